"""Time atrctl's own KV-cache sampling loop against transformers' generate() on a preset model.

Both produce tokens plus their logprobs (generate's from its returned logits), with the same batch,
prompt lengths and number of new tokens. Prints the median over several runs after one warm-up.

    .venv/bin/python benchmarks/sampling_speed.py --preset tiny --batch 64 --new-tokens 32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from atrctl.models import build_char_tokenizer, build_model, set_cpu_threads
from atrctl.rollout import left_pad
from atrctl.sampling import sample


def own_loop(model, prompts, new_tokens, tokenizer):
    rollout = sample(
        model, prompts, max_new_tokens=new_tokens, eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    return rollout.completion_ids.shape[1]


def generate(model, prompts, new_tokens, tokenizer, use_cache=True):
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=True, temperature=1.0,
            top_p=1.0, top_k=0, use_cache=use_cache, output_logits=True, return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        completion = out.sequences[:, ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()
        torch.log_softmax(logits, -1).gather(-1, completion[..., None])
    return completion.shape[1]


def generate_no_cache(model, prompts, new_tokens, tokenizer):
    return generate(model, prompts, new_tokens, tokenizer, use_cache=False)


def median_ms(fns, runs, *args):
    """Median milliseconds of each function; runs alternate between them so load from other processes
    hits all alike. Also the set of completion lengths each produced."""
    times = {fn: [] for fn in fns}
    lengths = {fn: set() for fn in fns}
    for run in range(runs + 1):  # run 0 is a warm-up
        for fn in fns:
            start = time.perf_counter()
            lengths[fn].add(fn(*args))
            if run:
                times[fn].append(1000 * (time.perf_counter() - start))
    return [(statistics.median(times[fn]), sorted(lengths[fn])) for fn in fns]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt lengths vary in [len/2, len]")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--no-cache", action="store_true", help="also time generate() without a KV cache")
    args = parser.parse_args()

    threads = set_cpu_threads()
    tokenizer = build_char_tokenizer()
    model = build_model(args.preset, tokenizer, arch=args.arch).eval()
    rng = random.Random(0)
    chars = "0123456789+-*="
    lengths = [rng.randint(args.prompt_len // 2, args.prompt_len) for _ in range(args.batch)]
    prompts = [tokenizer("".join(rng.choices(chars, k=n)))["input_ids"] for n in lengths]
    print(f"{args.preset}/{args.arch}, batch {args.batch}, new tokens {args.new_tokens}, threads {threads}, "
          f"median of {args.runs}")  # fmt: skip
    fns = [own_loop, generate] + ([generate_no_cache] if args.no_cache else [])
    results = median_ms(fns, args.runs, model, prompts, args.new_tokens, tokenizer)
    own = results[0][0]
    for fn, (ms, lengths) in zip(fns, results, strict=True):
        print(f"{fn.__name__:18s} {ms:8.1f} ms  {ms / own:5.2f}x own loop  (completion lengths {lengths})")


if __name__ == "__main__":
    main()
