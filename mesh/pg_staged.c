/*
 * Host-staged backend: a group's device data copied into host staging memory (page-locked on
 * CUDA), exchanged by an MPI group of the same ranks, and copied back, as gloo does for
 * device tensors. Slower than NCCL, but any number of ranks may share one GPU (NCCL refuses
 * two ranks on a device), and its results are the MPI backend's.
 *
 * On CUDA the copies run on a staging stream of the group: ordered after the caller's
 * current stream by an event, the copy back recorded by a completion event that pg_wait
 * makes the caller's current stream wait on. The host waits for the copy in (the exchange
 * needs the data) and, at pg_wait, for the copy back (before the staging memory is freed).
 *
 * Lazy mode (pg_set_device_backend(PG_BACKEND_STAGED_LAZY), FSDPC_PG=staged-lazy), for tests:
 * a delay kernel before each copy in, and the exchange and copy back only at pg_wait; on the
 * CPU, where copies are immediate, the copy in too happens at pg_wait. A caller that touches
 * a send buffer or reads a receive buffer before pg_wait, or orders its streams wrongly, then
 * gets a wrong result, not a lucky one.
 */
#include <stdlib.h>
#include <string.h>

#include "mesh/pg_impl.h"

#define LAZY_DELAY_S 2e-3 /* the delay kernel before each copy in, lazy mode */

typedef enum {
  ALL_GATHER,
  REDUCE_SCATTER,
  ALL_REDUCE,
  ALL_TO_ALL,
  ALL_TO_ALL_V,
  BROADCAST,
  SEND_RECV
} kind_t;

typedef struct staged {
  pg_t *host;       /* the exchange: an MPI group of the same ranks */
  stream_t *stream; /* the staging stream (NULL on the CPU) */
  event_t *ready;   /* the caller's stream at a call */
  bool lazy;
} staged_t;

typedef struct staged_work {
  pg_work_t base;
  pg_t *pg;
  kind_t kind;
  const void *send;
  void *recv;
  size_t count;
  dtype_t dt;
  reduce_op_t op;
  int root;
  void *hsend, *hrecv;
  size_t send_bytes, recv_bytes;
  size_t *counts; /* all_to_all_v's send counts then receive counts, owned */
  pg_p2p_t *ops;  /* send_recv's, owned: the sends staged one after the other in hsend, the
                     receives in hrecv */
  int n_ops;
  bool copied_in, exchanged;
  event_t *done; /* the copy back */
} staged_work_t;

static staged_t *state(pg_t *pg) { return pg->impl; }

static void work_free(staged_work_t *w) {
  if (w == NULL) return;
  device_staging_free(w->pg->device, w->hsend);
  device_staging_free(w->pg->device, w->hrecv);
  event_free(w->done);
  free(w->counts);
  free(w->ops);
  free(w);
}

/* Copies between each send_recv operation of one direction (sends: in, receives: back) and
 * its place in the staging buffer of that direction. */
static fsdpc_status_t copy_ops(staged_work_t *w, bool sends) {
  size_t at = 0, es = dtype_size(w->dt);
  char *host = sends ? w->hsend : w->hrecv;
  for (int i = 0; i < w->n_ops; i++) {
    const pg_p2p_t *o = &w->ops[i];
    if (o->send != sends) continue;
    size_t b = o->count * es;
    FSDPC_TRY(sends ? stream_copy_async(w->pg->device, state(w->pg)->stream, host + at, o->buf, b)
                    : stream_copy_async(w->pg->device, state(w->pg)->stream, o->buf, host + at, b));
    at += b;
  }
  return STATUS_OK;
}

/* The send_recv operations on the host staging buffers. */
static fsdpc_status_t exchange_ops(staged_work_t *w, pg_t *h, pg_work_t **hw) {
  pg_p2p_t *hops = malloc(sizeof *hops * (size_t)(w->n_ops > 0 ? w->n_ops : 1));
  if (hops == NULL) return err_set(STATUS_ENOMEM, "host-staged group: out of host memory");
  size_t at[2] = {0, 0}, es = dtype_size(w->dt);
  for (int i = 0; i < w->n_ops; i++) {
    int s = w->ops[i].send;
    hops[i] = w->ops[i];
    hops[i].buf = (char *)(s ? w->hsend : w->hrecv) + at[s];
    at[s] += w->ops[i].count * es;
  }
  fsdpc_status_t st = h->ops->send_recv(h, hops, w->n_ops, w->dt, hw);
  free(hops);
  return st;
}

/* The copy in, where it has not happened yet (the CPU in lazy mode). */
static fsdpc_status_t copy_in_now(staged_work_t *w) {
  if (w->copied_in) return STATUS_OK;
  w->copied_in = true;
  if (w->kind == SEND_RECV) return copy_ops(w, true);
  return stream_copy_async(w->pg->device, state(w->pg)->stream, w->hsend, w->send, w->send_bytes);
}

/* The exchange on the host buffers (the host waits for the copy in first), then the copy
 * back, recorded by w->done. */
static fsdpc_status_t exchange(staged_work_t *w) {
  w->exchanged = true;
  pg_t *pg = w->pg, *h = state(pg)->host;
  FSDPC_TRY(copy_in_now(w));
  if (state(pg)->stream != NULL) FSDPC_TRY(stream_synchronize(state(pg)->stream));
  pg_work_t *hw = NULL;
  switch (w->kind) {
    case ALL_GATHER:
      FSDPC_TRY(h->ops->all_gather(h, w->hsend, w->hrecv, w->count, w->dt, &hw));
      break;
    case REDUCE_SCATTER:
      FSDPC_TRY(h->ops->reduce_scatter(h, w->hsend, w->hrecv, w->count, w->dt, w->op, &hw));
      break;
    case ALL_REDUCE:
      FSDPC_TRY(h->ops->all_reduce(h, w->hsend, w->hrecv, w->count, w->dt, w->op, &hw));
      break;
    case ALL_TO_ALL:
      FSDPC_TRY(h->ops->all_to_all(h, w->hsend, w->hrecv, w->count, w->dt, &hw));
      break;
    case ALL_TO_ALL_V:
      FSDPC_TRY(
          h->ops->all_to_all_v(h, w->hsend, w->counts, w->hrecv, w->counts + pg->size, w->dt, &hw));
      break;
    case BROADCAST:
      memcpy(w->hrecv, w->hsend, w->recv_bytes);
      FSDPC_TRY(h->ops->broadcast(h, w->hrecv, w->count, w->dt, w->root, &hw));
      break;
    case SEND_RECV: FSDPC_TRY(exchange_ops(w, h, &hw)); break;
  }
  FSDPC_TRY(pg_wait(hw));
  if (w->kind == SEND_RECV)
    FSDPC_TRY(copy_ops(w, false));
  else
    FSDPC_TRY(stream_copy_async(pg->device, state(pg)->stream, w->recv, w->hrecv, w->recv_bytes));
  return event_record(w->done, state(pg)->stream);
}

static fsdpc_status_t staged_complete(pg_work_t *base) {
  staged_work_t *w = (staged_work_t *)base;
  fsdpc_status_t st = w->exchanged ? STATUS_OK : exchange(w);
  device_t dev = w->pg->device;
  if (st == STATUS_OK) st = stream_wait_event(stream_current(dev), w->done);
  if (st == STATUS_OK) st = event_synchronize(w->done); /* before the staging memory goes */
  work_free(w);
  return st;
}

/* Starts a collective: staging memory, the copy in ordered after the caller's stream (lazy:
 * behind a delay kernel, or on the CPU at pg_wait), and unless lazy the exchange. */
static fsdpc_status_t start(pg_t *pg, staged_work_t *proto, pg_work_t **work) {
  staged_t *s = state(pg);
  staged_work_t *w = calloc(1, sizeof *w);
  if (w == NULL) {
    free(proto->counts);
    free(proto->ops);
    return err_set(STATUS_ENOMEM, "host-staged group: out of host memory");
  }
  *w = *proto;
  w->base.complete = staged_complete;
  w->pg = pg;
  fsdpc_status_t st = device_staging_alloc(pg->device, w->send_bytes, &w->hsend);
  if (st == STATUS_OK) st = device_staging_alloc(pg->device, w->recv_bytes, &w->hrecv);
  if (st == STATUS_OK) st = event_new(pg->device, &w->done);
  if (st == STATUS_OK && s->stream != NULL) {
    st = event_record(s->ready, stream_current(pg->device));
    if (st == STATUS_OK) st = stream_wait_event(s->stream, s->ready);
    if (st == STATUS_OK && s->lazy) st = stream_delay(pg->device, s->stream, LAZY_DELAY_S);
  }
  if (st == STATUS_OK && (s->stream != NULL || !s->lazy)) st = copy_in_now(w);
  if (st == STATUS_OK && !s->lazy) st = exchange(w);
  if (st != STATUS_OK) {
    if (s->stream != NULL) (void)stream_synchronize(s->stream); /* nothing left reading */
    work_free(w);
    return st;
  }
  *work = &w->base;
  return STATUS_OK;
}

static fsdpc_status_t staged_all_gather(pg_t *pg, const void *send, void *recv, size_t count,
                                        dtype_t dt, pg_work_t **work) {
  size_t n = count * dtype_size(dt);
  staged_work_t p = {.kind = ALL_GATHER,
                     .send = send,
                     .recv = recv,
                     .count = count,
                     .dt = dt,
                     .send_bytes = n,
                     .recv_bytes = n * (size_t)pg->size};
  return start(pg, &p, work);
}

static fsdpc_status_t staged_reduce_scatter(pg_t *pg, const void *send, void *recv,
                                            size_t recv_count, dtype_t dt, reduce_op_t op,
                                            pg_work_t **work) {
  size_t n = recv_count * dtype_size(dt);
  staged_work_t p = {.kind = REDUCE_SCATTER,
                     .send = send,
                     .recv = recv,
                     .count = recv_count,
                     .dt = dt,
                     .op = op,
                     .send_bytes = n * (size_t)pg->size,
                     .recv_bytes = n};
  return start(pg, &p, work);
}

static fsdpc_status_t staged_all_reduce(pg_t *pg, const void *send, void *recv, size_t count,
                                        dtype_t dt, reduce_op_t op, pg_work_t **work) {
  size_t n = count * dtype_size(dt);
  staged_work_t p = {.kind = ALL_REDUCE,
                     .send = send,
                     .recv = recv,
                     .count = count,
                     .dt = dt,
                     .op = op,
                     .send_bytes = n,
                     .recv_bytes = n};
  return start(pg, &p, work);
}

static fsdpc_status_t staged_all_to_all(pg_t *pg, const void *send, void *recv, size_t count,
                                        dtype_t dt, pg_work_t **work) {
  size_t n = count * dtype_size(dt) * (size_t)pg->size;
  staged_work_t p = {.kind = ALL_TO_ALL,
                     .send = send,
                     .recv = recv,
                     .count = count,
                     .dt = dt,
                     .send_bytes = n,
                     .recv_bytes = n};
  return start(pg, &p, work);
}

static fsdpc_status_t staged_all_to_all_v(pg_t *pg, const void *send, const size_t *send_counts,
                                          void *recv, const size_t *recv_counts, dtype_t dt,
                                          pg_work_t **work) {
  size_t n = (size_t)pg->size, ns = 0, nr = 0;
  for (size_t i = 0; i < n; i++) {
    ns += send_counts[i];
    nr += recv_counts[i];
  }
  staged_work_t p = {.kind = ALL_TO_ALL_V,
                     .send = send,
                     .recv = recv,
                     .dt = dt,
                     .send_bytes = ns * dtype_size(dt),
                     .recv_bytes = nr * dtype_size(dt),
                     .counts = malloc(sizeof(size_t) * 2 * n)};
  if (p.counts == NULL) return err_set(STATUS_ENOMEM, "host-staged group: out of host memory");
  memcpy(p.counts, send_counts, sizeof(size_t) * n);
  memcpy(p.counts + n, recv_counts, sizeof(size_t) * n);
  return start(pg, &p, work);
}

static fsdpc_status_t staged_send_recv(pg_t *pg, const pg_p2p_t *ops, int n, dtype_t dt,
                                       pg_work_t **work) {
  staged_work_t p = {.kind = SEND_RECV, .dt = dt, .n_ops = n};
  for (int i = 0; i < n; i++) *(ops[i].send ? &p.send_bytes : &p.recv_bytes) += ops[i].count;
  p.send_bytes *= dtype_size(dt);
  p.recv_bytes *= dtype_size(dt);
  if ((p.ops = malloc(sizeof *p.ops * (size_t)(n > 0 ? n : 1))) == NULL)
    return err_set(STATUS_ENOMEM, "host-staged group: out of host memory");
  if (n > 0) memcpy(p.ops, ops, sizeof *p.ops * (size_t)n);
  return start(pg, &p, work);
}

static fsdpc_status_t staged_broadcast(pg_t *pg, void *buf, size_t count, dtype_t dt, int root,
                                       pg_work_t **work) {
  size_t n = count * dtype_size(dt);
  staged_work_t p = {.kind = BROADCAST,
                     .send = buf,
                     .recv = buf,
                     .count = count,
                     .dt = dt,
                     .root = root,
                     .send_bytes = n,
                     .recv_bytes = n};
  return start(pg, &p, work);
}

/* A barrier orders ranks, not streams: the exchange group's, after the caller's stream. */
static fsdpc_status_t staged_barrier(pg_t *pg, pg_work_t **work) {
  FSDPC_TRY(stream_synchronize(stream_current(pg->device)));
  pg_t *h = state(pg)->host;
  return h->ops->barrier(h, work);
}

static void staged_destroy(pg_t *pg) {
  staged_t *s = state(pg);
  if (s == NULL) return;
  if (s->stream != NULL) (void)stream_synchronize(s->stream);
  stream_free(s->stream);
  event_free(s->ready);
  pg_release(s->host);
  free(s);
}

static const pg_ops_t staged_ops = {
    .name = "staged",
    .all_gather = staged_all_gather,
    .reduce_scatter = staged_reduce_scatter,
    .all_reduce = staged_all_reduce,
    .all_to_all = staged_all_to_all,
    .all_to_all_v = staged_all_to_all_v,
    .send_recv = staged_send_recv,
    .broadcast = staged_broadcast,
    .barrier = staged_barrier,
    .destroy = staged_destroy,
};

fsdpc_status_t pg_new_staged(MPI_Comm comm, device_t dev, bool lazy, pg_t **out) {
  *out = NULL;
  FSDPC_TRY(device_check(dev));
  pg_t *pg = NULL;
  FSDPC_TRY(pg_alloc(comm, &staged_ops, dev, &pg));
  staged_t *s = calloc(1, sizeof *s);
  fsdpc_status_t st =
      s == NULL ? err_set(STATUS_ENOMEM, "host-staged group: out of host memory") : STATUS_OK;
  if (st == STATUS_OK) {
    pg->impl = s;
    s->lazy = lazy;
    st = pg_new_mpi(comm, &s->host);
  }
  if (st == STATUS_OK && dev.type == DEVICE_CUDA) {
    st = stream_new_high(dev, &s->stream);
    if (st == STATUS_OK) st = event_new(dev, &s->ready);
  }
  if (st != STATUS_OK) {
    pg_release(pg);
    return st;
  }
  *out = pg;
  return STATUS_OK;
}
