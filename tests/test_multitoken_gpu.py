"""Multi-token decode on the CUDA backend of a real GPU (skipped cleanly without CuPy or a
GPU): v2, v2tc (4 tokens x GQA 4 and 8: one and two 16-row tiles), v1 and gather against
the float64 oracle, uniform and ragged token counts, with the variants; torch CUDA tensors
in and out; the prepared call. NaN-poisoned outputs and workspaces (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, tc_out_tol

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import oracle_decode

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not availability("cuda").ok,
                                 reason=f"CUDA backend unavailable: {availability('cuda').reason}")]

HKV, D = 8, 128


def _problem(lengths, counts, hq, dtype, seed=0):
    pr = make_problem(ProblemSpec(len(lengths), max(lengths), hq, HKV, D, 16, dtype, dtype,
                                  seed=seed), lengths=list(lengths))
    q = (np.random.default_rng(seed + 1).standard_normal((int(sum(counts)), hq, D)) * 1.5
         ).astype(pr.q.dtype)
    return pr, q, np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


@pytest.fixture(scope="module")
def cuda():
    return pd.get_backend("cuda")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("path,hq", [("v2", 32), ("v2tc", 32), ("v2tc", 64), ("v1", 32),
                                     ("gather", 32)],
                         ids=["v2", "v2tc-one-tile", "v2tc-two-tiles", "v1", "gather"])
def test_ragged_tokens_match_oracle_on_cuda(cuda, path, hq, dtype):
    import cupy as cp
    pr, q, qi = _problem([4, 1500, 3000, 777], [4, 1, 4, 3], hq, dtype, seed=hq)
    ref, ref_lse = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi)
    out, lse = pd.decode(cp.asarray(q), cp.asarray(pr.k_pages), cp.asarray(pr.v_pages),
                         pr.table, path=path, qo_indptr=qi, return_lse=True,
                         out_dtype="float32", backend=cuda)
    tol = tc_out_tol(dtype, "float32") if path == "v2tc" else None
    assert_matches_oracle(cp.asnumpy(out), cp.asnumpy(lse), ref, ref_lse, "float32",
                          str(pd.last_outcome()), tol=tol)


@pytest.mark.parametrize("path", ["v2", "v2tc", "v1"])
def test_up_to_eight_tokens_per_request_on_cuda(cuda, path):
    """The most query tokens a request may bring (8), beside 5, 1 and 7: at GQA 4 the
    tensor-core partial folds 8 tokens into 32 rows, two row tiles."""
    import cupy as cp
    pr, q, qi = _problem([8, 1500, 3000, 777], [8, 5, 1, 7], 32, "float16", seed=11)
    ref, ref_lse = oracle_decode(q, pr.k_pages, pr.v_pages, pr.table, qo_indptr=qi)
    out, lse = pd.decode(cp.asarray(q), cp.asarray(pr.k_pages), cp.asarray(pr.v_pages),
                         pr.table, path=path, qo_indptr=qi, return_lse=True,
                         out_dtype="float32", backend=cuda)
    tol = tc_out_tol("float16", "float32") if path == "v2tc" else None
    assert_matches_oracle(cp.asnumpy(out), cp.asnumpy(lse), ref, ref_lse, "float32",
                          str(pd.last_outcome()), tol=tol)


def test_variants_and_torch_tensors_on_cuda(cuda):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    pr, q, qi = _problem([8, 2000, 513], [4, 4, 4], 32, "float16", seed=7)
    sinks = (np.random.default_rng(3).standard_normal(32) * 2).astype(np.float32)
    kw = {"window_left": 300, "logits_soft_cap": 5.0}
    ref, ref_lse = oracle_decode(q.reshape(3, 4, 32, D), pr.k_pages, pr.v_pages, pr.table,
                                 sinks=sinks, **kw)
    dev = torch.device("cuda")
    out, lse = pd.decode(torch.from_numpy(q.reshape(3, 4, 32, D)).to(dev),
                         torch.from_numpy(pr.k_pages).to(dev),
                         torch.from_numpy(pr.v_pages).to(dev), pr.table, return_lse=True,
                         sinks=torch.from_numpy(sinks).to(dev), backend=cuda, **kw)
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (3, 4, 32, D)
    assert_matches_oracle(out.float().cpu().numpy(), lse.cpu().numpy(), ref, ref_lse,
                          "float16", str(pd.last_outcome()))


def test_prepared_multitoken_on_cuda(cuda):
    import cupy as cp
    pr, q, qi = _problem([40, 3000], [4, 4], 32, "float16", seed=9)
    qd = cp.asarray(q.reshape(2, 4, 32, D))
    prep = pd.prepare_decode(qd, cp.asarray(pr.k_pages), cp.asarray(pr.v_pages), pr.table,
                             path="v2tc", return_lse=True, backend=cuda)
    for seed in (0, 1):
        new = np.random.default_rng(seed).standard_normal(qd.shape).astype(np.float16)
        qd[...] = cp.asarray(new)
        out, lse = prep()
        ref, ref_lse = oracle_decode(new, pr.k_pages, pr.v_pages, pr.table)
        assert_matches_oracle(cp.asnumpy(out), cp.asnumpy(lse), ref, ref_lse, "float16",
                              f"prepared {seed}", tol=tc_out_tol("float16", "float16"))
