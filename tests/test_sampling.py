from contextlib import contextmanager

import pytest
import torch

from atrctl.errors import UserError
from atrctl.models import build_char_tokenizer, build_model
from atrctl.sampling import Rollout, completion_logprobs, decode_completions, sample

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
    kwargs = {"max_new_tokens": 12, **kwargs}
    generator = torch.Generator().manual_seed(seed)
    return sample(
        model, prompts, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, generator=generator, **kwargs
    )


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


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_match_a_full_forward_pass(model, tokenizer, prompts, temperature, top_p):
    """Old logprobs from sampling and new ones from training must agree: w = 1 on the first update."""
    with eos_bias(model, tokenizer, 2.0):
        rollout = run(model, tokenizer, prompts, temperature=temperature, top_p=top_p)
        with torch.no_grad():
            padded = completion_logprobs(model, rollout, temperature=temperature)
        torch.testing.assert_close(padded, rollout.logprobs, atol=1e-5, rtol=0)
        for row, ids in enumerate(prompts):  # and each row alone, unpadded, without cache
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
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
    ],
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
