/*
 * Private to mesh/: the interface table between pg.c and its backends (pg_mpi.c, pg_nccl.c)
 * and the MPI side of groups. pg.c checks arguments and keeps the counters; a backend only
 * moves data.
 */
#ifndef FSDPC_MESH_PG_IMPL_H
#define FSDPC_MESH_PG_IMPL_H

#include <mpi.h>

#include "mesh/pg.h"

/* An MPI group over the ranks of comm (duplicated; the caller keeps comm). Collective over
 * comm. */
fsdpc_status_t pg_new_mpi(MPI_Comm comm, pg_t **out);
/* An NCCL group over the ranks of comm using CUDA device `device` on this rank (the NCCL id
 * travels over comm). Collective over comm. STATUS_ENODEV without CUDA support or device. */
fsdpc_status_t pg_new_nccl(MPI_Comm comm, int device, pg_t **out);
/* A host-staged group (mesh/pg_staged.c) for buffers on dev; lazy: its test mode. Collective
 * over comm. */
fsdpc_status_t pg_new_staged(MPI_Comm comm, device_t dev, bool lazy, pg_t **out);
/* The group a mesh makes for buffers on dev: pg_device_backend()'s choice. */
fsdpc_status_t pg_new_for(MPI_Comm comm, device_t dev, pg_t **out);

typedef struct pg_ops {
  const char *name;
  fsdpc_status_t (*all_gather)(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                               pg_work_t **work);
  fsdpc_status_t (*reduce_scatter)(pg_t *pg, const void *send, void *recv, size_t recv_count,
                                   dtype_t dt, reduce_op_t op, pg_work_t **work);
  fsdpc_status_t (*all_reduce)(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                               reduce_op_t op, pg_work_t **work);
  fsdpc_status_t (*all_to_all)(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                               pg_work_t **work);
  /* send_counts and recv_counts: size entries each; the callee copies what it keeps */
  fsdpc_status_t (*all_to_all_v)(pg_t *pg, const void *send, const size_t *send_counts, void *recv,
                                 const size_t *recv_counts, dtype_t dt, pg_work_t **work);
  fsdpc_status_t (*broadcast)(pg_t *pg, void *buf, size_t count, dtype_t dt, int root,
                              pg_work_t **work);
  /* ops checked by pg.c; the callee copies what it keeps */
  fsdpc_status_t (*send_recv)(pg_t *pg, const pg_p2p_t *ops, int n, dtype_t dt, pg_work_t **work);
  fsdpc_status_t (*barrier)(pg_t *pg, pg_work_t **work);
  void (*destroy)(pg_t *pg);
  /* optional: the group of pg's ranks that gave the same color, ordered by key, made from
   * pg's own communicator; sub is its MPI side (MPI_Comm_split of pg->comm with the same
   * color and key; the caller keeps it). Collective over pg. Without it a split makes a new
   * group over sub. */
  fsdpc_status_t (*split)(pg_t *pg, MPI_Comm sub, int color, int key, pg_t **out);
} pg_ops_t;

struct pg {
  const pg_ops_t *ops;
  int refcount;
  int rank;
  int size;
  device_t device;
  MPI_Comm comm; /* a duplicate owned by the group, errors returned, not fatal */
  pg_counters_t counters;
  void *impl; /* backend state */
  struct pg_kept *kept; /* groups made from this one and kept with it (pg_side_channel,
                          * pg_consecutive); released with it */
  bool planned; /* a group of a planning world (world_plan_as): rank and size planned, comm this
                 * process alone; host values act as if every rank brought this one's */
  int64_t calls; /* the collectives called on it (FSDPC_CHECK_COLLECTIVES numbers them) */
};

typedef struct pg_kept {
  int n; /* 0: the side channel; N > 0: pg_consecutive(pg, N) */
  pg_t *g;
  struct pg_kept *next;
} pg_kept_t;

/* Every backend's handle starts with this header; pg_wait calls complete(), which also
 * frees the handle. */
struct pg_work {
  fsdpc_status_t (*complete)(pg_work_t *work);
};

/* A group of a planning world: size ranks, this process being rank; its collectives fail,
 * saying that a plan moves no data, its host values act as if every rank brought this one's.
 * Local. */
fsdpc_status_t pg_new_planned(int size, int rank, device_t dev, pg_t **out);

/* Maps an MPI return code into a status with the failing call named; a failure stops the job
 * (world_stop), the other ranks of a collective being left waiting on it. */
fsdpc_status_t pg_mpi_status(int rc, const char *what);

/* Frees comm, unless MPI has been finalized (a group or mesh freed after world_finalize: its
 * memory alone is freed, where MPI would abort). */
void pg_comm_free(MPI_Comm *comm);

/* Allocates a group with a duplicate of comm and fills rank and size; the backend fills the
 * rest. */
fsdpc_status_t pg_alloc(MPI_Comm comm, const pg_ops_t *ops, device_t dev, pg_t **out);

#endif
