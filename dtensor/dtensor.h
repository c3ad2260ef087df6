/*
 * DTensor: a local tensor plus the global shape, the mesh and one placement per mesh
 * dimension. Local shape and global offset follow from the placements (placement.h).
 *
 *   placement_t pl[] = {placement_shard(0)};
 *   dtensor_t *x, *y;
 *   FSDPC_TRY(dtensor_distribute(&full, mesh, pl, DTENSOR_ALL_RANKS, &x)); // every rank holds full
 *   FSDPC_TRY(dtensor_redistribute(x, (placement_t[]){placement_replicate()}, &y)); // all-gather
 *   const fsdpc_tensor_t *whole = dtensor_local(y);
 *   dtensor_free(y); dtensor_free(x);
 *
 * The mesh must outlive every DTensor on it. Local tensors live on the mesh's device.
 * distribute(X, P) with a Partial placement puts X on coordinate 0 of each Partial(sum) mesh
 * dimension and zeros elsewhere; Partial(avg) and Partial(max) hold X on every coordinate.
 */
#ifndef FSDPC_DTENSOR_DTENSOR_H
#define FSDPC_DTENSOR_DTENSOR_H

#include "core/tensor.h"
#include "dtensor/placement.h"
#include "mesh/mesh.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef struct dtensor dtensor_t;

#define DTENSOR_ALL_RANKS (-1)

/* Wraps this rank's shard. local must have exactly the shape the placements give this rank
 * for global_shape; the DTensor takes its own reference to local's memory (the caller still
 * frees local). local lives on the mesh's device, or in host memory (an offloaded shard, which
 * redistribution refuses). Local; no communication. */
fsdpc_status_t dtensor_from_local(const fsdpc_tensor_t *local, mesh_t *mesh, const placement_t *pl,
                                  int ndim, const int64_t *global_shape, dtensor_t **out);

/* dtensor_from_local with like's mesh, placements and global shape, for a local tensor shaped
 * as like's (a parameter's gradient, of any dtype): contiguous, of like's local shape, on
 * like's local device; the shard's place is like's, not worked out again. Local. */
fsdpc_status_t dtensor_from_local_like(const fsdpc_tensor_t *local, const dtensor_t *like,
                                       dtensor_t **out);

/* Distributes a full tensor. src_rank == DTENSOR_ALL_RANKS: every rank passes the same full
 * tensor and keeps its shard of it (its values are not compared). Otherwise src_rank (a world
 * rank in the mesh) holds the data; other ranks pass a tensor of the same shape and dtype whose
 * contents are ignored (a meta tensor too), and the data is broadcast along the mesh
 * dimensions. Either way the ranks' shapes, dtypes and placements are compared first (a small
 * all-reduce per mesh dimension), every rank refusing a difference. Collective over the mesh. */
fsdpc_status_t dtensor_distribute(const fsdpc_tensor_t *full, mesh_t *mesh, const placement_t *pl,
                                  int src_rank, dtensor_t **out);

/* A new DTensor with placements dst holding the same global value, moved one mesh dimension
 * at a time with the collectives of the redistribute table. Collective over the mesh (with
 * FSDPC_CHECK_COLLECTIVES set, the ranks' dst and shapes are compared first). */
fsdpc_status_t dtensor_redistribute(const dtensor_t *src, const placement_t *dst, dtensor_t **out);

/* The whole global value on every rank (a new tensor the caller frees). Collective. */
fsdpc_status_t dtensor_full_tensor(const dtensor_t *dt, fsdpc_tensor_t *out);

void dtensor_free(dtensor_t *dt);

const fsdpc_tensor_t *dtensor_local(const dtensor_t *dt);
mesh_t *dtensor_mesh(const dtensor_t *dt);
int dtensor_ndim(const dtensor_t *dt);
const int64_t *dtensor_shape(const dtensor_t *dt);
const placement_t *dtensor_placements(const dtensor_t *dt);
/* This rank's global offset, dtensor_ndim entries. */
void dtensor_offset(const dtensor_t *dt, int64_t *offset);

/* Local shape and offset that placements give mesh coordinates coord for a global shape on
 * mesh (mesh_ndim(mesh) coordinates). Checks the placements, the coordinates (each within its
 * mesh dimension) and the shape (no negative size). No communication. */
fsdpc_status_t dtensor_compute_box(const mesh_t *mesh, const placement_t *pl, int ndim,
                                   const int64_t *global_shape, const int *coord,
                                   int64_t *local_shape, int64_t *offset);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
