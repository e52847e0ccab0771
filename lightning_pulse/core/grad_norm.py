"""One optimizer step's gradient norm and loss, read with one native call (StabilityGuard's hot path on CPU).

On a CPU step of a few milliseconds, torch's fused norm plus one read per 0-d result costs tens of
microseconds in dispatch alone, on caches that the backward pass has just evicted. :class:`HostStepReader`
makes one native call instead: an extension module (``lightning_pulse/_csrc/step_reader.cpp``, C++ against
torch's headers, built by :mod:`lightning_pulse._native`) walks the parameter groups, reads every gradient's
dtype, device, layout, address and size from the tensor itself (no Python binding per gradient) and reads the
loss in the same call. Where it cannot be built (no C++ compiler, no headers) the gradients' addresses go to a
plain C function (``lightning_pulse/_csrc/reductions.c``) through ctypes, which costs some microseconds more
per step (the bytecode loop over the gradients and its bindings, the address array, the ctypes call). It
accumulates in double, as torch's CPU norm does, so the value agrees with ``torch.nn.utils.get_total_norm``
to rounding, and a NaN or infinite entry makes it non-finite.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_pulse import _native

_FLOAT32 = torch.float32
_bound_to: ctypes.CDLL | None = None
_step_reads_f32: ctypes._CFuncPtr | None = None
_extension_read: Callable[..., tuple[float, float | None] | None] | None = None
_extension_resolved = False  # whether `_extension_read` is final (the module loaded, or cannot be)


def _extension_function() -> Callable[..., tuple[float, float | None] | None] | None:
    global _extension_read, _extension_resolved
    module = _native.step_reader()
    _extension_read = module.read_step if module is not None else None
    _extension_resolved = True
    return _extension_read


def prepare() -> None:
    """Build (or load) the extension module now, not inside the first training step (a first build: ~15 s)."""
    if not _extension_resolved:
        _extension_function()


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
    contiguous fp32 tensor in host memory and not a subclass with Python dispatch (the ctypes path declines
    every subclass), checked for each tensor on every call (a parameter's ``.data`` can be swapped for another
    dtype or size mid-run); otherwise, or where the kernels could not be built, the call returns ``None`` and
    the caller reads with torch. A single fp32 loss in host memory (no gradient
    accumulation) is read in the same call; several losses, or a loss of another dtype, are read with
    ``item``. The loss is ``None`` when there is none.

    On the ctypes path each reader owns the buffer the call writes the loss into, so give each training loop
    its own.
    """

    def __init__(self) -> None:
        # its address is taken on every call, never stored: a copied or pickled reader (``ddp_spawn`` pickles
        # the callbacks) gets a new buffer at a new address
        self._loss_out = array("d", (0.0,))

    def __call__(
        self, param_groups: Iterable[dict[str, Any]], losses: Sequence[Tensor]
    ) -> tuple[float, float | None] | None:
        read = _extension_read if _extension_resolved else _extension_function()
        if read is not None:
            reads = read(param_groups, losses)
            if reads is None or reads[1] is not None:
                return reads
            return reads[0], _summed_loss(losses)
        return self._read_with_ctypes(param_groups, losses)

    def _read_with_ctypes(
        self, param_groups: Iterable[dict[str, Any]], losses: Sequence[Tensor]
    ) -> tuple[float, float | None] | None:
        """The same read through the ctypes library, where the extension module could not be built."""
        function = _function()
        if function is None:
            return None
        entries = []  # (address, size) pairs in one list: one array to build, not two
        for group in param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                # a sparse gradient is not contiguous (and has no data pointer); a subclass (one with Python
                # dispatch decides itself what its data means) is left to torch, as the extension leaves it
                if (
                    grad.dtype is not _FLOAT32
                    or not grad.is_cpu
                    or type(grad) is not Tensor
                    or not grad.is_contiguous()
                ):
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
        return squares, _summed_loss(losses)


def _summed_loss(losses: Sequence[Tensor]) -> float | None:
    """The step's loss where the native call did not read it: the micro-batch losses summed with ``item``."""
    return sum(value.item() for value in losses) if losses else None
