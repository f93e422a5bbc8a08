"""Where a command will write, checked before any work: one line instead of a traceback minutes later.

Every output path of every command (a run directory, a results folder, a comparison, an evaluation's
--out, a figure, an imported model) goes through `check_destination` before the first byte is written
or the first model loaded.  It asks the file system only (stat, access, statvfs) and changes nothing.
A full disk that comes later is `disk_full`'s one line, raised where the write fails.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from atrctl.errors import UserError

MIN_FREE_BYTES = 1 << 20
"""Less than this free on the destination's device is refused up front: not even a recipe and a log fit."""
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def check_destination(
    path: str | os.PathLike, flag: str, *, folder: bool = True, replace: bool = False, what: str | None = None
) -> Path:
    """`path` can be written as a folder (or, `folder=False`, a file): no file stands where a folder must be
    (the path or one above it), no symbolic link loops or points nowhere, a link is not what --overwrite would
    replace (the link would go, not what it points to), the folder that will hold it is writable and its
    device has space.  The message names it as `what` (default: "<flag> <path>") and says to choose another
    `flag` (the option that sets it).  Returns `path`."""
    path = Path(path)
    what = what or f"{flag} {path}"
    absolute = Path(os.path.abspath(path))  # ".." taken literally, links not followed: what the writes will do
    nearest = None
    for ancestor in reversed(absolute.parents):  # from / down to the path's folder
        kind = _kind(ancestor, what, flag)
        if kind is None:
            break
        if kind != "folder":
            raise UserError(f"{what}: {ancestor} is {kind}, not a folder; choose another {flag}")
        nearest = ancestor
    else:
        kind = _kind(absolute, what, flag)
        if kind is not None:
            if absolute.is_symlink() and replace:
                raise UserError(f"{what}: it is a symbolic link, and --overwrite would replace the "
                                f"link, not what it points to; give the real path ({absolute.resolve()})")  # fmt: skip
            if folder and kind != "folder":
                raise UserError(f"{what}: it is {kind}, not a folder; choose another {flag}")
            if not folder and kind == "folder":
                raise UserError(f"{what}: it is a folder; give a file path inside it, or another {flag}")
            if kind == "folder":
                nearest = absolute
    assert nearest is not None  # "/" always exists
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise UserError(f"{what}: {nearest} is not writable; choose a writable {flag}")
    free = _free_bytes(nearest)
    if free is not None and free < MIN_FREE_BYTES:
        raise UserError(f"{what}: no space left on the device of {nearest} ({free} bytes free); "
                        f"free space, or choose another {flag}")  # fmt: skip
    return path


def _kind(path: Path, what: str, flag: str) -> str | None:
    """'folder', 'a file' (or another kind of entry), or None when nothing is there; a link loop or a
    link to nothing is a UserError."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            raise UserError(f"{what}: {path} is a symbolic link to nothing ({os.readlink(path)}); "
                            f"remove it or choose another {flag}") from None  # fmt: skip
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UserError(f"{what}: {path} is a symbolic link loop; remove it or choose another {flag}") from None
        if error.errno == errno.ENOTDIR:  # a file further up: reported there
            return None
        raise UserError(f"{what}: cannot look at {path} ({error.strerror}); choose another {flag}") from None
    if stat.S_ISDIR(mode):
        return "folder"
    return "a file" if stat.S_ISREG(mode) else "not a file or folder"


def _free_bytes(folder: Path) -> int | None:
    try:
        info = os.statvfs(folder)
    except OSError:
        return None
    if info.f_blocks == 0:  # a pseudo file system that reports no sizes
        return None
    return info.f_bavail * info.f_frsize


@contextlib.contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Libraries say "disk full" in their own words (torch.save: RuntimeError "unexpected pos", safetensors:
    SafetensorError); in this block such an error, raised while the device of `path`'s folder is (nearly)
    full, is the OSError(ENOSPC) it stands for, naming `path`, so that one handler (`disk_full`) answers
    every write."""
    try:
        yield
    except OSError as error:
        if error.filename is None:  # a write to an open file names none
            error.filename = str(path)
        raise
    except Exception as error:
        free = _free_bytes(Path(path).parent)
        if "No space left" in str(error) or (free is not None and free < MIN_FREE_BYTES):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from error
        raise


def disk_full(error: OSError, retry: str) -> UserError | None:
    """The one line for a write that found no space (ENOSPC, EDQUOT), naming the file when known and what to
    do after freeing space (`retry`); None for any other error."""
    if error.errno not in DISK_FULL:
        return None
    where = f" writing {error.filename}" if error.filename else ""
    return UserError(f"no space left on the device{where} ({error.strerror}); free space, then {retry}")
