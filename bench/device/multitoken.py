"""Multi-token decode (#14 item 4) against one token per request, on the CUDA backend.

At each cell (batch x context, Llama-3-8B heads 32/8 x 128, page 16, float16) and for
each path (v2, v2tc): a prepared one-token decode (``q [B, Hq, D]``) and prepared
multi-token decodes (``q [B, T, Hq, D]``, T = 2, 4, 8; the table holds the new tokens, as
in speculative verification). Each arm is first checked against the float64 oracle
(a failing arm is reported and not timed), then timed between CUDA events with a cold L2
(``bench.timing.cuda_event_times``), and its host time per call is measured too (the
multi-token call is eager: the fold and the merge are array ops and launches on the
stream). Prints the T / 1 ratios (#14 target: T = 4 at 32 x 4K within 1.3x) and writes
JSON.

    python3 bench/device/multitoken.py OUT.json [--cell 32x4096] [--reps 15]
"""

from __future__ import annotations

import argparse
import json

import cupy as cp
import numpy as np

import paged_decode as pd
from paged_decode.bench.timing import cuda_event_times, host_times, stats
from paged_decode.problems import ProblemSpec, make_problem
from paged_decode.reference import lse_error, max_rel_error, oracle_decode
from paged_decode.specs import v2tc_ctas_per_chunk

HQ, HKV, D, P = 32, 8, 128, 16
TOL = {"v2": 2e-3, "v2tc": 2e-3}       # tests/helpers.py: OUT_RTOL / PREFIX_RTOL float16
LSE_ATOL = 5e-5


def _arm(be, pr, q_host, tokens: int, path: str):
    """A prepared call (and its check against the oracle) for ``tokens`` per request."""
    b = pr.table.batch_size
    q = cp.asarray(q_host if tokens == 1 else q_host.reshape(b, tokens, HQ, D))
    k, v = cp.asarray(pr.k_pages), cp.asarray(pr.v_pages)
    plan = pd.plan_decode(pr.table, HQ, HKV, D, device=be.device_info(),
                          query_tokens=tokens,
                          ctas_per_chunk=(v2tc_ctas_per_chunk(HQ * tokens, HKV)
                                          if path == "v2tc" else None))
    prep = pd.prepare_decode(q, k, v, pr.table, plan, path=path, return_lse=True,
                             out_dtype="float32", backend=be)
    out, lse = prep()
    ref, ref_lse = oracle_decode(q_host, pr.k_pages, pr.v_pages, pr.table,
                                 qo_indptr=np.arange(b + 1) * tokens)
    got = cp.asnumpy(out).reshape(ref.shape)
    err = max_rel_error(got, ref)
    lerr = lse_error(cp.asnumpy(lse).reshape(ref_lse.shape), ref_lse)
    ok = err <= TOL[path] and lerr <= LSE_ATOL
    return prep, {"max_rel": err, "lse_abs": lerr, "verified": ok,
                  "outcome": str(pd.last_outcome())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--cell", action="append", default=[])
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    be = pd.get_backend("cuda")
    rows = []
    for cell in a.cell or ["32x4096"]:
        b, ctx = (int(x) for x in cell.split("x"))
        pr = make_problem(ProblemSpec(b, ctx, HQ, HKV, D, P, "float16", "float16", seed=0,
                                      jitter=False))
        rng = np.random.default_rng(1)
        for path in ("v2", "v2tc"):
            base = None
            for tokens in (1, 2, 4, 8):
                if path == "v2tc" and tokens * HQ // HKV > 32:
                    continue             # more rows than the kernel's two 16-row tiles
                q_host = (rng.standard_normal((b * tokens, HQ, D)) * 1.5).astype(np.float16)
                row = {"batch": b, "context": ctx, "path": path, "tokens": tokens}
                try:
                    prep, check = _arm(be, pr, q_host, tokens, path)
                except Exception as exc:     # report the arm, go on with the others
                    rows.append({**row, "error": f"{type(exc).__name__}: {exc}"})
                    print(rows[-1])
                    continue
                row.update(check)
                if check["verified"]:
                    row["gpu"] = stats(cuda_event_times(prep, warmup=3, reps=a.reps))
                    row["host"] = stats(host_times(
                        prep, warmup=3, reps=a.reps,
                        sync=lambda: cp.cuda.get_current_stream().synchronize()))
                    if tokens == 1:
                        base = row["gpu"]["median_us"]
                    elif base:
                        row["ratio_to_one_token"] = row["gpu"]["median_us"] / base
                rows.append(row)
                print(f"{cell} {path} T={tokens}: verified={check['verified']} "
                      f"err={check['max_rel']:.2e} gpu={row.get('gpu', {}).get('median_us')}"
                      f" us ratio={row.get('ratio_to_one_token')} "
                      f"host={row.get('host', {}).get('median_us')} us")
    with open(a.out, "w") as f:
        json.dump({"target": "T=4 at 32x4096 <= 1.3x T=1 (#14)", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
