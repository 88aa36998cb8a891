"""``bench/issue_targets.py``: #17's and #14's targets judged from bench JSON, on
hand-made results whose verdicts are known."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("issue_targets",
                                               _ROOT / "bench" / "issue_targets.py")
it = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(it)

BW = 1000.0     # GB/s: 1 MB takes 1 us


def _arm(us, ok=True):
    return {"gpu": {"median_us": us}, "verified": ok}


def _case(batch, context, *, hq=32, hkv=8, d=128, dtype="float16", kv="", ragged=0,
          model="llama3-8b", **kw):
    c = {"batch": batch, "context": context, "page_size": 16, "num_qo_heads": hq,
         "num_kv_heads": hkv, "head_dim": d, "dtype": dtype, "model": model,
         "window_left": -1, "soft_cap": 0.0, "sinks": False, "kv_dtype": kv,
         "ragged_min": ragged}
    c.update(kw)
    return c


def _result(case, mb, arms, label=None):
    label = label or (f"{case['model']} B{case['batch']} ctx{case['context']} ps16 "
                      f"{case['num_qo_heads']}/{case['num_kv_heads']}x{case['head_dim']} "
                      f"{case['dtype']}" + (f" kv {case['kv_dtype']}" if case["kv_dtype"] else ""))
    return {"case": case, "label": label, "io_bytes": mb * 1e6, "arms": arms}


def _write(tmp_path, results, device="GPU A", name="r.json"):
    p = tmp_path / name
    p.write_text(json.dumps({"header": {"device": device, "read_bandwidth_GBps": BW,
                                        "date": "2026-12-06"}, "results": results}))
    return p


def _rows(tmp_path, results):
    return it.judge(*it.load([_write(tmp_path, results)]))


def _by(rows, target):
    return {r.cell: r for r in rows if r.target == target}


def test_flashinfer_target_uses_the_better_arm_and_the_bandwidth_it_would_need(tmp_path):
    met = _result(_case(8, 8192), 300.0, {"v2tc": _arm(320.0), "flashinfer": _arm(400.0),
                                          "flashinfer-tc": _arm(340.0)})
    # FlashInfer at 1000 us for 1000 MB is at the bandwidth: 0.95x would need 105%
    wall = _result(_case(64, 16384), 1000.0, {"v2tc": _arm(1001.0),
                                              "flashinfer-tc": _arm(1000.0)})
    rows = _by(_rows(tmp_path, [met, wall]), "#17 fi")
    assert rows[met["label"]].met and rows[met["label"]].value == pytest.approx(320 / 340)
    assert not rows[wall["label"]].met
    assert rows[wall["label"]].need == pytest.approx(1 / 0.95)
    text = it.render(list(rows.values()), {"device": "GPU A", "read_bandwidth_GBps": BW})
    assert "met in 1 of 2 cells; in 1 of the misses" in text


def test_flashinfer_scope(tmp_path):
    """The grid at Llama-3-8B heads, any layout at 8 x 8K / 32 x 2K, ragged, bfloat16;
    not other cells, variants or other pages."""
    arms = {"v2tc": _arm(1.0), "flashinfer": _arm(2.0)}
    inside = [_case(1, 1024), _case(128, 32768), _case(8, 8192, hq=32, hkv=2, model="gqa16"),
              _case(32, 2048, hq=28, hkv=4, model="qwen2-7b"), _case(16, 8192, ragged=1024),
              _case(8, 8192, dtype="bfloat16")]
    outside = [_case(2, 1024), _case(8, 2048), _case(64, 8192, hq=32, hkv=2, model="gqa16"),
               _case(8, 8192, soft_cap=30.0), _case(8, 8192, page_size=32),
               _case(8, 8192, kv="float8_e4m3fn"), _case(8, 8192, dtype="float32")]
    results = [_result(c, 1.0, arms, label=f"cell{i}") for i, c in enumerate(inside + outside)]
    rows = _by(_rows(tmp_path, results), "#17 fi")
    assert sorted(rows) == [f"cell{i}" for i in range(len(inside))]


def test_bandwidth_and_sdpa_targets_apply_above_their_sizes(tmp_path):
    results = [
        _result(_case(8, 8192), 300.0, {"v2tc": _arm(320.0), "sdpa": _arm(310.0)}),   # 94%
        _result(_case(4, 8192), 255.0, {"v2tc": _arm(400.0), "sdpa": _arm(300.0)}),   # < 256 MB
        _result(_case(1, 1024), 63.0, {"v2tc": _arm(100.0), "sdpa": _arm(50.0)}),     # < 64 MB
        _result(_case(32, 8192), 1000.0, {"v2tc": _arm(1200.0), "sdpa": _arm(1100.0)})]
    rows = _rows(tmp_path, results)
    bw, sdpa = _by(rows, "#17 bw"), _by(rows, "#17 sdpa")
    assert sorted(bw) == sorted([results[0]["label"], results[3]["label"]])
    assert bw[results[0]["label"]].met and not bw[results[3]["label"]].met
    assert bw[results[3]["label"]].value == pytest.approx(1000 / 1200)
    assert sorted(sdpa) == sorted([results[0]["label"], results[1]["label"],
                                   results[3]["label"]])
    assert sdpa[results[0]["label"]].met and not sdpa[results[1]["label"]].met
    assert not sdpa[results[3]["label"]].met       # 1.091


def test_fp8_pairs_cells_by_label_and_needs_256_mb_of_float16(tmp_path):
    f16 = _result(_case(8, 8192), 268.0, {"v2tc": _arm(94.0)})
    f16_small = _result(_case(1, 8192), 34.0, {"v2tc": _arm(20.0)})
    fp8 = _result(_case(8, 8192, kv="float8_e4m3fn"), 134.0,
                  {"v2tc": _arm(54.0), "flashinfer-tc": _arm(60.0)})
    fp8_small = _result(_case(1, 8192, kv="float8_e4m3fn"), 17.0,
                        {"v2tc": _arm(10.0), "flashinfer-tc": _arm(10.0)})
    rows = _rows(tmp_path, [fp8, f16, f16_small, fp8_small])
    speed, fi = _by(rows, "#14 fp8 speed-up"), _by(rows, "#14 fp8 vs FlashInfer")
    assert list(speed) == [f16["label"]]
    assert speed[f16["label"]].value == pytest.approx(94 / 54) and not speed[f16["label"]].met
    assert fi[f16["label"]].met and not fi[f16_small["label"]].met   # 0.9 and 1.0


def test_unverified_and_missing_arms_count_nowhere(tmp_path):
    results = [_result(_case(8, 8192), 300.0, {"v2tc": _arm(1.0, ok=False),
                                               "flashinfer": _arm(2.0), "sdpa": _arm(2.0)}),
               _result(_case(32, 4096), 300.0, {"v2tc": _arm(1.0),
                                                "flashinfer": _arm(2.0, ok=False),
                                                "flashinfer-tc": _arm(4.0)})]
    rows = _rows(tmp_path, results)
    fi = _by(rows, "#17 fi")
    assert list(fi) == [results[1]["label"]] and fi[results[1]["label"]].value == 0.25


def test_forks_compares_flat_v2tc_with_flashinfers_better_flat_decode(tmp_path):
    """Against the faster of FlashInfer's two verified flat decodes: beating its CUDA-core
    arm alone (which reads shared pages from DRAM once per fork) is not the target."""
    case = {"batch": 32, "shared": 8192, "suffix": 256, "page_size": 16}
    results = [{"case": case, "label": "forks a", "io_bytes": 1.0,
                "arms": {"v2tc": _arm(120.0), "flashinfer": _arm(123.5), "cascade": _arm(60.0)}},
               {"case": case, "label": "forks b", "io_bytes": 1.0,
                "arms": {"v2tc": _arm(130.0), "flashinfer": _arm(123.5)}},
               {"case": case, "label": "forks c", "io_bytes": 1.0,
                "arms": {"v2tc": _arm(132.1), "flashinfer": _arm(335.4),
                         "flashinfer-tc": _arm(129.0)}},
               {"case": case, "label": "forks d", "io_bytes": 1.0,
                "arms": {"v2tc": _arm(132.1), "flashinfer": _arm(335.4),
                         "flashinfer-tc": _arm(129.0, ok=False)}}]
    rows = _by(_rows(tmp_path, results), "#17 forks")
    assert rows["forks a"].met and not rows["forks b"].met
    assert not rows["forks c"].met and round(rows["forks c"].value, 3) == 1.024
    assert "flashinfer-tc" in rows["forks c"].detail
    assert rows["forks d"].met and "(flashinfer)" in rows["forks d"].detail


def test_refuses_mixed_devices_and_foreign_files(tmp_path):
    a = _write(tmp_path, [], device="GPU A", name="a.json")
    b = _write(tmp_path, [], device="GPU B", name="b.json")
    with pytest.raises(SystemExit, match="GPU B"):
        it.load([a, b])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(SystemExit, match="not a `paged-decode bench --json` file"):
        it.load([bad])
    with pytest.raises(SystemExit, match="cannot read"):
        it.load([tmp_path / "missing.json"])


def test_main_writes_markdown_and_fails_without_cells(tmp_path, capsys):
    p = _write(tmp_path, [_result(_case(8, 8192), 300.0,
                                  {"v2tc": _arm(280.0), "flashinfer": _arm(330.0)})])
    out = tmp_path / "t.md"
    assert it.main([str(p), "--markdown", str(out)]) == 0
    assert "#17 fi (<= 0.95): met in 1 of 1 cells" in out.read_text()
    empty = _write(tmp_path, [], name="e.json")
    assert it.main([str(empty)]) == 1
    assert "no cell of any target" in capsys.readouterr().err
