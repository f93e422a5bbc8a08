"""The training forward pass projects only completion tokens to the vocabulary, a chunk at a time: the same
logprobs, entropy and gradients as the plain full-logits log_softmax, without a [rows, T, vocab] tensor."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from atrctl.model import forward
from atrctl.model.batch import Rollout, position_ids
from atrctl.model.forward import cache_argument, completion_logprobs_and_entropy, selective_log_softmax

VOCAB = 3001


def small_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, num_attention_heads=4, num_key_value_heads=2))
    return Qwen2ForCausalLM(Qwen2Config(**shape, num_attention_heads=4, num_key_value_heads=2))


def group_rollout(seed: int = 0, groups: int = 3, group: int = 4, prompt: int = 6, completion: int = 9) -> Rollout:
    """Groups of rows sharing a left-padded prompt, with completions of different lengths (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(1, VOCAB, (groups, prompt), generator=g)
    prompt_mask = torch.ones(groups, prompt, dtype=torch.long)
    for row in range(groups):
        prompt_mask[row, : row * 2] = 0  # different left padding per group
    prompt_ids = (prompt_ids * prompt_mask).repeat_interleave(group, 0)
    prompt_mask = prompt_mask.repeat_interleave(group, 0)
    rows = groups * group
    lengths = torch.randint(1, completion + 1, (rows,), generator=g)
    completion_mask = (torch.arange(completion)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(1, VOCAB, (rows, completion), generator=g) * completion_mask
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(rows, completion))


def plain(model, rollout: Rollout, temperature: float):
    """The reference: one pass over prompt + completion, float32 log_softmax of the whole [B, T, vocab] (the
    pass before chunking took with activation checkpointing, or where no prompt is shared)."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    width = rollout.completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask), logits_to_keep=width + 1).logits
    logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, -1)
    logp = logp_all.gather(-1, rollout.completion_ids[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp * rollout.completion_mask, entropy * rollout.completion_mask


def todays(model, rollout: Rollout, temperature: float):
    """The reference: the pass before chunking (atrctl 0b7dc18), a group's prompt run once and its
    completions on the prompt's cache, then float32 log_softmax of the whole [B, T, vocab]."""
    from transformers import DynamicCache

    from atrctl.model.batch import equal_runs

    prompt, prompt_mask, completion = rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids
    mask = torch.cat([prompt_mask, rollout.completion_mask], dim=1)
    positions = position_ids(mask)
    first_rows, counts = equal_runs(torch.cat([prompt, prompt_mask], dim=1))
    width = prompt.shape[1]
    cache = DynamicCache(config=model.config)
    head = model(
        input_ids=prompt[first_rows],
        attention_mask=prompt_mask[first_rows],
        position_ids=positions[first_rows, :width],
        **cache_argument(model, cache),
        logits_to_keep=1,
    ).logits[:, -1]
    owner = torch.repeat_interleave(torch.arange(len(counts)), counts)
    cache.batch_select_indices(owner)
    end = width + completion.shape[1] - 1
    rest = model(
        input_ids=completion[:, :-1],
        attention_mask=mask[:, :end],
        position_ids=positions[:, width:end],
        **cache_argument(model, cache),
    ).logits
    logits = torch.cat([head[owner][:, None], rest], dim=1).float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, completion[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp * rollout.completion_mask, entropy * rollout.completion_mask


def values_and_gradients(function, model, rollout):
    model.zero_grad(set_to_none=True)
    logp, entropy = function()
    g = torch.Generator().manual_seed(7)
    weights = torch.randn(logp.shape, generator=g), torch.randn(logp.shape, generator=g)
    ((logp * weights[0]).sum() + (entropy * weights[1]).sum()).backward()
    return logp.detach(), entropy.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_todays_full_log_softmax_with_gradients(monkeypatch, arch, temperature):
    model, rollout = small_model(arch), group_rollout()
    monkeypatch.setattr(forward, "CHUNK_BYTES", 4 * VOCAB * 7)  # 7 tokens a chunk: many chunks, one partial
    want = values_and_gradients(lambda: todays(model, rollout, temperature), model, rollout)
    got = values_and_gradients(lambda: completion_logprobs_and_entropy(model, rollout, temperature), model, rollout)
    # 1e-6 relative: the entropy is ~ln(vocab) ~ 8, where one float32 ulp is 9.5e-7, and the head's matrix
    # product over 7 rows may round differently from one over all rows (the CPU's GEMM blocking differs,
    # seen on AVX-512 machines: 2-4 ulp), so an absolute 1e-6 would demand one ulp.
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)
    for key, grad in want[2].items():  # float32 summation-order noise is relative to the tensor's scale
        error = (got[2][key] - grad).abs().max() / grad.abs().max()
        assert error < 1e-5, f"{key}: max |difference| is {error:.2e} of max |gradient|"
    assert torch.equal(got[0] == 0, rollout.completion_mask == 0)  # 0 exactly where masked


def test_no_tensor_holds_the_logits_of_every_token(monkeypatch):
    """Every tensor made in the forward and backward pass is far smaller than [rows, T, vocab]."""
    model, rollout = small_model("llama"), group_rollout(groups=6, group=8, completion=16)
    monkeypatch.setattr(forward, "CHUNK_BYTES", 4 * VOCAB * 64)  # 64 tokens: more than the hidden size, 48
    largest = LargestTensor()
    with largest:
        logp, entropy = completion_logprobs_and_entropy(model, rollout)
        (logp.sum() + entropy.sum()).backward()
    full = rollout.completion_ids.numel() * VOCAB
    assert largest.numel <= 64 * VOCAB < full / 10  # one chunk's logits (the head's [vocab, 48] is smaller)


def test_the_plain_path_would_have_held_them():
    """The check above can fail: the full log_softmax makes a [rows, T, vocab] tensor."""
    model, rollout = small_model("llama"), group_rollout(groups=6, group=8, completion=16)
    largest = LargestTensor()
    with largest:
        plain(model, rollout, 1.0)[0].sum().backward()
    assert largest.numel >= rollout.completion_ids.numel() * VOCAB


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation returns."""

    numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


def test_a_model_whose_logits_are_not_the_projection_keeps_its_logits(monkeypatch):
    """A model that transforms its logits after the head (soft-capping, scaling) is not split: it gets the
    full-logits path, with the log_softmax still chunked."""
    model, rollout = small_model("llama"), group_rollout()
    head = model.lm_head
    monkeypatch.setattr(model, "lm_head", torch.nn.Sequential(head, torch.nn.Tanh()))  # soft-capped logits
    monkeypatch.setattr(model, "get_output_embeddings", lambda: head)  # as a soft-capping model reports it
    assert not forward.head_is_linear(model)
    want = plain(model, rollout, 1.0)
    with torch.no_grad():
        got = completion_logprobs_and_entropy(model, rollout)
    torch.testing.assert_close(got[0], want[0].detach(), atol=1e-6, rtol=0)
    assert forward.head_is_linear(small_model("llama"))


def test_selective_log_softmax_of_nothing_is_zeros():
    states = torch.randn(2, 3, 5, requires_grad=True)
    logp, entropy = selective_log_softmax(
        states, torch.nn.Identity(), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3)
    )
    assert torch.equal(logp, torch.zeros(2, 3)) and torch.equal(entropy, torch.zeros(2, 3))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_cache_argument_reaches_the_installed_transformers_cache(arch):
    """The keyword changed (past_key_values, then cache) and a wrong one is swallowed by **kwargs: a prefill
    through `cache_argument` must fill the cache, and a step on it must give the full pass's next logits."""
    from transformers import DynamicCache

    model = small_model(arch).eval()
    ids = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :4], **cache_argument(model, cache))
        assert cache.get_seq_length() == 4
        step = model(input_ids=ids[:, 4:], position_ids=torch.tensor([[4], [4]]), **cache_argument(model, cache))
        whole = model(input_ids=ids, use_cache=False)
    torch.testing.assert_close(step.logits[:, -1], whole.logits[:, -1], rtol=1e-5, atol=1e-5)
