"""atrctl inside TRL's GRPOTrainer: the config helpers and the trainer subclass, on the real TRL (CPU, tiny model)."""

import subprocess
import sys

import pytest
import torch
from helpers import REPO

from atrctl.core.divergence import equivalent_clip, kl3_bounds, trust_region
from atrctl.errors import UserError
from atrctl.model.loading import build_char_tokenizer, build_model

trl = pytest.importorskip("trl")

from atrctl.integrations.trl import AtrctlGRPOTrainer, atr_grpo_config, region_grpo_config  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer()
    build_model("tiny", tokenizer, seed=0).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in ((1, 2), (3, 4), (5, 6), (7, 8))] * 4})


def reward(completions, **_):
    return [float(text[:1] in "0123456789") for text in completions]


def config(tmp_path, make=atr_grpo_config, **extra):
    options = dict(output_dir=str(tmp_path / "out"), use_cpu=True, seed=0, per_device_train_batch_size=8,
                   num_generations=4, max_completion_length=4, max_steps=3, learning_rate=1e-3, report_to="none",
                   logging_steps=1, save_strategy="no", disable_tqdm=True, temperature=1.0, top_k=0,
                   steps_per_generation=2)  # fmt: skip
    return make(**{**options, **extra})


def trainer(cls, model_dir, args, **extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return cls(model=model, reward_funcs=reward, args=args, train_dataset=dataset(), processing_class=tokenizer,
               **extra)  # fmt: skip


def test_the_configs_carry_the_regions_clip_range(tmp_path):
    args = config(tmp_path)
    eps_low, eps_high = equivalent_clip(0.1)
    assert (args.epsilon, args.epsilon_high) == pytest.approx((eps_low, eps_high), abs=1e-12)
    assert args.loss_type == "dapo"
    assert 1 - args.epsilon == pytest.approx(kl3_bounds(0.1)[0], abs=1e-12)
    kl2 = region_grpo_config("kl2", {"delta": 0.05}, output_dir=str(tmp_path), use_cpu=True, loss_type="bnpo")
    low, high = trust_region("kl2", delta=0.05)
    assert (kl2.epsilon, kl2.epsilon_high, kl2.loss_type) == (pytest.approx(1 - low), pytest.approx(high - 1), "bnpo")
    with pytest.raises(ValueError, match="come from the trust region"):
        atr_grpo_config(0.1, output_dir=str(tmp_path), use_cpu=True, epsilon=0.2)


def one_batch(trainer_, seed=0, spread=0.6):
    """A hand-made micro-batch with padding and ratios on both sides of the region (spread 0.6: w from ~0.2 to ~5;
    2: from below 0.05 to above 20)."""
    generator = torch.Generator().manual_seed(seed)
    rows, prompt, completion = 6, 5, 7
    vocab = trainer_.model.config.vocab_size
    inputs = {
        "prompt_ids": torch.randint(3, vocab, (rows, prompt), generator=generator),
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (rows, completion), generator=generator),
        "completion_mask": (torch.arange(completion)[None] < torch.tensor([7, 5, 3, 7, 1, 6])[:, None]).long(),
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]),
    }
    inputs["prompt_mask"][0, :2] = 0  # left padding
    with torch.no_grad():
        logp, _, _ = trainer_._get_per_token_logps_and_entropies(
            trainer_.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), completion,
        )  # fmt: skip
    inputs["old_per_token_logps"] = logp + spread * torch.randn(logp.shape, generator=generator)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum() * 2  # the window holds two such micro-batches
    return inputs


def loss_and_grads(trainer_, inputs):
    trainer_.model.train()
    trainer_.model.zero_grad()
    trainer_.current_gradient_accumulation_steps = 1
    loss = trainer_._compute_loss(trainer_.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer_.model.named_parameters()}


def assert_same_step(theirs, ours, inputs) -> dict:
    """TRL's trainer and atrctl's in it give the same loss and gradients on `inputs`; atrctl's logged metrics."""
    loss, grads = loss_and_grads(theirs, inputs)
    our_loss, our_grads = loss_and_grads(ours, inputs)
    assert loss.abs() > 1e-3 and torch.allclose(our_loss, loss, rtol=1e-6, atol=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(our_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    return ours._metrics["train"]


def test_atr_through_atrctl_equals_trls_own_loss_with_the_equivalent_clip(tmp_path, model_dir):
    theirs = trainer(trl.GRPOTrainer, model_dir, config(tmp_path))
    plain = config(tmp_path, make=trl.GRPOConfig, epsilon=0.05)  # its clip is not used: atrctl's loss replaces it
    ours = trainer(AtrctlGRPOTrainer, model_dir, plain, atrctl_loss="atr", loss_params={"max_kl3": 0.1})
    clipped = assert_same_step(theirs, ours, one_batch(theirs))
    assert clipped["atrctl/clip/low"][0] > 0 and clipped["atrctl/clip/high"][0] > 0  # both sides of the region bind


@pytest.mark.parametrize(
    ("loss", "trl_settings", "params", "agg"),
    [
        ("sapo", {"loss_type": "sapo"}, {}, "seq-mean-token-mean"),  # TRL's default temperatures, 1 and 1.05
        ("sapo", {"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5},
         {"tau_pos": 2.0, "tau_neg": 0.5}, "seq-mean-token-mean"),
        ("two-sided", {"loss_type": "dapo", "epsilon": 0.2, "delta": 4.0}, {}, "token-mean"),
        ("two-sided", {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28, "delta": 1.5},
         {"eps_high": 0.28, "delta": 1.5}, "token-mean"),
        ("two-sided", {"loss_type": "grpo", "epsilon": 0.2, "delta": 4.0}, {}, "seq-mean-token-mean"),
        ("opsm", {"loss_type": "dapo", "epsilon": 0.2, "off_policy_mask_threshold": 0.5}, {}, "token-mean"),
        ("opsm", {"loss_type": "grpo", "epsilon": 0.2, "epsilon_high": 0.28, "off_policy_mask_threshold": 0.2},
         {"eps_high": 0.28, "max_kl": 0.2}, "seq-mean-token-mean"),
        ("cispo", {"loss_type": "cispo", "epsilon_high": 5.0}, {"eps_low": 1.0, "eps_high": 4.0}, "token-mean"),
        ("cispo", {"loss_type": "cispo", "epsilon_high": 1.28}, {"eps_low": 1.0, "eps_high": 0.28}, "token-mean"),
    ],
)  # fmt: skip
def test_a_loss_trl_ships_gives_trls_own_loss_and_gradients(tmp_path, model_dir, loss, trl_settings, params, agg):
    """TRL's sapo, two-sided clip (`delta`), off-policy sequence mask and cispo through TRL's own _compute_loss,
    against atrctl's losses inside the same trainer, on one batch with padding and ratios from below 0.05 to
    above 20, under each aggregation TRL gives the loss (TRL's cispo cap is 1 + eps_high, with no lower bound)."""
    theirs = trainer(trl.GRPOTrainer, model_dir, config(tmp_path, make=trl.GRPOConfig, **trl_settings))
    plain = config(tmp_path, make=trl.GRPOConfig)
    ours = trainer(AtrctlGRPOTrainer, model_dir, plain, atrctl_loss=loss, loss_params=params, agg=agg)
    inputs = one_batch(theirs, seed=1, spread=2.0)
    with torch.no_grad():
        ratio = (theirs._get_per_token_logps_and_entropies(
            theirs.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), 7,
        )[0] - inputs["old_per_token_logps"]).exp()[inputs["completion_mask"].bool()]  # fmt: skip
    assert ratio.min() < 0.05 and ratio.max() > 20
    metrics = assert_same_step(theirs, ours, inputs)
    if loss == "two-sided":
        assert metrics["atrctl/clip/dual"][0] > 0  # δ binds on this batch
    if loss == "opsm":
        assert 0 < metrics["atrctl/clip/sequence"][0]  # some sequence dropped


@pytest.mark.slow
def test_three_steps_with_atr_grpo_config_equal_the_epsilons_set_by_hand(tmp_path, model_dir):
    eps_low, eps_high = equivalent_clip(0.1)
    runs = []
    for args in (config(tmp_path), config(tmp_path, make=trl.GRPOConfig, loss_type="dapo", epsilon=eps_low,
                                          epsilon_high=eps_high)):  # fmt: skip
        run = trainer(trl.GRPOTrainer, model_dir, args)
        run.train()
        runs.append({n: p.detach().clone() for n, p in run.model.named_parameters()})
    moved = trainer(trl.GRPOTrainer, model_dir, config(tmp_path)).model.state_dict()
    assert any(not torch.equal(runs[0][n], moved[n]) for n in runs[0])  # training changed the weights
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])


@pytest.mark.slow
def test_a_band_loss_trains_in_trl_and_logs_atrctls_diagnostics(tmp_path, model_dir):
    run = trainer(AtrctlGRPOTrainer, model_dir, config(tmp_path, num_iterations=2), atrctl_loss="tv-band",
                  loss_params={"delta": 0.1})  # fmt: skip
    run.train()
    logged = [entry for entry in run.state.log_history if "atrctl/clip/low" in entry]
    assert len(logged) == 3
    for entry in logged:
        for key in ("atrctl/clip/low", "atrctl/clip/high", "atrctl/kl3/mean", "atrctl/ratio/min", "atrctl/ratio/max"):
            assert entry[key] is not None and entry[key] >= 0, key
    assert any(entry["atrctl/kl3/mean"] > 0 for entry in logged)  # the second pass is off-policy


def test_a_bad_loss_parameter_fails_before_trl_starts(tmp_path, model_dir):
    with pytest.raises(ValueError, match="takes no parameter 'width'"):
        trainer(AtrctlGRPOTrainer, model_dir, config(tmp_path), atrctl_loss="tv-band", loss_params={"width": 1})


def test_atrctl_never_imports_trl_until_asked():
    modules = ", ".join(["atrctl", "atrctl.cli", "atrctl.training.loop", "atrctl.experiments.compare",
                         "atrctl.integrations.export", "atrctl.integrations.trl",
                         "atrctl.integrations.verl"])  # fmt: skip
    code = f"import sys, {modules}; assert not {{'trl', 'verl'}} & set(sys.modules), 'a trainer was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_missing_trl_is_one_line_naming_the_extra(monkeypatch):
    from atrctl.integrations import require

    monkeypatch.setitem(sys.modules, "not_a_trainer", None)
    from atrctl.integrations.trl import INSTALL

    with pytest.raises(UserError, match=r'needs not_a_trainer, which is not installed: pip install torch==2.13.0 -e "'):
        require("not_a_trainer", INSTALL, "atrctl.integrations.trl")


def test_the_readme_trl_example_runs_on_the_tiny_model(tmp_path, model_dir, monkeypatch):
    """The README's TRL block as written, with the model swapped for the tiny one and one CPU step each."""
    import re

    readme = (REPO / "README.md").read_text()
    code = re.search(r"<!-- trl-example -->\n```python\n(.*?)```", readme, re.S)[1]
    assert code.count('"Qwen/Qwen2.5-0.5B-Instruct"') == 1 and code.count('output_dir="grpo-atr"') == 1
    code = code.replace('"Qwen/Qwen2.5-0.5B-Instruct"', repr(str(model_dir))).replace(
        'output_dir="grpo-atr"', f'output_dir={str(tmp_path)!r}, use_cpu=True, max_steps=1, report_to="none", '
        "per_device_train_batch_size=8, save_strategy=\"no\", disable_tqdm=True"
    )  # fmt: skip
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})


def test_export_for_trl_is_python_that_builds_the_regions_config(monkeypatch):
    import functools

    from atrctl.experiments.arms import parse_arm
    from atrctl.integrations.export import export

    monkeypatch.setattr(trl, "GRPOConfig", functools.partial(trl.GRPOConfig, use_cpu=True))  # this CPU has no bf16
    namespace = {}
    exec(export(parse_arm("atr:max_kl3=0.05"), "trl"), namespace)
    assert (namespace["config"].epsilon, namespace["config"].epsilon_high) == equivalent_clip(0.05)
    assert namespace["config"].loss_type == "dapo"
