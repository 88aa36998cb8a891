"""PagePool: appends across pages, fork + copy-on-write, trims, frees, exhaustion."""

from __future__ import annotations

import numpy as np
import pytest

from paged_decode import (
    InvalidArgumentError,
    InvalidDtypeError,
    PagePool,
    PoolExhaustedError,
)
from paged_decode.reference import request_kv_f64

P, HKV, D = 4, 2, 3


# ---------------------------------------------------------------------------- helpers
class Model:
    """What each sequence should hold: its visible K and V rows and its trimmed count."""

    def __init__(self) -> None:
        self.k: dict[int, np.ndarray] = {}
        self.v: dict[int, np.ndarray] = {}
        self.trimmed: dict[int, int] = {}

    def new(self, seq: int) -> None:
        self.k[seq] = np.zeros((0, HKV, D))
        self.v[seq] = np.zeros((0, HKV, D))
        self.trimmed[seq] = 0

    def append(self, seq: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k[seq] = np.concatenate([self.k[seq], k.astype(np.float64)])
        self.v[seq] = np.concatenate([self.v[seq], v.astype(np.float64)])

    def fork(self, src: int, dst: int) -> None:
        self.k[dst], self.v[dst] = self.k[src].copy(), self.v[src].copy()
        self.trimmed[dst] = self.trimmed[src]

    def trim(self, seq: int, n: int) -> None:
        self.k[seq], self.v[seq] = self.k[seq][n:], self.v[seq][n:]
        self.trimmed[seq] += n

    def free(self, seq: int) -> None:
        del self.k[seq], self.v[seq], self.trimmed[seq]


def tokens(rng: np.random.Generator, n: int, lead: tuple[int, ...] = ()) -> np.ndarray:
    """Random K or V rows, exactly representable in float16."""
    return rng.integers(-64, 64, (*lead, n, HKV, D)).astype(np.float32) / 4


def assert_pool_holds(pool: PagePool, model: Model) -> None:
    """Every sequence reads back (through its page table) exactly what the model holds."""
    seqs = sorted(model.k)
    assert sorted(pool.sequences()) == seqs
    if not seqs:
        return
    t = pool.page_table(seqs)
    for r, s in enumerate(seqs):
        assert pool.seq_len(s) == len(model.k[s]) == int(t.visible_lens[r])
        assert int(t.rope_positions[r]) == model.trimmed[s] + len(model.k[s])
        np.testing.assert_array_equal(request_kv_f64(pool.k, t, r), model.k[s])
        np.testing.assert_array_equal(request_kv_f64(pool.v, t, r), model.v[s])


def assert_refcounts_consistent(pool: PagePool) -> None:
    """Refcount of a page == number of live sequences holding it; free == unreferenced."""
    held = np.zeros(pool.num_pages, np.int64)
    for s in pool.sequences():
        for p in pool.seq_pages(s):
            held[p] += 1
    assert [pool.refcount(p) for p in range(pool.num_pages)] == held.tolist()
    assert pool.num_free == int((held == 0).sum())


def snapshot(pool: PagePool) -> dict:
    """All observable state of a pool."""
    seqs = pool.sequences()
    return {
        "free": pool.num_free,
        "ref": [pool.refcount(p) for p in range(pool.num_pages)],
        "seqs": {s: (pool.seq_pages(s), pool.seq_len(s)) for s in seqs},
        "table": [a.tolist() for a in _table_arrays(pool, seqs)],
        "k": np.array(pool.k, copy=True),
        "v": np.array(pool.v, copy=True),
    }


def _table_arrays(pool, seqs):
    if not seqs:
        return []
    t = pool.page_table(seqs)
    return [t.indices, t.indptr, t.last_page_len, t.first_page_offset, t.rope_positions]


def assert_same_state(a: dict, b: dict) -> None:
    for key in ("free", "ref", "seqs", "table"):
        assert a[key] == b[key], key
    np.testing.assert_array_equal(a["k"], b["k"])
    np.testing.assert_array_equal(a["v"], b["v"])


def make_pool(num_pages: int = 16, **kw) -> PagePool:
    return PagePool(num_pages, P, HKV, D, kw.pop("dtype", "float32"), **kw)


# ---------------------------------------------------------------------------- appends
@pytest.mark.parametrize("chunks", [[1] * 9, [3, 5, 1], [4, 4], [11], [0, 2, 0, 7], [13, 3]])
def test_append_across_page_boundaries(chunks):
    rng = np.random.default_rng(sum(chunks))
    pool, model = make_pool(), Model()
    s = pool.new_sequence()
    model.new(s)
    for n in chunks:
        k, v = tokens(rng, n), tokens(rng, n)
        pool.append(s, k, v)
        model.append(s, k, v)
        assert_pool_holds(pool, model)
    total = sum(chunks)
    assert len(pool.seq_pages(s)) == -(-total // P)
    assert pool.num_free == 16 - -(-total // P)
    assert_refcounts_consistent(pool)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_append_casts_to_pool_dtype(dtype):
    pool, model = make_pool(dtype=dtype), Model()
    s = pool.new_sequence()
    model.new(s)
    rng = np.random.default_rng(0)
    k, v = tokens(rng, 6), tokens(rng, 6)   # exactly representable in every dtype here
    pool.append(s, k, v)
    model.append(s, k, v)
    assert str(pool.k.dtype) == dtype and pool.k.shape == (16, P, HKV, D)
    assert_pool_holds(pool, model)


def test_two_sequences_do_not_interfere():
    rng = np.random.default_rng(1)
    pool, model = make_pool(), Model()
    a, b = pool.new_sequence(), pool.new_sequence()
    model.new(a), model.new(b)
    for n_a, n_b in [(3, 2), (5, 6), (1, 1)]:
        ka, va, kb, vb = (tokens(rng, n) for n in (n_a, n_a, n_b, n_b))
        pool.append(a, ka, va), model.append(a, ka, va)
        pool.append(b, kb, vb), model.append(b, kb, vb)
    assert set(pool.seq_pages(a)).isdisjoint(pool.seq_pages(b))
    assert_pool_holds(pool, model)


# ---------------------------------------------------------------------------- fork / COW
def test_fork_copy_on_write_of_shared_partial_page():
    rng = np.random.default_rng(2)
    pool, model = make_pool(8), Model()
    a = pool.new_sequence()
    model.new(a)
    k, v = tokens(rng, 6), tokens(rng, 6)             # pages 0 (full), 1 (2 of 4)
    pool.append(a, k, v), model.append(a, k, v)
    b = pool.fork(a)
    model.fork(a, b)
    assert pool.seq_pages(b) == pool.seq_pages(a) == [0, 1]
    assert [pool.refcount(p) for p in (0, 1)] == [2, 2] and pool.num_free == 6
    parent_k = np.array(pool.k[1], copy=True)

    k2, v2 = tokens(rng, 3), tokens(rng, 3)           # child writes into the shared page
    pool.append(b, k2, v2), model.append(b, k2, v2)
    assert pool.seq_pages(a) == [0, 1]
    assert pool.seq_pages(b)[0] == 0 and pool.seq_pages(b)[1] not in (0, 1)
    assert pool.refcount(0) == 2 and pool.refcount(1) == 1
    np.testing.assert_array_equal(pool.k[1], parent_k)  # parent's page untouched
    assert_pool_holds(pool, model)
    assert_refcounts_consistent(pool)

    k3, v3 = tokens(rng, 1), tokens(rng, 1)           # parent's page is private again
    free_before = pool.num_free
    pool.append(a, k3, v3), model.append(a, k3, v3)
    assert pool.seq_pages(a) == [0, 1] and pool.num_free == free_before
    assert_pool_holds(pool, model)


def test_parent_append_after_fork_also_copies():
    rng = np.random.default_rng(3)
    pool, model = make_pool(8), Model()
    a = pool.new_sequence()
    model.new(a)
    k, v = tokens(rng, 5), tokens(rng, 5)
    pool.append(a, k, v), model.append(a, k, v)
    b = pool.fork(a)
    model.fork(a, b)
    k2, v2 = tokens(rng, 2), tokens(rng, 2)
    pool.append(a, k2, v2), model.append(a, k2, v2)
    assert pool.seq_pages(b) == [0, 1] and pool.seq_pages(a)[1] != 1
    assert_pool_holds(pool, model)
    assert_refcounts_consistent(pool)


def test_fork_shares_full_pages_without_copy():
    rng = np.random.default_rng(4)
    pool, model = make_pool(8), Model()
    a = pool.new_sequence()
    model.new(a)
    k, v = tokens(rng, 8), tokens(rng, 8)             # two full pages
    pool.append(a, k, v), model.append(a, k, v)
    b = pool.fork(a)
    model.fork(a, b)
    k2, v2 = tokens(rng, 3), tokens(rng, 3)
    pool.append(b, k2, v2), model.append(b, k2, v2)   # no COW: a fresh page
    assert pool.seq_pages(b)[:2] == pool.seq_pages(a) == [0, 1]
    assert [pool.refcount(p) for p in (0, 1, 2)] == [2, 2, 1]
    assert pool.num_free == 5
    assert_pool_holds(pool, model)


def test_fork_of_fork_and_free_order():
    rng = np.random.default_rng(5)
    pool, model = make_pool(8), Model()
    a = pool.new_sequence()
    model.new(a)
    k, v = tokens(rng, 6), tokens(rng, 6)
    pool.append(a, k, v), model.append(a, k, v)
    b = pool.fork(a)
    model.fork(a, b)
    c = pool.fork(b)
    model.fork(b, c)
    assert [pool.refcount(p) for p in (0, 1)] == [3, 3]
    pool.free(a), model.free(a)
    assert [pool.refcount(p) for p in (0, 1)] == [2, 2] and pool.num_free == 6
    assert_pool_holds(pool, model)
    pool.free(c), model.free(c)
    pool.free(b), model.free(b)
    assert pool.num_free == 8 and all(pool.refcount(p) == 0 for p in range(8))


# ---------------------------------------------------------------------------- trims
def test_trim_front_releases_retired_pages():
    rng = np.random.default_rng(6)
    pool, model = make_pool(8), Model()
    s = pool.new_sequence()
    model.new(s)
    k, v = tokens(rng, 10), tokens(rng, 10)           # pages 0, 1, 2
    pool.append(s, k, v), model.append(s, k, v)
    pool.trim_front(s, 3), model.trim(s, 3)           # page 0 still holds token 3
    t = pool.page_table([s])
    assert pool.seq_pages(s) == [0, 1, 2] and int(t.first_page_offset[0]) == 3
    pool.trim_front(s, 2), model.trim(s, 2)           # now 5 retired: page 0 goes
    t = pool.page_table([s])
    assert pool.seq_pages(s) == [1, 2] and int(t.first_page_offset[0]) == 1
    assert pool.refcount(0) == 0 and pool.num_free == 6
    assert int(t.rope_positions[0]) == 10 and int(t.visible_lens[0]) == 5
    assert_pool_holds(pool, model)
    k2, v2 = tokens(rng, 7), tokens(rng, 7)           # appends continue at the end
    pool.append(s, k2, v2), model.append(s, k2, v2)
    assert_pool_holds(pool, model)
    assert_refcounts_consistent(pool)


def test_trim_of_shared_pages_only_drops_references():
    rng = np.random.default_rng(7)
    pool, model = make_pool(8), Model()
    a = pool.new_sequence()
    model.new(a)
    k, v = tokens(rng, 9), tokens(rng, 9)
    pool.append(a, k, v), model.append(a, k, v)
    b = pool.fork(a)
    model.fork(a, b)
    pool.trim_front(b, 8), model.trim(b, 8)
    assert pool.seq_pages(b) == [2] and pool.seq_pages(a) == [0, 1, 2]
    assert [pool.refcount(p) for p in (0, 1, 2)] == [1, 1, 2] and pool.num_free == 5
    assert_pool_holds(pool, model)


@pytest.mark.parametrize("n", [8, 10])
def test_trim_everything(n):
    rng = np.random.default_rng(n)
    pool, model = make_pool(8), Model()
    s = pool.new_sequence()
    model.new(s)
    k, v = tokens(rng, n), tokens(rng, n)
    pool.append(s, k, v), model.append(s, k, v)
    pool.trim_front(s, n), model.trim(s, n)
    t = pool.page_table([s])
    assert int(t.visible_lens[0]) == 0 and int(t.rope_positions[0]) == n
    if n % P == 0:   # full pages: nothing left
        assert pool.seq_pages(s) == [] and pool.num_free == 8
        assert int(t.last_page_len[0]) == 0 and int(t.first_page_offset[0]) == 0
    else:            # the partial last page stays for later appends
        assert len(pool.seq_pages(s)) == 1 and pool.num_free == 7
        assert int(t.last_page_len[0]) == int(t.first_page_offset[0]) == n % P
    k2, v2 = tokens(rng, 6), tokens(rng, 6)
    pool.append(s, k2, v2), model.append(s, k2, v2)
    assert_pool_holds(pool, model)
    assert_refcounts_consistent(pool)


# ---------------------------------------------------------------------------- free
def test_free_returns_pages():
    rng = np.random.default_rng(8)
    pool = make_pool(8)
    a, b = pool.new_sequence(), pool.new_sequence()
    pool.append(a, tokens(rng, 9), tokens(rng, 9))
    pool.append(b, tokens(rng, 4), tokens(rng, 4))
    assert pool.num_free == 4
    pool.free(a)
    assert pool.num_free == 7 and pool.sequences() == [b]
    assert all(pool.refcount(p) == 0 for p in range(8) if p not in pool.seq_pages(b))
    pool.free(b)
    assert pool.num_free == 8 and pool.sequences() == []
    with pytest.raises(InvalidArgumentError, match=r"\bfree: unknown sequence"):
        pool.free(b)
    # all 8 pages are usable again
    c = pool.new_sequence()
    pool.append(c, tokens(rng, 32), tokens(rng, 32))
    assert pool.num_free == 0 and sorted(pool.seq_pages(c)) == list(range(8))


# ---------------------------------------------------------------------------- exhaustion
def build_history(pool: PagePool, rng: np.random.Generator) -> list[int]:
    """Shared, partial and trimmed sequences in 4 pages (peak use 4, deterministic)."""
    lead = _lead(pool)
    c = pool.new_sequence()
    pool.append(c, tokens(rng, 9, lead), tokens(rng, 9, lead))
    pool.trim_front(c, 5)                          # c: 2 pages, 3 entries of room
    a = pool.new_sequence()
    pool.append(a, tokens(rng, 6, lead), tokens(rng, 6, lead))
    b = pool.fork(a)                               # shares a's partial page (2 of 4)
    return [a, b, c]


def _lead(pool: PagePool) -> tuple[int, ...]:
    return () if pool.num_layers is None else (pool.num_layers,)


# build_history leaves 4 pages in use: a and b share [0, 1] (page 1 holds 2 of 4 entries),
# c holds 2 pages with 3 free entries at the end.
EXHAUSTING = {
    # name: (pages in pool, index of the sequence appended to, tokens)
    "new-pages": (5, 2, 9),        # c: 3 entries of room, needs 2 new pages, 1 free
    "cow-only": (4, 1, 1),         # b writes into the page shared with a: 1 copy, 0 free
    "cow-plus-pages": (5, 1, 6),   # b: 1 copy + 1 new page, 1 free
}


@pytest.mark.parametrize("layers", [None, 2])
@pytest.mark.parametrize("name", list(EXHAUSTING))
def test_exhaustion_leaves_pool_intact(name, layers):
    num_pages, which, n = EXHAUSTING[name]
    pool = make_pool(num_pages, num_layers=layers)
    twin = make_pool(num_pages, num_layers=layers)   # same history, never fails
    seqs = build_history(pool, np.random.default_rng(9))
    assert build_history(twin, np.random.default_rng(9)) == seqs
    assert pool.num_free == num_pages - 4
    before = snapshot(pool)
    rng = np.random.default_rng(10)
    k, v = tokens(rng, n, _lead(pool)), tokens(rng, n, _lead(pool))
    with pytest.raises(PoolExhaustedError, match=r"PagePool.append: need \d+ free pages for "
                                                 rf"{n} tokens, the pool has "
                                                 rf"{num_pages - 4} of {num_pages}; "
                                                 r"nothing was changed"):
        pool.append(seqs[which], k, v)
    assert_same_state(snapshot(pool), before)
    # and the pool goes on exactly like one that never saw the failed call (same free
    # list order: the same pages get handed out)
    for p in (pool, twin):
        for s in seqs:
            if s != seqs[which]:
                p.free(s)
        p.append(seqs[which], k, v)
    assert_same_state(snapshot(pool), snapshot(twin))


def test_exhaustion_needs_the_cow_page_too():
    # 1 page free; the child's append fits the shared page's room but must copy it first:
    # with the copy it needs exactly 1 page (ok); with 2 free entries of room and a 3rd
    # token it needs 2 (refused).
    rng = np.random.default_rng(12)
    pool = make_pool(2)
    a = pool.new_sequence()
    pool.append(a, tokens(rng, 2), tokens(rng, 2))
    b = pool.fork(a)
    before = snapshot(pool)
    with pytest.raises(PoolExhaustedError, match=r"need 2 free pages"):
        pool.append(b, tokens(rng, 3), tokens(rng, 3))
    assert_same_state(snapshot(pool), before)
    pool.append(b, tokens(rng, 2), tokens(rng, 2))   # exactly the one COW page
    assert pool.num_free == 0 and pool.refcount(0) == 1 and pool.refcount(1) == 1


# ---------------------------------------------------------------------------- layers
def test_num_layers_pool():
    rng = np.random.default_rng(13)
    pool = make_pool(8, num_layers=3)
    assert pool.k.shape == pool.v.shape == (3, 8, P, HKV, D)
    a = pool.new_sequence()
    ka, va = tokens(rng, 6, (3,)), tokens(rng, 6, (3,))
    pool.append(a, ka, va)
    b = pool.fork(a)
    kb, vb = tokens(rng, 3, (3,)), tokens(rng, 3, (3,))
    pool.append(b, kb, vb)                         # COW copies the page in every layer
    t = pool.page_table([a, b])
    for i in range(3):
        k_i, v_i = pool.layer(i)
        assert k_i.shape == (8, P, HKV, D)
        np.testing.assert_array_equal(request_kv_f64(k_i, t, 0), ka[i])
        np.testing.assert_array_equal(request_kv_f64(v_i, t, 0), va[i])
        np.testing.assert_array_equal(request_kv_f64(k_i, t, 1),
                                      np.concatenate([ka[i], kb[i]]))
        np.testing.assert_array_equal(request_kv_f64(v_i, t, 1),
                                      np.concatenate([va[i], vb[i]]))
    with pytest.raises(InvalidArgumentError, match=r"PagePool.layer: i must be in \[0, 3\)"):
        pool.layer(3)
    with pytest.raises(InvalidArgumentError, match=r"k must be \[L, T, Hkv, D\]"):
        pool.append(a, tokens(rng, 2), tokens(rng, 2))


def test_single_layer_pool_layer_zero():
    pool = make_pool(4)
    assert pool.layer(0)[0] is pool.k and pool.layer(0)[1] is pool.v
    with pytest.raises(InvalidArgumentError, match=r"the pool has one layer, got 1"):
        pool.layer(1)


# ---------------------------------------------------------------------------- random ops
def test_random_operation_sequence_matches_model():
    rng = np.random.default_rng(14)
    pool, model = make_pool(24), Model()
    for _ in range(300):
        live = pool.sequences()
        op = rng.choice(["new", "append", "append", "fork", "trim", "free"])
        if op == "new" or not live:
            model.new(pool.new_sequence())
            continue
        s = int(rng.choice(live))
        if op == "append":
            n = int(rng.integers(0, 10))
            k, v = tokens(rng, n), tokens(rng, n)
            try:
                pool.append(s, k, v)
            except PoolExhaustedError:
                continue           # state checked below: must still match the model
            model.append(s, k, v)
        elif op == "fork":
            model.fork(s, pool.fork(s))
        elif op == "trim":
            n = int(rng.integers(0, pool.seq_len(s) + 1))
            pool.trim_front(s, n), model.trim(s, n)
        else:
            pool.free(s), model.free(s)
        assert_pool_holds(pool, model)
        assert_refcounts_consistent(pool)


# ---------------------------------------------------------------------------- bad args
def test_append_rejects_bad_arguments():
    rng = np.random.default_rng(15)
    pool = make_pool(8)
    s = pool.new_sequence()
    good = tokens(rng, 3)
    with pytest.raises(InvalidArgumentError,
                       match=r"PagePool.append: k must have shape \[T, Hkv, D\] = "
                             r"\[3, 2, 3\], got \[3, 3, 3\]"):
        pool.append(s, np.zeros((3, 3, 3), np.float32), good)
    with pytest.raises(InvalidArgumentError,
                       match=r"PagePool.append: v must have shape \[T, Hkv, D\] = "
                             r"\[3, 2, 3\], got \[2, 2, 3\]"):
        pool.append(s, good, good[:2])
    with pytest.raises(InvalidArgumentError, match=r"PagePool.append: k must be \[T, Hkv, D\]"):
        pool.append(s, good[0], good[0])
    with pytest.raises(InvalidDtypeError, match=r"PagePool.append: k must have dtype"):
        pool.append(s, good.astype(np.float64), good)
    with pytest.raises(InvalidArgumentError, match=r"PagePool.append: unknown sequence 99"):
        pool.append(99, good, good)
    assert pool.num_free == 8 and pool.seq_len(s) == 0   # nothing was written


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_append_rejects_integer_values_naming_the_argument(dtype):
    pool = make_pool(8)
    s = pool.new_sequence()
    good = tokens(np.random.default_rng(0), 3)
    with pytest.raises(InvalidDtypeError, match=r"PagePool.append: v must have dtype"):
        pool.append(s, good, good.astype(dtype))


def test_trim_and_lookups_reject_bad_arguments():
    rng = np.random.default_rng(16)
    pool = make_pool(8)
    s = pool.new_sequence()
    pool.append(s, tokens(rng, 10), tokens(rng, 10))
    for n in (-1, 11, 1.5):
        with pytest.raises(InvalidArgumentError,
                           match=rf"PagePool.trim_front: n must be an integer in \[0, 10\] "
                                 rf"\(the visible length of sequence {s}\), got {n!r}"):
            pool.trim_front(s, n)
    assert pool.seq_len(s) == 10
    for call in (lambda: pool.trim_front(7, 1), lambda: pool.fork(7),
                 lambda: pool.page_table([s, 7]), lambda: pool.seq_pages(7)):
        with pytest.raises(InvalidArgumentError, match=r"unknown sequence 7; live sequences: "
                                                       rf"\[{s}\]"):
            call()


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(num_pages=0), r"PagePool: num_pages must be an integer in \[1, 2147483647\], got 0"),
    (dict(page_size=-1), r"PagePool: page_size must be an integer in \[1, 2147483647\], "
                         r"got -1"),
    (dict(num_kv_heads=2.0), r"PagePool: num_kv_heads must be a positive integer"),
    (dict(head_dim=0), r"PagePool: head_dim must be a positive integer"),
    (dict(num_layers=0), r"PagePool: num_layers must be a positive integer or None"),
])
def test_pool_constructor_rejects(kwargs, pattern):
    args = dict(num_pages=4, page_size=4, num_kv_heads=2, head_dim=8)
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=pattern):
        PagePool(**args)


def test_pool_constructor_rejects_dtype():
    with pytest.raises(InvalidDtypeError, match=r"PagePool: dtype must have dtype in"):
        PagePool(4, 4, 2, 8, "float64")
