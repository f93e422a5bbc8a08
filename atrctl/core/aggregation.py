"""Reducing per-token losses [B, T] to a batch loss (token-mean, seq-mean-token-mean, Dr. GRPO's constant
normaliser), and what each divides by, so that micro-batches can be weighted to the exact mini-batch loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

# ---------------------------------------------------------------- aggregation


def _token_mean(values: Tensor, mask: Tensor, max_new_tokens: int | None) -> Tensor:
    """sum / number of tokens (DAPO): every token weighs the same."""
    return values.sum() / mask.sum().clamp(min=1)


def _seq_mean_token_mean(values: Tensor, mask: Tensor, max_new_tokens: int | None) -> Tensor:
    """Mean over sequences of each sequence's token mean (GRPO)."""
    lengths = mask.sum(dim=1)
    return (values.sum(dim=1) / lengths.clamp(min=1)).sum() / _sequences(mask).clamp(min=1)


def _seq_mean_token_sum_norm(values: Tensor, mask: Tensor, max_new_tokens: int | None) -> Tensor:
    """sum / (sequences × max_new_tokens) (Dr. GRPO): a constant normaliser, so no length bias."""
    if max_new_tokens is None or int(max_new_tokens) < 1:
        raise ValueError(f"agg 'seq-mean-token-sum-norm' needs max_new_tokens >= 1, got {max_new_tokens}")
    return values.sum() / (_sequences(mask).clamp(min=1) * int(max_new_tokens))


def _tokens(mask: Tensor) -> Tensor:
    return mask.sum()


def _sequences(mask: Tensor) -> Tensor:
    """Rows with at least one token: an empty row is not a sequence."""
    return (mask.sum(dim=1) > 0).sum()


class Aggregation(NamedTuple):
    """A reduction of per-token values [B, T] (masked, padding already 0) to the batch loss, and what it
    divides by up to constants (its tokens or its sequences), so micro-batches can be weighted exactly."""

    reduce: Callable[[Tensor, Tensor, int | None], Tensor]
    normaliser: Callable[[Tensor], Tensor]


AGGREGATIONS: dict[str, Aggregation] = {
    "token-mean": Aggregation(_token_mean, _tokens),
    "seq-mean-token-mean": Aggregation(_seq_mean_token_mean, _sequences),
    "seq-mean-token-sum-norm": Aggregation(_seq_mean_token_sum_norm, _sequences),
}


def aggregate(values: Tensor, mask: Tensor, agg: str = "token-mean", max_new_tokens: int | None = None) -> Tensor:
    """Reduce per-token values [B, T] to a scalar over the masked tokens with the aggregation `agg`.

    Rows without tokens are not sequences: they change nothing, and an empty batch gives 0
    (with a valid gradient).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; choose one of {', '.join(AGGREGATIONS)}")
    mask = mask.bool()
    return AGGREGATIONS[agg].reduce(torch.where(mask, values, 0.0), mask, max_new_tokens)


def aggregation_normaliser(mask: Tensor, agg: str) -> Tensor:
    """What `aggregate` divides a batch's loss by, up to constants.  A micro-batch's loss times its own
    normaliser over the whole mini-batch's is its exact share of the mini-batch loss."""
    return AGGREGATIONS[agg].normaliser(mask.bool())
