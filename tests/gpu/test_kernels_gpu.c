/*
 * Every CUDA compute kernel against its CPU twin on the same random inputs: device outputs
 * are poisoned (NaN) first, sizes are not multiples of the block size, and each kernel runs in
 * f32, bf16 and f16. Tolerances (relative L2 over each output): none where the CUDA kernel keeps
 * the CPU kernel's order and rounding (embedding; RoPE, from the same table of angles); else 1e-5 in f32 (summation order
 * differs); 1e-2 in bf16 (one rounding of a differently ordered fp32 sum can move a bf16
 * value by one unit in the last place, 2^-8), 5e-3 in f16 (units eight times finer; the
 * margin for attention's backward, whose dS = P (dP - D) cancels). Exits 77 (skip) without a
 * CUDA device.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/kernels.h"
#include "tests/harness.h"

#define MAX_T 40

/* Under the CUDA emulator (tests/cuda_emu), which has no cuDNN: attention that would take it
 * must take its other path. */
static bool emulated(void) { return getenv("FSDPC_TEST_CUDA_EMULATED") != NULL; }

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

typedef struct kcase {
  const char *name;
  /* runs the kernel on dev with inputs from rng; fills outs (host f32 copies) */
  int (*run)(device_t dev, dtype_t dt, fsdpc_tensor_t *outs);
  int exact; /* the CPU kernel's order and rounding: the same bits in both dtypes */
  /* outputs stored in bf16 whatever dt is: a contraction the compilers choose differently
   * may move one of them by an ulp of bf16 (2^-8) */
  double min_tol;
} kcase_t;

/* A random float tensor on dev (same values on every device for the same seed). */
static void rnd(fsdpc_tensor_t *t, device_t dev, dtype_t dt, int ndim, const int64_t *shape,
                unsigned long long seed, double scale) {
  fsdpc_tensor_t h;
  ok(tensor_init(&h, dt, device_cpu(), ndim, shape));
  test_rng_t r = {seed};
  test_fill_uniform(&h, &r, scale);
  ok(tensor_clone(t, &h, dt, dev));
  tensor_free(&h);
}

static void poisoned(fsdpc_tensor_t *t, device_t dev, dtype_t dt, int ndim, const int64_t *shape) {
  ok(tensor_init(t, dt, dev, ndim, shape));
  ok(tensor_fill(t, NAN));
}

static void ids(fsdpc_tensor_t *t, device_t dev, int64_t n, int64_t V) {
  fsdpc_tensor_t h;
  ok(tensor_init(&h, DTYPE_I64, device_cpu(), 1, &n));
  for (int64_t i = 0; i < n; i++) ((int64_t *)h.data)[i] = (i * 7919) % V;
  if (n > 3) ((int64_t *)h.data)[3] = -100; /* ignored target (cross-entropy only) */
  ok(tensor_clone(t, &h, DTYPE_I64, dev));
  tensor_free(&h);
}

static void out(fsdpc_tensor_t *dst, fsdpc_tensor_t *t) {
  ok(tensor_clone(dst, t, DTYPE_F32, device_cpu()));
  tensor_free(t);
}

/* c = 0.5 a b^T + c (into values already there), then d = a^T c; outputs c and d. */
static void matmul_pair(device_t dev, dtype_t dt, fsdpc_tensor_t *o, int64_t M, int64_t N,
                        int64_t K) {
  int64_t sa[2] = {M, K}, sb[2] = {N, K}, sc[2] = {M, N}, sd[2] = {K, N};
  fsdpc_tensor_t a, b, c, d;
  rnd(&a, dev, dt, 2, sa, 1, 1);
  rnd(&b, dev, dt, 2, sb, 2, 1);
  rnd(&c, dev, dt, 2, sc, 3, 1);
  ok(kernel_matmul(&c, &a, false, &b, true, 0.5f, 1.0f));
  poisoned(&d, dev, dt, 2, sd);
  ok(kernel_matmul(&d, &a, true, &c, false, 1.0f, 0.0f));
  out(&o[0], &c);
  out(&o[1], &d);
  tensor_free(&a);
  tensor_free(&b);
}

/* The pair at sizes that are multiples of 8, at a training layer's (1024 tokens, 768 wide: the
 * products tensor-core algorithms with a workspace take), at odd sizes, then e = a b^T with a a
 * view one row into a matrix (off 16-byte boundaries). On the device, lt says whether cuBLASLt
 * is to run them: the case fails when it should and did not run the four products of even size
 * (with cuBLASLt's reason), or ran any product when it should not. The others may take
 * cublasGemmEx. */
static int matmul_case(device_t dev, dtype_t dt, fsdpc_tensor_t *o, bool lt) {
  bool on_device = dev.type == DEVICE_CUDA;
  if (on_device) kernel_matmul_set_lt(lt);
  int64_t runs = kernel_matmul_lt_runs();
  matmul_pair(dev, dt, o, 40, 32, 64);
  matmul_pair(dev, dt, o + 2, 1024, 768, 768);
  int64_t even = kernel_matmul_lt_runs() - runs;
  matmul_pair(dev, dt, o + 4, 37, 29, 53);
  int64_t sa[2] = {37, 53}, sb[2] = {29, 53}, se[2] = {36, 29};
  fsdpc_tensor_t a, b, rows, e;
  rnd(&a, dev, dt, 2, sa, 4, 1);
  rnd(&b, dev, dt, 2, sb, 5, 1);
  ok(tensor_narrow(&rows, &a, 0, 1, 36)); /* starts one row (53 elements) in */
  poisoned(&e, dev, dt, 2, se);
  ok(kernel_matmul(&e, &rows, false, &b, true, 1.0f, 0.0f));
  if (on_device) {
    const char *env = getenv("FSDPC_CUBLASLT");
    bool want = lt && !(env != NULL && strcmp(env, "0") == 0);
    int64_t all = kernel_matmul_lt_runs() - runs;
    kernel_matmul_set_lt(true);
    ck_assert_msg(want ? even == 4 : all == 0,
                  "%s: cuBLASLt ran %lld of 4 products of even size (%lld of 7 in all), %s "
                  "expected: %s",
                  dtype_name(dt), (long long)even, (long long)all, want ? "all" : "none",
                  kernel_matmul_lt_note());
  }
  out(&o[6], &e);
  tensor_free(&rows);
  tensor_free(&a);
  tensor_free(&b);
  return 7;
}

static int k_matmul(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  return matmul_case(dev, dt, o, true);
}

/* The same products through cublasGemmEx. */
static int k_matmul_gemmex(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  return matmul_case(dev, dt, o, false);
}

/* Rows whose strides are not 16-byte multiples (515 and 1001 elements) in products large enough
 * to be padded on the device (over 2^27 multiply-adds): every operand of both products, the
 * first one adding into values already in its output. */
static int k_matmul_padded(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  matmul_pair(dev, dt, o, 512, 1001, 515);
  /* an odd k with neither operand transposed: [512, 1001] x [1001, 515] */
  int64_t sx[2] = {512, 1001}, sw[2] = {1001, 515}, sy[2] = {512, 515};
  fsdpc_tensor_t x, w, y;
  rnd(&x, dev, dt, 2, sx, 4, 1);
  rnd(&w, dev, dt, 2, sw, 5, 1);
  poisoned(&y, dev, dt, 2, sy);
  ok(kernel_matmul(&y, &x, false, &w, false, 1.0f, 0.0f));
  out(&o[2], &y);
  tensor_free(&x);
  tensor_free(&w);
  return 3;
}

/* A mixture of experts' products through kernel_matmul_many over E stacked [out, in] weights,
 * the rows of x split by counts: y_e = x_e w_e^T, dx_e = dy_e w_e, dw_e = 0.5 dy_e^T x_e + dw_e
 * (into values already there). One expert has no rows: its forward and input-gradient
 * products have none either (skipped), its weight gradient sums no terms (dw_e stays). Outputs
 * y, dx, dw. */
static void experts_case(device_t dev, dtype_t dt, fsdpc_tensor_t *o, int64_t in, int64_t outd) {
  enum { E = 5 };
  static const int64_t counts[E] = {7, 0, 13, 1, 9};
  int64_t rows = 30, sw[3] = {E, outd, in}, sx[2] = {rows, in}, sy[2] = {rows, outd};
  fsdpc_tensor_t w, x, dy, y, dx, dw;
  rnd(&w, dev, dt, 3, sw, 11, 1);
  rnd(&x, dev, dt, 2, sx, 12, 1);
  rnd(&dy, dev, dt, 2, sy, 13, 1);
  rnd(&dw, dev, dt, 3, sw, 14, 1);
  poisoned(&y, dev, dt, 2, sy);
  poisoned(&dx, dev, dt, 2, sx);
  fsdpc_tensor_t v[5][E] = {{{0}}}; /* x_e, dy_e, y_e, dx_e, w_e; dw_e */
  fsdpc_tensor_t dwe[E] = {{0}};
  kernel_product_t fwd[E], bx[E], bw[E];
  int n = 0;
  for (int64_t e = 0, off = 0; e < E; off += counts[e++]) { /* the one without rows too */
    ok(tensor_narrow(&v[0][n], &x, 0, off, counts[e]));
    ok(tensor_narrow(&v[1][n], &dy, 0, off, counts[e]));
    ok(tensor_narrow(&v[2][n], &y, 0, off, counts[e]));
    ok(tensor_narrow(&v[3][n], &dx, 0, off, counts[e]));
    fsdpc_tensor_t one;
    ok(tensor_narrow(&one, &w, 0, e, 1));
    ok(tensor_view(&v[4][n], &one, 2, sw + 1));
    tensor_free(&one);
    ok(tensor_narrow(&one, &dw, 0, e, 1));
    ok(tensor_view(&dwe[n], &one, 2, sw + 1));
    tensor_free(&one);
    fwd[n] = (kernel_product_t){&v[2][n], &v[0][n], &v[4][n]};
    bx[n] = (kernel_product_t){&v[3][n], &v[1][n], &v[4][n]};
    bw[n] = (kernel_product_t){&dwe[n], &v[1][n], &v[0][n]};
    n++;
  }
  ok(kernel_matmul_many(fwd, n, false, true, 1.0f, 0.0f));
  ok(kernel_matmul_many(bx, n, false, false, 1.0f, 0.0f));
  ok(kernel_matmul_many(bw, n, true, false, 0.5f, 1.0f));
  for (int i = 0; i < n; i++) {
    for (int k = 0; k < 5; k++) tensor_free(&v[k][i]);
    tensor_free(&dwe[i]);
  }
  out(&o[0], &y);
  out(&o[1], &dx);
  out(&o[2], &dw);
  tensor_free(&w);
  tensor_free(&x);
  tensor_free(&dy);
}

/* The experts' products with rows of 40 and 24 elements (16-byte multiples in every dtype), which
 * take one grouped cuBLAS call each on the device, then with rows of 37 and 24 (off 16 bytes),
 * which run one by one. The case fails where the three calls did not run grouped for a reason
 * other than cuBLAS refusing the dtype (under the emulator: for any reason), or the last one
 * did not give its reason. */
static int k_matmul_many(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  int64_t runs = kernel_matmul_grouped_runs();
  experts_case(dev, dt, o, 40, 24);
  int64_t grouped = kernel_matmul_grouped_runs() - runs;
  char note[512];
  snprintf(note, sizeof note, "%s", kernel_matmul_grouped_note());
  experts_case(dev, dt, o + 3, 37, 24);
  if (dev.type == DEVICE_CUDA) {
    bool off = kernel_matmul_grouped_off()[0] != '\0';
    bool refused = !emulated() && strstr(note, "does not support") != NULL;
    ck_assert_msg(grouped == 3 || ((off || refused) && grouped == 0),
                  "%s: %lld of 3 calls grouped (%s)", dtype_name(dt), (long long)grouped, note);
    ck_assert_int_eq(kernel_matmul_grouped_runs() - runs, grouped);
    if (grouped == 3)
      ck_assert_msg(strstr(kernel_matmul_grouped_note(), "16-byte") != NULL, "note: %s",
                    kernel_matmul_grouped_note());
  }
  return 6;
}

static int k_embedding(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  int64_t st[2] = {61, 33}, so[2] = {45, 33};
  fsdpc_tensor_t table, id, y, g, dy;
  rnd(&table, dev, dt, 2, st, 4, 1);
  ids(&id, dev, 45, 61);
  ((void)0);
  fsdpc_tensor_t h;
  ok(tensor_clone(&h, &id, DTYPE_I64, device_cpu()));
  ((int64_t *)h.data)[3] = 5; /* embeddings need valid ids everywhere */
  tensor_free(&id);
  ok(tensor_clone(&id, &h, DTYPE_I64, dev));
  tensor_free(&h);
  poisoned(&y, dev, dt, 2, so);
  ok(kernel_embedding(&y, &table, &id));
  rnd(&dy, dev, dt, 2, so, 5, 1);
  ok(tensor_zeros(&g, DTYPE_F32, dev, 2, st));
  ok(kernel_embedding_backward(&g, &dy, &id));
  /* a vocabulary shard: rows [20, 50) of 61; other ids give zero rows and no gradient */
  int64_t ss[2] = {30, 33};
  fsdpc_tensor_t rows, shard, ys, gs;
  ok(tensor_narrow(&rows, &table, 0, 20, 30));
  ok(tensor_clone(&shard, &rows, dt, dev));
  poisoned(&ys, dev, dt, 2, so);
  ok(kernel_embedding_shard(&ys, &shard, &id, 20, 61));
  ok(tensor_zeros(&gs, DTYPE_F32, dev, 2, ss));
  ok(kernel_embedding_shard_backward(&gs, &dy, &id, 20, 61));
  /* many tokens per row, accumulated into a gradient that holds values already (bf16
   * gradients round once, after the row's sum), whole table and shard */
  int64_t n2 = 300, so2[2] = {300, 33};
  fsdpc_tensor_t id2, dy2, g2, gs2;
  ok(tensor_init(&h, DTYPE_I64, device_cpu(), 1, &n2));
  for (int64_t i = 0; i < n2; i++) ((int64_t *)h.data)[i] = (i * i + 3 * i) % 61 % 23 * 2;
  ok(tensor_clone(&id2, &h, DTYPE_I64, dev));
  tensor_free(&h);
  rnd(&dy2, dev, dt, 2, so2, 6, 1);
  rnd(&g2, dev, dt, 2, st, 7, 1);
  ok(kernel_embedding_backward(&g2, &dy2, &id2));
  rnd(&gs2, dev, dt, 2, ss, 8, 1);
  ok(kernel_embedding_shard_backward(&gs2, &dy2, &id2, 20, 61));
  out(&o[0], &y);
  out(&o[1], &g);
  out(&o[2], &ys);
  out(&o[3], &gs);
  out(&o[4], &g2);
  out(&o[5], &gs2);
  tensor_free(&id2);
  tensor_free(&dy2);
  tensor_free(&rows);
  tensor_free(&shard);
  tensor_free(&table);
  tensor_free(&id);
  tensor_free(&dy);
  return 6;
}

/* RMSNorm forward and backward over rows of D (rows on 16-byte boundaries when D is a multiple
 * of 8, else mostly not); outputs y, rstd, dx, dw. */
static int rmsnorm_case(device_t dev, dtype_t dt, fsdpc_tensor_t *o, int64_t rows, int64_t D) {
  int64_t sx[2] = {rows, D}, sw = D;
  fsdpc_tensor_t x, w, y, r, dy, dx, dw;
  rnd(&x, dev, dt, 2, sx, 6, 2);
  rnd(&w, dev, dt, 1, &sw, 7, 1);
  poisoned(&y, dev, dt, 2, sx);
  poisoned(&r, dev, DTYPE_F32, 1, &rows);
  ok(kernel_rmsnorm(&y, &r, &x, &w, 1e-5f));
  rnd(&dy, dev, dt, 2, sx, 8, 1);
  poisoned(&dx, dev, dt, 2, sx);
  ok(tensor_zeros(&dw, DTYPE_F32, dev, 1, &sw));
  ok(kernel_rmsnorm_backward(&dx, &dw, &dy, &x, &w, &r));
  out(&o[0], &y);
  out(&o[1], &r);
  out(&o[2], &dx);
  out(&o[3], &dw);
  tensor_free(&x);
  tensor_free(&w);
  tensor_free(&dy);
  return 4;
}

/* The backward's dw column by column over blocks of 64 rows, the last one short (170 rows of
 * 333), in 16-byte packs over blocks of 32 rows (1,300 rows of 40), a single short block (9
 * rows), and rows longer than a block's threads cover in one stride (12,300 columns). */
static int k_rmsnorm(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  int n = rmsnorm_case(dev, dt, o, 170, 333);
  n += rmsnorm_case(dev, dt, o + n, 9, 256);
  n += rmsnorm_case(dev, dt, o + n, 1300, 40);
  return n + rmsnorm_case(dev, dt, o + n, 3, 12300);
}

static int rope_case(device_t dev, dtype_t dt, fsdpc_tensor_t *o, int64_t head_dim) {
  int64_t s[4] = {3, 19, 5, head_dim};
  fsdpc_tensor_t x, y, z;
  rnd(&x, dev, dt, 4, s, 9, 1);
  poisoned(&y, dev, dt, 4, s);
  poisoned(&z, dev, dt, 4, s);
  rope_t plain = {.theta = 10000.0, .scaling = ROPE_DEFAULT, .factor = 1};
  rope_t llama3 = {.theta = 500000.0,
                   .scaling = ROPE_LLAMA3,
                   .factor = 8,
                   .low_freq_factor = 1,
                   .high_freq_factor = 4,
                   .original_max_pos = 64};
  ok(kernel_rope(&y, &x, &plain, 3, false));
  ok(kernel_rope(&z, &x, &llama3, 0, true));
  out(&o[0], &y);
  out(&o[1], &z);
  tensor_free(&x);
  return 2;
}

/* Heads of 14 (a pair a thread) and of 16 (four pairs a thread on the device), the same bits as
 * the CPU's either way. */
static int k_rope(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  int n = rope_case(dev, dt, o, 14);
  return n + rope_case(dev, dt, o + n, 16);
}

/* Attention of q [B, T, H, Dh] over k and v [B, T, Hkv, Dh]: out, lse, dq, dk, dv. On the
 * device, fused says whether cuDNN's fused attention is to run it: the case fails when it should
 * and did not (with cuDNN's reason), or did when it should not. */
static int attention_case(device_t dev, dtype_t dt, fsdpc_tensor_t *o, int64_t B, int64_t T,
                          int64_t H, int64_t Hkv, int64_t Dh, bool fused) {
  bool on_device = dev.type == DEVICE_CUDA;
  if (on_device) kernel_attention_set_fused(fused);
  int64_t runs = kernel_attention_fused_runs();
  int64_t sq[4] = {B, T, H, Dh}, sk[4] = {B, T, Hkv, Dh}, sl[3] = {B, H, T};
  fsdpc_tensor_t q, k, v, y, lse, dy, dq, dk, dv;
  rnd(&q, dev, dt, 4, sq, 10, 1);
  rnd(&k, dev, dt, 4, sk, 11, 1);
  rnd(&v, dev, dt, 4, sk, 12, 1);
  poisoned(&y, dev, dt, 4, sq);
  poisoned(&lse, dev, DTYPE_F32, 3, sl);
  ok(kernel_attention(&y, &lse, &q, &k, &v));
  rnd(&dy, dev, dt, 4, sq, 13, 1);
  poisoned(&dq, dev, dt, 4, sq);
  poisoned(&dk, dev, dt, 4, sk);
  poisoned(&dv, dev, dt, 4, sk);
  ok(kernel_attention_backward(&dq, &dk, &dv, &dy, &q, &k, &v, &y, &lse));
  if (on_device) {
    const char *env = getenv("FSDPC_CUDNN_ATTENTION");
    bool want = fused && dt != DTYPE_F32 && !(env != NULL && strcmp(env, "0") == 0) && !emulated();
    int64_t ran = kernel_attention_fused_runs() - runs;
    kernel_attention_set_fused(true);
    ck_assert_msg(ran == (want ? 2 : 0), "%s: cuDNN ran %lld of 2 calls, %s expected: %s",
                  dtype_name(dt), (long long)ran, want ? "both" : "none",
                  kernel_attention_fused_note());
  }
  out(&o[0], &y);
  out(&o[1], &lse);
  out(&o[2], &dq);
  out(&o[3], &dk);
  out(&o[4], &dv);
  tensor_free(&q);
  tensor_free(&k);
  tensor_free(&v);
  tensor_free(&dy);
  return 5;
}

/* Odd sizes: every product of the CUDA plan runs one entry at a time (unaligned operands). */
static int k_attention(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  return attention_case(dev, dt, o, 2, 19, 6, 2, 10, false);
}

/* Sizes whose operands are 16-byte aligned: batched products over pointer arrays. */
static int k_attention_batched(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  return attention_case(dev, dt, o, 2, 136, 8, 2, 64, false);
}

/* cuDNN's fused attention (bf16; f32 takes the batched products): grouped heads of 128, a
 * length off the 64-row tiles, and multi-head with one kv head per query head. */
static int k_attention_cudnn(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  int n = attention_case(dev, dt, o, 2, 200, 8, 2, 128, true);
  return n + attention_case(dev, dt, o + n, 1, 64, 4, 4, 64, true);
}

static int k_elementwise(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  int64_t s[2] = {41, 67};
  fsdpc_tensor_t g, u, y, dy, dg, du, sum, acc;
  rnd(&g, dev, dt, 2, s, 14, 4);
  rnd(&u, dev, dt, 2, s, 15, 1);
  poisoned(&y, dev, dt, 2, s);
  ok(kernel_silu_mul(&y, &g, &u));
  rnd(&dy, dev, dt, 2, s, 16, 1);
  poisoned(&dg, dev, dt, 2, s);
  poisoned(&du, dev, dt, 2, s);
  ok(kernel_silu_mul_backward(&dg, &du, &dy, &g, &u));
  poisoned(&sum, dev, dt, 2, s);
  ok(kernel_add(&sum, &g, &u));
  ok(kernel_scale(&sum, -0.75f));
  rnd(&acc, dev, DTYPE_F32, 2, s, 17, 1);
  ok(kernel_axpy(&acc, 0.3f, &g));
  /* views one row in (operands off 16-byte boundaries go element by element), in place, and
   * axpy within one dtype */
  int64_t sv[2] = {40, 67};
  fsdpc_tensor_t gv, uv, yv;
  ok(tensor_narrow(&gv, &g, 0, 1, 40));
  ok(tensor_narrow(&uv, &u, 0, 1, 40));
  poisoned(&yv, dev, dt, 2, sv);
  ok(kernel_silu_mul(&yv, &gv, &uv));
  ok(kernel_add(&yv, &yv, &gv));
  ok(kernel_axpy(&dy, 0.5f, &u));
  out(&o[0], &y);
  out(&o[1], &dg);
  out(&o[2], &du);
  out(&o[3], &sum);
  out(&o[4], &acc);
  out(&o[5], &yv);
  out(&o[6], &dy);
  tensor_free(&gv);
  tensor_free(&uv);
  tensor_free(&g);
  tensor_free(&u);
  return 7;
}

/* Losses and logits' gradients of n rows of V logits (rows on 16-byte boundaries when V is a
 * multiple of 8, else mostly not). */
static int cross_entropy_case(device_t dev, dtype_t dt, fsdpc_tensor_t *o, int64_t n, int64_t V) {
  int64_t s[2] = {n, V};
  fsdpc_tensor_t logits, tg, losses, d;
  rnd(&logits, dev, dt, 2, s, 18, 5);
  ids(&tg, dev, n, V);
  poisoned(&losses, dev, DTYPE_F32, 1, &n);
  ok(kernel_cross_entropy(&losses, &logits, &tg));
  poisoned(&d, dev, dt, 2, s);
  ok(kernel_cross_entropy_backward(&d, &logits, &tg, 1.0f / (float)(n - 1)));
  /* the mean over the targets kept and its gradient (times dloss), read on the device */
  int64_t one = 1;
  fsdpc_tensor_t mean, count, dloss, dm;
  poisoned(&mean, dev, DTYPE_F32, 1, &one);
  ok(tensor_init(&count, DTYPE_I64, dev, 1, &one));
  ok(tensor_fill(&count, -1.0));
  ok(kernel_masked_mean(&mean, &count, &losses, &tg));
  ok(tensor_init(&dloss, DTYPE_F32, dev, 1, &one));
  ok(tensor_fill(&dloss, 0.375));
  poisoned(&dm, dev, dt, 2, s);
  ok(kernel_cross_entropy_backward_mean(&dm, &logits, &tg, &dloss, &count));
  out(&o[0], &losses);
  out(&o[1], &d);
  out(&o[2], &mean);
  out(&o[3], &dm);
  out(&o[4], &count);
  tensor_free(&dloss);
  tensor_free(&logits);
  tensor_free(&tg);
  return 5;
}

static int k_cross_entropy(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  int n = cross_entropy_case(dev, dt, o, 23, 301);
  return n + cross_entropy_case(dev, dt, o + n, 7, 304);
}

/* Three AdamW steps of p (dt, 1001 elements) from g and moments of mdt starting at zero;
 * step 2 with clipping folded in (a gradient scale). */
static void adamw_three_steps(device_t dev, dtype_t dt, dtype_t mdt, fsdpc_tensor_t *p,
                              fsdpc_tensor_t *g, fsdpc_tensor_t *m, fsdpc_tensor_t *v) {
  int64_t n = 1001;
  rnd(p, dev, dt, 1, &n, 19, 1);
  rnd(g, dev, dt, 1, &n, 20, 1);
  ok(tensor_zeros(m, mdt, dev, 1, &n));
  ok(tensor_zeros(v, mdt, dev, 1, &n));
  for (int step = 1; step <= 3; step++) {
    adamw_args_t a = {.lr = 1e-2,
                      .beta1 = 0.9,
                      .beta2 = 0.95,
                      .eps = 1e-8,
                      .weight_decay = 0.1,
                      .step = step,
                      .grad_scale = step == 2 ? 0.375f : 0};
    ok(kernel_adamw(p, g, m, v, &a));
  }
}

static int k_adamw_sumsq(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  fsdpc_tensor_t p, g, m, v;
  adamw_three_steps(dev, dt, DTYPE_F32, &p, &g, &m, &v);
  double ss, many[3];
  ok(kernel_sum_squares(&g, &ss));
  int64_t none = 0;
  fsdpc_tensor_t empty;
  ok(tensor_init(&empty, dt, dev, 1, &none));
  const fsdpc_tensor_t *xs[3] = {&p, &empty, &g}; /* one read back; the single call's bits */
  ok(kernel_sum_squares_many(xs, 3, many));
  ck_assert(many[2] == ss && many[1] == 0.0);
  fsdpc_tensor_t s;
  int64_t two = 2;
  ok(tensor_init(&s, DTYPE_F32, device_cpu(), 1, &two));
  ((float *)s.data)[0] = (float)ss;
  ((float *)s.data)[1] = (float)many[0];
  out(&o[0], &p);
  out(&o[1], &m);
  out(&o[2], &v);
  o[3] = s;
  tensor_free(&g);
  tensor_free(&empty);
  /* kernel_adamw_many: 40 parameters (more than one launch's table on a GPU; sizes from 0 to
   * 1184, f32 and dt parameters, each its own learning rate), two steps; the same bits as
   * kernel_adamw on each, and the parameters' sums of squares against the other device */
  enum { K = 40 };
  fsdpc_tensor_t P[2][K], G[K], M[2][K], V[2][K];
  adamw_item_t items[K];
  for (int k = 0; k < K; k++) {
    int64_t nk = k * 37 % 1200;
    dtype_t pk = k % 3 ? dt : DTYPE_F32;
    for (int c = 0; c < 2; c++) {
      rnd(&P[c][k], dev, pk, 1, &nk, 30 + k, 1);
      ok(tensor_zeros(&M[c][k], DTYPE_F32, dev, 1, &nk));
      ok(tensor_zeros(&V[c][k], DTYPE_F32, dev, 1, &nk));
    }
    rnd(&G[k], dev, dt, 1, &nk, 80 + k, 1);
  }
  for (int step = 1; step <= 2; step++) {
    for (int k = 0; k < K; k++) {
      adamw_args_t a = {.lr = 1e-3 * (1 + k % 7), .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                        .weight_decay = k % 2 ? 0.1 : 0, .step = step,
                        .grad_scale = step == 2 ? 0.5f : 0};
      items[k] = (adamw_item_t){&P[0][k], &G[k], &M[0][k], &V[0][k], a};
      ok(kernel_adamw(&P[1][k], &G[k], &M[1][k], &V[1][k], &a));
    }
    int failed = 7;
    ok(kernel_adamw_many(items, K, &failed));
    ck_assert_int_eq(failed, -1);
  }
  int64_t kk = K;
  fsdpc_tensor_t sums;
  ok(tensor_init(&sums, DTYPE_F32, device_cpu(), 1, &kk));
  for (int k = 0; k < K; k++) {
    bool same_p = false, same_m = false, same_v = false;
    ok(tensor_equal(&P[0][k], &P[1][k], &same_p));
    ok(tensor_equal(&M[0][k], &M[1][k], &same_m));
    ok(tensor_equal(&V[0][k], &V[1][k], &same_v));
    ck_assert_msg(same_p && same_m && same_v, "kernel_adamw_many item %d: not kernel_adamw's bits",
                  k);
    double sq;
    ok(kernel_sum_squares(&P[0][k], &sq));
    ((float *)sums.data)[k] = (float)sq;
    for (int c = 0; c < 2; c++) {
      tensor_free(&P[c][k]);
      tensor_free(&M[c][k]);
      tensor_free(&V[c][k]);
    }
    tensor_free(&G[k]);
  }
  o[4] = sums;
  return 5;
}

/* kernel_sum_squares_many over 130 tensors (more than one launch's table on a GPU): sizes from
 * 0 to 70,000, views starting off a 16-byte boundary, and two of 40,000,000 ones (more blocks
 * than a tensor may take, so each thread strides over many; one on a boundary, one off it),
 * whose sums must be exactly their sizes: an element read twice or never is seen there. The
 * output is each random tensor's root mean square, so that every tensor weighs alike in the
 * comparison; the single call's bits are checked on the device itself. */
static int k_sumsq_many(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  enum { K = 130, ONES = 96 }; /* ONES and ONES + 1: the 40,000,000 ones */
  fsdpc_tensor_t base[K], view[K];
  const fsdpc_tensor_t *xs[K];
  int64_t n[K];
  for (int k = 0; k < K; k++) {
    bool ones = k == ONES || k == ONES + 1;
    n[k] = ones ? 40000000 : (int64_t)k * 541 % 70001;
    int64_t whole = n[k] + 3;
    if (ones) {
      ok(tensor_init(&base[k], dt, dev, 1, &whole));
      ok(tensor_fill(&base[k], 1.0));
    } else {
      rnd(&base[k], dev, dt, 1, &whole, 200 + k, 1);
    }
    /* every third tensor starts one element in: off the boundary in every dtype */
    ok(tensor_narrow(&view[k], &base[k], 0, k % 3 == 1 ? 1 : 0, n[k]));
    xs[k] = &view[k];
  }
  double ss[K];
  ok(kernel_sum_squares_many(xs, K, ss));
  for (int k = ONES; k <= ONES + 1; k++)
    ck_assert_msg(ss[k] == (double)n[k], "item %d: %lld ones sum to %.17g", k, (long long)n[k],
                  ss[k]);
  for (int k = 0; k < K; k += 32) { /* a call of its own gives the same bits */
    int j = k + 29 < K ? k + 29 : K - 1;
    double one;
    ok(kernel_sum_squares(&view[j], &one));
    ck_assert_msg(one == ss[j], "kernel_sum_squares_many item %d: not kernel_sum_squares's bits",
                  j);
  }
  int64_t kk = K;
  ok(tensor_init(&o[0], DTYPE_F32, device_cpu(), 1, &kk));
  for (int k = 0; k < K; k++) {
    ck_assert_msg(n[k] > 0 || ss[k] == 0.0, "item %d: an empty tensor's sum is %g", k, ss[k]);
    ((float *)o[0].data)[k] = n[k] > 0 ? (float)sqrt(ss[k] / (double)n[k]) : 0.0f;
    tensor_free(&view[k]);
    tensor_free(&base[k]);
  }
  return 1;
}

/* AdamW with bf16 moments (optim.state_dtype). */
static int k_adamw_bf16_moments(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  fsdpc_tensor_t p, g, m, v;
  adamw_three_steps(dev, dt, DTYPE_BF16, &p, &g, &m, &v);
  out(&o[0], &p);
  out(&o[1], &m);
  out(&o[2], &v);
  tensor_free(&g);
  return 3;
}

static int k_activations(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  int64_t s[2] = {29, 71};
  fsdpc_tensor_t x, dy;
  rnd(&x, dev, dt, 2, s, 21, 4);
  rnd(&dy, dev, dt, 2, s, 22, 1);
  for (int a = 0; a < KERNEL_ACT_COUNT; a++) {
    fsdpc_tensor_t y, dx;
    poisoned(&y, dev, dt, 2, s);
    poisoned(&dx, dev, dt, 2, s);
    ok(kernel_activation(&y, &x, (kernel_act_t)a));
    ok(kernel_activation_backward(&dx, &dy, &x, (kernel_act_t)a));
    out(&o[2 * a], &y);
    out(&o[2 * a + 1], &dx);
  }
  tensor_free(&x);
  tensor_free(&dy);
  return 2 * KERNEL_ACT_COUNT;
}

/* Bias and LayerNorm forward and backward over rows of D: outputs y, db, the norm's y, mean,
 * rstd, dx, dw, db. */
/* A random [rows, D] tensor of dt on dev whose first element is `off` elements into its
 * storage (off 1: every row off a 16-byte boundary when D is a multiple of 8). */
static void rnd_at(fsdpc_tensor_t *t, device_t dev, dtype_t dt, int64_t rows, int64_t D,
                   unsigned long long seed, double scale, int64_t off) {
  int64_t whole = rows * D + off, s[2] = {rows, D};
  fsdpc_tensor_t flat, part;
  rnd(&flat, dev, dt, 1, &whole, seed, scale);
  ok(tensor_narrow(&part, &flat, 0, off, rows * D));
  ok(tensor_view(t, &part, 2, s));
  tensor_free(&part);
  tensor_free(&flat);
}

static int bias_layernorm_case(device_t dev, dtype_t dt, fsdpc_tensor_t *o, int64_t rows, int64_t D,
                               int64_t off) {
  int64_t sx[2] = {rows, D};
  fsdpc_tensor_t x, w, b, y, db, mean, rstd, dy, dx, dw, db2, y2;
  rnd_at(&x, dev, dt, rows, D, 23, 2, off);
  rnd(&w, dev, dt, 1, &D, 24, 1);
  rnd(&b, dev, dt, 1, &D, 25, 1);
  poisoned(&y, dev, dt, 2, sx);
  ok(kernel_bias_add(&y, &x, &b));
  rnd_at(&dy, dev, dt, rows, D, 26, 1, off);
  ok(tensor_zeros(&db, DTYPE_F32, dev, 1, &D));
  ok(kernel_bias_backward(&db, &dy));
  poisoned(&y2, dev, dt, 2, sx);
  poisoned(&mean, dev, DTYPE_F32, 1, &rows);
  poisoned(&rstd, dev, DTYPE_F32, 1, &rows);
  ok(kernel_layernorm(&y2, &mean, &rstd, &x, &w, &b, 1e-5f));
  poisoned(&dx, dev, dt, 2, sx);
  ok(tensor_zeros(&dw, DTYPE_F32, dev, 1, &D));
  ok(tensor_zeros(&db2, DTYPE_F32, dev, 1, &D));
  ok(kernel_layernorm_backward(&dx, &dw, &db2, &dy, &x, &w, &mean, &rstd));
  out(&o[0], &y);
  out(&o[1], &db);
  out(&o[2], &y2);
  out(&o[3], &mean);
  out(&o[4], &rstd);
  out(&o[5], &dx);
  out(&o[6], &dw);
  out(&o[7], &db2);
  tensor_free(&x);
  tensor_free(&w);
  tensor_free(&b);
  tensor_free(&dy);
  return 8;
}

/* An I64 vector on dev from n host values. */
static void i64s(fsdpc_tensor_t *t, device_t dev, const int64_t *v, int64_t n) {
  fsdpc_tensor_t h;
  ok(tensor_init(&h, DTYPE_I64, device_cpu(), 1, &n));
  memcpy(h.data, v, sizeof(int64_t) * (size_t)n);
  ok(tensor_clone(t, &h, DTYPE_I64, dev));
  tensor_free(&h);
}

/* A mixture of experts' weighted sum: 37 tokens of 67, top-2, their 74 rows in an expert
 * order (row m holds slot (m * 29) mod 74), and with slots repeated and unused (row m of 80
 * holds slot (m * 7) mod 45 of 30 tokens' 90); forward, and the gradients. */
static int moe_combine_case(device_t dev, dtype_t dt, fsdpc_tensor_t *o, int64_t N, int64_t k,
                            int64_t M, bool perm, unsigned long long seed) {
  int64_t D = 67, S = N * k, sy[2] = {M, D}, so[2] = {N, D}, sw[2] = {N, k};
  int64_t *slot = malloc(sizeof(int64_t) * (size_t)M), *offs = calloc((size_t)S + 1, 8),
          *rows = malloc(sizeof(int64_t) * (size_t)M), *at = malloc(sizeof(int64_t) * (size_t)S);
  for (int64_t m = 0; m < M; m++) slot[m] = perm ? (m * 29) % S : (m * 7) % (S / 2);
  for (int64_t m = 0; m < M; m++) offs[slot[m] + 1]++;
  for (int64_t q = 0; q < S; q++) offs[q + 1] += offs[q];
  memcpy(at, offs, sizeof(int64_t) * (size_t)S);
  for (int64_t m = 0; m < M; m++) rows[at[slot[m]]++] = m;
  fsdpc_tensor_t y, w, dout, sum, dy, dw, ts, to, tr;
  rnd(&y, dev, dt, 2, sy, seed, 1);
  rnd(&w, dev, dt, 2, sw, seed + 1, 1);
  rnd(&dout, dev, dt, 2, so, seed + 2, 1);
  i64s(&ts, dev, slot, M);
  i64s(&to, dev, offs, S + 1);
  i64s(&tr, dev, rows, M);
  poisoned(&sum, dev, dt, 2, so);
  ok(kernel_moe_combine(&sum, &y, &w, &to, &tr));
  poisoned(&dy, dev, dt, 2, sy);
  poisoned(&dw, dev, dt, 2, sw);
  ok(kernel_moe_combine_backward(&dy, &dw, &dout, &y, &w, &ts, &to, &tr));
  out(&o[0], &sum);
  out(&o[1], &dy);
  out(&o[2], &dw);
  fsdpc_tensor_t *free_[] = {&y, &w, &dout, &ts, &to, &tr};
  for (int i = 0; i < 6; i++) tensor_free(free_[i]);
  free(slot);
  free(offs);
  free(rows);
  free(at);
  return 3;
}

/* A mixture of experts' routing of 300 tokens over 40 experts in f32 whatever dt: top-6 softmax
 * scores renormalised (its backward also with a load-balancing term), top-6 sigmoid scores with
 * an expert bias and a scale of 2.5, top-1 plain, and all 40 with the bias, renormalised; each
 * one's backward. The experts must be the same (an expert chosen apart moves the relative
 * error far past the tolerance). Outputs p, experts, w and dz of each, then dz with the term. */
static int k_moe_route(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  (void)dt;
  static const struct {
    int k;
    bool norm, sigmoid, bias;
    double scale;
  } v[4] = {{6, true, false, false, 1.0},
            {6, true, true, true, 2.5},
            {1, false, false, false, 1.0},
            {40, true, false, true, 1.0}};
  int64_t N = 300, E = 40, sz[2] = {N, E};
  fsdpc_tensor_t z, bias, g;
  rnd(&z, dev, DTYPE_F32, 2, sz, 41, 3);
  rnd(&bias, dev, DTYPE_F32, 1, &E, 42, 0.05);
  rnd(&g, dev, DTYPE_F32, 1, &E, 44, 0.01);
  for (int r = 0; r < 4; r++) {
    int k = v[r].k;
    int64_t sk[2] = {N, k};
    fsdpc_tensor_t p, ex, w, dz, dw;
    rnd(&dw, dev, DTYPE_F32, 2, sk, 43 + (unsigned long long)r, 1);
    poisoned(&p, dev, DTYPE_F32, 2, sz);
    poisoned(&w, dev, DTYPE_F32, 2, sk);
    ok(tensor_init(&ex, DTYPE_I64, dev, 2, sk));
    ok(kernel_moe_route(&p, &ex, &w, &z, v[r].bias ? &bias : NULL, k, v[r].norm, v[r].sigmoid,
                        v[r].scale));
    poisoned(&dz, dev, DTYPE_F32, 2, sz);
    ok(kernel_moe_route_backward(&dz, &dw, &w, &p, &ex, NULL, k, v[r].norm, v[r].sigmoid,
                                 v[r].scale));
    if (r == 0) {
      fsdpc_tensor_t dzg;
      poisoned(&dzg, dev, DTYPE_F32, 2, sz);
      ok(kernel_moe_route_backward(&dzg, &dw, &w, &p, &ex, &g, k, true, false, 1.0));
      out(&o[16], &dzg);
    }
    out(&o[4 * r], &p);
    out(&o[4 * r + 1], &ex);
    out(&o[4 * r + 2], &w);
    out(&o[4 * r + 3], &dz);
    tensor_free(&dw);
  }
  tensor_free(&z);
  tensor_free(&bias);
  tensor_free(&g);
  return 17;
}

static int k_moe_combine(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  int n = moe_combine_case(dev, dt, o, 37, 2, 74, true, 31);
  return n + moe_combine_case(dev, dt, o + n, 30, 3, 80, false, 41);
}

/* The column sums (db, dw) column by column in one short block of rows (37 of 333) and over
 * blocks of 64 rows (1,300 of 333, and 1,300 of 40 with the rows off a 16-byte boundary); in
 * 16-byte packs over blocks of 32 rows, the last one short (1,300 of 40; 600 rows of 1,032
 * columns, more packs than a block has threads). */
static int k_bias_layernorm(device_t dev, dtype_t dt, fsdpc_tensor_t *o) {
  int n = bias_layernorm_case(dev, dt, o, 37, 333, 0);
  n += bias_layernorm_case(dev, dt, o + n, 1300, 333, 0);
  n += bias_layernorm_case(dev, dt, o + n, 1300, 40, 1);
  n += bias_layernorm_case(dev, dt, o + n, 600, 1032, 0);
  return n + bias_layernorm_case(dev, dt, o + n, 1300, 40, 0);
}

static const kcase_t cases[] = {
    {"matmul", k_matmul, 0, 0},
    {"matmul (cublasGemmEx)", k_matmul_gemmex, 0, 0},
    {"matmul (padded sizes)", k_matmul_padded, 0, 0},
    {"embedding", k_embedding, 1, 0},
    {"rmsnorm", k_rmsnorm, 0, 0},
    {"rope", k_rope, 1, 0},
    {"attention", k_attention, 0, 0},
    {"attention (batched)", k_attention_batched, 0, 0},
    {"attention (cuDNN)", k_attention_cudnn, 0, 0},
    {"silu_mul/add/scale/axpy", k_elementwise, 0, 0},
    {"cross_entropy", k_cross_entropy, 0, 0},
    {"adamw/sum_squares", k_adamw_sumsq, 0, 0},
    {"adamw (bf16 moments)", k_adamw_bf16_moments, 0, 2e-3},
    {"sum_squares (many)", k_sumsq_many, 0, 0},
    {"relu/gelu/silu", k_activations, 0, 0},
    {"bias/layernorm", k_bias_layernorm, 0, 0},
    {"moe_combine", k_moe_combine, 0, 0},
    {"matmul_many (experts)", k_matmul_many, 0, 0},
    {"moe_route", k_moe_route, 0, 0},
};

START_TEST(cuda_kernel_matches_cpu) {
  static const dtype_t dts[3] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16};
  const kcase_t *c = &cases[_i / 3];
  dtype_t dt = dts[_i % 3];
  double tol = c->exact ? 0 : dt == DTYPE_F32 ? 1e-5 : dt == DTYPE_F16 ? 5e-3 : 1e-2;
  if (tol < c->min_tol) tol = c->min_tol;
  fsdpc_tensor_t cpu[MAX_T], gpu[MAX_T];
  int n = c->run(device_cpu(), dt, cpu);
  ck_assert_int_eq(c->run(world_device(), dt, gpu), n);
  for (int i = 0; i < n; i++) {
    double e = test_rel_l2(&gpu[i], &cpu[i]);
    ck_assert_msg(e <= tol, "%s (%s) output %d: CUDA vs CPU relative error %.3g", c->name,
                  dtype_name(dt), i, e);
    tensor_free(&cpu[i]);
    tensor_free(&gpu[i]);
  }
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("kernels_gpu");
  TCase *tc = tcase_create("cuda_vs_cpu");
  if (world_device().type != DEVICE_CUDA) {
    harness_skip("no CUDA device");
  } else {
    tcase_add_loop_test(tc, cuda_kernel_matches_cpu, 0, 3 * (int)(sizeof cases / sizeof cases[0]));
  }
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
