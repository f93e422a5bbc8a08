"""Answer extraction and equivalence for the data set tasks: math-verify, made safe to call from any thread.

math-verify bounds its sympy work with signal.alarm, which raises outside the main thread. There we run it
without a timeout; the callers bound the text they hand in instead.
"""

import threading
from functools import lru_cache

from math_verify import parse, verify

from atrctl.tasks.answer import answer_number, find_answer, plain
from atrctl.tasks.problem import Score

TIMEOUT_S = 5
MAX_NUMBER_CHARS = 200  # bounds the sympy work on a stated answer that is not a plain number
MAX_LATEX_CHARS = 1000  # and on a LaTeX answer: off the main thread it has no timeout


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


def score_number(answer: str, completion: str) -> Score:
    """A number answer (GSM8K, AIME): the stated number read strictly (`answer.answer_number`), else a stated
    fraction or LaTeX value ("9/2", "\\frac{9}{2}", "70^\\circ") read by math-verify; a bare last line counts
    only as a plain number."""
    found = find_answer(completion)
    parsed = answer_number(found)
    if parsed is not None:
        return Score(float(matches(answer, extract(f"\\boxed{{{parsed}}}"))), parsed)
    if found is not None and found.rule != "last-line" and len(found.text) <= MAX_NUMBER_CHARS:
        prediction = extract(f"\\boxed{{{plain(found.text)}}}")
        if prediction:
            return Score(float(matches(answer, prediction)), str(prediction[-1]))
    return Score(0.0, None)


def score_latex(answer: str, completion: str) -> Score:
    """A LaTeX answer (MATH): the stated answer compared with math-verify, so 0.5 matches \\frac{1}{2}."""
    found = find_answer(completion)
    if found is None:
        return Score(0.0, None)
    text = f"\\boxed{{{found.text}}}" if found.rule == "boxed" else found.text
    if len(text) > MAX_LATEX_CHARS:
        return Score(0.0, None)
    prediction = extract(text)
    if not prediction:
        return Score(0.0, None)
    return Score(float(matches(answer, prediction)), prediction[-1])
