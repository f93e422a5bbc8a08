"""`atrctl warmup` and `atrctl train`: a warmed-up base, and a training run on it."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer

from atrctl.cli.display import console, stderr
from atrctl.cli.options import (
    DEVICE_HELP,
    EpsHighOption,
    EpsOption,
    MaxKl3Option,
    NprocOption,
    RecipeOption,
    ReportToOption,
    ResultsOption,
    SetOption,
    check_nproc,
    report_to_sets,
)
from atrctl.config.schema import AlgoConfig, ModelConfig, OptimConfig, RolloutConfig, RunConfig
from atrctl.errors import UserError
from atrctl.files.destinations import check_destination, disk_full


def warmup(
    recipe: RecipeOption = None,
    seed: Annotated[int | None, typer.Option(help="Warm-up seed (initial weights, data order).")] = None,
    set_: SetOption = None,
    results: Annotated[Path, typer.Option(help="Results folder; bases live in <results>/bases/.")] = Path("results"),
) -> None:
    """Build (or reuse) the warmed-up base model of a recipe and report its held-out greedy accuracy."""
    from atrctl.cli import display, progress
    from atrctl.config.loading import load_recipe
    from atrctl.model.loading import PRESETS
    from atrctl.training.base_cache import base_key, ensure_base

    display.quiet_libraries()
    config = load_recipe(recipe, list(set_ or []) + ([f"warmup.seed={seed}"] if seed is not None else []))
    if config.model.base not in PRESETS:
        raise UserError(
            f"model.base '{config.model.base}' is not a preset ({', '.join(PRESETS)}): "
            "real models are used as they are, without a warm-up"
        )
    check_destination(results, "--results")
    from atrctl.training.checks import check_before_warmup

    check_before_warmup(config)  # what training this recipe would refuse, refused before its base is warmed up
    with progress.warmup_bar(config.warmup.max_steps) as on_progress:
        path, info = ensure_base(config, results, on_progress)
    console.print(
        f"base {base_key(config)}: held-out greedy accuracy {info['accuracy']:.1%} "
        f"after {info['steps']} steps in {info['seconds']:.1f} s  →  {path}"
    )


def train(
    ctx: typer.Context,
    algo: Annotated[
        str | None, typer.Option(help=f"Policy loss \\[default: {AlgoConfig.loss}]; `atrctl ls` lists them.")
    ] = None,
    max_kl3: MaxKl3Option = None,
    eps: EpsOption = None,
    eps_high: EpsHighOption = None,
    steps: Annotated[int | None, typer.Option(help=f"RL steps \\[default: {RunConfig.steps}].")] = None,
    seed: Annotated[
        int | None, typer.Option(help=f"Seed of prompt order and sampling \\[default: {RunConfig.seed}].")
    ] = None,
    group_size: Annotated[
        int | None, typer.Option(help=f"Completions per prompt G \\[default: {RolloutConfig.group_size}].")
    ] = None,
    prompts: Annotated[int | None, typer.Option(help=f"Prompts per step \\[default: {RolloutConfig.prompts}].")] = None,
    lr: Annotated[float | None, typer.Option(help=f"Learning rate \\[default: {OptimConfig.lr:g}].")] = None,
    device: Annotated[str | None, typer.Option(help=f"{DEVICE_HELP} \\[default: {ModelConfig.device}].")] = None,
    name: Annotated[
        str | None, typer.Option(help="Run name: results/<name>/ \\[default: <algo>-<task>-s<seed>-<time>].")
    ] = None,
    recipe: RecipeOption = None,
    set_: SetOption = None,
    resume: Annotated[Path | None, typer.Option(help="Continue the run in this directory from its checkpoint.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run directory of the same name.")] = False,
    tensorboard: Annotated[bool, typer.Option(help="TensorBoard event files too: --report-to tensorboard.")] = False,
    report_to: ReportToOption = None,
    results: ResultsOption = Path("results"),
    nproc: NprocOption = None,
) -> None:
    """Train a policy with GRPO, ATR-GRPO or another registered loss."""
    from atrctl.cli import display, progress
    from atrctl.config.loading import load_recipe_with_flags
    from atrctl.runtime import distributed
    from atrctl.training.rundir import RunDir, check_name, default_run_name

    display.quiet_libraries()
    flags = {
        "algo.loss": algo,
        "run.steps": steps,
        "run.seed": seed,
        "rollout.group_size": group_size,
        "rollout.prompts": prompts,
        "optim.lr": lr,
        "model.device": device,
        "run.tensorboard": "true" if tensorboard else None,
    }
    loss_flags = (max_kl3, eps, eps_high)
    if resume is not None:
        given = any(v is not None for v in (*flags.values(), *loss_flags)) or set_ or recipe or name or overwrite
        given = given or report_to
        if given:
            raise UserError("--resume continues a run with its own recorded recipe: drop the other options")
        run_dir = RunDir(resume)
        config = run_dir.recipe()
        results = resume.parent  # the run's own results folder holds its base
    else:
        config = load_recipe_with_flags(recipe, flags, [*report_to_sets(report_to), *(set_ or [])], *loss_flags)
        run_dir = RunDir(results / (check_name(name) if name is not None else default_run_name(config)))

    from atrctl.training.bad_steps import TrainingStopped
    from atrctl.training.checks import validate_algo
    from atrctl.training.loop import train as run_training

    check_nproc(nproc)
    validate_algo(config, nproc)
    main_rank = distributed.is_main()
    if main_rank:
        run_dir.check_can_start(resume is not None, overwrite, config.run.steps)  # its destination checked too
    if nproc is not None and nproc > 1:
        raise typer.Exit(distributed.relaunch(nproc, ctx.obj))
    # under torchrun only rank 0 shows and reports; the others train silently
    shown = progress.training_bars(config.algo.loss, config.run.steps, config.warmup.max_steps)
    started = time.time_ns()
    try:
        with shown if main_rank else nullcontext((None, None)) as (on_warmup, on_step):
            summary = run_training(
                config,
                run_dir.path,
                results=results,
                resume=resume is not None,
                overwrite=overwrite,
                on_step=on_step,
                on_warmup=on_warmup,
            )
    except KeyboardInterrupt:
        from atrctl.training.checkpoint import find_checkpoint

        if not main_rank:
            raise typer.Exit(130) from None
        if find_checkpoint(run_dir.checkpoint) is None:
            stderr.print(f"interrupted before the first checkpoint: nothing to resume in {run_dir.path}")
        else:
            stderr.print(f"interrupted: checkpoint saved; continue with  atrctl train --resume {run_dir.path}")
        raise typer.Exit(130) from None
    except OSError as error:  # the disk filled up: the last checkpoint (or the run it was to replace) is kept
        resumable = resume is not None or _checkpointed_since(run_dir, started)
        retry = f"continue with  atrctl train --resume {run_dir.path}" if resumable else "rerun the same command"
        full = disk_full(error, retry)
        if full is None:
            raise
        raise full from None
    except TrainingStopped as error:
        if main_rank:
            stderr.print(f"error: {error}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if summary is None:  # a rank other than 0
        return
    base, final = summary["base"], summary["final"]
    console.print(
        f"done: {run_dir.path}  held-out greedy {base['eval/greedy']:.1%} → {final['eval/greedy']:.1%}, "
        f"sampled pass@1 {base['eval/pass@1']:.1%} → {final['eval/pass@1']:.1%}"
    )


def _checkpointed_since(run_dir, started_ns: int) -> bool:
    """Whether this command wrote a checkpoint of the run (else an --overwrite put the older run back, or none
    was reached: the same command starts it again)."""
    from atrctl.training.checkpoint import find_checkpoint

    found = find_checkpoint(run_dir.checkpoint)
    return found is not None and (found / "state.json").stat().st_mtime_ns >= started_ns
