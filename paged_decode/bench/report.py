"""Benchmark output: a text table, JSON, CSV and a markdown report."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from .runner import BenchResult


def table(results: list[BenchResult], *, bandwidth: float | None = None) -> str:
    """One row per case: the median time of each arm (GPU time when measured; ``!`` marks
    an arm that failed verification, ``*`` one that fell back to another path), then the
    last arm's GB/s and fraction of the measured read bandwidth, and its speedup over each
    other arm. A speedup involving an arm that fell back or failed is withheld (``-``)."""
    if not results:
        return "(no results)"
    arms = list(results[0].arms)
    main, others = arms[-1], arms[:-1]
    width = max(44, max(len(r.case.label) for r in results) + 1)
    head = f"{'case':<{width}}" + "".join(f"{a + ' us':>13}" for a in arms)
    head += f"{main + ' GB/s':>14}{'%bw':>6}" + "".join(f"{main[:6] + '/' + o[:6]:>14}"
                                                          for o in others)
    head += f"{'chunks':>7}"
    lines = [head, "-" * len(head)]
    withheld = []
    for r in results:
        row = f"{r.case.label:<{width}}"
        for a in arms:
            x = r.arms[a]
            mark = "!" if not x.verified else "*" if x.fell_back else " "
            row += f"{x.median_us:>12.1f}{mark}"
        m = r.arms[main]
        pct = f"{100 * m.gbps * 1e9 / bandwidth:>5.0f}%" if bandwidth else f"{'-':>6}"
        row += f"{m.gbps:>14.1f}{pct}"
        for o in others:
            x = r.arms[o]
            ok = m.verified and x.verified and not m.fell_back and not x.fell_back
            row += f"{x.median_us / m.median_us:>14.2f}" if ok else f"{'-':>14}"
            if not ok:
                withheld.append(f"{r.case.label}: {main} vs {o}")
        lines.append(row + f"{r.num_chunks:>7}")
    ran = sorted({f"{a}->{x.ran}" for r in results for a, x in r.arms.items()})
    lines.append("arms ran: " + ", ".join(ran) + "  ('!' failed verification, '*' fell back)")
    if withheld:
        lines.append(f"comparisons withheld (an arm fell back or failed): {len(withheld)}: "
                     + "; ".join(withheld[:8]) + (" ..." if len(withheld) > 8 else ""))
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
