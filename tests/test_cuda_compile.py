"""Compile every CUDA specialization the tests and ``check`` use, without a GPU.

Runs in CI (NVRTC from the nvidia-cuda-nvrtc wheel, or nvcc); skips only when neither
compiler exists. A syntax or type error in a kernel string fails here, and so does a
source that nvcc accepts but NVRTC (what CuPy uses) rejects.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from paged_decode import cuda_compile
from paged_decode.specs import decode_specs

pytestmark = [pytest.mark.nvcc,
              pytest.mark.skipif(cuda_compile.available() is None,
                                 reason="no NVRTC library and no nvcc on this machine")]

DTYPES = ("float16", "bfloat16", "float32")


def check_matrix_specs():
    """The check matrix (head_dim x GQA x page, ``check.AXES``) for every dtype."""
    from paged_decode.check import AXES
    specs = set()
    for d, g, p, dt in itertools.product(AXES["head_dim"], AXES["gqa"], AXES["page_size"],
                                         DTYPES):
        specs.update(decode_specs(dt, dt, "float32", 4 * g, 4, d, p))
        specs.update(decode_specs(dt, dt, dt, 4 * g, 4, d, p))
    return specs


def gpu_test_specs():
    """Geometries and dtypes of tests/test_cuda_gpu.py (kept in step with its CASES)."""
    cases = [("float16", "float16", 32, 8, 128, 16), ("float16", "float16", 8, 8, 64, 32),
             ("bfloat16", "bfloat16", 16, 2, 128, 64), ("float16", "float16", 32, 2, 128, 16),
             ("float16", "float16", 28, 4, 128, 16), ("float32", "float32", 8, 2, 256, 16),
             ("float16", "float16", 16, 4, 96, 8), ("float16", "float16", 4, 2, 64, 1),
             ("float16", "float16", 8, 2, 128, 256), ("bfloat16", "bfloat16", 8, 2, 128, 7),
             ("float32", "float16", 8, 2, 128, 16), ("bfloat16", "float32", 8, 2, 64, 16)]
    specs = set()
    for q, kv, hq, hkv, d, p in cases:
        specs.update(decode_specs(q, kv, "float32", hq, hkv, d, p))
        specs.update(decode_specs(q, kv, q, hq, hkv, d, p))
    return specs


def test_compiler_is_found():
    assert cuda_compile.available() in ("nvrtc", "nvcc")


def test_compile_source_keeps_the_cubin(tmp_path):
    # bench/sass_loops.py disassembles what compile_source writes: an ELF holding the kernel
    src = 'extern "C" __global__ void pd_probe(float* x) { x[threadIdx.x] *= 2.f; }\n'
    path = tmp_path / "probe.cubin"
    cuda_compile.compile_source(src, cubin_path=str(path))
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and b"pd_probe" in data


def test_check_matrix_specializations_compile():
    cuda_compile.compile_specs(check_matrix_specs())


def test_gpu_test_specializations_compile():
    cuda_compile.compile_specs(gpu_test_specs() - check_matrix_specs())


def test_a_broken_kernel_string_fails_to_compile(monkeypatch):
    from paged_decode import specs as specs_mod
    real = specs_mod.cuda_source

    def broken(kernel):
        return real(kernel).replace("const int lane = threadIdx.x & 31", "const int lane = ;")
    monkeypatch.setattr(cuda_compile, "cuda_source", broken)
    spec = next(iter(decode_specs("float16", "float16", "float32", 8, 2, 128, 16)))
    with pytest.raises(RuntimeError, match="failed"):
        cuda_compile.compile_specs([spec])


def test_math_header_dependence_is_caught_by_nvrtc(monkeypatch):
    if cuda_compile.available() != "nvrtc":
        pytest.skip("only NVRTC lacks the C math headers")
    from paged_decode import specs as specs_mod
    real = specs_mod.cuda_source
    monkeypatch.setattr(cuda_compile, "cuda_source",
                        lambda k: real(k).replace("PD_INF", "INFINITY").replace(
                            "#define INFINITY", "#define PD_UNUSED"))
    spec = next(s for s in decode_specs("float16", "float16", "float32", 8, 2, 128, 16)
                if s.kernel == "merge")
    with pytest.raises(RuntimeError, match="INFINITY"):
        cuda_compile.compile_specs([spec])


def test_cascade_specializations_compile():
    """The tensor-core prefix kernel (cascade level 0) for every head_dim, both 16-bit
    dtypes and the page sizes of the tests and suites, the gathering merge and every split
    merge (sm_90 with ptxas: the mma.sync operands and the register budget meet the real
    toolchain)."""
    from paged_decode.specs import SUPPORTED_HEAD_DIMS, merge_spec, prefix_spec
    cuda_compile.compile_specs({prefix_spec(dt, d, p) for dt, d, p in itertools.product(
        ("float16", "bfloat16"), SUPPORTED_HEAD_DIMS, (1, 8, 16, 64))}
        | {merge_spec(dt, d, gather=True) for dt, d in itertools.product(
            DTYPES, SUPPORTED_HEAD_DIMS)}
        | {merge_spec(dt, d, gather=g, sink=s, split=k) for dt, d, g, s, k in
           itertools.product(DTYPES, SUPPORTED_HEAD_DIMS, (False, True), (False, True),
                             (2, 4, 8, 16))})


def test_append_specializations_compile():
    """The pool-append kernel for every pool dtype and word width (16/8/4/2 bytes)."""
    from paged_decode.kernels.append import WORD_BYTES
    from paged_decode.specs import append_spec
    cuda_compile.compile_specs({append_spec(dt, w) for dt, w in itertools.product(
        DTYPES, WORD_BYTES)})


@pytest.mark.parametrize("kw", [
    dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, kv_dtype="float16",
         logits_soft_cap=True, sinks=True),
    dict(num_qo_heads=28, num_kv_heads=4, head_dim=96, kv_dtype="float8_e4m3fn",
         q_dtype="bfloat16", out_dtype="float32"),
], ids=["f16-variants", "e4m3-hd96"])
def test_what_compile_ahead_lists_compiles(kw):
    """Every specialization ``compile_ahead`` compiles on a GPU that runs clusters (the
    emulated CUDA backend lists the same: it runs clusters too), with the real toolchain:
    the fused merge in each cluster size, the split merges, the appends, the table update,
    with the variants."""
    from paged_decode.compile_ahead import kernel_specs
    specs = kernel_specs("emulated-cuda", page_size=16, **kw)
    assert {s.cluster for s in specs} == {0, 2, 3, 4, 5, 6, 7, 8}
    cuda_compile.compile_specs(specs)


def test_what_compile_ahead_adds_for_other_calls_compiles():
    """What multi-token (8 tokens: a folded group of 32), cascade (the stacked v2 partial
    at every CTA width, the prefix kernel, the gathering merges) and sparse (page size 1)
    decodes add to a geometry's list, with the real toolchain."""
    from paged_decode.compile_ahead import kernel_specs
    kw = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, kv_dtype="float16",
              sinks=True)
    plain = set(kernel_specs("emulated-cuda", **kw))
    added = set(kernel_specs("emulated-cuda", query_tokens=8, cascade=True, sparse=True,
                             **kw)) - plain
    assert {s.kernel for s in added} == {"v2", "v2tc", "v1", "merge", "prefix"}
    assert {s.heads_per_cta for s in added if s.kernel == "v2"} == set(range(4, 9))
    cuda_compile.compile_specs(added)


def test_v2tc_specializations_compile():
    """The tensor-core v2 partial for every head_dim and both 16-bit dtypes at page size
    256 (sm_90 with ptxas: the mma.sync operands and the register budget meet the real
    toolchain). Its other specializations (float32 and 16-bit outputs, pages 1 to 64) come
    with the check matrix's and the GPU tests' ``decode_specs`` above."""
    from paged_decode.specs import SUPPORTED_HEAD_DIMS, v2tc_spec
    cuda_compile.compile_specs({v2tc_spec(dt, "float32", d, 256) for dt, d in
                                itertools.product(("float16", "bfloat16"), SUPPORTED_HEAD_DIMS)})


def test_v2tc_variant_specializations_compile():
    """v2tc's soft cap and sink specializations (``SOFT_CAP`` / ``SINK``, both dtypes, every
    head_dim between them), alone and together, with the real toolchain."""
    from paged_decode.specs import v2tc_spec
    cuda_compile.compile_specs({
        v2tc_spec(dt, out, d, 16, soft_cap=cap, sink=sink)
        for dt, out, d, cap, sink in [("float16", "float16", 64, True, True),
                                      ("bfloat16", "float32", 96, True, False),
                                      ("float16", "float32", 128, False, True),
                                      ("bfloat16", "bfloat16", 256, True, True)]})


@pytest.mark.parametrize("prefetch,head_dim", [(128, 128), (256, 128), (64, 96), (0, 96)])
def test_every_copying_kernel_compiles_with_an_l2_prefetch_hint(prefetch, head_dim):
    """The ``cp.async`` kernels (v1, v2, v2tc 16-bit and fp8, the cascade prefix kernel)
    with ``PD_L2_PREFETCH`` = 128 / 256 (``PAGED_DECODE_L2_PREFETCH``), and at head_dim 96
    with the hints the row rule picks there (64 bytes over 16-bit rows, none over fp8):
    the hinted copy's PTX meets ptxas."""
    from paged_decode.specs import prefix_spec, v1_spec, v2_spec, v2tc_spec
    d = head_dim
    cuda_compile.compile_specs({
        v1_spec("float16", "float16", "float32", d, 16),
        v2_spec("float16", "float16", "float32", d, 16, 4),
        v2tc_spec("float16", "float32", d, 16),
        v2tc_spec("float8_e4m3fn", "float32", d, 16, q_dtype="float16"),
        prefix_spec("float16", d, 16),
    }, l2_prefetch=prefetch)


def test_the_floor_script_s_kernels_compile():
    """bench/device/floor.py's own kernels (an empty launch, the plain reads, the paged
    read after the package's common source), as the script builds its module: a source
    error there would surface only on the GPU machine, after a start."""
    from test_floor_script import floor_source

    from paged_decode.kernels.common import CUDA_COMMON
    src = floor_source("SOURCE")
    cuda_compile.compile_source(src + CUDA_COMMON + floor_source("PAGED_SOURCE"))
    with pytest.raises(RuntimeError, match="failed"):      # the check can fail
        cuda_compile.compile_source(src.replace("uint4 v[U];", "uint4 v[U]"))


def test_the_tensor_core_partial_compiles_with_timeline_stamps():
    """``PD_TIMELINE`` (``PAGED_DECODE_TIMELINE=1``, bench/device/timeline.py): v2tc over
    16-bit and fp8 pools, with the fused merge, and a kernel that does not stamp (the
    merge) compile with the stamps' global and ``%globaltimer`` / ``%smid`` reads."""
    from paged_decode.specs import merge_spec, v2tc_spec
    cuda_compile.compile_specs({
        v2tc_spec("float16", "float32", 128, 16),
        v2tc_spec("float8_e4m3fn", "float32", 128, 16, q_dtype="bfloat16",
                  merged_dtype="float16"),
        merge_spec("float16", 128),
    }, timeline=True)


def test_the_timeline_setting_is_checked(monkeypatch):
    """``PD_TIMELINE`` is in the defines only when asked for; a bad value is refused."""
    from paged_decode.errors import InvalidArgumentError
    from paged_decode.specs import TIMELINE_ENV, cuda_defines
    assert not any("PD_TIMELINE" in d for d in cuda_defines())
    assert cuda_defines(128, True) == ("-DPD_L2_PREFETCH=128", "-DPD_TIMELINE=1")
    monkeypatch.setenv(TIMELINE_ENV, "1")
    assert "-DPD_TIMELINE=1" in cuda_defines()
    monkeypatch.setenv(TIMELINE_ENV, "yes")
    with pytest.raises(InvalidArgumentError, match="PAGED_DECODE_TIMELINE must be 0 or 1"):
        cuda_defines()


def test_the_l2_prefetch_setting_is_checked(monkeypatch):
    from paged_decode.errors import InvalidArgumentError
    from paged_decode.specs import (
        L2_PREFETCH,
        L2_PREFETCH_ENV,
        cuda_defines,
        l2_prefetch_bytes,
        v2_spec,
    )
    odd = v2_spec("float16", "float16", "float32", 96, 16, 1)     # 192-byte rows
    assert l2_prefetch_bytes() == L2_PREFETCH == l2_prefetch_bytes(odd)
    for size in ("0", "64", "256"):
        monkeypatch.setenv(L2_PREFETCH_ENV, size)
        assert l2_prefetch_bytes() == l2_prefetch_bytes(odd) == int(size)
        past_a_row = ("-DPD_HEADS_FIRST=1",) if size == "256" else ()   # 256 > 192
        assert cuda_defines(spec=odd) == (f"-DPD_L2_PREFETCH={size}",) + past_a_row
    monkeypatch.setenv(L2_PREFETCH_ENV, "rows")
    assert l2_prefetch_bytes() == L2_PREFETCH          # no spec: the default
    assert cuda_defines(spec=odd) == ("-DPD_L2_PREFETCH=64",)
    monkeypatch.setenv(L2_PREFETCH_ENV, "96")
    with pytest.raises(InvalidArgumentError,
                       match="PAGED_DECODE_L2_PREFETCH must be 0, 64, 128, 256 or rows, got '96'"):
        l2_prefetch_bytes()


def test_the_row_rule_hints_no_neighbouring_heads_bytes():
    """``PAGED_DECODE_L2_PREFETCH=rows``: a K/V row of ``head_dim`` elements starts at a
    multiple of its own size in the pools, so the hint is the largest of 128 and 64 that
    divides it; kernels without K/V rows keep the default."""
    from paged_decode.specs import (
        L2_PREFETCH,
        merge_spec,
        prefix_spec,
        row_l2_prefetch,
        v1_spec,
        v2_spec,
        v2tc_spec,
    )
    rows = {   # (head_dim, kv dtype) -> row bytes -> hint
        (64, "float16"): 128, (96, "float16"): 64, (128, "bfloat16"): 128,
        (256, "float16"): 128, (64, "float8_e4m3fn"): 64, (96, "float8_e5m2"): 0,
        (128, "float8_e4m3fn"): 128, (96, "float32"): 128, (32, "float16"): 64,
        (48, "float16"): 0,
    }
    for (d, kv), want in rows.items():
        q = "float16" if kv.startswith("float8") or kv == "float32" else kv
        assert row_l2_prefetch(v2_spec(q, kv, "float32", d, 16, 1)) == want, (d, kv)
        assert row_l2_prefetch(v1_spec(q, kv, "float32", d, 16)) == want, (d, kv)
    for d, kv, want in [(96, "float16", 64), (128, "float8_e4m3fn", 128),
                        (64, "float8_e4m3fn", 64), (256, "bfloat16", 128)]:
        q = None if kv == "bfloat16" or kv == "float16" else "float16"
        assert row_l2_prefetch(v2tc_spec(kv, "float32", d, 16, q_dtype=q)) == want
    assert row_l2_prefetch(prefix_spec("float16", 96, 16)) == 64
    assert row_l2_prefetch(merge_spec("float16", 96)) == L2_PREFETCH


def test_heads_first_where_the_prefetch_runs_past_a_row(monkeypatch):
    """The flat decode kernels number their CTAs head slots first exactly where the L2
    prefetch hint does not divide the K/V row (it fetches part of the next head's row),
    compiled in as ``PD_HEADS_FIRST``; other kernels never; the setting overrides it and
    is checked."""
    from paged_decode.errors import InvalidArgumentError
    from paged_decode.specs import (
        GRID_ORDER_ENV,
        L2_PREFETCH_ENV,
        cuda_defines,
        heads_first,
        merge_spec,
        prefix_spec,
        v1_spec,
        v2_spec,
        v2tc_spec,
    )
    rows = {   # (head_dim, kv dtype) -> heads first under the 128-byte default
        (64, "float16"): False, (96, "float16"): True, (128, "bfloat16"): False,
        (256, "float16"): False, (64, "float8_e4m3fn"): True, (96, "float8_e5m2"): True,
        (128, "float8_e4m3fn"): True, (128, "float8_e5m2"): True,
        (256, "float8_e4m3fn"): False, (96, "float32"): False, (32, "float16"): True,
    }
    for (d, kv), want in rows.items():
        q = "float16" if kv.startswith("float8") or kv == "float32" else kv
        spec = v2_spec(q, kv, "float32", d, 16, 1)
        assert heads_first(spec) == want, (d, kv)
        assert ("-DPD_HEADS_FIRST=1" in cuda_defines(spec=spec)) == want, (d, kv)
        assert not heads_first(v1_spec(q, kv, "float32", d, 16)), (d, kv)
        if kv != "float32" and d >= 64:
            tc = v2tc_spec(kv, "float32", d, 16, q_dtype=q)
            assert heads_first(tc) == want, (d, kv)
    f16_96 = v2_spec("float16", "float16", "float32", 96, 16, 1)
    assert not heads_first(prefix_spec("float16", 96, 16))
    assert not heads_first(merge_spec("float16", 96))
    # the hint decides: 64 bytes divide 192, none fetches nothing past a row, 256 does
    assert not heads_first(f16_96, 64) and not heads_first(f16_96, 0)
    assert heads_first(v2_spec("float16", "float16", "float32", 64, 16, 1), 256)
    monkeypatch.setenv(L2_PREFETCH_ENV, "rows")
    assert not heads_first(f16_96)
    monkeypatch.delenv(L2_PREFETCH_ENV)
    monkeypatch.setenv(GRID_ORDER_ENV, "chunks")
    assert not heads_first(f16_96)
    assert "-DPD_HEADS_FIRST=1" not in cuda_defines(spec=f16_96)
    monkeypatch.setenv(GRID_ORDER_ENV, "heads")
    assert heads_first(v2_spec("float16", "float16", "float32", 128, 16, 1))
    assert not heads_first(merge_spec("float16", 96))
    monkeypatch.setenv(GRID_ORDER_ENV, "rows")
    with pytest.raises(InvalidArgumentError, match=f"{GRID_ORDER_ENV} must be heads or "
                                                   "chunks, got 'rows'"):
        heads_first(f16_96)


def test_the_row_hint_where_a_plan_streams_long_past_a_16_bit_row(monkeypatch):
    """``row_hint_pays``: only the flat partials over 16-bit rows the 128-byte hint
    overruns (head_dim 96): the v2 partial from ``ROW_HINT_V2_CTAS`` CTAs, or from half
    as many with chunks of ``ROW_HINT_TOKENS`` tokens, the tensor-core one from chunks of
    ``ROW_HINT_TC_TOKENS`` tokens or where v2's holds with chunks of
    ``ROW_HINT_TC_MIN_TOKENS``; a spec made with it
    hints ``row_l2_prefetch`` bytes (64 over 192-byte rows), numbers chunks first, has
    its own name, and the setting still overrides it."""
    from paged_decode.specs import (
        L2_PREFETCH,
        L2_PREFETCH_ENV,
        ROW_HINT_TC_MIN_TOKENS,
        ROW_HINT_TC_TOKENS,
        ROW_HINT_TOKENS,
        ROW_HINT_V2_CTAS,
        cuda_defines,
        heads_first,
        l2_prefetch_bytes,
        row_hint_pays,
        v2_spec,
        v2tc_spec,
    )
    big, long = ROW_HINT_V2_CTAS, ROW_HINT_TOKENS
    for kv in ("float16", "bfloat16"):
        assert row_hint_pays("v2", kv, 96, ctas=big, chunk_tokens=0)
        assert not row_hint_pays("v2", kv, 96, ctas=big - 1, chunk_tokens=long - 1)
        assert row_hint_pays("v2", kv, 96, ctas=big // 2, chunk_tokens=long)
        assert not row_hint_pays("v2", kv, 96, ctas=big // 2 - 1, chunk_tokens=1 << 20)
        assert row_hint_pays("v2tc", kv, 96, ctas=1, chunk_tokens=ROW_HINT_TC_TOKENS)
        short = ROW_HINT_TC_MIN_TOKENS
        assert row_hint_pays("v2tc", kv, 96, ctas=big, chunk_tokens=short)
        assert not row_hint_pays("v2tc", kv, 96, ctas=1 << 20, chunk_tokens=short - 1)
        assert not row_hint_pays("v2tc", kv, 96, ctas=big - 1, chunk_tokens=long - 1)
        assert row_hint_pays("v2tc", kv, 96, ctas=big // 2, chunk_tokens=long)
        assert not row_hint_pays("v2tc", kv, 96, ctas=big // 2 - 1,
                                 chunk_tokens=ROW_HINT_TC_TOKENS - 1)
        for d in (64, 128, 256):        # rows the hint divides
            assert not row_hint_pays("v2", kv, d, ctas=1 << 20, chunk_tokens=1 << 20)
            assert not row_hint_pays("v2tc", kv, d, ctas=1 << 20, chunk_tokens=1 << 20)
    for kv in ("float8_e4m3fn", "float8_e5m2", "float32"):
        for d in (64, 96, 128):
            assert not row_hint_pays("v2", kv, d, ctas=1 << 20, chunk_tokens=1 << 20)
    for kernel in ("v1", "merge", "prefix"):
        assert not row_hint_pays(kernel, "float16", 96, ctas=1 << 20, chunk_tokens=1 << 20)
    plain = v2_spec("float16", "float16", "float32", 96, 16, 1)
    hinted = v2_spec("float16", "float16", "float32", 96, 16, 1, row_hint=True)
    tc = v2tc_spec("bfloat16", "float32", 96, 16, row_hint=True)
    assert l2_prefetch_bytes(plain) == L2_PREFETCH == 128 and heads_first(plain)
    for spec in (hinted, tc):
        assert l2_prefetch_bytes(spec) == 64 and not heads_first(spec)
        assert spec.uri.endswith("_l2row")
        assert "-DPD_L2_PREFETCH=64" in cuda_defines(spec=spec)
        assert "-DPD_HEADS_FIRST=1" not in cuda_defines(spec=spec)
    assert hinted.uri != plain.uri
    monkeypatch.setenv(L2_PREFETCH_ENV, "128")
    assert l2_prefetch_bytes(hinted) == 128 and heads_first(hinted)
    # every specialization a decode can compile is listed, hinted ones included
    specs_96 = decode_specs("float16", "float16", "float16", 32, 32, 96, 16)
    assert {s.kernel for s in specs_96 if s.row_hint} == {"v2", "v2tc"}
    assert not any(s.row_hint for s in decode_specs("float16", "float16", "float16", 32, 8,
                                                     128, 16))


@pytest.mark.parametrize("metal", [False, True])
def test_the_launches_take_the_row_hint_from_their_plan(metal):
    """The v2 / v2tc launches ask ``row_hint_pays`` with the plan's CTAs and chunk tokens
    (Phi-3-mini's heads, 32 / 32 x 96); the Metal dialect never (no L2 hint there)."""
    import paged_decode as pd
    from paged_decode.backends.launches import partial_launch, v2tc_launch
    from paged_decode.device import DeviceInfo
    from paged_decode.page_table import PageTable

    def launches(batch: int, tokens: int, ppc: int):
        pages = tokens // 16
        table = PageTable.build(np.arange(batch * pages), np.arange(batch + 1) * pages,
                                [16] * batch, page_size=16, num_pages=batch * pages)
        plan = pd.plan_decode(table, 32, 32, 96, device=DeviceInfo("cuda", "sm_90", 132, 2),
                              pages_per_chunk=ppc)
        a = np.zeros(1, np.float32)
        common = dict(plan=plan, sm_scale=0.1, q=a, k_pages=np.zeros((batch * pages, 1)),
                      v_pages=a, table=(a,) * 4, request_indices=a, kv_tile_indices=a,
                      v_out=a, lse_out=a, metal=metal)
        return (partial_launch(dtypes=("float16",) * 3, **common).spec,
                v2tc_launch(kv_dtype="float16", out_dtype="float32", **common).spec)

    on = not metal
    for batch, tokens, ppc, want_v2, want_tc in (
            (16, 4096, 256, False, False),      # 512 CTAs of 4K tokens
            (32, 4096, 256, on, False),         # 1024 CTAs of 4K tokens
            (16, 8192, 512, False, False),      # 512 CTAs of 8K tokens
            (32, 8192, 512, on, on),            # 1024 CTAs of 8K tokens
            (16, 16384, 1024, on, on),          # 512 CTAs of 16K tokens
            (8, 32768, 2048, False, on),        # 256 CTAs of 32K tokens
            (8, 32768, 1024, on, on),           # 512 CTAs of 16K tokens
            (8, 16384, 1024, False, False)):    # 256 CTAs of 16K tokens
        v2, tc = launches(batch, tokens, ppc)
        assert (v2.row_hint, tc.row_hint) == (want_v2, want_tc), (batch, tokens, ppc)


def test_an_unknown_hint_size_does_not_compile():
    from paged_decode.kernels.common import CUDA_COMMON
    cuda_compile.compile_source(CUDA_COMMON, defines=("-DPD_L2_PREFETCH=64",))
    with pytest.raises(RuntimeError, match="PD_L2_PREFETCH must be 0, 64, 128 or 256"):
        cuda_compile.compile_source(CUDA_COMMON, defines=("-DPD_L2_PREFETCH=96",))


def test_the_sources_default_l2_prefetch_is_the_hosts():
    """A compile without ``-DPD_L2_PREFETCH`` (the emulator, a tool) hints what the host
    passes by default."""
    import re

    from paged_decode.kernels.common import CUDA_COMMON
    from paged_decode.specs import L2_PREFETCH
    got = re.search(r"#define PD_L2_PREFETCH (\d+)", CUDA_COMMON)
    assert got is not None and int(got.group(1)) == L2_PREFETCH


def test_the_split_merge_the_rule_picks_compiles_at_wide_heads():
    """The merge alone takes any head_dim that is a multiple of 4: the split the rule picks
    for a batch-1 merge of 256 partials per head must fit the 48 KB of static shared
    memory ptxas allows (16 warps at 768 would take 49344 bytes and fail to build), and
    the split one step wider must not (the bound is the limit, not a guess)."""
    from paged_decode.backends.launches import merge_split
    from paged_decode.kernels.merge import STATIC_SMEM_LIMIT, split_smem_bytes
    from paged_decode.specs import merge_spec
    for d in (764, 768, 1024):
        split = merge_split(1, 8, 256, 132, d)
        assert split_smem_bytes(d, split) <= STATIC_SMEM_LIMIT < split_smem_bytes(d, 2 * split)
        cuda_compile.compile_specs({merge_spec("float32", d, split=split)})
    with pytest.raises(RuntimeError, match=r"too much shared data"):
        cuda_compile.compile_specs({merge_spec("float32", 768, split=16)})


#: an sm_90 SM (H100, H200): shared memory and 32-bit registers
SM90_SHARED_MEM = 233472
SM90_REGISTERS = 65536


def ctas_by_registers(regs: int, warps: int) -> int:
    """CTAs of ``warps`` warps one sm_90 SM holds by registers (a warp's are allocated in
    units of 256: 8 per thread)."""
    return SM90_REGISTERS // (-(-regs // 8) * 8 * 32) // warps


def spill_is_an_occupancy_trade(regs: int, spill: int, warps: int) -> bool:
    """No spill, or a small one (16 bytes at most) at exactly the most registers that
    some number of CTAs can have: ptxas capping itself to keep that many CTAs per SM
    (the prefix kernel at head_dim 64: 128 registers, 4 CTAs, 8 bytes)."""
    steps = {SM90_REGISTERS // (k * warps * 32) // 8 * 8 for k in range(1, 17)}
    return spill == 0 or (spill <= 16 and regs in steps)


@pytest.mark.parametrize("kv", ["float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_v2tc_registers_allow_what_the_ring_allows(kv, head_dim):
    """Over 16-bit pools the wave rule plans the tensor-core partial for as many CTAs
    per SM as its ring leaves room for (``specs.v2tc_slots_per_unit``), assuming its
    registers allow at least that many: ptxas's count for each specialization (plain and
    with the fused merge) must (over fp8 pools the registers bind first: 4 CTAs at
    head_dim 128 where the ring holds 5; the wave rule is not used there). No
    specialization may spill, except as ptxas's trade for a CTA per SM
    (``spill_is_an_occupancy_trade``). A compile fact of this machine's compiler (the
    device's may differ), checked here so that a kernel edit that costs registers shows
    before a GPU run times it."""
    from paged_decode.device import DeviceInfo
    from paged_decode.specs import v2tc_slots_per_unit, v2tc_spec, v2tc_warps
    q = "bfloat16" if kv == "bfloat16" else "float16"
    dev = DeviceInfo("cuda", "sm_90", 132, 2, shared_mem_per_unit=SM90_SHARED_MEM)
    slots, warps = v2tc_slots_per_unit(head_dim, kv, dev), v2tc_warps(head_dim, kv)
    for merged in ("", q):
        spec = v2tc_spec(kv, "float32" if merged else q, head_dim, 16, q_dtype=q,
                         merged_dtype=merged)
        regs, spill = cuda_compile.register_usage(spec)
        ctas = ctas_by_registers(regs, warps)
        assert spill_is_an_occupancy_trade(regs, spill, warps), (
            f"{spec.uri}: {spill} bytes of spill stores at {regs} registers")
        assert kv.startswith("float8") or ctas >= slots, (
            f"{spec.uri}: {regs} registers allow {ctas} CTAs per SM, the ring {slots}")


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_prefix_registers_allow_what_its_shared_memory_allows(head_dim):
    """Cascade plans level 0 for ``prefix_tc.ctas_per_sm`` CTAs per SM (its shared
    memory's count, at most 4): ptxas's registers must allow as many, and spill nothing
    but ptxas's trade for a CTA (at head_dim 64 NVRTC 13.0 keeps it at 128 registers, 4
    CTAs, with an 8-byte spill)."""
    from paged_decode.kernels import prefix_tc
    from paged_decode.specs import prefix_spec
    want = prefix_tc.ctas_per_sm(head_dim, SM90_SHARED_MEM)
    for kv in ("float16", "bfloat16"):
        spec = prefix_spec(kv, head_dim, 16)
        regs, spill = cuda_compile.register_usage(spec)
        ctas = ctas_by_registers(regs, prefix_tc.NUM_WARPS)
        assert spill_is_an_occupancy_trade(regs, spill, prefix_tc.NUM_WARPS), (
            f"{spec.uri}: {spill} bytes of spill stores at {regs} registers")
        assert ctas >= want, f"{spec.uri}: {regs} registers allow {ctas} CTAs per SM, want {want}"


def test_a_spill_counts_as_a_trade_only_at_an_occupancy_step():
    # 4 warps: 96 registers is the most 5 CTAs can have, 128 the most for 4, 168 for 3
    assert spill_is_an_occupancy_trade(100, 0, 4)
    assert spill_is_an_occupancy_trade(96, 4, 4) and spill_is_an_occupancy_trade(128, 8, 4)
    assert spill_is_an_occupancy_trade(168, 16, 4)
    assert not spill_is_an_occupancy_trade(120, 4, 4)        # nothing kept by spilling
    assert not spill_is_an_occupancy_trade(128, 20, 4)       # too much to call a trade
    assert ctas_by_registers(96, 4) == 5 and ctas_by_registers(97, 4) == 4
    assert ctas_by_registers(128, 4) == 4 and ctas_by_registers(233, 4) == 2


# ------------------------------------------- grid_cell costs no code (chunks first)
_CELL_BLOCK = re.compile(r"const (?:pd::)?GridCell cell = (?:pd::)?grid_cell\([^\n]*\);\n"
                         r"\s*const int c = [^\n]*;\n")


def _blockidx_source(src: str, per_head: str, second: str) -> str:
    """``src`` with the partial's ``pd::grid_cell`` lines (however the cell divides the
    slot) replaced by blockIdx read directly, as the kernels did before the CTA order
    became a define (c385e9d): the reference code. ``per_head``: the kernel's slots per
    KV head (``row_tiles``, ``q_groups``); ``second``: its name for the slot's remainder."""
    out, n = _CELL_BLOCK.subn(
        f"const int c = blockIdx.x;\n  const int kvh = blockIdx.y / {per_head}, "
        f"{second} = blockIdx.y % {per_head};\n", src)
    assert n == 1, "the kernel's grid_cell lines changed: update _CELL_BLOCK"
    return out.replace("cell.slot", "blockIdx.y")


def _text_size(tmp_path, src: str, spec) -> int:
    from paged_decode.specs import cuda_defines
    path = tmp_path / "k.cubin"
    cuda_compile.compile_source(src, [spec.cuda_name_expression()], None,
                                cuda_defines(spec=spec), cubin_path=str(path))
    data = path.read_bytes()
    names = set(re.findall(rb"\.text\.(_Z\w+)", data))
    assert len(names) == 1, names
    return cuda_compile.text_bytes(data, names.pop().decode())


@pytest.mark.parametrize("which", ["v2tc-fused-merge", "v2tc", "v2-gqa8"])
def test_grid_cell_compiles_to_the_code_blockidx_did(tmp_path, which):
    """Chunks first, a CTA's (chunk, slot) is blockIdx, and ptxas must emit the same amount
    of code as for blockIdx read directly. With GridCell's fields signed (int) the kernels
    divided the slot signed, and ptxas emitted 296 more SASS instructions for the
    tensor-core partial with its fused merge (3872 against 3576 under NVRTC 13.0: index
    arithmetic in its prologue, copies and merge), 3 more in its token loop at head_dim 64.
    Timed against the unsigned form in one run the two were level (S37-R1, H100,
    docs/benchmarks/gpu-2026-12-06-s37.md), so this guards code size, not a measured
    slowdown."""
    from paged_decode.specs import heads_per_cta, v2_spec, v2tc_spec
    spec = {"v2tc-fused-merge": v2tc_spec("float16", "float32", 128, 16,
                                          merged_dtype="float16"),
            "v2tc": v2tc_spec("float16", "float16", 64, 16),
            "v2-gqa8": v2_spec("float16", "float16", "float32", 128, 16,
                               heads_per_cta(64, 8))}[which]
    src = cuda_compile.cuda_source(spec.kernel)    # the mutants' hook (tests/mutants.py)
    names = ("row_tiles", "rt") if spec.kernel == "v2tc" else ("q_groups", "qg")
    assert _text_size(tmp_path, src, spec) == _text_size(
        tmp_path, _blockidx_source(src, *names), spec)
