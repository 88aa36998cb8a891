"""Build and cache the runtime library and kernel libraries (g++, C++17, -O2).

Libraries are cached on disk under ``$PAGED_DECODE_EMULATOR_CACHE`` (default
``~/.cache/paged-decode-emulator``), named by a hash of (headers, wrapped source, flags,
compiler), and in process by the same key. Writes go to a temporary name first and are
renamed into place, so concurrent test processes share the cache safely. The dialect
preludes are precompiled headers next to them (a kernel build then skips parsing the
C++ standard headers, about a quarter of its time); g++ falls back to the text when a
precompiled header does not fit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from .. import settings
from .cuda_prelude import CUDA_PRELUDE, STUB_HEADERS
from .errors import CompileError
from .metal_prelude import METAL_PRELUDE
from .metal_simdgroup import METAL_STUB_HEADERS
from .runtime_src import RUNTIME_CPP, RUNTIME_HEADER

CACHE_ENV = "PAGED_DECODE_EMULATOR_CACHE"
CXX_ENV = "PAGED_DECODE_EMULATOR_CXX"
#: ``-fsanitize=bounds,object-size`` with traps: an index past a fixed-size array's bound
#: (a thread's local array, a dimension of a static shared one) runs ud2, which the runtime
#: reports as an out-of-bounds fault; object-size adds a store one past a local array of
#: structs through its assignment, which bounds takes for a legal one-past address. No
#: sanitizer runtime library is needed. Locals start as a non-zero pattern, so one read
#: before it is written gives a wrong answer, as a GPU's leftover register would
FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-g0",
         "-Wno-unknown-pragmas", "-Wno-attributes", "-fsanitize=bounds,object-size",
         "-fsanitize-undefined-trap-on-error", "-ftrivial-auto-var-init=pattern")
#: the dialect preludes, by the header name the wrapped source includes
HEADERS = {"pd_emu_rt.h": RUNTIME_HEADER, "pd_emu_cuda.h": CUDA_PRELUDE,
           "pd_emu_metal.h": METAL_PRELUDE, **STUB_HEADERS, **METAL_STUB_HEADERS}

_lock = threading.Lock()


def cache_dir() -> Path:
    env = settings.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "paged-decode-emulator"


def compiler() -> str | None:
    """The C++ compiler to use (``$PAGED_DECODE_EMULATOR_CXX``, else g++), or ``None``."""
    return settings.get(CXX_ENV) or shutil.which("g++")


def _key(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


#: the headers a wrapped translation unit includes first: precompiled with FLAGS
PRECOMPILED = ("pd_emu_cuda.h", "pd_emu_metal.h")


def _headers_dir() -> Path:
    """The prelude headers (and their precompiled forms), written once per content hash,
    compiler and flags."""
    cxx = compiler() or ""
    d = cache_dir() / ("include-" + _key(*(k + v for k, v in sorted(HEADERS.items())), cxx,
                                         " ".join(FLAGS), "pch"))
    if not (d / "pd_emu_cuda.h").exists():
        tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix="inc-tmp-"))
        for name, text in HEADERS.items():
            (tmp / name).write_text(text)
        for name in PRECOMPILED if cxx else ():
            # optional: a failed precompile leaves the text header, which still works
            subprocess.run([cxx, *(f for f in FLAGS if f != "-shared"), "-x", "c++-header",
                            str(tmp / name), "-o", str(tmp / f"{name}.gch")],
                           capture_output=True)
        try:
            os.rename(tmp, d)
        except OSError:   # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return d


def _build(source: str, stem: str, extra: tuple[str, ...] = ()) -> Path:
    cxx = compiler()
    if cxx is None:
        raise CompileError("emulator: no C++ compiler (install g++ or set "
                           f"{CXX_ENV})")
    cache_dir().mkdir(parents=True, exist_ok=True)
    inc = _headers_dir()
    flags = (*FLAGS, *extra)
    key = _key(str(inc.name), source, " ".join(flags), cxx)
    out = cache_dir() / f"{stem}-{key}.so"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix="build-") as tmp:
        src = Path(tmp) / f"{stem}.cpp"
        src.write_text(source)
        so = Path(tmp) / f"{stem}.so"
        proc = subprocess.run([cxx, *flags, "-I", str(inc), str(src), "-o", str(so)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(f"emulator: compiling {stem} failed:\n{proc.stderr[-6000:]}")
        os.replace(so, out)
    return out


@functools.cache
def runtime() -> ctypes.CDLL:
    """The runtime library, loaded with ``RTLD_GLOBAL`` (kernel libraries use its symbols)."""
    with _lock:
        path = _build(RUNTIME_CPP, "pd_emu_runtime", ("-pthread",))
        return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


@functools.cache
def kernel_library(wrapped_source: str) -> ctypes.CDLL:
    """The compiled kernel library of a wrapped translation unit (``rewrite.wrap_cuda`` or
    ``metal.wrap_metal``)."""
    runtime()
    with _lock:
        path = _build(wrapped_source, "pd_emu_kernel")
        return ctypes.CDLL(str(path))
