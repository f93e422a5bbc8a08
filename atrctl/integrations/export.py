"""`atrctl export`: the settings that train an atrctl loss inside another trainer, as text to paste.

A constant trust region is one clip range in every PPO-style trainer: [l, u] becomes TRL's
epsilon = 1 − l / epsilon_high = u − 1 and verl's clip_ratio_low / clip_ratio_high, with the token-mean
aggregation atrctl defaults to.  A loss the trainer ships itself (verl's sapo, geo_mean, dppo_tv, …; TRL's
sapo, delta, off-policy mask) becomes its own settings (`VERL_NATIVE`, `TRL_NATIVE`; tests/core/test_loss_family.py
checks each mapping against the peer's loss).  Anything else (per-token bands, a dual clip) needs atrctl's own
loss inside the trainer: `atrctl.integrations.trl.AtrctlGRPOTrainer` for TRL, and for verl the loss registered
in verl's policy-loss registry by `atrctl.integrations.verl.register`.
"""

from __future__ import annotations

import math

from atrctl.core.losses import check_loss, constant_interval, loss_parameters
from atrctl.errors import UserError
from atrctl.experiments.arms import Arm

TARGETS = ("trl", "verl")

ACTOR = "actor_rollout_ref.actor"

# atrctl loss -> (verl's loss_mode, {atrctl parameter: verl actor setting}): the losses verl 0.9 implements itself.
VERL_NATIVE: dict[str, tuple[str, dict[str, str]]] = {
    "sapo": ("sapo", {"tau_pos": "tau_pos", "tau_neg": "tau_neg"}),
    "gmpo": ("geo_mean", {"eps_low": "clip_ratio_low", "eps_high": "clip_ratio_high"}),
    "dppo-tv": ("dppo_tv", {"delta_low": "clip_ratio_low", "delta_high": "clip_ratio_high", "tis_cap": "clip_ratio_c"}),
    "dppo-kl": ("dppo_kl", {"delta_low": "clip_ratio_low", "delta_high": "clip_ratio_high", "tis_cap": "clip_ratio_c"}),
    "clip-cov": (
        "clip_cov",
        {
            "eps_low": "clip_ratio_low",
            "eps_high": "clip_ratio_high",
            "share": "policy_loss.clip_cov_ratio",
            "cov_low": "policy_loss.clip_cov_lb",
            "cov_high": "policy_loss.clip_cov_ub",
        },
    ),  # fmt: skip
    "kl-cov": ("kl_cov", {"share": "policy_loss.kl_cov_ratio", "coef": "policy_loss.ppo_kl_coef"}),
    "gpg": ("gpg", {}),
    "gspo": ("gspo", {"eps_low": "clip_ratio_low", "eps_high": "clip_ratio_high"}),
    "cispo": ("cispo", {"eps_low": "clip_ratio_low", "eps_high": "clip_ratio_high"}),
}
VERL_AGGREGATION = {"sapo": "seq-mean-token-mean", "gmpo": "seq-mean-token-mean"}
"""What verl aggregates these by whatever loss_agg_mode says (sapo), or in effect (geo_mean's mean over rows)."""

# atrctl loss -> {GRPOConfig field: value or the atrctl parameter it takes}: what TRL 1.16's GRPOConfig trains itself.
TRL_NATIVE: dict[str, dict[str, object]] = {
    "sapo": {"loss_type": "sapo", "sapo_temperature_pos": "tau_pos", "sapo_temperature_neg": "tau_neg"},
    "two-sided": {"loss_type": "dapo", "epsilon": "eps_low", "epsilon_high": "eps_high", "delta": "delta"},
    "opsm": {
        "loss_type": "dapo",
        "epsilon": "eps_low",
        "epsilon_high": "eps_high",
        "off_policy_mask_threshold": "max_kl",
    },  # fmt: skip
}


def constant_region(arm: Arm) -> tuple[float, float] | None:
    """[l, u] of an arm whose loss is a constant trust region without a dual clip, else None.  A region without
    an upper bound (kl1's) is no clip range either: epsilon_high = inf is not a number TRL's or verl's settings
    can be written with, so it runs as atrctl's own loss.  A lower bound of 0 is one (epsilon = 1)."""
    if dict(arm.params).get("dual_clip") is not None:
        return None
    region = constant_interval(arm.loss, dict(arm.params))
    return region if region is not None and region[1] < math.inf else None


def describe(arm: Arm, region: tuple[float, float] | None) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in _values(arm).items() if v is not None)
    where = f": ratio interval [{region[0]:.6f}, {region[1]:.6f}]" if region else ""
    return f"{arm.loss} ({shown}){where}" if shown else f"{arm.loss}{where}"


def export(arm: Arm, target: str) -> str:
    """The snippet for `target` ("trl": Python, "verl": Hydra overrides) that trains `arm`'s loss."""
    if target not in TARGETS:
        raise UserError(f"--to {target!r}: choose one of {', '.join(TARGETS)}")
    if arm.overrides:
        raise UserError(f"export takes a loss and its parameters, not recipe keys ({arm.overrides[0][0]})")
    try:
        check_loss(arm.loss, **dict(arm.params))  # bad values fail here
        region = constant_region(arm)
    except (ValueError, TypeError) as error:
        raise UserError(f"{arm.label}: {error}") from None
    if target == "trl":
        return _trl_native(arm) if arm.loss in TRL_NATIVE else _trl(arm, region)
    if region is not None:
        return _verl(arm, region)
    return _verl_native(arm) if arm.loss in VERL_NATIVE else _verl_registered(arm)


def _values(arm: Arm) -> dict[str, object]:
    """The arm's parameters over the loss's defaults."""
    return {**loss_parameters(arm.loss), **dict(arm.params)}


def _verl_native(arm: Arm) -> str:
    mode, settings = VERL_NATIVE[arm.loss]
    values = _values(arm)
    lines = [f"{ACTOR}.{setting}={values[name]!r}" for name, setting in settings.items()]
    agg = VERL_AGGREGATION.get(arm.loss, "token-mean")
    note = [f"# verl aggregates {mode} by {agg} whatever loss_agg_mode says"] if arm.loss in VERL_AGGREGATION else []
    head = f"# {describe(arm, None)}: verl's own {mode} (Hydra overrides for verl's trainer)"
    return (
        "\n".join([head, *note, f"{ACTOR}.policy_loss.loss_mode={mode}", f"{ACTOR}.loss_agg_mode={agg}", *lines]) + "\n"
    )


def _trl_native(arm: Arm) -> str:
    values = _values(arm)
    fields = {field: values[taken] if taken in values else taken for field, taken in TRL_NATIVE[arm.loss].items()}
    body = "\n".join(f"    {field}={value!r}," for field, value in fields.items())
    return f"""from trl import GRPOConfig

# {describe(arm, None)}: TRL's own settings{" (TRL aggregates sapo per sequence)" if arm.loss == "sapo" else ""}
config = GRPOConfig(
    output_dir="grpo-{arm.loss}",  # and your other settings
{body}
)
"""


def _trl(arm: Arm, region: tuple[float, float] | None) -> str:
    if region is not None:
        low, high = region
        return f"""from trl import GRPOConfig

# {describe(arm, region)}, as TRL's clip range
config = GRPOConfig(
    output_dir="grpo-{arm.loss}",  # and your other settings
    loss_type="dapo",  # token-mean, atrctl's default aggregation
    epsilon={1.0 - low!r},  # 1 - l
    epsilon_high={high - 1.0!r},  # u - 1
)
"""
    params = {k: v for k, v in arm.params}
    return f"""from trl import GRPOConfig

from atrctl.integrations.trl import AtrctlGRPOTrainer

# {describe(arm, None)}: not one clip range, so atrctl's own loss runs inside TRL's trainer
config = GRPOConfig(output_dir="grpo-{arm.loss}")  # and your other settings; its epsilon is not used
trainer = AtrctlGRPOTrainer(
    model=model, reward_funcs=reward_funcs, args=config, train_dataset=dataset,  # yours
    atrctl_loss={arm.loss!r}, loss_params={params!r},
)
"""


def _verl_registered(arm: Arm) -> str:
    return f"""# {describe(arm, None)}: not one clip range, so atrctl's own loss runs inside verl.
# 1. a module verl can import, e.g. atrctl_losses.py:
#        from atrctl.integrations.verl import register
#        register({arm.label!r})
# 2. VERL_USE_EXTERNAL_MODULES=atrctl_losses in the environment (verl imports it in every process)
# 3. the overrides (the loss mode is the arm's label, quoted for Hydra; in a YAML file: loss_mode: "{arm.label}"):
'actor_rollout_ref.actor.policy_loss.loss_mode="{arm.label}"'
actor_rollout_ref.actor.loss_agg_mode=token-mean
"""


def _verl(arm: Arm, region: tuple[float, float]) -> str:
    low, high = region
    return f"""# {describe(arm, region)}, as verl's clip range (Hydra overrides for verl's trainer)
actor_rollout_ref.actor.policy_loss.loss_mode=vanilla
actor_rollout_ref.actor.loss_agg_mode=token-mean
actor_rollout_ref.actor.clip_ratio_low={1.0 - low!r}
actor_rollout_ref.actor.clip_ratio_high={high - 1.0!r}
# verl's dual clip (clip_ratio_c, default 3) also caps the loss of A < 0 tokens with w > c; atrctl's {arm.loss}
# has none, so set it out of reach to train the same loss:
actor_rollout_ref.actor.clip_ratio_c=1000000000.0
"""
