"""Memory budgets that size batches: rows of KV cache for sampling, rows of activations for an update.

The budgets are constants (or a fixed share of a GPU's total memory), never the memory free at the time,
so how a run is batched, and therefore its numbers, depends on its recipe and the kind of machine alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from atrctl.model.loading import is_checkpointing

if TYPE_CHECKING:
    import torch


MAX_SAMPLE_BATCH = 1024
KV_BUDGET = 2 * 2**30  # bytes of KV cache a default-sized sampling batch may take


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of KV cache one token of one sequence takes: keys and values of every layer's KV heads."""
    return config_kv_bytes_per_token(model.config, next(model.parameters()).dtype.itemsize)


def config_kv_bytes_per_token(config, itemsize: int) -> int:
    """`kv_bytes_per_token` from a model's config and the cache's bytes per value."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * itemsize


def sized_batch(model: torch.nn.Module, tokens_per_row: int, requested: int = 0) -> int:
    """Rows to sample at once: `requested` if > 0, else as many as KV_BUDGET holds in KV cache at
    `tokens_per_row` (prompt + new tokens), between 1 and MAX_SAMPLE_BATCH.  1024 rows of a 135M Llama at 300
    tokens in float32 would need ~14 GB; the tiny presets fit 1024 in a few MB.  The budget is a constant, not
    the memory free at the time: the batch decides how samples are seeded (evaluation.sample_chunks), so it
    must depend on the model and the lengths alone for a result to be reproducible."""
    if requested > 0:
        return requested
    rows = KV_BUDGET // max(1, kv_bytes_per_token(model) * tokens_per_row)
    return int(min(MAX_SAMPLE_BATCH, max(1, rows)))


UPDATE_BUDGET = 4 * 2**30  # bytes of activations a default-sized micro-batch may keep on a CPU
GPU_UPDATE_SHARE = 4
"""On a GPU the activation budget is this fraction (1/4) of the card's total memory, which leaves the rest for weights,
gradients, AdamW and the KV cache; the total, not the free memory, so micro-batches depend on the recipe and the kind
of GPU alone. Measured: docs/performance-log.md#gpu_update_share."""


def update_budget(device: torch.device) -> int:
    """Bytes of activations a default-sized micro-batch may keep for its backward pass on `device`."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // GPU_UPDATE_SHARE
    return UPDATE_BUDGET


def activation_bytes_per_token(model: torch.nn.Module, tokens_per_row: int, checkpointing: bool | None = None) -> int:
    """Bytes of activations one token of a row of `tokens_per_row` keeps for the backward pass, float32.

    Per layer about 10 hidden-size vectors (norm inputs, q, k, v, attention output, residuals), 6 of the
    MLP's width (gate, up, the activation's input and output, the product) and the attention probabilities
    over the row, 2 × heads × tokens (CPU attention with a padding mask saves them).  At 320 tokens this
    gives 2.5 MB for SmolLM2-135M and 4.5 MB for Qwen2.5-0.5B; one forward/backward there grew the process by
    2.4 and 4.8 MB per token beyond its parameter gradients (`update_memory` (retired: docs/performance-log.md)).  With
    activation checkpointing a layer keeps only its input, and the one being recomputed all of the above.
    `checkpointing` None asks the model (transformers walks its modules for that: pass it when calling often).
    """
    if checkpointing is None:
        checkpointing = is_checkpointing(model)
    return config_activation_bytes_per_token(model.config, tokens_per_row, checkpointing)


def config_activation_bytes_per_token(config, tokens_per_row: int, checkpointing: bool) -> int:
    """`activation_bytes_per_token` from a model's config."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    width = getattr(config, "intermediate_size", None) or 4 * hidden
    layer = 10 * hidden + 6 * width + 2 * config.num_attention_heads * tokens_per_row
    if checkpointing:
        return 4 * (layers * hidden + layer)
    return 4 * layers * layer


def sized_micro_batch(
    model: torch.nn.Module, tokens_per_row: int, checkpointing: bool | None = None, budget: int | None = None
) -> int:
    """Rows per forward/backward where algo.micro_batch is 0: as many as `budget` bytes of activations hold
    at `tokens_per_row` (at least 1); None = the `update_budget` of the model's device (pass it when calling
    often, as with `checkpointing`).  On a CPU, SmolLM2-135M at 320 tokens: 5 rows; the tiny presets: whole
    mini-batches.  A constant budget (not the free memory) keeps a run's arithmetic a function of its recipe."""
    if checkpointing is None:
        checkpointing = is_checkpointing(model)
    if budget is None:
        budget = update_budget(next(model.parameters()).device)
    return sized_micro_batch_rows(model.config, tokens_per_row, checkpointing, budget)


GPU_MEMORY_SHARE = 0.3
"""The share of a GPU the vllm backend's engine may take (weights and KV cache) beside the policy it trains:
TRL's colocate default, which leaves the trainer most of the card (`rollout.engine_args.gpu_memory_utilization`
overrides it)."""
CUDA_OVERHEAD = 2 * 2**30
"""Bytes a GPU process holds beyond its tensors (CUDA context, kernels, the allocator's slack): an allowance,
not measured here."""
ENGINE_OVERHEAD = 2 * 2**30
"""Bytes of a vLLM engine's share that hold neither weights nor KV cache (activations while it samples, CUDA
graphs): an allowance, not measured here."""


def gpu_plan(config, recipe, device_bytes: int, prompt_tokens: int, world: int = 1) -> dict[str, int]:
    """Bytes one of `world` training processes of `recipe` takes on a GPU of `device_bytes`, part by part, for
    the model of `config` and prompts of up to `prompt_tokens`: the memory model of docs/scaling.md, computed
    without the weights.  Trained state is float32 (16 bytes per parameter with AdamW, divided over the processes under
    FSDP2); a frozen or sampling copy is bf16 but for the float32 embedding; activations follow
    `config_activation_bytes_per_token` (float32, so an upper bound under bf16 autocast); the vllm backend's
    engine takes its share of the card (`gpu_memory_utilization`), the hf backend's KV cache its sampling batch.
    Under `engine KV cache (tokens)`, the tokens the engine's cache holds (not bytes, not in the sum)."""
    import torch
    from transformers import AutoModelForCausalLM

    if recipe.model.lora:
        raise ValueError("gpu_plan models full fine-tuning (model.lora is not modelled)")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    bf16_copy = 4 * embedding + 2 * (parameters - embedding)
    shards = world if recipe.model.shard == "fsdp" else 1
    tokens = prompt_tokens + recipe.rollout.max_new_tokens
    rows = recipe.algo.micro_batch or sized_micro_batch_rows(config, tokens, recipe.model.gradient_checkpointing,
                                                             device_bytes // GPU_UPDATE_SHARE)  # fmt: skip
    plan = {
        "weights, gradients and AdamW state (float32)": 16 * parameters // shards,
        "activations of one micro-batch": config_activation_bytes_per_token(
            config, tokens, recipe.model.gradient_checkpointing
        )
        * tokens
        * rows,
        "CUDA context and allocator (allowance)": CUDA_OVERHEAD,
    }
    if shards > 1:
        plan["the sampler's gathered copy (bf16)"] = bf16_copy
    if recipe.algo.beta > 0:
        plan["reference model (bf16)"] = bf16_copy
    kv_token = config_kv_bytes_per_token(config, 2)
    if recipe.rollout.backend == "vllm":
        share = float(recipe.rollout.engine_args.get("gpu_memory_utilization", GPU_MEMORY_SHARE))
        plan["vLLM engine (weights and KV cache)"] = int(share * device_bytes)
        room = plan["vLLM engine (weights and KV cache)"] - 2 * parameters - ENGINE_OVERHEAD
        plan["engine KV cache (tokens)"] = max(0, room) // kv_token
    else:
        batch = max(recipe.rollout.sample_batch, recipe.eval.batch) or KV_BUDGET // max(1, kv_token * tokens)
        plan["KV cache of one sampling batch (bf16)"] = kv_token * tokens * min(batch, MAX_SAMPLE_BATCH)
    return plan


def sized_micro_batch_rows(config, tokens_per_row: int, checkpointing: bool, budget: int) -> int:
    """`sized_micro_batch` from a model's config."""
    per_token = config_activation_bytes_per_token(config, tokens_per_row, checkpointing)
    return max(1, budget // max(1, per_token * tokens_per_row))
