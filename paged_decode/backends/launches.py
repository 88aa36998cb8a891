"""How the kernels are launched, in one place for every backend that runs them.

Each function turns a call into a ``Launch``: the specialization, the grid in blocks, the
threads per block and the dynamic shared memory (both from the kernel's ``KernelDef``,
``kernels/<name>.py``) and the argument list in the CUDA kernel's parameter order, each
argument tagged as an input buffer, an output buffer or a scalar (scalars are packed as
numpy ``int32`` / ``float32``, never Python numbers; the Metal dialect picks its inputs
from the same list by name). Arrays are whatever the calling backend uses
(``launching.LaunchingBackend`` calls these).

The builders stay host-side rather than in the kernel files: a grid is derived from host
objects (``DecodePlan``, ``AppendWrite``) and a spec from settings, while kernel modules
import nothing of the package but ``kernel_def``, which keeps the registry cycle-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..dtypes import itemsize
from ..errors import UnsupportedProblemError
from ..kernels import append, merge
from ..kernels.merge import SPLITS as MERGE_SPLITS
from ..kernels.merge import WARPS_PER_BLOCK as MERGE_ITEMS_PER_BLOCK
from ..kernels.registry import kernel_def
from ..plan import DecodePlan
from ..specs import (  # noqa: F401 - PREFIX_TILE_ROWS, prefix_*: re-exported for callers
    CLUSTER_SIZES,
    MAX_PAGE_SIZE,
    PREFIX_TILE_ROWS,
    SUPPORTED_HEAD_DIMS,
    V2TC_DTYPES,
    V2TC_FP8,
    V2TC_MAX_GROUP,
    KernelSpec,
    append_fp8_spec,
    append_spec,
    merge_spec,
    prefix_fits,
    prefix_kernel_runs,
    prefix_spec,
    row_hint_pays,
    table_update_spec,
    v1_spec,
    v2_spec,
    v2tc_fits,
    v2tc_metal_spec,
    v2tc_row_tiles,
    v2tc_spec,
    v2tc_warps,
)
from .base import Problem, Support

LOG2E = 1.4426950408889634
TABLE_FIELDS = ("indices", "indptr", "last_page_len", "first_page_offset")
#: where path "v2tc" runs (refusals name them)
V2TC_RUNS_ON = "it runs on 'cuda', 'emulated-cuda', 'metal' and 'emulated-metal'"


class Arg(NamedTuple):
    """One kernel argument (a named tuple: every eager launch builds a dozen of these,
    and a frozen dataclass costs several times as much host time to make)."""
    name: str
    value: Any
    role: str            # "in", "out" or "scalar"


class Launch(NamedTuple):
    spec: KernelSpec
    grid: tuple[int, int]        # blocks in x, y
    block: int                   # threads per block
    smem: int                    # dynamic shared memory bytes
    args: tuple[Arg, ...]
    #: waits in-kernel for the grid before it (the merge after a partial): backends that
    #: can launch it early do so (``cuda_pdl.py``); the others launch it as any other
    dependent: bool = False

    @property
    def empty(self) -> bool:
        return self.grid[0] == 0 or self.grid[1] == 0

    def values(self) -> tuple[Any, ...]:
        return tuple(a.value for a in self.args)


def support(problem: Problem, tensor_cores: bool = False, metal: bool = False) -> Support:
    """Whether the CUDA kernels have a specialization for ``problem`` (``path="merge"``:
    the merge alone, which reads float4 slices of any head dim that is a multiple of 4;
    ``path="v2tc"``: the tensor-core v2 partial, which needs a backend that runs it,
    ``tensor_cores``, q float16 or bfloat16 with pools in its dtype or fp8, a GQA group
    of at most 32 and, in the CUDA dialect (``metal`` False), a pool of at most
    ``V2TC_MAX_POOL_ROWS`` rows)."""
    if problem.path == "v2tc":
        if not tensor_cores:
            return Support(False, f"path 'v2tc' is the tensor-core partial, which this "
                                  f"backend does not run ({V2TC_RUNS_ON})")
        if not v2tc_fits(problem.q_dtype, problem.kv_dtype):
            return Support(False, f"path 'v2tc' needs q one of {V2TC_DTYPES} and the pools "
                                  f"in q's dtype or one of {V2TC_FP8}, got q "
                                  f"{problem.q_dtype} and pools {problem.kv_dtype} (path "
                                  f"'v2' runs any dtype)")
        group = problem.num_qo_heads // problem.num_kv_heads
        if group > V2TC_MAX_GROUP:
            return Support(False, f"path 'v2tc' takes at most {V2TC_MAX_GROUP} query heads "
                                  f"per KV head, got {group}")
        rows = v2tc_rows_refusal(problem.pool_pages, problem.page_size, metal)
        if rows:
            return Support(False, rows)
    if problem.path == "merge":
        if problem.head_dim < 4 or problem.head_dim % 4:
            return Support(False, "head_dim must be a positive multiple of 4 for the merge "
                                  f"kernel, got {problem.head_dim}")
        return Support(True)
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        return Support(False, f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got "
                              f"{problem.head_dim}")
    if not 1 <= problem.page_size <= MAX_PAGE_SIZE:
        return Support(False, f"page_size must be in [1, {MAX_PAGE_SIZE}], got "
                              f"{problem.page_size}")
    return Support(True)


def _ins(names: tuple[str, ...], values: tuple[Any, ...]) -> list[Arg]:
    return [Arg(n, v, "in") for n, v in zip(names, values)]


def _launch(spec: KernelSpec, grid: tuple[int, int], args: list[Arg],
            dependent: bool = False) -> Launch:
    """A launch of ``spec`` with the block and shared memory its kernel definition gives."""
    kdef = kernel_def(spec.kernel)
    return Launch(spec, grid, kdef.threads(spec), kdef.dynamic_smem(spec), tuple(args),
                  dependent)


def _cap_log2(soft_cap: float | None) -> np.float32:
    """The soft cap in the kernels' log2 units (their scores carry log2(e)); 0 when off."""
    return np.float32(0.0 if soft_cap is None else soft_cap * LOG2E)


def partial_launch(*, dtypes: tuple[str, str, str], plan: DecodePlan, sm_scale: float,
                   q: Any, k_pages: Any, v_pages: Any, table: tuple[Any, ...],
                   request_indices: Any, kv_tile_indices: Any, v_out: Any,
                   lse_out: Any, soft_cap: float | None = None, sinks: Any = None,
                   v_scale: float = 1.0, metal: bool = False) -> Launch:
    """The v2 partial: grid (C chunks, Hkv * q_groups). ``dtypes`` = (q, kv, out);
    ``table`` = the four CSR arrays in ``TABLE_FIELDS`` order. ``soft_cap`` (natural
    units) and ``sinks`` (``[Hq]`` float32, joined at the store: only for a partial that
    writes the output) pick the specialization; without sinks ``q`` stands in for the
    unread pointer. ``v_scale``: an fp8 pool's V scale, multiplying every row (1 for
    other pools; an fp8 pool's K scale is already in ``sm_scale``). ``metal``: for the
    Metal dialect (no L2 hint to choose: ``row_hint_pays`` is CUDA's)."""
    spec = v2_spec(*dtypes, plan.head_dim, plan.page_size, plan.heads_per_cta,
                   soft_cap=soft_cap is not None, sink=sinks is not None,
                   row_hint=not metal and _row_hint("v2", dtypes[1], plan, plan.q_groups))
    args = _chunk_args(plan, sm_scale, ("q_groups", plan.q_groups), q, k_pages, v_pages,
                       table, request_indices, kv_tile_indices, v_out, lse_out,
                       sinks=q if sinks is None else sinks)
    args += [Arg("soft_cap_log2", _cap_log2(soft_cap), "scalar"),
             Arg("v_scale", np.float32(v_scale), "scalar")]
    return _launch(spec, (plan.num_chunks, plan.num_kv_heads * plan.q_groups), args)


def _row_hint(kernel: str, kv_dtype: str, plan: DecodePlan, per_head: int) -> bool:
    """``row_hint_pays`` for a flat partial's launch over ``plan``: its grid of chunks x
    Hkv x ``per_head`` CTAs (q groups or row tiles), each streaming one chunk."""
    return row_hint_pays(kernel, kv_dtype, plan.head_dim,
                         ctas=plan.num_chunks * plan.num_kv_heads * per_head,
                         chunk_tokens=plan.pages_per_chunk * plan.page_size)


def _chunk_args(plan: DecodePlan, sm_scale: float, ctas_per_head: tuple[str, int], q: Any,
                k_pages: Any, v_pages: Any, table: tuple[Any, ...], request_indices: Any,
                kv_tile_indices: Any, v_out: Any, lse_out: Any, *,
                sinks: Any = None) -> list[Arg]:
    """The arguments of a split-KV partial (v2, v2tc), in their kernels' order;
    ``ctas_per_head`` names and gives the CTAs per (chunk, KV head) (``q_groups``,
    ``row_tiles``); ``sinks``: the partial's sink input (a stand-in without sinks)."""
    args = [*_ins(("q", "k_pages", "v_pages"), (q, k_pages, v_pages)),
            *_ins(TABLE_FIELDS, table),
            *_ins(("request_indices", "kv_tile_indices"), (request_indices, kv_tile_indices))]
    if sinks is not None:
        args.append(Arg("sinks", sinks, "in"))
    return args + [
        Arg("v_out", v_out, "out"), Arg("lse_out", lse_out, "out"),
        Arg("num_qo_heads", np.int32(plan.num_qo_heads), "scalar"),
        Arg("num_kv_heads", np.int32(plan.num_kv_heads), "scalar"),
        Arg(ctas_per_head[0], np.int32(ctas_per_head[1]), "scalar"),
        Arg("pages_per_chunk", np.int32(plan.pages_per_chunk), "scalar"),
        Arg("scale_log2", np.float32(sm_scale * LOG2E), "scalar")]


#: the most pool rows (pages x page size) the CUDA dialect of the tensor-core partial
#: addresses: its staged token rows are 32-bit (256 GiB of K at the smallest row)
V2TC_MAX_POOL_ROWS = 2 ** 32 - 1


def v2tc_rows_refusal(pages: int, page_size: int, metal: bool) -> str:
    """Why the tensor-core partial cannot address a pool of ``pages`` pages ("" when it
    can; the Metal dialect's offsets are 64-bit)."""
    rows = int(pages) * int(page_size)
    if metal or rows <= V2TC_MAX_POOL_ROWS:
        return ""
    return (f"path 'v2tc' addresses pool rows in 32 bits: k_pages holds {int(pages)} pages "
            f"of {int(page_size)} tokens ({rows} rows), at most {V2TC_MAX_POOL_ROWS} rows; "
            "path 'v2' takes larger pools")


def v2tc_launch(*, kv_dtype: str, out_dtype: str, plan: DecodePlan, sm_scale: float,
                q: Any, k_pages: Any, v_pages: Any, table: tuple[Any, ...],
                request_indices: Any, kv_tile_indices: Any, v_out: Any,
                lse_out: Any, metal: bool = False, soft_cap: float | None = None,
                sinks: Any = None, q_dtype: str | None = None, v_scale: float = 1.0,
                fused: FusedMerge | None = None) -> Launch:
    """The tensor-core v2 partial (``kernels/decode_v2_tc.py``): grid (C chunks, Hkv *
    row_tiles), the v2 partial's arguments with ``row_tiles`` for ``q_groups``, then
    ``soft_cap_log2`` and ``v_scale`` (an fp8 pool's V scale, as for ``partial_launch``;
    ``q_dtype``: q's dtype, the pools' when ``None``); ``metal``: the Metal dialect's
    specialization (its rows per threadgroup and SIMD groups), the same grid and
    arguments. ``soft_cap`` and ``sinks`` as for ``partial_launch`` (sinks only for a
    partial that writes the output). The CUDA dialect raises ``UnsupportedProblemError``
    for pools of more than ``V2TC_MAX_POOL_ROWS`` rows (``k_pages.shape[0]`` pages of
    ``plan.page_size`` tokens). ``fused`` (CUDA only; ``v_out`` / ``lse_out`` are then the
    float32 workspace): the request's last CTA merges its partials into ``fused.out`` /
    ``fused.lse``, with ``sinks`` as the merge's (``FusedMerge``); with ``fused.cluster``
    each request's chunks run as one thread-block cluster per head slot and merge through
    each other's shared memory (``v_out``, ``lse_out`` and the counters unused; the plan
    must have ``cluster_merge_size(plan) == fused.cluster``); the arguments end with
    ``o_indptr``, ``merge_counters``, ``merged_out`` and ``merged_lse`` (stand-ins
    without), then (CUDA) ``batch_size``."""
    if fused is not None and metal:
        raise ValueError("v2tc_launch: the Metal dialect has no fused merge")
    flags = {"soft_cap": soft_cap is not None, "sink": sinks is not None}
    refusal = v2tc_rows_refusal(int(k_pages.shape[0]), plan.page_size, metal)
    if refusal:         # supports() refuses it first; a launch built directly lands here
        raise UnsupportedProblemError(f"decode: {refusal}")
    tiles = v2tc_row_tiles(plan.num_qo_heads, plan.num_kv_heads)
    if metal:
        spec = v2tc_metal_spec(kv_dtype, out_dtype, plan.head_dim, plan.page_size,
                               plan.num_qo_heads // plan.num_kv_heads, q_dtype=q_dtype,
                               **flags)
    else:
        cluster = fused.cluster if fused is not None else 0
        if cluster and cluster not in CLUSTER_SIZES:
            raise ValueError(f"v2tc_launch: fused.cluster must be 0 or one of {CLUSTER_SIZES}, "
                             f"got {cluster}")
        if cluster and cluster_merge_size(plan) != cluster:
            raise ValueError(f"v2tc_launch: a cluster merge of {cluster} CTAs needs every "
                             f"request of the plan in exactly {cluster} chunks "
                             f"(cluster_merge_size: {cluster_merge_size(plan)})")
        spec = v2tc_spec(kv_dtype, out_dtype, plan.head_dim, plan.page_size, q_dtype=q_dtype,
                         merged_dtype=fused.out_dtype if fused is not None else "",
                         row_hint=_row_hint("v2tc", kv_dtype, plan, tiles), cluster=cluster,
                         **flags)
    args = _chunk_args(plan, sm_scale, ("row_tiles", tiles), q, k_pages, v_pages, table,
                       request_indices, kv_tile_indices, v_out, lse_out,
                       sinks=q if sinks is None else sinks)
    args.append(Arg("soft_cap_log2", _cap_log2(soft_cap), "scalar"))
    args.append(Arg("v_scale", np.float32(v_scale), "scalar"))
    if fused is not None:
        args += [Arg("o_indptr", fused.o_indptr, "in"),
                 Arg("merge_counters", fused.counters, "out"),
                 Arg("merged_out", fused.out, "out"), Arg("merged_lse", fused.lse, "out")]
    elif not metal:     # unread and unwritten: an input stands in for each
        args += [Arg(n, request_indices, "in")
                 for n in ("o_indptr", "merge_counters", "merged_out", "merged_lse")]
    if not metal:
        args.append(Arg("batch_size", np.int32(plan.batch_size), "scalar"))
    return _launch(spec, (plan.num_chunks, plan.num_kv_heads * tiles), args)


@dataclass(frozen=True, eq=False)
class FusedMerge:
    """The fused merge of a tensor-core partial launch (``v2tc_launch``): ``o_indptr
    [B+1]`` int32 (the plan's), ``counters [B * Hkv * row_tiles]`` int32, zero before the
    launch (the kernel leaves them zero; ``fused_merge_slots``), ``out [B, Hq, D]`` of
    ``out_dtype`` and ``lse [B, Hq]`` float32 (base 2): the merged results."""

    o_indptr: Any
    counters: Any
    out: Any
    lse: Any
    out_dtype: str
    cluster: int = 0     # CTAs per cluster of a cluster merge (``cluster_merge_size``); 0: none


def fused_merge_pays(plan: DecodePlan, kv_dtype: str, merge_split: int = 1) -> bool:
    """Whether the tensor-core partial fuses its merge by default: where a CTA's query
    heads (its rows, at most 16) are no more than its warps, so its last CTA merges one
    head per warp, as the unsplit merge kernel's one warp per (request, head) does, at
    head_dim up to 128, and where the merge kernel would run unsplit (``merge_split``, the
    split the two launches' merge would take, is 1). With more heads per CTA the merge of
    a request serializes on one CTA: on the H200 GQA 7, 8 and 16 took up to 2.5x the two
    launches' time at batch 1-8 (S16-R4). At head_dim 256 (GQA 2) the fused kernel ran
    9-13% slower wherever a call merged (S16-R5; not profiled). GQA 1 at head_dim 96 and
    GQA 4 at 128 were within 0.8 us (S16-R1, R5), and at GQA 4 batch 4-8 the fused call
    is 0.7-2.7 us faster than two launches; at batch 1 over 32-34 chunks per request the
    split merge's two launches are 2.3-3.8 us faster (S17-R3). Where the merge runs in
    thread-block clusters (``cluster_merge_pays``) it spreads over the request's CTAs
    instead, and the backend fuses it at any GQA (``LaunchingBackend.fuses_merge``): on
    an H100 at GQA 8 and 16 that was 0.7-2.4 us faster than two launches in each of the
    nine cells where clusters applied (1K contexts at batch 1-64, batch 64 at 8K, GQA 16
    batch 64 at 32K; S46-R1), while the counters' merge forced in the other nine was up
    to 3.7x slower (batch 1-8 over 8K-32K). Against the rule before it (S47-R1, an H100),
    fusing in clusters was 0.4-1.7 us faster in all twelve cells where it applied, GQA 7
    (Qwen2-7B) at batch 1 / 8 included."""
    rows = min(16, plan.num_qo_heads // plan.num_kv_heads)
    return (plan.head_dim <= 128 and rows <= v2tc_warps(plan.head_dim, kv_dtype)
            and merge_split == 1)


def cluster_merge_size(plan: DecodePlan) -> int:
    """The CTAs per cluster of a cluster merge over ``plan`` (``v2tc_launch``): ``K`` when
    every request has exactly ``K`` chunks, ``K`` in ``CLUSTER_SIZES``, so that ``K``
    adjacent chunks are one request's (the plan's chunks are in request order); else 0."""
    k = plan.uniform_chunks
    return k if k in CLUSTER_SIZES else 0


#: the longest chunk (tokens) where ``cluster_merge_pays`` takes clusters of 3-8 CTAs
CLUSTER_MERGE_MAX_CHUNK_TOKENS = 2048
#: the smallest batch where ``cluster_merge_pays`` takes two chunks of any length
CLUSTER_MERGE_TWO_CHUNK_BATCH = 64
#: the largest cluster ``cluster_merge_pays`` takes on a grid past the plan's CTA target
CLUSTER_MERGE_WIDE_ABOVE = 4


def cluster_merge_pays(plan: DecodePlan, kv_dtype: str) -> bool:
    """Whether a fused merge over ``plan`` runs in clusters by default (where
    ``cluster_merge_size(plan)`` allows it): over 16-bit pools at head_dim 128, with chunks
    of at most ``CLUSTER_MERGE_MAX_CHUNK_TOKENS`` tokens, or two chunks per request at
    batch ``CLUSTER_MERGE_TWO_CHUNK_BATCH`` or more (where two chunks were measured; in a
    grid of one wave, longer chunks measured slower at 4-8 per request).

    Measured on H100s (S44-R3 / R4 / R6, Llama-3-8B heads, the same kernel with and
    without clusters in one run): 0.4-1.8 us faster at batch 1-8 over 1K-8K contexts (4
    or 8 chunks of 128-2048 tokens), 1.0-4.9 us at batch 64 (2 chunks per request, 1024
    CTAs); 0.8-4.3 us slower with 4-8 chunks of 4096-8192 tokens (8 x 16K / 32K, 4 x
    32K); over fp8 pools 2-44 us slower at 8 chunks (512 CTAs) and, numbered heads first,
    up to 15 us at 2. Clusters of more than ``CLUSTER_MERGE_WIDE_ABOVE`` CTAs only on a
    grid within the plan's CTA target (one wave; the default plans give 8 chunks only
    there): past it, 6 and 8 chunks per request measured up to 14.6 us slower in 8 of 10
    cells (S45-R2, an H100: 8 x 1K / 8K at 384 and 512 CTAs, batch 32-128 x 1K at
    1536-8192 CTAs). Other head dims were not measured (docs/tensor-core-decode.md)."""
    k = cluster_merge_size(plan)
    if not k or kv_dtype in V2TC_FP8 or plan.head_dim != 128:
        return False
    if k > CLUSTER_MERGE_WIDE_ABOVE and plan.num_ctas > plan.target_ctas:
        return False
    return ((k == 2 and plan.batch_size >= CLUSTER_MERGE_TWO_CHUNK_BATCH)
            or plan.pages_per_chunk * plan.page_size <= CLUSTER_MERGE_MAX_CHUNK_TOKENS)


def fused_merge_slots(plan: DecodePlan) -> int:
    """Counters of a fused merge over ``plan``: one per (request, KV head, row tile)."""
    return plan.batch_size * plan.num_kv_heads * v2tc_row_tiles(plan.num_qo_heads,
                                                                 plan.num_kv_heads)


#: the split merge's bounds (``merge_split``): its warps stay within this many per SM, so
#: every block of the grid is resident at once (a split block is one (row, head); the
#: merge kernel holds few registers and at most 16.5 KB of shared memory) ...
MERGE_SPLIT_WARPS_PER_UNIT = 16
#: ... and each warp takes this many partials on average (one load batch of
#: ``kernels.merge.SPLIT_UNROLL``): fewer leave split warps with nothing to load
MERGE_SPLIT_MIN_ROWS = 8


def merge_split(outputs: int, heads: int, inputs: int, units: int, head_dim: int) -> int:
    """Warps per (output row, head) of the merge (``kernels/merge.py`` ``SPLIT``): the most
    of ``MERGE_SPLITS`` whose warps, ``outputs x heads x split``, stay within
    ``MERGE_SPLIT_WARPS_PER_UNIT`` per unit of ``units``, take at least
    ``MERGE_SPLIT_MIN_ROWS`` of a group's ``inputs / outputs`` partials each and whose
    block's shared sums at ``head_dim`` fit the static limit (``merge.split_smem_bytes``:
    16 warps up to head_dim 765, any split to 381); else 1 (one
    warp per (row, head), four per block). Why: one warp merges a group's partials
    ``4`` at a time, each batch waiting on memory, so a batch-1 call over 256 chunks per
    head waits 64 times in a row on 8 warps of an idle device; a split warp takes about
    ``inputs / (outputs x split)`` rows, ``kernels.merge.SPLIT_UNROLL`` at a time."""
    if outputs <= 0 or heads <= 0:
        return 1
    mean = inputs / outputs
    for split in sorted(MERGE_SPLITS, reverse=True):
        if (split > 1 and outputs * heads * split <= MERGE_SPLIT_WARPS_PER_UNIT * units
                and mean >= MERGE_SPLIT_MIN_ROWS * split
                and merge.split_fits(head_dim, split)):
            return split
    return 1


def merge_launch(*, out_dtype: str, shape: tuple[int, int, int], v: Any, lse: Any,
                 o_indptr: Any, v_out: Any, lse_out: Any, rows: Any = None,
                 sinks: Any = None, split: int = 1) -> Launch:
    """The merge: ``shape`` = (M, H, D) of ``v_out``; one warp per (row, head), or with
    ``split`` > 1 (CUDA dialect only; one of ``MERGE_SPLITS``: ``merge_split``) one block
    of ``split`` warps per (row, head). With ``rows`` (int32 ``[o_indptr[M]]``) merge input
    ``i`` is row ``rows[i]`` of ``v``/``lse`` (CUDA dialect only); without, ``o_indptr``
    stands in for the unread pointer. With ``sinks`` (``[H]`` float32) each group takes
    the head's sink once; without, ``lse`` stands in."""
    m, h, d = shape
    if split not in MERGE_SPLITS:
        raise ValueError(f"merge_launch: split must be one of {MERGE_SPLITS}, got {split!r}")
    spec = merge_spec(out_dtype, d, gather=rows is not None, sink=sinks is not None,
                      split=split)
    args = [*_ins(("v", "lse", "o_indptr", "rows", "sinks"),
                  (v, lse, o_indptr, o_indptr if rows is None else rows,
                   lse if sinks is None else sinks)),
            Arg("v_out", v_out, "out"), Arg("lse_out", lse_out, "out"),
            Arg("num_heads", np.int32(h), "scalar"), Arg("num_out", np.int32(m), "scalar")]
    # the merge kernel waits for the grid before it first thing (pd::wait_for_prerequisites)
    blocks = m * h if split > 1 else -(-m * h // MERGE_ITEMS_PER_BLOCK)
    return _launch(spec, (blocks, 1), args, dependent=True)


def v1_launch(*, dtypes: tuple[str, str, str], shape: tuple[int, int, int],
              num_kv_heads: int, page_size: int, sm_scale: float, q: Any, k_pages: Any,
              v_pages: Any, table: tuple[Any, ...], out: Any, lse_out: Any,
              soft_cap: float | None = None, sinks: Any = None,
              v_scale: float = 1.0) -> Launch:
    """v1: one block per (request, query head); ``shape`` = (B, Hq, D) of ``q``;
    ``soft_cap``, ``sinks`` and ``v_scale`` as for ``partial_launch`` (v1 always writes
    the output)."""
    b, hq, d = shape
    spec = v1_spec(*dtypes, d, page_size, soft_cap=soft_cap is not None,
                   sink=sinks is not None)
    args = [*_ins(("q", "k_pages", "v_pages"), (q, k_pages, v_pages)),
            *_ins(TABLE_FIELDS, table),
            Arg("sinks", q if sinks is None else sinks, "in"),
            Arg("out", out, "out"), Arg("lse_out", lse_out, "out"),
            Arg("num_qo_heads", np.int32(hq), "scalar"),
            Arg("num_kv_heads", np.int32(num_kv_heads), "scalar"),
            Arg("scale_log2", np.float32(sm_scale * LOG2E), "scalar"),
            Arg("soft_cap_log2", _cap_log2(soft_cap), "scalar"),
            Arg("v_scale", np.float32(v_scale), "scalar")]
    return _launch(spec, (b * hq, 1), args)


def prefix_launch(*, kv_dtype: str, plan0: DecodePlan, num_members: int, shared_pages: int,
                  row_tiles: int, sm_scale: float, q: Any, k_pages: Any, v_pages: Any,
                  page_ids: Any, members: Any, v_out: Any, lse_out: Any) -> Launch:
    """Cascade level 0 on tensor cores (``kernels/prefix_tc.py``): grid (C0 * row_tiles,
    Hkv). ``plan0`` is the level-0 plan (its ``num_qo_heads`` is ``M * Hq``); ``page_ids``
    the level-0 table's ``indices``; ``v_out [M * C0, Hq, D]``, ``lse_out [M * C0, Hq]``."""
    spec = prefix_spec(kv_dtype, plan0.head_dim, plan0.page_size)
    hq = plan0.num_qo_heads // num_members
    args = [*_ins(("q", "k_pages", "v_pages", "page_ids", "members"),
                  (q, k_pages, v_pages, page_ids, members)),
            Arg("v_out", v_out, "out"), Arg("lse_out", lse_out, "out"),
            Arg("num_shared_pages", np.int32(shared_pages), "scalar"),
            Arg("num_members", np.int32(num_members), "scalar"),
            Arg("num_chunks", np.int32(plan0.num_chunks), "scalar"),
            Arg("pages_per_chunk", np.int32(plan0.pages_per_chunk), "scalar"),
            Arg("num_qo_heads", np.int32(hq), "scalar"),
            Arg("num_kv_heads", np.int32(plan0.num_kv_heads), "scalar"),
            Arg("row_tiles", np.int32(row_tiles), "scalar"),
            Arg("scale_log2", np.float32(sm_scale * LOG2E), "scalar")]
    return _launch(spec, (plan0.num_chunks * row_tiles, plan0.num_kv_heads), args)


def append_launch(*, write: append.AppendWrite, dtype: str, vector_bytes: int,
                  pool_shape: tuple[int, ...], k_rows: Any, v_rows: Any, desc: Any,
                  k_pages: Any, v_pages: Any, outs: tuple[Any, Any] | None = None) -> Launch:
    """The pool append (``kernels/append.py``). ``pool_shape`` is the pools' ``[L?,
    num_pages, P, Hkv, D]``; ``k_rows``, ``v_rows`` are the new rows in the pools' dtype
    ``dtype``, C-contiguous; ``desc`` is ``write.desc`` as the backend's int32 array.

    CUDA (``outs`` None): the pools are read and written in place; grid (T, layers): every
    layer when the call copies a shared page but writes rows to one layer only, else the
    layers written. Metal (``outs`` = the new pools): ``desc`` sorted by page
    (``write.by_page()``), grid one threadgroup per (page, layer)."""
    *_, hkv, d = (int(x) for x in pool_shape)
    pools = [Arg("k_pages", k_pages, "out" if outs is None else "in"),
             Arg("v_pages", v_pages, "out" if outs is None else "in")]
    return _append(append_spec(dtype, vector_bytes), write, pool_shape,
                   _ins(("k_rows", "v_rows", "desc"), (k_rows, v_rows, desc)) + pools,
                   ("row_words", hkv * d * itemsize(dtype) // vector_bytes), outs)


def append_fp8_launch(*, write: append.AppendWrite, kv_dtype: str, row_dtype: str,
                      pool_shape: tuple[int, ...], k_rows: Any, v_rows: Any, desc: Any,
                      k_pages: Any, v_pages: Any, k_scale: Any, v_scale: Any,
                      outs: tuple[Any, Any] | None = None) -> Launch:
    """The quantizing append into fp8 pools (``kernels/append_fp8.py``): ``append_launch``'s
    grid and arguments, rows of ``row_dtype`` (C-contiguous), the layers' scales
    ``k_scale``, ``v_scale`` (float32 ``[L]`` backend arrays) after the pools, and
    ``row_elems`` (``Hkv * D``) for ``row_words``."""
    *_, hkv, d = (int(x) for x in pool_shape)
    pools = [Arg("k_pages", k_pages, "out" if outs is None else "in"),
             Arg("v_pages", v_pages, "out" if outs is None else "in")]
    return _append(append_fp8_spec(kv_dtype, row_dtype), write, pool_shape,
                   _ins(("k_rows", "v_rows", "desc"), (k_rows, v_rows, desc)) + pools
                   + _ins(("k_scale", "v_scale"), (k_scale, v_scale)),
                   ("row_elems", hkv * d), outs)


def append_layers(write: append.AppendWrite, num_layers: int) -> tuple[int, int]:
    """The first layer and the number of layers of a CUDA append grid: every layer of the
    pool when the call copies a shared page but writes rows to fewer layers, else the
    layers written."""
    if write.row_layers < num_layers and write.copies:
        return 0, num_layers
    return write.layer0, write.row_layers


def _append(spec: KernelSpec, write: append.AppendWrite, pool_shape: tuple[int, ...],
            args: list[Arg], row_size: tuple[str, int], outs: tuple[Any, Any] | None
            ) -> Launch:
    """The grid and scalars both append kernels share (after their buffer arguments
    ``args``): CUDA (``outs`` None) grid (T, layers), Metal one block per (page, layer)
    and the new pools ``outs`` as outputs. ``row_size``: the kernel's row-length scalar."""
    *lead, num_pages, page_size, _, _ = (int(x) for x in pool_shape)
    num_layers = lead[0] if lead else 1
    grid_layer0, grid_layers = append_layers(write, num_layers)
    scalars = [("num_touched", write.num_touched), ("num_rows", write.num_rows),
               row_size, ("page_size", page_size), ("num_pages", num_pages),
               ("grid_layer0", grid_layer0), ("layer0", write.layer0),
               ("row_layers", write.row_layers), ("copy_cow", int(write.copy_cow))]
    args = args + [Arg(n, np.int32(v), "scalar") for n, v in scalars]
    if outs is None:
        return _launch(spec, (write.num_touched, grid_layers), args)
    args += [Arg("k_out", outs[0], "out"), Arg("v_out", outs[1], "out")]
    return _launch(spec, (num_pages, num_layers), args)


def table_update_launch(*, cap: int, page_cap: int, old: Any, delta: Any, new: Any) -> Launch:
    """The step-table update (``kernels/table_update.py``): grid ``cap + 1`` blocks;
    ``old``, ``delta``, ``new`` int32 buffers (``old`` and ``new`` must not overlap)."""
    args = [*_ins(("old_table", "delta"), (old, delta)), Arg("new_table", new, "out"),
            Arg("cap", np.int32(cap), "scalar"), Arg("page_cap", np.int32(page_cap), "scalar")]
    return _launch(table_update_spec(), (cap + 1, 1), args)
