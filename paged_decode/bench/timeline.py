"""Where a kernel launch's time goes, CTA by CTA: the summary of the per-CTA timeline
stamps a kernel compiled with ``PD_TIMELINE`` writes (``kernels/common.py`` ``pd_stamp``;
``PAGED_DECODE_TIMELINE=1``, ``bench/device/timeline.py`` runs it on the GPU).

A record is ``PD_TIMELINE_FIELDS`` (5) ``uint64`` per CTA, in grid order: the SM the CTA
ran on, then ``%globaltimer`` nanoseconds at its stamps (0: not reached). The tensor-core
partial stamps 0 at its start, 1 when its first K/V stage has landed, 2 when its loop
ends and 3 when its output rows are written; a CTA over an empty chunk has no stamp 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: uint64 per CTA: the SM, then four stamps (``PD_TIMELINE_FIELDS`` in the kernels)
FIELDS = 5


def summarize(records: Any) -> dict[str, float]:
    """The launch's shape from ``records`` (``uint64 [CTAs, FIELDS]``; rows whose start
    stamp is 0 never ran and are left out), times in microseconds from the first CTA's
    start:

    - ``span_us``: first start to last output write;
    - ``start_p50_us`` / ``start_max_us``: when CTAs started (a late start is a later
      wave, or the launch ramp);
    - ``prologue_us`` (median, and ``prologue_p90_us``): start to the first stage landed
      (the dependent loads of the request, its pages and the first copies);
    - ``stream_us`` (median): first stage to the loop's end;
    - ``epilogue_us`` (median): loop end to the rows written (the warps' combine);
    - ``end_p50_us`` / ``tail_us``: the median CTA's end, and how long the last CTA
      outlasts it;
    - ``sm_idle``: the fraction of ``span_us`` an SM, on average over the SMs that ran
      any CTA, held none (the union of its CTAs' intervals against the span);
    - ``ctas``, ``sms``, ``ctas_per_sm_max``.

    Raises ``ValueError`` when ``records`` is not ``[N, FIELDS]`` or no CTA ran."""
    r = np.asarray(records)
    if r.ndim != 2 or r.shape[1] != FIELDS:
        raise ValueError(f"summarize: records must be [CTAs, {FIELDS}], got shape {r.shape}")
    r = r[r[:, 1] != 0]
    if r.shape[0] == 0:
        raise ValueError("summarize: no CTA wrote a start stamp (was the buffer pointed at "
                         "before the launch, with PAGED_DECODE_TIMELINE=1?)")
    stamps = r[:, 1:].astype(np.float64)
    stamps[r[:, 1:] == 0] = np.nan
    t = (stamps - np.nanmin(stamps[:, 0])) / 1e3                  # us from the first start
    start, first, loop_end, end = t.T
    sm = r[:, 0].astype(np.int64)
    span = float(np.nanmax(end))
    busy = []
    for s in np.unique(sm):
        lo, hi = start[sm == s], end[sm == s]
        order = np.argsort(lo)
        covered, reach = 0.0, -np.inf
        for a, b in zip(lo[order], hi[order]):
            if np.isnan(b):
                continue
            if a > reach:
                covered += b - a
                reach = b
            elif b > reach:
                covered += b - reach
                reach = b
        busy.append(covered)
    per_sm = np.bincount(sm)
    return {
        "ctas": float(r.shape[0]),
        "sms": float(np.unique(sm).size),
        "ctas_per_sm_max": float(per_sm.max()),
        "span_us": span,
        "start_p50_us": float(np.nanmedian(start)),
        "start_max_us": float(np.nanmax(start)),
        "prologue_us": float(np.nanmedian(first - start)),
        "prologue_p90_us": float(np.nanpercentile(first - start, 90)),
        "stream_us": float(np.nanmedian(loop_end - first)),
        "epilogue_us": float(np.nanmedian(end - loop_end)),
        "end_p50_us": float(np.nanmedian(end)),
        "tail_us": float(np.nanmax(end) - np.nanmedian(end)),
        "sm_idle": float(1.0 - np.mean(busy) / span) if span > 0 else 0.0,
    }
