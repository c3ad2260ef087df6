/* Private: the DTensor struct and helpers shared by dtensor.c and redistribute.c. */
#ifndef FSDPC_DTENSOR_DTENSOR_IMPL_H
#define FSDPC_DTENSOR_DTENSOR_IMPL_H

#include "dtensor/dtensor.h"

struct dtensor {
  mesh_t *mesh;
  int ndim;
  int64_t shape[TENSOR_MAX_DIMS];
  placement_t pl[MESH_MAX_DIMS];
  fsdpc_tensor_t local; /* contiguous */
};

/* The mesh's sizes and this rank's coordinates. */
void mesh_shape_coord(const mesh_t *mesh, int *shape, int *coord);

/* Allocates a DTensor that takes ownership of *local (which is zeroed). */
fsdpc_status_t dtensor_wrap_owned(fsdpc_tensor_t *local, mesh_t *mesh, const placement_t *pl,
                                  int ndim, const int64_t *global_shape, dtensor_t **out);

/* This rank's local tensor for placements pl, cut from the full value (a new contiguous
 * tensor on `full`'s device): the shard box, zeros off coordinate 0 of Partial(sum) dims. */
fsdpc_status_t local_from_full(const fsdpc_tensor_t *full, const mesh_t *mesh,
                               const placement_t *pl, fsdpc_tensor_t *out);

/* Every rank of mesh learns whether any failed its own checks (st) or passes other arguments
 * than the others (dtype, shape, placements, src_rank), so that all return the same error
 * (what names the call) rather than some waiting in a collective the others never reach.
 * Collective over mesh. */
fsdpc_status_t dtensor_agree_args(mesh_t *mesh, dtype_t dtype, int ndim, const int64_t *shape,
                                  const placement_t *pl, int src_rank, fsdpc_status_t st,
                                  const char *what);

#endif
