/* The kernel profile of core/kernels.h (FSDPC_PROFILE): calls, time and bytes per kernel name,
 * filled by the dispatch of core/kernels.c through kernel_prof_begin and kernel_prof_end. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/kernels.h"
#include "core/kernels_impl.h"

/* Per name: calls, seconds and (copies) bytes. On the CPU a call is timed on the wall clock around
 * it; on a backend with timers (CUDA: events on the call's stream) the timer is kept pending
 * and read when the report is made (or when too many are pending). */

enum { PROF_NAMES = 48, PROF_PENDING = 4096 };

static struct {
  pthread_mutex_t lock;
  int on; /* -1: not read from FSDPC_PROFILE yet */
  struct {
    const char *name;
    int64_t calls;
    double seconds, bytes;
  } k[PROF_NAMES];
  int n;
  struct {
    const char *name;
    const kernel_ops_t *ops;
    void *timer;
    double bytes;
  } pending[PROF_PENDING];
  int n_pending;
} prof = {.lock = PTHREAD_MUTEX_INITIALIZER, .on = -1};

bool kernel_profile_enabled(void) {
  if (prof.on < 0) {
    const char *e = getenv("FSDPC_PROFILE");
    prof.on = e != NULL && e[0] != 0 && strcmp(e, "0") != 0;
  }
  return prof.on > 0;
}

void kernel_profile_enable(bool on) { prof.on = on; }

/* Adds a call of seconds moving bytes to name's row (the lock held). */
static void prof_add(const char *name, double seconds, double bytes) {
  int i = 0;
  while (i < prof.n && strcmp(prof.k[i].name, name) != 0) i++;
  if (i == prof.n) {
    if (prof.n == PROF_NAMES) return;
    prof.k[prof.n].name = name;
    prof.k[prof.n].calls = 0;
    prof.k[prof.n].seconds = prof.k[prof.n].bytes = 0;
    prof.n++;
  }
  prof.k[i].calls++;
  prof.k[i].seconds += seconds;
  prof.k[i].bytes += bytes;
}

/* Reads every pending timer (waits for its work; the lock held). */
static fsdpc_status_t prof_settle(void) {
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < prof.n_pending; i++) {
    double s = 0;
    fsdpc_status_t r = prof.pending[i].ops->timer_read(prof.pending[i].timer, &s);
    if (r == STATUS_OK) prof_add(prof.pending[i].name, s, prof.pending[i].bytes);
    if (st == STATUS_OK) st = r;
  }
  prof.n_pending = 0;
  return st;
}

void kernel_prof_begin(kernel_prof_t *c, device_t dev) {
  c->ops = dev.type == DEVICE_CUDA ? cuda_kernels() : cpu_kernels();
  c->timer = c->ops && c->ops->timer_start ? c->ops->timer_start(dev) : NULL;
  c->t0 = device_clock_seconds();
}

fsdpc_status_t kernel_prof_end(kernel_prof_t *c, const char *name, double bytes,
                               fsdpc_status_t st) {
  double t1 = device_clock_seconds();
  pthread_mutex_lock(&prof.lock);
  if (c->timer == NULL) {
    prof_add(name, t1 - c->t0, bytes);
  } else {
    c->ops->timer_stop(c->timer);
    if (prof.n_pending == PROF_PENDING) prof_settle();
    prof.pending[prof.n_pending].name = name;
    prof.pending[prof.n_pending].ops = c->ops;
    prof.pending[prof.n_pending].bytes = bytes;
    prof.pending[prof.n_pending++].timer = c->timer;
  }
  pthread_mutex_unlock(&prof.lock);
  return st;
}

void kernel_profile_reset(void) {
  pthread_mutex_lock(&prof.lock);
  prof_settle();
  prof.n = 0;
  pthread_mutex_unlock(&prof.lock);
}

bool kernel_profile_get(const char *name, kernel_profile_row_t *out) {
  pthread_mutex_lock(&prof.lock);
  prof_settle();
  bool found = false;
  for (int i = 0; i < prof.n && !found; i++)
    if (strcmp(prof.k[i].name, name) == 0) {
      *out = (kernel_profile_row_t){prof.k[i].calls, prof.k[i].seconds, prof.k[i].bytes};
      found = true;
    }
  pthread_mutex_unlock(&prof.lock);
  return found;
}

static int by_time(const void *a, const void *b) {
  double x = ((const double *)a)[0], y = ((const double *)b)[0];
  return x < y ? 1 : x > y ? -1 : 0;
}

fsdpc_status_t kernel_profile_report(FILE *out, double *total_seconds) {
  pthread_mutex_lock(&prof.lock);
  fsdpc_status_t st = prof_settle();
  double rows[PROF_NAMES][2], total = 0; /* seconds, index */
  for (int i = 0; i < prof.n; i++) {
    rows[i][0] = prof.k[i].seconds;
    rows[i][1] = i;
    total += prof.k[i].seconds;
  }
  qsort(rows, (size_t)prof.n, sizeof rows[0], by_time);
  if (out != NULL) {
    fprintf(out, "%-24s %9s %12s %11s %7s %9s\n", "kernel", "calls", "total ms", "ms/call",
            "share", "GB/s");
    for (int r = 0; r < prof.n; r++) {
      int i = (int)rows[r][1];
      char rate[16] = "";
      if (prof.k[i].bytes > 0 && prof.k[i].seconds > 0)
        snprintf(rate, sizeof rate, "%.1f", prof.k[i].bytes / prof.k[i].seconds / 1e9);
      fprintf(out, "%-24s %9lld %12.3f %11.4f %6.1f%%", prof.k[i].name,
              (long long)prof.k[i].calls, 1e3 * prof.k[i].seconds,
              1e3 * prof.k[i].seconds / (double)(prof.k[i].calls ? prof.k[i].calls : 1),
              total > 0 ? 100 * prof.k[i].seconds / total : 0.0);
      fprintf(out, rate[0] ? " %9s\n" : "\n", rate);
    }
    fprintf(out, "%-24s %9s %12.3f\n", "all", "", 1e3 * total);
  }
  if (total_seconds) *total_seconds = total;
  pthread_mutex_unlock(&prof.lock);
  return st;
}
