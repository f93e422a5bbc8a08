"""Per-token trust regions that depend on the sampled token's old probability.

A constant ratio interval treats a token with p_old = 0.9 and one with p_old = 1e-4
alike, although w = 2 is impossible for the first and nearly harmless for the second.
Measuring the step on the token's own two-outcome distribution (the token vs everything
else) instead gives bounds l_t, u_t that widen as p_old shrinks and never let
p_new = p_old·w leave [0, 1]: the bounds of DPPO and BandPO.  The loss
is the same clipped surrogate, with tensors for l and u.

Pure tensor functions: the bounds have the shape of old_logp and come back as float32
(the dtype of the ratio they clip) unless asked otherwise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_LOG_FLOOR = -700.0  # e^-700 ~ 1e-304: keeps p and 1 - p positive in float64 without changing any float32 bound
_NEWTON_STEPS = 8  # from the starts below: |KL - delta| < 1e-13 for delta in [1e-8, 5], any p in (0, 1]


TV_DELTA_RANGE = (1e-7, math.inf)
"""Below 1e-7 a token with p_old near 1 has l = 1 - delta/p that rounds to 1 in float32: the band clips every
such ratio to 1.  Any delta >= 1 is no constraint at all, which is allowed."""
KL_DELTA_RANGE = (1e-8, 5.0)
"""Where the Newton solve is exact (_NEWTON_STEPS): below it a lower bound comes out above 1 (1e-20) or NaN
(1e-300), above it NaN at p_old = 1 (1e300).  KL of 5 nats already lets p_new go from 0.5 to 1e-4."""


def _check_delta(delta: float, valid: tuple[float, float]) -> float:
    if isinstance(delta, str | bool):
        raise ValueError(f"delta must be a number, got {delta!r}")
    delta = float(delta)
    low, high = valid
    if not (math.isfinite(delta) and low <= delta <= high):
        allowed = f"at least {low:g}" if high == math.inf else f"from {low:g} to {high:g}"
        raise ValueError(
            f"delta must be a finite number {allowed} (the band is degenerate or NaN outside), got {delta:g}"
        )
    return delta


def tv_band_bounds(old_logp: Tensor, delta: float, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Ratio bounds for the binary total variation |p_new - p_old| <= delta.

    p_new in [max(p - delta, 0), min(p + delta, 1)], divided by p:
    l = max(1 - delta/p, 0), u = min(1 + delta/p, 1/p).

    1/p is computed as exp(-log p), the very expression of the ratio of a token whose new logprob is 0
    (float32 log-softmax gives exactly 0 to a dominant token): such a token sits exactly on u on every
    device.  As 1.0 / exp(log p) it landed an ulp on either side of its ratio, clipped on a GPU and not on
    the CPU (tests/core/test_losses.py::test_cuda_matches_cpu, seen on an H200).
    """
    delta = _check_delta(delta, TV_DELTA_RANGE)
    log_p = old_logp.detach().to(dtype).clamp(max=0.0)
    p = log_p.exp()
    low = (1.0 - delta / p).clamp(min=0.0)
    high = torch.minimum(1.0 + delta / p, (-log_p).exp())
    return low, high


def kl_band_bounds(old_logp: Tensor, delta: float, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Ratio bounds for the binary KL(Bern(p_old) || Bern(p_new)) <= delta, solved per token.

    The divergence is symmetric under p -> 1 - p, q -> 1 - q, so one solver finds both
    roots: the lower root q < p directly, the upper root through 1 - q < 1 - p.  When
    the upper root lies within float64 rounding of 1, u is 1/p_old (p_new capped at 1).
    The roots are found in float64; float32 bounds are those roots rounded (near
    p_new = 1 the rounding of u, not the solver, limits how well p_old·u meets the constraint).
    """
    delta = _check_delta(delta, KL_DELTA_RANGE)
    log_p = old_logp.detach().double().clamp(max=0.0)
    log_1mp = _log1mexp(log_p)
    log_p, log_1mp = log_p.clamp(min=_LOG_FLOOR), log_1mp.clamp(min=_LOG_FLOOR)
    log_q_low = _lower_log_root(log_p, log_1mp, delta)
    log_1mq_high = _lower_log_root(log_1mp, log_p, delta)
    low = (log_q_low - log_p).exp()
    high = (_log1mexp(log_1mq_high) - log_p).exp()
    return low.to(dtype), high.to(dtype)


def _log1mexp(x: Tensor) -> Tensor:
    """ln(1 - e^x) for x <= 0, accurate at both ends (Maechler, 2012)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _lower_log_root(log_p: Tensor, log_1mp: Tensor, delta: float) -> Tensor:
    """t = ln q of the root q < p of KL(Bern(p) || Bern(q)) = delta, by Newton in t.

    In t the divergence g(t) is convex and decreasing up to t = ln p, with |g'| <= p, so
    Newton started left of the root climbs to it monotonically, never overshooting.  Two
    starts are certainly left of it (g >= delta), and the later one is used:
    - t = -(delta + H(p)) / p, from KL >= -H(p) - p·ln q (good when the root is near 0);
    - q = p - sqrt(2·delta·m(1-m)), m = min(p, 1/2), from KL >= (p-q)^2 / (2·max x(1-x) on [q, p])
      (good when the root is near p, i.e. small delta).
    """
    p, one_minus_p = log_p.exp(), log_1mp.exp()
    entropy = -(p * log_p + one_minus_p * log_1mp)
    t = -(delta + entropy) / p
    m = p.clamp(max=0.5)
    q_start = p - torch.sqrt(2.0 * delta * m * (1.0 - m))
    t = torch.where(q_start > 0, torch.maximum(t, q_start.clamp(min=1e-300).log()), t)
    for _ in range(_NEWTON_STEPS):
        q, one_minus_q = t.exp(), -torch.expm1(t)  # ln(1 - q) below loses only ~1e-16 absolute when q is tiny
        excess = p * (log_p - t) + one_minus_p * (log_1mp - one_minus_q.log()) - delta
        slope = one_minus_p * q / one_minus_q - p
        t = t - torch.where(slope < 0, excess / slope, 0.0)  # slope = 0 only at t = ln p, right of every root
    return t
