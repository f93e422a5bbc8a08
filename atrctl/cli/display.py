"""Where the CLI writes: stdout and stderr consoles whose lost output is told apart from a results file's,
unwrapped tables where stdout is a log, and the library's notices as stderr lines.  Presentation only.

Heavy libraries stay out: this module is imported by `atrctl --help`.
"""

from __future__ import annotations

import logging
import sys

from rich.console import Console


class OutputLost(Exception):
    """Standard output or error could not be written: a full device (`> /dev/full`) or a pipe whose reader
    has gone (`| head -1`).  `atrctl.cli.main` ends on it with one line, or quietly for a closed pipe."""

    def __init__(self, stream: str, error: OSError):
        name = {"stdout": "standard output", "stderr": "standard error"}[stream]
        super().__init__(f"cannot write to {name} ({error.strerror or error})")
        self.stream, self.error = stream, error


class _Guarded:
    """sys.stdout or sys.stderr as they are now (tests swap them), with a failed write raised as `OutputLost`,
    so that it is told apart from a results file that cannot be written."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        return getattr(getattr(sys, self._name), attribute)

    def write(self, text: str) -> int:
        try:
            return getattr(sys, self._name).write(text)
        except OSError as error:
            raise OutputLost(self._name, error) from None

    def flush(self) -> None:
        try:
            getattr(sys, self._name).flush()
        except OSError as error:
            raise OutputLost(self._name, error) from None


LOG_WIDTH = 100_000
"""Line width where stdout is not a terminal (nohup, SLURM, CI, a pipe): rich wraps nothing, so each figure of a
table stays on one line with its interval."""


def stdout_console() -> Console:
    """The console of stdout: the terminal's width on a terminal, `LOG_WIDTH` elsewhere."""
    return Console(file=_Guarded("stdout"), width=None if sys.stdout.isatty() else LOG_WIDTH)


console = stdout_console()
stderr = Console(file=_Guarded("stderr"), stderr=True)


class _NoticeLines(logging.Handler):
    """The `atrctl` loggers' notices (a "note: ..." or "warning: ..." the library logs), each one line on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        stderr.print(record.getMessage(), markup=False, highlight=False, soft_wrap=True)


def show_notices() -> None:
    """Show the library's notices on stderr: the one channel by which a command tells the user what is not an
    error (a damaged file passed over, a setting that falls back), once per process however often it runs."""
    logger = logging.getLogger("atrctl")
    if not any(isinstance(handler, _NoticeLines) for handler in logger.handlers):
        logger.addHandler(_NoticeLines(logging.WARNING))


def quiet_libraries() -> None:
    """Our progress display is the only one: silence transformers' and the hub's tqdm bars."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
