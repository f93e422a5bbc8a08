"""`atrctl compare`: train several algorithms from one base with the same seeds, evaluate them on the
same problems, and say which differences are larger than their uncertainty.

Fairness is structural: every arm's recipe differs only in `algo`, every arm starts from the one cached
base (passed to the runs as a model directory, so nothing is warmed up twice), seed s means the same
prompt order in every arm, and every final model is evaluated on the same held-out problems with the
same n and sampling seed.  Runs are ordinary `atrctl train` runs in <compare>/runs/, launched as
subprocesses (`--jobs` at a time), so an interrupted comparison resumes them where they stopped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from atrctl import io
from atrctl.config import Recipe, recipe_to_dict, to_toml
from atrctl.errors import UserError
from atrctl.losses import POLICY_LOSSES


@dataclass(frozen=True)
class Arm:
    """One side of the comparison: a registered loss trained here, or an existing run directory."""

    label: str
    loss: str | None = None  # trained here with this loss
    run_dir: Path | None = None  # or an existing run, used as it is (one seed)


def parse_arms(names: Sequence[str]) -> list[Arm]:
    """Loss names become trained arms; an existing run directory (with model/) is taken as it is."""
    if len(names) < 2:
        raise UserError("compare needs at least two arms, e.g. `atrctl compare grpo atr`")
    arms = []
    for name in names:
        path = Path(name)
        if name in POLICY_LOSSES:
            arms.append(Arm(label=name, loss=name))
        elif (path / "model").is_dir() and (path / "config.toml").is_file():
            arms.append(Arm(label=path.name, run_dir=path))
        else:
            raise UserError(f"unknown arm '{name}': give a loss ({', '.join(POLICY_LOSSES)}) "
                            "or a finished run directory such as results/<run>")
    labels = [arm.label for arm in arms]
    if len(set(labels)) != len(labels):
        raise UserError(f"arms must differ; got {', '.join(labels)}")
    return arms


def arm_recipe(recipe: Recipe, arm: Arm, base: str, loss_args: dict[str, dict]) -> Recipe:
    """The shared recipe with only the algorithm changed, starting from the shared base directory."""
    algo = dataclasses.replace(recipe.algo, loss=arm.loss, args=dict(loss_args.get(arm.loss, {})))
    model = dataclasses.replace(recipe.model, base=base)
    return dataclasses.replace(recipe, algo=algo, model=model)


# ------------------------------------------------------------------ training jobs


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
        summary = self.directory / "summary.json"
        return summary.is_file() and "final" in json.loads(summary.read_text())


def training_jobs(arms: Sequence[Arm], seeds: int, recipes: dict[str, Path], runs: Path) -> list[Job]:
    """One `atrctl train` per (trained arm, seed); a run with a checkpoint is resumed, a finished one kept."""
    jobs = []
    for seed in range(seeds):
        for arm in arms:
            if arm.loss is None:
                continue
            directory = runs / f"{arm.label}-s{seed}"
            base = [sys.executable, "-m", "atrctl", "train"]
            if (directory / "checkpoint").is_dir():
                command = [*base, "--resume", str(directory)]
            else:
                command = [*base, "--recipe", str(recipes[arm.label]), "--seed", str(seed), "--name",
                           directory.name, "--results", str(runs), "--overwrite"]
            jobs.append(Job(arm, seed, directory, command, runs / f"{directory.name}.log"))
    return jobs


def steps_done(job: Job) -> int:
    metrics = job.directory / "metrics.jsonl"
    return sum(1 for _ in metrics.open()) if metrics.is_file() else 0


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
                with job.log.open("w") as log:
                    job.process = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT, env=env)
                running.append(job)
            time.sleep(0.5)
            for job in [j for j in running if j.process.poll() is not None]:
                running.remove(job)
                if job.process.returncode != 0:
                    tail = job.log.read_text().strip().splitlines()[-1:] or ["(no output)"]
                    raise UserError(f"training {job.directory.name} failed ({tail[0].strip()}); "
                                    f"full log: {job.log}; rerun the same command to resume")
            if on_progress is not None:
                on_progress(sum(steps_done(job) for job in jobs))
    finally:
        for job in running:  # Ctrl-C or a failed sibling: stop the others; their checkpoints resume them
            job.process.terminate()
        for job in running:
            job.process.wait()


# ------------------------------------------------------------------ the comparison


@dataclass
class Comparison:
    """What `compare` resolved: where it writes and what it trains."""

    directory: Path
    arms: list[Arm]
    seeds: int
    recipe: Recipe
    loss_args: dict[str, dict]

    def record(self) -> dict:
        return {"arms": [arm.label for arm in self.arms], "seeds": self.seeds, "loss_args": self.loss_args,
                "recipe": recipe_to_dict(self.recipe)}


def prepare(comparison: Comparison, overwrite: bool) -> None:
    """Create the comparison directory, or continue one made by the same command; anything else is refused."""
    marker = comparison.directory / "compare.json"
    record = comparison.record()
    if marker.is_file():
        if _same_record(json.loads(marker.read_text()), json.loads(json.dumps(record))):
            return  # the same comparison: finished runs are kept, interrupted ones resume
        if not overwrite:
            raise UserError(f"{comparison.directory} holds a different comparison; pick another --name "
                            "or pass --overwrite to replace it")
    elif comparison.directory.exists() and any(comparison.directory.iterdir()) and not overwrite:
        raise UserError(f"{comparison.directory} already exists; pick another --name or pass --overwrite")
    if overwrite and comparison.directory.exists():
        import shutil

        shutil.rmtree(comparison.directory)
    comparison.directory.mkdir(parents=True, exist_ok=True)
    io.write_text(marker, json.dumps(record, indent=2) + "\n")


def _same_record(recorded: dict, current: dict) -> bool:
    """Whether a recorded comparison is this one; a recipe key added since then takes its default."""
    from atrctl.config import recipe_from_dict

    try:
        recorded = {**recorded, "recipe": recipe_to_dict(recipe_from_dict(recorded["recipe"]))}
    except (UserError, KeyError, TypeError):
        return False
    return recorded == current


def write_arm_recipes(comparison: Comparison, base: str) -> dict[str, Path]:
    paths = {}
    for arm in comparison.arms:
        if arm.loss is None:
            continue
        path = comparison.directory / "recipes" / f"{arm.label}.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        io.write_text(path, to_toml(recipe_to_dict(arm_recipe(comparison.recipe, arm, base, comparison.loss_args))))
        paths[arm.label] = path
    return paths


def arm_runs(comparison: Comparison) -> dict[str, list[Path]]:
    """Each arm's run directories, seed by seed."""
    runs = comparison.directory / "runs"
    return {arm.label: [arm.run_dir] if arm.run_dir else [runs / f"{arm.label}-s{s}" for s in range(comparison.seeds)]
            for arm in comparison.arms}


# ------------------------------------------------------------------ evaluation and report


def evaluate_arms(comparison: Comparison, n: int, problems: int,
                  on_progress: Callable[[str, int, int], None] | None = None) -> dict[str, list]:
    """Every final model on the same held-out problems, with the same n and sampling seed."""
    from atrctl.config import recipe_of_run
    from atrctl.evaluate import evaluate_model
    from atrctl.models import load_model
    from atrctl.tasks import get_task

    recipe = comparison.recipe
    task = get_task(recipe.task.name, **recipe.task.args)
    held_out = task.problems("test", problems, recipe.eval.seed)
    results: dict[str, list] = {}
    for label, directories in arm_runs(comparison).items():
        results[label] = []
        for directory in directories:
            run_recipe = recipe_of_run(directory)
            if (run_recipe.task.name, run_recipe.task.args) != (recipe.task.name, recipe.task.args):
                raise UserError(f"{directory} was trained on task {run_recipe.task.name} {run_recipe.task.args}, "
                                f"not {recipe.task.name} {recipe.task.args}: compare runs of one task")
            model, tokenizer = load_model(str(directory / "model"), recipe.model.device, recipe.model.dtype)
            result = evaluate_model(
                model, tokenizer, task, held_out, n=n, temperature=recipe.eval.temperature, seed=recipe.eval.seed,
                max_new_tokens=run_recipe.rollout.max_new_tokens, chat_template=recipe.task.chat_template,
                on_progress=None if on_progress is None else
                (lambda done, total, name=directory.name: on_progress(name, done, total)))
            results[label].append(result)
    return results
