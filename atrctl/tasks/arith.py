"""Integer arithmetic, "407+058=" -> "465": the smallest verifiable task, learnable by a tiny char model.

In the compact format operands are zero-padded to `digits` so every prompt of a task has the same shape,
and the completion's first line is the answer; the instruct format asks "What is 407 + 58?" and reads
the answer stated anywhere in the reply (`atrctl.tasks.answer`). A problem is in the
test split by a stable hash of its operands (with a+b and b+a sharing one key, so commuting a test problem
does not leak it into training). Problems within one call are distinct; asking for more than a split holds
is a UserError, not silent repetition.
"""

import random
from dataclasses import dataclass
from itertools import product

from atrctl.errors import UserError
from atrctl.tasks.answer import answer_number, find_answer, leading_number, same_number
from atrctl.tasks.problem import Problem, Score, check_format, check_request, require_int
from atrctl.tasks.split import split_of, take

OPS = "+-*"
ENUMERATE_LIMIT = 30_000  # spaces up to this size are listed in full (digits <= 2); larger ones are sampled
MAX_ANSWER_DIGITS = 40
INSTRUCTION = 'End your reply with "Answer: " followed by the number.'
_SYMBOLS = {"+": "+", "-": "-", "*": "×"}


@dataclass(frozen=True)
class ArithTask:
    """digits: operand width (1-9); ops: which of "+-*" to draw from, e.g. "+-"; format: compact or instruct."""

    digits: int = 3
    ops: str = "+"
    format: str = "compact"
    name = "arith"

    def __post_init__(self):
        require_int("arith", "digits", self.digits, 1, 9)
        if (
            not isinstance(self.ops, str)
            or not self.ops
            or set(self.ops) - set(OPS)
            or len(set(self.ops)) < len(self.ops)
        ):
            raise UserError(f"arith parameter ops={self.ops!r} is invalid; use distinct characters from {OPS!r}")
        check_format("arith", self.format)

    @property
    def instruction(self) -> str:
        return INSTRUCTION if self.format == "instruct" else ""

    def problems(self, split: str, n: int | None, seed: int) -> list[Problem]:
        check_request(split, n)
        size = 10**self.digits
        total = len(self.ops) * size * size
        what = f"arith {split} problems with digits={self.digits} ops={self.ops!r}"
        if total <= ENUMERATE_LIMIT:
            pool = [t for t in product(self.ops, range(size), range(size)) if split_of(_key(*t)) == split]
            return [self._problem(*t) for t in take(pool, n, seed, what)]
        if n is None:
            raise UserError(f"{what} are too many to list ({total} in all); pass n")
        if n > total // 20:
            raise UserError(f"asked for {n} {what}; sampling distinct ones is capped at {total // 20}, lower n")
        rng = random.Random(seed)
        picked: dict[tuple[str, int, int], None] = {}
        while len(picked) < n:
            t = (rng.choice(self.ops), rng.randrange(size), rng.randrange(size))
            if split_of(_key(*t)) == split:
                picked[t] = None
        return [self._problem(*t) for t in picked]

    def score(self, problem: Problem, completion: str) -> Score:
        if self.format == "compact":  # the completion is the answer
            parsed = leading_number(completion)
        else:
            parsed = answer_number(find_answer(completion))
        if parsed is not None and len(parsed.lstrip("-")) > MAX_ANSWER_DIGITS:
            parsed = None
        return Score(float(same_number(parsed, problem.answer)), parsed)

    def _problem(self, op: str, a: int, b: int) -> Problem:
        d = self.digits
        expr = f"{a:0{d}d}{op}{b:0{d}d}"
        answer = str({"+": a + b, "-": a - b, "*": a * b}[op])
        if self.format == "compact":
            return Problem(id=f"arith-{d}d-{expr}", prompt=f"{expr}=", answer=answer, solution=answer)
        worked = f"{a} {_SYMBOLS[op]} {b} = {answer}"
        return Problem(id=f"arith-{d}d-{expr}", prompt=f"What is {a} {_SYMBOLS[op]} {b}?", answer=answer,
                       solution=f"{worked}\nAnswer: {answer}")  # fmt: skip


def _key(op: str, a: int, b: int) -> str:
    """The split key: operand order is ignored for the commutative ops."""
    if op in "+*":
        a, b = min(a, b), max(a, b)
    return f"{a}{op}{b}"
