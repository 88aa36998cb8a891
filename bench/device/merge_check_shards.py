"""Merge the JSON reports of ``paged-decode check --shard k/n`` runs into one report.

Usage: python3 merge_check_shards.py OUT.json SHARD.json [SHARD.json ...]
Prints the pass count, the worst errors and the failures.
"""

import json
import math
import sys

out, shards = sys.argv[1], sys.argv[2:]
reports = [json.load(open(p)) for p in shards]
merged = dict(reports[0])
merged["results"] = [r for rep in reports for r in rep["results"]]
merged["passed"] = all(rep["passed"] for rep in reports)
merged["num_failures"] = sum(rep["num_failures"] for rep in reports)
merged["shards"] = len(reports)
merged.pop("timings", None)
res = merged["results"]
json.dump(merged, open(out, "w"), indent=1)


def _err(x):
    return math.inf if x is None or x != x else x    # null / NaN (json_text): the worst


worst = max(res, key=lambda r: _err(r["max_rel_error"]))
worst_lse = max(res, key=lambda r: _err(r["lse_error"]))
print(f"{out}: {sum(r['passed'] for r in res)}/{len(res)} passed; worst max-rel "
      f"{_err(worst['max_rel_error']):.3g}; worst LSE {_err(worst_lse['lse_error']):.3g}; "
      f"configs {len({json.dumps(r['config'], sort_keys=True) for r in res})}")
for r in res:
    if not r["passed"]:
        print("FAIL", r)
