/*
 * Private to the CPU kernels (backends/cpu/kernels_cpu*.c): fp32 views of tensors of any float
 * dtype, an exponential the compiler can vectorise, and the split of a kernel's work over the
 * kernel threads (kernel_cpu_threads). kernels_cpu.c holds the threads, the matrix products and the
 * embedding; kernels_cpu_attention.c RoPE and attention; kernels_cpu_rows.c the kernels that
 * reduce rows (RMSNorm, LayerNorm, cross-entropy); kernels_cpu_pointwise.c the element-wise
 * kernels, AdamW and the sum of squares.
 */
#ifndef FSDPC_BASE_KERNELS_CPU_H
#define FSDPC_BASE_KERNELS_CPU_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "core/kernels_impl.h"

/* Element-wise kernels built three times with GCC, for the baseline x86-64 (4 lanes), AVX2
 * (8 lanes) and AVX-512 (16 lanes), the copy chosen when the library loads (an ifunc): the
 * same IEEE operations in each (no FMA contraction: -ffp-contract=off), so the same bits on
 * every machine. Not for reductions, whose lane count would change their order, unless their
 * lanes are explicit (cpu_lane_sum). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define WIDE __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDE
#endif

/* e^x in fp32 with the operations a loop can vectorise (glibc's expf is a call per element):
 * x = n ln2 + r with n rounded to nearest (by the 1.5 * 2^23 shift) and ln2 in two parts,
 * e^r by Cephes' degree-6 polynomial on |r| <= ln2/2, times 2^n built in the exponent bits:
 * within 1 ulp of e^x (0.97 measured over [-87, 88]). Inputs are clamped to [-87.3, 88.37],
 * so the extremes give about 1.2e-38 and 2.4e38 instead of 0 and infinity (enough for softmax
 * and sigmoid); NaN stays NaN. */
static inline float exp_f32(float x) {
  /* (NaN fails both tests: clamped to -87.3, its integer part stays defined; returned below) */
  float c = x > -87.3f ? (x < 88.37f ? x : 88.37f) : -87.3f;
  float t = c * 1.44269504088896341f;
  float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest */
  float r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return x == x ? p * scale : x;
}

/* ---- fp32 views of tensors of any float dtype ---- */

typedef struct fbuf { /* one tensor's fp32 view: F32 tensors in place, others converted */
  float *p;
  int64_t n;
  bool owned; /* a converted copy that must be stored back (outputs) and freed */
} fbuf_t;

/* The fp32 views of one kernel's tensors, taken in turn and ended together: a kernel takes its
 * views, returns cpu_fbufs_end(&s, STATUS_OK) when s.st says one failed, and otherwise does its
 * work and ends the same way. */
#define CPU_FBUFS_MAX 8
typedef struct fbufs {
  fbuf_t b[CPU_FBUFS_MAX];
  fsdpc_tensor_t *out[CPU_FBUFS_MAX]; /* where an output view is stored back; NULL for inputs */
  int n;
  fsdpc_status_t st; /* the first failure: nothing more is taken after it */
} fbufs_t;

/* Read access to t; NULL for a NULL t or once s has failed. */
const float *cpu_fbufs_in(fbufs_t *s, const fsdpc_tensor_t *t);
/* Write access to t, stored back by cpu_fbufs_end; with load, t's values are read first. NULL
 * for a NULL t or once s has failed. */
float *cpu_fbufs_out(fbufs_t *s, fsdpc_tensor_t *t, bool load);
/* Ends every view of s: the outputs are stored back (rounding once) when neither s nor st holds
 * a failure, and every view is released. Returns s's failure, else st. */
fsdpc_status_t cpu_fbufs_end(fbufs_t *s, fsdpc_status_t st);

/* Element i of t's buffer. */
static inline void *elem_at(const fsdpc_tensor_t *t, int64_t i) {
  return (char *)t->data + (size_t)i * dtype_size(t->dtype);
}

/* Elements converted at a time by the kernels' loops for other dtypes than F32. */
enum { TILE = 512 };

static inline int64_t index_at(const fsdpc_tensor_t *t, int64_t i) {
  return t->dtype == DTYPE_I32 ? ((const int32_t *)t->data)[i] : ((const int64_t *)t->data)[i];
}

static inline int64_t last_dim(const fsdpc_tensor_t *t) {
  return t->ndim == 0 ? 1 : t->shape[t->ndim - 1];
}

/* ---- row sums ----
 * In double (defined in kernels_cpu_pointwise.c): fp32 rounding noise in these sums would
 * turn the last-bit differences between an FSDP run and the one-rank run (matrix products of
 * other batch sizes) into parameter differences above 1e-5 in ten steps. */

/* The sum of a[i] b[i] c[i] over i < n, or of a[i] b[i] when c is NULL, products in double
 * (outside the vector copies: the lane count sets the order). */
double cpu_sum_products(const float *a, const float *b, const float *c, int64_t n);
/* The sum of exp_f32(x[i] - shift) over i < n, each exponential also stored in e[i] unless e
 * is NULL (e may be x): softmax and log-sum-exp with one exponential per value. Summed in 8
 * double lanes of a fixed order, so the bits are the same for every vector width. */
double cpu_exp_sum(float *e, const float *x, int64_t n, float shift);
/* The largest of x[0..n), -INFINITY when n is 0 (NaNs are passed over). */
float cpu_max(const float *x, int64_t n);

/* Lanes of cpu_exp_sum and cpu_lane_sum: lane l adds the values l, l + EXP_LANES, ... in order,
 * then the lanes are added pairwise. */
enum { EXP_LANES = 8 };

/* The sum of x[0..n) in double, in cpu_exp_sum's order: the sum it returns for the same
 * exponentials (zeros after them change nothing). Inline, for the kernels' vector copies. */
static inline double cpu_lane_sum(const float *x, int64_t n) {
  double lane[EXP_LANES] = {0};
  int64_t i = 0;
  for (; i + EXP_LANES <= n; i += EXP_LANES) {
#pragma omp simd
    for (int l = 0; l < EXP_LANES; l++) lane[l] += x[i + l];
  }
  for (int l = 0; i < n; i++, l++) lane[l] += x[i];
  for (int w = EXP_LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) lane[l] += lane[l + w];
  return lane[0];
}

/* ---- threads ---- */

enum {
  GEMM_GRAIN = 1 << 18, /* multiply-adds per thread, at least */
  ELEM_GRAIN = 1 << 14, /* elements (or element-sized steps) per thread, at least */
};

/* A share of a kernel's work: items [i0, i1), the share's number t < kernel_cpu_threads(). */
typedef void share_fn(const void *ctx, int t, int64_t i0, int64_t i1);

/* fn over [0, n) in one share per thread, each a whole number of `align` items but the last,
 * on as many threads as give each at least `grain` units of work, where one item is `work`
 * units; on one thread, fn(ctx, 0, 0, n). */
void cpu_for_shares(int64_t n, int64_t work, int64_t grain, int64_t align, share_fn *fn,
                    const void *ctx);

/* Fill their kernels into the CPU's table. */
void cpu_attention_kernels(kernel_ops_t *ops);
void cpu_row_kernels(kernel_ops_t *ops);
void cpu_pointwise_kernels(kernel_ops_t *ops);

#endif
