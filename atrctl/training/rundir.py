"""The run directory: the one module that knows where a run's files are and how to read and write them.

    <run>/config.toml     the resolved recipe, plus an [environment] table of provenance
    <run>/metrics.jsonl   one JSON record per RL step, appended as the run goes
    <run>/checkpoint/     the latest resumable state (`atrctl.training.checkpoint`)
    <run>/model/          the final policy, Hugging Face format
    <run>/eval/           `atrctl eval`'s passk.csv / passk.md / passk.png
    <run>/summary.json    {"base": ...} from the start, then the final figures
    <run>/tensorboard/    event files when asked for

A run is *finished* once model/ exists: it is renamed into place after the final summary is written, so
nothing else needs checking; it is *evaluated* once eval/passk.csv exists (written last of the three).
docs/design.md §5 has the meaning of every file.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from atrctl import __version__
from atrctl.errors import UserError
from atrctl.files import atomic
from atrctl.files.destinations import check_destination, writing
from atrctl.files.records import read_json

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    import torch

    from atrctl.config.schema import Recipe


class RunDir:
    """Paths and file rules of one run directory; cheap to make, touches nothing until asked."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = self.path / "config.toml"
        self.metrics = self.path / "metrics.jsonl"
        self.checkpoint = self.path / "checkpoint"
        self.model = self.path / "model"
        self.eval = self.path / "eval"
        self.summary = self.path / "summary.json"
        self.tensorboard = self.path / "tensorboard"
        self.samples = self.path / "samples"

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    # ------------------------------------------------------------ state

    @property
    def is_run(self) -> bool:
        """It holds a recorded recipe: a run was started here."""
        return self.config.is_file()

    @property
    def finished(self) -> bool:
        """Training completed (`finish` puts model/ in place last)."""
        return self.model.is_dir()

    @property
    def evaluated(self) -> bool:
        return has_evaluation(self.eval)

    def check_can_start(self, resume: bool, overwrite: bool, steps: int | None = None) -> None:
        """Refuse to clobber a run: an existing directory needs resume (continue) or overwrite (replace), and
        only a run is replaced; a finished run resumes only if `steps` (default: its config.toml's) are more
        than it trained.  An --overwrite that a crash interrupted is finished first (under the lock), so the
        answer is about the run as it should be."""
        from atrctl.training.checkpoint import find_checkpoint, read_state

        if aside(self.path).exists() or _sibling(self.path, "dropping").exists():
            with exclusive(self.path):
                self.recover()
        check_destination(self.path, "--name or --results", replace=overwrite, what=f"run directory {self.path}")
        owner = comparison_of(self.path)
        if owner is not None and not resume and os.environ.get(OWNER_VARIABLE) != str(owner.resolve()):
            raise UserError(
                f"{self.path} is a run of {owner}: rerun that comparison's command to train it (started or "
                "replaced by hand, the comparison's report would describe another run); --resume continues it"
            )
        if resume:
            checkpoint = find_checkpoint(self.checkpoint)
            if checkpoint is None:
                raise UserError(
                    f"{self.path} has no checkpoint to resume; start it anew with the same --name and --overwrite"
                )
            steps = self.recipe().run.steps if steps is None else steps
            if self.finished and read_state(checkpoint).step >= steps:
                raise UserError(f"{self.path} is finished: nothing to resume (raise run.steps in its config.toml "
                                "to train it longer)")  # fmt: skip
        elif self.path.exists() and any(self.path.iterdir()):
            if not overwrite:
                raise UserError(
                    f"run directory {self.path} already exists; pick another --name, "
                    f"or pass --resume to continue it or --overwrite to replace it"
                )
            if not self.is_run:
                raise UserError(f"{self.path} is not a run (it has no config.toml): --overwrite replaces only runs; "
                                "pick another --name")  # fmt: skip

    # ------------------------------------------------------------ config.toml

    def recipe(self) -> Recipe:
        """The recipe the run recorded (its [environment] table is provenance, not settings)."""
        from atrctl.config.loading import loads_toml, recipe_from_dict

        if not self.is_run:
            raise UserError(f"{self.path} has no config.toml: give a run directory such as results/<run>")
        try:
            data = loads_toml(self.config.read_text(encoding="utf-8"), str(self.config))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            raise UserError(f"{self.config} is not valid TOML ({error}): restore it, or start the run anew") from None
        data.pop("environment", None)
        return recipe_from_dict(data)

    def create(self, recipe: Recipe, environment: dict[str, str]) -> None:
        """Start the directory afresh with its config.toml.  An old run here (an approved --overwrite) is moved
        aside, not deleted: the first logged step deletes it (`append_metrics`), and a failure before that
        puts it back (`restore_replaced`)."""
        from atrctl.config.loading import recipe_to_dict, to_toml

        move_aside(self.path)
        self.path.mkdir(parents=True)
        atomic.write_text(self.config, to_toml({**recipe_to_dict(recipe), "environment": environment}))

    def restore_replaced(self) -> None:
        """Undo `create` for a new run that never logged a step (the first one drops the run it replaced): the
        run it replaced comes back, or, if it replaced none, the directory goes (it holds only what this
        attempt wrote), so that the same command can simply be run again."""
        if aside(self.path).exists():
            restore_aside(self.path)
        elif not self.read_metrics():
            shutil.rmtree(self.path, ignore_errors=True)

    def recover(self) -> None:
        """Finish an --overwrite a crash interrupted (see `recover`): the new run stays if it logged a step."""
        recover(self.path, started=bool(self.read_metrics()))

    # ------------------------------------------------------------ metrics.jsonl

    def read_metrics(self) -> list[dict]:
        """Every logged record, in order; a line cut short by a crash mid-write (or anything else that is not
        a JSON object with an integer step) is not a record."""
        if not self.metrics.is_file():
            return []
        records = []
        for line in self.metrics.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):  # else not one of ours
                records.append(record)
        return records

    def steps_logged(self) -> int:
        """Lines in metrics.jsonl: a cheap progress count for a run that another process is writing."""
        if not self.metrics.is_file():
            return 0
        with self.metrics.open() as handle:
            return sum(1 for _ in handle)

    def append_metrics(self, record: dict) -> None:
        with writing(self.metrics), open(self.metrics, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
        drop_aside(self.path)  # the new run has started: the one it replaced can go

    def trim_metrics(self, step: int) -> None:
        """On resume, drop records after the checkpoint's step (they will be run again) and any torn line."""
        if self.metrics.exists():
            kept = [record for record in self.read_metrics() if record["step"] <= step]
            atomic.write_text(self.metrics, "".join(json.dumps(record) + "\n" for record in kept))

    def last_eval(self) -> dict[str, float]:
        """The eval/... figures of the last evaluated step ({} if none was)."""
        evaluated = [record for record in self.read_metrics() if "eval/greedy" in record]
        return {k: v for k, v in evaluated[-1].items() if k.startswith("eval/")} if evaluated else {}

    # ------------------------------------------------------------ summary.json and model/

    def read_summary(self) -> dict:
        if not self.summary.exists():
            return {}
        return read_json(self.summary, "restore it, or start the run anew")

    def write_summary(self, summary: dict) -> None:
        atomic.write_text(self.summary, json.dumps(summary, indent=2) + "\n")

    def write_samples(self, step: int, rows: list[dict]) -> Path:
        """samples/step-<step>.jsonl: completions of a held-out check, to read what the policy writes."""
        self.samples.mkdir(exist_ok=True)
        path = self.samples / f"step-{step}.jsonl"
        atomic.write_jsonl(path, rows)
        return path

    def finish(self, write_model: Callable[[Path], None], tokenizer, summary: dict) -> None:
        """The final model in Hugging Face format (`write_model(directory)` writes it, e.g. a model's
        save_pretrained) and the final summary: the model is staged, the summary written, and only then is the
        model renamed into place, so model/ marks a finished run."""
        staging = self.path / ".model.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            with writing(self.model):
                write_model(staging)
                tokenizer.save_pretrained(staging)
            self.write_summary(summary)
        except BaseException:  # a full disk: the space goes back, the checkpoint stays the resume point
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(self.model, ignore_errors=True)
        staging.rename(self.model)


OWNER_VARIABLE = "ATRCTL_COMPARISON"
"""Set by compare and sweep for the training processes they start: the comparison that owns those runs."""
COMPARISON_MARKERS = ("compare.json", "sweep.json")


def comparison_of(path: str | Path) -> Path | None:
    """The comparison (or sweep) whose runs/ folder holds the run at `path`, None for a run of its own.  Only
    the comparison trains its runs: its report describes them by the recipes it recorded."""
    path = Path(path).absolute()
    owner = path.parent.parent
    if path.parent.name == "runs" and any((owner / marker).exists() for marker in COMPARISON_MARKERS):
        return owner
    return None


def bases_folder(path: str | Path, results: Path) -> Path:
    """The results folder whose bases/ holds the warm base of the run at `path`: a comparison's, for its runs
    (found from where the run is, so a moved results folder still resumes them), else `results`."""
    owner = comparison_of(path)
    return owner.parent if owner is not None else Path(results)


def has_evaluation(directory: Path) -> bool:
    """Whether `directory` (a run's eval/ or any --out folder) holds a complete evaluation: passk.csv is
    written last of its three files."""
    return (directory / "passk.csv").is_file()


def environment(device: torch.device) -> dict[str, str]:
    """Versions and device recorded beside the recipe, so a result says what produced it."""
    import torch
    import transformers

    from atrctl.runtime import distributed

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "atrctl": __version__,
        "git_commit": commit or "unknown",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": f"{device} ({name})",
        "threads": str(torch.get_num_threads()),
        "processes": str(distributed.world_size()),
    }


# ------------------------------------------------------------ one writer at a time


def _sibling(path: Path, suffix: str) -> Path:
    """A hidden sibling of `path` in the same folder (absolute, so that "." has a name too)."""
    path = Path(path).absolute()
    return path.with_name(f".{path.name}.{suffix}")


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold the write lock of a run or comparison directory for the block: a second process that asks for it
    is refused with one line.  An OS lock (flock) on a hidden sibling file: a killed holder leaves no stale
    lock, and the file itself stays (removing it would let two processes lock two different files)."""
    lock = _sibling(path, "lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a+")  # closed by the with below
    except OSError as error:
        raise UserError(f"cannot write to {lock.parent} ({error.strerror}); choose a writable --results") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise UserError(f"{path} is being written by {holder}: wait for it to finish, or stop it") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()}")
        handle.flush()
        yield  # closing the file releases the lock


# ------------------------------------------------------------ replacing a directory safely


def aside(path: Path) -> Path:
    """Where `move_aside` keeps the directory it replaces: a hidden sibling, inside the same results folder."""
    return _sibling(path, "replaced")


def move_aside(path: Path) -> None:
    """Make room for a new `path` without losing the old one.  If an earlier replacement never started, the
    directory kept aside is the last good one, and what stands at `path` is the failed attempt."""
    shutil.rmtree(_sibling(path, "dropping"), ignore_errors=True)
    if aside(path).exists():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.rename(aside(path))


def restore_aside(path: Path) -> None:
    """Put the directory kept aside back in place of `path` (nothing to do if none is kept)."""
    if aside(path).exists():
        shutil.rmtree(path, ignore_errors=True)
        aside(path).rename(path)


def drop_aside(path: Path) -> None:
    """The replacement has started: delete the directory kept aside (renamed first, so a delete cut short
    leaves no half-deleted directory that could pass for the one kept aside)."""
    if aside(path).exists():
        dropping = _sibling(path, "dropping")
        shutil.rmtree(dropping, ignore_errors=True)
        aside(path).rename(dropping)
        shutil.rmtree(dropping)


def recover(path: Path, started: bool) -> None:
    """Finish a replacement a crash interrupted: keep the new `path` if it `started`, else bring the old one
    back.  Called under the lock, before anything else looks at `path`."""
    shutil.rmtree(_sibling(path, "dropping"), ignore_errors=True)
    if aside(path).exists():
        (drop_aside if started else restore_aside)(path)


MAX_NAME_BYTES = 200  # file systems allow 255 per path component; staging names add a few


def check_name(name: str, flag: str = "--name") -> str:
    """A run (or comparison) name is one plain path component, so the run stays inside its results folder:
    no separators, not "." or "..", no leading dot (hidden and staging names), at most MAX_NAME_BYTES."""
    unsafe = {"/", "\\"} | {chr(code) for code in range(32)}  # separators and control characters
    if not name or name in (".", "..") or name.startswith(".") or unsafe & set(name) or name != name.strip():
        raise UserError(f"{flag} {name!r} is not a plain name: use letters, digits, '-', '_' or '.' (not first), "
                        "no '/'; runs live in --results")  # fmt: skip
    if len(name.encode()) > MAX_NAME_BYTES:
        raise UserError(f"{flag} is {len(name.encode())} bytes long: use at most {MAX_NAME_BYTES}")
    return name


def default_run_name(recipe: Recipe) -> str:
    """<loss>-<task>-s<seed>-<time>: readable, and distinct for runs started a second apart."""
    import time

    return f"{recipe.algo.loss}-{recipe.task.name}-s{recipe.run.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
