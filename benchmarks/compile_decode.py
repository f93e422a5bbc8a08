"""Would a compiled, static-cache decode step make sampling faster than atrctl's eager sampler?  Not a test.

One rollout batch of a preset (64 prompts × G = 8, EOS never drawn so every row runs `--new-tokens`),
sampled three ways on the same weights: atrctl's sampler (`atrctl.sampling.sample`: eager, a group's
prompt prefilled once, a preallocated cache), transformers' `generate` with its dynamic cache, and
`generate` with a static cache and `torch.compile` of the forward pass (transformers' own compiled-decode
path; on CPU it must be asked for with `CompileConfig._compile_all_devices`).  The two `generate` runs do
identical work, so their ratio is what compilation gives a decode step; atrctl's ratio to the compiled one
says whether that would beat what atrctl already does.  Pairs rotate which side runs first; each ratio is
taken within its pair.

    python benchmarks/compile_decode.py                          # tiny, 64 new tokens, 5 pairs
    python benchmarks/compile_decode.py --preset medium --new-tokens 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atrctl.models import build_char_tokenizer, build_model, set_cpu_threads
from atrctl.sampling import sample

PROMPTS, GROUP = 64, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="batches timed per side and pair (median)")
    args = parser.parse_args()
    set_cpu_threads()
    from transformers import CompileConfig

    tokenizer = build_char_tokenizer()
    model = build_model(args.preset, tokenizer).eval()
    model.generation_config.eos_token_id = None  # every row decodes --new-tokens, as with a fresh model
    prompts = [tokenizer.encode(f"{i:03d}+{7 * i % 1000:03d}=") for i in range(PROMPTS)]
    repeated = torch.tensor([p for p in prompts for _ in range(GROUP)])
    compiled = CompileConfig(fullgraph=False, dynamic=False)
    compiled._compile_all_devices = True  # transformers compiles only on accelerators unless told

    def generate(**extra):
        return model.generate(
            repeated,
            attention_mask=torch.ones_like(repeated),
            do_sample=True,
            top_k=0,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            **extra,
        )

    sides = {
        "atrctl sampler": lambda: sample(
            model, prompts, max_new_tokens=args.new_tokens, eos_id=[-1], pad_id=0, repeats=GROUP
        ),
        "generate, dynamic cache": generate,
        "generate, static cache, compiled": lambda: generate(cache_implementation="static", compile_config=compiled),
    }
    names = list(sides)
    with torch.inference_mode():
        started = time.perf_counter()
        sides[names[2]]()
        compile_seconds = time.perf_counter() - started
        for run in sides.values():
            run()
        seconds = {name: [] for name in names}
        for pair in range(args.pairs):
            for name in names[pair % 3 :] + names[: pair % 3]:
                times = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    sides[name]()
                    times.append(time.perf_counter() - started)
                seconds[name].append(statistics.median(times))
    print(f"{args.preset}, {PROMPTS} prompts × {GROUP}, {args.new_tokens} new tokens, {args.pairs} pairs")
    print(f"first compiled call (compilation, or a hit in inductor's on-disk cache): {compile_seconds:.1f} s")
    for name in names:
        ms = [value * 1e3 for value in seconds[name]]
        print(f"{name:34} {statistics.median(ms):7.1f} ms [{min(ms):.1f}, {max(ms):.1f}]")
    for label, faster, slower in (
        ("compiled vs dynamic generate", names[2], names[1]),
        ("atrctl vs compiled generate", names[0], names[2]),
    ):
        ratios = [s / f for f, s in zip(seconds[faster], seconds[slower], strict=True)]
        print(f"speed-up, {label}: {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]")


if __name__ == "__main__":
    main()
