"""Host time of a replan on the CPU: ``make_plan`` for the tensor-core partial by the wave
rule (``waves.py``) against the target rule, as a ``DecodeStep`` replans (headroom 64).

Usage: python bench/plan_host.py [OUT.json]

The H200 as the CUDA backend describes it (132 SMs, 228 KB of shared memory per SM),
Llama-3-8B heads (32/8 x 128), float16 pools, page 16, uniform batches 1-128 x 4K-32K.
Each cell: the median of 200 calls per rule after 20 warm-ups, the hint (the previous
plan's chunk size) given as a replan gives it. Plans are pure host work, so no device is
needed; the numbers are this machine's.
"""

from __future__ import annotations

import json
import platform
import sys
import time

import numpy as np

from paged_decode.device import DeviceInfo
from paged_decode.page_table import PageTable
from paged_decode.plan import make_plan
from paged_decode.specs import v2tc_slots_per_unit

H200 = DeviceInfo("cuda", "NVIDIA H200", 132, 2, min_chunk_tokens=128, ragged_split=0.5,
                  shared_mem_per_unit=233472)
HQ, HKV, D, P, HEADROOM, CALLS, WARMUP = 32, 8, 128, 16, 64, 200, 20


def uniform(batch: int, context: int) -> PageTable:
    n = -(-context // P)
    return PageTable.build(np.arange(batch * n, dtype=np.int32),
                           np.arange(batch + 1, dtype=np.int64) * n,
                           np.full(batch, context - (n - 1) * P), page_size=P)


def median_us(table: PageTable, slots: int) -> tuple[float, int]:
    """The median host time of one replan (us) and the plan's chunk count."""
    first = make_plan(table, HQ, HKV, D, device=H200, headroom=HEADROOM, slots_per_unit=slots)
    hint = first.pages_per_chunk
    times = []
    for i in range(WARMUP + CALLS):
        t0 = time.perf_counter()
        make_plan(table, HQ, HKV, D, device=H200, headroom=HEADROOM, hint=hint,
                  slots_per_unit=slots)
        if i >= WARMUP:
            times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6), first.num_chunks


def main() -> None:
    slots = v2tc_slots_per_unit(D, "float16", H200)
    rows = []
    print(f"{'cell':>12} {'wave us':>8} {'target us':>9} {'chunks wave / target':>21}")
    for ctx in (4096, 16384, 32768):
        for batch in (1, 8, 32, 64, 128):
            t = uniform(batch, ctx)
            wave, cw = median_us(t, slots)
            target, ct = median_us(t, 0)
            rows.append({"batch": batch, "context": ctx, "wave_us": wave, "target_us": target,
                         "chunks_wave": cw, "chunks_target": ct})
            print(f"{batch:>4} x {ctx:>5} {wave:8.1f} {target:9.1f} {cw:>10} / {ct}")
    w = [r["wave_us"] for r in rows]
    g = [r["target_us"] for r in rows]
    print(f"wave rule {min(w):.1f}-{max(w):.1f} us, target rule {min(g):.1f}-{max(g):.1f} us "
          f"(slots per SM {slots}; {platform.processor() or platform.machine()})")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"machine": platform.platform(), "python": platform.python_version(),
                       "slots_per_unit": slots, "calls": CALLS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
