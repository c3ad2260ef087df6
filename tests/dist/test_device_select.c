/*
 * Which device each rank takes (mesh/world.c's world_choose_device), on 4 ranks of one node,
 * with the devices each rank sees played by a test list (world_set_devices_seen) so that every
 * layout runs on any machine:
 *   one per task   each rank sees one device, a different one (Slurm's --gpus-per-task=1,
 *                  cgroup ConstrainDevices, CUDA_VISIBLE_DEVICES=$LOCAL_RANK): all on CUDA,
 *                  each on its cuda:0;
 *   all visible    each rank sees the node's 4: rank r on cuda:r;
 *   more visible   each sees 8: rank r on cuda:r;
 *   fewer          each sees the same 2: ranks 0 and 2 would share one: auto runs on the CPU
 *                  and says so, cuda fails on every rank;
 *   same device    each sees one, all the same: the same;
 *   one blind      rank 3 sees none: auto on the CPU, cuda fails naming it.
 * A fake device UUID is the layout's byte 0xa0 + (the device's number on the node).
 */
#include <stdio.h>
#include <string.h>

#include "core/device.h"
#include "mesh/world.h"
#include "tests/harness.h"

typedef enum { ONE_PER_TASK, ALL_VISIBLE, MORE_VISIBLE, FEWER, SAME_DEVICE, ONE_BLIND } layout_t;
static layout_t layout;

static fsdpc_status_t fake_seen(int local_rank, device_seen_t *out) {
  memset(out, 0, sizeof *out);
  int id = 0;
  switch (layout) {
    case ONE_PER_TASK: out->count = 1, id = local_rank; break;
    case ALL_VISIBLE: out->count = 4, id = local_rank % 4; break;
    case MORE_VISIBLE: out->count = 8, id = local_rank % 8; break;
    case FEWER: out->count = 2, id = local_rank % 2; break;
    case SAME_DEVICE: out->count = 1, id = 0; break;
    case ONE_BLIND: out->count = local_rank == 3 ? 0 : 1, id = local_rank; break;
  }
  if (out->count > 0) out->pick.b[0] = (uint8_t)(0xa0 + id);
  return STATUS_OK;
}

typedef struct expect {
  device_type_t type;
  int index_is_rank; /* cuda:(rank) rather than cuda:0 */
  const char *says;  /* in why (auto) or the error (cuda); NULL: why is empty */
} expect_t;

/* Chooses under layout l; returns the mismatches with e, each printed (every rank goes on to
 * the next choice, a collective, whatever it found). */
static int choose(layout_t l, device_want_t want, fsdpc_status_t want_st, expect_t e) {
  layout = l;
  world_set_devices_seen(fake_seen);
  device_t dev = {DEVICE_CUDA, -1};
  char why[512] = "x";
  err_clear();
  fsdpc_status_t st = world_choose_device(want, &dev, why, sizeof why);
  world_set_devices_seen(NULL);
  int r = world_rank(), bad = 0;
#define MISMATCH(cond, ...)                                                  \
  do {                                                                       \
    if (cond) {                                                              \
      printf("rank %d, layout %d, %s: ", r, (int)l, device_want_name(want)); \
      printf(__VA_ARGS__);                                                   \
      printf("\n");                                                          \
      bad++;                                                                 \
    }                                                                        \
  } while (0)
  MISMATCH(st != want_st, "status %d (%s)", (int)st, err_detail());
  const char *text = st == STATUS_OK ? why : err_detail();
  if (e.says == NULL)
    MISMATCH(why[0] != 0, "why '%s'", why);
  else
    MISMATCH(strstr(text, e.says) == NULL, "'%s' does not say '%s'", text, e.says);
  if (st != STATUS_OK || bad) return bad;
  MISMATCH(dev.type != e.type, "device type %d", (int)dev.type);
  const char *line = world_device_assignment();
  if (e.type == DEVICE_CPU) {
    MISMATCH(line[0] != 0, "an assignment line on the CPU: '%s'", line);
    return bad;
  }
  MISMATCH(dev.index != (e.index_is_rank ? r : 0), "cuda:%d", dev.index);
  if (r != 0) {
    MISMATCH(line[0] != 0, "an assignment line on rank %d: '%s'", r, line);
    return bad;
  }
  /* rank 0's line: every rank's ordinal and the start of its device's UUID */
  char want_line[256] = "";
  size_t at = 0;
  for (int q = 0; q < world_size(); q++)
    at += (size_t)snprintf(want_line + at, sizeof want_line - at, "%srank %d cuda:%d GPU-a%d000000",
                           q ? ", " : "", q, e.index_is_rank ? q : 0, q);
  MISMATCH(strcmp(line, want_line) != 0, "line '%s', expected '%s'", line, want_line);
#undef MISMATCH
  return bad;
}

START_TEST(each_rank_takes_a_device_of_its_own) {
  ck_assert_int_eq(world_size(), 4);
  ck_assert_int_eq(world_local_size(), 4);
  int bad = 0;
  for (int w = 0; w < 2; w++) {
    device_want_t want = w ? DEVICE_WANT_CUDA : DEVICE_WANT_AUTO;
    bad += choose(ONE_PER_TASK, want, STATUS_OK, (expect_t){DEVICE_CUDA, 0, NULL});
    bad += choose(ALL_VISIBLE, want, STATUS_OK, (expect_t){DEVICE_CUDA, 1, NULL});
    bad += choose(MORE_VISIBLE, want, STATUS_OK, (expect_t){DEVICE_CUDA, 1, NULL});
  }
  expect_all(bad == 0, "%d mismatches", bad);
}
END_TEST

START_TEST(ranks_that_would_share_a_device_run_on_the_cpu_or_fail) {
  static const char *share02 =
      "local ranks 0 and 2 of this node would share CUDA device "
      "GPU-a0000000-0000-0000-0000-000000000000 (4 ranks, 2 devices "
      "seen by rank 0; NCCL needs one per rank)";
  static const char *share01 =
      "local ranks 0 and 1 of this node would share CUDA device "
      "GPU-a0000000-0000-0000-0000-000000000000 (4 ranks, 1 device seen "
      "by rank 0; NCCL needs one per rank)";
  int bad = 0;
  bad += choose(FEWER, DEVICE_WANT_AUTO, STATUS_OK, (expect_t){DEVICE_CPU, 0, share02});
  bad += choose(FEWER, DEVICE_WANT_CUDA, STATUS_ENODEV, (expect_t){DEVICE_CPU, 0, share02});
  bad += choose(SAME_DEVICE, DEVICE_WANT_AUTO, STATUS_OK, (expect_t){DEVICE_CPU, 0, share01});
  bad += choose(SAME_DEVICE, DEVICE_WANT_CUDA, STATUS_ENODEV, (expect_t){DEVICE_CPU, 0, share01});
  /* rank 3 says of itself that it sees none (or, without CUDA, that there is none), the
   * others name it */
  bool r3 = world_rank() == 3;
  bad += choose(ONE_BLIND, DEVICE_WANT_AUTO, STATUS_OK,
                (expect_t){DEVICE_CPU, 0,
                           r3 ? ": running on the CPU"
                              : "local rank 3 of this node sees no CUDA device: "
                                "running on the CPU"});
  bad += choose(ONE_BLIND, DEVICE_WANT_CUDA, STATUS_ENODEV,
                (expect_t){DEVICE_CPU, 0,
                           r3 ? ": ask for the CPU (cpu), or for auto"
                              : "local rank 3 of this node sees no CUDA device: "
                                "ask for the CPU (cpu), or for auto"});
  /* the CPU asked for: the devices are not looked at */
  bad += choose(SAME_DEVICE, DEVICE_WANT_CPU, STATUS_OK, (expect_t){DEVICE_CPU, 0, NULL});
  expect_all(bad == 0, "%d mismatches", bad);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("device_select");
  TCase *tc = tcase_create("layouts");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, each_rank_takes_a_device_of_its_own);
  tcase_add_test(tc, ranks_that_would_share_a_device_run_on_the_cpu_or_fail);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
