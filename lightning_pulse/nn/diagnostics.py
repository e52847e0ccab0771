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

import math
from collections.abc import Iterable, Sequence
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


def _nan_propagating_max(values: Iterable[float]) -> float:
    """The largest of ``values``, or NaN if any is NaN. Python's ``max`` keeps whichever of ``x`` and NaN comes
    first (``max(0.0, nan) == 0.0``), so a NaN gain would be logged as the healthy-looking other value."""
    values = list(values)
    return math.nan if any(math.isnan(value) for value in values) else max(values)


def stack_diagnostics(h_res_stack: Sequence[Tensor]) -> dict[str, Any]:
    """Composite gains (max over positions) and per-layer off-diagonal mass (mean over positions).

    Consecutive layers whose ``H_res`` shapes match form one stack; when the shape changes (e.g. a
    downsampling conv stage with fewer pixels) a new stack starts, and the gains are the maximum over stacks.

    Returns:
        ``{"forward_gain": float, "backward_gain": float, "off_diagonal_mass": [float per layer],
        "stacks": int}``; a gain is NaN when any position's is (NaN streams give a NaN ``H_res``).
    """
    if not h_res_stack:
        raise ValueError("`h_res_stack` must hold at least one matrix.")
    segments: list[list[Tensor]] = [[h_res_stack[0]]]
    for matrix in h_res_stack[1:]:
        if matrix.shape == segments[-1][-1].shape:
            segments[-1].append(matrix)
        else:
            segments.append([matrix])
    gains = [composite_gain(segment) for segment in segments]
    return {
        # torch.amax propagates NaN over positions, _nan_propagating_max over segments
        "forward_gain": _nan_propagating_max(float(forward.amax()) for forward, _ in gains),
        "backward_gain": _nan_propagating_max(float(backward.amax()) for _, backward in gains),
        "off_diagonal_mass": [float(off_diagonal_mass(matrix).mean()) for matrix in h_res_stack],
        "stacks": len(segments),
    }


def _split_passes(layers: Sequence[object], chained: Sequence[bool]) -> list[list[int]]:
    """Indices of ``layers`` (one per recorded call) grouped into forward passes: a pass ends where a layer
    already called in it is called again on streams that are not the previous call's output (a second forward
    pass of the same model, e.g. R-Drop's). A layer applied again to what the previous call returned (a
    weight-shared block looped, ALBERT-style) goes on the same pass: its gains compose."""
    passes: list[list[int]] = []
    seen: set[int] = set()
    for index, layer in enumerate(layers):
        if not passes or (id(layer) in seen and not chained[index]):
            passes.append([])
            seen = set()
        passes[-1].append(index)
        seen.add(id(layer))
    return passes


class HyperConnectionRecorder:
    """Records ``H_res`` of every :class:`HyperConnection` (HC or mHC) layer of a model in call order.

    While recording, a forward hook on each layer recomputes the layer's coefficients from its input under
    ``torch.no_grad`` (so training is unaffected, at the cost of one extra coefficient pass per layer) and
    stores ``H_res`` detached, plus the RMS of the layer's output streams. Layers with ``n_streams=1`` (plain
    residuals) are skipped.

    The hooks stay registered from :meth:`attach` to :meth:`detach` and read the mutable :attr:`recording`
    flag, which :meth:`start` and :meth:`stop` switch. That is what makes recording work inside a
    ``torch.compile``'d model: dynamo guards on the flag, so it keeps one graph that records and one that does
    not, whereas hooks registered anew for each measurement would reuse a graph traced with the old hooks
    (dynamo guards on their number, not their identity) and record nothing.

    Forward passes: when a layer is called again while recording, on streams that are not the previous call's
    output, a new forward pass has begun (a training step that runs the model twice); a layer applied again to
    its own output (a looped, weight-shared block) stays in its pass. :meth:`diagnostics` scores each pass on
    its own.

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
        self.called: list[HyperConnection] = []  # the layer of each record
        self.chained: list[bool] = []  # whether each call's streams were the previous call's output
        self._last_output: Tensor | None = None
        self.recording = False
        self._handles: list[RemovableHandle] = []

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickle) is inert: not recording, nothing recorded, no layers or hooks.

        ``deepcopy`` of a hooked model copies each layer's hook, a bound method of this recorder, and with it
        the recorder. A copy made while recording (an EMA / mean teacher built in a measured training step)
        would otherwise record every later forward of the copied model into lists nobody clears.
        """
        state = self.__dict__.copy()
        state.update(h_res=[], stream_rms=[], called=[], chained=[], _last_output=None, recording=False)
        # no layers: a copy of one submodule would drag copies of the others along; no handles: they point
        # into the original layers' hook dicts. The copied hooks stay on the copied layers, idle.
        state.update(layers=[], _handles=[])
        return state

    def _hook(
        self, layer: HyperConnection, args: tuple[Any, ...], kwargs: dict[str, Any], output: Tensor
    ) -> None:
        if not self.recording:
            return
        streams = args[0] if args else kwargs["streams"]  # layer(streams=h) is a valid call
        with torch.no_grad():
            h_res = layer.coefficients(streams).res.detach()
            if h_res.numel() == 0:
                # a call on zero positions (an MoE expert without tokens) adds nothing to a gain or a mass:
                # its (0, n, n) H_res has no maximum and a NaN mean, and would split the stack it sits in
                return
            # in place, never rebound: a compiled graph replays its appends on these very lists
            self.h_res.append(h_res)
            self.stream_rms.append(output.detach().float().pow(2).mean().sqrt())
            self.called.append(layer)
            self.chained.append(streams is self._last_output)
        self._last_output = output

    def attach(self) -> HyperConnectionRecorder:
        """Register the hooks (once) and start recording (clears what was recorded)."""
        if not self._handles:
            self._handles = [
                layer.register_forward_hook(self._hook, with_kwargs=True) for layer in self.layers
            ]
        return self.start()

    def start(self) -> HyperConnectionRecorder:
        """Clear what was recorded and record the following forward passes (the hooks must be attached)."""
        self.h_res.clear()
        self.stream_rms.clear()
        self.called.clear()
        self.chained.clear()
        self._last_output = None
        self.recording = True
        return self

    def stop(self) -> None:
        """Stop recording; the hooks stay registered (and cost one flag check per layer call)."""
        self.recording = False
        self._last_output = None  # not kept alive past the step

    def detach(self) -> None:
        """Stop recording and remove the hooks; what was recorded stays available."""
        self.recording = False
        self._last_output = None
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> HyperConnectionRecorder:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def diagnostics(self) -> dict[str, Any] | None:
        """What was recorded, scored per forward pass, or ``None`` if nothing was recorded.

        Each pass gets :func:`stack_diagnostics`; the gains and ``"stacks"`` are the maximum over passes,
        ``"off_diagonal_mass"`` holds one value per layer (in order of first call; the mean over that layer's
        calls), ``"layer_index"`` each such layer's position in :attr:`layers`, ``"stream_rms"`` is the
        largest layer-output RMS and ``"passes"`` the number of passes. A gain or ``"stream_rms"`` is NaN when
        any position of any pass has a NaN one.
        """
        if not self.h_res:
            return None
        passes = [
            stack_diagnostics([self.h_res[i] for i in indices])
            for indices in _split_passes(self.called, self.chained)
        ]
        position = {id(layer): index for index, layer in enumerate(self.layers)}
        masses: dict[int, list[float]] = {}
        for layer, matrix in zip(self.called, self.h_res):
            masses.setdefault(id(layer), []).append(float(off_diagonal_mass(matrix).mean()))
        return {
            "forward_gain": _nan_propagating_max(stats["forward_gain"] for stats in passes),
            "backward_gain": _nan_propagating_max(stats["backward_gain"] for stats in passes),
            "off_diagonal_mass": [sum(values) / len(values) for values in masses.values()],
            "layer_index": [position[layer] for layer in masses],
            "stacks": max(stats["stacks"] for stats in passes),
            "passes": len(passes),
            "stream_rms": float(torch.stack(self.stream_rms).amax()),
        }
