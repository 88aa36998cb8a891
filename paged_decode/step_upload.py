"""A step table's one host-to-device upload per step: the append descriptor and the
table delta in one fixed device buffer.

An engine step sends two small int32 arrays to the device: the append kernel's
descriptor (``kernels/append.py``, ``[5, capacity]``) and the step table's delta
(``kernels/table_update.DELTA_SECTIONS``). Each CUDA API call costs host time, so they
travel together: one host buffer, one asynchronous copy into one device buffer, laid out
(int32 words)

- ``desc [5 * capacity]``: the descriptor (``DecodeStep.begin``; unused by a table
  without a step);
- ``delta [7 * capacity + 2 + page_capacity]``: the delta's header, then its new page
  ids (a delta never holds more new ids than the table has pages, so the tail holds
  any delta of this table; the buffer is made again only with the table's buffer,
  whose ``layout`` change makes captures stale anyway).

Only the used prefix is copied. The kernels read views of the device buffer at fixed
addresses, so recorded launches and captured graphs keep reading the latest upload.
Backends without such a buffer (``Backend.staging_buffer`` returns ``None``: the Metal
dialect, MLX, the array-op backends) keep host arrays: the descriptor is passed per
call, the delta is applied from the host.

The device buffer is rewritten by the next step's copy, ordered after this step's work
on the same stream (an engine's steps run on one stream). The host side of the copy is a
pinned buffer the CUDA backend reuses only once the copy that last read it has finished
(``backends/cuda_staging.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .kernels.table_update import delta_header_words


class StepUpload:
    """The upload buffers of a step table of ``capacity`` rows and ``page_capacity`` page
    slots on ``backend`` (made on the current device).

    Attributes: ``staged`` (whether there is a device buffer), ``device`` (int32
    ``[5 * capacity + 7 * capacity + 2 + page_capacity]``, or ``None``), ``desc`` (its
    first ``5 * capacity`` words as ``[5, capacity]``) and ``delta`` (the rest).
    """

    def __init__(self, backend: Any, capacity: int, page_capacity: int) -> None:
        self.backend = backend
        self.capacity = capacity
        self.desc_words = 5 * capacity
        self.delta_words = delta_header_words(capacity) + page_capacity
        self.device: Any = backend.staging_buffer(self.desc_words + self.delta_words)
        self.staged = self.device is not None
        if self.staged:
            self.desc: Any = self.device[:self.desc_words].reshape(5, capacity)
            self.delta: Any = self.device[self.desc_words:]

    def send(self, desc: np.ndarray | None, delta: np.ndarray | None) -> Any:
        """Upload ``desc`` (int32 ``[5, capacity]``, C-contiguous) and ``delta`` (int32
        ``[words]``), either may be ``None``, with one copy on the current stream (none
        when both are ``None`` or there is no device buffer). Returns what the table
        update reads: the device delta view, or ``delta`` itself without staging."""
        if not self.staged:
            return delta
        if delta is not None and delta.size > self.delta_words:
            raise RuntimeError(f"StepUpload.send: a delta of {delta.size} words does not fit "
                               f"the staging buffer's {self.delta_words} (a table invariant "
                               "broke: a delta holds at most page_capacity new ids)")
        if desc is not None and delta is not None:
            self.backend.stage_int32(self.device, desc, delta)   # contiguous: one copy
        elif desc is not None:
            self.backend.stage_int32(self.device, desc)
        elif delta is not None:
            self.backend.stage_int32(self.delta, delta)
        return self.delta


__all__ = ["StepUpload"]
