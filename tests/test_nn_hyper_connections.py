"""HC / mHC layers: the equation, layouts, plain-residual equivalence, initialisation and gradients."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from torch import nn

from lightning_pulse.nn import (
    HyperConnection,
    HyperConnectionRecorder,
    ManifoldHyperConnection,
    PlainResidual,
    collapse_streams,
    composite_gain,
    doubly_stochastic_error,
    expand_streams,
    off_diagonal_mass,
    residual_connection,
    sinkhorn_knopp,
    stack_diagnostics,
    stream_weights,
)

WIDTH = 16
COEFFICIENT_PARAMETERS = ("phi_pre", "phi_post", "phi_res", "b_pre", "b_post", "b_res")
GATES = ("alpha_pre", "alpha_post", "alpha_res")


def mlp_branch(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


def pre_norm_branch(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(width), mlp_branch(width))


def stack(
    cls: type[HyperConnection], depth: int, n_streams: int = 4, branch=mlp_branch, **kwargs
) -> nn.Sequential:
    return nn.Sequential(*[cls(branch(), WIDTH, n_streams, **kwargs) for _ in range(depth)])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------- the equation
def test_forward_is_h_res_x_plus_h_post_transposed_branch_of_h_pre_x():
    layer = ManifoldHyperConnection(mlp_branch(), WIDTH, n_streams=3)
    streams = torch.randn(2, 5, 3, WIDTH)
    pre, post, res = layer.coefficients(streams)
    expected = torch.empty_like(streams)
    for b in range(2):
        for t in range(5):
            x = streams[b, t]  # (n, C)
            branch_out = layer.branch(pre[b, t] @ x)  # F(H_pre x)
            expected[b, t] = res[b, t] @ x + torch.outer(post[b, t], branch_out)
    torch.testing.assert_close(layer(streams), expected, atol=1e-5, rtol=1e-5)


def test_h_res_is_applied_so_changing_its_logits_changes_the_output():
    layer = ManifoldHyperConnection(mlp_branch(), WIDTH, n_streams=4)
    streams = expand_streams(torch.randn(2, 5, WIDTH), 4)
    before = layer(streams)
    with torch.no_grad():
        layer.b_res.copy_(torch.eye(4).flip(0) * 5)  # near an anti-diagonal permutation
    assert not torch.allclose(layer(streams), before, atol=1e-3)


def test_mhc_coefficients_follow_eq_8_sigmoid_two_sigmoid_and_a_doubly_stochastic_h_res():
    layer = ManifoldHyperConnection(mlp_branch(), WIDTH, n_streams=4, alpha_init=0.5)
    with torch.no_grad():
        for name in ("b_pre", "b_post", "b_res"):
            getattr(layer, name).normal_(std=2.0)
    pre, post, res = layer.coefficients(torch.randn(3, 7, 4, WIDTH))
    assert ((pre > 0) & (pre < 1)).all() and ((post > 0) & (post < 2)).all()
    assert (res >= 0).all()
    row_error, column_error = doubly_stochastic_error(res)
    assert row_error < 1e-5 and column_error < 5e-2  # logits here have std > 1, so columns lag


# ---------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("cls", [HyperConnection, ManifoldHyperConnection])
def test_token_layout_b_t_c_keeps_its_shape_through_expand_stack_collapse(cls):
    x = torch.randn(2, 7, WIDTH)
    streams = expand_streams(x, 4)
    assert streams.shape == (2, 7, 4, WIDTH)
    out = stack(cls, 2)(streams)
    assert out.shape == (2, 7, 4, WIDTH)
    assert collapse_streams(out).shape == (2, 7, WIDTH)


@pytest.mark.parametrize("cls", [HyperConnection, ManifoldHyperConnection])
def test_image_layout_b_c_h_w_with_a_conv_branch_equals_the_same_layer_on_channels_last(cls):
    conv = nn.Sequential(nn.Conv2d(WIDTH, WIDTH, 3, padding=1), nn.GELU())
    layer = cls(conv, WIDTH, n_streams=4, channel_dim=1)
    images = torch.randn(2, WIDTH, 5, 6)
    streams = expand_streams(images, 4, channel_dim=1)
    assert streams.shape == (2, 4, WIDTH, 5, 6)
    out = layer(streams)
    assert out.shape == (2, 4, WIDTH, 5, 6)
    assert collapse_streams(out, channel_dim=1).shape == (2, WIDTH, 5, 6)

    class ChannelsLastConv(nn.Module):  # the same conv, fed (B, H, W, C)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)

    tokens = cls(ChannelsLastConv(), WIDTH, n_streams=4)
    tokens.load_state_dict(
        {k: v for k, v in layer.state_dict().items() if not k.startswith("branch.")}, strict=False
    )
    channels_last = tokens(streams.permute(0, 3, 4, 1, 2))  # (B, H, W, n, C)
    torch.testing.assert_close(out, channels_last.permute(0, 3, 4, 1, 2), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- n = 1
@pytest.mark.parametrize("cls", [HyperConnection, ManifoldHyperConnection])
@pytest.mark.parametrize("shape, channel_dim", [((2, 7, WIDTH), -1), ((2, WIDTH, 3, 4), 1)])
def test_one_stream_equals_the_plain_residual_bit_for_bit(cls, shape, channel_dim):
    branch = nn.Conv2d(WIDTH, WIDTH, 1) if channel_dim == 1 else mlp_branch()
    layer = cls(branch, WIDTH, n_streams=1, channel_dim=channel_dim)
    assert sum(p.numel() for p in layer.parameters()) == sum(p.numel() for p in branch.parameters())
    x = torch.randn(*shape)
    out = collapse_streams(layer(expand_streams(x, 1, channel_dim=channel_dim)), channel_dim=channel_dim)
    assert torch.equal(out, x + branch(x))
    assert torch.equal(out, PlainResidual(branch)(x))


def test_charlm_mhc_with_one_stream_is_bit_identical_to_the_plain_model():
    from examples.charlm import CharTransformerLM

    tokens = torch.randint(0, 128, (2, 16))
    torch.manual_seed(0)
    plain = CharTransformerLM(d_model=32, n_layers=2, seq_len=16, residual="plain")
    torch.manual_seed(0)
    one_stream = CharTransformerLM(d_model=32, n_layers=2, seq_len=16, residual="mhc", n_streams=1)
    assert torch.equal(plain(tokens), one_stream(tokens))


@pytest.mark.parametrize("residual", ["hc", "mhc"])
def test_charlm_hyper_connected_variants_train_and_expose_their_layers(residual):
    from examples.charlm import CharTransformerLM

    model = CharTransformerLM(
        d_model=32, n_layers=2, seq_len=16, residual=residual, n_streams=4, sinkhorn_iters=7
    )
    layers = [m for m in model.modules() if isinstance(m, HyperConnection)]
    assert all(type(m) is (ManifoldHyperConnection if residual == "mhc" else HyperConnection) for m in layers)
    assert all(m.n_streams == 4 for m in layers)
    assert residual == "hc" or all(m.sinkhorn_iters == 7 for m in layers)
    tokens = torch.randint(0, 128, (2, 16))
    with HyperConnectionRecorder(model) as recorder:
        logits = model(tokens)
    assert logits.shape == (2, 16, 128)
    assert len(recorder.h_res) == 4  # attention + MLP branch per block
    logits.sum().backward()
    assert all(layer.b_res.grad is not None for layer in recorder.layers)


# ---------------------------------------------------------------------------------------------- init
def test_initial_coefficients_read_the_mean_write_the_stream_weights_and_mix_near_identity():
    layer = ManifoldHyperConnection(mlp_branch(), WIDTH, n_streams=4, alpha_init=0.0)
    pre, post, res = layer.coefficients(torch.randn(1, 1, 4, WIDTH))
    torch.testing.assert_close(pre[0, 0], torch.full((4,), 0.25))
    torch.testing.assert_close(post[0, 0], stream_weights(4))
    expected = torch.full((4, 4), 0.1 / 3) + torch.eye(4) * (0.9 - 0.1 / 3)
    torch.testing.assert_close(res[0, 0], expected)
    assert float(off_diagonal_mass(res.detach()).mean()) == pytest.approx(0.1, abs=1e-6)


@pytest.mark.parametrize("cls", [HyperConnection, ManifoldHyperConnection])
def test_without_dynamic_terms_the_stream_mean_follows_the_plain_residual_network(cls):
    layers = stack(cls, 6, branch=pre_norm_branch, alpha_init=0.0)
    x = torch.randn(2, 5, WIDTH)
    plain = x
    for layer in layers:
        plain = plain + layer.branch(plain)
    torch.testing.assert_close(collapse_streams(layers(expand_streams(x, 4))), plain, atol=1e-5, rtol=1e-5)


def _step0_gradients(layers: nn.Sequential, spread: float = 0.5) -> list[dict[str, float]]:
    x = torch.randn(4, 8, WIDTH)
    collapse_streams(layers(expand_streams(x, 4, spread=spread))).pow(2).mean().backward()
    return [
        {name: float(getattr(layer, name).grad.abs().max()) for name in COEFFICIENT_PARAMETERS + GATES}
        for layer in layers
    ]


@pytest.mark.parametrize("cls", [HyperConnection, ManifoldHyperConnection])
def test_gradients_reach_phi_b_and_alpha_of_every_layer_at_step_zero(cls):
    # Both traps below leave gradients at 1e-11..1e-12 (rounding noise) for this loss; phi gets alpha = 0.01
    # times the gradient of b, so 1e-8 separates "small because alpha is small" from "trapped".
    for layer_grads in _step0_gradients(stack(cls, 6)):
        for name, magnitude in layer_grads.items():
            assert magnitude > 1e-8, (name, magnitude)


def test_an_adam_step_moves_the_projection_by_lr_over_sqrt_nc_so_high_lrs_keep_h_res_logits_bounded():
    # phi is stored at unit scale: Adam's first step moves every entry by lr, so the projection it stands for
    # (phi_scale * phi, scale 1/sqrt(nC)) moves by lr/sqrt(nC), the same relative step as a unit-scale weight.
    layer = ManifoldHyperConnection(mlp_branch(), WIDTH, n_streams=4)
    effective = layer.phi_res.detach() * layer.phi_scale
    assert float(effective.std()) == pytest.approx(1 / math.sqrt(4 * WIDTH), rel=0.1)
    optimizer = torch.optim.Adam([layer.phi_res], lr=0.03)
    layer(expand_streams(torch.randn(2, 5, WIDTH), 4)).pow(2).sum().backward()
    optimizer.step()
    change = (layer.phi_res.detach() * layer.phi_scale - effective).abs()
    assert float(change.amax()) == pytest.approx(0.03 / math.sqrt(4 * WIDTH), rel=1e-3)


def test_far_apart_h_res_logits_fall_into_the_zero_gradient_trap_the_default_init_avoids():
    default = _step0_gradients(stack(ManifoldHyperConnection, 4))
    torch.manual_seed(0)
    saturated = _step0_gradients(stack(ManifoldHyperConnection, 4, res_init_diagonal=1 - 1e-7))
    for good, trapped in zip(default, saturated):
        assert trapped["b_res"] < 1e-3 * good["b_res"]
        assert trapped["phi_res"] < 1e-3 * good["phi_res"]


def test_identical_stream_copies_would_leave_the_first_h_res_without_gradient():
    # A doubly stochastic H_res maps identical streams to themselves, whatever its entries.
    copies = _step0_gradients(stack(ManifoldHyperConnection, 2, spread=0.0), spread=0.0)
    assert copies[0]["b_res"] < 1e-7
    torch.manual_seed(0)
    spread = _step0_gradients(stack(ManifoldHyperConnection, 2))
    assert spread[0]["b_res"] > 1e-5


# ---------------------------------------------------------------------------------------------- precision, compile
def test_coefficients_stay_fp32_and_forward_runs_under_bf16_autocast():
    layer = ManifoldHyperConnection(mlp_branch(), WIDTH, n_streams=4)
    streams = expand_streams(torch.randn(2, 5, WIDTH), 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        coefficients = layer.coefficients(streams)
        out = layer(streams)
    assert coefficients.res.dtype == torch.float32
    assert doubly_stochastic_error(coefficients.res)[0] < 1e-5
    assert out.shape == streams.shape and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), layer(streams), atol=0.1, rtol=0.05)


def _values_and_gradients(fn, layers: nn.Module, streams: torch.Tensor, upstream: torch.Tensor):
    layers.zero_grad()
    x = streams.clone().requires_grad_()
    out = fn(x)
    out.backward(upstream)
    return out.detach(), x.grad, {name: p.grad.clone() for name, p in layers.named_parameters()}


def _assert_compiled_matches_eager(layers: nn.Module, backend: str, rtol: float, atol: float) -> None:
    streams = expand_streams(torch.randn(2, 5, WIDTH), 4)
    upstream = torch.randn_like(streams)
    # fullgraph: a graph break (data-dependent branch, .item(), an untraceable Function) raises
    compiled = torch.compile(layers, backend=backend, fullgraph=True)
    eager = _values_and_gradients(layers, layers, streams, upstream)
    traced = _values_and_gradients(compiled, layers, streams, upstream)
    torch.testing.assert_close(traced[0], eager[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(traced[1], eager[1], rtol=rtol, atol=atol)  # through both layers
    assert set(traced[2]) == set(eager[2])
    for name, eager_grad in eager[2].items():
        assert eager_grad.abs().sum() > 0, (
            name
        )  # every parameter takes part, so the comparison means something
        torch.testing.assert_close(traced[2][name], eager_grad, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("cls", [ManifoldHyperConnection, HyperConnection])
def test_torch_compile_traces_the_layer_as_one_graph_and_matches_eager_in_value_and_gradient(cls):
    torch._dynamo.reset()
    # two layers: the stream gradient between them goes through the traced in-place buffer updates
    layers = stack(cls, 2, branch=pre_norm_branch, alpha_init=0.3)
    _assert_compiled_matches_eager(layers, "aot_eager", rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_inductor_compiles_an_mhc_layer_that_matches_eager_in_value_and_gradient():
    torch._dynamo.reset()
    # one layer with a linear branch; still about 100 s wall with a cold inductor cache on the loaded 2-core
    # machine (C++ code generation and compilation), hence slow
    layers = ManifoldHyperConnection(nn.Linear(WIDTH, WIDTH), WIDTH, alpha_init=0.3)
    # inductor fuses and reorders fp32 reductions: agreement to rounding, not bit for bit
    _assert_compiled_matches_eager(layers, "inductor", rtol=1e-4, atol=1e-5)


def test_bf16_parameters_and_streams_run_and_keep_h_res_doubly_stochastic_in_fp32():
    layer = ManifoldHyperConnection(mlp_branch(), WIDTH).to(torch.bfloat16)
    streams = expand_streams(torch.randn(2, 3, WIDTH), 4).bfloat16()
    out = layer(streams)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    res = layer.coefficients(streams).res
    assert res.dtype == torch.float32 and doubly_stochastic_error(res)[0] < 1e-5


# ---------------------------------------------------------------------------------------------- diagnostics
def test_composite_gain_multiplies_in_depth_order_and_reads_rows_forward_columns_backward():
    first = torch.tensor([[1.0, 0.0], [3.0, 1.0]])  # column sums 4, 1; row sums 1, 4
    second = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    forward, backward = composite_gain([first, second])
    product = second @ first  # [[2, 0], [3, 1]]
    assert float(forward) == 4.0 == float(product.abs().sum(-1).max())
    assert float(backward) == 5.0 == float(product.abs().sum(-2).max())


def test_off_diagonal_mass_is_zero_for_identity_and_n_minus_one_over_n_for_uniform_mixing():
    assert float(off_diagonal_mass(torch.eye(4))) == 0.0
    assert float(off_diagonal_mass(torch.full((4, 4), 0.25))) == pytest.approx(0.75)


def test_stack_diagnostics_start_a_new_stack_when_the_position_shape_changes():
    big = sinkhorn_knopp(torch.randn(2, 8, 4, 4))
    small = torch.eye(4).expand(2, 2, 4, 4) * 3
    stats = stack_diagnostics([big, big, small, small])
    assert stats["stacks"] == 2
    assert stats["forward_gain"] == pytest.approx(9.0)
    assert len(stats["off_diagonal_mass"]) == 4


def test_recorder_sees_layers_in_call_order_and_leaves_outputs_unchanged():
    layers = stack(HyperConnection, 3)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.b_res.copy_(torch.eye(4) * (i + 2))  # layer i scales every stream by i + 2
            layer.alpha_res.zero_()
    streams = expand_streams(torch.randn(2, 3, WIDTH), 4)
    expected = layers(streams)
    with HyperConnectionRecorder(layers) as recorder:
        out = layers(streams)
    assert torch.equal(out, expected)
    assert [float(m[0, 0, 0, 0]) for m in recorder.h_res] == [2.0, 3.0, 4.0]
    stats = recorder.diagnostics()
    assert stats["forward_gain"] == pytest.approx(24.0) and stats["backward_gain"] == pytest.approx(24.0)
    layers(streams)  # detached: nothing more is recorded
    assert len(recorder.h_res) == 3


def test_hc_composite_gain_grows_with_depth_while_mhc_stays_at_one_for_the_same_logits():
    depth, n = 32, 4
    logits = torch.eye(n) + torch.randn(depth, n, n) * 0.3
    hc_forward, _ = composite_gain(list(logits))
    mhc_forward, mhc_backward = composite_gain(list(sinkhorn_knopp(logits)))
    assert float(hc_forward) > 10
    assert float(mhc_forward) == pytest.approx(1.0, abs=1e-4)
    assert float(mhc_backward) == pytest.approx(1.0, abs=1e-2)


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dim": 0}, "dim"),
        ({"n_streams": 0}, "n_streams"),
        ({"sinkhorn_iters": 0}, "sinkhorn_iters"),
        ({"res_init_diagonal": 0.2}, "res_init_diagonal"),
        ({"res_init_diagonal": 1.0}, "res_init_diagonal"),
        ({"alpha_init": -0.1}, "alpha_init"),
        ({"spread": 1.0}, "spread"),
    ],
)
def test_bad_arguments_fail_at_construction_naming_the_field(kwargs, field):
    arguments = {"branch": mlp_branch(), "dim": WIDTH, **kwargs}
    with pytest.raises(ValueError, match=f"`{field}`"):
        ManifoldHyperConnection(**arguments)


def test_residual_connection_builds_each_kind_and_rejects_unknown_ones():
    assert isinstance(residual_connection("plain", mlp_branch(), WIDTH), PlainResidual)
    assert type(residual_connection("hc", mlp_branch(), WIDTH)) is HyperConnection
    assert isinstance(
        residual_connection("mhc", mlp_branch(), WIDTH, sinkhorn_iters=5), ManifoldHyperConnection
    )
    with pytest.raises(ValueError, match="`residual`='dense'"):
        residual_connection("dense", mlp_branch(), WIDTH)


def test_charlm_rejects_an_unknown_residual_kind():
    from examples.charlm import CharTransformerLM

    with pytest.raises(ValueError, match="`residual`"):
        CharTransformerLM(residual="dense")
    with pytest.raises(ValueError, match="`n_streams`"):
        CharTransformerLM(residual="mhc", n_streams=0)


def test_stream_weights_have_mean_one_so_collapse_inverts_expand():
    for n in (1, 2, 4, 7):
        assert float(stream_weights(n).mean()) == pytest.approx(1.0)
    x = torch.randn(2, 3, WIDTH)
    torch.testing.assert_close(collapse_streams(expand_streams(x, 4)), x)
    assert math.isclose(float(stream_weights(4)[0]), 0.5) and math.isclose(float(stream_weights(4)[-1]), 1.5)


# ---------------------------------------------------------------------------------------------- hand-written backwards
def test_hand_written_backwards_match_numerical_gradients_in_double_precision():
    from lightning_pulse.nn.hyper_connections import _AddBranch, _MixStreams, _RMSNormalizedProjection

    generator = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    for positions, n, width in ((5, 3, 4), (3, 4, 19)):
        assert torch.autograd.gradcheck(
            _MixStreams.apply, (leaf(positions, n), leaf(positions, n, n), leaf(positions, n, width))
        )
        # _AddBranch writes into its first input, so each evaluation gets a fresh copy of it
        assert torch.autograd.gradcheck(
            lambda mixed, post, branch_output: _AddBranch.apply(mixed.clone(), post, branch_output),
            (leaf(positions, n, width), leaf(positions, n), leaf(positions, width)),
        )
        # both outputs count: the projection and the streams passed through (whose gradient it adds to)
        assert torch.autograd.gradcheck(
            lambda streams, phi: _RMSNormalizedProjection.apply(streams, phi, 1e-6),
            (leaf(positions, n, width), leaf(n * width, 7)),
        )


@pytest.mark.parametrize("cls", [ManifoldHyperConnection, HyperConnection])
def test_the_fused_layer_backward_equals_autograd_through_the_unfused_equation(cls):
    # Reference: Eq. 3 and Eq. 7 written with plain differentiable ops, reading one shared x three times.
    layer = cls(mlp_branch(), WIDTH, n_streams=4, alpha_init=0.3).double()
    streams = torch.randn(2, 5, 4, WIDTH, dtype=torch.float64)
    grad = torch.randn_like(streams)

    def reference(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, 4 * WIDTH)
        phi = torch.cat((layer.phi_pre, layer.phi_post, layer.phi_res), dim=1) * layer.phi_scale
        normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + layer.eps)
        pre, post, res = (normed @ phi).split((4, 4, 16), dim=-1)
        maps = layer._coefficient_maps(pre, post, res.unflatten(-1, (4, 4)))
        pre, post, res = (c.to(x.dtype) for c in maps)  # Sinkhorn returns fp32, as in the layer
        matrices = x.reshape(-1, 4, WIDTH)
        branch = layer.branch(torch.einsum("pn,pnc->pc", pre, matrices))
        out = torch.einsum("pij,pjc->pic", res, matrices) + torch.einsum("pn,pc->pnc", post, branch)
        return out.view_as(x)

    results = []
    for fn in (layer, reference):
        x = streams.clone().requires_grad_()
        layer.zero_grad()
        fn(x).backward(grad)
        results.append((x.grad, {name: p.grad.clone() for name, p in layer.named_parameters()}))
    (fused_x, fused_params), (ref_x, ref_params) = results
    torch.testing.assert_close(fused_x, ref_x, rtol=1e-5, atol=1e-6)
    for name in ref_params:
        torch.testing.assert_close(fused_params[name], ref_params[name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------- sweep A fixes
@pytest.mark.parametrize("cls", [HyperConnection, ManifoldHyperConnection])
@pytest.mark.parametrize(
    "shape, channel_dim", [((0, 5, WIDTH), -1), ((2, 0, WIDTH), -1), ((0, WIDTH, 3, 3), 1)]
)
def test_inputs_with_zero_positions_give_empty_outputs_and_gradients(cls, shape, channel_dim):
    branch = nn.Conv2d(WIDTH, WIDTH, 1) if channel_dim == 1 else mlp_branch()
    layer = cls(branch, WIDTH, n_streams=4, channel_dim=channel_dim)
    streams = expand_streams(torch.randn(*shape), 4, channel_dim=channel_dim).requires_grad_()
    out = layer(streams)
    assert out.shape == streams.shape
    out.sum().backward()
    assert streams.grad.shape == streams.shape
    positions = [size for axis, size in enumerate(shape) if axis != channel_dim % len(shape)]
    assert layer.coefficients(streams.detach()).res.shape == (*positions, 4, 4)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"eps": 0.0}, "eps"),
        ({"eps": -1.0}, "eps"),
        ({"eps": float("nan")}, "eps"),
        ({"alpha_init": float("nan")}, "alpha_init"),
        ({"alpha_init": float("inf")}, "alpha_init"),
        ({"channel_dim": "1"}, "channel_dim"),
        ({"channel_dim": 1.0}, "channel_dim"),
        ({"res_init_diagonal": "0.9"}, "res_init_diagonal"),
        ({"res_init_diagonal": None}, "res_init_diagonal"),
        ({"res_init_diagonal": float("nan")}, "res_init_diagonal"),
    ],
)
def test_unchecked_arguments_of_the_sweep_fail_at_construction_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        ManifoldHyperConnection(mlp_branch(), WIDTH, **kwargs)


def test_an_out_of_range_channel_dim_is_refused_instead_of_wrapping_around():
    with pytest.raises(ValueError, match=r"`channel_dim`=5 is out of range for a 3-D tensor"):
        expand_streams(torch.randn(2, 3, WIDTH), 4, channel_dim=5)
    with pytest.raises(ValueError, match=r"`channel_dim`=-4 is out of range"):
        collapse_streams(torch.randn(2, 3, 4, WIDTH), channel_dim=-4)
    layer = HyperConnection(mlp_branch(), WIDTH, n_streams=4, channel_dim=3)
    with pytest.raises(ValueError, match=r"HyperConnection: `channel_dim`=3 is out of range"):
        layer(torch.randn(2, 3, 4, WIDTH))


def test_integer_like_numpy_and_torch_scalars_are_accepted_where_ints_are_required():
    np = pytest.importorskip("numpy")
    layer = ManifoldHyperConnection(
        mlp_branch(), np.int64(WIDTH), torch.tensor(4), sinkhorn_iters=np.int32(5)
    )
    assert (layer.dim, layer.n_streams, layer.sinkhorn_iters) == (WIDTH, 4, 5)
    assert type(layer.dim) is int and type(layer.n_streams) is int
    assert layer(expand_streams(torch.randn(2, 3, WIDTH), np.int64(4))).shape == (2, 3, 4, WIDTH)


@pytest.mark.parametrize(
    "layer, streams",
    [
        (
            lambda: ManifoldHyperConnection(mlp_branch(), WIDTH, 4),
            lambda: torch.randn(2, 7, WIDTH),
        ),  # no expand
        (lambda: ManifoldHyperConnection(mlp_branch(32), 32, 4), lambda: torch.randn(2, 7, 4, WIDTH)),  # dim
        (lambda: HyperConnection(mlp_branch(), WIDTH, 2), lambda: torch.randn(2, 7, 4, WIDTH)),  # n_streams
        (
            lambda: HyperConnection(mlp_branch(), WIDTH, 1),
            lambda: torch.randn(2, 7, WIDTH),
        ),  # n = 1, no expand
        (  # image streams with channel_dim left at -1
            lambda: ManifoldHyperConnection(nn.Conv2d(8, 8, 1), 8, 4),
            lambda: torch.randn(2, 4, 8, 6, 6),
        ),
    ],
)
def test_streams_that_do_not_match_n_streams_and_dim_raise_a_message_naming_the_layer_and_the_cause(
    layer, streams
):
    layer, streams = layer(), streams()
    name = type(layer).__name__
    expected = rf"{name}\(dim=.*expects streams.*got {re.escape(str(tuple(streams.shape)))}"
    with pytest.raises(ValueError, match=expected) as error:
        layer(streams)
    assert "expand_streams" in str(error.value) and "channel_dim" in str(error.value)


def test_recorder_measures_a_layer_called_with_its_streams_as_a_keyword():
    layers = stack(ManifoldHyperConnection, 2)
    streams = expand_streams(torch.randn(2, 3, WIDTH), 4)
    with HyperConnectionRecorder(layers) as recorder:
        layers[1](streams=layers[0](streams=streams))
    assert len(recorder.h_res) == 2
    torch.testing.assert_close(recorder.h_res[1], layers[1].coefficients(layers[0](streams)).res)


def test_recorder_scores_each_forward_pass_on_its_own_when_a_layer_recurs():
    layers = stack(HyperConnection, 2, alpha_init=0.0)
    with torch.no_grad():
        for layer in layers:
            layer.b_res.copy_(1.5 * torch.eye(4))  # forward gain 1.5 per layer: 2.25 over the stack
    streams = expand_streams(torch.randn(2, 3, WIDTH), 4)
    with HyperConnectionRecorder(layers) as recorder:
        layers(streams)
        layers(streams * 2)  # a second forward pass of the same model
    stats = recorder.diagnostics()
    assert stats["passes"] == 2 and len(recorder.h_res) == 4
    assert stats["forward_gain"] == pytest.approx(2.25)  # not 1.5 ** 4 = 5.06 chained over both passes
    assert len(stats["off_diagonal_mass"]) == 2  # one per layer


def test_recorder_keeps_a_looped_weight_shared_layer_in_one_pass():
    # ALBERT-style: one layer applied to its own output four times is a four-deep stack (a review of this
    # pass: splitting a pass at every repeated call scored it 1.5, hiding the HC gain growth the monitor is
    # for)
    layer = HyperConnection(mlp_branch(), WIDTH, 4, alpha_init=0.0)
    with torch.no_grad():
        layer.b_res.copy_(1.5 * torch.eye(4))
    streams = expand_streams(torch.randn(2, 3, WIDTH), 4)
    with HyperConnectionRecorder(layer) as recorder:
        for _ in range(4):
            streams = layer(streams)
    stats = recorder.diagnostics()
    assert stats["passes"] == 1 and stats["forward_gain"] == pytest.approx(1.5**4)


def test_recorder_hooks_stay_registered_but_idle_while_stopped():
    layers = stack(ManifoldHyperConnection, 2)
    streams = expand_streams(torch.randn(2, 3, WIDTH), 4)
    recorder = HyperConnectionRecorder(layers).attach()
    recorder.stop()
    layers(streams)
    assert recorder.h_res == [] and all(len(layer._forward_hooks) == 1 for layer in layers)
    recorder.start()
    layers(streams)
    assert len(recorder.h_res) == 2
    recorder.detach()
    assert all(len(layer._forward_hooks) == 0 for layer in layers)


# ---------------------------------------------------------------------------------------------- sweep D fixes
def test_a_nan_position_makes_the_gains_nan_whichever_stack_or_pass_it_is_in():
    # Python's max(1.0, nan) is 1.0: a NaN H_res read as a healthy gain of 1 (or 0.0 from the start value)
    healthy, poisoned = torch.eye(4).expand(3, 4, 4), torch.eye(4).expand(3, 4, 4).clone()
    poisoned[1, 0, 0] = math.nan  # one position of the second stack
    stats = stack_diagnostics([torch.eye(4).expand(5, 4, 4), healthy, poisoned])
    assert stats["stacks"] == 2 and math.isnan(stats["forward_gain"]) and math.isnan(stats["backward_gain"])

    layers = stack(ManifoldHyperConnection, 2)
    tokens = torch.randn(2, 3, WIDTH)
    with HyperConnectionRecorder(layers) as recorder:
        layers(expand_streams(tokens, 4))  # a finite first pass ...
        tokens[1, 2, 0] = math.nan
        layers(expand_streams(tokens, 4))  # ... then one NaN token in the second
    stats = recorder.diagnostics()
    assert stats["passes"] == 2
    assert math.isnan(stats["forward_gain"]) and math.isnan(stats["backward_gain"])
    assert math.isnan(stats["stream_rms"])


class SwapsLastTwoAxes(nn.Module):
    """A branch whose output has its input's elements in another layout: ``(B, T, C)`` -> ``(B, C, T)`` (a
    Conv1d token block missing its transpose back), ``(B, C, H, W)`` -> ``(B, C, W, H)``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).transpose(-1, -2)


class ReturnsOutputAndWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attention(x, x, x)


@pytest.mark.parametrize("cls", [ManifoldHyperConnection, HyperConnection])
@pytest.mark.parametrize(
    "branch, x_shape, channel_dim, expected",
    [
        (
            lambda: SwapsLastTwoAxes(nn.Linear(WIDTH, WIDTH)),
            (2, 5, WIDTH),
            -1,
            r"shape \(2, 16, 5\) for a branch input of shape \(2, 5, 16\)",
        ),
        (
            lambda: SwapsLastTwoAxes(nn.Conv2d(WIDTH, WIDTH, 1)),
            (2, WIDTH, 3, 4),
            1,
            r"shape \(2, 16, 4, 3\) for a branch input of shape \(2, 16, 3, 4\)",
        ),
        (ReturnsOutputAndWeights, (2, 5, WIDTH), -1, r"a tuple, not a tensor.*must be unwrapped"),
    ],
)
def test_a_branch_output_not_of_the_branch_input_shape_is_refused_naming_the_layer_and_both_shapes(
    cls, branch, x_shape, channel_dim, expected
):
    # same element count in another layout: reshaped into the streams, scrambled, where x + F(x) refuses
    layer = cls(branch(), WIDTH, 4, channel_dim=channel_dim)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}: the branch returned .*{expected}"):
        layer(expand_streams(torch.randn(x_shape), 4, channel_dim=channel_dim))


def _legacy_state_dict(layer: HyperConnection) -> dict[str, torch.Tensor]:
    """``layer``'s state as saved before the state_dict version: torch's default version 1, no variant."""
    state = layer.state_dict()
    for metadata in state._metadata.values():
        metadata.pop("hyper_connection", None)
        metadata["version"] = 1
    return state


def test_a_pre_unit_scale_phi_state_dict_warns_and_the_documented_rescale_restores_its_function():
    # Before commit adeed8c (2026-11-29) phi was stored at N(0, 1/(nC)) and used unscaled; the layer now
    # multiplies it by phi_scale = 1/sqrt(nC). Such a state_dict loaded silently into a different function.
    torch.manual_seed(0)
    n, width = 4, 4 * WIDTH
    old = ManifoldHyperConnection(pre_norm_branch(), WIDTH, n)
    old.phi_scale = 1.0  # the old layer's forward: phi used as stored
    with torch.no_grad():
        for name in ("phi_pre", "phi_post", "phi_res"):
            getattr(old, name).copy_(torch.randn_like(getattr(old, name)) / math.sqrt(width))
        old.alpha_res.fill_(0.6), old.alpha_pre.fill_(0.3), old.alpha_post.fill_(0.3)  # as trained
    state = _legacy_state_dict(old)
    x = expand_streams(torch.randn(2, 8, WIDTH), n)

    new = ManifoldHyperConnection(pre_norm_branch(), WIDTH, n)
    with pytest.warns(
        UserWarning, match=r"saved before 2026-11-29.*multiply phi_pre, phi_post and phi_res by sqrt"
    ):
        new.load_state_dict(state)
    assert (new(x) - old(x)).abs().max() > 0.1  # what loading as-is computes

    for name in ("phi_pre", "phi_post", "phi_res"):  # the migration in docs/mhc.md
        state[name] = state[name] * state[name].shape[0] ** 0.5
    new.load_state_dict(state)
    torch.testing.assert_close(new(x), old(x), atol=1e-5, rtol=1e-5)


def test_the_small_phi_warning_says_how_to_tell_a_shrunk_current_phi_from_an_old_one_before_rescaling():
    # sweep s44 (note): a current-layout phi that training shrank (long weight decay) below (nC)^-1/4 got the
    # same advice, "multiply phi by sqrt(nC)", which followed would corrupt its weights. The warning stays
    # (metadata cannot tell the two apart) and says how to tell them apart before acting.
    torch.manual_seed(0)
    layer = ManifoldHyperConnection(pre_norm_branch(), WIDTH, 4)
    with torch.no_grad():
        for name in ("phi_pre", "phi_post", "phi_res"):
            getattr(layer, name).mul_(0.1)  # current layout, shrunk
    state = _legacy_state_dict(layer)
    with pytest.warns(UserWarning, match="saved before 2026-11-29") as caught:
        ManifoldHyperConnection(pre_norm_branch(), WIDTH, 4).load_state_dict(state)
    (message,) = [str(w.message) for w in caught if "phi has RMS" in str(w.message)]
    assert "only if it was saved before 2026-11-29" in message
    assert "weight decay" in message and "load it as it is" in message  # the other case, and what to do
    assert "version 2" in message and "the loss" in message  # two ways to tell


@pytest.mark.parametrize("cls", [ManifoldHyperConnection, HyperConnection])
def test_current_state_dicts_load_without_a_warning_also_those_saved_before_the_version(cls):
    torch.manual_seed(0)
    trained = cls(mlp_branch(), WIDTH, 4)
    with torch.no_grad():
        for name in ("phi_pre", "phi_post", "phi_res"):
            getattr(trained, name).mul_(1.5)  # a unit-scale phi after some training
    state = trained.state_dict()
    assert state._metadata[""] == {"version": 2, "hyper_connection": trained._variant}
    for saved in (state, _legacy_state_dict(trained)):  # since adeed8c and before this version
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cls(mlp_branch(), WIDTH, 4).load_state_dict(saved)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [(HyperConnection, ManifoldHyperConnection), (ManifoldHyperConnection, HyperConnection)],
)
def test_an_hc_state_dict_is_refused_by_an_mhc_layer_and_the_other_way_round(saved, loaded):
    # same names and shapes, but b_* are coefficients in HC and logits in mHC: loaded silently before
    state = nn.Sequential(saved(mlp_branch(), WIDTH, 4)).state_dict()
    target = nn.Sequential(loaded(mlp_branch(), WIDTH, 4))
    before = target[0].b_res.detach().clone()
    with pytest.raises(RuntimeError, match=rf"{loaded.__name__} at '0' .*cannot load the state of an? "):
        target.load_state_dict(state, strict=False)
    assert torch.equal(target[0].b_res, before)


@pytest.mark.parametrize("cls", [ManifoldHyperConnection, HyperConnection])
def test_a_layer_built_on_the_meta_device_is_initialised_by_to_empty_and_reset_parameters(cls):
    # what Lightning does for ModelParallelStrategy / FSDP2 after configure_model builds on the meta device
    reference = cls(mlp_branch(), WIDTH, 4, alpha_init=0.02, spread=0.3)
    with torch.device("meta"):
        layer = cls(mlp_branch(), WIDTH, 4, alpha_init=0.02, spread=0.3)
    layer.to_empty(device="cpu")
    for module in layer.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for name in ("b_pre", "b_post", "b_res", *GATES):
        torch.testing.assert_close(getattr(layer, name), getattr(reference, name), rtol=0, atol=0)
    for name in ("phi_pre", "phi_post", "phi_res"):
        assert 0.7 < getattr(layer, name).std() < 1.3
    x = expand_streams(torch.randn(2, 3, WIDTH), 4)
    assert torch.isfinite(layer(x)).all()
