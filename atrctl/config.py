"""Recipes: TOML files plus command-line overrides, resolved into validated dataclasses.

Every setting has a default here and a one-line meaning in its docstring, so a
recipe only names what it changes.  Validation is strict because a typo in a
hyperparameter silently ignored is a wasted experiment: an unknown key or a
wrong type is an error that names the key and the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from atrctl.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass
class TaskConfig:
    """What the policy is trained and evaluated on."""

    name: str = "arith"
    """Registered task: arith, countdown, gsm8k, math."""
    args: dict[str, Any] = field(default_factory=dict)
    """Task parameters beyond the task's defaults, e.g. {digits = 2} for arith or {path = "gsm8k.jsonl"} for gsm8k."""
    chat_template: bool = False
    """Wrap prompts in the tokenizer's chat template (instruct models)."""


@dataclass
class ModelConfig:
    """The policy network."""

    base: str = "tiny"
    """A preset (tiny, small, medium: built from config and warmed up), a local HF model directory or a hub name."""
    arch: str = "llama"
    """Architecture of a preset: llama or qwen2."""
    device: str = "auto"
    """auto, cpu or cuda."""
    dtype: str = "auto"
    """auto (bf16 on a capable GPU, else float32), float32 or bfloat16."""


@dataclass
class WarmupConfig:
    """Supervised warm-up of a from-scratch preset until it solves some held-out problems (SFT)."""

    target_accuracy: float = 0.2
    """Stop once held-out greedy accuracy reaches this: good enough to get rewards, imperfect enough to improve."""
    max_steps: int = 3000
    """Give up after this many optimiser steps (the base is kept and its accuracy recorded)."""
    batch_size: int = 128
    """Solutions per SFT step."""
    lr: float = 3e-3
    """AdamW learning rate of the warm-up (from-scratch tiny models tolerate a large one)."""
    eval_every: int = 25
    """Measure held-out greedy accuracy every this many steps."""
    eval_problems: int = 200
    """Held-out test problems in each warm-up measurement."""
    seed: int = 0
    """Seed of the initial weights and the SFT data order: part of the cached base's identity."""


@dataclass
class Recipe:
    """A whole experiment; sections map one to one to TOML tables."""

    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)


# --------------------------------------------------------------- validation

_CHOICES = {
    ("model", "arch"): ("llama", "qwen2"),
    ("model", "device"): ("auto", "cpu", "cuda"),
    ("model", "dtype"): ("auto", "float32", "bfloat16"),
}
_POSITIVE = {
    ("warmup", "max_steps"), ("warmup", "batch_size"), ("warmup", "lr"), ("warmup", "eval_every"),
    ("warmup", "eval_problems"),
}
_FRACTIONS = {("warmup", "target_accuracy")}


def _closest(key: str, valid: typing.Iterable[str], prefix: str = "") -> str:
    valid = list(valid)
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if match:
        return f"; did you mean '{prefix}{match[0]}'?"
    return f"; valid: {', '.join(prefix + v for v in valid)}"


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a table"}


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
    if (section, key) in _CHOICES and value not in _CHOICES[section, key]:
        raise UserError(f"{where} = {value!r} is not one of {', '.join(_CHOICES[section, key])}")
    if (section, key) in _POSITIVE and not (value > 0 and math.isfinite(value)):
        raise UserError(f"{where} must be > 0, got {value}")
    if (section, key) in _FRACTIONS and not 0 < value <= 1:
        raise UserError(f"{where} must be in (0, 1], got {value}")


def _build_section(section: str, cls: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise UserError(f"unknown key '{section}.{key}'{_closest(key, names, section + '.')}")
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
    return Recipe(**sections)


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return dataclasses.asdict(recipe)


# ------------------------------------------------------------------ loading


def parse_override(assignment: str) -> tuple[list[str], Any]:
    """'section.key=value' -> (['section', 'key'], value), the value read as TOML (bare words as strings)."""
    path, sep, raw = assignment.partition("=")
    keys = path.strip().split(".")
    if not sep or len(keys) < 2 or not all(keys):
        raise UserError(f"--set {assignment!r}: write section.key=value, e.g. --set optim.lr=2e-4")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word such as cosine or cuda
    return keys, value


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
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise UserError(f"recipe {path} is not valid TOML: {error}") from None
    for assignment in overrides:
        keys, value = parse_override(assignment)
        _merge(data, keys, value)
    return recipe_from_dict(data)
