/*
 * Causal grouped-query attention as batched matrix products (private to the library: both backends
 * run it): the order of the products, their operands and the row passes between them, apart from
 * who runs them. The CUDA backend runs the products with cuBLAS's batched GEMM and the row passes
 * as kernels; the tests run the same plan with host BLAS loops against the CPU kernels, which
 * checks every operand offset, transpose, leading dimension and scale the device path uses.
 *
 * q and out are [B, T, H, Dh], k and v [B, T, Hkv, Dh], lse [B, H, T] (F32), H = rep x Hkv;
 * query head h reads key/value head g = h / rep. Work goes in chunks of (batch, kv head)
 * pairs, each with scratch score matrices of T x T per (pair, query head) entry:
 *
 *   forward, every query head of the chunk's pairs at once:
 *     S = scale Q K^T (F32)                   probs: lse, P = exp(S - lse) causal (dtype)
 *     O = P V
 *   backward, one query head r of each group at a time (dk and dv of a pair are summed over
 *   its group's heads in order, without two entries of one call writing the same rows):
 *     S = scale Q K^T, dP = dO V^T (F32)      dscores: P, dS = P (dP - rowsum(dO O)) scale
 *     dQ = dS K,  dK += dS^T Q,  dV += P^T dO   (dK and dV in F32 from zero, cast at the end)
 *
 * Causal blocks: each pass runs per block of query rows [r0, r1) (the executor's block_rows),
 * against keys [0, r1) only, so the products and row passes skip most of the masked upper
 * triangle (with 8 blocks, 56% of the full square is computed); dK and dV then add one block's
 * share after another.
 *
 * In the executor's terms every product is column-major (cuBLAS's): a row-major matrix of
 * R rows and row stride ld is a column-major matrix of R columns with leading dimension ld.
 */
#ifndef FSDPC_BASE_ATTENTION_GEMM_H
#define FSDPC_BASE_ATTENTION_GEMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __CUDACC__
#define ATTN_HD __host__ __device__
#else
#define ATTN_HD
#endif

typedef struct attn_shape {
  int64_t B, T, H, Hkv, Dh, rep;
  float scale; /* 1 / sqrt(Dh) */
} attn_shape_t;

/* The entries of one call: the (batch, kv head) pairs p = b * Hkv + g in [first, first +
 * count), with query head r of each pair's group (h = g * rep + r), or, with r < 0, every
 * head of the group: entry e is pair first + e / rep, head e % rep. */
typedef struct attn_batch {
  int64_t first, count, r;
} attn_batch_t;

static inline ATTN_HD int64_t attn_entries(const attn_shape_t *s, const attn_batch_t *bt) {
  return bt->r < 0 ? bt->count * s->rep : bt->count;
}

/* Entry e's batch, query head and kv head. */
static inline ATTN_HD void attn_entry(const attn_shape_t *s, const attn_batch_t *bt, int64_t e,
                                      int64_t *b, int64_t *h, int64_t *g) {
  int64_t p = bt->first + (bt->r < 0 ? e / s->rep : e), r = bt->r < 0 ? e % s->rep : bt->r;
  *b = p / s->Hkv;
  *g = p % s->Hkv;
  *h = *g * s->rep + r;
}

typedef enum attn_layout {
  ATTN_HEADS,    /* [B, T, H, Dh]: entry's T x Dh rows at (b T H + h) Dh, H Dh apart */
  ATTN_KV_HEADS, /* [B, T, Hkv, Dh]: at (b T Hkv + g) Dh, Hkv Dh apart */
  ATTN_SCRATCH   /* the call's scratch: entry e's T x T matrix at e T T, T apart */
} attn_layout_t;

/* Entry e's first element in a matrix of layout l (elements, not bytes). */
static inline ATTN_HD int64_t attn_offset(const attn_shape_t *s, attn_layout_t l, int64_t e,
                                          int64_t b, int64_t h, int64_t g) {
  if (l == ATTN_HEADS) return (b * s->T * s->H + h) * s->Dh;
  if (l == ATTN_KV_HEADS) return (b * s->T * s->Hkv + g) * s->Dh;
  return e * s->T * s->T;
}

typedef struct attn_mat {
  void *base;
  dtype_t dtype;
  attn_layout_t layout;
  int64_t off; /* elements after each entry's first: where a block of rows starts */
} attn_mat_t;

/* Entry e's first element of m (its layout's offset plus m's own). */
static inline ATTN_HD int64_t attn_at(const attn_shape_t *s, const attn_mat_t *m, int64_t e,
                                      int64_t b, int64_t h, int64_t g) {
  return attn_offset(s, m->layout, e, b, h, g) + m->off;
}

/* One batched product: for every entry, C = alpha op(A) op(B) + beta C, column-major, op(A)
 * m x k, op(B) k x n, C m x n; A and B of one dtype, C of that dtype or F32; F32 compute. */
typedef struct attn_gemm {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
  attn_mat_t a, b, c;
} attn_gemm_t;

/* Who runs the plan. S and dP are the call's F32 scratch (ATTN_SCRATCH), lse is [B, H, T]. */
typedef struct attn_exec {
  void *ctx;
  fsdpc_status_t (*gemm)(void *ctx, const attn_shape_t *s, const attn_batch_t *bt,
                         const attn_gemm_t *g);
  /* For each entry's rows r0 <= i < r1 (row i of a T x T matrix at i T, T apart), columns
   * j < r1: lse_i = log sum_{j <= i} exp(S_ij) (written to lse at (b H + h) T + i);
   * P_ij = exp(S_ij - lse_i) for j <= i, 0 after, in p's dtype (ATTN_SCRATCH). */
  fsdpc_status_t (*probs)(void *ctx, const attn_shape_t *s, const attn_batch_t *bt, int64_t r0,
                          int64_t r1, const float *S, float *lse, attn_mat_t p);
  /* For the same rows and columns, lse_i given: P as probs; D_i = sum_c dO_ic O_ic over the
   * entry's rows of dout and out (ATTN_HEADS); dS_ij = P_ij (dP_ij - D_i) scale for j <= i, 0
   * after; P and dS in their dtypes (ATTN_SCRATCH). */
  fsdpc_status_t (*dscores)(void *ctx, const attn_shape_t *s, const attn_batch_t *bt, int64_t r0,
                            int64_t r1, const float *S, const float *dP, const float *lse,
                            attn_mat_t dout, attn_mat_t out, attn_mat_t p, attn_mat_t ds);
  device_t device;    /* scratch comes from device_alloc here; casts run here */
  size_t scratch_max; /* bytes of scratch a chunk may take (at least one pair's) */
  int64_t block_rows; /* query rows per causal block (0 or >= T: one block) */
} attn_exec_t;

attn_shape_t attn_shape_of(const int64_t *q_shape, const int64_t *k_shape);

/* out and lse from q, k, v (contiguous, one float dtype). */
fsdpc_status_t attn_gemm_forward(const attn_exec_t *x, const attn_shape_t *s, dtype_t dt, void *out,
                                 float *lse, const void *q, const void *k, const void *v);

/* dq, dk and dv from dout and the forward's inputs, output and lse. */
fsdpc_status_t attn_gemm_backward(const attn_exec_t *x, const attn_shape_t *s, dtype_t dt, void *dq,
                                  void *dk, void *dv, const void *dout, const void *q,
                                  const void *k, const void *v, const void *out, const float *lse);

#ifdef __cplusplus
}
#endif

#endif
