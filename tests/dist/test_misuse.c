/*
 * The library misused as a user's own training loop may misuse it: each call must be refused
 * with a status that names the problem (the same on every rank where it is collective), never
 * crash, hang, or compute something else. Runs on one rank and on two.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint/dcp.h"
#include "checkpoint/hf_weights.h"
#include "checkpoint/train_ckpt.h"
#include "core/file.h"
#include "fully_shard/fsdp.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "parallel/tensor_parallel.h"
#include "tests/harness.h"

#define ok(call) ck_assert_msg((call) == STATUS_OK, "%s: %s", #call, err_detail())

/* call must fail with a message holding want. */
#define refused(call, want)                                                    \
  do {                                                                         \
    fsdpc_status_t st_ = (call);                                               \
    ck_assert_msg(st_ != STATUS_OK && strstr(err_detail(), want) != NULL,      \
                  "%s: expected a refusal naming \"%s\", got %s", #call, want, \
                  st_ == STATUS_OK ? "success" : err_detail());                \
  } while (0)

/* fc1 (4 -> 8), gelu, fc2 (8 -> 2) */
static nn_module_t *mlp(bool deferred) {
  nn_module_t *m = NULL;
  nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;
  lo.deferred = deferred;
  ok(nn_sequential_new(NULL, "", &m));
  ok(nn_linear_new(m, "fc1", 4, 8, true, &lo, NULL));
  ok(nn_activation_new(m, "act1", KERNEL_ACT_GELU, NULL));
  ok(nn_linear_new(m, "fc2", 8, 2, true, &lo, NULL));
  ok(nn_module_finalize(m));
  return m;
}

static mesh_t *world_mesh(void) {
  mesh_t *m = NULL;
  ok(mesh_new(1, (int[]){world_size()}, (const char *[]){"dp"}, DEVICE_CPU, &m));
  return m;
}

static nn_var_t *input(void) {
  fsdpc_tensor_t x;
  ok(tensor_init(&x, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 4}));
  for (int i = 0; i < 8; i++) ((float *)x.data)[i] = (float)nn_init_normal_value(3, "x", i);
  nn_var_t *v = NULL;
  ok(nn_var_new(&x, false, &v));
  return v;
}

/* The sum of the outputs of m on the input, as a loss recorded on ctx. */
static nn_var_t *loss_of(nn_ctx_t *ctx, nn_module_t *m) {
  nn_var_t *in = input(), *out = NULL, *l = NULL;
  fsdpc_tensor_t zero;
  ok(tensor_zeros(&zero, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 2}));
  ok(nn_call(ctx, m, in, &out));
  ok(nn_mse_loss(ctx, out, &zero, &l));
  tensor_free(&zero);
  nn_var_put(out);
  nn_var_put(in);
  return l;
}

START_TEST(fully_shard_checks_its_options) {
  mesh_t *mesh = world_mesh();
  nn_module_t *m = mlp(false), *other = mlp(false);
  fsdp_options_t fo = FSDP_OPTIONS_INIT;
  fo.mesh = mesh;
  fo.param_dtype = (dtype_t)42;
  refused(fully_shard(m, &fo, NULL), "param_dtype 42 is not a floating-point dtype");
  fo.param_dtype = DTYPE_COUNT;
  fo.reduce_dtype = DTYPE_I32; /* would truncate every gradient */
  refused(fully_shard(m, &fo, NULL), "reduce_dtype");
  fo.reduce_dtype = DTYPE_COUNT;
  fo.n_ignored = 2;
  refused(fully_shard(m, &fo, NULL), "2 ignored parameters given without their list");
  fo.n_ignored = 0;
  refused(
      fully_shard_modules((nn_module_t *[]){nn_module_find(m, "fc1"), nn_module_find(other, "fc1")},
                          2, &fo, NULL),
      "belongs to another model");
  /* prefetch lists: no NULL entry, no group of another model */
  fsdp_group_t *g1 = NULL, *g2 = NULL, *go = NULL;
  ok(fully_shard(nn_module_find(m, "fc1"), &fo, &g1));
  ok(fully_shard(nn_module_find(m, "fc2"), &fo, &g2));
  ok(fully_shard(other, &fo, &go));
  refused(fsdp_set_forward_prefetch(g1, (fsdp_group_t *[]){NULL}, 1), "is NULL");
  refused(fsdp_set_forward_prefetch(g1, NULL, 3), "without the list");
  refused(fsdp_set_backward_prefetch(g2, (fsdp_group_t *[]){go}, 1), "a group of another model");
  ok(fsdp_set_forward_prefetch(g1, (fsdp_group_t *[]){g2}, 1));
  nn_module_free(other); /* its groups go with it; m's keep working */
  nn_ctx_t *ctx = NULL;
  ok(nn_ctx_new(&ctx));
  nn_var_t *l = loss_of(ctx, m);
  ok(nn_backward(ctx, l));
  nn_var_put(l);
  nn_ctx_free(ctx);
  nn_module_free(m);
  mesh_free(mesh);
}
END_TEST

/* A parameter added after fully_shard would be neither sharded nor reduced: the first forward
 * refuses it by name. The ignored list is the group's own copy: the caller's may go. */
START_TEST(parameters_after_fully_shard_are_refused) {
  mesh_t *mesh = world_mesh();
  nn_module_t *m = mlp(false), *late = mlp(false);
  fsdp_options_t fo = FSDP_OPTIONS_INIT;
  fo.mesh = mesh;
  {
    nn_param_t *ig[1] = {nn_module_param(nn_module_find(m, "fc2"), 1)};
    fo.ignored = ig;
    fo.n_ignored = 1;
    ok(fully_shard(m, &fo, NULL));
    memset(ig, 0, sizeof ig); /* the caller's list, gone */
  }
  fo.ignored = NULL;
  fo.n_ignored = 0;
  nn_ctx_t *ctx = NULL;
  ok(nn_ctx_new(&ctx));
  nn_var_t *l = loss_of(ctx, m); /* the ignored bias is not taken for a late one */
  ok(nn_backward(ctx, l));
  nn_var_put(l);
  nn_ctx_free(ctx);
  ok(fully_shard(late, &fo, NULL));
  fsdpc_tensor_t t;
  ok(tensor_zeros(&t, DTYPE_F32, device_cpu(), 1, (int64_t[]){8}));
  placement_t rep = placement_replicate();
  dtensor_t *d = NULL;
  ok(dtensor_from_local(&t, mesh, &rep, 1, (int64_t[]){8}, &d));
  tensor_free(&t);
  ok(nn_module_add_param(nn_module_find(late, "fc1"), "extra", d, true, NULL));
  ok(nn_ctx_new(&ctx));
  nn_var_t *in = input(), *out = NULL;
  refused(nn_call(ctx, late, in, &out), "parameter 'fc1.extra' was added after fully_shard");
  nn_var_put(in);
  nn_ctx_free(ctx);
  nn_module_free(late);
  nn_module_free(m);
  mesh_free(mesh);
}
END_TEST

START_TEST(tensors_without_memory_and_narrow_bounds) {
  fsdpc_tensor_t z = {0}, out = {0}, t;
  bool eq;
  refused(tensor_fill(&z, 1), "has no memory");
  refused(tensor_clone(&out, &z, DTYPE_F32, device_cpu()), "has no memory");
  refused(tensor_equal(&z, &z, &eq), "has no memory");
  nn_var_t *v = NULL;
  refused(nn_var_new(&z, false, &v), "has no memory");
  ok(tensor_init(&t, DTYPE_F32, device_cpu(), 2, (int64_t[]){4, 6}));
  refused(tensor_copy(&t, &(fsdpc_tensor_t){.dtype = DTYPE_F32, .ndim = 2, .shape = {4, 6}}),
          "has no memory");
  refused(tensor_narrow(&out, &t, 0, INT64_MAX - 1, 2), "outside dimension 0");
  refused(tensor_narrow(&out, &t, 0, 2, INT64_MAX), "outside dimension 0");
  tensor_free(&t);
}
END_TEST

START_TEST(optimizer_and_checkpoint_pairing) {
  mesh_t *mesh = world_mesh();
  nn_module_t *m = mlp(false);
  fsdp_options_t fo = FSDP_OPTIONS_INIT;
  fo.mesh = mesh;
  ok(fully_shard(m, &fo, NULL));
  nn_param_t **ps = NULL;
  int n = 0;
  ok(nn_named_parameters(m, &ps, &n));
  adamw_config_t ac = ADAMW_CONFIG_INIT;
  optim_t *opt = NULL;
  refused(optim_new((nn_param_t *[]){ps[0], ps[1], ps[0]}, 3, &ac, &opt), "is given twice");
  ok(optim_new(ps, n, &ac, &opt));
  refused(optim_step(opt, NAN), "learning-rate factor");
  /* the moments of parameter i are the optimizer's slot i: another order is refused, on every
   * rank, before anything is written */
  char dir[64];
  snprintf(dir, sizeof dir, "/tmp/fsdpc-misuse-%d", (int)getpid());
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  nn_param_t *swapped[4] = {ps[1], ps[0], ps[2], ps[3]};
  refused(ckpt_save_training(dir, swapped, n, opt, 1, NULL, world_pg()),
          "is not the optimizer's parameter 0");
  ck_assert_msg(access(dir, F_OK) != 0, "a refused save wrote %s", dir);
  /* what train_state.json records: a step of none or more, saved_under a JSON object */
  refused(ckpt_save_training(dir, ps, n, opt, -5, NULL, world_pg()), "step -5 is negative");
  refused(ckpt_save_training(dir, ps, n, opt, 1, "this is {not json", world_pg()),
          "saved_under is not a JSON object");
  refused(ckpt_save_training(dir, ps, n, opt, 1, "[1, 2]", world_pg()),
          "saved_under is not a JSON object");
  ck_assert_msg(access(dir, F_OK) != 0, "a refused save wrote %s", dir);
  int64_t step = 0;
  refused(ckpt_load_training(dir, ps, n, NULL, &step, NULL), "opt is NULL");
  optim_free(opt);
  free(ps);
  nn_module_free(m);
  mesh_free(mesh);
  /* a meta model has no values to save: refused naming nn_module_materialize, no file left */
  nn_module_t *meta = mlp(true);
  char path[96];
  snprintf(path, sizeof path, "%s-meta-%d.safetensors", dir, world_rank());
  refused(ckpt_save_weights(meta, path), "nn_module_materialize");
  char tmp[128];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  ck_assert_msg(access(path, F_OK) != 0 && access(tmp, F_OK) != 0, "a refused save left %s", path);
  nn_module_free(meta);
}
END_TEST

static int ran_a, ran_b;
static fsdpc_status_t hook_once(nn_ctx_t *c, nn_module_t *m, nn_hook_kind_t k, void *u) {
  (void)c;
  (void)k;
  ran_a++;
  nn_module_remove_hooks(m, u); /* a one-shot hook */
  return STATUS_OK;
}
static fsdpc_status_t hook_count(nn_ctx_t *c, nn_module_t *m, nn_hook_kind_t k, void *u) {
  (void)c;
  (void)m;
  (void)k;
  (void)u;
  ran_b++;
  return STATUS_OK;
}

START_TEST(backward_and_hooks) {
  nn_module_t *m = mlp(false);
  int ta, tb;
  ok(nn_module_add_hook(m, NN_HOOK_PRE_FORWARD, hook_once, &ta));
  ok(nn_module_add_hook(m, NN_HOOK_PRE_FORWARD, hook_count, &tb));
  nn_ctx_t *ctx = NULL, *other = NULL;
  ok(nn_ctx_new(&ctx));
  ok(nn_ctx_new(&other));
  nn_var_t *l = loss_of(ctx, m);
  ck_assert_msg(ran_a == 1 && ran_b == 1, "a hook that removed itself skipped the next (%d, %d)",
                ran_a, ran_b);
  refused(nn_backward(other, l), "not on this context's tape");
  ok(nn_backward(ctx, l));
  refused(nn_backward(ctx, l), "not on this context's tape"); /* twice */
  nn_var_put(l);
  nn_var_t *l2 = loss_of(ctx, m);
  ck_assert_msg(ran_a == 1 && ran_b == 2, "hooks after the removal: %d, %d", ran_a, ran_b);
  ok(nn_backward(ctx, l2));
  nn_var_put(l2);
  nn_ctx_free(other);
  nn_ctx_free(ctx);
  nn_module_free(m);
}
END_TEST

/* Integer tensors where floats are taken: an integer input to a module with parameters is
 * named as such (not as a mixed-precision mismatch), and an integer target of nn_mse_loss is
 * refused. */
START_TEST(integer_inputs_are_named) {
  mesh_t *mesh = world_mesh();
  nn_module_t *m = mlp(false);
  fsdp_options_t fo = FSDP_OPTIONS_INIT;
  fo.mesh = mesh;
  ok(fully_shard(m, &fo, NULL));
  nn_ctx_t *ctx = NULL;
  ok(nn_ctx_new(&ctx));
  fsdpc_tensor_t ids, target;
  ok(tensor_zeros(&ids, DTYPE_I32, device_cpu(), 2, (int64_t[]){2, 4}));
  ok(tensor_zeros(&target, DTYPE_I32, device_cpu(), 2, (int64_t[]){2, 2}));
  nn_var_t *in = NULL, *out = NULL, *l = NULL;
  ok(nn_var_new(&ids, false, &in));
  fsdpc_status_t st = nn_call(ctx, m, in, &out);
  ck_assert_msg(st != STATUS_OK &&
                    strstr(err_detail(),
                           "fc1: its input has dtype i32 (a module "
                           "with parameters takes a floating-point "
                           "input)") &&
                    !strstr(err_detail(), "mp_policy"),
                "%s", st ? err_detail() : "ok");
  nn_var_put(in);
  nn_ctx_free(ctx);
  ok(nn_ctx_new(&ctx));
  in = input();
  ok(nn_call(ctx, m, in, &out));
  refused(nn_mse_loss(ctx, out, &target, &l),
          "nn_mse_loss: prediction f32 and target i32: both "
          "take a floating-point dtype");
  nn_var_put(out);
  nn_var_put(in);
  nn_ctx_free(ctx);
  tensor_free(&ids);
  tensor_free(&target);
  fsdp_free_all(m);
  nn_module_free(m);
  mesh_free(mesh);
}
END_TEST

/* dtensor_distribute from one rank whose tensor's shape the others do not share: every rank is
 * refused alike (before: the source returned ok and the others an MPI truncation error). */
START_TEST(distribute_agrees_on_the_shape) {
  mesh_t *mesh = world_mesh();
  fsdpc_tensor_t f;
  int rows = world_rank() == world_size() - 1 ? 6 : 4;
  ok(tensor_zeros(&f, DTYPE_F32, device_cpu(), 2, (int64_t[]){rows, 3}));
  dtensor_t *x = NULL;
  fsdpc_status_t st = dtensor_distribute(&f, mesh, (placement_t[]){placement_replicate()}, 0, &x);
  bool want_ok = world_size() == 1;
  expect_all(want_ok ? st == STATUS_OK
                     : st == STATUS_ESHAPE && strstr(err_detail(), "different shapes") != NULL,
             "dtensor_distribute of unequal shapes: %s", st ? err_detail() : "ok");
  dtensor_free(x);
  tensor_free(&f);
  mesh_t *bad = NULL;
  refused(mesh_new(1, (int[]){world_size()}, (const char *[]){"dp"}, (device_type_t)7, &bad),
          "device type 7");
  mesh_free(mesh);
}
END_TEST

/* fully_shard agrees on its unit over the mesh: a rank whose module has another shape, or that
 * shards another module, is refused on every rank (it would gather other ranks' bytes as its
 * own, or wait for good). */
START_TEST(fully_shard_agrees_on_the_unit) {
  mesh_t *mesh = world_mesh();
  nn_module_t *m = NULL;
  int last = world_rank() == world_size() - 1;
  ok(nn_sequential_new(NULL, "", &m));
  ok(nn_linear_new(m, "fc", 8, last ? 12 : 16, false, NULL, NULL));
  ok(nn_module_finalize(m));
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  fsdpc_status_t st = fully_shard(m, &opt, NULL);
  expect_all(world_size() == 1 ? st == STATUS_OK
                               : st == STATUS_EINVAL && strstr(err_detail(),
                                                               "shard different "
                                                               "parameters") != NULL,
             "fully_shard of unequal shapes: %s", st ? err_detail() : "ok");
  nn_module_free(m);
  mesh_free(mesh);
}
END_TEST

/* fully_shard of mlp() on mesh with the last rank's option k other (0: reshard_after_forward,
 * 1: param_dtype): refused on every rank, naming the options, when more than one rank. */
static void expect_unequal_options(mesh_t *mesh, int k, const char *what) {
  int last = world_rank() == world_size() - 1;
  nn_module_t *m = mlp(false);
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  if (k == 0) opt.reshard_after_forward = last ? 0 : 1;
  if (k == 1) opt.param_dtype = last ? DTYPE_BF16 : DTYPE_COUNT;
  fsdpc_status_t st = fully_shard(m, &opt, NULL);
  expect_all(world_size() == 1
                 ? st == STATUS_OK
                 : st == STATUS_EINVAL && strstr(err_detail(), "pass different options") != NULL,
             "fully_shard with unequal options (%s): %s", what, st ? err_detail() : "ok");
  nn_module_free(m);
}

/* fully_shard agrees on the options that shape its collectives: a rank passing another
 * reshard_after_forward or param_dtype is refused on every rank (it would gather, reduce and
 * reshard other byte counts: an MPI truncation at the first forward); on a 2-D mesh
 * (replicate, shard) too, none left waiting in another group's exchange (before: the other
 * replicas hung). */
START_TEST(fully_shard_agrees_on_the_options) {
  mesh_t *mesh = world_mesh();
  expect_unequal_options(mesh, 0, "reshard_after_forward");
  expect_unequal_options(mesh, 1, "param_dtype");
  mesh_free(mesh);
  if (world_size() % 2 == 0 && world_size() >= 4) {
    mesh_t *two = NULL;
    ok(mesh_new(2, (int[]){world_size() / 2, 2}, (const char *[]){"rep", "shard"}, DEVICE_CPU,
                &two));
    expect_unequal_options(two, 1, "param_dtype, 2-D mesh");
    mesh_free(two);
  }
}
END_TEST

/* A module of a unit that holds none of its parameters (an activation) called on its own, on
 * one rank only: nothing is gathered, so nothing is agreed with the other ranks (before: they
 * were waited for until on_demand_timeout, then the job was stopped). */
START_TEST(a_member_without_parameters_is_no_on_demand_call) {
  mesh_t *mesh = world_mesh();
  nn_module_t *m = mlp(false);
  fsdp_options_t fo = FSDP_OPTIONS_INIT;
  fo.mesh = mesh;
  fo.on_demand_timeout = 5;
  ok(fully_shard(nn_module_child_named(m, "fc1"), &fo, NULL));
  ok(fully_shard(nn_module_child_named(m, "fc2"), &fo, NULL));
  ok(fully_shard(m, &fo, NULL)); /* the root unit: no parameters of its own */
  nn_ctx_t *ctx = NULL;
  ok(nn_ctx_new(&ctx));
  nn_var_t *l = loss_of(ctx, m);
  ok(nn_backward(ctx, l));
  nn_var_put(l);
  if (world_rank() == 0) {
    nn_ctx_set_grad_enabled(ctx, false);
    fsdpc_tensor_t x;
    ok(tensor_zeros(&x, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 8}));
    nn_var_t *in = NULL, *out = NULL;
    ok(nn_var_new(&x, false, &in));
    ok(nn_call(ctx, nn_module_child_named(m, "act1"), in, &out));
    nn_var_put(out);
    nn_var_put(in);
    nn_ctx_set_grad_enabled(ctx, true);
  }
  l = loss_of(ctx, m);
  ok(nn_backward(ctx, l));
  nn_var_put(l);
  nn_ctx_free(ctx);
  nn_module_free(m);
  mesh_free(mesh);
}
END_TEST

/* dtensor_distribute from a source rank agrees on the placements too; Partial(avg) of an
 * integer tensor is refused at once (an average would truncate), not at its first reduction. */
START_TEST(distribute_agrees_on_the_placements) {
  mesh_t *mesh = world_mesh();
  fsdpc_tensor_t f, i64;
  ok(tensor_zeros(&f, DTYPE_F32, device_cpu(), 2, (int64_t[]){4, 3}));
  ok(tensor_zeros(&i64, DTYPE_I64, device_cpu(), 1, (int64_t[]){4}));
  placement_t pl = world_rank() == world_size() - 1 ? placement_replicate() : placement_shard(0);
  dtensor_t *x = NULL;
  fsdpc_status_t st = dtensor_distribute(&f, mesh, &pl, 0, &x);
  expect_all(world_size() == 1
                 ? st == STATUS_OK
                 : st != STATUS_OK && strstr(err_detail(), "different placements") != NULL,
             "dtensor_distribute of unequal placements: %s", st ? err_detail() : "ok");
  dtensor_free(x);
  x = NULL;
  /* every rank passing the data: the shapes are compared all the same (a rank passing another
   * one would shard another tensor) */
  fsdpc_tensor_t other;
  ok(tensor_zeros(&other, DTYPE_F32, device_cpu(), 2, (int64_t[]){world_rank() == 0 ? 12 : 4, 3}));
  st = dtensor_distribute(&other, mesh, (placement_t[]){placement_shard(0)}, DTENSOR_ALL_RANKS, &x);
  expect_all(world_size() == 1
                 ? st == STATUS_OK
                 : st != STATUS_OK && strstr(err_detail(), "pass tensors of different shapes"),
             "dtensor_distribute (every rank the source) of unequal shapes: %s",
             st ? err_detail() : "ok");
  dtensor_free(x);
  x = NULL;
  tensor_free(&other);
  refused(dtensor_distribute(&i64, mesh, (placement_t[]){placement_partial(REDUCE_AVG)},
                             DTENSOR_ALL_RANKS, &x),
          "Partial(avg) on mesh dimension 0 needs a floating-point dtype, got i64");
  ok(dtensor_distribute(&i64, mesh, (placement_t[]){placement_shard(0)}, DTENSOR_ALL_RANKS, &x));
  dtensor_t *y = NULL;
  refused(dtensor_redistribute(x, (placement_t[]){placement_partial(REDUCE_AVG)}, &y),
          "needs a floating-point dtype");
  dtensor_free(x);
  tensor_free(&i64);
  tensor_free(&f);
  mesh_free(mesh);
}
END_TEST

/* dcp_save and dcp_load check their entries: a NULL or empty name, a NULL value, no entries,
 * ranks passing other entries (every rank refused, nothing written), and a load into a
 * Partial DTensor, whose every local term would receive the whole value. */
START_TEST(checkpoint_entries_are_checked) {
  mesh_t *mesh = world_mesh();
  fsdpc_tensor_t f;
  ok(tensor_init(&f, DTYPE_F32, device_cpu(), 2, (int64_t[]){7, 3}));
  for (int i = 0; i < 21; i++) ((float *)f.data)[i] = (float)(3 * i + 1);
  dtensor_t *a = NULL, *b = NULL, *p = NULL;
  ok(dtensor_distribute(&f, mesh, (placement_t[]){placement_shard(0)}, DTENSOR_ALL_RANKS, &a));
  ok(dtensor_distribute(&f, mesh, (placement_t[]){placement_replicate()}, DTENSOR_ALL_RANKS, &b));
  char dir[64];
  snprintf(dir, sizeof dir, "/tmp/fsdpc-entries-%d", (int)getpid());
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  refused(dcp_save(dir, (dcp_entry_t[]){{NULL, a}}, 1, world_pg()), "entry 0 has a NULL name");
  refused(dcp_save(dir, (dcp_entry_t[]){{"w", NULL}}, 1, world_pg()),
          "entry 0 ('w') has a NULL value");
  refused(dcp_save(dir, NULL, 0, world_pg()), "nothing to save");
  /* the last rank leaves out its shard of "v" (Shard(0): 7 rows over the ranks), or its
   * replica of "w", which the others save: refused on every rank (ranks saving different
   * tensors, a pipeline's stages, are not) */
  int last = world_rank() == world_size() - 1;
  for (int k = 0; k < 2; k++) {
    dcp_entry_t both[2] = {{"w", b}, {"v", a}};
    if (k == 1) both[0] = (dcp_entry_t){"v", a}, both[1] = (dcp_entry_t){"w", b};
    fsdpc_status_t st = dcp_save(dir, both, last ? 1 : 2, world_pg());
    char want[96];
    snprintf(want, sizeof want, "tensor '%s' is passed by %d rank%s, its mesh has %d",
             k == 0 ? "v" : "w", world_size() - 1, world_size() == 2 ? "" : "s", world_size());
    expect_all(world_size() == 1 ? st == STATUS_OK
                                 : st == STATUS_EINVAL && strstr(err_detail(), want) != NULL,
               "dcp_save of a %s tensor a rank leaves out: %s", k == 0 ? "sharded" : "replicated",
               st ? err_detail() : "ok");
    if (world_size() > 1) ck_assert_msg(access(dir, F_OK) != 0, "a refused save wrote %s", dir);
    if (world_size() == 1) file_remove_tree(dir);
  }
  /* a replicated tensor of another shape on one rank (its replica is never written) */
  fsdpc_tensor_t g;
  ok(tensor_zeros(&g, DTYPE_F32, device_cpu(), 2, (int64_t[]){last ? 5 : 7, 3}));
  dtensor_t *c = NULL;
  ok(dtensor_from_local(&g, mesh, (placement_t[]){placement_replicate()}, 2, g.shape, &c));
  fsdpc_status_t st = dcp_save(dir, (dcp_entry_t[]){{"w", c}}, 1, world_pg());
  expect_all(world_size() == 1
                 ? st == STATUS_OK
                 : st == STATUS_EINVAL && strstr(err_detail(), "disagree on its shape or dtype"),
             "dcp_save of a replicated tensor of another shape on one rank: %s",
             st ? err_detail() : "ok");
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) file_remove_tree(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  dtensor_free(c);
  tensor_free(&g);
  /* a tensor without elements: nothing to write or read, refused by both */
  dtensor_t *e0 = NULL;
  ok(tensor_zeros(&g, DTYPE_F32, device_cpu(), 2, (int64_t[]){0, 3}));
  ok(dtensor_distribute(&g, mesh, (placement_t[]){placement_shard(0)}, DTENSOR_ALL_RANKS, &e0));
  refused(dcp_save(dir, (dcp_entry_t[]){{"w", a}, {"none", e0}}, 2, world_pg()),
          "tensor 'none' has no elements (shape [0,3]): a checkpoint holds tensors with elements");
  ck_assert_msg(access(dir, F_OK) != 0, "a refused save wrote %s", dir);
  ok(dcp_save(dir, (dcp_entry_t[]){{"w", a}, {"v", b}}, 2, world_pg()));
  refused(dcp_load(dir, (dcp_entry_t[]){{NULL, a}}, 1, NULL), "entry 0 has a NULL name");
  ok(dtensor_distribute(&f, mesh, (placement_t[]){placement_partial(REDUCE_SUM)}, DTENSOR_ALL_RANKS,
                        &p));
  refused(dcp_load(dir, (dcp_entry_t[]){{"w", p}}, 1, NULL),
          "has placement P(sum) on mesh dimension 0");
  ok(dcp_load(dir, (dcp_entry_t[]){{"w", b}}, 1, NULL));
  refused(dcp_load(dir, (dcp_entry_t[]){{"none", e0}}, 1, NULL), "tensor 'none' has no elements");
  dtensor_free(e0);
  tensor_free(&g);
  fsdpc_tensor_t full;
  ok(dtensor_full_tensor(b, &full));
  for (int i = 0; i < 21; i++)
    ck_assert_msg(((float *)full.data)[i] == (float)(3 * i + 1), "loaded w[%d] = %g", i,
                  ((float *)full.data)[i]);
  tensor_free(&full);
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) file_remove_tree(dir);
  dtensor_free(p);
  dtensor_free(b);
  dtensor_free(a);
  tensor_free(&f);
  mesh_free(mesh);
}
END_TEST

/* tensor_parallel over a tp dimension of one rank, then fully_shard over the data-parallel
 * one: composes (it was refused, the weights being Shard(0) on the one-rank mesh), and trains
 * what the plain model computes. */
START_TEST(tensor_parallel_of_one_rank_composes) {
  mesh_t *mesh = NULL, *tpm = NULL, *dpm = NULL;
  ok(mesh_new(2, (int[]){world_size(), 1}, (const char *[]){"dp_shard", "tp"}, DEVICE_CPU, &mesh));
  ok(mesh_slice(mesh, 1, (const char *[]){"tp"}, &tpm));
  ok(mesh_slice(mesh, 1, (const char *[]){"dp_shard"}, &dpm));
  nn_module_t *m = mlp(false), *plain = mlp(false);
  ok(nn_module_reset_parameters(m, 5));
  ok(nn_module_reset_parameters(plain, 5));
  tp_plan_t *tp = NULL;
  tp_rule_t rules[] = {{"fc1", TP_COLWISE, 0, 0}, {"fc2", TP_ROWWISE, 0, 0}};
  ok(tensor_parallel(m, tpm, rules, 2, false, &tp));
  fsdp_options_t fo = FSDP_OPTIONS_INIT;
  fo.mesh = dpm;
  ok(fully_shard(m, &fo, NULL));
  nn_ctx_t *ctx = NULL;
  ok(nn_ctx_new(&ctx));
  nn_var_t *a = loss_of(ctx, m), *b = loss_of(ctx, plain);
  double x = 0, y = 0;
  ok(nn_var_scalar(a, &x));
  ok(nn_var_scalar(b, &y));
  ck_assert_msg(fabs(x - y) <= 1e-6 * fabs(y), "tp of one rank x fsdp: loss %.9g, plain %.9g", x,
                y);
  nn_var_put(a);
  nn_var_put(b);
  nn_ctx_free(ctx);
  nn_module_free(plain);
  nn_module_free(m);
  tp_free(tp);
  mesh_free(dpm);
  mesh_free(tpm);
  mesh_free(mesh);
}
END_TEST

/* A tensor_parallel that fails on its second rule leaves the model without what it installed:
 * a forward after it runs the plain modules (or fails naming why), never through the freed
 * plan. */
START_TEST(failed_tensor_parallel_leaves_no_wrapper) {
  int W = world_size();
  if (W < 2) return;
  mesh_t *tpm = NULL;
  ok(mesh_new(1, (int[]){W}, (const char *[]){"tp"}, DEVICE_CPU, &tpm));
  nn_module_t *m = NULL;
  ok(nn_sequential_new(NULL, "", &m));
  ok(nn_linear_new(m, "fc1", 4, 6, true, NULL, NULL));
  ok(nn_linear_new(m, "fc2", 6, W + 1, true, NULL, NULL)); /* W + 1 rows: colwise refused */
  ok(nn_module_finalize(m));
  ok(nn_module_reset_parameters(m, 5));
  tp_rule_t rules[] = {{"fc1", TP_ROWWISE, 0, 0}, {"fc2", TP_COLWISE, 0, 0}};
  tp_plan_t *tp = NULL;
  ck_assert_int_ne(tensor_parallel(m, tpm, rules, 2, false, &tp), STATUS_OK);
  ck_assert_ptr_null(tp);
  ck_assert_int_eq(nn_module_num_hooks(nn_module_find(m, "fc1"), NN_HOOK_PRE_BACKWARD), 0);
  fsdpc_tensor_t x;
  ok(tensor_init(&x, DTYPE_F32, device_cpu(), 2, (int64_t[]){2, 4}));
  ok(tensor_fill(&x, 1));
  nn_ctx_t *ctx = NULL;
  nn_var_t *in = NULL, *out = NULL;
  ok(nn_ctx_new(&ctx));
  ok(nn_var_new(&x, false, &in));
  fsdpc_status_t st = nn_call(ctx, m, in, &out); /* fc1 Shard(0) on tp: a shape error, or runs */
  ck_assert(st == STATUS_OK || err_detail()[0] != 0);
  nn_var_put(out);
  nn_var_put(in);
  nn_ctx_free(ctx);
  tensor_free(&x);
  nn_module_free(m);
  mesh_free(tpm);
}
END_TEST

/* A parameter written between its unit's forward and backward (the unit resharded after
 * forward, so nothing held it): the backward would gather the new values, not those the
 * forward used; refused there, naming the unit, on every rank. */
START_TEST(written_between_forward_and_backward) {
  mesh_t *mesh = world_mesh();
  nn_module_t *m = mlp(false);
  ok(nn_module_reset_parameters(m, 5));
  fsdp_options_t fo = FSDP_OPTIONS_INIT;
  fo.mesh = mesh;
  ok(fully_shard(nn_module_find(m, "fc1"), &fo, NULL));
  ok(fully_shard(nn_module_find(m, "fc2"), &fo, NULL));
  ok(fully_shard(m, &fo, NULL));
  nn_ctx_t *ctx = NULL;
  ok(nn_ctx_new(&ctx));
  nn_var_t *l = loss_of(ctx, m);
  nn_param_t *w = nn_param_find(m, "fc1.weight");
  fsdpc_tensor_t zeros;
  ok(tensor_zeros(&zeros, DTYPE_F32, device_cpu(), 2, (int64_t[]){8, 4}));
  ok(nn_param_copy_full(w, &zeros)); /* fc1 resharded after its forward: the write goes on */
  refused(nn_backward(ctx, l), "was written (an optimizer step, a copy, a load) between");
  nn_var_put(l);
  nn_ctx_free(ctx);
  /* a step of its own afterwards runs */
  ok(nn_ctx_new(&ctx));
  l = loss_of(ctx, m);
  ok(nn_backward(ctx, l));
  nn_var_put(l);
  nn_ctx_free(ctx);
  tensor_free(&zeros);
  nn_module_free(m);
  mesh_free(mesh);
}
END_TEST

/* A watchdog of a negative or NaN count is refused, the one in force kept (read as 0 it
 * would have waited forever). */
START_TEST(watchdog_refuses_nonsense) {
  double before = world_timeout();
  refused(world_set_timeout(-5), "no number of seconds");
  refused(world_set_timeout(NAN), "no number of seconds");
  ck_assert(world_timeout() == before);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("misuse");
  TCase *tc = tcase_create("misuse");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, fully_shard_checks_its_options);
  tcase_add_test(tc, failed_tensor_parallel_leaves_no_wrapper);
  tcase_add_test(tc, written_between_forward_and_backward);
  tcase_add_test(tc, watchdog_refuses_nonsense);
  tcase_add_test(tc, parameters_after_fully_shard_are_refused);
  tcase_add_test(tc, tensors_without_memory_and_narrow_bounds);
  tcase_add_test(tc, optimizer_and_checkpoint_pairing);
  tcase_add_test(tc, backward_and_hooks);
  tcase_add_test(tc, integer_inputs_are_named);
  tcase_add_test(tc, distribute_agrees_on_the_shape);
  tcase_add_test(tc, fully_shard_agrees_on_the_unit);
  tcase_add_test(tc, fully_shard_agrees_on_the_options);
  tcase_add_test(tc, distribute_agrees_on_the_placements);
  tcase_add_test(tc, a_member_without_parameters_is_no_on_demand_call);
  tcase_add_test(tc, checkpoint_entries_are_checked);
  tcase_add_test(tc, tensor_parallel_of_one_rank_composes);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
