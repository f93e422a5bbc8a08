"""Training curves of any runs, from their metrics.jsonl: `atrctl plot`, and compare's and sweep's training.png.

Runs are grouped: the runs of one arm (its seeds) are drawn as their mean with a band from the lowest
to the highest seed, a run on its own as one line.  Curves are smoothed by a trailing moving average
(per-step values of RL runs are noisy), over `smooth` steps.  `atrctl plot` writes the drawn numbers as a
CSV beside the figure, so a figure quoted in a study can be quoted in digits.
"""

from __future__ import annotations

import difflib
import errno
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from atrctl.errors import UserError
from atrctl.training.rundir import RunDir

SMOOTHING = 10
TITLES = {
    "reward/mean": "reward (mean of the batch)",
    "entropy": "entropy (nats/token)",
    "kl3/mean": "kl3/mean: KL(π_old‖π_θ) per token",
    "clip/low": "clip/low: w<l, A<0",
    "clip/high": "clip/high: w>u, A>0",
}
SEED_SUFFIX = re.compile(r"-s\d+$")
MAX_STEP = 2**53
"""Larger steps are not a run's (and lose their value as floats): such records are not drawn."""


class CurvePoint(NamedTuple):
    """One step of one group's curve, as drawn and as written to the CSV beside the figure."""

    metric: str
    arm: str
    seeds: int
    step: int
    mean: float
    lowest: float
    highest: float


def points(records: Sequence[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of each record whose step is an integer in [0, MAX_STEP] and whose `key` is a finite
    number: what a curve can draw; anything else a hand-edited or foreign metrics.jsonl holds (a string, a
    list, a 400-digit step, NaN) is left out rather than failing the whole plot."""
    drawn = []
    for record in records:
        step, value = record.get("step"), record.get(key)
        if type(step) is not int or not 0 <= step <= MAX_STEP:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, int) and abs(value) > MAX_STEP or not math.isfinite(value):
            continue
        drawn.append((step, float(value)))
    return drawn


def run_groups(paths: Sequence[str | Path]) -> dict[str, list[Path]]:
    """What `atrctl plot` draws for each path given: a run directory is its own curve; a comparison or sweep
    directory (runs/<arm>-s<seed>/) gives one curve per arm over its seeds.  A path that is neither is a
    UserError naming it."""
    groups: dict[str, list[Path]] = {}
    seen: set[Path] = set()
    for given in paths:
        path = Path(given)
        try:
            path.stat()
        except OSError as error:  # a symbolic link loop, a file in the way, ...: not something to read
            if error.errno != errno.ENOENT:
                raise UserError(f"{path} cannot be read ({error.strerror}): give run or compare directories") from None
        if path.resolve() in seen:
            raise UserError(f"{path} is given twice: give each run or comparison once")
        seen.add(path.resolve())
        if RunDir(path).metrics.is_file():
            label = path.name if path.name not in groups else str(path)
            groups.setdefault(label, []).append(path)
        elif (path / "runs").is_dir():
            runs = sorted(d for d in (path / "runs").iterdir() if d.is_dir() and RunDir(d).metrics.is_file())
            if not runs:
                raise UserError(f"{path} holds no run with metrics.jsonl in runs/: nothing to plot")
            for run in runs:
                arm = SEED_SUFFIX.sub("", run.name)
                label = arm if len(paths) == 1 else f"{path.name}/{arm}"
                groups.setdefault(label, []).append(run)
        else:
            raise UserError(
                f"{path} is neither a run (no metrics.jsonl) nor a comparison or sweep (no runs/): give run "
                "directories, or compare/sweep directories"
            )
    return groups


DEFAULT_METRICS = ("reward/mean", "entropy", "kl3/mean")


def check_metrics(groups: dict[str, list[Path]], metrics: Sequence[str] | None) -> list[str]:
    """The metrics to draw: those asked for, each logged by at least one of the runs (else a UserError with the
    closest names), or by default those of DEFAULT_METRICS the runs log (a run that skipped every row logs no
    entropy)."""
    logged: set[str] = set()
    for directories in groups.values():
        for directory in directories:
            records = RunDir(directory).read_metrics()
            logged.update(key for record in records for key in record if key not in logged and points([record], key))
    logged.discard("step")
    if not logged:
        raise UserError(
            f"{', '.join(groups)}: no run has logged a step yet (a number to draw); plot them once they have"
        )
    if metrics is None:
        return [metric for metric in DEFAULT_METRICS if metric in logged] or ["reward/mean"]
    for metric in metrics:
        if metric not in logged:
            close = difflib.get_close_matches(metric, sorted(logged), n=3, cutoff=0.4)
            hint = f"did you mean {', '.join(close)}?" if close else f"they log {', '.join(sorted(logged)[:12])} …"
            raise UserError(f"no run logs the metric '{metric}'; {hint}")
    return list(metrics)


def arm_colours(count: int) -> list:
    """One colour per arm: matplotlib's 10-colour cycle, or its 20 colours when more arms would repeat it (a
    family comparison has 15)."""
    from matplotlib import colormaps

    if count <= 10:
        return [f"C{i}" for i in range(count)]
    return [colormaps["tab20"](i % 20) for i in range(count)]


def curves_figure(groups: dict[str, list[Path]], metrics: Sequence[str], smooth: int = SMOOTHING, title: str = ""):
    """One panel per metric: per group, the mean over its runs of a `smooth`-step trailing moving average,
    and a band over the runs' range when there are several (cut to the shortest of them); x is the step."""
    return draw_curves(curve_points(groups, metrics, smooth), list(groups), metrics, smooth, title)


def draw_curves(
    points: Sequence[CurvePoint], labels: Sequence[str], metrics: Sequence[str], smooth: int, title: str = ""
):
    """The figure of curves_figure from its points, so that a figure and its CSV are one computation; `labels`
    fixes each group's colour across the panels, also where it logged nothing to draw."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(metrics), 4.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(metrics)))
    colours = dict(zip(labels, arm_colours(len(labels)), strict=True))
    curves: dict[tuple[str, str], list[CurvePoint]] = {}
    for point in points:
        curves.setdefault((point.metric, point.arm), []).append(point)
    for key, ax in zip(metrics, axes, strict=True):
        for label in labels:
            curve = curves.get((key, label))
            if not curve:
                continue
            steps = [point.step for point in curve]
            seeds = curve[0].seeds
            runs = f" ({seeds} seeds)" if seeds > 1 else ""
            ax.plot(steps, [p.mean for p in curve], label=f"{label}{runs}", lw=1.6, color=colours[label])
            if seeds > 1:
                low, high = [p.lowest for p in curve], [p.highest for p in curve]
                ax.fill_between(steps, low, high, color=colours[label], alpha=0.2, lw=0)
        ax.set(title=TITLES.get(key, key), xlabel="step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    how = f"a {smooth}-step moving average" if smooth > 1 else "per step"
    fig.suptitle(title or f"Training curves, {how}; with several seeds: their mean, and their range as a band")
    return fig


def _smoothed(directories: Sequence[Path], key: str, smooth: int):
    """(steps, [runs, steps] values) of `key`: each run's logged values (a step that did not log the key,
    e.g. between held-out checks, is not on its curve) smoothed over `smooth` of them, then the runs lined
    up on the steps every one of them has; (None, None) when some run never logged it."""
    series = []
    for directory in directories:
        logged = np.array(points(RunDir(directory).read_metrics(), key), dtype=float)
        if not len(logged):
            return None, None
        window = max(1, min(smooth, len(logged)))
        values = np.convolve(logged[:, 1], np.ones(window) / window, mode="valid")
        series.append(dict(zip(logged[window - 1 :, 0].tolist(), values.tolist(), strict=True)))
    steps = sorted(set.intersection(*(set(run) for run in series)))
    if not steps:
        return None, None
    return np.array(steps), np.array([[run[step] for step in steps] for run in series])


def curve_points(groups: dict[str, list[Path]], metrics: Sequence[str], smooth: int = SMOOTHING) -> list[CurvePoint]:
    """What a curves figure draws: per metric, group and step, the mean of the runs' `smooth`-step trailing
    averages and the lowest and highest of them (one run: all three the same)."""
    points = []
    for key in metrics:
        for label, directories in groups.items():
            steps, values = _smoothed(directories, key, smooth)
            if steps is None:
                continue
            for step, column in zip(steps.tolist(), values.T, strict=True):
                points.append(
                    CurvePoint(key, label, len(directories), int(step), column.mean(), column.min(), column.max())
                )
    return points


def write_curves(figure, points: Sequence[CurvePoint], path: Path) -> Path:
    """The figure at `path` and its numbers in a CSV beside it, each replaced atomically; returns the CSV's path."""
    import csv
    import io

    from atrctl.files import atomic

    save(figure, path)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(CurvePoint._fields)
    writer.writerows((*point[:4], *(f"{value:.6g}" for value in point[4:])) for point in points)
    csv_path = path.with_suffix(".csv")
    atomic.write_text(csv_path, text.getvalue())
    return csv_path


def save(figure, path: Path) -> None:
    """Write the figure atomically, in the format its suffix names."""
    from atrctl.files import atomic

    with atomic.atomic_path(path) as tmp:
        figure.savefig(tmp, format=path.suffix.lstrip(".").lower(), dpi=120)


def default_path(paths: Sequence[str | Path], results: Path = Path("results")) -> Path:
    """results/plots/<the runs' names>.png (the first one's and a count when they are many)."""
    names = [Path(p).resolve().name for p in paths]
    stem = "-".join(names) if len(names) <= 3 else f"{names[0]}-and-{len(names) - 1}-more"
    return results / "plots" / f"{stem[:120]}.png"
