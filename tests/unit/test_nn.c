/*
 * The module layer around the model: module tree and FQNs, hook order with a module called
 * twice and a shared parameter, plan-independent init (also on sharded meshes when run under
 * mpirun), Hugging Face config parsing, deferred models and the layers (the optimizer:
 * test_optim.c; the data order: test_data.c).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nn/init.h"
#include "nn/layers.h"
#include "models/llama/llama.h"
#include "nn/ops.h"
#include "tests/harness.h"

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

/* ---- hooks ---- */

static char hook_log[512];

static fsdpc_status_t log_hook(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind, void *user) {
  (void)ctx, (void)user;
  static const char *tag[] = {"F<", "F>", "B<", "B>"};
  size_t n = strlen(hook_log);
  snprintf(hook_log + n, sizeof hook_log - n, "%s%s ", tag[kind],
           nn_module_name(m)[0] ? nn_module_name(m) : "root");
  return STATUS_OK;
}

static fsdpc_status_t lin_fwd(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  return nn_linear(ctx, in, nn_module_param(m, 0), out);
}

/* root: a(a(x)) then b(x') where b shares a's weight */
static fsdpc_status_t root_fwd(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *h1, *h2;
  FSDPC_TRY(nn_call(ctx, nn_module_child_named(m, "a"), in, &h1));
  fsdpc_status_t st = nn_call(ctx, nn_module_child_named(m, "a"), h1, &h2);
  nn_var_put(h1);
  FSDPC_TRY(st);
  st = nn_call(ctx, nn_module_child_named(m, "b"), h2, out);
  nn_var_put(h2);
  return st;
}

static nn_module_t *tiny_tree(mesh_t *mesh) {
  nn_module_t *root, *a, *b;
  ok(nn_module_new("", root_fwd, NULL, &root));
  ok(nn_module_new("a", lin_fwd, NULL, &a));
  ok(nn_module_new("b", lin_fwd, NULL, &b));
  ok(nn_module_add_child(root, a));
  ok(nn_module_add_child(root, b));
  nn_param_t *w;
  int64_t shape[2] = {3, 3};
  ok(nn_module_add_param(a, "weight", test_replicated(mesh, 2, shape, 0.5), true, &w));
  ok(nn_module_share_param(b, w));
  ok(nn_module_finalize(root));
  nn_module_t *ms[] = {root, a, b};
  for (int i = 0; i < 3; i++)
    for (int k = 0; k < NN_HOOK_COUNT; k++) ok(nn_module_add_hook(ms[i], k, log_hook, NULL));
  return root;
}

START_TEST(module_fqns_and_shared_parameters) {
  mesh_t *mesh = test_local_mesh();
  nn_module_t *root = tiny_tree(mesh);
  nn_param_t **ps;
  int n;
  ok(nn_named_parameters(root, &ps, &n));
  ck_assert_int_eq(n, 1); /* the shared weight appears once, at its owner */
  ck_assert_str_eq(ps[0]->fqn, "a.weight");
  ck_assert_ptr_eq(nn_param_find(root, "a.weight"), ps[0]);
  ck_assert_ptr_null(nn_param_find(root, "b.weight"));
  ck_assert_ptr_eq(nn_module_param_named(nn_module_find(root, "b"), "weight"), ps[0]);
  ck_assert_str_eq(nn_module_fqn(nn_module_find(root, "b")), "b");
  nn_module_t *dup;
  ok(nn_module_new("a", NULL, NULL, &dup));
  ck_assert_int_eq(nn_module_add_child(root, dup), STATUS_EINVAL);
  nn_module_free(dup);
  ck_assert_int_eq(nn_module_new("x.y", NULL, NULL, &dup), STATUS_EINVAL);
  /* a tree, never a cycle: a module is no child of itself nor of one under it */
  nn_module_t *c, *d;
  ok(nn_module_new("c", NULL, NULL, &c));
  ok(nn_module_new("d", NULL, NULL, &d));
  ok(nn_module_add_child(c, d));
  ck_assert_int_eq(nn_module_add_child(d, c), STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "no cycles") != NULL);
  ck_assert_int_eq(nn_module_add_child(d, d), STATUS_EINVAL);
  /* another tree's parameter is not shared: refused by the share (both finalised) or the
   * finalise */
  ok(nn_module_finalize(c));
  ck_assert_int_eq(nn_module_share_param(d, ps[0]), STATUS_EINVAL);
  nn_module_t *e;
  ok(nn_module_new("e", NULL, NULL, &e));
  ok(nn_module_share_param(e, ps[0]));
  ck_assert_int_eq(nn_module_finalize(e), STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "outside its tree") != NULL);
  nn_module_free(e);
  nn_module_free(c);
  free(ps);
  nn_module_free(root);
  mesh_free(mesh);
}
END_TEST

START_TEST(hooks_fire_in_call_order) {
  mesh_t *mesh = test_local_mesh();
  nn_module_t *root = tiny_tree(mesh);
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  int64_t shape[2] = {2, 3};
  fsdpc_tensor_t t;
  ok(tensor_init(&t, DTYPE_F32, device_cpu(), 2, shape));
  ok(tensor_fill(&t, 1.0));
  nn_var_t *x, *y;
  ok(nn_var_new(&t, false, &x));
  hook_log[0] = '\0';
  ok(nn_call(ctx, root, x, &y));
  ck_assert_str_eq(hook_log, "F<root F<a F>a F<a F>a F<b F>b F>root ");
  hook_log[0] = '\0';
  fsdpc_tensor_t g;
  ok(tensor_init(&g, DTYPE_F32, device_cpu(), 2, shape));
  ok(tensor_fill(&g, 1.0));
  ok(nn_backward_grad(ctx, y, &g));
  ck_assert_str_eq(hook_log, "B<root B<b B>b B<a B>a B<a B>a B>root ");
  /* y = W W W x with W = 0.5 everywhere (3x3), x = 1, dy = 1: every call contributes */
  nn_param_t *w = nn_param_find(root, "a.weight");
  const float *gw = dtensor_local(w->grad)->data;
  /* h1 = 1.5, h2 = 2.25 per element; dW = sum over uses of dy_k^T x_k:
   * b: dy=1, x=h2 -> 2*2.25 = 4.5; second a: dy=1.5, x=h1 -> 2*1.5*1.5 = 4.5;
   * first a: dy=2.25, x=1 -> 2*2.25 = 4.5; total 13.5 */
  for (int i = 0; i < 9; i++) ck_assert_float_eq_tol(gw[i], 13.5f, 1e-5f);
  /* a child called on its own (outside its parent's forward) */
  hook_log[0] = '\0';
  nn_var_t *z;
  ok(nn_call(ctx, nn_module_find(root, "a"), x, &z));
  ck_assert_str_eq(hook_log, "F<a F>a ");
  nn_ctx_clear(ctx);
  nn_var_put(z);
  nn_var_put(y);
  nn_var_put(x);
  nn_ctx_free(ctx);
  nn_module_free(root);
  mesh_free(mesh);
}
END_TEST

/* root: a(x) + x, so that x's gradient is formed (by the add, shared with a's output's) before
 * a's backward adds its share: under activation checkpointing too. */
static fsdpc_status_t residual_fwd(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *h;
  FSDPC_TRY(nn_call(ctx, nn_module_child_named(m, "a"), in, &h));
  fsdpc_status_t st = nn_add(ctx, h, in, out);
  nn_var_put(h);
  return st;
}

/* x's and W's gradients of y = x W^T + x with dy = 1 (x = 1..6 as 2 x 3, W = 0.5): dx = 2.5
 * everywhere, dW[i][j] = x[0][j] + x[1][j]; the same bits with a checkpointed. */
START_TEST(checkpointed_input_used_after) {
  mesh_t *mesh = test_local_mesh();
  float got[2][6 + 9];
  for (int ac = 0; ac < 2; ac++) {
    nn_module_t *root, *a;
    ok(nn_module_new("", residual_fwd, NULL, &root));
    ok(nn_module_new("a", lin_fwd, NULL, &a));
    ok(nn_module_add_child(root, a));
    nn_param_t *w;
    int64_t wshape[2] = {3, 3}, shape[2] = {2, 3};
    ok(nn_module_add_param(a, "weight", test_replicated(mesh, 2, wshape, 0.5), true, &w));
    ok(nn_module_finalize(root));
    nn_module_set_checkpoint(a, ac == 1);
    nn_ctx_t *ctx;
    ok(nn_ctx_new(&ctx));
    fsdpc_tensor_t t, g;
    ok(tensor_init(&t, DTYPE_F32, device_cpu(), 2, shape));
    for (int i = 0; i < 6; i++) ((float *)t.data)[i] = (float)(i + 1);
    ok(tensor_init(&g, DTYPE_F32, device_cpu(), 2, shape));
    ok(tensor_fill(&g, 1.0));
    nn_var_t *x, *y;
    ok(nn_var_new(&t, true, &x));
    ok(nn_call(ctx, root, x, &y));
    ok(nn_backward_grad(ctx, y, &g));
    ck_assert(nn_var_has_grad(x));
    memcpy(got[ac], x->grad.data, 6 * sizeof(float));
    memcpy(got[ac] + 6, dtensor_local(w->grad)->data, 9 * sizeof(float));
    for (int i = 0; i < 6; i++)
      ck_assert_msg(got[ac][i] == 2.5f, "dx[%d] = %g%s", i, got[ac][i],
                    ac ? " (checkpointed)" : "");
    for (int i = 0; i < 9; i++)
      ck_assert_msg(got[ac][6 + i] == (float)(5 + 2 * (i % 3)), "dW[%d] = %g%s", i, got[ac][6 + i],
                    ac ? " (checkpointed)" : "");
    nn_ctx_clear(ctx);
    nn_var_put(y);
    nn_var_put(x);
    nn_ctx_free(ctx);
    nn_module_free(root);
  }
  ck_assert_int_eq(memcmp(got[0], got[1], sizeof got[0]), 0);
  mesh_free(mesh);
}
END_TEST

/* nn_cast and the casts at a module's boundary (what fully_shard's mixed precision uses). */
static dtype_t seen_inside;

static fsdpc_status_t double_fwd(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  (void)m;
  seen_inside = in->value.dtype;
  return nn_scale(ctx, in, 2.0, out);
}

START_TEST(casts_at_a_module_boundary) {
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  int64_t shape[1] = {4};
  fsdpc_tensor_t t;
  ok(tensor_init(&t, DTYPE_F32, device_cpu(), 1, shape));
  ok(tensor_fill(&t, 1.5));
  nn_var_t *x, *y, *z;
  ok(nn_var_new(&t, true, &x));
  ok(nn_cast(ctx, x, DTYPE_F32, &y)); /* the same dtype: the same variable */
  ck_assert_ptr_eq(y, x);
  nn_var_put(y);
  ok(nn_cast(ctx, x, DTYPE_BF16, &y)); /* f32 -> bf16 -> (x2) -> f32, gradient back in f32 */
  ck_assert_int_eq(y->value.dtype, DTYPE_BF16);
  ok(nn_scale(ctx, y, 2.0, &z));
  nn_var_t *w;
  ok(nn_cast(ctx, z, DTYPE_F32, &w));
  fsdpc_tensor_t g;
  ok(tensor_init(&g, DTYPE_F32, device_cpu(), 1, shape));
  ok(tensor_fill(&g, 1.0));
  ok(nn_backward_grad(ctx, w, &g));
  ck_assert_int_eq(x->grad.dtype, DTYPE_F32);
  for (int i = 0; i < 4; i++) {
    ck_assert_float_eq(((const float *)w->value.data)[i], 3.0f);
    ck_assert_float_eq(((const float *)x->grad.data)[i], 2.0f);
  }
  nn_ctx_clear(ctx);
  nn_var_put(w);
  nn_var_put(z);
  nn_var_put(y);
  /* a module's boundary: inputs to its compute dtype; the output back to f32 when it came in
   * f32 and the module is narrower, or to the dtype asked for; a wider module keeps its own */
  nn_module_t *m;
  ok(nn_module_new("", double_fwd, NULL, &m));
  ok(nn_module_finalize(m));
  const struct {
    dtype_t in, cin, cout, inside, out;
  } cases[] = {{DTYPE_F32, DTYPE_BF16, DTYPE_COUNT, DTYPE_BF16, DTYPE_F32},
               {DTYPE_F32, DTYPE_BF16, DTYPE_BF16, DTYPE_BF16, DTYPE_BF16},
               {DTYPE_BF16, DTYPE_F32, DTYPE_COUNT, DTYPE_F32, DTYPE_F32},
               {DTYPE_BF16, DTYPE_BF16, DTYPE_COUNT, DTYPE_BF16, DTYPE_BF16},
               {DTYPE_F32, DTYPE_COUNT, DTYPE_COUNT, DTYPE_F32, DTYPE_F32}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    fsdpc_tensor_t v;
    ok(tensor_init(&v, cases[k].in, device_cpu(), 1, shape));
    ok(tensor_fill(&v, 1.5));
    nn_var_t *a, *b;
    ok(nn_var_new(&v, true, &a));
    nn_module_set_cast(m, cases[k].cin, cases[k].cout);
    ok(nn_call(ctx, m, a, &b));
    ck_assert_msg(seen_inside == cases[k].inside && b->value.dtype == cases[k].out,
                  "case %zu: inside %s, out %s", k, dtype_name(seen_inside),
                  dtype_name(b->value.dtype));
    fsdpc_tensor_t gb;
    ok(tensor_init(&gb, b->value.dtype, device_cpu(), 1, shape));
    ok(tensor_fill(&gb, 1.0));
    ok(nn_backward_grad(ctx, b, &gb));
    double g0 = dtype_load(a->grad.dtype, a->grad.data, 0);
    ck_assert_msg(a->grad.dtype == cases[k].in && g0 == 2.0, "case %zu: gradient %s %g", k,
                  dtype_name(a->grad.dtype), g0);
    nn_ctx_clear(ctx);
    nn_var_put(b);
    nn_var_put(a);
  }
  nn_module_free(m);
  nn_var_put(x);
  nn_ctx_free(ctx);
}
END_TEST

/* ---- init ---- */

START_TEST(init_is_plan_independent) {
  int W = world_size();
  mesh_t *world;
  const char *names[] = {"dp"};
  ok(mesh_new(1, &W, names, DEVICE_CPU, &world));
  int64_t shape[2] = {10, 3}; /* uneven over 3 or 4 ranks */
  placement_t sh = placement_shard(0);
  int coord = mesh_coord(world, 0);
  int64_t lshape[2], off[2];
  ok(dtensor_compute_box(world, &sh, 2, shape, &coord, lshape, off));
  for (int bad = -1; bad <= W; bad += W + 1) /* a coordinate outside the mesh is refused */
    ck_assert_int_eq(dtensor_compute_box(world, &sh, 2, shape, &bad, lshape, off), STATUS_EINVAL);
  int64_t negative[2] = {10, -3};
  ck_assert_int_eq(dtensor_compute_box(world, &sh, 2, negative, &coord, lshape, off),
                   STATUS_ESHAPE);
  fsdpc_tensor_t local;
  ok(tensor_zeros(&local, DTYPE_F32, device_cpu(), 2, lshape));
  dtensor_t *d;
  ok(dtensor_from_local(&local, world, &sh, 2, shape, &d));
  tensor_free(&local);
  nn_module_t *m;
  ok(nn_module_new("", NULL, NULL, &m));
  nn_param_t *p;
  ok(nn_module_add_param(m, "w", d, true, &p));
  ok(nn_module_finalize(m));
  ok(nn_init_normal(p, 7, 0.0, 0.02));
  fsdpc_tensor_t full;
  ok(dtensor_full_tensor(p->value, &full));
  int bad = 0;
  for (int i = 0; i < 30; i++) {
    float want = (float)(0.02 * nn_init_normal_value(7, "w", (uint64_t)i));
    if (((float *)full.data)[i] != want) bad++;
  }
  expect_all(bad == 0, "%d elements differ from the unsharded init", bad);
  /* different names and seeds give different values */
  ck_assert(nn_init_normal_value(7, "w", 0) != nn_init_normal_value(8, "w", 0));
  ck_assert(nn_init_normal_value(7, "w", 0) != nn_init_normal_value(7, "v", 0));
  tensor_free(&full);
  nn_module_free(m);
  mesh_free(world);
}
END_TEST

START_TEST(init_normal_statistics) {
  double s = 0, s2 = 0;
  int n = 20000;
  for (int i = 0; i < n; i++) {
    double v = nn_init_normal_value(3, "x", (uint64_t)i);
    s += v;
    s2 += v * v;
  }
  ck_assert(fabs(s / n) < 0.03);
  ck_assert(fabs(s2 / n - 1.0) < 0.05);
}
END_TEST

/* ---- Hugging Face config ---- */

static const char *write_tmp(const char *name, const char *text) {
  static char path[256];
  snprintf(path, sizeof path, "/tmp/fsdpc_test_%d_%s", (int)getpid(), name);
  FILE *f = fopen(path, "w");
  fputs(text, f);
  fclose(f);
  return path;
}

START_TEST(hf_config_parse_and_errors) {
  llama_config_t c;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_tied_config.json", &c));
  ck_assert(c.dim == 64 && c.n_layers == 2 && c.n_heads == 4 && c.n_kv_heads == 2 &&
            c.ffn_dim == 160 && c.vocab_size == 256 && c.max_seq_len == 64 && c.tie_embeddings);
  ck_assert_double_eq(c.norm_eps, 1e-5);
  const char *p = write_tmp("cfg.json", "{\"hidden_size\": 64}");
  ck_assert_int_eq(llama_config_from_hf(p, &c), STATUS_EFORMAT);
  ck_assert(strstr(err_detail(), "num_hidden_layers") != NULL);
  p = write_tmp("cfg.json",
                "{\"hidden_size\": 64, \"num_hidden_layers\": 1, "
                "\"num_attention_heads\": 3, \"intermediate_size\": 8, "
                "\"vocab_size\": 10}");
  ck_assert_int_eq(llama_config_from_hf(p, &c), STATUS_EINVAL);
  p = write_tmp("cfg.json",
                "{\"hidden_size\": 64, \"num_hidden_layers\": 1, "
                "\"num_attention_heads\": 4, \"intermediate_size\": 8, "
                "\"vocab_size\": 10, \"rope_scaling\": {\"type\": \"linear\"}}");
  ck_assert_int_eq(llama_config_from_hf(p, &c), STATUS_EFORMAT);
  ck_assert(strstr(err_detail(), "'rope_scaling' has no 'factor'") != NULL);
  p = write_tmp("cfg.json",
                "{\"hidden_size\": 64, \"num_hidden_layers\": 1, "
                "\"num_attention_heads\": 4, \"intermediate_size\": 8, "
                "\"vocab_size\": 10, \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2}}");
  ck_assert_int_eq(llama_config_from_hf(p, &c), STATUS_EUNSUPPORTED);
  p = write_tmp("cfg.json", "{\"hidden_size\": \"64\"");
  ck_assert_int_eq(llama_config_from_hf(p, &c), STATUS_EFORMAT);
  ck_assert_int_eq(llama_config_from_hf("/nonexistent/config.json", &c), STATUS_EIO);
  /* round trip through our writer */
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &c));
  char out[256];
  snprintf(out, sizeof out, "/tmp/fsdpc_test_%d_out.json", (int)getpid());
  ok(llama_config_to_hf(&c, DTYPE_F32, out));
  llama_config_t back;
  ok(llama_config_from_hf(out, &back));
  ck_assert(c.dim == back.dim && c.n_layers == back.n_layers && c.n_heads == back.n_heads &&
            c.n_kv_heads == back.n_kv_heads && c.ffn_dim == back.ffn_dim &&
            c.vocab_size == back.vocab_size && c.max_seq_len == back.max_seq_len &&
            c.rope.theta == back.rope.theta && c.norm_eps == back.norm_eps &&
            c.tie_embeddings == back.tie_embeddings);
  remove(out);
  remove(p);
}
END_TEST

/* A model built deferred holds no parameter memory; a forward before nn_module_materialize is
 * refused naming the parameter and the remedy; once materialized and initialised it computes
 * exactly the logits of the model built whole. */
START_TEST(deferred_model_materializes) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  llama_options_t o = LLAMA_OPTIONS_INIT;
  size_t before = mem_stats(device_cpu()).current;
  llama_t *m[2];
  o.deferred = true;
  ok(llama_new(&cfg, &o, &m[0]));
  ck_assert_uint_eq(mem_stats(device_cpu()).current, before);
  o.deferred = false;
  ok(llama_new(&cfg, &o, &m[1]));
  ok(llama_init_weights(m[1], 5));
  fsdpc_tensor_t ids;
  ok(tensor_init(&ids, DTYPE_I64, device_cpu(), 2, (int64_t[]){1, 6}));
  for (int i = 0; i < 6; i++) ((int64_t *)ids.data)[i] = 7 * i + 1;
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  nn_var_t *in, *out[2] = {NULL, NULL};
  ok(nn_var_new(&ids, false, &in));
  ck_assert_int_eq(nn_call(ctx, llama_module(m[0]), in, &out[0]), STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "model.embed_tokens.weight is meta") != NULL);
  ck_assert(strstr(err_detail(), "nn_module_materialize") != NULL);
  nn_ctx_clear(ctx);
  before = mem_stats(device_cpu()).current;
  ok(nn_module_materialize(llama_module(m[0])));
  ck_assert_uint_eq(mem_stats(device_cpu()).current - before, (size_t)llama_num_params(&cfg) * 4);
  ok(llama_init_weights(m[0], 5));
  for (int k = 0; k < 2; k++) ok(nn_call(ctx, llama_module(m[k]), in, &out[k]));
  bool eq;
  ok(tensor_equal(&out[0]->value, &out[1]->value, &eq));
  ck_assert(eq);
  for (int k = 0; k < 2; k++) {
    nn_var_put(out[k]);
    llama_free(m[k]);
  }
  nn_var_put(in);
  nn_ctx_free(ctx);
}
END_TEST

/* The layers: PyTorch's names, shapes and kinds; PyTorch's default init (bounds and moments);
 * a deferred model holds no memory until materialized; a sequential forward is its children
 * in order; bad sizes are refused naming the layer. */
START_TEST(layers_build_init_and_forward) {
  nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;
  nn_module_t *root, *fc, *emb, *ln;
  ok(nn_sequential_new(NULL, "", &root));
  ok(nn_linear_new(root, "fc", 100, 300, true, &lo, &fc));
  ok(nn_activation_new(root, "act", KERNEL_ACT_GELU, NULL));
  ok(nn_layernorm_new(root, "ln", 300, 1e-5, true, &lo, &ln));
  ok(nn_embedding_new(NULL, "emb", 50, 40, &lo, &emb));
  ok(nn_module_add_child(root, emb));
  ok(nn_module_finalize(root));
  ck_assert_str_eq(nn_module_kind(fc), "linear");
  ck_assert_str_eq(nn_module_kind(ln), "layernorm");
  ck_assert_str_eq(nn_module_kind(emb), "embedding");
  nn_param_t *w = nn_param_find(root, "fc.weight"), *b = nn_param_find(root, "fc.bias");
  ck_assert(w && b && nn_param_find(root, "ln.bias") && nn_param_find(root, "emb.weight"));
  ck_assert(dtensor_shape(w->value)[0] == 300 && dtensor_shape(w->value)[1] == 100);
  ck_assert_int_eq(nn_linear_new(root, "bad", 0, 3, false, &lo, NULL), STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "layer 'bad': in_features") != NULL);
  ck_assert_int_eq(nn_module_num_children(root), 4);
  ok(nn_module_reset_parameters(root, 3));
  double bound = 1.0 / sqrt(100.0), s = 0, s2 = 0, mx = 0;
  const float *wv = dtensor_local(w->value)->data;
  for (int i = 0; i < 30000; i++) {
    s += wv[i];
    s2 += (double)wv[i] * wv[i];
    mx = fabs(wv[i]) > mx ? fabs(wv[i]) : mx;
  }
  ck_assert(mx <= bound && mx > 0.99 * bound);          /* U(-1/sqrt(in), 1/sqrt(in)) */
  ck_assert(fabs(s / 30000) < 0.01 * bound);
  ck_assert(fabs(s2 / 30000 / (bound * bound / 3) - 1) < 0.03);
  const float *lw = dtensor_local(nn_param_find(root, "ln.weight")->value)->data;
  const float *lb = dtensor_local(nn_param_find(root, "ln.bias")->value)->data;
  ck_assert(lw[0] == 1.0f && lw[299] == 1.0f && lb[0] == 0.0f && lb[299] == 0.0f);
  const float *ev = dtensor_local(nn_param_find(root, "emb.weight")->value)->data;
  double e2 = 0;
  for (int i = 0; i < 2000; i++) e2 += (double)ev[i] * ev[i];
  ck_assert(fabs(e2 / 2000 - 1) < 0.1); /* N(0, 1) */
  /* the sequential forward: fc, GELU, LayerNorm in order */
  int64_t xs[2] = {3, 100};
  fsdpc_tensor_t x;
  ok(tensor_init(&x, DTYPE_F32, device_cpu(), 2, xs));
  test_rng_t rng = {5};
  test_fill_uniform(&x, &rng, 1.0);
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  nn_ctx_set_grad_enabled(ctx, false);
  nn_var_t *in, *a, *g, *n1, *want, *got;
  ok(nn_var_new(&x, false, &in));
  nn_module_t *seq;
  ok(nn_sequential_new(NULL, "", &seq));
  ok(nn_module_finalize(seq));
  ok(nn_call(ctx, fc, in, &a));
  ok(nn_activation(ctx, a, KERNEL_ACT_GELU, &g));
  ok(nn_layernorm(ctx, g, nn_param_find(root, "ln.weight"), nn_param_find(root, "ln.bias"), 1e-5, &want));
  nn_module_t *emb_child = nn_module_child(root, 3);
  ck_assert_ptr_eq(emb_child, emb);
  /* run the root without the embedding (its input is ids): a sequential of the first three */
  ok(nn_call(ctx, seq, in, &n1)); /* an empty sequential is the identity */
  ck_assert_ptr_eq(n1, in);
  nn_var_put(n1);
  nn_module_t *three;
  ok(nn_sequential_new(NULL, "", &three));
  nn_layer_options_t d = NN_LAYER_OPTIONS_INIT;
  d.deferred = true;
  size_t before = mem_stats(device_cpu()).current;
  ok(nn_linear_new(three, "fc", 100, 300, true, &d, NULL));
  ok(nn_activation_new(three, "act", KERNEL_ACT_GELU, NULL));
  ok(nn_layernorm_new(three, "ln", 300, 1e-5, true, &d, NULL));
  ok(nn_module_finalize(three));
  ck_assert_uint_eq(mem_stats(device_cpu()).current, before); /* deferred: no memory */
  ok(nn_module_materialize(three));
  ok(nn_module_reset_parameters(three, 3)); /* same names and seed: the same values */
  ok(nn_call(ctx, three, in, &got));
  bool eq;
  ok(tensor_equal(&got->value, &want->value, &eq));
  ck_assert(eq);
  nn_var_t *vs[] = {in, a, g, want, got};
  for (int i = 0; i < 5; i++) nn_var_put(vs[i]);
  nn_ctx_free(ctx);
  nn_module_free(three);
  nn_module_free(seq);
  nn_module_free(root);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("nn");
  TCase *tc = tcase_create("nn");
  if (world_size() == 1) {
    tcase_add_test(tc, module_fqns_and_shared_parameters);
    tcase_add_test(tc, hooks_fire_in_call_order);
    tcase_add_test(tc, checkpointed_input_used_after);
    tcase_add_test(tc, casts_at_a_module_boundary);
    tcase_add_test(tc, init_normal_statistics);
    tcase_add_test(tc, hf_config_parse_and_errors);
    tcase_add_test(tc, deferred_model_materializes);
    tcase_add_test(tc, layers_build_init_and_forward);
  }
  tcase_add_test(tc, init_is_plan_independent);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
