"""``BatchDecodeWithPagedKVCacheWrapper``: FlashInfer 0.3.1's batch decode API on paged-decode.

The constructor, ``plan`` and ``run`` take FlashInfer's arguments, in its order, with
its defaults (``flashinfer/decode.py`` of ``flashinfer-python`` 0.3.1); what paged-decode
does not support is refused by name (``fi_unsupported``), never ignored. Shapes (NHD):
``q [B, Hq, D]``, cache ``[num_pages, P, Hkv, D]`` pairs or ``[num_pages, 2, P, Hkv, D]``
(``fi_cache``), ``out [B, Hq, D]`` in ``q``'s dtype, ``lse [B, Hq]`` float32, **base 2**
on both sides (``log2 sum_t exp2(sm_scale * log2(e) * q.k_t)``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, cast

import numpy as np

from ..backends import Backend, Problem, backend_for, c_contiguous
from ..call import plan_decode
from ..decode import decode
from ..dtypes import KV_DTYPES, caller_dtype, check_dtype
from ..errors import (
    InvalidArgumentError,
    UnsupportedProblemError,
    check_bool,
    check_int,
    check_number,
    check_shape,
    check_writable,
    fmt_shape,
)
from ..fp8 import is_fp8, pool_dtype
from ..page_table import PageTable
from ..plan import DecodePlan, check_geometry
from .fi_arrays import (
    as_backend,
    checked_table,
    empty_like_kind,
    host_ints,
    int32_buffer,
    shape_of,
)
from .fi_cache import KVPools, decode_pools, first_array
from .fi_graph import GraphState
from .fi_unsupported import (
    check_backend_name,
    check_constructor,
    check_layout,
    check_plan,
    check_run,
)

CLS = "BatchDecodeWithPagedKVCacheWrapper"


def fi_table_arrays(fn: str, indptr: Any, indices: Any, last_page_len: Any, page_size: int
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's CSR arrays as host int64, checked against its invariants: ``indptr
    [B+1]`` from 0, non-decreasing; ``indices`` at least ``indptr[-1]`` long (a longer
    buffer is fine); ``1 <= last_page_len <= P`` for a request with pages. A request
    without pages is empty (FlashInfer's length 0, whatever its ``last_page_len``, as
    CUDA-graph padding rows are): its ``last_page_len`` comes back 0, paged-decode's
    spelling of an empty request (output zeros, LSE ``-inf``)."""
    ip, idx, lpl = (host_ints(fn, n, x) for n, x in (("indptr", indptr), ("indices", indices),
                                                       ("last_page_len", last_page_len)))
    lpl = checked_table(fn, ip, idx, lpl, page_size)
    if lpl.size == 0:
        raise InvalidArgumentError(f"{fn}: the batch is empty (len(last_page_len) = 0)")
    used = idx[: int(ip[-1])]
    if used.size and (used.min() < 0 or used.max() > np.iinfo(np.int32).max // 2):
        raise InvalidArgumentError(f"{fn}: indices must be page ids in [0, 2^30), got "
                                   f"{int(used.min())}..{int(used.max())}")
    return ip, used, lpl


class BatchDecodeWithPagedKVCacheWrapper:
    """Batch decode over a paged KV cache, FlashInfer-compatible (see ``plan`` and ``run``).

    Args (FlashInfer's, in its order):
        float_workspace_buffer: FlashInfer's float workspace (128 MB recommended). Its
            kind and device choose the backend under ``backend="auto"`` (torch CUDA or
            CuPy: ``cuda``; numpy or CPU torch: ``reference``). Without graph mode
            paged-decode keeps its own workspaces and does not touch it; in graph mode
            it holds the split-KV partials.
        kv_layout: ``"NHD"``; ``"HND"`` is refused.
        use_cuda_graph: fix the batch size for the wrapper's life; ``plan`` copies the
            page table into the three caller-owned buffers and ``run`` reads them, so a
            captured ``run`` replays correctly after a new plan of the same batch size
            (``fi_graph``). Run once before capturing (kernels compile on first use).
        use_tensor_cores: accepted (FlashInfer's choice between its two kernel families;
            the result is the same); paged-decode picks its own path.
        paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer:
            int32 ``[B+1]``, ``[max_pages]``, ``[B]`` buffers, required in graph mode.
        backend: ``"auto"``, or a paged-decode backend name or instance (``"cuda"``,
            ``"reference"``, ``"emulated-cuda"``, ...); FlashInfer's own names (``"fa2"``,
            ``"trtllm-gen"``, ...) are refused.
        jit_args: refused unless ``None``.
    """

    def __init__(self, float_workspace_buffer: Any, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer: Any = None, paged_kv_indices_buffer: Any = None,
                 paged_kv_last_page_len_buffer: Any = None, backend: str | Backend = "auto",
                 jit_args: Any = None) -> None:
        fn = CLS
        check_layout(fn, kv_layout)
        check_constructor(fn, jit_args=jit_args)
        check_backend_name(fn, backend)
        self._use_cuda_graph = check_bool(fn, "use_cuda_graph", use_cuda_graph)
        self._use_tensor_cores = check_bool(fn, "use_tensor_cores", use_tensor_cores)
        self._be = backend_for(backend, float_workspace_buffer, fn=fn)
        self._kv_layout = kv_layout
        self._float_workspace_buffer = float_workspace_buffer
        buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer,
                   paged_kv_last_page_len_buffer)
        names = ("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                 "paged_kv_last_page_len_buffer")
        self._fixed_batch_size = 0
        if use_cuda_graph:
            for name, buf in zip(names, buffers):
                if buf is None:
                    raise InvalidArgumentError(f"{fn}: {name} is required with "
                                               "use_cuda_graph=True")
                int32_buffer(fn, name, buf)
            self._fixed_batch_size = int(paged_kv_last_page_len_buffer.shape[0])
            int32_buffer(fn, names[0], buffers[0], self._fixed_batch_size + 1)
        self._buffers = buffers
        self._graph: GraphState | None = None
        self._planned: dict[str, Any] | None = None

    # ------------------------------------------------------------------ FlashInfer's API
    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: Any,
                               int_workspace_buffer: Any) -> None:
        """Take new workspace buffers (the int one is FlashInfer's plan metadata: unused)."""
        self._float_workspace_buffer = float_workspace_buffer

    def end_forward(self) -> None:
        """Deprecated in FlashInfer; does nothing there either."""

    def plan(self, indptr: Any, indices: Any, last_page_len: Any, num_qo_heads: int,
             num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: float | None = None,
             q_data_type: Any = "float16", kv_data_type: Any = None, data_type: Any = None,
             sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, non_blocking: bool = True,
             block_tables: Any = None, seq_lens: Any = None) -> None:
        """Plan a batch decode (host work, reused by every ``run`` until the next plan).

        Args:
            indptr: int ``[B+1]``, request ``r`` owns ``indices[indptr[r]:indptr[r+1]]``.
            indices: int page ids, at least ``indptr[-1]`` of them.
            last_page_len: int ``[B]``, entries of each request's last page, ``[1, P]``.
            num_qo_heads, num_kv_heads, head_dim, page_size: the geometry (``Hq % Hkv ==
                0``; head dims and page sizes paged-decode's kernels have).
            q_data_type, kv_data_type, data_type: FlashInfer's dtype arguments (default
                float16; ``kv_data_type`` defaults to ``q_data_type``; the deprecated
                ``data_type`` fills both); ``run`` refuses arrays of other dtypes.
            sm_scale: softmax scale (default ``1 / sqrt(head_dim)``).
            non_blocking: accepted (the copies are ordered on the current stream anyway).
            window_left: attend to the last ``window_left + 1`` tokens of each request (-1:
                all), as FlashInfer's decode does; logits_soft_cap: scores become ``c *
                tanh(s / c)`` (``None`` or 0: off). Both run on paged-decode's decode
                variants, outside graph mode only.
            pos_encoding_mode, rope_scale, rope_theta, block_tables, seq_lens: only their
            "off" values are supported (``fi_unsupported``); anything else is refused by
            name.
        Index arrays may be any kind (torch, CuPy, numpy); they are read on the host, as
        FlashInfer's plan does.
        """
        fn = f"{CLS}.plan"
        window, cap = check_plan(fn, pos_encoding_mode=pos_encoding_mode,
                                 window_left=window_left, logits_soft_cap=logits_soft_cap,
                                 rope_scale=rope_scale, rope_theta=rope_theta,
                                 block_tables=block_tables, seq_lens=seq_lens,
                                 graph=self._use_cuda_graph)
        check_bool(fn, "non_blocking", non_blocking)
        check_geometry(fn, num_qo_heads, num_kv_heads, head_dim)
        page_size = check_int(fn, "page_size", page_size)
        if data_type is not None:
            q_data_type = data_type if q_data_type is None else q_data_type
            kv_data_type = data_type if kv_data_type is None else kv_data_type
        q_dt = check_dtype(fn, "q_data_type", "float16" if q_data_type is None else q_data_type)
        kv_dt = check_dtype(fn, "kv_data_type", q_dt if kv_data_type is None else kv_data_type,
                            KV_DTYPES)
        scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else \
            check_number(fn, "sm_scale", sm_scale)
        sup = self._be.supports(Problem(q_dt, kv_dt, num_qo_heads, num_kv_heads, head_dim,
                                        page_size, "v2"))
        if not sup:
            raise UnsupportedProblemError(f"{fn}: backend {self._be.name!r} cannot run this "
                                          f"geometry: {sup.reason}")
        ip, idx, lpl = fi_table_arrays(fn, indptr, indices, last_page_len, page_size)
        b = lpl.size
        table = PageTable.build(idx, ip, lpl, page_size=page_size)
        # graph mode runs the v2 partial and merge (fixed launches); eager runs decode's auto
        dplan = plan_decode(table, num_qo_heads, num_kv_heads, head_dim, backend=self._be,
                            window_left=window, kv_dtype=kv_dt,
                            path="v2" if self._use_cuda_graph else "auto")
        if self._use_cuda_graph:
            if b != self._fixed_batch_size:
                raise InvalidArgumentError(
                    f"{fn}: the batch size is fixed in graph mode: the buffers hold "
                    f"{self._fixed_batch_size} requests, got {b}")
            room = int(self._buffers[1].shape[0])
            if idx.size > room:
                raise InvalidArgumentError(f"{fn}: {idx.size} page ids do not fit "
                                           f"paged_kv_indices_buffer of {room}")
            if self._graph is None:
                self._graph = GraphState(fn, self._be, self._buffers, dplan)
            elif not _same_geometry(self._graph.plan, dplan):
                # a capture holds the launch shape and the wrapper's own buffers: a new
                # shape would leave it reading freed memory
                raise InvalidArgumentError(
                    f"{fn}: graph mode fixes (Hq, Hkv, D, P) at the first plan, "
                    f"{_geometry(self._graph.plan)}; got {_geometry(dplan)} (make a new "
                    "wrapper and capture again)")
            self._graph.load(ip, idx, lpl, table.pages_per_request)
        self._planned = {"table": table, "plan": dplan, "geometry": (num_qo_heads,
                         num_kv_heads, head_dim, page_size), "dtypes": (q_dt, kv_dt),
                         "scale": scale, "max_page": int(idx.max()) if idx.size else -1,
                         "window_left": window, "logits_soft_cap": cap}

    begin_forward = plan

    def run(self, q: Any, paged_kv_cache: Any, *args: Any, q_scale: float | None = None,
            k_scale: float | None = None, v_scale: float | None = None, out: Any = None,
            lse: Any = None, return_lse: bool = False, enable_pdl: bool | None = None,
            window_left: int | None = None, sinks: Any = None,
            q_len_per_req: int | None = 1) -> Any:
        """Decode attention of ``q`` over the planned pages of ``paged_kv_cache``.

        Args:
            q: ``[B, Hq, D]`` in the planned ``q_data_type`` (a strided ``q`` is copied; in
                graph mode it must be C-contiguous, as ``out`` and ``lse`` must).
            paged_kv_cache: ``(k_cache, v_cache)``, each ``[num_pages, P, Hkv, D]``, or one
                ``[num_pages, 2, P, Hkv, D]`` array, in ``kv_data_type``, NHD. Read
                zero-copy when C-contiguous; strided views are refused (``fi_cache``).
            out: optional ``[B, Hq, D]`` output in ``q``'s dtype (written in place).
            lse: optional ``[B, Hq]`` float32 buffer for the base-2 LSE.
            return_lse: also return the LSE.
            enable_pdl: accepted, not acted on (paged-decode's own rule decides:
                ``PAGED_DECODE_PDL``, ``backends/cuda_pdl.py``; same result).
            window_left: may repeat the plan's, not change it.
            q_scale, k_scale, v_scale, sinks, q_len_per_req (other than 1), *args: refused
            by name.

        Returns:
            ``out`` ``[B, Hq, D]``, or ``(out, lse)`` with ``return_lse``; arrays of
            ``q``'s kind (torch in, torch out).
        """
        fn = f"{CLS}.run"
        planned = -1 if self._planned is None else int(self._planned["window_left"])
        scales = check_run(fn, args=args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                           window_left=window_left, sinks=sinks, q_len_per_req=q_len_per_req,
                           planned_window=planned)
        if enable_pdl is not None:
            check_bool(fn, "enable_pdl", enable_pdl)
        check_bool(fn, "return_lse", return_lse)
        if self._planned is None:
            raise InvalidArgumentError(f"{fn}: call plan() before run()")
        # every conversion inside q's launch context: a torch tensor is viewed through
        # DLPack on torch's current stream itself (no cross-stream event, which a CUDA
        # graph capture would refuse)
        with self._be.launch_context(q):
            out, lse = self._run(fn, q, paged_kv_cache, out, lse, return_lse, scales)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)

    # ------------------------------------------------------------------ internals
    def _run(self, fn: str, q: Any, paged_kv_cache: Any, out: Any, lse: Any,
             return_lse: bool, scales: tuple[float, float, float]) -> tuple[Any, Any]:
        """``run`` after its argument refusals: the checks, the outputs (``(out, lse)`` in
        the caller's kind, ``lse`` ``None`` when not wanted) and the launches. ``scales``:
        ``(q_scale, k_scale, v_scale)`` as FlashInfer applies them: the first two multiply
        the softmax scale, the last the output (over fp8 pools paged-decode's own K / V
        scales, ``docs/fp8.md``)."""
        st = self._planned
        assert st is not None
        be = self._be
        hq, hkv, d, p = st["geometry"]
        q_dt, kv_dt = st["dtypes"]
        fp8 = is_fp8(kv_dt)
        pools = decode_pools(fn, be, paged_kv_cache)
        # the dtype first: a byte cache under a 16-bit plan would read as a shape mismatch.
        # (The caller's dtype name: a torch fp8 tensor is a uint8 CuPy view on `cuda`.)
        held = be.dtype_of(pools.k)
        kv_got = check_dtype(fn, "paged_kv_cache", pool_dtype(
            fn, caller_dtype(first_array(paged_kv_cache), held), held,
            kv_dt if fp8 else None, "paged_kv_cache"), KV_DTYPES)
        if kv_got != kv_dt:
            raise InvalidArgumentError(f"{fn}: paged_kv_cache has dtype {kv_got}, but plan's "
                                       f"kv_data_type is {kv_dt}")
        got = (pools.page_size, pools.num_kv_heads, pools.head_dim)
        if got != (p, hkv, d):
            raise InvalidArgumentError(f"{fn}: paged_kv_cache must have (P, Hkv, D) = "
                                       f"{(p, hkv, d)} as planned, got {got}")
        if st["max_page"] >= pools.num_pages:
            raise InvalidArgumentError(f"{fn}: the plan references page {st['max_page']}, but "
                                       f"paged_kv_cache has {pools.num_pages} pages")
        qa = as_backend(fn, "q", be, q)
        b = st["table"].batch_size
        check_shape(fn, "q", qa.shape, (b, hq, d), "[B, Hq, D]")
        q_got = check_dtype(fn, "q", caller_dtype(q, be.dtype_of(qa)))
        if q_got != q_dt:
            raise InvalidArgumentError(f"{fn}: q has dtype {q_got}, but plan's q_data_type is "
                                       f"{q_dt}")
        if not c_contiguous(qa):
            if self._use_cuda_graph:    # a copy inside a capture would allocate
                raise InvalidArgumentError(f"{fn}: q must be C-contiguous in graph mode")
            qa = be.array_module().ascontiguousarray(qa)   # [B, Hq, D]: a small copy
        out = self._output(fn, "out", q, out, (b, hq, d), q_dt)
        want_lse = return_lse or lse is not None
        if want_lse:
            lse = self._output(fn, "lse", q, lse, (b, hq), "float32")
        out_a = as_backend(fn, "out", be, out)
        lse_a: Any = as_backend(fn, "lse", be, lse) if want_lse else None
        q_scale, k_scale, v_scale = scales
        if self._use_cuda_graph:   # the partial takes the K scale in sm_scale, any pools
            self._run_graph(fn, qa, pools, out_a, lse_a, st["scale"] * q_scale * k_scale,
                            v_scale)
        else:
            # decode's own outputs, then one copy into the caller's: given outputs would
            # make every run a new entry of decode's prepared-call cache (the backend views
            # are new objects on every run), which would only churn it
            quant = ({"kv_dtype": kv_dt, "k_scale": k_scale, "v_scale": v_scale} if fp8
                     else {})
            scale = st["scale"] * q_scale * (1.0 if fp8 else k_scale)
            got = decode(qa, pools.k, pools.v, self._table(pools.interleaved), st["plan"],
                         sm_scale=scale, return_lse=want_lse, backend=be,
                         window_left=st["window_left"],
                         logits_soft_cap=st["logits_soft_cap"], **quant)
            if want_lse:
                out_a[...], lse_a[...] = got
            else:
                out_a[...] = got
            if not fp8 and v_scale != 1.0:   # FlashInfer scales 16-bit outputs too
                f32 = be.array_module().float32
                out_a[...] = (out_a.astype(f32) * f32(v_scale)).astype(out_a.dtype)
        return out, lse

    def _output(self, fn: str, name: str, like: Any, given: Any, shape: tuple[int, ...],
                dtype: str) -> Any:
        """``given`` checked (shape, dtype; FlashInfer's rules), or a fresh one of
        ``like``'s kind."""
        if given is None:
            return empty_like_kind(self._be, like, shape, dtype)
        if not (hasattr(given, "shape") and hasattr(given, "dtype")):
            raise InvalidArgumentError(f"{fn}: {name} must be an array, got "
                                       f"{type(given).__name__}")
        if shape_of(given) != shape:
            raise InvalidArgumentError(f"{fn}: {name} must have shape {fmt_shape(shape)}, got "
                                       f"{fmt_shape(shape_of(given))}")
        got = check_dtype(fn, name, given.dtype)
        if got != dtype:
            raise InvalidArgumentError(f"{fn}: {name} must have dtype {dtype}, got {got}")
        check_writable(fn, name, given)
        return given

    def _table(self, interleaved: bool) -> PageTable:
        """The planned table; for a combined cache its page ids doubled (memoised)."""
        st = self._planned
        assert st is not None
        if not interleaved:
            return cast(PageTable, st["table"])
        if "table2" not in st:
            t = st["table"]
            st["table2"] = PageTable.build(t.indices.astype(np.int64) * 2, t.indptr,
                                           t.last_page_len, page_size=t.page_size)
        return cast(PageTable, st["table2"])

    def _run_graph(self, fn: str, qa: Any, pools: KVPools, out_a: Any, lse_a: Any,
                   sm_scale: float, v_scale: float) -> None:
        """Graph mode: the fixed partial and merge launches over the buffers (or, on the
        reference backend, a table rebuilt from them), partials in the workspace;
        ``sm_scale`` holds the Q and K scales, ``v_scale`` multiplies the partials' rows
        (the merge is linear in them)."""
        g, st, be = self._graph, self._planned, self._be
        assert g is not None and st is not None
        for name, arr in (("out", out_a), ("lse", lse_a)):
            if arr is not None and not c_contiguous(arr):
                raise InvalidArgumentError(f"{fn}: {name} must be C-contiguous in graph mode "
                                           "(the merge kernel writes it directly)")
        hq, _, d, p = st["geometry"]
        g.check_buffers(fn, pools)
        v_part, lse_part, spare = g.workspace(fn, self._float_workspace_buffer, hq, d)
        lse_out = spare if lse_a is None else lse_a
        table: Any = g.table(pools.interleaved) if g.kernels_read_buffers else \
            g.host_table(p, pools.interleaved)
        # (inside run's launch context) the launch hooks read only the fields GraphPlan
        # and BufferTable carry
        kv_dt = st["dtypes"][1]
        be.partial(qa, pools.k, pools.v, table, cast(DecodePlan, g.plan), sm_scale,
                   v_part, lse_part, kv_dtype=kv_dt if is_fp8(kv_dt) else None,
                   v_scale=v_scale)
        # the device chunk map's partials are at most its chunks: the split is fixed at
        # capture, and every later plan's map merges right under it
        be.merge(v_part, lse_part, g.plan.o_indptr, out_a, lse_out, inputs=g.plan.num_chunks)


def _geometry(plan: Any) -> tuple[int, int, int, int]:
    """``(Hq, Hkv, D, P)`` of a ``DecodePlan`` or ``GraphPlan``."""
    return plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size


def _same_geometry(gp: Any, plan: DecodePlan) -> bool:
    """Whether a graph state made for ``gp`` serves ``plan`` (same launch geometry)."""
    return _geometry(gp) == _geometry(plan)


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """FlashInfer's graph-mode subclass: the buffers are positional, graph mode is on."""

    def __init__(self, workspace_buffer: Any, indptr_buffer: Any, indices_buffer: Any,
                 last_page_len_buffer: Any, kv_layout: str = "NHD",
                 use_tensor_cores: bool = False) -> None:
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True,
                         use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer,
                         paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)


__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
           "fi_table_arrays"]
