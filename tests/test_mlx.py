"""MLX arrays on MLX's CPU device (the ``mlx`` backend, and routing): the gather arm
against the float64 oracle, the MLX-op merge, the page pool on MLX arrays, the
functional-output convention (``out=``), errors and registry routing.

Runs wherever the ``mlx`` wheel imports (CI installs ``mlx[cpu]``); the Metal kernels'
MLX glue is in ``test_mlx_kernels.py``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import assert_matches_oracle, require_mlx

import paged_decode as pd
from paged_decode import backends
from paged_decode.backends.cuda_gather import gather_rows
from paged_decode.backends.mlx import MetalBackend, MlxBackend
from paged_decode.backends.mlx_gather import gather_index
from paged_decode.dtypes import numpy_dtype
from paged_decode.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    InvalidDtypeError,
    UnsupportedProblemError,
)
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import max_rel_error, oracle_decode

mx = require_mlx()   # skips when mlx is missing or cannot load


@pytest.fixture(autouse=True)
def _cpu_device():
    """Everything here runs on MLX's CPU device, on a Mac too."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.fixture(scope="module")
def be():
    return pd.get_backend("mlx")


def _mx(be, *arrays):
    return tuple(be.asarray(a) for a in arrays)


# ---------------------------------------------------------------------------- gather arm
GATHER_CASES = [
    # (q dtype, kv dtype, out dtype, Hkv, G, D, P, lengths, offsets)
    ("float16", "float16", None, 2, 1, 64, 16, (37, 16, 1, 100), (0, 5, 0, 15)),
    ("bfloat16", "bfloat16", None, 2, 4, 128, 16, (200, 0, 33), (3, 0, 0)),
    ("float32", "float32", None, 1, 8, 96, 8, (0, 64, 9), (0, 7, 1)),
    ("float16", "float16", "float32", 4, 4, 64, 1, (30, 1, 0, 7), None),
    ("bfloat16", "bfloat16", "float32", 2, 2, 64, 32, (500, 31), (31, 0)),
    ("float32", "float16", None, 2, 4, 64, 16, (50, 70), (2, 0)),     # mixed q / KV dtypes
    ("float16", "bfloat16", "float16", 2, 4, 64, 16, (45, 0), (9, 0)),
]


@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: f"{c[0]}-{c[1]}-G{c[4]}-P{c[6]}")
def test_gather_matches_oracle(be, case):
    qd, kvd, od, hkv, g, d, p, lengths, offsets = case
    spec = ProblemSpec(len(lengths), 64, hkv * g, hkv, d, p, qd, kvd, seed=len(lengths) + d)
    pr = make_problem(spec, lengths=list(lengths), offsets=list(offsets) if offsets else None)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    q, k, v = _mx(be, pr.q, pr.k_pages, pr.v_pages)
    out, lse = pd.decode(q, k, v, pr.table, return_lse=True, out_dtype=od, backend=be)
    assert isinstance(out, mx.array) and isinstance(lse, mx.array)
    assert be.dtype_of(out) == (od or qd) and lse.dtype == mx.float32
    outcome = pd.last_outcome()
    assert (outcome.path, outcome.backend) == ("gather", "mlx")
    assert "MLX ops only" in outcome.reason
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, od or qd,
                          f"mlx gather {case}")
    empty = np.asarray(pr.table.visible_lens) == 0
    assert (be.to_numpy(out)[empty] == 0).all() and np.isneginf(be.to_numpy(lse)[empty]).all()
    # without the LSE the output is the same SDPA result
    again = pd.decode(q, k, v, pr.table, path="gather", out_dtype=od, backend=be)
    np.testing.assert_array_equal(be.to_numpy(again), be.to_numpy(out))


def test_gather_lse_is_base_2(be):
    """One token: out = v, lse = log2(exp(s)) = s / ln 2 with s = scale * q.k."""
    q = np.array([[[1.0, 2.0, 0.0, 0.0]]], np.float32)
    k = np.zeros((2, 4, 1, 4), np.float32)
    k[1, 2, 0] = [0.5, 0.25, 0, 0]
    v = np.zeros_like(k)
    v[1, 2, 0] = [3, 4, 5, 6]
    table = pd.PageTable.build([1], [0, 1], [3], page_size=4, first_page_offset=[2])
    out, lse = pd.decode(*_mx(be, q, k, v), table, path="gather", return_lse=True,
                         sm_scale=2.0, backend=be)
    np.testing.assert_allclose(be.to_numpy(out), [[[3, 4, 5, 6]]], rtol=1e-6)
    np.testing.assert_allclose(be.to_numpy(lse), [[2.0 * 1.0 / math.log(2.0)]], rtol=1e-6)


def test_gather_index_skips_unreadable_entries():
    """Padding and empty requests read a visible row (pools hold NaN elsewhere)."""
    pr = make_problem(ProblemSpec(3, 40, 4, 2, 64, 16, seed=5), lengths=[40, 0, 3],
                      offsets=[9, 0, 2])
    rows, valid, empty = (np.array(a) for a in gather_index(pr.table))
    assert rows.shape == (3, 40) and valid.sum(axis=1).tolist() == [40, 0, 3]
    assert empty.tolist() == [False, True, False]
    flat = pr.k_pages.reshape(-1, 2, 64)
    assert np.isfinite(flat[rows[[0, 2]]].astype(np.float32)).all()


class _IgnoresIndices(MlxBackend):
    """A broken gather: request r's pages taken as CSR positions, not ``indices``."""

    def gather_rows(self, table):
        rows = gather_rows(table).copy()
        p = table.page_size
        for r in range(table.batch_size):
            n = int(table.visible_lens[r])
            a = int(table.first_page_offset[r]) + np.arange(n)
            rows[r, :n] = (int(table.indptr[r]) + a // p) * p + a % p
        return mx.array(np.where(rows >= 0, rows, -1 - rows).astype(np.int32))


def test_negative_control_gather_ignoring_indices_fails(be):
    pr = make_problem(ProblemSpec(4, 90, 8, 2, 64, 16, seed=11))
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    q, k, v = _mx(be, pr.q, pr.k_pages, pr.v_pages)
    good = pd.decode(q, k, v, pr.table, path="gather", backend=be)
    bad = pd.decode(q, k, v, pr.table, path="gather", backend=_IgnoresIndices())
    assert max_rel_error(be.to_numpy(good), ref) < 1e-2
    assert max_rel_error(be.to_numpy(bad), ref) > 0.1


# ---------------------------------------------------------------------------- out= / lse=
def test_out_and_lse_arguments_are_rebound(be):
    pr = make_problem(ProblemSpec(2, 50, 8, 2, 64, 16, seed=2))
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    q, k, v = _mx(be, pr.q, pr.k_pages, pr.v_pages)
    out, lse = mx.zeros((2, 8, 64), mx.float16), mx.zeros((2, 8), mx.float32)
    keep = out
    got = pd.decode(q, k, v, pr.table, out=out, lse=lse, backend=be)
    assert got is out and keep is out           # the caller's object holds the result
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "float16")
    got, got_lse = pd.decode(q, k, v, pr.table, out=out, lse=lse, return_lse=True,
                             backend=be)
    assert got is out and got_lse is lse


def test_out_must_be_an_mlx_array(be):
    pr = make_problem(ProblemSpec(2, 20, 4, 2, 64, 16, seed=2))
    q, k, v = _mx(be, pr.q, pr.k_pages, pr.v_pages)
    with pytest.raises(InvalidArgumentError,
                       match=r"decode: out must be an array of backend 'mlx' .*numpy.ndarray"):
        pd.decode(q, k, v, pr.table, out=np.zeros((2, 4, 64), np.float16), backend=be)
    with pytest.raises(InvalidArgumentError, match=r"decode: lse must be an array of backend"):
        pd.decode(q, k, v, pr.table, lse=np.zeros((2, 4), np.float32), backend=be)
    with pytest.raises(InvalidArgumentError,
                       match=r"decode: out must have shape \[B, Hq, D\] = \[2, 4, 64\], got "
                             r"\[2, 4, 32\]"):
        pd.decode(q, k, v, pr.table, out=mx.zeros((2, 4, 32), mx.float16))
    with pytest.raises(InvalidArgumentError, match="decode: out must have dtype float16, got "
                                                   "float32"):
        pd.decode(q, k, v, pr.table, out=mx.zeros((2, 4, 64), mx.float32))


# ---------------------------------------------------------------------------- errors
def test_bad_inputs_name_function_and_argument(be):
    pr = make_problem(ProblemSpec(2, 20, 4, 2, 64, 16, seed=2))
    q, k, v = _mx(be, pr.q, pr.k_pages, pr.v_pages)
    with pytest.raises(InvalidArgumentError,
                       match=r"decode: q must have shape \[B, Hq, D\] = \[2, 4, 64\], got "
                             r"\[2, 4, 32\]"):
        pd.decode(q[..., :32], k, v, pr.table)
    with pytest.raises(InvalidDtypeError, match="decode: q must have dtype in"):
        pd.decode(q.astype(mx.int32), k, v, pr.table)
    with pytest.raises(InvalidArgumentError, match="decode: v_pages must have k_pages' dtype"):
        pd.decode(q, k, v.astype(mx.float32), pr.table)
    with pytest.raises(InvalidArgumentError, match="mlx backend: cannot use a"):
        be.asarray(object())


def test_kernel_paths_need_metal(be):
    pr = make_problem(ProblemSpec(2, 20, 4, 2, 64, 16, seed=2))
    q, k, v = _mx(be, pr.q, pr.k_pages, pr.v_pages)
    for path in ("v2", "v1"):
        with pytest.raises(UnsupportedProblemError,
                           match=rf"decode: backend 'mlx' cannot run path '{path}': the "
                                 rf"{path} kernel needs Metal \(.*is_available"):
            pd.decode(q, k, v, pr.table, path=path, backend=be)
    with pytest.raises(InvalidArgumentError, match="cascade runs on the v2 kernels"):
        pd.decode(q, k, v, pr.table, cascade=True, backend=be)


def test_metal_is_unavailable_without_metal_and_says_why():
    if mx.metal.is_available():
        pytest.skip("Metal is available here")
    sup = backends.availability("metal")
    assert not sup.ok and "mx.metal.is_available() is False" in sup.reason
    with pytest.raises(BackendUnavailableError, match=r"backend 'metal' is not usable here "
                                                      r"\(MLX .* Metal is not available"):
        pd.get_backend("metal")
    assert backends.availability("mlx").ok


def test_mlx_arrays_route_to_metal_or_mlx(be, monkeypatch):
    x = mx.zeros((1,))
    monkeypatch.delenv(backends.ENV, raising=False)
    want = "metal" if mx.metal.is_available() else "mlx"
    assert backends.backend_for(None, x).name == want
    assert backends.backend_for("reference", x).name == "reference"   # explicit wins
    monkeypatch.setattr(backends, "_instances", {})
    monkeypatch.setattr(MetalBackend, "available", classmethod(lambda cls: pd.backends.Support(
        True)))
    assert backends.backend_for(None, x).name == "metal"


# ---------------------------------------------------------------------------- merge
def test_merge_states_on_mlx_matches_reference(be):
    rng = np.random.default_rng(4)
    n, h, d = 9, 3, 16
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    lse = (rng.standard_normal((n, h)) * 4).astype(np.float32)
    lse[2] = -np.inf
    v[2] = 0
    lse[5, 1] = np.nan                               # NaN poisons its group (row 4, head 1)
    lse[6, 2] = np.inf                               # so does +inf (row 4, head 2)
    indptr = np.array([0, 1, 1, 3, 3, 7, 9])         # singles, empties, an all -inf group
    lse[7:9] = -np.inf
    v[7:9] = 0
    ref_v, ref_l = pd.merge_states(v, lse, indptr, backend="reference")
    got_v, got_l = pd.merge_states(mx.array(v), mx.array(lse), indptr)
    assert isinstance(got_v, mx.array)
    gv, gl = be.to_numpy(got_v), be.to_numpy(got_l)
    np.testing.assert_allclose(gv, ref_v, rtol=2e-6, atol=2e-6)      # NaN == NaN here
    assert np.isnan(gv[4, 1:]).all() and np.isnan(gl[4, 1:]).all() and np.isfinite(gl[4, 0])
    fin = np.isfinite(ref_l)
    assert (np.isneginf(gl) == np.isneginf(ref_l)).all()
    np.testing.assert_allclose(gl[fin], ref_l[fin], rtol=1e-6, atol=1e-6)
    assert (gv[[1, 3, 5]] == 0).all()                # empty and all -inf groups: zeros
    v2, l2 = pd.merge_state(mx.array(v[:4]), mx.array(lse[:4]), mx.array(v[4:8]),
                            mx.array(lse[4:8]))
    r2, rl2 = pd.merge_state(v[:4], lse[:4], v[4:8], lse[4:8])
    np.testing.assert_allclose(be.to_numpy(v2), r2, rtol=2e-6, atol=2e-6)


# ---------------------------------------------------------------------------- pool
def _drive(pool, rng):
    """The same sequence of pool operations on any backend; returns the sequences."""
    t = pool.num_layers
    shape = lambda n: ((t,) if t else ()) + (n, pool.num_kv_heads, pool.head_dim)  # noqa: E731
    kv = lambda n: (rng.standard_normal(shape(n)).astype(np.float32).astype(np.float16),)  # noqa: E731
    a = pool.new_sequence()
    x = kv(21)[0]
    pool.append(a, x, -x)                            # crosses pages (page size 8)
    b = pool.fork(a)                                 # shares every page
    y = kv(5)[0]
    pool.append(b, y, y)                             # copy-on-write of the shared last page
    pool.append(a, x[..., :2, :, :], x[..., :2, :, :])
    pool.trim_front(b, 9)                            # releases b's first page
    c = pool.new_sequence()
    pool.append(c, kv(0)[0], kv(0)[0])               # nothing
    return [a, b, c]


@pytest.mark.parametrize("layers", [None, 3])
def test_pool_on_mlx_arrays_matches_numpy_pool(be, layers):
    ref = pd.PagePool(16, 8, 2, 8, "float16", num_layers=layers, backend="reference")
    got = pd.PagePool(16, 8, 2, 8, "float16", num_layers=layers, backend="mlx")
    seqs_r = _drive(ref, np.random.default_rng(0))
    seqs_m = _drive(got, np.random.default_rng(0))
    assert isinstance(got.k, mx.array) and got.k.dtype == mx.float16
    np.testing.assert_array_equal(be.to_numpy(got.k), ref.k)
    np.testing.assert_array_equal(be.to_numpy(got.v), ref.v)
    tm, tr = got.page_table(seqs_m), ref.page_table(seqs_r)
    for name in ("indices", "indptr", "last_page_len", "first_page_offset", "rope_positions"):
        np.testing.assert_array_equal(getattr(tm, name), getattr(tr, name))
    k0, v0 = got.layer(layers - 1 if layers else 0)
    assert tuple(k0.shape) == (16, 8, 2, 8)


def test_pool_writes_return_new_arrays(be):
    pool = pd.PagePool(4, 4, 1, 8, "float32", backend="mlx")
    s = pool.new_sequence()
    before = pool.k
    pool.append(s, np.ones((3, 1, 8), np.float32), np.ones((3, 1, 8), np.float32))
    assert pool.k is not before and float(mx.sum(before).item()) == 0.0  # a snapshot stays
    assert float(mx.sum(pool.k).item()) == 24.0


def test_decode_from_an_mlx_pool(be):
    rng = np.random.default_rng(3)
    pool = pd.PagePool(32, 16, 2, 64, "bfloat16", backend="mlx")
    seqs = [pool.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, (40, 17, 1)):
        kv = rng.standard_normal((n, 2, 64)).astype(np.float32)
        pool.append(s, mx.array(kv).astype(mx.bfloat16), mx.array(-kv).astype(mx.bfloat16))
    pool.trim_front(seqs[0], 20)
    table = pool.page_table(seqs)
    q = mx.array(rng.standard_normal((3, 8, 64)).astype(np.float32)).astype(mx.bfloat16)
    out, lse = pd.decode(q, pool.k, pool.v, table, return_lse=True, backend=be)
    ref, ref_lse = oracle_decode(be.to_numpy(q), be.to_numpy(pool.k), be.to_numpy(pool.v),
                                 table)
    assert_matches_oracle(be.to_numpy(out), be.to_numpy(lse), ref, ref_lse, "bfloat16")


# ---------------------------------------------------------------------------- arrays
def test_array_conversions_round_trip(be):
    for dt in ("float16", "bfloat16", "float32"):
        x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
        h = x.astype(numpy_dtype(dt))
        a = be.asarray(h)
        assert isinstance(a, mx.array) and be.dtype_of(a) == dt
        np.testing.assert_array_equal(be.to_numpy(a), h)
        assert be.asarray(a) is a


def test_poison_fills_fresh_arrays(be, monkeypatch):
    assert np.isnan(be.to_numpy(be.empty((2, 3), "float16"))).all()    # conftest poisons
    monkeypatch.setenv("PAGED_DECODE_POISON", "0")
    assert (be.to_numpy(be.empty((2, 3), "bfloat16")) == 0).all()


# ---------------------------------------------------------------------------- command line
def test_cli_info_check_and_bench_with_mlx_backends():
    import json

    from click.testing import CliRunner

    from paged_decode.cli import main
    runner = CliRunner()
    data = json.loads(runner.invoke(main, ["info", "--backend", "mlx", "--json"]).output)
    assert data["selected"] == "mlx" and data["backends"]["mlx"]["available"] is True
    metal = data["backends"]["metal"]
    assert metal["available"] == bool(mx.metal.is_available())
    res = runner.invoke(main, ["check", "--backend", "mlx", "--max-configs", "2",
                               "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    assert "paths: gather only" in res.output and "PASS: 2/2" in res.output
    res = runner.invoke(main, ["bench", "--backend", "mlx", "--context", "128", "--batch", "1",
                               "--page", "16", "--reps", "3", "--warmup", "1"])
    assert res.exit_code == 0, res.output
    assert "gather->gather" in res.output and "v2->unavailable" in res.output
    if not mx.metal.is_available():
        assert "mx.metal.is_available() is False" in metal["reason"]
        for cmd in ("check", "bench"):
            res = runner.invoke(main, [cmd, "--backend", "metal"])
            assert res.exit_code != 0
            assert "backend 'metal' is not usable here" in res.output
            assert "Metal is not available" in res.output


def test_synchronize_and_describe(be):
    lazy = mx.ones((4,)) * 3
    be.synchronize((lazy, None), None)             # decode's (out, lse) tuple form
    assert float(mx.sum(lazy).item()) == 12.0
    d = be.describe()
    assert d["backend"] == "mlx" and d["mlx"] == mx.__version__ and "device" in d


def test_sparse_decode_on_mlx_cpu_takes_the_masked_path_with_the_reason():
    from paged_decode.reference import attention_f64, max_rel_error
    from paged_decode.sparse import make_selection, sparse_decode
    rng = np.random.default_rng(31)
    b, hkv, cap, d, g = 2, 2, 256, 64, 4
    pos = np.stack([np.stack([np.sort(rng.choice(200, 24, replace=False))
                              for _ in range(hkv)]) for _ in range(b)]).astype(np.int32)
    sel = make_selection(pos)
    k, v = (rng.standard_normal((b, hkv, cap, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((b, hkv * g, d)).astype(np.float32)
    out = sparse_decode(mx.array(q), mx.array(k), mx.array(v), sel,
                        live_lens=np.full(b, 200))
    outcome = pd.last_outcome()
    if mx.metal.is_available():
        assert outcome.path == "sparse"
    else:
        assert outcome.path == "sparse-masked" and "cannot run the fused path" in outcome.reason
        with pytest.raises(pd.UnsupportedProblemError, match="sparse_decode"):
            sparse_decode(mx.array(q), mx.array(k), mx.array(v), sel,
                          live_lens=np.full(b, 200), min_sparsity=0)
    got = np.array(out)
    for r in range(b):
        for h in range(hkv):
            rows = pos[r, h]
            ref, _ = attention_f64(q[r, h * g:(h + 1) * g].astype(np.float64),
                                   k[r, h, rows][:, None, :].astype(np.float64),
                                   v[r, h, rows][:, None, :].astype(np.float64), 1 / np.sqrt(d))
            assert max_rel_error(got[r, h * g:(h + 1) * g], ref) <= 1e-5
