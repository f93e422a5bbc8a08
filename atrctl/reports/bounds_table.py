"""The trust regions side by side, as rows a researcher can read or load.

Each row is one method's ratio interval [low, high] with what it means in other
units: the clip widths 1 - low and high - 1, the interval in log-ratio space,
and the settings that reproduce it in TRL and verl.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from atrctl.core.divergence import trust_region
from atrctl.errors import UserError

SWEEP_DELTAS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
FIGURE_FORMATS = ("png", "svg", "pdf")


@dataclass(frozen=True)
class RegionRow:
    method: str
    setting: str
    low: float
    high: float
    clip_range: bool = True  # exactly one PPO clip range; else a loss that only has the interval (its own loss)

    @property
    def eps_low(self) -> float:
        return 1.0 - self.low

    @property
    def eps_high(self) -> float:
        return self.high - 1.0

    @property
    def log_low(self) -> float:
        return math.log(self.low) if self.low > 0 else -math.inf

    @property
    def log_high(self) -> float:
        return math.log(self.high)

    @property
    def trl(self) -> str:
        if not self.clip_range:
            return f"atrctl export {self.method} --to trl"
        return f"epsilon={self.eps_low:.6g}, epsilon_high={self.eps_high:.6g}"

    @property
    def verl(self) -> str:
        if not self.clip_range:
            return f"atrctl export {self.method} --to verl"
        return f"clip_ratio_low={self.eps_low:.6g}, clip_ratio_high={self.eps_high:.6g}"


def region_row(method: str, **params: float) -> RegionRow:
    low, high = trust_region(method, **params)
    setting = ", ".join(f"{key}={value:g}" for key, value in params.items())
    return RegionRow(method, setting, low, high)


def method_rows(max_kl3s: Sequence[float], eps: float, eps_high: float) -> list[RegionRow]:
    """grpo and dapo at the given eps's, then atr, kl2 and reverse-kl3 at each delta (same level, to compare)."""
    rows = [region_row("grpo", eps=eps), region_row("dapo", eps_low=eps, eps_high=eps_high)]
    for delta in max_kl3s:
        rows += [
            region_row("atr", max_kl3=delta),
            region_row("kl2", delta=delta),
            region_row("reverse-kl3", delta=delta),
        ]
    return rows


def family_rows() -> list[RegionRow]:
    """Every loss with a constant ratio interval that is not a plain clip of it, at its defaults
    (`core.family_intervals`, free of torch): gmpo's is per token in log space inside a geometric mean, gppo keeps
    a bounded gradient outside, cispo caps a weight, two-sided, opsm and clip-cov add a cap, a mask or a
    selection."""
    from atrctl.core.family_intervals import FAMILY_INTERVALS

    rows = []
    for name, (defaults, interval) in FAMILY_INTERVALS.items():
        setting = ", ".join(f"{k}={v:g}" for k, v in defaults.items())
        rows.append(RegionRow(name, setting, *interval(defaults), clip_range=False))
    return rows


def sweep_rows(deltas: Sequence[float] = SWEEP_DELTAS) -> list[RegionRow]:
    return [region_row("atr", max_kl3=delta) for delta in deltas]


CSV_COLUMNS = ("table", "method", "setting", "low", "high", "eps_low", "eps_high", "log_low", "log_high", "trl", "verl")


def to_csv(methods: Sequence[RegionRow], sweep: Sequence[RegionRow], family: Sequence[RegionRow] = ()) -> str:
    """The tables in one tidy CSV (column `table` = methods | sweep | family), full float precision."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for table, rows in (("methods", methods), ("sweep", sweep), ("family", family)):
        for row in rows:
            writer.writerow(
                [table] + [repr(v) if isinstance(v, float) else v for v in (getattr(row, c) for c in CSV_COLUMNS[1:])]
            )
    return out.getvalue()


def write_bounds(
    figure_path: Path,
    max_kl3s: Sequence[float],
    eps: float,
    methods: Sequence[RegionRow],
    sweep: Sequence[RegionRow],
    family: Sequence[RegionRow] = (),
) -> Path:
    """The figure (format from its suffix) and, beside it, the tables as CSV, each replaced atomically."""
    from atrctl.files import atomic
    from atrctl.reports.bounds_plot import bounds_figure

    csv_path = figure_path.with_suffix(".csv")
    figure = bounds_figure(max_kl3s, eps, [*methods, *family])
    with atomic.atomic_path(figure_path) as tmp:
        figure.savefig(tmp, format=figure_path.suffix.lstrip("."), dpi=130)
    atomic.write_text(csv_path, to_csv(methods, sweep, family))
    return csv_path


def figure_path(out: Path | None, fmt: str | None, max_kl3s: Sequence[float]) -> Path:
    """Where `plot-bounds` writes its figure (--out, --format), checked and with its folder made, before any work."""
    if out is None:
        tag = "_".join(f"{d:g}" for d in sorted(max_kl3s))
        out = Path("results/bounds") / f"bounds-kl3-{tag}.{fmt or FIGURE_FORMATS[0]}"
    return checked_figure_path(out, fmt)


def checked_figure_path(out: Path, fmt: str | None = None) -> Path:
    """A figure path given by --out (and --format): its type known and agreeing, its folder made; else a
    UserError saying what to change."""
    suffix = out.suffix.lstrip(".").lower()
    if fmt is None and suffix not in FIGURE_FORMATS:
        endings = ", ".join(f".{f}" for f in FIGURE_FORMATS)
        raise UserError(f"--out {out}: unknown figure type '.{suffix}'; end it in one of {endings}")
    if fmt is not None and suffix != fmt:
        raise UserError(f"--out {out} does not end in .{fmt} as --format asks; make them agree")
    from atrctl.files.destinations import check_destination

    check_destination(out, "--out", folder=False)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"--out {out}: cannot create {out.parent} ({error.strerror}); choose a writable path") from None
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file path such as {out / 'figure.png'}")
    return out
