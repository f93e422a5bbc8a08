"""The update's rows cut into micro-batches (the fewest padded tokens under the memory budget), and kept in
step across the ranks of a sharded model, whose every pass is a collective."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atrctl.config.schema import AlgoConfig
from atrctl.model.batch import Rollout
from atrctl.model.loading import is_checkpointing
from atrctl.model.memory import sized_micro_batch, update_budget
from atrctl.runtime import distributed
from atrctl.training.batching import micro_batches, rows, trimmed

PASS_TOKENS = {"cpu": 512}
"""A forward/backward pass's fixed cost in tokens' worth of its work, by device type, for the cut of the update's rows
(`batching.least_padding_cut`); other devices take the fewest pieces the memory budget allows. Measured:
docs/performance-log.md#pass_tokens."""
FEWEST_PASSES = 1e9


def cut_micro_batches(model: torch.nn.Module, rollout: Rollout, trained: torch.Tensor, algo: AlgoConfig):
    """`trained` (row indices) in micro-batches, longest completions first (`batching.micro_batches`):
    `algo.micro_batch` rows each, or for 0 the cut that computes the fewest tokens with no micro-batch over
    the activation budget at its longest row (`models.sized_micro_batch`)."""
    lengths = rollout.completion_mask.sum(1)
    if algo.micro_batch or not len(trained):
        return micro_batches(trained, algo.micro_batch, lengths)
    prompt_width = trimmed(rows(rollout, trained)).prompt_ids.shape[1]
    checkpointing = is_checkpointing(model)  # asked once: it walks the modules
    device = next(model.parameters()).device
    budget = update_budget(device)

    def budgeted(length: int) -> int:
        return sized_micro_batch(model, prompt_width + length, checkpointing, budget)

    pass_tokens = PASS_TOKENS.get(device.type, FEWEST_PASSES)
    return micro_batches(trained, 0, lengths, budgeted, pass_tokens)


def lockstep(pieces: list[list[torch.Tensor]], minibatches: list[slice], device: torch.device):
    """Each mini-batch's micro-batches padded to the most any rank has, with passes (`Idle`) that name one
    row of the mini-batch: a sharded model runs a pass on it that contributes nothing (FSDP's collectives
    need every rank in every pass)."""
    counts = distributed.all_max(torch.tensor([len(micro) for micro in pieces], device=device)).tolist()
    return [
        micro + [idle_rows(part)] * (count - len(micro))
        for micro, part, count in zip(pieces, minibatches, counts, strict=True)
    ]


@dataclass(frozen=True)
class Idle:
    """A pass that only keeps a sharded model's ranks in step (`lockstep`), on these rows."""

    rows: torch.Tensor


def idle_rows(part: slice) -> Idle:
    return Idle(torch.tensor([part.start]))


def pass_rows(where: torch.Tensor | Idle) -> torch.Tensor:
    return where.rows if isinstance(where, Idle) else where
