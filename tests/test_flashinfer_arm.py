"""The external benchmark arms (FlashInfer batch decode, contiguous SDPA): what runs
without a GPU is the validation that decides when an arm must refuse a case, and the
promise that importing the module pulls in neither torch nor FlashInfer. The arms
themselves run on the GPU machine (``bench/device/flashinfer_setup.sh`` smoke test, and
the GPU test at the end, skipped elsewhere)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from helpers import assert_import_adds_none_of, relabel, table_of

from paged_decode.bench import flashinfer_arm as fa
from paged_decode.bench import sdpa_arm as sa


def _arrays(table, hq=8, hkv=2, d=16):
    n = (table.num_pages or table.total_pages)
    q = np.zeros((table.batch_size, hq, d), np.float16)
    k = np.zeros((n, table.page_size, hkv, d), np.float16)
    return q, k, k.copy()


# ---------------------------------------------------------------------------- import
def test_import_pulls_in_neither_torch_nor_flashinfer():
    assert_import_adds_none_of("paged_decode.bench.flashinfer_arm", {"torch", "flashinfer"})


def test_available_reports_a_reason_without_a_gpu():
    ok, why = fa.available()
    if ok:
        pytest.skip(f"FlashInfer is usable here ({why}): the GPU test covers it")
    assert isinstance(why, str) and why
    if importlib.util.find_spec("torch") is None:
        assert "torch" in why


# ---------------------------------------------------------------------------- validation
def test_first_page_offset_is_refused():
    table = table_of(lengths=[40, 40, 40], fpo=[0, 5, 0], spare_pages=2)
    with pytest.raises(ValueError, match="first-page offset.*request 1.*5"):
        fa.check_table_for_flashinfer(table)
    fa.check_table_for_flashinfer(table_of(lengths=[40, 17, 1], spare_pages=2))  # zero offsets pass


def test_make_flashinfer_decode_refuses_offsets_before_importing_anything():
    table = table_of(lengths=[33, 33], fpo=[3, 0], spare_pages=2)
    q, k, v = _arrays(table)
    with pytest.raises(ValueError, match="first-page offset"):
        fa.make_flashinfer_decode(q, k, v, table, sm_scale=0.25, use_tensor_cores=True)


def test_empty_requests_are_refused():
    with pytest.raises(ValueError, match="request 1 has none"):
        fa.check_table_for_flashinfer(table_of(lengths=[5, 0, 7], spare_pages=2))
    with pytest.raises(ValueError, match="at least one request"):
        fa.check_table_for_flashinfer(table_of(lengths=[], spare_pages=2))


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_cuda_core_group_sizes_accepted(group):
    fa.check_group_size(8 * group, 8, use_tensor_cores=False, version="0.3.1")


@pytest.mark.parametrize("group", [5, 6, 7, 16])
def test_cuda_core_group_sizes_refused(group):
    with pytest.raises(ValueError, match=f"not {group}"):
        fa.check_group_size(4 * group, 4, use_tensor_cores=False, version="0.3.1")
    fa.check_group_size(4 * group, 4, use_tensor_cores=True, version="0.3.1")
    fa.check_group_size(4 * group, 4, use_tensor_cores=False, version="0.4.0")


def test_neither_arm_is_run_at_head_dim_96_on_0_3():
    # S10-R4: an illegal address at 32/32 x 96 ends the bench process's CUDA context
    with pytest.raises(ValueError, match="illegal memory access at head_dim 96"):
        fa.check_head_dim(96, use_tensor_cores=True, version="0.3.1")
    # S22-R4 / S32-R4: the CUDA-core decode failed the oracle where its merge let it run
    with pytest.raises(ValueError, match="CUDA-core decode fails the oracle at head_dim 96"):
        fa.check_head_dim(96, use_tensor_cores=False, version="0.3.1")
    for d in (64, 128, 256):
        fa.check_head_dim(d, use_tensor_cores=True, version="0.3.1")
        fa.check_head_dim(d, use_tensor_cores=False, version="0.3.1")
    fa.check_head_dim(96, use_tensor_cores=True, version="0.4.0")
    fa.check_head_dim(96, use_tensor_cores=False, version="0.4.0")


def test_dtypes():
    fa.check_dtypes("float16", "float16")
    fa.check_dtypes(np.dtype("float16"), "float8_e4m3fn")
    fa.check_dtypes("torch.bfloat16", "torch.bfloat16")
    with pytest.raises(ValueError, match="no float32 kernels"):
        fa.check_dtypes("float32", "float32")
    table = table_of(lengths=[9], spare_pages=2)
    q, k, v = _arrays(table)
    with pytest.raises(ValueError, match="no float32 kernels"):
        fa.make_flashinfer_decode(q.astype(np.float32), k.astype(np.float32),
                                  v.astype(np.float32), table, sm_scale=1.0,
                                  use_tensor_cores=False)


def test_version_tuple():
    assert fa._version_tuple("0.3.1") == (0, 3, 1)
    assert fa._version_tuple("0.3.1.post1") == (0, 3, 1)
    assert fa._version_tuple("0.4.0rc1+cu130") == (0, 4, 0)
    assert fa._version_tuple("0.0.0+unknown") == (0, 0, 0)


def test_check_shapes():
    table = table_of(lengths=[20, 9], page_size=8, spare_pages=2)
    q, k, v = _arrays(table, hq=8, hkv=2, d=16)
    assert sa.check_shapes(q.shape, k.shape, v.shape, table) == (2, 8, 2, 16, 8)
    n = k.shape[0]
    bad = [
        ((2, 8), k.shape, v.shape, "q must be"),
        (q.shape, k.shape, (n, 8, 2, 32), "k_pages and v_pages"),
        ((2, 8, 32), k.shape, v.shape, "head_dim"),
        ((2, 6, 16), (n, 8, 4, 16), (n, 8, 4, 16), "multiple"),
        ((3, 8, 16), k.shape, v.shape, "batch 3"),
        (q.shape, (n, 16, 2, 16), (n, 16, 2, 16), "page size 16"),
        (q.shape, (3, 8, 2, 16), (3, 8, 2, 16), "references page"),
    ]
    for qs, ks, vs, msg in bad:
        with pytest.raises(ValueError, match=msg):
            sa.check_shapes(qs, ks, vs, table)


def test_contiguous_sdpa_needs_equal_lengths():
    assert sa.equal_visible_length(table_of(lengths=[30, 30, 30], spare_pages=2)) == 30
    assert sa.equal_visible_length(table_of(lengths=[30, 30], fpo=[0, 9], spare_pages=2)) == 30
    with pytest.raises(ValueError, match="equal request lengths"):
        sa.equal_visible_length(table_of(lengths=[30, 31], spare_pages=2))
    with pytest.raises(ValueError, match=">= 1 visible"):
        sa.equal_visible_length(table_of(lengths=[0, 0], spare_pages=2))
    table = table_of(lengths=[12, 40], spare_pages=2)
    q, k, v = _arrays(table)
    with pytest.raises(ValueError, match="equal request lengths"):
        sa.make_contiguous_sdpa(q, k, v, table, sm_scale=0.25)


# ---------------------------------------------------------------------------- with torch
def test_contiguous_sdpa_on_cpu_matches_a_numpy_oracle():
    torch = pytest.importorskip("torch", reason="torch is not installed (the arm's own "
                                "gather and SDPA call are checked here when it is)")
    rng = np.random.default_rng(3)
    hq, hkv, d, p, length = 12, 4, 32, 8, 21
    fpo = [0, 3, 7]
    table = table_of(lengths=[length] * 3, page_size=p, fpo=fpo, spare_pages=3)
    table = relabel(table, rng.permutation(table.num_pages)[: table.total_pages],
                    num_pages=table.num_pages)
    q = torch.from_numpy(rng.standard_normal((3, hq, d)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((table.num_pages, p, hkv, d)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((table.num_pages, p, hkv, d)).astype(np.float32))
    call, out, desc = sa.make_contiguous_sdpa(q, k, v, table, sm_scale=0.3)
    assert "SDPA" in desc and f"[3, {hkv}, {length}, {d}]" in desc
    got = call().numpy()
    np.testing.assert_allclose(out.numpy(), got)
    g = hq // hkv
    for r in range(3):
        pos = [fpo[r] + t for t in range(length)]
        pages = table.request_pages(r)
        kk = np.stack([k.numpy()[pages[i // p], i % p] for i in pos])      # [L, Hkv, D]
        vv = np.stack([v.numpy()[pages[i // p], i % p] for i in pos])
        for h in range(hq):
            s = kk[:, h // g] @ q.numpy()[r, h] * 0.3
            w = np.exp(s - s.max())
            np.testing.assert_allclose(got[r, h], (w / w.sum()) @ vv[:, h // g],
                                       rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_flashinfer_smoke_on_gpu():
    ok, why = fa.available()
    if not ok:
        pytest.skip(f"FlashInfer arm unavailable: {why}")
    assert fa.smoke("float16") == 0


# ---------------------------------------------------------------------------- the XQA arm
def test_xqa_arm_import_pulls_in_neither_torch_nor_flashinfer():
    assert_import_adds_none_of("paged_decode.bench.flashinfer_xqa_arm", {"torch", "flashinfer"})


def test_xqa_tables_pad_each_request_with_zeros():
    from paged_decode.bench.flashinfer_xqa_arm import xqa_tables
    t = table_of([[5, 2, 9], [7], [3, 4]], lpl=[10, 16, 1], num_pages=12)
    block, seq = xqa_tables(t)
    assert block.dtype == np.int32 and seq.dtype == np.uint32
    np.testing.assert_array_equal(block, [[5, 2, 9], [7, 0, 0], [3, 4, 0]])
    np.testing.assert_array_equal(seq, [2 * 16 + 10, 16, 16 + 1])


@pytest.mark.parametrize("d, p, cap, pattern", [
    (128, 8, None, r"page sizes \[16, 32, 64, 128\], not 8"),
    (128, 256, None, r"not 256"),
    (72, 16, None, r"head_dim a multiple of 16 in \[16, 512\], not 72"),
    (128, 16, 30.0, r"no logits soft cap")])
def test_xqa_refusals(d, p, cap, pattern):
    from paged_decode.bench.flashinfer_xqa_arm import check_xqa_problem
    with pytest.raises(ValueError, match=pattern):
        check_xqa_problem(d, p, logits_soft_cap=cap)
    check_xqa_problem(128, 16)
    check_xqa_problem(256, 128)


def test_make_flashinfer_xqa_refuses_offsets_and_page_sizes_before_importing_anything():
    from paged_decode.bench.flashinfer_xqa_arm import make_flashinfer_xqa
    table = table_of(lengths=[33, 33], fpo=[3, 0], spare_pages=2)
    q, k, v = _arrays(table)
    with pytest.raises(ValueError, match="first-page offset"):
        make_flashinfer_xqa(q, k, v, table, sm_scale=0.25)
    table = table_of(lengths=[33, 20], page_size=8, spare_pages=2)
    q, k, v = _arrays(table)
    with pytest.raises(ValueError, match="not 8"):
        make_flashinfer_xqa(q, k, v, table, sm_scale=0.25)


@pytest.mark.parametrize("window", [0, 3, 15, 16, 17, 40, 1000])
def test_window_pages_keep_every_window_token_and_drop_whole_pages_before_it(window):
    """FlashInfer's window arm plans on the pages holding the window (as an engine does):
    the windowed attention over them equals the windowed attention over the whole table,
    and no page before the window's first is kept."""
    from paged_decode.bench.flashinfer_arm import window_pages
    from paged_decode.reference import oracle_decode
    rng = np.random.default_rng(window)
    lens = np.array([1, 16, 17, 100, 63])
    table = table_of(lengths=lens, page_size=16)
    got = window_pages(table, window)
    first = np.maximum(lens - (window + 1), 0) // 16
    assert got.pages_per_request.tolist() == (table.pages_per_request - first).tolist()
    n = int(table.indices.max()) + 1
    k, v = (rng.standard_normal((n, 16, 2, 64)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((5, 4, 64)).astype(np.float32)
    a = oracle_decode(q, k, v, table, window_left=window)
    b = oracle_decode(q, k, v, got, window_left=window)
    np.testing.assert_allclose(b[0], a[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b[1], a[1], rtol=1e-12, atol=1e-12)
    assert window_pages(table, -1) is table
