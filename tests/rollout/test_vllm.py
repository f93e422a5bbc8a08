"""The vllm backend against atrctl's own passes, on vLLM's CPU build (skipped where vLLM is not installed).

One engine serves the module (it takes ~5 s to start and its first batch ~10 s, and vLLM's parallel state is
the process's: a second engine torn down takes the first one's with it): each test loads the weights it
samples from, which is itself what the trainer does after every update.  Its model stops at two EOS ids.
"""

import math

import pytest
import torch

from atrctl.errors import UserError
from atrctl.model.batch import Rollout
from atrctl.model.forward import completion_logprobs
from atrctl.model.loading import build_char_tokenizer, build_model
from atrctl.model.numerics import numerics
from atrctl.rollout.backend import NonFiniteProbabilities, rollout_backend
from atrctl.rollout.hf import HFSampler

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("one_cpu_thread")]

TEXTS = ["12+34=", "7+8=", "100+250=", "9+9="]
LOGPROB_TOLERANCE = 1e-5
"""float32 engine against float32 training pass, max |Δ| over every sampled token (seen: 5e-7)."""


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in TEXTS]


def small(tokenizer, seed: int = 1):
    return build_model("small", tokenizer, seed=seed).eval()  # head size 32: vLLM's CPU kernels run it


def stops(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("5")]


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = small(tokenizer)
    model.generation_config.eos_token_id = stops(tokenizer)  # the second one, as Qwen lists two
    return rollout_backend("vllm", model, tokenizer, numerics(torch.device("cpu"), autocast=False))


def sampled(engine, prompts, seed: int = 0, **settings) -> Rollout:
    settings = {"repeats": 4, "max_new_tokens": 12, **settings}
    return engine.generate(prompts, generator=torch.Generator().manual_seed(seed), **settings)


def deviation(model, rollout: Rollout, temperature: float = 1.0) -> tuple[float, float]:
    """(max, mean) |engine logprob - training pass logprob| over the completion tokens."""
    with torch.no_grad():
        mine = completion_logprobs(model, rollout, temperature)
    mask = rollout.completion_mask.bool()
    gap = (mine - rollout.logprobs).abs()[mask]
    return gap.max().item(), gap.mean().item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_its_logprobs_are_the_training_pass_on_the_same_weights(engine, tokenizer, prompts, temperature):
    model = small(tokenizer)
    engine.load_weights(model)
    rollout = sampled(engine, prompts, temperature=temperature)
    worst, mean = deviation(model, rollout, temperature)
    assert worst < LOGPROB_TOLERANCE and mean < LOGPROB_TOLERANCE / 10


def test_after_new_weights_its_logprobs_follow_them(engine, tokenizer, prompts):
    old = small(tokenizer)
    engine.load_weights(old)
    before = sampled(engine, prompts)
    new = small(tokenizer)
    with torch.no_grad():
        for parameter in new.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(7)))
    engine.load_weights(new)
    after = sampled(engine, prompts)
    assert deviation(new, after)[0] < LOGPROB_TOLERANCE
    assert deviation(old, after)[1] > 100 * LOGPROB_TOLERANCE  # not the old weights' numbers
    assert not torch.equal(before.completion_ids, after.completion_ids)


def test_the_same_generator_state_gives_the_same_tokens(engine, tokenizer, prompts):
    engine.load_weights(small(tokenizer))
    first, again, other = sampled(engine, prompts, seed=3), sampled(engine, prompts, seed=3), sampled(engine, prompts)
    assert torch.equal(first.completion_ids, again.completion_ids) and torch.equal(first.logprobs, again.logprobs)
    assert not torch.equal(first.completion_ids, other.completion_ids)
    rows = first.completion_ids.tolist()  # a prompt's samples, and the prompts, draw distinct streams
    assert len({tuple(row) for row in rows}) == len(rows)


def test_a_batch_of_more_prompt_tokens_than_one_engine_step_takes_is_seeded_and_whole(engine, tokenizer):
    """More prompt tokens than a step's budget: the CPU build rewound a CPU generator on a split prefill and
    failed ("CPU Generator does not use offset"); whole prefills sample, and reproducibly."""
    engine.load_weights(small(tokenizer))
    long = [tokenizer("+".join(str(100 + i + j) for j in range(12)) + "=")["input_ids"] for i in range(12)]
    assert sum(map(len, long)) * 64 > 8192 * 4  # a few engine steps' worth of prefill
    first = sampled(engine, long, repeats=64, max_new_tokens=3)
    again = sampled(engine, long, repeats=64, max_new_tokens=3)
    assert first.completion_ids.shape[0] == 12 * 64 and torch.equal(first.completion_ids, again.completion_ids)


def test_it_stops_at_every_eos_id_and_keeps_the_layout(engine, tokenizer, prompts):
    engine.load_weights(small(tokenizer))
    rollout = sampled(engine, prompts, repeats=8, max_new_tokens=16)
    first_eos, second_eos = stops(tokenizer)
    ended, ended_by_second = {first_eos, second_eos}, 0
    for ids, mask in zip(rollout.completion_ids.tolist(), rollout.completion_mask.tolist(), strict=True):
        length = sum(mask)
        assert mask == [1] * length + [0] * (len(mask) - length)
        body = ids[:length]
        assert not ended & set(body[:-1])  # no stop token before the last one kept
        if body[-1] in ended:
            ended_by_second += body[-1] == second_eos
            assert ids[length:] == [tokenizer.pad_token_id] * (len(ids) - length)
        else:
            assert length == 16  # the length limit
    assert ended_by_second > 0
    assert torch.equal(rollout.logprobs == 0, rollout.completion_mask == 0)  # 0 exactly where masked out
    assert rollout.prompt_ids.shape[0] == len(prompts) * 8 and rollout.prompt_mask[:, -1].all()  # left-padded


def test_greedy_gives_the_hf_samplers_greedy_tokens(engine, tokenizer, prompts):
    model = small(tokenizer)
    engine.load_weights(model)
    cpu = numerics(torch.device("cpu"), autocast=False)
    mine = HFSampler(model, tokenizer, cpu).generate(prompts, max_new_tokens=10, greedy=True)
    theirs = engine.generate(prompts, max_new_tokens=10, greedy=True)
    assert torch.equal(mine.completion_ids, theirs.completion_ids)
    torch.testing.assert_close(theirs.logprobs, mine.logprobs, atol=LOGPROB_TOLERANCE, rtol=0)


def test_lora_weights_arrive_merged(engine, tokenizer, prompts):
    pytest.importorskip("peft")
    from atrctl.model.adapters import add_adapters, lora_settings

    model = small(tokenizer)
    add_adapters(model, lora_settings({"r": 4}), seed=0)
    with torch.no_grad():  # B = 0 at the start: move it, so the adapters change the policy
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.2, generator=torch.Generator().manual_seed(5))
    engine.load_weights(model)
    rollout = sampled(engine, prompts)
    assert deviation(model, rollout)[0] < LOGPROB_TOLERANCE
    assert deviation(small(tokenizer), rollout)[1] > 100 * LOGPROB_TOLERANCE  # the base alone is not it


def test_non_finite_weights_raise_the_trainers_signal(engine, tokenizer, prompts):
    model = small(tokenizer)
    with torch.no_grad():
        model.model.norm.weight.fill_(math.nan)
    engine.load_weights(model)
    with pytest.raises(NonFiniteProbabilities):
        sampled(engine, prompts)


def test_a_head_size_the_cpu_kernels_refuse_is_one_line_before_the_engine(tokenizer):
    tiny = build_model("tiny", tokenizer, seed=0)  # head size 16
    with pytest.raises(UserError, match="does not run head size 16.*rollout.backend = 'hf'"):
        rollout_backend("vllm", tiny, tokenizer, numerics(torch.device("cpu"), autocast=False))


def test_an_engine_argument_vllm_does_not_take_is_one_line(tokenizer):
    with pytest.raises(UserError, match="rollout.engine_args"):
        rollout_backend("vllm", small(tokenizer), tokenizer, numerics(torch.device("cpu"), autocast=False),
                        {"no_such_setting": 1})  # fmt: skip


@pytest.mark.parametrize("name", ["tensor_parallel_size", "data_parallel_size", "distributed_executor_backend"])
def test_the_engines_parallelism_is_atrctls_to_set(tokenizer, name):
    with pytest.raises(UserError, match=f"rollout.engine_args: {name} is set by atrctl .* remove it"):
        rollout_backend("vllm", small(tokenizer), tokenizer, numerics(torch.device("cpu"), autocast=False), {name: 2})
