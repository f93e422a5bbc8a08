"""Where a training step's CPU time goes, operator by operator (torch.profiler).

Not a test. Runs a few real steps (`atrctl.training.step.train_step`) of the default recipe on a freshly
initialised preset, then profiles a few more and prints the step's phases and the operators with
the most self time.  This is the tool that found the work removed in issue 8: the recomputed old
logprobs, the prompt run once per completion instead of once per group, the per-tensor AdamW.
`--by-shape` lists the matrix products by shape instead, each with its achieved GFLOP/s against the peak
of a 2048³ product measured in the same process: how much of a step is products, and how far from the
limit they run (what decides whether a work-bound row can go faster at all).

    python benchmarks/profile_step.py                    # tiny, default recipe
    python benchmarks/profile_step.py --preset medium --set rollout.max_new_tokens=64
    python benchmarks/profile_step.py --preset medium --set model.compile=true --by-shape
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import EVERY_ROW, parse_with_smoke, save_model  # benchmarks/ is on sys.path when run as a script
from shapes import matmul_peak_gflops
from torch.profiler import ProfilerActivity, profile

from atrctl.config.loading import load_recipe
from atrctl.runtime.machine import set_cpu_threads
from atrctl.training.checkpoint import TrainState
from atrctl.training.setup import build_run
from atrctl.training.step import train_step
from atrctl.training.step_metrics import STEP_PHASES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--set", action="append", default=[], help="recipe override section.key=value")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps, after 3 unprofiled ones")
    parser.add_argument("--rows", type=int, default=25, help="operators to list")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--by-shape", action="store_true", help="matrix products by shape, with GFLOP/s")
    args = parse_with_smoke(
        parser,
        steps=1,
        rows=5,
        set=["rollout.prompts=4", "rollout.group_size=2", "rollout.max_new_tokens=4", "algo.minibatches=1"],
    )
    set_cpu_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        recipe = load_recipe(
            "recipes/default.toml",
            [f"model.base={save_model(args.preset, scratch)}", "model.device=cpu", EVERY_ROW, *args.set],
        )
        run = build_run(recipe, scratch / "run", scratch)
        for step in range(3):
            train_step(run, TrainState(step=step))
        with profile(activities=[ProfilerActivity.CPU], record_shapes=args.by_shape) as profiler:
            records = [train_step(run, TrainState(step=step))[0] for step in range(3, 3 + args.steps)]
    step_ms = statistics.fmean(r["time/step"] for r in records) * 1e3
    print(f"{args.preset}, {args.steps} profiled steps, mean {step_ms:.1f} ms per step (profiler overhead included)")
    for phase in STEP_PHASES:
        ms = statistics.fmean(r[f"time/{phase}"] for r in records) * 1e3
        print(f"  {phase:9} {ms:8.1f} ms {ms / step_ms:6.1%}")
    if args.by_shape:
        print_products(profiler, args.steps, step_ms, matmul_peak_gflops(), args.rows)
    else:
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


PRODUCTS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1)}  # op -> its two factors' inputs


def product_flops(op: str, shapes: list) -> int:
    """FLOPs of one call: 2·m·k·n, times the batch for bmm ([b, m, k] @ [b, k, n])."""
    a, b = (shapes[i] for i in PRODUCTS[op])
    batch = a[0] if op == "aten::bmm" else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def print_products(profiler, steps: int, step_ms: float, peak: float, rows: int) -> None:
    """Every matrix product's self time per step, by op and input shapes, with its achieved GFLOP/s."""
    found = []
    for event in profiler.key_averages(group_by_input_shape=True):
        if event.key in PRODUCTS and event.count:
            ms = event.self_cpu_time_total / 1e3 / steps
            flops = product_flops(event.key, event.input_shapes) * event.count / steps
            found.append((ms, event.key, event.input_shapes, event.count / steps, flops / ms / 1e6))
    found.sort(key=lambda row: -row[0])
    total_ms = sum(row[0] for row in found)
    total_gflop = sum(row[0] * row[4] / 1e3 for row in found)
    print(
        f"matrix products: {total_ms:.1f} ms a step ({total_ms / step_ms:.0%} of it), {total_gflop:.1f} GFLOP, "
        f"{total_gflop / total_ms * 1e3:.0f} GFLOP/s against a 2048³ product's {peak:.0f} here"
    )
    for ms, op, shapes, calls, gflops in found[:rows]:
        factors = " @ ".join(str(shapes[i]) for i in PRODUCTS[op])
        print(f"  {ms:8.1f} ms  {op:11} {factors:28} ×{calls:<5.0f} {gflops:5.0f} GFLOP/s ({gflops / peak:.0%})")


if __name__ == "__main__":
    main()
