"""The tensor-core partial's fused merge on a real GPU (skipped cleanly without one).

On the GPU the CTAs of one launch really run at once, so these tests look for what the
emulator cannot show: a partial read before its writer's fence (a stale or non-coherent
read), a counter that misses a CTA. Each compares the fused launch bit for bit with the
two-launch path (``PAGED_DECODE_FUSED_MERGE=0``) over NaN-poisoned outputs, many times
and at many chunks per request; checks that the kept counters are zero after every call
and every graph replay; and runs a captured fused decode. ``bench/device/run.sh fused``
runs this module under compute-sanitizer memcheck and racecheck too.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, assert_same_bits, take_and_repoison, tc_out_tol

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.backends.launching import CLUSTER_MERGE_ENV, FUSED_MERGE_ENV, MERGE_SPLIT_ENV
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.specs import v2tc_ctas_per_chunk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]


@pytest.fixture(autouse=True)
def _unsplit_merge(monkeypatch):
    """The two launches compared bit for bit with the fused merge run the merge kernel
    unsplit: the fused merge is its one-warp code (``pd::merge_group`` with SPLIT 1), and a
    split merge adds the same terms in another order (S17-R1: equal to 1 float32 ulp)."""
    monkeypatch.setenv(MERGE_SPLIT_ENV, "1")
    # the counters' fused merge throughout (the cluster merge: test_cluster_merge_gpu.py)
    monkeypatch.setenv(CLUSTER_MERGE_ENV, "0")


def _setup(spec, ppc, lengths=None):
    import cupy as cp
    be = pd.get_backend("cuda")
    pr = make_problem(spec, lengths=lengths)
    q, k, v = (be.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    # the copies ran on the NULL stream; a test on a created non-blocking stream must not
    # read the pools before they land
    cp.cuda.Device().synchronize()
    hq, hkv, d = spec.num_qo_heads, spec.num_kv_heads, spec.head_dim
    plan = pd.plan_decode(pr.table, hq, hkv, d, device=be.device_info(), pages_per_chunk=ppc,
                          ctas_per_chunk=v2tc_ctas_per_chunk(hq, hkv))
    assert plan.needs_merge
    out = cp.full(q.shape, np.nan, cp.float32)
    lse = cp.full(q.shape[:2], np.nan, cp.float32)

    def call(**kw):
        pd.decode(q, k, v, pr.table, plan, path="v2tc", out=out, lse=lse, out_dtype="float32",
                  **kw)
        assert pd.last_outcome().path == "v2tc+merge"

    def take():
        return take_and_repoison(out, lse)

    return be, pr, plan, call, take


def _same(a, b, what):
    """``a`` equals ``b`` bit for bit; empty requests are zeros and -inf."""
    assert_same_bits(a, b, what)
    live = np.isfinite(b[1])            # an empty request: lse -inf and zeros, as the merge writes
    assert live.any(), what
    assert np.isfinite(a[0][live]).all() and np.isfinite(a[1][live]).all(), what
    assert np.isneginf(a[1][~live]).all() and (a[0][~live] == 0).all(), what


CASES = [
    # many chunks per request (the counts race hardest), GQA 4, 8, 16 and 32 (two tiles)
    ("b2-16k-g4", ProblemSpec(2, 16384, 32, 8, 128, 16, seed=1), 1),
    ("b8-2k-g8", ProblemSpec(8, 2048, 64, 8, 128, 16, seed=2), 2),
    ("b4-4k-g16-d64", ProblemSpec(4, 4096, 32, 2, 64, 16, seed=3), 1),
    ("b3-3k-g32-ps1", ProblemSpec(3, 3000, 32, 1, 128, 1, seed=4), 16),
    ("b5-ragged-bf16", ProblemSpec(5, 4000, 32, 8, 128, 16, "bfloat16", "bfloat16", seed=5), 1),
]


@pytest.mark.parametrize("spec,ppc", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_fused_equals_two_launches_every_time(monkeypatch, spec, ppc):
    lengths = [4000, 1, 0, 2500, 333] if spec.batch == 5 else None
    be, pr, plan, call, take = _setup(spec, ppc, lengths)
    monkeypatch.setenv(FUSED_MERGE_ENV, "0")
    call()
    want = take()
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    # the two launches against the float64 oracle at v2tc's bound (the fused launch must
    # then equal them bit for bit); empty requests exactly zeros and -inf
    assert_matches_oracle(want[0], want[1], ref, ref_lse, "float32", spec.label,
                          tol=tc_out_tol(spec.kv_dtype, "float32"))
    monkeypatch.setenv(FUSED_MERGE_ENV, "1")
    counters = be.merge_counters(plan)
    for i in range(20):
        call()
        _same(take(), want, f"{spec.label} call {i}")
        assert not np.asarray(counters.get()).any(), f"counters not zero after call {i}"


def test_a_captured_fused_decode_replays_right(monkeypatch):
    import cupy as cp
    monkeypatch.setenv(FUSED_MERGE_ENV, "0")
    be, pr, plan, call, take = _setup(ProblemSpec(4, 8192, 32, 8, 128, 16, seed=6), 1)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        call()
        want = take()
        ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
        assert_matches_oracle(want[0], want[1], ref, ref_lse, "float32", "captured",
                              tol=tc_out_tol("float16", "float32"))
        monkeypatch.setenv(FUSED_MERGE_ENV, "1")
        call()                              # the workspace and counters are made on s
        _same(take(), want, "eager on the capture stream")
        s.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
        try:
            call()
        finally:
            g = s.end_capture()
        got = take()
        assert np.isnan(got[0]).all()       # the capture ran nothing
        counters = be.merge_counters(plan)
        for i in range(10):
            g.launch(s)
            _same(take(), want, f"replay {i}")
            assert not np.asarray(counters.get()).any()


def test_sinks_enter_the_fused_merge_once(monkeypatch):
    import cupy as cp
    be, pr, plan, call, take = _setup(ProblemSpec(3, 5000, 32, 8, 128, 16, seed=7), 1)
    sinks = (np.random.default_rng(0).standard_normal(32) * 2).astype(np.float32)
    monkeypatch.setenv(FUSED_MERGE_ENV, "0")
    call(sinks=cp.asarray(sinks))
    want = take()
    monkeypatch.setenv(FUSED_MERGE_ENV, "1")
    call(sinks=cp.asarray(sinks))
    _same(take(), want, "sinks")
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, sinks=sinks)
    assert_matches_oracle(want[0], want[1], ref, ref_lse, "float32", "sinks",
                          tol=tc_out_tol("float16", "float32"))
