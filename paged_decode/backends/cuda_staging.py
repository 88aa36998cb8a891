"""Small per-step host-to-device copies for the ``cuda`` backend, without allocation.

An engine step uploads a few kilobytes every step (a step table's delta, the append
descriptor). ``cupy.array`` and ``ndarray.set`` allocate or stage pageable memory on
every call. Here each destination gets a pinned host buffer that is reused: the host
writes into it, one ``cudaMemcpyAsync`` on the current stream copies it, and an event
recorded after the copy tells the next write to the same buffer when the copy has read
it (normally long before; a host running steps ahead waits there instead of
overwriting a buffer still being read).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cuda_arrays import cp

#: destinations whose buffers are kept (least recently used dropped first)
SLOTS = 64
_H2D, _D2D = 1, 3      # cudaMemcpyHostToDevice, cudaMemcpyDeviceToDevice


@dataclass
class _Slot:
    host: np.ndarray        # pinned, uint8
    done: Any               # cupy Event recorded after the slot's last copy


class PinnedStaging:
    """Reused pinned buffers, one per (device, destination address)."""

    def __init__(self) -> None:
        self._slots: OrderedDict[tuple[int, int], _Slot] = OrderedDict()

    def copy(self, dst: Any, host: np.ndarray) -> None:
        """Copy ``host`` (C-contiguous; at most ``dst.nbytes`` bytes) into the start of the
        device array ``dst`` on the current stream."""
        n = int(host.nbytes)
        if n > int(dst.nbytes):
            raise ValueError(f"PinnedStaging.copy: {n} bytes into a {dst.nbytes}-byte array")
        key = (int(dst.device.id), int(dst.data.ptr))
        slot = self._slots.pop(key, None)
        if slot is None or slot.host.nbytes < n:
            slot = _Slot(_pinned(max(n, 256)), cp.cuda.Event(disable_timing=True))
        else:
            slot.done.synchronize()       # the last copy from this buffer has read it
        view = slot.host[:n]
        view[...] = np.frombuffer(np.ascontiguousarray(host).data, np.uint8)
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(int(dst.data.ptr), view.ctypes.data, n, _H2D, stream.ptr)
        slot.done.record(stream)
        remember(self._slots, key, slot)


def remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """``cache[key] = value`` as its most recently used entry, the least recently used
    dropped past ``SLOTS`` entries (take entries out with ``pop`` to use them)."""
    cache[key] = value
    while len(cache) > SLOTS:
        cache.popitem(last=False)


def _pinned(nbytes: int) -> np.ndarray:
    """A pinned host buffer of ``nbytes`` bytes as a numpy ``uint8`` array."""
    import cupyx  # type: ignore[import-not-found]
    return cupyx.empty_pinned((nbytes,), np.uint8)


def copy_device(dst: Any, src: Any) -> None:
    """``dst[...] = src`` for same-size device arrays, one ``cudaMemcpyAsync`` on the
    current stream (no CuPy dispatch)."""
    stream = cp.cuda.get_current_stream()
    cp.cuda.runtime.memcpyAsync(int(dst.data.ptr), int(src.data.ptr), int(src.nbytes), _D2D,
                                stream.ptr)


__all__ = ["PinnedStaging", "copy_device", "remember"]
