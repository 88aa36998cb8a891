#!/usr/bin/env bash
# On the CPU machine (it reaches PyPI; the GPU machine does not): download FlashInfer 0.6's
# wheel and the one import-time dependency the GPU image lacks (apache-tvm-ffi, for its
# Python 3.12) into .carry/flashinfer06/, about 21.7 MB, for
# bench/device/flashinfer06_setup.sh. The GPU image already holds FlashInfer 0.6's other
# import-time needs (nvidia-ml-py, requests, tqdm, ninja, torch; KINDS.md's package list);
# its optional stacks (cutlass-dsl, cudnn-frontend, nccl4py, cuda-tile) are not needed by
# the XQA decode and are not fetched.
set -eu
dest=${1:-.carry/flashinfer06}
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform any -d "$dest" \
  "flashinfer-python==0.6.18.post1" "apache-tvm-ffi==0.1.15.post2"
ls -la "$dest"
