"""Task registry: name -> factory of a Task (problems with train/test splits, and a verifiable reward)."""

import difflib
import inspect
from collections.abc import Callable

from atrctl.errors import UserError
from atrctl.tasks.arith import ArithTask
from atrctl.tasks.benchmarks import BENCHMARKS, PRESETS, Preset
from atrctl.tasks.countdown import CountdownTask
from atrctl.tasks.gsm8k import GSM8KTask
from atrctl.tasks.hendrycks_math import MathTask
from atrctl.tasks.problem import Problem, Score, Task, problem_pool

TASKS: dict[str, Callable[..., Task]] = {
    "arith": ArithTask,
    "countdown": CountdownTask,
    "gsm8k": GSM8KTask,
    "math": MathTask,
    **BENCHMARKS,
}

__all__ = ["PRESETS", "TASKS", "Preset", "Problem", "Score", "Task", "get_task", "problem_pool"]


def get_task(name: str, **params) -> Task:
    """The task called name, built with params; a misspelled name or parameter is a UserError."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, TASKS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"unknown task {name!r}{hint}; valid tasks: {', '.join(TASKS)}")
    accepted = inspect.signature(TASKS[name]).parameters
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise UserError(f"task {name!r} has no parameter {', '.join(unknown)}; valid parameters: {', '.join(accepted)}")
    return TASKS[name](**params)
