"""Where an engine step's time goes (CUDA): host parts of ``begin`` and replay, a
cProfile of the captured loop, and every launch's GPU time.

Usage: python3 bench/device/profile_engine.py OUT_JSON [BATCH ...]   (default 8 64 128)

Per batch (the engine suite's case: float16, 32/8 x 128, page 16, 32 layers, ragged 1K):
- host: median microseconds of ``begin``'s parts (the general begin's ``_reserve_rows``,
  the steady begin's ``SteadyBegin.advance``, ``StepTable.send`` with its one upload
  ``stage_int32`` of the table delta and the append descriptor, the replan check) and of
  the graph replay call (``replay_graph``), over 30 steps; the upload's parts (its event
  wait, ``cudaMemcpyAsync``, event record and the rest: ``bench.staging_timer``); the
  host's device calls per begin and per replay (``DeviceCalls``: one upload per begin and
  no table update outside the graph expected), and the host time of an eager step's
  pending table update (``apply_pending``: a device copy and a recorded launch);
- the top functions of a cProfile of 20 captured steps (tottime), to the log;
- GPU: the step's launches queued behind a spin kernel (so the host is ahead and the
  GPU runs them back to back), a CUDA event after each ``begin`` / ``append`` /
  ``decode`` call; the event deltas are each call's GPU time (a call's kernels plus the
  gap to the next; ``update``: the table update an eager step runs first); their sum is
  the step's kernel sum. The captured graph's GPU time (events around a replay; it
  starts with the table update) is measured in the same process.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time

import cupy as cp
import numpy as np

from paged_decode.backends import get_backend
from paged_decode.backends.cuda_staging import PinnedStaging
from paged_decode.bench.device_calls import DeviceCalls
from paged_decode.bench.engine import _pool
from paged_decode.bench.engine_case import EngineCase
from paged_decode.bench.staging_timer import PARTS, TimedCuda
from paged_decode.engine_step import DecodeStep
from paged_decode.steady_step import SteadyBegin

_SPIN = cp.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}""", "spin")


def spin(ms: float) -> None:
    _SPIN((1,), (1,), (np.int64(int(ms * 1.9e6)),))   # ~1.9 GHz SM clock


def timed(obj, name, acc):
    fn = getattr(obj, name)

    def wrapped(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc.setdefault(name, []).append(time.perf_counter() - t0)
    setattr(obj, name, wrapped)


def med(xs):
    return float(np.median(xs) * 1e6) if xs else float("nan")


def profile(batch: int) -> dict:
    be = get_backend("cuda")
    case = EngineCase(batch, steps=100)       # the pool holds 100 steps of growth (84 run)
    pool, seqs, _ = _pool(be, case, 0)
    step = DecodeStep(pool, seqs, num_qo_heads=case.num_qo_heads, headroom=case.headroom)
    cap = step.capacity
    rng = np.random.default_rng(2)

    def fresh(shape):
        return cp.asarray(rng.standard_normal(shape).astype(np.float16))

    qs = [fresh((cap, 32, 128)) for _ in range(case.layers)]
    ks = [fresh((cap, 8, 128)) for _ in range(case.layers)]
    outs = [cp.empty((cap, 32, 128), cp.float16) for _ in range(case.layers)]

    def body(st):
        for layer in range(case.layers):
            st.append(layer, ks[layer], ks[layer])
            st.decode(layer, qs[layer], out=outs[layer])

    for _ in range(3):                      # compile, prepare
        step.begin()
        body(step)
    cp.cuda.Device().synchronize()

    # ---- host parts of begin() and of the replay
    acc: dict = {}
    timed(step.pool, "_reserve_rows", acc)          # the general begin's part
    timed(SteadyBegin, "advance", acc)              # the steady begin's part
    timed(step.table, "send", acc)                  # the delta + descriptor upload
    timed(be, "stage_int32", acc)                   # its one copy
    timed(step, "_replan_if_needed", acc)
    timed(be, "replay_graph", acc)
    step.begin()
    graph = step.capture(body)
    cp.cuda.Device().synchronize()
    acc.clear()
    begins, replays, calls_begin, calls_replay = [], [], [], []
    with DeviceCalls(be) as calls:
        for _ in range(30):
            t0 = time.perf_counter()
            step.begin()
            t1 = time.perf_counter()
            calls_begin.append(calls.take())
            if graph.stale:
                graph = step.capture(body)
                calls.take()
            else:
                graph.replay()
                calls_replay.append(calls.take())
            t2 = time.perf_counter()
            cp.cuda.Device().synchronize()
            begins.append(t1 - t0)
            replays.append(t2 - t1)
    host = {k: med(v) for k, v in acc.items()}
    host["begin"] = med(begins)
    host["replay"] = med(replays)
    # the one upload's parts: its CUDA calls timed through the staging's cuda module (a
    # new staging: its first two uploads allocate pinned buffers and are left out)
    staging, timer = be._staging, TimedCuda(cp)
    be._staging = PinnedStaging(cuda=timer)
    first = len(acc.get("stage_int32", []))
    for i in range(32):
        if i == 2:
            timer.clear()
            first = len(acc.get("stage_int32", []))
        step.begin()
        if graph.stale:
            graph = step.capture(body)
        else:
            graph.replay()
        cp.cuda.Device().synchronize()
    be._staging = staging
    upload = {"total": med(acc.get("stage_int32", [])[first:])}
    upload.update({part: med(timer.seconds.get(part, [])) for part in PARTS})
    upload["rest"] = upload["total"] - sum(upload[p] for p in PARTS if upload[p] == upload[p])
    host["upload_parts"] = upload
    # an eager step's pending update (the device copy and the recorded launch), host time
    updates = []
    for _ in range(20):
        step.begin()
        t0 = time.perf_counter()
        step.table.apply_pending()
        updates.append(time.perf_counter() - t0)
        body(step)
        cp.cuda.Device().synchronize()
    host["apply_pending"] = med(updates)
    device_calls = {"per_begin": calls_begin[-1] if calls_begin else {},
                    "per_replay": calls_replay[-1] if calls_replay else {},
                    "begins_counted": len(calls_begin), "replays_counted": len(calls_replay),
                    "all_begins_alike": all(c == calls_begin[-1] for c in calls_begin[1:]),
                    "all_replays_alike": all(c == calls_replay[-1] for c in calls_replay)}

    # ---- cProfile of 20 captured steps
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        step.begin()
        if graph.stale:
            graph = step.capture(body)
        else:
            graph.replay()
        cp.cuda.Device().synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(f"==== cProfile B{batch} (20 captured steps)\n{s.getvalue()}")

    # ---- GPU time per call, queued behind a spin
    stream = cp.cuda.get_current_stream()
    per: dict = {"begin": [], "update": [], "append": [], "decode": []}
    graph_gpu = []
    for _ in range(5):
        cp.cuda.Device().synchronize()
        spin(20.0)
        ev = [stream.record()]
        names = []
        step.begin()
        ev.append(stream.record())
        names.append("begin")
        step.table.apply_pending()          # what the first append would run
        ev.append(stream.record())
        names.append("update")
        for layer in range(case.layers):
            step.append(layer, ks[layer], ks[layer])
            ev.append(stream.record())
            names.append("append")
            step.decode(layer, qs[layer], out=outs[layer])
            ev.append(stream.record())
            names.append("decode")
        ev[-1].synchronize()
        for n, a, b in zip(names, ev, ev[1:]):
            per[n].append(cp.cuda.get_elapsed_time(a, b) * 1e3)
        # the captured graph's GPU time, also behind a spin
        step.begin()
        if graph.stale:                     # a replan: the capture ran the step once
            graph = step.capture(body)
            step.begin()
        cp.cuda.Device().synchronize()
        spin(5.0)
        e0 = stream.record()
        graph.replay()
        e1 = stream.record()
        e1.synchronize()
        graph_gpu.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3)
    reps = 5
    gpu = {n: float(np.sum(v) / reps) for n, v in per.items()}
    gpu["kernel_sum"] = sum(gpu.values())
    gpu["append_per_layer_median"] = float(np.median(per["append"]))
    gpu["decode_per_layer_median"] = float(np.median(per["decode"]))
    gpu["captured_graph"] = float(np.median(graph_gpu))
    launches = {}
    for key, (_, fnc) in step._prepared.items():
        rec = getattr(getattr(fnc, "_launch", fnc), "launches", None)
        if rec is not None:
            launches[str(key[0])] = launches.get(str(key[0]), 0) + len(rec)
    res = {"batch": batch, "host_us": host, "device_calls": device_calls, "gpu_us": gpu,
           "plan": {
        "pages_per_chunk": step.plan.pages_per_chunk,
        "chunks": int(step.plan.request_indices.size),
        "max_chunks_per_request": int(step.plan.chunks_per_request.max())},
        "recorded_launches": launches, "replans": step.replans}
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    out = sys.argv[1]
    batches = [int(x) for x in sys.argv[2:]] or [8, 64, 128]
    json.dump([profile(b) for b in batches], open(out, "w"), indent=1)
