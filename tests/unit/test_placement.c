#include <stdlib.h>
#include <string.h>

#include "dtensor/placement.h"
#include "tests/harness.h"

static void expect_chunks(int64_t n, int64_t w, const int64_t *lens) {
  int64_t expect_off = 0;
  for (int64_t r = 0; r < w; r++) {
    int64_t off, len;
    placement_chunk_range(n, w, r, &off, &len);
    ck_assert_msg(len == lens[r] && off == expect_off,
                  "n=%lld w=%lld rank %lld: got [%lld +%lld], want [%lld +%lld]", (long long)n,
                  (long long)w, (long long)r, (long long)off, (long long)len, (long long)expect_off,
                  (long long)lens[r]);
    expect_off += len;
  }
}

START_TEST(chunk_range_torch_chunk_rule) {
  expect_chunks(6, 4, (int64_t[]){2, 2, 2, 0});
  expect_chunks(1, 8, (int64_t[]){1, 0, 0, 0, 0, 0, 0, 0});
  expect_chunks(0, 3, (int64_t[]){0, 0, 0});
  expect_chunks(5, 4, (int64_t[]){2, 2, 1, 0});
  expect_chunks(7, 3, (int64_t[]){3, 3, 1});
  expect_chunks(16, 8, (int64_t[]){2, 2, 2, 2, 2, 2, 2, 2});
  expect_chunks(9, 6, (int64_t[]){2, 2, 2, 2, 1, 0});
  ck_assert_int_eq(placement_chunk_size(6, 4), 2);
  ck_assert_int_eq(placement_chunk_size(0, 4), 0);
  ck_assert_int_eq(placement_chunk_size(17, 8), 3);
  /* no ranks, a rank outside them: no chunk, never a division by zero */
  ck_assert_int_eq(placement_chunk_size(6, 0), 0);
  ck_assert_int_eq(placement_chunk_size(6, -2), 0);
  int64_t off = 9, len = 9;
  placement_chunk_range(6, 0, 0, &off, &len);
  ck_assert(off == 0 && len == 0);
  placement_chunk_range(6, 4, -1, &off, &len);
  ck_assert(off == 0 && len == 0);
  placement_chunk_range(6, 4, 7, &off, &len);
  ck_assert(off == 6 && len == 0);
}
END_TEST

static void box(int ndim, const int64_t *shape, int mdim, const int *mshape, const placement_t *pl,
                const int *coord, int64_t *ls, int64_t *off) {
  ck_assert_int_eq(placements_check(ndim, mdim, mshape, pl), STATUS_OK);
  placements_local_box(ndim, shape, mdim, mshape, pl, coord, ls, off);
}

START_TEST(local_box_1d_mesh) {
  int64_t shape[2] = {16, 15}, ls[2], off[2];
  int mshape[1] = {3};
  placement_t s0[1] = {placement_shard(0)}, s1[1] = {placement_shard(1)};
  box(2, shape, 1, mshape, s0, (int[]){2}, ls, off);
  ck_assert(ls[0] == 4 && ls[1] == 15 && off[0] == 12 && off[1] == 0);
  box(2, shape, 1, mshape, s1, (int[]){1}, ls, off);
  ck_assert(ls[0] == 16 && ls[1] == 5 && off[0] == 0 && off[1] == 5);
  int64_t small[1] = {3};
  int m8[1] = {8};
  box(1, small, 1, m8, s0, (int[]){5}, ls, off);
  ck_assert(ls[0] == 0 && off[0] == 3); /* empty trailing shard sits at the end */
}
END_TEST

START_TEST(local_box_2d_mesh_nested_shards) {
  int64_t shape[1] = {7}, ls[1], off[1];
  int mshape[2] = {2, 2};
  placement_t pl[2] = {placement_shard(0), placement_shard(0)};
  const int64_t want_off[4] = {0, 2, 4, 6}, want_len[4] = {2, 2, 2, 1};
  for (int a = 0; a < 2; a++)
    for (int b = 0; b < 2; b++) {
      box(1, shape, 2, mshape, pl, (int[]){a, b}, ls, off);
      ck_assert_int_eq(off[0], want_off[a * 2 + b]);
      ck_assert_int_eq(ls[0], want_len[a * 2 + b]);
    }
  int64_t shape2[2] = {7, 5}, ls2[2], off2[2];
  int m23[2] = {2, 3};
  placement_t p2[2] = {placement_shard(0), placement_shard(1)};
  box(2, shape2, 2, m23, p2, (int[]){1, 2}, ls2, off2);
  ck_assert(ls2[0] == 3 && off2[0] == 4 && ls2[1] == 1 && off2[1] == 4);
}
END_TEST

START_TEST(local_box_3d_mesh) {
  int64_t shape[3] = {5, 6, 9}, ls[3], off[3];
  int mshape[3] = {2, 2, 2};
  placement_t pl[3] = {placement_shard(2), placement_replicate(), placement_shard(2)};
  /* dim 2: 9 -> mesh dim 0 chunks 5,4 -> mesh dim 2 chunks (3,2) and (2,2) */
  box(3, shape, 3, mshape, pl, (int[]){1, 0, 1}, ls, off);
  ck_assert(ls[0] == 5 && ls[1] == 6 && ls[2] == 2 && off[2] == 7);
  box(3, shape, 3, mshape, pl, (int[]){0, 1, 1}, ls, off);
  ck_assert(ls[2] == 2 && off[2] == 3);
  placement_t q[3] = {placement_partial(REDUCE_SUM), placement_shard(0), placement_shard(1)};
  box(3, shape, 3, mshape, q, (int[]){1, 1, 1}, ls, off);
  ck_assert(ls[0] == 2 && off[0] == 3 && ls[1] == 3 && off[1] == 3 && ls[2] == 9);
}
END_TEST

START_TEST(local_box_strided_shard_follows_inner_split) {
  int64_t shape[2] = {7, 4}, ls[2], off[2];
  int mshape[2] = {2, 2}; /* (dp, tp) */
  placement_t pl[2] = {placement_strided_shard(0, 2), placement_shard(0)};
  /* tp splits 7 rows into [0,4) and [4,7); dp chunks each: (2,2) and (2,1) */
  const int64_t want_off[2][2] = {{0, 4}, {2, 6}}, want_len[2][2] = {{2, 2}, {2, 1}};
  for (int dp = 0; dp < 2; dp++)
    for (int tp = 0; tp < 2; tp++) {
      box(2, shape, 2, mshape, pl, (int[]){dp, tp}, ls, off);
      ck_assert_int_eq(off[0], want_off[dp][tp]);
      ck_assert_int_eq(ls[0], want_len[dp][tp]);
    }
}
END_TEST

START_TEST(placements_check_errors) {
  int mshape[2] = {2, 4};
  placement_t bad_dim[2] = {placement_shard(2), placement_replicate()};
  ck_assert_int_eq(placements_check(2, 2, mshape, bad_dim), STATUS_EPLACEMENT);
  ck_assert_ptr_nonnull(strstr(err_detail(), "dimension 2 of a 2-D tensor"));
  placement_t bad_sf[2] = {placement_strided_shard(0, 3), placement_shard(0)};
  ck_assert_int_eq(placements_check(2, 2, mshape, bad_sf), STATUS_EPLACEMENT);
  ck_assert_ptr_nonnull(strstr(err_detail(), "split factor of 4"));
  placement_t ok[2] = {placement_strided_shard(0, 4), placement_shard(0)};
  ck_assert_int_eq(placements_check(2, 2, mshape, ok), STATUS_OK);
  char buf[64];
  ck_assert_str_eq(placements_str(2, ok, buf, sizeof buf), "(SS(0,4), S(0))");
}
END_TEST

/* Every element of the tensor is held by exactly (product of non-shard mesh sizes) ranks:
 * the boxes tile the tensor, over random shapes, meshes and placements. */
START_TEST(local_boxes_tile_the_tensor) {
  test_rng_t rng = {7};
  int cases = 0;
  for (int iter = 0; iter < 3000; iter++) {
    int ndim = test_rng_int(&rng, 1, 3), mdim = test_rng_int(&rng, 1, 3);
    int64_t shape[3];
    int mshape[3];
    placement_t pl[3];
    int64_t numel = 1;
    int replicas = 1, nranks = 1;
    for (int d = 0; d < ndim; d++) numel *= (shape[d] = test_rng_int(&rng, 0, 9));
    for (int i = 0; i < mdim; i++) {
      nranks *= (mshape[i] = test_rng_int(&rng, 1, 4));
      int k = test_rng_int(&rng, 0, ndim + 1);
      pl[i] = k < ndim ? placement_shard(k)
                       : (k == ndim ? placement_replicate() : placement_partial(REDUCE_SUM));
      if (pl[i].kind != PLACEMENT_SHARD) replicas *= mshape[i];
    }
    int *count = calloc((size_t)(numel ? numel : 1), sizeof(int));
    for (int r = 0; r < nranks; r++) {
      int coord[3], rest = r;
      for (int i = mdim - 1; i >= 0; i--) {
        coord[i] = rest % mshape[i];
        rest /= mshape[i];
      }
      int64_t ls[3], off[3];
      box(ndim, shape, mdim, mshape, pl, coord, ls, off);
      int64_t n = 1;
      for (int d = 0; d < ndim; d++) {
        ck_assert(off[d] >= 0 && ls[d] >= 0 && off[d] + ls[d] <= shape[d]);
        n *= ls[d];
      }
      for (int64_t e = 0; e < n; e++) {
        int64_t idx = 0, rem = e;
        int64_t sub[3];
        for (int d = ndim - 1; d >= 0; d--) {
          sub[d] = rem % ls[d];
          rem /= ls[d];
        }
        for (int d = 0; d < ndim; d++) idx = idx * shape[d] + off[d] + sub[d];
        count[idx]++;
      }
    }
    for (int64_t e = 0; e < numel; e++) ck_assert_int_eq(count[e], replicas);
    free(count);
    cases++;
  }
  ck_assert_int_eq(cases, 3000);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("placement");
  TCase *tc = tcase_create("core");
  tcase_add_test(tc, chunk_range_torch_chunk_rule);
  tcase_add_test(tc, local_box_1d_mesh);
  tcase_add_test(tc, local_box_2d_mesh_nested_shards);
  tcase_add_test(tc, local_box_3d_mesh);
  tcase_add_test(tc, local_box_strided_shard_follows_inner_split);
  tcase_add_test(tc, placements_check_errors);
  tcase_add_test(tc, local_boxes_tile_the_tensor);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
