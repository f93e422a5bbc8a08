"""Answer extraction and equivalence for the data set tasks: math-verify, made safe to call from any thread.

math-verify bounds its sympy work with signal.alarm, which raises outside the main thread. There we run it
without a timeout; the callers bound the text they hand in instead.
"""

import threading
from functools import lru_cache

from math_verify import parse, verify

TIMEOUT_S = 5


def _timeout() -> int | None:
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def extract(text: str) -> list:
    """math-verify's reading of text: [sympy value, answer string], or [] if nothing parses."""
    return parse(text, parsing_timeout=_timeout())


@lru_cache(maxsize=16384)
def _gold(answer: str) -> tuple:
    return tuple(extract(f"\\boxed{{{answer}}}"))


def matches(answer: str, prediction: list) -> bool:
    """Whether the extracted prediction equals the reference answer (a LaTeX or number string)."""
    gold = _gold(answer)
    if not gold:  # math-verify cannot read the reference: fall back to the exact string
        return bool(prediction) and prediction[-1] == answer.strip()
    return bool(prediction) and verify(list(gold), prediction, timeout_seconds=_timeout())
