"""The mismatch corrections and metrics on hand-computed cases: m = π_old / μ = 2, 1/2 and 1."""

import math

import pytest
import torch

from atrctl.core.correction import CORRECTIONS, MISMATCH_METRICS, check_correction, correction_weights
from atrctl.core.losses import policy_loss

OLD = torch.log(torch.tensor([[0.5, 0.2, 0.1]]))
BEHAVIOUR = torch.log(torch.tensor([[0.25, 0.4, 0.1]]))  # m = [2, 0.5, 1]
MASK = torch.ones(1, 3, dtype=torch.long)
KL3 = [2 - 1 - math.log(2), 0.5 - 1 + math.log(2), 0.0]  # 0.306853, 0.193147, 0


def weights(name, mask=MASK, **params):
    return correction_weights(name, OLD, BEHAVIOUR, mask, **params)


def test_none_keeps_every_token_and_reports_the_mismatch():
    got, metrics = weights("none")
    assert got.tolist() == [[1.0, 1.0, 1.0]]
    assert set(metrics) == set(MISMATCH_METRICS)
    assert metrics["mismatch/kl3"].item() == pytest.approx(sum(KL3) / 3, abs=1e-7)
    assert metrics["mismatch/k1"].item() == pytest.approx(0.0, abs=1e-7)  # -(ln 2 - ln 2 + 0) / 3
    assert metrics["mismatch/log_ratio/max"].item() == pytest.approx(math.log(2), abs=1e-7)
    assert metrics["mismatch/corrected"].item() == 0.0


def test_token_tis_truncates_each_weight_at_the_cap():
    got, metrics = weights("token-tis", cap=1.5)
    torch.testing.assert_close(got, torch.tensor([[1.5, 0.5, 1.0]]))
    assert metrics["mismatch/corrected"].item() == pytest.approx(2 / 3)


def test_sequence_tis_weighs_every_token_by_the_products_truncation():
    got, _ = weights("sequence-tis")  # 2 · 0.5 · 1 = 1
    torch.testing.assert_close(got, torch.ones(1, 3))
    got, _ = weights("sequence-tis", mask=torch.tensor([[1, 0, 0]]), cap=1.5)  # only m = 2 counts: min(2, 1.5)
    torch.testing.assert_close(got, torch.tensor([[1.5, 0.0, 0.0]]))


def test_token_mask_drops_the_tokens_over_delta_by_the_chosen_measure():
    got, metrics = weights("token-mask", delta=0.2)  # kl3 = 0.307 > 0.2 >= 0.193
    assert got.tolist() == [[0.0, 1.0, 1.0]]
    assert metrics["mismatch/corrected"].item() == pytest.approx(1 / 3)
    got, _ = weights("token-mask", measure="ratio", delta=0.6)  # |m - 1| = 1, 0.5, 0
    assert got.tolist() == [[0.0, 1.0, 1.0]]
    got, _ = weights("token-mask", measure="kl1", delta=0.1)  # -ln m = -0.69, 0.69, 0: one side only
    assert got.tolist() == [[1.0, 0.0, 1.0]]


def test_sequence_mask_keeps_or_drops_a_whole_completion_by_its_mean():
    mean = sum(KL3) / 3  # 0.1667
    assert weights("sequence-mask", delta=mean + 1e-4)[0].tolist() == [[1.0, 1.0, 1.0]]
    assert weights("sequence-mask", delta=mean - 1e-4)[0].tolist() == [[0.0, 0.0, 0.0]]
    two = torch.tensor([[1, 1, 0]])  # the mean over its own tokens: (0.307 + 0.193) / 2 = 0.25
    assert weights("sequence-mask", mask=two, delta=0.26)[0].tolist() == [[1.0, 1.0, 0.0]]
    assert weights("sequence-mask", mask=two, delta=0.24)[0].tolist() == [[0.0, 0.0, 0.0]]


@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_padding_gets_weight_zero_and_no_say_in_the_metrics(name):
    mask = torch.tensor([[1, 1, 1, 0]])
    old, behaviour = torch.cat([OLD, torch.tensor([[-9.0]])], 1), torch.cat([BEHAVIOUR, torch.tensor([[0.0]])], 1)
    got, metrics = correction_weights(name, old, behaviour, mask)
    _, unpadded = weights(name)
    assert got[0, 3] == 0.0
    for key in MISMATCH_METRICS:
        assert metrics[key].item() == pytest.approx(unpadded[key].item(), abs=1e-7)


def test_token_weights_scale_the_policy_term_of_the_loss_and_not_its_count():
    logp = torch.zeros(1, 2, requires_grad=True)  # on-policy: w = 1, each token's surrogate term is -A
    advantages, mask = torch.tensor([2.0]), torch.ones(1, 2)
    loss, _ = policy_loss(logp, logp.detach(), advantages, mask, algo="grpo", token_weights=torch.tensor([[1.0, 0.5]]))
    assert loss.item() == pytest.approx(-(2.0 + 1.0) / 2)  # token-mean over both tokens
    plain, _ = policy_loss(logp, logp.detach(), advantages, mask, algo="grpo", token_weights=torch.ones(1, 2))
    unweighted, _ = policy_loss(logp, logp.detach(), advantages, mask, algo="grpo")
    assert plain.item() == unweighted.item()


def test_the_penalties_are_not_weighted():
    logp, mask = torch.zeros(1, 2), torch.ones(1, 2)
    ref = torch.full((1, 2), -0.5)
    kept, _ = policy_loss(logp, logp, torch.zeros(1), mask, algo="grpo", ref_logp=ref, beta=1.0)
    dropped, _ = policy_loss(logp, logp, torch.zeros(1), mask, algo="grpo", ref_logp=ref, beta=1.0,
                             token_weights=torch.zeros(1, 2))  # fmt: skip
    assert dropped.item() == kept.item() > 0


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("nope", {}, "unknown correction 'nope'"),
        ("token-tis", {"delta": 0.1}, "takes no parameter 'delta'; it takes cap"),
        ("none", {"cap": 2}, "takes no parameter 'cap'; it takes no parameters"),
        ("token-mask", {"measure": "kl9"}, "measure 'kl9' is not registered"),
        ("token-tis", {"cap": 0}, "cap must be a number > 0"),
        ("sequence-mask", {"delta": True}, "delta must be a number > 0"),
        ("token-mask", {"delta": "0.1"}, "delta must be a number > 0"),
    ],
)
def test_bad_corrections_are_refused_with_their_reason(name, params, message):
    with pytest.raises(ValueError, match=message):
        check_correction(name, params)
