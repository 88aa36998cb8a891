"""What a decode call actually ran, and why: returned values and process-wide counters.

Benchmarks print these so that a comparison never silently measures a fallback.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeOutcome:
    """One decode call.

    ``path``: ``"v2"``, ``"v2+merge"``, ``"v2tc"``, ``"v2tc+merge"`` (the tensor-core
    partial), ``"v1"``, ``"gather"``, ``"cascade"`` (shared
    prefix; ``detail`` names the members and shared pages), ``"sparse"`` (a selection
    through a ``page_size = 1`` table on the v2 kernels), ``"sparse-masked"`` (the dense
    masked path the sparsity gate chose) or ``"empty"`` (a batch without requests: empty
    results, nothing ran); a multi-token call (``docs/multi-token.md``) is its path with
    ``"+merge"`` (``"v1+merge"``, ``"gather+merge"`` too: each token's states are merged)
    and ``detail`` names its tokens. ``num_chunks``: partial states computed.
    ``detail``: optional extra facts (empty for the flat paths).
    """

    path: str
    backend: str
    batch_size: int
    visible_tokens: int
    num_chunks: int
    reason: str
    detail: str = ""

    def __str__(self) -> str:
        extra = f" [{self.detail}]" if self.detail else ""
        return (f"{self.path} on {self.backend} (batch {self.batch_size}, "
                f"{self.visible_tokens} visible KV tokens, {self.num_chunks} chunks): "
                f"{self.reason}{extra}")


_lock = threading.Lock()
_counts: Counter[str] = Counter()
_last: list[DecodeOutcome] = []


def record(outcome: DecodeOutcome) -> DecodeOutcome:
    with _lock:
        _counts[f"{outcome.backend}:{outcome.path}"] += 1
        _last[:] = [outcome]
    return outcome


def last_outcome() -> DecodeOutcome | None:
    """The outcome of the most recent decode call in this process."""
    return _last[0] if _last else None


def counters() -> dict[str, int]:
    """Calls per ``"backend:path"`` since start (or the last ``reset_counters``)."""
    with _lock:
        return dict(_counts)


def reset_counters() -> None:
    """Zero ``counters()`` and forget ``last_outcome()``."""
    with _lock:
        _counts.clear()
        _last.clear()
