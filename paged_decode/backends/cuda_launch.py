"""The ``cuda`` backend's launch machinery: compiled kernels (one CuPy module per
specialization, cached), the dynamic shared memory opt-in, the device copies of host
index arrays and the per-stream workspaces (both kept while their owners live), and
recording a call's launches once to replay them with packed arguments
(``prepare_decode``)."""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from ..specs import KernelSpec, assert_compile_allowed, cuda_defines, cuda_source
from .cuda_arrays import cp
from .cuda_pdl import DependentLaunch
from .launches import Launch

COMPILE_OPTIONS = ("-std=c++17",)


#: (kernel, module) of every module compiled with timeline stamps (``PD_TIMELINE``)
_timeline_modules: list[tuple[str, Any]] = []


@functools.cache
def _module(kernel: str, name_expressions: tuple[str, ...], defines: tuple[str, ...]) -> Any:
    module = cp.RawModule(code=cuda_source(kernel), options=COMPILE_OPTIONS + defines,
                          name_expressions=list(name_expressions))
    if "-DPD_TIMELINE=1" in defines:
        _timeline_modules.append((kernel, module))
    return module


def compiled(spec: KernelSpec) -> Any:
    """The compiled kernel of ``spec`` (one module per specialization and set of
    ``specs.cuda_defines``, cached)."""
    return _compiled(spec, cuda_defines(spec=spec))


@functools.cache
def _compiled(spec: KernelSpec, defines: tuple[str, ...]) -> Any:
    assert_compile_allowed(spec)
    expr = spec.cuda_name_expression()
    return _module(spec.kernel, (expr,), defines).get_function(expr)


def point_timeline(kernel: str, buffer: Any) -> int:
    """Point ``pd_timeline`` of every module of ``kernel`` (``KernelSpec.kernel``, e.g.
    ``"v2tc"``) compiled with timeline stamps at ``buffer`` (a CuPy ``uint64`` array of
    ``PD_TIMELINE_FIELDS`` per CTA of the next launches, C order), or back at nothing
    (``None``). Returns how many modules it set; diagnostics only
    (``bench/device/timeline.py``)."""
    n = 0
    for name, module in _timeline_modules:
        if name == kernel:
            slot = cp.ndarray((1,), cp.uint64, memptr=module.get_global("pd_timeline"))
            slot[...] = 0 if buffer is None else int(buffer.data.ptr)
            n += 1
    return n


_smem_opt_in: dict[int, tuple[Any, int]] = {}


def with_smem(kernel: Any, smem: int) -> Any:
    """``kernel``, opted in to ``smem`` bytes of dynamic shared memory where needed."""
    if smem and _smem_opt_in.get(id(kernel), (None, 0))[1] < smem:
        # above 48 KB of dynamic shared memory a kernel must opt in (once per kernel; the
        # entry keeps the kernel alive so its id is never reused)
        kernel.max_dynamic_shared_size_bytes = int(smem)
        _smem_opt_in[id(kernel)] = (kernel, int(smem))
    return kernel


class DeviceCaches:
    """Device copies of read-only host arrays, by (array, device), and workspaces, by
    (owner, tag, shape, dtype, device, stream); each entry lives as long as its key's
    host object."""

    def __init__(self, empty: Callable[[tuple[int, ...], str], Any]) -> None:
        self._empty = empty
        # (array, device) -> (device copy, the stream that copied it, the streams it is
        # ordered on)
        self._uploads: dict[tuple[int, int], tuple[Any, Any, set[int]]] = {}
        self._workspaces: dict[tuple[Any, ...], Any] = {}

    def upload(self, arr: np.ndarray) -> Any:
        """Device copy of a host array on the current device. Read-only arrays (every
        table and plan array) are immutable, so their copies are memoised by identity
        until the host array is collected. The copy is ordered only on the stream that
        made it (CuPy copies asynchronously on a created stream; a pageable copy on the
        NULL stream may return before its DMA lands), so the first use from each other
        stream makes that stream wait for it on the GPU (an event recorded on the copying
        stream), not on the host. A capture cannot wait on an event from outside it: a
        capture on a stream the copy is not ordered on records no wait (its replay comes
        later; ``prepare`` on the capture stream first orders it)."""
        if arr.flags.writeable:
            return cp.asarray(arr)
        key = (id(arr), cp.cuda.Device().id)
        got = self._uploads.get(key)
        s = cp.cuda.get_current_stream()
        if got is None:
            dev = cp.asarray(arr if arr.size else np.zeros(1, arr.dtype))
            self._uploads[key] = (dev, s, {s.ptr})
            weakref.finalize(arr, self._uploads.pop, key, None)
            return dev
        dev, made_on, ordered = got
        if s.ptr not in ordered and not s.is_capturing():
            s.wait_event(made_on.record())
            ordered.add(s.ptr)
        return dev

    def scratch(self, owner: Any, tag: str, shape: tuple[int, ...], dtype: str, *,
                zero: bool = False) -> Any:
        """The kept workspace of the key; with ``zero`` a fresh one is ``cupy.zeros`` of
        the numpy ``dtype`` (e.g. ``"int32"``), zeroed on the current stream."""
        key = (id(owner), tag, tuple(int(x) for x in shape), dtype, cp.cuda.Device().id,
               cp.cuda.get_current_stream().ptr)
        got = self._workspaces.get(key)
        if got is None:
            got = cp.zeros(shape, np.dtype(dtype)) if zero else self._empty(shape, dtype)
            self._workspaces[key] = got
            weakref.finalize(owner, self._workspaces.pop, key, None)
        return got


class PackedLaunch:
    """One recorded launch with its kernel arguments packed for ``cuLaunchKernel``: a
    ``void*[]`` of pointers to ctypes copies of each argument (device pointers for
    arrays, ``int32``/``float32`` scalars). Keeps the arrays alive. With ``pdl`` a launch
    marked ``dependent`` (the merge) goes through ``cuda_pdl.DependentLaunch`` (``ex``)."""

    __slots__ = ("fn", "gx", "gy", "block", "smem", "params", "ex", "_keep")

    def __init__(self, kernel: Any, launch: Launch, pdl: bool = False, *,
                 hold: bool = True) -> None:
        self.fn = int(kernel.kernel.ptr)
        self.gx, self.gy = (int(x) for x in launch.grid)
        self.block, self.smem = int(launch.block), int(launch.smem)
        cells: list[Any] = []
        for arg in launch.args:
            v = arg.value
            if isinstance(v, cp.ndarray):
                cells.append(ctypes.c_void_p(v.data.ptr))
            elif isinstance(v, np.int32):
                cells.append(ctypes.c_int32(int(v)))
            elif isinstance(v, np.float32):
                cells.append(ctypes.c_float(float(v)))
            else:
                raise TypeError(f"{launch.spec.uri}: cannot pack argument {arg.name!r} of type "
                                f"{type(v).__name__}")
        ptrs = (ctypes.c_void_p * len(cells))(*(ctypes.addressof(c) for c in cells))
        self.params = ctypes.addressof(ptrs)
        self._keep = (cells, ptrs, launch.values() if hold else ())
        self.ex = (DependentLaunch(self.fn, (self.gx, self.gy), self.block, self.smem,
                                   self.params, keep=self._keep)
                   if pdl and launch.dependent else None)

    def set_pointer(self, index: int, ptr: int) -> None:
        """Point argument ``index`` (an array argument) at device address ``ptr``."""
        self._keep[0][index].value = ptr


def replayer(packed: list[PackedLaunch], dev: int,
             stream: Callable[[], int]) -> Callable[[], None]:
    """A callable launching ``packed`` through ``cuLaunchKernel`` on device ``dev`` and
    the stream ``stream()`` names at call time; it allocates and copies nothing."""
    launch = cp.cuda.driver.launchKernel
    get_device = cp.cuda.runtime.getDevice

    def replay() -> None:
        if get_device() != dev:
            with cp.cuda.Device(dev):
                replay()
            return
        s = stream()
        for pk in packed:
            if pk.ex is not None:
                pk.ex(s)
            else:
                launch(pk.fn, pk.gx, pk.gy, 1, pk.block, 1, 1, pk.smem, s, pk.params, 0)
    return replay


__all__ = ["COMPILE_OPTIONS", "DeviceCaches", "PackedLaunch", "compiled", "replayer",
           "with_smem"]
