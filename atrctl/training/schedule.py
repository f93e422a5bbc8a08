"""What a step trains on and at which learning rate: pure functions of the step, so a resumed run draws exactly
the prompts and rates it would have."""

from __future__ import annotations

import functools
import math

import torch

from atrctl.core.seeds import derive_seed

PROMPT_POOL = 20_000  # distinct train prompts cycled through in a seeded order


def lr_at(step: int, lr: float, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Learning rate of optimiser step `step` (0-based): linear warm-up, then constant or cosine to 10%."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def prompts_for_step(pool_size: int, step: int, prompts: int, seed: int) -> list[int]:
    """Indices into the prompt pool for one step: epochs of seeded permutations, a pure function of step."""
    indices = []
    for position in range(step * prompts, (step + 1) * prompts):
        epoch, offset = divmod(position, pool_size)
        indices.append(_epoch_order(pool_size, epoch, seed)[offset])
    return indices


@functools.lru_cache(maxsize=4)
def _epoch_order(pool_size: int, epoch: int, seed: int) -> tuple[int, ...]:
    """The pool's order in one epoch; kept, since every step of the epoch reads it (drawn per step, the default
    recipe's permutation took ~1.5 ms, ~1% of a tiny model's step)."""
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch))
    return tuple(torch.randperm(pool_size, generator=generator).tolist())
