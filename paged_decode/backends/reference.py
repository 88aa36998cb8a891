"""The reference backend: the kernel contracts in vectorized numpy on the CPU.

It follows the GPU kernels' arithmetic (float32 accumulation, base-2 online softmax with
log2(e) folded into the scale, normalized partials) so its results track theirs; the
independent float64 oracle lives in ``paged_decode.reference``.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np

from ..device import DeviceInfo
from ..dtypes import as_float32, dtype_name, numpy_dtype
from ..errors import InvalidDtypeError, env_flag
from ..fp8 import dequantize, is_fp8, quantize_rows
from ..kernels.append import AppendWrite
from ..page_table import PageTable
from ..plan import DecodePlan, chunk_token_ranges
from ..softmax import RowSoftmax, merge_partials
from ..step_table import StepTable
from ..variants import cap_logits, with_sink
from . import launches
from .base import Backend, Problem, Support, poison_enabled

LOG2E = 1.4426950408889634


def torch_cpu_view(t: Any) -> np.ndarray:
    """A zero-copy numpy view of a CPU torch tensor (detached; bfloat16 and the fp8
    formats as their ``ml_dtypes`` types through a same-size integer view, since numpy
    has none of them and ``numpy()`` refuses them)."""
    import torch  # only reached with a torch tensor in hand

    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    name = str(t.dtype).removeprefix("torch.")
    if is_fp8(name):
        return t.view(torch.uint8).numpy().view(numpy_dtype(name))
    return t.numpy()
V1_SPLITS = 8  # stripes of one v1 "CTA", combined like its warps are


def attend_f32(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale_log2: float,
               soft_cap: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Normalized attention state of grouped queries over one token range.

    ``q [Hkv, G, D]``, ``k, v [Hkv, n, D]`` float32 -> ``o [Hkv, G, D]`` float32 and
    ``lse [Hkv, G]`` float32 in log2 units; ``n == 0`` gives zeros and -inf, a non-finite
    score NaN (``paged_decode.softmax``). ``soft_cap`` (natural units) caps the scores.
    """
    hkv, g, d = q.shape
    if k.shape[1] == 0:
        return np.zeros((hkv, g, d), np.float32), np.full((hkv, g), -np.inf, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):   # non-finite scores are poison
        s = np.matmul(q, k.transpose(0, 2, 1)) * np.float32(scale_log2)  # [Hkv, G, n]
        s = cap_logits(np, s, soft_cap, base2=True).astype(np.float32)
        sm = RowSoftmax(np, s, base2=True)
        o = sm.normalize(np.matmul(sm.p.astype(np.float32), v))
    return o.astype(np.float32), sm.lse2.astype(np.float32)


def combine_f32(vs: np.ndarray, lses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge states along axis 0: ``vs [n, ..., D]``, ``lses [n, ...]`` (log2)."""
    if vs.shape[0] == 0:
        return np.zeros(vs.shape[1:], np.float32), np.full(lses.shape[1:], -np.inf, np.float32)
    o, lse = merge_partials(np, vs.astype(np.float32), lses.astype(np.float32))
    return o.astype(np.float32), lse.astype(np.float32)


def sink_f32(o: np.ndarray, lse: np.ndarray, sinks: Any) -> tuple[np.ndarray, np.ndarray]:
    """A final state ``o [Hq, D]``, ``lse [Hq]`` (log2) with the heads' ``sinks [Hq]``
    joined (``variants.with_sink``), float32."""
    with np.errstate(invalid="ignore", over="ignore"):
        vo, lo = with_sink(np, o, lse, np.asarray(sinks), (o.shape[0],))
    return vo.astype(np.float32), lo.astype(np.float32)


def visible_kv(pages: np.ndarray, table: PageTable, r: int, t0: int, t1: int,
               kv_dtype: str | None = None) -> np.ndarray:
    """Visible tokens ``[t0, t1)`` of request ``r`` as float32 ``[Hkv, n, D]`` (an fp8
    pool's stored values, unscaled; ``kv_dtype`` names the format of ``uint8`` pages)."""
    p = table.page_size
    fpo = int(table.first_page_offset[r])
    a0, a1 = fpo + t0, fpo + t1
    pb, pe = a0 // p, -(-a1 // p)
    ids = table.indices[table.indptr[r] + pb: table.indptr[r] + pe]
    rows = pages[ids].reshape(-1, *pages.shape[2:])[a0 - pb * p: a1 - pb * p]
    if kv_dtype is not None and is_fp8(kv_dtype):
        return dequantize(rows, kv_dtype).transpose(1, 0, 2)
    return as_float32(rows).transpose(1, 0, 2)


#: "1" lets the reference backend run any head_dim and page size (see ``ReferenceBackend``)
ANY_GEOMETRY_ENV = "PAGED_DECODE_REFERENCE_ANY_GEOMETRY"


class ReferenceBackend(Backend):
    """The numpy backend. It refuses the head dims and page sizes the kernels refuse
    (``launches.support``), so code written against it runs on a GPU; ``any_geometry=True``
    (or ``PAGED_DECODE_REFERENCE_ANY_GEOMETRY=1`` when ``None``) lifts that, for use as
    an oracle on geometries no kernel has."""

    name = "reference"

    def __init__(self, *, any_geometry: bool | None = None) -> None:
        self.any_geometry = any_geometry

    @classmethod
    def available(cls) -> Support:
        return Support(True)

    def supports(self, problem: Problem) -> Support:
        anything = self.any_geometry
        if anything is None:
            anything = env_flag(ANY_GEOMETRY_ENV)
        if anything and problem.path != "v2tc":   # no tensor-core arm on any geometry
            return Support(True)
        return launches.support(problem)

    def device_info(self) -> DeviceInfo:
        # A fixed target, so plans do not depend on the CPU the tests run on.
        return DeviceInfo("reference", f"numpy on {platform.machine() or 'CPU'}",
                          compute_units=8, ctas_per_unit=4,
                          detail=f"{os.cpu_count()} CPU cores; fixed target 32 CTAs")

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "numpy": np.__version__, "device": "CPU"}

    # ----------------------------------------------------------- arrays
    def owns(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def asarray(self, x: Any) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        if type(x).__module__.startswith("torch") and not getattr(x, "is_cuda", True):
            return torch_cpu_view(x)
        if hasattr(x, "__array__") or isinstance(x, (list, tuple)):
            return np.asarray(x)
        raise TypeError(f"reference backend: cannot use a {type(x).__name__} as a numpy array")

    def array_module(self) -> Any:
        return np

    def to_numpy(self, x: Any) -> np.ndarray:
        return self.asarray(x)

    def dtype_of(self, x: Any) -> str:
        """Canonical dtype name; an unsupported dtype comes back as its own spelling so the
        caller's ``check_dtype`` can name the function and argument."""
        dt = x.dtype if isinstance(x, np.ndarray) else np.asarray(x).dtype
        try:
            return dtype_name(dt)
        except InvalidDtypeError:
            return str(dt)

    def empty(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        out = np.empty(shape, numpy_dtype(dtype))
        if poison_enabled():
            out.fill(np.nan)
        return out

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, numpy_dtype(dtype))

    # ----------------------------------------------------------- pool writes
    def append_rows(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
                    write: AppendWrite, fp8: tuple[str, Any, Any] | None = None
                    ) -> tuple[Any, Any]:
        """Row copies on flat views of the pools (numpy writes through them); fp8 pools
        take their rows quantized (``fp8.quantize``, each layer with its scale)."""
        *lead, num_pages, page_size, hkv, d = k_pages.shape
        c_dst, c_src, w_dst, w_src = write.flat_rows(lead[0] if lead else 1, num_pages,
                                                     page_size)
        if fp8 is not None:
            k_rows, v_rows = (quantize_rows(rows, write.row_layers, write.layer0, fp8[0],
                                            np.asarray(scale))
                              for rows, scale in ((k_rows, fp8[1]), (v_rows, fp8[2])))
        for pages, rows in ((k_pages, k_rows), (v_pages, v_rows)):
            if not pages.flags.c_contiguous:     # the pool's own arrays always are
                raise RuntimeError("reference append_rows: pools must be C-contiguous (the "
                                   "flat view must write through)")
            flat = pages.reshape(-1, hkv * d)
            if c_dst.size:
                flat[c_dst] = flat[c_src]
            src = np.asarray(rows).reshape(-1, hkv * d)[w_src]
            flat[w_dst] = src.view(np.uint8) if fp8 is not None and pages.dtype == np.uint8 \
                else src.astype(pages.dtype, copy=False)
        return k_pages, v_pages

    # ----------------------------------------------------------- kernels
    def partial(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
                plan: DecodePlan, sm_scale: float, v_out: Any, lse_out: Any, *,
                soft_cap: float | None = None, sinks: Any = None, kv_dtype: str | None = None,
                v_scale: float = 1.0) -> None:
        if isinstance(table, StepTable):   # array ops read the host view
            table = table.page_table()
        hkv, d = plan.num_kv_heads, plan.head_dim
        g = plan.num_qo_heads // hkv
        scale_log2 = sm_scale * LOG2E
        qf = as_float32(q).reshape(q.shape[0], hkv, g, d)
        t_begin, t_end = chunk_token_ranges(table, plan)
        for c in range(plan.num_chunks):
            r = int(plan.request_indices[c])
            t0, t1 = int(t_begin[c]), int(t_end[c])
            k = visible_kv(k_pages, table, r, t0, t1, kv_dtype)
            v = visible_kv(v_pages, table, r, t0, t1, kv_dtype)
            o, lse = attend_f32(qf[r], k, v, scale_log2, soft_cap)
            o, lse = o.reshape(hkv * g, d) * np.float32(v_scale), lse.reshape(hkv * g)
            if sinks is not None:          # a partial that is the output: its final store
                o, lse = sink_f32(o, lse, sinks)
            v_out[c] = o.astype(v_out.dtype)
            lse_out[c] = lse

    def merge(self, v: Any, lse: Any, o_indptr: Any, v_out: Any, lse_out: Any, *,
              sinks: Any = None, inputs: int | None = None) -> None:
        ip = np.asarray(o_indptr, dtype=np.int64)
        for o in range(ip.size - 1):
            vo, lo = combine_f32(v[ip[o]:ip[o + 1]].astype(np.float32),
                                 lse[ip[o]:ip[o + 1]].astype(np.float32))
            if sinks is not None:          # once per group, never per partial
                vo, lo = sink_f32(vo, lo, sinks)
            v_out[o] = vo.astype(v_out.dtype)
            lse_out[o] = lo

    def decode_v1(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable | StepTable,
                  sm_scale: float, out: Any, lse_out: Any, *,
                  soft_cap: float | None = None, sinks: Any = None, kv_dtype: str | None = None,
                  v_scale: float = 1.0) -> None:
        if isinstance(table, StepTable):
            table = table.page_table()
        b, hq, d = q.shape
        hkv = k_pages.shape[2]
        scale_log2 = sm_scale * LOG2E
        qf = as_float32(q).reshape(b, hkv, hq // hkv, d)
        for r in range(b):
            n = int(table.visible_lens[r])
            k = visible_kv(k_pages, table, r, 0, n, kv_dtype)
            v = visible_kv(v_pages, table, r, 0, n, kv_dtype)
            # the CTA's warps take interleaved token stripes, then combine their states
            parts = [attend_f32(qf[r], k[:, s::V1_SPLITS], v[:, s::V1_SPLITS], scale_log2,
                                soft_cap) for s in range(V1_SPLITS)]
            o, lse = combine_f32(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
            o, lse = o.reshape(hq, d) * np.float32(v_scale), lse.reshape(hq)
            if sinks is not None:
                o, lse = sink_f32(o, lse, sinks)
            out[r] = o.astype(out.dtype)
            lse_out[r] = lse

    def gather_sdpa(self, q: Any, k_pages: Any, v_pages: Any, table: PageTable,
                    sm_scale: float, out: Any, lse_out: Any, *,
                    soft_cap: float | None = None, sinks: Any = None,
                    kv_dtype: str | None = None, v_scale: float = 1.0) -> None:
        if isinstance(table, StepTable):
            table = table.page_table()
        b, hq, d = q.shape
        hkv = k_pages.shape[2]
        g = hq // hkv
        for r in range(b):
            n = int(table.visible_lens[r])
            k = visible_kv(k_pages, table, r, 0, n, kv_dtype)  # the gathered copy
            v = visible_kv(v_pages, table, r, 0, n, kv_dtype)
            if n == 0:
                o, lse2 = np.zeros((hq, d), np.float32), np.full(hq, -np.inf, np.float32)
            else:
                qf = as_float32(q[r]).reshape(hkv, g, d)
                with np.errstate(invalid="ignore", over="ignore"):
                    s = np.matmul(qf, k.transpose(0, 2, 1)) * np.float32(sm_scale)  # natural
                    sm = RowSoftmax(np, cap_logits(np, s, soft_cap, base2=False), base2=False)
                    o = sm.normalize(np.matmul(sm.p, v)).reshape(hq, d) * np.float32(v_scale)
                lse2 = sm.lse2.reshape(hq)
            if sinks is not None:
                o, lse2 = sink_f32(o, lse2, sinks)
            out[r] = o.astype(out.dtype)
            if lse_out is not None:
                lse_out[r] = lse2
