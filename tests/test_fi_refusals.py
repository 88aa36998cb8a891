"""Every argument the FlashInfer shim does not support is refused by name (one test per
argument), and bad input gets a clear error, never a wrong answer."""

from __future__ import annotations

import numpy as np
import pytest
from fi_cases import FiCase, make_fi_problem

import paged_decode.compat.flashinfer as fi
from paged_decode.errors import (
    InvalidArgumentError,
    InvalidDtypeError,
    PagedDecodeError,
    UnsupportedProblemError,
)

CLS = "BatchDecodeWithPagedKVCacheWrapper"
WS = np.zeros(1 << 20, np.uint8)


@pytest.fixture(scope="module")
def pr():
    return make_fi_problem(FiCase(12, 54, 8, 8, 4, 128))


def plan(w, pr, **kw):
    args = dict(indptr=pr.indptr, indices=pr.indices, last_page_len=pr.last_page_len,
                num_qo_heads=8, num_kv_heads=4, head_dim=128, page_size=8)
    args.update(kw)
    w.plan(**args)
    return w


@pytest.fixture
def w(pr):
    return plan(fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference"), pr)


# ---------------------------------------------------------------------------- constructor
@pytest.mark.parametrize("kw, match", [
    ({"kv_layout": "HND"}, "kv_layout='HND' is not supported"),
    ({"kv_layout": "NDH"}, "kv_layout must be 'NHD'"),
    ({"jit_args": ["x"]}, "jit_args"),
    ({"backend": "fa2"}, "backend='fa2' is not supported"),
    ({"backend": "trtllm-gen"}, "backend='trtllm-gen' is not supported"),
], ids=["HND", "bad-layout", "jit_args", "fa2", "trtllm-gen"])
def test_constructor_refuses(kw, match):
    with pytest.raises(UnsupportedProblemError, match=match) as e:
        fi.BatchDecodeWithPagedKVCacheWrapper(WS, **kw)
    assert str(e.value).startswith(CLS)


@pytest.mark.parametrize("missing", range(3))
def test_graph_mode_needs_all_three_buffers(missing):
    bufs = [np.zeros(13, np.int32), np.zeros(50, np.int32), np.zeros(12, np.int32)]
    bufs[missing] = None
    with pytest.raises(InvalidArgumentError, match="is required with use_cuda_graph=True"):
        fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WS, *bufs)


@pytest.mark.parametrize("bufs, match", [
    ((np.zeros(12, np.int32), np.zeros(50, np.int32), np.zeros(12, np.int32)),
     "paged_kv_indptr_buffer must have 13 entries"),
    ((np.zeros(13, np.int64), np.zeros(50, np.int32), np.zeros(12, np.int32)),
     "1-D int32"),
    ((np.zeros(13, np.int32), [0] * 50, np.zeros(12, np.int32)), "must be a torch tensor"),
], ids=["indptr-size", "int64", "list"])
def test_graph_mode_buffers_are_checked(bufs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WS, *bufs)


# ---------------------------------------------------------------------------- plan
@pytest.mark.parametrize("kw, match", [
    ({"pos_encoding_mode": "ROPE_LLAMA"}, "pos_encoding_mode='ROPE_LLAMA'.*RoPE"),
    ({"pos_encoding_mode": "ALIBI"}, "pos_encoding_mode='ALIBI'.*ALiBi"),
    ({"pos_encoding_mode": "rope"}, "pos_encoding_mode must be one of"),
    ({"rope_scale": 1.0}, "rope_scale=1.0"),
    ({"rope_theta": 1e4}, "rope_theta=10000.0"),
    ({"block_tables": np.zeros((12, 8), np.int32)}, "block_tables"),
    ({"seq_lens": np.zeros(12, np.int32)}, "seq_lens"),
], ids=["rope", "alibi", "bad-mode", "rope_scale", "rope_theta", "block_tables",
        "seq_lens"])
def test_plan_refuses_what_would_change_the_attention(pr, kw, match):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    with pytest.raises(UnsupportedProblemError, match=match) as e:
        plan(w, pr, **kw)
    assert str(e.value).startswith(f"{CLS}.plan: ")
    with pytest.raises(InvalidArgumentError, match="call plan"):
        w.run(pr.q, pr.cache)           # nothing was planned


@pytest.mark.parametrize("kw, err, match", [
    ({"q_data_type": "float8_e4m3fn"}, InvalidDtypeError, "q_data_type must have dtype"),
    ({"kv_data_type": "int8"}, InvalidDtypeError, "kv_data_type must have dtype"),
    ({"head_dim": 80}, UnsupportedProblemError, "head_dim must be one of"),
    ({"page_size": 512}, UnsupportedProblemError, "page_size must be in"),
    ({"num_qo_heads": 6}, InvalidArgumentError, "multiple of num_kv_heads"),
    ({"sm_scale": float("nan")}, InvalidArgumentError, "sm_scale must be finite"),
    ({"non_blocking": "yes"}, InvalidArgumentError, "non_blocking must be a bool"),
    ({"indptr": np.array([0, 5, 3] + [9] * 10, np.int32)}, InvalidArgumentError,
     "non-decreasing"),
    ({"indptr": np.arange(12, dtype=np.int32)}, InvalidArgumentError, "batch_size \\+ 1"),
    ({"last_page_len": np.zeros(12, np.int32)}, InvalidArgumentError,
     "last_page_len must be in \\[1, page_size = 8\\]"),
    ({"last_page_len": np.full(12, 9, np.int32)}, InvalidArgumentError, "got 9 for request 0"),
    ({"indices": np.zeros(3, np.int32)}, InvalidArgumentError, "indices has 3 entries"),
    ({"indices": np.full(200, -1, np.int32)}, InvalidArgumentError, "page ids in"),
    ({"indptr": np.zeros(1, np.int32), "last_page_len": np.zeros(0, np.int32)},
     InvalidArgumentError, "the batch is empty"),
    ({"indptr": np.zeros((2, 7), np.int32)}, InvalidArgumentError, "1-D integer array"),
    # an array as a dtype (numpy's ambiguous truth value once escaped check_dtype)
    ({"q_data_type": np.array([1, 2])}, InvalidDtypeError, "q_data_type must have dtype"),
], ids=["fp8-q", "int8-kv", "head_dim-80", "page-512", "gqa", "nan-scale", "non_blocking",
        "indptr-order", "indptr-size", "lpl-0", "lpl-9", "short-indices", "negative-ids",
        "empty-batch", "indptr-2d", "array-dtype"])
def test_plan_checks_its_arguments(pr, kw, err, match):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    with pytest.raises(err, match=match) as e:
        plan(w, pr, **kw)
    assert str(e.value).startswith(f"{CLS}.plan: ")


def test_graph_mode_plan_keeps_the_batch_size_and_the_buffer_bound(pr):
    bufs = (np.zeros(13, np.int32), np.zeros(pr.indices.size, np.int32), np.zeros(12, np.int32))
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(WS, *bufs)
    other = make_fi_problem(FiCase(17, 54, 8, 8, 4, 128))
    with pytest.raises(InvalidArgumentError, match="batch size is fixed in graph mode"):
        plan(w, other)
    longer = make_fi_problem(FiCase(12, 97, 8, 8, 4, 128))
    with pytest.raises(InvalidArgumentError, match="do not fit paged_kv_indices_buffer"):
        plan(w, longer)
    plan(w, pr)
    with pytest.raises(InvalidArgumentError, match="graph mode fixes \\(Hq, Hkv, D, P\\)"):
        plan(w, pr, num_qo_heads=16)
    small = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(np.zeros(64, np.uint8), *bufs)
    plan(small, pr)
    with pytest.raises(InvalidArgumentError, match="float_workspace_buffer holds 64 bytes"):
        small.run(pr.q, pr.cache)


@pytest.mark.parametrize("kw, match", [
    ({"window_left": 64}, "window_left=64 is not supported by paged-decode \\(in graph mode"),
    ({"logits_soft_cap": 30.0}, "logits_soft_cap=30.0 is not supported by paged-decode "
                                "\\(in graph mode"),
], ids=["window_left", "soft_cap"])
def test_graph_mode_plan_refuses_the_variants(pr, kw, match):
    bufs = [np.zeros(13, np.int32), np.zeros(64, np.int32), np.zeros(12, np.int32)]
    w = fi.BatchDecodeWithPagedKVCacheWrapper(
        WS, "NHD", use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
        paged_kv_indices_buffer=bufs[1], paged_kv_last_page_len_buffer=bufs[2],
        backend="reference")
    with pytest.raises(UnsupportedProblemError, match=match):
        plan(w, pr, **kw)


@pytest.mark.parametrize("kw, match", [
    ({"window_left": -2}, "window_left must be an integer >= -1"),
    ({"window_left": 1.5}, "window_left must be an integer"),
    ({"logits_soft_cap": -1.0}, "logits_soft_cap must be"),
    ({"logits_soft_cap": float("inf")}, "logits_soft_cap must be"),
], ids=["window-below-minus-1", "window-float", "cap-negative", "cap-inf"])
def test_plan_checks_the_variants(pr, kw, match):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference")
    with pytest.raises(InvalidArgumentError, match=match):
        plan(w, pr, **kw)


# ---------------------------------------------------------------------------- run
@pytest.mark.parametrize("kw, match", [
    ({"window_left": 16}, "window_left=16"),
    ({"sinks": np.zeros(8, np.float32)}, "sinks"),
    ({"q_len_per_req": 2}, "q_len_per_req=2"),
], ids=["window_left", "sinks", "q_len_per_req"])
def test_run_refuses_what_would_change_the_result(w, pr, kw, match):
    with pytest.raises(UnsupportedProblemError, match=match) as e:
        w.run(pr.q, pr.cache, **kw)
    assert str(e.value).startswith(f"{CLS}.run: ")


def test_run_refuses_custom_kernel_args(w, pr):
    with pytest.raises(UnsupportedProblemError, match="\\*args"):
        w.run(pr.q, pr.cache, 1.0)


def test_run_checks_its_arrays(w, pr):
    k, v = pr.pair()
    cases = [
        ((pr.q.astype(np.float32), pr.cache), {}, "q has dtype float32, but plan's "
                                                  "q_data_type is float16"),
        ((pr.q, pr.cache.astype(np.float32)), {}, "kv_data_type is float16"),
        ((pr.q[:5], pr.cache), {}, "q must have shape"),
        ((pr.q, (pr.cache[:, 0], pr.cache[:, 1])), {}, "k_cache is not C-contiguous"),
        ((pr.q, np.ascontiguousarray(pr.cache[..., :64])), {}, "must have \\(P, Hkv, D\\)"),
        ((pr.q, pr.cache[::2]), {}, "paged_kv_cache is not C-contiguous"),
        ((pr.q, pr.cache[:10]), {}, "paged_kv_cache has 10 pages"),
        ((pr.q, (k, v, k)), {}, "must be \\(k_cache, v_cache\\)"),
        ((pr.q, (k, v[:, :4])), {}, "one shape and dtype"),
        ((pr.q, pr.cache[:, :1]), {}, "\\[num_pages, 2, P, Hkv, D\\]"),
        ((pr.q, "cache"), {}, "must be a \\(k_cache, v_cache\\) tuple or one array"),
        ((pr.q, pr.cache), {"out": np.zeros((12, 8, 128), np.float32)},
         "out must have dtype float16"),
        ((pr.q, pr.cache), {"out": np.zeros((12, 8, 64), np.float16)}, "out must have shape"),
        ((pr.q, pr.cache), {"lse": np.zeros((12, 8), np.float16), "return_lse": True},
         "lse must have dtype float32"),
        ((pr.q, pr.cache), {"return_lse": 1}, "return_lse must be a bool"),
        # an object with a shape but no dtype (it once raised AttributeError)
        ((pr.q, pr.cache), {"out": type("S", (), {"shape": (12, 8, 128)})()},
         "out must be an array, got S"),
    ]
    for args, kw, match in cases:
        with pytest.raises(PagedDecodeError, match=match) as e:
            w.run(*args, **kw)
        assert str(e.value).startswith(f"{CLS}.run: "), str(e.value)


def test_strided_q_is_copied_but_refused_in_graph_mode(pr):
    from helpers import assert_matches_oracle
    w = plan(fi.BatchDecodeWithPagedKVCacheWrapper(WS, backend="reference"), pr)
    wide = np.zeros((12, 8, 256), np.float16)
    wide[..., :128] = pr.q
    q = wide[..., :128]
    out, lse = w.run(q, pr.cache, return_lse=True)
    assert_matches_oracle(out, lse, *pr.oracle(), "float16", "strided q")
    bufs = (np.zeros(13, np.int32), np.zeros(pr.indices.size, np.int32), np.zeros(12, np.int32))
    g = plan(fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(np.zeros(1 << 22, np.uint8), *bufs),
             pr)
    with pytest.raises(InvalidArgumentError, match="q must be C-contiguous in graph mode"):
        g.run(q, pr.cache)
    out = np.zeros((12, 8, 256), np.float16)[..., :128]
    with pytest.raises(InvalidArgumentError, match="out must be C-contiguous in graph mode"):
        g.run(pr.q, pr.cache, out=out)
