"""The figure behind `atrctl plot-bounds`: divergences, clipped surrogates, bounds against delta."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure  # a bare Figure needs no GUI backend and no global pyplot state

from atrctl.core.divergence import kl2, kl3, kl3_bounds, ratio_deviation, reverse_kl3, trust_region

CURVES = (  # (label, measure, trust-region name whose interval it draws, colour)
    ("kl3 = w−1−ln w  (atr)", kl3, "atr", "tab:red"),
    ("kl2 = ½ln²w", kl2, "kl2", "tab:blue"),
    ("reverse kl3 = w ln w−w+1", reverse_kl3, "reverse-kl3", "tab:green"),
)
GRPO_COLOUR = "0.35"


def _clipped_surrogate(w: np.ndarray, advantage: float, low: float, high: float) -> np.ndarray:
    return np.minimum(w * advantage, np.clip(w, low, high) * advantage)


def bounds_figure(max_kl3s: Sequence[float], eps: float, intervals: Sequence = ()) -> Figure:
    """Three panels: (a) D(w) with levels and regions, (b) the PPO surrogate, (c) [l, u] against delta; and with
    `intervals` (rows with method, setting, low, high, clip_range) a fourth, (d), every constant interval."""
    fig = Figure(figsize=(23 if intervals else 18, 5.6), layout="constrained")
    axes = fig.subplots(1, 4 if intervals else 3)
    ax_div, ax_sur, ax_delta = axes[:3]
    if intervals:
        _intervals_panel(axes[3], intervals)
    deltas = sorted(max_kl3s)
    alphas = np.linspace(0.22, 0.1, len(deltas))

    # (a) divergence measures against the ratio
    w = np.linspace(1e-3, 3.0, 1500)
    for label, measure, _, colour in CURVES:
        ax_div.plot(w, measure(w), color=colour, lw=2, label=label)
    ax_div.plot(w, ratio_deviation(w), color=GRPO_COLOUR, lw=1.5, ls="--", label=f"|w−1|  (grpo, level ε={eps:g})")
    ax_div.axhline(eps, color=GRPO_COLOUR, lw=0.8, ls=":")
    ax_div.plot(trust_region("grpo", eps=eps), [eps, eps], "s", color=GRPO_COLOUR, ms=5)
    for delta, alpha in zip(deltas, alphas, strict=True):
        low, high = kl3_bounds(delta)
        ax_div.axvspan(low, high, color="tab:red", alpha=alpha, lw=0)
        ax_div.axhline(delta, color="black", lw=0.8, ls=":")
        ax_div.annotate(f"δ={delta:g}: atr [{low:.3f}, {high:.3f}]", (2.95, delta), ha="right", va="bottom", fontsize=8)
        for _, _, name, colour in CURVES[1:]:
            ends = [v for v in trust_region(name, delta=delta) if 0 < v < 3]
            ax_div.plot(ends, [delta] * len(ends), "o", color=colour, ms=5)
    ax_div.axvline(1.0, color="black", lw=0.5)
    ax_div.set_ylim(0, max(2.5 * deltas[-1], 1.5 * eps))
    ax_div.set_xlim(0, 3)
    ax_div.set(
        xlabel="ratio w = π_θ / π_old", ylabel="D(w)", title="(a) divergence of one token; shaded: KL3 region kl3 ≤ δ"
    )
    ax_div.legend(loc="upper center", fontsize=8)

    # (b) the clipped surrogate min(wA, clip(w)A) for both signs of A
    w = np.linspace(0.0, 2.5, 1000)
    grpo = trust_region("grpo", eps=eps)
    for advantage, style in ((1.0, "-"), (-1.0, "--")):
        ax_sur.plot(
            w,
            _clipped_surrogate(w, advantage, *grpo),
            color=GRPO_COLOUR,
            ls=style,
            lw=1.5,
            label=f"grpo ε={eps:g}, A={advantage:+g}",
        )
        for delta in deltas:
            bounds = kl3_bounds(delta)
            ax_sur.plot(
                w,
                _clipped_surrogate(w, advantage, *bounds),
                color="tab:red",
                ls=style,
                lw=2,
                alpha=0.5 + 0.5 * (delta == deltas[-1]),
                label=f"atr δ={delta:g}, A={advantage:+g}",
            )
    ax_sur.axvline(1.0, color="black", lw=0.5)
    ax_sur.set(
        xlabel="ratio w",
        ylabel="surrogate  min(w·A, clip(w)·A)",
        title="(b) flat = clipped, zero gradient: atr lets w rise further",
    )
    ax_sur.legend(fontsize=8, loc="lower left")

    # (c) the bounds as functions of delta
    grid = np.logspace(-3, 0, 200)
    lows, highs = np.array([kl3_bounds(d) for d in grid]).T
    ax_delta.plot(grid, highs, color="tab:red", lw=2, label="u(δ)  (atr upper)")
    ax_delta.plot(grid, lows, color="tab:red", lw=2, ls="--", label="l(δ)  (atr lower)")
    ax_delta.plot(grid, 2.0 - lows, color="tab:purple", lw=1, ls=":", label="2 − l(δ)  (mirror of l: u exceeds it)")
    for bound in grpo:
        ax_delta.axhline(bound, color=GRPO_COLOUR, lw=1, ls="--")
    ax_delta.text(grid[0], grpo[1], f" grpo 1±{eps:g}", va="bottom", fontsize=8, color=GRPO_COLOUR)
    for delta in deltas:
        low, high = kl3_bounds(delta)
        ax_delta.plot([delta, delta], [low, high], "o-", color="black", ms=4, lw=0.8)
    ax_delta.axhline(1.0, color="black", lw=0.5)
    ax_delta.set_xscale("log")
    ax_delta.set(xlabel="max_kl3 δ (log scale)", ylabel="ratio bound", title="(c) KL3 bounds against δ")
    ax_delta.legend(fontsize=8, loc="upper left")

    shown = ", ".join(f"{d:g}" for d in deltas)
    fig.suptitle(f"Policy-divergence trust regions in ratio space — ATR-GRPO max_kl3 = {shown} vs GRPO ε = {eps:g}")
    return fig


def _intervals_panel(ax, rows: Sequence) -> None:
    """(d): each loss's constant ratio interval as a bar on a log axis; a plain clip range solid, an interval a
    loss treats its own way (a geometric mean, a kept gradient, a weight cap, a mask) hatched."""
    edge = 0.3  # cispo's l = 0 is drawn from the axis's edge
    for i, row in enumerate(rows):
        low = max(row.low, edge)
        ax.barh(i, row.high - low, left=low, height=0.6, color="tab:red" if row.method == "atr" else GRPO_COLOUR,
                alpha=0.7 if row.clip_range else 0.25, hatch=None if row.clip_range else "//")  # fmt: skip
        ax.text(row.high * 1.03, i, f"[{row.low:.3g}, {row.high:.3g}]", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [row.method for row in rows], fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlim(edge, 3.0)
    ticks = [0.3, 0.5, 0.8, 1.0, 1.25, 2.0, 3.0]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set(xlabel="ratio w (log scale)", title="(d) constant intervals; hatched: not a plain clip")
