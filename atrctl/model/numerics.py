"""Where and in what arithmetic a model computes: the device, the dtype of frozen copies, bf16 autocast.

One place decides bf16 against float32 (`numerics`), so the trainer, the evaluators and the checkpoints agree.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from atrctl.errors import UserError

if TYPE_CHECKING:
    import torch


DEVICES = ("auto", "cpu", "cuda")  # "auto" picks CUDA when present


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
    compiled: bool = False  # the policy's passes run compiled (model.compile, where `decoder_pass.compilable`)

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
