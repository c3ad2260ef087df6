/* fully_shard: one parameter's sharded storage, its sharded DTensor and their checks. */
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "fully_shard/fsdp_impl.h"

static bool ignored(const fsdp_options_t *opt, const nn_param_t *p) {
  for (int i = 0; i < opt->n_ignored; i++)
    if (opt->ignored[i] == p) return true;
  return false;
}

fsdpc_status_t fsdp_collect_params(const nn_module_t *m, const fsdp_options_t *opt,
                                   fsdp_plist_t *l) {
  for (int i = 0; i < nn_module_num_params(m); i++) {
    nn_param_t *p = nn_module_param(m, i);
    if (p->external || ignored(opt, p)) continue; /* claimed by an inner call, or ignored */
    bool seen = false;
    for (int j = 0; j < l->n && !seen; j++) seen = l->p[j] == p;
    if (seen) continue;
    ARRAY_GROW(l->p, l->n, l->cap, 16, "fully_shard");
    l->p[l->n++] = p;
  }
  for (int i = 0; i < nn_module_num_children(m); i++)
    FSDPC_TRY(fsdp_collect_params(nn_module_child(m, i), opt, l));
  return STATUS_OK;
}

/* The tensor-parallel mesh p already lives on (1-D, of the same world mesh as the group's),
 * or NULL for a whole parameter: one on a mesh of one rank, whatever its placement (a
 * tensor_parallel over tp 1 gives its colwise weights Shard(0) there). */
static mesh_t *tp_mesh_of(const nn_param_t *p) {
  mesh_t *pm = dtensor_mesh(p->value);
  return mesh_ndim(pm) == 1 && mesh_size(pm, 0) == 1 ? NULL : pm;
}

/* opt->shard_dim's dimension for p, from 0, checked against p's number of dimensions. */
static fsdpc_status_t shard_dim_of(const nn_param_t *p, const fsdp_options_t *opt, int *dim) {
  int nd = dtensor_ndim(p->value), d = opt->shard_dim ? opt->shard_dim(p, opt->shard_dim_user) : 0;
  if (d < -nd || d >= nd)
    return err_set(STATUS_EINVAL,
                   "fully_shard: parameter %s has %d dimension%s; shard dimension %d is out of "
                   "range (from %d to %d)",
                   p->fqn, nd, nd == 1 ? "" : "s", d, -nd, nd - 1);
  *dim = d < 0 ? d + nd : d;
  return STATUS_OK;
}

fsdpc_status_t fsdp_check_param(const nn_param_t *p, const fsdp_options_t *opt, int *dim) {
  const mesh_t *mesh = opt->mesh;
  const dtensor_t *v = p->value;
  const mesh_t *pm = dtensor_mesh(v);
  const placement_t *pl = dtensor_placements(v);
  if (tp_mesh_of(p) != NULL) {
    if (mesh_ndim(pm) != 1 || !mesh_same_root(pm, mesh) || pl[0].kind == PLACEMENT_PARTIAL ||
        mesh_ndim(mesh) + 1 > MESH_MAX_DIMS)
      return err_set(STATUS_EINVAL,
                     "fully_shard: parameter %s is already distributed (only a Shard or "
                     "Replicate DTensor on one tensor-parallel dimension of the same world "
                     "mesh composes with fully_shard)",
                     p->fqn);
  } else if (pl[0].kind == PLACEMENT_PARTIAL) { /* on one rank: a Shard holds it whole */
    return err_set(STATUS_EINVAL,
                   "fully_shard: parameter %s is a Partial DTensor; give it reduced (Replicate)",
                   p->fqn);
  }
  if (dtensor_ndim(v) < 1)
    return err_set(STATUS_ESHAPE,
                   "fully_shard: parameter %s is a scalar; sharding needs at "
                   "least one dimension",
                   p->fqn);
  if (!device_equal(dtensor_local(v)->device, mesh_device(mesh))) {
    char a[16], b[16];
    return err_set(STATUS_EINVAL, "fully_shard: parameter %s is on %s, the mesh on %s", p->fqn,
                   device_str(dtensor_local(v)->device, a, sizeof a),
                   device_str(mesh_device(mesh), b, sizeof b));
  }
  return shard_dim_of(p, opt, dim);
}

/* The mesh and placements of p's sharded DTensor: Shard(d) over the group's shard dimension
 * ((Replicate, Shard(d)) for HSDP); a tensor-parallel parameter lives on (dp..., tp) with its
 * tp placement last, the dp shard strided when tp also shards dimension d (dp chunks the tp
 * shard). */
static fsdpc_status_t sharded_layout(fsdp_group_t *g, const nn_param_t *p, int d, mesh_t **mesh,
                                     placement_t *pl) {
  int md = mesh_ndim(g->mesh);
  mesh_t *tp = tp_mesh_of(p);
  for (int i = 0; i < md - 1; i++) pl[i] = placement_replicate();
  pl[md - 1] = placement_shard(d);
  *mesh = g->mesh;
  /* HFSDP: the replicas chunk each shard (a strided shard over the replicate dimension) */
  if (g->hfsdp) pl[0] = g->W > 1 ? placement_strided_shard(d, g->W) : placement_shard(d);
  if (tp == NULL) return STATUS_OK;
  placement_t tpl = dtensor_placements(p->value)[0];
  if (placement_is_shard(tpl, d)) { /* dp chunks the tp shard (and HFSDP's replicas that) */
    pl[md - 1] = placement_strided_shard(d, mesh_size(tp, 0));
    if (g->hfsdp) pl[0] = placement_strided_shard(d, g->W * mesh_size(tp, 0));
  }
  pl[md] = tpl;
  if (g->param_mesh == NULL) FSDPC_TRY(mesh_concat(g->mesh, tp, &g->param_mesh));
  if (mesh_group(g->param_mesh, md) != mesh_group(tp, 0))
    return err_set(STATUS_EINVAL,
                   "fully_shard: the parameters of one group live on different tensor-parallel "
                   "meshes (%s)",
                   p->fqn);
  *mesh = g->param_mesh;
  return STATUS_OK;
}

/* *out: the first len rows of fp's flat padded storage, viewed in the shard's shape. */
static fsdpc_status_t shard_view(const fsdp_param_t *fp, const fsdpc_tensor_t *padded, int64_t len,
                                 fsdpc_tensor_t *out) {
  int64_t shape[TENSOR_MAX_DIMS];
  memcpy(shape, fp->shape, sizeof shape);
  shape[fp->dim] = len;
  fsdpc_tensor_t head = {0};
  fsdpc_status_t st = tensor_narrow(&head, padded, 0, 0, len * fp->row);
  if (st == STATUS_OK) st = tensor_view(out, &head, fp->ndim, shape);
  tensor_free(&head);
  return st;
}

/* HFSDP: *out, this replica's chunk of the shard's len rows (a view of shard when not NULL),
 * and its range; rows from *start, *n of them. */
static fsdpc_status_t replica_chunk(const fsdp_group_t *g, const fsdp_param_t *fp,
                                    const fsdpc_tensor_t *shard, fsdpc_tensor_t *out,
                                    int64_t *start, int64_t *n) {
  placement_chunk_range(fp->len, g->R, g->rrank, start, n);
  return shard ? tensor_narrow(out, shard, fp->dim, *start, *n) : STATUS_OK;
}

/* HFSDP: a new contiguous master of this replica's rows, their values copied from shard
 * (meta: none). */
static fsdpc_status_t new_master(const fsdp_group_t *g, fsdp_param_t *fp,
                                 const fsdpc_tensor_t *shard) {
  int64_t start, n;
  fsdpc_tensor_t rows = {0};
  FSDPC_TRY(replica_chunk(g, fp, shard, &rows, &start, &n));
  fsdpc_status_t st =
      tensor_is_meta(shard)
          ? tensor_meta(&fp->master, shard->dtype, shard->device, fp->ndim, rows.shape)
          : tensor_init(&fp->master, shard->dtype, shard->device, fp->ndim, rows.shape);
  if (st == STATUS_OK && !tensor_is_meta(shard)) st = tensor_copy(&fp->master, &rows);
  tensor_free(&rows);
  return st;
}

fsdpc_status_t fsdp_shard_param(fsdp_group_t *g, fsdp_param_t *fp) {
  nn_param_t *p = fp->p;
  const fsdpc_tensor_t *full = dtensor_local(p->value);
  int nd = full->ndim, d = fp->dim;
  fp->extent = full->shape[d];
  fp->ndim = nd;
  memcpy(fp->shape, full->shape, sizeof(int64_t) * (size_t)nd);
  fp->rows = placement_chunk_size(fp->extent, g->W);
  fp->row = fp->extent ? tensor_numel(full) / fp->extent : 0;
  int64_t start, len, global[TENSOR_MAX_DIMS], flat = fp->rows * fp->row;
  placement_chunk_range(fp->extent, g->W, g->rank, &start, &len);
  fp->len = len;
  memcpy(global, dtensor_shape(p->value), sizeof(int64_t) * (size_t)nd);
  placement_t pl[MESH_MAX_DIMS];
  mesh_t *mesh;
  FSDPC_TRY(sharded_layout(g, p, d, &mesh, pl));
  device_t dev = g->offload ? device_cpu() : full->device;
  if (tensor_is_meta(full)) /* deferred: memory comes with nn_module_materialize */
    FSDPC_TRY(tensor_meta(&fp->padded, full->dtype, dev, 1, &flat));
  else
    FSDPC_TRY(tensor_zeros(&fp->padded, full->dtype, dev, 1, &flat));
  fsdpc_tensor_t src = {0}, local = {0};
  fsdpc_status_t st = STATUS_OK;
  dtensor_t *dt = NULL;
  FSDPC_TRY_GOTO(st, shard_view(fp, &fp->padded, len, &local));
  if (!tensor_is_meta(full)) {
    FSDPC_TRY_GOTO(st, tensor_narrow(&src, full, d, start, len));
    FSDPC_TRY_GOTO(st, tensor_copy(&local, &src));
  }
  if (g->hfsdp) { /* the DTensor holds the replica's chunk */
    FSDPC_TRY_GOTO(st, new_master(g, fp, &local));
    tensor_free(&local);
    FSDPC_TRY_GOTO(st, tensor_ref(&local, &fp->master));
  }
  FSDPC_TRY_GOTO(st, dtensor_from_local(&local, mesh, pl, nd, global, &dt));
  tensor_free(&p->compute);
  nn_param_zero_grad(p);
  dtensor_free(p->value);
  p->value = dt;
  p->external = true;
  p->guard = &fsdp_on_demand_guard;
  p->guard_state = fp;
  fp->g = g;
cleanup:
  tensor_free(&src);
  tensor_free(&local);
  if (st != STATUS_OK) { /* the group frees only the parameters it counts */
    tensor_free(&fp->padded);
    tensor_free(&fp->master);
  }
  return st;
}

fsdpc_status_t fsdp_materialize_param(nn_param_t *p) {
  fsdp_param_t *fp = p->guard_state;
  if (!tensor_is_meta(&fp->padded)) return STATUS_OK;
  fsdp_group_t *g = fp->g;
  int64_t start, len;
  placement_chunk_range(fp->extent, g->W, g->rank, &start, &len);
  const fsdpc_tensor_t *meta = &fp->padded;
  fsdpc_tensor_t padded = {0}, pad = {0}, local = {0};
  dtensor_t *dt = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, tensor_init(&padded, meta->dtype, meta->device, meta->ndim, meta->shape));
  FSDPC_TRY_GOTO(st, tensor_narrow(&pad, &padded, 0, len * fp->row, (fp->rows - len) * fp->row));
  FSDPC_TRY_GOTO(st, tensor_fill(&pad, 0.0));
  FSDPC_TRY_GOTO(st, shard_view(fp, &padded, len, &local));
  if (g->hfsdp) { /* the shard's rows come from the masters at the first unshard */
    fsdpc_tensor_t master = {0};
    tensor_free(&local);
    FSDPC_TRY_GOTO(st, tensor_init(&master, fp->master.dtype, fp->master.device, fp->master.ndim,
                                   fp->master.shape));
    tensor_free(&fp->master); /* the meta one */
    fp->master = master;
    FSDPC_TRY_GOTO(st, tensor_ref(&local, &fp->master));
    g->stale = true;
  }
  const dtensor_t *v = p->value;
  FSDPC_TRY_GOTO(st, dtensor_from_local(&local, dtensor_mesh(v), dtensor_placements(v),
                                        dtensor_ndim(v), dtensor_shape(v), &dt));
  dtensor_free(p->value);
  p->value = dt;
  tensor_free(&fp->padded);
  fp->padded = padded;
  memset(&padded, 0, sizeof padded);
cleanup:
  tensor_free(&padded);
  tensor_free(&pad);
  tensor_free(&local);
  return st;
}
