#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz with clang (ASan+UBSan) in build-fuzz/ and runs
# each for RUNS inputs (default 1000000), starting from the seeds in tests/fuzz/seeds/ (and, for
# the plan parser, the shipped configs). Exits non-zero on a finding (the crashing input is
# left in build-fuzz/). Without clang it says so and exits 0.
#   scripts/fuzz.sh [RUNS] [plan|safetensors|dcp]...
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-1000000}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then targets=(plan safetensors dcp); fi
if ! command -v clang >/dev/null; then
  echo "fuzz: clang not installed; the harnesses are not built"
  exit 0
fi
scripts/setup.sh
if [ ! -f build-fuzz/build.ninja ]; then
  CC=clang meson setup build-fuzz -Dfuzz=true -Dtests=false -Dcuda=disabled \
    -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debug -Doptimization=1 >/dev/null
fi
ninja -C build-fuzz tests/fuzz/fuzz_plan tests/fuzz/fuzz_safetensors tests/fuzz/fuzz_dcp >/dev/null
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0" UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
for t in "${targets[@]}"; do
  corpus="build-fuzz/corpus/$t"
  mkdir -p "$corpus"
  seeds=(tests/fuzz/seeds/"$t")
  if [ "$t" = plan ]; then seeds+=(configs); fi
  extra=()
  if [ "$t" = plan ]; then extra=(-dict=tests/fuzz/plan.dict); fi
  log="build-fuzz/fuzz-$t.log"
  if ! (cd build-fuzz && "./tests/fuzz/fuzz_$t" -runs="$runs" -max_len=65536 -timeout=10 \
        "${extra[@]/#-dict=/-dict=../}" "../$corpus" "${seeds[@]/#/../}") >"$log" 2>&1; then
    tail -40 "$log"
    echo "fuzz: $t: a finding (log: $log)"
    exit 1
  fi
  echo "fuzz: $t: $(grep -o 'Done [0-9]* runs in [0-9]* second(s)' "$log" | tail -1), no finding"
done
