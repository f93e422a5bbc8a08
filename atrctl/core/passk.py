"""Evaluation math (docs/design.md §4): pass@k, maj@k, avg@n and bootstrap intervals over problems.

Pure numpy functions, so a comparison can recompute any figure from the per-sample rewards.  A sample
is *correct* when it earns the full reward (1).  Sampling the completions is `atrctl.experiments.evaluation`'s job.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k)/C(n, k).

    The product form 1 - ∏_{i=n-c+1}^{n} (1 - k/i) avoids huge binomials, so n = 1024 is exact enough.
    """
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be between 1 and n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"c={c} correct samples must be between 0 and n={n}")
    if c == 0:
        return 0.0
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_per_problem(correct: Sequence[int] | np.ndarray, n: int, k: int) -> np.ndarray:
    """pass@k of each problem from its correct count: shape of `correct`, float64."""
    counts = np.asarray(correct)
    return np.array([pass_at_k(n, int(c), k) for c in counts.ravel()], dtype=np.float64).reshape(counts.shape)


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself when it is not a power of two (pass@n: solved at all)."""
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else [*ks, n]


def _problem_means(values: np.ndarray) -> np.ndarray:
    """[P] or [S, P] -> [P]: resampling problems keeps each problem's seeds together, and the mean over all
    S×P entries of a resample equals the mean of these column means."""
    values = np.asarray(values, dtype=np.float64)
    if values.ndim not in (1, 2) or values.shape[-1] == 0:
        raise ValueError(f"values must have shape [problems] or [seeds, problems], got {values.shape}")
    return values if values.ndim == 1 else values.mean(axis=0)


def _bootstrap(per_problem: np.ndarray, resamples: int, seed: int, level: float) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"level={level} must be in (0, 1)")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, per_problem.size, size=(resamples, per_problem.size))
    means = per_problem[picks].mean(axis=1)
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def bootstrap_ci(
    values: np.ndarray, *, resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile-bootstrap interval of the mean over problems (values [P], or [S, P] for S seeds).

    Problems, not samples, are resampled: they are the unit the result should generalise over.
    """
    return _bootstrap(_problem_means(values), resamples, seed, level)


def majority_correct(parsed: Sequence[Sequence[str | None]], rewards: np.ndarray, k: int) -> np.ndarray:
    """Per problem, whether the most common parsed answer among its first k samples is correct: [P] bool.

    Unparseable samples (None) do not vote; a tie goes to the answer seen first.  The majority answer is
    correct when one of those k samples giving it earned reward 1: the task's verifier already decided
    equivalence (math-verify for math), so no answer comparison is repeated here.  No vote: incorrect.
    """
    rewards = np.asarray(rewards)
    if rewards.ndim != 2 or len(parsed) != rewards.shape[0]:
        raise ValueError(f"rewards must be [problems, n] matching parsed, got {rewards.shape} for {len(parsed)}")
    if not 1 <= k <= rewards.shape[1]:
        raise ValueError(f"k={k} must be between 1 and n={rewards.shape[1]}")
    out = np.zeros(len(parsed), dtype=bool)
    for p, answers in enumerate(parsed):
        votes = Counter(a for a in answers[:k] if a is not None)
        if votes:
            top = max(votes.values())
            winner = next(a for a in answers[:k] if votes.get(a) == top)  # first to reach the top count
            out[p] = any(a == winner and r >= 1 for a, r in zip(answers[:k], rewards[p, :k], strict=True))
    return out


def majority_at_k(parsed: Sequence[Sequence[str | None]], rewards: np.ndarray, k: int) -> float:
    """maj@k: the fraction of problems whose majority answer over the first k samples is correct."""
    return float(majority_correct(parsed, rewards, k).mean())


def avg_at_k_per_problem(rewards: np.ndarray, k: int) -> np.ndarray:
    """avg@k of each problem: the mean correctness of its first k samples, [P] (what an evaluation that drew k
    samples per problem reports, as papers' avg@32 on AIME; its mean over problems estimates pass@1, more
    noisily the smaller k is)."""
    rewards = np.asarray(rewards)
    if rewards.ndim != 2 or not 1 <= k <= rewards.shape[1]:
        raise ValueError(f"k={k} must be between 1 and n for rewards [problems, n], got {rewards.shape}")
    return (rewards[:, :k] >= 1).mean(axis=1)


def avg_at_n(rewards: np.ndarray) -> float:
    """avg@n: the mean correctness of all samples (equal to pass@1 in expectation)."""
    return float((np.asarray(rewards) >= 1).mean())


@dataclass
class EvalResult:
    """Everything one evaluation measured, per problem and per sample, so any figure can be recomputed."""

    problem_ids: list[str]
    n: int
    rewards: np.ndarray  # [P, n] float32, the task's reward of each sample
    parsed: list[list[str | None]]  # [P][n] normalised parsed answers, None when unparseable
    greedy: np.ndarray  # [P] bool, the greedy completion is correct
    temperature: float
    seed: int
    seconds: float
    completions: list[dict] = field(default_factory=list)  # the texts kept for samples.jsonl (evaluation.py)
    nats: np.ndarray | None = None  # [P, n] float64: each sample's sum of -logprob (nats) at the sampling T
    lengths: np.ndarray | None = None  # [P, n] int: each sample's tokens
    forms: list[list[str | None]] | None = None  # [P][n] the answer as written where a task gives one (countdown)

    def entropy(self) -> np.ndarray | None:
        """Per problem, the samples' mean surprisal per token (nats): the Monte-Carlo estimate of the sampling
        distribution's entropy per token (of the distribution at the sampling temperature before top-p)."""
        if self.nats is None or self.lengths is None:
            return None
        return self.nats.sum(axis=1) / np.maximum(self.lengths.sum(axis=1), 1)

    def distinct_correct(self) -> np.ndarray | None:
        """Per problem, how many distinct correct answers (as written, `Score.form`) the n samples hold; None
        where the task gives no forms (one correct answer per problem: nothing to count)."""
        if self.forms is None or not any(form is not None for row in self.forms for form in row):
            return None
        return np.array(
            [len({f for f, r in zip(row, rewards, strict=True) if f is not None and r >= 1})
             for row, rewards in zip(self.forms, self.rewards, strict=True)],
            dtype=float,
        )  # fmt: skip

    @property
    def correct(self) -> np.ndarray:
        """Correct samples per problem: [P] int."""
        return (self.rewards >= 1).sum(axis=1)

    def pass_at(self, k: int) -> np.ndarray:
        """pass@k of each problem: [P]."""
        return pass_at_k_per_problem(self.correct, self.n, k)

    def summary(self, ks: Sequence[int]) -> dict[str, float]:
        """Headline figures: pass@k and avg@k with their 95% intervals (pass@k/low, pass@k/high, avg@k/low,
        avg@k/high), maj@k, avg@n (= pass@1 and avg@n at k = n), greedy."""
        out: dict[str, float] = {
            "n": self.n,
            "problems": len(self.problem_ids),
            "temperature": self.temperature,
            "seed": self.seed,
            "seconds": self.seconds,
        }
        for k in ks:
            values = self.pass_at(k)
            out[f"pass@{k}"] = float(values.mean())
            out[f"pass@{k}/low"], out[f"pass@{k}/high"] = bootstrap_ci(values)
            out[f"maj@{k}"] = majority_at_k(self.parsed, self.rewards, k)
            averages = avg_at_k_per_problem(self.rewards, k)
            out[f"avg@{k}"] = float(averages.mean())
            out[f"avg@{k}/low"], out[f"avg@{k}/high"] = bootstrap_ci(averages)
        out["avg@n"] = avg_at_n(self.rewards)
        out["greedy"] = float(self.greedy.mean())
        for name, values in (("entropy", self.entropy()), ("distinct correct", self.distinct_correct())):
            if values is not None:
                out[name] = float(values.mean())
        return out
