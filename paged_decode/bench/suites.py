"""The cascade, forks and sparse benchmark suites: flat v2 against cascade over shared
prefixes (issue 6); flat decode over shared pages on every flat arm, ours and FlashInfer's,
beside cascade (``forks``: whether an arm reads pages shared by many requests from L2, issue
17); the dense masked path against fused sparse decode.

Cases run on the GPU with device-generated data; each arm is verified against the float64
oracle (requests 0 and B-1) before it is timed, and must run the path it stands for (an
arm that falls back is marked and its comparisons are withheld).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backends import Backend
from ..call import plan_decode
from ..cascade import plan_cascade
from ..decode import decode
from ..dtypes import itemsize, numpy_dtype
from ..page_table import PageTable
from ..reference import attention_f64, row_rel_error
from ..sparse import make_selection, sparse_decode
from .runner import TOLERANCE, BenchResult, _verify, fp8_pools, fp8_variants, time_arm, time_arms


@dataclass(frozen=True)
class CascadeCase:
    batch: int
    shared: int            # shared prefix tokens (whole pages)
    suffix: int = 256      # private tokens per request
    page_size: int = 16
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float16"
    kv_dtype: str = ""     # the pools' dtype when not ``dtype`` (fp8 formats; forks only)
    model: str = ""        # the models-preset layout of the heads ("": Llama-3-8B's)

    @property
    def label(self) -> str:
        heads = (f" {self.model} {self.num_qo_heads}/{self.num_kv_heads}x{self.head_dim}"
                 if self.model else "")
        return (f"cascade B{self.batch} shared{self.shared} suffix{self.suffix} "
                f"ps{self.page_size}{heads}"
                + (f" kv {self.kv_dtype}" if self.kv_dtype else ""))

    def row_bytes(self) -> int:
        """K and V bytes of one token over all KV heads."""
        return 2 * self.num_kv_heads * self.head_dim * itemsize(self.kv_dtype or self.dtype)

    def io_bytes(self) -> int:
        """What flat decode must read: every request's whole context."""
        return self.batch * (self.shared + self.suffix) * self.row_bytes()

    def cascade_bytes(self) -> int:
        """What cascade must read: the prefix once, the suffixes once."""
        return (self.shared + self.batch * self.suffix) * self.row_bytes()


@dataclass(frozen=True)
class SparseCase:
    batch: int
    context: int           # live tokens per request (= capacity)
    sparsity: int          # context / selected rows per (request, KV head)
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float16"

    @property
    def selected(self) -> int:
        return self.context // self.sparsity

    @property
    def label(self) -> str:
        return f"sparse B{self.batch} ctx{self.context} {self.sparsity}x ({self.selected} rows)"

    def row_bytes(self) -> int:
        return 2 * self.head_dim * (4 if self.dtype == "float32" else 2)

    def io_bytes(self) -> int:
        """What the dense masked path reads: the whole live window."""
        return self.batch * self.num_kv_heads * self.context * self.row_bytes()

    def fused_bytes(self) -> int:
        return self.batch * self.num_kv_heads * self.selected * self.row_bytes()


SUITES: dict[str, Callable[[], list[Any]]] = {
    "cascade": lambda: [CascadeCase(b, s) for s, b in
                        itertools.product([2048, 8192, 32768], [4, 8, 32, 128])],
    # where cascade starts to pay (the automatic rule and detection thresholds)
    "cascade-rule": lambda: [CascadeCase(b, s) for s, b in
                             itertools.product([128, 256, 512, 1024, 2048],
                                               [2, 4, 8, 16, 32, 64, 128])],
    # flat decode over pages every request shares (#17's 32 forks of one 8K prompt, and
    # engine-step-sized batches over 1K-2K prompts): every flat arm beside cascade
    "forks": lambda: [CascadeCase(b, s) for s, b in
                      ((8192, 32), (8192, 8), (1024, 64), (1024, 128), (2048, 128))],
    "sparse": lambda: [SparseCase(4, c, x) for c, x in
                       itertools.product([4096, 16384, 65536], [2, 4, 8, 16, 32])],
}


def _random(be: Backend, shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    xp = be.array_module()
    return xp.random.default_rng(seed).standard_normal(shape, dtype=xp.float32).astype(
        numpy_dtype(dtype))


def cascade_problem(be: Backend, case: CascadeCase) -> tuple[Any, Any, Any, PageTable]:
    """``(q, k_pages, v_pages, table)`` of a case on ``be``: every request shares the
    ``case.shared`` prefix pages and owns ``case.suffix`` private tokens; pools
    ``[num_pages, page_size, Hkv, D]`` of ``case.dtype``, or fp8 (``case.kv_dtype``,
    ``runner.fp8_pools``, scales ``runner.fp8_variants``)."""
    p = case.page_size
    n_shared, n_priv = case.shared // p, -(-case.suffix // p)
    num_pages = n_shared + case.batch * n_priv
    rows = [np.concatenate([np.arange(n_shared), n_shared + r * n_priv + np.arange(n_priv)])
            for r in range(case.batch)]
    lpl = case.suffix - (n_priv - 1) * p
    table = PageTable.build(np.concatenate(rows), np.arange(case.batch + 1) * (n_shared + n_priv),
                            [lpl] * case.batch, page_size=p, num_pages=num_pages)
    shape = (num_pages, p, case.num_kv_heads, case.head_dim)
    if case.kv_dtype:
        k, v = fp8_pools(be, shape, case.kv_dtype, 1)
    else:
        k, v = _random(be, shape, case.dtype, 1), _random(be, shape, case.dtype, 2)
    q = _random(be, (case.batch, case.num_qo_heads, case.head_dim), case.dtype, 3)
    return q, k, v, table


#: the forks suite's flat arms (``bench.arms``) beside its cascade arm
FORK_ARMS = ("v2", "v2tc", "flashinfer", "flashinfer-tc")


def bench_forks(be: Backend, case: CascadeCase, *, warmup: int, reps: int,
                cold_l2: bool | str, graph: bool = True) -> BenchResult:
    """Every flat arm of ``FORK_ARMS`` (each on its own plan of the flat table) and cascade,
    on one case; each verified against the oracle before it is timed. An arm that cannot
    run here is reported unverified with the reason."""
    q, k, v, table = cascade_problem(be, case)
    geo = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    vk = fp8_variants(case.kv_dtype) if case.kv_dtype else {}
    with be.launch_context(q):
        plan = plan_decode(table, *geo, device=be.device_info(), path="v2",
                           kv_dtype=case.kv_dtype or None)
        cplan = plan_cascade(table, *geo, device=be.device_info(), min_shared_pages=1)
    arms = time_arms(be, FORK_ARMS, q, k, v, table, plan, 1.0 / float(np.sqrt(case.head_dim)),
                     case.io_bytes(), TOLERANCE[case.dtype], vk or None, warmup=warmup,
                     reps=reps, cold_l2=cold_l2, graph=graph)
    with be.launch_context(q):
        out = be.empty(tuple(q.shape), case.dtype)
    arms["cascade"] = time_arm(
        be, "cascade",
        lambda: decode(q, k, v, table, out=out, cascade=cplan, backend=be, **vk),
        lambda: _verify(be, out, q, k, v, table, vk or None), case.cascade_bytes(),
        TOLERANCE[case.dtype], ("cascade",), warmup=warmup, reps=reps, cold_l2=cold_l2,
        graph=graph)
    return BenchResult(case, plan.num_chunks, plan.pages_per_chunk, arms)


def bench_cascade(be: Backend, case: CascadeCase, *, warmup: int, reps: int,
                  cold_l2: bool | str, graph: bool = True) -> BenchResult:
    q, k, v, table = cascade_problem(be, case)
    geo = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    with be.launch_context(q):
        flat_plan = plan_decode(table, *geo, device=be.device_info(), path="v2")
        dev = be.device_info()
        cplan = plan_cascade(table, *geo, device=dev, min_shared_pages=1)
        cplan_v2 = (plan_cascade(table, *geo, device=dev, min_shared_pages=1, level0="v2")
                    if dev.prefix_tile_rows else None)
        out = be.empty(tuple(q.shape), case.dtype)
    calls = {"flat": (lambda: decode(q, k, v, table, flat_plan, out=out, cascade=False,
                                     backend=be), case.io_bytes(), ("v2", "v2+merge")),
             "cascade": (lambda: decode(q, k, v, table, out=out, cascade=cplan, backend=be),
                         case.cascade_bytes(), ("cascade",))}
    if cplan_v2 is not None:   # level 0 on the v2 partial over stacked queries (comparison)
        calls["cascade-v2"] = (lambda: decode(q, k, v, table, out=out, cascade=cplan_v2,
                                              backend=be), case.cascade_bytes(), ("cascade",))
    arms = {name: time_arm(be, name, call, lambda: _verify(be, out, q, k, v, table), nbytes,
                           TOLERANCE[case.dtype], expected, warmup=warmup, reps=reps,
                           cold_l2=cold_l2, graph=graph)
            for name, (call, nbytes, expected) in calls.items()}
    return BenchResult(case, flat_plan.num_chunks, flat_plan.pages_per_chunk, arms)


def bench_sparse(be: Backend, case: SparseCase, *, warmup: int, reps: int,
                 cold_l2: bool | str, graph: bool = True) -> BenchResult:
    b, hkv, d = case.batch, case.num_kv_heads, case.head_dim
    rng = np.random.default_rng(4)
    pos = np.stack([np.stack([np.sort(rng.choice(case.context, case.selected, replace=False))
                              for _ in range(hkv)]) for _ in range(b)]).astype(np.int32)
    sel = make_selection(pos)
    shape = (b, hkv, case.context, d)
    k, v = _random(be, shape, case.dtype, 5), _random(be, shape, case.dtype, 6)
    q = _random(be, (b, case.num_qo_heads, d), case.dtype, 7)
    live = np.full(b, case.context)
    holder: dict[str, Any] = {}

    def run(min_sparsity: float) -> Any:
        holder["out"] = sparse_decode(q, k, v, sel, live_lens=live, min_sparsity=min_sparsity,
                                      backend=be)
        return holder["out"]

    def verify() -> float:
        g = case.num_qo_heads // hkv
        got, qn = be.to_numpy(holder["out"]), be.to_numpy(q)
        worst = 0.0
        for r in sorted({0, b - 1}):
            kk = be.to_numpy(k[r]).astype(np.float64)
            vv = be.to_numpy(v[r]).astype(np.float64)
            for h in range(hkv):
                rows = pos[r, h]
                ref, _ = attention_f64(qn[r, h * g:(h + 1) * g].astype(np.float64),
                                       kk[h, rows][:, None, :], vv[h, rows][:, None, :],
                                       1.0 / np.sqrt(d))
                worst = max(worst, row_rel_error(got[r, h * g:(h + 1) * g], ref))
        return worst

    calls = {"masked": (lambda: run(1e12), case.io_bytes(), ("sparse-masked",)),
             "fused": (lambda: run(0.0), case.fused_bytes(), ("sparse",))}
    arms = {name: time_arm(be, name, call, verify, nbytes, TOLERANCE[case.dtype], expected,
                           warmup=warmup, reps=reps, cold_l2=cold_l2, graph=graph)
            for name, (call, nbytes, expected) in calls.items()}
    return BenchResult(case, 0, 1, arms)


#: the suites whose cases take fp8 pools (``run_suite``'s ``kv_dtype``)
FP8_SUITES = ("forks",)
#: the suites whose cases take another layout's heads (``run_suite``'s ``model``)
MODEL_SUITES = ("cascade", "cascade-rule", "forks")


def with_model(case: CascadeCase, model: str) -> CascadeCase:
    """``case`` with the heads of models-preset layout ``model`` (``cases.MODELS``)."""
    from .cases import MODELS
    if model not in MODELS:
        raise ValueError(f"bench: model must be one of {', '.join(MODELS)}, got {model!r}")
    hq, hkv, d = MODELS[model]
    return dataclasses.replace(case, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                               model=model)


def suite_cases(name: str, kv_dtype: str = "", model: str = "") -> list[Any]:
    """The cases of suite ``name`` (``"cascade"``, ``"cascade-rule"``, ``"forks"`` or
    ``"sparse"``); ``kv_dtype`` (an fp8 format, suites of ``FP8_SUITES``): their pools in
    it; ``model`` (a ``cases.MODELS`` layout, suites of ``MODEL_SUITES``): their heads that
    layout's."""
    if name not in SUITES:
        raise ValueError(f"bench: suite must be one of decode, {', '.join(SUITES)}, "
                         f"got {name!r}")
    if kv_dtype and name not in FP8_SUITES:
        raise ValueError(f"bench: kv_dtype applies to the {', '.join(FP8_SUITES)} suite, "
                         f"not {name!r}")
    if model and name not in MODEL_SUITES:
        raise ValueError(f"bench: model applies to the {', '.join(MODEL_SUITES)} suites, "
                         f"not {name!r}")
    cases = SUITES[name]()
    if kv_dtype:
        cases = [dataclasses.replace(c, kv_dtype=kv_dtype) for c in cases]
    if model:
        cases = [with_model(c, model) for c in cases]
    return cases


def run_suite(name: str, be: Backend, *, warmup: int = 5, reps: int = 30,
              cold_l2: bool | str = True, graph: bool = True,
              progress: Any = None, kv_dtype: str = "", model: str = "") -> list[BenchResult]:
    """All cases of suite ``name`` on ``be`` (``suite_cases``: ``kv_dtype``, ``model``)."""
    cases = suite_cases(name, kv_dtype, model)
    by_suite: dict[str, Callable[..., BenchResult]] = {"sparse": bench_sparse,
                                                        "forks": bench_forks}
    fn = by_suite.get(name, bench_cascade)
    results = []
    for case in cases:
        r = fn(be, case, warmup=warmup, reps=reps, cold_l2=cold_l2, graph=graph)
        results.append(r)
        if progress:
            progress(r)
    return results
