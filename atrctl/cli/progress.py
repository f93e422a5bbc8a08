"""Progress while work runs: rich bars on a terminal, and where stdout is not one (a log, CI) a plain line every
PLAIN_INTERVAL seconds."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from atrctl.cli.display import OutputLost, console, stderr

PLAIN_INTERVAL = 30.0
"""Seconds between the plain progress lines written where stdout is not a terminal (ATRCTL_PROGRESS_SECONDS
changes it; 0 writes every update)."""


class PlainProgress:
    """What a rich Progress shows, as plain lines for a log file: rich draws its bars with control codes that
    a file gets only at the end, so a job under nohup or SLURM would look hung.

    A bar's line is written at its first update, when it completes, and every `interval` seconds between,
    from a timer thread, news or not (a heartbeat: a log that stops growing means a stopped job, not a
    long step).  A line is the description, done/total, the status fields, the elapsed time and, from the
    second update on, the remaining time at the rate since the first (a resumed run's steps done before are
    not part of the rate).  With interval 0 there is no timer: every update that changed something is written.
    """

    def __init__(self, *columns, console: Console, interval: float | None = None, **ignored):
        self.file = console.file
        self.interval = progress_interval() if interval is None else interval
        self.bars: dict[int, dict] = {}
        self.live = types.SimpleNamespace(transient=False, stop=lambda: None)  # what training_bars' quiet stop sets
        self.disable = False
        self.lock, self.stopped = threading.Lock(), threading.Event()
        self.timer = threading.Thread(target=self._heartbeat, daemon=True) if self.interval > 0 else None

    def __enter__(self):
        if self.timer is not None:
            self.timer.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        if self.timer is not None and self.timer.is_alive():
            self.timer.join()
        if exc[0] is None and not self.disable:
            with self.lock:
                for bar in self.bars.values():  # the state each bar ended in, unless its last line said it
                    if bar["written"] != (bar["completed"], bar["fields"]):
                        self._write(bar)
        return False

    def add_task(self, description: str, total: float | None = None, **fields) -> int:
        with self.lock:
            key = len(self.bars)
            self.bars[key] = {"description": description, "total": total, "completed": 0, "fields": fields,
                              "started": time.monotonic(), "first": None, "last": None, "written": None}  # fmt: skip
        return key

    def update(self, key: int, *, completed: float | None = None, total: float | None = None, **fields) -> None:
        with self.lock:
            bar, now = self.bars[key], time.monotonic()
            if completed is not None:
                bar["completed"] = completed
            if total is not None:
                bar["total"] = total
            bar["fields"] = {**bar["fields"], **fields}
            if bar["first"] is None:
                bar["first"] = (now, bar["completed"])
            if self.disable:
                return
            changed = bar["written"] != (bar["completed"], bar["fields"])
            if bar["last"] is None or (changed and (self._finished(bar) or self.interval == 0)):
                self._write(bar)

    def _heartbeat(self) -> None:
        while not self.stopped.wait(min(self.interval, 1.0)):
            with self.lock:
                now = time.monotonic()
                for bar in self.bars.values():
                    due = bar["last"] is not None and now - bar["last"] >= self.interval
                    if due and not self._finished(bar) and not self.disable:
                        self._write(bar)

    @staticmethod
    def _finished(bar: dict) -> bool:
        return bar["total"] is not None and bar["completed"] >= bar["total"]

    def _write(self, bar: dict) -> None:
        now = time.monotonic()
        done, total = bar["completed"], bar["total"]
        parts = [bar["description"], f"{done:g}/{total:g}" if total is not None else f"{done:g}"]
        parts += [str(value) for value in bar["fields"].values() if str(value)]
        parts.append(f"elapsed {_clock(now - bar['started'])}")
        since, done_then = bar["first"] or (now, done)
        if total and done < total and done > done_then and now > since:  # the rate since the first update
            parts.append(f"ETA {_clock((now - since) * (total - done) / (done - done_then))}")
        try:
            print("  ".join(parts), file=self.file, flush=True)
        except OutputLost as lost:  # the work goes on without its progress lines: they are not its results
            self.disable = True
            with contextlib.suppress(OutputLost):
                stderr.print(f"note: {lost}: progress is no longer shown; the work goes on and writes its results",
                             markup=False, highlight=False, soft_wrap=True)  # fmt: skip
        bar["last"], bar["written"] = now, (bar["completed"], dict(bar["fields"]))


def progress_interval() -> float:
    """PLAIN_INTERVAL, or ATRCTL_PROGRESS_SECONDS when set (a number of seconds >= 0)."""
    raw = os.environ.get("ATRCTL_PROGRESS_SECONDS")
    if raw is None:
        return PLAIN_INTERVAL
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not (seconds >= 0 and seconds < float("inf")):
        from atrctl.errors import UserError

        raise UserError(f"ATRCTL_PROGRESS_SECONDS must be a number of seconds >= 0, got {raw!r}; e.g. 30")
    return seconds


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


def live_or_plain(*columns, **options):
    """rich's live bars on a terminal; elsewhere (a log file, a pipe) `PlainProgress` lines."""
    return Progress(*columns, **options) if options["console"].is_terminal else PlainProgress(*columns, **options)


@contextmanager
def warmup_bar(max_steps: int) -> Iterator[Callable[[int, int, float, float | None], None]]:
    """A bar for `atrctl warmup`; yields on_progress(step, total, loss, held-out accuracy or None)."""
    columns = (
        TextColumn("warm-up"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    )
    with live_or_plain(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("warm-up", total=max_steps, status="")
        shown = {"accuracy": "–"}

        def on_progress(step: int, total: int, loss: float, accuracy: float | None) -> None:
            if accuracy is not None:
                shown["accuracy"] = f"{accuracy:.1%}"
            status = f"loss {loss:.3f}  held-out greedy {shown['accuracy']}"
            progress.update(bar, completed=step, total=total, status=status)

        yield on_progress


@contextmanager
def training_bars(loss: str, steps: int, warmup_steps: int):
    """Live bars for a training run (the warm-up one only if a base is built); yields (on_warmup, on_step).

    A run stopped by bad input before any bar showed leaves the terminal as it was."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
    )
    with live_or_plain(*columns, console=console, transient=False) as progress:
        bars: dict[str, int] = {}  # created when that phase starts: a cached base shows no warm-up bar
        evaluated: dict = {}

        def on_warmup(step: int, total: int, loss_value: float, accuracy: float | None) -> None:
            if "warmup" not in bars:
                bars["warmup"] = progress.add_task("warm-up", total=warmup_steps, status="")
            status = f"loss {loss_value:.3f}" + (f"  held-out greedy {accuracy:.1%}" if accuracy is not None else "")
            progress.update(bars["warmup"], completed=step, total=total, status=status)

        def on_step(record: dict) -> None:
            if "train" not in bars:
                bars["train"] = progress.add_task(f"train {loss}", total=steps, status="")
            status = (
                f"reward {record['reward/mean']:.3f}  clip low {record.get('clip/low', 0):.3f} "
                f"high {record.get('clip/high', 0):.3f}  kl3 {record.get('kl3/mean', 0):.2e}  "
                f"entropy {record.get('entropy', 0):.3f}  {record['tokens_per_s']:.0f} tok/s"
            )
            if "eval/greedy" in record:  # the latest held-out figures stay shown until the next ones
                evaluated["text"] = f"eval greedy {record['eval/greedy']:.1%} pass@1 {record['eval/pass@1']:.1%}"
                evaluated["step"] = record["step"]
            if evaluated:
                at = "" if evaluated["step"] == record["step"] else f" (step {evaluated['step']})"
                status += f"  {evaluated['text']}{at}"
            progress.update(bars["train"], completed=record["step"], status=status)

        try:
            yield on_warmup, on_step
        finally:
            if not bars:  # nothing was shown (bad input): stop quietly, without rich's closing blank line
                progress.live.transient = True
                progress.live.stop()
                progress.disable = True


@contextmanager
def sampling_bar(total: int) -> Iterator[Callable[[int, int], None]]:
    """A bar over completions sampled (greedy ones first); yields on_progress(done, total) (total: this process's
    share)."""
    columns = (TextColumn("sampling"), BarColumn(), MofNCompleteColumn(), TextColumn("completions"),
               TimeRemainingColumn())  # fmt: skip
    with live_or_plain(*columns, console=console, transient=True) as progress:
        bar = progress.add_task("sampling", total=total)
        yield lambda done, share: progress.update(bar, completed=done, total=share)


@contextmanager
def phase_bars() -> Iterator[Callable[[str, str, int, int, str], None]]:
    """One bar per phase of a long pipeline, each made on its first report; yields
    advance(key, description, done, total, note)."""
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeRemainingColumn(),
    )
    with live_or_plain(*columns, console=console) as progress:
        bars: dict[str, int] = {}

        def advance(key: str, description: str, done: int, total: int, note: str = "") -> None:
            if key not in bars:
                bars[key] = progress.add_task(description, total=total, note="")
            progress.update(bars[key], completed=done, total=total, note=note)  # a total may shrink: see warm_up

        yield advance
