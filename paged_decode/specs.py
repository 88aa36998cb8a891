"""Kernel specializations: one frozen spec per compiled kernel, with a readable URI.

The URI spells every parameter the compiled code depends on (every dtype included: the
original project once shared one compiled kernel between an f16 and an f32 pool and
returned garbage). It names the compiled object, keys the in-process cache and is what
``PAGED_DECODE_ASSERT_NO_COMPILE`` reports.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TypedDict

from . import settings
from .device import DeviceInfo
from .dtypes import itemsize
from .errors import InvalidArgumentError, PagedDecodeError, env_flag, env_positive_int
from .fp8 import FORMATS
from .kernels import decode_v2_tc, merge, prefix_tc
from .kernels.decode_v2 import row_loads, stage_bytes_per_thread
from .kernels.registry import kernel_def

ASSERT_NO_COMPILE_ENV = "PAGED_DECODE_ASSERT_NO_COMPILE"

SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "int32": "i32",
         "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}

V2_NUM_WARPS = 4
V1_NUM_WARPS = 8
SUPPORTED_HEAD_DIMS = (64, 96, 128, 256)
MAX_PAGE_SIZE = 256
MAX_HEADS_PER_CTA = 8


def heads_per_cta(num_qo_heads: int, num_kv_heads: int) -> int:
    """Query heads one CTA serves: the largest divisor of the GQA group that is <= 8.

    All of them share each K/V load; groups above 8 are split over ``q_groups`` CTAs
    (register budget: 8 heads x 8 accumulators per lane).
    """
    g = num_qo_heads // num_kv_heads
    return max(d for d in range(1, min(g, MAX_HEADS_PER_CTA) + 1) if g % d == 0)


class UnexpectedCompileError(PagedDecodeError, RuntimeError):
    """A kernel had to be compiled while ``PAGED_DECODE_ASSERT_NO_COMPILE=1``."""


@dataclass(frozen=True)
class KernelSpec:
    """One specialization. ``kernel`` is ``"v2"``, ``"v2tc"`` (the tensor-core v2 partial:
    ``q_dtype`` its queries' and mma operands', ``kv_dtype`` its pools', q's or fp8),
    ``"v1"``, ``"merge"``, ``"prefix"`` (the tensor-core level 0 of cascade decode:
    ``kv_dtype`` is its q/K/V dtype) or ``"append"`` (the pool write: ``out_dtype`` is the
    pools' dtype); parameters a kernel does not use are left at 0 / ``""``."""

    kernel: str
    out_dtype: str
    head_dim: int
    q_dtype: str = ""
    kv_dtype: str = ""
    page_size: int = 0
    heads_per_cta: int = 0
    num_warps: int = 0
    stages: int = 0
    row_loads: int = 0           # v2: 16-byte loads per lane per K/V row (CUDA only)
    gather: bool = False         # merge: inputs read through a row index (CUDA only)
    tile_tokens: int = 0         # prefix: K/V tokens per shared-memory tile
    vector_bytes: int = 0        # append: bytes per access (kernels/append.py)
    soft_cap: bool = False       # v2, v1, v2tc: logits soft cap (paged_decode/variants.py)
    sink: bool = False           # v2, v1, v2tc (final store), merge: attention sinks
    merged_dtype: str = ""       # v2tc (CUDA): the fused merge's output dtype ("": none)
    row_hint: bool = False       # v2, v2tc (CUDA): L2 prefetch hint within the K/V row
    cluster: int = 0             # v2tc (CUDA, fused merge): CTAs per cluster merge (0: none)

    # the kernels' template parameters are read off these fields by name in
    # ``kernels/<name>.py`` (``KernelDef.arguments``)

    @property
    def uri(self) -> str:
        parts = [f"pd_{self.kernel}"]
        if self.q_dtype:
            parts.append(f"q-{SHORT[self.q_dtype]}")
        if self.kv_dtype:
            parts.append(f"kv-{SHORT[self.kv_dtype]}")
        parts.append(f"o-{SHORT[self.out_dtype]}")
        if self.head_dim:
            parts.append(f"hd-{self.head_dim}")
        if self.page_size:
            parts.append(f"ps-{self.page_size}")
        if self.heads_per_cta:
            parts.append(f"qh-{self.heads_per_cta}")
        if self.num_warps:
            parts.append(f"w-{self.num_warps}")
        if self.stages:
            parts.append(f"st-{self.stages}")
        if self.row_loads:
            parts.append(f"ld-{self.row_loads}")
        if self.gather:
            parts.append("gather")
        if self.tile_tokens:
            parts.append(f"kt-{self.tile_tokens}")
        if self.vector_bytes:
            parts.append(f"vb-{self.vector_bytes}")
        if self.soft_cap:
            parts.append("softcap")
        if self.sink:
            parts.append("sink")
        if self.merged_dtype:
            parts.append(f"merge-{SHORT[self.merged_dtype]}")
        if self.row_hint:
            parts.append("l2row")
        if self.cluster:
            parts.append(f"cl-{self.cluster}")
        return "_".join(parts)

    def cuda_name_expression(self) -> str:
        """The template instantiation CuPy compiles (the kernel's parameter order)."""
        return kernel_def(self.kernel).cuda_name_expression(self)

    @property
    def dynamic_smem_bytes(self) -> int:
        """Dynamic shared memory bytes of a launch of this specialization."""
        return kernel_def(self.kernel).dynamic_smem(self)


RING_BUDGET = 96 * 1024       # staging bytes one CTA may take


def pipeline_stages(kv_dtype: str, head_dim: int, num_warps: int, preferred: int,
                    requested_loads: int = 1) -> int:
    """Deepest ring <= ``preferred`` (env ``PAGED_DECODE_STAGES`` overrides it) that fits
    ``RING_BUDGET``; at least 2."""
    want = env_stages() or preferred
    per_stage = num_warps * 32 * stage_bytes_per_thread(kv_dtype, head_dim, requested_loads)
    return max(2, min(want, RING_BUDGET // per_stage))


def v2_row_loads(kv_dtype: str, head_dim: int, heads_per_cta: int) -> int:
    """Loads per lane per row of the v2 partial: ``PAGED_DECODE_V2_ROW_LOADS`` when set,
    else ``V2_ROW_LOADS`` (the minimum, 1, unless measured otherwise)."""
    n = env_positive_int(ROW_LOADS_ENV)
    if n is None:
        return row_loads(kv_dtype, head_dim, V2_ROW_LOADS)
    loads = row_loads(kv_dtype, head_dim, n)

    def ring(m: int) -> int:       # bytes of the two-stage ring the kernel needs at least
        return 2 * V2_NUM_WARPS * 32 * stage_bytes_per_thread(kv_dtype, head_dim, m)
    limit = decode_v2_tc.MAX_DYNAMIC_SMEM           # what a block may have at all
    if ring(loads) > limit:
        most = max((m for m in range(1, loads) if ring(m) <= limit), default=1)
        raise InvalidArgumentError(
            f"{ROW_LOADS_ENV} = {n}: a two-stage ring of {loads} loads per lane per row "
            f"(head_dim {head_dim}, {kv_dtype}) needs {ring(loads)} bytes of shared memory, "
            f"above a block's {limit}; at most {most} here")
    return loads


STAGES_ENV = "PAGED_DECODE_STAGES"
TC_WARPS_ENV = "PAGED_DECODE_TC_WARPS"
L2_PREFETCH_ENV = "PAGED_DECODE_L2_PREFETCH"
#: bytes of the L2 prefetch hint on every CUDA cp.async copy (``PD_L2_PREFETCH``): 128
#: is 1-3% faster on v2tc's bandwidth-bound cells and level on v2 and cascade, 256 slower
#: (H200, ``docs/benchmarks/h200-2026-12-04-s18.md``)
L2_PREFETCH = 128
#: the hint sizes PTX has for ``cp.async`` (0: no hint)
L2_PREFETCH_SIZES = (0, 64, 128, 256)
#: ``PAGED_DECODE_L2_PREFETCH=rows``: each kernel hints the largest of 128 and 64 bytes
#: that divides its K/V row (``row_l2_prefetch``), none where neither does
L2_PREFETCH_ROWS = "rows"
#: CTAs per cluster a cluster merge may take (``v2tc_spec``): 8 is CUDA's portable limit
CLUSTER_SIZES = (2, 3, 4, 5, 6, 7, 8)
GRID_ORDER_ENV = "PAGED_DECODE_GRID_ORDER"
#: ``PAGED_DECODE_GRID_ORDER`` values (experiments): every flat decode kernel numbers its
#: CTAs head slots first / chunks first; unset, ``heads_first(spec)`` decides
GRID_ORDERS = ("heads", "chunks")
#: the kernels whose CTAs ``pd::grid_cell`` numbers (``PD_HEADS_FIRST``)
GRID_ORDER_KERNELS = ("v2", "v2tc")
ROW_LOADS_ENV = "PAGED_DECODE_V2_ROW_LOADS"
V2_ROW_LOADS = 1
V2_STAGES = 2
V1_STAGES = 2


def v2_spec(q_dtype: str, kv_dtype: str, out_dtype: str, head_dim: int, page_size: int,
            heads_per_cta: int, *, soft_cap: bool = False, sink: bool = False,
            row_hint: bool = False) -> KernelSpec:
    """The v2 partial; ``soft_cap`` / ``sink`` specialize it for those variants (``sink``
    only where it writes the output: merged partials never hold a sink); ``row_hint``:
    its L2 prefetch hint stays within a K/V row (``row_hint_pays``)."""
    loads = v2_row_loads(kv_dtype, head_dim, heads_per_cta)
    return KernelSpec("v2", out_dtype, head_dim, q_dtype, kv_dtype, page_size, heads_per_cta,
                      V2_NUM_WARPS,
                      pipeline_stages(kv_dtype, head_dim, V2_NUM_WARPS, V2_STAGES, loads),
                      loads, soft_cap=soft_cap, sink=sink, row_hint=row_hint)


def v1_spec(q_dtype: str, kv_dtype: str, out_dtype: str, head_dim: int,
            page_size: int, *, soft_cap: bool = False, sink: bool = False) -> KernelSpec:
    return KernelSpec("v1", out_dtype, head_dim, q_dtype, kv_dtype, page_size, 0, V1_NUM_WARPS,
                      pipeline_stages(kv_dtype, head_dim, V1_NUM_WARPS, V1_STAGES),
                      soft_cap=soft_cap, sink=sink)


def merge_spec(out_dtype: str, head_dim: int, gather: bool = False, *,
               sink: bool = False, split: int = 1) -> KernelSpec:
    """The merge; ``split`` > 1: that many warps per (row, head), kept in ``num_warps``
    (0 for the unsplit merge, so its name is what it was before the split existed)."""
    return KernelSpec("merge", out_dtype, head_dim, gather=gather, sink=sink,
                      num_warps=split if split > 1 else 0)


#: the tensor-core prefix kernel's dtypes (its operands are 16-bit; q must match the pools)
PREFIX_DTYPES = ("float16", "bfloat16")


#: query rows per CTA of the prefix kernel (``DeviceInfo.prefix_tile_rows`` where it runs)
PREFIX_TILE_ROWS = prefix_tc.ROWS_PER_WARP * prefix_tc.NUM_WARPS


def prefix_fits(q_dtype: str, kv_dtype: str) -> bool:
    """Whether the tensor-core prefix kernel takes these dtypes (q and pools both float16
    or both bfloat16; float32 pools run level 0 on the v2 partial)."""
    return kv_dtype in PREFIX_DTYPES and q_dtype == kv_dtype


def prefix_kernel_runs(device: DeviceInfo, q_dtype: str, kv_dtype: str) -> bool:
    """Whether cascade's level 0 runs on the tensor-core prefix kernel on ``device`` (one
    with ``prefix_tile_rows > 0``) for these dtypes: the one place this is decided (the
    backends' ``prefix_partial``, the plan's level-0 choice, the cost rule)."""
    return bool(device.prefix_tile_rows) and prefix_fits(q_dtype, kv_dtype)


def prefix_spec(kv_dtype: str, head_dim: int, page_size: int) -> KernelSpec:
    """The tensor-core level 0 of cascade decode (``kernels/prefix_tc.py``); it writes
    float32 partials."""
    return KernelSpec("prefix", "float32", head_dim, kv_dtype, kv_dtype, page_size, 0,
                      prefix_tc.NUM_WARPS, tile_tokens=prefix_tc.tokens_per_tile(head_dim))


#: the tensor-core v2 partial's query dtypes (16-bit mma operands); its pools have q's
#: dtype or are fp8 (``V2TC_FP8``: widened exactly into q's dtype in the kernel)
V2TC_DTYPES = ("float16", "bfloat16")
V2TC_FP8 = tuple(FORMATS)          # every fp8 format (``fp8.FORMATS``)
#: the largest GQA group the tensor-core v2 partial takes (two 16-row tiles)
V2TC_MAX_GROUP = decode_v2_tc.MAX_GROUP


def v2tc_fits(q_dtype: str, kv_dtype: str) -> bool:
    """Whether the tensor-core v2 partial takes these dtypes: q float16 or bfloat16, the
    pools in q's dtype or fp8 (either format); float32 keeps the CUDA-core v2."""
    return q_dtype in V2TC_DTYPES and (kv_dtype == q_dtype or kv_dtype in V2TC_FP8)


def v2tc_row_tiles(num_qo_heads: int, num_kv_heads: int) -> int:
    """CTAs of the tensor-core v2 partial per (chunk, KV head): 16-row tiles of the GQA
    group (1 up to 16 heads, 2 up to 32)."""
    return decode_v2_tc.row_tiles(num_qo_heads // num_kv_heads)


def v2tc_ctas_per_chunk(num_qo_heads: int, num_kv_heads: int) -> int:
    """CTAs one chunk launches on the tensor-core v2 partial (``plan_decode``'s
    ``ctas_per_chunk`` for a plan searched for it)."""
    return num_kv_heads * v2tc_row_tiles(num_qo_heads, num_kv_heads)


#: shared memory the CUDA driver keeps per resident block (sm_80 and later)
BLOCK_RESERVED_SMEM = 1024
#: ``PAGED_DECODE_WAVE_PLAN=0`` plans the tensor-core partial by the CTA-target rule
WAVE_PLAN_ENV = "PAGED_DECODE_WAVE_PLAN"


def v2tc_slots_per_unit(head_dim: int, kv_dtype: str, device: DeviceInfo) -> int:
    """CTAs of the tensor-core v2 partial one SM of ``device`` holds at once: what shared
    memory allows (its ring and Q tile plus the driver's reserve per block), at most what
    the kernel's registers allow (``decode_v2_tc.register_ctas``); 0 where the device does
    not say how much an SM has. Over 16-bit pools on sm_90 the ring allows 6 / 4 / 3 / 1
    CTAs of 128 threads at head_dim 64 / 96 / 128 / 256 and the registers 5 / 4 / 4 / 2
    (``tests/test_cuda_compile.py`` checks ptxas's counts against the result, with the
    fused merge too)."""
    if device.shared_mem_per_unit <= 0:
        return 0
    warps = v2tc_warps(head_dim, kv_dtype)
    elem = decode_v2_tc.kv_bytes(kv_dtype)
    smem = decode_v2_tc.dynamic_smem_bytes(head_dim, warps,
                                           v2tc_stages(head_dim, warps, kv_dtype), elem)
    by_smem = device.shared_mem_per_unit // (smem + BLOCK_RESERVED_SMEM)
    return max(1, min(by_smem, decode_v2_tc.register_ctas(head_dim, warps)))


class PlanGeometry(TypedDict):
    """``make_plan``'s keywords for the partial a plan is made for."""

    ctas_per_chunk: int | None
    slots_per_unit: int


def plan_geometry(path: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                  kv_dtype: str | None, device: DeviceInfo,
                  query_tokens: int = 1) -> PlanGeometry:
    """``make_plan``'s ``ctas_per_chunk`` and ``slots_per_unit`` for a plan made for
    ``path`` (one place for every caller): the tensor-core partial's CTAs per chunk for
    ``"v2tc"``, and its resident CTAs per SM where the wave rule is calibrated (16-bit
    pools, one query token, ``PAGED_DECODE_WAVE_PLAN`` not ``0``; ``waves.py``);
    ``None`` / 0 (the v2 partial's geometry, the target rule) otherwise. ``num_qo_heads``
    is the model's; a multi-token plan's group is ``query_tokens`` times it."""
    if path != "v2tc":
        return {"ctas_per_chunk": None, "slots_per_unit": 0}
    ctas = v2tc_ctas_per_chunk(num_qo_heads * query_tokens, num_kv_heads)
    kv = kv_dtype or "float16"
    waves = query_tokens == 1 and kv not in V2TC_FP8 and env_flag(WAVE_PLAN_ENV, True)
    return {"ctas_per_chunk": ctas,
            "slots_per_unit": v2tc_slots_per_unit(head_dim, kv, device) if waves else 0}


def env_stages() -> int | None:
    """``PAGED_DECODE_STAGES``: ``None`` when unset, else a ring depth of at least 2 (a
    kernel's budget may then lower it), or ``InvalidArgumentError`` naming the variable."""
    n = env_positive_int(STAGES_ENV)
    if n is not None and n < 2:
        raise InvalidArgumentError(f"{STAGES_ENV} must be an integer >= 2 (a ring of two "
                                   f"stages or more), got {settings.get(STAGES_ENV)!r}")
    return n


def v2tc_stages(head_dim: int, warps: int = decode_v2_tc.NUM_WARPS,
                kv_dtype: str = "float16") -> int:
    """Ring depth of the tensor-core v2 partial: ``decode_v2_tc.DEFAULT_STAGES`` (or
    ``PAGED_DECODE_STAGES``), at least 2 and at most what one block's shared memory
    holds for pools of ``kv_dtype`` (an fp8 ring holds bytes, beside the warps' scratch
    tiles)."""
    want = env_stages() or decode_v2_tc.DEFAULT_STAGES
    return max(2, min(want, decode_v2_tc.max_stages(head_dim, warps,
                                                    decode_v2_tc.kv_bytes(kv_dtype))))


def v2tc_warps(head_dim: int, kv_dtype: str = "float16") -> int:
    """Warps per CTA of the tensor-core v2 partial: ``decode_v2_tc.NUM_WARPS``, or
    ``PAGED_DECODE_TC_WARPS`` (2, 4 or 8) for experiments, halved while a two-stage ring
    of that many warps' tokens does not fit one block's shared memory."""
    env = settings.get(TC_WARPS_ENV)
    if env is None:
        return decode_v2_tc.NUM_WARPS
    if env not in ("2", "4", "8"):
        raise InvalidArgumentError(f"{TC_WARPS_ENV} must be 2, 4 or 8, got {env!r}")
    warps = int(env)
    elem = decode_v2_tc.kv_bytes(kv_dtype)
    while warps > 2 and decode_v2_tc.max_stages(head_dim, warps, elem) < 2:
        warps //= 2
    return warps


TIMELINE_ENV = "PAGED_DECODE_TIMELINE"


def timeline_enabled() -> bool:
    """Whether the CUDA kernels compile with per-CTA timeline stamps (``PD_TIMELINE``,
    ``kernels/common.py``): ``PAGED_DECODE_TIMELINE=1``, for ``bench/device/timeline.py``
    (diagnostics; a kernel is then compiled apart from its plain build)."""
    env = settings.get(TIMELINE_ENV)
    if env in (None, "", "0"):
        return False
    if env != "1":
        raise InvalidArgumentError(f"{TIMELINE_ENV} must be 0 or 1, got {env!r}")
    return True


def cuda_defines(l2_prefetch: int | None = None, timeline: bool | None = None,
                 spec: KernelSpec | None = None) -> tuple[str, ...]:
    """The ``-D`` options a CUDA kernel compiles with: ``PD_L2_PREFETCH`` (default
    ``l2_prefetch_bytes(spec)``), ``PD_HEADS_FIRST`` where ``heads_first(spec, prefetch)``
    ``PD_CLUSTER`` for a spec with ``cluster`` (the cluster merge's CTAs per cluster) and,
    when ``timeline`` (default ``timeline_enabled()``), ``PD_TIMELINE``. One compiled
    module per distinct tuple."""
    prefetch = l2_prefetch_bytes(spec) if l2_prefetch is None else l2_prefetch
    stamps = timeline_enabled() if timeline is None else timeline
    order = ("-DPD_HEADS_FIRST=1",) if spec is not None and heads_first(spec, prefetch) else ()
    cluster = (f"-DPD_CLUSTER={spec.cluster}",) if spec is not None and spec.cluster else ()
    return ((f"-DPD_L2_PREFETCH={prefetch}",) + order + cluster
            + (("-DPD_TIMELINE=1",) if stamps else ()))


def cuda_define_text(spec: KernelSpec) -> str:
    """``cuda_defines(spec=spec)`` as ``#define`` lines, for compilers that take source
    only (the emulator), so that they build what NVRTC builds for ``spec``."""
    lines = []
    for d in cuda_defines(spec=spec):
        name, _, value = d.removeprefix("-D").partition("=")
        lines.append(f"#define {name} {value or 1}\n")
    return "".join(lines)


def heads_first(spec: KernelSpec, prefetch: int | None = None) -> bool:
    """Whether ``spec``'s flat decode kernel (v2, v2tc; never others) numbers its CTAs
    head slots first (``pd::grid_cell``):

    - where the L2 prefetch hint of ``prefetch`` bytes (default ``l2_prefetch_bytes(spec)``)
      is not a divisor of the K/V row, so it fetches part of the next head's row, which
      that head's CTA then reads from L2 because it runs alongside (head_dim 96 at 16
      bits: 192-byte rows under 128 bytes);
    - over fp8 pools whose rows are no longer than the hint (head_dim <= 128): the heads'
      rows of a token lie side by side, and reading them together was 1-5% faster at
      batch 8-128 x 8K / 32K, level over the forks suite's shared pages (S34-R1 / R6 /
      R8, H100; 0.3 us slower at 8 x 1K).

    Elsewhere chunks first, which has requests that share pages read them at about the
    same time (over 16-bit pools at head_dim 128, heads first was level to 7% slower in
    the forks cells, S34-R1). ``PAGED_DECODE_GRID_ORDER`` = heads / chunks overrides it for
    experiments."""
    if spec.kernel not in GRID_ORDER_KERNELS:
        return False
    env = settings.get(GRID_ORDER_ENV)
    if env is not None:
        if env not in GRID_ORDERS:
            raise InvalidArgumentError(f"{GRID_ORDER_ENV} must be {' or '.join(GRID_ORDERS)}, "
                                       f"got {env!r}")
        return env == "heads"
    hint = l2_prefetch_bytes(spec) if prefetch is None else prefetch
    row = _row_bytes(spec.head_dim, spec.kv_dtype)
    return hint > 0 and (row % hint != 0 or (spec.kv_dtype in FORMATS and row <= hint))


@functools.cache
def _row_bytes(head_dim: int, kv_dtype: str) -> int:
    """Bytes of one K/V row of the pools (cached: ``heads_first`` runs on every eager
    launch)."""
    return head_dim * itemsize(kv_dtype)


def l2_prefetch_bytes(spec: KernelSpec | None = None) -> int:
    """The L2 prefetch size (bytes) the ``cp.async`` copies of ``spec``'s kernel hint:
    ``L2_PREFETCH``, or ``row_l2_prefetch(spec)`` for a spec made with ``row_hint``
    (``row_hint_pays``); ``PAGED_DECODE_L2_PREFETCH`` overrides both for experiments: 0,
    64, 128 or 256 for every kernel, or ``rows`` for ``row_l2_prefetch(spec)``
    (``L2_PREFETCH`` where ``spec`` is ``None``). Compiled in as ``PD_L2_PREFETCH``, so a
    kernel is compiled once per value."""
    env = settings.get(L2_PREFETCH_ENV)
    if env is None:
        return row_l2_prefetch(spec) if spec is not None and spec.row_hint else L2_PREFETCH
    if env == L2_PREFETCH_ROWS:
        return L2_PREFETCH if spec is None else row_l2_prefetch(spec)
    sizes = tuple(str(b) for b in L2_PREFETCH_SIZES)
    if env not in sizes:
        raise InvalidArgumentError(f"{L2_PREFETCH_ENV} must be {', '.join(sizes)} or "
                                   f"{L2_PREFETCH_ROWS}, got {env!r}")
    return int(env)


def row_l2_prefetch(spec: KernelSpec) -> int:
    """The L2 prefetch hint that fetches no bytes of a neighbouring head's K/V row: a
    row of the ``[num_pages, P, Hkv, D]`` pools is ``head_dim`` elements of ``kv_dtype``
    and starts at a multiple of its own size, so a hint of 128 bytes over a 192-byte row
    (head_dim 96, 16-bit) asks DRAM for 256, a third of it another head's, which is read
    again unless that head's CTA finds it in L2 in time. 128 where it divides the row,
    else 64, else 0; ``L2_PREFETCH`` for kernels without K/V rows (``kv_dtype`` empty)."""
    if not spec.kv_dtype or not spec.head_dim:
        return L2_PREFETCH
    row = _row_bytes(spec.head_dim, spec.kv_dtype)
    return next((b for b in (128, 64) if b <= L2_PREFETCH and row % b == 0), 0)


#: the plans under which the row hint beats 128 bytes over 16-bit head_dim 96 rows
#: (Phi-3-mini's heads on an H100, S34-R3 / R4 / R5 / R8 / R10, one round each): the v2 partial
#: from ``ROW_HINT_V2_CTAS`` CTAs (batch 32+ at 32 heads: 2-17% faster), or from half as
#: many with chunks of ``ROW_HINT_TOKENS`` tokens (16 x 16K / 32K: 9-14% faster; at 16 x 4K
#: it was 1-2% slower, at 8 x 8K / 32K level to 7% slower); the tensor-core partial from
#: chunks of ``ROW_HINT_TC_TOKENS`` tokens (32K: 3-9% faster at batch 8-64 as a rule,
#: S34-R10), and, its ring rows keeping sectors whole (``mma.TileRow``), also where
#: v2's rule holds with chunks of at least ``ROW_HINT_TC_MIN_TOKENS`` (S35-R8, one round:
#: 7-10% faster at batch 16-64 x 16K, 2-3% at 32 / 64 x 8K; 1-5% slower at 16 x 8K and
#: batch 16-64 x 4K)
ROW_HINT_V2_CTAS = 1024
ROW_HINT_TOKENS = 16384
ROW_HINT_TC_TOKENS = 32768
ROW_HINT_TC_MIN_TOKENS = 8192


def row_hint_pays(kernel: str, kv_dtype: str, head_dim: int, *, ctas: int,
                  chunk_tokens: int) -> bool:
    """Whether a CUDA launch of ``kernel`` (``v2`` or ``v2tc``) of ``ctas`` CTAs, each
    streaming at most ``chunk_tokens`` tokens, compiles with ``row_hint``: where the
    128-byte hint overruns a 16-bit K/V row (head_dim 96), once the launch streams long
    enough that a neighbouring head's CTA no longer finds the over-fetched bytes in L2
    (``ROW_HINT_V2_CTAS``, ``ROW_HINT_TOKENS``, ``ROW_HINT_TC_TOKENS``,
    ``ROW_HINT_TC_MIN_TOKENS``). fp8 rows keep the 128-byte hint, which was faster at
    every measured Phi-3-mini cell (S34-R4)."""
    if kernel not in GRID_ORDER_KERNELS or not _hint_overruns_16_bit_row(kv_dtype, head_dim):
        return False
    many = ctas >= ROW_HINT_V2_CTAS or (2 * ctas >= ROW_HINT_V2_CTAS
                                        and chunk_tokens >= ROW_HINT_TOKENS)
    if kernel == "v2tc":
        return chunk_tokens >= ROW_HINT_TC_TOKENS or (
            many and chunk_tokens >= ROW_HINT_TC_MIN_TOKENS)
    return many


def _hint_overruns_16_bit_row(kv_dtype: str, head_dim: int) -> bool:
    """Whether ``L2_PREFETCH`` overruns a 16-bit K/V row (head_dim 96): where
    ``row_hint_pays`` can choose the row hint (the row's bytes first: they are cached, and
    most rows are divided)."""
    return (_row_bytes(head_dim, kv_dtype) % L2_PREFETCH != 0
            and itemsize(kv_dtype) == 2)


def _v2tc_q_dtype(kv_dtype: str, q_dtype: str | None) -> str:
    """q's dtype of a v2tc specialization: ``q_dtype``, or the pools' own for 16-bit pools
    (fp8 pools must name it)."""
    if q_dtype is None:
        if kv_dtype in V2TC_FP8:
            raise ValueError(f"v2tc over {kv_dtype} pools needs q_dtype (float16 or bfloat16)")
        return kv_dtype
    return q_dtype


def v2tc_spec(kv_dtype: str, out_dtype: str, head_dim: int, page_size: int, *,
              q_dtype: str | None = None, soft_cap: bool = False,
              sink: bool = False, merged_dtype: str = "", row_hint: bool = False,
              cluster: int = 0) -> KernelSpec:
    """The tensor-core v2 partial (``kernels/decode_v2_tc.py``); q has the pools' dtype
    unless ``q_dtype`` says otherwise (fp8 pools: q float16 or bfloat16). ``soft_cap`` /
    ``sink`` / ``row_hint`` specialize it as they do the v2 partial (``v2_spec``).
    ``merged_dtype``: the fused merge's output dtype (CUDA; ``out_dtype`` is then float32,
    and ``sink`` is the merge's sink, not the partial's). ``cluster`` (with
    ``merged_dtype``): the fused merge runs within thread-block clusters of that many CTAs
    (``CLUSTER_SIZES``), each one request's chunks (``launches.cluster_merge_size``)."""
    if merged_dtype and out_dtype != "float32":
        raise ValueError(f"v2tc_spec: a fused merge reads float32 partials, not {out_dtype}")
    if cluster and (not merged_dtype or cluster not in CLUSTER_SIZES):
        raise ValueError(f"v2tc_spec: cluster must be 0 or, with merged_dtype, one of "
                         f"{CLUSTER_SIZES}; got {cluster} (merged_dtype {merged_dtype!r})")
    warps = v2tc_warps(head_dim, kv_dtype)
    return KernelSpec("v2tc", out_dtype, head_dim, _v2tc_q_dtype(kv_dtype, q_dtype), kv_dtype,
                      page_size, 0, warps, v2tc_stages(head_dim, warps, kv_dtype),
                      soft_cap=soft_cap, sink=sink, merged_dtype=merged_dtype,
                      row_hint=row_hint, cluster=cluster)


def v2tc_metal_spec(kv_dtype: str, out_dtype: str, head_dim: int, page_size: int,
                    group: int, *, q_dtype: str | None = None, soft_cap: bool = False,
                    sink: bool = False) -> KernelSpec:
    """The Metal dialect of the tensor-core v2 partial (``simdgroup_matrix``) for a GQA
    group of ``group`` heads: ``heads_per_cta`` is its query rows per threadgroup (8 or
    16, ``decode_v2_tc.metal_rows``), ``num_warps`` its SIMD groups
    (``decode_v2_tc.metal_simdgroups``: what Metal's 32 KB of threadgroup memory holds),
    no ring depth (a fixed double buffer); ``q_dtype`` as for ``v2tc_spec`` (fp8 codes
    are widened into q's dtype as they are staged, so the memory is the same);
    ``soft_cap`` / ``sink`` as for ``v2tc_spec``."""
    return KernelSpec("v2tc", out_dtype, head_dim, _v2tc_q_dtype(kv_dtype, q_dtype), kv_dtype,
                      page_size, decode_v2_tc.metal_rows(group),
                      decode_v2_tc.metal_simdgroups(head_dim), soft_cap=soft_cap, sink=sink)


def decode_specs(q_dtype: str, kv_dtype: str, out_dtype: str, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int, *,
                 paths: tuple[str, ...] = ("v2", "v1", "v2tc"), soft_cap: bool = False,
                 sinks: bool = False, fused: bool = False, clusters: bool = False,
                 merge_splits: bool = False) -> list[KernelSpec]:
    """The CUDA-dialect specializations a one-token decode of this problem can launch on
    ``paths`` (``"v2"``, ``"v1"``, ``"v2tc"``; v2tc only where its dtypes and GQA group
    fit), whatever its plan, without duplicates: each split partial writing float32
    partials (no sink: merged partials never hold one) and writing the output, with and
    without ``row_hint`` where ``row_hint_pays`` can choose it; the merge; v1.
    ``soft_cap`` / ``sinks``: the call's variants. What a plan picks beyond that, for a
    backend that runs it: ``fused``, the tensor-core partial with its merge fused
    (``merged_dtype``); ``clusters``, that fused partial in clusters of each of
    ``CLUSTER_SIZES`` CTAs; ``merge_splits``, the merge at each split of
    ``kernels.merge.SPLITS`` whose shared sums fit. ``compile_ahead.kernel_specs`` says
    which a backend takes."""
    qh = heads_per_cta(num_qo_heads, num_kv_heads)
    # (output dtype, sink): the partial of a split plan, then the one writing the output
    ends = (("float32", False), (out_dtype, sinks))
    tc = ("v2tc" in paths and v2tc_fits(q_dtype, kv_dtype)
          and num_qo_heads // num_kv_heads <= V2TC_MAX_GROUP)
    hints = (False, True) if _hint_overruns_16_bit_row(kv_dtype, head_dim) else (False,)
    out: list[KernelSpec] = []
    if "v2" in paths:
        out += [v2_spec(q_dtype, kv_dtype, o, head_dim, page_size, qh, soft_cap=soft_cap,
                        sink=sk, row_hint=h) for o, sk in ends for h in hints]
    if "v2" in paths or tc:
        splits = [s for s in (merge.SPLITS if merge_splits else (1,))
                  if merge.split_fits(head_dim, s)]
        out += [merge_spec(out_dtype, head_dim, sink=sinks, split=s) for s in splits]
    if "v1" in paths:
        out.append(v1_spec(q_dtype, kv_dtype, out_dtype, head_dim, page_size,
                           soft_cap=soft_cap, sink=sinks))
    if tc:
        out += [v2tc_spec(kv_dtype, o, head_dim, page_size, q_dtype=q_dtype,
                          soft_cap=soft_cap, sink=sk, row_hint=h)
                for o, sk in ends for h in hints]
        if fused:
            out += [v2tc_spec(kv_dtype, "float32", head_dim, page_size, q_dtype=q_dtype,
                              soft_cap=soft_cap, sink=sinks, merged_dtype=out_dtype,
                              row_hint=h, cluster=k)
                    for h in hints for k in ((0, *CLUSTER_SIZES) if clusters else (0,))]
    return list(dict.fromkeys(out))


def append_spec(dtype: str, vector_bytes: int) -> KernelSpec:
    """The pool-append kernel (``kernels/append.py``) for pools of ``dtype``, moving words
    of ``vector_bytes``."""
    return KernelSpec("append", dtype, 0, vector_bytes=vector_bytes)


def append_fp8_spec(kv_dtype: str, row_dtype: str) -> KernelSpec:
    """The quantizing pool append (``kernels/append_fp8.py``): pools of fp8 format
    ``kv_dtype`` (``out_dtype``), rows of ``row_dtype`` (``q_dtype``)."""
    return KernelSpec("append_fp8", kv_dtype, 0, row_dtype)


def table_update_spec() -> KernelSpec:
    """The step-table update kernel (``kernels/table_update.py``): int32 buffers only."""
    return KernelSpec("table_update", "int32", 0)


def cuda_source(kernel: str) -> str:
    """The complete CUDA source holding ``kernel``'s template."""
    return kernel_def(kernel).cuda_source


def assert_compile_allowed(spec: KernelSpec) -> None:
    if env_flag(ASSERT_NO_COMPILE_ENV):
        raise UnexpectedCompileError(
            f"kernel {spec.uri} needs compiling but {ASSERT_NO_COMPILE_ENV} is set "
            "(warm the kernels up before the measured region)")
