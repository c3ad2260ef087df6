/*
 * Modules of a fully-sharded model used the way real models use them (argument "fsdp" or
 * "hsdp"): a parent that calls children of sharded units directly (model.embed_tokens of the
 * root's group, model.layers.1.mlp of layer 1's) and calls a method of the sharded head
 * (lm_head) directly, outside any call of it. Ten steps match the single-rank run; the direct
 * uses warn once per module; registered (the children as entry points, the method run through
 * nn_call_with) they never warn and gather and reduce as often; a parameter's full_tensor()
 * mid-training equals the single-rank parameter, and a whole value written into it with
 * nn_param_copy_full lands in both runs alike; replacing a sharded parameter by hand, a value
 * of the wrong shape and a write while a step has it gathered are refused. The same path inside the
 * model's own forward (a parent using its children) holds the same way. The single-rank
 * reference takes each global batch as one micro-batch per data-parallel rank, with the
 * ranks' shapes, so any BLAS kernel rounds both runs alike (tests/README.md, "Reference
 * shapes").
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/kernels.h"
#include "nn/ops.h"
#include "tests/dist/fsdp_common.h"

#define STEPS 10

/* The head's method (not its forward): logits of an input scaled up to the size of a
 * normalised hidden state, halved. */
/* The hooks of every module of a tree. */
static int hooks_under(const nn_module_t *m) {
  int n = 0;
  for (int k = 0; k < NN_HOOK_COUNT; k++) n += nn_module_num_hooks(m, k);
  for (int i = 0; i < nn_module_num_children(m); i++) n += hooks_under(nn_module_child(m, i));
  return n;
}

static fsdpc_status_t half_logits(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *x = NULL, *y = NULL;
  FSDPC_TRY(nn_scale(ctx, in, 100.0, &x));
  fsdpc_status_t st = nn_linear(ctx, x, nn_module_param_named(m, "weight"), &y);
  if (st == STATUS_OK) st = nn_scale(ctx, y, 0.5, out);
  nn_var_put(y);
  nn_var_put(x);
  return st;
}

/* Where the step uses the children and the method: from the top level before the model's
 * forward (their backward runs after the model's has ended), unregistered or registered (the
 * children as entry points, the method through nn_call_with); or inside the model's own
 * forward, unregistered. */
typedef enum step_mode { OUTSIDE, REGISTERED, INSIDE } step_mode_t;

/* aux = head.half_logits(layers[1].mlp(embed_tokens(ids))) */
static fsdpc_status_t aux_path(nn_ctx_t *ctx, nn_module_t *root, nn_var_t *ids, bool registered,
                               nn_var_t **aux) {
  nn_var_t *e = NULL, *x = NULL;
  nn_module_t *head = nn_module_find(root, "lm_head");
  fsdpc_status_t st = nn_call(ctx, nn_module_find(root, "model.embed_tokens"), ids, &e);
  if (st == STATUS_OK) st = nn_call(ctx, nn_module_find(root, "model.layers.1.mlp"), e, &x);
  if (st == STATUS_OK)
    st = registered ? nn_call_with(ctx, head, half_logits, x, aux) : half_logits(ctx, head, x, aux);
  nn_var_put(x);
  nn_var_put(e);
  return st;
}

/* The model's forward as a parent that uses its children directly: model(ids) + aux. */
static fsdpc_status_t forward_with_aux(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out,
                                       nn_forward_fn inner, void *user) {
  (void)user;
  nn_var_t *aux = NULL, *logits = NULL;
  fsdpc_status_t st = aux_path(ctx, m, in, false, &aux);
  if (st == STATUS_OK) st = inner(ctx, m, in, &logits);
  if (st == STATUS_OK) st = nn_add(ctx, logits, aux, out);
  nn_var_put(logits);
  nn_var_put(aux);
  return st;
}

/* OUTSIDE, REGISTERED: loss = CE(model(ids)) + CE(aux); INSIDE: loss = CE(model(ids) + aux).
 * The backward runs from the loss times scale (1/micro-batches when accumulating); returns the
 * loss times scale. */
static double step(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec, int64_t s,
                   step_mode_t mode, double scale) {
  nn_module_t *root = llama_module(m);
  fsdpc_tensor_t in_h, tg_h, in, tg;
  ok(data_batch(d, spec, s, 0, &in_h, &tg_h));
  device_t dev = mesh_device(llama_local_mesh(m));
  ok(tensor_clone(&in, &in_h, DTYPE_I64, dev));
  ok(tensor_clone(&tg, &tg_h, DTYPE_I64, dev));
  nn_ctx_t *ctx;
  nn_var_t *ids, *logits, *aux = NULL, *l1, *l2 = NULL, *loss;
  ok(nn_ctx_new(&ctx));
  ok(nn_var_new(&in, false, &ids));
  if (mode != INSIDE) ok(aux_path(ctx, root, ids, mode == REGISTERED, &aux));
  ok(nn_call(ctx, root, ids, &logits));
  ok(nn_cross_entropy(ctx, logits, &tg, &l1, NULL));
  if (mode != INSIDE) {
    ok(nn_cross_entropy(ctx, aux, &tg, &l2, NULL));
    ok(nn_add(ctx, l1, l2, &loss));
  } else {
    loss = nn_var_ref(l1);
  }
  nn_var_t *scaled;
  ok(nn_scale(ctx, loss, scale, &scaled));
  double v;
  ok(nn_var_scalar(scaled, &v));
  ok(nn_backward(ctx, scaled));
  nn_var_t *vars[] = {ids, logits, aux, l1, l2, loss, scaled};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) nn_var_put(vars[i]);
  nn_ctx_free(ctx);
  tensor_free(&in);
  tensor_free(&tg);
  tensor_free(&in_h);
  tensor_free(&tg_h);
  return v;
}

/* Per step, of layer 1's group and of the head's: all-gathers issued and reductions. */
typedef struct counts {
  int unshard[2], post_backward[2];
} counts_t;

static fsdp_group_t *watched[2];

static void count_events(const char *event, const fsdp_group_t *g, void *user) {
  counts_t *c = user;
  for (int i = 0; i < 2; i++) {
    if (g != watched[i]) continue;
    if (strcmp(event, "unshard") == 0) c->unshard[i]++;
    if (strcmp(event, "post_backward") == 0) c->post_backward[i]++;
  }
}

/* Runs the ten steps; *warnings receives the number of this rank's on-demand warnings, each
 * naming one of the three modules used directly. */
static void train(step_mode_t mode, int *warnings, counts_t *per_step) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  mesh_t *mesh = dp_mesh();
  int md = mesh_ndim(mesh), W = world_size();
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  const int B = 2;
  int dp_rank = md == 2 ? mesh_coord(mesh, 0) * mesh_size(mesh, 1) + mesh_coord(mesh, 1)
                        : mesh_coord(mesh, 0);
  data_spec_t lspec = {
      .batch_size = B, .seq_len = 16, .grad_accum = 1, .dp_size = W, .dp_rank = dp_rank};
  run_t ref, sh;
  run_init(&ref, &cfg);
  run_init(&sh, &cfg);
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  nn_module_t *root = llama_module(sh.m);
  for (int i = 0; i < cfg.n_layers; i++) ok(fully_shard(llama_layer(sh.m, i), &opt, NULL));
  ok(fully_shard(nn_module_find(root, "lm_head"), &opt, NULL));
  ok(fully_shard(root, &opt, NULL));
  watched[0] = fsdp_group_of(llama_layer(sh.m, 1));
  watched[1] = fsdp_group_of(nn_module_find(root, "lm_head"));
  if (mode == INSIDE) /* with layers.1.mlp under activation checkpointing as well */
    for (run_t *r = &ref; r; r = r == &ref ? &sh : NULL) {
      ok(nn_module_wrap_forward(llama_module(r->m), forward_with_aux, NULL));
      nn_module_set_checkpoint(nn_module_find(llama_module(r->m), "model.layers.1.mlp"), true);
    }
  if (mode == REGISTERED) {
    ok(fsdp_register_forward_method(nn_module_find(root, "model.embed_tokens")));
    ok(fsdp_register_forward_method(nn_module_find(root, "model.layers.1.mlp")));
  }
  ck_assert_int_eq(fsdp_register_forward_method(root) == STATUS_OK, 1); /* a unit: a no-op */
  counts_t c = {0};
  fsdp_set_event_hook(root, count_events, &c);
  run_optim(&ref);
  run_optim(&sh);
  mesh_t *flat = NULL;
  const char *names[] = {"dp_replicate", "dp_shard"};
  if (md == 2) ok(mesh_flatten(mesh, 2, names, "dp", &flat));
  pg_t *dp = mesh_group(md == 2 ? flat : mesh, 0);
  /* this rank's stderr into a file, to count the warnings */
  char errpath[64];
  snprintf(errpath, sizeof errpath, "/tmp/fsdpc-ondemand-%d-%d.txt", (int)getpid(), world_rank());
  fflush(stderr);
  int saved = dup(2);
  FILE *capture = fopen(errpath, "w+");
  ck_assert_ptr_nonnull(capture);
  dup2(fileno(capture), 2);
  int bad = 0;
  for (int s = 0; s < STEPS; s++) {
    optim_zero_grad(ref.opt);
    optim_zero_grad(sh.opt);
    c = (counts_t){0};
    /* the reference takes the global batch as W micro-batches of the ranks' shapes
     * (tests/README.md, "Reference shapes") */
    double lref = 0;
    for (int k = 0; k < W; k++) {
      data_spec_t kspec = lspec;
      kspec.dp_rank = k;
      lref += step(ref.m, d, &kspec, s, mode == INSIDE ? INSIDE : OUTSIDE, 1.0 / W);
    }
    double lsh = step(sh.m, d, &lspec, s, mode, 1.0);
    double lsum = 0;
    *per_step = c;
    MPI_Allreduce(&lsh, &lsum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    lsh = lsum / W;
    if (fabs(lsh - lref) > 1e-5 * fabs(lref)) {
      bad++;
      if (world_rank() == 0) printf("step %d: sharded loss %.8f, single rank %.8f\n", s, lsh, lref);
    }
    ok(clip_grad_norm(ref.ps, ref.n, 1.0, NULL, NULL));
    ok(clip_grad_norm(sh.ps, sh.n, 1.0, dp, NULL));
    ok(optim_step(ref.opt, 1.0));
    ok(optim_step(sh.opt, 1.0));
    if (s == STEPS / 2) { /* user code reading a sharded parameter */
      nn_param_t *p = nn_param_find(root, "model.layers.0.mlp.up_proj.weight");
      nn_param_t *q = nn_param_find(llama_module(ref.m), "model.layers.0.mlp.up_proj.weight");
      fsdpc_tensor_t full;
      ok(dtensor_full_tensor(p->value, &full));
      double e = test_rel_l2(&full, dtensor_local(q->value));
      if (!(e <= 1e-5)) {
        bad++;
        printf("rank %d: full_tensor differs from the single-rank parameter by %.3g\n",
               world_rank(), e);
      }
      /* and writing one: a new whole value (half the old, in bf16) into both runs; the
       * losses after it keep matching, and the sharded one reads back exactly */
      fsdpc_tensor_t half, back;
      ok(tensor_clone(&half, &full, DTYPE_BF16, full.device));
      ok(kernel_scale(&half, 0.5f));
      ok(nn_param_copy_full(p, &half));
      ok(nn_param_copy_full(q, &half));
      ok(dtensor_full_tensor(p->value, &back));
      if (test_rel_l2(&back, &half) != 0.0 || test_rel_l2(dtensor_local(q->value), &half) != 0.0)
        bad++;
      tensor_free(&back);
      tensor_free(&half);
      tensor_free(&full);
    }
  }
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  rewind(capture);
  char line[2048];
  const char *named[] = {"model.embed_tokens ran", "model.layers.1.mlp ran",
                         "nn_linear on parameter lm_head.weight of module lm_head ran"};
  *warnings = 0;
  while (fgets(line, sizeof line, capture))
    if (strstr(line, "ran outside the forward of its unit")) {
      bool known = false;
      for (int i = 0; i < 3; i++) known |= strstr(line, named[i]) != NULL;
      *warnings += known ? 1 : 100;
      if (world_rank() == 0) printf("%s", line);
    }
  fclose(capture);
  remove(errpath);
  bad += compare_shards(&ref, &sh, false, 1e-5);
  /* evaluation: the method on the sharded head equals the single-rank one and leaves nothing
   * on the tape */
  {
    fsdpc_tensor_t out[2];
    run_t *runs[2] = {&ref, &sh};
    int64_t shape[2] = {3, cfg.dim};
    for (int i = 0; i < 2; i++) {
      nn_ctx_t *ctx;
      nn_var_t *x, *y = NULL;
      fsdpc_tensor_t t;
      test_rng_t rng = {7};
      ok(tensor_init(&t, DTYPE_F32, mesh_device(mesh), 2, shape));
      test_fill_uniform(&t, &rng, 0.01);
      ok(nn_ctx_new(&ctx));
      nn_ctx_set_grad_enabled(ctx, false);
      ok(nn_var_new(&t, false, &x));
      ok(half_logits(ctx, nn_module_find(llama_module(runs[i]->m), "lm_head"), x, &y));
      if (nn_ctx_tape_length(ctx) != 0) bad++;
      ok(tensor_clone(&out[i], &y->value, DTYPE_F32, device_cpu()));
      nn_var_put(y);
      nn_var_put(x);
      nn_ctx_free(ctx);
    }
    double e = test_rel_l2(&out[1], &out[0]);
    if (!(e <= 2e-5)) { /* the parameters themselves agree to 1e-5 */
      bad++;
      printf("rank %d: evaluation of the head's method differs by %.3g\n", world_rank(), e);
    }
    tensor_free(&out[0]);
    tensor_free(&out[1]);
  }
  /* replacing a sharded parameter by hand is refused */
  nn_param_t *p = nn_param_find(root, "model.norm.weight");
  dtensor_t *dt;
  ok(dtensor_from_local(dtensor_local(p->value), dtensor_mesh(p->value),
                        dtensor_placements(p->value), dtensor_ndim(p->value),
                        dtensor_shape(p->value), &dt));
  fsdpc_status_t st = nn_param_set_value(p, dt);
  if (st == STATUS_OK || strstr(err_detail(), "nn_param_copy_full") == NULL) bad++;
  /* ... as is writing a whole value of the wrong shape, or while the step gathered it (the
   * root keeps its parameters gathered from forward to backward) */
  {
    fsdpc_tensor_t wrong;
    int64_t n = cfg.dim + 1;
    ok(tensor_zeros(&wrong, DTYPE_F32, mesh_device(mesh), 1, &n));
    st = nn_param_copy_full(p, &wrong);
    if (st != STATUS_ESHAPE || strstr(err_detail(), "model.norm.weight") == NULL) bad++;
    tensor_free(&wrong);
    nn_ctx_t *ctx;
    nn_var_t *ids, *logits;
    fsdpc_tensor_t t;
    int64_t shape[2] = {1, 4};
    ok(tensor_zeros(&t, DTYPE_I64, mesh_device(mesh), 2, shape));
    ok(nn_ctx_new(&ctx));
    ok(nn_var_new(&t, false, &ids));
    ok(nn_call(ctx, root, ids, &logits));
    fsdpc_tensor_t full;
    ok(dtensor_full_tensor(p->value, &full));
    st = nn_param_copy_full(p, &full);
    if (st == STATUS_OK || strstr(err_detail(), "between steps") == NULL) bad++;
    tensor_free(&full);
    nn_var_put(logits);
    nn_var_put(ids);
    nn_ctx_free(ctx);
  }
  expect_all(bad == 0, "%d mismatches", bad);
  for (run_t *r = &ref; r; r = r == &ref ? &sh : NULL) {
    optim_free(r->opt);
    free(r->ps);
  }
  fsdp_free_all(root);
  int left = hooks_under(root); /* the on-demand hooks of member modules go too */
  ck_assert_int_eq(left, 0);
  llama_free(ref.m);
  llama_free(sh.m);
  data_free(d);
  mesh_free(flat);
  mesh_free(mesh);
}

/* Trains in mode: every rank prints `want` on-demand warnings, and per step layer 1 and the
 * head gather and reduce as a regular unit call does. Layer 1: its own call gathers in
 * forward and in backward, so does the direct call of its mlp, and each reduces once; the head
 * likewise for the root's call of it and for its method. */
static void expect_mode(step_mode_t mode, int want) {
  int warnings;
  counts_t c;
  train(mode, &warnings, &c);
  expect_all(warnings == want, "on-demand warnings on rank %d: %d, expected %d", world_rank(),
             warnings, want);
  int g = world_size() > 1 ? 4 : 0;
  for (int i = 0; i < 2; i++)
    expect_all(c.unshard[i] == g && c.post_backward[i] == 2,
               "%s per step: %d all-gathers, %d reductions (expected %d, 2)",
               i ? "lm_head" : "layer 1", c.unshard[i], c.post_backward[i], g);
}

/* model.embed_tokens, model.layers.1.mlp and lm_head's method, once each over ten steps */
START_TEST(direct_uses_warn_once_per_module) { expect_mode(OUTSIDE, 3); }
END_TEST

START_TEST(registered_entry_points_are_regular_calls) { expect_mode(REGISTERED, 0); }
END_TEST

/* inside the model's forward its own embed_tokens is a regular use; layers.1.mlp and the
 * head's method are on demand */
START_TEST(parent_forward_uses_children_directly) { expect_mode(INSIDE, 2); }
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("fsdp_ondemand");
  TCase *tc = tcase_create("ondemand");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, direct_uses_warn_once_per_module);
  tcase_add_test(tc, registered_entry_points_are_regular_calls);
  tcase_add_test(tc, parent_forward_uses_children_directly);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
