"""Evaluation math (pass@k, maj@k, bootstrap intervals) and sampling a model for an evaluation."""

import math
import re

import numpy as np
import pytest

from atrctl.core.passk import (
    EvalResult,
    avg_at_n,
    bootstrap_ci,
    default_ks,
    majority_at_k,
    majority_correct,
    pass_at_k,
    pass_at_k_per_problem,
)
from atrctl.model.loading import build_char_tokenizer, build_model
from atrctl.rollout.evaluate import evaluate_model
from atrctl.tasks import Score, get_task


def test_pass_at_k_matches_the_binomial_formula():
    for n in range(1, 21):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases():
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0 and pass_at_k(10, 1, 10) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    for bad in ((4, 1, 5), (4, 1, 0), (4, 5, 1), (4, -1, 1)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_is_accurate_for_large_n():
    assert pass_at_k(1024, 1, 1) == pytest.approx(1 / 1024, rel=1e-12)
    assert pass_at_k(1024, 512, 1) == pytest.approx(0.5, rel=1e-12)
    exact = 1 - math.comb(1024 - 3, 256) / math.comb(1024, 256)  # Python's exact integers
    assert pass_at_k(1024, 3, 256) == pytest.approx(exact, rel=1e-12)
    values = [pass_at_k(1024, 5, k) for k in default_ks(1024)]
    assert all(0 < v <= 1 for v in values) and values == sorted(values)


def test_pass_at_k_per_problem_keeps_the_shape():
    out = pass_at_k_per_problem([0, 2, 4], 4, 2)
    assert out.shape == (3,) and out.tolist() == [0.0, pytest.approx(1 - 1 / 6), 1.0]
    assert pass_at_k_per_problem(np.array([[1, 2], [3, 4]]), 4, 1).tolist() == [[0.25, 0.5], [0.75, 1.0]]


def test_default_ks_are_powers_of_two_and_n():
    assert default_ks(1) == [1]
    assert default_ks(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert default_ks(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_bootstrap_interval_holds_the_mean_and_narrows_with_more_problems():
    rng = np.random.default_rng(0)
    few, many = rng.binomial(1, 0.4, 50).astype(float), rng.binomial(1, 0.4, 2000).astype(float)
    low_few, high_few = bootstrap_ci(few)
    low_many, high_many = bootstrap_ci(many)
    assert low_few <= few.mean() <= high_few and low_many <= many.mean() <= high_many
    assert high_many - low_many < 0.5 * (high_few - low_few)
    assert bootstrap_ci(few, seed=3) == bootstrap_ci(few, seed=3)  # deterministic given the seed


def test_bootstrap_resamples_problems_not_seeds():
    per_seed = np.array([[0.0, 1.0, 0.5], [1.0, 0.0, 0.5]])  # every problem averages to 0.5 over seeds
    assert bootstrap_ci(per_seed) == (0.5, 0.5)
    with pytest.raises(ValueError):
        bootstrap_ci(np.zeros((2, 2, 2)))


PARSED = [
    ["7", "7", "3", None],  # majority 7, correct
    ["5", "6", "6", "5"],  # tie 5/6: 5 came first, wrong
    [None, None, None, "9"],  # one vote, correct only once it is seen
    ["1", "2", "2", "2"],  # majority 2, wrong, though a sample is right
]
REWARDS = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0]], dtype=np.float32)


def test_majority_vote_on_hand_built_answers():
    assert majority_correct(PARSED, REWARDS, 4).tolist() == [True, False, True, False]
    assert majority_correct(PARSED, REWARDS, 1).tolist() == [True, False, False, True]
    assert majority_correct(PARSED, REWARDS, 3).tolist() == [True, True, False, False]
    assert majority_correct(PARSED, REWARDS, 2).tolist() == [True, False, False, True]  # ties: the first answer
    assert majority_at_k(PARSED, REWARDS, 4) == 0.5
    with pytest.raises(ValueError):
        majority_at_k(PARSED, REWARDS, 5)


def test_summary_reports_every_figure():
    result = EvalResult(["a", "b", "c", "d"], 4, REWARDS, PARSED, np.array([True, False, False, True]), 1.0, 0, 1.5)
    assert result.correct.tolist() == [2, 2, 1, 1]
    summary = result.summary([1, 4])
    assert summary["pass@1"] == pytest.approx(avg_at_n(REWARDS)) == pytest.approx(6 / 16)
    assert summary["pass@4"] == 1.0 and summary["maj@4"] == 0.5 and summary["greedy"] == 0.5
    assert summary["pass@1/low"] <= summary["pass@1"] <= summary["pass@1/high"]
    assert (summary["n"], summary["problems"]) == (4, 4)


def test_avg_at_k_is_each_problems_first_k_samples_by_hand():
    from atrctl.core.passk import avg_at_k_per_problem

    assert avg_at_k_per_problem(REWARDS, 1).tolist() == [1, 0, 0, 1]
    assert avg_at_k_per_problem(REWARDS, 2).tolist() == [1, 0.5, 0, 0.5]
    assert avg_at_k_per_problem(REWARDS, 4).tolist() == [0.5, 0.5, 0.25, 0.25]
    with pytest.raises(ValueError, match="between 1 and n"):
        avg_at_k_per_problem(REWARDS, 5)
    result = EvalResult(["a", "b", "c", "d"], 4, REWARDS, PARSED, np.zeros(4, bool), 1.0, 0, 1.5)
    summary = result.summary([1, 2, 4])
    assert summary["avg@1"] == 0.5 and summary["avg@2"] == 0.5
    assert summary["avg@4"] == summary["avg@n"] == pytest.approx(summary["pass@1"])  # at k = n: pass@1's estimate
    for k in (1, 2, 4):
        assert summary[f"avg@{k}/low"] <= summary[f"avg@{k}"] <= summary[f"avg@{k}/high"]
    assert summary["avg@1/high"] - summary["avg@1/low"] > summary["avg@4/high"] - summary["avg@4/low"]  # fewer, wider


class FirstDigitTask:
    """Arithmetic prompts, but a completion counts as correct when it starts with 0-4: a random model
    then earns both rewards, and its first character is the parsed answer that votes."""

    name = "first-digit"

    def __init__(self):
        self.inner = get_task("arith", digits=1)

    def problems(self, split, n, seed):
        return self.inner.problems(split, n, seed)

    def score(self, problem, completion):
        head = completion[:1] or None
        return Score(float(head is not None and head in "01234"), head)


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_char_tokenizer()
    return build_model("tiny", tokenizer, seed=0).eval(), tokenizer


def test_evaluate_model_is_reproducible_and_consistent(tiny):
    model, tokenizer = tiny
    task = FirstDigitTask()
    problems = task.problems("test", 6, 0)
    seen = []
    kwargs = dict(n=8, temperature=1.0, max_new_tokens=3, batch_size=16)
    result = evaluate_model(
        model, tokenizer, task, problems, seed=0, on_progress=lambda d, t: seen.append((d, t)), **kwargs
    )
    assert result.rewards.shape == (6, 8) and len(result.parsed) == 6 and all(len(r) == 8 for r in result.parsed)
    assert result.greedy.shape == (6,) and result.greedy.dtype == bool
    assert result.problem_ids == [p.id for p in problems] and result.n == 8 and result.seconds > 0
    assert seen == [(6, 54), (22, 54), (38, 54), (54, 54)]  # 6 greedy at once, then 16 // 8 = 2 problems a batch
    assert 0 < result.rewards.mean() < 1  # both outcomes occur, so the figures below mean something
    for row, answers in zip(result.rewards, result.parsed, strict=True):
        assert all((r == 1) == (a is not None and a in "01234") for r, a in zip(row, answers, strict=True))
    again = evaluate_model(model, tokenizer, task, problems, seed=0, **kwargs)
    assert np.array_equal(again.rewards, result.rewards) and again.parsed == result.parsed
    other = evaluate_model(model, tokenizer, task, problems, seed=1, **kwargs)
    assert other.parsed != result.parsed
    summary = result.summary(default_ks(8))
    assert summary["pass@1"] <= summary["pass@2"] <= summary["pass@8"]


def test_exploration_measures_by_hand():
    forms = [["3*5+7", "7+3*5", "3*5+7", None], ["2+2", None, None, "9-5"]]
    rewards = np.array([[1, 1, 1, 0], [0, 0, 0, 1]], dtype=np.float32)
    nats, lengths = np.array([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5]]), np.array([[1, 1, 2, 6], [1, 1, 1, 1]])
    parsed = [["22"] * 4, ["4"] * 4]
    result = EvalResult(["a", "b"], 4, rewards, parsed, np.array([True, False]), 1.0, 0, 0.0,
                        nats=nats, lengths=lengths, forms=forms)  # fmt: skip
    assert result.distinct_correct().tolist() == [2.0, 1.0]  # the wrong "2+2" and the repeat count nothing
    assert result.entropy().tolist() == pytest.approx([10 / 10, 2 / 4])
    summary = result.summary([1])
    assert summary["distinct correct"] == 1.5 and summary["entropy"] == pytest.approx(0.75)
    assert EvalResult(["a"], 1, rewards[:1, :1], [["1"]], np.array([True]), 1.0, 0, 0.0).distinct_correct() is None


def test_countdown_gives_each_correct_expression_as_written():
    task = get_task("countdown")
    problem = task.problems("test", 1, 0)[0]
    first = task.score(problem, f"{problem.solution}\n")
    spaced = task.score(problem, re.sub(r"([-+*/()])", r" \1 ", problem.solution) + "\n")
    assert first.reward == spaced.reward == 1.0 and first.form == spaced.form == problem.solution.replace(" ", "")
    assert task.score(problem, "nonsense").form is None


def test_evaluation_entropy_is_the_samples_surprisal(tiny):
    """At a huge temperature every token is drawn from (almost) the uniform distribution over the vocabulary,
    whose entropy is ln V: the estimate must land there; at T = 1 it is below it and above 0."""
    model, tokenizer = tiny
    task = FirstDigitTask()
    problems = task.problems("test", 4, 0)
    kwargs = dict(n=8, seed=0, max_new_tokens=4, batch_size=32)
    hot = evaluate_model(model, tokenizer, task, problems, temperature=1e6, **kwargs)
    vocabulary = model.config.vocab_size
    assert hot.lengths.sum() > 0 and hot.entropy() == pytest.approx(np.full(4, math.log(vocabulary)), rel=1e-4)
    warm = evaluate_model(model, tokenizer, task, problems, temperature=1.0, **kwargs)
    assert np.all(warm.entropy() > 0) and np.all(warm.entropy() < math.log(vocabulary))
    assert warm.lengths.max() <= 4 and warm.nats.shape == (4, 8) and warm.distinct_correct() is None


def test_a_kept_result_reads_back_only_under_its_own_key(tmp_path):
    from atrctl.files.records import DamagedFile
    from atrctl.reports.eval_report import RESULT_ARRAYS, load_result, save_result

    forms = [["1+2", None], [None, None]]
    result = EvalResult(["a", "b"], 2, np.array([[1, 0], [0, 0]], dtype=np.float32), [["3", None], [None, "4"]],
                        np.array([True, False]), 1.0, 7, 2.5, [{"problem": "a", "completion": "x"}],
                        np.array([[1.5, 2.0], [0.1, 0.2]]), np.array([[2, 3], [1, 1]]), forms)  # fmt: skip
    key = {"model": "m", "settings": {"n": 2}}
    save_result(tmp_path, key, result)
    back = load_result(tmp_path, key)
    assert back is not None and back.parsed == result.parsed and back.forms == forms
    for name in ("rewards", "greedy", "nats", "lengths"):
        assert np.array_equal(getattr(back, name), getattr(result, name)), name
    assert back.summary([1, 2]) == result.summary([1, 2]) and back.completions == result.completions
    assert load_result(tmp_path, {"model": "m", "settings": {"n": 4}}) is None  # another evaluation
    save_result(tmp_path / "other", {"model": "other"}, result)
    (tmp_path / RESULT_ARRAYS).write_bytes((tmp_path / "other" / RESULT_ARRAYS).read_bytes())
    assert load_result(tmp_path, key) is None  # arrays from another key: refused by their digest
    assert load_result(tmp_path / "nowhere", key) is None
    (tmp_path / RESULT_ARRAYS).write_bytes(b"not a zip")
    with pytest.raises(DamagedFile, match=f"{RESULT_ARRAYS} is damaged"):  # the caller evaluates again, saying so
        load_result(tmp_path, key)
