"""FlashInfer's state merges and page helpers on paged-decode: ``merge_state`` /
``merge_states`` / ``merge_state_in_place`` against the float64 attention over the joined
KV segments (FlashInfer's argument order), and ``append_paged_kv_cache`` /
``get_batch_indices_positions`` / ``get_seq_lens`` against pure-Python models of
FlashInfer's semantics (``flashinfer/page.py``, ``include/flashinfer/page.cuh``)."""

from __future__ import annotations

import numpy as np
import pytest
from fi_cases import fi_arrays
from helpers import LSE_ATOL, assert_import_adds_none_of, assert_matches_oracle

import paged_decode.compat.flashinfer as fi
from paged_decode import PageTable, get_backend
from paged_decode.backends import availability
from paged_decode.errors import InvalidArgumentError, InvalidDtypeError, UnsupportedProblemError
from paged_decode.reference import attention_f64, lse_error, max_rel_error


# ---------------------------------------------------------------------------- merges
def segments(rng, n, num, h=8, d=64, t=(1, 40)):
    """``num`` KV segments per row: queries ``[n, H, D]`` and each segment's exact state
    (float64 attention, base-2 LSE), plus the attention over all segments joined."""
    q = rng.standard_normal((n, h, d))
    vs, ss, full_o, full_l = [], [], np.zeros((n, h, d)), np.zeros((n, h))
    ks = [[rng.standard_normal((int(rng.integers(*t)), h, d)) for _ in range(num)]
          for _ in range(n)]
    vv = [[rng.standard_normal(k.shape) for k in row] for row in ks]
    for seg in range(num):
        o, s = zip(*(attention_f64(q[i], ks[i][seg], vv[i][seg], 0.125) for i in range(n)))
        vs.append(np.stack(o))
        ss.append(np.stack(s))
    for i in range(n):
        k = np.concatenate(ks[i]) if num else np.zeros((0, h, d))
        v = np.concatenate(vv[i]) if num else np.zeros((0, h, d))
        full_o[i], full_l[i] = attention_f64(q[i], k, v, 0.125)
    return vs, ss, full_o, full_l


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_merge_state_is_attention_over_both_segments(dtype):
    from paged_decode.dtypes import numpy_dtype
    rng = np.random.default_rng(20)
    (va, vb), (sa, sb), ref_o, ref_l = segments(rng, 16, 2)
    dt = numpy_dtype(dtype)
    v, s = fi.merge_state(va.astype(dt), sa.astype(np.float32), vb.astype(dt),
                          sb.astype(np.float32))
    assert v.dtype == dt and s.dtype == np.float32
    assert_matches_oracle(v, s, ref_o, ref_l, dtype, f"merge_state {dtype}")
    # FlashInfer's order is (v_a, s_a, v_b, s_b): pairing a V with the other's LSE is wrong
    bad, _ = fi.merge_state(va.astype(dt), sb.astype(np.float32), vb.astype(dt),
                            sa.astype(np.float32))
    assert max_rel_error(bad, ref_o) > 0.05


@pytest.mark.parametrize("num", [0, 1, 2, 5])
def test_merge_states_is_attention_over_every_segment(num):
    rng = np.random.default_rng(21 + num)
    vs, ss, ref_o, ref_l = segments(rng, 12, num)
    v = np.stack(vs, axis=1) if num else np.zeros((12, 0, 8, 64))
    s = np.stack(ss, axis=1) if num else np.zeros((12, 0, 8))
    out, lse = fi.merge_states(v.astype(np.float16), s.astype(np.float32))
    assert out.shape == (12, 8, 64) and out.dtype == np.float16
    assert_matches_oracle(out, lse, ref_o, ref_l, "float16", f"merge_states S={num}")


def torch_bool(a):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(a)


@pytest.mark.parametrize("mask_kind", ["uint8", "bool", "torch-bool", "int32"])
def test_merge_state_in_place_honours_the_mask(mask_kind):
    # FlashInfer documents a bool mask (its own tests pass torch.bool); uint8 works there too
    rng = np.random.default_rng(22)
    (va, vb), (sa, sb), ref_o, ref_l = segments(rng, 10, 2)
    v, s = va.astype(np.float32), sa.astype(np.float32)
    on = np.arange(10) % 3 == 0
    mask = {"uint8": lambda: on.astype(np.uint8), "bool": lambda: on.copy(),
            "torch-bool": lambda: torch_bool(on.copy()),
            "int32": lambda: on.astype(np.int32) * 7}[mask_kind]()
    fi.merge_state_in_place(v, s, vb.astype(np.float32), sb.astype(np.float32), mask)
    assert max_rel_error(v[on], ref_o[on]) < 1e-5 and lse_error(s[on], ref_l[on]) < LSE_ATOL
    np.testing.assert_array_equal(v[~on], va[~on].astype(np.float32))
    np.testing.assert_array_equal(s[~on], sa[~on].astype(np.float32))
    fi.merge_state_in_place(v, s, vb.astype(np.float32), sb.astype(np.float32) - np.inf)
    assert max_rel_error(v[on], ref_o[on]) < 1e-5        # a -inf state adds nothing
    with pytest.raises(InvalidArgumentError, match="s must be float32"):
        fi.merge_state_in_place(v, s.astype(np.float16), vb, sb)


def test_merge_state_in_place_checks_the_mask():
    rng = np.random.default_rng(24)
    (va, vb), (sa, sb), _, _ = segments(rng, 6, 2)
    args = (va.astype(np.float32), sa.astype(np.float32), vb.astype(np.float32),
            sb.astype(np.float32))
    with pytest.raises(InvalidArgumentError, match="mask must be a bool or integer array, "
                       "got dtype float32"):
        fi.merge_state_in_place(*args, np.ones(6, np.float32))
    with pytest.raises(InvalidArgumentError,
                       match=r"mask must have shape \[n\] = \[6\], got \[5\]"):
        fi.merge_state_in_place(*args, np.ones(5, bool))
    with pytest.raises(InvalidArgumentError, match="mask must be an array"):
        fi.merge_state_in_place(*args, "yes")


def test_merges_on_torch_cpu_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(23)
    vs, ss, ref_o, ref_l = segments(rng, 8, 3)
    v = torch.from_numpy(np.stack(vs, axis=1)).to(torch.bfloat16)
    s = torch.from_numpy(np.stack(ss, axis=1)).float()
    out, lse = fi.merge_states(v, s)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert_matches_oracle(out.float().numpy(), lse.numpy(), ref_o, ref_l, "bfloat16",
                          "torch merge_states")
    a, b = fi.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)


def test_merge_states_checks_shapes():
    with pytest.raises(InvalidArgumentError, match="v must be 4-D"):
        fi.merge_states(np.zeros((4, 8, 64), np.float32), np.zeros((4, 8), np.float32))
    with pytest.raises(InvalidArgumentError, match="s must have shape"):
        fi.merge_states(np.zeros((4, 2, 8, 64), np.float32), np.zeros((4, 8), np.float32))


# ---------------------------------------------------------------------------- page helpers
def model_batch_indices_positions(append_indptr, seq_lens):
    batch, pos = [], []
    for b in range(len(seq_lens)):
        for j in range(append_indptr[b], append_indptr[b + 1]):
            batch.append(b)
            pos.append(j + seq_lens[b] - append_indptr[b + 1])
    return batch, pos


def model_append(k, v, key, value, batch, pos, indices, indptr, page_size):
    """FlashInfer's AppendPagedKVCacheKernel, one row at a time."""
    for i in range(len(batch)):
        b, p = int(batch[i]), int(pos[i])
        page = indices[indptr[b] + p // page_size]
        k[page, p % page_size] = key[i]
        v[page, p % page_size] = value[i]


def test_get_batch_indices_positions_matches_the_model_and_flashinfers_example():
    ip = np.array([0, 1, 3, 6, 10], np.int32)
    b, p = fi.get_batch_indices_positions(ip, np.array([5, 5, 5, 5]), 10)
    mb, mp = model_batch_indices_positions(ip, [5, 5, 5, 5])
    assert b.dtype == np.int32 and p.dtype == np.int32
    assert b.tolist() == mb and p.tolist() == mp
    # FlashInfer's docstring example: the last row of each request is at seq_len - 1
    assert p.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]
    rng = np.random.default_rng(24)
    for _ in range(20):
        counts = rng.integers(0, 9, 6)
        ip = np.concatenate([[0], np.cumsum(counts)])
        sl = counts + rng.integers(0, 50, 6)
        b, p = fi.get_batch_indices_positions(ip, sl, int(ip[-1]))
        assert (b.tolist(), p.tolist()) == model_batch_indices_positions(ip, sl)


def test_get_batch_indices_positions_checks_nnz_and_lengths():
    with pytest.raises(InvalidArgumentError, match="end at nnz = 9"):
        fi.get_batch_indices_positions(np.array([0, 4, 10]), np.array([5, 8]), 9)
    with pytest.raises(InvalidArgumentError, match="seq_lens\\[1\\] = 5 is less than the 6"):
        fi.get_batch_indices_positions(np.array([0, 4, 10]), np.array([5, 5]), 10)


def test_index_helpers_refuse_what_int32_cannot_hold():
    """FlashInfer's index arrays are int32: past that, the int64 arithmetic wrapped
    (``get_seq_lens`` gave [1] and [-7]) and the int32 results were truncated (positions
    -2147483644); bools among listed ints were read as 0 / 1."""
    with pytest.raises(InvalidArgumentError, match=r"get_seq_lens: page_size must be an "
                                                   r"integer in \[1, 2147483647\]"):
        fi.get_seq_lens(np.array([0, 5]), np.array([1]), 2**62)
    with pytest.raises(InvalidArgumentError, match=r"get_seq_lens: kv_indptr\[1\] = "
                                                   r"4611686018427387904 is outside int32"):
        fi.get_seq_lens(np.array([0, 2**62]), np.array([1]), 8)
    with pytest.raises(InvalidArgumentError, match=r"seq_lens\[0\] = 2147483653 is outside"):
        fi.get_batch_indices_positions(np.array([0, 1, 2]), np.array([2**31 + 5, 6]), 2)
    with pytest.raises(InvalidArgumentError, match=r"nnz must be an integer in \[0, "
                                                   r"2147483647\]"):
        fi.get_batch_indices_positions(np.array([0, 1]), np.array([5]), 2**62)
    with pytest.raises(InvalidArgumentError, match=r"get_seq_lens: kv_last_page_len\[0\] "
                                                   r"must be an integer, got True"):
        fi.get_seq_lens([0, 1, 2], [True, 1], 4)
    b, p = fi.get_batch_indices_positions(np.array([0, 1, 2]), np.array([2**31 - 1, 6]), 2)
    assert p.tolist() == [2**31 - 2, 5]


def test_append_names_the_page_id_out_of_range():
    kc = np.zeros((8, 4, 2, 64), np.float16)
    ak = np.zeros((2, 2, 64), np.float16)
    with pytest.raises(InvalidArgumentError, match=r"kv_indices names page -1 for row 1, "
                                                   r"outside the cache's 8 pages"):
        fi.append_paged_kv_cache(ak, ak, np.array([0, 1]), np.array([9, 7]), (kc, kc.copy()),
                                 [0, 1, 2, 3, -1], [0, 3, 5], [2, 4])


def test_get_seq_lens_is_flashinfers_rule():
    ip, lpl = np.array([0, 3, 4, 4, 6]), np.array([5, 16, 1, 2])
    got = fi.get_seq_lens(ip, lpl, 16)
    assert got.tolist() == [2 * 16 + 5, 16, 1, 16 + 2]     # an empty request counts lpl


def append_problem(seed, page_size=8, hkv=4, d=128, dtype=np.float16):
    """A cache with some requests, then ragged new rows: the table grown to count them."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 40, 7)
    new = rng.integers(0, 12, 7)
    new[0] = max(new[0], 1)
    lens = old + new
    lens = np.maximum(lens, 1)
    new = np.minimum(new, lens)
    indptr, indices, lpl, n = fi_arrays(lens, page_size, rng, 5)
    cache = rng.standard_normal((n, 2, page_size, hkv, d)).astype(dtype)
    nnz = int(new.sum())
    key = rng.standard_normal((nnz, hkv, d)).astype(dtype)
    value = rng.standard_normal((nnz, hkv, d)).astype(dtype)
    append_indptr = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    return cache, key, value, append_indptr, lens, indptr, indices, lpl


@pytest.mark.parametrize("form", ["combined", "pair", "strided-pair", "torch"])
def test_append_matches_the_model(form):
    cache, key, value, aip, lens, indptr, indices, lpl = append_problem(25)
    want = cache.copy()
    batch, pos = fi.get_batch_indices_positions(aip, lens, int(aip[-1]))
    model_append(want[:, 0], want[:, 1], key, value, batch, pos, indices, indptr, 8)
    if form == "combined":
        target, got = cache, lambda: cache
        fi.append_paged_kv_cache(key, value, batch, pos, target, indices, indptr, lpl)
    elif form == "pair":
        k, v = np.ascontiguousarray(cache[:, 0]), np.ascontiguousarray(cache[:, 1])
        fi.append_paged_kv_cache(key, value, batch, pos, (k, v), indices, indptr, lpl)
        got = lambda: np.stack([k, v], axis=1)   # noqa: E731
    elif form == "strided-pair":
        fi.append_paged_kv_cache(key, value, batch, pos, (cache[:, 0], cache[:, 1]), indices,
                                 indptr, lpl)
        got = lambda: cache                      # noqa: E731
    else:
        torch = pytest.importorskip("torch")
        t = torch.from_numpy(cache.copy())
        fi.append_paged_kv_cache(*(torch.from_numpy(x) for x in (key, value, batch, pos)),
                                 t.unbind(1), *(torch.from_numpy(x) for x in (indices,
                                                                             indptr, lpl)))
        got = lambda: t.numpy()                  # noqa: E731
    np.testing.assert_array_equal(got(), want)
    assert not np.array_equal(want, append_problem(25)[0])    # the append wrote something


def test_append_then_decode_matches_the_oracle():
    """The two together, as an engine uses them: append the step's rows, then decode."""
    cache, key, value, aip, lens, indptr, indices, lpl = append_problem(26, page_size=16)
    batch, pos = fi.get_batch_indices_positions(aip, fi.get_seq_lens(indptr, lpl, 16),
                                                int(aip[-1]))
    fi.append_paged_kv_cache(key, value, batch, pos, cache, indices, indptr, lpl)
    q = np.random.default_rng(27).standard_normal((7, 8, 128)).astype(np.float16)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 20, np.uint8))
    w.plan(indptr, indices, lpl, 8, 4, 128, 16)
    out, lse = w.run(q, cache, return_lse=True)
    table = PageTable.build(indices, indptr, lpl, page_size=16)
    from paged_decode.reference import oracle_decode
    assert_matches_oracle(out, lse, *oracle_decode(q, cache[:, 0], cache[:, 1], table),
                          "float16", "append then decode")


def test_append_page_size_one_and_emulated_backend_arrays():
    cache, key, value, aip, lens, indptr, indices, lpl = append_problem(28, page_size=1)
    want = cache.copy()
    batch, pos = fi.get_batch_indices_positions(aip, lens, int(aip[-1]))
    model_append(want[:, 0], want[:, 1], key, value, batch, pos, indices, indptr, 1)
    fi.append_paged_kv_cache(key, value, batch, pos, cache[:, :, 0], indices, indptr, lpl,
                             backend="emulated-cuda")
    np.testing.assert_array_equal(cache, want)


def test_append_is_refused_inside_a_graph_capture(monkeypatch):
    """The append maps its index arrays on the host: inside a capture (here the emulated
    backend told it is capturing) it is refused by name, the cache untouched, rather than
    failing in the framework's device-to-host copy."""
    from paged_decode.backends import get_backend
    cache, key, value, aip, lens, indptr, indices, lpl = append_problem(30, page_size=1)
    before = cache.copy()
    batch, pos = fi.get_batch_indices_positions(aip, lens, int(aip[-1]))
    be = get_backend("emulated-cuda")
    monkeypatch.setattr(type(be), "capturing", lambda self: True)
    with pytest.raises(InvalidArgumentError, match=r"^append_paged_kv_cache: called inside "
                                                   r"a CUDA graph capture"):
        fi.append_paged_kv_cache(key, value, batch, pos, cache[:, :, 0], indices, indptr,
                                 lpl, backend=be)
    np.testing.assert_array_equal(cache, before)


def test_append_refuses_bad_input():
    cache, key, value, aip, lens, indptr, indices, lpl = append_problem(29)
    batch, pos = (np.asarray(x) for x in fi.get_batch_indices_positions(aip, lens,
                                                                        int(aip[-1])))
    before = cache.copy()
    dup = pos.copy()
    dup[1] = dup[0]
    b2 = batch.copy()
    b2[1] = b2[0]
    cases = [
        ((key, value, batch, pos + 100, cache), {}, "outside its"),
        ((key, value, batch, pos - 100, cache), {}, "outside its"),
        ((key, value, batch + 7, pos, cache), {}, "batch_indices must be in \\[0, 7\\)"),
        ((key, value, b2, dup, cache), {}, "two rows go to the same"),
        ((key.astype(np.float32), value, batch, pos, cache), {}, "append_key must have the "
                                                                 "cache's dtype"),
        ((key[:, :2], value, batch, pos, cache), {}, "append_key must have shape"),
        ((key, value, batch[:-1], pos, cache), {}, "batch_indices must have shape"),
        ((key, value, batch, pos, cache[:3]), {}, "outside the cache's 3 pages"),
    ]
    for args, kw, match in cases:
        with pytest.raises(InvalidArgumentError, match=match) as e:
            fi.append_paged_kv_cache(*args, indices, indptr, lpl, **kw)
        assert str(e.value).startswith("append_paged_kv_cache: ")
    with pytest.raises(UnsupportedProblemError, match="kv_layout='HND'"):
        fi.append_paged_kv_cache(key, value, batch, pos, cache, indices, indptr, lpl, "HND")
    np.testing.assert_array_equal(cache, before)     # nothing written by a refused call


@pytest.mark.parametrize("backend", ["reference", "mlx"])
def test_append_refuses_float64_rows_on_every_backend(backend):
    # MLX holds a float64 array as float32: the check judges the caller's dtype, so MLX
    # refuses float64 rows as the reference backend does instead of writing them rounded
    if not availability(backend).ok:
        pytest.skip(f"{backend} unavailable: {availability(backend).reason}")
    cache, key, value, aip, lens, indptr, indices, lpl = append_problem(31, dtype=np.float32)
    batch, pos = (np.asarray(x) for x in fi.get_batch_indices_positions(aip, lens,
                                                                        int(aip[-1])))
    be = get_backend(backend)
    with pytest.raises(InvalidDtypeError, match=r"^append_paged_kv_cache: append_key must "
                                                r"have dtype in .*, got float64"):
        fi.append_paged_kv_cache(key.astype(np.float64), value, batch, pos,
                                 be.asarray(cache), indices, indptr, lpl, backend=backend)


def test_import_pulls_in_neither_torch_nor_flashinfer():
    assert_import_adds_none_of("paged_decode.compat.flashinfer", {"torch", "flashinfer", "cupy"})
