"""Policy losses: the PPO clipped surrogate over any trust region, plus its baselines.

Every ratio-clip method here is one surrogate with a per-token interval [l_t, u_t]
(docs/design.md §1):

    L_t = -min(w_t·A, clip(w_t, l_t, u_t)·A),    w_t = exp(logp_t - old_logp_t)

and differs only in where l and u come from: a constant interval from
`atrctl.core.divergence` (grpo, dapo, atr, kl2, reverse-kl3, any divergence) or a per-token
band from `atrctl.core.bands`.  GSPO and CISPO are the comparison baselines.

    from atrctl.core.losses import policy_loss
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, algo="atr", max_kl3=0.1)

Pure functions of tensors; `metrics` is a dict of plain floats with the names of
docs/design.md §3, computed without gradient over the masked tokens only.  A metric's name
declares how the values of several batches combine (`metric_reduction`): `.../min` and `.../max`
are extremes, everything else is a mean.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from atrctl.core.bands import kl_band_bounds, tv_band_bounds
from atrctl.core.divergence import TRUST_REGIONS, kl3_of_log_ratio, region_defaults, trust_region

# |logp - old_logp| is clamped to this before exp, so w stays within [e^-20, e^20] ~ [2e-9, 5e8]
# and cannot overflow float32.  A token beyond it is far outside every trust region; it keeps
# its (clipped) loss value but gets no gradient through w.
LOG_RATIO_LIMIT = 20.0

Bound = float | Tensor


class LossOutput(NamedTuple):
    """What `policy_loss` returns; unpacks as (loss, metrics)."""

    loss: Tensor
    metrics: dict[str, float]


@dataclass(frozen=True)
class Tokens:
    """The per-token inputs a policy loss sees: float32 [B, T], already neutral at padding.

    Padded positions hold logp = old_logp = 0 (so w = 1) and A = 0, whatever the caller
    put there, so neither their values nor their gradients can leak into the loss.
    """

    logp: Tensor
    old_logp: Tensor
    log_ratio: Tensor  # clamp(logp - old_logp, ±LOG_RATIO_LIMIT)
    ratio: Tensor  # exp(log_ratio)
    advantages: Tensor
    mask: Tensor  # bool


# ---------------------------------------------------------------- the surrogate


def clipped_surrogate(ratio: Tensor, advantages: Tensor, low: Bound, high: Bound, dual_clip: float | None = None):
    """Per-token PPO loss -min(w·A, clip(w, l, u)·A) (Schulman et al., 2017) for float or tensor bounds.

    The min lets the clip bind only in the direction A pushes: for A > 0 a token with
    w > u has zero gradient, for A < 0 one with w < l; every other token gets -A·w·∇logp.
    With `dual_clip` c (Ye et al., 2020, dual-clip PPO) the loss of an A < 0 token is
    also capped at c·|A|, so one very unlikely-now token cannot dominate the batch.
    """
    if isinstance(low, Tensor) or isinstance(high, Tensor):
        low, high = (torch.as_tensor(b, dtype=ratio.dtype, device=ratio.device) for b in (low, high))
    loss = torch.maximum(-ratio * advantages, -ratio.clamp(low, high) * advantages)
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    return loss


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
    count = mask.sum().clamp(min=1)
    above, below = ratio > high, ratio < low
    positive, negative = advantages > 0, advantages < 0
    removed = {"low": below & negative & mask, "high": above & positive & mask}
    fractions = {
        "clip/low": removed["low"].sum() / count,
        "clip/high": removed["high"].sum() / count,
        "clip/region": ((above | below) & mask).sum() / count,
    }
    if dual_clip is not None:
        fractions["clip/dual"] = ((ratio > dual_clip) & negative & mask).sum() / count
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


def _ratio_clip(tokens: Tokens, low: Bound, high: Bound, dual_clip: float | None):
    adv = tokens.advantages
    return (
        clipped_surrogate(tokens.ratio, adv, low, high, dual_clip),
        clip_fractions(tokens.ratio, adv, low, high, tokens.mask, dual_clip, old_probability_bin(tokens.old_logp)),
    )


# ----------------------------------------------------------------- the loss contract


LossFunction = Callable[..., tuple[Tensor, dict[str, Tensor]]]
"""loss(tokens, **params) -> (per-token loss [B, T], clip metrics)."""


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss and what the rest of atrctl reads of it, declared once: recipe validation,
    `atrctl ls`, export and the integrations read `parameters`; `atrctl ls` reads `objective`; the update's
    zero-advantage skip reads `needs_every_row`."""

    function: LossFunction
    parameters: tuple[tuple[str, object], ...]  # keyword parameters and their defaults (None: no default)
    objective: str = "surrogate"  # its value: -min(w·A, clip(w)·A), so -A at w = 1; or "weighted-logp" (-w·A·logp)
    needs_every_row: bool = False  # a term without A (say, a penalty on w): rows whose A is 0 still have a gradient

    def __call__(self, tokens: Tokens, **params) -> tuple[Tensor, dict[str, Tensor]]:
        return self.function(tokens, **params)


def define_loss(
    function: LossFunction, *, parameters_from: tuple[Callable, ...] = (), objective: str = "surrogate",
    needs_every_row: bool = False,
) -> PolicyLoss:  # fmt: skip
    """The PolicyLoss of `function`, its parameters read from its keyword parameters (or from those of
    `parameters_from`, for a function that passes them on)."""
    params: dict[str, object] = {}
    for source in parameters_from or (function,):
        for parameter in inspect.signature(source).parameters.values():
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY or (
                parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
                and parameter.default is not inspect.Parameter.empty
            ):
                params[parameter.name] = None if parameter.default is inspect.Parameter.empty else parameter.default
    return PolicyLoss(function, tuple(params.items()), objective, needs_every_row)


POLICY_LOSSES: dict[str, PolicyLoss] = {}
"""name -> PolicyLoss: every loss a recipe, an arm or an integration may name."""


def register_policy_loss(name: str, *, objective: str = "surrogate", needs_every_row: bool = False):
    """Register the decorated loss function under `name`: one function and this line make a new loss."""

    def register(function: LossFunction) -> LossFunction:
        POLICY_LOSSES[name] = define_loss(function, objective=objective, needs_every_row=needs_every_row)
        return function

    return register


# ----------------------------------------------------------------- the losses


@functools.lru_cache(maxsize=64)
def _cached_region(name: str, params: tuple[tuple[str, object], ...]) -> tuple[float, float]:
    return trust_region(name, **dict(params))


def _trust_region_loss(name: str, tokens: Tokens, *, dual_clip: float | None = None, **region):
    """A constant interval from `atrctl.core.divergence`, computed once per (name, params) and cached.

    grpo: [1-ε, 1+ε] (PPO clip as used by GRPO, Shao et al., 2024, DeepSeekMath);
    dapo: [1-ε_low, 1+ε_high] (clip-higher, Yu et al., 2025); atr: {w - 1 - ln w <= max_kl3}
    (the KL3 trust region); kl2, reverse-kl3 and divergence(measure, delta): {D(w) <= δ}.
    """
    low, high = _cached_region(name, tuple(sorted(region.items())))
    return _ratio_clip(tokens, low, high, _check_dual_clip(dual_clip))


@register_policy_loss("tv-band")
def _tv_band(tokens: Tokens, *, delta: float = 0.2, dual_clip: float | None = None):
    """|p_new - p_old| <= δ per token (DPPO, BandPO); δ = 0.2 matches grpo's l = 0.8 at p_old = 1."""
    low, high = tv_band_bounds(tokens.old_logp, delta)
    return _ratio_clip(tokens, low, high, _check_dual_clip(dual_clip))


@register_policy_loss("kl-band")
def _kl_band(tokens: Tokens, *, delta: float = 0.1, dual_clip: float | None = None):
    """KL(Bern(p_old) || Bern(p_new)) <= δ per token (DPPO, BandPO); at small p_old it tends to KL3 <= δ/p_old."""
    low, high = kl_band_bounds(tokens.old_logp, delta)
    return _ratio_clip(tokens, low, high, _check_dual_clip(dual_clip))


@register_policy_loss("gspo")
def _gspo(tokens: Tokens, *, eps_low: float = 3e-4, eps_high: float = 4e-4, dual_clip: float | None = None):
    """GSPO (Zheng et al., 2025): clip the sequence ratio s = exp(mean_t(logp - old_logp)).

    Every token of a sequence carries that sequence's loss, so `seq-mean-token-mean`
    gives GSPO's objective exactly and each token's gradient is -A·s·∇logp_t / |y|.
    The clip metrics count sequences (with A the sequence's mean advantage); the ratio
    and kl3 metrics stay per token.  Defaults are the paper's.
    """
    low, high = _cached_region("dapo", (("eps_high", eps_high), ("eps_low", eps_low)))
    dual_clip = _check_dual_clip(dual_clip)
    lengths = tokens.mask.sum(dim=1)
    per_seq = lengths.clamp(min=1)
    seq_ratio = (tokens.log_ratio.sum(dim=1) / per_seq).exp()
    loss = clipped_surrogate(seq_ratio[:, None], tokens.advantages, low, high, dual_clip)
    seq_advantages = tokens.advantages.sum(dim=1) / per_seq
    return loss, clip_fractions(seq_ratio, seq_advantages, low, high, lengths > 0, dual_clip)


@register_policy_loss("cispo", objective="weighted-logp")  # -sg(w)·A·logp: -A·logp at w = 1, not -A
def _cispo(tokens: Tokens, *, eps_low: float = 1.0, eps_high: float = 0.28):
    """CISPO (MiniMax-M1, 2025): -sg(clip(w, 1-ε_low, 1+ε_high))·A·logp.

    No token loses its gradient; the clip only caps its weight.  The default ε_low = 1
    (l = 0) follows the paper, which set no lower bound.  Its value is a weighted log-likelihood,
    not the surrogate's, so it declares its `objective`.
    """
    eps_low, eps_high = _check_positive(eps_low, "eps_low"), _check_positive(eps_high, "eps_high")
    low, high = max(0.0, 1.0 - eps_low), 1.0 + eps_high
    weight = tokens.ratio.clamp(low, high).detach()
    bins = old_probability_bin(tokens.old_logp)
    return -weight * tokens.advantages * tokens.logp, clip_fractions(
        tokens.ratio, tokens.advantages, low, high, tokens.mask, bins=bins
    )


# Every constant trust region of atrctl.core.divergence is a loss of the same name, with its parameters (and
# dual_clip): a new region needs no line here.  Registered first, so `atrctl ls` lists them first.
POLICY_LOSSES.update(
    {
        name: define_loss(
            functools.partial(_trust_region_loss, name), parameters_from=(TRUST_REGIONS[name], _trust_region_loss)
        )
        for name in TRUST_REGIONS
    }
)
POLICY_LOSSES.update({name: POLICY_LOSSES.pop(name) for name in ("tv-band", "kl-band", "gspo", "cispo")})


def loss_parameters(name: str) -> dict[str, object]:
    """The keyword parameters of the loss `name` and their defaults (None where there is none): what
    `algo.args` may set."""
    return dict(POLICY_LOSSES[name].parameters)


def constant_interval(name: str, params: dict) -> tuple[float, float] | None:
    """The constant ratio interval [l, u] of the loss `name` with `params` (its defaults for the rest) where it
    is one of the trust regions of `atrctl.core.divergence`, else None; a dual clip is not part of the interval."""
    if name not in TRUST_REGIONS:
        return None
    given = {**loss_parameters(name), **params}
    return _cached_region(name, tuple(sorted((k, v) for k, v in given.items() if k in region_defaults(name))))


def flag_parameters(
    name: str, max_kl3: float | None = None, eps: float | None = None, eps_high: float | None = None
) -> dict[str, float]:
    """The CLI's shared flags as parameters of the loss `name`: --max-kl3 is max_kl3 and --eps-high eps_high;
    --eps is the loss's eps, or its eps_low where it has a lower ε and no symmetric one (dapo, gspo, cispo).
    Flags left out (None) are not set."""
    taken = loss_parameters(name)
    eps_name = "eps_low" if "eps_low" in taken and "eps" not in taken else "eps"
    return {
        key: value
        for key, value in (("max_kl3", max_kl3), (eps_name, eps), ("eps_high", eps_high))
        if value is not None
    }


def loss_objective(name: str) -> str:
    """What a loss's value is (`PolicyLoss.objective`); every loss's gradient at w = 1 is -A·∇logp either way."""
    return POLICY_LOSSES[name].objective


def metric_reduction(name: str) -> str:
    """How values of the metric `name` from several micro-batches, ranks or optimiser steps combine: its
    name declares it, so a new loss's extreme needs no edit elsewhere.  "min" for .../min, "max" for
    .../max, else "mean"."""
    return "min" if name.endswith("/min") else "max" if name.endswith("/max") else "mean"


def _strict_float(value: float, name: str) -> float:
    """float(value) for a number; a string or a boolean is refused (`float()` reads "0.05", "０.２" and "1_0")."""
    if isinstance(value, str | bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def _check_positive(value: float, name: str) -> float:
    value = _strict_float(value, name)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def _check_dual_clip(dual_clip: float | None) -> float | None:
    if dual_clip is None:
        return None
    dual_clip = _strict_float(dual_clip, "dual_clip")
    if not (math.isfinite(dual_clip) and dual_clip > 1):
        raise ValueError(f"dual_clip must be a finite number > 1 (or None for off), got {dual_clip}")
    return dual_clip


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


# ------------------------------------------------------------ KL to reference


def _kl_k1(log_ref_ratio: Tensor) -> Tensor:
    """-r: unbiased, signed."""
    return -log_ref_ratio


def _kl_k2(log_ref_ratio: Tensor) -> Tensor:
    """r²/2: biased, low variance."""
    return 0.5 * log_ref_ratio**2


# Estimators of KL(pi_theta || pi_ref) from r = ln(pi_ref / pi_theta) at sampled tokens (Schulman, 2020);
# k3 is the trust regions' kl3 of the ratio pi_ref / pi_theta.
KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _kl_k1, "k2": _kl_k2, "k3": kl3_of_log_ratio}


# ---------------------------------------------------------------- the entry point


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    algo: str = "atr",
    agg: str = "token-mean",
    max_new_tokens: int | None = None,
    ref_logp: Tensor | None = None,
    beta: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    **params,
) -> LossOutput:
    """The policy loss of `algo` aggregated by `agg`, and its diagnostics.

    logp, old_logp, mask: [B, T] (any float dtype; the ratio is computed in float32);
    advantages: [B] or [B, T].  `params` go to the loss (e.g. eps, max_kl3, delta,
    measure, eps_low, eps_high, dual_clip).  With `ref_logp` the KL to the reference is
    reported as `kl/ref` and `beta` times it is added; with `entropy` (per token) it is
    reported as `entropy` and `entropy_coef` times it is subtracted.
    """
    if algo not in POLICY_LOSSES:
        raise ValueError(f"unknown algo {algo!r}; choose one of {', '.join(POLICY_LOSSES)}")
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown agg {agg!r}; choose one of {', '.join(AGGREGATIONS)}")
    _check_params(algo, params)
    beta, entropy_coef = float(beta), float(entropy_coef)
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta must be a finite number >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    if not math.isfinite(entropy_coef):
        raise ValueError(f"entropy_coef must be finite, got {entropy_coef}")
    if entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")

    tokens = _prepare(logp, old_logp, advantages, mask)
    token_loss, clip_metrics = POLICY_LOSSES[algo](tokens, **params)
    extra: dict[str, Tensor] = {}
    if ref_logp is not None:
        kl = KL_ESTIMATORS[kl_estimator](_masked_log_ratio(_aligned(ref_logp, mask, "ref_logp"), tokens))
        token_loss = token_loss + beta * kl
        extra["kl/ref"] = kl
    if entropy is not None:
        entropy = torch.where(tokens.mask, _aligned(entropy, mask, "entropy").float(), 0.0)
        token_loss = token_loss - entropy_coef * entropy
        extra["entropy"] = entropy
    loss = aggregate(token_loss, tokens.mask, agg, max_new_tokens)
    return LossOutput(loss, _metrics(tokens, loss, clip_metrics, extra))


def token_losses(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, algo: str = "atr",
                 **params) -> LossOutput:  # fmt: skip
    """The per-token policy loss of `algo` before aggregation ([B, T] float32, 0 at padding) and the diagnostics
    of `policy_loss` (their `loss` is the token mean): for a trainer that aggregates on its own, such as verl's
    agg_loss with its global token counts."""
    if algo not in POLICY_LOSSES:
        raise ValueError(f"unknown algo {algo!r}; choose one of {', '.join(POLICY_LOSSES)}")
    _check_params(algo, params)
    tokens = _prepare(logp, old_logp, advantages, mask)
    token_loss, clip_metrics = POLICY_LOSSES[algo](tokens, **params)
    token_loss = torch.where(tokens.mask, token_loss, 0.0)
    return LossOutput(token_loss, _metrics(tokens, aggregate(token_loss, tokens.mask), clip_metrics, {}))


def check_loss(
    algo: str, agg: str = "token-mean", *, max_new_tokens: int = 1, beta: float = 0.0, kl_estimator: str = "k3",
    entropy_coef: float = 0.0, **params,
) -> LossOutput:  # fmt: skip
    """The one probe of a loss, before anything trains (recipe validation, the TRL trainer, verl's registration,
    export): one token goes through `policy_loss` with every term the run will use, so every check a loss, its
    aggregation and its penalties make of their values runs (ValueError, or TypeError for a value of the wrong
    kind), and the metrics it returns are the ones a run logs."""
    probe = torch.zeros(1, 1)
    return policy_loss(
        probe, probe, torch.zeros(1), torch.ones(1, 1), algo=algo, agg=agg, max_new_tokens=max_new_tokens,
        ref_logp=probe if beta > 0 else None, beta=beta, kl_estimator=kl_estimator, entropy=probe,
        entropy_coef=entropy_coef, **params,
    )  # fmt: skip


def _check_params(algo: str, params: dict) -> None:
    """Unknown parameter names fail loudly, naming the ones the loss declares (`loss_parameters`)."""
    names = list(loss_parameters(algo))
    for name in params:
        if name not in names:
            raise ValueError(f"algo {algo!r} takes no parameter {name!r}; it takes {', '.join(names)}")


def _aligned(tensor: Tensor, mask: Tensor, name: str) -> Tensor:
    if tensor.shape != mask.shape:
        raise ValueError(f"{name} must have the shape of mask {tuple(mask.shape)}, got {tuple(tensor.shape)}")
    return tensor


def _prepare(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor) -> Tokens:
    if mask.ndim != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    mask = mask.bool()
    logp = torch.where(mask, _aligned(logp, mask, "logp").float(), 0.0)
    old_logp = torch.where(mask, _aligned(old_logp, mask, "old_logp").detach().float(), 0.0)
    if advantages.shape == mask.shape[:1]:
        advantages = advantages[:, None]
    elif advantages.shape != mask.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] for mask {tuple(mask.shape)}, got {tuple(advantages.shape)}"
        )
    advantages = torch.where(mask, advantages.detach().float(), 0.0)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return Tokens(logp, old_logp, log_ratio, log_ratio.exp(), advantages, mask)


def _masked_log_ratio(ref_logp: Tensor, tokens: Tokens) -> Tensor:
    """ln(pi_ref / pi_theta) per token, clamped like the policy ratio, 0 at padding."""
    ref_logp = torch.where(tokens.mask, ref_logp.detach().float(), 0.0)
    return (ref_logp - tokens.logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


@torch.no_grad()
def _metrics(tokens: Tokens, loss: Tensor, clip_metrics: dict[str, Tensor], extra: dict[str, Tensor]):
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
