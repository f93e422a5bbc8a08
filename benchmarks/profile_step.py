"""Where a training step's CPU time goes, operator by operator (torch.profiler).

Not a test. Runs a few real steps (`atrctl.train.train_step`) of the default recipe on a freshly
initialised preset, then profiles a few more and prints the step's phases and the operators with
the most self time.  This is the tool that found the work removed in issue 8: the recomputed old
logprobs, the prompt run once per completion instead of once per group, the per-tensor AdamW.

    python benchmarks/profile_step.py                    # tiny, default recipe
    python benchmarks/profile_step.py --preset medium --set rollout.max_new_tokens=64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from fresh_models import EVERY_ROW, save_model  # benchmarks/ is on sys.path when run as a script
from torch.profiler import ProfilerActivity, profile

from atrctl.checkpoint import TrainState
from atrctl.config import load_recipe
from atrctl.models import set_cpu_threads
from atrctl.train import STEP_PHASES, build_run, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--set", action="append", default=[], help="recipe override section.key=value")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps, after 3 unprofiled ones")
    parser.add_argument("--rows", type=int, default=25, help="operators to list")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
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
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            records = [train_step(run, TrainState(step=step))[0] for step in range(3, 3 + args.steps)]
    step_ms = statistics.fmean(r["time/step"] for r in records) * 1e3
    print(f"{args.preset}, {args.steps} profiled steps, mean {step_ms:.1f} ms per step (profiler overhead included)")
    for phase in STEP_PHASES:
        ms = statistics.fmean(r[f"time/{phase}"] for r in records) * 1e3
        print(f"  {phase:9} {ms:8.1f} ms {ms / step_ms:6.1%}")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
