"""What #17's "<= 0.95x FlashInfer" asks of the memory system, cell by cell.

For each cell of a `paged-decode bench --json` file (GPU times, L2 flushed before each
call): the bytes a decode must move (K, V, q and out: the bench's ``io_bytes``), the
run's measured read bandwidth (its header's ``read_bandwidth_GBps``), FlashInfer's best
arm and the rate it reached, and the rate a time of 0.95x FlashInfer's would need, as a
fraction of the measured bandwidth. Where that exceeds 100%, no kernel reading every byte
once can meet the target in that cell; the gap left is then FlashInfer's distance from
the bandwidth, not ours.

    python bench/ceiling.py RESULTS.json [...] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import math

FI_ARMS = ("flashinfer", "flashinfer-tc")
OURS = ("v2", "v2tc", "v1")


def gpu_us(arm: dict) -> float:
    """An arm's GPU-time median in us; NaN where it did not run or did not verify."""
    us = arm.get("gpu", {}).get("median_us")
    return float(us) if us and arm.get("verified") else math.nan


def need_fraction(io_bytes: float, fi_us: float, bandwidth_gbps: float) -> float:
    """The fraction of the measured read bandwidth a time of 0.95x ``fi_us`` needs to move
    ``io_bytes``."""
    return io_bytes / (0.95 * fi_us * 1e-6) / 1e9 / bandwidth_gbps


def rows(path: str) -> list[dict]:
    data = json.load(open(path))
    bw = float(data["header"]["read_bandwidth_GBps"])
    out = []
    for r in data["results"]:
        arms = r["arms"]
        fi = {a: gpu_us(arms[a]) for a in FI_ARMS if a in arms}
        ours = {a: gpu_us(arms[a]) for a in OURS if a in arms}
        fi = {a: t for a, t in fi.items() if t == t}
        ours = {a: t for a, t in ours.items() if t == t}
        if not fi or not ours:
            continue
        fa, ft = min(fi.items(), key=lambda x: x[1])
        oa, ot = min(ours.items(), key=lambda x: x[1])
        gb = r["io_bytes"] / 1e9
        out.append({"cell": r["label"], "MB": r["io_bytes"] / 1e6, "bw": bw,
                    "fi_arm": fa, "fi_us": ft, "fi_pct": 100 * gb / (ft * 1e-6) / bw,
                    "ours_arm": oa, "ours_us": ot, "ours_pct": 100 * gb / (ot * 1e-6) / bw,
                    "ratio": ot / ft,
                    "need_pct": 100 * need_fraction(r["io_bytes"], ft, bw)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    all_rows = [x for f in a.files for x in rows(f)]
    head = ("cell", "MB", "FI best us", "FI % of bw", "ours best us", "ours % of bw",
            "ours / FI", "0.95x FI needs % of bw")
    if a.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    for x in all_rows:
        vals = (x["cell"], f"{x['MB']:.0f}", f"{x['fi_us']:.1f} ({x['fi_arm']})",
                f"{x['fi_pct']:.0f}", f"{x['ours_us']:.1f} ({x['ours_arm']})",
                f"{x['ours_pct']:.0f}", f"{x['ratio']:.2f}", f"{x['need_pct']:.0f}")
        print("| " + " | ".join(vals) + " |" if a.markdown else "  ".join(vals))
    over = [x for x in all_rows if x["need_pct"] > 100]
    print(f"\n{len(over)} of {len(all_rows)} cells would need more than the measured "
          f"bandwidth ({all_rows[0]['bw']:.0f} GB/s) for 0.95x FlashInfer's time"
          if all_rows else "no cell with both arms verified")


if __name__ == "__main__":
    main()
