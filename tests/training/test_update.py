"""The update step does less work without changing the step: rows with advantage 0 are left out of the
forward/backward (their policy-loss gradient is exactly 0), and the mini-batch's normaliser still counts them."""

import pytest
import torch
from helpers import fast, recipe_maker

from atrctl.core.losses import POLICY_LOSSES, define_loss, loss_parameters, policy_loss
from atrctl.model.forward import completion_logprobs
from atrctl.training import step as step_module
from atrctl.training.setup import build_run
from atrctl.training.step import recomputes_old_logprobs, rollout_step, skips_zero_advantage, update_step

FAST = fast("algo.minibatches=2", "algo.num_iterations=2", "optim.lr=1e-5", "rollout.temperature=2.0")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


recipe = recipe_maker(FAST)


class Update:
    """One update_step from the base: the gradient each optimiser step took, the parameters after, its metrics."""

    def __init__(self, results, advantages, *overrides, rollout=None):
        run = build_run(recipe(*overrides), results / "unused", results)
        self.rollout = rollout if rollout is not None else rollout_step(run, 0)[0]
        self.forwards, self.gradients = 0, []
        run.model.register_forward_hook(lambda *_: setattr(self, "forwards", self.forwards + 1))
        step = run.optimizer.step

        def recording_step():
            self.gradients.append({k: p.grad.clone() for k, p in run.model.named_parameters()})
            step()

        run.optimizer.step = recording_step
        self.metrics, finite = update_step(run, self.rollout, advantages, 0)
        assert finite
        self.parameters = {k: v.detach().clone() for k, v in run.model.named_parameters()}


def assert_same_update(a: Update, b: Update):
    """The same gradient at every optimiser step (float32 noise, measured ~5e-7 of its norm, allowed 1e-5),
    and so the same parameters.  AdamW divides each entry by its own running scale, |g| + 1e-8 at the first
    step, so an entry whose gradient is float noise in both runs (|g| ~ 1e-9) can move by a visible part of
    one step, lr: measured at most 1.3% of lr, in 7 entries of a million.  The parameters are compared to 10%
    of lr entry by entry and to 1e-4 of lr on average; lr is small so such a difference cannot change the
    later steps' gradients."""
    assert len(a.gradients) == len(b.gradients)
    for ga, gb in zip(a.gradients, b.gradients, strict=True):
        difference = torch.cat([(ga[key] - gb[key]).flatten() for key in ga]).norm()
        assert difference <= 1e-5 * torch.cat([g.flatten() for g in gb.values()]).norm()
    lr = recipe().optim.lr
    moved = torch.cat([(a.parameters[key] - b.parameters[key]).abs().flatten() for key in a.parameters]) / lr
    assert moved.max() <= 0.1 and moved.mean() <= 1e-4


# rows are prompt-major (4 prompts × G = 4); mini-batch 1 is rows 0-7, mini-batch 2 rows 8-15
# (any values: a group's need not sum to 0, so identical completions still get a gradient)
ONE_GROUP_SOLVED = torch.tensor([0.0] * 4 + [1.5, -0.3, 0.7, -1.2] + [-0.87, 0.4, 0.87, 1.1] + [0.0] * 4)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("algo.agg=seq-mean-token-mean",),
        ("algo.agg=seq-mean-token-sum-norm", "algo.loss=grpo"),
        ("algo.loss=gspo", "algo.agg=seq-mean-token-mean"),
        ("algo.loss=cispo", "algo.micro_batch=3"),
    ],
)
def test_skipping_zero_advantage_rows_changes_no_parameter(results, overrides):
    skipped = Update(results, ONE_GROUP_SOLVED, *overrides)
    every_row = Update(results, ONE_GROUP_SOLVED, *overrides, "algo.skip_zero_advantage=false", rollout=skipped.rollout)
    assert_same_update(skipped, every_row)
    assert skipped.metrics["loss"] == pytest.approx(every_row.metrics["loss"], abs=1e-7)  # the skipped rows' is 0
    assert skipped.metrics["rows/skipped"] == pytest.approx(0.5) and every_row.metrics["rows/skipped"] == 0
    assert skipped.forwards <= every_row.forwards


def test_a_minibatch_with_nothing_to_train_runs_no_forward_pass_yet_steps_adamw_as_before(results):
    """Every advantage 0: no forward at all, but AdamW still takes its (weight-decay) step on zero gradients."""
    zeros = torch.zeros(16)
    skipped = Update(results, zeros, "optim.weight_decay=0.1")
    every_row = Update(
        results, zeros, "optim.weight_decay=0.1", "algo.skip_zero_advantage=false", rollout=skipped.rollout
    )
    assert skipped.forwards == 0 and every_row.forwards > 0
    assert_same_update(skipped, every_row)
    base = build_run(recipe(), results / "unused", results).model
    assert any(not torch.equal(p, skipped.parameters[k]) for k, p in base.named_parameters())  # decay moved them
    assert skipped.metrics["rows/skipped"] == 1 and skipped.metrics["loss"] == 0
    assert "clip/low" not in skipped.metrics and "clip/low" in every_row.metrics  # not measured, not reported


def test_a_partly_skipped_minibatch_reports_the_rows_it_trained(results):
    """Mini-batch 2 holds one trained group: the step's figures are over the rows with a gradient."""
    half = ONE_GROUP_SOLVED.clone()
    half[4:8] = 0  # mini-batch 1: nothing to train
    metrics = Update(results, half).metrics
    assert metrics["rows/skipped"] == pytest.approx((8 / 8 + 4 / 8) / 2)
    assert 0 <= metrics["clip/region"] <= 1 and metrics["ratio/min"] <= 1 <= metrics["ratio/max"]


def test_rows_are_skipped_only_where_no_other_term_needs_them():
    assert skips_zero_advantage(recipe().algo)
    assert not skips_zero_advantage(recipe("algo.skip_zero_advantage=false").algo)
    assert not skips_zero_advantage(recipe("algo.beta=0.01").algo)  # the KL to the reference has a gradient
    assert not skips_zero_advantage(recipe("algo.entropy_coef=0.01").algo)  # so has the entropy bonus


def test_a_loss_that_needs_every_row_says_so(monkeypatch):
    needy = define_loss(lambda tokens: (tokens.ratio - 1, {}), needs_every_row=True)  # a term without A
    monkeypatch.setitem(POLICY_LOSSES, "needy", needy)
    assert not skips_zero_advantage(recipe("algo.loss=needy").algo)
    assert step_module.skips_zero_advantage(recipe("algo.loss=grpo").algo)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_every_registered_loss_gives_a_zero_advantage_row_exactly_no_gradient(name):
    """The premise of skipping: a row with A = 0 gets gradient exactly 0, whatever its ratio."""
    torch.manual_seed(0)
    params = {k: v for k, v in loss_parameters(name).items() if v is not None}
    if name == "divergence":
        params = {"measure": "kl3", "delta": 0.1}
    logp = torch.randn(3, 5).mul(0.3).sub(1.0).requires_grad_()
    old_logp = logp.detach() + torch.randn(3, 5) * 0.2
    advantages = torch.tensor([0.0, 1.2, -0.7])
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, _ = policy_loss(
            logp, old_logp, advantages, torch.ones(3, 5), algo=name, agg=agg, max_new_tokens=5, **params
        )
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.equal(grad[0], torch.zeros(5)) and grad[1:].abs().sum() > 0, (name, agg)


BF16_SAMPLER_GAP = 0.05  # max |Δ logprob| between the bf16 KV-cache decode and the bf16 training pass


def test_a_bf16_update_on_cpu_reuses_its_samplers_logprobs_which_agree_with_its_training_pass(results):
    """Under bf16 autocast the sampler's logprobs are not the training pass's to float32 noise, but on a CPU
    auto takes them as the old ones (no recomputing pass): they agree within BF16_SAMPLER_GAP, as the pass
    agrees with float32, so the first optimiser step's ratio is 1 to within that gap."""
    run = build_run(recipe("model.autocast=bfloat16"), results / "unused", results)
    assert run.numerics.autocast_dtype is torch.bfloat16 and next(run.model.parameters()).dtype is torch.float32
    assert not recomputes_old_logprobs(run.recipe.algo, run.sampler)
    rollout = rollout_step(run, 0)[0]
    temperature, mask = run.recipe.rollout.temperature, rollout.completion_mask.bool()
    with torch.no_grad():
        with run.numerics.autocast():
            trained = completion_logprobs(run.model, rollout, temperature)
        exact = completion_logprobs(run.model, rollout, temperature)
    sampler_gap, bf16_gap = (rollout.logprobs - trained)[mask].abs(), (trained - exact)[mask].abs()
    assert 0 < sampler_gap.max() < BF16_SAMPLER_GAP and 0 < bf16_gap.max() < BF16_SAMPLER_GAP  # bf16 did run
    metrics, finite = update_step(run, rollout, ONE_GROUP_SOLVED, 0)
    assert finite and metrics["ratio/min"] < 1 < metrics["ratio/max"]  # the first mini-batch's ratio is not exactly 1


EVERY_ROW_ADVANTAGE = torch.linspace(-1.5, 1.5, 16)  # no row skipped: both mini-batches train every row


@pytest.mark.parametrize(("autocast", "micro_batch", "minibatches"), [("off", 0, 2), ("bfloat16", 0, 2),
                         ("off", 3, 2), ("bfloat16", 3, 2), ("bfloat16", 0, 1)])  # fmt: skip
def test_recomputed_old_logprobs_skip_the_first_minibatch_whose_own_pass_gives_the_same_update(
    results, monkeypatch, autocast, micro_batch, minibatches
):
    """Before the first optimiser step the policy is the sampling one, so the first mini-batch's training
    pass gives its old logprobs itself: the no-grad pass runs over the other mini-batches only (none of one),
    and the update (μ = 2: the first mini-batch's second pass reads what its first kept) is the one a full
    no-grad pass gives, bit for bit, in float32 and under bf16 autocast."""
    overrides = (f"model.autocast={autocast}", "algo.old_logprobs=recompute", f"algo.micro_batch={micro_batch}",
                 f"algo.minibatches={minibatches}")  # fmt: skip
    no_grad_rows, logprobs = [], step_module.completion_logprobs  # what the update's no-grad passes run on

    def counted(model, rollout, temperature, **kwargs):
        no_grad_rows.append(rollout.completion_ids.shape[0])
        return logprobs(model, rollout, temperature, **kwargs)

    monkeypatch.setattr(step_module, "completion_logprobs", counted)
    new = Update(results, EVERY_ROW_ADVANTAGE, *overrides)
    new_rows, no_grad_rows[:] = list(no_grad_rows), []
    step = step_module._optimiser_step

    def with_a_full_no_grad_pass(run, rollout, advantages, part, pieces, old_logp, ref_logp, own):
        """The update as it was: the first mini-batch's old logprobs from a no-grad pass, before its step."""
        if own:
            with torch.no_grad(), run.numerics.autocast():
                old_logp += step_module._logprobs(run.model, rollout, [pieces], run.recipe.rollout.temperature)
        return step(run, rollout, advantages, part, pieces, old_logp, ref_logp, False)

    monkeypatch.setattr(step_module, "_optimiser_step", with_a_full_no_grad_pass)
    full = Update(results, EVERY_ROW_ADVANTAGE, *overrides, rollout=new.rollout)
    rows = 16 // minibatches
    each_minibatch = [rows] if micro_batch == 0 else [3] * (rows // 3) + [rows % 3]  # its micro-batches' rows
    assert no_grad_rows == each_minibatch * minibatches  # the full pass, as it was
    assert new_rows == each_minibatch * (minibatches - 1)  # all but the first mini-batch's
    assert all(torch.equal(new.parameters[key], full.parameters[key]) for key in full.parameters)
    assert new.metrics == full.metrics


def test_a_first_pass_dropped_at_a_non_finite_loss_still_gives_every_row_its_old_logprobs(results, monkeypatch):
    """The first mini-batch's first pass stops at its first micro-batch's NaN loss (the step is dropped); the
    rows it did not reach get their old logprobs all the same, so its second pass (μ = 2) has ratios near 1
    (|log w| < 0.1 after three AdamW steps of lr 1e-5; measured 0.04), not exp(logp - 0) (|log w| up to 5.4)."""
    ratios, calls, loss = [], [], step_module.policy_loss

    def first_is_nan(logp, old_logp, *args, **kwargs):
        out = loss(logp, old_logp, *args, **kwargs)
        calls.append(1)
        mask = args[1].bool()
        ratios.append((logp.detach() - old_logp)[mask].abs().max().item())
        return (out[0] * float("nan"), out[1]) if len(calls) == 1 else out

    run = build_run(recipe("algo.old_logprobs=recompute", "algo.micro_batch=3"), results / "unused", results)
    rollout = rollout_step(run, 0)[0]
    monkeypatch.setattr(step_module, "policy_loss", first_is_nan)  # after build_run's probe of the loss
    _, finite = update_step(run, rollout, EVERY_ROW_ADVANTAGE, 0)
    assert not finite and len(calls) == 1 + 3 + 3 + 3  # mini-batch 1 stopped after one micro-batch of three
    assert max(ratios) < 0.1, ratios  # every pass read the old logprobs of its rows
