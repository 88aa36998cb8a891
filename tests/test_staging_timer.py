"""``bench.staging_timer.TimedCuda``: a pinned upload through the timed stand-in delivers
the same bytes as through the module it wraps, and each CUDA call the upload makes is
timed once (the split of ``stage_int32`` that ``profile_engine.py`` reports)."""

from __future__ import annotations

import numpy as np
from test_step_upload import _AsyncModel, _DeviceArray

from paged_decode.backends.cuda_staging import PinnedStaging
from paged_decode.bench.staging_timer import PARTS, TimedCuda


def test_timed_uploads_deliver_their_data_and_time_each_call():
    model = _AsyncModel()
    timer = TimedCuda(model)
    staging = PinnedStaging(cuda=timer, pinned=lambda n: np.zeros(n, np.uint8))
    dst = _DeviceArray(16)
    for i in range(5):
        staging.copy(dst, np.arange(8, dtype=np.int32) + i, np.full(4, -i, np.int32))
        model.run()
        np.testing.assert_array_equal(dst.arr[:12], np.concatenate(
            [np.arange(8) + i, np.full(4, -i)]))
    s = timer.seconds
    assert len(s["memcpy_async"]) == len(s["event_record"]) == len(s["current_stream"]) == 5
    assert len(s["event_new"]) == 2                 # one event per pinned buffer (DEPTH 2)
    assert len(s["event_synchronize"]) == 3         # each buffer's reuse waits for its copy
    assert set(s) <= set(PARTS) and all(t >= 0 for v in s.values() for t in v)
    timer.clear()
    assert not timer.seconds
