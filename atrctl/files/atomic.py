"""Atomic file writes: a reader never sees a half-written result.

Each writer fills a temporary file in the destination directory and renames it
into place (rename is atomic within one filesystem), so a crash leaves either
the old file or the new one, never a truncated mix.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read the process umask once: mkstemp files are 0600, results should be 0644-like


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o666 & ~_UMASK)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(error, OSError) and error.filename is None:  # a full disk names the file it did not write
            error.filename = str(path)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_jsonl(path: str | os.PathLike, rows) -> None:
    """One JSON object per line (non-ASCII text kept readable), written atomically."""
    write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
