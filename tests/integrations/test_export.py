"""`atrctl export`: the snippets that train a loss inside TRL or verl."""

import pytest

from atrctl.cli import main
from atrctl.core.divergence import equivalent_clip, trust_region
from atrctl.errors import UserError
from atrctl.experiments.arms import parse_arm
from atrctl.integrations.export import constant_region, export


def overrides(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_verl_gets_the_clip_range_and_no_dual_clip():
    values = overrides(export(parse_arm("atr:max_kl3=0.05"), "verl"))
    eps_low, eps_high = equivalent_clip(0.05)
    assert float(values["actor_rollout_ref.actor.clip_ratio_low"]) == eps_low  # repr round-trips exactly
    assert float(values["actor_rollout_ref.actor.clip_ratio_high"]) == eps_high
    assert values["actor_rollout_ref.actor.policy_loss.loss_mode"] == "vanilla"
    assert values["actor_rollout_ref.actor.loss_agg_mode"] == "token-mean"
    assert float(values["actor_rollout_ref.actor.clip_ratio_c"]) >= 1e9


@pytest.mark.parametrize("text", ["grpo:eps=0.3", "dapo", "kl2:delta=0.05", "reverse-kl3"])
def test_every_constant_region_exports_its_interval(text):
    arm = parse_arm(text)
    low, high = constant_region(arm)
    values = overrides(export(arm, "verl"))
    assert 1 - float(values["actor_rollout_ref.actor.clip_ratio_low"]) == pytest.approx(low, abs=1e-15)
    assert 1 + float(values["actor_rollout_ref.actor.clip_ratio_high"]) == pytest.approx(high, abs=1e-15)
    assert (low, high) == trust_region(arm.loss, **dict(arm.params))


def test_losses_that_are_not_one_clip_range():
    for text in ("tv-band:delta=0.1", "gspo", "cispo", "grpo:dual_clip=3"):
        arm = parse_arm(text)
        assert constant_region(arm) is None
        assert f"atrctl_loss={arm.loss!r}" in export(arm, "trl")
    band = export(parse_arm("tv-band:delta=0.1"), "verl")
    assert "register('tv-band:delta=0.1')" in band
    assert overrides(band) == {"'actor_rollout_ref.actor.policy_loss.loss_mode": '"tv-band:delta=0.1"\'',
                               "actor_rollout_ref.actor.loss_agg_mode": "token-mean"}  # fmt: skip
    assert 'loss_mode="grpo:dual_clip=3"' in export(parse_arm("grpo:dual_clip=3"), "verl")
    gspo = export(parse_arm("gspo:eps_high=1e-3"), "verl")  # verl's own gspo, with the arm's parameters
    assert "loss_mode=gspo\n" in gspo and "clip_ratio_high=0.001\n" in gspo
    with pytest.raises(UserError, match="choose one of trl, verl"):
        export(parse_arm("atr"), "openrlhf")
    with pytest.raises(UserError, match="not recipe keys"):
        export(parse_arm("atr:algo.minibatches=2"), "trl")


def test_the_command_prints_the_snippet_and_refuses_in_one_line(capsys):
    assert main(["export", "--to", "verl", "--max-kl3", "0.05"]) == 0
    assert f"clip_ratio_low={equivalent_clip(0.05)[0]!r}" in capsys.readouterr().out
    assert main(["export", "grpo:eps=0.1", "--eps", "0.3", "--to", "verl"]) == 0  # the arm's own value wins
    assert "clip_ratio_high=0.1" in capsys.readouterr().out
    assert main(["export", "cispo", "--to", "verl"]) == 0
    assert "policy_loss.loss_mode=cispo\n" in capsys.readouterr().out
    assert main(["export", "atr:max_kl3=-1"]) == 2
    assert "max_kl3" in capsys.readouterr().err
    assert main(["export", "grpo", "--max-kl3", "0.05"]) == 2  # a flag the loss does not take is not ignored
    assert "grpo takes no max_kl3" in capsys.readouterr().err
    assert main(["export", "tv-band:delta=-1"]) == 2  # values are checked, not only names
    assert "delta must be" in capsys.readouterr().err
    assert main(["export", "gspo", "--eps-high", "5e-4", "--to", "verl"]) == 0  # the flag reaches verl's setting
    assert "clip_ratio_high=0.0005\n" in capsys.readouterr().out
