/*
 * Block checks off the reading thread: while a load reads piece k + 1 into place, a helper
 * thread hashes the blocks of piece k and compares them with the record. A check costs the reading
 * thread a queue push; the wall time of a checked load is that of an unchecked one when the rank
 * has a CPU to spare (dcp_checker_spare_cpu). Without one (a rank bound to one core, or as many
 * ranks on the node as CPUs) the blocks are hashed at once, on the caller, while they are in its
 * caches: a helper would only take turns with the reading threads and hash from farther away.
 */
#include <pthread.h>
#include <stdlib.h>

#include "checkpoint/dcp_integrity_impl.h"
#include "mesh/world.h"

#define QUEUE 16                         /* pieces pushed and not yet hashed, at most */
#define INLINE_BYTES ((size_t)128 << 10) /* smaller pieces: hashed at once, no hand-over */

typedef struct job {
  const char *data;
  size_t bytes, block;
  const uint64_t *expect;
  uint64_t first;
  const void *who;
} job_t;

struct dcp_checker {
  bool threaded;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t work, done; /* work: a job or the stop came; done: a job was finished */
  job_t queue[QUEUE];
  uint64_t head, tail; /* jobs queue[head % QUEUE] .. queue[tail % QUEUE] wait; head: next */
  uint64_t busy;       /* jobs taken and not finished (0 or 1) */
  bool stop;
  bool bad; /* the first block found not to match: */
  const void *bad_who;
  uint64_t bad_block;
};

static uint64_t check(const job_t *j) {
  return dcp_first_bad_block(j->data, j->bytes, j->block, j->expect, j->first);
}

static void record(dcp_checker_t *c, const job_t *j, uint64_t bad) {
  if (bad != UINT64_MAX && !c->bad) {
    c->bad = true;
    c->bad_who = j->who;
    c->bad_block = bad;
  }
}

static void *run(void *arg) {
  dcp_checker_t *c = arg;
  pthread_mutex_lock(&c->mu);
  for (;;) {
    while (c->head == c->tail && !c->stop) pthread_cond_wait(&c->work, &c->mu);
    if (c->head == c->tail) break; /* stopped, nothing left */
    job_t j = c->queue[c->head % QUEUE];
    c->head++;
    c->busy = 1;
    pthread_mutex_unlock(&c->mu);
    uint64_t bad = check(&j);
    pthread_mutex_lock(&c->mu);
    record(c, &j, bad);
    c->busy = 0;
    pthread_cond_broadcast(&c->done);
  }
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

bool dcp_checker_spare_cpu(void) {
  world_cpus_t c = world_cpus();
  if (c.mine < c.online) return c.mine > 1;
  return c.mine > c.local_ranks;
}

fsdpc_status_t dcp_checker_new(dcp_checker_t **out) {
  dcp_checker_t *c = calloc(1, sizeof *c);
  if (c == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  if (dcp_checker_spare_cpu() && pthread_mutex_init(&c->mu, NULL) == 0) {
    if (pthread_cond_init(&c->work, NULL) == 0) {
      if (pthread_cond_init(&c->done, NULL) == 0) {
        if (pthread_create(&c->thread, NULL, run, c) == 0) {
          c->threaded = true;
          *out = c;
          return STATUS_OK;
        }
        pthread_cond_destroy(&c->done);
      }
      pthread_cond_destroy(&c->work);
    }
    pthread_mutex_destroy(&c->mu);
  }
  *out = c; /* no helper: every block hashed by the caller */
  return STATUS_OK;
}

bool dcp_checker_threaded(const dcp_checker_t *c) { return c->threaded; }

void dcp_checker_push(dcp_checker_t *c, const void *data, size_t bytes, size_t block,
                      const uint64_t *expect, uint64_t first, const void *who) {
  job_t j = {data, bytes, block, expect, first, who};
  if (!c->threaded || bytes < INLINE_BYTES) {
    uint64_t bad = check(&j);
    if (c->threaded) pthread_mutex_lock(&c->mu);
    record(c, &j, bad);
    if (c->threaded) pthread_mutex_unlock(&c->mu);
    return;
  }
  pthread_mutex_lock(&c->mu);
  while (c->tail - c->head == QUEUE) pthread_cond_wait(&c->done, &c->mu);
  c->queue[c->tail % QUEUE] = j;
  c->tail++;
  pthread_cond_signal(&c->work);
  pthread_mutex_unlock(&c->mu);
}

bool dcp_checker_wait(dcp_checker_t *c, const void **who, uint64_t *block) {
  if (c->threaded) {
    pthread_mutex_lock(&c->mu);
    while (c->head != c->tail || c->busy) pthread_cond_wait(&c->done, &c->mu);
  }
  bool ok = !c->bad;
  if (!ok) {
    *who = c->bad_who;
    *block = c->bad_block;
  }
  c->bad = false;
  if (c->threaded) pthread_mutex_unlock(&c->mu);
  return ok;
}

void dcp_checker_free(dcp_checker_t *c) {
  if (c == NULL) return;
  if (c->threaded) {
    pthread_mutex_lock(&c->mu);
    c->stop = true;
    pthread_cond_signal(&c->work);
    pthread_mutex_unlock(&c->mu);
    pthread_join(c->thread, NULL);
    pthread_cond_destroy(&c->done);
    pthread_cond_destroy(&c->work);
    pthread_mutex_destroy(&c->mu);
  }
  free(c);
}
