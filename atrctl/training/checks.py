"""What is checked before any work: the loss and its parameters, the batch split, and what can be refused
without the model (threads, memory, LoRA rank and prompt lengths of a preset) before a base is warmed up."""

from __future__ import annotations

import functools
import json

from atrctl.config.loading import recipe_to_dict
from atrctl.config.schema import Recipe
from atrctl.core.losses import POLICY_LOSSES, check_loss
from atrctl.errors import UserError
from atrctl.model.adapters import check_rank, lora_settings
from atrctl.rollout.prompts import check_lengths, encode_prompts, prompt_style
from atrctl.runtime import distributed
from atrctl.tasks import get_task, problem_pool
from atrctl.training.schedule import PROMPT_POOL


def validate_algo(recipe: Recipe, world: int | None = None) -> None:
    """Fail before any work if the loss, its parameters or the batch split (over `world` ranks) are wrong."""
    algo, world = recipe.algo, world or distributed.world_size()
    if algo.loss not in POLICY_LOSSES:
        raise UserError(f"algo.loss = '{algo.loss}' is not a registered loss; use one of {', '.join(POLICY_LOSSES)}")
    if recipe.rollout.prompts % (algo.minibatches * world):
        ranks = f" × {world} processes" if world > 1 else ""
        raise UserError(
            f"rollout.prompts ({recipe.rollout.prompts}) must be divisible by algo.minibatches "
            f"({algo.minibatches}){ranks} so that groups stay whole"
        )
    try:
        probe_loss(recipe)
    except (ValueError, TypeError) as error:  # TypeError: a list or table where a number belongs
        raise UserError(f"algo.args for '{algo.loss}': {error}") from None
    check_before_warmup(recipe)


LENGTH_FLAG = "rollout.max_new_tokens"
ROLLOUT_BYTES_PER_TOKEN = 16
"""Host bytes a rollout keeps per completion token at the least: its id (int64), its old logprob and its
advantage (float32 each) — before any KV cache or activation, which depend on the model."""


def check_before_warmup(recipe: Recipe) -> None:
    """What can be refused without the base model, checked before it is warmed up (hours for a preset) and
    before anything is written: ATRCTL_THREADS, the memory the step's and the held-out check's samples take
    at the least, and for a preset (whose shape is known before it exists) the LoRA rank and prompt lengths."""
    from atrctl.model.loading import MAX_POSITIONS, PRESETS
    from atrctl.rollout.backend import check_backend
    from atrctl.rollout.evaluate import BYTES_PER_SAMPLE, check_samples_fit
    from atrctl.runtime.machine import check_fits, requested_threads

    requested_threads()
    rollout = recipe.rollout
    check_backend(rollout.backend)
    if rollout.backend == "vllm":
        from atrctl.rollout.vllm_engine import check_engine_args

        check_engine_args(rollout.engine_args)
    rows = rollout.prompts * rollout.group_size
    check_fits(f"rollout.prompts × rollout.group_size = {rows:,} completions of {rollout.max_new_tokens} tokens",
               rows * (BYTES_PER_SAMPLE + ROLLOUT_BYTES_PER_TOKEN * rollout.max_new_tokens),
               "lower rollout.group_size or rollout.prompts")  # fmt: skip
    check_samples_fit(recipe.eval.problems, recipe.eval.samples, "eval.samples", "eval.problems")
    if recipe.model.base not in PRESETS:  # a real model's shape is read with it: it needs no warm-up
        return
    lora = lora_settings(recipe.model.lora)
    hidden, _, heads, _ = PRESETS[recipe.model.base]
    if lora:
        check_rank(lora["r"], hidden)
    if rollout.backend == "vllm":
        from atrctl.model.numerics import resolve_device
        from atrctl.rollout.vllm_engine import check_head_size

        check_head_size(hidden // heads, resolve_device(recipe.model.device))
    section = recipe_to_dict(recipe)["task"]
    longest = _longest_preset_prompt(json.dumps(section, sort_keys=True), recipe.run.seed, recipe.eval.problems,
                                     recipe.eval.seed)  # fmt: skip
    check_lengths([[0] * longest], rollout.max_new_tokens, MAX_POSITIONS, LENGTH_FLAG)
    from atrctl.tasks import PRESETS

    for benchmark in recipe.eval.benchmarks:  # evaluated by compare after training: refused now, not then
        as_benchmark = json.dumps({**section, "name": benchmark, "args": {}}, sort_keys=True)
        longest = _longest_preset_prompt(as_benchmark, recipe.run.seed, None, recipe.eval.seed)
        check_lengths([[0] * longest], PRESETS[benchmark].max_new_tokens, MAX_POSITIONS,
                      f"{benchmark}'s max new tokens (eval.benchmarks)")  # fmt: skip


@functools.lru_cache(maxsize=8)
def _longest_preset_prompt(task_section: str, seed: int, problems: int | None, eval_seed: int) -> int:
    """Tokens of the longest prompt a preset sees (its prompt pool and held-out problems; problems None: a
    benchmark's, all test): kept per setting, as every arm of a comparison shares it and encoding the pool takes
    a large part of a second."""
    from atrctl.model.loading import build_char_tokenizer

    section = json.loads(task_section)
    task = get_task(section["name"], **section["args"])
    style = prompt_style(task, section["chat_template"], section["system_prompt"], section["instruction"])
    if problems is None:
        pool = task.problems("test", None, eval_seed)
    else:
        pool = problem_pool(task, "train", PROMPT_POOL, seed) + problem_pool(task, "test", problems, eval_seed)
    return max((len(ids) for ids in encode_prompts(build_char_tokenizer(), pool, style)), default=0)


def probe_loss(recipe: Recipe):
    """The recipe's policy loss on one token (`losses.check_loss`): it raises on bad parameters, and its metrics
    name the loss's."""
    algo = recipe.algo
    return check_loss(algo.loss, algo.agg, max_new_tokens=recipe.rollout.max_new_tokens, beta=algo.beta,
                      kl_estimator=algo.kl_estimator, entropy_coef=algo.entropy_coef, **algo.args)  # fmt: skip


def metric_names(recipe: Recipe) -> list[str]:
    """Every metric an optimiser step reports: the loss's diagnostics and the sampler's mismatch."""
    from atrctl.core.correction import MISMATCH_METRICS

    return [*probe_loss(recipe).metrics, *MISMATCH_METRICS]
