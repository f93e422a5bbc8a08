"""The per-token inputs a policy loss sees, made float32 and neutral at padding before any loss reads them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

Bound = float | Tensor  # a bound of the ratio: one for every token, or one per token

# |logp - old_logp| is clamped to this before exp, so w stays within [e^-20, e^20] ~ [2e-9, 5e8]
# and cannot overflow float32.  A token beyond it is far outside every trust region; it keeps
# its (clipped) loss value but gets no gradient through w.
LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True)
class Tokens:
    """The per-token inputs a policy loss sees: float32 [B, T], already neutral at padding.

    Padded positions hold logp = old_logp = 0 (so w = 1) and A = 0, whatever the caller
    put there, so neither their values nor their gradients can leak into the loss.
    """

    logp: Tensor
    old_logp: Tensor
    log_ratio: Tensor  # clamp(logp - old_logp, ±LOG_RATIO_LIMIT)
    ratio: Tensor  # exp(log_ratio)
    advantages: Tensor
    mask: Tensor  # bool


def aligned(tensor: Tensor, mask: Tensor, name: str) -> Tensor:
    if tensor.shape != mask.shape:
        raise ValueError(f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(tensor.shape)}")
    return tensor


def prepare_tokens(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> Tokens:
    if mask.ndim != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    mask = mask.bool()
    logp = torch.where(mask, aligned(logp, mask, "logp").float(), 0.0)
    old_logp = torch.where(mask, aligned(old_logp, mask, "old_logp").detach().float(), 0.0)
    if advantages.shape == mask.shape[:1]:
        advantages = advantages[:, None]
    elif advantages.shape != mask.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] for mask {tuple(mask.shape)}, got {tuple(advantages.shape)}"
        )
    advantages = torch.where(mask, advantages.detach().float(), 0.0)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return Tokens(logp, old_logp, log_ratio, log_ratio.exp(), advantages, mask)


def masked_log_ratio(ref_logp: Tensor, tokens: Tokens) -> Tensor:
    """ln(pi_ref / pi_theta) per token, clamped like the policy ratio, 0 at padding."""
    ref_logp = torch.where(tokens.mask, ref_logp.detach().float(), 0.0)
    return (ref_logp - tokens.logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
