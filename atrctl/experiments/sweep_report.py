"""Table, figures and report.md of a sweep: every grid point (and reference arm) on one row, its figures
against the swept parameter, and one figure on axes that every family of trust region shares.

Evaluation figures carry compare's intervals (two-level bootstrap over problems and seeds); training figures
(entropy at the end, clip fractions, KL3, ratio range) are per run, so their interval is the range over
seeds.  Which x-axis makes two families comparable is itself a question: the nominal parameter (ε, δ)
is not, so the shared figure uses what was measured (the mean KL3 per token, which estimates how far the
updates moved the policy) and what was allowed (the width u − l of the ratio interval).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from atrctl.experiments.compare_report import (
    EXPLORATION_NOTE,
    LEVEL,
    MECHANISM_NOTE,
    RESAMPLES,
    SMOOTHING,
    TRAINING,
    bad_steps_text,
    benchmark_section,
    comparison_table,
    interval_text,
    mechanism_markdown,
    ratio_range,
    save_figure,
    table_markdown,
    table_metrics,
    training_figure,
    training_rows,
    write_mechanism,
)
from atrctl.files import atomic


def region_of(recipe) -> tuple[float, float] | None:
    """The constant ratio interval [l, u] a run trained with, where its loss has one (`losses.ratio_interval`)."""
    from atrctl.core.losses import ratio_interval

    return ratio_interval(recipe.algo.loss, recipe.algo.args)


def sweep_rows(sweep, evaluations: dict[str, list], ks: Sequence[int]) -> tuple[list[dict], list[dict]]:
    """(one row per arm: coordinates, evaluation figures with intervals, training figures with seed ranges, the
    region; compare's difference rows against the first reference arm, or the first point without one)."""
    from atrctl.experiments.arms import arm_recipe
    from atrctl.experiments.compare import arm_runs

    comparison = sweep.comparison
    order = [arm.label for arm in sweep.references] + list(sweep.points)
    table = comparison_table({label: evaluations[label] for label in order}, ks)
    evaluated = {row["row"]: row for row in table[: len(order)]}
    metrics = table_metrics(table, ks)
    runs = arm_runs(comparison)
    trained = {row["arm"]: row for row in training_rows(runs)}
    rows = []
    for arm in comparison.arms:
        row = {"arm": arm.label, "loss": arm.loss or "run", **sweep.points.get(arm.label, {})}
        row["seeds"] = evaluated[arm.label]["seeds"]
        for metric in metrics:
            row.update({k: evaluated[arm.label][k] for k in (metric, f"{metric} low", f"{metric} high")})
        row.update({key: value for key, value in trained[arm.label].items() if key not in ("arm", "seeds")})
        region = region_of(arm_recipe(comparison.recipe, arm, "", comparison.loss_args)) if arm.loss else None
        row["l"], row["u"] = region if region else (float("nan"), float("nan"))
        row["width"] = row["u"] - row["l"]
        rows.append(row)
    return rows, table[len(order) :]


def sweep_markdown(rows: Sequence[dict], metrics: Sequence[str]) -> str:
    """The sweep table: evaluation figures as mean [CI], training figures as mean [seed range]."""
    columns = [*metrics, *TRAINING[:4]]
    head = "| arm | seeds | " + " | ".join(columns) + " | ratio range | bad steps | [l, u] |"
    lines = [head, "|" + "---|" * (len(columns) + 5)]
    for row in rows:
        cells = [interval_text(row, c) for c in columns]
        cells += [ratio_range(row), bad_steps_text(row)]
        bands = row["loss"] in ("tv-band", "kl-band")
        cells.append(
            f"[{row['l']:.4f}, {row['u']:.4f}]" if np.isfinite(row["width"]) else "per token" if bands else "—"
        )
        lines.append(f"| {row['arm']} | {row['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _is_log_axis(values: Sequence) -> bool:
    """δ-like parameters: positive numbers spanning a factor of 4 or more get a log axis."""
    numeric = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return len(numeric) == len(values) and min(numeric) > 0 and max(numeric) >= 4 * min(numeric)


def parameter_figure(sweep, rows: Sequence[dict], metrics: Sequence[str]):
    """Each figure of the table against the first swept key (one line per combination of the other keys);
    the reference arms as horizontal bands (their interval, or their seed range)."""
    from matplotlib.figure import Figure

    panels = [*metrics, *TRAINING]
    columns = 4
    fig = Figure(figsize=(4.2 * columns, 3.6 * -(-len(panels) // columns)), layout="constrained")
    axes = fig.subplots(-(-len(panels) // columns), columns, squeeze=False).ravel()
    first, others = sweep.grids[0], sweep.grids[1:]
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in first.values)
    positions = {v: (v if numeric else i) for i, v in enumerate(first.values)}
    by_label = {row["arm"]: row for row in rows}
    for metric, ax in zip(panels, axes, strict=False):
        lines: dict[tuple, list[dict]] = {}
        for label, coordinates in sweep.points.items():
            rest = tuple((g.key, coordinates[g.key]) for g in others)
            lines.setdefault(rest, []).append(by_label[label])
        for rest, members in lines.items():
            x = [positions[m[first.key]] for m in members]
            y = np.array([m[metric] for m in members])
            errors = [y - [m[f"{metric} low"] for m in members], [m[f"{metric} high"] for m in members] - y]
            name = sweep.loss + "".join(f", {k}={v}" for k, v in rest)
            ax.errorbar(x, y, yerr=np.abs(errors), marker="o", ms=4, capsize=3, lw=1.6, label=name)
        for i, arm in enumerate(sweep.references):
            row = by_label[arm.label]
            colour = f"C{len(lines) + i}"
            ax.axhline(row[metric], color=colour, lw=1.2, ls="--", label=arm.label)
            ax.axhspan(row[f"{metric} low"], row[f"{metric} high"], color=colour, alpha=0.12, lw=0)
        if _is_log_axis(first.values):
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(list(positions.values()), [str(v) for v in first.values])
        elif _is_log_axis(first.values):
            ax.set_xticks(list(first.values), [f"{v:g}" for v in first.values])
            ax.minorticks_off()
        ax.set(title=metric, xlabel=first.key)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        f"Sweep of {sweep.loss} over {first.key}: evaluation with {LEVEL:.0%} CI, training with the seed range"
    )
    return fig


def common_axis_figure(rows: Sequence[dict], ks: Sequence[int]):
    """pass@1, pass@k and the final entropy of every arm against the measured mean KL3 per token and against
    the width u − l of its ratio interval: where families with different parameters become comparable."""
    from matplotlib.figure import Figure

    targets = ["pass@1", f"pass@{max(ks)}", "final entropy"]
    fig = Figure(figsize=(10, 3.4 * len(targets)), layout="constrained")
    axes = fig.subplots(len(targets), 2, squeeze=False)
    families = list(dict.fromkeys(row["loss"] for row in rows))
    for r, target in enumerate(targets):
        for c, (x_key, x_label) in enumerate((("kl3/mean", "measured kl3/mean (per token, mean over training)"),
                                              ("width", "width u − l of the ratio interval"))):  # fmt: skip
            ax = axes[r, c]
            for family in families:
                members = [row for row in rows if row["loss"] == family and np.isfinite(row[x_key])]
                if not members:
                    continue
                x = np.array([m[x_key] for m in members])
                y = np.array([m[target] for m in members])
                yerr = np.abs([y - [m[f"{target} low"] for m in members], [m[f"{target} high"] for m in members] - y])
                xerr = None
                if x_key == "kl3/mean":
                    xerr = np.abs([x - [m["kl3/mean low"] for m in members], [m["kl3/mean high"] for m in members] - x])
                ax.errorbar(x, y, yerr=yerr, xerr=xerr, fmt="o", ms=5, capsize=3, label=family)
                for m, xi, yi in zip(members, x, y, strict=True):
                    ax.annotate(m["arm"].partition(":")[2] or m["arm"], (xi, yi), fontsize=6, xytext=(3, 3),
                                textcoords="offset points")  # fmt: skip
            ax.set(xlabel=x_label, ylabel=target)
            ax.grid(alpha=0.3)
    if axes[0, 0].get_legend_handles_labels()[0]:
        axes[0, 0].legend(fontsize=8)
    fig.suptitle("Every arm on axes all families share (per-token bands have no single width: left panels only)")
    return fig


def write_sweep_report(
    sweep, evaluations: dict[str, list], ks: list[int], command: str, seconds: dict, benchmarks: dict[str, dict]
) -> list[dict]:
    """sweep.csv / sweep.md / sweep.png / common.png / differences / training.png / mechanism.png / report.md."""
    import pandas as pd

    from atrctl.config.loading import recipe_to_dict, to_toml
    from atrctl.experiments.compare import arm_runs
    from atrctl.model.numerics import resolve_device
    from atrctl.training.rundir import environment

    comparison, directory = sweep.comparison, sweep.comparison.directory
    rows, differences = sweep_rows(sweep, evaluations, ks)
    metrics = [m for m in table_metrics([rows[0]], ks) if m in ("pass@1", f"pass@{max(ks)}", "greedy", "entropy",
                                                                 "distinct correct")]  # fmt: skip
    atomic.write_text(directory / "sweep.csv", pd.DataFrame(rows).to_csv(index=False))
    table = sweep_markdown(rows, metrics)
    atomic.write_text(directory / "sweep.md", table)
    save_figure(parameter_figure(sweep, rows, metrics), directory / "sweep.png")
    save_figure(common_axis_figure(rows, ks), directory / "common.png")
    runs = arm_runs(comparison)
    save_figure(training_figure(runs), directory / "training.png")
    mechanism = write_mechanism(directory, runs)

    baseline = (sweep.references[0] if sweep.references else comparison.arms[0]).label
    difference_table = table_markdown(differences, metrics)
    starred = [row["row"] for row in differences if any(row.get(f"{m} excludes_0") for m in metrics)]
    verdict = (
        f"Differences from {baseline} whose {LEVEL:.0%} interval excludes 0 (★): {', '.join(starred)}."
        if starred
        else f"No arm differs from {baseline} by more than its {LEVEL:.0%} uncertainty."
    )
    timing = "\n".join(f"| {name} | {value:.1f} |" for name, value in seconds.items())
    versions = "\n".join(f"- {k}: {v}" for k, v in environment(resolve_device(comparison.recipe.model.device)).items())
    seeds = {row["seeds"] for row in rows}
    report = f"""# Sweep: {sweep.loss} over {", ".join(g.key for g in sweep.grids)}{" vs " if sweep.references else ""}{
        ", ".join(arm.label for arm in sweep.references)
    }

```
{command}
```

{verdict} Evaluation intervals come from a two-level bootstrap ({RESAMPLES} resamples) over the held-out
problems (paired across arms) and each arm's seeds{" — with a single seed, problem noise only" if seeds == {1} else ""};
training figures show the mean [lowest, highest] over seeds.

## Every point

{table}
Columns: {", ".join(metrics)} on the held-out problems; final entropy = the policy's entropy over the last
{SMOOTHING} training steps; clip/low, clip/high, kl3/mean = means over all steps; ratio range = the mean of each
step's lowest and highest ratio w; bad steps = updates undone or skipped as non-finite, summed over the seeds;
[l, u] = the ratio interval (per token for bands; — where the loss has none).
{EXPLORATION_NOTE if "entropy" in metrics else ""}
![figures against the swept parameter](sweep.png)

## On a shared axis

![every arm against the measured KL3 and the interval width](common.png)

## Differences from {baseline}

{difference_table}
{benchmark_section(directory, benchmarks)}
## Training

![training curves](training.png)

![where the trust region acts](mechanism.png)

{mechanism_markdown(mechanism)}
{MECHANISM_NOTE}

## Wall times (seconds)

| part | seconds |
|---|---|
{timing}

## Resolved recipe (shared by every arm except what its label sets)

```toml
{to_toml(recipe_to_dict(comparison.recipe))}```

## Versions

{versions}
"""
    atomic.write_text(directory / "report.md", report)
    return rows
