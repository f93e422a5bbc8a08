"""One update of a crafted batch, sharded or not (run by tests/training/test_sharding.py, under torchrun for "fsdp").

The first mini-batch's advantages are all 0, so no rank trains a row of it, while the second's are not:
with the old logprobs recomputed first (a pass without backward), the first optimiser step then has no
forward or backward pass at all (unless algo.beta > 0: then its rows still train on the KL term, against
a sharded reference).  The final parameters, gathered, go to argv[1] (torch.save, rank 0).

    python -m torch.distributed.run --nproc-per-node N tests/training/sharded_update.py OUT RESULTS fsdp [OVERRIDE ...]
(the unsharded update: `crafted_update(results, "none", *overrides)` in the test's own process)
"""

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # test_sharding, helpers
import test_sharding  # noqa: E402

from atrctl.runtime import distributed  # noqa: E402
from atrctl.training.batching import parts  # noqa: E402
from atrctl.training.setup import build_run  # noqa: E402
from atrctl.training.sharding import full_tensor  # noqa: E402
from atrctl.training.step import rollout_step, update_step  # noqa: E402


def crafted_update(results: Path, shard: str, *overrides: str) -> dict | None:
    """Build the run, sample step 0, update on the crafted advantages: rank 0's gathered weights, finite, loss."""
    with distributed.process_group(torch.device("cpu")):
        return _update(results, shard, *overrides)  # the run is dropped before the group is destroyed


def _update(results: Path, shard: str, *overrides: str) -> dict | None:
    run = build_run(test_sharding.recipe(f"model.shard={shard}", *overrides), results / "unused", results)
    rollout, rewards, _ = rollout_step(run, 0)
    group = rewards.shape[1]
    sample = torch.arange(rewards.numel()) % group  # rows are prompt-major: row i is sample i % G of its prompt
    advantages = torch.where(sample % 2 == 0, 1.0, -1.0)
    advantages[parts(rewards.numel(), run.recipe.algo.minibatches)[0]] = 0.0  # the first mini-batch: nothing
    metrics, finite = update_step(run, rollout, advantages, 0)
    weights = {name: full_tensor(p.detach()).clone() for name, p in run.model.named_parameters()}
    return {"weights": weights, "finite": finite, "loss": metrics.get("loss")} if distributed.is_main() else None


if __name__ == "__main__":
    out, results, shard, *overrides = Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:]
    torch.set_num_threads(1)
    done = crafted_update(results, shard, *overrides)
    if done is not None:
        torch.save(done, out)
