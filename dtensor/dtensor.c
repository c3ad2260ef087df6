#include "dtensor/dtensor.h"

#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "dtensor/dtensor_impl.h"
#include "mesh/world.h"

void mesh_shape_coord(const mesh_t *mesh, int *shape, int *coord) {
  for (int i = 0; i < mesh_ndim(mesh); i++) {
    shape[i] = mesh_size(mesh, i);
    if (coord) coord[i] = mesh_coord(mesh, i);
  }
}

fsdpc_status_t dtensor_compute_box(const mesh_t *mesh, const placement_t *pl, int ndim,
                                   const int64_t *global_shape, const int *coord,
                                   int64_t *local_shape, int64_t *offset) {
  ARG_NONNULL(mesh);
  ARG_NONNULL(pl);
  if (ndim > 0) ARG_NONNULL(global_shape);
  ARG_NONNULL(coord);
  if (ndim > 0) ARG_NONNULL(local_shape);
  if (ndim > 0) ARG_NONNULL(offset);
  int shape[MESH_MAX_DIMS];
  mesh_shape_coord(mesh, shape, NULL);
  if (ndim < 0 || ndim > TENSOR_MAX_DIMS)
    return err_set(STATUS_ESHAPE, "DTensor of %d dimensions (at most %d)", ndim, TENSOR_MAX_DIMS);
  FSDPC_TRY(placements_check(ndim, mesh_ndim(mesh), shape, pl));
  for (int i = 0; i < mesh_ndim(mesh); i++)
    if (coord[i] < 0 || coord[i] >= shape[i])
      return err_set(STATUS_EINVAL,
                     "dtensor_compute_box: coord[%d] is %d, outside mesh dimension %d of size %d",
                     i, coord[i], i, shape[i]);
  for (int d = 0; d < ndim; d++)
    if (global_shape[d] < 0)
      return err_set(STATUS_ESHAPE, "dtensor_compute_box: global_shape[%d] is %lld, negative", d,
                     (long long)global_shape[d]);
  placements_local_box(ndim, global_shape, mesh_ndim(mesh), shape, pl, coord, local_shape, offset);
  return STATUS_OK;
}

fsdpc_status_t dtensor_wrap_owned(fsdpc_tensor_t *local, mesh_t *mesh, const placement_t *pl,
                                  int ndim, const int64_t *global_shape, dtensor_t **out) {
  dtensor_t *dt = calloc(1, sizeof *dt);
  if (dt == NULL) return err_set(STATUS_ENOMEM, "DTensor: out of host memory");
  dt->mesh = mesh;
  dt->ndim = ndim;
  if (ndim > 0) memcpy(dt->shape, global_shape, sizeof(int64_t) * (size_t)ndim);
  memcpy(dt->pl, pl, sizeof(placement_t) * (size_t)mesh_ndim(mesh));
  dt->local = *local;
  memset(local, 0, sizeof *local);
  *out = dt;
  return STATUS_OK;
}

static fsdpc_status_t check_device(const fsdpc_tensor_t *t, const mesh_t *mesh, const char *what,
                                   bool host_ok) {
  device_t want = mesh_device(mesh);
  if (host_ok && t->device.type == DEVICE_CPU) return STATUS_OK; /* an offloaded shard */
  if (!device_equal(t->device, want)) {
    char a[16], b[16];
    return err_set(STATUS_EINVAL, "%s: tensor on %s, but the mesh's device is %s", what,
                   device_str(t->device, a, sizeof a), device_str(want, b, sizeof b));
  }
  return STATUS_OK;
}

/* The arguments every constructor takes: out, a tensor, a mesh, placements. */
static fsdpc_status_t check_args(const char *what, void *out, const fsdpc_tensor_t *t,
                                 const mesh_t *mesh, const placement_t *pl) {
  if (out == NULL) return err_set(STATUS_EINVAL, "%s: out is NULL", what);
  if (t == NULL) return err_set(STATUS_EINVAL, "%s: the tensor is NULL", what);
  if (mesh == NULL)
    return err_set(STATUS_EINVAL, "%s: the mesh is NULL (did mesh_new fail?)", what);
  if (pl == NULL) return err_set(STATUS_EINVAL, "%s: the placements are NULL", what);
  if (!t->meta) FSDPC_TRY(tensor_check_memory(what, t)); /* a meta one: deferred init's */
  FSDPC_TRY(placements_check_dtype(mesh_ndim(mesh), pl, t->dtype, what));
  return STATUS_OK;
}

fsdpc_status_t dtensor_from_local(const fsdpc_tensor_t *local, mesh_t *mesh, const placement_t *pl,
                                  int ndim, const int64_t *global_shape, dtensor_t **out) {
  FSDPC_TRY(check_args("dtensor_from_local", out, local, mesh, pl));
  if (global_shape == NULL && ndim > 0)
    return err_set(STATUS_EINVAL, "dtensor_from_local: the shape is NULL");
  *out = NULL;
  int coord[MESH_MAX_DIMS], shape[MESH_MAX_DIMS];
  mesh_shape_coord(mesh, shape, coord);
  int64_t want[TENSOR_MAX_DIMS], offset[TENSOR_MAX_DIMS];
  FSDPC_TRY(dtensor_compute_box(mesh, pl, ndim, global_shape, coord, want, offset));
  FSDPC_TRY(check_device(local, mesh, "dtensor_from_local", true));
  if (local->ndim != ndim || memcmp(local->shape, want, sizeof(int64_t) * (size_t)ndim) != 0) {
    char a[96], b[96], c[96], p[128];
    return err_set(STATUS_ESHAPE,
                   "dtensor_from_local: local shape %s, but placements %s of global shape %s "
                   "give this rank %s",
                   tensor_shape_str(local->ndim, local->shape, a, sizeof a),
                   placements_str(mesh_ndim(mesh), pl, p, sizeof p),
                   tensor_shape_str(ndim, global_shape, b, sizeof b),
                   tensor_shape_str(ndim, want, c, sizeof c));
  }
  fsdpc_tensor_t mine;
  if (tensor_is_contiguous(local))
    FSDPC_TRY(tensor_ref(&mine, local));
  else
    FSDPC_TRY(tensor_clone(&mine, local, local->dtype, local->device));
  fsdpc_status_t st = dtensor_wrap_owned(&mine, mesh, pl, ndim, global_shape, out);
  tensor_free(&mine);
  return st;
}

fsdpc_status_t dtensor_from_local_like(const fsdpc_tensor_t *local, const dtensor_t *like,
                                       dtensor_t **out) {
  if (like == NULL) return err_set(STATUS_EINVAL, "dtensor_from_local_like: like is NULL");
  FSDPC_TRY(check_args("dtensor_from_local_like", out, local, like->mesh, like->pl));
  *out = NULL;
  const fsdpc_tensor_t *v = &like->local;
  if (local->ndim != v->ndim ||
      memcmp(local->shape, v->shape, sizeof(int64_t) * (size_t)v->ndim) != 0 ||
      !tensor_is_contiguous(local) || !device_equal(local->device, v->device)) {
    char a[96], b[96];
    return err_set(STATUS_ESHAPE,
                   "dtensor_from_local_like: local tensor %s, but like's is %s, contiguous, on "
                   "its device",
                   tensor_shape_str(local->ndim, local->shape, a, sizeof a),
                   tensor_shape_str(v->ndim, v->shape, b, sizeof b));
  }
  fsdpc_tensor_t mine;
  FSDPC_TRY(tensor_ref(&mine, local));
  fsdpc_status_t st = dtensor_wrap_owned(&mine, like->mesh, like->pl, like->ndim, like->shape, out);
  tensor_free(&mine);
  return st;
}

fsdpc_status_t local_from_full(const fsdpc_tensor_t *full, const mesh_t *mesh,
                               const placement_t *pl, fsdpc_tensor_t *out) {
  int coord[MESH_MAX_DIMS];
  int64_t shape[TENSOR_MAX_DIMS], offset[TENSOR_MAX_DIMS];
  for (int i = 0; i < mesh_ndim(mesh); i++) coord[i] = mesh_coord(mesh, i);
  FSDPC_TRY(dtensor_compute_box(mesh, pl, full->ndim, full->shape, coord, shape, offset));
  fsdpc_tensor_t box;
  FSDPC_TRY(tensor_narrow_box(&box, full, offset, shape));
  int zero = 0;
  for (int i = 0; i < mesh_ndim(mesh); i++)
    if (pl[i].kind == PLACEMENT_PARTIAL && pl[i].op == REDUCE_SUM && coord[i] != 0) zero = 1;
  fsdpc_status_t st = zero ? tensor_zeros(out, full->dtype, full->device, full->ndim, shape)
                           : tensor_clone(out, &box, full->dtype, full->device);
  tensor_free(&box);
  return st;
}

/* Broadcasts buf from the mesh coordinates `src` to every rank of the mesh, one mesh dimension
 * at a time: along dim k only the ranks whose coordinates after k equal src's take part. */
static fsdpc_status_t broadcast_over_mesh(mesh_t *mesh, const int *src, fsdpc_tensor_t *buf) {
  int n = mesh_ndim(mesh);
  for (int k = 0; k < n; k++) {
    int joins = 1;
    for (int j = k + 1; j < n; j++)
      if (mesh_coord(mesh, j) != src[j]) joins = 0;
    if (joins)
      FSDPC_TRY(pg_broadcast(mesh_group(mesh, k), buf->data, (size_t)tensor_numel(buf), buf->dtype,
                             src[k], NULL));
  }
  return STATUS_OK;
}

fsdpc_status_t dtensor_agree_args(mesh_t *mesh, dtype_t dtype, int ndim, const int64_t *shape,
                                  const placement_t *pl, int src_rank, fsdpc_status_t st,
                                  const char *what) {
  enum { K = 3 + TENSOR_MAX_DIMS + 4 * MESH_MAX_DIMS };
  int64_t v[2 * K + 1] = {0}, got[2 * K + 1];
  v[2 * K] = st != STATUS_OK; /* a rank failed: its error, not the shapes, is the one */
  if (st == STATUS_OK) {
    v[0] = dtype;
    v[1] = ndim;
    v[2] = src_rank;
    for (int d = 0; d < ndim && d < TENSOR_MAX_DIMS; d++) v[3 + d] = shape[d];
    for (int k = 0; k < mesh_ndim(mesh) && k < MESH_MAX_DIMS; k++) {
      int64_t *w = &v[3 + TENSOR_MAX_DIMS + 4 * k];
      bool shard = pl[k].kind == PLACEMENT_SHARD; /* the fields the kind reads */
      w[0] = pl[k].kind;
      w[1] = shard ? pl[k].dim : 0;
      w[2] = pl[k].kind == PLACEMENT_PARTIAL ? pl[k].op : 0;
      w[3] = shard ? pl[k].split_factor : 0;
    }
  }
  for (int i = 0; i < K; i++) v[K + i] = -v[i]; /* the maximum of -x: the minimum */
  fsdpc_status_t cs = STATUS_OK;
  for (int k = 0; k < mesh_ndim(mesh) && cs == STATUS_OK; k++) {
    cs = pg_host_all_reduce(mesh_group(mesh, k), v, got, 2 * K + 1, PG_HOST_I64, REDUCE_MAX);
    memcpy(v, got, sizeof v);
  }
  if (cs != STATUS_OK) return cs;
  bool same = true;
  for (int i = 0; i < K; i++) same = same && v[i] == -v[K + i];
  if (st == STATUS_OK && !same && v[2 * K] == 0)
    st =
        err_set(STATUS_ESHAPE,
                "%s: the ranks pass tensors of different shapes or dtypes, different placements or "
                "different source ranks (every rank passes the same)",
                what);
  if (v[2 * K] == 0) return st; /* every rank knows the verdict: no rank failed its checks */
  for (int k = 0; k < mesh_ndim(mesh); k++) st = pg_agree(mesh_group(mesh, k), st);
  return st;
}

fsdpc_status_t dtensor_distribute(const fsdpc_tensor_t *full, mesh_t *mesh, const placement_t *pl,
                                  int src_rank, dtensor_t **out) {
  if (out == NULL || mesh == NULL) return check_args("dtensor_distribute", out, full, mesh, pl);
  *out = NULL;
  fsdpc_status_t st = check_args("dtensor_distribute", out, full, mesh, pl);
  if (st == STATUS_OK) st = check_device(full, mesh, "dtensor_distribute", false);
  int shape[MESH_MAX_DIMS];
  mesh_shape_coord(mesh, shape, NULL);
  if (st == STATUS_OK) st = placements_check(full->ndim, mesh_ndim(mesh), shape, pl);
  int idx = -1;
  for (int i = 0; src_rank != DTENSOR_ALL_RANKS && i < mesh_numel(mesh); i++)
    if (mesh_ranks(mesh)[i] == src_rank) idx = i;
  if (st == STATUS_OK && src_rank != DTENSOR_ALL_RANKS && idx < 0)
    st = err_set(STATUS_EINVAL, "distribute: source rank %d is not in the mesh", src_rank);
  if (st == STATUS_OK && src_rank == world_rank() && full->meta)
    st = err_set(STATUS_EINVAL,
                 "dtensor_distribute: the source rank's tensor is a meta tensor without memory: "
                 "there is nothing to send (the other ranks' may be; theirs is not read)");
  /* every rank's shape, dtype and placements compared, from every rank holding the data too:
   * a rank passing another shape would compute its shard of another tensor */
  st = dtensor_agree_args(mesh, st == STATUS_OK ? full->dtype : DTYPE_F32,
                          st == STATUS_OK ? full->ndim : 0, st == STATUS_OK ? full->shape : NULL,
                          pl, src_rank, st, "dtensor_distribute");
  FSDPC_TRY(st);
  fsdpc_tensor_t local = {0}, scratch = {0};
  const fsdpc_tensor_t *from = full;
  if (src_rank != DTENSOR_ALL_RANKS) {
    int src[MESH_MAX_DIMS];
    mesh_unravel(mesh, idx, src);
    /* the source's values; the others' buffer only receives them (a meta tensor there too) */
    if (src_rank == world_rank())
      FSDPC_TRY_GOTO(st, tensor_clone(&scratch, full, full->dtype, full->device));
    else
      FSDPC_TRY_GOTO(st, tensor_init(&scratch, full->dtype, full->device, full->ndim, full->shape));
    FSDPC_TRY_GOTO(st, broadcast_over_mesh(mesh, src, &scratch));
    from = &scratch;
  }
  FSDPC_TRY_GOTO(st, local_from_full(from, mesh, pl, &local));
  st = dtensor_wrap_owned(&local, mesh, pl, full->ndim, full->shape, out);
cleanup:
  tensor_free(&local);
  tensor_free(&scratch);
  return st;
}

fsdpc_status_t dtensor_full_tensor(const dtensor_t *dt, fsdpc_tensor_t *out) {
  if (dt == NULL || out == NULL)
    return err_set(STATUS_EINVAL, "dtensor_full_tensor: %s is NULL", dt ? "out" : "the DTensor");
  placement_t rep[MESH_MAX_DIMS];
  for (int i = 0; i < mesh_ndim(dt->mesh); i++) rep[i] = placement_replicate();
  dtensor_t *r;
  FSDPC_TRY(dtensor_redistribute(dt, rep, &r));
  *out = r->local;
  memset(&r->local, 0, sizeof r->local);
  dtensor_free(r);
  return STATUS_OK;
}

void dtensor_free(dtensor_t *dt) {
  if (dt == NULL) return;
  tensor_free(&dt->local);
  free(dt);
}

const fsdpc_tensor_t *dtensor_local(const dtensor_t *dt) { return dt ? &dt->local : NULL; }
mesh_t *dtensor_mesh(const dtensor_t *dt) {
  if (dt == NULL) return NULL;
  return dt->mesh;
}
int dtensor_ndim(const dtensor_t *dt) {
  if (dt == NULL) return 0;
  return dt->ndim;
}
const int64_t *dtensor_shape(const dtensor_t *dt) { return dt ? dt->shape : NULL; }
const placement_t *dtensor_placements(const dtensor_t *dt) { return dt ? dt->pl : NULL; }

void dtensor_offset(const dtensor_t *dt, int64_t *offset) {
  if (dt == NULL || offset == NULL) return;
  int coord[MESH_MAX_DIMS], shape[MESH_MAX_DIMS];
  int64_t local[TENSOR_MAX_DIMS];
  mesh_shape_coord(dt->mesh, shape, coord);
  placements_local_box(dt->ndim, dt->shape, mesh_ndim(dt->mesh), shape, dt->pl, coord, local,
                       offset);
}
