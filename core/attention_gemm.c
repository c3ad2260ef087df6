/* Attention as batched matrix products: the plan of core/attention_gemm_impl.h. */
#include "core/attention_gemm_impl.h"

#include <math.h>

#include "core/tensor.h"

attn_shape_t attn_shape_of(const int64_t *q_shape, const int64_t *k_shape) {
  attn_shape_t s = {q_shape[0], q_shape[1], q_shape[2], k_shape[2], q_shape[3], 0, 0};
  s.rep = s.H / s.Hkv;
  s.scale = 1.0f / sqrtf((float)s.Dh);
  return s;
}

/* Pairs per chunk: as many as fit scratch_max at per_pair bytes each, at least one. */
static int64_t chunk_pairs(const attn_exec_t *x, const attn_shape_t *s, size_t per_pair) {
  int64_t pairs = s->B * s->Hkv, n = per_pair ? (int64_t)(x->scratch_max / per_pair) : pairs;
  return n < 1 ? 1 : n > pairs ? pairs : n;
}

static attn_mat_t mat(const void *base, dtype_t dt, attn_layout_t l) {
  return (attn_mat_t){(void *)base, dt, l, 0};
}

/* m from element off of each entry's matrix on. */
static attn_mat_t from(attn_mat_t m, int64_t off) {
  m.off = off;
  return m;
}

/* Query rows per causal block. */
static int64_t block_rows(const attn_exec_t *x, const attn_shape_t *s) {
  return x->block_rows > 0 && x->block_rows < s->T ? x->block_rows : s->T;
}

/* Rows [r0, r1) of S (or dP) = alpha X Y^T, keys [0, r1): X of layout xl (rows ldx apart),
 * Y of layout yl; the row-major block is the column-major Y X^T. */
static fsdpc_status_t scores(const attn_exec_t *x, const attn_shape_t *s, const attn_batch_t *bt,
                             int64_t r0, int64_t r1, attn_mat_t X, int64_t ldx, attn_mat_t Y,
                             int64_t ldy, float alpha, float *out) {
  attn_gemm_t g = {.ta = true, .tb = false, .m = r1, .n = r1 - r0, .k = s->Dh, .lda = ldy,
                   .ldb = ldx, .ldc = s->T, .alpha = alpha, .beta = 0.0f, .a = Y,
                   .b = from(X, r0 * ldx),
                   .c = from(mat(out, DTYPE_F32, ATTN_SCRATCH), r0 * s->T)};
  return x->gemm(x->ctx, s, bt, &g);
}

/* With M a T x T scratch matrix (row-major) and Y's rows ldy apart, for rows [r0, r1) and keys
 * [0, r1): without tm, rows [r0, r1) of C = M Y (Y: key rows); with tm, keys [0, r1) of
 * C (+)= M^T Y (Y: query rows). Column-major: C = Y M^T, or C = Y M. */
static fsdpc_status_t times(const attn_exec_t *x, const attn_shape_t *s, const attn_batch_t *bt,
                            int64_t r0, int64_t r1, attn_mat_t M, bool tm, attn_mat_t Y,
                            int64_t ldy, attn_mat_t C, int64_t ldc, float beta) {
  attn_gemm_t g = {.ta = false, .tb = tm, .m = s->Dh, .n = tm ? r1 : r1 - r0,
                   .k = tm ? r1 - r0 : r1, .lda = ldy, .ldb = s->T, .ldc = ldc, .alpha = 1.0f,
                   .beta = beta, .a = tm ? from(Y, r0 * ldy) : Y, .b = from(M, r0 * s->T),
                   .c = tm ? C : from(C, r0 * ldc)};
  return x->gemm(x->ctx, s, bt, &g);
}

fsdpc_status_t attn_gemm_forward(const attn_exec_t *x, const attn_shape_t *s, dtype_t dt, void *out,
                                 float *lse, const void *q, const void *k, const void *v) {
  size_t es = dtype_size(dt), TT = (size_t)(s->T * s->T);
  size_t per_pair = (size_t)s->rep * TT * (sizeof(float) + es);
  int64_t chunk = chunk_pairs(x, s, per_pair), pairs = s->B * s->Hkv, br = block_rows(x, s);
  size_t bytes = (size_t)chunk * per_pair;
  void *scratch;
  FSDPC_TRY(device_alloc(x->device, bytes, &scratch));
  float *S = scratch;
  void *P = S + (size_t)chunk * (size_t)s->rep * TT;
  int64_t ldq = s->H * s->Dh, ldk = s->Hkv * s->Dh;
  fsdpc_status_t st = STATUS_OK;
  for (int64_t p0 = 0; p0 < pairs && st == STATUS_OK; p0 += chunk)
    for (int64_t r0 = 0; r0 < s->T && st == STATUS_OK; r0 += br) {
      attn_batch_t bt = {p0, pairs - p0 < chunk ? pairs - p0 : chunk, -1};
      int64_t r1 = r0 + br < s->T ? r0 + br : s->T;
      st = scores(x, s, &bt, r0, r1, mat(q, dt, ATTN_HEADS), ldq, mat(k, dt, ATTN_KV_HEADS), ldk,
                  s->scale, S);
      if (st == STATUS_OK)
        st = x->probs(x->ctx, s, &bt, r0, r1, S, lse, mat(P, dt, ATTN_SCRATCH));
      if (st == STATUS_OK)
        st = times(x, s, &bt, r0, r1, mat(P, dt, ATTN_SCRATCH), false, mat(v, dt, ATTN_KV_HEADS),
                   ldk, mat(out, dt, ATTN_HEADS), ldq, 0.0f);
    }
  device_free(x->device, scratch, bytes);
  return st;
}

/* dst (dtype dt) = src (F32), n elements on dev. */
static fsdpc_status_t cast_from_f32(device_t dev, void *dst, dtype_t dt, float *src, int64_t n) {
  fsdpc_tensor_t d, f;
  FSDPC_TRY(tensor_wrap(&d, dst, dt, dev, 1, &n));
  fsdpc_status_t st = tensor_wrap(&f, src, DTYPE_F32, dev, 1, &n);
  if (st == STATUS_OK) st = tensor_copy(&d, &f);
  tensor_free(&f);
  tensor_free(&d);
  return st;
}

/* n F32 zeros at p on dev. */
static fsdpc_status_t zero_f32(device_t dev, void *p, int64_t n) {
  fsdpc_tensor_t t;
  FSDPC_TRY(tensor_wrap(&t, p, DTYPE_F32, dev, 1, &n));
  fsdpc_status_t st = tensor_fill(&t, 0.0);
  tensor_free(&t);
  return st;
}

fsdpc_status_t attn_gemm_backward(const attn_exec_t *x, const attn_shape_t *s, dtype_t dt, void *dq,
                                  void *dk, void *dv, const void *dout, const void *q,
                                  const void *k, const void *v, const void *out, const float *lse) {
  size_t es = dtype_size(dt), TT = (size_t)(s->T * s->T);
  size_t per_pair = TT * 2 * (sizeof(float) + es); /* S, dP (F32); P, dS */
  int64_t chunk = chunk_pairs(x, s, per_pair), pairs = s->B * s->Hkv, br = block_rows(x, s);
  int64_t nk = s->B * s->T * s->Hkv * s->Dh, ldq = s->H * s->Dh, ldk = s->Hkv * s->Dh;
  /* dk and dv are sums over each group's heads and the row blocks: in F32 from zero, then
   * cast (F32 ones directly) */
  bool direct = dt == DTYPE_F32;
  size_t bytes = (size_t)chunk * per_pair, acc_bytes = direct ? 0 : 2 * sizeof(float) * (size_t)nk;
  void *scratch, *acc = NULL;
  FSDPC_TRY(device_alloc(x->device, bytes, &scratch));
  fsdpc_status_t st = device_alloc(x->device, acc_bytes, &acc);
  if (st != STATUS_OK) {
    device_free(x->device, scratch, bytes);
    return st;
  }
  float *S = scratch, *dP = S + (size_t)chunk * TT;
  void *P = dP + (size_t)chunk * TT, *dS = (char *)P + (size_t)chunk * TT * es;
  void *dk32 = direct ? dk : acc, *dv32 = direct ? dv : (float *)acc + nk;
  if (nk > 0) st = zero_f32(x->device, dk32, nk);
  if (st == STATUS_OK && nk > 0) st = zero_f32(x->device, dv32, nk);
  attn_mat_t Sq = mat(q, dt, ATTN_HEADS), Sk = mat(k, dt, ATTN_KV_HEADS);
  attn_mat_t Mo = mat(out, dt, ATTN_HEADS), Mdo = mat(dout, dt, ATTN_HEADS);
  attn_mat_t Mp = mat(P, dt, ATTN_SCRATCH), Mds = mat(dS, dt, ATTN_SCRATCH);
  attn_mat_t Mdk = mat(dk32, DTYPE_F32, ATTN_KV_HEADS), Mdv = mat(dv32, DTYPE_F32, ATTN_KV_HEADS);
  for (int64_t p0 = 0; p0 < pairs && st == STATUS_OK; p0 += chunk)
    for (int64_t r = 0; r < s->rep && st == STATUS_OK; r++)
      for (int64_t r0 = 0; r0 < s->T && st == STATUS_OK; r0 += br) {
        attn_batch_t bt = {p0, pairs - p0 < chunk ? pairs - p0 : chunk, r};
        int64_t r1 = r0 + br < s->T ? r0 + br : s->T;
        st = scores(x, s, &bt, r0, r1, Sq, ldq, Sk, ldk, s->scale, S);
        if (st == STATUS_OK)
          st = scores(x, s, &bt, r0, r1, Mdo, ldq, mat(v, dt, ATTN_KV_HEADS), ldk, 1.0f, dP);
        if (st == STATUS_OK)
          st = x->dscores(x->ctx, s, &bt, r0, r1, S, dP, lse, Mdo, Mo, Mp, Mds);
        if (st == STATUS_OK) /* dQ = dS K */
          st = times(x, s, &bt, r0, r1, Mds, false, Sk, ldk, mat(dq, dt, ATTN_HEADS), ldq, 0.0f);
        if (st == STATUS_OK) /* dK += dS^T Q */
          st = times(x, s, &bt, r0, r1, Mds, true, Sq, ldq, Mdk, ldk, 1.0f);
        if (st == STATUS_OK) /* dV += P^T dO */
          st = times(x, s, &bt, r0, r1, Mp, true, Mdo, ldq, Mdv, ldk, 1.0f);
      }
  if (st == STATUS_OK && !direct) st = cast_from_f32(x->device, dk, dt, dk32, nk);
  if (st == STATUS_OK && !direct) st = cast_from_f32(x->device, dv, dt, dv32, nk);
  device_free(x->device, acc, acc_bytes);
  device_free(x->device, scratch, bytes);
  return st;
}
