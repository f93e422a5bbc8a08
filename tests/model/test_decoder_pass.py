"""atrctl's own decoder pass (what `model.compile` compiles) computes transformers' function: the same states
and gradients for Llama and Qwen2, shared prompts or not, LoRA included; models it does not reproduce keep
transformers' forward; one compilation serves every micro-batch shape."""

import logging

import pytest
import torch
from test_forward import group_rollout, small_model, values_and_gradients
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from atrctl.errors import UserError
from atrctl.model import decoder_pass, forward
from atrctl.model.decoder_pass import compilable, decoder_inputs, decoder_states, rotary, supports
from atrctl.model.forward import cache_argument, completion_logprobs_and_entropy
from atrctl.model.loading import enable_checkpointing
from atrctl.training.sharding import check_can_shard


def transformers_states(model, rollout):
    """The eager path: transformers' decoder on the prompt once per group, then the completions on its cache."""
    return forward._completion_outputs(model.get_decoder(), rollout, lambda out: out.last_hidden_state, False)


def ours(model, rollout):
    return decoder_states(model, decoder_inputs(model, rollout))


def states_and_gradients(function, model, rollout):
    model.zero_grad(set_to_none=True)
    states = function(model, rollout)
    weights = torch.randn(states.shape, generator=torch.Generator().manual_seed(3))
    (states * weights * rollout.completion_mask[..., None]).sum().backward()  # masked: padding's states are unused
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return states.detach() * rollout.completion_mask[..., None], grads


def assert_same_function(model, rollout):
    want_states, want_grads = states_and_gradients(transformers_states, model, rollout)
    got_states, got_grads = states_and_gradients(ours, model, rollout)
    torch.testing.assert_close(got_states, want_states, atol=1e-6, rtol=1e-6)
    assert set(got_grads) == set(want_grads)
    for name, grad in want_grads.items():  # float32 summation-order noise, relative to the tensor's scale
        error = (got_grads[name] - grad).abs().max() / grad.abs().max()
        assert error < 1e-5, f"{name}: max |difference| is {error:.2e} of max |gradient|"


ROLLOUTS = {
    "groups share a left-padded prompt": dict(groups=3, group=4),
    "every row its own prompt": dict(groups=5, group=1, prompt=10),  # left padding up to 8 of 10
    "completions of one token": dict(groups=2, group=3, completion=1),
}


# `_attend`'s two ways: attention written out (short sequences, these tests' own) and SDPA (long ones)
ATTENTION = {"written out": 10**9, "sdpa": 0}


@pytest.fixture(params=list(ATTENTION))
def attention(request, monkeypatch):
    monkeypatch.setattr(decoder_pass, "MATH_ATTENTION_MAX", ATTENTION[request.param])
    return request.param


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shape", list(ROLLOUTS))
def test_states_and_gradients_equal_transformers(arch, shape, attention):
    model = small_model(arch)  # 4 query heads over 2 KV heads: grouped-query attention
    assert supports(model)
    assert_same_function(model, group_rollout(seed=1, **ROLLOUTS[shape]))


def test_qwen2s_attention_biases_are_applied():
    model = small_model("qwen2")
    with torch.no_grad():
        for layer in model.get_decoder().layers:
            layer.self_attn.q_proj.bias.normal_()  # Qwen2's q/k/v biases start at 0: make them count
            layer.self_attn.k_proj.bias.normal_()
    assert_same_function(model, group_rollout(seed=2))


def test_lora_adapters_inside_the_projections_still_apply():
    from atrctl.model.adapters import add_adapters

    model = small_model("llama")
    add_adapters(model, {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}, seed=0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.1)  # B starts at 0: the adapters would change nothing
    model.train()
    assert supports(model)
    assert_same_function(model, group_rollout(seed=3))


def test_bf16_autocast_stays_within_bf16_rounding_of_transformers(attention):
    model, rollout = small_model("llama"), group_rollout(seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = transformers_states(model, rollout), ours(model, rollout)
    mask = rollout.completion_mask[..., None]
    assert want.dtype == got.dtype
    error = ((got.float() - want.float()) * mask).abs().max() / (want.float() * mask).abs().max()
    assert error < 2e-2, f"max |difference| is {error:.2e} of max |state|"  # a few bf16 ulps (2^-8 = 3.9e-3)


def unsupported_models():
    shape = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    sliding = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, sliding_window=4))
    checkpointed = small_model("llama")
    enable_checkpointing(checkpointed)
    dynamic_rope = small_model("llama")
    dynamic_rope.get_decoder().rotary_emb.rope_type = "dynamic"  # its table changes with the sequence length
    dropout = small_model("llama")
    dropout.config.attention_dropout = 0.1
    dropout.train()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2))
    return {"sliding window": sliding, "checkpointing": checkpointed, "dynamic rope": dynamic_rope,
            "attention dropout while training": dropout, "gpt2": gpt2}  # fmt: skip


def test_models_it_does_not_reproduce_are_refused_and_train_eagerly(caplog):
    for name, model in unsupported_models().items():
        assert not supports(model), name
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="atrctl"):
            assert not compilable(model)
        assert "it runs eagerly" in caplog.text, name


def test_compile_with_fsdp_fails_before_any_work():
    with pytest.raises(UserError, match="model.compile = false"):
        check_can_shard("fsdp", 2, lora=False, compiled=True)


def transformers_logprobs(model, rollout):
    """completion_logprobs_and_entropy on transformers' path: `model` is not registered as compiled here."""
    states = transformers_states(model, rollout)
    return forward.selective_log_softmax(
        states, model.get_output_embeddings(), rollout.completion_ids, rollout.completion_mask
    )


def counting_compiler(monkeypatch, name: str, function, backend: str):
    """`decoder_pass`'s compiled `name` replaced by `function` compiled through a counter of compilations."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = {name: decoder_pass.compile_dynamic(function, backend=counter)}
    monkeypatch.setattr(decoder_pass, "_COMPILED_FUNCTIONS", compiled)
    return counter


def test_micro_batches_with_a_size_of_one_run_the_same_function_eagerly(monkeypatch):
    """Sizes 0 and 1 would each compile again: one row, one prompt, a one-token prompt, two-token completions."""
    counter = counting_compiler(monkeypatch, "states", decoder_states, "eager")
    model = small_model("llama")
    assert compilable(model)
    for shape in [dict(groups=1, group=4), dict(groups=1, group=1), dict(groups=1, group=3, prompt=1),
                  dict(groups=2, group=3, completion=2)]:  # fmt: skip
        rollout = group_rollout(seed=5, **shape)
        want = values_and_gradients(lambda r=rollout: transformers_logprobs(model, r), model, rollout)
        got = values_and_gradients(
            lambda r=rollout: completion_logprobs_and_entropy(model, r, compiled=True), model, rollout
        )
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    assert counter.frame_count == 0
    completion_logprobs_and_entropy(model, group_rollout(seed=5), compiled=True)  # every size >= 2: compiled
    assert counter.frame_count >= 1


@pytest.mark.slow
def test_one_inductor_compilation_serves_every_micro_batch_shape_with_the_eager_values(monkeypatch):
    """What model.compile runs (inductor's generated kernels) gives transformers' logprobs, entropy and
    gradients while rows, prompt width and completion width change between micro-batches, compiling once."""
    counter = counting_compiler(monkeypatch, "states", decoder_states, "inductor")
    model = small_model("qwen2")
    model.get_decoder().layers = model.get_decoder().layers[:1]  # one layer compiles in half the time
    model.config.num_hidden_layers = 1
    assert compilable(model)
    compiled = []  # frames compiled after each shape (the first shape's include an empty one)
    # the first shape's 12 rows equal head_dim (48 / 4): under torch's duck sizing they shared a symbol, and
    # the second shape compiled again
    for seed, shape in enumerate([dict(groups=3, group=4, prompt=6, completion=9),
                                  dict(groups=2, group=3, prompt=11, completion=5),
                                  dict(groups=4, group=2, prompt=7, completion=14)]):  # fmt: skip
        rollout = group_rollout(seed=seed, **shape)
        want = values_and_gradients(lambda r=rollout: transformers_logprobs(model, r), model, rollout)
        got = values_and_gradients(
            lambda r=rollout: completion_logprobs_and_entropy(model, r, compiled=True), model, rollout
        )
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
        for name, grad in want[2].items():  # fused kernels sum in another order: relative to the tensor's scale
            error = (got[2][name] - grad).abs().max() / grad.abs().max()
            assert error < 1e-5, f"{name}: max |difference| is {error:.2e} of max |gradient|"
        compiled.append(counter.frame_count)
    assert compiled[0] >= 1 and compiled[1:] == compiled[:1] * 2  # nothing recompiled for the new shapes
    assert sum(len(graph.graph.nodes) > 0 for graph in counter.graphs) == 1  # one graph: no break inside
    # past SUMMED_ATTENTION_MAX the attention's products are matrix products: one more compilation, same values
    monkeypatch.setattr(decoder_pass, "SUMMED_ATTENTION_MAX", 0)
    rollout = group_rollout(seed=3, groups=2, group=3, prompt=5, completion=6)
    want = values_and_gradients(lambda: transformers_logprobs(model, rollout), model, rollout)
    got = values_and_gradients(lambda: completion_logprobs_and_entropy(model, rollout, compiled=True), model, rollout)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for name, grad in want[2].items():
        assert (got[2][name] - grad).abs().max() / grad.abs().max() < 1e-5, name
    assert counter.frame_count == compiled[0] + 1


# ------------------------------------------------------------------ the sampler's decoding step


def transformers_step(model, prompt_ids, prompt_mask, token):
    """Prefill then one decoding step through transformers (the sampler's cache and attention): the
    step's logits, and the cache's keys and values before and after it."""
    from atrctl.rollout.hf import decode_attention, preallocated_cache

    cache = preallocated_cache(model, prompt_ids.shape[1] + 2)
    positions = forward.position_ids(prompt_mask)
    with torch.no_grad(), decode_attention(model):
        model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, **cache_argument(model, cache))
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        mask = torch.cat([prompt_mask, torch.ones_like(prompt_mask[:, :1])], dim=1)
        step = positions[:, -1:] + 1
        logits = model(
            input_ids=token[:, None], attention_mask=mask, position_ids=step, **cache_argument(model, cache)
        ).logits[:, -1]
    after = [(layer.keys, layer.values) for layer in cache.layers]
    return logits, before, after, mask, step


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_prefill_equals_transformers_prefill_on_left_padded_prompts(arch, attention):
    from atrctl.rollout.hf import preallocated_cache

    model = small_model(arch).eval()
    rollout = group_rollout(seed=7, groups=3, group=1)  # three distinct prompts, padded 0, 2 and 4 tokens
    prompt_ids, prompt_mask = rollout.prompt_ids, rollout.prompt_mask
    positions = forward.position_ids(prompt_mask)
    cache = preallocated_cache(model, prompt_ids.shape[1])
    with torch.no_grad():
        want = model(
            input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, **cache_argument(model, cache)
        ).logits
        rope = rotary(model.get_decoder(), positions, below=prompt_ids.shape[1])
        got, keys, values = decoder_pass.prefill(model, prompt_ids, rope, decoder_pass.causal_mask(prompt_mask))
    torch.testing.assert_close(got, want[:, -1], atol=1e-5, rtol=1e-5)
    real = prompt_mask.bool()[:, None, :, None]  # padded positions' keys are masked wherever they are read
    for layer, k, v in zip(cache.layers, keys, values, strict=True):
        torch.testing.assert_close(k * real, layer.keys * real, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v * real, layer.values * real, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_decoding_step_equals_transformers_step_on_the_same_cache(arch):
    model = small_model(arch).eval()
    rollout = group_rollout(seed=6, groups=3, group=2)
    token = rollout.completion_ids[:, 0]
    logits, before, after, mask, step = transformers_step(model, rollout.prompt_ids, rollout.prompt_mask, token)
    with torch.no_grad():
        rope = rotary(model.get_decoder(), step, below=mask.shape[1])
        got, keys, values = decoder_pass.decode_step(
            model, token, rope, mask.bool(), [k for k, _ in before], [v for _, v in before]
        )
    torch.testing.assert_close(got, logits, atol=1e-5, rtol=1e-5)
    for (k, v), new_k, new_v in zip(after, keys, values, strict=True):
        torch.testing.assert_close(new_k, k[:, :, -1:], atol=1e-6, rtol=1e-6)  # what the step appended
        torch.testing.assert_close(new_v, v[:, :, -1:], atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_compiled_sampling_draws_the_eager_tokens_while_rows_leave_the_batch(monkeypatch):
    """Rows end (EOS is a common token here) and leave the batch, the cache grows: one compilation, the
    eager sampler's tokens, its logprobs to float rounding; one row left decodes eagerly."""
    from atrctl.rollout.hf import sample

    counter = counting_compiler(monkeypatch, "decode", decoder_pass.decode_step, "inductor")
    model = small_model("qwen2").eval()
    with torch.no_grad():
        model.lm_head.weight[7] += 0.3  # token 7 (the EOS here) gets likelier: rows end at different steps
    prompts = [[5, 6, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]

    def rollout(compiled: bool):
        return sample(model, prompts, max_new_tokens=24, eos_id=7, pad_id=0, repeats=4,
                      generator=torch.Generator().manual_seed(0), compiled=compiled)  # fmt: skip

    eager = rollout(compiled=False)
    assert compilable(model)
    compiled = rollout(compiled=True)
    lengths = eager.completion_mask.sum(1)
    assert lengths.min() < lengths.max() and lengths.min() < 24  # rows did end at different steps
    assert torch.equal(compiled.completion_ids, eager.completion_ids)
    torch.testing.assert_close(compiled.logprobs, eager.logprobs, atol=1e-5, rtol=1e-5)
    assert sum(len(graph.graph.nodes) > 0 for graph in counter.graphs) == 1  # one graph (and an empty frame)


@pytest.mark.slow
def test_under_bf16_the_compiled_sampler_keeps_its_cache_in_bf16_and_draws_what_a_float32_cache_draws(monkeypatch):
    """The decoding step's products cast the cache to bf16 anyway: stored in bf16, the same tokens and the
    same logprobs bit for bit, rows leaving the batch included."""
    from atrctl.rollout import hf as sampling

    model = small_model("qwen2").eval()
    with torch.no_grad():
        model.lm_head.weight[7] += 0.3  # token 7 (the EOS here) gets likelier: rows end at different steps
    assert compilable(model)
    caches, preallocated = [], sampling.preallocated_cache

    def recorded_cache(*args, **kwargs):
        caches.append(preallocated(*args, **kwargs))
        return caches[-1]

    monkeypatch.setattr(sampling, "preallocated_cache", recorded_cache)
    prompts = [[5, 6, 8, 9], [10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]

    def rollout():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return sampling.sample(model, prompts, max_new_tokens=24, eos_id=7, pad_id=0, repeats=4,
                                   generator=torch.Generator().manual_seed(0), compiled=True)  # fmt: skip

    stored = rollout()
    assert {layer.key_buffer.dtype for layer in caches[-1].layers} == {torch.bfloat16}
    monkeypatch.setattr(sampling, "compiled_cache_dtype", lambda device: None)
    wide = rollout()
    assert {layer.key_buffer.dtype for layer in caches[-1].layers} == {torch.float32}
    lengths = wide.completion_mask.sum(1)
    assert lengths.min() < lengths.max()  # rows did end at different steps
    assert torch.equal(stored.completion_ids, wide.completion_ids)
    assert torch.equal(stored.logprobs, wide.logprobs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_passes_equal_the_eager_ones():
    """model.compile on a GPU (inductor's Triton kernels): the update's logprobs and gradients, and the
    sampler's greedy tokens and logprobs, as eager float32 gives them."""
    compiled_equals_eager("cuda")


def compiled_equals_eager(device: str) -> None:
    from atrctl.rollout.hf import sample

    torch._dynamo.reset()
    eager, compiled = small_model("qwen2").to(device), small_model("qwen2").to(device)
    assert compilable(compiled)
    rollout = group_rollout(seed=8)
    rollout = type(rollout)(*(getattr(rollout, f).to(device) for f in rollout.__dataclass_fields__))

    def values_and_gradients(model):
        model.zero_grad(set_to_none=True)
        logp, entropy = completion_logprobs_and_entropy(model, rollout, compiled=model is compiled)
        weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(7)).to(device)
        ((logp * weights).sum() + entropy.sum()).backward()
        return logp.detach(), {name: p.grad for name, p in model.named_parameters()}

    (want, want_grads), (got, got_grads) = values_and_gradients(eager), values_and_gradients(compiled)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # float32, kernels that sum in other orders
    for name, grad in want_grads.items():
        error = (got_grads[name] - grad).abs().max() / grad.abs().max()
        assert error < 1e-4, f"{name}: max |difference| is {error:.2e} of max |gradient|"
    prompts = [[5, 6, 8, 9], [10, 11], [12, 13, 14]]
    greedy = [sample(model.eval(), prompts, max_new_tokens=16, greedy=True, eos_id=7, pad_id=0, repeats=2,
                     compiled=model is compiled) for model in (eager, compiled)]  # fmt: skip
    assert torch.equal(greedy[1].completion_ids, greedy[0].completion_ids)  # argmax: no draw to differ in
    torch.testing.assert_close(greedy[1].logprobs, greedy[0].logprobs, atol=1e-4, rtol=1e-4)


def test_a_reference_following_a_checkpointing_policy_takes_its_single_pass(monkeypatch):
    """Checkpointing turns the policy's prompt cache off, so its pass is the single one; the reference must
    lay its rows out the same way, not share the prompt as its own cache would let it (on AVX2 kernels the
    two layouts gave bf16 logprobs 1e-3 apart at equal weights, which the test below caught there only)."""
    policy, rollout = small_model("llama"), group_rollout(seed=5)
    reference = small_model("llama")
    enable_checkpointing(policy)
    layouts = []
    single_pass = forward._single_pass
    monkeypatch.setattr(forward, "_single_pass", lambda *args: layouts.append("single") or single_pass(*args))
    with torch.no_grad():
        forward.completion_logprobs(policy, rollout)
        assert layouts == ["single"]
        forward.completion_logprobs(reference, rollout, path_of=policy)
    assert layouts == ["single", "single"]


def test_a_reference_computes_through_its_policys_pass_so_equal_weights_give_equal_logprobs_under_bf16():
    """A policy under activation checkpointing keeps transformers' forward; its reference (a frozen copy) would
    otherwise take the decoder pass.  Under bf16 the two passes round differently, so the KL of equal weights
    would be noise instead of 0; through the policy's pass (`path_of`) it is exactly 0."""
    policy, rollout = small_model("llama"), group_rollout(seed=5)
    reference = small_model("llama")
    reference.load_state_dict(policy.state_dict())
    reference.requires_grad_(False)
    enable_checkpointing(policy)
    policy.train()
    assert not supports(policy) and supports(reference)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = forward.completion_logprobs(policy, rollout)
        own_pass = forward.completion_logprobs(reference, rollout)
        followed = forward.completion_logprobs(reference, rollout, path_of=policy)
    assert torch.equal(followed, want)
    assert not torch.equal(own_pass, want)  # what the policy's pass avoids: two roundings of one function


def test_the_passs_flops_can_be_counted_without_gradients():
    """benchmarks/vs_trl.py counts FLOPs with torch.utils.flop_counter, whose module hooks refused the no-grad
    view of the embedding that `rotary` once passed to the rotary module (in a bf16 old-logprob pass)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, rollout = small_model("llama"), group_rollout(seed=1)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        forward.completion_logprobs(model, rollout)
    assert counter.get_total_flops() > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rotary_phases_come_from_a_table_equal_to_the_models_own_and_grown_on_demand(arch):
    model = small_model(arch)
    decoder = model.get_decoder()
    embeddings = decoder.embed_tokens.weight.detach()
    first = decoder_pass._rotary_table(decoder, 10)
    assert first[0].shape[0] == decoder_pass.ROTARY_TABLE_MIN
    assert decoder_pass._rotary_table(decoder, 200) is first  # no recomputation while it covers the positions
    positions = torch.randint(0, 1000, (5, 37), generator=torch.Generator().manual_seed(0))
    cos, sin = rotary(decoder, positions, below=1000)
    assert decoder_pass._rotary_table(decoder, 1)[0].shape[0] == 1024  # doubled past the largest position
    want_cos, want_sin = decoder.rotary_emb(embeddings[:1], positions.reshape(1, -1))
    assert torch.equal(cos, want_cos.view_as(cos)) and torch.equal(sin, want_sin.view_as(sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_half_gives_the_same_numbers_with_and_without_a_gradient(dtype):
    """The sampler's no-grad steps rotate by slices, the update by a matrix product: the two must agree to the
    bit, or the sampler's logprobs would drift from the update's."""
    x = torch.randn(3, 5, 4, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        sliced = decoder_pass._rotate_half(x)
    product = decoder_pass._rotate_half(x.clone().requires_grad_())
    assert product.requires_grad  # the product path ran
    assert torch.equal(sliced, product.detach())
    assert torch.equal(sliced[..., :8], -x[..., 8:]) and torch.equal(sliced[..., 8:], x[..., :8])
