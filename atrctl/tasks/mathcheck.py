"""Answer extraction and equivalence for the data set tasks: math-verify, made safe to call from any thread.

math-verify bounds its sympy work with signal.alarm, which raises outside the main thread. There we run it
without a timeout; the callers bound the text they hand in instead.
"""

import re
import threading
from functools import lru_cache

from math_verify import parse, verify

TIMEOUT_S = 5

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"
_HASHES = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


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


def last_boxed(text: str) -> str | None:
    r"""The contents of the last \boxed{...} (or \fbox{...}) with nested braces matched; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    begin = text.index("{", start) + 1
    depth = 1
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
    return None


def normalize_number(text: str) -> str:
    """ "1,234.50" -> "1234.5": one spelling per number, so parsed answers can be voted on (maj@k)."""
    text = text.replace(",", "")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def final_number(text: str) -> str | None:
    """The number after the last "####" if there is one, else the last number in the text; normalized."""
    found = _HASHES.findall(text) or _ANY_NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None
