"""The policy-loss contract and registry: what a loss declares once (its function, parameters and defaults,
objective) and the checks of parameter values the losses share.  `atrctl.core.losses` and
`atrctl.core.loss_family` register into it; everything else reads it through `atrctl.core.losses`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from atrctl.core.tokens import Tokens

LossFunction = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""loss(tokens, **params) -> (per-token loss [B, T], clip metrics)."""


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and what the rest of atrctl reads of it, declared once: recipe validation,
    `atrctl ls`, export and the integrations read `parameters`; `atrctl ls` reads `objective`; the update's
    zero-advantage skip reads `needs_every_row`."""

    function: LossFunction
    parameters: tuple[tuple[str, object], ...]  # keyword parameters and their defaults (None: no default)
    objective: str = "surrogate"  # its value: -min(w·A, clip(w)·A), -A at w = 1; "weighted-logp" (-w·A·logp); or
    # "soft-gate" (SAPO's -(4/τ)σ(τ(w-1))·A)
    needs_every_row: bool = False  # a term without A (say, a penalty on w): rows whose A is 0 still have a gradient

    def __call__(self, tokens: Tokens, **params) -> tuple[Tensor, dict[str, Tensor]]:
        return self.function(tokens, **params)


def define_loss(
    function: LossFunction, *, parameters_from: tuple[Callable, ...] = (), objective: str = "surrogate",
    needs_every_row: bool = False,
) -> PolicyLoss:  # fmt: skip
    """The PolicyLoss of `function`, its parameters read from its keyword parameters (or from those of
    `parameters_from`, for a function that passes them on)."""
    params: dict[str, object] = {}
    for source in parameters_from or (function,):
        for parameter in inspect.signature(source).parameters.values():
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY or (
                parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                and parameter.default is not inspect.Parameter.empty
            ):
                params[parameter.name] = None if parameter.default is inspect.Parameter.empty else parameter.default
    return PolicyLoss(function, tuple(params.items()), objective, needs_every_row)


POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""name -> PolicyLoss: every loss a recipe, an arm or an integration may name."""


def register_policy_loss(name: str, *, objective: str = "surrogate", needs_every_row: bool = False):
    """Register the decorated loss function under `name`: one function and this line make a new loss."""

    def register(function: LossFunction) -> LossFunction:
        POLICY_LOSSES[name] = define_loss(function, objective=objective, needs_every_row=needs_every_row)
        return function

    return register


# ------------------------------------------------------------ parameter values


def strict_float(value: float, name: str) -> float:
    """float(value) for a number; a string or a boolean is refused (`float()` reads "0.05", "０.２" and "1_0")."""
    if isinstance(value, str | bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def check_positive(value: float, name: str) -> float:
    value = strict_float(value, name)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def check_dual_clip(dual_clip: float | None) -> float | None:
    if dual_clip is None:
        return None
    dual_clip = strict_float(dual_clip, "dual_clip")
    if not (math.isfinite(dual_clip) and dual_clip > 1):
        raise ValueError(f"dual_clip must be a finite number > 1 (or None for off), got {dual_clip}")
    return dual_clip
