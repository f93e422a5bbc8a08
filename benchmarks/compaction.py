"""Sampling with finished rows leaving the batch (`sampling.COMPACT_AT`) against keeping them to the end.

Not a test.  The same `sample` call, with the same generator seed, runs with `compact` on and off in
alternating pairs in one process; both sides draw the same tokens (tested), so the ratio is kept's time /
compacted's within each pair (> 1: compaction is faster), median [min, max] over pairs.  Rows:

- the real model, SmolLM2-135M-Instruct (`--model DIR`, made by `atrctl import-gguf`; see
  recipes/smollm2-arith-cpu.toml), answering the recipe's two-digit additions through its chat template,
  8 prompts × G = 8 at temperature 0.7, where replies end anywhere from 5 tokens to the cap;
- the tiny preset, fresh, as `vs_trl.py` runs it: its replies end at random (EOS is one of 57 tokens);
- the tiny preset with EOS never drawn (its logit at -1e4): nothing leaves the batch, so the ratio is the
  bookkeeping's cost;
- the tiny preset with its EOS logit raised so rows end one by one: the most compactions per token, on the
  model whose decode step is cheapest next to the KV-cache copy a compaction makes.

    python benchmarks/compaction.py --model models/smollm2            # every row, 5 pairs
    python benchmarks/compaction.py --new-tokens 64                   # the tiny rows only
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from fresh_models import real_model, real_model_prompts  # benchmarks/ is on sys.path as a script

from atrctl.models import build_char_tokenizer, build_model, set_cpu_threads
from atrctl.sampling import sample, stop_tokens


def timed(model, prompts, *, compact: bool, **kwargs):
    started = time.perf_counter()
    rollout = sample(model, prompts, generator=torch.Generator().manual_seed(0), compact=compact, **kwargs)
    return time.perf_counter() - started, rollout


def compare(label: str, model, prompts, pairs: int, **kwargs) -> None:
    times = {True: [], False: []}
    for pair in range(pairs + 1):  # pair 0 is unmeasured
        for compact in (True, False) if pair % 2 else (False, True):
            seconds, rollout = timed(model, prompts, compact=compact, **kwargs)
            if pair:
                times[compact].append(seconds)
    lengths = rollout.completion_mask.sum(1)
    filled = lengths.sum().item() / (len(lengths) * rollout.completion_ids.shape[1])
    ratios = [kept / compacted for kept, compacted in zip(times[False], times[True], strict=True)]
    print(
        f"| {label} | {len(lengths)} | {kwargs['max_new_tokens']} | {lengths.min().item()}-{lengths.max().item()} "
        f"| {filled:.0%} | {statistics.median(times[False]):.2f} | {statistics.median(times[True]):.2f} "
        f"| {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] |",
        flush=True,
    )


class EosBias(torch.nn.Module):
    """Adds `bias` to the EOS logit of the wrapped head, so a random model ends its replies early."""

    def __init__(self, head: torch.nn.Module, eos: int, bias: float):
        super().__init__()
        self.head, self.shift = head, torch.zeros(head.out_features)
        self.shift[eos] = bias

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.head(states) + self.shift


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="SmolLM2-135M-Instruct's directory (atrctl import-gguf); omitted: tiny only")
    parser.add_argument("--real-new-tokens", nargs="+", type=int, default=[48, 256])
    parser.add_argument("--new-tokens", type=int, default=64, help="the tiny rows' max_new_tokens")
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    threads = set_cpu_threads()
    print(f"{threads} threads, {args.pairs} alternating pairs (after one unmeasured), the same tokens on both sides")
    print("| model | rows | max new | reply lengths | row-steps filled | kept s | compacted s | kept / compacted |")
    print("|---|---|---|---|---|---|---|---|")
    if args.model:
        model, tokenizer = real_model(args.model)
        for tokens in args.real_new_tokens:
            compare("SmolLM2-135M-Instruct", model, real_model_prompts(tokenizer), args.pairs, repeats=8,
                    max_new_tokens=tokens, temperature=0.7, eos_id=stop_tokens(model, tokenizer),
                    pad_id=tokenizer.pad_token_id)  # fmt: skip
    tokenizer = build_char_tokenizer()
    model = build_model("tiny", tokenizer, seed=0).eval()
    rng = random.Random(0)
    prompts = [tokenizer(f"{rng.randint(100, 999)}+{rng.randint(100, 999)}=")["input_ids"] for _ in range(64)]
    common = {"repeats": 8, "max_new_tokens": args.new_tokens, "eos_id": tokenizer.eos_token_id, "pad_id": 0}
    compare("tiny, fresh", model, prompts, args.pairs, **common)
    head = model.lm_head
    for label, bias in (("tiny, EOS never drawn", -1e4), ("tiny, EOS logit +2", 2.0)):
        model.lm_head = EosBias(head, tokenizer.eos_token_id, bias)
        compare(label, model, prompts, args.pairs, **common)


if __name__ == "__main__":
    main()
