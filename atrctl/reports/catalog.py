"""What `atrctl ls` lists, read from the registries themselves: a newly registered loss, estimator,
task or backend appears here with no edit, and so do its parameters and their defaults."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import NamedTuple

RECIPES = Path(__file__).resolve().parents[2] / "recipes"  # the repository's shipped recipes


class Section(NamedTuple):
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]


def _summary(obj) -> str:
    """The first line of an object's docstring (of the wrapped function for a partial, of a task's module)."""
    doc = inspect.getdoc(getattr(obj, "func", obj)) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _parameters(params: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in params.items()) or "–"


def _task_parameters(factory) -> dict:
    return {
        p.name: (None if p.default is inspect.Parameter.empty else p.default)
        for p in inspect.signature(factory).parameters.values()
    }


def _task_summary(factory) -> str:
    """A task function's own first docstring line; a task class's module's (its docstring lists parameters)."""
    return _summary(factory if inspect.isfunction(factory) else inspect.getmodule(factory))


def _recipe_summary(path: Path) -> str:
    first = path.read_text(encoding="utf-8").splitlines()[:1]
    return first[0].lstrip("# ").strip() if first and first[0].startswith("#") else ""


def sections(recipes: Path = RECIPES) -> list[Section]:
    """Every registry, one section each, in the order a recipe names them."""
    from atrctl.core.advantages import ADVANTAGE_ESTIMATORS
    from atrctl.core.aggregation import AGGREGATIONS
    from atrctl.core.correction import CORRECTIONS, correction_parameters
    from atrctl.core.divergence import MEASURES, TRUST_REGIONS, region_defaults, trust_region
    from atrctl.core.losses import KL_ESTIMATORS, POLICY_LOSSES, loss_objective, loss_parameters
    from atrctl.rollout.backend import ROLLOUT_BACKENDS
    from atrctl.tasks import PRESETS, TASKS

    def region_doc(name: str) -> str:
        return _summary(TRUST_REGIONS[name])

    losses = [
        (
            name,
            _parameters(loss_parameters(name)),
            loss_objective(name),
            region_doc(name) if name in TRUST_REGIONS else _summary(loss.function),
        )
        for name, loss in POLICY_LOSSES.items()
    ]
    regions = []
    for name in TRUST_REGIONS:
        low, high = trust_region(name)
        regions.append((name, _parameters(region_defaults(name)), f"[{low:.6f}, {high:.6f}]", region_doc(name)))
    shipped = sorted(recipes.glob("*.toml")) if recipes.is_dir() else []
    return [
        Section("policy losses (algo.loss, algo.args)", ("name", "parameters", "objective", "what"), losses),
        Section(
            "trust regions (constant ratio intervals; each is also a loss)",
            ("name", "parameters", "interval at defaults", "what"),
            regions,
        ),
        Section(
            "divergence measures (algo.args.measure of the divergence loss)",
            ("name", "what"),
            [(name, _summary(fn)) for name, fn in MEASURES.items()],
        ),
        Section(
            "advantage estimators (algo.advantage)",
            ("name", "what"),
            [(name, _summary(fn)) for name, fn in ADVANTAGE_ESTIMATORS.items()],
        ),
        Section(
            "aggregations (algo.agg)",
            ("name", "what"),
            [(name, _summary(entry.reduce)) for name, entry in AGGREGATIONS.items()],
        ),
        Section(
            "KL-to-reference estimators (algo.kl_estimator, with algo.beta > 0)",
            ("name", "what"),
            [(name, _summary(fn)) for name, fn in KL_ESTIMATORS.items()],
        ),
        Section(
            "tasks (task.name, task.args)",
            ("name", "parameters", "what"),
            [(name, _parameters(_task_parameters(factory)), _task_summary(factory)) for name, factory in TASKS.items()],
        ),
        Section(
            "benchmark presets (atrctl eval --task NAME; each flag given overrides its value)",
            ("task", "n", "temperature", "top-p", "max new tokens", "chat template"),
            [
                (
                    name,
                    str(p.n),
                    f"{p.temperature:g}",
                    f"{p.top_p:g}",
                    f"{p.max_new_tokens:,}",
                    "yes" if p.chat_template else "no",
                )
                for name, p in PRESETS.items()
            ],
        ),
        Section("rollout backends (rollout.backend)", ("name", "implementation"), list(ROLLOUT_BACKENDS.items())),
        Section(
            "mismatch corrections (rollout.correction, rollout.correction_args)",
            ("name", "parameters", "what"),
            [(name, _parameters(correction_parameters(name)), _summary(fn)) for name, fn in CORRECTIONS.items()],
        ),
        Section(f"recipes ({recipes})", ("file", "what"), [(path.name, _recipe_summary(path)) for path in shipped]),
    ]
