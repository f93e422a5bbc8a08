"""How atrctl's step time grows with group size and completion length; on a GPU, tokens/s and MFU.

Not a test. Runs the real training step (`atrctl.training.step.train_step`) on freshly initialised models
whose EOS logit is pushed down by 30 (a hook on the output layer, for sampling and training
alike), so every completion is exactly max_new_tokens long and "T" means T tokens.  For each
preset and (G, T) cell: the median step time over a few steps after an unmeasured one, tokens/s,
the share spent sampling, and the step time per generated token relative to the grid's first
cell (1.00 = the step grows exactly linearly with the tokens generated).

    python benchmarks/scaling.py                               # tiny and medium on CPU, 8 prompts
    python benchmarks/scaling.py --presets tiny --groups 4 8 --lengths 16 64
    python benchmarks/scaling.py --no-cpu --gpu --gpu-models qwen2.5-0.5b-shape --set algo.micro_batch=3

When CUDA is present (or with --gpu) it also runs the GPU section: bf16 autocast, medium and a
model of Qwen2.5-0.5B's shape built from its config (24 layers, hidden 896, 14 heads, 2 KV heads,
the character vocabulary), reporting tokens/s and model FLOP utilisation: achieved model FLOPs
(2·N per token forward, 6·N forward+backward; N = the parameters that multiply, i.e. all but an
untied input embedding; attention's O(context) term left out, ~2% at these lengths) over the GPU's
peak dense bf16 FLOP/s.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from common import (  # benchmarks/ is on sys.path when run as a script
    EVERY_ROW,
    QWEN_HALF_B_SHAPE,
    parse_with_smoke,
    save_model,
)

from atrctl.config.loading import load_recipe
from atrctl.runtime.machine import set_cpu_threads
from atrctl.training.checkpoint import TrainState
from atrctl.training.setup import build_run
from atrctl.training.step import recomputes_old_logprobs, train_step

EOS_PENALTY = 30.0
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}


def suppress_eos(run) -> None:
    shift = torch.zeros(run.model.config.vocab_size, device=run.device)
    shift[run.tokenizer.eos_token_id] = -EOS_PENALTY
    run.model.lm_head.register_forward_hook(lambda module, args, out: out + shift.to(out.dtype))


def flop_parameters(model) -> int:
    """Parameters that cost 2 FLOPs per token forward: all but the input embedding (a lookup), plus the
    output projection when it is tied to that embedding."""
    embedding = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    return total if model.config.tie_word_embeddings else total - embedding


def model_flops_per_step(run, generated: float, prompts: int, prompt_tokens: int) -> float:
    """Model FLOPs of one step as atrctl runs it: sampling (prefill once per prompt, one forward per
    generated token), old logprobs when recomputed (a forward of every mini-batch but the first), and μ
    passes of forward + backward (the prompt once per group)."""
    n, tokens = flop_parameters(run.model), prompts * prompt_tokens + generated
    minibatches = run.recipe.algo.minibatches
    recomputed = recomputes_old_logprobs(run.recipe.algo, run.sampler) * (minibatches - 1) / minibatches
    return 2 * n * tokens * (1 + recomputed) + 6 * n * tokens * run.recipe.algo.num_iterations


def measure(
    model_dir: Path,
    scratch: Path,
    device: str,
    prompts: int,
    group: int,
    length: int,
    steps: int,
    minibatches: int,
    overrides: list[str],
) -> dict[str, float]:
    recipe = load_recipe(
        "recipes/default.toml",
        [
            f"model.base={model_dir}",
            f"model.device={device}",
            EVERY_ROW,
            f"rollout.prompts={prompts}",
            f"rollout.group_size={group}",
            f"rollout.max_new_tokens={length}",
            f"algo.minibatches={minibatches}",
            f"run.steps={steps + 1}",
            *overrides,
        ],
    )
    run = build_run(recipe, scratch / f"{model_dir.name}-{group}-{length}", scratch)
    suppress_eos(run)
    records = []
    for step in range(steps + 1):
        record, _ = train_step(run, TrainState(step=step))
        if step:
            records.append(record)
    step_s = statistics.median(r["time/step"] for r in records)
    tokens = statistics.fmean(r["len/mean"] for r in records) * prompts * group
    return {
        "parameters": flop_parameters(run.model),
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "rollout_share": statistics.fmean(r["time/rollout"] / r["time/step"] for r in records),
        "per_token_ms": step_s / tokens * 1e3,
        "mean_length": tokens / (prompts * group),
        "flops": model_flops_per_step(run, tokens, prompts, len(run.pool_ids[0])) / step_s,
    }


def cpu_grid(args: argparse.Namespace, scratch: Path) -> None:
    for preset in args.presets:
        model_dir = save_model(preset, scratch)
        cells = {
            (g, t): measure(model_dir, scratch, "cpu", args.prompts, g, t, args.steps, args.minibatches, args.set)
            for g in args.groups
            for t in args.lengths
        }
        base = cells[args.groups[0], args.lengths[0]]["per_token_ms"]
        print(
            f"\n{preset}, CPU {torch.get_num_threads()} threads, {args.prompts} prompts, {args.minibatches} "
            f"mini-batches: median step seconds (tokens/s, sampling share, time per token vs first cell)"
        )
        print("| G \\ T | " + " | ".join(str(t) for t in args.lengths) + " |")
        print("|---|" + "---|" * len(args.lengths))
        for g in args.groups:
            row = [cells[g, t] for t in args.lengths]
            print(
                f"| {g} | "
                + " | ".join(
                    f"{c['step_s']:.3f} s ({c['tokens_per_s']:.0f} tok/s, "
                    f"{c['rollout_share']:.0%}, {c['per_token_ms'] / base:.2f}x)"
                    for c in row
                )
                + " |"
            )
        lengths = {round(c["mean_length"], 1) for c in cells.values()}
        print(f"completion lengths seen: {sorted(lengths)} (each cell's T: EOS suppressed)")


def gpu_section(args: argparse.Namespace, scratch: Path) -> None:
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    print(
        f"\nGPU: {name}, bf16 autocast, {args.gpu_prompts} prompts x {args.gpu_group}, "
        f"max_new_tokens {args.gpu_length}, {args.minibatches} mini-batches" + "".join(f", {item}" for item in args.set)
    )
    print("| model | parameters | step s | tokens/s | sampling share | model TFLOP/s | MFU | peak GPU memory |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.gpu_models:
        model_dir = save_model(model, scratch)
        torch.cuda.reset_peak_memory_stats()
        cell = measure(
            model_dir,
            scratch,
            "cuda",
            args.gpu_prompts,
            args.gpu_group,
            args.gpu_length,
            args.steps,
            args.minibatches,
            args.set,
        )
        mfu = f"{cell['flops'] / (peak * 1e12):.1%}" if peak else "n/a (give --peak-tflops)"
        print(
            f"| {model} | {cell['parameters'] / 1e6:.1f}M | {cell['step_s']:.3f} | {cell['tokens_per_s']:.0f} | "
            f"{cell['rollout_share']:.0%} | {cell['flops'] / 1e12:.1f} | {mfu} | "
            f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "medium"])
    parser.add_argument("--groups", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--lengths", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per cell, after one unmeasured")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="run the GPU section (default: when CUDA is present)")
    parser.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=True, help="run the CPU grid")
    parser.add_argument("--gpu-models", nargs="+", default=["tiny", "medium", QWEN_HALF_B_SHAPE])
    parser.add_argument("--gpu-prompts", type=int, default=64)
    parser.add_argument("--gpu-group", type=int, default=8)
    parser.add_argument("--gpu-length", type=int, default=256)
    parser.add_argument(
        "--set", action="append", default=[], help="a recipe override (repeatable), e.g. algo.micro_batch=3"
    )
    parser.add_argument("--peak-tflops", type=float, help="the GPU's peak dense bf16 TFLOP/s, if not in the table")
    args = parse_with_smoke(
        parser, presets=["tiny"], groups=[2], lengths=[4], prompts=2, minibatches=1, steps=1, gpu=False
    )
    set_cpu_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        if args.cpu:
            cpu_grid(args, Path(scratch))
        if args.gpu or torch.cuda.is_available():
            gpu_section(args, Path(scratch))


if __name__ == "__main__":
    main()
