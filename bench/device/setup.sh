#!/usr/bin/env bash
# Source this on the GPU machine: installs the working tree (no network there) and
# records the environment under $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 \
  || { echo "pip install failed"; cat "$OUT/pip.log"; exit 1; }
{ nvidia-smi; nvcc --version; python3 -c "import cupy, numpy, torch; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"; } >"$OUT/env.txt" 2>&1
