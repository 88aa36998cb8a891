"""The per-CTA timeline summary (``paged_decode.bench.timeline``): the phases, the SMs'
idle time and the tail from hand-made records, and what it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode.bench.timeline import FIELDS, summarize

NS = 1000      # stamps are nanoseconds, the summary microseconds


def rec(sm, start, first, loop_end, end):
    return [sm, *(int((t + 100) * NS) if t is not None else 0
                  for t in (start, first, loop_end, end))]


def test_phases_idle_and_tail_of_a_hand_made_launch():
    """Two SMs: SM 0 runs two overlapping CTAs (0-10 and 2-12), SM 1 one CTA (1-6) and a
    later one (8-20) over an empty chunk (no first-stage stamp); one row never ran."""
    r = np.array([rec(0, 0, 2, 8, 10), rec(0, 2, 3, 11, 12), rec(1, 1, 3, 5, 6),
                  rec(1, 8, None, 18, 20), [0, 0, 0, 0, 0]], dtype=np.uint64)
    s = summarize(r)
    assert s["ctas"] == 4 and s["sms"] == 2 and s["ctas_per_sm_max"] == 2
    assert s["span_us"] == pytest.approx(20)
    assert s["start_p50_us"] == pytest.approx(1.5) and s["start_max_us"] == pytest.approx(8)
    assert s["prologue_us"] == pytest.approx(np.median([2, 1, 2]))     # the empty chunk's skipped
    assert s["stream_us"] == pytest.approx(np.median([6, 8, 2]))
    assert s["epilogue_us"] == pytest.approx(np.median([2, 1, 1, 2]))
    assert s["end_p50_us"] == pytest.approx(11) and s["tail_us"] == pytest.approx(9)
    # SM 0 busy 0-12 (12 us), SM 1 busy 1-6 and 8-20 (17 us): idle 1 - 14.5 / 20
    assert s["sm_idle"] == pytest.approx(1 - 14.5 / 20)


def test_an_overlap_inside_another_ctas_interval_is_not_counted_twice():
    r = np.array([rec(3, 0, 1, 9, 10), rec(3, 2, 3, 4, 5)], dtype=np.uint64)
    assert summarize(r)["sm_idle"] == pytest.approx(0.0)


def test_records_of_the_wrong_shape_or_with_no_cta_are_refused():
    with pytest.raises(ValueError, match=r"records must be \[CTAs, 5\]"):
        summarize(np.zeros((3, 4), np.uint64))
    with pytest.raises(ValueError, match="no CTA wrote a start stamp"):
        summarize(np.zeros((3, FIELDS), np.uint64))
