"""Run a kernel launch on the CPU: guarded buffers, several fiber schedules, results back.

Every buffer argument is copied into its own mapping between guard regions (PROT_NONE),
so an access past either end faults; the runtime's SIGSEGV handler turns the fault into a
report naming the kernel, block, thread, buffer and element. The launch runs once per
schedule (``SCHEDULES``; all four by default), each from the same input bytes:

- ``forward``: fibers in thread order between synchronization points, each buffer
  *ending* at its upper guard (an overrun faults on its first byte);
- ``reverse``: fibers in reverse order, each buffer *starting* at its lower guard
  (underruns fault);
- ``random``: a fresh seeded permutation of the fibers at every sweep (``random:SEED``);
- ``runahead``: one warp runs alone until it waits at a block barrier (or exits) before
  the others move; the leader changes at every barrier and differs between blocks
  (``runahead:SEED`` shifts it). Warps drift a whole barrier interval apart.

``cp.async`` copies are deferred (``cp_async="deferred"``): each lands at the wait that
completes its group, its destination poisoned until then; ``"sync"`` lands them at the
issue. Any difference between the runs' buffers means the result depends on the
schedule (a race through shared memory: a missing barrier or wait) and raises
``RaceError``. The first run's buffers are copied back into the output arrays.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import settings
from ..errors import env_positive_int
from .compiler import kernel_library, runtime
from .errors import (
    DivergenceError,
    EmulatorError,
    ExitedPeerError,
    InFlightWriteError,
    KernelFault,
    KernelTimeoutError,
    MisalignedError,
    OutOfBoundsError,
    RaceError,
)
from .rewrite import wrap_cuda

THREADS_ENV = "PAGED_DECODE_EMULATOR_THREADS"
SCHEDULES_ENV = "PAGED_DECODE_EMULATOR_SCHEDULES"   # comma-separated schedule names
CP_ASYNC_ENV = "PAGED_DECODE_EMULATOR_CP_ASYNC"     # "deferred" or "sync"
TIMEOUT_ENV = "PAGED_DECODE_EMULATOR_TIMEOUT"       # seconds per schedule's run
#: the watchdog's limit on one schedule's run of a launch, in seconds: the test suite's
#: longest launch takes under half a second, so this fires only for a kernel that never ends
DEFAULT_TIMEOUT_S = 300
GUARD_BYTES = 4 << 30     # per side; PROT_NONE and unreserved: address space only, and
#                           a wild index lands in it more often than in mapped memory
#: schedule name -> (runtime enum, buffers end at their upper guard)
SCHEDULES = {"forward": (0, True), "reverse": (1, False), "random": (2, True),
             "runahead": (3, False)}
DEFAULT_SCHEDULES = ("forward", "reverse", "random", "runahead")
#: the emulator before schedules and deferred copies: what ``LEGACY`` reproduces
LEGACY_SCHEDULES = ("forward", "reverse")
CP_ASYNC_MODES = ("deferred", "sync")
DEFAULT_SEED = 1
#: buffer name -> bytes (1-15) past a 16-byte boundary its copy starts at, as a view into
#: a larger allocation would on a GPU (a test hook; empty otherwise): kernels that take
#: 16-byte loads of an argument must check its address
MISALIGN: dict[str, int] = {}


@dataclass
class Buffer:
    """A pointer argument: ``array`` (C-contiguous numpy) under ``name``. Outputs are
    written back into ``array`` after the launch."""

    name: str
    array: np.ndarray
    output: bool = False


class _BufferDesc(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("data", ctypes.c_uint64),
                ("nbytes", ctypes.c_uint64), ("itemsize", ctypes.c_uint64),
                ("map_base", ctypes.c_uint64), ("map_len", ctypes.c_uint64),
                ("guard", ctypes.c_uint64), ("skew", ctypes.c_uint64)]


class _LaunchDesc(ctypes.Structure):
    _fields_ = [("kernel", ctypes.c_char_p), ("grid", ctypes.c_uint * 3),
                ("block", ctypes.c_uint * 3), ("dyn_smem", ctypes.c_uint64),
                ("schedule", ctypes.c_int), ("cp_async_deferred", ctypes.c_int),
                ("seed", ctypes.c_uint64), ("threads", ctypes.c_int),
                ("nbuffers", ctypes.c_int), ("buffers", ctypes.POINTER(_BufferDesc)),
                ("end_aligned", ctypes.c_int), ("cluster", ctypes.c_uint),
                ("timeout_s", ctypes.c_double)]


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
            np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
            np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double}


def default_threads() -> int:
    n = env_positive_int(THREADS_ENV)
    return n if n is not None else max(1, min(2, os.cpu_count() or 1))


def default_timeout() -> int:
    """``$PAGED_DECODE_EMULATOR_TIMEOUT`` (positive whole seconds), else
    ``DEFAULT_TIMEOUT_S``."""
    n = env_positive_int(TIMEOUT_ENV)
    return n if n is not None else DEFAULT_TIMEOUT_S


def parse_schedule(name: str) -> tuple[str, int]:
    """``"random:7"`` -> ``("random", 7)``; a bare name takes ``DEFAULT_SEED``."""
    base, _, seed = name.strip().partition(":")
    if base not in SCHEDULES:
        raise EmulatorError(f"emulator: unknown schedule {name!r} (one of "
                            f"{', '.join(SCHEDULES)}, optionally ':SEED')")
    try:
        return base, int(seed) if seed else DEFAULT_SEED
    except ValueError:
        raise EmulatorError(f"emulator: schedule {name!r}: the seed must be an integer") \
            from None


def default_schedules() -> tuple[str, ...]:
    """``$PAGED_DECODE_EMULATOR_SCHEDULES`` (comma-separated), else ``DEFAULT_SCHEDULES``."""
    env = settings.get(SCHEDULES_ENV) or ""
    names = tuple(n.strip() for n in env.split(",") if n.strip())
    for n in names:
        parse_schedule(n)
    return names or DEFAULT_SCHEDULES


def default_cp_async() -> str:
    """``$PAGED_DECODE_EMULATOR_CP_ASYNC``, else ``"deferred"``."""
    mode = settings.get(CP_ASYNC_ENV) or "deferred"
    if mode not in CP_ASYNC_MODES:
        raise EmulatorError(f"emulator: {CP_ASYNC_ENV} must be one of "
                            f"{', '.join(CP_ASYNC_MODES)}, got {mode!r}")
    return mode


def _dim3(x: int | Sequence[int]) -> tuple[int, int, int]:
    t = (int(x),) if isinstance(x, (int, np.integer)) else tuple(int(v) for v in x)
    return (*t, *(1,) * (3 - len(t)))  # type: ignore[return-value]


def _align(nbytes: int, itemsize: int) -> int:
    a = 16
    while a > itemsize and nbytes % a:
        a //= 2
    return max(a, 1)


class _Guarded:
    """Guarded copies of the launch buffers for one run."""

    def __init__(self, buffers: list[Buffer], end_aligned: bool) -> None:
        rt = runtime()
        self.descs = (_BufferDesc * max(1, len(buffers)))()
        self._names = [b.name.encode() for b in buffers]
        self.views: list[np.ndarray] = []
        self.count = 0
        for i, b in enumerate(buffers):
            d = self.descs[i]
            arr = b.array
            skew = MISALIGN.get(b.name, 0)
            if not 0 <= skew < 16:
                raise EmulatorError(f"emulator: MISALIGN['{b.name}'] must be 0-15, got {skew}")
            # a skewed copy: `skew` bytes more, 16-byte aligned, started `skew` bytes in
            if rt.pd_emu_alloc(ctypes.c_uint64(arr.nbytes + skew),
                               ctypes.c_uint64(16 if skew else _align(arr.nbytes, arr.itemsize)),
                               ctypes.c_int(int(end_aligned)), ctypes.c_uint64(GUARD_BYTES),
                               ctypes.byref(d)) != 0:
                self.free()
                raise EmulatorError(f"emulator: cannot map {arr.nbytes} bytes for '{b.name}'")
            d.data += skew
            d.skew = skew
            d.nbytes = arr.nbytes
            self.count += 1
            d.name = self._names[i]
            d.itemsize = arr.itemsize
            raw = memoryview((ctypes.c_char * arr.nbytes).from_address(d.data)).cast("B")
            view = np.frombuffer(raw, dtype=np.uint8) if arr.nbytes else np.zeros(0, np.uint8)
            view[:] = arr.reshape(-1).view(np.uint8)
            self.views.append(view)
        self.count = len(buffers)

    def free(self) -> None:
        rt = runtime()
        for i in range(self.count):
            d = self.descs[i]
            if d.map_base:
                rt.pd_emu_free(ctypes.c_uint64(d.map_base), ctypes.c_uint64(d.map_len))
                d.map_base = 0
        self.views = []


def _classify(msg: str) -> type[KernelFault]:
    if "out-of-bounds" in msg or "outside shared memory" in msg \
            or "not in shared memory" in msg:
        return OutOfBoundsError
    if "misaligned" in msg:
        return MisalignedError
    if "divergent" in msg:
        return DivergenceError
    if "while a cp.async into it was in flight" in msg:
        return InFlightWriteError
    if "of its cluster, which has exited" in msg:
        return ExitedPeerError
    if "stopped by the emulator's watchdog" in msg:
        return KernelTimeoutError
    return KernelFault


def launch(source: str, name_expression: str, grid: int | Sequence[int],
           block: int | Sequence[int], args: Sequence[Any], shared_mem: int = 0, *,
           check_races: bool = True, threads: int | None = None,
           schedules: Sequence[str] | None = None, cp_async: str | None = None,
           cluster: int = 1, timeout: float | None = None) -> None:
    """Run ``name_expression`` (a ``__global__`` template instantiation in the CUDA
    ``source``) over ``grid`` x ``block`` with ``shared_mem`` bytes of dynamic shared
    memory. ``args`` in the kernel's parameter order: ``Buffer`` for pointers, numpy
    scalars (``np.int32``, ``np.float32``, ...) of the parameter's exact type for values.
    ``schedules`` (default ``default_schedules()``) run in order and must agree;
    ``check_races=False`` runs only the first. ``cp_async``: ``"deferred"`` or ``"sync"``
    (default ``default_cp_async()``). ``cluster``: CTAs per thread-block cluster along x
    (a divisor of the grid's x, at most 8; 1: none): a cluster's CTAs run interleaved, so
    ``pd::cluster_sync`` can hold them together. ``timeout``: seconds one schedule's run
    may take before the watchdog stops it with ``KernelTimeoutError`` (default
    ``default_timeout()``). Raises ``KernelFault`` subclasses and ``RaceError``; outputs
    land in their arrays."""
    run_wrapped(wrap_cuda(source, name_expression), name_expression, grid, block, args,
                shared_mem, check_races=check_races, threads=threads, schedules=schedules,
                cp_async=cp_async, cluster=cluster, timeout=timeout)


def run_wrapped(wrapped: str, kernel: str, grid: int | Sequence[int],
                block: int | Sequence[int], args: Sequence[Any], shared_mem: int = 0, *,
                check_races: bool = True, threads: int | None = None,
                schedules: Sequence[str] | None = None, cp_async: str | None = None,
                cluster: int = 1, timeout: float | None = None) -> None:
    """Run a wrapped translation unit (one that defines ``pd_emu_launch``) over ``grid``
    blocks of ``block`` threads; ``kernel`` names it in reports. See ``launch``."""
    name_expression = kernel
    lib = kernel_library(wrapped)
    fn = lib.pd_emu_launch
    fn.restype = ctypes.c_int
    buffers = [a for a in args if isinstance(a, Buffer)]
    for b in buffers:
        if not b.array.flags.c_contiguous:
            raise EmulatorError(f"emulator: buffer '{b.name}' must be C-contiguous")
    g, bl = _dim3(grid), _dim3(block)
    if 0 in g:
        return
    names = tuple(schedules) if schedules is not None else default_schedules()
    if not names:
        raise EmulatorError("emulator: no schedule to run")
    names = names if check_races else names[:1]
    runs = [(n.strip(), *parse_schedule(n)) for n in names]
    limit = float(timeout) if timeout is not None else float(default_timeout())
    if not limit > 0:
        raise EmulatorError(f"emulator: timeout must be a positive number of seconds, got "
                            f"{timeout!r}")
    mode = cp_async or default_cp_async()
    if mode not in CP_ASYNC_MODES:
        raise EmulatorError(f"emulator: cp_async must be one of {', '.join(CP_ASYNC_MODES)}, "
                            f"got {mode!r}")
    results: list[list[np.ndarray]] = []
    for label, name, seed in runs:
        sched, end_aligned = SCHEDULES[name]
        mem = _Guarded(buffers, end_aligned)
        try:
            ptrs: list[Any] = []
            bi = 0
            for a in args:
                if isinstance(a, Buffer):
                    ptrs.append(ctypes.c_void_p(int(mem.descs[bi].data)))
                    bi += 1
                else:
                    dt = np.asarray(a).dtype
                    if dt not in _SCALARS:
                        raise EmulatorError(f"emulator: scalar argument of dtype {dt} "
                                            "(pass a numpy scalar of the parameter's type)")
                    ptrs.append(_SCALARS[dt](np.asarray(a).item()))
            argv = (ctypes.c_void_p * max(1, len(ptrs)))(
                *[ctypes.cast(ctypes.pointer(p), ctypes.c_void_p) for p in ptrs])
            desc = _LaunchDesc(name_expression.encode(), (ctypes.c_uint * 3)(*g),
                               (ctypes.c_uint * 3)(*bl), int(shared_mem), sched,
                               int(mode == "deferred"), seed, threads or default_threads(),
                               len(buffers), mem.descs, int(end_aligned), int(cluster),
                               limit)
            err = ctypes.create_string_buffer(4096)
            rc = fn(ctypes.byref(desc), argv, err, ctypes.c_size_t(len(err)))
            if rc != 0:
                msg = err.value.decode(errors="replace")
                raise _classify(msg)(f"{msg} [{label} schedule]")
            results.append([v.copy() for v in mem.views])
        finally:
            mem.free()
    for (label, _, _), res in zip(runs[1:], results[1:]):
        _compare(name_expression, buffers, results[0], res, runs[0][0], label)
    for b, data in zip(buffers, results[0]):
        if b.output:
            b.array.reshape(-1).view(np.uint8)[:] = data


def _compare(kernel: str, buffers: list[Buffer], a: list[np.ndarray],
             b: list[np.ndarray], a_name: str, b_name: str) -> None:
    for buf, x, y in zip(buffers, a, b):
        if np.array_equal(x, y):
            continue
        isz = buf.array.itemsize
        ex, ey = x.view(buf.array.dtype), y.view(buf.array.dtype)
        bad = np.flatnonzero((x.reshape(-1, isz) != y.reshape(-1, isz)).any(axis=1))
        i = int(bad[0])
        raise RaceError(
            f"{kernel}: buffer '{buf.name}' differs between the {a_name} and the {b_name} "
            f"fiber schedule at element {i} ({ex[i]!r} vs {ey[i]!r}; {bad.size} elements "
            "differ): the kernel reads shared memory another thread writes without a "
            "barrier in between, or a cp.async destination before its wait (or otherwise "
            "depends on thread scheduling)")
