/*
 * Helpers shared by the files of differentiable operations (ops.c, ops_layers.c). Not
 * installed.
 */
#ifndef FSDPC_NN_OPS_IMPL_H
#define FSDPC_NN_OPS_IMPL_H

#include "nn/ops.h"

/* An uninitialised (or zero-filled) tensor of like's dtype, device and shape. */
fsdpc_status_t ops_alloc_like(fsdpc_tensor_t *t, const fsdpc_tensor_t *like);
fsdpc_status_t ops_zeros_like(fsdpc_tensor_t *t, const fsdpc_tensor_t *like);

/* Wraps a computed value as the output variable and records node when a gradient is
 * needed. Releases value and node's saved tensors on failure. */
fsdpc_status_t ops_finish(nn_ctx_t *ctx, nn_node_t *node, bool needs, fsdpc_tensor_t *value,
                          nn_var_t **out);

/* The value of a one-element tensor on any device, on the host (blocks). */
fsdpc_status_t ops_scalar_of(const fsdpc_tensor_t *t, double *out);

#endif
