"""The call layer: one validated decode call, from arguments to launches.

``decode``, ``prepare_decode`` and ``cascade_decode`` sit on top of this module; it sits
on top of the planner, the cascade levels and the backends, and imports none of the
entry points (no cycles). What a call goes through, in order:

1. ``check_call``: the arrays, table, path, scale, flags and variants (errors name the
   public function) -> ``CallArgs``; with a sliding window its table is the window's
   (``variants.window_table``), which every later step uses;
2. the plan: ``resolve_plan`` (a given plan checked against the table, or a fresh one for
   the arrays' device through ``plan_decode``);
3. the path: ``choose_path`` (``path="auto"``: the device's measured crossover table) or
   the cascade decision (``cascade_call``: ``cascade_policy.resolve_cascade``);
4. buffers: ``output_buffer`` (the caller's, checked, or fresh);
5. launches: ``run_path`` (v2 + merge, v1, gather) or ``cascade.run_cascade``.

Steps 1-5 run inside the backend's launch context for the call's arrays (the device and
stream of ``q``), which the entry points enter once per call.

``plan_decode`` (public) is here too: it resolves the device from a backend when none is
given, then runs the planner (``plan.make_plan``), which takes device facts as data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backends import Backend, Problem, c_contiguous, check_same_device, get_backend
from .cascade import TC_LEVEL0, V2_LEVEL0, tc_level0_applies
from .cascade_policy import resolve_cascade
from .crossover import measured_elsewhere, table_for
from .device import DeviceInfo
from .dtypes import caller_dtype, check_dtype, expect_dtype
from .errors import (
    UnsupportedProblemError,
    check_bool,
    check_choice,
    check_ndim,
    check_number,
    check_shape,
    check_type,
    check_writable,
    fail,
)
from .fp8 import is_fp8
from .multitoken import QueryTokens, check_query_tokens_arg, query_tokens
from .outcome import DecodeOutcome, record
from .page_table import PageTable
from .plan import MAX_CHUNKS, DecodePlan, check_geometry, make_plan
from .specs import plan_geometry
from .step_table import StepTable
from .variants import (
    PLAIN,
    Variant,
    check_path,
    check_pools_kv,
    check_variant,
    missing_variants,
    window_table,
)

#: a decode's table: the immutable host table, or a pool's device-resident step table
Table = PageTable | StepTable

PATHS = ("auto", "v2", "v2tc", "v1", "gather")
#: paths that run the split-KV partial (and the merge when the plan splits a request)
SPLIT_PATHS = ("v2", "v2tc")
#: paths whose prepared calls replay recorded launches (gather runs array ops)
LAUNCH_PATHS = ("v2", "v2tc", "v1")


def plan_decode(table: Table, num_qo_heads: int, num_kv_heads: int, head_dim: int, *,
                device: DeviceInfo | None = None, backend: str | Backend | None = None,
                target_ctas: int | None = None, pages_per_chunk: int | None = None,
                min_chunk_tokens: int | None = None, max_chunks: int = MAX_CHUNKS,
                ctas_per_chunk: int | None = None, headroom: int = 0,
                window_left: int = -1, ragged_split: float | None = None,
                query_tokens: int = 1, kv_dtype: str | None = None,
                path: str = "auto") -> DecodePlan:
    """Plan a split-KV decode of ``table`` (``plan.make_plan`` documents every argument);
    ``device`` defaults to the ``DeviceInfo`` of ``backend`` (see
    ``backends.get_backend``). ``window_left``: the sliding window the decode calls will
    use (the plan covers only the windows' pages; ``decode`` checks it matches).
    ``query_tokens``: the most query tokens per request of multi-token calls (1-8,
    ``docs/multi-token.md``); the plan serves calls with up to that many. ``kv_dtype``:
    the pools' dtype name (fp8 pools plan for more CTAs: ``DeviceInfo.fp8_ctas_per_unit``;
    ``None``: 16-bit pools).

    ``path``: the path the plan is for, which sets its CTAs per chunk (any plan runs on
    every path; a plan searched for another partial's geometry fills the device less
    well): ``"auto"``, the path ``decode(path="auto")`` takes for this table and pools on
    ``backend`` (its crossover table; queries in the pools' 16-bit dtype, float16 over fp8
    pools), ``"v2tc"`` the tensor-core partial's, ``"v2"``, ``"v1"`` or ``"gather"`` the
    v2 partial's. ``ctas_per_chunk``, when given, overrides it."""
    fn = "plan_decode"
    check_choice(fn, "path", path, PATHS)
    be = get_backend(backend, fn=fn) if device is None or path == "auto" else None
    if device is None:
        assert be is not None
        device = be.device_info()
    slots = 0
    if path in ("auto", "v2tc"):   # make_plan checks these too, after they are needed
        check_geometry(fn, num_qo_heads, num_kv_heads, head_dim)
        tokens = check_query_tokens_arg(fn, query_tokens)
        if kv_dtype is not None:
            check_type(fn, "kv_dtype", kv_dtype, str, "a dtype name or None")
        if path == "auto":
            assert be is not None
            check_type(fn, "table", table, (PageTable, StepTable), "a PageTable or StepTable")
            heads = tokens * num_qo_heads
            path = choose_path_at(be, table, heads // num_kv_heads, pool_paths(
                be, heads, num_kv_heads, head_dim, table.page_size, kv_dtype), kv_dtype)[0]
        geo = plan_geometry(path, num_qo_heads, num_kv_heads, head_dim, kv_dtype, device,
                            tokens)
        slots = geo["slots_per_unit"]
        if ctas_per_chunk is None:
            ctas_per_chunk = geo["ctas_per_chunk"]
    return make_plan(table, num_qo_heads, num_kv_heads, head_dim, device=device,
                     target_ctas=target_ctas, pages_per_chunk=pages_per_chunk,
                     min_chunk_tokens=min_chunk_tokens, max_chunks=max_chunks,
                     ctas_per_chunk=ctas_per_chunk, headroom=headroom,
                     window_left=window_left, ragged_split=ragged_split,
                     query_tokens=query_tokens, kv_dtype=kv_dtype, slots_per_unit=slots,
                     fn="plan_decode")


#: why ``path="auto"`` takes v2tc over fp8 pools wherever it runs (the crossover table's
#: cells are 16-bit pools): on the H200, e4m3fn pools at 32/8 x 128, batch 8-128 x 8K-32K,
#: v2tc took 0.29-0.47x v2's time (S11-R4, docs/benchmarks/h200-2026-12-02-s11.md)
FP8_AUTO = "auto: v2tc (fp8 pools: 2.2-3.4x faster than v2 on the H200, S11-R4)"


def choose_path(backend: Backend, table: Table, plan: DecodePlan,
                allowed: tuple[str, ...] = ("v2", "v1"),
                kv_dtype: str | None = None) -> tuple[str, str]:
    """The path ``path="auto"`` takes, and why (one place for the policy): the fastest
    path in ``allowed`` (those this call can run) at the nearest cell of the device's
    measured crossover table (``paged_decode.crossover``), v2 when the device has no
    table or the cell timed none of them; over fp8 pools (``kv_dtype``) v2tc wherever
    it is allowed (``FP8_AUTO``)."""
    return choose_path_at(backend, table, plan.num_qo_heads // plan.num_kv_heads, allowed,
                          kv_dtype)


def pool_paths(be: Backend, num_qo_heads: int, num_kv_heads: int, head_dim: int,
               page_size: int, kv_dtype: str | None, num_pages: int = 0) -> tuple[str, ...]:
    """The launch paths ``be`` runs for calls over pools of ``kv_dtype`` (``None``:
    float16) with queries in the pools' 16-bit dtype (float16 over fp8 pools): what
    ``path="auto"`` may take for an engine step or a plan made before its call; v2 when
    none (its checks then say why)."""
    kv = kv_dtype or "float16"
    q = "float16" if is_fp8(kv) else kv
    return tuple(p for p in LAUNCH_PATHS if be.supports(Problem(
        q, kv, num_qo_heads, num_kv_heads, head_dim, page_size, p, num_pages))) or ("v2",)


def choose_path_at(backend: Backend, table: Table, group: int,
                   allowed: tuple[str, ...] = ("v2", "v1"),
                   kv_dtype: str | None = None) -> tuple[str, str]:
    """``choose_path`` for a GQA group (query heads per KV head) without a plan."""
    single = backend.auto_path()  # a backend with one arm (MLX without Metal: gather)
    if single is not None:
        return single
    if kv_dtype is not None and is_fp8(kv_dtype) and "v2tc" in allowed:
        return "v2tc", FP8_AUTO
    dev = backend.device_info()
    name = dev.name
    xt = table_for(name, dev.arch)
    if xt is None:
        return "v2", f"auto: v2 (no crossover table for {name!r})"
    ctx = table.total_visible / max(1, table.batch_size)
    best, cell = xt.choose(table.batch_size, ctx, table.page_size, group, allowed)
    where = (f"the nearest measured cell (B{cell.batch} ctx{cell.context} ps{cell.page_size}"
             f" G{cell.group}) of {Path(xt.source).name}")
    if measured_elsewhere(xt, name):
        where += f", measured on {xt.device}, not on this {name}"
    if best is None:
        return "v2", f"auto: v2 (no path this call can run was timed at {where})"
    return best, f"auto: {best} was the fastest this call can run at {where}"


def runnable_paths(be: Backend, a: CallArgs, fold: int = 1,
                   paths: tuple[str, ...] = PATHS[1:]) -> tuple[str, ...]:
    """The paths of ``paths`` the crossover may pick for this call: those the backend
    supports for its geometry and dtypes (at ``a.hq`` query heads and, for a multi-token
    call's common pass, at ``fold x a.hq``) and that implement its variants (v2 when none
    does: its checks then name what is missing)."""
    heads = {a.hq, a.hq * fold}
    ok = tuple(p for p in paths if not missing_variants(p, a.variant)
               and all(be.supports(call_problem(a, p, h)) for h in heads))
    return ok or ("v2",)


@dataclass(frozen=True)
class CallArgs:
    """A validated decode call: backend arrays, geometry, dtypes, the scale and the
    variants. ``table`` is the one the kernels read: the call's, or its window table
    when ``variant.window_left >= 0``. A multi-token call (``tokens`` not ``None``,
    ``docs/multi-token.md``) has the flat ``q [N, Hq, D]`` and the call's own table (each
    token's window is applied by ``multitoken.split_tokens``, not by ``window_table``)."""

    q: Any
    k: Any
    v: Any
    table: Table      # a StepTable only for backends that launch our kernels
    b: int
    hq: int
    hkv: int
    d: int
    p: int
    q_dt: str
    kv_dt: str
    o_dt: str
    scale: float
    variant: Variant = PLAIN
    tokens: QueryTokens | None = None


def check_call(fn: str, be: Backend, q: Any, k_pages: Any, v_pages: Any, table: Table, *,
               path: str, sm_scale: float | None, out_dtype: str | None,
               return_lse: bool, window_left: Any = -1, logits_soft_cap: Any = None,
               sinks: Any = None, qo_indptr: Any = None, kv_dtype: Any = None,
               k_scale: Any = None, v_scale: Any = None) -> CallArgs:
    """Validate a decode call's arrays, table, path, scale, flags, variants (errors name
    ``fn``; ``variants.check_variant``; fp8 pools: ``variants.check_pools_kv``, and
    ``CallArgs.scale`` then holds the K scale) and query tokens (``q [B, T, Hq, D]``, or
    ``q [N, Hq, D]`` with ``qo_indptr [B+1]``: ``multitoken.query_tokens``). A
    ``StepTable`` is brought up to date here (on the call's stream); backends whose
    kernels do not read device tables get its host ``PageTable``."""
    qa, ka, va = (be.array_arg(fn, n, x) for n, x in (("q", q), ("k_pages", k_pages),
                                                        ("v_pages", v_pages)))
    check_type(fn, "table", table, (PageTable, StepTable), "a PageTable or StepTable")
    check_same_device(fn, be, (("q", qa), ("k_pages", ka), ("v_pages", va)))
    step = isinstance(table, StepTable)
    if isinstance(table, StepTable):
        table = step_table_arg(fn, be, table, qa)
    if len(qa.shape) == 4:
        check_ndim(fn, "q", qa.shape, 4, "[B, T, Hq, D]", "Hq D")
    elif len(qa.shape) != 3:
        raise fail(fn, f"q must be 3-D [B, Hq, D] (or [N, Hq, D] with qo_indptr) or 4-D "
                       f"[B, T, Hq, D], got shape {list(qa.shape)}")
    else:
        check_ndim(fn, "q", qa.shape, 3, "[B, Hq, D]", "Hq D")
    check_ndim(fn, "k_pages", ka.shape, 4, "[num_pages, P, Hkv, D]", "P Hkv D")
    tokens = query_tokens(fn, tuple(int(x) for x in qa.shape), qo_indptr, table.batch_size,
                          table.visible_lens)
    if tokens is not None and tokens.uniform:   # the flat view the kernels read
        qa = qa.reshape(tokens.num_tokens, *qa.shape[2:])
    hq, d = (int(x) for x in qa.shape[1:])
    b = table.batch_size
    num_pages, p, hkv, dk = (int(x) for x in ka.shape)
    if tokens is None:
        check_shape(fn, "q", qa.shape, (b, hq, dk), "[B, Hq, D]")
    else:
        check_shape(fn, "q", qa.shape, (tokens.num_tokens, hq, dk), "[N, Hq, D]")
    check_shape(fn, "v_pages", va.shape, ka.shape, "[num_pages, P, Hkv, D]")
    if p != table.page_size:
        raise fail(fn, f"k_pages page size (axis 1) must equal table.page_size = "
                       f"{table.page_size}, got {p}")
    if hq % hkv:
        raise fail(fn, f"q's heads must be a multiple of k_pages' KV heads, got Hq = {hq} "
                       f"and Hkv = {hkv}")
    if table.max_page_id >= num_pages:
        raise fail(fn, f"table references page {table.max_page_id}, but k_pages has only "
                       f"{num_pages} pages")
    for name, arr in (("q", qa), ("k_pages", ka), ("v_pages", va)):
        if not c_contiguous(arr):
            raise fail(fn, f"{name} must be C-contiguous (row-major)")
    q_dt = check_dtype(fn, "q", caller_dtype(q, be.dtype_of(qa)))
    kv_dt, kv = check_pools_kv(fn, be, (k_pages, v_pages), (ka, va), ("k_pages", "v_pages"),
                               kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    o_dt = check_dtype(fn, "out_dtype", q_dt if out_dtype is None else out_dtype)
    check_choice(fn, "path", path, PATHS)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else check_number(fn, "sm_scale", sm_scale)
    check_bool(fn, "return_lse", return_lse)
    variant = check_variant(fn, be, hq, window_left=window_left,
                            logits_soft_cap=logits_soft_cap, sinks=sinks, kv=kv)
    scale = variant.checked_score_scale(fn, scale)
    if step and variant.window_left >= 0:   # on every backend alike (some read its host view)
        raise UnsupportedProblemError(f"{fn}: window_left needs a PageTable; a StepTable (a "
                                      "pool's device-resident step table) is not windowed "
                                      "yet: pass its page_table()")
    if tokens is not None:
        return CallArgs(qa, ka, va, table, b, hq, hkv, d, p, q_dt, kv_dt, o_dt, scale,
                        variant, tokens)
    return CallArgs(qa, ka, va, window_table(table, variant.window_left, fn=fn), b, hq, hkv,
                    d, p, q_dt, kv_dt, o_dt, scale, variant)


def step_table_arg(fn: str, be: Backend, table: StepTable, q: Any) -> Table:
    """A step table as a call uses it: flushed, on this call's backend and device, as the
    table the backend's kernels read (its host view where they do not read device
    buffers)."""
    if table.backend is not be:
        raise fail(fn, f"table is a step table of a {table.backend.name!r} pool, but the "
                       f"call runs on backend {be.name!r}")
    check_same_device(fn, be, (("q", q), ("table (its device buffer)", table.buffer)))
    table.update_device()
    return table if be.reads_step_tables else table.page_table()


def host_table(table: Table) -> PageTable:
    """The host ``PageTable`` of a call's table (a step table's view)."""
    return table.page_table() if isinstance(table, StepTable) else table


def resolve_plan(fn: str, be: Backend, a: CallArgs, plan: DecodePlan | None,
                 path: str = "v2") -> DecodePlan:
    """``plan`` checked against the call, or a fresh plan for the call's device (for
    ``path="v2tc"`` searched for the tensor-core partial's CTAs per chunk; any plan of the
    table runs on either partial)."""
    w = a.variant.window_left
    if plan is None:   # a.table is already the window table: the plan records the window
        device = be.device_info()
        return make_plan(a.table, a.hq, a.hkv, a.d, device=device, window_left=w,
                         kv_dtype=a.kv_dt, fn=fn,
                         **plan_geometry(path, a.hq, a.hkv, a.d, a.kv_dt, device))
    check_type(fn, "plan", plan, DecodePlan, "a DecodePlan")
    plan.check(fn, a.table, a.hq, a.hkv, a.d, w)
    return plan


def flat_call(fn: str, be: Backend, a: CallArgs, plan: DecodePlan | None, path: str,
              out: Any, lse: Any, want_lse: bool) -> tuple[DecodePlan, str, str, Any, Any]:
    """The set-up of a flat (non-cascade) call, shared by ``decode`` and ``prepare_decode``:
    the plan (checked, or made for the path: with ``path="auto"`` the path is chosen
    first, so a plan for v2tc is searched for its CTAs per chunk, as the crossover table's
    v2tc cells were timed), the path and why, the support check, and the output
    buffers ``out [B, Hq, D]`` and ``lse [B, Hq]`` float32 (``None`` when the gather path
    needs no LSE). Returns ``(plan, path, reason, out, lse)``."""
    if a.b == 0:   # decode returns empty arrays (``_empty_batch``); no plan fits no requests
        raise fail(fn, "the table has no requests (B = 0): there is nothing to prepare")
    if path == "auto":
        if plan is None:   # the path first: a plan is then searched for its CTA geometry
            chosen, reason = choose_path_at(be, a.table, a.hq // a.hkv, runnable_paths(be, a),
                                            a.kv_dt)
            plan = resolve_plan(fn, be, a, None, chosen)
        else:
            plan = resolve_plan(fn, be, a, plan)
            chosen, reason = choose_path(be, a.table, plan, runnable_paths(be, a), a.kv_dt)
        check_support(fn, be, a, chosen)
    else:   # checked before planning: a v2tc plan is searched for that kernel's geometry
        check_support(fn, be, a, path)
        plan = resolve_plan(fn, be, a, plan, path)
        chosen, reason = path, "requested"
    check_path(fn, be.name, chosen, a.variant)
    out_a = output_buffer(fn, be, "out", out, (a.b, a.hq, a.d), a.o_dt)
    lse_a = output_buffer(fn, be, "lse", lse, (a.b, a.hq), "float32") \
        if want_lse or chosen != "gather" else None
    return plan, chosen, reason, out_a, lse_a


@dataclass(frozen=True)
class CascadeCall:
    """A cascade call set up for running: the ``CascadeDecodePlan``, the output buffers
    ``out [B, Hq, D]`` and ``lse [B, Hq]`` float32 (base 2), whether level 0 runs on the
    tensor-core prefix kernel, and the outcome a run records."""

    plan: Any
    out: Any
    lse: Any
    tensor_cores: bool
    outcome: DecodeOutcome


def cascade_call(fn: str, be: Backend, a: CallArgs, cascade: Any, path: str,
                 out: Any, lse: Any) -> tuple[CascadeCall | None, str | None]:
    """The set-up of a cascade call, shared by ``decode`` and ``prepare_decode``: whether
    to run cascade (``cascade_policy.resolve_cascade``), the support check of its level 0,
    the output buffers and the outcome. Returns ``(call or None, reason or None)``; with
    ``None`` the caller runs the flat decode and appends the reason to its own."""
    if isinstance(a.table, StepTable) and cascade is None:
        return None, "step table: cascade runs only when asked for (cascade=True)"
    cplan, why = resolve_cascade(fn, cascade, path, host_table(a.table), a.hq, a.hkv, a.d,
                                 be.device_info, (a.q_dt, a.kv_dt),
                                 tc_allowed=a.variant.soft_cap is None)
    if cplan is None:
        return None, why
    sup = be.supports(Problem(a.q_dt, a.kv_dt, a.hq * cplan.prefix.num_members, a.hkv, a.d,
                              a.p, "v2"))
    if not sup:
        raise UnsupportedProblemError(f"{fn}: backend {be.name!r} cannot run the cascade's "
                                      f"level 0: {sup.reason}")
    check_path(fn, be.name, "cascade", a.variant)
    out_a = output_buffer(fn, be, "out", out, (a.b, a.hq, a.d), a.o_dt)
    lse_a = output_buffer(fn, be, "lse", lse, (a.b, a.hq), "float32")
    tc = tc_level0_applies(be, cplan, a.q_dt, a.kv_dt, a.variant)
    level0 = TC_LEVEL0 if tc else V2_LEVEL0
    if not tc and a.variant.soft_cap is not None and tc_level0_applies(be, cplan, a.q_dt,
                                                                        a.kv_dt):
        level0 += " (the tensor-core prefix kernel has no logits soft cap)"
    if a.variant.kv is not None and be.device_info().prefix_tile_rows:
        level0 += " (the tensor-core prefix kernel reads 16-bit pools only)"
    detail = "; ".join(x for x in (f"{cplan.prefix.describe()}; level 0: {level0}",
                                   a.variant.describe()) if x)
    outcome = DecodeOutcome("cascade", be.name, a.b, a.table.total_visible,
                            cplan.num_partials, f"cascade: {why}", detail)
    return CascadeCall(cplan, out_a, lse_a, tc, outcome), why


def call_problem(a: CallArgs, path: str, num_qo_heads: int | None = None) -> Problem:
    """The ``Problem`` a backend's ``supports`` judges for call ``a`` on ``path`` (at
    ``num_qo_heads`` query heads: a multi-token pass's; default the call's)."""
    return Problem(a.q_dt, a.kv_dt, a.hq if num_qo_heads is None else num_qo_heads, a.hkv,
                   a.d, a.p, path, int(a.k.shape[0]))


def check_support(fn: str, be: Backend, a: CallArgs, path: str) -> None:
    sup = be.supports(call_problem(a, path))
    if not sup:
        raise UnsupportedProblemError(f"{fn}: backend {be.name!r} cannot run path {path!r}: "
                                      f"{sup.reason}")


def run_path(be: Backend, a: CallArgs, plan: DecodePlan, path: str, out_a: Any,
             lse_a: Any) -> str:
    """Launch ``path`` (``"v2"``, ``"v2tc"``, ``"v1"`` or ``"gather"``) into ``out_a`` /
    ``lse_a`` (inside the backend's launch context); returns the path that ran (a split
    path with ``"+merge"`` when the plan splits a request). Sinks enter once: in the merge
    of a split plan, else in the launch that writes the output (``check_path`` has refused
    variants on paths without them)."""
    vk = a.variant
    if path in SPLIT_PATHS:
        partial = be.partial_tc if path == "v2tc" else be.partial
        if plan.needs_merge:
            v_part, lse_part = be.workspace(plan)
            if path == "v2tc":                  # fused into one launch where it pays
                be.partial_tc_merged(a.q, a.k, a.v, a.table, plan, a.scale, v_part, lse_part,
                                     out_a, lse_a, **vk.kernel_kwargs(final=False),
                                     **vk.merge_kwargs())
                return f"{path}+merge"
            partial(a.q, a.k, a.v, a.table, plan, a.scale, v_part, lse_part,
                    **vk.kernel_kwargs(final=False))
            be.merge(v_part, lse_part, plan.o_indptr, out_a, lse_a, **vk.merge_kwargs())
            return f"{path}+merge"
        partial(a.q, a.k, a.v, a.table, plan, a.scale, out_a, lse_a,
                **vk.kernel_kwargs(final=True))
        return path
    if path == "v1":
        be.decode_v1(a.q, a.k, a.v, a.table, a.scale, out_a, lse_a,
                     **vk.kernel_kwargs(final=True))
        return "v1"
    be.gather_sdpa(a.q, a.k, a.v, host_table(a.table), a.scale, out_a, lse_a,
                   **vk.kernel_kwargs(final=True))
    return "gather"


def empty_batch(fn: str, be: Backend, a: CallArgs, plan: DecodePlan | None, path: str,
                 like: Any, out: Any, lse: Any, want_lse: bool, return_lse: bool,
                 lead: tuple[int, ...] = (0,)) -> Any:
    """A batch without requests: the checks a real call makes (a given plan, the path's
    support, the output buffers), then empty results ``[0, Hq, D]`` and ``[0, Hq]``
    (``[*lead, Hq, D]``: ``(0, T)`` for a multi-token ``q [0, T, Hq, D]``)."""
    if plan is not None:
        resolve_plan(fn, be, a, plan)
    check_support(fn, be, a, path)
    check_path(fn, be.name, path, a.variant)
    out_a = output_buffer(fn, be, "out", out, (*lead, a.hq, a.d), a.o_dt)
    lse_a = output_buffer(fn, be, "lse", lse, (*lead, a.hq), "float32") if want_lse \
        else None
    record(DecodeOutcome("empty", be.name, 0, 0, 0, "empty batch (B = 0): nothing to run"))
    return results(be, like, out, lse, out_a, lse_a, return_lse)


def results(be: Backend, q: Any, out: Any, lse: Any, out_a: Any, lse_a: Any,
             return_lse: bool) -> Any:
    result = returned(be, q, out, out_a)
    return (result, returned(be, q, lse, lse_a)) if return_lse else result


def returned(be: Backend, like: Any, given: Any, made: Any) -> Any:
    """What a call hands back for one output: the caller's ``given`` array, else the
    backend array ``made`` in the caller's array kind (``like``'s)."""
    return be.wrap_result(made, like=like) if given is None else given


def output_buffer(fn: str, be: Backend, name: str, given: Any, shape: tuple[int, ...],
                  dtype: str, dims: str | None = None) -> Any:
    """``given`` checked (shape, dtype, contiguity) as the backend's array, or a fresh one."""
    if given is None:
        return be.empty(shape, dtype)
    if be.functional_outputs and not be.owns(given):  # MLX: the result rebinds `given`
        raise fail(fn, f"{name} must be an array of backend {be.name!r} (it receives the "
                       f"result by rebinding), got {type(given).__module__}."
                       f"{type(given).__name__}")
    arr = be.array_arg(fn, name, given)
    here = be.current_device()          # inside the call's launch context: q's device
    if here is not None and be.device_of(arr) not in (None, here):
        raise fail(fn, f"{name} is on device {be.device_of(arr)}, but q is on device {here}: "
                       "every array of a call must be on one device")
    if dims is None:
        dims = "[B, Hq, D]" if len(shape) == 3 else "[B, Hq]"
    check_shape(fn, name, arr.shape, shape, dims)
    expect_dtype(fn, name, caller_dtype(given, be.dtype_of(arr)), dtype)   # the caller's name
    if not c_contiguous(arr):
        raise fail(fn, f"{name} must be C-contiguous")
    check_writable(fn, name, arr)
    return arr


__all__ = ["LAUNCH_PATHS", "PATHS", "SPLIT_PATHS", "CallArgs", "CascadeCall", "Table",
           "cascade_call", "check_call", "check_support", "choose_path", "choose_path_at",
           "empty_batch",
           "flat_call", "host_table", "output_buffer", "plan_decode", "resolve_plan",
           "results", "returned", "run_path", "step_table_arg"]
