"""Update time against the share of groups with one reward (advantage 0), with and without skipping their rows.

Not a test.  A random model of SmolLM2-135M's shape (49k vocabulary), one fixed batch of `prompts` × G
rows, every completion `tokens` long; the first `zero` groups get advantage 0, the rest a spread one.  The
update's forward + backward runs over the rows `train.trained_rows` keeps (all of them with skipping off),
in the micro-batches `train.cut_micro_batches` makes of them (algo.micro_batch = 0), as the update runs
them; AdamW's step, the same either way, is left out.  Skipping on and off alternate in pairs; reported:
median seconds of each and their ratio (off / on), median [min, max] over pairs.

    python benchmarks/skip_rows.py
    python benchmarks/skip_rows.py --shape qwen2.5-0.5b --pairs 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cpu_bf16 import draw, shape_model  # benchmarks/ is on sys.path

from atrctl.batching import rows, trimmed
from atrctl.config import AlgoConfig
from atrctl.forward import completion_logprobs_and_entropy
from atrctl.models import set_cpu_threads
from atrctl.train import cut_micro_batches, trained_rows


def update_seconds(model, rollout, advantages, skip: bool) -> float:
    algo = AlgoConfig(skip_zero_advantage=skip)
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    trained = trained_rows(algo, advantages, slice(0, len(advantages)))
    for where in cut_micro_batches(model, rollout, trained, algo):
        sub = trimmed(rows(rollout, where))
        logp, _ = completion_logprobs_and_entropy(model, sub, 1.0, entropy_grad=False)
        (logp * advantages[where, None]).sum().div(rollout.completion_mask.sum()).backward()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    threads = set_cpu_threads()
    model = shape_model(args.shape).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (args.prompts, args.prompt_tokens), generator=g).tolist()
    rollout = draw(model, ids, args.group, args.tokens, bf16=False)
    spread = torch.randn(args.prompts, args.group, generator=g)
    update_seconds(model, rollout, spread.flatten(), skip=False)  # unmeasured
    print(
        f"{args.shape}, {args.prompts} prompts x G={args.group}, {args.prompt_tokens}+{args.tokens} tokens, "
        f"{threads} threads, {args.pairs} alternating pairs"
    )
    print("| groups with one reward | skipping off, s | skipping on, s | off / on |")
    print("|---|---|---|---|")
    for zero in range(args.prompts + 1):
        advantages = spread.clone()
        advantages[:zero] = 0.0
        advantages = advantages.flatten()
        times = {True: [], False: []}
        for pair in range(args.pairs):
            for skip in (True, False) if pair % 2 else (False, True):
                times[skip].append(update_seconds(model, rollout, advantages, skip))
        ratios = [off / on for off, on in zip(times[False], times[True], strict=True)]
        print(
            f"| {zero}/{args.prompts} ({zero / args.prompts:.0%}) | {statistics.median(times[False]):.2f} | "
            f"{statistics.median(times[True]):.2f} | {statistics.median(ratios):.2f}x "
            f"[{min(ratios):.2f}, {max(ratios):.2f}] |",
            flush=True,
        )


if __name__ == "__main__":
    main()
