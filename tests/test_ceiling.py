"""``bench/ceiling.py``: the bandwidth a time of 0.95x FlashInfer's would need."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "ceiling", Path(__file__).resolve().parents[1] / "bench" / "ceiling.py")
ceiling = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ceiling)


def _arm(us, ok=True):
    return {"gpu": {"median_us": us}, "verified": ok}


def test_rows_take_each_sides_best_verified_arm(tmp_path):
    results = {"header": {"read_bandwidth_GBps": 1000.0}, "results": [
        {"label": "big", "io_bytes": 1_000_000_000,          # 1 GB: 1000 us at the bandwidth
         "arms": {"v2": _arm(1100.0), "v2tc": _arm(900.0, ok=False),
                  "flashinfer": _arm(1200.0), "flashinfer-tc": _arm(1010.0)}},
        {"label": "no-fi", "io_bytes": 10, "arms": {"v2": _arm(1.0)}}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    (row,) = ceiling.rows(str(path))              # the cell without FlashInfer is skipped
    assert row["ours_arm"] == "v2" and row["fi_arm"] == "flashinfer-tc"   # unverified v2tc out
    assert row["ratio"] == pytest.approx(1100.0 / 1010.0)
    assert row["fi_pct"] == pytest.approx(100 * 1000.0 / 1010.0)
    # 0.95 x 1010 us for 1 GB: 1042 GB/s, over the measured 1000
    assert row["need_pct"] == pytest.approx(100 / (0.95 * 1.010))
    assert row["need_pct"] > 100
