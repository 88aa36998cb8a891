"""A PNG of a decode benchmark: time (or GB/s) against context, one line per arm, one
panel per (batch, page size, geometry, dtype). Needs matplotlib (``pip install
'paged-decode[plot]'``); reads the JSON that ``paged-decode bench --json`` writes."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import is_int


def _value(arm: dict[str, Any], metric: str) -> float | None:
    if not arm.get("verified") or arm.get("ran") == "unavailable":
        return None
    try:
        if metric == "gbps":        # null: a NaN rate (json_text), drawn as a gap
            return None if arm["gbps"] is None else (float(arm["gbps"]) or None)
        key = "gpu" if metric == "gpu" else "call"
        med = arm.get(key, {}).get("median_us")
        return float(med) if med else None
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise ValueError(f"a verified arm has no usable {metric} value ({exc!r})") from exc


def _layers_title(results: list[dict[str, Any]], metric: str) -> str:
    """The title's words on a ``--graph-layers`` run: its GPU times are per call, of N
    calls per graph replay; N of each plotted arm (its own ``graph_layers``, else the
    case's), given per arm where arms differ, as does an arm timed by eager events. ""
    for a run of one call per replay."""
    per_arm: dict[str, set[str]] = defaultdict(set)
    layered = False
    for r in results:
        case_n = r.get("graph_layers", 1)
        case_n = case_n if is_int(case_n) and case_n >= 1 else 1
        for name, arm in r["arms"].items():
            if _value(arm, metric) is None:
                continue
            n = arm.get("graph_layers", case_n)
            n = n if is_int(n) and n >= 1 else case_n
            layered |= n > 1 or case_n > 1
            per_arm[name].add("eager events" if arm.get("gpu_mode") == "events" else str(n))
    if not layered:
        return ""
    kinds = {frozenset(v) for v in per_arm.values()}
    if len(kinds) == 1 and "eager events" not in (alike := next(iter(kinds))):
        return f"; GPU times per call, {_listed(alike)} calls per graph replay"
    return ("; GPU times per call; calls per graph replay by arm: "
            + ", ".join(f"{a} {_listed(v)}" for a, v in sorted(per_arm.items())))


def _listed(ns: Iterable[str]) -> str:
    """``2/3/eager events``: counts in numeric order, then words."""
    return "/".join(sorted(ns, key=lambda t: (not t.isdigit(), int(t) if t.isdigit() else 0)))


METRICS = ("auto", "gpu", "call", "gbps")
#: the largest case field a plot takes (an int32, as the bench's own cases are)
MAX_FIELD = 2**31 - 1
CASE_KEYS = ("batch", "context", "page_size", "num_qo_heads", "num_kv_heads", "head_dim",
             "dtype")


def _results(data: Any) -> list[dict[str, Any]]:
    """``data["results"]`` of a ``bench --json`` file, or a ``ValueError`` saying what is
    missing (a cascade or sparse suite's file has no decode cases to plot)."""
    res = data.get("results") if isinstance(data, dict) else None
    if not isinstance(res, list):
        raise ValueError("not a 'paged-decode bench --json' result (no 'results' list)")
    for i, r in enumerate(res):
        case = r.get("case") if isinstance(r, dict) else None
        if not (isinstance(case, dict)
                and all(is_int(case.get(k)) and 1 <= case[k] <= MAX_FIELD
                        for k in CASE_KEYS[:-1])
                and isinstance(case.get("dtype"), str) and isinstance(case.get("model", ""), str)
                and isinstance(r.get("arms"), dict)
                and all(isinstance(a, dict) for a in r["arms"].values())):
            raise ValueError(f"result {i} is not a decode-suite case with arms (needs "
                             f"case fields {', '.join(CASE_KEYS)}; integers in [1, "
                             f"{MAX_FIELD}])")
    return res


def plot_results(data: dict[str, Any], out: str | Path, *, metric: str = "auto") -> Path:
    """Write the PNG; ``metric`` is ``"gpu"`` (median GPU us, graph replay), ``"call"``
    (median per-call us), ``"gbps"``, or ``"auto"``: ``gpu`` when the run has GPU times,
    else ``call`` (CPU backends time per call only). Returns the path."""
    if metric not in METRICS:
        raise ValueError(f"plot_results: metric must be one of {', '.join(METRICS)}, "
                         f"got {metric!r}")
    results = _results(data)
    if metric == "auto":
        has_gpu = any(_value(a, "gpu") is not None for r in results for a in r["arms"].values())
        metric = "gpu" if has_gpu else "call"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels: dict[tuple[Any, ...], dict[str, list[tuple[int, float]]]] = defaultdict(
        lambda: defaultdict(list))
    for r in results:
        c = r["case"]
        key = (c["batch"], c["page_size"], c.get("model", ""), c["num_qo_heads"],
               c["num_kv_heads"], c["head_dim"], c["dtype"])
        for name, arm in r["arms"].items():
            v = _value(arm, metric)
            if v is not None:
                panels[key][name].append((c["context"], v))
    if not panels:
        why = (" (GPU times exist only for GPU runs: try --metric call)" if metric == "gpu"
               else "")
        raise ValueError(f"plot_results: no verified arm results to plot with metric "
                         f"{metric}{why}")
    keys = sorted(panels)
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.8 * rows), squeeze=False)
    ylabel = {"gpu": "GPU time, us (graph replay)", "call": "per-call time, us",
              "gbps": "GB/s"}[metric]
    for ax, key in zip(axes.flat, keys):
        for name, pts in sorted(panels[key].items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        b, p, model, hq, hkv, d, dt = key
        ax.set_title(f"{model} B{b} ps{p} {hq}/{hkv}x{d} {dt}", fontsize=9)
        ax.set_xscale("log", base=2)
        if metric != "gbps":
            ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    head = data.get("header", {})
    if not isinstance(head, dict):      # a hand-edited file: the title goes without it
        head = {}
    per = _layers_title(results, metric)
    fig.suptitle(f"paged-decode bench: {head.get('device', '?')}, {head.get('date', '')}{per}",
                 fontsize=11)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_file(json_path: str | Path, out: str | Path, *, metric: str = "auto") -> Path:
    """``plot_results`` of a ``bench --json`` file (a ``ValueError`` for anything else)."""
    try:
        data = json.loads(Path(json_path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not a 'paged-decode bench --json' result (not JSON, or nested "
                         f"too deep: {exc})") from exc
    return plot_results(data, out, metric=metric)


__all__ = ["METRICS", "plot_file", "plot_results"]
