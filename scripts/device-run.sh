#!/usr/bin/env bash
# On a GPU machine: build with CUDA and run the GPU test suites (and any extra commands).
#   bash scripts/device-run.sh [meson test arguments...]     default: --suite gpu
#   bash scripts/device-run.sh --build-only                  build, run nothing
# Needs .deps/ from `scripts/device-deps.sh fetch` when the machine lacks the build deps.
set -uo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$top" || exit 1
source scripts/device-env.sh
set -uo pipefail
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ ! -f build-gpu/build.ninja ]; then
  meson setup build-gpu -Dcuda=enabled "${nccl_opt[@]}" "${cudnn_opt[@]}" >build-gpu.log 2>&1 ||
    { cat build-gpu.log; exit 1; }
fi
ninja -C build-gpu >>build-gpu.log 2>&1 || { tail -60 build-gpu.log; exit 1; }
if [ "${1:-}" = --build-only ]; then exit 0; fi
if [ $# -eq 0 ]; then set -- --suite gpu; fi
meson test -C build-gpu --print-errorlogs "$@"
