"""`atrctl compare`: train several algorithms from one base with the same seeds, evaluate them on the
same problems, and say which differences are larger than their uncertainty.

Fairness is structural: every arm's recipe differs only in `algo`, every arm starts from the one cached
base (passed to the runs as a model directory, so nothing is warmed up twice), seed s means the same
prompt order in every arm, and every final model is evaluated on the same held-out problems with the
same n and sampling seed.  Runs are ordinary `atrctl train` runs in <compare>/runs/, launched as
subprocesses (`--jobs` at a time), so an interrupted comparison resumes them where they stopped.

`plan_comparison` checks everything and writes nothing; `run_comparison` claims the directory under its lock
and does the work (base, training, evaluation, report), reporting progress through a callback, so the CLI
only displays.

"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from atrctl.config.loading import changed_keys, recipe_to_dict, to_toml
from atrctl.config.schema import Recipe
from atrctl.errors import UserError
from atrctl.experiments.arms import Arm, arm_recipe, check_distinct, parse_arms
from atrctl.experiments.jobs import run_jobs, training_jobs
from atrctl.files import atomic
from atrctl.files.destinations import check_destination
from atrctl.files.records import DamagedFile, read_json
from atrctl.training.rundir import RunDir, check_name, drop_aside, exclusive, move_aside, recover

log = logging.getLogger(__name__)  # notes on stderr: Python's last-resort handler prints the message alone

# advance(key, description, done, total, note): one progress line per key, made on its first call
Progress = Callable[[str, str, int, int, str], None]
# report(comparison, evaluations per arm label, ks, command, wall seconds by part, evaluations per benchmark)
# -> the table's rows
Report = Callable[["Comparison", dict[str, list], list[int], str, dict[str, float], dict[str, dict]], list[dict]]


@dataclass
class Comparison:
    """What `compare` resolved: where it writes and what it trains."""

    directory: Path
    arms: list[Arm]
    seeds: int
    recipe: Recipe
    loss_args: dict[str, dict]
    overwrite: bool = False  # replace what the directory holds (run_comparison does it, under the lock)
    kind: str = "compare"  # what made it: the marker file is <kind>.json ("sweep" for atrctl sweep)

    def record(self) -> dict:
        return {
            "arms": [arm.label for arm in self.arms],
            "seeds": self.seeds,
            "loss_args": self.loss_args,
            "recipe": recipe_to_dict(self.recipe),
        }


def prepare(comparison: Comparison, overwrite: bool) -> None:
    """Create the comparison directory, or continue one with the same shared setting (recipe and shared loss
    flags; arms and seeds may have been added or left out); anything else is refused (`check_claim`).  With
    `overwrite` the old one is replaced even when it is the same comparison (its runs are retrained)."""
    marker, record = comparison.directory / f"{comparison.kind}.json", comparison.record()
    recorded = check_claim(comparison, overwrite)
    if recorded is not None:
        if recorded != json.loads(json.dumps(record)):  # arms or seeds added: record them
            atomic.write_text(marker, json.dumps(record, indent=2) + "\n")
        return
    if overwrite:  # kept aside until the new comparison's runs are trained, restored if that fails
        move_aside(comparison.directory)
    comparison.directory.mkdir(parents=True, exist_ok=True)
    atomic.write_text(marker, json.dumps(record, indent=2) + "\n")


def check_claim(comparison: Comparison, overwrite: bool) -> dict | None:
    """The record of the comparison in its directory when this one continues it, None when it starts anew;
    refused when it may do neither: another setting or a damaged marker without `overwrite`, and anything but
    a comparison of its kind in the way (--overwrite replaces only that).  Reads only: `plan_comparison` asks
    before any work, `prepare` again under the lock."""
    directory = comparison.directory
    marker = directory / f"{comparison.kind}.json"
    check_destination(directory, "--name or --results", replace=overwrite, what=f"{comparison.kind} folder {directory}")
    if not directory.exists() or not any(directory.iterdir()):
        return None
    if not (marker.exists() or marker.is_symlink()):
        if overwrite:
            raise UserError(f"{directory} is not a {comparison.kind} (it has no {marker.name}): --overwrite "
                            f"replaces only a {comparison.kind}; pick another --name")  # fmt: skip
        raise UserError(f"{directory} already exists; pick another --name or pass --overwrite")
    if overwrite:
        return None
    shape = {"arms": list, "seeds": int, "loss_args": dict, "recipe": dict}
    recorded = read_json(marker, f"restore it, or pass --overwrite to train the {comparison.kind} anew", shape)
    if _same_record(recorded, json.loads(json.dumps(comparison.record()))):
        # the same shared setting: finished runs are kept, interrupted ones resume, and arms or seeds
        # added since are trained (a run's recipe is its label's and its seed's, whatever the others)
        return recorded
    raise UserError(
        f"{directory} holds a {comparison.kind} with another shared recipe or --max-kl3/--eps/"
        "--eps-high; pick another --name or pass --overwrite to replace it"
    )


def _same_record(recorded: dict, current: dict) -> bool:
    """Whether a recorded comparison shares this one's setting (recipe and shared loss flags), so its runs are
    this one's runs of the same label and seed; a recipe key added since then takes its default."""
    from atrctl.config.loading import recipe_from_dict

    try:
        recipe = _trained(recipe_to_dict(recipe_from_dict(recorded["recipe"])))
        return (recipe, recorded["loss_args"]) == (_trained(current["recipe"]), current["loss_args"])
    except (UserError, KeyError, TypeError, AttributeError):
        return False


WATCHING = ("tensorboard", "report_to")
"""run.* keys that say where a run is reported, not what it trains: a rerun that changes them is the same
comparison.  They apply to the runs it starts from then on; a run already started keeps its own (its
config.toml), and gets its evaluation's table there."""


def _trained(recipe: dict) -> dict:
    """What a comparison's runs train: the recipe without where they are reported or which benchmarks evaluate
    them afterwards (a rerun that adds a benchmark keeps its runs)."""
    return {**recipe, "run": {k: v for k, v in recipe["run"].items() if k not in WATCHING},
            "eval": {k: v for k, v in recipe.get("eval", {}).items() if k != "benchmarks"}}  # fmt: skip


def write_arm_recipes(comparison: Comparison) -> dict[str, Path]:
    paths = {}
    for arm in comparison.arms:
        if arm.loss is None:
            continue
        path = comparison.directory / "recipes" / f"{arm.slug}.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, to_toml(recipe_to_dict(trained_recipe(comparison, arm))))
        paths[arm.slug] = path
    return paths


def trained_recipe(comparison: Comparison, arm: Arm, seed: int | None = None) -> Recipe:
    """The recipe an arm's runs train (with `seed`'s run.seed where given): the shared one with the arm's loss,
    parameters and regime keys, from the shared base."""
    recipe = arm_recipe(comparison.recipe, arm, comparison.recipe.model.base, comparison.loss_args)
    if seed is not None:
        recipe.run.seed = seed
    return recipe


IGNORED = {("model", "base"), ("eval", "benchmarks"), *(("run", key) for key in ("tensorboard", "report_to"))}
"""Keys in which a kept run may differ from its arm: where it is reported, which benchmarks evaluate it after
training, and how its base was named (an absolute path before bases were found by key)."""


def check_kept_runs(comparison: Comparison) -> None:
    """Every run already in <comparison>/runs/ that the comparison would keep or resume must be its arm's at its
    seed (a run trained there by hand would otherwise be reported as the arm): one line naming what differs."""
    for seed in range(comparison.seeds):
        for arm in comparison.arms:
            run = RunDir(comparison.directory / "runs" / f"{arm.slug}-s{seed}")
            if arm.loss is None or not run.is_run or not (run.finished or run.checkpoint.is_dir()):
                continue
            want, have = recipe_to_dict(trained_recipe(comparison, arm, seed)), recipe_to_dict(run.recipe())
            differ = [f"{section}.{key}" for section, key in changed_keys(have, want, IGNORED)]
            if differ:
                raise UserError(
                    f"{run.path} is not arm '{arm.label}' at seed {seed} ({', '.join(differ)} differ): move it "
                    f"away, or pass --overwrite to train the {comparison.kind} anew"
                )


def arm_runs(comparison: Comparison) -> dict[str, list[Path]]:
    """Each arm's run directories, seed by seed."""
    runs = comparison.directory / "runs"
    return {
        arm.label: [arm.run_dir] if arm.run_dir else [runs / f"{arm.slug}-s{s}" for s in range(comparison.seeds)]
        for arm in comparison.arms
    }


def arm_evaluations(comparison: Comparison, benchmark: str | None = None) -> dict[str, list[Path]]:
    """Where each run's evaluation is kept, seed by seed: a run the comparison trained keeps it in its own eval/
    (eval-<benchmark>/ for a benchmark's); a run given as an arm is only read, so its evaluation goes to
    <comparison>/evals/<arm>/ (<arm>-<benchmark>/): the run may belong to another comparison, whose report must
    keep describing it, or lie outside --results."""
    suffix = "" if benchmark is None else f"-{benchmark}"
    return {
        arm.label: [comparison.directory / "evals" / f"{arm.slug}{suffix}"]
        if arm.run_dir
        else [RunDir(d).path / f"eval{suffix}" for d in runs]
        for arm, runs in zip(comparison.arms, arm_runs(comparison).values(), strict=True)
    }


def arm_target(directory: Path, recipe: Recipe):
    """How a run of the comparison is evaluated (`evaluation.EvalTarget`); a run of another task is refused."""
    from atrctl.experiments.evaluation import eval_target

    spec = eval_target(str(directory))
    if (spec.task, spec.task_args) != (recipe.task.name, recipe.task.args):
        raise UserError(
            f"{directory} was trained on task {spec.task} {spec.task_args}, "
            f"not {recipe.task.name} {recipe.task.args}: compare runs of one task"
        )
    return spec


def evaluate_arms(
    comparison: Comparison,
    n: int,
    problems: int,
    on_progress: Callable[[str, int, int], None] | None = None,
    benchmark: str | None = None,
) -> dict[str, list]:
    """Every final model on the same held-out problems, with the same n and sampling seed; or, given a
    `benchmark`, on all of its problems at its preset (`atrctl ls`).  A run evaluated before with exactly this
    key (`evaluation.evaluation_key`: model files, problems, settings, code) is read back from where it was
    kept (eval/, or eval-<benchmark>/) instead of sampled again; either way its passk files are written there."""
    from dataclasses import replace

    from atrctl.core.passk import default_ks
    from atrctl.experiments.evaluation import evaluate_target, evaluation_key
    from atrctl.reports.eval_report import load_result, save_result, write_eval
    from atrctl.tasks import PRESETS, get_task

    recipe = comparison.recipe
    settings = dict(n=n, temperature=recipe.eval.temperature, seed=recipe.eval.seed, device=recipe.model.device,
                    batch_size=recipe.eval.batch)  # fmt: skip
    if benchmark is None:
        task = get_task(recipe.task.name, **recipe.task.args)
        held_out = task.problems("test", problems, recipe.eval.seed)
    else:
        preset, task = PRESETS[benchmark], get_task(benchmark)
        held_out = task.problems("test", None, recipe.eval.seed)
        settings.update(n=preset.n, temperature=preset.temperature, top_p=preset.top_p)
    kept: dict[str, list] = {}
    evaluated_in = arm_evaluations(comparison, benchmark)
    for label, directories in arm_runs(comparison).items():  # every kept evaluation read before any is sampled
        kept[label] = []
        for directory, where in zip(directories, evaluated_in[label], strict=True):
            spec = arm_target(directory, recipe)
            if benchmark is not None:  # in the prompt style the run was trained with (chat template included)
                spec = replace(spec, task=benchmark, task_args={}, max_new_tokens=preset.max_new_tokens,
                               directory=where)  # fmt: skip
            key = evaluation_key(spec, held_out, **settings)
            try:
                result = load_result(where, key)
            except DamagedFile as damaged:
                log.warning("note: %s", damaged)
                result = None
            kept[label].append((directory, where, spec, key, result))
    results: dict[str, list] = {}
    for label, entries in kept.items():
        results[label] = []
        for directory, where, spec, key, result in entries:
            if result is None:
                progress = None if on_progress is None else (lambda d, t, name=directory.name: on_progress(name, d, t))
                result = evaluate_target(spec, task, held_out, **settings, on_progress=progress)
                save_result(where, key, result)
            write_eval(result, default_ks(result.n), where, f"{directory.name}: {benchmark or 'pass@k'}")
            results[label].append(result)
    return results


def trust_region_args(max_kl3: float | None, eps: float | None, eps_high: float | None) -> dict[str, dict]:
    """The shared --max-kl3 / --eps / --eps-high flags as parameters of every constant trust region that takes
    them (atr's max_kl3, grpo's eps, dapo's eps_low / eps_high); other losses keep their own defaults (gspo's
    sequence-level ε is a different scale).  Recorded in compare.json, whichever arms are trained."""
    from atrctl.core.divergence import TRUST_REGIONS, region_defaults
    from atrctl.core.losses import flag_parameters

    args = {}
    for name in TRUST_REGIONS:
        taken = {k: v for k, v in flag_parameters(name, max_kl3, eps, eps_high).items() if k in region_defaults(name)}
        if taken:
            args[name] = taken
    return args


def plan_comparison(
    arm_names: Sequence[str],
    *,
    seeds: int,
    n: int,
    problems: int,
    jobs: int,
    recipe: Recipe,
    max_kl3: float | None,
    eps: float | None,
    eps_high: float | None,
    name: str | None,
    overwrite: bool,
    results: Path,
    kind: str = "compare",
) -> Comparison:
    """Check every input and resolve the comparison; nothing is written (run_comparison claims the directory).
    Its directory is results/<kind>-<name>."""
    from atrctl.rollout.evaluate import check_samples_fit
    from atrctl.runtime.machine import requested_threads
    from atrctl.training.checks import validate_algo

    for value, flag in ((seeds, "--seeds"), (n, "--n"), (problems, "--problems"), (jobs, "--jobs")):
        if value < 1:
            raise UserError(f"{flag} must be at least 1 (got {value})")
    if len(arm_names) < 2:
        raise UserError(f"{kind} needs at least two arms, e.g. `atrctl compare grpo atr`")
    requested_threads()  # here, in the parent, not first in a run it starts after writing the comparison
    from atrctl.training.trackers import check_installed, reporter_names

    check_installed(reporter_names(recipe.run))  # here, not in each run's log
    arms = parse_arms(arm_names)
    from atrctl.tasks import get_task

    held_out = get_task(recipe.task.name, **recipe.task.args).problems("test", problems, recipe.eval.seed)  # enough?
    check_samples_fit(len(held_out), n)
    for benchmark in recipe.eval.benchmarks:  # its data read (AIME's package found) before anything trains
        get_task(benchmark).problems("test", None, recipe.eval.seed)
    from atrctl.training.base_cache import cached_base

    cached_base(recipe, results)  # a damaged one is refused here, before the comparison's folder is claimed
    loss_args = trust_region_args(max_kl3, eps, eps_high)
    trained = {}
    for arm in arms:
        if arm.loss is not None:
            trained[arm.label] = arm_recipe(recipe, arm, recipe.model.base, loss_args)
            try:
                validate_algo(trained[arm.label])
            except UserError as error:
                raise UserError(f"arm '{arm.label}': {error}") from None
        else:  # an existing run: its recipe must read and its task match, before anything trains
            arm_target(arm.run_dir, recipe)
    check_distinct(trained)
    for arm in arms:  # the run directories' and recipe files' names: refused here rather than by the filesystem later
        if arm.loss is not None:
            check_name(f"{arm.slug}-s{seeds - 1}", flag=f"arm '{arm.label}': its run name")
    if name is None:
        label = check_name("-".join(a.slug for a in arms), flag="the name made of the arms' labels (pass --name)")
    else:
        label = check_name(name)
    comparison = Comparison(results / f"{kind}-{label}", arms, seeds, recipe, loss_args, overwrite, kind)
    check_claim(comparison, overwrite)  # again under the lock (`prepare`); here before any work
    return comparison


def _runs_started(comparison: Comparison) -> bool:
    """Whether any run of the comparison has logged a step (then it is kept, to be resumed)."""
    runs = comparison.directory / "runs"
    return runs.is_dir() and any(RunDir(d).read_metrics() for d in runs.iterdir() if d.is_dir() and d.name[0] != ".")


def run_comparison(
    comparison: Comparison,
    *,
    n: int,
    problems: int,
    jobs: int,
    results: Path,
    command: str,
    advance: Progress | None = None,
    report: Report | None = None,
) -> tuple[list[dict], list[int]]:
    """Warm up (or reuse) the base, train every (arm, seed), evaluate every final model and write the report
    (`report`, compare's own by default; `atrctl sweep` brings its own).

    Returns the table rows and the k's.  Every part resumes: finished runs are kept, interrupted ones
    continue from their checkpoints, and rerunning the same plan redoes only what is missing.  One
    process at a time: a second one on the same comparison is refused.
    """
    from atrctl.core.passk import default_ks
    from atrctl.training.trackers import report_evaluation

    def show(key: str, description: str, done: int, total: int, note: str = "") -> None:
        if advance is not None:
            advance(key, description, done, total, note)

    with exclusive(comparison.directory):
        recover(comparison.directory, started=_runs_started(comparison))  # after a crash in an --overwrite
        prepare(comparison, comparison.overwrite)
        started, seconds = time.perf_counter(), {}
        try:
            _train_arms(comparison, jobs, results, show, seconds)
        except BaseException:  # an --overwritten comparison comes back unless the new one's runs have started
            recover(comparison.directory, started=_runs_started(comparison))
            raise
        drop_aside(comparison.directory)

        phase = time.perf_counter()
        evaluations = evaluate_arms(
            comparison,
            n,
            problems,
            lambda run, done, total: show(f"eval {run}", f"eval {run}", done, total, f"n = {n}"),
        )
        seconds["evaluation (wall)"] = time.perf_counter() - phase
        ks = default_ks(n)
        evaluated_in = arm_evaluations(comparison)
        for label, directories in arm_runs(comparison).items():
            for directory, where in zip(directories, evaluated_in[label], strict=True):
                if where != RunDir(directory).eval:
                    continue  # a run given as an arm: its own trackers are its own, not written to
                try:  # to the run's own trackers; a tracker that fails costs the comparison nothing
                    report_evaluation(directory, where / "passk.csv")
                except UserError as error:
                    log.warning("warning: %s", error)
        benchmarks = {}
        for name in comparison.recipe.eval.benchmarks:
            phase = time.perf_counter()
            benchmarks[name] = evaluate_arms(
                comparison, n, problems, lambda run, d, t, b=name: show(f"{b} {run}", f"{b} {run}", d, t), name
            )
            seconds[f"{name} (wall)"] = time.perf_counter() - phase
        seconds["total"] = time.perf_counter() - started
        report = report or write_compare_report
        return report(comparison, evaluations, ks, command, seconds, benchmarks), ks


def write_compare_report(
    comparison: Comparison,
    evaluations: dict[str, list],
    ks: list[int],
    command: str,
    seconds: dict[str, float],
    benchmarks: dict[str, dict[str, list]],
) -> list[dict]:
    """compare's report (`compare_report.write_report`): the pass@k table with differences, the figures."""
    from atrctl.experiments.compare_report import write_report
    from atrctl.model.numerics import resolve_device
    from atrctl.training.rundir import environment

    deltas, eps = _drawn_regions(comparison)
    return write_report(
        comparison.directory,
        arm_runs(comparison),
        evaluations,
        ks,
        command=command,
        recipe_toml=to_toml(recipe_to_dict(comparison.recipe)),
        environment=environment(resolve_device(comparison.recipe.model.device)),
        deltas=deltas,
        eps=eps,
        seconds=seconds,
        benchmarks=benchmarks,
    )


def _drawn_regions(comparison: Comparison) -> tuple[list[float], float]:
    """The trust regions the report's figure draws: every atr arm's δ and the first grpo arm's ε (the
    defaults where no arm trains that loss)."""
    from atrctl.core.losses import loss_parameters

    def resolved(loss: str) -> list[dict]:
        return [
            {**loss_parameters(loss), **arm_recipe(comparison.recipe, arm, "", comparison.loss_args).algo.args}
            for arm in comparison.arms
            if arm.loss == loss
        ]

    deltas = sorted({float(args["max_kl3"]) for args in resolved("atr")}) or [loss_parameters("atr")["max_kl3"]]
    eps = next((float(args["eps"]) for args in resolved("grpo")), loss_parameters("grpo")["eps"])
    return deltas, eps


def _train_arms(comparison: Comparison, jobs: int, results: Path, show: Progress, seconds: dict) -> None:
    """The shared base (warmed up or cached), then every (arm, seed) run, `jobs` at a time; adds the wall
    times of both phases to `seconds`."""
    from atrctl.training.base_cache import ensure_base

    recipe, phase = comparison.recipe, time.perf_counter()
    check_kept_runs(comparison)  # before the warm-up: a foreign run is refused at once
    ensure_base(
        recipe, results, lambda step, total, loss, acc: show("warmup", "warm-up base", step, total, f"loss {loss:.3f}")
    )  # its runs find the base by its key in the results folder above them (`rundir.bases_folder`)
    seconds["base (warm-up or cache)"] = time.perf_counter() - phase

    phase = time.perf_counter()
    job_list = training_jobs(
        comparison.arms, comparison.seeds, write_arm_recipes(comparison), comparison.directory / "runs"
    )
    total_steps, reused = len(job_list) * recipe.run.steps, sum(job.finished for job in job_list)
    run_jobs(job_list, jobs, lambda done: show("train", f"train {len(job_list)} runs", done, total_steps,
                                               f"{jobs} at a time"))  # fmt: skip
    seconds[f"training ({len(job_list)} runs, {jobs} at a time; {reused} reused from before)"] = (
        time.perf_counter() - phase
    )
