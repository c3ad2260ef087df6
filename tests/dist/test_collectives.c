/*
 * Every collective of the MPI backend (or, with FSDPC_PG=staged or staged-lazy, of the
 * host-staged backend, whose groups a CPU mesh then makes) against closed-form results, in every
 * dtype, with counts of 0, 1, 7 and 1001 (not multiples of the world size), in place and not,
 * blocking and asynchronous; all_to_all_v with uneven and empty blocks; point-to-point sends
 * and receives in one batch; the group counters
 * against their formulas; the host channel
 * and the groups made from a group. Run under mpirun at several world sizes. Values are small
 * integers, exact in every dtype.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/mesh.h"
#include "mesh/pg.h"
#include "tests/harness.h"

static const dtype_t all_dtypes[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_I32, DTYPE_I64};
static const size_t counts[] = {0, 1, 7, 1001};
#define NDT (sizeof all_dtypes / sizeof all_dtypes[0])
#define NCOUNTS (sizeof counts / sizeof counts[0])

/* A fresh group of every rank (its counters start at zero): a host group, or under a
 * host-staged backend (FSDPC_PG) a copy of a one-dimensional mesh's group. */
static pg_t *new_world_group(void) {
  pg_t *pg = NULL;
  if (pg_device_backend() == PG_BACKEND_NATIVE) {
    ck_assert_int_eq(pg_new_host(world_pg(), &pg), STATUS_OK);
    return pg;
  }
  mesh_t *m = NULL;
  int shape[1] = {-1};
  const char *names[1] = {"all"};
  ck_assert_int_eq(mesh_new(1, shape, names, DEVICE_CPU, &m), STATUS_OK);
  ck_assert_int_eq(pg_dup(mesh_group(m, 0), &pg), STATUS_OK);
  mesh_free(m);
  ck_assert_str_eq(pg_backend_name(pg), "staged");
  return pg;
}

static void *buf_new(dtype_t dt, size_t n) { return calloc(n ? n : 1, dtype_size(dt)); }

static void set(dtype_t dt, void *b, size_t i, double v) { dtype_store(dt, b, i, v); }
static double get(dtype_t dt, const void *b, size_t i) { return dtype_load(dt, b, i); }

/* Number of elements of got that differ from want (tol 0: exact). */
static int mismatches(dtype_t dt, const void *got, const double *want, size_t n, double tol) {
  int bad = 0;
  for (size_t i = 0; i < n; i++) {
    double g = get(dt, got, i), w = want[i];
    if (tol == 0 ? g != w : fabs(g - w) > tol * fmax(1.0, fabs(w))) bad++;
  }
  return bad;
}

/* What a reduction by op of value(q, i) over the W ranks q gives, in closed form. */
static double reduced(int op, int W, double (*value)(int q, size_t i), size_t i) {
  double acc = op == REDUCE_MAX ? -1e30 : 0;
  for (int q = 0; q < W; q++) acc = op == REDUCE_MAX ? fmax(acc, value(q, i)) : acc + value(q, i);
  return op == REDUCE_AVG ? acc / W : acc;
}

/* Exact, but for an average's rounding in dt. */
static double reduce_tol(int op, dtype_t dt) {
  return op != REDUCE_AVG ? 0 : dt == DTYPE_F32 ? 1e-6 : 1e-2;
}

/* Rank q's element j of what the reductions reduce: small integers, exact in every dtype. */
static double scatter_value(int q, size_t j) { return (double)((q + j) % 5 + (j % 3)); }
static double reduce_value(int q, size_t i) { return (double)((q * 3 + i) % 11) - 4; }

START_TEST(all_gather_every_dtype_and_count) {
  pg_t *pg = new_world_group();
  int W = pg_size(pg), r = pg_rank(pg), bad = 0;
  for (size_t di = 0; di < NDT; di++)
    for (size_t ci = 0; ci < NCOUNTS; ci++)
      for (int inplace = 0; inplace < 2; inplace++) {
        dtype_t dt = all_dtypes[di];
        size_t n = counts[ci];
        void *send = buf_new(dt, n), *recv = buf_new(dt, n * W);
        double *want = malloc(sizeof(double) * (n * W + 1));
        for (size_t i = 0; i < n; i++) set(dt, send, i, (double)((r * 7 + i) % 61));
        for (int q = 0; q < W; q++)
          for (size_t i = 0; i < n; i++) want[q * n + i] = (double)((q * 7 + i) % 61);
        const void *src = send;
        if (inplace) {
          memcpy((char *)recv + r * n * dtype_size(dt), send, n * dtype_size(dt));
          src = (char *)recv + r * n * dtype_size(dt);
        }
        if (pg_all_gather(pg, src, recv, n, dt, NULL) != STATUS_OK) bad++;
        bad += mismatches(dt, recv, want, n * W, 0);
        free(send);
        free(recv);
        free(want);
      }
  expect_all(bad == 0, "all_gather: %d mismatches", bad);
  pg_release(pg);
}
END_TEST

START_TEST(reduce_scatter_sum_avg_max) {
  pg_t *pg = new_world_group();
  int W = pg_size(pg), r = pg_rank(pg), bad = 0;
  for (size_t di = 0; di < NDT; di++)
    for (size_t ci = 0; ci < NCOUNTS; ci++)
      for (int op = REDUCE_SUM; op <= REDUCE_MAX; op++) {
        dtype_t dt = all_dtypes[di];
        if (op == REDUCE_AVG && !dtype_is_float(dt)) continue;
        size_t n = counts[ci];
        void *send = buf_new(dt, n * W), *recv = buf_new(dt, n);
        double *want = calloc(n + 1, sizeof(double));
        for (size_t j = 0; j < n * W; j++) set(dt, send, j, scatter_value(r, j));
        for (size_t i = 0; i < n; i++) want[i] = reduced(op, W, scatter_value, r * n + i);
        if (pg_reduce_scatter(pg, send, recv, n, dt, (reduce_op_t)op, NULL) != STATUS_OK) bad++;
        bad += mismatches(dt, recv, want, n, reduce_tol(op, dt));
        free(send);
        free(recv);
        free(want);
      }
  expect_all(bad == 0, "reduce_scatter: %d mismatches", bad);
  pg_release(pg);
}
END_TEST

START_TEST(all_reduce_sum_avg_max_in_and_out_of_place) {
  pg_t *pg = new_world_group();
  int W = pg_size(pg), r = pg_rank(pg), bad = 0;
  for (size_t di = 0; di < NDT; di++)
    for (size_t ci = 0; ci < NCOUNTS; ci++)
      for (int op = REDUCE_SUM; op <= REDUCE_MAX; op++)
        for (int inplace = 0; inplace < 2; inplace++) {
          dtype_t dt = all_dtypes[di];
          if (op == REDUCE_AVG && !dtype_is_float(dt)) continue;
          size_t n = counts[ci];
          void *send = buf_new(dt, n), *recv = buf_new(dt, n);
          double *want = calloc(n + 1, sizeof(double));
          for (size_t i = 0; i < n; i++) set(dt, send, i, reduce_value(r, i));
          for (size_t i = 0; i < n; i++) want[i] = reduced(op, W, reduce_value, i);
          void *dst = inplace ? send : recv;
          if (pg_all_reduce(pg, send, dst, n, dt, (reduce_op_t)op, NULL) != STATUS_OK) bad++;
          bad += mismatches(dt, dst, want, n, reduce_tol(op, dt));
          free(send);
          free(recv);
          free(want);
        }
  expect_all(bad == 0, "all_reduce: %d mismatches", bad);
  pg_release(pg);
}
END_TEST

START_TEST(all_to_all_every_dtype_and_count) {
  pg_t *pg = new_world_group();
  int W = pg_size(pg), r = pg_rank(pg), bad = 0;
  for (size_t di = 0; di < NDT; di++)
    for (size_t ci = 0; ci < NCOUNTS; ci++) {
      dtype_t dt = all_dtypes[di];
      size_t n = counts[ci];
      void *send = buf_new(dt, n * W), *recv = buf_new(dt, n * W);
      double *want = malloc(sizeof(double) * (n * W + 1));
      for (int j = 0; j < W; j++)
        for (size_t i = 0; i < n; i++)
          set(dt, send, j * n + i, (double)((r * 11 + j * 3 + i) % 97));
      for (int q = 0; q < W; q++)
        for (size_t i = 0; i < n; i++) want[q * n + i] = (double)((q * 11 + r * 3 + i) % 97);
      if (pg_all_to_all(pg, send, recv, n, dt, NULL) != STATUS_OK) bad++;
      bad += mismatches(dt, recv, want, n * W, 0);
      free(send);
      free(recv);
      free(want);
    }
  expect_all(bad == 0, "all_to_all: %d mismatches", bad);
  pg_release(pg);
}
END_TEST

/* The elements rank q sends rank j in all_to_all_v: empty blocks, a rank's block to itself,
 * and uneven sizes, scaled by k (0: every block empty). */
static size_t v_count(int q, int j, size_t k) { return k * (size_t)((q * 3 + j * 5) % 4); }
static double v_value(int q, int j, size_t i) { return (double)((q * 13 + j * 7 + i) % 89); }

/* all_to_all_v, blocking and asynchronous, in every dtype: each rank receives exactly the
 * blocks the others address to it; the counter adds exactly the bytes sent to other ranks. */
START_TEST(all_to_all_v_uneven_blocks) {
  pg_t *pg = new_world_group();
  int W = pg_size(pg), r = pg_rank(pg), bad = 0;
  size_t *sc = malloc(sizeof *sc * (size_t)W), *rc = malloc(sizeof *rc * (size_t)W);
  for (size_t di = 0; di < NDT; di++)
    for (size_t k = 0; k < 3; k++) {
      dtype_t dt = all_dtypes[di];
      size_t ns = 0, nr = 0, at = 0;
      for (int j = 0; j < W; j++) {
        ns += sc[j] = v_count(r, j, k * 7);
        nr += rc[j] = v_count(j, r, k * 7);
      }
      void *send = buf_new(dt, ns), *recv = buf_new(dt, nr);
      double *want = malloc(sizeof(double) * (nr + 1));
      for (int j = 0; j < W; j++)
        for (size_t i = 0; i < sc[j]; i++) set(dt, send, at++, v_value(r, j, i));
      at = 0;
      for (int q = 0; q < W; q++)
        for (size_t i = 0; i < rc[q]; i++) want[at++] = v_value(q, r, i);
      pg_reset_counters(pg);
      pg_work_t *w = NULL;
      if (pg_all_to_all_v(pg, send, sc, recv, rc, dt, k == 1 ? &w : NULL) != STATUS_OK) bad++;
      if (pg_wait(w) != STATUS_OK) bad++;
      bad += mismatches(dt, recv, want, nr, 0);
      pg_counters_t c = pg_counters(pg);
      if (c.calls[PG_ALL_TO_ALL] != 1 || c.bytes[PG_ALL_TO_ALL] != (ns - sc[r]) * dtype_size(dt))
        bad++;
      free(send);
      free(recv);
      free(want);
    }
  /* refused locally, before any exchange: NULL counts, a NULL buffer with elements to send */
  int32_t x[1];
  if (pg_all_to_all_v(pg, x, NULL, x, rc, DTYPE_I32, NULL) != STATUS_EINVAL) bad++;
  for (int j = 0; j < W; j++) sc[j] = 1;
  if (pg_all_to_all_v(pg, NULL, sc, x, rc, DTYPE_I32, NULL) != STATUS_EINVAL) bad++;
  free(sc);
  free(rc);
  expect_all(bad == 0, "all_to_all_v: %d mismatches", bad);
  pg_release(pg);
}
END_TEST

static double p2p_value(int from, int to, size_t i) {
  return (double)((from * 17 + to * 5 + i) % 83);
}

/* pg_send_recv: a ring both ways in one batch (a elements to the next rank and from the
 * previous one, b to the previous and from the next) and c to itself, every dtype, blocking
 * and asynchronous; the counter adds exactly the bytes sent to other ranks. */
START_TEST(send_recv_ring_both_ways) {
  pg_t *pg = new_world_group();
  int W = pg_size(pg), r = pg_rank(pg), bad = 0;
  int nx = (r + 1) % W, pv = (r + W - 1) % W;
  for (size_t di = 0; di < NDT; di++)
    for (int async = 0; async < 2; async++) {
      dtype_t dt = all_dtypes[di];
      size_t n[3] = {5 + di, 3, 2}; /* a, b, c */
      int to[3] = {nx, pv, r}, from[3] = {pv, nx, r};
      void *s[3], *d[3];
      pg_p2p_t ops[6];
      for (int k = 0; k < 3; k++) {
        s[k] = buf_new(dt, n[k]);
        d[k] = buf_new(dt, n[k]);
        for (size_t i = 0; i < n[k]; i++) set(dt, s[k], i, p2p_value(r, to[k], i));
        ops[2 * k] = (pg_p2p_t){.send = true, .buf = s[k], .count = n[k], .peer = to[k]};
        ops[2 * k + 1] = (pg_p2p_t){.send = false, .buf = d[k], .count = n[k], .peer = from[k]};
      }
      pg_reset_counters(pg);
      pg_work_t *w = NULL;
      if (pg_send_recv(pg, ops, 6, dt, async ? &w : NULL) != STATUS_OK) bad++;
      if (pg_wait(w) != STATUS_OK) bad++;
      for (int k = 0; k < 3; k++) {
        for (size_t i = 0; i < n[k]; i++) bad += get(dt, d[k], i) != p2p_value(from[k], r, i);
        free(s[k]);
        free(d[k]);
      }
      pg_counters_t c = pg_counters(pg);
      uint64_t sent = W > 1 ? (n[0] + n[1]) * dtype_size(dt) : 0;
      if (c.calls[PG_SEND_RECV] != 1 || c.bytes[PG_SEND_RECV] != sent) bad++;
    }
  /* refused locally: a peer outside the group, a NULL buffer with elements */
  int32_t x[1];
  pg_p2p_t op = {.send = true, .buf = x, .count = 1, .peer = W};
  if (pg_send_recv(pg, &op, 1, DTYPE_I32, NULL) != STATUS_EINVAL) bad++;
  op = (pg_p2p_t){.send = false, .buf = NULL, .count = 1, .peer = 0};
  if (pg_send_recv(pg, &op, 1, DTYPE_I32, NULL) != STATUS_EINVAL) bad++;
  if (pg_send_recv(pg, NULL, 0, DTYPE_I32, NULL) != STATUS_OK) bad++;
  expect_all(bad == 0, "send_recv: %d mismatches", bad);
  pg_release(pg);
}
END_TEST

START_TEST(broadcast_from_every_root) {
  pg_t *pg = new_world_group();
  int W = pg_size(pg), r = pg_rank(pg), bad = 0;
  for (size_t di = 0; di < NDT; di++)
    for (int root = 0; root < W; root++) {
      dtype_t dt = all_dtypes[di];
      size_t n = 7;
      void *buf = buf_new(dt, n);
      double want[7];
      for (size_t i = 0; i < n; i++) {
        want[i] = (double)(root * 10 + (int)i);
        set(dt, buf, i, r == root ? want[i] : -1);
      }
      if (pg_broadcast(pg, buf, n, dt, root, NULL) != STATUS_OK) bad++;
      bad += mismatches(dt, buf, want, n, 0);
      free(buf);
    }
  expect_all(bad == 0, "broadcast: %d mismatches", bad);
  pg_release(pg);
}
END_TEST

START_TEST(async_collectives_overlap_then_wait) {
  pg_t *pg = new_world_group();
  int W = pg_size(pg), r = pg_rank(pg), bad = 0;
  float ag_in[3] = {(float)r, (float)r + 1, (float)r + 2}, *ag_out = calloc(3 * W, sizeof(float));
  float ar[4] = {1, 2, 3, (float)r};
  pg_work_t *w1 = NULL, *w2 = NULL, *w3 = NULL;
  if (pg_all_gather(pg, ag_in, ag_out, 3, DTYPE_F32, &w1) != STATUS_OK) bad++;
  if (pg_all_reduce(pg, ar, ar, 4, DTYPE_F32, REDUCE_AVG, &w2) != STATUS_OK) bad++;
  if (pg_barrier(pg, &w3) != STATUS_OK) bad++;
  ck_assert_ptr_nonnull(w1);
  if (pg_wait(w3) != STATUS_OK || pg_wait(w2) != STATUS_OK || pg_wait(w1) != STATUS_OK) bad++;
  for (int q = 0; q < W; q++)
    for (int i = 0; i < 3; i++) bad += ag_out[q * 3 + i] != (float)(q + i);
  bad += ar[0] != 1 || ar[2] != 3 || fabsf(ar[3] - (W - 1) / 2.0f) > 1e-6f;
  free(ag_out);
  expect_all(bad == 0, "async: %d mismatches", bad);
  pg_release(pg);
}
END_TEST

START_TEST(pg_counters_match_formulas) {
  pg_t *pg = new_world_group();
  uint64_t W = (uint64_t)pg_size(pg);
  pg_reset_counters(pg);
  float *a = calloc(1000 * W, sizeof(float)), *b = calloc(1000 * W, sizeof(float));
  uint16_t *h = calloc(1000 * W, sizeof(uint16_t)), *h2 = calloc(1000 * W, sizeof(uint16_t));
  int ok = 1;
  ok &= pg_all_gather(pg, a, b, 100, DTYPE_F32, NULL) == STATUS_OK;
  ok &= pg_all_gather(pg, h, h2, 7, DTYPE_BF16, NULL) == STATUS_OK;
  ok &= pg_reduce_scatter(pg, a, b, 50, DTYPE_F32, REDUCE_AVG, NULL) == STATUS_OK;
  ok &= pg_all_reduce(pg, a, a, 1000, DTYPE_F32, REDUCE_SUM, NULL) == STATUS_OK;
  ok &= pg_all_to_all(pg, a, b, 10, DTYPE_F32, NULL) == STATUS_OK;
  ok &= pg_broadcast(pg, h, 9, DTYPE_F16, 0, NULL) == STATUS_OK;
  ok &= pg_barrier(pg, NULL) == STATUS_OK;
  ok &= pg_all_gather(pg, a, b, 0, DTYPE_F32, NULL) == STATUS_OK;
  pg_counters_t c = pg_counters(pg);
  ok &= c.calls[PG_ALL_GATHER] == 3 && c.calls[PG_REDUCE_SCATTER] == 1 &&
        c.calls[PG_ALL_REDUCE] == 1 && c.calls[PG_ALL_TO_ALL] == 1 && c.calls[PG_BROADCAST] == 1 &&
        c.calls[PG_BARRIER] == 1;
  ok &= c.bytes[PG_ALL_GATHER] == (W - 1) * (100 * 4 + 7 * 2);
  ok &= c.bytes[PG_REDUCE_SCATTER] == (W - 1) * 50 * 4;
  ok &= c.bytes[PG_ALL_REDUCE] == 2 * (W - 1) * 4000 / W;
  ok &= c.bytes[PG_ALL_TO_ALL] == (W - 1) * 10 * 4;
  ok &= c.bytes[PG_BROADCAST] == (W > 1 ? 18u : 0u);
  ok &= c.bytes[PG_BARRIER] == 0;
  free(a);
  free(b);
  free(h);
  free(h2);
  expect_all(ok, "counters differ from the formulas");
  pg_release(pg);
}
END_TEST

START_TEST(pg_rejects_bad_arguments_locally) {
  pg_t *pg = new_world_group();
  int32_t x[4] = {0};
  ck_assert_int_eq(pg_all_reduce(pg, x, x, 4, DTYPE_I32, REDUCE_AVG, NULL), STATUS_EDTYPE);
  ck_assert_int_eq(pg_all_to_all(pg, x, x, 1, DTYPE_I32, NULL), STATUS_EINVAL);
  ck_assert_int_eq(pg_broadcast(pg, x, 4, DTYPE_I32, pg_size(pg), NULL), STATUS_EINVAL);
  ck_assert_int_eq(pg_all_gather(pg, NULL, x, 4, DTYPE_I32, NULL), STATUS_EINVAL);
  ck_assert_int_eq(pg_all_reduce(pg, x, x, 4, DTYPE_COUNT, REDUCE_SUM, NULL), STATUS_EDTYPE);
  pg_counters_t c = pg_counters(pg);
  for (int k = 0; k < PG_KIND_COUNT; k++) ck_assert_uint_eq(c.calls[k], 0);
  pg_release(pg);
}
END_TEST

/* FSDPC_CHECK_COLLECTIVES=1: calls that differ between the ranks (another size, another
 * collective) are refused on every rank with the same message naming both, before any byte is
 * exchanged; calls that match run as ever. */
START_TEST(mismatched_collectives_are_named_under_the_check) {
  if (world_size() < 2) return;
  pg_t *pg = new_world_group();
  int r = pg_rank(pg);
  int32_t x[8] = {1, 1, 1, 1, 1, 1, 1, 1}, y[64] = {0};
  setenv("FSDPC_CHECK_COLLECTIVES", "1", 1);
  ck_assert_int_eq(pg_all_reduce(pg, x, y, 4, DTYPE_I32, REDUCE_SUM, NULL), STATUS_OK);
  ck_assert_int_eq(y[0], pg_size(pg));
  fsdpc_status_t st = pg_all_reduce(pg, x, y, r == 0 ? 4 : 5, DTYPE_I32, REDUCE_SUM, NULL);
  ck_assert_int_eq(st, STATUS_EINVAL);
  ck_assert_msg(strstr(err_detail(),
                       "its rank 0 (world rank 0) call 1, all_reduce of 4 x i32 (sum), its "
                       "rank 1 (world rank 1) call 1, all_reduce of 5 x i32 (sum)") != NULL,
                "rank %d: %s", r, err_detail());
  st = r == 0 ? pg_all_gather(pg, x, y, 2, DTYPE_I32, NULL)
              : pg_all_reduce(pg, x, y, 2, DTYPE_I32, REDUCE_MAX, NULL);
  ck_assert_int_eq(st, STATUS_EINVAL);
  ck_assert_msg(strstr(err_detail(),
                       "call 2, all_gather of 2 x i32, its rank 1 (world rank 1) call 2, "
                       "all_reduce of 2 x i32 (max)") != NULL,
                "rank %d: %s", r, err_detail());
  ck_assert_int_eq(pg_broadcast(pg, x, 8, DTYPE_I32, 0, NULL), STATUS_OK);
  unsetenv("FSDPC_CHECK_COLLECTIVES");
  pg_release(pg);
}
END_TEST

START_TEST(pg_agree_reports_the_failing_rank_everywhere) {
  int r = world_rank(), W = world_size();
  fsdpc_status_t st = r == W - 1 ? err_set(STATUS_ESHAPE, "bad shape on the last rank") : STATUS_OK;
  fsdpc_status_t agreed = pg_agree(world_pg(), st);
  ck_assert_int_eq(agreed, STATUS_ESHAPE);
  ck_assert_ptr_nonnull(strstr(err_detail(), "bad shape on the last rank"));
  ck_assert_int_eq(pg_agree(world_pg(), STATUS_OK), STATUS_OK);
  if (W < 3) return;
  /* two failing ranks each keep their own; the others learn the lower one's */
  st = r == 1       ? err_set(STATUS_EIO, "no file on rank 1")
       : r == W - 1 ? err_set(STATUS_ESHAPE, "bad shape on the last rank")
                    : STATUS_OK;
  agreed = pg_agree(world_pg(), st);
  const char *want = r == W - 1 ? "bad shape on the last rank"
                     : r == 1   ? "no file on rank 1"
                                : "rank 1: no file on rank 1";
  ck_assert_int_eq(agreed, r == W - 1 ? STATUS_ESHAPE : STATUS_EIO);
  ck_assert_msg(strcmp(err_detail(), want) == 0, "rank %d: '%s'", r, err_detail());
}
END_TEST

/* The host channel of a group against closed forms (sums and maxima of rank-dependent values
 * in every host type, an all-gather of bytes, a timed all-reduce that completes), its refusal
 * of what it cannot do, and the groups made from a group: pg_split by parity (sizes, ranks,
 * a collective inside each half) and pg_new_host (its own counters). */
START_TEST(host_channel_and_groups_from_groups) {
  int r = world_rank(), W = world_size(), bad = 0;
  pg_t *w = world_pg();
  int32_t i32[2] = {r + 1, -r}, o32[2];
  int64_t i64[2] = {(int64_t)r << 33, r}, o64[2];
  double f64[2] = {0.5 * r, -1.0 * r};
  if (pg_host_all_reduce(w, i32, o32, 2, PG_HOST_I32, REDUCE_SUM) != STATUS_OK ||
      o32[0] != W * (W + 1) / 2 || o32[1] != -W * (W - 1) / 2)
    bad++;
  if (pg_host_all_reduce(w, i64, o64, 2, PG_HOST_I64, REDUCE_MAX) != STATUS_OK ||
      o64[0] != (int64_t)(W - 1) << 33 || o64[1] != W - 1)
    bad++;
  if (pg_host_all_reduce(w, f64, f64, 2, PG_HOST_F64, REDUCE_SUM) != STATUS_OK || /* in place */
      f64[0] != 0.25 * W * (W - 1) || f64[1] != -0.5 * W * (W - 1))
    bad++;
  bool late = true;
  if (pg_host_all_reduce_within(w, i64, o64, 2, PG_HOST_I64, REDUCE_SUM, 60.0, &late) !=
          STATUS_OK ||
      late || o64[1] != (int64_t)W * (W - 1) / 2)
    bad++;
  char mine[3] = {(char)('a' + r), (char)r, 'z'}, *all = malloc(3 * (size_t)W);
  ck_assert_ptr_nonnull(all);
  if (pg_host_all_gather(w, mine, all, 3, PG_HOST_BYTE) != STATUS_OK) bad++;
  for (int k = 0; k < W; k++)
    if (all[3 * k] != 'a' + k || all[3 * k + 1] != k || all[3 * k + 2] != 'z') bad++;
  free(all);
  /* refused on every rank alike, before any communication */
  if (pg_host_all_reduce(w, mine, o32, 3, PG_HOST_BYTE, REDUCE_SUM) != STATUS_EINVAL) bad++;
  if (pg_host_all_reduce(w, i32, o32, 2, PG_HOST_I32, REDUCE_AVG) != STATUS_EINVAL) bad++;
  if (pg_host_all_reduce(w, i32, o32, -1, PG_HOST_I32, REDUCE_SUM) != STATUS_EINVAL) bad++;
  pg_t *half, *host;
  ck_assert_int_eq(pg_split(w, r % 2, W - r, &half), STATUS_OK); /* key: reversed order */
  int n = (W + 1 - r % 2) / 2, want_rank = (n - 1) - r / 2;
  if (pg_size(half) != n || pg_rank(half) != want_rank) bad++;
  int32_t one = 1, count = 0;
  if (pg_all_reduce(half, &one, &count, 1, DTYPE_I32, REDUCE_SUM, NULL) != STATUS_OK ||
      count != n)
    bad++;
  ck_assert_int_eq(pg_split(w, -1, 0, &host), STATUS_EINVAL);
  ck_assert_int_eq(pg_new_host(half, &host), STATUS_OK);
  if (pg_size(host) != n || pg_rank(host) != pg_rank(half) || pg_counters(host).calls[PG_ALL_REDUCE])
    bad++;
  pg_release(host);
  pg_t *dup; /* the same ranks in the same order; its counters and traffic its own */
  ck_assert_int_eq(pg_dup(half, &dup), STATUS_OK);
  if (pg_size(dup) != n || pg_rank(dup) != pg_rank(half) || pg_counters(dup).calls[PG_ALL_REDUCE])
    bad++;
  int32_t ranks[8] = {0}, me = pg_rank(half);
  if (pg_all_gather(dup, &me, ranks, 1, DTYPE_I32, NULL) != STATUS_OK) bad++;
  for (int k = 0; k < n && k < 8; k++)
    if (ranks[k] != k) bad++;
  if (pg_counters(half).calls[PG_ALL_GATHER] != 0 || pg_counters(dup).calls[PG_ALL_GATHER] != 1)
    bad++;
  pg_release(dup);
  pg_t *side, *again; /* the side channel: made once, kept with the group, its traffic its own */
  ck_assert_int_eq(pg_side_channel(half, &side), STATUS_OK);
  ck_assert_int_eq(pg_side_channel(half, &again), STATUS_OK);
  if (side != again || pg_size(side) != n || pg_rank(side) != pg_rank(half)) bad++;
  int32_t got = 0;
  if (pg_host_all_reduce(side, &one, &got, 1, PG_HOST_I32, REDUCE_SUM) != STATUS_OK || got != n)
    bad++;
  if (pg_counters(half).calls[PG_ALL_GATHER] != 0) bad++;
  pg_t *pairs, *pairs2; /* half's ranks two by two (when its size is even) */
  if (n % 2 == 0) {
    ck_assert_int_eq(pg_consecutive(half, 2, &pairs), STATUS_OK);
    ck_assert_int_eq(pg_consecutive(half, 2, &pairs2), STATUS_OK);
    int32_t sum = 0, mine_rank = pg_rank(half), first = mine_rank - mine_rank % 2;
    if (pairs != pairs2 || pg_size(pairs) != 2 || pg_rank(pairs) != mine_rank % 2) bad++;
    if (pg_host_all_reduce(pairs, &mine_rank, &sum, 1, PG_HOST_I32, REDUCE_SUM) != STATUS_OK ||
        sum != 2 * first + 1) /* the pair's ranks in half: first and first + 1 */
      bad++;
  } else if (pg_consecutive(half, 2, &pairs) != STATUS_EINVAL) {
    bad++;
  }
  pg_release(half);
  expect_all(bad == 0, "%d host-channel, split or dup results differ from their closed forms",
             bad);
}
END_TEST

/* Host-staged groups only: when the data is read and written. Eager mode copies the send
 * buffer in at the call, so a send buffer changed before pg_wait (which the interface
 * forbids) still gives the old values; lazy mode reads and writes only at pg_wait, so the
 * same misuse shows as the new values, and the receive buffer is untouched until pg_wait. */
START_TEST(staged_copies_in_at_the_call_or_lazily_at_the_wait) {
  pg_backend_t b = pg_device_backend();
  if (b == PG_BACKEND_NATIVE) return;
  pg_t *pg = new_world_group();
  int W = world_size(), r = world_rank();
  float send = (float)(r + 1), recv[64];
  for (int i = 0; i < W; i++) recv[i] = -1.0f;
  pg_work_t *w = NULL;
  ck_assert_int_eq(pg_all_gather(pg, &send, recv, 1, DTYPE_F32, &w), STATUS_OK);
  bool lazy = b == PG_BACKEND_STAGED_LAZY;
  for (int i = 0; i < W; i++) ck_assert(recv[i] == (lazy ? -1.0f : (float)(i + 1)));
  send = (float)(100 + r); /* the misuse */
  ck_assert_int_eq(pg_wait(w), STATUS_OK);
  for (int i = 0; i < W; i++)
    ck_assert_msg(recv[i] == (float)(lazy ? 100 + i : i + 1), "rank %d: recv[%d] = %g", r, i,
                  (double)recv[i]);
  pg_release(pg);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("collectives");
  TCase *tc = tcase_create("mpi");
  tcase_add_test(tc, all_gather_every_dtype_and_count);
  tcase_add_test(tc, reduce_scatter_sum_avg_max);
  tcase_add_test(tc, all_reduce_sum_avg_max_in_and_out_of_place);
  tcase_add_test(tc, all_to_all_every_dtype_and_count);
  tcase_add_test(tc, all_to_all_v_uneven_blocks);
  tcase_add_test(tc, send_recv_ring_both_ways);
  tcase_add_test(tc, broadcast_from_every_root);
  tcase_add_test(tc, async_collectives_overlap_then_wait);
  tcase_add_test(tc, pg_counters_match_formulas);
  tcase_add_test(tc, pg_rejects_bad_arguments_locally);
  tcase_add_test(tc, mismatched_collectives_are_named_under_the_check);
  tcase_add_test(tc, pg_agree_reports_the_failing_rank_everywhere);
  tcase_add_test(tc, host_channel_and_groups_from_groups);
  tcase_add_test(tc, staged_copies_in_at_the_call_or_lazily_at_the_wait);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
