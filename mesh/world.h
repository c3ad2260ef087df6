/*
 * The world: MPI start-up, this rank's place in it and its default device.
 *
 *   int main(int argc, char **argv) {
 *     if (world_init(&argc, &argv) != STATUS_OK) return 1;
 *     ... world_rank(), world_size(), world_device() ...
 *     world_finalize();
 *   }
 *
 * A program started without mpirun is a world of size 1 (MPI singleton). The CUDA device of
 * a rank is local_rank % device_count, where the local rank comes from
 * OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID or, failing both, a shared-memory split.
 */
#ifndef FSDPC_MESH_WORLD_H
#define FSDPC_MESH_WORLD_H

#include <stdbool.h>

#include "core/device.h"
#include "core/status.h"
#include "mesh/pg.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* Initialises MPI (unless the program already did) and selects this rank's CUDA device.
 * Collective over all processes of the job. A bad FSDPC_PG is refused with the world up
 * (world_pg() not NULL), the same on every rank, so that the ranks can report it together. */
fsdpc_status_t world_init(int *argc, char ***argv);

/* world_init for a program: false when it failed, its message then printed (once for every
 * rank, as world_agree_report prints, when the world came up far enough to agree) and the
 * world finished. prog names the program in the message. */
bool world_start(int *argc, char ***argv, const char *prog);

/* Finalises MPI if world_init initialised it. In a build with AddressSanitizer, LeakSanitizer's
 * check runs here, before MPI_Finalize, instead of at exit (memory still reachable is no leak;
 * allocations dropped after this call are not checked). */
void world_finalize(void);

int world_rank(void);
int world_size(void);
/* world_size() once MPI runs, 0 before world_init or after world_finalize. */
int world_started_size(void);
int world_local_rank(void);
/* Fails when the environment says this process was started as one of several (torchrun's
 * WORLD_SIZE, the tasks of a Slurm step, SLURM_STEP_NUM_TASKS) but it is alone in its MPI
 * world: N processes that would each train alone, overwriting each other's files. The error
 * says how to launch. */
fsdpc_status_t world_check_launch(void);

/* A planning world: from here on this process plans as rank 0 of a world of n ranks,
 * ranks_per_node of them on each node: world_size() says n and world_local_size()
 * ranks_per_node (at most n). The groups of meshes made over it have that world's sizes and
 * rank 0's places; they move no data (a collective on one fails, saying so), and their
 * agreements and small host values act as if every rank brought this one's. For planning a
 * job larger than the one running (fsdp-train --dry-run --world N). Call it after world_init,
 * in a world of one process, before any mesh is made. Local. */
fsdpc_status_t world_plan_as(int n, int ranks_per_node);
/* Whether world_plan_as made this a planning world. */
bool world_planning(void);

/* The number of ranks on this node (1 before world_init). */
int world_local_size(void);

/* The CPUs this rank has: those it may run on (its launcher's binding; 1 if unknown), the
 * node's online CPUs (0 if unknown), the node's ranks, and this rank's share of the node's
 * CPUs (min(mine, online / ranks), at least 1). Local. */
typedef struct world_cpus {
  int mine;
  long online;
  int local_ranks;
  int share;
} world_cpus_t;
world_cpus_t world_cpus(void);
/* A host group of every rank of the world (for agreements, counts and small host values: the
 * checkpoint functions take it), owned by the world: pg_retain it to keep it past
 * world_finalize. NULL before world_init. */
pg_t *world_pg(void);

/* cuda:(local_rank % count) when CUDA devices are present, else the CPU. */
device_t world_device(void);

/* device_choose_node (core/device.h) over each node's ranks, agreed over the world: each rank
 * takes its local rank modulo the devices it sees, the ranks of a node compare the UUIDs they
 * would take, and when one rank fails (cuda asked for where a rank sees none or two would
 * share one) every rank fails with its message ("rank R: ..."); under auto, every rank takes
 * the CPU when any rank would. *out: the CUDA device this rank takes, else the CPU; why as
 * device_choose_node's, or saying that another node fell short. On CUDA, rank 0's
 * world_device_assignment() then says which device each rank took. Collective over the
 * world. */
fsdpc_status_t world_choose_device(device_want_t want, device_t *out, char *why, size_t why_size);

/* Rank 0's line of the devices the last world_choose_device gave each rank ("rank 0 cuda:0
 * GPU-1a2b3c4d, ..." up to 8 ranks, else the counts of ranks, devices and nodes); "" elsewhere,
 * before a choice and when the choice was the CPU. */
const char *world_device_assignment(void);

/* What a rank sees of the CUDA devices, as world_choose_device reads it: the count and the
 * UUID of the one it would take (local_rank modulo the count). */
typedef fsdpc_status_t (*world_devices_fn)(int local_rank, device_seen_t *out);

/* Replaces what world_choose_device reads of the devices (NULL: the devices this process
 * sees), so that tests play a node's layouts on any machine. */
void world_set_devices_seen(world_devices_fn fn);

/* Ends a phase of a program: every rank learns whether any rank failed (returns true when
 * none did). Then rank 0 prints each distinct failure message once, naming the ranks that
 * gave it: "PROG: [rank 2] MESSAGE", "PROG: [ranks 0-3] MESSAGE" or "[ranks 0,2]", and the
 * ranks that did not fail as "PROG: [ranks 1,3] stopping: another rank failed". When the
 * agreement itself fails (a stopped job, the watchdog) every failing rank prints its own
 * message in the same form. Collective over the world. */
bool world_agree_report(fsdpc_status_t st, const char *prog);

/* ---- stopping a job that would hang ----
 *
 * When a rank finds that the others will never join a collective it waits for (only some
 * ranks took a collective path), it stops the job with world_stop(): every rank's library
 * waits (MPI collectives, agreements) then fail with that rank's message instead of hanging,
 * and so does every later wait. Each rank reports the error itself and exits non-zero. The
 * channel exists once world_init has run. Host waits for device work poll (core/device.h):
 * world_init sets their hook, which ends them once the job is stopped, aborting the NCCL
 * communicators first so that a device collective a rank will never join ends too. */

/* The watchdog: a library wait (a collective, an agreement) that has not completed within
 * this many seconds stops the job, naming the wait, on the rank that waited (and, through the
 * stop channel, every rank waiting in the library); 0 waits forever. Default
 * WORLD_DEFAULT_TIMEOUT_S (10 minutes, as PyTorch's process groups). Per process; set it on
 * every rank. It covers host waits for device work too (a stream behind an NCCL collective),
 * with the NCCL communicators aborted. */
#define WORLD_DEFAULT_TIMEOUT_S 600.0
/* Refuses a negative or NaN count (left as it was: read as 0 it would wait forever). */
fsdpc_status_t world_set_timeout(double seconds);
double world_timeout(void);

/* Records err_detail() as the reason, sends it to every other rank and returns st with the
 * detail unchanged. Later waits on this rank fail with the same reason. */
fsdpc_status_t world_stop(fsdpc_status_t st);

/* STATUS_OK, or the stop's error once this rank stopped the job or learnt of another rank's
 * stop (collectives check it before they start). */
fsdpc_status_t world_check(void);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
