/* Private: the DTensor struct and helpers shared by dtensor.c and redistribute.c. */
#ifndef FSDPC_DTENSOR_DTENSOR_IMPL_H
#define FSDPC_DTENSOR_DTENSOR_IMPL_H

#include "dtensor/dtensor.h"

struct dtensor {
  mesh_t *mesh;
  int ndim;
  int64_t shape[TENSOR_MAX_DIMS];
  placement_t pl[MESH_MAX_DIMS];
  tensor_t local; /* contiguous */
};

/* The mesh's sizes and this rank's coordinates. */
void mesh_shape_coord(const mesh_t *mesh, int *shape, int *coord);

/* Allocates a DTensor that takes ownership of *local (which is zeroed). */
status_t dtensor_wrap_owned(dtensor_t **out, tensor_t *local, mesh_t *mesh, const placement_t *pl,
                            int ndim, const int64_t *global_shape);

/* This rank's local tensor for placements pl, cut from the full value (a new contiguous
 * tensor on `full`'s device): the shard box, zeros off coordinate 0 of Partial(sum) dims. */
status_t local_from_full(const tensor_t *full, const mesh_t *mesh, const placement_t *pl,
                         tensor_t *out);

#endif
