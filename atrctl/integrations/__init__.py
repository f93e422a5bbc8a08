"""atrctl's trust regions inside other trainers.  Each integration imports its trainer only when it is used:
`import atrctl`, the CLI and the core never import TRL or verl."""

from __future__ import annotations

import importlib

from atrctl.errors import UserError


def require(module: str, install: str, what: str):
    """The trainer's module, or one line saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{what} needs {module}, which is not installed: {install}") from None
