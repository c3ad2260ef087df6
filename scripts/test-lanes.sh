#!/usr/bin/env bash
# Every test of a build (what `meson test` runs), split over LANES meson processes that run at
# the same time, for a machine with the cores for it (a GPU machine's 16): meson runs its
# multi-rank tests one at a time, so one process leaves most of such a machine idle.
#   bash scripts/test-lanes.sh BUILD_DIR [LANES]     (LANES default 4)
# Tests go to the lane with the least work so far, heaviest first, by a rough weight (seconds
# on a 16-core GPU machine: the plans drivers 40, plans-operations 100, the GPU suites 15, the
# CUDA emulator's 40, the rest 3). slurm, whose job must reach a step before its time limit's warning, runs after the
# lanes, alone (beside another lane on 2 cores it missed its step). Each lane's log is
# BUILD_DIR/meson-logs/laneN.txt and its output laneN.out (the solo run's laneS); the outputs
# are printed lane by lane, then the counts of all lanes together. The exit status is 0 when
# every lane passed.
set -uo pipefail
build=${1:?usage: test-lanes.sh BUILD_DIR [LANES]}
lanes=${2:-4}
case "$lanes" in
  '' | *[!0-9]* | 0)
    echo "test-lanes: LANES must be a positive number, not '$lanes'" >&2
    exit 2
    ;;
esac
names=$(meson test -C "$build" --no-rebuild --list 2>/dev/null | sed -n 's/^.* \/ //p')
if [ -z "$names" ]; then
  echo "test-lanes: no tests listed in $build (is it a configured build with tests?)" >&2
  exit 2
fi

weight() {
  case "$1" in
    plans-operations) echo 100 ;;
    plans-*) echo 40 ;;
    *gpu*) echo 15 ;;
    *cuda-emu*) echo 40 ;;
    *) echo 3 ;;
  esac
}

solo=""
for n in $names; do
  case "$n" in slurm) solo+=" $n" ;; esac
done
declare -a load members
for ((i = 0; i < lanes; i++)); do
  load[i]=0
  members[i]=""
done
while read -r w name; do
  best=0
  for ((i = 1; i < lanes; i++)); do
    [ "${load[i]}" -lt "${load[best]}" ] && best=$i
  done
  load[best]=$((load[best] + w))
  members[best]+=" $name"
done < <(for n in $names; do
  case " $solo " in *" $n "*) ;; *) echo "$(weight "$n") $n" ;; esac
done | sort -k1,1nr -k2,2)

mkdir -p "$build/meson-logs"
pids=()
for ((i = 0; i < lanes; i++)); do
  [ -z "${members[i]}" ] && continue
  # shellcheck disable=SC2086 # the members are test names, one word each
  meson test -C "$build" --no-rebuild --print-errorlogs --logbase "lane$i" ${members[i]} \
    >"$build/meson-logs/lane$i.out" 2>&1 &
  pids[i]=$!
done
failed=0
for i in "${!pids[@]}"; do
  wait "${pids[i]}" || failed=1
  echo "=== lane $i (weight ${load[i]}):${members[i]}"
  cat "$build/meson-logs/lane$i.out"
done
outs=()
for i in "${!pids[@]}"; do outs+=("$build/meson-logs/lane$i.out"); done
if [ -n "$solo" ]; then
  # shellcheck disable=SC2086 # test names, one word each
  meson test -C "$build" --no-rebuild --print-errorlogs --logbase laneS $solo \
    >"$build/meson-logs/laneS.out" 2>&1 || failed=1
  echo "=== alone:$solo"
  cat "$build/meson-logs/laneS.out"
  outs+=("$build/meson-logs/laneS.out")
fi
echo "=== all lanes"
cat "${outs[@]}" | awk -F: '/^(Ok|Expected Fail|Fail|Unexpected Pass|Skipped|Timeout): / {
    gsub(/ /, "", $2); n[$1] += $2; if (!($1 in seen)) { seen[$1] = 1; order[++k] = $1 } }
  END { for (j = 1; j <= k; j++) printf "%-16s %d\n", order[j] ":", n[order[j]] }'
exit "$failed"
