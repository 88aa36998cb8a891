"""The merge as a programmatic dependent launch (``backends/cuda_pdl.py``) on a real GPU.

With ``PAGED_DECODE_PDL=1`` a split decode's merge goes through ``cuLaunchKernelEx`` with
programmatic stream serialization on every stream, the default ones included. Each test counts
the dependent launches the driver was asked for (so a silent fall back to the plain
launch fails the test) and compares the outputs and LSEs bit for bit with the same call
with PDL off: the partial and merge kernels are the same, only the launch differs.
Skipped cleanly without a CUDA device of compute capability 9.0 or newer.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, take_and_repoison, tc_out_tol

import paged_decode as pd
from paged_decode.backends import availability, cuda_pdl
from paged_decode.backends.launching import FUSED_MERGE_ENV
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode


def _sm90() -> bool:
    if not availability("cuda").ok:
        return False
    import cupy as cp
    return int(cp.cuda.Device().compute_capability[:1]) >= cuda_pdl.MIN_MAJOR


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of ``DependentLaunch.__call__`` (each one a ``cuLaunchKernelEx``).
    The tensor-core partial's fused merge is off, so v2tc's merge is a launch of its own."""
    if not _sm90():
        pytest.skip("PDL needs sm_90 or newer")
    monkeypatch.setenv(FUSED_MERGE_ENV, "0")
    calls = []
    real = cuda_pdl.DependentLaunch.__call__

    def spy(self, stream):
        calls.append(int(stream))
        return real(self, stream)

    monkeypatch.setattr(cuda_pdl.DependentLaunch, "__call__", spy)
    return calls


def _case(path):
    import cupy as cp
    cuda = pd.get_backend("cuda")
    pr = make_problem(ProblemSpec(4, 700, 32, 8, 128, 16, seed=5))
    q, k, v = (cuda.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    cp.cuda.Device().synchronize()     # copied on the NULL stream; the tests run on others
    plan = pd.plan_decode(pr.table, 32, 8, 128, device=cuda.device_info(), pages_per_chunk=1)
    assert plan.num_chunks > pr.table.batch_size          # the call merges
    out = cp.full(q.shape, np.nan, q.dtype)
    lse = cp.full(q.shape[:2], np.nan, cp.float32)

    def call():
        pd.decode(q, k, v, pr.table, plan, path=path, out=out, lse=lse)

    def result():
        return take_and_repoison(out, lse)

    return call, result, pr


def _plain(monkeypatch, path):
    import cupy as cp
    monkeypatch.setenv(cuda_pdl.PDL_ENV, "0")
    call, result, pr = _case(path)
    with cp.cuda.Stream(non_blocking=True):
        call()
        want = result()
    monkeypatch.setenv(cuda_pdl.PDL_ENV, "1")
    # the baseline the PDL runs must equal bit for bit is itself right
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(want[0], want[1], ref, ref_lse, "float16", f"{path} without PDL",
                          tol=tc_out_tol("float16", "float16") if path == "v2tc" else None)
    return call, result, want


def _same(got, want):
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def _each_call_same(call, result, want, times):
    """``times`` times: ``call()``, then its ``result()`` equals ``want`` bit for bit."""
    for _ in range(times):
        call()
        _same(result(), want)


@pytest.mark.parametrize("blocking", [False, True], ids=["non-blocking", "blocking"])
@pytest.mark.parametrize("path", ["v2", "v2tc"])
def test_an_eager_merge_on_a_created_stream_is_a_dependent_launch(monkeypatch, counted,
                                                                   path, blocking):
    import cupy as cp
    call, result, want = _plain(monkeypatch, path)
    assert counted == []
    s = cp.cuda.Stream(non_blocking=not blocking)
    with s:
        _each_call_same(call, result, want, 3)
    assert counted == [s.ptr] * 3


@pytest.mark.parametrize("path", ["v2", "v2tc"])
def test_a_merge_captured_in_a_graph_is_a_dependent_launch_and_replays_right(
        monkeypatch, counted, path):
    import cupy as cp
    call, result, want = _plain(monkeypatch, path)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        call()                                   # the workspace is allocated on s first
        result()
        s.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
        try:
            call()
        finally:
            g = s.end_capture()
        assert len(counted) == 2
        got = result()
        assert np.isnan(got[0]).all()            # the capture ran nothing
        _each_call_same(lambda: g.launch(s), result, want, 3)


@pytest.mark.parametrize("stream", ["null", "per-thread"])
@pytest.mark.parametrize("path", ["v2", "v2tc"])
def test_the_default_streams_take_a_dependent_launch_too(monkeypatch, counted, path, stream):
    import cupy as cp
    call, result, want = _plain(monkeypatch, path)
    s = cp.cuda.Stream.null if stream == "null" else cp.cuda.Stream.ptds
    with s:
        _each_call_same(call, result, want, 2)
    assert counted == [s.ptr] * 2


def test_a_fused_merge_leaves_nothing_to_launch_dependently(monkeypatch, counted):
    import cupy as cp
    call, result, want = _plain(monkeypatch, "v2tc")
    monkeypatch.setenv(FUSED_MERGE_ENV, "1")
    with cp.cuda.Stream(non_blocking=True):
        call()
        got = result()
    assert counted == []                                  # one launch, no merge grid
    np.testing.assert_allclose(got[0], want[0], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("path", ["v2", "v2tc"])
def test_by_default_packed_merges_are_dependent_launches_and_eager_ones_are_not(
        monkeypatch, counted, path):
    # PAGED_DECODE_PDL unset: decode's first call runs eagerly (a plain merge launch); it
    # then caches the call as packed launches, whose replays launch the merge dependently
    import cupy as cp
    call, result, want = _plain(monkeypatch, path)
    monkeypatch.delenv(cuda_pdl.PDL_ENV)
    call2, result2, _ = _case(path)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        _each_call_same(call2, result2, want, 3)
    assert counted == [s.ptr] * 2


@pytest.mark.parametrize("path", ["v2", "v2tc"])
def test_pdl_0_launches_every_merge_plainly(monkeypatch, counted, path):
    import cupy as cp
    call, result, want = _plain(monkeypatch, path)
    monkeypatch.setenv(cuda_pdl.PDL_ENV, "0")
    call2, result2, _ = _case(path)
    with cp.cuda.Stream(non_blocking=True):
        _each_call_same(call2, result2, want, 3)
    assert counted == []
