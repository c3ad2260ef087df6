#!/usr/bin/env bash
# On a GPU machine: build with CUDA and run the GPU test suites (and any extra commands).
#   bash scripts/device-run.sh [meson test arguments...]     default: --suite gpu
# Needs .deps/ from `scripts/device-deps.sh fetch` when the machine lacks the build deps.
set -uo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$top"
if ! pkg-config --exists check ompi-c openblas libcjson 2>/dev/null && [ -d .deps/debs ]; then
  source scripts/device-deps.sh env
fi
# NCCL: with the CUDA toolkit, or from the nvidia-nccl Python wheel
nccl_opt=()
if ! ls /usr/local/cuda/lib64/libnccl.so >/dev/null 2>&1; then
  wheel="$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)"
  if [ -n "$wheel" ]; then
    mkdir -p .deps/nccl/lib
    ln -sf "$wheel/include" .deps/nccl/include
    ln -sf "$wheel"/lib/libnccl.so.* .deps/nccl/lib/
    ln -sf "$(ls "$wheel"/lib/libnccl.so.* | head -1)" .deps/nccl/lib/libnccl.so
    nccl_opt=(-Dnccl_dir="$top/.deps/nccl")
    export LD_LIBRARY_PATH="$top/.deps/nccl/lib:${LD_LIBRARY_PATH:-}"
  fi
fi
# cuDNN's headers (fused attention): with the CUDA toolkit, or from the nvidia-cudnn wheel; the
# library is loaded at run time, from the loader's path
cudnn_opt=()
if ! ls /usr/local/cuda/include/cudnn_graph.h >/dev/null 2>&1; then
  wheel="$(python3 -c 'import nvidia.cudnn, os; print(list(nvidia.cudnn.__path__)[0])' 2>/dev/null)"
  if [ -n "$wheel" ] && [ -f "$wheel/include/cudnn_graph.h" ]; then
    cudnn_opt=(-Dcudnn_dir="$wheel")
    export LD_LIBRARY_PATH="$wheel/lib:${LD_LIBRARY_PATH:-}"
  fi
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ ! -f build-gpu/build.ninja ]; then
  meson setup build-gpu -Dcuda=enabled "${nccl_opt[@]}" "${cudnn_opt[@]}" >build-gpu.log 2>&1 ||
    { cat build-gpu.log; exit 1; }
fi
ninja -C build-gpu >>build-gpu.log 2>&1 || { tail -60 build-gpu.log; exit 1; }
if [ $# -eq 0 ]; then set -- --suite gpu; fi
meson test -C build-gpu --print-errorlogs "$@"
