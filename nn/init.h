/*
 * Plan-independent initialisation. Every element's initial value is a pure function of
 * (seed, parameter FQN, global element index) through a counter-based generator, so a shard
 * initialises itself without the full tensor existing anywhere, and every sharding plan
 * starts from the same global weights.
 *
 *   FSDPC_TRY(nn_init_normal(p, seed, 0.0, 0.02));   // N(0, 0.02^2), p's local shard only
 */
#ifndef FSDPC_NN_INIT_H
#define FSDPC_NN_INIT_H

#include <stdint.h>

#include "nn/module.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* The standard normal draw for element index of the tensor called name. */
double nn_init_normal_value(uint64_t seed, const char *name, uint64_t index);

/* Fills the local shard of p->value with mean + std * nn_init_normal_value(seed, fqn, i) for
 * each global index i. Placements must be Shard (strided shards included: each is one box of
 * the global tensor) or Replicate. Local. */
fsdpc_status_t nn_init_normal(nn_param_t *p, uint64_t seed, double mean, double std);

/* Fills the local shard of p->value with lo + (hi - lo) * u, u uniform in [0, 1) drawn for
 * each global index as above (the default init of PyTorch's Linear: lo = -hi =
 * -1/sqrt(in_features)). Local. */
fsdpc_status_t nn_init_uniform(nn_param_t *p, uint64_t seed, double lo, double hi);

/* Fills the local shard of p->value with value. */
fsdpc_status_t nn_init_constant(nn_param_t *p, double value);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
