#!/usr/bin/env bash
# A GPU machine's work in one command: build with CUDA (scripts/device-run.sh), then the named
# stages in order, each under its own time limit and all under one budget, each one's output
# kept in $OUT/STAGE.log (OUT defaults to /tmp/fsdpc-session), then a summary of what ran.
#   bash scripts/device-session.sh [STAGE]...      default: suites multi compare fsdp-step
# Stages:
#   suites        the GPU suites (meson test --suite gpu) but the multi-rank ones
#   multi         the multi-rank GPU tests (on as many GPUs through NCCL, else sharing the GPU
#                 through the host-staged groups, FSDPC_PG=staged-lazy: FSDP, HSDP 2x2,
#                 FSDP 2 x TP 2 and 2x2x2 against one CPU rank), then fsdp-train on 2 ranks
#                 the same way
#   compare       bench/vs_torch_gpu.py on configs/llama-100m.json, 8 x 1024, bf16/f32: torch
#                 FSDP2, eager under autocast and FSDP2 with each layer compiled beside
#                 fsdp-train, with its kernel profile (then attention and the matrix products)
#   compare-0.9b  on configs/llama-0.9b.json, torch FSDP2 and FSDP2 + compile, no profile
#   offload-0.9b  the same with the sharded state on the host on both sides (torch's
#                 CPUOffloadPolicy), fewer steps
#   profile-0.9b  fsdp-train alone on configs/llama-0.9b.json with its kernel profile
#   compare-qwen3 on configs/qwen3-0.6b.json (head_dim 128, q/k norms, a 151936 vocabulary),
#                 torch FSDP2 and FSDP2 + compile
#   moe           fsdp-train alone on configs/qwen3-moe-1.3b.json (64 experts, top-8) with its
#                 kernel profile, then again with the experts' products one by one
#                 (FSDPC_GROUPED_GEMM=0) against one grouped cuBLAS call a product kind
#   reference     tests/reference's torch models against transformers (on the CPU)
#   vs-llmc       bench/vs_llmc_gpu.py: GPT-2 124M against llm.c's train_gpt2cu, 16 x 1024, when
#                 .deps/llm.c holds an llm.c checkout (with .deps/cudnn-frontend, cuDNN on),
#                 then fsdp-train's kernel table and the model's matrix products
#   tests         every suite (meson test), in 4 lanes at once (scripts/test-lanes.sh): one
#                 meson process ran them in ~840 s on a 16-core H200 machine, more than a call
#   fsdp-step     bench-fsdp-step on llama-100m at 8 x 1024, bf16 (with the host's time a
#                 unit and a parameter)
# SESSION_BUDGET_S (default 570) bounds the whole command: a stage that could not end in what
# is left is skipped and said to be. The exit status is 1 when a stage failed or was stopped.
# PYTHON is the interpreter with torch (default /opt/torch/.venv/bin/python, else python3).
# Needs .deps/ from `scripts/device-deps.sh fetch` where the machine lacks the build
# dependencies.
set -uo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$top" || exit 1
start=$(date +%s)
budget=${SESSION_BUDGET_S:-570}
out=${OUT:-/tmp/fsdpc-session}
mkdir -p "$out"
python=${PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$python" ] || python=python3
export PYTHONUNBUFFERED=1
if [ $# -eq 0 ]; then set -- suites multi compare fsdp-step; fi
for s in "$@"; do
  case "$s" in
    suites | multi | compare | compare-0.9b | offload-0.9b | profile-0.9b | compare-qwen3 | \
      moe | reference | vs-llmc | tests | fsdp-step) ;;
    *)
      echo "device-session: unknown stage '$s' (suites, multi, compare, compare-0.9b," \
        "offload-0.9b, profile-0.9b, compare-qwen3, moe, reference, vs-llmc, tests," \
        "fsdp-step)" >&2
      exit 2
      ;;
  esac
done
if ! nvidia-smi >/dev/null 2>&1; then
  echo "device-session: no GPU here (nvidia-smi fails): nothing to do"
  exit 0
fi
source scripts/device-env.sh # the stages need the build's libraries and tools too
set -uo pipefail

summary=()
failed=0
# run NAME LIMIT_S COMMAND...: the command under its limit, or skipped when the budget is short
run() {
  local name=$1 limit=$2
  shift 2
  local left=$((budget - ($(date +%s) - start)))
  if [ "$left" -lt 30 ]; then
    summary+=("$name: skipped (${left} s of the budget left)")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0
  t0=$(date +%s)
  echo "=== $name (limit ${limit} s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  local note="rc $rc"
  [ "$rc" -eq 124 ] && note="stopped at its limit of ${limit} s"
  [ "$rc" -ne 0 ] && failed=1
  summary+=("$name: $note after $(($(date +%s) - t0)) s ($out/$name.log)")
}

run build 300 bash scripts/device-run.sh --build-only
if [ ! -x build-gpu/tools/fsdp-train ]; then
  printf '%s\n' "${summary[@]}"
  exit 1
fi
vs=(bench/vs_torch_gpu.py --exe build-gpu/tools/fsdp-train --python "$python")
for s in "$@"; do
  case "$s" in
    suites)
      run suites 240 meson test -C build-gpu --suite gpu --print-errorlogs \
        --no-suite fsdpc:gpu-multi
      ;;
    multi)
      run multi 200 meson test -C build-gpu --suite gpu-multi --print-errorlogs
      run multi-train 120 tests/gpu/multi_rank.sh mpirun 2 build-gpu/tools/fsdp-train \
        configs/fsdp.yaml --set mesh.dp_shard=2 --set train.device=cuda --set train.steps=20
      ;;
    compare) run compare 300 "$python" "${vs[@]}" --profile --torch-eager --torch-compile ;;
    compare-0.9b)
      run compare-0.9b 300 "$python" "${vs[@]}" --config configs/llama-0.9b.json --torch-compile \
        --steps 20
      ;;
    offload-0.9b)
      run offload-0.9b 300 "$python" "${vs[@]}" --config configs/llama-0.9b.json --offload \
        --steps 8 --warmup 3
      ;;
    profile-0.9b) # no torch to run beside it: fsdp-train's figures and kernel table alone
      run profile-0.9b 120 "$python" bench/vs_torch_gpu.py --exe build-gpu/tools/fsdp-train \
        --python /bin/false --config configs/llama-0.9b.json --profile --steps 10 --warmup 3
      ;;
    compare-qwen3)
      run compare-qwen3 300 "$python" "${vs[@]}" --config configs/qwen3-0.6b.json --torch-compile \
        --steps 20
      ;;
    moe) # fsdpc alone (torch's reference model loops over the experts)
      run moe 240 "$python" bench/vs_torch_gpu.py --exe build-gpu/tools/fsdp-train \
        --python /bin/false --config configs/qwen3-moe-1.3b.json --profile --steps 8 --warmup 3 \
        --also-env FSDPC_GROUPED_GEMM=0
      ;;
    reference) run reference 120 "$python" tests/reference/check_transformers.py ;;
    vs-llmc)
      fe=()
      [ -d .deps/cudnn-frontend ] && fe=(--cudnn-frontend .deps/cudnn-frontend)
      run vs-llmc 400 "$python" bench/vs_llmc_gpu.py --exe build-gpu/tools/fsdp-train \
        --llmc .deps/llm.c --profile "${fe[@]}"
      ;;
    tests) run tests 540 bash scripts/test-lanes.sh build-gpu 4 ;;
    fsdp-step) # then without the joint unshard, for the hooks' host time either way
      step=(build-gpu/bench/bench-fsdp-step --device cuda --param-dtype bf16
        --config configs/llama-100m.json --batch 8 --seq 1024 --steps 3)
      run fsdp-step 90 "${step[@]}"
      run fsdp-step-separate 90 env FSDPC_FSDP_JOINT_UNSHARD=0 "${step[@]}"
      ;;
  esac
done
for f in build-gpu/meson-logs/testlog.txt build-gpu/meson-logs/lane*.txt; do
  [ -f "$f" ] && cp "$f" "$out/"
done
echo "=== summary ($(($(date +%s) - start)) s of a ${budget} s budget)"
printf '%s\n' "${summary[@]}"
exit "$failed"
