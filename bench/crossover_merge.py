"""Fold saved bench results into a crossover table: the cells they time replace the
table's cells of the same geometry, the others are added (``crossover.merged``).

Usage: python bench/crossover_merge.py TABLE.json OUT.json SOURCE BENCH.json [BENCH.json ...]

``SOURCE`` names the device run and its report (e.g. "S22-R5, docs/benchmarks/..."); every
new cell carries it. Only arms among ``crossover.PATHS`` that were verified and ran what
they stand for count (``crossover.from_results``): a bench JSON of ``paged-decode bench
--json`` from one device run, with our arms side by side.
"""

import json
import sys
from pathlib import Path

from paged_decode.bench.runner import BenchResult
from paged_decode.crossover import from_results, merged


def main(argv: list[str]) -> None:
    if len(argv) < 4:
        raise SystemExit(__doc__)
    table, out, source, *benches = argv
    old = json.loads(Path(table).read_text())
    results = [BenchResult.from_dict(r) for b in benches
               for r in json.loads(Path(b).read_text())["results"]]
    new = from_results(results, old.get("device", "?"))
    Path(out).write_text(json.dumps(merged(old, new, source), indent=1) + "\n")
    print(f"{len(new['cells'])} cells from {len(benches)} file(s) into {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
