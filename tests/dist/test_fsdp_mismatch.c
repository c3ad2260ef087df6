/*
 * On-demand unshards taken by some ranks only (arguments: "fsdp" or "hsdp", then the case).
 * Without a guard these hang: the ranks that took the path wait in an all-gather the others
 * never join, and the others wait in the unit's all-gather for them.
 *   alone-module: rank 0 alone calls model.layers.1.mlp directly before the model's forward;
 *   alone-method: rank 0 alone runs a method of the sharded head (lm_head) directly;
 *   different:    rank 0 calls model.layers.1.mlp directly, the others model.embed_tokens.
 * Every rank ends the step with an error naming the module: rank 0 after the agreement's
 * timeout (two seconds here), which stops the job, and the others through the stop; with
 * different modules, every rank at once. No rank hangs.
 */
#include <stdio.h>
#include <string.h>

#include "nn/ops.h"
#include "tests/dist/fsdp_common.h"

#define TIMEOUT 2.0

static const char *test_case(void) { return test_argc() > 2 ? test_argv()[2] : ""; }

static fsdpc_status_t head_method(nn_ctx_t *ctx, nn_module_t *head, nn_var_t *x, nn_var_t **out) {
  return nn_linear(ctx, x, nn_module_param_named(head, "weight"), out);
}

/* Rank 0's (or every rank's) extra path, then the model's forward and backward. */
static fsdpc_status_t step(llama_t *m, const llama_config_t *cfg) {
  nn_module_t *root = llama_module(m);
  device_t dev = mesh_device(llama_local_mesh(m));
  int64_t ids_shape[2] = {2, 8}, x_shape[3] = {2, 8, cfg->dim};
  fsdpc_tensor_t ids_t, x_t;
  FSDPC_TRY(tensor_zeros(&ids_t, DTYPE_I64, dev, 2, ids_shape));
  FSDPC_TRY(tensor_zeros(&x_t, DTYPE_F32, dev, 3, x_shape));
  nn_ctx_t *ctx = NULL;
  nn_var_t *ids = NULL, *x = NULL, *extra = NULL, *logits = NULL, *loss = NULL;
  fsdpc_status_t st = nn_ctx_new(&ctx);
  if (st == STATUS_OK) st = nn_var_new(&ids_t, false, &ids);
  if (st == STATUS_OK) st = nn_var_new(&x_t, false, &x);
  bool first = world_rank() == 0;
  const char *c = test_case();
  if (st == STATUS_OK && strcmp(c, "alone-method") == 0) {
    if (first) st = head_method(ctx, nn_module_find(root, "lm_head"), x, &extra);
  } else if (st == STATUS_OK && first) {
    st = nn_call(ctx, nn_module_find(root, "model.layers.1.mlp"), x, &extra);
  } else if (st == STATUS_OK && strcmp(c, "different") == 0) {
    st = nn_call(ctx, nn_module_find(root, "model.embed_tokens"), ids, &extra);
  }
  if (st == STATUS_OK) st = nn_call(ctx, root, ids, &logits);
  if (st == STATUS_OK) st = nn_cross_entropy(ctx, logits, &ids->value, &loss, NULL);
  if (st == STATUS_OK) st = nn_backward(ctx, loss);
  nn_var_t *vars[] = {ids, x, extra, logits, loss};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) nn_var_put(vars[i]);
  nn_ctx_free(ctx);
  tensor_free(&ids_t);
  tensor_free(&x_t);
  return st;
}

START_TEST(partial_on_demand_path_fails_on_every_rank) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  mesh_t *mesh = dp_mesh();
  run_t sh;
  run_init(&sh, &cfg);
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  opt.on_demand_timeout = TIMEOUT;
  nn_module_t *root = llama_module(sh.m);
  for (int i = 0; i < cfg.n_layers; i++) ok(fully_shard(llama_layer(sh.m, i), &opt, NULL));
  ok(fully_shard(nn_module_find(root, "lm_head"), &opt, NULL));
  ok(fully_shard(root, &opt, NULL));
  const char *c = test_case();
  const char *want = strcmp(c, "alone-method") == 0 ? "nn_linear on parameter lm_head.weight"
                     : strcmp(c, "different") == 0 && world_rank() != 0 ? "model.embed_tokens"
                                                                        : "model.layers.1.mlp";
  double t0 = MPI_Wtime();
  fsdpc_status_t st = step(sh.m, &cfg);
  double took = MPI_Wtime() - t0;
  char detail[1200];
  snprintf(detail, sizeof detail, "%s", err_detail());
  printf("rank %d after %.1f s: %s\n", world_rank(), took, detail);
  /* different modules: found at once; one rank alone: after the timeout, with room for a
   * loaded machine */
  double limit = strcmp(c, "different") == 0 ? TIMEOUT : TIMEOUT + 60;
  expect_all(st != STATUS_OK && strstr(detail, want) != NULL && took < limit,
             "rank %d: %s after %.1f s (limit %.0f s), expected an error naming %s: %s",
             world_rank(), status_str(st), took, limit, want, detail);
  fsdp_free_all(root);
  llama_free(sh.m);
  mesh_free(mesh);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("fsdp_mismatch");
  TCase *tc = tcase_create("mismatch");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, partial_on_demand_path_fails_on_every_rank);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
