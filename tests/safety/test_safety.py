"""Nothing lost, nowhere else touched: hostile run names and late-caught bad values leave every file as it
was (the whole working tree is hashed before and after), and an --overwrite that fails puts the old run back."""

import hashlib
import json
import os

import pytest
from helpers import fast, recipe_maker

from atrctl.cli import main
from atrctl.experiments.compare import Arm, Comparison, prepare
from atrctl.training import loop
from atrctl.training.loop import train
from atrctl.training.rundir import aside, exclusive, restore_aside

FAST = fast("run.steps=2", "algo.minibatches=1")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


recipe = recipe_maker(FAST)


def tree(folder):
    """Every file and directory below `folder` with a hash of its bytes."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            out[os.path.relpath(os.path.join(root, name), folder)] = "dir"
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A working directory two levels down (so `..` escapes stay inside tmp_path) holding results/ with an
    existing run `good`."""
    cwd = tmp_path / "outer" / "cwd"
    (cwd / "results" / "good").mkdir(parents=True)
    (cwd / "results" / "good" / "metrics.jsonl").write_text('{"step": 1}\n')
    (cwd / "keep.txt").write_text("the user's own file\n")
    monkeypatch.chdir(cwd)
    return tmp_path


def refused(capsys, argv, fragment):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert fragment in err, err


NAMES = ["..", ".", "../x", "/tmp/atrctl-absolute", "a/b", ".hidden", "x" * 300, "", " padded"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_run_name_that_is_not_a_plain_name_is_refused_and_touches_nothing(workspace, capsys, name, command):
    before = tree(workspace)
    arms = ["grpo", "atr"] if command == "compare" else []
    refused(capsys, [command, *arms, "--name", name, "--overwrite", "--steps", "1", "--results", "results"], "--name")
    assert tree(workspace) == before
    assert not os.path.exists("/tmp/atrctl-absolute")


LATE = [
    (["--set", "algo.entropy_coef=nan"], "finite"),
    (["--set", "algo.beta=inf"], "finite"),
    (["--seed", str(2**70)], "2^63"),
    (["--set", "eval.seed=-1"], "2^63"),
    (["--set", "rollout.prompts=100000000000000000000"], "2^63"),
    (["--lr", "nan"], "finite"),
]


@pytest.mark.parametrize(("extra", "fragment"), LATE)
def test_values_caught_late_before_are_caught_before_anything_is_touched(workspace, capsys, extra, fragment):
    before = tree(workspace)
    refused(capsys, ["train", "--name", "good", "--overwrite", "--steps", "1", *extra], fragment)
    assert tree(workspace) == before


def test_an_overwrite_whose_new_run_fails_puts_the_old_run_back(results, monkeypatch):
    old = results / "replaced"
    train(recipe("run.steps=1"), old, results=results)
    before = tree(old)

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(loop, "train_step", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        train(recipe(), old, results=results, overwrite=True)
    assert tree(old) == before and not aside(old).exists()


def test_an_overwrite_drops_the_old_run_once_the_new_one_has_logged_a_step(results):
    old = results / "dropped"
    train(recipe("run.steps=1"), old, results=results)
    train(recipe("run.steps=2"), old, results=results, overwrite=True)
    assert not aside(old).exists() and len((old / "metrics.jsonl").read_text().splitlines()) == 2


def test_compare_overwrite_replaces_even_the_same_comparison_and_can_put_it_back(tmp_path):
    comparison = Comparison(tmp_path / "compare-x", [Arm("grpo", "grpo"), Arm("atr", "atr")], 1, recipe(), {})
    prepare(comparison, overwrite=False)
    (comparison.directory / "runs").mkdir()
    before = tree(comparison.directory)
    prepare(comparison, overwrite=False)  # the same comparison: kept as it is, to resume
    assert tree(comparison.directory) == before
    prepare(comparison, overwrite=True)  # replaced: its runs will be retrained
    assert sorted(os.listdir(comparison.directory)) == ["compare.json"] and aside(comparison.directory).is_dir()
    restore_aside(comparison.directory)  # what run_comparison does when the new one fails before training ends
    assert tree(comparison.directory) == before and not aside(comparison.directory).exists()


def damaged_unfinished_run(results, prefix, how):
    """A three-step run with a checkpoint after each step, cut off after logging step 3 and before saving it
    (so its checkpoints are steps 2 and 1, the previous), the same run trained straight to its end beside it
    (<run>-straight), and its newest checkpoint damaged `how`."""
    run = results / f"{prefix}-{hashlib.sha256(how.encode()).hexdigest()[:8]}"
    steps = recipe("run.steps=3", "run.checkpoint_every=1")

    def power_cut(record):
        if record["step"] == 3:
            raise RuntimeError("power cut")

    with pytest.raises(RuntimeError, match="power cut"):
        train(steps, run, results=results, on_step=power_cut)
    train(steps, run.with_name(run.name + "-straight"), results=results)
    damage(run, how)
    return run


def damage(run, how, checkpoint_name="checkpoint"):
    checkpoint = run / checkpoint_name
    if how == "truncated weights":
        data = (checkpoint / "model.safetensors").read_bytes()
        (checkpoint / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "random weights":
        (checkpoint / "model.safetensors").write_bytes(os.urandom(4096))
    elif how == "no optimiser":
        (checkpoint / "optimizer.pt").unlink()
    elif how == "garbage optimiser":
        (checkpoint / "optimizer.pt").write_bytes(b"\x80\x04not a pickle")
    elif how.startswith("state "):
        (checkpoint / "state.json").write_text(how.removeprefix("state "))
    elif how == "config edited":
        config = run / "config.toml"
        config.write_text(config.read_text().replace('loss = "atr"', 'loss = "grpo"'))
    elif how == "config garbage":
        (run / "config.toml").write_text("[task\n")


@pytest.mark.parametrize(
    ("how", "fragment"),
    [
        ("truncated weights", "model.safetensors is missing or damaged"),
        ("random weights", "model.safetensors is missing or damaged"),
        ("no optimiser", "optimizer.pt is missing or damaged"),
        ("garbage optimiser", "optimizer.pt is missing or damaged"),
        ("state {}", "state.json is damaged"),
        ("state {garbage", "state.json is damaged"),
        ('state {"step": "3"}', "state.json is damaged"),
        ('state {"step": 2, "extra": 1}', "state.json is damaged"),
        ("config edited", "no longer matches the recipe its checkpoint was trained with (algo.loss: 'atr' → 'grpo')"),
        ("config garbage", "config.toml is not valid TOML"),
    ],
)
def test_a_damaged_run_is_one_line_on_resume_and_stays_as_it_was(results, capsys, how, fragment):
    run = damaged_unfinished_run(results, "damaged", how)
    damage(run, how, "checkpoint.previous")  # no intact checkpoint to fall back on
    before = tree(results)
    capsys.readouterr()  # what training the run printed
    refused(capsys, ["train", "--resume", str(run)], fragment)
    assert tree(results) == before


@pytest.mark.parametrize(
    ("how", "fragment"),
    [
        ("truncated weights", "model.safetensors is missing or damaged"),
        ("garbage optimiser", "optimizer.pt is missing or damaged"),
        ("state {garbage", "state.json is damaged"),
    ],
)
def test_a_damaged_checkpoint_falls_back_to_the_previous_one_saying_so(results, capsys, how, fragment):
    run = damaged_unfinished_run(results, "fallback", how)
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"note: {run / 'checkpoint'}" in err and fragment in err, err
    assert "resumed from the previous checkpoint (step 1)" in err, err
    # steps 2 and 3 trained again from the intact step-1 checkpoint: the same final weights, bit for bit
    straight = run.with_name(run.name + "-straight")
    assert tree(run / "model")["model.safetensors"] == tree(straight / "model")["model.safetensors"]
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 3
    assert not (run / "checkpoint.previous").exists()  # finished: its fallback is no longer kept
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_second_writer_is_refused_with_one_line(results, capsys):

    run = results / "locked"
    with exclusive(run):  # another process holds it; the lock is per open file, so this one counts as another
        sets = [flag for item in FAST for flag in ("--set", item)]
        before = tree(results)
        refused(capsys, ["train", "--name", "locked", "--results", str(results), *sets], "is being written by process")
        assert tree(results) == before  # the holder's lock file included: the refused one changed nothing
    with exclusive(run):  # released: it can be taken again
        pass


def test_a_stale_checkpoint_staging_directory_is_cleaned_on_the_next_save(tmp_path):
    import torch

    from atrctl.training.checkpoint import TrainState, save_checkpoint

    (tmp_path / ".checkpoint.k1ll3d").mkdir()  # what a SIGKILL during a save leaves
    model = torch.nn.Linear(2, 2)
    save_checkpoint(tmp_path / "checkpoint", model, torch.optim.AdamW(model.parameters()), TrainState(step=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    (tmp_path / ".checkpoint.damaged").mkdir()  # what a resume from the previous checkpoint sets aside
    save_checkpoint(tmp_path / "checkpoint", model, torch.optim.AdamW(model.parameters()), TrainState(step=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", "checkpoint.previous"]


@pytest.mark.slow
def test_training_children_end_when_their_compare_is_killed():
    import subprocess
    import sys
    import time

    parent_code = (
        "import functools, os, subprocess, sys, time; from atrctl.experiments.jobs import _end_with_parent; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
        "preexec_fn=functools.partial(_end_with_parent, os.getpid())); "
        "print(child.pid, flush=True); time.sleep(120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()  # SIGKILL: no handler of compare's runs
    parent.wait()

    def alive(pid):
        try:
            return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["compare", "grpo", "atr", "--problems", "10000000"], "lower n"),
        (["warmup", "--results", "/proc/atrctl-unwritable"], "choose a writable --results"),
        (["eval", "tiny", "--task", "gsm8k", "--task-arg", "path=bad.jsonl", "--max-new-tokens", "4"], "not UTF-8"),
        (["eval", "tiny", "--task", "arith", "--max-new-tokens", "4", "--n", str(10**12)], "GiB available"),
        (["compare", "grpo", "atr", "--n", str(10**12), "--problems", "10"], "lower --n or --problems"),
    ],
)
def test_more_bad_input_is_one_line_before_any_work(workspace, capsys, argv, fragment):
    (workspace / "outer" / "cwd" / "bad.jsonl").write_bytes(b'{"question": "\xff\xfe", "answer": "#### 3"}\n')
    before = tree(workspace)
    refused(capsys, [*argv, "--results", "results"] if argv[0] == "compare" else argv, fragment)
    assert tree(workspace) == before


def test_a_failed_compare_overwrite_puts_the_old_comparison_back(tmp_path, monkeypatch):
    from atrctl.experiments import compare

    old = compare.Comparison(tmp_path / "compare-x", [Arm("grpo", "grpo"), Arm("atr", "atr")], 1, recipe(), {})
    prepare(old, overwrite=False)
    (old.directory / "runs" / "grpo-s0").mkdir(parents=True)
    (old.directory / "runs" / "grpo-s0" / "metrics.jsonl").write_text('{"step": 1}\n')  # a run that had trained
    before = tree(old.directory)

    def training_fails(*args, **kwargs):
        raise RuntimeError("a child failed before any step")

    monkeypatch.setattr(compare, "run_jobs", training_fails)
    new = compare.Comparison(old.directory, old.arms, 1, recipe(), {}, overwrite=True)
    with pytest.raises(RuntimeError, match="before any step"):
        compare.run_comparison(new, n=2, problems=4, jobs=1, results=tmp_path, command="test")
    assert tree(old.directory) == before and not aside(old.directory).exists()


def test_a_crash_during_an_overwrite_is_repaired_on_the_next_start(results, capsys):
    """Killed after the old run was moved aside and before the new one logged a step: the next command on
    that name brings the old run back, and refuses to clobber it."""
    run = results / "crashed"
    train(recipe("run.steps=1"), run, results=results)
    before = tree(run)
    run.rename(aside(run))  # what --overwrite did just before the kill
    run.mkdir()
    (run / "config.toml").write_text((aside(run) / "config.toml").read_text())
    sets = [flag for item in FAST for flag in ("--set", item)]
    capsys.readouterr()
    refused(capsys, ["train", "--name", "crashed", "--results", str(results), *sets], "already exists")
    assert tree(run) == before and not aside(run).exists()


def test_a_checkpoint_made_before_recipes_were_recorded_still_resumes(results):
    run = results / "old-format"
    train(recipe("run.steps=1", "run.checkpoint_every=1"), run, results=results)
    state_file = run / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    del state["recipe"]
    state_file.write_text(json.dumps(state))
    summary = train(recipe("run.steps=2", "run.checkpoint_every=1"), run, results=results, resume=True)
    assert summary["steps"] == 2 and json.loads(state_file.read_text())["recipe"]  # recorded from now on


def test_a_resume_may_extend_a_run_but_not_change_what_it_trains(results, capsys):
    run = results / "extended"
    train(recipe("run.steps=1", "run.checkpoint_every=1"), run, results=results)
    config = run / "config.toml"
    config.write_text(config.read_text().replace("steps = 1\n", "steps = 2\n"))
    (run / "model").rename(run / "was-final")
    assert train(load_recipe_of(run), run, results=results, resume=True)["steps"] == 2


def load_recipe_of(run):
    from atrctl.training.rundir import RunDir

    return RunDir(run).recipe()


def test_resume_of_the_current_directory(results, monkeypatch, capsys):
    run = results / "here"
    train(recipe("run.steps=1", "run.checkpoint_every=1"), run, results=results)
    (run / "model").rename(run / "was-final")  # a crash before the model was renamed into place: resumable
    monkeypatch.chdir(run)
    capsys.readouterr()
    assert main(["train", "--resume", "."]) == 0 and (run / "model").is_dir()  # it finishes the run
    before = tree(run)
    refused(capsys, ["train", "--resume", "."], "is finished: nothing to resume")  # and is then left alone
    assert tree(run) == before
