"""Where one tensor-core partial launch spends its time, CTA by CTA (CUDA, diagnostics):
each CTA's SM and ``%globaltimer`` stamps at its start, first K/V stage landed, loop end
and rows written (``PAGED_DECODE_TIMELINE=1`` compiles the kernels with ``PD_TIMELINE``;
``paged_decode.bench.timeline.summarize`` reads them).

Usage on the GPU machine: python3 bench/device/timeline.py OUT.json CELL [CELL ...]
CELL: BATCHxCONTEXT[:KV_DTYPE], e.g. 8x8192 8x8192:float8_e4m3fn (Llama-3-8B heads,
32/8 x 128, page 16, float16 queries; the bench's problem, plan and variants).

Per cell: one stamped call after L2 is flushed (as the bench times its calls; TIMELINE_L2
"clean", the default, or "dirty": ``paged_decode.bench.timing``; both with TIMELINE_L2=both,
the dirty call's summary under ``dirty``), its summary, the call's GPU time between CUDA
events (the merge launch included), and the raw records in the JSON. The stamps cost a
few instructions per CTA; the call's time is for orientation, not a benchmark.
"""

import json
import os
import sys

os.environ["PAGED_DECODE_TIMELINE"] = "1"      # before any kernel compiles

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from paged_decode import decode, plan_decode  # noqa: E402
from paged_decode.backends import get_backend  # noqa: E402
from paged_decode.backends.cuda_launch import point_timeline  # noqa: E402
from paged_decode.bench.cases import BenchCase  # noqa: E402
from paged_decode.bench.runner import _problem, _variants  # noqa: E402
from paged_decode.bench.timeline import FIELDS, summarize  # noqa: E402
from paged_decode.bench.timing import L2_FLUSH_BYTES, l2_flush_kind, l2_flusher  # noqa: E402

be = get_backend("cuda")
buffer = cp.ones(L2_FLUSH_BYTES // 4, cp.int32)
FLUSHES = (("clean", "dirty") if os.environ.get("TIMELINE_L2") == "both"
           else (l2_flush_kind(os.environ.get("TIMELINE_L2", "clean")),))


def flush(kind: str) -> None:
    """L2 left as ``kind`` says (the bench's two cold flushes)."""
    l2_flusher(buffer, kind)(0)


def run_cell(cell: str) -> dict:
    """One cell's stamped call: its summary, GPU time and raw records."""
    shape, _, kv_dtype = cell.partition(":")
    b, ctx = (int(x) for x in shape.split("x"))
    case = BenchCase(b, ctx, 16, 32, 8, 128, kv_dtype=kv_dtype)
    q, k, v, table = _problem(be, case, 0)
    vk = _variants(be, case, 0, q)
    plan = plan_decode(table, 32, 8, 128, device=be.device_info(), path="v2tc",
                       kv_dtype=kv_dtype or None)
    out = cp.empty(q.shape, q.dtype)

    def call():
        return decode(q, k, v, table, plan, path="v2tc", out=out, backend=be,
                      sm_scale=1 / np.sqrt(128), **vk)
    call()                                        # compiles, and the stamped modules exist
    result = {"cell": cell, "chunks": plan.num_chunks}
    for kind in FLUSHES:
        s, rec = stamped(call, plan.num_ctas, kind)
        print(f"{cell:24s} {kind:5s} CTAs {s['ctas']:5.0f} on {s['sms']:3.0f} SMs (<= "
              f"{s['ctas_per_sm_max']:.0f} each) call {s['call_us']:8.1f} us  span "
              f"{s['span_us']:8.1f}  starts p50 / max {s['start_p50_us']:6.1f} / "
              f"{s['start_max_us']:6.1f}  prologue {s['prologue_us']:5.1f} (p90 "
              f"{s['prologue_p90_us']:5.1f})  stream {s['stream_us']:7.1f}  epilogue "
              f"{s['epilogue_us']:5.1f}  tail {s['tail_us']:6.1f}  SM idle {s['sm_idle']:.0%}",
              flush=True)
        if kind == FLUSHES[0]:
            result.update(summary=s, l2=kind, records=rec.tolist())
        else:
            result[kind] = s
    return result


def stamped(call, num_ctas: int, kind: str) -> tuple[dict, np.ndarray]:
    """One stamped ``call`` after an L2 flush of ``kind``: its summary (with the call's
    GPU time, ``call_us``) and the raw records."""
    buf = cp.zeros((num_ctas, FIELDS), cp.uint64)
    if point_timeline("v2tc", buf) == 0:
        sys.exit("no v2tc module was compiled with timeline stamps")
    flush(kind)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    call()
    end.record()
    end.synchronize()
    point_timeline("v2tc", None)
    rec = cp.asnumpy(buf)
    s = summarize(rec)
    s["call_us"] = cp.cuda.get_elapsed_time(start, end) * 1e3
    return s, rec


rows = []
for cell in sys.argv[2:]:
    rows.append(run_cell(cell))
    json.dump(rows, open(sys.argv[1], "w"), indent=1)    # each cell kept if the run is cut
