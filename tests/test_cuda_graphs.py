"""Prepared calls and CUDA-graph capture on a real GPU (skipped cleanly without one).

A decode call with a plan and a caller-provided output, and a prepared call, must be
capturable in a CUDA graph under the strict (global) capture mode, which rejects host
synchronization and unsafe API calls; a replay must give the eager result, and must read
the *current* contents of the bound buffers (not values baked in at capture).
"""

from __future__ import annotations

import numpy as np
import pytest

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import lse_error, max_rel_error, oracle_decode, row_rel_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]

from helpers import LSE_ATOL, OUT_RTOL, PREFIX_RTOL  # noqa: E402


@pytest.fixture(scope="module")
def cuda():
    return pd.get_backend("cuda")


def _problem(cuda, spec):
    pr = make_problem(spec)
    q, k, v = (cuda.asarray(x) for x in (pr.q, pr.k_pages, pr.v_pages))
    return pr, q, k, v


def _capture_on(stream, fn):
    """Capture ``fn`` on ``stream`` (the current stream) in global mode; returns the graph."""
    import cupy as cp
    stream.begin_capture(cp.cuda.runtime.streamCaptureModeGlobal)
    try:
        fn()
    finally:
        graph = stream.end_capture()
    return graph


def _capture(fn):
    """Capture ``fn`` on a fresh stream in global mode; returns (graph, stream)."""
    import cupy as cp
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        g = _capture_on(s, fn)
    return g, s


@pytest.mark.parametrize("ppc", [None, 1], ids=["single-chunk", "merge"])
@pytest.mark.parametrize("path", ["v2", "v2tc", "v1"])
def test_decode_with_plan_and_out_is_capturable(cuda, path, ppc):
    import cupy as cp
    spec = ProblemSpec(4, 700, 32, 8, 128, 16, seed=21)
    pr, q, k, v = _problem(cuda, spec)
    plan = pd.plan_decode(pr.table, 32, 8, 128, device=cuda.device_info(), pages_per_chunk=ppc)
    out = cp.full(q.shape, np.nan, q.dtype)
    lse = cp.full(q.shape[:2], np.nan, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:   # the eager call on the capture stream allocates its workspace there
        pd.decode(q, k, v, pr.table, plan, path=path, out=out, lse=lse)
        stream.synchronize()
        eager, eager_lse = cp.asnumpy(out), cp.asnumpy(lse)
        out.fill(np.nan)
        lse.fill(np.nan)
        g = _capture_on(stream, lambda: pd.decode(q, k, v, pr.table, plan, path=path,
                                                  out=out, lse=lse))
        stream.synchronize()
        assert np.isnan(cp.asnumpy(out)).all()      # capture ran nothing
        g.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), eager)
    np.testing.assert_array_equal(cp.asnumpy(lse), eager_lse)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert max_rel_error(cp.asnumpy(out), ref) <= OUT_RTOL["float16"]
    assert lse_error(cp.asnumpy(lse), ref_lse) <= LSE_ATOL


@pytest.mark.parametrize("ppc", [None, 1], ids=["single-chunk", "merge"])
@pytest.mark.parametrize("path", ["v2", "v2tc"])
def test_prepared_call_matches_decode_and_replays_in_a_graph(cuda, ppc, path):
    import cupy as cp
    spec = ProblemSpec(3, 900, 16, 2, 128, 32, "bfloat16", "bfloat16", seed=22)
    pr, q, k, v = _problem(cuda, spec)
    plan = pd.plan_decode(pr.table, 16, 2, 128, device=cuda.device_info(), pages_per_chunk=ppc)
    prep = pd.prepare_decode(q, k, v, pr.table, plan, path=path, return_lse=True)
    assert prep.path == (f"{path}+merge" if plan.needs_merge else path)
    out, lse = prep()
    want, want_lse = pd.decode(q, k, v, pr.table, plan, path=path, return_lse=True)
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(want))
    np.testing.assert_array_equal(cp.asnumpy(lse), cp.asnumpy(want_lse))
    assert pd.last_outcome().path == prep.path
    # the graph reads the bound q at replay time: change q in place, replay, compare
    g, s = _capture(prep)
    q2 = cuda.asarray(np.random.default_rng(5).standard_normal(q.shape).astype(np.float32)
                      ).astype(q.dtype)
    q[...] = q2
    out.fill(np.nan)
    g.launch(s)
    s.synchronize()
    want2 = pd.decode(q, k, v, pr.table, plan, path=path)
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(want2))
    # and both are right, not only equal: the float64 oracle on the replayed q
    ref, _ = oracle_decode(cp.asnumpy(q), pr.k_pages, pr.v_pages, pr.table)
    tol = PREFIX_RTOL["bfloat16"] if path == "v2tc" else OUT_RTOL["bfloat16"]
    err = row_rel_error(cp.asnumpy(out), ref)
    assert err <= tol, f"{path}: replay {err:.3e} > {tol}"


def test_prepared_call_with_torch_tensors_uses_torch_stream(cuda):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    spec = ProblemSpec(4, 500, 32, 8, 128, 16, seed=23)
    pr = make_problem(spec)
    dev = torch.device("cuda", 0)
    q, k, v = (torch.from_numpy(np.asarray(x, np.float32)).to(dev, torch.float16)
               for x in (pr.q, pr.k_pages, pr.v_pages))
    plan = pd.plan_decode(pr.table, 32, 8, 128, device=cuda.device_info(), pages_per_chunk=2)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        prep = pd.prepare_decode(q, k, v, pr.table, plan)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            prep()
        prep.out.fill_(float("nan"))
        graph.replay()
    side.synchronize()
    assert isinstance(prep.out, torch.Tensor)
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert max_rel_error(prep.out.float().cpu().numpy(), ref) <= OUT_RTOL["float16"]


def test_bench_graph_timer_captures_every_arm_of_ours(cuda):
    from paged_decode.bench.cases import BenchCase
    from paged_decode.bench.runner import bench_case
    r = bench_case(cuda, BenchCase(2, 1024, 16), arms=("gather", "v1", "v2"), warmup=1, reps=3)
    for name, arm in r.arms.items():
        assert arm.verified, (name, arm.max_rel_error)
        assert arm.gpu_mode in ("graph", "events"), name
        assert arm.gpu["median_us"] > 0 and arm.call["median_us"] > 0
    assert r.arms["v2"].gpu_mode == "graph" and r.arms["v1"].gpu_mode == "graph"


def test_bench_graph_layers_time_three_layers_in_one_graph(cuda):
    """``--graph-layers 3``: each arm's three calls (each over its own copy of the pools,
    at other pages, through its own table) are captured in one graph, every layer's
    replayed output is verified, the layers' pools are distinct memory holding the case's
    tokens, and the GPU time is per call: within a sane factor of one call's alone (a
    replay of 3 calls not divided by 3 would be about 3x)."""
    import cupy as cp

    from paged_decode.bench import layers
    from paged_decode.bench.cases import BenchCase
    from paged_decode.bench.runner import _problem, run_bench
    case = BenchCase(2, 1024, 16)
    (r,) = run_bench([case], backend=cuda, arms=("v2", "v2tc"), warmup=1, reps=3,
                     graph_layers=3)
    assert r.graph_layers == 3 and r.layers_note == ""
    for name, arm in r.arms.items():
        assert arm.verified, (name, arm.max_rel_error, arm.note)
        assert arm.gpu_mode == "graph" and arm.graph_layers == 3, (name, arm.note)
        assert arm.gpu["median_us"] > 0 and arm.call["median_us"] > 0
    # the layers' pools, as bench_case makes them: distinct device memory, the case's
    # tokens through each layer's own table, at other pages
    _q, k, v, table = _problem(cuda, case, 0)
    pools, note = layers.layer_pools(cuda, k, v, table, 3)
    assert note == "" and len(pools) == 2 and len({p.shift for p in pools}) == 2
    arrays = [k, v, *(a for p in pools for a in (p.k, p.v))]
    spans = sorted(layers.byte_range(a) for a in arrays)
    assert all(hi <= lo for (_lo, hi), (lo, _hi) in zip(spans, spans[1:])), spans
    ids = cp.asarray(table.indices.astype(np.int64))
    for p in pools:
        own = cp.asarray(p.table.indices.astype(np.int64))
        assert bool(cp.array_equal(p.k[own], k[ids])) and bool(cp.array_equal(p.v[own], v[ids]))
        assert not bool(cp.array_equal(p.k, k))
    del pools, arrays
    # per call: 3 calls in one replay / 3 against one call per replay, on a case whose
    # calls outweigh the graph's launch
    big = BenchCase(8, 4096, 16)
    per = {n: run_bench([big], backend=cuda, arms=("v2",), warmup=2, reps=10,
                        graph_layers=n)[0].arms["v2"] for n in (1, 3)}
    assert per[3].graph_layers == 3 and per[1].graph_layers == 1
    assert per[3].gpu_mode == per[1].gpu_mode == "graph"
    ratio = per[3].gpu["median_us"] / per[1].gpu["median_us"]
    assert 0.5 < ratio < 1.5, (ratio, per[3].gpu, per[1].gpu)


@pytest.mark.parametrize("how", ["decode", "prepared"])
def test_cascade_with_plan_and_out_is_capturable(cuda, how):
    """Cascade with the tensor-core level 0: three launches, capturable in global mode;
    the replay equals the eager call and the oracle, and reads the current queries."""
    import cupy as cp
    rng = np.random.default_rng(31)
    hkv, g, d, p, b, shared = 8, 4, 128, 16, 12, 70   # 70 pages: above detection's 1024 tokens
    pool = pd.PagePool(shared + 4 * b + 8, p, hkv, d, "float16", backend="cuda")
    root = pool.new_sequence()
    pool.append(root, *(rng.standard_normal((2, shared * p, hkv, d)).astype(np.float16)))
    seqs = []
    for i in range(b):
        s = pool.fork(root)
        pool.append(s, *(rng.standard_normal((2, 20 + 7 * i, hkv, d)).astype(np.float16)))
        seqs.append(s)
    table = pool.page_table(seqs)
    cplan = pd.plan_cascade(table, hkv * g, hkv, d)
    assert cplan is not None and cplan.prefix_row_tiles == 1
    q = cp.asarray(rng.standard_normal((b, hkv * g, d)).astype(np.float16))
    out = cp.full(q.shape, np.nan, cp.float32)
    lse = cp.full(q.shape[:2], np.nan, cp.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        if how == "prepared":
            call = pd.prepare_decode(q, pool.k, pool.v, table, out=out, lse=lse, cascade=cplan,
                                     out_dtype="float32")
            assert call.path == "cascade" and call.compiled
        else:
            def call():
                return pd.decode(q, pool.k, pool.v, table, out=out, lse=lse, cascade=cplan,
                                 out_dtype="float32")
        call()
        stream.synchronize()
        assert "level 0: tensor-core prefix" in pd.last_outcome().detail
        eager = cp.asnumpy(out)
        out.fill(np.nan)
        lse.fill(np.nan)
        q2 = cp.asarray(rng.standard_normal((b, hkv * g, d)).astype(np.float16))
        graph = _capture_on(stream, call)
        stream.synchronize()
        assert np.isnan(cp.asnumpy(out)).all()      # capture ran nothing
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(out), eager)
        q[...] = q2                                  # the replay reads the bound q now
        graph.launch(stream)
        stream.synchronize()
    ref, ref_lse = oracle_decode(cp.asnumpy(q2), pool.k.get(), pool.v.get(), table)
    assert max_rel_error(cp.asnumpy(out), ref) <= PREFIX_RTOL["float16"]
    assert lse_error(cp.asnumpy(lse), ref_lse) <= LSE_ATOL


@pytest.mark.parametrize("path", ["v2", "v2tc"])
def test_a_prepared_call_over_a_step_table_follows_the_pool_on_the_gpu(cuda, path):
    """Eager calls of one prepared call while the pool appends: each call brings the
    device table up to date and checks the plan (the session-21 fix; CPU-tested in
    tests/test_prepared_follow.py)."""
    import cupy as cp
    rng = np.random.default_rng(11)
    p, hkv, d, hq = 16, 2, 128, 8
    pool = pd.PagePool(64, p, num_kv_heads=hkv, head_dim=d, dtype="float16", backend=cuda)
    seqs = [pool.new_sequence() for _ in range(3)]

    def grow(n):
        for s in seqs:
            x = rng.standard_normal((n, hkv, d)).astype(np.float16)
            pool.append(s, cp.asarray(x), cp.asarray(x))

    grow(40)
    st = pool.step_table(seqs)
    plan = pd.plan_decode(st, hq, hkv, d, backend=cuda, pages_per_chunk=1, headroom=16,
                          path=path)
    q = cp.asarray(rng.standard_normal((3, hq, d)).astype(np.float16))
    out = cp.full((3, hq, d), np.nan, np.float16)
    prep = pd.prepare_decode(q, pool.k, pool.v, st, plan, path=path, out=out)
    for step in range(3):
        prep()
        want, _ = oracle_decode(q.get(), pool.k.get(), pool.v.get(), st.page_table())
        tol = PREFIX_RTOL["float16"] if path == "v2tc" else OUT_RTOL["float16"]
        assert max_rel_error(out.get(), want) <= tol, f"{path} step {step}"
        grow(1)
    grow(40)
    with pytest.raises(pd.errors.PlanMismatchError, match="plan does not match"):
        prep()
