"""``paged-decode bench --suite engine``: an engine's decode loop, step by step.

B sequences with ragged lengths (the second half forked from a shared prompt, so pages
are shared and copy-on-write happens), L layers; at every step each sequence gains one
token in every layer and every layer decodes the whole batch. Arms:

- ``eager``: ``DecodeStep.begin`` then, per layer, ``append`` + ``decode`` (prepared
  launches on fixed buffers, as an engine with static buffers makes them);
- ``captured``: the same step recorded once (``DecodeStep.capture``; a CUDA graph on the
  ``cuda`` backend) and replayed after every ``begin`` (recaptured when stale);
- ``eager-tc`` / ``captured-tc`` (named with ``--arms``): the same two on the tensor-core
  partial (``DecodeStep(path="v2tc")``; CUDA, 16-bit queries over 16-bit or fp8 pools);
- ``speculative`` / ``speculative-tc`` (named with ``--arms``): a speculative decoding
  loop's step on the same pools: ``begin(tokens=T)`` (``--spec-tokens``, the token and
  its drafts), per layer ``append`` and ``decode`` of ``[B, T, ...]`` rows, then
  ``trim_back`` of a random number of drafts per sequence (0 to ``T - 1``: what
  verification rejects), included in the step's time; eager (such a step is not
  captured). No FlashInfer arm does the same step here (its decode wrapper takes one
  query token per request);
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

fp8 K/V (``--kv-dtype``, ``EngineCase.kv_dtype``; ``docs/fp8.md``): the pools hold
``float8_e4m3fn`` or ``float8_e5m2`` codes with per-layer float32 K and V scales, each the
amax of the layer's prompt K (or V) block over the format's largest finite value (an amax
calibration; later rows beyond it saturate). Every arm draws K and V rows separately, V at
half K's spread (``V_SIGMA``), so the two scales differ by about 2x and a decode given
the K and V caches or scales swapped fails the oracle. Queries, outputs and appended rows stay
``--dtype``; our appends quantize in the append kernel, FlashInfer's arms quantize each
layer's new rows with torch ops first (its append copies rows of the cache's dtype). The
oracle reads the pools as stored, the codes dequantized with the calibrated scales, so the
bound is the 16-bit one (``engine_case.tolerance``) and a wrong scale fails; the JSON
records each arm's scales. No arm falls back to 16-bit pools: one whose path refuses fp8
is reported not run, with the library's reason; FlashInfer's arms are not run over scales
its finite mask cannot mask at (``flashinfer_mask``: e5m2 calibrated to 57344).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backends import Backend
from ..dtypes import numpy_dtype
from ..engine_step import DecodeStep
from ..errors import UnsupportedProblemError, fail, fmt_shape
from ..fp8 import amax_scales, is_fp8
from ..pool import PagePool
from ..reference import oracle_decode, row_rel_error
from .engine_case import (
    V_SIGMA,
    EngineArm,
    EngineCase,
    EventTimer,
    NoTimer,
    mean_us,
    median_us,
    prompts,
)
from .engine_flashinfer import ARMS as FLASHINFER_ARMS
from .engine_flashinfer import run_flashinfer
from .memory import release_memory

ENGINE_ARMS = ("eager", "captured", "flashinfer", "flashinfer-captured")
#: every arm ``--arms`` may name (the default set is ENGINE_ARMS)
SPEC_ARMS = ("speculative", "speculative-tc")
ALL_ENGINE_ARMS = ("eager", "captured", "eager-tc", "captured-tc", *SPEC_ARMS,
                   *FLASHINFER_ARMS)
#: each sequence's K/V window starts SHIFT * i tokens into the shared blocks, mod SPREAD
_SHIFT, _SPREAD = 37, 512


def _pool(be: Backend, case: EngineCase, seed: int
          ) -> tuple[PagePool, list[int], dict[str, np.ndarray]]:
    """The case's pool ``[L, num_pages, P, Hkv, D]`` of ``case.pool_dtype``, its
    sequences (prompts appended, forks made) and, for an fp8 pool, the per-layer K and V
    scales (float32 ``[L]`` each, calibrated on the prompt blocks: ``amax_scales``)
    it was made with; its append quantizes with them. ``{}`` for 16-bit pools."""
    lens = prompts(case, seed)
    need = sum(-(-(n + case.steps + 1) // case.page_size) for n in lens) + case.batch

    def new_pool(**scales: np.ndarray) -> PagePool:
        return PagePool(need, case.page_size, case.num_kv_heads, case.head_dim,
                        case.pool_dtype, num_layers=case.layers, backend=be, **scales)

    scales: dict[str, np.ndarray] = {}
    # a 16-bit pool first, as before the fp8 pools: its allocation (on a device, and
    # usually the larger) fails with its own error before the host blocks are drawn; an
    # fp8 pool's scales come from the blocks
    pool = None if is_fp8(case.pool_dtype) else new_pool()
    k_block, v_block = _blocks(case, max(lens), seed)
    if pool is None:        # each layer's amax of the rows it is filled from
        scales = {name: amax_scales(np.abs(x).max(axis=(1, 2, 3)), case.pool_dtype)
                  for name, x in (("k_scale", k_block), ("v_scale", v_block))}
        pool = new_pool(**scales)
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
    return pool, seqs, scales


def _blocks(case: EngineCase, longest: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts' K and V blocks, ``[L, longest + SPREAD, Hkv, D]`` each in
    ``case.dtype``: one block for the whole batch, generated once in float32; each
    sequence takes its own window of it (starting SHIFT * i tokens in, modulo SPREAD), so
    no two sequences hold the same tokens at the same positions. (float64 normals per
    sequence took about 1 s a sequence at 32 layers: minutes per arm at batch 128.) K and
    V are drawn separately, V at ``V_SIGMA`` (K at 1): an fp8 pool's V scales are about
    half its K scales, so a decode given them swapped fails the oracle."""
    rng = np.random.default_rng(seed + 1)
    dt = numpy_dtype(case.dtype)
    shape = (case.layers, longest + _SPREAD, case.num_kv_heads, case.head_dim)
    try:
        k = rng.standard_normal(shape, dtype=np.float32).astype(dt)
        v = rng.standard_normal(shape, dtype=np.float32)
        v *= np.float32(V_SIGMA)
        return k, v.astype(dt)
    except (MemoryError, ValueError) as exc:     # ValueError: a size numpy cannot index
        gib = 2 * float(np.prod(shape, dtype=np.float64)) * 4 / 2 ** 30
        raise fail("bench --suite engine", f"the prompts' K and V blocks of shape "
                   f"{fmt_shape(shape)} (float32 while drawn) need {gib:.3g} GiB of host "
                   f"memory, which could not be allocated; fewer --layers or a shorter "
                   f"--context") from exc


def _check(be: Backend, pool: PagePool, step: DecodeStep, layer: int, q: Any,
           out: Any, scales: dict[str, np.ndarray]) -> float:
    """Max-rel error per (request, head) row of requests 0, the first fork and the last
    against the float64 oracle on the pool's layer ``layer`` as stored; an fp8 pool's
    codes are dequantized with the layer's entry of ``scales`` (``_pool``'s calibration,
    not read back from the pool: a decode given other scales fails)."""
    k, v = pool.layer(layer)
    table = step.table.page_table()
    n = int(step.table.num_live)
    forks = [i for i in range(n // 2 + 1, n) if i % 2 == 0]     # _pool's forks
    rows = sorted({0, n - 1, *forks[:1]})
    sub = table.subset(rows)
    qn = be.to_numpy(q)[rows]
    quant: dict[str, Any] = {}
    if scales:
        quant = {"kv_dtype": pool.dtype, **{nm: float(x[layer]) for nm, x in scales.items()}}
    want, _ = oracle_decode(qn, be.to_numpy(k), be.to_numpy(v), sub, **quant)
    got = be.to_numpy(out)[rows]       # [r, Hq, D], or [r, T, Hq, D] (speculative arms)
    return row_rel_error(got.reshape(-1, *got.shape[-2:]),      # per (token, head) row
                         want.reshape(-1, *want.shape[-2:]))


def _loop(be: Backend, case: EngineCase, arm: str, seed: int, tokens: int,
          issue: Callable[[DecodeStep, Callable[[DecodeStep], None]], None],
          after: Callable[[DecodeStep, int], None] | None = None) -> EngineArm:
    """``case.steps`` timed steps of an arm of ours on a fresh pool (``-tc``: on the
    tensor-core partial): ``issue(step, body)`` makes a step (``body`` appends and decodes
    every layer; with ``tokens`` > 1 their rows are ``[B, tokens, ...]``); the outputs are
    checked against the oracle at the first and the last step; ``after(step, i)``, timed
    with the step, follows the check. Queries, outputs and appended rows are
    ``case.dtype``; over an fp8 pool the pool's append quantizes the rows with the layer's
    scales and the decode reads the codes."""
    pool, seqs, scales = _pool(be, case, seed)
    step = DecodeStep(pool, seqs, num_qo_heads=case.num_qo_heads, headroom=case.headroom,
                      path="v2tc" if arm.endswith("-tc") else "v2")
    cap, dt = step.capacity, numpy_dtype(case.dtype)
    rows = (cap, tokens) if tokens > 1 else (cap,)
    rng = np.random.default_rng(seed + 2)

    def fresh(shape: tuple[int, ...], sigma: float = 1.0) -> Any:
        return be.asarray((rng.standard_normal(shape) * sigma).astype(dt))

    hq, hkv, d = case.num_qo_heads, case.num_kv_heads, case.head_dim
    qs = [fresh((*rows, hq, d)) for _ in range(case.layers)]
    ks = [fresh((*rows, hkv, d)) for _ in range(case.layers)]
    vs = [fresh((*rows, hkv, d), V_SIGMA) for _ in range(case.layers)]
    outs = [be.empty((*rows, hq, d), case.dtype) for _ in range(case.layers)]

    def body(st: DecodeStep) -> None:
        for layer in range(case.layers):
            st.append(layer, ks[layer], vs[layer])
            st.decode(layer, qs[layer], out=outs[layer])

    walls, hosts, gpus, errors = [], [], [], []
    timer = _gpu_timer(be)
    for i in range(case.steps):
        be.synchronize(outs[-1])
        t0 = time.perf_counter()
        with timer:
            issue(step, body)
            t1 = time.perf_counter()
        be.synchronize(outs[-1])
        t2 = time.perf_counter()
        if i in (0, case.steps - 1):
            errors += [_check(be, pool, step, layer, qs[layer], outs[layer], scales)
                       for layer in (0, case.layers - 1)]
        t3 = time.perf_counter()
        if after is not None:
            after(step, i)
        late = time.perf_counter() - t3
        walls.append(t2 - t0 + late)
        hosts.append(t1 - t0 + late)
        gpus.append(timer.last)
    return EngineArm(arm, True, case.dtype, step_us=median_us(walls), mean_us=mean_us(walls),
                     host_us=median_us(hosts), gpu_us=median_us(gpus), errors=errors,
                     replans=step.replans, kv_dtype=case.kv_dtype,
                     **{n: x.tolist() for n, x in scales.items()})


def run_ours(be: Backend, case: EngineCase, arm: str, *, seed: int = 0) -> EngineArm:
    """The ``eager`` or ``captured`` arm (``-tc``: on the tensor-core partial); the
    captured one records the step once and replays it after every ``begin``
    (recaptured when stale)."""
    graph: Any = None
    captures = 0

    def issue(step: DecodeStep, body: Callable[[DecodeStep], None]) -> None:
        nonlocal graph, captures
        step.begin()
        if arm.startswith("eager"):
            body(step)
        elif graph is None or graph.stale:
            graph = step.capture(body)
            captures += 1
        else:
            graph.replay()

    res = _loop(be, case, arm, seed, 1, issue)
    res.recaptures = max(0, captures - 1)
    return res


def run_speculative(be: Backend, case: EngineCase, arm: str, *, seed: int = 0) -> EngineArm:
    """The ``speculative`` arm (``-tc``: on the tensor-core partial): ``case.spec_tokens``
    slots per sequence per step, every layer appended and decoded, then a random 0 to
    ``T - 1`` drafts per sequence retired (``trim_back``, timed with the step); checked
    against the oracle at the first and the last step, before the trim."""
    t = case.spec_tokens
    rejects = np.random.default_rng(seed + 3).integers(0, t, (case.steps, case.batch))

    def issue(step: DecodeStep, body: Callable[[DecodeStep], None]) -> None:
        step.begin(tokens=t)
        body(step)

    res = _loop(be, case, arm, seed, t, issue, lambda step, i: step.trim_back(rejects[i]))
    res.note = f"{t} tokens per sequence per step, {t - rejects[1:].mean():.2f} kept on average"
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
                                         note=f"failed: {type(exc).__name__}: {exc}"[:300],
                                         kv_dtype=case.kv_dtype)
            else:
                try:
                    run = run_speculative if arm in SPEC_ARMS else run_ours
                    got[arm] = run(be, case, arm)
                except UnsupportedProblemError as exc:    # e.g. v2tc off CUDA or on f32
                    got[arm] = EngineArm(arm, False, case.dtype, note=str(exc)[:300],
                                         kv_dtype=case.kv_dtype)
            if progress:
                progress(f"{case.label} {arm}")
        out.append((case, got))
    return out


def report(results: list[tuple[EngineCase, dict[str, EngineArm]]]) -> str:
    """A text table: per case and arm, step / host / GPU microseconds, the step time
    against the faster verified FlashInfer arm's where one ran, the oracle errors,
    replans."""
    w = max([44, *(len(case.label) for case, _ in results)])   # fp8 labels run longer
    lines = [f"{'case':{w}} {'arm':19} {'step us':>10} {'mean us':>10} {'host us':>10} "
             f"{'gpu us':>10} {'vs FI':>7} {'max err':>9} replans"]
    for case, arms in results:
        fi = [a.step_us for n, a in arms.items()
              if n in FLASHINFER_ARMS and a.ran and a.verified]
        best = min(fi) if fi else float("nan")
        for name, a in arms.items():
            if not a.ran:
                lines.append(f"{case.label:{w}} {name:19} not run: {a.note}")
                continue
            ratio = (a.step_us / best if name not in FLASHINFER_ARMS and a.verified
                     else float("nan"))
            err = max(a.errors) if a.errors else float("nan")
            lines.append(f"{case.label:{w}} {name:19} {a.step_us:10.1f} {a.mean_us:10.1f} "
                         f"{a.host_us:10.1f} {a.gpu_us:10.1f} {ratio:7.2f} {err:9.2e} "
                         f"{a.replans}" + (f"  ({a.note})" if a.note else ""))
    return "\n".join(lines)


def plot_lines(results: list[tuple[EngineCase, dict[str, EngineArm]]]
               ) -> tuple[dict[tuple[str, int], list[tuple[int, float]]], list[str]]:
    """What ``plot`` draws: ``(lines, left_out)``, a line ``(arm, context) -> [(batch,
    step us)]`` of each arm's verified points only, and ``"arm (ctx C, B B)"`` for every
    point of an arm that ran but did not verify (a time of wrong answers is no time)."""
    lines: dict[tuple[str, int], list[tuple[int, float]]] = {}
    left_out: list[str] = []
    for case, arms in results:
        for name, a in arms.items():
            if a.ran and a.verified:
                lines.setdefault((name, case.context), []).append((case.batch, a.step_us))
            elif a.ran:
                left_out.append(f"{name} (ctx {case.context}, B {case.batch})")
    for pts in lines.values():
        pts.sort()
    return lines, left_out


def plot(results: list[tuple[EngineCase, dict[str, EngineArm]]], path: str) -> str:
    """A PNG of step time against batch size, one line per arm and context (needs
    matplotlib); an arm that ran but failed the oracle is not drawn, and is named under
    the plot as left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lines, left_out = plot_lines(results)
    for (name, ctx), pts in sorted(lines.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{name} (ctx {ctx})")
    ax.set_xlabel("batch size")
    ax.set_ylabel("step time (us, median)")
    ax.set_title("engine step: append + decode of every layer")
    if lines:
        ax.legend()
    if left_out:
        shown = ", ".join(left_out[:6]) + (f" and {len(left_out) - 6} more"
                                           if len(left_out) > 6 else "")
        fig.text(0.01, 0.01, f"not verified, not plotted: {shown}", fontsize=7,
                 color="tab:red", wrap=True)
    fig.tight_layout(rect=(0, 0.05 if left_out else 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def to_dict(results: list[tuple[EngineCase, dict[str, EngineArm]]]) -> list[dict[str, Any]]:
    from dataclasses import asdict
    return [{"case": asdict(c), "label": c.label,
             "arms": {n: asdict(a) | {"verified": a.verified} for n, a in arms.items()}}
            for c, arms in results]


__all__ = ["ALL_ENGINE_ARMS", "ENGINE_ARMS", "SPEC_ARMS", "EngineArm", "EngineCase", "plot",
           "plot_lines", "report", "run_engine", "run_ours", "run_speculative", "to_dict"]
