/*
 * Argument checks at the top of public functions (private to the library): a NULL handle or
 * pointer is refused with STATUS_EINVAL naming the function and the argument, never crashes.
 * And arrays that grow by doubling.
 *
 *   fsdpc_status_t mesh_group(...)  { ARG_NONNULL(mesh); ARG_NONNULL(out); ... }
 *   int mesh_ndim(const mesh_t *mesh) { if (mesh == NULL) return 0; ... }
 */
#ifndef FSDPC_BASE_ARGS_H
#define FSDPC_BASE_ARGS_H

#include <stddef.h>
#include <stdlib.h>

#include "core/status.h"

#define ARG_NONNULL(p)                                                              \
  do {                                                                              \
    if ((p) == NULL) return err_set(STATUS_EINVAL, "%s: %s is NULL", __func__, #p); \
  } while (0)

/* Room for element n of the array v of cap elements: when full, v doubles (first: its first
 * size); out of memory, the caller returns STATUS_ENOMEM naming what, v and cap unchanged.
 *
 *   ARRAY_GROW(l->v, l->n, l->cap, 16, "plan");
 *   l->v[l->n++] = x;
 */
#define ARRAY_GROW(v, n, cap, first, what)                                             \
  do {                                                                                 \
    if ((n) >= (cap)) {                                                                \
      int nc_ = (cap) ? 2 * (cap) : (first);                                           \
      void *p_ = realloc((v), sizeof *(v) * (size_t)nc_);                              \
      if (p_ == NULL) return err_set(STATUS_ENOMEM, "%s: out of host memory", (what)); \
      (v) = p_;                                                                        \
      (cap) = nc_;                                                                     \
    }                                                                                  \
  } while (0)

#endif
