#!/usr/bin/env bash
# Installs what the project needs to build and test from Debian's archive.
# Idempotent: when every package is already installed it only checks and returns.
set -euo pipefail

packages=(
  build-essential meson ninja-build pkg-config
  check libyaml-dev libcjson-dev zlib1g-dev libxxhash-dev
  libopenmpi-dev openmpi-bin
  libopenblas-dev
  librsvg2-bin  # tests: fsdp-plot's SVG rendered by a real renderer
)
# the one-node Slurm test (tests/slurm): in CI, or where FSDPC_SLURM=1 asks for it (the packages
# bring system services, munge's among them, that a workstation may not want)
if [ -n "${CI:-}" ] || [ "${FSDPC_SLURM:-}" = 1 ]; then
  packages+=(slurmctld slurmd slurm-client munge)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
