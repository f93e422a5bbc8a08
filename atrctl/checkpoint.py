"""Resumable training state, written atomically and loaded without unpickling arbitrary objects.

A checkpoint is a directory: model weights as safetensors, the optimiser state through
torch.save (read back with weights_only=True: tensors and plain containers only), and the step,
counters and RNG states as JSON.  It is written beside the old one and swapped in by rename, so a
crash at any moment leaves a complete checkpoint behind.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from atrctl import atomic
from atrctl.errors import UserError


@dataclass
class TrainState:
    """What, besides weights and optimiser, a resumed run needs to continue identically.

    Rollout sampling keeps no generator state: each chunk's generator is seeded from (seed, step,
    position) (`atrctl.batching`), so the step alone places a resumed run at any world size.
    """

    step: int = 0
    bad_steps: int = 0  # consecutive bad steps (non-finite loss or gradient, or an undone update)
    skipped_steps: int = 0  # all skipped steps
    # the last step applied an update no sampling has yet shown to be sound; until one has, it may still be
    # undone, so bad_steps is not reset (train._sample_or_undo)
    unverified_update: bool = False
    torch_rng: list[int] = field(default_factory=list)
    python_rng: list = field(default_factory=list)
    recipe: dict = field(default_factory=dict)  # the recipe trained with, so a resume can refuse an edited one


def capture_rng(state: TrainState) -> None:
    state.torch_rng = torch.get_rng_state().tolist()
    version, internal, gauss = random.getstate()
    state.python_rng = [version, list(internal), gauss]


def restore_rng(state: TrainState) -> None:
    torch.set_rng_state(torch.tensor(state.torch_rng, dtype=torch.uint8))
    version, internal, gauss = state.python_rng
    random.setstate((version, tuple(internal), gauss))


def save_checkpoint(directory: Path, model, optimizer, state: TrainState) -> None:
    """Write the checkpoint to a staging directory, then swap it in for the old one."""
    directory = Path(directory)
    for stale in directory.parent.glob(f".{directory.name}.*"):  # left by a save killed mid-write
        shutil.rmtree(stale, ignore_errors=True)  # (safe: a run has one writer, `rundir.exclusive`)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        weights = {name: tensor.detach().to("cpu").contiguous() for name, tensor in model.state_dict().items()}
        save_file(_untie(weights), staging / "model.safetensors")
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        atomic.write_text(staging / "state.json", json.dumps(asdict(state)) + "\n")
        os.chmod(staging, 0o755)  # mkdtemp makes it private; a checkpoint is an ordinary result
        previous = directory.with_name(directory.name + ".old")
        if directory.exists():
            # a complete checkpoint is in place, so an .old beside it is a leftover of a crash after the
            # swap; it would block the rename below (a non-empty directory is never replaced)
            shutil.rmtree(previous, ignore_errors=True)
            directory.rename(previous)
        staging.rename(directory)
        shutil.rmtree(previous, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def find_checkpoint(directory: Path) -> Path | None:
    """The checkpoint directory, or the previous one if a crash hit between the two renames."""
    directory = Path(directory)
    for candidate in (directory, directory.with_name(directory.name + ".old")):
        if (candidate / "state.json").is_file():
            return candidate
    return None


def load_checkpoint(directory: Path, model, optimizer) -> TrainState:
    """Load weights and optimiser state in place; return the saved TrainState."""
    device = next(model.parameters()).device
    state = read_state(directory)
    try:
        weights = load_file(directory / "model.safetensors", device=str(device))
    except (OSError, SafetensorError) as error:
        raise UserError(f"{directory / 'model.safetensors'} is missing or damaged ({error}); the run cannot resume "
                        "from it") from None  # fmt: skip
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:  # a checkpoint of another model: never resume from half of it
        names = ", ".join((missing or unexpected)[:3])
        raise UserError(
            f"checkpoint {directory} does not match the model ({'missing' if missing else 'unexpected'} "
            f"weights: {names}); resume with the recipe the run was started with"
        )
    try:
        with warnings.catch_warnings():  # a damaged file is reported below, in one line, not as torch's warning
            warnings.simplefilter("ignore", UserWarning)
            saved = torch.load(directory / "optimizer.pt", map_location=device, weights_only=True)
        optimizer.load_state_dict(saved)
    except (OSError, RuntimeError, ValueError, pickle.UnpicklingError, EOFError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"{directory / 'optimizer.pt'} is missing or damaged ({reason}); the run cannot resume "
                        "from it") from None  # fmt: skip
    return state


def read_state(directory: Path) -> TrainState:
    """The TrainState saved in directory/state.json; a file that is not one is a UserError naming it."""
    path = Path(directory) / "state.json"
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "step" not in data:
            raise TypeError("no step recorded")
        state = TrainState(**data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as error:
        raise UserError(f"{path} is not a training state ({error}); the run cannot resume from it") from None
    counters = (state.step, state.bad_steps, state.skipped_steps)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counters):
        raise UserError(f"{path} is not a training state (step and counters must be integers >= 0)")
    if not isinstance(state.unverified_update, bool):
        raise UserError(f"{path} is not a training state (unverified_update must be true or false)")
    return state


def _untie(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage (tied embeddings): store a copy of each repeated tensor."""
    seen: set[int] = set()
    out = {}
    for name, tensor in weights.items():
        pointer = tensor.data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out
