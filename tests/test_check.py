"""The correctness matrix behind ``paged-decode check`` (CPU, reference backend)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import IgnoresIndices

from paged_decode import DecodeOutcome, check, problems, reference
from paged_decode.backends import availability
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.check import (
    ALL_PATHS,
    AXES,
    TC_PATHS,
    CheckConfig,
    check_config,
    default_paths,
    format_result,
    matrix,
    path_applies,
    run_check,
)
from paged_decode.plan import MAX_CHUNKS, chunk_counts
from paged_decode.problems import make_table


def test_small_run_passes_on_reference():
    seen = []
    rep = run_check(ReferenceBackend(), max_configs=2, progress=seen.append)
    assert rep.passed, rep.summary()
    paths = default_paths(ReferenceBackend())
    assert paths == tuple(p for p in ALL_PATHS if p not in TC_PATHS)   # no tensor cores
    assert len(rep.results) == 2 * len(paths) == len(seen)
    assert {r.path for r in rep.results} == set(paths)
    for r in rep.results:
        assert r.passed and r.error is None
        assert r.max_rel_error < 1e-4 and r.lse_error < 1e-4
        assert "PASS" in format_result(r) and r.config.label in format_result(r)
        if r.path.startswith("v2"):
            assert r.ran == ("v2+merge" if r.merged else "v2")
            assert r.num_ctas == r.num_chunks * r.config.num_kv_heads
        else:
            assert r.ran == r.path and r.pages_per_chunk is None
    forced = [r for r in rep.results if r.path == "v2-forced-merge"]
    assert all(r.pages_per_chunk == 1 and r.merged for r in forced)
    single = [r for r in rep.results if r.path == "v2-single"]
    assert all(r.num_chunks == r.config.batch and not r.merged and r.ran == "v2"
               for r in single)
    n = len(rep.results)
    assert f"PASS: {n}/{n}" in rep.summary()
    data = json.loads(rep.to_json())
    assert data["passed"] and len(data["results"]) == n


def test_ignoring_indices_fails(tmp_path):
    rep = run_check(IgnoresIndices(), max_configs=2)
    assert not rep.passed
    bad = {r.path for r in rep.failures}
    assert bad == {"v2", "v2-forced-merge", "v2-single"}   # v1 and gather are honest
    assert len(rep.failures) == 2 * 3
    assert all(r.max_rel_error > 1e-1 for r in rep.failures)
    assert "FAIL" in rep.summary() and "FAIL" in format_result(rep.failures[0])
    assert not json.loads(rep.to_json())["passed"]
    # a non-finite error is written null (strict JSON), and the shard merger reads it as
    # the worst error
    import subprocess
    import sys
    from pathlib import Path
    rep.failures[0].max_rel_error = math.nan
    text = rep.to_json()
    assert "NaN" not in text
    assert any(r["max_rel_error"] is None for r in json.loads(text)["results"])
    (tmp_path / "a.json").write_text(text)
    res = subprocess.run([sys.executable, "bench/device/merge_check_shards.py",
                          str(tmp_path / "m.json"), str(tmp_path / "a.json")],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert res.returncode == 0 and "worst max-rel inf" in res.stdout, res.stderr


def test_wrong_path_recorded_fails(monkeypatch):
    class RaisesOnGather(ReferenceBackend):
        name = "raises"

        def gather_sdpa(self, *args):
            raise RuntimeError("boom")

    rep = run_check(RaisesOnGather(), max_configs=1, paths=("gather",))
    assert not rep.passed and "boom" in rep.failures[0].error
    assert math.isinf(rep.failures[0].max_rel_error)

    # right numbers, but the recorded outcome says another path ran (a silent fallback)
    monkeypatch.setattr(check, "last_outcome",
                        lambda: DecodeOutcome("gather", "reference", 1, 1, 1, "fallback"))
    rep = run_check(ReferenceBackend(), max_configs=1, paths=("v1",))
    assert not rep.passed and "ran gather" in rep.failures[0].error
    # a stale outcome (nothing recorded by this call) fails too
    stale = DecodeOutcome("gather", "reference", 1, 1, 1, "an earlier call")
    monkeypatch.setattr(check, "last_outcome", lambda: stale)
    rep = run_check(ReferenceBackend(), max_configs=1, paths=("gather",))
    assert not rep.passed and "nothing recorded" in rep.failures[0].error


def test_nan_output_fails():
    class NaNMerge(ReferenceBackend):
        name = "nan-merge"

        def merge(self, v, lse, o_indptr, v_out, lse_out):
            super().merge(v, lse, o_indptr, v_out, lse_out)
            v_out[0, 0, 0] = np.nan

    rep = run_check(NaNMerge(), max_configs=1, paths=("v2-forced-merge", "gather"))
    assert [r.passed for r in rep.results] == [False, True]
    assert math.isinf(rep.results[0].max_rel_error)


def test_full_matrix_axes():
    for dtypes in (["float16"], ["float16", "bfloat16", "float32"]):
        cfgs = matrix(True, dtypes)
        assert len(cfgs) == 360 * len(dtypes)
        assert len({c.label for c in cfgs}) == len(cfgs)
        for name, values in AXES.items():
            assert {getattr(c, name) for c in cfgs} == set(values)
        assert {c.kv_dtype for c in cfgs} == set(dtypes)
        assert all(c.q_dtype == c.kv_dtype and c.num_kv_heads == 4 for c in cfgs)
    assert [len(AXES[a]) for a in AXES] == [2, 5, 3, 4, 3]
    # every reduction path of the v2 partial: transposed heads (1, 4, 8 per CTA), one
    # butterfly per head (7), two CTAs per KV head (16)
    assert set(AXES["gqa"]) == {1, 4, 7, 8, 16}


def test_quick_matrix_covers_every_value():
    cfgs = matrix(False, ["float16"])
    assert 30 <= len(cfgs) <= 36
    assert cfgs == matrix(False, ["float16"])                      # deterministic
    assert len({c.label for c in cfgs}) == len(cfgs)
    names = list(AXES)
    for i, a in enumerate(names):                                  # every pair of values
        for b in names[i + 1:]:
            got = {(getattr(c, a), getattr(c, b)) for c in cfgs}
            assert len(got) == len(AXES[a]) * len(AXES[b]), (a, b)
    specs = {(c.head_dim, c.gqa, c.page_size) for c in cfgs}       # every specialization
    assert len(specs) == 2 * 5 * 3
    pairs = {(c.context, c.batch) for c in cfgs}
    assert (32768, 8) in pairs and (512, 1) in pairs
    assert len(matrix(False, ["float16", "float32"])) == 2 * len(cfgs)
    full = {c.label for c in matrix(True, ["float16"])}
    assert {c.label for c in cfgs} <= full


def test_seed_is_per_geometry():
    a = matrix(True, ["float16"])
    b = matrix(True, ["bfloat16"])
    assert [c.seed for c in a] == [c.seed for c in b]
    assert len({c.seed for c in a}) == len(a)


def ref_oracle_loop(q, k_pages, v_pages, table):
    """A slow, obviously-correct oracle: per request, per query head, token by token."""
    b, hq, d = q.shape
    hkv = k_pages.shape[2]
    out = np.zeros((b, hq, d))
    lse = np.full((b, hq), -np.inf)
    for r in range(b):
        toks = []
        for t in range(int(table.visible_lens[r])):
            a = int(table.first_page_offset[r]) + t
            page = int(table.indices[table.indptr[r] + a // table.page_size])
            toks.append((page, a % table.page_size))
        for h in range(hq):
            kvh = h // (hq // hkv)
            if not toks:
                continue
            xs = [float(np.dot(q[r, h].astype(np.float64),
                               k_pages[pg, e, kvh].astype(np.float64))) / np.sqrt(d)
                  for pg, e in toks]
            mx = max(xs)
            ws = [np.exp(x - mx) for x in xs]
            acc = sum(w * v_pages[pg, e, kvh].astype(np.float64) for w, (pg, e) in zip(ws, toks))
            out[r, h] = acc / sum(ws)
            lse[r, h] = (mx + np.log(sum(ws))) / np.log(2.0)
    return out, lse


def test_oracle_matches_a_token_by_token_loop():
    for g, d, ps in ((1, 64, 16), (4, 128, 32), (8, 64, 1)):
        spec = problems.ProblemSpec(3, 120, 2 * g, 2, d, ps, "bfloat16", "float16", seed=g)
        p = problems.make_problem(spec)
        o1, l1 = ref_oracle_loop(p.q, p.k_pages, p.v_pages, p.table)
        o2, l2 = reference.oracle_decode(p.q, p.k_pages, p.v_pages, p.table)
        np.testing.assert_allclose(o2, o1, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(l2, l1, rtol=1e-10, atol=1e-10)
    # an empty request: zeros and -inf
    table, n = make_table([5, 0, 3], 4, offsets=[1, 0, 2])
    rng = np.random.default_rng(0)
    k = rng.standard_normal((n, 4, 2, 8)).astype(np.float32)
    q = rng.standard_normal((3, 4, 8)).astype(np.float32)
    o1, l1 = ref_oracle_loop(q, k, k, table)
    o2, l2 = reference.oracle_decode(q, k, k, table)
    np.testing.assert_allclose(o2, o1, rtol=1e-10, atol=1e-10)
    assert np.array_equal(np.isneginf(l2), np.isneginf(l1)) and np.isneginf(l2[1]).all()


def test_forced_merge_ppc_respects_grid_bound():
    table, _ = make_table([10] * 3, 4)
    assert check.forced_merge_ppc(table) == 1
    table, _ = make_table([70000, 70000], 1)      # 140000 one-token pages
    ppc = check.forced_merge_ppc(table)
    pages = table.pages_per_request
    assert int(chunk_counts(pages, ppc).sum()) <= MAX_CHUNKS
    assert int(chunk_counts(pages, ppc - 1).sum()) > MAX_CHUNKS


def test_tolerance_table_and_config():
    assert check.TOLERANCES == {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}
    assert max(check.TOLERANCES.values()) <= 2e-2                 # the bound
    c = CheckConfig(128, 4, 16, 4096, 8, kv_dtype="bfloat16", q_dtype="bfloat16", seed=3)
    assert c.num_qo_heads == 16 and c.label == "D128-G4-P16-ctx4096-B8-bfloat16"
    s = c.spec
    assert (s.num_qo_heads, s.num_kv_heads, s.head_dim, s.page_size, s.batch) == (16, 4, 128, 16, 8)
    with pytest.raises(ValueError):
        run_check(ReferenceBackend(), paths=("v3",), max_configs=1)
    with pytest.raises(ValueError):
        run_check(ReferenceBackend(), dtypes=("float64",), max_configs=1)


@pytest.mark.skipif(not availability("emulated-cuda").ok, reason="no emulator")
def test_tensor_core_paths_run_on_emulated_cuda_for_16_bit_configs():
    from paged_decode import get_backend
    be = get_backend("emulated-cuda")
    assert set(TC_PATHS) <= set(default_paths(be))
    rep = run_check(be, max_configs=2, paths=TC_PATHS, dtypes=("bfloat16",))
    assert rep.passed, rep.summary()
    assert len(rep.results) == 4 and {r.path for r in rep.results} == set(TC_PATHS)
    for r in rep.results:
        assert r.ran == ("v2tc+merge" if r.merged else "v2tc")
        assert r.num_ctas == r.num_chunks * r.config.num_kv_heads   # one 16-row tile
    # a float32 configuration has no tensor-core run (no result, not a pass)
    cfg = CheckConfig(64, 4, 16, 512, 1, q_dtype="float32", kv_dtype="float32")
    assert not path_applies("v2tc", cfg)
    assert check_config(be, cfg, TC_PATHS) == []
