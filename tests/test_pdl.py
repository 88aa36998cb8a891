"""Programmatic dependent launch of the merge (``backends/cuda_pdl.py``), on the CPU: the
driver structs' layout, the launch a ``DependentLaunch`` makes (through a stand-in for
``cuLaunchKernelEx``), when it is enabled, which launches are dependents, and the kernel
sources' side of the contract (the GPU tests run it on the H200)."""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import subprocess
import weakref

import numpy as np
import pytest

from paged_decode.backends import cuda_pdl, launches
from paged_decode.kernels import decode_v2, decode_v2_tc, merge

#: sizeof / offsetof of CUlaunchAttribute and CUlaunchConfig in CUDA 12 / 13's cuda.h
C_LAYOUT = {"attr": 72, "attr.value": 8, "config": 56, "config.hStream": 32,
            "config.attrs": 40, "config.numAttrs": 48}


def _py_layout():
    A, C = cuda_pdl._Attribute, cuda_pdl._Config
    return {"attr": ctypes.sizeof(A), "attr.value": A.value.offset,
            "config": ctypes.sizeof(C), "config.hStream": C.hStream.offset,
            "config.attrs": C.attrs.offset, "config.numAttrs": C.numAttrs.offset}


def test_struct_layout_matches_cuda_h():
    assert _py_layout() == C_LAYOUT


def _cuda_h():
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "include", "cuda.h")):
            return os.path.join(root, "include")
    return None


@pytest.mark.skipif(_cuda_h() is None or shutil.which("cc") is None,
                    reason="no cuda.h or C compiler here")
def test_struct_layout_from_the_installed_header(tmp_path):
    src = tmp_path / "l.c"
    src.write_text('#include <cuda.h>\n#include <stdio.h>\n#include <stddef.h>\nint main() {'
                   'printf("%zu %zu %zu %zu %zu %zu", sizeof(CUlaunchAttribute), '
                   'offsetof(CUlaunchAttribute, value), sizeof(CUlaunchConfig), '
                   'offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs), '
                   'offsetof(CUlaunchConfig, numAttrs)); return 0; }\n')
    exe = tmp_path / "l"
    subprocess.run(["cc", f"-I{_cuda_h()}", str(src), "-o", str(exe)], check=True)
    got = [int(x) for x in subprocess.run([str(exe)], capture_output=True, text=True,
                                          check=True).stdout.split()]
    assert dict(zip(C_LAYOUT, got)) == _py_layout()


class FakeDriver:
    """Records what each cuLaunchKernelEx call was given."""

    def __init__(self, result=0):
        self.calls, self.result = [], result

    def __call__(self, config, fn, params, extra):
        c = config._obj
        attr = c.attrs[0]
        self.calls.append(dict(grid=(c.gridDimX, c.gridDimY, c.gridDimZ),
                               block=(c.blockDimX, c.blockDimY, c.blockDimZ),
                               smem=c.sharedMemBytes, stream=c.hStream, n=c.numAttrs,
                               attr=(attr.id, attr.value.int), fn=fn.value,
                               params=params.value, extra=extra))
        return self.result


def test_a_dependent_launch_sets_programmatic_serialization_and_the_stream():
    drv = FakeDriver()
    ex = cuda_pdl.DependentLaunch(0x1234, (7, 3), 128, 4096, 0x5678, entry=drv)
    ex(0xABC)
    ex(0xDEF)
    first, second = drv.calls
    assert first == dict(grid=(7, 3, 1), block=(128, 1, 1), smem=4096, stream=0xABC, n=1,
                         attr=(cuda_pdl.PROGRAMMATIC_STREAM_SERIALIZATION, 1), fn=0x1234,
                         params=0x5678, extra=None)
    assert cuda_pdl.PROGRAMMATIC_STREAM_SERIALIZATION == 6     # cuda.h's enum value
    assert second["stream"] == 0xDEF                            # the stream of each call


def test_a_driver_error_is_raised_with_its_code():
    ex = cuda_pdl.DependentLaunch(1, (1, 1), 32, 0, 2, entry=FakeDriver(result=1))
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx returned CUresult 1 \(grid 1 x "
                                           r"1, block 32, 0 B of shared memory\)"):
        ex(0)


def test_enabled_by_default_for_packed_launches_only_on_sm90_with_the_driver_entry(
        monkeypatch):
    drv = FakeDriver()
    monkeypatch.delenv(cuda_pdl.PDL_ENV, raising=False)
    # unset: packed launches (prepared calls, the engine step, graphs) yes, eager no
    assert cuda_pdl.enabled(9, entry=drv, packed=True)
    assert not cuda_pdl.enabled(9, entry=drv) and not cuda_pdl.enabled(9, entry=drv,
                                                                        packed=False)
    assert not cuda_pdl.enabled(8, entry=drv, packed=True)   # griddepcontrol is sm_90+
    monkeypatch.setenv(cuda_pdl.PDL_ENV, "1")
    for packed in (False, True):
        assert cuda_pdl.enabled(9, entry=drv, packed=packed)
        assert cuda_pdl.enabled(10, entry=drv, packed=packed)
        assert not cuda_pdl.enabled(8, entry=drv, packed=packed)
    monkeypatch.setattr(cuda_pdl, "driver_entry", lambda: None)
    assert not cuda_pdl.enabled(9, packed=True)          # no cuLaunchKernelEx
    monkeypatch.setenv(cuda_pdl.PDL_ENV, "0")
    for packed in (False, True):
        assert not cuda_pdl.enabled(9, entry=drv, packed=packed)


def test_a_launch_holds_the_owner_of_its_argument_array():
    # S11-R6 / S15-R1: the eager merge's launch came from a temporary PackedLaunch, freed
    # with the void*[] the launch points at before the driver read it
    class Owner:
        pass

    owner = Owner()
    alive = weakref.ref(owner)
    ex = cuda_pdl.DependentLaunch(1, (1, 1), 32, 0, 2, entry=FakeDriver(), keep=owner)
    del owner
    gc.collect()
    assert alive() is not None
    ex(0)
    del ex
    gc.collect()
    assert alive() is None


def test_only_the_merge_is_a_dependent_launch():
    from paged_decode import plan_decode
    from paged_decode.problems import ProblemSpec, make_problem
    pr = make_problem(ProblemSpec(2, 300, 8, 2, 64, 16, seed=3))
    plan = plan_decode(pr.table, 8, 2, 64, pages_per_chunk=4)
    c = plan.num_chunks
    v = np.zeros((c, 8, 64), np.float32)
    lse = np.zeros((c, 8), np.float32)
    tab = (pr.table.indices, pr.table.indptr, pr.table.last_page_len,
           pr.table.first_page_offset)
    m = launches.merge_launch(out_dtype="float16", shape=(2, 8, 64), v=v, lse=lse,
                              o_indptr=plan.o_indptr, v_out=np.zeros((2, 8, 64), np.float16),
                              lse_out=np.zeros((2, 8), np.float32))
    common = dict(plan=plan, sm_scale=0.125, q=pr.q, k_pages=pr.k_pages, v_pages=pr.v_pages,
                  table=tab, request_indices=plan.request_indices,
                  kv_tile_indices=plan.kv_tile_indices, v_out=v, lse_out=lse)
    p = launches.partial_launch(dtypes=("float16", "float16", "float32"), **common)
    t = launches.v2tc_launch(kv_dtype="float16", out_dtype="float32", **common)
    assert m.dependent and not p.dependent and not t.dependent


def _body(src: str, name: str) -> str:
    return src[src.index(name):]


def test_the_merge_waits_first_and_the_partials_allow_dependents():
    body = _body(merge.CUDA_BODY, "pd_merge_states(")
    wait = body.index("pd::wait_for_prerequisites();")
    # before any global read (all in pd::merge_group) and before the early return of warps
    # past the items
    assert wait < body.index("return;") and wait < body.index("pd::merge_group<")
    before = body[body.index(") {"):wait]
    assert "o_indptr[" not in before and "lse[" not in before and "v[" not in before
    for src, name in ((decode_v2.CUDA_BODY, "pd_decode_v2_partial("),
                      (decode_v2_tc.CUDA_BODY, "pd_decode_v2_tc(")):
        assert "allow_dependents();" in _body(src, name)
    # the instructions exist on sm_90+ only (the emulator and older GPUs compile nothing)
    from paged_decode.kernels.common import CUDA_COMMON, METAL_COMMON
    assert "griddepcontrol" not in METAL_COMMON
    for ins in ("griddepcontrol.launch_dependents", "griddepcontrol.wait"):
        at = CUDA_COMMON.index(ins)
        assert CUDA_COMMON.rindex("#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900", 0,
                                  at) > CUDA_COMMON.rindex("#endif", 0, at)
