"""What several test modules share: the repository's folders, the fast recipe settings the training tests start from,
and the comparison command line the compare tests run."""

from pathlib import Path

from atrctl.config.loading import load_recipe
from atrctl.model.loading import build_char_tokenizer

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"

# A 1-digit arith task on the tiny preset, warmed up in seconds, with steps of 4 prompts × 4 completions: the base
# most training tests share (the session's warm-bases fixture builds each distinct base once).
FAST = [
    "task.args.digits=1",
    "model.device=cpu",
    "warmup.max_steps=60",
    "warmup.target_accuracy=1.0",
    "warmup.batch_size=32",
    "warmup.eval_every=60",
    "warmup.eval_problems=10",
    "rollout.prompts=4",
    "rollout.group_size=4",
    "eval.problems=10",
    "eval.samples=2",
]


def fast(*changes: str) -> list[str]:
    """FAST with a module's own `changes` after it: a later setting of a key wins."""
    return [*FAST, *changes]


def recipe_maker(settings: list[str]):
    """A module's `recipe(*overrides)`: its settings, then the test's overrides."""

    def recipe(*overrides: str):
        return load_recipe(None, [*settings, *overrides])

    return recipe


# What the comparison tests train: 2-digit arith (a base that needs a real warm-up) and two mini-batches.
COMPARE = fast(
    "task.args.digits=2",
    "warmup.max_steps=40",
    "warmup.eval_every=40",
    "algo.minibatches=2",
    "eval.problems=8",
    "eval.every=2",
)


def compare_args(results, *extra):
    """`atrctl compare grpo atr` for one seed of two steps on COMPARE, evaluated with n = 4 on 8 problems."""
    sets = [flag for item in COMPARE for flag in ("--set", item)]
    return ["compare", "grpo", "atr", "--seeds", "1", "--steps", "2", "--n", "4", "--problems", "8",
            "--results", str(results), *sets, *extra]  # fmt: skip


def offline_runs(directory):
    """Every offline W&B run in a run directory, oldest first (one per session: start, resume, evaluation)."""
    from wandb_offline import offline_run

    return [offline_run(path) for path in sorted((directory / "wandb").glob("offline-run-*/run-*.wandb"))]


def qwen3_stand_in(directory, chat_template: str):
    """Qwen3's architecture (q/k norms, grouped KV heads of size 32, which vLLM's CPU kernels take, tied embeddings)
    at a size a CPU trains in seconds, with the character tokenizer and `chat_template`, in a model directory."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = chat_template
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
