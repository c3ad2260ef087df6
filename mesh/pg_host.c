/*
 * The host channel of every group (its MPI communicator, whatever the backend moves data
 * with), and new groups made from a group.
 */
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "mesh/pg_impl.h"
#include "mesh/world_impl.h"

static const char *const TYPE_NAMES[] = {"i32", "i64", "f64", "byte"};

static fsdpc_status_t host_args(pg_t *pg, int count, pg_host_type_t type, const char *what) {
  if (pg == NULL) return err_set(STATUS_EINVAL, "%s: no process group", what);
  if (count < 0) return err_set(STATUS_EINVAL, "%s: negative count %d", what, count);
  if ((int)type < 0 || type > PG_HOST_BYTE)
    return err_set(STATUS_EINVAL, "%s: unknown host type %d", what, (int)type);
  return STATUS_OK;
}

static MPI_Datatype host_type(pg_host_type_t type) {
  switch (type) {
    case PG_HOST_I32: return MPI_INT32_T;
    case PG_HOST_I64: return MPI_INT64_T;
    case PG_HOST_F64: return MPI_DOUBLE;
    default: return MPI_BYTE;
  }
}

static fsdpc_status_t host_op(pg_host_type_t type, reduce_op_t op, MPI_Op *out, const char *what) {
  if (type == PG_HOST_BYTE || (op != REDUCE_SUM && op != REDUCE_MAX))
    return err_set(STATUS_EINVAL, "%s: %s of %s values is not supported (sum or max of i32, i64, "
                   "f64)", what, reduce_op_name(op), TYPE_NAMES[type]);
  *out = op == REDUCE_MAX ? MPI_MAX : MPI_SUM;
  return STATUS_OK;
}

/* Starts the all-reduce into *req. */
static fsdpc_status_t start_all_reduce(pg_t *pg, const void *send, void *recv, int count,
                                       pg_host_type_t type, reduce_op_t op, MPI_Request *req,
                                       const char *what) {
  FSDPC_TRY(host_args(pg, count, type, what));
  MPI_Op mop = MPI_SUM;
  FSDPC_TRY(host_op(type, op, &mop, what));
  FSDPC_TRY(world_check());
  return pg_mpi_status(MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, count,
                                      host_type(type), mop, pg->comm, req),
                       what);
}

/* A planning world's reduction: every rank brought send (a sum: size times it). */
static fsdpc_status_t planned_all_reduce(pg_t *pg, const void *send, void *recv, int count,
                                         pg_host_type_t type, reduce_op_t op, const char *what) {
  FSDPC_TRY(host_args(pg, count, type, what));
  MPI_Op mop;
  FSDPC_TRY(host_op(type, op, &mop, what));
  for (int i = 0; i < count; i++) {
    double k = op == REDUCE_SUM ? (double)pg->size : 1;
    if (type == PG_HOST_I32) ((int32_t *)recv)[i] = (int32_t)(((const int32_t *)send)[i] * k);
    if (type == PG_HOST_I64) ((int64_t *)recv)[i] = (int64_t)(((const int64_t *)send)[i] * k);
    if (type == PG_HOST_F64) ((double *)recv)[i] = ((const double *)send)[i] * k;
  }
  return STATUS_OK;
}

fsdpc_status_t pg_host_all_reduce(pg_t *pg, const void *send, void *recv, int count,
                                  pg_host_type_t type, reduce_op_t op) {
  const char *what = "MPI_Iallreduce (host)";
  if (count > 0) {
    ARG_NONNULL(send);
    ARG_NONNULL(recv);
  }
  if (pg != NULL && pg->planned) return planned_all_reduce(pg, send, recv, count, type, op, what);
  MPI_Request req;
  FSDPC_TRY(start_all_reduce(pg, send, recv, count, type, op, &req, what));
  return world_wait(&req, what);
}

fsdpc_status_t pg_host_all_reduce_within(pg_t *pg, const void *send, void *recv, int count,
                                         pg_host_type_t type, reduce_op_t op, double seconds,
                                         bool *timed_out) {
  ARG_NONNULL(pg);
  ARG_NONNULL(timed_out);
  if (count > 0) {
    ARG_NONNULL(send);
    ARG_NONNULL(recv);
  }
  const char *what = "MPI_Iallreduce (host, timed)";
  *timed_out = false;
  if (pg != NULL && pg->planned) return planned_all_reduce(pg, send, recv, count, type, op, what);
  MPI_Request req;
  FSDPC_TRY(start_all_reduce(pg, send, recv, count, type, op, &req, what));
  return world_wait_for(&req, seconds, what, timed_out); /* late: req stays pending */
}

fsdpc_status_t pg_host_all_gather(pg_t *pg, const void *send, void *recv, int count,
                                  pg_host_type_t type) {
  const char *what = "MPI_Iallgather (host)";
  if (count > 0) {
    ARG_NONNULL(send);
    ARG_NONNULL(recv);
  }
  FSDPC_TRY(host_args(pg, count, type, what));
  if (pg->planned) { /* every rank brought send */
    size_t bytes = (size_t)count * (type == PG_HOST_I32 ? 4 : type == PG_HOST_BYTE ? 1 : 8);
    for (int r = 0; r < pg->size; r++) memcpy((char *)recv + (size_t)r * bytes, send, bytes);
    return STATUS_OK;
  }
  FSDPC_TRY(world_check());
  MPI_Request req;
  FSDPC_TRY(pg_mpi_status(
      MPI_Iallgather(send, count, host_type(type), recv, count, host_type(type), pg->comm, &req),
      what));
  return world_wait(&req, what);
}

fsdpc_status_t pg_host_first_differing(pg_t *pg, uint64_t value, int *rank) {
  ARG_NONNULL(pg);
  ARG_NONNULL(rank);
  *rank = -1;
  uint64_t *all = malloc(sizeof *all * (size_t)pg->size);
  /* agreed: a rank short of memory must not leave the others in the gather */
  fsdpc_status_t st = pg_agree(pg, all ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory"));
  if (st == STATUS_OK) st = pg_host_all_gather(pg, &value, all, 1, PG_HOST_I64);
  for (int r = 0; st == STATUS_OK && r < pg->size && *rank < 0; r++)
    if (all[r] != all[0]) *rank = r;
  free(all);
  return st;
}

fsdpc_status_t pg_agree(pg_t *pg, fsdpc_status_t st) {
  if (pg == NULL) return err_set(STATUS_EINVAL, "pg_agree: no process group");
  return comm_agree(pg->comm, st);
}

fsdpc_status_t pg_split(pg_t *pg, int color, int key, pg_t **out) {
  ARG_NONNULL(pg);
  ARG_NONNULL(out);
  *out = NULL;
  if (pg == NULL) return err_set(STATUS_EINVAL, "pg_split: no process group");
  if (color < 0) return err_set(STATUS_EINVAL, "pg_split: color %d is negative", color);
  if (pg->planned) /* the other ranks' colors are unknown */
    return err_set(STATUS_EINVAL, "pg_split: a group of a planning world cannot be split");
  MPI_Comm sub;
  FSDPC_TRY(pg_mpi_status(MPI_Comm_split(pg->comm, color, key, &sub), "MPI_Comm_split"));
  /* the parent's kind: an MPI group's part is one too, a device group's the mesh's choice;
   * an NCCL group's part is split from its communicator */
  fsdpc_status_t st = pg->ops->split != NULL              ? pg->ops->split(pg, sub, color, key, out)
                      : strcmp(pg->ops->name, "mpi") == 0 ? pg_new_mpi(sub, out)
                                                          : pg_new_for(sub, pg->device, out);
  MPI_Comm_free(&sub);
  return st;
}

fsdpc_status_t pg_dup(pg_t *pg, pg_t **out) {
  ARG_NONNULL(pg);
  ARG_NONNULL(out);
  *out = NULL;
  if (pg == NULL) return err_set(STATUS_EINVAL, "pg_dup: no process group");
  if (pg->planned) return pg_new_planned(pg->size, pg->rank, pg->device, out);
  return pg_split(pg, 0, pg_rank(pg), out);
}

/* The group kept with pg under n (see pg_kept_t), made on the first call for n. */
static fsdpc_status_t kept(pg_t *pg, int n, pg_t **out) {
  for (pg_kept_t *k = pg->kept; k != NULL; k = k->next)
    if (k->n == n) {
      *out = k->g;
      return STATUS_OK;
    }
  pg_kept_t *k = calloc(1, sizeof *k);
  if (k == NULL) return err_set(STATUS_ENOMEM, "process group: out of host memory");
  fsdpc_status_t st = pg->planned ? pg_new_planned(n ? n : pg->size, n ? pg->rank % n : pg->rank,
                                                   n ? pg->device : device_cpu(), &k->g)
                      : n == 0 ? pg_new_host(pg, &k->g)
                               : pg_split(pg, pg->rank / n, pg->rank % n, &k->g);
  if (st != STATUS_OK) {
    free(k);
    return st;
  }
  k->n = n;
  k->next = pg->kept;
  pg->kept = k;
  *out = k->g;
  return STATUS_OK;
}

fsdpc_status_t pg_side_channel(pg_t *pg, pg_t **out) {
  ARG_NONNULL(pg);
  ARG_NONNULL(out);
  *out = NULL;
  if (pg == NULL) return err_set(STATUS_EINVAL, "pg_side_channel: no process group");
  return kept(pg, 0, out);
}

fsdpc_status_t pg_consecutive(pg_t *pg, int n, pg_t **out) {
  ARG_NONNULL(pg);
  ARG_NONNULL(out);
  *out = NULL;
  if (pg == NULL) return err_set(STATUS_EINVAL, "pg_consecutive: no process group");
  if (n < 1 || pg->size % n != 0)
    return err_set(STATUS_EINVAL, "pg_consecutive: %d does not divide the group's %d ranks", n,
                   pg->size);
  return kept(pg, n, out);
}

fsdpc_status_t pg_new_host(pg_t *pg, pg_t **out) {
  ARG_NONNULL(pg);
  ARG_NONNULL(out);
  *out = NULL;
  if (pg == NULL) return err_set(STATUS_EINVAL, "pg_new_host: no process group");
  if (pg->planned) return pg_new_planned(pg->size, pg->rank, device_cpu(), out);
  return pg_new_mpi(pg->comm, out);
}
