"""Compiling a decode's kernels before it serves: ``compile_ahead`` and
``DecodeStep.compile_ahead``.

Some specializations are chosen per plan, at run time: the partials' L2 row hint (by the
grid), whether the tensor-core partial fuses its merge and in clusters of how many CTAs
(by the chunks per request), the merge's split (by its size), the append's word width (by
the arrays' addresses). A serving loop whose batch and contexts move meets new ones as it
goes, and the first launch of each compiles it inside a decode step (and raises under
``PAGED_DECODE_ASSERT_NO_COMPILE``). ``kernel_specs`` lists every specialization a
one-token decode of a geometry, its appends and its step-table updates can launch on a
backend, whatever the plans and the ``PAGED_DECODE_*`` kernel settings; ``compile_ahead``
compiles them. The settings that change a specialization's code (``PAGED_DECODE_STAGES``,
the L2 prefetch settings) must be the serving process's when it runs. Multi-token,
cascade and sparse decodes launch kernels of their own (a folded group, stacked members,
page size 1, gathering merges): ``query_tokens``, ``cascade`` and ``sparse`` add them.
A ``decode(..., path="auto")`` without a plan runs cascade by itself where a table's
requests share a prefix, so a process that serves such calls names ``cascade=True``.

Backends: ``cuda`` (NVRTC through CuPy, which also keeps a disk cache across processes)
and ``emulated-cuda`` compile ahead (``Backend.compiles_ahead``). MLX has no compile-only
call, so ``metal`` (and ``emulated-metal``, as it) compiles each kernel at its first call;
``reference`` and ``mlx`` run no kernels of ours. There ``compile_ahead`` compiles nothing
and says so in its report.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from .backends import Backend, get_backend
from .backends.base import Problem
from .dtypes import KV_DTYPES, SUPPORTED, check_dtype, itemsize
from .errors import InvalidArgumentError, UnsupportedProblemError, check_bool, check_int
from .fp8 import is_fp8
from .kernels import merge
from .kernels.append import word_widths
from .multitoken import MAX_QUERY_TOKENS
from .plan import check_geometry
from .specs import (
    KernelSpec,
    append_fp8_spec,
    append_spec,
    decode_specs,
    heads_per_cta,
    merge_spec,
    prefix_fits,
    prefix_spec,
    table_update_spec,
)

#: the paths ``kernel_specs`` lists kernels for (``decode``'s launch paths)
AHEAD_PATHS = ("v2", "v2tc", "v1")


@dataclass(frozen=True)
class AheadReport:
    """What ``compile_ahead`` did: ``specs``, the URIs of the specializations it made
    ready (compiled now, or already compiled in this process); ``seconds``, the wall time;
    ``note``, why nothing was compiled on a backend that compiles at first use ("" where
    it compiled)."""

    backend: str
    specs: tuple[str, ...]
    seconds: float
    note: str = ""


def _checked(fn: str, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             kv_dtype: str, q_dtype: str | None, out_dtype: str | None,
             paths: Sequence[str] | None, logits_soft_cap: bool, sinks: bool,
             appends: bool, query_tokens: int, cascade: bool,
             sparse: bool) -> tuple[str, str, str, tuple[str, ...] | None, bool, bool]:
    """The arguments of ``kernel_specs`` / ``compile_ahead`` checked (errors name ``fn``):
    ``(q, kv, out, paths, soft_cap, sinks)`` with the dtypes' canonical names."""
    check_geometry(fn, num_qo_heads, num_kv_heads, head_dim)
    check_int(fn, "page_size", page_size)
    kv = check_dtype(fn, "kv_dtype", kv_dtype, KV_DTYPES)
    if q_dtype is None:
        if is_fp8(kv):
            raise InvalidArgumentError(f"{fn}: q_dtype must be given for {kv} pools "
                                       "(float16 or bfloat16 queries), got None")
        q_dtype = kv
    q = check_dtype(fn, "q_dtype", q_dtype)
    out = check_dtype(fn, "out_dtype", out_dtype or q)
    if paths is not None and (isinstance(paths, str)
                              or not all(p in AHEAD_PATHS for p in paths)):
        raise InvalidArgumentError(f"{fn}: paths must be a sequence of "
                                   f"{', '.join(AHEAD_PATHS)}, got {paths!r}")
    soft_cap = check_bool(fn, "logits_soft_cap", logits_soft_cap)
    with_sinks = check_bool(fn, "sinks", sinks)
    check_bool(fn, "appends", appends)
    check_int(fn, "query_tokens", query_tokens, 1, MAX_QUERY_TOKENS)
    check_bool(fn, "cascade", cascade)
    check_bool(fn, "sparse", sparse)
    return q, kv, out, None if paths is None else tuple(paths), soft_cap, with_sinks


def kernel_specs(backend: str | Backend | None = None, *, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, page_size: int, kv_dtype: str,
                 q_dtype: str | None = None, out_dtype: str | None = None,
                 paths: Sequence[str] | None = None, logits_soft_cap: bool = False,
                 sinks: bool = False, appends: bool = True, query_tokens: int = 1,
                 cascade: bool = False, sparse: bool = False,
                 fn: str = "kernel_specs") -> list[KernelSpec]:
    """Every specialization ``backend`` can launch for a one-token decode of this
    geometry (``Hq / Hkv`` heads of ``head_dim``, pages of ``page_size`` tokens, pools of
    ``kv_dtype``), whatever the plan: on each of ``paths`` (default: those of
    ``AHEAD_PATHS`` the backend supports for the problem), with the variants named
    (``logits_soft_cap``, ``sinks``: whether the calls pass them), and with ``appends``
    the pool appends (every word width the row allows; an fp8 pool's quantizing append
    from rows of each float dtype) and the step-table update. ``q_dtype`` defaults to the
    pools' dtype (fp8 pools: it must be named, float16 or bfloat16); ``out_dtype`` to
    ``q_dtype``. Only for a backend that ``compiles_ahead`` (CUDA-dialect kernels).

    The calls beyond one-token flat decodes, each adding its own kernels:
    ``query_tokens`` (1-8): multi-token decodes of up to that many query tokens per
    request (``qo_indptr`` or ``q [B, T, Hq, D]``) on the same paths; ``cascade``: cascade
    decodes (the v2 partial over stacked members, the tensor-core prefix kernel where it
    runs, the gathering merge); ``sparse``: ``sparse_decode`` over dense caches of these
    heads (page size 1 whatever ``page_size`` says; nothing where the backend runs its
    dense masked path instead)."""
    be = get_backend(backend, fn=fn)
    q, kv, out, asked, soft_cap, with_sinks = _checked(
        fn, num_qo_heads, num_kv_heads, head_dim, page_size, kv_dtype, q_dtype, out_dtype,
        paths, logits_soft_cap, sinks, appends, query_tokens, cascade, sparse)
    if not be.compiles_ahead:
        raise InvalidArgumentError(f"{fn}: backend {be.name!r} compiles its kernels at first "
                                   "use (nothing to list ahead); cuda and emulated-cuda do")

    def runs(path: str, heads: int, kv_heads: int = num_kv_heads,
             page: int = page_size) -> bool:
        return bool(be.supports(Problem(q, kv, heads, kv_heads, head_dim, page, path)))

    support = {p: be.supports(Problem(q, kv, num_qo_heads, num_kv_heads, head_dim, page_size,
                                       p)) for p in AHEAD_PATHS}
    chosen = tuple(p for p in AHEAD_PATHS if support[p]) if asked is None else asked
    if not chosen:
        raise UnsupportedProblemError(
            f"{fn}: backend {be.name!r} runs no decode path for {q} queries over {kv} pools "
            f"at {num_qo_heads}/{num_kv_heads} heads x {head_dim}, page size {page_size}: "
            f"{support['v2'].reason}")
    refused = [p for p in chosen if not support[p]]
    if refused:
        raise InvalidArgumentError(f"{fn}: backend {be.name!r} cannot run path "
                                   f"{refused[0]!r} for {q} queries over {kv} pools at "
                                   f"{num_qo_heads}/{num_kv_heads} heads x {head_dim}")
    plans = dict(soft_cap=soft_cap, fused=be.tensor_core_decode, clusters=be.runs_clusters(),
                 merge_splits=True)
    specs = decode_specs(q, kv, out, num_qo_heads, num_kv_heads, head_dim, page_size,
                         paths=chosen, sinks=with_sinks, **plans)
    splits = [s for s in merge.SPLITS if merge.split_fits(head_dim, s)]
    # the states merged by row index (multitoken_call, run_cascade), sinks added there
    gathered = [merge_spec(out, head_dim, gather=be.merge_gathers, sink=with_sinks, split=s)
                for s in splits]
    if query_tokens > 1:
        # the common pass folds up to T tokens into the group (fold 1 is the pieces pass);
        # every pass writes float32 states without sinks
        for fold in range(1, query_tokens + 1):
            on = tuple(p for p in chosen if runs(p, num_qo_heads * fold))
            specs += decode_specs(q, kv, "float32", num_qo_heads * fold, num_kv_heads,
                                  head_dim, page_size, paths=on, **plans)
        specs += gathered
    if cascade and runs("v2", num_qo_heads):
        # level 1, and level 0 over M stacked members (M * Hq heads, any M): the v2
        # partial at each CTA width M * G can give, in float32 states
        g = num_qo_heads // num_kv_heads
        widths: dict[int, int] = {}       # CTA width -> the fewest members giving it
        for m in range(1, 841):            # 840 = lcm(1..8): every width there is
            widths.setdefault(heads_per_cta(m * g, 1), m)
        for m in sorted(widths.values()):
            if runs("v2", m * num_qo_heads):
                specs += [s for s in decode_specs(q, kv, "float32", m * num_qo_heads,
                                                  num_kv_heads, head_dim, page_size,
                                                  paths=("v2",), **plans) if s.kernel == "v2"]
        if not soft_cap and be.device_info().prefix_tile_rows and prefix_fits(q, kv):
            specs.append(prefix_spec(kv, head_dim, page_size))
        specs += gathered
    if sparse and runs("v2", num_qo_heads // num_kv_heads, 1, 1):
        # heads folded into requests (one KV head of G query heads), page size 1; with
        # sinks the output stays float32 until they join it outside the kernels
        specs += decode_specs(q, kv, "float32" if with_sinks else out,
                              num_qo_heads // num_kv_heads, 1, head_dim, 1, paths=("v2",),
                              **plans)
    if appends:
        if is_fp8(kv):
            # rows of any float dtype (K and V rows of different dtypes go in float32)
            specs += [append_fp8_spec(kv, r) for r in SUPPORTED]
        else:
            specs += [append_spec(kv, w)
                      for w in word_widths(num_kv_heads * head_dim * itemsize(kv))]
        specs.append(table_update_spec())
    return list(dict.fromkeys(specs))


def compile_specs(backend: Backend, specs: Sequence[KernelSpec]) -> AheadReport:
    """Compile ``specs`` on ``backend`` (each not already compiled in this process), or,
    where the backend compiles at first use, nothing (the report's ``note`` says so)."""
    if not backend.compiles_ahead:
        why = ("it compiles each kernel at its first launch (MLX has no compile-only call)"
               if getattr(backend, "metal_dialect", False) else
               "it runs no kernels of this package")
        return AheadReport(backend.name, (), 0.0,
                           f"backend {backend.name!r}: nothing compiled ahead; {why}")
    t0 = time.perf_counter()
    for spec in specs:
        backend.precompile(spec)
    return AheadReport(backend.name, tuple(s.uri for s in specs), time.perf_counter() - t0)


def compile_ahead(backend: str | Backend | None = None, *, num_qo_heads: int,
                  num_kv_heads: int, head_dim: int, page_size: int, kv_dtype: str,
                  q_dtype: str | None = None, out_dtype: str | None = None,
                  paths: Sequence[str] | None = None, logits_soft_cap: bool = False,
                  sinks: bool = False, appends: bool = True, query_tokens: int = 1,
                  cascade: bool = False, sparse: bool = False,
                  fn: str = "compile_ahead") -> AheadReport:
    """Compile every kernel ``decode`` (and, with ``appends``, ``PagePool`` appends and
    ``DecodeStep``'s table updates; with ``query_tokens`` > 1, ``cascade`` or ``sparse``,
    those calls) can launch for this geometry on ``backend`` (``kernel_specs``'
    arguments), so that no later call compiles one. Returns an ``AheadReport``; on a
    backend that compiles at first use (metal, emulated-metal) or runs no kernels of ours
    (mlx, reference) it checks the arguments, compiles nothing and its ``note`` says
    why."""
    be = get_backend(backend, fn=fn)
    if not be.compiles_ahead:
        _checked(fn, num_qo_heads, num_kv_heads, head_dim, page_size, kv_dtype, q_dtype,
                 out_dtype, paths, logits_soft_cap, sinks, appends, query_tokens, cascade,
                 sparse)
        return compile_specs(be, ())
    return compile_specs(be, kernel_specs(
        be, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, kv_dtype=kv_dtype, q_dtype=q_dtype, out_dtype=out_dtype,
        paths=paths, logits_soft_cap=logits_soft_cap, sinks=sinks, appends=appends,
        query_tokens=query_tokens, cascade=cascade, sparse=sparse, fn=fn))
