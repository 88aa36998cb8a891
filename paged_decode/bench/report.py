"""Benchmark output: a text table, JSON, CSV and a markdown report."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from .runner import BenchResult


def _time(r: BenchResult, arm: str) -> float:
    a = r.arms[arm]
    return a.gpu.get("median_us") or a.call.get("median_us", float("nan"))


def table(results: list[BenchResult], *, bandwidth: float | None = None) -> str:
    """One row per case: median time per arm (GPU time when measured), v2's GB/s and
    fraction of the measured read bandwidth, and v2's speedups over v1 and gather."""
    if not results:
        return "(no results)"
    arms = list(results[0].arms)
    head = f"{'case':<44}" + "".join(f"{a + ' us':>12}" for a in arms)
    extra = "v2" in arms
    if extra:
        head += f"{'v2 GB/s':>10}{'%bw':>6}{'v2/v1':>7}{'v2/gth':>7}{'chunks':>7}"
    lines = [head, "-" * len(head)]
    for r in results:
        row = f"{r.case.label:<44}" + "".join(
            f"{_time(r, a):>11.1f}{' ' if r.arms[a].verified else '!'}" for a in arms)
        if extra:
            v2 = _time(r, "v2")
            pct = f"{100 * r.arms['v2'].gbps * 1e9 / bandwidth:>5.0f}%" if bandwidth else \
                f"{'-':>6}"
            sp1 = _time(r, "v1") / v2 if "v1" in arms else float("nan")
            spg = _time(r, "gather") / v2 if "gather" in arms else float("nan")
            row += f"{r.arms['v2'].gbps:>10.1f}{pct}{sp1:>7.2f}{spg:>7.2f}{r.num_chunks:>7}"
        lines.append(row)
    ran = sorted({f"{a}->{x.ran}" for r in results for a, x in r.arms.items()})
    lines.append("arms ran: " + ", ".join(ran) + "  ('!' = failed verification)")
    return "\n".join(lines)


def to_json(results: list[BenchResult], head: dict[str, Any]) -> str:
    return json.dumps({"header": head, "results": [r.to_dict() for r in results]}, indent=1)


def to_csv(results: list[BenchResult]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["model", "batch", "context", "page_size", "hq", "hkv", "head_dim", "dtype",
                "arm", "ran", "verified", "max_rel_error", "gpu_median_us", "gpu_p20_us",
                "gpu_p80_us", "call_median_us", "gbps", "num_chunks", "pages_per_chunk"])
    for r in results:
        c = r.case
        for a in r.arms.values():
            w.writerow([c.model, c.batch, c.context, c.page_size, c.num_qo_heads,
                        c.num_kv_heads, c.head_dim, c.dtype, a.arm, a.ran, a.verified,
                        f"{a.max_rel_error:.3g}", a.gpu.get("median_us", ""),
                        a.gpu.get("p20_us", ""), a.gpu.get("p80_us", ""),
                        a.call.get("median_us", ""), f"{a.gbps:.2f}", r.num_chunks,
                        r.pages_per_chunk])
    return buf.getvalue()


def markdown(results: list[BenchResult], head: dict[str, Any], command: str) -> str:
    lines = ["# Benchmark run", "", f"Command: `{command}`", ""]
    lines += [f"- {k}: {v}" for k, v in head.items()]
    bw = head.get("read_bandwidth_GBps")
    lines += ["", "```", table(results, bandwidth=bw * 1e9 if bw else None), "```", ""]
    return "\n".join(lines)
