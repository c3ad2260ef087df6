/*
 * The world's hook on host waits for device work (core/device.h, mesh/world.c), with a wait
 * that never completes standing in for a device collective a rank will never join (the same
 * poll loop as a stream, event or NCCL wait):
 *   stop      (2 ranks) rank 1 stops the job; rank 0's endless wait ends with rank 1's
 *             message, and rank 1's own wait ends at once with it;
 *   watchdog  (1 rank) with a 0.3 s watchdog the endless wait ends after about that long,
 *             naming the wait and the limit.
 * Each mode stops the job, so each runs alone: test_device_wait MODE.
 */
#include <string.h>

#include "core/device.h"
#include "mesh/world.h"
#include "tests/harness.h"

static int never(void *ctx, fsdpc_status_t *st) {
  (void)ctx;
  (void)st;
  return 0;
}

START_TEST(a_stop_ends_device_waits_on_every_rank) {
  ck_assert_int_eq(world_size(), 2);
  if (world_rank() == 1) world_stop(err_set(STATUS_EINVAL, "rank 1 gives up"));
  double t = device_clock_seconds();
  fsdpc_status_t st = device_poll(never, NULL, "an endless device wait");
  ck_assert_int_ne(st, STATUS_OK);
  ck_assert_msg(strstr(err_detail(), "rank 1 gives up") != NULL, "rank %d: %s", world_rank(),
                err_detail());
  ck_assert_msg(device_clock_seconds() - t < 60, "the wait took %.1f s",
                device_clock_seconds() - t);
}
END_TEST

START_TEST(the_watchdog_ends_a_device_wait) {
  world_set_timeout(0.3);
  double t = device_clock_seconds();
  fsdpc_status_t st = device_poll(never, NULL, "an endless device wait");
  double took = device_clock_seconds() - t;
  ck_assert_int_eq(st, STATUS_ETIMEOUT);
  ck_assert_msg(strstr(err_detail(), "an endless device wait (device work) has not completed in "
                                     "0.3 s") != NULL,
                "%s", err_detail());
  ck_assert_msg(took >= 0.3 && took < 30, "ended after %.2f s", took);
  ck_assert_int_ne(world_check(), STATUS_OK); /* the job is stopped */
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("device_wait");
  TCase *tc = tcase_create("hook");
  tcase_set_timeout(tc, 120);
  const char *mode = test_argc() > 1 ? test_argv()[1] : "stop";
  if (strcmp(mode, "watchdog") == 0)
    tcase_add_test(tc, the_watchdog_ends_a_device_wait);
  else
    tcase_add_test(tc, a_stop_ends_device_waits_on_every_rank);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
