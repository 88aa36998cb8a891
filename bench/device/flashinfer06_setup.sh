#!/usr/bin/env bash
# FlashInfer 0.6.18.post1 on the GPU machine, offline, for the flashinfer-xqa bench arm
# (paged_decode/bench/flashinfer_xqa_arm.py). Source it from the repo root with ".carry"
# carried, after `bash bench/device/fetch_flashinfer06.sh` filled .carry/flashinfer06/ on
# the CPU machine:
#   source bench/device/flashinfer06_setup.sh               # install, env, smoke test
#   FI06_SMOKE=0 source bench/device/flashinfer06_setup.sh  # without the smoke test
# It installs the two wheels (pip --no-index --no-deps) into $FI06_HOME/site and puts that
# first on PYTHONPATH, so `import flashinfer` is 0.6 in this shell even where FlashInfer
# 0.3.1's .pth (flashinfer_setup.sh) is installed: one process cannot hold both, so
# bench calls with the flashinfer-xqa arm run after this, and the 0.3.1 arms in calls
# before it. JIT cache: $FI06_HOME/jit (FLASHINFER_WORKSPACE_BASE); sm_90a kernels
# (FLASHINFER_CUDA_ARCH_LIST=9.0a). Knobs: FI06_HOME (/tmp/paged-decode-flashinfer06),
# FI06_SMOKE (1).
_fi06_main() {
  local repo wheels site
  repo=$(pwd)
  wheels="$repo/.carry/flashinfer06"
  FI06_HOME=${FI06_HOME:-/tmp/paged-decode-flashinfer06}
  site="$FI06_HOME/site"
  if ! ls "$wheels"/flashinfer_python-0.6*.whl >/dev/null 2>&1; then
    echo "[flashinfer06_setup] ERROR: no FlashInfer 0.6 wheel in $wheels (run bench/device/fetch_flashinfer06.sh on the CPU machine and carry .carry)" >&2
    return 1
  fi
  mkdir -p "$site" "$FI06_HOME/jit"
  if [ ! -d "$site/flashinfer" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl \
      > "$FI06_HOME/pip.log" 2>&1 || { echo "[flashinfer06_setup] ERROR: pip failed:" >&2; cat "$FI06_HOME/pip.log" >&2; return 1; }
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  export FLASHINFER_WORKSPACE_BASE="$FI06_HOME/jit" FLASHINFER_CUDA_ARCH_LIST=9.0a
  python3 -c "import flashinfer, tvm_ffi; print('[flashinfer06_setup] flashinfer', flashinfer.__version__, 'at', flashinfer.__file__)" \
    || { echo "[flashinfer06_setup] ERROR: import flashinfer failed" >&2; return 1; }
  if [ "${FI06_SMOKE:-1}" = 1 ]; then
    python3 -m paged_decode.bench.flashinfer_xqa_arm --smoke
  fi
}
_fi06_main
