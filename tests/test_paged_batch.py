"""The framework-neutral pieces of ``paged_decode.integrations``: ``PagedBatch`` (the one
adapter over the pool) and the prompt batch (validation, shared prefix, pool size), on
the numpy reference backend: no torch or MLX needed."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode.errors import InvalidArgumentError, UnsupportedProblemError
from paged_decode.integrations.model_checks import check_attention
from paged_decode.integrations.paged_batch import PagedBatch
from paged_decode.integrations.prompts import pool_pages, prompt_batch
from paged_decode.reference import oracle_decode

L, HKV, HQ, D, P = 3, 2, 4, 64, 4


def make(num_pages=64, backend="reference", **kw):
    return PagedBatch(num_layers=L, num_pages=num_pages, page_size=P, num_kv_heads=HKV,
                      num_qo_heads=HQ, head_dim=D, dtype="float32", backend=backend, **kw)


def rows(rng, n):
    return rng.standard_normal((L, n, HKV, D)).astype(np.float32)


def forward(batch, rng, counts):
    """One forward: every layer's new rows appended; returns them ``[L, N, Hkv, D]``."""
    n = len(batch.seqs) if counts is None else int(np.sum(counts))
    k, v = rows(rng, n), rows(rng, n)
    batch.begin(counts)
    for layer in range(L):
        batch.append(layer, k[layer], v[layer])
    return k, v


def test_gather_returns_each_sequence_right_aligned(rng):
    batch = make()
    batch.start(1)
    pk, pv = forward(batch, rng, [6])                      # a 6-token prefix
    batch.fork(3)
    k, v = forward(batch, rng, [1, 5, 0])
    lens = [7, 11, 6]
    assert batch.lengths.tolist() == lens
    starts = np.cumsum([0, 1, 5])
    for layer in range(L):
        gk, gv = batch.gather(layer) if layer == L - 1 else (None, None)
        if gk is None:
            continue
        assert gk.shape == (3, 11, HKV, D)
        for i, c in enumerate([1, 5, 0]):
            want_k = np.concatenate([pk[layer], k[layer, starts[i]:starts[i] + c]])
            want_v = np.concatenate([pv[layer], v[layer, starts[i]:starts[i] + c]])
            np.testing.assert_array_equal(gk[i, 11 - lens[i]:], want_k)
            np.testing.assert_array_equal(gv[i, 11 - lens[i]:], want_v)


def test_decode_matches_the_oracle_with_and_without_cascade(rng):
    for cascade in (False, True):
        batch = make(cascade=cascade)
        batch.start(1)
        forward(batch, rng, [9])                           # two full shared pages
        batch.fork(4)
        forward(batch, rng, [3, 1, 2, 4])
        forward(batch, rng, None)
        q = rng.standard_normal((4, HQ, D)).astype(np.float32)
        k, v = batch.pool.layer(L - 1)
        got = batch.decode(L - 1, q, 0.125)
        want = oracle_decode(q, k, v, batch.table, sm_scale=0.125)[0]
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_out_of_order_calls_are_refused(rng):
    batch = make()
    batch.start(2)
    batch.begin([1, 1])
    k = rows(rng, 2)
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch.append: layer must be 0 "
                       r"\(layers are appended in order, once per forward\), got 1"):
        batch.append(1, k[1], k[1])
    batch.append(0, k[0], k[0])
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch.decode: layer 1 is not the "
                       r"layer appended last in this forward \(0\)"):
        batch.decode(1, np.zeros((2, HQ, D), np.float32), 1.0)
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch.begin: the forward in "
                       r"progress appended layers 0..0 of 3; finish it first"):
        batch.begin(None)
    with pytest.raises(InvalidArgumentError, match="PagedBatch.fork: .* finish it first"):
        batch.fork(2)
    batch.append(1, k[1], k[1])
    batch.append(2, k[2], k[2])
    with pytest.raises(InvalidArgumentError, match=r"the batch must hold one sequence to "
                       r"fork, it holds 2"):
        batch.fork(2)
    with pytest.raises(InvalidArgumentError, match=r"counts\[1\] must be in \[0, 2147483647\], "
                       r"got -1"):
        batch.begin([1, -1])
    with pytest.raises(InvalidArgumentError, match="num_qo_heads \\(3\\) must be a "
                       "multiple of num_kv_heads \\(2\\)"):
        PagedBatch(num_layers=1, num_pages=4, page_size=4, num_kv_heads=2, num_qo_heads=3,
                   head_dim=64, dtype="float32", backend="reference")


def test_close_returns_every_page(rng):
    batch = make(num_pages=20)
    batch.start(1)
    forward(batch, rng, [6])
    batch.fork(3)
    forward(batch, rng, [2, 3, 1])
    assert batch.pool.num_free < 20
    batch.close()
    assert batch.pool.num_free == 20 and batch.seqs == []


def test_the_shared_prefix_leaves_every_prompt_a_token():
    b = prompt_batch("f", [[1, 2, 3, 4], [1, 2, 3, 9, 9], [1, 2, 3]], 5, vocab_size=10,
                     max_positions=None)
    assert b.prefix_len == 2 and b.prefix == (1, 2)
    assert b.suffixes == [(3, 4), (3, 9, 9), (3,)]
    assert prompt_batch("f", [[1, 2]], 5, vocab_size=10, max_positions=None).prefix_len == 0
    assert prompt_batch("f", [[1, 2], [1, 2]], 5, vocab_size=10, max_positions=None,
                        share_prefix=False).prefix_len == 0
    assert prompt_batch("f", [np.array([1, 2]), (1, 3)], 1, vocab_size=10,
                        max_positions=None).prefix_len == 1


@pytest.mark.parametrize("tails", [(1, 5, 2, 9), (4, 4, 4), (3,)])
@pytest.mark.parametrize("prefix", [0, 4, 6])
def test_pages_needed_hold_the_run_with_at_most_one_to_spare(rng, tails, prefix):
    head = list(range(1, prefix + 1))
    prompts = [head + [7] * t for t in tails]
    new = 5
    b = prompt_batch("f", prompts, new, vocab_size=10, max_positions=None)
    need = pool_pages("f", b, P, None)
    batch = make(num_pages=need)
    if b.prefix_len:
        batch.start(1)
        forward(batch, rng, [b.prefix_len])
        batch.fork(b.size)
    else:
        batch.start(b.size)
    forward(batch, rng, [len(s) for s in b.suffixes])
    for _ in range(new - 1):
        forward(batch, rng, None)
    assert batch.pool.num_free <= 1
    with pytest.raises(InvalidArgumentError, match=rf"f: the pool of {need - 1} pages of "
                       rf"{P} tokens cannot hold the run: .* need {need} pages"):
        pool_pages("f", b, P, need - 1)


@pytest.mark.parametrize("kw, error, match", [
    (dict(head_dim=80), UnsupportedProblemError, r"head_dim must be one of"),
    (dict(dtype="float64"), UnsupportedProblemError, r"dtype must be one of float16, "
                                                     r"bfloat16, float32, got float64"),
    (dict(page_size=512), InvalidArgumentError, r"page_size must be an integer in "
                                                r"\[1, 256\], got 512"),
    (dict(num_heads=6, num_kv_heads=4), InvalidArgumentError,
     r"num_attention_heads \(6\) is not a multiple of its num_key_value_heads \(4\)"),
])
def test_model_geometry_checks(kw, error, match):
    args = dict(num_heads=8, num_kv_heads=2, head_dim=64, dtype="float32", page_size=16)
    args.update(kw)
    with pytest.raises(error, match="m: .*" + match):
        check_attention("m", **args)


def _forked(backend="reference", step_engine=False):
    """A batch after its prefill: a 6-token prefix forked 3 ways, tails of 2, 0 and 5
    (the same rows every time)."""
    batch = make(backend=backend, step_engine=step_engine)
    batch.start(1)
    forward(batch, np.random.default_rng(5), [6])
    batch.fork(3)
    forward(batch, np.random.default_rng(6), [2, 0, 5])
    return batch


def _engine_pair(rng):
    """Two batches fed the same rows; one runs its decode steps through the engine step."""
    return [_forked(step_engine=True), _forked()]


def test_step_engine_decode_steps_match_the_plain_path_and_the_oracle(rng):
    """Decode steps through the DecodeStep (page boundaries crossed every few steps) give
    the plain path's outputs, and the oracle's, in every layer; the engine ran them."""
    eng, plain = _engine_pair(rng)
    for step in range(9):
        k, v = rows(rng, 3), rows(rng, 3)
        for b in (eng, plain):
            b.begin(None)
        for layer in range(L):
            q = rng.standard_normal((3, HQ, D)).astype(np.float32)
            got = []
            for b in (eng, plain):
                b.append(layer, k[layer], v[layer])
                got.append(np.array(b.decode(layer, q, 0.125)))
            pk, pv = eng.pool.layer(layer)
            want = oracle_decode(q, pk, pv, eng.pool.page_table(eng.seqs), sm_scale=0.125)[0]
            tol = 1e-5 * np.abs(want).max()
            assert np.abs(got[0] - want).max() <= tol, (step, layer)
            assert np.abs(got[0] - got[1]).max() <= tol, (step, layer)
        assert eng.lengths.tolist() == plain.lengths.tolist() == [9 + step, 7 + step, 12 + step]
    assert eng._engine is not None and eng._engine.steps == 9
    assert plain._engine is None


def test_step_engine_outputs_start_poisoned_and_are_written(rng):
    """The engine's output buffers start as NaN (so a decode that writes nothing shows)."""
    eng, _ = _engine_pair(rng)
    eng.begin(None)
    outs = eng._buffers()[3]
    assert all(np.isnan(np.asarray(o)).all() for o in outs)
    k, v = rows(rng, 3), rows(rng, 3)
    for layer in range(L):
        eng.append(layer, k[layer], v[layer])
        got = eng.decode(layer, rng.standard_normal((3, HQ, D)).astype(np.float32), 0.125)
        assert np.isfinite(np.asarray(got)).all()


def test_step_engine_refusals(rng):
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch: step_engine runs flat "
                       r"decodes; it cannot be combined with cascade=True"):
        make(step_engine=True, cascade=True)
    eng, _ = _engine_pair(rng)
    eng.begin(None)
    k = rows(rng, 3)
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch.append: k must be \[3, 2, 64\] "
                       r"in a decode step \(one row per sequence\), got \[2, 2, 64\]"):
        eng.append(0, k[0][:2], k[0])
    eng.append(0, k[0], k[0])
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch.gather: a decode step of a "
                       r"step_engine batch decodes every layer \(call decode, not gather\)"):
        eng.gather(0)
    q = np.zeros((3, HQ, D), np.float32)
    eng.decode(0, q, 0.125)
    eng.append(1, k[1], k[1])
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch.decode: sm_scale must stay "
                       r"0.125 across a step_engine batch's layers, got 0.25"):
        eng.decode(1, q, 0.25)
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch.decode: q must be \[3, 4, 64\]"):
        eng.decode(1, q[:, :2], 0.125)
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch.decode: q must be float32 "
                       r"\(the pool's dtype\), got float64"):
        eng.decode(1, q.astype(np.float64), 0.125)


def test_step_engine_takes_strided_views(rng):
    """The engine step copies k, v and q into its buffers whatever their strides (the
    transformers adapter passes transposed views): the same outputs as contiguous rows."""
    a, _ = _engine_pair(rng)
    b, _ = _engine_pair(rng)
    for _ in range(3):
        kt = np.ascontiguousarray(rows(rng, 3).transpose(0, 2, 1, 3))   # [L, Hkv, 3, D]
        vt = np.ascontiguousarray(rows(rng, 3).transpose(0, 2, 1, 3))
        k, v = kt.swapaxes(1, 2), vt.swapaxes(1, 2)          # [L, 3, Hkv, D] views
        assert not k[0].flags.c_contiguous
        a.begin(None)
        b.begin(None)
        for layer in range(L):
            qt = rng.standard_normal((HQ, 3, D)).astype(np.float32)
            a.append(layer, k[layer], v[layer])
            b.append(layer, np.ascontiguousarray(k[layer]), np.ascontiguousarray(v[layer]))
            got = np.array(a.decode(layer, qt.swapaxes(0, 1), 0.125))
            want = np.array(b.decode(layer, np.ascontiguousarray(qt.swapaxes(0, 1)), 0.125))
            np.testing.assert_array_equal(got, want)


def test_begin_capture_reruns_a_finished_decode_step_and_refuses_anything_else(rng):
    """``begin_capture`` (``decode_graph.DecodeGraph``): only after a decode step's eager
    forward on a backend with a staging buffer; the table update it records applied again
    and the forward run again give the same outputs (same slots, same rows), and
    ``replayed`` closes the forward."""
    ref, _ = _engine_pair(rng)
    ref.begin(None)
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch.begin_capture: only a "
                       r"step_engine batch's decode step on the cuda backend"):
        ref.begin_capture()
    batch = _forked("emulated-cuda", step_engine=True)
    k, v = rows(rng, 3), rows(rng, 3)
    q = rng.standard_normal((L, 3, HQ, D)).astype(np.float32)
    batch.begin(None)
    batch.append(0, k[0], v[0])
    with pytest.raises(InvalidArgumentError, match=r"PagedBatch.begin_capture: run the step's "
                       r"forward once eagerly first \(it appended 1 of 3 layers\)"):
        batch.begin_capture()
    first = [np.array(batch.decode(0, q[0], 0.125))]
    for layer in range(1, L):
        batch.append(layer, k[layer], v[layer])
        first.append(np.array(batch.decode(layer, q[layer], 0.125)))
    batch.begin_capture()
    for layer in range(L):                    # the same forward again
        batch.append(layer, k[layer], v[layer])
        again = np.array(batch.decode(layer, q[layer], 0.125))
        assert np.array_equal(again, first[layer]), layer
    pk, pv = batch.pool.layer(L - 1)
    want = oracle_decode(q[L - 1], pk, pv, batch.pool.page_table(batch.seqs),
                         sm_scale=0.125)[0]
    assert np.abs(first[L - 1] - want).max() <= 1e-5 * np.abs(want).max()
    batch.replayed()
    batch.begin(None)                         # the forward is closed: the next step starts
    assert batch.lengths.tolist() == [10, 8, 13]


def test_a_recorded_decode_forward_replays_each_begin_s_slots_and_table(rng):
    """``begin_capture`` inside a recording (emulated CUDA's graph: launches and device
    copies, no Python) of a decode forward, replayed after later begins: every layer's
    output matches the oracle, so the replays applied each begin's table update and
    wrote its slots. (Every layer takes the same rows here: the emulated graph does not
    hold the host copies into the engine's buffers, which a torch graph holds, so the
    test writes them before each replay.)"""
    batch = _forked("emulated-cuda", step_engine=True)
    k, v, q = (np.zeros((3, HKV, D), np.float32), np.zeros((3, HKV, D), np.float32),
               np.zeros((3, HQ, D), np.float32))

    def fwd():
        for layer in range(L):
            batch.append(layer, k, v)
            batch.decode(layer, q, 0.125)

    graph = None
    for step in range(8):                      # page boundaries every 4 tokens
        k[...], v[...] = rng.standard_normal(k.shape), rng.standard_normal(v.shape)
        q[...] = rng.standard_normal(q.shape)
        batch.begin(None)
        if graph is None:
            graph, _ = batch.pool.backend.capture_graph(fwd, batch.begin_capture)
        else:
            kb, vb, qb, _ = batch._buffers()
            kb[...], vb[...], qb[...] = k, v, q
            batch.pool.backend.replay_graph(graph, qb)
            batch.replayed()
        outs = batch._buffers()[3]
        table = batch.pool.page_table(batch.seqs)
        for layer in range(L):
            pk, pv = batch.pool.layer(layer)
            for r in range(3):                 # the step's rows landed in its new slots
                n = int(table.visible_lens[r]) - 1 + int(table.first_page_offset[r])
                page = table.request_pages(r)[n // P]
                assert np.array_equal(np.asarray(pk)[page, n % P], k[r]), (step, layer, r)
                assert np.array_equal(np.asarray(pv)[page, n % P], v[r]), (step, layer, r)
            want = oracle_decode(q, pk, pv, table, sm_scale=0.125)[0]
            assert np.abs(np.asarray(outs[layer]) - want).max() <= 1e-5 * np.abs(want).max(), \
                (step, layer)
    assert batch.lengths.tolist() == [16, 14, 19]


def test_counts_and_rows_are_checked_not_coerced():
    """begin's counts and gather's rows went through np.asarray(x, int64): 1.7 became 1,
    -1 named the last sequence, and strings, huge values and rows past the batch raised
    numpy's errors (a session-24 audit)."""
    batch = _forked()
    n = len(batch.seqs)
    for counts, pattern in (([1.7] * n, r"counts must be a 1-D array of integers, got shape "
                             rf"\[{n}\] dtype float64"),
                            (["a"] * n, r"counts must be a 1-D array of integers"),
                            ([2**63 + 5] * n, r"counts must hold values that fit int64"),
                            ([1] * (n - 1), rf"counts must have {n} entries, got {n - 1}"),
                            ([-1] + [1] * (n - 1), r"counts\[0\] must be in \[0, ")):
        with pytest.raises(InvalidArgumentError, match=r"^PagedBatch.begin: " + pattern):
            batch.begin(counts)
    batch.begin([1] * n)                                   # control
    rng = np.random.default_rng(2)
    k, v = rows(rng, n), rows(rng, n)
    batch.append(0, k[0], v[0])
    for bad in ([n], [-1]):
        with pytest.raises(InvalidArgumentError, match=rf"^PagedBatch.gather: rows\[0\] must be "
                                                       rf"in \[0, {n - 1}\], got {bad[0]}"):
            batch.gather(0, rows=bad)
    got_k, _ = batch.gather(0, rows=[n - 1])
    want_k, _ = batch.gather(0)
    np.testing.assert_array_equal(np.asarray(got_k)[0], np.asarray(want_k)[n - 1])


def test_replayed_before_a_decode_step_is_refused():
    batch = _forked(step_engine=True)
    with pytest.raises(InvalidArgumentError, match=r"^PagedBatch.replayed: no decode step of "
                                                   r"the engine was begun"):
        batch.replayed()


def test_flags_and_the_engine_scale_are_checked():
    """cascade=1 / "abc" once ran flat silently, step_engine="no" turned the engine on,
    and the engine path's sm_scale went through float() (None: a TypeError)."""
    kw = dict(num_layers=1, num_pages=16, page_size=4, num_kv_heads=1, num_qo_heads=2,
              head_dim=64, dtype="float32", backend="reference")
    for bad in (1, "abc"):
        with pytest.raises(InvalidArgumentError, match="PagedBatch: cascade must be a bool"):
            PagedBatch(**kw, cascade=bad)
    with pytest.raises(InvalidArgumentError, match="PagedBatch: step_engine must be a bool"):
        PagedBatch(**kw, step_engine="no")
    with pytest.raises(InvalidArgumentError, match="step_engine runs flat decodes"):
        PagedBatch(**kw, step_engine=np.True_, cascade=np.True_)
    pb = PagedBatch(**kw, step_engine=True)
    pb.start(2)
    k = np.ones((3, 1, 64), np.float32)
    pb.begin(np.array([3, 3]))
    pb.append(0, np.ones((6, 1, 64), np.float32), np.ones((6, 1, 64), np.float32))
    pb.gather(0)
    pb.begin(None)
    pb.append(0, k[:2], k[:2])
    q = np.ones((2, 2, 64), np.float32)
    for bad, match in ((None, "sm_scale must be a real number"),
                       (1e39, "sm_scale must be at most")):
        with pytest.raises(InvalidArgumentError, match="PagedBatch.decode: " + match):
            pb.decode(0, q, bad)
    assert np.isfinite(np.asarray(pb.decode(0, q, 0.125))).all()
