"""The CUDA backend: the kernels in ``kernels/`` compiled at run time through CuPy.

Arrays: CuPy arrays, and any CUDA array exposing DLPack or ``__cuda_array_interface__``
(torch tensors) are used in place, without copies; results come back in the caller's
array kind. Launches go to the caller's current stream (CuPy's, or torch's when the
inputs are torch tensors) on the inputs' device. Table and plan arrays are copied to the
device once per (table or plan object, device) and memoised, and the merge workspace is
kept per (plan, device, stream), so after its first call on a stream a decode with a plan
and a caller-provided output makes no host-to-device copy and no allocation (it can be
captured in a CUDA graph). ``compile_launches`` packs a call's launches once for
``prepare_decode``; ``prepare`` uploads a table and plan ahead of time.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..device import DeviceInfo
from ..dtypes import dtype_name, numpy_dtype
from ..errors import InvalidArgumentError, InvalidDtypeError
from ..kernels import append as append_kernel
from ..kernels.append import AppendWrite
from ..page_table import PageTable
from ..plan import DecodePlan
from ..specs import KernelSpec, assert_compile_allowed, cuda_source
from . import launches
from .base import Backend, Problem, Support, poison_enabled

CTAS_PER_SM = 2   # measured: bench/results/h200/tune_plan_2026-11-30.json
MIN_CHUNK_TOKENS = 128  # measured: bench/results/h200/tune_plan_2026-11-30.json
COMPILE_OPTIONS = ("-std=c++17",)

try:  # imported lazily by the registry; a failure here marks the backend unavailable
    import cupy as cp
except Exception:  # pragma: no cover - exercised only where CuPy is missing
    cp = None


@functools.cache
def _module(kernel: str, name_expressions: tuple[str, ...]) -> Any:
    return cp.RawModule(code=cuda_source(kernel), options=COMPILE_OPTIONS,
                        name_expressions=list(name_expressions))


@functools.cache
def compiled(spec: KernelSpec) -> Any:
    """The compiled kernel of ``spec`` (one module per specialization, cached)."""
    assert_compile_allowed(spec)
    expr = spec.cuda_name_expression()
    return _module(spec.kernel, (expr,)).get_function(expr)


def _torch() -> Any:
    try:
        import torch
        return torch
    except Exception:
        return None


class CudaBackend(Backend):
    name = "cuda"
    merge_gathers = True

    def __init__(self) -> None:
        self._uploads: dict[tuple[int, int], Any] = {}
        self._workspaces: dict[tuple[Any, ...], Any] = {}
        self._recording = threading.local()

    @classmethod
    def available(cls) -> Support:
        if cp is None:
            return Support(False, "CuPy is not installed (pip install 'paged-decode[cuda12]' "
                                  "or '[cuda13]')")
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:
            return Support(False, f"no usable CUDA device ({type(exc).__name__}: {exc})")
        return Support(True) if n > 0 else Support(False, "no CUDA device")

    def device_info(self, index: int | None = None) -> DeviceInfo:
        i = cp.cuda.Device().id if index is None else index
        return _device_info(i)

    def describe(self) -> dict[str, Any]:
        info = self.device_info()
        return {"backend": self.name, "cupy": cp.__version__, "device": info.name,
                "sms": info.compute_units, "driver": cp.cuda.runtime.driverGetVersion(),
                "runtime": cp.cuda.runtime.runtimeGetVersion()}

    def supports(self, problem: Problem) -> Support:
        return launches.support(problem)

    # ----------------------------------------------------------- arrays
    def owns(self, x: Any) -> bool:
        return isinstance(x, cp.ndarray)

    def asarray(self, x: Any) -> Any:
        """A CuPy view of ``x`` (no copy for device arrays; host arrays are uploaded)."""
        if isinstance(x, cp.ndarray):
            return x
        if type(x).__module__.split(".")[0] == "torch":
            if not x.is_cuda:
                raise InvalidArgumentError(f"cuda backend: torch tensor on {x.device} is not a "
                                           "CUDA tensor")
            return _from_torch(x)
        if hasattr(x, "__cuda_array_interface__"):
            return cp.asarray(x)
        if hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
            return cp.from_dlpack(x)
        return cp.asarray(np.asarray(x))

    def array_module(self) -> Any:
        return cp

    def to_numpy(self, x: Any) -> np.ndarray:
        a = self.asarray(x)
        return cp.asnumpy(a)

    def dtype_of(self, x: Any) -> str:
        dt = self.asarray(x).dtype
        try:
            return dtype_name(dt)
        except InvalidDtypeError:
            return str(dt)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        out = cp.empty(shape, numpy_dtype(dtype))
        if poison_enabled():
            out.view(np.uint16 if out.itemsize == 2 else np.uint32).fill(
                0x7E00 if dtype == "float16" else 0x7FC0 if dtype == "bfloat16" else 0x7FC00000)
        return out

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        return cp.zeros(shape, numpy_dtype(dtype))

    def wrap_result(self, x: Any, like: Any) -> Any:
        if type(like).__module__.split(".")[0] == "torch":
            torch = _torch()
            return torch.from_dlpack(x)
        return x

    @contextlib.contextmanager
    def launch_context(self, like: Any) -> Iterator[None]:
        """Run on ``like``'s device and its framework's current stream."""
        if type(like).__module__.split(".")[0] == "torch":
            torch = _torch()
            dev = like.device.index
            dev = torch.cuda.current_device() if dev is None else dev
            ptr = torch.cuda.current_stream(dev).cuda_stream
            with cp.cuda.Device(dev), _external_stream(ptr, dev):
                yield
            return
        dev = like.device.id if isinstance(like, cp.ndarray) else cp.cuda.Device().id
        with cp.cuda.Device(dev):
            yield

    # ----------------------------------------------------------- pool writes
    def append_rows(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
                    write: AppendWrite) -> tuple[Any, Any]:
        """One launch of the append kernel, in place, on the pools' device and the
        current stream; ``write.desc`` is the one host-to-device copy. Words are 16 bytes
        where the row size and the four arrays' addresses allow (``vector_bytes``)."""
        with self.launch_context(k_pages):
            kr, vr = (cp.ascontiguousarray(self.asarray(r).astype(k_pages.dtype, copy=False))
                      for r in (k_rows, v_rows))
            shape = tuple(k_pages.shape)
            vec = append_kernel.vector_bytes(
                shape[-2] * shape[-1] * k_pages.itemsize,
                tuple(a.data.ptr for a in (k_pages, v_pages, kr, vr)))
            self._run(launches.append_launch(write, self.dtype_of(k_pages), vec, shape, kr,
                                             vr, cp.asarray(write.desc), k_pages, v_pages))
        return k_pages, v_pages

    # ----------------------------------------------------------- device copies of host data
    def upload(self, arr: np.ndarray) -> Any:
        """Device copy of a host array on the current device.

        Read-only arrays (every table and plan array) are immutable, so their copies are
        memoised by identity until the host array is collected.
        """
        if arr.flags.writeable:
            return cp.asarray(arr)
        key = (id(arr), cp.cuda.Device().id)
        got = self._uploads.get(key)
        if got is None:
            got = cp.asarray(arr if arr.size else np.zeros(1, arr.dtype))
            self._uploads[key] = got
            weakref.finalize(arr, self._uploads.pop, key, None)
        return got

    def prepare(self, table: PageTable, plan: DecodePlan | None = None) -> None:
        """Upload ``table`` (and ``plan``) to the current device ahead of time (e.g. before
        capturing a CUDA graph)."""
        for a in (table.indices, table.indptr, table.last_page_len, table.first_page_offset):
            self.upload(a)
        if plan is not None:
            for a in (plan.request_indices, plan.kv_tile_indices, plan.o_indptr):
                self.upload(a)

    def scratch(self, owner: Any, tag: str, shape: tuple[int, ...], dtype: str) -> Any:
        """A workspace of ``owner`` on the current device and stream, allocated on first
        use and kept while ``owner`` lives (the merge workspace of a plan, cascade's
        stacked states). One per stream, so concurrent streams never share partials;
        after the first call on a stream a decode allocates nothing (it can be captured in
        a CUDA graph)."""
        key = (id(owner), tag, tuple(int(x) for x in shape), dtype, cp.cuda.Device().id,
               cp.cuda.get_current_stream().ptr)
        got = self._workspaces.get(key)
        if got is None:
            got = self.empty(shape, dtype)
            self._workspaces[key] = got
            weakref.finalize(owner, self._workspaces.pop, key, None)
        return got

    def run_prefix(self, q: Any, k_pages: Any, v_pages: Any, level0: PageTable,
                   plan0: DecodePlan, members: Any, row_tiles: int, sm_scale: float,
                   v_out: Any, lse_out: Any) -> None:
        _check_aligned("cascade_decode", k_pages, v_pages)
        self._run(launches.prefix_launch(
            self.dtype_of(k_pages), plan0, int(members.shape[0]), level0.total_pages,
            row_tiles, sm_scale, q, k_pages, v_pages, self.upload(level0.indices), members,
            v_out, lse_out))

    def _table(self, table: PageTable) -> tuple[Any, ...]:
        return tuple(self.upload(a) for a in (table.indices, table.indptr, table.last_page_len,
                                              table.first_page_offset))

    # ----------------------------------------------------------- kernels
    def kernel(self, spec: KernelSpec) -> Any:
        """The compiled kernel for ``spec`` (a hook tests override with mutated sources)."""
        return compiled(spec)

    def partial(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable, plan: DecodePlan,
                sm_scale: float, v_out: Any, lse_out: Any) -> None:
        _check_aligned("decode", k_pages, v_pages)
        self._run(launches.partial_launch(
            (self.dtype_of(q), self.dtype_of(k_pages), self.dtype_of(v_out)), plan, sm_scale,
            q, k_pages, v_pages, self._table(table), self.upload(plan.request_indices),
            self.upload(plan.kv_tile_indices), v_out, lse_out))

    def merge(self, v: Any, lse: Any, o_indptr: Any, v_out: Any, lse_out: Any,
              rows: Any = None) -> None:
        ip = o_indptr if isinstance(o_indptr, cp.ndarray) else self.upload(o_indptr)
        self._run(launches.merge_launch(self.dtype_of(v_out), tuple(v_out.shape), v, lse, ip,
                                        v_out, lse_out, rows))

    def decode_v1(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable,
                  sm_scale: float, out: Any, lse_out: Any) -> None:
        _check_aligned("decode", k_pages, v_pages)
        self._run(launches.v1_launch(
            (self.dtype_of(q), self.dtype_of(k_pages), self.dtype_of(out)), tuple(q.shape),
            int(k_pages.shape[2]), table.page_size, sm_scale, q, k_pages, v_pages,
            self._table(table), out, lse_out))

    def _run(self, launch: launches.Launch) -> None:
        """The one place that turns a ``Launch`` into a kernel call on the current stream
        (or, while ``compile_launches`` records, into a recorded launch)."""
        if launch.empty:
            return
        recorded = getattr(self._recording, "launches", None)
        if recorded is not None:
            recorded.append(launch)
            return
        kernel = self._kernel_for(launch)
        gx, gy = launch.grid
        kernel((int(gx), int(gy), 1), (int(launch.block), 1, 1), launch.values(),
               shared_mem=int(launch.smem))

    def _kernel_for(self, launch: launches.Launch) -> Any:
        kernel = self.kernel(launch.spec)
        smem = launch.smem
        if smem and _smem_opt_in.get(id(kernel), (None, 0))[1] < smem:
            # above 48 KB of dynamic shared memory a kernel must opt in (once per kernel; the
            # entry keeps the kernel alive so its id is never reused)
            kernel.max_dynamic_shared_size_bytes = int(smem)
            _smem_opt_in[id(kernel)] = (kernel, int(smem))
        return kernel

    def stream_key(self, like: Any) -> int:
        """The raw current stream for arrays like ``like`` (torch's for torch tensors)."""
        return _stream_getter(like)()

    def compile_launches(self, run: Callable[[], Any], like: Any) -> Callable[[], Any]:
        """Record the launches ``run`` makes (nothing runs), then return a callable that
        replays them through ``cuLaunchKernel`` with arguments packed once, on the current
        stream of ``like``'s framework at call time (torch's for torch tensors, CuPy's
        otherwise) and on ``like``'s device. No allocation, host synchronization or
        host-to-device copy happens in the callable, so it can be captured in a graph."""
        self._recording.launches = []
        try:
            with self.launch_context(like):
                run()
                recorded = self._recording.launches
                packed = [_PackedLaunch(self._kernel_for(lc), lc) for lc in recorded]
                dev = cp.cuda.Device().id
        finally:
            self._recording.launches = None
        stream = _stream_getter(like)
        launch = cp.cuda.driver.launchKernel
        get_device = cp.cuda.runtime.getDevice

        def replay() -> None:
            if get_device() != dev:
                with cp.cuda.Device(dev):
                    replay()
                return
            s = stream()
            for pk in packed:
                launch(pk.fn, pk.gx, pk.gy, 1, pk.block, 1, 1, pk.smem, s, pk.params, 0)

        replay.launches = tuple(recorded)  # type: ignore[attr-defined]
        return replay

    def gather_sdpa(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable,
                    sm_scale: float, out: Any, lse_out: Any) -> None:
        from .cuda_gather import gather_attention
        gather_attention(self, q, k_pages, v_pages, table, sm_scale, out, lse_out)


@functools.cache
def _device_info(index: int) -> DeviceInfo:
    props = cp.cuda.runtime.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    sms = int(props["multiProcessorCount"])
    tc = int(props["major"]) >= 8          # mma.sync m16n8k16 with f16 and bf16
    return DeviceInfo("cuda", name, sms, CTAS_PER_SM, index=index,
                      detail=f"compute capability {props['major']}.{props['minor']}",
                      min_chunk_tokens=MIN_CHUNK_TOKENS,
                      prefix_tile_rows=launches.PREFIX_TILE_ROWS if tc else 0,
                      shared_mem_per_unit=int(props.get("sharedMemPerMultiprocessor", 0)))


def _check_aligned(fn: str, *arrays: Any) -> None:
    for a in arrays:
        if a.data.ptr % 16:
            raise InvalidArgumentError(f"{fn}: K/V page pools must be 16-byte aligned for "
                                       f"vector loads, got an address {a.data.ptr:#x}")


_smem_opt_in: dict[int, tuple[Any, int]] = {}


class _PackedLaunch:
    """One recorded launch with its kernel arguments packed for ``cuLaunchKernel``: a
    ``void*[]`` of pointers to ctypes copies of each argument (device pointers for
    arrays, ``int32``/``float32`` scalars). Keeps the arrays alive."""

    __slots__ = ("fn", "gx", "gy", "block", "smem", "params", "_keep")

    def __init__(self, kernel: Any, launch: launches.Launch) -> None:
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
        self._keep = (cells, ptrs, launch.values())


def _stream_getter(like: Any) -> Callable[[], int]:
    """A function returning the raw current stream for calls on arrays like ``like``:
    torch's current stream on the tensor's device for torch tensors, else CuPy's."""
    if type(like).__module__.split(".")[0] == "torch":
        current, dev = _torch().cuda.current_stream, like.device
        return lambda: int(current(dev).cuda_stream)
    get = cp.cuda.get_current_stream
    return lambda: int(get().ptr)


def _external_stream(ptr: int, dev: int) -> Any:
    """A CuPy stream object for a raw CUDA stream owned by another framework."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 prefers from_external
        return cp.cuda.ExternalStream(ptr, dev)


def _from_torch(t: Any) -> Any:
    """Zero-copy CuPy view of a CUDA torch tensor (bfloat16 through an int16 view if needed)."""
    try:
        return cp.from_dlpack(t)
    except Exception:
        torch = _torch()
        if t.dtype != torch.bfloat16:
            raise
        raw = cp.from_dlpack(t.view(torch.int16))
        return raw.view(numpy_dtype("bfloat16"))


__all__ = ["CudaBackend", "compiled"]
