/*
 * Turning a resolved plan into a parallel model: the world mesh, tensor parallelism on its
 * "tp" dimension, then fully_shard over the data-parallel dimensions and the plan's units.
 */
#ifndef FSDPC_PARALLEL_PARALLELIZE_H
#define FSDPC_PARALLEL_PARALLELIZE_H

#include "fully_shard/fsdp.h"
#include "parallel/plan.h"
#include "parallel/tensor_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The world mesh of a resolved plan on this rank's device of type dev: ("dp_replicate",)
 * "dp_shard"(, "tp"), dp_replicate only when > 1 and tp only when > 1. Collective. */
status_t plan_mesh(const plan_t *p, device_type_t dev, mesh_t **out);

/* The data-parallel part of the world mesh (a slice: "dp_shard", or ("dp_replicate",
 * "dp_shard")), which fully_shard shards over. Local. */
status_t plan_dp_mesh(const plan_t *p, const mesh_t *world, mesh_t **out);

/* The built-in Llama tensor-parallel plan (used when parallelize.tensor_parallel.plan is
 * absent); returns the number of rules. */
int plan_default_tp_rules(const tp_rule_t **rules);

/* The world mesh's shape under a resolved plan (as plan_mesh lays it out) and the placements
 * a training run gives the Llama parameter fqn on it: its tensor-parallel placement on "tp",
 * Shard(0) over dp_shard (strided when tp also splits dim 0), Replicate over dp_replicate.
 * Offline tools lay checkpoints out for a plan with it. Local. */
status_t plan_param_placements(const plan_t *p, const char *fqn, int *mesh_ndim, int *mesh_shape,
                               placement_t *pl);

/* True when the plan's tensor-parallel rules are the built-in ones (absent, or written out
 * in the same order). */
bool plan_tp_is_builtin(const plan_t *p);

/* Applies parallelize.tensor_parallel on the world mesh's "tp" dimension when mesh.tp > 1
 * (else leaves *tp_mesh and *out NULL): *tp_mesh is the caller's slice, to free after *out
 * (tp_free) and the model. Local. */
status_t plan_apply_tensor_parallel(const plan_t *p, llama_t *m, const mesh_t *world,
                                    mesh_t **tp_mesh, tp_plan_t **out);

/* Applies parallelize.fully_shard: every module whose FQN matches a unit's pattern (a glob
 * whose * and ? stay within one dot-separated name; the first unit that matches wins) becomes one
 * group, inner modules first, then the root with the section's settings. A pattern that matches no
 * module is an error naming the unit. groups (may be NULL) receives up to max groups in the order
 * applied, *n their count. Local, except integer reshards (collective over the shard dimension). */
status_t plan_apply_fully_shard(const plan_t *p, llama_t *m, mesh_t *mesh, fsdp_group_t **groups,
                                int max, int *n);

#ifdef __cplusplus
}
#endif

#endif
