"""The trainer–sampler mismatch in a run: measured every step, and corrected as `rollout.correction` says."""

import json
import math

import pytest
from helpers import fast, recipe_maker

from atrctl.config.loading import load_recipe
from atrctl.core.correction import MISMATCH_METRICS
from atrctl.errors import UserError
from atrctl.rollout.backend import ROLLOUT_BACKENDS
from atrctl.training.loop import train

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

recipe = recipe_maker(fast("run.steps=1", "algo.minibatches=1", "eval.every=100", "algo.skip_zero_advantage=false"))
SHIFT = 0.3  # nats the shifted sampler takes off each logprob it reports: ln m = ln π_old - ln μ = 0.3


class ShiftedSampler:
    """The hf sampler reporting every token's logprob SHIFT nats lower than the policy's: a behaviour policy μ
    with a known mismatch (m = e^0.3 on every token)."""

    def __init__(self, model, tokenizer, numerics):
        from atrctl.rollout.hf import HFSampler

        self.inner = HFSampler(model, tokenizer, numerics)

    logprobs_reusable = False

    def generate(self, prompt_ids, **kwargs):
        rollout = self.inner.generate(prompt_ids, **kwargs)
        rollout.logprobs = (rollout.logprobs - SHIFT) * rollout.completion_mask
        return rollout

    def load_weights(self, model):
        self.inner.load_weights(model)

    def join_peers(self):
        self.inner.join_peers()


def step_metrics(directory):
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if '"step"' in line]


def test_the_hf_sampler_reports_a_mismatch_of_float_noise(results):
    train(recipe("run.steps=2"), results / "hf", results=results)
    for row in step_metrics(results / "hf"):
        assert set(MISMATCH_METRICS) <= set(row)
        assert row["mismatch/log_ratio/max"] < 1e-5 and abs(row["mismatch/k1"]) < 1e-6
        assert row["mismatch/corrected"] == 0.0


@pytest.fixture
def shifted(monkeypatch):
    monkeypatch.setitem(ROLLOUT_BACKENDS, "shifted", f"{__name__}:ShiftedSampler")


def test_a_known_mismatch_is_measured_and_truncated_weights_scale_the_loss(results, shifted):
    runs = {}
    for name, correction in [("none", "none"), ("tis", "token-tis")]:
        train(
            recipe("rollout.backend=shifted", f"rollout.correction={correction}", "rollout.correction_args={cap=1.2}"
                   if correction != "none" else "rollout.correction=none"),
            results / f"shifted-{name}",
            results=results,
        )  # fmt: skip
        runs[name] = step_metrics(results / f"shifted-{name}")[0]
    for row in runs.values():
        assert row["mismatch/k1"] == pytest.approx(-SHIFT, abs=1e-5)
        assert row["mismatch/kl3"] == pytest.approx(math.exp(SHIFT) - 1 - SHIFT, abs=1e-5)
        assert row["mismatch/log_ratio/max"] == pytest.approx(SHIFT, abs=1e-5)
    assert runs["none"]["mismatch/corrected"] == 0.0 and runs["tis"]["mismatch/corrected"] == 1.0
    # the same samples, every policy term weighted min(e^0.3, 1.2) = 1.2 (on-policy: one mini-batch, no penalty)
    assert runs["tis"]["loss"] == pytest.approx(1.2 * runs["none"]["loss"], rel=1e-5)


def test_a_mask_over_every_token_leaves_no_policy_gradient(results, shifted):
    train(recipe("rollout.backend=shifted", "rollout.correction=token-mask", "rollout.correction_args={delta=0.04}",
                 "algo.entropy_coef=0"), results / "masked", results=results)  # fmt: skip
    row = step_metrics(results / "masked")[0]
    assert row["mismatch/corrected"] == 1.0  # kl3(e^0.3) = 0.0499 > 0.04 on every token
    assert row["grad_norm"] == 0.0 and row["loss"] == 0.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.correction=halfway"], "rollout.correction = 'halfway' is not one of none, token-tis"),
        (["rollout.correction=token-tis", "rollout.correction_args={delta=0.1}"], "takes no parameter 'delta'"),
        (["rollout.correction=token-mask", "rollout.correction_args={measure='kl7'}"], "measure 'kl7'"),
        (["rollout.engine_args={enforce_eager=true}"], "the hf backend takes none"),
    ],
)
def test_bad_correction_or_engine_settings_are_refused_at_load(overrides, message):
    with pytest.raises(UserError, match=message):
        load_recipe(None, overrides)
