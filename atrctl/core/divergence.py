"""Policy divergences as trust regions in ratio space.

Every convex divergence D(w) with D(1) = 0, written as a function of the token
probability ratio w = pi_theta / pi_old, turns the constraint D(w) <= delta into
an interval [low, high] around 1.  Clipping w to that interval is all a PPO-style
loss needs, so a new divergence costs one function here and nothing at train time.

Pure functions only: no I/O, no configuration objects.  The measures accept
floats, numpy arrays and torch tensors alike.  torch is never imported here and
scipy only when a bound is solved, so the CLI can read the registry's defaults
for its help text at no cost.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import numpy as np

# ---------------------------------------------------------------- measures of w


def _log(w):
    """Natural log for floats, numpy arrays and torch tensors (tensors have .log())."""
    return w.log() if hasattr(w, "log") else np.log(w)


def ratio_deviation(w):
    """|w - 1|: the quantity PPO/GRPO ratio clipping bounds."""
    return abs(w - 1)


def kl1(w):
    """-ln w: Schulman's k1 estimator of KL(pi_old || pi_theta); unbiased but signed, so it bounds one side only."""
    return -_log(w)


def kl2(w):
    """1/2 ln^2 w: Schulman's k2, the squared log-ratio, symmetric in log space."""
    return 0.5 * _log(w) ** 2


def kl3(w):
    """w - 1 - ln w: Schulman's k3; its mean under pi_old is KL(pi_old || pi_theta), and it is >= 0."""
    return w - 1 - _log(w)


def kl3_of_log_ratio(x):
    """kl3 at w = e^x, as expm1(x) - x: no cancellation near w = 1 (tensors only; the losses' form)."""
    return x.expm1() - x


def reverse_kl3(w):
    """w ln w - w + 1: the k3-style estimator of the reverse direction, KL(pi_theta || pi_old)."""
    return w * _log(w) - w + 1


MEASURES: dict[str, Callable] = {
    "ratio": ratio_deviation,
    "kl1": kl1,
    "kl2": kl2,
    "kl3": kl3,
    "reverse-kl3": reverse_kl3,
}


# ------------------------------------------------------------------- the bounds


def _as_float(value, name: str) -> float:
    """A number as a float; a string or a boolean is not one (`float()` would read "0.05", "０.２" and "1_0")."""
    if isinstance(value, str | bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _check_level(delta: float, name: str = "delta") -> float:
    delta = _as_float(delta, name)
    if not (math.isfinite(delta) and delta > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {delta}")
    return delta


MAX_KL3 = 700.0  # beyond it the lower bound e^(-1-delta) underflows float64
MIN_KL3 = 1e-14
"""Below ~2e-15 the upper bound 1 + sqrt(2 delta) rounds to 1 in float32, where the losses clip the ratio, and
below ~1e-16 Lambert W's argument rounds onto its branch point and the bounds are NaN: such a region clips
every ratio to 1 (a run would skip every step).  1e-14 is the round value above both."""


def kl3_bounds(delta: float) -> tuple[float, float]:
    """The interval {w : w - 1 - ln w <= delta} in closed form.

    low = -W0(-e^(-1-delta)), high = -W_{-1}(-e^(-1-delta)).  Near delta = 0 the
    argument sits on Lambert W's branch point -1/e, where W loses about half its
    digits, so each root is polished with Newton steps on x = ln w (well
    conditioned on both sides) until w - 1 - ln w = delta to rounding.
    """
    from scipy.special import lambertw

    delta = _check_level(delta, "max_kl3")
    if delta > MAX_KL3:
        raise ValueError(f"max_kl3 must be <= {MAX_KL3:g} (its lower bound underflows), got {delta}")
    if delta < MIN_KL3:
        raise ValueError(
            f"max_kl3 must be at least {MIN_KL3:g} (a smaller region rounds to the ratio 1), got {delta:g}"
        )
    z = -math.exp(-1.0 - delta)
    low = -lambertw(z, 0).real
    high = -lambertw(z, -1).real
    return _polish_k3_root(low, delta), _polish_k3_root(high, delta)


def _polish_k3_root(w: float, delta: float) -> float:
    """Newton on g(x) = e^x - 1 - x - delta with x = ln w; stops once the step is negligible."""
    x = math.log(w)
    for _ in range(50):
        slope = math.expm1(x)
        if slope == 0.0:
            break
        step = (math.expm1(x) - x - delta) / slope
        x -= step
        if abs(step) <= 1e-16 * max(1.0, abs(x)):
            break
    return math.exp(x)


def kl2_bounds(delta: float) -> tuple[float, float]:
    """{w : 1/2 ln^2 w <= delta} = [e^-sqrt(2 delta), e^sqrt(2 delta)]: symmetric in log space."""
    radius = math.sqrt(2.0 * _check_level(delta))
    return math.exp(-radius), math.exp(radius)


_LOG_W_LIMIT = 700.0  # e^700 ~ 1e304: the widest ratio we search before calling a side unbounded


def bounds_for(divergence: Callable | str, delta: float) -> tuple[float, float]:
    """The interval {w : D(w) <= delta} for any convex D with D(1) = 0, by bracketing root finding.

    The search runs in x = ln w so that ratios from 1e-304 to 1e304 are reachable.
    A side on which D never reaches delta is unbounded: low = 0 or high = inf
    (reverse kl3 tends to 1 as w -> 0, so for delta >= 1 it does not bound w from below).
    """
    from scipy.optimize import brentq

    measure = MEASURES[divergence] if isinstance(divergence, str) else divergence
    delta = _check_level(delta)

    def excess(x: float) -> float:
        return float(measure(math.exp(x))) - delta

    def root(direction: float) -> float:
        reach = 1.0
        while excess(direction * reach) < 0:
            reach *= 2.0
            if reach > _LOG_W_LIMIT:
                return 0.0 if direction < 0 else math.inf
        lo, hi = sorted((0.0, direction * reach))
        x = brentq(excess, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)
        return math.exp(x)

    return root(-1.0), root(+1.0)


# ------------------------------------------------------ named trust regions


def _check_eps(eps: float, name: str) -> float:
    eps = _as_float(eps, name)
    if not (math.isfinite(eps) and 0 < eps < 1):
        raise ValueError(f"{name} must be in (0, 1), got {eps}")
    return eps


def _check_eps_high(eps: float, name: str) -> float:
    eps = _as_float(eps, name)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {eps}")
    return eps


def _grpo(eps: float = 0.2) -> tuple[float, float]:
    """|w - 1| <= eps: PPO's symmetric clip as GRPO uses it (Shao et al., 2024)."""
    eps = _check_eps(eps, "eps")
    return 1.0 - eps, 1.0 + eps


def _dapo(eps_low: float = 0.2, eps_high: float = 0.28) -> tuple[float, float]:
    """-eps_low <= w - 1 <= eps_high: clip-higher (Yu et al., 2025, DAPO)."""
    return 1.0 - _check_eps(eps_low, "eps_low"), 1.0 + _check_eps_high(eps_high, "eps_high")


def _atr(max_kl3: float = 0.1) -> tuple[float, float]:
    """w - 1 - ln w <= max_kl3: the KL3 region of ATR-GRPO, in closed form by Lambert W."""
    return kl3_bounds(max_kl3)


def _kl2(delta: float = 0.1) -> tuple[float, float]:
    """1/2 ln^2 w <= delta: symmetric in log space."""
    return kl2_bounds(delta)


def _reverse_kl3(delta: float = 0.1) -> tuple[float, float]:
    """w ln w - w + 1 <= delta: the reverse-direction KL3 (unbounded below for delta >= 1)."""
    return bounds_for(reverse_kl3, delta)


def _divergence(measure: str = "kl3", delta: float = 0.1) -> tuple[float, float]:
    """D(w) <= delta for any measure of MEASURES, by root finding."""
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r}; choose one of {', '.join(MEASURES)}")
    return bounds_for(MEASURES[measure], delta)


TRUST_REGIONS: dict[str, Callable[..., tuple[float, float]]] = {
    "grpo": _grpo,
    "dapo": _dapo,
    "atr": _atr,
    "kl2": _kl2,
    "reverse-kl3": _reverse_kl3,
    "divergence": _divergence,
}


def region_defaults(name: str) -> dict[str, object]:
    """The parameters of a named trust region and their defaults, e.g. {"max_kl3": 0.1} for atr."""
    return {p.name: p.default for p in inspect.signature(TRUST_REGIONS[name]).parameters.values()}


def trust_region(name: str, **params) -> tuple[float, float]:
    """The constant ratio interval [low, high] of a named method, e.g. trust_region("atr", max_kl3=0.1)."""
    if name not in TRUST_REGIONS:
        raise ValueError(f"unknown trust region {name!r}; choose one of {', '.join(TRUST_REGIONS)}")
    try:
        low, high = TRUST_REGIONS[name](**params)
    except TypeError as error:  # a misspelt parameter name
        raise ValueError(f"trust region {name!r}: {error}") from None
    return _usable(name, params, low, high)


def _usable(name: str, params: dict, low: float, high: float) -> tuple[float, float]:
    """[low, high] if it lets the ratio move on both sides of 1 as the losses compute it (float32): a region so
    small that a bound is NaN or rounds to 1 would clip every ratio to 1 and train nothing, silently.  A side
    may be unbounded (kl1's upper, reverse-kl3's lower for delta >= 1: 0 and inf)."""
    import numpy

    low32, high32 = numpy.float32(low), numpy.float32(high)
    if not (0 <= low32 < 1 < high32):
        given = ", ".join(f"{key}={value!r}" for key, value in params.items()) or "its defaults"
        raise ValueError(f"{name} with {given} gives the ratio interval [{low:.17g}, {high:.17g}], which float32 "
                         "cannot tell from 1: widen it (a larger level or epsilon)")  # fmt: skip
    return low, high


# ---------------------------------------------- translation to other trainers


def equivalent_clip(max_kl3: float) -> tuple[float, float]:
    """(eps_low, eps_high) with [1 - eps_low, 1 + eps_high] = the KL3 region.

    Set these as TRL's `epsilon` / `epsilon_high` or verl's `clip_ratio_low` /
    `clip_ratio_high` to train ATR-GRPO in those frameworks unchanged.
    """
    low, high = kl3_bounds(max_kl3)
    return 1.0 - low, high - 1.0


def kl3_for_eps_high(eps_high: float) -> float:
    """The max_kl3 whose upper bound is 1 + eps_high: delta = eps_high - ln(1 + eps_high)."""
    eps_high = _check_eps_high(eps_high, "eps_high")
    return eps_high - math.log1p(eps_high)
