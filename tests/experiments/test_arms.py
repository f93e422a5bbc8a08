"""Arms with parameters: `LOSS[:key=value,…]` parsed, resolved against the shared recipe, refused in one line."""

import pytest

from atrctl.cli import main
from atrctl.config.loading import load_recipe
from atrctl.errors import UserError
from atrctl.experiments.arms import Arm, arm_recipe, check_distinct, parse_arm, parse_arms
from atrctl.experiments.compare import plan_comparison

LONG_ARM = "atr:max_kl3=0.1," + ",".join(
    ["optim.lr=0.0002", "algo.kl_estimator=k3", "rollout.temperature=1.0", "rollout.top_p=1.0", "algo.agg=token-mean",
     "algo.advantage=grpo", "optim.schedule=constant", "optim.grad_clip=1.0", "optim.warmup_steps=0",
     "algo.entropy_coef=0.0", "algo.beta=0.0", "algo.old_logprobs=auto"]
)  # fmt: skip
FAST = ["rollout.prompts=4", "rollout.group_size=4", "algo.minibatches=2", "model.device=cpu"]


def plan(tmp_path, *arms, **flags):
    options = dict(seeds=1, n=4, problems=8, jobs=1, max_kl3=None, eps=None, eps_high=None, name=None)
    options.update(flags)
    return plan_comparison(list(arms), recipe=load_recipe(None, FAST), overwrite=False, results=tmp_path, **options)


def test_an_arm_carries_loss_parameters_and_recipe_keys_in_the_order_given():
    arm = parse_arm("atr:max_kl3=0.05, algo.num_iterations=2,optim.schedule=cosine")
    assert arm == Arm(
        "atr:max_kl3=0.05,algo.num_iterations=2,optim.schedule=cosine",
        "atr",
        params=(("max_kl3", 0.05),),
        overrides=(("algo.num_iterations", 2), ("optim.schedule", "cosine")),
    )
    assert arm.slug == "atr_max_kl3=0.05_algo.num_iterations=2_optim.schedule=cosine"
    assert parse_arm("grpo:eps=1e-1").label == "grpo:eps=0.1"  # the label spells the value as read
    assert parse_arm("dapo") == Arm("dapo", "dapo")


def test_the_resolved_recipe_layers_defaults_shared_flags_and_the_arms_own_values():
    recipe = load_recipe(None, FAST)
    shared = {"grpo": {"eps": 0.3}}
    plain = arm_recipe(recipe, parse_arm("grpo"), "base-dir", shared)
    assert plain.algo.loss == "grpo" and plain.algo.args == {"eps": 0.3} and plain.model.base == "base-dir"
    own = arm_recipe(recipe, parse_arm("grpo:eps=0.1,algo.minibatches=4,optim.lr=1e-3"), "base-dir", shared)
    assert own.algo.args == {"eps": 0.1} and own.algo.minibatches == 4 and own.optim.lr == 1e-3
    assert (own.task, own.eval, own.run, own.warmup) == (recipe.task, recipe.eval, recipe.run, recipe.warmup)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ppo:eps=0.1", "'ppo' is not a loss"),
        ("grpo:", "nothing after ':'"),
        ("grpo:eps", "'eps' is not key=value"),
        ("grpo:eps=", "'eps=' is not key=value"),
        ("grpo:=0.1", "is not key=value"),
        ("grpo:eps=0.1,,", "is not key=value"),
        ("grpo:eps=0.1,eps=0.2", "sets eps twice"),
        ("grpo:delta=0.1", "grpo takes no parameter 'delta'; its parameters: eps=0.2, dual_clip"),
        ("atr:eps=0.1", "atr takes no parameter 'eps'; its parameters: max_kl3=0.1"),
        ("atr:algo.loss=grpo", "the arm's name is its loss"),
        ("atr:algo.args.max_kl3=0.1", "write the loss's parameter as max_kl3="),
        ("atr:task.args.digits=2", "may change only algo.*, optim.*, rollout.* keys"),
        ("atr:eval.n=3", "task, model, warm-up, eval and run are shared"),
        ("atr:algo.x.y=1", "'algo.x.y' is not a recipe key"),
        ("grpo:eps=[0.1]", "eps=[0.1] is not a number or a word"),
        ("tv-band:delta={a=1}", "is not a number or a word"),
        ("atr:max_kl3=true", "max_kl3 must be a number, got true"),
        ("atr:rollout.max_new_tokens=4", "which the evaluation of every arm uses too"),
        ("atr:rollout.backend=hf", "which the evaluation of every arm uses too"),
    ],
)
def test_every_malformed_arm_is_refused_naming_the_problem(text, message):
    with pytest.raises(UserError, match=None) as caught:
        parse_arm(text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("arms", "message"),
    [
        (["grpo:eps=-1", "atr"], "arm 'grpo:eps=-1': algo.args for 'grpo': eps must be"),
        (["grpo:eps=abc", "atr"], "arm 'grpo:eps=abc'"),
        (["grpo", "atr:max_kl3=0"], "max_kl3"),
        (["grpo", "atr:algo.minibatches=0"], "arm 'atr:algo.minibatches=0': algo.minibatches must be > 0"),
        (["grpo", "atr:algo.minibatches=3"], "must be divisible by algo.minibatches (3)"),
        (["grpo", "atr:optim.lr=fast"], "optim.lr must be a number"),
        (["grpo", "atr:algo.bogus=1"], "unknown key 'algo.bogus'"),
        (["grpo", "grpo:eps=0.2"], "arms 'grpo' and 'grpo:eps=0.2' train the same recipe"),
        (["atr:max_kl3=0.1", "atr"], "arms 'atr:max_kl3=0.1' and 'atr' train the same recipe"),
        (["grpo", "grpo:algo.minibatches=2"], "train the same recipe"),  # FAST already has 2
        (["atr:max_kl3=1", "atr:max_kl3=1.0"], "train the same recipe"),  # 1 and 1.0 are one value
        (["grpo", LONG_ARM], "its run name is"),
        (["grpo", "grpo"], "grpo is given more than once"),
        (["grpo"], "at least two arms"),
    ],
)
def test_bad_values_and_duplicates_are_refused_before_anything_is_written(tmp_path, arms, message):
    with pytest.raises(UserError) as caught:
        plan(tmp_path, *arms)
    assert message in str(caught.value), str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_shared_flags_give_way_to_an_arms_own_parameter(tmp_path):
    comparison = plan(tmp_path, "grpo", "grpo:eps=0.1", "atr:max_kl3=0.05", "atr", eps=0.3, max_kl3=0.2)
    labels = [arm.label for arm in comparison.arms]
    assert labels == ["grpo", "grpo:eps=0.1", "atr:max_kl3=0.05", "atr"]
    resolved = {
        arm.label: arm_recipe(comparison.recipe, arm, "b", comparison.loss_args).algo.args for arm in comparison.arms
    }
    assert resolved == {"grpo": {"eps": 0.3}, "grpo:eps=0.1": {"eps": 0.1}, "atr:max_kl3=0.05": {"max_kl3": 0.05},
                        "atr": {"max_kl3": 0.2}}  # fmt: skip
    assert comparison.directory.name == "compare-grpo-grpo_eps=0.1-atr_max_kl3=0.05-atr"


def test_a_default_name_too_long_for_the_filesystem_asks_for_name(tmp_path):
    arms = [f"atr:max_kl3={0.01 * i:.2f}" for i in range(1, 15)]  # each label is fine, joined they are not
    with pytest.raises(UserError, match=r"the name made of the arms' labels \(pass --name\) is \d+ bytes long"):
        plan(tmp_path, *arms)
    assert plan(tmp_path, *arms, name="short").directory == tmp_path / "compare-short"
    assert list(tmp_path.iterdir()) == []


def test_check_distinct_ignores_the_label_and_compares_what_is_trained():
    recipe = load_recipe(None, FAST)
    same = {label: arm_recipe(recipe, parse_arm(label), "b", {}) for label in ("dapo", "dapo:eps_high=0.28")}
    with pytest.raises(UserError, match="train the same recipe"):
        check_distinct(same)
    check_distinct({label: arm_recipe(recipe, parse_arm(label), "b", {}) for label in ("dapo", "dapo:eps_high=0.3")})


def test_parse_arms_refuses_two_labels_with_one_file_name():
    with pytest.raises(UserError, match="more than once"):
        parse_arms(["atr:max_kl3=0.1", "atr:max_kl3=0.1"])


def test_a_bad_arm_on_the_command_line_is_one_line_with_exit_2(tmp_path, capsys):
    assert main(["compare", "grpo:eps=0.1", "grpo:width=2", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: arm 'grpo:width=2': grpo takes no parameter 'width'") and "\n" not in err
    assert list(tmp_path.iterdir()) == []
