"""Fused CPU kernels for the mHC stream operations and Sinkhorn-Knopp, built from C at first use.

The kernels (``_csrc/mhc_kernels.c``) are plain C with no torch headers: a build takes about a second with
the system C compiler (``$CC``, else ``cc``/``gcc``), and the shared library is cached under
``$LIGHTNING_PULSE_KERNEL_DIR`` (default ``~/.cache/lightning_pulse/kernels``; the temporary directory where
that is not writable), keyed by the source, the compiler, the flags and the CPU's feature flags (the build uses
``-march=native``). They are called through :mod:`ctypes`, which releases the GIL.

Nothing here is required: when no compiler is found or the build fails, :func:`load` warns once and returns
``None``, and the layers keep using their torch implementation. The kernels only take contiguous fp32/fp64
CPU tensors; callers check :func:`usable` first.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

_SOURCE = Path(__file__).parent / "_csrc" / "mhc_kernels.c"
_FLAGS = ("-O3", "-march=native", "-fPIC", "-std=c99", "-fno-math-errno", "-pthread")
_VARIANTS = {torch.float32: ("float", "_f32"), torch.float64: ("double", "_f64")}
_SIZE = ctypes.c_int64
_PTR = ctypes.c_void_p

_lock = threading.Lock()
_loaded: _Kernels | None = None
_failed = False


def _cache_dir() -> Path:
    configured = os.environ.get("LIGHTNING_PULSE_KERNEL_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lightning_pulse" / "kernels"


def _compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def _cpu_fingerprint() -> str:
    """The CPU's feature flags: a library built with ``-march=native`` must not be reused on a CPU lacking them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, compiler.encode(), " ".join(_FLAGS).encode(), _cpu_fingerprint().encode()])
    ).hexdigest()[:16]
    directory = _cache_dir()
    library = directory / f"mhc_kernels-{key}.so"
    if library.exists():
        return library
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not os.access(directory, os.W_OK):
            raise PermissionError(f"{directory} is not writable")
    except OSError:  # a read-only home (some clusters): build in the temporary directory instead
        directory = Path(tempfile.gettempdir()) / f"lightning_pulse_kernels-{os.getuid()}"
        library = directory / library.name
        if library.exists():
            return library
        directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        objects = []
        for scalar, suffix in _VARIANTS.values():
            obj = Path(scratch) / f"kernels{suffix}.o"
            subprocess.run(
                [
                    compiler,
                    *_FLAGS,
                    f"-DSCALAR={scalar}",
                    f"-DSFX={suffix}",
                    "-c",
                    str(_SOURCE),
                    "-o",
                    str(obj),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            objects.append(str(obj))
        built = Path(scratch) / "kernels.so"
        subprocess.run(
            [compiler, "-shared", "-pthread", *objects, "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(built, library)  # atomic: a concurrent process sees the whole library or none
    return library


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
    global _loaded, _failed
    if _loaded is not None or _failed:
        return _loaded
    with _lock:
        if _loaded is not None or _failed:
            return _loaded
        compiler = _compiler()
        try:
            if compiler is None:
                raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")
            _loaded = _Kernels(ctypes.CDLL(str(_build(compiler))))
        except (OSError, RuntimeError, subprocess.CalledProcessError, AttributeError) as error:
            _failed = True
            detail = getattr(error, "stderr", "") or str(error)
            warnings.warn(
                "lightning_pulse.nn: the fused CPU kernels could not be built, so mHC/HC layers use their "
                f"(slower, equivalent) torch implementation. Reason: {detail.strip()[:500]}",
                RuntimeWarning,
                stacklevel=3,
            )
    return _loaded


def compiling() -> bool:
    """Whether torch.compile is tracing: the kernels are opaque to it, so traced code takes the torch path."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)  # torch >= 2.3
    if is_compiling is None:
        from torch import _dynamo

        is_compiling = _dynamo.is_compiling
    return bool(is_compiling())


def usable(*tensors: Tensor) -> bool:
    """Whether the kernels can take these tensors: contiguous, CPU, one fp32/fp64 dtype, outside tracing."""
    dtype = tensors[0].dtype
    if dtype not in _VARIANTS or compiling():
        return False
    return all(t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)
