"""``bench --graph-layers N`` on the CPU: the option's refusals, the memory cap, and the
N-layer timing path of the runner on a fake CUDA backend (the reference backend under the
name ``cuda``, with the GPU timers replaced by fixed times): each of N layers' calls runs
over its own pools in one captured graph, the replay's time is divided by N, every report
gives N, and a layer whose replayed output is wrong leaves its arm unverified and untimed.
Each layer's pools hold the case's tokens at other pages, read through its own table, so a
layer reading another layer's pools or table fails the check; copies and arms that run out
of memory are retried with fewer layers; arms timed differently are not compared. The real
GPU run is in ``tests/test_cuda_graphs.py``."""

from __future__ import annotations

import json
import weakref

import numpy as np
import pytest
from click.testing import CliRunner

from paged_decode.backends import get_backend
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.bench import layers, runner, timing
from paged_decode.bench.arms import Arm
from paged_decode.bench.cases import BenchCase
from paged_decode.bench.report import comparable, markdown, table, to_csv
from paged_decode.bench.runner import ArmResult, BenchResult
from paged_decode.cli import main
from paged_decode.problems import make_table

CASE = BenchCase(2, 64, 16, 4, 2, 64)
REPLAY_S = 12e-6        # the fake replay's time: one graph, however many calls it holds


# ---------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("args, want", [
    (["--graph-layers", "0"], "--graph-layers"),
    (["--graph-layers", "two"], "--graph-layers"),
    (["--graph-layers", "2", "--suite", "cascade"], "applies to the decode suite, not the "
                                                    "cascade suite"),
    (["--graph-layers", "2", "--preset", "sparse"], "not the sparse suite"),
    (["--graph-layers", "2", "--suite", "engine"], "not the engine suite"),
    (["--graph-layers", "2", "--no-graph"], "--no-graph"),
    (["--graph-layers", "3"], "only --backend cuda has; got backend reference"),
    (["--graph-layers", "257"], "'--graph-layers': 257 is not in the range 1<=x<=256"),
])
def test_the_cli_refuses_what_graph_layers_cannot_measure(args, want):
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", *args])
    assert res.exit_code != 0 and want in res.output, res.output
    assert "Traceback" not in res.output


def test_the_cli_passes_graph_layers_1_by_default(monkeypatch):
    import paged_decode.bench as bench_pkg
    seen: list[int] = []
    monkeypatch.setattr(bench_pkg, "run_bench", lambda *a, real=bench_pkg.run_bench, **kw:
                        seen.append(kw["graph_layers"]) or real(*a, **kw))
    for opts in ([], ["--graph-layers", "1"]):
        res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--context", "32",
                                        "--batch", "1", "--arms", "v2", "--reps", "1",
                                        "--warmup", "0", *opts])
        assert res.exit_code == 0, res.output
        (head,) = [line for line in res.output.splitlines() if line.startswith("case ")]
        assert head.endswith(" chunks") and "layers" not in head     # the table's head
    assert seen == [1, 1]


def test_the_cli_and_the_runner_share_the_most_graph_layers():
    from paged_decode import cli
    assert cli.MAX_GRAPH_LAYERS == layers.MAX_GRAPH_LAYERS == 256
    layers.check_graph_layers("f", 256, "cuda", True)


def test_the_runner_refuses_graph_layers_it_cannot_time():
    with pytest.raises(ValueError, match="run_bench: graph_layers > 1 .* backend 'reference'"):
        runner.run_bench([CASE], backend="reference", arms=("v2",), graph_layers=2)
    for bad in (0, True, 2.0, 257):
        with pytest.raises(ValueError, match=r"run_bench: graph_layers must be an int in "
                                             rf"\[1, 256\], got {bad!r}$"):
            runner.run_bench([CASE], backend="reference", arms=("v2",), graph_layers=bad)
    with pytest.raises(ValueError, match="bench_case: .* graph=False"):
        runner.bench_case(FakeCuda(), CASE, graph=False, graph_layers=2)


# ---------------------------------------------------------------------------- memory cap
def test_layers_that_fit_leave_half_the_free_memory_to_the_arms():
    gib = 1 << 30
    assert layers.layers_that_fit(32, 4 * gib, 40 * gib) == 6     # 5 copies in 20 GiB
    assert layers.layers_that_fit(4, 4 * gib, 40 * gib) == 4      # all fit: as asked
    assert layers.layers_that_fit(3, 4 * gib, 16 * gib) == 3      # 2 copies: exactly half
    assert layers.layers_that_fit(3, 4 * gib, 16 * gib - 1) == 2
    assert layers.layers_that_fit(8, 4 * gib, 0) == 1             # never below one
    assert layers.layers_that_fit(1, 4 * gib, 100 * gib) == 1
    with pytest.raises(ValueError, match="layers_that_fit: expected requested >= 1"):
        layers.layers_that_fit(0, gib, gib)
    with pytest.raises(ValueError, match="layer_bytes >= 1"):
        layers.layers_that_fit(2, 0, gib)


def _pools(num_pages=10):
    """A table of 2 requests (5 and 3 pages, shuffled over ``num_pages``) and its pools."""
    table, n = make_table([70, 40], 16, slack=num_pages / 8, rng=np.random.default_rng(3))
    assert n == num_pages
    k = np.arange(n * 16 * 2 * 8, dtype=np.float32).reshape(n, 16, 2, 8).astype(np.float16)
    return table, k, -k


def _tokens(pool, table, r):
    """Request ``r``'s visible K (or V) rows, in order, read through ``table``."""
    rows = pool[np.asarray(table.request_pages(r), np.int64)].reshape(-1, *pool.shape[2:])
    off = int(table.first_page_offset[r])
    return rows[off:off + int(table.visible_lens[r])]


def test_layer_pools_hold_the_cases_tokens_at_other_pages_in_distinct_memory():
    """Each layer's own table reads from its own pools exactly the tokens the case's table
    reads from the case's pools (so layer 0's oracle checks it), at other pages: its pools
    differ from every other layer's, and another layer's pools or table read other tokens."""
    be = get_backend("reference")
    table, k, v = _pools()
    per = k.nbytes + v.nbytes
    pools, note = layers.layer_pools(be, k, v, table, 4, free_bytes=2 * 3 * per)
    assert len(pools) == 3 and note == ""
    assert [p.shift for p in pools] == [2, 4, 6] == layers.layer_shifts(10, 4)[1:]
    every = [(k, v, table), *((p.k, p.v, p.table) for p in pools)]
    for li, (lk, lv, lt) in enumerate(every):
        assert lk.dtype == k.dtype and lk.shape == k.shape and lk.flags.c_contiguous
        assert np.array_equal(lt.indptr, table.indptr)
        assert np.array_equal(lt.last_page_len, table.last_page_len)
        assert lt.page_size == table.page_size
        for r in range(table.batch_size):
            assert np.array_equal(_tokens(lk, lt, r), _tokens(k, table, r)), (li, r)
            assert np.array_equal(_tokens(lv, lt, r), _tokens(v, table, r)), (li, r)
        for lj, (ok, ov, ot) in enumerate(every):
            if lj == li:
                continue
            assert not np.shares_memory(lk, ok) and not np.shares_memory(lv, ov)
            assert not np.array_equal(lk, ok)                     # other placement
            # a layer reading another layer's pools with its table, or its pools with
            # another layer's table, reads other tokens
            assert not np.array_equal(_tokens(ok, lt, 0), _tokens(k, table, 0)), (li, lj)
            assert not np.array_equal(_tokens(lk, ot, 0), _tokens(k, table, 0)), (li, lj)
    pools, note = layers.layer_pools(be, k, v, table, 4, free_bytes=2 * per)
    assert len(pools) == 1
    assert note.startswith("graph layers 4 capped to 2: each layer's K/V pools take")


def test_layer_shifts_are_distinct_where_the_pages_allow():
    assert layers.layer_shifts(10, 4) == [0, 2, 4, 6]
    assert layers.layer_shifts(1000, 3) == [0, 333, 666]
    assert layers.layer_shifts(3, 5) == [0, 1, 2, 0, 1]      # fewer pages than layers
    assert layers.layer_shifts(1, 2) == [0, 0]
    with pytest.raises(ValueError, match="layer_shifts: expected num_pages >= 1"):
        layers.layer_shifts(0, 2)
    table, k, _v = _pools()
    t = layers.shifted_table(table, 7, 10)
    assert np.array_equal(t.indices, (table.indices + 7) % 10) and t.num_pages == 10
    assert np.array_equal(layers.rolled(get_backend("reference"), k, 7)[7], k[0])


class OutOfMemoryError(MemoryError):
    """What CuPy raises when an allocation fails (``memory.out_of_memory``)."""


def _allocator(monkeypatch, target, name, budget):
    """Replace ``target.name`` (a function returning a new array or arm) with one that
    raises ``OutOfMemoryError`` once ``budget`` of its results are alive: a device of that
    much memory, which gets memory back only when the results are dropped."""
    real = getattr(target, name)
    alive: list[weakref.ref] = []

    def alloc(*a, **kw):
        alive[:] = [w for w in alive if w() is not None]
        if len(alive) >= budget:
            raise OutOfMemoryError(f"out of memory allocating ({len(alive)} alive)")
        out = real(*a, **kw)
        alive.append(weakref.ref(out))
        return out
    monkeypatch.setattr(target, name, alloc)


def test_copies_that_run_out_of_memory_are_retried_with_half_the_layers(monkeypatch):
    """8 layers need 14 copies; the device holds 6: 8 fails, 4 (6 copies) fits once the
    failed attempt's copies are dropped."""
    be = get_backend("reference")
    table, k, v = _pools()
    _allocator(monkeypatch, layers, "rolled", 6)
    pools, note = layers.layer_pools(be, k, v, table, 8, free_bytes=1 << 40)
    assert len(pools) == 3 and [p.shift for p in pools] == [2, 4, 6]
    assert note == ("graph layers 8 ran out of device memory making the layers' K/V copies "
                    "(OutOfMemoryError: out of memory allocating (6 alive)); retried with 4")
    _allocator(monkeypatch, layers, "rolled", 0)                  # not one copy fits
    pools, note = layers.layer_pools(be, k, v, table, 5, free_bytes=2 * (k.nbytes + v.nbytes))
    assert pools == [] and note.startswith("graph layers 5 capped to 2: ")
    assert note.endswith("; graph layers 2 ran out of device memory making the layers' K/V "
                         "copies (OutOfMemoryError: out of memory allocating (0 alive)); "
                         "retried with 1")


def test_byte_ranges_and_aliased_outputs():
    x = np.zeros((4, 3, 8), np.float16)
    lo, hi = layers.byte_range(x)
    assert hi - lo == x.nbytes
    assert layers.byte_range(x[1]) == (lo + 48, lo + 96)
    assert layers.byte_range(x[::-1])[1] - layers.byte_range(x[::-1])[0] == x.nbytes
    be = get_backend("reference")
    layers.check_distinct_outputs(be, [x[0], x[1], np.zeros_like(x)])     # disjoint
    for outs, pair in (([x, np.zeros_like(x), x], "0 and 2"), ([x[1], x], "0 and 1"),
                       ([x[:, 1], x[2]], "0 and 1")):
        with pytest.raises(layers.LayerOutputError, match=f"layers {pair} of {len(outs)} write "
                                                          "their outputs to overlapping"):
            layers.check_distinct_outputs(be, outs)


# ---------------------------------------------------------------------------- fake CUDA
class FakeCuda(ReferenceBackend):
    """The reference backend under the cuda backend's name: the runner takes its GPU
    timing path, with ``timing``'s functions replaced (``fake_gpu``)."""

    name = "cuda"


@pytest.fixture
def fake_gpu(monkeypatch):
    """Fake GPU timers: capture runs the function once and replays it by calling it again;
    a replay takes ``REPLAY_S``, an eager call between events 50 us. Returns the list of
    what each capture returned."""
    ref = get_backend("reference")
    real_problem = runner._problem
    monkeypatch.setattr(runner, "_problem", lambda be, case, seed: real_problem(ref, case, seed))
    monkeypatch.setattr(runner, "release_memory", lambda be: None)
    monkeypatch.setattr(layers, "release_memory", lambda be: None)
    monkeypatch.setattr(layers, "device_free_bytes", lambda: 1 << 40)
    captured = []

    def capture(fn, *, warmup=2):
        result = fn()
        captured.append(result)
        return fn, result
    monkeypatch.setattr(timing, "capture", capture)
    monkeypatch.setattr(timing, "synchronize", lambda: None)

    def replay_times(replay, *, warmup, reps, cold_l2=True):
        replay()
        return np.full(reps, REPLAY_S)
    monkeypatch.setattr(timing, "replay_times", replay_times)
    monkeypatch.setattr(timing, "cuda_event_times",
                        lambda fn, *, warmup, reps, cold_l2=True: np.full(reps, 50e-6))
    monkeypatch.setattr(timing, "cuda_per_call_times",
                        lambda fn, *, warmup, reps: np.full(5, 20e-6))
    monkeypatch.setattr(timing, "host_enqueue_times",
                        lambda fn, *, warmup, reps: np.full(reps, 3e-6))
    return captured


def test_n_layers_run_in_one_graph_and_are_reported_per_call(fake_gpu):
    r = runner.bench_case(FakeCuda(), CASE, arms=("v1", "v2"), warmup=0, reps=4,
                          graph_layers=3)
    assert r.graph_layers == 3 and r.layers_note == ""
    # one graph per arm, holding 3 calls with 3 outputs in distinct memory
    assert [len(c) for c in fake_gpu] == [3, 3]
    for c in fake_gpu:
        outs = [layers.output_of(r, None) for r in c]
        assert all(isinstance(o, np.ndarray) for o in outs)
        assert not any(np.shares_memory(a, b) for i, a in enumerate(outs) for b in outs[i + 1:])
    for name, a in r.arms.items():
        assert a.verified and a.gpu_mode == "graph" and a.graph_layers == 3, (name, a.note)
        assert a.gpu["median_us"] == pytest.approx(REPLAY_S * 1e6 / 3)    # per call
        assert a.call["median_us"] == pytest.approx(20.0)                # layer 0's alone
        assert a.gbps == pytest.approx(CASE.io_bytes() / (REPLAY_S / 3) / 1e9)
    text = table([r])
    head, row = text.splitlines()[0], text.splitlines()[2]
    assert head.endswith(" chunks layers") and row.endswith(" 3")
    assert "GPU us per call (layers calls, each over its own layer's pools" in text
    csv_rows = to_csv([r]).splitlines()
    col = csv_rows[0].split(",").index("graph_layers")
    assert [row.split(",")[col] for row in csv_rows[1:]] == ["3", "3"]
    d = json.loads(json.dumps(r.to_dict()))
    assert d["graph_layers"] == 3 and d["arms"]["v2"]["graph_layers"] == 3
    back = BenchResult.from_dict(d)
    assert back.graph_layers == 3 and back.arms["v1"].graph_layers == 3
    assert "layers" in markdown([r], {"backend": "cuda"}, "paged-decode bench")


def test_one_layer_is_the_single_call_replay(fake_gpu):
    r = runner.bench_case(FakeCuda(), CASE, arms=("v2",), warmup=0, reps=4)
    a = r.arms["v2"]
    assert r.graph_layers == 1 and a.graph_layers == 1 and a.gpu_mode == "graph"
    assert a.gpu["median_us"] == pytest.approx(REPLAY_S * 1e6)
    assert fake_gpu and not isinstance(fake_gpu[0], list)     # one call captured, not a list
    assert "layers" not in table([r]).splitlines()[0]
    old = r.to_dict()
    del old["graph_layers"], old["layers_note"], old["arms"]["v2"]["graph_layers"]
    back = BenchResult.from_dict(old)          # a JSON written before the option: N = 1
    assert back.graph_layers == 1 and back.arms["v2"].graph_layers == 1


def test_a_capped_case_reports_the_layers_it_ran_and_why(fake_gpu, monkeypatch):
    _q, k, v, _t = runner._problem(FakeCuda(), CASE, 0)
    monkeypatch.setattr(layers, "device_free_bytes", lambda: 2 * (k.nbytes + v.nbytes) + 1)
    r = runner.bench_case(FakeCuda(), CASE, arms=("v2",), warmup=0, reps=4, graph_layers=5)
    a = r.arms["v2"]
    assert r.graph_layers == 2 and "graph layers 5 capped to 2" in r.layers_note
    assert a.graph_layers == 2 and a.gpu["median_us"] == pytest.approx(REPLAY_S * 1e6 / 2)
    text = table([r])
    assert text.splitlines()[2].endswith(" 2")
    assert f"note: {CASE.label}: graph layers 5 capped to 2" in text
    monkeypatch.setattr(layers, "device_free_bytes", lambda: 0)      # not one copy fits
    r = runner.bench_case(FakeCuda(), CASE, arms=("v2",), warmup=0, reps=4, graph_layers=5)
    assert r.graph_layers == 1 and r.arms["v2"].graph_layers == 1
    assert "capped to 1" in r.layers_note and "capped to 1" in table([r])


def test_a_layer_with_a_wrong_output_leaves_the_arm_unverified_and_untimed(fake_gpu,
                                                                          monkeypatch):
    """Negative control: layer 2 of 3 reads pools whose V differs from the case's (as a
    layer reading the wrong memory would); layer 0 passes its eager check, but the replayed
    graph's check of every layer must catch layer 2."""
    real = runner.layer_pools

    def corrupt(be, k, v, table, n, **kw):
        pools, note = real(be, k, v, table, n, **kw)
        pools[1].v[...] += 1.0          # layer 2's V
        return pools, note
    monkeypatch.setattr(runner, "layer_pools", corrupt)
    r = runner.bench_case(FakeCuda(), CASE, arms=("v1", "v2"), warmup=0, reps=4,
                          graph_layers=3)
    for name, a in r.arms.items():
        assert not a.verified and a.gpu == {} and a.gpu_mode == "", name
        assert "layer(s) 2 of 3 in the replayed graph" in a.note and a.max_rel_error > 0.1
    assert "FAIL!" in table([r])


@pytest.mark.parametrize("wrong", ["pools of layer 1", "pools of layer 0", "table of layer 1",
                                   "table of layer 0"])
def test_a_layer_reading_another_layers_memory_fails_the_check(fake_gpu, monkeypatch, wrong):
    """Negative control: layer 2 of 3 reads another layer's pools with its own table, or
    its own pools with another layer's table (as a call bound to the wrong layer would).
    Every layer holds the same tokens, so only their placement can tell: the check after
    the replay must catch layer 2, and only layer 2."""
    real = runner.layer_pools

    def swap(be, k, v, table, n, **kw):
        pools, note = real(be, k, v, table, n, **kw)
        what, layer = wrong.split(" of layer ")
        other = ((k, v, table) if layer == "0" else pools[0][:3])
        pools[1] = (pools[1]._replace(k=other[0], v=other[1]) if what == "pools"
                    else pools[1]._replace(table=other[2]))
        return pools, note
    monkeypatch.setattr(runner, "layer_pools", swap)
    r = runner.bench_case(FakeCuda(), CASE, arms=("v1", "v2"), warmup=0, reps=4,
                          graph_layers=3)
    for name, a in r.arms.items():
        assert not a.verified and a.gpu == {}, (name, a.note)
        assert "layer(s) 2 of 3 in the replayed graph" in a.note and a.max_rel_error > 0.1


def test_layers_sharing_one_output_are_not_timed(fake_gpu, monkeypatch):
    """Negative control: every layer's call returns layer 0's output buffer; the replay's
    check would see one output only, so the arm is left unverified and untimed."""
    real = runner.make_arm
    first: dict[str, object] = {}

    def shared(name, *a, **kw):
        arm = real(name, *a, **kw)
        out = first.setdefault(name, arm.out)
        return Arm(lambda: (arm.call(), out)[1], out, arm.ran, arm.expected, arm.api_call,
                   arm.plan)
    monkeypatch.setattr(runner, "make_arm", shared)
    r = runner.bench_case(FakeCuda(), CASE, arms=("v2",), warmup=0, reps=4, graph_layers=3)
    a = r.arms["v2"]
    assert not a.verified and a.gpu == {} and a.gpu_mode == ""
    assert "layers 0 and 1 of 3 write their outputs to overlapping memory" in a.note


def test_a_case_whose_copies_run_out_of_memory_runs_fewer_layers(fake_gpu, monkeypatch):
    _allocator(monkeypatch, layers, "rolled", 2)        # one layer's copies fit
    r = runner.bench_case(FakeCuda(), CASE, arms=("v2",), warmup=0, reps=4, graph_layers=4)
    assert r.graph_layers == 2 and r.arms["v2"].graph_layers == 2 and r.arms["v2"].verified
    assert r.layers_note.startswith("graph layers 4 ran out of device memory making the "
                                    "layers' K/V copies (OutOfMemoryError: ")
    assert r.layers_note.endswith("retried with 2")
    assert r.arms["v2"].gpu["median_us"] == pytest.approx(REPLAY_S * 1e6 / 2)


@pytest.mark.parametrize("budget, runs", [(2, 2), (1, 1)])
def test_an_arm_whose_layers_run_out_of_memory_runs_fewer(fake_gpu, monkeypatch, budget,
                                                          runs):
    """v1's arms fit ``budget`` layers on this device (an arm's per-layer buffers, which
    the cap does not count): v1 is retried with half as many layers until they fit, and
    runs; v2 runs all 4. The two were timed differently: their ratio is withheld, and the
    report says each arm's N."""
    real = runner.make_arm
    alive: list[weakref.ref] = []

    def make(name, *a, **kw):
        arm = real(name, *a, **kw)
        if name == "v1":
            alive[:] = [w for w in alive if w() is not None]
            if len(alive) >= budget:
                raise OutOfMemoryError("out of memory allocating a workspace")
            alive.append(weakref.ref(arm))
        return arm
    monkeypatch.setattr(runner, "make_arm", make)
    r = runner.bench_case(FakeCuda(), CASE, arms=("v1", "v2"), warmup=0, reps=4,
                          graph_layers=4)
    v1, v2 = r.arms["v1"], r.arms["v2"]
    assert r.graph_layers == 4 and v2.graph_layers == 4 and v2.note == ""
    assert v1.verified and v1.graph_layers == runs and v1.gpu_mode == "graph", v1.note
    assert v1.gpu["median_us"] == pytest.approx(REPLAY_S * 1e6 / runs)
    tried = [4, 2] if runs == 2 else [4, 2, 1]
    assert v1.note == "; ".join(
        f"graph layers {n} ran out of device memory building or timing this arm's layers "
        f"(OutOfMemoryError: out of memory allocating a workspace); retried with {n // 2}"
        for n in tried[:-1])
    assert not comparable(v2, v1)
    text = table([r])
    row = text.splitlines()[2].split()
    assert row[-3:] == ["-", str(r.num_chunks), "4"]              # v1/v2 withheld
    assert (f"note: {CASE.label}: arms timed differently (ratios between them withheld): "
            f"v1 {runs} per replay, v2 4 per replay") in text
    assert f"comparisons withheld (an arm fell back or failed, or the two were timed " \
           f"differently): 1: {CASE.label}: v2 vs v1" in text


@pytest.mark.parametrize("link", ["cause", "context"])
def test_a_layer_graph_whose_capture_runs_out_of_memory_is_retried(fake_gpu, monkeypatch,
                                                                   link):
    """The capture of 4 layers runs out of memory (``GraphCaptureError`` from an
    out-of-memory error, as its cause or, when the capture's cleanup raised after the
    failed allocation, in its context): the arm is retried with 2 layers, not timed by
    eager events."""
    real = timing.capture

    def capture(fn, *, warmup=2):
        probe = fn()
        if isinstance(probe, list) and len(probe) > 2:
            try:
                raise OutOfMemoryError("out of memory in the graph's pool")
            except OutOfMemoryError as exc:
                if link == "cause":
                    raise timing.GraphCaptureError(f"OutOfMemoryError: {exc}") from exc
                try:                # the capture's end fails too, while handling it
                    raise RuntimeError("operation failed due to a previous error during "
                                       "capture")
                except RuntimeError as end:
                    raise timing.GraphCaptureError(f"RuntimeError: {end}") from end
        return real(fn, warmup=warmup)
    monkeypatch.setattr(timing, "capture", capture)
    r = runner.bench_case(FakeCuda(), CASE, arms=("v2",), warmup=0, reps=4, graph_layers=4)
    a = r.arms["v2"]
    assert a.verified and a.gpu_mode == "graph" and a.graph_layers == 2, a.note
    assert a.note.startswith("graph layers 4 ran out of device memory building or timing")


def test_arms_timed_differently_are_not_compared():
    def arm(**kw):
        base = {"arm": "x", "ran": "v2", "max_rel_error": 0.0, "verified": True,
                "gpu": {"median_us": 5.0}, "gpu_mode": "graph", "graph_layers": 3}
        return ArmResult(**{**base, **kw})
    assert comparable(arm(), arm())
    assert not comparable(arm(), arm(graph_layers=1))
    assert not comparable(arm(), arm(gpu_mode="events", graph_layers=1))
    assert not comparable(arm(graph_layers=1), arm(gpu_mode="events", graph_layers=1))
    r = BenchResult(CASE, 1, 4, {"sdpa": arm(arm="sdpa", gpu_mode="events", graph_layers=1,
                                             note="graph timing of 3 layers unusable"),
                                 "v2": arm(arm="v2")}, graph_layers=3)
    text = table([r])
    assert text.splitlines()[2].split()[-3:] == ["-", "1", "3"]
    assert (f"note: {CASE.label}: arms timed differently (ratios between them withheld): "
            "sdpa eager events, v2 3 per replay") in text
    same = BenchResult(CASE, 1, 4, {"sdpa": arm(arm="sdpa"), "v2": arm(arm="v2")},
                       graph_layers=3)
    assert "timed differently" not in table([same])
    assert table([same]).splitlines()[2].split()[-3:] == ["1.00", "1", "3"]


def test_a_graph_that_skips_its_work_is_not_timed(fake_gpu, monkeypatch):
    """Negative control: a replay that writes nothing leaves every layer's output NaN."""
    def capture(fn, *, warmup=2):
        return (lambda: None), fn()
    monkeypatch.setattr(timing, "capture", capture)
    r = runner.bench_case(FakeCuda(), CASE, arms=("v2",), warmup=0, reps=4, graph_layers=3)
    a = r.arms["v2"]
    assert not a.verified and a.gpu == {} and "layer(s) 0, 1, 2 of 3" in a.note


def test_a_failed_capture_falls_back_to_one_eager_call(fake_gpu, monkeypatch):
    def capture(fn, *, warmup=2):
        raise timing.GraphCaptureError("RuntimeError: operation not permitted when capturing")
    monkeypatch.setattr(timing, "capture", capture)
    r = runner.bench_case(FakeCuda(), CASE, arms=("v2",), warmup=0, reps=4, graph_layers=3)
    a = r.arms["v2"]
    assert a.verified and a.gpu_mode == "events" and a.graph_layers == 1
    assert a.gpu["median_us"] == pytest.approx(50.0)
    assert "graph timing of 3 layers unusable" in a.note


def test_the_plot_of_a_layered_run_says_its_times_are_per_call(monkeypatch, tmp_path):
    figure = pytest.importorskip("matplotlib.figure")
    from paged_decode.bench.plot import plot_results
    titles = []
    real = figure.Figure.suptitle
    monkeypatch.setattr(figure.Figure, "suptitle",
                        lambda fig, t, **kw: titles.append(t) or real(fig, t, **kw))
    arm = {"verified": True, "ran": "v2", "gpu": {"median_us": 4.0}, "call": {}, "gbps": 1.0}
    case = {"batch": 2, "context": 64, "page_size": 16, "num_qo_heads": 4, "num_kv_heads": 2,
            "head_dim": 64, "dtype": "float16"}
    for layered in (1, 3):
        data = {"results": [{"case": case, "arms": {"v2": arm}, "graph_layers": layered}]}
        plot_results(data, tmp_path / "p.png")
    assert "per call" not in titles[0]
    assert titles[1].endswith("; GPU times per call, 3 calls per graph replay")
    # arms timed differently: each arm's N, or eager events
    for other in ({"graph_layers": 1, "gpu_mode": "graph"},
                  {"graph_layers": 1, "gpu_mode": "events"}):
        data = {"results": [{"case": case, "graph_layers": 3, "arms": {
            "v2": {**arm, "graph_layers": 3, "gpu_mode": "graph"},
            "sdpa": {**arm, **other}}}]}
        plot_results(data, tmp_path / "p.png")
    assert titles[2].endswith("; GPU times per call; calls per graph replay by arm: sdpa 1, "
                              "v2 3")
    assert titles[3].endswith("; calls per graph replay by arm: sdpa eager events, v2 3")
