"""The `atrctl` command line: parse, call the core, print.  No logic lives here.

Heavy libraries (torch, transformers) are imported inside the commands that
need them, so `atrctl --help` and `atrctl plot-bounds` start quickly.
"""

from __future__ import annotations

import math
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, NamedTuple

import typer
from rich.console import Console

from atrctl import __version__
from atrctl.errors import UserError

app = typer.Typer(
    name="atrctl",
    help="GRPO and ATR-GRPO experiments on small causal LMs: train, evaluate, compare, plot trust regions.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(width=None if sys.stdout.isatty() else 160)  # logs and pipes get whole tables
stderr = Console(stderr=True)


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


# -------------------------------------------------------------- plot-bounds


class FigureFormat(str, Enum):
    png = "png"
    svg = "svg"
    pdf = "pdf"


def _figure_path(out: Path | None, fmt: FigureFormat | None, max_kl3s: list[float]) -> Path:
    if out is None:
        tag = "_".join(f"{d:g}" for d in sorted(max_kl3s))
        return Path("results/bounds") / f"bounds-kl3-{tag}.{(fmt or FigureFormat.png).value}"
    suffix = out.suffix.lstrip(".").lower()
    if fmt is None:
        if suffix not in FigureFormat.__members__:
            raise UserError(f"--out {out}: unknown figure type '.{suffix}'; end it in .png, .svg or .pdf")
        return out
    if suffix != fmt.value:
        raise UserError(f"--out {out} does not end in .{fmt.value} as --format asks; make them agree")
    return out


def _prepare_directory(path: Path) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        message = f"--out {path}: cannot create {path.parent} ({error.strerror}); choose a writable path"
        raise UserError(message) from None
    if path.is_dir():
        raise UserError(f"--out {path} is a directory; give a file path such as {path / 'bounds.png'}")


@app.command("plot-bounds")
def plot_bounds(
    max_kl3: Annotated[
        list[float], typer.Option("--max-kl3", help="KL3 level δ of ATR-GRPO; repeat to overlay several.")
    ] = [0.1],  # noqa: B006 - typer reads the default, it is never mutated
    eps: Annotated[float, typer.Option(help="GRPO clip ε (and DAPO's ε_low), in (0, 1).")] = 0.2,
    eps_high: Annotated[float, typer.Option(help="DAPO's clip-higher ε_high, > 0.")] = 0.28,
    out: Annotated[
        Path | None, typer.Option(help="Figure path \\[default: results/bounds/bounds-kl3-<δ>.png]; CSV beside it.")
    ] = None,
    fmt: Annotated[FigureFormat | None, typer.Option("--format", help="Figure format.")] = None,
) -> None:
    """Show the ratio interval each divergence constraint implies: table, CSV and figure."""
    from atrctl.divergence import MAX_KL3

    for delta in max_kl3:
        if _positive(delta, "--max-kl3") > MAX_KL3:
            raise UserError(f"--max-kl3 must be at most {MAX_KL3:g} (got {delta}); typical values are 0.01-0.2")
    _unit_open(eps, "--eps")
    _positive(eps_high, "--eps-high")
    figure_path = _figure_path(out, fmt, max_kl3)
    _prepare_directory(figure_path)

    from atrctl import bounds_table, io
    from atrctl.bounds_plot import bounds_figure

    methods = bounds_table.method_rows(max_kl3, eps, eps_high)
    sweep = bounds_table.sweep_rows()
    console.print(_methods_table(methods))
    console.print(_sweep_table(sweep))

    csv_path = figure_path.with_suffix(".csv")
    figure = bounds_figure(max_kl3, eps)
    try:
        with io.atomic_path(figure_path) as tmp:
            figure.savefig(tmp, format=figure_path.suffix.lstrip("."), dpi=130)
        io.write_text(csv_path, bounds_table.to_csv(methods, sweep))
    except OSError as error:
        raise UserError(f"--out {figure_path}: cannot write ({error.strerror}); choose a writable path") from None
    console.print(f"wrote {figure_path} and {csv_path}")


def _methods_table(rows):
    from rich.table import Table

    table = Table(title=r"Trust regions in ratio space: clip w = π_θ/π_old to \[l, u]")
    table.caption = "TRL: epsilon / epsilon_high; verl: clip_ratio_low / clip_ratio_high — the same two numbers"
    for column in ("method", "setting", "l", "u", "1 − l", "u − 1", "ln l", "ln u", "TRL / verl settings"):
        table.add_column(column, justify="left" if column in ("method", "setting") else "right")
    for row in rows:
        table.add_row(row.method, row.setting, f"{row.low:.6f}", f"{row.high:.6f}", f"{row.eps_low:.4f}",
                      f"{row.eps_high:.4f}", f"{row.log_low:.4f}", f"{row.log_high:.4f}",
                      f"{row.eps_low:.6g} / {row.eps_high:.6g}")
    return table


def _sweep_table(rows):
    from rich.table import Table

    table = Table(title="ATR-GRPO: KL3 level δ → ratio bounds and the equivalent clip ε's")
    for column in ("max_kl3 δ", "l", "u", "eps_low = 1 − l", "eps_high = u − 1", "(u − 1) / (1 − l)"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row.setting.split("=")[1], f"{row.low:.6f}", f"{row.high:.6f}", f"{row.eps_low:.6f}",
                      f"{row.eps_high:.6f}", f"{row.eps_high / row.eps_low:.3f}")
    return table


# ------------------------------------------------------------------- warmup


def _quiet_libraries() -> None:
    """Our progress display is the only one: silence transformers' and the hub's tqdm bars."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


RecipeOption = Annotated[Path | None, typer.Option("--recipe", help="TOML recipe \\[default: built-in defaults].")]
SetOption = Annotated[
    list[str] | None, typer.Option("--set", help="Override any recipe key: section.key=value (repeatable).")
]


@app.command()
def warmup(
    recipe: RecipeOption = None,
    seed: Annotated[int | None, typer.Option(help="Warm-up seed (initial weights, data order).")] = None,
    set_: SetOption = None,
    results: Annotated[Path, typer.Option(help="Results folder; bases live in <results>/bases/.")] = Path("results"),
) -> None:
    """Build (or reuse) the warmed-up base model of a recipe and report its held-out greedy accuracy."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from atrctl.bases import base_key, ensure_base
    from atrctl.config import load_recipe
    from atrctl.models import PRESETS

    _quiet_libraries()
    overrides = list(set_ or []) + ([f"warmup.seed={seed}"] if seed is not None else [])
    config = load_recipe(recipe, overrides)
    if config.model.base not in PRESETS:
        raise UserError(f"model.base '{config.model.base}' is not a preset ({', '.join(PRESETS)}): "
                        "real models are used as they are, without a warm-up")
    columns = (TextColumn("warm-up"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("warm-up", total=config.warmup.max_steps, status="")
        shown = {"accuracy": "–"}

        def on_progress(step: int, loss: float, accuracy: float | None) -> None:
            if accuracy is not None:
                shown["accuracy"] = f"{accuracy:.1%}"
            progress.update(bar, completed=step, status=f"loss {loss:.3f}  held-out greedy {shown['accuracy']}")

        path, info = ensure_base(config, results, on_progress)
    console.print(f"base {base_key(config)}: held-out greedy accuracy {info['accuracy']:.1%} "
                  f"after {info['steps']} steps in {info['seconds']:.1f} s  →  {path}")


# -------------------------------------------------------------------- train


def _train_overrides(algo, max_kl3, eps, eps_high, steps, seed, group_size, prompts, lr, device, tensorboard):
    """The common flags as recipe overrides (applied after --recipe and before --set)."""
    pairs = [("algo.loss", algo), ("run.steps", steps), ("run.seed", seed), ("rollout.group_size", group_size),
             ("rollout.prompts", prompts), ("optim.lr", lr), ("model.device", device),
             ("run.tensorboard", "true" if tensorboard else None), ("algo.args.max_kl3", max_kl3),
             ("algo.args.eps" if algo in (None, "grpo") else "algo.args.eps_low", eps),
             ("algo.args.eps_high", eps_high)]
    return [f"{key}={value}" for key, value in pairs if value is not None]


@app.command()
def train(
    algo: Annotated[str | None, typer.Option(help="Policy loss: atr (default), grpo, dapo, k2, kl-band, ...")] = None,
    max_kl3: Annotated[float | None, typer.Option(help="ATR-GRPO's KL3 level δ \\[default: 0.1].")] = None,
    eps: Annotated[float | None, typer.Option(help="Clip ε of grpo (ε_low of dapo/gspo/cispo).")] = None,
    eps_high: Annotated[float | None, typer.Option(help="Upper clip ε_high of dapo/gspo/cispo.")] = None,
    steps: Annotated[int | None, typer.Option(help="RL steps \\[default: 300].")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of prompt order and sampling \\[default: 0].")] = None,
    group_size: Annotated[int | None, typer.Option(help="Completions per prompt G \\[default: 8].")] = None,
    prompts: Annotated[int | None, typer.Option(help="Prompts per step \\[default: 64].")] = None,
    lr: Annotated[float | None, typer.Option(help="Learning rate \\[default: 2e-4].")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu or cuda \\[default: auto].")] = None,
    name: Annotated[
        str | None, typer.Option(help="Run name: results/<name>/ \\[default: <algo>-<task>-s<seed>-<time>].")
    ] = None,
    recipe: RecipeOption = None,
    set_: SetOption = None,
    resume: Annotated[Path | None, typer.Option(help="Continue the run in this directory from its checkpoint.")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing run directory of the same name.")] = False,
    tensorboard: Annotated[bool, typer.Option(help="Also write TensorBoard event files.")] = False,
    results: Annotated[Path, typer.Option(help="Results folder.")] = Path("results"),
    nproc: Annotated[
        int | None, typer.Option(help="Data-parallel processes: relaunches itself under torchrun \\[default: 1].")
    ] = None,
) -> None:
    """Train a policy with GRPO, ATR-GRPO or another registered loss."""
    import time as clock

    from atrctl import distributed
    from atrctl.config import load_recipe, recipe_of_run

    _quiet_libraries()
    overrides = _train_overrides(algo, max_kl3, eps, eps_high, steps, seed, group_size, prompts, lr, device,
                                 tensorboard) + list(set_ or [])
    if resume is not None:
        if overrides or recipe is not None or name is not None or overwrite:
            raise UserError("--resume continues a run with its own recorded recipe: drop the other options")
        directory = resume
        config = recipe_of_run(directory)
        results = directory.parent  # the run's own results folder holds its base
    else:
        config = load_recipe(recipe, overrides)
        stamp = clock.strftime("%Y%m%d-%H%M%S")
        directory = results / (name or f"{config.algo.loss}-{config.task.name}-s{config.run.seed}-{stamp}")

    from atrctl.train import TrainingStopped, check_run_directory, validate_algo

    if nproc is not None and (nproc < 1 or distributed.world_size() > 1):
        raise UserError(f"--nproc {nproc}: give a count >= 1, and only outside torchrun (which sets its own)")
    validate_algo(config, nproc)
    main_rank = distributed.is_main()
    if main_rank:
        check_run_directory(directory, resume is not None, overwrite)
    if nproc is not None and nproc > 1:
        raise typer.Exit(distributed.relaunch(nproc, _without_nproc(_invocation[1:])))
    try:
        summary = _train_with_display(config, directory, results, resume is not None, overwrite)
    except KeyboardInterrupt:
        from atrctl.checkpoint import find_checkpoint

        if not main_rank:
            raise typer.Exit(130) from None
        if find_checkpoint(directory / "checkpoint") is None:
            stderr.print(f"interrupted before the first checkpoint: nothing to resume in {directory}")
        else:
            stderr.print(f"interrupted: checkpoint saved; continue with  atrctl train --resume {directory}")
        raise typer.Exit(130) from None
    except TrainingStopped as error:
        if main_rank:
            stderr.print(f"error: {error}", markup=False)
        raise typer.Exit(1) from None
    if summary is None:  # a rank other than 0: it reports nothing
        return
    base, final = summary["base"], summary["final"]
    console.print(f"done: {directory}  held-out greedy {base['eval/greedy']:.1%} → {final['eval/greedy']:.1%}, "
                  f"sampled pass@1 {base['eval/pass@1']:.1%} → {final['eval/pass@1']:.1%}")


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line minus its --nproc option, for the processes torchrun starts."""
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--nproc="):
            skip = False
        elif arg == "--nproc":
            skip = True
        else:
            out.append(arg)
    return out


def _train_with_display(config, directory: Path, results: Path, resume: bool, overwrite: bool) -> dict | None:
    """Run training under a rich live bar: step, reward, clip fractions, kl3, entropy, tokens/s, ETA.

    Under torchrun only rank 0 shows it; the other ranks train silently."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from atrctl.distributed import is_main
    from atrctl.train import train as run_training

    if not is_main():
        return run_training(config, directory, results=results, resume=resume, overwrite=overwrite)

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        bars: dict[str, int] = {}  # created when that phase starts: a cached base shows no warm-up bar

        def on_warmup(step: int, loss: float, accuracy: float | None) -> None:
            if "warmup" not in bars:
                bars["warmup"] = progress.add_task("warm-up", total=config.warmup.max_steps, status="")
            status = f"loss {loss:.3f}" + (f"  held-out greedy {accuracy:.1%}" if accuracy is not None else "")
            progress.update(bars["warmup"], completed=step, status=status)

        def on_step(record: dict) -> None:
            if "train" not in bars:
                bars["train"] = progress.add_task(f"train {config.algo.loss}", total=config.run.steps, status="")
            status = (f"reward {record['reward/mean']:.3f}  clip low {record.get('clip/low', 0):.3f} "
                      f"high {record.get('clip/high', 0):.3f}  kl3 {record.get('kl3/mean', 0):.2e}  "
                      f"entropy {record.get('entropy', 0):.3f}  {record['tokens_per_s']:.0f} tok/s")
            if "eval/greedy" in record:
                status += f"  eval greedy {record['eval/greedy']:.1%} pass@1 {record['eval/pass@1']:.1%}"
            progress.update(bars["train"], completed=record["step"], status=status)

        try:
            return run_training(config, directory, results=results, resume=resume, overwrite=overwrite,
                                on_step=on_step, on_warmup=on_warmup)
        finally:
            if not bars:  # nothing was shown (bad input): stop quietly, without rich's closing blank line
                progress.live.transient = True
                progress.live.stop()
                progress.disable = True


def _parse_ks(text: str | None, n: int) -> list[int]:
    """--k '1,2,4' -> [1, 2, 4] (sorted, distinct), each in [1, n]; None -> 1, 2, 4, ... and n."""
    from atrctl.evaluate import default_ks

    if text is None:
        return default_ks(n)
    try:
        ks = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise UserError(f"--k {text!r}: give comma-separated integers, e.g. --k 1,2,4,8") from None
    if ks[0] < 1 or ks[-1] > n:
        raise UserError(f"--k {text!r}: every k must be between 1 and --n ({n}); raise --n or drop the larger k")
    return ks


def _task_args(pairs: list[str]) -> dict:
    """--task-arg key=value pairs, values read as TOML (bare words as strings)."""
    from atrctl.config import parse_override

    args = {}
    for pair in pairs:
        key, sep, _ = pair.partition("=")
        if not sep or not key.strip() or "." in key:
            raise UserError(f"--task-arg {pair!r}: write key=value, e.g. --task-arg digits=2")
        args[key.strip()] = parse_override(f"task.{pair}")[1]
    return args


class _EvalTarget(NamedTuple):
    model: str  # a model directory or hub name for load_model
    task: str
    task_args: dict
    chat_template: bool
    max_new_tokens: int
    dtype: str
    problem_seed: int  # the held-out problems training evaluated on (eval.seed), shared by every run
    directory: Path


def _eval_target(target: str, task: str | None, task_args: dict, max_new_tokens: int | None,
                 out: Path | None) -> _EvalTarget:
    """What TARGET is evaluated with: a run directory brings its own recipe; a model directory or hub name
    needs --task and --max-new-tokens."""
    from atrctl.config import EvalConfig, recipe_of_run

    path = Path(target).expanduser()
    if (path / "config.toml").is_file():
        recipe = recipe_of_run(path)
        if not (path / "model").is_dir():
            raise UserError(f"run {path} has no final model in {path / 'model'}: finish (or resume) its training")
        name, args = (task, task_args) if task else (recipe.task.name, {**recipe.task.args, **task_args})
        return _EvalTarget(str(path / "model"), name, args, recipe.task.chat_template,
                           max_new_tokens or recipe.rollout.max_new_tokens, recipe.model.dtype, recipe.eval.seed,
                           out or path / "eval")
    if task is None:
        raise UserError(f"{target} is not a run directory (no config.toml): name its task, e.g. --task arith")
    if max_new_tokens is None:
        raise UserError(f"{target} is not a run directory: give --max-new-tokens (e.g. 8 for 3-digit arith, "
                        f"512 for gsm8k) so answers are not silently cut short")
    stem = path.name if path.name != "model" else path.parent.name
    return _EvalTarget(target, task, task_args, False, max_new_tokens, "auto", EvalConfig().seed,
                       out or Path("results") / f"eval-{stem}")


@app.command("eval")
def evaluate(
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
    temperature: Annotated[float, typer.Option(help="Sampling temperature, > 0.")] = 1.0,
    problems: Annotated[int, typer.Option(help="Problems to evaluate (drawn with the run's eval.seed).")] = 200,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    max_new_tokens: Annotated[
        int | None, typer.Option(help=r"Longest completion \[default: the run's rollout.max_new_tokens].")
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Completions per sampling batch.")] = 1024,
    out: Annotated[
        Path | None, typer.Option(help=r"Output folder \[default: <run>/eval, results/eval-<model>].")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing evaluation in the output folder.")] = False,
    nproc: Annotated[
        int | None, typer.Option(help="Data-parallel processes: relaunches itself under torchrun \\[default: 1].")
    ] = None,
) -> None:
    """Evaluate a model with pass@k, avg@n, maj@k and greedy accuracy: table, CSV, markdown and plot.

    Under torchrun (or --nproc) each process samples a share of the problems; rank 0 alone writes and prints."""
    from atrctl import distributed

    if n < 1:
        raise UserError(f"--n must be at least 1 (got {n}); e.g. --n 256")
    if problems < 1:
        raise UserError(f"--problems must be at least 1 (got {problems}); e.g. --problems 200")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1 (got {max_new_tokens})")
    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1 (got {batch_size})")
    if nproc is not None and (nproc < 1 or distributed.world_size() > 1):
        raise UserError(f"--nproc {nproc}: give a count >= 1, and only outside torchrun (which sets its own)")
    _positive(temperature, "--temperature")
    ks = _parse_ks(k, n)
    spec = _eval_target(target, task, _task_args(task_arg or []), max_new_tokens, out)
    if (spec.directory / "passk.csv").exists() and not overwrite:
        raise UserError(f"{spec.directory} already holds an evaluation; pass --overwrite to replace it "
                        f"or --out elsewhere")
    if nproc is not None and nproc > 1:
        raise typer.Exit(distributed.relaunch(nproc, _samples_spelled_out(_without_nproc(_invocation[1:]))))

    from atrctl.models import resolve_device

    with distributed.process_group(resolve_device(device)):
        _evaluate_and_write(spec, target, split, n, ks, temperature, problems, seed, device, batch_size)


def _samples_spelled_out(argv: list[str]) -> list[str]:
    """--n as --samples: torchrun's own parser reads --n as an ambiguous abbreviation of its options."""
    return ["--samples" if arg == "--n" else "--samples=" + arg[4:] if arg.startswith("--n=") else arg
            for arg in argv]


def _evaluate_and_write(spec: _EvalTarget, target: str, split: str, n: int, ks: list[int], temperature: float,
                        problems: int, seed: int, device: str, batch_size: int) -> None:
    """Sample (this process's share of) the problems; rank 0 writes the three files and prints the table."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from atrctl import distributed
    from atrctl.eval_report import write_eval
    from atrctl.evaluate import evaluate_model
    from atrctl.models import load_model, set_cpu_threads
    from atrctl.tasks import get_task

    _quiet_libraries()
    evaluated = get_task(spec.task, **spec.task_args)
    picked = evaluated.problems(split, problems, spec.problem_seed)
    set_cpu_threads(distributed.cpu_threads_per_rank())
    model, tokenizer = load_model(spec.model, device, spec.dtype)
    kwargs = dict(n=n, temperature=temperature, seed=seed, max_new_tokens=spec.max_new_tokens,
                  chat_template=spec.chat_template, batch_size=batch_size)
    if not distributed.is_main():
        evaluate_model(model, tokenizer, evaluated, picked, **kwargs)
        return
    columns = (TextColumn("sampling"), BarColumn(), MofNCompleteColumn(), TextColumn("problems"),
               TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("sampling", total=len(picked))  # this process's share once sampling starts
        result = evaluate_model(model, tokenizer, evaluated, picked, **kwargs,
                                on_progress=lambda done, total: progress.update(bar, completed=done, total=total))
    setting = f"{spec.task} {split}, {len(picked)} problems, n={n}, T={temperature:g}"
    try:
        paths = write_eval(result, ks, spec.directory, f"{target}: {setting}")
    except OSError as error:
        raise UserError(f"cannot write to {spec.directory} ({error.strerror}); use --out elsewhere") from None
    console.print(_passk_table(result.summary(ks), ks, f"pass@k: {setting}"))
    console.print("wrote " + ", ".join(str(p) for p in paths))


def _passk_table(summary: dict, ks: list[int], title: str):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=escape(title))
    table.caption = (f"avg@n {summary['avg@n']:.4f}  greedy {summary['greedy']:.4f}  seed {summary['seed']}  "
                     f"{summary['seconds']:.1f} s")
    for column in ("k", "pass@k", "95% CI", "maj@k"):
        table.add_column(column, justify="right")
    for k in ks:
        interval = escape(f"[{summary[f'pass@{k}/low']:.4f}, {summary[f'pass@{k}/high']:.4f}]")
        table.add_row(str(k), f"{summary[f'pass@{k}']:.4f}", interval, f"{summary[f'maj@{k}']:.4f}")
    return table


@app.command()
def compare(
    arms: Annotated[list[str], typer.Argument(help="Losses to train (e.g. grpo atr) or finished run directories.")],
    seeds: Annotated[int, typer.Option(help="Training seeds per arm (0 … seeds-1).")] = 4,
    steps: Annotated[int | None, typer.Option(help="RL steps per run \\[default: the recipe's, 300].")] = None,
    n: Annotated[int, typer.Option("--n", help="Samples per held-out problem for pass@k.")] = 256,
    problems: Annotated[int, typer.Option(help="Held-out problems, the same for every arm.")] = 500,
    jobs: Annotated[int, typer.Option(help="Training runs in parallel (one CPU thread each when > 1).")] = 2,
    max_kl3: Annotated[float | None, typer.Option(help="δ of the atr arm \\[default: 0.1].")] = None,
    eps: Annotated[float | None, typer.Option(help="ε of the grpo arm (ε_low of dapo) \\[default: 0.2].")] = None,
    eps_high: Annotated[float | None, typer.Option(help="ε_high of the dapo arm \\[default: 0.28].")] = None,
    name: Annotated[str | None, typer.Option(help="results/compare-<name>/ \\[default: the arms joined by -].")] = None,
    recipe: RecipeOption = None,
    set_: SetOption = None,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing comparison of the same name.")] = False,
    results: Annotated[Path, typer.Option(help="Results folder.")] = Path("results"),
) -> None:
    """Train and evaluate several algorithms side by side (e.g. `atrctl compare grpo atr`)."""
    import shlex
    import time as clock

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from atrctl import compare as cmp
    from atrctl.bases import ensure_base
    from atrctl.compare_report import write_report
    from atrctl.config import load_recipe, recipe_to_dict, to_toml
    from atrctl.eval_report import write_eval
    from atrctl.evaluate import default_ks
    from atrctl.models import resolve_device
    from atrctl.train import environment, validate_algo

    _quiet_libraries()
    started = clock.perf_counter()
    for value, flag in ((seeds, "--seeds"), (n, "--n"), (problems, "--problems"), (jobs, "--jobs")):
        if value < 1:
            raise UserError(f"{flag} must be at least 1 (got {value})")
    arm_list = cmp.parse_arms(arms)
    config = load_recipe(recipe, ([f"run.steps={steps}"] if steps is not None else []) + list(set_ or []))
    loss_args = {loss: args for loss, args in (
        ("atr", {"max_kl3": max_kl3}), ("grpo", {"eps": eps}), ("dapo", {"eps_low": eps, "eps_high": eps_high}))}
    loss_args = {loss: {k: v for k, v in args.items() if v is not None} for loss, args in loss_args.items()}
    loss_args = {loss: args for loss, args in loss_args.items() if args}
    for arm in arm_list:
        if arm.loss is not None:
            validate_algo(cmp.arm_recipe(config, arm, config.model.base, loss_args))
    ks = default_ks(n)
    comparison = cmp.Comparison(results / f"compare-{name or '-'.join(a.label for a in arm_list)}", arm_list,
                                seeds, config, loss_args)
    cmp.prepare(comparison, overwrite)

    seconds: dict[str, float] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[note]}"),
               TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        bars: dict[str, int] = {}

        def advance(key: str, description: str, done: int, total: int, note: str = "") -> None:
            if key not in bars:
                bars[key] = progress.add_task(description, total=total, note="")
            progress.update(bars[key], completed=done, note=note)

        phase = clock.perf_counter()
        base, _ = ensure_base(config, results, lambda step, loss, acc: advance(
            "warmup", "warm-up base", step, config.warmup.max_steps, f"loss {loss:.3f}"))
        base = str(Path(base).resolve()) if isinstance(base, Path) else base
        seconds["base (warm-up or cache)"] = clock.perf_counter() - phase

        phase = clock.perf_counter()
        job_list = cmp.training_jobs(arm_list, seeds, cmp.write_arm_recipes(comparison, base),
                                     comparison.directory / "runs")
        total_steps = len(job_list) * config.run.steps
        reused = sum(job.finished for job in job_list)
        try:
            cmp.run_jobs(job_list, jobs, lambda done: advance(
                "train", f"train {len(job_list)} runs", done, total_steps, f"{jobs} at a time"))
        except KeyboardInterrupt:
            stderr.print(f"interrupted: rerun the same command to resume the runs in {comparison.directory}")
            raise typer.Exit(130) from None
        seconds[f"training ({len(job_list)} runs, {jobs} at a time; {reused} reused from before)"] = \
            clock.perf_counter() - phase

        phase = clock.perf_counter()
        evaluations = cmp.evaluate_arms(comparison, n, problems, lambda run, done, total: advance(
            f"eval {run}", f"eval {run}", done, total, f"n = {n}"))
        seconds["evaluation (wall)"] = clock.perf_counter() - phase

    for label, directories in cmp.arm_runs(comparison).items():
        for directory, result in zip(directories, evaluations[label], strict=True):
            write_eval(result, ks, directory / "eval", f"{directory.name}: pass@k")
    seconds["total"] = clock.perf_counter() - started
    deltas = sorted({float(loss_args.get("atr", {}).get("max_kl3", 0.1))} if any(a.loss == "atr" for a in arm_list)
                    else {0.1})
    rows = write_report(
        comparison.directory, cmp.arm_runs(comparison), evaluations, ks,
        command=" ".join(shlex.quote(a) for a in _invocation),
        recipe_toml=to_toml(recipe_to_dict(config)), environment=environment(resolve_device(config.model.device)),
        deltas=deltas, eps=float(loss_args.get("grpo", {}).get("eps", 0.2)), seconds=seconds)
    console.print(_compare_table(rows, ks))
    console.print(f"report: {comparison.directory / 'report.md'}")


def _compare_table(rows: list[dict], ks: list[int]):
    from rich.table import Table

    metrics = [f"pass@{k}" for k in ks] + ["greedy"]
    table = Table(title="pass@k, mean over seeds and problems [95% CI]; ★ = difference whose CI excludes 0")
    table.add_column("arm")
    table.add_column("seeds", justify="right")
    for metric in metrics:
        table.add_column(metric, justify="right")
    for row in rows:
        cells = [f"{row[m]:.3f} \\[{row[m + ' low']:.3f}, {row[m + ' high']:.3f}]"
                 + (" ★" if row.get(f"{m} excludes_0") else "") for m in metrics]
        table.add_row(row["row"], str(row["seeds"]), *cells)
    return table


# --------------------------------------------------------------------- entry


_invocation: list[str] = ["atrctl"]  # the command line as typed, for reports


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; bad input becomes one line on stderr and exit code 2, never a traceback."""
    _invocation[1:] = sys.argv[1:] if argv is None else argv
    try:
        code = app(args=argv, prog_name="atrctl", standalone_mode=False)
    except UserError as error:
        stderr.print(f"error: {error}", markup=False, highlight=False, soft_wrap=True)
        return 2
    except typer.TyperException as error:  # typer's own parse errors (it vendors click)
        stderr.print(f"error: {error.format_message()} (see `atrctl --help`)", markup=False, highlight=False,
                     soft_wrap=True)
        return error.exit_code
    except typer.Abort:
        stderr.print("aborted", markup=False)
        return 130
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
