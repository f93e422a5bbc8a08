"""Recipes: defaults, TOML, --set overrides, and errors that name the key."""

import pytest

from atrctl.config.loading import load_recipe, parse_override, recipe_from_dict
from atrctl.config.schema import Recipe
from atrctl.errors import UserError


def test_shipped_default_recipe_is_the_default():
    recipe = load_recipe("recipes/default.toml")
    assert recipe.task.name == "arith" and recipe.task.args == {"digits": 3, "ops": "+"}
    assert recipe.model.base == "tiny" and recipe.warmup.target_accuracy == 0.2
    defaults = Recipe()
    for section in ("model", "warmup", "rollout", "algo", "optim", "eval", "run"):
        assert getattr(recipe, section) == getattr(defaults, section), section


def test_overrides_apply_in_order_and_read_toml_values():
    recipe = load_recipe(
        "recipes/default.toml",
        ["task.args.digits=2", "warmup.lr=1e-3", "model.device=cpu", "warmup.lr=5e-4", "task.chat_template=true"],
    )
    assert recipe.task.args["digits"] == 2 and recipe.task.args["ops"] == "+"
    assert recipe.warmup.lr == 5e-4 and recipe.model.device == "cpu" and recipe.task.chat_template is True
    assert parse_override("model.base=results/bases/x") == (["model", "base"], "results/bases/x")
    assert parse_override("warmup.max_steps = 10") == (["warmup", "max_steps"], 10)


def test_ints_are_accepted_for_floats():
    assert recipe_from_dict({"warmup": {"lr": 1}}).warmup.lr == 1.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("warmup.lrr=1", "unknown key 'warmup.lrr'; did you mean 'warmup.lr'?"),
        ("modle.base=tiny", "unknown section '[modle]'; did you mean 'model'?"),
        ("warmup.batch_size=1.5", "warmup.batch_size must be an integer, got 1.5"),
        ("warmup.seed=true", "warmup.seed must be an integer, got the boolean True"),
        ("warmup.lr=-1", "warmup.lr must be > 0"),
        ("warmup.target_accuracy=1.5", "warmup.target_accuracy must be in (0, 1]"),
        ("model.arch=gpt2", "model.arch = 'gpt2' is not one of llama, qwen2"),
        ("algo.old_logprobs=cache", "algo.old_logprobs = 'cache' is not one of auto, sampler, recompute"),
        ("model.base=1", "model.base must be a string"),
        ("lr=1", "write section.key=value"),
        ("warmup.lr", "write section.key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(UserError) as error:
        load_recipe("recipes/default.toml", [override])
    assert message in str(error.value)


def test_bad_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_recipe(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[task\nname = 1")
    with pytest.raises(UserError, match="not valid TOML"):
        load_recipe(broken)
