"""Evaluation math (DESIGN.md §3): pass@k, maj@k, avg@n and bootstrap intervals over problems.

Everything here but `evaluate_model` is a pure numpy function, so a comparison can recompute any
figure from the per-sample rewards.  A sample is *correct* when it earns the full reward (1).
Importing this module stays cheap: torch is imported inside `evaluate_model` only.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


def bootstrap_ci(values: np.ndarray, *, resamples: int = 2000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float]:
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

    @property
    def correct(self) -> np.ndarray:
        """Correct samples per problem: [P] int."""
        return (self.rewards >= 1).sum(axis=1)

    def pass_at(self, k: int) -> np.ndarray:
        """pass@k of each problem: [P]."""
        return pass_at_k_per_problem(self.correct, self.n, k)

    def summary(self, ks: Sequence[int]) -> dict[str, float]:
        """Headline figures: pass@k with its 95% interval (pass@k/low, pass@k/high), maj@k, avg@n, greedy."""
        out: dict[str, float] = {"n": self.n, "problems": len(self.problem_ids), "temperature": self.temperature,
                                 "seed": self.seed, "seconds": self.seconds}
        for k in ks:
            values = self.pass_at(k)
            out[f"pass@{k}"] = float(values.mean())
            out[f"pass@{k}/low"], out[f"pass@{k}/high"] = bootstrap_ci(values)
            out[f"maj@{k}"] = majority_at_k(self.parsed, self.rewards, k)
        out["avg@n"] = avg_at_n(self.rewards)
        out["greedy"] = float(self.greedy.mean())
        return out


def sample_chunks(problems: int, n: int, batch_size: int) -> list[range]:
    """The problems sampled together: runs of max(1, batch_size // n), cut at multiples of that size."""
    width = max(1, batch_size // n)
    return [range(first, min(first + width, problems)) for first in range(0, problems, width)]


def chunk_seed(seed: int, first: int) -> int:
    """Seed of the generator that samples the chunk whose first problem has index `first`."""
    return (seed * 1_000_003 + first) % (2**63)


def evaluate_model(model, tokenizer, task, problems: Sequence, *, n: int, temperature: float, seed: int,
                   max_new_tokens: int, chat_template: bool = False, batch_size: int = 1024,
                   on_progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """A greedy completion and n samples for each problem, scored by the task.

    Problems are sampled in chunks of max(1, batch_size // n) whole problems (at most about
    `batch_size` completions, cut at multiples of the chunk size), each chunk from its own generator
    seeded by (seed, index of its first problem) on the model's device.  Greedy completions go in
    blocks of `batch_size` problems.  Under a joined process group (torchrun) rank r takes chunks and
    blocks r, r + W, ... and every rank receives the whole result, in problem order: the samples of a
    problem do not depend on the world size, so W processes give the 1-process result.
    on_progress(problems sampled, total) follows this process's share of the sampling.
    """
    import torch

    from atrctl import distributed
    from atrctl.scoring import encode_prompts, sampled_scores

    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    started = time.perf_counter()
    rank, world = distributed.shard()
    prompt_ids = encode_prompts(tokenizer, problems, chat_template)
    device = next(model.parameters()).device

    greedy: dict[int, bool] = {}
    blocks = [range(f, min(f + batch_size, len(problems))) for f in range(0, len(problems), batch_size)]
    for block in blocks[rank::world]:
        scores = sampled_scores(model, tokenizer, task, problems[block.start : block.stop],
                                prompt_ids[block.start : block.stop], samples=1, greedy=True,
                                max_new_tokens=max_new_tokens, batch_size=batch_size)
        greedy.update((i, row[0].reward >= 1) for i, row in zip(block, scores, strict=True))

    sampled: dict[int, tuple[list[float], list[str | None]]] = {}
    mine = sample_chunks(len(problems), n, batch_size)[rank::world]
    total = sum(len(chunk) for chunk in mine)
    for chunk in mine:
        generator = torch.Generator(device).manual_seed(chunk_seed(seed, chunk.start))
        scores = sampled_scores(model, tokenizer, task, problems[chunk.start : chunk.stop],
                                prompt_ids[chunk.start : chunk.stop], samples=n, temperature=temperature,
                                max_new_tokens=max_new_tokens, generator=generator, batch_size=batch_size)
        sampled.update((i, ([s.reward for s in row], [s.parsed for s in row]))
                       for i, row in zip(chunk, scores, strict=True))
        if on_progress is not None:
            on_progress(len(sampled), total)

    for other_greedy, other_sampled in distributed.all_gather_objects((greedy, sampled)):
        greedy.update(other_greedy)
        sampled.update(other_sampled)
    order = range(len(problems))
    return EvalResult(
        problem_ids=[p.id for p in problems],
        n=n,
        rewards=np.array([sampled[i][0] for i in order], dtype=np.float32).reshape(len(problems), n),
        parsed=[sampled[i][1] for i in order],
        greedy=np.array([greedy[i] for i in order], dtype=bool),
        temperature=temperature,
        seed=seed,
        seconds=time.perf_counter() - started,
    )
