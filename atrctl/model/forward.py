"""The training forward pass: per-token logprobs (and entropy) of sampled completions, with the graph.

This is the training-side twin of a rollout backend's logprobs: same padding, positions and float32
log_softmax, so the ratio w of the first update on a fresh rollout is exactly 1 (up to float noise).
A group's G rows share their prompt, which runs once per group (`_completion_outputs`), and only the
completion tokens are projected to the vocabulary, a chunk at a time (`selective_log_softmax`).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint

from atrctl.model import decoder_pass
from atrctl.model.batch import Rollout, equal_runs, position_ids
from atrctl.model.loading import is_checkpointing

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def completion_logprobs(
    model: PreTrainedModel,
    rollout: Rollout,
    temperature: float = 1.0,
    path_of: PreTrainedModel | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """log_softmax(logits.float() / temperature) at each completion token, from the training forward pass.

    This is the training-side twin of `sample`'s logprobs (same padding, positions and numerics);
    it keeps the graph, so call it under torch.no_grad() when no gradient is wanted. [B, T] float32,
    0 where the completion is masked.  `path_of`: the model whose pass to take (`_completion_states`), when
    not `model`'s own; `compiled`: whether atrctl's decoder pass runs compiled (`Numerics.compiled`).
    """
    return completion_logprobs_and_entropy(model, rollout, temperature, path_of=path_of, compiled=compiled)[0]


def completion_logprobs_and_entropy(
    model: PreTrainedModel,
    rollout: Rollout,
    temperature: float = 1.0,
    entropy_grad: bool = True,
    path_of: PreTrainedModel | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy of the sampling distribution) per completion token, both [B, T], 0 where masked.

    The entropy shares the forward pass.  It carries a gradient (for an entropy bonus) only when
    `entropy_grad`.  Only the completion tokens are projected to the vocabulary, a chunk at a time
    (`selective_log_softmax`): float32 logits of a whole micro-batch, [B, T, vocab], never exist at once.
    """
    states, head = _completion_states(model, rollout, model if path_of is None else path_of, compiled)
    return selective_log_softmax(
        states, head, rollout.completion_ids, rollout.completion_mask, temperature, entropy_grad
    )


CHUNK_BYTES = 32 * 2**20
"""Float32 logits projected at once by `selective_log_softmax`: 32 MiB is 170 tokens of a 49k vocabulary,
55 of a 152k one, the whole batch of a 64-token one — enough rows to keep the matrix product efficient."""


def selective_log_softmax(
    states: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(head(states).float() / temperature) at `targets`, and the distribution's entropy: [B, T]
    float32 each, 0 where `mask` is 0.

    states: [B, T, H] (what predicts each target), targets and mask: [B, T].  Only masked positions are
    projected, `CHUNK_BYTES` of logits at a time, each chunk under activation checkpointing: autograd keeps
    the [tokens, H] states and recomputes a chunk's logits in the backward pass (one more pass of the
    output projection, ~1/6 of a small model's FLOPs), so the peak holds one chunk's [tokens, vocab]
    tensors instead of the micro-batch's.  When one chunk holds every token it is not checkpointed: the
    logits are as small as they get.  Same arithmetic as the full log_softmax, row by row.
    """
    picked = mask.bool()
    where = picked.flatten().nonzero().squeeze(1)  # index_select: its backward is ~3x faster than boolean indexing's
    flat_states = states.flatten(0, 1).index_select(0, where)  # [N, H]
    flat_targets = targets.flatten().index_select(0, where)  # [N]
    vocab = getattr(head, "out_features", states.shape[-1])
    per_chunk = max(1, CHUNK_BYTES // (4 * vocab))
    # one chunk holds every token (a small vocabulary): nothing to gain from recomputing it in the backward
    track = torch.is_grad_enabled() and flat_states.requires_grad and len(flat_targets) > per_chunk
    pieces = []
    for start in range(0, len(flat_targets), per_chunk):
        chunk = (flat_states[start : start + per_chunk], flat_targets[start : start + per_chunk])
        if track:
            pieces.append(checkpoint(_chunk_logprobs, head, *chunk, temperature, entropy_grad, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(head, *chunk, temperature, entropy_grad))
    zeros = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if not pieces:
        return zeros, zeros.clone()
    logp, entropy = (torch.cat(column) for column in zip(*pieces, strict=True))
    return zeros.masked_scatter(picked, logp), zeros.masked_scatter(picked, entropy)


def _chunk_logprobs(head, states, targets, temperature: float, entropy_grad: bool):
    """(logprob of each target, entropy) of one chunk: [n] float32 each."""
    logp_all = torch.log_softmax(head(states).float() / temperature, -1)  # [n, vocab]
    logp = logp_all.gather(-1, targets[:, None])[:, 0]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _completion_states(
    model: PreTrainedModel, rollout: Rollout, path_of: PreTrainedModel, compiled: bool
) -> tuple[torch.Tensor, torch.nn.Module]:
    """(states [B, T, H] at the positions that predict each completion token, the module that maps them to
    logits).  The decoder's last hidden states and the output projection where the model's logits are
    exactly that projection (`head_is_linear`); otherwise its logits and the identity.

    The pass is the one `path_of` takes (FSDP's root, atrctl's decoder pass compiled or eager, transformers'
    forward): a reference model computes through its policy's, so that the two differ by their weights
    alone.  Two passes differ by rounding, and under bf16 that rounding made the KL term of identical
    weights nonzero noise, which AdamW scales into full-sized steps (seen with a policy under activation
    checkpointing, which keeps transformers' forward, against a reference on the decoder pass)."""
    from atrctl.model.loading import is_sharded

    if is_sharded(path_of):  # FSDP: one pass of the root model (it gathers the embedding and head) on every rank
        if head_is_linear(model):
            return _single_pass(_through_root(model), rollout, lambda out: out, False), model.get_output_embeddings()
        return _single_pass(model, rollout, lambda out: out.logits, True), torch.nn.Identity()
    if head_is_linear(model):
        if decoder_pass.supports(path_of):  # Llama, Qwen2: atrctl's own pass, compiled under model.compile
            states = decoder_pass.update_states(model, rollout, compiled)
        else:
            states = _completion_outputs(
                model.get_decoder(), rollout, lambda out: out.last_hidden_state, False, path_of
            )
        return states, model.get_output_embeddings()
    return _completion_outputs(model, rollout, lambda out: out.logits, True, path_of), torch.nn.Identity()


def _shares_prefix(model: PreTrainedModel) -> bool:
    """Whether `model`'s pass runs a group's prompt once and its completions on the cache (`_completion_outputs`).
    Activation checkpointing turns the cache off, so such a model, and a reference following its pass, takes the
    single pass: the two layouts round differently (a reference on the other one gave bf16 logprobs 1e-3
    apart from its policy's at equal weights, seen with PyTorch's AVX2 kernels)."""
    return not is_checkpointing(model)


def _through_root(model: PreTrainedModel):
    """`model` as a function of the decoder's inputs that returns the decoder's last hidden states: the root's
    forward runs (under FSDP it is what gathers the root's weights), projecting no position to the vocabulary."""

    def run(**inputs) -> torch.Tensor:
        captured = []
        hook = model.get_decoder().register_forward_hook(lambda module, args, out: captured.append(out))
        try:
            model(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device))
        finally:
            hook.remove()
        return captured[0].last_hidden_state

    return run


_LINEAR_HEAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_is_linear(model: PreTrainedModel) -> bool:
    """Whether logits = output_embeddings(decoder's last hidden state), checked once per model on a short
    input: a model that scales or soft-caps its logits (Gemma 2's final_logit_softcapping, Cohere's
    logit_scale) keeps the full-logits path."""
    if model not in _LINEAR_HEAD:
        decoder, head = getattr(model, "get_decoder", lambda: None)(), model.get_output_embeddings()
        matches = isinstance(head, torch.nn.Linear) and decoder is not None and decoder is not model
        if matches:
            ids = torch.arange(3, device=head.weight.device)[None] % head.out_features
            training = model.training
            model.eval()  # no dropout: the two passes must be the same function
            try:
                with torch.no_grad():
                    full = model(input_ids=ids).logits
                    split = head(decoder(input_ids=ids).last_hidden_state)
            finally:
                model.train(training)
            matches = full.shape == split.shape and torch.equal(full, split)
        _LINEAR_HEAD[model] = matches
    return _LINEAR_HEAD[model]


def _completion_outputs(module, rollout: Rollout, pick, is_lm: bool, layout_of=None) -> torch.Tensor:
    """`pick(module(...))` at the positions that predict each completion token: [B, T, ...] (a language
    model, `is_lm`, is asked for the logits of those positions only), laid out as `layout_of`'s pass is
    (default: `module`'s).

    Rows of a GRPO group share their prompt, so the prompt runs through the model once per distinct
    prompt (a run of consecutive rows with equal ids and mask) and its KV cache, graph included, is
    indexed out to each row; the completions then run on top of it.  Same function as one pass over
    prompt + completion (the gradient reaches the prompt's activations through the cache), with the
    prompt's share of the work divided by G.  Where no two rows share a prompt, where `layout_of` does
    not share it (activation checkpointing turns the cache off: `_shares_prefix`), and where the model
    turned out to ignore the cache, it takes the single pass.
    """
    from transformers import DynamicCache

    prompt, prompt_mask, completion = rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids
    mask = torch.cat([prompt_mask, rollout.completion_mask], dim=1)
    positions = position_ids(mask)
    config = getattr(module, "config", None)

    def keep(last: int) -> dict:
        return {"logits_to_keep": last} if is_lm else {}

    def single_pass() -> torch.Tensor:
        return _single_pass(module, rollout, pick, is_lm)

    first_rows, counts = equal_runs(torch.cat([prompt, prompt_mask], dim=1))
    # asked only where rows share a prompt: transformers walks the modules for `is_activation_checkpointing`
    if len(counts) == prompt.shape[0] or not _shares_prefix(module if layout_of is None else layout_of):
        return single_pass()
    width = prompt.shape[1]
    cache = DynamicCache(config=config)
    head = pick(
        module(
            input_ids=prompt[first_rows],
            attention_mask=prompt_mask[first_rows],
            position_ids=positions[first_rows, :width],
            **cache_argument(module, cache),
            **keep(1),
        )
    )[:, -1]
    owner = torch.repeat_interleave(torch.arange(len(counts), device=prompt.device), counts)
    _select_rows(cache, owner)
    outputs = [head.index_select(0, owner)[:, None]]  # the prompt's last position predicts the first token
    if completion.shape[1] > 1:  # completion token t predicts t + 1; the last one predicts nothing
        end = width + completion.shape[1] - 1
        outputs.append(
            pick(
                module(
                    input_ids=completion[:, :-1],
                    attention_mask=mask[:, :end],
                    position_ids=positions[:, width:end],
                    **cache_argument(module, cache),
                )
            )
        )
        if cache.get_seq_length() != end:  # the model ignored the cache (e.g. checkpointing we did not detect)
            return single_pass()
    return torch.cat(outputs, dim=1)


def cache_argument(model, cache) -> dict:
    """`{name: cache}` for a transformers forward call.  The KV cache's keyword is `cache` since transformers
    5.20 and `past_key_values` before; a keyword the forward does not take lands in its **kwargs and is
    ignored without a word, which under 5.19 left every decoding step without its context."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return {_cache_keyword(type(decoder).forward): cache}


@functools.cache
def _cache_keyword(forward) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _single_pass(module, rollout: Rollout, pick, is_lm: bool) -> torch.Tensor:
    """`_completion_outputs` in one pass over prompt + completion of every row."""
    prompt, completion = rollout.prompt_ids, rollout.completion_ids
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], dim=1)
    keep = {"logits_to_keep": completion.shape[1] + 1} if is_lm else {}
    ids = torch.cat([prompt, completion], dim=1)
    out = pick(module(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), use_cache=False, **keep))
    return out[:, -completion.shape[1] - 1 : -1]


def _select_rows(cache, rows: torch.Tensor) -> None:
    """The cache's keys and values at `rows` (a prompt's for each of its completions).  `index_select` where
    the layers keep plain tensors: the backward of the advanced indexing `batch_select_indices` uses is an
    accumulating index_put, 5-7x slower on CPU for the repeated rows of a group."""
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor):
            layer.keys, layer.values = keys.index_select(0, rows), values.index_select(0, rows)
        else:
            layer.batch_select_indices(rows)
