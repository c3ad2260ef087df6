/*
 * fully_shard's layouts beyond dimension 0 and HSDP: parameters sharded on another dimension
 * (shard_dim) hold exactly the chunk-rule slices along it, uneven sizes included, and gather
 * back whole; a dimension a parameter lacks is refused by name. With "hsdp[:R] hfsdp" (HFSDP),
 * a hand-made change to the 1/(R*S) shards reaches the gathered parameters after
 * fsdp_params_changed, and not before. Training parity for both is test_fsdp's.
 */
#include <stdio.h>
#include <string.h>

#include "tests/dist/fsdp_common.h"

/* Shard dimensions: p0 its last (-1), p1 and p2 dimension 1 (p2's middle one), p3 0. */
static const int test_dims[] = {-1, 1, 1, 0};
static int dim_of_name(const nn_param_t *p, void *user) {
  (void)user;
  return test_dims[p->fqn[1] - '0'];
}

START_TEST(shard_dims_are_chunks) {
  mesh_t *mesh = dp_mesh(), *local;
  ok(mesh_new_local("local", DEVICE_CPU, &local));
  static const int64_t shapes[][3] = {{4, 15, 0}, {3, 17, 0}, {2, 7, 5}, {9, 0, 0}};
  static const int ndims[] = {2, 2, 3, 1};
  nn_module_t *root = params_module(local, 4, ndims, shapes);
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  opt.shard_dim = dim_of_name;
  fsdp_group_t *g;
  ok(fully_shard(root, &opt, &g));
  int md = mesh_ndim(mesh), W = mesh_size(mesh, md - 1), r = mesh_coord(mesh, md - 1);
  int bad = 0;
  int64_t padded = 0;
  for (int i = 0; i < 4; i++) {
    char name[16];
    snprintf(name, sizeof name, "p%d", i);
    nn_param_t *p = nn_param_find(root, name);
    int nd = dtensor_ndim(p->value), dim = test_dims[i] < 0 ? test_dims[i] + nd : test_dims[i];
    const placement_t *pl = dtensor_placements(p->value);
    if (!placement_is_shard(pl[md - 1], dim)) bad++;
    const fsdpc_tensor_t *l = dtensor_local(p->value);
    int64_t start, len, n = shapes[i][dim], numel = 1, inner = 1;
    for (int k = 0; k < nd; k++) numel *= shapes[i][k];
    for (int k = dim + 1; k < nd; k++) inner *= shapes[i][k];
    placement_chunk_range(n, W, r, &start, &len);
    padded += numel / n * placement_chunk_size(n, W);
    if (l->shape[dim] != len || !tensor_is_contiguous(l)) bad++;
    /* element (a, j, b) of the shard is (a, start + j, b) of the whole */
    for (int64_t e = 0; e < tensor_numel(l); e++) {
      int64_t a = e / (len * inner), j = e / inner % len, b = e % inner;
      if (((float *)l->data)[e] != (float)(1000 * i + (a * n + start + j) * inner + b)) bad++;
    }
  }
  expect_all(bad == 0, "%d shard mismatches", bad);
  ck_assert_int_eq(fsdp_flat_numel(g), padded);
  /* gathered back whole */
  ok(fsdp_unshard(g));
  for (int i = 0; i < 4; i++) {
    const fsdpc_tensor_t *c = &nn_module_param(root, i)->compute;
    for (int64_t k = 0; k < tensor_numel(c); k++)
      if (((float *)c->data)[k] != (float)(1000 * i + k)) bad++;
  }
  fsdp_reshard(g);
  expect_all(bad == 0, "%d mismatches in the gathered parameters", bad);
  nn_module_free(root);
  /* a dimension the parameter does not have is refused by name */
  ok(nn_module_new("", NULL, NULL, &root));
  fsdpc_tensor_t t;
  ok(tensor_zeros(&t, DTYPE_F32, device_cpu(), 1, (int64_t[]){6}));
  dtensor_t *d;
  placement_t rep = placement_replicate();
  ok(dtensor_from_local(&t, local, &rep, 1, (int64_t[]){6}, &d));
  tensor_free(&t);
  ok(nn_module_add_param(root, "p1", d, true, NULL));
  ok(nn_module_finalize(root));
  ck_assert_int_eq(fully_shard(root, &opt, NULL), STATUS_EINVAL);
  ck_assert_msg(strstr(err_detail(), "p1 has 1 dimension; shard dimension 1 is out of range"), "%s",
                err_detail());
  nn_module_free(root);
  mesh_free(local);
  mesh_free(mesh);
}
END_TEST

/* Writes value(global element index, gen) into every element of p's local shard. */
static void fill_global(nn_param_t *p, int gen) {
  const dtensor_t *v = p->value;
  const fsdpc_tensor_t *l = dtensor_local(v);
  int64_t off[TENSOR_MAX_DIMS];
  dtensor_offset(v, off);
  int64_t cols = dtensor_shape(v)[1];
  for (int64_t e = 0; e < tensor_numel(l); e++) {
    int64_t r = e / l->shape[1] + off[0], c = e % l->shape[1] + off[1];
    ((float *)l->data)[e] = (float)(gen * 10000 + r * cols + c);
  }
}

/* Mismatches between the gathered parameter and value(., gen). */
static int gathered_differs(const nn_param_t *p, int gen) {
  int bad = 0;
  for (int64_t e = 0; e < tensor_numel(&p->compute); e++)
    bad += ((float *)p->compute.data)[e] != (float)(gen * 10000 + e);
  return bad;
}

/* HFSDP: a hand-made change to the 1/(R*S) shards reaches the gathered parameters after
 * fsdp_params_changed, and not before (the 1/S shards are what the units gather). */
START_TEST(params_changed_refreshes) {
  mesh_t *mesh = dp_mesh(), *local;
  ok(mesh_new_local("local", DEVICE_CPU, &local));
  static const int64_t shapes[][3] = {{13, 5}, {6, 7}};
  static const int ndims[] = {2, 2};
  nn_module_t *root = params_module(local, 2, ndims, shapes);
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  opt.shard_state_over_replicas = true;
  opt.shard_dim = NULL;
  fsdp_group_t *g;
  ok(fully_shard(root, &opt, &g));
  nn_param_t *ps[2] = {nn_param_find(root, "p0"), nn_param_find(root, "p1")};
  int bad = 0;
  for (int i = 0; i < 2; i++) fill_global(ps[i], 1);
  ok(fsdp_unshard(g)); /* the first unshard fills the 1/S shards from the new values */
  for (int i = 0; i < 2; i++) bad += gathered_differs(ps[i], 1);
  fsdp_reshard(g);
  for (int i = 0; i < 2; i++) fill_global(ps[i], 2);
  ok(fsdp_unshard(g)); /* not marked: the shards keep generation 1 */
  for (int i = 0; i < 2; i++) bad += gathered_differs(ps[i], 1);
  fsdp_params_changed(root); /* reshards, and the next unshard gathers generation 2 */
  ck_assert(!fsdp_is_unsharded(g));
  ok(fsdp_unshard(g));
  for (int i = 0; i < 2; i++) bad += gathered_differs(ps[i], 2);
  expect_all(bad == 0, "%d elements gathered from the wrong generation", bad);
  nn_module_free(root);
  mesh_free(local);
  mesh_free(mesh);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("fsdp_layouts");
  TCase *tc = tcase_create("fsdp_layouts");
  tcase_set_timeout(tc, 300);
  if (hfsdp_mode())
    tcase_add_test(tc, params_changed_refreshes);
  else
    tcase_add_test(tc, shard_dims_are_chunks);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
