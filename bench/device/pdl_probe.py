"""Which streams accept a programmatic dependent launch (``backends/cuda_pdl.py``)?

Launches a small kernel pair (a writer, then a reader that waits on it through
``griddepcontrol.wait``) with ``cuLaunchKernelEx`` and programmatic stream serialization
on the legacy NULL stream, the per-thread default stream, a blocking and a non-blocking
created stream, and inside a stream capture; prints each launch's CUresult and whether
the reader saw the writer's values. Then, on a non-blocking stream, the same launch with no
attribute (is it the call or the attribute the driver refuses?) and with the reader's
handle from ``cuModuleGetFunction`` on a cubin nvcc built (is it CuPy's handle?).
Usage: python bench/device/pdl_probe.py [out.json]
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile

import cupy as cp
import numpy as np

from paged_decode.backends import cuda_pdl

SRC = r"""
extern "C" __global__ void writer(float* a, int n) {
  asm volatile("griddepcontrol.launch_dependents;");
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) a[i] = 2.0f * i + 1.0f;
}
extern "C" __global__ void reader(const float* a, float* b, int n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] = a[i] + 1.0f;
}
"""


def main() -> None:
    mod = cp.RawModule(code=SRC, options=("-arch=sm_90",))
    writer, reader = mod.get_function("writer"), mod.get_function("reader")
    n = 1 << 20
    a = cp.zeros(n, cp.float32)
    b = cp.zeros(n, cp.float32)
    cells = [ctypes.c_void_p(a.data.ptr), ctypes.c_void_p(b.data.ptr), ctypes.c_int32(n)]
    ptrs = (ctypes.c_void_p * 3)(*(ctypes.addressof(c) for c in cells))
    ex = cuda_pdl.DependentLaunch(int(reader.kernel.ptr), (n // 256, 1), 256, 0,
                                  ctypes.addressof(ptrs))
    want = 2.0 * np.arange(n, dtype=np.float32) + 2.0
    rows = {}
    streams = {"legacy-null": (cp.cuda.Stream.null, 0), "per-thread": (cp.cuda.Stream.ptds, 2)}
    s1, s2 = cp.cuda.Stream(), cp.cuda.Stream(non_blocking=True)
    streams["blocking"] = (s1, s1.ptr)
    streams["non-blocking"] = (s2, s2.ptr)
    for name, (s, handle) in streams.items():
        a.fill(0), b.fill(0)
        cp.cuda.Device().synchronize()
        with s:
            writer((n // 256,), (256,), (a, cp.int32(n)))
            try:
                ex(handle)
                err = 0
            except RuntimeError as e:
                err = str(e)
            s.synchronize()
        rows[name] = dict(result=err, correct=bool(np.array_equal(cp.asnumpy(b), want)))
    # inside a graph on the non-blocking stream
    a.fill(0), b.fill(0)
    cp.cuda.Device().synchronize()
    with s2:
        s2.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
        err = 0
        try:
            writer((n // 256,), (256,), (a, cp.int32(n)))
            try:
                ex(s2.ptr)
            except RuntimeError as e:
                err = str(e)
        finally:
            g = s2.end_capture()
        if not err:
            g.launch(s2)
        s2.synchronize()
    rows["graph"] = dict(result=err, correct=bool(np.array_equal(cp.asnumpy(b), want)))
    def once(ex_, s):
        a.fill(0), b.fill(0)
        cp.cuda.Device().synchronize()
        with s:
            writer((n // 256,), (256,), (a, cp.int32(n)))
            try:
                ex_(s.ptr)
                err = 0
            except RuntimeError as e:
                err = str(e)
            s.synchronize()
        return dict(result=err, correct=bool(np.array_equal(cp.asnumpy(b), want)))

    plain = cuda_pdl.DependentLaunch(int(reader.kernel.ptr), (n // 256, 1), 256, 0,
                                     ctypes.addressof(ptrs))
    plain._config.numAttrs = 0
    rows["no-attribute"] = once(plain, s2)
    rows["cupy-handle-type"] = type(reader.kernel).__name__
    try:
        with tempfile.TemporaryDirectory() as d:
            cu, cubin = os.path.join(d, "k.cu"), os.path.join(d, "k.cubin")
            with open(cu, "w") as f:
                f.write(SRC)
            subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-o", cubin, cu], check=True)
            drv = ctypes.CDLL("libcuda.so.1")
            mod_, fn_ = ctypes.c_void_p(), ctypes.c_void_p()
            r1 = drv.cuModuleLoad(ctypes.byref(mod_), cubin.encode())
            r2 = drv.cuModuleGetFunction(ctypes.byref(fn_), mod_, b"reader")
            rows["own-module"] = dict(load=r1, get=r2)
            if not (r1 or r2):
                own = cuda_pdl.DependentLaunch(int(fn_.value), (n // 256, 1), 256, 0,
                                               ctypes.addressof(ptrs))
                rows["own-handle"] = once(own, s2)
                own0 = cuda_pdl.DependentLaunch(int(fn_.value), (n // 256, 1), 256, 0,
                                                ctypes.addressof(ptrs))
                own0._config.numAttrs = 0
                rows["own-handle-no-attribute"] = once(own0, s2)
    except Exception as e:  # noqa: BLE001 (a probe: report and go on)
        rows["own-module-error"] = repr(e)
    for k, v in rows.items():
        print(f"{k:14s} {v}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
