"""``bench --graph-layers N`` on the CPU: the option's refusals, the memory cap, and the
N-layer timing path of the runner on a fake CUDA backend (the reference backend under the
name ``cuda``, with the GPU timers replaced by fixed times): each of N layers' calls runs
over its own pools in one captured graph, the replay's time is divided by N, every report
gives N, and a layer whose replayed output is wrong leaves its arm unverified and untimed.
The real GPU run is in ``tests/test_cuda_graphs.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from paged_decode.backends import get_backend
from paged_decode.backends.reference import ReferenceBackend
from paged_decode.bench import layers, runner, timing
from paged_decode.bench.cases import BenchCase
from paged_decode.bench.report import markdown, table, to_csv
from paged_decode.bench.runner import BenchResult
from paged_decode.cli import main

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
        assert "layers" not in res.output.splitlines()[1]        # the table's head
    assert seen == [1, 1]


def test_the_runner_refuses_graph_layers_it_cannot_time():
    with pytest.raises(ValueError, match="run_bench: graph_layers > 1 .* backend 'reference'"):
        runner.run_bench([CASE], backend="reference", arms=("v2",), graph_layers=2)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=r"run_bench: graph_layers must be an int >= 1"):
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


def test_layer_pools_are_distinct_copies_capped_with_a_note():
    be = get_backend("reference")
    k = np.arange(2 * 16 * 2 * 8, dtype=np.float16).reshape(2, 16, 2, 8)
    v = -k
    per = k.nbytes + v.nbytes
    pools, note = layers.layer_pools(be, k, v, 4, free_bytes=2 * 3 * per)
    assert len(pools) == 3 and note == ""
    for lk, lv in pools:
        assert not np.shares_memory(lk, k) and not np.shares_memory(lv, v)
        assert np.array_equal(lk, k) and np.array_equal(lv, v) and lk.dtype == k.dtype
    assert not np.shares_memory(pools[0][0], pools[1][0])
    pools, note = layers.layer_pools(be, k, v, 4, free_bytes=2 * per)
    assert len(pools) == 1
    assert note.startswith("graph layers 4 capped to 2: each layer's K/V pools take")


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
    # one graph per arm, holding 3 calls with 3 distinct outputs
    assert [len(c) for c in fake_gpu] == [3, 3]
    assert all(len({id(o) for o in c}) == 3 for c in fake_gpu)
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

    def corrupt(be, k, v, n, **kw):
        pools, note = real(be, k, v, n, **kw)
        pools[1][1][...] += 1.0          # layer 2's V
        return pools, note
    monkeypatch.setattr(runner, "layer_pools", corrupt)
    r = runner.bench_case(FakeCuda(), CASE, arms=("v1", "v2"), warmup=0, reps=4,
                          graph_layers=3)
    for name, a in r.arms.items():
        assert not a.verified and a.gpu == {} and a.gpu_mode == "", name
        assert "layer(s) 2 of 3 in the replayed graph" in a.note and a.max_rel_error > 0.1
    assert "FAIL!" in table([r])


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
