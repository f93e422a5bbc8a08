"""Under bf16, may the update reuse the sampler's logprobs as the old ones?  Measured on a real model.

Not a test.  Under bf16 autocast the sampler's logprobs (KV-cache decoding, one position at a time) round
apart from the training pass's (all positions at once), so `algo.old_logprobs = auto` used to recompute
them there.  This measures, on the rollouts of a real recipe (default: SmolLM2-135M-Instruct on
`recipes/smollm2-arith-cpu.toml`, imported as docs/usage.md says), what reusing them changes against that
and against the float32 truth.  Each rollout is sampled once, by the bf16 run; three copies of the same
weights and AdamW state then take the same update on it:

- fp32: autocast off, old logprobs recomputed in float32 — the arithmetic both bf16 arms approximate;
- recompute: bf16, old logprobs from a bf16 training pass (the first mini-batch's own, the rest recomputed);
- sampler: bf16, old logprobs = the bf16 sampler's.

Per rollout it reports, over the completion tokens: |Δ logprob| between the bf16 sampler and the bf16
training pass (what the reused denominator carries) and between the bf16 and the float32 pass (what bf16
itself costs), with the share of tokens whose exp(Δ) alone leaves the loss's trust region; and, per
mini-batch, the cosine between each bf16 arm's gradient (as AdamW receives it, after clipping) and the
float32 arm's, and how far each arm's weights land from the float32 arm's after the whole update,
relative to the float32 update's size.  The bf16 run then steps on (recompute arm) and samples again.

    python benchmarks/old_logprobs_bf16.py                      # 6 rollouts of the SmolLM2 recipe
    python benchmarks/old_logprobs_bf16.py --rollouts 3 --set rollout.max_new_tokens=96
    python benchmarks/old_logprobs_bf16.py --round-to-bf16   # weights on the bf16 grid first

`--round-to-bf16` starts from the weights rounded to bf16, as a checkpoint stored in bf16 holds them: the
GGUF import's dequantised Q4_1 values put about 8% of its weights exactly halfway between two bf16
numbers, where the first update's tiny step flips their rounding all in the gradient's direction.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from atrctl.advantages import group_advantages
from atrctl.config import load_recipe
from atrctl.divergence import trust_region
from atrctl.forward import completion_logprobs_and_entropy
from atrctl.train import build_run, rollout_step, update_step

ARMS = {  # name: the overrides that make it
    "fp32": ["model.autocast=off", "algo.old_logprobs=recompute"],
    "recompute": ["model.autocast=bfloat16", "algo.old_logprobs=recompute"],
    "sampler": ["model.autocast=bfloat16", "algo.old_logprobs=sampler"],
}


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten().float() for t in tensors])


def record_gradients(run) -> list[torch.Tensor]:
    """Have `run`'s optimiser keep each step's gradient (as it receives it: clipped) in the returned list."""
    kept, step = [], run.optimizer.step
    params = [p for group in run.optimizer.param_groups for p in group["params"]]

    def recording_step(*args, **kwargs):
        kept.append(flat(p.grad for p in params))
        return step(*args, **kwargs)

    run.optimizer.step = recording_step
    return kept


def bf16_ties(model) -> float:
    """Share of the float32 weights that lie exactly halfway between two bf16 numbers (low 16 bits 0x8000)."""
    weights = [p.detach().flatten().float() for p in model.parameters()]
    ties = sum(((w.view(torch.int32) & 0xFFFF) == 0x8000).sum().item() for w in weights)
    return ties / sum(w.numel() for w in weights)


def token_gaps(runs, rollout, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion token, at the sampling weights: bf16 sampler − bf16 pass, bf16 pass − float32 pass."""
    mask = rollout.completion_mask.bool()
    with torch.no_grad():
        with runs["recompute"].numerics.autocast():
            bf16 = completion_logprobs_and_entropy(runs["recompute"].model, rollout, temperature)[0]
        fp32 = completion_logprobs_and_entropy(runs["fp32"].model, rollout, temperature)[0]
    return (rollout.logprobs - bf16)[mask], (bf16 - fp32)[mask]


def outside(gap: torch.Tensor, low: float, high: float) -> float:
    ratio = gap.double().exp()
    return ((ratio < low) | (ratio > high)).double().mean().item()


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """nan where the float32 gradient is 0 (a mini-batch whose groups all have one reward trains no row)."""
    if not b.any():
        return float("nan")
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def summary(values: list[float]) -> str:
    """Median [min, max] of the defined values (a mini-batch without trained rows has none)."""
    values = [v for v in values if v == v]
    if not values:
        return "none"
    return f"{statistics.median(values):.4f} [{min(values):.4f}, {max(values):.4f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/smollm2-arith-cpu.toml")
    parser.add_argument("--rollouts", type=int, default=6, help="rollouts compared (those with reward variance)")
    parser.add_argument("--set", action="append", default=[], help="recipe override, as atrctl's --set")
    parser.add_argument("--round-to-bf16", action="store_true", help="start from the weights rounded to bf16")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="old-logprobs-"))
    runs = {}
    for name, overrides in ARMS.items():
        recipe = load_recipe(args.recipe, [*args.set, *overrides])
        runs[name] = build_run(recipe, scratch / name, scratch)
    lead, recipe = runs["recompute"], runs["recompute"].recipe
    if args.round_to_bf16:  # the other arms copy the lead's weights before every update
        with torch.no_grad():
            for parameter in lead.model.parameters():
                parameter.copy_(parameter.bfloat16())
    low, high = trust_region(recipe.algo.loss, **recipe.algo.args)
    temperature = recipe.rollout.temperature
    kept = {name: record_gradients(run) for name, run in runs.items()}
    print(
        f"{recipe.model.base}, {recipe.rollout.prompts}x{recipe.rollout.group_size} rows, "
        f"<= {recipe.rollout.max_new_tokens} new tokens, {recipe.algo.minibatches} mini-batches, "
        f"{recipe.algo.loss} region [{low:.4f}, {high:.4f}], lr {recipe.optim.lr}; "
        f"{bf16_ties(lead.model):.2%} of the weights on a bf16 rounding tie"
    )
    print(
        "| step | tokens | sampler − bf16 pass: mean / p99 / max | outside | bf16 − fp32 pass: mean / p99 / max "
        "| outside | grad cosine to fp32 per mini-batch: recompute; sampler | weights' distance to fp32's: "
        "recompute; sampler |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows, step = [], 0
    while len(rows) < args.rollouts:
        rollout, rewards, _ = rollout_step(lead, step)
        advantages = group_advantages(rewards, recipe.algo.advantage)[0].flatten()
        step += 1
        if not advantages.any():
            continue  # nothing to train on: every arm would take the same zero step
        for name, run in runs.items():  # every arm starts from the weights that sampled
            if run is not lead:
                run.model.load_state_dict(lead.model.state_dict())
                run.optimizer.load_state_dict(lead.optimizer.state_dict())
            kept[name].clear()
        sampler_gap, dtype_gap = token_gaps(runs, rollout, temperature)
        start = flat(lead.model.parameters())
        weights = {}
        for name in ("fp32", "sampler", "recompute"):  # the lead last: it carries the trajectory on
            update_step(runs[name], rollout, advantages, step - 1)
            weights[name] = flat(runs[name].model.parameters())
        lead.sampler.load_weights(lead.model)
        moved = (weights["fp32"] - start).norm()
        cosines = {
            name: [cosine(g, g32) for g, g32 in zip(kept[name], kept["fp32"], strict=True)]
            for name in ("recompute", "sampler")
        }
        distance = {name: ((weights[name] - weights["fp32"]).norm() / moved).item() for name in cosines}
        row = {
            "sampler_gap": sampler_gap.abs(),
            "dtype_gap": dtype_gap.abs(),
            "outside_sampler": outside(sampler_gap, low, high),
            "outside_dtype": outside(dtype_gap, low, high),
            "cosines": cosines,
            "distance": distance,
        }
        rows.append(row)

        def spread(gap: torch.Tensor) -> str:
            return f"{gap.mean():.1e} / {gap.quantile(0.99):.1e} / {gap.max():.2e}"

        def per_minibatch(values: list[float]) -> str:
            return ", ".join(f"{v:.4f}" for v in values)

        print(
            f"| {step} | {sampler_gap.numel()} | {spread(row['sampler_gap'])} | {row['outside_sampler']:.1e} | "
            f"{spread(row['dtype_gap'])} | {row['outside_dtype']:.1e} | "
            f"{per_minibatch(cosines['recompute'])}; {per_minibatch(cosines['sampler'])} | "
            f"{distance['recompute']:.3f}; {distance['sampler']:.3f} |",
            flush=True,
        )
    every = {key: torch.cat([row[key] for row in rows]) for key in ("sampler_gap", "dtype_gap")}
    print(
        f"\nall {every['sampler_gap'].numel()} tokens: sampler − bf16 pass mean {every['sampler_gap'].mean():.1e}, "
        f"max {every['sampler_gap'].max():.2e}; bf16 − fp32 pass mean {every['dtype_gap'].mean():.1e}, "
        f"max {every['dtype_gap'].max():.2e}"
    )
    for name in ("recompute", "sampler"):
        first, last = ([row["cosines"][name][i] for row in rows] for i in (0, -1))
        distance = [row["distance"][name] for row in rows]
        print(
            f"{name}: grad cosine to fp32, first mini-batch {summary(first)}, last {summary(last)}; "
            f"weights' distance to fp32's / fp32's step {summary(distance)}"
        )


if __name__ == "__main__":
    main()
