"""A few training steps of a sharded (FSDP2) or LoRA policy: step time, tokens/s, MFU and peak memory per rank.

Not a test.  Meant for a GPU machine (`benchmarks/gpu_check.sh shard` runs it), and runs anywhere: under
torch.distributed.run with N processes the policy is sharded over them (`model.shard = "fsdp"`; nccl on
CUDA, gloo on the CPU); with --lora it trains LoRA adapters in one process.  The model is a preset or a
random model of a real checkpoint's shape (`common.py`), EOS is suppressed so every completion is
--length tokens long, and the first step is not measured (allocation, kernel selection).

    torchrun --nproc-per-node 8 benchmarks/shard_check.py --model qwen2.5-0.5b-shape     # sharded over 8 GPUs
    python benchmarks/shard_check.py --model qwen2.5-0.5b-shape --lora                    # LoRA on one GPU
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/shard_check.py --device cpu --model tiny
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import parse_with_smoke, save_model  # noqa: E402
from scaling import EOS_PENALTY, PEAK_BF16_TFLOPS, model_flops_per_step  # noqa: E402

from atrctl.config.loading import load_recipe  # noqa: E402
from atrctl.runtime import distributed  # noqa: E402
from atrctl.training.checkpoint import TrainState  # noqa: E402
from atrctl.training.setup import build_run
from atrctl.training.step import train_step  # noqa: E402


def suppress_eos(run) -> None:
    sampled = getattr(run.sampler, "full_copy", run.model)
    for model in {id(run.model): run.model, id(sampled): sampled}.values():
        shift = torch.zeros(model.config.vocab_size, device=run.device)
        shift[run.tokenizer.eos_token_id] = -EOS_PENALTY
        model.get_output_embeddings().register_forward_hook(lambda module, a, out, s=shift: out + s.to(out.dtype))


@contextlib.contextmanager
def _nothing():
    yield None


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: allocated GPU memory on CUDA, else the peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmHWM:")).split()[1]) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-0.5b-shape", help="a preset or qwen2.5-0.5b-shape (random weights)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--lora", action="store_true", help="LoRA adapters (r = 16) in one process, not sharded")
    parser.add_argument("--prompts", type=int, default=0, help="default: ~16, a multiple of 2 x processes")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="measured steps, after one unmeasured")
    parser.add_argument("--scratch", default="/tmp", help="where the model and the run are written (then deleted)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="the GPU's dense bf16 peak, for MFU")
    args = parse_with_smoke(parser, model="tiny", device="cpu", lora=True, group=2, length=4, micro_batch=0, steps=1)

    world = distributed.world_size()
    args.prompts = args.prompts or 2 * world * max(1, 8 // world)  # 2 mini-batches, whole groups on every rank
    shard = "none" if args.lora else "fsdp"
    sets = [
        f"model.device={args.device}",
        f"model.shard={shard}",
        "algo.skip_zero_advantage=false",  # every row trains: the work is the same whatever the rewards
        f"rollout.prompts={args.prompts}",
        f"rollout.group_size={args.group}",
        f"rollout.max_new_tokens={args.length}",
        f"algo.micro_batch={args.micro_batch}",
        "algo.minibatches=2",
        "model.gradient_checkpointing=true",
        f"run.steps={args.steps + 1}",
    ]
    if args.lora:
        sets.append("model.lora={r = 16}")
    with tempfile.TemporaryDirectory(dir=args.scratch) if distributed.is_main() else _nothing() as mine:
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else args.device)
        with distributed.process_group(device):
            scratch = Path(distributed.all_gather_objects(mine)[0])  # rank 0's folder: every rank reads the model
            model_dir = scratch / args.model
            with distributed.main_first():
                if distributed.is_main():
                    save_model(args.model, scratch)
            recipe = load_recipe("recipes/default.toml", [*sets, f"model.base={model_dir}"])
            run = build_run(recipe, scratch / "run", scratch)
            suppress_eos(run)  # in the policy and in the copy a sharded policy samples
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            records = [train_step(run, TrainState(step=step))[0] for step in range(args.steps + 1)][1:]
            peaks = distributed.all_gather_objects(peak_memory_gib(run.device))
            if not distributed.is_main():
                return
            step_s = statistics.median(r["time/step"] for r in records)
            tokens = statistics.fmean(r["len/mean"] for r in records) * args.prompts * args.group
            flops = model_flops_per_step(run, tokens, args.prompts, len(run.pool_ids[0])) / step_s
            name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
            peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
            mfu = f"{flops / (peak * 1e12 * world):.1%}" if peak else "n/a (give --peak-tflops)"
            how = "LoRA r = 16, one process" if args.lora else f"FSDP2 over {world} processes"
            print(f"{args.model} on {name}, {how}: {args.prompts} prompts x {args.group}, {args.length} new tokens")
            print(f"step {step_s:.2f} s, {tokens / step_s:,.0f} tokens/s, {flops / 1e12:.2f} model TFLOP/s, MFU {mfu}")
            print("peak memory per rank: " + ", ".join(f"{p:.1f} GiB" for p in peaks), flush=True)


if __name__ == "__main__":
    main()
