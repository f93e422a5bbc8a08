"""Tables, figures and report.md of a comparison, with uncertainty over problems *and* seeds.

A difference between two algorithms has two sources of noise: which held-out problems were drawn and
which training seeds were run.  Confidence intervals here come from a two-level bootstrap: problems are
resampled (jointly for all arms, since they share the problems: a paired comparison) and, within each
arm, its seeds are resampled.  With one seed the interval reflects problem noise only, and the report
says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from atrctl.files import atomic
from atrctl.reports.curves import SMOOTHING, arm_colours
from atrctl.training.rundir import RunDir

LEVEL = 0.95
RESAMPLES = 2000
TRAINING_METRICS = ("reward/mean", "entropy", "kl3/mean", "clip/low", "clip/high")


TRAINING = ("final entropy", "clip/low", "clip/high", "kl3/mean", "ratio/min", "ratio/max", "bad steps")
"""Per-run training figures of the table: the policy's entropy over the last SMOOTHING steps, the mean over
all steps of the clip fractions, KL3 per token and each step's ratio extremes, and the bad steps (updates
undone or skipped, `atrctl.training.bad_steps`): how stable each arm trained."""


def training_stats(directory: Path) -> dict[str, float]:
    """TRAINING of one run, from its metrics.jsonl."""
    records = RunDir(directory).read_metrics()

    def mean(key: str, last: int | None = None) -> float:
        values = [r[key] for r in records if key in r][-last if last else None :]
        return float(np.mean(values)) if values else float("nan")

    stats = {"final entropy": mean("entropy", SMOOTHING)}
    stats.update({key: mean(key) for key in TRAINING[1:-1]})
    stats["bad steps"] = float(records[-1].get("skipped_steps", 0)) if records else float("nan")  # a running count
    return stats


def interval_text(row: dict, column: str) -> str:
    """`mean [low, high]`, or — where nothing was measured (a run whose every row had advantage 0 logs no
    loss diagnostics)."""
    if not np.isfinite(row[column]):
        return "—"
    return f"{row[column]:.3f} [{row[f'{column} low']:.3f}, {row[f'{column} high']:.3f}]"


TRAINING_NOTE = f"""Training figures are the mean [lowest, highest] over an arm's seeds: final entropy = the policy's
entropy over the last {SMOOTHING} steps; clip/low, clip/high (the share of tokens whose gradient the loss removed or
cut below half, by side), kl3/mean = means over all steps; ratio range = the mean of each step's lowest and
highest ratio w; bad steps = the updates undone or skipped as non-finite, summed over the seeds."""


def training_rows(runs: dict[str, list[Path]]) -> list[dict]:
    """Per arm, TRAINING as the mean over its seeds and their lowest and highest: how the arms trained."""
    rows = []
    for label, directories in runs.items():
        per_seed = [training_stats(directory) for directory in directories]
        row = {"arm": label, "seeds": len(per_seed)}
        for key in TRAINING:
            values = np.array([stats[key] for stats in per_seed])
            row[key], row[f"{key} low"], row[f"{key} high"] = (
                float(values.mean()),
                float(values.min()),
                float(values.max()),
            )
        rows.append(row)
    return rows


def training_markdown(rows: Sequence[dict]) -> str:
    """The training table: each figure as mean [lowest, highest] over seeds, the ratio range as its means, the
    bad steps as their sum."""
    columns = TRAINING[:4]
    head = "| arm | seeds | " + " | ".join(columns) + " | ratio range | bad steps |"
    lines = [head, "|" + "---|" * (len(columns) + 4)]
    for row in rows:
        cells = [interval_text(row, column) for column in columns]
        lines.append(f"| {row['arm']} | {row['seeds']} | " + " | ".join(cells) + f" | {ratio_range(row)} | "
                     f"{bad_steps_text(row)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def ratio_range(row: dict) -> str:
    return f"{row['ratio/min']:.3f}–{row['ratio/max']:.3f}" if np.isfinite(row["ratio/min"]) else "—"


def bad_steps_text(row: dict) -> str:
    """The bad steps of an arm's seeds, summed (the row holds their mean)."""
    return f"{round(row['bad steps'] * row['seeds'])}" if np.isfinite(row["bad steps"]) else "—"


def two_level_bootstrap(arrays: Sequence[np.ndarray], resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """Bootstrap means of several [seeds, problems] arrays: [resamples, arms].

    Each resample draws one set of problem indices shared by all arms (paired) and, per arm, its seeds.
    """
    rng = np.random.default_rng(seed)
    problems = arrays[0].shape[1]
    out = np.empty((resamples, len(arrays)))
    for r in range(resamples):
        columns = rng.integers(0, problems, problems)
        for i, values in enumerate(arrays):
            rows = rng.integers(0, values.shape[0], values.shape[0])
            out[r, i] = values[np.ix_(rows, columns)].mean()
    return out


def interval(samples: np.ndarray) -> tuple[float, float]:
    tail = (1 - LEVEL) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def per_seed_pass_at_k(results: Sequence, k: int) -> np.ndarray:
    """[seeds, problems] pass@k of one arm's evaluations (all on the same problems, in the same order)."""
    return np.stack([result.pass_at(k) for result in results])


EXPLORATION = {"entropy": lambda r: r.entropy(), "distinct correct": lambda r: r.distinct_correct()}
"""Per-problem exploration measures a table adds where every evaluation has them (`passk.EvalResult`)."""


EXPLORATION_NOTE = """
entropy: the evaluation samples' mean surprisal per token (nats), which estimates the sampling distribution's
entropy; distinct correct (tasks with several correct answers, e.g. countdown): distinct correct answers as
written, per problem, among its n samples.
"""


def table_metrics(rows: Sequence[dict], ks: Sequence[int]) -> list[str]:
    """The columns of a comparison table: pass@k, greedy, then the exploration measures present."""
    return [f"pass@{k}" for k in ks] + ["greedy"] + [name for name in EXPLORATION if rows and name in rows[0]]


def comparison_table(results: dict[str, list], ks: Sequence[int]) -> list[dict]:
    """Rows: one per arm (mean over seeds and problems, with its CI), then each arm minus the first.

    Columns per metric: value, low, high; difference rows add `excludes_0`.
    """
    labels = list(results)
    metrics = {f"pass@{k}": [per_seed_pass_at_k(results[label], k) for label in labels] for k in ks}
    metrics["greedy"] = [np.stack([r.greedy.astype(float) for r in results[label]]) for label in labels]
    for name, per_problem in EXPLORATION.items():
        arrays = [[per_problem(r) for r in results[label]] for label in labels]
        if all(a is not None for arm in arrays for a in arm):
            metrics[name] = [np.stack(arm) for arm in arrays]
    rows = [{"row": label, "seeds": len(results[label])} for label in labels]
    diffs = [{"row": f"{label} − {labels[0]}", "seeds": len(results[label])} for label in labels[1:]]
    for name, arrays in metrics.items():
        boot = two_level_bootstrap(arrays)
        for i, row in enumerate(rows):
            row[name] = float(arrays[i].mean())
            row[f"{name} low"], row[f"{name} high"] = interval(boot[:, i])
        for i, row in enumerate(diffs, start=1):
            row[name] = float(arrays[i].mean() - arrays[0].mean())
            row[f"{name} low"], row[f"{name} high"] = interval(boot[:, i] - boot[:, 0])
            row[f"{name} excludes_0"] = row[f"{name} low"] > 0 or row[f"{name} high"] < 0
    return rows + diffs


def table_markdown(rows: Sequence[dict], metrics: Sequence[str]) -> str:
    """The table as markdown: `mean [low, high]`, a ★ on a difference whose interval excludes 0."""
    head = "| arm | seeds | " + " | ".join(metrics) + " |"
    lines = [head, "|" + "---|" * (len(metrics) + 2)]
    for row in rows:
        cells = []
        for metric in metrics:
            star = " ★" if row.get(f"{metric} excludes_0") else ""
            cells.append(f"{row[metric]:.3f} [{row[f'{metric} low']:.3f}, {row[f'{metric} high']:.3f}]{star}")
        lines.append(f"| {row['row']} | {row['seeds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


BENCHMARK_NOTE = """Each final model on every problem of each benchmark, at the benchmark's preset (`atrctl ls`), in
the prompt style the run was trained with: pass@1 is avg@n, the mean correctness of the n samples per problem
(papers' avg@32); pass@n, whether any sample is right. The intervals and ★ are the held-out table's."""


def benchmark_section(directory: Path, benchmarks: dict[str, dict[str, list]]) -> str:
    """benchmarks.csv (one row per benchmark and arm or difference) and the report's section: pass@1 (= avg@n),
    pass@n and greedy of each arm per benchmark, with the differences from the first arm."""
    import pandas as pd

    from atrctl.tasks import PRESETS

    if not benchmarks:
        return ""
    every, parts = [], ["## Benchmarks", "", BENCHMARK_NOTE, ""]
    for name, results in benchmarks.items():
        first, preset = next(iter(results.values()))[0], PRESETS[name]
        ks = sorted({1, first.n})
        rows = comparison_table(results, ks)
        every += [{"benchmark": name, **row} for row in rows]
        setting = (f"{len(first.problem_ids)} problems, n = {first.n}, T = {first.temperature:g}, "
                   f"top-p {preset.top_p:g}, ≤{preset.max_new_tokens:,} new tokens")  # fmt: skip
        parts += [f"### {name}: {setting}", "", table_markdown(rows, table_metrics(rows, ks))]
    atomic.write_text(directory / "benchmarks.csv", pd.DataFrame(every).to_csv(index=False))
    return "\n".join(parts) + "\n"


def training_figure(runs: dict[str, list[Path]]):
    """Training curves of every arm: mean over seeds, band from the lowest to the highest seed (`curves`)."""
    from atrctl.reports.curves import curves_figure

    return curves_figure(runs, TRAINING_METRICS, SMOOTHING)


MECHANISM_PANELS = (
    ("clip/low/{bin}", "tokens/neg/{bin}", "clip/low: share of the A<0 tokens\nwhose gradient is removed or halved"),
    ("clip/high/{bin}", "tokens/pos/{bin}", "clip/high: share of the A>0 tokens\nwhose gradient is removed or halved"),
    ("dlogp/pos/{bin}", None, "mean Δ log p of the A>0 tokens\n(since the rollout)"),
    ("dlogp/neg/{bin}", None, "mean Δ log p of the A<0 tokens\n(since the rollout)"),
)


def mechanism_summary(directories: Sequence[Path]) -> dict[str, list[float]]:
    """Per MECHANISM_PANELS panel, one value per p_old bin over every step of the runs (all seeds): a clip share
    as a fraction of the tokens of that sign and bin (ratio of the summed shares), a dlogp as the mean over
    the steps that measured it."""
    from atrctl.core.loss_metrics import OLD_PROBABILITY_BINS

    records = [record for d in directories for record in RunDir(d).read_metrics()]
    panels = {}
    for key, share, _ in MECHANISM_PANELS:
        values = []
        for name in OLD_PROBABILITY_BINS:
            top = [r[key.format(bin=name)] for r in records if key.format(bin=name) in r]
            if share is None:
                values.append(float(np.mean(top)) if top else np.nan)
            else:
                bottom = sum(r.get(share.format(bin=name), 0.0) for r in records)
                values.append(sum(top) / bottom if top and bottom > 0 else np.nan)  # gspo: no binned clip
        panels[key] = values
    return panels


BIN_LABELS = ("p<0.1", "0.1–0.5", "0.5–0.9", "≥0.9")  # OLD_PROBABILITY_BINS as the figures and tables show them
MECHANISM_COLUMNS = {"dlogp/pos/{bin}": "Δ log p, A>0", "dlogp/neg/{bin}": "Δ log p, A<0",
                     "clip/high/{bin}": "clip/high", "clip/low/{bin}": "clip/low"}  # fmt: skip


def mechanism_rows(runs: dict[str, list[Path]]) -> list[dict]:
    """Per arm and p_old bin, MECHANISM_PANELS as the mean over the arm's seeds of each seed's figure, with the
    lowest and highest seed: does an arm move probability toward the tokens it was already sure of?"""
    rows = []
    for label, directories in runs.items():
        per_seed = [mechanism_summary([directory]) for directory in directories]
        for i, name in enumerate(BIN_LABELS):
            row = {"arm": label, "p_old": name, "seeds": len(per_seed)}
            for key in MECHANISM_COLUMNS:
                values = np.array([summary[key][i] for summary in per_seed])
                values = values[np.isfinite(values)]
                row[key], row[f"{key} low"], row[f"{key} high"] = (
                    (float(values.mean()), float(values.min()), float(values.max())) if values.size else (np.nan,) * 3
                )
            rows.append(row)
    return rows


def mechanism_markdown(rows: Sequence[dict]) -> str:
    """The mechanism table: one row per arm and p_old bin, each figure as mean [lowest, highest] over seeds."""
    lines = [
        "| arm | p_old | " + " | ".join(MECHANISM_COLUMNS.values()) + " |",
        "|" + "---|" * (2 + len(MECHANISM_COLUMNS)),
    ]
    for row in rows:
        cells = [interval_text(row, key) for key in MECHANISM_COLUMNS]
        lines.append(f"| {row['arm']} | {row['p_old']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


MECHANISM_NOTE = """Where the trust region acts, by the probability p_old the sampler gave the token: Δ log p = the mean
of ln w = log π_θ − log π_old over the tokens of advantage A>0 (A<0) when their mini-batch was trained, i.e. how
far the step's earlier optimiser steps had already moved them since the rollout (0 in the first, on-policy
one); clip/high, clip/low = the share of those tokens whose gradient the loss removed or halved.  Each figure
is the mean over an arm's seeds of that seed's figure over all steps [lowest, highest seed]."""


def write_mechanism(directory: Path, runs: dict[str, list[Path]]) -> list[dict]:
    """mechanism.png and mechanism.csv of a comparison or sweep; returns the table's rows for its report."""
    import pandas as pd

    save_figure(mechanism_figure(runs), directory / "mechanism.png")
    rows = mechanism_rows(runs)
    atomic.write_text(directory / "mechanism.csv", pd.DataFrame(rows).to_csv(index=False))
    return rows


def mechanism_figure(runs: dict[str, list[Path]]):
    """Where each arm's trust region acts, by the sampling probability of the token: the share of tokens whose
    gradient the clip removed and the mean change of log-probability, per p_old bin (grouped bars)."""
    from matplotlib.figure import Figure

    from atrctl.core.loss_metrics import OLD_PROBABILITY_BINS

    fig = Figure(figsize=(4.4 * len(MECHANISM_PANELS), 4.4), layout="constrained")
    axes = fig.subplots(1, len(MECHANISM_PANELS))
    summaries = {label: mechanism_summary(directories) for label, directories in runs.items()}
    width = 0.8 / max(len(runs), 1)
    x = np.arange(len(OLD_PROBABILITY_BINS))
    for (key, _, title), ax in zip(MECHANISM_PANELS, axes, strict=True):
        for i, (colour, (label, summary)) in enumerate(zip(arm_colours(len(runs)), summaries.items(), strict=True)):
            ax.bar(x + (i - (len(runs) - 1) / 2) * width, summary[key], width, label=label, color=colour)
        ax.set_xticks(x, BIN_LABELS)
        ax.set(title=title, xlabel="p_old of the token")
        ax.axhline(0, color="0.3", lw=0.6)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7)
    fig.suptitle("Where the trust region acts, by the sampling probability of the token (every step, all seeds)")
    return fig


def save_figure(figure, path: Path) -> None:
    with atomic.atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=120)


def write_report(
    directory: Path,
    runs: dict[str, list[Path]],
    results: dict[str, list],
    ks: Sequence[int],
    *,
    command: str,
    recipe_toml: str,
    environment: dict[str, str],
    deltas: Sequence[float],
    eps: float,
    seconds: dict[str, float],
    benchmarks: dict[str, dict[str, list]] | None = None,
) -> list[dict]:
    """passk.csv / passk.md / passk.png / training.png / bounds.png / report.md in `directory`, and
    benchmarks.csv where the recipe names benchmarks; returns the held-out table's rows."""
    import pandas as pd

    from atrctl.reports.bounds_plot import bounds_figure
    from atrctl.reports.eval_report import plot_passk_curves

    rows = comparison_table(results, ks)
    metrics = table_metrics(rows, ks)
    atomic.write_text(directory / "passk.csv", pd.DataFrame(rows).to_csv(index=False))
    table = table_markdown(rows, metrics)
    atomic.write_text(directory / "passk.md", table)
    arm_rows = rows[: len(results)]
    curves = [
        (
            row["row"],
            list(ks),
            [row[f"pass@{k}"] for k in ks],
            [row[f"pass@{k} low"] for k in ks],
            [row[f"pass@{k} high"] for k in ks],
        )
        for row in arm_rows
    ]
    n = next(iter(results.values()))[0].n
    problems = len(next(iter(results.values()))[0].correct)
    title = f"pass@k: {problems} held-out problems, n = {n}\nmean over seeds, {LEVEL:.0%} CI (problems and seeds)"
    save_figure(plot_passk_curves(curves, title), directory / "passk.png")
    trained = training_rows(runs)
    atomic.write_text(directory / "training.csv", pd.DataFrame(trained).to_csv(index=False))
    save_figure(training_figure(runs), directory / "training.png")
    mechanism = write_mechanism(directory, runs)
    save_figure(bounds_figure(deltas, eps), directory / "bounds.png")

    starred = [row["row"] for row in rows[len(results) :] if any(row.get(f"{m} excludes_0") for m in metrics)]
    seeds = {row["seeds"] for row in arm_rows}
    verdict = (
        f"Differences whose {LEVEL:.0%} interval excludes 0 (★): {', '.join(starred)}."
        if starred
        else f"No difference between arms is larger than its {LEVEL:.0%} uncertainty."
    )
    single_seed_note = " — with a single seed they reflect problem noise only" if seeds == {1} else ""
    timing = "\n".join(f"| {name} | {value:.1f} |" for name, value in seconds.items())
    versions = "\n".join(f"- {key}: {value}" for key, value in environment.items())
    report = f"""# Comparison: {" vs ".join(results)}

```
{command}
```

{verdict} Intervals come from a two-level bootstrap ({RESAMPLES} resamples) over the held-out problems
(paired across arms) and over each arm's seeds{single_seed_note}.

## pass@k (mean over seeds and problems, {LEVEL:.0%} CI)

{table}{EXPLORATION_NOTE if "entropy" in metrics else ""}
![pass@k](passk.png)

{benchmark_section(directory, benchmarks or {})}
## Training

{training_markdown(trained)}
{TRAINING_NOTE}

![training curves](training.png)

![where the trust region acts](mechanism.png)

{mechanism_markdown(mechanism)}
{MECHANISM_NOTE}

## Trust regions

![trust regions](bounds.png)

## Wall times (seconds)

| part | seconds |
|---|---|
{timing}

## Resolved recipe (shared by every arm except `algo`)

```toml
{recipe_toml}```

## Versions

{versions}
"""
    atomic.write_text(directory / "report.md", report)
    return rows
