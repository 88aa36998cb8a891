"""What the test modules share that is not a fixture: the one place that defines
numerical tolerances, the oracle comparison, the one hand-built table, the MLX guard and
the mutant check. Test modules import from here rather than from ``conftest.py``, which
keeps only pytest hooks and fixtures (pytest loads it as a plugin, not as a module of ours).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import paged_decode as pd
from paged_decode import PageTable
from paged_decode.backends import availability
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.emulator import KernelFault, RaceError
from paged_decode.problems import make_problem
from paged_decode.reference import lse_error, max_rel_error, oracle_decode, row_rel_error

# ---------------------------------------------------------------------------- tolerances
#: max relative error of the output (``max|got - ref| / max|ref|``) against the float64
#: oracle, keyed by the *output* dtype: the reference backend accumulates in float32 and
#: the oracle sees the same (already rounded) inputs, so the error is float32 arithmetic
#: plus rounding the result to the output dtype (half an ulp: 4.9e-4 for float16, 3.9e-3
#: for bfloat16). Worst measured over the curated cases, the fuzz and a context <= 1000
#: sweep: float32 2.6e-6, float16 4.6e-4, bfloat16 3.8e-3. Bounds keep ~2.5-4x above
#: those (run with ``-v`` to print this session's worst errors).
OUT_RTOL = {
    "float32": 1e-5,
    "float16": 2e-3,
    "bfloat16": 1e-2,
}
#: the tensor-core kernels (cascade's prefix kernel, the v2tc partial) round the softmax
#: weights to the pools' 16-bit dtype before P V (mma operands are 16-bit; the row sums
#: and the LSE stay float32), so even a float32 output carries an error of that dtype's
#: rounding. Keyed by the pool dtype; worst measured (emulator and H200): see
#: test_prefix_tc.py; v2tc on the emulator: see test_v2tc.py.
PREFIX_RTOL = {
    "float16": 2e-3,
    "bfloat16": 1e-2,
}
#: max absolute error of the base-2 LSE (float32, so it scales with |LSE|: ~1e-5 at
#: |LSE| ~ 100 with sm_scale = 2 in the fuzz; ~2e-6 at the default scale).
LSE_ATOL = 5e-5


def fp8_out_tol(out_dtype: str) -> float:
    """Output max-rel tolerance of a decode over fp8 pools against the float64 oracle on
    the *dequantized* values (``oracle_decode(..., k_scale=, v_scale=)``): the kernels
    read the same stored values exactly (every fp8 value is a float32) and apply the
    scales as two more float32 roundings (``k_scale`` folded into the softmax scale,
    ``v_scale`` times the normalized output: 2 x 2^-24 relative), so the bound is the
    float16-level one of ``OUT_RTOL`` for the output dtype. The error fp8 storage adds
    against float16 K/V (quantization, not arithmetic) is measured in docs/fp8.md."""
    return OUT_RTOL[out_dtype] + 2 * 2.0 ** -24


def f32_accumulation_tol(tokens: int) -> float:
    """Max-rel bound on a float32 output accumulated in float32 over ``tokens`` tokens,
    whatever the K/V dtype (the oracle reads the same rounded inputs in float64): a
    random walk of 2^-24 per addition, 4 sigma (3.1e-5 at 16K tokens; measured 2-4e-7 on
    the emulated kernels). An accumulator held in a 16-bit type errs by 2^-11 (float16)
    or 2^-8 (bfloat16) per addition instead: 5e-4 and more at 16K."""
    return 4 * 2.0 ** -24 * math.sqrt(tokens)


def tc_out_tol(kv_dtype: str, out_dtype: str) -> float:
    """Output max-rel tolerance of a tensor-core kernel: its pools' rounding of the softmax
    weights (``PREFIX_RTOL``) or the output dtype's, whichever is larger."""
    return max(PREFIX_RTOL[kv_dtype], OUT_RTOL[out_dtype])


def path_out_tol(path: str, kv_dtype: str, out_dtype: str) -> float:
    """Output max-rel tolerance of a call that ran ``path`` (``last_outcome().path``, e.g.
    ``"v2tc+merge"``): ``tc_out_tol`` for the tensor-core partial, ``out_tol`` otherwise.
    For ``path="auto"`` calls, whose partial the device's crossover table picks."""
    return tc_out_tol(kv_dtype, out_dtype) if path.startswith("v2tc") else out_tol(out_dtype)


#: unit roundoff (half an ulp at 1) of each float type
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}


def f32_dot_bound(abs_terms: np.ndarray, n: int, out_dtype: str = "float32",
                  result=None) -> np.ndarray:
    """Elementwise bound on ``|computed - exact|`` of a sum of ``n`` products (plus an
    addend) accumulated in float32 with one rounding per step (fused multiply-adds),
    then rounded to ``out_dtype``: ``gamma_n * abs_terms`` with ``gamma_n = n u / (1 -
    n u)``, ``u = 2^-24`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
    3.1), plus half an ulp of ``out_dtype`` at ``|result|``. ``abs_terms``: the sum of
    the terms' magnitudes (``|c| + sum_k |a_k b_k|``)."""
    u = UNIT_ROUNDOFF["float32"]
    bound = n * u / (1 - n * u) * np.asarray(abs_terms, np.float64)
    if out_dtype != "float32":
        bound = bound + UNIT_ROUNDOFF[out_dtype] * np.abs(np.asarray(result, np.float64))
    return bound


def out_tol(dtype: str) -> float:
    """Output max-rel tolerance for an output of ``dtype`` (canonical name)."""
    return OUT_RTOL[dtype]


def assert_matches_oracle(out, lse, ref_out, ref_lse, out_dtype: str, what: str = "",
                          tol: float | None = None) -> None:
    """Output and (optionally) LSE agree with the float64 oracle within tolerance
    (``tol``, default ``out_tol(out_dtype)``), every output row ``[..., D]`` against its
    own scale (``reference.row_rel_error``).

    ``lse=None`` skips the LSE comparison (for calls made without ``return_lse``).
    Empty requests must be exactly 0 / ``-inf`` (``lse_error`` is ``inf`` otherwise).
    """
    out = np.asarray(out)
    assert np.isfinite(out.astype(np.float64)).all(), f"{what}: non-finite output"
    err = row_rel_error(out, ref_out)       # each (request, head) row on its own scale
    bound = out_tol(out_dtype) if tol is None else tol
    _note(out_dtype if tol is None else f"{out_dtype} (tensor cores)", err)
    assert err <= bound, f"{what}: out max-rel error {err:.3e} > {bound}"
    if lse is not None:
        lerr = lse_error(lse, ref_lse)
        _note("lse", lerr)
        assert lerr <= LSE_ATOL, f"{what}: lse abs error {lerr:.3e} > {LSE_ATOL}"


#: worst errors seen this session (printed at the end with ``-rA`` or on ``-v``), so the
#: tolerances above can be re-measured whenever the arithmetic changes
WORST: dict[str, float] = {}


def _note(key: str, err: float) -> None:
    WORST[key] = max(WORST.get(key, 0.0), err)


# ---------------------------------------------------------------------------- tables
def table_of(pages=None, page_size: int = 16, *, lengths=None, ids=None, lpl=None, fpo=None,
             rope=None, num_pages=None, spare_pages: int | None = None) -> PageTable:
    """The tests' one hand-built page table (``problems.make_table`` builds random ones).

    ``pages[r]`` is request r's list of page ids, or a page count: the next that many of
    ``ids`` (default ``0, 1, 2, ...``, pages in logical order). With ``lengths`` instead,
    request r holds ``lengths[r]`` visible tokens after ``fpo[r]`` retired ones, in as many
    pages as that takes. ``lpl`` defaults to full last pages (or what ``lengths`` leaves);
    ``fpo``, ``rope`` and ``num_pages`` (or listed pages + ``spare_pages``) go to
    ``PageTable.build`` as given, so invalid values reach its validation.
    """
    p = page_size
    if lengths is not None:
        off = [0] * len(lengths) if fpo is None else [int(f) for f in fpo]
        pages = [-(-(n + f) // p) if n + f else 0 for n, f in zip(lengths, off)]
        lpl = [(n + f) - (c - 1) * p if c else 0 for n, f, c in zip(lengths, off, pages)]
    counts = [int(x) if isinstance(x, (int, np.integer)) else len(x) for x in pages]
    pool = np.arange(sum(counts)) if ids is None else np.asarray(ids)
    lists, taken = [], 0
    for x, c in zip(pages, counts):
        if isinstance(x, (int, np.integer)):
            lists.append(pool[taken:taken + c])
            taken += c
        else:
            lists.append(np.asarray(x, np.int64))
    indices = np.concatenate(lists).astype(np.int64) if lists else np.zeros(0, np.int64)
    if lpl is None:
        lpl = [p if c else 0 for c in counts]
    if spare_pages is not None:
        num_pages = len(indices) + spare_pages
    return PageTable.build(indices, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                           lpl, page_size=p, first_page_offset=fpo, rope_positions=rope,
                           num_pages=num_pages)


def relabel(table: PageTable, ids=None, num_pages: int | None = None) -> PageTable:
    """``table``'s requests over other page ids (default ``0, 1, 2, ...``: each request's
    pages read in logical order, the broken read of the negative controls) in a pool of
    ``num_pages`` (default unknown: the old bound need not hold for the new ids)."""
    return table_of(table.pages_per_request.tolist(), table.page_size, ids=ids,
                    lpl=table.last_page_len, fpo=table.first_page_offset,
                    rope=table.rope_positions, num_pages=num_pages)


class IgnoresIndices(ReferenceBackend):
    """A broken partial (the negative control of the paging tests): reads each request's
    pages in logical order, as if ``indices`` were ``arange``."""

    name = "ignores-indices"

    def partial(self, q, k_pages, v_pages, table, plan, sm_scale, v_out, lse_out):
        super().partial(q, k_pages, v_pages, relabel(table), plan, sm_scale, v_out, lse_out)


def assert_import_adds_none_of(module: str, banned: set[str]) -> None:
    """Importing ``module`` (in a fresh interpreter, after ``paged_decode``) loads none of
    the top-level packages ``banned`` (optional heavy stacks stay lazy)."""
    import subprocess
    import sys
    code = ("import sys, paged_decode, paged_decode.page_table, numpy\n"
            "before = set(sys.modules)\n"
            f"import {module}\n"
            "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
            f"assert not new & set({sorted(banned)!r}), new\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def needs_backend(name: str) -> pytest.MarkDecorator:
    """A module's ``pytestmark``: skip cleanly where backend ``name`` is unavailable,
    saying why."""
    got = availability(name)
    return pytest.mark.skipif(not got.ok, reason=f"{name} unavailable: {got.reason}")


def take_and_repoison(out, lse):
    """CuPy ``out`` / ``lse`` as numpy after the current stream has finished, then filled
    with NaN again, so the next call must write every element."""
    import cupy as cp
    cp.cuda.get_current_stream().synchronize()
    got = cp.asnumpy(out), cp.asnumpy(lse)
    out.fill(np.nan)
    lse.fill(np.nan)
    return got


def require_mlx():
    """``mlx.core``, or skip the calling test module with the reason: MLX missing, or
    installed but not loadable (a Linux ``pip install '.[metal]'`` whose ``libmlx.so`` is
    missing raises ``ImportError`` or ``OSError``, which ``importorskip`` lets through)."""
    try:
        import mlx.core as mx
    except (ImportError, OSError) as exc:
        pytest.skip(f"mlx.core cannot be imported ({type(exc).__name__}: {exc})",
                    allow_module_level=True)
    return mx


def mutant_fails(be, spec, path: str = "v2", ppc: int | None = None) -> str:
    """Why a decode of a fresh ``spec`` problem on ``be`` (a backend running a mutated
    kernel) fails: the emulator's fault or race report, or the error off the float64
    oracle when above 0.1; ``""`` when it passes. A compile error is not a detection and
    propagates."""
    pr = make_problem(spec)
    ref, _ = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    plan = pd.plan_decode(pr.table, spec.num_qo_heads, spec.num_kv_heads, spec.head_dim,
                          device=be.device_info(), pages_per_chunk=ppc)
    try:
        out = pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, plan, path=path,
                        out_dtype="float32", backend=be)
    except (KernelFault, RaceError) as exc:
        return str(exc)
    err = max_rel_error(out, ref)
    return f"error {err:.3g}" if err > 0.1 else ""


# ---------------------------------------------------------------------------- generation
def ragged_prompts(vocab: int, seed: int, prefix: int = 40,
                   tails: tuple[int, ...] = (5, 17, 1, 30)) -> list[list[int]]:
    """A batch of ragged prompts sharing a ``prefix``-token system prompt (its first two
    pages at page size 16 are shared after the fork), one tail length each."""
    g = np.random.default_rng(seed)
    head = g.integers(0, vocab, prefix).tolist()
    return [head + g.integers(0, vocab, n).tolist() for n in tails]


def assert_same_greedy(ref_tokens, ref_logits, got_tokens, got_logits,
                       min_distinct: int = 16, floor: float | None = None) -> None:
    """Greedy generation through paged-decode chose exactly the framework's tokens, and
    no tie could have decided it: at every step the two runs' logits (``[steps, B, V]``)
    differ by less than half the framework's smallest top-1 / top-2 gap, so each argmax
    is the same whatever the rounding (a near tie fails here, loudly: pick another seed,
    never a looser check). The run must also be non-degenerate (many distinct tokens).

    ``floor``: how far the framework's own logits move when only the batch layout
    changes (the same prompts run one at a time; deep float32 models move by about the
    smallest gap). Given, the logits must instead differ by at most 1.5x that floor:
    paged-decode moves them no more than the framework's own batching does."""
    ref_logits, got_logits = np.asarray(ref_logits), np.asarray(got_logits)
    assert got_tokens == ref_tokens
    top = np.sort(ref_logits, axis=-1)[..., -2:]
    margin = float((top[..., 1] - top[..., 0]).min())
    dev = float(np.abs(ref_logits - got_logits).max())
    if floor is None:
        assert dev < margin / 2, f"logits differ by {dev:.3g}, smallest top-2 gap {margin:.3g}"
    else:
        assert dev <= 1.5 * floor, (f"logits differ by {dev:.3g}, the framework's own batch "
                                    f"layout moves them by {floor:.3g}")
    distinct = len({t for row in ref_tokens for t in row})
    assert distinct >= min_distinct, f"{distinct} distinct tokens: a degenerate run proves little"


def tc_fp8_out_tol(q_dtype: str, out_dtype: str) -> float:
    """Output max-rel tolerance of the tensor-core partial over fp8 pools against the
    float64 oracle on the dequantized values: the codes widen exactly into q's dtype, so
    it is ``tc_out_tol`` of q's dtype (the mma's rounding of the softmax weights) plus the
    two float32 roundings of the scales (``fp8_out_tol``)."""
    return tc_out_tol(q_dtype, out_dtype) + 2 * 2.0 ** -24


#: decode variants by test id (the variant tests of every path): windows smaller than a
#: page, crossing pages, of 0 and longer than every context; the cap alone; the sinks
#: alone; all three. ``"sinks": True`` stands for per-head sinks (``variant_kwargs``).
VARIANTS: dict[str, dict] = {
    "w5": {"window_left": 5},
    "w37": {"window_left": 37},
    "w0": {"window_left": 0},
    "w9999": {"window_left": 9999},
    "cap": {"logits_soft_cap": 1.5},
    "sinks": {"sinks": True},
    "all": {"window_left": 21, "logits_soft_cap": 2.0, "sinks": True},
}


def variant_kwargs(variant: dict, hq: int, seed: int = 3) -> dict:
    """A variant table's entry as ``decode``'s keywords: ``"sinks": True`` becomes
    ``sinks_for(hq, seed)`` (host float32 ``[hq]``)."""
    kw = dict(variant)
    if kw.get("sinks"):
        kw["sinks"] = sinks_for(hq, seed)
    return kw


def sinks_for(hq: int, seed: int = 3) -> np.ndarray:
    """``[hq]`` float32 attention sinks around the scores' scale (|s| ~ 1-3), so each takes
    a visible share of the softmax weight (natural-log units)."""
    return (np.random.default_rng(seed).standard_normal(hq) * 2).astype(np.float32)


def run_step(step, body, graph, captured: bool):
    """One step of ``body(step)`` after ``step.begin()``: eager, or through a captured
    step (captured again when it is missing or stale). Returns the captured step."""
    if not captured:
        body(step)
    elif graph is None or graph.stale:
        graph = step.capture(body)
    else:
        graph.replay()
    return graph


def ref_merge(v: np.ndarray, lse: np.ndarray, indptr) -> tuple[np.ndarray, np.ndarray]:
    """float64 closed form, one (group, head) at a time; base-2 LSE. A NaN or +inf partial
    LSE poisons its group (NaN output and LSE); -inf partials carry no weight."""
    m = len(indptr) - 1
    out = np.zeros((m, v.shape[1], v.shape[2]))
    out_lse = np.full((m, v.shape[1]), -np.inf)
    for o in range(m):
        for h in range(v.shape[1]):
            group = [float(lse[i, h]) for i in range(indptr[o], indptr[o + 1])]
            if any(math.isnan(x) or x == math.inf for x in group):
                out[o, h], out_lse[o, h] = np.nan, np.nan
                continue
            rows = [i for i in range(indptr[o], indptr[o + 1]) if np.isfinite(lse[i, h])]
            if not rows:
                continue
            mx = max(float(lse[i, h]) for i in rows)
            w = [2.0 ** (float(lse[i, h]) - mx) for i in rows]
            out[o, h] = sum(wi * v[i, h].astype(np.float64) for wi, i in zip(w, rows)) / sum(w)
            out_lse[o, h] = mx + math.log2(sum(w))
    return out, out_lse


def assert_same_bits(a, b, what):
    """``a`` and ``b``, each an (out, lse) pair of arrays ``[B, Hq, ...]``, are equal bit
    for bit (NaN where NaN); a failure names the mismatching (request, head) rows."""
    for x, y, name in ((a[0], b[0], "out"), (a[1], b[1], "lse")):
        if not np.array_equal(x, y, equal_nan=True):
            bad = ~((x == y) | (np.isnan(x) & np.isnan(y)))
            rows = np.argwhere(bad.reshape(*bad.shape[:2], -1).any(axis=-1))
            np.testing.assert_array_equal(x, y, err_msg=f"{what}: {name} differs at (request, "
                                                        f"head) {rows[:12].tolist()}")


def spy_specs(monkeypatch, be):
    """The list that collects the ``KernelSpec`` of every launch ``be`` runs from now on
    (its ``_run`` wrapped through ``monkeypatch``, undone with it). On the instance, not
    the class: an older pytest's undo of an instance patch leaves the original bound
    method in the instance's ``__dict__``, where it hides a patch of the class (the GPU
    machine's full run, S36-R5)."""
    seen = []
    real = be._run

    def spy(launch):
        seen.append(launch.spec)
        return real(launch)

    monkeypatch.setattr(be, "_run", spy)
    return seen
