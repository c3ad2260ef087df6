#!/usr/bin/env bash
# For a GPU machine without apt or network: bundle the build and test dependencies here,
# unpack them there.
#   here:  scripts/device-deps.sh fetch          -> .deps/debs/*.deb   (git-ignored)
#   there: source scripts/device-deps.sh env     -> unpacks into .deps/root, exports paths
set -euo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
debs="$top/.deps/debs"
root="$top/.deps/root"

packages=(
  meson ninja-build pkg-config
  check libsubunit0 libsubunit-dev
  libyaml-0-2 libyaml-dev libcjson1 libcjson-dev zlib1g zlib1g-dev libxxhash0 libxxhash-dev
  libopenmpi-dev libopenmpi3 openmpi-bin openmpi-common
  libpmix2 libhwloc15 libevent-core-2.1-7 libevent-pthreads-2.1-7 libfabric1 libucx0
  libpsm2-2 libpsm-infinipath1 libibverbs1 librdmacm1 libnl-3-200 libnl-route-3-200
  libmunge2 libnuma1 libxnvctrl0 libltdl7
  libopenblas-dev libopenblas0 libopenblas0-pthread libopenblas-pthread-dev libgfortran5
)

case "${1:-}" in
  fetch)
    mkdir -p "$debs"
    (cd "$debs" && apt-get download "${packages[@]}")
    echo "device-deps: $(ls "$debs" | wc -l) packages in $debs"
    ;;
  env)
    if [ ! -d "$root/usr" ]; then
      mkdir -p "$root"
      for d in "$debs"/*.deb; do dpkg -x "$d" "$root"; done
      # links to absolute paths (zlib1g-dev's libz.so -> /lib/.../libz.so.1.2.13) name files
      # of the unpacked packages, which the machine itself may not have: point them there
      find "$root" -type l | while read -r l; do
        t=$(readlink "$l")
        case "$t" in /*) if [ -e "$root$t" ]; then ln -sfn "$root$t" "$l"; fi ;; esac
      done
    fi
    export PATH="$root/usr/bin:/usr/local/cuda/bin:$PATH"
    # dpkg -x does not run update-alternatives: point at OpenBLAS's own directory
    export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$root/usr/lib/x86_64-linux-gnu/openmpi/lib:$root/usr/lib/x86_64-linux-gnu/openblas-pthread:${LD_LIBRARY_PATH:-}"
    export PKG_CONFIG_PATH="$root/usr/lib/x86_64-linux-gnu/pkgconfig:$root/usr/share/pkgconfig:$root/usr/lib/x86_64-linux-gnu/openblas-pthread/pkgconfig"
    # the .pc files name /usr/...: make pkg-config prefix every path with the unpack root
    export PKG_CONFIG_SYSROOT_DIR="$root"
    export PYTHONPATH="$root/usr/lib/python3/dist-packages:${PYTHONPATH:-}"
    export OPAL_PREFIX="$root/usr"
    # the unpacked PMIx looks for its plugins where the machine's own PMIx keeps different
    # ones (undefined symbols when loaded): point it at its own
    export PMIX_MCA_mca_base_component_path="$root/usr/lib/x86_64-linux-gnu/pmix2/lib/pmix"
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    ;;
  *)
    echo "usage: scripts/device-deps.sh fetch | source scripts/device-deps.sh env" >&2
    exit 2
    ;;
esac
