/* DeviceMesh under mpirun: layout, per-dimension groups, slicing, flattening, errors. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mesh/mesh.h"
#include "tests/harness.h"

/* World ranks of the group of mesh dim `dim`, gathered over the group. */
static int *group_members(const mesh_t *m, int dim) {
  pg_t *g = mesh_group(m, dim);
  int n = pg_size(g);
  int32_t me = world_rank();
  int32_t *all = calloc((size_t)n, sizeof(int32_t));
  ck_assert_int_eq(pg_all_gather(g, &me, all, 1, DTYPE_I32, NULL), STATUS_OK);
  return all;
}

/* Smallest divisor a > 1 of W (W itself when prime; 1 when W == 1). */
static int small_factor(int W) {
  for (int a = 2; a <= W; a++)
    if (W % a == 0) return a;
  return 1;
}

START_TEST(mesh_1d_infers_world_size) {
  mesh_t *m = NULL;
  ck_assert_int_eq(mesh_new(1, (int[]){-1}, (const char *[]){"dp"}, DEVICE_CPU, &m), STATUS_OK);
  ck_assert_int_eq(mesh_size(m, 0), world_size());
  ck_assert_int_eq(mesh_coord(m, 0), world_rank());
  ck_assert_int_eq(pg_size(mesh_group(m, 0)), world_size());
  ck_assert_int_eq(mesh_numel(m), world_size());
  /* the tests run on one node: every rank is local, each with its own local rank */
  ck_assert_int_eq(world_local_size(), world_size());
  ck_assert_int_eq(world_local_rank(), world_rank());
  mesh_free(m);
}
END_TEST

START_TEST(mesh_2d_groups_differ_in_one_coordinate) {
  int W = world_size(), a = small_factor(W), b = W / a, r = world_rank();
  mesh_t *m = NULL;
  ck_assert_int_eq(
      mesh_new(2, (int[]){a, -1}, (const char *[]){"dp_replicate", "dp_shard"}, DEVICE_CPU, &m),
      STATUS_OK);
  ck_assert_int_eq(mesh_size(m, 1), b);
  ck_assert_int_eq(mesh_coord(m, 0), r / b);
  ck_assert_int_eq(mesh_coord(m, 1), r % b);
  int ok = 1;
  int *rows = group_members(m, 1), *cols = group_members(m, 0);
  for (int k = 0; k < b; k++) ok &= rows[k] == (r / b) * b + k;
  for (int k = 0; k < a; k++) ok &= cols[k] == k * b + r % b;
  for (int k = 0; k < W; k++) ok &= mesh_ranks(m)[k] == k;
  free(rows);
  free(cols);
  char got[128], want[128];
  snprintf(want, sizeof want, "(dp_replicate=%d, dp_shard=%d)", a, b);
  ck_assert_str_eq(mesh_str(m, got, sizeof got), want);
  expect_all(ok, "2-D groups are not the rows and columns of arange(W).view(a, b)");
  mesh_free(m);
}
END_TEST

START_TEST(mesh_slice_reuses_parent_groups) {
  int W = world_size(), a = small_factor(W);
  mesh_t *m = NULL, *s = NULL, *bad = NULL;
  const char *names[2] = {"dp_replicate", "dp_shard"};
  ck_assert_int_eq(mesh_new(2, (int[]){a, -1}, names, DEVICE_CPU, &m), STATUS_OK);
  ck_assert_int_eq(mesh_slice(m, 1, (const char *[]){"dp_shard"}, &s), STATUS_OK);
  ck_assert_ptr_eq(mesh_group(s, 0), mesh_group(m, 1));
  ck_assert_int_eq(mesh_coord(s, 0), mesh_coord(m, 1));
  ck_assert_int_eq(mesh_numel(s), W / a);
  ck_assert_int_eq(mesh_ranks(s)[0], (world_rank() / (W / a)) * (W / a));
  ck_assert_int_eq(mesh_slice(m, 2, (const char *[]){"dp_shard", "dp_replicate"}, &bad),
                   STATUS_EMESH);
  ck_assert_int_eq(mesh_slice(m, 1, (const char *[]){"tp"}, &bad), STATUS_EMESH);
  ck_assert_ptr_nonnull(strstr(err_detail(), "no dimension 'tp'"));
  mesh_free(m); /* the slice keeps the groups alive */
  int32_t one = 1, sum = 0;
  ck_assert_int_eq(pg_all_reduce(mesh_group(s, 0), &one, &sum, 1, DTYPE_I32, REDUCE_SUM, NULL),
                   STATUS_OK);
  ck_assert_int_eq(sum, W / a);
  mesh_free(s);
}
END_TEST

/* A mesh makes the group of every rank once, and every dimension's group is split from it:
 * flattening every dimension hands that group out again, and a 1-D mesh's only dimension is
 * it (on CUDA meshes one NCCL communicator is made from scratch, the rest split from it). */
START_TEST(mesh_groups_come_from_one_group_of_every_rank) {
  int W = world_size(), a = small_factor(W);
  const char *names[2] = {"dp_replicate", "dp_shard"};
  mesh_t *m = NULL, *all = NULL, *again = NULL, *one = NULL, *one_all = NULL;
  ck_assert_int_eq(mesh_new(2, (int[]){a, -1}, names, DEVICE_CPU, &m), STATUS_OK);
  ck_assert_int_eq(mesh_flatten(m, 2, names, "all", &all), STATUS_OK);
  ck_assert_int_eq(mesh_flatten(m, 2, names, "all2", &again), STATUS_OK);
  ck_assert_ptr_eq(mesh_group(all, 0), mesh_group(again, 0));
  ck_assert_int_eq(pg_size(mesh_group(all, 0)), W);
  ck_assert_int_eq(pg_rank(mesh_group(all, 0)), world_rank());
  if (a > 1 && W / a > 1) {
    ck_assert_ptr_ne(mesh_group(m, 0), mesh_group(all, 0));
    ck_assert_ptr_ne(mesh_group(m, 1), mesh_group(all, 0));
  }
  ck_assert_int_eq(mesh_new(1, (int[]){-1}, (const char *[]){"dp"}, DEVICE_CPU, &one), STATUS_OK);
  ck_assert_int_eq(mesh_flatten(one, 1, (const char *[]){"dp"}, "all", &one_all), STATUS_OK);
  ck_assert_ptr_eq(mesh_group(one, 0), mesh_group(one_all, 0));
  mesh_free(all);
  mesh_free(m); /* the flattening keeps the group alive */
  int32_t me = 1, sum = 0;
  ck_assert_int_eq(pg_all_reduce(mesh_group(again, 0), &me, &sum, 1, DTYPE_I32, REDUCE_SUM, NULL),
                   STATUS_OK);
  ck_assert_int_eq(sum, W);
  mesh_free(again);
  mesh_free(one_all);
  mesh_free(one);
  /* a rank-local mesh: its one group is its group of every rank */
  mesh_t *local = NULL, *flat = NULL;
  ck_assert_int_eq(mesh_new_local("solo", DEVICE_CPU, &local), STATUS_OK);
  ck_assert_int_eq(mesh_flatten(local, 1, (const char *[]){"solo"}, "flat", &flat), STATUS_OK);
  ck_assert_ptr_eq(mesh_group(flat, 0), mesh_group(local, 0));
  me = 5;
  ck_assert_int_eq(pg_all_reduce(mesh_group(flat, 0), &me, &sum, 1, DTYPE_I32, REDUCE_SUM, NULL),
                   STATUS_OK);
  ck_assert_int_eq(sum, 5);
  mesh_free(flat);
  mesh_free(local);
}
END_TEST

START_TEST(mesh_flatten_makes_row_major_group) {
  int W = world_size();
  if (W % 2 != 0 || W < 4) return; /* needs a 3-D mesh with two non-trivial outer dims */
  int dims[3] = {2, W / 4 > 0 && W % 4 == 0 ? 2 : 1, -1};
  mesh_t *m = NULL, *dp = NULL, *outer = NULL;
  const char *names[3] = {"dp_replicate", "dp_shard", "tp"};
  ck_assert_int_eq(mesh_new(3, dims, names, DEVICE_CPU, &m), STATUS_OK);
  ck_assert_int_eq(mesh_flatten(m, 2, names, "dp", &dp), STATUS_OK);
  int R = mesh_size(m, 0), S = mesh_size(m, 1), T = mesh_size(m, 2);
  ck_assert_int_eq(mesh_size(dp, 0), R * S);
  ck_assert_int_eq(mesh_coord(dp, 0), mesh_coord(m, 0) * S + mesh_coord(m, 1));
  int *members = group_members(dp, 0), ok = 1;
  for (int k = 0; k < R * S; k++) ok &= members[k] == k * T + mesh_coord(m, 2);
  for (int k = 0; k < R * S; k++) ok &= mesh_ranks(dp)[k] == members[k];
  free(members);
  /* flatten a slice: (dp_replicate, tp) skipping the middle dim */
  ck_assert_int_eq(mesh_slice(m, 2, (const char *[]){"dp_replicate", "tp"}, &outer), STATUS_OK);
  mesh_t *flat = NULL;
  ck_assert_int_eq(mesh_flatten(outer, 2, (const char *[]){"dp_replicate", "tp"}, "rt", &flat),
                   STATUS_OK);
  members = group_members(flat, 0);
  for (int a = 0; a < R; a++)
    for (int t = 0; t < T; t++) ok &= members[a * T + t] == (a * S + mesh_coord(m, 1)) * T + t;
  free(members);
  expect_all(ok, "flattened groups are not row-major over the flattened dims");
  mesh_free(flat);
  mesh_free(outer);
  mesh_free(dp);
  mesh_free(m);
}
END_TEST

/* Expert parallelism's experts mesh over (dp_shard_ep, ep, tp): dp_shard_ep and tp flattened,
 * then ep, which lies between them in the world mesh; its ranks are row-major over its own
 * coordinates. */
START_TEST(mesh_concat_interleaved_is_row_major_over_its_coordinates) {
  int W = world_size();
  if (W != 8) return;
  int dims[3] = {2, 2, 2};
  const char *names[3] = {"dp_shard_ep", "ep", "tp"};
  mesh_t *m = NULL, *flat = NULL, *ep = NULL, *both = NULL;
  ck_assert_int_eq(mesh_new(3, dims, names, DEVICE_CPU, &m), STATUS_OK);
  ck_assert_int_eq(mesh_flatten(m, 2, (const char *[]){"dp_shard_ep", "tp"}, "st", &flat),
                   STATUS_OK);
  ck_assert_int_eq(mesh_slice(m, 1, (const char *[]){"ep"}, &ep), STATUS_OK);
  ck_assert_int_eq(mesh_concat(flat, ep, &both), STATUS_OK);
  /* every rank of the world: (s, e, t) is world rank 4 s + 2 e + t; the new mesh's index
   * (2 s + t) * 2 + e */
  int ok = mesh_numel(both) == 8 && mesh_size(both, 0) == 4 && mesh_size(both, 1) == 2;
  for (int s = 0; s < 2; s++)
    for (int e = 0; e < 2; e++)
      for (int t = 0; t < 2; t++) ok &= mesh_ranks(both)[(2 * s + t) * 2 + e] == 4 * s + 2 * e + t;
  int me = world_rank(), c[2];
  mesh_unravel(both, (2 * (me / 4) + me % 2) * 2 + (me / 2) % 2, c);
  ok &= c[0] == mesh_coord(both, 0) && c[1] == mesh_coord(both, 1);
  expect_all(ok, "an interleaved concat's ranks are not row-major over its coordinates");
  mesh_free(both);
  mesh_free(ep);
  mesh_free(flat);
  mesh_free(m);
}
END_TEST

START_TEST(mesh_size_mismatch_fails_on_every_rank) {
  int W = world_size();
  mesh_t *m = NULL;
  fsdpc_status_t st = mesh_new(2, (int[]){W + 1, 1}, (const char *[]){"a", "b"}, DEVICE_CPU, &m);
  expect_all(st == STATUS_EMESH && m == NULL, "mismatch not refused everywhere");
  ck_assert_ptr_nonnull(strstr(err_detail(), "but the world has"));
  st = mesh_new(2, (int[]){-1, -1}, (const char *[]){"a", "b"}, DEVICE_CPU, &m);
  expect_all(st == STATUS_EMESH, "two -1 accepted");
  st = mesh_new(2, (int[]){0, -1}, (const char *[]){"a", "b"}, DEVICE_CPU, &m);
  expect_all(st == STATUS_EMESH, "zero size accepted");
  st = mesh_new(2, (int[]){W + 1, -1}, (const char *[]){"a", "b"}, DEVICE_CPU, &m);
  expect_all(st == STATUS_EMESH, "-1 inferred from a non-divisor");
  ck_assert_ptr_nonnull(strstr(err_detail(), "cannot be inferred"));
  st = mesh_new(2, (int[]){1, -1}, (const char *[]){"a", "a"}, DEVICE_CPU, &m);
  expect_all(st == STATUS_EMESH, "duplicate names accepted");
  st = mesh_new(6, (int[]){1, 1, 1, 1, 1, -1}, (const char *[]){"a", "b", "c", "d", "e", "f"},
                DEVICE_CPU, &m);
  expect_all(st == STATUS_EMESH, "6-D mesh accepted");
  /* the world is still usable: nobody is stuck in a collective */
  ck_assert(all_ranks(1));
}
END_TEST

START_TEST(mesh_cuda_without_device_fails_on_every_rank) {
  if (device_cuda_count() > 0) return;
  mesh_t *m = NULL;
  fsdpc_status_t st = mesh_new(1, (int[]){-1}, (const char *[]){"dp"}, DEVICE_CUDA, &m);
  expect_all(st == STATUS_ENODEV && m == NULL, "CUDA mesh without a device: %d", st);
}
END_TEST

/* world_agree_report on this rank with status st and message msg; returns what this rank
 * printed to stderr (caller frees) and the verdict in *ok. */
static char *report(fsdpc_status_t st, const char *msg, bool *ok) {
  char path[64];
  snprintf(path, sizeof path, "/tmp/fsdpc_report_%d_%d", (int)getpid(), world_rank());
  fflush(stderr);
  int saved = dup(2), fd = open(path, O_CREAT | O_TRUNC | O_RDWR, 0600);
  ck_assert(saved >= 0 && fd >= 0);
  dup2(fd, 2);
  if (st != STATUS_OK) err_set(st, "%s", msg);
  *ok = world_agree_report(st, "t");
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  char *text = calloc(4096, 1);
  ck_assert(pread(fd, text, 4095, 0) >= 0);
  close(fd);
  unlink(path);
  return text;
}

/* Rank 0 prints each distinct failure once with the ranks that gave it; the other ranks print
 * nothing; every rank gets the verdict. */
START_TEST(agree_report_prints_each_message_once_with_its_ranks) {
  int W = world_size(), r = world_rank();
  bool ok = false;
  char *said = report(STATUS_OK, NULL, &ok);
  expect_all(ok && said[0] == '\0', "all passed: true and silent, got \"%s\"", said);
  free(said);

  static const char *const halves[9] = {
      [1] = "t: [rank 0] first half\n",
      [2] = "t: [rank 0] first half\nt: [rank 1] stopping: another rank failed\n",
      [3] = "t: [rank 0] first half\nt: [ranks 1,2] stopping: another rank failed\n",
      [4] = "t: [ranks 0,1] first half\nt: [ranks 2,3] stopping: another rank failed\n",
      [6] = "t: [ranks 0-2] first half\nt: [ranks 3-5] stopping: another rank failed\n",
      [8] = "t: [ranks 0-3] first half\nt: [ranks 4-7] stopping: another rank failed\n"};
  ck_assert(W <= 8 && halves[W] != NULL);
  int half = W / 2 > 0 ? W / 2 : 1;
  said = report(r < half ? STATUS_EINVAL : STATUS_OK, "first half", &ok);
  const char *want = r == 0 ? halves[W] : "";
  expect_all(!ok && strcmp(said, want) == 0, "rank %d printed \"%s\", expected \"%s\"", r,
             said, want);
  free(said);

  static const char *const thirds[9] = {
      [1] = "t: [rank 0] message A\n",
      [2] = "t: [rank 0] message A\nt: [rank 1] message B\n",
      [3] = "t: [rank 0] message A\nt: [rank 1] message B\n"
            "t: [rank 2] stopping: another rank failed\n",
      [4] = "t: [ranks 0,3] message A\nt: [rank 1] message B\n"
            "t: [rank 2] stopping: another rank failed\n",
      [6] = "t: [ranks 0,3] message A\nt: [ranks 1,4] message B\n"
            "t: [ranks 2,5] stopping: another rank failed\n",
      [8] = "t: [ranks 0,3,6] message A\nt: [ranks 1,4,7] message B\n"
            "t: [ranks 2,5] stopping: another rank failed\n"};
  said = report(r % 3 == 2 ? STATUS_OK : STATUS_EINVAL, r % 3 ? "message B" : "message A", &ok);
  want = r == 0 ? thirds[W] : "";
  expect_all(!ok && strcmp(said, want) == 0, "rank %d printed \"%s\", expected \"%s\"", r,
             said, want);
  free(said);

  /* rank 1's failure, which the others pass on as "rank 1: ..." (the agreement's copy), is
   * said once with every rank that stops on it and rank 1 named; rank 3's own, apart */
  static const char *const relayed[9] = {
      [2] = "t: [ranks 0,1, from rank 1] file 1\n",
      [3] = "t: [ranks 0-2, from rank 1] file 1\n",
      [4] = "t: [ranks 0-2, from rank 1] file 1\nt: [rank 3] file 3\n",
      [6] = "t: [ranks 0-2,4,5, from rank 1] file 1\nt: [rank 3] file 3\n",
      [8] = "t: [ranks 0-2,4-7, from rank 1] file 1\nt: [rank 3] file 3\n"};
  if (W >= 2) {
    said = report(STATUS_EIO, r == 1 ? "file 1" : r == 3 ? "file 3" : "rank 1: file 1", &ok);
    want = r == 0 ? relayed[W] : "";
    expect_all(!ok && strcmp(said, want) == 0, "rank %d printed \"%s\", expected \"%s\"", r, said,
               want);
    free(said);
  }
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("mesh");
  TCase *tc = tcase_create("mpi");
  tcase_add_test(tc, mesh_1d_infers_world_size);
  tcase_add_test(tc, mesh_2d_groups_differ_in_one_coordinate);
  tcase_add_test(tc, mesh_slice_reuses_parent_groups);
  tcase_add_test(tc, mesh_groups_come_from_one_group_of_every_rank);
  tcase_add_test(tc, mesh_flatten_makes_row_major_group);
  tcase_add_test(tc, mesh_concat_interleaved_is_row_major_over_its_coordinates);
  tcase_add_test(tc, mesh_size_mismatch_fails_on_every_rank);
  tcase_add_test(tc, mesh_cuda_without_device_fails_on_every_rank);
  tcase_add_test(tc, agree_report_prints_each_message_once_with_its_ranks);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
