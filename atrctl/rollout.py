"""The rollout seam: the batch a rollout produces, its layout, and the backends that produce it.

Layout every backend keeps (the training forward pass, `atrctl.forward`, relies on it):
- Prompts are left-padded; position ids count real tokens only (cumsum of the mask - 1), so a padded
  row gives the same logits as the prompt alone.
- Rows are prompt-major: the `repeats` completions of a prompt are consecutive rows (a GRPO group).
- A completion includes its EOS (masked in); everything after it is `pad_id` and masked out.
- `logprobs` are log_softmax(logits.float() / temperature) at the sampled token (temperature 1 when
  greedy), 0 where masked; top_p truncation is not part of them, as in TRL.

A backend is anything with the `RolloutBackend` methods; `ROLLOUT_BACKENDS` maps the recipe's
`rollout.backend` to it as "module:Class", imported only when chosen, so an engine with heavy
dependencies (vLLM, say) costs nothing to the runs that do not use it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from atrctl.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from atrctl.models import Numerics


@dataclass
class Rollout:
    """A batch of prompts with one sampled completion each (layout above); all tensors on the model's device."""

    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long, 1 for real prompt tokens
    completion_ids: torch.Tensor  # [B, T] long, pad_id after EOS
    completion_mask: torch.Tensor  # [B, T] long, 1 up to and including EOS
    logprobs: torch.Tensor  # [B, T] float32, 0 where completion_mask is 0


def left_pad(
    sequences: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of shape [B, longest], real tokens flush right."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise UserError("every prompt needs at least one token: check the task's prompts and tokenizer")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def position_ids(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip padding, so left padding does not shift the rotary phases."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def decode_completions(tokenizer: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    """Each completion's text, up to (not including) its EOS, without special tokens."""
    lengths = rollout.completion_mask.sum(-1).tolist()
    rows = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), lengths, strict=True)]
    if _decodes_as_its_backend(tokenizer):  # one call into the Rust tokenizer instead of one per row
        return tokenizer.backend_tokenizer.decode_batch(rows, skip_special_tokens=True)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]


def _decodes_as_its_backend(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer.decode` returns exactly its Rust backend's decode: a fast tokenizer whose decoding
    is transformers' own (no subclass override) and that cleans up no spaces afterwards.  Per-row decode
    costs ~6 µs of Python a row, 2-4x the batched call (the default recipe's 512 rows: ~3 ms of a tiny
    model's ~180 ms step on a 2-core CPU)."""
    from transformers import PreTrainedTokenizerFast

    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and not tokenizer.clean_up_tokenization_spaces
    )


class NonFiniteProbabilities(RuntimeError):
    """A backend raises this when the policy's next-token probabilities are NaN or infinite: the policy has
    diverged, which the trainer turns into a clean stop instead of a crash."""


class RolloutBackend(Protocol):
    """What the trainer and the evaluators need from a generation engine.

    Built as `Backend(model, tokenizer, numerics)` by `rollout_backend`.
    """

    @property
    def logprobs_reusable(self) -> bool:
        """Whether `algo.old_logprobs = auto` may take `Rollout.logprobs` as an off-policy update's ratio
        denominator instead of recomputing them: they are the probabilities the tokens were drawn from, and
        either equal the training pass's to float noise or were measured to serve the update as well."""
        ...

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        repeats: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        """`repeats` completions per prompt (rows prompt-major); the same generator state gives the same tokens.
        Raises NonFiniteProbabilities when the policy's probabilities are not finite."""
        ...

    def load_weights(self, model: PreTrainedModel) -> None:
        """Take the policy's new weights (after an optimiser step) before the next `generate`."""
        ...


# name -> "module:Class" of a RolloutBackend, imported when a recipe picks it.
ROLLOUT_BACKENDS: dict[str, str] = {"hf": "atrctl.sampling:HFSampler"}


def rollout_backend(
    name: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, numerics: Numerics
) -> RolloutBackend:
    """The backend registered as `name`, generating with `model`."""
    if name not in ROLLOUT_BACKENDS:
        raise UserError(f"rollout.backend = {name!r} is not registered; use one of {', '.join(ROLLOUT_BACKENDS)}")
    module, cls = ROLLOUT_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(model, tokenizer, numerics)
