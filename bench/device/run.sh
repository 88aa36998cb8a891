#!/usr/bin/env bash
# One parametrized runner for a device run: bench/device/run.sh STEP [STEP ...]
# (the per-run scripts of past device runs are folded into these steps; docs/benchmarks
# says which steps reproduce each report).
#
# Steps log under a scratch folder; after every step, everything the steps wrote (logs,
# bench tables, JSON) is packed into $OUT/results.tgz, so $OUT holds few files (the device
# returns at most 8) and a run cut short keeps every finished step:
#   info        `paged-decode info` into $OUT/info.txt
#   fi          FlashInfer 0.3.1 laid out offline from .carry (carry it), no smoke test
#   fi06        FlashInfer 0.6 (its XQA decode) laid out from .carry/flashinfer06 and put
#               first on PYTHONPATH for the later steps, with its smoke test
#   xqa         v2 / v2tc beside FlashInfer 0.6's XQA decode (run fi06 first)
#   gpu-tests   every test marked gpu (run fi first for the FlashInfer arm's test), -rs
#   check-full  `paged-decode check --full` in float16, bfloat16, float32 (5 shards each,
#               all at once), merged per dtype
#   memcheck    compute-sanitizer memcheck over a representative GPU subset (MEMCHECK_K)
#   racecheck   compute-sanitizer racecheck over the prefix-kernel GPU tests
#   regs        registers / local memory of the prefix, merge and v2tc kernels (at PREFIX_TILE)
#   targets     bench --preset targets with v1, v2, sdpa, flashinfer, flashinfer-tc
#   adr         bench --preset adr with gather, v1, v2 (+ csv, and the crossover table
#               path='auto' reads, written to $OUT/<device slug>.json)
#   crossover   bench --preset crossover with v1, v2, v2tc: the table path='auto' reads, written
#               to $OUT/<device slug>.json (ship it as paged_decode/data/crossover/ of that name)
#   ragged      bench --preset ragged (#17's 16 x 1K-8K and 128 x 512-4K) with BENCH_ARMS
#   variants    bench --preset variants with v2 and sdpa (bf16, head_dim, GQA, page size)
#   decode-variants  issue #14 items 2-3, side by side with FlashInfer (run fi first):
#               plain 32K, W=4095 over 32K and plain 4K (target: window within 1.1x of 4K);
#               soft cap 30 and sinks at 4K and 32K (targets: within 3% of plain);
#               batch 1/8/32/128, page 16, Llama-3-8B heads, float16; v2 and v2tc (the
#               tensor-core partial) each with every variant beside its plain time; fits
#               one 600 s command with fi (the five runs' limits add up to 400 s)
#   models      bench --preset models with v2, sdpa, flashinfer, flashinfer-tc (run fi first;
#               MODELS_LIST "phi3-mini gqa16": those layouts only, one bench each)
#   cascade     bench --suite cascade (CASCADE_MODEL: a models-preset layout's heads)
#   cascade-rule  bench --suite cascade-rule (short prefixes: where cascade starts to pay)
#   forks       bench --suite forks: flat decode over pages every request shares, v2 /
#               v2tc / FlashInfer beside cascade (run fi first; FORKS_KV: fp8 pools;
#               FORKS_MODEL: a models-preset layout's heads)
#   forks-stages  the forks suite at the CUDA kernels' ring depths FORKS_STAGES (2 3; run fi
#               first)
#   tune-forks  bench/device/tune_forks.py: v2 and v2tc over shared and private pages at plan
#               CTA targets 264-2112 (v2tc also at 8 warps)
#   chunks      bench/device/tune_chunks.py: v2 / v2tc on balanced chunks against the
#               searched size (one full chunk and a sliver) where balancing changed the plan,
#               and at 1-4 even chunks per request against the default (wave quantization);
#               TUNE_CHUNKS_PARTS (balance, waves; also sweep, stages, clusters)
#   batches     bench --preset batches (batch 5-96, 4K / 16K) with v2, v2tc and both
#               FlashInfer arms (run fi first)
#   waves-ab    the tensor-core partial's wave rule (paged_decode/waves.py) beside the CTA-target
#               rule: WAVES_PRESETS (batches targets) with BENCH_ARMS, then v2tc alone with
#               PAGED_DECODE_WAVE_PLAN=0 (run fi first)
#   sparse      bench --suite sparse
#   prefix-tile-ab  the cascade suite at prefix tile 64/32 x resident CTAs per SM 2/3/4,
#               with each tile's register use
#   tune-v2     bench/device/tune_v2.py: the v2 row-loads x CTA-target sweep
#   ncu-v2      an ncu profile of the v2 partial at 64 x 4K, one and two row loads
#   append-host host time of one PagePool.append_batch, 128 sequences x 1 token x 32 layers
#   engine      the step-table / engine-step GPU tests, then bench --suite engine (arms
#               ENGINE_ARMS, default eager, captured, flashinfer; batch 8/64/128, 32 layers;
#               ENGINE_ARGS more bench options, e.g. --context 4096 --batch 64;
#               ENGINE_KV pool formats, one bench each: 16bit (the default, engine.json) and
#               fp8 formats (float8_e4m3fn, float8_e5m2: --kv-dtype, per-layer calibrated
#               scales, engine_FORMAT.json), e.g. ENGINE_KV="16bit float8_e4m3fn"; run fi
#               first) + its plot
#   begin-host  bench/begin_host.py on the GPU machine's CPU (no GPU work): the steady and
#               general begin's bookkeeping, to set its host beside this repository's CPU
#   engine-models  bench --suite engine --model M (ENGINE_MODELS, default qwen2-7b) at batch
#               64 / 128: captured on v2 and on v2tc against FlashInfer (run fi first)
#   fi-compat   tests/test_fi_gpu.py: the FlashInfer shim side by side with FlashInfer 0.3.1
#               over its decode-test geometries, graph replay after a re-plan, merges,
#               append and fp8 caches with run's scales (run fi first; -v prints the worst
#               gaps; FI_COMPAT_K a -k expression), log in $OUT/fi_compat.log
#   generate    transformers integration (the machine's transformers, 5.17 when written):
#               its gpu tests (cuda backend, torch CUDA tensors, float32 token equality),
#               then examples/generate_transformers.py at Llama-3-8B heads x 16 layers,
#               float16, batch 32, 1K-token prompts (512 shared), 64 new tokens, against
#               transformers' dynamic and static caches -> $OUT/generate_*.json;
#               GENERATE_TEST_K narrows the tests, GENERATE_NOISE=1 adds
#               bench/device/generate_noise.py (the float32 logit floor of a batch layout)
#   kernel-times  each kernel of one call alone under ncu (KT_CELLS x KT_ARMS): where a
#               batch-1 call's GPU time goes, kernel by kernel, beside FlashInfer's
#   tc-batch1   v2tc at batch 1 with 3 ring stages and with 3 CTAs per SM, beside the default
#   prefetch    the L2 prefetch hint of the cp.async copies at 0 / 128 / 256 bytes: GPU tests,
#               v2 / v2tc over large-batch targets cells, GQA 7 / 8 and the forks suite
#   small-cells  v2tc at batch 1 / 8 x 1K / 8K, GQA 7 / 8 / 16, as shipped, with its merge
#               fused, and with the merge as a dependent launch (PDL); FlashInfer beside
#   setting-ab  one PAGED_DECODE_* setting's values alternated in one run (SETTING,
#               SETTING_VALUES, SETTING_BENCHES, SETTING_ROUNDS, SETTING_ENGINE)
#   row-prefetch  the L2 prefetch hint's row rule (PAGED_DECODE_L2_PREFETCH=rows) against 128
#               bytes: head_dim 96 (Phi-3-mini) beside SDPA, and fp8 over the variants preset
#   unsplit-merge  v2 / v2tc at Llama-3-70B TP8 batch 1 x 8K / 32K, the merge split by its
#               rule and forced unsplit
#   ncu-bw      ncu of v2 / v2tc / FlashInfer tc (BW_ARMS; sdpa too) at bandwidth-bound cells
#               (BW_CELLS "B CTX HQ HKV [D];..."; DRAM bytes, occupancy limits, stalls), then
#               v2tc 3 stages and a 528-CTA target (BW_BENCH=0: not)
#   v2-target   v2 over the targets preset at plan CTA targets 264 / 528 (V2_TARGETS)
#   ncu-mem     ncu memory tables (requests, sectors, hit rates per operation) of v2tc and
#               FlashInfer's tensor-core kernel (MEM_ARMS, MEM_CELL; KT_SHARED=N: the cell's
#               first N tokens one prefix all requests share, as the forks suite's, here
#               and in ncu-source)
#   ncu-fp8     ncu of v2tc over e4m3fn and float16 pools at 8 x 8K (FP8_NCU_DTYPES,
#               FP8_NCU_CELL): pipe utilization, warp states, memory, per-instruction samples
#   timeline    bench/device/timeline.py: per-CTA stamps of one v2tc launch per cell
#               (TIMELINE_CELLS, BxCTX[:KV_DTYPE]): prologue, streaming, epilogue, ramp, tail;
#               TIMELINE_BASE=DIR: the same cells on a carried paged_decode after them;
#               TIMELINE_SETTINGS="NAME=VALUE ...": one timeline under each setting instead
#   ncu-source  per-instruction stall samples of v2tc and FlashInfer's tensor-core kernel
#               (ncu source counters, the SASS source page as CSV)
#   tc-target   v2tc at plan CTA targets 396 / 792 beside the default (TC_TARGETS)
#   merge-split the split merge: GPU tests, memcheck / racecheck, models and targets
#               (batch 1-8) cells with its rule and with PAGED_DECODE_MERGE_SPLIT=1
#   pdl         the merge as a programmatic dependent launch: a stream probe, its GPU tests with
#               PAGED_DECODE_PDL=1, v2 / v2tc at batch 1-8 with it off and on (PDL_ARMS)
#   fused       v2tc's fused merge: its GPU tests, memcheck / racecheck (FUSED_SANITIZE_K), batch
#               1-8 with it on / off (FUSED_BENCH=0: no bench)
#   pdl-probe   bench/device/pdl_probe.py alone: which streams take a dependent launch
#   fused-models  the fused merge on / off at GQA 16 / 8 / 7 (FUSED_MODELS; FlashInfer's tensor
#               cores beside it unless FUSED_MODEL_ARMS=v2tc: run fi first), and over e4m3fn
#               pools at GQA 16 (FUSED_FP8=0: not)
#   tests       the GPU tests of TESTS (files; default fp8, engine step, transformers), TESTS_K
#   l2          the bench's two cold-L2 flushes (--l2-flush clean / dirty) side by side over
#               float16 and e4m3fn pools at 8/32/128 x 8K/32K (L2_ARMS, L2_FLUSHES,
#               L2_BATCHES, L2_TIMEOUT; L2_LAYERS="1 8": each flush once per --graph-layers
#               count, outputs of N > 1 named l2_FLUSH_LN_*)
#   fp8-fixed   v2tc at 8 x 8K over e4m3fn under the switches of a call's fixed part
#   floor       bench/device/floor.py: the timer's floor and the best float16 / fp8 ratio of
#               plain reads at FLOOR_CELLS (default 8x8192 32x8192), v2tc beside them and a
#               paged read of v2tc's chunks (its pools and plan, no math, no merge)
#   smem-base   bench/device/smem_base.py: the dynamic shared-memory base modulo 128 bytes at a
#               few static sizes
#   fp8-quick   v2tc over float16 and e4m3fn pools at 8/32/128 x 8K/32K (FP8_QUICK_ARMS;
#               FP8_QUICK_E5M2=1: e5m2 pools too)
#   verdict     #17's and #14's targets judged from every bench JSON the earlier steps of
#               this run wrote (bench/issue_targets.py), into $OUT/verdict.md; name it last,
#               and not after an A/B step (its base package's tables would join)
#   fp8-ab      this tree's v2tc against a carried earlier paged_decode (FP8_AB_BASE) in one
#               run: float16 / e4m3fn at 8/32/128 x 8K/32K (FP8_AB_STAGES), the targets preset
#   ab          this tree against a carried paged_decode (AB_BASE, default .carry/base) on
#               the same cells, alternated AB_ROUNDS times (AB_ARGS, AB_KV, AB_ARMS; AB_MODELS
#               adds models-preset layouts at AB_MODEL_ARGS)
#   fp8-stages  v2tc over fp8 pools at ring depths 2/3/4 and 4 or 8 warps, float16 beside
#   fp8-residency  the fp8 v2tc path at plan CTA targets 264-1056 x ring depths 2 / 3
#               (FRES_TARGETS, FRES_STAGES, FRES_WARPS (4): other lists)
#   v2tc-race   racecheck (synccheck too with V2TC_SYNC=1) over a v2tc subset (RACE_TIMEOUT;
#               V2TC_RACE_K: its -k)
#   decode-graph-debug  bench/device/debug_decode_graph.py: a CUDA-graph decode step against
#               the eager one (per-step logits, positions, layer-0 K rows, launch streams)
#   generate-profile  bench/device/profile_generate.py: prefill / decode-step split, cProfile
#               and torch profiler tables of generation through paged-decode and transformers
#   v2tc        the tensor-core v2 partial (#17) against v2 and FlashInfer (run fi first) over
#               #17's target cells: the targets preset (cold and warm L2), every models
#               layout at 8 x 8K and 32 x 2K, and bfloat16 at 8 x 8K
#   v2tc-targets / v2tc-models  the two halves of v2tc (v2tc-targets: the ragged preset too)
#   tune-tc     bench/device/tune_tc.py: v2tc CTA target x ring depth on GQA 4/7/8/16 cells,
#               and the plan's ragged_split on ragged batches (v2, v2tc); TUNE_TC_PARTS
#   tune-cells  bench/device/tune_cells.py: v2tc / v2 chunkings x ring depths on named models
#               cells (TUNE_CELLS "gqa16:8x8192 ..."), SDPA beside; TUNE_STAGES / SPLITS / ARMS
#   engine-profile  bench/device/profile_engine.py: host parts of begin / replay (the one
#               upload per begin, the table update inside the graph: device calls counted
#               per begin / replay), a cProfile of the captured loop and each call's GPU
#               time (the table update's too) at batch 8/64/128
#   v2tc-sanitize  compute-sanitizer memcheck, racecheck and synccheck (V2TC_TOOLS) over the
#               v2tc GPU tests (-k v2tc over the CUDA and graph-capture modules; each tool
#               gets V2TC_SAN_TIMEOUT, 300 s). V2TC_SAN_SET=variants takes -k "v2tc or tc"
#               over TC_VARIANT_FILES instead: 100 of the 142 GPU tests of the fp8, PDL,
#               variants, multi-token and engine-step modules, the 70 whose ids name v2tc and
#               30 v2 / auto ones whose names hold "tc" ("match") (S40-R4 / R5 on an H100:
#               memcheck 69 s, racecheck about 430 s); V2TC_SAN_SET=cluster takes the
#               cluster merge's module, tests/test_cluster_merge_gpu.py (20 tests; under
#               racecheck it needs far more than 560 s: S47-R2 ran 4). V2TC_SAN_K: -k instead
#   ncu-stalls  warp stall reasons (per issued instruction) of v2tc and v2 at 8 x 8K, 32/2 and 32/8
#   ncu-v2tc    ncu profiles of the v2tc and v2 partials at 8 x 8K, GQA 4 (32/8) and 16 (32/2)
#   multitoken  issue #14 item 4: the multi-token GPU tests, then bench/device/multitoken.py:
#               T = 1, 2, 4, 8 query tokens per request on v2 and v2tc (prepared, each
#               verified against the oracle first) at 32 x 4K (the target: T = 4 within
#               1.3x of T = 1) and 8 x 8K, Llama-3-8B heads, float16 -> $OUT/multitoken.json
#   tc-speed    session 10's v2tc (token-row copies, skipped rescale): the GPU tests of the
#               kernel files, then v2 / v2tc / FlashInfer tensor cores over the targets
#               preset, the models layouts (8 x 8K, 32 x 2K) and e4m3fn pools (run fi first)
#   tc-models   the rest of tc-speed: the GPU tests it left, each models layout in a bench
#               of its own (TC_MODELS, TC_MODELS_ARMS), the forks suite (run fi first)
#   tc-depth    phi3-mini on our arms, then FlashInfer tensor cores alone; v2tc ring depth
#               2 / 3 / 4 at 8 / 32 x 8K / 32K and Llama-3-70B TP8; ncu of v2tc at 8 x 8K
#   tc-quick    session 7's short run: GPU tests of fp8, variants, the step and multi-token,
#               then v2tc against FlashInfer tensor cores at two cells each for fp8 (8 / 32
#               x 8K), soft cap, sinks and window (batch 8, 4K / 32K), then memcheck over
#               the v2tc GPU tests (run fi first)
#   softcap-quick  the soft cap's GPU tests and v2 / v2tc with and without a cap of 30 at
#               batch 8 x 4K / 32K (session 7)
#   fp8         issue #14 item 1 (run fi first): the fp8 GPU tests (tests/test_fp8_gpu.py: the
#               sm_90 cvt widens over all 256 codes, decode (v2tc too) and append on CuPy
#               bytes and torch fp8 tensors), then float16 pools against float8_e4m3fn pools
#               (and e5m2, v2 and v2tc) at 32/8 x 128, float16 queries, batch 8/32/128 x
#               8K/32K (float16 K/V of 256 MB to 8 GB; target: fp8 >= 1.8x faster than
#               float16 in GPU time): our v2 and v2tc beside FlashInfer's tensor-core decode
#               on the same pools (target: <= 0.95x FlashInfer's fp8 time), joined into one
#               side-by-side table ($OUT/fp8_table.md, bench/device/fp8_table.py), and the
#               v2 and v2tc partials' registers with float16 and fp8 pools ($OUT/fp8_regs.txt).
#               The benches get 180, 180 and 100 s (BENCH_TIMEOUT) to keep the step within
#               one 600 s device command: run fi in a command before it
# Knobs: GPU_TEST_K (a -k expression for gpu-tests), MEMCHECK_K (the memcheck subset),
# NCU_KV_DTYPE / NCU_BATCH (the ncu steps over fp8 pools / another batch than 8),
# BENCH_REPS (15), BENCH_TIMEOUT (260), BENCH_ARMS (the arms of targets/adr/variants/models),
# BENCH_L2 (run_bench's --l2-flush), BENCH_LAYERS (run_bench's --graph-layers N: N calls,
# each over its own copy of the pools, per graph replay, times per call; decode-suite
# steps only: the other suites refuse it; default 1).
source bench/device/setup.sh
set -o pipefail
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
L=$(mktemp -d)
GPU_FILES="tests/test_cuda_gpu.py tests/test_cuda_graphs.py tests/test_nan_semantics.py tests/test_append_gpu.py tests/test_engine_step_gpu.py tests/test_variants_gpu.py tests/test_multitoken_gpu.py"
# the GPU test files of the decode kernels (tc-speed, tc-models)
TC_GPU_FILES="tests/test_cuda_gpu.py tests/test_cuda_graphs.py tests/test_fp8_gpu.py tests/test_variants_gpu.py tests/test_multitoken_gpu.py tests/test_nan_semantics.py"
# the GPU modules of v2tc's variants, multi-token calls, PDL merge and engine-step capture (v2tc-sanitize's V2TC_SAN_SET=variants)
TC_VARIANT_FILES="tests/test_fp8_gpu.py tests/test_pdl_gpu.py tests/test_variants_gpu.py tests/test_multitoken_gpu.py tests/test_engine_step_gpu.py"
FI_ENV="FLASHINFER_WORKSPACE_BASE=/tmp/paged-decode-flashinfer/jit FLASHINFER_CUDA_ARCH_LIST=9.0 TORCH_CUDA_ARCH_LIST=9.0"
export $FI_ENV
REPS=${BENCH_REPS:-15}

step_fi() {
  FI_SMOKE=0 timeout 150 bash -c 'source bench/device/flashinfer_setup.sh' > "$L/fi_setup.log" 2>&1
  echo "fi setup rc=$?"; tail -2 "$L/fi_setup.log"
}
# FlashInfer 0.6 (.carry/flashinfer06, bench/device/fetch_flashinfer06.sh) first on
# PYTHONPATH for every later step of this run, with its XQA arm's smoke test (JIT-builds
# its GQA 4 and 16 kernels): name it after every step that uses FlashInfer 0.3.1
step_fi06() {
  # the setup's own exports die with its shell: the same three again for the later steps
  export FI06_HOME=${FI06_HOME:-/tmp/paged-decode-flashinfer06}
  timeout ${FI06_TIMEOUT:-400} bash -c 'source bench/device/flashinfer06_setup.sh' \
    > "$L/fi06_setup.log" 2>&1
  echo "fi06 setup rc=$?"; tail -8 "$L/fi06_setup.log"
  export PYTHONPATH="$FI06_HOME/site${PYTHONPATH:+:$PYTHONPATH}"
  export FLASHINFER_WORKSPACE_BASE="$FI06_HOME/jit" FLASHINFER_CUDA_ARCH_LIST=9.0a
}
# our arms beside FlashInfer 0.6's XQA decode (run fi06 first): the models layouts at
# batch 1 / 8 / 64 x 8K / 32K (XQA_MODELS) and the targets cells at batch 1 / 8 / 64
step_xqa() {
  local m
  for m in ${XQA_MODELS:-llama3-70b-tp8 gqa16 qwen2-7b}; do
    BENCH_TIMEOUT=${XQA_BENCH_TIMEOUT:-200} run_bench "xqa_$m" --preset models --model $m \
      --context 8192 --context 32768 --arms v2,v2tc,flashinfer-xqa | tail -8
  done
  BENCH_TIMEOUT=${XQA_BENCH_TIMEOUT:-200} run_bench xqa_targets --preset targets --batch 1 \
    --batch 8 --batch 64 --arms v2,v2tc,flashinfer-xqa | tail -14
}
step_gpu_tests() {
  python3 -m pytest -q tests -m gpu -rs ${GPU_TEST_K:+-k "$GPU_TEST_K"} \
    > "$L/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "FAILED|passed|failed" "$L/gpu_tests.log" | tail -8
}
step_check_full() {
  local t0 dt k
  t0=$(date +%s)
  for dt in float16 bfloat16 float32; do
    for k in 0 1 2 3 4; do
      timeout 240 paged-decode check --backend cuda --full --dtype $dt --shard $k/5 \
        --json "$L/check_${dt}_$k.json" > "$L/check_${dt}_$k.log" 2>&1 &
    done
  done
  wait
  echo "check wall $(( $(date +%s) - t0 )) s"
  for dt in float16 bfloat16 float32; do
    python3 bench/device/merge_check_shards.py "$L/check_$dt.json" "$L"/check_${dt}_*.json
  done
}
step_memcheck() {
  PAGED_DECODE_PLAIN_MALLOC=1 timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 -m pytest -q $GPU_FILES -m gpu \
    -k "${MEMCHECK_K:-llama or g7 or g8 or g16 or ps1 or d256 or ps256 or empty or merge or capturable or poison or append}" \
    > "$L/memcheck.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$L/memcheck.log" | tail -3
}
step_racecheck() {
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 3 \
    python3 -m pytest -q tests/test_cuda_gpu.py -m gpu -k "prefix_kernel_on_cuda_matches_oracle and 128-float16" \
    > "$L/racecheck.log" 2>&1
  echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed|failed" "$L/racecheck.log" | tail -3
}
# run_bench NAME ARGS...: one bench run into $OUT/bench_NAME.{json,md,txt}, stderr logged
# (BENCH_L2=dirty: the flush of the runs before session 25, for comparisons with them;
# BENCH_LAYERS=32: 32 calls over 32 layers' pools per graph replay, as an engine's step)
run_bench() {
  local name=$1; shift
  timeout ${BENCH_TIMEOUT:-260} paged-decode bench --backend cuda --reps $REPS --warmup 3 \
    ${BENCH_L2:+--l2-flush $BENCH_L2} ${BENCH_LAYERS:+--graph-layers $BENCH_LAYERS} "$@" \
    --json "$OUT/bench_$name.json" --markdown "$OUT/bench_$name.md" 2>"$L/bench_$name.err" \
    | tee "$OUT/bench_$name.txt" | tail -40
  echo "$name rc=$?"; tail -3 "$L/bench_$name.err"
}
step_info() { paged-decode info > "$OUT/info.txt" 2>&1; echo "info rc=$?"; }
step_targets() { run_bench targets --preset targets --arms ${BENCH_ARMS:-v1,v2,sdpa,flashinfer,flashinfer-tc}; }
# the crossover table's file: $OUT/<the device's slug>.json, the name path='auto' looks
# up (paged_decode/crossover.py: device_slug), e.g. nvidia-h200.json
crossover_file() {
  echo "$OUT/$(python3 -c 'import cupy as cp; from paged_decode.crossover import device_slug
n = cp.cuda.runtime.getDeviceProperties(0)["name"]
print(device_slug(n.decode() if isinstance(n, bytes) else str(n)))').json"
}
step_adr() {
  run_bench adr --preset adr --arms ${BENCH_ARMS:-gather,v1,v2} --csv "$OUT/bench_adr.csv" \
    --write-crossover "$(crossover_file)"
}
step_crossover() {   # 69 cells (117 ran over 260 s in run N4): give it a command of its own
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-570} REPS=${BENCH_REPS:-10} run_bench crossover \
    --preset crossover --arms ${BENCH_ARMS:-v1,v2,v2tc} \
    --write-crossover "$(crossover_file)" | tail -12
}
step_ragged() { BENCH_TIMEOUT=${BENCH_TIMEOUT:-90} run_bench ragged --preset ragged \
  --arms ${BENCH_ARMS:-v2,v2tc,flashinfer,flashinfer-tc}; }
step_variants() { run_bench variants --preset variants --arms ${BENCH_ARMS:-v2,sdpa}; }
step_decode_variants() {
  # limits by arm-cells (about 1 s each at 15 reps, the crossover sweep's rate): 32, 16, 32,
  # 16 and 8 of them; FlashInfer's wrapper takes no sinks, so the sinks runs are ours alone
  # (DV_PARTS: a subset of plain window softcap sinks all)
  local arms=${BENCH_ARMS:-v2,v2tc,flashinfer,flashinfer-tc} b="--batch 1 --batch 8 --batch 32 --batch 128"
  local parts=" ${DV_PARTS:-plain window softcap sinks all} "
  [[ $parts == *" plain "* ]] && BENCH_TIMEOUT=${BENCH_TIMEOUT:-110} run_bench dv_plain \
    --preset targets --context 4096 --context 32768 $b --arms $arms
  [[ $parts == *" window "* ]] && BENCH_TIMEOUT=${BENCH_TIMEOUT:-70} run_bench dv_window \
    --preset targets --context 32768 $b --window-left 4095 --arms $arms
  [[ $parts == *" softcap "* ]] && BENCH_TIMEOUT=${BENCH_TIMEOUT:-110} run_bench dv_softcap \
    --preset targets --context 4096 --context 32768 $b --soft-cap 30 --arms $arms
  [[ $parts == *" sinks "* ]] && BENCH_TIMEOUT=${BENCH_TIMEOUT:-70} run_bench dv_sinks \
    --preset targets --context 4096 --context 32768 $b --sinks --arms v2,v2tc
  [[ $parts == *" all "* ]] && BENCH_TIMEOUT=${BENCH_TIMEOUT:-40} run_bench dv_all \
    --preset targets --context 32768 $b --window-left 4095 --soft-cap 30 --sinks --arms v2,v2tc
  return 0
}
step_models() {   # MODELS_LIST "phi3-mini gqa16": one bench per layout (--model takes one)
  local m
  [ -n "${MODELS_LIST:-}" ] || { run_bench models --preset models \
    --arms ${BENCH_ARMS:-v2,sdpa,flashinfer,flashinfer-tc}; return; }
  for m in $MODELS_LIST; do
    run_bench "models_$m" --preset models --model $m \
      --arms ${BENCH_ARMS:-v2,sdpa,flashinfer,flashinfer-tc} | grep -E " B[0-9]+ |rc="
  done
}
step_cascade() { run_bench cascade${CASCADE_MODEL:+_$CASCADE_MODEL} --suite cascade ${CASCADE_MODEL:+--model $CASCADE_MODEL}; }
step_cascade_rule() { run_bench cascade-rule --suite cascade-rule; }
# the forks suite over FORKS_KV's pools (unset: float16; an fp8 format: its pools, and
# FlashInfer's fp8 decode after fi)
step_forks() {   # FORKS_KV: fp8 pools; FORKS_MODEL: a models-preset layout's heads
  local m=${FORKS_MODEL:+--model $FORKS_MODEL} n=forks${FORKS_MODEL:+_$FORKS_MODEL}
  if [ -n "${FORKS_KV:-}" ]; then
    BENCH_TIMEOUT=${FORKS_TIMEOUT:-150} run_bench "${n}_$FORKS_KV" --suite forks --kv-dtype "$FORKS_KV" $m
  else
    run_bench "$n" --suite forks $m
  fi
}
# the forks suite (flat decode over pages every request shares: their K/V come from L2,
# every flat arm and cascade, FlashInfer's too after fi) at the CUDA kernels' ring depths
# FORKS_STAGES (2 3): whether a deeper ring streams L2-resident pages faster
step_forks_stages() {
  local st
  for st in ${FORKS_STAGES:-2 3}; do
    PAGED_DECODE_STAGES=$st BENCH_TIMEOUT=${FORKS_TIMEOUT:-90} run_bench "forks_s$st" \
      --suite forks | tail -9
  done
}
step_tune_forks() {
  timeout ${TUNE_TIMEOUT:-240} python3 bench/device/tune_forks.py "$OUT/tune_forks.json" \
    2>&1 | tee "$L/tune_forks.txt" | tail -60
  echo "tune-forks rc=$?"
}
step_chunks() {
  timeout ${TUNE_TIMEOUT:-560} python3 bench/device/tune_chunks.py "$OUT/tune_chunks.json" \
    ${TUNE_CHUNKS_PARTS:-} 2>&1 | tee "$L/tune_chunks.txt" | tail -90
  echo "chunks rc=$?"
}
step_batches() {
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-200} run_bench batches --preset batches \
    --arms ${BENCH_ARMS:-v2,v2tc,flashinfer,flashinfer-tc}
}
# the tensor-core partial's wave rule against the CTA-target rule it replaced: each preset of
# WAVES_PRESETS (batches targets) with BENCH_ARMS on the shipped plans, then v2tc alone with
# PAGED_DECODE_WAVE_PLAN=0 (WAVES_TIMEOUTS: each preset's limit for the first, half for
# the second; WAVES_ARGS_<preset>: more bench options for that preset, e.g. --batch 8)
step_waves_ab() {
  local presets=(${WAVES_PRESETS:-batches targets}) limits=(${WAVES_TIMEOUTS:-150 260}) i var
  for i in "${!presets[@]}"; do
    var="WAVES_ARGS_${presets[$i]}"
    BENCH_TIMEOUT=${limits[$i]:-200} run_bench "${presets[$i]}" --preset "${presets[$i]}" \
      --arms ${BENCH_ARMS:-v2,v2tc,flashinfer,flashinfer-tc} ${!var:-}
    PAGED_DECODE_WAVE_PLAN=0 BENCH_TIMEOUT=$(( ${limits[$i]:-200} / 2 )) \
      run_bench "${presets[$i]}_targetrule" --preset "${presets[$i]}" --arms v2tc ${!var:-}
  done
}
step_sparse() { run_bench sparse --suite sparse; }
step_regs() {
  python3 - <<'PY' 2>&1 | tee -a "$L/regs.txt"
from paged_decode.backends.cuda import compiled
from paged_decode.specs import merge_spec, prefix_spec, v2tc_spec
for spec in [prefix_spec(dt, d, 16) for dt in ("float16", "bfloat16") for d in (64, 96, 128, 256)] \
        + [merge_spec("float16", d, g) for d in (128, 256) for g in (False, True)] \
        + [v2tc_spec("float16", o, d, 16) for d in (64, 96, 128, 256) for o in ("float32", "float16")]:
    a = compiled(spec).attributes
    print(f"{spec.uri}: regs {a['num_regs']} local {a['local_size_bytes']} B"
          f" smem {spec.dynamic_smem_bytes}")
PY
}
step_prefix_tile_ab() {
  local kt c
  for kt in 64 32; do PAGED_DECODE_PREFIX_TILE=$kt step_regs; done
  for v in "64 2" "32 3" "32 4"; do
    read -r kt c <<< "$v"
    PAGED_DECODE_PREFIX_TILE=$kt PAGED_DECODE_PREFIX_CTAS_PER_SM=$c run_bench "ab_kt${kt}_c$c" \
      --suite cascade | grep " rc="
    echo "kt=$kt ctas/sm=$c"; grep -E "^cascade" "$OUT/bench_ab_kt${kt}_c$c.txt" | awk '{print $2, $3, $6, $7}'
  done
}
step_tune_v2() {
  timeout 300 python3 bench/device/tune_v2.py "$OUT/tune_v2.json" > "$OUT/tune_v2.txt" 2>&1
  echo "tune-v2 rc=$?"; tail -40 "$OUT/tune_v2.txt"
}
step_ncu_v2() {
  command -v ncu >/dev/null || { echo "no ncu on this machine"; return; }
  local ld
  for ld in 1 2; do
    timeout 100 ncu -k regex:pd_decode_v2 -c 1 --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats \
      python3 bench/device/profile_v2.py 64 4096 $ld >> "$OUT/ncu_v2.txt" 2>&1
  done
  grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issued|Eligible|Stall|Warp Cycles" "$OUT/ncu_v2.txt" | head -80
}

step_append_host() {
  timeout 240 python3 bench/device/append_host.py "$OUT/append_host.json" 2>&1 | tee "$L/append_host.txt"
  echo "append-host rc=$?"
}
step_engine() {
  python3 -m pytest -q tests/test_engine_step_gpu.py -rs > "$L/engine_tests.log" 2>&1
  echo "engine tests rc=$?"; grep -E "FAILED|passed|failed" "$L/engine_tests.log" | tail -8
  local kv n
  for kv in ${ENGINE_KV:-16bit}; do
    n=engine; [ "$kv" = 16bit ] || n="engine_$kv"
    timeout ${ENGINE_TIMEOUT:-500} paged-decode bench --backend cuda --suite engine ${ENGINE_ARGS:-} \
      $([ "$kv" = 16bit ] || echo "--kv-dtype $kv") \
      --arms ${ENGINE_ARMS:-eager,captured,flashinfer,flashinfer-captured} --json "$OUT/$n.json" \
      --plot "$OUT/$n.png" > "$OUT/$n.txt" 2>&1
    echo "$n bench rc=$?"; tail -20 "$OUT/$n.txt"
  done
}
step_begin_host() {   # CPU only: the same numpy bookkeeping this repository's CPU times
  timeout 120 python3 bench/begin_host.py 8 64 128 > "$L/begin_host.txt" 2>&1
  echo "begin-host rc=$?"; grep -E "^batch" "$L/begin_host.txt"
}
step_engine_models() {   # the engine step on GQA 7 and 8, CUDA-core v2 against v2tc
  local m
  for m in ${ENGINE_MODELS:-qwen2-7b}; do
    timeout 300 paged-decode bench --backend cuda --suite engine --model $m --batch 64 \
      --batch 128 --arms captured,captured-tc,flashinfer,flashinfer-captured --json "$OUT/engine_$m.json" \
      > "$OUT/engine_$m.txt" 2>&1
    echo "engine $m rc=$?"; tail -7 "$OUT/engine_$m.txt"
  done
}

step_fi_compat() {
  # SIGINT at the limit: pytest stops there and still prints its summary, the worst gaps
  # included (S23-R3's run was cut at 100 s by SIGTERM and printed none)
  timeout --signal=INT --kill-after=30 ${FI_COMPAT_TIMEOUT:-560} \
    python3 -m pytest tests/test_fi_gpu.py -m gpu -rs -v \
    ${FI_COMPAT_K:+-k "$FI_COMPAT_K"} > "$OUT/fi_compat.log" 2>&1
  echo "fi-compat rc=$?"; grep -E "FAILED|passed|failed|worst errors" "$OUT/fi_compat.log" | tail -12
}

step_generate() {
  timeout ${GENERATE_TEST_TIMEOUT:-240} python3 -m pytest -q -rs -m gpu \
    tests/test_integration_transformers.py ${GENERATE_TEST_K:+-k "$GENERATE_TEST_K"} \
    2>&1 | tee "$L/generate_tests.txt" | tail -15
  echo "generate tests rc=$?"
  if [ -n "${GENERATE_NOISE:-}" ]; then
    timeout 200 python3 bench/device/generate_noise.py "$OUT/generate_noise.json" \
      2>&1 | tee "$L/generate_noise.txt" | tail -4
    echo "generate noise rc=$?"
  fi
  timeout 300 python3 examples/generate_transformers.py --model-config llama3-8b-16l \
    --dtype float16 --batch 32 --prefix-len 512 --prompt-len 512 --new 64 --repeats 2 \
    --json "$OUT/generate_llama3_8b_16l.json" 2>&1 | tee "$L/generate_bench.txt" | tail -12
  echo "generate bench rc=$?"
}

step_decode_graph_debug() {
  timeout 200 python3 bench/device/debug_decode_graph.py ${DEBUG_MODEL:-llama} \
    > "$L/decode_graph_debug.txt" 2>&1
  echo "decode-graph-debug rc=$?"; grep -vE "^   \(" "$L/decode_graph_debug.txt" | tail -30
}
step_generate_profile() {
  timeout ${PROFILE_TIMEOUT:-240} python3 bench/device/profile_generate.py "$OUT/generate_profile.txt" \
    > "$L/generate_profile.log" 2>&1
  echo "generate profile rc=$?"; tail -6 "$L/generate_profile.log"
}

step_v2tc() { step_v2tc_targets; step_v2tc_models; }
step_v2tc_targets() {
  local arms=${BENCH_ARMS:-v2,v2tc,flashinfer,flashinfer-tc}
  run_bench v2tc_targets --preset targets --arms $arms
  run_bench v2tc_targets_warm --preset targets --arms $arms --warm-l2
  BENCH_TIMEOUT=60 run_bench v2tc_ragged --preset ragged --arms $arms
  BENCH_TIMEOUT=60 run_bench v2tc_ragged_warm --preset ragged --arms $arms --warm-l2
}
step_v2tc_models() {
  local arms=${BENCH_ARMS:-v2,v2tc,flashinfer,flashinfer-tc}
  run_bench v2tc_models --preset models --context 8192 --context 2048 --batch 8 --batch 32 \
    --arms $arms
  run_bench v2tc_bf16 --preset targets --dtype bfloat16 --context 8192 --batch 8 --arms $arms
}
step_tune_tc() {
  timeout 420 python3 bench/device/tune_tc.py "$OUT/tune_tc.json" ${TUNE_TC_PARTS:-} \
    > "$OUT/tune_tc.txt" 2>&1
  echo "tune-tc rc=$?"; cut -c1-150 "$OUT/tune_tc.txt" | tail -120
}
# both partials' chunkings x ring depths on named models cells beside SDPA
# (bench/device/tune_cells.py; TUNE_CELLS "model:BxCTX ...", TUNE_STAGES, TUNE_SPLITS, TUNE_ARMS)
step_tune_cells() {
  timeout ${TUNE_TIMEOUT:-480} python3 bench/device/tune_cells.py "$OUT/tune_cells.json" \
    ${TUNE_CELLS:-gqa16:64x1024 gqa16:8x8192} > "$OUT/tune_cells.txt" 2>&1
  echo "tune-cells rc=$?"; grep -A40 "^summary" "$OUT/tune_cells.txt" | cut -c1-170
}
step_engine_profile() {
  timeout 300 python3 bench/device/profile_engine.py "$OUT/engine_profile.json" \
    > "$OUT/engine_profile.txt" 2>&1
  echo "engine profile rc=$?"; grep -E '"(begin|replay|_reserve_rows|advance|send|stage_int32|apply_pending|replay_graph|update_table|graph:table_update|_replan_if_needed|update|append|decode|kernel_sum|captured_graph|batch)"' "$OUT/engine_profile.txt" | tr -s ' ' | paste -sd' ' | fold -w 2000
}
step_v2tc_sanitize() {
  local tool log files="tests/test_cuda_gpu.py tests/test_cuda_graphs.py" k=v2tc
  case ${V2TC_SAN_SET:-} in
    "") ;;
    variants) files=$TC_VARIANT_FILES k="v2tc or tc" ;;
    cluster) files=tests/test_cluster_merge_gpu.py k="cluster or grid" ;;
    *) echo "V2TC_SAN_SET: unset, 'variants' or 'cluster', got '$V2TC_SAN_SET'"; return 2 ;;
  esac
  k=${V2TC_SAN_K:-$k}
  for tool in ${V2TC_TOOLS:-memcheck racecheck synccheck}; do
    log="$L/v2tc_${V2TC_SAN_SET:+${V2TC_SAN_SET}_}$tool.log"
    PAGED_DECODE_PLAIN_MALLOC=1 timeout ${V2TC_SAN_TIMEOUT:-300} compute-sanitizer --tool $tool --error-exitcode 3 \
      python3 -m pytest -q $files -m gpu -k "$k" > "$log" 2>&1
    echo "v2tc ${V2TC_SAN_SET:+$V2TC_SAN_SET }$tool rc=$?"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$log" | tail -3
  done
}
# ncu over v2tc and v2 (NCU_ARMS) at 8 x 8K, heads 32/8 and 32/2: ncu_cells FILE NCU-ARGS...
ncu_cells() {
  command -v ncu >/dev/null || { echo "no ncu on this machine"; return 1; }
  local file=$1 arm heads; shift
  for heads in "32 8" "32 2"; do
    for arm in ${NCU_ARMS:-v2tc v2}; do
      echo "== $arm heads $heads" >> "$file"
      timeout 100 ncu -k regex:pd_decode_v2 -c 1 --section SpeedOfLight --section Occupancy \
        "$@" python3 bench/device/profile_v2.py ${NCU_BATCH:-8} 8192 0 $arm $heads \
        ${NCU_KV_DTYPE:-} >> "$file" 2>&1
    done
  done
}
# each kernel of one call (bench/device/kernel_times.py) alone under ncu, its CSV appended
# to FILE under a "== ARM CELL" line: ncu_kernels FILE LIMIT_S METRICS CELLS ARMS (CELLS:
# "B CTX HQ HKV" cells separated by ';', ARMS separated by spaces)
ncu_kernels() {
  command -v ncu >/dev/null || { echo "no ncu on this machine"; return 1; }
  local f=$1 limit=$2 metrics=$3 cells=$4 arms=$5 cell arm
  local IFS_SAVE=$IFS
  IFS=';'
  for cell in $cells; do
    IFS=$IFS_SAVE
    for arm in $arms; do
      echo "== $arm $cell" >> "$f"
      timeout $limit ncu --profile-from-start off --csv --print-units base --metrics "$metrics" \
        python3 bench/device/kernel_times.py $arm $cell >> "$f" 2>&1
      echo "ncu $arm $cell rc=$?"
    done
    IFS=';'
  done
  IFS=$IFS_SAVE
}
# each kernel of one call alone under ncu (its caches flushed): KT_CELLS "B CTX HQ HKV"
# x KT_ARMS; $OUT/kernel_times.csv and a per-call summary (bench/device/kernel_times.py)
step_kernel_times() {
  local f="$OUT/kernel_times.csv"
  ncu_kernels "$f" 60 \
    gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active \
    "${KT_CELLS:-1 8192 8 1;1 32768 8 1;1 8192 32 2;1 16384 32 8;1 1024 8 1;8 8192 32 8}" \
    "${KT_ARMS:-v2 v2tc flashinfer-tc}" || return 1
  python3 - "$f" <<'PY' | tee "$OUT/kernel_times.md"
import csv, sys
block, rows = None, {}
for line in open(sys.argv[1]):
    if line.startswith("== "):
        block = line[3:].strip(); rows[block] = {}; continue
    if not line.startswith('"') or block is None: continue
    r = next(csv.reader([line]))
    if r[0] == "ID": continue
    try: kid, name, metric, value = r[0], r[4], r[-3], r[-1]
    except IndexError: continue
    rows[block].setdefault((kid, name.split("(")[0][:60]), {})[metric] = value
for block, ks in rows.items():
    print(f"{block}:")
    tot = 0.0
    for (kid, name), m in ks.items():
        t = float(m.get("gpu__time_duration.sum", "nan").replace(",", "")) / 1000
        tot += t
        print(f"  {name:60s} {t:8.2f} us  grid {m.get('launch__grid_size','?'):>6}  regs "
              f"{m.get('launch__registers_per_thread','?'):>4}  dram% "
              f"{m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed','?'):>6}  warps% "
              f"{m.get('sm__warps_active.avg.pct_of_peak_sustained_active','?')}")
    print(f"  sum {tot:.2f} us")
PY
}
step_ncu_v2tc() {
  ncu_cells "$OUT/ncu_v2tc.txt" --section LaunchStats --section WarpStateStats \
    --section SchedulerStats || return
  grep -E "^==|Duration|Throughput|Registers|Achieved Occupancy|Block Limit|Issued|Stall" "$OUT/ncu_v2tc.txt" | head -80
}
step_ncu_stalls() {
  ncu_cells "$L/ncu_stalls.txt" \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" || return
  grep -E "^==|Duration|DRAM Throughput|Achieved Occupancy|stalled" "$L/ncu_stalls.txt" \
    | awk '$NF+0 >= 0.05 || /^==|Duration|DRAM|Occupancy/' | head -90
}
# the merge as a programmatic dependent launch (backends/cuda_pdl.py, #17): which streams
# the driver accepts it on (bench/device/pdl_probe.py), the GPU tests with it on, then
# v2 / v2tc at batch 1 / 4 / 8 x 1K-32K with PAGED_DECODE_PDL 0 and 1 (graph replay on a
# non-blocking stream, so the merge goes through PDL when it is on)
step_pdl() {
  python3 bench/device/pdl_probe.py "$OUT/pdl_probe.json" 2>&1 | tail -8
  PAGED_DECODE_PDL=1 timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu -rs \
    tests/test_pdl_gpu.py tests/test_pdl.py tests/test_cuda_graphs.py tests/test_cuda_gpu.py \
    > "$L/pdl_tests.log" 2>&1
  echo "pdl tests rc=$?"; grep -E "FAILED|Error|passed|failed" "$L/pdl_tests.log" | tail -12
  local p
  for p in 0 1; do
    PAGED_DECODE_PDL=$p BENCH_TIMEOUT=${PDL_BENCH_TIMEOUT:-90} run_bench "pdl_$p" --preset targets \
      --context 1024 --context 4096 --context 16384 --context 32768 --batch 1 --batch 4 \
      --batch 8 --arms ${PDL_ARMS:-v2,v2tc} | tail -14
  done
}
# the small cells where FlashInfer still leads (#17; S32-R4, H100: GQA 16 at 1 x 1K 1.112x,
# Llama-3-70B TP8 at 1 x 1K 1.020x), whose merge is a second launch (GQA > 4): v2tc as
# shipped, with its merge fused (PAGED_DECODE_FUSED_MERGE=1: session 29's fused merge has
# not been timed at these groups), and with the merge as a programmatic dependent launch
# (PAGED_DECODE_PDL=1; in a captured graph its host cost is paid once), FlashInfer's
# tensor cores beside them (run fi first); SC_MODELS, batch 1 / 8 x 1K / 8K
step_small_cells() {
  local m c="--context 1024 --context 8192 --batch 1 --batch 8"
  for m in ${SC_MODELS:-gqa16 llama3-70b-tp8 qwen2-7b}; do
    BENCH_TIMEOUT=60 run_bench "sc_${m}_fi" --preset models --model $m $c \
      --arms flashinfer-tc | tail -6
    BENCH_TIMEOUT=60 run_bench "sc_${m}_default" --preset models --model $m $c \
      --arms v2tc | tail -6
    PAGED_DECODE_FUSED_MERGE=1 BENCH_TIMEOUT=60 run_bench "sc_${m}_fused" --preset models \
      --model $m $c --arms v2tc | tail -6
    PAGED_DECODE_PDL=1 BENCH_TIMEOUT=60 run_bench "sc_${m}_pdl" --preset models --model $m \
      $c --arms v2tc | tail -6
  done
  return 0
}
# the tensor-core partial's fused merge (#17): its GPU tests (and the graph and v2tc oracle
# tests, which run it), memcheck and racecheck over its module, then v2 and v2tc at batch
# 1 / 4 / 8 x 1K-32K with PAGED_DECODE_FUSED_MERGE 1 (the arms FUSED_ARMS; add flashinfer,
# flashinfer-tc after fi) and v2tc with it 0
step_fused() {
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu -rs tests/test_fused_merge_gpu.py \
    tests/test_upload_streams_gpu.py tests/test_cuda_graphs.py tests/test_cuda_gpu.py \
    > "$L/fused_tests.log" 2>&1
  echo "fused tests rc=$?"; grep -E "FAILED|Error|passed|failed" "$L/fused_tests.log" | tail -8
  local tool
  for tool in memcheck racecheck; do
    timeout ${SANITIZE_TIMEOUT:-100} compute-sanitizer --tool $tool --error-exitcode 9 \
      python3 -m pytest -q -m gpu -x tests/test_fused_merge_gpu.py -k "${FUSED_SANITIZE_K:-captured or sinks}" \
      > "$L/fused_$tool.log" 2>&1
    echo "fused $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" \
      "$L/fused_$tool.log" | tail -3
  done
  [ "${FUSED_BENCH:-1}" = 1 ] || return 0
  local c="--preset targets --context 1024 --context 4096 --context 16384 --context 32768"
  PAGED_DECODE_FUSED_MERGE=1 BENCH_TIMEOUT=${FUSED_BENCH_TIMEOUT:-150} run_bench fused_1 $c \
    --batch 1 --batch 4 --batch 8 --arms ${FUSED_ARMS:-v2tc} | tail -14
  PAGED_DECODE_FUSED_MERGE=0 BENCH_TIMEOUT=${FUSED_BENCH_TIMEOUT:-150} run_bench fused_0 $c \
    --batch 1 --batch 4 --batch 8 --arms v2tc | tail -14
}
# the fused merge beside the two launches on the other GQA layouts (FUSED_MODELS, models
# preset cells: 1K / 8K / 32K x batch 1 / 8 / 64), FlashInfer's tensor-core decode beside
# the fused arm (run fi first), then over e4m3fn pools at GQA 16, 8 x 8K and 32 x 8K
step_fused_models() {
  local m
  for m in ${FUSED_MODELS:-gqa16 llama3-70b-tp8 qwen2-7b}; do
    PAGED_DECODE_FUSED_MERGE=1 BENCH_TIMEOUT=100 run_bench "fused_${m}_1" --preset models \
      --model $m --arms ${FUSED_MODEL_ARMS:-v2tc,flashinfer-tc} | tail -12
    PAGED_DECODE_FUSED_MERGE=0 BENCH_TIMEOUT=100 run_bench "fused_${m}_0" --preset models \
      --model $m --arms v2tc | tail -12
  done
  [ "${FUSED_FP8:-1}" = 1 ] || return 0
  local f
  for f in 1 0; do
    PAGED_DECODE_FUSED_MERGE=$f BENCH_TIMEOUT=100 run_bench "fused_fp8_gqa16_$f" --preset models \
      --model gqa16 --context 8192 --batch 8 --batch 32 --kv-dtype float8_e4m3fn --arms v2tc \
      | tail -6
  done
}
# the split merge (several warps per (row, head) where few groups merge many partials):
# its GPU tests, memcheck and racecheck over them, then the models layouts (MERGE_MODELS;
# 1K / 8K / 32K x batch 1 / 8 / 64) and the targets cells at batch 1-8 with the rule's
# split (FlashInfer beside it: run fi first) and with PAGED_DECODE_MERGE_SPLIT=1, and v2tc
# with its fused merge off (two launches, split) beside the default
step_merge_split() {
  timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu -rs tests/test_merge_split_gpu.py \
    tests/test_fused_merge_gpu.py tests/test_cuda_gpu.py tests/test_cuda_graphs.py \
    tests/test_pdl_gpu.py tests/test_engine_step_gpu.py > "$L/split_tests.log" 2>&1
  echo "split tests rc=$?"; grep -E "FAILED|Error|passed|failed" "$L/split_tests.log" | tail -8
  PAGED_DECODE_PDL=1 timeout 100 python3 -m pytest -q -m gpu tests/test_pdl_gpu.py \
    tests/test_merge_split_gpu.py -k "pdl or decode" > "$L/split_pdl_tests.log" 2>&1
  echo "split tests with PDL rc=$?"; grep -E "FAILED|passed|failed" "$L/split_pdl_tests.log" | tail -4
  local tool
  for tool in memcheck racecheck; do
    timeout ${SANITIZE_TIMEOUT:-100} compute-sanitizer --tool $tool --error-exitcode 9 \
      python3 -m pytest -q -m gpu -x tests/test_merge_split_gpu.py \
      -k "${SPLIT_SANITIZE_K:-128 or decode}" > "$L/split_$tool.log" 2>&1
    echo "split $tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" \
      "$L/split_$tool.log" | tail -3
  done
  [ "${SPLIT_BENCH:-1}" = 1 ] || return 0
  local m arms
  # FlashInfer's prebuilt ops are head_dim 128: at 256 / 96 it would JIT-compile for minutes
  for m in ${MERGE_MODELS:-llama3-70b-tp8 gqa16 qwen2-7b gemma2-9b phi3-mini}; do
    case $m in gemma2-9b|phi3-mini) arms=v2,v2tc ;; *) arms=${SPLIT_ARMS:-v2,v2tc,flashinfer,flashinfer-tc} ;; esac
    BENCH_TIMEOUT=100 run_bench "split_${m}_auto" --preset models --model $m --arms $arms | tail -12
    PAGED_DECODE_MERGE_SPLIT=1 BENCH_TIMEOUT=100 run_bench "split_${m}_1" --preset models \
      --model $m --arms v2,v2tc | tail -12
  done
  # shorter chunks, now that a long merge is cheap (SPLIT_FLOORS: chunk floors in tokens)
  local f
  for f in ${SPLIT_FLOORS:-}; do
    for m in llama3-70b-tp8 gqa16; do
      PAGED_DECODE_MIN_CHUNK_TOKENS=$f BENCH_TIMEOUT=100 run_bench "split_${m}_floor$f" \
        --preset models --model $m --batch 1 --batch 8 --arms v2,v2tc | tail -8
    done
  done
  local c="--preset targets --batch 1 --batch 4 --batch 8"
  BENCH_TIMEOUT=150 run_bench split_targets_auto $c --arms ${SPLIT_ARMS:-v2,v2tc,flashinfer,flashinfer-tc} | tail -14
  PAGED_DECODE_MERGE_SPLIT=1 BENCH_TIMEOUT=150 run_bench split_targets_1 $c --arms v2,v2tc | tail -14
  PAGED_DECODE_FUSED_MERGE=0 BENCH_TIMEOUT=150 run_bench split_targets_unfused $c --arms v2tc | tail -14
}
# the L2 prefetch hint of every cp.async copy (PAGED_DECODE_L2_PREFETCH; PREFETCH_SIZES,
# default 0 128 256 0: the first size again last, for the spread between processes): the
# GPU tests of the copying kernels at PREFETCH_TEST (128), then v2 / v2tc at batch 8 / 64 /
# 128 x 4K / 32K (Llama-3-8B heads; PREFETCH_CELLS: other bench arguments), GQA 7 and 8 at
# 32 x 8K, and the forks suite (PREFETCH_FORKS=0: not), at each size; FlashInfer's tensor
# cores once beside them (run fi first)
step_prefetch() {
  PAGED_DECODE_L2_PREFETCH=${PREFETCH_TEST:-128} timeout ${TESTS_TIMEOUT:-200} python3 -m pytest \
    -q -m gpu -rs tests/test_cuda_gpu.py tests/test_fp8_gpu.py tests/test_variants_gpu.py \
    tests/test_cuda_graphs.py tests/test_merge_split_gpu.py tests/test_fused_merge_gpu.py \
    > "$L/prefetch_tests.log" 2>&1
  echo "prefetch tests rc=$?"; grep -E "FAILED|Error|passed|failed" "$L/prefetch_tests.log" | tail -6
  local p i=0 c=${PREFETCH_CELLS:-"--preset targets --context 4096 --context 32768 --batch 8 --batch 64 --batch 128"}
  BENCH_TIMEOUT=60 run_bench pf_fi $c --arms flashinfer-tc | tail -8
  for p in ${PREFETCH_SIZES:-0 128 256 0}; do
    i=$((i + 1))
    PAGED_DECODE_L2_PREFETCH=$p BENCH_TIMEOUT=60 run_bench "pf${i}_$p" $c --arms v2,v2tc | tail -8
    for m in llama3-70b-tp8 qwen2-7b; do
      PAGED_DECODE_L2_PREFETCH=$p BENCH_TIMEOUT=40 run_bench "pf${i}_${p}_$m" --preset models \
        --model $m --context 8192 --batch 32 --arms v2,v2tc | tail -3
    done
    [ "${PREFETCH_FORKS:-1}" = 1 ] && PAGED_DECODE_L2_PREFETCH=$p BENCH_TIMEOUT=60 \
      run_bench "pf${i}_${p}_forks" --suite forks | tail -8
  done
  return 0
}
# one PAGED_DECODE_* setting's values alternated in one run: SETTING (its name), SETTING_VALUES
# (e.g. "chunks heads"; "-" leaves it unset), SETTING_ROUNDS (2) rounds; each value runs every
# bench of SETTING_BENCHES (";" between bench argument lists; default: the forks suite, the
# targets preset at batch 32 / 128 x 8K / 32K, the same over e4m3fn) with SETTING_ARMS
# (v2,v2tc) and, with SETTING_ENGINE=1, the engine step (ENGINE_ARMS, ENGINE_ARGS)
step_setting_ab() {
  [ -n "${SETTING:-}" ] || { echo "setting-ab: SETTING is not set"; return 1; }
  local benches=${SETTING_BENCHES:-"--suite forks;--preset targets --context 8192 --context 32768 --batch 32 --batch 128;--preset targets --context 8192 --context 32768 --batch 32 --batch 128 --kv-dtype float8_e4m3fn"}
  local r v k b n
  for r in $(seq ${SETTING_ROUNDS:-2}); do
    for v in ${SETTING_VALUES:?setting-ab: SETTING_VALUES is not set}; do
      # one subshell per value: every bench and the engine step below run under it
      ( if [ "$v" = - ]; then unset "$SETTING"; else export "$SETTING=$v"; fi
        k=0
        while IFS= read -r b; do
          [ -n "$b" ] || continue
          k=$((k + 1)); n="sab${r}_${v/#-/unset}_$k"
          BENCH_TIMEOUT=${SETTING_TIMEOUT:-120} run_bench "$n" $b --arms ${SETTING_ARMS:-v2,v2tc} \
            | grep -E " B[0-9]+ |rc="
        done <<< "$(tr ';' '\n' <<< "$benches")"
        [ "${SETTING_ENGINE:-0}" = 1 ] || exit 0
        n="sab${r}_${v/#-/unset}_engine"
        timeout ${ENGINE_TIMEOUT:-300} paged-decode bench --backend cuda --suite engine \
          ${ENGINE_ARGS:-} --arms ${ENGINE_ARMS:-captured-tc} --json "$OUT/$n.json" \
          > "$OUT/$n.txt" 2>&1
        echo "$n rc=$?"; grep -E "^B[0-9]+ " "$OUT/$n.txt" )
    done
  done
  return 0
}
# the row rule of the L2 prefetch hint (PAGED_DECODE_L2_PREFETCH=rows: 64 bytes over head_dim
# 96's 192-byte rows, 64 over fp8 head_dim 64, none over fp8 head_dim 96) against the 128
# bytes every kernel hints now, alternated ROWPF_ROUNDS (2) times in one run: the GPU tests
# of the head_dim-96 and fp8 kernels under the rule, then Phi-3-mini's heads (32/32 x 96)
# at batch 8 / 64 x 1K / 8K (ROWPF_ARGS: other cells) beside SDPA, and the variants preset
# (8 x 8K, head_dim 64 among its cells) over e4m3fn pools
step_row_prefetch() {
  PAGED_DECODE_L2_PREFETCH=rows timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu -rs \
    tests/test_cuda_gpu.py tests/test_fp8_gpu.py -k "96 or 64 or fp8 or e4m3 or e5m2" \
    > "$L/row_prefetch_tests.log" 2>&1
  echo "row-prefetch tests rc=$?"; grep -E "FAILED|Error|passed|failed" "$L/row_prefetch_tests.log" | tail -6
  local p r
  for r in $(seq ${ROWPF_ROUNDS:-2}); do
    for p in 128 rows; do
      PAGED_DECODE_L2_PREFETCH=$p BENCH_TIMEOUT=${ROWPF_TIMEOUT:-90} run_bench "rp${r}_${p}_phi3" \
        --preset models --model phi3-mini ${ROWPF_ARGS:-"--context 1024 --context 8192 --batch 8 --batch 64"} \
        --arms v2,v2tc,sdpa | tail -6
      PAGED_DECODE_L2_PREFETCH=$p BENCH_TIMEOUT=${ROWPF_TIMEOUT:-90} run_bench "rp${r}_${p}_fp8" \
        --preset variants --kv-dtype float8_e4m3fn --arms v2,v2tc | tail -12
    done
  done
  # the DRAM bytes behind it: v2 alone at Phi-3-mini's 64 x 8K under ncu (6.4 GB of K/V
  # to read), at each hint
  command -v ncu >/dev/null || return 0
  for p in 128 rows; do
    PAGED_DECODE_L2_PREFETCH=$p timeout 120 ncu --profile-from-start off \
      --metrics dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,gpu__time_duration.sum \
      python3 bench/device/kernel_times.py v2 64 8192 32 32 96 > "$L/rp_ncu_$p.log" 2>&1
    echo "rp ncu $p rc=$?"; grep -E "dram__bytes|lts__t_sectors|gpu__time|pd_" "$L/rp_ncu_$p.log" | head -8
  done
  return 0
}
# the unsplit merge of long groups (forced with PAGED_DECODE_MERGE_SPLIT=1) beside the
# default rule: Llama-3-70B TP8 heads at batch 1 x 8K / 32K, v2 / v2tc
step_unsplit_merge() {
  local m
  for m in auto 1; do
    PAGED_DECODE_MERGE_SPLIT=${m/auto/} BENCH_TIMEOUT=60 run_bench "unsplit_$m" --preset models \
      --model llama3-70b-tp8 --context 8192 --context 32768 --batch 1 --arms v2,v2tc | tail -4
  done
}
# where the bandwidth-bound cells lose to FlashInfer's tensor cores (#17: 86-93% of the
# measured bandwidth against its 97%): each kernel of one call alone under ncu (DRAM
# bytes and throughput, occupancy limits, issue and the main stall reasons) at BW_CELLS x
# v2 / v2tc / flashinfer-tc (run fi first), raw CSV in $OUT/ncu_bw.csv; then v2tc with a
# 3-stage ring and v2 / v2tc at a 528-CTA plan target beside the defaults at batch 4-32 x
# 16K / 32K
step_ncu_bw() {
  local st="smsp__average_warps_issue_stalled"
  ncu_kernels "$OUT/ncu_bw.csv" 90 \
gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
launch__grid_size,launch__block_size,launch__registers_per_thread,\
launch__shared_mem_per_block_dynamic,launch__occupancy_limit_shared_mem,\
launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,\
smsp__issue_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct,\
${st}_long_scoreboard_per_issue_active.ratio,${st}_barrier_per_issue_active.ratio,\
${st}_wait_per_issue_active.ratio,${st}_short_scoreboard_per_issue_active.ratio,\
${st}_lg_throttle_per_issue_active.ratio,${st}_math_pipe_throttle_per_issue_active.ratio,\
${st}_mio_throttle_per_issue_active.ratio,${st}_not_selected_per_issue_active.ratio,\
smsp__inst_executed.sum,lts__t_sectors_srcunit_tex_op_read.sum,dram__sectors_read.sum,\
sm__cycles_active.avg,gpc__cycles_elapsed.max \
    "${BW_CELLS:-32 16384 32 8;8 32768 32 8}" "${BW_ARMS:-v2 v2tc flashinfer-tc}" || return 1
  [ "${BW_BENCH:-1}" = 1 ] || return 0
  local c="--preset targets --context 16384 --context 32768 --batch 4 --batch 8 --batch 32"
  PAGED_DECODE_STAGES=3 BENCH_TIMEOUT=60 run_bench bw_tc_s3 $c --arms v2tc | tail -8
  PAGED_DECODE_TARGET_CTAS=528 BENCH_TIMEOUT=60 run_bench bw_t528 $c --arms v2,v2tc | tail -8
  BENCH_TIMEOUT=60 run_bench bw_default $c --arms v2,v2tc | tail -8
}
# the CUDA-core v2 partial at plan CTA targets V2_TARGETS (default 264, the default 2 per
# SM, and 528) over the targets preset: whether v2 wants more CTAs than v2tc (S18-R4: 4-5%
# less time at 528 at batch 8 / 32 x 32K, v2tc 17-24% more)
step_v2_target() {
  local t
  for t in ${V2_TARGETS:-264 528}; do
    PAGED_DECODE_TARGET_CTAS=$t BENCH_TIMEOUT=60 run_bench "v2_target_$t" --preset targets \
      --arms v2 | tail -26
  done
}
# why v2tc's L2 hit rate is 34% on exactly the DRAM bytes FlashInfer's kernel reads at a 1%
# hit rate (S18-R4): ncu's memory tables (requests, sectors per request and hit rate per
# operation, L1 and L2, the L2 fabric) of each kernel alone at MEM_CELL (32 x 16K, 32/8 by
# default; run fi first), profiled once into a report, printed from it as text
# ($OUT/ncu_mem_<arm>.txt) and as every metric the sections collect ($OUT/ncu_mem_raw_<arm>.csv)
step_ncu_mem() {
  command -v ncu >/dev/null || { echo "no ncu on this machine"; return 1; }
  local arm
  for arm in ${MEM_ARMS:-v2tc flashinfer-tc}; do
    timeout 120 ncu --profile-from-start off --section MemoryWorkloadAnalysis_Tables \
      --section MemoryWorkloadAnalysis_Chart -o "$L/ncu_mem_$arm" -f \
      python3 bench/device/kernel_times.py $arm ${MEM_CELL:-32 16384 32 8} \
      > "$L/ncu_mem_$arm.log" 2>&1
    echo "ncu mem $arm rc=$?"
    timeout 60 ncu --import "$L/ncu_mem_$arm.ncu-rep" --print-details all \
      > "$OUT/ncu_mem_$arm.txt" 2>&1
    echo "details $arm rc=$? ($(wc -l < "$OUT/ncu_mem_$arm.txt") lines)"
    timeout 60 ncu --import "$L/ncu_mem_$arm.ncu-rep" --page raw --csv \
      > "$OUT/ncu_mem_raw_$arm.csv" 2>&1
    echo "raw $arm rc=$?"
    grep -iE "hit rate|sectors/req|Global Load|LDGSTS|L2 Fabric" "$OUT/ncu_mem_$arm.txt" | head -20
  done
}
# where v2tc's and FlashInfer's tensor-core kernels stall, instruction by instruction: ncu
# source counters (warp-state samples per SASS instruction) of each kernel alone at
# SRC_CELL (32 x 16K, 32/8 by default; run fi first), saved as .ncu-rep and printed as the
# source page (CSV) in $OUT/ncu_source_<arm>.csv
step_ncu_source() {
  command -v ncu >/dev/null || { echo "no ncu on this machine"; return 1; }
  local arm
  for arm in ${SRC_ARMS:-v2tc flashinfer-tc}; do
    timeout 150 ncu --profile-from-start off --section SourceCounters --section WarpStateStats \
      -o "$L/ncu_source_$arm" -f python3 bench/device/kernel_times.py $arm ${SRC_CELL:-32 16384 32 8} \
      > "$L/ncu_source_$arm.log" 2>&1
    echo "ncu source $arm rc=$?"
    timeout 60 ncu --import "$L/ncu_source_$arm.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/ncu_source_$arm.csv" 2>&1
    echo "source page $arm rc=$? ($(wc -l < "$OUT/ncu_source_$arm.csv") lines)"
  done
}
# what limits v2tc over fp8 pools where it trails the 1.8x-of-float16 target (#14): one
# ncu profile per pool dtype (FP8_NCU_DTYPES; "" is float16) of the partial alone at
# FP8_NCU_CELL (8 x 8K, 32/8; FP8_NCU_STAGES a ring depth), with the pipe utilization (ComputeWorkloadAnalysis,
# InstructionStats), warp states, memory and per-SASS-instruction samples; details in
# $OUT/ncu_fp8_<dtype>.txt, the source page in $OUT/ncu_fp8_src_<dtype>.csv
step_ncu_fp8() {
  command -v ncu >/dev/null || { echo "no ncu on this machine"; return 1; }
  local dt tag
  for dt in ${FP8_NCU_DTYPES:-float8_e4m3fn float16}; do
    tag=${dt:-float16}
    [ "$dt" = float16 ] && dt=""
    KT_KV_DTYPE=$dt PAGED_DECODE_STAGES=${FP8_NCU_STAGES:-} timeout 150 ncu --profile-from-start off -k regex:pd_decode_v2_tc \
      --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section SourceCounters \
      --metrics "regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active" \
      -o "$L/ncu_fp8_$tag" -f python3 bench/device/kernel_times.py v2tc ${FP8_NCU_CELL:-8 8192 32 8} \
      > "$L/ncu_fp8_$tag.log" 2>&1
    echo "ncu fp8 $tag rc=$?"; tail -3 "$L/ncu_fp8_$tag.log"
    timeout 60 ncu --import "$L/ncu_fp8_$tag.ncu-rep" --print-details all > "$OUT/ncu_fp8_$tag.txt" 2>&1
    timeout 60 ncu --import "$L/ncu_fp8_$tag.ncu-rep" --page raw --csv > "$L/ncu_fp8_raw_$tag.csv" 2>&1
    timeout 60 ncu --import "$L/ncu_fp8_$tag.ncu-rep" --page source --csv --print-source sass \
      > "$OUT/ncu_fp8_src_$tag.csv" 2>&1
    grep -E "Duration|DRAM Throughput|Achieved Occupancy|Issue Slots Busy|Executed Ipc|pipe|Stall" \
      "$OUT/ncu_fp8_$tag.txt" | head -40
  done
}
# one stamped tensor-core partial launch per cell (bench/device/timeline.py: each CTA's SM,
# start, first stage landed, loop end, rows written; PAGED_DECODE_TIMELINE=1): the call's
# fixed part (prologue, ramp, tail) beside its streaming, float16 and fp8 pools
# carried_base DIR: DIR's absolute path when it holds a paged_decode package (a copy of an
# earlier commit's, for A/B steps: PYTHONPATH=that path runs it), after printing which
# package imports from it (-P: not this tree's from the current folder); else a message
# and status 1
carried_base() {
  [ -d "$1/paged_decode" ] || { echo "no $1/paged_decode" >&2; return 1; }
  local d; d=$(realpath "$1")
  PYTHONPATH=$d python3 -P -c "import paged_decode; print(\"base:\", paged_decode.__file__)" 2>&1 \
    | sed "s/^/  /" >&2
  echo "$d"
}
step_timeline() {
  local cells=${TIMELINE_CELLS:-8x8192 8x8192:float8_e4m3fn 32x8192 32x8192:float8_e4m3fn 8x32768:float8_e4m3fn 20x16384 12x16384 64x4096}
  # TIMELINE_SETTINGS: NAME=VALUE settings separated by spaces, one timeline under each
  # ($OUT/timeline_<k>.json), e.g. the cluster merge on and off
  if [ -n "${TIMELINE_SETTINGS:-}" ]; then
    local k=0 setting
    for setting in $TIMELINE_SETTINGS; do
      k=$((k + 1))
      env "$setting" timeout ${TIMELINE_TIMEOUT:-240} python3 bench/device/timeline.py \
        "$OUT/timeline_$k.json" $cells 2>&1 | tee "$L/timeline_$k.txt" | tail -12
      echo "timeline $setting rc=$?"
    done
    return 0
  fi
  timeout ${TIMELINE_TIMEOUT:-240} python3 bench/device/timeline.py "$OUT/timeline.json" \
    $cells 2>&1 | tee "$L/timeline.txt" | tail -12
  echo "timeline rc=$?"
  # TIMELINE_BASE: the same cells on a carried paged_decode (as the ab step's AB_BASE)
  [ -n "${TIMELINE_BASE:-}" ] || return 0
  local base; base=$(carried_base "$TIMELINE_BASE") || return 1
  PYTHONPATH=$base timeout ${TIMELINE_TIMEOUT:-240} python3 \
    bench/device/timeline.py "$OUT/timeline_base.json" $cells 2>&1 \
    | tee "$L/timeline_base.txt" | tail -12
  echo "timeline base rc=$?"
}
# v2tc at plan CTA targets beyond the default 2 per SM (TC_TARGETS; "" is the default),
# where its 3-4 resident CTAs per SM are left idle or a second wave runs nearly empty:
# GQA 7 and 16 at batch 8 / 64 x 8K / 32K, Llama-3-8B heads at batch 64 / 128 x 4K / 16K
step_tc_target() {
  local t m
  for t in ${TC_TARGETS:-"" 396 792}; do
    for m in qwen2-7b gqa16; do
      PAGED_DECODE_TARGET_CTAS=$t BENCH_TIMEOUT=60 run_bench "tc_target_${m}_${t:-default}" \
        --preset models --model $m --batch 8 --batch 64 --context 8192 --context 32768 \
        --arms v2tc | tail -6
    done
    PAGED_DECODE_TARGET_CTAS=$t BENCH_TIMEOUT=90 run_bench "tc_target_llama3-8b_${t:-default}" \
      --preset targets --batch 64 --batch 128 --context 4096 --context 16384 --arms v2tc | tail -6
  done
}
# v2tc at batch 1 with a deeper ring (PAGED_DECODE_STAGES=3) and 3 CTAs per SM in the
# plan (PAGED_DECODE_TARGET_CTAS=396), beside the defaults in the same run: Llama-3-8B
# heads at 4K-32K and the GQA 8 / 16 layouts at 8K / 32K
step_tc_batch1() {
  local knob label m
  for knob in "" PAGED_DECODE_STAGES=3 PAGED_DECODE_TARGET_CTAS=396; do
    label=${knob:-default}; label=${label#PAGED_DECODE_}; label=${label/=/}
    (
      [ -n "$knob" ] && export "$knob"
      BENCH_TIMEOUT=60 run_bench "tc_b1_targets_$label" --preset targets --batch 1 \
        --context 4096 --context 16384 --context 32768 --arms v2tc | tail -5
      for m in llama3-70b-tp8 gqa16; do
        BENCH_TIMEOUT=60 run_bench "tc_b1_${m}_$label" --preset models --model $m --batch 1 \
          --context 8192 --context 32768 --arms v2tc | tail -4
      done
    )
  done
}
step_pdl_probe() { python3 bench/device/pdl_probe.py "$OUT/pdl_probe.json" 2>&1 | tail -12; }
step_multitoken() {
  python3 -m pytest -q tests/test_multitoken_gpu.py -m gpu -rs > "$L/multitoken_tests.log" 2>&1
  echo "multitoken gpu tests rc=$?"; grep -E "FAILED|passed|failed" "$L/multitoken_tests.log" | tail -4
  timeout 500 python3 bench/device/multitoken.py "$OUT/multitoken.json" --cell 32x4096 \
    --cell 8x8192 --reps "$REPS" 2>&1 | tee "$L/multitoken.log" | tail -24
}

step_fp8() {
  python3 -m pytest -q tests/test_fp8_gpu.py -m gpu -rs > "$L/fp8_gpu_tests.log" 2>&1
  echo "fp8 gpu tests rc=$?"; grep -E "FAILED|passed|failed" "$L/fp8_gpu_tests.log" | tail -8
  # registers of the v2 partial, float16 against fp8 pools (an fp8 lane holds 16 elements
  # of a row, twice float16's: q and accumulator registers double)
  python3 - <<'PY' 2>&1 | tee -a "$OUT/fp8_regs.txt"
from paged_decode.backends.cuda import compiled
from paged_decode.specs import v2_spec, v2tc_spec
for kv in ("float16", "float8_e4m3fn", "float8_e5m2"):
    for o in ("float16", "float32"):
        specs = [v2_spec("float16", kv, o, 128, 16, qh) for qh in (1, 4, 8)]
        specs.append(v2tc_spec(kv, o, 128, 16, q_dtype="float16"))
        for spec in specs:
            a = compiled(spec).attributes
            print(f"{spec.uri}: regs {a['num_regs']} local {a['local_size_bytes']} B")
PY
  local arms=${BENCH_ARMS:-v2,v2tc,flashinfer-tc}
  local cells="--preset targets --context 8192 --context 32768 --batch 8 --batch 32 --batch 128"
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-180} run_bench fp8_f16 $cells --arms $arms
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-180} run_bench fp8_e4m3 $cells --kv-dtype float8_e4m3fn --arms $arms
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-100} run_bench fp8_e5m2 $cells --kv-dtype float8_e5m2 --arms v2,v2tc
  python3 bench/device/fp8_table.py "$OUT/fp8_table.md" "$OUT"/bench_fp8_f16.json \
    "$OUT"/bench_fp8_e4m3.json "$OUT"/bench_fp8_e5m2.json 2>&1 | tail -12
}

# the new tensor-core variants in one short command (session 7): the GPU tests of fp8, the
# variants and the step, then #14's targets at two cells each (8 x 8K and 32 x 8K for fp8:
# float16 K/V of 268 MB and 1 GB; batch 8 at 4K / 32K for the variants), v2tc beside
# FlashInfer's tensor-core decode (run fi first), then memcheck over v2tc's GPU tests
step_tc_quick() {
  timeout 150 python3 -m pytest -q -m gpu -rs tests/test_fp8_gpu.py tests/test_variants_gpu.py \
    tests/test_engine_step_gpu.py tests/test_multitoken_gpu.py > "$L/tc_quick_tests.log" 2>&1
  echo "tc-quick gpu tests rc=$?"; grep -E "FAILED|passed|failed" "$L/tc_quick_tests.log" | tail -8
  local a=v2tc,flashinfer-tc c8="--preset targets --context 8192 --batch 8 --batch 32"
  local cv="--preset targets --context 4096 --context 32768 --batch 8"
  BENCH_TIMEOUT=60 run_bench q_fp8_f16 $c8 --arms v2,$a | tail -6
  BENCH_TIMEOUT=60 run_bench q_fp8_e4m3 $c8 --kv-dtype float8_e4m3fn --arms v2,$a | tail -6
  BENCH_TIMEOUT=45 run_bench q_plain $cv --arms $a | tail -6
  BENCH_TIMEOUT=45 run_bench q_softcap $cv --soft-cap 30 --arms $a | tail -6
  BENCH_TIMEOUT=30 run_bench q_sinks $cv --sinks --arms v2tc | tail -6
  BENCH_TIMEOUT=40 run_bench q_window --preset targets --context 32768 --batch 8 \
    --window-left 4095 --arms $a | tail -6
  PAGED_DECODE_PLAIN_MALLOC=1 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 -m pytest -q -m gpu tests/test_fp8_gpu.py tests/test_variants_gpu.py -k v2tc \
    > "$L/tc_quick_memcheck.log" 2>&1
  echo "v2tc memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$L/tc_quick_memcheck.log" | tail -3
}

# the soft cap on the hardware exp2 / reciprocal tanh (session 7, after tc-quick): its GPU
# tests (the logit sweep, every path with a cap), the fp8 widening tests, then v2 and
# v2tc with and without a cap of 30 at batch 8 x 4K / 32K (#14: within 3% of plain)
step_softcap_quick() {
  timeout 120 python3 -m pytest -q -m gpu -rs tests/test_variants_gpu.py -k "cap or logit" \
    tests/test_fp8_gpu.py > "$L/softcap_tests.log" 2>&1
  echo "softcap gpu tests rc=$?"; grep -E "FAILED|passed|failed" "$L/softcap_tests.log" | tail -8
  local cv="--preset targets --context 4096 --context 32768 --batch 8 --arms v2,v2tc"
  BENCH_TIMEOUT=50 run_bench s_plain $cv | tail -5
  BENCH_TIMEOUT=50 run_bench s_softcap $cv --soft-cap 30 | tail -5
}

# the GPU tests of the files in TESTS (default: fp8, the engine step, the transformers
# integration), TESTS_K narrowing them
step_tests() {
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu -rs \
    ${TESTS:-tests/test_fp8_gpu.py tests/test_engine_step_gpu.py tests/test_integration_transformers.py} \
    ${TESTS_K:+-k "$TESTS_K"} > "$L/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|Error|passed|failed" "$L/tests.log" | tail -12
}
# how the flush shapes the time (paged_decode.bench.timing): L2 read before each iteration
# (clean lines) against L2 overwritten (dirty lines the timed call writes back), #14's fp8
# cells (8 / 32 / 128 x 8K / 32K), float16 and e4m3fn pools, our arm beside FlashInfer's (run
# fi first)
step_l2() {
  local c="--preset targets --context 8192 --context 32768" f b n t
  for b in ${L2_BATCHES:-8 32 128}; do c="$c --batch $b"; done
  local arms=${L2_ARMS:-v2tc,flashinfer-tc}
  for n in ${L2_LAYERS:-1}; do
    t=""; [ "$n" = 1 ] || t="_L$n"
    for f in ${L2_FLUSHES:-clean dirty}; do
      BENCH_LAYERS=$n BENCH_TIMEOUT=${L2_TIMEOUT:-70} run_bench "l2_${f}${t}_f16" $c \
        --l2-flush $f --arms $arms | tail -7
      BENCH_LAYERS=$n BENCH_TIMEOUT=${L2_TIMEOUT:-70} run_bench "l2_${f}${t}_e4m3" $c \
        --l2-flush $f --kv-dtype float8_e4m3fn --arms $arms | tail -7
    done
  done
  return 0
}

# what the bench's timer charges beyond a call's bytes: empty graphs, plain reads of the
# cells' float16 and fp8 K/V byte counts (the ceiling of any float16 / fp8 ratio), v2tc
# and a paged read of its chunks
step_floor() {
  timeout ${FLOOR_TIMEOUT:-150} python3 bench/device/floor.py "$OUT/floor.json" \
    ${FLOOR_CELLS:-8x8192 32x8192} 2>&1 | tee "$L/floor.txt" | grep -v "^ "
  echo "floor rc=${PIPESTATUS[0]}"
}
# where dynamic shared memory starts modulo 128 bytes for a few static sizes (whether the
# v2 partial's uint4 ring can split 32-byte sectors across two shared spans)
step_smem_base() {
  timeout 60 python3 bench/device/smem_base.py "$OUT/smem_base.json" 2>&1 | tee "$L/smem_base.txt"
  echo "smem-base rc=${PIPESTATUS[0]}"
}
# #14's farthest cell (8 x 8K, e4m3fn; float16 beside it) under the switches that move a
# call's fixed part: the fused merge off, the merge as a dependent launch, 5 CTAs per SM,
# a 3-deep ring (FIXED_TIMEOUT each)
step_fp8_fixed() {
  local c="--preset targets --context 8192 --batch 8 --arms v2tc" t=${FIXED_TIMEOUT:-40}
  BENCH_TIMEOUT=$t run_bench fx_f16 $c | grep B8
  BENCH_TIMEOUT=$t run_bench fx_e4m3 $c --kv-dtype float8_e4m3fn | grep B8
  PAGED_DECODE_FUSED_MERGE=0 BENCH_TIMEOUT=$t run_bench fx_unfused $c --kv-dtype float8_e4m3fn | grep B8
  PAGED_DECODE_FUSED_MERGE=0 PAGED_DECODE_PDL=1 BENCH_TIMEOUT=$t run_bench fx_pdl $c \
    --kv-dtype float8_e4m3fn | grep B8
  PAGED_DECODE_TARGET_CTAS=660 BENCH_TIMEOUT=$t run_bench fx_t660 $c --kv-dtype float8_e4m3fn | grep B8
  PAGED_DECODE_STAGES=3 BENCH_TIMEOUT=$t run_bench fx_s3 $c --kv-dtype float8_e4m3fn | grep B8
  return 0
}

# v2tc over float16 and float8_e4m3fn pools (float16 queries) at 8/32/128 x 8K/32K,
# Llama-3-8B heads, side by side (FP8_QUICK_ARMS: add flashinfer-tc after fi;
# FP8_QUICK_F16=0 skips the float16 pools)
step_verdict() {
  local f; f=$(ls "$L"/out/bench_*.json 2>/dev/null)
  [ -n "$f" ] || { echo "verdict: no bench JSON in this run"; return 0; }
  python3 bench/issue_targets.py $f --markdown "$OUT/verdict.md" > "$L/verdict.txt" 2>&1
  echo "verdict rc=$?"; head -${VERDICT_LINES:-12} "$L/verdict.txt"
}
step_fp8_quick() {
  local c="--preset targets --context 8192 --context 32768 --batch 8 --batch 32 --batch 128"
  local arms=${FP8_QUICK_ARMS:-v2tc}
  [ "${FP8_QUICK_F16:-1}" = 1 ] && BENCH_TIMEOUT=60 run_bench fq_f16 $c --arms $arms | tail -9
  BENCH_TIMEOUT=${FP8_QUICK_TIMEOUT:-60} run_bench fq_e4m3 $c --kv-dtype float8_e4m3fn --arms $arms | tail -9
  [ "${FP8_QUICK_E5M2:-0}" = 1 ] && BENCH_TIMEOUT=${FP8_QUICK_TIMEOUT:-60} run_bench fq_e5m2 $c \
    --kv-dtype float8_e5m2 --arms $arms | tail -9
  return 0
}
# an A/B of this tree's v2tc against the package at FP8_AB_BASE (a copy of an earlier
# commit's paged_decode/, carried: its bench and kernels imported first on PYTHONPATH), in
# one run: float16 and e4m3fn pools at 8/32/128 x 8K/32K (this tree's fp8 ring at the depths
# FP8_AB_STAGES, "S" or "S:TARGET" for a plan CTA target), then v2tc over the targets preset
# (FP8_AB_TARGETS=0: not)
step_fp8_ab() {
  local c="--preset targets --context 8192 --context 32768 --batch 8 --batch 32 --batch 128"
  local base; base=$(carried_base "${FP8_AB_BASE:-.carry/base}") || return 1; local st tgt
  PYTHONPATH=$base BENCH_TIMEOUT=60 run_bench ab_base_f16 $c --arms v2tc | tail -9
  PYTHONPATH=$base BENCH_TIMEOUT=60 run_bench ab_base_e4m3 $c --kv-dtype float8_e4m3fn --arms v2tc | tail -9
  BENCH_TIMEOUT=60 run_bench ab_new_f16 $c --arms v2tc | tail -9
  for st in ${FP8_AB_STAGES:-2 3}; do
    tgt=${st#*:}; [ "$tgt" = "$st" ] && tgt=""
    PAGED_DECODE_STAGES=${st%%:*} PAGED_DECODE_TARGET_CTAS=$tgt BENCH_TIMEOUT=60 \
      run_bench "ab_new_e4m3_s${st/:/_t}" $c --kv-dtype float8_e4m3fn --arms v2tc | tail -9
  done
  [ "${FP8_AB_TARGETS:-1}" = 1 ] || return 0
  PYTHONPATH=$base BENCH_TIMEOUT=90 run_bench ab_base_targets --preset targets --arms v2tc | tail -28
  BENCH_TIMEOUT=90 run_bench ab_new_targets --preset targets --arms v2tc | tail -28
}
# this tree against a carried paged_decode (AB_BASE, default .carry/base; make it with
# `rm -rf .carry/base && mkdir -p .carry/base && git archive REV paged_decode | tar -x -C
# .carry/base`) in one run: each of AB_ROUNDS rounds (2) times the base, then this tree,
# on AB_ARGS (bench arguments; default batch 1 / 8 x 1K / 8K of the targets preset) over
# each pool dtype of AB_KV ("f16 float8_e4m3fn"), arms AB_ARMS (v2tc), AB_TIMEOUT (60 s) a
# bench; then the same rounds for each models-preset layout of AB_MODELS (none; e.g.
# "gqa16 llama3-70b-tp8") at AB_MODEL_ARGS (batch 8 / 32 x 2K / 8K; AB_ARGS=- runs only
# those); alternating shows the drift between rounds beside the difference
step_ab() {
  local base; base=$(carried_base "${AB_BASE:-.carry/base}") || return 1; local m
  python3 -P -c "import paged_decode; print(\"new:\", paged_decode.__file__)" 2>&1 | sed "s/^/  /"
  [ "${AB_ARGS:-}" = - ] ||      # "-": the AB_MODELS rounds only
    ab_rounds "$base" "" "${AB_ARGS:-"--preset targets --context 1024 --context 8192 --batch 1 --batch 8"}"
  # AB_MODELS: the same rounds over models-preset layouts (AB_MODEL_ARGS: their cells)
  for m in ${AB_MODELS:-}; do
    ab_rounds "$base" "${m}_" "--preset models --model $m ${AB_MODEL_ARGS:-"--context 2048 --context 8192 --batch 8 --batch 32"}"
  done
  return 0
}
# AB_ROUNDS rounds of (base, new) over AB_KV pools: ab_rounds BASE_DIR NAME_PREFIX "ARGS"
ab_rounds() {
  local base=$1 p=$2 c=$3 i kv
  for i in $(seq ${AB_ROUNDS:-2}); do
    for kv in ${AB_KV:-f16 float8_e4m3fn}; do
      local k=""; [ "$kv" = f16 ] || k="--kv-dtype $kv"
      PYTHONPATH=$base BENCH_TIMEOUT=${AB_TIMEOUT:-60} run_bench "ab_base_${p}${kv}_$i" $c $k \
        --arms ${AB_ARMS:-v2tc} | grep -E " B[0-9]+ |rc="
      BENCH_TIMEOUT=${AB_TIMEOUT:-60} run_bench "ab_new_${p}${kv}_$i" $c $k \
        --arms ${AB_ARMS:-v2tc} | grep -E " B[0-9]+ |rc="
    done
  done
}
# v2tc over fp8 pools at ring depths 2/3/4 (4 warps) and 2/3 (8 warps), float16 v2tc
# beside them, 8/32/128 x 8K/32K at Llama-3-8B heads: the fp8 stage holds half float16's
# bytes, so the default depth (float16's) may leave DRAM requests unissued (session 8)
step_fp8_stages() {
  local c="--preset targets --context 8192 --context 32768 --batch 8 --batch 32 --batch 128"
  BENCH_TIMEOUT=45 run_bench fst_f16 $c --arms v2tc | tail -8
  local w st
  for w in 4 8; do
    for st in 2 3 4; do
      [ "$w" = 8 ] && [ "$st" = 4 ] && continue
      PAGED_DECODE_TC_WARPS=$w PAGED_DECODE_STAGES=$st BENCH_TIMEOUT=45 \
        run_bench "fst_w${w}_s$st" $c --kv-dtype float8_e4m3fn --arms v2tc | tail -8
    done
  done
}
# the register-widening fp8 path (session 8: 41 KB and 128 registers per CTA, 4 resident
# per SM where float16's 3 are) at plan CTA targets 264 / 528 / 792 / 1056 x ring depths
# 2 / 3, batch 8 / 32 x 8K / 32K, where it reads at 2.1-2.9 TB/s
step_fp8_residency() {
  local c="--preset targets --context 8192 --context 32768 --batch 8 --batch 32" tgt st w
  for w in ${FRES_WARPS:-4}; do   # 8 warps: half the CTAs per SM, each twice the tokens
    for st in ${FRES_STAGES:-2 3}; do
      for tgt in ${FRES_TARGETS:-264 528 792 1056}; do
        PAGED_DECODE_TC_WARPS=$w PAGED_DECODE_STAGES=$st PAGED_DECODE_TARGET_CTAS=$tgt \
          BENCH_TIMEOUT=40 run_bench "fres_w${w}_s${st}_t$tgt" $c --kv-dtype float8_e4m3fn \
          --arms v2tc | tail -6
      done
    done
  done
}
# racecheck (then synccheck, if V2TC_SYNC=1) over a v2tc subset: every float16 / bfloat16
# geometry of test_cuda_gpu, the fp8 pools, and the four-variant specializations
step_v2tc_race() {
  local tool
  for tool in racecheck ${V2TC_SYNC:+synccheck}; do
    PAGED_DECODE_PLAIN_MALLOC=1 timeout ${RACE_TIMEOUT:-170} compute-sanitizer --tool $tool \
      --error-exitcode 3 python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_cuda_gpu.py \
      tests/test_fp8_gpu.py tests/test_variants_gpu.py -k "${V2TC_RACE_K:-v2tc and (oracle or empty or fp8 or all)}" \
      > "$L/v2tc_$tool.log" 2>&1
    echo "v2tc $tool rc=$?"
    grep -cE "PASSED" "$L/v2tc_$tool.log"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|FAILED|passed|failed" "$L/v2tc_$tool.log" | tail -5
  done
}

# the tensor-core partial after session 10's copy issue (one shared token row per copy)
# and skipped rescale: the GPU tests of every kernel file it and the prefix kernel touch,
# then v2, v2tc and FlashInfer's tensor-core decode over the targets preset (cold L2),
# every models layout at 8 x 8K and 32 x 2K, and e4m3fn pools at 8/32/128 x 8K / 32K
# (run fi first; TC_SPEED_PARTS: a subset of tests targets models fp8)
step_tc_speed() {
  local parts=${TC_SPEED_PARTS:-tests targets models fp8} a=v2,v2tc,flashinfer-tc
  if [[ " $parts " == *" tests "* ]]; then
    timeout ${TC_SPEED_TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu -rs $TC_GPU_FILES \
      > "$L/tc_speed_tests.log" 2>&1
    echo "tc-speed gpu tests rc=$?"; grep -E "FAILED|passed|failed" "$L/tc_speed_tests.log" | tail -8
  fi
  [[ " $parts " == *" targets "* ]] && BENCH_TIMEOUT=170 run_bench ts_targets --preset targets --arms $a
  [[ " $parts " == *" models "* ]] && BENCH_TIMEOUT=90 run_bench ts_models --preset models \
    --context 8192 --context 2048 --batch 8 --batch 32 --arms $a
  [[ " $parts " == *" fp8 "* ]] && BENCH_TIMEOUT=70 run_bench ts_fp8 --preset targets \
    --context 8192 --context 32768 --batch 8 --batch 32 --batch 128 --kv-dtype float8_e4m3fn \
    --arms v2tc,flashinfer-tc
  return 0
}

# the rest of tc-speed: the GPU tests it left (v2tc, prefix, cascade, fp8, the negative
# controls: S10-R2's tests reached their limit), then each models layout at 8 / 32 x 8K /
# 2K in a bench of its own (an illegal address in one arm, as S10-R2's models bench met,
# costs only that layout), then the forks suite (run fi first)
step_tc_models() {
  timeout ${TC_MODELS_TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu -rs $TC_GPU_FILES \
    -k "v2tc or prefix or cascade or fp8 or negative or pool_beyond" > "$L/tc_models_tests.log" 2>&1
  echo "tc-models gpu tests rc=$?"; grep -E "FAILED|passed|failed" "$L/tc_models_tests.log" | tail -8
  local m
  for m in ${TC_MODELS:-llama3-8b llama3-70b-tp8 qwen2-7b gqa16 gemma2-9b phi3-mini}; do
    BENCH_TIMEOUT=45 run_bench "tm_$m" --preset models --model $m --context 8192 --context 2048 \
      --batch 8 --batch 32 --arms ${TC_MODELS_ARMS:-v2,v2tc,flashinfer-tc} | tail -7
  done
  BENCH_TIMEOUT=80 run_bench tm_forks --suite forks | tail -9
  return 0
}

# after tc-models (session 10): phi3-mini on our arms, then FlashInfer's tensor-core arm
# alone (which of them met S10-R2/R3's illegal address); v2tc's ring depth 2 / 3 / 4 now
# that a CTA takes 125 registers, not 162; an ncu profile of v2tc at 8 x 8K, 32/8 and 32/2,
# with executed instructions (run fi first)
step_tc_depth() {
  BENCH_TIMEOUT=45 run_bench td_phi3_ours --preset models --model phi3-mini --context 8192 \
    --context 2048 --batch 8 --batch 32 --arms v2,v2tc | tail -6
  BENCH_TIMEOUT=45 run_bench td_phi3_fi --preset models --model phi3-mini --context 8192 \
    --context 2048 --batch 8 --batch 32 --arms flashinfer-tc | tail -6
  local st
  for st in 2 3 4; do
    PAGED_DECODE_STAGES=$st BENCH_TIMEOUT=40 run_bench "td_s$st" --preset targets \
      --context 8192 --context 32768 --batch 8 --batch 32 --arms v2tc | tail -6
    PAGED_DECODE_STAGES=$st BENCH_TIMEOUT=30 run_bench "td_70b_s$st" --preset models \
      --model llama3-70b-tp8 --context 8192 --batch 8 --batch 32 --arms v2tc | tail -4
  done
  NCU_ARMS=v2tc ncu_cells "$OUT/ncu_tc_depth.txt" --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section InstructionStats || return 0
  grep -E "^==|Duration|DRAM Throughput|Executed Instructions |Registers Per|Achieved Active|Warp Cycles Per Issued|Issued Warp" \
    "$OUT/ncu_tc_depth.txt" | head -40
  return 0
}

# move what the steps wrote to $OUT into the scratch folder and pack it all
pack() {
  mkdir -p "$L/out"
  find "$OUT" -maxdepth 1 -type f ! -name results.tgz ! -name env.txt ! -name pip.log \
    -exec mv {} "$L/out/" \;
  tar czf /tmp/pd-results.tgz -C "$L" . && mv /tmp/pd-results.tgz "$OUT/results.tgz"
}

for s in "$@"; do
  echo "== $s ($(date +%T))"
  "step_${s//-/_}"
  pack
done
