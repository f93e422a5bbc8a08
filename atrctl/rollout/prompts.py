"""How a problem's prompt becomes what the model reads: the task's text, its answer instruction, and the
chat template with an optional system prompt.

One path for warm-up, training, held-out checks and `atrctl eval`, so a model is always scored on the
prompts it was trained on.  The task writes the problem (its `format`); the recipe's [task] keys decide
the rest: `instruction` ("auto": the format's own, e.g. "put your final answer within \\boxed{}"; "": none),
`chat_template`, and `system_prompt` ("": the template's own default, which many templates inject).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from atrctl.errors import UserError

AUTO = "auto"


@dataclass(frozen=True)
class PromptStyle:
    """What wraps every prompt of a run or an evaluation (the instruction already resolved)."""

    chat_template: bool = False
    system_prompt: str = ""  # "": the chat template's default
    instruction: str = ""  # appended on a line of its own after the problem

    def describe(self) -> str:
        """A short account for reports: 'chat template, system prompt "…", instruction "…"'."""
        parts = ["chat template" if self.chat_template else "no chat template"]
        if self.system_prompt:
            parts.append(f"system prompt {self.system_prompt!r}")
        if self.instruction:
            parts.append(f"instruction {self.instruction!r}")
        return ", ".join(parts)


PLAIN = PromptStyle()  # the prompt as the task wrote it: what the compact formats and the presets use


def prompt_style(task, chat_template: bool, system_prompt: str = "", instruction: str = AUTO) -> PromptStyle:
    """The style for `task`, its "auto" instruction resolved; a system prompt without a chat template is a
    UserError (there is nowhere to put it)."""
    if system_prompt and not chat_template:
        raise UserError(
            "a system prompt needs the chat template: set task.chat_template = true (eval: --chat-template)"
        )
    return PromptStyle(chat_template, system_prompt, task.instruction if instruction == AUTO else instruction)


def prompt_text(tokenizer, prompt: str, style: PromptStyle) -> str:
    """The text the model reads for one problem prompt."""
    text = f"{prompt}\n{style.instruction}" if style.instruction else prompt
    if not style.chat_template:
        return text
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("chat template requested but the tokenizer has none: turn chat_template off")
    messages = [{"role": "system", "content": style.system_prompt}] if style.system_prompt else []
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(tokenizer, problems: Sequence, style: PromptStyle = PLAIN) -> list[list[int]]:
    """Token ids of each problem's prompt; a chat template already carries its special tokens."""
    texts = [prompt_text(tokenizer, p.prompt, style) for p in problems]
    return [tokenizer(text, add_special_tokens=not style.chat_template)["input_ids"] for text in texts]


def model_positions(model) -> int | None:
    """The positions a model can attend over (None where its config does not say)."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def check_lengths(prompt_ids: Sequence[list[int]], max_new_tokens: int, positions: int | None, flag: str) -> None:
    """Refuse, before any sampling, prompts that with `max_new_tokens` would run past the model's `positions`
    (some architectures index out of range there, others silently degrade)."""
    longest = max((len(ids) for ids in prompt_ids), default=0)
    if positions is not None and longest + max_new_tokens > positions:
        raise UserError(
            f"the longest prompt ({longest} tokens) plus {flag} ({max_new_tokens}) exceeds the model's {positions} "
            f"positions: lower {flag} or use shorter problems"
        )
