/*
 * Parallelism plans filled in code and applied to a model of the general layers on one rank:
 * units and rules added by function, resolution against the world, the groups parallel_apply
 * makes (the matching modules inner first, the root last) and the placements it reports
 * offline for a tensor-parallel plan, taken from the model's module kinds; the model and the
 * plan's state freed in either order.
 */
#include <stdio.h>
#include <string.h>

#include "checkpoint/dcp.h"
#include "nn/autograd.h"
#include "nn/layers.h"
#include "nn/ops.h"
#include "parallel/parallelize.h"
#include "train/plan.h"
#include "tests/harness.h"

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

static nn_module_t *mlp(void) {
  nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;
  lo.deferred = true;
  nn_module_t *m;
  ok(nn_sequential_new(NULL, "", &m));
  ok(nn_linear_new(m, "fc1", 8, 12, true, &lo, NULL));
  ok(nn_activation_new(m, "act", KERNEL_ACT_RELU, NULL));
  ok(nn_linear_new(m, "fc2", 12, 8, true, &lo, NULL));
  ok(nn_layernorm_new(m, "norm", 8, 1e-5, true, &lo, NULL));
  ok(nn_module_finalize(m));
  return m;
}

START_TEST(plan_in_code_applies_to_any_model) {
  parallel_plan_t pp;
  parallel_plan_defaults(&pp);
  ok(parallel_plan_add_unit(&pp, "fc*"));
  ck_assert_int_eq(parallel_plan_add_unit(&pp, ""), STATUS_EINVAL);
  ok(parallel_plan_resolve(&pp, 1));
  ck_assert_int_eq(pp.dp_shard, 1);
  nn_module_t *m = mlp();
  parallel_t *par;
  ok(parallel_apply(m, &pp, DEVICE_CPU, &par));
  ck_assert_int_eq(parallel_num_groups(par), 3); /* fc1, fc2, the root (act has no params) */
  ck_assert_str_eq(fsdp_group_name(parallel_groups(par)[0]), "fc1");
  ck_assert_str_eq(fsdp_group_name(parallel_groups(par)[2]), "");
  ck_assert_int_eq(parallel_dp_size(par), 1);
  ck_assert_ptr_null(parallel_tp_mesh(par));
  ok(nn_module_materialize(m));
  ok(nn_module_reset_parameters(m, 1));
  parallel_free(par);
  nn_module_free(m);
  /* a unit matching nothing names the module names of the model */
  parallel_plan_defaults(&pp);
  ok(parallel_plan_add_unit(&pp, "layers.*"));
  ok(parallel_plan_resolve(&pp, 1));
  m = mlp();
  ck_assert_int_eq(parallel_apply(m, &pp, DEVICE_CPU, &par), STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "modules here: fc1, act, fc2, norm") != NULL);
  nn_module_free(m);
}
END_TEST

/* The model and the plan's state are freed in either order, after a step that left
 * gradients and fully_shard's buffers behind: the groups go with the model (nn_module_free
 * runs their slot's destructor), the meshes with their last user, and every byte is given
 * back. (ASan builds also catch any use after free.) */
START_TEST(model_and_plan_free_in_either_order) {
  for (int order = 0; order < 2; order++) {
    size_t before = mem_stats(device_cpu()).current;
    parallel_plan_t pp;
    parallel_plan_defaults(&pp);
    ok(parallel_plan_add_unit(&pp, "fc*"));
    ok(parallel_plan_resolve(&pp, 1));
    nn_module_t *m = mlp();
    parallel_t *par;
    ok(parallel_apply(m, &pp, DEVICE_CPU, &par));
    ok(nn_module_materialize(m));
    ok(nn_module_reset_parameters(m, 1));
    nn_ctx_t *ctx;
    ok(nn_ctx_new(&ctx));
    fsdpc_tensor_t x, target;
    ok(tensor_init(&x, DTYPE_F32, device_cpu(), 2, (int64_t[]){4, 8}));
    ok(tensor_fill(&x, 0.5));
    ok(tensor_init(&target, DTYPE_F32, device_cpu(), 2, (int64_t[]){4, 8}));
    ok(tensor_fill(&target, 0.25));
    nn_var_t *in, *out, *loss;
    ok(nn_var_new(&x, false, &in));
    ok(nn_call(ctx, m, in, &out));
    ok(nn_mse_loss(ctx, out, &target, &loss));
    ok(nn_backward(ctx, loss));
    nn_var_put(loss);
    nn_var_put(out);
    nn_var_put(in);
    nn_ctx_free(ctx);
    tensor_free(&target);
    ck_assert_uint_gt(mem_stats(device_cpu()).current, before);
    if (order == 0) {
      nn_module_free(m);
      parallel_free(par);
    } else {
      parallel_free(par);
      nn_module_free(m);
    }
    ck_assert_msg(mem_stats(device_cpu()).current == before,
                  "order %d: %zu bytes still allocated after freeing the model and the plan",
                  order, mem_stats(device_cpu()).current - before);
  }
}
END_TEST

/* Offline placements for a 2 x 2 (dp_shard x tp) plan, by kind: a colwise linear's weight
 * and bias split on tp (dp strided over them), a rowwise one's weight by columns and its bias
 * whole, a sequence-parallel LayerNorm whole; rules are needed when tp > 1. */
START_TEST(placements_follow_module_kinds) {
  parallel_plan_t pp;
  parallel_plan_defaults(&pp);
  pp.tp = 2;
  ck_assert_int_eq(parallel_plan_resolve(&pp, 4), STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "no rule says which modules to split") != NULL);
  ck_assert_int_eq(tp_rule_index(NULL, 1, "fc1"), -1); /* no rules given: none matches */
  ok(parallel_plan_add_tp_rule(&pp, "fc1", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT));
  ok(parallel_plan_add_tp_rule(&pp, "fc2", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT));
  ok(parallel_plan_add_tp_rule(&pp, "norm", TP_SEQUENCE_PARALLEL, TP_LAYOUT_DEFAULT,
                               TP_LAYOUT_DEFAULT));
  pp.sequence_parallel = true;
  ok(parallel_plan_resolve(&pp, 4));
  ck_assert_int_eq(pp.dp_shard, 2);
  nn_module_t *m = mlp();
  const struct {
    const char *fqn, *want;
  } cases[] = {{"fc1.weight", "(SS(0,2), S(0))"}, {"fc1.bias", "(SS(0,2), S(0))"},
               {"fc2.weight", "(S(0), S(1))"},    {"fc2.bias", "(S(0), R)"},
               {"norm.weight", "(S(0), R)"},      {"norm.bias", "(S(0), R)"}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int md, shape[MESH_MAX_DIMS];
    placement_t pl[MESH_MAX_DIMS];
    char module[32];
    snprintf(module, sizeof module, "%s", cases[i].fqn);
    *strrchr(module, '.') = 0;
    int nd = strstr(cases[i].fqn, "weight") && strncmp(cases[i].fqn, "norm", 4) != 0 ? 2 : 1;
    ok(parallel_param_placements(&pp, cases[i].fqn, nn_module_kind(nn_module_find(m, module)), nd,
                                 &md, shape, pl));
    char buf[64];
    placements_str(md, pl, buf, sizeof buf);
    ck_assert_msg(strcmp(buf, cases[i].want) == 0, "%s: %s, want %s", cases[i].fqn, buf,
                  cases[i].want);
    ck_assert(md == 2 && shape[0] == 2 && shape[1] == 2);
  }
  /* a rule on a module of unknown kind cannot place its parameters */
  int md, shape[MESH_MAX_DIMS];
  placement_t pl[MESH_MAX_DIMS];
  ck_assert_int_eq(parallel_param_placements(&pp, "fc1.weight", NULL, 2, &md, shape, pl),
                   STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "rule 'fc1' matches module 'fc1', whose kind is not known"));
  ok(parallel_param_placements(&pp, "other.weight", NULL, 2, &md, shape, pl));
  nn_module_free(m);
}
END_TEST

/* shard_dims in code: the offline placements follow them (strided where tp splits the same
 * dimension), first match wins, a dimension out of range is refused there and in
 * parallel_apply, a pattern matching no parameter is refused by parallel_apply. */
START_TEST(shard_dims_in_code) {
  parallel_plan_t pp;
  parallel_plan_defaults(&pp);
  pp.tp = 2;
  ok(parallel_plan_add_tp_rule(&pp, "fc1", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT));
  ok(parallel_plan_add_tp_rule(&pp, "fc2", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT));
  ok(parallel_plan_add_shard_dim(&pp, "fc2.weight", -1));
  ok(parallel_plan_add_shard_dim(&pp, "fc*.weight", 1));
  ok(parallel_plan_add_shard_dim(&pp, "norm.*", 1));
  ck_assert_int_eq(parallel_plan_add_shard_dim(&pp, "", 0), STATUS_EINVAL);
  ok(parallel_plan_resolve(&pp, 4));
  nn_module_t *m = mlp();
  const struct {
    const char *fqn, *want;
  } cases[] = {{"fc1.weight", "(S(1), S(0))"},
               {"fc2.weight", "(SS(1,2), S(1))"},
               {"fc1.bias", "(SS(0,2), S(0))"}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int md, shape[MESH_MAX_DIMS];
    placement_t pl[MESH_MAX_DIMS];
    char module[32], buf[64];
    snprintf(module, sizeof module, "%s", cases[i].fqn);
    *strrchr(module, '.') = 0;
    ok(parallel_param_placements(&pp, cases[i].fqn, nn_module_kind(nn_module_find(m, module)),
                                 strstr(cases[i].fqn, "weight") ? 2 : 1, &md, shape, pl));
    placements_str(md, pl, buf, sizeof buf);
    ck_assert_msg(strcmp(buf, cases[i].want) == 0, "%s: %s, want %s", cases[i].fqn, buf,
                  cases[i].want);
  }
  ck_assert_int_eq(parallel_plan_shard_dim(&pp, "norm.weight", 1), -1);
  int md, shape[MESH_MAX_DIMS];
  placement_t pl[MESH_MAX_DIMS];
  ck_assert_int_eq(parallel_param_placements(&pp, "norm.weight", "layernorm", 1, &md, shape, pl),
                   STATUS_EINVAL);
  ck_assert(strstr(err_detail(), "norm.weight") && strstr(err_detail(), "out of range"));
  nn_module_free(m);
  /* applied on one rank: the norm's 1-D weight has no dimension 1 */
  parallel_plan_t one;
  parallel_plan_defaults(&one);
  ok(parallel_plan_add_shard_dim(&one, "fc1.weight", 1));
  ok(parallel_plan_add_shard_dim(&one, "norm.weight", 1));
  ok(parallel_plan_resolve(&one, 1));
  parallel_t *par = NULL;
  m = mlp();
  ck_assert_int_eq(parallel_apply(m, &one, DEVICE_CPU, &par), STATUS_EINVAL);
  ck_assert_msg(strstr(err_detail(),
                       "parameter norm.weight has 1 dimension; 'norm.weight' gives "
                       "it dimension 1 (from -1 to 0)"),
                "%s", err_detail());
  nn_module_free(m);
  one.n_shard_dims = 1;
  ok(parallel_plan_add_shard_dim(&one, "fc3.*", 0));
  m = mlp();
  ck_assert_int_eq(parallel_apply(m, &one, DEVICE_CPU, &par), STATUS_EINVAL);
  ck_assert_msg(strstr(err_detail(),
                       "'fc3.*' matches no parameter (parameters here: fc1.weight, "
                       "fc1.bias, ...)"),
                "%s", err_detail());
  nn_module_free(m);
  /* and a valid one shards fc1's weight on its columns */
  one.n_shard_dims = 1;
  m = mlp();
  ok(parallel_apply(m, &one, DEVICE_CPU, &par));
  char buf[64];
  const dtensor_t *w = nn_param_find(m, "fc1.weight")->value;
  ck_assert_str_eq(
      placements_str(mesh_ndim(dtensor_mesh(w)), dtensor_placements(w), buf, sizeof buf), "(S(1))");
  parallel_free(par);
  nn_module_free(m);
}
END_TEST

/* optimizer_sharding: full (HFSDP) in code: the offline placements chunk each dp shard over
 * the replicas (a plain shard when dp_shard is 1), over a tp shard of the same dimension too. */
START_TEST(state_over_replicas_in_code) {
  parallel_plan_t pp;
  parallel_plan_defaults(&pp);
  pp.dp_replicate = 2;
  pp.state_over_replicas = true;
  ok(parallel_plan_add_shard_dim(&pp, "fc2.weight", 1));
  ok(parallel_plan_resolve(&pp, 8));
  const struct {
    const char *fqn;
    int ndim;
    const char *want;
  } cases[] = {{"fc1.weight", 2, "(SS(0,4), S(0))"}, {"fc2.weight", 2, "(SS(1,4), S(1))"}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int md, shape[MESH_MAX_DIMS];
    placement_t pl[MESH_MAX_DIMS];
    char buf[64];
    ok(parallel_param_placements(&pp, cases[i].fqn, "linear", cases[i].ndim, &md, shape, pl));
    placements_str(md, pl, buf, sizeof buf);
    ck_assert_msg(strcmp(buf, cases[i].want) == 0, "%s: %s, want %s", cases[i].fqn, buf,
                  cases[i].want);
    ck_assert(md == 2 && shape[0] == 2 && shape[1] == 4);
  }
  pp.dp_shard = 1;
  pp.dp_replicate = 8;
  int md, shape[MESH_MAX_DIMS];
  placement_t pl[MESH_MAX_DIMS];
  char buf[64];
  ok(parallel_param_placements(&pp, "fc1.weight", "linear", 2, &md, shape, pl));
  ck_assert_str_eq(placements_str(md, pl, buf, sizeof buf), "(S(0), S(0))");
  parallel_plan_defaults(&pp);
  pp.dp_replicate = 2;
  pp.tp = 2;
  pp.state_over_replicas = true;
  ok(parallel_plan_add_tp_rule(&pp, "fc1", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT));
  ok(parallel_plan_add_tp_rule(&pp, "fc2", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT));
  ok(parallel_plan_resolve(&pp, 16));
  ok(parallel_param_placements(&pp, "fc1.weight", "linear", 2, &md, shape, pl));
  ck_assert_str_eq(placements_str(md, pl, buf, sizeof buf), "(SS(0,8), SS(0,2), S(0))");
  /* the box on (2, 4, 2) at (1, 2, 1) of 37 rows: tp 1 has rows 19..36 (18), shard 2 of 4
   * chunks of 5 has rows 10..14 of those, replica 1 of chunks of 3 rows 3..4 of that: global
   * rows 32 and 33 */
  int64_t global[2] = {37, 3}, local[2], off[2];
  int mshape[3] = {2, 4, 2}, coord[3] = {1, 2, 1};
  ok(placements_check(2, 3, mshape, pl));
  placements_local_box(2, global, 3, mshape, pl, coord, local, off);
  ck_assert_msg(local[0] == 2 && off[0] == 32 && local[1] == 3 && off[1] == 0,
                "box %lld rows from %lld", (long long)local[0], (long long)off[0]);
  ok(parallel_param_placements(&pp, "fc2.weight", "linear", 2, &md, shape, pl));
  ck_assert_str_eq(placements_str(md, pl, buf, sizeof buf), "(SS(0,4), S(0), S(1))");
}
END_TEST

/* mesh.ep: a stacked experts' weight on ((dp_replicate,) dp_shard / ep, ep(, tp)), its
 * experts over ep and that split over dp_shard / ep (strided on the experts' dimension),
 * whole on the replicas and tp ranks; every other parameter as without ep. */
START_TEST(expert_placements_follow_mesh_ep) {
  parallel_plan_t pp;
  parallel_plan_defaults(&pp);
  pp.dp_replicate = 2;
  pp.dp_shard = 4;
  pp.ep = 2;
  pp.tp = 2;
  ok(parallel_plan_add_tp_rule(&pp, "fc1", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT));
  ok(parallel_plan_resolve(&pp, 16));
  int md, shape[MESH_MAX_DIMS];
  placement_t pl[MESH_MAX_DIMS];
  char buf[64];
  ok(parallel_param_placements(&pp, "mlp.experts.up_proj", "experts", 3, &md, shape, pl));
  ck_assert_str_eq(placements_str(md, pl, buf, sizeof buf), "(R, SS(0,2), S(0), R)");
  ck_assert(md == 4 && shape[0] == 2 && shape[1] == 2 && shape[2] == 2 && shape[3] == 2);
  /* 8 experts: ep rank 1 holds 4..7, dp_shard_ep rank 1 of those 6..7 */
  int64_t global[3] = {8, 3, 5}, local[3], off[3];
  placements_local_box(3, global, 4, shape, pl, (int[]){1, 1, 1, 0}, local, off);
  ck_assert(local[0] == 2 && off[0] == 6 && local[1] == 3 && local[2] == 5);
  ok(parallel_param_placements(&pp, "fc1.weight", "linear", 2, &md, shape, pl));
  ck_assert_str_eq(placements_str(md, pl, buf, sizeof buf), "(R, SS(0,2), S(0))");
  ck_assert(md == 3 && shape[1] == 4);
  ok(parallel_plan_add_shard_dim(&pp, "mlp.experts.*", 1));
  ok(parallel_param_placements(&pp, "mlp.experts.up_proj", "experts", 3, &md, shape, pl));
  /* (sharded on dimension 1 over dp_shard / ep and tp, tp's chunks innermost, as the experts'
   * fully_shard over the two flattened) */
  ck_assert_str_eq(placements_str(md, pl, buf, sizeof buf), "(R, S(1), S(0), S(1))");
  /* ep 4 on dp_shard 2 x tp 2 borrows the tp ranks: the experts over 2 dp ranks times tp,
   * (dp_shard / 2, 2 x tp) in the world's order; sequence parallelism required */
  parallel_plan_defaults(&pp);
  pp.dp_shard = 2;
  pp.tp = 2;
  pp.ep = 4;
  ok(parallel_plan_add_tp_rule(&pp, "fc1", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT));
  ck_assert_int_eq(parallel_plan_resolve(&pp, 4), STATUS_EINVAL);
  ck_assert_ptr_nonnull(strstr(err_detail(), "sequence parallelism"));
  pp.sequence_parallel = true;
  ok(parallel_plan_resolve(&pp, 4));
  ck_assert(parallel_plan_ep_borrows_tp(&pp));
  ok(parallel_param_placements(&pp, "mlp.experts.up_proj", "experts", 3, &md, shape, pl));
  ck_assert_str_eq(placements_str(md, pl, buf, sizeof buf), "(S(0), S(0))"); /* (one rank) */
  ck_assert(md == 2 && shape[0] == 1 && shape[1] == 4);
  pp.ep = 3;
  ck_assert_int_eq(parallel_plan_resolve(&pp, 4), STATUS_EINVAL);
}
END_TEST

/* The job plan's defaults that stand for another folder's: checkpoint.block_bytes is the
 * checkpoint library's block size (parallel/ cannot include checkpoint/). */
START_TEST(plan_defaults_match_the_libraries) {
  fsdpc_plan_t p;
  plan_defaults(&p);
  ck_assert_int_eq(p.ckpt_block_bytes, (int64_t)DCP_BLOCK_BYTES_DEFAULT);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("parallel");
  TCase *tc = tcase_create("parallel");
  tcase_add_test(tc, plan_in_code_applies_to_any_model);
  tcase_add_test(tc, model_and_plan_free_in_either_order);
  tcase_add_test(tc, placements_follow_module_kinds);
  tcase_add_test(tc, shard_dims_in_code);
  tcase_add_test(tc, state_over_replicas_in_code);
  tcase_add_test(tc, expert_placements_follow_mesh_ep);
  tcase_add_test(tc, plan_defaults_match_the_libraries);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
