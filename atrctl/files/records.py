"""Reading back the JSON files atrctl wrote earlier (caches, markers, summaries): the one reader for all of them.

A file that was edited, truncated, replaced by a directory or written by another version is never trusted
and never a traceback: `read_json` checks its shape and raises `DamagedFile`, one line naming the file and
what to do.  A caller that can simply compute the content again (the evaluation cache) catches it and says
so in a note instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from atrctl.errors import UserError

Shape = dict[str, type | tuple[type, ...]]
"""The keys a record must hold and the type (or types) of each value; other keys are allowed."""


class DamagedFile(UserError):
    """A file atrctl wrote earlier that no longer holds what atrctl wrote; `problem` says how it differs."""

    def __init__(self, path: Path, problem: str, fix: str):
        super().__init__(f"{path} is damaged ({problem}): {fix}")
        self.path, self.problem = Path(path), problem


def read_json(path: str | Path, fix: str, shape: Shape | None = None) -> dict:
    """The JSON object in `path`, holding every key of `shape` with a value of its type (a bool is not an
    int).  Anything else is DamagedFile, whose message ends with `fix`."""
    path = Path(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except IsADirectoryError:
        raise DamagedFile(path, "a directory, not a file", fix) from None
    except UnicodeDecodeError:
        raise DamagedFile(path, "not UTF-8 text", fix) from None
    except json.JSONDecodeError as error:
        raise DamagedFile(path, f"not JSON: {error.msg} at line {error.lineno}", fix) from None
    except RecursionError:
        raise DamagedFile(path, "nested too deeply", fix) from None
    except OSError as error:
        raise DamagedFile(path, error.strerror or type(error).__name__, fix) from None
    if not isinstance(data, dict):
        raise DamagedFile(path, f"holds {type(data).__name__ if data is not None else 'null'}, not an object", fix)
    for key, kind in (shape or {}).items():
        if key not in data:
            raise DamagedFile(path, f"no '{key}'", fix)
        if not _is(data[key], kind):
            raise DamagedFile(path, f"'{key}' is {type(data[key]).__name__}", fix)
    return data


def _is(value: object, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:  # JSON's true is not the number 1
        return False
    return isinstance(value, kinds)


NUMBER = (int, float)
