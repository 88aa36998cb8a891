"""One upload per begin and the table update inside the captured step (issue #13's host
time): ``DecodeStep.begin`` sends the table delta and the append descriptor in one copy
(``paged_decode/step_upload.py``) and leaves the device update pending; the update runs
as the step's first device work: recorded first in a captured graph, or eagerly before
any reader of the device table. Captured steps on ``emulated-cuda`` are recorded graphs
(launches and device copies replayed on the same arrays, none of the host code that made
them), so a replay that skipped the update, or read a buffer rebound since capture,
shows in the outputs.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import assert_matches_oracle
from test_engine_step import HKV, HQ, D, L, P
from test_engine_step import _setup as engine_setup

import paged_decode as pd
from paged_decode.backends import cuda_staging
from paged_decode.bench.device_calls import DeviceCalls
from paged_decode.errors import InvalidArgumentError
from paged_decode.kernels.table_update import delta_header_words, table_views
from paged_decode.reference import oracle_decode
from paged_decode.step_upload import StepUpload

BACKENDS = ["reference", "emulated-cuda", "emulated-metal"]


def _setup(backend, headroom=16, seed=1):
    """test_engine_step's pool and step (a fork: copy-on-write), more headroom."""
    return engine_setup(backend, np.random.default_rng(seed), headroom=headroom)


def _raw(step):
    """The device table buffer as it is (no flush)."""
    return np.array(step.backend.to_numpy(step.table.buffer))


def _assert_buffer_is_the_pools(step, what):
    """The raw device buffer against the pool's own page lists (nothing flushed here)."""
    t = step.table
    got = table_views(_raw(step), t.capacity)
    ip = got["indptr"]
    for r, s in enumerate(t.sequences):
        pages = got["indices"][ip[r]:ip[r + 1]].tolist()
        assert pages == ([] if s < 0 else step.pool.seq_pages(int(s))), f"{what}: row {r}"
        if s >= 0:
            n = step.pool.seq_len(int(s))
            assert got["last_page_len"][r] == n - (len(pages) - 1) * P, f"{what}: row {r}"


def _oracle(pool, step, layer, q):
    k, v = pool.layer(layer)
    return oracle_decode(q, np.asarray(k), np.asarray(v), step.table.page_table())


READERS = ["step-decode", "decode-outside-the-step", "page_table", "flush",
           "device_arrays", "next-begin"]


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_pending_update_is_applied_before_every_reader(backend, reader, monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    pool, step = _setup(backend)
    t, cap = step.table, step.capacity
    rng = np.random.default_rng(2)
    q = rng.standard_normal((cap, HQ, D)).astype(np.float32)
    out = np.full((cap, HQ, D), np.nan, np.float32)
    for it in range(6):                                # every row crosses a page
        before = _raw(step)
        step.begin()
        # deferred: the begin sent the delta, the device table is still the old one
        assert t.pending and not t.changed, f"step {it}"
        np.testing.assert_array_equal(_raw(step), before, err_msg=f"step {it}")
        if reader in ("step-decode", "decode-outside-the-step"):
            out[...] = np.nan
            if reader == "step-decode":     # the step's first call, then its decode
                x = rng.standard_normal((cap, HKV, D)).astype(np.float32)
                step.append(0, x, x)
                step.decode(0, q, out=out)
            else:
                k, v = pool.layer(0)
                pd.decode(q, k, v, t, step.plan, out=out, backend=step.backend)
            want, _ = _oracle(pool, step, 0, q)
            assert_matches_oracle(out, None, want, None, "float32", f"{reader} {it}")
        elif reader == "page_table":
            t.page_table()
        elif reader == "flush":
            assert t.flush()
        elif reader == "device_arrays":
            t.device_arrays()
        else:           # a begin without a step between: refused, the update stays pending
            with pytest.raises(InvalidArgumentError, match=r"DecodeStep.begin: the last "
                                                           r"begin\(\) reserved"):
                step.begin()
            assert t.pending
            t.flush()
        assert not t.pending, f"{reader} {it}"
        _assert_buffer_is_the_pools(step, f"{reader} {it}")
        for layer in step.unwritten_layers():
            x = rng.standard_normal((cap, HKV, D)).astype(np.float32)
            step.append(layer, x, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_captured_replay_equals_the_eager_step_and_the_oracle(backend, monkeypatch):
    """Twin pools, one stepped eagerly, one by a captured step, the same rows and queries,
    over page-boundary crossings and one replan: outputs equal (bit for bit: the same
    kernels on the same data) and equal to the oracle, and the pools stay equal."""
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    (pa, sa), (pb, sb) = _setup(backend, headroom=6), _setup(backend, headroom=6)
    cap = sa.capacity
    rng = np.random.default_rng(3)
    q = [np.empty((cap, HQ, D), np.float32) for _ in range(L)]
    ks = [np.empty((cap, HKV, D), np.float32) for _ in range(L)]
    outs = {id(sa): [np.full((cap, HQ, D), np.nan, np.float32) for _ in range(L)],
            id(sb): [np.full((cap, HQ, D), np.nan, np.float32) for _ in range(L)]}

    def body(st):
        for layer in range(L):
            st.append(layer, ks[layer], ks[layer])
            st.decode(layer, q[layer], out=outs[id(st)][layer])

    graph, captures = None, 0
    for it in range(12):
        for layer in range(L):
            q[layer][...] = rng.standard_normal((cap, HQ, D))
            ks[layer][...] = rng.standard_normal((cap, HKV, D))
        sa.begin()
        body(sa)
        sb.begin()
        if graph is None or graph.stale:
            graph = sb.capture(body)
            captures += 1
        else:
            graph.replay()
        assert not sb.table.pending, f"step {it}"
        for layer in range(L):
            np.testing.assert_array_equal(outs[id(sb)][layer], outs[id(sa)][layer],
                                          err_msg=f"step {it} layer {layer}")
            want, _ = _oracle(pb, sb, layer, q[layer])
            assert_matches_oracle(outs[id(sb)][layer], None, want, None, "float32",
                                  f"step {it} layer {layer}")
        _assert_buffer_is_the_pools(sb, f"step {it}")
    assert sb.replans >= 1 and captures >= 2        # a replan made the graph stale
    for layer in range(L):
        np.testing.assert_array_equal(sa.backend.to_numpy(pa.layer(layer)[0]),
                                      sb.backend.to_numpy(pb.layer(layer)[0]))


def test_one_upload_per_begin_and_no_table_update_outside_the_graph():
    """Counted on emulated-cuda (its captured steps are recorded graphs): a steady begin
    makes one upload and no device work; a replay makes no table update on the host, its
    graph starts with the table update; an eager step applies the update once."""
    pool, step = _setup("emulated-cuda")
    cap = step.capacity
    k = np.ones((cap, HKV, D), np.float32)

    def body(st):
        for layer in range(L):
            st.append(layer, k, k)

    step.begin()                                        # general (arms the steady path)
    graph = step.capture(body)
    assert graph.graph[0][0] == "copy"                  # buffer -> scratch, then update
    assert graph.graph[1][0] == "launch" and graph.graph[1][1].spec.kernel == "table_update"
    with DeviceCalls(step.backend) as calls:
        for it in range(8):
            step.begin()
            assert calls.take() == {"stage_int32": 1}, f"begin {it}"
            graph.replay()
            got = calls.take()
            assert got == {"replay_graph": 1, "graph:table_update": 1, "graph:append": L}, \
                f"replay {it}: {got}"
        step.begin()
        body(step)                                      # eager: the update, once
        got = calls.take()
        assert got == {"stage_int32": 1, "update_table": 1, "device_copy": 1,
                       "launch:table_update": 1, "launch:append": L}, got
    _assert_buffer_is_the_pools(step, "after the loop")


def test_a_replay_after_an_eager_read_of_a_moving_delta(monkeypatch):
    """A delta that moves rows (a front trim) is not safe to apply twice; after a reader
    applied it eagerly, the graph's update on replay must change nothing."""
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    pool, step = _setup("emulated-cuda", headroom=16)
    cap = step.capacity
    rng = np.random.default_rng(4)
    q = rng.standard_normal((cap, HQ, D)).astype(np.float32)
    k = rng.standard_normal((cap, HKV, D)).astype(np.float32)
    out = np.full((cap, HQ, D), np.nan, np.float32)

    def body(st):
        for layer in range(L):
            st.append(layer, k, k)
        st.decode(0, q, out=out)

    step.begin()
    graph = step.capture(body)
    for it, row in enumerate([2, 3, 2]):
        pool.trim_front(int(step.sequences[row]), P)  # the row drops its first page
        step.begin()
        step.table.page_table()                      # applies the update eagerly
        graph.replay()                               # its update must be a no-op now
        assert not graph.stale
        want, _ = _oracle(pool, step, 0, q)
        assert_matches_oracle(out, None, want, None, "float32", f"step {it}")
        _assert_buffer_is_the_pools(step, f"step {it}")


def test_the_upload_layout_and_its_bound():
    pool, step = _setup("emulated-cuda")
    up, cap = step.table.upload, step.capacity
    assert up.staged and step._desc is up.desc
    assert up.desc.shape == (5, cap)
    assert up.delta.size == delta_header_words(cap) + step.table.page_capacity
    # the descriptor and the delta are one buffer (one copy): desc first
    assert up.desc.base is up.device and up.delta.base is up.device
    too_big = np.zeros(up.delta_words + 1, np.int32)
    with pytest.raises(RuntimeError, match=r"StepUpload.send: a delta of \d+ words does not "
                                           r"fit the staging buffer's \d+"):
        up.send(None, too_big)
    assert not StepUpload(pd.get_backend("reference"), 4, 8).staged


class _AsyncModel:
    """A model of CuPy's asynchronous copies for ``PinnedStaging``: ``memcpyAsync`` is
    queued and reads its source when it runs; an event runs the queue up to where it was
    recorded when synchronized; ``observe`` queues a device-side read of a buffer (a
    kernel reading the copied data)."""

    def __init__(self):
        self.queue, self.seen = [], []
        stream = SimpleNamespace(ptr=0)
        model = self

        class Event:
            def __init__(self, disable_timing=True):
                self.at = 0

            def record(self, stream):
                self.at = len(model.queue)

            def synchronize(self):
                model.run(self.at)

        def memcpy(dst, src, n, kind, stream_ptr):
            model.queue.append(lambda: ctypes.memmove(dst, src, n))

        self.done = 0
        self.cuda = SimpleNamespace(Event=Event,
                                    get_current_stream=lambda: stream,
                                    runtime=SimpleNamespace(memcpyAsync=memcpy))

    def run(self, upto=None):
        upto = len(self.queue) if upto is None else upto
        while self.done < upto:
            self.queue[self.done]()
            self.done += 1

    def observe(self, dev):
        self.queue.append(lambda: self.seen.append(dev.arr.copy()))


class _DeviceArray:
    def __init__(self, n):
        self.arr = np.zeros(n, np.int32)
        self.nbytes = self.arr.nbytes
        self.data = SimpleNamespace(ptr=self.arr.ctypes.data, device_id=0)
        self.device = SimpleNamespace(id=0)


def test_pinned_buffers_are_not_rewritten_before_their_copy_ran():
    """The host queues many uploads to one destination ahead of the device: each queued
    copy must deliver the data it was given, so a pinned buffer is rewritten only after
    the copy that read it ran (``cuda_staging.DEPTH`` buffers in turn)."""
    model = _AsyncModel()
    staging = cuda_staging.PinnedStaging(cuda=SimpleNamespace(cuda=model.cuda),
                                         pinned=lambda n: np.zeros(n, np.uint8))
    dev = _DeviceArray(64)
    sent = []
    for i in range(7):
        a = np.arange(40, dtype=np.int32) * (i + 1)
        b = np.full(8, -i, np.int32)
        staging.copy(dev, a, b)                         # two parts, one copy
        sent.append(np.concatenate([a, b]))
        model.observe(dev)
    model.run()
    assert len(model.seen) == 7
    for i, (got, want) in enumerate(zip(model.seen, sent)):
        np.testing.assert_array_equal(got[:48], want, err_msg=f"upload {i}")
    assert model.done == 14 and cuda_staging.DEPTH >= 2
