"""Resumable training state, written atomically and loaded without unpickling arbitrary objects.

A checkpoint is a directory: the trained weights as safetensors (every weight, or the LoRA adapters
alone when the base is frozen), the optimiser state through torch.save (read back with
weights_only=True: tensors and plain containers only), and the step, counters and RNG states as JSON.
A model sharded with FSDP is gathered into the same files (`atrctl.training.sharding`), so a run resumes at any
number of processes, sharded or not.  It is written beside the old one and swapped in by rename; the one
it replaces is kept as `checkpoint.previous`, so a crash at any moment leaves a complete checkpoint
behind, and a checkpoint damaged later (a disk error, a truncated copy) still leaves the one before.
A finished run drops its previous checkpoint: its final model is in place, and the last checkpoint alone
is what training it further needs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from atrctl.errors import UserError, first_line
from atrctl.files import atomic
from atrctl.files.destinations import writing
from atrctl.files.records import DamagedFile, read_json


@dataclass
class TrainState:
    """What, besides weights and optimiser, a resumed run needs to continue identically.

    Rollout sampling keeps no generator state: each chunk's generator is seeded from (seed, step,
    position) (`atrctl.training.batching`), so the step alone places a resumed run at any world size.
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
    weights: str = "full"  # what model.safetensors holds: "full" (every weight) or "lora" (the adapters alone)


def capture_rng(state: TrainState) -> None:
    state.torch_rng = torch.get_rng_state().tolist()
    version, internal, gauss = random.getstate()
    state.python_rng = [version, list(internal), gauss]


def restore_rng(state: TrainState) -> None:
    torch.set_rng_state(torch.tensor(state.torch_rng, dtype=torch.uint8))
    version, internal, gauss = state.python_rng
    random.setstate((version, tuple(internal), gauss))


def checkpointed(model) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of `model` stores, by name: every weight, or only the trained ones beside a
    frozen base (LoRA adapters)."""
    from atrctl.model.adapters import trains_adapters

    if trains_adapters(model):
        return {name: p for name, p in model.named_parameters() if p.requires_grad}
    return model.state_dict()


def checkpoint_contents(model, optimizer) -> tuple[dict[str, torch.Tensor], dict] | None:
    """(trained weights on the CPU, optimiser state) to checkpoint.  Every rank calls it (a sharded model is
    gathered: a collective); the contents come back on rank 0, None on the others."""
    from atrctl.model.loading import is_sharded
    from atrctl.runtime import distributed
    from atrctl.training import sharding

    if is_sharded(model):
        return sharding.full_contents(model, optimizer)
    if not distributed.is_main():
        return None
    weights = {name: tensor.detach().to("cpu").contiguous() for name, tensor in checkpointed(model).items()}
    return weights, optimizer.state_dict()


def save_checkpoint(directory: Path, model, optimizer, state: TrainState) -> None:
    """`checkpoint_contents` of a model that is not sharded, written by `write_checkpoint`."""
    write_checkpoint(directory, checkpoint_contents(model, optimizer), state)


def write_checkpoint(directory: Path, contents: tuple[dict[str, torch.Tensor], dict], state: TrainState) -> None:
    """Write the checkpoint to a staging directory, then swap it in; the old one becomes the previous."""
    directory, (weights, optimizer_state) = Path(directory), contents
    for stale in directory.parent.glob(f".{directory.name}.*"):  # left by a save killed mid-write
        shutil.rmtree(stale, ignore_errors=True)  # (safe: a run has one writer, `rundir.exclusive`)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        with writing(directory):
            save_file(_untie(weights), staging / "model.safetensors")
            torch.save(optimizer_state, staging / "optimizer.pt")
            atomic.write_text(staging / "state.json", json.dumps(asdict(state)) + "\n")
        os.chmod(staging, 0o755)  # mkdtemp makes it private; a checkpoint is an ordinary result
        if directory.exists():  # else a crash came between the two renames: the previous one is what there is
            shutil.rmtree(previous_checkpoint(directory), ignore_errors=True)
            directory.rename(previous_checkpoint(directory))
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def previous_checkpoint(directory: Path) -> Path:
    return Path(directory).with_name(Path(directory).name + ".previous")


def find_checkpoint(directory: Path) -> Path | None:
    """The newest checkpoint that looks complete: `directory`, else the previous one."""
    for candidate in (Path(directory), previous_checkpoint(directory)):
        if (candidate / "state.json").is_file():
            return candidate
    return None


def load_latest_checkpoint(directory: Path, model, optimizer) -> tuple[TrainState, Path, str | None]:
    """Load the newest intact checkpoint in place: (its state, its path, a note saying why it is the previous
    one, or None).  Nothing intact: the UserError naming what is wrong with the newest."""
    problems = []
    for candidate in (Path(directory), previous_checkpoint(directory)):
        if not candidate.exists():
            problems.append(f"{candidate} is missing")
            continue
        try:
            state = load_checkpoint(candidate, model, optimizer)
        except UserError as error:
            problems.append(str(error))
            continue
        note = None if not problems else f"{problems[0]}; resumed from the previous checkpoint (step {state.step})"
        return state, candidate, note
    damaged = [problem for problem in problems if not problem.endswith(" is missing")]
    raise UserError((damaged or problems)[0])


def promote_previous(directory: Path) -> None:
    """After a resume from the previous checkpoint: it becomes the checkpoint, and the damaged newer one is
    set aside under a staging name (removed by the next save), so the next save keeps an intact previous."""
    directory = Path(directory)
    if directory.exists():
        damaged = directory.with_name(f".{directory.name}.damaged")
        shutil.rmtree(damaged, ignore_errors=True)
        directory.rename(damaged)
    previous_checkpoint(directory).rename(directory)


WEIGHTS_KINDS = {"full": "every weight", "lora": "LoRA adapters"}


def load_checkpoint(directory: Path, model, optimizer) -> TrainState:
    """Load weights and optimiser state in place (every rank, sharded or not); return the saved TrainState."""
    from atrctl.model.adapters import trains_adapters
    from atrctl.model.loading import is_sharded
    from atrctl.training import sharding

    state, sharded = read_state(directory), is_sharded(model)
    expected = "lora" if trains_adapters(model) else "full"
    if state.weights != expected:  # before reading a byte of weights: say what differs, not which names are missing
        raise UserError(
            f"checkpoint {directory} holds {WEIGHTS_KINDS[state.weights]} but the recipe trains "
            f"{WEIGHTS_KINDS[expected]} (model.lora is {'set' if expected == 'lora' else 'off'}); resume with the "
            "recipe the run was started with"
        )
    # a sharded model reads the full tensors on the host and keeps its part of each: never the whole on its device
    device = torch.device("cpu") if sharded else next(model.parameters()).device
    try:
        weights = load_file(directory / "model.safetensors", device=str(device))
    except (OSError, SafetensorError) as error:
        raise UserError(f"{directory / 'model.safetensors'} is missing or damaged ({error}); the run cannot resume "
                        "from it") from None  # fmt: skip
    names = set(checkpointed(model))
    missing, unexpected = sorted(names - set(weights)), sorted(set(weights) - names)
    if missing or unexpected:  # a checkpoint of another model: never resume from half of it
        listed = ", ".join((missing or unexpected)[:3])
        raise UserError(
            f"checkpoint {directory} does not match the model ({'missing' if missing else 'unexpected'} "
            f"weights: {listed}); resume with the recipe the run was started with"
        )
    if sharded:
        sharding.load_full_weights(model, weights)
    else:
        model.load_state_dict(weights, strict=False)  # strict=False: a LoRA checkpoint has no base weights
    del weights
    try:
        with warnings.catch_warnings():  # a damaged file is reported below, in one line, not as torch's warning
            warnings.simplefilter("ignore", UserWarning)
            saved = torch.load(directory / "optimizer.pt", map_location=device, weights_only=True,
                               mmap=sharded)  # fmt: skip
        if sharded:
            sharding.load_full_optimizer_state(optimizer, saved)
        else:
            optimizer.load_state_dict(saved)
    except Exception as error:  # the unpickler meets garbage with any error (IndexError on a torn file, ...)
        raise UserError(f"{directory / 'optimizer.pt'} is missing or damaged ({first_line(error)}); the run "
                        "cannot resume from it") from None  # fmt: skip
    return state


def read_state(directory: Path) -> TrainState:
    """The TrainState saved in directory/state.json; a file that is not one is a UserError naming it."""
    path = Path(directory) / "state.json"
    fix = "the run cannot resume from it"
    data = read_json(path, fix, {"step": int})
    try:
        state = TrainState(**data)
    except TypeError as error:
        raise DamagedFile(path, first_line(error), fix) from None
    counters = (state.step, state.bad_steps, state.skipped_steps)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counters):
        raise DamagedFile(path, "step and counters must be integers >= 0", fix)
    if not isinstance(state.weights, str) or state.weights not in WEIGHTS_KINDS:
        raise DamagedFile(path, f"weights must be one of {', '.join(WEIGHTS_KINDS)}", fix)
    if not isinstance(state.unverified_update, bool):
        raise DamagedFile(path, "unverified_update must be true or false", fix)
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
