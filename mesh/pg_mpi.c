/*
 * MPI backend: nonblocking MPI collectives on host buffers. bf16 and f16 travel as 2-byte
 * MPI types with user-defined sum and max (each step converts to f32 and rounds back);
 * avg is a sum divided by the group size when the request completes.
 */
#include <stdlib.h>
#include <string.h>

#include "mesh/pg_impl.h"
#include "mesh/world_impl.h"

typedef struct mpi_work {
  pg_work_t base;
  MPI_Request req;
  const char *what;
  /* avg post-processing: divide `count` elements at `buf` by `divisor` */
  void *avg_buf;
  size_t avg_count;
  dtype_t dt;
  int divisor;
  int *v; /* all_to_all_v: send counts, send offsets, recv counts, recv offsets (size each) */
  MPI_Request *reqs; /* send_recv: one request per operation */
  int n_reqs;
} mpi_work_t;

static MPI_Datatype half_types[2]; /* [0] bf16, [1] f16 */
static MPI_Op half_ops[2][2];      /* [bf16|f16][sum|max] */
static int half_ready;

typedef float (*to_f32_fn)(uint16_t);
typedef uint16_t (*from_f32_fn)(float);

static void half_reduce(void *in, void *inout, int *len, to_f32_fn to, from_f32_fn from,
                        int is_max) {
  const uint16_t *a = in;
  uint16_t *b = inout;
  for (int i = 0; i < *len; i++) {
    float x = to(a[i]), y = to(b[i]);
    b[i] = from(is_max ? (x > y || x != x ? x : y) : x + y);
  }
}

static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *dt) {
  (void)dt;
  half_reduce(in, inout, len, bf16_to_f32, f32_to_bf16, 0);
}
static void bf16_max(void *in, void *inout, int *len, MPI_Datatype *dt) {
  (void)dt;
  half_reduce(in, inout, len, bf16_to_f32, f32_to_bf16, 1);
}
static void f16_sum(void *in, void *inout, int *len, MPI_Datatype *dt) {
  (void)dt;
  half_reduce(in, inout, len, f16_to_f32, f32_to_f16, 0);
}
static void f16_max(void *in, void *inout, int *len, MPI_Datatype *dt) {
  (void)dt;
  half_reduce(in, inout, len, f16_to_f32, f32_to_f16, 1);
}

static fsdpc_status_t half_types_init(void) {
  if (half_ready) return STATUS_OK;
  for (int i = 0; i < 2; i++) {
    FSDPC_TRY(
        pg_mpi_status(MPI_Type_contiguous(2, MPI_BYTE, &half_types[i]), "MPI_Type_contiguous"));
    FSDPC_TRY(pg_mpi_status(MPI_Type_commit(&half_types[i]), "MPI_Type_commit"));
  }
  FSDPC_TRY(pg_mpi_status(MPI_Op_create(bf16_sum, 1, &half_ops[0][0]), "MPI_Op_create"));
  FSDPC_TRY(pg_mpi_status(MPI_Op_create(bf16_max, 1, &half_ops[0][1]), "MPI_Op_create"));
  FSDPC_TRY(pg_mpi_status(MPI_Op_create(f16_sum, 1, &half_ops[1][0]), "MPI_Op_create"));
  FSDPC_TRY(pg_mpi_status(MPI_Op_create(f16_max, 1, &half_ops[1][1]), "MPI_Op_create"));
  half_ready = 1;
  return STATUS_OK;
}

static MPI_Datatype mpi_type(dtype_t dt) {
  switch (dt) {
    case DTYPE_F32: return MPI_FLOAT;
    case DTYPE_BF16: return half_types[0];
    case DTYPE_F16: return half_types[1];
    case DTYPE_I32: return MPI_INT32_T;
    case DTYPE_I64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
  }
}

static MPI_Op mpi_op(dtype_t dt, reduce_op_t op) {
  int is_max = op == REDUCE_MAX;
  if (dt == DTYPE_BF16) return half_ops[0][is_max];
  if (dt == DTYPE_F16) return half_ops[1][is_max];
  return is_max ? MPI_MAX : MPI_SUM;
}

static fsdpc_status_t mpi_complete(pg_work_t *base) {
  mpi_work_t *w = (mpi_work_t *)base;
  fsdpc_status_t st = world_wait(&w->req, w->what);
  for (int i = 0; i < w->n_reqs; i++) { /* every request waited for, the first failure kept */
    fsdpc_status_t s = world_wait(&w->reqs[i], w->what);
    if (st == STATUS_OK) st = s;
  }
  free(w->reqs);
  if (st == STATUS_OK && w->avg_buf != NULL) {
    for (size_t i = 0; i < w->avg_count; i++)
      dtype_store(w->dt, w->avg_buf, i, dtype_load(w->dt, w->avg_buf, i) / w->divisor);
  }
  free(w->v);
  free(w);
  return st;
}

static fsdpc_status_t new_work(const char *what, mpi_work_t **out) {
  mpi_work_t *w = calloc(1, sizeof *w);
  if (w == NULL) return err_set(STATUS_ENOMEM, "%s: out of host memory", what);
  w->base.complete = mpi_complete;
  w->what = what;
  w->req = MPI_REQUEST_NULL;
  *out = w;
  return STATUS_OK;
}

/* Hands out the handle of a started request; on failure frees it instead. */
static fsdpc_status_t started(mpi_work_t *w, int rc, pg_work_t **work) {
  fsdpc_status_t st = pg_mpi_status(rc, w->what);
  if (st != STATUS_OK) {
    free(w->v);
    free(w);
    return st;
  }
  *work = &w->base;
  return STATUS_OK;
}

static fsdpc_status_t mpi_all_gather(pg_t *pg, const void *send, void *recv, size_t count,
                                     dtype_t dt, pg_work_t **work) {
  mpi_work_t *w = NULL;
  FSDPC_TRY(new_work("MPI_Iallgather", &w));
  const void *src = send;
  if ((const char *)send == (const char *)recv + (size_t)pg->rank * count * dtype_size(dt))
    src = MPI_IN_PLACE;
  return started(w,
                 MPI_Iallgather(src, (int)count, mpi_type(dt), recv, (int)count, mpi_type(dt),
                                pg->comm, &w->req),
                 work);
}

static fsdpc_status_t mpi_reduce_scatter(pg_t *pg, const void *send, void *recv, size_t recv_count,
                                         dtype_t dt, reduce_op_t op, pg_work_t **work) {
  mpi_work_t *w = NULL;
  FSDPC_TRY(new_work("MPI_Ireduce_scatter_block", &w));
  if (op == REDUCE_AVG) {
    w->avg_buf = recv;
    w->avg_count = recv_count;
    w->dt = dt;
    w->divisor = pg->size;
  }
  return started(w,
                 MPI_Ireduce_scatter_block(send, recv, (int)recv_count, mpi_type(dt),
                                           mpi_op(dt, op), pg->comm, &w->req),
                 work);
}

static fsdpc_status_t mpi_all_reduce(pg_t *pg, const void *send, void *recv, size_t count,
                                     dtype_t dt, reduce_op_t op, pg_work_t **work) {
  mpi_work_t *w = NULL;
  FSDPC_TRY(new_work("MPI_Iallreduce", &w));
  if (op == REDUCE_AVG) {
    w->avg_buf = recv;
    w->avg_count = count;
    w->dt = dt;
    w->divisor = pg->size;
  }
  return started(w,
                 MPI_Iallreduce(send == recv ? MPI_IN_PLACE : send, recv, (int)count, mpi_type(dt),
                                mpi_op(dt, op), pg->comm, &w->req),
                 work);
}

static fsdpc_status_t mpi_all_to_all(pg_t *pg, const void *send, void *recv, size_t count,
                                     dtype_t dt, pg_work_t **work) {
  mpi_work_t *w = NULL;
  FSDPC_TRY(new_work("MPI_Ialltoall", &w));
  return started(w,
                 MPI_Ialltoall(send, (int)count, mpi_type(dt), recv, (int)count, mpi_type(dt),
                               pg->comm, &w->req),
                 work);
}

/* The counts and offsets live in the handle until the request completes, as MPI requires
 * (pg.c checked that every total fits an int). */
static fsdpc_status_t mpi_all_to_all_v(pg_t *pg, const void *send, const size_t *send_counts,
                                       void *recv, const size_t *recv_counts, dtype_t dt,
                                       pg_work_t **work) {
  mpi_work_t *w = NULL;
  FSDPC_TRY(new_work("MPI_Ialltoallv", &w));
  int n = pg->size, *v = w->v = malloc(sizeof *v * 4 * (size_t)n);
  if (v == NULL) {
    free(w);
    return err_set(STATUS_ENOMEM, "MPI_Ialltoallv: out of host memory");
  }
  for (int side = 0; side < 2; side++) {
    const size_t *counts = side ? recv_counts : send_counts;
    int *c = v + 2 * side * n, *off = c + n, at = 0;
    for (int i = 0; i < n; i++) {
      c[i] = (int)counts[i];
      off[i] = at;
      at += c[i];
    }
  }
  return started(w,
                 MPI_Ialltoallv(send, v, v + n, mpi_type(dt), recv, v + 2 * n, v + 3 * n,
                                mpi_type(dt), pg->comm, &w->req),
                 work);
}

/* Each operation a nonblocking send or receive (one tag: messages between a pair match in
 * the order they are posted); a failure to post cancels nothing already posted, so the
 * handle still waits for those. */
static fsdpc_status_t mpi_send_recv(pg_t *pg, const pg_p2p_t *ops, int n, dtype_t dt,
                                    pg_work_t **work) {
  mpi_work_t *w = NULL;
  FSDPC_TRY(new_work("MPI_Isend/MPI_Irecv", &w));
  if (n > 0 && (w->reqs = malloc(sizeof *w->reqs * (size_t)n)) == NULL) {
    free(w);
    return err_set(STATUS_ENOMEM, "MPI_Isend/MPI_Irecv: out of host memory");
  }
  int rc = MPI_SUCCESS;
  for (int i = 0; i < n && rc == MPI_SUCCESS; i++, w->n_reqs++) {
    const pg_p2p_t *o = &ops[i];
    rc = o->send
             ? MPI_Isend(o->buf, (int)o->count, mpi_type(dt), o->peer, 0, pg->comm, &w->reqs[i])
             : MPI_Irecv(o->buf, (int)o->count, mpi_type(dt), o->peer, 0, pg->comm, &w->reqs[i]);
  }
  if (rc != MPI_SUCCESS) {
    w->n_reqs--; /* the failed one posted nothing */
    fsdpc_status_t st = pg_mpi_status(rc, w->what);
    (void)mpi_complete(&w->base);
    return st;
  }
  *work = &w->base;
  return STATUS_OK;
}

static fsdpc_status_t mpi_broadcast(pg_t *pg, void *buf, size_t count, dtype_t dt, int root,
                                    pg_work_t **work) {
  mpi_work_t *w = NULL;
  FSDPC_TRY(new_work("MPI_Ibcast", &w));
  return started(w, MPI_Ibcast(buf, (int)count, mpi_type(dt), root, pg->comm, &w->req), work);
}

static fsdpc_status_t mpi_barrier(pg_t *pg, pg_work_t **work) {
  mpi_work_t *w = NULL;
  FSDPC_TRY(new_work("MPI_Ibarrier", &w));
  return started(w, MPI_Ibarrier(pg->comm, &w->req), work);
}

static const pg_ops_t mpi_ops = {
    .name = "mpi",
    .all_gather = mpi_all_gather,
    .reduce_scatter = mpi_reduce_scatter,
    .all_reduce = mpi_all_reduce,
    .all_to_all = mpi_all_to_all,
    .all_to_all_v = mpi_all_to_all_v,
    .send_recv = mpi_send_recv,
    .broadcast = mpi_broadcast,
    .barrier = mpi_barrier,
    .destroy = NULL,
};

fsdpc_status_t pg_new_mpi(MPI_Comm comm, pg_t **out) {
  FSDPC_TRY(half_types_init());
  return pg_alloc(comm, &mpi_ops, device_cpu(), out);
}
