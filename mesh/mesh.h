/*
 * DeviceMesh: an N-D, named arrangement of ranks with one process group per dimension.
 *
 * Ranks are laid out row-major over the world (rank = arange(world).view(shape)); the group
 * of dimension i holds the ranks that differ only in coordinate i.
 *
 *   int shape[] = {2, -1};                       // -1: whatever is left of the world
 *   const char *names[] = {"dp_replicate", "dp_shard"};
 *   mesh_t *mesh, *shard, *dp;
 *   FSDPC_TRY(mesh_new(2, shape, names, DEVICE_CPU, &mesh));       // collective over the world
 *   FSDPC_TRY(mesh_slice(mesh, 1, (const char *[]){"dp_shard"}, &shard));  // reuses the group
 *   FSDPC_TRY(mesh_flatten(mesh, 2, names, "dp", &dp));              // new 1-D group of 2*W/2
 * ranks pg_t *g = mesh_group(shard, 0); mesh_free(dp); mesh_free(shard); mesh_free(mesh);
 *
 * Groups use MPI on a CPU mesh and NCCL on a CUDA mesh (each rank on world_device()).
 * Meshes are reference counted internally: a slice keeps its parent's groups alive, so
 * meshes may be freed in any order.
 */
#ifndef FSDPC_MESH_MESH_H
#define FSDPC_MESH_MESH_H

#include <stdbool.h>

#include "core/device.h"
#include "core/status.h"
#include "mesh/pg.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

#define MESH_MAX_DIMS 5
#define MESH_NAME_MAX 32

typedef struct mesh mesh_t;

/* Creates a mesh over the world. shape[i] > 0, or -1 on at most one dimension; names are
 * distinct, non-empty, shorter than MESH_NAME_MAX. The product of the sizes must equal the
 * world size. Every rank gets the same error for a bad shape (it depends only on the
 * arguments and the world size), so no rank is left waiting. Collective over the world. */
fsdpc_status_t mesh_new(int ndim, const int *shape, const char *const *names,
                        device_type_t device_type, mesh_t **out);

/* A 1-D mesh of this rank alone (size 1, named name), for tensors that are not distributed:
 * an unsharded parameter is Replicate on such a mesh (so every module constructor needs
 * world_init first: before it, an error says so). Local; no communication. */
fsdpc_status_t mesh_new_local(const char *name, device_type_t device_type, mesh_t **out);

/* The library's one-rank mesh on this rank's device of the given type, named "local", made on
 * first use and shared by every caller until the process ends (the caller never frees it): the
 * mesh of parameters that are not distributed (nn/layers.h builds them on it). Local. */
fsdpc_status_t mesh_local_shared(device_type_t device_type, mesh_t **out);

/* Releases a mesh (once for its creation and once per mesh_retain); its groups go when no
 * slice or flattened mesh uses them. NULL is a no-op. */
void mesh_free(mesh_t *mesh);
/* Keeps mesh alive until a matching mesh_free (for objects that outlive their creator's
 * reference, such as a fully_shard group). Returns mesh. */
mesh_t *mesh_retain(mesh_t *mesh);

/* A submesh of the named dimensions (in the parent's order), sharing the parent's groups.
 * Local: no communication. */
fsdpc_status_t mesh_slice(const mesh_t *mesh, int n, const char *const *names, mesh_t **out);

/* A mesh with a's dimensions followed by b's, sharing their groups: fully_shard places a
 * tensor-parallel parameter on (dp..., tp) this way. a and b come from the same mesh_new,
 * span disjoint dimensions of it and have distinct names; they may interleave in the world
 * mesh (mesh_ranks follows the new mesh's own row-major order). Local: no communication. */
fsdpc_status_t mesh_concat(const mesh_t *a, const mesh_t *b, mesh_t **out);

/* True when a and b come from the same mesh_new. */
bool mesh_same_root(const mesh_t *a, const mesh_t *b);

/* A 1-D mesh named new_name whose group is the product of the named dimensions (in the
 * parent's order; rank order row-major over them). Collective over all ranks of the mesh's
 * root (the mesh created by mesh_new). */
fsdpc_status_t mesh_flatten(const mesh_t *mesh, int n, const char *const *names,
                            const char *new_name, mesh_t **out);

/* The getters below are local; with a NULL mesh or a dim outside [0, mesh_ndim) they give 0
 * (sizes, counts), -1 (coordinates, indices) or NULL. */
int mesh_ndim(const mesh_t *mesh);
int mesh_size(const mesh_t *mesh, int dim);
/* Number of ranks in the mesh (product of the sizes). */
int mesh_numel(const mesh_t *mesh);
/* This rank's coordinate along dim. */
int mesh_coord(const mesh_t *mesh, int dim);
const char *mesh_dim_name(const mesh_t *mesh, int dim);
/* Index of the dimension called name, or -1. */
int mesh_dim_index(const mesh_t *mesh, const char *name);
/* The group of dimension dim (owned by the mesh). */
pg_t *mesh_group(const mesh_t *mesh, int dim);
/* World ranks of the mesh in row-major order of its coordinates (mesh_numel entries). */
const int *mesh_ranks(const mesh_t *mesh);
/* Coordinates of the mesh's i-th rank (row-major index) into coord[mesh_ndim]. */
void mesh_unravel(const mesh_t *mesh, int index, int *coord);
/* The device this rank's buffers live on for this mesh. */
device_t mesh_device(const mesh_t *mesh);
/* "(dp_replicate=2, dp_shard=4)" into buf; returns buf. */
const char *mesh_str(const mesh_t *mesh, char *buf, size_t size);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
