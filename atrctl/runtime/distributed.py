"""Data parallelism under torchrun: process group, rank queries and the few collectives training needs.

Every function works without a process group (a single process is world size 1), so the training
loop has one code path.  Gradients are summed by hand after each mini-batch instead of through
DDP: the loss is already scaled by the global normaliser (see `train.update_step`), so a plain
sum gives exactly the single-process gradient, with no DDP wrapper around the model to unwrap for
sampling, saving and gradient accumulation.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(hours=2)  # rank 0 evaluates alone while the others wait


def world_size() -> int:
    """Processes in this run, from torchrun's environment (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main() -> bool:
    """Only rank 0 writes files and shows progress."""
    return rank() == 0


def cpu_threads_per_rank() -> int | None:
    """This process's share of the CPUs when several ranks share a machine (None: the usual default,
    or ATRCTL_THREADS when set)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local == 1 or os.environ.get("ATRCTL_THREADS"):
        return None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // local)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def process_group(device: torch.device):
    """Join torchrun's process group for the duration (nccl on CUDA, gloo on CPU); no-op for one process."""
    if world_size() == 1 or _active():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    try:
        yield
        dist.barrier()  # leave together: a rank that exits while rank 0 still writes can abort in gloo's teardown
    finally:
        # a sharded model dropped by the work inside is cyclic garbage: freed now, while the group it holds work of
        # still exists, not at interpreter exit, where gloo's teardown aborted the process (1 run in ~12, seen)
        gc.collect()
        while _AT_LEAVE:
            _AT_LEAVE.pop()()
        if _active():  # an engine closed above may have ended the group itself
            dist.destroy_process_group()


_AT_LEAVE: list[Callable[[], None]] = []


def at_leave(close: Callable[[], None]) -> None:
    """Call `close` when the process group is left, after the run's last collective: an engine that ends the
    group as it shuts down (vLLM's does) must outlive every collective of the run, not just the object that
    held it."""
    _AT_LEAVE.append(close)


def barrier() -> None:
    if _active():
        dist.barrier()


@contextlib.contextmanager
def main_first():
    """Rank 0 runs the block first (e.g. builds a cached base), the others after it is done."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


def decided_by_main(check) -> None:
    """Run `check()` on rank 0 alone; a UserError it raises is raised on every rank, so no rank goes on to wait
    in a collective for one that has stopped (and each exits with the same one line and code)."""
    from atrctl.errors import UserError

    message = None
    if is_main():
        try:
            check()
        except UserError as error:
            message = str(error)
    said = False
    if _active():
        if message is not None:  # said before any rank learns of it: torchrun stops every rank once one has ended,
            print(f"error: {message}", file=sys.stderr, flush=True)  # and a busy rank 0 was stopped unheard
            said = True
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    if message is not None:
        error = UserError(message)
        error.shared, error.said = True, said
        raise error


def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    """In place sum over ranks; returns the tensor."""
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_min(tensor: torch.Tensor) -> torch.Tensor:
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return tensor


def all_max(tensor: torch.Tensor) -> torch.Tensor:
    if _active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank: one all-reduce, so every rank takes the same branch."""
    return bool(all_max(torch.tensor(float(flag), device=device)).item())


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors of all ranks along dim 0, in rank order."""
    if not _active():
        return tensor
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return torch.cat(out)


def shard() -> tuple[int, int]:
    """(rank, world size) of the joined process group; (0, 1) without one."""
    if not _active():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_gather_objects(obj) -> list:
    """Every rank's picklable `obj`, in rank order (works on gloo and nccl); [obj] without a process group."""
    if not _active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def sum_gradients(parameters) -> None:
    """Sum each parameter's gradient over ranks (a missing one counts as zeros)."""
    if not _active():
        return
    for parameter in parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)


def relaunch(nproc: int, argv: list[str]) -> int:
    """Run `atrctl <argv>` in `nproc` processes on this machine, as torchrun does (its elastic agent, in this
    process); the exit code of the first process that failed (128 + signal for a killed one), else 0.  The
    agent's own report of a failure is silenced: the failing process has already said why, in one line."""
    import logging
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
    )
    for name in list(logging.root.manager.loggerDict):  # each sets its own level, so the parent's is not enough
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, sys.executable)("-m", "atrctl", *torchrun_argv(argv))
    except ChildFailedError as failed:
        _, failure = failed.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as interrupted:  # Ctrl-C or SIGTERM: the processes got it too, and have checkpointed
        return 128 + int(interrupted.sigval)
    return 0


def torchrun_argv(argv: list[str]) -> list[str]:
    """The command line for the processes torchrun starts: without its --nproc option, and with --n spelt
    --samples (torchrun's own parser reads --n as an ambiguous abbreviation of its options)."""
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--nproc="):
            skip = False
        elif arg == "--nproc":
            skip = True
        else:
            out.append("--samples" if arg == "--n" else "--samples=" + arg[4:] if arg.startswith("--n=") else arg)
    return out
