"""The ``cuda`` backend's eager append: one descriptor copy and one packed launch.

A decode loop appends at every step (``PagePool.append_batch``: one launch for every
layer; ``PagePool.write_layer``: one per layer). The general launch path spends most of
its host time there on ``cupy.array`` (the descriptor upload allocates and stages
pageable memory), on building the ``Launch`` and on CuPy's kernel call. Here the
descriptor goes through a reused pinned buffer (``cuda_staging.PinnedStaging``) into a
device buffer kept per (device, stream): kernels on one stream run in order, so the next
copy into it lands only after the last kernel that read it. A descriptor that several
appends share (``AppendWrite.shared``: the decode loop's worked-out appends) is uploaded
once for all of them and read where it lies. The launch is packed once per geometry and
pool addresses (``cuda_launch.PackedLaunch``), and each call rewrites only the addresses
of the rows and the descriptor.
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from ..kernels import append as append_kernel
from ..kernels.append import AppendWrite
from . import launches
from .cuda_arrays import cp
from .cuda_launch import PackedLaunch
from .cuda_staging import PinnedStaging, kept_int32, remember

#: pinned descriptor buffers per (device, stream): a host may queue this many appends
#: (one per layer with ``write_layer``) before it waits for the oldest copy to have run
DEPTH = 8
#: int32 words a descriptor buffer starts with (``[5, T]``: 128 sequences)
FIRST_WORDS = 5 * 128


#: whether a CuPy array is C-contiguous: the attribute CuPy's ``flags`` are made from,
#: where it has one (a plain read; ``flags`` builds an object, 0.55 us a call on the H200
#: machine's host, S14-R3)
_contiguous: Callable[[Any], Any] = (
    operator.attrgetter("_c_contiguous")
    if cp is not None and hasattr(cp.ndarray, "_c_contiguous")
    else lambda x: x.flags.c_contiguous)


class EagerAppend:
    """The eager append launches of one ``CudaBackend`` (``backend``: its kernel and
    dynamic shared memory hooks, ``_kernel_for``). A packed launch belongs to one pair of
    pools (its key holds their addresses), so threads appending to different pools never
    share one; appends to one pool from several threads at once are not supported (nor
    are they by ``PagePool``)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._staging = PinnedStaging(depth=DEPTH)
        self._descs: OrderedDict[tuple[int, int], Any] = OrderedDict()
        #: by (device, pool addresses, geometry): the packed launch (``None`` for a launch
        #: with an empty grid) and the argument positions of the rows and the descriptor
        self._packed: OrderedDict[tuple[Any, ...],
                                  tuple[PackedLaunch | None, int, int, int]] = OrderedDict()

    def run(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
            write: AppendWrite) -> bool:
        """Launch the append (``Backend.append_rows``' arguments; float pools) on the
        current device and CuPy's current stream and return ``True``; or return ``False``
        having done nothing where the general path must run: any array not a CuPy array,
        rows not C-contiguous in the pools' dtype, arrays off the current device, or a
        stream being captured into a graph (a copy from a reused pinned buffer must not
        be captured: the graph would read what the buffer holds at replay)."""
        nd = cp.ndarray
        if type(k_pages) is not nd or type(v_pages) is not nd or type(k_rows) is not nd \
                or type(v_rows) is not nd:
            return False
        dt = k_pages.dtype
        contiguous = _contiguous
        if v_pages.dtype != dt or k_rows.dtype != dt or v_rows.dtype != dt \
                or not (contiguous(k_rows) and contiguous(v_rows) and contiguous(k_pages)
                        and contiguous(v_pages)):
            return False
        kp, vp, kr, vr = k_pages.data, v_pages.data, k_rows.data, v_rows.data
        dev = kp.device_id
        if cp.cuda.runtime.getDevice() != dev or not (vp.device_id == kr.device_id
                                                        == vr.device_id == dev):
            return False
        stream = cp.cuda.get_current_stream()
        if stream.is_capturing():
            return False
        s = stream.ptr
        desc = write.desc
        shared = write.shared
        if shared is not None and not shared[0].flags.writeable \
                and shared[0].dtype == np.int32 and shared[0].flags.c_contiguous:
            # uploaded once for every append sharing it (memoised while it lives)
            dev_desc = self._backend.upload(shared[0])
            desc_ptr = dev_desc.data.ptr + shared[1] * desc.nbytes
            host_desc = None
        else:
            host_desc = desc
            if desc.dtype != np.int32 or not desc.flags.c_contiguous:
                host_desc = np.ascontiguousarray(desc, np.int32)
            dev_desc = kept_int32(self._descs, (dev, s), desc.size, FIRST_WORDS)
            desc_ptr = dev_desc.data.ptr
        shape = k_pages.shape
        vec = append_kernel.vector_bytes(shape[-2] * shape[-1] * k_pages.itemsize,
                                         (kp.ptr, vp.ptr, kr.ptr, vr.ptr))
        num_layers = shape[0] if len(shape) == 5 else 1
        key = (dev, kp.ptr, vp.ptr, shape, dt.char, vec, desc.shape[1], write.num_rows,
               write.layer0, write.row_layers, write.copy_cow,
               launches.append_layers(write, num_layers))
        hit = self._packed.pop(key, None)
        if hit is None:
            hit = self._pack(k_pages, v_pages, k_rows, v_rows, write, dev_desc, vec)
        remember(self._packed, key, hit)
        packed, ik, iv, idesc = hit
        if packed is None:
            return True
        if host_desc is not None:
            self._staging.copy(dev_desc, host_desc)
        packed.set_pointer(ik, kr.ptr)
        packed.set_pointer(iv, vr.ptr)
        packed.set_pointer(idesc, desc_ptr)
        cp.cuda.driver.launchKernel(packed.fn, packed.gx, packed.gy, 1, packed.block, 1, 1,
                                    packed.smem, s, packed.params, 0)
        return True

    def _pack(self, k_pages: Any, v_pages: Any, k_rows: Any, v_rows: Any,
              write: AppendWrite, desc: Any, vec: int
              ) -> tuple[PackedLaunch | None, int, int, int]:
        """The append's launch packed on these arrays, holding none of them (the pools are
        keyed by address; the rows' and the descriptor's addresses are rewritten per call)
        and the positions of those three arguments."""
        launch = launches.append_launch(
            write=write, dtype=self._backend.dtype_of(k_pages), vector_bytes=vec,
            pool_shape=tuple(int(x) for x in k_pages.shape), k_rows=k_rows, v_rows=v_rows,
            desc=desc, k_pages=k_pages, v_pages=v_pages)
        names = [a.name for a in launch.args]
        at = (names.index("k_rows"), names.index("v_rows"), names.index("desc"))
        if launch.empty:
            return (None, *at)
        return (PackedLaunch(self._backend._kernel_for(launch), launch, hold=False), *at)


__all__ = ["DEPTH", "EagerAppend"]
