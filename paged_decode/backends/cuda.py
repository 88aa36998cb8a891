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

Array interop and streams are ``cuda_arrays``; compiled kernels, device caches and
launch replay are ``cuda_launch``; the kernel entry points are ``LaunchingBackend``'s.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from ..device import DeviceInfo
from ..dtypes import dtype_name, numpy_dtype
from ..errors import InvalidArgumentError, InvalidDtypeError
from ..fp8 import is_fp8
from ..kernels import append as append_kernel
from ..page_table import PageTable
from ..plan import DecodePlan
from ..specs import PREFIX_TILE_ROWS, KernelSpec
from . import cuda_arrays, cuda_pdl, cuda_staging, launches
from .base import Support, poison_enabled
from .cuda_append import EagerAppend
from .cuda_arrays import cp
from .cuda_launch import COMPILE_OPTIONS, DeviceCaches, PackedLaunch, compiled, replayer, with_smem
from .launching import LaunchingBackend

CTAS_PER_SM = 2   # measured: bench/results/h200/tune_plan_2026-11-30.json
#: measured: bench/results/h200/2026-12-03-s14/r6 (v2tc over e4m3fn pools, 32/8 x 128,
#: batch 8 / 32 x 8K / 32K: 4 per SM took 0.82-0.89x the time of 2 in every cell; 6 and 8
#: per SM 0.92-1.10x and 0.82-1.07x)
FP8_CTAS_PER_SM = 4
MIN_CHUNK_TOKENS = 128  # measured: bench/results/h200/tune_plan_2026-11-30.json
#: measured: bench/results/h200/2026-12-01-s6/tune_tc.json (v2 on ragged batches: 0.5 cut
#: 128 x U(512, 4K) from 371 to 320 us and 64 x U(512, 1536) from 101 to 96 us)
RAGGED_SPLIT = 0.5


class CudaBackend(LaunchingBackend):
    name = "cuda"
    merge_gathers = True
    tensor_core_decode = True
    records_graphs = True
    compiles_ahead = True

    def __init__(self) -> None:
        self._caches = DeviceCaches(self.empty)
        self._recording = threading.local()
        #: per-step uploads (stage_int32, update_table): pinned buffers, device deltas and
        #: recorded table-update launches, by address (least recently used dropped)
        self._staging = cuda_staging.PinnedStaging()
        self._deltas: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._table_updates: OrderedDict[tuple[int, ...], Callable[[], Any]] = OrderedDict()
        self._eager_append = EagerAppend(self)

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

    def runs_clusters(self) -> bool:
        return _runs_clusters(cp.cuda.Device().id)

    def describe(self) -> dict[str, Any]:
        info = self.device_info()
        return {"backend": self.name, "cupy": cp.__version__, "device": info.name,
                "sms": info.compute_units, "driver": cp.cuda.runtime.driverGetVersion(),
                "runtime": cp.cuda.runtime.runtimeGetVersion()}

    # ----------------------------------------------------------- arrays
    def owns(self, x: Any) -> bool:
        return isinstance(x, cp.ndarray)

    def asarray(self, x: Any) -> Any:
        """A CuPy view of ``x`` (no copy for device arrays; host arrays are uploaded)."""
        return cuda_arrays.as_cupy(x)

    def array_module(self) -> Any:
        return cp

    def to_numpy(self, x: Any) -> np.ndarray:
        return cp.asnumpy(self.asarray(x))

    def dtype_of(self, x: Any) -> str:
        dt = self.asarray(x).dtype
        try:
            return dtype_name(dt)
        except InvalidDtypeError:
            return str(dt)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        out = cp.empty(shape, _cupy_dtype(dtype))
        if poison_enabled():
            if out.itemsize == 1:          # fp8 bytes: 0x7F is NaN in both formats
                out.fill(0x7F)
            else:
                out.view(np.uint16 if out.itemsize == 2 else np.uint32).fill(
                    0x7E00 if dtype == "float16" else 0x7FC0 if dtype == "bfloat16"
                    else 0x7FC00000)
        return out

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        return cp.zeros(shape, _cupy_dtype(dtype))

    def wrap_result(self, x: Any, like: Any) -> Any:
        return cuda_arrays.like_caller(x, like)

    def launch_context(self, like: Any) -> Any:
        """Run on ``like``'s device and its framework's current stream."""
        return cuda_arrays.device_and_stream(like)

    def stream_key(self, like: Any) -> int:
        """The raw current stream for arrays like ``like`` (torch's for torch tensors)."""
        return cuda_arrays.stream_getter(like)()

    def capturing(self) -> bool:
        """Whether the current stream (the launch context's) is capturing a graph."""
        return bool(cp.cuda.get_current_stream().is_capturing())

    # ----------------------------------------------------------- device copies of host data
    def upload(self, arr: np.ndarray) -> Any:
        """Device copy of a host array on the current device (read-only arrays memoised
        by identity while they live)."""
        return self._caches.upload(arr)

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
        return self._caches.scratch(owner, tag, shape, dtype)

    def merge_counters(self, plan: DecodePlan) -> Any:
        """The fused merge's counters, kept like ``scratch`` (zeroed when made; every
        launch leaves them zero)."""
        return self._caches.scratch(plan, "merge_counters",
                                    (launches.fused_merge_slots(plan),), "int32", zero=True)

    def stage_int32(self, dst: Any, *parts: np.ndarray) -> None:
        """``parts`` into the start of ``dst`` with one ``cudaMemcpyAsync`` on the current
        stream, through a reused pinned buffer (``cuda_staging``)."""
        self._staging.copy(dst, *parts)

    def update_table(self, buf: Any, delta: Any, cap: int, page_cap: int, *,
                     scratch: Any) -> Any:
        """The in-place table update (``LaunchingBackend.update_table``) without per-step
        allocation: ``buf`` is copied to ``scratch`` with one ``cudaMemcpyAsync`` and the
        update kernel is a recorded launch on fixed addresses, reading ``delta`` where it
        is (a step's staging buffer, ``step_upload.py``: nothing is uploaded here, so a
        graph can hold the update), or, for a host delta, from a device buffer kept per
        table buffer that it is first copied into through a pinned buffer."""
        dev = int(buf.device.id)
        if isinstance(delta, cp.ndarray):
            d = delta
        else:
            d = cuda_staging.kept_int32(self._deltas, (dev, int(buf.data.ptr)), delta.size)
            self._staging.copy(d, np.ascontiguousarray(delta, np.int32))
        cuda_staging.copy_device(scratch, buf)
        lkey = (dev, int(buf.data.ptr), int(scratch.data.ptr), int(d.data.ptr), cap, page_cap)
        replay = self._table_updates.pop(lkey, None)
        if replay is None:
            launch = launches.table_update_launch(cap=cap, page_cap=page_cap, old=scratch,
                                                  delta=d, new=buf)
            replay = self.compile_launches(lambda: self._run(launch), like=buf)
        cuda_staging.remember(self._table_updates, lkey, replay)
        replay()
        return buf

    def replay_graph(self, graph: Any, like: Any) -> None:
        with self.launch_context(like):       # torch's current stream for torch arrays
            graph.launch(cp.cuda.get_current_stream())

    def synchronize(self, *arrays: Any) -> None:
        """Wait for every stream of the current device (host timers of whole steps)."""
        cp.cuda.Device().synchronize()

    def capture_graph(self, run: Callable[[], Any],
                      prologue: Callable[[], Any] | None = None) -> tuple[Any, Any]:
        """One eager run of ``run`` on a fresh stream (compiles, allocates the workspaces
        there), then a capture of ``prologue`` and ``run`` on it in global mode (host
        syncs and allocations inside the capture fail loudly). The eager run is ordered
        after the work queued on the current stream (a step's upload) and before what is
        queued there next."""
        caller = cp.cuda.get_current_stream()
        stream = cp.cuda.Stream(non_blocking=True)
        stream.wait_event(caller.record())
        with stream:
            run()
            stream.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
            try:
                if prologue is not None:
                    prologue()
                run()
            finally:
                graph = stream.end_capture()
        caller.wait_event(stream.record())
        return graph, stream

    def table_buffer(self, host: np.ndarray) -> Any:
        """A device copy of a step table's buffer on the current device (never memoised:
        the table writes it)."""
        return cp.array(np.asarray(host, np.int32))

    # ----------------------------------------------------------- launching hooks
    def index_array(self, arr: Any) -> Any:
        return arr if isinstance(arr, cp.ndarray) else self.upload(arr)

    def device_of(self, x: Any) -> int | None:
        if isinstance(x, cp.ndarray):
            return int(x.data.device_id)
        dev = getattr(x, "device", None)
        index = getattr(dev, "index", None)          # a CUDA torch tensor
        return int(index) if index is not None and getattr(dev, "type", "") == "cuda" \
            else None

    def current_device(self) -> int | None:
        return int(cp.cuda.runtime.getDevice())

    def check_pools(self, fn: str, k_pages: Any, v_pages: Any) -> None:
        for a in (k_pages, v_pages):
            if a.data.ptr % 16:
                raise InvalidArgumentError(f"{fn}: K/V page pools must be 16-byte aligned for "
                                           f"vector loads, got an address {a.data.ptr:#x}")

    def append_row_arrays(self, k_pages: Any, k_rows: Any, v_rows: Any) -> tuple[Any, Any]:
        kr, vr = (cp.ascontiguousarray(self.asarray(r).astype(k_pages.dtype, copy=False))
                  for r in (k_rows, v_rows))
        return kr, vr

    def append_rows(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
                    write: append_kernel.AppendWrite,
                    fp8: tuple[str, Any, Any] | None = None) -> tuple[Any, Any]:
        """``LaunchingBackend.append_rows``; eager float appends of CuPy rows in the
        pools' dtype take ``cuda_append.EagerAppend`` (no allocation, a launch packed
        once), the rest the general path."""
        if fp8 is None and getattr(self._recording, "launches", None) is None \
                and self._eager_append.run(k_pages, v_pages, k_rows, v_rows, write):
            return k_pages, v_pages
        return super().append_rows(k_pages, v_pages, k_rows, v_rows, write, fp8)

    def append_vector_bytes(self, k_pages: Any, v_pages: Any, k_rows: Any,
                            v_rows: Any) -> int:
        """16 bytes where the row size and the four arrays' addresses allow."""
        shape = k_pages.shape
        return append_kernel.vector_bytes(
            shape[-2] * shape[-1] * k_pages.itemsize,
            tuple(a.data.ptr for a in (k_pages, v_pages, k_rows, v_rows)))

    # ----------------------------------------------------------- kernels
    def kernel(self, spec: KernelSpec) -> Any:
        """The compiled kernel for ``spec`` (a hook tests override with mutated sources)."""
        return compiled(spec)

    def precompile(self, spec: KernelSpec) -> None:
        self.kernel(spec)

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
        if launch.dependent and self._pdl():
            ex = PackedLaunch(kernel, launch, pdl=True).ex
            assert ex is not None
            ex(cp.cuda.get_current_stream().ptr)
            return
        gx, gy = launch.grid
        kernel((int(gx), int(gy), 1), (int(launch.block), 1, 1), launch.values(),
               shared_mem=int(launch.smem))

    def _pdl(self, packed: bool = False) -> bool:
        """Whether dependent launches (the merge), ``packed`` by ``compile_launches`` or
        eager, use programmatic dependent launch on the current device
        (``cuda_pdl.enabled``). Every eager merge asks, so the setting is read before the
        device is queried."""
        return (cuda_pdl.requested(packed)
                and cuda_pdl.enabled(_major(int(cp.cuda.runtime.getDevice())), packed=packed))

    def _kernel_for(self, launch: launches.Launch) -> Any:
        return with_smem(self.kernel(launch.spec), launch.smem)

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
                pdl = self._pdl(packed=True)
                packed = [PackedLaunch(self._kernel_for(lc), lc, pdl) for lc in recorded]
                dev = cp.cuda.Device().id
        finally:
            self._recording.launches = None
        replay = replayer(packed, dev, cuda_arrays.stream_getter(like))
        replay.launches = tuple(recorded)  # type: ignore[attr-defined]
        return replay

    def gather_sdpa(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable,
                    sm_scale: float, out: Any, lse_out: Any, *, soft_cap: float | None = None,
                    sinks: Any = None, kv_dtype: str | None = None,
                    v_scale: float = 1.0) -> None:
        from .cuda_gather import gather_attention
        gather_attention(self, q, k_pages, v_pages, table, sm_scale, out, lse_out,
                         soft_cap=soft_cap, sinks=sinks, kv_dtype=kv_dtype, v_scale=v_scale)


@functools.cache
def _major(index: int) -> int:
    """Device ``index``'s compute capability major."""
    return int(cp.cuda.runtime.getDeviceProperties(index)["major"])


@functools.cache
def _runs_clusters(index: int) -> bool:
    """Whether device ``index`` runs thread-block clusters (sm_90 and later)."""
    return int(_device_info(index).arch.split(".")[0]) >= 9


@functools.cache
def _device_info(index: int) -> DeviceInfo:
    props = cp.cuda.runtime.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    sms = int(props["multiProcessorCount"])
    tc = int(props["major"]) >= 8          # mma.sync m16n8k16 with f16 and bf16
    return DeviceInfo("cuda", name, sms, CTAS_PER_SM, index=index,
                      detail=f"compute capability {props['major']}.{props['minor']}",
                      min_chunk_tokens=MIN_CHUNK_TOKENS, ragged_split=RAGGED_SPLIT,
                      fp8_ctas_per_unit=FP8_CTAS_PER_SM,
                      prefix_tile_rows=PREFIX_TILE_ROWS if tc else 0,
                      shared_mem_per_unit=int(props.get("sharedMemPerMultiprocessor", 0)),
                      arch=f"{props['major']}.{props['minor']}")



def _cupy_dtype(name: str) -> Any:
    """The CuPy dtype of a canonical name: fp8 pools are ``uint8`` (CuPy has no fp8)."""
    return np.dtype(np.uint8) if is_fp8(name) else numpy_dtype(name)


__all__ = ["COMPILE_OPTIONS", "CudaBackend", "compiled"]
