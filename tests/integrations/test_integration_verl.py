"""atrctl's losses in verl's policy-loss registry, on verl's own loss code (installed without its cluster stack)."""

import pytest
import torch

from atrctl.core.divergence import equivalent_clip

core = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.workers.config import ActorConfig  # noqa: E402

from atrctl.integrations.verl import register  # noqa: E402


def actor(**fields):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)


def batch(seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows, length = 6, 9
    old = -3 * torch.rand(rows, length, generator=generator)
    logp = (old + 0.7 * torch.randn(rows, length, generator=generator)).requires_grad_()  # w from ~0.1 to ~10
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, length)
    mask = (torch.arange(length)[None] < torch.tensor([9, 4, 7, 1, 9, 6])[:, None]).float()
    return old, logp, advantages, mask


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_atr_through_verls_registry_equals_vanilla_with_the_equivalent_clip(agg):
    assert "atr" in register() and "gspo" not in register()  # verl's own gspo is left alone
    eps_low, eps_high = equivalent_clip(0.1)
    old, logp, advantages, mask = batch()
    theirs, their_metrics = core.get_policy_loss_fn("vanilla")(
        old, logp, advantages, mask, agg, actor(clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=1e9)
    )
    (their_grad,) = torch.autograd.grad(theirs, logp)
    ours, metrics = core.get_policy_loss_fn("atr")(old, logp, advantages, mask, agg, actor())
    (our_grad,) = torch.autograd.grad(ours, logp)
    assert abs(theirs.item()) > 1e-3 and ours.item() == pytest.approx(theirs.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-6, atol=1e-7)
    assert metrics["actor/atrctl/clip/low"] > 0 and metrics["actor/atrctl/clip/high"] > 0
    removed = metrics["actor/atrctl/clip/low"] + metrics["actor/atrctl/clip/high"]  # verl counts both in one
    assert removed == pytest.approx(their_metrics["actor/pg_clipfrac"], abs=1e-6)


def vanilla_loss(max_kl3, old, logp, advantages, mask):
    eps_low, eps_high = equivalent_clip(max_kl3)
    config = actor(clip_ratio_low=eps_low, clip_ratio_high=eps_high, clip_ratio_c=1e9)
    return core.get_policy_loss_fn("vanilla")(old, logp, advantages, mask, "token-mean", config)[0].item()


def test_an_arm_label_is_a_loss_mode_that_carries_its_parameters():
    from omegaconf import OmegaConf

    assert register("atr:max_kl3=0.05", "gspo:eps_low=1e-4")[-2:] == ["atr:max_kl3=0.05", "gspo:eps_low=0.0001"]
    old, logp, advantages, mask = batch(1)
    atr = core.get_policy_loss_fn("atr:max_kl3=0.05")
    assert atr(old, logp, advantages, mask, "token-mean", actor())[0].item() == pytest.approx(
        vanilla_loss(0.05, old, logp, advantages, mask), rel=1e-6
    )
    assert core.get_policy_loss_fn("atr")(old, logp, advantages, mask, "token-mean", actor())[
        0
    ].item() == pytest.approx(
        vanilla_loss(0.1, old, logp, advantages, mask), rel=1e-6
    )  # the plain name keeps atrctl's default
    dict_config = OmegaConf.create({"policy_loss": {"loss_mode": "atr", "max_kl3": 0.2}, "global_batch_info": {}})
    assert atr(old, logp, advantages, mask, "token-mean", dict_config)[0].item() == pytest.approx(
        vanilla_loss(0.2, old, logp, advantages, mask), rel=1e-6
    )  # a DictConfig's own entry wins


@pytest.mark.parametrize("name", ["tv-band", "kl-band", "kl2", "reverse-kl3", "divergence"])
def test_the_band_and_divergence_losses_run_in_verl(name):
    register()
    old, logp, advantages, mask = batch(2)
    loss, metrics = core.get_policy_loss_fn(name)(old, logp, advantages, mask, "token-mean", actor())
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and grad.abs().sum() > 0 and grad[mask == 0].abs().sum() == 0
    assert 0 <= metrics["actor/atrctl/clip/low"] <= 1 and metrics["actor/atrctl/kl3/mean"] > 0


def test_register_refuses_an_unknown_loss_or_a_bad_value():
    from atrctl.errors import UserError

    with pytest.raises(UserError, match="'ppo' is not a loss"):
        register("ppo:eps=0.1")
    with pytest.raises(ValueError, match="max_kl3"):
        register("atr:max_kl3=-1")
    with pytest.raises(UserError, match="not 'atr:algo.minibatches=2'"):
        register("atr:algo.minibatches=2")
