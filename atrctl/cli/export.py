"""`atrctl export`: the settings that train a loss inside TRL or verl."""

from __future__ import annotations

from typing import Annotated

import typer

from atrctl.cli.display import console
from atrctl.cli.options import EpsHighOption, EpsOption, MaxKl3Option
from atrctl.errors import UserError


def export(
    arm: Annotated[
        str, typer.Argument(help="The loss and its parameters, as an arm: atr, atr:max_kl3=0.05, tv-band:delta=0.1.")
    ] = "atr",
    to: Annotated[str, typer.Option("--to", help="trl (Python) or verl (Hydra overrides).")] = "trl",
    max_kl3: MaxKl3Option = None,
    eps: EpsOption = None,
    eps_high: EpsHighOption = None,
) -> None:
    """Print the settings that train a loss inside TRL or verl (e.g. `atrctl export --to verl --max-kl3 0.05`)."""
    from atrctl.core.losses import flag_parameters, loss_parameters
    from atrctl.experiments.arms import arm_text, parse_arm
    from atrctl.integrations.export import export as snippet

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
