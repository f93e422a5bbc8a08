"""The one check of a number the user gives, wherever it comes from: a flag, a recipe key, an arm's parameter.

Types are strict because Python's `float()` is not: it reads "0.05", full-width "０.２", Arabic-Indic "٠.１" and
"1_0" (= 10), so a string that reached a loss would train, and `max_kl3="0.10"` and `max_kl3=0.1` would be two
arms of one setting.  A string is never a number here, nor is a boolean.  Ranges are those that give a
finite trust region and a usable sampler; each floor says what breaks below it.
"""

from __future__ import annotations

import math
from typing import Any

from atrctl.errors import UserError

SEED_LIMIT = 2**63
"""Seeds feed torch generators (64-bit) through formulas that stay below 2^64 for these."""

MIN_TEMPERATURE = 1e-3
"""What breaks is the sampler's logits / T: it overflows float32 to inf, and sampling meets NaN, near T = 1e-37
for a logit of 30 (T = 1e-45 traced back in eval and read as a diverged policy in train).  Long before, the
logprobs stop meaning anything: float32 rounds a logit z by ~6e-8·|z|, which 1/T makes 6e-5·|z| nats at
T = 1e-3 and whole nats by T = 1e-6, and the ratio w that a trust region clips is made of them.  1e-3 is a
floor with that margin, not a recommendation (bf16 autocast rounds ~6e4 times coarser still)."""

MIN_TOP_P = 1.1754943508222875e-38
"""float32's smallest normal number: the sampler compares the cumulative probability to top_p in float32, and
a top_p that rounds to 0 there removes every token (1e-320 is 0 in float32).  Any top_p this small keeps
the most likely token alone already."""


def number(value: Any, where: str) -> int | float:
    """`value` if it is a finite int or float (not a bool, not a string); else the one-line refusal."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        if isinstance(value, str):
            raise UserError(f"{where} must be a number, got the string {value!r}: write the number without quotes")
        shown = str(value).lower() if isinstance(value, bool) else repr(value)  # TOML's spelling of a boolean
        raise UserError(f"{where} must be a number, got {shown}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{where} must be a finite number, got {value}")
    if isinstance(value, int) and abs(value) >= SEED_LIMIT:
        raise UserError(f"{where} = {value} is out of range: use a value below 2^63")
    return value


def seed(value: Any, where: str) -> int:
    """A seed: an integer from 0 to 2^63 - 1 (2^64 would wrap to 0 in a 64-bit generator)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        raise UserError(f"{where} must be an integer from 0 to 2^63 - 1, got {value}")
    return value


def temperature(value: Any, where: str) -> float:
    """A sampling temperature: at least MIN_TEMPERATURE (see there why)."""
    value = number(value, where)
    if not value >= MIN_TEMPERATURE:
        raise UserError(
            f"{where} must be at least {MIN_TEMPERATURE:g}, got {value:g}: below it the sampled logprobs are "
            "float32 rounding noise and then overflow; e.g. 0.1 for near-greedy samples"
        )
    return value


def top_p(value: Any, where: str) -> float:
    """A nucleus threshold in [MIN_TOP_P, 1] (see MIN_TOP_P why not smaller)."""
    value = number(value, where)
    if not MIN_TOP_P <= value <= 1:
        raise UserError(
            f"{where} must be in [{MIN_TOP_P:.3g}, 1], got {value:g}: a smaller one rounds to 0 in the float32 "
            "sampler and keeps no token; e.g. 0.95, or 1 for no nucleus"
        )
    return value


def loss_value(value: Any, default: Any, where: str) -> Any:
    """A loss parameter's value: a word where its default is a word (divergence's measure), else a number."""
    if isinstance(default, str):
        if not isinstance(value, str):
            raise UserError(f"{where} must be a word such as {default!r}, got {value!r}")
        return value
    return number(value, where)
