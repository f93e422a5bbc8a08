"""The compiled sampler under bf16 autocast: its KV cache stored in bf16 against float32 (as before
`sampling.compiled_cache_dtype`).

Not a test.  Under autocast every product of the compiled decoding step casts the whole cache it reads to
bf16, at every step and in every layer; stored in bf16, nothing is cast and half the bytes are read.  Each
shape samples one batch (`prompts` × G rows in groups, EOS suppressed so every row runs `--tokens` steps)
as `HFSampler.generate` does, compiled, both ways in alternating pairs in one process; the ratio is the
float32 cache's time / the bf16 cache's within each pair (> 1: bf16 is faster), median [min, max] over
pairs.  Both give the same tokens and logprobs bit for bit (tests/test_decoder_pass.py).

    python benchmarks/cache_dtype.py                           # medium at 8 and 64 new tokens
    python benchmarks/cache_dtype.py --shapes medium smollm2-135m --tokens 32
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from cpu_bf16 import alternating, draw, shape_model, summary  # benchmarks/ is on sys.path
from grad_mode import SIZES

from atrctl import decoder_pass, sampling
from atrctl.models import set_cpu_threads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["medium"], choices=list(SIZES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[8, 64], help="new tokens per row")
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    set_cpu_threads()
    chosen = sampling.compiled_cache_dtype
    store = {"float32": lambda device: None, "bf16": chosen}
    print(f"compiled bf16 sampling, {torch.get_num_threads()} threads, {args.pairs} pairs")
    print("| shape | rows | new tokens | float32 cache s | bf16 cache s | float32 / bf16 |")
    print("|---|---|---|---|---|---|")
    for shape in args.shapes:
        model = shape_model(shape).eval()
        decoder_pass.compile_policy(model)
        prompts, group, prompt_tokens = SIZES[shape]
        ids = torch.randint(4, 50, (prompts, prompt_tokens), generator=torch.Generator().manual_seed(1)).tolist()
        for tokens in args.tokens:
            setups = {name: partial(setattr, sampling, "compiled_cache_dtype", way) for name, way in store.items()}
            times = alternating(setups, partial(draw, model, ids, group, tokens, bf16=True), args.pairs)
            sampling.compiled_cache_dtype = chosen
            ratios = [wide / narrow for wide, narrow in zip(times["float32"], times["bf16"], strict=True)]
            print(
                f"| {shape} | {prompts * group} | {tokens} | {statistics.median(times['float32']):.3f} | "
                f"{statistics.median(times['bf16']):.3f} | {summary(ratios)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
