"""The total 2-norm of a list of gradients in one native call (StabilityGuard's per-step read on CPU).

On a CPU step of a few milliseconds, torch's fused norm plus one read per 0-d result costs tens of
microseconds in dispatch alone; :func:`host_sum_of_squares` hands every tensor's address to one C function
(``lightning_pulse/_csrc/reductions.c``, built by :mod:`lightning_pulse._native`) instead. It accumulates in
double, as torch's CPU norm does, so the value agrees with ``torch.nn.utils.get_total_norm`` to rounding and
a NaN or infinite entry makes it non-finite.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from lightning_pulse import _native

_bound_to: ctypes.CDLL | None = None
_sum_of_squares_f32: ctypes._CFuncPtr | None = None


def _function() -> ctypes._CFuncPtr | None:
    global _bound_to, _sum_of_squares_f32
    library = _native.library()
    if library is None:
        return None
    if _bound_to is not library:
        function = library.sum_of_squares_f32
        function.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        function.restype = ctypes.c_double
        _bound_to, _sum_of_squares_f32 = library, function
    return _sum_of_squares_f32


def host_sum_of_squares(grads: list[Tensor]) -> float | None:
    """The sum of squares of every entry of ``grads``, or ``None`` where the native path does not apply.

    It applies to contiguous fp32 tensors in host memory (the common case of a CPU run in fp32 or with
    ``bf16-mixed``, whose gradients are fp32); for anything else, or where the kernels could not be built,
    the caller uses torch.
    """
    function = _function()
    if function is None or not grads:
        return None
    pointers, sizes = [], []
    for grad in grads:
        if grad.dtype is not torch.float32 or not grad.is_cpu or grad.is_sparse or not grad.is_contiguous():
            return None
        pointers.append(grad.data_ptr())
        sizes.append(grad.numel())
    count = len(pointers)
    return function(count, (ctypes.c_void_p * count)(*pointers), (ctypes.c_int64 * count)(*sizes))
