#!/usr/bin/env bash
# meson setup DIR [OPTIONS...]; when nvcc is on the PATH, the CUDA sources compile through
# scripts/nvcc-deps (a machine file written into DIR names it), so that ninja learns which
# headers each CUDA object includes and rebuilds it when one changes. Meson releases before
# 1.4 (Debian 12 ships 1.0.1) do not ask nvcc for them.
set -euo pipefail
dir=$1
shift
native=()
if command -v nvcc >/dev/null; then
  mkdir -p "$dir"
  printf "[binaries]\ncuda = '%s'\n" "$(cd "$(dirname "$0")" && pwd)/nvcc-deps" >"$dir/nvcc-deps.ini"
  native=(--native-file "$dir/nvcc-deps.ini")
fi
exec meson setup "$dir" "${native[@]}" "$@"
