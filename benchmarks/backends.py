"""Rollout tokens/s of the vllm backend against the hf sampler, and the whole training step, in alternating pairs.

    python benchmarks/backends.py --smollm2 models/smollm2          # needs vLLM (docs/backends.md)

Rollouts: the same prompts, group size and length through each backend, in float32 and under bf16, on
SmolLM2-135M-Instruct (its chat prompts; `atrctl import-gguf` writes the directory) and on a random model of
Qwen2.5-0.5B's shape (character vocabulary).  A pair times one generate call of each backend, the order
alternating; each backend is warmed up first.  Steps: two runs of recipes/smollm2-arith-cpu.toml on the same
base, one per backend, stepping in turn (`train_step`: rollout, π_old, update, weight sync).  Reported: each
backend's median [range] and the ratio vllm / hf per pair, median [range].  One vLLM engine lives at a time.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_with_smoke, qwen_half_b_shape, real_model, real_model_prompts, seconds  # noqa: E402

from atrctl.model.loading import build_char_tokenizer, build_model  # noqa: E402
from atrctl.model.numerics import Numerics  # noqa: E402
from atrctl.rollout.backend import rollout_backend  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def load(name: str, smollm2: Path | None):
    """(model, tokenizer, prompts) of a benchmark model."""
    if name == "smollm2-135m":
        model, tokenizer = real_model(str(smollm2))
        return model, tokenizer, real_model_prompts(tokenizer)
    tokenizer = build_char_tokenizer()
    model = qwen_half_b_shape(tokenizer) if name == "qwen2.5-0.5b-shape" else build_model(name, tokenizer, seed=0)
    prompts = [tokenizer(f"{a}+{b}=")["input_ids"] for a, b in zip(range(12, 92, 10), range(37, 117, 10), strict=True)]
    return model.eval(), tokenizer, prompts


def rollout_pairs(name: str, dtype: str, args) -> dict:
    """Tokens/s of each backend over `args.pairs` alternating pairs."""
    model, tokenizer, prompts = load(name, args.smollm2)
    device = torch.device(args.device)
    model, prompts = model.to(device), prompts[: args.prompts]
    compute = Numerics(device, torch.float32, torch.bfloat16 if dtype == "bfloat16" else None)
    backends = {b: rollout_backend(b, model, tokenizer, compute) for b in ("hf", "vllm")}
    settings = dict(repeats=args.group, max_new_tokens=args.tokens, temperature=1.0)

    def run(backend: str, seed: int) -> float:
        generator, out = torch.Generator(device).manual_seed(seed), []
        took = seconds(lambda: out.append(backends[backend].generate(prompts, generator=generator, **settings)))
        return float(out[0].completion_mask.sum()) / took

    for backend in backends:
        run(backend, 10_000)  # warm-up: vLLM's first batch, the allocator's first pages
    rates: dict[str, list[float]] = {"hf": [], "vllm": []}
    for pair in range(args.pairs):
        for backend in ("hf", "vllm") if pair % 2 == 0 else ("vllm", "hf"):
            rates[backend].append(run(backend, pair))
    backends.clear()
    gc.collect()  # the engine goes before the next one starts
    return rates


def step_pairs(args) -> dict:
    """Seconds per training step of the SmolLM2 recipe with each backend, stepping in turn."""
    from atrctl.config.loading import load_recipe
    from atrctl.training.checkpoint import TrainState
    from atrctl.training.setup import build_run
    from atrctl.training.step import train_step

    sets = [f"model.base={args.smollm2}", f"model.device={args.device}", *args.step_set]
    results = Path(tempfile.mkdtemp(prefix="atrctl-backends-"))
    runs = {
        b: build_run(
            load_recipe(REPO / "recipes" / "smollm2-arith-cpu.toml", [*sets, f"rollout.backend={b}"]),
            results / b,
            results,
        )  # fmt: skip
        for b in ("hf", "vllm")
    }
    times: dict[str, list[float]] = {"hf": [], "vllm": []}
    for step in range(args.steps + 1):  # step 0 warms up each run
        for backend in ("hf", "vllm") if step % 2 == 0 else ("vllm", "hf"):
            metrics, _ = train_step(runs[backend], TrainState(step=step))
            if step:
                times[backend].append(metrics["time/step"])
                times.setdefault(f"{backend} rollout", []).append(metrics["time/rollout"])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct's directory (atrctl import-gguf)")
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b-shape")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="training-step pairs on SmolLM2 (0: none)")
    parser.add_argument("--step-set", nargs="*", default=[], help="recipe overrides of the step runs")
    args = parse_with_smoke(parser, models="small", dtypes="float32", pairs=1, prompts=2, group=2, tokens=4, steps=0)
    models = args.models.split(",")
    if ("smollm2-135m" in models or args.steps) and args.smollm2 is None:
        parser.error("--smollm2 DIR is needed for SmolLM2 (atrctl import-gguf …/SmolLM2-135M-Instruct.Q4_1.gguf)")
    torch.manual_seed(0)
    print(f"| model | dtype | hf tokens/s | vllm tokens/s | vllm / hf per pair ({args.pairs} pairs) |")
    print("|---|---|---|---|---|")
    for name in models:
        for dtype in args.dtypes.split(","):
            rates = rollout_pairs(name, dtype, args)
            ratios = [v / h for h, v in zip(rates["hf"], rates["vllm"], strict=True)]
            print(f"| {name} | {dtype} | {spread(rates['hf'])} | {spread(rates['vllm'])} | {spread(ratios)} |")
    if args.steps:
        times = step_pairs(args)
        ratios = [v / h for h, v in zip(times["hf"], times["vllm"], strict=True)]
        print(f"\n| SmolLM2 step ({args.steps} pairs) | hf s | vllm s | vllm / hf |\n|---|---|---|---|")
        print(f"| whole step | {spread(times['hf'])} | {spread(times['vllm'])} | {spread(ratios)} |")
        rollout = [v / h for h, v in zip(times["hf rollout"], times["vllm rollout"], strict=True)]
        print(f"| its rollout | {spread(times['hf rollout'])} | {spread(times['vllm rollout'])} | {spread(rollout)} |")


if __name__ == "__main__":
    main()
