"""Whole runs through the vllm backend (skipped where vLLM is not installed): the engine follows the policy's
weights through updates, an interrupt and a resume, so a resumed run ends where an uninterrupted one does."""

import json
import os
import signal

import pytest
import torch
from helpers import fast, recipe_maker
from safetensors.torch import load_file

from atrctl.training.loop import train

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.usefixtures("one_cpu_thread")]

# the small preset (head size 32: vLLM's CPU kernels refuse tiny's 16), barely warmed up: the mechanics, not learning
recipe = recipe_maker(
    fast(
        "model.base=small",
        "warmup.max_steps=20",
        "warmup.eval_every=20",
        "rollout.backend=vllm",
        "algo.minibatches=2",
        "eval.every=2",
        "run.checkpoint_every=100",
    )  # fmt: skip
)


def records(directory):
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith("time/") and k != "tokens_per_s"} for row in rows]


def test_a_resumed_vllm_run_ends_where_an_uninterrupted_one_does(results):
    train(recipe("run.steps=4"), results / "straight", results=results)

    def interrupt(record):
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(recipe("run.steps=4"), results / "resumed", results=results, on_step=interrupt)
    train(recipe("run.steps=4"), results / "resumed", results=results, resume=True)

    straight, resumed = records(results / "straight"), records(results / "resumed")
    assert [r.get("step") for r in resumed if "step" in r] == [1, 2, 3, 4]
    assert straight == resumed
    assert all(abs(r["mismatch/log_ratio/max"]) < 1e-4 for r in straight if "mismatch/log_ratio/max" in r)
    a, b = (load_file(results / name / "model" / "model.safetensors") for name in ("straight", "resumed"))
    assert all(torch.equal(a[name], b[name]) for name in a)
