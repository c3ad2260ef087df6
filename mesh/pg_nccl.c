/*
 * NCCL backend: device buffers, one NCCL communicator per group (its unique id broadcast
 * over the group's MPI communicator) and one communication stream per group. A collective
 * first makes the communication stream wait on an event recorded on the caller's current
 * stream, runs there, and records a completion event; pg_wait() makes the caller's current
 * stream wait on that event. No device-wide synchronisation.
 *
 * Communicators are non-blocking (NCCL's config.blocking = 0): a call that answers
 * ncclInProgress is polled to its end through device_poll, so the world's wait hook can end
 * it; pg_nccl_abort_all() aborts every live communicator (the hook calls it when the job
 * stops), which ends their kernels, so that no host wait stays blocked behind them.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/cuda_check.h"
#include "mesh/pg_impl.h"

cudaStream_t cuda_stream_raw(stream_t *s);

/* The status of an NCCL result: STATUS_OK, or STATUS_ENCCL with "WHAT: NCCL's text". Every
 * NCCL result the library checks goes through here. */
static status_t nccl_status(ncclResult_t rc, const char *what) {
  if (rc == ncclSuccess) return STATUS_OK;
  return err_set(STATUS_ENCCL, "%s: %s", what, ncclGetErrorString(rc));
}

#define NCCL_TRY(call) TRY(nccl_status((call), __FILE__ ":" CUDA_STR_(__LINE__) ": " #call))

typedef struct nccl_state {
  ncclComm_t comm;
  cudaStream_t stream;
  bool aborted;                 /* by pg_nccl_abort_all: comm is gone */
  struct nccl_state *prev, *next; /* the live communicators */
} nccl_state_t;

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static nccl_state_t *live;

static void live_add(nccl_state_t *s) {
  pthread_mutex_lock(&live_lock);
  s->next = live;
  if (live) live->prev = s;
  live = s;
  pthread_mutex_unlock(&live_lock);
}

/* Removes s (when listed) and tells whether it was aborted. */
static bool live_remove(nccl_state_t *s) {
  pthread_mutex_lock(&live_lock);
  if (s->prev) s->prev->next = s->next;
  else if (live == s) live = s->next;
  if (s->next) s->next->prev = s->prev;
  s->prev = s->next = NULL;
  bool aborted = s->aborted;
  pthread_mutex_unlock(&live_lock);
  return aborted;
}

void pg_nccl_abort_all(void) {
  pthread_mutex_lock(&live_lock);
  for (nccl_state_t *s = live; s; s = s->next)
    if (!s->aborted && s->comm) {
      ncclCommAbort(s->comm);
      s->aborted = true;
    }
  pthread_mutex_unlock(&live_lock);
}

/* ncclCommGetAsyncError as a device_poll condition: 1 once the communicator's last call has
 * finished, -1 when it failed. */
static int comm_settled(void *ctx, status_t *st) {
  nccl_state_t *s = ctx;
  ncclResult_t state = ncclSuccess, rc = ncclCommGetAsyncError(s->comm, &state);
  if (rc != ncclSuccess) state = rc;
  if (state == ncclInProgress) return 0;
  if (state == ncclSuccess) return 1;
  *st = nccl_status(state, "ncclCommGetAsyncError");
  return -1;
}

/* Polls s's communicator until its last call has finished. */
static status_t poll_settled(nccl_state_t *s, const char *what) {
  status_t st = device_poll(comm_settled, s, what);
  return st == STATUS_OK ? STATUS_OK : err_prefix(st, "%s", what);
}

/* The result rc of a call on s's communicator, polled to its end when still in progress. */
static status_t settle(nccl_state_t *s, ncclResult_t rc, const char *what) {
  if (rc == ncclSuccess) return STATUS_OK;
  if (rc != ncclInProgress) return nccl_status(rc, what);
  return poll_settled(s, what);
}

typedef struct nccl_work {
  pg_work_t base;
  int device;
  cudaEvent_t done;
} nccl_work_t;

static nccl_state_t *state(pg_t *pg) { return pg->impl; }

static status_t nccl_complete(pg_work_t *base) {
  nccl_work_t *w = (nccl_work_t *)base;
  cudaError_t e = cudaSetDevice(w->device);
  if (e == cudaSuccess)
    e = cudaStreamWaitEvent(cuda_stream_raw(stream_current(device_cuda(w->device))), w->done, 0);
  cudaEventDestroy(w->done);
  free(w);
  return cuda_status(e, "pg_wait");
}

/* Orders the communication stream after the caller's current stream. */
static status_t begin(pg_t *pg) {
  if (state(pg)->aborted)
    return err_set(STATUS_ENCCL, "the NCCL communicator of this group was aborted (the job is "
                                 "stopping)");
  CUDA_TRY(cudaSetDevice(pg->device.index));
  cudaEvent_t ready;
  CUDA_TRY(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  cudaStream_t caller = cuda_stream_raw(stream_current(pg->device));
  cudaError_t e = cudaEventRecord(ready, caller);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(state(pg)->stream, ready, 0);
  cudaEventDestroy(ready);
  return cuda_status(e, "nccl begin");
}

/* Records completion on the communication stream and hands out the handle. */
static status_t end(pg_t *pg, pg_work_t **work) {
  nccl_work_t *w = calloc(1, sizeof *w);
  if (w == NULL) return err_set(STATUS_ENOMEM, "nccl: out of host memory");
  w->base.complete = nccl_complete;
  w->device = pg->device.index;
  cudaError_t e = cudaEventCreateWithFlags(&w->done, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(w->done, state(pg)->stream);
  status_t st = cuda_status(e, "nccl end");
  if (st != STATUS_OK) {
    free(w);
    return st;
  }
  *work = &w->base;
  return STATUS_OK;
}

static ncclDataType_t nccl_type(dtype_t dt) {
  switch (dt) {
    case DTYPE_F32: return ncclFloat32;
    case DTYPE_BF16: return ncclBfloat16;
    case DTYPE_F16: return ncclFloat16;
    case DTYPE_I32: return ncclInt32;
    case DTYPE_I64: return ncclInt64;
    default: return ncclFloat32;
  }
}

static ncclRedOp_t nccl_op(reduce_op_t op) {
  return op == REDUCE_AVG ? ncclAvg : op == REDUCE_MAX ? ncclMax : ncclSum;
}

static status_t nccl_all_gather(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                                pg_work_t **work) {
  TRY(begin(pg));
  TRY(settle(state(pg),
             ncclAllGather(send, recv, count, nccl_type(dt), state(pg)->comm, state(pg)->stream),
             "ncclAllGather"));
  return end(pg, work);
}

static status_t nccl_reduce_scatter(pg_t *pg, const void *send, void *recv, size_t recv_count,
                                    dtype_t dt, reduce_op_t op, pg_work_t **work) {
  TRY(begin(pg));
  TRY(settle(state(pg),
             ncclReduceScatter(send, recv, recv_count, nccl_type(dt), nccl_op(op),
                               state(pg)->comm, state(pg)->stream),
             "ncclReduceScatter"));
  return end(pg, work);
}

static status_t nccl_all_reduce(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                                reduce_op_t op, pg_work_t **work) {
  TRY(begin(pg));
  TRY(settle(state(pg),
             ncclAllReduce(send, recv, count, nccl_type(dt), nccl_op(op), state(pg)->comm,
                           state(pg)->stream),
             "ncclAllReduce"));
  return end(pg, work);
}

static status_t nccl_all_to_all(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                                pg_work_t **work) {
  TRY(begin(pg));
  size_t block = count * dtype_size(dt);
  NCCL_TRY(ncclGroupStart());
  for (int peer = 0; peer < pg->size; peer++) {
    ncclSend((const char *)send + peer * block, count, nccl_type(dt), peer, state(pg)->comm,
             state(pg)->stream);
    ncclRecv((char *)recv + peer * block, count, nccl_type(dt), peer, state(pg)->comm,
             state(pg)->stream);
  }
  TRY(settle(state(pg), ncclGroupEnd(), "ncclGroupEnd (all-to-all)"));
  return end(pg, work);
}

static status_t nccl_broadcast(pg_t *pg, void *buf, size_t count, dtype_t dt, int root,
                               pg_work_t **work) {
  TRY(begin(pg));
  TRY(settle(state(pg),
             ncclBroadcast(buf, buf, count, nccl_type(dt), root, state(pg)->comm,
                           state(pg)->stream),
             "ncclBroadcast"));
  return end(pg, work);
}

/* A barrier orders ranks, not streams: the host-side MPI barrier of the group. */
static status_t nccl_barrier(pg_t *pg, pg_work_t **work) {
  TRY(pg_mpi_status(MPI_Barrier(pg->comm), "MPI_Barrier"));
  TRY(begin(pg));
  return end(pg, work);
}

static void nccl_destroy(pg_t *pg) {
  nccl_state_t *s = state(pg);
  if (s == NULL) return;
  cudaSetDevice(pg->device.index);
  bool aborted = live_remove(s);
  if (s->comm && !aborted) ncclCommDestroy(s->comm);
  if (s->stream) cudaStreamDestroy(s->stream);
  free(s);
}

static const pg_ops_t nccl_ops = {
    .name = "nccl",
    .all_gather = nccl_all_gather,
    .reduce_scatter = nccl_reduce_scatter,
    .all_reduce = nccl_all_reduce,
    .all_to_all = nccl_all_to_all,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .destroy = nccl_destroy,
};

status_t pg_new_nccl(MPI_Comm comm, int device, pg_t **out) {
  *out = NULL;
  TRY(device_check(device_cuda(device)));
  pg_t *pg = NULL;
  TRY(pg_alloc(comm, &nccl_ops, device_cuda(device), &pg));
  status_t st = STATUS_OK;
  nccl_state_t *s = calloc(1, sizeof *s);
  if (s == NULL) {
    st = err_set(STATUS_ENOMEM, "nccl: out of host memory");
    goto cleanup;
  }
  pg->impl = s;
  ncclUniqueId id;
  if (pg->rank == 0 && ncclGetUniqueId(&id) != ncclSuccess)
    memset(&id, 0, sizeof id); /* every rank still joins the broadcast; init then fails */
  TRY_GOTO(st, pg_mpi_status(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, pg->comm), "MPI_Bcast"));
  char what[96];
  snprintf(what, sizeof what, "nccl: a stream on cuda:%d", device);
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
  TRY_GOTO(st, cuda_status(e, what));
  snprintf(what, sizeof what, "ncclCommInitRank (rank %d of %d on cuda:%d)", pg->rank, pg->size,
           device);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0; /* polled: a peer that never joins cannot block this rank for good */
  ncclResult_t rc = ncclCommInitRankConfig(&s->comm, pg->size, id, pg->rank, &config);
  /* the communicator is usable once ncclCommGetAsyncError no longer says ncclInProgress */
  st = rc == ncclSuccess || rc == ncclInProgress ? poll_settled(s, what) : nccl_status(rc, what);
  if (st != STATUS_OK) {
    if (s->comm) ncclCommAbort(s->comm);
    s->comm = NULL;
    goto cleanup;
  }
  live_add(s);
  *out = pg;
  return STATUS_OK;
cleanup:
  pg_release(pg);
  return st;
}
