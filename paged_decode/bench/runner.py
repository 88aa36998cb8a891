"""Run benchmark cases on a backend: verify each arm against the float64 oracle, then time
it, and record what actually ran.

GPU arms are timed with CUDA events around each call with a cold L2 (``gpu_us``) and as a
Python caller sees them, back-to-back with host overhead (``call_us``); on the reference
backend only host time exists. The plan is made once per case and reused, as an engine
reuses it across layers.
"""

from __future__ import annotations

import datetime
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from .. import __version__
from ..backends import Backend, get_backend
from ..decode import decode
from ..dtypes import numpy_dtype
from ..outcome import last_outcome
from ..page_table import PageTable
from ..plan import plan_decode
from ..problems import make_table
from ..reference import attention_f64, max_rel_error
from . import timing
from .cases import BenchCase

ARMS = ("gather", "v1", "v2")
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


#: the paths each adr arm may report; anything else is a fallback
EXPECTED = {"gather": ("gather",), "v1": ("v1",), "v2": ("v2", "v2+merge")}


@dataclass
class ArmResult:
    arm: str
    ran: str                   # the path decode reports it ran
    max_rel_error: float
    verified: bool
    gpu: dict[str, float] = field(default_factory=dict)    # median/p20/p80 in us
    call: dict[str, float] = field(default_factory=dict)
    gbps: float = 0.0          # the arm's own bytes / median GPU (or host) time
    expected: tuple[str, ...] = ()   # paths this arm is meant to run

    @property
    def fell_back(self) -> bool:
        """The arm ran something else than it stands for: no comparison may use it."""
        return bool(self.expected) and self.ran not in self.expected

    @property
    def median_us(self) -> float:
        return self.gpu.get("median_us") or self.call.get("median_us", float("nan"))


@dataclass
class BenchResult:
    case: Any                  # BenchCase or a suite's case: .label, .io_bytes()
    num_chunks: int
    pages_per_chunk: int
    arms: dict[str, ArmResult]

    def to_dict(self) -> dict[str, Any]:
        d = {"case": asdict(self.case), "label": self.case.label, "num_chunks": self.num_chunks,
             "pages_per_chunk": self.pages_per_chunk, "io_bytes": self.case.io_bytes()}
        d["arms"] = {k: asdict(v) for k, v in self.arms.items()}
        return d


def header(be: Backend, *, bandwidth: float | None) -> dict[str, Any]:
    info = be.describe()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "paged_decode": __version__, "python": sys.version.split()[0],
            "numpy": np.__version__, "host": platform.node(), **info,
            "read_bandwidth_GBps": None if bandwidth is None else bandwidth / 1e9}


def _problem(be: Backend, case: BenchCase, seed: int) -> tuple[Any, Any, Any, PageTable]:
    rng = np.random.default_rng(seed)
    table, num_pages = make_table([case.context] * case.batch, case.page_size, slack=1.25,
                                  rng=rng)
    xp = be.array_module()
    g = xp.random.default_rng(seed)
    dt = numpy_dtype(case.dtype)
    shape = (num_pages, case.page_size, case.num_kv_heads, case.head_dim)
    k = g.standard_normal(shape, dtype=xp.float32).astype(dt)
    v = g.standard_normal(shape, dtype=xp.float32).astype(dt)
    q = g.standard_normal((case.batch, case.num_qo_heads, case.head_dim),
                          dtype=xp.float32).astype(dt)
    return q, k, v, table


def _verify(be: Backend, out: Any, q: Any, k: Any, v: Any, table: PageTable) -> float:
    """Max relative error of requests 0 and B-1 against the float64 oracle (only their
    pages are copied to the host)."""
    worst = 0.0
    xp = be.array_module()
    on, qn = be.to_numpy(out), be.to_numpy(q)
    for r in sorted({0, table.batch_size - 1}):
        ids = xp.asarray(np.asarray(table.request_pages(r), dtype=np.int64))
        fpo, n = int(table.first_page_offset[r]), int(table.visible_lens[r])
        kv = []
        for pool in (k, v):
            rows = be.to_numpy(pool[ids])
            kv.append(rows.reshape(-1, *rows.shape[2:])[fpo:fpo + n].astype(np.float64))
        ref, _ = attention_f64(qn[r].astype(np.float64), kv[0], kv[1],
                               1.0 / np.sqrt(qn.shape[-1]))
        worst = max(worst, max_rel_error(on[r], ref))
    return worst


def time_arm(be: Backend, arm: str, call: Callable[[], Any], verify: Callable[[], float],
             nbytes: int, tolerance: float, expected: tuple[str, ...], *, warmup: int,
             reps: int, cold_l2: bool) -> ArmResult:
    """Run ``call`` once, verify it (``verify`` returns the max relative error against the
    oracle), record the path it ran, then time it: CUDA events (cold L2) and per-call wall
    time on a GPU backend, host time otherwise. GB/s uses ``nbytes``."""
    call()
    done = last_outcome()
    err = verify()
    res = ArmResult(arm, done.path if done else "?", err, bool(err <= tolerance),
                    expected=expected)
    if be.name == "cuda":
        res.gpu = timing.stats(timing.cuda_event_times(call, warmup=warmup, reps=reps,
                                                       cold_l2=cold_l2))
        res.call = timing.stats(timing.cuda_per_call_times(call, warmup=warmup, reps=reps))
    else:
        res.call = timing.stats(timing.host_times(call, warmup=min(warmup, 2),
                                                  reps=max(3, reps // 6)))
    res.gbps = nbytes / (res.median_us * 1e-6) / 1e9
    return res


def bench_case(be: Backend, case: BenchCase, *, arms: tuple[str, ...] = ARMS,
               warmup: int = 5, reps: int = 30, cold_l2: bool = True,
               seed: int = 0) -> BenchResult:
    """Verify, then time, every arm of one case on ``be``."""
    q, k, v, table = _problem(be, case, seed)
    plan = plan_decode(table, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                       device=be.device_info())
    with be.launch_context(q):
        out = be.empty(tuple(q.shape), case.dtype)
    results = {}
    for arm in arms:
        def call(arm: str = arm) -> Any:
            return decode(q, k, v, table, plan, path=arm, out=out, backend=be)
        results[arm] = time_arm(be, arm, call, lambda: _verify(be, out, q, k, v, table),
                                case.io_bytes(), TOLERANCE[case.dtype], EXPECTED[arm],
                                warmup=warmup, reps=reps, cold_l2=cold_l2)
    return BenchResult(case, plan.num_chunks, plan.pages_per_chunk, results)


def run_bench(cases: list[BenchCase], *, backend: str | Backend | None = None,
              arms: tuple[str, ...] = ARMS, warmup: int = 5, reps: int = 30,
              cold_l2: bool = True, seed: int = 0,
              progress: Callable[[BenchResult], None] | None = None) -> list[BenchResult]:
    """Verify and time every arm of every case; see the module docstring."""
    be = get_backend(backend)
    results = []
    for case in cases:
        r = bench_case(be, case, arms=arms, warmup=warmup, reps=reps, cold_l2=cold_l2,
                       seed=seed)
        results.append(r)
        if progress:
            progress(r)
    return results
