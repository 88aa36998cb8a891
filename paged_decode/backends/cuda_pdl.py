"""Programmatic dependent launch (PDL, sm_90+) of the merge, for the ``cuda`` backend.

A split decode is two kernels in one stream: the partial, then the merge of its states.
Launched plainly, the merge's CTAs are scheduled only when the partial's last CTA has
exited, so each call pays the gap between the grids. A launch with the driver's
programmatic-stream-serialization attribute lets the merge be scheduled once every CTA of
the partial has run ``griddepcontrol.launch_dependents`` (its first statement,
``pd::allow_dependents``). Each merge CTA then waits in ``griddepcontrol.wait``
(``pd::wait_for_prerequisites``, its first statement, before any read and any early
return) until the partial grid has finished and its writes are visible. The merge grid so
never finishes before the partial, and work queued after the merge stays ordered after
both. A ``Launch`` marked ``dependent`` (``launches.merge_launch``) takes this path where
``enabled`` says so. Elsewhere, and in the emulator and Metal, the two instructions are
absent and the launch is a plain one.

CuPy's kernel call takes no launch attributes, so the launch is ``cuLaunchKernelEx``
through ctypes, with the kernel's packed arguments (``cuda_launch.PackedLaunch``). The
struct layouts below are CUDA 12 / 13's ``cuda.h``; ``tests/test_pdl.py`` checks them
against the C header where one is installed.

Default (``PAGED_DECODE_PDL`` unset): on for launches packed once and replayed
(``compile_launches``: prepared calls, ``decode``'s cached fast path, the engine step and
the graphs captured from them), off for the uncached eager call, whose launch would pack
its arguments on every call (about 1.5 us of host time, S16-R2). ``1`` turns it on for
both, ``0`` off for both. On an H100 (S34-R2, 2026-12-06, one round) the packed merge as a
dependent launch took 0.1-1.4 us less GPU time in 26 of the 27 cells of GQA 16 / 8 / 7 at
batch 1-64 x 1K-32K (the 27th, Qwen2-7B 64 x 32K, 0.4 us more of 1410), and Qwen2-7B's
captured engine step at batch 8 x 1K went from 538 to 500 us (level at batch 64 / 128).
A packed replay costs about 0.5 us more host time (``cuLaunchKernelEx`` through ctypes).
Earlier, every PDL launch of the H200
runs S11-R6 and S15-R1 (2026-12-02/03) failed with ``CUDA_ERROR_INVALID_VALUE``: the eager
merge took its ``DependentLaunch`` from a temporary ``PackedLaunch`` that was freed, with
the argument array the launch points at, before the call (the launch now holds its
owner, ``keep``). A stand-alone probe (S15-R2, ``bench/device/pdl_probe.py``) launched
with this module's structs on the legacy and per-thread default streams, on created
streams and in a stream capture, every one accepted and ordered, so no stream is
refused here.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

from ..errors import env_flag

PDL_ENV = "PAGED_DECODE_PDL"
#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: the compute capability griddepcontrol needs
MIN_MAJOR = 9


class _Value(ctypes.Union):
    # CUlaunchAttributeValue: 64 bytes, 8-byte aligned (it holds pointers)
    _fields_ = [("pad", ctypes.c_char * 64), ("ptr", ctypes.c_void_p), ("int", ctypes.c_int)]


class _Attribute(ctypes.Structure):
    # CUlaunchAttribute: id, pad to 8, value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _Value)]


class _Config(ctypes.Structure):
    # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attribute)), ("numAttrs", ctypes.c_uint)]


@functools.cache
def driver_entry() -> Any:
    """``cuLaunchKernelEx`` of the CUDA driver, or ``None`` (no driver, or one older than
    CUDA 12)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_void_p]
    return fn


def requested(packed: bool = False) -> bool:
    """Whether ``PAGED_DECODE_PDL`` asks for dependent launches of launches that are
    ``packed`` (argument arrays packed once, replayed: ``compile_launches``) or eager:
    unset, exactly the packed ones; ``1`` all; ``0`` none."""
    return env_flag(PDL_ENV, default=packed)


def enabled(major: int, entry: Any = None, packed: bool = False) -> bool:
    """Whether dependent launches (``packed`` or eager, as for ``requested``) go through
    PDL on a device of compute capability ``major``: ``requested(packed)``, sm_90+, and a
    driver with ``cuLaunchKernelEx`` (``entry``: that function; default the driver's)."""
    if not requested(packed) or major < MIN_MAJOR:
        return False
    return (driver_entry() if entry is None else entry) is not None


class DependentLaunch:
    """One kernel launch with programmatic stream serialization: ``fn`` (a ``CUfunction``
    handle), the grid, block and dynamic shared memory, ``params`` (the address of its
    ``void*[]`` of argument pointers) and ``keep`` (whatever owns that array and the
    arguments it points at: held as long as the launch is, so a launch taken from a
    temporary owner still reads live memory). ``__call__(stream)``
    launches it on ``stream`` (a ``CUstream`` handle); a driver error raises
    ``RuntimeError`` naming the code. The config is built once, so a replay allocates
    nothing."""

    __slots__ = ("_entry", "_fn", "_params", "_keep", "_attr", "_config")

    def __init__(self, fn: int, grid: tuple[int, int], block: int, smem: int, params: int,
                 entry: Callable[..., int] | None = None, keep: Any = None) -> None:
        self._entry = driver_entry() if entry is None else entry
        if self._entry is None:
            raise RuntimeError("cuda_pdl: the CUDA driver has no cuLaunchKernelEx")
        self._fn, self._params = ctypes.c_void_p(fn), ctypes.c_void_p(params)
        self._keep = keep
        self._attr = _Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value.int = 1
        gx, gy = grid
        self._config = _Config(gridDimX=gx, gridDimY=gy, gridDimZ=1, blockDimX=block,
                               blockDimY=1, blockDimZ=1, sharedMemBytes=smem,
                               attrs=ctypes.pointer(self._attr), numAttrs=1)

    def __call__(self, stream: int) -> None:
        self._config.hStream = stream
        err = self._entry(ctypes.byref(self._config), self._fn, self._params, None)
        if err:
            raise RuntimeError(f"cuda_pdl: cuLaunchKernelEx returned CUresult {err} "
                               f"(grid {self._config.gridDimX} x {self._config.gridDimY}, "
                               f"block {self._config.blockDimX}, "
                               f"{self._config.sharedMemBytes} B of shared memory)")


__all__ = ["MIN_MAJOR", "PDL_ENV", "DependentLaunch", "driver_entry", "enabled",
           "requested"]
