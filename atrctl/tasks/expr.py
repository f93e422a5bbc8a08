"""Exact, bounded evaluation of an arithmetic answer: integers, + - * /, parentheses and nothing else.

Model output is never handed to eval/exec/compile: an own tokenizer and recursive-descent parser read it,
after the length is checked, so hostile text costs at most MAX_CHARS steps and runs nothing. Values are
Fractions, so "(7-3)/2" is exactly 2 and no float rounding can make a wrong answer right.
"""

import re
from fractions import Fraction

MAX_CHARS = 64
MAX_DEPTH = 8

_TOKEN = re.compile(r" *(?:([0-9]+)|([-+*/()]))")  # ASCII digits only, as the prompts use


class ExprError(ValueError):
    """The text is not a valid expression (or breaks a limit)."""


def evaluate(text: str) -> tuple[Fraction, list[int]]:
    """The value of the expression and the integer literals it uses, in order of appearance."""
    text = text.strip(" ")
    if len(text) > MAX_CHARS:
        raise ExprError(f"longer than {MAX_CHARS} characters")
    parser = _Parser(_tokenize(text))
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ExprError(f"unexpected {parser.peek()!r} after the expression")
    return value, parser.numbers


def _tokenize(text: str) -> list[int | str]:
    tokens: list[int | str] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ExprError(f"unexpected character {text[pos]!r}")
        tokens.append(int(match[1]) if match[1] else match[2])
        pos = match.end()
    return tokens


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ; factor := INT | '(' expr ')'"""

    def __init__(self, tokens: list[int | str]):
        self.tokens = tokens
        self.pos = 0
        self.numbers: list[int] = []

    def peek(self) -> int | str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def advance(self) -> int | str | None:
        token = self.peek()
        self.pos += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.advance()
            rhs = self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.advance()
            rhs = self.factor(depth)
            if op == "/" and rhs == 0:
                raise ExprError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor(self, depth: int) -> Fraction:
        token = self.advance()
        if isinstance(token, int):
            self.numbers.append(token)
            return Fraction(token)
        if token != "(":
            raise ExprError(f"expected a number or '(', got {token!r}")
        if depth >= MAX_DEPTH:
            raise ExprError(f"parentheses nested deeper than {MAX_DEPTH}")
        value = self.expr(depth + 1)
        if self.advance() != ")":
            raise ExprError("missing ')'")
        return value
