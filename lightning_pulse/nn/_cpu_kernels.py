"""Fused CPU kernels for the mHC stream operations and Sinkhorn-Knopp (``lightning_pulse/_csrc/mhc_kernels.c``).

Built at first use by :mod:`lightning_pulse._native` (plain C, about a second with the system C compiler,
cached) and called through :mod:`ctypes`. Nothing here is required: where the kernels cannot be built,
:func:`load` returns ``None`` (after one warning) and the layers keep using their torch implementation. The
kernels only take contiguous fp32/fp64 CPU tensors; callers check :func:`usable` first.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from lightning_pulse import _native

_VARIANTS = {torch.float32: ("float", "_f32"), torch.float64: ("double", "_f64")}
_SIZE = ctypes.c_int64
_PTR = ctypes.c_void_p

_loaded: _Kernels | None = None
_bound_to: ctypes.CDLL | None = None


class _Kernels:
    """The loaded library, with typed entry points per dtype."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions: dict[tuple[str, torch.dtype], object] = {}
        signatures = {
            "mix_forward": [_SIZE, _SIZE, _SIZE, _PTR, _PTR, _PTR, _PTR, _PTR, ctypes.c_int],
            "mix_backward": [
                _SIZE,
                _SIZE,
                _SIZE,
                _PTR,
                _PTR,
                _PTR,
                _PTR,
                _PTR,
                _PTR,
                _PTR,
                _PTR,
                ctypes.c_int,
            ],
            "add_branch_backward": [_SIZE, _SIZE, _SIZE, _PTR, _PTR, _PTR, _PTR, _PTR, ctypes.c_int],
            "sinkhorn_forward": [_SIZE, _SIZE, _SIZE, None, _PTR, _PTR, ctypes.c_int],
            "sinkhorn_backward": [_SIZE, _SIZE, _SIZE, None, _PTR, _PTR, _PTR, ctypes.c_int],
        }
        for dtype, (scalar, suffix) in _VARIANTS.items():
            scalar_type = ctypes.c_float if scalar == "float" else ctypes.c_double
            for name, argtypes in signatures.items():
                function = getattr(library, name + suffix)
                function.argtypes = [scalar_type if t is None else t for t in argtypes]
                function.restype = None
                self._functions[(name, dtype)] = function

    def _call(self, name: str, dtype: torch.dtype, *args: object) -> None:
        self._functions[(name, dtype)](*args, torch.get_num_threads())

    def mix_forward(self, pre: Tensor, res: Tensor, streams: Tensor) -> tuple[Tensor, Tensor]:
        """``(P, n)``, ``(P, n, n)``, ``(P, n, C)`` -> ``H_pre x`` ``(P, C)`` and ``H_res x`` ``(P, n, C)``."""
        positions, n, width = streams.shape
        branch_input = streams.new_empty(positions, width)
        mixed = torch.empty_like(streams)
        self._call(
            "mix_forward", streams.dtype, positions, n, width,
            pre.data_ptr(), res.data_ptr(), streams.data_ptr(), branch_input.data_ptr(), mixed.data_ptr(),
        )  # fmt: skip
        return branch_input, mixed

    def mix_backward(
        self, pre: Tensor, res: Tensor, streams: Tensor, grad_branch_input: Tensor, grad_mixed: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients of :meth:`mix_forward` with respect to ``pre``, ``res`` and ``streams``."""
        positions, n, width = streams.shape
        grad_pre, grad_res = torch.empty_like(pre), torch.empty_like(res)
        grad_streams = torch.empty_like(streams)
        self._call(
            "mix_backward", streams.dtype, positions, n, width,
            pre.data_ptr(), res.data_ptr(), streams.data_ptr(), grad_branch_input.data_ptr(),
            grad_mixed.data_ptr(), grad_pre.data_ptr(), grad_res.data_ptr(), grad_streams.data_ptr(),
        )  # fmt: skip
        return grad_pre, grad_res, grad_streams

    def add_branch_backward(self, post: Tensor, branch_output: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
        """Gradients of ``mixed + post^T F`` with respect to ``post`` ``(P, n)`` and ``F`` ``(P, C)``."""
        positions, n, width = grad.shape
        grad_post, grad_branch_output = torch.empty_like(post), torch.empty_like(branch_output)
        self._call(
            "add_branch_backward", grad.dtype, positions, n, width,
            post.data_ptr(), branch_output.data_ptr(), grad.data_ptr(),
            grad_post.data_ptr(), grad_branch_output.data_ptr(),
        )  # fmt: skip
        return grad_post, grad_branch_output

    def sinkhorn_forward(self, logits: Tensor, iters: int, min_shifted: float) -> Tensor:
        """``(N, n, n)`` logits -> ``(N, n, n)`` Sinkhorn-Knopp output (see ``sinkhorn.py`` for the method)."""
        count, n, _ = logits.shape
        out = torch.empty_like(logits)
        self._call(
            "sinkhorn_forward", logits.dtype, count, n, iters, min_shifted, logits.data_ptr(), out.data_ptr()
        )
        return out

    def sinkhorn_backward(self, logits: Tensor, grad: Tensor, iters: int, min_shifted: float) -> Tensor:
        """Gradient of :meth:`sinkhorn_forward` with respect to the logits, through every iteration."""
        count, n, _ = logits.shape
        grad_logits = torch.empty_like(logits)
        self._call(
            "sinkhorn_backward", logits.dtype, count, n, iters, min_shifted,
            logits.data_ptr(), grad.data_ptr(), grad_logits.data_ptr(),
        )  # fmt: skip
        return grad_logits


def load() -> _Kernels | None:
    """The fused kernels, built on first call; ``None`` (after one warning) where they cannot be built."""
    global _loaded, _bound_to
    library = _native.library()
    if library is None:
        return None
    if _bound_to is not library:
        _loaded, _bound_to = _Kernels(library), library
    return _loaded


def usable(*tensors: Tensor) -> bool:
    """Whether the kernels can take these tensors: contiguous, CPU, one fp32/fp64 dtype, outside tracing."""
    dtype = tensors[0].dtype
    if dtype not in _VARIANTS or _native.compiling():
        return False
    return all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)
