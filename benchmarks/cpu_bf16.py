"""bf16 autocast against float32 on this CPU: speed of the update pass and of sampling, and how far the
logprobs move.

Not a test.  For each model shape, one fixed batch (a GRPO group layout: `prompts` prompts × G rows,
completions `tokens` long) is run both ways in alternating pairs, in one process:
- update: `completion_logprobs_and_entropy` forward + backward of the whole batch (float32 master weights;
  under autocast the matrix products run in bf16), seconds per pass;
- sampling: `sample` of the same rows, seconds per call;
- step: what a training step does with these rows, timed phase by phase in the same pair: sampling, the
  update pass and a fused AdamW step on the float32 master weights, as atrctl's (lr 0, so the weights stay
  put).  No old-logprob pass: on a CPU atrctl reuses the sampler's logprobs in either precision.
Ratios are float32 time / bf16 time within each pair (> 1: bf16 is faster): median [min, max] over pairs.
Agreement, on the sampled batch: max and mean |Δ logprob| between the bf16 sampler (KV-cache decode) and the
bf16 training pass (what an off-policy ratio's denominator carries, since atrctl reuses the sampler's
logprobs on a CPU), and between the bf16 and the float32 training pass.

    python benchmarks/cpu_bf16.py                              # tiny, small, medium, smollm2-135m
    python benchmarks/cpu_bf16.py --shapes medium --pairs 7
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from fresh_models import REAL_VOCABULARY_SHAPES, real_vocabulary_shape  # benchmarks/ is on sys.path

from atrctl.forward import completion_logprobs_and_entropy
from atrctl.models import build_char_tokenizer, build_model, set_cpu_threads
from atrctl.sampling import sample


def shape_model(name: str):
    if name in REAL_VOCABULARY_SHAPES:
        return real_vocabulary_shape(name)
    return build_model(name, build_char_tokenizer(), seed=0)


def autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=on)


def draw(model, prompts, group: int, tokens: int, bf16: bool, seed: int = 0):
    """`sample` as `HFSampler.generate` runs it: in eval mode (a training-mode model decodes through SDPA,
    not the sampler's own decode attention), under the autocast of `bf16`."""
    vocab = model.config.vocab_size
    training = model.training
    model.eval()
    try:
        with autocast(bf16):  # sample() turns gradients off itself; what it returns can enter a graph
            return sample(
                model,
                prompts,
                repeats=group,
                max_new_tokens=tokens,
                eos_id=[vocab],  # an id no row can draw: every completion is `tokens` long
                pad_id=0,
                generator=torch.Generator().manual_seed(seed),
            )
    finally:
        model.train(training)


def update_pass(model, rollout, bf16: bool) -> float:
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    with autocast(bf16):
        logp, entropy = completion_logprobs_and_entropy(model, rollout, 1.0, entropy_grad=False)
    (logp.sum() / rollout.completion_mask.sum()).backward()
    return time.perf_counter() - started


def seconds(work) -> float:
    """Wall-clock seconds of one call of `work`."""
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def alternating(setups: dict, work, pairs: int) -> dict[str, list[float]]:
    """Seconds of `work` after each named setup, in `pairs` alternating pairs (which goes first swaps), after
    an unmeasured pair that compiles and warms both up."""
    times: dict[str, list[float]] = {name: [] for name in setups}
    for pair in range(pairs + 1):
        for name in list(setups) if pair % 2 else list(setups)[::-1]:
            setups[name]()
            took = seconds(work)
            if pair:
                times[name].append(took)
    return times


def summary(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]"


def measure(name: str, args: argparse.Namespace) -> str:
    model = shape_model(name).train()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, model.config.vocab_size, (args.prompts, args.prompt_tokens), generator=g).tolist()
    rollout = draw(model, prompts, args.group, args.tokens, bf16=True)
    with torch.no_grad():
        with autocast(True):
            trained_bf16 = completion_logprobs_and_entropy(model, rollout)[0]
        trained_fp32 = completion_logprobs_and_entropy(model, rollout)[0]
    mask = rollout.completion_mask.bool()
    sampler_gap = (rollout.logprobs - trained_bf16)[mask].abs()
    dtype_gap = (trained_bf16 - trained_fp32)[mask].abs()

    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, fused=True)  # as atrctl's; lr 0: weights stay put
    update, sampling, step, fp32_seconds = [], [], [], []
    for pair in range(args.warmup + args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        updated, drawn, total = {}, {}, {}
        for bf16 in order:
            drawn[bf16] = seconds(lambda bf16=bf16: draw(model, prompts, args.group, args.tokens, bf16))
            updated[bf16] = update_pass(model, rollout, bf16)
            total[bf16] = drawn[bf16] + updated[bf16] + seconds(optimizer.step)
        if pair >= args.warmup:
            update.append(updated[False] / updated[True])
            sampling.append(drawn[False] / drawn[True])
            step.append(total[False] / total[True])
            fp32_seconds.append((updated[False], drawn[False], total[False]))
    update_s, sample_s, step_s = (statistics.median(column) for column in zip(*fp32_seconds, strict=True))
    return (
        f"| {name} | {summary(update)} | {summary(sampling)} | {summary(step)} | "
        f"{update_s:.3f} / {sample_s:.3f} / {step_s:.3f} | "
        f"{sampler_gap.max():.2e} / {sampler_gap.mean():.1e} | {dtype_gap.max():.2e} / {dtype_gap.mean():.1e} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "small", "medium", "smollm2-135m"])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    threads = set_cpu_threads()
    print(
        f"{args.prompts} prompts x G={args.group}, {args.prompt_tokens} prompt + {args.tokens} new tokens, "
        f"{threads} threads, {args.pairs} alternating pairs; ratio = float32 time / bf16 time"
    )
    print(
        "| shape | update pass, fp32/bf16 | sampling, fp32/bf16 | step, fp32/bf16 | "
        "fp32 seconds: update / sampling / step | "
        "|Δlogp| bf16 sampler vs bf16 pass: max / mean | |Δlogp| bf16 vs fp32 pass: max / mean |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes:
        print(measure(name, args), flush=True)


if __name__ == "__main__":
    main()
