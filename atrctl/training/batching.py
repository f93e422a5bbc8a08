"""How one step's batch is cut: prompts across ranks, sampling chunks, mini- and micro-batches.

Pure functions of sizes, positions (a position is a prompt's index within the step) and lengths, so a
data-parallel run and a single-process run can be checked to cut the same batch the same way.

- Global mini-batch j is the contiguous positions [j·P/M, (j+1)·P/M) at every world size; rank r
  holds the r-th of W equal slices of each, so the union over ranks of local mini-batch j is
  global mini-batch j and an optimiser step sees the same completions whatever W is.
- A prompt's completions come from a sampling chunk: at most `sample_batch` completions of whole
  groups, aligned to multiples of `sample_batch // G` positions, never crossing a rank's run.  The
  chunk's generator is seeded by (run seed, step, first position), so the sampled tokens are a pure
  function of the chunk: identical at every world size where each rank's run per mini-batch,
  P/(M·W), is a multiple of the chunk size (no generator state to checkpoint either).
- A micro-batch is a set of rows of one mini-batch, cut longest completion first (`micro_batches`): its
  forward pass runs to its longest row, and the loss weights make any cut give the same gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from atrctl.core.seeds import derive_seed
from atrctl.model.batch import Rollout


def rank_positions(prompts: int, minibatches: int, world: int, rank: int) -> list[int]:
    """The step positions rank `rank` samples and trains on: its slice of every global mini-batch."""
    per_minibatch, per_rank = prompts // minibatches, prompts // (minibatches * world)
    return [j * per_minibatch + rank * per_rank + i for j in range(minibatches) for i in range(per_rank)]


def sampling_chunks(positions: list[int], group_size: int, sample_batch: int) -> list[list[int]]:
    """Consecutive runs of `positions`, cut at multiples of the chunk size (0 = one chunk per run)."""
    width = max(1, sample_batch // group_size) if sample_batch else None
    chunks: list[list[int]] = []
    for position in positions:
        fresh = not chunks or position != chunks[-1][-1] + 1 or (width and position % width == 0)
        if fresh:
            chunks.append([position])
        else:
            chunks[-1].append(position)
    return chunks


def rollout_seed(seed: int, step: int, position: int) -> int:
    """Seed of the generator that samples the chunk starting at `position` of step `step`."""
    return derive_seed(seed, step, position)


def parts(rows: int, count: int) -> list[slice]:
    """`count` equal consecutive row slices (mini-batches of whole groups)."""
    size = rows // count
    return [slice(i * size, (i + 1) * size) for i in range(count)]


def micro_batches(
    indices: torch.Tensor,
    micro_batch: int,
    lengths: torch.Tensor | None = None,
    rows_at: Callable[[int], int] | None = None,
    pass_tokens: float = 0.0,
) -> list[torch.Tensor]:
    """Row indices (e.g. the rows of a mini-batch the update trains on) in pieces of at most `micro_batch`
    (0 = one piece); none for no rows.

    With `lengths` (each row's completion length, indexed by row) the rows are taken longest first: a
    piece is computed up to its longest row, so rows of similar length padded together waste less (SmolLM2's
    replies run from 5 to 256 tokens).  `rows_at(length)` instead caps each piece at what the memory budget
    holds at its longest row, and the cut is the one that computes the fewest tokens (`least_padding_cut`,
    `pass_tokens` being a pass's fixed cost).  Each piece keeps its rows in their order, so a group's rows stay
    adjacent and share their prompt's pass (`forward._completion_outputs`).
    """
    if len(indices) == 0:
        return []
    if lengths is None:
        return list(indices.split(micro_batch or len(indices)))
    order = indices[torch.argsort(lengths[indices], descending=True, stable=True)]
    if rows_at is None:
        pieces = order.split(micro_batch or len(order))
    else:
        pieces = order.split(least_padding_cut(lengths[order].tolist(), rows_at, pass_tokens))
    return [piece.sort().values for piece in pieces]


def least_padding_cut(longest_first: list[int], rows_at: Callable[[int], int], pass_tokens: float) -> list[int]:
    """Sizes of the consecutive pieces of `longest_first` (lengths, descending) whose passes compute the
    fewest tokens: a piece costs its rows × its first row's length, plus `pass_tokens` (the fixed cost of
    a pass, in tokens' worth of its work), and holds at most rows_at(that length) rows.

    Exact, by dynamic programming over where each piece starts, each start's piece sizes at once (numpy).
    Where no cap binds, only the first row of each run of equal lengths needs to be tried as a start:
    moving a piece's start back to its run's first row moves rows of that length out of a piece at least as
    wide, which never costs more.  A huge `pass_tokens` gives the fewest pieces the caps allow, padded as
    little as that count can be.
    """
    rows = len(longest_first)
    caps = {width: max(1, rows_at(width)) for width in set(longest_first)}
    starts = range(rows)
    if min(caps.values(), default=rows) >= rows:
        starts = [i for i in range(rows) if i == 0 or longest_first[i] != longest_first[i - 1]]
    best = np.full(rows + 1, np.inf)  # best[j]: the cheapest cut of the first j rows
    best[0] = 0.0
    start = np.zeros(rows + 1, dtype=np.int64)  # where the last piece of that cut starts
    for first in starts:
        width = longest_first[first]
        sizes = np.arange(1, min(caps[width], rows - first) + 1)
        cost = best[first] + pass_tokens + sizes * float(width)
        ends = first + sizes
        better = cost < best[ends]
        best[ends[better]], start[ends[better]] = cost[better], first
    cut, end = [], rows
    while end:
        cut.append(int(end - start[end]))
        end = int(start[end])
    return cut[::-1]


def rows(rollout: Rollout, where: slice | torch.Tensor) -> Rollout:
    return Rollout(*(getattr(rollout, f)[where] for f in Rollout.__dataclass_fields__))


def trimmed(rollout: Rollout) -> Rollout:
    """The same rows without the columns that are padding in every row: the prompt's leading ones and the
    completion's trailing ones.  A subset of rows (a micro-batch, the rows left after skipping) is often
    shorter than the batch it came from; the trimmed columns change no logit of the others (causal
    attention, positions that skip padding), they only cost time."""
    used_prompt = rollout.prompt_mask.any(0).nonzero()
    first = int(used_prompt[0]) if len(used_prompt) else 0
    used_completion = rollout.completion_mask.any(0).nonzero()
    width = int(used_completion[-1]) + 1 if len(used_completion) else 1
    return Rollout(
        rollout.prompt_ids[:, first:],
        rollout.prompt_mask[:, first:],
        rollout.completion_ids[:, :width],
        rollout.completion_mask[:, :width],
        rollout.logprobs[:, :width],
    )


def concat_rollouts(pieces: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts sampled separately: prompts left-padded, completions right-padded to a common width."""
    if len(pieces) == 1:
        return pieces[0]
    prompt = max(p.prompt_ids.shape[1] for p in pieces)
    completion = max(p.completion_ids.shape[1] for p in pieces)

    def pad(tensor: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
        extra = width - tensor.shape[1]
        return torch.nn.functional.pad(tensor, (extra, 0) if left else (0, extra), value=value)

    return Rollout(
        torch.cat([pad(p.prompt_ids, prompt, pad_id, True) for p in pieces]),
        torch.cat([pad(p.prompt_mask, prompt, 0, True) for p in pieces]),
        torch.cat([pad(p.completion_ids, completion, pad_id, False) for p in pieces]),
        torch.cat([pad(p.completion_mask, completion, 0, False) for p in pieces]),
        torch.cat([pad(p.logprobs, completion, 0.0, False) for p in pieces]),
    )
