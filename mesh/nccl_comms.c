#include "mesh/nccl_comms_impl.h"

#include <pthread.h>
#include <stdio.h>
#include <time.h>

#include "core/args_impl.h"
#include "core/device.h"

static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static nccl_comm_t *live;

void nccl_comm_track(nccl_comm_t *c) {
  pthread_mutex_lock(&live_lock);
  c->prev = NULL;
  c->next = live;
  if (live) live->prev = c;
  live = c;
  pthread_mutex_unlock(&live_lock);
}

static void untrack(nccl_comm_t *c) {
  pthread_mutex_lock(&live_lock);
  if (c->prev)
    c->prev->next = c->next;
  else if (live == c)
    live = c->next;
  if (c->next) c->next->prev = c->prev;
  c->prev = c->next = NULL;
  pthread_mutex_unlock(&live_lock);
}

static void abort_locked(nccl_comm_t *c) {
  if (c->aborted || c->comm == NULL) return;
  c->t->abort(c->comm);
  c->aborted = true;
}

void nccl_comm_abort(nccl_comm_t *c) {
  if (c == NULL) return;
  pthread_mutex_lock(&live_lock);
  abort_locked(c);
  pthread_mutex_unlock(&live_lock);
}

void nccl_comm_abort_all(void) {
  pthread_mutex_lock(&live_lock);
  for (nccl_comm_t *c = live; c; c = c->next) abort_locked(c);
  pthread_mutex_unlock(&live_lock);
}

/* The state of c's last call: ok, in progress, or the error (of the call or of the ask). */
static int comm_state(const nccl_comm_t *c) {
  int state = NCCL_RESULT_OK, rc = c->t->async_error(c->comm, &state);
  return rc != NCCL_RESULT_OK ? rc : state;
}

typedef struct settle_ctx {
  nccl_comm_t *c;
  const char *what;
  double start, limit_s; /* limit_s 0: no limit of its own */
} settle_ctx_t;

/* device_poll's condition: 1 once c's last call has finished, 0 while it runs, -1 when it
 * failed, c was aborted or the limit passed (*st says which). */
static int settled(void *ctx, fsdpc_status_t *st) {
  settle_ctx_t *s = ctx;
  nccl_comm_t *c = s->c;
  if (c->aborted) {
    *st = err_set(STATUS_ENCCL, "%s: the NCCL communicator %s was aborted", s->what, c->name);
    return -1;
  }
  int state = comm_state(c);
  if (state == NCCL_RESULT_OK) return 1;
  if (state != NCCL_RESULT_IN_PROGRESS) {
    *st = err_set(STATUS_ENCCL, "%s: %s (NCCL communicator %s)", s->what, c->t->error_string(state),
                  c->name);
    return -1;
  }
  if (s->limit_s > 0 && device_clock_seconds() - s->start > s->limit_s) {
    *st = err_set(STATUS_ETIMEOUT, "%s of NCCL communicator %s has not completed in %g s", s->what,
                  c->name, s->limit_s);
    return -1;
  }
  return 0;
}

fsdpc_status_t nccl_comm_settle(nccl_comm_t *c, const char *what) {
  ARG_NONNULL(c);
  settle_ctx_t ctx = {c, what, 0, 0};
  fsdpc_status_t st = device_poll(settled, &ctx, what);
  if (st != STATUS_OK) nccl_comm_abort(c); /* failed, stopped or past the watchdog */
  return st;
}

fsdpc_status_t nccl_comm_result(nccl_comm_t *c, int rc, const char *what) {
  ARG_NONNULL(c);
  if (rc == NCCL_RESULT_OK) return STATUS_OK;
  if (rc == NCCL_RESULT_IN_PROGRESS) return nccl_comm_settle(c, what);
  fsdpc_status_t st =
      err_set(STATUS_ENCCL, "%s: %s (NCCL communicator %s)", what, c->t->error_string(rc), c->name);
  nccl_comm_abort(c);
  return st;
}

static double last_poll;

fsdpc_status_t nccl_comm_poll_errors(void) {
  double t = device_clock_seconds();
  if (t - last_poll < 0.1) return STATUS_OK;
  last_poll = t;
  fsdpc_status_t st = STATUS_OK;
  pthread_mutex_lock(&live_lock);
  for (nccl_comm_t *c = live; c && st == STATUS_OK; c = c->next) {
    if (c->aborted) continue;
    int state = comm_state(c);
    if (state != NCCL_RESULT_OK && state != NCCL_RESULT_IN_PROGRESS)
      st = err_set(STATUS_ENCCL, "NCCL communicator %s failed: %s", c->name,
                   c->t->error_string(state));
  }
  if (st != STATUS_OK)
    for (nccl_comm_t *c = live; c; c = c->next) abort_locked(c);
  pthread_mutex_unlock(&live_lock);
  return st;
}

fsdpc_status_t nccl_comm_close(nccl_comm_t *c, double limit_s) {
  if (c == NULL) return STATUS_OK;
  untrack(c);
  if (c->aborted || c->comm == NULL) return STATUS_OK;
  fsdpc_status_t st = STATUS_OK;
  int rc = c->t->finalize(c->comm);
  if (rc != NCCL_RESULT_OK && rc != NCCL_RESULT_IN_PROGRESS)
    st = err_set(STATUS_ENCCL, "ncclCommFinalize: %s (NCCL communicator %s)",
                 c->t->error_string(rc), c->name);
  settle_ctx_t ctx = {c, "ncclCommFinalize", device_clock_seconds(), limit_s};
  if (st == STATUS_OK) st = device_poll(settled, &ctx, ctx.what); /* under the wait hook too */
  if (st == STATUS_OK) {
    rc = c->t->destroy(c->comm);
    c->comm = NULL;
    /* a non-blocking communicator may answer in progress: it frees itself after a finalize */
    return rc == NCCL_RESULT_OK || rc == NCCL_RESULT_IN_PROGRESS
               ? STATUS_OK
               : err_set(STATUS_ENCCL, "ncclCommDestroy: %s (NCCL communicator %s)",
                         c->t->error_string(rc), c->name);
  }
  nccl_comm_abort(c);
  c->comm = NULL;
  return st;
}
