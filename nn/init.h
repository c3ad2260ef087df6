/*
 * Plan-independent initialisation. Every element's initial value is a pure function of
 * (seed, parameter FQN, global element index) through a counter-based generator, so a shard
 * initialises itself without the full tensor existing anywhere, and every sharding plan
 * starts from the same global weights.
 *
 *   TRY(nn_init_normal(p, seed, 0.0, 0.02));   // N(0, 0.02^2), p's local shard only
 */
#ifndef FSDPC_NN_INIT_H
#define FSDPC_NN_INIT_H

#include <stdint.h>

#include "nn/module.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The standard normal draw for element index of the tensor called name. */
double nn_init_normal_value(uint64_t seed, const char *name, uint64_t index);

/* Fills the local shard of p->value with mean + std * nn_init_normal_value(seed, fqn, i) for
 * each global index i. Placements must be Shard or Replicate. Local. */
status_t nn_init_normal(nn_param_t *p, uint64_t seed, double mean, double std);

/* Fills the local shard of p->value with value. */
status_t nn_init_constant(nn_param_t *p, double value);

#ifdef __cplusplus
}
#endif

#endif
