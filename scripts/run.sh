#!/usr/bin/env bash
# Sets up, builds and runs the main job: the 4-rank DTensor demo on a 2x2 mesh, then a
# single-process training run of the tiny Llama on the bundled corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
[ -f build/build.ninja ] || meson setup build
ninja -C build
mpirun --oversubscribe --bind-to none -n 4 build/tools/fsdp-demo
build/bench/bench-train-tiny --steps 200
