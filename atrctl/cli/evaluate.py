"""`atrctl eval`: pass@k, avg@n, maj@k and greedy accuracy of a run or a model."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer

from atrctl import numbers
from atrctl.cli.display import console
from atrctl.cli.options import DEVICE_HELP, EVALUATION, BackendOption, NprocOption, check_nproc
from atrctl.errors import UserError
from atrctl.files.destinations import check_destination


def eval_command(
    ctx: typer.Context,
    target: Annotated[str, typer.Argument(help="A run directory, a model directory or a hub name.")],
    task: Annotated[str | None, typer.Option(help=r"Task \[default: the run's]; required for a model.")] = None,
    task_arg: Annotated[
        list[str] | None, typer.Option("--task-arg", help="Task parameter key=value, e.g. digits=2 (repeatable).")
    ] = None,
    split: Annotated[str, typer.Option(help="Problem split: test or train.")] = "test",
    n: Annotated[
        int | None,
        typer.Option(
            "--n",
            "--samples",
            help="Samples per problem (--samples under torchrun, which takes --n) [default: a benchmark's preset, "
            f"else {EVALUATION['eval'].n}: {EVALUATION['eval'].why}].",
        ),
    ] = None,
    k: Annotated[str | None, typer.Option("--k", help=r"Comma-separated k's \[default: 1, 2, 4, ... and n].")] = None,
    temperature: Annotated[
        float | None, typer.Option(help=r"Sampling temperature, at least 0.001 \[default: a benchmark's preset; 1].")
    ] = None,
    problems: Annotated[
        int | None,
        typer.Option(
            help="Problems to evaluate, drawn with the run's eval.seed "
            rf"\[default: all of a benchmark, else {EVALUATION['eval'].problems}]."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    device: Annotated[str, typer.Option(help=f"{DEVICE_HELP}.")] = "auto",
    max_new_tokens: Annotated[
        int | None,
        typer.Option(help=r"Longest completion \[default: a benchmark's preset; the run's rollout.max_new_tokens]."),
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
            "--chat-template/--no-chat-template",
            help=r"Wrap prompts in the chat template \[default: a benchmark's preset, else the run's; off].",
        ),
    ] = None,
    system_prompt: Annotated[
        str | None, typer.Option(help=r"Chat system message \[default: the run's; the template's own].")
    ] = None,
    instruction: Annotated[
        str | None,
        typer.Option(help=r"Line after each problem; 'auto': the task format's, '': none \[default: the run's; auto]."),
    ] = None,
    top_p: Annotated[
        float | None,
        typer.Option(
            help=r"Nucleus sampling: keep the smallest set of tokens of this mass \[default: a benchmark's preset; 1]."
        ),
    ] = None,
    completions: Annotated[
        str,
        typer.Option(help="Sampled completions per problem written to samples.jsonl (with the greedy one), or 'all'."),
    ] = "4",
    backend: BackendOption = None,
    nproc: NprocOption = None,
) -> None:
    """Evaluate a model with pass@k, avg@n, maj@k and greedy accuracy: table, CSV, markdown and plot.

    Under torchrun (or --nproc) each process samples a share of the problems; rank 0 alone writes and prints."""
    from atrctl.cli import display, progress, tables
    from atrctl.config.loading import parse_task_args
    from atrctl.experiments.evaluation import eval_target, parse_ks, preset_settings, run_evaluation
    from atrctl.rollout.backend import check_backend
    from atrctl.runtime import distributed
    from atrctl.training.rundir import has_evaluation

    given = dict(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, problems=problems,
                 chat_template=chat_template, backend=backend)  # fmt: skip
    settings = preset_settings(
        task, given, n=EVALUATION["eval"].n, problems=EVALUATION["eval"].problems, temperature=1.0, top_p=1.0
    )
    n, temperature, top_p, max_new_tokens = (settings[key] for key in ("n", "temperature", "top_p", "max_new_tokens"))
    problems, chat_template, backend = settings["problems"], settings["chat_template"], settings["backend"]
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
    check_nproc(nproc)
    numbers.temperature(temperature, "--temperature")
    numbers.top_p(top_p, "--top-p")
    numbers.seed(seed, "--seed")
    ks = parse_ks(k, n)
    if completions != "all" and not (completions.isdigit() and completions.isascii()):
        raise UserError(f"--completions {completions!r}: give a count (e.g. 4, or 0 for the greedy ones only) or 'all'")
    keep = None if completions == "all" else int(completions)
    prompt = dict(chat_template=chat_template, system_prompt=system_prompt, instruction=instruction)
    spec = eval_target(target, task, parse_task_args(task_arg or []), max_new_tokens, out, backend=backend, **prompt)
    check_backend(spec.backend, "--backend")
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
    bar = progress.sampling_bar(0) if distributed.is_main() else nullcontext()  # its total: the first report's
    with bar as on_progress:
        done = run_evaluation(spec, target, **settings, on_progress=on_progress)
    if done is None:  # a rank other than 0: rank 0 prints
        return
    result, setting, paths = done
    if reported is not None:
        from atrctl.training.trackers import report_evaluation

        report_evaluation(reported, spec.directory / "passk.csv")
    console.print(tables.passk_table(result.summary(ks), ks, f"pass@k: {setting}"))
    console.print("wrote " + ", ".join(str(p) for p in paths))


def _reported_run(target: str, out: Path) -> Path | None:
    """The run whose own eval/ an evaluation writes, when its recipe names trackers (their libraries checked)."""
    from atrctl.training.rundir import RunDir
    from atrctl.training.trackers import check_installed, reporter_names

    run = RunDir(target)
    if not run.config.is_file() or Path(out).resolve() != run.eval.resolve():
        return None
    recipe = run.recipe()
    names = reporter_names(recipe.run)
    check_installed(names, run.path)
    return run.path if names else None
