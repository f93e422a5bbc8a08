"""Bad steps: a non-finite loss or gradient, or an update whose policy can no longer be sampled.

A bad update is undone from the snapshot taken before it (`run.rollback`) and counted; `run.max_bad_steps`
in a row stop the run on its last good weights, and a policy that diverged with nothing to undo stops it too.
"""

from __future__ import annotations

from atrctl.rollout.backend import NonFiniteProbabilities
from atrctl.runtime import distributed
from atrctl.training.checkpoint import TrainState, find_checkpoint, read_state
from atrctl.training.held_out import held_out_metrics
from atrctl.training.setup import Run


class TrainingStopped(Exception):
    """Too many consecutive non-finite steps, or a diverged policy: the run stops with a valid checkpoint."""


class PolicyDiverged(Exception):
    """The policy's sampling probabilities became non-finite at RL step `step` (1-based)."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


class BadStepLimit(Exception):
    """`run.max_bad_steps` consecutive bad steps: the run stops on its last good weights."""


def count_bad_step(state: TrainState) -> None:
    state.bad_steps += 1
    state.skipped_steps += 1


def undo_last_update(run: Run, state: TrainState, step: int) -> None:
    """The policy the last update left samples non-finite probabilities (found at RL step `step`, 1-based):
    the weights and optimiser state from before that update come back and it counts as a bad step.
    With nothing to go back to (rollback off, or the weights were never updated since they last sampled
    soundly, e.g. just after a resume) the policy has diverged: PolicyDiverged."""
    if run.snapshot is None or not run.snapshot.held or not state.unverified_update:
        raise PolicyDiverged(step)
    run.snapshot.restore()
    run.sampler.load_weights(run.model)
    state.unverified_update = False
    count_bad_step(state)


def verified(state: TrainState) -> None:
    """The policy sampled soundly after the last update: that update is good, the bad-step streak ends."""
    if state.unverified_update:
        state.unverified_update, state.bad_steps = False, 0


def held_out_or_undo(run: Run, state: TrainState) -> tuple[dict[str, float] | None, list[dict]]:
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
        run.sampler.join_peers()  # the other ranks take part in rank 0's engine calls
        if not distributed.any_rank(failed, run.device):
            verified(state)
            return figures, shown
        undo_last_update(run, state, state.step)
        if state.bad_steps >= run.recipe.run.max_bad_steps:
            return None, []


def divergence_message(run: Run, step: int) -> str:
    return (f"the policy diverged: sampling at step {step} met non-finite probabilities (optim.lr = "
            f"{run.recipe.optim.lr:g}) and there is no update to undo; {_saved_weights(run)}; "
            "train again with a lower optim.lr")  # fmt: skip


def bad_steps_message(run: Run, state: TrainState) -> str:
    return (f"{state.bad_steps} consecutive steps were bad (a non-finite loss or gradient, or an update after "
            f"which sampling met non-finite probabilities) at step {state.step}; {_saved_weights(run)}; "
            f"train again with a lower optim.lr (now {run.recipe.optim.lr:g})")  # fmt: skip


def _saved_weights(run: Run) -> str:
    last = find_checkpoint(run.run_dir.checkpoint)
    if last is None:
        return "no checkpoint was saved yet"
    return f"the checkpoint in {last} (step {read_state(last).step}) holds the last good weights"
