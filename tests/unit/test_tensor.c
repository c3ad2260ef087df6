#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/kernels.h"
#include "base/tensor.h"
#include "tests/harness.h"

static float *f32(const tensor_t *t) { return (float *)t->data; }

static void iota(tensor_t *t) {
  for (int64_t i = 0; i < tensor_numel(t); i++) f32(t)[i] = (float)i;
}

START_TEST(tensor_init_contiguous_layout) {
  tensor_t t;
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
  tensor_t t;
  int64_t six[6] = {1, 1, 1, 1, 1, 1}, neg[2] = {3, -1};
  ck_assert_int_eq(tensor_init(&t, DTYPE_F32, device_cpu(), 6, six), STATUS_ESHAPE);
  ck_assert_int_eq(tensor_init(&t, DTYPE_F32, device_cpu(), 2, neg), STATUS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err_detail(), "negative"));
  ck_assert_int_eq(tensor_init(&t, (dtype_t)99, device_cpu(), 2, neg), STATUS_EDTYPE);
}
END_TEST

START_TEST(tensor_init_cuda_without_device_is_enodev) {
  if (device_cuda_count() > 0) return;
  tensor_t t;
  int64_t shape[1] = {4};
  ck_assert_int_eq(tensor_init(&t, DTYPE_F32, device_cuda(0), 1, shape), STATUS_ENODEV);
}
END_TEST

/* auto, cpu and cuda against the node's devices and ranks: each row's device, or its error and
 * the counts it names. */
START_TEST(device_choice_by_devices_and_ranks) {
  static const struct {
    device_want_t want;
    int gpus, ranks;
    status_t st;
    device_type_t type;
    const char *says; /* in why (auto) or the error (cuda); NULL: why is empty */
  } rows[] = {
      {DEVICE_WANT_CPU, 8, 1, STATUS_OK, DEVICE_CPU, NULL},
      {DEVICE_WANT_CPU, 0, 4, STATUS_OK, DEVICE_CPU, NULL},
      {DEVICE_WANT_AUTO, 0, 1, STATUS_OK, DEVICE_CPU, NULL},
      {DEVICE_WANT_AUTO, 0, 8, STATUS_OK, DEVICE_CPU, NULL},
      {DEVICE_WANT_AUTO, 1, 1, STATUS_OK, DEVICE_CUDA, NULL},
      {DEVICE_WANT_AUTO, 8, 8, STATUS_OK, DEVICE_CUDA, NULL},
      {DEVICE_WANT_AUTO, 8, 2, STATUS_OK, DEVICE_CUDA, NULL},
      {DEVICE_WANT_AUTO, 1, 4, STATUS_OK, DEVICE_CPU,
       "4 ranks run on this node, which has 1 CUDA device (one per rank is needed): running on "
       "the CPU; start at most 1 rank per node"},
      {DEVICE_WANT_AUTO, 2, 3, STATUS_OK, DEVICE_CPU, "which has 2 CUDA devices"},
      {DEVICE_WANT_CUDA, 1, 1, STATUS_OK, DEVICE_CUDA, NULL},
      {DEVICE_WANT_CUDA, 4, 4, STATUS_OK, DEVICE_CUDA, NULL},
      {DEVICE_WANT_CUDA, 1, 4, STATUS_ENODEV, DEVICE_CPU,
       "4 ranks run on this node, which has 1 CUDA device; NCCL needs one per rank: start at "
       "most 1 rank per node, or ask for the CPU (cpu)"},
      {DEVICE_WANT_CUDA, 0, 1, STATUS_ENODEV, DEVICE_CPU, "ask for the CPU (cpu), or for auto"},
  };
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    device_type_t type = (device_type_t)-1;
    char why[256] = "x";
    err_clear();
    status_t st = device_choose(rows[i].want, rows[i].gpus, rows[i].ranks, &type, why, sizeof why);
    ck_assert_msg(st == rows[i].st, "row %zu: status %d", i, (int)st);
    if (st == STATUS_OK) ck_assert_msg(type == rows[i].type, "row %zu: type %d", i, (int)type);
    const char *text = st == STATUS_OK ? why : err_detail();
    if (rows[i].says == NULL)
      ck_assert_msg(why[0] == 0, "row %zu: why '%s'", i, why);
    else
      ck_assert_msg(strstr(text, rows[i].says) != NULL, "row %zu: '%s'", i, text);
  }
  device_want_t w;
  ck_assert(device_want_parse("cuda", &w) && w == DEVICE_WANT_CUDA);
  ck_assert(device_want_parse("auto", &w) && w == DEVICE_WANT_AUTO);
  ck_assert(!device_want_parse("gpu", &w) && !device_want_parse("CPU", &w));
  ck_assert_str_eq(device_want_name(DEVICE_WANT_CPU), "cpu");
}
END_TEST

/* device_poll, the loop of every host wait for device work: done, failed, or ended by the
 * wait hook. */
typedef struct poll_state {
  int polls, ready_at; /* ready_at < 0: never; 0: fails */
} poll_state_t;

static int fake_ready(void *ctx, status_t *st) {
  poll_state_t *p = ctx;
  p->polls++;
  if (p->ready_at == 0) {
    *st = err_set(STATUS_ECUDA, "the device failed");
    return -1;
  }
  return p->ready_at > 0 && p->polls >= p->ready_at;
}

static double hook_waited;
static status_t give_up_after_5ms(const char *what, double waited) {
  hook_waited = waited;
  if (waited < 5e-3) return STATUS_OK;
  return err_set(STATUS_ETIMEOUT, "%s: given up after %.3f s", what, waited);
}

START_TEST(device_poll_ends_by_ready_failure_or_hook) {
  device_wait_hook_t saved = device_wait_hook();
  device_set_wait_hook(NULL);
  poll_state_t p = {0, 40};
  ck_assert_int_eq(device_poll(fake_ready, &p, "forty polls"), STATUS_OK);
  ck_assert_int_eq(p.polls, 40);
  p = (poll_state_t){0, 0};
  ck_assert_int_eq(device_poll(fake_ready, &p, "a failing wait"), STATUS_ECUDA);
  ck_assert_str_eq(err_detail(), "the device failed");
  device_set_wait_hook(give_up_after_5ms);
  p = (poll_state_t){0, -1};
  ck_assert_int_eq(device_poll(fake_ready, &p, "a wait that never ends"), STATUS_ETIMEOUT);
  ck_assert_ptr_nonnull(strstr(err_detail(), "a wait that never ends: given up after"));
  ck_assert(hook_waited >= 5e-3 && hook_waited < 1.0);
  device_set_wait_hook(saved);
}
END_TEST

/* FSDPC_PROFILE's table: a row per kernel name with its calls and, for copies and the
 * memory-bound kernels, the bytes they move, only while profiling is on. */
START_TEST(kernel_profile_counts_calls_per_kernel) {
  int64_t n = 1000;
  tensor_t a, b;
  ck_assert_int_eq(tensor_init(&a, DTYPE_F32, device_cpu(), 1, &n), STATUS_OK);
  ck_assert_int_eq(tensor_init(&b, DTYPE_F32, device_cpu(), 1, &n), STATUS_OK);
  ck_assert_int_eq(tensor_fill(&a, 1.0), STATUS_OK);
  ck_assert_int_eq(tensor_fill(&b, 2.0), STATUS_OK);
  kernel_profile_enable(true);
  kernel_profile_reset();
  for (int i = 0; i < 3; i++) ck_assert_int_eq(kernel_add(&a, &a, &b), STATUS_OK);
  ck_assert_int_eq(kernel_scale(&a, 0.5f), STATUS_OK);
  ck_assert_int_eq(tensor_copy(&b, &a), STATUS_OK); /* a copy: 8000 bytes moved */
  ck_assert_int_eq(tensor_copy(&a, &b), STATUS_OK);
  kernel_profile_enable(false);
  ck_assert_int_eq(kernel_add(&a, &a, &b), STATUS_OK); /* not counted */
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  double total = -1;
  ck_assert_int_eq(kernel_profile_report(f, &total), STATUS_OK);
  fclose(f);
  long long adds = -1, scales = -1, copies = -1;
  double ms, per, share, gbs = -1;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    if (strncmp(line, "add ", 4) == 0) sscanf(line + 4, "%lld", &adds);
    if (strncmp(line, "scale ", 6) == 0) sscanf(line + 6, "%lld", &scales);
    if (strncmp(line, "copy ", 5) == 0)
      ck_assert_int_eq(sscanf(line + 5, "%lld %lf %lf %lf%% %lf", &copies, &ms, &per, &share, &gbs),
                       5);
  }
  ck_assert_int_eq(adds, 3);
  ck_assert_int_eq(scales, 1);
  ck_assert_int_eq(copies, 2);
  ck_assert(gbs > 0);
  ck_assert(total >= 0 && total < 10);
  free(text);
  kernel_profile_row_t row;
  ck_assert(kernel_profile_get("copy", &row));
  ck_assert_int_eq(row.calls, 2);
  ck_assert(row.bytes == 16000.0 && row.seconds > 0);
  ck_assert(!kernel_profile_get("copy (cast)", &row));
  /* a memory-bound kernel's least bytes: add reads two operands and writes one */
  ck_assert(kernel_profile_get("add", &row));
  ck_assert(row.calls == 3 && row.bytes == 3 * 12000.0);
  ck_assert(kernel_profile_get("scale", &row));
  ck_assert(row.bytes == 8000.0);
  kernel_profile_reset();
  ck_assert(!kernel_profile_get("copy", &row));
  ck_assert_int_eq(kernel_profile_report(NULL, &total), STATUS_OK);
  ck_assert(total == 0);
  ck_assert_float_eq(((float *)a.data)[0], 7.0f); /* (1 + 2 + 2 + 2) / 2, copied, doubled */
  ck_assert_float_eq(((float *)b.data)[0], 3.5f);
  tensor_free(&a);
  tensor_free(&b);
}
END_TEST

START_TEST(tensor_scalar_and_empty) {
  tensor_t s, e;
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
  tensor_t t, v;
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
  tensor_t t, n, c;
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
  tensor_t t, b;
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
  tensor_t t, src, dst;
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

START_TEST(tensor_copy_casts_with_rounding) {
  tensor_t a, b, c;
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
  tensor_t src32;
  ck_assert_int_eq(tensor_init(&src32, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  test_rng_t rng = {77};
  uint32_t *bits = src32.data;
  for (int64_t i = 0; i < tensor_numel(&src32); i++)
    bits[i] = i % 97 < 12 ? special[i % 97] : (uint32_t)test_rng_next(&rng);
  int bad = 0;
  for (int a = 0; a < 3; a++)
    for (int b = 0; b < 3; b++) {
      tensor_t src, dst, sv, dv;
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

/* kernel_adamw_many: checks every item before updating any (naming the failing one), then
 * gives each item kernel_adamw's bits. */
START_TEST(kernel_adamw_many_checks_all_then_updates_each) {
  int64_t n[3] = {5, 0, 9}, wrong = 4;
  tensor_t p[2][3], g[3], m[2][3], v[2][3], bad;
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

START_TEST(tensor_fill_strided_view) {
  tensor_t t, col;
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
  tensor_t a, b;
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

START_TEST(mem_stats_track_current_and_peak) {
  mem_reset_peak(device_cpu());
  mem_stats_t base = mem_stats(device_cpu());
  tensor_t a, b;
  int64_t s1[1] = {1000}, s2[1] = {500};
  ck_assert_int_eq(tensor_init(&a, DTYPE_F32, device_cpu(), 1, s1), STATUS_OK);
  ck_assert_int_eq(tensor_init(&b, DTYPE_I64, device_cpu(), 1, s2), STATUS_OK);
  mem_stats_t now = mem_stats(device_cpu());
  ck_assert_uint_eq(now.current - base.current, 4000 + 4000);
  tensor_free(&a);
  now = mem_stats(device_cpu());
  ck_assert_uint_eq(now.current - base.current, 4000);
  ck_assert_uint_eq(now.peak - base.current, 8000);
  mem_reset_peak(device_cpu());
  ck_assert_uint_eq(mem_stats(device_cpu()).peak, now.current);
  tensor_free(&b);
  ck_assert_uint_eq(mem_stats(device_cpu()).current, base.current);
}
END_TEST

/* Freed host blocks of 64 KiB and more are reused for the same size without asking the
 * system again, and a zeroed request is zeroed even when its block comes back dirty; the
 * cache stays under 1.25 times the peak of live bytes. */
START_TEST(host_cache_reuses_blocks_and_zeroes_them) {
  device_t cpu = device_cpu();
  mem_empty_cache(cpu);
  const size_t sizes[] = {(size_t)64 << 10, (size_t)300 << 10, (size_t)5 << 20};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    size_t n = sizes[k];
    unsigned char *p;
    ck_assert_int_eq(device_alloc(cpu, n, (void **)&p), STATUS_OK);
    memset(p, 0xAB, n);
    device_free(cpu, p, n);
    size_t before = mem_os_allocs(cpu);
    ck_assert_int_eq(device_alloc_zeroed(cpu, n, (void **)&p), STATUS_OK);
    ck_assert_uint_eq(mem_os_allocs(cpu), before); /* from the cache */
    size_t nonzero = 0;
    for (size_t i = 0; i < n; i++) nonzero += p[i] != 0;
    ck_assert_msg(nonzero == 0, "%zu-byte zeroed block from the cache: %zu bytes not zero", n,
                  nonzero);
    device_free_zeroed(cpu, p, n);
  }
  /* four 2 MiB blocks freed and asked for again come from the cache (peak 8 MiB) */
  mem_empty_cache(cpu);
  const size_t MiB = (size_t)1 << 20;
  void *b[4], *big;
  size_t before = mem_os_allocs(cpu);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(device_alloc(cpu, 2 * MiB, &b[i]), STATUS_OK);
  for (int i = 0; i < 4; i++) device_free(cpu, b[i], 2 * MiB);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(device_alloc(cpu, 2 * MiB, &b[i]), STATUS_OK);
  ck_assert_uint_eq(mem_os_allocs(cpu), before + 4);
  for (int i = 0; i < 4; i++) device_free(cpu, b[i], 2 * MiB);
  /* a 6 MiB request misses: 6 live + 8 cached would pass 1.25 x 8, so the two oldest 2 MiB
   * blocks go back; asking for four 2 MiB blocks then finds two, and the 6 MiB block is
   * released for the third (6 + 6 > 10): 1 + 2 blocks from the system */
  ck_assert_int_eq(device_alloc(cpu, 6 * MiB, &big), STATUS_OK);
  device_free(cpu, big, 6 * MiB);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(device_alloc(cpu, 2 * MiB, &b[i]), STATUS_OK);
  ck_assert_uint_eq(mem_os_allocs(cpu), before + 4 + 3);
  for (int i = 0; i < 4; i++) device_free(cpu, b[i], 2 * MiB);
  mem_empty_cache(cpu);
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
  tensor_t t, v;
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
  tensor_t m, v, n, c, real;
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
  tcase_add_test(tc, device_choice_by_devices_and_ranks);
  tcase_add_test(tc, device_poll_ends_by_ready_failure_or_hook);
  tcase_add_test(tc, kernel_profile_counts_calls_per_kernel);
  tcase_add_test(tc, tensor_scalar_and_empty);
  tcase_add_test(tc, tensor_view_checks_numel);
  tcase_add_test(tc, tensor_narrow_inner_dim_copies_strided);
  tcase_add_test(tc, tensor_narrow_box_views_a_box);
  tcase_add_test(tc, tensor_copy_into_strided_destination);
  tcase_add_test(tc, tensor_copy_casts_with_rounding);
  tcase_add_test(tc, tensor_copy_casts_rows_like_dtype_store);
  tcase_add_test(tc, kernel_adamw_many_checks_all_then_updates_each);
  tcase_add_test(tc, tensor_fill_strided_view);
  tcase_add_test(tc, tensor_equal_compares_bits);
  tcase_add_test(tc, mem_stats_track_current_and_peak);
  tcase_add_test(tc, host_cache_reuses_blocks_and_zeroes_them);
  tcase_add_test(tc, err_prefix_keeps_the_detail);
  tcase_add_test(tc, tensor_wrap_does_not_free);
  tcase_add_test(tc, tensor_meta_has_layout_without_memory);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
