"""The native gradient-norm read (lightning_pulse.core.grad_norm) that StabilityGuard uses on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_pulse import _native
from lightning_pulse.callbacks import stability_guard
from lightning_pulse.core.grad_norm import host_sum_of_squares

pytestmark = pytest.mark.skipif(
    _native.compiler() is None, reason="no C compiler: the guard reads with torch"
)


def test_native_sum_of_squares_equals_torchs_total_norm():
    generator = torch.Generator().manual_seed(0)
    # sizes below, at and past the 16 lanes, a 0-d tensor, and a large one
    grads = [torch.randn(shape, generator=generator) for shape in [(3,), (16,), (37, 5), (), (300_001,)]]
    expected = torch.nn.utils.get_total_norm(grads, 2.0, foreach=False).double().item()
    assert math.sqrt(host_sum_of_squares(grads)) == pytest.approx(expected, rel=1e-6)


def test_non_finite_entries_and_an_overflowing_tensor_give_a_non_finite_norm_as_torch_does():
    grads = [torch.ones(40), torch.ones(7)]
    grads[1][3] = float("nan")
    assert math.isnan(host_sum_of_squares(grads))
    grads[1][3] = float("-inf")
    assert host_sum_of_squares(grads) == float("inf")
    # one tensor whose fp32 norm overflows: torch's per-tensor norm is inf, and so is this
    huge = [torch.full((3,), 3e38)]
    assert host_sum_of_squares(huge) == float("inf") == torch._foreach_norm(huge, 2.0)[0].item()
    # two tensors whose norms are each finite in fp32: the total is a finite (double) number, as with hypot
    two = [torch.full((1,), 3e38), torch.full((1,), 3e38)]
    assert math.sqrt(host_sum_of_squares(two)) == pytest.approx(math.hypot(3e38, 3e38), rel=1e-6)


def test_gradients_the_native_path_cannot_take_are_left_to_torch():
    assert host_sum_of_squares([]) is None
    assert host_sum_of_squares([torch.ones(4, dtype=torch.float64)]) is None
    assert host_sum_of_squares([torch.ones(4), torch.ones(4, dtype=torch.bfloat16)]) is None
    assert host_sum_of_squares([torch.ones(4, 6).t()]) is None  # not contiguous
    assert host_sum_of_squares([torch.ones(3).to_sparse()]) is None


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_the_guards_read_gives_the_same_norm_with_and_without_the_native_path(monkeypatch, native):
    if not native:
        monkeypatch.setattr(stability_guard, "host_sum_of_squares", lambda grads: None)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    expected = torch.nn.utils.get_total_norm(grads, 2.0).item()
    read_loss, read_norm = stability_guard._loss_and_grad_norm(grads, [loss], read_each=True)
    assert read_norm == pytest.approx(expected, rel=1e-6) and read_loss == pytest.approx(loss.item())
    grads[0][0, 0] = float("inf")
    assert stability_guard._loss_and_grad_norm(grads, [loss], read_each=True)[1] == float("inf")
