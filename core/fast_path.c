/* The switch, run count and note of an optional faster path (see fast_path.h). */
#include "core/fast_path_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *fast_path_off_locked(fast_path_t *p) {
  if (p->env_off < 0) {
    const char *env = getenv(p->env);
    p->env_off = env != NULL && strcmp(env, "0") == 0;
  }
  if (p->env_off) return p->env_off_text;
  return p->enabled ? "" : p->setter;
}

void fast_path_note(fast_path_t *p, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->note, sizeof p->note, fmt, ap);
  va_end(ap);
}

void fast_path_set(fast_path_t *p, bool on) {
  pthread_mutex_lock(&p->lock);
  p->enabled = on;
  pthread_mutex_unlock(&p->lock);
}

const char *fast_path_off(fast_path_t *p) {
  pthread_mutex_lock(&p->lock);
  const char *off = fast_path_off_locked(p);
  pthread_mutex_unlock(&p->lock);
  return off;
}

int64_t fast_path_runs(fast_path_t *p) {
  pthread_mutex_lock(&p->lock);
  int64_t n = p->runs;
  pthread_mutex_unlock(&p->lock);
  return n;
}

void fast_path_note_copy(fast_path_t *p, char *buf, size_t size) {
  pthread_mutex_lock(&p->lock);
  snprintf(buf, size, "%s", p->note);
  pthread_mutex_unlock(&p->lock);
}
