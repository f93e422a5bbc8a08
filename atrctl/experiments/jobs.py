"""The job runner: `atrctl train` runs as subprocesses, `--jobs` at a time, each told which comparison owns
it and ended with the comparison that started it; the algorithm itself knows nothing of them."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from atrctl.errors import UserError
from atrctl.experiments.arms import Arm
from atrctl.training.rundir import OWNER_VARIABLE, RunDir


@dataclass
class Job:
    arm: Arm
    seed: int
    directory: Path
    command: list[str]
    log: Path
    process: subprocess.Popen | None = None

    @property
    def finished(self) -> bool:
        return RunDir(self.directory).finished


def training_jobs(arms: Sequence[Arm], seeds: int, recipes: dict[str, Path], runs: Path) -> list[Job]:
    """One `atrctl train` per (trained arm, seed); a run with a checkpoint is resumed, a finished one kept."""
    jobs = []
    for seed in range(seeds):
        for arm in arms:
            if arm.loss is None:
                continue
            directory = runs / f"{arm.slug}-s{seed}"
            base = [sys.executable, "-m", "atrctl", "train"]
            if RunDir(directory).checkpoint.is_dir():
                command = [*base, "--resume", str(directory)]
            else:
                command = [
                    *base,
                    "--recipe",
                    str(recipes[arm.slug]),
                    "--seed",
                    str(seed),
                    "--name",
                    directory.name,
                    "--results",
                    str(runs),
                    "--overwrite",
                ]
            jobs.append(Job(arm, seed, directory, command, runs / f"{directory.name}.log"))
    return jobs


def run_jobs(jobs: Sequence[Job], parallel: int, on_progress: Callable[[int], None] | None = None) -> None:
    """Run the unfinished jobs, `parallel` at a time (one CPU thread each when parallel); fail on the first error."""
    pending = [job for job in jobs if not job.finished]
    env = {**os.environ, "ATRCTL_THREADS": os.environ.get("ATRCTL_THREADS", "1" if parallel > 1 else "")}
    if not env["ATRCTL_THREADS"]:
        del env["ATRCTL_THREADS"]
    running: list[Job] = []
    try:
        while pending or running:
            while pending and len(running) < parallel:
                job = pending.pop(0)
                job.log.parent.mkdir(parents=True, exist_ok=True)
                owner = {OWNER_VARIABLE: str(job.directory.parent.parent.resolve())}  # it may train its own runs
                with job.log.open("w") as log:
                    job.process = subprocess.Popen(
                        job.command,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env={**env, **owner},
                        preexec_fn=functools.partial(_end_with_parent, os.getpid()),
                    )
                running.append(job)
            time.sleep(0.5)
            for job in [j for j in running if j.process.poll() is not None]:
                running.remove(job)
                if job.process.returncode != 0:
                    tail = job.log.read_text().strip().splitlines()[-1:] or ["(no output)"]
                    raise UserError(
                        f"training {job.directory.name} failed ({tail[0].strip()}); "
                        f"full log: {job.log}; rerun the same command to resume"
                    )
            if on_progress is not None:
                on_progress(sum(RunDir(job.directory).steps_logged() for job in jobs))
    finally:
        for job in running:  # Ctrl-C or a failed sibling: stop the others; their checkpoints resume them
            job.process.terminate()
        for job in running:
            job.process.wait()


try:  # resolved here, in compare's process: a forked child should not load libraries before it execs
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the children outlive a killed compare, as before
    _PRCTL = None


def _end_with_parent(parent: int) -> None:
    """In a training child, before it runs: SIGTERM it when compare dies, even by SIGKILL, so no run is left
    training alone (Linux's PR_SET_PDEATHSIG; the child then checkpoints and stops as on Ctrl-C).  A compare
    that died before the call left the child an orphan already: it ends at once."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(143)
