"""``paged-decode bench --suite engine``: an engine's decode loop, step by step.

B sequences with ragged lengths (the second half forked from a shared prompt, so pages
are shared and copy-on-write happens), L layers; at every step each sequence gains one
token in every layer and every layer decodes the whole batch. Arms:

- ``eager``: ``DecodeStep.begin`` then, per layer, ``append`` + ``decode`` (prepared
  launches on fixed buffers, as an engine with static buffers makes them);
- ``captured``: the same step recorded once (``DecodeStep.capture``; a CUDA graph on the
  ``cuda`` backend) and replayed after every ``begin`` (recaptured when stale);
- ``eager-tc`` / ``captured-tc`` (named with ``--arms``): the same two on the tensor-core
  partial (``DecodeStep(path="v2tc")``; CUDA, 16-bit pools);
- ``flashinfer`` / ``flashinfer-captured`` (CUDA, when importable): per step the host
  table's update (vectorized numpy), one ``plan``, then ``append_paged_kv_cache`` and
  ``run`` for every layer on FlashInfer's own cache of the same shape, launched eagerly or
  replayed from a CUDA graph (FlashInfer's graph mode; ``engine_flashinfer.py``).

Reported per arm (the first step is a warm-up, left out): median and mean step time
(host wall time of a synchronized step; the mean carries replans and recaptures), host time
per step (the Python calls until the last launch is queued), GPU time per step (CUDA
events around the whole step, host preparation included: ``begin`` for ours, the table
update and ``plan`` for FlashInfer's), replans and recaptures. Every arm's outputs are
checked against the float64 oracle at the first and the last step (layer 0 and L-1;
requests 0, the first fork and the last).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backends import Backend
from ..dtypes import numpy_dtype
from ..engine_step import DecodeStep
from ..errors import UnsupportedProblemError
from ..pool import PagePool
from ..reference import oracle_decode, row_rel_error
from .engine_case import EngineArm, EngineCase, EventTimer, NoTimer, mean_us, median_us, prompts
from .engine_flashinfer import ARMS as FLASHINFER_ARMS
from .engine_flashinfer import run_flashinfer
from .memory import release_memory

ENGINE_ARMS = ("eager", "captured", "flashinfer", "flashinfer-captured")
#: every arm ``--arms`` may name (the default set is ENGINE_ARMS)
ALL_ENGINE_ARMS = ("eager", "captured", "eager-tc", "captured-tc", *FLASHINFER_ARMS)
#: each sequence's K/V window starts SHIFT * i tokens into the shared blocks, mod SPREAD
_SHIFT, _SPREAD = 37, 512


def _pool(be: Backend, case: EngineCase, seed: int) -> tuple[PagePool, list[int]]:
    lens = prompts(case, seed)
    need = sum(-(-(n + case.steps + 1) // case.page_size) for n in lens) + case.batch
    pool = PagePool(need, case.page_size, case.num_kv_heads, case.head_dim, case.dtype,
                    num_layers=case.layers, backend=be)
    # one K and one V block for the whole batch, generated once in float32: each sequence
    # takes its own window of it (starting SHIFT * i tokens in, modulo SPREAD), so no two
    # sequences hold the same tokens at the same positions. (float64 normals per sequence
    # took about 1 s a sequence at 32 layers: minutes per arm at batch 128.)
    rng = np.random.default_rng(seed + 1)
    dt = numpy_dtype(case.dtype)
    shape = (case.layers, max(lens) + _SPREAD, case.num_kv_heads, case.head_dim)
    k_block = rng.standard_normal(shape, dtype=np.float32).astype(dt)
    v_block = rng.standard_normal(shape, dtype=np.float32).astype(dt)
    seqs: list[int] = []
    half = case.batch // 2
    for i, n in enumerate(lens):
        if i > half and i % 2 == 0:
            s = pool.fork(seqs[0])             # shares request 0's pages, then grows
        else:
            s = pool.new_sequence()
            at = _SHIFT * i % _SPREAD
            pool.append(s, k_block[:, at:at + n], v_block[:, at:at + n])
        seqs.append(s)
    return pool, seqs


def _check(be: Backend, pool: PagePool, step: DecodeStep, layer: int, q: Any,
           out: Any) -> float:
    k, v = pool.layer(layer)
    table = step.table.page_table()
    n = int(step.table.num_live)
    forks = [i for i in range(n // 2 + 1, n) if i % 2 == 0]     # _pool's forks
    rows = sorted({0, n - 1, *forks[:1]})
    sub = table.subset(rows)
    qn = be.to_numpy(q)[rows]
    want, _ = oracle_decode(qn, be.to_numpy(k), be.to_numpy(v), sub)
    return row_rel_error(be.to_numpy(out)[rows], want)   # per (request, head) row


def run_ours(be: Backend, case: EngineCase, arm: str, *, seed: int = 0) -> EngineArm:
    """The ``eager`` or ``captured`` arm (``-tc``: on the tensor-core partial)."""
    pool, seqs = _pool(be, case, seed)
    mode, _, tc = arm.partition("-")
    step = DecodeStep(pool, seqs, num_qo_heads=case.num_qo_heads, headroom=case.headroom,
                      path="v2tc" if tc else "v2")
    cap, dt = step.capacity, numpy_dtype(case.dtype)
    rng = np.random.default_rng(seed + 2)

    def fresh(shape: tuple[int, ...]) -> Any:
        return be.asarray(rng.standard_normal(shape).astype(dt))

    qs = [fresh((cap, case.num_qo_heads, case.head_dim)) for _ in range(case.layers)]
    ks = [fresh((cap, case.num_kv_heads, case.head_dim)) for _ in range(case.layers)]
    outs = [be.empty((cap, case.num_qo_heads, case.head_dim), case.dtype)
            for _ in range(case.layers)]

    def body(st: DecodeStep) -> None:
        for layer in range(case.layers):
            st.append(layer, ks[layer], ks[layer])
            st.decode(layer, qs[layer], out=outs[layer])

    graph = None
    recaptures = 0
    walls, hosts, gpus, errors = [], [], [], []
    timer = _gpu_timer(be)
    for i in range(case.steps):
        be.synchronize(outs[-1])
        t0 = time.perf_counter()
        with timer:
            step.begin()
            if mode == "eager":
                body(step)
            elif graph is None or graph.stale:
                graph = step.capture(body)
                recaptures += 1
            else:
                graph.replay()
            t1 = time.perf_counter()
        be.synchronize(outs[-1])
        t2 = time.perf_counter()
        walls.append(t2 - t0)
        hosts.append(t1 - t0)
        gpus.append(timer.last)
        if i in (0, case.steps - 1):
            errors += [_check(be, pool, step, layer, qs[layer], outs[layer])
                       for layer in (0, case.layers - 1)]
    res = EngineArm(arm, True, case.dtype, step_us=median_us(walls), mean_us=mean_us(walls),
                    host_us=median_us(hosts), gpu_us=median_us(gpus), errors=errors,
                    replans=step.replans,
                    recaptures=max(0, recaptures - 1))
    return res


def _gpu_timer(be: Backend) -> Any:
    if be.name != "cuda":
        return NoTimer()
    import cupy as cp
    return EventTimer(cp.cuda.Event, cp.cuda.get_elapsed_time)


def run_engine(be: Backend, cases: list[EngineCase], *, arms: tuple[str, ...] = ENGINE_ARMS,
               progress: Callable[[str], None] | None = None
               ) -> list[tuple[EngineCase, dict[str, EngineArm]]]:
    """Every arm on every case (an arm that cannot run here is reported with why)."""
    out = []
    for case in cases:
        got: dict[str, EngineArm] = {}
        for arm in arms:
            # the last arm's pools, steps and graphs: on an 80 GB card FlashInfer's arm
            # after ours met CuPy's cached blocks and ran out of memory (S25-R3)
            release_memory(be)
            if arm in FLASHINFER_ARMS:
                try:
                    got[arm] = run_flashinfer(be, case, arm)
                except Exception as exc:   # reported (not run, with why), the others go on
                    got[arm] = EngineArm(arm, False, case.dtype,
                                         note=f"failed: {type(exc).__name__}: {exc}"[:300])
            else:
                try:
                    got[arm] = run_ours(be, case, arm)
                except UnsupportedProblemError as exc:    # e.g. v2tc off CUDA or on f32
                    got[arm] = EngineArm(arm, False, case.dtype, note=str(exc)[:300])
            if progress:
                progress(f"{case.label} {arm}")
        out.append((case, got))
    return out


def report(results: list[tuple[EngineCase, dict[str, EngineArm]]]) -> str:
    """A text table: per case and arm, step / host / GPU microseconds, the step time
    against the faster verified FlashInfer arm's where one ran, the oracle errors,
    replans."""
    lines = [f"{'case':44} {'arm':19} {'step us':>10} {'mean us':>10} {'host us':>10} "
             f"{'gpu us':>10} {'vs FI':>7} {'max err':>9} replans"]
    for case, arms in results:
        fi = [a.step_us for n, a in arms.items()
              if n in FLASHINFER_ARMS and a.ran and a.verified]
        best = min(fi) if fi else float("nan")
        for name, a in arms.items():
            if not a.ran:
                lines.append(f"{case.label:44} {name:19} not run: {a.note}")
                continue
            ratio = (a.step_us / best if name not in FLASHINFER_ARMS and a.verified
                     else float("nan"))
            err = max(a.errors) if a.errors else float("nan")
            lines.append(f"{case.label:44} {name:19} {a.step_us:10.1f} {a.mean_us:10.1f} "
                         f"{a.host_us:10.1f} {a.gpu_us:10.1f} {ratio:7.2f} {err:9.2e} "
                         f"{a.replans}")
    return "\n".join(lines)


def plot(results: list[tuple[EngineCase, dict[str, EngineArm]]], path: str) -> str:
    """A PNG of step time against batch size, one line per arm and context (needs
    matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lines: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for case, arms in results:
        for name, a in arms.items():
            if a.ran:
                lines.setdefault((name, case.context), []).append((case.batch, a.step_us))
    for (name, ctx), pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{name} (ctx {ctx})")
    ax.set_xlabel("batch size")
    ax.set_ylabel("step time (us, median)")
    ax.set_title("engine step: append + decode of every layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def to_dict(results: list[tuple[EngineCase, dict[str, EngineArm]]]) -> list[dict[str, Any]]:
    from dataclasses import asdict
    return [{"case": asdict(c), "label": c.label,
             "arms": {n: asdict(a) | {"verified": a.verified} for n, a in arms.items()}}
            for c, arms in results]


__all__ = ["ALL_ENGINE_ARMS", "ENGINE_ARMS", "EngineArm", "EngineCase", "plot", "report",
           "run_engine", "run_ours", "to_dict"]
