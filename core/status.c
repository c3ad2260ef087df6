#include "core/status.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char detail_text[1024];

const char *status_str(fsdpc_status_t st) {
  switch (st) {
#define STATUS_CASE_(name, value, msg) \
  case STATUS_##name: return msg;
    STATUS_TABLE(STATUS_CASE_)
#undef STATUS_CASE_
  }
  return "unknown status";
}

const char *err_detail(void) { return detail_text; }

fsdpc_status_t err_set(fsdpc_status_t st, const char *fmt, ...) {
  if (fmt == NULL) return st; /* nothing to say: the detail text stays */
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail_text, sizeof detail_text, fmt, ap);
  va_end(ap);
  return st;
}

fsdpc_status_t err_prefix(fsdpc_status_t st, const char *fmt, ...) {
  if (fmt == NULL) return st;
  char old[sizeof detail_text];
  memcpy(old, detail_text, sizeof old);
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(detail_text, sizeof detail_text, fmt, ap);
  va_end(ap);
  if (n < 0) n = 0;
  size_t len = (size_t)n < sizeof detail_text ? (size_t)n : sizeof detail_text - 1;
  for (const char *s = ": "; *s && len + 1 < sizeof detail_text; s++) detail_text[len++] = *s;
  for (const char *s = old; *s && len + 1 < sizeof detail_text; s++) detail_text[len++] = *s;
  detail_text[len] = '\0'; /* a prefix and detail too long for the buffer end short */
  return st;
}

void err_clear(void) { detail_text[0] = '\0'; }

#ifndef FSDPC_VERSION
#define FSDPC_VERSION "unknown"
#endif

const char *fsdpc_version(void) { return FSDPC_VERSION; }
