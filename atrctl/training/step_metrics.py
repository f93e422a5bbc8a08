"""A step's metrics: where its time went (`Stopwatch`), and its optimiser steps' metrics reduced over
micro-batches, ranks and steps by the reduction each metric's name declares (`loss_metrics.metric_reduction`)."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager

import torch

from atrctl.core.loss_metrics import metric_reduction
from atrctl.runtime import distributed

STEP_PHASES = ("rollout", "reward", "logprobs", "update")
"""Where a step's time goes: sampling, decoding + verifying, old/reference logprobs, optimiser steps."""


class Stopwatch:
    """Seconds spent per named phase; `with clock("update"): ...` adds to `clock.seconds["update"]`.

    On CUDA each phase waits for its queued kernels, or their time would be charged to the next one.
    """

    def __init__(self, device: torch.device | None = None):
        self.seconds: dict[str, float] = {}
        self.cuda = device is not None and device.type == "cuda"

    @contextmanager
    def __call__(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


def combine_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """Merge the metrics of several optimiser steps, each by the reduction its name declares (min, max or mean),
    over the steps that measured it (one that trained no row measured no loss diagnostics)."""
    reducers = {"min": min, "max": max, "mean": lambda values: sum(values) / len(values)}
    keys = dict.fromkeys(key for step in steps for key in step)
    return {key: reducers[metric_reduction(key)]([step[key] for step in steps if key in step]) for key in keys}


def reduce_step_metrics(
    micro: list[tuple[dict[str, float], float, float]], keys: list[str], device: torch.device
) -> dict[str, float]:
    """One optimiser step's metrics `keys` from (metrics, tokens, loss weight) of its micro-batches on every
    rank (a rank may have none): `loss` is the weighted sum (the mini-batch loss), .../min and .../max are
    extremes, the rest token-weighted means.  Only `loss` when no rank trained a token (every row skipped):
    the mini-batch's loss is then 0, and the rest was not measured."""
    lows = [k for k in keys if metric_reduction(k) == "min"]
    highs = [k for k in keys if metric_reduction(k) == "max"]
    means = [k for k in keys if metric_reduction(k) == "mean"]

    def gathered(values: list[float], reduce) -> list[float]:
        return reduce(torch.tensor(values, dtype=torch.float64, device=device)).tolist()

    sums = gathered(
        [sum(m[k] * (weight if k == "loss" else tokens) for m, tokens, weight in micro) for k in means]
        + [sum(tokens for _, tokens, _ in micro)],
        distributed.all_sum,
    )
    out = {k: total if k == "loss" else total / max(sums[-1], 1.0) for k, total in zip(means, sums, strict=False)}
    out.update(zip(lows, gathered([min((m[k] for m, _, _ in micro), default=math.inf) for k in lows],
                                  distributed.all_min), strict=True))  # fmt: skip
    out.update(zip(highs, gathered([max((m[k] for m, _, _ in micro), default=-math.inf) for k in highs],
                                   distributed.all_max), strict=True))  # fmt: skip
    if sums[-1] == 0:
        return {"loss": out["loss"]}
    return {k: out[k] for k in keys}
