/*
 * Placements and the chunk rule.
 *
 * A placement says how a tensor lives along one mesh dimension:
 *   Shard(d)     dimension d is split across the mesh dimension with torch.chunk semantics:
 *                chunk c = ceil(n / W); rank r holds [r*c, min(n, (r+1)*c)); trailing ranks
 *                may hold nothing (n=6, W=4 gives 2,2,2,0).
 *   Replicate    every rank holds the whole.
 *   Partial(op)  every rank holds a term; the value is the reduction (sum, avg, max).
 *
 * Several mesh dimensions may shard one tensor dimension. Plain shards nest in mesh order:
 * mesh dim 0 chunks the tensor, mesh dim 1 chunks that chunk, and so on. A strided shard
 * (split_factor > 1) is applied after the plain shards of the same tensor dimension: with
 * placements (StridedShard(0, 2), Shard(0)) on a (dp=2, tp=2) mesh, tp splits the rows first
 * and dp chunks each tp piece, which is how FSDP over a tensor-parallel shard lays data out.
 * Strided shards apply in reverse mesh order, each chunking what the later dimensions made:
 * (StridedShard(0, 4), StridedShard(0, 2), Shard(0)) on (replicate=2, shard=2, tp=2) is HFSDP
 * over tensor parallelism (tp, then the shard group, then the replicas). A split_factor must
 * equal the product of the sizes of the later mesh dimensions that shard the same tensor
 * dimension. Every shard, strided or not, is one box in global coordinates, so local shapes
 * and global offsets are exact.
 *
 *   placement_t pl[2] = {placement_shard(0), placement_replicate()};
 *   int mesh_shape[2] = {2, 2}, coord[2] = {1, 0};
 *   int64_t shape[2] = {7, 15}, local[2], offset[2];
 *   placements_local_box(2, shape, 2, mesh_shape, pl, coord, local, offset);
 *   // local = {3, 15}, offset = {4, 0}
 */
#ifndef FSDPC_DTENSOR_PLACEMENT_H
#define FSDPC_DTENSOR_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/status.h"
#include "mesh/pg.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef enum placement_kind {
  PLACEMENT_REPLICATE = 0,
  PLACEMENT_SHARD,
  PLACEMENT_PARTIAL
} placement_kind_t;

typedef struct placement {
  placement_kind_t kind;
  int dim;          /* Shard: the tensor dimension */
  int split_factor; /* Shard: 1 for a plain shard, > 1 for a strided shard */
  reduce_op_t op;   /* Partial: the reduction */
} placement_t;

static inline placement_t placement_replicate(void) {
  return (placement_t){PLACEMENT_REPLICATE, 0, 1, REDUCE_SUM};
}
static inline placement_t placement_shard(int dim) {
  return (placement_t){PLACEMENT_SHARD, dim, 1, REDUCE_SUM};
}
static inline placement_t placement_strided_shard(int dim, int split_factor) {
  return (placement_t){PLACEMENT_SHARD, dim, split_factor, REDUCE_SUM};
}
static inline placement_t placement_partial(reduce_op_t op) {
  return (placement_t){PLACEMENT_PARTIAL, 0, 1, op};
}

bool placement_equal(placement_t a, placement_t b);
static inline bool placement_is_shard(placement_t p, int dim) {
  return p.kind == PLACEMENT_SHARD && p.dim == dim;
}

/* "S(0)", "R", "P(sum)", "SS(0,2)" into buf; returns buf. */
const char *placement_str(placement_t p, char *buf, size_t size);
/* "(S(0), R)" into buf; returns buf. */
const char *placements_str(int n, const placement_t *pl, char *buf, size_t size);

/* ceil(n / w): the chunk size of n elements over w ranks; 0 when n <= 0 or w <= 0. */
int64_t placement_chunk_size(int64_t n, int64_t w);

/* Offset and length of rank r's chunk of n elements over w ranks; a rank past the last has the
 * empty chunk at n, and n <= 0, w <= 0 or r < 0 give offset and length 0. */
void placement_chunk_range(int64_t n, int64_t w, int64_t r, int64_t *offset, int64_t *length);

/* Checks placements for a tensor of tensor_ndim dimensions on a mesh of the given shape:
 * shard dimensions in range, split factors consistent, reduce ops valid. */
fsdpc_status_t placements_check(int tensor_ndim, int mesh_ndim, const int *mesh_shape,
                                const placement_t *pl);

/* Checks placements against the tensor's dtype: Partial(avg) needs a floating-point one (an
 * integer average would truncate); what names the caller. */
fsdpc_status_t placements_check_dtype(int mesh_ndim, const placement_t *pl, dtype_t dt,
                                      const char *what);

/* Local shape and global offset of the shard held at mesh coordinates coord. Placements
 * must pass placements_check. Pure computation, no communication. */
void placements_local_box(int ndim, const int64_t *global_shape, int mesh_ndim,
                          const int *mesh_shape, const placement_t *pl, const int *coord,
                          int64_t *local_shape, int64_t *offset);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
