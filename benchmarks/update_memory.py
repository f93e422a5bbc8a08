"""Peak memory of one micro-batch's forward + backward pass, before and after the chunked log-softmax.

Not a test.  "before" is the pass atrctl ran until the chunked selective log-softmax (float32 logits of
the whole micro-batch, [rows, T, vocab], then log_softmax over them; `todays` in tests/test_forward.py,
which the tests check the new pass against); "after" is `atrctl.forward.completion_logprobs_and_entropy`.
Both run the same model (random weights of a real model's shape: the vocabulary is what matters), the
same rows (a GRPO group sharing one prompt, every completion max_new_tokens long) and the same loss
(the token-mean of logprob × a fixed weight, entropy without gradient as the update computes it).

Each measurement is a fresh process: the model and the rollout are built, the kernel's peak-RSS counter
is reset (/proc/self/clear_refs), then one forward + backward runs; reported are the peak RSS of the
process and its rise above the resting RSS just before the pass, once with glibc's heap left as it is
(what a user's process shows: freed blocks below 32 MiB stay resident) and once with every freed block
of 64 KiB or more returned to the kernel (MALLOC_MMAP_THRESHOLD_), which makes the RSS the tensors alive.
The parameter gradients are allocated before (as they are from a mini-batch's second micro-batch on), so
the rise is what the pass itself holds: activations and logits, the part that grows with the micro-batch.
Weights, gradients and AdamW's two moments (16 bytes per parameter) come on top and do not depend on it.

    python benchmarks/update_memory.py                       # SmolLM2-135M and Qwen2.5-0.5B shapes
    python benchmarks/update_memory.py --shapes smollm2-135m --rows 8 --prompt 64 --completion 256
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = "RESULT "


def rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(args: argparse.Namespace) -> dict:
    import torch

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
    from fresh_models import real_vocabulary_shape
    from test_forward import plain, todays  # the pre-chunking passes (shared prompt; single), the tests' references

    from atrctl.forward import completion_logprobs_and_entropy
    from atrctl.rollout import Rollout

    torch.set_num_threads(2)
    model = real_vocabulary_shape(args.shape).train()
    if args.checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = args.rows
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=g).repeat(rows, 1)
    completion = torch.randint(0, vocab, (rows, args.completion), generator=g)
    ones = torch.ones_like(completion)
    rollout = Rollout(prompt, torch.ones_like(prompt), completion, ones, torch.zeros(rows, args.completion))
    weights = torch.randn(rows, args.completion, generator=g)

    def step():
        if args.path == "before":
            logp, entropy = (plain if args.checkpointing else todays)(model, rollout, 1.0)
            entropy = entropy.detach()
        else:
            logp, entropy = completion_logprobs_and_entropy(model, rollout, 1.0, entropy_grad=False)
        ((logp * weights).sum() / ones.sum() + 0 * entropy.sum()).backward()

    for parameter in model.parameters():  # the gradients exist before the pass, as from the second micro-batch on:
        parameter.grad = torch.zeros_like(parameter)  # the rise is then the pass's own (activations, logits)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
    resting = rss_mib("VmRSS")
    step()
    return {"peak_mib": rss_mib("VmHWM"), "rise_mib": rss_mib("VmHWM") - resting, "resting_mib": resting}


def measure(args: argparse.Namespace, shape: str, path: str, live: bool) -> dict:
    """One worker process; `live`: glibc returns every freed block of 64 KiB or more to the kernel at once, so
    the RSS follows the tensors alive (otherwise freed heap blocks stay resident and count in the peak)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"} if live else None
    command = [sys.executable, __file__, "--worker", "--shape", shape, "--path", path]
    command += ["--rows", str(args.rows), "--prompt", str(args.prompt), "--completion", str(args.completion)]
    command += ["--checkpointing"] if args.checkpointing else []
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT, env=env).stdout
    return json.loads(next(line for line in out.splitlines()[::-1] if line.startswith(RESULT))[len(RESULT) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the layers")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--path", choices=["before", "after"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(RESULT + json.dumps(worker(args)), flush=True)
        return
    layers = "with activation checkpointing" if args.checkpointing else "without activation checkpointing"
    print(f"one forward + backward of {args.rows} rows x ({args.prompt} prompt + {args.completion} completion) tokens,"
          f" {layers}")  # fmt: skip
    print("| shape | memory | before: peak / rise (MiB) | after: peak / rise (MiB) | rise, before / after |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        for live, label in ((True, "tensors alive"), (False, "RSS, default malloc")):
            before, after = measure(args, shape, "before", live), measure(args, shape, "after", live)
            print(
                f"| {shape} | {label} | {before['peak_mib']:.0f} / {before['rise_mib']:.0f} | "
                f"{after['peak_mib']:.0f} / {after['rise_mib']:.0f} | {before['rise_mib'] / after['rise_mib']:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
