/*
 * Differentiable operations of the reference model. Each computes its result with the
 * kernels of core/kernels.h on the inputs' device and, when a gradient is needed, records
 * itself on the context's tape with what its backward reads. Parameters are read through
 * nn_param_t.compute at forward and again at backward (so hooks may swap the tensor in
 * between, as fully_shard does). Every *out is a new variable the caller releases.
 *
 *   FSDPC_TRY(nn_linear(ctx, x, q_proj_weight, &q));   // q[..., out] = x[..., in] @ W^T
 */
#ifndef FSDPC_NN_OPS_H
#define FSDPC_NN_OPS_H

#include "core/kernels.h"
#include "nn/autograd.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* y[..., out] = x[..., in] @ w^T with w [out, in] (no bias). */
fsdpc_status_t nn_linear(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, nn_var_t **out);

/* y[..., out] = x[..., in] @ w with w stored [in, out] (no bias): Hugging Face's Conv1D, the
 * layout of GPT-2's weights. */
fsdpc_status_t nn_linear_io(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, nn_var_t **out);

/* y = x's elements [start, start + length) along dimension dim, as a contiguous tensor; its
 * gradient goes to those elements of x's (q, k and v of a fused projection). */
fsdpc_status_t nn_narrow(nn_ctx_t *ctx, nn_var_t *x, int dim, int64_t start, int64_t length,
                         nn_var_t **out);

/* y[..., D] = w[ids[...], :] with w [V, D]; ids (I32/I64) get no gradient. */
fsdpc_status_t nn_embedding(nn_ctx_t *ctx, nn_var_t *ids, nn_param_t *w, nn_var_t **out);

/* The same on a vocabulary shard: w holds rows [first, first + V) of `vocab` ids; ids outside
 * the shard give zero rows and no gradient (a row-wise tensor-parallel embedding, whose
 * outputs are summed over the shards). vocab < 0 means V (the whole table). */
fsdpc_status_t nn_embedding_shard(nn_ctx_t *ctx, nn_var_t *ids, nn_param_t *w, int64_t first,
                                  int64_t vocab, nn_var_t **out);
/* RMSNorm over the last dimension with weight w [D], computed in fp32. */
fsdpc_status_t nn_rmsnorm(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, double eps, nn_var_t **out);

/* Rotary embedding (rotate_half) of x [B, T, H, Dh] at positions 0..T-1 with rope's
 * frequencies; rope must stay valid until the backward has run (a model's config). */
fsdpc_status_t nn_rope(nn_ctx_t *ctx, nn_var_t *x, const rope_t *rope, nn_var_t **out);

/* Causal grouped-query attention: q [B, T, H, Dh], k and v [B, T, Hkv, Dh]. */
fsdpc_status_t nn_attention(nn_ctx_t *ctx, nn_var_t *q, nn_var_t *k, nn_var_t *v, nn_var_t **out);

/* y[..., D] = x[..., D] + b with b [D] (a parameter). */
fsdpc_status_t nn_bias_add(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *b, nn_var_t **out);

/* act(x) elementwise: KERNEL_ACT_RELU, KERNEL_ACT_GELU (exact, erf form), KERNEL_ACT_SILU,
 * KERNEL_ACT_GELU_TANH (GPT-2's tanh form), KERNEL_ACT_SIGMOID. */
fsdpc_status_t nn_activation(nn_ctx_t *ctx, nn_var_t *x, kernel_act_t act, nn_var_t **out);

/* LayerNorm over the last dimension (PyTorch's: biased variance, eps inside the square root)
 * with weight w [D] and bias b [D] (b may be NULL), computed in fp32. */
fsdpc_status_t nn_layernorm(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, nn_param_t *b, double eps,
                            nn_var_t **out);

/* silu(gate) * up. */
fsdpc_status_t nn_silu_mul(nn_ctx_t *ctx, nn_var_t *gate, nn_var_t *up, nn_var_t **out);

/* a + b (same shape). */
fsdpc_status_t nn_add(nn_ctx_t *ctx, nn_var_t *a, nn_var_t *b, nn_var_t **out);

/* alpha * x. */
fsdpc_status_t nn_scale(nn_ctx_t *ctx, nn_var_t *x, double alpha, nn_var_t **out);

/* x in dtype (a new reference to x when it already is); the gradient flows back in x's. */
fsdpc_status_t nn_cast(nn_ctx_t *ctx, nn_var_t *x, dtype_t dtype, nn_var_t **out);

/* x seen with another shape of the same number of elements (no copy). */
fsdpc_status_t nn_view(nn_ctx_t *ctx, nn_var_t *x, int ndim, const int64_t *shape, nn_var_t **out);

/* Mean token cross-entropy of logits [..., V] against targets [...] (I32/I64 tensor on the
 * logits' device; negative targets are ignored). *out is an F32 scalar variable; *n_tokens,
 * if not NULL, receives the number of counted targets. On a GPU nothing is read on the host
 * unless n_tokens is asked for: the loss and its gradient stay on the device. Targets that
 * are all ignored are refused (EINVAL) where the count is read (the CPU, or n_tokens); else
 * the loss is NaN. */
fsdpc_status_t nn_cross_entropy(nn_ctx_t *ctx, nn_var_t *logits, const fsdpc_tensor_t *targets,
                                nn_var_t **out, int64_t *n_tokens);

/* nn_cross_entropy whose backward writes the logits' gradient over their value, which the
 * gradient then owns: one logits-sized buffer instead of two, and none left once the gradient
 * has been used. After the backward, logits holds no value (nothing may read it); with a
 * gradient already present, or a strided value, it falls back to a buffer of its own. */
fsdpc_status_t nn_cross_entropy_consume(nn_ctx_t *ctx, nn_var_t *logits,
                                        const fsdpc_tensor_t *targets, nn_var_t **out,
                                        int64_t *n_tokens);

/* Mean squared error mean((pred - target)^2) over every element (target: a tensor of pred's
 * shape, any float dtype, on pred's device); *out is an F32 scalar variable. Blocks to read
 * the sum. */
fsdpc_status_t nn_mse_loss(nn_ctx_t *ctx, nn_var_t *pred, const fsdpc_tensor_t *target,
                           nn_var_t **out);

/* The value of a one-element variable on the host (blocks). */
fsdpc_status_t nn_var_scalar(const nn_var_t *v, double *out);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
