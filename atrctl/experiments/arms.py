"""Arms of a comparison or sweep: `LOSS[:key=value[,key=value…]]`, or a finished run directory.

An arm is a registered loss with, optionally, its own values of the loss's parameters (`grpo:eps=0.1`,
`atr:max_kl3=0.05`) and of recipe keys that set the regime (`atr:max_kl3=0.1,algo.num_iterations=2`), so
trust regions can be compared at several sizes and in several regimes in one command.  Everything an arm
does not set is the shared recipe's, which keeps the comparison fair: task, model, warm-up and evaluation
can never differ between arms.

`parse_arms` checks the syntax and the names; `arm_recipe` resolves an arm against the shared recipe, and
the values themselves are checked there (by the recipe's own validation and a probe of the loss), before
anything is trained.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atrctl.config.loading import read_value, recipe_from_dict, recipe_to_dict
from atrctl.config.schema import Recipe
from atrctl.core.losses import POLICY_LOSSES, loss_parameters
from atrctl.errors import UserError
from atrctl.numbers import loss_value
from atrctl.training.rundir import RunDir

REGIME_SECTIONS = ("algo", "optim", "rollout")
"""Recipe sections an arm may change.  The others (task, model, warmup, eval, run) are what makes arms
comparable: the same base, problems, evaluation and steps for all."""

EVALUATED_WITH = ("rollout.max_new_tokens", "rollout.backend")
"""Regime keys a run's evaluation also reads (its completion budget and sampler): per arm, they would make the
arms' evaluations differ, so they stay shared."""

SYNTAX = "write LOSS[:key=value[,key=value…]], e.g. grpo:eps=0.1 or atr:max_kl3=0.05,algo.num_iterations=2"


@dataclass(frozen=True)
class Arm:
    """One side of a comparison: a registered loss trained here (with its own parameters and recipe keys),
    or an existing run directory used as it is."""

    label: str
    loss: str | None = None
    params: tuple[tuple[str, Any], ...] = ()  # the loss's parameters this arm sets: algo.args
    overrides: tuple[tuple[str, Any], ...] = ()  # dotted recipe keys this arm sets, e.g. ("algo.minibatches", 8)
    run_dir: Path | None = None

    @property
    def slug(self) -> str:
        """The label as a file name (recipes/<slug>.toml, runs/<slug>-s<seed>): ':' and ',' become '_', which
        shells, TensorBoard's name:path specs and other operating systems all take as a plain character."""
        return self.label.replace(":", "_").replace(",", "_")


def format_value(value: Any) -> str:
    """A parameter value as the label shows it: TOML's spelling (0.1, 2, true, cosine), a word bare where it reads
    back as itself and quoted where it would not: the string "0.05" stays a string, not the number 0.05."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return str(value) if read_value(str(value)) == value else json.dumps(value)


def arm_text(loss: str, settings: Sequence[tuple[str, Any]]) -> str:
    """`LOSS:key=value,…` for these (key, value) pairs, values as the label shows them; the bare loss without."""
    return loss + (":" + ",".join(f"{k}={format_value(v)}" for k, v in settings) if settings else "")


def parse_arm(text: str) -> Arm:
    """`LOSS[:key=value,…]` as an Arm, or a finished run directory; syntax and names checked, values not."""
    loss, colon, rest = text.partition(":")
    if not colon and loss not in POLICY_LOSSES:
        if RunDir(Path(text)).is_run and RunDir(Path(text)).finished:
            return Arm(label=Path(text).name, run_dir=Path(text))
    if loss not in POLICY_LOSSES:
        raise UserError(
            f"unknown arm '{text}': '{loss}' is not a loss ({', '.join(POLICY_LOSSES)}) "
            "nor a finished run directory such as results/<run>"
        )
    if colon and not rest.strip():
        raise UserError(f"arm '{text}' has nothing after ':'; {SYNTAX}")
    taken = loss_parameters(loss)
    params, overrides, seen = [], [], set()
    for pair in rest.split(",") if colon else ():
        key, equals, raw = (part.strip() for part in pair.partition("="))
        if not equals or not key or not raw:
            raise UserError(f"arm '{text}': '{pair}' is not key=value; {SYNTAX}")
        if key in seen:
            raise UserError(f"arm '{text}' sets {key} twice")
        seen.add(key)
        value = read_value(raw)
        if not isinstance(value, int | float | str):
            raise UserError(f"arm '{text}': {key}={raw} is not a number or a word")
        if "." not in key:
            if key not in taken:
                raise UserError(
                    f"arm '{text}': {loss} takes no parameter '{key}'; its parameters: {_parameter_list(loss)} "
                    f"(or a recipe key such as algo.num_iterations=2)"
                )
            params.append((key, loss_value(value, taken[key], f"arm '{text}': {key}")))
        else:
            _check_regime_key(text, key)
            overrides.append((key, value))
    return Arm(label=arm_text(loss, [*params, *overrides]), loss=loss, params=tuple(params), overrides=tuple(overrides))


def _parameter_list(loss: str) -> str:
    return ", ".join(f"{k}={format_value(v)}" if v is not None else k for k, v in loss_parameters(loss).items())


def _check_regime_key(text: str, key: str) -> None:
    section, _, field = key.partition(".")
    if key == "algo.loss":
        raise UserError(f"arm '{text}' sets algo.loss: the arm's name is its loss")
    if key.startswith("algo.args."):
        raise UserError(f"arm '{text}': write the loss's parameter as {key.removeprefix('algo.args.')}=…")
    if section not in REGIME_SECTIONS:
        raise UserError(
            f"arm '{text}' sets {key}: an arm may change only {', '.join(s + '.*' for s in REGIME_SECTIONS)} keys; "
            "task, model, warm-up, eval and run are shared by every arm (set them with --set or --recipe)"
        )
    if not field or "." in field:
        raise UserError(f"arm '{text}': '{key}' is not a recipe key; write section.key=value")
    if key in EVALUATED_WITH:
        raise UserError(f"arm '{text}' sets {key}, which the evaluation of every arm uses too; set it for all "
                        "arms with --set or --recipe")  # fmt: skip


def parse_arms(texts: Sequence[str]) -> list[Arm]:
    """Every arm parsed, with distinct labels and file names."""
    arms = [parse_arm(text) for text in texts]
    for attribute in ("label", "slug"):
        names = [getattr(arm, attribute) for arm in arms]
        if len(set(names)) != len(names):
            repeated = sorted({name for name in names if names.count(name) > 1})
            raise UserError(f"arms must differ; {', '.join(repeated)} is given more than once")
    return arms


def arm_recipe(recipe: Recipe, arm: Arm, base: str, loss_args: dict[str, dict]) -> Recipe:
    """The shared recipe with the arm's loss, parameters and regime keys, starting from the shared base.

    Parameters: the loss's defaults, then the shared --max-kl3/--eps/--eps-high (`loss_args`), then the
    arm's own.  Values are validated as a recipe's are (one line naming the key)."""
    data = recipe_to_dict(recipe)
    data["algo"] = {**data["algo"], "loss": arm.loss, "args": {**loss_args.get(arm.loss, {}), **dict(arm.params)}}
    data["model"] = {**data["model"], "base": base}
    for key, value in arm.overrides:
        section, field = key.split(".")
        data[section] = {**data[section], field: value}
    try:
        return recipe_from_dict(data)
    except UserError as error:
        raise UserError(f"arm '{arm.label}': {error}") from None


def resolved_identity(recipe: Recipe) -> dict:
    """What a trained arm is, with the loss's defaults filled in and its numbers as floats: `grpo`,
    `grpo:eps=0.2` and `atr:max_kl3=1` / `atr:max_kl3=1.0` are one arm each."""
    data = recipe_to_dict(recipe)
    args = {**loss_parameters(recipe.algo.loss), **data["algo"]["args"]}
    data["algo"]["args"] = {k: as_number(v) for k, v in args.items()}
    return data


def as_number(value: Any) -> Any:
    """An int as the float it equals (bools and words as they are), so that 1 and 1.0 compare equal."""
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def check_distinct(recipes: dict[str, Recipe]) -> None:
    """Two arms that would train the same recipe are one arm given twice: refused, naming both."""
    seen: dict[str, str] = {}
    for label, recipe in recipes.items():
        key = json.dumps(resolved_identity(recipe), sort_keys=True, default=str)
        if key in seen:
            raise UserError(f"arms '{seen[key]}' and '{label}' train the same recipe; drop one")
        seen[key] = label
