"""Benchmarks: AIME read offline from sgl-eval's copy, MATH-500 and GSM8K's test set by hub name or file, each
a test split only, with its preset; a missing package or split is one line naming the fix."""

import importlib.util
import json

import pytest
from helpers import DATA

from atrctl.errors import UserError
from atrctl.tasks import PRESETS, TASKS, get_task
from atrctl.tasks.benchmarks import BENCHMARKS
from atrctl.tasks.data import BOXED_INSTRUCTION


@pytest.mark.parametrize("name", ["aime24", "aime25", "aime26"])
def test_each_aime_year_is_thirty_integer_answers_read_offline(name):
    task = get_task(name)
    problems = task.problems("test", None, 0)
    assert len(problems) == 30 and len({p.id for p in problems}) == 30 and len({p.prompt for p in problems}) == 30
    assert all(p.answer.isdigit() and 0 <= int(p.answer) <= 999 for p in problems)
    assert task.instruction == BOXED_INSTRUCTION  # the instruct format: the problem, then the boxed instruction
    assert task.problems("test", 5, 0) == task.problems("test", None, 0)[:5]
    assert all(task.score(p, f"<think>\nchecking\n</think>\n\\boxed{{{p.answer}}}").reward == 1 for p in problems)


def test_aime25_starts_with_the_problem_whose_answer_is_known():
    """A spot check of the data against the published 2025 AIME I problem 1 (bases b > 9 with 17_b | 97_b: 70)."""
    first = {p.id: p for p in get_task("aime25").problems("test", None, 0)}["aime25-0"]
    assert "17_b" in first.prompt and "97_b" in first.prompt and first.answer == "70"


def test_a_benchmark_has_no_training_problems():
    for name in ("aime25", "math500"):
        args = {"path": str(DATA / "math500_sample.jsonl")} if name == "math500" else {}
        with pytest.raises(UserError, match=f"{name} is a benchmark: it has test problems only"):
            get_task(name, **args).problems("train", None, 0)


def test_missing_sgl_eval_is_one_line_naming_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sgl_eval" else real(name, *a))
    with pytest.raises(UserError, match=r"pip install --no-deps sgl-eval==0\.1\.3") as error:
        get_task("aime24")
    assert "\n" not in str(error.value)


def test_an_aime_file_of_the_packaged_format_stands_in(tmp_path):
    task = get_task("aime25", path=str(DATA / "aime_sample.jsonl"))  # the row without an integer answer is skipped
    problems = {p.id: p for p in task.problems("test", None, 0)}
    assert set(problems) == {"stand-in-0", "stand-in-1"} and problems["stand-in-0"].answer == "649"
    assert task.score(problems["stand-in-0"], "so 7^2026 ≡ 649 (mod 1000).\n\nFinal answer: 649").reward == 1
    with pytest.raises(UserError, match="expects rows with problem, expected_answer"):
        get_task("aime25", path=str(DATA / "gsm8k_sample.jsonl"))


@pytest.mark.parametrize(("name", "file", "rows"), [("math500", "math500_sample.jsonl", 8),
                                                     ("gsm8k-test", "gsm8k_sample.jsonl", 10)])  # fmt: skip
def test_a_local_benchmark_file_is_all_test_problems(name, file, rows):
    """Unlike the training tasks, whose one file is cut 90/10 by a hash, a benchmark's file is all test."""
    task = get_task(name, path=str(DATA / file))
    problems = task.problems("test", None, 0)
    assert len(problems) == rows and all(task.score(p, p.solution).reward == 1 for p in problems)


def _hub(monkeypatch, splits: dict[str, list[dict]]):
    import datasets

    calls = []

    def load_dataset(name, config=None, **kwargs):
        calls.append((name, config))
        return datasets.DatasetDict({split: datasets.Dataset.from_list(rows) for split, rows in splits.items()})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_math500_and_gsm8k_test_load_by_hub_name(monkeypatch):
    """The hub's layouts: MATH-500 is one 'test' split with an answer column; GSM8K has train and test."""
    math500 = [json.loads(line) for line in (DATA / "math500_sample.jsonl").read_text().splitlines()]
    calls = _hub(monkeypatch, {"test": math500})
    assert len(get_task("math500").problems("test", None, 0)) == 8
    assert calls == [("HuggingFaceH4/MATH-500", None)]

    gsm8k = [json.loads(line) for line in (DATA / "gsm8k_sample.jsonl").read_text().splitlines()]
    calls = _hub(monkeypatch, {"train": gsm8k[:3], "test": gsm8k[3:]})
    assert len(get_task("gsm8k-test").problems("test", None, 0)) == 7  # the test split whole, not the train rows
    assert calls == [("openai/gsm8k", "main")]
    with pytest.raises(UserError, match=r"has no split 'validation' \(it has train, test\); pass split="):
        get_task("gsm8k-test", split="validation")


def test_math500_reads_latex_answers_from_the_answer_column():
    task = get_task("math500", path=str(DATA / "math500_sample.jsonl"))
    polar = next(p for p in task.problems("test", None, 0) if "polar" in p.prompt)
    assert polar.answer == "\\left( 2, \\frac{3 \\pi}{2} \\right)"
    assert task.score(polar, "The point is $\\boxed{\\left(2,\\frac{3\\pi}{2}\\right)}$.").reward == 1
    assert task.score(polar, "The point is $\\boxed{(2, \\frac{\\pi}{2})}$.").reward == 0


def test_every_benchmark_is_a_task_with_a_preset():
    assert set(BENCHMARKS) <= set(TASKS) and set(PRESETS) == set(BENCHMARKS)
    for preset in PRESETS.values():
        assert preset.n >= 1 and 0 < preset.temperature and 0 < preset.top_p <= 1 and preset.max_new_tokens >= 1
