"""The token batch every model pass reads: prompts and completions with their masks, in one layout.

Layout every rollout backend keeps (the training forward pass, `atrctl.model.forward`, relies on it):
- Prompts are left-padded; position ids count real tokens only (cumsum of the mask - 1), so a padded
  row gives the same logits as the prompt alone.
- Rows are prompt-major: the `repeats` completions of a prompt are consecutive rows (a GRPO group).
- A completion includes its EOS (masked in); everything after it is `pad_id` and masked out.
- `logprobs` are log_softmax(logits.float() / temperature) at the sampled token (temperature 1 when
  greedy), 0 where masked; top_p truncation is not part of them, as in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atrctl.errors import UserError


@dataclass
class Rollout:
    """A batch of prompts with one sampled completion each (layout above); all tensors on the model's device."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long, 1 for real prompt tokens
    completion_ids: torch.Tensor  # [B, T] long, pad_id after EOS
    completion_mask: torch.Tensor  # [B, T] long, 1 up to and including EOS
    logprobs: torch.Tensor  # [B, T] float32, 0 where completion_mask is 0


def left_pad(
    sequences: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape [B, longest], real tokens flush right."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise UserError("every prompt needs at least one token: check the task's prompts and tokenizer")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding, so left padding does not shift the rotary phases."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def equal_runs(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each run's first row, run lengths) of consecutive equal rows: a GRPO group's shared prompt."""
    starts = torch.ones(len(rows), dtype=torch.bool, device=rows.device)
    starts[1:] = (rows[1:] != rows[:-1]).any(dim=1)  # row-wise unique_consecutive: one equality call per row
    first = starts.nonzero().squeeze(1)
    counts = torch.diff(first, append=first.new_tensor([len(rows)]))
    return first, counts
