/*
 * Private interface between kernels.c (argument checks) and the compute backends. Each
 * backend fills one kernel_ops_t with labelled initialisers; arguments arrive checked.
 */
#ifndef FSDPC_BASE_KERNELS_IMPL_H
#define FSDPC_BASE_KERNELS_IMPL_H

#include "core/kernels.h"
#include "core/moe_route_impl.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Matrix sizes of a checked kernel_matmul call: op(a) is [m, k], op(b) is [k, n]; lda and
 * ldb are the row lengths of a and b as stored. */
typedef struct matmul_dims {
  int64_t m, n, k, lda, ldb;
} matmul_dims_t;

typedef struct kernel_ops {
  fsdpc_status_t (*matmul)(fsdpc_tensor_t *out, const fsdpc_tensor_t *a, bool trans_a,
                           const fsdpc_tensor_t *b, bool trans_b, float alpha, float beta,
                           const matmul_dims_t *d);
  /* NULL: kernel_matmul_many runs matmul on each product; d[i] are p[i]'s sizes */
  fsdpc_status_t (*matmul_many)(const kernel_product_t *p, const matmul_dims_t *d, int n,
                                bool trans_a, bool trans_b, float alpha, float beta);
  /* table holds rows [first, first + V) of a vocabulary of `vocab` ids (first = 0 and
   * vocab = V when whole): ids outside the rows give zero rows and no gradient */
  fsdpc_status_t (*embedding)(fsdpc_tensor_t *out, const fsdpc_tensor_t *table,
                              const fsdpc_tensor_t *ids, int64_t first, int64_t vocab);
  fsdpc_status_t (*embedding_backward)(fsdpc_tensor_t *grad_table, const fsdpc_tensor_t *grad_out,
                                       const fsdpc_tensor_t *ids, int64_t first, int64_t vocab);
  fsdpc_status_t (*rmsnorm)(fsdpc_tensor_t *out, fsdpc_tensor_t *rstd, const fsdpc_tensor_t *x,
                            const fsdpc_tensor_t *w, float eps);
  fsdpc_status_t (*rmsnorm_backward)(fsdpc_tensor_t *dx, fsdpc_tensor_t *dw,
                                     const fsdpc_tensor_t *dy, const fsdpc_tensor_t *x,
                                     const fsdpc_tensor_t *w, const fsdpc_tensor_t *rstd);
  fsdpc_status_t (*rope)(fsdpc_tensor_t *out, const fsdpc_tensor_t *x, const rope_t *rope,
                         int64_t pos_offset, bool inverse);
  fsdpc_status_t (*attention)(fsdpc_tensor_t *out, fsdpc_tensor_t *lse, const fsdpc_tensor_t *q,
                              const fsdpc_tensor_t *k, const fsdpc_tensor_t *v);
  fsdpc_status_t (*attention_backward)(fsdpc_tensor_t *dq, fsdpc_tensor_t *dk, fsdpc_tensor_t *dv,
                                       const fsdpc_tensor_t *dout, const fsdpc_tensor_t *q,
                                       const fsdpc_tensor_t *k, const fsdpc_tensor_t *v,
                                       const fsdpc_tensor_t *out, const fsdpc_tensor_t *lse);
  fsdpc_status_t (*silu_mul)(fsdpc_tensor_t *out, const fsdpc_tensor_t *gate,
                             const fsdpc_tensor_t *up);
  fsdpc_status_t (*silu_mul_backward)(fsdpc_tensor_t *dgate, fsdpc_tensor_t *dup,
                                      const fsdpc_tensor_t *dout, const fsdpc_tensor_t *gate,
                                      const fsdpc_tensor_t *up);
  fsdpc_status_t (*moe_combine)(fsdpc_tensor_t *out, const fsdpc_tensor_t *y,
                                const fsdpc_tensor_t *w, const fsdpc_tensor_t *offs,
                                const fsdpc_tensor_t *rows);
  fsdpc_status_t (*moe_combine_backward)(fsdpc_tensor_t *dy, fsdpc_tensor_t *dw,
                                         const fsdpc_tensor_t *dout, const fsdpc_tensor_t *y,
                                         const fsdpc_tensor_t *w, const fsdpc_tensor_t *slots,
                                         const fsdpc_tensor_t *offs, const fsdpc_tensor_t *rows);
  /* bias and g may be NULL; a holds E, k, norm, sigmoid and scale */
  fsdpc_status_t (*moe_route)(fsdpc_tensor_t *p, fsdpc_tensor_t *experts, fsdpc_tensor_t *w,
                              const fsdpc_tensor_t *z, const fsdpc_tensor_t *bias,
                              const moe_route_args_t *a);
  fsdpc_status_t (*moe_route_backward)(fsdpc_tensor_t *dz, const fsdpc_tensor_t *dw,
                                       const fsdpc_tensor_t *w, const fsdpc_tensor_t *p,
                                       const fsdpc_tensor_t *experts, const fsdpc_tensor_t *g,
                                       const moe_route_args_t *a);
  fsdpc_status_t (*activation)(fsdpc_tensor_t *out, const fsdpc_tensor_t *x, kernel_act_t act);
  fsdpc_status_t (*activation_backward)(fsdpc_tensor_t *dx, const fsdpc_tensor_t *dy,
                                        const fsdpc_tensor_t *x, kernel_act_t act);
  fsdpc_status_t (*bias_add)(fsdpc_tensor_t *out, const fsdpc_tensor_t *x, const fsdpc_tensor_t *b);
  fsdpc_status_t (*bias_backward)(fsdpc_tensor_t *db, const fsdpc_tensor_t *dy);
  /* b and db may be NULL */
  fsdpc_status_t (*layernorm)(fsdpc_tensor_t *out, fsdpc_tensor_t *mean, fsdpc_tensor_t *rstd,
                              const fsdpc_tensor_t *x, const fsdpc_tensor_t *w,
                              const fsdpc_tensor_t *b, float eps);
  fsdpc_status_t (*layernorm_backward)(fsdpc_tensor_t *dx, fsdpc_tensor_t *dw, fsdpc_tensor_t *db,
                                       const fsdpc_tensor_t *dy, const fsdpc_tensor_t *x,
                                       const fsdpc_tensor_t *w, const fsdpc_tensor_t *mean,
                                       const fsdpc_tensor_t *rstd);
  fsdpc_status_t (*add)(fsdpc_tensor_t *out, const fsdpc_tensor_t *a, const fsdpc_tensor_t *b);
  fsdpc_status_t (*axpy)(fsdpc_tensor_t *y, float alpha, const fsdpc_tensor_t *x);
  fsdpc_status_t (*scale)(fsdpc_tensor_t *x, float alpha);
  fsdpc_status_t (*cross_entropy)(fsdpc_tensor_t *losses, const fsdpc_tensor_t *logits,
                                  const fsdpc_tensor_t *targets);
  /* count: NULL, or kernel_masked_mean's count with dloss: the scale is then dloss[0] /
   * count[0], read on the device (see kernel_cross_entropy_backward_mean) */
  fsdpc_status_t (*cross_entropy_backward)(fsdpc_tensor_t *dlogits, const fsdpc_tensor_t *logits,
                                           const fsdpc_tensor_t *targets, float scale,
                                           const fsdpc_tensor_t *dloss,
                                           const fsdpc_tensor_t *count);
  fsdpc_status_t (*masked_mean)(fsdpc_tensor_t *mean, fsdpc_tensor_t *count,
                                const fsdpc_tensor_t *values, const fsdpc_tensor_t *targets);
  fsdpc_status_t (*adamw)(fsdpc_tensor_t *p, const fsdpc_tensor_t *g, fsdpc_tensor_t *m,
                          fsdpc_tensor_t *v, const adamw_args_t *args);
  /* NULL: adamw on each (the items arrive checked, n > 0) */
  fsdpc_status_t (*adamw_many)(const adamw_item_t *items, int n);
  fsdpc_status_t (*sum_squares)(const fsdpc_tensor_t *x, double *out);
  /* NULL: sum_squares on each (the tensors arrive checked, n > 0) */
  fsdpc_status_t (*sum_squares_many)(const fsdpc_tensor_t *const *xs, int n, double *out);
  /* Device timers for profiling (NULL: the wall clock): start on dev's current stream (NULL
   * when none could be made), stop after the call, read later (waits, then frees). */
  void *(*timer_start)(device_t dev);
  void (*timer_stop)(void *timer);
  fsdpc_status_t (*timer_read)(void *timer, double *seconds);
} kernel_ops_t;

const kernel_ops_t *cpu_kernels(void);

/* What a RoPE table depends on: the rotary embedding, the head size and positions
 * [p0, p0 + T). Both backends keep the table of their last call under its key. */
typedef struct rope_key {
  rope_t rope;
  int64_t Dh, p0, T;
} rope_key_t;

/* Whether two keys give the same table. */
bool rope_key_equal(const rope_key_t *a, const rope_key_t *b);
/* The table both backends compute RoPE from (T * Dh floats): cs[t * Dh + 2i] and
 * cs[t * Dh + 2i + 1] are the cosine and sine of the angle (p0 + t) * rope_inv_freq(rope, i,
 * Dh), computed in double and rounded to float. */
void rope_fill_table(const rope_key_t *k, float *cs);

/* A timed call for the profile of core/kernels.h (kernel_profile_enabled() first): begin
 * before the work on dev, end after it with its name (a string that outlives the process's
 * profile) and the bytes it read and wrote (0: not a copy); returns st. */
typedef struct kernel_prof {
  const kernel_ops_t *ops;
  void *timer;
  double t0;
} kernel_prof_t;
void kernel_prof_begin(kernel_prof_t *c, device_t dev);
fsdpc_status_t kernel_prof_end(kernel_prof_t *c, const char *name, double bytes, fsdpc_status_t st);

/* NULL when the library was built without CUDA. */
const kernel_ops_t *cuda_kernels(void);

#ifdef __cplusplus
}
#endif

#endif
