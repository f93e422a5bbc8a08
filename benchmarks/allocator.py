"""What keeping freed memory in the process (`atrctl.allocator.keep_freed_memory`) does to a training step.

Not a test.  The setting is process-wide, so the two arms live in two processes, built once each (compiling
included) and then stepping in turn: a worker runs one real training step (`atrctl.train.train_step`, the
default recipe on a fresh preset, every row trained) when told to and reports its time and its minor page
faults.  Only one worker computes at a time; which goes first alternates between pairs, and the ratio
(glibc's defaults / kept) is taken within each pair: median and 2.5-97.5% range over pairs.  Both workers
hold a model and its optimiser at once: presets up to medium (two 0.5B-shape workers exhaust 24 GB).

    python benchmarks/allocator.py --preset medium --set model.compile=true
    python benchmarks/allocator.py --preset tiny --set model.compile=true --set rollout.max_new_tokens=64
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from step_throughput import quantile  # benchmarks/ is on sys.path when run as a script

ARMS = ("glibc", "kept")  # the ratio is the first's time over the second's


def worker(args: argparse.Namespace) -> None:
    """Build the run, say "ready", then take one step per line read from stdin and print its record."""
    from fresh_models import EVERY_ROW, save_model  # benchmarks/ is on sys.path when run as a script

    import atrctl.allocator
    from atrctl.checkpoint import TrainState
    from atrctl.config import load_recipe
    from atrctl.train import STEP_PHASES, build_run, train_step

    if args.worker == "glibc":
        atrctl.allocator.keep_freed_memory = lambda: False  # build_run looks it up when called
    scratch = Path(tempfile.mkdtemp(prefix="atrctl-allocator-"))
    model_dir = save_model(args.preset, scratch)
    overrides = [f"model.base={model_dir}", "model.device=cpu", EVERY_ROW, "run.steps=100000", *args.set]
    run = build_run(load_recipe("recipes/default.toml", overrides), scratch / "run", scratch)
    for step in range(args.warmup):
        train_step(run, TrainState(step=step))
    print("ready", flush=True)
    step = args.warmup
    for _ in sys.stdin:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        record, _ = train_step(run, TrainState(step=step))
        seconds = time.perf_counter() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        phases = {phase: record[f"time/{phase}"] for phase in STEP_PHASES}
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB, Linux counts KiB
        print(json.dumps({"seconds": seconds, "faults": faults, "peak_mib": peak, **phases}), flush=True)
        step += 1


def spawn(arm: str, args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, __file__, "--worker", arm, "--preset", args.preset, "--warmup", str(args.warmup)]
    command += [f"--set={value}" for value in args.set]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def wait_ready(process: subprocess.Popen) -> None:
    for line in process.stdout:
        if line.strip() == "ready":
            return
    raise SystemExit(f"a worker stopped before it was ready (exit {process.wait()})")


def take_step(process: subprocess.Popen) -> dict:
    process.stdin.write("step\n")
    process.stdin.flush()
    return json.loads(process.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per worker (compiling included)")
    parser.add_argument("--set", action="append", default=[], help="recipe override shared by both arms")
    parser.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    workers = {}
    for arm in ARMS:  # one at a time: building and compiling are not measured, but they share the cores
        workers[arm] = spawn(arm, args)
        wait_ready(workers[arm])
    records = {arm: [] for arm in ARMS}
    for pair in range(args.pairs):
        for arm in ARMS if pair % 2 == 0 else ARMS[::-1]:
            records[arm].append(take_step(workers[arm]))
    for process in workers.values():
        process.stdin.close()
        process.wait()

    print(f"\n{args.preset} {' '.join(args.set)}: {args.pairs} pairs of steps, medians")
    phases = list(records["kept"][0])[3:]
    print(f"  {'arm':6} {'step ms':>8} {'faults':>8} {'peak MiB':>9} " + " ".join(f"{p:>9}" for p in phases))
    for arm, rows in records.items():
        cells = [f"{1e3 * statistics.median(r[key] for r in rows):9.1f}" for key in phases]
        print(
            f"  {arm:6} {1e3 * statistics.median(r['seconds'] for r in rows):8.1f}"
            f" {statistics.median(r['faults'] for r in rows):8.0f} {rows[-1]['peak_mib']:9.0f} " + " ".join(cells)
        )
    ratios = [a["seconds"] / b["seconds"] for a, b in zip(records["glibc"], records["kept"], strict=True)]
    print(
        f"  glibc/kept step time: {statistics.median(ratios):.3f}x"
        f" [{quantile(ratios, 0.025):.3f}, {quantile(ratios, 0.975):.3f}]"
    )


if __name__ == "__main__":
    main()
