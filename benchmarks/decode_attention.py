"""Sampling with atrctl's one-query CPU decode attention against sdpa's, on the default recipe's batch.

Not a test.  The same `sample` call (64 prompts × G = 8 rows of a fresh preset, every completion
`--new-tokens` long) runs with `sampling.decode_attention` on and off in alternating pairs, in one process;
the ratio is sdpa's time / ours within each pair (> 1: ours is faster), median [min, max] over pairs.

    python benchmarks/decode_attention.py                   # tiny and medium, 8 and 64 new tokens
    python benchmarks/decode_attention.py --presets tiny --new-tokens 64 --pairs 9
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time

import torch

from atrctl import sampling
from atrctl.models import build_char_tokenizer, build_model, set_cpu_threads

OURS = sampling.decode_attention


def timed(model, prompts, tokens: int, ours: bool) -> float:
    sampling.decode_attention = OURS if ours else (lambda model: contextlib.nullcontext())
    started = time.perf_counter()
    sampling.sample(
        model,
        prompts,
        repeats=8,
        max_new_tokens=tokens,
        eos_id=[model.config.vocab_size],  # an id no row can draw: every row is `tokens` long
        pad_id=0,
        generator=torch.Generator().manual_seed(0),
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "medium"])
    parser.add_argument("--new-tokens", nargs="+", type=int, default=[8, 64])
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    threads = set_cpu_threads()
    tokenizer = build_char_tokenizer()
    rng = random.Random(0)
    prompts = [tokenizer(f"{rng.randint(100, 999)}+{rng.randint(100, 999)}=")["input_ids"] for _ in range(64)]
    print(f"64 prompts x G=8, {threads} threads, {args.pairs} alternating pairs (after one unmeasured)")
    print("| preset | new tokens | sdpa s | ours s | sdpa / ours |")
    print("|---|---|---|---|---|")
    for preset in args.presets:
        model = build_model(preset, tokenizer, seed=0).eval()
        for tokens in args.new_tokens:
            times = {True: [], False: []}
            for pair in range(args.pairs + 1):
                for ours in (True, False) if pair % 2 else (False, True):
                    seconds = timed(model, prompts, tokens, ours)
                    if pair:
                        times[ours].append(seconds)
            ratios = [a / b for a, b in zip(times[False], times[True], strict=True)]
            print(
                f"| {preset} | {tokens} | {statistics.median(times[False]):.3f} | {statistics.median(times[True]):.3f} "
                f"| {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] |",
                flush=True,
            )


if __name__ == "__main__":
    main()
