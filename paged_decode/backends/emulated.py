"""The ``emulated-cuda`` backend: the real CUDA kernel strings, run on the CPU emulator.

Arrays are numpy; the kernel entry points (``partial``, ``merge``, ``decode_v1``, the
prefix kernel, the append) are ``LaunchingBackend``'s, the CUDA backend's own: each
``Launch`` compiles ``specs.cuda_source(kind)`` with the spec's name expression through
``paged_decode.emulator`` and runs with the CUDA backend's grid, block, dynamic shared
memory and argument order. ``gather_sdpa`` is the reference backend's (it is not a
kernel of ours).

``EmulatedMetalBackend`` (``emulated-metal``) runs the Metal bodies the same way, wrapped
in the signature MLX's ``metal_kernel`` generates (``paged_decode.emulator.metal``).

Explicit choice only (``backend="emulated-cuda"``, ``PAGED_DECODE_BACKEND`` or
``paged-decode check --backend emulated-cuda``): it is slow and meant for tests and CI.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..device import DeviceInfo
from ..errors import env_flag
from ..kernels import append as append_kernel
from ..kernels.append import AppendWrite
from ..kernels.kernel_def import MetalKernel
from ..specs import (
    PREFIX_TILE_ROWS,
    KernelSpec,
    assert_compile_allowed,
    cuda_define_text,
    cuda_source,
)
from . import launches
from .base import Support
from .launching import LaunchingBackend
from .metal_launches import metal_call, metal_kernel
from .reference import ReferenceBackend

RACES_ENV = "PAGED_DECODE_EMULATOR_RACES"   # "0" runs the first schedule only
#: (spec URI, hash of its source) of each CUDA-dialect kernel this process has compiled or
#: loaded (``EmulatedCudaBackend._ready``)
_LOADED: set[tuple[str, int]] = set()


class EmulatedCudaBackend(LaunchingBackend, ReferenceBackend):
    """``schedules`` (fiber schedule names, ``emulator.launch.SCHEDULES``) and ``cp_async``
    (``"deferred"`` / ``"sync"``) default to the emulator's environment settings;
    ``check_races`` to ``$PAGED_DECODE_EMULATOR_RACES`` (``"0"``: the first schedule
    only)."""

    name = "emulated-cuda"
    merge_gathers = True
    tensor_core_decode = True
    records_graphs = True
    compiles_ahead = True

    def runs_clusters(self) -> bool:
        return True       # the emulator interleaves a cluster's CTAs (emulator/runtime_src.py)

    def __init__(self, *, check_races: bool | None = None,
                 schedules: tuple[str, ...] | None = None, cp_async: str | None = None
                 ) -> None:
        self.check_races = (env_flag(RACES_ENV, True)
                            if check_races is None else check_races)
        self.schedules, self.cp_async = schedules, cp_async
        # what this thread records (compile_launches, capture_graph): one backend object
        # serves every thread, and another thread's launches must run, not join it
        self._tls = threading.local()

    @classmethod
    def available(cls) -> Support:
        from .. import emulator
        ok, why = emulator.available()
        return Support(ok, why)

    def device_info(self) -> DeviceInfo:
        # the reference backend's fixed target, so plans do not depend on this machine
        return DeviceInfo("emulated-cuda", "CUDA kernels on the CPU emulator", compute_units=8,
                          ctas_per_unit=4, detail="fibers on up to 2 OS threads; fixed "
                          "target 32 CTAs", prefix_tile_rows=PREFIX_TILE_ROWS)

    def describe(self) -> dict[str, Any]:
        from ..emulator import cache_dir
        from ..emulator.launch import default_cp_async, default_schedules
        return {"backend": self.name, "numpy": np.__version__, "device": "CPU (emulated CUDA)",
                "cache": str(cache_dir()), "race_check": self.check_races,
                "schedules": list(self.schedules or default_schedules()),
                "cp_async": self.cp_async or default_cp_async()}

    # ----------------------------------------------------------- kernels
    def kernel_source(self, spec: KernelSpec) -> str:
        """The CUDA source compiled for ``spec``: NVRTC's ``-D`` options for it as
        ``#define`` lines, then the kernel's source (a hook tests override with mutants)."""
        return cuda_define_text(spec) + cuda_source(spec.kernel)

    def precompile(self, spec: KernelSpec) -> None:
        self._ready(spec, self.kernel_source(spec))

    def _ready(self, spec: KernelSpec, source: str) -> None:
        """Compile (or load from the emulator's disk cache) ``spec``'s library once per
        process and source; as the CUDA backend does, a spec this process has not loaded
        yet raises under ``PAGED_DECODE_ASSERT_NO_COMPILE``."""
        key = (spec.uri, hash(source))
        if key in _LOADED:
            return
        from ..emulator.compiler import kernel_library
        from ..emulator.rewrite import wrap_cuda
        assert_compile_allowed(spec)
        kernel_library(wrap_cuda(source, spec.cuda_name_expression()))
        _LOADED.add(key)

    # ----------------------------------------------------------- graphs
    @property
    def _graph(self) -> list[tuple[Any, ...]] | None:
        """The operations this thread's capture records (``capture_graph``), ``None``
        when it is not capturing."""
        return getattr(self._tls, "graph", None)

    @_graph.setter
    def _graph(self, value: list[tuple[Any, ...]] | None) -> None:
        self._tls.graph = value

    @property
    def _recording(self) -> list[launches.Launch] | None:
        """The launches this thread's ``compile_launches`` records, ``None`` when it is
        not recording."""
        return getattr(self._tls, "recording", None)

    @_recording.setter
    def _recording(self, value: list[launches.Launch] | None) -> None:
        self._tls.recording = value

    def capture_graph(self, run: Callable[[], Any],
                      prologue: Callable[[], Any] | None = None) -> tuple[Any, Any]:
        """A model of CUDA graph capture: one eager run of ``run``, then ``prologue`` and
        ``run`` recorded, not run: their launches (``_run``) and device copies
        (``device_copy``) become a list of operations on the same arrays, which
        ``replay_graph`` runs again. Like a CUDA graph, a replay reads whatever those
        arrays hold then and runs none of the host code that made the calls (so a
        launch on an array rebound since capture, or host work left out of the graph,
        shows in the results)."""
        run()
        self._graph = []
        try:
            if prologue is not None:
                prologue()
            run()
            graph = tuple(self._graph)
        finally:
            self._graph = None
        return graph, None

    def replay_graph(self, graph: Any, like: Any) -> None:
        for op in graph:
            if op[0] == "launch":
                self._run(op[1])
            else:
                np.copyto(op[1], op[2])

    def compile_launches(self, run: Callable[[], Any], like: Any) -> Callable[[], Any]:
        """As the CUDA backend's: the launches ``run`` makes are recorded (nothing runs)
        and the callable replays them on the same arrays, without ``run``'s host code
        (so work left out of the launches, or an array rebound since, shows)."""
        outer, self._recording = self._recording, []
        try:
            run()
            recorded = tuple(self._recording)
        finally:
            self._recording = outer

        def replay() -> None:
            for lc in recorded:
                self._run(lc)
        replay.launches = recorded  # type: ignore[attr-defined]
        return replay

    def device_copy(self, dst: Any, src: Any) -> None:
        if self._graph is not None:
            self._graph.append(("copy", dst, src))
            return
        np.copyto(dst, src)

    def _run(self, lc: launches.Launch) -> None:
        """Run a ``Launch`` on the emulator: inputs are copied into guarded buffers and
        outputs written back (C-contiguous stand-ins when the caller's are not); while a
        capture records, it joins the graph instead."""
        from ..emulator import Buffer, launch
        if lc.empty:
            return
        if self._recording is not None:
            self._recording.append(lc)
            return
        if self._graph is not None:
            self._graph.append(("launch", lc))
            return
        outs = [a.value for a in lc.args if a.role == "out"]
        with _Outputs(*outs) as tmp:
            it = iter(tmp)
            args = [a.value if a.role == "scalar" else
                    Buffer(a.name, next(it) if a.role == "out" else _host(a.value),
                           a.role == "out")
                    for a in lc.args]
            source = self.kernel_source(lc.spec)
            self._ready(lc.spec, source)
            launch(source, lc.spec.cuda_name_expression(),
                   (lc.grid[0], lc.grid[1], 1), lc.block, args, lc.smem,
                   check_races=self.check_races, schedules=self.schedules,
                   cp_async=self.cp_async, cluster=max(1, lc.spec.cluster))

    # ----------------------------------------------------------- launching hooks
    def index_array(self, arr: Any) -> Any:
        return arr          # the emulator's buffers copy it (``_host``)

    def append_row_arrays(self, k_pages: Any, k_rows: Any, v_rows: Any) -> tuple[Any, Any]:
        kr, vr = _rows(k_pages, k_rows, v_rows)
        return kr, vr

    def append_vector_bytes(self, k_pages: Any, v_pages: Any, k_rows: Any,
                            v_rows: Any) -> int:
        # the emulator's buffers are aligned to the largest power of two <= 16 dividing
        # their size, a multiple of the row
        return append_kernel.vector_bytes(
            k_pages.shape[-2] * k_pages.shape[-1] * k_pages.itemsize)


def _host(a: Any) -> np.ndarray:
    """An input as a C-contiguous numpy array (index arrays as int32; ``uint8`` arrays are
    fp8 pools' codes, kept as bytes)."""
    arr = np.ascontiguousarray(a)
    return arr.astype(np.int32) if arr.dtype.kind in "iu" and arr.dtype != np.uint8 else arr


def _rows(pages: np.ndarray, *rows: Any) -> list[np.ndarray]:
    """New K/V rows in the pools' dtype, C-contiguous."""
    return [np.ascontiguousarray(np.asarray(r).astype(pages.dtype, copy=False)) for r in rows]


class _Outputs:
    """C-contiguous stand-ins for output arrays, written back on success."""

    def __init__(self, *arrays: Any) -> None:
        self.arrays = arrays
        self.tmp = [a if a is None or a.flags.c_contiguous else np.ascontiguousarray(a)
                    for a in arrays]

    def __enter__(self) -> list[Any]:
        return self.tmp

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is None:
            for a, t in zip(self.arrays, self.tmp):
                if t is not a:
                    a[...] = t


class EmulatedMetalBackend(EmulatedCudaBackend):
    """The Metal kernel bodies (``kernels/*.py`` ``METAL_SOURCE``), wrapped in the
    signature ``mlx.core.fast.metal_kernel`` generates and run on the CPU emulator with
    the template arguments and geometry an MLX call would use (``metal_launches``). The
    launch descriptions are the CUDA backend's (``launches.py``), converted in one place.
    Nothing here ran on Apple hardware."""

    name = "emulated-metal"
    merge_gathers = False      # the Metal merge has no row index
    tensor_core_decode = True  # on simdgroup_matrix
    records_graphs = False     # no graphs (as on metal)
    metal_dialect = True
    in_place_append = False

    def device_info(self) -> DeviceInfo:
        return DeviceInfo("emulated-metal", "Metal kernels on the CPU emulator",
                          compute_units=8, ctas_per_unit=4, detail="fibers on up to 2 OS "
                          "threads; fixed target 32 threadgroups")

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["device"] = "CPU (emulated Metal, MLX metal_kernel signature)"
        return d

    def capture_graph(self, run: Callable[[], Any],
                      prologue: Callable[[], Any] | None = None) -> tuple[Any, Any]:
        """No graphs (as on ``metal``): the append and the table update adopt their
        outputs on the host, which a list of launches would leave out."""
        run()
        return None, None

    def compile_launches(self, run: Callable[[], Any], like: Any) -> Callable[[], Any]:
        """``run`` itself (the Metal dialect's outputs are adopted on the host)."""
        return run

    def metal_kernel(self, spec: KernelSpec) -> MetalKernel:
        """The Metal header and body run for ``spec`` (a hook tests override with mutants)."""
        return metal_kernel(spec.kernel)

    def append_fallback(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
                        write: AppendWrite) -> tuple[Any, Any]:
        """Inputs too small for the kernel's word accesses take the reference path (as
        ``metal`` takes MLX ops)."""
        return ReferenceBackend.append_rows(self, k_pages, v_pages, k_rows, v_rows, write)

    def adopt_pools(self, k_pages: Any, v_pages: Any, outs: tuple[Any, Any]
                    ) -> tuple[Any, Any]:
        """The Metal kernel writes whole new pools (as MLX returns fresh outputs: NaN under
        ``PAGED_DECODE_POISON``), copied back into the pool arrays."""
        k_pages[...], v_pages[...] = outs
        return k_pages, v_pages

    def adopt_table(self, buf: Any, new: Any) -> Any:
        """The kernel wrote a whole new buffer; copied back into the table's."""
        buf[...] = new
        return buf

    def _run(self, lc: launches.Launch) -> None:
        from ..emulator.metal import launch_metal
        if lc.empty:
            return
        call = metal_call(lc, self.dtype_of)
        mk = self.metal_kernel(lc.spec)
        call = dataclasses.replace(call, kernel=mk)
        with _Outputs(*call.outputs) as tmp:
            ins = [np.asarray(x) if np.ndim(x) == 0 else _host(x) for x in call.inputs]
            launch_metal(call.name, mk.inputs, mk.outputs, mk.source, mk.header, ins, tmp,
                         call.grid, call.threadgroup, call.template,
                         output_dtypes=call.output_dtypes, check_races=self.check_races,
                         schedules=self.schedules)


__all__ = ["EmulatedCudaBackend", "EmulatedMetalBackend"]
