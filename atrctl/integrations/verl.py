"""atrctl's losses inside verl's policy-loss registry (verl >= 0.9).

    from atrctl.integrations.verl import register
    register()                                   # atr, grpo, dapo, kl2, reverse-kl3, divergence, tv-band, kl-band
    register(atr={"max_kl3": 0.05})              # with other default parameters

after which verl's `actor_rollout_ref.actor.policy_loss.loss_mode=atr` selects ATR-GRPO.  verl imports plugin
modules named in VERL_USE_EXTERNAL_MODULES at start-up, so a module of yours that calls `register` can be put
there.  A loss's parameters are read, by their atrctl names, from the actor's `policy_loss` config where it has
them (a DictConfig with `+actor_rollout_ref.actor.policy_loss.max_kl3=0.05`), else from `register`'s values,
else atrctl's defaults.  The per-token loss is atrctl's (`losses.token_losses`); aggregation is verl's own
`agg_loss` with its global batch counts, so data-parallel scaling is verl's.  Names verl already has (gspo,
cispo) keep verl's implementation.
"""

from __future__ import annotations

import torch

from atrctl.integrations import require
from atrctl.losses import POLICY_LOSSES, finish_metrics, loss_parameters, token_losses

WHAT = "atrctl.integrations.verl"
INSTALL = "pip install verl (or only its loss code: pip install --no-deps -r requirements/verl-loss.txt)"


def register(**parameters: dict) -> list[str]:
    """Add every atrctl loss verl does not already have to verl's policy-loss registry under its atrctl name,
    with `parameters[name]` as its defaults; returns the names added (registering again replaces them)."""
    core = require("verl.trainer.ppo.core_algos", INSTALL, WHAT)
    unknown = sorted(set(parameters) - set(POLICY_LOSSES))
    if unknown:
        raise ValueError(f"no atrctl loss {unknown[0]!r}; the losses: {', '.join(POLICY_LOSSES)}")
    probe, added = torch.zeros(1, 1), []
    for name in POLICY_LOSSES:
        existing = core.POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and not getattr(existing, "atrctl", False):
            continue  # verl's own gspo / cispo
        token_losses(probe, probe, probe[0], probe, algo=name, **parameters.get(name, {}))  # bad values fail here
        core.register_policy_loss(name)(_verl_loss(name, dict(parameters.get(name, {})), core.agg_loss))
        added.append(name)
    return added


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
