"""The update's forward/backward over micro-batches cut longest completion first against cut in row order.

Not a test.  One rollout is sampled, then its rows go through the update's pass (`train.cut_micro_batches`
as the update cuts them; `forward.completion_logprobs_and_entropy` on each micro-batch, trimmed as the
update trims it; the backward of a policy-gradient surrogate) with the rows cut in length order (atrctl's)
and in row order (as before), in alternating pairs; the ratio is row order's time / length order's within
each pair (> 1: length order is faster), median [min, max].  "padded" is the tokens the passes run on
(rows × width, summed over micro-batches) per completion token.  Rows:

- the real model, SmolLM2-135M-Instruct (`--model DIR`, made by `atrctl import-gguf`; see
  recipes/smollm2-arith-cpu.toml): 4 of the recipe's questions × G = 8 at temperature 0.7 and up to
  256 new tokens, its micro-batches sized by the activation budget (algo.micro_batch = 0);
- the tiny preset, fresh (its replies end at random), a mini-batch of 128 rows × up to 64 new tokens, as
  one micro-batch (the budget's choice: nothing changes) and as micro-batches of 32 rows.

    python benchmarks/length_order.py --model models/smollm2
    python benchmarks/length_order.py                   # the tiny rows only
    python benchmarks/length_order.py --sweep 128 256 512 1024 2048   # train.PASS_TOKENS's value, swept
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from fresh_models import real_model, real_model_prompts  # benchmarks/ is on sys.path when run as a script

from atrctl import train
from atrctl.batching import micro_batches, rows, trimmed
from atrctl.config import AlgoConfig
from atrctl.forward import completion_logprobs_and_entropy
from atrctl.models import build_char_tokenizer, build_model, set_cpu_threads
from atrctl.sampling import sample, stop_tokens


def in_row_order(model, rollout, trained, algo):
    """The cut as it was: consecutive rows, sized at the longest row of all."""
    size = algo.micro_batch
    if not size:
        longest = trimmed(rows(rollout, trained))
        size = train.sized_micro_batch(model, longest.prompt_ids.shape[1] + longest.completion_ids.shape[1])
    return micro_batches(trained, size)


def passes(model, rollout, pieces, temperature: float) -> float:
    advantages = torch.linspace(-1, 1, rollout.completion_ids.shape[0])[:, None]
    started = time.perf_counter()
    for where in pieces:
        sub = trimmed(rows(rollout, where))
        logp, _ = completion_logprobs_and_entropy(model, sub, temperature, entropy_grad=False)
        (-(torch.exp(logp - logp.detach()) * advantages[where] * sub.completion_mask).sum()).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def padded(rollout, pieces) -> float:
    computed = 0
    for where in pieces:
        sub = trimmed(rows(rollout, where))
        computed += len(where) * sub.completion_ids.shape[1]
    return computed / rollout.completion_mask.sum().item()


def compare(label: str, model, rollout, micro_batch: int, pairs: int, temperature: float) -> None:
    algo, trained = AlgoConfig(micro_batch=micro_batch), torch.arange(rollout.completion_ids.shape[0])
    cuts = {
        True: train.cut_micro_batches(model, rollout, trained, algo),
        False: in_row_order(model, rollout, trained, algo),
    }
    model.train()
    times = {True: [], False: []}
    for pair in range(pairs + 1):  # pair 0 is unmeasured
        for ordered in (True, False) if pair % 2 else (False, True):
            seconds = passes(model, rollout, cuts[ordered], temperature)
            if pair:
                times[ordered].append(seconds)
    ratios = [a / b for a, b in zip(times[False], times[True], strict=True)]
    lengths = rollout.completion_mask.sum(1)
    print(
        f"| {label} | {len(lengths)}, {lengths.min().item()}-{lengths.max().item()} tokens "
        f"| {len(cuts[False])} / {len(cuts[True])} "
        f"| {padded(rollout, cuts[False]):.2f} / {padded(rollout, cuts[True]):.2f} "
        f"| {statistics.median(times[False]):.2f} | {statistics.median(times[True]):.2f} "
        f"| {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] |",
        flush=True,
    )


def sweep(preset: str, new_tokens: int, pass_tokens: list[float], pairs: int) -> None:
    """The budget's cut at each fixed cost per pass (`train.PASS_TOKENS`) against the fewest pieces, on a fresh
    preset's 16 prompts × G = 8; each pair times every value once, in alternating order."""
    tokenizer = build_char_tokenizer()
    model = build_model(preset, tokenizer, seed=0).eval()
    rng = random.Random(0)
    prompts = [tokenizer(f"{rng.randint(100, 999)}+{rng.randint(100, 999)}=")["input_ids"] for _ in range(16)]
    rollout = sample(model, prompts, repeats=8, max_new_tokens=new_tokens, eos_id=tokenizer.eos_token_id, pad_id=0,
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    trained, width = torch.arange(rollout.completion_ids.shape[0]), rollout.prompt_ids.shape[1]
    values = [train.FEWEST_PASSES, *pass_tokens]
    cuts = {value: micro_batches(trained, 0, rollout.completion_mask.sum(1),
                                 lambda length: train.sized_micro_batch(model, width + length), value)
            for value in values}  # fmt: skip
    model.train()
    times = {value: [] for value in values}
    for pair in range(pairs + 1):  # pair 0 is unmeasured
        for value in values if pair % 2 else values[::-1]:
            seconds = passes(model, rollout, cuts[value], 1.0)
            if pair:
                times[value].append(seconds)
    for value in values:
        ratios = [a / b for a, b in zip(times[train.FEWEST_PASSES], times[value], strict=True)]
        print(f"| {preset}, {new_tokens} | {value:g} | {len(cuts[value])} | {padded(rollout, cuts[value]):.2f} "
              f"| {statistics.median(times[value]):.3f} "
              f"| {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}] |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="SmolLM2-135M-Instruct's directory (atrctl import-gguf); omitted: tiny only")
    parser.add_argument("--real-new-tokens", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--sweep", nargs="*", type=float, metavar="TOKENS",
                        help="instead: the budget's cut at these costs per pass, e.g. 128 256 512 1024")  # fmt: skip
    args = parser.parse_args()
    threads = set_cpu_threads()
    if args.sweep:
        print(f"{threads} threads, {args.pairs} pairs; ratio = the fewest pieces' time / this cost's (> 1: faster)")
        print("| preset, new tokens | cost per pass | micro-batches | padded per token | s | ratio |")
        print("|---|---|---|---|---|---|")
        for preset, new_tokens in (("tiny", 64), ("medium", 64), ("tiny", 8), ("medium", 8)):
            sweep(preset, new_tokens, args.sweep, args.pairs)
        return
    print(f"{threads} threads, {args.pairs} alternating pairs (after one unmeasured); row order / length order")
    print("| model | rows, reply lengths | micro-batches | padded per token | row order s | length order s | ratio |")
    print("|---|---|---|---|---|---|---|")
    if args.model:
        model, tokenizer = real_model(args.model)
        rollout = sample(model, real_model_prompts(tokenizer, 4), repeats=8, max_new_tokens=args.real_new_tokens,
                         temperature=0.7, eos_id=stop_tokens(model, tokenizer), pad_id=tokenizer.pad_token_id,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
        compare("SmolLM2-135M-Instruct, budget", model, rollout, 0, args.pairs, 0.7)
    tokenizer = build_char_tokenizer()
    model = build_model("tiny", tokenizer, seed=0).eval()
    rng = random.Random(0)
    prompts = [tokenizer(f"{rng.randint(100, 999)}+{rng.randint(100, 999)}=")["input_ids"] for _ in range(16)]
    rollout = sample(model, prompts, repeats=8, max_new_tokens=64, eos_id=tokenizer.eos_token_id, pad_id=0,
                     generator=torch.Generator().manual_seed(0))  # fmt: skip
    compare("tiny, budget (one micro-batch)", model, rollout, 0, args.pairs, 1.0)
    compare("tiny, micro_batch = 32", model, rollout, 32, args.pairs, 1.0)


if __name__ == "__main__":
    main()
