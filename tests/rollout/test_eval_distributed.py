"""`atrctl eval` sharded over processes: 2 gloo ranks give the 1-process evaluation, and only rank 0 writes.

A tiny model guessing one-digit answers (its embeddings pushed towards digits) earns some reward on
1-digit addition and subtraction, so the compared figures (pass@k, maj@k, greedy) are not all zero.
The two torchrun tests start two Python processes each: about 20 s on 2 CPU cores.
"""

import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from atrctl.cli import main
from atrctl.model.loading import build_char_tokenizer, build_model
from atrctl.rollout.evaluate import evaluate_model, sample_chunks
from atrctl.runtime import distributed
from atrctl.tasks import Score, get_task

# one problem per sampling chunk, greedy blocks of 8 problems: rank 1 samples 12 problems, greedy-decodes 8
FLAGS = [
    "--task",
    "arith",
    "--task-arg",
    "digits=1",
    "--task-arg",
    "ops=+-",
    "--max-new-tokens",
    "1",
    "--n",
    "32",
    "--problems",
    "24",
    "--batch-size",
    "8",
    "--device",
    "cpu",
]


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def digit_guesser():
    tokenizer = build_char_tokenizer()
    model = build_model("tiny", tokenizer, seed=0)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    with torch.no_grad():  # tied embeddings: a shared direction that every logit reads, larger for digits
        embedding = model.get_input_embeddings().weight
        embedding[:, 0] = 1.0
        embedding[digits, 0] = 3.0
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models") / "guesser"
    model, tokenizer = digit_guesser()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_chunks_are_aligned_whole_problems():
    assert sample_chunks(7, 4, 8) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert sample_chunks(3, 64, 16) == [range(0, 1), range(1, 2), range(2, 3)]


class FirstDigitTask:
    """Arithmetic prompts; a completion is correct when it starts with 0-4, and its first character votes."""

    def __init__(self):
        self.inner = get_task("arith", digits=2)

    def problems(self, split, n, seed):
        return self.inner.problems(split, n, seed)

    def score(self, problem, completion):
        head = completion[:1] or None
        return Score(float(head is not None and head in "01234"), head)


def test_shards_merge_into_the_one_process_result(monkeypatch):
    """Each rank's share (chunks r, r + W, ...) gathered in problem order is exactly the 1-process result."""
    tokenizer = build_char_tokenizer()
    model = build_model("tiny", tokenizer, seed=0).eval()
    task = FirstDigitTask()
    problems = task.problems("test", 10, 0)
    kwargs = dict(n=8, temperature=1.0, seed=5, max_new_tokens=3, batch_size=16)  # chunks of 2 problems
    alone = evaluate_model(model, tokenizer, task, problems, **kwargs)
    assert 0 < alone.rewards.mean() < 1

    shares = {}

    class Gathered(Exception):
        pass

    def keep(rank, obj):
        shares[rank] = obj
        raise Gathered

    for rank in (0, 1):  # each rank's own share, stopped at the gather
        monkeypatch.setattr(distributed, "shard", lambda rank=rank: (rank, 2))
        monkeypatch.setattr(distributed, "all_gather_objects", lambda obj, rank=rank: keep(rank, obj))
        with pytest.raises(Gathered):
            evaluate_model(model, tokenizer, task, problems, **kwargs)
    assert sorted(shares[0][1]) == [0, 1, 4, 5, 8, 9] and sorted(shares[1][1]) == [2, 3, 6, 7]
    assert sorted(shares[0][0]) == list(range(10)) and shares[1][0] == {}  # one greedy block of 16 problems
    monkeypatch.setattr(distributed, "all_gather_objects", lambda obj: [shares[0], shares[1]])
    monkeypatch.setattr(distributed, "shard", lambda: (0, 2))
    merged = evaluate_model(model, tokenizer, task, problems, **kwargs)
    assert np.array_equal(merged.rewards, alone.rewards) and merged.parsed == alone.parsed
    assert np.array_equal(merged.greedy, alone.greedy) and merged.problem_ids == alone.problem_ids


def run(*command):
    """Run python with these arguments; a crashing rank prints its Python stack (PYTHONFAULTHANDLER)."""
    env = {**os.environ, "ATRCTL_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    done = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "eval"
    assert main(["eval", str(model_dir), *FLAGS, "--out", str(out)]) == 0
    return out


def without_seconds(path):
    return [line for line in path.read_text().splitlines() if not line.startswith("- seconds")]


def assert_same_evaluation(ours, single):
    assert sorted(p.name for p in ours.iterdir()) == ["passk.csv", "passk.md", "passk.png", "samples.jsonl"]
    assert (ours / "passk.csv").read_text() == (single / "passk.csv").read_text()
    # the completions kept, gathered from every rank, in problem order with each problem's greedy first
    assert (ours / "samples.jsonl").read_text() == (single / "samples.jsonl").read_text()
    assert without_seconds(ours / "passk.md") == without_seconds(single / "passk.md")  # avg@n, greedy too


@pytest.mark.slow
def test_torchrun_eval_matches_one_process_and_only_rank_zero_writes(model_dir, single, tmp_path):
    frame = pd.read_csv(single / "passk.csv")
    assert (frame["pass@k"] > 0).all() and (frame["maj@k"] > 0).any()
    assert "greedy accuracy: 0.0000" not in (single / "passk.md").read_text()  # block 2 of 3 is rank 1's
    out = tmp_path / "eval"
    flags = ["--samples" if flag == "--n" else flag for flag in FLAGS]  # torchrun would take --n as its own
    done = run(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "atrctl",
        "eval",
        str(model_dir),
        *flags,
        "--out",
        str(out),
    )
    assert_same_evaluation(out, single)
    assert done.stdout.count("wrote ") == 1 and done.stdout.count("pass@k:") == 1  # rank 0 alone reports


@pytest.mark.slow
def test_nproc_relaunches_under_torchrun(model_dir, single, tmp_path):
    out = tmp_path / "eval"
    done = run("-m", "atrctl", "eval", str(model_dir), *FLAGS, "--out", str(out), "--nproc", "2")
    assert_same_evaluation(out, single)
    assert done.stdout.count("wrote ") == 1


def test_nproc_is_refused_under_torchrun_or_below_one(model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "eval"
    assert main(["eval", str(model_dir), *FLAGS, "--out", str(out), "--nproc", "0"]) == 2
    assert "--nproc" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["eval", str(model_dir), *FLAGS, "--out", str(out), "--nproc", "2"]) == 2
    assert "--nproc" in capsys.readouterr().err
    assert not out.exists()
