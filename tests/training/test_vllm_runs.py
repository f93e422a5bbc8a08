"""Whole runs through the vllm backend (skipped where vLLM is not installed): the engine follows the policy's
weights through updates, an interrupt and a resume, so a resumed run ends where an uninterrupted one does; and
under torchrun, one engine per process (data-parallel and FSDP2), a run is the one-process run."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import fast, recipe_maker
from safetensors.torch import load_file
from test_distributed import assert_same_weights, torchrun  # the data-parallel tests' tolerance and launcher
from test_rollback import fail_sampling

from atrctl.cli import main
from atrctl.training.loop import train

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.usefixtures("one_cpu_thread")]

# the small preset (head size 32: vLLM's CPU kernels refuse tiny's 16), barely warmed up: the mechanics, not learning
recipe_settings = fast(
    "model.base=small",
    "warmup.max_steps=20",
    "warmup.eval_every=20",
    "rollout.backend=vllm",
    "algo.minibatches=2",
    "eval.every=2",
    "run.checkpoint_every=100",
)
recipe = recipe_maker(recipe_settings)


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


def test_after_an_undone_update_the_engine_samples_the_restored_weights(results, monkeypatch):
    """Step 3's sampling is made to fail: step 2's update is undone in the trainer and must be in the engine
    too, or the steps after it sample from weights the trainer no longer has (a log-ratio between engine and
    trainer far above float noise)."""
    fail_sampling(monkeypatch, {3})
    summary = train(recipe("run.steps=4", "run.max_bad_steps=2", "eval.every=100"), results / "undone", results=results)
    assert summary["skipped_steps"] == 1
    steps = [r for r in records(results / "undone") if "step" in r]
    assert [r["skipped_steps"] for r in steps] == [0, 0, 1, 1]
    after = [r["mismatch/log_ratio/max"] for r in steps[2:]]  # the steps sampled after the undo
    assert all(abs(r.get("mismatch/log_ratio/max", 0)) < 1e-4 for r in steps) and len(after) == 2


# Under torchrun: one prompt per sampling chunk (the 1-process chunks, so the same per-prompt seeds) and rank 0's
# held-out checks in 8 engine calls (blocks of 4 completions) that the other rank joins with empty ones.
TORCHRUN = ["rollout.sample_batch=4", "eval.batch=4", "run.steps=2"]


def torchrun_train(*args):
    """`atrctl train` under torchrun with 2 processes (a rank left out of an engine call would wait until the
    timeout)."""
    torchrun(*[arg for item in (*recipe_settings, *TORCHRUN) for arg in ("--set", item)], *args)


@pytest.fixture(scope="module")
def one_process(results):
    directory = results / "one-process"
    train(recipe(*TORCHRUN), directory, results=results)
    return directory


@pytest.mark.parametrize("shard", ["none", "fsdp"])
def test_one_engine_per_process_gives_the_one_process_run(results, one_process, shard):
    """Data-parallel and FSDP2 (the engine takes the gathered copy): each rank samples its own prompts on its
    engine, the held-out checks run on rank 0 alone, and the run ends with the 1-process run's weights and
    figures up to float noise."""
    torchrun_train("--name", shard, "--results", str(results), "--set", f"model.shard={shard}")
    ours, theirs = records(results / shard), records(one_process)
    assert theirs[0]["frac_zero_std"] < 1  # some group had mixed rewards: the update moved the weights
    assert [r["step"] for r in ours] == [1, 2]
    assert "eval/pass@1" in ours[-1]  # rank 0's held-out check, at step 2
    for mine, alone in zip(ours, theirs, strict=True):
        assert mine.keys() == alone.keys()
        for key in ("reward/mean", "len/mean", "eval/greedy", "eval/pass@1"):
            assert mine.get(key) == pytest.approx(alone.get(key), abs=1e-5), key
    load = lambda name: load_file(results / name / "model" / "model.safetensors")  # noqa: E731
    assert_same_weights(load(one_process.name), load(shard))


def test_an_evaluation_over_two_processes_is_the_one_process_evaluation(results, one_process):
    """`atrctl eval --nproc 2 --backend vllm`: 3 sampling chunks (rank 0 takes two, rank 1 one) and one greedy
    block (rank 0's alone), so each rank joins engine calls it has no prompts for; the figures are the 1-process
    figures."""
    model = str(one_process / "model")
    flags = ["--task", "arith", "--task-arg", "digits=1", "--n", "4", "--problems", "6", "--batch-size", "8",
             "--max-new-tokens", "6", "--backend", "vllm", "--device", "cpu"]  # fmt: skip
    assert main(["eval", model, *flags, "--out", str(results / "eval-one")]) == 0
    env = {**os.environ, "ATRCTL_THREADS": "1", "OMP_NUM_THREADS": "1"}
    two = ["--nproc", "2", "--out", str(results / "eval-two")]
    command = [sys.executable, "-m", "atrctl", "eval", model, *flags, *two]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = ((results / name / "passk.csv").read_text() for name in ("eval-one", "eval-two"))
    assert one == two and one.splitlines()[-1].startswith("4,")  # pass@k up to k = n = 4


def test_a_benchmark_is_sampled_by_vllm_where_it_is_installed(tmp_path):
    """`atrctl eval MODEL --task aime25` with no --backend: the preset's settings through the vllm engine."""
    from helpers import DATA

    from atrctl.model.loading import build_char_tokenizer, build_model

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}="
    build_model("small", tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    flags = ["--task", "aime25", "--task-arg", f"path={DATA / 'aime_sample.jsonl'}", "--n", "4",
             "--max-new-tokens", "4", "--device", "cpu", "--out", str(tmp_path / "eval")]  # fmt: skip
    assert main(["eval", str(tmp_path / "model"), *flags]) == 0
    setting = (tmp_path / "eval" / "passk.md").read_text().splitlines()[0]
    assert "aime25 test, 2 problems, n=4, T=0.6, top-p=0.95" in setting and setting.endswith("vllm backend")


def test_one_step_of_the_paper_recipe_runs_through_vllm_on_a_stand_in(tmp_path):
    """recipes/paper-qwen3-1.7b.toml as it is, engine included, on a Qwen3 of test size (tests/config has the
    same step with the hf backend, and the memory check)."""
    from helpers import DATA, REPO, qwen3_stand_in

    chat = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"
    model, data = qwen3_stand_in(tmp_path / "qwen3", chat), DATA / "math_sample.jsonl"
    sets = [f"model.base={model}", f"task.args.path={data}", f"task.args.test_path={data}", "model.device=cpu",
            "rollout.prompts=4", "rollout.group_size=4", "rollout.max_new_tokens=8", "algo.micro_batch=3",
            "eval.problems=2", "eval.samples=1", "run.steps=1"]  # fmt: skip
    args = ["train", "--recipe", str(REPO / "recipes" / "paper-qwen3-1.7b.toml"), "--name", "run"]
    assert main([*args, "--results", str(tmp_path), *[item for s in sets for item in ("--set", s)]]) == 0
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert record["step"] == 1 and "eval/greedy" in record
    assert 'backend = "vllm"' in (tmp_path / "run" / "config.toml").read_text()
