"""`atrctl plot` and the one curve-drawing path it shares with compare's and sweep's training.png."""

import csv
import json

import numpy as np
import pytest

from atrctl.cli import main
from atrctl.errors import UserError
from atrctl.experiments.compare_report import training_figure
from atrctl.reports import curves


def fake_run(directory, rewards, **more):
    """A run directory with only metrics.jsonl: reward/mean per step (steps from 1), plus other series."""
    directory.mkdir(parents=True)
    lines = []
    for i, reward in enumerate(rewards):
        record = {"step": i + 1, "reward/mean": reward, **{key: values[i] for key, values in more.items()}}
        lines.append(json.dumps(record))
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return directory


@pytest.fixture
def comparison(tmp_path):
    runs = tmp_path / "compare-grpo-atr" / "runs"
    fake_run(runs / "grpo-s0", [0.0, 1.0, 2.0, 3.0], entropy=[1.0, 1.0, 1.0, 1.0])
    fake_run(runs / "grpo-s1", [2.0, 3.0, 4.0, 5.0, 6.0], entropy=[1.0, 1.0, 1.0, 1.0, 1.0])  # longer: cut to 4
    fake_run(runs / "atr-s0", [1.0, 1.0, 1.0, 1.0])
    (runs / "atr-s0.log").write_text("a log beside the runs is not a run\n")
    return tmp_path / "compare-grpo-atr"


def test_a_comparison_gives_one_group_per_arm_and_a_run_its_own(comparison, tmp_path):
    groups = curves.run_groups([comparison])
    assert {label: [d.name for d in ds] for label, ds in groups.items()} == {
        "atr": ["atr-s0"],
        "grpo": ["grpo-s0", "grpo-s1"],
    }
    alone = fake_run(tmp_path / "other-day", [0.5])
    groups = curves.run_groups([comparison, alone])
    assert set(groups) == {"compare-grpo-atr/atr", "compare-grpo-atr/grpo", "other-day"}
    with pytest.raises(UserError, match="is neither a run .* nor a comparison or sweep"):
        curves.run_groups([tmp_path / "nothing-here"])


def test_curves_are_trailing_means_over_seeds_with_their_range(comparison):
    steps, values = curves._smoothed(curves.run_groups([comparison])["grpo"], "reward/mean", 2)
    assert steps.tolist() == [2, 3, 4]  # the window ends at each step; cut to the shorter seed's 4 steps
    assert values.tolist() == [[0.5, 1.5, 2.5], [2.5, 3.5, 4.5]]
    figure = curves.curves_figure(curves.run_groups([comparison]), ["reward/mean"], smooth=2)
    ax = figure.axes[0]
    lines = {line.get_label(): line.get_ydata().tolist() for line in ax.get_lines()}
    assert lines == {"atr": [1.0, 1.0, 1.0], "grpo (2 seeds)": [1.5, 2.5, 3.5]}
    band = ax.collections[0].get_paths()[0].vertices[:, 1]  # grpo's band: from the lower seed to the upper
    assert band.min() == 0.5 and band.max() == 4.5


def test_seeds_are_lined_up_by_step_not_by_position(tmp_path):
    """A metric one seed logged at steps 1, 3, 5, 7 and the other at 1-4 is averaged on the steps both have."""
    runs = tmp_path / "compare-x" / "runs"
    fake_run(runs / "a-s0", [0.0] * 7, entropy=[1.0, None, 3.0, None, 5.0, None, 7.0])
    fake_run(runs / "a-s1", [0.0] * 4, entropy=[10.0, 20.0, 30.0, 40.0])
    for path in runs.glob("*/metrics.jsonl"):  # None: the step did not log it
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in lines))
    steps, values = curves._smoothed(curves.run_groups([tmp_path / "compare-x"])["a"], "entropy", 1)
    assert steps.tolist() == [1, 3] and values.tolist() == [[1.0, 3.0], [10.0, 30.0]]


def test_a_run_given_twice_or_without_steps_is_refused(comparison, tmp_path):
    with pytest.raises(UserError, match="is given twice"):
        curves.run_groups([comparison, comparison / "."])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="no run has logged a step yet"):
        curves.check_metrics(curves.run_groups([empty]), None)


def test_compare_draws_its_training_figure_through_the_same_function(comparison):
    runs = curves.run_groups([comparison])
    ours = training_figure(runs)
    theirs = curves.curves_figure(runs, ["reward/mean", "entropy", "kl3/mean", "clip/low", "clip/high"])
    for a, b in zip(ours.axes, theirs.axes, strict=True):
        assert a.get_title() == b.get_title()
        assert [line.get_ydata().tolist() for line in a.get_lines()] == [
            line.get_ydata().tolist() for line in b.get_lines()
        ]


def test_metrics_default_to_those_logged_and_a_missing_one_is_named(comparison):
    groups = curves.run_groups([comparison])
    assert curves.check_metrics(groups, None) == ["reward/mean", "entropy"]  # no run logs kl3/mean
    assert curves.check_metrics(groups, ["entropy"]) == ["entropy"]
    with pytest.raises(UserError, match=r"no run logs the metric 'reward/man'; did you mean reward/mean"):
        curves.check_metrics(groups, ["reward/man"])


def test_plot_writes_the_figure_and_refuses_bad_input_in_one_line(comparison, tmp_path, capsys):
    out = tmp_path / "figures" / "curves.svg"
    assert main(["plot", str(comparison), "--metric", "reward/mean", "--smooth", "1", "--out", str(out)]) == 0
    assert out.stat().st_size > 0 and b"<svg" in out.read_bytes()[:400]
    assert "atr, grpo (2)" in capsys.readouterr().out
    for bad, message in [
        (["--smooth", "0"], "--smooth must be at least 1"),
        (["--metric", "rewards"], "no run logs the metric 'rewards'"),
        (["--out", str(tmp_path / "f.jpeg")], "unknown figure type '.jpeg'"),
    ]:
        assert main(["plot", str(comparison), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare-grpo-atr", "figures"]  # nothing else written


def test_plot_writes_the_drawn_numbers_beside_the_figure(comparison, tmp_path):
    out = tmp_path / "figures" / "curves.png"
    assert main(["plot", str(comparison), "--metric", "reward/mean", "--metric", "entropy", "--smooth", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    rows = list(csv.DictReader((tmp_path / "figures" / "curves.csv").open()))
    assert tuple(rows[0]) == curves.CurvePoint._fields
    grpo = [(r["step"], r["seeds"], r["mean"], r["lowest"], r["highest"])
            for r in rows if r["metric"] == "reward/mean" and r["arm"] == "grpo"]  # fmt: skip
    # seed 0 smoothed over 2 steps: 0.5, 1.5, 2.5; seed 1: 2.5, 3.5, 4.5 (cut to seed 0's last step)
    assert grpo == [("2", "2", "1.5", "0.5", "2.5"), ("3", "2", "2.5", "1.5", "3.5"), ("4", "2", "3.5", "2.5", "4.5")]
    assert {(r["arm"], r["mean"]) for r in rows if r["metric"] == "entropy"} == {("grpo", "1")}  # atr logs none
    drawn = curves.curves_figure(curves.run_groups([comparison]), ["reward/mean"], smooth=2).axes[0].get_lines()
    assert {line.get_label(): line.get_ydata().tolist() for line in drawn}["grpo (2 seeds)"] == [1.5, 2.5, 3.5]


def test_the_default_figure_goes_under_results_plots(comparison, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(comparison)]) == 0
    assert (tmp_path / "results" / "plots" / "compare-grpo-atr.png").stat().st_size > 0
    assert (tmp_path / "results" / "plots" / "compare-grpo-atr.csv").read_text().startswith("metric,arm,seeds,step")
    assert np.isfinite(curves._smoothed([comparison / "runs" / "atr-s0"], "reward/mean", 10)[1]).all()
