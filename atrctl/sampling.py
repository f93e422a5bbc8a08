"""Batched autoregressive sampling with a KV cache: the rollout engine for GRPO.

Conventions the trainer relies on:
- Prompts are left-padded; position ids count real tokens only (cumsum of the mask - 1), so a padded
  row gives the same logits as the prompt alone.
- A completion includes its EOS (masked in); everything after it is `pad_id` and masked out.
- `logprobs` are log_softmax(logits.float() / temperature) at the sampled token (temperature 1 when
  greedy): the same numbers `completion_logprobs` computes in a full forward pass, so the ratio w of
  the first update on a fresh rollout is exactly 1 (up to float noise). top_p truncation is not part
  of them, as in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from atrctl.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Rollout:
    """A batch of prompts with one sampled completion each; all tensors on the model's device."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long, 1 for real prompt tokens
    completion_ids: torch.Tensor  # [B, T] long, pad_id after EOS
    completion_mask: torch.Tensor  # [B, T] long, 1 up to and including EOS
    logprobs: torch.Tensor  # [B, T] float32, 0 where completion_mask is 0


def left_pad(
    sequences: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape [B, longest], real tokens flush right."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise UserError("every prompt needs at least one token: check the task's prompts and tokenizer")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding, so left padding does not shift the rotary phases."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _next_token(
    logits: torch.Tensor, temperature: float, top_p: float, greedy: bool, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its logprob) per row from last-position logits [B, V]."""
    if greedy:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits.float(), -1).gather(-1, token[:, None])[:, 0]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the top token always stays
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    token = draw(probs, generator)
    return token, logp.gather(-1, token[:, None])[:, 0]


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of (unnormalised) probabilities [B, V]; raises on NaN/inf or all-zero rows.

    On CUDA torch.multinomial is one fused kernel.  On CPU it draws an exponential variate per
    vocabulary entry (B·V random numbers, about a tenth of a tiny model's sampling time), so the CPU
    uses the inverse CDF: one uniform per row, the CDF summed in float64 so every token keeps its
    probability; a zero-probability entry is never chosen (the draw lands strictly inside a
    positive-width CDF step).
    """
    if probs.device.type != "cpu":
        _check_totals(probs.sum(-1))
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]  # the row sums, for free
    _check_totals(total)
    u = torch.rand((probs.shape[0], 1), dtype=torch.float64, generator=generator)
    token = torch.searchsorted(cdf, u * total, right=True)
    return token.clamp(max=probs.shape[-1] - 1)[:, 0]


def _check_totals(total: torch.Tensor) -> None:
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise RuntimeError("sampling probabilities are NaN, infinite or all zero: the model's logits are not finite")


def preallocated_cache(model: PreTrainedModel, capacity: int):
    """A DynamicCache whose full-attention layers write into buffers of `capacity` positions.

    HF's DynamicLayer appends a token by concatenation, copying the whole cache at every step
    (O(T²) memory traffic over a rollout; a tenth of a CPU step at 64 new tokens).  Writing in place
    costs one token's copy.  Inference only: autograd cannot see through the in-place writes.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.device, self.is_initialized, self.length = key_states.device, True, 0
                shape = (*key_states.shape[:2], capacity, key_states.shape[-1])
                self.key_buffer = key_states.new_empty(shape)
                self.value_buffer = value_states.new_empty((*shape[:3], value_states.shape[-1]))
            end = self.length + key_states.shape[-2]
            self.key_buffer[..., self.length : end, :] = key_states
            self.value_buffer[..., self.length : end, :] = value_states
            self.length = end
            return self._filled()

        def _filled(self):
            self.keys, self.values = self.key_buffer[..., : self.length, :], self.value_buffer[..., : self.length, :]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length if self.is_initialized else 0

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.is_initialized:
                self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
                self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
                self._filled()

        def _unsupported(self, *args, **kwargs):
            raise NotImplementedError("the sampling cache only appends, and repeats rows once after the prefill")

        crop = reorder_cache = batch_select_indices = reset = _unsupported

    cache = DynamicCache(config=model.config)
    cache.layers = [PreallocatedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def sample(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    eos_id: int,
    pad_id: int,
    generator: torch.Generator | None = None,
    repeats: int = 1,
) -> Rollout:
    """Sample `repeats` completions per prompt (rows prompt-major), stopping once every row has emitted EOS.

    A GRPO group shares its prompt, so the prompt's forward pass (the prefill) runs once per distinct
    prompt and its KV cache is copied to the group's rows.  Same `generator` state, same tokens.
    The generator must live on the model's device.
    """
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens={max_new_tokens} must be at least 1: raise it")
    if not greedy and temperature <= 0:
        raise UserError(f"temperature={temperature} must be > 0: raise it, or sample greedily")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p={top_p} must be in (0, 1]: use 1.0 to turn it off")

    device = model.device
    distinct, distinct_mask = left_pad(prompt_ids, pad_id, device)
    prompt, prompt_mask = (t.repeat_interleave(repeats, dim=0) for t in (distinct, distinct_mask))
    cache = preallocated_cache(model, capacity=prompt.shape[1] + max_new_tokens)
    with torch.inference_mode():
        positions = position_ids(distinct_mask)
        logits = model(input_ids=distinct, attention_mask=distinct_mask, position_ids=positions, cache=cache,
                       logits_to_keep=1).logits[:, -1]
        if repeats > 1:
            cache.batch_repeat_interleave(repeats)
            positions, logits = positions.repeat_interleave(repeats, dim=0), logits.repeat_interleave(repeats, dim=0)
        tokens, logprobs, mask = [], [], prompt_mask
        done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=device)
        for produced in range(1, max_new_tokens + 1):
            token, logp = _next_token(logits, temperature, top_p, greedy, generator)
            tokens.append(torch.where(done, pad_id, token))
            logprobs.append(logp.masked_fill(done, 0.0))
            done = done | (token == eos_id)
            if produced == max_new_tokens or bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(done[:, None], dtype=mask.dtype)], dim=-1)
            positions = positions[:, -1:] + 1
            logits = model(input_ids=tokens[-1][:, None], attention_mask=mask, position_ids=positions, cache=cache,
                           logits_to_keep=1).logits[:, -1]

    completion_ids = torch.stack(tokens, dim=1)
    is_eos = (completion_ids == eos_id).long()
    completion_mask = (is_eos.cumsum(-1) - is_eos == 0).long()  # up to and including the first EOS
    logprobs = torch.stack(logprobs, dim=1)
    return Rollout(prompt, prompt_mask, completion_ids, completion_mask, logprobs)


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
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                       logits_to_keep=completion.shape[1] + 1).logits[:, :-1]
        return logits.float() / temperature

    first_rows, counts = _runs(torch.cat([prompt, prompt_mask], dim=1))
    if len(counts) == prompt.shape[0] or getattr(model, "is_activation_checkpointing", False):
        return single_pass()
    width = prompt.shape[1]
    cache = DynamicCache(config=model.config)
    head = model(input_ids=prompt[first_rows], attention_mask=prompt_mask[first_rows],
                 position_ids=positions[first_rows, :width], cache=cache, logits_to_keep=1).logits[:, -1]
    owner = torch.repeat_interleave(torch.arange(len(counts), device=prompt.device), counts)
    cache.batch_select_indices(owner)
    logits = [head[owner][:, None]]  # the prompt's last position predicts the first completion token
    if completion.shape[1] > 1:  # completion token t predicts t + 1; the last one predicts nothing
        end = width + completion.shape[1] - 1
        logits.append(model(input_ids=completion[:, :-1], attention_mask=mask[:, :end],
                            position_ids=positions[:, width:end], cache=cache).logits)
        if cache.get_seq_length() != end:  # the model ignored the cache (e.g. checkpointing we did not detect)
            return single_pass()
    return torch.cat(logits, dim=1).float() / temperature


def _runs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each run's first row, run lengths) of consecutive equal rows."""
    counts = torch.unique_consecutive(rows, dim=0, return_counts=True)[1]
    return counts.cumsum(0) - counts, counts


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


def decode_completions(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    """Each completion's text, up to (not including) its EOS, without special tokens."""
    lengths = rollout.completion_mask.sum(-1).tolist()
    rows = rollout.completion_ids.tolist()
    return [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(rows, lengths, strict=True)]
