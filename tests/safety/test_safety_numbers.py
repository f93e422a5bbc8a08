"""Numbers at the edges and checks that used to come late: each is refused in one line, exit code 2, before a
byte is written or a base warmed up (issue 48, classes 9 and 10)."""

import pytest
from test_safety import refused, tree, workspace  # noqa: F401 - workspace is a fixture

from atrctl import numbers
from atrctl.config.loading import load_recipe
from atrctl.errors import UserError

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

TRAIN = ["train", "--name", "fresh", "--steps", "1", "--device", "cpu"]
COMPARE = ["compare", "--seeds", "1", "--steps", "1", "--n", "2", "--problems", "2", "--set", "model.device=cpu"]


def refused_untouched(workspace, capsys, argv, fragment):  # noqa: F811
    before = tree(workspace)
    refused(capsys, argv, fragment)
    assert tree(workspace) == before


# ------------------------------------------------------------ sampling numbers


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--temperature", "1e-45"], "--temperature must be at least 0.001"),
        (["--temperature", "0.0009"], "--temperature must be at least 0.001"),
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--top-p", "1e-320"], "--top-p must be in [1.18e-38, 1]"),
        (["--top-p", "1.5"], "--top-p must be in"),
        (["--seed", "-1"], "--seed must be an integer from 0 to 2^63 - 1"),
        (["--seed", str(2**64)], "--seed must be an integer from 0 to 2^63 - 1"),
        (["--seed", str(2**63)], "--seed must be an integer from 0 to 2^63 - 1"),
    ],
)
def test_eval_refuses_sampling_numbers_that_break_the_sampler(workspace, capsys, argv, fragment):  # noqa: F811
    refused_untouched(workspace, capsys, ["eval", "results/good", "--device", "cpu", *argv], fragment)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("eval.temperature=1e-45", "eval.temperature must be at least 0.001"),
        ("rollout.temperature=1e-45", "rollout.temperature must be at least 0.001"),
        ("rollout.top_p=1e-320", "rollout.top_p must be in [1.18e-38, 1]"),
        ("rollout.top_p=0", "rollout.top_p must be in"),
        ("eval.seed=18446744073709551616", "eval.seed must be an integer from 0 to 2^63 - 1"),
        ("run.seed=-1", "run.seed must be an integer from 0 to 2^63 - 1"),
    ],
)
@pytest.mark.parametrize("command", ["train", "compare"])
def test_recipe_sampling_numbers_are_refused_before_anything(workspace, capsys, override, fragment, command):  # noqa: F811
    argv = [*TRAIN] if command == "train" else [*COMPARE, "grpo", "atr"]
    refused_untouched(workspace, capsys, [*argv, "--set", override], fragment)


def test_the_floors_themselves_are_accepted():
    recipe = load_recipe(None, ["rollout.temperature=0.001", f"rollout.top_p={numbers.MIN_TOP_P!r}", "eval.seed=0"])
    assert recipe.rollout.temperature == numbers.MIN_TEMPERATURE and recipe.rollout.top_p == numbers.MIN_TOP_P
    assert numbers.seed(2**63 - 1, "--seed") == 2**63 - 1


# ------------------------------------------------------- loss parameters: numbers only


STRINGS = ['"0.05"', '"０.２"', '"٠.١"', "０.２", "٠.١", '"1_0"', "true"]


@pytest.mark.parametrize("value", STRINGS)
def test_a_loss_parameter_that_is_a_string_is_refused_in_a_recipe(workspace, capsys, value):  # noqa: F811
    refused_untouched(workspace, capsys, [*TRAIN, "--set", f"algo.args.max_kl3={value}"], "must be a number, got")


@pytest.mark.parametrize("value", STRINGS)
def test_a_loss_parameter_that_is_a_string_is_refused_in_an_arm(workspace, capsys, value):  # noqa: F811
    refused_untouched(workspace, capsys, [*COMPARE, "grpo", f"atr:max_kl3={value}"], "max_kl3 must be a number")


def test_the_string_and_the_number_are_not_two_arms(workspace, capsys):  # noqa: F811
    refused_untouched(workspace, capsys, [*COMPARE, 'atr:max_kl3="0.10"', "atr:max_kl3=0.1"], "must be a number")


@pytest.mark.parametrize(
    ("arm", "fragment"),
    [
        ('atr:max_kl3="0.05"', "max_kl3 must be a number, got the string '0.05'"),
        ('dapo:eps_high="1_0"', "eps_high must be a number, got the string '1_0'"),
        ("atr:max_kl3=０.２", "max_kl3 must be a number"),
        ("divergence:measure=1", "measure must be a word"),
        ("atr:algo.num_iterations=2", "not recipe keys (algo.num_iterations)"),
        ("grpo:eps=0.1,optim.lr=1e-3", "not recipe keys (optim.lr)"),
        ("atr:max_kl3=1e-16", "max_kl3 must be at least 1e-14"),
        ("atr:max_kl3=1e-300", "max_kl3 must be at least 1e-14"),
        ("grpo:eps=1e-320", "cannot tell from 1"),
        ("divergence:measure=ratio,delta=1e-17", "cannot tell from 1"),
    ],
)
@pytest.mark.parametrize("to", ["trl", "verl"])
def test_export_refuses_what_it_would_drop_or_print_as_nan(capsys, arm, fragment, to):
    refused(capsys, ["export", arm, "--to", to], fragment)


@pytest.mark.parametrize("to", ["trl", "verl"])
def test_export_never_prints_an_infinite_or_nan_bound(capsys, to):
    from atrctl.cli import main

    for arm in ("divergence:measure=kl1", "reverse-kl3:delta=2", "atr:max_kl3=1e-14", "atr"):
        assert main(["export", arm, "--to", to]) == 0
        out = capsys.readouterr().out
        assert "inf" not in out.replace("info", "") and "nan" not in out, out


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("algo.args.max_kl3=1e-16", "max_kl3 must be at least 1e-14"),
        ("algo.args.max_kl3=1e-17", "max_kl3 must be at least 1e-14"),
    ],
)
def test_a_trust_region_too_small_to_clip_is_refused_before_training(workspace, capsys, override, fragment):  # noqa: F811
    refused_untouched(workspace, capsys, [*TRAIN, "--set", override], fragment)


def test_max_kl3_flag_too_small_is_refused_in_compare(workspace, capsys):  # noqa: F811
    refused_untouched(workspace, capsys, [*COMPARE, "grpo", "atr", "--max-kl3", "1e-16"], "at least 1e-14")


def test_numbers_refuses_strings_booleans_and_non_finite_values():
    for value in ("0.1", True, float("nan"), float("inf"), [0.1], None):
        with pytest.raises(UserError, match="must be a"):
            numbers.number(value, "x")
    assert numbers.number(3, "x") == 3 and numbers.number(0.5, "x") == 0.5


# ------------------------------------------------------------------ nesting depth


DEEP_LIST = "[" * 3000 + "]" * 3000
DEEP_TABLE = "{a=" * 3000 + "1" + "}" * 3000


@pytest.mark.parametrize(
    "argv",
    [
        [*TRAIN, "--set", f"task.args.x={DEEP_LIST}"],
        [*TRAIN, "--set", f"task.args.x={DEEP_TABLE}"],
        [*TRAIN, "--set", "task.args.x=" + "[" * 100 + "]" * 100],
        [*TRAIN, "--set", "task.args" + ".a" * 3000 + "=1"],
        [*COMPARE, "grpo", f"atr:optim.lr={DEEP_LIST}"],
        ["eval", "results/good", "--task-arg", f"x={DEEP_LIST}"],
    ],
)
def test_a_value_nested_thousands_deep_is_one_line(workspace, capsys, argv):  # noqa: F811
    refused_untouched(workspace, capsys, argv, "nests lists or tables too deeply")


def test_a_recipe_file_nested_thousands_deep_is_one_line(workspace, capsys):  # noqa: F811
    (workspace / "deep.toml").write_text(f"[task]\nargs = {{x = {DEEP_LIST}}}\n")
    refused_untouched(workspace, capsys, [*TRAIN, "--recipe", str(workspace / "deep.toml")], "too deeply")


def test_lists_and_tables_of_ordinary_depth_are_accepted():
    recipe = load_recipe(
        None, ['model.lora={r = 4, target_modules = ["q_proj"]}', "task.args.x=" + "[" * 15 + "]" * 15]
    )
    assert recipe.model.lora["r"] == 4


# ------------------------------------------------------- sizes that cannot fit


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("rollout.group_size=100000000", "lower rollout.group_size or rollout.prompts"),
        ("rollout.prompts=1000000000000", "lower rollout.group_size or rollout.prompts"),
        ("eval.samples=100000000", "lower eval.samples or eval.problems"),
        ("eval.problems=100000000000", "lower eval.samples or eval.problems"),
        ("model.lora={r=100000000}", "model.lora.r = 100000000 is above the model's width (64)"),
        ("model.lora={r=65}", "is above the model's width (64)"),
    ],
)
@pytest.mark.parametrize("command", ["train", "compare"])
def test_sizes_that_cannot_fit_are_refused_before_any_work(workspace, capsys, override, fragment, command):  # noqa: F811
    argv = [*TRAIN] if command == "train" else [*COMPARE, "grpo", "atr"]
    refused_untouched(workspace, capsys, [*argv, "--set", override], fragment)
    assert not (workspace / "outer" / "cwd" / "results" / "bases").exists()


@pytest.mark.parametrize("threads", ["1000000000", "abc", "0", "-1", "２", "1.5", str(2**70)])
@pytest.mark.parametrize("command", ["train", "compare", "warmup"])
def test_atrctl_threads_is_checked_by_the_command_before_it_writes(workspace, capsys, monkeypatch, threads, command):  # noqa: F811
    monkeypatch.setenv("ATRCTL_THREADS", threads)
    argv = {"train": TRAIN, "compare": [*COMPARE, "grpo", "atr"], "warmup": ["warmup", "--set", "model.device=cpu"]}
    refused_untouched(workspace, capsys, argv[command], "ATRCTL_THREADS")


def test_atrctl_threads_within_the_cpus_is_taken(monkeypatch):
    from atrctl.runtime.machine import requested_threads, usable_cpus

    monkeypatch.setenv("ATRCTL_THREADS", str(usable_cpus()))
    assert requested_threads() == usable_cpus()
    monkeypatch.delenv("ATRCTL_THREADS")
    assert requested_threads() is None


# ------------------------------------------------------ checks before a warm-up


LONG = "x" * 600


@pytest.mark.parametrize(
    "overrides",
    [
        [f'task.instruction="{LONG}"'],
        ["rollout.max_new_tokens=600"],
        ["rollout.max_new_tokens=500", "task.args.digits=9"],
    ],
)
@pytest.mark.parametrize("command", ["train", "compare"])
def test_a_prompt_past_the_presets_positions_is_refused_before_its_warm_up(workspace, capsys, overrides, command):  # noqa: F811
    argv = [*TRAIN] if command == "train" else [*COMPARE, "grpo", "atr"]
    sets = [part for override in overrides for part in ("--set", override)]
    refused_untouched(workspace, capsys, [*argv, *sets], "exceeds the model's 512 positions")
    assert not (workspace / "outer" / "cwd" / "results" / "bases").exists()


@pytest.mark.parametrize("edit", [("warmup", "seed", 7), ("warmup", "max_steps", 61), ("task", "instruction", "")])
def test_a_resume_whose_warm_up_key_changed_is_refused_before_a_base_is_warmed(workspace, capsys, edit):  # noqa: F811
    import dataclasses
    import json

    from atrctl.config.loading import recipe_to_dict, to_toml
    from atrctl.training.checkpoint import TrainState

    recorded = recipe_to_dict(load_recipe(None, ["model.device=cpu", "warmup.max_steps=60"]))
    run = workspace / "outer" / "cwd" / "results" / "old"
    (run / "checkpoint").mkdir(parents=True)
    state = TrainState(step=1, recipe=recorded)
    (run / "checkpoint" / "state.json").write_text(json.dumps(dataclasses.asdict(state)))
    section, key, value = edit
    (run / "config.toml").write_text(to_toml({**recorded, section: {**recorded[section], key: value}}))
    refused_untouched(workspace, capsys, ["train", "--resume", "results/old"], f"{section}.{key}:")
    assert not (workspace / "outer" / "cwd" / "results" / "bases").exists()


@pytest.mark.parametrize("grid", ['max_kl3="0.05",0.1', "max_kl3=０.２,0.1", 'max_kl3=0.1,"0.10"', "max_kl3=1e-16,0.1"])
def test_a_sweep_grid_value_is_checked_like_an_arms(workspace, capsys, grid):  # noqa: F811
    argv = ["sweep", "atr", "--grid", grid, "--seeds", "1", "--steps", "1", "--set", "model.device=cpu"]
    refused_untouched(workspace, capsys, argv, "max_kl3")


def test_an_arm_label_keeps_a_string_a_string():
    from atrctl.experiments.arms import arm_text, format_value

    assert format_value("0.05") == '"0.05"' and format_value("kl1") == "kl1" and format_value(0.05) == "0.05"
    assert arm_text("divergence", [("measure", "kl1"), ("delta", 0.1)]) == "divergence:measure=kl1,delta=0.1"


@pytest.mark.parametrize(
    ("arm", "fragment"),
    [
        ("kl-band:delta=1e-20", "delta must be a finite number from 1e-08 to 5"),
        ("kl-band:delta=1e-300", "delta must be a finite number from 1e-08 to 5"),
        ("kl-band:delta=1e300", "delta must be a finite number from 1e-08 to 5"),
        ("tv-band:delta=1e-320", "delta must be a finite number at least 1e-07"),
    ],
)
def test_a_band_whose_bounds_would_be_nan_or_cross_1_is_refused(workspace, capsys, arm, fragment):  # noqa: F811
    refused_untouched(workspace, capsys, [*COMPARE, "grpo", arm], fragment)
    refused(capsys, ["export", arm], fragment)


@pytest.mark.parametrize(
    ("loss", "params"),
    [
        ("atr", {"max_kl3": "0.1"}),
        ("dapo", {"eps_high": "1_0"}),
        ("grpo", {"eps": "０.２"}),
        ("cispo", {"eps_high": "٠.١"}),
        ("grpo", {"dual_clip": "3"}),
        ("kl-band", {"delta": "0.1"}),
        ("tv-band", {"delta": True}),
    ],
)
def test_the_python_losses_take_no_string_for_a_number(loss, params):
    from atrctl.core.losses import check_loss

    with pytest.raises((TypeError, ValueError), match="must be a number"):
        check_loss(loss, **params)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        (f'task.instruction="{LONG}"', "exceeds the model's 512 positions"),
        ("model.lora={r=100000000}", "above the model's width"),
        ("rollout.group_size=100000000", "lower rollout.group_size"),
    ],
)
def test_warmup_refuses_what_training_its_recipe_would_before_warming(workspace, capsys, override, fragment):  # noqa: F811
    refused_untouched(workspace, capsys, ["warmup", "--set", "model.device=cpu", "--set", override], fragment)
