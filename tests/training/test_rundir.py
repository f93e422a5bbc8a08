"""The run-directory contract, in one place: where each file lives, how it is read and written, and
what "finished" and "evaluated" mean (docs/design.md §5)."""

import json
import sys

import pytest

from atrctl.config.loading import load_recipe
from atrctl.errors import UserError
from atrctl.model.loading import build_char_tokenizer, build_model
from atrctl.training.rundir import RunDir, default_run_name, environment

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def test_layout():
    run = RunDir("results/r")
    assert (run.config.name, run.metrics.name, run.summary.name) == ("config.toml", "metrics.jsonl", "summary.json")
    assert [p.name for p in (run.checkpoint, run.model, run.eval, run.tensorboard)] == [
        "checkpoint",
        "model",
        "eval",
        "tensorboard",
    ]
    assert all(p.parent == run.path for p in (run.config, run.metrics, run.checkpoint, run.model, run.eval))
    assert run.name == "r"


def test_config_round_trip_keeps_provenance_apart(tmp_path):
    import torch

    recipe = load_recipe(None, ["optim.lr=1e-3", "task.args.digits=2"])
    run = RunDir(tmp_path / "r")
    assert not run.is_run
    with pytest.raises(UserError, match="has no config.toml"):
        run.recipe()
    run.create(recipe, environment(torch.device("cpu")))
    assert run.is_run and run.recipe() == recipe
    provenance = tomllib.loads(run.config.read_text())["environment"]
    assert {"atrctl", "git_commit", "torch", "transformers", "device", "threads", "processes"} <= set(provenance)
    (run.path / "stale").write_text("x")
    run.create(recipe, {})  # an approved overwrite starts afresh
    assert sorted(p.name for p in run.path.iterdir()) == ["config.toml"]


def test_metrics_append_read_trim_and_a_torn_line(tmp_path):
    run = RunDir(tmp_path)
    assert run.read_metrics() == [] and run.steps_logged() == 0 and run.last_eval() == {}
    for step in (1, 2, 3):
        record = {"step": step, "loss": step / 10}
        if step == 2:
            record.update({"eval/greedy": 0.5, "eval/pass@1": 0.25})
        run.append_metrics(record)
    with run.metrics.open("a") as handle:
        handle.write('{"step": 4, "lo')  # a crash mid-write
    assert [r["step"] for r in run.read_metrics()] == [1, 2, 3] and run.steps_logged() == 4
    assert run.last_eval() == {"eval/greedy": 0.5, "eval/pass@1": 0.25}
    run.trim_metrics(2)  # resume from the step-2 checkpoint: steps 3 and the torn line go
    assert (
        run.metrics.read_text()
        == '{"step": 1, "loss": 0.1}\n'
        + json.dumps({"step": 2, "loss": 0.2, "eval/greedy": 0.5, "eval/pass@1": 0.25})
        + "\n"
    )


def test_finished_and_evaluated(tmp_path):
    run = RunDir(tmp_path)
    tokenizer = build_char_tokenizer()
    run.write_summary({"base": {"eval/greedy": 0.1}})
    assert run.read_summary() == {"base": {"eval/greedy": 0.1}} and not run.finished
    run.finish(build_model("tiny", tokenizer).save_pretrained, tokenizer, {"base": {}, "final": {"eval/greedy": 0.2}})
    assert (run.model / "config.json").is_file() and not (tmp_path / ".model.tmp").exists()
    assert run.finished and run.read_summary()["final"] == {"eval/greedy": 0.2} and not run.evaluated
    run.eval.mkdir()
    (run.eval / "passk.csv").write_text("k\n")
    assert run.evaluated


def test_the_model_appears_after_the_summary(tmp_path, monkeypatch):
    """A crash while finishing leaves no model/: the run is not taken for finished (resume finishes it)."""
    run = RunDir(tmp_path)
    tokenizer = build_char_tokenizer()
    monkeypatch.setattr(RunDir, "write_summary", lambda self, summary: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        run.finish(build_model("tiny", tokenizer).save_pretrained, tokenizer, {"final": {}})
    assert not run.model.exists() and not run.finished


def test_starting_a_run_never_clobbers_one(tmp_path):
    run = RunDir(tmp_path / "r")
    run.check_can_start(resume=False, overwrite=False)  # nothing there yet
    run.path.mkdir()
    (run.path / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="already exists"):
        run.check_can_start(resume=False, overwrite=False)
    with pytest.raises(UserError, match="is not a run .* replaces only runs"):  # no config.toml: not a run
        run.check_can_start(resume=False, overwrite=True)
    run.config.write_text("")
    run.check_can_start(resume=False, overwrite=True)
    with pytest.raises(UserError, match="no checkpoint to resume"):
        run.check_can_start(resume=True, overwrite=False)


def test_default_run_name():
    name = default_run_name(load_recipe(None, ["algo.loss=grpo", "run.seed=3"]))
    assert name.startswith("grpo-arith-s3-") and len(name) == len("grpo-arith-s3-") + len("20261201-092048")


def test_a_corrupt_config_or_summary_is_one_clear_error(tmp_path):
    run = RunDir(tmp_path)
    run.config.write_text("[task\nname = ")
    with pytest.raises(UserError, match="config.toml is not valid TOML"):
        run.recipe()
    for text, message in (('{"base": ', "damaged .not JSON"), ("[1, 2]", "damaged .holds list, not an object")):
        run.summary.write_text(text)
        with pytest.raises(UserError, match=message):
            run.read_summary()
