#!/usr/bin/env bash
# Runs a GPU test on N ranks: on N GPUs through NCCL where the machine has that many, else on
# the GPUs it has through the host-staged process groups in their lazy test mode
# (FSDPC_PG=staged-lazy: several ranks may share a GPU). Exits 77 (skip) without a GPU.
#   multi_rank.sh MPIRUN N PROGRAM [ARGS]...
set -uo pipefail
mpirun=$1 n=$2
shift 2
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [ "${gpus:-0}" -lt 1 ]; then
  echo "no GPU: skipped"
  exit 77
fi
pg=native
if [ "$gpus" -lt "$n" ]; then pg=staged-lazy; fi
echo "$n ranks on $gpus GPU(s): process groups $pg"
exec "$mpirun" --oversubscribe --bind-to none -x FSDPC_PG=$pg -n "$n" "$@"
