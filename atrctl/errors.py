"""The one exception type for bad input from the user.

The CLI turns it into a single line on stderr and exit code 2, so the core can
raise it anywhere without knowing it is called from a terminal.
"""


class UserError(ValueError):
    """Bad input: the message names the problem and how to fix it.  `shared`: every rank of a torchrun job
    raised it together (`distributed.decided_by_main`), so rank 0 alone prints it; `said`: rank 0 printed it
    already, before the others could end (and torchrun with them, rank 0 included)."""

    shared = False
    said = False


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none: a library's error
    quoted inside one of our one-line messages."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
