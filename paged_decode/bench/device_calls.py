"""Counting an engine step's device calls on the host (issue #13: the host time of a
captured step is the number of CUDA API calls it makes, each 10-40 us on the H200 host).

``DeviceCalls(backend)`` is a context manager that counts, while it is entered, the
calls the host makes to the backend's device entry points of a step:

- ``stage_int32``: host-to-device uploads (``step_upload.StepUpload``);
- ``update_table``: table updates the host makes (the launch and, on the CUDA dialect,
  the device copy before it); a captured graph's own update is not one;
- ``device_copy``: device-to-device copies made through the backend's hook;
- ``replay_graph``: graph replays;
- ``launch:<kernel>``: kernel launches through ``_run`` outside a graph replay, and
  ``graph:<kernel>`` those a graph replay makes (the ``emulated-cuda`` backend replays
  its recorded graphs through ``_run``; on ``cuda`` a graph's launches never reach the
  host, and recorded launches replay without ``_run``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

#: the counted entry points (besides ``_run``)
CALLS = ("stage_int32", "update_table", "device_copy", "replay_graph")


class DeviceCalls:
    """The counts (``counts``, a ``Counter`` by name) of one backend instance's device
    calls while entered; ``take()`` returns them and starts again from zero."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.counts: Counter[str] = Counter()
        self._in_graph = 0
        self._saved: dict[str, Any] = {}

    def take(self) -> dict[str, int]:
        out = dict(self.counts)
        self.counts.clear()
        return out

    def __enter__(self) -> DeviceCalls:
        be = self.backend
        self._saved = {n: be.__dict__[n] for n in (*CALLS, "_run") if n in be.__dict__}
        for name in CALLS:
            if hasattr(be, name):
                setattr(be, name, self._wrap(name, getattr(be, name)))
        if hasattr(be, "_run"):
            real = be._run

            def run(launch: Any) -> Any:
                where = "graph" if self._in_graph else "launch"
                if not getattr(launch, "empty", False):
                    self.counts[f"{where}:{launch.spec.kernel}"] += 1
                return real(launch)
            be._run = run
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in (*CALLS, "_run"):        # the instance's own attributes back
            self.backend.__dict__.pop(name, None)
        self.backend.__dict__.update(self._saved)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*a: Any, **kw: Any) -> Any:
            self.counts[name] += 1
            if name != "replay_graph":
                return fn(*a, **kw)
            self._in_graph += 1
            try:
                return fn(*a, **kw)
            finally:
                self._in_graph -= 1
        return counted


__all__ = ["CALLS", "DeviceCalls"]
