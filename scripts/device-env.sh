# shellcheck shell=bash
# Sourced on a GPU machine by scripts/device-run.sh and scripts/device-session.sh: the build
# and test dependencies (from .deps/ when the machine lacks them; see scripts/device-deps.sh),
# NCCL with the CUDA toolkit or from the nvidia-nccl Python wheel, cuDNN's headers with the
# toolkit or from the nvidia-cudnn wheel (the library is loaded at run time, from the
# loader's path). Sets nccl_opt and cudnn_opt, the meson options they need.
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! pkg-config --exists check ompi-c openblas libcjson 2>/dev/null && [ -d "$top/.deps/debs" ]; then
  source "$top/scripts/device-deps.sh" env
  set +e # device-deps.sh sets -e for itself
fi
nccl_opt=()
if ! ls /usr/local/cuda/lib64/libnccl.so >/dev/null 2>&1; then
  wheel="$(python3 -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null)"
  if [ -n "$wheel" ]; then
    mkdir -p "$top/.deps/nccl/lib"
    ln -sfn "$wheel/include" "$top/.deps/nccl/include"
    ln -sf "$wheel"/lib/libnccl.so.* "$top/.deps/nccl/lib/"
    ln -sf "$(ls "$wheel"/lib/libnccl.so.* | head -1)" "$top/.deps/nccl/lib/libnccl.so"
    nccl_opt=(-Dnccl_dir="$top/.deps/nccl")
    export LD_LIBRARY_PATH="$top/.deps/nccl/lib:${LD_LIBRARY_PATH:-}"
  fi
fi
cudnn_opt=()
if ! ls /usr/local/cuda/include/cudnn_graph.h >/dev/null 2>&1; then
  wheel="$(python3 -c 'import nvidia.cudnn, os; print(list(nvidia.cudnn.__path__)[0])' 2>/dev/null)"
  if [ -n "$wheel" ] && [ -f "$wheel/include/cudnn_graph.h" ]; then
    cudnn_opt=(-Dcudnn_dir="$wheel")
    export LD_LIBRARY_PATH="$wheel/lib:${LD_LIBRARY_PATH:-}"
  fi
fi
