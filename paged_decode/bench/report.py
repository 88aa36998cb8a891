"""Benchmark output: a text table, JSON, CSV and a markdown report."""

from __future__ import annotations

import csv
import io
from typing import Any

import numpy as np

from .. import json_text
from .runner import ArmResult, BenchResult

MAIN_ARM = "v2"
#: the arm other arms are divided by: v2 in the decode suite, cascade (tensor-core level
#: 0) in the cascade suites, the fused path in the sparse suite
MAIN_ARMS = (MAIN_ARM, "cascade", "fused")


def _main_arm(arms: list[str]) -> str:
    return next((a for a in MAIN_ARMS if a in arms), arms[-1])


def comparable(a: ArmResult, b: ArmResult) -> bool:
    """Both arms verified, timed and ran what they stand for, and timed alike: the same
    GPU timing mode (a graph replay is not compared with eager events) and the same calls
    per graph replay (``graph_layers``: a per-call time of N calls in one replay is not
    compared with one of another N)."""
    return (a.verified and b.verified and not a.fell_back and not b.fell_back
            and a.median_us == a.median_us and b.median_us == b.median_us
            and a.gpu_mode == b.gpu_mode and a.graph_layers == b.graph_layers)


def _timed_as(x: ArmResult) -> str:
    """How an arm's GPU time was taken, for a note: its calls per graph replay, or
    ``eager events``."""
    return "eager events" if x.gpu_mode == "events" else f"{x.graph_layers} per replay"


def layer_notes(r: BenchResult) -> list[str]:
    """A layered case's note (``graph_layers`` > 1 for the case or an arm) when its timed
    arms were not all timed alike: each arm's calls per graph replay, or eager events (an
    arm whose layers ran out of memory ran fewer; one whose graph could not be captured
    fell back to one eager call), and that their ratios are withheld."""
    timed = {a: x for a, x in r.arms.items() if x.verified and x.gpu}
    if (max([r.graph_layers, *(x.graph_layers for x in r.arms.values())]) <= 1
            or len({(x.gpu_mode, x.graph_layers) for x in timed.values()}) <= 1):
        return []
    return [f"{r.case.label}: arms timed differently (ratios between them withheld): "
            + ", ".join(f"{a} {_timed_as(x)}" for a, x in timed.items())]


def _cell(x: ArmResult, width: int = 19) -> str:
    """An arm's cell: ``width - 1`` characters right-aligned, then its mark."""
    if x.ran == "unavailable":
        return f"{'n/a':>{width - 1}} "
    mark = "!" if not x.verified else "*" if x.fell_back else " "
    if not x.verified:
        return f"{'FAIL':>{width - 1}}{mark}"
    gpu = x.gpu.get("median_us")
    call = x.call.get("median_us", float("nan"))
    txt = f"{gpu:.1f}/{call:.1f}" if gpu is not None else f"{call:.1f}"
    if x.gpu_mode == "events":
        txt += "e"
    return f"{txt:>{width - 1}}{mark}"


def table(results: list[BenchResult], *, bandwidth: float | None = None) -> str:
    """One row per case: each arm's median GPU time (graph replay) / per-call time in us
    (``!`` failed verification, ``*`` fell back to another path, ``e`` GPU time from eager
    events because the call could not be captured, ``n/a`` the arm cannot run here), then
    the main arm's (v2) GB/s and fraction of the measured read bandwidth, and each other
    arm's time divided by the main arm's (GPU time; > 1 means v2 is faster). A ratio
    involving an arm that fell back or failed, or two arms timed differently
    (``comparable``), is withheld (``-``). When a case ran more than one layer per graph
    replay (``graph_layers``), a ``layers`` column gives each case's N (GPU times are then
    per call: replay / N), a capped N is noted, and so are the arms' own N where they
    differ (``layer_notes``)."""
    if not results:
        return "(no results)"
    arms = list(results[0].arms)
    main = _main_arm(arms)
    others = [a for a in arms if a != main]
    width = max(44, max(len(r.case.label) for r in results) + 1)
    # every column as wide as its header (an arm's whole name, e.g. flashinfer-tc)
    arm_w = {a: max(19, len(a) + 5) for a in arms}
    gbps_h = main + " GB/s"
    gbps_w = max(12, len(gbps_h) + 1)
    ratio_w = {o: max(13, len(o) + len(main) + 3) for o in others}
    head = f"{'case':<{width}}" + "".join(f"{a + ' us':>{arm_w[a] - 1}} " for a in arms)
    head += f"{gbps_h:>{gbps_w}}{'%bw':>6}" + "".join(f"{o + '/' + main:>{ratio_w[o]}}"
                                                      for o in others)
    head += f"{'chunks':>7}"
    layered = any(r.graph_layers > 1 for r in results)
    if layered:
        head += f"{'layers':>7}"
    lines = [head, "-" * len(head)]
    withheld = []
    for r in results:
        row = f"{r.case.label:<{width}}" + "".join(_cell(r.arms[a], arm_w[a]) for a in arms)
        m = r.arms[main]
        pct = f"{100 * m.gbps * 1e9 / bandwidth:>5.0f}%" if bandwidth and m.gbps else f"{'-':>6}"
        row += f"{m.gbps:>{gbps_w}.1f}{pct}"
        for o in others:
            x = r.arms[o]
            ok = comparable(m, x)
            row += (f"{x.median_us / m.median_us:>{ratio_w[o]}.2f}" if ok
                    else f"{'-':>{ratio_w[o]}}")
            if not ok and x.ran != "unavailable":
                withheld.append(f"{r.case.label}: {main} vs {o}")
        lines.append(row + f"{r.num_chunks:>7}" + (f"{r.graph_layers:>7}" if layered else ""))
    host = {a: [x.host["median_us"] for r in results for b, x in r.arms.items()
                if b == a and x.host] for a in arms}
    if any(host.values()):
        lines.append("host us per call (enqueue only, median over cases; min-max): " + ", ".join(
            f"{a} {np.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for a, v in host.items() if v))
    ran = sorted({f"{a}->{x.ran}" for r in results for a, x in r.arms.items()})
    if layered:
        lines.append("columns: GPU us per call (layers calls, each over its own layer's "
                     "pools, in one CUDA-graph replay, cold L2: replay / layers; 'e': one "
                     "eager call) / per-call us (host included)")
    elif any(x.gpu for r in results for x in r.arms.values()):
        lines.append("columns: GPU us (CUDA-graph replay, cold L2) / per-call us (host "
                     "included)")
    else:
        lines.append("columns: host us per call (synchronized)")
    lines.append("arms ran: " + ", ".join(ran) + "  ('!' failed verification, '*' fell back)")
    own = [f"{r.case.label.split(' ps')[0]}: {a} {x.plan['chunks']} chunks, "
           f"{x.plan['ctas']} CTAs ({x.plan['rule']} rule)"
           for r in results for a, x in r.arms.items()
           if x.plan and x.plan["chunks"] != r.num_chunks]
    if own:
        lines.append("plans differing from the chunks column (v2's plan): " + "; ".join(own[:12])
                     + (f" ... ({len(own)} in all)" if len(own) > 12 else ""))
    notes = sorted({f"{a}: {x.note}" for r in results for a, x in r.arms.items() if x.note})
    lines += [f"note: {n}" for n in notes[:10]]
    lines += [f"note: {r.case.label}: {r.layers_note}" for r in results if r.layers_note]
    lines += [f"note: {n}" for r in results for n in layer_notes(r)]
    if withheld:
        lines.append(f"comparisons withheld (an arm fell back or failed, or the two were "
                     f"timed differently): {len(withheld)}: "
                     + "; ".join(withheld[:8]) + (" ..." if len(withheld) > 8 else ""))
    return "\n".join(lines)


def to_json(results: list[BenchResult], head: dict[str, Any]) -> str:
    """The bench's JSON (strict: a NaN measurement is written ``null``)."""
    return json_text.dumps({"header": head, "results": [r.to_dict() for r in results]},
                           indent=1)


def _context(case: Any) -> str:
    """A case's context column: ``8192``, or ``1024-8192`` for a ragged batch."""
    lo = getattr(case, "ragged_min", 0)
    return f"{lo}-{case.context}" if lo else str(case.context)


def to_csv(results: list[BenchResult]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["model", "batch", "context", "page_size", "hq", "hkv", "head_dim", "dtype",
                "arm", "ran", "verified", "max_rel_error", "gpu_mode", "graph_layers",
                "gpu_median_us",
                "gpu_p20_us", "gpu_p80_us", "call_median_us", "call_p20_us", "call_p80_us",
                "api_call_median_us", "host_median_us", "gbps", "num_chunks",
                "pages_per_chunk", "note"])
    for r in results:
        c = r.case
        for a in r.arms.values():
            w.writerow([c.model, c.batch, _context(c), c.page_size, c.num_qo_heads,
                        c.num_kv_heads, c.head_dim, c.dtype, a.arm, a.ran, a.verified,
                        f"{a.max_rel_error:.3g}", a.gpu_mode, a.graph_layers,
                        a.gpu.get("median_us", ""),
                        a.gpu.get("p20_us", ""), a.gpu.get("p80_us", ""),
                        a.call.get("median_us", ""), a.call.get("p20_us", ""),
                        a.call.get("p80_us", ""), a.api_call.get("median_us", ""),
                        a.host.get("median_us", ""), f"{a.gbps:.2f}", r.num_chunks,
                        r.pages_per_chunk, a.note])
    return buf.getvalue()


def markdown(results: list[BenchResult], head: dict[str, Any], command: str) -> str:
    lines = ["# Benchmark run", "", f"Command: `{command}`", ""]
    lines += [f"- {k}: {v}" for k, v in head.items()]
    bw = head.get("read_bandwidth_GBps")
    lines += ["", "```", table(results, bandwidth=bw * 1e9 if bw else None), "```", ""]
    return "\n".join(lines)
