from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from atrctl.errors import UserError
from atrctl.model import memory, numerics
from atrctl.model.loading import CHAR_ALPHABET, build_char_tokenizer, build_model, load_model
from atrctl.model.numerics import resolve_device, resolve_dtype
from atrctl.runtime.machine import set_cpu_threads

TEXT = "what is 12 + (3 * 4)?\nanswer: 24. yes, 1/2 < 3; 5 > 4!"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny")
    model = build_model("tiny", tokenizer, seed=3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


def test_tokenizer_round_trips_every_character(tokenizer):
    for text in (CHAR_ALPHABET, TEXT, "  two  spaces ", "\n\n"):
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == len(text)  # one token per character, no BOS added
        assert tokenizer.decode(ids) == text


def test_tokenizer_ids_are_stable(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.unk_token_id == 3
    assert tokenizer("0")["input_ids"] == [4]
    assert len(tokenizer) == 4 + len(CHAR_ALPHABET)
    assert tokenizer("A~")["input_ids"] == [3, 3]


def test_tokenizer_skips_specials_on_decode(tokenizer):
    ids = tokenizer("12")["input_ids"] + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12"


def test_tokenizer_save_and_reload(tokenizer, saved_tiny):
    path, _ = saved_tiny
    reloaded = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(TEXT)["input_ids"]
    assert reloaded(TEXT)["input_ids"] == ids
    assert reloaded.decode(ids) == TEXT
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert reloaded.pad_token_id == 0 and reloaded.eos_token_id == 2 and reloaded.padding_side == "left"


def test_saved_model_reloads_with_identical_logits(tokenizer, saved_tiny):
    path, model = saved_tiny
    ids = torch.tensor([tokenizer(TEXT)["input_ids"]])
    auto = AutoModelForCausalLM.from_pretrained(path)
    loaded, loaded_tokenizer = load_model(str(path), device="cpu", dtype="float32")
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(auto(ids).logits, expected)
        assert torch.equal(loaded(ids).logits, expected)
    assert not loaded.training and loaded_tokenizer.pad_token_id == 0


def test_a_loaded_model_never_asks_the_hub_for_kernels(saved_tiny):
    """transformers >= 5.25 turns hub kernels on by default: on a GPU, `model.train()` then downloads layer
    replacements (seen on an offline H200: "could not verify publisher trust status"). atrctl loads with them off."""
    path, _ = saved_tiny
    loaded, _ = load_model(str(path), device="cpu", dtype="float32")
    assert loaded.use_kernels is False
    loaded.train()
    assert loaded.use_kernels is False


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("preset", "millions"), [("tiny", 0.14), ("small", 0.53), ("medium", 4.2)])
def test_preset_sizes(tokenizer, preset, millions, arch):
    model = build_model(preset, tokenizer, arch=arch)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(millions * 1e6, rel=0.05)  # tied: once
    assert model.config.vocab_size == len(tokenizer)


def test_build_model_is_deterministic_and_leaves_global_rng_alone(tokenizer):
    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    first = build_model("tiny", tokenizer, seed=1).state_dict()
    assert torch.equal(torch.rand(1), expected_draw)
    second = build_model("tiny", tokenizer, seed=1).state_dict()
    other = build_model("tiny", tokenizer, seed=2).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_unknown_preset_or_arch_lists_the_valid_ones(tokenizer):
    with pytest.raises(UserError, match="tiny, small, medium"):
        build_model("huge", tokenizer)
    with pytest.raises(UserError, match="llama, qwen2"):
        build_model("tiny", tokenizer, arch="gpt2")


def test_load_model_from_a_preset_name():
    model, tokenizer = load_model("tiny", device="cpu", arch="qwen2", seed=5)
    assert model.config.model_type == "qwen2" and not model.training
    assert tokenizer.pad_token_id == 0


def test_load_model_missing_path_is_a_one_line_user_error(tmp_path):
    with pytest.raises(UserError, match="not found") as err:
        load_model(str(tmp_path / "nowhere"), device="cpu")
    assert "\n" not in str(err.value) and "preset" in str(err.value)


def test_load_model_directory_without_a_model_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="could not be loaded") as err:
        load_model(str(tmp_path), device="cpu")
    assert "\n" not in str(err.value)


def test_load_model_gives_the_tokenizer_a_pad_token(tmp_path, tokenizer, saved_tiny):
    path, _ = saved_tiny
    no_pad = AutoTokenizer.from_pretrained(path)
    no_pad.pad_token = None
    no_pad.save_pretrained(tmp_path)
    build_model("tiny", tokenizer).save_pretrained(tmp_path)
    _, loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.pad_token == loaded.eos_token == "<eos>"


def test_resolve_device_and_dtype():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(UserError, match="auto, cpu or cuda"):
        resolve_device("tpu")
    with pytest.raises(UserError, match="float32"):
        resolve_dtype("int8", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA is not available"):
            resolve_device("cuda")


def test_set_cpu_threads(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("ATRCTL_THREADS", "1")
        assert set_cpu_threads() == 1
        assert set_cpu_threads(2) == 2
        monkeypatch.setenv("ATRCTL_THREADS", "many")
        with pytest.raises(UserError, match="ATRCTL_THREADS"):
            set_cpu_threads()
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ bf16 autocast


@pytest.mark.parametrize(
    ("device", "policy", "native", "width", "expected"),
    [
        ("cpu", "auto", False, 576, None),  # emulated bf16 is slower than float32
        ("cpu", "auto", True, 64, None),  # too narrow to pay back the casts
        ("cpu", "auto", True, 128, None),  # small: measured no faster
        ("cpu", "auto", True, 256, torch.bfloat16),  # medium: 1.35x
        ("cpu", "auto", True, 576, torch.bfloat16),
        ("cpu", "auto", True, None, None),  # width unknown (warm-up): float32
        ("cpu", "bfloat16", False, 64, torch.bfloat16),
        ("cpu", "off", True, 576, None),
    ],
)
def test_bf16_autocast_on_cpu_only_where_it_is_native_and_the_model_wide(
    monkeypatch, device, policy, native, width, expected
):
    monkeypatch.setattr(numerics, "cpu_has_native_bf16", lambda: native)
    chosen = numerics.numerics(torch.device(device), policy=policy, width=width)
    assert chosen.autocast_dtype is expected and chosen.dtype is torch.float32  # frozen copies stay float32
    assert numerics.numerics(torch.device(device), autocast=False, policy=policy, width=width).autocast_dtype is None


def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch, tmp_path):
    numerics.cpu_has_native_bf16.cache_clear()
    try:
        real = Path.read_text
        flags = {"amx_bf16": True, "avx512f avx512_vnni": False}
        for line, native in flags.items():
            monkeypatch.setattr(Path, "read_text", lambda self, *a, line=line, **k: f"flags\t\t: fpu {line} sse\n")
            numerics.cpu_has_native_bf16.cache_clear()
            assert numerics.cpu_has_native_bf16() is native
        monkeypatch.setattr(Path, "read_text", real)
    finally:
        numerics.cpu_has_native_bf16.cache_clear()


def test_the_update_budget_is_a_quarter_of_a_gpus_memory_and_4_gib_on_a_cpu(monkeypatch, tokenizer):
    """A GPU sizes default micro-batches from its own memory: the CPU's 4 GiB cut a 0.5B model's 256-token
    rows into passes of 3 on an H200, each too small to fill it."""

    class Card:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Card)
    assert memory.update_budget(torch.device("cpu")) == 4 * 2**30
    assert memory.update_budget(torch.device("cuda", 0)) == 20 * 2**30
    model = build_model("medium", tokenizer)
    per_row = memory.activation_bytes_per_token(model, 2000) * 2000
    assert memory.sized_micro_batch(model, 2000) == 4 * 2**30 // per_row  # its parameters are on the CPU
