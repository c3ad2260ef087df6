/*
 * Private to mesh/: the MPI side of the world. Every wait of the library goes through
 * world_wait, which fails with the stopping rank's message once the job is stopped and stops
 * the job when the watchdog expires.
 */
#ifndef FSDPC_MESH_WORLD_IMPL_H
#define FSDPC_MESH_WORLD_IMPL_H

#include <mpi.h>
#include <stdbool.h>

#include "mesh/world.h"

/* Completes req (an MPI request of any kind); fails with the stopping rank's message if the
 * job is stopped first or was stopped already. */
fsdpc_status_t world_wait(MPI_Request *req, const char *what);

/* world_wait with a limit: *timed_out (then STATUS_OK is returned and req left pending)
 * when req has not completed within seconds. */
fsdpc_status_t world_wait_for(MPI_Request *req, double seconds, const char *what, bool *timed_out);

/* pg_agree over an MPI communicator. */
fsdpc_status_t comm_agree(MPI_Comm comm, fsdpc_status_t st);

#endif
