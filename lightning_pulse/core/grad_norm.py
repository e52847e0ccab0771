"""One optimizer step's gradient norm and loss, read with one native call (StabilityGuard's hot path on CPU).

On a CPU step of a few milliseconds, torch's fused norm plus one read per 0-d result costs tens of
microseconds in dispatch alone, on caches that the backward pass has just evicted. :class:`HostStepReader`
hands every gradient's address to one C function (``lightning_pulse/_csrc/reductions.c``, built by
:mod:`lightning_pulse._native`) instead, and reads the loss in the same call. It accumulates in double, as
torch's CPU norm does, so the value agrees with ``torch.nn.utils.get_total_norm`` to rounding, and a NaN or
infinite entry makes it non-finite.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pulse import _native

_FLOAT32 = torch.float32
_bound_to: ctypes.CDLL | None = None
_step_reads_f32: ctypes._CFuncPtr | None = None


def _function() -> ctypes._CFuncPtr | None:
    global _bound_to, _step_reads_f32
    library = _native.library()
    if library is None:
        return None
    if _bound_to is not library:
        function = library.step_reads_f32
        function.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        function.restype = ctypes.c_double
        _bound_to, _step_reads_f32 = library, function
    return _step_reads_f32


class HostStepReader:
    """Reads an optimizer step's gradient sum of squares and summed loss where one native call can.

    Call it with the optimizer's ``param_groups`` and the step's losses (one per micro-batch). Parameters
    without a gradient are left out, as ``clip_grad_norm_`` leaves them out. Every gradient must be a
    contiguous fp32 tensor in host memory, checked for each tensor on every call (a parameter's ``.data`` can
    be swapped for another dtype or size mid-run); otherwise, or where the kernels could not be built, the
    call returns ``None`` and the caller reads with torch. A single fp32 loss in host memory (no gradient
    accumulation) is read in the same call; several losses, or a loss of another dtype, are read with
    ``item``. The loss is ``None`` when there is none.

    Each reader owns the buffer the call writes the loss into, so give each training loop its own.
    """

    def __init__(self) -> None:
        # its address is taken on every call, never stored: a copied or pickled reader (``ddp_spawn`` pickles
        # the callbacks) gets a new buffer at a new address
        self._loss_out = array("d", (0.0,))

    def __call__(
        self, param_groups: Iterable[dict[str, Any]], losses: Sequence[Tensor]
    ) -> tuple[float, float | None] | None:
        function = _function()
        if function is None:
            return None
        entries = []  # (address, size) pairs in one list: one array to build, not two
        for group in param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                # a sparse gradient is not contiguous (and has no data pointer)
                if grad.dtype is not _FLOAT32 or not grad.is_cpu or not grad.is_contiguous():
                    return None
                entries.append(grad.data_ptr())
                entries.append(grad.numel())
        if not entries:
            return None
        loss_address = 0
        if len(losses) == 1:
            loss = losses[0]
            if loss.dtype is _FLOAT32 and loss.is_cpu and loss.numel() == 1:
                loss_address = loss.data_ptr()
        pairs = array("q", entries)
        loss_out = self._loss_out
        squares = function(len(entries) // 2, pairs.buffer_info()[0], loss_address, loss_out.buffer_info()[0])
        if loss_address:
            return squares, loss_out[0]
        return squares, (sum(value.item() for value in losses) if losses else None)
