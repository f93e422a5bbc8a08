"""The CLI's rich tables: trust regions, pass@k, comparisons, sweeps and the catalogue.  Every number comes from
the core; these only lay them out."""

from __future__ import annotations

from collections.abc import Sequence

from rich.markup import escape
from rich.table import Table


def methods_table(rows) -> Table:
    table = Table(title=r"Trust regions in ratio space: clip w = π_θ/π_old to \[l, u]")
    table.caption = "TRL: epsilon / epsilon_high; verl: clip_ratio_low / clip_ratio_high — the same two numbers"
    return _interval_rows(table, rows)


def family_table(rows) -> Table:
    table = Table(title="Other losses with a constant ratio interval, at their defaults")
    table.caption = (
        "not a plain clip: each treats the tokens outside its own way (atrctl ls); its settings: atrctl export"
    )
    return _interval_rows(table, rows)


def _interval_rows(table: Table, rows) -> Table:
    for column in ("method", "setting", "l", "u", "1 − l", "u − 1", "ln l", "ln u", "TRL / verl settings"):
        table.add_column(column, justify="left" if column in ("method", "setting") else "right")
    for row in rows:
        table.add_row(
            row.method,
            row.setting,
            f"{row.low:.6f}",
            f"{row.high:.6f}",
            f"{row.eps_low:.4f}",
            f"{row.eps_high:.4f}",
            f"{row.log_low:.4f}",
            f"{row.log_high:.4f}",
            f"{row.eps_low:.6g} / {row.eps_high:.6g}" if row.clip_range else f"atrctl export {row.method} --to …",
        )
    return table


def sweep_table(rows) -> Table:
    table = Table(title="ATR-GRPO: KL3 level δ → ratio bounds and the equivalent clip ε's")
    for column in ("max_kl3 δ", "l", "u", "eps_low = 1 − l", "eps_high = u − 1", "(u − 1) / (1 − l)"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row.setting.split("=")[1],
            f"{row.low:.6f}",
            f"{row.high:.6f}",
            f"{row.eps_low:.6f}",
            f"{row.eps_high:.6f}",
            f"{row.eps_high / row.eps_low:.3f}",
        )
    return table


def passk_table(summary: dict, ks: Sequence[int], title: str) -> Table:
    table = Table(title=escape(title))
    table.caption = (
        f"avg@n {summary['avg@n']:.4f}  greedy {summary['greedy']:.4f}  seed {summary['seed']}  "
        f"{summary['seconds']:.1f} s"
        + (f"  entropy {summary['entropy']:.4f} nats/token" if "entropy" in summary else "")
        + (f"  distinct correct {summary['distinct correct']:.2f}" if "distinct correct" in summary else "")
    )
    for column in ("k", "pass@k", "95% CI", "avg@k", "95% CI ", "maj@k"):
        table.add_column(column, justify="right")
    for k in ks:
        cells = []
        for metric in ("pass", "avg"):
            low, high = summary[f"{metric}@{k}/low"], summary[f"{metric}@{k}/high"]
            cells += [f"{summary[f'{metric}@{k}']:.4f}", escape(f"[{low:.4f}, {high:.4f}]")]
        table.add_row(str(k), *cells, f"{summary[f'maj@{k}']:.4f}")
    return table


def compare_table(rows: list[dict], ks: Sequence[int]) -> Table:
    from atrctl.experiments.compare_report import table_metrics

    metrics = table_metrics(rows, ks)
    table = Table(title="pass@k, mean over seeds and problems [95% CI]; ★ = difference whose CI excludes 0")
    table.add_column("arm")
    table.add_column("seeds", justify="right")
    for metric in metrics:
        table.add_column(metric, justify="right")
    for row in rows:
        cells = [
            f"{row[m]:.3f} \\[{row[m + ' low']:.3f}, {row[m + ' high']:.3f}]"
            + (" ★" if row.get(f"{m} excludes_0") else "")
            for m in metrics
        ]
        table.add_row(row["row"], str(row["seeds"]), *cells)
    return table


def sweep_results_table(rows: list[dict], ks: Sequence[int]) -> Table:
    """A sweep's headline per arm: pass@1, pass@k at the largest k, greedy, final entropy, kl3/mean."""
    from atrctl.experiments.compare_report import interval_text

    columns = ["pass@1", f"pass@{max(ks)}", "greedy", "final entropy", "kl3/mean"]
    table = Table(title="sweep: evaluation mean [95% CI]; training mean [seed range]")
    table.add_column("arm")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(escape(row["arm"]), *(escape(interval_text(row, c)) for c in columns))
    return table


def catalog_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    """One section of `atrctl ls`."""
    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(escape(cell) for cell in row))
    return table
