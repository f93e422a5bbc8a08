"""`atrctl sweep`: grids, planning and its refusals, the report's figures, and a small sweep end to end."""

import json
import math

import numpy as np
import pytest

from atrctl.cli import main
from atrctl.config.loading import load_recipe
from atrctl.core.divergence import kl3_bounds
from atrctl.errors import UserError
from atrctl.experiments import compare
from atrctl.experiments.sweep import Grid, grid_points, parse_grid, plan_sweep
from atrctl.experiments.sweep_report import _is_log_axis, region_of

FAST = ["rollout.prompts=4", "rollout.group_size=4", "algo.minibatches=2", "model.device=cpu"]


def plan(tmp_path, loss, grids, vs=(), **flags):
    options = dict(seeds=1, n=4, problems=8, jobs=1, max_kl3=None, eps=None, eps_high=None, name=None)
    options.update(flags)
    recipe = load_recipe(None, FAST)
    return plan_sweep(loss, grids, list(vs), recipe=recipe, overwrite=False, results=tmp_path, **options)


def test_a_grid_is_a_key_and_its_values_read_as_toml():
    assert parse_grid("max_kl3=0.02, 0.05,1e-1") == Grid("max_kl3", (0.02, 0.05, 0.1))
    assert parse_grid("optim.schedule=constant,cosine") == Grid("optim.schedule", ("constant", "cosine"))
    for bad, message in (("max_kl3", "write KEY=v1,v2"), ("max_kl3=", "write KEY=v1,v2"),
                         ("=0.1", "write KEY=v1,v2"), ("max_kl3=0.1,,0.2", "write KEY=v1,v2"),
                         ("max_kl3=0.1,0.10", "repeats a value"), ("max_kl3=1,1.0", "repeats a value")):  # fmt: skip
        with pytest.raises(UserError, match=message):
            parse_grid(bad)


def test_grid_points_are_the_product_labelled_as_arms():
    points = grid_points("grpo", [Grid("eps", (0.1, 0.3)), Grid("algo.num_iterations", (1, 2))])
    assert list(points) == [
        "grpo:eps=0.1,algo.num_iterations=1",
        "grpo:eps=0.1,algo.num_iterations=2",
        "grpo:eps=0.3,algo.num_iterations=1",
        "grpo:eps=0.3,algo.num_iterations=2",
    ]
    assert points["grpo:eps=0.3,algo.num_iterations=1"] == {"eps": 0.3, "algo.num_iterations": 1}


def test_a_plan_names_its_directory_and_writes_nothing(tmp_path):
    sweep = plan(tmp_path, "atr", ["max_kl3=0.05,0.2"], vs=["grpo:eps=0.1"])
    assert sweep.comparison.directory == tmp_path / "sweep-atr-max_kl3" and sweep.comparison.kind == "sweep"
    assert [arm.label for arm in sweep.comparison.arms] == ["atr:max_kl3=0.05", "atr:max_kl3=0.2", "grpo:eps=0.1"]
    assert [arm.label for arm in sweep.references] == ["grpo:eps=0.1"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("loss", "grids", "vs", "message"),
    [
        ("ppo", ["eps=0.1,0.2"], [], "'ppo' is not a registered loss"),
        ("atr", [], ["grpo"], "at least one --grid"),
        ("atr", ["max_kl3=0.1", "max_kl3=0.2"], [], "--grid max_kl3 is given twice"),
        ("atr", ["max_kl3=0.1"], [], "two grid points or a --vs arm"),
        ("atr", ["eps=0.1,0.2"], [], "atr takes no parameter 'eps'; its parameters: max_kl3=0.1"),
        ("atr", ["max_kl3=0.1,-1"], [], "arm 'atr:max_kl3=-1'"),
        ("atr", ["task.args.digits=1,2"], [], "may change only algo.*, optim.*, rollout.* keys"),
        ("atr", ["max_kl3=0.05,0.1"], ["atr"], "arms 'atr:max_kl3=0.1' and 'atr' train the same recipe"),
        ("atr", ["max_kl3=0.05,0.1"], ["grpo:delta=1"], "grpo takes no parameter 'delta'"),
        ("grpo", ["algo.minibatches=2,3"], [], "must be divisible by algo.minibatches (3)"),
    ],
)
def test_every_bad_sweep_is_refused_before_anything_is_written(tmp_path, loss, grids, vs, message):
    with pytest.raises(UserError) as caught:
        plan(tmp_path, loss, grids, vs)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_a_bad_sweep_on_the_command_line_is_one_line_with_exit_2(tmp_path, capsys):
    assert main(["sweep", "atr", "--grid", "max_kl3=0.1,abc", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: arm 'atr:max_kl3=abc'") and "\n" not in err and list(tmp_path.iterdir()) == []


def test_log_axis_for_delta_like_values_only():
    assert _is_log_axis([0.02, 0.05, 0.1, 0.2, 0.5]) and not _is_log_axis([0.1, 0.2, 0.3])
    assert not _is_log_axis(["constant", "cosine"]) and not _is_log_axis([0, 1, 10])


def test_region_of_every_kind_of_loss():
    recipe = load_recipe(None, FAST)
    with_loss = lambda loss, **args: load_recipe(None, [*FAST, f"algo.loss={loss}",  # noqa: E731
                                                        *(f"algo.args.{k}={v}" for k, v in args.items())])  # fmt: skip
    assert region_of(recipe) == pytest.approx(kl3_bounds(0.1), abs=1e-12)
    assert region_of(with_loss("atr", max_kl3=0.5)) == pytest.approx(kl3_bounds(0.5), abs=1e-12)
    assert region_of(with_loss("grpo", eps=0.3)) == pytest.approx((0.7, 1.3))
    assert region_of(with_loss("dapo")) == pytest.approx((0.8, 1.28))
    assert region_of(with_loss("cispo")) == pytest.approx((0.0, 1.28))
    assert region_of(with_loss("tv-band")) is None and region_of(with_loss("gspo")) is None
    assert region_of(with_loss("gmpo", eps_high=0.2)) == pytest.approx((math.exp(-0.4), math.exp(0.2)))
    assert region_of(with_loss("gppo")) == pytest.approx((0.8, 1.28)) and region_of(with_loss("sapo")) is None


SWEEP_SETS = [
    "task.args.digits=2", "model.device=cpu", "warmup.max_steps=40", "warmup.target_accuracy=1.0",
    "warmup.eval_every=40", "warmup.eval_problems=10", "warmup.batch_size=32", "rollout.prompts=4",
    "rollout.group_size=4", "algo.minibatches=2", "eval.problems=8", "eval.samples=2", "eval.every=2",
    "algo.skip_zero_advantage=false",  # the 40-step base earns ~nothing: train every row, so diagnostics exist
]  # fmt: skip


def sweep_args(results, grid="max_kl3=0.05,0.5"):
    sets = [flag for item in SWEEP_SETS for flag in ("--set", item)]
    return ["sweep", "atr", "--grid", grid, "--seeds", "1", "--steps", "2", "--n", "4", "--problems", "8",
            "--jobs", "1", "--name", "s", "--results", str(results), *sets]  # fmt: skip


@pytest.mark.slow
def test_a_two_point_sweep_resumes_after_an_interruption_and_reuses_its_points(tmp_path, capsys, monkeypatch):
    directory, real_run_jobs = tmp_path / "sweep-s", compare.run_jobs

    def interrupted(jobs, parallel, on_progress=None):  # the first run finishes, then Ctrl-C
        real_run_jobs(jobs[:1], parallel, on_progress)
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "run_jobs", interrupted)
    assert main(sweep_args(tmp_path)) == 130
    first = directory / "runs" / "atr_max_kl3=0.05-s0" / "summary.json"
    assert first.is_file() and not (directory / "runs" / "atr_max_kl3=0.5-s0" / "summary.json").exists()
    finished_at = first.stat().st_mtime_ns
    monkeypatch.setattr(compare, "run_jobs", real_run_jobs)

    assert main(sweep_args(tmp_path)) == 0  # the same command: the finished point is reused, the other trained
    assert first.stat().st_mtime_ns == finished_at
    for name in ("sweep.csv", "sweep.md", "sweep.png", "common.png", "training.png", "mechanism.png", "report.md"):
        assert (directory / name).stat().st_size > 0, name
    rows = {row["arm"]: row for row in _read_csv(directory / "sweep.csv")}
    assert list(rows) == ["atr:max_kl3=0.05", "atr:max_kl3=0.5"]
    for delta in (0.05, 0.5):
        row = rows[f"atr:max_kl3={delta}"]
        assert (row["l"], row["u"]) == pytest.approx(kl3_bounds(delta), abs=1e-10)
        records = [
            json.loads(line) for line in (directory / "runs" / f"atr_max_kl3={delta}-s0" / "metrics.jsonl").open()
        ]
        assert row["kl3/mean"] == pytest.approx(np.mean([r["kl3/mean"] for r in records]))
        assert row["final entropy"] == pytest.approx(np.mean([r["entropy"] for r in records]))  # < 10 steps: all
        assert row["pass@1 low"] <= row["pass@1"] <= row["pass@1 high"]
        assert row["bad steps"] == records[-1]["skipped_steps"] == 0
    report = (directory / "report.md").read_text()
    assert "# Sweep: atr over max_kl3" in report and "| atr:max_kl3=0.5 | ≥0.9 |" in report  # the mechanism table
    mechanism = _read_csv(directory / "mechanism.csv")
    assert [(row["arm"], row["p_old"]) for row in mechanism[:2]] == [("atr:max_kl3=0.05", "p<0.1"),
                                                                     ("atr:max_kl3=0.05", "0.1–0.5")]  # fmt: skip
    assert "atr:max_kl3=0.5" in capsys.readouterr().out

    points = ("atr_max_kl3=0.05-s0", "atr_max_kl3=0.5-s0")
    kept = [directory / "runs" / p / name for p in points for name in ("summary.json", "eval/result.json")]
    again = {path: path.stat().st_mtime_ns for path in kept}
    assert main(sweep_args(tmp_path, "max_kl3=0.05,0.5,0.2")) == 0  # a point added: only it is trained
    assert {path: path.stat().st_mtime_ns for path in kept} == again  # ... and evaluated
    assert len(_read_csv(directory / "sweep.csv")) == 3
    assert main([*sweep_args(tmp_path), "--set", "optim.lr=1e-3"]) == 2  # another shared recipe: refused
    assert "holds a sweep with another shared recipe" in capsys.readouterr().err


def _read_csv(path):
    import pandas as pd

    return pd.read_csv(path).to_dict("records")
