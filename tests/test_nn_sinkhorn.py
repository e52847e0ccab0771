"""Sinkhorn-Knopp projection: doubly stochastic output, fp32 under autocast, batched, differentiable."""

from __future__ import annotations

import pytest
import torch

from lightning_pulse.nn import composite_gain, doubly_stochastic_error, sinkhorn_knopp
from lightning_pulse.nn.sinkhorn import _SinkhornKnopp


def _logits(*shape: int, std: float = 1.0, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std


@pytest.mark.parametrize("std", [0.25, 0.5, 1.0])
def test_rows_and_columns_sum_to_one_within_1e_3_at_20_iterations(std):
    matrices = sinkhorn_knopp(_logits(512, 4, 4, std=std), iters=20)
    row_error, column_error = doubly_stochastic_error(matrices)
    assert row_error < 1e-5  # the last normalisation is over rows
    assert column_error < 1e-3


def test_column_error_falls_as_iterations_grow():
    logits = _logits(512, 4, 4, std=2.0)
    errors = [float((sinkhorn_knopp(logits, iters=k).sum(-2) - 1).abs().mean()) for k in (1, 5, 20, 80)]
    assert errors == sorted(errors, reverse=True)
    assert errors[-1] < errors[0] / 20


def test_entries_are_non_negative_and_finite_even_for_far_apart_logits():
    for std in (1.0, 10.0, 100.0):
        matrices = sinkhorn_knopp(_logits(256, 4, 4, std=std), iters=20)
        assert torch.isfinite(matrices).all()
        assert (matrices >= 0).all()
        assert torch.allclose(matrices.sum(-1), torch.ones(256, 4), atol=1e-5)


def test_spectral_norm_is_at_most_one_plus_tolerance():
    matrices = sinkhorn_knopp(_logits(512, 4, 4, std=1.0), iters=20)
    spectral_norm = torch.linalg.matrix_norm(matrices.double(), ord=2)
    assert float(spectral_norm.max()) <= 1 + 2e-3
    assert float(spectral_norm.min()) >= 1 - 1e-5  # a doubly stochastic matrix has the all-ones eigenvector


def test_products_of_64_projected_matrices_stay_bounded_while_identity_plus_noise_explodes():
    noise = _logits(64, 4, 4, std=0.5, seed=1)
    projected = list(sinkhorn_knopp(noise, iters=20))
    forward_gain, backward_gain = composite_gain(projected)
    assert float(forward_gain) <= 1 + 1e-3
    assert float(backward_gain) <= 1 + 1e-2
    unconstrained = list(torch.eye(4) + noise)
    exploding_forward, exploding_backward = composite_gain(unconstrained)
    assert float(exploding_forward) > 1e3
    assert float(exploding_backward) > 1e3


def test_batched_over_leading_dimensions_matches_one_matrix_at_a_time():
    logits = _logits(2, 3, 5, 5)
    batched = sinkhorn_knopp(logits, iters=7)
    assert batched.shape == (2, 3, 5, 5)
    one_by_one = torch.stack([sinkhorn_knopp(m, iters=7) for m in logits.reshape(-1, 5, 5)]).reshape(
        2, 3, 5, 5
    )
    torch.testing.assert_close(batched, one_by_one)


def test_computes_in_fp32_under_bf16_autocast():
    logits = _logits(64, 4, 4).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        matrices = sinkhorn_knopp(logits, iters=20)
    assert matrices.dtype == torch.float32
    row_error, _ = doubly_stochastic_error(matrices)
    assert row_error < 1e-5  # bf16 arithmetic would leave errors near 1e-2


def test_gradients_flow_through_every_iteration_and_match_finite_differences():
    logits = _logits(4, 4, std=1.0, seed=3).double().requires_grad_()
    weights = _logits(4, 4, seed=4).double()

    def loss(x: torch.Tensor, iters: int) -> torch.Tensor:
        return (sinkhorn_knopp(x, iters=iters) * weights).sum()

    (grad_20,) = torch.autograd.grad(loss(logits, 20), logits)
    (grad_1,) = torch.autograd.grad(loss(logits, 1), logits)
    assert not torch.allclose(grad_20, grad_1, atol=1e-4)  # later iterations are part of the graph
    step = 1e-2
    numeric = torch.zeros_like(logits)
    with torch.no_grad():
        for index in range(16):
            bump = torch.zeros(16, dtype=torch.float64)
            bump[index] = step
            bump = bump.view(4, 4)
            numeric.view(-1)[index] = (loss(logits + bump, 20) - loss(logits - bump, 20)) / (2 * step)
    torch.testing.assert_close(grad_20, numeric, atol=2e-3, rtol=2e-2)


@pytest.mark.parametrize("iters", [0, -1, 2.0, True])
def test_rejects_a_non_positive_or_non_integer_iteration_count(iters):
    with pytest.raises(ValueError, match="`iters`"):
        sinkhorn_knopp(torch.zeros(4, 4), iters=iters)


def test_rejects_non_square_logits():
    with pytest.raises(ValueError, match=r"\(\.\.\., n, n\)"):
        sinkhorn_knopp(torch.zeros(3, 4))


def _sinkhorn_by_plain_autograd(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """The textbook loop, differentiated by autograd: the reference for the hand-written backward."""
    matrix = (logits - logits.amax(dim=(-2, -1), keepdim=True).detach()).exp()
    for _ in range(iters):
        matrix = matrix / matrix.sum(dim=-2, keepdim=True)
        matrix = matrix / matrix.sum(dim=-1, keepdim=True)
    return matrix


@pytest.mark.parametrize("iters", [1, 2, 7, 20])
def test_forward_and_gradient_equal_plain_autograd_through_the_unrolled_iterations(iters):
    logits = _logits(3, 5, 4, 4, std=1.5, seed=5).requires_grad_()
    upstream = _logits(3, 5, 4, 4, seed=6)
    reference = _sinkhorn_by_plain_autograd(logits, iters)
    result = sinkhorn_knopp(logits, iters)
    torch.testing.assert_close(result, reference, atol=1e-6, rtol=1e-5)
    (expected,) = torch.autograd.grad(reference, logits, upstream)
    (actual,) = torch.autograd.grad(result, logits, upstream)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4)


def test_logits_spanning_more_than_60_are_iterated_as_given_not_floored():
    # a floor at max-60 made the bottom row uniform: [[0.5, 0.5], [0.5, 0.5]]
    result = sinkhorn_knopp(torch.tensor([[0.0, 0.0], [-70.0, -140.0]]), iters=20)
    torch.testing.assert_close(result, torch.tensor([[0.025, 0.975], [1.0, 0.0]]), atol=1e-6, rtol=1e-5)
    logits = torch.rand(2000, 4, 4, generator=torch.Generator().manual_seed(0)) * 80
    exact = _sinkhorn_by_plain_autograd(logits.double(), 20)
    assert float((sinkhorn_knopp(logits, 20).double() - exact).abs().max()) < 1e-5  # the floor: 0.98


def test_a_row_whose_exponentials_all_underflow_in_fp32_gives_the_exact_finite_result():
    # exp(-200) is 0 in fp32: a plain fp32 loop divides 0 by 0 in its first row normalisation
    torch.testing.assert_close(
        sinkhorn_knopp(torch.tensor([[0.0, 0.0], [-200.0, -200.0]]), 20), torch.full((2, 2), 0.5)
    )
    logits = _logits(500, 4, 4, std=2.0, seed=10)
    logits[:, 1] -= 150.0  # one row far below the others, differences within it kept
    logits[:250, :, 2] -= 300.0  # and, in half the matrices, one column far below that
    result = sinkhorn_knopp(logits, 20)
    assert torch.isfinite(result).all()
    torch.testing.assert_close(
        result.double(), _sinkhorn_by_plain_autograd(logits.double(), 20), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_backward_passes_float64_gradcheck_for_logits_spread_over_0_to_200(iters):
    logits = torch.rand(4, 4, 6, generator=torch.Generator().manual_seed(iters), dtype=torch.float64) * 200
    assert torch.autograd.gradcheck(lambda x: _SinkhornKnopp.apply(x, iters), (logits.requires_grad_(),))


def test_gradient_matches_the_exact_loop_in_float64_for_logits_spread_over_0_to_200():
    logits = (torch.rand(1000, 4, 4, generator=torch.Generator().manual_seed(11)) * 200).requires_grad_()
    upstream = _logits(1000, 4, 4, seed=12)
    sinkhorn_knopp(logits, 20).backward(upstream)
    reference = logits.detach().double().requires_grad_()
    _sinkhorn_by_plain_autograd(reference, 20).backward(upstream.double())
    assert float(reference.grad.abs().max()) > 0.1
    torch.testing.assert_close(logits.grad.double(), reference.grad, atol=1e-5, rtol=0)


def test_a_minus_inf_logit_is_an_exact_zero_and_a_minus_inf_row_a_visible_nan():
    minus_inf = float("-inf")
    logits = torch.tensor([[[0.0, 1.0], [minus_inf, 2.0]], [[0.0, 1.0], [minus_inf, minus_inf]]])
    logits.requires_grad_()
    out = sinkhorn_knopp(logits, 20)
    assert out[0, 1, 0] == 0 and torch.isfinite(out[0]).all()
    torch.testing.assert_close(out[0].sum(-1), torch.ones(2))
    assert torch.isnan(out[1]).all()  # no doubly stochastic scaling of a zero row exists
    out[0].sum().backward()
    assert torch.isfinite(logits.grad[0]).all()


def test_a_nan_logit_poisons_only_its_own_matrix():
    logits = _logits(2, 4, 4, seed=7)
    logits[1, 2, 3] = float("nan")
    out = sinkhorn_knopp(logits)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).any()  # visible, never silently repaired


# inductor: about 12 s wall with a warm inductor cache, about 60 s cold, on the loaded 2-core machine
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torch_compile_traces_sinkhorn_as_one_graph_and_matches_eager_in_value_and_gradient(backend):
    torch._dynamo.reset()
    logits = _logits(3, 37, 4, 4, std=1.5, seed=8)
    upstream = _logits(3, 37, 4, 4, seed=9)
    compiled = torch.compile(sinkhorn_knopp, backend=backend, fullgraph=True)  # a graph break raises
    results = []
    for fn in (sinkhorn_knopp, compiled):
        leaf = logits.clone().requires_grad_()
        out = fn(leaf, 20)
        out.backward(upstream)
        results.append((out.detach(), leaf.grad))
    (eager_out, eager_grad), (traced_out, traced_grad) = results
    assert eager_grad.abs().amax() > 1e-3
    torch.testing.assert_close(traced_out, eager_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(traced_grad, eager_grad, rtol=1e-4, atol=1e-6)


def test_accepts_an_integer_like_numpy_or_torch_iteration_count():
    np = pytest.importorskip("numpy")
    logits = torch.randn(3, 4, 4)
    expected = sinkhorn_knopp(logits, 5)
    assert torch.equal(sinkhorn_knopp(logits, np.int64(5)), expected)
    assert torch.equal(sinkhorn_knopp(logits, torch.tensor(5)), expected)
