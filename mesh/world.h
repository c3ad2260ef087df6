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

#include <mpi.h>

#include "base/device.h"
#include "base/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Initialises MPI (unless the program already did) and selects this rank's CUDA device.
 * Collective over all processes of the job. */
status_t world_init(int *argc, char ***argv);

/* Finalises MPI if world_init initialised it. */
void world_finalize(void);

int world_rank(void);
int world_size(void);
int world_local_rank(void);
MPI_Comm world_comm(void);

/* cuda:(local_rank % count) when CUDA devices are present, else the CPU. */
device_t world_device(void);

/* Agreement on an outcome: collective over comm. Returns STATUS_OK when every rank passed
 * OK; otherwise the status of the lowest failing rank, whose detail text (err_detail())
 * becomes this rank's detail text, prefixed with "rank R: " on other ranks. Use it wherever
 * only some ranks could detect a problem, so that all ranks stop together. */
status_t comm_agree(MPI_Comm comm, status_t st);

#ifdef __cplusplus
}
#endif

#endif
