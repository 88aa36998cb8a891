"""Host time of the CUDA calls inside one pinned upload (``backends/cuda_staging``).

``PinnedStaging`` reaches CUDA only through the module it is given (``cuda=``, CuPy by
default): ``cuda.get_current_stream``, ``cuda.Event`` (``record``, ``synchronize``) and
``cuda.runtime.memcpyAsync``. ``TimedCuda`` wraps such a module and records the host
seconds of each of those calls, so a profile can split an upload's time into the event
wait, the copy call, the event record and the rest (the staging's own packing and
bookkeeping: what the calls leave over). Used by ``bench/device/profile_engine.py``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

#: the parts ``TimedCuda`` times, in the order an upload makes them
PARTS = ("event_synchronize", "current_stream", "memcpy_async", "event_record", "event_new")


class _TimedEvent:
    """An event of the wrapped module whose ``record`` / ``synchronize`` are timed."""

    def __init__(self, owner: TimedCuda, event: Any) -> None:
        self._owner, self._event = owner, event

    def record(self, stream: Any = None) -> Any:
        with self._owner.timing("event_record"):
            return self._event.record(stream)

    def synchronize(self) -> Any:
        with self._owner.timing("event_synchronize"):
            return self._event.synchronize()


class _Timing:
    def __init__(self, acc: list[float]) -> None:
        self._acc = acc

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self._acc.append(time.perf_counter() - self._t0)


class TimedCuda:
    """A stand-in for the ``cuda`` argument of ``PinnedStaging`` over ``module`` (an
    object with CuPy's ``cuda`` attribute); ``seconds[part]`` lists every call's host
    time (``PARTS``)."""

    def __init__(self, module: Any) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        real = module.cuda
        owner = self

        def event(*a: Any, **kw: Any) -> _TimedEvent:
            with owner.timing("event_new"):
                ev = real.Event(*a, **kw)
            return _TimedEvent(owner, ev)

        def current_stream() -> Any:
            with owner.timing("current_stream"):
                return real.get_current_stream()

        def memcpy(*a: Any) -> Any:
            with owner.timing("memcpy_async"):
                return real.runtime.memcpyAsync(*a)

        self.cuda = SimpleNamespace(Event=event, get_current_stream=current_stream,
                                    runtime=SimpleNamespace(memcpyAsync=memcpy))

    def timing(self, part: str) -> _Timing:
        return _Timing(self.seconds[part])

    def clear(self) -> None:
        self.seconds.clear()
