/* CPU kernels of rotary embedding and attention (see kernels_cpu.h). */
#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "core/attention_gemm_impl.h"
#include "core/backend_impl.h"
#include "backends/cpu/kernels_cpu.h"

/* ---- RoPE ---- */

/* The cos and sin of every (position, pair) angle of one call's positions (rope_fill_table).
 * The angles depend on nothing else, so the table of the last call is kept and serves the next
 * calls of the same positions (every layer's q and k, forward and backward) without a cos,
 * sin or pow. */
typedef struct rope_table {
  rope_key_t key;
  float *cs;
} rope_table_t;

static rope_table_t rope_cache; /* under rope_lock for the whole of a kernel call */
static pthread_mutex_t rope_lock = PTHREAD_MUTEX_INITIALIZER;

/* The table of key, built unless the last call's serves. */
static const float *rope_table(const rope_key_t *key) {
  rope_table_t *c = &rope_cache;
  if (c->cs != NULL && rope_key_equal(&c->key, key)) return c->cs;
  free(c->cs);
  memset(c, 0, sizeof *c);
  int64_t n = key->T * key->Dh;
  float *cs = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
  if (cs == NULL) return NULL;
  rope_fill_table(key, cs);
  *c = (rope_table_t){*key, cs};
  return cs;
}

typedef struct rope_args {
  int64_t B, T, H, Dh;
  bool inverse;
  const float *x, *cs;
  float *out;
} rope_args_t;

/* Positions [t0, t1). */
WIDE static void rope_share(const void *ctx, int share, int64_t t0, int64_t t1) {
  (void)share;
  const rope_args_t *a = ctx;
  int64_t Dh = a->Dh, half = Dh / 2;
  float sign = a->inverse ? -1.0f : 1.0f; /* rotating back: sin(-angle) */
  for (int64_t t = t0; t < t1; t++) {
    const float *cs = a->cs + t * Dh;
    for (int64_t b = 0; b < a->B; b++)
      for (int64_t h = 0; h < a->H; h++) {
        int64_t base = ((b * a->T + t) * a->H + h) * Dh;
        const float *x = a->x + base;
        float *o = a->out + base;
        for (int64_t i = 0; i < half; i++) {
          float x1 = x[i], x2 = x[i + half];
          float c = cs[2 * i], s = sign * cs[2 * i + 1];
          o[i] = x1 * c - x2 * s;
          o[i + half] = x2 * c + x1 * s;
        }
      }
  }
}

static fsdpc_status_t cpu_rope(fsdpc_tensor_t *out, const fsdpc_tensor_t *x, const rope_t *rope,
                               int64_t pos_offset, bool inverse) {
  rope_args_t a = {
      .B = x->shape[0], .T = x->shape[1], .H = x->shape[2], .Dh = x->shape[3], .inverse = inverse};
  fbufs_t s = {0};
  a.x = cpu_fbufs_in(&s, x);
  a.out = cpu_fbufs_out(&s, out, false); /* f32: in place, so out may be x */
  if (s.st != STATUS_OK) return cpu_fbufs_end(&s, STATUS_OK);
  pthread_mutex_lock(&rope_lock);
  a.cs = rope_table(&(rope_key_t){*rope, a.Dh, pos_offset, a.T});
  if (a.cs == NULL) {
    pthread_mutex_unlock(&rope_lock);
    return cpu_fbufs_end(&s, err_set(STATUS_ENOMEM, "kernel_rope: out of host memory"));
  }
  cpu_for_shares(a.T, a.B * a.H * a.Dh, ELEM_GRAIN, 1, rope_share, &a);
  pthread_mutex_unlock(&rope_lock);
  return cpu_fbufs_end(&s, STATUS_OK);
}

/* ---- attention ---- */

/* Attention through BLAS, per (batch, head) and block of ATTN_ROWS query rows: the block's
 * scores against the keys up to its last row are one GEMM (only the diagonal block computes
 * masked entries), the softmax runs over each row, and the outputs are GEMMs again. The
 * backward recomputes the probabilities from the saved log-sum-exp (one exp per score, as
 * flash attention does) and forms dq, dk and dv with GEMMs; dk and dv accumulate over the
 * query heads of their group and the row blocks. Blocks of 32 rows leave more of the masked
 * triangle out than larger ones (at 64 tokens, a quarter of the square instead of none) and
 * measured fastest at 64 and 256 tokens, and no slower at 1024 and 2048. */
enum { ATTN_ROWS = 32 };

static float *attn_scratch(int64_t floats) {
  return cpu_host_alloc(sizeof(float) * (size_t)(floats > 0 ? floats : 1), false);
}
static void attn_scratch_free(float *p, int64_t floats) {
  cpu_host_free(p, sizeof(float) * (size_t)(floats > 0 ? floats : 1));
}

/* The row passes below run over whole chunks of ROW_CHUNK keys (one vector or two), up to the
 * chunk that holds the row's last causal key, with the keys after it masked, and set the rest
 * of the row to zero: rows are short (64 keys at most at 64 tokens, 32 on average), and an
 * exact-length loop would spend most of its time in its scalar tail. Each pass goes over all
 * rows of the block before the next starts, so that the rows' chains of dependent operations
 * (a maximum, a sum, a division, a logarithm) overlap. */
enum { ROW_CHUNK = 16 };

/* Keys [0, c) a row pass computes for causal row i of a row of n keys: whole chunks, but for a
 * last partial one where n is not a multiple of ROW_CHUNK. */
static inline int64_t row_cover(int64_t i, int64_t n) {
  int64_t c = (i + ROW_CHUNK) / ROW_CHUNK * ROW_CHUNK;
  return c < n ? c : n;
}

/* The largest of row[0..i], of a row of n keys. */
static inline float row_max(const float *row, int64_t i, int64_t n) {
  float m[ROW_CHUNK];
  int64_t c = row_cover(i, n), j0 = 0;
  for (int l = 0; l < ROW_CHUNK; l++) m[l] = -INFINITY;
  for (; j0 + ROW_CHUNK <= c; j0 += ROW_CHUNK) {
#pragma omp simd
    for (int l = 0; l < ROW_CHUNK; l++)
      m[l] = j0 + l <= i && row[j0 + l] > m[l] ? row[j0 + l] : m[l];
  }
  for (int l = 0; j0 + l < c; l++) m[l] = j0 + l <= i && row[j0 + l] > m[l] ? row[j0 + l] : m[l];
  float r = m[0];
  for (int l = 1; l < ROW_CHUNK; l++) r = m[l] > r ? m[l] : r;
  return r;
}

/* row[j] = exp(row[j] - shift) for j <= i, 0 for i < j < n. */
static inline void row_exp(float *row, int64_t i, int64_t n, float shift) {
  int64_t c = row_cover(i, n), j0 = 0;
  for (; j0 + ROW_CHUNK <= c; j0 += ROW_CHUNK) {
#pragma omp simd
    for (int l = 0; l < ROW_CHUNK; l++)
      row[j0 + l] = j0 + l <= i ? exp_f32(row[j0 + l] - shift) : 0.0f;
  }
  for (int64_t j = j0; j < c; j++) row[j] = j <= i ? exp_f32(row[j] - shift) : 0.0f;
  memset(row + c, 0, sizeof(float) * (size_t)(n - c));
}

/* Row r of block rows [i0, i1): P[r, 0..i] = exp(S[r, j] - lse) for the causal keys j <= i,
 * zero beyond; S (the scaled scores) is read from and P written to p (ld n). */
WIDE static void attn_probs(float *p, int64_t n, int64_t i0, int64_t i1, const float *lse) {
  for (int64_t i = i0; i < i1; i++) row_exp(p + (i - i0) * n, i, n, lse[i]);
}

/* Rows [i0, i1) of the block, as attn_probs, from the scores alone: P[r, j] = e_j / l with
 * e_j = exp(S[r, j] - max) and l their sum (in cpu_exp_sum's order), one exponential per
 * score; lse[i] = max + log(l). Backward's exp(S - lse) differs from these in the last bits at
 * most. */
WIDE static void attn_softmax(float *p, int64_t n, int64_t i0, int64_t i1, float *lse) {
  float mx[ATTN_ROWS];
  double sum[ATTN_ROWS];
  for (int64_t i = i0; i < i1; i++) mx[i - i0] = row_max(p + (i - i0) * n, i, n);
  for (int64_t i = i0; i < i1; i++) {
    float *row = p + (i - i0) * n;
    row_exp(row, i, n, mx[i - i0]);
    sum[i - i0] = cpu_lane_sum(row, row_cover(i, n));
  }
  for (int64_t i = i0; i < i1; i++) lse[i] = mx[i - i0] + (float)log(sum[i - i0]);
  for (int64_t i = i0; i < i1; i++) {
    float *row = p + (i - i0) * n, inv = (float)(1.0 / sum[i - i0]);
    int64_t c = row_cover(i, n);
#pragma omp simd
    for (int64_t j = 0; j < c; j++) row[j] *= inv;
  }
}

/* Rows [i0, i1) of the block: dS[r, j] = P[r, j] (dP[r, j] - D_i) scale for the causal keys,
 * zero beyond, in place of dP; D_i = sum_c dO_ic O_ic (dO and O: the block's first rows, ld
 * ldq), each summed in order of c, the rows' sums side by side. */
WIDE static void attn_dscores(float *dp, const float *p, int64_t n, int64_t i0, int64_t i1,
                              const float *dO, const float *O, int64_t ldq, int64_t Dh,
                              float scale) {
  float D[ATTN_ROWS];
  for (int64_t i = i0; i < i1; i++) D[i - i0] = 0.0f;
  for (int64_t c = 0; c < Dh; c++)
    for (int64_t i = i0; i < i1; i++) D[i - i0] += dO[(i - i0) * ldq + c] * O[(i - i0) * ldq + c];
  for (int64_t i = i0; i < i1; i++) {
    const float *pi = p + (i - i0) * n;
    float *dsi = dp + (i - i0) * n, Di = D[i - i0];
    int64_t c = row_cover(i, n), j0 = 0;
    for (; j0 + ROW_CHUNK <= c; j0 += ROW_CHUNK) {
#pragma omp simd
      for (int l = 0; l < ROW_CHUNK; l++)
        dsi[j0 + l] = j0 + l <= i ? pi[j0 + l] * (dsi[j0 + l] - Di) * scale : 0.0f;
    }
    for (int64_t j = j0; j < c; j++) dsi[j] = j <= i ? pi[j] * (dsi[j] - Di) * scale : 0.0f;
    memset(dsi + c, 0, sizeof(float) * (size_t)(n - c));
  }
}

typedef struct attn_args {
  attn_shape_t d;
  int64_t rows, ldq, ldk, scratch; /* scratch: floats per share */
  const float *q, *k, *v, *o, *dout;
  float *out, *lse, *dq, *dk, *dv, *s;
  const float *lse_in;
} attn_args_t;

/* Forward of the (batch, head) pairs [i0, i1). */
WIDE static void attn_forward_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const attn_args_t *a = ctx;
  const attn_shape_t d = a->d;
  int64_t rows = a->rows, ldq = a->ldq, ldk = a->ldk;
  float *s = a->s + t * a->scratch;
  for (int64_t bh = i0; bh < i1; bh++) {
    int64_t b = bh / d.H, h = bh % d.H;
    const float *Q = a->q + (b * d.T * d.H + h) * d.Dh;
    const float *K = a->k + (b * d.T * d.Hkv + h / d.rep) * d.Dh;
    const float *V = a->v + (b * d.T * d.Hkv + h / d.rep) * d.Dh;
    float *O = a->out + (b * d.T * d.H + h) * d.Dh, *Lbh = a->lse + bh * d.T;
    for (int64_t r0 = 0; r0 < d.T; r0 += rows) {
      int64_t r1 = r0 + rows < d.T ? r0 + rows : d.T, n = r1; /* keys 0..r1-1 */
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)(r1 - r0), (int)n, (int)d.Dh,
                  d.scale, Q + r0 * ldq, (int)ldq, K, (int)ldk, 0.0f, s, (int)n);
      attn_softmax(s, n, r0, r1, Lbh);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)(r1 - r0), (int)d.Dh, (int)n,
                  1.0f, s, (int)n, V, (int)ldk, 0.0f, O + r0 * ldq, (int)ldq);
    }
  }
}

static fsdpc_status_t cpu_attention(fsdpc_tensor_t *out, fsdpc_tensor_t *lse,
                                    const fsdpc_tensor_t *q, const fsdpc_tensor_t *k,
                                    const fsdpc_tensor_t *v) {
  attn_shape_t d = attn_shape_of(q->shape, k->shape);
  int nt = kernel_cpu_threads();
  attn_args_t a = {.d = d, .rows = d.T < ATTN_ROWS ? d.T : ATTN_ROWS};
  a.ldq = d.H * d.Dh;
  a.ldk = d.Hkv * d.Dh;
  a.scratch = (a.rows * d.T + 15) / 16 * 16; /* each share's scratch starts 64-byte aligned */
  float *s = attn_scratch(nt * a.scratch);
  if (s == NULL) return err_set(STATUS_ENOMEM, "kernel_attention: out of host memory");
  fbufs_t f = {0};
  a.q = cpu_fbufs_in(&f, q);
  a.k = cpu_fbufs_in(&f, k);
  a.v = cpu_fbufs_in(&f, v);
  a.out = cpu_fbufs_out(&f, out, false);
  a.lse = lse->data;
  a.s = s;
  if (f.st == STATUS_OK)
    cpu_for_shares(d.B * d.H, d.T * d.T * d.Dh, GEMM_GRAIN, 1, attn_forward_share, &a);
  attn_scratch_free(s, nt * a.scratch);
  return cpu_fbufs_end(&f, STATUS_OK);
}

/* Backward of the (batch, key-value head) pairs [i0, i1): each owns its rows of dk and dv,
 * summed over the group's query heads in order. */
WIDE static void attn_backward_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const attn_args_t *a = ctx;
  const attn_shape_t d = a->d;
  int64_t rows = a->rows, ldq = a->ldq, ldk = a->ldk;
  float *p = a->s + t * a->scratch, *dp = p + a->scratch / 2;
  for (int64_t bg = i0; bg < i1; bg++) {
    int64_t b = bg / d.Hkv, h0 = bg % d.Hkv * d.rep;
    for (int64_t h = h0; h < h0 + d.rep; h++) {
      int64_t qo = (b * d.T * d.H + h) * d.Dh, ko = (b * d.T * d.Hkv + h / d.rep) * d.Dh;
      const float *Lbh = a->lse_in + (b * d.H + h) * d.T;
      for (int64_t r0 = 0; r0 < d.T; r0 += rows) {
        int64_t r1 = r0 + rows < d.T ? r0 + rows : d.T, n = r1, m = r1 - r0;
        const float *Q = a->q + qo + r0 * ldq, *dO = a->dout + qo + r0 * ldq,
                    *O = a->o + qo + r0 * ldq;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)d.Dh, d.scale, Q,
                    (int)ldq, a->k + ko, (int)ldk, 0.0f, p, (int)n);
        attn_probs(p, n, r0, r1, Lbh);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)d.Dh, 1.0f, dO,
                    (int)ldq, a->v + ko, (int)ldk, 0.0f, dp, (int)n);
        attn_dscores(dp, p, n, r0, r1, dO, O, ldq, d.Dh, d.scale);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)d.Dh, (int)n, 1.0f, dp,
                    (int)n, a->k + ko, (int)ldk, 0.0f, a->dq + qo + r0 * ldq, (int)ldq);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)d.Dh, (int)m, 1.0f, dp,
                    (int)n, Q, (int)ldq, 1.0f, a->dk + ko, (int)ldk);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)d.Dh, (int)m, 1.0f, p,
                    (int)n, dO, (int)ldq, 1.0f, a->dv + ko, (int)ldk);
      }
    }
  }
}

static fsdpc_status_t cpu_attention_backward(fsdpc_tensor_t *dq, fsdpc_tensor_t *dk,
                                             fsdpc_tensor_t *dv, const fsdpc_tensor_t *dout,
                                             const fsdpc_tensor_t *q, const fsdpc_tensor_t *k,
                                             const fsdpc_tensor_t *v, const fsdpc_tensor_t *out,
                                             const fsdpc_tensor_t *lse) {
  attn_shape_t d = attn_shape_of(q->shape, k->shape);
  int nt = kernel_cpu_threads();
  attn_args_t a = {.d = d, .rows = d.T < ATTN_ROWS ? d.T : ATTN_ROWS};
  a.ldq = d.H * d.Dh;
  a.ldk = d.Hkv * d.Dh;
  a.scratch = 2 * ((a.rows * d.T + 15) / 16 * 16); /* P and dP, each 64-byte aligned */
  float *p = attn_scratch(nt * a.scratch);
  if (p == NULL) return err_set(STATUS_ENOMEM, "kernel_attention_backward: out of host memory");
  fbufs_t f = {0};
  a.dout = cpu_fbufs_in(&f, dout);
  a.q = cpu_fbufs_in(&f, q);
  a.k = cpu_fbufs_in(&f, k);
  a.v = cpu_fbufs_in(&f, v);
  a.o = cpu_fbufs_in(&f, out);
  a.dq = cpu_fbufs_out(&f, dq, false);
  a.dk = cpu_fbufs_out(&f, dk, false);
  a.dv = cpu_fbufs_out(&f, dv, false);
  a.lse_in = lse->data;
  a.s = p;
  if (f.st == STATUS_OK) {
    memset(a.dk, 0, sizeof(float) * (size_t)tensor_numel(dk)); /* summed over heads, blocks */
    memset(a.dv, 0, sizeof(float) * (size_t)tensor_numel(dv));
    cpu_for_shares(d.B * d.Hkv, d.rep * d.T * d.T * d.Dh, GEMM_GRAIN, 1, attn_backward_share, &a);
  }
  attn_scratch_free(p, nt * a.scratch);
  return cpu_fbufs_end(&f, STATUS_OK);
}

void cpu_attention_kernels(kernel_ops_t *ops) {
  ops->rope = cpu_rope;
  ops->attention = cpu_attention;
  ops->attention_backward = cpu_attention_backward;
}
