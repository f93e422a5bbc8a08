"""Would compiling the whole model's forward/backward make the update fast enough for 3× TRL?  Not a test.

One update micro-batch of a preset (fixed shape: prompt + completion tokens, every row trained, the
token-mean policy-gradient surrogate on top), eager against `torch.compile(model, dynamic=False)` — the
most a compiled forward/backward can gain, since a real run's varying lengths would also need shape
buckets and a recompilation per bucket.  Pairs alternate which side runs first; the ratio is taken
within each pair.

    python benchmarks/compile_update.py                          # tiny, 128 rows × (9 + 64), 5 pairs
    python benchmarks/compile_update.py --preset medium --new-tokens 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atrctl.models import build_char_tokenizer, build_model, set_cpu_threads

PROMPT_TOKENS = 9  # "407+058=" and BOS: the default task's prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--rows", type=int, default=128, help="one mini-batch of the default recipe: 64 × 8 / 4")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="micro-batches timed per side and pair (median)")
    args = parser.parse_args()
    set_cpu_threads()
    torch.manual_seed(0)
    model = build_model(args.preset, build_char_tokenizer()).train()
    ids = torch.randint(3, model.config.vocab_size, (args.rows, PROMPT_TOKENS + args.new_tokens))
    mask, advantages = torch.ones_like(ids), torch.randn(args.rows, 1)

    def update(module) -> float:
        started = time.perf_counter()
        logits = module(input_ids=ids, attention_mask=mask).logits[:, PROMPT_TOKENS - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, PROMPT_TOKENS:, None])[..., 0]
        (-(torch.exp(logp - logp.detach()) * advantages).mean()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    compiled = torch.compile(model, dynamic=False)
    update(model)
    compile_seconds = update(compiled)
    eager_s, compiled_s, ratios = [], [], []
    for pair in range(args.pairs):
        order = (model, compiled) if pair % 2 == 0 else (compiled, model)
        times = {id(side): statistics.median(update(side) for _ in range(args.repeats)) for side in order}
        eager_s.append(times[id(model)])
        compiled_s.append(times[id(compiled)])
        ratios.append(eager_s[-1] / compiled_s[-1])
    print(f"{args.preset}, {args.rows} rows × ({PROMPT_TOKENS} + {args.new_tokens}) tokens, {args.pairs} pairs")
    print(f"first compiled call (compilation): {compile_seconds:.1f} s")
    for name, seconds in (("eager", eager_s), ("compiled", compiled_s)):
        ms = [value * 1e3 for value in seconds]
        print(f"{name:8} {statistics.median(ms):7.1f} ms [{min(ms):.1f}, {max(ms):.1f}]")
    print(f"speed-up {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]")


if __name__ == "__main__":
    main()
