"""Tokenizers and causal LMs: tiny presets built locally, or any Hugging Face model.

A preset is an ordinary transformers model plus a character tokenizer, so it saves and loads as a
normal model directory and takes the same path through training and evaluation as a real model.
transformers is imported inside the functions: importing this module must stay cheap for the CLI.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import string
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from atrctl.errors import UserError, first_line

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

CHAR_ALPHABET = string.digits + "+-*/()=<>.,:;?! " + string.ascii_lowercase + "\n"
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}

# name -> (hidden size, layers, attention heads, initializer range); the MLP is 4x hidden.
# tiny: 4 heads of dim 16 and a 0.1 init escape the 3-digit-addition SFT plateau on every seed tried
# (0-8 reached >= 20% in 200-500 steps); 2 heads or the default 0.02 init left some seeds near 1% for 3000 steps.
PRESETS = {"tiny": (64, 2, 4, 0.1), "small": (128, 2, 4, 0.02), "medium": (256, 4, 4, 0.02)}
ARCHS = ("llama", "qwen2")
DEVICES = ("auto", "cpu", "cuda")  # "auto" picks CUDA when present
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


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present; asking for CUDA without it is a user error, not a silent CPU run."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu" or name.startswith("cuda"):
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"device '{name}' requested but CUDA is not available: use --device cpu or auto")
        return torch.device(name)
    raise UserError(f"unknown device '{name}': use {', '.join(DEVICES[:-1])} or {DEVICES[-1]}")


@dataclass(frozen=True)
class Numerics:
    """How forward passes compute on a device; `numerics()` is the one place that decides bf16 vs float32.

    `dtype` is that of frozen copies (reference model, evaluation) under model.dtype = "auto".
    `autocast_dtype` is what a trained policy's float32 master weights compute in (bf16 on a capable GPU),
    or None: the weights' own dtype, as evaluations want (they load the dtype they were asked for).
    """

    device: torch.device
    dtype: torch.dtype
    autocast_dtype: torch.dtype | None

    @property
    def autocast_enabled(self) -> bool:
        return self.autocast_dtype is not None

    def autocast(self):
        import torch

        return torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                              enabled=self.autocast_enabled)  # fmt: skip


def numerics(
    device: torch.device, *, autocast: bool = True, policy: str = "auto", width: int | None = None
) -> Numerics:
    """The arithmetic of forward passes on `device`.  The frozen copies' dtype (`Numerics.dtype`) is bf16 on a
    CUDA device that supports it, else float32.  A trained policy (`autocast`) computes under bf16 autocast
    as `policy` (model.autocast) says: "auto" = on such a GPU, and on a CPU with native bf16 for a model at
    least CPU_BF16_MIN_WIDTH wide (`width`, its hidden size); "bfloat16" = always; "off" = never.  With
    autocast=False the passes keep the weights' dtype (evaluation, the warm-up's checks)."""
    import torch

    gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    dtype = torch.bfloat16 if gpu_bf16 else torch.float32
    if policy == "auto":
        cpu_bf16 = device.type == "cpu" and cpu_has_native_bf16() and (width or 0) >= CPU_BF16_MIN_WIDTH
        use = gpu_bf16 or cpu_bf16
    else:
        use = policy == "bfloat16"
    return Numerics(device, dtype, torch.bfloat16 if use and autocast else None)


CPU_BF16_MIN_WIDTH = 256
"""Narrower models stay float32 on CPU, where bf16 autocast did not pay below this width; without native bf16
instructions it is emulated, 2-4x slower, and never chosen. Measured: docs/performance-log.md#cpu_bf16_min_width."""


def linears_autocast_casts(model) -> list:
    """The nn.Linear layers whose weights bf16 autocast casts before every product, so that storing them in
    bf16 changes no number: every one but a head tied to the input embedding (the embedding's lookup is not
    cast, and the tie must hold).  What `sharding.full_copy` and `adapters.store_frozen_base` store in bf16."""
    import torch

    embedding = model.get_input_embeddings().weight
    return [module for module in model.modules()
            if isinstance(module, torch.nn.Linear) and module.weight is not embedding]  # fmt: skip


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (the avx512_bf16 or amx_bf16 flag of /proc/cpuinfo)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


DTYPES = ("auto", "float32", "bfloat16")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is the device's `numerics` dtype; float32 and bfloat16 are taken as asked."""
    import torch

    if name not in DTYPES:
        raise UserError(f"unknown dtype '{name}': use {', '.join(DTYPES)}")
    return numerics(device).dtype if name == "auto" else getattr(torch, name)


MAX_SAMPLE_BATCH = 1024
KV_BUDGET = 2 * 2**30  # bytes of KV cache a default-sized sampling batch may take


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of KV cache one token of one sequence takes: keys and values of every layer's KV heads."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    return 2 * config.num_hidden_layers * heads * head_dim * dtype.itemsize


def sized_batch(model: torch.nn.Module, tokens_per_row: int, requested: int = 0) -> int:
    """Rows to sample at once: `requested` if > 0, else as many as KV_BUDGET holds in KV cache at
    `tokens_per_row` (prompt + new tokens), between 1 and MAX_SAMPLE_BATCH.  1024 rows of a 135M Llama at 300
    tokens in float32 would need ~14 GB; the tiny presets fit 1024 in a few MB.  The budget is a constant, not
    the memory free at the time: the batch decides how samples are seeded (evaluation.sample_chunks), so it
    must depend on the model and the lengths alone for a result to be reproducible."""
    if requested > 0:
        return requested
    rows = KV_BUDGET // max(1, kv_bytes_per_token(model) * tokens_per_row)
    return int(min(MAX_SAMPLE_BATCH, max(1, rows)))


UPDATE_BUDGET = 4 * 2**30  # bytes of activations a default-sized micro-batch may keep on a CPU
GPU_UPDATE_SHARE = 4
"""On a GPU the activation budget is this fraction (1/4) of the card's total memory, which leaves the rest for weights,
gradients, AdamW and the KV cache; the total, not the free memory, so micro-batches depend on the recipe and the kind
of GPU alone. Measured: docs/performance-log.md#gpu_update_share."""


def update_budget(device: torch.device) -> int:
    """Bytes of activations a default-sized micro-batch may keep for its backward pass on `device`."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // GPU_UPDATE_SHARE
    return UPDATE_BUDGET


def activation_bytes_per_token(model: torch.nn.Module, tokens_per_row: int, checkpointing: bool | None = None) -> int:
    """Bytes of activations one token of a row of `tokens_per_row` keeps for the backward pass, float32.

    Per layer about 10 hidden-size vectors (norm inputs, q, k, v, attention output, residuals), 6 of the
    MLP's width (gate, up, the activation's input and output, the product) and the attention probabilities
    over the row, 2 × heads × tokens (CPU attention with a padding mask saves them).  At 320 tokens this
    gives 2.5 MB for SmolLM2-135M and 4.5 MB for Qwen2.5-0.5B; one forward/backward there grew the process by
    2.4 and 4.8 MB per token beyond its parameter gradients (`update_memory` (retired: docs/performance-log.md)).  With
    activation checkpointing a layer keeps only its input, and the one being recomputed all of the above.
    `checkpointing` None asks the model (transformers walks its modules for that: pass it when calling often).
    """
    config = model.config
    hidden, layers = config.hidden_size, config.num_hidden_layers
    width = getattr(config, "intermediate_size", None) or 4 * hidden
    layer = 10 * hidden + 6 * width + 2 * config.num_attention_heads * tokens_per_row
    if checkpointing is None:
        checkpointing = getattr(model, "is_activation_checkpointing", False)
    if checkpointing:
        return 4 * (layers * hidden + layer)
    return 4 * layers * layer


def sized_micro_batch(
    model: torch.nn.Module, tokens_per_row: int, checkpointing: bool | None = None, budget: int | None = None
) -> int:
    """Rows per forward/backward where algo.micro_batch is 0: as many as `budget` bytes of activations hold
    at `tokens_per_row` (at least 1); None = the `update_budget` of the model's device (pass it when calling
    often, as with `checkpointing`).  On a CPU, SmolLM2-135M at 320 tokens: 5 rows; the tiny presets: whole
    mini-batches.  A constant budget (not the free memory) keeps a run's arithmetic a function of its recipe."""
    per_token = activation_bytes_per_token(model, tokens_per_row, checkpointing)
    if budget is None:
        budget = update_budget(next(model.parameters()).device)
    return max(1, budget // max(1, per_token * tokens_per_row))


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters: tied input and output embeddings count once."""
    return sum(p.numel() for p in model.parameters())


def set_cpu_threads(threads: int | None = None) -> int:
    """Use every CPU this process may run on (torch defaults to physical cores); ATRCTL_THREADS overrides."""
    import torch

    if threads is None:
        threads = requested_threads() or usable_cpus()
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def requested_threads() -> int | None:
    """ATRCTL_THREADS, checked (None when unset): a whole number from 1 to the CPUs this process may use.  Read
    by the command itself before anything is written, not first by a child it starts (compare's runs)."""
    env = os.environ.get("ATRCTL_THREADS")
    if not env:
        return None
    if not (env.isascii() and env.isdigit() and 1 <= int(env) <= usable_cpus()):
        raise UserError(f"ATRCTL_THREADS='{env[:20]}' is not a whole number from 1 to {usable_cpus()} (the CPUs "
                        "this process may use): set it to e.g. 2 or unset it")  # fmt: skip
    return int(env)


def is_sharded(model) -> bool:
    """Whether `model` is an FSDP2-sharded module (`sharding.shard_model`): a fact about the model, which the
    forward pass, checkpoints and the update each ask."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
