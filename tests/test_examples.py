"""The generation examples (``examples/``) run as the README shows them, on the CPU: every
arm's greedy tokens equal the framework's own cache's, and the paged arms hold less K/V.
Skipped where the framework is not installed (the ``[transformers]`` / ``[mlx-lm]``
extras; CI installs both through ``[ci]``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run_example(name: str, tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / f"{name}.json"
    res = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), "--batch",
                          "2", "--new", "4", "--json", str(out), *args],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads(out.read_text())["rows"]


def _check(rows: list[dict], framework: str) -> None:
    arms = {r["arm"]: r for r in rows}
    assert framework in arms and any(a.startswith("paged-decode") for a in arms)
    for r in rows:
        assert r["same_tokens"] is True, r["arm"]
        assert r["tokens_per_s"] > 0
    paged = [r for r in rows if r["arm"].startswith("paged-decode")]
    assert all(r["kv_bytes"] < arms[framework]["kv_bytes"] for r in paged)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                    or importlib.util.find_spec("torch") is None,
                    reason="the [transformers] extra is not installed")
def test_transformers_example_runs(tmp_path):
    rows = _run_example("generate_transformers", tmp_path, "--model-config", "qwen2")
    _check(rows, "transformers dynamic cache (sdpa)")


@pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                    reason="the [mlx-lm] extra is not installed")
def test_mlx_lm_example_runs(tmp_path):
    _check(_run_example("generate_mlx_lm", tmp_path), "mlx-lm BatchKVCache")


def test_the_check_fails_on_other_tokens_or_more_memory():
    ok = [dict(arm="fw", same_tokens=True, tokens_per_s=1.0, kv_bytes=10),
          dict(arm="paged-decode", same_tokens=True, tokens_per_s=1.0, kv_bytes=8)]
    _check(ok, "fw")
    with pytest.raises(AssertionError, match="paged-decode"):
        _check([ok[0], {**ok[1], "same_tokens": False}], "fw")
    with pytest.raises(AssertionError):
        _check([ok[0], {**ok[1], "kv_bytes": 12}], "fw")
