"""Warmed-up base models, cached by everything that determines them.

Two arms of a comparison must start from the identical policy.  A base is therefore stored once under
results/bases/<key>/ (an ordinary Hugging Face model directory plus base.json with its measured
accuracy), where the key hashes the task, the preset, the architecture and the warm-up settings, and
every later run reuses it.  Real models (a hub name or a directory) need no warm-up and pass through.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from atrctl.config.schema import Recipe
from atrctl.errors import UserError
from atrctl.files import atomic
from atrctl.files.destinations import writing
from atrctl.files.records import NUMBER, DamagedFile, read_json
from atrctl.model.loading import CHAR_ALPHABET, PRESETS

BASE_FORMAT = 1  # bump when the warm-up procedure changes what a key produces


def resolved_task_args(name: str, args: dict) -> dict:
    """The task's parameters with its defaults filled in, so {} and {digits = 3} name the same base."""
    from atrctl.tasks import TASKS

    signature = inspect.signature(TASKS[name]) if name in TASKS else None
    defaults = (
        {key: p.default for key, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}
        if signature
        else {}
    )
    return {**defaults, **args}


def base_identity(recipe: Recipe) -> dict:
    """Everything that determines a warmed-up preset (device and dtype are deliberately not part of it)."""
    return {
        "format": BASE_FORMAT,
        "task": recipe.task.name,
        "task_args": resolved_task_args(recipe.task.name, recipe.task.args),
        "preset": recipe.model.base,
        "preset_shape": PRESETS[recipe.model.base],
        "arch": recipe.model.arch,
        "alphabet": CHAR_ALPHABET,
        "warmup": dataclasses.asdict(recipe.warmup),
        **({"instruction": recipe.task.instruction} if recipe.task.instruction != "auto" else {}),
    }


def base_key(recipe: Recipe) -> str:
    text = json.dumps(base_identity(recipe), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_base_info(path: str | Path, identity: dict | None = None) -> dict | None:
    """base.json of the cached base at `path` (None where there is none), checked to be what a warm-up wrote
    for `identity`.  A damaged one is one line saying how to build it again: the base is renamed into place
    complete, so a directory without a sound base.json was changed after the fact."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return None
    fix = f"delete {path} and rerun to warm the base up again"
    info = read_json(path / "base.json", fix, {"identity": dict, "accuracy": NUMBER, "steps": int, "seconds": NUMBER})
    if identity is not None and info["identity"] != json.loads(json.dumps(identity)):
        raise DamagedFile(path / "base.json", "records another warm-up than its folder's name", fix)
    return info


def cached_base(recipe: Recipe, results: str | Path) -> dict | None:
    """The recorded info of the recipe's cached base (None for none, or a real model): read before any work, so
    a damaged one is refused before a comparison claims its folder."""
    if recipe.model.base not in PRESETS:
        return None
    return read_base_info(Path(results) / "bases" / base_key(recipe), base_identity(recipe))


def ensure_base(
    recipe: Recipe,
    results: str | Path = "results",
    on_progress: Callable[[int, int, float, float | None], None] | None = None,
) -> tuple[Path | str, dict]:
    """(model location, info): the cached warm base of a preset, built first if missing; else the model as named.

    A new base is written to a temporary directory and renamed into place, so an interrupted warm-up
    never leaves a half-written base that a later run would trust.
    """
    if recipe.model.base not in PRESETS:
        return recipe.model.base, {}
    target = Path(results) / "bases" / base_key(recipe)
    info = cached_base(recipe, results)
    if info is not None:
        return target, info

    from atrctl.model.loading import build_char_tokenizer, build_model
    from atrctl.model.numerics import resolve_device
    from atrctl.rollout.prompts import prompt_style
    from atrctl.runtime.allocator import keep_freed_memory
    from atrctl.runtime.machine import requested_threads, set_cpu_threads
    from atrctl.tasks import get_task
    from atrctl.training.warmup import warm_up

    task = get_task(recipe.task.name, **recipe.task.args)
    requested_threads()  # a bad ATRCTL_THREADS is refused before bases/ is made
    try:  # before the warm-up, not after it
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(target.parent, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as error:
        raise UserError(f"cannot write to {target.parent} ({error.strerror}); choose a writable --results") from None
    set_cpu_threads()
    keep_freed_memory()
    tokenizer = build_char_tokenizer()
    model = build_model(recipe.model.base, tokenizer, arch=recipe.model.arch, seed=recipe.warmup.seed)
    model.to(resolve_device(recipe.model.device))
    style = prompt_style(task, chat_template=False, instruction=recipe.task.instruction)  # presets have no chat
    result = warm_up(model, tokenizer, task, recipe.warmup, on_progress, style)

    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        with writing(target):  # a full disk is an OSError here whatever the library says
            model.to("cpu").save_pretrained(staging)
            tokenizer.save_pretrained(staging)
        info = {
            "identity": base_identity(recipe),
            "accuracy": result.accuracy,
            "steps": result.steps,
            "seconds": round(result.seconds, 2),
            "history": result.history,
        }
        atomic.write_text(staging / "base.json", json.dumps(info, indent=2) + "\n")
        os.chmod(staging, 0o755)
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if read_base_info(target) is None:  # not a concurrent builder winning the race: a real failure
            raise
    return target, read_base_info(target)
