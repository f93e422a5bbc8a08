"""What `run.rollback` costs: a training step with the host copy of weights and AdamW state against one without.

Not a test. Two runs of the default recipe on the same freshly initialised preset, one with run.rollback on
and one off, take their steps in turn in one process (which goes first alternates), so step k of one is
paired with step k of the other; the on/off ratio is the median of the paired step-time ratios, with the
range over pairs.

    python benchmarks/rollback_overhead.py                      # tiny and medium, 2 threads
    python benchmarks/rollback_overhead.py --presets medium --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from fresh_models import EVERY_ROW, save_model  # benchmarks/ is on sys.path when run as a script

from atrctl.checkpoint import TrainState
from atrctl.config import load_recipe
from atrctl.models import count_parameters, set_cpu_threads
from atrctl.train import build_run, train_step

SETTINGS = ("on", "off")


def measure(model_dir: Path, scratch: Path, steps: int, warmup: int) -> tuple[list[float], int]:
    """Paired on/off step-time ratios, and the model's parameter count."""
    runs = {}
    for setting in SETTINGS:
        rollback = f"run.rollback={'true' if setting == 'on' else 'false'}"
        sets = [f"model.base={model_dir}", "model.device=cpu", EVERY_ROW, rollback]
        runs[setting] = build_run(load_recipe("recipes/default.toml", sets), scratch / f"{setting}", scratch)
    times: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    for step in range(warmup + steps):
        for setting in SETTINGS if step % 2 == 0 else SETTINGS[::-1]:
            record, _ = train_step(runs[setting], TrainState(step=step))
            if step >= warmup:
                times[setting].append(record["time/step"])
    ratios = [on / off for on, off in zip(times["on"], times["off"], strict=True)]
    return ratios, count_parameters(runs["on"].model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "medium"])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per setting")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_cpu_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch = default recipe")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        for preset in args.presets:
            ratios, parameters = measure(save_model(preset, scratch), scratch, args.steps, args.warmup)
            spread = f"[{min(ratios):.3f}, {max(ratios):.3f}]"
            print(f"{preset} ({parameters:,} parameters): rollback on / off step time: median "
                  f"{statistics.median(ratios):.3f} over {len(ratios)} pairs {spread}")  # fmt: skip


if __name__ == "__main__":
    main()
