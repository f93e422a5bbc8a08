"""`atrctl plot-bounds` and `atrctl plot`: the trust regions, and training curves of any runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from atrctl.cli.display import console
from atrctl.cli.options import DEFAULT_EPS, DEFAULT_EPS_HIGH, DEFAULT_MAX_KL3, FigureFormat, positive, unit_open
from atrctl.errors import UserError


def plot_bounds(
    max_kl3: Annotated[
        list[float], typer.Option("--max-kl3", help="KL3 level δ of ATR-GRPO; repeat to overlay several.")
    ] = [DEFAULT_MAX_KL3],  # noqa: B006 - typer reads the default, it is never mutated
    eps: Annotated[float, typer.Option(help="GRPO clip ε (and DAPO's ε_low), in (0, 1).")] = DEFAULT_EPS,
    eps_high: Annotated[float, typer.Option(help="DAPO's clip-higher ε_high, > 0.")] = DEFAULT_EPS_HIGH,
    out: Annotated[
        Path | None, typer.Option(help="Figure path \\[default: results/bounds/bounds-kl3-<δ>.png]; CSV beside it.")
    ] = None,
    fmt: Annotated[FigureFormat | None, typer.Option("--format", help="Figure format.")] = None,
) -> None:
    """Show the ratio interval each divergence constraint implies: table, CSV and figure."""
    from atrctl.cli import tables
    from atrctl.core.divergence import MAX_KL3, MIN_KL3

    for delta in max_kl3:
        if not MIN_KL3 <= positive(delta, "--max-kl3") <= MAX_KL3:
            raise UserError(f"--max-kl3 must be from {MIN_KL3:g} to {MAX_KL3:g} (got {delta}); typical values are "
                            "0.01-0.2")  # fmt: skip
    unit_open(eps, "--eps")
    positive(eps_high, "--eps-high")

    from atrctl.reports import bounds_table

    figure_path = bounds_table.figure_path(out, fmt and fmt.value, max_kl3)

    methods, sweep = bounds_table.method_rows(max_kl3, eps, eps_high), bounds_table.sweep_rows()
    family = bounds_table.family_rows()
    console.print(tables.methods_table(methods))
    console.print(tables.sweep_table(sweep))
    console.print(tables.family_table(family))
    try:
        csv_path = bounds_table.write_bounds(figure_path, max_kl3, eps, methods, sweep, family)
    except OSError as error:
        raise UserError(f"--out {figure_path}: cannot write ({error.strerror}); choose a writable path") from None
    console.print(f"wrote {figure_path} and {csv_path}")


def plot(
    runs: Annotated[
        list[Path], typer.Argument(help="Run directories, or compare/sweep directories (one curve per arm).")
    ],
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            help="A metrics.jsonl key; repeat for several panels \\[default: those of reward/mean, entropy and "
            "kl3/mean the runs log].",
        ),
    ] = None,
    smooth: Annotated[int, typer.Option(help="Trailing moving average over this many steps (1: none).")] = 10,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Figure path (.png, .svg, .pdf) \\[default: results/plots/<runs>.png]; its numbers as CSV beside it."
        ),
    ] = None,
) -> None:
    """Overlay training curves of any runs from their metrics.jsonl: seeds of an arm as a mean and a band; the
    drawn numbers go to a CSV beside the figure."""
    from atrctl.reports import curves
    from atrctl.reports.bounds_table import checked_figure_path

    if smooth < 1:
        raise UserError(f"--smooth must be at least 1 (got {smooth}); 1 draws every step as logged")
    groups = curves.run_groups(runs)
    metric = curves.check_metrics(groups, metric)
    path = checked_figure_path(out or curves.default_path(runs))
    try:
        points = curves.curve_points(groups, metric, smooth)
        csv_path = curves.write_curves(curves.draw_curves(points, list(groups), metric, smooth), points, path)
    except OSError as error:
        raise UserError(f"--out {path}: cannot write ({error.strerror}); choose a writable path") from None
    shown = ", ".join(f"{label} ({len(directories)})" if len(directories) > 1 else label
                      for label, directories in groups.items())  # fmt: skip
    console.print(f"wrote {path} and {csv_path.name}: {', '.join(metric)} of {shown}", markup=False, highlight=False)
