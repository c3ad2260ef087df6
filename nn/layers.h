/*
 * Layers for a model of your own: each constructor makes one module with its parameters,
 * named and shaped as PyTorch's torch.nn layers (Linear: "weight" [out, in] and "bias"
 * [out]; Embedding: "weight" [num, dim]; RMSNorm and LayerNorm: "weight" [dim], LayerNorm's
 * "bias" [dim]; transformers' Conv1D: "weight" [in, out] and "bias" [out]), and declares its
 * kind ("linear", "conv1d", "embedding", "rmsnorm", "layernorm"), which
 * is what tensor parallelism reads to split it. Parameters are whole tensors (Replicate on
 * this rank's shared local mesh, mesh_local_shared), so fully_shard and tensor_parallel take
 * them as they take the built-in Llama's.
 *
 *   nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;    // f32 on the CPU
 *   lo.deferred = true;                               // meta until nn_module_materialize
 *   nn_module_t *model;
 *   FSDPC_TRY(nn_sequential_new(NULL, "", &model));          // the root: children in order
 *   FSDPC_TRY(nn_linear_new(model, "fc1", 16, 64, true, &lo, NULL));
 *   FSDPC_TRY(nn_activation_new(model, "act", KERNEL_ACT_GELU, NULL));
 *   FSDPC_TRY(nn_linear_new(model, "fc2", 64, 4, true, &lo, NULL));
 *   FSDPC_TRY(nn_module_finalize(model));                    // FQNs: fc1.weight, fc1.bias, ...
 *   ... fully_shard / parallel_apply, then nn_module_materialize ...
 *   FSDPC_TRY(nn_module_reset_parameters(model, 1234));      // PyTorch's default init, any plan
 *
 * A module with a forward of your own (a residual block, an attention) is a plain
 * nn_module_new whose forward calls its children with nn_call and computes with the
 * operations of nn/ops.h.
 */
#ifndef FSDPC_NN_LAYERS_H
#define FSDPC_NN_LAYERS_H

#include "nn/ops.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef struct nn_layer_options {
  dtype_t dtype;        /* parameter dtype (f32, bf16, f16) */
  device_type_t device; /* this rank's device of that type */
  bool deferred;        /* meta parameters (no memory) until nn_module_materialize */
} nn_layer_options_t;

#define NN_LAYER_OPTIONS_INIT {.dtype = DTYPE_F32, .device = DEVICE_CPU, .deferred = false}

/* Every constructor: a new module called name (no dots; "" only for a root), added to parent
 * when parent is not NULL (which then owns it; on failure nothing is added), returned in *out
 * when out is not NULL. opt NULL means NN_LAYER_OPTIONS_INIT. Eager parameters start at zero:
 * initialise them (nn_module_reset_parameters, nn_init_*, a load). Local. */

/* y = x W^T (+ b): x [..., in] -> y [..., out]. */
fsdpc_status_t nn_linear_new(nn_module_t *parent, const char *name, int64_t in_features,
                             int64_t out_features, bool bias, const nn_layer_options_t *opt,
                             nn_module_t **out);

/* transformers' Conv1D (GPT-2's projections): y = x W (+ b) with W [in, out]: x [..., in] ->
 * y [..., out]. Kind "conv1d": tensor parallelism splits it as a Linear, on W's other side. */
fsdpc_status_t nn_conv1d_new(nn_module_t *parent, const char *name, int64_t in_features,
                             int64_t out_features, bool bias, const nn_layer_options_t *opt,
                             nn_module_t **out);

/* y = W[ids]: ids (I32/I64) [...] -> y [..., dim]. */
fsdpc_status_t nn_embedding_new(nn_module_t *parent, const char *name, int64_t num_embeddings,
                                int64_t dim, const nn_layer_options_t *opt, nn_module_t **out);

/* RMSNorm over the last dimension, x * rsqrt(mean(x^2) + eps) * w. */
fsdpc_status_t nn_rmsnorm_new(nn_module_t *parent, const char *name, int64_t dim, double eps,
                              const nn_layer_options_t *opt, nn_module_t **out);

/* LayerNorm over the last dimension, (x - mean) / sqrt(var + eps) * w (+ b). */
fsdpc_status_t nn_layernorm_new(nn_module_t *parent, const char *name, int64_t dim, double eps,
                                bool bias, const nn_layer_options_t *opt, nn_module_t **out);

/* An activation without parameters: KERNEL_ACT_RELU, KERNEL_ACT_GELU, KERNEL_ACT_SILU,
 * KERNEL_ACT_GELU_TANH, KERNEL_ACT_SIGMOID. */
fsdpc_status_t nn_activation_new(nn_module_t *parent, const char *name, kernel_act_t act,
                                 nn_module_t **out);

/* A container whose forward calls its children in the order they were added, each on the
 * previous one's output (torch.nn.Sequential). */
fsdpc_status_t nn_sequential_new(nn_module_t *parent, const char *name, nn_module_t **out);

/* PyTorch's default initialisation of every layer under root made by these constructors,
 * plan-independent (each element a function of seed, the parameter's FQN and its global
 * index, as nn/init.h): Linear weight and bias U(-1/sqrt(in), 1/sqrt(in)), Conv1D weight
 * N(0, 0.02) and bias 0 (transformers'), Embedding N(0, 1), norm weights 1 and biases 0. Each rank
 * fills its local shards; other modules are left alone. Local. */
fsdpc_status_t nn_module_reset_parameters(nn_module_t *root, uint64_t seed);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
