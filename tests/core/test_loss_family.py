"""The peers' family (`atrctl.core.loss_family`) against the peers' own code where it is installed (verl 0.9.1's
policy losses, TRL 1.16's off-policy sequence mask), and against hand-computed cases where it is not.

One hand-made batch makes every branch bind: both signs of A, ratios from 0.05 to 20 at sampling probabilities
from 0.01 to 0.95, and padding.  Loss and gradient must agree within 1e-6, for each aggregation both support, at
the peer's default settings and at one other.  Where atrctl differs on purpose, the test pins the difference.
"""

import math

import pytest
import torch

from atrctl.core import loss_family
from atrctl.core.bands import kl_band_bounds, tv_band_bounds
from atrctl.core.losses import policy_loss
from atrctl.core.tokens import prepare_tokens
from atrctl.experiments.arms import parse_arm
from atrctl.integrations.export import VERL_NATIVE, export

TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}
AGGS = ["token-mean", "seq-mean-token-mean"]


def batch(empty_row: bool = False):
    """8 rows × 12 tokens: w from 0.05 to 20, p_old from 0.01 to 0.95 (lowered where w would take p past 0.95),
    A of both signs, rows of lengths 12 down to 3 (or one row without tokens)."""
    generator = torch.Generator().manual_seed(0)
    rows, length = 8, 12
    ratio = torch.logspace(math.log10(0.05), math.log10(20), rows * length)
    ratio = ratio[torch.randperm(rows * length, generator=generator)]
    p_old = torch.linspace(0.01, 0.95, rows * length)[torch.randperm(rows * length, generator=generator)]
    p_old = torch.minimum(p_old, 0.95 / ratio)  # p = p_old·w stays below 1
    old = p_old.log().view(rows, length)
    logp = old + ratio.log().view(rows, length)
    advantages = torch.tensor([1.5, -1.2, 0.7, -0.4, 2.0, -2.0, 0.3, -0.9])[:, None].expand(rows, length)
    lengths = torch.tensor([12, 11, 9, 7, 12, 5, 3, 0 if empty_row else 8])
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    return old, logp.requires_grad_(), advantages, mask


def ours(name, agg, **params):
    old, logp, advantages, mask = batch()
    loss, metrics = policy_loss(logp, old, advantages, mask, algo=name, agg=agg, max_new_tokens=12, **params)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad, metrics


def assert_same(mine, theirs):
    (loss, grad, _), (their_loss, their_grad) = mine, theirs
    assert abs(their_loss) > 1e-3 and loss == pytest.approx(their_loss, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(grad, their_grad, **TOLERANCE)


def test_every_branch_binds_in_the_batch():
    old, logp, advantages, mask = batch()
    ratio = (logp - old).exp()[mask.bool()]
    assert ratio.min() < 0.06 and ratio.max() > 15
    moved = (logp.exp() - old.exp())[mask.bool()]
    assert moved.max() > 0.3 and moved.min() < -0.3  # DPPO's TV mask binds on both sides
    assert (advantages[mask.bool()] > 0).any() and (advantages[mask.bool()] < 0).any()


# ------------------------------------------------------------------ verl 0.9.1


verl = pytest.importorskip("verl.trainer.ppo.core_algos")


def actor(**fields):
    from verl.workers.config import ActorConfig

    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)


def theirs(name, agg, config):
    old, logp, advantages, mask = batch()
    loss, _ = verl.get_policy_loss_fn(name)(old, logp, advantages, mask, agg, config)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad


def policy_config(**fields):
    from verl.workers.config import PolicyLossConfig

    return PolicyLossConfig(**fields)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    ("name", "params", "fields"),
    [
        ("dppo-tv", {"tis_cap": 3.0}, {}),  # verl's defaults: δ = clip_ratio 0.2, c = clip_ratio_c 3
        (
            "dppo-tv",
            {"delta_low": 0.1, "delta_high": 0.3},
            {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3, "clip_ratio_c": 20.0},
        ),  # fmt: skip
        ("dppo-kl", {"delta_low": 0.2, "delta_high": 0.2, "tis_cap": 3.0}, {}),
        ("dppo-kl", {}, {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 20.0}),  # atrctl's
        ("gpg", {}, {}),
        ("cispo", {"eps_low": 0.2, "eps_high": 0.2}, {}),
        ("cispo", {}, {"clip_ratio_low": 1.0, "clip_ratio_high": 0.28}),
        ("gspo", {"eps_low": 0.2, "eps_high": 0.2}, {}),
        ("gspo", {}, {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}),
    ],
)
def test_a_loss_verl_implements_gives_verls_loss_and_gradient(name, params, fields, agg):
    peer = {"dppo-tv": "dppo_tv", "dppo-kl": "dppo_kl"}.get(name, name)
    assert_same(ours(name, agg, **params), theirs(peer, agg, actor(**fields)))


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(("params", "fields"), [({"eps": 0.2}, {}), ({"eps": 0.3}, {"clip_ratio": 0.3,
                         "clip_ratio_low": 0.3, "clip_ratio_high": 0.3, "clip_ratio_c": 10.0})])  # fmt: skip
def test_grpo_with_verls_dual_clip_is_verls_vanilla_and_atrctls_default_has_none(params, fields, agg):
    """verl's vanilla loss caps an A < 0 token's loss at c·|A| (clip_ratio_c, default 3); atrctl's grpo takes that
    dual clip only when asked, since it removes the gradient of exactly the tokens a trust region should bound."""
    their = theirs("vanilla", agg, actor(**fields))
    c = fields.get("clip_ratio_c", 3.0)
    assert_same(ours("grpo", agg, dual_clip=c, **params), their)
    plain = ours("grpo", agg, **params)
    assert plain[0] != pytest.approx(their[0], rel=1e-3)  # the difference, pinned: this batch has w > c with A < 0


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(("tau_pos", "tau_neg"), [(1.0, 1.05), (2.0, 0.5)])
def test_sapo_is_verls_under_seq_mean_token_mean_which_verl_always_uses(tau_pos, tau_neg, agg):
    their = theirs("sapo", agg, actor(tau_pos=tau_pos, tau_neg=tau_neg))  # verl ignores agg for sapo
    assert_same(ours("sapo", "seq-mean-token-mean", tau_pos=tau_pos, tau_neg=tau_neg), their)
    if agg == "token-mean":  # atrctl honours the recipe's aggregation
        assert ours("sapo", agg, tau_pos=tau_pos, tau_neg=tau_neg)[0] != pytest.approx(their[0], rel=1e-3)


@pytest.mark.parametrize(("params", "clip"), [({"eps_low": 0.2, "eps_high": 0.2}, 0.2), ({}, 0.4)])
def test_gmpo_is_verls_geo_mean_as_a_sequence_mean(params, clip):
    """verl's geo_mean takes no aggregation (a mean over rows); atrctl's seq-mean-token-mean is that mean."""
    their = theirs("geo_mean", "token-mean", actor(clip_ratio_low=clip, clip_ratio_high=clip))
    assert_same(ours("gmpo", "seq-mean-token-mean", **params), their)


def test_gmpo_leaves_out_a_row_without_tokens_where_verl_counts_it():
    old, logp, advantages, mask = batch(empty_row=True)
    their, _ = verl.get_policy_loss_fn("geo_mean")(
        old, logp, advantages, mask, "token-mean", actor(clip_ratio_low=0.4, clip_ratio_high=0.4)
    )
    mine, _ = policy_loss(logp, old, advantages, mask, algo="gmpo", agg="seq-mean-token-mean")
    assert their.item() == pytest.approx(mine.item() * 7 / 8, rel=1e-6)  # 8 rows, one without tokens


def global_draw(monkeypatch):
    """Make clip-cov draw as verl does, from torch's global generator, so both select the same tokens."""
    monkeypatch.setattr(loss_family, "_selection_generator", lambda tokens: torch.default_generator)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    ("params", "fields"),
    [
        ({}, {}),  # verl's defaults: ε 0.2, share 2e-4 (one token here), covariance in (1, 5)
        ({"share": 0.1, "cov_low": 0.0, "cov_high": 2.0, "eps_high": 0.28},
         {"clip_ratio_high": 0.28, "policy_loss": {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.0, "clip_cov_ub": 2.0}}),
    ],
)  # fmt: skip
def test_clip_cov_with_the_selection_fixed_is_verls(monkeypatch, params, fields, agg):
    global_draw(monkeypatch)
    fields = dict(fields)  # the parameters are shared by both aggregations' runs
    config = actor(policy_loss=policy_config(**fields.pop("policy_loss", {})), **fields)
    torch.manual_seed(7)
    their = theirs("clip_cov", agg, config)
    torch.manual_seed(7)
    mine = ours("clip-cov", agg, **params)
    assert_same(mine, their)
    assert mine[2]["clip/cov"] > 0  # the selection removed some gradient


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize(
    ("params", "fields"), [({}, {}), ({"share": 0.1, "coef": 1.0}, {"kl_cov_ratio": 0.1, "ppo_kl_coef": 1.0})]
)
def test_kl_cov_is_verls(params, fields, agg):
    mine = ours("kl-cov", agg, **params)
    assert_same(mine, theirs("kl_cov", agg, actor(policy_loss=policy_config(**fields))))
    assert mine[2]["clip/region"] > 0


def test_clip_covs_draw_is_the_same_for_the_same_micro_batch():
    first, second = ours("clip-cov", "token-mean", share=0.1, cov_low=0.0), ours("clip-cov", "token-mean", share=0.1,
                                                                                cov_low=0.0)  # fmt: skip
    torch.testing.assert_close(first[1], second[1], rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(VERL_NATIVE))
def test_an_export_to_verl_trains_verls_own_loss_with_the_same_numbers(name, monkeypatch):
    """`atrctl export <loss> --to verl` for a loss verl has: its overrides, read into verl's ActorConfig, give
    verl's loss function atrctl's loss and gradient (non-default parameters, so a dropped setting shows)."""
    params = {"sapo": {"tau_neg": 2.0}, "gmpo": {"eps_high": 0.3}, "dppo-tv": {"delta_high": 0.3, "tis_cap": 5.0},
              "dppo-kl": {"tis_cap": 5.0}, "clip-cov": {"share": 0.1, "cov_low": 0.0}, "kl-cov": {"coef": 0.5},
              "gspo": {"eps_high": 0.2}, "cispo": {"eps_low": 0.3}}.get(name, {})  # fmt: skip
    text = export(parse_arm(":".join([name, ",".join(f"{k}={v}" for k, v in params.items())]) if params else name),
                  "verl")  # fmt: skip
    fields, policy, mode, agg = {}, {}, None, None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, value = line.removeprefix("actor_rollout_ref.actor.").split("=")
        if key == "policy_loss.loss_mode":
            mode = value
        elif key == "loss_agg_mode":
            agg = value
        elif key.startswith("policy_loss."):
            policy[key.removeprefix("policy_loss.")] = float(value)
        else:
            fields[key] = float(value)
    config = actor(policy_loss=policy_config(**policy), **fields)
    ours_agg = "seq-mean-token-mean" if name in ("sapo", "gmpo") else agg
    if name == "clip-cov":
        global_draw(monkeypatch)
    torch.manual_seed(3)
    their = theirs(mode, agg, config)
    torch.manual_seed(3)
    assert_same(ours(name, ours_agg, **params), their)


# ------------------------------------------------------------------ the relations the docstrings state


@pytest.mark.parametrize(
    ("dppo", "band", "bounds", "delta"),
    [("dppo-tv", "tv-band", tv_band_bounds, 0.2), ("dppo-kl", "kl-band", kl_band_bounds, 0.05)],
)
def test_dppos_mask_has_the_gradient_of_the_band_clip_below_its_cap(dppo, band, bounds, delta):
    """A mask on log π with sg(w) and a clip of the surrogate on the same region: the same gradient, token by token,
    wherever w <= tis_cap, except at tokens within float error of the region's edge."""
    old, logp, advantages, mask = batch()
    grads = []
    for name, params in ((dppo, {"delta_low": delta, "delta_high": delta, "tis_cap": 1e6}), (band, {"delta": delta})):
        loss, _ = policy_loss(logp, old, advantages, mask, algo=name, agg="token-mean", **params)
        grads.append(torch.autograd.grad(loss, logp)[0])
    low, high = bounds(old, delta)
    ratio = (logp - old).exp().detach()
    edge = torch.minimum((ratio - low).abs() / low, (ratio - high).abs() / high) < 1e-5
    assert int(edge.sum()) <= 1
    torch.testing.assert_close(grads[0][~edge], grads[1][~edge], **TOLERANCE)
    assert (grads[0] == 0).sum() > (mask == 0).sum()  # the region removed some gradient


@pytest.mark.parametrize("delta", [4.0, 2.5])
def test_two_sided_is_dapo_with_its_dual_clip(delta):
    for agg in AGGS:
        mine = ours("two-sided", agg, eps_low=0.2, eps_high=0.28, delta=delta)
        dual = ours("dapo", agg, eps_low=0.2, eps_high=0.28, dual_clip=delta)
        assert_same(mine, (dual[0], dual[1]))
        assert mine[2]["clip/dual"] == dual[2]["clip/dual"] > 0


def test_two_sided_by_hand():
    """TRL's formula, -min(min(w, δ)·A, clip(w, 1-ε, 1+ε)·A), at one token per branch (δ = 4, ε = 0.2)."""
    logp = torch.log(torch.tensor([[0.5, 1.5, 6.0, 0.5, 1.1, 6.0]])).requires_grad_()
    old = torch.zeros(1, 6)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])
    tokens = prepare_tokens(logp, old, adv, torch.ones(1, 6))
    loss, _ = loss_family._two_sided(tokens)
    expected = [-0.5, -1.2, -1.2, 0.8, 1.1, 4.0]  # A > 0: min(w, 1.2); A < 0: max(w, 0.8) capped at δ
    torch.testing.assert_close(loss, torch.tensor([expected]))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.0, 0.0, 0.0, 1.1, 0.0]]))


def test_two_sided_refuses_a_delta_inside_the_clip():
    with pytest.raises(ValueError, match="delta must exceed 1 \\+ eps_high"):
        ours("two-sided", "token-mean", delta=1.1)


# ------------------------------------------------------------------ TRL 1.16


def test_opsm_drops_the_sequences_trls_mask_drops():
    trl = pytest.importorskip("trl")
    old, logp, advantages, mask = batch()
    threshold = 0.5
    keep = trl.GRPOTrainer.get_off_policy_mask(advantages[:, :1], logp.detach(), old, mask, threshold)  # [B, 1]
    mine = ours("opsm", "token-mean", max_kl=threshold)
    plain = ours("dapo", "token-mean", eps_low=0.2, eps_high=0.2)
    assert 0 < keep.mean() < 1  # some sequences dropped, some kept
    kept_rows = keep[:, 0].bool()
    torch.testing.assert_close(mine[1][kept_rows], plain[1][kept_rows], rtol=0, atol=0)
    assert (mine[1][~kept_rows] == 0).all()
    assert mine[2]["clip/sequence"] == pytest.approx(float((mask * (1 - keep)).sum() / mask.sum()), abs=1e-7)


# ------------------------------------------------------------------ by hand, where no peer has it


def test_topr_by_hand():
    """A sequence with A >= 0: plain -A·logp; A < 0: weight min(π(y)/π_old(y), 1) on -A·logp."""
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.8], [0.4, 0.5]])).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.5], [0.3, 0.4], [0.5, 0.5]]))
    adv = torch.tensor([[2.0, 2.0], [-1.0, -1.0], [-1.0, -1.0]])
    tokens = prepare_tokens(logp, old, adv, torch.ones(3, 2))
    loss, metrics = loss_family._topr(tokens)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # sequence ratios 2, 6 and 0.8: weights 1 (A > 0), min(6, 1) = 1 and 0.8
    torch.testing.assert_close(grad, torch.tensor([[-2.0, -2.0], [1.0, 1.0], [0.8, 0.8]]))
    assert metrics["clip/low"].item() == pytest.approx(2 / 6)  # the A < 0 sequence with ratio 6 > 2·cap


def test_gppo_keeps_a_bounded_gradient_where_dapo_has_none():
    """w = 2 with A = 1 (above 1.28): dapo's gradient is 0, GPPO's -(1 + 0.28)·A; w = 0.5 with A = -1 (below 0.8):
    -(1 - 0.2)·A; w = 5 with A = -1: past the dual clip 3, 0."""
    logp = torch.log(torch.tensor([[2.0, 0.5, 5.0, 1.1]]) * 0.1).requires_grad_()
    old = torch.full((1, 4), math.log(0.1))
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    tokens = prepare_tokens(logp, old, adv, torch.ones(1, 4))
    loss, _ = loss_family._gppo(tokens)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8, 3.0, -1.1]]))  # the clip-higher values
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[-1.28, 0.8, 0.0, -1.1]]))


def test_sapos_gate_is_the_policy_gradient_at_w_1_and_half_of_it_at_its_clip_edge():
    tau = 1.0
    edge = 1 + loss_family.HALF_WEIGHT / tau
    logp = torch.log(torch.tensor([[1.0, edge]]) * 0.1).requires_grad_()
    tokens = prepare_tokens(logp, torch.full((1, 2), math.log(0.1)), torch.ones(1, 2), torch.ones(1, 2))
    loss, _ = loss_family._sapo(tokens, tau_pos=tau)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -0.5 * edge]]))  # -4σ(1-σ)·w·A


@pytest.mark.parametrize("arm", ["sapo:tau_neg=2.0", "two-sided:eps_high=0.28,delta=3.0", "opsm:max_kl=0.3"])
def test_an_export_to_trl_is_a_grpo_config_with_the_losss_settings(arm, monkeypatch):
    import functools

    trl = pytest.importorskip("trl")
    monkeypatch.setattr(trl, "GRPOConfig", functools.partial(trl.GRPOConfig, use_cpu=True))  # this CPU has no bf16
    namespace = {}
    exec(export(parse_arm(arm), "trl"), namespace)  # noqa: S102 - the snippet a user pastes
    config = namespace["config"]
    expected = {
        "sapo:tau_neg=2.0": {"loss_type": "sapo", "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 2.0},
        "two-sided:eps_high=0.28,delta=3.0": {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "delta": 3.0},
        "opsm:max_kl=0.3": {"loss_type": "dapo", "epsilon": 0.2, "off_policy_mask_threshold": 0.3},
    }[arm]
    assert {key: getattr(config, key) for key in expected} == expected


def test_the_torch_free_intervals_hold_the_losses_own_defaults():
    """plot-bounds reads `family_intervals` without torch: its defaults must be the losses' (a changed default in
    a loss fails here), and its intervals those the losses clip with."""
    from atrctl.core.family_intervals import FAMILY_INTERVALS
    from atrctl.core.losses import loss_parameters, ratio_interval

    for name, (defaults, _) in FAMILY_INTERVALS.items():
        assert {key: loss_parameters(name)[key] for key in defaults} == defaults, name
    assert ratio_interval("gppo", {"eps_high": 0.5}) == pytest.approx((0.8, 1.5))
    assert ratio_interval("gmpo", {}) == pytest.approx((math.exp(-0.4), math.exp(0.4)))
    assert ratio_interval("sapo", {}) is None and ratio_interval("tv-band", {}) is None
    old, logp, advantages, mask = batch()  # gppo's value is dapo's clip on that interval
    gppo, _ = policy_loss(logp, old, advantages, mask, algo="gppo", eps_high=0.5, dual_clip=None)
    dapo, _ = policy_loss(logp, old, advantages, mask, algo="dapo", eps_high=0.5)
    assert gppo.item() == pytest.approx(dapo.item(), rel=1e-6)
