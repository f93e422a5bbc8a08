"""atrctl's own batched sampler with a KV cache: the "hf" rollout backend.

It runs the policy module itself (a transformers causal LM), so it needs no weight transfer and, in
float32, its logprobs are the training forward pass's to ~1e-6 (tested).  The batch it returns
follows `atrctl.rollout.backend`'s layout.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from atrctl.model import decoder_pass
from atrctl.model.batch import Rollout, left_pad, position_ids
from atrctl.model.forward import cache_argument
from atrctl.rollout.backend import NonFiniteProbabilities, check_sampling

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from atrctl.model.numerics import Numerics


class HFSampler:
    """The "hf" backend (`atrctl.rollout.backend.RolloutBackend`): `sample` on the policy module, under its numerics."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, numerics: Numerics):
        self.model, self.numerics = model, numerics
        self.eos_id, self.pad_id = stop_tokens(model, tokenizer), tokenizer.pad_token_id

    @property
    def logprobs_reusable(self) -> bool:
        """In float32 the KV-cache decode equals a full pass to ~1e-6.  Under bf16 autocast on a CPU it differs
        by bf16 rounding (mean 0.03, max 0.36 nats on SmolLM2-135M), yet the tokens were drawn from exactly
        these probabilities, and the update taken on them landed closer to the float32 update than one on
        recomputed bf16 logprobs, in 10 of 12 rollouts (`old_logprobs_bf16` (retired: docs/performance-log.md)), while
        saving a forward pass.  On CUDA that comparison has not been run, so bf16 there still recomputes."""
        return not self.numerics.autocast_enabled or self.numerics.device.type == "cpu"

    def load_weights(self, model: PreTrainedModel) -> None:
        self.model = model  # the policy module itself: its new weights are already in place

    def join_peers(self) -> None:
        """Nothing: each process samples on its own."""

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        repeats: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        was_training = self.model.training
        self.model.eval()  # the KV cache is off in training mode under gradient checkpointing
        try:
            with self.numerics.autocast():
                return sample(
                    self.model,
                    prompt_ids,
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    top_p=top_p,
                    greedy=greedy,
                    eos_id=self.eos_id,
                    pad_id=self.pad_id,
                    generator=generator,
                    repeats=repeats,
                    compiled=self.numerics.compiled,
                )
        finally:
            self.model.train(was_training)


def stop_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and each EOS id of the model's generation_config
    (Qwen's lists both <|im_end|> and <|endoftext|>; stopping at only one lets a reply run on past its end)."""
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    return list(dict.fromkeys(i for i in [tokenizer.eos_token_id, *listed] if i is not None))


def _next_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    greedy: bool,
    generator: torch.Generator | None,
    rows: tuple[torch.Tensor, int] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its logprob) per row from last-position logits [B, V]; `rows` as in `draw`."""
    if greedy:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits.float(), -1).gather(-1, token[:, None])[:, 0]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # the top token always stays
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    token = draw(probs, generator, rows)
    return token, logp.gather(-1, token[:, None])[:, 0]


def draw(
    probs: torch.Tensor, generator: torch.Generator | None, rows: tuple[torch.Tensor, int] | None = None
) -> torch.Tensor:
    """One token per row of (unnormalised) probabilities [B, V]; raises on NaN/inf or all-zero rows.

    On CUDA torch.multinomial is one fused kernel.  On CPU it draws an exponential variate per
    vocabulary entry (B·V random numbers, about a tenth of a tiny model's sampling time), so the CPU
    uses the inverse CDF: one uniform per row, the CDF summed in float64 so every token keeps its
    probability; a zero-probability entry is never chosen (the draw lands strictly inside a
    positive-width CDF step).  `rows = (index, batch)` says the B rows are rows `index` of a batch of
    `batch` (the rows still decoding, `sample`): the CPU draws the whole batch's uniforms and keeps
    theirs, so a row's draws do not depend on which other rows are still in the batch.
    """
    if probs.device.type != "cpu":
        _check_totals(probs.sum(-1))
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]  # the row sums, for free
    _check_totals(total)
    index, batch = rows if rows is not None else (None, probs.shape[0])
    u = torch.rand((batch, 1), dtype=torch.float64, generator=generator)
    if index is not None:
        u = u.index_select(0, index)
    token = torch.searchsorted(cdf, u * total, right=True)
    return token.clamp(max=probs.shape[-1] - 1)[:, 0]


def _check_totals(total: torch.Tensor) -> None:
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise NonFiniteProbabilities(
            "sampling probabilities are NaN, infinite or all zero: the model's logits are not finite"
        )


class Preallocated:
    """Marks the cache layers `preallocated_cache` makes (their class is made per call)."""


def preallocated_cache(model: PreTrainedModel, capacity: int):
    """A DynamicCache whose full-attention layers write into buffers of `capacity` positions.

    HF's DynamicLayer appends a token by concatenation, copying the whole cache at every step
    (O(T²) memory traffic over a rollout; a tenth of a CPU step at 64 new tokens).  Writing in place
    costs one token's copy.  Inference only: autograd cannot see through the in-place writes.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer, Preallocated):
        store_as: torch.dtype | None = None  # the buffers' dtype, if not the first keys' (`sample` sets it)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.device, self.is_initialized, self.length = key_states.device, True, 0
                shape = (*key_states.shape[:2], capacity, key_states.shape[-1])
                dtype = self.store_as or key_states.dtype
                self.key_buffer = key_states.new_empty(shape, dtype=dtype)
                self.value_buffer = value_states.new_empty((*shape[:3], value_states.shape[-1]), dtype=dtype)
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
            """Each row `repeats` times, consecutively: only the filled positions are copied (after the prefill
            about half the buffer at the default recipe's lengths), the rest stays unwritten, as it was."""
            if self.is_initialized:
                for name in ("key_buffer", "value_buffer"):
                    buffer = getattr(self, name)
                    rows = buffer.new_empty((buffer.shape[0] * repeats, *buffer.shape[1:]))
                    grouped = rows.view(buffer.shape[0], repeats, *buffer.shape[1:])
                    grouped[..., : self.length, :] = buffer[:, None, ..., : self.length, :]
                    setattr(self, name, rows)
                self._filled()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            """Keep rows `indices`: their filled positions are gathered into new buffers in one pass (about
            what a decode step reads), and the old ones are freed, a layer at a time.  Moved to the front of
            the same buffers instead, they went through a gathered copy and back: 2x the time (tiny's 448 of
            512 rows at 40 of 74 positions: 507 against 242 µs a buffer); whole tiny rollouts at 64 new tokens,
            which compact ~17 times, ran 1.08x [0.98, 1.71] and 1.13x [0.61, 1.44] faster (12 and 16
            alternating pairs in one process, the same tokens and logprobs)."""
            if self.is_initialized:
                for name in ("key_buffer", "value_buffer"):
                    buffer = getattr(self, name)
                    kept = buffer.new_empty((len(indices), *buffer.shape[1:]))
                    torch.index_select(buffer[:, :, : self.length], 0, indices, out=kept[:, :, : self.length])
                    setattr(self, name, kept)
                self._filled()

        def _unsupported(self, *args, **kwargs):
            raise NotImplementedError("the sampling cache only appends, repeats rows after the prefill and drops rows")

        crop = reorder_cache = reset = _unsupported

    cache = DynamicCache(config=model.config)
    cache.layers = [PreallocatedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def compiled_cache_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype the compiled decoding step keeps its KV cache in: autocast's where it is on, else the keys'.

    Why: under autocast every product of `decoder_pass.decode_step` casts the whole cache it reads to
    autocast's dtype, at every step and in every layer (in a compiled medium rollout under bf16 those casts
    were the step's largest fused kernel).  Stored already cast, the same products read the same numbers,
    half the bytes of a float32 cache, and nothing is cast twice; the cache takes half the memory.  The
    eager path keeps the keys' dtype: transformers' attention takes the cache as it is."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _prefill(model: PreTrainedModel, prompt_ids, prompt_mask, positions, cache) -> torch.Tensor:
    """The prompts' pass through transformers' forward, filling `cache`: the last position's logits [D, V]."""
    return model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        logits_to_keep=1,
        **cache_argument(model, cache),
    ).logits[:, -1]


def _decode(model: PreTrainedModel, token, positions, mask, cache) -> torch.Tensor:
    """One decoding step through transformers' forward, appending to `cache`: the new logits [B, V]."""
    return model(
        input_ids=token[:, None],
        attention_mask=mask,
        position_ids=positions,
        logits_to_keep=1,
        **cache_argument(model, cache),
    ).logits[:, -1]


def _prefill_on_buffers(model: PreTrainedModel, prompt_ids, prompt_mask, positions, cache) -> torch.Tensor:
    """The prompts' pass through `decoder_pass.prefill` (compiled): its keys and values written into the
    cache here; the last position's logits [D, V]."""
    step = decoder_pass.compiled_prefill(*prompt_ids.shape)
    rope = decoder_pass.rotary(model.get_decoder(), positions, below=prompt_ids.shape[1])
    logits, keys, values = step(model, prompt_ids, rope, decoder_pass.causal_mask(prompt_mask))
    for layer, key, value in zip(cache.layers, keys, values, strict=True):
        layer.update(key, value)
    return logits


def _decode_on_buffers(model: PreTrainedModel, token, positions, mask, cache) -> torch.Tensor:
    """One decoding step through `decoder_pass.decode_step` (compiled): it reads the cache's filled
    positions, and its new keys and values are appended here, in place."""
    layers = cache.layers
    step = decoder_pass.compiled_decode_step(len(token), cache.get_seq_length())
    # outside the compiled step (no cos/sin there); a new token's position is at most the cache's filled length
    rope = decoder_pass.rotary(model.get_decoder(), positions, below=cache.get_seq_length() + 1)
    logits, keys, values = step(
        model, token, rope, mask.bool(), [layer.keys for layer in layers], [layer.values for layer in layers]
    )
    for layer, key, value in zip(layers, keys, values, strict=True):
        layer.update(key, value)
    return logits


def can_drop_rows(cache) -> bool:
    """Whether every layer of the sampling cache keeps only per-row keys and values, which its
    batch_select_indices drops: the preallocated layers and transformers' sliding-window ones.  A hybrid
    model's linear-attention layers (conv and recurrent states) or a quantized cache would keep the rows'
    other states, so their rows stay in the batch to the end."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return all(isinstance(layer, Preallocated) or type(layer) is DynamicSlidingWindowLayer for layer in cache.layers)


DECODE_ATTENTION = "atrctl-cpu-decode"


@contextmanager
def decode_attention(model: PreTrainedModel):
    """On CPU, a model using sdpa attention decodes with `_cpu_decode_attention` (one query per row) while
    in this block.  torch's CPU flash kernel is built for many queries: for one it took 1.2-1.7x the time
    of two plain matrix products and a softmax (64-256-wide models, 40-300 keys), and decode attention is
    about half of a tiny model's sampling.  Everything else, the prefill included, stays sdpa."""
    config = model.config
    if model.device.type != "cpu" or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, _cpu_decode_attention)
    if DECODE_ATTENTION not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)  # the masks sdpa gets
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def _cpu_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention of one new token per row: softmax(q·kᵀ·scale + mask)·v, the query heads of a KV head
    batched together (no copy of the keys per query head).  query [B, H, 1, D], key/value [B, H_kv, S, D],
    attention_mask bool [B, 1, 1, S] (True = attend) or None; returns [B, 1, H, D] as transformers' attention
    functions do.  Anything else goes to sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or kwargs.get("position_bias") is not None or module.training:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    rows, heads, _, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    scale = dim**-0.5 if scaling is None else scaling
    grouped = query.view(rows, kv_heads, heads // kv_heads, dim)  # query head h reads KV head h // groups
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scale  # [B, H_kv, groups, S]
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask[:, :, :, -keys:].bool(), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    return torch.matmul(probs, value).view(rows, 1, heads, dim), None


def _without_grad(device: torch.device, compiled: bool):
    """no_grad for the eager sampler under autocast, else inference_mode.  Autocast keeps one low-precision
    copy of each weight for as long as its block lasts, but not under inference_mode, which made every
    decoding step cast every weight again.  Kept, eager bf16 sampling ran 1.12x faster on the SmolLM2-135M
    shape (32 rows) and 1.57x on the Qwen2.5-0.5B shape (16 rows), 0.99x on medium's 512 rows, whose products
    outweigh its 4M weights' casts (`grad_mode` (retired: docs/performance-log.md), 32 new tokens).  A compiled step
    casts inside its graph either way (0.93x, 0.99x there), and without autocast there is nothing to keep:
    inference_mode, the cheaper of the two, stays."""
    keeps_casts = torch.is_autocast_enabled(device.type) and not compiled
    return torch.no_grad() if keeps_casts else torch.inference_mode()


COMPACT_AT = 1 / 8
"""Finished rows leave the decoding batch once they are this fraction of it.  A completion that has ended
would otherwise go through every layer until the longest one ends: SmolLM2-135M-Instruct's replies to
64 two-digit additions at 256 new tokens filled 29% of the batch's row-steps.  Each compaction copies the
remaining rows' filled KV cache once, about what one decode step reads; at 1/8 a batch is compacted at most
~8·ln(rows) times and never carries more than 1/8 finished rows."""


def sample(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    eos_id: int | list[int],
    pad_id: int,
    generator: torch.Generator | None = None,
    repeats: int = 1,
    compiled: bool = False,
) -> Rollout:
    """Sample `repeats` completions per prompt (rows prompt-major), stopping once every row has emitted EOS
    (any of `eos_id`, when it is a list).

    A GRPO group shares its prompt, so the prompt's forward pass (the prefill) runs once per distinct
    prompt and its KV cache is copied to the group's rows.  Rows that have ended leave the batch
    (`COMPACT_AT`; a cache `can_drop_rows` refuses keeps them), and
    with them the check that their probabilities are finite.  Same `generator` state, same tokens, with or
    without compaction on CPU (up to the last bits of a matrix product over fewer rows); on CUDA the
    multinomial's draws depend on the batch, so compaction changes the stream, not its distribution.
    The generator must live on the model's device.  `compiled` (model.compile): the prefill and decoding steps
    run compiled through `decoder_pass`, on a preallocated cache.
    """
    check_sampling(max_new_tokens, temperature, top_p, greedy)

    device = model.device
    stops = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), device=device)
    distinct, distinct_mask = left_pad(prompt_ids, pad_id, device)
    prompt, prompt_mask = (t.repeat_interleave(repeats, dim=0) for t in (distinct, distinct_mask))
    rows = prompt.shape[0]
    completion_ids = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=device)
    cache = preallocated_cache(model, capacity=prompt.shape[1] + max_new_tokens)
    compact = can_drop_rows(cache)
    compiled = compiled and all(isinstance(layer, Preallocated) for layer in cache.layers)
    if compiled:  # model.compile: the prefill and decoding steps through decoder_pass, filling the preallocated buffers
        store_as = compiled_cache_dtype(device)
        for layer in cache.layers:  # before the prefill: the buffers take their dtype when it first writes
            layer.store_as = store_as
        prefill, decode = _prefill_on_buffers, _decode_on_buffers
    else:
        prefill, decode = _prefill, _decode
    with _without_grad(device, compiled), decode_attention(model):
        positions = position_ids(distinct_mask)
        logits = prefill(model, distinct, distinct_mask, positions, cache)
        if repeats > 1:
            cache.batch_repeat_interleave(repeats)
            positions, logits = positions.repeat_interleave(repeats, dim=0), logits.repeat_interleave(repeats, dim=0)
        live = torch.arange(rows, device=device)  # the output row of each batch row
        mask, done = prompt_mask, torch.zeros(rows, dtype=torch.bool, device=device)
        for produced in range(1, max_new_tokens + 1):
            token, logp = _next_token(logits, temperature, top_p, greedy, generator, (live, rows))
            token, logp = torch.where(done, pad_id, token), logp.masked_fill(done, 0.0)
            completion_ids[live, produced - 1], logprobs[live, produced - 1] = token, logp
            done = done | torch.isin(token, stops)
            ended = int(done.sum())  # the step's one host sync
            if produced == max_new_tokens or ended == len(done):
                break
            if compact and ended >= COMPACT_AT * len(done):
                keep = (~done).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                live = live.index_select(0, keep)
                token, mask, positions = token[keep], mask[keep], positions[keep]
                done = done[keep]
            mask = torch.cat([mask, torch.ones_like(done[:, None], dtype=mask.dtype)], dim=-1)
            positions = positions[:, -1:] + 1
            logits = decode(model, token, positions, mask, cache)

    completion_ids, logprobs = completion_ids[:, :produced], logprobs[:, :produced]
    is_eos = torch.isin(completion_ids, stops).long()
    completion_mask = (is_eos.cumsum(-1) - is_eos == 0).long()  # up to and including the first EOS
    return Rollout(prompt, prompt_mask, completion_ids, completion_mask, logprobs)
