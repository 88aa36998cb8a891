"""The correctness matrix behind ``paged-decode check``.

Every configuration builds a random problem (``problems.make_problem``: randomized
partial last pages, odd requests starting mid-page, physical pages shuffled out of a pool
with 2x slack), computes the float64 oracle once, then runs each path through
``decode(..., path=..., return_lse=True, out_dtype="float32")`` and compares:

- ``"v2"``: the plan the backend's device target gives (single chunk or merged);
- ``"v2-forced-merge"``: one page per chunk (or the smallest chunk the 65535-chunk grid
  bound allows), so the merge runs on every request with more than one page;
- ``"v2-single"``: one chunk per request, so the partial writes the output itself and no
  merge runs (a large device target rarely plans that for this matrix's batch sizes);
- ``"v1"`` and ``"gather"``: the comparison and fallback arms;
- ``"v2tc"`` and ``"v2tc-forced-merge"``: the tensor-core v2 partial with its own plan
  (``ctas_per_chunk`` of its geometry) and with one page per chunk; only on backends that
  run it (``Backend.tensor_core_decode``) and only for float16 / bfloat16 configurations
  (the report counts the runs each path made).

A result passes only when both errors are finite and within tolerance **and** the path
that actually ran (``last_outcome()``) is the one asked for. Errors are those of the
**float32** output (the kernels' accumulation before any rounding to a 16-bit output
dtype); a configuration's dtype is that of q and K/V, and every report labels it so.
Full matrix: head_dim {64, 128} x GQA {1, 4, 7, 8, 16} x page {16, 32, 64} x context
{512, 4096, 16384, 32768} x batch {1, 4, 8} = 360 configurations per dtype (4 KV heads).
The GQA axis holds every reduction path of the v2 partial: head transposition (1, 4, 8
heads per CTA), one butterfly per head (7) and two CTAs per KV head (16). The quick
matrix is a deterministic subset that covers every pair of axis values, every kernel
specialization (head_dim x GQA x page) and both extreme corners.
"""

from __future__ import annotations

import itertools
import math
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import json_text, problems, reference
from .backends import Backend, get_backend
from .call import plan_decode
from .decode import decode
from .errors import is_int
from .outcome import last_outcome
from .page_table import PageTable
from .plan import MAX_CHUNKS, DecodePlan, smallest_chunk_size
from .specs import V2TC_MAX_GROUP, v2tc_fits

HEAD_DIMS = (64, 128)
GQAS = (1, 4, 7, 8, 16)
PAGE_SIZES = (16, 32, 64)
CONTEXTS = (512, 4096, 16384, 32768)
BATCHES = (1, 4, 8)
AXES: dict[str, tuple[int, ...]] = {"head_dim": HEAD_DIMS, "gqa": GQAS,
                                    "page_size": PAGE_SIZES, "context": CONTEXTS,
                                    "batch": BATCHES}
#: the tensor-core v2 partial's paths (``Backend.tensor_core_decode``, 16-bit dtypes)
TC_PATHS = ("v2tc", "v2tc-forced-merge")
ALL_PATHS = ("v2", "v2-forced-merge", "v2-single", "v1", "gather", *TC_PATHS)
QUICK_SIZE = 24

# Max relative error on outputs, keyed by KV dtype. The oracle reads the same quantized
# inputs, so what remains is accumulation error (float32 on the reference backend: ~1e-6)
# plus whatever a GPU kernel rounds on the way (P rounded to the KV dtype before P.V:
# ~2^-11 relative for float16, ~2^-8 for bfloat16). The bound is 2e-2 for float16
# and bfloat16; float16 is held to 5e-3 here because its arithmetic allows it.
TOLERANCES = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}
# Max absolute LSE error, log2 units (LSEs here are ~10-20, where a float32 ulp is ~2e-6).
LSE_TOLERANCE = 2e-4


@dataclass(frozen=True)
class CheckConfig:
    """One configuration of the matrix (``num_qo_heads = gqa * num_kv_heads``)."""

    head_dim: int
    gqa: int
    page_size: int
    context: int
    batch: int
    num_kv_heads: int = 4
    q_dtype: str = "float16"
    kv_dtype: str = "float16"
    seed: int = 0

    @property
    def num_qo_heads(self) -> int:
        return self.gqa * self.num_kv_heads

    @property
    def label(self) -> str:
        dt = self.kv_dtype if self.q_dtype == self.kv_dtype else \
            f"q{self.q_dtype}-kv{self.kv_dtype}"
        return (f"D{self.head_dim}-G{self.gqa}-P{self.page_size}-ctx{self.context}"
                f"-B{self.batch}-{dt}")

    @property
    def spec(self) -> problems.ProblemSpec:
        return problems.ProblemSpec(self.batch, self.context, self.num_qo_heads,
                                    self.num_kv_heads, self.head_dim, self.page_size,
                                    self.q_dtype, self.kv_dtype, seed=self.seed)

    @property
    def cost(self) -> int:
        """Relative work (KV elements to generate and read); orders and picks configs."""
        return self.batch * self.context * self.num_kv_heads * self.head_dim


def tolerance(kv_dtype: str) -> float:
    return TOLERANCES[kv_dtype]


# ---------------------------------------------------------------------------- matrix
def _seed(values: Sequence[int]) -> int:
    """A stable seed per geometry (the same problem in every dtype)."""
    return zlib.crc32("-".join(str(v) for v in values).encode())


def _quick_points() -> list[tuple[int, ...]]:
    """Greedy covering of every value pair of every two axes and every kernel
    specialization (head_dim x GQA x page), seeded with the corners (ctx 32768, batch 8)
    and (ctx 512, batch 1); ties go to the cheaper point, then to product order; padded
    to ``QUICK_SIZE`` by covering (context, batch, page) triples."""
    names = list(AXES)
    cands = list(itertools.product(*AXES.values()))
    ci, bi = names.index("context"), names.index("batch")

    def cost(pt: tuple[int, ...]) -> int:
        return pt[ci] * pt[bi] * pt[names.index("head_dim")]

    def keys(pt: tuple[int, ...], groups: list[tuple[int, ...]]) -> set[tuple[Any, ...]]:
        return {(g, tuple(pt[i] for i in g)) for g in groups}

    pair_groups = list(itertools.combinations(range(len(names)), 2))
    spec_group = [tuple(names.index(n) for n in ("head_dim", "gqa", "page_size"))]
    pad_group = [tuple(names.index(n) for n in ("context", "batch", "page_size"))]
    primary = pair_groups + spec_group
    todo = set().union(*(keys(p, primary) for p in cands))
    chosen: list[tuple[int, ...]] = []

    def take(pool: list[tuple[int, ...]], groups: list[tuple[int, ...]],
             todo: set[tuple[Any, ...]]) -> None:
        best = max(pool, key=lambda p: (len(keys(p, groups) & todo), -cost(p)))
        chosen.append(best)
        cands.remove(best)
        todo -= keys(best, groups)

    for ctx, b in ((CONTEXTS[-1], BATCHES[-1]), (CONTEXTS[0], BATCHES[0])):
        take([p for p in cands if p[ci] == ctx and p[bi] == b], primary, todo)
    while todo:
        take(cands, primary, todo)
    pad = set().union(*(keys(p, pad_group) for p in cands)) - \
        set().union(*(keys(p, pad_group) for p in chosen))
    while len(chosen) < QUICK_SIZE and pad:
        take(cands, pad_group, pad)
    return chosen


def matrix(full: bool, dtypes: Iterable[str] = ("float16",)) -> list[CheckConfig]:
    """The configurations to check: ``full`` gives all 360 per dtype, otherwise the quick
    subset (about 30 per dtype). Ordered by dtype, then cheapest first (context, batch,
    ...), so ``max_configs`` and early progress lines take the small ones."""
    points = list(itertools.product(*AXES.values())) if full else _quick_points()
    names = list(AXES)
    out = []
    for dt in dtypes:
        cfgs = [CheckConfig(**dict(zip(names, pt)), q_dtype=dt, kv_dtype=dt,
                            seed=_seed(pt)) for pt in points]
        cfgs.sort(key=lambda c: (c.context, c.batch, c.page_size, c.gqa, c.head_dim))
        out.extend(cfgs)
    return out


# ---------------------------------------------------------------------------- results
@dataclass
class CheckResult:
    """One (configuration, path) check. The plan fields are ``None`` for v1 and gather."""

    config: CheckConfig
    path: str
    ran: str | None                 # last_outcome().path: "v2", "v2+merge", "v1", "gather"
    pages_per_chunk: int | None
    num_chunks: int | None
    num_ctas: int | None
    merged: bool | None
    max_rel_error: float
    lse_error: float
    tolerance: float
    passed: bool
    seconds: float
    error: str | None = None        # why it failed beyond the numbers

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.config.label
        return d             # a non-finite error is written null (json_text)


def format_result(r: CheckResult) -> str:
    """One line: label, path, plan, max rel err, LSE err, PASS/FAIL (and why)."""
    if r.pages_per_chunk is None:
        plan = "-"
    else:
        plan = (f"ppc={r.pages_per_chunk} chunks={r.num_chunks} ctas={r.num_ctas} "
                f"{'merge' if r.merged else 'single'}")
    line = (f"{r.config.label:<34} {r.path:<15} {plan:<40} rel(f32 out)="
            f"{r.max_rel_error:.2e} lse={r.lse_error:.2e}  {'PASS' if r.passed else 'FAIL'}")
    if not r.passed and r.error:
        line += f"  ({r.error})"
    return line


@dataclass
class CheckReport:
    """What ``run_check`` found on one backend: every (configuration, path)
    ``CheckResult``, the dtypes and paths run, and timings in seconds."""
    backend: str
    device: str
    full: bool
    dtypes: tuple[str, ...]
    paths: tuple[str, ...]
    results: list[CheckResult] = field(default_factory=list)
    #: dtypes asked for that no selected configuration has (``max_configs`` cut them)
    unreached: tuple[str, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)  # build, oracle, per path, total

    @property
    def failures(self) -> list[CheckResult]:
        """The results that did not pass."""
        return [r for r in self.results if not r.passed]

    @property
    def passed(self) -> bool:
        """Whether at least one check ran and none failed."""
        return bool(self.results) and not self.failures

    def summary(self) -> str:
        """A text report: per dtype and path the runs, failures, worst errors and
        seconds, then timings, up to 20 failures and a PASS/FAIL line."""
        n_cfg = len({(r.config.label) for r in self.results})
        lines = [f"paged-decode check on {self.backend} ({self.device}): "
                 f"{'full' if self.full else 'quick'} matrix, {n_cfg} configs x "
                 f"{len(self.paths)} paths, dtypes {', '.join(self.dtypes)}"
                 + (f" ({', '.join(self.unreached)} not reached within the configs "
                    "selected)" if self.unreached else ""),
                 "errors of float32 outputs against the float64 oracle ('dtype': q and "
                 "K/V)",
                 f"{'dtype':<9} {'path':<15} {'runs':>5} {'fail':>5} {'max rel err':>12} "
                 f"{'tol':>8} {'max lse err':>12} {'seconds':>8}"]
        for dt in self.dtypes:
            for p in self.paths:
                rs = [r for r in self.results if r.path == p and r.config.kv_dtype == dt]
                if not rs:
                    continue
                lines.append(
                    f"{dt:<9} {p:<15} {len(rs):>5} {sum(not r.passed for r in rs):>5} "
                    f"{max(r.max_rel_error for r in rs):>12.2e} {tolerance(dt):>8.0e} "
                    f"{max(r.lse_error for r in rs):>12.2e} {sum(r.seconds for r in rs):>8.1f}")
        lines.append(f"LSE tolerance {LSE_TOLERANCE:.0e} (absolute, log2 units)")
        t = self.timings
        if t:
            lines.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in t.items()))
        for r in self.failures[:20]:
            lines.append("FAIL " + format_result(r))
        if len(self.failures) > 20:
            lines.append(f"... and {len(self.failures) - 20} more failures")
        good = len(self.results) - len(self.failures)
        lines.append(f"{'PASS' if self.passed else 'FAIL'}: {good}/{len(self.results)} "
                     "checks passed")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (what ``to_json`` writes), every result included."""
        return {"backend": self.backend, "device": self.device, "full": self.full,
                "dtypes": list(self.dtypes), "paths": list(self.paths),
                "unreached_dtypes": list(self.unreached), "output_dtype": "float32",
                "tolerances": {**TOLERANCES, "lse": LSE_TOLERANCE},
                "passed": self.passed, "num_failures": len(self.failures),
                "timings": self.timings, "results": [r.to_dict() for r in self.results]}

    def to_json(self, indent: int | None = 2) -> str:
        """``to_dict`` as strict JSON text (a non-finite error is written ``null``)."""
        return json_text.dumps(self.to_dict(), indent=indent)


# ---------------------------------------------------------------------------- running
def forced_merge_ppc(table: PageTable) -> int:
    """Pages per chunk for the forced-merge arm: 1, or the smallest the grid bound allows."""
    return smallest_chunk_size(table.pages_per_request, MAX_CHUNKS)


def default_paths(be: Backend) -> tuple[str, ...]:
    """The paths ``paged-decode check`` runs on ``be`` by default: every one, less the
    tensor-core paths on a backend without the tensor-core partial."""
    return tuple(p for p in ALL_PATHS if be.tensor_core_decode or p not in TC_PATHS)


def path_applies(path: str, cfg: CheckConfig) -> bool:
    """Whether ``path`` runs for ``cfg`` (the tensor-core paths: 16-bit q and pools of one
    dtype, at most 32 query heads per KV head)."""
    return path not in TC_PATHS or (v2tc_fits(cfg.q_dtype, cfg.kv_dtype)
                                    and cfg.gqa <= V2TC_MAX_GROUP)


def _plan_for(path: str, be: Backend, cfg: CheckConfig, table: PageTable,
              auto: DecodePlan) -> DecodePlan:
    if path in ("v2-forced-merge", "v2tc-forced-merge"):
        ppc = forced_merge_ppc(table)
    elif path == "v2-single":
        ppc = max(1, int(table.pages_per_request.max()))
    elif path == "v2tc":    # its own plan (the wave rule where the device calibrates it)
        return plan_decode(table, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                           device=be.device_info(), path="v2tc")
    else:
        return auto
    return plan_decode(table, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                       device=be.device_info(), pages_per_chunk=ppc, path="v2")


def _run_path(be: Backend, cfg: CheckConfig, path: str, arrays: tuple[Any, Any, Any],
              table: PageTable, auto: DecodePlan, ref: tuple[np.ndarray, np.ndarray]
              ) -> CheckResult:
    tol = tolerance(cfg.kv_dtype)
    plan = _plan_for(path, be, cfg, table, auto)
    is_v2 = path.startswith("v2")
    kernel_path = ("v2tc" if path in TC_PATHS else "v2") if is_v2 else path
    want = f"{kernel_path}+merge" if is_v2 and plan.needs_merge else kernel_path
    before = last_outcome()
    t0 = time.perf_counter()
    err, lerr, ran, why = math.inf, math.inf, None, None
    try:
        out, lse = decode(*arrays, table, plan, path=kernel_path,
                          return_lse=True, out_dtype="float32", backend=be)
        out_h, lse_h = be.to_numpy(be.asarray(out)), be.to_numpy(be.asarray(lse))
        outcome = last_outcome()
        ran = outcome.path if outcome is not None and outcome is not before else None
        err = reference.row_rel_error(out_h, ref[0])   # each (request, head) row
        lerr = reference.lse_error(lse_h, ref[1])
    except Exception as exc:  # a failing backend is a result, not a crash of the check
        why = f"{type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - t0
    if why is None:
        if ran != want:
            why = f"asked for {want}, ran {ran or 'nothing recorded'}"
        elif not (math.isfinite(err) and err <= tol):
            why = f"max rel error {err:.3g} > {tol:.0e}"
        elif not (math.isfinite(lerr) and lerr <= LSE_TOLERANCE):
            why = f"LSE error {lerr:.3g} > {LSE_TOLERANCE:.0e}"
    return CheckResult(cfg, path, ran,
                       plan.pages_per_chunk if is_v2 else None,
                       plan.num_chunks if is_v2 else None,
                       plan.num_ctas if is_v2 else None,
                       plan.needs_merge if is_v2 else None,
                       err, lerr, tol, why is None, seconds, why)


def check_config(be: Backend, cfg: CheckConfig, paths: Sequence[str] = ALL_PATHS,
                 timings: dict[str, float] | None = None) -> list[CheckResult]:
    """Check one configuration on every path in ``paths`` that applies to it
    (``path_applies``; oracle computed once)."""
    tm = timings if timings is not None else {}
    t0 = time.perf_counter()
    prob = problems.make_problem(cfg.spec)
    arrays = problems.move(prob, be)
    t1 = time.perf_counter()
    ref = reference.oracle_decode(prob.q, prob.k_pages, prob.v_pages, prob.table)
    t2 = time.perf_counter()
    tm["build"] = tm.get("build", 0.0) + (t1 - t0)
    tm["oracle"] = tm.get("oracle", 0.0) + (t2 - t1)
    auto = plan_decode(prob.table, cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim,
                       device=be.device_info(), path="v2")
    results = []
    for p in (p for p in paths if path_applies(p, cfg)):
        r = _run_path(be, cfg, p, arrays, prob.table, auto, ref)
        tm[p] = tm.get(p, 0.0) + r.seconds
        results.append(r)
    return results


def run_check(backend: str | Backend | None = None, *, full: bool = False,
              dtypes: Sequence[str] = ("float16",), paths: Sequence[str] | None = None,
              progress: Callable[[CheckResult], None] | None = None,
              max_configs: int | None = None,
              shard: tuple[int, int] | None = None) -> CheckReport:
    """Run the correctness matrix on ``backend`` (a name, an instance, or automatic).

    ``progress`` is called with every ``CheckResult`` as it lands; ``max_configs`` keeps
    only the first (cheapest) configurations of the matrix; ``shard=(k, n)`` keeps every
    n-th configuration starting at the k-th (0-based), so n processes can split a matrix.
    ``paths`` defaults to ``default_paths`` of the backend.
    """
    be = get_backend(backend, fn="run_check")
    paths = default_paths(be) if paths is None else tuple(paths)
    bad = [p for p in paths if p not in ALL_PATHS]
    if bad:
        raise ValueError(f"run_check: paths must be among {', '.join(ALL_PATHS)}, got {bad}")
    dtypes = list(dict.fromkeys(dtypes))   # a dtype named twice runs once
    for dt in dtypes:
        if dt not in TOLERANCES:
            raise ValueError(f"run_check: dtypes must be among {', '.join(TOLERANCES)}, "
                             f"got {dt!r}")
    info = be.device_info()
    configs = matrix(full, list(dtypes))
    if max_configs is not None:
        if not is_int(max_configs) or max_configs < 1:
            raise ValueError(f"run_check: max_configs must be a positive integer, "
                             f"got {max_configs!r}")
        configs = configs[:max_configs]
    if shard is not None:
        k, n = shard
        if not (n >= 1 and 0 <= k < n):
            raise ValueError(f"run_check: shard must be (k, n) with 0 <= k < n, got {shard}")
        configs = configs[k::n]
    ran = tuple(dict.fromkeys(c.kv_dtype for c in configs))   # in the order asked
    report = CheckReport(be.name, f"{info.name}; target {info.target_ctas()} CTAs", full,
                         ran, tuple(paths),
                         unreached=tuple(d for d in dict.fromkeys(dtypes) if d not in ran))
    t0 = time.perf_counter()
    for cfg in configs:
        for r in check_config(be, cfg, paths, report.timings):
            report.results.append(r)
            if progress is not None:
                progress(r)
    report.timings["total"] = time.perf_counter() - t0
    return report


__all__ = ["ALL_PATHS", "AXES", "TC_PATHS", "CheckConfig", "CheckReport", "CheckResult",
           "LSE_TOLERANCE", "TOLERANCES", "check_config", "default_paths", "forced_merge_ppc",
           "format_result", "matrix", "path_applies", "run_check", "tolerance"]
