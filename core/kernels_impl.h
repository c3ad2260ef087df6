/*
 * Private interface between kernels.c (argument checks) and the compute backends. Each
 * backend fills one kernel_ops_t with labelled initialisers; arguments arrive checked.
 */
#ifndef FSDPC_BASE_KERNELS_IMPL_H
#define FSDPC_BASE_KERNELS_IMPL_H

#include "core/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Matrix sizes of a checked kernel_matmul call: op(a) is [m, k], op(b) is [k, n]; lda and
 * ldb are the row lengths of a and b as stored. */
typedef struct matmul_dims {
  int64_t m, n, k, lda, ldb;
} matmul_dims_t;

typedef struct kernel_ops {
  status_t (*matmul)(tensor_t *out, const tensor_t *a, bool trans_a, const tensor_t *b,
                     bool trans_b, float alpha, float beta, const matmul_dims_t *d);
  /* table holds rows [first, first + V) of a vocabulary of `vocab` ids (first = 0 and
   * vocab = V when whole): ids outside the rows give zero rows and no gradient */
  status_t (*embedding)(tensor_t *out, const tensor_t *table, const tensor_t *ids, int64_t first,
                        int64_t vocab);
  status_t (*embedding_backward)(tensor_t *grad_table, const tensor_t *grad_out,
                                 const tensor_t *ids, int64_t first, int64_t vocab);
  status_t (*rmsnorm)(tensor_t *out, tensor_t *rstd, const tensor_t *x, const tensor_t *w,
                      float eps);
  status_t (*rmsnorm_backward)(tensor_t *dx, tensor_t *dw, const tensor_t *dy, const tensor_t *x,
                               const tensor_t *w, const tensor_t *rstd);
  status_t (*rope)(tensor_t *out, const tensor_t *x, const rope_t *rope, int64_t pos_offset,
                   bool inverse);
  status_t (*attention)(tensor_t *out, tensor_t *lse, const tensor_t *q, const tensor_t *k,
                        const tensor_t *v);
  status_t (*attention_backward)(tensor_t *dq, tensor_t *dk, tensor_t *dv, const tensor_t *dout,
                                 const tensor_t *q, const tensor_t *k, const tensor_t *v,
                                 const tensor_t *out, const tensor_t *lse);
  status_t (*silu_mul)(tensor_t *out, const tensor_t *gate, const tensor_t *up);
  status_t (*silu_mul_backward)(tensor_t *dgate, tensor_t *dup, const tensor_t *dout,
                                const tensor_t *gate, const tensor_t *up);
  status_t (*activation)(tensor_t *out, const tensor_t *x, kernel_act_t act);
  status_t (*activation_backward)(tensor_t *dx, const tensor_t *dy, const tensor_t *x,
                                  kernel_act_t act);
  status_t (*bias_add)(tensor_t *out, const tensor_t *x, const tensor_t *b);
  status_t (*bias_backward)(tensor_t *db, const tensor_t *dy);
  /* b and db may be NULL */
  status_t (*layernorm)(tensor_t *out, tensor_t *mean, tensor_t *rstd, const tensor_t *x,
                        const tensor_t *w, const tensor_t *b, float eps);
  status_t (*layernorm_backward)(tensor_t *dx, tensor_t *dw, tensor_t *db, const tensor_t *dy,
                                 const tensor_t *x, const tensor_t *w, const tensor_t *mean,
                                 const tensor_t *rstd);
  status_t (*add)(tensor_t *out, const tensor_t *a, const tensor_t *b);
  status_t (*axpy)(tensor_t *y, float alpha, const tensor_t *x);
  status_t (*scale)(tensor_t *x, float alpha);
  status_t (*cross_entropy)(tensor_t *losses, const tensor_t *logits, const tensor_t *targets);
  /* count: NULL, or kernel_masked_mean's count with dloss: the scale is then dloss[0] /
   * count[0], read on the device (see kernel_cross_entropy_backward_mean) */
  status_t (*cross_entropy_backward)(tensor_t *dlogits, const tensor_t *logits,
                                     const tensor_t *targets, float scale, const tensor_t *dloss,
                                     const tensor_t *count);
  status_t (*masked_mean)(tensor_t *mean, tensor_t *count, const tensor_t *values,
                          const tensor_t *targets);
  status_t (*adamw)(tensor_t *p, const tensor_t *g, tensor_t *m, tensor_t *v,
                    const adamw_args_t *args);
  /* NULL: adamw on each (the items arrive checked, n > 0) */
  status_t (*adamw_many)(const adamw_item_t *items, int n);
  status_t (*sum_squares)(const tensor_t *x, double *out);
  /* NULL: sum_squares on each (the tensors arrive checked, n > 0) */
  status_t (*sum_squares_many)(const tensor_t *const *xs, int n, double *out);
  /* Device timers for profiling (NULL: the wall clock): start on dev's current stream (NULL
   * when none could be made), stop after the call, read later (waits, then frees). */
  void *(*timer_start)(device_t dev);
  void (*timer_stop)(void *timer);
  status_t (*timer_read)(void *timer, double *seconds);
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
status_t kernel_prof_end(kernel_prof_t *c, const char *name, double bytes, status_t st);

/* NULL when the library was built without CUDA. */
const kernel_ops_t *cuda_kernels(void);

#ifdef __cplusplus
}
#endif

#endif
