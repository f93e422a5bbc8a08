"""The trainer–sampler mismatch as one more policy divergence, and its corrections.

An engine samples from its own behaviour policy μ (other kernels, other rounding, bf16, top-p), not from
π_old, the policy the trainer's forward pass computes with the same weights.  Per token the mismatch is the
ratio m = π_old / μ, and every trust-region measure of `atrctl.core.divergence` applies to it as it does to
w = π_θ / π_old: KL3(m) = m - 1 - ln m has mean KL(μ || π_old) under the tokens μ drew.  A correction turns
m into a weight of each token's policy term: truncated importance weights (TIS) reweight toward π_old, masks
drop the tokens or sequences whose mismatch exceeds δ under a registered measure.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from atrctl.core.divergence import MEASURES, kl3_of_log_ratio


def _none(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Every token at weight 1: the sampler's tokens are trained on as if π_old had drawn them."""
    return torch.ones_like(log_ratio)


def _token_tis(log_ratio: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """min(m_t, cap) per token: importance weights toward π_old, truncated so one token cannot dominate."""
    return log_ratio.exp().clamp(max=cap)


def _sequence_tis(log_ratio: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """min(Π_t m_t, cap) for every token of a sequence: the whole completion's importance weight."""
    total = torch.where(mask, log_ratio, 0.0).sum(-1, keepdim=True)
    return total.exp().clamp(max=cap).expand_as(log_ratio)


def _token_mask(log_ratio: Tensor, mask: Tensor, measure: str = "kl3", delta: float = 0.1) -> Tensor:
    """1 where D(m_t) <= δ, else 0: a token the engine drew too far from π_old does not train."""
    return (_measure(measure, log_ratio) <= delta).float()


def _sequence_mask(log_ratio: Tensor, mask: Tensor, measure: str = "kl3", delta: float = 0.1) -> Tensor:
    """1 for every token of a sequence whose mean D(m_t) over its tokens is <= δ, else 0 for all of them."""
    tokens = mask.sum(-1, keepdim=True).clamp(min=1)
    mean = torch.where(mask, _measure(measure, log_ratio), 0.0).sum(-1, keepdim=True) / tokens
    return (mean <= delta).float().expand_as(log_ratio)


def _measure(name: str, log_ratio: Tensor) -> Tensor:
    """D(m) of a registered measure, from log m (kl3 without cancellation near m = 1)."""
    return kl3_of_log_ratio(log_ratio) if name == "kl3" else MEASURES[name](log_ratio.exp())


CORRECTIONS: dict[str, Callable[..., Tensor]] = {
    "none": _none,
    "token-tis": _token_tis,
    "sequence-tis": _sequence_tis,
    "token-mask": _token_mask,
    "sequence-mask": _sequence_mask,
}
"""`rollout.correction` -> f(log m [B, T], mask [B, T] bool, **its parameters) -> weights [B, T]."""

MISMATCH_METRICS = ("mismatch/kl3", "mismatch/k1", "mismatch/log_ratio/max", "mismatch/corrected")
"""What every step reports of the mismatch over the tokens it trains on: KL3 and k1 estimates of
KL(μ || π_old), the largest |ln m|, and the share of tokens whose weight the correction changed."""


def correction_parameters(name: str) -> dict[str, object]:
    """The parameters `name` declares, with their defaults."""
    signature = inspect.signature(CORRECTIONS[name])
    return {key: p.default for key, p in list(signature.parameters.items())[2:]}


def check_correction(name: str, params: dict[str, object]) -> None:
    """ValueError naming the problem: an unknown correction, parameter or measure, or a bad cap or δ."""
    if name not in CORRECTIONS:
        raise ValueError(f"unknown correction {name!r}; use one of {', '.join(CORRECTIONS)}")
    declared = correction_parameters(name)
    for key in params:
        if key not in declared:
            takes = ", ".join(declared) or "no parameters"
            raise ValueError(f"correction {name!r} takes no parameter {key!r}; it takes {takes}")
    values = {**declared, **params}
    if "measure" in values and values["measure"] not in MEASURES:
        raise ValueError(f"measure {values['measure']!r} is not registered; use one of {', '.join(MEASURES)}")
    for key in ("cap", "delta"):
        value = values.get(key)
        if key in values and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0):
            raise ValueError(f"{key} must be a number > 0, got {value!r}")


def correction_weights(
    name: str, old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, **params
) -> tuple[Tensor, dict[str, Tensor]]:
    """(weights [B, T] of each token's policy term, 0 at padding; the mismatch metrics) of the tokens drawn by
    μ (`behaviour_logp`) for the update whose ratio denominator is π_old (`old_logp`)."""
    mask = mask.bool()
    log_ratio = torch.where(mask, old_logp.float() - behaviour_logp.float(), 0.0)  # ln m = ln π_old - ln μ
    weights = torch.where(mask, CORRECTIONS[name](log_ratio, mask, **params), 0.0)
    count = mask.sum().clamp(min=1)
    metrics = {
        "mismatch/kl3": kl3_of_log_ratio(log_ratio).sum() / count,
        "mismatch/k1": -log_ratio.sum() / count,
        "mismatch/log_ratio/max": log_ratio.abs().max() if mask.any() else log_ratio.new_zeros(()),
        "mismatch/corrected": ((weights != 1.0) & mask).sum() / count,
    }
    return weights, metrics
