"""The bench timers' shared loop and statistics, with fake events (no GPU needed): warm-up
calls are not timed, L2 is flushed before every timed call and outside its events (a read
of the flush buffer for a clean L2, an overwrite for a dirty one), and each iteration's
time is its own event pair."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode.bench import timing


class Clock:
    def __init__(self) -> None:
        self.t = 0.0
        self.log: list[str] = []


def test_event_loop_times_each_call_between_its_own_events():
    clock = Clock()

    class Event:
        def record(self) -> None:
            self.at = clock.t
            clock.log.append("event")

    durations = iter([5.0, 5.0, 1.0, 2.0, 3.0])    # 2 warm-up calls, then 3 timed ones

    def fn() -> None:
        clock.log.append("call")
        clock.t += next(durations)

    def flush(i: int) -> None:
        clock.log.append(f"flush{i}")
        clock.t += 100.0                              # outside the events: not counted

    waited = []
    out = timing._event_loop(fn, warmup=2, reps=3, flush=flush, new_event=Event,
                             elapsed_ms=lambda s, e: e.at - s.at,
                             wait=lambda: waited.append(True))
    np.testing.assert_allclose(out, [1e-3, 2e-3, 3e-3])
    assert clock.log == ["call", "call", "flush0", "event", "call", "event",
                         "flush1", "event", "call", "event", "flush2", "event", "call", "event"]
    assert waited == [True]


def test_event_loop_without_flush_and_stats():
    class Event:
        def record(self) -> None:
            pass

    out = timing._event_loop(lambda: None, warmup=0, reps=4, flush=None, new_event=Event,
                             elapsed_ms=lambda s, e: 2.0, wait=lambda: None)
    assert out.tolist() == [2e-3] * 4
    st = timing.stats(np.array([1e-6, 2e-6, 3e-6, 4e-6, 5e-6]))
    assert st["median_us"] == pytest.approx(3.0)
    assert st["p20_us"] == pytest.approx(1.8) and st["p80_us"] == pytest.approx(4.2)


class Buffer:
    """A flush buffer that logs what is done to it (CuPy's ``fill`` spelling, or torch's
    ``fill_``)."""

    def __init__(self, torch_style: bool) -> None:
        self.log: list[str] = []
        if torch_style:
            self.fill_ = lambda v: self.log.append(f"fill {v}")
        else:
            self.fill = lambda v: self.log.append(f"fill {v}")

    def sum(self) -> int:
        self.log.append("sum")
        return 0


@pytest.mark.parametrize("torch_style", [False, True])
def test_the_clean_flush_reads_the_buffer_and_the_dirty_one_overwrites_it(torch_style):
    for cold_l2, want in ((True, ["sum", "sum"]), ("clean", ["sum", "sum"]),
                          ("dirty", ["fill 0", "fill 1"])):
        buf = Buffer(torch_style)
        flush = timing.l2_flusher(buf, timing.l2_flush_kind(cold_l2))
        flush(0)
        flush(1)
        assert buf.log == want, cold_l2
    assert timing.l2_flush_kind(False) is None
    assert timing.l2_flusher(Buffer(torch_style), None) is None


@pytest.mark.parametrize("bad", ["warm", "Clean", 1, None])
def test_an_unknown_flush_is_refused(bad):
    with pytest.raises(ValueError, match="cold_l2 must be True, False or one of clean, dirty"):
        timing.l2_flush_kind(bad)


def test_host_times_synchronizes_after_every_call():
    log: list[str] = []
    out = timing.host_times(lambda: log.append("call"), warmup=1, reps=2,
                            sync=lambda: log.append("sync"))
    assert log == ["call", "sync", "call", "sync", "call", "sync"] and out.shape == (2,)
