"""The `atrctl` command line: parse the flags, call the core, print what it returns.

One module per command or small group, in the order `atrctl --help` lists them; what several share (the app,
options, evaluation defaults, checks) is `atrctl.cli.options`.  The work is done by functions callable from
Python (`atrctl.training.loop.train`, `atrctl.experiments.evaluation.run_evaluation`,
`atrctl.experiments.compare.run_comparison`, ...); what is shown is `atrctl.cli.display`.  Heavy libraries
(torch, transformers) are imported inside the commands that need them, so `atrctl --help` and `atrctl plot-bounds`
start quickly.
"""

from __future__ import annotations

import contextlib
import sys

import typer

from atrctl.cli import compare, evaluate, export, import_gguf, ls, plots, train
from atrctl.cli.display import OutputLost, show_notices, stderr
from atrctl.cli.options import app
from atrctl.errors import UserError
from atrctl.files.destinations import disk_full

COMMANDS = {
    "plot-bounds": plots.plot_bounds,
    "plot": plots.plot,
    "ls": ls.list_registered,
    "import-gguf": import_gguf.import_gguf_command,
    "warmup": train.warmup,
    "train": train.train,
    "eval": evaluate.eval_command,
    "compare": compare.compare,
    "sweep": compare.sweep,
    "export": export.export,
}
"""Every command, in the order `atrctl --help` lists them."""
for _name, _command in COMMANDS.items():
    app.command(_name)(_command)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; bad input becomes one line on stderr and exit code 2, never a traceback."""
    invocation = list(sys.argv[1:] if argv is None else argv)  # as typed, for reports and relaunches
    show_notices()
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
        from atrctl.runtime.distributed import is_main, rank

        if (is_main() and not error.said) or not error.shared:  # under torchrun a shared refusal is said once
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
