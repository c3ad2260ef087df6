/*
 * cuDNN's fused-attention graphs (backends/cuda/cudnn_sdpa.c) checked without a GPU: cuDNN must take
 * every tensor and operation descriptor, the operation graph and a heuristics query over it,
 * forward and backward, bf16 and f16, with one kv head per query head, grouped heads and one
 * kv head, at the training shapes of the benchmark configs and at odd ones. What only a device
 * can tell (an engine that runs the graph, the results) is the GPU suite's: kernels-gpu
 * compares the fused path with the CPU kernels. Skips (77) where libcudnn.so.9 cannot be
 * loaded. Also: kernel_attention_fused_off and kernel_matmul_lt_off name what keeps attention
 * off cuDNN and matrix products off cuBLASLt.
 */
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cudnn_sdpa.h"
#include "core/kernels.h"
#include "tests/harness.h"

typedef struct gcase {
  int64_t B, T, H, Hkv, Dh;
} gcase_t;

static const gcase_t cases[] = {
    {8, 1024, 16, 16, 128}, /* the attention benchmark */
    {8, 1024, 12, 4, 64},   /* llama-100m */
    {8, 1024, 16, 8, 128},  /* llama-0.9b */
    {2, 136, 8, 2, 64},     /* kernels-gpu's batched case */
    {3, 19, 6, 1, 8},       /* odd sizes, one kv head */
};

static attn_shape_t shape_of(const gcase_t *c) {
  int64_t q[4] = {c->B, c->T, c->H, c->Dh}, k[4] = {c->B, c->T, c->Hkv, c->Dh};
  return attn_shape_of(q, k);
}

START_TEST(cudnn_takes_the_attention_graphs) {
  const gcase_t *c = &cases[_i / 4];
  dtype_t dt = _i % 2 ? DTYPE_F16 : DTYPE_BF16;
  bool backward = (_i / 2) % 2;
  attn_shape_t s = shape_of(c);
  fsdpc_status_t st = cudnn_sdpa_check_graph(&s, dt, backward);
  ck_assert_msg(st == STATUS_OK, "B=%lld T=%lld H=%lld Hkv=%lld Dh=%lld %s %s: %s: %s",
                (long long)c->B, (long long)c->T, (long long)c->H, (long long)c->Hkv,
                (long long)c->Dh, dtype_name(dt), backward ? "backward" : "forward", status_str(st),
                err_detail());
}
END_TEST

/* What keeps every call off cuDNN, as fsdp-train's header reports it. */
START_TEST(the_switch_names_what_keeps_attention_off) {
#ifdef FSDPC_HAVE_CUDNN
  const char *env = getenv("FSDPC_CUDNN_ATTENTION");
  const char *base = env != NULL && strcmp(env, "0") == 0 ? "FSDPC_CUDNN_ATTENTION=0" : "";
  ck_assert_str_eq(kernel_attention_fused_off(), base);
  kernel_attention_set_fused(false);
  ck_assert_str_eq(kernel_attention_fused_off(),
                   base[0] ? base : "kernel_attention_set_fused(false)");
  kernel_attention_set_fused(true);
  ck_assert_str_eq(kernel_attention_fused_off(), base);
#else
  ck_assert_ptr_nonnull(strstr(kernel_attention_fused_off(), "built without"));
#endif
}
END_TEST

/* The same for cuBLASLt (no product runs it without a device). */
START_TEST(the_switch_names_what_keeps_products_off_cublaslt) {
  const char *env = getenv("FSDPC_CUBLASLT");
  const char *base = env != NULL && strcmp(env, "0") == 0 ? "FSDPC_CUBLASLT=0" : "";
  ck_assert_str_eq(kernel_matmul_lt_off(), base);
  kernel_matmul_set_lt(false);
  ck_assert_str_eq(kernel_matmul_lt_off(), base[0] ? base : "kernel_matmul_set_lt(false)");
  kernel_matmul_set_lt(true);
  ck_assert_str_eq(kernel_matmul_lt_off(), base);
  ck_assert_int_eq(kernel_matmul_lt_runs(), 0);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("cudnn_graph");
  TCase *tc = tcase_create("graphs");
  attn_shape_t probe = shape_of(&cases[0]);
  fsdpc_status_t st = cudnn_sdpa_check_graph(&probe, DTYPE_BF16, false);
  if (st == STATUS_ENODEV) {
    harness_skip(err_detail());
  } else {
    int n = (int)(sizeof cases / sizeof cases[0]);
    tcase_add_loop_test(tc, cudnn_takes_the_attention_graphs, 0, 4 * n);
  }
  suite_add_tcase(s, tc);
  TCase *sw = tcase_create("switch");
  tcase_add_test(sw, the_switch_names_what_keeps_attention_off);
  tcase_add_test(sw, the_switch_names_what_keeps_products_off_cublaslt);
  suite_add_tcase(s, sw);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
