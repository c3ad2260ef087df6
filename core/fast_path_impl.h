/*
 * The switch, run count and note of an optional faster path (internal to the library):
 * cuBLASLt for matrix products (backends/cuda/cublas_lt.c), cuDNN's fused attention
 * (backends/cuda/cudnn_sdpa.c), fully_shard's one-rank path (fully_shard/fsdp_comm.c). The path is
 * on unless NAME=0 is in the environment or code turned it off; runs counts the calls that took it;
 * the note keeps why the last call that could not, did not. The lock also guards the owner's
 * caches.
 *
 *   static fast_path_t path = FAST_PATH_INIT("FSDPC_X", "kernel_x_set_fast(false)");
 *   pthread_mutex_lock(&path.lock);
 *   const char *off = fast_path_off_locked(&path);
 *   if (off[0]) fast_path_note(&path, "turned off (%s)", off);
 *   else if (run_it() == STATUS_OK) path.runs++;
 *   pthread_mutex_unlock(&path.lock);
 */
#ifndef FSDPC_BASE_FAST_PATH_H
#define FSDPC_BASE_FAST_PATH_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fast_path {
  pthread_mutex_t lock;
  const char *env, *env_off_text; /* NAME and "NAME=0" */
  const char *setter;             /* the call that turns the path off, as messages name it */
  bool enabled;
  int env_off; /* -1 until the environment is read */
  int64_t runs;
  char note[512];
} fast_path_t;

#define FAST_PATH_INIT(name, setter_call)                                        \
  {                                                                              \
    .lock = PTHREAD_MUTEX_INITIALIZER, .env = name, .env_off_text = name "=0",   \
    .setter = setter_call, .enabled = true, .env_off = -1, .runs = 0, .note = "" \
  }

/* With p->lock held: what keeps the path off ("NAME=0" or the setter), "" when nothing does. */
const char *fast_path_off_locked(fast_path_t *p);

/* With p->lock held: keeps why a call did not take the path. */
void fast_path_note(fast_path_t *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* These take p->lock. */
void fast_path_set(fast_path_t *p, bool on);
const char *fast_path_off(fast_path_t *p);
int64_t fast_path_runs(fast_path_t *p);
void fast_path_note_copy(fast_path_t *p, char *buf, size_t size);

#ifdef __cplusplus
}
#endif

#endif
