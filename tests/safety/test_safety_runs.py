"""Issue 48's run and comparison classes: a directory is replaced only by what made it, arms given as paths are
read and never written, a comparison's runs are its own, bases are found from where the runs are, and a damaged
file atrctl wrote earlier is one line naming it (or evaluated again, saying so)."""

import json
import os
import shutil
import stat

import numpy as np
import pytest
from helpers import COMPARE, compare_args
from test_safety import refused, tree

from atrctl.cli import main
from atrctl.config.loading import load_recipe
from atrctl.core.passk import EvalResult
from atrctl.errors import UserError
from atrctl.experiments.compare import check_kept_runs, plan_comparison, prepare, trained_recipe
from atrctl.files.records import DamagedFile
from atrctl.reports.eval_report import RESULT_ARRAYS, RESULT_RECORD, load_result, save_result
from atrctl.training.base_cache import base_key
from atrctl.training.rundir import RunDir

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
SETS = [flag for item in COMPARE for flag in ("--set", item)]


def unlocked(folder):
    """`tree` without the lock files a refused command may leave (empty, hidden, by design: rundir.exclusive)."""
    return {path: digest for path, digest in tree(folder).items() if not path.endswith(".lock")}


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """results/ holding a comparison, a cached base and a folder of the user's, beside a file of the user's."""
    monkeypatch.chdir(tmp_path)
    results = tmp_path / "results"
    (results / "compare-c1" / "runs" / "grpo-s0").mkdir(parents=True)
    (results / "compare-c1" / "compare.json").write_text("{}\n")
    (results / "compare-c1" / "report.md").write_text("the comparison's report\n")
    (results / "bases" / "0123456789abcdef").mkdir(parents=True)
    (results / "bases" / "0123456789abcdef" / "base.json").write_text("{}\n")
    (results / "notes").mkdir()
    (results / "notes" / "ideas.txt").write_text("the user's own notes\n")
    (tmp_path / "keep.txt").write_text("beside the results\n")
    return tmp_path


# ------------------------------------------------------------ class 2: only a run is replaced by train


@pytest.mark.parametrize("name", ["compare-c1", "bases", "notes"])
def test_train_overwrite_replaces_only_a_run(workspace, capsys, name):
    before = tree(workspace)
    argv = ["train", "--name", name, "--overwrite", "--steps", "1", "--results", "results", *SETS]
    refused(capsys, argv, "is not a run (it has no config.toml): --overwrite replaces only runs")
    assert tree(workspace) == before


@pytest.mark.parametrize("kind", ["compare", "sweep"])
def test_compare_and_sweep_overwrite_replace_only_their_own_kind(workspace, capsys, kind):
    results = workspace / "results"
    (results / f"{kind}-x").mkdir()
    (results / f"{kind}-x" / "config.toml").write_text("[run]\nsteps = 1\n")  # a run that has the name
    other = "sweep" if kind == "compare" else "compare"
    (results / f"{kind}-y").mkdir()
    (results / f"{kind}-y" / f"{other}.json").write_text("{}\n")  # a comparison of the other kind
    before = tree(workspace)
    arms = ["atr", "--grid", "max_kl3=0.05,0.1"] if kind == "sweep" else ["grpo", "atr"]
    for name in ("x", "y"):
        refused(capsys, [kind, *arms, "--name", name, "--overwrite", "--results", "results", *SETS],
                f"is not a {kind} (it has no {kind}.json): --overwrite replaces only a {kind}")  # fmt: skip
        refused(capsys, [kind, *arms, "--name", name, "--results", "results", *SETS], "already exists")
    assert tree(workspace) == before


@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_name_that_is_a_file_or_a_link_is_refused(workspace, capsys, command):
    results = workspace / "results"
    (results / "taken").write_text("a file of the user's\n")
    (results / "compare-taken").write_text("a file of the user's\n")
    (results / "linked").symlink_to(results / "notes")
    (results / "compare-linked").symlink_to(results / "notes")
    before = tree(workspace)
    arms = ["grpo", "atr"] if command == "compare" else []
    cases = [
        ("taken", [], "it is a file, not a folder"),
        ("taken", ["--overwrite"], "it is a file, not a folder"),
        ("linked", [], "already exists"),
        ("linked", ["--overwrite"], "--overwrite would replace the link"),
    ]
    for name, overwrite, fragment in cases:
        argv = [command, *arms, "--name", name, *overwrite, "--steps", "1", "--results", "results", *SETS]
        refused(capsys, argv, fragment)
    assert tree(workspace) == before


# ------------------------------------------------------------ class 4: a comparison's runs are its own


def test_a_run_of_a_comparison_is_trained_only_by_the_comparison(workspace, capsys):
    before = tree(workspace)
    for extra in (["--overwrite"], [], ["--name", "atr-s0"]):
        name = [] if "--name" in extra else ["--name", "grpo-s0"]
        argv = ["train", *name, *extra, "--steps", "1", "--results", "results/compare-c1/runs", *SETS]
        refused(capsys, argv, "is a run of")
    assert tree(workspace) == before


def comparison_of(results, *arms, seeds=1):
    recipe = load_recipe(None, [*COMPARE, "run.steps=2"])
    options = dict(seeds=seeds, n=2, problems=8, jobs=1, recipe=recipe, max_kl3=None, eps=None, eps_high=None)
    return plan_comparison(list(arms or ("grpo", "atr")), name=None, overwrite=False, results=results, **options)


def fake_finished_run(path, recipe):
    """A run directory as train leaves it, with `recipe` recorded (no weights: only its identity is read)."""
    run = RunDir(path)
    run.create(recipe, {})
    (run.checkpoint / "step-2").mkdir(parents=True)
    run.model.mkdir()
    return run


def test_a_kept_run_must_be_its_arm_at_its_seed(tmp_path):
    comparison = comparison_of(tmp_path)
    prepare(comparison, overwrite=False)
    grpo, atr = comparison.arms
    own = trained_recipe(comparison, grpo, 0)
    own.model.base = str(tmp_path / "bases" / "0123")  # recorded by path before bases were found by key: still its own
    fake_finished_run(comparison.directory / "runs" / "grpo-s0", own)
    check_kept_runs(comparison)
    cases = [("atr-s0", trained_recipe(comparison, grpo, 0), "algo.loss"),  # another arm's recipe
             ("atr-s0", trained_recipe(comparison, atr, 3), "run.seed"),  # another seed's
             ("atr-s0", load_recipe(None, ["algo.loss=atr", "optim.lr=1e-3"]), "optim.lr")]  # fmt: skip
    for name, foreign, differs in cases:
        fake_finished_run(comparison.directory / "runs" / name, foreign)
        with pytest.raises(UserError, match=rf"is not arm 'atr' at seed 0 \(.*{differs}.*\): move it away"):
            check_kept_runs(comparison)
        shutil.rmtree(comparison.directory / "runs" / name)


def test_a_foreign_run_in_a_comparison_is_refused_before_any_work(tmp_path, capsys):
    results = tmp_path / "results"
    comparison = comparison_of(results)
    prepare(comparison, overwrite=False)
    foreign = load_recipe(None, [*COMPARE, "run.steps=2", "algo.loss=grpo", "optim.lr=1e-3"])
    fake_finished_run(comparison.directory / "runs" / "grpo-s0", foreign)
    before = unlocked(tmp_path)
    argv = [*compare_args(results), "--n", "2"]
    refused(capsys, argv, "runs/grpo-s0 is not arm 'grpo' at seed 0 (optim.lr differ)")
    assert unlocked(tmp_path) == before and not (results / "bases").exists()  # no warm-up


# ------------------------------------------------------------ class 5: resume and bases


def test_a_comparison_names_its_base_by_preset_so_its_runs_find_it_from_where_they_are(tmp_path):
    from atrctl.experiments.compare import write_arm_recipes
    from atrctl.training.rundir import bases_folder

    comparison = comparison_of(tmp_path / "results")
    prepare(comparison, overwrite=False)
    paths = write_arm_recipes(comparison)
    assert all(load_recipe(path).model.base == "tiny" for path in paths.values())
    run = comparison.directory / "runs" / "grpo-s0"
    assert bases_folder(run, run.parent) == tmp_path / "results"  # how `train --resume <run>` finds the base
    moved = tmp_path / "moved"
    (tmp_path / "results").rename(moved)
    assert bases_folder(moved / "compare-grpo-atr" / "runs" / "grpo-s0", tmp_path / "x") == moved
    assert bases_folder(tmp_path / "elsewhere" / "run", tmp_path / "r") == tmp_path / "r"  # a run of its own


# ------------------------------------------------------------ class 6: damaged files atrctl wrote


BASE = {"identity": {}, "accuracy": 0.5, "steps": 1, "seconds": 1}
DAMAGE = [
    ("[1, 2]", "holds list, not an object"),
    ("null", "holds null"),
    ('{"identity": ', "not JSON"),
    ("\udcff", "not UTF-8 text"),
    (json.dumps({**BASE, "accuracy": "0.5"}), "'accuracy' is str"),
    (json.dumps({**BASE, "steps": True}), "'steps' is bool"),
    (json.dumps({k: v for k, v in BASE.items() if k != "identity"}), "no 'identity'"),
    (json.dumps({**BASE, "identity": {"task": "other"}}), "records another warm-up"),
]


def write_damage(path, text):
    path.write_bytes(text.encode("utf-8", "surrogateescape"))


@pytest.mark.parametrize("text, problem", DAMAGE)
@pytest.mark.parametrize("command", ["warmup", "train", "compare"])
def test_a_damaged_base_is_one_line_naming_it(tmp_path, capsys, monkeypatch, text, problem, command):
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "results" / "bases" / base_key(load_recipe(None, COMPARE))
    base.mkdir(parents=True)
    write_damage(base / "base.json", text)
    before = unlocked(tmp_path)
    argv = {"warmup": ["warmup", *SETS], "train": ["train", "--steps", "1", *SETS], "compare": compare_args("results")}
    refused(capsys, argv[command], f"base.json is damaged ({problem}")
    assert unlocked(tmp_path) == before


def test_a_base_folder_without_its_record_is_damaged_too(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "results" / "bases" / base_key(load_recipe(None, COMPARE))
    (base / "base.json").mkdir(parents=True)
    refused(capsys, ["warmup", *SETS], "base.json is damaged (a directory, not a file): delete")
    shutil.rmtree(base / "base.json")
    refused(capsys, ["warmup", *SETS], "base.json is damaged (No such file or directory)")


MARKERS = [("[]", "holds list"), ("null", "holds null"), ("{", "not JSON"), ('{"arms": []}', "no 'seeds'"),
           ('{"arms": [], "seeds": "2", "loss_args": {}, "recipe": {}}', "'seeds' is str")]  # fmt: skip


@pytest.mark.parametrize("text, problem", MARKERS)
@pytest.mark.parametrize("kind", ["compare", "sweep"])
def test_a_damaged_comparison_marker_is_named_not_taken_for_another_comparison(tmp_path, capsys, text, problem, kind):
    directory = tmp_path / ("compare-grpo-atr" if kind == "compare" else "sweep-atr-max_kl3")
    (directory / "runs").mkdir(parents=True)
    write_damage(directory / f"{kind}.json", text)
    before = tree(tmp_path)
    sweep = ["sweep", "atr", "--grid", "max_kl3=0.05,0.1", "--results", str(tmp_path), *SETS]
    refused(capsys, compare_args(tmp_path) if kind == "compare" else sweep, f"{kind}.json is damaged ({problem}")
    assert tree(tmp_path) == before


def evaluation(problems=2, n=2):
    return EvalResult([f"p{i}" for i in range(problems)], n, np.ones((problems, n), dtype=np.float32),
                      [[None] * n] * problems, np.array([True] * problems), 1.0, 7, 2.5, [])  # fmt: skip


KEY = {"model": "m", "settings": {"n": 2}}


def damaged_record(tmp_path, change):
    save_result(tmp_path, KEY, evaluation())
    record = json.loads((tmp_path / RESULT_RECORD).read_text())
    (tmp_path / RESULT_RECORD).write_text(json.dumps(change(record)))


@pytest.mark.parametrize(
    "change, problem",
    [(lambda r: [r], "holds list"), (lambda r: None, "holds null"), (lambda r: {**r, "n": "2"}, "'n' is str"),
     (lambda r: {k: v for k, v in r.items() if k != "seed"}, "no 'seed'"),
     (lambda r: {**r, "problem_ids": ["p0", "p1", "p2"]}, "'rewards' is not 3 problems x 2 samples"),
     (lambda r: {**r, "parsed": [[None]]}, "the parsed answers are not 2 problems x 2 samples")],
)  # fmt: skip
def test_a_damaged_evaluation_cache_is_damaged_file_and_never_a_traceback(tmp_path, change, problem):
    damaged_record(tmp_path, change)
    with pytest.raises(DamagedFile, match=f"is damaged \\({problem}.*evaluating again"):
        load_result(tmp_path, KEY)


def test_an_evaluation_cache_that_is_a_directory_is_refused_before_sampling(tmp_path):
    save_result(tmp_path, KEY, evaluation())
    (tmp_path / RESULT_ARRAYS).unlink()
    (tmp_path / RESULT_ARRAYS).mkdir()
    with pytest.raises(UserError, match=f"{RESULT_ARRAYS} is not a file.*remove it and rerun"):
        load_result(tmp_path, KEY)


# ------------------------------------------------------------ end to end (seconds): classes 1, 5 and 6


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """A finished small comparison grpo vs atr (1 seed, 2 steps)."""
    results = tmp_path_factory.mktemp("compared") / "results"
    assert main([*compare_args(results), "--n", "2"]) == 0
    return results


@pytest.mark.slow
def test_arms_given_as_paths_are_evaluated_under_the_comparison_never_in_the_arm(compared, tmp_path, capsys):
    theirs = compared / "compare-grpo-atr" / "runs" / "grpo-s0"  # a run of another comparison
    outside = tmp_path / "outside" / "atr-run"  # and a run outside --results, in a read-only folder
    shutil.copytree(compared / "compare-grpo-atr" / "runs" / "atr-s0", outside)
    shutil.rmtree(outside / "eval")
    mode = outside.parent.stat().st_mode
    os.chmod(outside, 0o555)
    os.chmod(outside.parent, 0o555)
    try:
        before = {
            "theirs": tree(theirs),
            "outside": tree(outside.parent),
            "report": tree(compared / "compare-grpo-atr"),
        }
        argv = ["compare", str(theirs), str(outside), "--name", "paths", "--n", "2", "--problems", "8",
                "--results", str(tmp_path / "results"), *SETS]  # fmt: skip
        assert main(argv) == 0, capsys.readouterr().err
        after = {"theirs": tree(theirs), "outside": tree(outside.parent), "report": tree(compared / "compare-grpo-atr")}
        assert after == before
    finally:
        os.chmod(outside, 0o755)
        os.chmod(outside.parent, stat.S_IMODE(mode))
    for arm in ("grpo-s0", "atr-run"):
        assert (tmp_path / "results" / "compare-paths" / "evals" / arm / "passk.csv").is_file()


@pytest.mark.slow
def test_a_moved_comparison_resumes_its_runs_and_a_damaged_cache_is_evaluated_again(compared, tmp_path, capsys, caplog):
    moved = tmp_path / "moved"
    shutil.copytree(compared, moved)
    directory = moved / "compare-grpo-atr"
    report = (directory / "passk.csv").read_bytes()
    run = RunDir(directory / "runs" / "atr-s0")
    assert run.recipe().model.base == "tiny"  # found by its key in the results folder above the comparison
    shutil.rmtree(run.model)  # interrupted before its end: resumed from its checkpoint
    (directory / "runs" / "grpo-s0" / "eval" / RESULT_RECORD).write_text("[]")
    (compared / "bases").rename(compared / "bases-away")  # the old location is gone
    try:
        capsys.readouterr()
        assert main([*compare_args(moved), "--n", "2"]) == 0
    finally:
        (compared / "bases-away").rename(compared / "bases")
    note = f"note: {directory / 'runs' / 'grpo-s0' / 'eval' / RESULT_RECORD} is damaged (holds list"
    assert note in caplog.text  # on stderr outside pytest, which takes the log over
    assert "Traceback" not in capsys.readouterr().err and run.finished
    assert (directory / "passk.csv").read_bytes() == report  # the same numbers again: resumed and re-evaluated
