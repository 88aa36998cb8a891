"""Crossover tables: parsing, nearest-cell choice, writing from bench results, and the
path ``decode(path="auto")`` takes from them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import paged_decode as pd
from paged_decode import crossover, json_text
from paged_decode.bench.cases import BenchCase
from paged_decode.bench.runner import ArmResult, BenchResult
from paged_decode.errors import InvalidArgumentError
from paged_decode.problems import ProblemSpec, make_problem


def _cells():
    return [{"batch": 1, "context": 1024, "page_size": 16, "group": 4, "best": "v1",
             "times_us": {"v1": 5.0, "v2": 6.0}},
            {"batch": 64, "context": 32768, "page_size": 16, "group": 4, "best": "v2",
             "times_us": {"v1": 900.0, "v2": 300.0}},
            {"batch": 1, "context": 1024, "page_size": 16, "group": 1, "best": "gather",
             "times_us": {"gather": 4.0, "v2": 6.0}}]


def test_nearest_cell_prefers_the_same_group():
    t = crossover.parse({"device": "x", "cells": _cells()}, "mem")
    assert t.choose(2, 900, 16, 4)[0] == "v1"
    assert t.choose(48, 30000, 32, 4)[0] == "v2"
    assert t.choose(2, 900, 16, 1)[0] == "gather"
    assert t.choose(2, 900, 16, 8)[0] == "v1"        # no group-8 cell: group 4's
    assert t.choose(2, 900, 16, 2)[0] == "gather"    # equally near 1 and 4: the smaller


@pytest.mark.parametrize("bad,match", [
    ({}, "cells"),
    ({"cells": []}, "no cells"),
    ({"cells": [{"batch": 1}]}, "cell 0 is malformed"),
    ({"cells": [{"batch": 1, "context": 1, "page_size": 1, "best": "v3"}]}, "best must"),
    ({"cells": [{"batch": 0, "context": 1, "page_size": 1, "best": "v2"}]}, "non-positive"),
])
def test_malformed_tables_are_rejected(bad, match):
    with pytest.raises(InvalidArgumentError, match=match):
        crossover.parse(bad, "t.json")


def test_auto_follows_the_table_named_by_the_environment(tmp_path, monkeypatch):
    pr = make_problem(ProblemSpec(2, 700, 8, 2, 64, 16, seed=1))
    dev = pd.get_backend("reference").device_info().name
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"device": dev, "cells": [
        {"batch": 2, "context": 700, "page_size": 16, "group": 4, "best": "v1"}]}))
    monkeypatch.setenv(crossover.ENV, str(path))
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert pd.last_outcome().path == "v1" and "t.json" in pd.last_outcome().reason
    path.write_text(json.dumps({"device": dev, "cells": [
        {"batch": 2, "context": 700, "page_size": 16, "group": 4, "best": "gather"}]}))
    import os
    os.utime(path, (1, 1))      # a new mtime: the cached table is re-read
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    assert pd.last_outcome().path == "gather"
    monkeypatch.setenv(crossover.ENV, str(tmp_path / "missing.json"))
    with pytest.raises(InvalidArgumentError, match="missing.json"):
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table)


def test_without_a_table_auto_runs_v2(monkeypatch, tmp_path):
    monkeypatch.delenv(crossover.ENV, raising=False)
    monkeypatch.setattr(crossover, "USER", tmp_path)
    assert crossover.table_for("no such device 123") is None
    pr = make_problem(ProblemSpec(2, 300, 8, 2, 64, 16, seed=2))
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    out = pd.last_outcome()
    assert out.path.startswith("v2") and "no crossover table" in out.reason


def test_from_results_skips_failed_and_fallen_back_arms():
    def arm(name, us, *, ok=True, ran=None):
        return ArmResult(name, ran or name, 0.0, ok, gpu={"median_us": us},
                         expected=(name,))
    r = BenchResult(BenchCase(4, 4096, 16), 1, 1, {
        "gather": arm("gather", 1.0, ok=False), "v1": arm("v1", 5.0, ran="gather"),
        "v2": arm("v2", 7.0), "sdpa": arm("sdpa", 0.5)})
    t = crossover.from_results([r], "dev")
    assert t["cells"] == [{"batch": 4, "context": 4096, "page_size": 16, "group": 4,
                           "best": "v2", "times_us": {"v2": 7.0}}]
    assert crossover.parse(t, "x").choose(4, 4096, 16, 4)[0] == "v2"
    # a verified arm whose timer measured nothing (NaN, truthy) is no cell's best, and a
    # case with nothing else timed writes no cell: the table stays parseable
    r.arms["v1"] = arm("v1", math.nan)
    r.arms["v2"] = arm("v2", math.nan)
    assert crossover.from_results([r], "dev")["cells"] == []
    r.arms["v2"] = arm("v2", 7.0)
    t = crossover.from_results([r], "dev")
    assert t["cells"][0]["times_us"] == {"v2": 7.0}
    crossover.parse(json.loads(json_text.dumps(t)), "x")


def test_shipped_tables_parse():
    for p in crossover.SHIPPED.glob("*.json"):
        t = crossover.parse(json.loads(p.read_text()), str(p))
        assert all(np.isfinite(list(c.times_us.values())).all() for c in t.cells)


def test_from_results_uses_call_times_without_gpu_times():
    r = BenchResult(BenchCase(1, 512, 16), 1, 1, {
        "v1": ArmResult("v1", "v1", 0.0, True, call={"median_us": 9.0}, expected=("v1",)),
        "v2": ArmResult("v2", "v2", 0.0, True, call={"median_us": 12.0}, expected=("v2",))})
    t = crossover.from_results([r], "cpu")
    assert t["cells"][0]["best"] == "v1" and "per synchronized call" in t["metric"]


def test_a_path_the_call_cannot_run_yields_the_cells_next_fastest(tmp_path, monkeypatch):
    cells = [{"batch": 8, "context": 8192, "page_size": 16, "group": 7, "best": "v2tc",
              "times_us": {"v2tc": 150.0, "v1": 400.0, "v2": 230.0}}]
    t = crossover.parse({"device": "x", "cells": cells}, "mem")
    assert t.choose(8, 8192, 16, 7)[0] == "v2tc"
    assert t.choose(8, 8192, 16, 7, ("v2", "v1"))[0] == "v2"
    assert t.choose(8, 8192, 16, 7, ("gather",))[0] is None
    # the reference backend cannot run v2tc: auto takes the cell's fastest other path
    pr = make_problem(ProblemSpec(2, 700, 8, 2, 64, 16, seed=1))
    dev = pd.get_backend("reference").device_info().name
    path = tmp_path / "tc.json"
    path.write_text(json.dumps({"device": dev, "cells": [
        {"batch": 2, "context": 700, "page_size": 16, "group": 4, "best": "v2tc",
         "times_us": {"v2tc": 1.0, "v1": 2.0, "v2": 3.0}}]}))
    monkeypatch.setenv(crossover.ENV, str(path))
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    out = pd.last_outcome()
    assert out.path == "v1" and "can run" in out.reason
    path.write_text(json.dumps({"device": dev, "cells": [
        {"batch": 2, "context": 700, "page_size": 16, "group": 4, "best": "v2tc",
         "times_us": {"v2tc": 1.0}}]}))
    import os
    os.utime(path, (2, 2))
    pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table)
    out = pd.last_outcome()
    assert out.path.startswith("v2") and out.path != "v2tc" and "no path" in out.reason


def test_auto_takes_v2tc_over_fp8_pools_wherever_it_runs(tmp_path, monkeypatch):
    # the table's cells are 16-bit pools; over fp8 pools v2tc was 2.2-3.4x faster than v2
    # on the H200 (call.FP8_AUTO), so auto takes it even where the table says v2
    from paged_decode.call import FP8_AUTO
    pr = make_problem(ProblemSpec(2, 700, 8, 2, 64, 16, "float16", "float8_e4m3fn", seed=4))
    for backend, want in (("emulated-cuda", "v2tc"), ("reference", "v2")):
        dev = pd.get_backend(backend).device_info().name
        path = tmp_path / f"{backend}.json"
        path.write_text(json.dumps({"device": dev, "cells": [
            {"batch": 2, "context": 700, "page_size": 16, "group": 4, "best": "v2",
             "times_us": {"v2tc": 3.0, "v1": 2.0, "v2": 1.0}}]}))
        monkeypatch.setenv(crossover.ENV, str(path))
        pd.decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend=backend, k_scale=0.5,
                  v_scale=0.25)
        out = pd.last_outcome()
        assert out.path.startswith(want), (backend, out.path)
        assert out.reason.startswith(FP8_AUTO) == (want == "v2tc"), out.reason
    # 16-bit pools keep the table's choice
    pr16 = make_problem(ProblemSpec(2, 700, 8, 2, 64, 16, seed=4))
    pd.decode(pr16.q, pr16.k_pages, pr16.v_pages, pr16.table, backend="emulated-cuda")
    assert pd.last_outcome().path.startswith("v2") and not \
        pd.last_outcome().path.startswith("v2tc")


def _v2tc_table(tmp_path, monkeypatch, group):
    """A crossover table for emulated-cuda whose one cell names v2tc fastest at ``group``."""
    dev = pd.get_backend("emulated-cuda").device_info().name
    path = tmp_path / f"tc{group}.json"
    path.write_text(json.dumps({"device": dev, "cells": [
        {"batch": 2, "context": 700, "page_size": 16, "group": group, "best": "v2tc",
         "times_us": {"v2tc": 1.0, "v2": 2.0}}]}))
    monkeypatch.setenv(crossover.ENV, str(path))


def test_auto_without_a_plan_plans_for_the_path_it_takes(tmp_path, monkeypatch):
    """GQA 16 (32/2 heads): v2 runs 2 CTAs per (chunk, KV head), v2tc one, so a plan
    searched for v2 gives v2tc half the CTAs. ``path="auto"`` without a plan picks the
    path first and plans for it, as ``path="v2tc"`` and the crossover table's v2tc cells
    (the bench's v2tc arm) do; a plan the caller passes is kept."""
    from helpers import PREFIX_RTOL

    from paged_decode.reference import max_rel_error, oracle_decode
    from paged_decode.specs import v2tc_ctas_per_chunk
    _v2tc_table(tmp_path, monkeypatch, 16)
    pr = make_problem(ProblemSpec(2, 700, 32, 2, 64, 16, seed=5))
    be = "emulated-cuda"
    auto = pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, backend=be)
    asked = pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, path="v2tc", backend=be)
    assert auto.path == asked.path == "v2tc+merge"
    assert auto.plan.ctas_per_chunk == v2tc_ctas_per_chunk(32, 2) == 2
    assert auto.plan.num_chunks == asked.plan.num_chunks
    v2_plan = pd.plan_decode(pr.table, 32, 2, 64, backend=be, path="v2")
    assert v2_plan.ctas_per_chunk == 4 and v2_plan.num_chunks < auto.plan.num_chunks
    # plan_decode's default is the auto path's plan
    assert pd.plan_decode(pr.table, 32, 2, 64, backend=be).num_chunks == auto.plan.num_chunks
    out = auto()
    ref = oracle_decode(pr.q, pr.k_pages, pr.v_pages, pr.table)[0]
    assert max_rel_error(np.asarray(out), ref) < PREFIX_RTOL["float16"]
    kept = pd.prepare_decode(pr.q, pr.k_pages, pr.v_pages, pr.table, v2_plan, backend=be)
    assert kept.path == "v2tc+merge" and kept.plan is v2_plan


def test_multitoken_auto_without_a_plan_plans_for_the_path_it_takes(tmp_path, monkeypatch):
    """The same for a multi-token call, whose common pass folds T tokens into the group:
    2 tokens x GQA 16 = 32 rows, two v2tc row tiles (4 CTAs per chunk at 2 KV heads)
    against v2's 4 groups of 8 heads (8 CTAs)."""
    from paged_decode.specs import v2tc_ctas_per_chunk
    _v2tc_table(tmp_path, monkeypatch, 32)
    pr = make_problem(ProblemSpec(2, 700, 32, 2, 64, 16, seed=6))
    q = np.stack([pr.q, pr.q[::-1]], axis=1)                        # [B, 2, Hq, D]
    be = "emulated-cuda"
    auto = pd.prepare_decode(q, pr.k_pages, pr.v_pages, pr.table, backend=be)
    asked = pd.prepare_decode(q, pr.k_pages, pr.v_pages, pr.table, path="v2tc", backend=be)
    assert auto.path == asked.path and auto.path.startswith("v2tc")
    assert auto.plan.ctas_per_chunk == v2tc_ctas_per_chunk(64, 2) == 4
    assert auto.plan.num_chunks == asked.plan.num_chunks
    np.testing.assert_array_equal(np.asarray(auto()), np.asarray(asked()))


def test_plan_decode_plans_for_the_path_it_is_for(tmp_path, monkeypatch):
    """``plan_decode(path=...)``: "auto" (the default) the path decode(path="auto") takes
    on the backend (its crossover table), "v2tc" the tensor-core partial's CTAs, "v2" /
    "v1" / "gather" v2's; ``ctas_per_chunk`` overrides it; anything else is refused."""
    from paged_decode.specs import v2tc_ctas_per_chunk
    pr = make_problem(ProblemSpec(2, 700, 32, 2, 64, 16, seed=7))
    be = "emulated-cuda"
    v2 = pd.plan_decode(pr.table, 32, 2, 64, backend=be, path="v2")
    tc = pd.plan_decode(pr.table, 32, 2, 64, backend=be, path="v2tc")
    assert v2.ctas_per_chunk == 4 and tc.ctas_per_chunk == v2tc_ctas_per_chunk(32, 2) == 2
    for p in ("v1", "gather"):
        assert pd.plan_decode(pr.table, 32, 2, 64, backend=be, path=p).ctas_per_chunk == 4
    # no crossover table for the emulator: auto runs v2, and plans for it
    assert pd.plan_decode(pr.table, 32, 2, 64, backend=be).ctas_per_chunk == 4
    _v2tc_table(tmp_path, monkeypatch, 16)
    auto = pd.plan_decode(pr.table, 32, 2, 64, backend=be)
    assert auto.ctas_per_chunk == 2 and auto.num_chunks == tc.num_chunks
    # the reference backend cannot run v2tc: its auto plan stays v2's
    assert pd.plan_decode(pr.table, 32, 2, 64, backend="reference").ctas_per_chunk == 4
    # fp8 pools: auto takes v2tc wherever it runs (call.FP8_AUTO), at the fp8 target
    monkeypatch.delenv(crossover.ENV)
    fp8 = pd.plan_decode(pr.table, 32, 2, 64, backend=be, kv_dtype="float8_e4m3fn")
    assert fp8.ctas_per_chunk == 2
    assert pd.plan_decode(pr.table, 32, 2, 64, backend=be, ctas_per_chunk=3).ctas_per_chunk == 3
    with pytest.raises(InvalidArgumentError, match=r"plan_decode: path must be one of auto, "
                                                   r"v2, v2tc, v1, gather, got 'v3'"):
        pd.plan_decode(pr.table, 32, 2, 64, backend=be, path="v3")


def test_a_multitoken_plan_for_auto_folds_the_tokens_into_the_group(tmp_path, monkeypatch):
    """query_tokens x G rows choose the cell and the CTAs: 2 tokens at GQA 16 are 32 rows,
    two v2tc row tiles."""
    _v2tc_table(tmp_path, monkeypatch, 32)
    pr = make_problem(ProblemSpec(2, 700, 32, 2, 64, 16, seed=8))
    plan = pd.plan_decode(pr.table, 32, 2, 64, backend="emulated-cuda", query_tokens=2)
    assert plan.ctas_per_chunk == 4 and plan.query_tokens == 2


def test_bench_results_round_trip_through_json():
    r = BenchResult(BenchCase(4, 4096, 16, ragged_min=1024), 12, 64, {
        "v2": ArmResult("v2", "v2+merge", 1e-4, True, gpu={"median_us": 7.0},
                        expected=("v2", "v2+merge"), plan={"chunks": 12, "ctas": 96,
                                                           "rule": "target"}),
        "flashinfer": ArmResult("flashinfer", "unavailable", float("nan"), False,
                                note="no GPU")})
    text = json_text.dumps(r.to_dict())
    assert "NaN" not in text and '"max_rel_error": null' in text      # strict JSON
    d = json.loads(text)
    back = BenchResult.from_dict(d)
    assert back.case == r.case and back.arms["v2"] == r.arms["v2"]
    assert math.isnan(back.arms["flashinfer"].max_rel_error)         # null read back as NaN
    assert back.to_dict()["arms"]["v2"] == r.to_dict()["arms"]["v2"]
    d["arms"]["v2"]["field_of_a_newer_writer"] = 1          # dropped, not an error
    assert BenchResult.from_dict(d).arms["v2"].gpu == {"median_us": 7.0}


def test_merged_tables_replace_cells_of_the_same_geometry():
    def cell(b, ctx, best, **t):
        return {"batch": b, "context": ctx, "page_size": 16, "group": 4, "best": best,
                "times_us": t}
    metric = "median GPU time under CUDA-graph replay, cold L2"
    old = {"device": "dev", "metric": metric, "sources": ["run A"],
           "cells": [cell(4, 4096, "v2", v2=10.0, v2tc=11.0), cell(8, 4096, "v2", v2=20.0)]}
    new = {"device": "dev", "metric": metric,
           "cells": [cell(4, 4096, "v2tc", v2=10.0, v2tc=9.0), cell(12, 4096, "v2tc", v2tc=30.0)]}
    out = crossover.merged(old, new, "run B")
    assert out["sources"] == ["run A", "run B"]
    by = {(c["batch"], c["context"]): c for c in out["cells"]}
    assert len(out["cells"]) == 3
    assert by[(4, 4096)]["best"] == "v2tc" and by[(4, 4096)]["source"] == "run B"
    assert "source" not in by[(8, 4096)] and by[(12, 4096)]["source"] == "run B"
    assert crossover.parse(out, "x").choose(5, 4096, 16, 4)[0] == "v2tc"
    assert old["cells"][0]["best"] == "v2"                  # the input is not changed
    with pytest.raises(InvalidArgumentError, match="crossover.merged.*metrics differ"):
        crossover.merged(old, {**new, "metric": "host time"}, "run C")


@pytest.mark.parametrize("name", ["nvidia-h200.json", "nvidia-h100-80gb-hbm3.json"])
def test_the_shipped_tables_name_their_runs(name):
    t = json.loads((crossover.SHIPPED / name).read_text())
    sources = t["sources"]
    assert sources and all(c.get("source", sources[0]) in sources for c in t["cells"])


H100 = "NVIDIA H100 80GB HBM3"
#: a compute capability 9.0 device with no table of its own shipped
H800 = "NVIDIA H800"


def test_a_device_without_a_table_borrows_its_architectures(monkeypatch, tmp_path):
    """An H800 (compute capability 9.0, no table of its own) gets the H200's shipped
    table, flagged as measured elsewhere; another architecture, or none known, gets no
    table; a table measured on the device itself comes first."""
    monkeypatch.delenv(crossover.ENV, raising=False)
    monkeypatch.setattr(crossover, "USER", tmp_path)
    t = crossover.table_for(H800, "9.0")
    assert t is not None and t.source.endswith("nvidia-h200.json")
    assert crossover.measured_elsewhere(t, H800)
    assert not crossover.measured_elsewhere(t, "NVIDIA H200")
    assert crossover.table_for(H800, "8.0") is None and crossover.table_for(H800) is None
    own = tmp_path / "nvidia-h800.json"
    own.write_text(json.dumps({"device": H800, "cells": _cells()}))
    t = crossover.table_for(H800, "9.0")
    assert t.source == str(own) and not crossover.measured_elsewhere(t, H800)


def test_the_h100_reads_its_own_shipped_table(monkeypatch, tmp_path):
    """The H100's table (S36-R4) is its own, not the H200's: at GQA 16 batch 1 x 1K it
    takes v2tc (11.9 us against v2's 15.4 on the H100), where the H200's table, nearest
    cell and all, sends the call to v2; a table re-measured in the user's cache still
    comes first."""
    monkeypatch.delenv(crossover.ENV, raising=False)
    monkeypatch.setattr(crossover, "USER", tmp_path)
    t = crossover.table_for(H100, "9.0")
    assert t is not None and t.source.endswith("nvidia-h100-80gb-hbm3.json")
    assert not crossover.measured_elsewhere(t, H100)
    assert t.choose(1, 1024, 16, 16)[0] == "v2tc"
    h200 = crossover.table_for("NVIDIA H200", "9.0")
    assert h200.choose(1, 1024, 16, 16)[0] == "v2"
    own = tmp_path / "nvidia-h100-80gb-hbm3.json"
    own.write_text(json.dumps({"device": H100, "cells": _cells()}))
    assert crossover.table_for(H100, "9.0").source == str(own)


class _Device:
    """A backend as choose_path_at sees it: one device, no single-arm shortcut."""

    def __init__(self, arch):
        from paged_decode.device import DeviceInfo
        self.info = DeviceInfo("cuda", H800, 132, 2, arch=arch)

    def auto_path(self):
        return None

    def device_info(self):
        return self.info


def test_auto_on_a_borrowed_table_says_where_it_was_measured(monkeypatch, tmp_path):
    """GQA 8 (Llama-3-70B at TP8): on the H200 table v2tc is fastest in every cell, so an
    H800 (no table of its own) takes v2tc and says the table is the H200's; on an
    architecture with no table it runs v2 (negative control)."""
    from paged_decode.call import choose_path_at
    monkeypatch.delenv(crossover.ENV, raising=False)
    monkeypatch.setattr(crossover, "USER", tmp_path)
    h200 = json.loads((crossover.SHIPPED / "nvidia-h200.json").read_text())
    assert {c["best"] for c in h200["cells"] if c["group"] == 8} == {"v2tc"}
    table = make_problem(ProblemSpec(8, 8192, 8, 1, 128, 16, seed=3)).table
    path, why = choose_path_at(_Device("9.0"), table, 8, ("v2", "v2tc"))
    assert path == "v2tc"
    assert "nvidia-h200.json, measured on NVIDIA H200, not on this NVIDIA H800" in why
    path, why = choose_path_at(_Device("8.0"), table, 8, ("v2", "v2tc"))
    assert path == "v2" and "no crossover table" in why
