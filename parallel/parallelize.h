/*
 * Turning a resolved plan into a parallel model: the data-parallel mesh, then fully_shard
 * over the plan's units.
 */
#ifndef FSDPC_PARALLEL_PARALLELIZE_H
#define FSDPC_PARALLEL_PARALLELIZE_H

#include "fully_shard/fsdp.h"
#include "parallel/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The data-parallel mesh of a resolved plan on this rank's device of type dev: 1-D
 * ("dp_shard") without replication, else 2-D ("dp_replicate", "dp_shard"). Collective. */
status_t plan_mesh(const plan_t *p, device_type_t dev, mesh_t **out);

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
