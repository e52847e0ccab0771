"""The package's native CPU kernels: C sources in ``lightning_pulse/_csrc``, built at first use.

The sources are plain C with no torch headers: a build takes about a second with the system C compiler
(``$CC``, else ``cc``/``gcc``/``clang``), and the shared library is cached under ``$LIGHTNING_PULSE_KERNEL_DIR``
(default ``~/.cache/lightning_pulse/kernels``; the temporary directory where that is not writable), keyed by
the sources, the compiler, the flags and the CPU's feature flags (the build uses ``-march=native``). Callers
bind the functions they need with :mod:`ctypes`, which releases the GIL during a call.

Nothing here is required: when no compiler is found or the build fails, :func:`library` warns once and
returns ``None``, and every caller keeps its torch implementation. Users of the kernels:
:mod:`lightning_pulse.nn._cpu_kernels` (mHC stream mixing, Sinkhorn-Knopp) and
:mod:`lightning_pulse.core.grad_norm` (StabilityGuard's per-step gradient norm).
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

SOURCE_DIR = Path(__file__).parent / "_csrc"
# (source, extra flags): mhc_kernels.c is written once over a SCALAR type and compiled for fp32 and fp64
_UNITS = (
    ("mhc_kernels.c", ("-DSCALAR=float", "-DSFX=_f32")),
    ("mhc_kernels.c", ("-DSCALAR=double", "-DSFX=_f64")),
    ("reductions.c", ()),
)
_FLAGS = ("-O3", "-march=native", "-fPIC", "-std=c99", "-fno-math-errno", "-pthread")

_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_failed = False


def cache_dir() -> Path:
    """Where built libraries are kept: ``$LIGHTNING_PULSE_KERNEL_DIR`` or ``~/.cache/lightning_pulse/kernels``."""
    configured = os.environ.get("LIGHTNING_PULSE_KERNEL_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lightning_pulse" / "kernels"


def compiler() -> str | None:
    """The C compiler to build with, or ``None`` where there is none."""
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def compiling() -> bool:
    """Whether torch.compile is tracing: the kernels are opaque to it, so traced code takes the torch path."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)  # torch >= 2.3
    if is_compiling is None:
        from torch import _dynamo

        is_compiling = _dynamo.is_compiling
    return bool(is_compiling())


def _cpu_fingerprint() -> str:
    """The CPU's feature flags: a library built with ``-march=native`` must not be reused on a CPU lacking them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(compiler_command: str) -> Path:
    """Build (or find in the cache) the shared library of every source, and return its path."""
    sources = {name: (SOURCE_DIR / name).read_bytes() for name, _ in _UNITS}
    key = hashlib.sha256(
        b"\0".join(
            [
                *(sources[name] for name in sorted(sources)),
                compiler_command.encode(),
                " ".join(_FLAGS).encode(),
            ]
            + [" ".join(flags).encode() for _, flags in _UNITS]
            + [_cpu_fingerprint().encode()]
        )
    ).hexdigest()[:16]
    directory = cache_dir()
    library = directory / f"lightning_pulse_kernels-{key}.so"
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
        for index, (name, flags) in enumerate(_UNITS):
            obj = Path(scratch) / f"unit{index}.o"
            subprocess.run(
                [compiler_command, *_FLAGS, *flags, "-c", str(SOURCE_DIR / name), "-o", str(obj)],
                check=True,
                capture_output=True,
                text=True,
            )
            objects.append(str(obj))
        built = Path(scratch) / "kernels.so"
        subprocess.run(
            [compiler_command, "-shared", "-pthread", *objects, "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(built, library)  # atomic: a concurrent process sees the whole library or none
    return library


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first call; ``None`` (after one warning) where they cannot be built."""
    global _loaded, _failed
    if _loaded is not None or _failed:
        return _loaded
    with _lock:
        if _loaded is not None or _failed:
            return _loaded
        command = compiler()
        try:
            if command is None:
                raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")
            _loaded = ctypes.CDLL(str(build(command)))
        except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
            _failed = True
            detail = getattr(error, "stderr", "") or str(error)
            warnings.warn(
                "lightning_pulse: the native CPU kernels could not be built, so the torch implementations are "
                "used instead (slower, same results: mHC/HC layers, StabilityGuard's gradient-norm read). "
                f"Reason: {detail.strip()[:500]}",
                RuntimeWarning,
                stacklevel=3,
            )
    return _loaded
