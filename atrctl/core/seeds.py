"""One way to derive a generator's seed from a run's seed and where the draw happens (a step, a position, a
chunk of problems): every stream atrctl samples from is seeded by `derive_seed`, so two streams never share a
seed by accident of two formulas."""

MULTIPLIERS = (1_000_003, 1_000_033)  # primes: distinct (seed, part) pairs give distinct seeds below 2^63 in practice
SEED_MODULUS = 2**63  # torch generators take 64-bit seeds; staying below 2^63 keeps them non-negative int64


def derive_seed(seed: int, *parts: int) -> int:
    """((seed·p₁ + part₁)·p₂ + part₂) mod 2^63 for one or two parts: deterministic, cheap, and the same numbers
    every earlier release drew (held-out chunks, rollout chunks, epoch orders)."""
    if not 1 <= len(parts) <= len(MULTIPLIERS):
        raise ValueError(f"derive_seed takes 1 to {len(MULTIPLIERS)} parts, got {len(parts)}")
    value = seed
    for multiplier, part in zip(MULTIPLIERS, parts):  # noqa: B905 - fewer parts than multipliers is allowed
        value = value * multiplier + part
    return value % SEED_MODULUS
