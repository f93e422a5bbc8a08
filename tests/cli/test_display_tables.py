"""Tables in a log: where stdout is not a terminal (nohup, SLURM, CI), each figure keeps its interval on one line."""

import io
import re

from atrctl.cli import display, tables

KS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CELL = re.compile(r"-?\d\.\d{3,4} \[-?\d\.\d{3,4}, -?\d\.\d{3,4}\]")


def piped_output(monkeypatch, table) -> str:
    """What `display.console` writes when stdout is a file, as under nohup or in CI."""
    out = io.StringIO()
    monkeypatch.setattr("sys.stdout", out)  # not a terminal
    display.stdout_console().print(table)
    return out.getvalue()


def compare_rows() -> list[dict]:
    rows = []
    for label, seeds in (("grpo", 4), ("atr:max_kl3=0.05,algo.num_iterations=2", 4), ("atr − grpo", 4)):
        row = {"row": label, "seeds": seeds}
        for metric in [f"pass@{k}" for k in KS] + ["greedy", "entropy"]:
            row[metric], row[f"{metric} low"], row[f"{metric} high"] = -0.0123, -0.0291, 0.0194
            row[f"{metric} excludes_0"] = False
        rows.append(row)
    return rows


def test_compare_table_cells_stay_on_one_line_in_a_log(monkeypatch):
    text = piped_output(monkeypatch, tables.compare_table(compare_rows(), KS))
    cells = CELL.findall(text)
    assert len(cells) == 3 * (len(KS) + 2)  # every figure with its whole interval, none wrapped or cut
    assert len(text.splitlines()) <= 10  # title, header, three rows, borders: no row spans several lines


def test_sweep_table_cells_stay_on_one_line_in_a_log(monkeypatch):
    columns = ["pass@1", "pass@256", "greedy", "final entropy", "kl3/mean"]
    rows = []
    for arm in ("atr:max_kl3=0.02", "atr:max_kl3=0.5", "grpo:eps=0.2", "dapo"):
        row = {"arm": arm}
        for column in columns:
            row[column], row[f"{column} low"], row[f"{column} high"] = 0.7123, 0.6812, 0.7391
        rows.append(row)
    text = piped_output(monkeypatch, tables.sweep_results_table(rows, [1, 256]))
    assert len(CELL.findall(text)) == 4 * len(columns)
    assert len(text.splitlines()) <= 4 + 4 + 2


def test_eval_table_cells_stay_on_one_line_in_a_log(monkeypatch):
    summary = {"avg@n": 0.7, "greedy": 0.87, "seed": 0, "seconds": 52.0, "entropy": 0.41}
    for k in KS:
        summary[f"pass@{k}"], summary[f"pass@{k}/low"], summary[f"pass@{k}/high"] = 0.7001, 0.6812, 0.7194
        summary[f"avg@{k}"], summary[f"avg@{k}/low"], summary[f"avg@{k}/high"] = 0.7, 0.6513, 0.7488
        summary[f"maj@{k}"] = 0.8
    text = piped_output(monkeypatch, tables.passk_table(summary, KS, "pass@k: results/compare-grpo-atr/runs/atr-s0"))
    assert len(re.findall(r"\[0\.6812, 0\.7194\]", text)) == len(re.findall(r"\[0\.6513, 0\.7488\]", text)) == len(KS)
    assert "entropy 0.4100 nats/token" in text  # the caption on one line too
