"""Recipes: TOML files plus command-line overrides, resolved into the validated sections of `schema`.

Validation is strict because a typo in a hyperparameter silently ignored is a wasted experiment: an
unknown key or a wrong type is an error that names the key and the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any

from atrctl import numbers
from atrctl.config.schema import AlgoConfig, Recipe, RolloutConfig
from atrctl.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


# --------------------------------------------------------------- validation


def _registry(module: str, name: str):
    """A registry read when a recipe is checked (not copied at import), so a newly registered entry is valid
    at once; imported lazily because the loss and rollout registries bring torch."""
    import importlib

    return lambda: getattr(importlib.import_module(module), name)


_CHOICES = {
    ("model", "arch"): _registry("atrctl.model.loading", "ARCHS"),
    ("model", "device"): _registry("atrctl.model.numerics", "DEVICES"),
    ("model", "dtype"): _registry("atrctl.model.numerics", "DTYPES"),
    ("model", "autocast"): lambda: ("auto", "bfloat16", "off"),
    ("model", "shard"): lambda: ("none", "fsdp"),
    ("rollout", "backend"): _registry("atrctl.rollout.backend", "ROLLOUT_BACKENDS"),
    ("rollout", "correction"): _registry("atrctl.core.correction", "CORRECTIONS"),
    ("algo", "advantage"): _registry("atrctl.core.advantages", "ADVANTAGE_ESTIMATORS"),
    ("algo", "agg"): _registry("atrctl.core.losses", "AGGREGATIONS"),
    ("algo", "kl_estimator"): _registry("atrctl.core.losses", "KL_ESTIMATORS"),
    ("algo", "old_logprobs"): lambda: ("auto", "sampler", "recompute"),
    ("optim", "schedule"): lambda: ("constant", "cosine"),
}
_POSITIVE = {
    ("warmup", "max_steps"),
    ("warmup", "batch_size"),
    ("warmup", "lr"),
    ("warmup", "eval_every"),
    ("warmup", "eval_problems"),
    ("rollout", "prompts"),
    ("rollout", "max_new_tokens"),
    ("algo", "num_iterations"),
    ("algo", "minibatches"),
    ("optim", "lr"),
    ("optim", "grad_clip"),
    ("eval", "every"),
    ("eval", "problems"),
    ("eval", "samples"),
    ("run", "steps"),
    ("run", "checkpoint_every"),
    ("run", "max_bad_steps"),
}
_NON_NEGATIVE = {
    ("algo", "beta"),
    ("optim", "weight_decay"),
    ("optim", "warmup_steps"),
    ("algo", "micro_batch"),
    ("eval", "batch"),
    ("rollout", "sample_batch"),
}
_FRACTIONS = {("warmup", "target_accuracy")}
_SAMPLING = {"temperature": numbers.temperature, "top_p": numbers.top_p}  # rollout.* and eval.*


def _closest(key: str, valid: typing.Iterable[str], prefix: str = "") -> str:
    valid = list(valid)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if match:
        return f"; did you mean '{prefix}{match[0]}'?"
    return f"; valid: {', '.join(prefix + v for v in valid)}"


_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    str: "a string",
    bool: "true or false",
    dict: "a table",
    list: "a list",
}


def _type_name(annotation: Any) -> str:
    return _TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check a TOML value against a field's type; ints are accepted where floats are expected."""
    origin = typing.get_origin(annotation) or annotation
    if origin is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin in (int, float) and isinstance(value, bool):
        raise UserError(f"{where} must be {_type_name(origin)}, got the boolean {value!r}")
    if origin in (types.UnionType, typing.Union):
        return value
    if not isinstance(value, origin):
        raise UserError(f"{where} must be {_type_name(origin)}, got {value!r}")
    return value


def _check_value(section: str, key: str, value: Any) -> None:
    where = f"{section}.{key}"
    if key == "seed":
        numbers.seed(value, where)
    if isinstance(value, int | float) and not isinstance(value, bool):
        numbers.number(value, where)
    if key in _SAMPLING:
        _SAMPLING[key](value, where)
    if (section, key) in _CHOICES and value not in (choices := _CHOICES[section, key]()):
        raise UserError(f"{where} = {value!r} is not one of {', '.join(choices)}")
    if (section, key) in _POSITIVE and not (value > 0 and math.isfinite(value)):
        raise UserError(f"{where} must be > 0, got {value}")
    if (section, key) in _NON_NEGATIVE and not (value >= 0 and math.isfinite(value)):
        raise UserError(f"{where} must be >= 0, got {value}")
    if (section, key) in _FRACTIONS and not 0 < value <= 1:
        raise UserError(f"{where} must be in (0, 1], got {value}")
    if (section, key) == ("run", "report_to"):
        check_report_to(value)
    if (section, key) == ("eval", "benchmarks"):
        check_benchmarks(value)
    if (section, key) == ("model", "lora"):
        from atrctl.model.adapters import lora_settings

        lora_settings(value)
    if (section, key) == ("rollout", "group_size") and value < 2:
        raise UserError(f"{where} must be at least 2 (a group of one has no baseline), got {value}")


MAX_NESTING = 16
"""Most levels of lists and tables inside one another a recipe value may have: real ones have 2 (lora's
target_modules); past a few hundred, parsing and copying a value exhaust Python's recursion."""


def _nesting(value: Any) -> int:
    """Levels of lists and tables in `value`, counted level by level (no recursion, whatever the depth)."""
    depth, level = 0, [value]
    while any(isinstance(item, list | dict) for item in level):
        depth += 1
        level = [child for item in level if isinstance(item, list | dict)
                 for child in (item.values() if isinstance(item, dict) else item)]  # fmt: skip
    return depth


def _too_deep(what: str) -> UserError:
    return UserError(f"{what} nests lists or tables too deeply: at most {MAX_NESTING} levels")


def loads_toml(text: str, what: str) -> dict[str, Any]:
    """tomllib.loads, whose parser recurses once per level: a value nested a few hundred deep is refused."""
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise _too_deep(what) from None


TRACKERS = ("tensorboard", "wandb")
"""The names run.report_to takes; `reporting.REPORTERS` implements one each (a test checks that they agree).
Kept here, where recipes are read, so that checking a recipe needs no tracker code."""


def check_report_to(names: typing.Sequence[str]) -> None:
    """run.report_to names known trackers, each once (checked while the recipe is read)."""
    check_names("run.report_to", names, TRACKERS, "tracker", "wandb")


def check_benchmarks(names: typing.Sequence[str]) -> None:
    """eval.benchmarks names benchmark tasks, each once (checked while the recipe is read)."""
    from atrctl.tasks import PRESETS

    check_names("eval.benchmarks", names, tuple(PRESETS), "benchmark", "aime25")


def check_names(where: str, names: typing.Sequence[str], known: tuple[str, ...], what: str, example: str) -> None:
    """A recipe key that lists names of `known` things (trackers, benchmarks): a list of strings, each known, once."""
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise UserError(f'{where} must be a list of {what} names such as ["{example}"], got {names!r}')
    for name in names:
        if name not in known:
            raise UserError(f"{where}: '{name}' is not a {what}; use one of {', '.join(known)}")
    if len(set(names)) < len(names):
        raise UserError(f"{where} names a {what} twice: {names}")


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise UserError(f"unknown key '{section}.{key}'{_closest(key, names, section + '.')}")
        if _nesting(value) > MAX_NESTING:
            raise _too_deep(f"{section}.{key}")
        value = _coerce(value, hints[key], f"{section}.{key}")
        _check_value(section, key, value)
        kwargs[key] = value
    return cls(**kwargs)


def recipe_from_dict(data: dict[str, Any]) -> Recipe:
    """Validate a nested dict (a parsed TOML recipe) into a Recipe."""
    hints = typing.get_type_hints(Recipe)
    sections = {}
    for section, values in data.items():
        if section not in hints:
            raise UserError(f"unknown section '[{section}]'{_closest(section, hints)}")
        if not isinstance(values, dict):
            raise UserError(f"'{section}' must be a table ([{section}]), got {type(values).__name__}")
        sections[section] = _build_section(section, hints[section], values)
    recipe = Recipe(**sections)
    _check_loss_args(recipe.algo)
    _check_rollout_args(recipe.rollout)
    if recipe.task.system_prompt and not recipe.task.chat_template:
        raise UserError("task.system_prompt needs the chat template: set task.chat_template = true")
    return recipe


def _check_loss_args(algo: AlgoConfig) -> None:
    """Each of algo.args a number, or a word where the loss's default is one: the loss itself would pass a
    string through `float()` and train on it.  Names the loss does not take are left to `training.checks.validate_algo`,
    which lists the ones it does."""
    if not algo.args:
        return
    from atrctl.core.losses import POLICY_LOSSES, loss_parameters

    defaults = loss_parameters(algo.loss) if algo.loss in POLICY_LOSSES else {}
    for key, value in algo.args.items():
        if key in defaults:
            numbers.loss_value(value, defaults[key], f"algo.args.{key}")


def _check_rollout_args(rollout: RolloutConfig) -> None:
    """The correction's parameters, and engine settings only for a backend that has an engine."""
    from atrctl.core.correction import check_correction

    try:
        check_correction(rollout.correction, rollout.correction_args)
    except ValueError as error:
        raise UserError(f"rollout.correction_args: {error}") from None
    if rollout.engine_args and rollout.backend == "hf":
        raise UserError("rollout.engine_args: the hf backend takes none; remove them or set rollout.backend = 'vllm'")


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe)


def changed_keys(before: dict, after: dict, ignored: typing.Collection[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """The (section, key) pairs whose values differ between two recipes as `recipe_to_dict` writes them (a key
    `before` lacks counts as changed), `ignored` left out: what a resume or a kept run may not have changed."""
    return [(section, key) for section in after for key in after[section]
            if (section, key) not in ignored and before.get(section, {}).get(key) != after[section][key]]  # fmt: skip


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def to_toml(tables: dict[str, dict[str, Any]]) -> str:
    """A two-level dict (tables of scalars, lists and inline tables) as TOML that load_recipe reads back."""
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------ loading


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """'section.key=value' -> (['section', 'key'], value), the value read as TOML (bare words as strings)."""
    path, sep, raw = assignment.partition("=")
    keys = path.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise UserError(f"--set {assignment!r}: write section.key=value, e.g. --set optim.lr=2e-4")
    return keys, read_value(raw)


def read_value(raw: str) -> Any:
    """A value as TOML reads it (0.1, 2, true, "x"); a bare word such as cosine or cuda stays a string."""
    try:
        return loads_toml(f"v = {raw.strip()}", f"the value {raw.strip()[:20]}…")["v"]
    except tomllib.TOMLDecodeError:
        return raw.strip()


def _merge(base: dict[str, Any], keys: list[str], value: Any) -> None:
    node = base
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise UserError(f"--set {'.'.join(keys)}: '{key}' is a value, not a table")
    node[keys[-1]] = value


def load_recipe(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Recipe:
    """Defaults, then the TOML file (if any), then each `section.key=value` override, validated once."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"recipe {path} does not exist; pass a TOML file such as recipes/default.toml")
        try:
            data = loads_toml(path.read_text(encoding="utf-8"), f"recipe {path}")
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise UserError(f"recipe {path} is not valid TOML: {error}") from None
    for assignment in overrides:
        keys, value = parse_override(assignment)
        _merge(data, keys, value)
    return recipe_from_dict(data)


def load_recipe_with_flags(
    path: str | Path | None,
    flags: dict[str, Any],
    sets: typing.Sequence[str],
    max_kl3: float | None = None,
    eps: float | None = None,
    eps_high: float | None = None,
) -> Recipe:
    """`load_recipe` with a command's flags applied after the file and before its --set overrides (flags
    that are None are not given); --max-kl3 / --eps / --eps-high become parameters of whichever loss the
    recipe ends up with (`losses.flag_parameters`)."""
    from atrctl.core.losses import POLICY_LOSSES, flag_parameters

    common = [f"{key}={value}" for key, value in flags.items() if value is not None]
    loss = load_recipe(path, [*common, *sets]).algo.loss
    # an unknown loss gets no parameters: validate_algo refuses it with the list of registered ones
    loss_args = flag_parameters(loss, max_kl3, eps, eps_high) if loss in POLICY_LOSSES else {}
    return load_recipe(path, [*common, *(f"algo.args.{key}={value}" for key, value in loss_args.items()), *sets])


def parse_task_args(pairs: typing.Sequence[str]) -> dict[str, Any]:
    """--task-arg key=value pairs, values read as TOML (bare words as strings)."""
    args = {}
    for pair in pairs:
        key, sep, _ = pair.partition("=")
        if not sep or not key.strip() or "." in key:
            raise UserError(f"--task-arg {pair!r}: write key=value, e.g. --task-arg digits=2")
        args[key.strip()] = parse_override(f"task.{pair}")[1]
    return args
