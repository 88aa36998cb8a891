"""The command line through click's CliRunner (CPU: the reference backend)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from paged_decode.bench.report import table
from paged_decode.bench.runner import ArmResult, BenchResult
from paged_decode.bench.suites import (
    CascadeCase,
    SparseCase,
    bench_cascade,
    bench_forks,
    bench_sparse,
)
from paged_decode.cli import main


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args: str):
        return runner.invoke(main, list(args), catch_exceptions=False)
    return invoke


def test_help_lists_the_commands(run):
    res = run("--help")
    assert res.exit_code == 0
    for cmd in ("info", "check", "bench"):
        assert cmd in res.output
    assert run("check", "--help").exit_code == 0


def test_info_reports_the_reference_backend(run):
    res = run("info", "--backend", "reference")
    assert res.exit_code == 0 and "selected: reference" in res.output
    data = json.loads(run("info", "--backend", "reference", "--json").output)
    assert data["selected"] == "reference" and data["target_ctas"] == 32
    assert data["backends"]["reference"]["available"] is True
    assert data["v2tc_plans"].startswith("CTA-target rule")   # no shared memory figure


def test_unknown_backend_is_a_clear_error(run):
    res = CliRunner().invoke(main, ["info", "--backend", "nope"])
    assert res.exit_code != 0 and "nope" in res.output and "available" in res.output


def test_small_check_passes_and_writes_json(run, tmp_path):
    out = tmp_path / "check.json"
    res = run("check", "--backend", "reference", "--max-configs", "2", "--json", str(out))
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output
    data = json.loads(out.read_text())
    assert data["passed"] and len(data["results"]) == 10      # 2 configs x 5 paths


@pytest.mark.parametrize("shard", ["3/2", ""])
def test_check_shard_must_be_well_formed(run, shard):
    """An empty --shard is refused too (it once ran the whole matrix)."""
    res = CliRunner().invoke(main, ["check", "--backend", "reference", "--shard", shard])
    assert res.exit_code != 0 and "--shard" in res.output


def test_bench_refuses_an_empty_preset_and_a_batch_past_its_bound():
    """--preset "" once ran the cpu preset; --batch 10**11 ran out of host memory building
    the cases (a MemoryError traceback)."""
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--preset", "",
                                    "--arms", "v2"])
    assert res.exit_code != 0 and "preset must be one of" in res.output, res.output
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--preset", "cpu",
                                    "--batch", str(10**11), "--arms", "v2"])
    assert res.exit_code == 2 and "1<=x<=1048576" in res.output, res.output


@pytest.mark.parametrize("args, msg", [
    (["--backend", "reference", "--path", "v2tc"],
     "check: --path v2tc needs a backend with the tensor-core partial"),
    (["--backend", "emulated-cuda", "--path", "v2tc", "--dtype", "float32"],
     "check: --path v2tc takes float16 / bfloat16 queries"),
])
def test_check_refuses_paths_it_cannot_run(args, msg):
    res = CliRunner().invoke(main, ["check", *args])
    assert res.exit_code != 0 and msg in res.output and "Traceback" not in res.output


def test_small_bench_prints_the_three_arms(run, tmp_path):
    js, cs = tmp_path / "b.json", tmp_path / "b.csv"
    res = run("bench", "--backend", "reference", "--context", "256", "--batch", "2",
              "--page", "16", "--reps", "6", "--warmup", "1", "--json", str(js),
              "--csv", str(cs))
    assert res.exit_code == 0, res.output
    for arm in ("gather us", "v1 us", "v2 us", "v1/v2", "gather/v2"):
        assert arm in res.output
    data = json.loads(js.read_text())
    assert data["header"]["backend"] == "reference"
    assert {a for r in data["results"] for a in r["arms"]} == {"gather", "v1", "v2"}
    assert cs.read_text().count("\n") == 1 + 3                 # header + one row per arm


@pytest.mark.parametrize("opts, cold_l2", [([], "clean"), (["--l2-flush", "clean"], "clean"),
                                           (["--l2-flush", "dirty"], "dirty"),
                                           (["--warm-l2"], False)])
def test_bench_passes_the_l2_flush_to_the_timers(run, monkeypatch, tmp_path, opts, cold_l2):
    import paged_decode.bench as bench_pkg
    seen = []
    real = bench_pkg.run_bench

    def spy(*args, **kwargs):
        seen.append(kwargs["cold_l2"])
        return real(*args, **kwargs)
    monkeypatch.setattr(bench_pkg, "run_bench", spy)
    js = tmp_path / "b.json"
    res = run("bench", "--backend", "reference", "--context", "32", "--batch", "1",
              "--arms", "v2", "--reps", "1", "--warmup", "0", "--json", str(js), *opts)
    assert res.exit_code == 0, res.output
    assert seen == [cold_l2]
    # no L2 is flushed on a CPU backend, so its report names none
    assert "l2" not in json.loads(js.read_text())["header"]


def test_the_report_header_names_the_flush_when_given():
    from paged_decode.backends import get_backend
    from paged_decode.bench.runner import header
    be = get_backend("reference")
    assert header(be, bandwidth=None, l2="dirty")["l2"] == "dirty"
    assert "l2" not in header(be, bandwidth=None)


def test_the_report_header_records_the_experiment_switches_set(monkeypatch):
    """A run under ``PAGED_DECODE_*`` switches (an A/B of ``PAGED_DECODE_L2_PREFETCH``)
    says so in its header; a run under none has no such field."""
    from paged_decode.backends import get_backend
    from paged_decode.bench.runner import header
    from paged_decode.settings import VARIABLES
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    be = get_backend("reference")
    assert "settings" not in header(be, bandwidth=None)
    monkeypatch.setenv("PAGED_DECODE_L2_PREFETCH", "rows")
    monkeypatch.setenv("PAGED_DECODE_PDL", "1")
    assert header(be, bandwidth=None)["settings"] == {"PAGED_DECODE_L2_PREFETCH": "rows",
                                                      "PAGED_DECODE_PDL": "1"}


def test_bench_refuses_a_flush_with_a_warm_l2():
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--warm-l2",
                                    "--l2-flush", "dirty"])
    assert res.exit_code != 0 and "--warm-l2 flushes nothing" in res.output
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--warm-l2",
                                    "--l2-flush", "clean"])             # the default, named
    assert res.exit_code != 0 and "--warm-l2 flushes nothing" in res.output
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--l2-flush", "cold"])
    assert res.exit_code != 0 and "'cold' is not one of 'clean', 'dirty'" in res.output


def test_bench_rejects_unknown_arm_and_gpu_suites_on_cpu(run):
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--arms", "v3"])
    assert res.exit_code != 0 and "v3" in res.output
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "cascade"])
    assert res.exit_code != 0 and "--backend cuda" in res.output


def test_suites_run_small_cases_and_verify():
    from paged_decode import get_backend
    be = get_backend("reference")
    c = bench_cascade(be, CascadeCase(4, 512, 64, num_qo_heads=8, num_kv_heads=2,
                                      head_dim=64), warmup=1, reps=6, cold_l2=False)
    assert c.arms["cascade"].ran == "cascade" and not c.arms["cascade"].fell_back
    assert c.arms["flat"].ran in ("v2", "v2+merge")
    assert all(a.verified for a in c.arms.values())
    s = bench_sparse(be, SparseCase(2, 2048, 8, num_qo_heads=8, num_kv_heads=2, head_dim=64),
                     warmup=1, reps=6, cold_l2=False)
    assert s.arms["fused"].ran == "sparse" and s.arms["masked"].ran == "sparse-masked"
    assert all(a.verified for a in s.arms.values())


def test_forks_suite_runs_every_flat_arm_it_can_and_says_why_not_the_others():
    from paged_decode import get_backend
    be = get_backend("emulated-cuda")     # runs v2tc's CUDA body under the emulator
    f = bench_forks(be, CascadeCase(4, 64, 32, num_qo_heads=8, num_kv_heads=2, head_dim=64),
                    warmup=1, reps=3, cold_l2=False)
    assert f.arms["v2"].ran in ("v2", "v2+merge") and f.arms["v2tc"].ran in ("v2tc",
                                                                                "v2tc+merge")
    assert f.arms["cascade"].ran == "cascade"
    assert all(f.arms[a].verified for a in ("v2", "v2tc", "cascade"))
    for fi in ("flashinfer", "flashinfer-tc"):   # no GPU here: unavailable, with the reason
        assert f.arms[fi].ran == "unavailable" and "cuda backend" in f.arms[fi].note


def test_the_cascade_and_forks_suites_take_a_models_layouts_heads(monkeypatch):
    """``run_suite(model=...)`` (``bench --suite forks --model phi3-mini``): every case gets
    the layout's heads and says so in its label, and every arm, cascade's head_dim-96
    prefix kernel included, still matches the oracle; other suites and unknown layouts
    are refused by name."""
    from paged_decode import get_backend
    from paged_decode.bench import suites
    for name in suites.MODEL_SUITES:
        plain, phi = suites.suite_cases(name), suites.suite_cases(name, model="phi3-mini")
        assert [(c.batch, c.shared, c.suffix) for c in phi] == [
            (c.batch, c.shared, c.suffix) for c in plain]
        assert {(c.num_qo_heads, c.num_kv_heads, c.head_dim, c.model) for c in phi} == {
            (32, 32, 96, "phi3-mini")}
    (fp8,) = {c.kv_dtype for c in suites.suite_cases("forks", "float8_e4m3fn", "gqa16")}
    assert fp8 == "float8_e4m3fn"
    with pytest.raises(ValueError, match="model applies to the cascade, cascade-rule, "
                                         "forks suites, not 'sparse'"):
        suites.suite_cases("sparse", model="phi3-mini")
    with pytest.raises(ValueError, match="model must be one of .*phi3-mini.*got 'llama9'"):
        suites.suite_cases("forks", model="llama9")
    # one small case run through the suite's bench under the emulator
    be = get_backend("emulated-cuda")
    monkeypatch.setitem(suites.SUITES, "forks", lambda: [CascadeCase(2, 32, 16)])
    (r,) = suites.run_suite("forks", be, warmup=1, reps=2, cold_l2=False, graph=False,
                            model="phi3-mini")
    assert (r.case.num_qo_heads, r.case.num_kv_heads, r.case.head_dim) == (32, 32, 96)
    assert r.case.label == "cascade B2 shared32 suffix16 ps16 phi3-mini 32/32x96"
    assert r.case.row_bytes() == 2 * 32 * 96 * 2
    assert all(r.arms[a].verified for a in ("v2", "v2tc", "cascade"))
    assert r.arms["cascade"].ran == "cascade" and r.arms["v2tc"].ran.startswith("v2tc")
    assert CascadeCase(2, 32).label == "cascade B2 shared32 suffix256 ps16"


def test_forks_suite_over_fp8_pools_verifies_every_arm_against_the_dequantized_oracle():
    from paged_decode import get_backend
    be = get_backend("emulated-cuda")
    case = CascadeCase(3, 32, 16, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                       kv_dtype="float8_e4m3fn")
    assert case.label.endswith(" kv float8_e4m3fn")
    assert case.row_bytes() == 2 * 2 * 64                    # one byte per element
    f = bench_forks(be, case, warmup=1, reps=3, cold_l2=False)
    assert f.arms["v2"].ran in ("v2", "v2+merge") and f.arms["v2tc"].ran in ("v2tc",
                                                                                "v2tc+merge")
    assert f.arms["cascade"].ran == "cascade"
    assert all(f.arms[a].verified for a in ("v2", "v2tc", "cascade"))
    # negative control: the check reads the codes through the scales, so an output made
    # with another K scale fails it
    from paged_decode import decode
    from paged_decode.bench import suites
    from paged_decode.bench.runner import TOLERANCE, _verify
    q, k, v, table = suites.cascade_problem(be, case)
    vk = suites.fp8_variants(case.kv_dtype)
    good = decode(q, k, v, table, backend=be, **vk)
    assert _verify(be, good, q, k, v, table, vk) < TOLERANCE["float16"]
    off = decode(q, k, v, table, backend=be, **{**vk, "k_scale": 2 * vk["k_scale"]})
    assert _verify(be, off, q, k, v, table, vk) > TOLERANCE["float16"]
    with pytest.raises(ValueError, match="kv_dtype applies to the forks suite, not 'cascade'"):
        suites.run_suite("cascade", be, kv_dtype="float8_e4m3fn")


def test_a_fallen_back_arm_withholds_the_comparison():
    ok = ArmResult("v1", "v1", 0.0, True, call={"median_us": 10.0}, expected=("v1",))
    fell = ArmResult("v2", "gather", 0.0, True, call={"median_us": 5.0},
                     expected=("v2", "v2+merge"))
    text = table([BenchResult(CascadeCase(1, 16), 1, 1, {"v1": ok, "v2": fell})])
    assert fell.fell_back and "withheld" in text and "2.00" not in text
    good = ArmResult("v2", "v2", 0.0, True, call={"median_us": 5.0}, expected=("v2",))
    assert "2.00" in table([BenchResult(CascadeCase(1, 16), 1, 1, {"v1": ok, "v2": good})])


def test_the_table_names_an_arms_own_plan():
    """v2tc plans for itself (the wave rule on CUDA): where its chunks differ from the
    chunks column (v2's plan), the table says what it ran; the JSON keeps every arm's."""
    v2 = ArmResult("v2", "v2+merge", 0.0, True, call={"median_us": 10.0},
                   expected=("v2", "v2+merge"), plan={"chunks": 36, "ctas": 288,
                                                      "rule": "target"})
    tc = ArmResult("v2tc", "v2tc+merge", 0.0, True, call={"median_us": 9.0},
                   expected=("v2tc", "v2tc+merge"), plan={"chunks": 48, "ctas": 384,
                                                          "rule": "wave"})
    r = BenchResult(CascadeCase(1, 16), 36, 1, {"v2": v2, "v2tc": tc})
    text = table([r])
    assert "v2tc 48 chunks, 384 CTAs (wave rule)" in text and "v2 36 chunks" not in text
    assert r.to_dict()["arms"]["v2tc"]["plan"] == {"chunks": 48, "ctas": 384, "rule": "wave"}


def test_every_arm_of_ours_reports_its_plan(run):
    from paged_decode.backends import get_backend
    from paged_decode.bench.cases import BenchCase
    from paged_decode.bench.runner import bench_case
    r = bench_case(get_backend("emulated-cuda"), BenchCase(2, 300, 16, 8, 2, 64),
                   arms=("v2", "v2tc"), warmup=0, reps=1)
    for a in ("v2", "v2tc"):
        p = r.arms[a].plan
        assert p["chunks"] >= 2 and p["ctas"] >= 2 and p["rule"] == "target"   # no smem here


def test_cascade_and_sparse_presets_select_their_suites(run):
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--preset", "cascade"])
    assert res.exit_code != 0 and "--backend cuda" in res.output      # the suite ran its gate
    res = CliRunner().invoke(main, ["bench", "--backend", "reference", "--preset", "sparse",
                                    "--suite", "cascade"])
    assert res.exit_code != 0 and "cannot be combined" in res.output


def test_info_names_the_crossover_table(run, tmp_path, monkeypatch):
    res = run("info", "--backend", "reference", "--json")
    assert "path='auto' runs v2" in json.loads(res.output)["crossover"]
    bad = tmp_path / "t.json"
    bad.write_text("[]")
    monkeypatch.setenv("PAGED_DECODE_CROSSOVER", str(bad))
    res = run("info", "--backend", "reference")
    assert "crossover table: unreadable" in res.output


def test_bench_engine_suite_runs_verifies_and_reports(run, tmp_path, monkeypatch):
    import paged_decode.bench.engine as engine_mod
    released = []      # the allocators' cached blocks go back before every arm (S25-R3)
    monkeypatch.setattr(engine_mod, "release_memory", lambda be: released.append(be.name))
    out = tmp_path / "engine.json"
    res = run("bench", "--backend", "reference", "--suite", "engine", "--layers", "2",
              "--steps", "5", "--batch", "3", "--context", "40", "--json", str(out))
    assert res.exit_code == 0, res.output
    assert "eager" in res.output and "captured" in res.output
    for fi_arm in ("flashinfer", "flashinfer-captured"):
        assert re.search(fi_arm + r" +not run: needs the cuda backend", res.output), fi_arm
    data = json.loads(out.read_text())
    arms = data["results"][0]["arms"]
    for name in ("eager", "captured"):
        assert arms[name]["ran"] and arms[name]["verified"]
        assert len(arms[name]["errors"]) == 4           # layers 0 and L-1, first and last
        assert arms[name]["step_us"] > 0
    assert not arms["flashinfer"]["ran"] and not arms["flashinfer-captured"]["ran"]
    assert released == ["reference"] * len(arms)
    bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "engine",
                                    "--arms", "v2"])
    assert bad.exit_code != 0 and "eager, captured, eager-tc, captured-tc, speculative, " \
        "speculative-tc, flashinfer" in bad.output
    bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "engine",
                                    "--model", "llama9"])
    assert bad.exit_code != 0 and "--model must be one of" in bad.output
    for opts in (["--window-left", "5"], ["--sinks"],
                 ["--soft-cap", "3"], ["--preset", "targets"], ["--warm-l2"],
                 ["--l2-flush", "dirty"], ["--l2-flush", "clean"]):
        bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite",
                                        "engine", *opts])
        assert bad.exit_code != 0 and f"bench --suite engine: {opts[0]} apply to the decode " \
            "suite" in bad.output, opts


def test_bench_model_selects_one_layout_of_a_decode_preset(run, tmp_path):
    out = tmp_path / "qwen.json"
    res = run("bench", "--backend", "reference", "--preset", "models", "--model", "qwen2-7b",
              "--context", "48", "--batch", "2", "--arms", "v2", "--reps", "1", "--warmup", "0",
              "--json", str(out))
    assert res.exit_code == 0, res.output
    cases = json.loads(out.read_text())["results"]
    assert [c["case"]["model"] for c in cases] == ["qwen2-7b"]
    assert "qwen2-7b B2 ctx48" in res.output and "llama3-8b" not in res.output
    bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--preset", "models",
                                    "--model", "llama9", "--context", "48", "--batch", "2"])
    assert bad.exit_code != 0 and "--model must name a layout of preset models" in bad.output
    assert "qwen2-7b" in bad.output and "got 'llama9'" in bad.output
    bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "sparse",
                                    "--model", "qwen2-7b"])
    assert bad.exit_code != 0 and "not --suite sparse" in bad.output
    bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "forks",
                                    "--model", "llama9"])
    assert bad.exit_code != 0 and "--model must name a models-preset layout" in bad.output
    assert "phi3-mini" in bad.output and "got 'llama9'" in bad.output
    bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "cascade",
                                    "--kv-dtype", "float8_e4m3fn"])
    assert bad.exit_code != 0
    assert "--kv-dtype applies to the decode and forks suites, not --suite cascade" in bad.output


def test_bench_engine_suite_model_heads_and_tensor_core_arms(run, tmp_path):
    # the reference backend has no tensor-core partial: those arms are reported, not run
    res = run("bench", "--backend", "reference", "--suite", "engine", "--layers", "2",
              "--steps", "3", "--batch", "2", "--context", "40", "--model", "llama3-70b-tp8",
              "--arms", "eager,eager-tc")
    assert res.exit_code == 0, res.output
    assert "llama3-70b-tp8 B2 ctx40 L2 x3 8/1x128" in res.output
    assert re.search(r"eager-tc +not run", res.output) and "v2tc" in res.output
    # on the emulated CUDA backend they run and are checked against the oracle
    out = tmp_path / "tc.json"
    res = run("bench", "--backend", "emulated-cuda", "--suite", "engine", "--layers", "2",
              "--steps", "3", "--batch", "2", "--context", "40", "--dtype", "float16",
              "--arms", "eager-tc,captured-tc", "--json", str(out))
    assert res.exit_code == 0, res.output
    arms = json.loads(out.read_text())["results"][0]["arms"]
    for name in ("eager-tc", "captured-tc"):
        assert arms[name]["ran"] and arms[name]["verified"], arms[name]


def test_bench_engine_suite_over_fp8_pools(run, tmp_path, monkeypatch):
    """``--kv-dtype`` applies to the engine suite: the case names its pools' format in the
    table and the JSON, with each arm's per-layer scales; the arms are verified against
    the oracle on the dequantized pools (tests/test_engine_fp8.py has the rest)."""
    out = tmp_path / "fp8.json"
    res = run("bench", "--backend", "emulated-cuda", "--suite", "engine", "--layers", "2",
              "--steps", "3", "--batch", "3", "--context", "40", "--dtype", "float16",
              "--kv-dtype", "float8_e4m3fn", "--arms", "eager,captured-tc", "--json", str(out))
    assert res.exit_code == 0, res.output
    assert re.search(r"float16 kv float8_e4m3fn +eager ", res.output), res.output
    assert re.search(r"float16 kv float8_e4m3fn +captured-tc ", res.output), res.output
    [case] = json.loads(out.read_text())["results"]
    assert case["case"]["kv_dtype"] == "float8_e4m3fn" and case["case"]["dtype"] == "float16"
    for name in ("eager", "captured-tc"):
        arm = case["arms"][name]
        assert arm["ran"] and arm["verified"] and arm["kv_dtype"] == "float8_e4m3fn", arm
        assert len(arm["k_scale"]) == len(arm["v_scale"]) == 2
        assert all(0 < x < 1 for x in arm["k_scale"] + arm["v_scale"])
    # 16-bit pools record no scales
    res = run("bench", "--backend", "reference", "--suite", "engine", "--layers", "1",
              "--steps", "2", "--batch", "2", "--context", "20", "--arms", "eager",
              "--json", str(out))
    arm = json.loads(out.read_text())["results"][0]["arms"]["eager"]
    assert res.exit_code == 0 and arm["kv_dtype"] == "" and arm["k_scale"] == []
    bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "engine",
                                    "--kv-dtype", "float16"])
    assert bad.exit_code != 0 and "--kv-dtype" in bad.output and "float8_e5m2" in bad.output
    # negative control: an oracle reading the pools with another v_scale fails the command
    import paged_decode.bench.engine as engine_mod
    real = engine_mod.oracle_decode
    monkeypatch.setattr(engine_mod, "oracle_decode", lambda *a, **kw: real(
        *a, **{**kw, "v_scale": kw["v_scale"] * 1.1}))
    bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "engine",
                                    "--layers", "1", "--steps", "2", "--batch", "2",
                                    "--context", "20", "--arms", "eager", "--kv-dtype",
                                    "float8_e5m2"])
    assert bad.exit_code != 0 and "engine arms failed verification" in bad.output
    assert "kv float8_e5m2 eager" in bad.output


def test_bench_engine_suite_speculative_arms(run, tmp_path, monkeypatch):
    """``speculative`` / ``speculative-tc``: T slots per sequence per step, the drafts
    trimmed back, every arm checked against the oracle over its T tokens; the sequences
    grow by what is kept; --spec-tokens belongs to the engine suite."""
    out = tmp_path / "spec.json"
    res = run("bench", "--backend", "emulated-cuda", "--suite", "engine", "--layers", "2",
              "--steps", "3", "--batch", "3", "--context", "40", "--dtype", "float16",
              "--arms", "speculative,speculative-tc", "--spec-tokens", "3", "--json",
              str(out))
    assert res.exit_code == 0, res.output
    [case] = json.loads(out.read_text())["results"]
    assert case["case"]["spec_tokens"] == 3
    for name in ("speculative", "speculative-tc"):
        arm = case["arms"][name]
        assert arm["ran"] and arm["verified"] and "3 tokens per sequence" in arm["note"], arm
    assert re.search(r"speculative-tc .*\(3 tokens per sequence per step", res.output)
    bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--spec-tokens", "3"])
    assert bad.exit_code != 0 and "--spec-tokens applies to the engine suite" in bad.output
    # negative control: an oracle shifted by one token fails the command
    import paged_decode.bench.engine as engine_mod
    real = engine_mod.oracle_decode
    monkeypatch.setattr(engine_mod, "oracle_decode",
                        lambda q, *a, **kw: real(q[:, ::-1].copy(), *a, **kw))
    bad = CliRunner().invoke(main, ["bench", "--backend", "reference", "--suite", "engine",
                                    "--layers", "1", "--steps", "2", "--batch", "2",
                                    "--context", "20", "--arms", "speculative"])
    assert bad.exit_code != 0 and "engine arms failed verification" in bad.output


def test_an_engine_arm_with_a_wrong_answer_fails_verification():
    """Negative control: the oracle comparison of the engine suite can fail."""
    from paged_decode.bench.engine_case import EngineArm
    assert EngineArm("eager", True, "float32", errors=[1e-6, 1e-6]).verified
    assert not EngineArm("eager", True, "float32", errors=[1e-6, 3e-2]).verified
    assert not EngineArm("eager", True, "float32", errors=[float("nan")]).verified
    assert not EngineArm("eager", True, "float32").verified


def test_v2tc_arm_keeps_a_plan_made_for_its_ctas_and_replans_any_other():
    # a sweep's plan (its own chunk size, v2tc's CTAs per chunk) must be the one timed
    from paged_decode import get_backend, plan_decode
    from paged_decode.bench.arms import make_arm
    from paged_decode.problems import make_table
    from paged_decode.specs import v2tc_ctas_per_chunk
    be = get_backend("emulated-cuda")
    rng = np.random.default_rng(0)
    table, n = make_table([64, 40], 16, rng=rng)
    q = rng.standard_normal((2, 32, 64)).astype(np.float16)
    k, v = (rng.standard_normal((n, 16, 2, 64)).astype(np.float16) for _ in range(2))
    tc = v2tc_ctas_per_chunk(32, 2)
    mine = plan_decode(table, 32, 2, 64, device=be.device_info(), pages_per_chunk=1,
                       ctas_per_chunk=tc)
    assert make_arm("v2tc", be, q, k, v, table, mine, 0.125).call.plan is mine
    v2_plan = plan_decode(table, 32, 2, 64, device=be.device_info())
    assert v2_plan.ctas_per_chunk != tc            # GQA 16: v2 splits the group, v2tc not
    got = make_arm("v2tc", be, q, k, v, table, v2_plan, 0.125).call.plan
    assert got is not v2_plan and got.ctas_per_chunk == tc


def test_ragged_cases_draw_their_lengths_and_count_their_bytes():
    from paged_decode.backends import get_backend
    from paged_decode.bench.cases import BenchCase, preset_cases
    from paged_decode.bench.report import to_csv
    from paged_decode.bench.runner import _problem, bench_case
    from paged_decode.bench.sdpa_arm import equal_visible_length
    c = BenchCase(6, 300, 16, 8, 2, 64, ragged_min=20)
    lens = c.lengths()
    assert lens == c.lengths() and len(lens) == 6 and len(set(lens)) > 1
    assert all(20 <= n <= 300 for n in lens)
    assert c.kv_bytes() == 2 * sum(lens) * 2 * 64 * 2
    assert "ctx20-300" in c.label
    w = BenchCase(6, 300, 16, 8, 2, 64, ragged_min=20, window_left=49)
    assert w.kv_bytes() == 2 * sum(min(n, 50) for n in lens) * 2 * 64 * 2
    assert [(x.batch, x.ragged_min, x.context) for x in preset_cases("ragged")] == \
        [(16, 1024, 8192), (128, 512, 4096)]
    be = get_backend("reference")
    table = _problem(be, c, 0)[3]
    assert list(table.visible_lens) == lens
    with pytest.raises(ValueError, match="length"):   # contiguous SDPA: equal lengths only
        equal_visible_length(table)
    r = bench_case(be, c, arms=("v2",), reps=3, warmup=0)
    assert r.arms["v2"].verified                      # checked against the oracle
    assert ",20-300," in to_csv([r])


def test_a_preset_s_axes_can_be_replaced_without_losing_its_shapes():
    """``--batch`` / ``--context`` / ``--page`` / ``--dtype`` over a preset keep every
    other field of each of its shapes (before: a ragged batch came back uniform, and an
    fp8 or variant case lost its pools' dtype and its variant, under the same preset)."""
    from paged_decode.bench.cases import BenchCase, preset_cases
    got = preset_cases("ragged", batches=[16])
    assert sorted((c.batch, c.ragged_min, c.context) for c in got) == \
        [(16, 512, 4096), (16, 512, 8192), (16, 1024, 4096), (16, 1024, 8192)]
    with pytest.raises(ValueError, match="ragged batch draws requests of 1024 tokens and "
                                         "more; --context 800 is shorter"):
        preset_cases("ragged", contexts=[800])
    models = preset_cases("models", contexts=[2048], dtype="bfloat16")
    assert {(c.model, c.num_qo_heads, c.num_kv_heads, c.head_dim) for c in models} == \
        {(c.model, c.num_qo_heads, c.num_kv_heads, c.head_dim)
         for c in preset_cases("models")}
    assert {c.context for c in models} == {2048} and {c.dtype for c in models} == {"bfloat16"}
    # every field that is not an axis survives (a case the presets do not hold today)
    import paged_decode.bench.cases as cases_mod
    odd = BenchCase(4, 4096, 16, 28, 4, 128, kv_dtype="float8_e4m3fn", window_left=511,
                    soft_cap=30.0, sinks=True, ragged_min=100, model="qwen2-7b")
    cases_mod.PRESETS["_odd"] = lambda: [odd]
    try:
        (c,) = preset_cases("_odd", batches=[2])
    finally:
        del cases_mod.PRESETS["_odd"]
    assert c == BenchCase(2, 4096, 16, 28, 4, 128, kv_dtype="float8_e4m3fn", window_left=511,
                          soft_cap=30.0, sinks=True, ragged_min=100, model="qwen2-7b")


def test_pools_are_filled_slab_by_slab(monkeypatch):
    """fill_slabs: every row drawn once, in order, cast on assignment, no slab over
    SLAB_BYTES of float32 scratch, the last one short."""
    from paged_decode.bench import runner
    monkeypatch.setattr(runner, "SLAB_BYTES", 3 * 4 * 12)      # three rows of 3 x 4
    rng = np.random.default_rng(0)
    want = rng.standard_normal((10, 3, 4)).astype(np.float32)
    sizes, at = [], [0]

    def draw(n):
        sizes.append(n)
        at[0] += n
        return want[at[0] - n:at[0]]
    got = runner.fill_slabs(np, (10, 3, 4), np.float16, draw)
    assert sizes == [3, 3, 3, 1] and got.dtype == np.float16
    assert np.array_equal(got, want.astype(np.float16))


def test_a_case_that_does_not_fit_is_reported_and_the_run_goes_on(monkeypatch):
    """A case whose pools cannot be allocated reports every arm unavailable, saying why;
    the next case runs; the CLI's verification check skips the unavailable arms."""
    from paged_decode.bench import runner
    from paged_decode.bench.cases import BenchCase
    real = runner._problem

    def problem(be, case, seed):
        if case.batch == 3:
            raise MemoryError("Out of memory allocating 10,737,418,240 bytes")
        return real(be, case, seed)
    monkeypatch.setattr(runner, "_problem", problem)
    res = runner.run_bench([BenchCase(3, 64, 16, 4, 2, 64), BenchCase(2, 64, 16, 4, 2, 64)],
                           backend="reference", arms=("v1", "v2"), warmup=0, reps=1)
    assert [a.ran for a in res[0].arms.values()] == ["unavailable"] * 2
    assert all("do not fit the device's memory" in a.note and "10,737,418,240" in a.note
               for a in res[0].arms.values())
    assert all(a.verified for a in res[1].arms.values())


def test_an_arm_out_of_memory_is_unavailable_and_other_failures_still_raise(monkeypatch):
    """An arm whose allocation fails (CuPy's MemoryError, or torch's OutOfMemoryError, a
    RuntimeError) is reported unavailable and the next arm runs; any other exception is a
    bug and propagates (negative control)."""
    from paged_decode.bench import runner
    from paged_decode.bench.cases import BenchCase

    class OutOfMemoryError(RuntimeError):   # torch's, by name
        pass
    real = runner.make_arm
    fail = {"v1": OutOfMemoryError("CUDA out of memory")}

    def make_arm(name, *a, **k):
        if name in fail:
            raise fail[name]
        return real(name, *a, **k)
    monkeypatch.setattr(runner, "make_arm", make_arm)
    r = runner.bench_case(runner.get_backend("reference"), BenchCase(2, 64, 16, 4, 2, 64),
                          arms=("v1", "v2"), warmup=0, reps=1)
    assert r.arms["v1"].ran == "unavailable" and "out of device memory" in r.arms["v1"].note
    assert r.arms["v2"].verified
    fail["v1"] = RuntimeError("an unrelated failure")
    with pytest.raises(RuntimeError, match="unrelated"):
        runner.bench_case(runner.get_backend("reference"), BenchCase(2, 64, 16, 4, 2, 64),
                          arms=("v1", "v2"), warmup=0, reps=1)
    from paged_decode.errors import PoolExhaustedError  # a MemoryError of ours: a bug
    fail["v1"] = PoolExhaustedError("no free page")
    with pytest.raises(PoolExhaustedError, match="no free page"):
        runner.bench_case(runner.get_backend("reference"), BenchCase(2, 64, 16, 4, 2, 64),
                          arms=("v1", "v2"), warmup=0, reps=1)
