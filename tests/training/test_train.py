"""The training loop: files a run writes, on-policy first pass, resume, interrupts, bad input, NaN steps.

One tiny warmed-up base is built once for the module; every run then takes a fraction of a second
on CPU.  An entropy bonus makes every update move the weights even when a step's rewards carry no
signal, so the tests do not depend on how good the tiny base happens to be.
"""

import json
import math
import os
import shutil
import signal
import sys

import pytest
import torch
from helpers import fast, recipe_maker
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from atrctl.cli import main
from atrctl.config.loading import recipe_from_dict
from atrctl.config.schema import AlgoConfig
from atrctl.core.losses import LossOutput
from atrctl.errors import UserError
from atrctl.model.loading import build_char_tokenizer
from atrctl.model.numerics import Numerics
from atrctl.rollout.hf import HFSampler
from atrctl.tasks import get_task
from atrctl.training import step as step_module
from atrctl.training.bad_steps import TrainingStopped
from atrctl.training.base_cache import ensure_base
from atrctl.training.checkpoint import (
    TrainState,
    find_checkpoint,
    load_checkpoint,
    load_latest_checkpoint,
    promote_previous,
    read_state,
    save_checkpoint,
)
from atrctl.training.loop import train
from atrctl.training.schedule import lr_at, prompts_for_step
from atrctl.training.step import recomputes_old_logprobs
from atrctl.training.step_metrics import STEP_PHASES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

FAST = fast("eval.every=2", "run.steps=4", "algo.minibatches=1", "algo.entropy_coef=0.01", "optim.lr=1e-3")

METRICS = (
    "reward/mean",
    "reward/std",
    "frac_zero_std",
    "len/mean",
    "clip/low",
    "clip/high",
    "clip/region",
    "kl3/mean",
    "kl3/max",
    "ratio/min",
    "ratio/max",
    "entropy",
    "loss",
    "grad_norm",
    "lr",
    "time/rollout",
    "time/reward",
    "time/logprobs",
    "time/update",
    "time/step",
    "tokens_per_s",
)
TIMING = (
    "time/rollout",
    "time/reward",
    "time/logprobs",
    "time/update",
    "time/step",
    "tokens_per_s",
    "train_seconds_this_session",
)


recipe = recipe_maker(FAST)


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def base_weights(results):
    path, _ = ensure_base(recipe(), results)
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def start(results, name, *overrides, **kwargs):
    """A fresh run `name` in `results`: (summary, directory)."""
    directory = results / name
    return train(recipe(*overrides), directory, results=results, **kwargs), directory


def records(directory):
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def saved_recipe(directory):
    data = tomllib.loads((directory / "config.toml").read_text())
    data.pop("environment")
    return recipe_from_dict(data)


def without_timing(record):
    return {key: value for key, value in record.items() if key not in TIMING}


@pytest.fixture(scope="module")
def short_run(results):
    return start(results, "short")


# ------------------------------------------------------------------ pure parts


def test_lr_constant_with_linear_warmup():
    assert [lr_at(s, 1.0, "constant", 0, 10) for s in range(10)] == [1.0] * 10
    ramp = [lr_at(s, 2.0, "constant", 4, 10) for s in range(10)]
    assert ramp[:4] == [0.5, 1.0, 1.5, 2.0] and ramp[4:] == [2.0] * 6


def test_lr_cosine_decays_to_ten_percent():
    lrs = [lr_at(s, 1.0, "cosine", 2, 12) for s in range(14)]
    assert lrs[:3] == [0.5, 1.0, 1.0]  # warm-up, then the peak where the decay starts
    assert all(a > b for a, b in zip(lrs[2:12], lrs[3:13], strict=True))  # strictly down to the end
    assert lrs[12] == pytest.approx(0.1) and lrs[13] == pytest.approx(0.1)  # 10% at the end, and it stays
    assert min(lrs) == pytest.approx(0.1)
    assert lr_at(7, 1.0, "cosine", 2, 12) == pytest.approx(0.55)  # half-way: the mean of 1 and 0.1


def test_prompts_for_step_covers_the_pool_once_per_epoch():
    pool, prompts = 10, 4
    order = [i for step in range(10) for i in prompts_for_step(pool, step, prompts, seed=3)]
    epochs = [order[e * pool : (e + 1) * pool] for e in range(4)]
    assert all(sorted(epoch) == list(range(pool)) for epoch in epochs)  # every prompt once, no repeats
    assert len({tuple(epoch) for epoch in epochs}) == 4  # each epoch its own shuffle
    assert epochs[0] != list(range(pool))
    # a pure function of (seed, step): the same again, and independent of how it is batched
    assert prompts_for_step(pool, 7, prompts, seed=3) == order[28:32]
    assert [i for step in range(40) for i in prompts_for_step(pool, step, 1, seed=3)] == order
    assert prompts_for_step(pool, 0, pool, seed=4) != prompts_for_step(pool, 0, pool, seed=3)


# ------------------------------------------------------------------ a short run


def test_short_run_writes_every_file(short_run, base_weights):
    summary, directory = short_run
    assert saved_recipe(directory) == recipe()  # the fully resolved recipe reads back
    environment = tomllib.loads((directory / "config.toml").read_text())["environment"]
    assert {"atrctl", "git_commit", "torch", "transformers", "device"} <= set(environment)

    logged = records(directory)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    for record in logged:
        assert set(METRICS) <= set(record), set(METRICS) - set(record)
        assert all(math.isfinite(record[key]) for key in METRICS)
        assert record["lr"] == 1e-3 and record["skipped_steps"] == 0
        assert 0 <= record["reward/mean"] <= 1 and record["len/mean"] > 0 and record["entropy"] > 0
        phases = [record[f"time/{phase}"] for phase in STEP_PHASES]
        assert min(phases) >= 0 and 0 < sum(phases) <= record["time/step"]  # the phases do not overlap
    assert ["eval/greedy" in r for r in logged] == [False, True, False, True]

    checkpoint = directory / "checkpoint"
    assert {p.name for p in checkpoint.iterdir()} == {"model.safetensors", "optimizer.pt", "state.json"}
    assert json.loads((checkpoint / "state.json").read_text())["step"] == 4
    model = AutoModelForCausalLM.from_pretrained(directory / "model")
    final = model.state_dict()
    saved = load_file(checkpoint / "model.safetensors")
    assert all(torch.equal(final[name], saved[name]) for name in final)  # the final model is the last state
    assert any(not torch.equal(final[name], base_weights[name]) for name in final)  # and training moved it

    written = json.loads((directory / "summary.json").read_text())
    assert written == summary
    assert set(summary["base"]) == set(summary["final"]) == {"eval/greedy", "eval/pass@1"}
    assert summary["final"] == {k: v for k, v in logged[-1].items() if k.startswith("eval/")}
    assert summary["steps"] == 4 and summary["skipped_steps"] == 0 and summary["algo"] == "atr"
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".") or p.name.endswith(".old")]
    assert leftovers == []  # no staging or temporary files


def test_first_pass_is_on_policy(short_run):
    for record in records(short_run[1]):
        assert record["kl3/mean"] == record["kl3/max"] == 0.0
        assert record["clip/low"] == record["clip/high"] == record["clip/region"] == 0.0
        assert record["ratio/min"] == record["ratio/max"] == 1.0


def test_auto_recomputes_old_logprobs_only_under_bf16_on_cuda():
    """The rollout backend decides, from its numerics: the hf sampler's logprobs stand in for the old ones in
    float32 (they match the forward pass) and under bf16 on a CPU (measured, `old_logprobs_bf16` (retired:
    docs/performance-log.md)); under bf16 on CUDA, not measured there, they are recomputed."""
    tokenizer = build_char_tokenizer()
    cpu, cpu_bf16, cuda = (
        HFSampler(None, tokenizer, Numerics(torch.device(name), torch.float32, autocast))
        for name, autocast in (("cpu", None), ("cpu", torch.bfloat16), ("cuda", torch.bfloat16))
    )

    def algo(old_logprobs, minibatches=4):
        return AlgoConfig(old_logprobs=old_logprobs, minibatches=minibatches)

    assert not recomputes_old_logprobs(algo("auto"), cpu) and not recomputes_old_logprobs(algo("auto"), cpu_bf16)
    assert recomputes_old_logprobs(algo("auto"), cuda)
    assert recomputes_old_logprobs(algo("recompute"), cpu) and not recomputes_old_logprobs(algo("sampler"), cuda)
    assert not recomputes_old_logprobs(algo("recompute", minibatches=1), cpu)  # on-policy: no old logprobs at all


@pytest.mark.parametrize("old_logprobs", ["recompute", "sampler"])
def test_second_pass_moves_the_ratio(results, monkeypatch, old_logprobs):
    """μ = 2: the first pass over a fresh rollout is on-policy, the second is not.  Recomputed old
    logprobs make the first pass exact; the sampler's KV-cache logprobs agree to float noise."""
    passes = []

    def spy(*args, **kwargs):
        out = policy_loss(*args, **kwargs)
        if args[0].requires_grad:  # not the recipe check
            passes.append(out.metrics)
        return out

    policy_loss = step_module.policy_loss
    monkeypatch.setattr(step_module, "policy_loss", spy)
    _, directory = start(
        results,
        f"two-passes-{old_logprobs}",
        "algo.num_iterations=2",
        "run.steps=3",
        f"algo.old_logprobs={old_logprobs}",
    )
    assert len(passes) == 6
    for first, second in zip(passes[::2], passes[1::2], strict=True):
        if old_logprobs == "recompute":
            assert first["kl3/max"] == 0.0 and first["ratio/min"] == first["ratio/max"] == 1.0  # fresh rollout
        else:
            assert first["kl3/max"] < 1e-10 and 1 - 1e-5 < first["ratio/min"] <= first["ratio/max"] < 1 + 1e-5
            assert first["clip/region"] == 0.0
        # the first pass's update moved the policy: some ratio is off 1 (which way depends on the batch)
        assert second["kl3/max"] > 0.0 and (second["ratio/min"] < 1.0 or second["ratio/max"] > 1.0)
    for record in records(directory):
        assert record["kl3/max"] > 0.0 and record["kl3/mean"] > 0.0
        assert record["ratio/min"] < 1.0 or record["ratio/max"] > 1.0


# ------------------------------------------------------------------ interrupt and resume


def interrupt_at(step):
    def on_step(record):
        if record["step"] == step:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does

    return on_step


def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(results, base_weights):
    steps = ["run.steps=6", "eval.every=2", "run.checkpoint_every=100"]
    whole, straight = start(results, "straight", *steps)

    handler = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a shell's background job
    with pytest.raises(KeyboardInterrupt):
        start(results, "resumed", *steps, on_step=interrupt_at(3))
    directory = results / "resumed"
    assert signal.getsignal(signal.SIGINT) is handler  # handlers restored
    checkpoint = find_checkpoint(directory / "checkpoint")
    assert json.loads((checkpoint / "state.json").read_text())["step"] == 3
    assert [r["step"] for r in records(directory)] == [1, 2, 3]
    assert not (directory / "model").exists()

    # the checkpoint loads into a fresh model and optimiser
    model = AutoModelForCausalLM.from_pretrained(ensure_base(recipe(), results)[0])
    optimizer = torch.optim.AdamW(model.parameters())
    state = load_checkpoint(checkpoint, model, optimizer)
    assert state.step == 3 and state.skipped_steps == 0
    saved = load_file(checkpoint / "model.safetensors")
    assert set(saved) == set(model.state_dict())
    assert all(torch.equal(model.state_dict()[name], saved[name]) for name in saved)
    assert any(not torch.equal(saved[name], base_weights[name]) for name in saved)
    assert len(optimizer.state) == len(list(model.parameters()))

    resumed = train(saved_recipe(directory), directory, results=results, resume=True)
    a, b = records(straight), records(directory)
    assert [r["step"] for r in b] == list(range(1, 7))
    for left, right in zip(a, b, strict=True):
        assert without_timing(left) == without_timing(right)
    assert without_timing(resumed) == without_timing(whole)
    final_a = AutoModelForCausalLM.from_pretrained(straight / "model").state_dict()
    final_b = AutoModelForCausalLM.from_pretrained(directory / "model").state_dict()
    assert all(torch.equal(final_a[name], final_b[name]) for name in final_a)


def test_sigterm_also_checkpoints(results):
    def on_step(record):
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        start(results, "terminated", "run.steps=5", on_step=on_step)
    assert signal.getsignal(signal.SIGTERM) == previous
    state = json.loads((results / "terminated" / "checkpoint" / "state.json").read_text())
    assert state["step"] == 2


def test_resume_drops_steps_logged_after_the_checkpoint(results):
    steps = ["run.steps=5", "run.checkpoint_every=2", "eval.every=100"]
    _, straight = start(results, "drop-straight", *steps)
    directory = results / "drop"

    def crash(record):
        if record["step"] == 3:
            raise RuntimeError("power cut")  # after step 3 is logged, before it is checkpointed

    with pytest.raises(RuntimeError):
        start(results, "drop", *steps, on_step=crash)
    assert [r["step"] for r in records(directory)] == [1, 2, 3]
    with open(directory / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "reward/me')  # and a line cut short by the crash
    assert json.loads((directory / "checkpoint" / "state.json").read_text())["step"] == 2
    train(saved_recipe(directory), directory, results=results, resume=True)
    assert [without_timing(r) for r in records(directory)] == [without_timing(r) for r in records(straight)]
    for run in (directory, straight):  # finished: the last checkpoint (step 5) stays, its fallback (step 4) goes
        assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 5
        assert not (run / "checkpoint.previous").exists()


def test_interrupt_during_the_last_step_still_finishes(results):
    summary, directory = start(results, "last", "run.steps=3", on_step=interrupt_at(3))
    assert summary["steps"] == 3 and (directory / "model").is_dir()
    assert json.loads((directory / "checkpoint" / "state.json").read_text())["step"] == 3


def test_checkpoint_swap_keeps_the_previous_one_and_recovers_from_a_crash_at_any_point(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    directory, previous = tmp_path / "checkpoint", tmp_path / "checkpoint.previous"
    save_checkpoint(directory, model, optimizer, TrainState(step=1))
    save_checkpoint(directory, model, optimizer, TrainState(step=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.previous"]  # no staging left
    assert read_state(directory).step == 2 and read_state(previous).step == 1
    assert oct(directory.stat().st_mode & 0o777) == "0o755"

    shutil.rmtree(previous)
    directory.rename(previous)  # a crash between the two renames: the previous one is what there is
    assert find_checkpoint(directory) == previous
    state, where, note = load_latest_checkpoint(directory, model, optimizer)
    assert (state.step, where) == (2, previous) and note.startswith(f"{directory} is missing")
    save_checkpoint(directory, model, optimizer, TrainState(step=3))  # the previous one is kept as it is
    assert read_state(directory).step == 3 and read_state(previous).step == 2


def test_a_damaged_checkpoint_is_passed_over_for_the_previous_and_set_aside(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    directory = tmp_path / "checkpoint"
    for step in (1, 2):
        save_checkpoint(directory, model, optimizer, TrainState(step=step))
    (directory / "optimizer.pt").write_bytes(b"torn")
    state, where, note = load_latest_checkpoint(directory, model, optimizer)
    assert state.step == 1 and where.name == "checkpoint.previous"
    assert "optimizer.pt is missing or damaged" in note and note.endswith("previous checkpoint (step 1)")
    promote_previous(directory)
    assert read_state(directory).step == 1 and not (tmp_path / "checkpoint.previous").exists()
    save_checkpoint(directory, model, optimizer, TrainState(step=2))  # the damaged one goes with the next save
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.previous"]
    (directory / "model.safetensors").write_bytes(b"torn")
    (tmp_path / "checkpoint.previous" / "model.safetensors").write_bytes(b"torn")
    with pytest.raises(UserError, match=r"checkpoint/model.safetensors is missing or damaged"):
        load_latest_checkpoint(directory, model, optimizer)  # nothing intact: the newest one's problem


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path / "checkpoint", model, torch.optim.AdamW(model.parameters()), TrainState(step=1))
    other = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with pytest.raises(UserError, match="does not match the model"):
        load_checkpoint(tmp_path / "checkpoint", other, torch.optim.AdamW(other.parameters()))


# ------------------------------------------------------------------ non-finite steps


def poison(monkeypatch, bad_steps):
    """Make the loss NaN on the given (1-based) steps of an on-policy run."""
    calls = []
    policy_loss = step_module.policy_loss

    def patched(*args, **kwargs):
        out = policy_loss(*args, **kwargs)
        if not args[0].requires_grad:  # the recipe check before any work
            return out
        calls.append(1)
        return LossOutput(out.loss * math.nan, out.metrics) if len(calls) in bad_steps else out

    monkeypatch.setattr(step_module, "policy_loss", patched)


def test_a_nan_step_is_skipped_and_counted(results, monkeypatch):
    poison(monkeypatch, {2, 4})
    summary, directory = start(results, "nan-some", "run.steps=5", "run.max_bad_steps=2")
    logged = records(directory)
    assert [r["skipped_steps"] for r in logged] == [0, 1, 1, 2, 2]
    assert all(set(METRICS) <= set(r) for r in (logged[0], logged[2], logged[4]))
    assert all(math.isfinite(r["reward/mean"]) for r in logged)  # the rollout of a skipped step is logged
    assert summary["steps"] == 5 and summary["skipped_steps"] == 2
    weights = AutoModelForCausalLM.from_pretrained(directory / "model").state_dict()
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_consecutive_nan_steps_stop_the_run_with_a_valid_checkpoint(results, monkeypatch, base_weights):
    poison(monkeypatch, {2, 3, 4, 5})
    with pytest.raises(TrainingStopped, match="3 consecutive steps"):
        start(results, "nan-stop", "run.steps=6", "run.max_bad_steps=3", "run.checkpoint_every=100")
    directory = results / "nan-stop"
    state = json.loads((directory / "checkpoint" / "state.json").read_text())
    assert state["step"] == 4 and state["bad_steps"] == 3 and state["skipped_steps"] == 3
    assert [r["step"] for r in records(directory)] == [1, 2, 3, 4]
    saved = load_file(directory / "checkpoint" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in saved.values())
    # only step 1 updated the weights: they are those after step 1 of an identical healthy run
    monkeypatch.undo()
    _, healthy = start(results, "nan-healthy", "run.steps=1", "run.max_bad_steps=3")
    after_one = load_file(healthy / "checkpoint" / "model.safetensors")
    assert all(torch.equal(saved[name], after_one[name]) for name in saved)
    assert any(not torch.equal(saved[name], base_weights[name]) for name in saved)


# ------------------------------------------------------------------ the CLI


def cli(results, *args):
    """`atrctl train` on the FAST recipe; the common flags are given as flags (a later one wins)."""
    flagged = ("run.steps=", "optim.lr=", "rollout.group_size=", "rollout.prompts=")  # --set would override them
    sets = [flag for item in FAST if not item.startswith(flagged) for flag in ("--set", item)]
    return main(
        ["train", "--results", str(results), *sets, "--prompts", "4", "--group-size", "4", "--steps", "2", *args]
    )


@pytest.mark.parametrize(
    "bad",
    [
        ["--set", "rollout.promts=4"],  # unknown key
        ["--set", "optim.lr=fast"],  # wrong type
        ["--lr", "-1e-4"],  # negative learning rate
        ["--group-size", "1"],  # no baseline
        ["--algo", "ppo"],  # unknown loss
        ["--set", "algo.args.eps=0.2"],  # atr takes max_kl3, not eps
        ["--set", "algo.minibatches=3"],  # 4 prompts do not split into 3 whole mini-batches
        ["--set", "task.args.carry=1"],  # caught only once the run is being set up
    ],
)
def test_bad_recipe_exits_2_and_leaves_no_run_directory(results, capsys, bad):
    before = sorted(p.name for p in results.iterdir())
    assert cli(results, "--name", "bad", *bad) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert captured.out == ""  # not even a blank line from the progress display
    assert not (results / "bad").exists()
    assert sorted(p.name for p in results.iterdir()) == before


def test_existing_run_is_refused_unless_resumed_or_overwritten(results, capsys):
    directory = results / "taken"
    assert cli(results, "--name", "taken") == 0
    snapshot = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()}
    capsys.readouterr()

    assert cli(results, "--name", "taken", "--steps", "3") == 2
    err = capsys.readouterr().err.strip()
    assert "--resume" in err and "--overwrite" in err and "\n" not in err
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()} == snapshot

    # an --overwrite that fails on bad input costs nothing: the old run is removed only once the new one is set up
    assert cli(results, "--name", "taken", "--overwrite", "--set", "task.args.carry=1") == 2
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()} == snapshot

    assert main(["train", "--resume", str(directory), "--name", "taken"]) == 2  # resume takes no recipe options
    assert main(["train", "--resume", str(directory), "--results", str(results)]) == 2  # finished: nothing to do
    assert "is finished: nothing to resume" in capsys.readouterr().err
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.rglob("*") if p.is_file()} == snapshot

    assert cli(results, "--name", "taken", "--steps", "3", "--overwrite") == 0
    assert [r["step"] for r in records(directory)] == [1, 2, 3]
    assert saved_recipe(directory).run.steps == 3
    assert json.loads((directory / "summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("seconds, shown", [("0", [1, 2, 3]), ("1000", [1, 3])])
def test_without_a_terminal_progress_is_plain_lines_at_an_interval(results, capsys, monkeypatch, seconds, shown):
    """stdout is a file (here pytest's capture): no rich control codes, a line at the first step, then at most
    one per interval, and the last; each says step/total, reward, the latest held-out figures, elapsed, ETA."""
    monkeypatch.setenv("ATRCTL_PROGRESS_SECONDS", seconds)
    capsys.readouterr()
    assert cli(results, "--name", f"plain-{seconds}", "--steps", "3", "--set", "eval.every=2") == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out
    lines = [line for line in out.splitlines() if line.startswith("train atr ")]
    assert [int(line.split()[2].split("/")[0]) for line in lines] == shown
    assert all("/3  reward " in line and "elapsed 0:00:" in line for line in lines)
    assert "ETA" not in lines[0] and "ETA" not in lines[-1]  # no rate yet; nothing left to estimate
    if seconds == "0":
        assert "ETA 0:00:0" in lines[1]  # the rate since the first update
    assert "eval greedy" in lines[-1] and "pass@1" in lines[-1]
    if seconds == "0":
        assert "eval greedy" not in lines[0] and "(step 2)" not in lines[1] and lines[2].endswith(tuple("0123456789"))


def test_reference_model_only_with_beta(results):
    _, directory = start(results, "no-reference", "run.steps=1")
    assert "kl/ref" not in records(directory)[0]
    _, directory = start(results, "with-reference", "run.steps=2", "algo.beta=0.1")
    kl = [record["kl/ref"] for record in records(directory)]
    assert all(math.isfinite(value) and value >= 0 for value in kl) and kl[-1] > 0


def test_tensorboard_events_are_written(results):
    pytest.importorskip("tensorboard")
    _, directory = start(results, "tensorboard", "run.steps=2", "run.tensorboard=true")
    events = list((directory / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_missing_tensorboard_is_one_line_and_writes_nothing(results, capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    assert cli(results, "--name", "no-tb", "--tensorboard") == 2
    assert "pip install tensorboard" in capsys.readouterr().err
    assert not (results / "no-tb").exists()


def test_each_held_out_check_writes_the_completions_it_scored(results):
    _, directory = start(results, "shown", "run.steps=2", "eval.every=1", "eval.problems=8")
    assert sorted(p.name for p in (directory / "samples").iterdir()) == ["step-0.jsonl", "step-1.jsonl", "step-2.jsonl"]
    rows = [json.loads(line) for line in (directory / "samples" / "step-2.jsonl").read_text().splitlines()]
    task = get_task("arith", digits=1)
    problems = {p.id: p for p in task.problems("test", None, 0)}
    assert [r["sample"] for r in rows[:2]] == ["greedy", 0] and len(rows) == 2 * 8
    assert all(r["reward"] == task.score(problems[r["problem"]], r["completion"]).reward for r in rows)
    greedy = [r["reward"] for r in rows if r["sample"] == "greedy"]  # all 8 held-out problems are shown
    assert records(directory)[-1]["eval/greedy"] == pytest.approx(sum(greedy) / len(greedy))
