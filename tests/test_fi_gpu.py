"""The FlashInfer shim side by side with real FlashInfer 0.3.1 on a GPU (skipped cleanly
elsewhere): the same calls through ``flashinfer`` and through
``paged_decode.compat.flashinfer`` on the same torch CUDA tensors, over the full product of
FlashInfer's own decode-test geometries (``fi_cases.GPU_CASES``: batch 12/17/128, kv_len
54..16384, page 1/8/16, Hq 4/32 over Hkv 4, head_dim 128/256, float16), both cache forms,
and graph mode (capture, re-plan with longer requests, replay) against FlashInfer's own
graph mode. Run on the H200 with ``bench/device/run.sh fi fi-compat``.

Tolerances: each output is within the float16 oracle bound of the truth (``OUT_RTOL``),
so the two within twice that of each other; the LSE bound (``FI_LSE_ATOL``) is a
first guess, not yet measured on the H200 (``-v`` prints the worst gaps seen).
"""

from __future__ import annotations

import numpy as np
import pytest
from fi_cases import GPU_CASES, FiCase, fi_arrays, lengths_of
from helpers import WORST, assert_matches_oracle, out_tol

from paged_decode import PageTable
from paged_decode.backends import availability
from paged_decode.bench import flashinfer_arm
from paged_decode.reference import max_rel_error, oracle_decode

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]

#: max |LSE_shim - LSE_flashinfer| (both float32 base 2); not yet measured on the H200
FI_LSE_ATOL = 1e-3
#: the oracle (float64 on the host) is also checked where the batch is this small in tokens
ORACLE_TOKENS = 1 << 16


@pytest.fixture(scope="module")
def libs():
    ok, why = flashinfer_arm.available()
    if not ok:
        pytest.skip(f"FlashInfer unavailable: {why}")
    import flashinfer
    import torch

    import paged_decode.compat.flashinfer as shim
    return torch, flashinfer, shim


def on_gpu(torch, case, seed=0):
    """FlashInfer's arrays for ``case`` on the GPU: the CSR arrays (host-made, shuffled
    pages) and uniform q / cache made on the device (batch 128 x 16K x d256 is 4 GB)."""
    rng = np.random.default_rng(seed)
    lens = lengths_of(case, rng)
    indptr, indices, lpl, n = fi_arrays(lens, case.page_size, rng, case.spare_pages)
    g = torch.Generator(device="cuda").manual_seed(seed)

    def uniform(*shape):
        return ((torch.rand(*shape, generator=g, device="cuda") - 0.5) * 4).half()

    t = {k: torch.from_numpy(x).cuda() for k, x in
         (("indptr", indptr), ("indices", indices), ("last_page_len", lpl))}
    t["q"] = uniform(case.batch, case.num_qo_heads, case.head_dim)
    t["cache"] = uniform(n, 2, case.page_size, case.num_kv_heads, case.head_dim)
    t["table"] = PageTable.build(indices, indptr, lpl, page_size=case.page_size)
    return t


def oracle(t):
    cache = t["cache"].cpu().numpy()
    return oracle_decode(t["q"].cpu().numpy(), cache[:, 0], cache[:, 1], t["table"])


def gap(name, got, want):
    g = max_rel_error(got.float().cpu().numpy(), want.float().cpu().numpy().astype(np.float64))
    WORST[f"fi-gap {name}"] = max(WORST.get(f"fi-gap {name}", 0.0), g)
    return g


def lse_gap(got, want):
    a, b = got.cpu().numpy().astype(np.float64), want.cpu().numpy().astype(np.float64)
    g = float(np.abs(a - b).max())
    WORST["fi-gap lse"] = max(WORST.get("fi-gap lse", 0.0), g)
    return g


def plan_both(torch, lib, ws_bytes, t, case, **ctor):
    w = lib.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(ws_bytes, dtype=torch.uint8, device="cuda"), "NHD", **ctor)
    w.plan(t["indptr"], t["indices"], t["last_page_len"], case.num_qo_heads,
           case.num_kv_heads, case.head_dim, case.page_size, q_data_type=torch.float16)
    return w


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_shim_matches_flashinfer_on_its_decode_geometries(libs, case):
    torch, flashinfer, shim = libs
    t = on_gpu(torch, case)
    ref = plan_both(torch, flashinfer, 128 << 20, t, case)
    ours = plan_both(torch, shim, 128 << 20, t, case)
    fo, fl = ref.run(t["q"], t["cache"], return_lse=True)
    k, v = (x.contiguous() for x in t["cache"].unbind(1))
    want = oracle(t) if case.batch * case.kv_len <= ORACLE_TOKENS else None
    for form, cache in (("combined", t["cache"]), ("pair", (k, v))):
        so, sl = ours.run(t["q"], cache, return_lse=True)
        assert isinstance(so, torch.Tensor) and so.is_cuda and so.dtype == torch.float16
        assert gap("out", so, fo) <= 2 * out_tol("float16"), f"{case.id} {form}"
        assert lse_gap(sl, fl) <= FI_LSE_ATOL, f"{case.id} {form}"
        if want is not None:    # both cache forms against the float64 oracle
            assert_matches_oracle(so.cpu().numpy(), sl.cpu().numpy(), *want, "float16",
                                  f"{case.id} {form}")
    out = torch.full_like(t["q"], float("nan"))
    assert ours.run(t["q"], t["cache"], out=out) is out
    assert gap("out", out, fo) <= 2 * out_tol("float16")


@pytest.mark.parametrize("window, cap", [(0, None), (37, None), (-1, 30.0), (255, 5.0)],
                         ids=["w0", "w37", "cap30", "w255-cap5"])
@pytest.mark.parametrize("case", GPU_CASES[:6], ids=lambda c: c.id)
def test_shim_variants_match_flashinfer(libs, case, window, cap):
    """window_left and logits_soft_cap through the shim (paged-decode's variants) against
    FlashInfer's own, on the same tensors, and against the float64 oracle."""
    torch, flashinfer, shim = libs
    t = on_gpu(torch, case)
    outs = []
    for lib in (flashinfer, shim):
        w = lib.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(128 << 20, dtype=torch.uint8, device="cuda"), "NHD")
        w.plan(t["indptr"], t["indices"], t["last_page_len"], case.num_qo_heads,
               case.num_kv_heads, case.head_dim, case.page_size, window_left=window,
               logits_soft_cap=cap, q_data_type=torch.float16)
        outs.append(w.run(t["q"], t["cache"], return_lse=True))
    (fo, fl), (so, sl) = outs
    assert gap("variants out", so, fo) <= 2 * out_tol("float16"), case.id
    assert lse_gap(sl, fl) <= FI_LSE_ATOL, case.id
    if case.batch * case.kv_len <= ORACLE_TOKENS:
        cache = t["cache"].cpu().numpy()
        ref = oracle_decode(t["q"].cpu().numpy(), cache[:, 0], cache[:, 1], t["table"],
                            window_left=window, logits_soft_cap=cap)
        assert_matches_oracle(so.cpu().numpy(), sl.cpu().numpy(), *ref, "float16", case.id)


def grown_tables(torch, t, case, extra, seed):
    """The same batch ``extra`` tokens longer per request, over other pages of the cache."""
    lens = t["table"].visible_lens.astype(np.int64) + extra
    rng = np.random.default_rng(seed)
    indptr, _, lpl, n = fi_arrays(lens, case.page_size, rng, 0)
    assert n <= t["cache"].shape[0]
    indices = rng.permutation(t["cache"].shape[0])[:n].astype(np.int32)
    return {k: torch.from_numpy(x).cuda() for k, x in
            (("indptr", indptr), ("indices", indices), ("last_page_len", lpl))}


def graph_pair(torch, lib, case, batch, max_pages):
    bufs = (torch.zeros(batch + 1, dtype=torch.int32, device="cuda"),
            torch.zeros(max_pages, dtype=torch.int32, device="cuda"),
            torch.zeros(batch, dtype=torch.int32, device="cuda"))
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    return lib.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2])


def replan(torch, w, t, case):
    w.plan(t["indptr"], t["indices"], t["last_page_len"], case.num_qo_heads,
           case.num_kv_heads, case.head_dim, case.page_size, q_data_type=torch.float16)


def capture(torch, run):
    """A torch CUDA graph of ``run`` (warmed up on a side stream first, as torch asks)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    return g


@pytest.mark.parametrize("case", [FiCase(12, 512, 16, 32, 4, 128, ragged=True, spare_pages=600),
                                  FiCase(17, 97, 1, 4, 4, 128, spare_pages=2000),
                                  FiCase(128, 54, 8, 32, 4, 128, spare_pages=2000)],
                         ids=lambda c: c.id)
def test_graph_replay_after_a_new_plan_matches_flashinfers(libs, case):
    torch, flashinfer, shim = libs
    t = on_gpu(torch, case, seed=2)
    n = t["cache"].shape[0]
    outs = {}
    for name, lib in (("fi", flashinfer), ("shim", shim)):
        w = graph_pair(torch, lib, case, case.batch, n)
        replan(torch, w, t, case)
        out = torch.empty_like(t["q"])
        lse = torch.empty(t["q"].shape[:2], dtype=torch.float32, device="cuda")
        g = capture(torch, lambda w=w, out=out, lse=lse: w.run(t["q"], t["cache"], out=out,
                                                                lse=lse, return_lse=True))
        g.replay()
        torch.cuda.synchronize()
        first = (out.clone(), lse.clone())
        replan(torch, w, grown_tables(torch, t, case, 3 * case.page_size + 5, seed=3), case)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        outs[name] = (first, (out.clone(), lse.clone()))
    for step in (0, 1):
        (so, sl), (fo, fl) = outs["shim"][step], outs["fi"][step]
        assert gap("graph out", so, fo) <= 2 * out_tol("float16"), f"step {step}"
        assert lse_gap(sl, fl) <= FI_LSE_ATOL, f"step {step}"
    # the replay after the new plan is not the first one's answer (it read the new table)
    assert gap("graph out", outs["shim"][1][0], outs["shim"][0][0]) > 10 * out_tol("float16")


def test_merges_and_append_match_flashinfer(libs):
    torch, flashinfer, shim = libs
    g = torch.Generator(device="cuda").manual_seed(0)
    va, vb = (torch.randn(64, 32, 128, device="cuda", generator=g).half() for _ in range(2))
    sa, sb = (torch.randn(64, 32, device="cuda", generator=g) * 4 for _ in range(2))
    for a, b in zip(flashinfer.merge_state(va, sa, vb, sb), shim.merge_state(va, sa, vb, sb)):
        assert gap("merge_state", b, a) <= 2 * out_tol("float16")
    v = torch.randn(64, 5, 32, 128, device="cuda", generator=g).half()
    s = torch.randn(64, 5, 32, device="cuda", generator=g) * 4
    for a, b in zip(flashinfer.merge_states(v, s), shim.merge_states(v, s)):
        assert gap("merge_states", b, a) <= 2 * out_tol("float16")
    # append: the same ragged rows through both into two copies of one cache
    case = FiCase(7, 60, 16, 4, 4, 128, ragged=True)
    t = on_gpu(torch, case, seed=4)
    seq = flashinfer.get_seq_lens(t["indptr"], t["last_page_len"], 16)
    new = torch.minimum(seq, torch.full_like(seq, 9))
    aip = torch.cat([torch.zeros(1, dtype=torch.int32, device="cuda"),
                     torch.cumsum(new, 0).int()])
    nnz = int(aip[-1])
    key = torch.randn(nnz, 4, 128, device="cuda", generator=g).half()
    val = torch.randn(nnz, 4, 128, device="cuda", generator=g).half()
    bi, pos = shim.get_batch_indices_positions(aip, seq, nnz)
    try:   # FlashInfer's runs a Triton kernel: compared where Triton is importable
        fbi, fpos = flashinfer.get_batch_indices_positions(aip, seq, nnz)
    except ImportError:
        fbi, fpos = bi, pos
    assert torch.equal(bi, fbi) and torch.equal(pos, fpos)
    caches = [t["cache"].clone(), t["cache"].clone()]
    for lib, c in zip((flashinfer, shim), caches):
        lib.append_paged_kv_cache(key, val, bi, pos, c, t["indices"], t["indptr"],
                                  t["last_page_len"])
    assert torch.equal(caches[0], caches[1]) and not torch.equal(caches[0], t["cache"])


def test_masked_in_place_merge_matches_flashinfer(libs):
    """A bool mask (FlashInfer's documented type), read on the device by both."""
    torch, flashinfer, shim = libs
    g = torch.Generator(device="cuda").manual_seed(1)
    va, vb = (torch.randn(64, 8, 128, device="cuda", generator=g).half() for _ in range(2))
    sa, sb = (torch.randn(64, 8, device="cuda", generator=g) * 4 for _ in range(2))
    mask = torch.rand(64, device="cuda", generator=g) < 0.5
    pairs = [(va.clone(), sa.clone()) for _ in range(2)]
    for lib, (v, s) in zip((flashinfer, shim), pairs):
        lib.merge_state_in_place(v, s, vb, sb, mask)
    assert gap("merge_state_in_place", pairs[1][0], pairs[0][0]) <= 2 * out_tol("float16")
    assert lse_gap(pairs[1][1], pairs[0][1]) <= FI_LSE_ATOL
    keep = ~mask
    assert torch.equal(pairs[1][0][keep], va[keep]) and torch.equal(pairs[1][1][keep], sa[keep])


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_requests_without_pages_match_flashinfer(libs, graph):
    """Page-less rows (CUDA-graph padding): FlashInfer's length 0 whatever last_page_len."""
    torch, flashinfer, shim = libs
    case = FiCase(9, 700, 16, 32, 8, 128, ragged=True, spare_pages=8)
    t = on_gpu(torch, case, seed=5)
    pages = torch.diff(t["indptr"]).cpu().numpy()
    pages[[2, 5, 8]] = 0
    indptr = torch.from_numpy(np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)).cuda()
    indices = t["indices"][: int(pages.sum())].contiguous()
    lpl = t["last_page_len"].clone()
    lpl[5] = 0
    outs = []
    for lib in (flashinfer, shim):
        ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
        if graph:
            bufs = (torch.zeros(10, dtype=torch.int32, device="cuda"),
                    torch.zeros(indices.numel(), dtype=torch.int32, device="cuda"),
                    torch.zeros(9, dtype=torch.int32, device="cuda"))
            w = lib.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True,
                                                       paged_kv_indptr_buffer=bufs[0],
                                                       paged_kv_indices_buffer=bufs[1],
                                                       paged_kv_last_page_len_buffer=bufs[2])
        else:
            w = lib.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indices, lpl, 32, 8, 128, 16, q_data_type=torch.float16)
        outs.append(w.run(t["q"], t["cache"], return_lse=True))
    (fo, fl), (so, sl) = outs
    live = torch.from_numpy(pages > 0).cuda()
    assert gap("out", so[live], fo[live]) <= 2 * out_tol("float16")
    assert lse_gap(sl[live], fl[live]) <= FI_LSE_ATOL
    assert (so[~live] == 0).all() and torch.isneginf(sl[~live]).all()


@pytest.mark.parametrize("fmt", ["float8_e4m3fn"])   # what the bench's fp8 arm ran (S19-R4)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", [FiCase(17, 2048, 16, 32, 4, 128, ragged=True),
                                  FiCase(12, 512, 1, 4, 4, 128)], ids=lambda c: c.id)
def test_shim_fp8_caches_and_scales_match_flashinfer(libs, case, fmt, graph):
    """An fp8 cache (FlashInfer's kv_data_type) with run's q_scale / k_scale / v_scale
    through both, on the same torch fp8 tensors, against each other and the float64 oracle
    on the dequantized values; the shim in eager and graph mode (FlashInfer eager)."""
    torch, flashinfer, shim = libs
    from helpers import fp8_out_tol
    t = on_gpu(torch, case, seed=3)
    dt = getattr(torch, fmt)
    ks, vs, qs = 0.4, 2.0, 1.25
    cache = (t["cache"].float() / torch.tensor([ks, vs], device="cuda").view(1, 2, 1, 1, 1)
             ).to(dt)

    def planned(lib, **ctor):   # tensor cores: FlashInfer's fp8 arm in the bench
        w = lib.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(128 << 20, dtype=torch.uint8, device="cuda"), "NHD",
            use_tensor_cores=True, **ctor)
        w.plan(t["indptr"], t["indices"], t["last_page_len"], case.num_qo_heads,
               case.num_kv_heads, case.head_dim, case.page_size, q_data_type=torch.float16,
               kv_data_type=dt)
        return w
    fo, fl = planned(flashinfer).run(t["q"], cache, q_scale=qs, k_scale=ks, v_scale=vs,
                                     return_lse=True)
    ctor = {}
    if graph:
        ctor = dict(use_cuda_graph=True, paged_kv_indptr_buffer=t["indptr"].clone(),
                    paged_kv_indices_buffer=t["indices"].clone(),
                    paged_kv_last_page_len_buffer=t["last_page_len"].clone())
    so, sl = planned(shim, **ctor).run(t["q"], cache, q_scale=qs, k_scale=ks, v_scale=vs,
                                       return_lse=True)
    tol = fp8_out_tol("float16")
    assert gap("fp8 out", so, fo) <= 2 * tol, case.id
    assert lse_gap(sl, fl) <= FI_LSE_ATOL, case.id
    codes = cache.view(torch.uint8).cpu().numpy()
    from paged_decode.dtypes import numpy_dtype
    codes = codes.view(numpy_dtype(fmt))
    ref_o, ref_l = oracle_decode(t["q"].cpu().numpy(), codes[:, 0], codes[:, 1], t["table"],
                                 qs / np.sqrt(case.head_dim), kv_dtype=fmt, k_scale=ks,
                                 v_scale=vs)
    assert_matches_oracle(so.cpu().numpy(), sl.cpu().numpy(), ref_o, ref_l, "float16",
                          case.id, tol=tol)
