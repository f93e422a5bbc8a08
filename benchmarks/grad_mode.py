"""The sampler under bf16 autocast: weights cast once a rollout (no_grad) against once a decoding step
(inference_mode, as every rollout ran before `sampling._without_grad`; it now takes no_grad where that won:
eager sampling under autocast).

Not a test.  Autocast keeps its low-precision copy of each weight for as long as its block lasts, except
under inference_mode.  Each shape samples one batch (`prompts` × G rows in groups, EOS suppressed so every
row runs `--tokens` steps) as `HFSampler.generate` does (eval mode, bf16 autocast), both ways in alternating
pairs in one process; the ratio is the old way's time / the new one's within each pair (> 1: the new way is
faster), median [min, max] over pairs.  Both ways give the same tokens and logprobs (tests/test_sampling.py).

    python benchmarks/grad_mode.py                               # medium, smollm2-135m, qwen2.5-0.5b
    python benchmarks/grad_mode.py --shapes smollm2-135m --pairs 7 --tokens 64
    python benchmarks/grad_mode.py --shapes medium --compile     # the compiled sampler casts inside its graph
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from cpu_bf16 import alternating, draw, shape_model  # benchmarks/ is on sys.path
from shapes import SIZES as BATCHES

from atrctl import decoder_pass, sampling
from atrctl.models import set_cpu_threads

SIZES = {name: BATCHES[name][:3] for name in ("medium", "smollm2-135m", "qwen2.5-0.5b")}  # prompts, G, prompt tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per row")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="model.compile's sampler (prefill, decoding step)")
    args = parser.parse_args()
    set_cpu_threads()
    kept = sampling._without_grad
    ways = {"old": lambda device, compiled: torch.inference_mode(), "new": lambda device, compiled: torch.no_grad()}
    how = "compiled" if args.compile else "eager"
    print(f"bf16 sampling ({how}), {args.tokens} new tokens, {torch.get_num_threads()} threads, {args.pairs} pairs")
    print("| shape | rows | old s | new s | old / new |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        model = shape_model(shape).eval()
        if args.compile:
            decoder_pass.compile_policy(model)
        prompts, group, prompt_tokens = SIZES[shape]
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(4, 50, (prompts, prompt_tokens), generator=g).tolist()
        setups = {name: partial(setattr, sampling, "_without_grad", way) for name, way in ways.items()}
        times = alternating(setups, partial(draw, model, ids, group, args.tokens, bf16=True), args.pairs)
        sampling._without_grad = kept
        ratios = [o / n for o, n in zip(times["old"], times["new"], strict=True)]
        print(
            f"| {shape} | {prompts * group} | {statistics.median(times['old']):.3f} | "
            f"{statistics.median(times['new']):.3f} | {statistics.median(ratios):.2f}× "
            f"[{min(ratios):.2f}, {max(ratios):.2f}] |"
        )


if __name__ == "__main__":
    main()
