"""FSDP2 sharding (`model.shard = "fsdp"`) under torchrun with 2 (and once 3) gloo processes on the CPU.

A sharded run must be the single-process run: the same losses, metrics and final weights up to float
noise (the ranks' gradients are summed in another order), with ~1/2 of the trained state on each rank.
The recipe skips zero-advantage rows and cuts one-row micro-batches, so the ranks have unequal numbers
of passes and the update's lockstep padding is exercised (steps where no rank trains a row included), and
recomputes the old logprobs, a pass without backward, under activation checkpointing.  Checkpoints are
the unsharded files: a run moves between sharded and unsharded, and between process counts, at any
checkpoint (loading a checkpoint into a sharded model from an unsharded run's files is the same code
path as from a sharded run's).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import fast, recipe_maker
from test_distributed import assert_same_weights, weights  # the data-parallel tests' tolerance

from atrctl.errors import UserError
from atrctl.training.loop import train
from atrctl.training.sharding import check_can_shard

FAST = fast(
    "warmup.max_steps=15",  # a weak base: mixed rewards, so rows are skipped unevenly over the ranks
    "warmup.eval_every=15",
    "rollout.sample_batch=4",  # one prompt per sampling chunk: the same chunks at 1 and 2 processes
    "eval.problems=6",
    "eval.every=100",
    "run.steps=3",
    "algo.minibatches=2",
    "algo.num_iterations=2",
    "algo.micro_batch=1",
    "algo.old_logprobs=recompute",  # a pass without backward: FSDP's root must be resharded after it
    "model.gradient_checkpointing=true",
    "optim.lr=1e-3",
)


recipe = recipe_maker(FAST)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def records(directory):
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def torchrun(*args, check=True):
    env = {**os.environ, "ATRCTL_THREADS": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run([*command, "-m", "atrctl", "train", *args], capture_output=True, text=True, env=env)
    assert not check or done.returncode == 0, done.stderr[-3000:]
    return done


def cli_sets(*overrides):
    return [arg for item in (*FAST, *overrides) for arg in ("--set", item)]


def set_in_config(directory, **values):
    """Edit config.toml's [model]/[run] entries a resume may change (model.shard, run.steps)."""
    config = directory / "config.toml"
    text = config.read_text()
    for key, value in values.items():
        text, count = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
        assert count == 1, key
    config.write_text(text)


# ------------------------------------------------------------------ bad input


def test_sharding_needs_several_processes_and_full_weights():
    check_can_shard("none", 1, lora=True)
    check_can_shard("fsdp", 2, lora=False)
    with pytest.raises(UserError, match=r'model.shard = "fsdp" needs several processes .* --nproc N'):
        check_can_shard("fsdp", 1, lora=False)
    with pytest.raises(UserError, match=r'model.shard = "fsdp" with model.lora is not supported'):
        check_can_shard("fsdp", 2, lora=True)
    with pytest.raises(UserError, match=r"model.shard = 'zero3' is not one of none, fsdp"):
        recipe("model.shard=zero3")


def test_a_sharded_run_in_one_process_is_refused_before_anything_is_written(tmp_path, capsys):
    from atrctl.cli import main

    assert main(["train", "--results", str(tmp_path), "--name", "alone", *cli_sets("model.shard=fsdp")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs several processes to shard over" in err
    assert not any(tmp_path.iterdir())


def test_the_samplers_copy_under_bf16_autocast_holds_bf16_linears_and_computes_the_same_logits():
    """Autocast casts a linear layer's float32 weight to bf16 before each product, so a copy that stores it in
    bf16 computes the same logits, bit for bit, in half the memory; the tied embedding stays float32."""
    from atrctl.model.loading import build_char_tokenizer, build_model
    from atrctl.training.sharding import full_copy

    for arch in ("llama", "qwen2"):  # qwen2's q/k/v projections have biases
        model = build_model("tiny", build_char_tokenizer(), arch=arch).eval()
        copied = full_copy(model, torch.bfloat16)
        linears = [m for m in copied.modules() if isinstance(m, torch.nn.Linear)]
        embedding = copied.get_input_embeddings().weight
        assert copied.get_output_embeddings().weight is embedding and embedding.dtype == torch.float32
        stored = [p for m in linears if m.weight is not embedding for p in m.parameters()]
        assert len(stored) > 10 and all(p.dtype == torch.bfloat16 for p in stored)
        assert all(p.dtype == torch.float32 for n, p in copied.named_parameters() if "norm" in n)
        assert not any(p.requires_grad for p in copied.parameters())
        ids = torch.randint(4, model.config.vocab_size, (3, 12))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(copied(input_ids=ids).logits, model(input_ids=ids).logits)
        assert torch.equal(
            full_copy(model).model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight
        )


# ------------------------------------------------------------------ torchrun


@pytest.fixture(scope="module")
def single(results):
    """The single-process, unsharded run every sharded run is compared with."""
    directory = results / "single"
    train(recipe(), directory, results=results)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize(
    ("processes", "overrides"),
    [(2, ()), (3, ("rollout.prompts=6", "algo.beta=0.1", "model.autocast=bfloat16"))],  # 6 prompts: 2 × 3 ranks
    ids=["2-processes", "3-processes-bf16-with-a-sharded-reference"],
)
def test_an_update_whose_first_minibatch_trains_no_row_matches_one_process(results, single, tmp_path, processes,
                                                                           overrides):  # fmt: skip
    """No rank has a pass in the first mini-batch, after the old logprobs' pass without backward (with
    beta > 0 its rows train on the KL term alone, against a sharded reference).  3 processes: a process
    count that is not a power of two, with its uneven split of every matrix over the ranks."""
    from sharded_update import crafted_update

    script = str(Path(__file__).parent / "sharded_update.py")
    env = {**os.environ, "ATRCTL_THREADS": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", script]
    done = subprocess.run([*command, str(tmp_path / "fsdp"), str(results), "fsdp", *overrides], capture_output=True,
                          text=True, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    alone = crafted_update(results, "none", *overrides)
    sharded = torch.load(tmp_path / "fsdp", weights_only=True)
    assert alone["finite"] and sharded["finite"]
    assert sharded["loss"] == pytest.approx(alone["loss"], abs=1e-6)
    assert_same_weights(alone["weights"], sharded["weights"])


@pytest.mark.slow
def test_a_sharded_run_matches_one_process_writes_from_rank_zero_and_resumes_anywhere(results, single):
    """Step 1 sharded over 2 processes, step 2 resumed in one process without sharding (another N), step 3
    resumed sharded again, which saves the final model from the gathered shards: the single-process run,
    step by step, to float noise."""
    directory = results / "sharded"
    done = torchrun("--name", directory.name, "--results", str(results), *cli_sets("model.shard=fsdp", "run.steps=1"))
    assert done.stdout.count("done:") == 1  # only rank 0 reports
    # the trained state each rank holds, measured: half of it, up to the rows of a matrix split unevenly
    line = re.search(r"rank 0 holds ([\d.]+) MiB .*?, ([\d.]+) of the ([\d.]+) MiB", done.stderr)
    assert line, done.stderr[-2000:]
    assert 0.45 < float(line.group(2)) < 0.55
    set_in_config(directory, shard='"none"', steps=2)
    train(recipe("run.steps=2"), directory, results=results, resume=True)
    set_in_config(directory, shard='"fsdp"', steps=3)
    torchrun("--resume", str(directory))

    assert_same_weights(weights(single), weights(directory))
    files = {p.name for p in directory.iterdir()} - {"checkpoint.previous"}  # saved more than once: resumed
    assert files == {p.name for p in single.iterdir()}
    logged, alone = records(directory), records(single)
    assert [r["step"] for r in logged] == [1, 2, 3]  # one writer, not one per rank
    assert any(0 < r["rows/skipped"] < 1 for r in alone)  # rows were skipped, and not all of them
    for ours, theirs in zip(logged, alone, strict=True):
        for key in ("reward/mean", "frac_zero_std", "len/mean", "rows/skipped"):
            assert ours[key] == theirs[key], key
        for key in ("loss", "entropy", "kl3/mean", "clip/low", "clip/high", "grad_norm"):
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], abs=1e-5), key
