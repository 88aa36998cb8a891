"""How the plan's chunks shape the GPU time (CUDA): even chunks against the searched size,
and balanced chunk counts per request against the default count (wave quantization).
GPU time under CUDA-graph replay, cold L2, every output checked against the float64
oracle first (``bench.runner.time_arms``).

Usage on the GPU machine: python3 bench/device/tune_chunks.py OUT.json [balance] [waves]
(``TUNE_BACKEND`` another backend, ``TUNE_SMALL=1`` small cells: a dry run on the CPU)

- balance: v2 and v2tc on batches whose default plan changed with balanced chunks
  (``plan.balanced_chunk_size``), each on the balanced plan (the default) and on the plan
  the search left before balancing (one full chunk and a sliver per request);
- waves: v2 and v2tc at 1, 2, 3 and 4 even chunks per request, beside the default plan,
  on batches whose CTA count is a poor multiple of what the SMs hold at once (v2tc holds
  3 CTAs per SM at head_dim 128: 512 CTAs are 1.29 waves of 396; 1 at head_dim 256).
- sweep: v2tc at 1-10, 12 and 16 even chunks per request beside FlashInfer's tensor-core
  decode (when it is laid out) on the `batches` preset's batch 5-24 and three other head
  layouts: which CTA counts the SMs share evenly (the batch 5-20 gap of S21-R4).
- stages: v2tc at ring depths ``TUNE_STAGES`` (default 2 3 4; ``PAGED_DECODE_STAGES``) x
  1-8 even chunks per request, beside FlashInfer's tensor-core decode, where one or two
  CTAs per SM must stream at full rate (batch 20 / 24 x 16K: FlashInfer runs 160 / 192
  CTAs there; S22-R1 timed a lone v2tc CTA per SM at about two thirds of the rate of two).
- clusters: v2tc at 1-8 even chunks per request with ``PAGED_DECODE_CLUSTER_MERGE`` unset
  (the rule), ``1`` and ``0``, beside FlashInfer's tensor-core decode, at the `targets`
  cells #17 misses without needing more than the read bandwidth (``TUNE_CLUSTER_CELLS``,
  ``BATCHxCONTEXT`` at 32/8 x 128): does a merge with no global round trip make more
  chunks pay where the wave rule keeps one or two?
"""

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, "bench")
from plan_balance import unbalanced  # noqa: E402

from paged_decode import plan_decode  # noqa: E402
from paged_decode.backends import get_backend  # noqa: E402
from paged_decode.backends.launching import CLUSTER_MERGE_ENV  # noqa: E402
from paged_decode.bench.cases import BenchCase  # noqa: E402
from paged_decode.bench.runner import TOLERANCE, _problem, time_arms  # noqa: E402

be = get_backend(os.environ.get("TUNE_BACKEND", "cuda"))
SMALL = os.environ.get("TUNE_SMALL") == "1"
t0 = time.time()
rows = []


def plan_for(case, table, arm_name, pages_per_chunk=None):
    """The arm's plan (searched for its CTAs per chunk, or ``pages_per_chunk``)."""
    return plan_decode(table, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                       backend=be, path=arm_name, pages_per_chunk=pages_per_chunk)


#: extra fields of every row measure() writes (the stages part's ring depth)
TAG: dict = {}


def measure(part, case, prob, arm_name, plan_name, plan):
    """Time ``arm_name`` on ``prob`` (q, k, v, table) with ``plan``; one row."""
    r = time_arms(be, (arm_name,), *prob, plan, 1 / np.sqrt(case.head_dim),
                  case.io_bytes(), TOLERANCE["float16"], warmup=3, reps=15,
                  cold_l2=True)[arm_name]
    us = (r.gpu or r.call).get("median_us") or float("nan")
    rows.append({"part": part, "cell": case.label, "batch": case.batch,
                 "context": case.context, "heads": f"{case.num_qo_heads}/{case.num_kv_heads}",
                 "arm": arm_name, "ran": r.ran, "plan": plan_name, "ctas": plan.num_ctas,
                 "chunks": plan.num_chunks, "pages_per_chunk": plan.pages_per_chunk,
                 "gpu_us": us, "gbps": r.gbps, "verified": r.verified,
                 "err": r.max_rel_error, **TAG})
    print(f"{case.label:40s} {arm_name:5s} {plan_name:9s} {plan.num_ctas:5d} CTAs chunk <= "
          f"{plan.pages_per_chunk * case.page_size:6d} tok {us:9.1f} us {r.gbps:7.0f} GB/s "
          f"{'ok' if r.verified else 'FAIL ' + r.note} t={time.time() - t0:.0f}s", flush=True)
    json.dump(rows, open(sys.argv[1], "w"), indent=1)    # each row kept if the run is cut


def cases(cells):
    """BenchCases of ``((Hq, Hkv[, head_dim]), batch, context)`` cells (head_dim 128
    unless given)."""
    for heads, b, ctx in cells:
        hq, hkv, d = (*heads, 128)[:3]
        yield BenchCase(b, 700 if SMALL else ctx, 16, hq, hkv, d, model=f"{hq}/{hkv}x{d}")


parts = set(sys.argv[2:]) or {"balance", "waves"}


def flashinfer_row(part, case, prob, plan):
    """FlashInfer's tensor-core decode on ``prob`` (its own plan), one row."""
    r = time_arms(be, ("flashinfer-tc",), *prob, plan, 1 / np.sqrt(case.head_dim),
                  case.io_bytes(), TOLERANCE["float16"], warmup=3, reps=15,
                  cold_l2=True)["flashinfer-tc"]
    us = (r.gpu or r.call).get("median_us") or float("nan")
    rows.append({"part": part, "cell": case.label, "batch": case.batch,
                 "context": case.context, "heads": f"{case.num_qo_heads}/{case.num_kv_heads}",
                 "arm": "flashinfer-tc", "ran": r.ran, "plan": "its own", "gpu_us": us,
                 "gbps": r.gbps, "verified": r.verified, "err": r.max_rel_error,
                 "note": r.note})
    print(f"{case.label:40s} flashinfer-tc {us:9.1f} us {r.verified} {r.note}", flush=True)


if "clusters" in parts:
    cells = os.environ.get("TUNE_CLUSTER_CELLS", "64x1024 8x8192 4x16384 4x32768 8x1024 "
                           "128x1024 32x1024").split()
    for case in cases([((32, 8), int(c.split("x")[0]), int(c.split("x")[1])) for c in cells]):
        prob = _problem(be, case, 0)
        pages = int(prob[3].pages_per_request.max())
        flashinfer_row("clusters", case, prob, plan_for(case, prob[3], "v2tc"))
        for setting in ("rule", "1", "0"):
            if setting == "rule":
                os.environ.pop(CLUSTER_MERGE_ENV, None)
            else:
                os.environ[CLUSTER_MERGE_ENV] = setting    # read per call
            TAG["cluster_merge"] = setting
            measure("clusters", case, prob, "v2tc", "default", plan_for(case, prob[3], "v2tc"))
            for n in (1, 2, 3, 4, 6, 8):
                if n <= pages:
                    measure("clusters", case, prob, "v2tc", f"{n} chunks",
                            plan_for(case, prob[3], "v2tc", -(-pages // n)))
        os.environ.pop(CLUSTER_MERGE_ENV, None)
        TAG.clear()
        del prob
if "stages" in parts:
    for case in cases([((32, 8), 20, 16384), ((32, 8), 24, 16384), ((32, 8), 12, 16384),
                       ((32, 8), 20, 4096), ((32, 8), 96, 4096)]):
        prob = _problem(be, case, 0)
        pages = int(prob[3].pages_per_request.max())
        flashinfer_row("stages", case, prob, plan_for(case, prob[3], "v2tc"))
        for depth in os.environ.get("TUNE_STAGES", "2 3 4").split():
            os.environ["PAGED_DECODE_STAGES"] = depth      # read per call (settings.snapshot)
            TAG["stages"] = int(depth)
            measure("stages", case, prob, "v2tc", "default", plan_for(case, prob[3], "v2tc"))
            for n in (1, 2, 3, 4, 6, 8):
                measure("stages", case, prob, "v2tc", f"{n} chunks",
                        plan_for(case, prob[3], "v2tc", -(-pages // n)))
        os.environ.pop("PAGED_DECODE_STAGES", None)
        TAG.clear()
        del prob
if "sweep" in parts:
    # the batches preset's batch 5-24 first (S21-R4: 7-15% behind FlashInfer at 5-20), then
    # Qwen2-7B, GQA 16 and head_dim 256 (1 resident v2tc CTA per SM)
    for case in cases([((32, 8), 12, 16384), ((32, 8), 5, 16384), ((32, 8), 20, 16384),
                       ((32, 8), 12, 4096), ((32, 8), 5, 4096), ((32, 8), 20, 4096),
                       ((32, 8), 24, 16384), ((32, 8), 24, 4096), ((28, 4), 12, 16384),
                       ((32, 2), 20, 8192), ((16, 8, 256), 12, 8192)]):
        prob = _problem(be, case, 0)
        pages = int(prob[3].pages_per_request.max())
        default = plan_for(case, prob[3], "v2tc")
        flashinfer_row("sweep", case, prob, default)
        measure("sweep", case, prob, "v2tc", "default", default)
        for n in (*range(1, 11), 12, 16):
            measure("sweep", case, prob, "v2tc", f"{n} chunks",
                    plan_for(case, prob[3], "v2tc", -(-pages // n)))
        del prob
if "balance" in parts:
    # Llama-3-8B heads at batch 5 / 12 / 20 (the longest chunk 1.09x / 1.41x / 1.88x shorter
    # at 16K, bench/plan_balance.py), Qwen2-7B at batch 40 and GQA 16 at batch 70 (v2tc)
    for case in cases([((32, 8), 5, 16384), ((32, 8), 12, 16384), ((32, 8), 20, 16384),
                       ((32, 8), 20, 4096), ((28, 4), 40, 16384), ((32, 2), 70, 8192)]):
        prob = _problem(be, case, 0)
        for arm_name in ("v2", "v2tc"):
            measure("balance", case, prob, arm_name, "balanced",
                    plan_for(case, prob[3], arm_name))
            with unbalanced():
                searched = plan_for(case, prob[3], arm_name)
            measure("balance", case, prob, arm_name, "searched", searched)
        del prob
if "waves" in parts:
    # batch 24: the target rule keeps one chunk per request (192 CTAs): two even chunks?
    # Gemma-2 heads (head_dim 256): v2tc holds 1 CTA per SM, so 272 CTAs are 2.06 waves
    for case in cases([((32, 8), 64, 4096), ((32, 8), 64, 16384), ((32, 8), 32, 16384),
                       ((32, 8), 24, 16384), ((32, 8), 128, 4096), ((28, 4), 128, 8192),
                       ((28, 4), 64, 8192), ((16, 8, 256), 17, 8192)]):
        prob = _problem(be, case, 0)
        pages = int(prob[3].pages_per_request.max())
        for arm_name in ("v2", "v2tc"):
            measure("waves", case, prob, arm_name, "default", plan_for(case, prob[3], arm_name))
            for n in (1, 2, 3, 4):
                measure("waves", case, prob, arm_name, f"{n} chunks",
                        plan_for(case, prob[3], arm_name, -(-pages // n)))
        del prob
