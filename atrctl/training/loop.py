"""The GRPO / ATR-GRPO training run's lifecycle: claim the run directory, build or resume, loop over steps, finish.

Read it in call order: `train` checks, claims and builds (`atrctl.training.setup`), `_loop` runs the steps
(`atrctl.training.step`) with logging, held-out checks, checkpoints and clean stops, and `_finish` saves the
final model.  Everything a resumed run needs (weights, optimiser, RNG, step) is checkpointed; the prompt
order and the sampling seeds are pure functions of (seed, step), so the data position is the step itself.
Files go through `atrctl.training.rundir`.

Under torchrun each rank samples and trains on its share of every mini-batch (`atrctl.training.batching`),
gradients are summed over ranks after each mini-batch, and rank 0 alone evaluates and writes.
"""

from __future__ import annotations

import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from atrctl.config.loading import changed_keys, recipe_from_dict, recipe_to_dict
from atrctl.config.schema import Recipe
from atrctl.errors import UserError
from atrctl.model.adapters import adapter_line, write_final_model
from atrctl.model.loading import is_sharded
from atrctl.runtime import distributed
from atrctl.training.bad_steps import (
    BadStepLimit,
    PolicyDiverged,
    TrainingStopped,
    bad_steps_message,
    count_bad_step,
    divergence_message,
    held_out_or_undo,
)
from atrctl.training.checkpoint import (
    TrainState,
    capture_rng,
    checkpoint_contents,
    load_latest_checkpoint,
    previous_checkpoint,
    promote_previous,
    read_state,
    restore_rng,
    write_checkpoint,
)
from atrctl.training.held_out import held_out_metrics
from atrctl.training.rundir import RunDir, bases_folder, environment, exclusive
from atrctl.training.setup import Run, build_run
from atrctl.training.sharding import gathered_weights, memory_line
from atrctl.training.step import train_step
from atrctl.training.trackers import Reporters, check_installed, held_out_table, reporter_names

log = logging.getLogger(__name__)


def train(
    recipe: Recipe,
    directory: str | Path,
    *,
    results: Path = Path("results"),
    resume: bool = False,
    overwrite: bool = False,
    on_step: Callable[[dict[str, float]], None] | None = None,
    on_warmup: Callable[[int, int, float, float | None], None] | None = None,
) -> dict | None:
    """Run (or resume) a training run in `directory`; returns the summary written to summary.json.
    What the user should read but is not an error (a damaged checkpoint passed over) is a notice on the
    `atrctl` loggers (`atrctl.cli.display.show_notices`).

    Under torchrun every rank trains on its share of each step and only rank 0 writes, evaluates
    and reports (the other ranks return None).  Everything that can fail on bad input (recipe,
    task, data, model) is set up before the run directory is touched, so a mistake never costs an
    existing run.
    """
    from atrctl.model.numerics import resolve_device

    with distributed.process_group(resolve_device(recipe.model.device)):
        return _train(recipe, RunDir(directory), results, resume, overwrite, on_step, on_warmup)


def _train(
    recipe: Recipe,
    run_dir: RunDir,
    results: Path,
    resume: bool,
    overwrite: bool,
    on_step: Callable[[dict[str, float]], None] | None,
    on_warmup: Callable[[int, int, float, float | None], None] | None,
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
                state = _resume(run)
            elif main:
                replacing = True
                run_dir.create(recipe, environment(run.device))  # an old run (approved --overwrite) is moved aside
            if run.adapters is not None and main:
                log.warning("note: %s", adapter_line(run.model))
            return _run_steps(run, state, resume, on_step)
        except BaseException:
            if replacing:
                run_dir.restore_replaced()  # the new run logged no step: the one it was to replace comes back
            raise


def _resume(run: Run) -> TrainState:
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
        if note:
            log.warning("note: %s", note)
    return state


def _run_steps(
    run: Run, state: TrainState, resume: bool, on_step: Callable[[dict[str, float]], None] | None
) -> dict | None:
    """`_loop`, reported to the recipe's trackers (rank 0): its steps, and the held-out table at the end."""
    recipe = run.recipe
    names = reporter_names(recipe.run) if distributed.is_main() else []
    reporters = Reporters(names, run.run_dir.path, recipe_to_dict(recipe), resumed_at=state.step if resume else None)
    try:
        summary = _loop(run, state, resume, on_step, reporters)
    except BaseException:
        reporters.close(failed=True)
        raise
    if summary is not None:
        reporters.tables(*held_out_table(summary))
    reporters.close()
    return summary


def _loop(
    run: Run, state: TrainState, resume: bool, on_step: Callable[[dict[str, float]], None] | None, reporters: Reporters
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

    def write(record: dict) -> None:
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
    run.sampler.join_peers()  # the other ranks take part in rank 0's engine calls
    started, measured = time.perf_counter(), False
    with _StopRequest() as stop:
        while state.step < recipe.run.steps:
            try:
                record, finite = train_step(run, state)
            except PolicyDiverged as diverged:  # nothing to undo: the last checkpoint stays the resume point
                raise TrainingStopped(divergence_message(run, diverged.step)) from None
            except BadStepLimit:  # an update undone at this step's sampling was the last bad step allowed
                checkpoint()
                raise TrainingStopped(bad_steps_message(run, state)) from None
            state.step += 1
            if is_sharded(run.model) and main and not measured:  # its gradients and moments exist by now
                log.warning("note: %s", memory_line(run.model, run.optimizer, run.sampler.full_copy))
                measured = True
            if not finite:
                count_bad_step(state)
            if state.step % recipe.eval.every == 0 or state.step == recipe.run.steps:
                try:
                    figures, rows = held_out_or_undo(run, state)
                except PolicyDiverged:
                    raise TrainingStopped(divergence_message(run, state.step)) from None
                record.update(figures or {})
                if main and rows:
                    show(state.step, rows)
            record["skipped_steps"] = state.skipped_steps
            if main:
                write(record)
            if state.bad_steps >= recipe.run.max_bad_steps:
                checkpoint()
                raise TrainingStopped(bad_steps_message(run, state))
            stopping = distributed.any_rank(stop.signal is not None, run.device)  # SIGINT/SIGTERM on any rank stops all
            if state.step % recipe.run.checkpoint_every == 0 or state.step == recipe.run.steps:
                checkpoint()
            if stopping and state.step < recipe.run.steps:  # after the last step: just finish
                checkpoint()
                raise KeyboardInterrupt
    final = gathered_weights(run.model) if is_sharded(run.model) else None  # every rank: a collective
    return _finish(run, state, base_eval, time.perf_counter() - started, final) if main else None


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
    # the last step's checkpoint is complete and model/ is in place: its fallback would only double the disk a
    # finished run keeps (design §5); the checkpoint stays, to train the run further
    shutil.rmtree(previous_checkpoint(run.run_dir.checkpoint), ignore_errors=True)
    return summary


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
