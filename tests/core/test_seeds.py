"""The one seed derivation: its formula by hand, its range, and that the streams it seeds stay apart."""

import pytest

from atrctl.core.seeds import SEED_MODULUS, derive_seed


def test_the_formula_by_hand():
    assert derive_seed(0, 5) == 5
    assert derive_seed(2, 7) == 2 * 1_000_003 + 7
    assert derive_seed(3, 4, 9) == (3 * 1_000_003 + 4) * 1_000_033 + 9
    big = SEED_MODULUS - 1
    assert derive_seed(big, 1, 2) == ((big * 1_000_003 + 1) * 1_000_033 + 2) % SEED_MODULUS


def test_seeds_are_in_range_and_distinct_for_nearby_inputs():
    seeds = {derive_seed(seed, step, position) for seed in range(4) for step in range(50) for position in range(64)}
    assert len(seeds) == 4 * 50 * 64 and all(0 <= s < SEED_MODULUS for s in seeds)
    assert derive_seed(SEED_MODULUS - 1, 2**40, 2**40) < SEED_MODULUS


def test_it_takes_one_or_two_parts():
    for parts in ((), (1, 2, 3)):
        with pytest.raises(ValueError, match="1 to 2 parts"):
            derive_seed(0, *parts)
