"""Throughput of one GRPO/ATR-GRPO step per preset, and what ATR's trust region costs against GRPO's.

Not a test. Runs the real training step (`atrctl.training.step.train_step`) on a freshly initialised
preset saved as an ordinary model directory (no warm-up: an untrained model's completions end at
random, `common`), with the default recipe's batch.  For each preset an
atr run and a grpo run take their steps in turn, in the same process, so step k of one is paired
with step k of the other under the same machine conditions; the atr/grpo ratio is the median of
the paired ratios, with its 2.5-97.5% range over pairs.  `--arms autocast` pairs float32 against bf16
autocast instead (same loss, atr): the choice `model.autocast = auto` makes on a bf16-native CPU;
`--arms compile` eager against `model.compile = true` (compiled in the unmeasured steps).  `--set`
changes the shared recipe (e.g. rollout.max_new_tokens=64).

    python benchmarks/step_throughput.py                      # tiny and medium, 2 threads
    python benchmarks/step_throughput.py --presets tiny --steps 60
    python benchmarks/step_throughput.py --arms autocast      # bf16 / float32 step time
    python benchmarks/step_throughput.py --arms compile --set rollout.max_new_tokens=64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from common import EVERY_ROW, parse_with_smoke, save_model  # benchmarks/ is on sys.path when run as a script

from atrctl.config.loading import load_recipe
from atrctl.runtime.machine import set_cpu_threads
from atrctl.training.checkpoint import TrainState
from atrctl.training.setup import build_run
from atrctl.training.step import train_step
from atrctl.training.step_metrics import STEP_PHASES

ARMS = {  # the two arms of a comparison, and the recipe overrides that make each; the ratio is second / first
    "losses": {"grpo": ["algo.loss=grpo"], "atr": ["algo.loss=atr"]},
    "autocast": {"float32": ["model.autocast=off"], "bf16": ["model.autocast=bfloat16"]},
    "compile": {"eager": ["model.compile=false"], "compiled": ["model.compile=true"]},
}


def measure(
    model_dir: Path, scratch: Path, steps: int, warmup: int, arms: dict, shared: list[str]
) -> dict[str, list[dict]]:
    """Each arm's step records, steps alternating between the arms (which goes first alternates too)."""
    runs = {}
    for name, overrides in arms.items():
        recipe = load_recipe(
            "recipes/default.toml",
            [
                f"model.base={model_dir}",
                "model.device=cpu",
                EVERY_ROW,
                f"run.steps={warmup + steps}",
                *shared,
                *overrides,
            ],
        )
        runs[name] = build_run(recipe, scratch / f"{model_dir.name}-{name}", scratch)
    names = list(runs)
    records = {name: [] for name in names}
    for step in range(warmup + steps):
        for name in names if step % 2 == 0 else names[::-1]:
            record, _ = train_step(runs[name], TrainState(step=step))
            if step >= warmup:
                records[name].append(record)
    return records


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def report(preset: str, records: dict[str, list[dict]]) -> None:
    print(f"\n{preset}")
    print(
        f"  {'arm':7} {'steps/s':>8} {'gen tok/s':>10} "
        + " ".join(f"{p:>9}" for p in STEP_PHASES)
        + f" {'other':>9}  (mean ms per step)"
    )
    for name, rows in records.items():
        step_s = statistics.median(r["time/step"] for r in rows)
        phases = [statistics.fmean(r[f"time/{p}"] for r in rows) for p in STEP_PHASES]
        other = statistics.fmean(r["time/step"] for r in rows) - sum(phases)
        generated = sum(r["tokens_per_s"] * r["time/step"] for r in rows) / sum(r["time/step"] for r in rows)
        print(
            f"  {name:7} {1 / step_s:8.2f} {generated:10.0f} "
            + " ".join(f"{p * 1e3:9.1f}" for p in phases)
            + f" {other * 1e3:9.1f}"
        )
    first, second = records
    ratios = [b["time/step"] / a["time/step"] for a, b in zip(records[first], records[second], strict=True)]
    print(
        f"  {second} / {first} step time: median {statistics.median(ratios):.3f} over {len(ratios)} paired steps "
        f"[{quantile(ratios, 0.025):.3f}, {quantile(ratios, 0.975):.3f}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "medium"])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per (preset, arm)")
    parser.add_argument("--arms", choices=list(ARMS), default="losses", help="what the two arms differ in")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="recipe override for both arms, section.key=value")
    args = parse_with_smoke(
        parser,
        presets=["tiny"],
        steps=1,
        warmup=0,
        set=["rollout.prompts=4", "rollout.group_size=2", "rollout.max_new_tokens=4", "algo.minibatches=1"],
    )
    set_cpu_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch = default recipe "
        f"(64 prompts x 8, 8 new tokens, 4 mini-batches){''.join(' ' + o for o in args.set)}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        for preset in args.presets:
            report(
                preset,
                measure(save_model(preset, scratch), scratch, args.steps, args.warmup, ARMS[args.arms], args.set),
            )


if __name__ == "__main__":
    main()
