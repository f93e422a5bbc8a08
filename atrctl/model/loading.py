"""Tokenizers and causal LMs: tiny presets built locally, or any Hugging Face model.

A preset is an ordinary transformers model plus a character tokenizer, so it saves and loads as a
normal model directory and takes the same path through training and evaluation as a real model.
transformers is imported inside the functions: importing this module must stay cheap for the CLI.
"""

from __future__ import annotations

import logging
import pickle
import string
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from atrctl.errors import UserError, first_line
from atrctl.model.numerics import resolve_device, resolve_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast


CHAR_ALPHABET = string.digits + "+-*/()=<>.,:;?! " + string.ascii_lowercase + "\n"
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}

# name -> (hidden size, layers, attention heads, initializer range); the MLP is 4x hidden.
# tiny: 4 heads of dim 16 and a 0.1 init escape the 3-digit-addition SFT plateau on every seed tried
# (0-8 reached >= 20% in 200-500 steps); 2 heads or the default 0.02 init left some seeds near 1% for 3000 steps.
PRESETS = {"tiny": (64, 2, 4, 0.1), "small": (128, 2, 4, 0.02), "medium": (256, 4, 4, 0.02)}
ARCHS = ("llama", "qwen2")
MAX_POSITIONS = 512

log = logging.getLogger(__name__)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of CHAR_ALPHABET; ids 0-3 are <pad> <bos> <eos> <unk>, then the alphabet.

    No BOS is added on encode: a prompt's tokens are exactly its characters, so token and character
    boundaries coincide and decode(encode(s)) == s. Characters outside the alphabet become <unk>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS.values(), *CHAR_ALPHABET])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False, padding_side="left", **SPECIAL_TOKENS
    )


def build_model(preset: str, tokenizer: PreTrainedTokenizerBase, arch: str = "llama", seed: int = 0) -> PreTrainedModel:
    """A freshly initialised causal LM of a preset size; the same seed gives the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    if preset not in PRESETS:
        raise UserError(f"unknown model preset '{preset}': use one of {', '.join(PRESETS)}")
    if arch not in ARCHS:
        raise UserError(f"unknown architecture '{arch}': use one of {', '.join(ARCHS)}")
    hidden, layers, heads, init_range = PRESETS[preset]
    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        initializer_range=init_range,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def load_model(
    name_or_path: str,
    device: str = "auto",
    dtype: str = "auto",
    *,
    arch: str = "llama",
    seed: int = 0,
    strict: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model and tokenizer in eval mode on `device`: a model directory, a hub name, or a preset name
    (fresh weights of `arch` from `seed`, with the character tokenizer).

    Weights the checkpoint lacks (which transformers initialises at random) or has in excess are reported:
    a UserError when `strict` (a run's own final model must be whole), else a warning naming them.

    Hub kernels stay off (`use_kernels=False`): transformers >= 5.25 otherwise swaps layers for kernels it
    downloads from the hub at `model.train()` on a GPU, which fails offline and changes numerics atrctl tests.

    The tokenizer always has a pad token (its EOS when it has none) and pads on the left, the side
    generation needs; atrctl's sampler pads prompts itself, so this only matters to other callers.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if name_or_path in PRESETS:
        tokenizer = build_char_tokenizer()
        model = build_model(name_or_path, tokenizer, arch=arch, seed=seed)
    else:
        source = _local_or_hub(name_or_path)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            with warnings.catch_warnings():  # torch's note on a pickle's protocol, before refusing it anyway
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                model, loading = AutoModelForCausalLM.from_pretrained(
                    source, dtype=torch_dtype, output_loading_info=True, use_kernels=False
                )
        except pickle.UnpicklingError:  # torch.load(weights_only=True) met more than tensors: never run it
            raise UserError(
                f"model '{name_or_path}': {_pickled_weights(source)} holds more than weights (code a pickle would run) "
                "and was refused unread; use a model saved as safetensors, or one you trust"
            ) from None
        except (OSError, ValueError, SafetensorError) as err:
            raise UserError(
                f"model '{name_or_path}' could not be loaded ({first_line(err)}): give a preset "
                f"({', '.join(PRESETS)}), a local model directory or a hub name"
            ) from None
        _report_loading(name_or_path, loading, strict)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(f"tokenizer of '{name_or_path}' has neither a pad nor an EOS token: add one to it")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model.to(device=torch_device, dtype=torch_dtype).eval(), tokenizer


def _pickled_weights(source: str) -> str:
    """The pickled weight files of a model directory, by name (what the refusal names)."""
    found = sorted(str(p) for p in Path(source).glob("*.bin")) if Path(source).is_dir() else []
    return ", ".join(found) or f"a pickled weight file of {source}"


def _report_loading(name: str, loading: dict, strict: bool) -> None:
    problems = []
    for what in ("missing", "unexpected", "mismatched"):
        names = sorted(str(name) for name in loading.get(f"{what}_keys") or ())
        if names:
            problems.append(f"{what} {', '.join(names[:4])}{' …' if len(names) > 4 else ''}")
    if not problems:
        return
    message = f"model '{name}' does not match its architecture: {'; '.join(problems)}"
    if strict:
        raise UserError(f"{message}; the model directory is damaged: train (or resume) the run again")
    log.warning("warning: %s (missing weights were initialised at random)", message)


def _local_or_hub(name: str) -> str:
    """An existing directory, or a hub name; a path-like name that does not exist fails here, without
    asking the hub about it."""
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path)
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise UserError(
            f"model '{name}' not found: give a preset ({', '.join(PRESETS)}), a local model directory or a hub name"
        )
    return name


def enable_checkpointing(model) -> None:
    """Turn on activation checkpointing (non-reentrant): `activation_checkpointing_enable` since transformers
    5.20, `gradient_checkpointing_enable` before."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def is_checkpointing(model) -> bool:
    """Whether activation checkpointing is on (it walks the modules: ask once).  Read under both of
    transformers' names: asked by a name the installed version lacks, it would always say no."""
    now = getattr(model, "is_activation_checkpointing", None)
    return bool(now if now is not None else getattr(model, "is_gradient_checkpointing", False))


def is_sharded(model) -> bool:
    """Whether `model` is an FSDP2-sharded module (`sharding.shard_model`): a fact about the model, which the
    forward pass, checkpoints and the update each ask."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
