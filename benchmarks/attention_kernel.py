"""Attention written out (two products and a softmax) against torch's SDPA, in the update's decoder pass.
Not a test.

`decoder_pass._attend` writes attention out where a head has at most `MATH_ATTENTION_MAX` query-key
pairs and calls SDPA above.  This measures both sides of that switch: first the attention alone (forward +
backward of `_attend` at each recipe's shapes), then the whole update pass (`update_states`, forward +
backward of one default-recipe micro-batch), each side compiled as `model.compile` runs it, and eagerly.
Pairs alternate which side runs first; the ratio (written-out time / SDPA time) is taken within each pair.

    python benchmarks/attention_kernel.py                       # attention shapes, then tiny and medium passes
    python benchmarks/attention_kernel.py --models medium --new-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from update_pass import build, micro_batch  # benchmarks/ is on sys.path when run as a script

from atrctl import decoder_pass
from atrctl.models import set_cpu_threads

# (rows, heads, queries, keys, head_dim): the completions' attention of tiny and medium at 8 and 64 new
# tokens (keys = 9 prompt + queries), the prompts' own, and a SmolLM2-135M-like long micro-batch
ATTENTION_SHAPES = [(128, 4, 7, 16, 16), (128, 4, 7, 16, 64), (16, 4, 9, 9, 64), (128, 4, 31, 40, 16),
                    (128, 4, 63, 72, 16), (8, 9, 255, 300, 64)]  # fmt: skip


def timed(function, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - started) / repeats


def pairs(sides: dict, count: int, repeats: int) -> dict[str, list[float]]:
    for side in sides.values():  # unmeasured: the compilation, the allocator's warm-up
        timed(side, 2)
    times = {name: [] for name in sides}
    for pair in range(count):
        for name in list(sides) if pair % 2 == 0 else list(sides)[::-1]:
            times[name].append(timed(sides[name], repeats))
    return times


def with_math_max(limit: int, function):
    """`function` run with `_attend`'s switch at `limit` (0: SDPA always)."""

    def run():
        saved, decoder_pass.MATH_ATTENTION_MAX = decoder_pass.MATH_ATTENTION_MAX, limit
        try:
            function()
        finally:
            decoder_pass.MATH_ATTENTION_MAX = saved

    return run


def attention_sides(shape: tuple[int, ...], compiled: bool) -> dict:
    rows, heads, queries, keys, dim = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, heads, n, dim, generator=g, requires_grad=True) for n in (queries, keys, keys))
    mask = torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries).expand(rows, 1, queries, keys)
    grad = torch.randn(rows, queries, heads * dim, generator=g)
    attention = SimpleNamespace(scaling=dim**-0.5)
    attend = decoder_pass.compile_dynamic(decoder_pass._attend) if compiled else decoder_pass._attend

    def step():
        attend(attention, q, k, v, mask).backward(grad)

    return {"written out": with_math_max(10**9, step), "SDPA": with_math_max(0, step)}


def pass_sides(name: str, args: argparse.Namespace, compiled: bool) -> dict:
    model = build(name)
    if compiled:
        decoder_pass.compile_policy(model)
    rollout = micro_batch(model.config.vocab_size, args.rows, args.group, args.prompt, args.new_tokens)
    weights = torch.randn(args.rows, args.new_tokens, model.config.hidden_size) * rollout.completion_mask[..., None]

    def step():
        (decoder_pass.update_states(model, rollout) * weights).sum().backward()

    return {"written out": with_math_max(10**9, step), "SDPA": with_math_max(0, step)}


def report(label: str, times: dict[str, list[float]]) -> None:
    ratios = [a / b for a, b in zip(times["written out"], times["SDPA"], strict=True)]
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    print(f"  {label:44} written out {ms['written out']:8.2f} ms  SDPA {ms['SDPA']:8.2f} ms  "
          f"ratio {statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["tiny", "medium"], help="presets whose update pass to time")
    parser.add_argument("--rows", type=int, default=128, help="the default recipe's mini-batch: 64 × 8 / 4")
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=9, help='"407+058=" and BOS: the default task\'s prompt')
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3, help="passes timed per side and pair (their mean)")
    parser.add_argument("--no-shapes", action="store_true", help="skip the attention-alone shapes")
    args = parser.parse_args()
    set_cpu_threads()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32; forward + backward, "
          f"median [min, max] over {args.pairs} alternating pairs; ratio = written out / SDPA")  # fmt: skip
    for compiled in (True, False):
        mode = "compiled" if compiled else "eager"
        if not args.no_shapes:
            print(f"attention alone, {mode} (rows, heads, queries, keys, head_dim):")
            for shape in ATTENTION_SHAPES:
                report(str(shape), pairs(attention_sides(shape, compiled), args.pairs, args.repeats))
        print(f"update pass, {mode}: {args.rows} rows in groups of {args.group}, {args.prompt} prompt + "
              f"1..{args.new_tokens} new tokens")  # fmt: skip
        for name in args.models:
            report(name, pairs(pass_sides(name, args, compiled), args.pairs, args.repeats))


if __name__ == "__main__":
    main()
