/*
 * The batched-GEMM attention plan (core/attention_gemm_impl.h, what the CUDA backend runs with
 * cuBLAS) run by a host executor: every product as column-major cblas_sgemm calls on the
 * entry's operands, the row passes as loops. Its outputs must match the CPU attention
 * kernels (a different algorithm: row blocks per head) in f32, with chunks of one pair, of
 * several and of all, causal blocks of the whole sequence, of 7 and of 3 query rows, for
 * grouped-query, multi-query and one-head-per-kv-head shapes. A wrong offset, transpose,
 * leading dimension, scale or accumulation in the plan fails here.
 */
#include <cblas.h>
#include <math.h>
#include <string.h>

#include "core/attention_gemm_impl.h"
#include "core/kernels.h"
#include "tests/harness.h"

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

typedef struct host_exec {
  int64_t gemms, entries; /* calls and entries the plan made */
} host_exec_t;

static float *at(const attn_shape_t *s, attn_mat_t m, int64_t e, int64_t b, int64_t h,
                 int64_t g) {
  ck_assert_int_eq(m.dtype, DTYPE_F32);
  return (float *)m.base + attn_at(s, &m, e, b, h, g);
}

static fsdpc_status_t host_gemm(void *ctx, const attn_shape_t *s, const attn_batch_t *bt,
                                const attn_gemm_t *g) {
  host_exec_t *x = ctx;
  x->gemms++;
  for (int64_t e = 0; e < attn_entries(s, bt); e++) {
    int64_t b, h, kv;
    attn_entry(s, bt, e, &b, &h, &kv);
    cblas_sgemm(CblasColMajor, g->ta ? CblasTrans : CblasNoTrans,
                g->tb ? CblasTrans : CblasNoTrans, (int)g->m, (int)g->n, (int)g->k, g->alpha,
                at(s, g->a, e, b, h, kv), (int)g->lda, at(s, g->b, e, b, h, kv), (int)g->ldb,
                g->beta, at(s, g->c, e, b, h, kv), (int)g->ldc);
    x->entries++;
  }
  return STATUS_OK;
}

/* lse_i and the causal probabilities of entry e's row i of S into prow, columns [0, n). */
static float probs_row(const float *srow, int64_t i, int64_t n, float *prow,
                       const float *given_lse) {
  double m = -INFINITY, l = 0;
  for (int64_t j = 0; j <= i; j++) m = srow[j] > m ? srow[j] : m;
  for (int64_t j = 0; j <= i; j++) l += exp(srow[j] - m);
  float L = given_lse ? *given_lse : (float)(m + log(l));
  for (int64_t j = 0; j < n; j++) prow[j] = j <= i ? expf(srow[j] - L) : 0.0f;
  return L;
}

static fsdpc_status_t host_probs(void *ctx, const attn_shape_t *s, const attn_batch_t *bt,
                                 int64_t r0, int64_t r1, const float *S, float *lse, attn_mat_t p) {
  (void)ctx;
  for (int64_t e = 0; e < attn_entries(s, bt); e++) {
    int64_t b, h, g;
    attn_entry(s, bt, e, &b, &h, &g);
    for (int64_t i = r0; i < r1; i++)
      lse[(b * s->H + h) * s->T + i] =
          probs_row(S + (e * s->T + i) * s->T, i, r1, at(s, p, e, b, h, g) + i * s->T, NULL);
  }
  return STATUS_OK;
}

static fsdpc_status_t host_dscores(void *ctx, const attn_shape_t *s, const attn_batch_t *bt,
                                   int64_t r0, int64_t r1, const float *S, const float *dP,
                                   const float *lse, attn_mat_t dout, attn_mat_t out, attn_mat_t p,
                                   attn_mat_t ds) {
  (void)ctx;
  for (int64_t e = 0; e < attn_entries(s, bt); e++) {
    int64_t b, h, g;
    attn_entry(s, bt, e, &b, &h, &g);
    for (int64_t i = r0; i < r1; i++) {
      const float *o = at(s, out, e, b, h, g) + i * s->H * s->Dh,
                  *d = at(s, dout, e, b, h, g) + i * s->H * s->Dh;
      float D = 0, *prow = at(s, p, e, b, h, g) + i * s->T;
      float *drow = at(s, ds, e, b, h, g) + i * s->T;
      for (int64_t c = 0; c < s->Dh; c++) D += d[c] * o[c];
      probs_row(S + (e * s->T + i) * s->T, i, r1, prow, &lse[(b * s->H + h) * s->T + i]);
      const float *dprow = dP + (e * s->T + i) * s->T;
      for (int64_t j = 0; j < r1; j++) drow[j] = j <= i ? prow[j] * (dprow[j] - D) * s->scale : 0;
    }
  }
  return STATUS_OK;
}

static void rnd(fsdpc_tensor_t *t, int ndim, const int64_t *shape, unsigned long long seed) {
  ok(tensor_init(t, DTYPE_F32, device_cpu(), ndim, shape));
  test_rng_t r = {seed};
  test_fill_uniform(t, &r, 1.0);
}

static void poisoned(fsdpc_tensor_t *t, int ndim, const int64_t *shape) {
  ok(tensor_init(t, DTYPE_F32, device_cpu(), ndim, shape));
  ok(tensor_fill(t, NAN));
}

static const struct {
  int64_t B, T, H, Hkv, Dh;
} shapes[] = {{2, 19, 6, 2, 10}, {1, 37, 4, 4, 16}, {3, 5, 8, 1, 8}, {2, 130, 4, 2, 32}};

/* scratch_max: one byte (a pair per chunk), 3 pairs' worth, everything at once */
static size_t budget(int which, const attn_shape_t *s) {
  size_t TT = (size_t)(s->T * s->T), fwd = (size_t)s->rep * TT * 8, bwd = TT * 16;
  size_t pair = fwd > bwd ? fwd : bwd;
  return which == 0 ? 1 : which == 1 ? 3 * pair : (size_t)1 << 40;
}

/* Chunks of the pairs when each chunk takes what fits max bytes at per_pair each (one at
 * least). */
static int64_t chunks_of(int64_t pairs, size_t max, size_t per_pair) {
  int64_t per = (int64_t)(max / per_pair);
  per = per < 1 ? 1 : per > pairs ? pairs : per;
  return (pairs + per - 1) / per;
}

START_TEST(gemm_plan_matches_cpu_attention) {
  int si = _i / 3;
  int64_t sq[4] = {shapes[si].B, shapes[si].T, shapes[si].H, shapes[si].Dh};
  int64_t sk[4] = {shapes[si].B, shapes[si].T, shapes[si].Hkv, shapes[si].Dh};
  int64_t sl[3] = {shapes[si].B, shapes[si].H, shapes[si].T};
  fsdpc_tensor_t q, k, v, dy, y, lse, dq, dk, dv, y2, lse2, dq2, dk2, dv2;
  rnd(&q, 4, sq, 100 + si);
  rnd(&k, 4, sk, 200 + si);
  rnd(&v, 4, sk, 300 + si);
  rnd(&dy, 4, sq, 400 + si);
  poisoned(&y, 4, sq);
  poisoned(&lse, 3, sl);
  poisoned(&dq, 4, sq);
  poisoned(&dk, 4, sk);
  poisoned(&dv, 4, sk);
  ok(kernel_attention(&y, &lse, &q, &k, &v));
  ok(kernel_attention_backward(&dq, &dk, &dv, &dy, &q, &k, &v, &y, &lse));

  attn_shape_t s = attn_shape_of(sq, sk);
  host_exec_t hx = {0, 0};
  /* causal blocks of query rows: one block (the whole sequence), blocks of 7 and of 3 */
  int64_t br = _i % 3 == 0 ? 0 : _i % 3 == 1 ? 7 : 3;
  attn_exec_t x = {.ctx = &hx, .gemm = host_gemm, .probs = host_probs, .dscores = host_dscores,
                   .device = device_cpu(), .scratch_max = budget(_i % 3, &s), .block_rows = br};
  int64_t nb = br > 0 && br < s.T ? (s.T + br - 1) / br : 1;
  poisoned(&y2, 4, sq);
  poisoned(&lse2, 3, sl);
  poisoned(&dq2, 4, sq);
  poisoned(&dk2, 4, sk);
  poisoned(&dv2, 4, sk);
  ok(attn_gemm_forward(&x, &s, DTYPE_F32, y2.data, lse2.data, q.data, k.data, v.data));
  int64_t pairs = s.B * s.Hkv, TT = s.T * s.T;
  int64_t fwd = chunks_of(pairs, x.scratch_max, (size_t)(s.rep * TT * 8));
  int64_t bwd = chunks_of(pairs, x.scratch_max, (size_t)(TT * 16));
  ck_assert(_i % 3 != 0 || (fwd == pairs && bwd == pairs)); /* a pair per chunk */
  ck_assert(_i % 3 != 2 || (fwd == 1 && bwd == 1));         /* one chunk */
  ck_assert_int_eq(hx.gemms, 2 * fwd * nb);          /* S and O per chunk and block */
  ck_assert_int_eq(hx.entries, 2 * s.B * s.H * nb);  /* every (batch, head) twice a block */
  ok(attn_gemm_backward(&x, &s, DTYPE_F32, dq2.data, dk2.data, dv2.data, dy.data, q.data, k.data,
                        v.data, y.data, lse.data));
  ck_assert_int_eq(hx.gemms, (2 * fwd + 5 * bwd * s.rep) * nb);
  ck_assert_int_eq(hx.entries, (2 * s.B * s.H + 5 * s.B * s.H) * nb);

  const fsdpc_tensor_t *got[] = {&y2, &lse2, &dq2, &dk2, &dv2}, *want[] = {&y, &lse, &dq, &dk, &dv};
  const char *names[] = {"out", "lse", "dq", "dk", "dv"};
  for (int i = 0; i < 5; i++) {
    double e = test_rel_l2(got[i], want[i]);
    ck_assert_msg(e <= 2e-6,
                  "shape %d, budget %d, blocks of %lld rows: %s: relative error %.3g against the "
                  "CPU kernel", si, _i % 3, (long long)br, names[i], e);
  }
  fsdpc_tensor_t *all[] = {&q, &k, &v, &dy, &y, &lse, &dq, &dk, &dv, &y2, &lse2, &dq2, &dk2, &dv2};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("attention_gemm");
  TCase *tc = tcase_create("plan");
  tcase_add_loop_test(tc, gemm_plan_matches_cpu_attention, 0,
                      3 * (int)(sizeof shapes / sizeof shapes[0]));
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
