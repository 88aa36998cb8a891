"""The real CUDA kernels (v2 partial, merge, v1) on the ``emulated-cuda`` backend against
the float64 oracle, with negative controls: mutated kernel sources must fail.

A subset of the GPU matrix, sized for CI on 2 cores: head_dim 64 and 128, GQA 1/4/8,
pages 1/16/32, partial last pages and mid-page starts (``make_problem`` jitter), empty
requests, multi-chunk merges (forced ``pages_per_chunk``), every K/V dtype.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from conftest import assert_matches_oracle

import paged_decode as pd
from paged_decode.backends import availability
from paged_decode.backends.emulated import EmulatedCudaBackend
from paged_decode.backends.reference import ReferenceBackend, combine_f32
from paged_decode.emulator import EmulatorError, OutOfBoundsError
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import max_rel_error, oracle_decode
from paged_decode.specs import cuda_source

pytestmark = pytest.mark.skipif(not availability("emulated-cuda").ok,
                                reason=f"emulator unavailable: "
                                       f"{availability('emulated-cuda').reason}")


@pytest.fixture(scope="module")
def emu():
    return pd.get_backend("emulated-cuda")


# (id, spec, paths): paths as (path, pages_per_chunk); ppc forces multi-chunk merges
CASES = [
    ("d64-g1-ps16-f16", ProblemSpec(3, 70, 4, 4, 64, 16, seed=21),
     [("v2", None), ("v2", 1), ("v1", None)]),
    ("d128-g4-ps16-bf16", ProblemSpec(3, 90, 8, 2, 128, 16, "bfloat16", "bfloat16", seed=22),
     [("v2", None), ("v2", 2), ("v1", None)]),
    ("d128-g8-ps32-f16", ProblemSpec(2, 120, 16, 2, 128, 32, seed=23),
     [("v2", 1), ("v1", None)]),
    ("d64-g4-ps1-f32", ProblemSpec(2, 21, 8, 2, 64, 1, "float32", "float32", seed=24),
     [("v2", 5), ("v1", None)]),
    ("d128-g1-ps32-qf32-kvf16", ProblemSpec(2, 75, 2, 2, 128, 32, "float32", "float16",
                                            seed=25), [("v2", 1)]),
    ("d64-g8-ps16-qbf16-kvf32", ProblemSpec(2, 50, 8, 1, 64, 16, "bfloat16", "float32",
                                            seed=26), [("v2", 2)]),
]


def _run(be, spec, paths, *, lengths=None, offsets=None, out_dtype="float32"):
    pr = make_problem(spec, lengths=lengths, offsets=offsets)
    ref, ref_lse = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    for path, ppc in paths:
        plan = pd.plan_decode(pr.table, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                              device=be.device_info(), pages_per_chunk=ppc)
        out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path,
                             return_lse=True, out_dtype=out_dtype, backend=be)
        if path == "v2" and ppc is not None:
            assert plan.needs_merge, "the case must exercise the merge kernel"
        assert_matches_oracle(out, lse, ref, ref_lse, out_dtype, f"{spec.label} {path} {ppc}")


@pytest.mark.parametrize("spec,paths", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kernels_match_oracle(emu, spec, paths):
    _run(emu, spec, paths)


def test_output_in_query_dtype_without_merge(emu):
    spec = ProblemSpec(2, 60, 8, 2, 128, 16, seed=27)
    pr = make_problem(spec)
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    plan = pd.plan_decode(pr.table, 8, 2, 128, target_ctas=1)
    assert not plan.needs_merge
    out = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, backend=emu)
    assert pd.last_outcome().path == "v2" and out.dtype == np.float16
    assert_matches_oracle(out, None, ref, None, "float16", "v2 direct f16")


def test_empty_requests_give_zeros_and_neg_inf(emu):
    spec = ProblemSpec(4, 40, 8, 2, 64, 16, seed=28)
    _run(emu, spec, [("v2", 1), ("v1", None)], lengths=[40, 0, 17, 0], offsets=[0, 0, 5, 0])
    pr = make_problem(spec, lengths=[0, 0, 0, 0], offsets=[0, 0, 0, 0])
    for path in ("v2", "v1"):
        out, lse = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path=path,
                             return_lse=True, backend=emu)
        assert (out == 0).all() and np.isneginf(lse).all(), path


def test_merge_kernel_against_combine(emu):
    rng = np.random.default_rng(29)
    n, h, d = 9, 3, 128
    v = rng.standard_normal((n, h, d)).astype(np.float32)
    lse = (rng.standard_normal((n, h)) * 4).astype(np.float32)
    lse[2, :] = -np.inf                           # an empty chunk
    lse[5, 1] = np.nan                            # NaN carries no weight
    indptr = np.array([0, 1, 1, 4, 6, 6, 9], np.int32)   # singleton, empty groups
    lse[4:6, 2] = -np.inf                         # an all-empty group for one head
    out, lse_out = pd.merge_states(v, lse, indptr, backend=emu)
    for o in range(indptr.size - 1):
        a, b = indptr[o], indptr[o + 1]
        lw = np.where(np.isnan(lse[a:b]), -np.inf, lse[a:b])
        ro, rl = combine_f32(v[a:b], lw)
        np.testing.assert_allclose(out[o], ro, rtol=2e-6, atol=2e-6)
        np.testing.assert_allclose(lse_out[o], rl, rtol=1e-6, atol=1e-6)
    assert np.isneginf(lse_out[1]).all() and (out[1] == 0).all()
    assert np.isneginf(lse_out[4, 2])


# ----------------------------------------------------------------- negative controls
class _Mutant(EmulatedCudaBackend):
    def __init__(self, kernel, mutate):
        super().__init__()
        self._kernel, self._mutate = kernel, mutate

    def kernel_source(self, spec):
        src = super().kernel_source(spec)
        if spec.kernel != self._kernel:
            return src
        bad = self._mutate(src)
        assert bad != src, "mutation did not apply"
        return bad


def _fails(be, spec, path="v2", ppc=None):
    """Whether a decode on ``be`` fails: an emulator error or a result off the oracle."""
    pr = make_problem(spec)
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    plan = pd.plan_decode(pr.table, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                          device=be.device_info(), pages_per_chunk=ppc)
    try:
        out = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path,
                        out_dtype="float32", backend=be)
    except EmulatorError as exc:
        return str(exc)
    err = max_rel_error(out, ref)
    return f"error {err:.3g}" if err > 0.1 else ""


SPEC_NEG = ProblemSpec(3, 60, 8, 2, 64, 16, seed=30)


def test_off_by_one_page_index_fails():
    bad = _Mutant("v2", lambda s: s.replace("page_ids[a / PAGE_SIZE]",
                                            "page_ids[a / PAGE_SIZE + 1]"))
    with pytest.raises(OutOfBoundsError, match=r"pd_decode_v2_partial<.*'indices'"):
        pd.decode(*_problem_args(SPEC_NEG), path="v2", backend=bad)


def test_off_by_one_page_offset_fails():
    bad = _Mutant("v2", lambda s: s.replace("const long long a = fpo + t;",
                                            "const long long a = fpo + t + 1;"))
    assert _fails(bad, SPEC_NEG, ppc=1)


def test_removed_syncthreads_fails():
    bad = _Mutant("v2", lambda s: s.replace("  __syncthreads();\n", "", 1))
    why = _fails(bad, SPEC_NEG)
    assert "differs between the forward and the reverse fiber schedule" in why, why


def test_merge_without_rescale_fails():
    bad = _Mutant("merge", lambda s: s.replace("const float w = exp2f(s - mx);",
                                               "const float w = 1.f;"))
    assert _fails(bad, SPEC_NEG, ppc=1)


def test_reference_mutant_control_passes():
    # the harness itself: an identity "mutation" must pass
    ok = _Mutant("v2", lambda s: s + "\n// unchanged\n")
    assert _fails(ok, SPEC_NEG, ppc=1) == ""


def _problem_args(spec):
    pr = make_problem(spec)
    return pr.q, pr.k_pages, pr.v_pages, pr.table


# ----------------------------------------------------------------- launch packing
def test_launch_packing_matches_cuda_backend(monkeypatch):
    """The emulated backend launches with the CUDA backend's spec, grid, block, dynamic
    shared memory and arguments (CuPy faked out; cuda.py's own code builds the launch)."""
    from paged_decode.backends import cuda as cuda_mod
    calls = {"cuda": [], "emu": []}
    monkeypatch.setattr(cuda_mod, "cp", types.SimpleNamespace(ndarray=np.ndarray))
    monkeypatch.setattr(cuda_mod, "_check_aligned", lambda *a: None)
    cb = cuda_mod.CudaBackend()
    monkeypatch.setattr(cb, "upload", lambda a: a)
    monkeypatch.setattr(cb, "dtype_of", ReferenceBackend().dtype_of)
    monkeypatch.setattr(cb, "_run", lambda launch: calls["cuda"].append(launch))
    eb = EmulatedCudaBackend()
    monkeypatch.setattr(eb, "_run", lambda launch: calls["emu"].append(launch))
    spec = ProblemSpec(2, 50, 8, 2, 64, 16, seed=31)
    pr = make_problem(spec)
    plan = pd.plan_decode(pr.table, 8, 2, 64, pages_per_chunk=1)
    for be in (cb, eb):
        vo = np.zeros((plan.num_chunks, 8, 64), np.float32)
        lo = np.zeros((plan.num_chunks, 8), np.float32)
        be.partial(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, 0.125, vo, lo)
        be.merge(vo, lo, plan.o_indptr, np.zeros((2, 8, 64), np.float16),
                 np.zeros((2, 8), np.float32))
        be.decode_v1(pr.q, pr.k_pages, pr.v_pages, pr.table, 0.125,
                     np.zeros((2, 8, 64), np.float32), np.zeros((2, 8), np.float32))
    assert len(calls["cuda"]) == len(calls["emu"]) == 3
    for c, e in zip(calls["cuda"], calls["emu"]):
        assert (c.spec, c.grid, c.block, c.smem) == (e.spec, e.grid, e.block, e.smem)
        assert [(a.name, a.role) for a in c.args] == [(a.name, a.role) for a in e.args]
        for a, b in zip(c.args, e.args):
            np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))


def test_source_is_the_cuda_backends(emu):
    from paged_decode.specs import v2_spec
    assert emu.kernel_source(v2_spec("float16", "float16", "float32", 64, 16, 4)) == \
        cuda_source("v2")
