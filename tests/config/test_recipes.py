"""The real-model recipes: they load, and one step of each runs end to end on a local stand-in.

The stand-in is a tiny Qwen2 built from config with the character tokenizer and a small chat
template, saved as an ordinary model directory; data come from the sample files in tests/data.
Only sizes are shrunk: the recipe's task, chat template, dtype and memory settings are kept.
"""

import json

import pytest
import torch
from helpers import DATA, REPO, qwen3_stand_in

from atrctl.cli import main
from atrctl.config.loading import load_recipe
from atrctl.model.loading import build_char_tokenizer, build_model

RECIPES = REPO / "recipes"
CASES = {"gsm8k-qwen2.5-0.5b": DATA / "gsm8k_sample.jsonl", "math-qwen2.5-1.5b": DATA / "math_sample.jsonl"}
CHAT = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A tiny Qwen2 with a chat template, in a model directory."""
    directory = tmp_path_factory.mktemp("stand-in")
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT
    build_model("tiny", tokenizer, arch="qwen2").save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("ATRCTL_THREADS", "1")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", CASES)
def test_recipe_loads_with_its_real_model(name):
    recipe = load_recipe(RECIPES / f"{name}.toml")
    assert recipe.model.base.startswith("Qwen/Qwen2.5-") and recipe.task.chat_template
    assert recipe.model.dtype == "bfloat16" and recipe.optim.lr == 1e-6 and recipe.algo.beta == 0
    assert recipe.rollout.group_size == 8 and recipe.rollout.temperature == 1.0 and recipe.algo.agg == "token-mean"
    assert recipe.rollout.prompts % (recipe.algo.minibatches * 8) == 0  # splits over up to 8 processes


def test_the_larger_recipe_saves_memory():
    recipe = load_recipe(RECIPES / "math-qwen2.5-1.5b.toml")
    assert recipe.model.gradient_checkpointing and recipe.algo.micro_batch and recipe.rollout.sample_batch
    assert recipe.rollout.max_new_tokens == 1024


@pytest.mark.parametrize("name", CASES)
def test_one_step_of_the_recipe_runs_on_a_stand_in(name, stand_in, tmp_path):
    sets = [
        f"model.base={stand_in}",
        f"task.args.path={CASES[name]}",
        f"task.args.test_path={CASES[name]}",
        "model.device=cpu",
        "rollout.prompts=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=8",
        "algo.micro_batch=3",
        "rollout.sample_batch=8",
        "eval.problems=2",
        "eval.samples=1",
        "run.steps=1",
    ]
    args = ["train", "--recipe", str(RECIPES / f"{name}.toml"), "--name", "run", "--results", str(tmp_path)]
    assert main([*args, *[item for s in sets for item in ("--set", s)]]) == 0
    run = tmp_path / "run"
    record = json.loads((run / "metrics.jsonl").read_text())
    assert record["step"] == 1 and "eval/greedy" in record and record["lr"] == pytest.approx(1e-7)  # warm-up 1/10
    assert (run / "model" / "model.safetensors").is_file() and (run / "checkpoint" / "state.json").is_file()


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_recipe_reads_and_its_algorithm_validates(path, monkeypatch):
    import importlib.util

    from atrctl.rollout import vllm_engine
    from atrctl.training.checks import validate_algo

    if importlib.util.find_spec("vllm") is None:  # whether vLLM is installed is the machine's, not the recipe's:
        monkeypatch.setattr(vllm_engine, "check_installed", lambda: None)  # the vllm leg checks it unpatched
    validate_algo(load_recipe(path))


PAPER = RECIPES / "paper-qwen3-1.7b.toml"
GPU_BYTES = 80 * 10**9  # the recipe's stated card: one 80 GB GPU
PROMPT_TOKENS = 1024  # MATH problems in Qwen3's chat template with the instruction stay well below this


def test_the_paper_recipe_is_the_papers_setting():
    recipe = load_recipe(PAPER)
    assert recipe.model.base == "Qwen/Qwen3-1.7B" and recipe.model.shard == "none" and not recipe.model.lora
    assert recipe.task.name == "math" and not recipe.task.args["path"].endswith((".jsonl", ".parquet"))  # hub name
    assert recipe.rollout.backend == "vllm" and recipe.task.chat_template and recipe.algo.beta == 0
    assert recipe.eval.benchmarks == ["aime24", "aime25", "math500"]
    assert "atrctl compare grpo:eps=0.2 atr:max_kl3=0.1 --recipe recipes/paper-qwen3-1.7b.toml" in PAPER.read_text()


def test_the_paper_recipe_fits_one_80gb_gpu_by_the_memory_model():
    """gpu_plan on Qwen3-1.7B's own config (tests/data/qwen3-1.7b: its published sizes): every part together
    within the card, and an engine cache that holds a whole group of the longest completions at once."""
    from transformers import AutoConfig

    from atrctl.model.memory import gpu_plan

    recipe = load_recipe(PAPER)
    plan = gpu_plan(AutoConfig.from_pretrained(DATA / "qwen3-1.7b"), recipe, GPU_BYTES, PROMPT_TOKENS)
    tokens = plan.pop("engine KV cache (tokens)")
    assert plan["weights, gradients and AdamW state (float32)"] == 16 * 1_720_574_976  # 1.72B parameters, tied
    assert sum(plan.values()) <= GPU_BYTES
    assert tokens >= recipe.rollout.group_size * (PROMPT_TOKENS + recipe.rollout.max_new_tokens)
    two_rows = load_recipe(PAPER, ["algo.micro_batch=2"])  # the model is not vacuous: two 9k-token rows do not fit
    assert sum(v for k, v in gpu_plan(AutoConfig.from_pretrained(DATA / "qwen3-1.7b"), two_rows, GPU_BYTES,
                                      PROMPT_TOKENS).items() if "tokens" not in k) > GPU_BYTES  # fmt: skip


def test_one_step_of_the_paper_recipe_runs_on_a_stand_in(tmp_path):
    """Everything the recipe sets but the engine (the vllm leg runs it with vLLM) and the sizes."""
    model = qwen3_stand_in(tmp_path / "qwen3", CHAT)
    data = DATA / "math_sample.jsonl"
    sets = [f"model.base={model}", f"task.args.path={data}", f"task.args.test_path={data}", "rollout.backend=hf",
            "model.device=cpu", "rollout.prompts=4", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "algo.micro_batch=3", "eval.problems=2", "eval.samples=1", "run.steps=1"]  # fmt: skip
    args = ["train", "--recipe", str(PAPER), "--name", "run", "--results", str(tmp_path)]
    assert main([*args, *[item for s in sets for item in ("--set", s)]]) == 0
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert record["step"] == 1 and "eval/greedy" in record


def test_the_paper_scale_recipe_shards_over_eight_gpus():
    recipe = load_recipe(RECIPES / "math-qwen3-8b-fsdp.toml")
    assert recipe.model.base == "Qwen/Qwen3-8B" and recipe.model.shard == "fsdp" and not recipe.model.lora
    assert recipe.model.gradient_checkpointing and recipe.algo.micro_batch and recipe.rollout.sample_batch
    assert recipe.rollout.prompts % (recipe.algo.minibatches * 8) == 0


@pytest.mark.parametrize("name", ["offpolicy", "offpolicy-countdown"])
def test_the_off_policy_recipes_reuse_each_rollout_for_sixteen_optimiser_steps(name):
    recipe = load_recipe(RECIPES / f"{name}.toml")
    assert (recipe.algo.num_iterations, recipe.algo.minibatches, recipe.run.steps) == (2, 8, 150)
    assert recipe.rollout.prompts % recipe.algo.minibatches == 0
