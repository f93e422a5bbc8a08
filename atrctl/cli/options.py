"""What the commands share: the app, the options several commands take (each defined once, with one help
text), the evaluation defaults and why they differ, and the checks of flag values."""

from __future__ import annotations

import math
from enum import Enum
from pathlib import Path
from typing import Annotated, NamedTuple

import typer

from atrctl import __version__
from atrctl.cli.display import console
from atrctl.core.divergence import region_defaults
from atrctl.errors import UserError
from atrctl.model.numerics import DEVICES
from atrctl.reports.bounds_table import FIGURE_FORMATS

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


# ------------------------------------------------------------------ options several commands take

RecipeOption = Annotated[Path | None, typer.Option("--recipe", help="TOML recipe \\[default: built-in defaults].")]
SetOption = Annotated[
    list[str] | None, typer.Option("--set", help="Override any recipe key: section.key=value (repeatable).")
]
ResultsOption = Annotated[Path, typer.Option(help="Results folder.")]
BackendOption = Annotated[
    str | None,
    typer.Option(help=r"Rollout backend that samples (rollout.backend): hf or vllm \[default: the recipe's, hf]."),
]
ReportToOption = Annotated[
    list[str] | None,
    typer.Option(help="Trackers besides metrics.jsonl: tensorboard, wandb (repeatable, or comma-separated)."),
]
NprocOption = Annotated[
    int | None, typer.Option(help="Data-parallel processes: relaunches itself under torchrun \\[default: 1].")
]

# The trust-region flags of train, compare, sweep and export: parameters of whichever loss takes them
# (`losses.flag_parameters`; in compare and sweep, of the constant regions), an arm's own value winning.
MaxKl3Option = Annotated[
    float | None, typer.Option(help=f"KL3 level δ of atr (an arm's own value wins) \\[default: {DEFAULT_MAX_KL3}].")
]
EpsOption = Annotated[
    float | None,
    typer.Option(
        help=f"Clip ε: grpo's eps, dapo's eps_low (train: also gspo's and cispo's eps_low; an arm's own value "
        f"wins) \\[default: {DEFAULT_EPS}]."
    ),
]
EpsHighOption = Annotated[
    float | None,
    typer.Option(
        help=f"Upper clip ε_high of dapo (train: also of gspo and cispo; an arm's own value wins) \\[default: the "
        f"loss's, {DEFAULT_EPS_HIGH} for dapo]."
    ),
]


class Evaluation(NamedTuple):
    n: int  # samples per held-out problem
    problems: int  # held-out problems
    why: str  # said in --help, since the commands' defaults differ


EVALUATION = {
    "eval": Evaluation(256, 200, "pass@k up to k = 256 of one model"),
    "compare": Evaluation(256, 500, "500 problems, since differences between a few arms need narrow intervals"),
    "sweep": Evaluation(64, 200, "n = 64, since a grid evaluates many arms"),
}
"""The evaluation defaults of the three commands that evaluate, in one place, each with its reason."""

ArmSamplesOption = Annotated[
    int, typer.Option("--n", help="Samples per held-out problem for pass@k (compare: 256, sweep: 64 by default).")
]
ArmProblemsOption = Annotated[
    int,
    typer.Option(
        help="Held-out problems, the same for every arm (compare: 500, narrower intervals for a few arms' "
        "differences; sweep: 200, as it evaluates many arms)."
    ),
]


def report_to_sets(names: list[str] | None) -> list[str]:
    """--report-to as the `--set` override of run.report_to (none when not given)."""
    if not names:
        return []
    listed = [name.strip() for given in names for name in given.split(",") if name.strip()]
    from atrctl.config.loading import check_report_to

    check_report_to(listed)
    return ["run.report_to=[" + ", ".join(f'"{name}"' for name in listed) + "]"]


# ------------------------------------------------------------------ checks of flag values


def positive(value: float, flag: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{flag} must be a finite number > 0 (got {value}); e.g. {flag} 0.1")
    return value


def unit_open(value: float, flag: str) -> float:
    if not (math.isfinite(value) and 0 < value < 1):
        raise UserError(f"{flag} must be in the open interval (0, 1) (got {value}); e.g. {flag} 0.2")
    return value


def check_nproc(nproc: int | None) -> None:
    from atrctl.runtime import distributed

    if nproc is not None and (nproc < 1 or distributed.world_size() > 1):
        raise UserError(f"--nproc {nproc}: give a count >= 1, and only outside torchrun (which sets its own)")
