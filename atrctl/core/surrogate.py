"""PPO's clipped surrogate, the one formula the ratio-clip losses of `atrctl.core.losses` and
`atrctl.core.loss_family` share."""

from __future__ import annotations

import torch
from torch import Tensor

from atrctl.core.tokens import Bound


def clipped_surrogate(ratio: Tensor, advantages: Tensor, low: Bound, high: Bound, dual_clip: float | None = None):
    """Per-token PPO loss -min(w·A, clip(w, l, u)·A) (Schulman et al., 2017) for float or tensor bounds.

    The min lets the clip bind only in the direction A pushes: for A > 0 a token with
    w > u has zero gradient, for A < 0 one with w < l; every other token gets -A·w·∇logp.
    With `dual_clip` c (Ye et al., 2020, dual-clip PPO) the loss of an A < 0 token is
    also capped at c·|A|, so one very unlikely-now token cannot dominate the batch.
    """
    if isinstance(low, Tensor) or isinstance(high, Tensor):
        low, high = (torch.as_tensor(b, dtype=ratio.dtype, device=ratio.device) for b in (low, high))
    loss = torch.maximum(-ratio * advantages, -ratio.clamp(low, high) * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss
