"""The fused CPU kernels of lightning_pulse.nn: same values and gradients as the torch path, and a safe fallback."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_pulse import _native
from lightning_pulse.nn import (
    HyperConnection,
    ManifoldHyperConnection,
    _cpu_kernels,
    collapse_streams,
    expand_streams,
    sinkhorn_knopp,
)
from lightning_pulse.nn.hyper_connections import _AddBranch, _MixStreams
from lightning_pulse.nn.sinkhorn import _FusedSinkhornKnopp


@pytest.fixture(scope="module")
def kernels():
    if _native.compiler() is None:
        pytest.skip("no C compiler on this machine: the layers use their torch path (tested elsewhere)")
    loaded = _cpu_kernels.load()
    assert loaded is not None, "the kernels must build wherever a C compiler is installed"
    return loaded


def _leaf(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()


def test_fused_mixing_and_sinkhorn_match_numerical_gradients_in_double_precision(kernels):
    generator = torch.Generator().manual_seed(0)
    # 3 streams (the general loops) and 4 (the specialised ones), widths with and without a remainder
    for positions, n, width in ((5, 3, 19), (3, 4, 32), (3, 4, 19)):
        assert torch.autograd.gradcheck(
            lambda pre, res, streams: _MixStreams.apply(pre, res, streams, kernels),
            (
                _leaf(generator, positions, n),
                _leaf(generator, positions, n, n),
                _leaf(generator, positions, n, width),
            ),
        )
        # _AddBranch writes into its first input, so each evaluation gets a fresh copy of it
        assert torch.autograd.gradcheck(
            lambda mixed, post, branch_output: _AddBranch.apply(mixed.clone(), post, branch_output, kernels),
            (
                _leaf(generator, positions, n, width),
                _leaf(generator, positions, n),
                _leaf(generator, positions, width),
            ),
        )
    # 19 matrices: one full block of 16 and a partial one
    assert torch.autograd.gradcheck(
        lambda logits: _FusedSinkhornKnopp.apply(logits, 7, kernels), (_leaf(generator, 19, 4, 4),)
    )


@pytest.mark.parametrize("std", [1.0, 4.0, 40.0])
def test_fused_sinkhorn_equals_the_torch_path_in_value_and_gradient(kernels, std):
    logits = torch.randn(3, 37, 4, 4, generator=torch.Generator().manual_seed(1)) * std
    grad = torch.randn(3, 37, 4, 4, generator=torch.Generator().manual_seed(2))
    results = []
    for fused in (True, False):
        leaf = logits.clone().requires_grad_()
        out = sinkhorn_knopp(leaf, iters=20, cpu_kernel=fused)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-5)


def test_fused_sinkhorn_keeps_a_nan_logit_visible(kernels):
    logits = torch.randn(2, 4, 4)
    logits[1, 2, 3] = float("nan")
    out = sinkhorn_knopp(logits, cpu_kernel=True)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).any()


def _branch(width: int, channel_dim: int) -> nn.Module:
    if channel_dim == 1:
        return nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.Tanh())
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


@pytest.mark.parametrize("layer_class", [ManifoldHyperConnection, HyperConnection])
@pytest.mark.parametrize(("channel_dim", "width"), [(-1, 20), (-1, 32), (1, 20)])
def test_layers_give_the_same_outputs_and_gradients_with_and_without_the_kernels(
    kernels, layer_class, channel_dim, width
):
    # width 32 takes the kernels' n = 4 fast paths end to end; 20 leaves a remainder after the 16 lanes
    torch.manual_seed(0)
    fused = layer_class(
        _branch(width, channel_dim), width, n_streams=4, channel_dim=channel_dim, alpha_init=0.3
    )
    plain = layer_class(
        _branch(width, channel_dim), width, n_streams=4, channel_dim=channel_dim, alpha_init=0.3
    )
    plain.cpu_kernels = False
    plain.load_state_dict(fused.state_dict())
    shape = (2, 9, width) if channel_dim == -1 else (2, width, 5, 3)
    x = torch.randn(shape)
    grad = torch.randn(expand_streams(x, 4, channel_dim).shape)
    results = []
    for layer in (fused, plain):
        streams = expand_streams(x, 4, channel_dim).requires_grad_()
        out = layer(layer(streams))  # two layers deep: the gradient between them goes through both paths
        out.backward(grad)
        results.append((out.detach(), streams.grad, {k: p.grad for k, p in layer.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-5)
    for name, value in results[1][2].items():
        torch.testing.assert_close(results[0][2][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_threads_split_positions_without_changing_results(kernels):
    generator = torch.Generator().manual_seed(3)
    pre, res = torch.rand(600, 4, generator=generator), torch.rand(600, 4, 4, generator=generator)
    streams = torch.randn(600, 4, 24, generator=generator)
    grad_input, grad_mixed = (
        torch.randn(600, 24, generator=generator),
        torch.randn(600, 4, 24, generator=generator),
    )
    logits = torch.randn(2100, 4, 4, generator=generator)  # 2 threads for Sinkhorn, 2 for the rest
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            outputs.append(
                (
                    *kernels.mix_forward(pre, res, streams),
                    *kernels.mix_backward(pre, res, streams, grad_input, grad_mixed),
                    *kernels.add_branch_backward(pre, grad_input, grad_mixed),
                    kernels.sinkhorn_forward(logits, 20, -60.0),
                    kernels.sinkhorn_backward(logits, logits.cos(), 20, -60.0),
                )
            )
    finally:
        torch.set_num_threads(threads)
    for single, split in zip(*outputs):
        assert torch.equal(single, split)  # positions are independent: the same arithmetic, bit for bit


def test_bf16_streams_and_the_kernels_switch_off_fall_back_to_torch(kernels):
    layer = ManifoldHyperConnection(nn.Linear(8, 8), 8)
    streams = expand_streams(torch.randn(2, 3, 8), 4)
    assert not _cpu_kernels.usable(streams.bfloat16())
    assert _cpu_kernels.usable(streams)
    out = layer.to(torch.bfloat16)(streams.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_cpu_kernels_must_be_a_bool():
    with pytest.raises(ValueError, match="`cpu_kernels`='yes'"):
        ManifoldHyperConnection(nn.Linear(8, 8), 8, cpu_kernels="yes")


def test_a_failing_build_warns_once_and_the_layer_still_trains(monkeypatch, tmp_path):
    # Failure path only: a compiler that always fails stands in for a machine whose build breaks.
    compiler = tmp_path / "broken-cc"
    compiler.write_text("#!/bin/sh\necho 'cc: fatal error: no input files' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    monkeypatch.setenv("LIGHTNING_PULSE_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(_native, "_loaded", None)
    monkeypatch.setattr(_native, "_failed", False)
    layer = ManifoldHyperConnection(nn.Linear(8, 8), 8)
    streams = expand_streams(torch.randn(2, 3, 8), 4)
    with pytest.warns(RuntimeWarning, match="could not be built.*no input files"):
        collapse_streams(layer(streams)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        collapse_streams(layer(streams)).sum().backward()
    assert layer.phi_res.grad is not None and torch.isfinite(layer.phi_res.grad).all()


def test_the_char_lm_passes_cpu_kernels_to_its_layers():
    from examples.charlm import CharTransformerLM

    for setting in (True, False):
        model = CharTransformerLM(d_model=16, n_layers=1, seq_len=8, residual="mhc", cpu_kernels=setting)
        layers = [m for m in model.modules() if isinstance(m, ManifoldHyperConnection)]
        assert len(layers) == 2 and all(layer.cpu_kernels is setting for layer in layers)


def test_an_unwritable_cache_directory_falls_back_to_the_temporary_directory(monkeypatch, tmp_path):
    if _native.compiler() is None:
        pytest.skip("no C compiler on this machine")
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv("LIGHTNING_PULSE_KERNEL_DIR", str(blocked / "kernels"))
    monkeypatch.setattr(_native.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    library = _native.build(_native.compiler())
    assert library.parent.parent == tmp_path / "tmp" and library.exists()
