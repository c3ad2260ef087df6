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
 * or NULL for a whole parameter. */
static mesh_t *tp_mesh_of(const nn_param_t *p) {
  mesh_t *pm = dtensor_mesh(p->value);
  return mesh_ndim(pm) == 1 && mesh_size(pm, 0) == 1 ? NULL : pm;
}

fsdpc_status_t fsdp_check_param(const nn_param_t *p, const mesh_t *mesh) {
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
  } else if (pl[0].kind != PLACEMENT_REPLICATE) {
    return err_set(STATUS_EINVAL, "fully_shard: parameter %s is already distributed", p->fqn);
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
  return STATUS_OK;
}

/* The mesh and placements of p's sharded DTensor: Shard(0) over the group's shard dimension
 * ((Replicate, Shard(0)) for HSDP); a tensor-parallel parameter lives on (dp..., tp) with its
 * tp placement last, the dp shard strided when tp also shards dimension 0 (dp chunks the tp
 * shard). */
static fsdpc_status_t sharded_layout(fsdp_group_t *g, const nn_param_t *p, mesh_t **mesh,
                                     placement_t *pl) {
  int md = mesh_ndim(g->mesh);
  mesh_t *tp = tp_mesh_of(p);
  for (int i = 0; i < md - 1; i++) pl[i] = placement_replicate();
  pl[md - 1] = placement_shard(0);
  *mesh = g->mesh;
  if (tp == NULL) return STATUS_OK;
  placement_t tpl = dtensor_placements(p->value)[0];
  if (placement_is_shard(tpl, 0)) pl[md - 1] = placement_strided_shard(0, mesh_size(tp, 0));
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

fsdpc_status_t fsdp_shard_param(fsdp_group_t *g, fsdp_param_t *fp) {
  nn_param_t *p = fp->p;
  const fsdpc_tensor_t *full = dtensor_local(p->value);
  int nd = full->ndim;
  fp->n0 = full->shape[0];
  fp->ndim = nd;
  memcpy(fp->shape, full->shape, sizeof(int64_t) * (size_t)nd);
  fp->rows = placement_chunk_size(fp->n0, g->W);
  fp->row = fp->n0 ? tensor_numel(full) / fp->n0 : 0;
  int64_t start, len, shape[TENSOR_MAX_DIMS], global[TENSOR_MAX_DIMS];
  placement_chunk_range(fp->n0, g->W, g->rank, &start, &len);
  memcpy(shape, full->shape, sizeof shape);
  memcpy(global, dtensor_shape(p->value), sizeof(int64_t) * (size_t)nd);
  shape[0] = fp->rows;
  placement_t pl[MESH_MAX_DIMS];
  mesh_t *mesh;
  FSDPC_TRY(sharded_layout(g, p, &mesh, pl));
  device_t dev = g->offload ? device_cpu() : full->device;
  if (tensor_is_meta(full)) /* deferred: memory comes with nn_module_materialize */
    FSDPC_TRY(tensor_meta(&fp->padded, full->dtype, dev, nd, shape));
  else
    FSDPC_TRY(tensor_zeros(&fp->padded, full->dtype, dev, nd, shape));
  fsdpc_tensor_t src = {0}, dst = {0}, local = {0};
  fsdpc_status_t st = STATUS_OK;
  dtensor_t *dt = NULL;
  FSDPC_TRY_GOTO(st, tensor_narrow(&dst, &fp->padded, 0, 0, len));
  if (!tensor_is_meta(full)) {
    FSDPC_TRY_GOTO(st, tensor_narrow(&src, full, 0, start, len));
    FSDPC_TRY_GOTO(st, tensor_copy(&dst, &src));
  }
  FSDPC_TRY_GOTO(st, tensor_ref(&local, &dst));
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
  tensor_free(&dst);
  tensor_free(&local);
  return st;
}

fsdpc_status_t fsdp_materialize_param(nn_param_t *p) {
  fsdp_param_t *fp = p->guard_state;
  if (!tensor_is_meta(&fp->padded)) return STATUS_OK;
  fsdp_group_t *g = fp->g;
  int64_t start, len;
  placement_chunk_range(fp->n0, g->W, g->rank, &start, &len);
  const fsdpc_tensor_t *meta = &fp->padded;
  fsdpc_tensor_t padded = {0}, pad = {0}, local = {0};
  dtensor_t *dt = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, tensor_init(&padded, meta->dtype, meta->device, meta->ndim, meta->shape));
  FSDPC_TRY_GOTO(st, tensor_narrow(&pad, &padded, 0, len, fp->rows - len));
  FSDPC_TRY_GOTO(st, tensor_fill(&pad, 0.0));
  FSDPC_TRY_GOTO(st, tensor_narrow(&local, &padded, 0, 0, len));
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
