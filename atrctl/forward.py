"""The training forward pass: per-token logprobs (and entropy) of sampled completions, with the graph.

This is the training-side twin of a rollout backend's logprobs: same padding, positions and float32
log_softmax, so the ratio w of the first update on a fresh rollout is exactly 1 (up to float noise).
A group's G rows share their prompt, which runs once per group (`_completion_logits`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from atrctl.rollout import Rollout, position_ids

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def completion_logprobs(model: PreTrainedModel, rollout: Rollout, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits.float() / temperature) at each completion token, from one full forward pass.

    This is the training-side twin of `sample`'s logprobs (same padding, positions and numerics);
    it keeps the graph, so call it under torch.no_grad() when no gradient is wanted. [B, T] float32,
    0 where the completion is masked.
    """
    return completion_logprobs_and_entropy(model, rollout, temperature)[0]


def completion_logprobs_and_entropy(
    model: PreTrainedModel, rollout: Rollout, temperature: float = 1.0, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy of the sampling distribution) per completion token, both [B, T], 0 where masked.

    The entropy shares the forward pass.  It carries a gradient (for an entropy bonus) only when
    `entropy_grad`: otherwise autograd would keep a [B, T, vocab] tensor alive for nothing.
    """
    logp_all = torch.log_softmax(_completion_logits(model, rollout, temperature), -1)
    logp = logp_all.gather(-1, rollout.completion_ids[..., None])[..., 0]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp * rollout.completion_mask, entropy * rollout.completion_mask


def _completion_logits(model: PreTrainedModel, rollout: Rollout, temperature: float) -> torch.Tensor:
    """Float32 logits / temperature at the positions that predict each completion token: [B, T, V].

    Rows of a GRPO group share their prompt, so the prompt runs through the model once per distinct
    prompt (a run of consecutive rows with equal ids and mask) and its KV cache, graph included, is
    indexed out to each row; the completions then run on top of it.  Same function as one pass over
    prompt + completion (the gradient reaches the prompt's activations through the cache), with the
    prompt's share of the work divided by G.  Activation checkpointing turns the cache off, so it
    gets the single pass (also if the model turned out to ignore the cache).
    """
    from transformers import DynamicCache

    prompt, prompt_mask, completion = rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids
    mask = torch.cat([prompt_mask, rollout.completion_mask], dim=1)
    positions = position_ids(mask)

    def single_pass() -> torch.Tensor:
        ids = torch.cat([prompt, completion], dim=1)
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=completion.shape[1] + 1
        ).logits[:, :-1]
        return logits.float() / temperature

    first_rows, counts = _runs(torch.cat([prompt, prompt_mask], dim=1))
    if len(counts) == prompt.shape[0] or getattr(model, "is_activation_checkpointing", False):
        return single_pass()
    width = prompt.shape[1]
    cache = DynamicCache(config=model.config)
    head = model(
        input_ids=prompt[first_rows],
        attention_mask=prompt_mask[first_rows],
        position_ids=positions[first_rows, :width],
        cache=cache,
        logits_to_keep=1,
    ).logits[:, -1]
    owner = torch.repeat_interleave(torch.arange(len(counts), device=prompt.device), counts)
    cache.batch_select_indices(owner)
    logits = [head[owner][:, None]]  # the prompt's last position predicts the first completion token
    if completion.shape[1] > 1:  # completion token t predicts t + 1; the last one predicts nothing
        end = width + completion.shape[1] - 1
        logits.append(
            model(
                input_ids=completion[:, :-1],
                attention_mask=mask[:, :end],
                position_ids=positions[:, width:end],
                cache=cache,
            ).logits
        )
        if cache.get_seq_length() != end:  # the model ignored the cache (e.g. checkpointing we did not detect)
            return single_pass()
    return torch.cat(logits, dim=1).float() / temperature


def _runs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each run's first row, run lengths) of consecutive equal rows."""
    counts = torch.unique_consecutive(rows, dim=0, return_counts=True)[1]
    return counts.cumsum(0) - counts, counts
