/*
 * Expert parallelism of the MoE block (nn_moe_expert_parallel) on every rank of the world:
 * each rank routes its own tokens, holds E / W experts, and exchanges rows by all-to-all. The
 * same block whole on one rank, run over every rank's tokens together, is the reference:
 * each rank's outputs and input gradients are its rows of the reference's, an expert's
 * gradient on the rank holding it is the reference's, and the router's summed over the ranks
 * is the reference's. The all-to-all moves exactly the routed rows: per step, twice forward
 * and twice backward, every row a rank sends to another, times dim, times 4 bytes. A
 * checkpoint saved with the experts split loads into the whole block and into a split over
 * fewer ranks.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/dcp.h"
#include "nn/moe.h"
#include "tests/dist/fsdp_common.h"

enum { DIM = 8, FFN = 12, E = 8, K = 2, T = 16 };

static const char *const names[] = {"gate.weight", "experts.gate_proj", "experts.up_proj",
                                    "experts.down_proj"};

/* Element i of a tensor of the case, the same on every rank. */
static float value(int tensor, int64_t i) { return (float)(0.5 * sin(0.37 * (double)i + tensor)); }

static void fill(fsdpc_tensor_t *t, int tensor) {
  for (int64_t i = 0; i < tensor_numel(t); i++) ((float *)t->data)[i] = value(tensor, i);
}

/* A block with the case's weights (whole). */
static nn_module_t *block(void) {
  nn_module_t *m;
  ok(nn_moe_new(NULL, "", DIM, FFN, E, K, true, NULL, &m));
  ok(nn_module_finalize(m));
  for (int i = 0; i < 4; i++) {
    nn_param_t *p = nn_param_find(m, names[i]);
    fsdpc_tensor_t w;
    ok(tensor_init(&w, DTYPE_F32, device_cpu(), dtensor_ndim(p->value), dtensor_shape(p->value)));
    fill(&w, 10 + i);
    ok(nn_param_copy_full(p, &w));
    tensor_free(&w);
  }
  return m;
}

/* Forward of rows [first, first + n) of the case's tokens, backward with their upstream
 * gradient; *y and *dx hold the output and the input's gradient. */
static void run(nn_module_t *m, int64_t first, int64_t n, fsdpc_tensor_t *y, fsdpc_tensor_t *dx) {
  fsdpc_tensor_t x, all, r, rall;
  int64_t total = T * (int64_t)world_size();
  ok(tensor_init(&all, DTYPE_F32, device_cpu(), 2, (int64_t[]){total, DIM}));
  ok(tensor_init(&rall, DTYPE_F32, device_cpu(), 2, (int64_t[]){total, DIM}));
  fill(&all, 1);
  fill(&rall, 2);
  fsdpc_tensor_t xv, rv;
  ok(tensor_narrow(&xv, &all, 0, first, n));
  ok(tensor_narrow(&rv, &rall, 0, first, n));
  ok(tensor_clone(&x, &xv, DTYPE_F32, device_cpu()));
  ok(tensor_clone(&r, &rv, DTYPE_F32, device_cpu()));
  nn_ctx_t *ctx;
  nn_var_t *in, *out;
  ok(nn_ctx_new(&ctx));
  ok(nn_var_new(&x, true, &in));
  ok(nn_call(ctx, m, in, &out));
  ok(tensor_clone(y, &out->value, DTYPE_F32, device_cpu()));
  ok(nn_backward_grad(ctx, out, &r));
  ok(tensor_clone(dx, &in->grad, DTYPE_F32, device_cpu()));
  nn_var_put(out);
  nn_var_put(in);
  nn_ctx_free(ctx);
  tensor_free(&xv);
  tensor_free(&rv);
  tensor_free(&all);
  tensor_free(&rall);
}

/* Largest |a - b| over the elements, relative to b's largest magnitude. */
static double rel_err(const fsdpc_tensor_t *a, const fsdpc_tensor_t *b) {
  double worst = 0, scale = 1e-30;
  for (int64_t i = 0; i < tensor_numel(b); i++) {
    double d = fabs((double)((float *)a->data)[i] - ((float *)b->data)[i]);
    worst = d > worst ? d : worst;
    scale = fmax(scale, fabs(((float *)b->data)[i]));
  }
  return worst / scale;
}

/* rows [first, first + n) of t (a view, freed by the caller) */
static fsdpc_tensor_t rows(const fsdpc_tensor_t *t, int64_t first, int64_t n) {
  fsdpc_tensor_t v;
  ok(tensor_narrow(&v, t, 0, first, n));
  return v;
}

START_TEST(matches_one_rank) {
  int W = world_size(), r = world_rank(), L = E / W;
  nn_module_t *ref = block(), *ep = block();
  fsdpc_tensor_t ry, rdx, y, dx;
  run(ref, 0, (int64_t)T * W, &ry, &rdx);
  mesh_t *mesh = dp_mesh();
  ok(nn_moe_expert_parallel(ep, mesh, 0));
  nn_param_t *up = nn_param_find(ep, "experts.up_proj");
  ck_assert_int_eq(dtensor_shape(up->value)[0], E);
  ck_assert_int_eq(dtensor_local(up->value)->shape[0], L);
  pg_t *pg = mesh_group(mesh, 0);
  pg_reset_counters(pg);
  run(ep, (int64_t)T * r, T, &y, &dx);
  pg_counters_t c = pg_counters(pg);

  fsdpc_tensor_t mine = rows(&ry, (int64_t)T * r, T), mine_dx = rows(&rdx, (int64_t)T * r, T);
  double e_y = rel_err(&y, &mine), e_dx = rel_err(&dx, &mine_dx), e_w = 0, e_gate;
  for (int i = 1; i < 4; i++) { /* the experts this rank holds */
    const fsdpc_tensor_t *g = dtensor_local(nn_param_find(ep, names[i])->grad);
    fsdpc_tensor_t want =
        rows(dtensor_local(nn_param_find(ref, names[i])->grad), (int64_t)r * L, L);
    e_w = fmax(e_w, rel_err(g, &want));
    tensor_free(&want);
  }
  /* the router: this rank's tokens' gradient, summed over the ranks */
  const fsdpc_tensor_t *gg = dtensor_local(nn_param_find(ep, names[0])->grad);
  fsdpc_tensor_t sum;
  ok(tensor_clone(&sum, gg, DTYPE_F32, device_cpu()));
  ok(pg_all_reduce(pg, sum.data, sum.data, (size_t)tensor_numel(&sum), DTYPE_F32, REDUCE_SUM,
                   NULL));
  e_gate = rel_err(&sum, dtensor_local(nn_param_find(ref, names[0])->grad));
  expect_all(e_y <= 1e-6 && e_dx <= 1e-6 && e_w <= 1e-6 && e_gate <= 1e-6,
             "rank %d: outputs %.2g, input gradients %.2g, experts' gradients %.2g, router's "
             "%.2g from one rank's",
             r, e_y, e_dx, e_w, e_gate);

  /* the bytes: this rank's rows for each peer's experts and the peers' rows for its own, each
   * sent forward and back, then their gradients */
  int64_t load[E], all[E * 8];
  ck_assert(nn_moe_last_load(ep, load, E));
  ok(pg_host_all_gather(pg, load, all, E, PG_HOST_I64));
  int64_t sent = 0, routed = 0;
  for (int q = 0; q < W; q++)
    for (int l = 0; l < L; l++) {
      routed += load[q * L + l];
      if (q != r) sent += load[q * L + l] + all[q * E + r * L + l];
    }
  ck_assert_int_eq(routed, (int64_t)T * K);
  uint64_t want = 2 * (uint64_t)sent * DIM * sizeof(float);
  expect_all(c.calls[PG_ALL_TO_ALL] == 4 && c.bytes[PG_ALL_TO_ALL] == want,
             "rank %d: %llu all-to-alls of %llu bytes, want 4 of %llu", r,
             (unsigned long long)c.calls[PG_ALL_TO_ALL], (unsigned long long)c.bytes[PG_ALL_TO_ALL],
             (unsigned long long)want);
  tensor_free(&mine);
  tensor_free(&mine_dx);
  tensor_free(&sum);
  tensor_free(&ry);
  tensor_free(&rdx);
  tensor_free(&y);
  tensor_free(&dx);
  nn_module_free(ref);
  nn_module_free(ep);
  mesh_free(mesh);
}
END_TEST

/* The block's experts as checkpoint entries (their FQNs; the router, on each rank's own
 * one-rank mesh here, is no distributed tensor): *n of them. */
static dcp_entry_t *entries_of(nn_module_t *m, int *n) {
  *n = 3;
  dcp_entry_t *e = calloc(3, sizeof *e);
  ck_assert_ptr_nonnull(e);
  for (int i = 0; i < 3; i++) {
    nn_param_t *p = nn_param_find(m, names[i + 1]);
    e[i] = (dcp_entry_t){p->fqn, p->value};
  }
  return e;
}

/* A checkpoint of the experts saved split over the world (each rank writing its own) holds
 * every expert under its global index: loaded into the whole block (expert parallelism of 1),
 * and into the block split over half the ranks where W > 2, it gives the case's weights. */
START_TEST(checkpoint_across_expert_counts) {
  int W = world_size();
  mesh_t *mesh = dp_mesh();
  nn_module_t *ep = block();
  ok(nn_moe_expert_parallel(ep, mesh, 0));
  char dir[64] = "";
  if (world_rank() == 0) {
    char tmpl[] = "/tmp/fsdpc-moe-ep-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(tmpl));
    snprintf(dir, sizeof dir, "%s/ck", tmpl);
  }
  ok(pg_broadcast(mesh_group(mesh, 0), dir, sizeof dir / 4, DTYPE_I32, 0, NULL));
  int n;
  dcp_entry_t *e = entries_of(ep, &n);
  ok(dcp_save(dir, e, n, mesh_group(mesh, 0)));
  free(e);
  int bad = 0;
  for (int half = 0; half < (W > 2 ? 2 : 1); half++) {
    nn_module_t *m = block();
    for (int i = 0; i < 4; i++) { /* other values, which the load must replace */
      nn_param_t *p = nn_param_find(m, names[i]);
      fsdpc_tensor_t z;
      ok(tensor_zeros(&z, DTYPE_F32, device_cpu(), dtensor_ndim(p->value),
                      dtensor_shape(p->value)));
      ok(nn_param_copy_full(p, &z));
      tensor_free(&z);
    }
    mesh_t *sub = NULL;
    if (half) { /* the world as (2, W / 2): the experts over the second dimension */
      int shape[2] = {2, W / 2};
      ok(mesh_new(2, shape, (const char *[]){"a", "ep"}, DEVICE_CPU, &sub));
      ok(nn_moe_expert_parallel(m, sub, 1));
    }
    e = entries_of(m, &n);
    ok(dcp_load(dir, e, n, NULL));
    free(e);
    int r = half ? mesh_coord(sub, 1) : 0;
    for (int i = 1; i < 4; i++) {
      const fsdpc_tensor_t *l = dtensor_local(nn_param_find(m, names[i])->value);
      int64_t first = (int64_t)r * tensor_numel(l); /* its experts' elements */
      for (int64_t k = 0; k < tensor_numel(l); k++)
        bad += ((float *)l->data)[k] != value(10 + i, first + k);
    }
    nn_module_free(m);
    mesh_free(sub);
  }
  expect_all(bad == 0, "rank %d: %d elements differ from the saved weights", world_rank(), bad);
  nn_module_free(ep);
  mesh_free(mesh);
}
END_TEST

/* Ranks whose experts no token chooses (the router's weights favour experts 0 and 1 alone)
 * still run every exchange, forward and backward: the step ends on every rank, and the idle
 * experts' gradients are zero. */
START_TEST(idle_experts) {
  int W = world_size();
  mesh_t *mesh = dp_mesh();
  nn_module_t *m;
  ok(nn_moe_new(NULL, "", DIM, FFN, W, 1, false, NULL, &m));
  ok(nn_module_finalize(m));
  nn_param_t *gate = nn_param_find(m, "gate.weight");
  fsdpc_tensor_t w;
  ok(tensor_zeros(&w, DTYPE_F32, device_cpu(), 2, (int64_t[]){W, DIM}));
  for (int64_t d = 0; d < DIM; d++) ((float *)w.data)[d] = 1; /* expert 0, for positive rows */
  ok(nn_param_copy_full(gate, &w));
  tensor_free(&w);
  ok(nn_module_reset_parameters(nn_module_child(m, 1), 3));
  ok(nn_moe_expert_parallel(m, mesh, 0));
  fsdpc_tensor_t x, g;
  ok(tensor_init(&x, DTYPE_F32, device_cpu(), 2, (int64_t[]){T, DIM}));
  ok(tensor_init(&g, DTYPE_F32, device_cpu(), 2, (int64_t[]){T, DIM}));
  for (int64_t i = 0; i < T * DIM; i++) {
    ((float *)x.data)[i] = 1.0f + 0.01f * (float)(i % 7);
    ((float *)g.data)[i] = 1.0f;
  }
  nn_ctx_t *ctx;
  nn_var_t *in, *out;
  ok(nn_ctx_new(&ctx));
  ok(nn_var_new(&x, true, &in));
  ok(nn_call(ctx, m, in, &out));
  ok(nn_backward_grad(ctx, out, &g));
  int64_t load[64];
  ck_assert(nn_moe_last_load(m, load, W));
  ck_assert_int_eq(load[0], T);
  const fsdpc_tensor_t *up = dtensor_local(nn_param_find(m, "experts.up_proj")->grad);
  double s = 0;
  for (int64_t i = 0; i < tensor_numel(up); i++) s += fabs(((float *)up->data)[i]);
  double dx = 0; /* every rank's tokens went to expert 0: their gradients came back */
  for (int64_t i = 0; i < T * DIM; i++) dx += fabs(((float *)in->grad.data)[i]);
  expect_all((world_rank() == 0) == (s > 0) && dx > 0,
             "rank %d: its expert's gradient sums to %g, its input's to %g", world_rank(), s, dx);
  nn_var_put(out);
  nn_var_put(in);
  nn_ctx_free(ctx);
  nn_module_free(m);
  mesh_free(mesh);
}
END_TEST

/* Experts the group does not divide, a second application, a non-MoE module: refused. */
START_TEST(refusals) {
  mesh_t *mesh = dp_mesh();
  nn_module_t *m;
  int W = world_size();
  ok(nn_moe_new(NULL, "", DIM, FFN, 3 * W - 1, 1, false, NULL, &m));
  ok(nn_module_finalize(m));
  if (W > 1) {
    ck_assert_int_eq(nn_moe_expert_parallel(m, mesh, 0), STATUS_EINVAL);
    ck_assert_ptr_nonnull(strstr(err_detail(), "ranks do not divide"));
  }
  nn_module_free(m);
  m = block();
  ok(nn_moe_expert_parallel(m, mesh, 0));
  ck_assert_int_eq(nn_moe_expert_parallel(m, mesh, 0), STATUS_EINVAL);
  ck_assert_int_eq(nn_moe_expert_parallel(nn_module_child(m, 0), mesh, 0), STATUS_EINVAL);
  ck_assert_int_eq(nn_moe_expert_parallel(m, mesh, 1), STATUS_EINVAL);
  nn_module_free(m);
  mesh_free(mesh);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("moe_ep");
  TCase *tc = tcase_create("moe_ep");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, matches_one_rank);
  tcase_add_test(tc, checkpoint_across_expert_counts);
  tcase_add_test(tc, idle_experts);
  tcase_add_test(tc, refusals);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
