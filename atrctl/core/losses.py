"""Policy losses: the PPO clipped surrogate over any trust region, plus its baselines.

Every ratio-clip method here is one surrogate with a per-token interval [l_t, u_t]
(docs/design.md §1):

    L_t = -min(w_t·A, clip(w_t, l_t, u_t)·A),    w_t = exp(logp_t - old_logp_t)

and differs only in where l and u come from: a constant interval from
`atrctl.core.divergence` (grpo, dapo, atr, kl2, reverse-kl3, any divergence) or a per-token
band from `atrctl.core.bands`.  GSPO and CISPO are the comparison baselines; the rest of the peers' family
(soft gates, masks, geometric means, covariance selections) is in `atrctl.core.loss_family`.

    from atrctl.core.losses import policy_loss
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, algo="atr", max_kl3=0.1)

Pure functions of tensors.  Each loss is registered with its typed contract (`register_policy_loss`);
the inputs are prepared by `atrctl.core.tokens`, reduced by `atrctl.core.aggregation`, and reported
by `atrctl.core.loss_metrics` (plain floats with the names of docs/design.md §3).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from atrctl.core.aggregation import AGGREGATIONS, aggregate
from atrctl.core.bands import kl_band_bounds, tv_band_bounds
from atrctl.core.divergence import TRUST_REGIONS, kl3_of_log_ratio, region_defaults, trust_region
from atrctl.core.family_intervals import family_interval
from atrctl.core.loss_family import FAMILY  # registers the rest of the peers' family
from atrctl.core.loss_metrics import clip_fractions, diagnostics, old_probability_bin, removed_fractions
from atrctl.core.loss_registry import POLICY_LOSSES, check_dual_clip, check_positive, define_loss, register_policy_loss
from atrctl.core.surrogate import clipped_surrogate
from atrctl.core.tokens import Bound, Tokens, aligned, masked_log_ratio, prepare_tokens


class LossOutput(NamedTuple):
    """What `policy_loss` returns; unpacks as (loss, metrics)."""

    loss: Tensor
    metrics: dict[str, float]


# ---------------------------------------------------------------- the surrogate


def _ratio_clip(tokens: Tokens, low: Bound, high: Bound, dual_clip: float | None):
    adv = tokens.advantages
    return (
        clipped_surrogate(tokens.ratio, adv, low, high, dual_clip),
        clip_fractions(tokens.ratio, adv, low, high, tokens.mask, dual_clip, old_probability_bin(tokens.old_logp)),
    )


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
    return _ratio_clip(tokens, low, high, check_dual_clip(dual_clip))


@register_policy_loss("tv-band")
def _tv_band(tokens: Tokens, *, delta: float = 0.2, dual_clip: float | None = None):
    """|p_new - p_old| <= δ per token (DPPO, BandPO); δ = 0.2 matches grpo's l = 0.8 at p_old = 1."""
    low, high = tv_band_bounds(tokens.old_logp, delta)
    return _ratio_clip(tokens, low, high, check_dual_clip(dual_clip))


@register_policy_loss("kl-band")
def _kl_band(tokens: Tokens, *, delta: float = 0.1, dual_clip: float | None = None):
    """KL(Bern(p_old) || Bern(p_new)) <= δ per token (DPPO, BandPO); at small p_old it tends to KL3 <= δ/p_old."""
    low, high = kl_band_bounds(tokens.old_logp, delta)
    return _ratio_clip(tokens, low, high, check_dual_clip(dual_clip))


@register_policy_loss("gspo")
def _gspo(tokens: Tokens, *, eps_low: float = 3e-4, eps_high: float = 4e-4, dual_clip: float | None = None):
    """GSPO (Zheng et al., 2025): clip the sequence ratio s = exp(mean_t(logp - old_logp)).

    Every token of a sequence carries that sequence's loss, so `seq-mean-token-mean`
    gives GSPO's objective exactly and each token's gradient is -A·s·∇logp_t / |y|.
    The clip metrics count sequences (with A the sequence's mean advantage); the ratio
    and kl3 metrics stay per token.  Defaults are the paper's.
    """
    low, high = _cached_region("dapo", (("eps_high", eps_high), ("eps_low", eps_low)))
    dual_clip = check_dual_clip(dual_clip)
    lengths = tokens.mask.sum(dim=1)
    per_seq = lengths.clamp(min=1)
    seq_ratio = (tokens.log_ratio.sum(dim=1) / per_seq).exp()
    loss = clipped_surrogate(seq_ratio[:, None], tokens.advantages, low, high, dual_clip)
    seq_advantages = tokens.advantages.sum(dim=1) / per_seq
    return loss, clip_fractions(seq_ratio, seq_advantages, low, high, lengths > 0, dual_clip)


@register_policy_loss("cispo", objective="weighted-logp")  # -sg(w)·A·logp: -A·logp at w = 1, not -A
def _cispo(tokens: Tokens, *, eps_low: float = 1.0, eps_high: float = 0.28):
    """CISPO (MiniMax-M1, 2025): -sg(clip(w, 1-ε_low, 1+ε_high))·A·logp.

    No token loses its gradient; the clip only caps its weight, so it counts as clipped where the cap left less
    than half of w (w > 2u; clip/high for A > 0, clip/low for A < 0).  The default ε_low = 1 (l = 0) follows
    the paper, which set no lower bound.  Its value is a weighted log-likelihood,
    not the surrogate's, so it declares its `objective`.
    """
    eps_low, eps_high = check_positive(eps_low, "eps_low"), check_positive(eps_high, "eps_high")
    low, high = max(0.0, 1.0 - eps_low), 1.0 + eps_high
    weight = tokens.ratio.clamp(low, high).detach()
    adv, ratio = tokens.advantages, tokens.ratio
    cut = ratio > 2 * high  # the cap left less than half of the weight w (below l the weight only grows)
    outside = (ratio < low) | (ratio > high)
    fractions = removed_fractions(cut & (adv < 0), cut & (adv > 0), tokens.mask, old_probability_bin(tokens.old_logp),
                                  outside)  # fmt: skip
    return -weight * adv * tokens.logp, fractions


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
POLICY_LOSSES.update({name: POLICY_LOSSES.pop(name) for name in ("tv-band", "kl-band", "gspo", "cispo", *FAMILY)})


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


def ratio_interval(name: str, params: dict) -> tuple[float, float] | None:
    """The constant interval [l, u] on the token ratio that the loss `name` bounds with `params` (its defaults for
    the rest), whatever it does outside it: a trust region's, or one of `family_intervals.FAMILY_INTERVALS`; None
    for a per-token band, a sequence-level clip or a loss without a region.  For plots and tables;
    `constant_interval` is the narrower set that is exactly one PPO clip range."""
    return constant_interval(name, params) or family_interval(name, {**loss_parameters(name), **params})


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
    token_weights: Tensor | None = None,
    **params,
) -> LossOutput:
    """The policy loss of `algo` aggregated by `agg`, and its diagnostics.

    logp, old_logp, mask: [B, T] (any float dtype; the ratio is computed in float32);
    advantages: [B] or [B, T].  `params` go to the loss (e.g. eps, max_kl3, delta,
    measure, eps_low, eps_high, dual_clip).  With `ref_logp` the KL to the reference is
    reported as `kl/ref` and `beta` times it is added; with `entropy` (per token) it is
    reported as `entropy` and `entropy_coef` times it is subtracted.  `token_weights` [B, T] scale each token's
    policy term (a rollout correction's, `atrctl.core.correction`; 0 drops it), not the penalties.
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

    tokens = prepare_tokens(logp, old_logp, advantages, mask)
    token_loss, clip_metrics = POLICY_LOSSES[algo](tokens, **params)
    if token_weights is not None:
        token_loss = token_loss * aligned(token_weights, mask, "token_weights").float()
    extra: dict[str, Tensor] = {}
    if ref_logp is not None:
        kl = KL_ESTIMATORS[kl_estimator](masked_log_ratio(aligned(ref_logp, mask, "ref_logp"), tokens))
        token_loss = token_loss + beta * kl
        extra["kl/ref"] = kl
    if entropy is not None:
        entropy = torch.where(tokens.mask, aligned(entropy, mask, "entropy").float(), 0.0)
        token_loss = token_loss - entropy_coef * entropy
        extra["entropy"] = entropy
    loss = aggregate(token_loss, tokens.mask, agg, max_new_tokens)
    return LossOutput(loss, diagnostics(tokens, loss, clip_metrics, extra))


def token_losses(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, algo: str = "atr",
                 **params) -> LossOutput:  # fmt: skip
    """The per-token policy loss of `algo` before aggregation ([B, T] float32, 0 at padding) and the diagnostics
    of `policy_loss` (their `loss` is the token mean): for a trainer that aggregates on its own, such as verl's
    agg_loss with its global token counts."""
    if algo not in POLICY_LOSSES:
        raise ValueError(f"unknown algo {algo!r}; choose one of {', '.join(POLICY_LOSSES)}")
    _check_params(algo, params)
    tokens = prepare_tokens(logp, old_logp, advantages, mask)
    token_loss, clip_metrics = POLICY_LOSSES[algo](tokens, **params)
    token_loss = torch.where(tokens.mask, token_loss, 0.0)
    return LossOutput(token_loss, diagnostics(tokens, aggregate(token_loss, tokens.mask), clip_metrics, {}))


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
