#!/usr/bin/env bash
# FlashInfer 0.3.1 on the GPU machine, offline, from what .carry/ holds (no network there).
#
# Run from the repo root, with ".carry" among the run's carried paths:
#   source bench/device/flashinfer_setup.sh               # lay out, env, versions, smoke test
#   FI_SMOKE=0 source bench/device/flashinfer_setup.sh    # the same without the smoke test
# `bash bench/device/flashinfer_setup.sh` works too, but its exports die with it: then
# `source "$FI_HOME/env.sh"` (path printed at the end) or rely on the defaults that
# paged_decode.bench.flashinfer_arm uses (the same JIT cache directory).
#
# What it does (idempotent: a second run only re-checks, in about a second):
#   1. installs from .carry/wheels (pip --no-index) only the import-time dependencies of
#      FlashInfer that this python lacks (the GPU image normally has them all);
#   2. unpacks .carry/flashinfer/flashinfer_python-0.3.1.tar.gz under $FI_HOME and gives
#      it the flashinfer/data/ tree a wheel would have (include, csrc, tvm_binding,
#      cutlass, spdlog, version.txt; relative symlinks, as FlashInfer's own editable
#      install does), plus data/aot -> .carry/flashinfer/aot when prebuilt ops were
#      carried; makes it importable with a .pth file in site-packages;
#   3. exports FLASHINFER_WORKSPACE_BASE (JIT cache: $FI_HOME/jit), FLASHINFER_CUDA_ARCH_LIST
#      and TORCH_CUDA_ARCH_LIST (9.0: sm_90a kernels for the H200), and writes them to
#      $FI_HOME/env.sh;
#   4. prints versions and checks the JIT include paths FlashInfer will use;
#   5. unless FI_SMOKE=0: python -m paged_decode.bench.flashinfer_arm --smoke (JIT-builds
#      the float16 head_dim-128 CUDA-core and tensor-core modules, about a minute the
#      first time, and checks them, a CUDA-graph replay, the contiguous SDPA arm and
#      the GQA-7 refusal);
#   6. with FI_EXPORT_JIT=1 and $OUT set: packs the JIT-built ops into
#      $OUT/flashinfer_aot.tar.gz; unpacked into .carry/flashinfer/aot/ here, later
#      machines load them instead of compiling (they match this image's torch and CUDA).
#
# Knobs: PYTHON (python3), FI_HOME (/tmp/paged-decode-flashinfer), FI_SMOKE (1),
# FI_SMOKE_DTYPE (float16), FI_EXPORT_JIT (0), FLASHINFER_CUDA_ARCH_LIST (9.0).

_fi_log() { echo "[flashinfer_setup] $*"; }
_fi_err() { echo "[flashinfer_setup] ERROR: $*" >&2; }

_fi_main() {
  local t0 repo py fi_home tarball want_sha src data missing site pth have_sha aot
  t0=$(date +%s)
  repo=$(pwd)
  py=${PYTHON:-python3}
  fi_home=${FI_HOME:-/tmp/paged-decode-flashinfer}
  tarball="$repo/.carry/flashinfer/flashinfer_python-0.3.1.tar.gz"
  want_sha=992017d193dfbbc62e67401a6d5416629bf90b640872d14b7863de45e9371446
  src="$fi_home/flashinfer_python-0.3.1"
  data="$src/flashinfer/data"

  if [ ! -f "$tarball" ]; then
    _fi_err "$tarball is missing: run from the repo root and carry '.carry'"
    return 1
  fi
  if ! command -v "$py" >/dev/null 2>&1; then
    _fi_err "no python interpreter '$py' (set PYTHON)"
    return 1
  fi
  if ! "$py" -c "import torch, numpy, setuptools" 2>/dev/null; then
    _fi_err "$py cannot import torch, numpy and setuptools (FlashInfer's JIT needs all three)"
    return 1
  fi
  mkdir -p "$fi_home" || { _fi_err "cannot create $fi_home"; return 1; }

  # -- 1. import-time dependencies (module:distribution), installed only when missing
  missing=$("$py" - <<'PY'
import importlib.util
need = {"requests": "requests", "einops": "einops", "tqdm": "tqdm", "tabulate": "tabulate",
        "packaging": "packaging", "filelock": "filelock", "jinja2": "jinja2",
        "ninja": "ninja"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
PY
)
  if [ -n "$missing" ]; then
    _fi_log "installing from .carry/wheels: $missing"
    # shellcheck disable=SC2086
    if ! "$py" -m pip install -q --no-index --no-cache-dir --find-links "$repo/.carry/wheels" \
        $missing >"$fi_home/pip.log" 2>&1; then
      _fi_log "pip install into the interpreter failed; trying --target $fi_home/site"
      # shellcheck disable=SC2086
      if ! "$py" -m pip install -q --no-index --no-cache-dir --upgrade \
          --find-links "$repo/.carry/wheels" --target "$fi_home/site" $missing \
          >>"$fi_home/pip.log" 2>&1; then
        _fi_err "could not install $missing from .carry/wheels; log:"
        cat "$fi_home/pip.log" >&2
        return 1
      fi
      export PYTHONPATH="$fi_home/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
  fi

  # -- tools FlashInfer's JIT runs: ninja (from PATH) and nvcc (torch's CUDA_HOME or PATH)
  if ! command -v ninja >/dev/null 2>&1; then
    local ninja_dir
    ninja_dir=$("$py" -c "import ninja; print(ninja.BIN_DIR)" 2>/dev/null)
    if [ -n "$ninja_dir" ] && [ -x "$ninja_dir/ninja" ]; then
      export PATH="$ninja_dir:$PATH"
    else
      _fi_err "no ninja executable on PATH nor in the ninja package"
      return 1
    fi
  fi
  if ! command -v nvcc >/dev/null 2>&1; then
    local d
    for d in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-13.0; do
      if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then
        export PATH="$d/bin:$PATH"
        break
      fi
    done
    if ! command -v nvcc >/dev/null 2>&1; then
      _fi_err "nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): FlashInfer JIT-compiles with it"
      return 1
    fi
  fi

  # -- 2. the source tree with a wheel's flashinfer/data/ layout
  if [ ! -f "$fi_home/.unpacked-$want_sha" ] || [ ! -f "$src/flashinfer/__init__.py" ]; then
    have_sha=$(sha256sum "$tarball" | cut -d' ' -f1)
    if [ "$have_sha" != "$want_sha" ]; then
      _fi_err "$tarball has sha256 $have_sha, expected $want_sha (FlashInfer 0.3.1 sdist)"
      return 1
    fi
    rm -rf "$src" "$fi_home"/.unpacked-*
    if ! tar -xzf "$tarball" -C "$fi_home"; then
      _fi_err "cannot unpack $tarball into $fi_home"
      return 1
    fi
    touch "$fi_home/.unpacked-$want_sha"
    _fi_log "unpacked FlashInfer 0.3.1 into $src"
  fi
  mkdir -p "$data"
  # link name -> target relative to flashinfer/data (what setuptools' package-dir maps)
  local pair
  for pair in include:../../include csrc:../../csrc tvm_binding:../../tvm_binding \
      cutlass:../../3rdparty/cutlass spdlog:../../3rdparty/spdlog version.txt:../../version.txt; do
    ln -sfn "${pair#*:}" "$data/${pair%%:*}" || { _fi_err "cannot link $data/${pair%%:*}"; return 1; }
  done
  aot="$repo/.carry/flashinfer/aot"
  if [ -d "$aot" ]; then
    ln -sfn "$aot" "$data/aot"
    _fi_log "prebuilt ops: $(find "$aot" -name '*.so' | wc -l) in $aot (loaded instead of JIT)"
  elif [ -L "$data/aot" ]; then
    rm -f "$data/aot"
  fi
  site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  pth="$site/paged-decode-flashinfer.pth"
  if [ -w "$site" ]; then
    [ "$(cat "$pth" 2>/dev/null)" = "$src" ] || echo "$src" >"$pth"
  else
    _fi_log "$site is not writable: using PYTHONPATH"
    export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
  fi

  # -- 3. environment
  export FLASHINFER_WORKSPACE_BASE="${FLASHINFER_WORKSPACE_BASE:-$fi_home/jit}"
  export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0}"
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$FLASHINFER_CUDA_ARCH_LIST}"
  {
    echo "export FLASHINFER_WORKSPACE_BASE='$FLASHINFER_WORKSPACE_BASE'"
    echo "export FLASHINFER_CUDA_ARCH_LIST='$FLASHINFER_CUDA_ARCH_LIST'"
    echo "export TORCH_CUDA_ARCH_LIST='$TORCH_CUDA_ARCH_LIST'"
    echo "export PATH='$PATH'"
    [ -n "${PYTHONPATH:-}" ] && echo "export PYTHONPATH='$PYTHONPATH'"
  } >"$fi_home/env.sh"

  # -- 4. versions and the paths FlashInfer's JIT will use
  if ! FI_SRC="$src" "$py" - <<'PY'
import os, subprocess, sys
import torch
import flashinfer
from flashinfer.jit import env
src = os.environ["FI_SRC"]
print(f"[flashinfer_setup] python {sys.version.split()[0]}, torch {torch.__version__} "
      f"(CUDA {torch.version.cuda}), GPU "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
ninja = subprocess.run(["ninja", "--version"], capture_output=True, text=True).stdout
print(f"[flashinfer_setup] nvcc: {nvcc.strip().splitlines()[-1]}; ninja {ninja.strip()}")
print(f"[flashinfer_setup] flashinfer {flashinfer.__version__} from "
      f"{os.path.dirname(flashinfer.__file__)}; JIT cache {env.FLASHINFER_JIT_DIR}")
bad = []
if not os.path.realpath(flashinfer.__file__).startswith(os.path.realpath(src)):
    bad.append(f"another flashinfer shadows {src}")
for p in [env.FLASHINFER_INCLUDE_DIR / "flashinfer" / "attention" / "decode.cuh",
          env.FLASHINFER_CSRC_DIR / "batch_decode.cu",
          env.CUTLASS_INCLUDE_DIRS[0] / "cutlass" / "cutlass.h",
          env.CUTLASS_INCLUDE_DIRS[1], env.SPDLOG_INCLUDE_DIR / "spdlog" / "spdlog.h"]:
    if not p.exists():
        bad.append(f"missing {p}")
for msg in bad:
    print(f"[flashinfer_setup] ERROR: {msg}", file=sys.stderr)
sys.exit(1 if bad else 0)
PY
  then
    _fi_err "flashinfer import or layout check failed (see above)"
    return 1
  fi

  # -- 5. smoke test
  if [ "${FI_SMOKE:-1}" != 0 ]; then
    if ! PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
        "$py" -m paged_decode.bench.flashinfer_arm --smoke "${FI_SMOKE_DTYPE:-float16}"; then
      _fi_err "smoke test failed"
      return 1
    fi
  fi

  # -- 6. hand the JIT-built ops back (to carry as .carry/flashinfer/aot next time)
  if [ "${FI_EXPORT_JIT:-0}" = 1 ] && [ -n "${OUT:-}" ]; then
    local jit_ops ops
    jit_ops=$(find "$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer" -mindepth 2 -maxdepth 2 \
              -type d -name cached_ops 2>/dev/null | head -1)
    ops=$([ -n "$jit_ops" ] && cd "$jit_ops" && \
          find . -mindepth 2 -maxdepth 2 -name '*.so' | sed 's#^\./##')
    if [ -n "$ops" ]; then
      # shellcheck disable=SC2086
      tar -czf "$OUT/flashinfer_aot.tar.gz" -C "$jit_ops" $ops
      _fi_log "packed $(echo "$ops" | wc -w) JIT ops into \$OUT/flashinfer_aot.tar.gz" \
              "($(du -h "$OUT/flashinfer_aot.tar.gz" | cut -f1)); unpack it into .carry/flashinfer/aot/"
    else
      _fi_log "FI_EXPORT_JIT: no JIT-built ops to pack"
    fi
  fi
  _fi_log "ready in $(( $(date +%s) - t0 ))s; env in $fi_home/env.sh"
  return 0
}

_fi_main "$@"
_fi_rc=$?
unset -f _fi_main _fi_log _fi_err
if (return 0 2>/dev/null); then
  return $_fi_rc
fi
exit $_fi_rc
