#!/usr/bin/env bash
# Sets up, builds and runs every test suite.
#   scripts/test.sh              release-style build in build/
#   scripts/test.sh --sanitize   ASan+UBSan build in build-san/ (CPU only)
# Extra arguments after the options go to `meson test` (e.g. a test name).
set -euo pipefail
cd "$(dirname "$0")/.."

sanitize=0
if [ "${1:-}" = "--sanitize" ]; then sanitize=1; shift; fi

scripts/setup.sh
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

if [ $sanitize -eq 1 ]; then
  dir=build-san
  # -O1: what the sanitizers' authors recommend; several times faster than -O0
  opts=(-Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled -Dbuildtype=debug
        -Doptimization=1)
else
  dir=build
  opts=()
fi
# CI treats every compiler warning as an error; a user's build does not
if [ -n "${CI:-}" ]; then opts+=(-Dwerror=true); fi
if [ ! -f "$dir/build.ninja" ]; then
  scripts/meson-setup.sh "$dir" "${opts[@]}"
fi
ninja -C "$dir"
meson test -C "$dir" --print-errorlogs --num-processes 2 "$@"
