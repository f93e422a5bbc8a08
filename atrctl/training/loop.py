"""The GRPO / ATR-GRPO training loop: rollout → rewards → advantages → policy loss → AdamW.

Read it in call order: `train` runs the loop, `train_step` is one RL step (`rollout_step`, then
`update_step`, which takes `num_iterations × minibatches` optimiser steps), and the set-up and the
small pure parts come after.  Everything a resumed run needs (weights, optimiser, RNG, step) is
checkpointed; the prompt order and the sampling seeds are pure functions of (seed, step), so the data
position is the step itself.  Files go through `atrctl.training.rundir`.

Under torchrun each rank samples and trains on its share of every mini-batch (`atrctl.training.batching`),
gradients are summed over ranks after each mini-batch, and rank 0 alone evaluates and writes.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from atrctl.config.loading import changed_keys, recipe_from_dict, recipe_to_dict
from atrctl.config.schema import AlgoConfig, Recipe
from atrctl.core.advantages import group_advantages
from atrctl.core.losses import POLICY_LOSSES, aggregation_normaliser, finish_metrics, policy_loss
from atrctl.errors import UserError
from atrctl.model.adapters import (
    adapter_line,
    add_adapters,
    lora_settings,
    reference_pass,
    store_frozen_base,
    trained_parameters,
    write_final_model,
)
from atrctl.model.batch import Rollout
from atrctl.model.decoder_pass import compile_policy
from atrctl.model.forward import completion_logprobs, completion_logprobs_and_entropy
from atrctl.model.loading import is_sharded
from atrctl.model.numerics import Numerics
from atrctl.rollout.backend import NonFiniteProbabilities, RolloutBackend, decode_completions
from atrctl.rollout.prompts import PLAIN, PromptStyle, check_lengths, encode_prompts, model_positions, prompt_style
from atrctl.rollout.scoring import mean_reward, sampled_scores
from atrctl.runtime import distributed
from atrctl.tasks import Problem, Task, get_task, problem_pool
from atrctl.training.batching import (
    concat_rollouts,
    parts,
    rank_positions,
    rollout_seed,
    rows,
    sampling_chunks,
    trimmed,
)
from atrctl.training.checkpoint import (
    TrainState,
    capture_rng,
    checkpoint_contents,
    find_checkpoint,
    load_latest_checkpoint,
    previous_checkpoint,
    promote_previous,
    read_state,
    restore_rng,
    write_checkpoint,
)
from atrctl.training.checks import LENGTH_FLAG, metric_names, validate_algo
from atrctl.training.micro_batches import Idle, cut_micro_batches, lockstep, pass_rows
from atrctl.training.rollback import Snapshot
from atrctl.training.rundir import RunDir, bases_folder, environment, exclusive
from atrctl.training.schedule import PROMPT_POOL, lr_at, prompts_for_step
from atrctl.training.sharding import (
    GatheredSampler,
    check_can_shard,
    full_copy,
    full_tensor,
    gathered_weights,
    memory_line,
    optimizer_parameters,
    shard_model,
)
from atrctl.training.step_metrics import STEP_PHASES, Stopwatch, combine_metrics, reduce_step_metrics
from atrctl.training.trackers import Reporters, check_installed, held_out_table, reporter_names

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase


class TrainingStopped(Exception):
    """Too many consecutive non-finite steps, or a diverged policy: the run stops with a valid checkpoint."""


class PolicyDiverged(Exception):
    """The policy's sampling probabilities became non-finite at RL step `step` (1-based)."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


# ----------------------------------------------------------------- the loop


def train(
    recipe: Recipe,
    directory: str | Path,
    *,
    results: Path = Path("results"),
    resume: bool = False,
    overwrite: bool = False,
    on_step: Callable[[dict[str, float]], None] | None = None,
    on_warmup: Callable[[int, int, float, float | None], None] | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> dict | None:
    """Run (or resume) a training run in `directory`; returns the summary written to summary.json.
    `on_notice` gets what the user should read but is not an error (a damaged checkpoint passed over).

    Under torchrun every rank trains on its share of each step and only rank 0 writes, evaluates
    and reports (the other ranks return None).  Everything that can fail on bad input (recipe,
    task, data, model) is set up before the run directory is touched, so a mistake never costs an
    existing run.
    """
    from atrctl.model.numerics import resolve_device

    with distributed.process_group(resolve_device(recipe.model.device)):
        return _train(recipe, RunDir(directory), results, resume, overwrite, on_step, on_warmup, on_notice)


def _train(
    recipe: Recipe,
    run_dir: RunDir,
    results: Path,
    resume: bool,
    overwrite: bool,
    on_step: Callable[[dict[str, float]], None] | None,
    on_warmup: Callable[[int, int, float, float | None], None] | None,
    on_notice: Callable[[str], None] | None,
) -> dict | None:
    main = distributed.is_main()
    # rank 0 decides and every rank abides, so none is left waiting in a collective for a refused one
    distributed.decided_by_main(
        lambda: run_dir.check_can_start(resume, overwrite, recipe.run.steps)
    )  # before the lock file exists
    if main:  # a tracker's missing library is one line, before anything is written
        check_installed(reporter_names(recipe.run), run_dir.path if resume else None)
    if resume:  # an edited config.toml (a warm-up key, say) is refused before a new base is warmed up for it
        distributed.decided_by_main(lambda: _check_recorded_recipe(run_dir, recipe))
    run = build_run(recipe, run_dir, bases_folder(run_dir.path, results), on_warmup)  # then the lock file
    with ExitStack() as held:

        def claim() -> None:  # one writer per run directory; then the check again, now that nobody can change it
            held.enter_context(exclusive(run_dir.path))
            run_dir.recover()
            run_dir.check_can_start(resume, overwrite, recipe.run.steps)

        distributed.decided_by_main(claim)
        weights = "lora" if run.adapters is not None else "full"
        state, replacing = TrainState(recipe=recipe_to_dict(recipe), weights=weights), False
        try:
            if resume:
                state = _resume(run, on_notice)
            elif main:
                replacing = True
                run_dir.create(recipe, environment(run.device))  # an old run (approved --overwrite) is moved aside
            if run.adapters is not None and main and on_notice is not None:
                on_notice(adapter_line(run.model))
            return _run_steps(run, state, resume, on_step, on_notice)
        except BaseException:
            if replacing:
                run_dir.restore_replaced()  # the new run logged no step: the one it was to replace comes back
            raise


def _resume(run: Run, on_notice: Callable[[str], None] | None) -> TrainState:
    """Load the newest intact checkpoint (every rank: the state is replicated; sampling seeds derive from the
    step) and drop the metrics logged after it."""
    state, where, note = load_latest_checkpoint(run.run_dir.checkpoint, run.model, run.optimizer)
    _check_same_recipe(state, run.recipe, run.run_dir)
    restore_rng(state)
    run.sampler.load_weights(run.model)  # a backend that holds its own copy samples the resumed weights
    distributed.barrier()  # every rank has read the checkpoint before rank 0 moves it
    if distributed.is_main():
        if where != run.run_dir.checkpoint:
            promote_previous(run.run_dir.checkpoint)
        run.run_dir.trim_metrics(state.step)
        if note and on_notice is not None:
            on_notice(note)
    return state


def _run_steps(
    run: Run,
    state: TrainState,
    resume: bool,
    on_step: Callable[[dict[str, float]], None] | None,
    on_notice: Callable[[str], None] | None,
) -> dict | None:
    """`_loop`, reported to the recipe's trackers (rank 0): its steps, and the held-out table at the end."""
    recipe = run.recipe
    names = reporter_names(recipe.run) if distributed.is_main() else []
    reporters = Reporters(names, run.run_dir.path, recipe_to_dict(recipe), resumed_at=state.step if resume else None)
    try:
        summary = _loop(run, state, resume, on_step, on_notice, reporters)
    except BaseException:
        reporters.close(failed=True)
        raise
    if summary is not None:
        reporters.tables(*held_out_table(summary))
    reporters.close()
    return summary


def _loop(
    run: Run,
    state: TrainState,
    resume: bool,
    on_step: Callable[[dict[str, float]], None] | None,
    on_notice: Callable[[str], None] | None,
    reporters: Reporters,
) -> dict | None:
    """The loop: the base's held-out figures, then RL steps with logging, checkpoints and clean stops."""
    recipe, run_dir, main = run.recipe, run.run_dir, distributed.is_main()

    def checkpoint() -> None:
        contents = checkpoint_contents(run.model, run.optimizer)  # every rank: a sharded model is gathered
        if main:
            capture_rng(state)
            write_checkpoint(run_dir.checkpoint, contents, state)

    def show(step: int, rows: list[dict]) -> None:
        run_dir.write_samples(step, rows)
        reporters.samples(step, rows)

    def log(record: dict) -> None:
        run_dir.append_metrics(record)
        reporters.log(record)
        if on_step is not None:
            on_step(record)

    base_eval = None
    if main:
        base_eval = run_dir.read_summary().get("base") if resume else None
        if base_eval is None:
            shown: list[dict] = []
            base_eval = held_out_metrics(run, shown)
            run_dir.write_summary({"base": base_eval})
            show(0, shown)
    started, measured = time.perf_counter(), False
    with _StopRequest() as stop:
        while state.step < recipe.run.steps:
            try:
                record, finite = train_step(run, state)
            except PolicyDiverged as diverged:  # nothing to undo: the last checkpoint stays the resume point
                raise TrainingStopped(_divergence_message(run, diverged.step)) from None
            except BadStepLimit:  # an update undone at this step's sampling was the last bad step allowed
                checkpoint()
                raise TrainingStopped(_bad_steps_message(run, state)) from None
            state.step += 1
            if is_sharded(run.model) and main and on_notice is not None and not measured:  # gradients, moments exist
                on_notice(memory_line(run.model, run.optimizer, run.sampler.full_copy))
                measured = True
            if not finite:
                _count_bad_step(state)
            if state.step % recipe.eval.every == 0 or state.step == recipe.run.steps:
                try:
                    figures, rows = _held_out_or_undo(run, state)
                except PolicyDiverged:
                    raise TrainingStopped(_divergence_message(run, state.step)) from None
                record.update(figures or {})
                if main and rows:
                    show(state.step, rows)
            record["skipped_steps"] = state.skipped_steps
            if main:
                log(record)
            if state.bad_steps >= recipe.run.max_bad_steps:
                checkpoint()
                raise TrainingStopped(_bad_steps_message(run, state))
            stopping = _any_rank(stop.signal is not None, run.device)  # SIGINT/SIGTERM on any rank stops all
            if state.step % recipe.run.checkpoint_every == 0 or state.step == recipe.run.steps:
                checkpoint()
            if stopping and state.step < recipe.run.steps:  # after the last step: just finish
                checkpoint()
                raise KeyboardInterrupt
    final = gathered_weights(run.model) if is_sharded(run.model) else None  # every rank: a collective
    return _finish(run, state, base_eval, time.perf_counter() - started, final) if main else None


class BadStepLimit(Exception):
    """`run.max_bad_steps` consecutive bad steps: the run stops on its last good weights."""


def _count_bad_step(state: TrainState) -> None:
    state.bad_steps += 1
    state.skipped_steps += 1


def _undo_last_update(run: Run, state: TrainState, step: int) -> None:
    """The policy the last update left samples non-finite probabilities (found at RL step `step`, 1-based):
    the weights and optimiser state from before that update come back and it counts as a bad step.
    With nothing to go back to (rollback off, or the weights were never updated since they last sampled
    soundly, e.g. just after a resume) the policy has diverged: PolicyDiverged."""
    if run.snapshot is None or not run.snapshot.held or not state.unverified_update:
        raise PolicyDiverged(step)
    run.snapshot.restore()
    run.sampler.load_weights(run.model)
    state.unverified_update = False
    _count_bad_step(state)


def _verified(state: TrainState) -> None:
    """The policy sampled soundly after the last update: that update is good, the bad-step streak ends."""
    if state.unverified_update:
        state.unverified_update, state.bad_steps = False, 0


def _held_out_or_undo(run: Run, state: TrainState) -> tuple[dict[str, float] | None, list[dict]]:
    """Rank 0's held-out figures after the step's update and the completions shown (None and [] on the other
    ranks).  An update whose policy cannot be sampled is undone on every rank and the figures are taken
    again, on the weights restored; none at all if that undo was the last bad step allowed (the loop then
    stops)."""
    while True:
        figures, failed, shown = None, False, []
        if distributed.is_main():
            try:
                figures = held_out_metrics(run, shown)
            except NonFiniteProbabilities:
                failed = True
        if not _any_rank(failed, run.device):
            _verified(state)
            return figures, shown
        _undo_last_update(run, state, state.step)
        if state.bad_steps >= run.recipe.run.max_bad_steps:
            return None, []


def _any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank: one all-reduce, so every rank takes the same branch."""
    return bool(distributed.all_max(torch.tensor(float(flag), device=device)).item())


# What a resume may change in config.toml: how long the run goes, how often it checkpoints or is evaluated, and
# where it runs.  Anything else would make the run something other than what its checkpoint trained.
RESUMABLE_EDITS = {("run", "steps"), ("run", "checkpoint_every"), ("run", "max_bad_steps"), ("run", "tensorboard"),
                   ("run", "report_to"), ("run", "rollback"), ("eval", "every"), ("model", "device"),
                   ("algo", "micro_batch"), ("algo", "skip_zero_advantage"), ("model", "shard")}  # fmt: skip


def _check_same_recipe(state: TrainState, recipe: Recipe, run_dir: RunDir) -> None:
    """A resume continues the run its checkpoint was trained as: a config.toml edited since (beyond
    RESUMABLE_EDITS) is refused, naming what changed.  A checkpoint that recorded no recipe (made before
    recipes were recorded) is taken as it is, and records this one from now on."""
    now = recipe_to_dict(recipe)
    saved = recipe_to_dict(recipe_from_dict(state.recipe)) if state.recipe else now  # new keys: their defaults
    changed = [f"{section}.{key}: {saved[section][key]!r} → {now[section][key]!r}"
               for section, key in changed_keys(saved, now, RESUMABLE_EDITS)]  # fmt: skip
    if changed:
        raise UserError(f"{run_dir.config} no longer matches the recipe its checkpoint was trained with "
                        f"({'; '.join(changed)}): restore it, or start a new run")  # fmt: skip
    state.recipe = now


def _check_recorded_recipe(run_dir: RunDir, recipe: Recipe) -> None:
    """`_check_same_recipe` against the newest checkpoint's state.json alone (no weights): what `_resume` will
    check once the model is built, said before the build warms up a base.  A checkpoint that cannot be read is
    left to `_resume`, which explains it."""
    for candidate in (run_dir.checkpoint, previous_checkpoint(run_dir.checkpoint)):
        try:
            state = read_state(candidate)
        except UserError:
            continue
        _check_same_recipe(state, recipe, run_dir)
        return


def _divergence_message(run: Run, step: int) -> str:
    return (f"the policy diverged: sampling at step {step} met non-finite probabilities (optim.lr = "
            f"{run.recipe.optim.lr:g}) and there is no update to undo; {_saved_weights(run)}; "
            "train again with a lower optim.lr")  # fmt: skip


def _bad_steps_message(run: Run, state: TrainState) -> str:
    return (f"{state.bad_steps} consecutive steps were bad (a non-finite loss or gradient, or an update after "
            f"which sampling met non-finite probabilities) at step {state.step}; {_saved_weights(run)}; "
            f"train again with a lower optim.lr (now {run.recipe.optim.lr:g})")  # fmt: skip


def _saved_weights(run: Run) -> str:
    last = find_checkpoint(run.run_dir.checkpoint)
    if last is None:
        return "no checkpoint was saved yet"
    return f"the checkpoint in {last} (step {read_state(last).step}) holds the last good weights"


def _finish(run: Run, state: TrainState, base_eval: dict, seconds: float, gathered: dict | None) -> dict:
    """Save the final model in Hugging Face format with the headline figures (a sharded model's from its
    `gathered` float32 weights)."""
    summary = {
        "base": base_eval,
        "final": run.run_dir.last_eval(),
        "steps": state.step,
        "skipped_steps": state.skipped_steps,
        "algo": run.recipe.algo.loss,
        "algo_args": run.recipe.algo.args,
        "task": run.recipe.task.name,
        "seed": run.recipe.run.seed,
        "train_seconds_this_session": round(seconds, 1),
    }
    if run.adapters is not None:
        run.run_dir.finish(lambda directory: write_final_model(run.adapters, directory), run.tokenizer, summary)
    elif gathered is not None:  # written by the sampler's copy (an unsharded model), with the shards' weights
        save = run.sampler.full_copy.save_pretrained
        run.run_dir.finish(lambda directory: save(directory, state_dict=gathered), run.tokenizer, summary)
    else:
        run.run_dir.finish(run.model.save_pretrained, run.tokenizer, summary)
    return summary


# ----------------------------------------------------------------- one step


def train_step(run: Run, state: TrainState) -> tuple[dict[str, float], bool]:
    """RL step `state.step` (0-based): its metrics (docs/design.md §3, plus where the time went) and whether
    it was finite.  With `run.rollback`, a non-finite step changes nothing (its applied mini-batches are undone)."""
    clock = Stopwatch(run.device)
    started = time.perf_counter()
    rollout, rewards, _ = _sample_or_undo(run, state, clock)  # rewards: [prompts on this rank, G]
    advantages, _ = group_advantages(rewards, run.recipe.algo.advantage)  # [prompts, G] -> rows by flatten
    if run.snapshot is not None:
        run.snapshot.take()  # these weights just sampled soundly: the state a bad update goes back to
    metrics, finite = update_step(run, rollout, advantages.flatten().to(run.device), state.step, clock)
    if finite:
        state.unverified_update = True
    elif run.snapshot is not None:
        run.snapshot.restore()
    run.sampler.load_weights(run.model)  # the next rollout samples from the updated policy
    rewards = distributed.all_gather(rewards.to(run.device)).cpu()  # every rank's groups, for the step's figures
    _, frac_zero_std = group_advantages(rewards, run.recipe.algo.advantage)
    tokens = int(distributed.all_sum(rollout.completion_mask.sum()).item())
    seconds = time.perf_counter() - started
    return {
        "step": state.step + 1,
        "reward/mean": rewards.mean().item(),
        "reward/std": rewards.std().item(),
        "frac_zero_std": frac_zero_std,
        "len/mean": tokens / rewards.numel(),
        **metrics,
        **{f"time/{phase}": clock.seconds.get(phase, 0.0) for phase in STEP_PHASES},
        "time/step": seconds,
        "tokens_per_s": tokens / seconds,
    }, finite


def _sample_or_undo(run: Run, state: TrainState, clock: Stopwatch):
    """The step's rollout.  Non-finite probabilities mean the last update broke the policy: it is undone
    (`_undo_last_update`) and the step samples again from the weights before it."""
    while True:
        try:
            sampled, failed = rollout_step(run, state.step, clock), False
        except NonFiniteProbabilities:
            sampled, failed = None, True
        if not _any_rank(failed, run.device):  # every rank takes the same branch
            _verified(state)
            return sampled
        _undo_last_update(run, state, state.step + 1)
        if state.bad_steps >= run.recipe.run.max_bad_steps:
            raise BadStepLimit


def rollout_step(run: Run, step: int, clock: Stopwatch | None = None) -> tuple[Rollout, torch.Tensor, list[Problem]]:
    """Sample G completions for each of this rank's prompts of the step and score them:
    (rollout of prompts × G rows, prompt-major; rewards [prompts on this rank, G]; problems).
    Chunks and seeds: `atrctl.training.batching`."""
    clock = clock or Stopwatch(run.device)
    cfg, seed = run.recipe.rollout, run.recipe.run.seed
    picked = prompts_for_step(len(run.pool), step, cfg.prompts, seed)
    positions = rank_positions(cfg.prompts, run.recipe.algo.minibatches, distributed.world_size(), distributed.rank())
    problems = [run.pool[picked[p]] for p in positions]
    pieces = []
    with clock("rollout"):
        for chunk in sampling_chunks(positions, cfg.group_size, cfg.sample_batch):
            generator = torch.Generator(run.device).manual_seed(rollout_seed(seed, step, chunk[0]))
            pieces.append(
                run.sampler.generate(
                    [run.pool_ids[picked[p]] for p in chunk],
                    repeats=cfg.group_size,
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    generator=generator,
                )
            )
        rollout = concat_rollouts(pieces, run.tokenizer.pad_token_id)
    with clock("reward"):
        texts = decode_completions(run.tokenizer, rollout)  # row i is completion i % G of problem i // G
        rewards = [run.task.score(problems[i // cfg.group_size], text).reward for i, text in enumerate(texts)]
    return rollout, torch.tensor(rewards).view(len(problems), cfg.group_size), problems


def update_step(
    run: Run, rollout: Rollout, advantages: torch.Tensor, step: int, clock: Stopwatch | None = None
) -> tuple[dict[str, float], bool]:
    """μ passes of `minibatches` optimiser steps over one rollout; (metrics, whether every step was finite)."""
    algo, cfg, clock = run.recipe.algo, run.recipe, clock or Stopwatch(run.device)
    minibatches = parts(advantages.shape[0], algo.minibatches)  # row slices of whole groups
    # each mini-batch's rows to train on, cut into micro-batches once for every pass over it
    pieces = [cut_micro_batches(run.model, rollout, trained_rows(algo, advantages, part), algo) for part in minibatches]
    if is_sharded(run.model):  # every rank takes as many passes as the busiest: each one is a collective
        pieces = lockstep(pieces, minibatches, run.device)
    on_policy, recompute = is_on_policy(algo), recomputes_old_logprobs(algo, run.sampler)
    old_logp = ref_logp = None
    with clock("logprobs"), torch.no_grad(), run.numerics.autocast():
        if recompute:  # the first mini-batch's own first pass gives its old logprobs (`_optimiser_step`)
            old_logp = _logprobs(run.model, rollout, pieces[1:], cfg.rollout.temperature)
        elif not on_policy:
            old_logp = rollout.logprobs  # [rows, T], the backend's own (it says they match)
        if run.reference is not None:
            ref_logp = _logprobs(run.reference, rollout, pieces, cfg.rollout.temperature, path_of=run.model)
        elif algo.beta > 0:  # LoRA: the reference is the policy's base, its adapters off
            with reference_pass(run.adapters):
                ref_logp = _logprobs(run.model, rollout, pieces, cfg.rollout.temperature)
    for module in (run.model, run.reference):  # FSDP keeps a root gathered after a pass without backward
        if module is not None and is_sharded(module):
            module.reshard()
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, cfg.optim.lr, cfg.optim.schedule, cfg.optim.warmup_steps, cfg.run.steps)

    collected, finite = [], True
    with clock("update"):
        for iteration in range(algo.num_iterations):
            for index, (part, micro) in enumerate(zip(minibatches, pieces, strict=True)):
                # before the first optimiser step the policy is the one that sampled: a pass's own logprobs,
                # detached, are the old ones, the same numbers a recomputing pass gets (tested)
                own = on_policy or (recompute and iteration == index == 0)
                metrics = _optimiser_step(run, rollout, advantages, part, micro, old_logp, ref_logp, own)
                if metrics is None:
                    finite = False
                else:
                    collected.append(metrics)
    metrics = finish_metrics(combine_metrics(collected)) if collected else {}
    metrics["lr"] = run.optimizer.param_groups[0]["lr"]
    return metrics, finite


def skips_zero_advantage(algo: AlgoConfig) -> bool:
    """Whether the update leaves out rows with advantage 0 (`AlgoConfig.skip_zero_advantage`).  Every
    registered loss is a multiple of A token by token, so such a row's policy-loss gradient is exactly 0;
    the KL penalty and the entropy bonus are not, and a loss that declares `needs_every_row` is not either."""
    needed = algo.beta > 0 or algo.entropy_coef != 0 or POLICY_LOSSES[algo.loss].needs_every_row
    return algo.skip_zero_advantage and not needed


def trained_rows(algo: AlgoConfig, advantages: torch.Tensor, part: slice) -> torch.Tensor:
    """Indices of the mini-batch's rows that go through the forward/backward pass."""
    where = torch.arange(part.start, part.stop, device=advantages.device)
    return where[advantages[part] != 0] if skips_zero_advantage(algo) else where


def _optimiser_step(
    run: Run,
    rollout: Rollout,
    advantages: torch.Tensor,
    part: slice,
    pieces: list[torch.Tensor],
    old_logp,
    ref_logp,
    own_old_logprobs: bool,
) -> dict[str, float] | None:
    """Accumulate one mini-batch's gradient over its micro-batches (`pieces`: row indices of the rows it
    trains on) and ranks, then step; None if skipped.  With `own_old_logprobs` (the weights are still the
    sampling policy's) the ratio's denominator is the pass's own logprobs, detached, and they are written
    into `old_logp` (when the update keeps one) for the passes that follow.

    Each micro-batch's loss is weighted by its normaliser over the whole mini-batch's (summed over ranks,
    skipped rows included), so the summed gradient equals the single-process, whole-mini-batch gradient
    for every aggregation.
    """
    algo, cfg = run.recipe.algo, run.recipe
    # the mini-batch's normaliser (its tokens or sequences) over every rank: a micro-batch's share is its own / this
    total = distributed.all_sum(aggregation_normaliser(rollout.completion_mask[part], algo.agg).double()).clamp(min=1)
    run.optimizer.zero_grad(set_to_none=True)
    sharded = is_sharded(run.model)
    micro, finite = [], True
    for index, where in enumerate(pieces):
        idle, where = isinstance(where, Idle), pass_rows(where)
        sub = trimmed(rows(rollout, where))  # the micro-batch: every [rows, ...] tensor indexed by `where`
        width = sub.completion_ids.shape[1]
        with run.numerics.autocast():  # logp, entropy: [micro rows, width] float32
            logp, entropy = completion_logprobs_and_entropy(
                run.model, sub, cfg.rollout.temperature, entropy_grad=bool(algo.entropy_coef)
            )
        if idle:  # a sharded model's pass that keeps the ranks in step: its backward adds zeros
            (logp.sum() * 0.0).backward()
            continue
        if own_old_logprobs and old_logp is not None:  # kept for this mini-batch's later passes (μ > 1)
            old_logp[where, :width] = logp.detach()
        loss, metrics = policy_loss(
            logp,
            logp.detach() if own_old_logprobs else old_logp[where, :width],
            advantages[where],
            sub.completion_mask,
            algo=algo.loss,
            agg=algo.agg,
            max_new_tokens=cfg.rollout.max_new_tokens,
            ref_logp=None if ref_logp is None else ref_logp[where, :width],
            beta=algo.beta,
            kl_estimator=algo.kl_estimator,
            entropy=entropy,
            entropy_coef=algo.entropy_coef,
            **algo.args,
        )
        if not torch.isfinite(loss):
            finite = False
            if not sharded:
                if own_old_logprobs and old_logp is not None:  # the later passes still need the rest's
                    _fill_old_logprobs(run, rollout, pieces[index + 1 :], old_logp)
                break
            (loss * 0.0).backward()  # FSDP: the other ranks wait in this pass's collectives; the step is dropped
            continue
        weight = (aggregation_normaliser(sub.completion_mask, algo.agg) / total).item()  # its exact share
        (loss * weight).backward()
        micro.append((metrics, float(sub.completion_mask.sum()), weight))
    params = optimizer_parameters(run.optimizer)  # not the module's: a sharded root may hold gathered tensors
    for parameter in params:  # no row trained: a zero gradient still steps AdamW (momentum, weight decay),
        if parameter.grad is None:  # exactly as computing it would
            parameter.grad = torch.zeros_like(parameter)
    if not sharded:  # FSDP has reduced them already
        distributed.sum_gradients(params)
    finite = bool(distributed.all_min(torch.tensor(float(finite), device=run.device)))
    grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)).item() if finite else 0.0
    if not (finite and math.isfinite(grad_norm)):
        run.optimizer.zero_grad(set_to_none=True)
        return None
    run.optimizer.step()
    rows_here = part.stop - part.start
    trained = sum(len(where) for where in pieces if not isinstance(where, Idle))
    skipped = distributed.all_sum(torch.tensor([rows_here - trained, rows_here], device=run.device))
    keys = list(micro[0][0]) if micro else metric_names(run.recipe)  # the same on every rank
    measured = reduce_step_metrics(micro, keys, run.device)
    return {**measured, "rows/skipped": (skipped[0] / skipped[1]).item(), "grad_norm": grad_norm}


def _fill_old_logprobs(run: Run, rollout: Rollout, pieces: list[torch.Tensor], old_logp: torch.Tensor) -> None:
    """Write the old logprobs of `pieces`' rows into `old_logp`: a first pass that stopped at a non-finite
    loss left them unwritten, and the weights are still the sampling ones (its step is dropped)."""
    if pieces:
        with torch.no_grad(), run.numerics.autocast():
            filled = _logprobs(run.model, rollout, [pieces], run.recipe.rollout.temperature)
        where = torch.cat(list(pieces))
        old_logp[where] = filled[where]


def _logprobs(
    model: torch.nn.Module,
    rollout: Rollout,
    pieces: list[list[torch.Tensor]],
    temperature: float,
    path_of: torch.nn.Module | None = None,
) -> torch.Tensor:
    """No-grad logprobs [rows, T] of the rows the update trains on, in its micro-batches; 0 elsewhere; through
    the pass of `path_of` (the policy, for its reference) where given."""
    out = torch.zeros_like(rollout.logprobs)
    for where in (where for micro in pieces for where in micro):
        logp = completion_logprobs(model, trimmed(rows(rollout, pass_rows(where))), temperature, path_of=path_of)
        if not isinstance(where, Idle):
            out[where, : logp.shape[1]] = logp
    return out


SHOWN_PROBLEMS = 8  # held-out problems whose greedy and first sampled completions go to samples/step-<N>.jsonl


def held_out_metrics(run: Run, shown: list[dict] | None = None) -> dict[str, float]:
    """Held-out greedy accuracy and sampled pass@1, on the same problems and sample seed every time; the
    greedy and first sampled completions of the first SHOWN_PROBLEMS are appended to `shown` when given."""
    from atrctl.rollout.evaluate import completion_row
    from atrctl.rollout.prompts import prompt_text

    cfg = run.recipe.eval
    greedy_texts: list[list[str]] = []
    sampled_texts: list[list[str]] = []
    greedy = sampled_scores(
        run.sampler,
        run.tokenizer,
        run.task,
        run.held_out,
        run.held_out_ids,
        samples=1,
        max_new_tokens=run.recipe.rollout.max_new_tokens,
        greedy=True,
        batch_size=run.eval_batch,
        texts=greedy_texts,
    )
    generator = torch.Generator(run.device).manual_seed(cfg.seed)
    sampled = sampled_scores(
        run.sampler,
        run.tokenizer,
        run.task,
        run.held_out,
        run.held_out_ids,
        samples=cfg.samples,
        max_new_tokens=run.recipe.rollout.max_new_tokens,
        temperature=cfg.temperature,
        generator=generator,
        batch_size=run.eval_batch,
        texts=sampled_texts,
    )
    if shown is not None:
        for i, problem in enumerate(run.held_out[:SHOWN_PROBLEMS]):
            prompt = prompt_text(run.tokenizer, problem.prompt, run.style)
            shown.append(completion_row(problem, prompt, "greedy", greedy_texts[i][0], greedy[i][0]))
            shown.append(completion_row(problem, prompt, 0, sampled_texts[i][0], sampled[i][0]))
    return {"eval/greedy": mean_reward(greedy), "eval/pass@1": mean_reward(sampled)}


# ----------------------------------------------------------------- set-up


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
    from atrctl.model.loading import load_model
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
        model.activation_checkpointing_enable({"use_reentrant": False})
    adapters = add_adapters(model, lora, recipe.run.seed) if lora else None  # injected into `model` in place
    if adapters is not None:  # under bf16 autocast a bf16-valued base is stored so: the same numbers, half its bytes
        store_frozen_base(model, compute.autocast_dtype)
        model.to(compute.device)
    model.train()
    if recipe.model.compile:
        compile_policy(model)
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
    sampler = rollout_backend(recipe.rollout.backend, sampled, tokenizer, compute)
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


def is_on_policy(algo: AlgoConfig) -> bool:
    """One optimiser step per rollout: the ratio is exactly 1 and the current logprobs are the old ones."""
    return algo.num_iterations == 1 and algo.minibatches == 1


def recomputes_old_logprobs(algo: AlgoConfig, sampler: RolloutBackend) -> bool:
    """Whether the update runs a forward pass for the ratio's denominator (see `AlgoConfig.old_logprobs`).

    Only off-policy updates need old logprobs.  "auto" reuses the rollout's own when its backend says they
    may stand in (the "hf" sampler in float32, where they match the training pass to ~1e-6, tested, and
    under bf16 on a CPU), which saves a forward pass over the whole batch.  A recomputing pass skips the
    first mini-batch: its first training pass runs before any optimiser step, so its own logprobs are the
    old ones (`update_step`).
    """
    reuse = algo.old_logprobs == "sampler" or (algo.old_logprobs == "auto" and sampler.logprobs_reusable)
    return not is_on_policy(algo) and not reuse


# ----------------------------------------------------------------- small parts


class _StopRequest:
    """Turn SIGINT/SIGTERM into a flag the loop checks between steps, so the checkpoint is consistent."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # elsewhere Python refuses handlers
            self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _handle(self, signum, frame):
        if self.signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
