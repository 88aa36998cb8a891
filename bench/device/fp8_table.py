"""The fp8 step's side-by-side table: one row per cell, every arm of every pool dtype.

Usage: python3 fp8_table.py OUT.md BENCH.json [BENCH.json ...]
(the ``paged-decode bench --json`` files of one run: float16 pools and fp8 pools of the
same cells). Each column is ``arm pool-dtype`` (median GPU us); a timing counts only when
its arm was verified against the oracle and ran what it stands for, else the cell shows
``-``. The ratios are #14 item 1's targets: ``f16/e4m3`` of v2tc (the target: >= 1.8) and
``v2tc/FI`` (v2tc over FlashInfer's tensor-core decode, both on e4m3fn pools; the
target: <= 0.95).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any


def timings(paths: list[str]) -> tuple[dict[str, dict[str, float]], list[str]]:
    """``{cell label: {"arm dtype": median us}}`` and the columns in first-seen order."""
    cells: dict[str, dict[str, float]] = {}
    cols: list[str] = []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        for r in data["results"]:
            c = r["case"]
            pool = c.get("kv_dtype") or c["dtype"]
            key = (f"B{c['batch']} ctx{c['context']} ps{c['page_size']} "
                   f"{c['num_qo_heads']}/{c['num_kv_heads']}x{c['head_dim']} q {c['dtype']}")
            for arm, a in r["arms"].items():
                col = f"{arm} {pool}"
                if col not in cols:
                    cols.append(col)
                ok = a.get("verified") and (not a.get("expected")
                                            or a.get("ran") in a.get("expected"))
                med = (a.get("gpu") or {}).get("median_us")     # null: not measured
                cells.setdefault(key, {})[col] = med if ok and med is not None else math.nan
    return cells, cols


def ratio(row: dict[str, float], a: str, b: str) -> float:
    x, y = row.get(a, math.nan), row.get(b, math.nan)
    return x / y if y and not (math.isnan(x) or math.isnan(y)) else math.nan


def table(cells: dict[str, dict[str, float]], cols: list[str]) -> str:
    def fmt(x: Any) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"

    def fmt_ratio(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.2f}"
    head = ["cell", *cols, "v2tc f16/e4m3", "v2tc/FI e4m3"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, row in cells.items():
        speed = ratio(row, "v2tc float16", "v2tc float8_e4m3fn")
        vs_fi = ratio(row, "v2tc float8_e4m3fn", "flashinfer-tc float8_e4m3fn")
        lines.append("| " + " | ".join([key, *(fmt(row.get(c)) for c in cols),
                                        fmt_ratio(speed), fmt_ratio(vs_fi)]) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out, paths = argv[0], argv[1:]
    text = ("GPU us (median, L2 flushed), verified arms only; targets: v2tc f16/e4m3 >= "
            "1.8, v2tc/FI e4m3 <= 0.95\n\n" + table(*timings(paths)) + "\n")
    with open(out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
