"""The error an fp8 K/V cache adds to decode outputs, against float16 K/V (docs/fp8.md).

CPU only (the reference backend runs the kernels' float32 arithmetic): K and V are drawn
in float32, stored as float16 or quantized to e4m3fn / e5m2 with a per-tensor amax scale
(``scale = amax / max_finite``, the usual calibration), decoded by ``paged_decode.decode``
(path v2) and compared with the float64 oracle of the *unquantized* float32 K/V. Two data
sets: ``random`` (K, V ~ N(0, 1)) and ``outliers`` (K with 4 of 128 channels x20, as the
massive channels of LLM keys; V ~ N(0, 1); queries aligned with the key mean so that the
softmax is peaked). Prints max-rel and rms-rel output errors and the max LSE error.

    python bench/fp8_error.py [--contexts 512 4096] [--batch 4] [--seed 0]
"""

from __future__ import annotations

import argparse
import math

import numpy as np

import paged_decode as pd
from paged_decode import fp8
from paged_decode.problems import make_table
from paged_decode.reference import oracle_decode

HQ, HKV, D, P = 32, 8, 128, 16


def data(kind: str, n_pages: int, b: int, rng: np.random.Generator):
    shape = (n_pages, P, HKV, D)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((b, HQ, D)).astype(np.float32)
    if kind == "outliers":
        ch = rng.choice(D, 4, replace=False)
        k[..., ch] *= 20.0
        k += 0.5                                   # a shared key direction
        q += 2.0 * np.sign(rng.standard_normal(D)).astype(np.float32) * 0.2
    return q.astype(np.float16), k, v


def errors(out, lse, ref, ref_lse):
    o = np.asarray(out, np.float64)
    rel_max = float(np.abs(o - ref).max() / np.abs(ref).max())
    rel_rms = float(np.sqrt(((o - ref) ** 2).mean() / (ref ** 2).mean()))
    return rel_max, rel_rms, float(np.abs(np.asarray(lse) - ref_lse).max())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(f"{'data':9} {'ctx':>5} {'K/V':14} {'max-rel':>9} {'rms-rel':>9} {'lse abs':>9}")
    for kind in ("random", "outliers"):
        for ctx in a.contexts:
            rng = np.random.default_rng(a.seed)
            table, n_pages = make_table([ctx] * a.batch, P, slack=1.0, rng=rng)
            q, k, v = data(kind, n_pages, a.batch, rng)
            ref, ref_lse = oracle_decode(q, k, v, table)
            rows = [("float16", k.astype(np.float16), v.astype(np.float16), {})]
            for fmt in fp8.FP8_DTYPES:
                ks = float(np.abs(k).max()) / fp8.max_finite(fmt)
                vs = float(np.abs(v).max()) / fp8.max_finite(fmt)
                rows.append((fmt, fp8.quantize(k, fmt, ks), fp8.quantize(v, fmt, vs),
                             {"k_scale": ks, "v_scale": vs}))
            for name, kk, vv, kw in rows:
                out, lse = pd.decode(q, kk, vv, table, path="v2", out_dtype="float32",
                                     return_lse=True, backend="reference", **kw)
                e = errors(out, lse, ref, ref_lse)
                print(f"{kind:9} {ctx:5d} {name:14} {e[0]:9.2e} {e[1]:9.2e} {e[2]:9.2e}")
    print(f"(B={a.batch}, {HQ}/{HKV} heads x {D}, page {P}, sm_scale 1/sqrt(D) = "
          f"{1 / math.sqrt(D):.4f}; reference backend, path v2)")


if __name__ == "__main__":
    main()
