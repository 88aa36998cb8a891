"""The bench plot: one panel per (batch, page, geometry, dtype), one line per arm; failed,
unavailable and fallen-back arms are left out; the CLI reports bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from paged_decode.bench.plot import _value, plot_results
from paged_decode.cli import main

matplotlib = pytest.importorskip("matplotlib")   # in the dev extra, so CI runs these


def _data():
    res = []
    for b in (1, 4):
        for ctx in (1024, 4096):
            arms = {"v2": {"verified": True, "ran": "v2", "gpu": {"median_us": ctx / 100 * b},
                           "call": {"median_us": 20.0}, "gbps": 100.0},
                    "v1": {"verified": False, "ran": "v1", "gpu": {"median_us": 1.0},
                           "call": {"median_us": 1.0}, "gbps": 1.0},
                    "fi": {"verified": False, "ran": "unavailable", "gpu": {}, "call": {},
                           "gbps": 0.0}}
            res.append({"case": {"batch": b, "context": ctx, "page_size": 16,
                                 "model": "m", "num_qo_heads": 32, "num_kv_heads": 8,
                                 "head_dim": 128, "dtype": "float16"}, "arms": arms})
    return {"header": {"device": "test", "date": "today"}, "results": res}


def test_plot_writes_a_png_with_one_panel_per_batch(tmp_path):
    out = plot_results(_data(), tmp_path / "p.png")
    head = out.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    fig_axes = matplotlib.pyplot.gcf().axes          # closed after saving: a new empty figure
    assert fig_axes == []


def test_unverified_and_unavailable_arms_are_not_plotted():
    d = _data()["results"][0]["arms"]
    assert _value(d["v2"], "gpu") == pytest.approx(10.24)
    assert _value(d["v1"], "gpu") is None and _value(d["fi"], "gpu") is None
    assert _value(d["v2"], "call") == 20.0 and _value(d["v2"], "gbps") == 100.0
    # a NaN rate is written null (json_text): a gap in the plot, as NaN was
    assert _value({**d["v2"], "gbps": None}, "gbps") is None


def test_plot_rejects_bad_metric_and_empty_results(tmp_path):
    with pytest.raises(ValueError, match="metric"):
        plot_results(_data(), tmp_path / "x.png", metric="ms")
    empty = _data()
    for r in empty["results"]:
        r["arms"].pop("v2")
    with pytest.raises(ValueError, match="no verified arm"):
        plot_results(empty, tmp_path / "x.png")


def test_plot_command(tmp_path):
    src = tmp_path / "r.json"
    src.write_text(json.dumps(_data()))
    res = CliRunner().invoke(main, ["plot", str(src), str(tmp_path / "o.png"), "--metric",
                                    "gbps"])
    assert res.exit_code == 0 and (tmp_path / "o.png").exists(), res.output
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = CliRunner().invoke(main, ["plot", str(bad), str(tmp_path / "o2.png")])
    assert res.exit_code != 0 and "bad.json" in res.output


def test_plot_reports_deep_and_huge_json(tmp_path):
    """A file nested past Python's recursion limit, or holding an integer no double holds,
    is a one-line error, not a traceback."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)
    res = CliRunner().invoke(main, ["plot", str(deep), str(tmp_path / "o.png")])
    assert res.exit_code != 0 and "nested too deep" in res.output, res.output
    data = _data()
    data["results"][0]["case"]["context"] = 2**2000
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(data))
    res = CliRunner().invoke(main, ["plot", str(huge), str(tmp_path / "o.png")])
    assert res.exit_code != 0 and "integers in [1, 2147483647]" in res.output, res.output
    data = _data()
    data["results"][0]["arms"]["v2"]["gpu"]["median_us"] = 2**2000
    huge.write_text(json.dumps(data))
    res = CliRunner().invoke(main, ["plot", str(huge), str(tmp_path / "o.png")])
    assert res.exit_code != 0 and "OverflowError" in res.output, res.output
