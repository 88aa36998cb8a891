"""Emulated-kernel coverage that the other modules leave out, each case against the
float64 oracle with NaN-poisoned ``out`` / ``lse`` buffers and the project's tolerances
(``helpers.py``):

- ``PAGED_DECODE_TC_WARPS`` 2 and 8 on the CUDA tensor-core partial (float16 and e4m3fn
  pools): the launched specialization carries the warps; a bad value is refused by name;
- ``PAGED_DECODE_STAGES`` 3 and 4 on v2 (split) and v1 at head_dim 128;
- fp8 pools (both formats) on v2 and v1 at head_dim 96 / 128 / 256, GQA 8, page sizes
  other than 16, and float32 queries over an fp8 pool, on both dialects;
- window + soft cap + sinks on v2 at GQA 16 (two q-groups of 8 heads: the ``q_groups``
  term of the sink index in ``kernels/decode_v2.py``), both dialects;
- v2 and v1 at page sizes 7 and 256, v1 at head_dim 96, both dialects;
- mixed query / pool dtypes on v2 (one chunk and split) and v1;
- the append kernel moving 4-byte words (float32 rows of 12 bytes);
- the table-update kernel on a row of more than 128 pages (its strided loop), both
  dialects.

Everything runs on the CPU emulator (``emulated-cuda``, ``emulated-metal``); nothing here
ran on a GPU or Apple hardware.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_matches_oracle,
    fp8_out_tol,
    needs_backend,
    sinks_for,
    tc_fp8_out_tol,
    tc_out_tol,
)
from test_append_batch import check, make, random_ops
from test_step_table import assert_matches_pool

import paged_decode as pd
from paged_decode.dtypes import numpy_dtype
from paged_decode.errors import InvalidArgumentError
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode
from paged_decode.specs import (
    STAGES_ENV,
    TC_WARPS_ENV,
    v1_spec,
    v2_spec,
    v2tc_ctas_per_chunk,
    v2tc_spec,
)

pytestmark = needs_backend("emulated-cuda")

DIALECTS = ["emulated-cuda", "emulated-metal"]
ONE = 10 ** 6                  # pages per chunk: one chunk per request (no merge)
E4, E5, F16, BF16, F32 = "float8_e4m3fn", "float8_e5m2", "float16", "bfloat16", "float32"
K_SCALE, V_SCALE = 0.37, 2.5   # != 1: a scale left out fails the oracle


# ---------------------------------------------------------------------------- helpers
def launched(monkeypatch, be) -> list:
    """The ``Launch``es ``be`` runs from now on (recorded, then run as before)."""
    seen, real = [], be._run

    def spy(lc):
        seen.append(lc)
        real(lc)
    monkeypatch.setattr(be, "_run", spy)
    return seen


def decode_checked(be, pr, path: str, ppc: int | None, *, out_dtype: str = F32,
                   tol: float | None = None, variant: dict | None = None,
                   scaled: bool = False, what: str = "") -> None:
    """Decode ``pr`` on ``path`` under ``pages_per_chunk=ppc`` into NaN-filled ``out`` and
    ``lse`` and compare with the float64 oracle (``variant``: window / cap / sinks;
    ``scaled``: fp8 pools read with ``K_SCALE`` / ``V_SCALE``). The outcome must be the
    path asked for, merged exactly when the plan splits a request (a forced
    ``pages_per_chunk`` other than ``ONE`` must split one)."""
    kw = dict(variant or {})
    scales = {"k_scale": K_SCALE, "v_scale": V_SCALE} if scaled else {}
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, **kw, **scales)
    b, hq, d = pr.q.shape
    hkv = pr.k_pages.shape[2]
    ctas = v2tc_ctas_per_chunk(hq, hkv) if path == "v2tc" else None
    plan = pd.plan_decode(pr.table, hq, hkv, d, device=be.device_info(), pages_per_chunk=ppc,
                          window_left=kw.get("window_left", -1), ctas_per_chunk=ctas)
    if path in ("v2", "v2tc") and ppc is not None and ppc != ONE:
        assert plan.needs_merge, "a forced split must exercise the merge"
    if kw.get("sinks") is not None:
        kw["sinks"] = be.asarray(kw["sinks"])
    out = be.asarray(np.full((b, hq, d), np.nan, numpy_dtype(out_dtype)))
    lse = be.asarray(np.full((b, hq), np.nan, np.float32))
    got, got_lse = pd.decode(be.asarray(pr.q), be.asarray(pr.k_pages), be.asarray(pr.v_pages),
                             pr.table, plan, path=path, out=out, lse=lse, return_lse=True,
                             out_dtype=out_dtype, backend=be, **kw, **scales)
    assert got is out and got_lse is lse, "decode must write the caller's buffers"
    o = pd.last_outcome()
    want = path + ("+merge" if path in ("v2", "v2tc") and plan.needs_merge else "")
    assert o.path == want, o
    if scaled:
        assert f"kv {pr.k_pages.dtype.name}" in o.detail, o
    assert_matches_oracle(be.to_numpy(got), be.to_numpy(got_lse), ref, ref_lse, out_dtype,
                          f"{be.name} {pr.spec.label} {path} ppc={ppc} {out_dtype} {what}",
                          tol=tol)


# ---------------------------------------------------------------------------- 1. TC warps
TC_WARP_CASES = [
    # one chunk of ~330 tokens: 3 stages of 128 tokens at 8 warps, 11 of 32 at 2
    ("d64-g4-f16", ProblemSpec(2, 330, 8, 2, 64, 16, seed=201), [None, ONE]),
    # an fp8 ring (bytes) beside each warp's 16-bit scratch tile, pages of 8; chunks of
    # 16 tokens leave most of 8 warps without a token
    ("d128-g4-ps8-e4m3-f16", ProblemSpec(2, 300, 8, 2, 128, 8, F16, E4, seed=202), [2, ONE]),
]


@pytest.mark.parametrize("warps", [2, 8])
@pytest.mark.parametrize("spec,ppcs", [c[1:] for c in TC_WARP_CASES],
                         ids=[c[0] for c in TC_WARP_CASES])
def test_tc_warps_setting_on_v2tc(monkeypatch, warps, spec, ppcs):
    """``PAGED_DECODE_TC_WARPS`` (default 4) changes the CUDA tensor-core partial's CTA:
    2 warps take 32 tokens per ring stage, 8 take 128, so the stage loop, the warps'
    cross-warp combine and the block size all move; no other test sets it. The launch
    must be the specialization that names the warps, with that many threads."""
    monkeypatch.setenv(TC_WARPS_ENV, str(warps))
    be = pd.get_backend("emulated-cuda")
    runs = launched(monkeypatch, be)
    fp8 = spec.kv_dtype == E4
    pr = make_problem(spec)
    for ppc in ppcs:
        for od in ([F32, spec.q_dtype] if ppc == ONE else [F32]):
            tol = tc_fp8_out_tol(spec.q_dtype, od) if fp8 else tc_out_tol(spec.kv_dtype, od)
            decode_checked(be, pr, "v2tc", ppc, out_dtype=od, tol=tol, scaled=fp8)
    tc = [lc for lc in runs if lc.spec.kernel == "v2tc"]
    assert tc, [lc.spec.uri for lc in runs]
    for lc in tc:
        want = v2tc_spec(spec.kv_dtype, lc.spec.out_dtype, spec.head_dim, spec.page_size,
                         q_dtype=spec.q_dtype, merged_dtype=lc.spec.merged_dtype)
        assert lc.spec.uri == want.uri and f"_w-{warps}_" in lc.spec.uri, lc.spec.uri
        assert lc.block == 32 * warps, (lc.spec.uri, lc.block)


@pytest.mark.parametrize("bad", ["3", "16", "four"])
def test_tc_warps_bad_value_is_refused_by_name(monkeypatch, bad):
    """A value other than 2, 4 or 8 is an argument error naming the variable and the
    value, raised before anything launches (never a silent fallback to 4)."""
    monkeypatch.setenv(TC_WARPS_ENV, bad)
    be = pd.get_backend("emulated-cuda")
    runs = launched(monkeypatch, be)
    pr = make_problem(ProblemSpec(1, 40, 4, 1, 64, 16, seed=203))
    with pytest.raises(InvalidArgumentError,
                       match=rf"PAGED_DECODE_TC_WARPS must be 2, 4 or 8, got '{bad}'"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2tc", backend=be)
    assert not [lc for lc in runs if lc.spec.kernel == "v2tc"]


# ---------------------------------------------------------------------------- 2. stages
@pytest.mark.parametrize("stages", [3, 4])
def test_stages_setting_on_v2_and_v1(monkeypatch, stages):
    """``PAGED_DECODE_STAGES`` deepens the cp.async rings of the v2 partial and v1 (only
    v2tc's was tested): at head_dim 128 and 4 heads per CTA a v2 stage is 32 tokens, so
    chunks of 320 tokens refill every slot of a 4-deep ring twice, then merge; v1 (64
    tokens a stage) runs ~8 stages per request. v1's ring is capped by its budget (3 at
    head_dim 128), so its launch must be what ``v1_spec`` resolves, never the default 2."""
    monkeypatch.setenv(STAGES_ENV, str(stages))
    be = pd.get_backend("emulated-cuda")
    runs = launched(monkeypatch, be)
    pr = make_problem(ProblemSpec(2, 520, 8, 2, 128, 16, seed=210 + stages))
    decode_checked(be, pr, "v2", 20)
    decode_checked(be, pr, "v1", None, out_dtype=F16)
    v2 = {lc.spec.uri for lc in runs if lc.spec.kernel == "v2"}
    v1 = {lc.spec.uri for lc in runs if lc.spec.kernel == "v1"}
    assert v2 == {v2_spec(F16, F16, F32, 128, 16, 4).uri}, v2
    assert f"_st-{stages}_" in next(iter(v2))
    assert v1 == {v1_spec(F16, F16, F16, 128, 16).uri}, v1
    assert "_st-2" not in next(iter(v1))


# ---------------------------------------------------------------------------- 3. fp8
FP8_GEOMETRIES = [(96, 8), (128, 32), (256, 5)]      # (head_dim, page_size)


@pytest.mark.parametrize("name", DIALECTS)
@pytest.mark.parametrize("fmt", [E4, E5])
@pytest.mark.parametrize("head_dim,page_size", FP8_GEOMETRIES,
                         ids=[f"d{d}-ps{p}" for d, p in FP8_GEOMETRIES])
def test_fp8_pools_wide_heads_gqa8(name, fmt, head_dim, page_size):
    """fp8 pools on v2 (one chunk: the partial's store, in q's dtype; split: the merge,
    which v_scale must reach) and v1 at the head dims test_fp8.py leaves out (it runs
    64 only), GQA 8 (16 / 2) and pages of 8, 32 and 5 (an fp8 row then starts at no
    16-byte boundary of a page), mid-page starts and partial last pages."""
    be = pd.get_backend(name)
    pr = make_problem(ProblemSpec(2, 45, 16, 2, head_dim, page_size, F16, fmt,
                                  seed=head_dim + page_size + len(fmt)))
    decode_checked(be, pr, "v2", ONE, out_dtype=F16, tol=fp8_out_tol(F16), scaled=True)
    decode_checked(be, pr, "v2", 1, tol=fp8_out_tol(F32), scaled=True)
    decode_checked(be, pr, "v1", None, tol=fp8_out_tol(F32), scaled=True)


@pytest.mark.parametrize("name", DIALECTS)
@pytest.mark.parametrize("fmt", [E4, E5])
def test_fp8_pools_with_float32_queries(name, fmt):
    """float32 queries over fp8 pools on v2 (the existing fp8 decodes take 16-bit q): the
    query is never rounded to 16 bits, so the float32 bound holds, one chunk and split."""
    be = pd.get_backend(name)
    pr = make_problem(ProblemSpec(2, 60, 16, 2, 128, 32, F32, fmt, seed=220 + len(fmt)))
    for ppc in (ONE, 1):
        decode_checked(be, pr, "v2", ppc, tol=fp8_out_tol(F32), scaled=True)


# ---------------------------------------------------------------------------- 4. variants
@pytest.mark.parametrize("name", DIALECTS)
def test_variants_with_two_q_groups(name):
    """Window + soft cap + per-head sinks on v2 at GQA 16 (32 / 2 at head_dim 128): each
    KV head runs two CTAs of 8 heads, so the one-chunk partial's store must read sink
    ``h0 + g`` with ``h0`` counting the q-group (a sink of the wrong head shows as the
    other head's weight); split, the merge takes the sinks."""
    be = pd.get_backend(name)
    pr = make_problem(ProblemSpec(2, 90, 32, 2, 128, 16, seed=230))
    variant = {"window_left": 37, "logits_soft_cap": 2.0, "sinks": sinks_for(32, 231)}
    decode_checked(be, pr, "v2", ONE, out_dtype=F16, variant=variant)
    decode_checked(be, pr, "v2", 1, variant=variant)


# ---------------------------------------------------------------------------- 5. pages
PAGE_CASES = [
    # pages of 7: no page boundary on a power of two; v1 at head_dim 96 (24 of 32 lanes)
    ("ps7-d96-g4-f16", ProblemSpec(3, 60, 8, 2, 96, 7, seed=240), F16, None, None),
    # pages of 256 (the largest), every request over two of them: one from a start at 200
    # of its first page, one with a partial last page
    ("ps256-d128-g2-bf16", ProblemSpec(2, 0, 4, 2, 128, 256, BF16, BF16, seed=241), BF16,
     [300, 270], [200, 0]),
    # one request of one token at the last entry of its page beside one of 500 tokens
    ("ps256-d96-g3-f32", ProblemSpec(2, 0, 6, 2, 96, 256, F32, F32, seed=242), F32,
     [500, 1], [13, 255]),
]


@pytest.mark.parametrize("name", DIALECTS)
@pytest.mark.parametrize("spec,out_dtype,lengths,offsets", [c[1:] for c in PAGE_CASES],
                         ids=[c[0] for c in PAGE_CASES])
def test_page_sizes_7_and_256(name, spec, out_dtype, lengths, offsets):
    """v2 (one chunk, in the output dtype; split into single pages, merged) and v1 at
    page sizes 7 and 256, with mid-page starts and partial last pages."""
    be = pd.get_backend(name)
    pr = make_problem(spec, lengths=lengths, offsets=offsets)
    decode_checked(be, pr, "v2", ONE, out_dtype=out_dtype)
    decode_checked(be, pr, "v2", 1)
    decode_checked(be, pr, "v1", None, out_dtype=out_dtype)


# ---------------------------------------------------------------------------- 6. dtypes
MIXED = [(F16, BF16), (BF16, F16), (F32, BF16), (F16, F32)]


@pytest.mark.parametrize("q_dtype,kv_dtype", MIXED, ids=[f"q{q}-kv{k}" for q, k in MIXED])
def test_mixed_query_and_pool_dtypes(q_dtype, kv_dtype):
    """Queries of one dtype over pools of another on v2 one chunk (output in q's dtype),
    v2 split and v1 (float32 outputs): each operand is read in its own dtype, so the
    bound is the output dtype's (a query rounded to the pools' 16 bits would miss the
    float32 bound)."""
    be = pd.get_backend("emulated-cuda")
    pr = make_problem(ProblemSpec(2, 70, 8, 2, 64, 16, q_dtype, kv_dtype,
                                  seed=250 + len(q_dtype) + 3 * len(kv_dtype)))
    decode_checked(be, pr, "v2", ONE, out_dtype=q_dtype)
    decode_checked(be, pr, "v2", 1)
    decode_checked(be, pr, "v1", None)


# ---------------------------------------------------------------------------- 7. append
@pytest.mark.parametrize("name", DIALECTS)
def test_append_kernel_with_4_byte_words(monkeypatch, name):
    """A float32 pool of 1 KV head x head_dim 3: rows of 12 bytes, so the append kernel
    moves 4-byte words (GEOMETRIES in test_append_batch.py has 16, 8 and 2). Random pool
    operations against the model, every visible entry checked, pools NaN-poisoned."""
    be = pd.get_backend(name)
    runs = launched(monkeypatch, be)
    pool, model = make(be, dtype="float32", heads=1, head_dim=3, num_pages=24)
    ran = random_ops(pool, model, np.random.default_rng(260), 50)
    check(pool, model)
    assert ran.get("ragged", 0) + ran.get("batch1", 0) > 0, ran
    appends = {lc.spec.uri for lc in runs if lc.spec.kernel == "append"}
    assert appends == {"pd_append_o-f32_vb-4"}, appends


# ---------------------------------------------------------------------------- 8. table
@pytest.mark.parametrize("name", DIALECTS)
def test_table_update_row_of_more_than_128_pages(monkeypatch, name):
    """The table-update kernel writes a row with a block of 128 threads, striding over
    its pages: a row of 300 pages (page size 1) keeps them over three strides, then gains
    200 new pages in one update (the changed ids strided too), then is trimmed at the
    front (``skip``) and moved to another row (``src_row``), and forked."""
    be = pd.get_backend(name)
    rng = np.random.default_rng(270)
    pool = pd.PagePool(700, 1, 1, 4, "float32", backend=be)

    def rows(n):
        return rng.standard_normal((n, 1, 4)).astype(np.float32)
    a, b = pool.new_sequence(), pool.new_sequence()
    pool.append_batch([a, b], rows(305), rows(305), counts=[300, 5])
    st = pool.step_table([a, b], capacity=4)
    assert_matches_pool(st)
    runs = launched(monkeypatch, be)
    pool.append_batch([a, b], rows(2), rows(2))            # keeps 300 pages, gains 1
    assert_matches_pool(st)
    pool.append(a, rows(200), rows(200))                   # 200 changed ids in one row
    assert_matches_pool(st)
    pool.trim_front(a, 50)                                 # skip 50 of 501
    st.set_sequences([b, a])                               # row 1 from old row 0
    assert_matches_pool(st)
    c = pool.fork(a)
    st.set_sequences([c, b, a])
    pool.append_batch([c, a], rows(2), rows(2))
    assert_matches_pool(st)
    updates = [lc for lc in runs if lc.spec.kernel == "table_update"]
    assert len(updates) >= 4, [lc.spec.uri for lc in runs]
    assert max(pool.seq_len(s) for s in (a, c)) > 3 * 128
