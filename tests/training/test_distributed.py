"""Memory controls and data parallelism: micro-batches, sampling chunks, torchrun with 2 gloo processes.

The equivalence tests compare final weights: gradient accumulation over micro-batches, and two ranks
summing their gradients, must give the single-process optimiser steps up to float noise.  The torchrun
runs start two Python processes each, so this module takes about a minute on 2 CPU cores.
"""

import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from helpers import fast, recipe_maker
from safetensors.torch import load_file

from atrctl.core.aggregation import aggregation_normaliser
from atrctl.errors import UserError
from atrctl.model.batch import Rollout, equal_runs
from atrctl.model.loading import build_char_tokenizer, build_model
from atrctl.training.batching import (
    concat_rollouts,
    least_padding_cut,
    micro_batches,
    parts,
    rank_positions,
    rollout_seed,
    rows,
    sampling_chunks,
    trimmed,
)
from atrctl.training.checks import validate_algo
from atrctl.training.loop import train

FAST = fast(
    "eval.problems=6",
    "eval.every=100",
    "run.steps=3",
    "algo.minibatches=2",
    "algo.num_iterations=2",
    "algo.entropy_coef=0.01",
    "optim.lr=1e-3",
)
DDP = ["rollout.sample_batch=4"]  # one prompt per sampling chunk: the same chunks at 1 and 2 processes


recipe = recipe_maker(FAST)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def weights(directory):
    return load_file(directory / "model" / "model.safetensors")


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=2e-5, msg=name)


# ------------------------------------------------------------------ pure parts


def test_ranks_hold_their_slice_of_every_global_minibatch():
    prompts, minibatches = 8, 2
    shares = [rank_positions(prompts, minibatches, 2, r) for r in range(2)]
    assert shares == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert rank_positions(prompts, minibatches, 1, 0) == list(range(8))
    for j in range(minibatches):  # local mini-batch j of every rank makes up global mini-batch j
        local = [share[part] for share in shares for part in [parts(len(share), minibatches)[j]]]
        assert sorted(p for piece in local for p in piece) == list(range(j * 4, (j + 1) * 4))


def test_sampling_chunks_are_aligned_and_never_cross_a_run():
    assert sampling_chunks(list(range(8)), 4, 0) == [list(range(8))]
    assert sampling_chunks(list(range(8)), 4, 12) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert sampling_chunks([0, 1, 4, 5], 4, 0) == [[0, 1], [4, 5]]
    assert sampling_chunks([2, 3, 6, 7], 4, 8) == [[2, 3], [6, 7]]  # the same chunks as at one process
    assert sampling_chunks([1, 2], 4, 8) == [[1], [2]]
    assert rollout_seed(0, 1, 2) != rollout_seed(0, 2, 1) != rollout_seed(1, 1, 2)


def test_micro_batches_cover_the_rows():
    pieces = micro_batches(torch.arange(4, 14), 4)
    assert [p.tolist() for p in pieces] == [[4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]
    assert [p.tolist() for p in micro_batches(torch.arange(6), 0)] == [list(range(6))]
    assert micro_batches(torch.arange(0), 3) == []


def test_micro_batches_take_the_longest_rows_first_and_keep_each_piece_in_order():
    lengths = torch.tensor([9, 2, 7, 7, 1, 5, 8, 3, 0, 6])  # row i's completion length
    pieces = micro_batches(torch.arange(1, 10), 3, lengths)  # rows 1..9; row 0 is not trained
    assert [p.tolist() for p in pieces] == [
        [2, 3, 6],  # lengths 7, 7, 8: the three longest, in row order (a group's rows stay adjacent)
        [5, 7, 9],  # 5, 3, 6
        [1, 4, 8],  # 2, 1, 0
    ]

    def budget(length: int) -> int:  # rows a piece may hold at its longest row's length
        return 1 if length >= 8 else 2 if length >= 6 else 4

    fewest = micro_batches(torch.arange(1, 10), 0, lengths, rows_at=budget, pass_tokens=1e9)
    assert [p.tolist() for p in fewest] == [[6], [2, 3], [5, 9], [1, 4, 7, 8]]  # longest 8 7 6 3: 8+14+12+12
    free = micro_batches(torch.arange(1, 10), 0, lengths, rows_at=budget, pass_tokens=0)
    assert all(len(set(lengths[p].tolist())) == 1 for p in free)  # passes cost nothing: no padding at all
    assert sorted(torch.cat(free).tolist()) == list(range(1, 10))


def cut_cost(sizes, longest_first, cap, pass_tokens):
    """What `least_padding_cut` minimises, written out: inf where a piece is over its cap."""
    starts = list(itertools.accumulate([0, *sizes[:-1]]))
    pieces = list(zip(starts, sizes, strict=True))
    if any(size > cap[longest_first[first]] for first, size in pieces):
        return math.inf
    return sum(pass_tokens + size * longest_first[first] for first, size in pieces)


def test_the_least_padding_cut_is_the_cheapest_of_every_cut():
    """Against every composition of the rows into pieces, on random lengths and caps."""
    rng = random.Random(0)
    for _ in range(80):
        longest_first = sorted((rng.randint(1, 12) for _ in range(rng.randint(1, 8))), reverse=True)
        roomy = rng.random() < 0.3  # no cap binds: the cut only tries runs' first rows as starts
        cap = {length: 100 if roomy else rng.randint(1, 4) for length in set(longest_first)}
        pass_tokens = rng.choice([0, 5, 40, 1e9])
        rows = len(longest_first)
        every = [[b - a for a, b in itertools.pairwise([0, *cuts, rows])]
                 for k in range(rows) for cuts in itertools.combinations(range(1, rows), k)]  # fmt: skip
        sizes = least_padding_cut(longest_first, cap.get, pass_tokens)
        assert sum(sizes) == rows
        assert cut_cost(sizes, longest_first, cap, pass_tokens) == min(
            cut_cost(other, longest_first, cap, pass_tokens) for other in every
        )


def test_equal_runs_finds_consecutive_equal_rows_only():
    a, b = [1, 2, 0], [1, 3, 0]
    first, counts = equal_runs(torch.tensor([a, a, b, a, a, a]))  # a returns after b: a run of its own
    assert first.tolist() == [0, 2, 3] and counts.tolist() == [2, 1, 3]
    assert [t.tolist() for t in equal_runs(torch.tensor([b]))] == [[0], [1]]
    assert [t.tolist() for t in equal_runs(torch.zeros(0, 3, dtype=torch.long))] == [[], []]


def test_concat_rollouts_pads_prompts_left_and_completions_right():
    a = Rollout(
        torch.tensor([[5, 6]]),
        torch.ones(1, 2, dtype=torch.long),
        torch.tensor([[7]]),
        torch.ones(1, 1, dtype=torch.long),
        torch.tensor([[-0.5]]),
    )
    b = Rollout(
        torch.tensor([[5]]),
        torch.ones(1, 1, dtype=torch.long),
        torch.tensor([[7, 8]]),
        torch.ones(1, 2, dtype=torch.long),
        torch.tensor([[-0.1, -0.2]]),
    )
    joined = concat_rollouts([a, b], pad_id=0)
    assert joined.prompt_ids.tolist() == [[5, 6], [0, 5]] and joined.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert joined.completion_ids.tolist() == [[7, 0], [7, 8]] and joined.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert joined.logprobs.tolist() == [[-0.5, 0.0], [pytest.approx(-0.1), pytest.approx(-0.2)]]


def test_aggregation_normaliser_counts_tokens_or_sequences():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert aggregation_normaliser(mask, "token-mean") == 3
    assert (
        aggregation_normaliser(mask, "seq-mean-token-mean")
        == aggregation_normaliser(mask, "seq-mean-token-sum-norm")
        == 2
    )


def test_prompts_must_split_over_processes_and_minibatches():
    validate_algo(recipe("rollout.prompts=4"), world=2)
    with pytest.raises(UserError, match=r"minibatches \(2\) × 4 processes"):
        validate_algo(recipe("rollout.prompts=4"), world=4)


# ------------------------------------------------------------------ micro-batches


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_give_the_same_weights(results, agg):
    """Uneven micro-batches (3 rows of a mini-batch of 8) and two off-policy passes, over 3 steps."""
    whole = results / f"whole-{agg}"
    micro = results / f"micro-{agg}"
    train(recipe(f"algo.agg={agg}"), whole, results=results)
    train(recipe(f"algo.agg={agg}", "algo.micro_batch=3"), micro, results=results)
    assert_same_weights(weights(whole), weights(micro))
    losses = [
        [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (whole, micro)
    ]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)


def test_budgeted_micro_batches_fit_the_budget_and_give_the_same_weights(results, monkeypatch):
    """A budget that binds (algo.micro_batch = 0): every micro-batch holds at most what the budget allows at
    its own trimmed width, the cut spans several, and the weights are the whole mini-batch's."""
    from atrctl.model import memory
    from atrctl.training import step as step_module

    whole, budgeted = results / "whole-budget", results / "budgeted"
    train(recipe(), whole, results=results)
    cuts = []

    def recorded(model, rollout, trained, algo):
        pieces = cut(model, rollout, trained, algo)
        for piece in pieces:
            sub = trimmed(rows(rollout, piece))
            width = sub.prompt_ids.shape[1] + sub.completion_ids.shape[1]
            cuts.append((len(piece), memory.sized_micro_batch(model, width)))
        return pieces

    cut = step_module.cut_micro_batches
    tiny = build_model("tiny", build_char_tokenizer())
    two_rows = 2 * memory.activation_bytes_per_token(tiny, 10) * 10  # 1-3 rows at these 5 + <= 8 tokens
    monkeypatch.setattr(memory, "UPDATE_BUDGET", two_rows)
    monkeypatch.setattr(step_module, "cut_micro_batches", recorded)
    train(recipe(), budgeted, results=results)
    assert cuts and all(size <= cap for size, cap in cuts)
    assert len(cuts) > 2 * 3 * 2  # 3 steps × 2 mini-batches, each in more than two micro-batches
    assert_same_weights(weights(whole), weights(budgeted))


def test_gradient_checkpointing_and_sampling_chunks_train(results):
    """Gradient checkpointing changes no number; small sampling chunks only change which tokens are drawn."""
    plain, checkpointed = results / "plain-chunks", results / "checkpointed-chunks"
    train(recipe("rollout.sample_batch=4"), plain, results=results)
    train(recipe("rollout.sample_batch=4", "model.gradient_checkpointing=true"), checkpointed, results=results)
    assert_same_weights(weights(plain), weights(checkpointed))


# ------------------------------------------------------------------ torchrun


def torchrun(*args, nproc=2):
    env = {**os.environ, "ATRCTL_THREADS": "1", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "atrctl",
        "train",
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def cli_sets(*overrides):
    return [arg for item in (*FAST, *overrides) for arg in ("--set", item)]


@pytest.fixture(scope="module")
def single(results):
    """The single-process run every data-parallel run is compared with."""
    directory = results / "single"
    train(recipe(*DDP), directory, results=results)
    return directory


@pytest.mark.slow
def test_two_processes_match_one_and_only_rank_zero_writes(results, single):
    done = torchrun("--name", "ddp", "--results", str(results), *cli_sets(*DDP))
    directory = results / "ddp"
    assert_same_weights(weights(single), weights(directory))
    assert sorted(p.name for p in directory.iterdir()) == sorted(p.name for p in single.iterdir())
    logged = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    alone = [json.loads(line) for line in (single / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3]  # one writer, not one per rank
    for ours, theirs in zip(logged, alone, strict=True):  # metrics reduced over ranks = the global figures
        for key in ("reward/mean", "reward/std", "frac_zero_std", "len/mean", "entropy"):
            assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
        for key in ("ratio/min", "ratio/max"):  # exp of one token's log-ratio: its logprob's float noise (the
            # ranks project other sets of tokens to the vocabulary) shows relative to the ratio; seen 2.5e-5
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4), key
    assert done.stdout.count("done:") == 1  # only rank 0 reports


@pytest.mark.slow
def test_a_run_resumes_at_another_world_size(results, single):
    directory = results / "resumed"

    def stop_after_first(record):
        if record["step"] == 1:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(recipe(*DDP), directory, results=results, on_step=stop_after_first)
    assert json.loads((directory / "checkpoint" / "state.json").read_text())["step"] == 1
    torchrun("--resume", str(directory))
    assert_same_weights(weights(single), weights(directory))


@pytest.mark.slow
def test_nproc_relaunches_under_torchrun(results, single):
    env = {**os.environ, "ATRCTL_THREADS": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "atrctl",
            "train",
            "--nproc",
            "2",
            "--name",
            "nproc",
            "--results",
            str(results),
            *cli_sets(*DDP, "run.steps=1"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len((results / "nproc" / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.slow
def test_a_refusal_under_nproc_is_one_line_from_every_rank_together(results, single):
    """Rank 0 alone checks the lock; the others abide by its answer instead of waiting for it in a
    collective, and the launcher adds no report of its own."""
    from atrctl.training.rundir import exclusive

    held = results / "held"  # the run as a crash before its model was in place leaves it: resumable
    shutil.copytree(single, held)
    shutil.rmtree(held / "model")
    env = {**os.environ, "ATRCTL_THREADS": "1", "OMP_NUM_THREADS": "1"}
    with exclusive(held):  # another writer holds the run
        done = subprocess.run(
            [sys.executable, "-m", "atrctl", "train", "--nproc", "2", "--resume", str(held)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [f"error: {held} is being written by process {os.getpid()}: "
                                                "wait for it to finish, or stop it"]  # fmt: skip
