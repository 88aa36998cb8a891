"""A PNG of a decode benchmark: time (or GB/s) against context, one line per arm, one
panel per (batch, page size, geometry, dtype). Needs matplotlib (``pip install
'paged-decode[plot]'``); reads the JSON that ``paged-decode bench --json`` writes."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any


def _value(arm: dict[str, Any], metric: str) -> float | None:
    if not arm.get("verified") or arm.get("ran") == "unavailable":
        return None
    if metric == "gbps":
        return float(arm["gbps"]) or None
    key = "gpu" if metric == "gpu" else "call"
    med = arm.get(key, {}).get("median_us")
    return float(med) if med else None


def plot_results(data: dict[str, Any], out: str | Path, *, metric: str = "gpu") -> Path:
    """Write the PNG; ``metric`` is ``"gpu"`` (median GPU us, graph replay), ``"call"``
    (median per-call us) or ``"gbps"``. Returns the path."""
    if metric not in ("gpu", "call", "gbps"):
        raise ValueError(f"plot_results: metric must be gpu, call or gbps, got {metric!r}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels: dict[tuple[Any, ...], dict[str, list[tuple[int, float]]]] = defaultdict(
        lambda: defaultdict(list))
    for r in data["results"]:
        c = r["case"]
        key = (c["batch"], c["page_size"], c.get("model", ""), c["num_qo_heads"],
               c["num_kv_heads"], c["head_dim"], c["dtype"])
        for name, arm in r["arms"].items():
            v = _value(arm, metric)
            if v is not None:
                panels[key][name].append((c["context"], v))
    if not panels:
        raise ValueError("plot_results: no verified arm results to plot")
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
    fig.suptitle(f"paged-decode bench: {head.get('device', '?')}, {head.get('date', '')}",
                 fontsize=11)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_file(json_path: str | Path, out: str | Path, *, metric: str = "gpu") -> Path:
    return plot_results(json.loads(Path(json_path).read_text()), out, metric=metric)


__all__ = ["plot_file", "plot_results"]
