"""The constant ratio intervals of the losses that bound one without being a plain clip of it (cispo's weight cap,
gmpo's log-space clip, and dapo's interval under gppo, two-sided, opsm and clip-cov), in plain Python so that
`atrctl plot-bounds` draws them without importing torch.  The defaults here are those of the losses themselves
(`atrctl.core.loss_family`, `atrctl.core.losses`); tests/core/test_loss_family.py holds the two equal."""

from __future__ import annotations

import math
from collections.abc import Callable


def _clip(params: dict) -> tuple[float, float]:
    return max(0.0, 1.0 - float(params["eps_low"])), 1.0 + float(params["eps_high"])


def _log_clip(params: dict) -> tuple[float, float]:
    return math.exp(-float(params["eps_low"])), math.exp(float(params["eps_high"]))


FAMILY_INTERVALS: dict[str, tuple[dict[str, float], Callable[[dict], tuple[float, float]]]] = {
    "cispo": ({"eps_low": 1.0, "eps_high": 0.28}, _clip),  # the cap of its weight, not of the gradient
    "gmpo": ({"eps_low": 0.4, "eps_high": 0.4}, _log_clip),  # each token's log-ratio, inside a geometric mean
    "clip-cov": ({"eps_low": 0.2, "eps_high": 0.2}, _clip),
    "gppo": ({"eps_low": 0.2, "eps_high": 0.28}, _clip),  # a bounded gradient beyond it
    "two-sided": ({"eps_low": 0.2, "eps_high": 0.2}, _clip),
    "opsm": ({"eps_low": 0.2, "eps_high": 0.2}, _clip),
}
"""loss -> (the defaults of the parameters its interval depends on, the interval from its parameters)."""


def family_interval(name: str, params: dict) -> tuple[float, float] | None:
    """[l, u] of the loss `name` with `params` (its defaults for the rest), or None where it has none here."""
    if name not in FAMILY_INTERVALS:
        return None
    defaults, interval = FAMILY_INTERVALS[name]
    return interval({**defaults, **params})
