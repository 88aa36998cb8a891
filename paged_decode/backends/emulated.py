"""The ``emulated-cuda`` backend: the real CUDA kernel strings, run on the CPU emulator.

Arrays are numpy and pool writes are the reference backend's; ``partial``, ``merge`` and
``decode_v1`` compile ``specs.cuda_source(kind)`` with the spec's name expression through
``paged_decode.emulator`` and launch it with the CUDA backend's grid, block, dynamic
shared memory and argument order (``launch_partial`` & co. below mirror
``backends/cuda.py`` line for line; ``tests/test_emulated_kernels.py`` pins the two
together). ``gather_sdpa`` is the reference backend's (it is not a kernel of ours).

Explicit choice only (``backend="emulated-cuda"``, ``PAGED_DECODE_BACKEND`` or
``paged-decode check --backend emulated-cuda``): it is slow and meant for tests and CI.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..device import DeviceInfo
from ..page_table import PageTable
from ..plan import DecodePlan
from ..specs import (
    MAX_PAGE_SIZE,
    SUPPORTED_HEAD_DIMS,
    V1_NUM_WARPS,
    V2_NUM_WARPS,
    KernelSpec,
    cuda_source,
    merge_spec,
    v1_spec,
    v2_spec,
)
from .base import Problem, Support
from .reference import ReferenceBackend

LOG2E = 1.4426950408889634
RACES_ENV = "PAGED_DECODE_EMULATOR_RACES"   # "0" skips the second (reverse) schedule


def _buf(name: str, a: Any, output: bool = False) -> Any:
    from ..emulator import Buffer
    return Buffer(name, a, output)


class EmulatedCudaBackend(ReferenceBackend):
    name = "emulated-cuda"

    def __init__(self, *, check_races: bool | None = None) -> None:
        self.check_races = (os.environ.get(RACES_ENV, "1") not in ("", "0")
                            if check_races is None else check_races)

    @classmethod
    def available(cls) -> Support:
        from .. import emulator
        ok, why = emulator.available()
        return Support(ok, why)

    def device_info(self) -> DeviceInfo:
        # the reference backend's fixed target, so plans do not depend on this machine
        return DeviceInfo("emulated-cuda", "CUDA kernels on the CPU emulator", compute_units=8,
                          ctas_per_unit=4, detail="fibers on up to 2 OS threads; fixed "
                          "target 32 CTAs")

    def describe(self) -> dict[str, Any]:
        from ..emulator import cache_dir
        return {"backend": self.name, "numpy": np.__version__, "device": "CPU (emulated CUDA)",
                "cache": str(cache_dir()), "race_check": self.check_races}

    def supports(self, problem: Problem) -> Support:
        if problem.head_dim not in SUPPORTED_HEAD_DIMS:
            return Support(False, f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got "
                                  f"{problem.head_dim}")
        if not 1 <= problem.page_size <= MAX_PAGE_SIZE:
            return Support(False, f"page_size must be in [1, {MAX_PAGE_SIZE}], got "
                                  f"{problem.page_size}")
        return Support(True)

    # ----------------------------------------------------------- kernels
    def kernel_source(self, spec: KernelSpec) -> str:
        """The CUDA source compiled for ``spec`` (a hook tests override with mutants)."""
        return cuda_source(spec.kernel)

    def _launch(self, spec: KernelSpec, grid: tuple[int, int], block: int,
                args: list[Any], smem: int = 0) -> None:
        from ..emulator import launch
        gx, gy = grid
        if gx == 0 or gy == 0:
            return
        launch(self.kernel_source(spec), spec.cuda_name_expression(), (gx, gy, 1), block,
               args, smem, check_races=self.check_races)

    def partial(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable, plan: DecodePlan,
                sm_scale: float, v_out: Any, lse_out: Any) -> None:
        spec = v2_spec(self.dtype_of(q), self.dtype_of(k_pages), self.dtype_of(v_out),
                       plan.head_dim, plan.page_size, plan.heads_per_cta)
        with _Outputs(v_out, lse_out) as (vo, lo):
            self._launch(spec, (plan.num_chunks, plan.ctas_per_chunk), V2_NUM_WARPS * 32,
                         [_buf("q", _c(q)), _buf("k_pages", _c(k_pages)),
                          _buf("v_pages", _c(v_pages)), *_table(table),
                          _buf("request_indices", _i32(plan.request_indices)),
                          _buf("kv_tile_indices", _i32(plan.kv_tile_indices)),
                          _buf("v_out", vo, True), _buf("lse_out", lo, True),
                          np.int32(plan.num_qo_heads), np.int32(plan.num_kv_heads),
                          np.int32(plan.q_groups), np.int32(plan.pages_per_chunk),
                          np.float32(sm_scale * LOG2E)], spec.dynamic_smem_bytes)

    def merge(self, v: Any, lse: Any, o_indptr: Any, v_out: Any, lse_out: Any) -> None:
        m, h, d = (int(x) for x in v_out.shape)
        spec = merge_spec(self.dtype_of(v_out), d)
        if m * h == 0:
            return
        with _Outputs(v_out, lse_out) as (vo, lo):
            self._launch(spec, (-(-m * h // 4), 1), 128,
                         [_buf("v", _c(v)), _buf("lse", _c(lse)),
                          _buf("o_indptr", _i32(o_indptr)), _buf("v_out", vo, True),
                          _buf("lse_out", lo, True), np.int32(h), np.int32(m)])

    def decode_v1(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable,
                  sm_scale: float, out: Any, lse_out: Any) -> None:
        b, hq, d = (int(x) for x in q.shape)
        spec = v1_spec(self.dtype_of(q), self.dtype_of(k_pages), self.dtype_of(out), d,
                       table.page_size)
        with _Outputs(out, lse_out) as (o, lo):
            self._launch(spec, (b * hq, 1), V1_NUM_WARPS * 32,
                         [_buf("q", _c(q)), _buf("k_pages", _c(k_pages)),
                          _buf("v_pages", _c(v_pages)), *_table(table),
                          _buf("out", o, True), _buf("lse_out", lo, True), np.int32(hq),
                          np.int32(k_pages.shape[2]), np.float32(sm_scale * LOG2E)],
                         spec.dynamic_smem_bytes)


def _c(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a)


def _i32(a: Any) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int32)


def _table(table: PageTable) -> list[Any]:
    return [_buf(n, _i32(getattr(table, n))) for n in
            ("indices", "indptr", "last_page_len", "first_page_offset")]


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


__all__ = ["EmulatedCudaBackend"]
