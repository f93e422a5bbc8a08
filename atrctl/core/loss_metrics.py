"""The diagnostics every policy loss reports beside its value: how much of the batch each side of the clip
removed (also by the sampling probability p_old), kl3, the ratio's extremes, and how far log-probabilities moved
per (sign of A, p_old) cell.  A metric's name declares how batches combine (`metric_reduction`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from atrctl.core.divergence import kl3_of_log_ratio
from atrctl.core.tokens import Bound, Tokens

OLD_PROBABILITY_EDGES = (0.1, 0.5, 0.9)
"""Where the bins of the mechanism metrics split the sampling policy's probability of a token, p_old."""
OLD_PROBABILITY_BINS = ("p00-10", "p10-50", "p50-90", "p90-100")
"""Metric-name suffixes of those bins: p_old < 0.1, [0.1, 0.5), [0.5, 0.9), >= 0.9."""


def old_probability_bin(old_logp: Tensor) -> Tensor:
    """Index into OLD_PROBABILITY_BINS of each token's p_old = exp(old_logp): [B, T] int64."""
    edges = torch.tensor(OLD_PROBABILITY_EDGES, dtype=old_logp.dtype, device=old_logp.device)
    return torch.bucketize(old_logp.exp(), edges, right=True)


def clip_fractions(
    ratio: Tensor,
    advantages: Tensor,
    low: Bound,
    high: Bound,
    mask: Tensor,
    dual_clip: float | None = None,
    bins: Tensor | None = None,
) -> dict[str, Tensor]:
    """Fractions of masked entries whose gradient the clip removes (high: w > u, A > 0; low: w < l, A < 0)
    or that lie outside [l, u] at all (region), and with dual-clip the A < 0 entries capped (w > c).

    With `bins` (each entry's `old_probability_bin`) clip/low and clip/high are also split by p_old
    (`clip/low/<bin>`, `clip/high/<bin>`): the share of all masked entries that the clip removed and that lie
    in the bin, so each split sums to its total.  Where the mass is clipped is what distinguishes the
    regions: KL3's lower bound is tighter than its upper one, and a band's width follows p_old itself."""
    above, below = ratio > high, ratio < low
    negative = advantages < 0
    fractions = removed_fractions(below & negative, above & (advantages > 0), mask, bins, outside=above | below)
    if dual_clip is not None:
        fractions["clip/dual"] = token_share((ratio > dual_clip) & negative, mask)
    return fractions


def token_share(where: Tensor, mask: Tensor) -> Tensor:
    """The share of the masked tokens where `where` holds."""
    return (where & mask).sum() / mask.sum().clamp(min=1)


def removed_fractions(
    low: Tensor, high: Tensor, mask: Tensor, bins: Tensor | None = None, outside: Tensor | None = None
) -> dict[str, Tensor]:
    """clip/low and clip/high from where a loss removed (or cut) the gradient: `low` the tokens it stops from
    falling further, `high` those it stops from rising; clip/region the tokens `outside` its region (by default
    the removed ones).  With `bins` both are also split by p_old, as `clip_fractions` does."""
    count = mask.sum().clamp(min=1)
    removed = {"low": low & mask, "high": high & mask}
    outside = (low | high) if outside is None else outside
    fractions = {
        "clip/low": removed["low"].sum() / count,
        "clip/high": removed["high"].sum() / count,
        "clip/region": (outside & mask).sum() / count,
    }
    if bins is not None:
        for side, where in removed.items():
            per_bin = cell_sums(bins, where, len(OLD_PROBABILITY_BINS), where.float())[0] / count
            fractions.update({f"clip/{side}/{name}": per_bin[i] for i, name in enumerate(OLD_PROBABILITY_BINS)})
    return fractions


def cell_sums(cells: Tensor, where: Tensor, n_cells: int, *values: Tensor) -> list[Tensor]:
    """Each of `values` summed per cell index in [0, n_cells) over the entries `where` holds: [n_cells] each.
    One matrix product of the values against a one-hot of the cells, instead of a mask and a sum per cell (the
    diagnostics' 16 cells were about a third of the loss's time on a tiny micro-batch).  No host sync (unlike
    indexing by a boolean mask) and no atomics (unlike a scatter on a GPU), so the sums are reproducible."""
    one_hot = (cells.flatten()[:, None] == torch.arange(n_cells, device=cells.device)) & where.flatten()[:, None]
    stacked = torch.stack([value.flatten().float() for value in values])  # [len(values), entries]
    return list(stacked @ one_hot.float())


def metric_reduction(name: str) -> str:
    """How values of the metric `name` from several micro-batches, ranks or optimiser steps combine: its
    name declares it, so a new loss's extreme needs no edit elsewhere.  "min" for .../min, "max" for
    .../max, else "mean"."""
    return "min" if name.endswith("/min") else "max" if name.endswith("/max") else "mean"


@torch.no_grad()
def diagnostics(tokens: Tokens, loss: Tensor, clip_metrics: dict[str, Tensor], extra: dict[str, Tensor]):
    """All diagnostics as floats, fetched from the device in one transfer.

    Padding holds log_ratio = 0 (kl3 = 0, no KL, no entropy), so sums over all entries
    are sums over masked tokens.  An empty mask reports w = 1 (no movement) and zeros.
    """
    mask, log_ratio, ratio = tokens.mask, tokens.log_ratio, tokens.ratio
    count = mask.sum().clamp(min=1)
    kl3 = kl3_of_log_ratio(log_ratio)
    any_token = mask.any()
    values = {
        "loss": loss.detach(),
        **clip_metrics,
        "kl3/mean": kl3.sum() / count,
        "kl3/max": kl3.amax(),
        "ratio/min": torch.where(any_token, torch.where(mask, ratio, math.inf).amin(), 1.0),
        "ratio/max": torch.where(any_token, torch.where(mask, ratio, 0.0).amax(), 1.0),
        **{name: value.sum() / count for name, value in extra.items()},
    }
    values.update(_movement_by_bin(tokens, count))
    floats = torch.stack([value.float() for value in values.values()]).tolist()
    return dict(zip(values, floats, strict=True))


def _movement_by_bin(tokens: Tokens, count: Tensor) -> dict[str, Tensor]:
    """Per (sign of A, p_old bin) cell: `tokens/<sign>/<bin>`, the cell's share of the masked tokens, and
    `dlogp/<sign>/<bin>`, the sum of ln w = logp - old_logp over the cell divided by all masked tokens.
    Both are token-weighted means, so they combine over micro-batches like every other metric;
    `finish_metrics` then divides the second by the first: the cell's mean change of log-probability."""
    n_bins, cells = len(OLD_PROBABILITY_BINS), {}
    positive, negative = tokens.advantages > 0, tokens.advantages < 0
    cell = negative.long() * n_bins + old_probability_bin(tokens.old_logp)  # A > 0: its bin; A < 0: n_bins + bin
    where = tokens.mask & (positive | negative)  # A = 0 (or NaN) is in no cell
    shares, moves = (total / count for total in cell_sums(cell, where, 2 * n_bins, where.float(), tokens.log_ratio))
    for offset, sign in ((0, "pos"), (n_bins, "neg")):
        for index, name in enumerate(OLD_PROBABILITY_BINS):
            cells[f"tokens/{sign}/{name}"] = shares[offset + index]
            cells[f"dlogp/{sign}/{name}"] = moves[offset + index]
    return cells


def finish_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A step's combined metrics with each `dlogp/<cell>` turned into the cell's mean change of log-probability
    (its share-weighted sum over its `tokens/<cell>` share); a cell with no tokens reports no dlogp."""
    finished = {}
    for key, value in metrics.items():
        if key.startswith("dlogp/"):
            share = metrics.get("tokens/" + key.removeprefix("dlogp/"), 0.0)
            if share > 0:
                finished[key] = value / share
        else:
            finished[key] = value
    return finished
