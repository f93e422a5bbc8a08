"""Throughput of one GRPO/ATR-GRPO step: rollout and update tokens/s, steps/s, per preset.

Not a test. Runs the real training step (`atrctl.train.rollout_step` / `update_step`) on a
freshly initialised preset saved as an ordinary model directory (no warm-up: untrained
models emit completions up to max_new_tokens, the worst case for sampling). For each preset,
atr and grpo steps alternate, so the atr/grpo ratio compares like with like in the same run.

    python benchmarks/step_throughput.py                      # tiny and medium, 2 threads
    python benchmarks/step_throughput.py --presets tiny --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from atrctl.advantages import group_advantages
from atrctl.config import load_recipe
from atrctl.models import build_char_tokenizer, build_model, set_cpu_threads
from atrctl.train import build_run, rollout_step, update_step


def timed_step(run, step: int) -> tuple[float, float, int, int]:
    """(rollout seconds, update seconds, generated tokens, tokens through the update) of one real step."""
    started = time.perf_counter()
    rollout, rewards, _ = rollout_step(run, step)
    advantages, _ = group_advantages(rewards, run.recipe.algo.advantage)
    sampled = time.perf_counter()
    update_step(run, rollout, advantages.flatten(), step)
    done = time.perf_counter()
    generated = int(rollout.completion_mask.sum())
    return sampled - started, done - sampled, generated, int(rollout.prompt_mask.sum()) + generated


def summarise(samples: list[tuple[float, float, int, int]], passes: int) -> dict[str, float]:
    rollout_s, update_s, generated, updated = (list(column) for column in zip(*samples, strict=True))
    step_s = [r + u for r, u in zip(rollout_s, update_s, strict=True)]
    return {
        "rollout tok/s": sum(generated) / sum(rollout_s),
        "update tok/s": sum(updated) * passes / sum(update_s),
        "steps/s": 1.0 / statistics.median(step_s),
        "median step s": statistics.median(step_s),
        "rollout share": sum(rollout_s) / sum(step_s),
    }


def measure(preset: str, steps: int, warmup: int, model_dir: Path, scratch: Path) -> dict[str, dict[str, float]]:
    """grpo and atr steps alternating on the same model and prompts, so their ratio is like for like."""
    runs = {}
    for loss in ("grpo", "atr"):
        recipe = load_recipe("recipes/default.toml", [f"model.base={model_dir}", f"algo.loss={loss}",
                                                      "model.device=cpu"])
        runs[loss] = build_run(recipe, scratch / f"{preset}-{loss}", scratch)
    samples = {loss: [] for loss in runs}
    for step in range(warmup + steps):
        for loss, run in runs.items():
            sample = timed_step(run, step)
            if step >= warmup:
                samples[loss].append(sample)
    return {loss: summarise(rows, runs[loss].recipe.algo.num_iterations) for loss, rows in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "medium"])
    parser.add_argument("--steps", type=int, default=10, help="measured steps per (preset, loss)")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    set_cpu_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch = default recipe "
          "(64 prompts x 8, 8 new tokens, 4 mini-batches)")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        for preset in args.presets:
            tokenizer = build_char_tokenizer()
            model_dir = scratch / preset
            build_model(preset, tokenizer, seed=0).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            rows = measure(preset, args.steps, args.warmup, model_dir, scratch)
            print(f"\n{preset}")
            print(f"  {'loss':5} {'rollout tok/s':>14} {'update tok/s':>13} {'steps/s':>8} {'rollout share':>14}")
            for loss, row in rows.items():
                print(f"  {loss:5} {row['rollout tok/s']:14.0f} {row['update tok/s']:13.0f} {row['steps/s']:8.2f} "
                      f"{row['rollout share']:14.0%}")
            ratio = rows["atr"]["median step s"] / rows["grpo"]["median step s"]
            print(f"  atr / grpo median step time: {ratio:.3f}")


if __name__ == "__main__":
    main()
