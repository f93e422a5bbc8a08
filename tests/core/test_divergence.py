"""The trust-region math: closed forms, the generic solver, and their agreement."""

import math

import numpy as np
import pytest
import torch

from atrctl.core import divergence as dv

DELTAS = np.geomspace(1e-8, 50, 400)


def k3_residual(w: float, delta: float) -> float:
    return (w - 1 - math.log(w)) - delta


@pytest.mark.parametrize("delta", DELTAS)
def test_kl3_bounds_solve_their_equation(delta):
    low, high = dv.kl3_bounds(delta)
    assert 0 < low < 1 < high
    assert abs(k3_residual(low, delta)) <= 1e-12
    assert abs(k3_residual(high, delta)) <= 1e-12


@pytest.mark.parametrize("delta", DELTAS[::8])
def test_closed_forms_agree_with_the_generic_solver(delta):
    for closed, measure in ((dv.kl3_bounds, dv.kl3), (dv.kl2_bounds, dv.kl2)):
        for exact, solved in zip(closed(delta), dv.bounds_for(measure, delta), strict=True):
            assert exact == pytest.approx(solved, rel=1e-9, abs=1e-300)


def test_reference_values():
    expected = {
        0.01: (0.865165, 1.148165),
        0.05: (0.716189, 1.350403),
        0.1: (0.616817, 1.516221),
        0.2: (0.493239, 1.772250),
    }
    for delta, (low, high) in expected.items():
        got = dv.kl3_bounds(delta)
        assert round(got[0], 6) == low and round(got[1], 6) == high


def test_bounds_are_monotone_and_asymmetric():
    lows, highs = np.array([dv.kl3_bounds(d) for d in DELTAS]).T
    assert np.all(np.diff(lows) < 0) and np.all(np.diff(highs) > 0)
    # more room to raise a probability than to lower it ...
    assert np.all(highs - 1 > 1 - lows)
    # ... while in log-ratio space the lower side is the wider one
    assert np.all(-np.log(lows) > np.log(highs))


def test_equivalent_clip_round_trips():
    for delta in (1e-4, 0.01, 0.1, 0.7, 5.0):
        eps_low, eps_high = dv.equivalent_clip(delta)
        low, high = dv.kl3_bounds(delta)
        assert (eps_low, eps_high) == (1 - low, high - 1)
        assert dv.kl3_for_eps_high(eps_high) == pytest.approx(delta, rel=1e-12)
    for eps_high in (0.01, 0.28, 1.0, 3.0):
        assert dv.equivalent_clip(dv.kl3_for_eps_high(eps_high))[1] == pytest.approx(eps_high, rel=1e-12)


def test_measures_accept_floats_arrays_and_tensors():
    points = [0.25, 1.0, 2.0]
    for name, measure in dv.MEASURES.items():
        scalar = [float(measure(w)) for w in points]
        array = measure(np.array(points))
        tensor = measure(torch.tensor(points, dtype=torch.float64))
        np.testing.assert_allclose(array, scalar, rtol=1e-15, err_msg=name)
        np.testing.assert_allclose(tensor.numpy(), scalar, rtol=1e-15, err_msg=name)
    assert dv.kl3(1.0) == 0 and dv.reverse_kl3(1.0) == 0 and dv.kl2(1.0) == 0
    assert dv.kl3(2.0) == pytest.approx(1 - math.log(2), rel=1e-15)
    assert dv.reverse_kl3(2.0) == pytest.approx(2 * math.log(2) - 1, rel=1e-15)


def test_named_trust_regions():
    assert dv.trust_region("grpo", eps=0.2) == (0.8, 1.2)
    assert dv.trust_region("dapo", eps_low=0.2, eps_high=0.28) == (0.8, 1.28)
    assert dv.trust_region("atr", max_kl3=0.1) == dv.kl3_bounds(0.1)
    radius = math.sqrt(0.2)
    assert dv.trust_region("kl2", delta=0.1) == pytest.approx((math.exp(-radius), math.exp(radius)), rel=1e-15)
    low, high = dv.trust_region("reverse-kl3", delta=0.1)
    for w in (low, high):
        assert w * math.log(w) - w + 1 == pytest.approx(0.1, abs=1e-12)
    assert dv.trust_region("divergence", measure="kl3", delta=0.1) == pytest.approx(dv.kl3_bounds(0.1))


def test_one_sided_divergences_leave_a_side_unbounded():
    # reverse k3 tends to 1 as w -> 0: at delta >= 1 nothing bounds w from below
    assert dv.bounds_for(dv.reverse_kl3, 1.5)[0] == 0.0
    # k1 = -ln w is negative above 1: it never bounds w from above
    low, high = dv.bounds_for(dv.kl1, 0.1)
    assert high == math.inf and low == pytest.approx(math.exp(-0.1), rel=1e-12)


@pytest.mark.parametrize("bad", [0.0, -0.1, math.nan, math.inf])
def test_bad_levels_are_rejected(bad):
    with pytest.raises(ValueError, match="max_kl3"):
        dv.kl3_bounds(bad)
    with pytest.raises(ValueError, match="delta"):
        dv.bounds_for(dv.kl3, bad)


def test_bad_names_and_parameters_are_rejected():
    with pytest.raises(ValueError, match="unknown trust region 'ppo'"):
        dv.trust_region("ppo")
    with pytest.raises(ValueError, match="grpo"):
        dv.trust_region("grpo", epsilon=0.2)
    with pytest.raises(ValueError, match="eps must be in"):
        dv.trust_region("grpo", eps=1.0)
    with pytest.raises(ValueError, match="unknown measure"):
        dv.trust_region("divergence", measure="js", delta=0.1)
    with pytest.raises(ValueError, match="eps must be a number, got None"):
        dv.trust_region("grpo", eps=None)
    with pytest.raises(ValueError, match="max_kl3 must be <= 700"):
        dv.kl3_bounds(800)
    assert dv.kl3_bounds(700)[0] > 0
