"""One RL step: sample and score (`rollout_step`), then `update_step`'s num_iterations × minibatches optimiser
steps, each of which accumulates a mini-batch's gradient over its micro-batches and ranks, then applies it.
"""

from __future__ import annotations

import math
import time

import torch

from atrctl.config.schema import AlgoConfig
from atrctl.core.advantages import group_advantages
from atrctl.core.aggregation import aggregation_normaliser
from atrctl.core.correction import correction_weights
from atrctl.core.loss_metrics import finish_metrics
from atrctl.core.losses import POLICY_LOSSES, policy_loss
from atrctl.model.adapters import reference_pass
from atrctl.model.batch import Rollout
from atrctl.model.forward import completion_logprobs, completion_logprobs_and_entropy
from atrctl.model.loading import is_sharded
from atrctl.rollout.backend import NonFiniteProbabilities, RolloutBackend, decode_completions
from atrctl.runtime import distributed
from atrctl.tasks import Problem
from atrctl.training.bad_steps import BadStepLimit, undo_last_update, verified
from atrctl.training.batching import (
    concat_rollouts,
    parts,
    rank_positions,
    rollout_seed,
    rows,
    sampling_chunks,
    trimmed,
)
from atrctl.training.checkpoint import TrainState
from atrctl.training.checks import metric_names
from atrctl.training.micro_batches import Idle, cut_micro_batches, lockstep, pass_rows
from atrctl.training.schedule import lr_at, prompts_for_step
from atrctl.training.setup import Run
from atrctl.training.sharding import full_tensor, optimizer_parameters
from atrctl.training.step_metrics import STEP_PHASES, Stopwatch, combine_metrics, reduce_step_metrics


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
    (`undo_last_update`) and the step samples again from the weights before it."""
    while True:
        try:
            sampled, failed = rollout_step(run, state.step, clock), False
        except NonFiniteProbabilities:
            sampled, failed = None, True
        run.sampler.join_peers()  # a rank that stopped early still takes part in the others' engine calls
        if not distributed.any_rank(failed, run.device):  # every rank takes the same branch
            verified(state)
            return sampled
        undo_last_update(run, state, state.step + 1)
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
    compiled = run.numerics.compiled
    with clock("logprobs"), torch.no_grad(), run.numerics.autocast():
        if recompute:  # the first mini-batch's own first pass gives its old logprobs (`_optimiser_step`)
            old_logp = _logprobs(run.model, rollout, pieces[1:], cfg.rollout.temperature, compiled=compiled)
        elif not on_policy:
            old_logp = rollout.logprobs  # [rows, T], the backend's own (it says they match)
        if run.reference is not None:
            ref_logp = _logprobs(run.reference, rollout, pieces, cfg.rollout.temperature, run.model, compiled)
        elif algo.beta > 0:  # LoRA: the reference is the policy's base, its adapters off
            with reference_pass(run.adapters):
                ref_logp = _logprobs(run.model, rollout, pieces, cfg.rollout.temperature, compiled=compiled)
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
    """One mini-batch's optimiser step: `_accumulate` its gradient, then `_apply` it; None if skipped."""
    run.optimizer.zero_grad(set_to_none=True)
    micro, finite = _accumulate(run, rollout, advantages, part, pieces, old_logp, ref_logp, own_old_logprobs)
    return _apply(run, part, pieces, micro, finite)


def _accumulate(
    run: Run,
    rollout: Rollout,
    advantages: torch.Tensor,
    part: slice,
    pieces: list[torch.Tensor],
    old_logp,
    ref_logp,
    own_old_logprobs: bool,
) -> tuple[list[tuple[dict, float, float]], bool]:
    """Backward passes over one mini-batch's micro-batches (`pieces`: row indices of the rows it trains on):
    (each micro-batch's metrics, tokens and weight; whether every loss was finite).  With `own_old_logprobs`
    (the weights are still the sampling policy's) the ratio's denominator is the pass's own logprobs, detached,
    and they are written into `old_logp` (when the update keeps one) for the passes that follow.

    Each micro-batch's loss is weighted by its normaliser over the whole mini-batch's (summed over ranks,
    skipped rows included), so the summed gradient equals the single-process, whole-mini-batch gradient
    for every aggregation.
    """
    algo, cfg = run.recipe.algo, run.recipe
    # the mini-batch's normaliser (its tokens or sequences) over every rank: a micro-batch's share is its own / this
    total = distributed.all_sum(aggregation_normaliser(rollout.completion_mask[part], algo.agg).double()).clamp(min=1)
    sharded = is_sharded(run.model)
    micro, finite = [], True
    for index, where in enumerate(pieces):
        idle, where = isinstance(where, Idle), pass_rows(where)
        sub = trimmed(rows(rollout, where))  # the micro-batch: every [rows, ...] tensor indexed by `where`
        width = sub.completion_ids.shape[1]
        with run.numerics.autocast():  # logp, entropy: [micro rows, width] float32
            logp, entropy = completion_logprobs_and_entropy(
                run.model, sub, cfg.rollout.temperature, bool(algo.entropy_coef), compiled=run.numerics.compiled
            )
        if idle:  # a sharded model's pass that keeps the ranks in step: its backward adds zeros
            (logp.sum() * 0.0).backward()
            continue
        if own_old_logprobs and old_logp is not None:  # kept for this mini-batch's later passes (μ > 1)
            old_logp[where, :width] = logp.detach()
        old = logp.detach() if own_old_logprobs else old_logp[where, :width]
        # the backend drew these tokens from its μ, not from π_old: weigh each token's term by the correction
        weights, mismatch = correction_weights(
            cfg.rollout.correction, old, sub.logprobs, sub.completion_mask, **cfg.rollout.correction_args
        )
        loss, metrics = policy_loss(
            logp,
            old,
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
            token_weights=None if cfg.rollout.correction == "none" else weights,
            **algo.args,
        )
        metrics = {**metrics, **dict(zip(mismatch, torch.stack(list(mismatch.values())).tolist(), strict=True))}
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
    return micro, finite


def _apply(
    run: Run, part: slice, pieces: list[torch.Tensor], micro: list[tuple[dict, float, float]], finite: bool
) -> dict[str, float] | None:
    """Sum the accumulated gradient over ranks, clip it and step AdamW; the step's metrics, or None when a
    loss or the gradient is non-finite on any rank (every rank then drops the step)."""
    cfg = run.recipe
    params = optimizer_parameters(run.optimizer)  # not the module's: a sharded root may hold gathered tensors
    for parameter in params:  # no row trained: a zero gradient still steps AdamW (momentum, weight decay),
        if parameter.grad is None:  # exactly as computing it would
            parameter.grad = torch.zeros_like(parameter)
    if not is_sharded(run.model):  # FSDP has reduced them already
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
            filled = _logprobs(
                run.model, rollout, [pieces], run.recipe.rollout.temperature, compiled=run.numerics.compiled
            )
        where = torch.cat(list(pieces))
        old_logp[where] = filled[where]


def _logprobs(
    model: torch.nn.Module,
    rollout: Rollout,
    pieces: list[list[torch.Tensor]],
    temperature: float,
    path_of: torch.nn.Module | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """No-grad logprobs [rows, T] of the rows the update trains on, in its micro-batches; 0 elsewhere; through
    the pass of `path_of` (the policy, for its reference) where given, compiled where the policy's is."""
    out = torch.zeros_like(rollout.logprobs)
    for where in (where for micro in pieces for where in micro):
        rows_here = trimmed(rows(rollout, pass_rows(where)))
        logp = completion_logprobs(model, rows_here, temperature, path_of=path_of, compiled=compiled)
        if not isinstance(where, Idle):
            out[where, : logp.shape[1]] = logp
    return out


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
