"""Supervised warm-up: teach a from-scratch model the task's format until it solves a few problems.

RL needs a policy that sometimes earns a reward.  A freshly initialised tiny model never does, so it
is first trained with teacher-forced cross-entropy on the answer tokens of worked train-split
solutions, and stopped on *measured* held-out greedy accuracy: when the accuracy jump comes varies a
lot by seed, so a fixed step count would give bases of very different strength.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from atrctl.config.schema import WarmupConfig
from atrctl.model.numerics import numerics
from atrctl.rollout.hf import HFSampler
from atrctl.rollout.prompts import PLAIN, PromptStyle, encode_prompts, prompt_text
from atrctl.rollout.scoring import mean_reward, sampled_scores
from atrctl.tasks import Problem, Task, problem_pool

TRAIN_POOL = 20_000  # distinct train problems cycled through; more than any warm-up needs to see


@dataclass
class WarmupResult:
    accuracy: float
    steps: int
    seconds: float
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out greedy accuracy)


def encode_examples(
    tokenizer, problems: Sequence[Problem], style: PromptStyle = PLAIN
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, loss mask) right-padded: prompt + solution + EOS, loss on solution and EOS only."""
    rows, answer_spans = [], []
    for problem in problems:
        prompt = tokenizer.encode(prompt_text(tokenizer, problem.prompt, style), add_special_tokens=False)
        answer = tokenizer.encode(problem.solution, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        answer_spans.append((len(prompt), len(prompt) + len(answer)))
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    on_answer = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (row, (start, end)) in enumerate(zip(rows, answer_spans, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        on_answer[i, start:end] = 1.0
    return ids, attention, on_answer


def answer_loss(model, ids: torch.Tensor, attention: torch.Tensor, on_answer: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the answer tokens (the prompt is given, not learned)."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    weight = on_answer[:, 1:]
    return (nll * weight).sum() / weight.sum().clamp(min=1.0)


def greedy_accuracy(
    sampler: HFSampler,
    tokenizer,
    task: Task,
    problems: Sequence[Problem],
    max_new_tokens: int,
    style: PromptStyle = PLAIN,
) -> float:
    """Fraction of problems whose greedy completion earns reward 1."""
    prompt_ids = encode_prompts(tokenizer, problems, style)
    return mean_reward(
        sampled_scores(
            sampler, tokenizer, task, problems, prompt_ids, samples=1, max_new_tokens=max_new_tokens, greedy=True
        )
    )


def answer_budget(tokenizer, problems: Sequence[Problem], slack: int = 2) -> int:
    """New tokens a greedy check needs: the longest solution, its EOS, and a little slack."""
    return max(len(tokenizer.encode(p.solution, add_special_tokens=False)) for p in problems) + 1 + slack


def warm_up(
    model,
    tokenizer,
    task: Task,
    config: WarmupConfig,
    on_progress: Callable[[int, int, float, float | None], None] | None = None,
    style: PromptStyle = PLAIN,
) -> WarmupResult:
    """Train until held-out greedy accuracy reaches config.target_accuracy or config.max_steps pass, on the
    prompts as RL will show them (`style`: the instruction; presets have no chat template).

    on_progress(step, total, loss, accuracy or None) is called after every step, for a progress display:
    total is max_steps, or the step itself at the step that reaches the target, so a bar stopped early
    shows as complete (a log's heartbeat would otherwise keep writing it, its remaining time growing).
    """
    started = time.perf_counter()
    device = next(model.parameters()).device
    train = problem_pool(task, "train", min(TRAIN_POOL, config.batch_size * config.max_steps), config.seed)
    held_out = problem_pool(task, "test", config.eval_problems, config.seed)
    budget = answer_budget(tokenizer, held_out)
    order = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0)
    compute = numerics(device)  # the SFT steps run under the device's autocast, as RL updates do
    sampler = HFSampler(model, tokenizer, numerics(device, autocast=False))  # accuracy checks: as the weights are

    history: list[tuple[int, float]] = []
    accuracy, step, queue = 0.0, 0, torch.empty(0, dtype=torch.long)
    model.train()
    while step < config.max_steps:
        if len(queue) < config.batch_size:  # a fresh seeded permutation per epoch
            queue = torch.cat([queue, torch.randperm(len(train), generator=order)])
        batch, queue = queue[: config.batch_size], queue[config.batch_size :]
        ids, attention, on_answer = (t.to(device) for t in encode_examples(tokenizer, [train[i] for i in batch], style))
        with compute.autocast():
            loss = answer_loss(model, ids, attention, on_answer)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        measured = None
        if step % config.eval_every == 0 or step == config.max_steps:
            accuracy = measured = greedy_accuracy(sampler, tokenizer, task, held_out, budget, style)
            history.append((step, accuracy))
        reached = measured is not None and measured >= config.target_accuracy
        if on_progress is not None:
            on_progress(step, step if reached else config.max_steps, loss.item(), measured)
        if reached:
            break
    model.eval()
    return WarmupResult(accuracy, step, time.perf_counter() - started, history)
