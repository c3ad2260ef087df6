/*
 * Every backward against central finite differences of its forward: for an operation y = f(x),
 * L = sum(r * y) with a random r; dL/dx from backward is compared with
 * (L(x + h e_i) - L(x - h e_i)) / 2h on sampled elements of every input and parameter.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/kernels.h"
#include "nn/ops.h"
#include "tests/harness.h"

#define MAX_IN 3
#define MAX_PARAMS 2

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

typedef struct fd_case {
  const char *name;
  int n_in;
  int in_ndim[MAX_IN];
  int64_t in_shape[MAX_IN][4];
  bool in_grad[MAX_IN]; /* false: not differentiated (ids, targets) */
  int n_params;
  int p_ndim[MAX_PARAMS];
  int64_t p_shape[MAX_PARAMS][4];
  /* builds the output from inputs and parameters */
  fsdpc_status_t (*build)(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out);
  /* optional: fills non-differentiated inputs (indices) */
  void (*fill)(fsdpc_tensor_t *in, int i);
} fd_case_t;

static double weighted_sum(const fsdpc_tensor_t *y, const fsdpc_tensor_t *r) {
  fsdpc_tensor_t h;
  ok(tensor_clone(&h, y, DTYPE_F32, device_cpu()));
  double s = 0;
  for (int64_t i = 0; i < tensor_numel(y); i++)
    s += (double)((float *)h.data)[i] * ((float *)r->data)[i];
  tensor_free(&h);
  return s;
}

static double eval(const fd_case_t *c, nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p,
                   const fsdpc_tensor_t *r) {
  nn_ctx_set_grad_enabled(ctx, false);
  nn_var_t *y;
  ok(c->build(ctx, in, p, &y));
  double s = weighted_sum(&y->value, r);
  nn_var_put(y);
  nn_ctx_set_grad_enabled(ctx, true);
  return s;
}

/* Compares analytic gradient g of tensor x (perturbed in place) at sampled elements. */
static void check_tensor(const fd_case_t *c, const char *what, nn_ctx_t *ctx, nn_var_t **in,
                         nn_param_t **p, const fsdpc_tensor_t *r, fsdpc_tensor_t *x,
                         const fsdpc_tensor_t *g, test_rng_t *rng) {
  ck_assert_msg(g->storage != NULL, "%s: %s has no gradient", c->name, what);
  fsdpc_tensor_t gh;
  ok(tensor_clone(&gh, g, DTYPE_F32, device_cpu()));
  int64_t n = tensor_numel(x);
  int samples = n < 24 ? (int)n : 24;
  float *xv = x->data;
  for (int s = 0; s < samples; s++) {
    int64_t i = n < 24 ? s : (int64_t)(test_rng_next(rng) % (unsigned long long)n);
    float orig = xv[i];
    double h = 1e-2;
    xv[i] = orig + (float)h;
    double lp = eval(c, ctx, in, p, r);
    xv[i] = orig - (float)h;
    double lm = eval(c, ctx, in, p, r);
    xv[i] = orig;
    double fd = (lp - lm) / (2 * h), an = ((float *)gh.data)[i];
    ck_assert_msg(fabs(fd - an) <= 1e-3 + 3e-3 * fabs(fd),
                  "%s: d/d%s[%lld]: backward %.6g, "
                  "finite difference %.6g",
                  c->name, what, (long long)i, an, fd);
  }
  tensor_free(&gh);
}

static void run_case(const fd_case_t *c) {
  test_rng_t rng = {0x5eed + (unsigned long long)strlen(c->name)};
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  nn_var_t *in[MAX_IN] = {0};
  nn_param_t params[MAX_PARAMS], *pp[MAX_PARAMS] = {0};
  memset(params, 0, sizeof params);
  for (int i = 0; i < c->n_in; i++) {
    fsdpc_tensor_t t;
    if (c->in_grad[i]) {
      ok(tensor_init(&t, DTYPE_F32, device_cpu(), c->in_ndim[i], c->in_shape[i]));
      test_fill_uniform(&t, &rng, 1.0);
    } else {
      ok(tensor_init(&t, DTYPE_I64, device_cpu(), c->in_ndim[i], c->in_shape[i]));
      c->fill(&t, i);
    }
    ok(nn_var_new(&t, c->in_grad[i], &in[i]));
  }
  for (int i = 0; i < c->n_params; i++) {
    params[i].name = params[i].fqn = (char *)"w";
    params[i].requires_grad = true;
    params[i].external = true; /* plain compute/compute_grad tensors, no DTensor */
    ok(tensor_init(&params[i].compute, DTYPE_F32, device_cpu(), c->p_ndim[i], c->p_shape[i]));
    test_fill_uniform(&params[i].compute, &rng, 1.0);
    pp[i] = &params[i];
  }
  nn_var_t *y;
  ok(c->build(ctx, in, pp, &y));
  fsdpc_tensor_t r, rg;
  ok(tensor_init(&r, DTYPE_F32, device_cpu(), y->value.ndim, y->value.shape));
  test_fill_uniform(&r, &rng, 1.0);
  ok(tensor_clone(&rg, &r, DTYPE_F32, device_cpu()));
  ok(nn_backward_grad(ctx, y, &rg));
  ck_assert_int_eq(nn_ctx_tape_length(ctx), 0);
  nn_var_put(y);
  for (int i = 0; i < c->n_in; i++) {
    if (!c->in_grad[i]) continue;
    char what[24];
    snprintf(what, sizeof what, "input%d", i);
    check_tensor(c, what, ctx, in, pp, &r, &in[i]->value, &in[i]->grad, &rng);
  }
  for (int i = 0; i < c->n_params; i++) {
    char what[24];
    snprintf(what, sizeof what, "param%d", i);
    check_tensor(c, what, ctx, in, pp, &r, &params[i].compute, &params[i].compute_grad, &rng);
  }
  for (int i = 0; i < c->n_in; i++) nn_var_put(in[i]);
  for (int i = 0; i < c->n_params; i++) {
    tensor_free(&params[i].compute);
    tensor_free(&params[i].compute_grad);
  }
  tensor_free(&r);
  nn_ctx_free(ctx);
}

/* ---- the operations ---- */

static fsdpc_status_t b_linear(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  return nn_linear(ctx, in[0], p[0], out);
}

/* The same weight used twice in a row: gradients of both uses accumulate. */
static fsdpc_status_t b_linear_twice(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  nn_var_t *h;
  FSDPC_TRY(nn_linear(ctx, in[0], p[0], &h));
  fsdpc_status_t st = nn_linear(ctx, h, p[0], out);
  nn_var_put(h);
  return st;
}

/* One input read by two weights, as q and k read theirs: the second product's dx is added
 * into the gradient the first formed. */
static fsdpc_status_t b_linear_shared_input(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p,
                                            nn_var_t **out) {
  nn_var_t *a, *b = NULL;
  FSDPC_TRY(nn_linear(ctx, in[0], p[0], &a));
  fsdpc_status_t st = nn_linear(ctx, in[0], p[1], &b);
  if (st == STATUS_OK) st = nn_add(ctx, a, b, out);
  nn_var_put(a);
  if (b) nn_var_put(b);
  return st;
}

/* x + linear(u) + rmsnorm(x), with the product recorded before x's use by the norm: the sum's
 * gradient reaches x, the product and the norm, and the norm's dx is added into x's gradient
 * before the product's backward reads its own. */
static fsdpc_status_t b_shared_grad(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  nn_var_t *a, *b = NULL, *h = NULL;
  FSDPC_TRY(nn_linear(ctx, in[1], p[0], &a));
  fsdpc_status_t st = nn_rmsnorm(ctx, in[0], p[1], 1e-5, &b);
  if (st == STATUS_OK) st = nn_add(ctx, in[0], a, &h);
  if (st == STATUS_OK) st = nn_add(ctx, h, b, out);
  nn_var_put(a);
  if (b) nn_var_put(b);
  if (h) nn_var_put(h);
  return st;
}

static fsdpc_status_t b_embedding(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  return nn_embedding(ctx, in[0], p[0], out);
}

static fsdpc_status_t b_rmsnorm(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  return nn_rmsnorm(ctx, in[0], p[0], 1e-5, out);
}

static fsdpc_status_t b_rope(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  (void)p;
  static const rope_t rope = {.theta = 10000.0, .scaling = ROPE_DEFAULT, .factor = 1};
  return nn_rope(ctx, in[0], &rope, out);
}

/* llama3 scaling with one pair in each regime (wavelengths 6.3, 499 and 39,000 positions). */
static fsdpc_status_t b_rope_llama3(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  (void)p;
  static const rope_t rope = {.theta = 500000.0, .scaling = ROPE_LLAMA3, .factor = 8,
                              .low_freq_factor = 1, .high_freq_factor = 4,
                              .original_max_pos = 1024};
  return nn_rope(ctx, in[0], &rope, out);
}

static fsdpc_status_t b_attention(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  (void)p;
  return nn_attention(ctx, in[0], in[1], in[2], out);
}

static fsdpc_status_t b_silu_mul(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  (void)p;
  return nn_silu_mul(ctx, in[0], in[1], out);
}

/* x + x*2 through add, scale and a view: one variable reaching the output twice. */
static fsdpc_status_t b_add_scale_view(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p,
                                       nn_var_t **out) {
  (void)p;
  nn_var_t *s, *a;
  FSDPC_TRY(nn_scale(ctx, in[0], 2.0, &s));
  fsdpc_status_t st = nn_add(ctx, in[0], s, &a);
  nn_var_put(s);
  FSDPC_TRY(st);
  int64_t shape[2] = {2, 6};
  st = nn_view(ctx, a, 2, shape, out);
  nn_var_put(a);
  return st;
}

static fsdpc_status_t b_cross_entropy(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p,
                                      nn_var_t **out) {
  (void)p;
  return nn_cross_entropy(ctx, in[0], &in[1]->value, out, NULL);
}

static fsdpc_status_t b_bias_add(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  return nn_bias_add(ctx, in[0], p[0], out);
}

static fsdpc_status_t b_gelu(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  (void)p;
  return nn_activation(ctx, in[0], KERNEL_ACT_GELU, out);
}

static fsdpc_status_t b_linear_io(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  return nn_linear_io(ctx, in[0], p[0], out);
}

/* The middle third of a fused projection's output, as GPT-2's attention takes k. */
static fsdpc_status_t b_narrow(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  (void)p;
  return nn_narrow(ctx, in[0], 2, 3, 3, out);
}

/* Two overlapping slices of one tensor: the second slice's gradient adds to the first's. */
static fsdpc_status_t b_narrow_slices(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p,
                                      nn_var_t **out) {
  (void)p;
  nn_var_t *a = NULL, *b = NULL;
  fsdpc_status_t st = nn_narrow(ctx, in[0], 2, 0, 4, &a);
  if (st == STATUS_OK) st = nn_narrow(ctx, in[0], 2, 3, 4, &b);
  if (st == STATUS_OK) st = nn_add(ctx, a, b, out);
  nn_var_put(a);
  nn_var_put(b);
  return st;
}

static fsdpc_status_t b_gelu_tanh(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  (void)p;
  return nn_activation(ctx, in[0], KERNEL_ACT_GELU_TANH, out);
}

static fsdpc_status_t b_sigmoid(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  (void)p;
  return nn_activation(ctx, in[0], KERNEL_ACT_SIGMOID, out);
}

static fsdpc_status_t b_silu(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  (void)p;
  return nn_activation(ctx, in[0], KERNEL_ACT_SILU, out);
}

static fsdpc_status_t b_layernorm(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  return nn_layernorm(ctx, in[0], p[0], p[1], 1e-5, out);
}

static fsdpc_status_t b_layernorm_no_bias(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p,
                                          nn_var_t **out) {
  return nn_layernorm(ctx, in[0], p[0], NULL, 1e-5, out);
}

/* mean((x - t)^2) against a fixed target t = 0.1 * (i mod 7) - 0.3. */
static fsdpc_status_t b_mse(nn_ctx_t *ctx, nn_var_t **in, nn_param_t **p, nn_var_t **out) {
  (void)p;
  fsdpc_tensor_t t;
  FSDPC_TRY(tensor_init(&t, DTYPE_F32, device_cpu(), in[0]->value.ndim, in[0]->value.shape));
  for (int64_t i = 0; i < tensor_numel(&t); i++) ((float *)t.data)[i] = 0.1f * (float)(i % 7) - 0.3f;
  fsdpc_status_t st = nn_mse_loss(ctx, in[0], &t, out);
  tensor_free(&t);
  return st;
}

static void fill_ids(fsdpc_tensor_t *t, int i) {
  (void)i;
  int64_t *v = t->data;
  for (int64_t k = 0; k < tensor_numel(t); k++) v[k] = (k * 3) % 5; /* repeats on purpose */
}

static void fill_targets(fsdpc_tensor_t *t, int i) {
  (void)i;
  int64_t *v = t->data;
  for (int64_t k = 0; k < tensor_numel(t); k++) v[k] = k == 2 ? -100 : (k * 5) % 9;
}

static const fd_case_t cases[] = {
    {"linear", 1, {3}, {{2, 3, 5}}, {true}, 1, {2}, {{4, 5}}, b_linear, NULL},
    {"linear_twice", 1, {2}, {{3, 5}}, {true}, 1, {2}, {{5, 5}}, b_linear_twice, NULL},
    {"linear_shared_input",
     1,
     {3},
     {{2, 3, 5}},
     {true},
     2,
     {2, 2},
     {{4, 5}, {4, 5}},
     b_linear_shared_input,
     NULL},
    {"shared_grad",
     2,
     {2, 2},
     {{3, 4}, {3, 5}},
     {true, true},
     2,
     {2, 1},
     {{4, 5}, {4}},
     b_shared_grad,
     NULL},
    {"embedding", 1, {2}, {{2, 3}}, {false}, 1, {2}, {{7, 5}}, b_embedding, fill_ids},
    {"rmsnorm", 1, {2}, {{3, 8}}, {true}, 1, {1}, {{8}}, b_rmsnorm, NULL},
    {"rope", 1, {4}, {{2, 5, 3, 6}}, {true}, 0, {0}, {{0}}, b_rope, NULL},
    {"rope_llama3", 1, {4}, {{2, 5, 3, 6}}, {true}, 0, {0}, {{0}}, b_rope_llama3, NULL},
    {"attention",
     3,
     {4, 4, 4},
     {{2, 5, 4, 6}, {2, 5, 2, 6}, {2, 5, 2, 6}},
     {true, true, true},
     0,
     {0},
     {{0}},
     b_attention,
     NULL},
    {"silu_mul", 2, {2, 2}, {{3, 7}, {3, 7}}, {true, true}, 0, {0}, {{0}}, b_silu_mul, NULL},
    {"add_scale_view", 1, {2}, {{3, 4}}, {true}, 0, {0}, {{0}}, b_add_scale_view, NULL},
    {"bias_add", 1, {3}, {{2, 3, 5}}, {true}, 1, {1}, {{5}}, b_bias_add, NULL},
    {"gelu", 1, {2}, {{3, 7}}, {true}, 0, {0}, {{0}}, b_gelu, NULL},
    {"gelu_tanh", 1, {2}, {{3, 7}}, {true}, 0, {0}, {{0}}, b_gelu_tanh, NULL},
    {"sigmoid", 1, {2}, {{3, 7}}, {true}, 0, {0}, {{0}}, b_sigmoid, NULL},
    {"linear_io", 1, {3}, {{2, 3, 4}}, {true}, 1, {2}, {{4, 5}}, b_linear_io, NULL},
    {"narrow", 1, {3}, {{2, 3, 9}}, {true}, 0, {0}, {{0}}, b_narrow, NULL},
    {"narrow_slices", 1, {3}, {{2, 3, 9}}, {true}, 0, {0}, {{0}}, b_narrow_slices, NULL},
    {"silu", 1, {2}, {{3, 7}}, {true}, 0, {0}, {{0}}, b_silu, NULL},
    {"layernorm", 1, {2}, {{3, 8}}, {true}, 2, {1, 1}, {{8}, {8}}, b_layernorm, NULL},
    {"layernorm_no_bias", 1, {2}, {{3, 8}}, {true}, 1, {1}, {{8}}, b_layernorm_no_bias, NULL},
    {"mse_loss", 1, {2}, {{3, 5}}, {true}, 0, {0}, {{0}}, b_mse, NULL},
    {"cross_entropy",
     2,
     {2, 1},
     {{6, 9}, {6}},
     {true, false},
     0,
     {0},
     {{0}},
     b_cross_entropy,
     fill_targets},
};

START_TEST(backward_matches_finite_differences) { run_case(&cases[_i]); }
END_TEST

/* Activation values against values computed independently (Python's math.erf, exp and tanh):
 * the exact GELU x/2 (1 + erf(x / sqrt 2)) as PyTorch's default, SiLU, ReLU, GELU's tanh form
 * (PyTorch's approximate="tanh" gives the same values); and both GELUs' derivatives through
 * the backward kernel. */
START_TEST(activations_match_reference_values) {
  static const double xs[7] = {-3.0, -1.5, -0.5, 0.0, 0.25, 1.0, 2.5};
  static const double gelu[7] = {-0.00404969409489031, -0.10021080190328713,
                                 -0.15426876936299344, 0.0, 0.14967658142073093,
                                 0.8413447460685429,   2.4844758366855597};
  static const double silu[7] = {-0.14227761953270035, -0.2736382857095345, -0.1887703343990727,
                                 0.0, 0.14054412522144952, 0.7310585786300049,
                                 2.3103545499468914};
  static const double dgelu[7] = {-0.011945647204183918, -0.12746919222997954,
                                  0.13250487534383712,   0.5,
                                  0.695373354883636,     1.0833154705876864,
                                  1.037611085908145};
  static const double gelu_tanh[7] = {
      -0.0036373920817729943, -0.10042842301976707, -0.15428599017485606, 0.0,
      0.149675350701685,      0.8411919906082768,   2.484915733910001};
  static const double dgelu_tanh[7] = {
      -0.011584166630969516, -0.1277107931514331, 0.13263009646535764, 0.5,
      0.6953540951510604,    1.0829640838457826,  1.037951576212666};
  static const double sigmoid[7] = {
      0.04742587317756678, 0.18242552380635635, 0.3775406687981454, 0.5,
      0.5621765008857981,  0.7310585786300049,  0.9241418199787566};
  static const double dsigmoid[7] = {
      0.04517665973091214, 0.14914645207033286, 0.2350037122015945, 0.25,
      0.24613408273759835, 0.19661193324148185, 0.07010371654510807};
  int64_t n = 7;
  fsdpc_tensor_t x, y, one, d;
  ok(tensor_init(&x, DTYPE_F32, device_cpu(), 1, &n));
  ok(tensor_init(&y, DTYPE_F32, device_cpu(), 1, &n));
  ok(tensor_init(&d, DTYPE_F32, device_cpu(), 1, &n));
  ok(tensor_init(&one, DTYPE_F32, device_cpu(), 1, &n));
  ok(tensor_fill(&one, 1.0));
  for (int i = 0; i < 7; i++) ((float *)x.data)[i] = (float)xs[i];
  const double *want[KERNEL_ACT_COUNT] = {NULL, gelu, silu, gelu_tanh, sigmoid};
  for (int a = 0; a < KERNEL_ACT_COUNT; a++) {
    ok(kernel_activation(&y, &x, (kernel_act_t)a));
    for (int i = 0; i < 7; i++) {
      double w = a == KERNEL_ACT_RELU ? (xs[i] > 0 ? xs[i] : 0) : want[a][i];
      ck_assert_msg(fabs(((float *)y.data)[i] - w) <= 1e-6 * (1 + fabs(w)), "act %d at %g: %.9g, want %.9g",
                    a, xs[i], ((float *)y.data)[i], w);
    }
  }
  ok(kernel_activation_backward(&d, &one, &x, KERNEL_ACT_GELU));
  for (int i = 0; i < 7; i++)
    ck_assert_msg(fabs(((float *)d.data)[i] - dgelu[i]) <= 1e-6, "gelu'(%g): %.9g, want %.9g",
                  xs[i], ((float *)d.data)[i], dgelu[i]);
  ok(kernel_activation_backward(&d, &one, &x, KERNEL_ACT_GELU_TANH));
  for (int i = 0; i < 7; i++)
    ck_assert_msg(fabs(((float *)d.data)[i] - dgelu_tanh[i]) <= 1e-6,
                  "gelu_tanh'(%g): %.9g, want %.9g", xs[i], ((float *)d.data)[i], dgelu_tanh[i]);
  ok(kernel_activation_backward(&d, &one, &x, KERNEL_ACT_SIGMOID));
  for (int i = 0; i < 7; i++)
    ck_assert_msg(fabs(((float *)d.data)[i] - dsigmoid[i]) <= 1e-6, "sigmoid'(%g): %.9g, want %.9g",
                  xs[i], ((float *)d.data)[i], dsigmoid[i]);
  ok(kernel_activation_backward(&d, &one, &x, KERNEL_ACT_RELU));
  ck_assert(((float *)d.data)[3] == 0.0f && ((float *)d.data)[5] == 1.0f); /* relu'(0) = 0 */
  tensor_free(&x);
  tensor_free(&y);
  tensor_free(&d);
  tensor_free(&one);
}
END_TEST

/* LayerNorm's forward against a double-precision reference of PyTorch's formula (biased
 * variance, eps inside the root), with and without bias; MSE against its definition. */
START_TEST(layernorm_and_mse_match_reference) {
  int64_t shape[2] = {3, 10}, D = 10, rows = 3;
  fsdpc_tensor_t x, w, b, y, mean, rstd;
  test_rng_t rng = {77};
  ok(tensor_init(&x, DTYPE_F32, device_cpu(), 2, shape));
  ok(tensor_init(&w, DTYPE_F32, device_cpu(), 1, &D));
  ok(tensor_init(&b, DTYPE_F32, device_cpu(), 1, &D));
  ok(tensor_init(&y, DTYPE_F32, device_cpu(), 2, shape));
  ok(tensor_init(&mean, DTYPE_F32, device_cpu(), 1, &rows));
  ok(tensor_init(&rstd, DTYPE_F32, device_cpu(), 1, &rows));
  test_fill_uniform(&x, &rng, 3.0);
  test_fill_uniform(&w, &rng, 1.0);
  test_fill_uniform(&b, &rng, 1.0);
  const float *X = x.data, *W = w.data, *B = b.data;
  for (int with_bias = 0; with_bias < 2; with_bias++) {
    ok(kernel_layernorm(&y, &mean, &rstd, &x, &w, with_bias ? &b : NULL, 1e-5f));
    for (int r = 0; r < 3; r++) {
      double mu = 0, var = 0;
      for (int j = 0; j < D; j++) mu += X[r * D + j] / (double)D;
      for (int j = 0; j < D; j++) var += (X[r * D + j] - mu) * (X[r * D + j] - mu) / (double)D;
      for (int j = 0; j < D; j++) {
        double want = (X[r * D + j] - mu) / sqrt(var + 1e-5) * W[j] + (with_bias ? B[j] : 0);
        double got = ((float *)y.data)[r * D + j];
        ck_assert_msg(fabs(got - want) <= 1e-5 * (1 + fabs(want)), "layernorm [%d,%d]: %.8g, want %.8g",
                      r, j, got, want);
      }
    }
  }
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  nn_var_t *p, *loss;
  fsdpc_tensor_t px, target;
  ok(tensor_clone(&px, &x, DTYPE_F32, device_cpu()));
  ok(tensor_clone(&target, &y, DTYPE_F32, device_cpu()));
  ok(nn_var_new(&px, true, &p));
  ok(nn_mse_loss(ctx, p, &target, &loss));
  double want = 0, got;
  for (int i = 0; i < 30; i++) {
    double e = X[i] - ((float *)target.data)[i];
    want += e * e / 30.0;
  }
  ok(nn_var_scalar(loss, &got));
  ck_assert_msg(fabs(got - want) <= 1e-6 * want, "mse %.9g, want %.9g", got, want);
  nn_var_put(loss);
  nn_var_put(p);
  nn_ctx_free(ctx);
  fsdpc_tensor_t *ts[] = {&x, &w, &b, &y, &mean, &rstd, &target};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) tensor_free(ts[i]);
}
END_TEST

/* The tape records module calls and drops everything after backward. */
START_TEST(no_grad_records_nothing) {
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  nn_ctx_set_grad_enabled(ctx, false);
  int64_t shape[2] = {2, 3};
  fsdpc_tensor_t t;
  ok(tensor_zeros(&t, DTYPE_F32, device_cpu(), 2, shape));
  nn_var_t *x, *y;
  ok(nn_var_new(&t, true, &x));
  ok(nn_add(ctx, x, x, &y));
  ck_assert_int_eq(nn_ctx_tape_length(ctx), 0);
  ck_assert(!y->requires_grad);
  nn_var_put(y);
  nn_var_put(x);
  nn_ctx_free(ctx);
}
END_TEST

/* Causal grouped-query attention in double precision, straight from the definition:
 * forward out and lse, and the gradients of sum(r * out). */
static void attention_reference(const float *q, const float *k, const float *v, const float *r,
                                int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t Dh,
                                double *out, double *lse, double *dq, double *dk, double *dv) {
  int64_t rep = H / Hkv;
  double scale = 1.0 / sqrt((double)Dh), *p = malloc(sizeof(double) * (size_t)T);
  memset(dq, 0, sizeof(double) * (size_t)(B * T * H * Dh));
  memset(dk, 0, sizeof(double) * (size_t)(B * T * Hkv * Dh));
  memset(dv, 0, sizeof(double) * (size_t)(B * T * Hkv * Dh));
#define QI(b, t, h) ((((b) * T + (t)) * H + (h)) * Dh)
#define KI(b, t, g) ((((b) * T + (t)) * Hkv + (g)) * Dh)
  for (int64_t b = 0; b < B; b++)
    for (int64_t h = 0; h < H; h++)
      for (int64_t i = 0; i < T; i++) {
        int64_t g = h / rep;
        double m = -INFINITY, l = 0;
        for (int64_t j = 0; j <= i; j++) {
          double sc = 0;
          for (int64_t c = 0; c < Dh; c++) sc += (double)q[QI(b, i, h) + c] * k[KI(b, j, g) + c];
          p[j] = sc * scale;
          m = p[j] > m ? p[j] : m;
        }
        for (int64_t j = 0; j <= i; j++) l += exp(p[j] - m);
        lse[(b * H + h) * T + i] = m + log(l);
        for (int64_t j = 0; j <= i; j++) p[j] = exp(p[j] - m) / l;
        double D = 0; /* sum_c r * out = sum_j p_j dp_j */
        for (int64_t c = 0; c < Dh; c++) {
          double o = 0;
          for (int64_t j = 0; j <= i; j++) o += p[j] * v[KI(b, j, g) + c];
          out[QI(b, i, h) + c] = o;
          D += o * r[QI(b, i, h) + c];
        }
        for (int64_t j = 0; j <= i; j++) {
          double dp = 0;
          for (int64_t c = 0; c < Dh; c++) dp += (double)r[QI(b, i, h) + c] * v[KI(b, j, g) + c];
          double ds = p[j] * (dp - D) * scale;
          for (int64_t c = 0; c < Dh; c++) {
            dq[QI(b, i, h) + c] += ds * k[KI(b, j, g) + c];
            dk[KI(b, j, g) + c] += ds * q[QI(b, i, h) + c];
            dv[KI(b, j, g) + c] += p[j] * r[QI(b, i, h) + c];
          }
        }
      }
#undef QI
#undef KI
  free(p);
}

static double rel_err(const fsdpc_tensor_t *t, const double *ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < tensor_numel(t); i++) {
    double x = ((const float *)t->data)[i] - ref[i];
    num += x * x;
    den += ref[i] * ref[i];
  }
  return sqrt(num / (den > 0 ? den : 1));
}

/* The attention kernels against the definition at sequence lengths around their row-block
 * size (one partial block, exact blocks, blocks plus a remainder) with grouped-query heads. */
START_TEST(attention_matches_definition) {
  const int64_t Ts[] = {1, 5, 128, 300}, B = 2, H = 4, Hkv = 2, Dh = 8;
  for (size_t t = 0; t < sizeof Ts / sizeof Ts[0]; t++) {
    int64_t T = Ts[t], sq[4] = {B, T, H, Dh}, sk[4] = {B, T, Hkv, Dh}, sl[3] = {B, H, T};
    fsdpc_tensor_t q, k, v, r, out, lse, dq, dk, dv;
    fsdpc_tensor_t *all[] = {&q, &k, &v, &r, &out, &lse, &dq, &dk, &dv};
    ok(tensor_init(&q, DTYPE_F32, device_cpu(), 4, sq));
    ok(tensor_init(&k, DTYPE_F32, device_cpu(), 4, sk));
    ok(tensor_init(&v, DTYPE_F32, device_cpu(), 4, sk));
    ok(tensor_init(&r, DTYPE_F32, device_cpu(), 4, sq));
    ok(tensor_init(&out, DTYPE_F32, device_cpu(), 4, sq));
    ok(tensor_init(&lse, DTYPE_F32, device_cpu(), 3, sl));
    ok(tensor_init(&dq, DTYPE_F32, device_cpu(), 4, sq));
    ok(tensor_init(&dk, DTYPE_F32, device_cpu(), 4, sk));
    ok(tensor_init(&dv, DTYPE_F32, device_cpu(), 4, sk));
    uint64_t x = 88172645463325252ull + (uint64_t)T;
    for (int i = 0; i < 4; i++)
      for (int64_t e = 0; e < tensor_numel(all[i]); e++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        ((float *)all[i]->data)[e] = (float)((double)(x >> 11) / 9007199254740992.0 * 4 - 2);
      }
    ok(kernel_attention(&out, &lse, &q, &k, &v));
    ok(kernel_attention_backward(&dq, &dk, &dv, &r, &q, &k, &v, &out, &lse));
    size_t nq = (size_t)tensor_numel(&q), nk = (size_t)tensor_numel(&k);
    double *ro = malloc(sizeof(double) * nq), *rl = malloc(sizeof(double) * (size_t)(B * H * T)),
           *rq = malloc(sizeof(double) * nq), *rk = malloc(sizeof(double) * nk),
           *rv = malloc(sizeof(double) * nk);
    attention_reference(q.data, k.data, v.data, r.data, B, T, H, Hkv, Dh, ro, rl, rq, rk, rv);
    const struct {
      const char *name;
      const fsdpc_tensor_t *t;
      const double *ref;
    } cmp[] = {{"out", &out, ro}, {"lse", &lse, rl}, {"dq", &dq, rq}, {"dk", &dk, rk},
               {"dv", &dv, rv}};
    for (size_t c = 0; c < sizeof cmp / sizeof cmp[0]; c++) {
      double e = rel_err(cmp[c].t, cmp[c].ref);
      ck_assert_msg(e < 2e-6, "T %lld %s: relative L2 error %.3g", (long long)T, cmp[c].name, e);
    }
    free(ro), free(rl), free(rq), free(rk), free(rv);
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
  }
}
END_TEST

/* RoPE's definition, element for element and bit for bit, over calls that change the rope,
 * the positions and the direction (the kernel keeps the last call's cos/sin table). */
START_TEST(rope_matches_definition_across_calls) {
  const rope_t plain = {1e4, ROPE_DEFAULT, 1, 0, 0, 0}, plain5 = {5e5, ROPE_DEFAULT, 1, 0, 0, 0},
               llama3 = {5e5, ROPE_LLAMA3, 8, 1, 4, 64};
  const struct {
    const rope_t *rope;
    int64_t p0;
    bool inverse;
  } calls[] = {{&plain, 0, false}, {&plain5, 0, false}, {&llama3, 0, false}, {&plain, 0, true},
               {&plain, 7, false}, {&plain, 7, false},  {&llama3, 7, true},  {&plain, 0, false}};
  int64_t B = 2, T = 5, H = 3, Dh = 8, shape[4] = {B, T, H, Dh}, half = Dh / 2;
  fsdpc_tensor_t x, y;
  ok(tensor_init(&x, DTYPE_F32, device_cpu(), 4, shape));
  ok(tensor_init(&y, DTYPE_F32, device_cpu(), 4, shape));
  float *xd = x.data;
  for (int64_t e = 0; e < tensor_numel(&x); e++) xd[e] = (float)((e * 37 % 101) - 50) / 16.0f;
  for (size_t c = 0; c < sizeof calls / sizeof calls[0]; c++) {
    ok(kernel_rope(&y, &x, calls[c].rope, calls[c].p0, calls[c].inverse));
    const float *yd = y.data;
    for (int64_t t = 0; t < T; t++)
      for (int64_t i = 0; i < half; i++) {
        double ang = (double)(t + calls[c].p0) * rope_inv_freq(calls[c].rope, i, Dh);
        float co = (float)cos(ang), si = calls[c].inverse ? -(float)sin(ang) : (float)sin(ang);
        for (int64_t bh = 0; bh < B * H; bh++) {
          int64_t base = ((bh / H * T + t) * H + bh % H) * Dh;
          float x1 = xd[base + i], x2 = xd[base + i + half];
          ck_assert_msg(
              yd[base + i] == x1 * co - x2 * si && yd[base + i + half] == x2 * co + x1 * si,
              "call %zu, position %lld, pair %lld: not the definition", c, (long long)t,
              (long long)i);
        }
      }
  }
  tensor_free(&x);
  tensor_free(&y);
}
END_TEST

/* The consuming cross-entropy: the same loss and gradient bits as nn_cross_entropy, the
 * gradient written over the logits (no logits-sized buffer during its backward), no value
 * left in the logits afterwards. */
START_TEST(cross_entropy_consume_reuses_the_logits) {
  int64_t N = 6, V = 1000, shape[2] = {N, V};
  fsdpc_tensor_t t, host_t;
  ok(tensor_init(&host_t, DTYPE_I64, device_cpu(), 1, &N));
  for (int64_t r = 0; r < N; r++) ((int64_t *)host_t.data)[r] = r == 2 ? -100 : r * 137 % V;
  ok(tensor_clone(&t, &host_t, DTYPE_I64, device_cpu()));
  nn_var_t *logits[2], *loss[2];
  size_t grew[2];
  for (int c = 0; c < 2; c++) {
    fsdpc_tensor_t x;
    ok(tensor_init(&x, DTYPE_F32, device_cpu(), 2, shape));
    for (int64_t e = 0; e < N * V; e++) ((float *)x.data)[e] = (float)((e * 7919) % 613) / 97.0f;
    ok(nn_var_new(&x, true, &logits[c]));
    nn_ctx_t *ctx;
    ok(nn_ctx_new(&ctx));
    ok(c ? nn_cross_entropy_consume(ctx, logits[c], &t, &loss[c], NULL)
         : nn_cross_entropy(ctx, logits[c], &t, &loss[c], NULL));
    size_t before = mem_stats(device_cpu()).current;
    mem_reset_peak(device_cpu());
    ok(nn_backward(ctx, loss[c]));
    grew[c] = mem_stats(device_cpu()).peak - before;
    nn_ctx_free(ctx);
  }
  size_t bytes = (size_t)(N * V) * sizeof(float);
  ck_assert_msg(grew[0] >= bytes && grew[1] < bytes / 4,
                "backward allocated %zu B, consuming %zu B, logits %zu B", grew[0], grew[1], bytes);
  bool same;
  ok(tensor_equal(&loss[0]->value, &loss[1]->value, &same));
  ck_assert_msg(same, "the losses differ");
  ok(tensor_equal(&logits[0]->grad, &logits[1]->grad, &same));
  ck_assert_msg(same, "the gradients differ");
  ck_assert_msg(logits[0]->value.storage != NULL && logits[1]->value.storage == NULL,
                "the consumed logits still hold a value, or the others lost theirs");
  for (int c = 0; c < 2; c++) nn_var_put(loss[c]), nn_var_put(logits[c]);
  tensor_free(&t);
  tensor_free(&host_t);
}
END_TEST

/* out = alpha op(a) op(b) + beta out in double, row-major, from the values before. */
static void product_by_definition(const float *a, bool ta, const float *b, bool tb, float *out,
                                  int64_t M, int64_t N, int64_t K, float alpha, float beta) {
  for (int64_t i = 0; i < M; i++)
    for (int64_t j = 0; j < N; j++) {
      double s = 0;
      for (int64_t k = 0; k < K; k++)
        s += (double)(ta ? a[k * M + i] : a[i * K + k]) * (tb ? b[j * K + k] : b[k * N + j]);
      out[i * N + j] = (float)(alpha * s + beta * out[i * N + j]);
    }
}

/* kernel_matmul_many: each product as its definition (one without rows among them), with a
 * transposed b, alpha and beta; and its refusals, each naming the product or the overlap. */
START_TEST(matmul_many_matches_definition_and_refuses_overlaps) {
  enum { P = 3 };
  const int64_t M[P] = {5, 0, 3}, N = 4, K = 6;
  fsdpc_tensor_t a[P], b[P], c[P];
  float want[P][20];
  kernel_product_t p[P];
  test_rng_t r = {7};
  for (int i = 0; i < P; i++) {
    ok(tensor_init(&a[i], DTYPE_F32, device_cpu(), 2, (int64_t[]){M[i], K}));
    ok(tensor_init(&b[i], DTYPE_F32, device_cpu(), 2, (int64_t[]){N, K})); /* b^T is [K, N] */
    ok(tensor_init(&c[i], DTYPE_F32, device_cpu(), 2, (int64_t[]){M[i], N}));
    test_fill_uniform(&a[i], &r, 1);
    test_fill_uniform(&b[i], &r, 1);
    test_fill_uniform(&c[i], &r, 1);
    if (M[i] > 0) memcpy(want[i], c[i].data, tensor_nbytes(&c[i]));
    product_by_definition(a[i].data, false, b[i].data, true, want[i], M[i], N, K, 0.5f, 2.0f);
    p[i] = (kernel_product_t){&c[i], &a[i], &b[i]};
  }
  ok(kernel_matmul_many(p, P, false, true, 0.5f, 2.0f));
  for (int i = 0; i < P; i++)
    for (int64_t e = 0; e < M[i] * N; e++)
      ck_assert_msg(fabsf(((float *)c[i].data)[e] - want[i][e]) <= 1e-5f * (1 + fabsf(want[i][e])),
                    "product %d element %lld: %g, by definition %g", i, (long long)e,
                    ((float *)c[i].data)[e], want[i][e]);
  ok(kernel_matmul_many(p, 0, false, true, 1.0f, 0.0f)); /* none */
  /* refusals */
  ck_assert_int_eq(kernel_matmul_many(NULL, 1, false, true, 1.0f, 0.0f), STATUS_EINVAL);
  ck_assert_int_eq(kernel_matmul_many(p, -1, false, true, 1.0f, 0.0f), STATUS_EINVAL);
  ck_assert_int_eq(kernel_matmul_many(p, P, false, false, 1.0f, 0.0f), STATUS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err_detail(), "product 0 of 3"));
  kernel_product_t twice[2] = {p[0], p[0]};
  ck_assert_int_eq(kernel_matmul_many(twice, 2, false, true, 1.0f, 0.0f), STATUS_EINVAL);
  ck_assert_ptr_nonnull(strstr(err_detail(), "outputs of products 0 and 1 overlap"));
  fsdpc_tensor_t cv; /* product 1 reads the output of product 0 through a view */
  ok(tensor_view(&cv, &c[0], 2, (int64_t[]){4, 5}));
  fsdpc_tensor_t a2;
  ok(tensor_init(&a2, DTYPE_F32, device_cpu(), 2, (int64_t[]){3, 5}));
  kernel_product_t reads[2] = {p[0], {&c[2], &a2, &cv}}; /* [3, 5] @ [4, 5]^T */
  ck_assert_int_eq(kernel_matmul_many(reads, 2, false, true, 1.0f, 0.0f), STATUS_EINVAL);
  ck_assert_ptr_nonnull(strstr(err_detail(), "product 1's b overlaps the output of product 0"));
  /* among five outputs (rows of one tensor, given out of order), an operand that meets the
   * last of them in memory, and a product that reads its own output */
  fsdpc_tensor_t big, rows5[5], in5, w4;
  ok(tensor_zeros(&big, DTYPE_F32, device_cpu(), 2, (int64_t[]){10, 4}));
  ok(tensor_zeros(&in5, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 6}));
  ok(tensor_zeros(&w4, DTYPE_F32, device_cpu(), 2, (int64_t[]){4, 4}));
  kernel_product_t six[6];
  for (int i = 0; i < 5; i++) {
    ok(tensor_narrow(&rows5[i], &big, 0, 2 * ((i * 3) % 5), 2)); /* rows 0, 6, 2, 8, 4 */
    six[i] = (kernel_product_t){&rows5[i], &in5, &b[0]};         /* [2, 6] @ [4, 6]^T */
  }
  ok(kernel_matmul_many(six, 5, false, true, 1.0f, 0.0f)); /* apart: taken */
  fsdpc_tensor_t row5, a1, out2;
  ok(tensor_narrow(&row5, &big, 0, 5, 1)); /* the second row of product 4's output */
  ok(tensor_zeros(&a1, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 4}));
  ok(tensor_zeros(&out2, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 1}));
  six[5] = (kernel_product_t){&out2, &a1, &row5}; /* [2, 4] @ [1, 4]^T */
  ck_assert_int_eq(kernel_matmul_many(six, 6, false, true, 1.0f, 0.0f), STATUS_EINVAL);
  ck_assert_ptr_nonnull(strstr(err_detail(), "product 5's b overlaps the output of product 4"));
  fsdpc_tensor_t first;
  ok(tensor_narrow(&first, &big, 0, 0, 2)); /* product 0's output, read as its own a */
  kernel_product_t self = {&rows5[0], &first, &w4};
  ck_assert_int_eq(kernel_matmul_many(&self, 1, false, true, 1.0f, 0.0f), STATUS_EINVAL);
  ck_assert_ptr_nonnull(strstr(err_detail(), "product 0's a overlaps the output of product 0"));
  for (int i = 0; i < 5; i++) tensor_free(&rows5[i]);
  fsdpc_tensor_t *more[] = {&big, &in5, &w4, &row5, &a1, &out2, &first};
  for (size_t i = 0; i < sizeof more / sizeof more[0]; i++) tensor_free(more[i]);
  fsdpc_tensor_t h;
  ok(tensor_init(&h, DTYPE_BF16, device_cpu(), 2, (int64_t[]){3, 4}));
  kernel_product_t mixed[2] = {p[0], {&h, &a[2], &b[2]}};
  ck_assert_int_eq(kernel_matmul_many(mixed, 2, false, true, 1.0f, 0.0f), STATUS_EDTYPE);
  ck_assert_ptr_nonnull(strstr(err_detail(), "product 1 of 2"));
  kernel_product_t none[1] = {{NULL, &a[0], &b[0]}};
  ck_assert_int_eq(kernel_matmul_many(none, 1, false, true, 1.0f, 0.0f), STATUS_EINVAL);
  tensor_free(&h);
  tensor_free(&a2);
  tensor_free(&cv);
  for (int i = 0; i < P; i++) {
    tensor_free(&a[i]);
    tensor_free(&b[i]);
    tensor_free(&c[i]);
  }
}
END_TEST

/* The mean loss on the device: kernel_masked_mean against a sum in f64 over the kept rows
 * (NaN and a zero count when none is kept), and its gradient with the scale read from the
 * tensors: the same bits as the kernel given dloss / count on the host. */
START_TEST(masked_mean_and_its_gradient_match_host_values) {
  int64_t N = 5, V = 7, one = 1, shape[2] = {N, V};
  fsdpc_tensor_t vals, tg, mean, count, logits, dloss, d_host, d_dev;
  ok(tensor_init(&vals, DTYPE_F32, device_cpu(), 1, &N));
  ok(tensor_init(&tg, DTYPE_I64, device_cpu(), 1, &N));
  const float v[5] = {0.5f, 1.25f, 3.0f, 0.1f, 2.2f};
  const int64_t t[5] = {1, -100, 6, 0, -1};
  memcpy(vals.data, v, sizeof v);
  memcpy(tg.data, t, sizeof t);
  ok(tensor_init(&mean, DTYPE_F32, device_cpu(), 0, &one));
  ok(tensor_init(&count, DTYPE_I64, device_cpu(), 1, &one));
  ok(kernel_masked_mean(&mean, &count, &vals, &tg));
  const float *m = mean.data;
  const int64_t *c = count.data;
  ck_assert_float_eq(m[0], (float)(((double)0.5f + (double)3.0f + (double)0.1f) / 3.0));
  ck_assert_int_eq(c[0], 3);
  ok(tensor_init(&logits, DTYPE_F32, device_cpu(), 2, shape));
  for (int64_t e = 0; e < N * V; e++) ((float *)logits.data)[e] = (float)((e * 31) % 11) / 5.0f;
  ok(tensor_init(&dloss, DTYPE_F32, device_cpu(), 1, &one));
  *(float *)dloss.data = 0.3f;
  ok(tensor_init(&d_host, DTYPE_F32, device_cpu(), 2, shape));
  ok(tensor_init(&d_dev, DTYPE_F32, device_cpu(), 2, shape));
  ok(kernel_cross_entropy_backward(&d_host, &logits, &tg, (float)((double)0.3f / 3.0)));
  ok(kernel_cross_entropy_backward_mean(&d_dev, &logits, &tg, &dloss, &count));
  bool same;
  ok(tensor_equal(&d_host, &d_dev, &same));
  ck_assert_msg(same, "the gradient with the scale read from the tensors differs");
  for (int64_t i = 0; i < N; i++) ((int64_t *)tg.data)[i] = -100;
  ok(kernel_masked_mean(&mean, &count, &vals, &tg));
  ck_assert(isnan(m[0]) && c[0] == 0);
  int64_t three = 3;
  fsdpc_tensor_t bad;
  ok(tensor_init(&bad, DTYPE_F32, device_cpu(), 1, &three));
  ck_assert_int_eq(kernel_masked_mean(&bad, &count, &vals, &tg), STATUS_ESHAPE);
  ck_assert_int_eq(kernel_masked_mean(&mean, &mean, &vals, &tg), STATUS_EDTYPE);
  tensor_free(&bad);
  tensor_free(&count);
  tensor_free(&d_dev);
  tensor_free(&d_host);
  tensor_free(&dloss);
  tensor_free(&logits);
  tensor_free(&mean);
  tensor_free(&tg);
  tensor_free(&vals);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("ops");
  TCase *tc = tcase_create("finite_differences");
  tcase_add_loop_test(tc, backward_matches_finite_differences, 0,
                      (int)(sizeof cases / sizeof cases[0]));
  tcase_add_test(tc, no_grad_records_nothing);
  tcase_add_test(tc, attention_matches_definition);
  tcase_add_test(tc, activations_match_reference_values);
  tcase_add_test(tc, layernorm_and_mse_match_reference);
  tcase_add_test(tc, rope_matches_definition_across_calls);
  tcase_add_test(tc, cross_entropy_consume_reuses_the_logits);
  tcase_add_test(tc, masked_mean_and_its_gradient_match_host_values);
  tcase_add_test(tc, matmul_many_matches_definition_and_refuses_overlaps);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
