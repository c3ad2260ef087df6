/*
 * The redistribution property, exhaustively over placement pairs:
 *
 *   for random global X and every pair of placement tuples P, Q drawn from
 *   {Shard(d) for every tensor dim d, Replicate, Partial(sum)} on each mesh dimension:
 *     redistribute(distribute(X, P), Q) == distribute(X, Q)   bit-exactly, and
 *     full_tensor(distribute(X, P)) == X.
 *
 * Where Q holds a Partial, the local split is not unique, so the reduced value
 * (full_tensor) is compared with X instead. Data are small integers, so sums are exact in
 * every dtype. Usage: test_redistribute MESH, e.g. "4" or "2x2x2" (the product must equal
 * the world size).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtensor/dtensor.h"
#include "nn/optim.h"
#include "tests/harness.h"

static int g_ndim;
static int g_shape[MESH_MAX_DIMS];
static int g_shapes_per_ndim = 12;
static int g_sample = 1; /* check every g_sample-th pair (sanitized builds) */

static mesh_t *make_mesh(void) {
  const char *names[3] = {"m0", "m1", "m2"};
  mesh_t *m = NULL;
  ck_assert_int_eq(mesh_new(g_ndim, g_shape, names, DEVICE_CPU, &m), STATUS_OK);
  return m;
}

/* All placement tuples for a tensor of ndim dims: (ndim + 2)^mesh_ndim of them. */
static int all_tuples(int tensor_ndim, placement_t (*out)[MESH_MAX_DIMS]) {
  int per = tensor_ndim + 2, total = 1;
  for (int i = 0; i < g_ndim; i++) total *= per;
  for (int t = 0; t < total; t++) {
    int rest = t;
    for (int i = 0; i < g_ndim; i++) {
      int k = rest % per;
      rest /= per;
      out[t][i] = k < tensor_ndim
                      ? placement_shard(k)
                      : (k == tensor_ndim ? placement_replicate() : placement_partial(REDUCE_SUM));
    }
  }
  return total;
}

static int has_partial(const placement_t *pl) {
  for (int i = 0; i < g_ndim; i++)
    if (pl[i].kind == PLACEMENT_PARTIAL) return 1;
  return 0;
}

static void fill_pattern(fsdpc_tensor_t *t, int salt) {
  for (int64_t i = 0; i < tensor_numel(t); i++)
    dtype_store(t->dtype, t->data, (size_t)i, (double)((i * 7 + salt) % 23 - 11));
}

static int same(const fsdpc_tensor_t *a, const fsdpc_tensor_t *b) {
  bool eq = false;
  return tensor_equal(a, b, &eq) == STATUS_OK && eq;
}

START_TEST(redistribute_matches_distribute_for_every_pair) {
  mesh_t *mesh = make_mesh();
  test_rng_t rng = {1234};
  static const dtype_t dts[] = {DTYPE_F32, DTYPE_I32, DTYPE_BF16, DTYPE_I64, DTYPE_F16};
  long cases = 0, failures = 0;
  static placement_t tuples[4096][MESH_MAX_DIMS];
  for (int tensor_ndim = 1; tensor_ndim <= 3; tensor_ndim++) {
    int nt = all_tuples(tensor_ndim, tuples);
    /* (ndim+2)^(2*mesh_ndim) pairs per shape: fewer shapes where that is large, and there
     * each pair on every other shape (each pair still checked, on half the shapes) */
    int stride = g_sample * (nt * nt > 1000 ? 2 : 1);
    int nshapes = nt * nt > 10000  ? 2
                  : nt * nt > 1000 ? g_shapes_per_ndim / 2
                  : nt * nt < 100  ? 4 * g_shapes_per_ndim
                                   : g_shapes_per_ndim;
    for (int s = 0; s < nshapes; s++) {
      int64_t shape[3];
      for (int d = 0; d < tensor_ndim; d++) /* small dims (below the mesh size) and odd ones */
        shape[d] = test_rng_int(&rng, 0, 3) == 0 ? test_rng_int(&rng, 0, 3)
                                                 : test_rng_int(&rng, 1, 6) * 2 - 1 + (s & 1);
      dtype_t dt = dts[(tensor_ndim * 7 + s) % 5];
      fsdpc_tensor_t X;
      ck_assert_int_eq(tensor_init(&X, dt, device_cpu(), tensor_ndim, shape), STATUS_OK);
      fill_pattern(&X, s);
      /* each placement distributed once: the source of its redistributions and the
       * expected result of the others' */
      static dtensor_t *D[4096];
      for (int p = 0; p < nt; p++) {
        D[p] = NULL;
        fsdpc_status_t st = dtensor_distribute(&X, mesh, tuples[p], DTENSOR_ALL_RANKS, &D[p]);
        fsdpc_tensor_t full = {0};
        if (st == STATUS_OK) st = dtensor_full_tensor(D[p], &full);
        if (st != STATUS_OK || !same(&full, &X)) failures++;
        tensor_free(&full);
      }
      for (int p = 0; p < nt; p++) {
        for (int q = 0; q < nt && D[p] != NULL; q++) {
          if ((p + q + s) % stride != 0) continue; /* every q for some p */
          dtensor_t *B = NULL;
          fsdpc_status_t st = dtensor_redistribute(D[p], tuples[q], &B);
          int ok = st == STATUS_OK && D[q] != NULL;
          if (ok && has_partial(tuples[q])) {
            fsdpc_tensor_t got = {0};
            ok = dtensor_full_tensor(B, &got) == STATUS_OK && same(&got, &X);
            tensor_free(&got);
          } else if (ok) {
            ok = same(dtensor_local(B), dtensor_local(D[q]));
          }
          if (!ok) {
            char a[128], b[128], sh[64];
            if (failures < 10)
              fprintf(stderr, "rank %d: %s %s: %s -> %s differs (%s)\n", world_rank(),
                      dtype_name(dt), tensor_shape_str(tensor_ndim, shape, sh, sizeof sh),
                      placements_str(g_ndim, tuples[p], a, sizeof a),
                      placements_str(g_ndim, tuples[q], b, sizeof b),
                      st == STATUS_OK ? "values" : err_detail());
            failures++;
          }
          cases++;
          dtensor_free(B);
        }
      }
      for (int p = 0; p < nt; p++) dtensor_free(D[p]);
      tensor_free(&X);
    }
  }
  if (world_rank() == 0) {
    char m[64];
    printf("redistribute on mesh %s: %ld placement pairs checked%s\n",
           mesh_str(mesh, m, sizeof m), cases,
           g_sample > 1 ? " (a fixed sample: sanitized build)" : "");
  }
  expect_all(failures == 0, "%ld of %ld redistributions differ", failures, cases);
  mesh_free(mesh);
}
END_TEST

/* distribute from one source rank equals distribute from all ranks; other ranks' data is
 * ignored. */
START_TEST(distribute_from_source_rank) {
  mesh_t *mesh = make_mesh();
  int64_t shape[2] = {5, 3};
  fsdpc_tensor_t X, junk;
  ck_assert_int_eq(tensor_init(&X, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  ck_assert_int_eq(tensor_init(&junk, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  fill_pattern(&X, 3);
  ck_assert_int_eq(tensor_fill(&junk, 99), STATUS_OK);
  int src = world_size() - 1, bad = 0;
  static placement_t tuples[4096][MESH_MAX_DIMS];
  int nt = all_tuples(2, tuples);
  fsdpc_tensor_t meta; /* the other ranks' may hold no memory at all */
  ck_assert_int_eq(tensor_meta(&meta, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  for (int p = 0; p < nt; p++) {
    dtensor_t *A = NULL, *B = NULL;
    const fsdpc_tensor_t *mine = world_rank() == src ? &X : p % 2 ? &meta : &junk;
    if (dtensor_distribute(mine, mesh, tuples[p], src, &A) != STATUS_OK ||
        dtensor_distribute(&X, mesh, tuples[p], DTENSOR_ALL_RANKS, &B) != STATUS_OK ||
        !same(dtensor_local(A), dtensor_local(B)))
      bad++;
    dtensor_free(A);
    dtensor_free(B);
  }
  expect_all(bad == 0, "%d source-rank distributions differ", bad);
  /* the source's own tensor meta: nothing to send, refused on every rank */
  dtensor_t *A = NULL;
  fsdpc_status_t st = dtensor_distribute(&meta, mesh, tuples[0], src, &A);
  expect_all(st == STATUS_EINVAL && A == NULL &&
                 strstr(err_detail(), "the source rank's tensor is a meta tensor") != NULL,
             "a meta tensor on the source rank: %s", err_detail());
  tensor_free(&meta);
  tensor_free(&X);
  tensor_free(&junk);
  mesh_free(mesh);
}
END_TEST

/* FSDPC_CHECK_COLLECTIVES: a redistribution one rank asks with other placements, or with
 * placements only it finds invalid, is refused on every rank instead of leaving the others in
 * collectives it never makes. */
START_TEST(checked_redistribute_agrees_on_arguments) {
  if (world_size() == 1) return;
  mesh_t *mesh = make_mesh();
  fsdpc_tensor_t X;
  int64_t shape[2] = {6, 4};
  ck_assert_int_eq(tensor_init(&X, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  fill_pattern(&X, 5);
  placement_t rep[MESH_MAX_DIMS], mine[MESH_MAX_DIMS];
  for (int i = 0; i < g_ndim; i++) rep[i] = placement_replicate();
  dtensor_t *A = NULL;
  ck_assert_int_eq(dtensor_distribute(&X, mesh, rep, DTENSOR_ALL_RANKS, &A), STATUS_OK);
  setenv("FSDPC_CHECK_COLLECTIVES", "1", 1);
  bool last = world_rank() == world_size() - 1;
  for (int k = 0; k < 2; k++) {
    memcpy(mine, rep, sizeof rep);
    if (last) mine[0] = placement_shard(k == 0 ? 5 : 0); /* invalid, or only different */
    dtensor_t *B = NULL;
    fsdpc_status_t st = dtensor_redistribute(A, mine, &B);
    const char *want = k == 1 ? "different shapes or dtypes, different placements"
                              : "S(5) shards dimension 5 of a 2-D tensor";
    expect_all(st != STATUS_OK && B == NULL && strstr(err_detail(), want) != NULL,
               "case %d: refused on every rank, naming it (%s)", k, err_detail());
    dtensor_free(B);
  }
  unsetenv("FSDPC_CHECK_COLLECTIVES");
  dtensor_free(A);
  tensor_free(&X);
  mesh_free(mesh);
}
END_TEST

/* clip_grad_norm over a group narrower than a gradient's mesh would clip some ranks by
 * another norm than the rest: refused on every rank; the world computes the norm. */
START_TEST(clip_grad_norm_needs_the_whole_mesh) {
  if (g_ndim < 2) return;
  mesh_t *mesh = make_mesh();
  fsdpc_tensor_t X;
  int64_t shape[2] = {8, 3};
  ck_assert_int_eq(tensor_init(&X, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  fill_pattern(&X, 7);
  placement_t pl[MESH_MAX_DIMS];
  for (int i = 0; i < g_ndim; i++)
    pl[i] = i == g_ndim - 1 ? placement_shard(0) : placement_replicate();
  nn_param_t p = {.fqn = "w"};
  ck_assert_int_eq(dtensor_distribute(&X, mesh, pl, DTENSOR_ALL_RANKS, &p.grad), STATUS_OK);
  nn_param_t *ps[1] = {&p};
  double norm = -1, want = 0;
  const float *x = X.data;
  for (int64_t i = 0; i < tensor_numel(&X); i++) want += (double)x[i] * x[i];
  fsdpc_status_t st = clip_grad_norm(ps, 1, 1e9, mesh_group(mesh, g_ndim - 1), &norm);
  expect_all(st == STATUS_EINVAL && strstr(err_detail(), "'w' lies on a mesh of"),
             "a group of the shard dimension alone is refused: %s", err_detail());
  st = clip_grad_norm(ps, 1, 1e9, world_pg(), &norm);
  expect_all(st == STATUS_OK && fabs(norm - sqrt(want)) <= 1e-6 * sqrt(want),
             "the world's norm %.9g, the whole tensor's %.9g", norm, sqrt(want));
  dtensor_free(p.grad);
  /* replicated over the whole mesh: NULL counts every rank's whole copy (each rank clips by
   * the same norm), a group narrower than the mesh is refused as for a shard */
  for (int i = 0; i < g_ndim; i++) pl[i] = placement_replicate();
  ck_assert_int_eq(dtensor_distribute(&X, mesh, pl, DTENSOR_ALL_RANKS, &p.grad), STATUS_OK);
  norm = -1;
  st = clip_grad_norm(ps, 1, 1e9, NULL, &norm);
  expect_all(st == STATUS_OK && fabs(norm - sqrt(want)) <= 1e-6 * sqrt(want),
             "a replicated gradient's norm with no group %.9g on every rank, the whole "
             "tensor's %.9g",
             norm, sqrt(want));
  st = clip_grad_norm(ps, 1, 1e9, mesh_group(mesh, g_ndim - 1), &norm);
  expect_all(st == STATUS_EINVAL && strstr(err_detail(), "'w' lies on a mesh of"),
             "a replicated gradient with a group of one mesh dimension is refused: %s",
             err_detail());
  dtensor_free(p.grad);
  tensor_free(&X);
  mesh_free(mesh);
}
END_TEST

/* Strided shards (FSDP over a TP shard) round-trip through the general path. */
START_TEST(strided_shard_round_trips) {
  if (g_ndim != 2) return;
  mesh_t *mesh = make_mesh();
  int64_t shape[2] = {11, 3};
  fsdpc_tensor_t X;
  ck_assert_int_eq(tensor_init(&X, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  fill_pattern(&X, 5);
  placement_t strided[2] = {placement_strided_shard(0, g_shape[1]), placement_shard(0)};
  placement_t others[4][2] = {{placement_replicate(), placement_replicate()},
                              {placement_shard(0), placement_shard(1)},
                              {placement_partial(REDUCE_SUM), placement_shard(0)},
                              {placement_replicate(), placement_shard(0)}};
  int bad = 0;
  dtensor_t *S = NULL;
  ck_assert_int_eq(dtensor_distribute(&X, mesh, strided, DTENSOR_ALL_RANKS, &S), STATUS_OK);
  int64_t off[2];
  dtensor_offset(S, off);
  /* tp chunks first, then dp chunks the tp piece */
  int64_t tp_off, tp_len, dp_off, dp_len;
  placement_chunk_range(11, g_shape[1], mesh_coord(mesh, 1), &tp_off, &tp_len);
  placement_chunk_range(tp_len, g_shape[0], mesh_coord(mesh, 0), &dp_off, &dp_len);
  bad += off[0] != tp_off + dp_off || dtensor_local(S)->shape[0] != dp_len;
  for (int k = 0; k < 4; k++) {
    dtensor_t *A = NULL, *B = NULL, *C = NULL;
    fsdpc_tensor_t full = {0};
    int ok = dtensor_redistribute(S, others[k], &A) == STATUS_OK &&
             dtensor_redistribute(A, strided, &B) == STATUS_OK &&
             same(dtensor_local(B), dtensor_local(S)) &&
             dtensor_full_tensor(A, &full) == STATUS_OK && same(&full, &X) &&
             dtensor_distribute(&X, mesh, others[k], DTENSOR_ALL_RANKS, &C) == STATUS_OK;
    if (ok && others[k][0].kind != PLACEMENT_PARTIAL) ok = same(dtensor_local(A), dtensor_local(C));
    bad += !ok;
    tensor_free(&full);
    dtensor_free(A);
    dtensor_free(B);
    dtensor_free(C);
  }
  expect_all(bad == 0, "%d strided round trips failed", bad);
  dtensor_free(S);
  tensor_free(&X);
  mesh_free(mesh);
}
END_TEST

START_TEST(from_local_checks_the_shard_shape) {
  mesh_t *mesh = make_mesh();
  int64_t global[1] = {13}, wrong[1] = {14};
  placement_t pl[MESH_MAX_DIMS];
  for (int i = 0; i < g_ndim; i++) pl[i] = placement_shard(0);
  int coord[MESH_MAX_DIMS];
  for (int i = 0; i < g_ndim; i++) coord[i] = mesh_coord(mesh, i);
  int64_t ls[1], off[1];
  ck_assert_int_eq(dtensor_compute_box(mesh, pl, 1, global, coord, ls, off), STATUS_OK);
  fsdpc_tensor_t local;
  ck_assert_int_eq(tensor_init(&local, DTYPE_F32, device_cpu(), 1, wrong), STATUS_OK);
  dtensor_t *d = NULL;
  ck_assert_int_eq(dtensor_from_local(&local, mesh, pl, 1, global, &d), STATUS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err_detail(), "local shape [14]"));
  tensor_free(&local);
  ck_assert_int_eq(tensor_init(&local, DTYPE_F32, device_cpu(), 1, ls), STATUS_OK);
  ck_assert_int_eq(dtensor_from_local(&local, mesh, pl, 1, global, &d), STATUS_OK);
  int64_t got[1];
  dtensor_offset(d, got);
  ck_assert_int_eq(got[0], off[0]);
  tensor_free(&local); /* the DTensor holds its own reference */
  ck_assert_int_eq(dtensor_local(d)->shape[0], ls[0]);
  /* shaped as d's shard, in another dtype (a gradient): d's mesh, placements, global shape
   * and place; a wrong shape or a strided tensor refused */
  fsdpc_tensor_t like, strided;
  ck_assert_int_eq(tensor_init(&like, DTYPE_BF16, device_cpu(), 1, ls), STATUS_OK);
  dtensor_t *e = NULL;
  ck_assert_int_eq(dtensor_from_local_like(&like, d, &e), STATUS_OK);
  ck_assert_ptr_eq(dtensor_mesh(e), mesh);
  ck_assert_int_eq(dtensor_ndim(e), 1);
  ck_assert_int_eq(dtensor_shape(e)[0], 13);
  ck_assert_int_eq(dtensor_local(e)->dtype, DTYPE_BF16);
  ck_assert_ptr_eq(dtensor_local(e)->data, like.data);
  for (int i = 0; i < g_ndim; i++)
    ck_assert(placement_equal(dtensor_placements(e)[i], dtensor_placements(d)[i]));
  dtensor_offset(e, got);
  ck_assert_int_eq(got[0], off[0]);
  dtensor_free(e);
  tensor_free(&like);
  int64_t two[2] = {ls[0], 2}, one = ls[0] + 1;
  ck_assert_int_eq(tensor_init(&like, DTYPE_F32, device_cpu(), 1, &one), STATUS_OK);
  ck_assert_int_eq(dtensor_from_local_like(&like, d, &e), STATUS_ESHAPE);
  tensor_free(&like);
  ck_assert_int_eq(tensor_init(&like, DTYPE_F32, device_cpu(), 2, two), STATUS_OK);
  ck_assert_int_eq(tensor_narrow(&strided, &like, 1, 0, 1), STATUS_OK);
  strided.ndim = 1; /* column 0 of [ls, 2]: ls elements two apart */
  if (ls[0] > 1) ck_assert_int_eq(dtensor_from_local_like(&strided, d, &e), STATUS_ESHAPE);
  tensor_free(&strided);
  tensor_free(&like);
  dtensor_free(d);
  mesh_free(mesh);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("redistribute");
  TCase *tc = tcase_create("property");
  tcase_add_test(tc, redistribute_matches_distribute_for_every_pair);
  tcase_add_test(tc, distribute_from_source_rank);
  tcase_add_test(tc, checked_redistribute_agrees_on_arguments);
  tcase_add_test(tc, clip_grad_norm_needs_the_whole_mesh);
  tcase_add_test(tc, strided_shard_round_trips);
  tcase_add_test(tc, from_local_checks_the_shard_shape);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) {
  const char *spec = argc > 1 ? argv[1] : "1";
  g_ndim = 0;
  for (const char *p = spec; *p && g_ndim < 3;) {
    g_shape[g_ndim++] = (int)strtol(p, (char **)&p, 10);
    if (*p == 'x') p++;
  }
  if (argc > 2) g_shapes_per_ndim = atoi(argv[2]);
  if (getenv("FSDPC_TEST_SANITIZED") != NULL) g_sample = 4;
  return harness_main(argc, argv, make_suite);
}
