#include "mesh/pg.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "mesh/pg_impl.h"
#include "mesh/world_impl.h"

const char *pg_kind_name(pg_kind_t kind) {
  static const char *const names[PG_KIND_COUNT] = {
      [PG_ALL_GATHER] = "all_gather", [PG_REDUCE_SCATTER] = "reduce_scatter",
      [PG_ALL_REDUCE] = "all_reduce", [PG_ALL_TO_ALL] = "all_to_all",
      [PG_BROADCAST] = "broadcast",   [PG_BARRIER] = "barrier",
      [PG_SEND_RECV] = "send_recv",
  };
  return (unsigned)kind < PG_KIND_COUNT ? names[kind] : "invalid";
}

const char *reduce_op_name(reduce_op_t op) {
  switch (op) {
    case REDUCE_SUM: return "sum";
    case REDUCE_AVG: return "avg";
    case REDUCE_MAX: return "max";
  }
  return "invalid";
}

fsdpc_status_t pg_mpi_status(int rc, const char *what) {
  if (rc == MPI_SUCCESS) return STATUS_OK;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "code %d", rc);
  /* a call that failed here (ranks that called different collectives, or counts that differ:
   * MPI_ERR_TRUNCATE) leaves the others waiting on it: the job stops, each rank naming it */
  return world_stop(err_set(STATUS_EMPI, "%s failed: %s", what, text));
}

fsdpc_status_t pg_alloc(MPI_Comm comm, const pg_ops_t *ops, device_t dev, pg_t **out) {
  *out = NULL;
  pg_t *pg = calloc(1, sizeof *pg);
  if (pg == NULL) return err_set(STATUS_ENOMEM, "process group: out of host memory");
  pg->ops = ops;
  pg->refcount = 1;
  pg->device = dev;
  fsdpc_status_t st = pg_mpi_status(MPI_Comm_dup(comm, &pg->comm), "MPI_Comm_dup");
  if (st != STATUS_OK) {
    free(pg);
    return st;
  }
  MPI_Comm_set_errhandler(pg->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(pg->comm, &pg->rank);
  MPI_Comm_size(pg->comm, &pg->size);
  *out = pg;
  return STATUS_OK;
}

/* ---- groups of a planning world: no collective runs ---- */

static fsdpc_status_t planned_refusal(pg_t *pg) {
  return err_set(STATUS_EINVAL,
                 "a group of a planning world (%d ranks, planned from one process) moves no data",
                 pg->size);
}
static fsdpc_status_t planned_all_gather(pg_t *pg, const void *s, void *r, size_t n, dtype_t dt,
                                         pg_work_t **w) {
  (void)s, (void)r, (void)n, (void)dt, (void)w;
  return planned_refusal(pg);
}
static fsdpc_status_t planned_reduce(pg_t *pg, const void *s, void *r, size_t n, dtype_t dt,
                                     reduce_op_t op, pg_work_t **w) {
  (void)s, (void)r, (void)n, (void)dt, (void)op, (void)w;
  return planned_refusal(pg);
}
static fsdpc_status_t planned_all_to_all_v(pg_t *pg, const void *s, const size_t *sc, void *r,
                                           const size_t *rc, dtype_t dt, pg_work_t **w) {
  (void)s, (void)sc, (void)r, (void)rc, (void)dt, (void)w;
  return planned_refusal(pg);
}
static fsdpc_status_t planned_send_recv(pg_t *pg, const pg_p2p_t *ops, int n, dtype_t dt,
                                        pg_work_t **w) {
  (void)ops, (void)n, (void)dt, (void)w;
  return planned_refusal(pg);
}
static fsdpc_status_t planned_broadcast(pg_t *pg, void *b, size_t n, dtype_t dt, int root,
                                        pg_work_t **w) {
  (void)b, (void)n, (void)dt, (void)root, (void)w;
  return planned_refusal(pg);
}
static fsdpc_status_t planned_barrier(pg_t *pg, pg_work_t **w) {
  (void)w;
  return planned_refusal(pg);
}

static const pg_ops_t planned_ops = {
    .name = "planned",
    .all_gather = planned_all_gather,
    .reduce_scatter = planned_reduce,
    .all_reduce = planned_reduce,
    .all_to_all = planned_all_gather,
    .all_to_all_v = planned_all_to_all_v,
    .send_recv = planned_send_recv,
    .broadcast = planned_broadcast,
    .barrier = planned_barrier,
};

fsdpc_status_t pg_new_planned(int size, int rank, device_t dev, pg_t **out) {
  FSDPC_TRY(pg_alloc(MPI_COMM_SELF, &planned_ops, dev, out));
  (*out)->size = size;
  (*out)->rank = rank;
  (*out)->planned = true;
  return STATUS_OK;
}

pg_t *pg_retain(pg_t *pg) {
  if (pg) pg->refcount++;
  return pg;
}

void pg_release(pg_t *pg) {
  if (pg == NULL || --pg->refcount > 0) return;
  for (pg_kept_t *k = pg->kept, *next; k != NULL; k = next) {
    next = k->next;
    pg_release(k->g);
    free(k);
  }
  int finalized = 0;
  MPI_Finalized(&finalized); /* a group freed after world_finalize: its memory alone */
  if (!finalized && pg->ops->destroy) pg->ops->destroy(pg);
  pg_comm_free(&pg->comm);
  free(pg);
}

void pg_comm_free(MPI_Comm *comm) {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(comm);
}

int pg_rank(const pg_t *pg) {
  if (pg == NULL) return 0;
  return pg->rank;
}
int pg_size(const pg_t *pg) {
  if (pg == NULL) return 0;
  return pg->size;
}
device_t pg_device(const pg_t *pg) {
  if (pg == NULL) return device_cpu();
  return pg->device;
}
static pg_backend_t device_backend = PG_BACKEND_NATIVE;

void pg_set_device_backend(pg_backend_t b) {
  if (b >= PG_BACKEND_NATIVE && b <= PG_BACKEND_STAGED_LAZY) device_backend = b;
}
pg_backend_t pg_device_backend(void) { return device_backend; }

bool pg_backend_parse(const char *s, pg_backend_t *out) {
  static const char *const names[] = {"native", "staged", "staged-lazy"};
  for (int i = 0; i < 3 && s != NULL && out != NULL; i++)
    if (strcmp(s, names[i]) == 0) {
      *out = (pg_backend_t)i;
      return true;
    }
  return false;
}

fsdpc_status_t pg_new_for(MPI_Comm comm, device_t dev, pg_t **out) {
  if (device_backend != PG_BACKEND_NATIVE)
    return pg_new_staged(comm, dev, device_backend == PG_BACKEND_STAGED_LAZY, out);
  return dev.type == DEVICE_CUDA ? pg_new_nccl(comm, dev.index, out) : pg_new_mpi(comm, out);
}

const char *pg_backend_name(const pg_t *pg) {
  if (pg == NULL) return "(null)";
  return pg->ops->name;
}
pg_counters_t pg_counters(const pg_t *pg) {
  if (pg == NULL) return (pg_counters_t){0};
  return pg->counters;
}
void pg_reset_counters(pg_t *pg) {
  if (pg == NULL) return;
  pg->counters = (pg_counters_t){{0}, {0}, {0}};
}

static fsdpc_status_t check_call(const pg_t *pg, const char *what, dtype_t dt, size_t count,
                                 size_t total_count) {
  if (pg == NULL) return err_set(STATUS_EINVAL, "%s: group is NULL", what);
  FSDPC_TRY(world_check());
  if (dtype_size(dt) == 0) return err_set(STATUS_EDTYPE, "%s: invalid dtype %d", what, (int)dt);
  if (total_count > (size_t)INT_MAX || count > (size_t)INT_MAX)
    return err_set(STATUS_EINVAL, "%s: %zu elements exceed the per-call limit of %d", what,
                   total_count, INT_MAX);
  return STATUS_OK;
}

/* FSDPC_CHECK_COLLECTIVES=1 (PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL): every collective
 * first compares its call with the other ranks' (which collective, its element count and
 * dtype, its reduce op or root, and its number among the group's calls) over the host, so that
 * ranks that call different collectives, or the same one with different sizes, stop with an
 * error naming both calls on every rank instead of exchanging the wrong bytes. A host
 * all-gather a call: a debugging mode. */
enum { CALL_FIELDS = 6 }; /* the call's number, kind, count, dtype, op or root; world rank */
#define CALL_COUNTS_OWN (-1) /* the count of all_to_all_v: each rank's counts its own */

bool pg_checking_calls(void) { /* (read each time: beside a collective, nothing) */
  const char *e = getenv("FSDPC_CHECK_COLLECTIVES");
  return e != NULL && e[0] != 0 && strcmp(e, "0") != 0;
}

static void call_text(const int64_t *c, char *buf, size_t n) {
  pg_kind_t k = (pg_kind_t)c[1];
  int len = snprintf(buf, n, "call %lld, %s%s", (long long)c[0], pg_kind_name(k),
                     c[2] == CALL_COUNTS_OWN ? "_v" : "");
  if (k == PG_BARRIER || c[2] == CALL_COUNTS_OWN || len < 0 || (size_t)len >= n) return;
  len += snprintf(buf + len, n - (size_t)len, " of %lld x %s", (long long)c[2],
                  dtype_name((dtype_t)c[3]));
  if ((k == PG_REDUCE_SCATTER || k == PG_ALL_REDUCE) && (size_t)len < n)
    snprintf(buf + len, n - (size_t)len, " (%s)", reduce_op_name((reduce_op_t)c[4]));
  else if (k == PG_BROADCAST && (size_t)len < n)
    snprintf(buf + len, n - (size_t)len, " from root %lld", (long long)c[4]);
}

/* extra: the reduce op or the root; count CALL_COUNTS_OWN: all_to_all_v's. Collective over pg
 * when on. */
static fsdpc_status_t same_call(pg_t *pg, pg_kind_t kind, int64_t count, dtype_t dt, int extra) {
  if (!pg_checking_calls() || pg->planned || pg->size == 1) return STATUS_OK;
  int64_t mine[CALL_FIELDS] = {pg->calls++, kind, count, (int64_t)dt, extra, world_rank()};
  int64_t *all = malloc(sizeof *all * CALL_FIELDS * (size_t)pg->size);
  fsdpc_status_t st = pg_agree(pg, all ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory"));
  if (st == STATUS_OK) st = pg_host_all_gather(pg, mine, all, CALL_FIELDS, PG_HOST_I64);
  int r = 1; /* the first rank whose call differs from rank 0's (the world ranks aside) */
  while (st == STATUS_OK && r < pg->size &&
         memcmp(all + CALL_FIELDS * r, all, sizeof *all * (CALL_FIELDS - 1)) == 0)
    r++;
  if (st == STATUS_OK && r < pg->size) {
    char a[160], b[160];
    call_text(all, a, sizeof a);
    call_text(all + CALL_FIELDS * r, b, sizeof b);
    st = err_set(STATUS_EINVAL,
                 "FSDPC_CHECK_COLLECTIVES: the ranks of a group of %d called different "
                 "collectives: its rank 0 (world rank %lld) %s, its rank %d (world rank %lld) %s",
                 pg->size, (long long)all[CALL_FIELDS - 1], a, r,
                 (long long)all[CALL_FIELDS * r + CALL_FIELDS - 1], b);
  }
  free(all);
  return st;
}

static fsdpc_status_t check_op(const char *what, dtype_t dt, reduce_op_t op) {
  if (op != REDUCE_SUM && op != REDUCE_AVG && op != REDUCE_MAX)
    return err_set(STATUS_EINVAL, "%s: invalid reduce op %d", what, (int)op);
  if (op == REDUCE_AVG && !dtype_is_float(dt))
    return err_set(STATUS_EDTYPE, "%s: avg needs a floating-point dtype, got %s", what,
                   dtype_name(dt));
  return STATUS_OK;
}

static fsdpc_status_t check_buf(const char *what, const void *p, size_t count) {
  if (count > 0 && p == NULL) return err_set(STATUS_EINVAL, "%s: NULL buffer", what);
  return STATUS_OK;
}

static void count_call(pg_t *pg, pg_kind_t kind, uint64_t bytes) {
  pg->counters.calls[kind]++;
  pg->counters.bytes[kind] += bytes;
}

/* Runs a call either asynchronously (work != NULL) or to completion. */
static fsdpc_status_t finish(fsdpc_status_t st, pg_work_t *w, pg_work_t **work) {
  if (st != STATUS_OK) return st;
  if (work != NULL) {
    *work = w;
    return STATUS_OK;
  }
  return pg_wait(w);
}

fsdpc_status_t pg_all_gather(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                             pg_work_t **work) {
  if (work) *work = NULL;
  FSDPC_TRY(check_call(pg, "all_gather", dt, count, count * (size_t)(pg ? pg->size : 1)));
  FSDPC_TRY(check_buf("all_gather", send, count));
  FSDPC_TRY(check_buf("all_gather", recv, count));
  FSDPC_TRY(same_call(pg, PG_ALL_GATHER, (int64_t)count, dt, 0));
  pg_work_t *w = NULL;
  fsdpc_status_t st = pg->ops->all_gather(pg, send, recv, count, dt, &w);
  if (st == STATUS_OK)
    count_call(pg, PG_ALL_GATHER, (uint64_t)(pg->size - 1) * count * dtype_size(dt));
  return finish(st, w, work);
}

fsdpc_status_t pg_reduce_scatter(pg_t *pg, const void *send, void *recv, size_t recv_count,
                                 dtype_t dt, reduce_op_t op, pg_work_t **work) {
  if (work) *work = NULL;
  FSDPC_TRY(
      check_call(pg, "reduce_scatter", dt, recv_count, recv_count * (size_t)(pg ? pg->size : 1)));
  FSDPC_TRY(check_op("reduce_scatter", dt, op));
  FSDPC_TRY(check_buf("reduce_scatter", send, recv_count));
  FSDPC_TRY(check_buf("reduce_scatter", recv, recv_count));
  FSDPC_TRY(same_call(pg, PG_REDUCE_SCATTER, (int64_t)recv_count, dt, (int)op));
  pg_work_t *w = NULL;
  fsdpc_status_t st = pg->ops->reduce_scatter(pg, send, recv, recv_count, dt, op, &w);
  if (st == STATUS_OK) {
    count_call(pg, PG_REDUCE_SCATTER, (uint64_t)(pg->size - 1) * recv_count * dtype_size(dt));
    pg->counters.reductions[dt]++;
  }
  return finish(st, w, work);
}

fsdpc_status_t pg_all_reduce(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                             reduce_op_t op, pg_work_t **work) {
  if (work) *work = NULL;
  FSDPC_TRY(check_call(pg, "all_reduce", dt, count, count));
  FSDPC_TRY(check_op("all_reduce", dt, op));
  FSDPC_TRY(check_buf("all_reduce", send, count));
  FSDPC_TRY(check_buf("all_reduce", recv, count));
  FSDPC_TRY(same_call(pg, PG_ALL_REDUCE, (int64_t)count, dt, (int)op));
  pg_work_t *w = NULL;
  fsdpc_status_t st = pg->ops->all_reduce(pg, send, recv, count, dt, op, &w);
  if (st == STATUS_OK) {
    count_call(pg, PG_ALL_REDUCE,
               2u * (uint64_t)(pg->size - 1) * count * dtype_size(dt) / (uint64_t)pg->size);
    pg->counters.reductions[dt]++;
  }
  return finish(st, w, work);
}

fsdpc_status_t pg_all_to_all(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                             pg_work_t **work) {
  if (work) *work = NULL;
  FSDPC_TRY(check_call(pg, "all_to_all", dt, count, count * (size_t)(pg ? pg->size : 1)));
  FSDPC_TRY(check_buf("all_to_all", send, count));
  FSDPC_TRY(check_buf("all_to_all", recv, count));
  if (count > 0 && send == recv)
    return err_set(STATUS_EINVAL, "all_to_all: send and recv must not be the same buffer");
  FSDPC_TRY(same_call(pg, PG_ALL_TO_ALL, (int64_t)count, dt, 0));
  pg_work_t *w = NULL;
  fsdpc_status_t st = pg->ops->all_to_all(pg, send, recv, count, dt, &w);
  if (st == STATUS_OK)
    count_call(pg, PG_ALL_TO_ALL, (uint64_t)(pg->size - 1) * count * dtype_size(dt));
  return finish(st, w, work);
}

/* The sum of n counts, or INT_MAX + 1 past the per-call limit. */
static size_t total_of(const size_t *counts, int n) {
  size_t t = 0;
  for (int i = 0; i < n; i++) {
    if (counts[i] > (size_t)INT_MAX - t) return (size_t)INT_MAX + 1;
    t += counts[i];
  }
  return t;
}

fsdpc_status_t pg_all_to_all_v(pg_t *pg, const void *send, const size_t *send_counts, void *recv,
                               const size_t *recv_counts, dtype_t dt, pg_work_t **work) {
  if (work) *work = NULL;
  FSDPC_TRY(check_call(pg, "all_to_all_v", dt, 0, 0));
  if (send_counts == NULL || recv_counts == NULL)
    return err_set(STATUS_EINVAL, "all_to_all_v: NULL counts");
  size_t ns = total_of(send_counts, pg->size), nr = total_of(recv_counts, pg->size);
  FSDPC_TRY(check_call(pg, "all_to_all_v", dt, ns, nr));
  FSDPC_TRY(check_buf("all_to_all_v", send, ns));
  FSDPC_TRY(check_buf("all_to_all_v", recv, nr));
  if (ns > 0 && nr > 0 && send == recv)
    return err_set(STATUS_EINVAL, "all_to_all_v: send and recv must not be the same buffer");
  FSDPC_TRY(same_call(pg, PG_ALL_TO_ALL, CALL_COUNTS_OWN, dt, 0));
  pg_work_t *w = NULL;
  fsdpc_status_t st = pg->ops->all_to_all_v(pg, send, send_counts, recv, recv_counts, dt, &w);
  if (st == STATUS_OK)
    count_call(pg, PG_ALL_TO_ALL, (uint64_t)(ns - send_counts[pg->rank]) * dtype_size(dt));
  return finish(st, w, work);
}

fsdpc_status_t pg_send_recv(pg_t *pg, const pg_p2p_t *ops, int n, dtype_t dt, pg_work_t **work) {
  if (work) *work = NULL;
  FSDPC_TRY(check_call(pg, "send_recv", dt, 0, 0));
  if (n < 0 || (n > 0 && ops == NULL))
    return err_set(STATUS_EINVAL, "send_recv: %d operations at %p", n, (const void *)ops);
  uint64_t sent = 0;
  for (int i = 0; i < n; i++) {
    const pg_p2p_t *o = &ops[i];
    FSDPC_TRY(check_call(pg, "send_recv", dt, o->count, o->count));
    FSDPC_TRY(check_buf("send_recv", o->buf, o->count));
    if (o->peer < 0 || o->peer >= pg->size)
      return err_set(STATUS_EINVAL, "send_recv: operation %d: peer %d outside a group of %d", i,
                     o->peer, pg->size);
    if (o->send && o->peer != pg->rank) sent += (uint64_t)o->count * dtype_size(dt);
  }
  pg_work_t *w = NULL;
  fsdpc_status_t st = pg->ops->send_recv(pg, ops, n, dt, &w);
  if (st == STATUS_OK) count_call(pg, PG_SEND_RECV, sent);
  return finish(st, w, work);
}

fsdpc_status_t pg_broadcast(pg_t *pg, void *buf, size_t count, dtype_t dt, int root,
                            pg_work_t **work) {
  if (work) *work = NULL;
  FSDPC_TRY(check_call(pg, "broadcast", dt, count, count));
  FSDPC_TRY(check_buf("broadcast", buf, count));
  if (root < 0 || root >= pg->size)
    return err_set(STATUS_EINVAL, "broadcast: root %d outside a group of %d", root, pg->size);
  FSDPC_TRY(same_call(pg, PG_BROADCAST, (int64_t)count, dt, root));
  pg_work_t *w = NULL;
  fsdpc_status_t st = pg->ops->broadcast(pg, buf, count, dt, root, &w);
  if (st == STATUS_OK)
    count_call(pg, PG_BROADCAST, pg->size > 1 ? (uint64_t)count * dtype_size(dt) : 0);
  return finish(st, w, work);
}

fsdpc_status_t pg_barrier(pg_t *pg, pg_work_t **work) {
  if (work) *work = NULL;
  if (pg == NULL) return err_set(STATUS_EINVAL, "barrier: group is NULL");
  FSDPC_TRY(world_check());
  FSDPC_TRY(same_call(pg, PG_BARRIER, 0, DTYPE_F32, 0));
  pg_work_t *w = NULL;
  fsdpc_status_t st = pg->ops->barrier(pg, &w);
  if (st == STATUS_OK) count_call(pg, PG_BARRIER, 0);
  return finish(st, w, work);
}

fsdpc_status_t pg_wait(pg_work_t *work) {
  if (work == NULL) return STATUS_OK;
  return work->complete(work);
}
