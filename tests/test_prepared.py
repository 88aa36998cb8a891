"""Prepared decode calls on the CPU backends: same results as ``decode``, bound buffers,
outcomes, errors. (The CUDA launch packing and graph capture are in test_cuda_graphs.)"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle

import paged_decode as pd
from paged_decode.errors import InvalidArgumentError, PlanMismatchError
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode

SPEC = ProblemSpec(3, 300, 8, 2, 64, 16, seed=3)


@pytest.mark.parametrize("path,ppc", [("v2", None), ("v2", 1), ("v1", None),
                                      ("gather", None)])
def test_prepared_equals_decode_and_oracle(path, ppc):
    pr = make_problem(SPEC)
    plan = pd.plan_decode(pr.table, 8, 2, 64, backend="reference", pages_per_chunk=ppc)
    prep = pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path,
                             return_lse=True)
    out, lse = prep()
    want, want_lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path,
                               return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, lse, ref, ref_lse, "float16", f"prepared {path}")
    assert prep.path == ("v2+merge" if path == "v2" and plan.needs_merge else path)
    prep()
    assert pd.last_outcome().path == prep.path
    assert "prepared call" in pd.last_outcome().reason


def test_prepared_reads_bound_buffers_at_call_time():
    pr = make_problem(SPEC)
    q = pr.q.copy()
    out = np.full(q.shape, np.nan, np.float16)
    prep = pd.prepare_decode(q, pr.k_pages, pr.v_pages, pr.table, path="v2", out=out)
    assert prep() is out
    first = out.copy()
    q[...] = np.random.default_rng(9).standard_normal(q.shape).astype(np.float16)
    prep()
    assert not np.array_equal(out, first)
    ref, _ = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, None, ref, None, "float16", "after an in-place q update")


def test_prepared_without_out_allocates_once():
    pr = make_problem(SPEC)
    prep = pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    a = prep()
    assert prep() is a and prep.lse is None


def test_prepared_errors_name_the_function():
    pr = make_problem(SPEC)
    with pytest.raises(InvalidArgumentError, match="prepare_decode: path"):
        pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v3")
    with pytest.raises(InvalidArgumentError, match="prepare_decode: out"):
        pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table,
                          out=np.zeros((1, 8, 64), np.float16))
    other = make_problem(ProblemSpec(2, 100, 8, 2, 64, 16, seed=4))
    plan = pd.plan_decode(other.table, 8, 2, 64, backend="reference")
    with pytest.raises((PlanMismatchError, InvalidArgumentError), match="prepare_decode"):
        pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan)
    with pytest.raises(InvalidArgumentError, match="return_lse"):
        pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, return_lse=1)


def test_prepared_on_the_emulated_cuda_kernels():
    pytest.importorskip("paged_decode.emulator")
    from paged_decode.backends import availability
    if not availability("emulated-cuda").ok:
        pytest.skip(availability("emulated-cuda").reason)
    spec = ProblemSpec(2, 80, 4, 2, 64, 16, seed=5)
    pr = make_problem(spec)
    plan = pd.plan_decode(pr.table, 4, 2, 64, backend="emulated-cuda", pages_per_chunk=2)
    prep = pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path="v2",
                             backend="emulated-cuda", return_lse=True)
    out, lse = prep()
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, lse, ref, ref_lse, "float16", "prepared on emulated-cuda")


def test_decode_fast_path_reuses_a_prepared_call_only_for_the_same_objects():
    from paged_decode.prepared import decode_cache
    decode_cache.clear()
    pr = make_problem(SPEC)
    q = pr.q.copy()
    plan = pd.plan_decode(pr.table, 8, 2, 64, backend="reference", pages_per_chunk=2)
    out = np.full(q.shape, np.nan, np.float16)
    args = (q, pr.k_pages, pr.v_pages, pr.table, plan)
    pd.decode(*args, out=out)
    assert len(decode_cache._entries) == 1
    first = out.copy()
    out.fill(np.nan)
    assert pd.decode(*args, out=out) is out          # replayed from the cache
    np.testing.assert_array_equal(out, first)
    assert "prepared call" in pd.last_outcome().reason
    q[...] = np.random.default_rng(11).standard_normal(q.shape).astype(np.float16)
    pd.decode(*args, out=out)                        # in-place updates are seen
    ref, _ = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table)
    assert_matches_oracle(out, None, ref, None, "float16", "fast path after a q update")
    # anything else (another output, no output, return_lse without lse, another scale,
    # a path) takes the full path or a new entry
    pd.decode(*args, out=np.empty_like(out))
    pd.decode(*args)
    pd.decode(*args, out=out, return_lse=True)
    pd.decode(*args, out=out, sm_scale=0.5)
    assert len(decode_cache._entries) == 3
    for _ in range(2 * decode_cache.MAX):
        pd.decode(*args, out=np.empty_like(out))
    assert len(decode_cache._entries) == decode_cache.MAX
    decode_cache.clear()


def test_decode_fast_path_keys_on_the_backend_instance():
    from paged_decode.backends.reference import ReferenceBackend
    from paged_decode.prepared import decode_cache
    decode_cache.clear()

    class Zeroing(ReferenceBackend):
        def partial(self, q, k, v, table, plan, scale, v_out, lse_out):
            v_out[...] = 0
            lse_out[...] = 0

    pr = make_problem(SPEC)
    plan = pd.plan_decode(pr.table, 8, 2, 64, backend="reference", pages_per_chunk=2)
    out = np.empty(pr.q.shape, np.float16)
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, out=out, backend="reference")
    good = out.copy()
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, out=out, backend=Zeroing())
    assert not np.array_equal(out, good)             # the other backend really ran
    decode_cache.clear()


@pytest.mark.parametrize("name", sorted(__import__("paged_decode.settings",
                                                    fromlist=["x"]).VARIABLES))
def test_decode_fast_path_keys_on_every_setting(monkeypatch, name):
    """A prepared call is replayed only under the settings it was prepared with: every
    PAGED_DECODE_* variable is part of the key (the PREFIX_TILE one once was not), so a
    change of any of them prepares afresh instead of replaying stale launches."""
    from paged_decode.prepared import decode_cache
    decode_cache.clear()
    pr = make_problem(SPEC)
    plan = pd.plan_decode(pr.table, 8, 2, 64, backend="reference", pages_per_chunk=2)
    out = np.empty(pr.q.shape, np.float16)
    args = (pr.q, pr.k_pages, pr.v_pages, pr.table, plan)
    pd.decode(*args, out=out, backend="reference")
    pd.decode(*args, out=out, backend="reference")
    assert len(decode_cache._entries) == 1
    # a value that keeps the call valid, so only the key can tell the calls apart
    monkeypatch.setenv(name, "" if name != "PAGED_DECODE_POISON" else "0")   # tests set 1
    pd.decode(*args, out=out, backend="reference")
    assert len(decode_cache._entries) == 2
    decode_cache.clear()
