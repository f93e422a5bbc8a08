"""The update's decoder pass for Llama-family models, written as one function over the model's own modules.

`forward._completion_outputs` gets the same states through transformers' `LlamaModel.forward` twice (the
group's shared prompt once, then the completions on its KV cache).  Here the loop over layers is ours and
calls the model's own norms, projections and MLPs (so LoRA adapters inside them still apply), with
rotary phases, masks and SDPA computed once per pass, and the prompts' and completions' positions go
through each position-wise step as one matrix (`decoder_states`).  Same arithmetic as transformers'
(tested to 1e-6, gradients included), and faster eagerly too (`update_pass` (retired: docs/performance-log.md)): every
model it supports takes it.

Being a plain function of tensors, it is what `torch.compile` takes, with dynamic shapes, so one
compilation serves every micro-batch's rows and widths (`model.compile`, `compilable`); the
data-dependent parts (which rows share a prompt) stay outside it, in `decoder_inputs`.  `decode_step` is
the sampler's twin, used when compiled: one new token per row on the preallocated KV cache.

Only models whose every layer is known to compute this function take it (`supports`): Llama and Qwen2
decoders with full attention, a static rotary table, no attention dropout while training, no activation
checkpointing; anything else keeps transformers' forward.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from atrctl.model.batch import Rollout, equal_runs, position_ids

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

DECODERS = {"LlamaModel", "Qwen2Model"}  # class names whose forward this module reproduces
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # rotary tables that do not change with the sequence length


def compilable(model: PreTrainedModel) -> bool:
    """Whether `model`'s update passes and its sampler's prefill and decode steps may run compiled
    (`update_states`, `prefill`, `decode_step`, given compiled=True); False, with a warning, where this module
    does not reproduce the model, which then runs eagerly.  Compilation happens at the first use: 10-60 s on a
    2-core CPU (less when torch's on-disk cache already holds it)."""
    if not supports(model):
        log.warning(
            "warning: model.compile: %s is not a decoder atrctl compiles (Llama and Qwen2 with full attention, no "
            "activation checkpointing); it runs eagerly",
            type(model).__name__,
        )
        return False
    return True


def update_states(model: PreTrainedModel, rollout: Rollout, compiled: bool) -> torch.Tensor:
    """`decoder_states` of the rollout's rows, compiled where `compiled` says so (a reference model computes as
    its policy does), else eager.

    torch.compile specialises sizes 0 and 1 even with dynamic shapes, so a micro-batch with one row, one
    distinct prompt, a one-token prompt or completions of at most two tokens would compile once more (seen:
    one recompilation each); those rare micro-batches run the same function eagerly instead."""
    inputs = decoder_inputs(model, rollout)
    sizes = (*inputs.prompt_ids.shape, *inputs.completion_ids.shape)
    if compiled and min(sizes) >= 2:
        return _compiled("states", decoder_states)(model, inputs)
    return decoder_states(model, inputs)


def _compiled(name: str, function):
    """`function` compiled once per process with dynamic shapes (every model and size shares it)."""
    if name not in _COMPILED_FUNCTIONS:
        _COMPILED_FUNCTIONS[name] = compile_dynamic(function)
    return _COMPILED_FUNCTIONS[name]


def compile_dynamic(function, backend: str | Callable = "inductor"):
    """torch.compile(function) with every size a symbol of its own.  By default torch gives sizes that are
    equal at the first compilation one symbol ("duck sizing"), so a micro-batch of 16 rows on a model
    with head_dim 16, or a prompt as wide as the completions, would guard on that equality and compile
    again once it fails (seen)."""
    compiled = torch.compile(function, backend=backend, dynamic=True)

    def run(*args):
        with torch.fx.experimental._config.patch(use_duck_shape=False):  # read when a compilation starts
            return compiled(*args)

    return run


_COMPILED_FUNCTIONS: dict = {}  # name -> its function compiled, once per process


def supports(model: PreTrainedModel) -> bool:
    """Whether `decoder_states` and `decode_step` compute what `model.get_decoder()` would."""
    decoder = getattr(model, "get_decoder", lambda: None)()
    if decoder is None or type(decoder).__name__ not in DECODERS or decoder is model:
        return False
    config = decoder.config
    rope = getattr(getattr(decoder, "rotary_emb", None), "rope_type", None)
    return (
        rope in STATIC_ROPE
        and getattr(config, "_attn_implementation", None) in ("sdpa", "eager")
        and not getattr(config, "use_sliding_window", False)
        and not (model.training and getattr(config, "attention_dropout", 0.0))
        and not any(getattr(layer, "gradient_checkpointing", False) for layer in decoder.layers)
    )


Rotary = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), [*positions' shape, head_dim] each


@dataclass
class DecoderInputs:
    """A micro-batch laid out for `decoder_states`: the distinct prompts once, each row's completion after it."""

    prompt_ids: torch.Tensor  # [D, P] the distinct prompts (D runs of consecutive equal rows)
    prompt_mask: torch.Tensor  # [D, 1, P, P] bool, True = attend (causal, padding, each position itself)
    owner: torch.Tensor  # [B, D] float one-hot: row b's distinct prompt
    completion_ids: torch.Tensor  # [B, T-1] every completion token that predicts a next one
    completion_mask: torch.Tensor  # [B, 1, T-1, P + T-1] bool
    rope: Rotary  # [D·P + B·(T-1), head_dim] each: the prompts' positions, then the completions', flattened


def decoder_inputs(model: PreTrainedModel, rollout: Rollout) -> DecoderInputs:
    """The rows' inputs with their shared prompts found (`batching.equal_runs`), their masks and rotary
    phases built: all of it outside the compiled function, whose backward would otherwise recompute the
    phases' cos and sin (a probe's profile: the rotary backward kernels were the largest part of a tiny
    model's compiled backward)."""
    prompt, prompt_mask, completion = rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids
    mask = torch.cat([prompt_mask, rollout.completion_mask], dim=1).bool()
    positions = position_ids(mask.long())
    first, counts = equal_runs(torch.cat([prompt, prompt_mask], dim=1))
    owner = torch.repeat_interleave(torch.arange(len(counts), device=prompt.device), counts)
    owner = F.one_hot(owner, len(counts)).float()
    width, steps = prompt.shape[1], completion.shape[1] - 1

    # a completion token attends to its prompt's real tokens, then causally to its own completion
    on_prompt = causal_mask(mask[first, :width])
    on_completion = torch.cat(
        [mask[:, None, None, :width].expand(-1, 1, steps, width), causal_mask(mask[:, width : width + steps])], dim=-1
    )
    flat_positions = torch.cat([positions[first, :width].flatten(), positions[:, width : width + steps].flatten()])
    return DecoderInputs(
        prompt[first],
        on_prompt,
        owner,
        completion[:, :steps],
        on_completion,
        rotary(model.get_decoder(), flat_positions, below=mask.shape[1]),  # positions count real tokens only
    )


def causal_mask(mask: torch.Tensor) -> torch.Tensor:
    """[rows, 1, L, L] bool of padding masks [rows, L], True = attend: real keys at or before the query; and
    every query its own key, so that a padded one (which sees no real key) keeps a finite softmax (its output
    is never read, and its key is masked wherever it is cached)."""
    length = mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=mask.device).tril()
    return (mask.bool()[:, None, None, :] & causal) | torch.eye(length, dtype=torch.bool, device=mask.device)


def decoder_states(model: PreTrainedModel, inputs: DecoderInputs) -> torch.Tensor:
    """The decoder's last hidden states at the positions that predict each completion token: [B, T, H].

    Column 0 is the prompt's last position (it predicts the first token), column t the completion's token
    t - 1.  The prompt runs once per distinct prompt; its keys and values are then copied to its rows, so
    gradients reach the prompt's activations through every completion of the group.  Prompt and completion
    positions travel as one [D·P + B·(T-1), H] matrix through every position-wise step (norms, projections,
    MLP: one matrix product each instead of two smaller ones) and part only for attention.
    """
    decoder = model.get_decoder()
    distinct, width = inputs.prompt_ids.shape
    rows, steps = inputs.completion_ids.shape
    split = distinct * width  # positions [0, split) are the prompts', the rest the completions'

    def prompts(t: torch.Tensor) -> torch.Tensor:  # [N, heads, head_dim] -> [D, heads, P, head_dim]
        return t[:split].view(distinct, width, *t.shape[1:]).transpose(1, 2)

    def completions(t: torch.Tensor) -> torch.Tensor:  # [N, heads, head_dim] -> [B, heads, T-1, head_dim]
        return t[split:].view(rows, steps, *t.shape[1:]).transpose(1, 2)

    def attend(index: int, attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = [_attend(attention, prompts(q), prompts(k), prompts(v), inputs.prompt_mask).flatten(0, 1)]
        if steps:  # the completions attend to their prompt's keys and values, then to their own
            keys = torch.cat([_to_rows(prompts(k), inputs.owner), completions(k)], dim=2)
            values = torch.cat([_to_rows(prompts(v), inputs.owner), completions(v)], dim=2)
            out.append(_attend(attention, completions(q), keys, values, inputs.completion_mask).flatten(0, 1))
        return torch.cat(out) if steps else out[0]

    hidden = decoder.embed_tokens(torch.cat([inputs.prompt_ids.flatten(), inputs.completion_ids.flatten()]))
    hidden = _layers(decoder, hidden, inputs.rope, attend)
    last = decoder.norm(hidden[:split].view(distinct, width, -1)[:, -1:])  # [D, 1, H]
    last = _to_rows(last, inputs.owner)  # [B, 1, H]
    return torch.cat([last, decoder.norm(hidden[split:].view(rows, steps, -1))], dim=1) if steps else last


def _layers(decoder, hidden: torch.Tensor, rope: Rotary, attend) -> torch.Tensor:
    """The decoder's layers over positions `hidden` [..., H]: the one layer loop of every pass (the update's,
    the prefill and the decoding step).  `attend(index, attention, q, k, v)` is what differs between them: the
    attention output [..., heads·head_dim] of the positions' queries, keys and values [..., heads, head_dim]."""
    for index, layer in enumerate(decoder.layers):
        attention = layer.self_attn
        q, k, v = _projections(attention, layer.input_layernorm(hidden), rope)
        hidden = hidden + attention.o_proj(attend(index, attention, q, k, v))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden


def rotary(decoder, positions: torch.Tensor, below: int) -> Rotary:
    """The rotary phases of `positions` (any shape, every one < `below`: a bound the caller knows from shapes,
    so no value is read back), as the decoder's rotary module computes them for its embeddings' dtype:
    [*positions.shape, head_dim] each; constants of the pass (no gradient).

    Looked up in a table of the module's phases for the first positions, computed once per model, dtype and
    device and grown by doubling: computed per pass they took ~0.2 ms of the ~0.6 ms of a tiny micro-batch's
    inputs, a dozen times a step (its update's micro-batches and every decoding step).  The compiled sampler
    and the update read the same table, so their phases agree to the bit."""
    flat = positions.flatten()
    return tuple(table.index_select(0, flat).view(*positions.shape, -1) for table in _rotary_table(decoder, below))


def _rotary_table(decoder, below: int) -> Rotary:
    # the module reads only the dtype and device; detached, since a no-grad view of a parameter, passed into a
    # module, is refused by hooks that track gradients (torch.utils.flop_counter's counting an old-logprob pass)
    embeddings = decoder.embed_tokens.weight.detach()
    tables = _ROTARY_TABLES.setdefault(decoder.rotary_emb, {})
    key = (embeddings.dtype, embeddings.device)
    if key not in tables or tables[key][0].shape[0] < below:
        length = max(ROTARY_TABLE_MIN, 1 << max(0, below - 1).bit_length())
        cos, sin = decoder.rotary_emb(embeddings[:1], torch.arange(length, device=embeddings.device)[None])
        tables[key] = (cos[0], sin[0])
    return tables[key]


ROTARY_TABLE_MIN = 256  # positions in a first table: the tiny presets' rows never need another
_ROTARY_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # rotary module -> {(dtype, device): table}


def _to_rows(per_prompt: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """Each row's copy of its prompt's tensor: [D, ...] -> [B, ...], as a product with the one-hot `owner`
    [B, D].  Its gradient (each prompt's sum over its rows) is then a product too; as index_select and
    index_add the compiled pair took 2-3% of a medium model's update in a profile (scalar scatter loops).
    Exact in any dtype: one term per sum, and autocast off so that nothing is rounded on the way."""
    with torch.autocast(per_prompt.device.type, enabled=False):
        rows = owner.to(per_prompt.dtype) @ per_prompt.flatten(1)
    return rows.view(owner.shape[0], *per_prompt.shape[1:])


def _projections(attention, x: torch.Tensor, rope: Rotary):
    """Queries and keys with their rotary phases, and values, of positions x [..., H]: [..., heads, head_dim]
    each (rope: [..., head_dim])."""
    shape = (*x.shape[:-1], -1, attention.head_dim)
    q, k, v = (projection(x).view(shape) for projection in (attention.q_proj, attention.k_proj, attention.v_proj))
    cos, sin = rope[0].unsqueeze(-2), rope[1].unsqueeze(-2)  # one phase for every head
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(-x₂, x₁) of x = (x₁, x₂) halves of its last dimension.  Where a gradient flows, as a product with a
    signed permutation matrix: exact in any dtype (one nonzero term per sum), and its gradient is a product
    too.  Written as slices, negation and concatenation, the compiled backward's kernel for it took 2 ms on a
    medium micro-batch (index arithmetic, not vectorised), the largest element-wise kernel of the update.

    Without a gradient (the sampler's prefill and decoding steps, no-grad logprob passes) as those slices,
    the same numbers (tested), which inductor fuses into the kernel around them: as products they were 4 of
    a tiny decoding step's 19 matrix-product calls and ~10% of its time (py-spy).  Tiny rollouts at 64 new
    tokens ran 1.065x [0.91, 1.39] faster (12 alternating pairs, same tokens and logprobs to the bit)."""
    dim = x.shape[-1]
    half = dim // 2
    if not torch.is_grad_enabled():
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    eye = torch.eye(half, dtype=x.dtype, device=x.device)
    zero = torch.zeros_like(eye)
    rotation = torch.cat([torch.cat([zero, eye], dim=1), torch.cat([-eye, zero], dim=1)])  # [dim, dim]
    with torch.autocast(x.device.type, enabled=False):
        return x @ rotation


def _attend(
    attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    cached: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v of q [rows, heads, L, head_dim], heads side by side: [rows, L, heads·head_dim]
    (the output projection's input).  mask: [rows, 1, L, S] bool, True = attend, at least one per query.
    With `cached` (a decoding step's keys and values of one layer, [rows, H_kv, S, head_dim] each) q is the
    step's one position per row, and mask [rows, S + 1] covers the cache, then the new key.

    Short attention on a CPU (at most MATH_ATTENTION_MAX query-key pairs per head) is written out as two
    products and a softmax, in float32 whatever the autocast: torch's CPU flash kernel takes up to 2x as long
    there in float32, forward and backward, and under bf16 its backward was 55% of a medium model's compiled
    update on an AMX Xeon (`attention_kernel` (retired: docs/performance-log.md)).  Its scores are then at most 8 KB
    per row and head.  Float32 is what the flash kernel accumulates and normalises in, so written out and SDPA agree to
    float32 rounding, and under bf16 to the rounding of the output (both tested): a policy on transformers'
    forward (FSDP, attention dropout) and its reference on this pass then start with a KL of bf16 noise at
    most.  Everything else takes SDPA: long attention, whose memory then does not grow with L·S, and a GPU's
    (not measured there).  Compiled, the size test is a guard: a micro-batch on the other side of it compiles
    the pass once more."""
    rows, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads  # grouped-query attention: query head h reads KV head h // groups
    if cached is not None:  # one decoding step: a query per row over the cache, then over its own new key
        grouped = q.view(rows, kv_heads, groups, dim)
        scores = torch.cat([grouped @ cached[0].transpose(-1, -2), grouped @ k.transpose(-1, -2)], dim=-1)
        scores = (scores * attention.scaling).masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)  # [B, H_kv, groups, S + 1]
        out = probs[..., :-1] @ cached[1] + probs[..., -1:] * v  # [B, H_kv, groups, D]
        return out.reshape(rows, 1, heads * dim)
    if q.device.type == "cpu" and length * k.shape[2] <= MATH_ATTENTION_MAX:
        with torch.autocast("cpu", enabled=False):
            grouped = q.float().reshape(rows, kv_heads, groups * length, dim)  # a KV head's queries as one matrix
            k, v = k.float(), v.float()
            # compiled and short: products as broadcast sums, which inductor fuses with the softmax around them
            summed = torch.compiler.is_compiling() and length * k.shape[2] <= SUMMED_ATTENTION_MAX
            if summed:  # [rows, kv_heads, groups·L, 1, D] · [rows, kv_heads, 1, S, D], summed over D
                scores = (grouped.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1)
            else:
                scores = grouped @ k.transpose(-1, -2)
            scores = scores.view(rows, kv_heads, groups, length, -1) * attention.scaling
            scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(rows, kv_heads, groups * length, -1)
            if summed:  # [rows, kv_heads, groups·L, S, 1] · [rows, kv_heads, 1, S, D], summed over S
                out = (probs.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)
            else:
                out = probs @ v
            out = out.view(rows, heads, length, dim).to(q.dtype)
    else:
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attention.scaling)
    return out.transpose(1, 2).flatten(2)


MATH_ATTENTION_MAX = 2048
"""Query-key pairs per row and head up to which `_attend` writes attention out instead of calling SDPA: below it the
written-out form is faster, above it SDPA. Measured: docs/performance-log.md#math_attention_max."""
SUMMED_ATTENTION_MAX = 512
"""Query-key pairs per row and head up to which compiled, written-out attention takes its two products as broadcast
products summed over the shared dimension, which inductor fuses with the mask and softmax (the same sums in float32,
tested against transformers to 1e-5); crossing it compiles the pass once more. Measured:
docs/performance-log.md#summed_attention_max."""


def prefill(
    model: PreTrainedModel, prompt_ids: torch.Tensor, rope: Rotary, mask: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The sampler's first pass over the (left-padded) prompts [D, P]: (the last position's logits [D, V],
    each layer's keys and values [D, H_kv, P, head_dim], for the sampler to write into its cache).
    rope: `rotary` of the prompts' positions; mask: `causal_mask` of their padding.  Same function as
    transformers' prefill, to float rounding (tested)."""
    decoder = model.get_decoder()
    keys, values = [], []

    def attend(index: int, attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [D, heads, P, head_dim]
        keys.append(k)
        values.append(v)
        return _attend(attention, q, k, v, mask)

    hidden = _layers(decoder, decoder.embed_tokens(prompt_ids), rope, attend)  # [D, P, H]
    return model.get_output_embeddings()(decoder.norm(hidden[:, -1])), keys, values


def decode_step(
    model: PreTrainedModel,
    token: torch.Tensor,
    rope: Rotary,
    key_mask: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One decoding step of every row: (last-position logits [B, V], each layer's new key and value
    [B, H_kv, 1, D]).

    token [B], rope: `rotary` of its positions [B, 1], key_mask [B, S + 1] bool (True = attend; the last
    column is the new token), keys/values: each layer's cached [B, H_kv, S, D] (views of the sampler's
    buffers).  The cache is read, never written: the caller appends the new keys and values.  Compiled with
    the writes inside (into its inputs, which compiled code may copy back whole) the step was barely faster
    than eager in a probe; attending to the cache and to the new key separately (one softmax over both)
    keeps it free of writes.  Same function as transformers' decoding step with
    `atrctl.rollout.hf._cpu_decode_attention`, to float rounding (tested).
    """
    decoder = model.get_decoder()
    new_keys, new_values = [], []

    def attend(index: int, attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, 1, head_dim]
        new_keys.append(k)
        new_values.append(v)
        return _attend(attention, q, k, v, key_mask, cached=(keys[index], values[index]))

    hidden = _layers(decoder, decoder.embed_tokens(token[:, None]), rope, attend)  # [B, 1, H]
    logits = model.get_output_embeddings()(decoder.norm(hidden))[:, 0]
    return logits, new_keys, new_values


def compiled_prefill(rows: int, width: int):
    """`prefill`, compiled unless a size of 1 would compile it once more (see `update_states`)."""
    return _compiled("prefill", prefill) if min(rows, width) >= 2 else prefill


def compiled_decode_step(rows: int, cached: int):
    """`decode_step` for `rows` rows over `cached` positions, compiled unless a size of 1 would compile it
    once more (see `update_states`)."""
    return _compiled("decode", decode_step) if min(rows, cached) >= 2 else decode_step
