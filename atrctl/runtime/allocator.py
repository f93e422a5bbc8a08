"""Keep the memory a training step frees inside the process, so the next step does not fault it back in.

Why: a step allocates and frees the same tensors every time (activations, logits, the KV cache, its group
repeat).  glibc's malloc serves blocks over its mmap threshold (128 KiB at first, rising with what is freed)
with fresh mmaps and hands freed heap tops back to the kernel above its trim threshold (128 KiB); each
returned page is faulted in and zeroed again on its next use, and on a VM a page fault is dear.  Raising
the mmap threshold to 32 MiB (the most its own adjustment reaches on 64-bit) and the trim threshold out of
reach keeps freed blocks for reuse.  Measured on this project's 2-core CPU (`allocator`, retired:
docs/performance-log.md; 20 paired steps): the medium preset's compiled step went from 9.8k minor faults to
0.9k and ran 1.11x faster [0.98, 1.26] (eager, 12 pairs: 1.15x); tiny at 8 and 64 new tokens 1.06x and
1.09x; peak RSS +1%.

The cost: memory freed after a step's peak stays with the process instead of returning to the system, so
its resident size sits at its peak, which it reaches every step anyway.  Blocks of 32 MiB and more (the
logits of a real vocabulary) still come from mmap and go back.  Nothing here changes a number computed.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # the most glibc's dynamic threshold reaches on 64-bit, and older glibcs accept
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes a C int: 2 GiB of free heap top before any is returned


def is_glibc() -> bool:
    """Whether this process's C library is glibc (musl and others have no such thresholds to set)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for a process that repeats the same large allocations (see the
    module's docstring); once per process, by each command that computes (training, its warm-up, evaluation).
    True where both were set, False where this is not glibc."""
    if not is_glibc():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
