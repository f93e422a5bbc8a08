"""How far each part of a step is from this CPU's limit, per model shape: tokens/s and achieved GFLOP/s of the
rollout and of the update, against the GFLOP/s of one large float32 matrix product on the same threads,
and the peak memory of each.

Not a test.  Each shape runs in a fresh process on random weights (speed and memory do not depend on
them): a rollout of `prompts` × G completions, every one `tokens` long (EOS suppressed), then one update
pass over it (forward + backward of logprobs, as `train._optimiser_step` runs it, in micro-batches as
`algo.micro_batch = 0` sizes them); one unmeasured round first, then the median of `repeats`.  FLOPs are
counted, not measured: 2 per multiply-add of every weight matrix per token (the output projection
included), plus attention's q·k and p·v over the keys each token attends to; the update is 3 forward
passes' worth (forward, and backward's two products) plus the chunked head's recomputation.  Peak memory
is the process's peak RSS during each phase (the counter reset before it), weights included.  With
--bf16 both run under bf16 autocast (float32 master weights, as `model.autocast` does on a bf16-native CPU
for models >= 256 wide), against the peak of a bf16 product.

    python benchmarks/shapes.py                                   # tiny, medium, smollm2-135m, qwen2.5-0.5b
    python benchmarks/shapes.py --shapes smollm2-135m qwen2.5-0.5b --bf16   # on a bf16-native CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from common import parse_with_smoke  # benchmarks/ is on sys.path when run as a script

RESULT = "RESULT "
SIZES = {  # prompts, G, prompt tokens, new tokens: the default recipe's batch for the presets, smaller above
    "tiny": (64, 8, 8, 64),
    "tiny-smoke": (2, 2, 4, 4),  # --smoke: the tiny preset on a batch of seconds
    "medium": (64, 8, 8, 64),
    "smollm2-135m": (4, 8, 32, 64),
    "qwen2.5-0.5b": (2, 8, 32, 64),
}


def matmul_peak_gflops(size: int = 2048, repeats: int = 5, dtype=None) -> float:
    """GFLOP/s of one [size, size] @ [size, size] product (float32 unless `dtype`): what these cores reach at
    best."""
    import torch
    from common import seconds  # benchmarks/ is on sys.path

    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    best = min(seconds(lambda: a @ b) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def forward_flops(config, tokens: int, keys: float) -> float:
    """Forward FLOPs of `tokens` tokens attending on average to `keys` keys each."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = hidden // heads
    width = config.intermediate_size
    per_layer = hidden * hidden * 2 + 2 * hidden * kv * head_dim + 3 * hidden * width  # q, o; k, v; MLP
    matmul = layers * per_layer + config.vocab_size * hidden  # and the output projection
    attention = layers * 2 * heads * head_dim * keys  # q·k and p·v
    return 2 * tokens * (matmul + attention)


def worker(shape: str, repeats: int, bf16: bool) -> dict:
    import torch
    from common import autocast, draw, rss_mib, seconds, shape_model  # benchmarks/ is on sys.path

    from atrctl.config.schema import AlgoConfig
    from atrctl.model.forward import completion_logprobs_and_entropy
    from atrctl.runtime.machine import set_cpu_threads
    from atrctl.training.batching import rows
    from atrctl.training.micro_batches import cut_micro_batches

    threads = set_cpu_threads()
    peak = matmul_peak_gflops(256 if shape.endswith("-smoke") else 2048, dtype=torch.bfloat16 if bf16 else None)
    model = shape_model(shape.removesuffix("-smoke")).train()
    prompts, group, prompt_tokens, tokens = SIZES[shape]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (prompts, prompt_tokens), generator=g).tolist()

    def rollout():
        return draw(model, ids, group, tokens, bf16=bf16)

    def update(batch):
        model.zero_grad(set_to_none=True)
        for where in pieces:
            sub = rows(batch, where)
            with autocast(bf16):
                logp, _ = completion_logprobs_and_entropy(model, sub, 1.0, entropy_grad=False)
            (logp.sum() / batch.completion_mask.sum()).backward()

    batch = rollout()
    pieces = cut_micro_batches(model, batch, torch.arange(prompts * group), AlgoConfig())  # as the update cuts
    update(batch)  # the unmeasured round
    Path("/proc/self/clear_refs").write_text("5")
    sample_s = statistics.median(seconds(rollout) for _ in range(repeats))
    sample_peak = rss_mib("VmHWM")
    Path("/proc/self/clear_refs").write_text("5")
    update_s = statistics.median(seconds(lambda: update(batch)) for _ in range(repeats))
    update_peak = rss_mib("VmHWM")

    config, rows_total = model.config, prompts * group
    new = rows_total * tokens
    prefill = forward_flops(config, prompts * prompt_tokens, prompt_tokens / 2)
    decode = forward_flops(config, new, prompt_tokens + tokens / 2)
    # the update runs each group's prompt once, its completions on top; the head only at completion tokens
    body = forward_flops(config, prompts * prompt_tokens + new, prompt_tokens + tokens / 2)
    head_only = 2 * config.vocab_size * config.hidden_size
    update_flops = 3 * (body - head_only * prompts * prompt_tokens) + head_only * new  # + the recomputed head
    return {
        "threads": threads,
        "peak_gflops": peak,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "rows": rows_total,
        "micro_batch": " + ".join(str(len(piece)) for piece in pieces),  # rows of each pass
        "sample_tokens_per_s": new / sample_s,
        "sample_gflops": (prefill + decode) / sample_s / 1e9,
        "update_tokens_per_s": new / update_s,
        "update_gflops": update_flops / update_s / 1e9,
        "sample_peak_mib": sample_peak,
        "update_peak_mib": update_peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, against a bf16 product's peak")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parse_with_smoke(parser, shapes=["tiny-smoke"], repeats=1)
    if args.worker:
        print(RESULT + json.dumps(worker(args.worker, args.repeats, args.bf16)), flush=True)
        return
    print("| shape | params | batch (micro) | rollout tok/s | rollout GFLOP/s | update tok/s | update GFLOP/s "
          "| matmul peak GFLOP/s | peak RSS rollout / update |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        command = [sys.executable, __file__, "--worker", shape, "--repeats", str(args.repeats)]
        command += ["--bf16"] if args.bf16 else []
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        r = json.loads(next(line for line in out.splitlines()[::-1] if line.startswith(RESULT))[len(RESULT) :])
        prompts, group, prompt_tokens, tokens = SIZES[shape]
        share = {part: r[f"{part}_gflops"] / r["peak_gflops"] for part in ("sample", "update")}
        print(
            f"| {shape} | {r['params_m']:.1f}M | {prompts}×{group}, {prompt_tokens}+{tokens} tok ({r['micro_batch']}) "
            f"| {r['sample_tokens_per_s']:.0f} | {r['sample_gflops']:.1f} ({share['sample']:.0%}) "
            f"| {r['update_tokens_per_s']:.0f} | {r['update_gflops']:.1f} ({share['update']:.0%}) "
            f"| {r['peak_gflops']:.0f} | {r['sample_peak_mib'] / 1024:.1f} / {r['update_peak_mib'] / 1024:.1f} GiB |",
            flush=True,
        )


if __name__ == "__main__":
    main()
