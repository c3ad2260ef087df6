/*
 * The MoE block (nn/moe.h) against an independent PyTorch MoE (tests/reference/
 * make_moe_golden.py): the output, the tokens each expert received and the gradients of the
 * input and of every weight, with top-2 routing plain and renormalised and with top-1 over 8
 * experts of which some receive no token, with a shared expert, and with DeepSeek-V3's
 * sigmoid routing and expert bias (its update after a step too); and the operations'
 * refusals. With the argument "cuda" (the GPU suite) the cases run on the GPU in f32: the
 * routing, the rows and the experts' products on the device, the choices then on the host.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/safetensors.h"
#include "core/kernels.h"
#include "nn/moe.h"
#include "tests/harness.h"

#define REF SOURCE_ROOT "/tests/reference/"

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

/* Where the cases run, and their tolerances (relative L2): cuBLAS orders fp32 sums otherwise. */
static struct {
  device_type_t device;
  double tol_out, tol_grad;
} mode = {DEVICE_CPU, 1e-6, 1e-5};

/* t on the mode's device (a copy). */
static void to_dev(fsdpc_tensor_t *t) {
  if (mode.device == DEVICE_CPU) return;
  fsdpc_tensor_t d;
  ok(tensor_clone(&d, t, t->dtype, world_device()));
  tensor_free(t);
  *t = d;
}

/* A host f32 copy of t. */
static fsdpc_tensor_t host(const fsdpc_tensor_t *t) {
  fsdpc_tensor_t h;
  ok(tensor_clone(&h, t, DTYPE_F32, device_cpu()));
  return h;
}

/* Golden tensor CASE.NAME on the host, in its stored dtype. */
static void golden(st_file_t *f, const char *tag, const char *name, fsdpc_tensor_t *out) {
  char full[128];
  snprintf(full, sizeof full, "%s.%s", tag, name);
  const st_info_t *info = st_find(f, full);
  ck_assert_msg(info != NULL, "golden file has no %s", full);
  dtype_t dt = strcmp(name, "load") == 0 ? DTYPE_I64 : DTYPE_F32;
  ok(tensor_init(out, dt, device_cpu(), info->ndim, info->shape));
  ok(st_read(f, full, out));
}

static const char *const weights[] = {"gate.weight",
                                      "experts.gate_proj",
                                      "experts.up_proj",
                                      "experts.down_proj",
                                      "shared_experts.gate_proj.weight",
                                      "shared_experts.up_proj.weight",
                                      "shared_experts.down_proj.weight"};

/* On the device the experts' products of a forward and backward are nine grouped cuBLAS calls
 * (gate, up and down: one forward, two backward; the golden blocks' f32 rows of 8 and 12 are
 * 16-byte multiples), unless turned off or, on a GPU, cuBLAS does not support them (the note
 * says so); the emulator has them. */
static void grouped_calls(const char *tag, int64_t calls) {
  const char *note = kernel_matmul_grouped_note();
  bool off = kernel_matmul_grouped_off()[0] != '\0';
  bool refused = getenv("FSDPC_TEST_CUDA_EMULATED") == NULL && strstr(note, "does not support");
  ck_assert_msg(calls == 9 || ((off || refused) && calls == 0),
                "%s: %lld grouped calls of the experts' 9 (%s)", tag, (long long)calls, note);
  if (calls == 0) printf("%s: the experts' products ran one by one: %s\n", tag, note);
}

/* The block of case tag, run forward and backward with the upstream gradient r; every value
 * against torch's. sigmoid: DeepSeek-V3's routing (scale 2.5, the golden expert_bias), and
 * then the bias's update by 0.125 toward the mean load. */
static void check_case(const char *tag, int experts, int k, bool norm, int64_t shared,
                       bool sigmoid) {
  st_file_t *g;
  ok(st_open(REF "tiny_moe_golden.safetensors", &g));
  nn_module_t *m;
  nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;
  lo.device = mode.device;
  ok(nn_moe_new(NULL, "", 8, 12, experts, k, norm, &lo, &m));
  if (shared > 0) ok(nn_moe_add_shared_expert(m, shared, &lo));
  if (sigmoid) ok(nn_moe_set_routing(m, NN_MOE_SIGMOID, 2.5, 0.125));
  ok(nn_module_finalize(m));
  int nw = shared > 0 ? 7 : 4;
  for (int i = 0; i < nw; i++) {
    fsdpc_tensor_t w;
    golden(g, tag, weights[i], &w);
    ok(nn_param_copy_full(nn_param_find(m, weights[i]), &w));
    tensor_free(&w);
  }
  fsdpc_tensor_t bias = {0};
  if (sigmoid) {
    golden(g, tag, "expert_bias", &bias);
    ok(nn_param_copy_full(nn_param_find(m, "expert_bias"), &bias));
  }
  fsdpc_tensor_t x, r, ref, h;
  golden(g, tag, "x", &x);
  golden(g, tag, "r", &r);
  to_dev(&x);
  to_dev(&r);
  nn_ctx_t *ctx;
  nn_var_t *in, *out;
  int64_t grouped = kernel_matmul_grouped_runs();
  ok(nn_ctx_new(&ctx));
  ok(nn_var_new(&x, true, &in));
  ok(nn_call(ctx, m, in, &out));
  golden(g, tag, "out", &ref);
  h = host(&out->value);
  double e = test_rel_l2(&h, &ref);
  ck_assert_msg(e <= mode.tol_out, "%s: output relative L2 error %.3g", tag, e);
  tensor_free(&h);
  tensor_free(&ref);
  int64_t load[8];
  ck_assert(nn_moe_last_load(m, load, experts));
  golden(g, tag, "load", &ref);
  ck_assert(memcmp(load, ref.data, (size_t)experts * sizeof *load) == 0);
  tensor_free(&ref);
  ok(nn_backward_grad(ctx, out, &r));
  if (mode.device == DEVICE_CUDA) grouped_calls(tag, kernel_matmul_grouped_runs() - grouped);
  golden(g, tag, "grad.x", &ref);
  h = host(&in->grad);
  e = test_rel_l2(&h, &ref);
  ck_assert_msg(e <= mode.tol_grad, "%s: input gradient relative L2 error %.3g", tag, e);
  tensor_free(&h);
  tensor_free(&ref);
  for (int i = 0; i < nw; i++) {
    char name[64];
    snprintf(name, sizeof name, "grad.%s", weights[i]);
    golden(g, tag, name, &ref);
    nn_param_t *p = nn_param_find(m, weights[i]);
    ck_assert_msg(p->grad != NULL, "%s: %s has no gradient", tag, weights[i]);
    h = host(dtensor_local(p->grad));
    e = test_rel_l2(&h, &ref);
    ck_assert_msg(e <= mode.tol_grad, "%s: %s relative L2 error %.3g", tag, name, e);
    tensor_free(&h);
    tensor_free(&ref);
  }
  if (sigmoid) { /* no gradient; after the step, each expert's bias 0.125 toward the mean */
    nn_param_t *b = nn_param_find(m, "expert_bias");
    ck_assert(b->grad == NULL && !b->requires_grad);
    mesh_t *one;
    ok(mesh_local_shared(mode.device, &one));
    ok(nn_moe_update_bias(m, mesh_group(one, 0)));
    golden(g, tag, "load", &ref);
    const int64_t *l = ref.data;
    double mean = 0;
    for (int i = 0; i < experts; i++) mean += (double)l[i] / experts;
    h = host(dtensor_local(b->value));
    const float *got = h.data, *was = bias.data;
    for (int i = 0; i < experts; i++)
      ck_assert_float_eq(got[i], was[i] + (l[i] < mean ? 0.125f : l[i] > mean ? -0.125f : 0));
    tensor_free(&h);
    /* a forward whose counts are discarded (a skipped step's) moves nothing either */
    nn_ctx_t *again;
    nn_var_t *o2;
    ok(nn_ctx_new(&again));
    ok(nn_call(again, m, in, &o2));
    nn_moe_discard_bias_counts(m);
    nn_moe_discard_bias_counts(NULL); /* a no-op */
    nn_var_put(o2);
    nn_ctx_free(again);
    ok(nn_moe_update_bias(m, mesh_group(one, 0)));
    h = host(dtensor_local(b->value));
    got = h.data;
    for (int i = 0; i < experts; i++)
      ck_assert_float_eq(got[i], was[i] + (l[i] < mean ? 0.125f : l[i] > mean ? -0.125f : 0));
    tensor_free(&h);
    tensor_free(&ref);
    tensor_free(&bias);
  }
  nn_var_put(out);
  nn_var_put(in);
  nn_ctx_free(ctx);
  nn_module_free(m);
  st_close(g);
}

START_TEST(top2_plain) { check_case("plain", 4, 2, false, 0, false); }
END_TEST

START_TEST(top2_renormalised) { check_case("norm", 4, 2, true, 0, false); }
END_TEST

START_TEST(top1_with_idle_experts) { check_case("sparse", 8, 1, false, 0, false); }
END_TEST

/* DeepSeek-V3's routing: sigmoid scores, the choice moved by expert_bias, renormalised and
 * scaled; its refusals. */
START_TEST(sigmoid_routing_with_bias) {
  check_case("sigmoid", 6, 2, true, 0, true);
  nn_module_t *m;
  ok(nn_moe_new(NULL, "", 8, 12, 4, 2, true, NULL, &m));
  ck_assert_int_eq(nn_moe_set_routing(m, NN_MOE_SIGMOID, 0, 0), STATUS_EINVAL);
  ck_assert_int_eq(nn_moe_set_routing(m, NN_MOE_SIGMOID, 1, -1), STATUS_EINVAL);
  ck_assert_int_eq(nn_moe_set_routing(m, (nn_moe_score_t)7, 1, 0), STATUS_EINVAL);
  ck_assert_int_eq(nn_moe_set_routing(nn_module_child(m, 0), NN_MOE_SIGMOID, 1, 0), STATUS_EINVAL);
  ok(nn_moe_set_routing(m, NN_MOE_SIGMOID, 1, 0));
  ck_assert_ptr_null(nn_param_find(m, "expert_bias")); /* without a rate, no bias */
  nn_moe_aux_t *a;
  ok(nn_moe_aux_new(4, 2, 0.1, &a));
  ck_assert_int_eq(nn_moe_aux_attach(m, a, NULL), STATUS_EINVAL);
  ck_assert_ptr_nonnull(strstr(err_detail(), "sigmoid"));
  nn_moe_aux_free(a);
  nn_module_free(m);
}
END_TEST

/* DeepSeek-V3's ungated shared expert beside the routed ones. */
START_TEST(shared_expert) {
  check_case("shared", 4, 2, true, 10, false);
  nn_module_t *m;
  ok(nn_moe_new(NULL, "", 8, 12, 4, 2, true, NULL, &m));
  ok(nn_moe_add_shared_expert(m, 10, NULL));
  ck_assert_int_eq(nn_moe_add_shared_expert(m, 10, NULL), STATUS_EINVAL); /* one */
  ck_assert_int_eq(nn_moe_add_shared_expert(nn_module_child(m, 0), 10, NULL), STATUS_EINVAL);
  nn_module_free(m);
  ok(nn_moe_new(NULL, "", 8, 12, 4, 2, true, NULL, &m));
  ck_assert_int_eq(nn_moe_add_shared_expert(m, 0, NULL), STATUS_EINVAL);
  nn_module_free(m);
  /* Qwen2-MoE's gated one (checked against torch in the llama suite's qwen2_moe): its expert
   * and gate under their names, one shared expert a block, gated or not */
  ok(nn_moe_new(NULL, "", 8, 12, 4, 2, true, NULL, &m));
  ok(nn_moe_add_gated_shared_expert(m, 10, NULL));
  ck_assert_int_eq(nn_moe_add_gated_shared_expert(m, 10, NULL), STATUS_EINVAL);
  ck_assert_int_eq(nn_moe_add_shared_expert(m, 10, NULL), STATUS_EINVAL);
  ok(nn_module_finalize(m));
  ck_assert_ptr_nonnull(nn_param_find(m, "shared_expert.up_proj.weight"));
  nn_param_t *g = nn_param_find(m, "shared_expert_gate.weight");
  ck_assert(g != NULL && dtensor_shape(g->value)[0] == 1 && dtensor_shape(g->value)[1] == 8);
  nn_module_free(m);
}
END_TEST

/* kernel_moe_route's refusals, each by name; NaN scores (a row of them, or one among others)
 * still give k distinct experts. */
static void route_refusals(void) {
  fsdpc_tensor_t z, p, ex, w, dz, bad, b3;
  ok(tensor_zeros(&z, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 4}));
  ok(tensor_zeros(&p, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 4}));
  ok(tensor_zeros(&dz, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 4}));
  ok(tensor_zeros(&ex, DTYPE_I64, device_cpu(), 2, (int64_t[]){2, 2}));
  ok(tensor_zeros(&w, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 2}));
  ok(tensor_zeros(&bad, DTYPE_BF16, device_cpu(), 2, (int64_t[]){2, 4}));
  ok(tensor_zeros(&b3, DTYPE_F32, device_cpu(), 1, (int64_t[]){3}));
  ck_assert_int_eq(kernel_moe_route(&p, &ex, &w, &z, NULL, 3, true, false, 1), STATUS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err_detail(), "[tokens, k]"));
  ck_assert_int_eq(kernel_moe_route(&p, &ex, &w, &z, NULL, 5, true, false, 1), STATUS_EINVAL);
  ck_assert_ptr_nonnull(strstr(err_detail(), "top_k 5 must lie in [1, 4]"));
  ck_assert_int_eq(kernel_moe_route(&p, &ex, &w, &bad, NULL, 2, true, false, 1), STATUS_EDTYPE);
  ck_assert_int_eq(kernel_moe_route(&p, &ex, &w, &z, &b3, 2, true, false, 1), STATUS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err_detail(), "[experts]"));
  ck_assert_int_eq(kernel_moe_route(&p, &ex, &w, &z, NULL, 2, true, false, 0), STATUS_EINVAL);
  ((float *)z.data)[1] = NAN; /* token 0: a NaN score among equal ones */
  ok(kernel_moe_route(&p, &ex, &w, &z, NULL, 2, true, false, 1));
  const int64_t *e = ex.data;
  for (int t = 0; t < 2; t++)
    ck_assert(e[2 * t] >= 0 && e[2 * t] < 4 && e[2 * t + 1] >= 0 && e[2 * t + 1] < 4 &&
              e[2 * t] != e[2 * t + 1]);
  ck_assert(e[2] == 0 && e[3] == 1); /* token 1: equal scores, the lower experts first */
  ok(kernel_moe_route(&p, &ex, &w, &z, NULL, 2, true, true, 1)); /* sigmoid: one NaN score */
  ck_assert(e[0] >= 0 && e[0] < 4 && e[1] >= 0 && e[1] < 4 && e[0] != e[1]);
  ((int64_t *)ex.data)[3] = 4;
  ck_assert_int_eq(kernel_moe_route_backward(&dz, &w, &w, &p, &ex, NULL, 2, true, false, 1),
                   STATUS_EINVAL);
  ck_assert_ptr_nonnull(strstr(err_detail(), "expert 4 outside [0, 4)"));
  fsdpc_tensor_t *all[] = {&z, &p, &ex, &w, &dz, &bad, &b3};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
}

/* Bad sizes and inputs are refused by name, without a crash. */
START_TEST(refusals) {
  route_refusals();
  nn_module_t *m = NULL;
  ck_assert_int_ne(nn_moe_new(NULL, "moe", 8, 12, 4, 5, true, NULL, &m), STATUS_OK);
  ck_assert_ptr_nonnull(strstr(err_detail(), "top_k 5"));
  ck_assert_int_ne(nn_moe_new(NULL, "moe", 8, 12, 0, 1, true, NULL, &m), STATUS_OK);
  /* the experts' weights renamed (Mixtral's w1, w3, w2) before finalize, by plain names */
  ok(nn_moe_new(NULL, "", 8, 12, 4, 2, true, NULL, &m));
  ck_assert_int_eq(nn_moe_name_experts(m, "w1", "w1", "w2"), STATUS_EINVAL); /* twice */
  ck_assert_int_eq(nn_moe_name_experts(m, "w.1", "w3", "w2"), STATUS_EINVAL);
  ck_assert_int_eq(nn_moe_name_experts(m, "", "w3", "w2"), STATUS_EINVAL);
  ck_assert_int_eq(nn_moe_name_experts(nn_module_child(m, 0), "w1", "w3", "w2"), STATUS_EINVAL);
  ok(nn_moe_name_experts(m, "w1", "w3", "w2"));
  ok(nn_module_finalize(m));
  ck_assert_ptr_nonnull(nn_param_find(m, "experts.w3"));
  ck_assert_ptr_null(nn_param_find(m, "experts.up_proj"));
  ck_assert_int_eq(nn_moe_name_experts(m, "a", "b", "c"), STATUS_EINVAL); /* finalized */
  ck_assert_ptr_nonnull(strstr(err_detail(), "finalized already"));
  nn_module_free(m);
  ok(nn_moe_new(NULL, "", 8, 12, 4, 2, true, NULL, &m));
  ok(nn_module_finalize(m));
  fsdpc_tensor_t x;
  ok(tensor_zeros(&x, DTYPE_F32, device_cpu(), 2, (int64_t[]){3, 7}));
  nn_ctx_t *ctx;
  nn_var_t *in, *out = NULL;
  ok(nn_ctx_new(&ctx));
  ok(nn_var_new(&x, false, &in));
  ck_assert_int_ne(nn_call(ctx, m, in, &out), STATUS_OK);
  ck_assert_ptr_nonnull(strstr(err_detail(), "does not end in dim 8"));
  fsdpc_tensor_t rows;
  ok(tensor_init(&rows, DTYPE_I64, device_cpu(), 1, (int64_t[]){1}));
  ((int64_t *)rows.data)[0] = 3;
  ck_assert_int_ne(nn_gather_rows(ctx, in, &rows, &out), STATUS_OK);
  ck_assert_ptr_nonnull(strstr(err_detail(), "row 3 outside [0, 3)"));
  int64_t load[4];
  ck_assert(!nn_moe_last_load(m, load, 4)); /* it has not run */
  tensor_free(&rows);
  nn_var_put(in);
  nn_ctx_free(ctx);
  nn_module_free(m);
}
END_TEST

/* A slot named twice sums both rows forward and both rows' products backward. */
START_TEST(combine_repeated_slot) {
  fsdpc_tensor_t y, w, slots, g;
  ok(tensor_init(&y, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 1}));
  ok(tensor_init(&w, DTYPE_F32, device_cpu(), 2, (int64_t[]){1, 1}));
  ok(tensor_init(&slots, DTYPE_I64, device_cpu(), 1, (int64_t[]){2}));
  ok(tensor_init(&g, DTYPE_F32, device_cpu(), 2, (int64_t[]){1, 1}));
  ((float *)y.data)[0] = 1, ((float *)y.data)[1] = 2, ((float *)w.data)[0] = 0.5f;
  ((int64_t *)slots.data)[0] = ((int64_t *)slots.data)[1] = 0;
  ((float *)g.data)[0] = 1;
  nn_ctx_t *ctx;
  nn_var_t *yv, *wv, *out;
  ok(nn_ctx_new(&ctx));
  ok(nn_var_new(&y, true, &yv));
  ok(nn_var_new(&w, true, &wv));
  ok(nn_combine_rows(ctx, yv, wv, &slots, &out));
  ck_assert_float_eq(((float *)out->value.data)[0], 1.5f);
  ok(nn_backward_grad(ctx, out, &g));
  ck_assert_float_eq(((float *)wv->grad.data)[0], 3.0f);
  ck_assert_float_eq(((float *)yv->grad.data)[1], 0.5f);
  nn_var_put(out);
  nn_var_put(yv);
  nn_var_put(wv);
  tensor_free(&slots);
  nn_ctx_free(ctx);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("moe");
  TCase *tc = tcase_create("moe");
  if (test_argc() > 1 && strcmp(test_argv()[1], "cuda") == 0) {
    if (world_device().type != DEVICE_CUDA) {
      harness_skip("no CUDA device");
      suite_add_tcase(s, tc);
      return s;
    }
    mode.device = DEVICE_CUDA;
    mode.tol_out = 1e-5;
    mode.tol_grad = 1e-4;
  }
  tcase_add_test(tc, top2_plain);
  tcase_add_test(tc, top2_renormalised);
  tcase_add_test(tc, top1_with_idle_experts);
  tcase_add_test(tc, shared_expert);
  tcase_add_test(tc, sigmoid_routing_with_bias);
  if (mode.device == DEVICE_CPU) tcase_add_test(tc, refusals);
  if (mode.device == DEVICE_CPU) tcase_add_test(tc, combine_repeated_slot);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
