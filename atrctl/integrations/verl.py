"""atrctl's losses inside verl's policy-loss registry (verl >= 0.9).

    from atrctl.integrations.verl import register
    register()                            # atr, grpo, dapo, kl2, reverse-kl3, divergence, tv-band, kl-band
    register("atr:max_kl3=0.05", "tv-band:delta=0.1")     # also these arms, under their labels

after which verl's `actor_rollout_ref.actor.policy_loss.loss_mode=atr` selects ATR-GRPO at atrctl's default
δ, and `loss_mode='atr:max_kl3=0.05'` at δ = 0.05: the loss mode is the one field of verl's (structured,
fixed) policy-loss config that takes any value, so an arm's label carries its parameters there.  verl imports
the modules named in VERL_USE_EXTERNAL_MODULES in every process at start-up, so a module of yours that calls
`register` goes there.  Where the actor config is a DictConfig its `policy_loss` entries of a parameter's name
are read too (they win over the label's).  The per-token loss is atrctl's (`losses.token_losses`); the
aggregation is verl's own `agg_loss` with its global batch counts, so data-parallel scaling is verl's.  Names
verl already has (gspo, cispo) keep verl's implementation; an arm of them (`gspo:eps_low=1e-4`) is atrctl's.
"""

from __future__ import annotations

from atrctl.core.loss_metrics import finish_metrics
from atrctl.core.losses import POLICY_LOSSES, check_loss, loss_parameters, token_losses
from atrctl.errors import UserError
from atrctl.integrations import require

WHAT = "atrctl.integrations.verl"
INSTALL = "pip install verl (or only its loss code: pip install --no-deps -r requirements/verl-loss.txt)"


def register(*arms: str) -> list[str]:
    """Add every atrctl loss verl does not already have to verl's policy-loss registry under its atrctl name,
    and each of `arms` (`LOSS:key=value,…`) under its label with its parameters; returns the names added
    (registering again replaces them).  Bad arms or values fail here, before verl trains."""
    from atrctl.experiments.arms import parse_arm

    core = require("verl.trainer.ppo.core_algos", INSTALL, WHAT)
    registry = core.POLICY_LOSS_REGISTRY
    ours = [name for name in POLICY_LOSSES if name not in registry or getattr(registry[name], "atrctl", False)]
    entries = [(name, name, {}) for name in ours]  # verl's own gspo and cispo stay
    for text in arms:
        arm = parse_arm(text)
        if arm.loss is None or arm.overrides:
            raise UserError(f"register takes losses with their parameters, e.g. atr:max_kl3=0.05; not {text!r}")
        entries.append((arm.label, arm.loss, dict(arm.params)))
    for _, loss, defaults in entries:
        check_loss(loss, **defaults)  # bad values fail here
    for label, loss, defaults in entries:
        core.register_policy_loss(label)(_verl_loss(loss, defaults, core.agg_loss))
    return [label for label, _, _ in entries]


def _verl_loss(name: str, defaults: dict, agg_loss):
    """verl's policy-loss signature around atrctl's loss `name`."""

    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):  # fmt: skip
        params = _parameters(name, defaults, config)
        out = token_losses(log_prob, old_log_prob, advantages, response_mask, algo=name, **params)
        per_token = out.loss if rollout_is_weights is None else out.loss * rollout_is_weights
        batch = dict(getattr(config, "global_batch_info", None) or {})
        loss = agg_loss(loss_mat=per_token, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **batch)
        metrics = {f"actor/atrctl/{k}": v for k, v in finish_metrics(out.metrics).items() if k != "loss"}
        return loss, metrics

    loss_fn.atrctl = True
    loss_fn.__name__ = f"atrctl_{name.replace('-', '_')}"
    return loss_fn


def _parameters(name: str, defaults: dict, config) -> dict:
    """The loss's parameters: the actor config's `policy_loss` entries of the same names, else `defaults`, else
    atrctl's (None, an unset optional parameter such as dual_clip, is left out)."""
    section = getattr(config, "policy_loss", None)
    params = {}
    for key, default in loss_parameters(name).items():
        value = defaults.get(key, default)
        if section is not None:
            given = section.get(key, None) if hasattr(section, "get") else getattr(section, key, None)
            value = value if given is None else given
        if value is not None:
            params[key] = value
    return params
