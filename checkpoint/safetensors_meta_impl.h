/* A safetensors file's __metadata__ ({str: str}) as the reader and the writer keep it
 * (internal to checkpoint/safetensors*.c). */
#ifndef FSDPC_CHECKPOINT_SAFETENSORS_META_H
#define FSDPC_CHECKPOINT_SAFETENSORS_META_H

#include <stdlib.h>
#include <string.h>

typedef struct st_meta {
  char *key, *value; /* owned */
} st_meta_t;

/* The index of key among m[0..n), or -1. */
static inline int st_meta_find(const st_meta_t *m, int n, const char *key) {
  for (int i = 0; i < n; i++)
    if (strcmp(m[i].key, key) == 0) return i;
  return -1;
}

/* Frees the n pairs and the array. */
static inline void st_meta_free(st_meta_t *m, int n) {
  for (int i = 0; i < n; i++) {
    free(m[i].key);
    free(m[i].value);
  }
  free(m);
}

#endif
