r"""Where a completion states its final answer, and which strings are numbers: one policy for every task.

Reasoning models (Qwen3, DeepSeek-R1) think inside <think>...</think> first: only what follows the last
</think> is read, and a completion whose thinking never closed (cut off by the token limit) states no answer,
however many numbers its chain holds.

Instruct models state answers in many ways ("The answer is 19.", "**Answer:** 19", "\boxed{19}",
"#### 19", "... = 19"), often followed by chatter that holds other numbers ("I hope this helps with
your 2 questions!"). The answer is taken by the first of these rules that applies:

1. `boxed`: the contents of the last \boxed{...} (or \fbox{...});
2. `hashes`: what follows the last "####" on its line (GSM8K's own convention);
3. `answer-is`: what follows the last "answer is", "answer:" or "final answer:" on its line;
4. `last-line`: the last non-empty line that is not a sign-off ("I hope this helps!", "Let me know
   if ..."), a fallback: a completion that states its answer plainly ends with it more often than not,
   but this rule can be fooled, which is why instruct prompts ask for rule 1 or 3.

Within what a rule found, a number task reads *the* number (`answer_number`): after the last "=" when
there is one ("242 + 17 = 259"), else the first number of a stated answer ("19 seats (out of 36)") or
the last number of a fallback line, skipping the total after "out of" ("19 empty seats out of 36").

Numbers are strict: ASCII digits, an optional minus sign and decimal part, commas only as real
thousands separators. "259abc", "259.5", "1,9", "12,34" and "٣" are not 259, 19, 1234 or 3, "1 200"
is two numbers, and "9/2" or "\\frac{9}{2}" holds none (math-verify reads those, where a task wants it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A number stands alone: no letter, digit, '.' or ',' glued to either side (a sentence's final '.' or ','
# may follow it), and it is not part of a fraction (9/2) or a power (2^3);
# commas group thousands exactly.  [0-9], not \d: other scripts' digits are not numbers here.
NUMBER = re.compile(r"(?<![\w.,/^])-?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?![\w^]|[.,][0-9]|\s*/\s*[0-9])")
THINK_START, THINK_END = "<think>", "</think>"
_HASHES = re.compile(r"####")
_ANSWER_IS = re.compile(r"\b(?:final\s+)?answer\b\s*(?:\*\*)?\s*(?:is\b|:|=)\s*(?:\*\*)?\s*:?", re.IGNORECASE)
_OUT_OF = re.compile(r"\bout\s+of\s*$", re.IGNORECASE)
_SIGN_OFF = re.compile(
    r"^\W*(?:i hope|hope this|let me know|feel free|if you have|happy to help|glad to help|good luck)", re.IGNORECASE
)
_TEXT_COMMAND = re.compile(r"\\(?:text|mathrm|textbf|mathbf)\{([^{}]*)\}")
_NOISE = re.compile(r"\\\$|\$|\\%|%|\*\*|\\[;:]|\\quad")


@dataclass(frozen=True)
class Found:
    """The text of a completion's final answer and the rule that found it (`boxed`, `hashes`, `answer-is`,
    `last-line`)."""

    text: str
    rule: str


def find_answer(completion: str) -> Found | None:
    """The final answer's text by the first rule that applies (module docstring); None for an empty completion
    or one whose reasoning never ended."""
    completion = after_reasoning(completion)
    boxed = last_boxed(completion)
    if boxed is not None:
        return Found(boxed, "boxed")
    for rule, pattern in (("hashes", _HASHES), ("answer-is", _ANSWER_IS)):
        last = None
        for last in pattern.finditer(completion):  # noqa: B007 - the last match is the one wanted
            pass
        if last is not None:
            rest = completion[last.end() :].split("\n", 1)[0].strip()
            if rest:
                return Found(rest, rule)
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    while len(lines) > 1 and _SIGN_OFF.match(lines[-1]):
        lines.pop()
    return Found(lines[-1], "last-line") if lines else None


def after_reasoning(completion: str) -> str:
    """What a completion says after its reasoning: the text after the last </think>; "" while a <think> is
    still open (the limit cut the chain short, and a number inside it is a step, not an answer)."""
    closed = completion.rfind(THINK_END)
    if closed >= 0:
        return completion[closed + len(THINK_END) :]
    return "" if THINK_START in completion else completion


def last_boxed(text: str) -> str | None:
    r"""The contents of the last \boxed{...} (or \fbox{...}), nested braces matched; None if there is none."""
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


def numbers(text: str) -> list[str]:
    """The strict numbers in text, in order, as written (see NUMBER)."""
    return NUMBER.findall(plain(text))


def leading_number(text: str) -> str | None:
    """The number a text starts with (after spaces), normalized; None if it starts otherwise ("259abc" too).
    The compact formats' reading: there the completion is the answer."""
    match = NUMBER.match(text.lstrip(" "))
    return normalize_number(match[0]) if match else None


def answer_number(found: Found | None) -> str | None:
    """The number a found answer states, normalized ("1,200.50" -> "1200.5"); None if it states none."""
    if found is None:
        return None
    text = plain(found.text)
    if found.rule == "boxed" and re.search(r"[\\{}]", text):  # LaTeX structure (\frac{9}{2}): not a plain number
        return None
    if "=" in text:  # a worked line: the result is what follows the last "="
        text = text.rpartition("=")[2]
        candidates = numbers(text)
        return normalize_number(candidates[0]) if candidates else None
    if found.rule != "last-line":
        candidates = numbers(text)
        return normalize_number(candidates[0]) if candidates else None
    kept = [m for m in NUMBER.finditer(text) if not _OUT_OF.search(text[max(0, m.start() - 16) : m.start()])]
    return normalize_number(kept[-1][0]) if kept else None


def plain(text: str) -> str:
    r"""Text with the markup around numbers removed: LaTeX thousands spacing (1{,}200, 1\,200) joined, and
    dollar signs, percent signs, bold markers and \text{...} wrappers made spaces."""
    text = text.replace("{,}", ",").replace("\\,", "").replace("\\!", "")
    return _NOISE.sub(" ", _TEXT_COMMAND.sub(r" \1 ", text))


def normalize_number(text: str) -> str:
    """ "1,234.50" -> "1234.5", "007" -> "7", "-0" -> "0": one spelling per value, so answers can be voted on."""
    whole, _, fraction = text.replace(",", "").partition(".")
    fraction = fraction.rstrip("0")
    sign = "-" if whole.startswith("-") else ""
    out = (whole.lstrip("-").lstrip("0") or "0") + ("." + fraction if fraction else "")
    return out if out == "0" else sign + out  # string work only: a million-digit "answer" costs no int()


def same_number(a: str | None, b: str | None) -> bool:
    """Exact equality of two decimal number strings: their normal spellings are equal (no float rounding can
    make a wrong answer right)."""
    return a is not None and b is not None and normalize_number(a) == normalize_number(b)
