"""Sample completions for problems and score them with the task's verifier.

Shared by warm-up, training-time held-out checks and `atrctl eval`: prompts are encoded one way
everywhere (`atrctl.rollout.prompts`), and sampling runs through a rollout backend in large batches of whole
problems.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atrctl.rollout.backend import RolloutBackend, decode_completions
from atrctl.tasks import Problem, Score, Task


def sampled_scores(
    sampler: RolloutBackend,
    tokenizer,
    task: Task,
    problems: Sequence[Problem],
    prompt_ids: Sequence[list[int]],
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    batch_size: int = 1024,
    texts: list[list[str]] | None = None,
    surprisal: list[list[tuple[float, int]]] | None = None,
) -> list[list[Score]]:
    """`samples` scored completions per problem ([problems][samples]), sampled in batches of whole problems;
    each problem's completion texts are appended to `texts` when a list is given, and to `surprisal` each
    completion's (sum of -logprob over its tokens in nats, its number of tokens)."""
    per_batch = max(1, batch_size // samples)
    scores: list[list[Score]] = []
    for start in range(0, len(problems), per_batch):
        chunk = problems[start : start + per_batch]
        rollout = sampler.generate(
            list(prompt_ids[start : start + per_batch]),
            repeats=samples,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            greedy=greedy,
            generator=generator,
        )
        decoded = decode_completions(tokenizer, rollout)
        if surprisal is not None:
            mask = rollout.completion_mask.bool()
            nats = (-torch.where(mask, rollout.logprobs.float(), 0.0).sum(1)).tolist()
            pairs = list(zip(nats, mask.sum(1).tolist(), strict=True))
        for i, problem in enumerate(chunk):
            mine = decoded[i * samples : (i + 1) * samples]
            scores.append([task.score(problem, text) for text in mine])
            if texts is not None:
                texts.append(mine)
            if surprisal is not None:
                surprisal.append(pairs[i * samples : (i + 1) * samples])
    return scores


def mean_reward(scores: Sequence[Sequence[Score]]) -> float:
    rewards = [s.reward for row in scores for s in row]
    return sum(rewards) / max(len(rewards), 1)
