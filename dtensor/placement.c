#include "dtensor/placement.h"

#include <stdio.h>

#include "core/args_impl.h"

bool placement_equal(placement_t a, placement_t b) {
  if (a.kind != b.kind) return false;
  if (a.kind == PLACEMENT_SHARD) return a.dim == b.dim && a.split_factor == b.split_factor;
  if (a.kind == PLACEMENT_PARTIAL) return a.op == b.op;
  return true;
}

const char *placement_str(placement_t p, char *buf, size_t size) {
  if (buf == NULL || size == 0) return "";
  switch (p.kind) {
    case PLACEMENT_REPLICATE: snprintf(buf, size, "R"); break;
    case PLACEMENT_SHARD:
      if (p.split_factor > 1)
        snprintf(buf, size, "SS(%d,%d)", p.dim, p.split_factor);
      else
        snprintf(buf, size, "S(%d)", p.dim);
      break;
    case PLACEMENT_PARTIAL: snprintf(buf, size, "P(%s)", reduce_op_name(p.op)); break;
    default: snprintf(buf, size, "?");
  }
  return buf;
}

const char *placements_str(int n, const placement_t *pl, char *buf, size_t size) {
  if (buf == NULL || size == 0) return "";
  if (pl == NULL) n = 0;
  size_t off = (size_t)snprintf(buf, size, "(");
  for (int i = 0; i < n && off < size; i++) {
    char one[32];
    off += (size_t)snprintf(buf + off, size - off, "%s%s", i ? ", " : "",
                            placement_str(pl[i], one, sizeof one));
  }
  if (off < size) snprintf(buf + off, size - off, ")");
  return buf;
}

int64_t placement_chunk_size(int64_t n, int64_t w) {
  return n <= 0 || w <= 0 ? 0 : n / w + (n % w != 0);
}

void placement_chunk_range(int64_t n, int64_t w, int64_t r, int64_t *offset, int64_t *length) {
  if (offset == NULL || length == NULL) return;
  if (n <= 0 || w <= 0 || r < 0) { /* no chunk */
    *offset = *length = 0;
    return;
  }
  int64_t c = placement_chunk_size(n, w);
  if (r >= w) r = w; /* past the last: the empty chunk at the end */
  int64_t lo = r * c < n ? r * c : n;
  int64_t hi = (r + 1) * c < n ? (r + 1) * c : n;
  *offset = lo;
  *length = hi - lo;
}

fsdpc_status_t placements_check_dtype(int mesh_ndim, const placement_t *pl, dtype_t dt,
                                      const char *what) {
  ARG_NONNULL(pl);
  for (int i = 0; i < mesh_ndim; i++)
    if (pl[i].kind == PLACEMENT_PARTIAL && pl[i].op == REDUCE_AVG && !dtype_is_float(dt))
      return err_set(STATUS_EDTYPE,
                     "%s: Partial(avg) on mesh dimension %d needs a floating-point dtype, got %s "
                     "(an integer average would truncate)",
                     what ? what : "placements", i, dtype_name(dt));
  return STATUS_OK;
}

fsdpc_status_t placements_check(int tensor_ndim, int mesh_ndim, const int *mesh_shape,
                                const placement_t *pl) {
  ARG_NONNULL(mesh_shape);
  ARG_NONNULL(pl);
  char buf[32];
  for (int i = 0; i < mesh_ndim; i++) {
    placement_t p = pl[i];
    switch (p.kind) {
      case PLACEMENT_REPLICATE: break;
      case PLACEMENT_PARTIAL:
        if (p.op != REDUCE_SUM && p.op != REDUCE_AVG && p.op != REDUCE_MAX)
          return err_set(STATUS_EPLACEMENT, "mesh dim %d: invalid partial reduce op %d", i,
                         (int)p.op);
        break;
      case PLACEMENT_SHARD: {
        if (p.dim < 0 || p.dim >= tensor_ndim)
          return err_set(STATUS_EPLACEMENT, "mesh dim %d: %s shards dimension %d of a %d-D tensor",
                         i, placement_str(p, buf, sizeof buf), p.dim, tensor_ndim);
        if (p.split_factor < 1)
          return err_set(STATUS_EPLACEMENT, "mesh dim %d: split factor %d < 1", i, p.split_factor);
        if (p.split_factor > 1) {
          int later = 1;
          for (int j = i + 1; j < mesh_ndim; j++)
            if (pl[j].kind == PLACEMENT_SHARD && pl[j].dim == p.dim) later *= mesh_shape[j];
          if (later != p.split_factor)
            return err_set(STATUS_EPLACEMENT,
                           "mesh dim %d: %s needs a split factor of %d (the later mesh "
                           "dimensions that shard dimension %d)",
                           i, placement_str(p, buf, sizeof buf), later, p.dim);
        }
        break;
      }
      default:
        return err_set(STATUS_EPLACEMENT, "mesh dim %d: invalid placement kind %d", i, (int)p.kind);
    }
  }
  return STATUS_OK;
}

void placements_local_box(int ndim, const int64_t *global_shape, int mesh_ndim,
                          const int *mesh_shape, const placement_t *pl, const int *coord,
                          int64_t *local_shape, int64_t *offset) {
  for (int d = 0; d < ndim; d++) {
    local_shape[d] = global_shape[d];
    offset[d] = 0;
  }
  /* Plain shards first, in mesh order; then strided shards, in reverse mesh order (a strided
   * shard chunks what the later mesh dimensions made). */
  for (int pass = 0; pass < 2; pass++) {
    for (int k = 0; k < mesh_ndim; k++) {
      int i = pass == 0 ? k : mesh_ndim - 1 - k;
      if (pl[i].kind != PLACEMENT_SHARD || (pl[i].split_factor > 1) != pass) continue;
      int d = pl[i].dim;
      int64_t off, len;
      placement_chunk_range(local_shape[d], mesh_shape[i], coord[i], &off, &len);
      offset[d] += off;
      local_shape[d] = len;
    }
  }
}
