"""Run benchmark cases on a backend: verify each arm against the float64 oracle, then time
it, and record what actually ran.

GPU arms are timed two ways, side by side: GPU time under CUDA-graph replay with a cold
L2 (``gpu``; plain CUDA events when the call cannot be captured, noted in ``gpu_mode``),
and per call as a Python caller sees it, back-to-back with host overhead (``call``; for
our arms this is the prepared call, and ``api_call`` is the plain ``decode(...)`` with
the plan reused). ``host`` is the host time of one call alone (no wait for the GPU): the
host overhead per call. On the reference backend only host time exists. The plan is made once
per case and reused, as an engine reuses it across layers and steps.

``graph_layers`` N > 1 (``layers``; 1, one call per replay, is the default and the
historical method) times N calls captured in one CUDA graph, as an engine's step runs one
call per layer: GPU time per call is the replay's time / N, without the launch latency a
single-call replay charges every call. Each layer reads its own copy of the case's K/V
pools, placed at other pages and read through its own table (``layers.layer_pools``), so
every layer holds the case's tokens and the case's float64 oracle checks each one's output
after a NaN-poisoned replay, while a layer that reads another layer's pools or table reads
other tokens and fails; a wrong output, or two layers writing one buffer, leaves the arm
unverified and untimed. N is capped per case by device memory and halved when the copies,
or an arm's per-layer buffers, run out of it; the N each case and each arm ran is recorded
(``BenchResult.graph_layers``, ``ArmResult.graph_layers``) with the reason in a note.

Device memory: pools are generated on the device slab by slab (``fill_slabs``), the
allocators' cached blocks are handed back before each case (``release_memory``), and a
case or an arm that still does not fit is reported unavailable with the reason, so one
large case does not end a run on a smaller card.
"""

from __future__ import annotations

import datetime
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from .. import __version__, fp8, settings
from ..backends import Backend, get_backend
from ..call import plan_decode
from ..dtypes import numpy_dtype
from ..fp8 import is_fp8
from ..outcome import last_outcome
from ..page_table import PageTable
from ..plan import DecodePlan
from ..problems import make_table
from ..reference import attention_f64, row_rel_error
from . import timing
from .arms import ALL_ARMS, EXPECTED, Arm, ArmUnavailable, make_arm
from .cases import BenchCase
from .layers import (
    LayerOutputError,
    LayerPools,
    check_graph_layers,
    graph_layer_times,
    layer_pools,
    output_of,
)
from .memory import out_of_memory, release_memory

ARMS = ALL_ARMS
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


@dataclass
class ArmResult:
    arm: str
    ran: str                   # the path decode reports it ran
    max_rel_error: float
    verified: bool
    gpu: dict[str, float] = field(default_factory=dict)    # median/p20/p80 in us
    call: dict[str, float] = field(default_factory=dict)
    gbps: float = 0.0          # the case's bytes / median GPU (or host) time
    expected: tuple[str, ...] = ()   # paths this arm is meant to run
    gpu_mode: str = ""         # "graph" (CUDA-graph replay) or "events" (eager, fallback)
    api_call: dict[str, float] = field(default_factory=dict)   # ours: plain decode()
    host: dict[str, float] = field(default_factory=dict)       # host time per call (enqueue)
    note: str = ""             # why an arm was unavailable, or a capture failure
    #: ours: the plan the arm ran (chunks, ctas, rule: "wave" or "target"); {} otherwise
    plan: dict[str, Any] = field(default_factory=dict)
    #: calls per graph replay that ``gpu`` was measured with (``gpu`` is per call: the
    #: replay's time / this); 1 in events mode and for a single-call replay
    graph_layers: int = 1

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
    #: layers per graph replay the case ran (``layers``; below the requested N when the
    #: copies of its pools did not fit, ``layers_note`` then says why)
    graph_layers: int = 1
    layers_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {"case": asdict(self.case), "label": self.case.label, "num_chunks": self.num_chunks,
             "pages_per_chunk": self.pages_per_chunk, "io_bytes": self.case.io_bytes(),
             "graph_layers": self.graph_layers, "layers_note": self.layers_note}
        d["arms"] = {k: asdict(v) for k, v in self.arms.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        """A decode-suite result from its ``to_dict`` form (a bench JSON's ``results``);
        unknown arm fields (a newer writer's) are dropped, missing ones take defaults, and
        a number written ``null`` (a NaN: ``json_text``) is NaN again."""
        names = {f.name for f in fields(ArmResult)}
        arms = {}
        for k, a in d["arms"].items():
            kept = {n: v for n, v in a.items() if n in names}
            for n in ("max_rel_error", "gbps"):
                if n in kept and kept[n] is None:
                    kept[n] = float("nan")
            for n in ("gpu", "call", "api_call", "host"):
                if isinstance(kept.get(n), dict):
                    kept[n] = {m: float("nan") if x is None else x for m, x in kept[n].items()}
            kept["expected"] = tuple(kept.get("expected", ()))
            arms[k] = ArmResult(**kept)
        return cls(BenchCase(**d["case"]), int(d["num_chunks"]), int(d["pages_per_chunk"]),
                   arms, int(d.get("graph_layers", 1)), str(d.get("layers_note", "")))


def header(be: Backend, *, bandwidth: float | None, l2: str | None = None) -> dict[str, Any]:
    """The run's facts for a report: date, versions, host, the backend's device and the
    measured read bandwidth; ``l2``: how L2 was left before each timed iteration (warm,
    clean, dirty; ``timing``), when the run times GPU work; ``settings``: the
    ``PAGED_DECODE_*`` variables set for the run (``settings.active``), where any are."""
    info = be.describe()
    switches = settings.active()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "paged_decode": __version__, "python": sys.version.split()[0],
            "numpy": np.__version__, "host": platform.node(), **info,
            "read_bandwidth_GBps": None if bandwidth is None else bandwidth / 1e9,
            **({} if l2 is None else {"l2": l2}),
            **({"settings": switches} if switches else {})}


def _problem(be: Backend, case: BenchCase, seed: int) -> tuple[Any, Any, Any, PageTable]:
    rng = np.random.default_rng(seed)
    table, num_pages = make_table(case.lengths(), case.page_size, slack=1.25,
                                  rng=rng)
    dt = numpy_dtype(case.dtype)
    shape = (num_pages, case.page_size, case.num_kv_heads, case.head_dim)
    qshape = (case.batch, case.num_qo_heads, case.head_dim)
    if is_fp8(case.pool_dtype):
        return _fp8_problem(be, case, seed, table, shape, qshape)
    if be.name == "cuda":   # generated on the device (pools of many GB)
        import cupy as cp
        g = cp.random.default_rng(seed)
        def normal(s: tuple[int, ...]) -> Any:
            return fill_slabs(cp, s, dt, lambda n: g.standard_normal((n, *s[1:]),
                                                                     dtype=cp.float32))
        return normal(qshape), normal(shape), normal(shape), table
    h = np.random.default_rng(seed)
    q, k, v = (be.asarray(h.standard_normal(s, dtype=np.float32).astype(dt))
               for s in (qshape, shape, shape))
    return q, k, v, table


#: the most bytes of scratch a pool's generation holds at once (``fill_slabs``)
SLAB_BYTES = 1 << 28


def fill_slabs(xp: Any, shape: tuple[int, ...], dtype: Any,
               draw: Callable[[int], Any]) -> Any:
    """An array of ``shape`` and ``dtype`` (module ``xp``) filled slab by slab along its
    first axis: ``draw(n)`` returns the next ``n`` rows (shape ``(n, *shape[1:])``, any
    dtype, cast on assignment), each slab at most ``SLAB_BYTES`` of float32 scratch. A
    pool drawn whole took its size in float32 (or int32 indices) beside itself: three
    times a float16 pool, which ran an 80 GB card out of memory at 128 x 32K."""
    out = xp.empty(shape, dtype=dtype)
    per_row = 4 * int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, SLAB_BYTES // max(per_row, 1))
    for i in range(0, shape[0], step):
        n = min(step, shape[0] - i)
        out[i:i + n] = draw(n)
    return out


#: fp8 benchmark pools: K ~ N(0, 2^2), V ~ N(0, 1), scaled so that 4 sigma reaches the
#: format's largest value (a per-tensor amax calibration)
FP8_SIGMA = {"k": 2.0, "v": 1.0}


def fp8_scales(fmt: str) -> tuple[float, float]:
    """(k_scale, v_scale) of the fp8 benchmark pools of format ``fmt``."""
    top = fp8.max_finite(fmt)
    return 4 * FP8_SIGMA["k"] / top, 4 * FP8_SIGMA["v"] / top


def _fp8_problem(be: Backend, case: BenchCase, seed: int, table: PageTable,
                 shape: tuple[int, ...], qshape: tuple[int, ...]) -> tuple[Any, ...]:
    """``case``'s problem over fp8 pools (``fp8_pools``) and float queries of its dtype."""
    h = np.random.default_rng(seed)
    q = h.standard_normal(qshape, dtype=np.float32).astype(numpy_dtype(case.dtype))
    k, v = fp8_pools(be, shape, case.pool_dtype, seed)
    return be.asarray(q), k, v, table


def fp8_pools(be: Backend, shape: tuple[int, ...], fmt: str, seed: int) -> tuple[Any, Any]:
    """K and V pools of ``shape`` in fp8 format ``fmt`` whose codes are drawn from a host
    sample of quantized normals (1M codes, ``fp8.quantize`` with ``fp8_scales``): the
    distribution of a calibrated cache, made on the device by indexing the sample (pools
    of many GB), bytes (``uint8``) on CuPy, ``ml_dtypes`` fp8 arrays elsewhere."""
    h = np.random.default_rng(seed)
    ks, vs = fp8_scales(fmt)
    sample = [fp8.codes(fp8.quantize(h.standard_normal(1 << 20) * FP8_SIGMA[n], fmt, s))
              for n, s in (("k", ks), ("v", vs))]
    if be.name == "cuda":
        import cupy as cp
        g = cp.random.default_rng(seed)

        def pool(smp: np.ndarray) -> Any:
            codes = cp.asarray(smp)
            return fill_slabs(cp, shape, cp.uint8, lambda n: codes[
                g.integers(0, codes.size, (n, *shape[1:]), dtype=cp.int32)])
        return pool(sample[0]), pool(sample[1])
    k, v = (smp[h.integers(0, smp.size, shape)].view(fp8.numpy_fp8(fmt)) for smp in sample)
    return be.asarray(k), be.asarray(v)


def fp8_variants(fmt: str) -> dict[str, Any]:
    """``decode``'s fp8 arguments of pools made by ``fp8_pools`` in format ``fmt``."""
    ks, vs = fp8_scales(fmt)
    return {"kv_dtype": fmt, "k_scale": ks, "v_scale": vs}


def _variants(be: Backend, case: BenchCase, seed: int, like: Any) -> dict[str, Any]:
    """``decode``'s variant arguments of ``case`` (sinks drawn on ``be`` beside ``like``,
    natural units; an fp8 case's format and scales, ``fp8_scales``)."""
    sinks = None
    if case.sinks:
        host = (np.random.default_rng(seed + 7).standard_normal(case.num_qo_heads) * 2)
        with be.launch_context(like):
            sinks = be.asarray(host.astype(np.float32))
    vk = {"window_left": case.window_left,
          "logits_soft_cap": case.soft_cap if case.soft_cap else None, "sinks": sinks}
    if is_fp8(case.pool_dtype):
        vk.update(fp8_variants(case.pool_dtype))
    return vk


def _verify(be: Backend, out: Any, q: Any, k: Any, v: Any, table: PageTable,
            variants: dict[str, Any] | None = None) -> float:
    """Max relative error of requests 0 and B-1 against the float64 oracle (only their
    pages are copied to the host), with ``variants`` (``_variants``) applied."""
    vk = variants or {}
    w = int(vk.get("window_left", -1))
    sinks = vk.get("sinks")
    sinks = None if sinks is None else be.to_numpy(sinks)
    worst = 0.0
    xp = be.array_module()
    on, qn = be.to_numpy(out), be.to_numpy(q)
    for r in sorted({0, table.batch_size - 1}):
        ids = xp.asarray(np.asarray(table.request_pages(r), dtype=np.int64))
        fpo, n = int(table.first_page_offset[r]), int(table.visible_lens[r])
        kv = []
        for pool, scale in ((k, vk.get("k_scale", 1.0)), (v, vk.get("v_scale", 1.0))):
            rows = be.to_numpy(pool[ids])
            run = rows.reshape(-1, *rows.shape[2:])[fpo:fpo + n]
            run = (fp8.dequantize(run, vk["kv_dtype"], scale).astype(np.float64)
                   if vk.get("kv_dtype") else run.astype(np.float64))
            kv.append(run if w < 0 else run[max(0, n - 1 - w):])
        ref, _ = attention_f64(qn[r].astype(np.float64), kv[0], kv[1],
                               1.0 / np.sqrt(qn.shape[-1]),
                               soft_cap=vk.get("logits_soft_cap"), sinks=sinks)
        worst = max(worst, row_rel_error(on[r], ref))   # per (request, head) row
    return worst


def verifier(be: Backend, arm: Any, q: Any, k: Any, v: Any, table: PageTable,
             variants: dict[str, Any] | None = None) -> Callable[[], float]:
    """A function running ``arm`` once and returning its max relative error against the
    oracle (the output the call returns, else ``arm.out``)."""
    def verify() -> float:
        return _verify(be, output_of(arm.call(), arm.out), q, k, v, table, variants)
    return verify


def time_arm(be: Backend, arm: str, call: Callable[[], Any], verify: Callable[[], float],
             nbytes: int, tolerance: float, expected: tuple[str, ...], *, warmup: int,
             reps: int, cold_l2: bool | str, ran: str | None = None,
             api_call: Callable[[], Any] | None = None, graph: bool = True,
             check_output: Callable[[Any], float] | None = None,
             layers: Sequence[Arm] = ()) -> ArmResult:
    """Run ``call`` once, verify it (``verify`` returns the max relative error against the
    oracle), record what ran (``ran``, else the last decode outcome's path), then time it:
    on a GPU backend GPU time and per-call wall time (and ``api_call``'s per-call time when
    given); host time otherwise. GB/s uses ``nbytes``. An arm that fails verification is
    not timed.

    GPU time comes from CUDA-graph replay when ``graph``: the call is captured once, and
    with ``check_output`` (the max relative error of a given output array) the graph's
    output is NaN-poisoned, replayed and verified, so a graph that does not do the work
    cannot be timed. When capture fails, or the replay does not reproduce the output,
    eager CUDA events are used instead and ``note`` says why.

    ``layers`` (2 or more, with ``graph`` and ``check_output``): the arm built once per
    layer over that layer's pools and table, layer 0's first (its call is ``call``); the
    graph holds every layer's call and GPU time is per call
    (``layers.graph_layer_times``). A layer whose replayed output fails the check, or two
    layers sharing an output buffer, leave the arm unverified and untimed, with the layers
    in ``note``; a failed capture falls back to one eager call between events.
    ``call``, ``host`` and ``api_call`` stay layer 0's, one call each."""
    call()
    if ran is None:
        done = last_outcome()
        ran = done.path if done else "?"
    err = verify()
    res = ArmResult(arm, ran, err, bool(err <= tolerance), expected=expected)
    if not res.verified:
        return res
    if be.name == "cuda":
        times = None
        if graph and len(layers) > 1:
            try:
                times = graph_layer_times(be, layers, check_output, tolerance, warmup=warmup,
                                          reps=reps, cold_l2=cold_l2)
                res.gpu_mode, res.graph_layers = "graph", len(layers)
            except LayerOutputError as exc:
                res.verified, res.max_rel_error, res.note = False, exc.error, str(exc)
                return res
            except timing.GraphCaptureError as exc:
                cause = _out_of_memory_behind(exc)  # the N layers' graph: fewer may fit
                if cause is not None:               # (time_arms retries)
                    raise cause from None
                res.note = (f"graph timing of {len(layers)} layers unusable "
                            f"({str(exc)[:160]}); one eager call between events")
        elif graph:
            try:
                replay, result = timing.capture(call)
                target = output_of(result, None)
                if check_output is not None and target is not None:
                    be.asarray(target).fill(float("nan"))
                    replay()
                    timing.synchronize()
                    gerr = check_output(target)
                    if not gerr <= tolerance:
                        raise timing.GraphCaptureError(
                            f"the replayed graph did not reproduce the output (max rel "
                            f"error {gerr:.3g})")
                times = timing.replay_times(replay, warmup=warmup, reps=reps,
                                            cold_l2=cold_l2)
                res.gpu_mode = "graph"
            except timing.GraphCaptureError as exc:
                res.note = f"graph timing unusable ({str(exc)[:160]}); eager events"
        if times is None:
            times = timing.cuda_event_times(call, warmup=warmup, reps=reps, cold_l2=cold_l2)
            res.gpu_mode = "events"
        res.gpu = timing.stats(times)
        res.call = timing.stats(timing.cuda_per_call_times(call, warmup=warmup, reps=reps))
        res.host = timing.stats(timing.host_enqueue_times(call, warmup=warmup,
                                                          reps=max(reps, 40)))
        if api_call is not None:
            res.api_call = timing.stats(timing.cuda_per_call_times(api_call, warmup=warmup,
                                                                   reps=reps))
    else:
        def synced() -> None:   # lazy backends (MLX) compute only when synchronized
            r = call()
            be.synchronize(*(r if isinstance(r, tuple) else (r,)))
        res.call = timing.stats(timing.host_times(synced, warmup=min(warmup, 2),
                                                  reps=max(3, reps // 6)))
    res.gbps = nbytes / (res.median_us * 1e-6) / 1e9
    return res


def _out_of_memory_behind(exc: BaseException) -> BaseException | None:
    """The device out-of-memory error behind ``exc``, if any: its causes and the errors
    it was raised while handling (a capture's own cleanup can raise after the allocation
    failed inside it, so the failure sits in ``__context__``, not ``__cause__``)."""
    todo, seen = [exc.__cause__, exc.__context__], {id(exc)}
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        if out_of_memory(e):
            return e
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
    return None


def bench_case(be: Backend, case: BenchCase, *, arms: tuple[str, ...] = ("gather", "v1", "v2"),
               warmup: int = 5, reps: int = 30, cold_l2: bool | str = True, seed: int = 0,
               graph: bool = True, graph_layers: int = 1) -> BenchResult:
    """Verify, then time, every arm of one case on ``be``. An arm that cannot run here
    (``ArmUnavailable``, or out of device memory) is reported as unverified with the
    reason in ``note``; so is every arm of a case whose pools do not fit the device.
    ``graph_layers`` > 1 (cuda, ``graph``): N calls per replay over N layers' pools and
    tables (the module docstring), N capped by device memory and halved while the copies
    run out of it (``layers.layer_pools``, noted in ``layers_note``); the copies are
    released after the case."""
    check_graph_layers("bench_case", graph_layers, be.name, graph)
    release_memory(be)      # the previous case's pools and the arms' cached blocks
    try:
        q, k, v, table = _problem(be, case, seed)
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        release_memory(be)
        note = (f"the case's K/V pools (about {case.io_bytes() / 2**30:.1f} GiB read per "
                f"call, 1.25x that allocated) do not fit the device's memory: {exc}")
        return BenchResult(case, 0, 0, {arm: ArmResult(
            arm, "unavailable", float("nan"), False, expected=EXPECTED.get(arm, ()),
            note=note) for arm in arms})
    vk = _variants(be, case, seed, q)
    # v2's plan; the v2tc arm plans for its own CTAs (make_arm). It serves every layer's
    # table too: the same requests and lengths at other pages (``DecodePlan.mismatch``)
    plan = plan_decode(table, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                       device=be.device_info(), window_left=case.window_left,
                       kv_dtype=case.kv_dtype or None, path="v2")
    scale = 1.0 / float(np.sqrt(case.head_dim))
    more, note = (layer_pools(be, k, v, table, graph_layers) if graph_layers > 1
                  else ([], ""))
    n_layers = 1 + len(more)
    results = time_arms(be, arms, q, k, v, table, plan, scale, case.io_bytes(),
                        TOLERANCE[case.dtype], vk, warmup=warmup, reps=reps,
                        cold_l2=cold_l2, graph=graph, more_layers=more)
    if more:
        del more            # the copies go now, not at the next case's release
        release_memory(be)
    return BenchResult(case, plan.num_chunks, plan.pages_per_chunk, results,
                       graph_layers=n_layers, layers_note=note)


def time_arms(be: Backend, arms: tuple[str, ...], q: Any, k: Any, v: Any, table: PageTable,
              plan: DecodePlan, sm_scale: float, nbytes: int, tolerance: float,
              variants: dict[str, Any] | None = None, *, warmup: int, reps: int,
              cold_l2: bool | str, graph: bool = True,
              more_layers: Sequence[LayerPools] = ()) -> dict[str, ArmResult]:
    """Build (``make_arm``), verify and time each of ``arms`` on one problem; an arm that
    cannot run here (``ArmUnavailable``, or out of device memory) is reported unverified
    with the reason in ``note``. ``more_layers``: the pools and tables of layers 1 .. N-1
    (``layers.layer_pools``): each arm is also built over each of them (the same ``q``,
    plan and variants; its own output) and the N calls timed in one graph (``time_arm``'s
    ``layers``), every layer's output checked against the oracle of ``k`` / ``v`` /
    ``table`` (each layer holds those tokens, at other pages). An arm whose N layers run
    out of device memory (its per-layer buffers: outputs, FlashInfer's workspaces, SDPA's
    contiguous K/V) is built and timed again over the first N // 2 layers, down to 1, and
    its ``graph_layers`` and ``note`` say so."""
    results = {}
    for arm in arms:
        n = 1 + len(more_layers)
        notes: list[str] = []
        while True:
            res, why = _time_layers(be, arm, q, k, v, table, plan, sm_scale, nbytes, tolerance,
                                    variants, warmup=warmup, reps=reps, cold_l2=cold_l2,
                                    graph=graph, more_layers=more_layers[:n - 1])
            # _time_layers has returned: a failed arm's buffers and graphs are unreferenced,
            # and go before the next attempt or arm
            if res is None or res.ran == "unavailable":
                release_memory(be)
            if res is not None:
                break
            notes.append(f"graph layers {n} ran out of device memory building or timing "
                         f"this arm's layers ({why}); retried with {n // 2}")
            n //= 2
        res.note = "; ".join([*notes, *([res.note] if res.note else [])])
        results[arm] = res
    return results


def _time_layers(be: Backend, arm: str, q: Any, k: Any, v: Any, table: PageTable,
                 plan: DecodePlan, sm_scale: float, nbytes: int, tolerance: float,
                 variants: dict[str, Any] | None, *, warmup: int, reps: int,
                 cold_l2: bool | str, graph: bool,
                 more_layers: Sequence[LayerPools]) -> tuple[ArmResult | None, str]:
    """``time_arms``'s one attempt at ``arm`` over layer 0 and ``more_layers``:
    ``(result, why)``; ``why`` is the out-of-memory error ("" without one), and ``result``
    is None when it came with more than one layer (``time_arms`` then tries fewer), an
    unavailable arm's result with one layer."""
    why = ""
    try:
        a = make_arm(arm, be, q, k, v, table, plan, sm_scale, variants)
        layers = [a, *(make_arm(arm, be, q, m.k, m.v, m.table, plan, sm_scale, variants)
                       for m in more_layers)] if more_layers else []
        # every layer is checked against the case's pools and table: the tokens each
        # layer's own table reads from its own pools (``layers.shifted_table``)
        res = time_arm(be, arm, a.call, verifier(be, a, q, k, v, table, variants),
                       nbytes, tolerance, a.expected, warmup=warmup, reps=reps,
                       cold_l2=cold_l2, ran=a.ran, api_call=a.api_call, graph=graph,
                       check_output=lambda o: _verify(be, o, q, k, v, table, variants),
                       layers=layers)
        res.plan = a.plan
        return res, ""
    except Exception as exc:
        if not isinstance(exc, ArmUnavailable) and not out_of_memory(exc):
            raise
        if isinstance(exc, ArmUnavailable):
            note = str(exc)
        else:
            why = f"{type(exc).__name__}: {str(exc)[:160]}"
            if more_layers:
                return None, why
            note = f"out of device memory: {exc}"
    return ArmResult(arm, "unavailable", float("nan"), False, expected=EXPECTED.get(arm, ()),
                     note=note), why


def run_bench(cases: list[BenchCase], *, backend: str | Backend | None = None,
              arms: tuple[str, ...] = ("gather", "v1", "v2"), warmup: int = 5, reps: int = 30,
              cold_l2: bool | str = True, seed: int = 0, graph: bool = True,
              progress: Callable[[BenchResult], None] | None = None,
              graph_layers: int = 1) -> list[BenchResult]:
    """Verify and time every arm of every case; see the module docstring
    (``graph_layers``: calls per graph replay, each over its own layer's pools)."""
    be = get_backend(backend)
    check_graph_layers("run_bench", graph_layers, be.name, graph)
    results = []
    for case in cases:
        r = bench_case(be, case, arms=arms, warmup=warmup, reps=reps, cold_l2=cold_l2,
                       seed=seed, graph=graph, graph_layers=graph_layers)
        results.append(r)
        if progress:
            progress(r)
    return results
