"""Policy losses: the gradient rule, the equivalences between trust regions, aggregation, metrics, bands."""

import math

import pytest
import torch

from atrctl.core.aggregation import AGGREGATIONS, aggregate
from atrctl.core.bands import kl_band_bounds, tv_band_bounds
from atrctl.core.divergence import kl3_bounds
from atrctl.core.loss_metrics import finish_metrics
from atrctl.core.losses import POLICY_LOSSES, loss_objective, policy_loss
from atrctl.core.tokens import LOG_RATIO_LIMIT, prepare_tokens

BINS = ("p00-10", "p10-50", "p50-90", "p90-100")
MECHANISM_NAMES = {f"clip/{side}/{b}" for side in ("low", "high") for b in BINS} | {
    f"{kind}/{sign}/{b}" for kind in ("tokens", "dlogp") for sign in ("pos", "neg") for b in BINS
}
METRIC_NAMES = {
    "loss", "clip/low", "clip/high", "clip/region", "kl3/mean", "kl3/max", "ratio/min", "ratio/max", *MECHANISM_NAMES
}  # fmt: skip


def batch(ratios, advantages, lengths=None, old=-1.0):
    """Hand-built [B, T] inputs with exactly these ratios; padding (beyond lengths) holds junk."""
    w = torch.tensor(ratios, dtype=torch.float64)
    old_logp = torch.full_like(w, old)
    logp = (old_logp + w.log()).float().requires_grad_()
    mask = torch.ones_like(w, dtype=torch.bool)
    if lengths is not None:
        for row, length in enumerate(lengths):
            mask[row, length:] = False
    return logp, old_logp.float(), torch.tensor(advantages, dtype=torch.float32), mask


def grad_of(loss, logp):
    (grad,) = torch.autograd.grad(loss, logp)
    return grad


def random_batch(seed, B=8, T=16, spread=0.6):
    gen = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(B, T, generator=gen) * 4
    logp = (old_logp + torch.randn(B, T, generator=gen) * spread).clamp(max=0.0).requires_grad_()
    advantages = torch.randn(B, generator=gen)
    mask = torch.ones(B, T, dtype=torch.bool)
    for row in range(B):
        mask[row, int(torch.randint(1, T + 1, (1,), generator=gen)) :] = False
    return logp, old_logp, advantages, mask


# ------------------------------------------------------------------ the gradient rule


def test_atr_gradient_is_zero_exactly_where_the_clip_binds_and_minus_a_w_elsewhere():
    low, high = kl3_bounds(0.1)  # [0.616817, 1.516221]
    w = [2.0, 0.5, 1.1, 0.7, 1.6]
    logp, old_logp, adv, mask = batch([w, w], [1.5, -0.5])
    loss, _ = policy_loss(logp, old_logp, adv, mask, algo="atr", max_kl3=0.1)
    grad = grad_of(loss, logp)
    # token-mean over 10 tokens: every token weighs 1/10
    expected = (
        torch.tensor(
            [
                [0.0, -1.5 * 0.5, -1.5 * 1.1, -1.5 * 0.7, 0.0],  # A > 0: w = 2.0, 1.6 > u are cut off
                [0.5 * 2.0, 0.0, 0.5 * 1.1, 0.5 * 0.7, 0.5 * 1.6],  # A < 0: w = 0.5 < l is cut off
            ]
        )
        / 10
    )
    assert grad[0, 0] == 0 and grad[0, 4] == 0 and grad[1, 1] == 0
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=0)
    # loss: -min(wA, clip(w)A), clip to [l, u]
    per_token = [
        -1.5 * high, -1.5 * 0.5, -1.5 * 1.1, -1.5 * 0.7, -1.5 * high,
        0.5 * 2.0, 0.5 * low, 0.5 * 1.1, 0.5 * 0.7, 0.5 * 1.6,
    ]  # fmt: skip
    assert loss.item() == pytest.approx(sum(per_token) / 10, rel=1e-6)


def test_gradient_weights_follow_the_aggregation():
    w = [[1.1, 0.9, 1.0], [1.15, 1.0, 1.0]]
    logp, old_logp, adv, mask = batch(w, [1.0, 2.0], lengths=[3, 1])
    grad = grad_of(policy_loss(logp, old_logp, adv, mask, algo="grpo", agg="seq-mean-token-mean")[0], logp)
    expected = torch.tensor([[-1.1 / 3 / 2, -0.9 / 3 / 2, -1.0 / 3 / 2], [-2.0 * 1.15 / 2, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=0)
    grad = grad_of(
        policy_loss(logp, old_logp, adv, mask, algo="grpo", agg="seq-mean-token-sum-norm", max_new_tokens=5)[0], logp
    )
    expected = torch.tensor([[-1.1, -0.9, -1.0], [-2.0 * 1.15, 0.0, 0.0]]) / (2 * 5)
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=0)


# ----------------------------------------------------------------- equivalences


@pytest.mark.parametrize("delta", [0.01, 0.1, 0.2])
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_atr_equals_dapo_with_the_kl3_bounds(delta, agg):
    low, high = kl3_bounds(delta)
    logp, old_logp, adv, mask = random_batch(seed=int(delta * 100))
    atr_loss, atr_metrics = policy_loss(
        logp, old_logp, adv, mask, algo="atr", agg=agg, max_new_tokens=16, max_kl3=delta
    )
    dapo_loss, dapo_metrics = policy_loss(
        logp, old_logp, adv, mask, algo="dapo", agg=agg, max_new_tokens=16, eps_low=1 - low, eps_high=high - 1
    )
    torch.testing.assert_close(atr_loss, dapo_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_of(atr_loss, logp), grad_of(dapo_loss, logp), rtol=1e-6, atol=1e-8)
    assert atr_metrics == pytest.approx(dapo_metrics)
    assert 0 < atr_metrics["clip/region"] < 1  # the comparison is not vacuous


def test_grpo_equals_symmetric_dapo_and_divergence_k3_equals_atr():
    logp, old_logp, adv, mask = random_batch(seed=3)
    grpo, _ = policy_loss(logp, old_logp, adv, mask, algo="grpo", eps=0.15)
    dapo, _ = policy_loss(logp, old_logp, adv, mask, algo="dapo", eps_low=0.15, eps_high=0.15)
    torch.testing.assert_close(grpo, dapo, rtol=0, atol=0)
    torch.testing.assert_close(grad_of(grpo, logp), grad_of(dapo, logp), rtol=0, atol=0)
    atr, _ = policy_loss(logp, old_logp, adv, mask, algo="atr", max_kl3=0.05)
    generic, _ = policy_loss(logp, old_logp, adv, mask, algo="divergence", measure="kl3", delta=0.05)
    torch.testing.assert_close(atr, generic, rtol=1e-6, atol=1e-7)


def test_default_parameters():
    logp, old_logp, adv, mask = random_batch(seed=4)
    pairs = [("grpo", {}, "grpo", {"eps": 0.2}), ("dapo", {}, "dapo", {"eps_low": 0.2, "eps_high": 0.28})]
    pairs += [("atr", {}, "atr", {"max_kl3": 0.1})]
    for algo_a, params_a, algo_b, params_b in pairs:
        a = policy_loss(logp, old_logp, adv, mask, algo=algo_a, **params_a)[0]
        b = policy_loss(logp, old_logp, adv, mask, algo=algo_b, **params_b)[0]
        assert a.item() == b.item()
    assert (
        policy_loss(logp, old_logp, adv, mask)[0].item() == policy_loss(logp, old_logp, adv, mask, algo="atr")[0].item()
    )


@pytest.mark.parametrize("algo", list(POLICY_LOSSES))
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_on_policy_first_pass_is_the_plain_policy_gradient(algo, agg):
    """At w = 1 no clip binds: every loss's gradient is that of -A·logp under the same aggregation.  The covariance
    selections do not look at w: clip-cov removes one token's gradient (its share of this batch rounds up to
    one), and kl-cov penalises one token by |ln w|, whose gradient at w = 1 is 0."""
    _, old_logp, adv, mask = random_batch(seed=5)
    logp = old_logp.clone().requires_grad_()
    loss, metrics = policy_loss(logp, old_logp, adv, mask, algo=algo, agg=agg, max_new_tokens=16)
    plain = aggregate(-adv[:, None] * logp, mask, agg, max_new_tokens=16)
    ours, theirs = grad_of(loss, logp), grad_of(plain, logp)
    if algo == "clip-cov":
        differs = ~torch.isclose(ours, theirs, rtol=1e-6, atol=1e-9)
        assert int(differs.sum()) == 1 and ours[differs].item() == 0 and metrics["clip/cov"] > 0
        ours = torch.where(differs, theirs, ours)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-9)
    if loss_objective(algo) == "surrogate" and algo != "clip-cov":  # -A at w = 1 (cispo's is -A·logp; clip-cov
        # drops its chosen token's term)
        assert loss.item() == pytest.approx(aggregate(-adv[:, None].expand_as(mask), mask, agg, 16).item(), abs=1e-7)
    assert metrics["clip/region"] == pytest.approx(1 / mask.sum().item() if algo == "kl-cov" else 0, abs=1e-9)
    assert metrics["kl3/max"] == 0
    assert metrics["ratio/min"] == metrics["ratio/max"] == 1


# ----------------------------------------------------------------- aggregation


def test_aggregation_modes_by_hand_with_unequal_lengths():
    values = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, -7.0, 8.0, 9.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # lengths 3, 1 and an empty row
    assert aggregate(values, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(values, mask, "seq-mean-token-sum-norm", max_new_tokens=4).item() == pytest.approx(10 / (2 * 4))
    junk = values.clone()
    junk[~mask.bool()] = float("nan")
    for agg in AGGREGATIONS:
        assert aggregate(junk, mask, agg, 4).item() == aggregate(values, mask, agg, 4).item()


def test_sum_norm_needs_max_new_tokens_and_unknown_modes_are_listed():
    with pytest.raises(ValueError, match="max_new_tokens"):
        aggregate(torch.ones(2, 3), torch.ones(2, 3), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum-norm"):
        aggregate(torch.ones(2, 3), torch.ones(2, 3), "sum")


@pytest.mark.parametrize("algo", list(POLICY_LOSSES))
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_padding_never_changes_the_loss(algo, agg):
    logp, old_logp, adv, mask = random_batch(seed=6, spread=0.4)
    loss, metrics = policy_loss(logp, old_logp, adv, mask, algo=algo, agg=agg, max_new_tokens=32)
    grad = grad_of(loss, logp)
    # more padding columns and a padding row, filled with junk that must not matter
    B, T = mask.shape
    pad_logp = torch.full((B + 1, T + 16), -3.0)
    pad_old = torch.full((B + 1, T + 16), float("-inf"))
    pad_old[:, -1] = float("nan")
    pad_adv = torch.cat([adv, torch.tensor([1e6])])
    pad_mask = torch.zeros(B + 1, T + 16, dtype=torch.bool)
    pad_logp[:B, :T], pad_old[:B, :T], pad_mask[:B, :T] = logp.detach(), old_logp, mask
    pad_old[:B, :T][~mask] = 123.0
    pad_logp.requires_grad_()
    padded_loss, padded_metrics = policy_loss(
        pad_logp, pad_old, pad_adv, pad_mask, algo=algo, agg=agg, max_new_tokens=32
    )
    padded_grad = grad_of(padded_loss, pad_logp)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(padded_grad[:B, :T], grad, rtol=1e-6, atol=1e-9)
    assert padded_grad[B:].abs().sum() == 0 and padded_grad[:, T:].abs().sum() == 0
    assert padded_metrics == pytest.approx(metrics)


# --------------------------------------------------------------------- metrics


def test_clip_and_kl3_metrics_by_hand():
    # grpo, eps = 0.2: [0.8, 1.2]; the last column is padding with w = 5
    w = [[1.5, 0.7, 1.0, 5.0], [1.5, 0.7, 1.1, 5.0]]
    logp, old_logp, adv, mask = batch(w, [1.0, -2.0], lengths=[3, 3])
    _, metrics = policy_loss(logp, old_logp, adv, mask, algo="grpo")
    assert set(metrics) == METRIC_NAMES and all(type(v) is float for v in metrics.values())
    assert metrics["clip/high"] == pytest.approx(1 / 6)  # 1.5 with A > 0
    assert metrics["clip/low"] == pytest.approx(1 / 6)  # 0.7 with A < 0
    assert metrics["clip/region"] == pytest.approx(4 / 6)  # both 1.5s and both 0.7s
    kl3 = [x - 1 - math.log(x) for x in (1.5, 0.7, 1.0, 1.5, 0.7, 1.1)]
    assert metrics["kl3/mean"] == pytest.approx(sum(kl3) / 6, rel=1e-5)
    assert metrics["kl3/max"] == pytest.approx(1.5 - 1 - math.log(1.5), rel=1e-5)
    assert metrics["ratio/min"] == pytest.approx(0.7, rel=1e-6)
    assert metrics["ratio/max"] == pytest.approx(1.5, rel=1e-6)


def test_mechanism_metrics_by_hand():
    """Six tokens in four p_old bins, clipped by grpo's [0.8, 1.2]; every figure counted here by hand."""
    p_old = torch.tensor([[0.05, 0.3, 0.95, 0.7], [0.05, 0.6, 0.99, 0.2]])
    w = torch.tensor([[1.5, 0.7, 1.1, 1.0], [0.5, 1.3, 0.9, 9.0]])  # last of row 1 is padding
    old_logp = p_old.log()
    logp = old_logp + w.log()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    _, m = policy_loss(logp, old_logp, torch.tensor([1.0, -1.0]), mask, algo="grpo")
    # row 0 (A > 0): 1.5 at p 0.05 clipped high; row 1 (A < 0): 0.5 at p 0.05 clipped low; 1.3 (A < 0) is
    # outside the region but keeps its gradient; 0.7 with A > 0 likewise
    assert m["clip/high/p00-10"] == pytest.approx(1 / 7) and m["clip/low/p00-10"] == pytest.approx(1 / 7)
    for side in ("low", "high"):
        assert sum(m[f"clip/{side}/{b}"] for b in BINS) == pytest.approx(m[f"clip/{side}"])
    assert m["clip/high/p10-50"] == m["clip/low/p50-90"] == 0.0
    shares = {
        "pos": [1, 1, 1, 1],
        "neg": [1, 0, 1, 1],
    }  # tokens per bin: row 0 [0.05, 0.3, 0.7, 0.95], row 1 [0.05, 0.6, 0.99]
    for sign, counts in shares.items():
        assert [m[f"tokens/{sign}/{b}"] for b in BINS] == pytest.approx([c / 7 for c in counts])
    finished = finish_metrics(m)
    expected = {"pos": [1.5, 0.7, 1.0, 1.1], "neg": [0.5, None, 1.3, 0.9]}
    for sign, ratios in expected.items():
        for b, ratio in zip(BINS, ratios, strict=True):
            if ratio is None:
                assert f"dlogp/{sign}/{b}" not in finished  # an empty cell reports nothing, not 0
            else:
                assert finished[f"dlogp/{sign}/{b}"] == pytest.approx(math.log(ratio), abs=1e-6)
    assert {k: v for k, v in finished.items() if not k.startswith("dlogp/")} == {
        k: v for k, v in m.items() if not k.startswith("dlogp/")
    }


def test_mechanism_metrics_combine_exactly_over_micro_batches():
    """Token-weighted means of the shares, then one division: the cell means of one batch split in two."""
    from atrctl.training.step_metrics import reduce_step_metrics

    torch.manual_seed(0)
    old_logp = torch.rand(6, 5).log()
    logp = old_logp + 0.3 * torch.randn(6, 5)
    adv, mask = torch.randn(6), torch.rand(6, 5) > 0.3
    whole = finish_metrics(policy_loss(logp, old_logp, adv, mask, algo="atr").metrics)
    micro = []
    for rows in (slice(0, 2), slice(2, 6)):
        metrics = policy_loss(logp[rows], old_logp[rows], adv[rows], mask[rows], algo="atr").metrics
        micro.append((metrics, float(mask[rows].sum()), 1.0))
    split = finish_metrics(reduce_step_metrics(micro, list(micro[0][0]), torch.device("cpu")))
    for key in whole:
        if key.startswith(("dlogp/", "tokens/", "clip/low/", "clip/high/")):
            assert split[key] == pytest.approx(whole[key], abs=1e-6), key


def test_atr_clips_less_above_than_grpo_with_the_same_lower_bound():
    """The KL3 region's built-in clip-higher, seen in the metrics: same l, larger u."""
    low, high = kl3_bounds(0.1)
    w = [[1.3, 1.45, 1.55, 0.65, 0.6]]
    logp, old_logp, _, mask = batch(w, [1.0])
    eps = 1 - low
    for adv, name in ((1.0, "clip/high"), (-1.0, "clip/low")):
        a = torch.tensor([adv])
        grpo = policy_loss(logp, old_logp, a, mask, algo="grpo", eps=eps)[1]
        atr = policy_loss(logp, old_logp, a, mask, algo="atr", max_kl3=0.1)[1]
        if name == "clip/high":  # grpo's u = 1 + eps = 1.383 cuts 1.45 and 1.55; atr's u = 1.516 only 1.55
            assert (grpo[name], atr[name]) == pytest.approx((2 / 5, 1 / 5))
        else:  # same lower bound: 0.6 only
            assert (grpo[name], atr[name]) == pytest.approx((1 / 5, 1 / 5))
    assert high - 1 > 1 - low


def test_kl_and_entropy_terms():
    logp, old_logp, adv, mask = batch([[1.0, 1.0, 1.0]], [0.0], lengths=[2])
    ref_logp = logp.detach() + torch.tensor([[0.5, -0.2, 9.0]])  # r = ln(pi_ref / pi_theta)
    entropy = torch.tensor([[0.3, 0.9, 50.0]])
    expected = {
        "k1": (-0.5 + 0.2) / 2,
        "k2": (0.5 * 0.25 + 0.5 * 0.04) / 2,
        "k3": (math.exp(0.5) - 1.5 + math.exp(-0.2) - 0.8) / 2,
    }
    for estimator, kl in expected.items():
        loss, metrics = policy_loss(
            logp, old_logp, adv, mask, ref_logp=ref_logp, beta=0.1, kl_estimator=estimator,
            entropy=entropy, entropy_coef=0.01,
        )  # fmt: skip
        assert metrics["kl/ref"] == pytest.approx(kl, rel=1e-5)
        assert metrics["entropy"] == pytest.approx(0.6, rel=1e-6)
        assert loss.item() == pytest.approx(0.1 * kl - 0.01 * 0.6, rel=1e-5)  # A = 0: no policy term
    # the k3 penalty's gradient: d/dlogp (e^r - 1 - r) = 1 - e^r, times beta, token-mean
    loss, _ = policy_loss(logp, old_logp, adv, mask, ref_logp=ref_logp, beta=0.1, kl_estimator="k3")
    expected_grad = torch.tensor([[1 - math.exp(0.5), 1 - math.exp(-0.2), 0.0]]) * 0.1 / 2
    torch.testing.assert_close(grad_of(loss, logp), expected_grad, rtol=1e-5, atol=0)
    # reported without being added at beta = 0
    loss, metrics = policy_loss(logp, old_logp, adv, mask, ref_logp=ref_logp)
    assert loss.item() == 0 and metrics["kl/ref"] == pytest.approx(expected["k3"], rel=1e-5)


# -------------------------------------------------------------- the other losses


def test_dual_clip_caps_negative_advantage_tokens():
    logp, old_logp, adv, mask = batch([[5.0, 2.0], [5.0, 2.0]], [-1.0, 1.0])
    loss, _ = policy_loss(logp, old_logp, adv, mask, algo="grpo")
    assert loss.item() == pytest.approx((5.0 + 2.0 - 1.2 - 1.2) / 4, rel=1e-6)
    loss, metrics = policy_loss(logp, old_logp, adv, mask, algo="grpo", dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2 - 1.2) / 4, rel=1e-6)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[0.0, 2.0 / 4], [0.0, 0.0]]))
    assert metrics["clip/dual"] == pytest.approx(1 / 4)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old_logp, adv, mask, algo="atr", dual_clip=0.5)


def test_gspo_clips_whole_sequences():
    # sequence ratios (default region [1 - 3e-4, 1 + 4e-4]): exp(mean(ln 1.1, ln 0.9)) = sqrt(0.99) < l
    # and, over the one real token of the second sequence, 1.2 > u
    logp, old_logp, adv, mask = batch([[1.1, 0.9], [1.2, 7.0]], [1.0, 1.0], lengths=[2, 1])
    loss, metrics = policy_loss(logp, old_logp, adv, mask, algo="gspo", agg="seq-mean-token-mean")
    s = math.sqrt(0.99)
    assert loss.item() == pytest.approx((-s - (1 + 4e-4)) / 2, rel=1e-6)  # A > 0: only s > u is clipped
    grad = grad_of(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[-s / 2 / 2, -s / 2 / 2], [0.0, 0.0]]), rtol=1e-6, atol=0)
    assert (metrics["clip/high"], metrics["clip/low"], metrics["clip/region"]) == (0.5, 0.0, 1.0)  # per sequence


def test_cispo_keeps_every_gradient_with_a_capped_weight():
    logp, old_logp, adv, mask = batch([[2.0, 0.5, 1.1, 3.0]], [1.0])
    loss, metrics = policy_loss(logp, old_logp, adv, mask, algo="cispo", eps_high=0.28)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-1.28, -0.5, -1.1, -1.28]]) / 4, rtol=1e-6, atol=0)
    weights = torch.tensor([1.28, 0.5, 1.1, 1.28])
    assert loss.item() == pytest.approx(-(weights * logp[0]).sum().item() / 4)
    # clipped: the cap cut the weight below half of w (3 > 2·1.28), not w = 2 (kept 64%); no lower bound
    assert metrics["clip/high"] == pytest.approx(1 / 4) and metrics["clip/low"] == 0
    assert metrics["clip/region"] == pytest.approx(2 / 4)


# ---------------------------------------------------------------------- bands


def binary_kl(p, q):
    return torch.xlogy(p, p) - torch.xlogy(p, q) + torch.xlogy(1 - p, 1 - p) - torch.xlogy(1 - p, 1 - q)


OLD_LOGP = torch.cat([torch.tensor([0.0, -1e-9, -1e-4]), -torch.logspace(-3, math.log10(30), 400)])


@pytest.mark.parametrize("delta", [1e-4, 0.02, 0.2, 0.6])
def test_tv_band_bounds_meet_the_constraint_and_stay_in_0_1(delta):
    p = OLD_LOGP.double().exp()
    low, high = tv_band_bounds(OLD_LOGP, delta, dtype=torch.float64)
    capped_high, capped_low = p + delta >= 1, p - delta <= 0
    assert capped_high.any() and (~capped_high).any() and capped_low.any() and (~capped_low).any()
    # p_new = p·u = min(p + delta, 1), p_new = p·l = max(p - delta, 0)
    torch.testing.assert_close(p * high, (p + delta).clamp(max=1), rtol=0, atol=1e-12)
    torch.testing.assert_close(p * low, (p - delta).clamp(min=0), rtol=0, atol=1e-12)
    low32, high32 = tv_band_bounds(OLD_LOGP, delta)
    assert low32.dtype == torch.float32 and (low32 >= 0).all() and (p * high32 <= 1 + 1e-6).all()
    torch.testing.assert_close(low32.double(), low, rtol=1e-6, atol=1e-7)


def test_a_token_the_policy_now_takes_with_probability_1_sits_exactly_on_the_tv_bands_upper_bound():
    """Where p_old + delta >= 1 the bound u is 1/p_old, the ratio of a token whose new logprob is exactly 0:
    the two must be the same float, or the clip decision at that token rests on rounding that differs
    between devices (a GPU clipped one such token and the CPU did not)."""
    old_logp = -torch.logspace(-6, math.log10(0.2), 2000)
    _, high = tv_band_bounds(old_logp, 0.2)
    ratio = prepare_tokens(torch.zeros(1, 2000), old_logp[None], torch.ones(1), torch.ones(1, 2000)).ratio
    assert torch.equal(ratio[0], high)


@pytest.mark.parametrize("delta", [1e-6, 1e-3, 0.1, 2.0])
def test_kl_band_bounds_meet_the_constraint_and_stay_in_0_1(delta):
    p = OLD_LOGP.double().exp()
    low, high = kl_band_bounds(OLD_LOGP, delta, dtype=torch.float64)
    q_low, q_high = p * low, p * high
    assert (q_low >= 0).all() and (q_low < p).all() and (q_high >= p).all() and (q_high <= 1 + 1e-15).all()
    # every root that float64 resolves meets KL = delta; the others sit at p_new = 0 or 1
    has_low, has_high = q_low > 1e-300, q_high < 1 - 1e-9
    torch.testing.assert_close(binary_kl(p, q_low)[has_low], torch.full_like(p, delta)[has_low], rtol=0, atol=1e-6)
    torch.testing.assert_close(binary_kl(p, q_high)[has_high], torch.full_like(p, delta)[has_high], rtol=0, atol=1e-6)
    assert high[0] == 1  # p_old = 1: nothing above
    assert has_low.sum() > 100 and has_high.sum() > 100
    low32, high32 = kl_band_bounds(OLD_LOGP, delta)
    assert low32.dtype == torch.float32 and (low32 >= 0).all() and (p * high32 <= 1 + 1e-6).all()
    torch.testing.assert_close(low32.double(), low, rtol=1e-6, atol=1e-37)
    torch.testing.assert_close(high32.double(), high, rtol=1e-6, atol=0)


def test_bands_are_the_same_surrogate_with_tensor_bounds():
    logp, old_logp, adv, mask = random_batch(seed=7, spread=1.0)
    for algo, bounds in (("tv-band", tv_band_bounds), ("kl-band", kl_band_bounds)):
        loss, metrics = policy_loss(logp, old_logp, adv, mask, algo=algo, delta=0.05)
        low, high = bounds(old_logp, 0.05)
        w = (logp - old_logp).exp()
        a = adv[:, None].expand_as(w)
        manual = -torch.minimum(w * a, torch.minimum(torch.maximum(w, low), high) * a)
        torch.testing.assert_close(loss, aggregate(manual, mask), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad_of(loss, logp), grad_of(aggregate(manual, mask), logp), rtol=1e-6, atol=1e-9)
        assert 0 < metrics["clip/region"] < 1


def test_kl_band_tends_to_kl3_over_p_for_rare_tokens():
    """KL(Bern(p) || Bern(pw)) = p·(w - 1 - ln w) + O(p^2): a rare token's band is the KL3 region of delta/p."""
    old_logp = torch.tensor([math.log(1e-6)])
    low, high = kl_band_bounds(old_logp, 1e-7, dtype=torch.float64)
    assert (low.item(), high.item()) == pytest.approx(kl3_bounds(0.1), rel=1e-5)


# ------------------------------------------------------------------- numerics


@pytest.mark.parametrize("algo", list(POLICY_LOSSES))
def test_bfloat16_inputs_give_the_float32_result(algo):
    logp, old_logp, adv, mask = random_batch(seed=8)
    logp16 = logp.detach().bfloat16().requires_grad_()
    loss16, metrics16 = policy_loss(logp16, old_logp.bfloat16(), adv.bfloat16(), mask, algo=algo)
    logp32 = logp16.detach().float().requires_grad_()
    loss32, metrics32 = policy_loss(logp32, old_logp.bfloat16().float(), adv.bfloat16().float(), mask, algo=algo)
    assert loss16.dtype == torch.float32
    torch.testing.assert_close(loss16, loss32, rtol=1e-6, atol=1e-7)
    grad16 = grad_of(loss16, logp16)
    assert grad16.dtype == torch.bfloat16
    torch.testing.assert_close(grad16, grad_of(loss32, logp32).bfloat16())
    assert metrics16 == pytest.approx(metrics32)


@pytest.mark.parametrize("algo", list(POLICY_LOSSES))
def test_extreme_ratios_empty_masks_and_zero_advantages_stay_finite(algo):
    logp = torch.tensor([[0.0, -1000.0, -1.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    old_logp = torch.tensor([[-1000.0, 0.0, -1.0], [-1.0, -1.0, -1.0]])
    for adv, mask in (
        (torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 1], [1, 1, 0]])),  # w = e^±20 after the clamp
        (torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 1], [0, 0, 0]])),  # one empty sequence
        (torch.tensor([1.0, -1.0]), torch.zeros(2, 3)),  # nothing to learn from
        (torch.zeros(2), torch.ones(2, 3)),  # all advantages zero
    ):
        for agg in AGGREGATIONS:
            loss, metrics = policy_loss(
                logp, old_logp, adv, mask, algo=algo, agg=agg, max_new_tokens=3, ref_logp=old_logp, beta=0.01
            )
            grad = grad_of(loss, logp)
            assert torch.isfinite(loss) and torch.isfinite(grad).all()
            assert all(math.isfinite(v) for v in metrics.values())
            if not mask.any():
                assert loss.item() == 0 and grad.abs().sum() == 0 and metrics["ratio/min"] == 1.0
    _, metrics = policy_loss(logp, old_logp, torch.ones(2), torch.ones(2, 3), algo=algo)
    assert metrics["ratio/max"] == pytest.approx(math.exp(LOG_RATIO_LIMIT), rel=1e-6)
    assert metrics["ratio/min"] == pytest.approx(math.exp(-LOG_RATIO_LIMIT), rel=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("algo", list(POLICY_LOSSES))
def test_cuda_matches_cpu(algo):
    logp, old_logp, adv, mask = random_batch(seed=9)
    loss, metrics = policy_loss(logp, old_logp, adv, mask, algo=algo)
    logp_gpu = logp.detach().cuda().bfloat16().float().requires_grad_()
    loss_gpu, metrics_gpu = policy_loss(
        logp_gpu.bfloat16(), old_logp.cuda().bfloat16(), adv.cuda(), mask.cuda(), algo=algo
    )
    logp_cpu = logp.detach().bfloat16().float().requires_grad_()
    loss_cpu, metrics_cpu = policy_loss(logp_cpu.bfloat16(), old_logp.bfloat16(), adv, mask, algo=algo)
    torch.testing.assert_close(loss_gpu.cpu(), loss_cpu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_of(loss_gpu, logp_gpu).cpu(), grad_of(loss_cpu, logp_cpu), rtol=1e-3, atol=1e-6)
    assert metrics_gpu == pytest.approx(metrics_cpu, rel=1e-4, abs=1e-6)


# ------------------------------------------------------------------ validation


def test_bad_names_and_parameters_are_value_errors_that_say_which():
    logp, old_logp, adv, mask = random_batch(seed=10)
    cases = [
        ({"algo": "ppo"}, "grpo, dapo, atr"),
        ({"agg": "mean"}, "token-mean"),
        ({"algo": "grpo", "eps": 1.5}, "eps"),
        ({"algo": "atr", "max_kl3": -1}, "max_kl3"),
        ({"algo": "atr", "delta": 0.1}, "delta"),
        ({"algo": "kl-band", "eps": 0.1}, "'eps'.*delta, dual_clip"),
        ({"algo": "tv-band", "delta": 0}, "delta"),
        ({"algo": "gspo", "eps_low": 2}, "eps_low"),
        ({"algo": "cispo", "eps_high": -1}, "eps_high"),
        ({"algo": "divergence", "measure": "tv"}, "ratio, kl1, kl2, kl3, reverse-kl3"),
        ({"beta": 0.1}, "ref_logp"),
        ({"entropy_coef": 0.1}, "entropy"),
        ({"ref_logp": old_logp, "kl_estimator": "k4"}, "k1, k2, k3"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            policy_loss(logp, old_logp, adv, mask, **kwargs)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old_logp, adv[:3], mask)
    with pytest.raises(ValueError, match="old_logp"):
        policy_loss(logp, old_logp[:, :3], adv, mask)
