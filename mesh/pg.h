/*
 * Process groups: one interface for collectives, three backends.
 *
 *   MPI  (host buffers):   every build
 *   NCCL (device buffers): CUDA builds
 *   host-staged (the buffers of a device, either kind): copied through host memory and
 *        exchanged over MPI, as gloo does: several ranks may share one GPU, which NCCL
 *        refuses (pg_set_device_backend)
 *
 * Groups come from a device mesh (mesh_group), from the world (world_pg: every rank, host), or
 * from another group (pg_split, pg_dup, pg_new_host). Every group, whatever its backend, also has a
 * host channel for small values (agreements, counts, losses): pg_host_all_reduce,
 * pg_host_all_gather, pg_agree.
 *
 * Every collective is collective over the group's ranks (all must call it, in the same
 * order), counts in elements (never bytes), and comes in two forms: work == NULL blocks
 * until the result is ready; otherwise *work receives a handle and the call returns at once;
 * pg_wait(*work) then completes it (MPI: the host waits; NCCL: the current stream of the
 * device waits on the collective's stream, the host does not block) and frees the handle.
 * Buffers must stay untouched until then.
 *
 *   pg_work_t *w;
 *   FSDPC_TRY(pg_all_gather(pg, shard, full, shard_count, DTYPE_F32, &w));   // returns at once
 *   ... other work ...
 *   FSDPC_TRY(pg_wait(w));                                                    // full is ready
 *
 * Counters: every call increments calls[kind] and adds to bytes[kind] the bytes this rank
 * sends in the bandwidth-optimal (ring) algorithm, with n the bytes of one rank's block:
 *   all-gather (W-1)*n_in, reduce-scatter (W-1)*n_out, all-reduce 2*(W-1)*n/W (integer
 *   division), all-to-all (W-1)*n_block, broadcast n when W > 1, barrier 0.
 * So a group of size 1 counts its calls and zero bytes.
 */
#ifndef FSDPC_MESH_PG_H
#define FSDPC_MESH_PG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef enum pg_kind {
  PG_ALL_GATHER = 0,
  PG_REDUCE_SCATTER,
  PG_ALL_REDUCE,
  PG_ALL_TO_ALL,
  PG_BROADCAST,
  PG_BARRIER,
  PG_SEND_RECV, /* point-to-point (pg_send_recv) */
  PG_KIND_COUNT
} pg_kind_t;

typedef enum reduce_op { REDUCE_SUM = 0, REDUCE_AVG, REDUCE_MAX } reduce_op_t;

typedef struct pg_counters {
  uint64_t calls[PG_KIND_COUNT];
  uint64_t bytes[PG_KIND_COUNT];
  uint64_t reductions[DTYPE_COUNT]; /* all-reduce and reduce-scatter calls by element dtype */
} pg_counters_t;

typedef struct pg pg_t;
typedef struct pg_work pg_work_t;

const char *pg_kind_name(pg_kind_t kind);
const char *reduce_op_name(reduce_op_t op);

/* A new group of the ranks of pg that pass the same color (>= 0), ordered by key (ties by
 * rank in pg): the same backend and device as pg. Collective over pg. Free with pg_release. */
fsdpc_status_t pg_split(pg_t *pg, int color, int key, pg_t **out);

/* A group of the same ranks in the same order, backend and device as pg, with communicators
 * of its own: its collectives never mix with pg's (a library's private copy of a caller's
 * group). Collective over pg. Free with pg_release. */
fsdpc_status_t pg_dup(pg_t *pg, pg_t **out);

/* A host (MPI) group of pg's ranks with a channel of its own: exchanges on it never mix with
 * pg's. Collective over pg. Free with pg_release. */
fsdpc_status_t pg_new_host(pg_t *pg, pg_t **out);

/* pg's side channel: a host group of its ranks kept with pg, for exchanges that must never
 * mix with pg's own or with other users' (a timed agreement that may be given up and left
 * pending, as fully_shard's on-demand agreement). Made on the first call, which is then
 * collective over pg; later calls return the same group at once. Owned by pg (pg_retain it
 * to keep it longer). */
fsdpc_status_t pg_side_channel(pg_t *pg, pg_t **out);

/* The group of the n consecutive ranks of pg that holds this rank (ranks.view(-1, n)'s row; n
 * divides pg's size), with pg's backend and device: made on the first call for each n (then
 * collective over pg), kept with pg and returned again by later calls. Owned by pg. */
fsdpc_status_t pg_consecutive(pg_t *pg, int n, pg_t **out);

/* Reference counting: a group may be shared by several meshes. pg_release(NULL) is a no-op. */
pg_t *pg_retain(pg_t *pg);
void pg_release(pg_t *pg);

/* Whether FSDPC_CHECK_COLLECTIVES is set (to anything but 0): every collective then first
 * compares its call with the other ranks', and dtensor_redistribute its arguments. */
bool pg_checking_calls(void);

int pg_rank(const pg_t *pg);
int pg_size(const pg_t *pg);
/* Where the group's buffers must live: the host for MPI, a CUDA device for NCCL. */
device_t pg_device(const pg_t *pg);
const char *pg_backend_name(const pg_t *pg);

/* How the groups a mesh makes move data: the device's own backend (MPI on the CPU, NCCL on
 * CUDA), or host-staged; lazy is the host-staged test mode (a delay before each copy in, the
 * exchange and copy back only at pg_wait, so that a caller's missing wait or stream order
 * gives a wrong result). Applies to groups made afterwards; FSDPC_PG=native, staged or
 * staged-lazy sets it when the world starts (world_init). */
typedef enum pg_backend {
  PG_BACKEND_NATIVE = 0,
  PG_BACKEND_STAGED,
  PG_BACKEND_STAGED_LAZY
} pg_backend_t;
void pg_set_device_backend(pg_backend_t b);
pg_backend_t pg_device_backend(void);
/* "native", "staged" or "staged-lazy" into *out; false for anything else. */
bool pg_backend_parse(const char *s, pg_backend_t *out);

pg_counters_t pg_counters(const pg_t *pg);
void pg_reset_counters(pg_t *pg);

/* recv[r*count .. (r+1)*count) = send of rank r. recv holds size*count elements; send may be
 * recv + rank*count (in place). */
fsdpc_status_t pg_all_gather(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                             pg_work_t **work);

/* send holds size*recv_count elements; block r of the reduction lands in recv of rank r.
 * REDUCE_AVG divides the sum by the group size (floating-point dtypes only). */
fsdpc_status_t pg_reduce_scatter(pg_t *pg, const void *send, void *recv, size_t recv_count,
                                 dtype_t dt, reduce_op_t op, pg_work_t **work);

/* recv = reduction of send over the group; send == recv is in place. */
fsdpc_status_t pg_all_reduce(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                             reduce_op_t op, pg_work_t **work);

/* send and recv hold size*count elements: block j of send goes to rank j, block i of recv
 * comes from rank i. Not in place. */
fsdpc_status_t pg_all_to_all(pg_t *pg, const void *send, void *recv, size_t count, dtype_t dt,
                             pg_work_t **work);

/* The all-to-all of blocks of any size (MPI_Alltoallv; expert parallelism's token exchange):
 * send holds send_counts[0] + ... + send_counts[size-1] elements, block j (after the blocks
 * before it) going to rank j; recv receives recv_counts[i] elements from rank i, in rank order.
 * recv_counts[i] here must equal send_counts[rank] on rank i (exchange the counts first, e.g.
 * with pg_all_to_all of one element per rank). Both arrays hold size entries and may be freed
 * once the call returns. Not in place. Counted as an all_to_all: the bytes sent to other
 * ranks. */
fsdpc_status_t pg_all_to_all_v(pg_t *pg, const void *send, const size_t *send_counts, void *recv,
                               const size_t *recv_counts, dtype_t dt, pg_work_t **work);

/* One send or receive of pg_send_recv: count elements of buf to peer (send) or from peer
 * into buf (a receive). */
typedef struct pg_p2p {
  bool send;
  void *buf;
  size_t count;
  int peer; /* a rank of the group; this rank itself too */
} pg_p2p_t;

/* The sends and receives ops[0..n) started together and completed together (torch's
 * batch_isend_irecv; pipeline stages' activations and gradients): each must be matched by the
 * peer's receive or send of the same count and dtype, posted in any order on either side;
 * several between one pair of ranks match in the order each side lists them. ops may be
 * freed once the call returns, the buffers only after pg_wait. Counted as send_recv: the
 * bytes sent to other ranks. */
fsdpc_status_t pg_send_recv(pg_t *pg, const pg_p2p_t *ops, int n, dtype_t dt, pg_work_t **work);

/* buf of root (a rank of the group) is copied into buf of every rank. */
fsdpc_status_t pg_broadcast(pg_t *pg, void *buf, size_t count, dtype_t dt, int root,
                            pg_work_t **work);

fsdpc_status_t pg_barrier(pg_t *pg, pg_work_t **work);

/* Completes and frees a handle (see above). pg_wait(NULL) is a no-op. */
fsdpc_status_t pg_wait(pg_work_t *work);

/* ---- the host channel of any group ----
 *
 * Small values on host memory over the group's ranks, whatever its backend; blocking. Like
 * every library wait, they fail with the stopping rank's message once the job is stopped
 * (world_stop) and stop the job when the watchdog expires (world_set_timeout). Not counted in
 * pg_counters. */
typedef enum pg_host_type { PG_HOST_I32 = 0, PG_HOST_I64, PG_HOST_F64, PG_HOST_BYTE } pg_host_type_t;

/* recv = the sum or maximum (REDUCE_SUM, REDUCE_MAX; not for PG_HOST_BYTE) of send over the
 * group; send == recv is in place. */
fsdpc_status_t pg_host_all_reduce(pg_t *pg, const void *send, void *recv, int count,
                                  pg_host_type_t type, reduce_op_t op);
/* pg_host_all_reduce that gives up after seconds: then *timed_out, STATUS_OK, and send and
 * recv stay owned by the collective for good (never free or reuse them). */
fsdpc_status_t pg_host_all_reduce_within(pg_t *pg, const void *send, void *recv, int count,
                                         pg_host_type_t type, reduce_op_t op, double seconds,
                                         bool *timed_out);
/* recv[r*count .. (r+1)*count) = send of rank r. */
fsdpc_status_t pg_host_all_gather(pg_t *pg, const void *send, void *recv, int count,
                                  pg_host_type_t type);

/* The lowest rank of the group whose value differs from rank 0's into *rank, -1 when every rank
 * brought the same: value a fingerprint of what the ranks must agree on (a plan, the parameters
 * of a unit), each rank's verdict the same. */
fsdpc_status_t pg_host_first_differing(pg_t *pg, uint64_t value, int *rank);

/* Agreement on an outcome: STATUS_OK when every rank of the group passed OK; otherwise a
 * failing rank keeps its own status and detail, and every other rank gets the status of the
 * lowest failing rank and its detail text prefixed with "rank R: " (R: its rank in the
 * world). Use it wherever only some ranks could detect a problem, so that all ranks stop
 * together and each names the problem; it ends early when the job is stopping (world.h). */
fsdpc_status_t pg_agree(pg_t *pg, fsdpc_status_t st);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
