"""Warm-up (SFT) and the base cache: loss on answers only, measured stopping, reuse by key."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from atrctl.cli import main
from atrctl.config.loading import load_recipe
from atrctl.model.loading import build_char_tokenizer
from atrctl.tasks import Problem, get_task
from atrctl.training import base_cache
from atrctl.training.warmup import answer_budget, encode_examples

FAST = [
    "task.args.digits=1",
    "warmup.max_steps=30",
    "warmup.eval_every=10",
    "warmup.eval_problems=8",
    "warmup.batch_size=16",
    "warmup.target_accuracy=1.0",
    "model.device=cpu",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_examples_train_on_the_answer_and_eos_only(tokenizer):
    problems = [Problem("a", "12+34=", "46", "46"), Problem("b", "1+2=", "3", "3")]
    ids, attention, on_answer = encode_examples(tokenizer, problems)
    first = tokenizer.decode(ids[0][on_answer[0].bool()])
    assert first == "46" + tokenizer.eos_token
    assert tokenizer.decode(ids[1][on_answer[1].bool()]) == "3" + tokenizer.eos_token
    assert attention.sum(1).tolist() == [9, 6] and on_answer.sum(1).tolist() == [3, 2]
    assert (ids[1, 6:] == tokenizer.pad_token_id).all()
    assert answer_budget(tokenizer, problems) == 2 + 1 + 2


def test_base_is_built_once_and_reused(tmp_path, monkeypatch):
    recipe = load_recipe("recipes/default.toml", FAST)
    path, info = base_cache.ensure_base(recipe, tmp_path)
    assert path == tmp_path / "bases" / base_cache.base_key(recipe)
    assert info["steps"] == 30 and [step for step, _ in info["history"]] == [10, 20, 30]
    assert 0.0 <= info["accuracy"] <= 1.0
    assert info["identity"]["task_args"] == {"digits": 1, "ops": "+", "format": "compact"}
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 2
    assert sorted(p.name for p in (tmp_path / "bases").iterdir()) == [path.name]  # no staging left behind

    monkeypatch.setattr("atrctl.training.warmup.warm_up", lambda *a, **k: pytest.fail("a cached base was rebuilt"))
    assert base_cache.ensure_base(recipe, tmp_path) == (path, info)
    other = load_recipe("recipes/default.toml", [*FAST, "warmup.seed=1"])
    assert base_cache.base_key(other) != base_cache.base_key(recipe)


def test_default_task_arguments_name_the_same_base():
    implicit = load_recipe(None, [])  # task.args = {}: the task's own defaults
    explicit = load_recipe(None, ["task.args.digits=3", 'task.args.ops="+"'])
    assert base_cache.base_key(implicit) == base_cache.base_key(explicit)
    assert base_cache.base_key(load_recipe(None, ["task.args.digits=2"])) != base_cache.base_key(implicit)


def test_warmup_is_deterministic(tmp_path):
    recipe = load_recipe("recipes/default.toml", FAST)
    first, _ = base_cache.ensure_base(recipe, tmp_path / "a")
    second, _ = base_cache.ensure_base(recipe, tmp_path / "b")
    a = AutoModelForCausalLM.from_pretrained(first).state_dict()
    b = AutoModelForCausalLM.from_pretrained(second).state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_warmup_that_reaches_its_target_early_reports_its_real_total(tmp_path, monkeypatch):
    """The progress total shrinks to the step that reached the target, so the bar ends complete: a log's
    heartbeat once kept writing "warm-up base 400/3000" with a growing remaining time through the training."""
    recipe = load_recipe("recipes/default.toml", FAST)
    monkeypatch.setattr(
        "atrctl.training.warmup.greedy_accuracy", lambda *_, **__: 1.0
    )  # the target, at the first check
    seen = []
    _, info = base_cache.ensure_base(recipe, tmp_path, lambda *report: seen.append(report[:2]))
    assert info["steps"] == 10
    assert seen == [(step, 30) for step in range(1, 10)] + [(10, 10)]


def test_real_models_pass_through_without_warmup(tmp_path):
    recipe = load_recipe(None, ["model.base=some/hub-model"])
    assert base_cache.ensure_base(recipe, tmp_path) == ("some/hub-model", {})
    assert not (tmp_path / "bases").exists()


def test_warmup_command_reports_accuracy(tmp_path, capsys):
    args = ["warmup", "--results", str(tmp_path)] + [a for s in FAST for a in ("--set", s)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "held-out greedy accuracy" in out
    (base,) = (tmp_path / "bases").iterdir()
    assert json.loads((base / "base.json").read_text())["steps"] == 30


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("task.name=arithmetic", "unknown task 'arithmetic' (did you mean 'arith'?)"),
        ("model.base=huge", "not a preset"),
        ("task.args.digitz=2", "has no parameter digitz"),
        ("task.args.digits=0", "digits=0 is invalid"),
        ("warmup.lr=0", "warmup.lr must be > 0"),
    ],
)
def test_warmup_bad_input_is_one_line(tmp_path, capsys, override, message):
    assert main(["warmup", "--results", str(tmp_path), "--set", override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "bases").exists()


def test_data_tasks_report_missing_or_malformed_files(tmp_path):
    from atrctl.errors import UserError

    with pytest.raises(UserError, match="does not exist"):
        get_task("gsm8k", path=str(tmp_path / "missing.jsonl")).problems("train", 2, 0)
    with pytest.raises(UserError, match="question"):
        get_task("gsm8k", path="tests/data/malformed_sample.jsonl").problems("train", 2, 0)
