"""Group-relative advantages: each completion is scored against the other completions of its prompt.

Rewards come shaped [prompts, G] (G completions per prompt); the advantage of a
completion is one number, shared by all of its tokens.  A group whose rewards are all
equal carries no learning signal: its advantages are exactly 0 and it is counted in
`frac_zero_std`, the share of the batch that was sampled for nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

STD_EPS = 1e-6  # added to the group std so a near-constant group does not explode


def _grpo(rewards: Tensor) -> Tensor:
    """(r - mean) / (std + 1e-6), std with Bessel's correction as in TRL and verl (DeepSeekMath GRPO)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return centred / (rewards.std(dim=1, keepdim=True) + STD_EPS)


def _drgrpo(rewards: Tensor) -> Tensor:
    """r - mean: Dr. GRPO (Liu et al., 2025) drops the std, which up-weights easy and hard prompts."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def _rloo(rewards: Tensor) -> Tensor:
    """r_i - mean of the other G-1 rewards (REINFORCE leave-one-out, Ahmadian et al., 2024): unbiased."""
    group = rewards.shape[1]
    return (rewards - rewards.mean(dim=1, keepdim=True)) * (group / (group - 1))


ADVANTAGE_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"grpo": _grpo, "drgrpo": _drgrpo, "rloo": _rloo}


def group_advantages(rewards, estimator: str = "grpo") -> tuple[Tensor, float]:
    """Advantages [prompts, G] (float32) and the fraction of groups with zero reward spread.

    `rewards` is anything torch.as_tensor accepts, shaped [prompts, G] with G >= 2 (a
    group of one has no baseline).  Flatten the result row-major to line it up with
    completions ordered prompt by prompt.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be shaped [prompts, G] with G >= 2, got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    flat = rewards.amax(dim=1) == rewards.amin(dim=1)
    advantages = torch.where(flat[:, None], 0.0, ADVANTAGE_ESTIMATORS[estimator](rewards))
    frac_zero_std = flat.float().mean().item() if len(flat) else 0.0
    return advantages, frac_zero_std
