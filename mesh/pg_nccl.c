/*
 * NCCL backend: device buffers, one NCCL communicator per group and one communication stream
 * per group. A mesh makes one communicator over all its ranks (its unique id broadcast over
 * MPI) and splits every other group's from it (ncclCommSplit; NCCL's
 * NCCL_COMM_SPLIT_SHARE_RESOURCES=1 lets the parts share the parent's buffers). Every
 * communicator connects while it is made, and the device memory that takes is counted
 * (mem_stats' comm). A collective
 * first makes the communication stream wait on an event recorded on the caller's current
 * stream, runs there, and records a completion event; pg_wait() makes the caller's current
 * stream wait on that event. No device-wide synchronisation.
 *
 * Communicators are non-blocking (NCCL's config.blocking = 0): a call that answers
 * ncclInProgress is polled to its end through device_poll, so the world's wait hook can end
 * it. Their failure and teardown paths are mesh/nccl_comms.c's: an error aborts the
 * communicator, a stop of the job aborts every one (which ends their kernels, so that no host
 * wait stays blocked behind them), and closing a group finalizes its communicator within a
 * limit before destroying it.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_check.h"
#include "mesh/nccl_comms_impl.h"
#include "mesh/pg_impl.h"
#include "mesh/world_impl.h"

cudaStream_t cuda_stream_raw(stream_t *s);

/* The status of an NCCL result: STATUS_OK, or STATUS_ENCCL with "WHAT: NCCL's text", for
 * calls outside a communicator (on one, nccl_comm_result also aborts it). */
static fsdpc_status_t nccl_status(ncclResult_t rc, const char *what) {
  if (rc == ncclSuccess) return STATUS_OK;
  return err_set(STATUS_ENCCL, "%s: %s", what, ncclGetErrorString(rc));
}

#define NCCL_TRY(call) FSDPC_TRY(nccl_status((call), __FILE__ ":" CUDA_STR_(__LINE__) ": " #call))

/* NCCL's own functions behind mesh/nccl_comms.c's table */
static int real_abort(void *c) { return (int)ncclCommAbort((ncclComm_t)c); }
static int real_finalize(void *c) { return (int)ncclCommFinalize((ncclComm_t)c); }
static int real_destroy(void *c) { return (int)ncclCommDestroy((ncclComm_t)c); }
static int real_async_error(void *c, int *state) {
  ncclResult_t s = ncclSuccess, rc = ncclCommGetAsyncError((ncclComm_t)c, &s);
  *state = (int)s;
  return (int)rc;
}
static const char *real_error_string(int rc) { return ncclGetErrorString((ncclResult_t)rc); }
static const nccl_table_t real_table = {real_abort, real_finalize, real_destroy, real_async_error,
                                        real_error_string};

/* How long closing a group may wait for its communicator's outstanding work before aborting
 * it. */
#define CLOSE_LIMIT_S 30.0

typedef struct nccl_state {
  nccl_comm_t life; /* life.comm: the ncclComm_t */
  cudaStream_t stream;
  size_t held; /* the device memory its making took (mem_stats' comm) */
} nccl_state_t;

static ncclComm_t comm_of(nccl_state_t *s) { return (ncclComm_t)s->life.comm; }

/* The result rc of a call on s's communicator (mesh/nccl_comms_impl.h). */
static fsdpc_status_t settle(nccl_state_t *s, ncclResult_t rc, const char *what) {
  return nccl_comm_result(&s->life, (int)rc, what);
}

typedef struct nccl_work {
  pg_work_t base;
  int device;
  cudaEvent_t done;
} nccl_work_t;

static nccl_state_t *state(pg_t *pg) { return pg->impl; }

static fsdpc_status_t nccl_complete(pg_work_t *base) {
  nccl_work_t *w = (nccl_work_t *)base;
  cudaError_t e = cuda_use_device(w->device);
  if (e == cudaSuccess)
    e = cudaStreamWaitEvent(cuda_stream_raw(stream_current(device_cuda(w->device))), w->done, 0);
  cudaEventDestroy(w->done);
  free(w);
  return cuda_status(e, "pg_wait");
}

/* Orders the communication stream after the caller's current stream. */
static fsdpc_status_t begin(pg_t *pg) {
  if (state(pg)->life.aborted)
    return err_set(STATUS_ENCCL, "the NCCL communicator %s was aborted (the job is stopping)",
                   state(pg)->life.name);
  CUDA_TRY(cuda_use_device(pg->device.index));
  cudaEvent_t ready;
  CUDA_TRY(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  cudaStream_t caller = cuda_stream_raw(stream_current(pg->device));
  cudaError_t e = cudaEventRecord(ready, caller);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(state(pg)->stream, ready, 0);
  cudaEventDestroy(ready);
  return cuda_status(e, "nccl begin");
}

/* Records completion on the communication stream and hands out the handle. */
static fsdpc_status_t end(pg_t *pg, pg_work_t **work) {
  nccl_work_t *w = calloc(1, sizeof *w);
  if (w == NULL) return err_set(STATUS_ENOMEM, "nccl: out of host memory");
  w->base.complete = nccl_complete;
  w->device = pg->device.index;
  cudaError_t e = cudaEventCreateWithFlags(&w->done, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(w->done, state(pg)->stream);
  fsdpc_status_t st = cuda_status(e, "nccl end");
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

static fsdpc_status_t nccl_all_gather(pg_t *pg, const void *send, void *recv, size_t count,
                                      dtype_t dt, pg_work_t **work) {
  FSDPC_TRY(begin(pg));
  FSDPC_TRY(
      settle(state(pg),
             ncclAllGather(send, recv, count, nccl_type(dt), comm_of(state(pg)), state(pg)->stream),
             "ncclAllGather"));
  return end(pg, work);
}

static fsdpc_status_t nccl_reduce_scatter(pg_t *pg, const void *send, void *recv, size_t recv_count,
                                          dtype_t dt, reduce_op_t op, pg_work_t **work) {
  FSDPC_TRY(begin(pg));
  FSDPC_TRY(settle(state(pg),
                   ncclReduceScatter(send, recv, recv_count, nccl_type(dt), nccl_op(op),
                                     comm_of(state(pg)), state(pg)->stream),
                   "ncclReduceScatter"));
  return end(pg, work);
}

static fsdpc_status_t nccl_all_reduce(pg_t *pg, const void *send, void *recv, size_t count,
                                      dtype_t dt, reduce_op_t op, pg_work_t **work) {
  FSDPC_TRY(begin(pg));
  FSDPC_TRY(settle(state(pg),
                   ncclAllReduce(send, recv, count, nccl_type(dt), nccl_op(op), comm_of(state(pg)),
                                 state(pg)->stream),
                   "ncclAllReduce"));
  return end(pg, work);
}

static fsdpc_status_t nccl_all_to_all(pg_t *pg, const void *send, void *recv, size_t count,
                                      dtype_t dt, pg_work_t **work) {
  FSDPC_TRY(begin(pg));
  size_t block = count * dtype_size(dt);
  NCCL_TRY(ncclGroupStart());
  for (int peer = 0; peer < pg->size; peer++) {
    ncclSend((const char *)send + peer * block, count, nccl_type(dt), peer, comm_of(state(pg)),
             state(pg)->stream);
    ncclRecv((char *)recv + peer * block, count, nccl_type(dt), peer, comm_of(state(pg)),
             state(pg)->stream);
  }
  FSDPC_TRY(settle(state(pg), ncclGroupEnd(), "ncclGroupEnd (all-to-all)"));
  return end(pg, work);
}

static fsdpc_status_t nccl_all_to_all_v(pg_t *pg, const void *send, const size_t *send_counts,
                                        void *recv, const size_t *recv_counts, dtype_t dt,
                                        pg_work_t **work) {
  FSDPC_TRY(begin(pg));
  size_t es = dtype_size(dt), so = 0, ro = 0;
  NCCL_TRY(ncclGroupStart());
  for (int peer = 0; peer < pg->size; peer++) {
    size_t sc = send_counts[peer], rc = recv_counts[peer];
    ncclSend((const char *)send + so * es, sc, nccl_type(dt), peer, comm_of(state(pg)),
             state(pg)->stream);
    ncclRecv((char *)recv + ro * es, rc, nccl_type(dt), peer, comm_of(state(pg)),
             state(pg)->stream);
    so += sc;
    ro += rc;
  }
  FSDPC_TRY(settle(state(pg), ncclGroupEnd(), "ncclGroupEnd (all-to-all-v)"));
  return end(pg, work);
}

static fsdpc_status_t nccl_send_recv(pg_t *pg, const pg_p2p_t *ops, int n, dtype_t dt,
                                     pg_work_t **work) {
  FSDPC_TRY(begin(pg));
  NCCL_TRY(ncclGroupStart());
  for (int i = 0; i < n; i++) {
    const pg_p2p_t *o = &ops[i];
    if (o->send)
      ncclSend(o->buf, o->count, nccl_type(dt), o->peer, comm_of(state(pg)), state(pg)->stream);
    else
      ncclRecv(o->buf, o->count, nccl_type(dt), o->peer, comm_of(state(pg)), state(pg)->stream);
  }
  FSDPC_TRY(settle(state(pg), ncclGroupEnd(), "ncclGroupEnd (send/recv)"));
  return end(pg, work);
}

static fsdpc_status_t nccl_broadcast(pg_t *pg, void *buf, size_t count, dtype_t dt, int root,
                                     pg_work_t **work) {
  FSDPC_TRY(begin(pg));
  FSDPC_TRY(settle(
      state(pg),
      ncclBroadcast(buf, buf, count, nccl_type(dt), root, comm_of(state(pg)), state(pg)->stream),
      "ncclBroadcast"));
  return end(pg, work);
}

/* A barrier orders ranks, not streams: the host-side MPI barrier of the group (under the
 * stop channel and the watchdog). */
static fsdpc_status_t nccl_barrier(pg_t *pg, pg_work_t **work) {
  MPI_Request req;
  FSDPC_TRY(pg_mpi_status(MPI_Ibarrier(pg->comm, &req), "MPI_Ibarrier"));
  FSDPC_TRY(world_wait(&req, "MPI_Ibarrier (NCCL group)"));
  FSDPC_TRY(begin(pg));
  return end(pg, work);
}

static void nccl_destroy(pg_t *pg) {
  nccl_state_t *s = state(pg);
  if (s == NULL) return;
  cuda_use_device(pg->device.index);
  if (s->life.comm != NULL) /* tracked */
    (void)nccl_comm_close(&s->life, CLOSE_LIMIT_S); /* finalized, else aborted */
  if (s->held) mem_note_comm(pg->device, s->held, false);
  if (s->stream) cudaStreamDestroy(s->stream);
  free(s);
}

static fsdpc_status_t nccl_split(pg_t *pg, MPI_Comm sub, int color, int key, pg_t **out);

static const pg_ops_t nccl_ops = {
    .name = "nccl",
    .all_gather = nccl_all_gather,
    .reduce_scatter = nccl_reduce_scatter,
    .all_reduce = nccl_all_reduce,
    .all_to_all = nccl_all_to_all,
    .all_to_all_v = nccl_all_to_all_v,
    .send_recv = nccl_send_recv,
    .broadcast = nccl_broadcast,
    .barrier = nccl_barrier,
    .destroy = nccl_destroy,
    .split = nccl_split,
};

/* Makes pg's communicator: from a unique id rank 0 draws and broadcasts over pg's MPI
 * communicator, or, with a parent, split from the parent's communicator (collective over the
 * parent: color and key as for MPI_Comm_split). The memory it takes on the device is counted
 * in mem_stats' comm. */
static fsdpc_status_t open_comm(pg_t *pg, nccl_state_t *s, nccl_state_t *parent, int color,
                                int key) {
  int device = pg->device.index;
  ncclUniqueId id;
  if (parent == NULL) {
    if (pg->rank == 0 && ncclGetUniqueId(&id) != ncclSuccess)
      memset(&id, 0, sizeof id); /* every rank still joins the broadcast; init then fails */
    MPI_Request req;
    FSDPC_TRY(pg_mpi_status(MPI_Ibcast(&id, sizeof id, MPI_BYTE, 0, pg->comm, &req),
                            "MPI_Ibcast (NCCL id)"));
    FSDPC_TRY(world_wait(&req, "MPI_Ibcast (NCCL id)"));
  } else if (parent->life.aborted) {
    return err_set(STATUS_ENCCL, "the NCCL communicator %s was aborted (the job is stopping)",
                   parent->life.name);
  }
  char what[96];
  snprintf(what, sizeof what, "nccl: a stream on cuda:%d", device);
  cudaError_t e = cuda_use_device(device);
  int least = 0, greatest = 0; /* the communication stream at the top priority */
  if (e == cudaSuccess) e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (e == cudaSuccess)
    e = cudaStreamCreateWithPriority(&s->stream, cudaStreamNonBlocking, greatest);
  FSDPC_TRY(cuda_status(e, what));
  size_t free_before = 0, free_after = 0, total = 0;
  if (cudaMemGetInfo(&free_before, &total) != cudaSuccess) free_before = 0;
  snprintf(what, sizeof what, "%s (rank %d of %d on cuda:%d)",
           parent ? "ncclCommSplit" : "ncclCommInitRank", pg->rank, pg->size, device);
  /* connect every channel while the communicator is made (the mesh exists before the model),
   * not at the first collective of the first step, when the memory pool already holds the
   * step's peak; a user's own setting wins */
  setenv("NCCL_RUNTIME_CONNECT", "0", 0);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0; /* polled: a peer that never joins cannot block this rank for good */
  ncclComm_t nc = NULL;
  ncclResult_t rc = parent ? ncclCommSplit(comm_of(parent), color, key, &nc, &config)
                           : ncclCommInitRankConfig(&nc, pg->size, id, pg->rank, &config);
  s->life.comm = nc;
  s->life.t = &real_table;
  snprintf(s->life.name, sizeof s->life.name, "rank %d of %d on cuda:%d", pg->rank, pg->size,
           device);
  if (nc == NULL) return nccl_status(rc == ncclSuccess ? ncclInternalError : rc, what);
  nccl_comm_track(&s->life); /* a stop while it connects aborts it too */
  /* the communicator is usable once ncclCommGetAsyncError no longer says ncclInProgress (a
   * split: the parent's too); a failure aborts it */
  FSDPC_TRY(nccl_comm_result(&s->life, (int)rc, what));
  if (parent) FSDPC_TRY(nccl_comm_settle(&parent->life, "ncclCommSplit (the parent communicator)"));
  if (free_before > 0 && cudaMemGetInfo(&free_after, &total) == cudaSuccess &&
      free_after < free_before) {
    s->held = free_before - free_after;
    mem_note_comm(pg->device, s->held, true);
  }
  return STATUS_OK;
}

/* An NCCL group over comm, its communicator new or split from parent's. */
static fsdpc_status_t new_group(MPI_Comm comm, int device, pg_t *parent, int color, int key,
                                pg_t **out) {
  *out = NULL;
  FSDPC_TRY(device_check(device_cuda(device)));
  pg_t *pg = NULL;
  FSDPC_TRY(pg_alloc(comm, &nccl_ops, device_cuda(device), &pg));
  fsdpc_status_t st = STATUS_OK;
  nccl_state_t *s = calloc(1, sizeof *s);
  if (s == NULL) {
    st = err_set(STATUS_ENOMEM, "nccl: out of host memory");
    goto cleanup;
  }
  pg->impl = s;
  FSDPC_TRY_GOTO(st, open_comm(pg, s, parent ? state(parent) : NULL, color, key));
  *out = pg;
  return STATUS_OK;
cleanup:
  pg_release(pg);
  return st;
}

static fsdpc_status_t nccl_split(pg_t *pg, MPI_Comm sub, int color, int key, pg_t **out) {
  return new_group(sub, pg->device.index, pg, color, key, out);
}

fsdpc_status_t pg_new_nccl(MPI_Comm comm, int device, pg_t **out) {
  return new_group(comm, device, NULL, 0, 0, out);
}
