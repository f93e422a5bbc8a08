"""LoRA adapters through peft: train a low-rank update of the policy instead of every weight.

With `model.lora` set, the base weights are frozen and each targeted linear layer gets W + (α/r)·B·A,
with B = 0 at the start, so the first rollout samples the base exactly.  Only A and B train, so only
they (and their AdamW moments) are checkpointed, and with `algo.beta > 0` the reference policy is the
same module with its adapters switched off (`reference_pass`): no second copy of the model.

The training loop runs the transformers model that peft injected the adapters into (the same forward,
logits path and KV cache as a full run); the peft wrapper is kept for what needs it: switching the
adapters off, saving them in peft's format and merging them into the base at the end.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch

from atrctl.errors import UserError
from atrctl.model.numerics import linears_autocast_casts

LORA_DEFAULTS: dict[str, Any] = {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}
"""The parameters of `model.lora`; a table names only those it changes.  "all-linear" is peft's: every
linear layer of the decoder, not the output projection."""


def lora_settings(table: dict[str, Any]) -> dict[str, Any]:
    """`model.lora` with its defaults filled in ({} when LoRA is off); a bad key or value is a UserError that
    names it.  Pure: checked while the recipe is read, before peft is imported or anything is written."""
    if not table:
        return {}
    unknown = sorted(set(table) - set(LORA_DEFAULTS))
    if unknown:
        raise UserError(f"model.lora.{unknown[0]} is not a LoRA setting; use {', '.join(LORA_DEFAULTS)}")
    settings = {**LORA_DEFAULTS, **table}
    r, alpha, dropout, targets = (settings[key] for key in ("r", "alpha", "dropout", "target_modules"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise UserError(f"model.lora.r must be an integer >= 1 (the adapters' rank), got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (alpha > 0 and math.isfinite(alpha)):
        raise UserError(f"model.lora.alpha must be a number > 0 (the update is scaled by alpha / r), got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise UserError(f"model.lora.dropout must be a number in [0, 1), got {dropout!r}")
    names_ok = isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets)
    if targets != "all-linear" and not names_ok:
        raise UserError(
            f'model.lora.target_modules must be "all-linear" or a list of module names such as '
            f'["q_proj", "v_proj"], got {targets!r}'
        )
    return {**settings, "alpha": float(alpha), "dropout": float(dropout)}


def check_rank(r: int, width: int) -> None:
    """Refuse a rank above the model's width (hidden_size): A and B would be width × r and r × width, yet their
    product has rank at most the width, so the rest is memory that adds nothing (r = 1e8 asks for hundreds
    of GiB)."""
    if r > width:
        raise UserError(f"model.lora.r = {r} is above the model's width ({width}): the update's rank cannot exceed "
                        f"it; use at most {width}, typically 8-64")  # fmt: skip


def check_targets(model: torch.nn.Module, targets: str | list[str]) -> None:
    """Every named target is the last part of some linear layer's name in `model`: a typo would otherwise
    leave peft to fail deep in its own code, or (for a partly right list) train fewer layers than asked."""
    if targets == "all-linear":
        return
    linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    missing = [target for target in targets if target not in linear]
    if missing:
        raise UserError(
            f"model.lora.target_modules: {', '.join(missing)} is not a linear layer of this model; "
            f'its linear layers are {", ".join(sorted(linear))} (or use "all-linear")'
        )


def add_adapters(model: torch.nn.Module, settings: dict[str, Any], seed: int = 0):
    """Freeze `model` and inject LoRA adapters into it in place; returns the peft wrapper (`model` itself,
    now holding the adapters, is what trains and samples).  A is drawn at random (B = 0) from `seed`, not
    from the process's RNG: a run is the same whatever ran before it, and every rank starts alike."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError(
            'model.lora needs the peft package: pip install torch==2.13.0 -e ".[lora]" (or pip install peft)'
        ) from None
    check_targets(model, settings["target_modules"])
    check_rank(settings["r"], model.config.hidden_size)
    config = LoraConfig(
        r=settings["r"],
        lora_alpha=settings["alpha"],
        lora_dropout=settings["dropout"],
        target_modules=settings["target_modules"],
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore", FutureWarning)  # peft asks the model a question transformers 5 renamed
        torch.default_generator.manual_seed(seed)  # peft draws A on the host; an accelerator's RNG is not touched
        return get_peft_model(model, config)


def merged_weights(model: torch.nn.Module):
    """(Hugging Face name, tensor) of each weight the policy samples with: a LoRA layer's base weight with
    its active adapters' W + (α/r)·B·A merged in (in float32, as the final model's merge), other weights as
    they are.  For an engine that holds its own copy of the model; the module itself is not changed."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft, so no adapters
        LoraLayer = ()  # noqa: N806
    merged = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer) and not module.disable_adapters:
                weight = module.get_base_layer().weight.float()
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        weight = weight + module.get_delta_weight(adapter).float()
                merged[f"{name}.base_layer.weight"] = weight
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        yield name.replace(".base_layer.", "."), merged.get(name, tensor).detach()


def store_frozen_base(model: torch.nn.Module, dtype: torch.dtype | None) -> bool:
    """Keep the frozen linear layers (the base under the adapters) in `dtype`, the run's bf16 autocast, where
    that loses nothing: when every one of their values is a bf16 number already, as in checkpoints shipped
    in bf16 (most hub models; atrctl loads them in float32, exactly).  Autocast casts them to bf16 before
    every product anyway, so training computes the same numbers in half the base's memory.  A base with
    float32 precision (a warmed-up preset, say) keeps it.  Returns whether the base was stored in `dtype`.
    A layer whose weight is the input embedding's (a tied head) stays float32: the lookup is not cast.
    Every pass of such a model must then run under that autocast (the training step's all do): outside it, a float32
    input meets a bf16 weight and the product fails on the dtypes."""
    if dtype is None:
        return False
    frozen = [layer for layer in linears_autocast_casts(model) if not any(p.requires_grad for p in layer.parameters())]
    with torch.no_grad():
        exact = all(torch.equal(p, p.to(dtype).to(p.dtype)) for module in frozen for p in module.parameters())
    if not (frozen and exact):
        return False
    for module in frozen:
        module.to(dtype)
    return True


def trains_adapters(model: torch.nn.Module) -> bool:
    """Whether `model` holds frozen weights beside trained ones (LoRA): a checkpoint then stores only these."""
    return any(not parameter.requires_grad for parameter in model.parameters())


def adapter_line(model: torch.nn.Module) -> str:
    """How much of the model trains, and what the frozen base weighs, for the user to read at the start of a
    LoRA run."""
    trained = sum(p.numel() for p in trained_parameters(model))
    total = sum(p.numel() for p in model.parameters())
    frozen = [p for p in model.parameters() if not p.requires_grad]
    base_mib = sum(p.numel() * p.element_size() for p in frozen) / 2**20
    stored = "bf16 where autocast casts it" if any(p.dtype == torch.bfloat16 for p in frozen) else "float32"
    return (f"LoRA: {trained:,} of {total:,} parameters train ({trained / total:.2%}); the base stays frozen "
            f"({base_mib:,.1f} MiB, {stored})")  # fmt: skip


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [parameter for parameter in model.parameters() if parameter.requires_grad]


def reference_pass(adapters):
    """The context in which the policy module computes the reference policy: its adapters off."""
    return adapters.disable_adapter()


def write_final_model(adapters, directory: Path) -> None:
    """The finished run's model/: the base with the adapters merged in (a plain transformers model, what
    `atrctl eval` and compare load) and, in model/adapter/, the adapters alone in peft's format
    (`PeftModel.from_pretrained(base, "model/adapter")`).  Merging changes the module in place: call it
    when training is over.  The merge runs in float32 on the host, whatever the device: a base stored in bf16
    (`store_frozen_base`) upcasts exactly, so the merged model is the one a float32 base gives, to the bit."""
    adapters.save_pretrained(Path(directory) / "adapter")
    adapters.to("cpu", torch.float32)
    adapters.merge_and_unload().save_pretrained(directory)
