/*
 * Applying a parallelism plan (parallel_plan.h) to any module tree: the world mesh
 * ((dp_replicate,) dp_shard(, tp)), with mesh.ep the MoE blocks' experts split over "ep"
 * (nn_moe_expert_parallel), tensor parallelism on its "tp" dimension by the plan's rules (each
 * matched module's declared kind says how to split it: nn_module_kind), then fully_shard over
 * the data-parallel dimensions, the plan's units first (inner ones first) and the root last
 * (with mesh.ep each block's experts a unit of their own over parallel_expert_mesh).
 *
 *   parallel_plan_t pp;
 *   FSDPC_TRY(parallel_plan_load(&pp, "plan.yaml", NULL, 0));
 *   FSDPC_TRY(parallel_plan_resolve(&pp, world_size()));
 *   parallel_t *par;
 *   FSDPC_TRY(parallel_apply(model, &pp, DEVICE_CPU, &par));   // model built deferred, or whole
 *   FSDPC_TRY(nn_module_materialize(model));                     // deferred: this rank's shards
 *   ... initialise, train; clip with parallel_all_group(par) ...
 *   parallel_free(par); llama_free(model);                 // in either order
 */
#ifndef FSDPC_PARALLEL_PARALLELIZE_H
#define FSDPC_PARALLEL_PARALLELIZE_H

#include "fully_shard/fsdp.h"
#include "parallel/parallel_plan.h"
#include "parallel/tensor_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef struct parallel parallel_t;

/* Applies a resolved plan to the module tree under root (finalized; its parameters whole or
 * meta, the same on every rank) on this rank's device of type dev. Every unit pattern must
 * match a module and every tensor-parallel rule a module of a kind its style handles (errors
 * name the plan's line and list module names of the tree); on failure root may be partly
 * parallelised and should be freed. *out is freed with parallel_free. Collective over the
 * world (it creates the meshes). */
fsdpc_status_t parallel_apply(nn_module_t *root, const parallel_plan_t *pp, device_type_t dev,
                              parallel_t **out);

/* Pipeline parallelism (mesh.pp > 1): parallel_apply for the stages this rank holds, owned[0..n)
 * the modules they are made of (the world mesh's outermost dimension "pp" is the pipeline, so
 * this rank's pipeline index is world_rank / (world_size / pp)). fully_shard takes units at or
 * under those modules only: the plan's units among them, and each of them whose parameters no
 * inner unit took (no root unit); the other stages' modules stay as built (meta when deferred:
 * materialise only this rank's, nn_module_materialize on each owned module). owned must
 * outlive the result. Collective over the world. */
fsdpc_status_t parallel_apply_stages(nn_module_t *root, const parallel_plan_t *pp,
                                     device_type_t dev, nn_module_t *const *owned, int n_owned,
                                     parallel_t **out);

/* Frees the tensor-parallel state and releases the meshes, after the last step; the model's
 * fully_shard groups go with the model (they keep the meshes they use until then), so the
 * model and par may be freed in either order. NULL is a no-op. Local. */
void parallel_free(parallel_t *par);

/* The world mesh: ("pp",) ("dp_replicate",) "dp_shard"(, "tp"), pp, dp_replicate and tp only
 * when > 1; with mesh.ep, ("dp_replicate",) "dp_shard_ep", "ep"(, "tp"), dp_shard_ep of size
 * dp_shard / ep, or when ep borrows tp ("dp_replicate",) "dp_shard_ep", "ep_dp", "tp" with
 * ep_dp of size ep / tp. */
mesh_t *parallel_mesh(const parallel_t *par);
/* Its data-parallel part ("dp_shard", or ("dp_replicate", "dp_shard"); with mesh.ep,
 * dp_shard_ep and ep flattened into "dp_shard"), which fully_shard shards over. */
mesh_t *parallel_dp_mesh(const parallel_t *par);
/* Its "tp" slice, or NULL without tensor parallelism. */
mesh_t *parallel_tp_mesh(const parallel_t *par);
/* With mesh.ep, the mesh the experts' units fully shard over: ("dp_replicate",)
 * "dp_shard_ep", flattened with "tp" into "dp_shard_ep_tp" when tp > 1 (the tp ranks share
 * the experts' shards); NULL otherwise. */
mesh_t *parallel_expert_mesh(const parallel_t *par);
/* With mesh.ep, the mesh the experts are split over: the world's "ep" dimension, or when ep
 * borrows tp, "ep_dp" and "tp" flattened into "ep"; NULL otherwise. */
mesh_t *parallel_ep_mesh(const parallel_t *par);
/* The world's "pp" slice (the pipeline group), or NULL without pipeline parallelism. */
mesh_t *parallel_pp_mesh(const parallel_t *par);
/* Whether this rank holds module m: true without pipeline parallelism, else m at or under one
 * of the modules of parallel_apply_stages. */
bool parallel_holds(const parallel_t *par, const nn_module_t *m);
/* A group of every rank (gradient-norm sums, losses). */
pg_t *parallel_all_group(const parallel_t *par);
/* This rank's data-parallel index (flattened over dp_replicate x dp_shard) and their number:
 * the data order's dp_rank and dp_size (the ranks of one tp group share them). */
int parallel_dp_rank(const parallel_t *par);
int parallel_dp_size(const parallel_t *par);
/* The fully_shard groups in the order applied (the root's last). */
int parallel_num_groups(const parallel_t *par);
fsdp_group_t *const *parallel_groups(const parallel_t *par);
/* The tensor-parallel state, or NULL. */
const tp_plan_t *parallel_tp(const parallel_t *par);

/* The world mesh's shape under a resolved plan (as parallel_apply lays it out) and the
 * placements a training run gives parameter fqn: its tensor-parallel placement on "tp",
 * Shard(d) over dp_shard (d from the plan's shard_dims, else 0; strided when tp also splits
 * dim d), Replicate over dp_replicate.
 * kind is the kind of the module holding the parameter (nn_module_kind: "linear",
 * "embedding", a norm's; NULL when not known), needed only where a tensor-parallel rule
 * matches that module (the module's FQN is fqn without its last component); ndim is the
 * parameter's number of dimensions. Offline tools
 * lay checkpoints out for a plan with it, with or without a model. Local. */
fsdpc_status_t parallel_param_placements(const parallel_plan_t *pp, const char *fqn,
                                         const char *kind, int ndim, int *mesh_ndim,
                                         int *mesh_shape, placement_t *pl);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
