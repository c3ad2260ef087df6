/*
 * CUDA backend against its CPU twin: every tensor operation on random inputs (device outputs
 * poisoned first, sizes that are not multiples of the block size), NCCL groups against
 * closed-form results, and DTensor redistribution on device memory. Exits 77 (skip) when no
 * CUDA device is present. Runs at any world size as long as each rank has its own GPU.
 * test_gpu abort: a wait for device work behind an NCCL collective that never completes ends
 * by the watchdog, which aborts the communicator (it stops the job, so it runs alone).
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dtensor/dtensor.h"
#include "tests/harness.h"
#ifdef FSDPC_TEST_CUDA
#include <cuda_runtime.h>
cudaStream_t cuda_stream_raw(stream_t *s); /* backends/cuda/cuda_backend.cu */
#endif

static device_t gpu(void) { return world_device(); }

static int same(const fsdpc_tensor_t *a, const fsdpc_tensor_t *b) {
  bool eq = false;
  return tensor_equal(a, b, &eq) == STATUS_OK && eq;
}

static void random_f32(fsdpc_tensor_t *t, unsigned long long seed) {
  test_rng_t rng = {seed};
  for (int64_t i = 0; i < tensor_numel(t); i++)
    ((float *)t->data)[i] = (float)((double)(test_rng_next(&rng) >> 11) * 0x1p-53 * 200.0 - 100.0);
}

START_TEST(cuda_copy_and_cast_match_cpu) {
  static const int64_t sizes[][3] = {{1, 1, 1}, {3, 5, 7}, {17, 33, 65}, {2, 257, 129}};
  static const dtype_t dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_I32, DTYPE_I64};
  int bad = 0;
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    fsdpc_tensor_t host, dev;
    ck_assert_int_eq(tensor_init(&host, DTYPE_F32, device_cpu(), 3, sizes[s]), STATUS_OK);
    random_f32(&host, 100 + s);
    ck_assert_int_eq(tensor_clone(&dev, &host, DTYPE_F32, gpu()), STATUS_OK);
    for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) {
      fsdpc_tensor_t want, got, back;
      ck_assert_int_eq(tensor_clone(&want, &host, dts[d], device_cpu()), STATUS_OK);
      ck_assert_int_eq(tensor_init(&got, dts[d], gpu(), 3, sizes[s]), STATUS_OK);
      ck_assert_int_eq(tensor_fill(&got, -12345), STATUS_OK); /* poison */
      ck_assert_int_eq(tensor_copy(&got, &dev), STATUS_OK);   /* cast on the device */
      ck_assert_int_eq(tensor_clone(&back, &got, dts[d], device_cpu()), STATUS_OK);
      if (!same(&back, &want)) {
        fprintf(stderr, "cast f32 -> %s differs for size %lld\n", dtype_name(dts[d]),
                (long long)tensor_numel(&host));
        bad++;
      }
      /* between the float dtypes on the device: whole tensors, and from one row in (off the
       * vector casts' alignment) */
      for (size_t e = 0; e < 3 && d < 3; e++) {
        if (e == d) continue;
        for (int from_row = 0; from_row < 2 && from_row < sizes[s][0]; from_row++) {
          fsdpc_tensor_t gv, wv, want2, got2;
          int64_t rows = sizes[s][0] - from_row;
          ck_assert_int_eq(tensor_narrow(&gv, &got, 0, from_row, rows), STATUS_OK);
          ck_assert_int_eq(tensor_narrow(&wv, &want, 0, from_row, rows), STATUS_OK);
          ck_assert_int_eq(tensor_clone(&want2, &wv, dts[e], device_cpu()), STATUS_OK);
          ck_assert_int_eq(tensor_clone(&got2, &gv, dts[e], gpu()), STATUS_OK);
          if (!same(&got2, &want2)) {
            fprintf(stderr, "cast %s -> %s differs for size %lld from row %d\n", dtype_name(dts[d]),
                    dtype_name(dts[e]), (long long)tensor_numel(&wv), from_row);
            bad++;
          }
          tensor_free(&gv);
          tensor_free(&wv);
          tensor_free(&want2);
          tensor_free(&got2);
        }
      }
      tensor_free(&want);
      tensor_free(&got);
      tensor_free(&back);
    }
    /* strided narrow along the last dimension, device to device and device to host */
    if (sizes[s][2] > 2) {
      fsdpc_tensor_t hv, dv, want, got, back;
      ck_assert_int_eq(tensor_narrow(&hv, &host, 2, 1, sizes[s][2] - 2), STATUS_OK);
      ck_assert_int_eq(tensor_narrow(&dv, &dev, 2, 1, sizes[s][2] - 2), STATUS_OK);
      ck_assert_int_eq(tensor_clone(&want, &hv, DTYPE_BF16, device_cpu()), STATUS_OK);
      ck_assert_int_eq(tensor_clone(&got, &dv, DTYPE_BF16, gpu()), STATUS_OK);
      ck_assert_int_eq(tensor_clone(&back, &dv, DTYPE_BF16, device_cpu()), STATUS_OK);
      bad += !same(&got, &want) + !same(&back, &want);
      tensor_free(&hv);
      tensor_free(&dv);
      tensor_free(&want);
      tensor_free(&got);
      tensor_free(&back);
    }
    tensor_free(&host);
    tensor_free(&dev);
  }
  ck_assert_msg(bad == 0, "%d CUDA copies differ from the CPU", bad);
}
END_TEST

/* Same-dtype copies of boxes of a 3-D tensor on the device: whole rows (one copy after the
 * dimensions merge), row ranges with pitches (2-D copies) and boxes that stay 3-D (the copy
 * kernel), for 2-, 4- and 8-byte elements, against the same boxes copied on the host. */
START_TEST(cuda_box_copies_match_cpu) {
  static const int64_t shape[3] = {5, 9, 67};
  static const int64_t boxes[][2][3] = {
      {{1, 0, 0}, {3, 9, 67}},  /* rows of dim 0: contiguous */
      {{0, 2, 0}, {5, 6, 67}},  /* rows of dim 1: pitched */
      {{2, 0, 3}, {2, 9, 60}},  /* narrowed last dim: pitched rows */
      {{0, 1, 5}, {5, 7, 31}},  /* dims 1 and 2 narrowed: 3-D */
      {{4, 8, 66}, {1, 1, 1}},  /* one element */
  };
  static const dtype_t dts[] = {DTYPE_BF16, DTYPE_F32, DTYPE_I64};
  fsdpc_tensor_t base;
  ck_assert_int_eq(tensor_init(&base, DTYPE_F32, device_cpu(), 3, shape), STATUS_OK);
  random_f32(&base, 7);
  int bad = 0;
  for (size_t t = 0; t < sizeof dts / sizeof dts[0]; t++) {
    fsdpc_tensor_t host, dev;
    ck_assert_int_eq(tensor_clone(&host, &base, dts[t], device_cpu()), STATUS_OK);
    ck_assert_int_eq(tensor_clone(&dev, &host, dts[t], gpu()), STATUS_OK);
    for (size_t b = 0; b < sizeof boxes / sizeof boxes[0]; b++) {
      fsdpc_tensor_t hv, dv, want, got, back, into, into_back, iv, expect, ev;
      ck_assert_int_eq(tensor_narrow_box(&hv, &host, boxes[b][0], boxes[b][1]), STATUS_OK);
      ck_assert_int_eq(tensor_narrow_box(&dv, &dev, boxes[b][0], boxes[b][1]), STATUS_OK);
      ck_assert_int_eq(tensor_clone(&want, &hv, dts[t], device_cpu()), STATUS_OK);
      ck_assert_int_eq(tensor_clone(&got, &dv, dts[t], gpu()), STATUS_OK); /* box -> dense */
      ck_assert_int_eq(tensor_clone(&back, &got, dts[t], device_cpu()), STATUS_OK);
      /* dense -> box, into a poisoned tensor: the box holds the values, the rest the poison */
      ck_assert_int_eq(tensor_init(&into, dts[t], gpu(), 3, shape), STATUS_OK);
      ck_assert_int_eq(tensor_init(&expect, dts[t], device_cpu(), 3, shape), STATUS_OK);
      ck_assert_int_eq(tensor_fill(&into, -3), STATUS_OK);
      ck_assert_int_eq(tensor_fill(&expect, -3), STATUS_OK);
      ck_assert_int_eq(tensor_narrow_box(&iv, &into, boxes[b][0], boxes[b][1]), STATUS_OK);
      ck_assert_int_eq(tensor_narrow_box(&ev, &expect, boxes[b][0], boxes[b][1]), STATUS_OK);
      ck_assert_int_eq(tensor_copy(&iv, &got), STATUS_OK);
      ck_assert_int_eq(tensor_copy(&ev, &want), STATUS_OK);
      ck_assert_int_eq(tensor_clone(&into_back, &into, dts[t], device_cpu()), STATUS_OK);
      if (!same(&back, &want) || !same(&into_back, &expect)) {
        fprintf(stderr, "%s box %zu copies differ from the host's\n", dtype_name(dts[t]), b);
        bad++;
      }
      fsdpc_tensor_t *all[] = {&hv, &dv, &want, &got, &back, &into, &into_back, &iv, &expect, &ev};
      for (size_t k = 0; k < sizeof all / sizeof all[0]; k++) tensor_free(all[k]);
    }
    tensor_free(&host);
    tensor_free(&dev);
  }
  tensor_free(&base);
  ck_assert_msg(bad == 0, "%d CUDA box copies differ from the CPU", bad);
}
END_TEST

/* tensor_copy_many on the device against tensor_copy on the host, pair by pair: more pairs
 * than one launch takes, same-dtype copies and casts between every two float dtypes, an
 * integer one and an integer-to-float cast (not batched), a strided destination, an empty
 * pair, offsets off every vector alignment and lengths that are not multiples of 8. Each
 * destination lies inside a poisoned buffer, so that a write past its end shows too. */
START_TEST(cuda_copy_many_matches_cpu) {
  enum { N = 150 };
  static const dtype_t dts[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_I32};
  int64_t total = 8192;
  fsdpc_tensor_t host;
  ck_assert_int_eq(tensor_init(&host, DTYPE_F32, device_cpu(), 1, &total), STATUS_OK);
  random_f32(&host, 77);
  fsdpc_tensor_t src_h[4], src_d[4];
  for (int d = 0; d < 4; d++) {
    ck_assert_int_eq(tensor_clone(&src_h[d], &host, dts[d], device_cpu()), STATUS_OK);
    ck_assert_int_eq(tensor_clone(&src_d[d], &src_h[d], dts[d], gpu()), STATUS_OK);
  }
  fsdpc_tensor_t buf_h[N], buf_d[N], dst_h[N], dst_d[N], from_h[N], from_d[N];
  for (int k = 0; k < N; k++) {
    int sd = k % 4, dd = (k / 4) % 4;
    if (dts[dd] == DTYPE_I32 && dts[sd] != DTYPE_I32) dd = sd; /* float to integer: not FSDP's */
    int64_t len = k == 5 ? 0 : 1 + (k * 997) % 3001, at = (k * 37) % 500, pad = k % 3;
    int64_t whole = len + pad + 3;
    ck_assert_int_eq(tensor_init(&buf_h[k], dts[dd], device_cpu(), 1, &whole), STATUS_OK);
    ck_assert_int_eq(tensor_fill(&buf_h[k], -7), STATUS_OK);
    ck_assert_int_eq(tensor_clone(&buf_d[k], &buf_h[k], dts[dd], gpu()), STATUS_OK);
    if (k % 13 == 1) { /* into every other element of the buffer: a strided destination */
      int64_t half = len / 2, grid[2] = {half, 2}, col[2] = {half, 1};
      fsdpc_tensor_t *bufs[2] = {&buf_h[k], &buf_d[k]}, *srcs[2] = {&src_h[sd], &src_d[sd]};
      fsdpc_tensor_t *dsts[2] = {&dst_h[k], &dst_d[k]}, *froms[2] = {&from_h[k], &from_d[k]};
      for (int side = 0; side < 2; side++) {
        fsdpc_tensor_t seg, g2, part;
        ck_assert_int_eq(tensor_narrow(&seg, bufs[side], 0, pad, 2 * half), STATUS_OK);
        ck_assert_int_eq(tensor_view(&g2, &seg, 2, grid), STATUS_OK);
        ck_assert_int_eq(tensor_narrow(dsts[side], &g2, 1, 1, 1), STATUS_OK);
        ck_assert_int_eq(tensor_narrow(&part, srcs[side], 0, at, half), STATUS_OK);
        ck_assert_int_eq(tensor_view(froms[side], &part, 2, col), STATUS_OK);
        tensor_free(&seg);
        tensor_free(&g2);
        tensor_free(&part);
      }
    } else {
      ck_assert_int_eq(tensor_narrow(&dst_h[k], &buf_h[k], 0, pad, len), STATUS_OK);
      ck_assert_int_eq(tensor_narrow(&dst_d[k], &buf_d[k], 0, pad, len), STATUS_OK);
      ck_assert_int_eq(tensor_narrow(&from_h[k], &src_h[sd], 0, at, len), STATUS_OK);
      ck_assert_int_eq(tensor_narrow(&from_d[k], &src_d[sd], 0, at, len), STATUS_OK);
    }
  }
  for (int k = 0; k < N; k++) ck_assert_int_eq(tensor_copy(&dst_h[k], &from_h[k]), STATUS_OK);
  ck_assert_int_eq(tensor_copy_many(dst_d, from_d, N), STATUS_OK);
  int bad = 0;
  for (int k = 0; k < N; k++) {
    fsdpc_tensor_t back;
    ck_assert_int_eq(tensor_clone(&back, &buf_d[k], buf_d[k].dtype, device_cpu()), STATUS_OK);
    if (!same(&back, &buf_h[k])) {
      fprintf(stderr, "copy %d (%s -> %s, %lld elements) differs\n", k,
              dtype_name(from_h[k].dtype), dtype_name(dst_h[k].dtype),
              (long long)tensor_numel(&dst_h[k]));
      bad++;
    }
    tensor_free(&back);
    tensor_free(&buf_h[k]);
    tensor_free(&buf_d[k]);
    tensor_free(&dst_h[k]);
    tensor_free(&dst_d[k]);
    tensor_free(&from_h[k]);
    tensor_free(&from_d[k]);
  }
  for (int d = 0; d < 4; d++) {
    tensor_free(&src_h[d]);
    tensor_free(&src_d[d]);
  }
  tensor_free(&host);
  ck_assert_msg(bad == 0, "%d of %d batched copies differ from the CPU", bad, N);
}
END_TEST

START_TEST(cuda_fill_and_memory_accounting) {
  mem_stats_t before = mem_stats(gpu());
  int64_t shape[1] = {1000003};
  fsdpc_tensor_t t, h, want;
  ck_assert_int_eq(tensor_init(&t, DTYPE_F16, gpu(), 1, shape), STATUS_OK);
  ck_assert_uint_eq(mem_stats(gpu()).current - before.current, 2000006);
  ck_assert_int_eq(tensor_fill(&t, 0.1), STATUS_OK);
  ck_assert_int_eq(tensor_clone(&h, &t, DTYPE_F16, device_cpu()), STATUS_OK);
  ck_assert_int_eq(tensor_init(&want, DTYPE_F16, device_cpu(), 1, shape), STATUS_OK);
  ck_assert_int_eq(tensor_fill(&want, 0.1), STATUS_OK);
  ck_assert(same(&h, &want));
  tensor_free(&t);
  tensor_free(&h);
  tensor_free(&want);
  ck_assert_uint_eq(mem_stats(gpu()).current, before.current);
}
END_TEST

START_TEST(nccl_collectives_closed_form) {
  mesh_t *mesh = NULL;
  ck_assert_int_eq(mesh_new(1, (int[]){-1}, (const char *[]){"dp"}, DEVICE_CUDA, &mesh), STATUS_OK);
  pg_t *pg = mesh_group(mesh, 0);
  /* the CUDA emulator (tests/cuda_emu) has no NCCL: the host-staged group takes its place */
  ck_assert_str_eq(pg_backend_name(pg), getenv("FSDPC_TEST_CUDA_EMULATED") ? "staged" : "nccl");
  int W = pg_size(pg), r = pg_rank(pg), bad = 0;
  size_t n = 1001;
  int64_t shape[1] = {(int64_t)(n * W)};
  fsdpc_tensor_t send, recv, host;
  ck_assert_int_eq(tensor_init(&host, DTYPE_F32, device_cpu(), 1, shape), STATUS_OK);
  for (size_t i = 0; i < n * W; i++) ((float *)host.data)[i] = (float)((r * 7 + i) % 61);
  ck_assert_int_eq(tensor_clone(&send, &host, DTYPE_F32, gpu()), STATUS_OK);
  ck_assert_int_eq(tensor_zeros(&recv, DTYPE_F32, gpu(), 1, shape), STATUS_OK);
  /* all-gather of the first n elements */
  pg_work_t *w = NULL;
  ck_assert_int_eq(pg_all_gather(pg, send.data, recv.data, n, DTYPE_F32, &w), STATUS_OK);
  ck_assert_int_eq(pg_wait(w), STATUS_OK);
  fsdpc_tensor_t back;
  ck_assert_int_eq(tensor_clone(&back, &recv, DTYPE_F32, device_cpu()), STATUS_OK);
  for (int q = 0; q < W; q++)
    for (size_t i = 0; i < n; i++)
      bad += ((float *)back.data)[q * n + i] != (float)((q * 7 + i) % 61);
  tensor_free(&back);
  /* all-reduce sum in place */
  ck_assert_int_eq(pg_all_reduce(pg, send.data, send.data, n * W, DTYPE_F32, REDUCE_SUM, NULL),
                   STATUS_OK);
  ck_assert_int_eq(tensor_clone(&back, &send, DTYPE_F32, device_cpu()), STATUS_OK);
  for (size_t i = 0; i < n * W; i++) {
    float want = 0;
    for (int q = 0; q < W; q++) want += (float)((q * 7 + i) % 61);
    bad += ((float *)back.data)[i] != want;
  }
  tensor_free(&back);
  /* all-to-all-v: rank r sends rank q (r + 2q) % 3 + 1 elements, its host values from 0 */
  size_t *sc = malloc(sizeof *sc * (size_t)W), *rc = malloc(sizeof *rc * (size_t)W), nr = 0;
  fsdpc_tensor_t src;
  ck_assert_int_eq(tensor_clone(&src, &host, DTYPE_F32, gpu()), STATUS_OK);
  for (int q = 0; q < W; q++) {
    sc[q] = (size_t)((r + 2 * q) % 3 + 1);
    nr += rc[q] = (size_t)((q + 2 * r) % 3 + 1);
  }
  ck_assert_int_eq(pg_all_to_all_v(pg, src.data, sc, recv.data, rc, DTYPE_F32, NULL), STATUS_OK);
  ck_assert_int_eq(tensor_clone(&back, &recv, DTYPE_F32, device_cpu()), STATUS_OK);
  size_t at = 0;
  for (int q = 0; q < W; q++) {
    size_t first = 0; /* where rank q's block for this rank starts in its send buffer */
    for (int j = 0; j < r; j++) first += (size_t)((q + 2 * j) % 3 + 1);
    for (size_t i = 0; i < rc[q]; i++, at++)
      bad += ((float *)back.data)[at] != (float)((q * 7 + first + i) % 61);
  }
  bad += at != nr;
  tensor_free(&back);
  /* send/recv: the first 5 elements to the next rank, from the previous one */
  pg_p2p_t ops[2] = {{.send = true, .buf = src.data, .count = 5, .peer = (r + 1) % W},
                     {.send = false, .buf = recv.data, .count = 5, .peer = (r + W - 1) % W}};
  ck_assert_int_eq(pg_send_recv(pg, ops, 2, DTYPE_F32, NULL), STATUS_OK);
  ck_assert_int_eq(tensor_clone(&back, &recv, DTYPE_F32, device_cpu()), STATUS_OK);
  for (size_t i = 0; i < 5; i++)
    bad += ((float *)back.data)[i] != (float)((((r + W - 1) % W) * 7 + i) % 61);
  tensor_free(&back);
  tensor_free(&src);
  free(sc);
  free(rc);
  pg_counters_t c = pg_counters(pg);
  bad += c.calls[PG_ALL_GATHER] != 1 || c.calls[PG_ALL_REDUCE] != 1 ||
         c.calls[PG_ALL_TO_ALL] != 1 || c.calls[PG_SEND_RECV] != 1;
  tensor_free(&send);
  tensor_free(&recv);
  tensor_free(&host);
  expect_all(bad == 0, "%d NCCL results differ", bad);
  mesh_free(mesh);
}
END_TEST

START_TEST(dtensor_redistribute_on_device) {
  mesh_t *mesh = NULL;
  ck_assert_int_eq(mesh_new(1, (int[]){-1}, (const char *[]){"dp"}, DEVICE_CUDA, &mesh), STATUS_OK);
  int64_t shape[2] = {7, 5};
  fsdpc_tensor_t host, X;
  ck_assert_int_eq(tensor_init(&host, DTYPE_F32, device_cpu(), 2, shape), STATUS_OK);
  for (int i = 0; i < 35; i++) ((float *)host.data)[i] = (float)(i % 13 - 6);
  ck_assert_int_eq(tensor_clone(&X, &host, DTYPE_F32, gpu()), STATUS_OK);
  placement_t pls[4] = {placement_shard(0), placement_shard(1), placement_replicate(),
                        placement_partial(REDUCE_SUM)};
  int bad = 0, cases = 0;
  for (int p = 0; p < 4; p++)
    for (int q = 0; q < 4; q++) {
      dtensor_t *A = NULL, *B = NULL;
      fsdpc_tensor_t full = {0};
      int ok = dtensor_distribute(&X, mesh, &pls[p], DTENSOR_ALL_RANKS, &A) == STATUS_OK &&
               dtensor_redistribute(A, &pls[q], &B) == STATUS_OK &&
               dtensor_full_tensor(B, &full) == STATUS_OK && same(&full, &X) &&
               full.device.type == DEVICE_CUDA;
      bad += !ok;
      cases++;
      tensor_free(&full);
      dtensor_free(A);
      dtensor_free(B);
    }
  if (world_rank() == 0) printf("device redistribute: %d placement pairs\n", cases);
  expect_all(bad == 0, "%d device redistributions differ", bad);
  tensor_free(&host);
  tensor_free(&X);
  mesh_free(mesh);
}
END_TEST

#ifdef FSDPC_TEST_CUDA
static atomic_int holding;

/* Runs on the stream and holds it until holding is cleared, 3 s at most (so that a failed
 * assertion cannot leave the process unable to end, and an abort that waits for the device
 * shows as a time, not a hang): device work that does not complete. */
static void CUDART_CB hold_stream(void *arg) {
  (void)arg;
  struct timespec nap = {0, 1000000};
  double end = device_clock_seconds() + 3;
  while (atomic_load(&holding) && device_clock_seconds() < end) nanosleep(&nap, NULL);
}

/* Device work queued behind an NCCL collective never completes: the host's wait for it polls,
 * and the watchdog stops the job and aborts the communicator; new work is then refused with
 * the job's stop. (A stand-in for a peer that never joins, which one GPU cannot have; the CPU
 * twin is test_device_wait. NCCL's abort waits for the device's pending work, which a stuck
 * NCCL kernel ends when aborted but a held stream does not: the hold ends at its bound, which
 * the wait's time shows (3 s on an H200 with NCCL 2.28); unbounded, the abort would wait for
 * the hold and the hold for the test's end.) */
START_TEST(nccl_abort_ends_a_stuck_wait) {
  mesh_t *mesh = NULL;
  ck_assert_int_eq(mesh_new(1, (int[]){-1}, (const char *[]){"dp"}, DEVICE_CUDA, &mesh), STATUS_OK);
  pg_t *pg = mesh_group(mesh, 0);
  /* the CUDA emulator (tests/cuda_emu) has no NCCL: the host-staged group takes its place */
  ck_assert_str_eq(pg_backend_name(pg), getenv("FSDPC_TEST_CUDA_EMULATED") ? "staged" : "nccl");
  int64_t n = 1001;
  fsdpc_tensor_t x;
  ck_assert_int_eq(tensor_zeros(&x, DTYPE_F32, gpu(), 1, &n), STATUS_OK);
  pg_work_t *w = NULL;
  ck_assert_int_eq(pg_all_reduce(pg, x.data, x.data, (size_t)n, DTYPE_F32, REDUCE_SUM, &w),
                   STATUS_OK);
  ck_assert_int_eq(pg_wait(w), STATUS_OK); /* stream-ordered: returns at once */
  atomic_store(&holding, 1);
  cudaStream_t s = cuda_stream_raw(stream_current(gpu()));
  ck_assert_int_eq(cudaLaunchHostFunc(s, hold_stream, NULL), cudaSuccess);
  world_set_timeout(0.5);
  double t = device_clock_seconds();
  fsdpc_status_t st = device_stream_sync(gpu());
  double took = device_clock_seconds() - t;
  printf("the stuck wait ended, the communicator aborted, in %.2f s\n", took);
  ck_assert_int_eq(st, STATUS_ETIMEOUT);
  ck_assert_msg(strstr(err_detail(), "has not completed in 0.5 s") != NULL, "%s", err_detail());
  ck_assert_msg(took >= 0.5 && took < 5, "the wait and the abort took %.2f s", took);
  st = pg_all_reduce(pg, x.data, x.data, (size_t)n, DTYPE_F32, REDUCE_SUM, NULL);
  ck_assert_int_eq(st, STATUS_ETIMEOUT); /* the job's stop */
  ck_assert_msg(strstr(err_detail(), "stopping the job") != NULL, "%s", err_detail());
  atomic_store(&holding, 0);
}
END_TEST
#endif

static Suite *make_suite(void) {
  Suite *s = suite_create("gpu");
  TCase *tc = tcase_create("cuda");
  tcase_set_timeout(tc, 0);
#ifdef FSDPC_TEST_CUDA
  if (test_argc() > 1 && strcmp(test_argv()[1], "abort") == 0) {
    tcase_add_test(tc, nccl_abort_ends_a_stuck_wait);
    suite_add_tcase(s, tc);
    return s;
  }
#endif
  tcase_add_test(tc, cuda_copy_and_cast_match_cpu);
  tcase_add_test(tc, cuda_box_copies_match_cpu);
  tcase_add_test(tc, cuda_copy_many_matches_cpu);
  tcase_add_test(tc, cuda_fill_and_memory_accounting);
  tcase_add_test(tc, nccl_collectives_closed_form);
  tcase_add_test(tc, dtensor_redistribute_on_device);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) {
  if (device_cuda_count() == 0) {
    printf("no CUDA device%s: skipping the GPU suite\n",
           device_cuda_compiled() ? "" : " (built without CUDA)");
    return 77;
  }
  return harness_main(argc, argv, make_suite);
}
