/*
 * Compute kernels of the reference model, one semantics on every device: the CPU twin uses
 * OpenBLAS for matrix products and plain C elsewhere; the CUDA twin uses cuBLAS and CUDA
 * kernels. Each function checks its arguments (same device, contiguous, shapes, dtypes) and
 * then calls the backend of the tensors' device, on that device's current stream.
 *
 *   // y[N, out] = x[N, in] @ w[out, in]^T
 *   FSDPC_TRY(kernel_matmul(&y, &x, false, &w, true, 1.0f, 0.0f));
 *
 * Conventions shared by all kernels:
 * - Every tensor is contiguous and all tensors of one call are on one device.
 * - "Float" tensors are F32, BF16 or F16; the values of one call share one float dtype, except
 *   where a parameter says F32 (statistics, losses, optimizer moments, gradient accumulators).
 *   Arithmetic is in fp32 whatever the storage dtype; results are rounded once to nearest-even.
 * - Leading dimensions are batch dimensions: a [B, T, D] activation is [B*T, D] to a kernel
 *   that works on rows.
 * - "accumulates" means out += result; "writes" means out = result.
 * None of these functions allocates memory that outlives the call, and none is collective.
 */
#ifndef FSDPC_BASE_KERNELS_H
#define FSDPC_BASE_KERNELS_H

#include <math.h>
#include <stdbool.h>
#include <stdio.h>

#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* out = alpha * op(a) @ op(b) + beta * out, where op(x) is x or x^T, a and b viewed as
 * matrices [numel/last, last]. op(a) is [M, K], op(b) is [K, N], out has M*N elements and
 * last dimension N. a, b and out share one float dtype; accumulation is fp32. */
fsdpc_status_t kernel_matmul(fsdpc_tensor_t *out, const fsdpc_tensor_t *a, bool trans_a,
                             const fsdpc_tensor_t *b, bool trans_b, float alpha, float beta);

/* One product of kernel_matmul_many: out = alpha * op(a) @ op(b) + beta * out. */
typedef struct kernel_product {
  fsdpc_tensor_t *out;
  const fsdpc_tensor_t *a, *b;
} kernel_product_t;

/* The n products p[0..n) as kernel_matmul would run them one by one, with one trans_a, trans_b,
 * alpha and beta: each product checked as kernel_matmul checks it, all of one float dtype and
 * device, their outputs apart from each other and from every operand. A mixture of experts' blocks
 * take one for each expert that got tokens. On CUDA devices they run as one grouped cuBLAS call
 * (cublasGemmGroupedBatchedEx; see kernel_matmul_set_grouped) rather than a call each. */
fsdpc_status_t kernel_matmul_many(const kernel_product_t *p, int n, bool trans_a, bool trans_b,
                                  float alpha, float beta);

/* out[..., D] = table[ids[...], :]; ids are I32 or I64 in [0, V). */
fsdpc_status_t kernel_embedding(fsdpc_tensor_t *out, const fsdpc_tensor_t *table,
                                const fsdpc_tensor_t *ids);

/* grad_table[ids[i], :] += grad_out[i, :] (accumulates). grad_table may be F32 while grad_out
 * is a narrower float dtype. */
fsdpc_status_t kernel_embedding_backward(fsdpc_tensor_t *grad_table, const fsdpc_tensor_t *grad_out,
                                         const fsdpc_tensor_t *ids);

/* The same on a vocabulary shard: table holds rows [first, first + V) of a vocabulary of
 * `vocab` ids; ids must lie in [0, vocab), and those outside the shard give zero rows
 * (forward) and no gradient (backward). */
fsdpc_status_t kernel_embedding_shard(fsdpc_tensor_t *out, const fsdpc_tensor_t *table,
                                      const fsdpc_tensor_t *ids, int64_t first, int64_t vocab);
fsdpc_status_t kernel_embedding_shard_backward(fsdpc_tensor_t *grad_table,
                                               const fsdpc_tensor_t *grad_out,
                                               const fsdpc_tensor_t *ids, int64_t first,
                                               int64_t vocab);

/* RMSNorm over the last dimension: rstd = 1/sqrt(mean(x^2) + eps) (F32, one per row),
 * out = w * (x * rstd rounded to x's dtype). Writes out and rstd. */
fsdpc_status_t kernel_rmsnorm(fsdpc_tensor_t *out, fsdpc_tensor_t *rstd, const fsdpc_tensor_t *x,
                              const fsdpc_tensor_t *w, float eps);

/* Writes dx, accumulates dw (dw may be F32). */
fsdpc_status_t kernel_rmsnorm_backward(fsdpc_tensor_t *dx, fsdpc_tensor_t *dw,
                                       const fsdpc_tensor_t *dy, const fsdpc_tensor_t *x,
                                       const fsdpc_tensor_t *w, const fsdpc_tensor_t *rstd);

/* The rotary embedding's frequencies, as Hugging Face's rope types define them: pair i of a
 * head of size Dh turns by inv_freq(i) = theta^(-2i/Dh) radians per position (ROPE_DEFAULT),
 * that divided by factor (ROPE_LINEAR), or llama3's frequency-dependent scaling (ROPE_LLAMA3):
 * with wavelength w = 2 pi / inv_freq and L = original_max_pos, frequencies with
 * w < L / high_freq_factor keep their value, those with w > L / low_freq_factor are divided by
 * factor, and those between are interpolated: s = (L / w - low_freq_factor) /
 * (high_freq_factor - low_freq_factor), inv_freq * ((1 - s) / factor + s). */
typedef enum rope_scaling { ROPE_DEFAULT, ROPE_LINEAR, ROPE_LLAMA3 } rope_scaling_t;

typedef struct rope {
  double theta;
  rope_scaling_t scaling;
  double factor;                            /* ROPE_LINEAR and ROPE_LLAMA3 */
  double low_freq_factor, high_freq_factor; /* ROPE_LLAMA3 */
  double original_max_pos;                  /* ROPE_LLAMA3: original_max_position_embeddings */
} rope_t;

/* Checks a rope_t: theta positive; for the scaled types a positive factor; for llama3 a
 * positive original_max_pos and 0 < low_freq_factor < high_freq_factor. Errors name the
 * Hugging Face key. */
fsdpc_status_t rope_check(const rope_t *r);

#ifdef __CUDACC__
#define ROPE_HOST_DEVICE __host__ __device__
#else
#define ROPE_HOST_DEVICE
#endif

/* inv_freq(i) for pair i of a head of size dh; one definition for the host and the device. */
static inline ROPE_HOST_DEVICE double rope_inv_freq(const rope_t *r, int64_t i, int64_t dh) {
  if (r == NULL || dh <= 0) return 0.0;
  double f = pow(r->theta, -2.0 * (double)i / (double)dh);
  if (r->scaling == ROPE_LINEAR) return f / r->factor;
  if (r->scaling != ROPE_LLAMA3) return f;
  double wavelen = 6.283185307179586 / f;
  if (wavelen < r->original_max_pos / r->high_freq_factor) return f;
  if (wavelen > r->original_max_pos / r->low_freq_factor) return f / r->factor;
  double s = (r->original_max_pos / wavelen - r->low_freq_factor) /
             (r->high_freq_factor - r->low_freq_factor);
  return f * ((1 - s) / r->factor + s);
}

/* Rotary embedding with the rotate_half convention on x [B, T, H, Dh] (Dh even): for pair
 * (i, i + Dh/2) at position t + pos_offset, angle = pos * rope_inv_freq(rope, i, Dh). inverse
 * rotates by -angle, which is the backward of the forward rotation. out may be x (in place). */
fsdpc_status_t kernel_rope(fsdpc_tensor_t *out, const fsdpc_tensor_t *x, const rope_t *rope,
                           int64_t pos_offset, bool inverse);

/* Causal softmax attention with grouped-query heads: q [B, T, H, Dh], k and v [B, T, Hkv, Dh],
 * H a multiple of Hkv (query head h reads kv head h / (H/Hkv)), scale 1/sqrt(Dh).
 * Writes out [B, T, H, Dh] and lse [B, H, T] (F32 log-sum-exp of the scaled scores). */
fsdpc_status_t kernel_attention(fsdpc_tensor_t *out, fsdpc_tensor_t *lse, const fsdpc_tensor_t *q,
                                const fsdpc_tensor_t *k, const fsdpc_tensor_t *v);

/* Writes dq, dk, dv from dout and the forward's inputs, output and lse. */
fsdpc_status_t kernel_attention_backward(fsdpc_tensor_t *dq, fsdpc_tensor_t *dk, fsdpc_tensor_t *dv,
                                         const fsdpc_tensor_t *dout, const fsdpc_tensor_t *q,
                                         const fsdpc_tensor_t *k, const fsdpc_tensor_t *v,
                                         const fsdpc_tensor_t *out, const fsdpc_tensor_t *lse);

/* On CUDA devices matrix products run cuBLASLt with an algorithm chosen once per shape (and
 * operand alignment) and kept, so a shape gives the same bits on every run; a product cuBLASLt
 * refuses runs cublasGemmEx. FSDPC_CUBLASLT=0 in the environment (whatever kernel_matmul_set_lt
 * says), or kernel_matmul_set_lt(false), keeps to the latter. kernel_matmul_lt_runs counts the
 * products that ran cuBLASLt in this process; kernel_matmul_lt_note says why the last one that
 * could not, did not ("" when none has). kernel_matmul_lt_off says what keeps every product off
 * cuBLASLt ("FSDPC_CUBLASLT=0", "kernel_matmul_set_lt(false)", a build without CUDA), "" when
 * nothing does. */
void kernel_matmul_set_lt(bool on);
const char *kernel_matmul_lt_off(void);
int64_t kernel_matmul_lt_runs(void);
const char *kernel_matmul_lt_note(void);

/* On CUDA devices kernel_matmul_many runs its products as one cublasGemmGroupedBatchedEx where
 * the loaded cuBLAS has it (CUDA 12.5 on) and every operand starts on a 16-byte boundary with rows
 * of a multiple of 16 bytes; otherwise it runs them one by one as kernel_matmul does.
 * FSDPC_GROUPED_GEMM=0 in the environment (whatever kernel_matmul_set_grouped says), or
 * kernel_matmul_set_grouped(false), keeps to the latter. kernel_matmul_grouped_runs counts the
 * grouped calls in this process; kernel_matmul_grouped_note says why the last call that could
 * not, did not ("" when none has); kernel_matmul_grouped_off what keeps every call off it
 * ("FSDPC_GROUPED_GEMM=0", "kernel_matmul_set_grouped(false)", a build without CUDA), "" when
 * nothing does. */
void kernel_matmul_set_grouped(bool on);
const char *kernel_matmul_grouped_off(void);
int64_t kernel_matmul_grouped_runs(void);
const char *kernel_matmul_grouped_note(void);

/* On CUDA devices attention runs cuDNN's fused flash attention when libcudnn.so.9 loads and
 * takes the call (bf16 or f16, head dim a multiple of 8 up to 256), and batched cuBLAS products
 * otherwise (f32 among them). FSDPC_CUDNN_ATTENTION=0 in the environment (whatever
 * kernel_attention_set_fused says), or kernel_attention_set_fused(false), keeps to the latter,
 * whose backward gives the same bits on every run (cuDNN's adds dq's shares with atomics).
 * kernel_attention_fused_runs counts the calls (forward and backward) that ran cuDNN in this
 * process; kernel_attention_fused_note says why the last call that could not, did not ("" when none
 * has). Without CUDA: 0, and a note saying so. kernel_attention_fused_off says what keeps every
 * call off cuDNN ("FSDPC_CUDNN_ATTENTION=0", "kernel_attention_set_fused(false)", a build
 * without cuDNN or CUDA), "" when nothing does. */
void kernel_attention_set_fused(bool on);
const char *kernel_attention_fused_off(void);
int64_t kernel_attention_fused_runs(void);
const char *kernel_attention_fused_note(void);

/* out = silu(gate) * up, silu(x) = x / (1 + exp(-x)). */
fsdpc_status_t kernel_silu_mul(fsdpc_tensor_t *out, const fsdpc_tensor_t *gate,
                               const fsdpc_tensor_t *up);

/* Writes dgate and dup. */
fsdpc_status_t kernel_silu_mul_backward(fsdpc_tensor_t *dgate, fsdpc_tensor_t *dup,
                                        const fsdpc_tensor_t *dout, const fsdpc_tensor_t *gate,
                                        const fsdpc_tensor_t *up);

/* A mixture of experts' weighted sum back into token order (N tokens, k slots each, slot
 * s = t k + j): out[t, :] = sum over j of w[s] times the sum of the rows of y listed for s,
 * rows[offs[s]] .. rows[offs[s + 1] - 1] in order (none when equal). out [N, D], y [M, D] and w
 * (N k elements) share one float dtype; offs (N k + 1, from 0, nondecreasing, ending at M) and
 * rows (M, each in [0, M)) are I64. Writes out. */
fsdpc_status_t kernel_moe_combine(fsdpc_tensor_t *out, const fsdpc_tensor_t *y,
                                  const fsdpc_tensor_t *w, const fsdpc_tensor_t *offs,
                                  const fsdpc_tensor_t *rows);

/* Its gradients from dout [N, D]: dy[m, :] = w[slots[m]] dout[slots[m] / k, :] (slots I64 [M],
 * each row's slot: the inverse of offs and rows) and dw[s] = sum over the rows m listed for s
 * of y[m, :] . dout[s / k, :]. dy and dout share y's dtype, dw w's. Writes dy and dw. */
fsdpc_status_t kernel_moe_combine_backward(fsdpc_tensor_t *dy, fsdpc_tensor_t *dw,
                                           const fsdpc_tensor_t *dout, const fsdpc_tensor_t *y,
                                           const fsdpc_tensor_t *w, const fsdpc_tensor_t *slots,
                                           const fsdpc_tensor_t *offs, const fsdpc_tensor_t *rows);

/* A mixture of experts' routing of each token's logits z [N, E] (F32): p [N, E] (F32) its scores
 * (the softmax of the row; with sigmoid, each logit's sigmoid), experts [N, k] (I64) the k
 * largest scores, plus bias [E] (F32, for the choice alone) when not NULL, from the largest,
 * ties to the lower expert, and w [N, k] (F32) their weights: scale times the score, over the
 * chosen scores' sum when norm. 1 <= k <= min(E, 64). The scores are computed in f64 and rounded
 * once on every device, which then choose the same experts (but where their f64 exp differs in
 * the last bit at a rounding boundary, rarely). Writes p, experts and w. */
fsdpc_status_t kernel_moe_route(fsdpc_tensor_t *p, fsdpc_tensor_t *experts, fsdpc_tensor_t *w,
                                const fsdpc_tensor_t *z, const fsdpc_tensor_t *bias, int k,
                                bool norm, bool sigmoid, double scale);

/* Its backward: dz [N, E] (F32) from dw [N, k] (F32) through the forward's w, p and experts
 * (each in [0, E)), with its k, norm, sigmoid and scale; with g [E] (F32) not NULL, plus the
 * gradient of a loss whose derivative by p[t, e] is g[e] (the load-balancing loss), through the
 * softmax. Writes dz. */
fsdpc_status_t kernel_moe_route_backward(fsdpc_tensor_t *dz, const fsdpc_tensor_t *dw,
                                         const fsdpc_tensor_t *w, const fsdpc_tensor_t *p,
                                         const fsdpc_tensor_t *experts, const fsdpc_tensor_t *g,
                                         int k, bool norm, bool sigmoid, double scale);

/* Pointwise activations: ReLU max(x, 0); GELU x * Phi(x) = x/2 * (1 + erf(x / sqrt(2))) (the
 * exact form, PyTorch's default); SiLU x * sigmoid(x); GELU's tanh form
 * x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) (PyTorch's approximate="tanh", GPT-2's
 * gelu_new); sigmoid 1 / (1 + exp(-x)) (Qwen2-MoE's shared-expert gate). */
typedef enum kernel_act {
  KERNEL_ACT_RELU,
  KERNEL_ACT_GELU,
  KERNEL_ACT_SILU,
  KERNEL_ACT_GELU_TANH,
  KERNEL_ACT_SIGMOID,
  KERNEL_ACT_COUNT
} kernel_act_t;

/* out = act(x) (out may be x). */
fsdpc_status_t kernel_activation(fsdpc_tensor_t *out, const fsdpc_tensor_t *x, kernel_act_t act);

/* Writes dx = dy * act'(x) (dx may alias dy; ReLU's derivative at 0 is 0, as PyTorch's). */
fsdpc_status_t kernel_activation_backward(fsdpc_tensor_t *dx, const fsdpc_tensor_t *dy,
                                          const fsdpc_tensor_t *x, kernel_act_t act);

/* out[r, :] = x[r, :] + b for every row r of x [..., D], b [D] (out may be x). */
fsdpc_status_t kernel_bias_add(fsdpc_tensor_t *out, const fsdpc_tensor_t *x,
                               const fsdpc_tensor_t *b);

/* db += the sum over rows of dy [..., D], in row order (db [D] may be F32 while dy is
 * narrower). */
fsdpc_status_t kernel_bias_backward(fsdpc_tensor_t *db, const fsdpc_tensor_t *dy);

/* LayerNorm over the last dimension (PyTorch's): mean and rstd = 1/sqrt(var + eps) of each row
 * (biased variance; F32, one per row), out = (x - mean) * rstd * w + b, rounded once; b may be
 * NULL (no bias). Writes out, mean and rstd. */
fsdpc_status_t kernel_layernorm(fsdpc_tensor_t *out, fsdpc_tensor_t *mean, fsdpc_tensor_t *rstd,
                                const fsdpc_tensor_t *x, const fsdpc_tensor_t *w,
                                const fsdpc_tensor_t *b, float eps);

/* Writes dx, accumulates dw and db (db may be NULL; both may be F32). */
fsdpc_status_t kernel_layernorm_backward(fsdpc_tensor_t *dx, fsdpc_tensor_t *dw, fsdpc_tensor_t *db,
                                         const fsdpc_tensor_t *dy, const fsdpc_tensor_t *x,
                                         const fsdpc_tensor_t *w, const fsdpc_tensor_t *mean,
                                         const fsdpc_tensor_t *rstd);

/* out = a + b (out may alias a or b). */
fsdpc_status_t kernel_add(fsdpc_tensor_t *out, const fsdpc_tensor_t *a, const fsdpc_tensor_t *b);

/* y += alpha * x; y may be F32 while x is narrower. */
fsdpc_status_t kernel_axpy(fsdpc_tensor_t *y, float alpha, const fsdpc_tensor_t *x);

/* x *= alpha. */
fsdpc_status_t kernel_scale(fsdpc_tensor_t *x, float alpha);

/* Per-row cross-entropy of logits [N, V] against targets [N] (I32 or I64): losses[r] =
 * logsumexp(logits[r]) - logits[r, targets[r]] (F32 [N]); a negative target ignores the row
 * (loss 0). */
fsdpc_status_t kernel_cross_entropy(fsdpc_tensor_t *losses, const fsdpc_tensor_t *logits,
                                    const fsdpc_tensor_t *targets);

/* Writes dlogits = scale * (softmax(logits) - onehot(targets)); zero for ignored rows. */
fsdpc_status_t kernel_cross_entropy_backward(fsdpc_tensor_t *dlogits, const fsdpc_tensor_t *logits,
                                             const fsdpc_tensor_t *targets, float scale);

/* The mean of values [N] (F32) over the rows whose target is not negative, into mean (one F32
 * element: the sum in f64 divided by the count, rounded once; NaN when every target is
 * negative), and their count into count (one I64 element). Nothing is read on the host. */
fsdpc_status_t kernel_masked_mean(fsdpc_tensor_t *mean, fsdpc_tensor_t *count,
                                  const fsdpc_tensor_t *values, const fsdpc_tensor_t *targets);

/* kernel_cross_entropy_backward of the mean loss kernel_masked_mean made, times dloss (one F32
 * element): the scale dloss[0] / count[0] (count: kernel_masked_mean's), in f64 rounded to
 * f32, read where the tensors lie (no host read). */
fsdpc_status_t kernel_cross_entropy_backward_mean(fsdpc_tensor_t *dlogits,
                                                  const fsdpc_tensor_t *logits,
                                                  const fsdpc_tensor_t *targets,
                                                  const fsdpc_tensor_t *dloss,
                                                  const fsdpc_tensor_t *count);

/* One torch.optim.AdamW update of p with gradient g and F32 moments m, v (all same numel).
 * grad_scale multiplies each gradient element (as an F32 product) before the update, as a
 * separate kernel_scale of an F32 g would (clipping folded into the pass); 0 means 1. */
typedef struct adamw_args {
  double lr, beta1, beta2, eps, weight_decay; /* as torch's Python floats */
  int64_t step;                               /* 1-based: the step being taken */
  float grad_scale;
} adamw_args_t;
fsdpc_status_t kernel_adamw(fsdpc_tensor_t *p, const fsdpc_tensor_t *g, fsdpc_tensor_t *m,
                            fsdpc_tensor_t *v, const adamw_args_t *args);

/* kernel_adamw of n parameters at once, each with its own arguments, all on one device: the
 * same bits as n calls, on a GPU in one launch per few dozen parameters. Every item is checked
 * before any is updated; when an item fails its check, *failed (when not NULL) is its index,
 * else -1. */
typedef struct adamw_item {
  fsdpc_tensor_t *p;
  const fsdpc_tensor_t *g;
  fsdpc_tensor_t *m, *v;
  adamw_args_t args;
} adamw_item_t;
fsdpc_status_t kernel_adamw_many(const adamw_item_t *items, int n, int *failed);

/* *out = sum of x^2 in double precision (blocks until the value is on the host). */
fsdpc_status_t kernel_sum_squares(const fsdpc_tensor_t *x, double *out);

/* out[i] = kernel_sum_squares of xs[i] for n tensors on one device, the same bits; on a GPU
 * with one read back for all of them (and no atomics: the same bits on every run). */
fsdpc_status_t kernel_sum_squares_many(const fsdpc_tensor_t *const *xs, int n, double *out);

/* Threads of the CPU kernels: one unless OMP_NUM_THREADS asks for more (in a build with
 * OpenMP). With more, each kernel splits its work into one share per thread, computing every
 * value as on one thread, so the results are the same bits for any count; a matrix product is
 * split by rows of its output, each share computed by OpenBLAS on one thread, whose rounding may
 * depend on the share's shape: deterministic for a given count, within ~1e-6 across counts (the
 * same bits on OpenBLAS's Haswell and Zen kernels). On one kernel thread OPENBLAS_NUM_THREADS,
 * if set, still threads the matrix products alone. kernel_set_cpu_threads changes the count for
 * the process (n >= 1; above 1 needs OpenMP). */
int kernel_cpu_threads(void);
fsdpc_status_t kernel_set_cpu_threads(int n);

/* Kernel profiling: with FSDPC_PROFILE=1 in the environment (or kernel_profile_enable), every
 * kernel call is timed under its name (matmul, attention, rmsnorm_backward, ...), and so is
 * every tensor_copy within one device ("copy", or "copy (cast)" between dtypes, with the
 * bytes read and written): on a GPU the device time between events recorded around it on
 * its stream, on the CPU the wall time of the call. The memory-bound kernels (all but the
 * matrix products, attention and the embedding's backward) count the least bytes they move:
 * every operand read or written once, one both read and written twice. kernel_profile_report
 * prints calls, total and per-call milliseconds, each row's share and, where bytes were
 * counted, GB/s, slowest first, to out
 * (when not NULL; waiting for pending device timers) and gives the total in *total_seconds
 * (when not NULL); kernel_profile_reset starts over. Off, a call costs one branch more. */
bool kernel_profile_enabled(void);
void kernel_profile_enable(bool on);
void kernel_profile_reset(void);
fsdpc_status_t kernel_profile_report(FILE *out, double *total_seconds);

/* One name's totals since the last reset (device timers settled first): false when the name
 * has none. */
typedef struct kernel_profile_row {
  int64_t calls;
  double seconds, bytes; /* bytes: copies and memory-bound kernels (0 for the others) */
} kernel_profile_row_t;
bool kernel_profile_get(const char *name, kernel_profile_row_t *out);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
