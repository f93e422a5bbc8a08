"""Sample completions for problems and score them with the task's verifier.

Shared by warm-up, training-time held-out checks and `atrctl eval`: prompts are encoded one way
everywhere (chat template when asked, the tokenizer's own special tokens otherwise), and
sampling runs through a rollout backend in large batches of whole problems.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atrctl.models import format_prompt
from atrctl.rollout import RolloutBackend, decode_completions
from atrctl.tasks import Problem, Score, Task


def encode_prompts(tokenizer, problems: Sequence[Problem], chat_template: bool = False) -> list[list[int]]:
    """Token ids of each problem's prompt; a chat template already carries its special tokens."""
    texts = [format_prompt(tokenizer, p.prompt, chat_template) for p in problems]
    return [tokenizer(text, add_special_tokens=not chat_template)["input_ids"] for text in texts]


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
) -> list[list[Score]]:
    """`samples` scored completions per problem ([problems][samples]), sampled in batches of whole problems."""
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
        texts = decode_completions(tokenizer, rollout)
        for i, problem in enumerate(chunk):
            scores.append([task.score(problem, text) for text in texts[i * samples : (i + 1) * samples]])
    return scores


def mean_reward(scores: Sequence[Sequence[Score]]) -> float:
    rewards = [s.reward for row in scores for s in row]
    return sum(rewards) / max(len(rewards), 1)
