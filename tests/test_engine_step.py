"""The engine step (``DecodeStep``): begin / append / decode for every layer, eager and
captured, against the float64 oracle on the host table of every step.

On the CPU the "captured" replay of ``emulated-cuda`` replays its recorded launches and
device copies (``Backend.capture_graph``, a model of a CUDA graph); elsewhere it re-runs
the body. The CUDA graph itself is exercised in tests/test_cuda_graphs.py and
tests/test_engine_step_gpu.py on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, require_mlx, run_step

import paged_decode as pd
from paged_decode.errors import InvalidArgumentError, InvalidDtypeError
from paged_decode.reference import oracle_decode

BACKENDS = ["reference", "emulated-cuda", "emulated-metal"]
L, HKV, D, HQ, P = 2, 2, 64, 8, 4


def _setup(backend, rng, capacity=6, headroom=4):
    pool = pd.PagePool(96, P, HKV, D, "float32", num_layers=L, backend=backend)
    seqs = [pool.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, [5, 1, 10]):
        x = rng.standard_normal((L, n, HKV, D)).astype(np.float32)
        pool.append(s, x, x)
    fork = pool.fork(seqs[2])           # shares a partial last page: copy-on-write
    step = pd.DecodeStep(pool, [*seqs, fork], num_qo_heads=HQ, capacity=capacity,
                         headroom=headroom)
    return pool, step


def _oracle(pool, step, layer, q):
    k, v = pool.layer(layer)
    return oracle_decode(q, np.asarray(k), np.asarray(v), step.table.page_table())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_steps_match_the_oracle_through_replans(backend, captured, monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    rng = np.random.default_rng(1)
    pool, step = _setup(backend, rng)
    cap = step.capacity
    q = [np.empty((cap, HQ, D), np.float32) for _ in range(L)]
    ks = [np.empty((cap, HKV, D), np.float32) for _ in range(L)]
    outs = [np.full((cap, HQ, D), np.nan, np.float32) for _ in range(L)]

    def body(st):
        for layer in range(L):
            st.append(layer, ks[layer], ks[layer])
            st.decode(layer, q[layer], out=outs[layer])

    graph = None
    for it in range(10):
        for layer in range(L):
            q[layer][...] = rng.standard_normal((cap, HQ, D))
            ks[layer][...] = rng.standard_normal((cap, HKV, D))
        step.begin()
        graph = run_step(step, body, graph, captured)
        for layer in range(L):
            want, _ = _oracle(pool, step, layer, q[layer])
            assert_matches_oracle(outs[layer], None, want, None, "float32",
                                  f"step {it} layer {layer}")
    assert step.replans >= 1 and step.steps == 10     # headroom 4 over 10 steps
    lens = [pool.seq_len(int(s)) for s in step.sequences[:4]]
    assert lens == [15, 11, 20, 20]


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_sequences_leave_and_join_between_steps(backend):
    rng = np.random.default_rng(4)
    pool, step = _setup(backend, rng)
    cap = step.capacity
    q = rng.standard_normal((cap, HQ, D)).astype(np.float32)
    k = rng.standard_normal((cap, HKV, D)).astype(np.float32)
    out = np.empty((cap, HQ, D), np.float32)
    seqs = [int(s) for s in step.sequences[:4]]
    for it in range(6):
        if it == 2:                     # one finishes; a new one joins in its row
            pool.free(seqs[1])
            new = pool.new_sequence()
            x = rng.standard_normal((L, 3, HKV, D)).astype(np.float32)
            pool.append(new, x, x)
            seqs[1] = new
            step.set_sequences(seqs)
        step.begin()
        for layer in range(L):
            step.append(layer, k, k)
            step.decode(layer, q, out=out)
            want, _ = _oracle(pool, step, layer, q)
            assert_matches_oracle(out, None, want, None, "float32", f"step {it}")
    assert (out[4:] == 0).all()          # padding rows


def test_bad_use_is_refused_clearly():
    rng = np.random.default_rng(0)
    pool, step = _setup("reference", rng)
    cap = step.capacity
    k = np.zeros((cap, HKV, D), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep.append: call begin\(\) "
                                                   r"first"):
        step.append(0, k, k)
    step.begin()
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep.append: k must have shape "
                                                   r"\[capacity, Hkv, D\] = \[6, 2, 64\], "
                                                   r"got \[5, 2, 64\]"):
        step.append(0, np.zeros((cap - 1, HKV, D), np.float32), k)
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep.append: layer must be"):
        step.append(L, k, k)
    graph = step.capture(lambda st: (st.append(0, k, k), st.append(1, k, k)))
    with pytest.raises(pd.StaleStepError, match=r"call step.begin\(\) before each replay"):
        graph.replay()
    pool.append(int(step.sequences[0]), np.zeros((L, 1, HKV, D), np.float32),
                np.zeros((L, 1, HKV, D), np.float32))
    with pytest.raises(InvalidArgumentError, match=r"the pool changed since this step's "
                                                   r"begin\(\)"):
        step.append(0, k, k)
    for _ in range(6):                  # past the headroom: replanned, the graph is stale
        step.begin()
        step.append(0, k, k)
        step.append(1, k, k)
    assert step.replans >= 1 and graph.stale
    with pytest.raises(pd.StaleStepError, match=r"replanned .* capture again"):
        graph.replay()
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep: path must be one of auto, "
                                                   r"v2, v2tc, v1, got 'gather'"):
        pd.DecodeStep(pool, [0], num_qo_heads=HQ, path="gather")


def test_the_same_step_code_runs_on_mlx():
    """MLX arrays are functional: the pool, the table buffer and the outputs rebind."""
    require_mlx()
    import mlx.core as mx
    rng = np.random.default_rng(8)
    pool, step = _setup("mlx", rng)
    cap = step.capacity
    q = mx.array(rng.standard_normal((cap, HQ, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((cap, HKV, D)).astype(np.float32))
    out = mx.zeros((cap, HQ, D))
    graph = None
    for it in range(6):
        step.begin()
        if graph is None or graph.stale:
            graph = step.capture(lambda st: [(st.append(i, k, k), st.decode(i, q, out=out))
                                             for i in range(L)])
        else:
            graph.replay()
        want, _ = _oracle(pool, step, L - 1, np.array(q))
        assert_matches_oracle(np.array(out), None, want, None, "float32", f"step {it}")
    assert step.path == "gather" and step.steps == 6


def _write_rest(step, k, first):
    """Append layers ``first ..`` of the step's token (rows ``k``, also as V): a begin's
    slots must be written in every layer before the next begin or a decode of the layer."""
    for layer in range(first, step.num_layers):
        step.append(layer, k, k)


def _f16_pool(rng):
    """A float16 pool on emulated-cuda with three sequences of 5, 1 and 10 tokens."""
    pool = pd.PagePool(96, P, HKV, D, "float16", num_layers=L, backend="emulated-cuda")
    seqs = [pool.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, [5, 1, 10]):
        x = rng.standard_normal((L, n, HKV, D)).astype(np.float16)
        pool.append(s, x, x)
    return pool, seqs


def test_the_tensor_core_partial_serves_the_step_on_emulated_cuda(monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    rng = np.random.default_rng(6)
    pool, seqs = _f16_pool(rng)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=4, headroom=4, path="v2tc")
    q = rng.standard_normal((4, HQ, D)).astype(np.float16)
    k = rng.standard_normal((4, HKV, D)).astype(np.float16)
    out = np.full((4, HQ, D), np.nan, np.float16)
    for it in range(6):
        step.begin()
        step.append(0, k, k)
        step.decode(0, q, out=out)
        assert pd.last_outcome().path.startswith("v2tc")
        want, _ = _oracle(pool, step, 0, q)
        assert_matches_oracle(out, None, want, None, "float16", f"step {it}")
        _write_rest(step, k, 1)


def _crossover(tmp_path, monkeypatch, backend, cells, mtime):
    import json
    import os

    from paged_decode import crossover
    dev = pd.get_backend(backend).device_info().name
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"device": dev, "cells": cells}))
    os.utime(path, (mtime, mtime))              # the table is cached by modification time
    monkeypatch.setenv(crossover.ENV, str(path))


def _cell(best, times, ctx=6):
    return {"batch": 4, "context": ctx, "page_size": P, "group": HQ // HKV, "best": best,
            "times_us": times}


def test_auto_takes_the_crossover_table_s_path_and_chooses_again_at_each_replan(
        tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    rng = np.random.default_rng(9)
    pool, seqs = _f16_pool(rng)
    _crossover(tmp_path, monkeypatch, "emulated-cuda",
               [_cell("v2tc", {"v2tc": 1.0, "v2": 2.0, "v1": 3.0})], 10)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=4, headroom=2)
    from paged_decode.specs import v2tc_ctas_per_chunk
    assert step.requested_path == "auto" and step.path == "v2tc"
    assert step.path_reason.startswith("auto: v2tc was the fastest")
    assert step.plan.ctas_per_chunk == v2tc_ctas_per_chunk(HQ, HKV)   # the plan for v2tc
    q = rng.standard_normal((4, HQ, D)).astype(np.float16)
    k = rng.standard_normal((4, HKV, D)).astype(np.float16)
    out = np.full((4, HQ, D), np.nan, np.float16)
    _crossover(tmp_path, monkeypatch, "emulated-cuda",
               [_cell("v1", {"v2tc": 3.0, "v2": 2.0, "v1": 1.0})], 20)
    paths = []
    for it in range(5):                         # headroom 2: replanned within 5 steps
        step.begin()
        step.append(0, k, k)
        step.decode(0, q, out=out)
        paths.append(pd.last_outcome().path)
        want, _ = _oracle(pool, step, 0, q)
        assert_matches_oracle(out, None, want, None, "float16", f"step {it}")
        _write_rest(step, k, 1)
    assert step.replans >= 1 and step.path == "v1"        # the new table at the replan
    assert paths[0].startswith("v2tc") and paths[-1] == "v1"


def test_auto_runs_only_what_the_backend_supports(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    _crossover(tmp_path, monkeypatch, "reference",
               [_cell("v2tc", {"v2tc": 1.0, "v2": 3.0, "v1": 2.0})], 30)
    pool, step = _setup("reference", rng, capacity=4)   # the reference backend has no v2tc
    assert step.path == "v1" and "can run" in step.path_reason
    monkeypatch.delenv("PAGED_DECODE_CROSSOVER")
    pool2, step2 = _setup("reference", rng, capacity=4)
    assert step2.path == "v2" and "no crossover table" in step2.path_reason
    assert pd.DecodeStep(pool2, [0], num_qo_heads=HQ, path="v1").path_reason == \
        "path 'v1' asked for"


@pytest.mark.parametrize("backend", BACKENDS)
def test_soft_cap_and_sinks_apply_to_every_layer_of_the_step(backend, monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    rng = np.random.default_rng(9)
    pool = pd.PagePool(96, P, HKV, D, "float32", num_layers=L, backend=backend)
    seqs = [pool.new_sequence() for _ in range(3)]
    for s, n in zip(seqs, [5, 1, 10]):
        x = rng.standard_normal((L, n, HKV, D)).astype(np.float32)
        pool.append(s, x, x)
    sinks = rng.standard_normal(HQ).astype(np.float32)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=4, headroom=4,
                         logits_soft_cap=2.0, sinks=sinks)
    q = (3 * rng.standard_normal((4, HQ, D))).astype(np.float32)   # scores the cap bends
    k = rng.standard_normal((4, HKV, D)).astype(np.float32)
    out = np.full((4, HQ, D), np.nan, np.float32)
    lse = np.full((4, HQ), np.nan, np.float32)
    for it in range(6):
        step.begin()
        for layer in range(L):
            step.append(layer, k, k)
            step.decode(layer, q, out=out, lse=lse, return_lse=True)
            kk, vv = pool.layer(layer)
            want = oracle_decode(q, np.asarray(kk), np.asarray(vv), step.table.page_table(),
                                 logits_soft_cap=2.0, sinks=sinks)
            assert_matches_oracle(out, lse, *want, "float32", f"step {it} layer {layer}")
    plain = oracle_decode(q, np.asarray(kk), np.asarray(vv), step.table.page_table())
    assert np.abs(out - plain[0]).max() > 1e-2          # the variants changed the answer


def test_the_plan_check_is_skipped_only_within_the_headroom(monkeypatch):
    # (decode's own prepare still checks each new table version on array-op backends)
    """begin() skips the O(B) plan check for the begins a plan surely serves
    (``DecodePlan.tokens_left``, at least the headroom), and checks (and replans) as soon
    as anything else changed the pool or the batch."""
    rng = np.random.default_rng(4)
    pool, step = _setup("reference", rng, headroom=3)
    checks = []
    real = step._replan_if_needed

    def counting():
        checks.append(step.steps)
        real()
    monkeypatch.setattr(step, "_replan_if_needed", counting)
    cap = step.capacity
    q = rng.standard_normal((cap, HQ, D)).astype(np.float32)
    k = rng.standard_normal((cap, HKV, D)).astype(np.float32)

    def run_step():
        step.begin()
        _write_rest(step, k, 0)
        out = np.full((cap, HQ, D), np.nan, np.float32)
        step.decode(0, q, out=out)
        want, _ = _oracle(pool, step, 0, q)
        live = step.table.live_rows()[0]
        assert_matches_oracle(out[live], None, want[live], None, "float32")

    left = step.plan.tokens_left(step.table)
    assert left >= 3            # the headroom at least
    for _ in range(left):       # within the room of the first plan: no check
        run_step()
    assert checks == [] and step.replans == 0
    run_step()                  # the next begin: checked
    assert checks == [left]
    # a change outside the step (a long append to one sequence) is checked at the next
    # begin and replans: the sequence outgrew the plan
    s = int(step.sequences[0])
    x = rng.standard_normal((L, 40, HKV, D)).astype(np.float32)
    pool.append(s, x, x)
    replans = step.replans
    run_step()
    assert step.replans == replans + 1
    n = len(checks)
    run_step()                  # a fresh plan: its headroom again
    assert len(checks) == n
    step.set_sequences(step.table.live_rows()[1][:2])     # the batch changed: checked
    run_step()
    assert len(checks) == n + 1


def test_the_plan_serves_the_table_after_every_begin():
    """The invariant the skipped checks rest on: after every begin the step's plan serves
    its table (a prepared CUDA launch does not check again), over many replans."""
    rng = np.random.default_rng(6)
    pool, step = _setup("reference", rng, headroom=2)
    first = step.plan            # outgrown along the way: no room left once it mismatches
    skipped = 0
    k = np.zeros((step.capacity, HKV, D), np.float32)
    for _ in range(60):
        skipped += step._unchecked_begins > 0
        if step.steps:
            _write_rest(step, k, 0)
        step.begin()
        assert step.plan.mismatch(step.table) is None
        assert step._unchecked_begins <= step.plan.tokens_left(step.table)
        if first.mismatch(step.table) is not None:
            assert first.tokens_left(step.table) == 0
    assert step.replans >= 3 and skipped >= 30


@pytest.mark.parametrize("kw,msg", [
    ({"page_capacity": 0}, r"page_capacity must be an integer in \[1, 2147483647\] or None, got 0"),
    ({"page_capacity": "64"}, r"page_capacity must be an integer in \[1, 2147483647\] or None, "
                              r"got '64'"),
    ({"page_capacity": 1}, "page_capacity must hold the batch's"),
    ({"capacity": 2}, "capacity must be at least the number of sequences"),
])
def test_table_sizes_are_checked_in_the_step_s_name(kw, msg):
    rng = np.random.default_rng(9)
    pool, step = _setup("reference", rng)
    with pytest.raises(InvalidArgumentError, match=f"^DecodeStep: {msg}"):
        pd.DecodeStep(pool, step.sequences[:4].tolist(), num_qo_heads=HQ, **kw)


def test_recorded_launches_follow_the_caller_s_arrays_not_the_backend_s_views(monkeypatch):
    """The recorded append is made on the caller's ``k`` (its framework's stream at each
    call: torch's for torch tensors, which a torch CUDA graph captures), never on the
    backend's view of it (CuPy's stream: a torch graph would miss the append, S9 device
    run). Here the caller's arrays are torch CPU tensors over emulated CUDA."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    pool, step = _setup("emulated-cuda", rng)
    likes = []
    real = step.backend.compile_launches

    def recording(run, like):
        likes.append(like)
        return real(run, like)
    monkeypatch.setattr(step.backend, "compile_launches", recording)
    k = torch.from_numpy(rng.standard_normal((6, HKV, D)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((6, HQ, D)).astype(np.float32))
    out = torch.empty((6, HQ, D))
    step.begin()
    step.append(0, k, k)
    step.decode(0, q, out=out)
    assert likes and all(isinstance(x, torch.Tensor) for x in likes), \
        [type(x).__name__ for x in likes]
    assert likes[0] is k
    np.testing.assert_allclose(out.numpy()[:4], _oracle(pool, step, 0, q.numpy())[0][:4],
                               rtol=1e-4, atol=1e-5)


def test_a_step_in_the_caller_s_own_graph_replays_each_begin_s_update(monkeypatch):
    """``record_update`` / ``replayed`` / ``launch_state`` (a torch CUDA graph around a
    model forward, ``integrations.decode_graph``), modelled by emulated CUDA's recorded
    graphs: each replay must apply its own begin's delta through the recorded update
    alone. Every step matches the oracle through replans (headroom 4), captured again when
    ``launch_state`` changes."""
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    rng = np.random.default_rng(4)
    pool, step = _setup("emulated-cuda", rng)
    cap = step.capacity
    q = [np.empty((cap, HQ, D), np.float32) for _ in range(L)]
    ks = [np.empty((cap, HKV, D), np.float32) for _ in range(L)]
    outs = [np.full((cap, HQ, D), np.nan, np.float32) for _ in range(L)]

    def body():
        for layer in range(L):
            step.append(layer, ks[layer], ks[layer])
            step.decode(layer, q[layer], out=outs[layer])

    state, captures, graph = None, 0, None
    for it in range(10):
        for layer in range(L):
            q[layer][...] = rng.standard_normal((cap, HQ, D))
            ks[layer][...] = rng.standard_normal((cap, HKV, D))
        step.begin()
        if state != step.launch_state:
            # an eager run of the calls, then a recording of [the update, the calls]: the
            # emulated graph holds launches and device copies, no Python
            graph, _ = step.backend.capture_graph(body, step.record_update)
            state, captures = step.launch_state, captures + 1
        else:
            step.backend.replay_graph(graph, ks[0])
            step.replayed()
        assert not step.table.pending
        for layer in range(L):
            want, _ = _oracle(pool, step, layer, q[layer])
            assert_matches_oracle(outs[layer], None, want, None, "float32",
                                  f"step {it} layer {layer}")
    assert step.replans >= 1 and captures == 1 + step.replans


def test_record_update_needs_a_staging_buffer_and_a_begin():
    pool, step = _setup("reference", np.random.default_rng(0))
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep.record_update: call begin"):
        step.record_update()
    step.begin()
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep.record_update: the "
                       r"'reference' backend has no staging buffer"):
        step.record_update()


def test_auto_takes_v2tc_for_an_fp8_pool(tmp_path, monkeypatch):
    from paged_decode.call import FP8_AUTO
    _crossover(tmp_path, monkeypatch, "emulated-cuda",
               [_cell("v2", {"v2tc": 3.0, "v2": 1.0, "v1": 2.0})], 40)
    pool = pd.PagePool(32, P, HKV, D, "float8_e4m3fn", num_layers=L, k_scale=0.5,
                       v_scale=0.5, backend="emulated-cuda")
    seqs = [pool.new_sequence() for _ in range(4)]
    for s in seqs:
        x = np.ones((L, 6, HKV, D), np.float16)
        pool.append(s, x, x)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ)
    assert step.path == "v2tc" and step.path_reason == FP8_AUTO
    f16 = pd.PagePool(32, P, HKV, D, "float16", num_layers=L, backend="emulated-cuda")
    s16 = [f16.new_sequence() for _ in range(4)]
    for s in s16:
        f16.append(s, np.ones((L, 6, HKV, D), np.float16), np.ones((L, 6, HKV, D), np.float16))
    assert pd.DecodeStep(f16, s16, num_qo_heads=HQ).path == "v2"      # the table's choice


# ---------------------------------------------------------------------------- unwritten slots
def _two_layer_step(backend="reference"):
    rng = np.random.default_rng(11)
    pool = pd.PagePool(32, P, HKV, D, "float32", num_layers=L, backend=backend)
    s = pool.new_sequence()
    x = rng.standard_normal((L, 3, HKV, D)).astype(np.float32)
    pool.append(s, x, x)
    k = rng.standard_normal((1, HKV, D)).astype(np.float32)
    q = rng.standard_normal((1, HQ, D)).astype(np.float32)
    return pool, s, pd.DecodeStep(pool, [s], num_qo_heads=HQ, capacity=1), k, q


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_a_slot_begin_reserved_is_never_read_unwritten(backend):
    """A begin reserves one token slot per sequence in every layer. Decoding a layer before
    its append, a second begin before every layer was appended, another step's begin, or
    an outside append in between each read (or left) an unwritten slot: max-rel errors of
    0.16-0.34 against what was written, no error (a session-24 audit). Each is refused
    now, naming the layers still missing; the full step then runs right."""
    pool, s, step, k, q = _two_layer_step(backend)
    step.begin()
    step.append(0, k, k)
    with pytest.raises(InvalidArgumentError, match=r"^DecodeStep.decode: layer 1 has not been "
                                                   r"appended since begin\(\)"):
        step.decode(1, q)
    with pytest.raises(InvalidArgumentError, match=r"^DecodeStep.append: layer 0 was appended "
                                                   r"already since begin\(\)"):
        step.append(0, k, k)
    with pytest.raises(InvalidArgumentError, match=r"^DecodeStep.begin: the last begin\(\) "
                                                   r"reserved a token slot per sequence that "
                                                   r"layers \[1\] have not written"):
        step.begin()
    other = pd.DecodeStep(pool, [s], num_qo_heads=HQ, capacity=1)
    with pytest.raises(InvalidArgumentError, match=r"^DecodeStep.begin: a DecodeStep's begin\(\) "
                                                   r"reserved a token slot in its sequences that "
                                                   r"layers \[1\] have not written"):
        other.begin()
    x = np.zeros((L, 1, HKV, D), np.float32)
    for call in (lambda: pool.append(s, x, x), lambda: pool.fork(s),
                 lambda: pool.trim_front(s, 1), lambda: pool.reserve_batch([s])):
        with pytest.raises(InvalidArgumentError, match=r"a DecodeStep's begin\(\) reserved a "
                                                       r"token slot in its sequences that "
                                                       r"layers \[1\] have not written yet"):
            call()
    assert pool.seq_len(s) == 4                       # nothing changed the sequence
    step.append(1, k, k)                              # the step completes: all is allowed
    for layer in range(L):
        out = step.decode(layer, q)
        kk, vv = pool.layer(layer)
        want = oracle_decode(q, np.asarray(kk), np.asarray(vv), step.table.page_table())
        assert_matches_oracle(np.asarray(out), None, want[0], None, "float32", f"{layer}")
        np.testing.assert_array_equal(np.asarray(kk)[pool.seq_pages(s)[-1], 3 % P], k[0])
    other.begin()                                     # the other step may go on now
    for layer in range(L):
        other.append(layer, k, k)
    pool.append(s, x, x)


def test_an_abandoned_step_is_closed_only_by_freeing_its_sequences():
    """A step that cannot finish (a sequence freed mid-step): its remaining sequences hold
    an unwritten slot, so the batch cannot move on until they are freed too."""
    pool, s, step, k, q = _two_layer_step()
    t = pool.new_sequence()
    x = np.ones((L, 2, HKV, D), np.float32)
    pool.append(t, x, x)
    step.set_sequences([s, t])
    step.begin()
    k2 = np.zeros((step.capacity, HKV, D), np.float32)
    step.append(0, k2, k2)
    pool.free(t)                                      # allowed: it drops a sequence
    with pytest.raises(InvalidArgumentError, match=r"^DecodeStep.append: a sequence was freed "
                                                   r"since the last begin\(\), before layers "
                                                   r"\[1\] were appended"):
        step.append(1, k2, k2)
    with pytest.raises(InvalidArgumentError, match=r"^DecodeStep.begin: a sequence was freed "
                                                   r"since the last begin\(\)"):
        step.begin()
    with pytest.raises(InvalidArgumentError, match=rf"^DecodeStep.set_sequences: sequences "
                                                   rf"\[{s}\] hold the token slot"):
        step.set_sequences([s])
    pool.free(s)
    step.set_sequences([pool.new_sequence()])         # every holder freed: closed
    pool.append(step.sequences[0], x, x)


@pytest.mark.parametrize("rows", ["float32", "strided"])
def test_a_capture_refuses_rows_it_would_replay_stale(rows):
    """Rows the append converts on the host (another dtype, not C-contiguous) were
    converted once at capture: every replay wrote the capture step's rows (max-rel
    0.67-0.88 on emulated-cuda). Capturing with them is refused; the pool's dtype works."""
    rng = np.random.default_rng(3)
    pool = pd.PagePool(16, P, HKV, D, "float16", num_layers=1, backend="emulated-cuda")
    s = pool.new_sequence()
    x = rng.standard_normal((1, 3, HKV, D)).astype(np.float16)
    pool.append(s, x, x)
    step = pd.DecodeStep(pool, [s], num_qo_heads=HQ, capacity=1, headroom=16)
    q = np.zeros((1, HQ, D), np.float16)
    out = np.zeros((1, HQ, D), np.float16)
    k = np.zeros((1, HKV, D), np.float32) if rows == "float32" else \
        np.zeros((1, HKV, 2 * D), np.float16)[:, :, ::2]
    step.begin()
    with pytest.raises(InvalidArgumentError, match=r"^DecodeStep.append: rows of dtype .* are "
                                                   r"converted on the host at every call"):
        step.capture(lambda st: (st.append(0, k, k), st.decode(0, q, out=out)))
    good = np.zeros((1, HKV, D), np.float16)           # control: replays the new rows
    graph = step.capture(lambda st: (st.append(0, good, good), st.decode(0, q, out=out)))
    for _ in range(3):
        step.begin()
        good[...] = rng.standard_normal(good.shape)
        q[...] = rng.standard_normal(q.shape)
        graph.replay()
        kk, vv = pool.layer(0)
        np.testing.assert_array_equal(np.asarray(kk)[pool.seq_pages(s)[-1],
                                                     (pool.seq_len(s) - 1) % P], good[0])
        want = oracle_decode(q, np.asarray(kk), np.asarray(vv), step.table.page_table())
        assert_matches_oracle(out, None, want[0], None, "float16")


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_replayed_without_a_recorded_update_is_refused(backend):
    """replayed() marks the begin's table update as made by a graph: without a graph that
    recorded it, it dropped the update and the device table stayed a token behind (an
    out-of-bounds read on emulated-cuda once a new page id was lost)."""
    pool, s, step, k, q = _two_layer_step(backend)
    step.begin()
    with pytest.raises(InvalidArgumentError, match=r"^DecodeStep.replayed: no graph recorded "
                                                   r"this table's update \(record_update was "
                                                   r"never called\)"):
        step.replayed()
    for layer in range(L):
        step.append(layer, k, k)
    out = step.decode(0, q)
    kk, vv = pool.layer(0)
    want = oracle_decode(q, np.asarray(kk), np.asarray(vv), pool.page_table([s]))
    assert_matches_oracle(np.asarray(out), None, want[0], None, "float32")


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_the_step_follows_its_table_s_own_set_sequences_between_steps(backend):
    """``step.table.set_sequences`` between steps (not the step's own ``set_sequences``):
    the next begin takes the new batch, replanning when it no longer fits the plan
    (before: the step kept its plan and every decode raised a ``PlanMismatchError`` that
    told the caller to call ``plan_decode``, which a step's caller cannot); mid-step the
    table refuses, naming the unwritten layers (its rows are the begun step's)."""
    rng = np.random.default_rng(11)
    pool, step = _setup(backend, rng, capacity=4)
    extra = pool.new_sequence()
    x = rng.standard_normal((L, 40, HKV, D)).astype(np.float32)
    pool.append(extra, x, x)
    batches = [list(step.sequences[:4]), [int(step.sequences[0]), extra],
               [*map(int, step.sequences[:4]), extra]]
    for it, seqs in enumerate(batches):
        step.table.set_sequences(seqs)
        for _ in range(2):
            step.begin()
            cap = step.capacity
            q = rng.standard_normal((cap, HQ, D)).astype(np.float32)
            for layer in range(L):
                k = rng.standard_normal((cap, HKV, D)).astype(np.float32)
                step.append(layer, k, k)
            out = np.asarray(step.decode(0, q))
            want, _ = _oracle(pool, step, 0, q)
            b = len(seqs)
            assert_matches_oracle(out[:b], None, want[:b], None, "float32", f"batch {it}")
    assert step.replans >= 1                  # five sequences outgrew the first plan
    step.begin()
    before = step.table.batches
    with pytest.raises(InvalidArgumentError, match=r"StepTable.set_sequences: a DecodeStep "
                       r"over this table has begun a step whose new slots have not been "
                       r"written in layers \[0, 1\]"):
        step.table.set_sequences(batches[0])
    assert step.table.batches == before       # a refused call changes nothing
    # once every layer is appended the table may take a batch, but this step's decodes
    # (their q rows are the begun batch's) are refused until the next begin follows it
    cap = step.capacity
    for layer in range(L):
        step.append(layer, *(2 * [rng.standard_normal((cap, HKV, D)).astype(np.float32)]))
    step.table.set_sequences(batches[1])
    assert step.table.batches == before + 1
    q = rng.standard_normal((cap, HQ, D)).astype(np.float32)
    with pytest.raises(InvalidArgumentError, match=r"DecodeStep.decode: the step's table "
                                                   r"took another batch"):
        step.decode(1, q)
    step.begin()
    for layer in range(L):
        step.append(layer, *(2 * [rng.standard_normal((cap, HKV, D)).astype(np.float32)]))
    out = np.asarray(step.decode(1, q))
    want, _ = _oracle(pool, step, 1, q)
    assert_matches_oracle(out[:2], None, want[:2], None, "float32", "followed")


def test_auto_over_fp8_pools_refuses_a_query_it_did_not_plan_for():
    """``path="auto"`` over fp8 pools plans v2tc for 16-bit queries before any query is
    seen; a float32 query is refused by name, saying what auto assumed (before: v2tc's own
    refusal, about a path the caller never asked for). Named v2 runs it."""
    from paged_decode.fp8 import dequantize
    rng = np.random.default_rng(3)
    for path in ("auto", "v2"):
        pool = pd.PagePool(64, 16, HKV, D, "float8_e4m3fn", num_layers=1,
                           backend="emulated-cuda", k_scale=0.5, v_scale=0.5)
        seqs = [pool.new_sequence() for _ in range(2)]
        for s in seqs:
            x = rng.standard_normal((1, 20, HKV, D)).astype(np.float32)
            pool.append(s, x, x)
        step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, path=path)
        step.begin()
        k = rng.standard_normal((step.capacity, HKV, D)).astype(np.float32)
        step.append(0, k, k)
        q = rng.standard_normal((step.capacity, HQ, D)).astype(np.float32)
        if path == "auto":
            assert step.path == "v2tc"
            with pytest.raises(InvalidDtypeError):      # no path takes float64: decode's
                step.decode(0, q.astype(np.float64))     # own dtype error, as before
            with pytest.raises(InvalidArgumentError, match=r"DecodeStep.decode: path='auto' "
                               r"chose v2tc for this step's float8_e4m3fn pools, assuming "
                               r"float16 or bfloat16 queries; got q float32"):
                step.decode(0, q)
            out = step.decode(0, q.astype(np.float16))      # what auto planned for
        else:
            out = step.decode(0, q)
        kp, vp = (dequantize(x, "float8_e4m3fn", 0.5) for x in pool.layer(0))
        qf = q.astype(np.float16).astype(np.float32) if path == "auto" else q
        want, _ = oracle_decode(qf, kp, vp, step.table.page_table())
        assert_matches_oracle(np.asarray(out, np.float32), None, want, None, "float16", path)


def _one_seq_step(backend, extra=False):
    rng = np.random.default_rng(21)
    pool = pd.PagePool(32, 4, HKV, D, "float32", num_layers=L, backend=backend)
    a = pool.new_sequence()
    x = rng.standard_normal((L, 5, HKV, D)).astype(np.float32)
    pool.append(a, x, x)
    other = None
    if extra:
        other = pool.new_sequence()
        pool.append(other, x, x)
    step = pd.DecodeStep(pool, [a], num_qo_heads=HQ, capacity=2, headroom=8, path="v2")
    return pool, step, a, other, rng


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_a_free_outside_the_batch_leaves_the_step_going(backend):
    """free() is allowed mid-step: of a sequence outside the begun batch, the step goes on
    (before: every later call said the step was stranded and advised freeing the step's
    own sequences); of one of its own, the step is stranded and every message says the
    one way out (free the others that hold slots), none says to append."""
    pool, step, a, other, rng = _one_seq_step(backend, extra=True)
    k = rng.standard_normal((2, HKV, D)).astype(np.float32)
    step.begin()
    step.append(0, k, k)
    pool.free(other)
    step.append(1, k, k)                         # the step goes on
    q = rng.standard_normal((2, HQ, D)).astype(np.float32)
    out = np.asarray(step.decode(1, q))
    want, _ = _oracle(pool, step, 1, q)
    assert_matches_oracle(out[:1], None, want[:1], None, "float32", "after the free")
    # freeing a sequence of the batch strands it
    b = pool.new_sequence()
    x = rng.standard_normal((L, 3, HKV, D)).astype(np.float32)
    pool.append(b, x, x)
    step.set_sequences([a, b])
    step.begin()
    step.append(0, k, k)
    pool.free(b)
    with pytest.raises(InvalidArgumentError, match=r"a sequence was freed since the last "
                                                   r"begin\(\)"):
        step.append(1, k, k)
    with pytest.raises(InvalidArgumentError, match=r"can no longer write .*free its other "
                                                   r"sequences"):
        pool.append(a, x[:, :1], x[:, :1])
    with pytest.raises(InvalidArgumentError, match=r"free those sequences \(a sequence of "
                                                   r"the step was freed"):
        step.set_sequences([a])


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_a_free_outside_a_begun_batch_of_padding_leaves_the_step_going(backend):
    """A begin over padding rows only reserves nothing; a free (or any pool change) after
    it once made the next append say the pool changed since begin() (session 38's
    stateful fuzz), where a batch with a live row goes on."""
    pool = pd.PagePool(32, 4, 1, 64, "float32", num_layers=2, backend=backend)
    a, b = pool.new_sequence(), pool.new_sequence()
    x = np.ones((2, 3, 1, 64), np.float32)
    pool.append(a, x, x)
    pool.append(b, x, x)
    step = pd.DecodeStep(pool, [a], num_qo_heads=1, capacity=2)
    pool.free(a)                      # every row of the step is padding now
    step.begin()
    k = np.zeros((2, 1, 64), np.float32)
    step.append(0, k, k)
    pool.free(b)
    step.append(1, k, k)
    step.decode(1, np.ones((2, 1, 64), np.float32))
    c = pool.new_sequence()           # and the step takes a live batch again
    pool.append(c, x, x)
    step.set_sequences([c])
    step.begin()
    kv = np.random.default_rng(3).standard_normal((2, 1, 64)).astype(np.float32)
    step.append(0, kv, kv)
    step.append(1, kv, kv)
    q = np.random.default_rng(4).standard_normal((2, 1, 64)).astype(np.float32)
    got = np.asarray(step.decode(1, q))
    rows = np.concatenate([x[1, :, 0], kv[:1, 0]])            # c's layer-1 K = V rows
    s = rows @ q[0, 0] / 8.0
    w = np.exp(s - s.max())
    np.testing.assert_allclose(got[0, 0], (w / w.sum()) @ rows, rtol=1e-5, atol=1e-6)


def test_an_empty_batch_is_not_captured():
    """A graph recorded while the batch has no live sequence records no append, and every
    replay over a later batch would leave its begin's slots unwritten (stale K/V read:
    max-rel 0.49 on emulated-cuda, S25's fuzzing): refused; the step recovers."""
    pool, step, a, _, rng = _one_seq_step("emulated-cuda")
    k = np.zeros((2, HKV, D), np.float32)

    def body(st):
        for layer in range(L):
            st.append(layer, k, k)
    step.set_sequences([])
    step.begin()
    with pytest.raises(InvalidArgumentError, match=r"the batch has no live sequence, so a "
                                                   r"graph captured now would write no rows"):
        step.capture(body)
    step.set_sequences([a])
    step.begin()
    graph = step.capture(body)
    step.begin()
    k[...] = rng.standard_normal(k.shape)
    graph.replay()
    kp = np.asarray(pool.layer(0)[0])
    slot = kp[pool.seq_pages(a)[-1], (pool.seq_len(a) - 1) % 4]
    np.testing.assert_array_equal(slot, k[0])


@pytest.mark.parametrize("backend", ["reference", "emulated-cuda"])
def test_a_replay_after_an_eager_append_is_refused_before_it_writes(backend):
    """begin, one layer appended eagerly, then a replay of a graph that appends every
    layer: refused before anything runs (before: reference re-ran the body, wrote layer 0
    and refused at layer 1; emulated-cuda rewrote layer 1's slot silently)."""
    pool, step, a, _, rng = _one_seq_step(backend)
    k = np.ones((2, HKV, D), np.float32)

    def body(st):
        for layer in range(L):
            st.append(layer, k, k)
    step.begin()
    graph = step.capture(body)
    step.begin()
    eager = np.full((2, HKV, D), 7.0, np.float32)
    step.append(1, eager, eager)
    k[...] = 3.0
    with pytest.raises(InvalidArgumentError, match=r"CapturedStep.replay: layers \[1\] were "
                                                   r"appended since begin\(\)"):
        graph.replay()
    assert step.unwritten_layers() == [0]
    slot = (pool.seq_pages(a)[-1], (pool.seq_len(a) - 1) % 4)
    assert np.asarray(pool.layer(1)[0])[slot][0, 0] == 7.0      # untouched
    assert np.asarray(pool.layer(0)[0])[slot][0, 0] != 3.0
    step.append(0, k, k)                                       # the step completes
    assert step.unwritten_layers() == []


def test_a_full_pool_is_reported_by_the_call_the_caller_made():
    pool = pd.PagePool(3, 4, HKV, D, "float32", num_layers=1, backend="reference")
    x = np.zeros((1, 4, HKV, D), np.float32)
    seqs = [pool.new_sequence(), pool.new_sequence()]
    for s in seqs:
        pool.append(s, x, x)
    step = pd.DecodeStep(pool, seqs, num_qo_heads=HQ, capacity=2)
    with pytest.raises(pd.PoolExhaustedError, match=r"^DecodeStep.begin: need 2 free pages"):
        step.begin()
    assert step.unwritten_layers() == [0] and pool._open_step is None   # nothing reserved

