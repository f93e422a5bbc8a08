import contextlib
from contextlib import contextmanager

import pytest
import torch

from atrctl.errors import UserError
from atrctl.model import forward
from atrctl.model.batch import Rollout
from atrctl.model.forward import cache_argument, completion_logprobs
from atrctl.model.loading import build_char_tokenizer, build_model, enable_checkpointing
from atrctl.rollout.backend import decode_completions
from atrctl.rollout.hf import draw, sample

TEXTS = ["12+3=", "7*8=", "100-99=", "a", "(4+4)/2="]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_model("tiny", tokenizer, seed=0).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


@contextmanager
def eos_bias(model, tokenizer, bias):
    """Raise the EOS logit, so a random model ends its completions early."""
    shift = torch.zeros(len(tokenizer))
    shift[tokenizer.eos_token_id] = bias
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out + shift)
    try:
        yield
    finally:
        handle.remove()


def run(model, tokenizer, prompts, seed=0, **kwargs):
    kwargs = {"max_new_tokens": 12, "eos_id": tokenizer.eos_token_id, **kwargs}
    generator = torch.Generator().manual_seed(seed)
    return sample(model, prompts, pad_id=tokenizer.pad_token_id, generator=generator, **kwargs)


def alone_logits(model, ids):
    """Last-position logits of one unpadded sequence, no cache."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0, -1]


def test_shapes_padding_and_masks(model, tokenizer, prompts):
    prompts = prompts * 2
    with eos_bias(model, tokenizer, 1.5):
        rollout = run(model, tokenizer, prompts, max_new_tokens=16)
    batch, width = len(prompts), max(map(len, prompts))
    assert rollout.prompt_ids.shape == rollout.prompt_mask.shape == (batch, width)
    assert rollout.completion_ids.shape == rollout.completion_mask.shape == rollout.logprobs.shape
    assert rollout.completion_ids.shape[0] == batch and rollout.logprobs.dtype == torch.float32
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ended = 0
    for row, ids in enumerate(prompts):
        assert rollout.prompt_ids[row, width - len(ids) :].tolist() == ids
        assert rollout.prompt_mask[row].tolist() == [0] * (width - len(ids)) + [1] * len(ids)
        tokens, mask = rollout.completion_ids[row].tolist(), rollout.completion_mask[row].tolist()
        length = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        ended += eos in tokens
        assert mask == [1] * length + [0] * (len(tokens) - length)
        assert tokens[length:] == [pad] * (len(tokens) - length)
        assert (rollout.logprobs[row, :length] < 0).all() and (rollout.logprobs[row, length:] == 0).all()
    assert 0 < ended < batch  # the seed gives both kinds of row


def test_stops_once_every_row_has_ended(model, tokenizer, prompts):
    with eos_bias(model, tokenizer, 30.0):
        rollout = run(model, tokenizer, prompts)
    assert rollout.completion_ids.tolist() == [[tokenizer.eos_token_id]] * len(prompts)
    assert rollout.completion_mask.tolist() == [[1]] * len(prompts)


def test_mask_when_pad_is_eos(model, tokenizer, prompts):
    eos = tokenizer.eos_token_id
    with eos_bias(model, tokenizer, 3.0):
        rollout = sample(model, prompts, max_new_tokens=16, eos_id=eos, pad_id=eos,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    for tokens, mask in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist(), strict=True):
        length = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert sum(mask) == length


def test_every_eos_id_of_the_generation_config_ends_a_completion(model, tokenizer, prompts):
    from atrctl.model.numerics import Numerics
    from atrctl.rollout.hf import HFSampler, stop_tokens

    plain = sample(model, prompts, max_new_tokens=6, greedy=True, eos_id=tokenizer.eos_token_id,
                   pad_id=tokenizer.pad_token_id)  # fmt: skip
    first = plain.completion_ids[0, 0].item()  # the first greedy token of prompt 0
    assert first != tokenizer.eos_token_id and plain.completion_mask[0].sum() > 1
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]  # as Qwen lists two
    try:
        assert stop_tokens(model, tokenizer) == [tokenizer.eos_token_id, first]
        sampler = HFSampler(model, tokenizer, Numerics(torch.device("cpu"), torch.float32, None))
        stopped = sampler.generate(prompts, max_new_tokens=6, greedy=True)
    finally:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    assert stopped.completion_mask[0].tolist()[:2] == [1, 0]  # ended at once, the stop token counted
    assert torch.equal(stopped.completion_ids[:, 0], plain.completion_ids[:, 0])  # the same greedy tokens


def test_seeded_generator_makes_sampling_deterministic(model, tokenizer, prompts):
    first, second = run(model, tokenizer, prompts, seed=7), run(model, tokenizer, prompts, seed=7)
    other = run(model, tokenizer, prompts, seed=8)
    assert torch.equal(first.completion_ids, second.completion_ids)
    assert torch.equal(first.logprobs, second.logprobs)
    assert not torch.equal(first.completion_ids, other.completion_ids)


def test_greedy_is_the_step_by_step_argmax_without_cache(model, tokenizer, prompts):
    rollout = run(model, tokenizer, prompts[:2], greedy=True, max_new_tokens=8)
    for row, ids in enumerate(prompts[:2]):
        ids = list(ids)
        for token in rollout.completion_ids[row].tolist():
            assert token == alone_logits(model, ids).argmax().item()
            ids.append(token)


@pytest.mark.parametrize(("temperature", "top_p", "repeats"), [(1.0, 1.0, 1), (0.7, 0.9, 1), (0.7, 1.0, 3)])
def test_logprobs_match_a_full_forward_pass(model, tokenizer, prompts, temperature, top_p, repeats):
    """Old logprobs from sampling and new ones from training must agree: w = 1 on the first update.
    With repeats, both sides share each prompt's work across its group."""
    with eos_bias(model, tokenizer, 2.0):
        rollout = run(model, tokenizer, prompts, temperature=temperature, top_p=top_p, repeats=repeats)
        with torch.no_grad():
            padded = completion_logprobs(model, rollout, temperature=temperature)
        torch.testing.assert_close(padded, rollout.logprobs, atol=1e-5, rtol=0)
        rows = [ids for ids in prompts for _ in range(repeats)]
        for row, ids in enumerate(rows):  # and each row alone, unpadded, without cache
            n = int(rollout.completion_mask[row].sum())
            completion = rollout.completion_ids[row, :n].tolist()
            with torch.no_grad():
                logits = model(torch.tensor([ids + completion]), use_cache=False).logits[0, len(ids) - 1 : -1]
            alone = torch.log_softmax(logits.float() / temperature, -1).gather(-1, torch.tensor(completion)[:, None])
            torch.testing.assert_close(rollout.logprobs[row, :n], alone[:, 0], atol=1e-5, rtol=0)


def test_left_padding_does_not_change_results(model, tokenizer, prompts):
    batched = run(model, tokenizer, prompts, greedy=True)
    for row, ids in enumerate(prompts):
        alone = run(model, tokenizer, [ids], greedy=True)
        width = alone.completion_ids.shape[1]
        assert batched.completion_ids[row, :width].tolist() == alone.completion_ids[0].tolist()
        torch.testing.assert_close(batched.logprobs[row, :width], alone.logprobs[0], atol=1e-5, rtol=0)


def test_tiny_top_p_keeps_only_the_top_token(model, tokenizer, prompts):
    greedy = run(model, tokenizer, prompts, greedy=True)
    nucleus = run(model, tokenizer, prompts, top_p=1e-6)
    assert torch.equal(nucleus.completion_ids, greedy.completion_ids)


def test_decode_completions_stops_at_eos(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ids = tokenizer("42")["input_ids"]
    rollout = Rollout(
        prompt_ids=torch.tensor([[5], [5]]),
        prompt_mask=torch.ones(2, 1, dtype=torch.long),
        completion_ids=torch.tensor([ids + [eos, pad], ids + [tokenizer.bos_token_id, 5]]),
        completion_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
        logprobs=torch.zeros(2, 4),
    )
    assert decode_completions(tokenizer, rollout) == ["42", "421"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top_p")],
)
def test_bad_settings_are_user_errors(model, tokenizer, prompts, kwargs, message):
    with pytest.raises(UserError, match=message):
        run(model, tokenizer, prompts, **kwargs)


def test_empty_prompt_is_a_user_error(model, tokenizer):
    with pytest.raises(UserError, match="prompt"):
        run(model, tokenizer, [[4], []])


def test_rollout_tensors_can_enter_a_training_graph(model, tokenizer, prompts):
    """Sampling runs under inference_mode; what it returns must still mix with tensors that need grad."""
    rollout = run(model, tokenizer, prompts, max_new_tokens=4)
    new = completion_logprobs(model, rollout)
    ratio = torch.exp(new - rollout.logprobs)
    (ratio * rollout.logprobs * rollout.completion_mask).sum().backward()
    assert model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)


# ------------------------------------------------------------- groups share their prompt's work


def test_repeats_share_the_prefill_and_sample_like_repeated_prompts(model, tokenizer, prompts):
    """One prefill per distinct prompt, copied to its G rows, samples what G copies of the prompt would."""
    group = 4
    with eos_bias(model, tokenizer, 1.0):
        shared = run(model, tokenizer, prompts, repeats=group)
        copied = run(model, tokenizer, [ids for ids in prompts for _ in range(group)])
    assert shared.completion_ids.shape[0] == len(prompts) * group
    assert torch.equal(shared.prompt_ids, copied.prompt_ids) and torch.equal(shared.prompt_mask, copied.prompt_mask)
    assert torch.equal(shared.completion_ids, copied.completion_ids)
    assert torch.equal(shared.completion_mask, copied.completion_mask)
    torch.testing.assert_close(shared.logprobs, copied.logprobs, atol=1e-5, rtol=0)
    assert len({tuple(row) for row in shared.completion_ids[:group].tolist()}) > 1  # the group's samples differ


def grouped_rollout(model, tokenizer, prompts, group=3):
    with eos_bias(model, tokenizer, 1.0):
        return run(model, tokenizer, prompts, repeats=group, max_new_tokens=10)


def logprobs_and_grad(model, rollout, weights):
    """Logprobs of the rollout and the gradient of sum(weights * logprobs) w.r.t. every parameter."""
    model.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, rollout)
    (logp * weights).sum().backward()
    return logp.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prompt_pass_equals_one_pass_per_row_in_value_and_gradient(tokenizer, prompts, arch):
    """The training pass runs a group's prompt once and its completions on the cached prompt: same
    function as a full pass per row, so the same logprobs and the same gradient (float noise aside)."""
    model = build_model("tiny", tokenizer, arch=arch, seed=3).train()
    rollout = grouped_rollout(model, tokenizer, prompts)
    weights = torch.randn(rollout.completion_ids.shape, generator=torch.Generator().manual_seed(1))
    shared, shared_grad = logprobs_and_grad(model, rollout, weights)
    alone, alone_grad = [], [torch.zeros_like(p) for p in model.parameters()]
    for row in range(rollout.completion_ids.shape[0]):  # one row: nothing to share, the plain full pass
        part = Rollout(*(getattr(rollout, f)[row : row + 1] for f in Rollout.__dataclass_fields__))
        logp, grad = logprobs_and_grad(model, part, weights[row : row + 1])
        alone.append(logp)
        alone_grad = [a + g for a, g in zip(alone_grad, grad, strict=True)]
    torch.testing.assert_close(shared, torch.cat(alone), atol=1e-5, rtol=0)
    for got, want in zip(shared_grad, alone_grad, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert max(g.abs().max().item() for g in shared_grad) > 1e-3  # a real gradient was compared


def test_activation_checkpointing_takes_the_single_pass_with_the_same_result(tokenizer, prompts):
    model = build_model("tiny", tokenizer, seed=3).train()
    rollout = grouped_rollout(model, tokenizer, prompts)
    weights = torch.ones(rollout.completion_ids.shape)
    plain, plain_grad = logprobs_and_grad(model, rollout, weights)
    enable_checkpointing(model)
    checkpointed, checkpointed_grad = logprobs_and_grad(model, rollout, weights)
    torch.testing.assert_close(checkpointed, plain, atol=1e-5, rtol=0)
    for got, want in zip(checkpointed_grad, plain_grad, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_cpu_draw_follows_the_probabilities_and_never_picks_a_zero():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 2.0], [1.0, 1.0, 0.0, 1.0, 1.0]])
    draws = torch.stack([draw(probs, torch.Generator().manual_seed(seed)) for seed in range(20_000)])
    counts = torch.stack([torch.bincount(draws[:, row], minlength=5) for row in range(3)]).double() / len(draws)
    expected = probs / probs.sum(-1, keepdim=True)  # unnormalised rows are fine
    assert (counts[expected == 0] == 0).all()
    # 20,000 draws: the standard error of a frequency is at most 0.0036, so 0.015 is over 4 of them
    torch.testing.assert_close(counts, expected.double(), atol=0.015, rtol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_draw_refuses_probabilities_that_are_not_finite(bad):
    with pytest.raises(RuntimeError, match="not finite"):
        draw(torch.tensor([[0.5, 0.5], [bad, 0.1]]), torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="all zero"):
        draw(torch.tensor([[0.0, 0.0]]), torch.Generator().manual_seed(0))


def test_the_preallocated_cache_samples_what_a_growing_cache_samples(model, tokenizer, prompts, monkeypatch):
    from transformers import DynamicCache

    import atrctl.rollout.hf as sampling

    with eos_bias(model, tokenizer, 1.0):
        written_in_place = run(model, tokenizer, prompts, repeats=2, max_new_tokens=20)
        monkeypatch.setattr(sampling, "preallocated_cache", lambda model, capacity: DynamicCache(config=model.config))
        concatenated = run(model, tokenizer, prompts, repeats=2, max_new_tokens=20)
    assert torch.equal(written_in_place.completion_ids, concatenated.completion_ids)
    # attention over the preallocated width sums its (zero) masked terms too, in other blocks: a few float32
    # ulps apart (seen: 1.4e-6 on a logprob of -2.75 with PyTorch's AVX2 kernels), not a different function
    torch.testing.assert_close(written_in_place.logprobs, concatenated.logprobs, atol=1e-6, rtol=1e-6)


def test_rows_with_equal_ids_but_different_masks_do_not_share_a_prompt(tokenizer):
    """A real leading token can equal the pad id: grouping must look at the mask as well."""
    model = build_model("tiny", tokenizer, seed=3).eval()
    pad, a, b = tokenizer.pad_token_id, 20, 21
    ids = torch.tensor([[pad, a, b], [pad, a, b], [pad, a, b]])
    rollout = Rollout(
        ids,
        torch.tensor([[1, 1, 1], [0, 1, 1], [0, 1, 1]]),
        torch.tensor([[a, b]] * 3),
        torch.ones(3, 2, dtype=torch.long),
        torch.zeros(3, 2),
    )
    with torch.no_grad():
        shared = completion_logprobs(model, rollout)
        for row in range(3):
            part = Rollout(*(getattr(rollout, f)[row : row + 1] for f in Rollout.__dataclass_fields__))
            torch.testing.assert_close(shared[row : row + 1], completion_logprobs(model, part), atol=1e-5, rtol=0)
    assert not torch.allclose(shared[0], shared[1])  # the two prompts really differ


def test_a_model_that_ignores_the_cache_gets_the_single_pass(tokenizer, prompts, monkeypatch):
    """If checkpointing goes undetected the cache stays empty: the completions must not run without
    their prompt."""
    model = build_model("tiny", tokenizer, seed=3).train()
    rollout = grouped_rollout(model, tokenizer, prompts)
    weights = torch.ones(rollout.completion_ids.shape)
    plain, _ = logprobs_and_grad(model, rollout, weights)
    enable_checkpointing(model)
    monkeypatch.setattr(forward, "is_checkpointing", lambda model: False)
    undetected, _ = logprobs_and_grad(model, rollout, weights)
    torch.testing.assert_close(undetected, plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_cpu_decode_attention_equals_sdpa(tokenizer, prompts, monkeypatch, kv_heads):
    """The one-query attention used for decoding on CPU samples what sdpa samples (grouped KV heads, padded rows)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from atrctl.rollout import hf as sampling

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    config = Qwen2Config(
        vocab_size=len(tokenizer), num_key_value_heads=kv_heads, pad_token_id=tokenizer.pad_token_id, **shape
    )
    model = Qwen2ForCausalLM(config).eval()
    calls = []
    decode = sampling._cpu_decode_attention
    monkeypatch.setattr(sampling, "_cpu_decode_attention", lambda *a, **k: calls.append(1) or decode(*a, **k))
    ours = run(model, tokenizer, prompts, repeats=2, max_new_tokens=10)
    assert calls and model.config._attn_implementation == "sdpa"  # it ran, and the model is as it was
    monkeypatch.setattr(sampling, "decode_attention", lambda model: contextlib.nullcontext())
    theirs = run(model, tokenizer, prompts, repeats=2, max_new_tokens=10)
    assert torch.equal(ours.completion_ids, theirs.completion_ids)
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-6, rtol=0)


# ------------------------------------------------------------- finished rows leave the batch


def batch_sizes(model):
    """A forward hook's record of how many rows each call of `model` runs."""
    seen = []
    return seen, model.register_forward_hook(lambda module, args, kwargs, out: seen.append(len(kwargs["input_ids"])),
                                             with_kwargs=True)  # fmt: skip


@pytest.mark.parametrize(
    "kwargs", [{}, {"temperature": 0.7, "top_p": 0.9}, {"repeats": 3}, {"greedy": True}, {"eos_id": [2, 9]}]
)
def test_finished_rows_leave_the_batch_without_changing_the_samples(model, tokenizer, prompts, kwargs, monkeypatch):
    """Dropping ended rows keeps every row's tokens (the CPU draws each row's uniform from the whole batch's)
    and logprobs; the decode steps run on fewer rows, never carrying more than COMPACT_AT of them ended."""
    from atrctl.rollout import hf
    from atrctl.rollout.hf import COMPACT_AT

    kwargs = {"eos_id": tokenizer.eos_token_id, **kwargs}
    prompts = prompts * 4
    with eos_bias(model, tokenizer, 1.5):  # sampled or greedy, rows end at different steps
        seen, hook = batch_sizes(model)
        try:
            compacted = sample(model, prompts, max_new_tokens=24, pad_id=tokenizer.pad_token_id,
                               generator=torch.Generator().manual_seed(3), **kwargs)  # fmt: skip
        finally:
            hook.remove()
        monkeypatch.setattr(hf, "COMPACT_AT", float("inf"))  # no share of ended rows is enough: none leaves
        kept = sample(model, prompts, max_new_tokens=24, pad_id=tokenizer.pad_token_id,
                      generator=torch.Generator().manual_seed(3), **kwargs)  # fmt: skip
    assert torch.equal(compacted.completion_ids, kept.completion_ids)
    assert torch.equal(compacted.completion_mask, kept.completion_mask)
    # a matrix product over fewer rows rounds its last bits differently (2e-6 seen): float32 noise on ~3 nats
    torch.testing.assert_close(compacted.logprobs, kept.logprobs, atol=1e-5, rtol=0)
    rows, lengths = compacted.completion_ids.shape[0], compacted.completion_mask.sum(1)
    assert seen[0] == len(prompts)  # the prefill, once per prompt
    still = [int((lengths > step).sum()) for step in range(1, compacted.completion_ids.shape[1])]
    for step, (batch, decoding) in enumerate(zip(seen[1:], still, strict=True), start=1):
        assert decoding <= batch and batch - decoding < COMPACT_AT * batch, (step, batch, decoding)
    assert seen[-1] < rows  # the batch did shrink


def test_the_cache_drops_rows_as_a_cache_rebuilt_from_those_rows(model, tokenizer, prompts):
    """PreallocatedLayer.batch_select_indices gathers the kept rows' filled positions into new buffers: the
    next step's logits equal those of a batch that only ever held the kept rows."""
    from atrctl.rollout.hf import preallocated_cache

    ids, mask = (torch.tensor([[5, 6, 7, 8]] * 4) + torch.arange(4)[:, None]), torch.ones(4, 4, dtype=torch.long)
    keep = torch.tensor([1, 3])
    with torch.inference_mode():
        cache = preallocated_cache(model, capacity=8)
        model(input_ids=ids, attention_mask=mask, **cache_argument(model, cache))
        cache.batch_select_indices(keep)
        step = torch.tensor([[9], [10]])
        after = model(input_ids=step, attention_mask=torch.ones(2, 5, dtype=torch.long),
                      position_ids=torch.tensor([[4], [4]]), **cache_argument(model, cache)).logits[:, -1]  # fmt: skip
        fresh = preallocated_cache(model, capacity=8)
        model(input_ids=ids[keep], attention_mask=mask[keep], **cache_argument(model, fresh))
        direct = model(input_ids=step, attention_mask=torch.ones(2, 5, dtype=torch.long),
                       position_ids=torch.tensor([[4], [4]]), **cache_argument(model, fresh)).logits[:, -1]  # fmt: skip
    assert cache.get_seq_length() == 5
    torch.testing.assert_close(after, direct, atol=1e-6, rtol=0)


def test_a_cache_whose_layers_keep_other_state_keeps_every_row(model, tokenizer, prompts, monkeypatch):
    """Only layers whose batch_select_indices drops all they keep let rows leave: a cache of plain DynamicLayers
    (standing in for a hybrid model's linear-attention layers) decodes every row to the end."""
    from transformers import DynamicCache

    import atrctl.rollout.hf as sampling

    assert sampling.can_drop_rows(sampling.preallocated_cache(model, capacity=4))
    assert not sampling.can_drop_rows(DynamicCache(config=model.config))
    monkeypatch.setattr(sampling, "preallocated_cache", lambda model, capacity: DynamicCache(config=model.config))
    with eos_bias(model, tokenizer, 1.5):
        seen, hook = batch_sizes(model)
        try:
            rollout = run(model, tokenizer, prompts * 4, max_new_tokens=24)
        finally:
            hook.remove()
    assert rollout.completion_mask.sum(1).min() < rollout.completion_ids.shape[1]  # rows did end early
    assert set(seen) == {len(prompts) * 4}


def test_the_character_tokenizer_decodes_a_batch_as_row_by_row(tokenizer):
    from atrctl.rollout.backend import _decodes_as_its_backend

    assert _decodes_as_its_backend(tokenizer)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, len(tokenizer), (50, 12), generator=generator)  # specials and <unk> included
    lengths = torch.randint(0, 13, (50,), generator=generator)
    mask = (torch.arange(12)[None, :] < lengths[:, None]).long()
    rollout = Rollout(ids[:, :1], torch.ones(50, 1, dtype=torch.long), ids, mask, torch.zeros(50, 12))
    expected = [
        tokenizer.decode(row[:n], skip_special_tokens=True)
        for row, n in zip(ids.tolist(), lengths.tolist(), strict=True)
    ]
    assert decode_completions(tokenizer, rollout) == expected
    assert any(len(text) > 5 for text in expected)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer, monkeypatch):
    """transformers post-processes a decode when clean_up_tokenization_spaces is set (" ." -> "."): the batched
    backend call would skip that, so such a tokenizer decodes row by row."""
    from atrctl.rollout.backend import _decodes_as_its_backend

    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert not _decodes_as_its_backend(tokenizer)
    ids = torch.tensor([tokenizer("1 . 2")["input_ids"]])
    rollout = Rollout(ids[:, :1], torch.ones(1, 1, dtype=torch.long), ids, torch.ones_like(ids), torch.zeros(ids.shape))
    assert decode_completions(tokenizer, rollout) == [tokenizer.decode(ids[0].tolist(), skip_special_tokens=True)]


# ------------------------------------------------------------- bf16 autocast keeps its weight casts


def weight_casts(linears, make):
    """How many times `make()` converted a Linear weight to another dtype: profiled conversions whose input has a
    weight's 2-D shape (the activations are 3-D).  A dispatch mode would not see them under inference_mode."""
    from torch.profiler import ProfilerActivity, profile

    shapes = [[list(w.shape)] for w in linears]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        made = make()
    events = [e for e in profiler.events() if e.name == "aten::_to_copy" and e.input_shapes[:1] in shapes]
    return made, len(events)


def test_under_bf16_autocast_each_weight_is_cast_once_a_rollout_and_nothing_changes(model, tokenizer, prompts):
    """Under inference_mode autocast casts every weight at every decoding step; the sampler keeps its casts
    (`sampling._without_grad`), and a cast kept is the cast made again: the same tokens and logprobs."""
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # no row ends early: six forward passes
        kept, casts = weight_casts(linears, lambda: run(model, tokenizer, prompts, max_new_tokens=6, eos_id=99))
    assert kept.completion_ids.shape[1] == 6
    assert casts == len(linears)  # once each, not six times
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        recast = run(model, tokenizer, prompts, max_new_tokens=6, eos_id=99)
    assert torch.equal(kept.completion_ids, recast.completion_ids)
    assert torch.equal(kept.logprobs, recast.logprobs)


@pytest.mark.parametrize(
    ("autocast", "compiled", "keeps"), [(True, False, True), (True, True, False), (False, False, False)]
)
def test_casts_are_kept_only_where_that_won(autocast, compiled, keeps):
    """no_grad (casts kept) for eager sampling under autocast; inference_mode, cheaper, everywhere else."""
    from atrctl.rollout.hf import _without_grad

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        mode = _without_grad(torch.device("cpu"), compiled)
    assert isinstance(mode, torch.no_grad) is keeps
    assert isinstance(mode, torch.inference_mode) is not keeps
