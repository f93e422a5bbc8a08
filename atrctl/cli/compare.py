"""`atrctl compare` and `atrctl sweep`: several arms from one base, evaluated alike, with a report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from atrctl.cli.display import console, stderr
from atrctl.cli.options import (
    EVALUATION,
    ArmProblemsOption,
    ArmSamplesOption,
    BackendOption,
    EpsHighOption,
    EpsOption,
    MaxKl3Option,
    RecipeOption,
    ReportToOption,
    ResultsOption,
    SetOption,
    report_to_sets,
)
from atrctl.config.schema import RunConfig


def compare(
    ctx: typer.Context,
    arms: Annotated[list[str], typer.Argument(help="Losses to train (e.g. grpo atr) or finished run directories.")],
    seeds: Annotated[int, typer.Option(help="Training seeds per arm (0 … seeds-1).")] = 4,
    steps: Annotated[
        int | None, typer.Option(help=f"RL steps per run \\[default: the recipe's, {RunConfig.steps}].")
    ] = None,
    n: ArmSamplesOption = EVALUATION["compare"].n,
    problems: ArmProblemsOption = EVALUATION["compare"].problems,
    jobs: Annotated[int, typer.Option(help="Training runs in parallel (one CPU thread each when > 1).")] = 2,
    max_kl3: MaxKl3Option = None,
    eps: EpsOption = None,
    eps_high: EpsHighOption = None,
    name: Annotated[str | None, typer.Option(help="results/compare-<name>/ \\[default: the arms joined by -].")] = None,
    recipe: RecipeOption = None,
    set_: SetOption = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing comparison of the same name.")] = False,
    report_to: ReportToOption = None,
    backend: BackendOption = None,
    results: ResultsOption = Path("results"),
) -> None:
    """Train and evaluate several algorithms side by side (e.g. `atrctl compare grpo atr`)."""
    from atrctl.cli import tables
    from atrctl.experiments.compare import plan_comparison

    config, command = _set_up(ctx, recipe, steps, report_to, set_, backend)
    comparison = plan_comparison(
        arms,
        seeds=seeds,
        n=n,
        problems=problems,
        jobs=jobs,
        recipe=config,
        max_kl3=max_kl3,
        eps=eps,
        eps_high=eps_high,
        name=name,
        overwrite=overwrite,
        results=results,
    )
    _run_and_show(comparison, tables.compare_table, n=n, problems=problems, jobs=jobs, results=results,
                  command=command)  # fmt: skip


def _set_up(ctx: typer.Context, recipe, steps: int | None, report_to, set_, backend: str | None) -> tuple:
    """What compare and sweep both start from: the shared recipe with the flags applied, and the command as
    typed (for the report)."""
    import shlex

    from atrctl.cli import display
    from atrctl.config.loading import load_recipe

    display.quiet_libraries()
    sets = [
        *([f"run.steps={steps}"] if steps is not None else []),
        *([f"rollout.backend={backend}"] if backend is not None else []),
        *report_to_sets(report_to),
        *(set_ or []),
    ]
    return load_recipe(recipe, sets), " ".join(shlex.quote(a) for a in ["atrctl", *ctx.obj])


def _run_and_show(comparison, table, report=None, **options) -> None:
    """`run_comparison` under progress bars, then its table and where the report is; Ctrl-C says how to resume."""
    from atrctl.cli import progress
    from atrctl.experiments.compare import run_comparison

    try:
        with progress.phase_bars() as advance:
            rows, ks = run_comparison(comparison, advance=advance, report=report, **options)
    except KeyboardInterrupt:
        stderr.print(f"interrupted: rerun the same command without --overwrite to resume the runs in "
                     f"{comparison.directory}")  # fmt: skip
        raise typer.Exit(130) from None
    console.print(table(rows, ks))
    console.print(f"report: {comparison.directory / 'report.md'}")


def sweep(
    ctx: typer.Context,
    loss: Annotated[str, typer.Argument(help="The loss swept (e.g. atr); `atrctl ls` lists them.")],
    grid: Annotated[
        list[str],
        typer.Option(help="KEY=v1,v2,…: a parameter of the loss or a dotted recipe key (repeatable: the product)."),
    ],
    vs: Annotated[
        list[str] | None, typer.Option(help="Reference arms drawn as bands, e.g. grpo:eps=0.2 (repeatable).")
    ] = None,
    seeds: Annotated[int, typer.Option(help="Training seeds per point (0 … seeds-1).")] = 3,
    steps: Annotated[
        int | None, typer.Option(help=f"RL steps per run \\[default: the recipe's, {RunConfig.steps}].")
    ] = None,
    n: ArmSamplesOption = EVALUATION["sweep"].n,
    problems: ArmProblemsOption = EVALUATION["sweep"].problems,
    jobs: Annotated[int, typer.Option(help="Training runs in parallel (one CPU thread each when > 1).")] = 2,
    max_kl3: MaxKl3Option = None,
    eps: EpsOption = None,
    eps_high: EpsHighOption = None,
    name: Annotated[str | None, typer.Option(help="results/sweep-<name>/ \\[default: LOSS-KEY…].")] = None,
    recipe: RecipeOption = None,
    set_: SetOption = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing sweep of the same name.")] = False,
    report_to: ReportToOption = None,
    backend: BackendOption = None,
    results: ResultsOption = Path("results"),
) -> None:
    """Train LOSS at every grid point (and the --vs arms) from one base and compare them (e.g.
    `atrctl sweep atr --grid max_kl3=0.02,0.05,0.1,0.2 --vs grpo`)."""
    from atrctl.cli import tables
    from atrctl.experiments.sweep import plan_sweep
    from atrctl.experiments.sweep_report import write_sweep_report

    config, command = _set_up(ctx, recipe, steps, report_to, set_, backend)
    planned = plan_sweep(
        loss, grid, vs or [], seeds=seeds, n=n, problems=problems, jobs=jobs, recipe=config, max_kl3=max_kl3,
        eps=eps, eps_high=eps_high, name=name, overwrite=overwrite, results=results,
    )  # fmt: skip
    report = lambda comparison, evaluations, ks, text, seconds, benchmarks: write_sweep_report(  # noqa: E731
        planned, evaluations, ks, text, seconds, benchmarks
    )
    _run_and_show(planned.comparison, tables.sweep_results_table, report, n=n, problems=problems, jobs=jobs,
                  results=results, command=command)  # fmt: skip
