"""The registries are the one source of every name: recipe validation, help texts, `atrctl ls` and
training pick a newly registered loss, estimator or task up with no other edit."""

import json

import pytest
import torch
from helpers import fast, recipe_maker

from atrctl.cli import main
from atrctl.config import loading
from atrctl.config.loading import load_recipe
from atrctl.config.schema import RolloutConfig, RunConfig
from atrctl.core.advantages import ADVANTAGE_ESTIMATORS
from atrctl.core.aggregation import AGGREGATIONS
from atrctl.core.divergence import TRUST_REGIONS, region_defaults
from atrctl.core.loss_metrics import clip_fractions
from atrctl.core.losses import KL_ESTIMATORS, POLICY_LOSSES, clipped_surrogate, define_loss
from atrctl.errors import UserError
from atrctl.model.loading import ARCHS
from atrctl.model.numerics import DTYPES
from atrctl.reports.catalog import sections
from atrctl.rollout.backend import ROLLOUT_BACKENDS
from atrctl.tasks import PRESETS, TASKS
from atrctl.training import step as step_module
from atrctl.training.loop import train

FAST = fast(
    "eval.every=2", "run.steps=2", "algo.minibatches=2", "algo.entropy_coef=0.01", "optim.lr=1e-3"
)  # the bonus moves every update

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


recipe = recipe_maker(FAST)


def test_every_choice_list_is_its_registry():
    registries = {
        ("model", "arch"): ARCHS,
        ("model", "dtype"): DTYPES,
        ("rollout", "backend"): ROLLOUT_BACKENDS,
        ("algo", "advantage"): ADVANTAGE_ESTIMATORS,
        ("algo", "agg"): AGGREGATIONS,
        ("algo", "kl_estimator"): KL_ESTIMATORS,
    }
    for key, registry in registries.items():
        assert loading._CHOICES[key]() is registry, key  # the registry object itself, read when checked


def test_a_registered_estimator_is_a_valid_recipe_value_at_once(monkeypatch):
    with pytest.raises(UserError, match="algo.advantage = 'sign'"):
        load_recipe(None, ["algo.advantage=sign"])
    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, "sign", lambda rewards: torch.sign(rewards - rewards.mean(1, True)))
    assert load_recipe(None, ["algo.advantage=sign"]).algo.advantage == "sign"


def test_help_texts_show_the_defaults_of_the_dataclasses_and_registries(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one help line per option: rich wraps to the terminal's width
    assert main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    for default in (
        RunConfig.steps,
        RolloutConfig.group_size,
        RolloutConfig.prompts,
        region_defaults("atr")["max_kl3"],
        region_defaults("grpo")["eps"],
    ):
        assert f"[default: {default}]" in text, default


def test_ls_lists_every_registry_entry_with_its_parameters(capsys):
    assert main(["ls"]) == 0
    out = capsys.readouterr().out
    names = [
        *POLICY_LOSSES,
        *TRUST_REGIONS,
        *ADVANTAGE_ESTIMATORS,
        *AGGREGATIONS,
        *TASKS,
        *ROLLOUT_BACKENDS,
        "default.toml",
        "gsm8k-qwen2.5-0.5b.toml",
    ]
    assert all(name in out for name in names), [name for name in names if name not in out]
    assert "max_kl3=0.1" in out and "digits=3" in out  # parameters come with their defaults
    assert "[0.616817, 1.516221]" in out  # atr's interval at its default δ
    presets = out.split("benchmark presets")[1].split("rollout backends")[0]  # each benchmark with its settings
    assert all(name in presets for name in PRESETS) and "32,768" in presets and "0.95" in presets


def test_a_registered_loss_and_estimator_train_end_to_end(results, monkeypatch):
    """One function and one registry line each: validated, trained with, logged with the reduction its
    metric name declares, and listed by `atrctl ls`."""
    seen = []  # test/max of every optimiser step, in order

    def halved_clip(tokens, *, eps: float = 0.3):
        """A throwaway loss: the symmetric clip at ε, with one extra extreme metric."""
        low, high = 1 - eps, 1 + eps
        farthest = torch.where(tokens.mask, (tokens.ratio - 1).abs(), 0.0).amax()
        if tokens.logp.requires_grad:  # not the recipe check's probe
            seen.append(farthest.item())
        fractions = clip_fractions(tokens.ratio, tokens.advantages, low, high, tokens.mask)
        return clipped_surrogate(tokens.ratio, tokens.advantages, low, high), {**fractions, "test/max": farthest}

    def sign(rewards):
        """A throwaway estimator: the sign of each reward's distance to its group mean."""
        return torch.sign(rewards - rewards.mean(dim=1, keepdim=True))

    monkeypatch.setitem(POLICY_LOSSES, "halved-clip", define_loss(halved_clip))
    monkeypatch.setitem(ADVANTAGE_ESTIMATORS, "sign", sign)
    summary = train(
        recipe("algo.loss=halved-clip", "algo.advantage=sign", "algo.args.eps=0.25"),
        results / "registered",
        results=results,
    )
    assert summary["algo"] == "halved-clip" and summary["algo_args"] == {"eps": 0.25} and summary["steps"] == 2
    logged = [json.loads(line) for line in (results / "registered" / "metrics.jsonl").read_text().splitlines()]
    assert len(seen) == 4  # 2 RL steps × 2 mini-batches
    # .../max declares its reduction: the largest of the RL step's optimiser steps, not their mean
    assert [record["test/max"] for record in logged] == pytest.approx([max(seen[:2]), max(seen[2:])], rel=1e-12)
    assert seen[1] > seen[0]  # the second mini-batch is off-policy: here a mean would differ from the max

    listed = {section.title.split(" (")[0]: section.rows for section in sections()}
    loss_row = next(row for row in listed["policy losses"] if row[0] == "halved-clip")
    assert loss_row[1:3] == ("eps=0.3", "surrogate") and loss_row[3].startswith("A throwaway loss")
    assert ("sign", "A throwaway estimator: the sign of each reward's distance to its group mean.") in listed[
        "advantage estimators"
    ]


def count_recomputed_logprobs(monkeypatch) -> list:
    """A list that grows by one for every no-grad logprob pass the update runs over a mini-batch."""
    calls, forward_pass = [], step_module.completion_logprobs
    monkeypatch.setattr(step_module, "completion_logprobs", lambda *a, **k: calls.append(1) or forward_pass(*a, **k))
    return calls


class RecordingSampler:
    """A second rollout backend, registered by name: the hf sampler behind a log of what the trainer asks.
    It says its logprobs do not match the training pass, so the trainer must recompute them."""

    calls: list = []

    def __init__(self, model, tokenizer, numerics):
        from atrctl.rollout.hf import HFSampler

        self.inner = HFSampler(model, tokenizer, numerics)

    logprobs_reusable = False

    def generate(self, prompt_ids, **kwargs):
        RecordingSampler.calls.append(("generate", len(prompt_ids), kwargs["repeats"]))
        return self.inner.generate(prompt_ids, **kwargs)

    def load_weights(self, model):
        RecordingSampler.calls.append(("load_weights",))
        self.inner.load_weights(model)

    def join_peers(self):
        self.inner.join_peers()


def test_a_registered_rollout_backend_is_chosen_by_the_recipe(results, monkeypatch):
    monkeypatch.setitem(ROLLOUT_BACKENDS, "recording", f"{__name__}:RecordingSampler")
    monkeypatch.setattr(RecordingSampler, "calls", [])
    recomputed = count_recomputed_logprobs(monkeypatch)
    train(recipe("rollout.backend=recording", "run.steps=2"), results / "recording", results=results)
    calls = RecordingSampler.calls
    # per step: the rollout (2 mini-batches of 2 prompts × G = 4, one sampling chunk), then the new weights
    assert [c for c in calls if c[0] == "load_weights"] == [("load_weights",)] * 2
    assert calls.count(("generate", 4, 4)) == 2
    assert ("generate", 10, 1) in calls and ("generate", 10, 2) in calls  # held-out greedy and pass@1 samples
    # it said its logprobs differ: recomputed for each step's second mini-batch (the first's own pass gives them)
    assert len(recomputed) == 2


def test_the_hf_backend_reuses_its_own_logprobs_on_cpu(results, monkeypatch):
    recomputed = count_recomputed_logprobs(monkeypatch)
    train(recipe("run.steps=1"), results / "hf-reuse", results=results)
    assert recomputed == []  # float32: the sampler's logprobs are the training pass's
