"""The engine step under random outside changes, against a host model of every sequence.

Between steps the caller appends to, forks, trims, frees and adds sequences (through the
pool and ``DecodeStep.set_sequences``), as an engine's scheduler does; after each
``begin`` the step's device table must equal the pool's host table row for row, and every
live row's decode must match the float64 attention over that sequence's model tokens
(a freed row, a hole in the batch, stays zeros). Seeded; the seeds below reached the
hole bug of session 21 (a freed middle row shifted the rows a general ``begin`` marked
changed, so a later row's new page never reached the device table).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_matches_oracle, run_step

import paged_decode as pd
from paged_decode.reference import attention_f64

P, HKV, D, HQ, L, CAP = 4, 1, 64, 2, 2, 6
OPS = ["none", "append", "fork", "trim", "free", "new"]
OP_P = [0.5, 0.15, 0.1, 0.1, 0.1, 0.05]


def device_rows(step) -> list[list[int]]:
    """Each table row's page ids as the kernels read them (the device buffer)."""
    ind, iptr, lpl, fpo = (np.asarray(a) for a in step.table.device_arrays())
    return [ind[iptr[r]:iptr[r + 1]].tolist() + [int(lpl[r]), int(fpo[r])]
            for r in range(step.capacity)]


def host_rows(step) -> list[list[int]]:
    t = step.table.page_table()
    return [t.indices[t.indptr[r]:t.indptr[r + 1]].tolist()
            + [int(t.last_page_len[r]), int(t.first_page_offset[r])]
            for r in range(step.capacity)]


@pytest.mark.parametrize("seed", [0, 1, 2, 4])
@pytest.mark.parametrize("backend,captured", [("reference", False), ("emulated-cuda", False),
                                              ("emulated-cuda", True)],
                         ids=["reference", "emulated-cuda", "emulated-cuda-captured"])
def test_step_follows_the_pool_through_random_engine_events(backend, captured, seed,
                                                             monkeypatch):
    monkeypatch.setenv("PAGED_DECODE_POISON", "1")
    rng = np.random.default_rng(seed)
    pool = pd.PagePool(300, P, num_kv_heads=HKV, head_dim=D, dtype="float16",
                       num_layers=L, backend=backend)
    model: dict[int, np.ndarray] = {}        # sequence -> its tokens [L, n, HKV, D]

    def new(n: int) -> int:
        s = pool.new_sequence()
        x = rng.standard_normal((L, n, HKV, D)).astype(np.float16)
        if n:
            pool.append(s, x, x)
        model[s] = x
        return s

    rows: list[int | None] = [new(int(rng.integers(1, 9))) for _ in range(3)]
    step = pd.DecodeStep(pool, rows, num_qo_heads=HQ, capacity=CAP,
                         headroom=int(rng.integers(0, 6)),
                         path=str(rng.choice(["v2", "v1", "v2tc", "auto"])))
    q = np.zeros((CAP, HQ, D), np.float16)
    kv = np.zeros((L, CAP, HKV, D), np.float16)
    out = np.zeros((L, CAP, HQ, D), np.float16)

    def body(st):
        for layer in range(L):
            st.append(layer, kv[layer], kv[layer])
            st.decode(layer, q, out=out[layer])

    graph = None
    for it in range(40):
        op = str(rng.choice(OPS, p=OP_P))
        live = [s for s in rows if s is not None]
        if op == "append" and live:
            s, n = int(rng.choice(live)), int(rng.integers(1, 7))
            x = rng.standard_normal((L, n, HKV, D)).astype(np.float16)
            pool.append(s, x, x)
            model[s] = np.concatenate([model[s], x], 1)
        elif op == "fork" and live and len(live) < CAP:
            s = int(rng.choice(live))
            c = pool.fork(s)
            model[c] = model[s].copy()
            rows = [*live, c]
            step.set_sequences(rows)
        elif op == "trim" and live:
            s = int(rng.choice(live))
            n = int(rng.integers(0, model[s].shape[1] + 1))
            pool.trim_front(s, n)
            model[s] = model[s][:, n:]
        elif op == "free" and len(live) > 1:
            s = int(rng.choice(live))
            pool.free(s)
            del model[s]
            rows = [None if r == s else r for r in rows]   # a hole, as engine.md says
        elif op == "new" and len(live) < CAP:
            rows = [*live, new(int(rng.integers(0, 6)))]
            step.set_sequences(rows)
        step.begin()
        q[...] = rng.standard_normal(q.shape)
        kv[...] = rng.standard_normal(kv.shape)
        for r, s in enumerate(rows):
            if s is not None:
                model[s] = np.concatenate([model[s], kv[:, r:r + 1]], 1)
        graph = run_step(step, body, graph, captured)
        step.table.flush()
        assert device_rows(step) == host_rows(step), f"step {it} after {op}"
        for layer in range(L):
            for r in range(CAP):
                s = rows[r] if r < len(rows) else None
                if s is None:
                    assert not np.abs(out[layer, r]).any(), f"step {it}: empty row {r}"
                    continue
                k = model[s][layer].astype(np.float64)
                want, _ = attention_f64(q[r].astype(np.float64), k, k, 1 / np.sqrt(D))
                assert_matches_oracle(out[layer, r], None, want, None, "float16",
                                      f"seed {seed} step {it} ({op}) layer {layer} row {r}")
