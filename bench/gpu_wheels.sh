#!/usr/bin/env bash
# The wheels a GPU machine without a registry needs for bench/run_gpu.sh, into .whl/ (git-ignored):
#
#   bash bench/gpu_wheels.sh            # liger-kernel (the loss's peer) and TRL's step (trl ...)
#   bash bench/gpu_wheels.sh --peers    # liger-kernel alone (the loss benchmarks, ~1 MB)
#
# Run it where a registry is reachable, then carry `.whl` to the GPU machine (the device tool's
# `carry`); run_gpu.sh installs them into /tmp/site. Pinned to what pyproject's extras and the
# last GPU runs used, for the image's Python 3.12; nothing the image already has (torch, triton,
# transformers, accelerate, pyarrow, ...) and never torch, triton or nvidia-* wheels. The lot is
# about 3 MB: well inside the 64 MiB a call may carry.
set -euo pipefail
cd "$(dirname "$0")/.."

PEERS=(liger-kernel==0.8.5)
TRL_STEP=(trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
case "${1:-}" in
  "") WANTED=("${PEERS[@]}" "${TRL_STEP[@]}") ;;
  --peers) WANTED=("${PEERS[@]}") ;;
  *) echo "gpu_wheels.sh: unknown option '$1' (none, or --peers)" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
mkdir -p .whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${WANTED[@]}"
ls -l .whl
du -sh .whl
