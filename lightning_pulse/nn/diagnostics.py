"""Stability diagnostics for hyper-connected stacks: composite gain of the ``H_res`` product, off-diagonal mass.

The composite mapping from the streams entering a stack to the streams leaving it, ignoring the branches, is
``P = H_res^{(L)} ... H_res^{(1)}`` (per token). The mHC paper's "Amax gain magnitude" reads it two ways:

* forward gain: the largest absolute row sum of ``P`` (``||P||_inf``), how much a signal can grow going up;
* backward gain: the largest absolute column sum of ``P`` (``||P||_1``), how much a gradient can grow going
  down.

Both are exactly 1 for products of doubly stochastic matrices and for the identity (the plain residual).
Unconstrained HC products can reach thousands (the paper measures ~3000 in a 27B model).

:class:`HyperConnectionRecorder` collects ``H_res`` from every hyper-connection layer of any model during a
forward pass, through forward hooks, so the model needs no change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_pulse.nn.hyper_connections import HyperConnection


def composite_mapping(h_res_stack: Sequence[Tensor]) -> Tensor:
    """``H_L ... H_1`` (in float64) for a sequence ``[H_1, ..., H_L]`` of ``(..., n, n)`` matrices in depth order."""
    if not h_res_stack:
        raise ValueError("`h_res_stack` must hold at least one matrix.")
    product = h_res_stack[0].double()
    for matrix in h_res_stack[1:]:
        product = matrix.double() @ product
    return product


def composite_gain(h_res_stack: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Forward and backward gain of the composite ``H_res`` mapping, per position.

    Args:
        h_res_stack: ``[H_1, ..., H_L]``, each ``(..., n, n)`` with the same leading shape, in depth order.

    Returns:
        ``(forward_gain, backward_gain)``, each ``(...)``: the largest absolute row sum and the largest absolute
        column sum of ``H_L ... H_1``.
    """
    product = composite_mapping(h_res_stack).abs()
    return product.sum(dim=-1).amax(dim=-1), product.sum(dim=-2).amax(dim=-1)


def off_diagonal_mass(h_res: Tensor) -> Tensor:
    """The share of ``|H_res|`` off the diagonal, per position: 0 keeps streams apart, ``(n-1)/n`` mixes evenly.

    Args:
        h_res: ``(..., n, n)``.

    Returns:
        ``(...)`` values in ``[0, 1]``.
    """
    magnitude = h_res.double().abs()
    total = magnitude.sum(dim=(-2, -1))
    diagonal = magnitude.diagonal(dim1=-2, dim2=-1).sum(dim=-1)
    return (total - diagonal) / total.clamp_min(torch.finfo(torch.float64).tiny)


def stack_diagnostics(h_res_stack: Sequence[Tensor]) -> dict[str, Any]:
    """Composite gains (max over positions) and per-layer off-diagonal mass (mean over positions).

    Consecutive layers whose ``H_res`` shapes match form one stack; when the shape changes (e.g. a
    downsampling conv stage with fewer pixels) a new stack starts, and the gains are the maximum over stacks.

    Returns:
        ``{"forward_gain": float, "backward_gain": float, "off_diagonal_mass": [float per layer],
        "stacks": int}``.
    """
    if not h_res_stack:
        raise ValueError("`h_res_stack` must hold at least one matrix.")
    segments: list[list[Tensor]] = [[h_res_stack[0]]]
    for matrix in h_res_stack[1:]:
        if matrix.shape == segments[-1][-1].shape:
            segments[-1].append(matrix)
        else:
            segments.append([matrix])
    forward = backward = 0.0
    for segment in segments:
        forward_gain, backward_gain = composite_gain(segment)
        forward = max(forward, float(forward_gain.amax()))
        backward = max(backward, float(backward_gain.amax()))
    return {
        "forward_gain": forward,
        "backward_gain": backward,
        "off_diagonal_mass": [float(off_diagonal_mass(matrix).mean()) for matrix in h_res_stack],
        "stacks": len(segments),
    }


class HyperConnectionRecorder:
    """Records ``H_res`` of every :class:`HyperConnection` (HC or mHC) layer of a model in call order.

    While attached, a forward hook on each layer recomputes the layer's coefficients from its input under
    ``torch.no_grad`` (so training is unaffected, at the cost of one extra coefficient pass per layer) and
    stores ``H_res`` detached, plus the RMS of the layer's output streams. Layers with ``n_streams=1`` (plain
    residuals) are skipped.

    Args:
        model: any module containing hyper-connection layers.

    Example::

        >>> with HyperConnectionRecorder(model) as recorder:
        ...     model(x)
        >>> stats = recorder.diagnostics()   # {"forward_gain": ..., "backward_gain": ..., ...}
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, HyperConnection) and m.n_streams > 1]
        self.h_res: list[Tensor] = []
        self.stream_rms: list[Tensor] = []
        self._handles: list[RemovableHandle] = []

    def _hook(self, layer: HyperConnection, args: tuple[Any, ...], output: Tensor) -> None:
        with torch.no_grad():
            self.h_res.append(layer.coefficients(args[0]).res.detach())
            self.stream_rms.append(output.detach().float().pow(2).mean().sqrt())

    def attach(self) -> HyperConnectionRecorder:
        """Start recording (clears what was recorded)."""
        self.detach()
        self.h_res, self.stream_rms = [], []
        self._handles = [layer.register_forward_hook(self._hook) for layer in self.layers]
        return self

    def detach(self) -> None:
        """Stop recording; what was recorded stays available."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> HyperConnectionRecorder:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def diagnostics(self) -> dict[str, Any] | None:
        """:func:`stack_diagnostics` of what was recorded plus ``"stream_rms"`` (the largest layer-output RMS),
        or ``None`` if nothing was recorded."""
        if not self.h_res:
            return None
        return {**stack_diagnostics(self.h_res), "stream_rms": float(torch.stack(self.stream_rms).amax())}
