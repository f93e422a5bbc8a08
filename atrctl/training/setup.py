"""Setting a run up once: the base (warmed up or cached), the policy with its adapters, sharding and compile,
the reference, the problems and their prompts, the optimiser and the rollout backend, all in one `Run`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from atrctl.config.schema import Recipe
from atrctl.model.adapters import add_adapters, lora_settings, store_frozen_base, trained_parameters
from atrctl.model.decoder_pass import compilable
from atrctl.model.numerics import Numerics
from atrctl.rollout.backend import RolloutBackend
from atrctl.rollout.prompts import PLAIN, PromptStyle, check_lengths, encode_prompts, model_positions, prompt_style
from atrctl.runtime import distributed
from atrctl.tasks import Problem, Task, get_task, problem_pool
from atrctl.training.checks import LENGTH_FLAG, validate_algo
from atrctl.training.rollback import Snapshot
from atrctl.training.rundir import RunDir
from atrctl.training.schedule import PROMPT_POOL
from atrctl.training.sharding import GatheredSampler, check_can_shard, full_copy, shard_model

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase


@dataclass(kw_only=True)
class Run:
    """Everything the loop touches, set up once (`build_run`), named at construction."""

    recipe: Recipe
    run_dir: RunDir
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    sampler: RolloutBackend
    numerics: Numerics
    task: Task
    pool: list[Problem]
    pool_ids: list[list[int]]
    held_out: list[Problem]
    held_out_ids: list[list[int]]
    optimizer: torch.optim.Optimizer
    reference: torch.nn.Module | None = None
    snapshot: Snapshot | None = None  # the state before the latest update (`run.rollback`)
    style: PromptStyle = PLAIN  # how the prompts were written (`atrctl.rollout.prompts`)
    eval_batch: int = 1024  # completions sampled at once in held-out checks (eval.batch, or sized from the model)
    adapters: PeftModel | None = (
        None  # the peft wrapper of `model` when it trains LoRA adapters (`atrctl.model.adapters`)
    )

    @property
    def device(self) -> torch.device:
        return self.numerics.device


def build_run(
    recipe: Recipe,
    directory: str | Path | RunDir,
    results: Path,
    on_warmup: Callable[[int, int, float, float | None], None] | None = None,
) -> Run:
    from atrctl.model.loading import enable_checkpointing, load_model
    from atrctl.model.memory import sized_batch
    from atrctl.model.numerics import numerics, resolve_device, resolve_dtype
    from atrctl.rollout.backend import rollout_backend
    from atrctl.runtime.allocator import keep_freed_memory
    from atrctl.runtime.machine import set_cpu_threads
    from atrctl.training.base_cache import ensure_base

    validate_algo(recipe)  # and `check_before_warmup`
    lora = lora_settings(recipe.model.lora)
    check_can_shard(recipe.model.shard, distributed.world_size(), bool(lora), recipe.model.compile)
    task = get_task(recipe.task.name, **recipe.task.args)
    with distributed.main_first():  # rank 0 builds a missing base; the others then load it
        base, _ = ensure_base(recipe, results, on_warmup)
    set_cpu_threads(distributed.cpu_threads_per_rank())
    keep_freed_memory()
    # Master weights in float32, loaded as such (a float32 checkpoint read in bf16 would lose its low
    # bits; bf16 ones upcast exactly); the device's numerics decide whether bf16 autocast does the arithmetic.
    # A policy to shard is loaded on the host: its full copy for sampling is made there, and each process's
    # accelerator then receives that copy and its own shards, never two whole models at once.  So is one
    # that trains adapters: its base reaches the accelerator already in bf16 where it is stored so.
    sharded = recipe.model.shard == "fsdp"
    on_host = sharded or bool(lora)
    model, tokenizer = load_model(str(base), "cpu" if on_host else recipe.model.device, "float32")
    width = getattr(model.config, "hidden_size", None)
    compute = numerics(resolve_device(recipe.model.device), policy=recipe.model.autocast, width=width)
    if recipe.model.gradient_checkpointing:
        enable_checkpointing(model)
    adapters = add_adapters(model, lora, recipe.run.seed) if lora else None  # injected into `model` in place
    if adapters is not None:  # under bf16 autocast a bf16-valued base is stored so: the same numbers, half its bytes
        store_frozen_base(model, compute.autocast_dtype)
        model.to(compute.device)
    model.train()
    if recipe.model.compile and compilable(model):  # the passes then run compiled, as `compute` says
        compute = replace(compute, compiled=True)
    sampled = model  # what the rollout backend samples: the policy itself, or a full copy of a sharded one
    bf16 = compute.device.type == "cuda" and compute.autocast_enabled  # FSDP gathers in bf16 where it computes so
    if sharded:
        sampled = full_copy(model, compute.autocast_dtype).to(compute.device)
        shard_model(model, bf16)  # the shards move to the process's device
    reference = None
    if recipe.algo.beta > 0 and adapters is None:  # with adapters the reference is the base they sit on
        dtype = recipe.model.dtype  # "auto" decided for the device it will run on, not the host it is read on
        dtype = str(resolve_dtype(dtype, compute.device)).removeprefix("torch.") if sharded else dtype
        reference, _ = load_model(str(base), "cpu" if sharded else recipe.model.device, dtype)
        reference.requires_grad_(False)
        if sharded:
            shard_model(reference, bf16)
    pool = problem_pool(task, "train", PROMPT_POOL, recipe.run.seed)
    held_out = problem_pool(task, "test", recipe.eval.problems, recipe.eval.seed)
    style = prompt_style(task, recipe.task.chat_template, recipe.task.system_prompt, recipe.task.instruction)
    pool_ids, held_out_ids = encode_prompts(tokenizer, pool, style), encode_prompts(tokenizer, held_out, style)
    check_lengths(pool_ids + held_out_ids, recipe.rollout.max_new_tokens, model_positions(model), LENGTH_FLAG)
    longest = max(len(ids) for ids in held_out_ids) + recipe.rollout.max_new_tokens
    eval_batch = sized_batch(model, longest, recipe.eval.batch)  # the held-out checks' KV cache is bounded
    # The fused kernel (CPU and CUDA) updates every tensor in one pass: ~6x faster than the per-tensor loop.
    optimizer = torch.optim.AdamW(
        trained_parameters(model), lr=recipe.optim.lr, weight_decay=recipe.optim.weight_decay, fused=True
    )
    run_dir = directory if isinstance(directory, RunDir) else RunDir(directory)
    sampler = rollout_backend(recipe.rollout.backend, sampled, tokenizer, compute, recipe.rollout.engine_args)
    if sampled is not model:
        sampler = GatheredSampler(sampler, sampled)
    return Run(
        recipe=recipe,
        run_dir=run_dir,
        model=model,
        tokenizer=tokenizer,
        sampler=sampler,
        numerics=compute,
        task=task,
        pool=pool,
        pool_ids=pool_ids,
        held_out=held_out,
        held_out_ids=held_out_ids,
        optimizer=optimizer,
        reference=reference,
        snapshot=Snapshot(model, optimizer) if recipe.run.rollback else None,
        style=style,
        eval_batch=eval_batch,
        adapters=adapters,
    )
