#!/usr/bin/env bash
# Sets up, builds and runs the main job: fully-sharded training of the tiny Llama on 4 ranks
# with fsdp-train (configs/fsdp.yaml, the loss goes down), the 4-rank DTensor demo on a 2x2
# mesh, an MLP of your own trained under a YAML plan (tensor parallelism x fully_shard), a
# single-process training benchmark, and fully-sharded step benchmarks of a small Llama on 4
# ranks (communication, memory and time per step).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
[ -f build/build.ninja ] || scripts/meson-setup.sh build
ninja -C build
mpirun --oversubscribe --bind-to none -n 4 build/tools/fsdp-train configs/fsdp.yaml
mpirun --oversubscribe --bind-to none -n 4 build/tools/fsdp-demo
mpirun --oversubscribe --bind-to none -n 4 build/examples/mlp-plan examples/mlp_tp.yaml
build/bench/bench-train-tiny --steps 100
mpirun --oversubscribe --bind-to none -n 4 build/bench/bench-fsdp-step --steps 3
