"""``PagePool.append_batch`` (and every other pool operation) against a pure-Python model
of the pool, on every CPU backend: ``reference`` (numpy), ``emulated-cuda`` and
``emulated-metal`` (the append kernel's CUDA and Metal strings on the CPU emulator) and
``mlx`` (MLX ops) where MLX imports. Pools start NaN-poisoned, so a visible entry the
write misses cannot pass. Also: copy-on-write in a batch, the all-or-nothing rule,
layers, bad input, and mutated kernels that must fail. Nothing runs on Apple hardware.
"""

from __future__ import annotations

import copy
import zlib

import numpy as np
import pytest
from mutants import Mutation, backend, control

import paged_decode as pd
from paged_decode import InvalidArgumentError, InvalidDtypeError, PoolExhaustedError
from paged_decode.backends import availability
from paged_decode.emulator import KernelFault, RaceError

BACKENDS = [pytest.param(n, marks=pytest.mark.skipif(
    not availability(n).ok, reason=f"{n}: {availability(n).reason}"))
    for n in ("reference", "emulated-cuda", "emulated-metal", "mlx")]


# ---------------------------------------------------------------------------- the model
class ModelExhausted(Exception):
    pass


class ModelPool:
    """The pool as lists and dicts, one obvious loop per operation.

    ``seqs[id] = [pages, start, filled, trimmed]``; ``ref[page]``; ``free`` a list popped
    from the end (0, 1, 2, ... first; released pages pushed at the end); ``data[(layer,
    page, slot)] = (k_row, v_row)`` (``None``: written by no layer-wise call yet). A batch
    is ``append`` for each sequence in order, tried on a copy and kept only if it fits.
    """

    def __init__(self, num_pages: int, page_size: int, layers: int | None) -> None:
        self.P, self.L = page_size, layers or 1
        self.free = list(range(num_pages - 1, -1, -1))
        self.ref = [0] * num_pages
        self.seqs: dict[int, list] = {}
        self.data: dict[tuple[int, int, int], tuple | None] = {}
        self.next_id = 0

    def new(self) -> int:
        self.seqs[self.next_id] = [[], 0, 0, 0]
        self.next_id += 1
        return self.next_id - 1

    def fork(self, s: int) -> int:
        pages, start, filled, trimmed = self.seqs[s]
        c = self.new()
        self.seqs[c] = [list(pages), start, filled, trimmed]
        for p in pages:
            self.ref[p] += 1
        return c

    def _release(self, p: int) -> None:
        self.ref[p] -= 1
        if self.ref[p] == 0:
            self.free.append(p)

    def free_seq(self, s: int) -> None:
        for p in self.seqs.pop(s)[0]:
            self._release(p)

    def trim(self, s: int, n: int) -> None:
        st = self.seqs[s]
        st[1] += n
        st[3] += n
        while st[1] >= self.P:
            self._release(st[0].pop(0))
            st[1] -= self.P
            st[2] -= self.P

    def _take(self) -> int:
        if not self.free:
            raise ModelExhausted
        p = self.free.pop()
        self.ref[p] = 1
        return p

    def append(self, s: int, k, v, layer: int | None = None) -> None:
        """``k, v [L, T, ...]`` (``layer=None``) or ``[T, ...]`` for layer ``layer``."""
        pages, _, filled, _ = st = self.seqs[s]
        t = k.shape[-3]
        if t == 0:
            return
        fill = filled - (len(pages) - 1) * self.P
        if pages and fill < self.P and self.ref[pages[-1]] > 1:      # copy-on-write
            old, new = pages[-1], self._take()
            self.ref[old] -= 1
            pages[-1] = new
            for layer_ in range(self.L):
                for slot in range(fill):
                    self.data[(layer_, new, slot)] = self.data[(layer_, old, slot)]
        for i in range(t):
            pos = filled + i
            if pos // self.P == len(pages):
                pages.append(self._take())
            for layer_ in range(self.L):
                key = (layer_, pages[pos // self.P], pos % self.P)
                if layer is None:
                    self.data[key] = (k[layer_, i], v[layer_, i])
                else:
                    self.data[key] = (k[i], v[i]) if layer_ == layer else None
        st[2] = filled + t

    def append_batch(self, seqs, k, v, counts=None, layer=None) -> None:
        counts = [1] * len(seqs) if counts is None else list(counts)
        if layer is None and k.ndim == 3:          # a pool without layers
            k, v = k[None], v[None]
        trial = copy.deepcopy(self)
        at = 0
        for s, n in zip(seqs, counts):
            sl = slice(at, at + n)
            trial.append(s, k[..., sl, :, :], v[..., sl, :, :], layer)
            at += n
        self.__dict__.update(trial.__dict__)

    def write_layer(self, keys: list, k, v, layer: int) -> None:
        for (page, slot), kr, vr in zip(keys, k, v):
            self.data[(layer, page, slot)] = (kr, vr)

    def batch_slots(self, seqs, counts) -> list[tuple[int, int]]:
        """(page, slot) of each new row of the last batch (in the model after it)."""
        out = []
        for s, n in zip(seqs, counts):
            pages, _, filled, _ = self.seqs[s]
            out += [(pages[p // self.P], p % self.P) for p in range(filled - n, filled)]
        return out

    # -- what the pool must report
    def table(self, seqs):
        idx = [p for s in seqs for p in self.seqs[s][0]]
        indptr = np.cumsum([0] + [len(self.seqs[s][0]) for s in seqs])
        lpl, fpo, rope = [], [], []
        for s in seqs:
            pages, start, filled, trimmed = self.seqs[s]
            lpl.append(filled - (len(pages) - 1) * self.P if pages else 0)
            fpo.append(start if pages else 0)
            rope.append(trimmed + filled - start)
        return idx, indptr, lpl, fpo, rope


def check(pool: pd.PagePool, model: ModelPool) -> None:
    """Sequences, page lists, lengths, the page table, refcounts, free count, and every
    visible K/V entry of every layer that the model knows."""
    seqs = sorted(model.seqs)
    assert pool.sequences() == seqs
    assert [pool.refcount(p) for p in range(pool.num_pages)] == model.ref
    assert pool.num_free == len(model.free)
    for s in seqs:
        assert pool.seq_pages(s) == model.seqs[s][0], s
        assert pool.seq_len(s) == model.seqs[s][2] - model.seqs[s][1], s
    if not seqs:
        return
    t = pool.page_table(seqs)
    for got, want in zip((t.indices, t.indptr, t.last_page_len, t.first_page_offset,
                          t.rope_positions), model.table(seqs)):
        assert list(got) == list(want)
    k, v = (pool.backend.to_numpy(a).reshape(model.L, *a.shape[-4:]) for a in (pool.k, pool.v))
    keys, want_k, want_v = [], [], []
    for s in seqs:
        pages, start, filled, _ = model.seqs[s]
        for pos in range(start, filled):
            for layer in range(model.L):
                entry = model.data[(layer, pages[pos // model.P], pos % model.P)]
                if entry is not None:
                    keys.append((layer, pages[pos // model.P], pos % model.P))
                    want_k.append(entry[0])
                    want_v.append(entry[1])
    if keys:
        li, pi, si = np.array(keys).T
        np.testing.assert_array_equal(k[li, pi, si].astype(np.float32), np.array(want_k))
        np.testing.assert_array_equal(v[li, pi, si].astype(np.float32), np.array(want_v))


def make(backend: str, num_pages: int = 32, *, page_size: int = 4, heads: int = 2,
         head_dim: int = 8, dtype: str = "float16", layers: int | None = None):
    """A NaN-poisoned pool and its model."""
    pool = pd.PagePool(num_pages, page_size, heads, head_dim, dtype, num_layers=layers,
                       backend=backend)
    if pool.backend.functional_outputs:            # MLX arrays are values: rebind
        import mlx.core as mx
        pool.k = mx.full(pool.k.shape, float("nan"), pool.k.dtype)
        pool.v = mx.full(pool.v.shape, float("nan"), pool.v.dtype)
    else:
        pool.k[...] = np.nan
        pool.v[...] = np.nan
    return pool, ModelPool(num_pages, page_size, layers)


def rows(rng, pool, n: int, lead: bool):
    """Random K or V rows exactly representable in every pool dtype: float32 on the host
    (the pool converts), ``[L, n, Hkv, D]`` with ``lead`` else ``[n, Hkv, D]``."""
    shape = ((pool.num_layers,) if lead else ()) + (n, pool.num_kv_heads, pool.head_dim)
    return rng.integers(-64, 64, shape).astype(np.float32) / 4


def snapshot(pool):
    """Every observable bit of a pool (the K/V arrays as raw bits: NaNs compare)."""
    def bits(a):
        h = np.ascontiguousarray(pool.backend.to_numpy(a))
        return h.view(np.uint16 if h.itemsize == 2 else np.uint32).copy()
    seqs = pool.sequences()
    t = pool.page_table(seqs) if seqs else None
    return (pool.num_free, [pool.refcount(p) for p in range(pool.num_pages)],
            {s: (pool.seq_pages(s), pool.seq_len(s)) for s in seqs},
            None if t is None else [a.tolist() for a in (t.indices, t.indptr, t.last_page_len,
                                                         t.first_page_offset,
                                                         t.rope_positions)],
            bits(pool.k), bits(pool.v))


def assert_same(a, b):
    assert a[:4] == b[:4]
    np.testing.assert_array_equal(a[4], b[4])
    np.testing.assert_array_equal(a[5], b[5])


# ---------------------------------------------------------------------------- random ops
def random_ops(pool, model, rng, steps: int, *, check_every: int = 1,
               to_pool=None) -> dict[str, int]:
    """``steps`` random operations on both; checks the pool after every ``check_every``;
    returns how often each operation ran (exhausted appends counted apart). ``to_pool``:
    what the pool gets of the model's host float32 rows (default: the same arrays)."""
    layered = pool.num_layers is not None
    conv = (lambda a: a) if to_pool is None else to_pool
    ran: dict[str, int] = {}
    for step in range(steps):
        live = sorted(model.seqs)
        op = str(rng.choice(["new", "fork", "fork", "append", "batch1", "ragged", "ragged", "layer",
                             "flood", "trim", "free", "free"]))
        if op == "new" or not live:
            assert pool.new_sequence() == model.new()
            op = "new"
        elif op == "fork":
            s = int(rng.choice(live))
            assert pool.fork(s) == model.fork(s)
        elif op == "trim":
            s = int(rng.choice(live))
            n = int(rng.integers(0, model.seqs[s][2] - model.seqs[s][1] + 1))
            pool.trim_front(s, n)
            model.trim(s, n)
        elif op == "free":
            s = int(rng.choice(live))
            pool.free(s)
            model.free_seq(s)
        else:
            b = int(rng.integers(1, len(live) + 1))
            seqs = [int(x) for x in rng.permutation(live)[:b]]
            counts = None
            if op == "append":
                seqs, counts = seqs[:1], [int(rng.integers(0, 9))]
            elif op in ("ragged", "layer"):
                counts = [int(x) for x in rng.integers(0, 7, b)]
            elif op == "flood":         # one token more than free pages and rooms hold
                total = (pool.num_free + b) * pool.page_size + 1
                counts = [int(x) for x in rng.multinomial(total, np.ones(b) / b)]
            n = b if counts is None else sum(counts)
            layer = int(rng.integers(0, pool.num_layers)) if op == "layer" and layered else None
            k, v = rows(rng, pool, n, layered and layer is None), \
                rows(rng, pool, n, layered and layer is None)
            before = snapshot(pool)
            try:
                model.append_batch(seqs, k, v, counts, layer)
            except ModelExhausted:
                with pytest.raises(PoolExhaustedError, match="nothing was changed"):
                    if op == "append":
                        pool.append(seqs[0], conv(k), conv(v))
                    else:
                        pool.append_batch(seqs, conv(k), conv(v), counts=counts, layer=layer)
                assert_same(snapshot(pool), before)
                op += "-exhausted"
            else:
                if op == "append":
                    pool.append(seqs[0], conv(k), conv(v))
                else:
                    got = pool.append_batch(seqs, conv(k), conv(v), counts=counts, layer=layer)
                    ran["copies"] = ran.get("copies", 0) + len(got.copies)
                if layer is not None:       # the other layers, in a random order
                    keys = model.batch_slots(seqs, counts)
                    for other in rng.permutation(pool.num_layers):
                        if other != layer:
                            k2, v2 = rows(rng, pool, n, False), rows(rng, pool, n, False)
                            pool.write_layer(got, conv(k2), conv(v2), layer=int(other))
                            model.write_layer(keys, k2, v2, int(other))
        ran[op] = ran.get(op, 0) + 1
        if step % check_every == 0 or step == steps - 1:
            check(pool, model)
    return ran


GEOMETRIES = [
    # (id, pool kwargs): 16-byte words (f16 rows of 32 bytes), 8-byte words (f32 rows of
    # 24 bytes), 2-byte words (bf16 rows of 6 bytes, where Metal takes the array path
    # for inputs under 8 elements)
    ("f16-w16", dict(dtype="float16")),
    ("f16-w16-layers3", dict(dtype="float16", layers=3, num_pages=48)),
    ("f32-w8-layers2", dict(dtype="float32", head_dim=3, layers=2)),
    ("bf16-w2-p1", dict(dtype="bfloat16", heads=1, head_dim=3, page_size=1, num_pages=64)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("geom", [g[1] for g in GEOMETRIES], ids=[g[0] for g in GEOMETRIES])
def test_random_operations_match_the_model(backend, geom):
    rng = np.random.default_rng(zlib.crc32(repr(sorted(geom.items())).encode()))
    pool, model = make(backend, **geom)
    ran = random_ops(pool, model, rng, 200)
    # the mix is what it says: every operation ran, and the pool ran out at times
    for op in ("new", "fork", "append", "batch1", "ragged", "trim", "free"):
        assert ran.get(op, 0) > 0, ran
    if pool.page_size > 1:                  # (pages of one entry are never partial)
        assert ran.get("copies", 0) > 0, ran
    assert ran.get("flood-exhausted", 0) > 0 and "flood" not in ran, ran
    if geom.get("layers"):
        assert ran.get("layer", 0) > 0, ran


# ---------------------------------------------------------------------------- copy-on-write
def _forked(backend, layers=None, fill=6, num_pages=12):
    """a holds ``fill`` tokens (page 1 partial), b = fork(a): both share pages 0 and 1."""
    rng = np.random.default_rng(7)
    pool, model = make(backend, num_pages, layers=layers)
    a = pool.new_sequence()
    model.new()
    k, v = rows(rng, pool, fill, layers is not None), rows(rng, pool, fill, layers is not None)
    pool.append(a, k, v)
    model.append_batch([a], k, v, [fill])
    b = pool.fork(a)
    model.fork(a)
    return pool, model, rng, a, b


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layers", [None, 2])
def test_both_children_append_to_the_shared_partial_page_in_one_batch(backend, layers):
    pool, model, rng, a, b = _forked(backend, layers)
    assert pool.refcount(1) == 2
    k, v = rows(rng, pool, 2, layers is not None), rows(rng, pool, 2, layers is not None)
    got = pool.append_batch([a, b], k, v)
    model.append_batch([a, b], k, v)
    check(pool, model)
    # a (first) copied page 1; b, the last holder, wrote into it in place
    assert pool.seq_pages(a) == [0, 2] and pool.seq_pages(b) == [0, 1]
    assert [pool.refcount(p) for p in (0, 1, 2)] == [2, 1, 1]
    assert got.copies.tolist() == [[1, 2]]
    assert got.first_changed.tolist() == [1, 2] and got.changed_pages.tolist() == [2]
    assert got.changed_indptr.tolist() == [0, 1, 1]
    assert got.seq_lens.tolist() == [7, 7] and got.last_page_len.tolist() == [3, 3]
    assert got.num_pages.tolist() == [2, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_holders_two_append(backend):
    pool, model, rng, a, b = _forked(backend)
    c = pool.fork(b)
    model.fork(b)
    k, v = rows(rng, pool, 5, False), rows(rng, pool, 5, False)
    got = pool.append_batch([c, b], k, v, counts=[2, 3])   # both copy: a keeps page 1
    model.append_batch([c, b], k, v, [2, 3])
    check(pool, model)
    assert pool.seq_pages(a) == [0, 1] and pool.refcount(1) == 1
    assert got.copies.tolist() == [[1, 2], [1, 3]]
    # b's 3 tokens: 2 fill its copy, 1 needs a fresh page after it
    assert pool.seq_pages(b) == [0, 3, 4] and got.changed_pages.tolist() == [2, 3, 4]
    k, v = rows(rng, pool, 3, False), rows(rng, pool, 3, False)
    pool.append_batch([a, b, c], k, v)                     # nothing shared is partial now
    model.append_batch([a, b, c], k, v)
    check(pool, model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_on_write_with_one_layer_copies_every_layer(backend):
    pool, model, rng, a, b = _forked(backend, layers=3)
    k, v = rows(rng, pool, 1, False), rows(rng, pool, 1, False)
    got = pool.append_batch([b], k, v, layer=1)
    model.append_batch([b], k, v, None, 1)
    check(pool, model)                 # layers 0 and 2 of the copy hold a's 2 old entries
    assert got.copies.tolist() == [[1, 2]]
    for other in (2, 0):
        k2, v2 = rows(rng, pool, 1, False), rows(rng, pool, 1, False)
        pool.write_layer(got, k2, v2, layer=other)
        model.write_layer(model.batch_slots([b], [1]), k2, v2, other)
    check(pool, model)
    assert pool.seq_pages(a) == [0, 1] and pool.seq_pages(b) == [0, 2]


# ---------------------------------------------------------------------------- all or nothing
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layers", [None, 2])
def test_exhaustion_in_the_middle_of_a_batch_changes_nothing(backend, layers):
    # 8 pages: a and b share [0, 1] (page 1 partial), c holds 2 (3 entries of room); 4
    # free. The batch needs b 1 copy, c 4, d 1: 6 > 4, failing at c.
    pool, model, rng, a, b = _forked(backend, layers, num_pages=8)
    lead = layers is not None
    c, d = pool.new_sequence(), pool.new_sequence()
    model.new(), model.new()
    k, v = rows(rng, pool, 5, lead), rows(rng, pool, 5, lead)
    pool.append(c, k, v)
    model.append_batch([c], k, v, [5])
    before = snapshot(pool)
    k, v = rows(rng, pool, 18, lead), rows(rng, pool, 18, lead)
    with pytest.raises(PoolExhaustedError) as exc:
        pool.append_batch([b, c, d], k, v, counts=[1, 16, 1])
    msg = str(exc.value)
    assert msg == ("PagePool.append_batch: need 6 free pages for 3 of the 3 sequences "
                   f"(seq {b}: 1 (1 copy-on-write), seq {c}: 4, seq {d}: 1), the pool has "
                   "4 of 8 free; nothing was changed"), msg
    assert_same(snapshot(pool), before)
    with pytest.raises(ModelExhausted):
        model.append_batch([b, c, d], k, v, [1, 16, 1])
    check(pool, model)
    # and the pool goes on as the model (the same free pages in the same order)
    k, v = rows(rng, pool, 4, lead), rows(rng, pool, 4, lead)
    pool.append_batch([b, c, d], k, v, counts=[1, 2, 1])
    model.append_batch([b, c, d], k, v, [1, 2, 1])
    check(pool, model)


def test_exhaustion_lists_at_most_16_sequences():
    pool, _ = make("reference", 4, page_size=1)
    seqs = [pool.new_sequence() for _ in range(20)]
    k = np.zeros((20, 2, 8), np.float32)
    with pytest.raises(PoolExhaustedError, match=r"need 20 free pages for 20 of the 20 "
                                                 r"sequences \(seq 0: 1, .*seq 15: 1, and 4 "
                                                 r"more\), the pool has 4 of 4 free"):
        pool.append_batch(seqs, k, k)
    assert pool.num_free == 4


# ---------------------------------------------------------------------------- layers
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_layer_at_once_and_one_layer_at_a_time_agree(backend):
    rng = np.random.default_rng(3)
    whole, _ = make(backend, 16, layers=3)
    wise, _ = make(backend, 16, layers=3)
    seqs = [whole.new_sequence() for _ in range(3)]
    assert [wise.new_sequence() for _ in range(3)] == seqs
    for counts in ([5, 0, 3], [1, 1, 1], [4, 9, 2]):
        k, v = rows(rng, whole, sum(counts), True), rows(rng, whole, sum(counts), True)
        whole.append_batch(seqs, k, v, counts=counts)
        got = wise.append_batch(seqs, k[2], v[2], counts=counts, layer=2)
        for i in (0, 1):
            wise.write_layer(got, k[i], v[i], layer=i)
    assert_same(snapshot(whole), snapshot(wise))


def test_write_layer_refuses_a_stale_or_foreign_batch():
    pool, _ = make("reference", 16, layers=2)
    other, _ = make("reference", 16, layers=2)
    s = pool.new_sequence()
    one = np.zeros((1, 2, 8), np.float32)
    got = pool.append_batch([s], one, one, layer=0)
    pool.write_layer(got, one, one, layer=1)
    pool.write_layer(got, one, one, layer=1)               # again: fine, same slots
    with pytest.raises(InvalidArgumentError, match=r"PagePool.write_layer: batch must be what "
                                                   r"this pool's append_batch returned"):
        other.write_layer(got, one, one, layer=1)
    with pytest.raises(InvalidArgumentError, match=r"PagePool.write_layer: k must have shape "
                                                   r"\[N, Hkv, D\] = \[1, 2, 8\], got \[2, 2, 8\]"):
        pool.write_layer(got, np.zeros((2, 2, 8), np.float32), one, layer=1)
    with pytest.raises(InvalidArgumentError, match=r"layer must be in \[0, 2\) or None, got 2"):
        pool.write_layer(got, one, one, layer=2)
    with pytest.raises(InvalidArgumentError, match=r"layer must be an integer in \[0, 2\), "
                                                   r"got None"):
        pool.write_layer(got, one, one, layer=None)
    pool.fork(s)
    with pytest.raises(InvalidArgumentError, match=r"PagePool.write_layer: batch is stale: the "
                                                   r"pool changed since"):
        pool.write_layer(got, one, one, layer=1)
    flat, _ = make("reference", 16)
    t = flat.new_sequence()
    got = flat.append_batch([t], one, one)
    with pytest.raises(InvalidArgumentError, match=r"PagePool.write_layer: the pool has no "
                                                   r"layer axis"):
        flat.write_layer(got, one, one, layer=0)


def test_a_batch_s_launch_description_is_read_only():
    # write_layer launches on batch.write.desc again: an edit there would write another
    # sequence's slots, or out of bounds on a GPU
    pool, _ = make("reference", 16, layers=2)
    seqs = [pool.new_sequence() for _ in range(2)]
    one = np.zeros((2, 2, 8), np.float32)
    for _ in range(3):                  # the general path, then the worked-out appends
        got = pool.append_batch(seqs, one, one, layer=0)
        assert not got.write.desc.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            got.write.desc[0, 1] = got.write.desc[0, 0]
        pool.write_layer(got, one, one, layer=1)


# ---------------------------------------------------------------------------- bad input
class _DeviceIds:
    """Stands in for a CuPy array: no implicit copy to the host."""

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")


def _bad_cases(pool, seqs, freed):
    one = np.zeros((2, 2, 8), np.float32)
    return [
        (dict(seqs=_DeviceIds(), k=one, v=one), InvalidArgumentError,
         r"PagePool.append_batch: seqs must be host integers \(a list or a numpy array\), "
         r"got a _DeviceIds"),
        (dict(seqs=seqs, k=one, v=one, counts=_DeviceIds()), InvalidArgumentError,
         r"PagePool.append_batch: counts must be host integers"),
        # (call kwargs, error type, message pattern)
        (dict(seqs=[seqs[0], freed], k=one, v=one), InvalidArgumentError,
         rf"PagePool.append_batch: seqs\[1\]: unknown sequence {freed}; live sequences: "
         rf"\[{seqs[0]}, {seqs[1]}\]"),
        (dict(seqs=[seqs[0], 99], k=one, v=one), InvalidArgumentError,
         r"seqs\[1\]: unknown sequence 99"),
        (dict(seqs=[seqs[1], seqs[1]], k=one, v=one), InvalidArgumentError,
         rf"PagePool.append_batch: seqs must not repeat a sequence, got {seqs[1]} at "
         r"seqs\[0\] and seqs\[1\]"),
        (dict(seqs=[[seqs[0]], [seqs[1]]], k=one, v=one), InvalidArgumentError,
         r"seqs must be a 1-D sequence of sequence ids, got shape \[2, 1\]"),
        (dict(seqs=[0.0, 1.0], k=one, v=one), InvalidArgumentError,
         r"seqs must hold sequence ids \(integers\), got dtype float64"),
        (dict(seqs=[seqs[0], True], k=one, v=one), InvalidArgumentError,
         r"PagePool.append_batch: seqs\[1\] must be an integer, got True"),
        (dict(seqs=seqs, k=one[0], v=one[0]), InvalidArgumentError,
         r"PagePool.append_batch: k must be \[B, Hkv, D\], got shape \[2, 8\]"),
        (dict(seqs=seqs, k=np.zeros((3, 2, 8), np.float32), v=one), InvalidArgumentError,
         r"PagePool.append_batch: k must have shape \[B, Hkv, D\] = \[2, 2, 8\], got "
         r"\[3, 2, 8\]"),
        (dict(seqs=seqs, k=one, v=np.zeros((2, 2, 7), np.float32)), InvalidArgumentError,
         r"PagePool.append_batch: v must have shape \[B, Hkv, D\] = \[2, 2, 8\], got "
         r"\[2, 2, 7\]"),
        (dict(seqs=seqs, k=one.astype(np.float64), v=one), InvalidDtypeError,
         r"PagePool.append_batch: k must have dtype in \(float16, bfloat16, float32\), "
         r"got float64"),
        (dict(seqs=seqs, k=one, v=one.astype(np.int32)), InvalidDtypeError,
         r"PagePool.append_batch: v must have dtype in"),
        (dict(seqs=seqs, k=one, v=one, counts=[2]), InvalidArgumentError,
         r"counts must have shape \[B\] = \[2\] \(one count per sequence\), got \[1\]"),
        (dict(seqs=seqs, k=one, v=one, counts=[3, -1]), InvalidArgumentError,
         r"PagePool.append_batch: counts must be >= 0, got counts\[1\] = -1"),
        (dict(seqs=seqs, k=one, v=one, counts=[1, 2]), InvalidArgumentError,
         r"PagePool.append_batch: counts must add up to the rows of k and v \(N = 2\), got "
         r"a sum of 3"),
        (dict(seqs=seqs, k=one, v=one, counts=[1.0, 1.0]), InvalidArgumentError,
         r"counts must hold integers, got dtype float64"),
        (dict(seqs=seqs, k=one, v=one, counts=[True, True]), InvalidArgumentError,
         r"counts\[0\] must be an integer, got True"),
        (dict(seqs=seqs, k=one, v=one, counts=np.array([True, True])), InvalidArgumentError,
         r"counts must hold integers, got dtype bool"),
        (dict(seqs=seqs, k=one, v=one, layer=1), InvalidArgumentError,
         r"PagePool.append_batch: layer must be None or 0 \(the pool has no layer axis\), "
         r"got 1"),
        (dict(seqs=seqs, k=one, v=one, layer=True), InvalidArgumentError,
         r"PagePool.append_batch: layer must be an integer or None, got True"),
    ]


def test_bad_input_names_the_argument_and_changes_nothing():
    pool, _ = make("reference", 16)
    seqs = [pool.new_sequence() for _ in range(3)]
    pool.append(seqs[0], np.ones((3, 2, 8), np.float32), np.ones((3, 2, 8), np.float32))
    pool.free(seqs[2])
    freed, seqs = seqs[2], seqs[:2]
    before = snapshot(pool)
    for kwargs, err, pattern in _bad_cases(pool, seqs, freed):
        with pytest.raises(err, match=pattern):
            pool.append_batch(**kwargs)
        assert_same(snapshot(pool), before)


def test_bad_layer_arguments_on_a_layered_pool():
    pool, _ = make("reference", 16, layers=3)
    s = pool.new_sequence()
    one, all3 = np.zeros((1, 2, 8), np.float32), np.zeros((3, 1, 2, 8), np.float32)
    before = snapshot(pool)
    with pytest.raises(InvalidArgumentError, match=r"PagePool.append_batch: layer must be in "
                                                   r"\[0, 3\) or None, got 3"):
        pool.append_batch([s], one, one, layer=3)
    with pytest.raises(InvalidArgumentError, match=r"k must be \[L, B, Hkv, D\], got shape "
                                                   r"\[1, 2, 8\] \(every layer: layer=None\)"):
        pool.append_batch([s], one, one)
    with pytest.raises(InvalidArgumentError, match=r"k must be \[N, Hkv, D\], got shape "
                                                   r"\[3, 1, 2, 8\] \(one layer: layer=1\)"):
        pool.append_batch([s], all3, all3, counts=[1], layer=1)
    assert_same(snapshot(pool), before)
    pool.append_batch(np.array([s]), all3, all3)            # an id array works too
    pool.append_batch([s], one, one, layer=np.int64(2))
    assert pool.seq_len(s) == 2


def test_empty_batch_and_zero_counts_change_no_page():
    pool, model = make("reference", 8)
    s = pool.new_sequence()
    model.new()
    got = pool.append_batch([], np.zeros((0, 2, 8), np.float32),
                            np.zeros((0, 2, 8), np.float32))
    assert got.seqs.size == 0 and got.changed_indptr.tolist() == [0]
    got = pool.append_batch([s], np.zeros((0, 2, 8), np.float32),
                            np.zeros((0, 2, 8), np.float32), counts=[0])
    assert got.write.num_touched == 0 and got.seq_lens.tolist() == [0]
    check(pool, model)


@pytest.mark.skipif(not availability("emulated-metal").ok, reason="the CPU emulator is "
                    "unavailable")
@pytest.mark.parametrize("geom", [g[1] for g in GEOMETRIES[1:3]], ids=[g[0] for g in
                                                                        GEOMETRIES[1:3]])
def test_the_metal_backend_through_metal_kernel_on_the_emulator(geom):
    """The ``metal`` backend's own path on MLX arrays (``append_rows``, ``metal_call``,
    the ``metal_kernel`` call with NaN-initialized outputs, the rebound results), with
    the CPU emulator standing in for the GPU (as in test_mlx_kernels.py)."""
    pytest.importorskip("mlx.core")
    from test_mlx_kernels import Spy, emulate

    from paged_decode.backends.mlx import MetalBackend
    spy = Spy(execute=emulate)
    pool, model = make(MetalBackend(spy), **geom)
    random_ops(pool, model, np.random.default_rng(8), 60)
    assert spy.calls and all(kw["name"].startswith("pd_append") for kw, _ in spy.calls)


# ---------------------------------------------------------------------------- one launch
def test_one_token_for_128_sequences_and_32_layers_is_one_launch(monkeypatch):
    """The emulated backend's launch path sees exactly one launch, and it is the append
    kernel over (128 touched pages, 32 layers) (recorded, not run: the same description
    the CUDA backend launches; tests/test_append_gpu.py runs it)."""
    be = pd.get_backend("emulated-cuda")
    launched = []
    monkeypatch.setattr(be, "_run", launched.append)
    pool = pd.PagePool(256, 16, 1, 8, "float16", num_layers=32, backend=be)
    seqs = np.array([pool.new_sequence() for _ in range(128)])
    one = np.zeros((32, 128, 1, 8), np.float16)
    pool.append_batch(seqs, one, one)
    assert len(launched) == 1
    lc = launched[0]
    assert lc.spec.uri == "pd_append_o-f16_vb-16" and lc.grid == (128, 32) and lc.block == 128


# ---------------------------------------------------------------------------- mutants
def _scenario(backend) -> str:
    """A fixed history (copy-on-write in a batch, ragged runs, one-layer writes) on a
    3-layer pool; why it disagrees with the model, or "" when it agrees."""
    try:
        pool, model, rng, a, b = _forked(backend, layers=3)
        check(pool, model)
        k, v = rows(rng, pool, 9, True), rows(rng, pool, 9, True)
        pool.append_batch([a, b], k, v, counts=[2, 7])
        model.append_batch([a, b], k, v, [2, 7])
        c = pool.fork(b)
        model.fork(b)
        k, v = rows(rng, pool, 4, False), rows(rng, pool, 4, False)
        got = pool.append_batch([c, a], k, v, counts=[3, 1], layer=2)
        model.append_batch([c, a], k, v, [3, 1], 2)
        for layer in (0, 1):
            k2, v2 = rows(rng, pool, 4, False), rows(rng, pool, 4, False)
            pool.write_layer(got, k2, v2, layer=layer)
            model.write_layer(model.batch_slots([c, a], [3, 1]), k2, v2, layer)
        check(pool, model)
    except (AssertionError, KernelFault, RaceError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return ""


needs_emulator = pytest.mark.skipif(not availability("emulated-cuda").ok,
                                    reason=f"{availability('emulated-cuda').reason}")

MUTANTS = [
    # (id, dialect, old, new): each must make the scenario fail
    ("slot-off-by-one", "cuda",
     "b.first = copy ? 0 : (long long)lo * row_len;",
     "b.first = copy ? 0 : (long long)(lo + 1) * row_len;"),
    ("no-cow-copy", "cuda", "const bool copy = copy_cow != 0 && src != page;",
     "const bool copy = false;"),
    ("cow-from-layer-0", "cuda", "b.src0 = layer_units + ",
     "b.src0 = 0 * layer_units + "),
    ("row-of-the-wrong-layer", "cuda",
     "b.row_base = ((long long)(l - layer0) * num_rows + row0) * row_len;",
     "b.row_base = ((long long)0 * num_rows + row0) * row_len;"),
    ("unchanged-slots-not-copied", "metal",
     "      ok[p.dst0 + i] = ik[p.dst0 + i];\n      ov[p.dst0 + i] = iv[p.dst0 + i];\n", ""),
    ("page-search-off-by-one", "metal", "if (desc[m] < page) a = m + 1;",
     "if (desc[m] <= page) a = m + 1;"),
    ("no-cow-source", "metal", "if (copy_cow != 0) src = desc[num_touched + a];", ""),
]


@needs_emulator
@pytest.mark.parametrize("dialect", ["cuda", "metal"])
def test_the_real_kernel_passes_the_scenario(dialect):
    assert _scenario(backend(control(dialect, ["append"]))) == ""


@needs_emulator
@pytest.mark.parametrize("dialect, old, new", [m[1:] for m in MUTANTS],
                         ids=[m[0] for m in MUTANTS])
def test_mutated_append_kernels_fail(dialect, old, new):
    why = _scenario(backend(Mutation(dialect, ("append",), old, new)))
    assert why, "the mutant passed"


def _pool_state(pool):
    # page lists, not the page array: arming the fast path may widen the array
    S = pool._seqs
    out = {f: getattr(S, f).copy() for f in ("npages", "start", "filled", "trimmed")}
    out.update(pages=np.concatenate([pool.seq_pages(s) + [-1] for s in pool.sequences()]),
               free=pool._free[:pool._nfree].copy(),
               ref=pool._ref.copy(), version=pool._version,
               k=np.asarray(pool.k).copy(), v=np.asarray(pool.v).copy())
    return out


@pytest.mark.parametrize("reserve", [False, True])
def test_repeated_one_token_appends_equal_the_general_path_on_twin_pools(reserve):
    """The decode loop's fast path (``append_lookahead``: the same batch again, worked
    out ahead) against the general path on a twin pool (its fast path switched off before
    every call), through outside changes (a fork joining the batch, a trim, a free, an
    append outside the batch), a different batch, and pool exhaustion."""
    L_, hkv, d, p = 2, 2, 8, 4
    rng = np.random.default_rng(11)
    twins = []
    for _ in range(2):
        pool = pd.PagePool(90, p, hkv, d, "float32", num_layers=L_, backend="reference")
        seqs = [pool.new_sequence() for _ in range(5)]
        for s, n in zip(seqs, (5, 1, 8, 4, 7)):
            x = np.arange(L_ * n * hkv * d, dtype=np.float32).reshape(L_, n, hkv, d)
            pool.append(s, x, x + 1)
        twins.append((pool, seqs))
    (pa, sa), (pb, sb) = twins
    fast = 0
    ids = np.asarray(sa, np.int64)
    for it in range(70):
        for pool, seqs in twins:
            if it == 10:
                seqs.append(pool.fork(seqs[2]))         # a shared partial last page
            elif it == 20:
                pool.trim_front(seqs[0], 3)
            elif it == 30:
                s = pool.new_sequence()                 # outside the batch
                pool.append(s, np.ones((L_, 6, hkv, d), np.float32),
                            np.ones((L_, 6, hkv, d), np.float32))
            elif it == 40:
                pool.free(seqs.pop(1))
        if it in (10, 40):
            ids = np.asarray(sa, np.int64)
        batch_ids = ids if it % 17 else list(sa[:3])    # now and then another batch
        rows = rng.standard_normal((L_, len(batch_ids), hkv, d)).astype(np.float32)
        got = []
        for pool, use_fast in ((pa, True), (pb, False)):
            if not use_fast:
                pool._repeat = pool._ahead = None
            before = pool._ahead
            try:
                r = (pool.reserve_batch(batch_ids) if reserve
                     else pool.append_batch(batch_ids, rows, rows * 2))
            except PoolExhaustedError as exc:
                r = exc
            if use_fast and pool._ahead is not None and pool._ahead is before:
                fast += 1
            got.append(r)
        ra, rb = got
        assert type(ra) is type(rb)
        if isinstance(ra, PoolExhaustedError):
            assert str(ra) == str(rb)
        else:
            for f in ("seqs", "counts", "seq_lens", "last_page_len", "num_pages",
                      "first_changed", "changed_pages", "changed_indptr", "copies"):
                np.testing.assert_array_equal(getattr(ra, f), getattr(rb, f), err_msg=f)
            np.testing.assert_array_equal(ra.write.desc, rb.write.desc)
        a, b = _pool_state(pa), _pool_state(pb)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"step {it}: {key}")
        if it > 55:          # use up the pool: both refuse the same way, nothing changes
            for pool in (pa, pb):
                if pool._nfree > 1:
                    pool.append(pool.new_sequence(), *(np.zeros((L_, p * (pool._nfree - 1),
                                                                 hkv, d), np.float32),) * 2)
    assert fast > 30                    # the fast path really ran


def test_the_fast_path_leaves_the_caller_s_ids_writable():
    pool = pd.PagePool(32, 4, 1, 4, "float32", backend="reference")
    ids = np.asarray([pool.new_sequence() for _ in range(3)], np.int64)
    x = np.zeros((3, 1, 4), np.float32)
    for _ in range(5):
        pool.append_batch(ids, x, x)
    assert ids.flags.writeable
    assert pool._ahead is not None        # the later calls took the fast path
