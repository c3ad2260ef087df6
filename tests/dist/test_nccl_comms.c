/*
 * The failure and teardown paths of the NCCL communicators (mesh/nccl_comms.c), run in every
 * build through a recording table standing in for NCCL: each mock communicator logs the calls
 * made on it and answers as its script says.
 *   paths     (1 rank) results, errors, closing a healthy and a stuck communicator, abort_all;
 *   async     (1 rank) an asynchronous error, seen during a host wait for device work: the
 *             wait ends naming the communicator, every communicator is aborted, the job stops;
 *   async-mpi (2 ranks) the same error seen by rank 0 while it waits in a host collective that
 *             rank 1 joins late: both ranks end with its message, well before rank 1 joins;
 *   stop      (2 ranks) rank 1 stops the job: its communicators are aborted at once, rank 0's
 *             when its wait for device work sees the stop.
 * Each mode but paths stops the job, so each runs alone: test_nccl_comms MODE.
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "core/device.h"
#include "mesh/nccl_comms_impl.h"
#include "mesh/world.h"
#include "tests/harness.h"

enum { IN_PROGRESS = NCCL_RESULT_IN_PROGRESS, REMOTE_ERROR = 6 };

typedef struct mock {
  char log[256];
  int busy;           /* async_error answers in progress this many more times (-1: for good) */
  int error;          /* then this state (0: success) */
  double error_after; /* or, from this long after it was made, REMOTE_ERROR (0: never) */
  double made;
  int aborts, destroys;
} mock_t;

static void note(mock_t *m, const char *call) {
  size_t n = strlen(m->log);
  snprintf(m->log + n, sizeof m->log - n, "%s%s", n ? "," : "", call);
}

static int mock_abort(void *c) {
  mock_t *m = c;
  m->aborts++;
  note(m, "abort");
  return 0;
}
static int mock_finalize(void *c) {
  note(c, "finalize");
  return IN_PROGRESS;
}
static int mock_destroy(void *c) {
  mock_t *m = c;
  m->destroys++;
  note(m, "destroy");
  return 0;
}
static int mock_async(void *c, int *state) {
  mock_t *m = c;
  if (m->error_after > 0 && device_clock_seconds() - m->made >= m->error_after) {
    *state = REMOTE_ERROR;
  } else if (m->busy != 0) {
    if (m->busy > 0) m->busy--;
    *state = IN_PROGRESS;
  } else {
    *state = m->error;
  }
  if (*state != IN_PROGRESS && strstr(m->log, "async") == NULL) note(m, "async");
  return 0;
}
static const char *mock_text(int rc) {
  static char buf[32];
  snprintf(buf, sizeof buf, "mock error %d", rc);
  return buf;
}
static const nccl_table_t table = {mock_abort, mock_finalize, mock_destroy, mock_async, mock_text};

static void make(nccl_comm_t *c, mock_t *m, const char *name) {
  memset(c, 0, sizeof *c);
  m->made = device_clock_seconds();
  c->comm = m;
  c->t = &table;
  snprintf(c->name, sizeof c->name, "%s", name);
  nccl_comm_track(c);
}

static int never(void *ctx, fsdpc_status_t *st) {
  (void)ctx;
  (void)st;
  return 0;
}

START_TEST(results_errors_and_closing) {
  /* a call still in progress is polled to its end; an error aborts its communicator */
  mock_t a = {.busy = 3};
  nccl_comm_t ca;
  make(&ca, &a, "mock-a");
  ck_assert_int_eq(nccl_comm_result(&ca, 0, "a call"), STATUS_OK);
  ck_assert_int_eq(nccl_comm_result(&ca, IN_PROGRESS, "a call in progress"), STATUS_OK);
  ck_assert_int_eq(a.busy, 0);
  ck_assert_int_eq(a.aborts, 0);
  ck_assert_int_eq(nccl_comm_result(&ca, 3, "ncclAllGather"), STATUS_ENCCL);
  ck_assert_str_eq(err_detail(), "ncclAllGather: mock error 3 (NCCL communicator mock-a)");
  ck_assert(ca.aborted);
  ck_assert_int_eq(a.aborts, 1);
  ck_assert_int_eq(nccl_comm_result(&ca, IN_PROGRESS, "after the abort"), STATUS_ENCCL);
  ck_assert_ptr_nonnull(strstr(err_detail(), "was aborted"));
  /* closing the aborted one: nothing more is called on it (NCCL freed it) */
  ck_assert_int_eq(nccl_comm_close(&ca, 1.0), STATUS_OK);
  ck_assert_str_eq(a.log, "async,abort");

  /* a healthy communicator: finalized, its work drained, destroyed */
  mock_t b = {.busy = 5};
  nccl_comm_t cb;
  make(&cb, &b, "mock-b");
  ck_assert_int_eq(nccl_comm_close(&cb, 5.0), STATUS_OK);
  ck_assert_str_eq(b.log, "finalize,async,destroy");
  ck_assert_int_eq(b.busy, 0);

  /* a stuck one: the limit ends the finalize, and it is aborted, never destroyed */
  mock_t c = {.busy = -1};
  nccl_comm_t cc;
  make(&cc, &c, "mock-c");
  double t = device_clock_seconds();
  ck_assert_int_eq(nccl_comm_close(&cc, 0.2), STATUS_ETIMEOUT);
  ck_assert(device_clock_seconds() - t >= 0.2 && device_clock_seconds() - t < 10);
  ck_assert_str_eq(err_detail(),
                   "ncclCommFinalize of NCCL communicator mock-c has not completed in 0.2 s");
  ck_assert_str_eq(c.log, "finalize,abort");

  /* a failing finalize: aborted */
  mock_t d = {.error = REMOTE_ERROR};
  nccl_comm_t cd;
  make(&cd, &d, "mock-d");
  ck_assert_int_eq(nccl_comm_close(&cd, 5.0), STATUS_ENCCL);
  ck_assert_str_eq(d.log, "finalize,async,abort");

  /* abort_all: every live communicator once; closed ones are no longer live */
  mock_t e = {0}, f = {0};
  nccl_comm_t ce, cf;
  make(&ce, &e, "mock-e");
  make(&cf, &f, "mock-f");
  nccl_comm_abort_all();
  nccl_comm_abort_all();
  ck_assert_int_eq(e.aborts + f.aborts, 2);
  ck_assert_int_eq(b.aborts + c.aborts + d.aborts, 2); /* c's and d's own, nothing more */
  ck_assert_int_eq(nccl_comm_close(&ce, 1.0), STATUS_OK);
  ck_assert_int_eq(nccl_comm_close(&cf, 1.0), STATUS_OK);
  ck_assert_int_eq(e.destroys + f.destroys, 0);
  ck_assert_int_eq(nccl_comm_poll_errors(), STATUS_OK); /* nothing live */
}
END_TEST

START_TEST(an_async_error_ends_a_device_wait) {
  mock_t a = {.error_after = 0.3}, b = {0};
  nccl_comm_t ca, cb;
  make(&ca, &a, "mock-a (rank 0 of 2 on cuda:0)");
  make(&cb, &b, "mock-b");
  double t = device_clock_seconds();
  fsdpc_status_t st = device_poll(never, NULL, "an endless device wait");
  double took = device_clock_seconds() - t;
  ck_assert_int_eq(st, STATUS_ENCCL);
  ck_assert_msg(strstr(err_detail(),
                       "an endless device wait (device work): NCCL communicator "
                       "mock-a (rank 0 of 2 on cuda:0) failed: mock error 6") != NULL,
                "%s", err_detail());
  ck_assert_msg(took >= 0.3 && took < 5, "ended after %.2f s", took);
  ck_assert(ca.aborted && cb.aborted);
  ck_assert_int_eq(a.aborts + b.aborts, 2);
  ck_assert_int_ne(world_check(), STATUS_OK); /* the job is stopped */
  nccl_comm_close(&ca, 1.0);
  nccl_comm_close(&cb, 1.0);
}
END_TEST

START_TEST(an_async_error_ends_a_host_wait) {
  ck_assert_int_eq(world_size(), 2);
  mock_t a = {.error_after = 0.3};
  nccl_comm_t ca;
  if (world_rank() == 0) make(&ca, &a, "mock-a");
  if (world_rank() == 1) sleep(4); /* joins the agreement late */
  double t = device_clock_seconds();
  fsdpc_status_t st = pg_agree(world_pg(), STATUS_OK);
  double took = device_clock_seconds() - t;
  ck_assert_int_ne(st, STATUS_OK);
  ck_assert_msg(strstr(err_detail(), "NCCL communicator mock-a failed: mock error 6") != NULL,
                "rank %d: %s", world_rank(), err_detail());
  if (world_rank() == 0) {
    ck_assert_msg(took >= 0.3 && took < 3, "rank 0 waited %.2f s", took);
    ck_assert(ca.aborted);
    nccl_comm_close(&ca, 1.0);
  }
}
END_TEST

START_TEST(a_stop_aborts_the_communicators) {
  ck_assert_int_eq(world_size(), 2);
  mock_t a = {0};
  nccl_comm_t ca;
  make(&ca, &a, "mock-a");
  if (world_rank() == 1) {
    world_stop(err_set(STATUS_EINVAL, "rank 1 gives up"));
    ck_assert_str_eq(a.log, "abort"); /* at once, before any wait */
  } else {
    fsdpc_status_t st = device_poll(never, NULL, "an endless device wait");
    ck_assert_int_ne(st, STATUS_OK);
    ck_assert_msg(strstr(err_detail(), "rank 1 gives up") != NULL, "%s", err_detail());
    /* aborted once; the wait may have asked for its state before the stop arrived (a slow
     * rank 1, as under the sanitizers) */
    ck_assert_msg(
        a.aborts == 1 && (strcmp(a.log, "abort") == 0 || strcmp(a.log, "async,abort") == 0),
        "rank 0: %s", a.log);
  }
  ck_assert_int_eq(nccl_comm_close(&ca, 1.0), STATUS_OK);
  ck_assert_int_eq(a.destroys, 0);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("nccl_comms");
  TCase *tc = tcase_create("paths");
  tcase_set_timeout(tc, 60);
  const char *mode = test_argc() > 1 ? test_argv()[1] : "paths";
  if (strcmp(mode, "async") == 0)
    tcase_add_test(tc, an_async_error_ends_a_device_wait);
  else if (strcmp(mode, "async-mpi") == 0)
    tcase_add_test(tc, an_async_error_ends_a_host_wait);
  else if (strcmp(mode, "stop") == 0)
    tcase_add_test(tc, a_stop_aborts_the_communicators);
  else
    tcase_add_test(tc, results_errors_and_closing);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
