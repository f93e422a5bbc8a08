"""Peak memory per process of one training step, full vs FSDP-sharded vs LoRA, on a real model's shape.

Not a test.  Each configuration runs in fresh processes (two under torch.distributed.run for "fsdp2"):
the model is built with random weights of the shape (Qwen2.5-0.5B by default: 494M parameters, 151,936
vocabulary; the weights do not change the memory), set up as `atrctl.training.setup.build_run` sets it up (the
policy in float32 and AdamW over what trains; for fsdp2 the sampler's full copy, then `shard_model`; for
LoRA `add_adapters`), then one optimiser step runs on a micro-batch of --rows rows × (--prompt +
--completion) tokens through `atrctl.model.forward.completion_logprobs_and_entropy`.  Reported per process:

- the bytes of the trained state it holds (parameters, gradients, AdamW's moments), counted from the
  tensors themselves (a sharded tensor's local part), plus the frozen weights it holds besides (LoRA's
  base, fsdp's full copy for sampling);
- the peak RSS (VmHWM) over the whole step, set-up included, and the RSS once the step is over (the
  activations freed: what the process holds between steps), with glibc's heap as it is, or with
  --live every freed block of 64 KiB or more returned to the kernel (MALLOC_MMAP_THRESHOLD_), which
  makes the RSS follow the tensors alive.

    python benchmarks/shard_memory.py                    # Qwen2.5-0.5B shape, 4 rows x (64 + 128) tokens
    python benchmarks/shard_memory.py --shape smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import parse_with_smoke  # benchmarks/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parent.parent
RESULT = "RESULT "
CONFIGS = ("full", "fsdp2", "lora")


def worker(args: argparse.Namespace) -> dict:
    import torch

    sys.path[:0] = [str(ROOT / "benchmarks")]
    from common import rss_mib, shape_model

    from atrctl.model.adapters import add_adapters, lora_settings, trained_parameters
    from atrctl.model.batch import Rollout
    from atrctl.model.forward import completion_logprobs_and_entropy
    from atrctl.runtime import distributed
    from atrctl.training.sharding import full_copy, local_part, shard_model

    torch.set_num_threads(max(1, 2 // distributed.world_size()))
    with distributed.process_group(torch.device("cpu")):
        model = shape_model(args.shape).train()
        frozen = []
        if args.config == "fsdp2":
            frozen = list(full_copy(model).parameters())  # what GatheredSampler samples
            shard_model(model, bf16=False)
        elif args.config == "lora":
            add_adapters(model, lora_settings({"r": 16}))
            frozen = [p for p in model.parameters() if not p.requires_grad]
        params = trained_parameters(model)
        optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(distributed.rank())
        rows = args.rows
        prompt = torch.randint(0, vocab, (1, args.prompt), generator=g).repeat(rows, 1)
        completion = torch.randint(0, vocab, (rows, args.completion), generator=g)
        ones = torch.ones_like(completion)
        rollout = Rollout(prompt, torch.ones_like(prompt), completion, ones, torch.zeros(rows, args.completion))
        logp, _ = completion_logprobs_and_entropy(model, rollout, 1.0, entropy_grad=False)
        (logp.sum() / ones.sum()).backward()
        optimizer.step()

        def nbytes(tensors) -> float:
            return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors) / 2**20

        moments = [v for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)]
        result = {
            "rank": distributed.rank(),
            "parameters_mib": nbytes(params),
            "gradients_mib": nbytes([p.grad for p in params]),
            "optimizer_mib": nbytes(moments),
            "frozen_mib": nbytes(frozen),
            "peak_rss_mib": rss_mib("VmHWM"),
            "rss_after_mib": rss_mib("VmRSS"),
        }
        return distributed.all_gather_objects(result)


def measure(args: argparse.Namespace, config: str) -> list[dict]:
    command = [__file__, "--worker", "--config", config, "--shape", args.shape]
    command += ["--rows", str(args.rows), "--prompt", str(args.prompt), "--completion", str(args.completion)]
    if config == "fsdp2":
        command = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *command]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"MALLOC_MMAP_THRESHOLD_": "65536"} if args.live else {})}
    done = subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    line = next(line for line in done.stdout.splitlines()[::-1] if line.startswith(RESULT))
    return json.loads(line[len(RESULT) :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-0.5b", help="a real model's shape, or a preset")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--live", action="store_true", help="return freed heap blocks: RSS = tensors alive")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parse_with_smoke(parser, shape="tiny", rows=1, prompt=8, completion=8, configs=["full", "lora"])
    if args.worker:
        results = worker(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(RESULT + json.dumps(results), flush=True)
        return
    heap = "freed blocks returned (--live)" if args.live else "glibc's default heap"
    print(f"{args.shape}, one optimiser step on {args.rows} rows x ({args.prompt} + {args.completion}) tokens, "
          f"CPU, {heap}")  # fmt: skip
    print("| run | process | parameters | gradients | AdamW state | frozen weights | trained state | peak RSS "
          "| RSS after the step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        for r in measure(args, config):
            state = r["parameters_mib"] + r["gradients_mib"] + r["optimizer_mib"]
            cells = [r["parameters_mib"], r["gradients_mib"], r["optimizer_mib"], r["frozen_mib"], state]
            print(f"| {config} | rank {r['rank']} | " + " | ".join(f"{c:,.0f} MiB" for c in cells)
                  + f" | {r['peak_rss_mib']:,.0f} MiB | {r['rss_after_mib']:,.0f} MiB |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
