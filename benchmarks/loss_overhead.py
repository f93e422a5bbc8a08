"""What a trust region costs per step: policy_loss forward + backward, atr vs grpo vs the bands.

ATR-GRPO's claim is "no additional computation": its bounds are two constants (cached
per max_kl3), so its loss is dapo's at [1 - eps_low, 1 + eps_high] = the KL3 interval
(row dapo@atr).  The per-token bands solve for their bounds on every call.  Only the
loss is timed (logp is a leaf tensor, no model), so the ratios here bound from above
the difference in a real training step.  The elementwise kernels run slightly faster
when fewer tokens are clipped, so the clip/region column is printed beside each time.

    .venv/bin/python benchmarks/loss_overhead.py            # 256 x 1024 tokens, 2 CPU threads
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from atrctl.divergence import equivalent_clip
from atrctl.losses import policy_loss


def step(algo: str, params: dict, logp, old_logp, advantages, mask) -> tuple[float, float]:
    """Seconds of one forward + backward, metrics included (a trainer logs them every step), and clip/region."""
    logp.grad = None
    if logp.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, algo=algo, **params)
    loss.backward()
    if logp.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, metrics["clip/region"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="sequences")
    parser.add_argument("--tokens", type=int, default=1024, help="completion tokens per sequence")
    parser.add_argument("--spread", type=float, default=0.1, help="std of logp - old_logp in the synthetic batch")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per loss (median reported)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.tokens)
    old_logp = -torch.rand(shape, generator=gen) * 3
    logp = (old_logp + args.spread * torch.randn(shape, generator=gen)).clamp(max=0.0)
    mask = torch.rand(shape, generator=gen) < 0.9
    advantages = torch.randn(args.batch, generator=gen)
    logp, old_logp, mask, advantages = (t.to(args.device) for t in (logp, old_logp, mask, advantages))
    logp.requires_grad_()

    eps_low, eps_high = equivalent_clip(0.1)
    rows = {
        "grpo": ("grpo", {}),
        "atr": ("atr", {}),
        "dapo@atr": ("dapo", {"eps_low": eps_low, "eps_high": eps_high}),
        "kl-band": ("kl-band", {}),
        "tv-band": ("tv-band", {}),
        "gspo": ("gspo", {}),
        "cispo": ("cispo", {}),
    }
    times: dict[str, list[float]] = {label: [] for label in rows}
    clipped: dict[str, float] = {}
    order = random.Random(0)
    for round_ in range(args.repeats + 1):  # rounds in shuffled order, so load and caches hit every loss alike
        for label in order.sample(list(rows), len(rows)):
            seconds, clipped[label] = step(*rows[label], logp, old_logp, advantages, mask)
            if round_:  # the first round warms up
                times[label].append(seconds)
    median = {label: statistics.median(t) for label, t in times.items()}
    print(f"policy_loss forward+backward, {args.batch} x {args.tokens} tokens, {args.device}, {args.threads} threads")
    for label, seconds in median.items():
        ratio = seconds / median["grpo"]
        print(f"  {label:>9}  {seconds * 1e3:8.2f} ms  {ratio:5.2f} x grpo   clip/region {clipped[label]:.3f}")


if __name__ == "__main__":
    main()
