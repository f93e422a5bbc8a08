"""The interface every task shares: problems with a split and a seed, and a verifiable reward."""

from dataclasses import dataclass
from typing import Protocol

from atrctl.errors import UserError

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer and a correct completion to warm up on."""

    id: str
    prompt: str
    answer: str
    solution: str


@dataclass(frozen=True)
class Score:
    """Reward in [0, 1] and the normalized parsed answer (None if unparseable), used for maj@k; `form` is the
    answer as written, normalised, where one value has several correct ways to reach it (countdown's
    expression): distinct correct forms measure how many solutions the samples explore."""

    reward: float
    parsed: str | None
    form: str | None = None


class Task(Protocol):
    name: str
    instruction: str  # what the prompt format asks of the answer ("" for none): `task.instruction = "auto"`

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]: ...

    def score(self, problem: Problem, completion: str) -> Score: ...


def check_request(split: str, n: int | None) -> None:
    """Reject a bad split or count before any work, with the fix in the message."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; use 'train' or 'test'")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise UserError(f"n={n!r} is invalid; use a non-negative integer, or None for all problems")


def require_int(task: str, name: str, value: object, lo: int, hi: int) -> None:
    """Task parameters come from TOML or the command line, so check type and range once, up front."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise UserError(f"{task} parameter {name}={value!r} is invalid; use an integer from {lo} to {hi}")


# How a task's prompts are written and its answers read.  compact: the bare problem, the completion *is* the
# answer (what the character models learn); instruct: the problem in words with an instruction on how to
# state the answer, read by `atrctl.tasks.answer.find_answer` (what instruct models expect).
FORMATS = ("compact", "instruct")


def check_format(task: str, format: object) -> None:
    if format not in FORMATS:
        raise UserError(f"{task} parameter format={format!r} is invalid; use one of {', '.join(FORMATS)}")


def problem_pool(task: Task, split: str, n: int, seed: int) -> list[Problem]:
    """Up to n distinct problems for a trainer to cycle through: all of a split smaller than n.

    Tasks refuse to invent duplicates when asked for more than a split holds; a trainer only
    wants as many as there are, so a small split is taken whole (listed in full, n=None).
    """
    try:
        return task.problems(split, n, seed)
    except UserError:
        return task.problems(split, None, seed)
