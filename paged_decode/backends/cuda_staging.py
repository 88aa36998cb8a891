"""Small per-step host-to-device copies for the ``cuda`` backend, without allocation.

An engine step uploads a few kilobytes every step (``step_upload.StepUpload``: the
append descriptor and the table delta in one copy). ``cupy.array`` and ``ndarray.set``
allocate or stage pageable memory on every call. Here each destination gets ``DEPTH``
pinned host buffers used in turn: the host writes into one, one ``cudaMemcpyAsync`` on
the current stream copies it, and an event recorded after the copy says when the copy
has read it. An asynchronous copy reads its pinned source when the stream reaches it,
not when it is queued, so the host must not write a buffer before the last copy from it
has run: before reusing one, the host waits for its event (normally long done; a host
running more than ``DEPTH - 1`` steps ahead of the GPU waits there instead of
overwriting a buffer still to be read).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .cuda_arrays import cp

#: destinations whose buffers are kept (least recently used dropped first)
SLOTS = 64
#: pinned buffers per destination, used in turn (the host may queue this many copies
#: to one destination before it waits for the oldest)
DEPTH = 2
_H2D, _D2D = 1, 3      # cudaMemcpyHostToDevice, cudaMemcpyDeviceToDevice


@dataclass
class _Slot:
    hosts: list[np.ndarray]     # the pinned uint8 buffers, used in turn
    done: list[Any]             # per buffer: cupy Event recorded after its last copy
    addrs: list[int]            # per buffer: its host address (numpy's ctypes is slow)
    turn: int = 0               # the buffer the next copy uses

    def wait(self) -> None:
        """Until every copy from these buffers has read them."""
        for ev in self.done:
            if ev is not None:
                ev.synchronize()


class PinnedStaging:
    """Reused pinned buffers, ``depth`` per (device, destination address).

    ``cuda``: the module whose ``cuda.get_current_stream``, ``cuda.Event`` and
    ``cuda.runtime.memcpyAsync`` are used, and ``pinned(nbytes)``, the allocator of host
    buffers (default: CuPy and pinned memory; tests pass a model of asynchronous copies);
    ``depth``: buffers per destination.
    """

    def __init__(self, cuda: Any = None, pinned: Callable[[int], np.ndarray] | None = None,
                 depth: int = DEPTH) -> None:
        self._slots: OrderedDict[tuple[int, int], _Slot] = OrderedDict()
        self._depth = depth
        self._cp = cp if cuda is None else cuda
        self._pinned = _pinned if pinned is None else pinned

    def copy(self, dst: Any, *parts: np.ndarray) -> None:
        """Copy ``parts`` (C-contiguous, one after the other; at most ``dst.nbytes``
        bytes in all) into the start of the device array ``dst``: one ``cudaMemcpyAsync``
        on the current stream."""
        # the engine step's one upload per begin: kept to plain attribute reads and one
        # slice copy per part (the host time outside a captured step is #13's target)
        n = 0
        for p in parts:
            n += p.nbytes
        if n > dst.nbytes:
            raise ValueError(f"PinnedStaging.copy: {n} bytes into a {dst.nbytes}-byte array")
        mem = dst.data
        ptr = mem.ptr
        key = (mem.device_id, ptr)
        slot = self._slots.pop(key, None)
        if slot is None or slot.hosts[0].nbytes < n:
            if slot is not None:          # its buffers go back to the pinned pool
                slot.wait()
            # room for the whole destination (up to 1 MiB): a step's upload varies in size
            size = max(n, 256, min(int(dst.nbytes), 1 << 20))
            hosts = [self._pinned(size) for _ in range(self._depth)]
            slot = _Slot(hosts, [None] * self._depth, [h.ctypes.data for h in hosts])
        i = slot.turn
        done = slot.done[i]
        if done is not None:
            done.synchronize()            # the last copy from this buffer has read it
        else:
            done = slot.done[i] = self._cp.cuda.Event(disable_timing=True)
        host = slot.hosts[i]
        at = 0
        for p in parts:
            m = p.nbytes
            host[at:at + m] = np.ascontiguousarray(p).reshape(-1).view(np.uint8)
            at += m
        stream = self._cp.cuda.get_current_stream()
        self._cp.cuda.runtime.memcpyAsync(ptr, slot.addrs[i], n, _H2D, stream.ptr)
        done.record(stream)
        slot.turn = (i + 1) % len(slot.hosts)
        self._slots[key] = slot
        while len(self._slots) > SLOTS:   # least recently used out, once its copies ran
            self._slots.popitem(last=False)[1].wait()


def remember(cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    """``cache[key] = value`` as its most recently used entry, the least recently used
    dropped past ``SLOTS`` entries (take entries out with ``pop`` to use them)."""
    cache[key] = value
    while len(cache) > SLOTS:
        cache.popitem(last=False)


def kept_int32(cache: OrderedDict[Any, Any], key: Any, words: int, least: int = 0) -> Any:
    """A device int32 buffer of at least ``words`` words kept in ``cache`` under ``key``
    (``remember``'s rules): the kept one while it is large enough, else a new one of
    ``max(words, least, twice the old size)`` words (the device buffer of a per-step
    upload, which varies in size)."""
    buf = cache.pop(key, None)
    if buf is None or buf.size < words:
        buf = cp.empty(max(int(words), least, 2 * (int(buf.size) if buf is not None else 0)),
                       np.int32)
    remember(cache, key, buf)
    return buf


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


__all__ = ["PinnedStaging", "copy_device", "kept_int32", "remember"]
