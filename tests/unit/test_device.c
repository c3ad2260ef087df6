/*
 * The device layer under the tensors: the choice of device for every count of devices and
 * ranks, the poll loop of host waits for device work, memory accounting and the host block
 * cache, and the kernel profile.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/kernels.h"
#include "core/tensor.h"
#include "tests/harness.h"

/* auto, cpu and cuda against what each rank of a node sees: how many devices, and which one
 * it would take (its local rank modulo the count). Each row: the node (per local rank, the
 * count and the last byte of the UUID it would take), the rank asking, and its device or its
 * error, with what why or the error says. */
START_TEST(device_choice_by_what_each_rank_sees) {
  enum { MAXR = 4 };
  static const struct {
    const char *layout;
    device_want_t want;
    int ranks, count[MAXR], pick[MAXR], me;
    bool share; /* host-staged groups: ranks may share a device */
    fsdpc_status_t st;
    device_type_t type;
    const char *says; /* in why (auto) or the error (cuda); NULL: why is empty */
  } rows[] = {
      // clang-format off
      {"one device per task (Slurm --gpus-per-task=1)", DEVICE_WANT_AUTO, 4, {1, 1, 1, 1},
       {10, 11, 12, 13}, 2, false, STATUS_OK, DEVICE_CUDA, NULL},
      {"one device per task, cuda", DEVICE_WANT_CUDA, 4, {1, 1, 1, 1}, {10, 11, 12, 13}, 3, false,
       STATUS_OK, DEVICE_CUDA, NULL},
      {"every device visible to every rank", DEVICE_WANT_CUDA, 4, {4, 4, 4, 4}, {0, 1, 2, 3}, 0, false,
       STATUS_OK, DEVICE_CUDA, NULL},
      {"more devices than ranks", DEVICE_WANT_AUTO, 2, {8, 8}, {0, 1}, 1, false, STATUS_OK, DEVICE_CUDA,
       NULL},
      {"one rank, one device", DEVICE_WANT_AUTO, 1, {1}, {5}, 0, false, STATUS_OK, DEVICE_CUDA, NULL},
      {"fewer devices than ranks", DEVICE_WANT_AUTO, 4, {2, 2, 2, 2}, {0, 1, 0, 1}, 1, false, STATUS_OK,
       DEVICE_CPU,
       "local ranks 0 and 2 of this node would share CUDA device GPU-00000000-0000-0000-0000-"
       "000000000000 (4 ranks, 2 devices seen by rank 0; NCCL needs one per rank): running on the "
       "CPU; start at most 2 ranks per node, or give each rank a device of its own (Slurm: "
       "--gpus-per-task=1)"},
      {"fewer devices than ranks, cuda", DEVICE_WANT_CUDA, 4, {2, 2, 2, 2}, {0, 1, 0, 1}, 3, false,
       STATUS_ENODEV, DEVICE_CPU,
       "local ranks 0 and 2 of this node would share CUDA device GPU-00000000-0000-0000-0000-"
       "000000000000 (4 ranks, 2 devices seen by rank 0; NCCL needs one per rank): start at "
       "most 2 ranks per node, or give each rank a device of its own (Slurm: --gpus-per-task=1), "
       "or ask for the CPU (cpu)"},
      {"two ranks given the same device", DEVICE_WANT_CUDA, 2, {1, 1}, {7, 7}, 0, false, STATUS_ENODEV,
       DEVICE_CPU, "local ranks 0 and 1 of this node would share CUDA device GPU-00000000-0000-"
       "0000-0000-000000000007 (2 ranks, 1 device seen by rank 0; NCCL needs one per rank)"},
      {"two ranks given the same device, auto", DEVICE_WANT_AUTO, 3, {1, 1, 1}, {7, 8, 8}, 0, false,
       STATUS_OK, DEVICE_CPU, "local ranks 1 and 2 of this node would share CUDA device"},
      {"another rank sees none", DEVICE_WANT_AUTO, 2, {1, 0}, {3, 0}, 0, false, STATUS_OK, DEVICE_CPU,
       "local rank 1 of this node sees no CUDA device: running on the CPU"},
      {"this rank sees none", DEVICE_WANT_AUTO, 2, {1, 0}, {3, 0}, 1, false, STATUS_OK, DEVICE_CPU,
       ": running on the CPU"}, /* "this rank sees no CUDA device" or "built without CUDA" */
      {"another rank sees none, cuda", DEVICE_WANT_CUDA, 2, {1, 0}, {3, 0}, 0, false, STATUS_ENODEV,
       DEVICE_CPU, "local rank 1 of this node sees no CUDA device: ask for the CPU (cpu), or for "
       "auto"},
      {"no device anywhere", DEVICE_WANT_AUTO, 4, {0, 0, 0, 0}, {0}, 2, false, STATUS_OK, DEVICE_CPU,
       NULL},
      {"no device anywhere, cuda", DEVICE_WANT_CUDA, 1, {0}, {0}, 0, false, STATUS_ENODEV, DEVICE_CPU,
       "ask for the CPU (cpu), or for auto"},
      {"two ranks given the same device, host-staged", DEVICE_WANT_CUDA, 2, {1, 1}, {7, 7}, 0,
       true, STATUS_OK, DEVICE_CUDA, NULL},
      {"fewer devices than ranks, host-staged", DEVICE_WANT_AUTO, 4, {2, 2, 2, 2}, {0, 1, 0, 1},
       3, true, STATUS_OK, DEVICE_CUDA, NULL},
      {"another rank sees none, host-staged", DEVICE_WANT_CUDA, 2, {1, 0}, {3, 0}, 0, true,
       STATUS_ENODEV, DEVICE_CPU, "local rank 1 of this node sees no CUDA device"},
      {"the CPU beside devices", DEVICE_WANT_CPU, 2, {8, 8}, {0, 1}, 0, false, STATUS_OK, DEVICE_CPU,
       NULL},
      // clang-format on
  };
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    device_seen_t seen[MAXR];
    memset(seen, 0, sizeof seen);
    for (int r = 0; r < rows[i].ranks; r++) {
      seen[r].count = rows[i].count[r];
      if (seen[r].count > 0) seen[r].pick.b[15] = (uint8_t)rows[i].pick[r];
    }
    device_type_t type = (device_type_t)-1;
    char why[512] = "x";
    err_clear();
    fsdpc_status_t st = device_choose_node(rows[i].want, rows[i].ranks, seen, rows[i].me,
                                           rows[i].share, &type, why, sizeof why);
    ck_assert_msg(st == rows[i].st, "%s: status %d (%s)", rows[i].layout, (int)st, err_detail());
    if (st == STATUS_OK)
      ck_assert_msg(type == rows[i].type, "%s: type %d", rows[i].layout, (int)type);
    const char *text = st == STATUS_OK ? why : err_detail();
    if (rows[i].says == NULL)
      ck_assert_msg(why[0] == 0, "%s: why '%s'", rows[i].layout, why);
    else
      ck_assert_msg(strstr(text, rows[i].says) != NULL, "%s: '%s'", rows[i].layout, text);
  }
  device_seen_t one = {1, {{0}}};
  device_type_t type;
  ck_assert_int_eq(device_choose_node(DEVICE_WANT_AUTO, 1, &one, 1, false, &type, NULL, 0),
                   STATUS_EINVAL);
  device_uuid_t u = {{0x1a, 0x2b, 0x3c, 0x4d, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0xa, 0xff}};
  char buf[48];
  ck_assert_str_eq(device_uuid_str(&u, buf, sizeof buf),
                   "GPU-1a2b3c4d-0001-0203-0405-060708090aff");
  device_want_t w;
  ck_assert(device_want_parse("cuda", &w) && w == DEVICE_WANT_CUDA);
  ck_assert(device_want_parse("auto", &w) && w == DEVICE_WANT_AUTO);
  ck_assert(!device_want_parse("gpu", &w) && !device_want_parse("CPU", &w));
  ck_assert_str_eq(device_want_name(DEVICE_WANT_CPU), "cpu");
}
END_TEST

/* device_poll, the loop of every host wait for device work: done, failed, or ended by the
 * wait hook. */
typedef struct poll_state {
  int polls, ready_at; /* ready_at < 0: never; 0: fails */
} poll_state_t;

static int fake_ready(void *ctx, fsdpc_status_t *st) {
  poll_state_t *p = ctx;
  p->polls++;
  if (p->ready_at == 0) {
    *st = err_set(STATUS_ECUDA, "the device failed");
    return -1;
  }
  return p->ready_at > 0 && p->polls >= p->ready_at;
}

static double hook_waited;
static fsdpc_status_t give_up_after_5ms(const char *what, double waited) {
  hook_waited = waited;
  if (waited < 5e-3) return STATUS_OK;
  return err_set(STATUS_ETIMEOUT, "%s: given up after %.3f s", what, waited);
}

START_TEST(device_poll_ends_by_ready_failure_or_hook) {
  device_wait_hook_t saved = device_wait_hook();
  device_set_wait_hook(NULL);
  poll_state_t p = {0, 40};
  ck_assert_int_eq(device_poll(fake_ready, &p, "forty polls"), STATUS_OK);
  ck_assert_int_eq(p.polls, 40);
  p = (poll_state_t){0, 0};
  ck_assert_int_eq(device_poll(fake_ready, &p, "a failing wait"), STATUS_ECUDA);
  ck_assert_str_eq(err_detail(), "the device failed");
  device_set_wait_hook(give_up_after_5ms);
  p = (poll_state_t){0, -1};
  ck_assert_int_eq(device_poll(fake_ready, &p, "a wait that never ends"), STATUS_ETIMEOUT);
  ck_assert_ptr_nonnull(strstr(err_detail(), "a wait that never ends: given up after"));
  ck_assert(hook_waited >= 5e-3 && hook_waited < 1.0);
  device_set_wait_hook(saved);
}
END_TEST

/* FSDPC_PROFILE's table: a row per kernel name with its calls and, for copies and the
 * memory-bound kernels, the bytes they move, only while profiling is on. */
START_TEST(kernel_profile_counts_calls_per_kernel) {
  int64_t n = 1000;
  fsdpc_tensor_t a, b;
  ck_assert_int_eq(tensor_init(&a, DTYPE_F32, device_cpu(), 1, &n), STATUS_OK);
  ck_assert_int_eq(tensor_init(&b, DTYPE_F32, device_cpu(), 1, &n), STATUS_OK);
  ck_assert_int_eq(tensor_fill(&a, 1.0), STATUS_OK);
  ck_assert_int_eq(tensor_fill(&b, 2.0), STATUS_OK);
  kernel_profile_enable(true);
  kernel_profile_reset();
  for (int i = 0; i < 3; i++) ck_assert_int_eq(kernel_add(&a, &a, &b), STATUS_OK);
  ck_assert_int_eq(kernel_scale(&a, 0.5f), STATUS_OK);
  ck_assert_int_eq(tensor_copy(&b, &a), STATUS_OK); /* a copy: 8000 bytes moved */
  ck_assert_int_eq(tensor_copy(&a, &b), STATUS_OK);
  kernel_profile_enable(false);
  ck_assert_int_eq(kernel_add(&a, &a, &b), STATUS_OK); /* not counted */
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  double total = -1;
  ck_assert_int_eq(kernel_profile_report(f, &total), STATUS_OK);
  fclose(f);
  long long adds = -1, scales = -1, copies = -1;
  double ms, per, share, gbs = -1;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    if (strncmp(line, "add ", 4) == 0) sscanf(line + 4, "%lld", &adds);
    if (strncmp(line, "scale ", 6) == 0) sscanf(line + 6, "%lld", &scales);
    if (strncmp(line, "copy ", 5) == 0)
      ck_assert_int_eq(sscanf(line + 5, "%lld %lf %lf %lf%% %lf", &copies, &ms, &per, &share, &gbs),
                       5);
  }
  ck_assert_int_eq(adds, 3);
  ck_assert_int_eq(scales, 1);
  ck_assert_int_eq(copies, 2);
  ck_assert(gbs > 0);
  ck_assert(total >= 0 && total < 10);
  free(text);
  kernel_profile_row_t row;
  ck_assert(kernel_profile_get("copy", &row));
  ck_assert_int_eq(row.calls, 2);
  ck_assert(row.bytes == 16000.0 && row.seconds > 0);
  ck_assert(!kernel_profile_get("copy (cast)", &row));
  /* a memory-bound kernel's least bytes: add reads two operands and writes one */
  ck_assert(kernel_profile_get("add", &row));
  ck_assert(row.calls == 3 && row.bytes == 3 * 12000.0);
  ck_assert(kernel_profile_get("scale", &row));
  ck_assert(row.bytes == 8000.0);
  kernel_profile_reset();
  ck_assert(!kernel_profile_get("copy", &row));
  ck_assert_int_eq(kernel_profile_report(NULL, &total), STATUS_OK);
  ck_assert(total == 0);
  ck_assert_float_eq(((float *)a.data)[0], 7.0f); /* (1 + 2 + 2 + 2) / 2, copied, doubled */
  ck_assert_float_eq(((float *)b.data)[0], 3.5f);
  tensor_free(&a);
  tensor_free(&b);
}
END_TEST

START_TEST(mem_stats_and_host_waits_are_counted) {
  mem_reset_peak(device_cpu());
  mem_stats_t base = mem_stats(device_cpu());
  fsdpc_tensor_t a, b;
  int64_t s1[1] = {1000}, s2[1] = {500};
  ck_assert_int_eq(tensor_init(&a, DTYPE_F32, device_cpu(), 1, s1), STATUS_OK);
  ck_assert_int_eq(tensor_init(&b, DTYPE_I64, device_cpu(), 1, s2), STATUS_OK);
  mem_stats_t now = mem_stats(device_cpu());
  ck_assert_uint_eq(now.current - base.current, 4000 + 4000);
  tensor_free(&a);
  now = mem_stats(device_cpu());
  ck_assert_uint_eq(now.current - base.current, 4000);
  ck_assert_uint_eq(now.peak - base.current, 8000);
  mem_reset_peak(device_cpu());
  ck_assert_uint_eq(mem_stats(device_cpu()).peak, now.current);
  tensor_free(&b);
  ck_assert_uint_eq(mem_stats(device_cpu()).current, base.current);
  /* what a collective library holds is counted apart from current and peak */
  mem_stats_t before = mem_stats(device_cpu());
  mem_note_comm(device_cpu(), 3000, true);
  mem_note_comm(device_cpu(), 1000, true);
  now = mem_stats(device_cpu());
  ck_assert_uint_eq(now.comm - before.comm, 4000);
  ck_assert_uint_eq(now.current, before.current);
  ck_assert_uint_eq(now.peak, before.peak);
  mem_note_comm(device_cpu(), 4000, false);
  ck_assert_uint_eq(mem_stats(device_cpu()).comm, before.comm);
  /* a wait counts as one, whatever it polls */
  size_t waits = device_host_waits();
  poll_state_t p = {0, 3};
  ck_assert_int_eq(device_poll(fake_ready, &p, "three polls"), STATUS_OK);
  ck_assert_uint_eq(device_host_waits() - waits, 1);
}
END_TEST

/* Freed host blocks of 64 KiB and more are reused for the same size without asking the
 * system again, and a zeroed request is zeroed even when its block comes back dirty; the
 * cache stays under 1.25 times the peak of live bytes. */
START_TEST(host_cache_reuses_blocks_and_zeroes_them) {
  device_t cpu = device_cpu();
  mem_empty_cache(cpu);
  const size_t sizes[] = {(size_t)64 << 10, (size_t)300 << 10, (size_t)5 << 20};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
    size_t n = sizes[k];
    unsigned char *p;
    ck_assert_int_eq(device_alloc(cpu, n, (void **)&p), STATUS_OK);
    memset(p, 0xAB, n);
    device_free(cpu, p, n);
    size_t before = mem_os_allocs(cpu);
    ck_assert_int_eq(device_alloc_zeroed(cpu, n, (void **)&p), STATUS_OK);
    ck_assert_uint_eq(mem_os_allocs(cpu), before); /* from the cache */
    size_t nonzero = 0;
    for (size_t i = 0; i < n; i++) nonzero += p[i] != 0;
    ck_assert_msg(nonzero == 0, "%zu-byte zeroed block from the cache: %zu bytes not zero", n,
                  nonzero);
    device_free_zeroed(cpu, p, n);
  }
  /* four 2 MiB blocks freed and asked for again come from the cache (peak 8 MiB) */
  mem_empty_cache(cpu);
  const size_t MiB = (size_t)1 << 20;
  void *b[4], *big;
  size_t before = mem_os_allocs(cpu);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(device_alloc(cpu, 2 * MiB, &b[i]), STATUS_OK);
  for (int i = 0; i < 4; i++) device_free(cpu, b[i], 2 * MiB);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(device_alloc(cpu, 2 * MiB, &b[i]), STATUS_OK);
  ck_assert_uint_eq(mem_os_allocs(cpu), before + 4);
  for (int i = 0; i < 4; i++) device_free(cpu, b[i], 2 * MiB);
  /* a 6 MiB request misses: 6 live + 8 cached would pass 1.25 x 8, so the two oldest 2 MiB
   * blocks go back; asking for four 2 MiB blocks then finds two, and the 6 MiB block is
   * released for the third (6 + 6 > 10): 1 + 2 blocks from the system */
  ck_assert_int_eq(device_alloc(cpu, 6 * MiB, &big), STATUS_OK);
  device_free(cpu, big, 6 * MiB);
  for (int i = 0; i < 4; i++) ck_assert_int_eq(device_alloc(cpu, 2 * MiB, &b[i]), STATUS_OK);
  ck_assert_uint_eq(mem_os_allocs(cpu), before + 4 + 3);
  for (int i = 0; i < 4; i++) device_free(cpu, b[i], 2 * MiB);
  mem_empty_cache(cpu);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("device");
  TCase *tc = tcase_create("device");
  tcase_add_test(tc, device_choice_by_what_each_rank_sees);
  tcase_add_test(tc, device_poll_ends_by_ready_failure_or_hook);
  tcase_add_test(tc, kernel_profile_counts_calls_per_kernel);
  tcase_add_test(tc, mem_stats_and_host_waits_are_counted);
  tcase_add_test(tc, host_cache_reuses_blocks_and_zeroes_them);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
