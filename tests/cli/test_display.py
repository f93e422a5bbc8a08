"""Plain progress lines, where stdout is not a terminal: when they are written and what they estimate."""

import io
import time

import pytest
from rich.console import Console

from atrctl.cli import progress
from atrctl.errors import UserError


def lines_of(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_the_remaining_time_is_the_rate_since_the_first_update(monkeypatch):
    """A run resumed at step 500 of 1000: its earlier steps are not part of the rate."""
    clock = iter([0.0, 0.0, 0.0, 10.0, 10.0, 20.0, 20.0, 20.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    with progress.PlainProgress(console=Console(file=out), interval=0) as bars:
        bar = bars.add_task("train atr", total=1000, status="")
        bars.update(bar, completed=500)
        bars.update(bar, completed=501)  # one step in 10 s: 499 left
        bars.update(bar, completed=502)
    first, second, third = lines_of(out)
    assert first == "train atr  500/1000  elapsed 0:00:00"  # no rate yet
    assert second.endswith("elapsed 0:00:10  ETA 1:23:10")  # 10 s x 499
    assert third.endswith("elapsed 0:00:20  ETA 1:23:00")  # 20 s / 2 steps x 498 = 4980 s


def test_a_heartbeat_line_comes_without_updates():
    """A long step updates nothing: the timer still writes the bar's line every interval."""
    out = io.StringIO()
    with progress.PlainProgress(console=Console(file=out), interval=0.05) as bars:
        bar = bars.add_task("train atr", total=3, status="")
        bars.update(bar, completed=1)
        deadline = time.monotonic() + 5
        while len(lines_of(out)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        beats = len(lines_of(out))
        bars.update(bar, completed=3)
    assert beats >= 3 and all(line.startswith("train atr  1/3") for line in lines_of(out)[:beats])
    assert lines_of(out)[-1].startswith("train atr  3/3")


@pytest.mark.parametrize("value", ["abc", "-1", "inf"])
def test_a_bad_interval_is_one_line(monkeypatch, value):
    monkeypatch.setenv("ATRCTL_PROGRESS_SECONDS", value)
    with pytest.raises(UserError, match="ATRCTL_PROGRESS_SECONDS must be a number of seconds >= 0"):
        progress.progress_interval()


def test_a_phase_whose_total_shrinks_to_what_is_done_ends_and_stops_beating(monkeypatch):
    """compare's warm-up bar: the warm-up stopped at its target (400 of at most 3000 steps), so its total
    becomes 400; the line says 400/400 and the heartbeat writes it no more while the next phase runs."""
    out = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=out))  # not a terminal: plain lines
    monkeypatch.setenv("ATRCTL_PROGRESS_SECONDS", "0.02")
    with progress.phase_bars() as advance:
        advance("warmup", "warm-up base", 399, 3000, "loss 0.700")
        advance("warmup", "warm-up base", 400, 400, "loss 0.664")
        ended = len(lines_of(out))
        advance("train", "train 8 runs", 1, 2400)
        time.sleep(0.2)  # ten heartbeats
    warmup_lines = [line for line in lines_of(out) if line.startswith("warm-up base")]
    assert warmup_lines[-1].startswith("warm-up base  400/400  loss 0.664")
    assert lines_of(out)[ended - 1] == warmup_lines[-1]  # written when it ended, never again
    assert sum(line.startswith("train 8 runs  1/2400") for line in lines_of(out)) >= 3  # the heartbeat ran


def test_a_notice_of_any_atrctl_module_is_one_line_on_stderr_once_however_often_the_cli_runs(capsys):
    import logging

    from atrctl.cli import main

    assert main(["ls"]) == 0 and main(["ls"]) == 0  # each run routes the notices; only the first adds the route
    capsys.readouterr()
    logging.getLogger("atrctl.experiments.compare").warning("note: %s is damaged", "eval/result.json")
    logging.getLogger("atrctl.experiments.compare").info("progress the user does not need")
    assert capsys.readouterr().err == "note: eval/result.json is damaged\n"
