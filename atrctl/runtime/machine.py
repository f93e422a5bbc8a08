"""What this machine lends a process: its CPUs (threads, ATRCTL_THREADS) and its available memory."""

from __future__ import annotations

import os

from atrctl.errors import UserError


def set_cpu_threads(threads: int | None = None) -> int:
    """Use every CPU this process may run on (torch defaults to physical cores); ATRCTL_THREADS overrides."""
    import torch

    if threads is None:
        threads = requested_threads() or usable_cpus()
    torch.set_num_threads(threads)
    return torch.get_num_threads()


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def requested_threads() -> int | None:
    """ATRCTL_THREADS, checked (None when unset): a whole number from 1 to the CPUs this process may use.  Read
    by the command itself before anything is written, not first by a child it starts (compare's runs)."""
    env = os.environ.get("ATRCTL_THREADS")
    if not env:
        return None
    if not (env.isascii() and env.isdigit() and 1 <= int(env) <= usable_cpus()):
        raise UserError(f"ATRCTL_THREADS='{env[:20]}' is not a whole number from 1 to {usable_cpus()} (the CPUs "
                        "this process may use): set it to e.g. 2 or unset it")  # fmt: skip
    return int(env)


def check_fits(what: str, needed: int, fix: str) -> None:
    """The one memory check: refuse `what`, which needs at least `needed` bytes, where this machine has fewer
    available, before any work (else it runs, perhaps for hours, and is then killed); `fix` says what to lower."""
    available = available_memory()
    if available is not None and needed > available:
        raise UserError(f"{what} need about {needed / 2**30:,.1f} GiB to hold, more than the "
                        f"{available / 2**30:,.1f} GiB available: {fix}")  # fmt: skip


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux MemAvailable; else free pages; None if unknown)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
