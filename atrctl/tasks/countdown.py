"""Countdown: combine the given numbers with + - * / to reach the target, "3,5,7>22:" -> "3*5+7".

Each problem is made by drawing numbers and a random expression tree over all of them, so it has at
least one solution (kept as `solution`). Every step of that tree stays a positive integer, as in the game;
the verifier is more lenient and accepts any expression with exact rational steps that uses each given
number at most once. The prompt lists the numbers sorted, so one multiset and target is one problem, and
its split is a stable hash of the prompt. The compact format's completion is the expression; the instruct
format asks in words and reads the expression from the stated answer (`atrctl.tasks.answer`), written
with ASCII or typeset operators (× ÷ −).
"""

import random
import re
from collections import Counter
from dataclasses import dataclass

from atrctl.errors import UserError
from atrctl.tasks.answer import find_answer, plain
from atrctl.tasks.expr import ExprError, evaluate
from atrctl.tasks.problem import Problem, Score, check_format, check_request, require_int
from atrctl.tasks.split import split_of

EXHAUSTED_AFTER = 20_000
"""Draws in a row that find no new problem of the split: the split is then taken as exhausted (what random
draws would still find is too rare to wait for), so a request for more than exist fails in seconds and a
request for all of it (n = None, a trainer's pool) returns what was found."""
_LEAF = 3  # precedence of a bare number; '+'/'-' are 1, '*'/'/' are 2

Node = tuple[str, int, int]  # (text, value, precedence)
INSTRUCTION = 'End your reply with "Answer: " followed by the expression.'
_TYPESET = str.maketrans({"×": "*", "·": "*", "÷": "/", "−": "-", "–": "-", "[": "(", "]": ")"})
_LATEX_OPS = re.compile(r"\\(times|cdot|div|left|right)\b")
_EXPRESSION = re.compile(r"[0-9+\-*/() ]+")  # a run of expression characters (one pass: no backtracking)


@dataclass(frozen=True)
class CountdownTask:
    """count: numbers per problem (2-6); max_number: numbers are drawn from 1..max_number;
    max_target: targets lie in 1..max_target; format: compact or instruct."""

    count: int = 3
    max_number: int = 20
    max_target: int = 100
    format: str = "compact"
    name = "countdown"

    def __post_init__(self):
        require_int("countdown", "count", self.count, 2, 6)
        require_int("countdown", "max_number", self.max_number, 1, 1000)
        require_int("countdown", "max_target", self.max_target, 1, 1_000_000)
        check_format("countdown", self.format)

    @property
    def instruction(self) -> str:
        return INSTRUCTION if self.format == "instruct" else ""

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]:
        check_request(split, n)
        rng = random.Random(seed)
        found: dict[str, Problem] = {}
        misses = 0
        while len(found) != n and misses < EXHAUSTED_AFTER:
            misses += 1
            numbers = [rng.randint(1, self.max_number) for _ in range(self.count)]
            node = _random_tree(numbers, rng)
            if node is None or node[1] > self.max_target or node[1] in numbers:
                continue
            prompt = f"{','.join(map(str, sorted(numbers)))}>{node[1]}:"
            if prompt not in found and split_of(prompt) == split:
                found[prompt] = self._problem(prompt, sorted(numbers), node)
                misses = 0
        if n is not None and len(found) < n:
            raise UserError(
                f"found only {len(found)} distinct countdown {split} problems with count={self.count}, "
                f"max_number={self.max_number}, max_target={self.max_target}; lower n or raise the limits"
            )
        return list(found.values())

    def score(self, problem: Problem, completion: str) -> Score:
        # the compact prompt is the problem's key; an instruct prompt is words, its id carries the key
        numbers, target = parse_prompt(problem.prompt if self.format == "compact" else problem.id.split("-", 1)[1])
        if self.format == "compact":  # the first line is the expression, whole (its value may follow an "=")
            text = completion.partition("\n")[0].partition("=")[0]
        else:
            text = stated_expression(completion)
        try:
            value, used = evaluate(text)
        except ExprError:
            return Score(0.0, None)
        if Counter(used) - Counter(numbers):
            return Score(0.0, None)
        return Score(float(value == target), str(value), form="".join(text.split()))

    def _problem(self, key: str, numbers: list[int], node: Node) -> Problem:
        target, id = node[1], f"countdown-{key[:-1]}"
        if self.format == "compact":
            return Problem(id=id, prompt=key, answer=str(target), solution=node[0])
        listed = ", ".join(map(str, numbers[:-1])) + f" and {numbers[-1]}"
        prompt = (f"Using the numbers {listed}, each at most once, with + - * / and parentheses, "
                  f"write an expression that equals {target}.")  # fmt: skip
        return Problem(id=id, prompt=prompt, answer=str(target), solution=f"{node[0]} = {target}\nAnswer: {node[0]}")


def parse_prompt(prompt: str) -> tuple[list[int], int]:
    """The numbers and target of a compact prompt (or problem id), "3,5,7>22:" -> ([3, 5, 7], 22)."""
    numbers, target = prompt.rstrip(":").split(">")
    return [int(x) for x in numbers.split(",")], int(target)


def stated_expression(completion: str) -> str:
    """The expression a reply gives as its answer: the stated answer (`find_answer`), typeset operators made
    ASCII, and of "3 * 5 + 7 = 22" the side with operators; "" if there is none."""
    found = find_answer(completion)
    return "" if found is None else expression_in(found.text)


def expression_in(text: str) -> str:
    """The arithmetic expression in a line: "So 3 × 5 + 7 = 22." -> "3 * 5 + 7" (the last run of expression
    characters on the last side of an "=" that has an operator); "" if there is none."""
    ops = {"times": "*", "cdot": "*", "div": "/", "left": "", "right": ""}
    text = _LATEX_OPS.sub(lambda m: ops[m[1]], plain(text)).translate(_TYPESET)
    sides = [side for side in text.split("=") if re.search(r"[0-9)]\s*[-+*/]", side)]
    runs = [run for run in _EXPRESSION.findall(sides[-1] if sides else text) if re.search("[0-9]", run)]
    return runs[-1].strip() if runs else ""


def _random_tree(numbers: list[int], rng: random.Random) -> Node | None:
    """A random expression over all numbers in order; None if a step leaves the positive integers."""
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0], _LEAF
    k = rng.randint(1, len(numbers) - 1)
    left, right = _random_tree(numbers[:k], rng), _random_tree(numbers[k:], rng)
    if left is None or right is None:
        return None
    return _combine(left, rng.choice("+-*/"), right)


def _combine(left: Node, op: str, right: Node) -> Node | None:
    """Apply op, with only the parentheses the precedence rules need."""
    (ltext, lval, lprec), (rtext, rval, rprec) = left, right
    if op == "/":
        if lval % rval:
            return None
        value = lval // rval
    else:
        value = {"+": lval + rval, "-": lval - rval, "*": lval * rval}[op]
    if value <= 0:
        return None
    prec = 1 if op in "+-" else 2
    if lprec < prec:
        ltext = f"({ltext})"
    if rprec < prec or (rprec == prec and op in "-/"):
        rtext = f"({rtext})"
    return f"{ltext}{op}{rtext}", value, prec
