/*
 * Argument checks at the top of public functions (private to the library): a NULL handle or
 * pointer is refused with STATUS_EINVAL naming the function and the argument, never crashes.
 *
 *   status_t mesh_group(...)  { ARG_NONNULL(mesh); ARG_NONNULL(out); ... }
 *   int mesh_ndim(const mesh_t *mesh) { if (mesh == NULL) return 0; ... }
 */
#ifndef FSDPC_BASE_ARGS_H
#define FSDPC_BASE_ARGS_H

#include <stddef.h>

#include "core/status.h"

#define ARG_NONNULL(p)                                                              \
  do {                                                                              \
    if ((p) == NULL) return err_set(STATUS_EINVAL, "%s: %s is NULL", __func__, #p); \
  } while (0)

#endif
