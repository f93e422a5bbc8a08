"""LoRA adapters (`model.lora`): settings, what trains, the reference without a second model, checkpoints
of adapters alone, exact resume, the merged and the adapter-only final model, and bad input."""

import json
import logging
import os
import signal
import warnings

import pytest
import torch
from helpers import fast, recipe_maker
from safetensors.torch import load_file

from atrctl.config.loading import recipe_from_dict
from atrctl.errors import UserError
from atrctl.model.adapters import (
    LORA_DEFAULTS,
    adapter_line,
    add_adapters,
    check_targets,
    lora_settings,
    reference_pass,
    store_frozen_base,
    write_final_model,
)
from atrctl.model.loading import load_model
from atrctl.training.loop import train

FAST = fast(
    "warmup.max_steps=15",  # a weak base: its rewards have room to rise
    "warmup.eval_every=15",
    "rollout.prompts=8",
    "rollout.group_size=8",
    "eval.every=100",
    "optim.lr=1e-3",
    "model.lora={r = 8}",
)


recipe = recipe_maker(FAST)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def records(directory):
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def saved_recipe(directory):
    import tomllib

    data = tomllib.loads((directory / "config.toml").read_text())
    data.pop("environment")
    return recipe_from_dict(data)


# ------------------------------------------------------------------ settings


def test_settings_take_the_defaults_for_what_they_do_not_name():
    assert lora_settings({}) == {}
    assert lora_settings({"r": 4}) == {**LORA_DEFAULTS, "r": 4}
    assert lora_settings({"alpha": 8, "target_modules": ["q_proj"]})["alpha"] == 8.0


@pytest.mark.parametrize(
    "table, message",
    [
        ({"rank": 4}, r"model.lora.rank is not a LoRA setting; use r, alpha, dropout, target_modules"),
        ({"r": 0}, r"model.lora.r must be an integer >= 1"),
        ({"r": 2.5}, r"model.lora.r must be an integer >= 1"),
        ({"alpha": -1}, r"model.lora.alpha must be a number > 0"),
        ({"dropout": 1.0}, r"model.lora.dropout must be a number in \[0, 1\)"),
        ({"target_modules": "q_proj"}, r'model.lora.target_modules must be "all-linear" or a list'),
        ({"target_modules": []}, r'model.lora.target_modules must be "all-linear" or a list'),
    ],
)
def test_bad_settings_are_refused_while_the_recipe_is_read(table, message):
    with pytest.raises(UserError, match=message):
        lora_settings(table)
    with pytest.raises(UserError, match=message):
        recipe_from_dict({"model": {"lora": table}})


def test_target_modules_that_the_model_lacks_are_named_with_those_it_has():
    model, _ = load_model("tiny", "cpu", "float32")
    check_targets(model, ["q_proj", "down_proj"])
    with pytest.raises(UserError, match=r"q_prj is not a linear layer of this model; its linear layers are .*q_proj"):
        check_targets(model, ["q_prj", "v_proj"])


# ------------------------------------------------------------------ the module


def test_only_the_adapters_train_and_they_start_as_the_base():
    model, _ = load_model("tiny", "cpu", "float32")
    ids = torch.arange(6)[None] % model.config.vocab_size
    before = model(input_ids=ids).logits
    adapters = add_adapters(model, lora_settings({"r": 4, "target_modules": ["q_proj", "v_proj"]}))
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    assert all(".q_proj." in name or ".v_proj." in name for name in trained)
    assert torch.equal(model(input_ids=ids).logits, before)  # B = 0: the first rollout samples the base
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.1)
    assert not torch.allclose(model(input_ids=ids).logits, before)
    with reference_pass(adapters):  # the reference: the same module, adapters off
        assert torch.equal(model(input_ids=ids).logits, before)
    assert not torch.allclose(model(input_ids=ids).logits, before)  # and back on after


def bf16_valued_tiny():
    """The tiny preset with every weight rounded to bf16, held in float32: a base as hub checkpoints ship."""
    model, tokenizer = load_model("tiny", "cpu", "float32")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model, tokenizer


def adapted(model):
    """`model` with r = 4 adapters on every linear layer, perturbed from B = 0 by a fixed draw."""
    wrapper = add_adapters(model, lora_settings({"r": 4}))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return wrapper


def test_a_bf16_valued_base_is_stored_in_bf16_and_trains_the_same_numbers_under_autocast(tmp_path):
    """Autocast casts the frozen float32 weights to bf16 before each product; stored in bf16 they compute the
    same logits and the same adapter gradients, bit for bit, and the merged model is the float32 one."""
    (plain, _), (stored, _) = bf16_valued_tiny(), bf16_valued_tiny()
    plain_wrapper, stored_wrapper = adapted(plain), adapted(stored)
    assert store_frozen_base(stored, torch.bfloat16)
    embedding = stored.get_input_embeddings().weight
    frozen = [p for n, p in stored.named_parameters() if not p.requires_grad and "base_layer" in n]
    assert len(frozen) == 14 and all(p.dtype == torch.bfloat16 for p in frozen)  # 7 linear layers × 2
    assert embedding.dtype == torch.float32 and stored.get_output_embeddings().weight is embedding  # tied head
    assert "bf16 where autocast casts it" in adapter_line(stored) and "float32)" in adapter_line(plain)
    ids = torch.randint(4, plain.config.vocab_size, (3, 10))
    grads = []
    for model in (plain, stored):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        grads.append((logits.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1], strict=True))
    for wrapper, name in ((plain_wrapper, "plain"), (stored_wrapper, "stored")):
        write_final_model(wrapper, tmp_path / name)
    merged = [load_file(tmp_path / name / "model.safetensors") for name in ("plain", "stored")]
    assert merged[0].keys() == merged[1].keys()
    assert all(merged[1][k].dtype == torch.float32 and torch.equal(merged[0][k], merged[1][k]) for k in merged[0])


def test_a_base_with_float32_precision_or_a_run_without_autocast_keeps_float32():
    model, _ = load_model("tiny", "cpu", "float32")  # fresh float32 weights: bf16 would round them
    adapted(model)
    assert not store_frozen_base(model, torch.bfloat16)
    assert not store_frozen_base(bf16_valued_tiny()[0], None)  # no autocast: the weights' own dtype computes
    assert all(p.dtype == torch.float32 for p in model.parameters())


# ------------------------------------------------------------------ runs


@pytest.fixture(scope="module")
def straight(results):
    directory = results / "straight"
    train(recipe("run.steps=30"), directory, results=results)
    return directory


@pytest.mark.slow
def test_a_lora_run_learns(straight):
    rewards = [r["reward/mean"] for r in records(straight)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert last > first + 0.1, rewards  # measured: 0.30 over the first 5 steps, 0.46 over the last 10


@pytest.mark.slow
def test_the_checkpoint_holds_the_adapters_alone(results, straight):
    model, _ = load_model("tiny", "cpu", "float32")
    add_adapters(model, lora_settings({"r": 8}))
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    saved = load_file(straight / "checkpoint" / "model.safetensors")
    assert set(saved) == set(adapters) and all(".lora_A." in name or ".lora_B." in name for name in saved)
    adapter_bytes = sum(p.numel() * 4 for p in adapters.values())  # 64-wide layers: r = 8 is 1/4 of each matrix
    assert os.path.getsize(straight / "checkpoint" / "model.safetensors") < adapter_bytes + 16 * 1024
    assert adapter_bytes < 0.2 * os.path.getsize(straight / "model" / "model.safetensors")
    moments = torch.load(straight / "checkpoint" / "optimizer.pt", weights_only=True)["state"]
    assert len(moments) == len(adapters)  # AdamW's state of the adapters alone
    state = json.loads((straight / "checkpoint" / "state.json").read_text())
    assert state["weights"] == "lora"


@pytest.mark.slow
def test_the_final_model_is_merged_and_the_adapters_load_with_peft(results, straight):
    from peft import PeftModel

    merged, _ = load_model(str(straight / "model"), "cpu", "float32", strict=True)
    adapter_config = json.loads((straight / "model" / "adapter" / "adapter_config.json").read_text())
    base, _ = load_model(adapter_config["base_model_name_or_path"], "cpu", "float32")
    ids = torch.arange(7)[None] % merged.config.vocab_size
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        with warnings.catch_warnings():  # peft asks the model a question transformers 5 has renamed
            warnings.simplefilter("ignore", FutureWarning)
            adapted = PeftModel.from_pretrained(base, straight / "model" / "adapter")(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=0, atol=1e-5)
    assert (adapted - plain).abs().max() > 1e-3  # the adapters changed the policy


@pytest.mark.slow
def test_an_interrupted_lora_run_resumes_exactly(results, straight):
    directory = results / "resumed"

    def stop_at_10(record):
        if record["step"] == 10:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(recipe("run.steps=30"), directory, results=results, on_step=stop_at_10)
    train(saved_recipe(directory), directory, results=results, resume=True)
    timing = ("time/", "tokens_per_s")
    for a, b in zip(records(straight), records(directory), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == {
            k: v for k, v in b.items() if not k.startswith(timing)
        }
    ours, theirs = (load_file(d / "checkpoint" / "model.safetensors") for d in (directory, straight))
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


@pytest.mark.slow
def test_a_kl_penalty_uses_the_base_under_the_adapters(results, monkeypatch):
    from atrctl.model import loading

    loaded = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loaded.append(a[0]) or real(*a, **k))
    directory = results / "kl"
    train(recipe("run.steps=3", "algo.beta=0.1", "algo.minibatches=1"), directory, results=results)
    assert len(loaded) == 1  # the policy only: no second model for the reference
    kl = [r["kl/ref"] for r in records(directory)]
    assert kl[0] == pytest.approx(0.0, abs=1e-7) and kl[-1] > 1e-5  # the base itself at first, then apart


@pytest.mark.slow
def test_a_bf16_autocast_run_on_a_bf16_base_equals_the_run_that_keeps_the_base_in_float32(results, monkeypatch, caplog):
    from atrctl.training import setup as setup_module

    model, tokenizer = bf16_valued_tiny()
    model.save_pretrained(results / "bf16-base")
    tokenizer.save_pretrained(results / "bf16-base")
    overrides = ("run.steps=2", f"model.base={results / 'bf16-base'}", "model.autocast=bfloat16", "algo.beta=0.1")
    with caplog.at_level(logging.WARNING, logger="atrctl"):
        train(recipe(*overrides), results / "bf16", results=results)
    notices = [record.getMessage() for record in caplog.records]
    assert any("bf16 where autocast casts it" in line for line in notices)  # the base was stored in bf16
    monkeypatch.setattr(setup_module, "store_frozen_base", lambda *args: False)
    train(recipe(*overrides), results / "float32", results=results)
    timing = ("time/", "tokens_per_s")
    for a, b in zip(records(results / "bf16"), records(results / "float32"), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == {
            k: v for k, v in b.items() if not k.startswith(timing)
        }
    for name in ("checkpoint/model.safetensors", "model/model.safetensors"):  # adapters, and the merged model
        ours, theirs = (load_file(results / run / name) for run in ("bf16", "float32"))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.slow
def test_target_modules_the_model_lacks_stop_the_run_before_it_is_written(results, capsys):
    from atrctl.cli import main

    sets = [arg for item in (*FAST, 'model.lora={target_modules = ["q_prj"]}') for arg in ("--set", item)]
    assert main(["train", "--results", str(results), "--name", "typo", *sets]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "q_prj is not a linear layer of this model" in err
    assert not (results / "typo").exists()


@pytest.mark.slow
def test_a_checkpoint_of_other_weights_is_refused_in_one_line(results, capsys):
    from atrctl.cli import main

    directory = results / "stopped"

    def stop_at_2(record):
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(recipe("run.steps=5"), directory, results=results, on_step=stop_at_2)
    config = directory / "config.toml"
    text, metrics = config.read_text(), (directory / "metrics.jsonl").read_text()
    assert 'lora = {"r" = 8}' in text
    config.write_text(text.replace('lora = {"r" = 8}', "lora = {}"))
    capsys.readouterr()
    assert main(["train", "--resume", str(directory)]) == 2  # the recorded recipe names the change first
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "(model.lora: {'r': 8} → {})" in err
    state = directory / "checkpoint" / "state.json"
    state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "recipe"}))
    assert main(["train", "--resume", str(directory)]) == 2  # a checkpoint that recorded none: its weights tell
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "holds LoRA adapters but the recipe trains every weight" in err
    assert (directory / "metrics.jsonl").read_text() == metrics  # nothing of the run was touched
