/*
 * How a matrix product reaches cuBLASLt (backends/cuda/cublas_lt.c), checked without a GPU: the
 * row-major product kernel_matmul checked, put in cuBLAS's column-major terms
 * (cublas_lt_of_row_major) and described by the layouts cuBLASLt is given
 * (cublas_lt_layouts), is carried out here by the definition of a column-major product
 * (D = alpha op(A) op(B) + beta D, each operand read as its layout describes it, over the same
 * memory) and must give kernel_matmul's result on the CPU, for every pair of transposes and
 * sizes that are not multiples of anything. What only a device can tell (that cuBLASLt runs
 * these descriptors) is the GPU suite's: kernels-gpu compares the path with the CPU kernels.
 */
#include <math.h>
#include <stdlib.h>

#include "backends/cuda/cublas_lt.h"
#include "core/kernels.h"
#include "tests/harness.h"

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

/* Element (r, c) of a column-major matrix with leading dimension ld, or of its transpose. */
static float at(const float *p, const lt_layout_t *l, bool trans, int64_t r, int64_t c) {
  if (trans) {
    int64_t t = r;
    r = c;
    c = t;
  }
  ck_assert_msg(r >= 0 && (uint64_t)r < l->rows && c >= 0 && (uint64_t)c < l->cols,
                "(%lld, %lld) outside the %llu x %llu layout", (long long)r, (long long)c,
                (unsigned long long)l->rows, (unsigned long long)l->cols);
  ck_assert_int_ge(l->ld, (int64_t)l->rows);
  return p[r + c * l->ld];
}

static void rnd(fsdpc_tensor_t *t, int64_t rows, int64_t cols, unsigned long long seed) {
  int64_t shape[2] = {rows, cols};
  ok(tensor_init(t, DTYPE_F32, device_cpu(), 2, shape));
  test_rng_t r = {seed};
  test_fill_uniform(t, &r, 1);
}

typedef struct pcase {
  int64_t m, n, k;
  bool ta, tb;
} pcase_t;

static const pcase_t cases[] = {
    {7, 5, 3, false, false},   {7, 5, 3, false, true}, {7, 5, 3, true, false},
    {7, 5, 3, true, true},     {1, 9, 4, false, true}, {6, 1, 11, true, false},
    {13, 17, 1, false, false}, {2, 3, 19, true, true},
};

START_TEST(layouts_carry_the_row_major_product) {
  const pcase_t *c = &cases[_i];
  /* stored as kernel_matmul takes them: a [m, k] or [k, m] (trans), b [k, n] or [n, k] */
  fsdpc_tensor_t a, b, want, got;
  rnd(&a, c->ta ? c->k : c->m, c->ta ? c->m : c->k, 1 + (unsigned)_i);
  rnd(&b, c->tb ? c->n : c->k, c->tb ? c->k : c->n, 101 + (unsigned)_i);
  rnd(&want, c->m, c->n, 201 + (unsigned)_i);
  ok(tensor_clone(&got, &want, DTYPE_F32, device_cpu()));
  float alpha = 0.75f, beta = -0.5f;
  ok(kernel_matmul(&want, &a, c->ta, &b, c->tb, alpha, beta));
  matmul_dims_t d = {.m = c->m, .n = c->n, .k = c->k, .lda = a.shape[1], .ldb = b.shape[1]};
  lt_gemm_t g = cublas_lt_of_row_major(0, NULL, DTYPE_F32, c->ta, c->tb, &d);
  lt_layout_t l[3];
  cublas_lt_layouts(&g, l);
  /* cuBLAS's A and B are b and a; D is out, over the same memory */
  const float *A = b.data, *B = a.data;
  float *D = got.data;
  float *res = malloc(sizeof(float) * (size_t)(g.m * g.n));
  ck_assert_ptr_nonnull(res);
  for (int64_t i = 0; i < g.m; i++)
    for (int64_t j = 0; j < g.n; j++) {
      double s = 0;
      for (int64_t p = 0; p < g.k; p++)
        s += (double)at(A, &l[0], g.trans_a, i, p) * at(B, &l[1], g.trans_b, p, j);
      res[i + j * g.m] = (float)(alpha * s + beta * at(D, &l[2], false, i, j));
    }
  for (int64_t i = 0; i < g.m; i++)
    for (int64_t j = 0; j < g.n; j++) D[i + j * l[2].ld] = res[i + j * g.m];
  free(res);
  double e = test_rel_l2(&got, &want);
  ck_assert_msg(e < 1e-6, "m=%lld n=%lld k=%lld%s%s: relative error %.3g", (long long)c->m,
                (long long)c->n, (long long)c->k, c->ta ? " a^T" : "", c->tb ? " b^T" : "", e);
  tensor_free(&a);
  tensor_free(&b);
  tensor_free(&want);
  tensor_free(&got);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("cublas_lt");
  TCase *tc = tcase_create("layouts");
  tcase_add_loop_test(tc, layouts_carry_the_row_major_product, 0,
                      (int)(sizeof cases / sizeof cases[0]));
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
