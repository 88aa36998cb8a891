"""``LaunchingBackend``: the kernel entry points of every backend that runs our kernels
(``cuda``, ``metal``, ``emulated-cuda``, ``emulated-metal``), written once (the
tensor-core partial ``partial_tc`` where ``tensor_core_decode`` says the backend runs it:
``mma.sync`` in the CUDA dialect, ``simdgroup_matrix`` in the Metal dialect, whose
specialization ``metal_dialect`` picks).

Each entry point builds a ``Launch`` (``launches.py``) and hands it to the backend's
``_run``; a backend supplies only small hooks: ``index_array`` (a host index array of a
table or plan, or ``write.desc``, as the array its kernels read), ``check_pools`` (what
its loads need of the K/V pools), ``append_row_arrays`` / ``append_vector_bytes`` (the
append's rows and word width) and ``_run`` itself. ``in_place_append`` says which
dialect's append it launches: CUDA writes the pools in place, Metal returns new pools.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np

from .. import settings
from ..errors import InvalidArgumentError, UnsupportedProblemError, env_switch
from ..kernels import merge
from ..kernels.append import METAL_MIN_ELEMENTS, AppendWrite
from ..page_table import PageTable
from ..plan import DecodePlan
from ..specs import PREFIX_TILE_ROWS, prefix_kernel_runs
from ..step_table import StepTable
from . import launches
from .base import Backend, Problem, Support

#: the tensor-core partial's fused merge (``partial_tc_merged``): unset, where it pays
#: (``launches.fused_merge_pays``, or wherever it runs in clusters: ``cluster_merge``);
#: ``1`` always; ``0`` never (the merge kernel's launch)
FUSED_MERGE_ENV = "PAGED_DECODE_FUSED_MERGE"
#: the fused merge within thread-block clusters (``launches.cluster_merge_size``): unset,
#: where ``launches.cluster_merge_pays``; ``1`` wherever the plan and device allow it;
#: ``0`` never
CLUSTER_MERGE_ENV = "PAGED_DECODE_CLUSTER_MERGE"
#: warps per (row, head) of the CUDA merge: unset, ``launches.merge_split``'s rule; one of
#: ``launches.MERGE_SPLITS`` forces it (``1``: never split)
MERGE_SPLIT_ENV = "PAGED_DECODE_MERGE_SPLIT"


class LaunchingBackend(Backend):
    #: the append kernel writes the pools in place (CUDA dialect); else it returns new
    #: pools (Metal dialect, MLX outputs), which ``adopt_pools`` delivers
    in_place_append: bool = True
    #: launches the Metal dialect's specializations (``launches.v2tc_launch(metal=...)``)
    metal_dialect: bool = False
    reads_step_tables = True

    def supports(self, problem: Problem) -> Support:
        # a CUDA device must have mma.sync too (sm_80+: prefix_tile_rows says so); every
        # Apple GPU MLX runs on has simdgroup_matrix
        tc = self.tensor_core_decode and (self.metal_dialect
                                          or bool(self.device_info().prefix_tile_rows))
        return launches.support(problem, tc, metal=self.metal_dialect)

    # ----------------------------------------------------------- hooks
    @abstractmethod
    def index_array(self, arr: Any) -> Any:
        """A host int32 index array (a table's or plan's, ``o_indptr``, the append
        descriptor) as the array the kernels read; this backend's arrays pass through."""

    @abstractmethod
    def _run(self, launch: launches.Launch) -> None:
        """Run one launch (nothing when it is empty)."""

    def check_pools(self, fn: str, k_pages: Any, v_pages: Any) -> None:
        """Raise when the kernels cannot read these pools (nothing by default)."""
        return None

    def append_row_arrays(self, k_pages: Any, k_rows: Any, v_rows: Any) -> tuple[Any, Any]:
        """The append's new rows in the pools' dtype, C-contiguous."""
        return k_rows, v_rows

    @abstractmethod
    def append_vector_bytes(self, k_pages: Any, v_pages: Any, k_rows: Any,
                            v_rows: Any) -> int:
        """Bytes per access of the append kernel for these arrays."""

    def append_fallback(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
                        write: AppendWrite) -> tuple[Any, Any]:
        """The append of inputs too small for the Metal kernel's word accesses."""
        raise NotImplementedError

    def adopt_pools(self, k_pages: Any, v_pages: Any, outs: tuple[Any, Any]
                    ) -> tuple[Any, Any]:
        """The pools after a Metal-dialect append wrote ``outs`` (default: ``outs``)."""
        return outs

    def table_arrays(self, table: PageTable | StepTable) -> tuple[Any, ...]:
        """The four CSR arrays of ``table``, in ``launches.TABLE_FIELDS`` order (a step
        table's device buffers as they are)."""
        if isinstance(table, StepTable):
            return table.device_arrays()
        return tuple(self.index_array(getattr(table, n)) for n in launches.TABLE_FIELDS)

    def plan_arrays(self, plan: DecodePlan) -> tuple[Any, Any]:
        """``request_indices [C]`` and ``kv_tile_indices [C]`` of ``plan``."""
        return self.index_array(plan.request_indices), self.index_array(plan.kv_tile_indices)

    # ----------------------------------------------------------- kernels
    def partial(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
                plan: DecodePlan, sm_scale: float, v_out: Any, lse_out: Any, *,
                soft_cap: float | None = None, sinks: Any = None, kv_dtype: str | None = None,
                v_scale: float = 1.0) -> None:
        self.check_pools("decode", k_pages, v_pages)
        request_indices, kv_tile_indices = self.plan_arrays(plan)
        self._run(launches.partial_launch(
            dtypes=(self.dtype_of(q), kv_dtype or self.dtype_of(k_pages), self.dtype_of(v_out)),
            plan=plan, sm_scale=sm_scale, q=q, k_pages=k_pages, v_pages=v_pages,
            table=self.table_arrays(table), request_indices=request_indices,
            kv_tile_indices=kv_tile_indices, v_out=v_out, lse_out=lse_out, soft_cap=soft_cap,
            sinks=sinks, v_scale=v_scale, metal=self.metal_dialect))

    def partial_tc(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
                   plan: DecodePlan, sm_scale: float, v_out: Any, lse_out: Any, *,
                   soft_cap: float | None = None, sinks: Any = None,
                   kv_dtype: str | None = None, v_scale: float = 1.0) -> None:
        if not self.tensor_core_decode:
            super().partial_tc(q, k_pages, v_pages, table, plan, sm_scale, v_out, lse_out,
                               soft_cap=soft_cap, sinks=sinks, kv_dtype=kv_dtype,
                               v_scale=v_scale)
        self._v2tc(q, k_pages, v_pages, table, plan, sm_scale, v_out, lse_out,
                   soft_cap=soft_cap, sinks=sinks, kv_dtype=kv_dtype, v_scale=v_scale)

    def _v2tc(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
              plan: DecodePlan, sm_scale: float, v_out: Any, lse_out: Any, *,
              soft_cap: float | None, sinks: Any, kv_dtype: str | None, v_scale: float,
              fused: launches.FusedMerge | None = None) -> None:
        """The one tensor-core partial launch of ``partial_tc`` and ``partial_tc_merged``."""
        self.check_pools("decode", k_pages, v_pages)
        request_indices, kv_tile_indices = self.plan_arrays(plan)
        self._run(launches.v2tc_launch(
            kv_dtype=kv_dtype or self.dtype_of(k_pages), out_dtype=self.dtype_of(v_out),
            plan=plan, sm_scale=sm_scale, q=q, k_pages=k_pages, v_pages=v_pages,
            table=self.table_arrays(table), request_indices=request_indices,
            kv_tile_indices=kv_tile_indices, v_out=v_out, lse_out=lse_out,
            metal=self.metal_dialect, soft_cap=soft_cap, sinks=sinks,
            q_dtype=self.dtype_of(q), v_scale=v_scale, fused=fused))

    def fuses_merge(self, plan: DecodePlan, kv_dtype: str) -> bool:
        return self._fused_merge_cluster(plan, kv_dtype) is not None

    def _fused_merge_cluster(self, plan: DecodePlan, kv_dtype: str) -> int | None:
        """``None`` where the merge keeps its own launch; else the fused merge's CTAs per
        cluster (``cluster_merge``; 0: the counters' merge). One call decides both."""
        if self.metal_dialect or not self.tensor_core_decode:
            return None
        forced = env_switch(FUSED_MERGE_ENV)
        if forced is False:
            return None
        k = self.cluster_merge(plan, kv_dtype)
        # in clusters a request's merge is spread over its K CTAs, so it pays at any GQA
        # (S46-R1), where the counters' merge serializes many heads on the last CTA
        if forced or k or launches.fused_merge_pays(
                plan, kv_dtype, self.merge_split(plan.batch_size, plan.num_qo_heads,
                                                 plan.num_chunks, plan.head_dim)):
            return k
        return None

    def cluster_merge(self, plan: DecodePlan, kv_dtype: str) -> int:
        """The CTAs per cluster of a fused merge over ``plan`` (``launches.FusedMerge``),
        0 for the counters' merge: ``launches.cluster_merge_size(plan)`` where the backend
        runs clusters and ``PAGED_DECODE_CLUSTER_MERGE`` is ``1``, or is unset and
        ``launches.cluster_merge_pays``; 0 otherwise."""
        forced = env_switch(CLUSTER_MERGE_ENV, "decode")
        k = launches.cluster_merge_size(plan)      # the plan's, cached: cheap first
        if forced is False or not k:
            return 0
        if forced is None and not launches.cluster_merge_pays(plan, kv_dtype):
            return 0
        return k if self.runs_clusters() else 0

    def merge_counters(self, plan: DecodePlan) -> Any:
        """The fused merge's ``int32 [fused_merge_slots(plan)]`` counters, zero (a fresh
        array by default; a kept workspace stays zero, as the kernel leaves it)."""
        return self.index_array(np.zeros(launches.fused_merge_slots(plan), np.int32))

    def partial_tc_merged(self, q: Any, k_pages: Any, v_pages: Any,
                          table: PageTable | StepTable, plan: DecodePlan, sm_scale: float,
                          v_part: Any, lse_part: Any, out: Any, lse_out: Any, *,
                          soft_cap: float | None = None, sinks: Any = None,
                          kv_dtype: str | None = None, v_scale: float = 1.0) -> None:
        cluster = self._fused_merge_cluster(plan, kv_dtype or self.dtype_of(k_pages))
        if cluster is None:
            super().partial_tc_merged(q, k_pages, v_pages, table, plan, sm_scale, v_part,
                                      lse_part, out, lse_out, soft_cap=soft_cap, sinks=sinks,
                                      kv_dtype=kv_dtype, v_scale=v_scale)
            return
        fused = launches.FusedMerge(
            self.index_array(plan.o_indptr), self.merge_counters(plan), out, lse_out,
            self.dtype_of(out), cluster)
        self._v2tc(q, k_pages, v_pages, table, plan, sm_scale, v_part, lse_part,
                   soft_cap=soft_cap, sinks=sinks, kv_dtype=kv_dtype, v_scale=v_scale,
                   fused=fused)

    def merge(self, v: Any, lse: Any, o_indptr: Any, v_out: Any, lse_out: Any,
              rows: Any = None, *, sinks: Any = None, inputs: int | None = None) -> None:
        if rows is not None and not self.merge_gathers:
            raise InvalidArgumentError(f"{self.name} backend: the merge takes no row index")
        if inputs is None:
            if not isinstance(o_indptr, np.ndarray):
                raise InvalidArgumentError(
                    f"{self.name} backend: merge: o_indptr is a device array, so inputs= "
                    "(a bound on its last entry) must size the launch; reading it back "
                    "would synchronize, and fails inside a graph capture")
            inputs = int(o_indptr[-1])
        m, h, d = v_out.shape
        self._run(launches.merge_launch(
            out_dtype=self.dtype_of(v_out), shape=tuple(v_out.shape), v=v, lse=lse,
            o_indptr=self.index_array(o_indptr), v_out=v_out, lse_out=lse_out, rows=rows,
            sinks=sinks, split=self.merge_split(int(m), int(h), inputs, int(d))))

    def merge_split(self, outputs: int, heads: int, inputs: int, head_dim: int) -> int:
        """Warps per (row, head) of a merge of ``inputs`` partials into ``outputs x heads``
        groups of ``head_dim``: 1 on the Metal dialect (its merge has no split); else
        ``PAGED_DECODE_MERGE_SPLIT`` when set, ``launches.merge_split``'s rule when not."""
        if self.metal_dialect:
            return 1
        val = (settings.get(MERGE_SPLIT_ENV) or "").strip()
        if not val:
            return launches.merge_split(outputs, heads, inputs,
                                        self.device_info().compute_units, head_dim)
        if val not in {str(s) for s in launches.MERGE_SPLITS}:
            raise InvalidArgumentError(
                f"merge: {MERGE_SPLIT_ENV} must be one of "
                f"{', '.join(map(str, launches.MERGE_SPLITS))} or unset, got {val!r}")
        if not merge.split_fits(head_dim, int(val)):
            raise InvalidArgumentError(
                f"merge: {MERGE_SPLIT_ENV}={val} at head_dim {head_dim} needs "
                f"{merge.split_smem_bytes(head_dim, int(val))} bytes of static shared memory, "
                f"over CUDA's {merge.STATIC_SMEM_LIMIT}; use a smaller split")
        return int(val)

    def decode_v1(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
                  sm_scale: float, out: Any, lse_out: Any, *,
                  soft_cap: float | None = None, sinks: Any = None, kv_dtype: str | None = None,
                  v_scale: float = 1.0) -> None:
        self.check_pools("decode", k_pages, v_pages)
        self._run(launches.v1_launch(
            dtypes=(self.dtype_of(q), kv_dtype or self.dtype_of(k_pages), self.dtype_of(out)),
            shape=tuple(q.shape), num_kv_heads=int(k_pages.shape[2]),
            page_size=table.page_size, sm_scale=sm_scale, q=q, k_pages=k_pages,
            v_pages=v_pages, table=self.table_arrays(table), out=out, lse_out=lse_out,
            soft_cap=soft_cap, sinks=sinks, v_scale=v_scale))

    def prefix_partial(self, q: Any, k_pages: Any, v_pages: Any, level0: PageTable,
                       plan0: DecodePlan, members: Any, row_tiles: int, sm_scale: float,
                       v_out: Any, lse_out: Any) -> bool:
        if not prefix_kernel_runs(self.device_info(), self.dtype_of(q), self.dtype_of(k_pages)):
            return False
        self.run_prefix(q, k_pages, v_pages, level0, plan0, members, row_tiles, sm_scale,
                        v_out, lse_out)
        return True

    def run_prefix(self, q: Any, k_pages: Any, v_pages: Any, level0: PageTable,
                   plan0: DecodePlan, members: Any, row_tiles: int, sm_scale: float,
                   v_out: Any, lse_out: Any) -> None:
        """Launch the prefix kernel (arguments of ``prefix_partial``, already checked)."""
        if not self.device_info().prefix_tile_rows:
            raise UnsupportedProblemError(f"{self.name} backend has no tensor-core prefix "
                                          "kernel")
        rows = int(members.shape[0]) * (int(q.shape[1]) // int(k_pages.shape[2]))
        if row_tiles * PREFIX_TILE_ROWS < rows:     # a plan made for another device's tiles
            raise InvalidArgumentError(
                f"cascade_decode: the cascade plan's {row_tiles} level-0 row tile(s) of this "
                f"kernel's {PREFIX_TILE_ROWS} rows cover fewer than the {rows} stacked query "
                "rows (members x GQA group): it was planned for a device with other prefix "
                "tiles (DeviceInfo.prefix_tile_rows); plan it for this backend's device")
        self.check_pools("cascade_decode", k_pages, v_pages)
        self._run(launches.prefix_launch(
            kv_dtype=self.dtype_of(k_pages), plan0=plan0, num_members=int(members.shape[0]),
            shared_pages=level0.total_pages, row_tiles=row_tiles, sm_scale=sm_scale, q=q,
            k_pages=k_pages, v_pages=v_pages, page_ids=self.index_array(level0.indices),
            members=members, v_out=v_out, lse_out=lse_out))

    def append_rows(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
                    write: AppendWrite, fp8: tuple[str, Any, Any] | None = None
                    ) -> tuple[Any, Any]:
        """One launch of the append kernel on the pools' device and current stream (see
        ``Backend.append_rows``); ``write.desc`` is the one host-to-device copy. fp8 pools
        take the quantizing kernel (``kernels/append_fp8.py``)."""
        if fp8 is not None:
            return self._append_fp8(k_pages, v_pages, k_rows, v_rows, write, fp8)
        with self.launch_context(k_pages):
            kr, vr = self.append_row_arrays(k_pages, k_rows, v_rows)
            if not self.in_place_append and min(kr.size, k_pages.size) < METAL_MIN_ELEMENTS:
                return self.append_fallback(k_pages, v_pages, kr, vr, write)
            dtype = self.dtype_of(k_pages)
            shape = tuple(int(x) for x in k_pages.shape)
            vec = self.append_vector_bytes(k_pages, v_pages, kr, vr)
            if self.in_place_append:
                self._run(launches.append_launch(
                    write=write, dtype=dtype, vector_bytes=vec, pool_shape=shape, k_rows=kr,
                    v_rows=vr, desc=self.index_array(write.desc), k_pages=k_pages,
                    v_pages=v_pages))
                return k_pages, v_pages
            outs = (self.empty(shape, dtype), self.empty(shape, dtype))
            self._run(launches.append_launch(
                write=write, dtype=dtype, vector_bytes=vec, pool_shape=shape, k_rows=kr,
                v_rows=vr, desc=self.index_array(write.by_page()), k_pages=k_pages,
                v_pages=v_pages, outs=outs))
            return self.adopt_pools(k_pages, v_pages, outs)

    def _append_fp8(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
                    write: AppendWrite, fp8: tuple[str, Any, Any]) -> tuple[Any, Any]:
        """The quantizing append: rows in their own float dtype, C-contiguous; K and V
        rows of different dtypes both in float32 (the kernel has one row type, and a
        narrowing cast would round, or overflow to inf, before the quantization does)."""
        fmt, k_scale, v_scale = fp8
        with self.launch_context(k_pages):
            like = self.asarray(k_rows)
            if self.dtype_of(like) != self.dtype_of(self.asarray(v_rows)):
                like = like.astype(self.array_module().float32)
            kr, vr = self.append_row_arrays(like, k_rows, v_rows)
            shape = tuple(int(x) for x in k_pages.shape)
            common = dict(write=write, kv_dtype=fmt, row_dtype=self.dtype_of(kr),
                          pool_shape=shape, k_rows=kr, v_rows=vr, k_pages=k_pages,
                          v_pages=v_pages, k_scale=k_scale, v_scale=v_scale)
            if self.in_place_append:
                self._run(launches.append_fp8_launch(desc=self.index_array(write.desc),
                                                     **common))
                return k_pages, v_pages
            outs = (self.empty(shape, fmt), self.empty(shape, fmt))
            self._run(launches.append_fp8_launch(desc=self.index_array(write.by_page()),
                                                 outs=outs, **common))
            return self.adopt_pools(k_pages, v_pages, outs)


    def update_table(self, buf: Any, delta: np.ndarray, cap: int, page_cap: int, *,
                     scratch: Any) -> Any:
        """One upload of ``delta`` and one table-update launch. CUDA dialect: ``buf`` is
        copied to ``scratch`` and updated in place from it (fixed addresses: captured
        graphs stay valid); Metal dialect: a new buffer (``adopt_table`` delivers it)."""
        d = self.index_array(delta)
        if self.in_place_append:
            self.device_copy(scratch, buf)
            self._run(launches.table_update_launch(cap=cap, page_cap=page_cap, old=scratch,
                                                   delta=d, new=buf))
            return buf
        new = self.int32_empty(int(buf.shape[0]))
        self._run(launches.table_update_launch(cap=cap, page_cap=page_cap, old=buf,
                                               delta=d, new=new))
        return self.adopt_table(buf, new)

    def staging_buffer(self, words: int) -> Any:
        """The CUDA dialect reads its append descriptor and table delta from one device
        buffer (``step_upload.py``); the Metal dialect keeps host arrays (``None``)."""
        return self.table_buffer(np.zeros(words, np.int32)) if self.in_place_append else None

    def device_copy(self, dst: Any, src: Any) -> None:
        """``dst[...] = src`` on the device, same-size int32 buffers (a CUDA-dialect table
        update's copy of the old table)."""
        self.array_module().copyto(dst, src)

    def int32_empty(self, n: int) -> Any:
        """A fresh int32 array of ``n`` elements (a Metal-dialect update's output)."""
        return self.table_buffer(np.zeros(n, np.int32))

    def adopt_table(self, buf: Any, new: Any) -> Any:
        """The table buffer after a Metal-dialect update wrote ``new`` (default: ``new``)."""
        return new


def host_index(arr: Any) -> np.ndarray:
    """An index array as numpy (for backends whose kernels read host memory)."""
    return np.asarray(arr)


__all__ = ["LaunchingBackend", "host_index"]
