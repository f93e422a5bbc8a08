"""The one exception type for bad input from the user.

The CLI turns it into a single line on stderr and exit code 2, so the core can
raise it anywhere without knowing it is called from a terminal.
"""


class UserError(ValueError):
    """Bad input: the message names the problem and how to fix it."""
