"""`atrctl sweep`: one loss over a grid of its parameters (or of regime keys), beside reference arms.

A sweep is a comparison whose arms are the grid's points, `LOSS:key=value,…` for every combination of the
`--grid` values, plus the `--vs` arms: the same shared base, seeds, held-out problems, n and sampling seed
(`atrctl.experiments.compare` does the training, evaluation and resuming), and a report of its own
(`atrctl.experiments.sweep_report`): one row per point, figures against the swept parameter, and a figure on axes that
every family shares (the measured KL3 per token, the width of the ratio interval).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from atrctl.config.loading import read_value
from atrctl.core.losses import POLICY_LOSSES
from atrctl.errors import UserError
from atrctl.experiments.arms import Arm, arm_text, as_number, format_value, parse_arm
from atrctl.experiments.compare import Comparison, plan_comparison


@dataclass(frozen=True)
class Grid:
    """One swept key and its values, in the order given."""

    key: str
    values: tuple[Any, ...]


@dataclass
class Sweep:
    """What `sweep` resolved: the comparison it runs, and which of its arms is which grid point."""

    comparison: Comparison
    loss: str
    grids: list[Grid]
    points: dict[str, dict[str, Any]] = field(default_factory=dict)  # point label -> {grid key: value}

    @property
    def references(self) -> list[Arm]:
        return [arm for arm in self.comparison.arms if arm.label not in self.points]


def parse_grid(text: str) -> Grid:
    """`key=v1,v2,…` (a loss parameter or a dotted recipe key) as a Grid; values read as TOML."""
    key, equals, raw = text.partition("=")
    key = key.strip()
    values = [part.strip() for part in raw.split(",")]
    if not equals or not key or not all(values):
        raise UserError(f"--grid {text!r}: write KEY=v1,v2,…, e.g. --grid max_kl3=0.05,0.1,0.2")
    parsed = tuple(read_value(value) for value in values)
    shown = [format_value(as_number(value)) for value in parsed]
    if len(set(shown)) != len(shown):
        raise UserError(f"--grid {text!r} repeats a value")
    return Grid(key, parsed)


def grid_points(loss: str, grids: Sequence[Grid]) -> dict[str, dict[str, Any]]:
    """Every combination of the grids' values as an arm label, `LOSS:k1=v1,k2=v2`, and its coordinates."""
    points = {}
    for combination in itertools.product(*(grid.values for grid in grids)):
        coordinates = dict(zip((grid.key for grid in grids), combination, strict=True))
        arm = parse_arm(arm_text(loss, list(coordinates.items())))
        points[arm.label] = coordinates
    return points


def plan_sweep(loss: str, grid_texts: Sequence[str], vs: Sequence[str], *, name: str | None, **options) -> Sweep:
    """Check every input and resolve the sweep; nothing is written.  `options` are `plan_comparison`'s (seeds,
    n, problems, jobs, recipe, the shared loss flags, overwrite, results)."""
    if loss not in POLICY_LOSSES:
        raise UserError(f"sweep LOSS: '{loss}' is not a registered loss; use one of {', '.join(POLICY_LOSSES)}")
    if not grid_texts:
        raise UserError("sweep needs at least one --grid KEY=v1,v2,…, e.g. --grid max_kl3=0.05,0.1,0.2")
    grids = [parse_grid(text) for text in grid_texts]
    keys = [grid.key for grid in grids]
    if len(set(keys)) != len(keys):
        raise UserError(f"--grid {', '.join(sorted({k for k in keys if keys.count(k) > 1}))} is given twice")
    points = grid_points(loss, grids)
    if len(points) + len(vs) < 2:
        raise UserError("a sweep needs two grid points or a --vs arm to compare with")
    name = name if name is not None else f"{loss}-" + "-".join(keys)
    comparison = plan_comparison([*points, *vs], name=name, kind="sweep", **options)
    return Sweep(comparison, loss, grids, points)
