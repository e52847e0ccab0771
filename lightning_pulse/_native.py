"""The package's native CPU kernels: C sources in ``lightning_pulse/_csrc``, built at first use.

The sources are plain C with no torch headers: a build takes about a second with the system C compiler
(``$CC``, else ``cc``/``gcc``/``clang``), and the shared library is cached under ``$LIGHTNING_PULSE_KERNEL_DIR``
(default ``~/.cache/lightning_pulse/kernels``; the temporary directory where that is not writable), keyed by
the sources, the compiler, the flags and the CPU's feature flags (the build uses ``-march=native``). Callers
bind the functions they need with :mod:`ctypes`, which releases the GIL during a call.

One more build is an extension module, ``_lp_step_reader`` (:func:`step_reader`): StabilityGuard's per-step
read, where even a ctypes call and the Python bindings around it are a measurable share of a small model's
step. It is C++ against torch's own headers (shipped in torch's wheels) and the interpreter's, built with the
system C++ compiler (``$CXX``, else ``c++``/``g++``/``clang++``) in about 15 seconds once per torch and
interpreter version, and keyed by both.

Nothing here is required: when no compiler is found or the build fails, :func:`library` warns once and
returns ``None``, and every caller keeps its torch implementation; without the extension module the guard
reads through :func:`library`. Users of the kernels: :mod:`lightning_pulse.nn._cpu_kernels` (mHC stream
mixing, Sinkhorn-Knopp) and :mod:`lightning_pulse.core.grad_norm` (StabilityGuard's per-step gradient norm).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE_DIR = Path(__file__).parent / "_csrc"
# (source, extra flags): mhc_kernels.c is written once over a SCALAR type and compiled for fp32 and fp64
_UNITS = (
    ("mhc_kernels.c", ("-DSCALAR=float", "-DSFX=_f32")),
    ("mhc_kernels.c", ("-DSCALAR=double", "-DSFX=_f64")),
    ("reductions.c", ()),
)
# the extension module of StabilityGuard's per-step read; its file name ends in the interpreter's extension
# suffix and its init function is named after the last part of the module name
_STEP_READER_UNITS = (("step_reader.cpp", ()), ("reductions.c", ()))
_STEP_READER_MODULE = "lightning_pulse._lp_step_reader"
_FLAGS = ("-O3", "-march=native", "-fPIC", "-std=c99", "-fno-math-errno", "-pthread")
# C++20: what torch's own extension builds use with its headers (they warn, or fail, under older standards)
_CXX_FLAGS = ("-O3", "-march=native", "-fPIC", "-std=c++20", "-fno-math-errno", "-pthread")

_log = logging.getLogger("lightning_pulse")
_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None
_failed = False
_step_reader: ModuleType | None = None
_step_reader_failed = False
step_reader_error = ""  # why the extension module is unavailable, when it is


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


def cxx_compiler() -> str | None:
    """The C++ compiler to build the step reader with, or ``None`` where there is none."""
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
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
    return _build_shared({".c": compiler_command}, _UNITS, (), (), "lightning_pulse_kernels", ".so")


def build_step_reader(compiler_command: str, cxx_command: str) -> Path:
    """Build (or find in the cache) the ``_lp_step_reader`` extension module, and return its path.

    It is compiled against this interpreter's headers (``sysconfig``'s include directory) and torch's (its
    ``include`` directory), linked with torch's libraries, and keyed by the interpreter's ABI and torch's
    version, so each pair gets its own build. Raises ``FileNotFoundError`` where either set of headers is not
    installed (some distributions ship the interpreter's in a separate ``python3-dev`` package).
    """
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise FileNotFoundError(f"Python.h is not in {include} (the interpreter's headers are not installed)")
    torch_root = Path(torch.__file__).parent
    torch_include, torch_lib = torch_root / "include", torch_root / "lib"
    if not (torch_include / "torch" / "csrc" / "autograd" / "python_variable.h").exists():
        raise FileNotFoundError(f"torch's C++ headers are not in {torch_include}")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return _build_shared(
        {".c": compiler_command, ".cpp": cxx_command},
        _STEP_READER_UNITS,
        (f"-I{include}", f"-I{torch_include}", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"),
        # libtorch_python holds the Python bindings' symbols; the rpath finds torch's libraries at load time
        (f"-L{torch_lib}", "-lc10", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{torch_lib}"),
        "lp_step_reader",
        suffix,
        f"{sys.version} {suffix} torch {torch.__version__} {torch_root}",
    )


def _build_shared(
    compilers: dict[str, str],
    units: tuple[tuple[str, tuple[str, ...]], ...],
    common_flags: tuple[str, ...],
    link_flags: tuple[str, ...],
    stem: str,
    suffix: str,
    key_extra: str = "",
) -> Path:
    """Compile ``units`` ((source, flags) pairs; the compiler by the source's extension in ``compilers``) and
    link them into one shared object, cached by content."""
    sources = {name: (SOURCE_DIR / name).read_bytes() for name, _ in units}
    key = hashlib.sha256(
        b"\0".join(
            [
                *(sources[name] for name in sorted(sources)),
                " ".join(f"{ext}={command}" for ext, command in sorted(compilers.items())).encode(),
                " ".join(_FLAGS + _CXX_FLAGS + common_flags + link_flags).encode(),
            ]
            + [" ".join(flags).encode() for _, flags in units]
            + [_cpu_fingerprint().encode(), key_extra.encode()]
        )
    ).hexdigest()[:16]
    directory = cache_dir()
    library = directory / f"{stem}-{key}{suffix}"
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
    _log.info("lightning_pulse: compiling %s once (cached in %s)", stem, directory)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        objects = []
        for index, (name, flags) in enumerate(units):
            extension = Path(name).suffix
            obj = Path(scratch) / f"unit{index}.o"
            subprocess.run(
                [
                    compilers[extension],
                    *(_CXX_FLAGS if extension == ".cpp" else _FLAGS),
                    *common_flags,
                    *flags,
                    "-c",
                    str(SOURCE_DIR / name),
                    "-o",
                    str(obj),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            objects.append(str(obj))
        built = Path(scratch) / f"built{suffix}"
        linker = compilers[".cpp"] if ".cpp" in compilers else compilers[".c"]
        subprocess.run(
            [linker, "-shared", "-pthread", *objects, "-o", str(built), *link_flags, "-lm"],
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


def step_reader() -> ModuleType | None:
    """The ``_lp_step_reader`` extension module (StabilityGuard's per-step read), built on first call.

    ``None`` where it cannot be built or loaded (no C or C++ compiler, no Python or torch headers, a compiler
    without C++20): the guard then reads through :func:`library` with ctypes, some microseconds slower per
    step, with the same values. Not worth a warning: nothing is lost but those microseconds; the reason is
    kept in :data:`step_reader_error`. The first build takes about 15 seconds (torch's headers are large) and is
    announced in the ``lightning_pulse`` logger.
    """
    global _step_reader, _step_reader_failed, step_reader_error
    if _step_reader is not None or _step_reader_failed:
        return _step_reader
    with _lock:
        if _step_reader is not None or _step_reader_failed:
            return _step_reader
        command, cxx_command = compiler(), cxx_compiler()
        try:
            if command is None:
                raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")
            if cxx_command is None:
                raise RuntimeError("no C++ compiler found ($CXX, c++, g++ or clang++)")
            path = build_step_reader(command, cxx_command)
            spec = importlib.util.spec_from_file_location(_STEP_READER_MODULE, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _step_reader = module
        except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as error:
            _step_reader_failed = True
            step_reader_error = (getattr(error, "stderr", "") or str(error)).strip()[:500]
    return _step_reader
