/*
 * fsdp-train: trains a built-in architecture (Llama, Qwen2, Qwen3, GPT-2: the plan's model
 * section) under a YAML parallelism plan.
 *
 *   mpirun -n 4 fsdp-train configs/fsdp.yaml [--set key.path=value]... [--metrics PATH]
 *       [--plot OUT.svg] [--dry-run [-v] [--world N [--ranks-per-node M]]]
 *
 * Prints a header (world, mesh, plan, parameters, per-rank sharded bytes), a line per logged
 * step and a summary; --metrics (or log.metrics) writes one JSON object per step from rank 0,
 * and --plot draws that file as SVG at the end (as fsdp-plot does).
 * --dry-run builds the sharded model meta (no parameter memory) and prints placements, shapes,
 * the peak memory of a step and its communication without training; -v adds a table of the
 * fully_shard units. Bad input is reported by every rank, with a non-zero exit. The run is
 * the library's trainer (train/trainer.h), which trains a program's own model the same way.
 */
#include "train/trainer.h"

int main(int argc, char **argv) { return train_main(argc, argv, "fsdp-train", NULL); }
