"""Deterministic train/test assignment and seeded sampling, shared by all tasks."""

import hashlib
import random
from typing import TypeVar

from atrctl.errors import UserError

TEST_PERCENT = 10

T = TypeVar("T")


def stable_hash(key: str) -> int:
    """A 64-bit hash that, unlike hash(), is the same in every process and Python version."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def split_of(key: str) -> str:
    """'test' for about TEST_PERCENT% of keys, else 'train': a fixed function of the key, so splits never mix."""
    return "test" if stable_hash(key) % 100 < TEST_PERCENT else "train"


def take(items: list[T], n: int | None, seed: int, what: str) -> list[T]:
    """n distinct items (all if n is None) in an order fixed by the seed."""
    if n is not None and n > len(items):
        raise UserError(f"asked for {n} {what} but there are only {len(items)}; lower n")
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    return shuffled if n is None else shuffled[:n]
