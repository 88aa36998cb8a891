"""The kernel mutant list and mechanism (``tests/mutants.py``) without running a kernel: every
mutation applies exactly once to each kernel it names, every killing test exists, stale
mutations raise before anything runs. ``make mutants`` (and CI) runs the mutants."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from mutants import (
    GPU_NEGATIVE_CONTROLS,
    KERNELS,
    METAL_KERNELS,
    MUTANTS,
    Mutation,
    StaleMutation,
    backend,
    control,
    mutate_cuda,
    mutate_metal,
)

from paged_decode.backends.metal_launches import metal_kernel
from paged_decode.specs import cuda_source, merge_spec, v1_spec, v2_spec

ROOT = Path(__file__).resolve().parents[1]

#: the survivors issue #18 names: each must stay on the list
ISSUE_18 = ("cuda-acc-rounded-to-kv-type", "metal-acc-in-kv-type", "cuda-merge-no-32-row-cap",
            "cuda-merge-gather-max-wrong-row", "metal-k-stride-d256-f32",
            "metal-group-sum-16-as-simd-sum", "prefix-no-barrier-before-refill",
            "prefix-no-cp-async-wait")


@pytest.mark.parametrize("name", list(GPU_NEGATIVE_CONTROLS))
def test_gpu_negative_control_applies_once(name):
    # the GPU modules compile these on the device; a stale one must fail here, on the CPU
    mutation = GPU_NEGATIVE_CONTROLS[name]
    mutation.check()
    assert len(mutation.kernels) == 1 and mutation.old != mutation.new


def test_a_stale_gpu_negative_control_is_caught():
    from dataclasses import replace
    stale = replace(GPU_NEGATIVE_CONTROLS["v2tc-ignores-indices"],
                    old="page_ids[(a_begin + i) / PAGE_SIZE]")
    with pytest.raises(StaleMutation, match="occurs 0 times"):
        stale.check()


@pytest.mark.parametrize("mt", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutation_applies_once_to_each_kernel(mt):
    mt.mutation.check()
    assert mt.mutation.old != mt.mutation.new


def test_mutant_list_is_well_formed():
    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names) >= 30
    assert set(ISSUE_18) <= set(names)
    for m in MUTANTS:
        valid = {"cuda": KERNELS, "metal": METAL_KERNELS}.get(m.mutation.dialect)
        if valid is None:   # host code: one module of the package
            assert m.mutation.dialect == "python" and len(m.mutation.kernels) == 1, m.name
            assert m.mutation.kernels[0].startswith("paged_decode."), m.name
        else:
            assert set(m.mutation.kernels) <= set(valid), m.name
        assert m.tests and m.why, m.name
    covered = {(m.mutation.dialect, k) for m in MUTANTS for k in m.mutation.kernels}
    assert {"paged_decode.variants", "paged_decode.plan"} <= {k for d, k in covered
                                                               if d == "python"}
    assert covered >= {("cuda", k) for k in KERNELS} | {("metal", k) for k in METAL_KERNELS}


def test_killing_tests_exist():
    for m in MUTANTS:
        for node in m.tests:
            path, _, rest = node.partition("::")
            assert (ROOT / path).is_file(), node
            func = rest.split("[")[0]
            mod = importlib.import_module(Path(path).stem)
            assert callable(getattr(mod, func, None)), node


def test_stale_mutations_raise_before_anything_runs():
    gone = Mutation("cuda", ("v2",), "this text is in no kernel", "x")
    with pytest.raises(StaleMutation, match="occurs 0 times") as e:
        gone.check()
    assert not isinstance(e.value, AssertionError)     # never taken for a detection
    with pytest.raises(StaleMutation):
        backend(gone)
    twice = Mutation("cuda", ("v2",), "__syncwarp", "")   # not in v2: occurs 0 times
    with pytest.raises(StaleMutation):
        twice.check()
    many = Mutation("cuda", ("merge",), "lane", "l")
    with pytest.raises(StaleMutation, match=r"occurs \d+ times \(exactly once expected\)"):
        many.check()
    # one kernel of two: the v1 body is not in the v2 source
    v1_only = Mutation("cuda", ("v2", "v1"), "pd_decode_v1(", "pd_decode_v1x(")
    with pytest.raises(StaleMutation, match="cuda v2"):
        v1_only.check()


def test_mutations_reach_only_the_kernels_they_name():
    m = Mutation("cuda", ("v1",), "fpo, 0, seq, r, kvh, h,", "fpo, 0, seq - 1, r, kvh, h,")
    v1 = v1_spec("float16", "float16", "float32", 64, 16)
    v2 = v2_spec("float16", "float16", "float32", 64, 16, 4)
    assert "seq - 1" in mutate_cuda([m], v1, cuda_source("v1"))
    assert mutate_cuda([m], v2, cuda_source("v2")) == cuda_source("v2")
    # Metal: the header (shared by v2 and v1) or the body, wherever the text is
    head = Mutation("metal", ("v2",), "  mx = simd_max(mx);\n", "")
    with pytest.raises(StaleMutation):
        head.check()                                    # the merge's, not v2's
    body = Mutation("metal", ("v1",), "const int kvh = h / (num_qo_heads / num_kv_heads);",
                    "const int kvh = h % num_kv_heads;")
    mk = mutate_metal([body], v1, metal_kernel("v1"))
    assert "h % num_kv_heads" in mk.source and mk.header == metal_kernel("v1").header
    merge = merge_spec("float32", 64)
    ctl = mutate_metal([control("metal")], merge, metal_kernel("merge"))
    assert ctl.header.endswith("// unmutated control\n")
    assert ctl.source == metal_kernel("merge").source
