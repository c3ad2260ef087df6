/*
 * CPU twin of the compute kernels: OpenBLAS for matrix products, plain C elsewhere.
 * Values are read into fp32 (converted copies for bf16/f16 storage), computed in fp32 with
 * double-precision reductions where a row is summed (the gradient norm: fp32 lanes per 256
 * elements, the blocks in double), and rounded once when stored.
 */
#include <cblas.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/backend.h"
#include "base/kernels_impl.h"

/* Element-wise kernels built twice with GCC, for the baseline x86-64 (4 lanes) and for AVX2
 * (8 lanes), the copy chosen when the library loads (an ifunc): the same IEEE operations
 * either way (no FMA contraction), so the same bits on every machine. Not for reductions,
 * whose lane count would change their order. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define WIDE __attribute__((target_clones("avx2", "default")))
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
  float c = x < -87.3f ? -87.3f : x > 88.37f ? 88.37f : x;
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

typedef struct fbuf {
  float *p;
  int64_t n;
  bool owned; /* a converted copy that must be stored back (outputs) and freed */
} fbuf_t;

static status_t fbuf_alloc(fbuf_t *b, int64_t n) {
  b->n = n;
  b->owned = true;
  b->p = cpu_host_alloc(sizeof(float) * (size_t)(n > 0 ? n : 1), false);
  if (b->p == NULL)
    return err_set(STATUS_ENOMEM, "kernels: out of host memory for %lld floats", (long long)n);
  return STATUS_OK;
}

/* Read access: F32 tensors are used in place, others converted. */
static status_t fbuf_in(fbuf_t *b, const tensor_t *t) {
  int64_t n = tensor_numel(t);
  if (t->dtype == DTYPE_F32) {
    *b = (fbuf_t){.p = (float *)t->data, .n = n, .owned = false};
    return STATUS_OK;
  }
  TRY(fbuf_alloc(b, n));
  for (int64_t i = 0; i < n; i++) b->p[i] = (float)dtype_load(t->dtype, t->data, (size_t)i);
  return STATUS_OK;
}

/* Write access; with load the current values are read first (for accumulation). */
static status_t fbuf_out(fbuf_t *b, tensor_t *t, bool load) {
  if (t->dtype == DTYPE_F32 || load) return fbuf_in(b, t);
  return fbuf_alloc(b, tensor_numel(t));
}

static void fbuf_release(fbuf_t *b) {
  if (b->owned) cpu_host_free(b->p, sizeof(float) * (size_t)(b->n > 0 ? b->n : 1));
  b->p = NULL;
}

/* Stores an output buffer back into t (rounding once) and releases it. */
static void fbuf_commit(fbuf_t *b, tensor_t *t) {
  if (b->owned)
    for (int64_t i = 0; i < b->n; i++) dtype_store(t->dtype, t->data, (size_t)i, b->p[i]);
  fbuf_release(b);
}

/* Value of x rounded to dtype dt, as float. */
static float round_to(dtype_t dt, float x) {
  switch (dt) {
    case DTYPE_BF16: return bf16_to_f32(f32_to_bf16(x));
    case DTYPE_F16: return f16_to_f32(f32_to_f16(x));
    default: return x;
  }
}

static int64_t index_at(const tensor_t *t, int64_t i) {
  return t->dtype == DTYPE_I32 ? ((const int32_t *)t->data)[i] : ((const int64_t *)t->data)[i];
}

static int64_t last_dim(const tensor_t *t) { return t->ndim == 0 ? 1 : t->shape[t->ndim - 1]; }

/* ---- matmul ---- */

static pthread_once_t blas_once = PTHREAD_ONCE_INIT;
static void blas_threads_default(void) {
  if (getenv("OPENBLAS_NUM_THREADS") == NULL) openblas_set_num_threads(1);
}

static status_t cpu_matmul(tensor_t *out, const tensor_t *a, bool trans_a, const tensor_t *b,
                           bool trans_b, float alpha, float beta, const matmul_dims_t *d) {
  pthread_once(&blas_once, blas_threads_default);
  fbuf_t fa, fb, fo;
  status_t st = STATUS_OK;
  TRY(fbuf_in(&fa, a));
  TRY_GOTO(st, fbuf_in(&fb, b));
  st = fbuf_out(&fo, out, beta != 0.0f);
  if (st != STATUS_OK) {
    fbuf_release(&fb);
    goto cleanup;
  }
  if (d->k == 0) {
    for (int64_t i = 0; i < d->m * d->n; i++) fo.p[i] = beta == 0.0f ? 0.0f : beta * fo.p[i];
  } else {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, (int)d->m, (int)d->n, (int)d->k, alpha, fa.p,
                (int)d->lda, fb.p, (int)d->ldb, beta, fo.p, (int)d->n);
  }
  fbuf_commit(&fo, out);
  fbuf_release(&fb);
cleanup:
  fbuf_release(&fa);
  return st;
}

/* ---- embedding ---- */

static status_t check_ids(const char *fn, const tensor_t *ids, int64_t vocab) {
  for (int64_t i = 0, n = tensor_numel(ids); i < n; i++) {
    int64_t id = index_at(ids, i);
    if (id < 0 || id >= vocab)
      return err_set(STATUS_EINVAL, "%s: index %lld at position %lld is outside [0, %lld)", fn,
                     (long long)id, (long long)i, (long long)vocab);
  }
  return STATUS_OK;
}

static status_t cpu_embedding(tensor_t *out, const tensor_t *table, const tensor_t *ids,
                              int64_t first, int64_t vocab) {
  int64_t n = tensor_numel(ids), V = table->shape[0], D = table->shape[1];
  size_t row = (size_t)D * dtype_size(table->dtype);
  TRY(check_ids("kernel_embedding", ids, vocab));
  for (int64_t i = 0; i < n; i++) {
    int64_t id = index_at(ids, i) - first;
    char *dst = (char *)out->data + (size_t)i * row;
    if (id < 0 || id >= V)
      memset(dst, 0, row); /* another shard's row */
    else
      memcpy(dst, (const char *)table->data + (size_t)id * row, row);
  }
  return STATUS_OK;
}

static status_t cpu_embedding_backward(tensor_t *grad_table, const tensor_t *grad_out,
                                       const tensor_t *ids, int64_t first, int64_t vocab) {
  int64_t n = tensor_numel(ids), V = grad_table->shape[0], D = grad_table->shape[1];
  TRY(check_ids("kernel_embedding_backward", ids, vocab));
  fbuf_t g, go;
  TRY(fbuf_out(&g, grad_table, true));
  status_t st = fbuf_in(&go, grad_out);
  if (st != STATUS_OK) {
    fbuf_release(&g);
    return st;
  }
  for (int64_t i = 0; i < n; i++) {
    int64_t id = index_at(ids, i) - first;
    if (id < 0 || id >= V) continue;
    float *dst = g.p + id * D;
    const float *src = go.p + i * D;
    for (int64_t j = 0; j < D; j++) dst[j] += src[j];
  }
  fbuf_release(&go);
  fbuf_commit(&g, grad_table);
  return STATUS_OK;
}

/* ---- RMSNorm ---- */

static status_t cpu_rmsnorm(tensor_t *out, tensor_t *rstd, const tensor_t *x, const tensor_t *w,
                            float eps) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / (D ? D : 1);
  fbuf_t fx, fw, fo;
  TRY(fbuf_in(&fx, x));
  status_t st = fbuf_in(&fw, w);
  if (st == STATUS_OK) st = fbuf_out(&fo, out, false);
  if (st != STATUS_OK) {
    fbuf_release(&fx);
    fbuf_release(&fw);
    return st;
  }
  float *r = rstd->data;
  for (int64_t i = 0; i < rows; i++) {
    const float *xi = fx.p + i * D;
    double ss = 0;
    for (int64_t j = 0; j < D; j++) ss += (double)xi[j] * xi[j];
    float var = (float)(ss / (double)D), ri = 1.0f / sqrtf(var + eps);
    float *oi = fo.p + i * D;
    r[i] = ri;
    if (x->dtype == DTYPE_F32) {
#pragma omp simd
      for (int64_t j = 0; j < D; j++) oi[j] = fw.p[j] * (xi[j] * ri);
    } else {
      for (int64_t j = 0; j < D; j++) oi[j] = fw.p[j] * round_to(x->dtype, xi[j] * ri);
    }
  }
  fbuf_commit(&fo, out);
  fbuf_release(&fx);
  fbuf_release(&fw);
  return STATUS_OK;
}

static status_t cpu_rmsnorm_backward(tensor_t *dx, tensor_t *dw, const tensor_t *dy,
                                     const tensor_t *x, const tensor_t *w, const tensor_t *rstd) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / (D ? D : 1);
  fbuf_t fdx, fdw, fdy, fx, fw;
  fbuf_t *bufs[] = {&fdx, &fdw, &fdy, &fx, &fw};
  int got = 0;
  status_t st = fbuf_out(&fdx, dx, false);
  if (st == STATUS_OK && ++got) st = fbuf_out(&fdw, dw, true);
  if (st == STATUS_OK && ++got) st = fbuf_in(&fdy, dy);
  if (st == STATUS_OK && ++got) st = fbuf_in(&fx, x);
  if (st == STATUS_OK && ++got) st = fbuf_in(&fw, w);
  if (st != STATUS_OK) {
    for (int i = 0; i < got; i++) fbuf_release(bufs[i]);
    return st;
  }
  const float *r = rstd->data;
  for (int64_t i = 0; i < rows; i++) {
    const float *xi = fx.p + i * D, *dyi = fdy.p + i * D;
    double dot = 0; /* sum_j dy_j w_j x_j */
    for (int64_t j = 0; j < D; j++) dot += (double)dyi[j] * fw.p[j] * xi[j];
    float ri = r[i], c = (float)(dot / (double)D) * ri * ri;
    float *dxi = fdx.p + i * D, *dw = fdw.p;
#pragma omp simd
    for (int64_t j = 0; j < D; j++) {
      dxi[j] = ri * (dyi[j] * fw.p[j] - xi[j] * c);
      dw[j] += dyi[j] * (xi[j] * ri);
    }
  }
  fbuf_commit(&fdx, dx);
  fbuf_commit(&fdw, dw);
  fbuf_release(&fdy);
  fbuf_release(&fx);
  fbuf_release(&fw);
  return STATUS_OK;
}

/* ---- RoPE ---- */

WIDE static status_t cpu_rope(tensor_t *out, const tensor_t *x, const rope_t *rope,
                              int64_t pos_offset, bool inverse) {
  int64_t B = x->shape[0], T = x->shape[1], H = x->shape[2], Dh = x->shape[3], half = Dh / 2;
  fbuf_t fx, fo;
  TRY(fbuf_in(&fx, x));
  status_t st = fbuf_out(&fo, out, false); /* f32: in place, so out may be x */
  if (st != STATUS_OK) {
    fbuf_release(&fx);
    return st;
  }
  float *cs = malloc(sizeof(float) * 2 * (size_t)(half ? half : 1));
  if (cs == NULL) {
    fbuf_release(&fx);
    fbuf_release(&fo);
    return err_set(STATUS_ENOMEM, "kernel_rope: out of host memory");
  }
  for (int64_t t = 0; t < T; t++) {
    for (int64_t i = 0; i < half; i++) {
      double ang = (double)(t + pos_offset) * rope_inv_freq(rope, i, Dh);
      cs[2 * i] = (float)cos(ang);
      cs[2 * i + 1] = inverse ? -(float)sin(ang) : (float)sin(ang);
    }
    for (int64_t b = 0; b < B; b++)
      for (int64_t h = 0; h < H; h++) {
        int64_t base = ((b * T + t) * H + h) * Dh;
        for (int64_t i = 0; i < half; i++) {
          float x1 = fx.p[base + i], x2 = fx.p[base + i + half];
          float c = cs[2 * i], s = cs[2 * i + 1];
          fo.p[base + i] = x1 * c - x2 * s;
          fo.p[base + i + half] = x2 * c + x1 * s;
        }
      }
  }
  free(cs);
  fbuf_release(&fx);
  fbuf_commit(&fo, out);
  return STATUS_OK;
}

/* ---- attention ---- */

typedef struct attn_dims {
  int64_t B, T, H, Hkv, Dh, rep;
  float scale;
} attn_dims_t;

static attn_dims_t attn_dims(const tensor_t *q, const tensor_t *k) {
  attn_dims_t d = {q->shape[0], q->shape[1], q->shape[2], k->shape[2], q->shape[3], 0, 0};
  d.rep = d.H / d.Hkv;
  d.scale = 1.0f / sqrtf((float)d.Dh);
  return d;
}

/* Attention through BLAS, per (batch, head) and block of ATTN_ROWS query rows: the block's
 * scores against the keys up to its last row are one GEMM (only the diagonal block computes
 * masked entries), the softmax runs over each row, and the outputs are GEMMs again. The
 * backward recomputes the probabilities from the saved log-sum-exp (one exp per score, as
 * flash attention does) and forms dq, dk and dv with GEMMs; dk and dv accumulate over the
 * query heads of their group and the row blocks. */
enum { ATTN_ROWS = 128 };

static float *attn_scratch(int64_t floats) {
  return cpu_host_alloc(sizeof(float) * (size_t)(floats > 0 ? floats : 1), false);
}
static void attn_scratch_free(float *p, int64_t floats) {
  cpu_host_free(p, sizeof(float) * (size_t)(floats > 0 ? floats : 1));
}

/* Row r of block rows [i0, i1): P[r, 0..i] = exp(S[r, j] - lse) for the causal keys j <= i,
 * zero beyond; S (the scaled scores) is read from and P written to p (ld n). */
WIDE static void attn_probs(float *p, int64_t n, int64_t i0, int64_t i1, const float *lse) {
  for (int64_t i = i0; i < i1; i++) {
    float *row = p + (i - i0) * n, l = lse[i];
#pragma omp simd
    for (int64_t j = 0; j <= i; j++) row[j] = exp_f32(row[j] - l);
    for (int64_t j = i + 1; j < n; j++) row[j] = 0.0f;
  }
}

WIDE static status_t cpu_attention(tensor_t *out, tensor_t *lse, const tensor_t *q,
                                   const tensor_t *k, const tensor_t *v) {
  pthread_once(&blas_once, blas_threads_default);
  attn_dims_t d = attn_dims(q, k);
  int64_t rows = d.T < ATTN_ROWS ? d.T : ATTN_ROWS, ldq = d.H * d.Dh, ldk = d.Hkv * d.Dh;
  fbuf_t fq, fk, fv, fo;
  fbuf_t *bufs[] = {&fq, &fk, &fv, &fo};
  int got = 0;
  float *s = attn_scratch(rows * d.T);
  status_t st = s ? STATUS_OK : err_set(STATUS_ENOMEM, "kernel_attention: out of host memory");
  if (st == STATUS_OK) st = fbuf_in(&fq, q);
  if (st == STATUS_OK && ++got) st = fbuf_in(&fk, k);
  if (st == STATUS_OK && ++got) st = fbuf_in(&fv, v);
  if (st == STATUS_OK && ++got) st = fbuf_out(&fo, out, false);
  if (st != STATUS_OK) {
    for (int i = 0; i < got; i++) fbuf_release(bufs[i]);
    if (s) attn_scratch_free(s, rows * d.T);
    return st;
  }
  float *L = lse->data;
  for (int64_t b = 0; b < d.B; b++)
    for (int64_t h = 0; h < d.H; h++) {
      const float *Q = fq.p + (b * d.T * d.H + h) * d.Dh;
      const float *K = fk.p + (b * d.T * d.Hkv + h / d.rep) * d.Dh;
      const float *V = fv.p + (b * d.T * d.Hkv + h / d.rep) * d.Dh;
      float *O = fo.p + (b * d.T * d.H + h) * d.Dh, *Lbh = L + (b * d.H + h) * d.T;
      for (int64_t i0 = 0; i0 < d.T; i0 += rows) {
        int64_t i1 = i0 + rows < d.T ? i0 + rows : d.T, n = i1; /* keys 0..i1-1 */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)(i1 - i0), (int)n, (int)d.Dh,
                    d.scale, Q + i0 * ldq, (int)ldq, K, (int)ldk, 0.0f, s, (int)n);
        /* the probabilities from the log-sum-exp, as backward recomputes them: the same
         * values in both passes */
        for (int64_t i = i0; i < i1; i++) {
          const float *row = s + (i - i0) * n;
          float m = -INFINITY;
          for (int64_t j = 0; j <= i; j++) m = row[j] > m ? row[j] : m;
          double l = 0;
          for (int64_t j = 0; j <= i; j++) l += exp_f32(row[j] - m);
          Lbh[i] = m + (float)log(l);
        }
        attn_probs(s, n, i0, i1, Lbh);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)(i1 - i0), (int)d.Dh, (int)n,
                    1.0f, s, (int)n, V, (int)ldk, 0.0f, O + i0 * ldq, (int)ldq);
      }
    }
  attn_scratch_free(s, rows * d.T);
  fbuf_release(&fq);
  fbuf_release(&fk);
  fbuf_release(&fv);
  fbuf_commit(&fo, out);
  return STATUS_OK;
}

WIDE static status_t cpu_attention_backward(tensor_t *dq, tensor_t *dk, tensor_t *dv,
                                            const tensor_t *dout, const tensor_t *q,
                                            const tensor_t *k, const tensor_t *v,
                                            const tensor_t *out, const tensor_t *lse) {
  pthread_once(&blas_once, blas_threads_default);
  attn_dims_t d = attn_dims(q, k);
  int64_t rows = d.T < ATTN_ROWS ? d.T : ATTN_ROWS, ldq = d.H * d.Dh, ldk = d.Hkv * d.Dh;
  fbuf_t b_[8];
  const tensor_t *ins[] = {dout, q, k, v, out};
  tensor_t *outs[] = {dq, dk, dv};
  int got = 0;
  float *p = attn_scratch(2 * rows * d.T), *dp = p ? p + rows * d.T : NULL;
  status_t st =
      p ? STATUS_OK : err_set(STATUS_ENOMEM, "kernel_attention_backward: out of host memory");
  for (int i = 0; i < 5 && st == STATUS_OK; i++)
    if ((st = fbuf_in(&b_[got], ins[i])) == STATUS_OK) got++;
  for (int i = 0; i < 3 && st == STATUS_OK; i++)
    if ((st = fbuf_out(&b_[got], outs[i], false)) == STATUS_OK) got++;
  if (st != STATUS_OK) {
    for (int i = 0; i < got; i++) fbuf_release(&b_[i]);
    if (p) attn_scratch_free(p, 2 * rows * d.T);
    return st;
  }
  const float *fdo = b_[0].p, *fq = b_[1].p, *fk = b_[2].p, *fv = b_[3].p, *fo = b_[4].p;
  float *fdq = b_[5].p, *fdk = b_[6].p, *fdv = b_[7].p;
  memset(fdk, 0, sizeof(float) * (size_t)b_[6].n); /* accumulated over heads and blocks */
  memset(fdv, 0, sizeof(float) * (size_t)b_[7].n);
  const float *L = lse->data;
  for (int64_t b = 0; b < d.B; b++)
    for (int64_t h = 0; h < d.H; h++) {
      int64_t qo = (b * d.T * d.H + h) * d.Dh, ko = (b * d.T * d.Hkv + h / d.rep) * d.Dh;
      const float *Lbh = L + (b * d.H + h) * d.T;
      for (int64_t i0 = 0; i0 < d.T; i0 += rows) {
        int64_t i1 = i0 + rows < d.T ? i0 + rows : d.T, n = i1, m = i1 - i0;
        const float *Q = fq + qo + i0 * ldq, *dO = fdo + qo + i0 * ldq, *O = fo + qo + i0 * ldq;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)d.Dh, d.scale, Q,
                    (int)ldq, fk + ko, (int)ldk, 0.0f, p, (int)n);
        attn_probs(p, n, i0, i1, Lbh);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)m, (int)n, (int)d.Dh, 1.0f, dO,
                    (int)ldq, fv + ko, (int)ldk, 0.0f, dp, (int)n);
        for (int64_t i = i0; i < i1; i++) { /* dS = P * (dP - rowsum(dO * O)) * scale */
          const float *doi = dO + (i - i0) * ldq, *oi = O + (i - i0) * ldq;
          float Di = 0;
          for (int64_t c = 0; c < d.Dh; c++) Di += doi[c] * oi[c];
          const float *pi = p + (i - i0) * n;
          float *dsi = dp + (i - i0) * n;
          for (int64_t j = 0; j <= i; j++) dsi[j] = pi[j] * (dsi[j] - Di) * d.scale;
          for (int64_t j = i + 1; j < n; j++) dsi[j] = 0.0f;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)m, (int)d.Dh, (int)n, 1.0f, dp,
                    (int)n, fk + ko, (int)ldk, 0.0f, fdq + qo + i0 * ldq, (int)ldq);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)d.Dh, (int)m, 1.0f, dp,
                    (int)n, Q, (int)ldq, 1.0f, fdk + ko, (int)ldk);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n, (int)d.Dh, (int)m, 1.0f, p,
                    (int)n, dO, (int)ldq, 1.0f, fdv + ko, (int)ldk);
      }
    }
  attn_scratch_free(p, 2 * rows * d.T);
  for (int i = 0; i < 5; i++) fbuf_release(&b_[i]);
  for (int i = 0; i < 3; i++) fbuf_commit(&b_[5 + i], outs[i]);
  return STATUS_OK;
}

/* ---- element-wise ---- */

/* Element-wise kernels have a loop over plain floats for the all-F32 case (the compiler
 * vectorises it) and a generic loop through dtype_load/dtype_store for the others; both
 * compute the same fp32 expression. */
static bool all_f32(const tensor_t *const *t, int n) {
  for (int i = 0; i < n; i++)
    if (t[i]->dtype != DTYPE_F32) return false;
  return true;
}
#define ALL_F32(...)                              \
  all_f32((const tensor_t *const[]){__VA_ARGS__}, \
          (int)(sizeof((const tensor_t *const[]){__VA_ARGS__}) / sizeof(const tensor_t *)))

static inline float silu_sig(float g) { return 1.0f / (1.0f + exp_f32(-g)); }

WIDE static status_t cpu_silu_mul(tensor_t *out, const tensor_t *gate, const tensor_t *up) {
  int64_t n = tensor_numel(out);
  if (ALL_F32(out, gate, up)) {
    const float *pg = gate->data, *pu = up->data;
    float *po = out->data;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) po[i] = pg[i] * silu_sig(pg[i]) * pu[i];
    return STATUS_OK;
  }
  for (int64_t i = 0; i < n; i++) {
    float g = (float)dtype_load(gate->dtype, gate->data, (size_t)i);
    float u = (float)dtype_load(up->dtype, up->data, (size_t)i);
    float a = round_to(out->dtype, g * silu_sig(g));
    dtype_store(out->dtype, out->data, (size_t)i, a * u);
  }
  return STATUS_OK;
}

WIDE static status_t cpu_silu_mul_backward(tensor_t *dgate, tensor_t *dup, const tensor_t *dout,
                                           const tensor_t *gate, const tensor_t *up) {
  int64_t n = tensor_numel(dout);
  if (ALL_F32(dgate, dup, dout, gate, up)) {
    const float *pg = gate->data, *pu = up->data, *pd = dout->data;
    float *dg = dgate->data, *du = dup->data;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
      float g = pg[i], s = silu_sig(g), dy = pd[i];
      du[i] = dy * (g * s);
      dg[i] = dy * pu[i] * (s * (1.0f + g * (1.0f - s)));
    }
    return STATUS_OK;
  }
  for (int64_t i = 0; i < n; i++) {
    float g = (float)dtype_load(gate->dtype, gate->data, (size_t)i);
    float u = (float)dtype_load(up->dtype, up->data, (size_t)i);
    float dy = (float)dtype_load(dout->dtype, dout->data, (size_t)i);
    float s = silu_sig(g);
    dtype_store(dup->dtype, dup->data, (size_t)i, dy * (g * s));
    dtype_store(dgate->dtype, dgate->data, (size_t)i, dy * u * (s * (1.0f + g * (1.0f - s))));
  }
  return STATUS_OK;
}

/* ---- activations, bias, LayerNorm ---- */

static float act_value(kernel_act_t act, float x) {
  switch (act) {
    case KERNEL_ACT_RELU: return x > 0.0f ? x : 0.0f;
    case KERNEL_ACT_GELU: return 0.5f * x * (1.0f + erff(x * (float)M_SQRT1_2));
    default: return x * silu_sig(x);
  }
}

static float act_derivative(kernel_act_t act, float x) {
  switch (act) {
    case KERNEL_ACT_RELU: return x > 0.0f ? 1.0f : 0.0f;
    case KERNEL_ACT_GELU: /* Phi(x) + x * phi(x) */
      return 0.5f * (1.0f + erff(x * (float)M_SQRT1_2)) +
             x * (float)(0.5 * M_2_SQRTPI * M_SQRT1_2) * expf(-0.5f * x * x);
    default: {
      float s = silu_sig(x);
      return s * (1.0f + x * (1.0f - s));
    }
  }
}

static status_t cpu_activation(tensor_t *out, const tensor_t *x, kernel_act_t act) {
  int64_t n = tensor_numel(out);
  for (int64_t i = 0; i < n; i++)
    dtype_store(out->dtype, out->data, (size_t)i,
                act_value(act, (float)dtype_load(x->dtype, x->data, (size_t)i)));
  return STATUS_OK;
}

static status_t cpu_activation_backward(tensor_t *dx, const tensor_t *dy, const tensor_t *x,
                                        kernel_act_t act) {
  int64_t n = tensor_numel(dx);
  for (int64_t i = 0; i < n; i++) {
    float g = (float)dtype_load(dy->dtype, dy->data, (size_t)i);
    float v = (float)dtype_load(x->dtype, x->data, (size_t)i);
    dtype_store(dx->dtype, dx->data, (size_t)i, g * act_derivative(act, v));
  }
  return STATUS_OK;
}

static status_t cpu_bias_add(tensor_t *out, const tensor_t *x, const tensor_t *b) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / D;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < D; j++) {
      size_t e = (size_t)(r * D + j);
      dtype_store(out->dtype, out->data, e,
                  (float)dtype_load(x->dtype, x->data, e) +
                      (float)dtype_load(b->dtype, b->data, (size_t)j));
    }
  return STATUS_OK;
}

static status_t cpu_bias_backward(tensor_t *db, const tensor_t *dy) {
  int64_t D = last_dim(dy), rows = tensor_numel(dy) / D;
  fbuf_t fdb, fdy;
  TRY(fbuf_out(&fdb, db, true));
  status_t st = fbuf_in(&fdy, dy);
  if (st != STATUS_OK) {
    fbuf_release(&fdb);
    return st;
  }
  for (int64_t j = 0; j < D; j++) { /* rows in order, as the CUDA twin */
    float acc = 0;
    for (int64_t r = 0; r < rows; r++) acc += fdy.p[r * D + j];
    fdb.p[j] += acc;
  }
  fbuf_commit(&fdb, db);
  fbuf_release(&fdy);
  return STATUS_OK;
}

static status_t cpu_layernorm(tensor_t *out, tensor_t *mean, tensor_t *rstd, const tensor_t *x,
                              const tensor_t *w, const tensor_t *b, float eps) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / D;
  fbuf_t fx, fw, fb = {0}, fo;
  fbuf_t *bufs[] = {&fx, &fw, &fb, &fo};
  int got = 0;
  status_t st = fbuf_in(&fx, x);
  if (st == STATUS_OK && ++got) st = fbuf_in(&fw, w);
  if (st == STATUS_OK && ++got && b != NULL) st = fbuf_in(&fb, b);
  if (st == STATUS_OK && ++got) st = fbuf_out(&fo, out, false);
  if (st != STATUS_OK) {
    for (int i = 0; i < got; i++) fbuf_release(bufs[i]);
    return st;
  }
  float *mu = mean->data, *r = rstd->data;
  for (int64_t i = 0; i < rows; i++) {
    const float *xi = fx.p + i * D;
    double s = 0, ss = 0;
    for (int64_t j = 0; j < D; j++) s += xi[j];
    mu[i] = (float)(s / (double)D);
    for (int64_t j = 0; j < D; j++) ss += (double)(xi[j] - mu[i]) * (xi[j] - mu[i]);
    r[i] = 1.0f / sqrtf((float)(ss / (double)D) + eps);
    for (int64_t j = 0; j < D; j++)
      fo.p[i * D + j] = (xi[j] - mu[i]) * r[i] * fw.p[j] + (b ? fb.p[j] : 0.0f);
  }
  fbuf_commit(&fo, out);
  fbuf_release(&fx);
  fbuf_release(&fw);
  fbuf_release(&fb);
  return STATUS_OK;
}

static status_t cpu_layernorm_backward(tensor_t *dx, tensor_t *dw, tensor_t *db, const tensor_t *dy,
                                       const tensor_t *x, const tensor_t *w, const tensor_t *mean,
                                       const tensor_t *rstd) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / D;
  fbuf_t fdx, fdw, fdb = {0}, fdy, fx, fw;
  fbuf_t *bufs[] = {&fdx, &fdw, &fdb, &fdy, &fx, &fw};
  int got = 0;
  status_t st = fbuf_out(&fdx, dx, false);
  if (st == STATUS_OK && ++got) st = fbuf_out(&fdw, dw, true);
  if (st == STATUS_OK && ++got && db != NULL) st = fbuf_out(&fdb, db, true);
  if (st == STATUS_OK && ++got) st = fbuf_in(&fdy, dy);
  if (st == STATUS_OK && ++got) st = fbuf_in(&fx, x);
  if (st == STATUS_OK && ++got) st = fbuf_in(&fw, w);
  if (st != STATUS_OK) {
    for (int i = 0; i < got; i++) fbuf_release(bufs[i]);
    return st;
  }
  const float *mu = mean->data, *r = rstd->data;
  for (int64_t i = 0; i < rows; i++) {
    const float *xi = fx.p + i * D, *dyi = fdy.p + i * D;
    double a = 0, c = 0; /* sums of g and of g * xhat, g = dy * w */
    for (int64_t j = 0; j < D; j++) {
      float g = dyi[j] * fw.p[j], xh = (xi[j] - mu[i]) * r[i];
      a += g;
      c += (double)g * xh;
    }
    float ma = (float)(a / (double)D), mc = (float)(c / (double)D);
    for (int64_t j = 0; j < D; j++) {
      float g = dyi[j] * fw.p[j], xh = (xi[j] - mu[i]) * r[i];
      fdx.p[i * D + j] = r[i] * (g - ma - xh * mc);
    }
  }
  for (int64_t j = 0; j < D; j++) { /* rows in order, as the CUDA twin */
    float sw = 0, sb = 0;
    for (int64_t i = 0; i < rows; i++) {
      float g = fdy.p[i * D + j];
      sw += g * ((fx.p[i * D + j] - mu[i]) * r[i]);
      sb += g;
    }
    fdw.p[j] += sw;
    if (db != NULL) fdb.p[j] += sb;
  }
  fbuf_commit(&fdx, dx);
  fbuf_commit(&fdw, dw);
  if (db != NULL) fbuf_commit(&fdb, db);
  fbuf_release(&fdy);
  fbuf_release(&fx);
  fbuf_release(&fw);
  return STATUS_OK;
}

WIDE static status_t cpu_add(tensor_t *out, const tensor_t *a, const tensor_t *b) {
  int64_t n = tensor_numel(out);
  if (out->dtype == DTYPE_F32) {
    const float *pa = a->data, *pb = b->data;
    float *po = out->data;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) po[i] = pa[i] + pb[i];
    return STATUS_OK;
  }
  for (int64_t i = 0; i < n; i++)
    dtype_store(out->dtype, out->data, (size_t)i,
                (float)dtype_load(a->dtype, a->data, (size_t)i) +
                    (float)dtype_load(b->dtype, b->data, (size_t)i));
  return STATUS_OK;
}

WIDE static status_t cpu_axpy(tensor_t *y, float alpha, const tensor_t *x) {
  int64_t n = tensor_numel(y);
  if (y->dtype == DTYPE_F32 && x->dtype == DTYPE_F32) {
    float *py = y->data;
    const float *px = x->data;
    if (alpha == 1.0f) {
#pragma omp simd
      for (int64_t i = 0; i < n; i++) py[i] += px[i];
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; i++) py[i] += alpha * px[i];
    }
    return STATUS_OK;
  }
  for (int64_t i = 0; i < n; i++)
    dtype_store(y->dtype, y->data, (size_t)i,
                (float)dtype_load(y->dtype, y->data, (size_t)i) +
                    alpha * (float)dtype_load(x->dtype, x->data, (size_t)i));
  return STATUS_OK;
}

WIDE static status_t cpu_scale(tensor_t *x, float alpha) {
  int64_t n = tensor_numel(x);
  if (x->dtype == DTYPE_F32) {
    float *px = x->data;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) px[i] *= alpha;
    return STATUS_OK;
  }
  for (int64_t i = 0; i < n; i++)
    dtype_store(x->dtype, x->data, (size_t)i,
                alpha * (float)dtype_load(x->dtype, x->data, (size_t)i));
  return STATUS_OK;
}

/* ---- cross-entropy ---- */

static status_t ce_target(const tensor_t *targets, int64_t r, int64_t V, int64_t *t) {
  *t = index_at(targets, r);
  if (*t >= V)
    return err_set(STATUS_EINVAL, "cross-entropy: target %lld of row %lld is outside [0, %lld)",
                   (long long)*t, (long long)r, (long long)V);
  return STATUS_OK;
}

/* log-sum-exp of a row: fp32 exponentials (as the CUDA twin), a double-precision sum. */
static float row_lse(const float *x, int64_t V) {
  float m = -INFINITY;
  for (int64_t j = 0; j < V; j++) m = x[j] > m ? x[j] : m;
  double s = 0;
  for (int64_t j = 0; j < V; j++) s += expf(x[j] - m);
  return m + (float)log(s);
}

static status_t cpu_cross_entropy(tensor_t *losses, const tensor_t *logits,
                                  const tensor_t *targets) {
  int64_t V = last_dim(logits), N = tensor_numel(targets);
  fbuf_t fl;
  TRY(fbuf_in(&fl, logits));
  float *out = losses->data;
  status_t st = STATUS_OK;
  for (int64_t r = 0; r < N && st == STATUS_OK; r++) {
    int64_t t;
    if ((st = ce_target(targets, r, V, &t)) != STATUS_OK) break;
    out[r] = t < 0 ? 0.0f : row_lse(fl.p + r * V, V) - fl.p[r * V + t];
  }
  fbuf_release(&fl);
  return st;
}

static status_t cpu_cross_entropy_backward(tensor_t *dlogits, const tensor_t *logits,
                                           const tensor_t *targets, float scale) {
  int64_t V = last_dim(logits), N = tensor_numel(targets);
  fbuf_t fl, fd;
  TRY(fbuf_in(&fl, logits));
  status_t st = fbuf_out(&fd, dlogits, false);
  if (st != STATUS_OK) {
    fbuf_release(&fl);
    return st;
  }
  for (int64_t r = 0; r < N && st == STATUS_OK; r++) {
    int64_t t;
    if ((st = ce_target(targets, r, V, &t)) != STATUS_OK) break;
    const float *x = fl.p + r * V;
    float *g = fd.p + r * V;
    if (t < 0) {
      memset(g, 0, sizeof(float) * (size_t)V);
      continue;
    }
    float m = -INFINITY; /* softmax with one exponential per logit */
    for (int64_t j = 0; j < V; j++) m = x[j] > m ? x[j] : m;
    double sum = 0;
    for (int64_t j = 0; j < V; j++) sum += (g[j] = expf(x[j] - m));
    float k = (float)(scale / sum);
    for (int64_t j = 0; j < V; j++) g[j] *= k;
    g[t] -= scale;
  }
  fbuf_commit(&fd, dlogits);
  fbuf_release(&fl);
  return st;
}

/* ---- optimizer and reductions ---- */

WIDE static status_t cpu_adamw(tensor_t *p, const tensor_t *g, tensor_t *m, tensor_t *v,
                               const adamw_args_t *a) {
  float decay = (float)(1.0 - a->lr * a->weight_decay);
  float one_minus_b1 = (float)(1.0 - a->beta1), b2 = (float)a->beta2;
  float one_minus_b2 = (float)(1.0 - a->beta2);
  double bc1 = 1.0 - pow(a->beta1, (double)a->step), bc2 = 1.0 - pow(a->beta2, (double)a->step);
  float step_size = (float)(a->lr / bc1), bc2_sqrt = (float)sqrt(bc2), eps = (float)a->eps;
  float gs = a->grad_scale != 0 ? a->grad_scale : 1.0f; /* x * 1 is x exactly */
  float *pm = m->data, *pv = v->data;
  int64_t n = tensor_numel(p);
  if (ALL_F32(p, g)) {
    float *pp = p->data;
    const float *pg = g->data;
#pragma omp simd /* vectorised at -O2 as well (-fopenmp-simd): the same IEEE operations */
    for (int64_t i = 0; i < n; i++) {
      float gi = pg[i] * gs;
      pm[i] += one_minus_b1 * (gi - pm[i]);
      pv[i] = pv[i] * b2 + one_minus_b2 * gi * gi;
      float denom = sqrtf(pv[i]) / bc2_sqrt + eps;
      pp[i] = pp[i] * decay + (-step_size * pm[i]) / denom;
    }
    return STATUS_OK;
  }
  for (int64_t i = 0; i < n; i++) {
    float pi = (float)dtype_load(p->dtype, p->data, (size_t)i);
    float gi = (float)dtype_load(g->dtype, g->data, (size_t)i) * gs;
    pi *= decay;
    pm[i] += one_minus_b1 * (gi - pm[i]);
    pv[i] = pv[i] * b2 + one_minus_b2 * gi * gi;
    float denom = sqrtf(pv[i]) / bc2_sqrt + eps;
    pi += (-step_size * pm[i]) / denom;
    dtype_store(p->dtype, p->data, (size_t)i, pi);
  }
  return STATUS_OK;
}

/* sum a*b in fp32 lanes over blocks of 256 elements (vectorised), the blocks added in double:
 * the gradient norm. */
enum { SUM_BLOCK = 256 };

static double dot_f32(const float *a, const float *b, int64_t n) {
  double s = 0;
  for (int64_t i0 = 0; i0 < n; i0 += SUM_BLOCK) {
    int64_t i1 = i0 + SUM_BLOCK < n ? i0 + SUM_BLOCK : n;
    float acc = 0;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = i0; i < i1; i++) acc += a[i] * b[i];
    s += acc;
  }
  return s;
}

static status_t cpu_sum_squares(const tensor_t *x, double *out) {
  int64_t n = tensor_numel(x);
  double s = 0;
  if (x->dtype == DTYPE_F32) { /* fp32 lanes per block, double across blocks */
    *out = dot_f32(x->data, x->data, n);
    return STATUS_OK;
  }
  for (int64_t i = 0; i < n; i++) {
    double e = dtype_load(x->dtype, x->data, (size_t)i);
    s += e * e;
  }
  *out = s;
  return STATUS_OK;
}

static const kernel_ops_t ops = {
    .matmul = cpu_matmul,
    .embedding = cpu_embedding,
    .embedding_backward = cpu_embedding_backward,
    .rmsnorm = cpu_rmsnorm,
    .rmsnorm_backward = cpu_rmsnorm_backward,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .attention_backward = cpu_attention_backward,
    .silu_mul = cpu_silu_mul,
    .silu_mul_backward = cpu_silu_mul_backward,
    .activation = cpu_activation,
    .activation_backward = cpu_activation_backward,
    .bias_add = cpu_bias_add,
    .bias_backward = cpu_bias_backward,
    .layernorm = cpu_layernorm,
    .layernorm_backward = cpu_layernorm_backward,
    .add = cpu_add,
    .axpy = cpu_axpy,
    .scale = cpu_scale,
    .cross_entropy = cpu_cross_entropy,
    .cross_entropy_backward = cpu_cross_entropy_backward,
    .adamw = cpu_adamw,
    .sum_squares = cpu_sum_squares,
};

const kernel_ops_t *cpu_kernels(void) { return &ops; }
