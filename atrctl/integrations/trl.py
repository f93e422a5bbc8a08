"""ATR-GRPO and every atrctl trust region inside TRL's GRPOTrainer (trl >= 1.16).

Two ways in, from the least to the most invasive:

- A constant interval [l, u] is what TRL's own clipped loss already takes, as epsilon = 1 − l and
  epsilon_high = u − 1: `atr_grpo_config(max_kl3=0.1, ...)` (or `region_grpo_config("kl2", delta=0.1, ...)`)
  returns a `GRPOConfig` with them set, and TRL trains unchanged.
- Anything else — a per-token band (tv-band, kl-band), gspo, cispo, a `divergence` measure, another
  aggregation — and atrctl's diagnostics: `AtrctlGRPOTrainer(..., atrctl_loss="tv-band",
  loss_params={"delta": 0.2})` replaces only the policy loss of TRL's `_compute_loss` with
  `atrctl.core.losses.policy_loss` and logs its metrics (clip/low, clip/high, clip/region, kl3/mean, ratio/min,
  ratio/max, the p_old bins) under `atrctl/…` through TRL's own logging, so they reach every `report_to` sink.

    from atrctl.integrations.trl import atr_grpo_config
    config = atr_grpo_config(max_kl3=0.1, output_dir="out", num_generations=8)   # epsilon 0.3832, epsilon_high 0.5162
"""

from __future__ import annotations

import functools

import torch

from atrctl.core.divergence import trust_region
from atrctl.core.loss_metrics import finish_metrics, metric_reduction
from atrctl.core.losses import check_loss, policy_loss
from atrctl.integrations import require

WHAT, INSTALL = "atrctl.integrations.trl", 'pip install torch==2.13.0 -e ".[trl]"'


def region_grpo_config(name: str = "atr", region: dict | None = None, **config):
    """A `trl.GRPOConfig` whose clip range is the constant trust region `name` with parameters `region`
    (`atrctl.core.divergence.trust_region`), with TRL's token-mean clipped loss ("dapo") unless `loss_type` is given;
    every other keyword goes to GRPOConfig as it is."""
    trl = require("trl", INSTALL, WHAT)
    clashing = sorted({"epsilon", "epsilon_high"} & set(config))
    if clashing:
        raise ValueError(f"{', '.join(clashing)} come from the trust region {name!r}: leave them out")
    low, high = trust_region(name, **(region or {}))
    return trl.GRPOConfig(epsilon=1.0 - low, epsilon_high=high - 1.0, **{"loss_type": "dapo", **config})


def atr_grpo_config(max_kl3: float = 0.1, **config):
    """`region_grpo_config` for ATR-GRPO's KL3 region {w − 1 − ln w ≤ max_kl3}."""
    return region_grpo_config("atr", {"max_kl3": max_kl3}, **config)


@functools.cache
def _trainer_class():
    """AtrctlGRPOTrainer, defined on first use so that importing this module does not import TRL."""
    trl = require("trl", INSTALL, WHAT)

    class AtrctlGRPOTrainer(trl.GRPOTrainer):
        """TRL's GRPOTrainer with atrctl's policy loss: any registered loss and aggregation.

        Everything but the loss is TRL's: generation, rewards, advantages, old and reference logprobs, the
        optimiser.  The micro-batch loss is scaled the way TRL scales its own so that gradient accumulation
        gives the same step: token-mean by TRL's "dapo" normaliser (the generation batch's tokens), the
        sequence aggregations like its "grpo" (the micro-batch mean over the accumulation steps).  The KL to
        TRL's reference (beta > 0) is atrctl's k3, which is TRL's estimator.  Text models only.
        """

        def __init__(self, *args, atrctl_loss: str = "atr", loss_params: dict | None = None,
                     agg: str = "token-mean", **kwargs):  # fmt: skip
            self.atrctl_loss, self.atrctl_params, self.atrctl_agg = atrctl_loss, dict(loss_params or {}), agg
            check_loss(atrctl_loss, agg, **self.atrctl_params)  # bad names or values fail before TRL starts
            super().__init__(*args, **kwargs)

        def _compute_loss(self, model, inputs):
            prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
            logp, entropy, _ = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True
            )
            old = inputs.get("old_per_token_logps")
            old = logp.detach() if old is None else old
            out = policy_loss(
                logp, old, inputs["advantages"], mask, algo=self.atrctl_loss, agg=self.atrctl_agg,
                max_new_tokens=self.max_completion_length, ref_logp=inputs.get("ref_per_token_logps"),
                beta=self.beta, kl_estimator="k3", entropy=entropy, **self.atrctl_params,
            )  # fmt: skip
            mode = "train" if self.model.training else "eval"
            self._log_atrctl(mode, out.metrics)
            return out.loss * self._loss_scale(mask, inputs["num_items_in_batch"], mode)

        def _loss_scale(self, mask: torch.Tensor, window_tokens: torch.Tensor, mode: str) -> torch.Tensor | float:
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
            if self.atrctl_agg == "token-mean":  # the micro-batch's token sum over TRL's window normaliser
                normaliser = window_tokens.clamp(min=1.0) / self.accelerator.num_processes
                if mode == "train":
                    normaliser = normaliser * accumulation / self.args.steps_per_generation
                return mask.sum() / normaliser
            return 1.0 / accumulation

        def _log_atrctl(self, mode: str, metrics: dict[str, float]) -> None:
            """This micro-batch's metrics, reduced over processes by the rule each name declares and then finished
            (`loss_metrics.finish_metrics`), into TRL's metric lists (TRL averages a list when it logs: a min or max is
            then the mean of the extremes).  The loss emits the same keys on every process; only finishing drops
            the empty cells, so it comes after the gather."""
            names = sorted(metrics)
            values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=self.accelerator.device)
            gathered = self.accelerator.gather(values[None]).reshape(-1, len(names))
            reduced = {}
            for column, name in enumerate(names):
                reduce = {"min": torch.min, "max": torch.max}.get(metric_reduction(name), torch.mean)
                reduced[name] = reduce(gathered[:, column]).item()
            for name, value in finish_metrics(reduced).items():
                self._metrics[mode][f"atrctl/{name}"].append(value)

    return AtrctlGRPOTrainer


def __getattr__(name: str):
    if name == "AtrctlGRPOTrainer":
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
