"""Prompt styles: the task's text, its answer instruction, the chat template and a system prompt, one path."""

import pytest

from atrctl.cli import main
from atrctl.errors import UserError
from atrctl.model.loading import build_char_tokenizer
from atrctl.rollout.prompts import PLAIN, PromptStyle, encode_prompts, prompt_style, prompt_text
from atrctl.tasks import Problem, get_task

CHAT = (
    "{% if messages[0]['role'] != 'system' %}system: the default\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture
def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT
    return tokenizer


def test_the_plain_style_is_the_task_prompt_as_written():
    tokenizer = build_char_tokenizer()
    assert prompt_text(tokenizer, "1+1=", PLAIN) == "1+1="
    with pytest.raises(UserError, match="tokenizer has none"):
        prompt_text(tokenizer, "1+1=", PromptStyle(chat_template=True))


def test_chat_template_system_prompt_and_instruction(chat_tokenizer):
    assert prompt_text(chat_tokenizer, "1+1=", PromptStyle(True)) == "system: the default\nuser: 1+1=\nassistant: "
    styled = PromptStyle(True, system_prompt="Be brief.", instruction="Answer: N")
    assert prompt_text(chat_tokenizer, "What is 1 + 1?", styled) == (
        "system: Be brief.\nuser: What is 1 + 1?\nAnswer: N\nassistant: "
    )
    ids = encode_prompts(chat_tokenizer, [Problem("p", "1+1=", "2", "2")], PromptStyle(True))
    assert chat_tokenizer.decode(ids[0]) == "system: the default\nuser: 1+1=\nassistant: "  # no BOS added twice


def test_auto_takes_the_task_formats_instruction():
    instruct, compact = get_task("arith", format="instruct"), get_task("arith")
    assert prompt_style(instruct, False).instruction == instruct.instruction != ""
    assert prompt_style(compact, False).instruction == ""
    assert prompt_style(instruct, False, instruction="").instruction == ""
    assert prompt_style(instruct, False, instruction="Just the number.").instruction == "Just the number."
    with pytest.raises(UserError, match="system prompt needs the chat template"):
        prompt_style(instruct, False, system_prompt="Be brief.")


def test_every_task_has_an_instruct_format_in_words():
    arith = get_task("arith", digits=2, format="instruct").problems("test", 3, 0)
    assert all(p.prompt.startswith("What is ") and p.prompt.endswith("?") for p in arith)
    countdown = get_task("countdown", format="instruct").problems("test", 3, 0)
    assert all(p.prompt.startswith("Using the numbers ") for p in countdown)
    for task, problems in (("arith", arith), ("countdown", countdown)):
        scorer = get_task(task, **({"digits": 2} if task == "arith" else {}), format="instruct")
        assert all(scorer.score(p, p.solution).reward == 1.0 for p in problems)  # its worked solution reads right
    with pytest.raises(UserError, match="format='chatty' is invalid"):
        get_task("arith", format="chatty")


def test_eval_refuses_a_system_prompt_without_the_chat_template(tmp_path, capsys):
    argv = ["eval", str(tmp_path), "--task", "arith", "--max-new-tokens", "4", "--system-prompt", "Be brief."]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "system prompt needs the chat template" in err and "\n" not in err.strip()
    assert list(tmp_path.iterdir()) == []


def test_a_recipe_with_a_system_prompt_but_no_chat_template_is_refused():
    from atrctl.config.loading import load_recipe

    with pytest.raises(UserError, match="task.system_prompt needs the chat template"):
        load_recipe(None, ["task.system_prompt=Be brief."])
    assert load_recipe(None, ["task.system_prompt=Be brief.", "task.chat_template=true"]).task.system_prompt
