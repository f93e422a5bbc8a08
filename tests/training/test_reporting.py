"""Trackers (`run.report_to`): validation, missing libraries, and W&B offline runs checked record by record."""

import json
import os
import signal

import pytest
from helpers import fast, offline_runs, recipe_maker

from atrctl.cli import main
from atrctl.config.loading import TRACKERS, check_report_to, recipe_from_dict
from atrctl.config.schema import RunConfig
from atrctl.errors import UserError
from atrctl.training.loop import train
from atrctl.training.trackers import REPORTERS, comparison_group, reporter_names

FAST = fast("eval.problems=6", "eval.every=2", "algo.entropy_coef=0.01", "optim.lr=1e-3")


recipe = recipe_maker(FAST)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def records(directory):
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def offline(monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)


# ------------------------------------------------------------------ settings and bad input


def test_report_to_names_known_trackers_once():
    check_report_to([])
    check_report_to(["wandb", "tensorboard"])
    for bad, message in [
        (["wandbb"], "run.report_to: 'wandbb' is not a tracker; use one of tensorboard, wandb"),
        (["wandb", "wandb"], "names a tracker twice"),
        ("wandb", "run.report_to must be a list"),
    ]:
        with pytest.raises(UserError, match=message):
            check_report_to(bad)
        with pytest.raises(UserError, match=message):
            recipe_from_dict({"run": {"report_to": bad}})
    shorthand = RunConfig(report_to=["wandb"], tensorboard=True)  # --tensorboard: a shorthand
    assert reporter_names(shorthand) == ["wandb", "tensorboard"]
    assert reporter_names(RunConfig(report_to=["tensorboard"], tensorboard=True)) == ["tensorboard"]


def test_a_run_of_a_comparison_is_grouped_under_it(tmp_path):
    run = tmp_path / "compare-grpo-atr" / "runs" / "atr-s0"
    assert comparison_group(run) is None  # a folder named runs/ is not enough
    run.parent.mkdir(parents=True)
    (tmp_path / "compare-grpo-atr" / "compare.json").write_text("{}")
    assert comparison_group(run) == "compare-grpo-atr"
    assert comparison_group(tmp_path / "results" / "atr-arith-s0") is None


def test_a_tracker_that_cannot_start_is_one_line_and_leaves_no_run(results, capsys, monkeypatch):
    from atrctl.training import trackers as reporting

    def refuse(self, *args):
        raise RuntimeError("api_key not configured (no-tty)")

    monkeypatch.setattr(reporting.Wandb, "__init__", refuse)
    pytest.importorskip("wandb")
    sets = [arg for item in FAST for arg in ("--set", item)]
    capsys.readouterr()
    assert main(["train", "--results", str(results), "--name", "offline-not", "--report-to", "wandb", *sets]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "wandb reporting could not start (api_key not configured" in err
    assert "WANDB_MODE=offline" in err
    assert not (results / "offline-not").exists()  # the same command can simply be run again


def test_report_to_flag_and_missing_wandb_are_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    import builtins

    sets = [arg for item in FAST for arg in ("--set", item)]
    assert main(["train", "--results", str(tmp_path), "--name", "r", "--report-to", "wandb,tb", *sets]) == 2
    assert "run.report_to: 'tb' is not a tracker; use one of tensorboard, wandb" in capsys.readouterr().err

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    for command in (["train", "--name", "r"], ["compare", "grpo", "atr"]):
        assert main([*command, "--results", str(tmp_path), "--report-to", "wandb", *sets]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "needs the wandb package: pip install wandb" in err
    assert not any(tmp_path.iterdir())


def test_where_a_comparison_reports_is_not_part_of_what_it_trains():
    """A rerun may add or drop trackers and still reuse the comparison's runs."""
    from atrctl.config.loading import recipe_to_dict
    from atrctl.experiments.compare import _same_record

    def record(*overrides):
        return {"recipe": recipe_to_dict(recipe(*overrides)), "loss_args": {}}

    assert _same_record(record(), record('run.report_to=["wandb"]', "run.tensorboard=true"))
    assert not _same_record(record(), record("run.steps=7"))


# ------------------------------------------------------------------ W&B, offline


@pytest.mark.slow
def test_an_offline_wandb_run_holds_every_step_and_a_resume_continues_it(results, offline):
    directory = results / "watched"

    def stop_at_2(record):
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(recipe("run.steps=4", 'run.report_to=["wandb"]'), directory, results=results, on_step=stop_at_2)
    train(recipe("run.steps=4", 'run.report_to=["wandb"]'), directory, results=results, resume=True)

    first, resumed = offline_runs(directory)
    assert first["id"] == resumed["id"] == (directory / "wandb" / "id").read_text().strip()  # one W&B run
    assert first["name"] == "watched" and first["group"] == ""
    config = first["config"]
    assert config["algo"]["loss"] == "atr" and config["run"]["report_to"] == ["wandb"] and config["run"]["steps"] == 4
    logged = {}
    for row in first["history"] + resumed["history"]:  # W&B's own _step runs on; atrctl's step is the axis
        if "reward/mean" in row:
            logged[row["step"]] = row
    for record in records(directory):  # every metric of every step of metrics.jsonl, with its value
        row = logged[record["step"]]
        assert {key: row[key] for key in record} == pytest.approx(record, rel=1e-12)
        assert row["_step"] == record["step"]  # W&B's own step too: sessions line up when synced
    assert sorted(logged) == [1, 2, 3, 4]
    tables = [row for row in first["history"] + resumed["history"] if "samples/nrows" in row]
    assert [row["step"] for row in tables] == [0, 2, 4] and all(row["samples/nrows"] == 12 for row in tables)
    assert any("held-out/nrows" in row for row in resumed["history"])  # the table at the end
    assert (
        resumed["summary"]["final/eval/greedy"]
        == json.loads((directory / "summary.json").read_text())["final"]["eval/greedy"]
    )

    id_file = directory / "wandb" / "id"
    kept = id_file.read_text()
    id_file.write_text("../../not an id\n")  # damaged: refused in one line, naming the file, before sampling
    assert main(["eval", str(directory), "--n", "2", "--problems", "4"]) == 2
    assert not (directory / "eval").exists()
    id_file.write_text(kept)
    assert main(["eval", str(directory), "--n", "2", "--problems", "4"]) == 0  # its evaluation: the same W&B run
    evaluation = offline_runs(directory)[-1]
    assert evaluation["id"] == first["id"] and any("evaluation/passk/nrows" in row for row in evaluation["history"])


def test_the_tracker_names_a_recipe_takes_are_the_trackers_implemented():
    assert tuple(REPORTERS) == TRACKERS
