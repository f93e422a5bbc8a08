"""The rest of the family the peers ship: soft gates, masks, geometric means, covariance selections and plain
policy gradients, each registered like atrctl's own trust regions (`atrctl.core.loss_registry`).

Each docstring cites the method's paper and says which divergence or region the loss bounds, or why it is not a
region; where atrctl differs from a peer's code on purpose it says so (the differences are pinned by
tests/core/test_loss_family.py, which checks every loss verl 0.9.1 or TRL 1.16 implements against their code).

What counts as "clipped" in the diagnostics, for every loss: a token whose gradient the loss removed, or reduced
to less than half of the importance-weighted policy gradient -A·w·∇logp.  clip/low counts the A < 0 tokens it
stops from falling further, clip/high the A > 0 tokens it stops from rising, both also by p_old.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor

from atrctl.core.loss_metrics import clip_fractions, old_probability_bin, removed_fractions, token_share
from atrctl.core.loss_registry import check_dual_clip, check_positive, register_policy_loss
from atrctl.core.surrogate import clipped_surrogate
from atrctl.core.tokens import Tokens

FAMILY = ("sapo", "gmpo", "dppo-tv", "dppo-kl", "clip-cov", "kl-cov", "gppo", "two-sided", "opsm", "gpg", "topr")
"""The losses of this module, in the order `atrctl ls` lists them."""

HALF_WEIGHT = 2 * math.log(1 + math.sqrt(2))
"""τ·|w - 1| beyond which SAPO's gate 4σ(1 - σ) is below 1/2: σ(x) = (1 ± 1/√2)/2 at |x| = 2·ln(1 + √2) ≈ 1.763."""


def _bins(tokens: Tokens) -> Tensor:
    return old_probability_bin(tokens.old_logp)


def _sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per row, the mean of `values` over its masked tokens ([B]; 0 for a row without any)."""
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


# ---------------------------------------------------------------- soft gates and geometric means


@register_policy_loss("sapo", objective="soft-gate")  # -(4/τ)·σ(τ(w-1))·A: -2A/τ at w = 1, not -A
def _sapo(tokens: Tokens, *, tau_pos: float = 1.0, tau_neg: float = 1.05):
    """SAPO (Gao et al., 2025): a soft gate -(4/τ)·σ(τ(w - 1))·A in place of a clip; not a region.

    arXiv 2511.20347; τ = tau_pos where A > 0, else tau_neg.

    Not a region: a soft gate.  Its gradient is the policy gradient -A·w·∇logp times 4σ(1 - σ), which is 1 at
    w = 1 and decays smoothly as w leaves 1 on either side, sooner for a larger τ (tau_neg > tau_pos damps
    the tokens pushed down sooner).  Clipped here: the gate below 1/2, at |w - 1| > 1.763/τ.  verl aggregates
    SAPO by seq-mean-token-mean whatever its loss_agg_mode says; atrctl takes the recipe's algo.agg, as for
    every loss.  Defaults: verl's and TRL's.
    """
    tau_pos, tau_neg = check_positive(tau_pos, "tau_pos"), check_positive(tau_neg, "tau_neg")
    adv, ratio = tokens.advantages, tokens.ratio
    tau = torch.where(adv > 0, tau_pos, tau_neg)
    loss = -(4 / tau) * torch.sigmoid(tau * (ratio - 1)) * adv
    damped = tau * (ratio - 1).abs() > HALF_WEIGHT
    fractions = removed_fractions(
        damped & (ratio < 1) & (adv < 0), damped & (ratio > 1) & (adv > 0), tokens.mask, _bins(tokens), damped
    )
    return loss, fractions


@register_policy_loss("gmpo")
def _gmpo(tokens: Tokens, *, eps_low: float = 0.4, eps_high: float = 0.4):
    """GMPO (Zhao et al., 2025): the geometric mean of the token ratios, each clipped in log space.

    arXiv 2507.20673: -Ā·exp(mean_t clip(ln w_t)), each ln w_t clipped to [-eps_low, eps_high] only in the
    direction A pushes (as PPO's min).

    The region is a constant interval on each token's ratio, [e^-eps_low, e^eps_high] (the paper's
    (e^-0.4, e^0.4) by default), taken inside a geometric mean, so one extreme token moves the sequence's
    weight far less than in an arithmetic mean.  Every token carries its sequence's loss (as gspo), so
    seq-mean-token-mean gives GMPO's objective; verl averages over all rows, counting a row without tokens
    as a sequence of loss 0, which atrctl's aggregations leave out.
    """
    eps_low, eps_high = check_positive(eps_low, "eps_low"), check_positive(eps_high, "eps_high")
    adv, log_ratio, mask = tokens.advantages, tokens.log_ratio, tokens.mask
    sign = torch.sign(adv)
    clamped = log_ratio.clamp(-eps_low, eps_high)
    bounded = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = _sequence_mean(bounded, mask).exp()
    loss = -_sequence_mean(adv, mask)[:, None] * seq_ratio[:, None]
    below, above = log_ratio < -eps_low, log_ratio > eps_high
    fractions = removed_fractions(below & (adv < 0), above & (adv > 0), mask, _bins(tokens), below | above)
    return loss.expand_as(adv), fractions


# ---------------------------------------------------------------- DPPO's divergence masks


def _dppo(tokens: Tokens, keep_rising: Tensor, keep_falling: Tensor, tis_cap: float):
    """DPPO's loss, -sg(min(w, c))·A·logp on the tokens its mask keeps: an A > 0 token while `keep_rising`, an
    A < 0 one while `keep_falling`."""
    adv = tokens.advantages
    keep = torch.where(adv > 0, keep_rising, keep_falling).detach()
    weight = tokens.ratio.clamp(max=tis_cap).detach()
    loss = -adv * weight * tokens.logp * keep
    fractions = removed_fractions(~keep & (adv < 0), ~keep & (adv > 0), tokens.mask, _bins(tokens))
    fractions["clip/dual"] = token_share((tokens.ratio > tis_cap) & keep, tokens.mask)
    return loss, fractions


@register_policy_loss("dppo-tv", objective="weighted-logp")
def _dppo_tv(tokens: Tokens, *, delta_low: float = 0.2, delta_high: float = 0.2, tis_cap: float = 20.0):
    """DPPO-Binary-TV (Qi et al., 2026): -sg(w)·A·logp, masked once p - p_old passes δ in A's direction.

    arXiv 2602.04879: a token's gradient is kept while its probability moved by at most δ in the direction A
    pushes (p - p_old <= delta_high for A > 0, >= -delta_low for A < 0),
    with the weight w truncated at tis_cap (their truncated importance sampling in place of a dual clip).

    The region is tv-band's, |p - p_old| <= δ, applied as a mask on log π with sg(w) rather than as a clip of
    the surrogate: inside it both give -A·w·∇logp, outside it in A's direction both give 0, so the gradients
    agree wherever w <= tis_cap (tested); the loss values differ (a weighted log-likelihood, not -w·A).
    Defaults: δ = 0.2 (verl's clip_ratio); tis_cap = 20, the paper's advice of a large cap (verl's ActorConfig
    passes its clip_ratio_c, 3).
    """
    delta_low, delta_high = check_positive(delta_low, "delta_low"), check_positive(delta_high, "delta_high")
    tis_cap = check_positive(tis_cap, "tis_cap")
    moved = tokens.logp.exp() - tokens.old_logp.exp()
    return _dppo(tokens, moved <= delta_high, moved >= -delta_low, tis_cap)


@register_policy_loss("dppo-kl", objective="weighted-logp")
def _dppo_kl(tokens: Tokens, *, delta_low: float = 0.05, delta_high: float = 0.05, tis_cap: float = 20.0):
    """DPPO-Binary-KL (Qi et al., 2026): as dppo-tv, masking once KL(Bern(p_old) || Bern(p)) passes δ.

    arXiv 2602.04879; a token moving against A's push is always kept.

    The region is kl-band's; the gradients of the two agree wherever w <= tis_cap, as for dppo-tv.  atrctl
    computes 1 - p as -expm1(log p), where verl adds 1e-8 inside its logarithms (a difference only for
    probabilities within ~1e-8 of 1).  Defaults: δ = 0.05 (the paper's KL threshold), tis_cap = 20.
    """
    delta_low, delta_high = check_positive(delta_low, "delta_low"), check_positive(delta_high, "delta_high")
    tis_cap = check_positive(tis_cap, "tis_cap")
    p, p_old = tokens.logp.exp(), tokens.old_logp.exp()
    divergence = p_old * (tokens.old_logp - tokens.logp) + (1 - p_old) * (
        torch.log(-torch.expm1(tokens.old_logp)) - torch.log(-torch.expm1(tokens.logp))
    )
    return _dppo(tokens, (divergence <= delta_high) | (p <= p_old), (divergence <= delta_low) | (p >= p_old), tis_cap)


# ---------------------------------------------------------------- covariance selections


def _covariance(tokens: Tokens) -> Tensor:
    """Each token's centred covariance term (A - mean A)·(logp - mean logp) over the micro-batch's tokens."""
    mask, adv, logp = tokens.mask, tokens.advantages, tokens.logp.detach()
    count = mask.sum().clamp(min=1)
    return (adv - (adv * mask).sum() / count) * (logp - (logp * mask).sum() / count)


def _selection_generator(tokens: Tokens) -> torch.Generator:
    """A generator seeded by the micro-batch itself (its old log-probabilities), so that clip-cov's random choice
    is the same when the same batch comes again, as after a resume, without touching torch's global state."""
    data = tokens.old_logp[tokens.mask].detach().float().cpu().numpy().tobytes()
    return torch.Generator().manual_seed(zlib.crc32(data))


def choose(candidates: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """`count` of the candidate positions (rows of nonzero indices), drawn without replacement."""
    return candidates[torch.randperm(len(candidates), generator=generator)[:count]]


@register_policy_loss("clip-cov", needs_every_row=True)  # its covariance is over every token of the micro-batch
def _clip_cov(
    tokens: Tokens, *, eps_low: float = 0.2, eps_high: float = 0.2, share: float = 2e-4,
    cov_low: float = 1.0, cov_high: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:  # fmt: skip
    """Clip-Cov (Cui et al., 2025): PPO's clip, and the gradient of a few high-covariance tokens removed.

    "The Entropy Mechanism of RL for Reasoning LMs", arXiv 2505.22617: PPO's clipped surrogate on [1 - eps_low,
    1 + eps_high], and the gradient of a random `share` of the tokens (at least one) whose covariance term (A -
    Ā)(logp - mean logp) lies in (cov_low, cov_high) removed.

    Not a divergence region beyond PPO's: the selection targets the tokens that drive entropy down (high
    probability with a positive advantage), whatever their ratio.  The draw is random; atrctl seeds it from the
    micro-batch (`_selection_generator`) so a run is reproducible, where verl draws from torch's global state.
    Defaults: verl's.
    """
    eps_low, eps_high, share = (check_positive(v, n) for v, n in ((eps_low, "eps_low"), (eps_high, "eps_high"),
                                                                     (share, "share")))  # fmt: skip
    adv, ratio, mask = tokens.advantages, tokens.ratio, tokens.mask
    low, high = 1 - eps_low, 1 + eps_high
    loss = clipped_surrogate(ratio, adv, low, high)
    clipped = (-adv * ratio.clamp(low, high) > -adv * ratio) & mask
    covariance = _covariance(tokens)
    candidates = torch.nonzero(mask & ~clipped & (covariance > cov_low) & (covariance < cov_high))
    count = max(int(share * int(mask.sum())), 1)
    chosen = choose(candidates, count, _selection_generator(tokens))
    dropped = torch.zeros_like(mask)
    dropped[chosen[:, 0], chosen[:, 1]] = True
    fractions = clip_fractions(ratio, adv, low, high, mask, bins=_bins(tokens))
    fractions["clip/cov"] = token_share(dropped, mask)
    return loss * ~dropped, fractions


@register_policy_loss("kl-cov", needs_every_row=True)  # its covariance is over every token of the micro-batch
def _kl_cov(tokens: Tokens, *, share: float = 2e-4, coef: float = 0.1):
    """KL-Cov (Cui et al., 2025): -w·A, plus coef·|ln w| on the tokens of largest covariance; not a region.

    arXiv 2505.22617: the unclipped policy gradient -w·A, plus coef·|ln w| on the `share` of tokens (at least
    one) with the largest covariance term (A - Ā)(logp - mean logp).

    Not a region: an L1 penalty on how far the selected tokens' log-probabilities moved, so those that would
    collapse entropy are held near π_old and nothing else is bounded.  No gradient is removed, so its clip/low
    and clip/high are 0; clip/region is the share penalised.  Defaults: verl's config (share 2e-4, coef 0.1).
    """
    share, coef = check_positive(share, "share"), check_positive(coef, "coef")
    adv, mask = tokens.advantages, tokens.mask
    covariance = torch.where(mask, _covariance(tokens), -math.inf).flatten()
    count = min(max(int(share * int(mask.sum())), 1), int(mask.sum()))
    penalised = torch.zeros_like(covariance, dtype=torch.bool)
    penalised[torch.topk(covariance, count).indices] = True
    penalised = penalised.view_as(mask) & mask
    loss = -adv * tokens.ratio + coef * tokens.log_ratio.abs() * penalised
    none = torch.zeros_like(mask)
    return loss, removed_fractions(none, none, mask, _bins(tokens), outside=penalised)


# ---------------------------------------------------------------- other clips of the ratio


@register_policy_loss("gppo")
def _gppo(tokens: Tokens, *, eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float | None = 3.0):
    """GPPO (Su et al., 2025, Klear-Reasoner): dapo's clip in value, a bounded gradient beyond it.

    arXiv 2508.07629: a clipped token keeps a bounded gradient, (1 ± ε)·A·∇logp, instead of none (the clip bound
    is written (1 ± ε)·w/sg(w)).

    The region is dapo's [1 - eps_low, 1 + eps_high]; outside it the update is slowed, not stopped.  So
    clip/high counts the A > 0 tokens whose gradient fell below half of -A·w·∇logp (w > 2(1 + eps_high)); an
    A < 0 token below the region gets (1 - eps_low)/w >= 1 times it, so clip/low only counts the dual clip's
    removals (clip/dual).  Defaults: the paper's code (clip-higher 0.28, dual clip 3).
    """
    eps_low, eps_high = check_positive(eps_low, "eps_low"), check_positive(eps_high, "eps_high")
    dual_clip = check_dual_clip(dual_clip)
    adv, ratio = tokens.advantages, tokens.ratio
    preserved = ratio / ratio.detach()  # 1 in value, ∇logp in gradient
    loss = clipped_surrogate(ratio, adv, (1 - eps_low) * preserved, (1 + eps_high) * preserved, dual_clip)
    slowed = (ratio > 2 * (1 + eps_high)) & (adv > 0)
    dual = (ratio > dual_clip) & (adv < 0) if dual_clip is not None else torch.zeros_like(tokens.mask)
    outside = (ratio < 1 - eps_low) | (ratio > 1 + eps_high)
    fractions = removed_fractions(dual, slowed, tokens.mask, _bins(tokens), outside)
    fractions["clip/dual"] = token_share(dual, tokens.mask)
    return loss, fractions


@register_policy_loss("two-sided")
def _two_sided(tokens: Tokens, *, eps_low: float = 0.2, eps_high: float = 0.2, delta: float = 4.0):
    """Two-sided clip (INTELLECT-2, 2025; TRL's delta): dapo with the A < 0 ratios also capped at δ.

    Prime Intellect, arXiv 2505.07291: the unclipped term's ratio is also capped at δ, -min(min(w, δ)·A, clip(w,
    1 - eps_low, 1 + eps_high)·A).

    The region is dapo's; δ only acts on A < 0 tokens whose ratio grew past it, whose loss it caps at δ·|A|
    (gradient 0).  That is dual-clip PPO (Ye et al., 2020) with c = δ, written as a clamp: the same loss as
    dapo with dual_clip = δ (tested).  δ must exceed 1 + eps_high (as TRL advises), or it would also tighten
    the upper clip.  Defaults: TRL's ε (0.2) and the report's δ = 4.
    """
    eps_low, eps_high = check_positive(eps_low, "eps_low"), check_positive(eps_high, "eps_high")
    delta = check_positive(delta, "delta")
    if delta <= 1 + eps_high:
        raise ValueError(f"delta must exceed 1 + eps_high = {1 + eps_high:g}, got {delta}: raise delta")
    adv, ratio = tokens.advantages, tokens.ratio
    low, high = 1 - eps_low, 1 + eps_high
    loss = clipped_surrogate(ratio, adv, low, high, dual_clip=delta)  # TRL's clamp of w at δ is this cap
    return loss, clip_fractions(ratio, adv, low, high, tokens.mask, delta, _bins(tokens))


@register_policy_loss("opsm")
def _opsm(tokens: Tokens, *, eps_low: float = 0.2, eps_high: float = 0.2, max_kl: float = 0.5):
    """OPSM (DeepSeek-V3.2, 2025): dapo, dropping A < 0 sequences whose mean ln(π_old/π) passes max_kl.

    The off-policy sequence mask (arXiv 2512.02556; TRL's off_policy_mask_threshold) over dapo's clipped
    surrogate: a sequence with A < 0 whose mean ln(π_old/π) over its tokens exceeds max_kl
    is dropped whole.

    A sequence-level region on the k1 estimate of KL(π_old || π), one-sided: only sequences pushed down are
    dropped, since those are the ones whose probability the update already drove far below the sampler's.
    π_old stands for the sampler's policy μ (TRL's choice without vLLM); the mismatch to μ itself is
    rollout.correction's.  Defaults: TRL's ε 0.2 and its suggested threshold 0.5.
    """
    eps_low, eps_high = check_positive(eps_low, "eps_low"), check_positive(eps_high, "eps_high")
    max_kl = check_positive(max_kl, "max_kl")
    adv, ratio, mask = tokens.advantages, tokens.ratio, tokens.mask
    low, high = 1 - eps_low, 1 + eps_high
    seq_kl = _sequence_mean(tokens.old_logp - tokens.logp.detach(), mask)
    dropped = (adv < 0) & (seq_kl > max_kl)[:, None]
    loss = clipped_surrogate(ratio, adv, low, high) * ~dropped
    fractions = removed_fractions(((ratio < low) | dropped) & (adv < 0), (ratio > high) & (adv > 0) & ~dropped,
                                  mask, _bins(tokens), (ratio < low) | (ratio > high) | dropped)  # fmt: skip
    fractions["clip/sequence"] = token_share(dropped, mask)
    return loss, fractions


# ---------------------------------------------------------------- policy gradients without a region


@register_policy_loss("gpg", objective="weighted-logp")
def _gpg(tokens: Tokens):
    """GPG (Chu et al., 2025): -A·logp, the plain policy gradient on group-relative advantages; not a region.

    arXiv 2504.02546.

    Not a region, and not importance-weighted: off-policy (several mini-batches or iterations) its later
    updates follow the current policy's gradient at the old samples.  Nothing is clipped.  As verl's, it
    leaves out the paper's rescaling of A by the share of groups with a signal.
    """
    none = torch.zeros_like(tokens.mask)
    return -tokens.advantages * tokens.logp, removed_fractions(none, none, tokens.mask, _bins(tokens))


@register_policy_loss("topr", objective="weighted-logp")
def _topr(tokens: Tokens, *, cap: float = 1.0):
    """TOPR (Le Roux et al., 2025): -ρ·A·logp, ρ = 1 for A >= 0, the sequence ratio capped for A < 0.

    "Tapered Off-Policy REINFORCE", arXiv 2503.14286: ρ = 1 for a sequence with A >= 0 (no importance weight:
    push every good sequence up as SFT would) and ρ = min(π(y)/π_old(y), cap) for A < 0 (truncated sequence
    ratio, cap 1 in the paper).

    A one-sided region on the sequence ratio of the negatives only.  Clipped here: the sequences whose weight
    is under half their importance weight, π(y)/π_old(y) > 2 for A >= 0 (high) and > 2·cap for A < 0 (low).
    verl's implementation is an open pull request (#6986), so it is checked against hand-computed cases only.
    """
    cap = check_positive(cap, "cap")
    adv, mask = tokens.advantages, tokens.mask
    seq_ratio = (tokens.log_ratio * mask).sum(dim=1, keepdim=True).exp()
    weight = torch.where(adv >= 0, 1.0, seq_ratio.clamp(max=cap)).detach()
    loss = -weight * adv * tokens.logp
    high = (adv > 0) & (seq_ratio > 2)
    low = (adv < 0) & (seq_ratio > 2 * cap)
    return loss, removed_fractions(low, high, mask, _bins(tokens))
