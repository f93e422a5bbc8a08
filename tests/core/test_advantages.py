"""Group-relative advantage estimators against hand-computed groups."""

import math

import pytest
import torch

from atrctl.core.advantages import ADVANTAGE_ESTIMATORS, group_advantages

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [2.0, 4.0, 6.0, 8.0]]


def test_grpo_divides_by_the_group_std():
    advantages, frac_zero_std = group_advantages(REWARDS, "grpo")
    std_a = math.sqrt(4 * 0.25 / 3)  # Bessel: sum of squared deviations / (G - 1)
    std_c = math.sqrt((9 + 1 + 1 + 9) / 3)
    expected = [
        [0.5 / (std_a + 1e-6), -0.5 / (std_a + 1e-6), -0.5 / (std_a + 1e-6), 0.5 / (std_a + 1e-6)],
        [0.0, 0.0, 0.0, 0.0],
        [-3 / (std_c + 1e-6), -1 / (std_c + 1e-6), 1 / (std_c + 1e-6), 3 / (std_c + 1e-6)],
    ]
    torch.testing.assert_close(advantages, torch.tensor(expected), rtol=1e-6, atol=0)
    assert frac_zero_std == pytest.approx(1 / 3)


def test_drgrpo_only_centres():
    advantages, frac_zero_std = group_advantages(REWARDS, "drgrpo")
    expected = [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [-3.0, -1.0, 1.0, 3.0]]
    torch.testing.assert_close(advantages, torch.tensor(expected), rtol=0, atol=1e-7)
    assert frac_zero_std == pytest.approx(1 / 3)


def test_rloo_subtracts_the_mean_of_the_others():
    advantages, _ = group_advantages(REWARDS, "rloo")
    # 1 - (0 + 0 + 1)/3 = 2/3; 0 - 2/3; 2 - (4 + 6 + 8)/3 = -4; 4 - 16/3; 6 - 14/3; 8 - 4
    expected = [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0] * 4, [-4.0, 4 - 16 / 3, 6 - 14 / 3, 4.0]]
    torch.testing.assert_close(advantages, torch.tensor(expected), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("estimator", list(ADVANTAGE_ESTIMATORS))
def test_all_equal_groups_are_exactly_zero_and_counted(estimator):
    # 0.1 + 0.2 style values whose float mean is not exactly the value
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.3, 0.3, 0.3], [1e6, 1e6, 1e6], [0.0, 1.0, 0.0]])
    advantages, frac_zero_std = group_advantages(rewards, estimator)
    assert torch.isfinite(advantages).all()
    assert (advantages[:3] == 0).all() and (advantages[3] != 0).all()
    assert frac_zero_std == 0.75
    assert advantages.dtype == torch.float32 and advantages.shape == (4, 3)


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="grpo, drgrpo, rloo"):
        group_advantages(REWARDS, "ppo")
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages([[1.0], [0.0]])
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages([1.0, 0.0])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([[1.0, float("nan")]])
