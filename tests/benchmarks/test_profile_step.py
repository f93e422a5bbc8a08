"""benchmarks/profile_step.py --by-shape: the FLOPs it divides each product's time into are torch's own count."""

import sys

import pytest
import torch
from helpers import REPO
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(REPO / "benchmarks"))
from profile_step import product_flops  # noqa: E402


@pytest.mark.parametrize(
    ("op", "call", "shapes"),
    [
        ("aten::mm", lambda a, b: a @ b, [[7, 5], [5, 3]]),
        ("aten::addmm", lambda a, b: torch.addmm(torch.zeros(3), a, b), [[3], [7, 5], [5, 3]]),
        ("aten::bmm", lambda a, b: torch.bmm(a, b), [[4, 7, 5], [4, 5, 3]]),
    ],
)
def test_product_flops_equal_torchs_flop_counter(op, call, shapes):
    factors = shapes[-2:]
    with FlopCounterMode(display=False) as counter:
        call(*(torch.randn(*shape) for shape in factors))
    assert product_flops(op, shapes) == counter.get_total_flops()
