/*
 * Tensors: contiguous layout, bad shapes, scalars and empty tensors, views and boxes, copies
 * into strided destinations and casts with rounding, many copies at once, fill, bit equality, wrapped and meta
 * tensors, error details, and the checks of the many-tensor AdamW (the device layer below:
 * test_device.c).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/kernels.h"
#include "core/tensor.h"
#include "tests/harness.h"

static float *f32(const fsdpc_tensor_t *t) { return (float *)t->data; }

static void iota(fsdpc_tensor_t *t) {
  for (int64_t i = 0; i < tensor_numel(t); i++) f32(t)[i] = (float)i;
}

START_TEST(tensor_init_contiguous_layout) {
  fsdpc_tensor_t t;
  int64_t shape[3] = {2, 3, 4};
  ck_assert_int_eq(tensor_init(&t, DTYPE_F32, device_cpu(), 3, shape), STATUS_OK);
  ck_assert_int_eq(tensor_numel(&t), 24);
  ck_assert_uint_eq(tensor_nbytes(&t), 96);
  ck_assert_int_eq(t.stride[0], 12);
  ck_assert_int_eq(t.stride[2], 1);
  ck_assert(tensor_is_contiguous(&t));
  tensor_free(&t);
  ck_assert_ptr_null(t.storage);
  tensor_free(NULL);
}
END_TEST

START_TEST(tensor_init_rejects_bad_shapes) {
  fsdpc_tensor_t t;
  int64_t six[6] = {1, 1, 1, 1, 1, 1}, neg[2] = {3, -1};
  ck_assert_int_eq(tensor_init(&t, DTYPE_F32, device_cpu(), 6, six), STATUS_ESHAPE);
  ck_assert_int_eq(tensor_init(&t, DTYPE_F32, device_cpu(), 2, neg), STATUS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err_detail(), "negative"));
  ck_assert_int_eq(tensor_init(&t, (dtype_t)99, device_cpu(), 2, neg), STATUS_EDTYPE);
}
END_TEST

START_TEST(tensor_init_cuda_without_device_is_enodev) {
  if (device_cuda_count() > 0) return;
  fsdpc_tensor_t t;
  int64_t shape[1] = {4};
  ck_assert_int_eq(tensor_init(&t, DTYPE_F32, device_cuda(0), 1, shape), STATUS_ENODEV);
}
END_TEST

START_TEST(tensor_scalar_and_empty) {
  fsdpc_tensor_t s, e;
  ck_assert_int_eq(tensor_init(&s, DTYPE_I64, device_cpu(), 0, NULL), STATUS_OK);
  ck_assert_int_eq(tensor_numel(&s), 1);
  ck_assert_int_eq(tensor_fill(&s, 7), STATUS_OK);
  ck_assert_int_eq(*(int64_t *)s.data, 7);
  int64_t shape[2] = {0, 5};
  ck_assert_int_eq(tensor_init(&e, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  ck_assert_ptr_null(e.data);
  ck_assert_int_eq(tensor_fill(&e, 1), STATUS_OK);
  tensor_free(&s);
  tensor_free(&e);
}
END_TEST

START_TEST(tensor_view_checks_numel) {
  fsdpc_tensor_t t, v;
  int64_t shape[2] = {7, 15}, bad[2] = {16, 15}, good[1] = {105};
  ck_assert_int_eq(tensor_init(&t, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  ck_assert_int_eq(tensor_view(&v, &t, 2, bad), STATUS_ESHAPE);
  ck_assert_str_eq(err_detail(), "shape [7,15] cannot be viewed as [16,15]");
  ck_assert_int_eq(tensor_view(&v, &t, 1, good), STATUS_OK);
  ck_assert_ptr_eq(v.data, t.data);
  tensor_free(&t); /* the view keeps the storage alive */
  f32(&v)[104] = 1.0f;
  tensor_free(&v);
}
END_TEST

START_TEST(tensor_narrow_inner_dim_copies_strided) {
  fsdpc_tensor_t t, n, c;
  int64_t shape[2] = {4, 6};
  ck_assert_int_eq(tensor_init(&t, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  iota(&t);
  ck_assert_int_eq(tensor_narrow(&n, &t, 1, 2, 3), STATUS_OK);
  ck_assert(!tensor_is_contiguous(&n));
  ck_assert_int_eq(tensor_clone(&c, &n, DTYPE_F32, device_cpu()), STATUS_OK);
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 3; j++) ck_assert(f32(&c)[i * 3 + j] == (float)(i * 6 + j + 2));
  tensor_free(&c);
  ck_assert_int_eq(tensor_narrow(&c, &t, 1, 5, 2), STATUS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err_detail(), "[5, 7)"));
  tensor_free(&n);
  tensor_free(&t);
}
END_TEST

START_TEST(tensor_narrow_box_views_a_box) {
  fsdpc_tensor_t t, b;
  int64_t shape[3] = {3, 4, 5}, off[3] = {1, 2, 3}, ext[3] = {2, 1, 2};
  ck_assert_int_eq(tensor_init(&t, DTYPE_F32, device_cpu(), 3, shape), STATUS_OK);
  iota(&t);
  ck_assert_int_eq(tensor_narrow_box(&b, &t, off, ext), STATUS_OK);
  ck_assert_int_eq(tensor_numel(&b), 4);
  ck_assert(f32(&b)[0] == (float)(1 * 20 + 2 * 5 + 3));
  ck_assert(*(float *)((char *)b.data + b.stride[0] * 4) == (float)(2 * 20 + 2 * 5 + 3));
  tensor_free(&b);
  int64_t past[3] = {0, 0, 4};
  ck_assert_int_eq(tensor_narrow_box(&b, &t, past, ext), STATUS_ESHAPE);
  tensor_free(&t);
}
END_TEST

START_TEST(tensor_copy_into_strided_destination) {
  fsdpc_tensor_t t, src, dst;
  int64_t shape[3] = {2, 3, 4}, sub[3] = {2, 3, 2};
  ck_assert_int_eq(tensor_zeros(&t, DTYPE_F32, device_cpu(), 3, shape), STATUS_OK);
  ck_assert_int_eq(tensor_init(&src, DTYPE_F32, device_cpu(), 3, sub), STATUS_OK);
  iota(&src);
  ck_assert_int_eq(tensor_narrow(&dst, &t, 2, 1, 2), STATUS_OK);
  ck_assert_int_eq(tensor_copy(&dst, &src), STATUS_OK);
  for (int i = 0; i < 6; i++) {
    ck_assert(f32(&t)[i * 4 + 0] == 0.0f);
    ck_assert(f32(&t)[i * 4 + 1] == (float)(i * 2));
    ck_assert(f32(&t)[i * 4 + 2] == (float)(i * 2 + 1));
    ck_assert(f32(&t)[i * 4 + 3] == 0.0f);
  }
  ck_assert_int_eq(tensor_copy(&t, &src), STATUS_ESHAPE);
  tensor_free(&dst);
  tensor_free(&src);
  tensor_free(&t);
}
END_TEST

/* tensor_copy_many: each pair as tensor_copy does it (a cast, a strided destination, an empty
 * pair); a bad pair is named, and found before anything is copied. */
START_TEST(tensor_copy_many_copies_each_pair_and_names_a_bad_one) {
  int64_t n6 = 6, n0 = 0, shape[2] = {2, 3}, wide[2] = {2, 5};
  fsdpc_tensor_t src[3], dst[3], want[3], wide_t;
  ck_assert_int_eq(tensor_init(&src[0], DTYPE_F32, device_cpu(), 1, &n6), STATUS_OK);
  ck_assert_int_eq(tensor_init(&src[1], DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  ck_assert_int_eq(tensor_init(&src[2], DTYPE_F32, device_cpu(), 1, &n0), STATUS_OK);
  iota(&src[0]);
  iota(&src[1]);
  for (int i = 0; i < 6; i++) f32(&src[0])[i] += 0.3f; /* rounds in bf16 */
  ck_assert_int_eq(tensor_zeros(&dst[0], DTYPE_BF16, device_cpu(), 1, &n6), STATUS_OK);
  ck_assert_int_eq(tensor_zeros(&wide_t, DTYPE_F32, device_cpu(), 2, wide), STATUS_OK);
  ck_assert_int_eq(tensor_narrow(&dst[1], &wide_t, 1, 1, 3), STATUS_OK);
  ck_assert_int_eq(tensor_init(&dst[2], DTYPE_F32, device_cpu(), 1, &n0), STATUS_OK);
  ck_assert_int_eq(tensor_clone(&want[0], &src[0], DTYPE_BF16, device_cpu()), STATUS_OK);
  ck_assert_int_eq(tensor_copy_many(dst, src, 3), STATUS_OK);
  bool eq = false;
  ck_assert_int_eq(tensor_equal(&dst[0], &want[0], &eq), STATUS_OK);
  ck_assert(eq);
  for (int r = 0; r < 2; r++)
    for (int c = 0; c < 5; c++)
      ck_assert(f32(&wide_t)[r * 5 + c] == (c >= 1 && c <= 3 ? (float)(r * 3 + c - 1) : 0.0f));
  /* pair 1's shapes differ: refused by number, pair 0 left as it was */
  ck_assert_int_eq(tensor_fill(&dst[0], 0), STATUS_OK);
  fsdpc_tensor_t bad[3] = {dst[0], src[0], dst[2]};
  ck_assert_int_eq(tensor_copy_many(bad, src, 3), STATUS_ESHAPE);
  ck_assert_msg(strstr(err_detail(), "pair 1 of 3") != NULL, "%s", err_detail());
  for (int i = 0; i < 6; i++) ck_assert(((uint16_t *)dst[0].data)[i] == 0);
  ck_assert_int_eq(tensor_copy_many(dst, src, 0), STATUS_OK);
  ck_assert_int_eq(tensor_copy_many(dst, src, -1), STATUS_EINVAL);
  for (int i = 0; i < 3; i++) {
    tensor_free(&src[i]);
    tensor_free(&dst[i]);
  }
  tensor_free(&want[0]);
  tensor_free(&wide_t);
}
END_TEST

START_TEST(tensor_copy_casts_with_rounding) {
  fsdpc_tensor_t a, b, c;
  int64_t shape[1] = {4};
  ck_assert_int_eq(tensor_init(&a, DTYPE_F32, device_cpu(), 1, shape), STATUS_OK);
  f32(&a)[0] = 1.0f;
  f32(&a)[1] = 1.0f + 0x1p-8f; /* bf16 tie: rounds to even 1.0 */
  f32(&a)[2] = -3.75f;
  f32(&a)[3] = 65520.0f;
  ck_assert_int_eq(tensor_clone(&b, &a, DTYPE_BF16, device_cpu()), STATUS_OK);
  uint16_t *h = b.data;
  ck_assert_uint_eq(h[0], 0x3F80);
  ck_assert_uint_eq(h[1], 0x3F80);
  ck_assert_uint_eq(h[2], f32_to_bf16(-3.75f));
  ck_assert_int_eq(tensor_clone(&c, &a, DTYPE_I32, device_cpu()), STATUS_OK);
  ck_assert_int_eq(((int32_t *)c.data)[2], -3);
  ck_assert_int_eq(((int32_t *)c.data)[3], 65520);
  tensor_free(&a);
  tensor_free(&b);
  tensor_free(&c);
}
END_TEST

/* Copies between every pair of float dtypes, of whole tensors and of narrowed rows, hold
 * element by element what dtype_store(dtype_load) gives (the same bits, between equal dtypes):
 * NaNs (signalling too), infinities, subnormals, ties and values beyond f16's range included. */
/* Element i of src (dtype st) as dtype dt into *want; zero when !in. */
static void expect_cast(dtype_t dt, uint64_t *want, dtype_t st, const void *src, int64_t i,
                        bool in) {
  if (!in)
    dtype_store(dt, want, 0, 0.0);
  else if (dt == st)
    memcpy(want, (const char *)src + i * (int64_t)dtype_size(st), dtype_size(st));
  else
    dtype_store(dt, want, 0, dtype_load(st, src, (size_t)i));
}

START_TEST(tensor_copy_casts_rows_like_dtype_store) {
  static const dtype_t fl[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16};
  static const uint32_t special[] = {0x7fc00000u, 0x7f800001u, 0xff800000u, 0x7f800000u,
                                     0x00000001u, 0x80400000u, 0x3f808000u, 0x3f818000u,
                                     0x477ff000u, 0xc77fefffu, 0x33800000u, 0x387fe000u};
  int64_t shape[2] = {7, 1100}; /* rows longer than a conversion tile of 512 */
  fsdpc_tensor_t src32;
  ck_assert_int_eq(tensor_init(&src32, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  test_rng_t rng = {77};
  uint32_t *bits = src32.data;
  for (int64_t i = 0; i < tensor_numel(&src32); i++)
    bits[i] = i % 97 < 12 ? special[i % 97] : (uint32_t)test_rng_next(&rng);
  int bad = 0;
  for (int a = 0; a < 3; a++)
    for (int b = 0; b < 3; b++) {
      fsdpc_tensor_t src, dst, sv, dv;
      ck_assert_int_eq(tensor_clone(&src, &src32, fl[a], device_cpu()), STATUS_OK);
      ck_assert_int_eq(tensor_init(&dst, fl[b], device_cpu(), 2, shape), STATUS_OK);
      ck_assert_int_eq(tensor_fill(&dst, 0), STATUS_OK);
      ck_assert_int_eq(tensor_copy(&dst, &src), STATUS_OK); /* whole rows */
      for (int64_t i = 0; i < tensor_numel(&src); i++) {
        uint64_t want = 0, got = 0;
        expect_cast(fl[b], &want, fl[a], src.data, i, true);
        memcpy(&got, (char *)dst.data + i * (int64_t)dtype_size(fl[b]), dtype_size(fl[b]));
        bad += want != got;
      }
      /* rows 1..5, columns 3..1000 of src into the same box of dst: pitched rows */
      int64_t off[2] = {1, 3}, box[2] = {5, 998};
      ck_assert_int_eq(tensor_fill(&dst, 0), STATUS_OK);
      ck_assert_int_eq(tensor_narrow_box(&sv, &src, off, box), STATUS_OK);
      ck_assert_int_eq(tensor_narrow_box(&dv, &dst, off, box), STATUS_OK);
      ck_assert_int_eq(tensor_copy(&dv, &sv), STATUS_OK);
      for (int64_t r = 0; r < shape[0]; r++)
        for (int64_t c = 0; c < shape[1]; c++) {
          int64_t i = r * shape[1] + c;
          bool in = r >= 1 && r < 6 && c >= 3 && c < 1001;
          uint64_t want = 0, got = 0;
          expect_cast(fl[b], &want, fl[a], src.data, i, in);
          memcpy(&got, (char *)dst.data + i * (int64_t)dtype_size(fl[b]), dtype_size(fl[b]));
          bad += want != got;
        }
      tensor_free(&sv);
      tensor_free(&dv);
      tensor_free(&src);
      tensor_free(&dst);
    }
  tensor_free(&src32);
  ck_assert_msg(bad == 0, "%d elements differ from dtype_store(dtype_load)", bad);
}
END_TEST

/* dtype_round_f32 gives what storing each value in the dtype and loading it gives (specials,
 * ties, subnormals and random bits; more than a vector's worth). */
START_TEST(dtype_round_f32_is_store_then_load) {
  static const uint32_t special[] = {0x7fc00000u, 0x7f800001u, 0xff800000u, 0x7f800000u,
                                     0x00000001u, 0x80400000u, 0x3f808000u, 0x3f818000u,
                                     0x477ff000u, 0xc77fefffu, 0x33800000u, 0x387fe000u};
  enum { N = 1000 };
  static const dtype_t dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16};
  test_rng_t rng = {5};
  uint32_t bits[N];
  for (int i = 0; i < N; i++) bits[i] = i < 12 ? special[i] : (uint32_t)test_rng_next(&rng);
  int bad = 0;
  for (int d = 0; d < 3; d++) {
    float x[N];
    memcpy(x, bits, sizeof x);
    dtype_round_f32(dts[d], x, N);
    for (int i = 0; i < N; i++) {
      float v;
      memcpy(&v, &bits[i], sizeof v);
      char stored[4];
      dtype_store(dts[d], stored, 0, v);
      float want = (float)dtype_load(dts[d], stored, 0);
      bad += memcmp(&want, &x[i], sizeof want) != 0 && !(want != want && x[i] != x[i]);
    }
  }
  ck_assert_msg(bad == 0, "%d values differ from a store and a load", bad);
}
END_TEST

/* kernel_adamw_many: checks every item before updating any (naming the failing one), then
 * gives each item kernel_adamw's bits. */
START_TEST(kernel_adamw_many_checks_all_then_updates_each) {
  int64_t n[3] = {5, 0, 9}, wrong = 4;
  fsdpc_tensor_t p[2][3], g[3], m[2][3], v[2][3], bad;
  adamw_item_t items[3];
  for (int k = 0; k < 3; k++) {
    for (int c = 0; c < 2; c++) {
      ck_assert_int_eq(tensor_init(&p[c][k], k == 2 ? DTYPE_BF16 : DTYPE_F32, device_cpu(), 1,
                                   &n[k]), STATUS_OK);
      ck_assert_int_eq(tensor_fill(&p[c][k], 0.5 + k), STATUS_OK);
      ck_assert_int_eq(tensor_zeros(&m[c][k], DTYPE_F32, device_cpu(), 1, &n[k]), STATUS_OK);
      ck_assert_int_eq(tensor_zeros(&v[c][k], DTYPE_F32, device_cpu(), 1, &n[k]), STATUS_OK);
    }
    ck_assert_int_eq(tensor_init(&g[k], DTYPE_F32, device_cpu(), 1, &n[k]), STATUS_OK);
    ck_assert_int_eq(tensor_fill(&g[k], 0.25 - k), STATUS_OK);
    adamw_args_t a = {.lr = 0.01 * (k + 1), .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                      .weight_decay = 0.1, .step = 1};
    items[k] = (adamw_item_t){&p[0][k], &g[k], &m[0][k], &v[0][k], a};
  }
  ck_assert_int_eq(tensor_zeros(&bad, DTYPE_F32, device_cpu(), 1, &wrong), STATUS_OK);
  items[2].v = &bad;
  int failed = -7;
  ck_assert_int_eq(kernel_adamw_many(items, 3, &failed), STATUS_ESHAPE);
  ck_assert_int_eq(failed, 2);
  ck_assert_float_eq(((float *)p[0][0].data)[0], 0.5f); /* item 0 untouched */
  items[2].v = &v[0][2];
  ck_assert_int_eq(kernel_adamw_many(items, 3, &failed), STATUS_OK);
  ck_assert_int_eq(failed, -1);
  for (int k = 0; k < 3; k++) {
    ck_assert_int_eq(kernel_adamw(&p[1][k], &g[k], &m[1][k], &v[1][k], &items[k].args), STATUS_OK);
    bool eq = false;
    ck_assert_int_eq(tensor_equal(&p[0][k], &p[1][k], &eq), STATUS_OK);
    ck_assert(eq);
    ck_assert_int_eq(tensor_equal(&m[0][k], &m[1][k], &eq), STATUS_OK);
    ck_assert(eq);
  }
  ck_assert(((float *)p[0][0].data)[0] != 0.5f);
  for (int k = 0; k < 3; k++) {
    for (int c = 0; c < 2; c++) {
      tensor_free(&p[c][k]);
      tensor_free(&m[c][k]);
      tensor_free(&v[c][k]);
    }
    tensor_free(&g[k]);
  }
  tensor_free(&bad);
}
END_TEST

/* bf16 moments (optim.state_dtype): the first step from zero moments gives the f32 moments'
 * parameters bit for bit and those moments rounded to bf16; later steps, from the rounded
 * moments, stay within bf16's precision of the f32 run; f16 or mixed moments are refused. */
START_TEST(kernel_adamw_bf16_moments) {
  int64_t n = 1000;
  fsdpc_tensor_t p[2], g, m[2], v[2];
  ck_assert_int_eq(tensor_init(&g, DTYPE_F32, device_cpu(), 1, &n), STATUS_OK);
  for (int c = 0; c < 2; c++) {
    ck_assert_int_eq(tensor_init(&p[c], DTYPE_F32, device_cpu(), 1, &n), STATUS_OK);
    ck_assert_int_eq(tensor_zeros(&m[c], c ? DTYPE_BF16 : DTYPE_F32, device_cpu(), 1, &n),
                     STATUS_OK);
    ck_assert_int_eq(tensor_zeros(&v[c], c ? DTYPE_BF16 : DTYPE_F32, device_cpu(), 1, &n),
                     STATUS_OK);
  }
  adamw_args_t a = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  double worst = 0;
  for (a.step = 1; a.step <= 5; a.step++) {
    for (int64_t i = 0; i < n; i++) {
      ((float *)g.data)[i] = (float)(sin(0.37 * (double)(i * a.step)) * pow(10, -(double)(i % 7)));
      if (a.step == 1) ((float *)p[0].data)[i] = ((float *)p[1].data)[i] = (float)cos(0.1 * i);
    }
    for (int c = 0; c < 2; c++)
      ck_assert_int_eq(kernel_adamw(&p[c], &g, &m[c], &v[c], &a), STATUS_OK);
    bool eq = false;
    if (a.step == 1) {
      ck_assert_int_eq(tensor_equal(&p[0], &p[1], &eq), STATUS_OK);
      ck_assert_msg(eq, "step 1: the parameters differ from the f32 moments' run");
      for (int k = 0; k < 2; k++) {
        fsdpc_tensor_t *f32 = k ? &v[0] : &m[0], *b16 = k ? &v[1] : &m[1], r;
        ck_assert_int_eq(tensor_clone(&r, f32, DTYPE_BF16, device_cpu()), STATUS_OK);
        ck_assert_int_eq(tensor_equal(&r, b16, &eq), STATUS_OK);
        ck_assert_msg(eq, "step 1: %s is not the f32 moment rounded to bf16", k ? "v" : "m");
        tensor_free(&r);
      }
    }
    for (int64_t i = 0; i < n; i++) { /* relative to the step's size, lr */
      double d = fabs(((float *)p[0].data)[i] - ((float *)p[1].data)[i]) / a.lr;
      worst = d > worst ? d : worst;
    }
  }
  /* an update is lr m / sqrt(v), with m and v each within 2^-9 relative of the f32 run's
   * (measured: 0.013 lr after five steps) */
  printf("bf16 moments: parameters within %.3g lr of f32's after 5 steps\n", worst);
  ck_assert_msg(worst < 0.03, "bf16 moments moved a parameter %.3g lr from f32's", worst);
  fsdpc_tensor_t h[2];
  for (int k = 0; k < 2; k++)
    ck_assert_int_eq(tensor_zeros(&h[k], DTYPE_F16, device_cpu(), 1, &n), STATUS_OK);
  ck_assert_int_eq(kernel_adamw(&p[0], &g, &h[0], &h[1], &a), STATUS_EDTYPE);
  ck_assert_msg(strstr(err_detail(), "must both be f32 or both bf16") != NULL, "%s", err_detail());
  ck_assert_int_eq(kernel_adamw(&p[0], &g, &m[0], &v[1], &a), STATUS_EDTYPE);
  for (int k = 0; k < 2; k++) tensor_free(&h[k]);
  for (int c = 0; c < 2; c++) {
    tensor_free(&p[c]);
    tensor_free(&m[c]);
    tensor_free(&v[c]);
  }
  tensor_free(&g);
}
END_TEST

START_TEST(tensor_fill_strided_view) {
  fsdpc_tensor_t t, col;
  int64_t shape[2] = {3, 3};
  ck_assert_int_eq(tensor_zeros(&t, DTYPE_F16, device_cpu(), 2, shape), STATUS_OK);
  ck_assert_int_eq(tensor_narrow(&col, &t, 1, 1, 1), STATUS_OK);
  ck_assert_int_eq(tensor_fill(&col, 2.5), STATUS_OK);
  uint16_t *h = t.data;
  for (int i = 0; i < 9; i++) ck_assert_uint_eq(h[i], i % 3 == 1 ? f32_to_f16(2.5f) : 0);
  tensor_free(&col);
  tensor_free(&t);
}
END_TEST

START_TEST(tensor_equal_compares_bits) {
  fsdpc_tensor_t a, b;
  int64_t shape[2] = {2, 2};
  ck_assert_int_eq(tensor_zeros(&a, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  ck_assert_int_eq(tensor_zeros(&b, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  bool eq;
  ck_assert_int_eq(tensor_equal(&a, &b, &eq), STATUS_OK);
  ck_assert(eq);
  f32(&b)[3] = -0.0f; /* equal as numbers, not as bits */
  ck_assert_int_eq(tensor_equal(&a, &b, &eq), STATUS_OK);
  ck_assert(!eq);
  tensor_free(&a);
  tensor_free(&b);
}
END_TEST

/* err_prefix puts where a failure happened before its detail, keeping the status. */
START_TEST(err_prefix_keeps_the_detail) {
  ck_assert_int_eq(err_set(STATUS_ESHAPE, "x has shape [3]"), STATUS_ESHAPE);
  ck_assert_int_eq(err_prefix(STATUS_EINVAL, "layer %d", 7), STATUS_EINVAL);
  ck_assert_str_eq(err_detail(), "layer 7: x has shape [3]");
  err_clear();
  err_prefix(STATUS_EINVAL, "outer");
  ck_assert_str_eq(err_detail(), "outer: ");
}
END_TEST

START_TEST(tensor_wrap_does_not_free) {
  float buf[6] = {1, 2, 3, 4, 5, 6};
  fsdpc_tensor_t t, v;
  int64_t shape[2] = {2, 3};
  size_t before = mem_stats(device_cpu()).current;
  ck_assert_int_eq(tensor_wrap(&t, buf, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  ck_assert_int_eq(tensor_narrow(&v, &t, 0, 1, 1), STATUS_OK);
  ck_assert(f32(&v)[2] == 6.0f);
  tensor_free(&t);
  tensor_free(&v);
  ck_assert_uint_eq(mem_stats(device_cpu()).current, before);
}
END_TEST

/* A meta tensor has a layout and no memory: views, narrows and clones stay meta and allocate
 * nothing; copies, fills, comparisons and kernels refuse it, naming the remedy. */
START_TEST(tensor_meta_has_layout_without_memory) {
  device_t cpu = device_cpu();
  size_t before = mem_stats(cpu).current;
  fsdpc_tensor_t m, v, n, c, real;
  int64_t shape[2] = {6, 4}, flat = 24;
  ck_assert_int_eq(tensor_meta(&m, DTYPE_BF16, cpu, 2, shape), STATUS_OK);
  ck_assert(tensor_is_meta(&m));
  ck_assert_ptr_null(m.data);
  ck_assert_int_eq(m.stride[0], 4);
  ck_assert_uint_eq(tensor_nbytes(&m), 48);
  ck_assert_int_eq(tensor_view(&v, &m, 1, &flat), STATUS_OK);
  ck_assert_int_eq(tensor_narrow(&n, &m, 0, 2, 3), STATUS_OK);
  ck_assert_int_eq(tensor_clone(&c, &n, DTYPE_F32, cpu), STATUS_OK);
  ck_assert(tensor_is_meta(&v) && tensor_is_meta(&n) && tensor_is_meta(&c));
  ck_assert_ptr_null(n.data);
  ck_assert_int_eq(c.dtype, DTYPE_F32);
  ck_assert_int_eq(c.shape[0], 3);
  ck_assert_uint_eq(mem_stats(cpu).current, before);
  ck_assert_int_eq(tensor_init(&real, DTYPE_F32, cpu, 2, (int64_t[]){3, 4}), STATUS_OK);
  ck_assert_int_eq(tensor_copy(&real, &c), STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "meta tensor") != NULL);
  ck_assert(strstr(err_detail(), "nn_module_materialize") != NULL);
  ck_assert_int_eq(tensor_copy(&c, &real), STATUS_EINVAL);
  ck_assert_int_eq(tensor_fill(&m, 1.0), STATUS_EINVAL);
  bool eq;
  ck_assert_int_eq(tensor_equal(&c, &real, &eq), STATUS_EINVAL);
  ck_assert_int_eq(kernel_scale(&c, 2.0f), STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "meta tensor") != NULL);
  tensor_free(&real);
  tensor_free(&c);
  tensor_free(&n);
  tensor_free(&v);
  tensor_free(&m);
  ck_assert_uint_eq(mem_stats(cpu).current, before);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("tensor");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, tensor_init_contiguous_layout);
  tcase_add_test(tc, tensor_init_rejects_bad_shapes);
  tcase_add_test(tc, tensor_init_cuda_without_device_is_enodev);
  tcase_add_test(tc, tensor_scalar_and_empty);
  tcase_add_test(tc, tensor_view_checks_numel);
  tcase_add_test(tc, tensor_copy_many_copies_each_pair_and_names_a_bad_one);
  tcase_add_test(tc, tensor_narrow_inner_dim_copies_strided);
  tcase_add_test(tc, tensor_narrow_box_views_a_box);
  tcase_add_test(tc, tensor_copy_into_strided_destination);
  tcase_add_test(tc, tensor_copy_casts_with_rounding);
  tcase_add_test(tc, tensor_copy_casts_rows_like_dtype_store);
  tcase_add_test(tc, dtype_round_f32_is_store_then_load);
  tcase_add_test(tc, kernel_adamw_many_checks_all_then_updates_each);
  tcase_add_test(tc, kernel_adamw_bf16_moments);
  tcase_add_test(tc, tensor_fill_strided_view);
  tcase_add_test(tc, tensor_equal_compares_bits);
  tcase_add_test(tc, err_prefix_keeps_the_detail);
  tcase_add_test(tc, tensor_wrap_does_not_free);
  tcase_add_test(tc, tensor_meta_has_layout_without_memory);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
