/* What the layer files share (layers.c, moe.c). Not installed. */
#ifndef FSDPC_NN_LAYERS_IMPL_H
#define FSDPC_NN_LAYERS_IMPL_H

#include "nn/layers.h"

/* A parameter of m of shape [nd] (whole, Replicate on this rank's local mesh), zero or meta. */
fsdpc_status_t layers_add_param(nn_module_t *m, const char *name, int nd, const int64_t *shape,
                                const nn_layer_options_t *opt);

/* Adds m to parent (when given) after st, the result of adding its parameters and children;
 * m is freed on failure. *out (when given) receives m. */
fsdpc_status_t layers_attach(nn_module_t *parent, nn_module_t *m, fsdpc_status_t st,
                             nn_module_t **out);

/* The stacked experts of a MoE block (moe.c): whether m is one, and its initialisation. */
bool layers_is_experts(nn_module_t *m);
fsdpc_status_t layers_reset_experts(nn_module_t *m, uint64_t seed);
/* A MoE block's expert_bias zeroed (nn_moe_set_routing); nothing for any other module. */
fsdpc_status_t layers_reset_moe(nn_module_t *m);

#endif
