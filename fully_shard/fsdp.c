/* fully_shard: sharding parameters into groups, the hooks, prefetching and control. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fully_shard/fsdp_impl.h"
#include "mesh/world.h"

status_t gvec_push(gvec_t *a, fsdp_group_t *g) {
  if (a->n == a->cap) {
    int nc = a->cap ? 2 * a->cap : 16;
    fsdp_group_t **v = realloc(a->v, sizeof(fsdp_group_t *) * (size_t)nc);
    if (v == NULL) return err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
    a->v = v;
    a->cap = nc;
  }
  a->v[a->n++] = g;
  return STATUS_OK;
}

fsdp_group_t *fsdp_group_of(const nn_module_t *m) { return nn_module_ext(m); }
bool fsdp_is_unsharded(const fsdp_group_t *g) { return g->unsharded; }
int fsdp_reshard_after_forward(const fsdp_group_t *g) { return g->reshard_after_forward; }
int fsdp_num_params(const fsdp_group_t *g) { return g->n; }
int64_t fsdp_flat_numel(const fsdp_group_t *g) { return g->flat; }
pg_t *fsdp_post_forward_group(const fsdp_group_t *g) { return g->post_forward; }
dtype_t fsdp_param_dtype(const fsdp_group_t *g) { return g->param_dtype; }

int fsdp_post_forward_groups(fsdp_group_t *const *groups, int n, pg_t **out) {
  int k = 0;
  for (int i = 0; i < n; i++) {
    pg_t *pf = groups[i]->post_forward;
    bool seen = pf == NULL;
    for (int j = 0; j < k && !seen; j++) seen = out[j] == pf;
    if (!seen) out[k++] = pf;
  }
  return k;
}
dtype_t fsdp_reduce_dtype(const fsdp_group_t *g) { return g->reduce_dtype; }

/* ---- sharding ---- */

typedef struct plist {
  nn_param_t **p;
  int n, cap;
} plist_t;

static bool ignored(const fsdp_options_t *opt, const nn_param_t *p) {
  for (int i = 0; i < opt->n_ignored; i++)
    if (opt->ignored[i] == p) return true;
  return false;
}

static status_t collect(const nn_module_t *m, const fsdp_options_t *opt, plist_t *l) {
  for (int i = 0; i < nn_module_num_params(m); i++) {
    nn_param_t *p = nn_module_param(m, i);
    if (p->external || ignored(opt, p)) continue; /* claimed by an inner call, or ignored */
    bool seen = false;
    for (int j = 0; j < l->n && !seen; j++) seen = l->p[j] == p;
    if (seen) continue;
    if (l->n == l->cap) {
      int nc = l->cap ? 2 * l->cap : 16;
      nn_param_t **np = realloc(l->p, sizeof(nn_param_t *) * (size_t)nc);
      if (np == NULL) return err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
      l->p = np;
      l->cap = nc;
    }
    l->p[l->n++] = p;
  }
  for (int i = 0; i < nn_module_num_children(m); i++) TRY(collect(nn_module_child(m, i), opt, l));
  return STATUS_OK;
}

/* The tensor-parallel mesh p already lives on (1-D, of the same world mesh as the group's),
 * or NULL for a whole parameter. */
static mesh_t *tp_mesh_of(const nn_param_t *p) {
  mesh_t *pm = dtensor_mesh(p->value);
  return mesh_ndim(pm) == 1 && mesh_size(pm, 0) == 1 ? NULL : pm;
}

static status_t check_param(const nn_param_t *p, const mesh_t *mesh) {
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
static status_t sharded_layout(fsdp_group_t *g, const nn_param_t *p, mesh_t **mesh,
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
  if (g->param_mesh == NULL) TRY(mesh_concat(g->mesh, tp, &g->param_mesh));
  if (mesh_group(g->param_mesh, md) != mesh_group(tp, 0))
    return err_set(STATUS_EINVAL,
                   "fully_shard: the parameters of one group live on different tensor-parallel "
                   "meshes (%s)",
                   p->fqn);
  *mesh = g->param_mesh;
  return STATUS_OK;
}

static const nn_param_guard_t on_demand_guard;

/* Replaces p's value with its sharded DTensor: dim 0 of its local tensor (the whole
 * parameter, or its tensor-parallel shard) chunked over the group's shard dimension. */
static status_t shard_param(fsdp_group_t *g, fsdp_param_t *fp) {
  nn_param_t *p = fp->p;
  const tensor_t *full = dtensor_local(p->value);
  int nd = full->ndim;
  fp->n0 = full->shape[0];
  fp->ndim = nd;
  memcpy(fp->shape, full->shape, sizeof(int64_t) * (size_t)nd);
  fp->rows = chunk_size(fp->n0, g->W);
  fp->row = fp->n0 ? tensor_numel(full) / fp->n0 : 0;
  int64_t start, len, shape[TENSOR_MAX_DIMS], global[TENSOR_MAX_DIMS];
  chunk_range(fp->n0, g->W, g->rank, &start, &len);
  memcpy(shape, full->shape, sizeof shape);
  memcpy(global, dtensor_shape(p->value), sizeof(int64_t) * (size_t)nd);
  shape[0] = fp->rows;
  placement_t pl[MESH_MAX_DIMS];
  mesh_t *mesh;
  TRY(sharded_layout(g, p, &mesh, pl));
  device_t dev = g->offload ? device_cpu() : full->device;
  if (tensor_is_meta(full)) /* deferred: memory comes with nn_module_materialize */
    TRY(tensor_meta(&fp->padded, full->dtype, dev, nd, shape));
  else
    TRY(tensor_zeros(&fp->padded, full->dtype, dev, nd, shape));
  tensor_t src = {0}, dst = {0}, local = {0};
  status_t st = STATUS_OK;
  dtensor_t *dt = NULL;
  TRY_GOTO(st, tensor_narrow(&dst, &fp->padded, 0, 0, len));
  if (!tensor_is_meta(full)) {
    TRY_GOTO(st, tensor_narrow(&src, full, 0, start, len));
    TRY_GOTO(st, tensor_copy(&dst, &src));
  }
  TRY_GOTO(st, tensor_ref(&local, &dst));
  TRY_GOTO(st, dtensor_from_local(&dt, &local, mesh, pl, nd, global));
  tensor_free(&p->compute);
  nn_param_zero_grad(p);
  dtensor_free(p->value);
  p->value = dt;
  p->external = true;
  p->guard = &on_demand_guard;
  p->guard_state = fp;
  fp->g = g;
cleanup:
  tensor_free(&src);
  tensor_free(&dst);
  tensor_free(&local);
  return st;
}

/* The guard's materialize: the padded shard of a meta parameter gets memory, uninitialised
 * except its padding rows (zero: they travel in the all-gather and the reduce-scatter). */
static status_t materialize_param(nn_param_t *p) {
  fsdp_param_t *fp = p->guard_state;
  if (!tensor_is_meta(&fp->padded)) return STATUS_OK;
  fsdp_group_t *g = fp->g;
  int64_t start, len;
  chunk_range(fp->n0, g->W, g->rank, &start, &len);
  const tensor_t *meta = &fp->padded;
  tensor_t padded = {0}, pad = {0}, local = {0};
  dtensor_t *dt = NULL;
  status_t st = STATUS_OK;
  TRY_GOTO(st, tensor_init(&padded, meta->dtype, meta->device, meta->ndim, meta->shape));
  TRY_GOTO(st, tensor_narrow(&pad, &padded, 0, len, fp->rows - len));
  TRY_GOTO(st, tensor_fill(&pad, 0.0));
  TRY_GOTO(st, tensor_narrow(&local, &padded, 0, 0, len));
  const dtensor_t *v = p->value;
  TRY_GOTO(st, dtensor_from_local(&dt, &local, dtensor_mesh(v), dtensor_placements(v),
                                  dtensor_ndim(v), dtensor_shape(v)));
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

static status_t hook(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind, void *user);
static status_t member_hook(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind, void *user);

/* The modules under m that no inner group claims (m itself excluded), appended to g->members
 * unless counting only. */
static int collect_members(fsdp_group_t *g, nn_module_t *m, bool count_only) {
  int n = 0;
  for (int i = 0; i < nn_module_num_children(m); i++) {
    nn_module_t *c = nn_module_child(m, i);
    if (fsdp_group_of(c) != NULL) continue; /* an inner unit: its own group */
    if (!count_only) g->members[g->n_members++] = (fsdp_member_t){.g = g, .m = c};
    n += 1 + collect_members(g, c, count_only);
  }
  return n;
}

/* The members: the group's own modules, then the others, which get the on-demand hook. */
static status_t install_members(fsdp_group_t *g) {
  size_t n = (size_t)g->n_modules;
  for (int i = 0; i < g->n_modules; i++) n += (size_t)collect_members(g, g->modules[i], true);
  if ((g->members = calloc(n, sizeof *g->members)) == NULL)
    return err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  for (int i = 0; i < g->n_modules; i++)
    g->members[g->n_members++] = (fsdp_member_t){.g = g, .m = g->modules[i]};
  for (int i = 0; i < g->n_modules; i++) collect_members(g, g->modules[i], false);
  for (int i = g->n_modules; i < g->n_members; i++)
    for (int k = 0; k < NN_HOOK_COUNT; k++)
      TRY(nn_module_add_hook(g->members[i].m, k, member_hook, &g->members[i]));
  return STATUS_OK;
}

/* The member for module m, or NULL. */
static fsdp_member_t *find_member(fsdp_group_t *g, const nn_module_t *m) {
  for (int i = 0; i < g->n_members; i++)
    if (g->members[i].m == m) return &g->members[i];
  return NULL;
}

/* The member for module m (the group's first module when m is not one of its members). */
static fsdp_member_t *member_of(fsdp_group_t *g, const nn_module_t *m) {
  fsdp_member_t *mb = find_member(g, m);
  return mb ? mb : &g->members[0];
}

/* Communicators for agreeing on on-demand unshards, one duplicate per process group, shared by
 * the groups that use it and freed with the last. */
typedef struct agree_entry {
  pg_t *pg;
  MPI_Comm comm;
  int users;
  struct agree_entry *next;
} agree_entry_t;
static agree_entry_t *agree_entries;

/* Collective over pg the first time for each pg (every rank makes the same calls). */
static status_t agree_comm(pg_t *pg, MPI_Comm *out) {
  *out = MPI_COMM_NULL;
  if (pg == NULL || pg_size(pg) == 1) return STATUS_OK;
  for (agree_entry_t *e = agree_entries; e != NULL; e = e->next)
    if (e->pg == pg) {
      e->users++;
      *out = e->comm;
      return STATUS_OK;
    }
  agree_entry_t *e = calloc(1, sizeof *e);
  if (e == NULL) return err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  if (MPI_Comm_dup(pg_comm(pg), &e->comm) != MPI_SUCCESS) {
    free(e);
    return err_set(STATUS_EMPI, "fully_shard: MPI_Comm_dup failed");
  }
  MPI_Comm_set_errhandler(e->comm, MPI_ERRORS_RETURN);
  *e = (agree_entry_t){pg, e->comm, 1, agree_entries};
  agree_entries = e;
  *out = e->comm;
  return STATUS_OK;
}

static void agree_comm_release(MPI_Comm *comm) {
  for (agree_entry_t **p = &agree_entries; *p != NULL && *comm != MPI_COMM_NULL; p = &(*p)->next) {
    agree_entry_t *e = *p;
    if (e->comm != *comm) continue;
    if (--e->users == 0) {
      MPI_Comm_free(&e->comm);
      *p = e->next;
      free(e);
    }
    break;
  }
  *comm = MPI_COMM_NULL;
}

/* Post-forward groups of an integer reshard, one per (shard group, N), shared by the groups
 * that use them and released with the last. */
typedef struct pf_entry {
  pg_t *shard, *pf;
  int N, users;
  struct pf_entry *next;
} pf_entry_t;
static pf_entry_t *pf_entries;

/* ranks.view(-1, N): the N consecutive ranks of the shard group holding this one. Collective
 * over the shard group the first time for each (group, N); every rank makes the same calls. */
static status_t post_forward_group(fsdp_group_t *g, int N) {
  for (pf_entry_t *e = pf_entries; e != NULL; e = e->next)
    if (e->shard == g->shard && e->N == N) {
      e->users++;
      g->post_forward = e->pf;
      return STATUS_OK;
    }
  pf_entry_t *e = calloc(1, sizeof *e);
  if (e == NULL) return err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  MPI_Comm sub;
  if (MPI_Comm_split(pg_comm(g->shard), g->rank / N, g->rank % N, &sub) != MPI_SUCCESS) {
    free(e);
    return err_set(STATUS_EMPI, "fully_shard: MPI_Comm_split failed");
  }
  device_t dev = mesh_device(g->mesh);
  status_t st =
      dev.type == DEVICE_CUDA ? pg_new_nccl(sub, dev.index, &e->pf) : pg_new_mpi(sub, &e->pf);
  MPI_Comm_free(&sub);
  if (st != STATUS_OK) {
    free(e);
    return st;
  }
  *e = (pf_entry_t){g->shard, e->pf, N, 1, pf_entries};
  pf_entries = e;
  g->post_forward = e->pf;
  return STATUS_OK;
}

static void post_forward_release(fsdp_group_t *g) {
  for (pf_entry_t **p = &pf_entries; *p != NULL; p = &(*p)->next) {
    pf_entry_t *e = *p;
    if (e->pf != g->post_forward) continue;
    if (--e->users == 0) {
      pg_release(e->pf);
      *p = e->next;
      free(e);
    }
    break;
  }
  g->post_forward = NULL;
}

static void group_free(fsdp_group_t *g) {
  if (g == NULL) return;
  tensor_free(&g->partial);
  tensor_free(&g->post_forward_slice);
  tensor_free(&g->gather);
  free(g->fwd_order.v);
  free(g->prev_fwd_order.v);
  free(g->bwd_order.v);
  free(g->fwd_prefetch);
  free(g->bwd_prefetch);
  post_forward_release(g);
  event_free(g->copied);
  tensor_free(&g->red_send);
  tensor_free(&g->red_recv);
  for (int i = 0; i < g->n; i++) {
    tensor_free(&g->params[i].padded);
    if (g->params[i].p != NULL && g->params[i].p->guard_state == &g->params[i])
      g->params[i].p->guard = NULL, g->params[i].p->guard_state = NULL;
  }
  for (int k = 0; k < 2; k++) agree_comm_release(&g->agree[k]);
  for (int i = 0; i < g->n_members; i++) free(g->members[i].on_demand);
  free(g->members);
  free(g->params);
  free(g->modules);
  mesh_free(g->param_mesh);
  free(g);
}

status_t fully_shard(nn_module_t *m, const fsdp_options_t *opt, fsdp_group_t **out) {
  return fully_shard_modules(&m, 1, opt, out);
}

status_t fully_shard_modules(nn_module_t *const *ms, int n_modules, const fsdp_options_t *opt,
                             fsdp_group_t **out) {
  if (out) *out = NULL;
  if (ms == NULL || n_modules < 1 || opt == NULL || opt->mesh == NULL)
    return err_set(STATUS_EINVAL, "fully_shard: modules, options and mesh are required");
  for (int i = 0; i < n_modules; i++) {
    if (ms[i] == NULL) return err_set(STATUS_EINVAL, "fully_shard: module %d is NULL", i);
    if (fsdp_group_of(ms[i]) != NULL)
      return err_set(STATUS_EINVAL, "fully_shard: module '%s' is already fully sharded",
                     nn_module_fqn(ms[i]));
  }
  int md = mesh_ndim(opt->mesh);
  if (md != 1 && md != 2)
    return err_set(STATUS_EMESH,
                   "fully_shard: the mesh must be 1-D (shard) or 2-D "
                   "(replicate, shard), got %d dimensions",
                   md);
  int W = mesh_size(opt->mesh, md - 1), N = opt->reshard_after_forward;
  if (N != FSDP_RESHARD_AUTO && N != 0 && N != 1 && (N < 2 || N >= W || W % N != 0))
    return err_set(STATUS_EINVAL,
                   "fully_shard: reshard_after_forward %d is not valid for a shard group of %d "
                   "ranks (use true, false, or an integer N with 1 < N < %d dividing %d)",
                   N, W, W, W);
  plist_t l = {0};
  status_t st = STATUS_OK;
  for (int i = 0; i < n_modules && st == STATUS_OK; i++) st = collect(ms[i], opt, &l);
  for (int i = 0; i < l.n && st == STATUS_OK; i++) st = check_param(l.p[i], opt->mesh);
  fsdp_group_t *g = NULL;
  if (st == STATUS_OK && (g = calloc(1, sizeof *g)) == NULL)
    st = err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  if (st == STATUS_OK &&
      ((g->params = calloc((size_t)(l.n ? l.n : 1), sizeof(fsdp_param_t))) == NULL ||
       (g->modules = malloc(sizeof(nn_module_t *) * (size_t)n_modules)) == NULL))
    st = err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  if (st != STATUS_OK) {
    free(l.p);
    group_free(g);
    return st;
  }
  g->module = ms[0];
  memcpy(g->modules, ms, sizeof(nn_module_t *) * (size_t)n_modules);
  g->n_modules = n_modules;
  g->mesh = opt->mesh;
  g->opt = *opt;
  g->shard = mesh_group(opt->mesh, md - 1);
  g->replicate = md == 2 ? mesh_group(opt->mesh, 0) : NULL;
  g->W = mesh_size(opt->mesh, md - 1);
  g->rank = mesh_coord(opt->mesh, md - 1);
  g->reshard_after_forward = opt->reshard_after_forward;
  g->sync = g->all_reduce = g->reshard_after_backward = g->is_last_backward = true;
  g->offload = opt->offload && mesh_device(opt->mesh).type == DEVICE_CUDA;
  st = fsdp_streams_of(mesh_device(opt->mesh), &g->streams);
  for (int i = 0; i < l.n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[g->n];
    fp->p = l.p[i];
    dtype_t dt = dtensor_local(fp->p->value)->dtype;
    if (g->n == 0) {
      g->param_dtype = opt->param_dtype == DTYPE_COUNT ? dt : opt->param_dtype;
      g->reduce_dtype = opt->reduce_dtype == DTYPE_COUNT ? g->param_dtype : opt->reduce_dtype;
    }
    st = shard_param(g, fp);
    if (st == STATUS_OK) {
      fp->offset = g->flat;
      g->flat += fp->rows * fp->row;
      g->n++;
    }
  }
  free(l.p);
  g->agree[0] = g->agree[1] = MPI_COMM_NULL;
  if (st == STATUS_OK) st = agree_comm(g->shard, &g->agree[0]);
  if (st == STATUS_OK) st = agree_comm(g->replicate, &g->agree[1]);
  if (st == STATUS_OK && N >= 2) st = post_forward_group(g, N);
  if (st == STATUS_OK) st = install_members(g);
  for (int i = 0; i < n_modules; i++)
    for (int k = 0; k < NN_HOOK_COUNT && st == STATUS_OK; k++)
      st = nn_module_add_hook(ms[i], k, hook, g);
  if (st != STATUS_OK) { /* parameters already sharded stay sharded; the group is dropped */
    group_free(g);
    return st;
  }
  for (int i = 0; i < n_modules; i++) {
    nn_module_set_ext(ms[i], g);
    if (g->n > 0) nn_module_set_cast(ms[i], g->param_dtype, opt->output_dtype); /* boundary */
  }
  if (out) *out = g;
  return STATUS_OK;
}

static void free_all(nn_module_t *m) {
  fsdp_group_t *g = fsdp_group_of(m);
  if (g != NULL) {
    fsdp_reshard(g);
    for (int i = 0; i < g->n_modules; i++) {
      nn_module_set_ext(g->modules[i], NULL);
      nn_module_set_cast(g->modules[i], DTYPE_COUNT, DTYPE_COUNT);
    }
    group_free(g);
  }
  for (int i = 0; i < nn_module_num_children(m); i++) free_all(nn_module_child(m, i));
}

/* Drops reductions still in flight (after a backward that was not the last). */
static void drop_reductions(nn_module_t *m) {
  fsdp_group_t *g = fsdp_group_of(m);
  if (g != NULL && g->reducing != NULL) fsdp_reduce_drop(g->reducing);
  for (int i = 0; i < nn_module_num_children(m); i++) drop_reductions(nn_module_child(m, i));
}

void fsdp_free_all(nn_module_t *root) {
  if (root == NULL) return;
  drop_reductions(root);
  free_all(root);
}

typedef enum control {
  CONTROL_SYNC,
  CONTROL_ALL_REDUCE,
  CONTROL_RESHARD_AFTER_BACKWARD,
  CONTROL_DIVIDE_FACTOR,
  CONTROL_LAST_BACKWARD
} control_t;

static void set_control(nn_module_t *m, control_t what, double value) {
  fsdp_group_t *g = fsdp_group_of(m);
  if (g != NULL) {
    if (what == CONTROL_SYNC) g->sync = value != 0;
    if (what == CONTROL_ALL_REDUCE) g->all_reduce = value != 0;
    if (what == CONTROL_RESHARD_AFTER_BACKWARD) g->reshard_after_backward = value != 0;
    if (what == CONTROL_DIVIDE_FACTOR) g->divide_factor = value;
    if (what == CONTROL_LAST_BACKWARD) g->is_last_backward = value != 0;
  }
  for (int i = 0; i < nn_module_num_children(m); i++)
    set_control(nn_module_child(m, i), what, value);
}

void fsdp_set_gradient_divide_factor(nn_module_t *root, double factor) {
  set_control(root, CONTROL_DIVIDE_FACTOR, factor > 0 ? factor : 0);
}

void fsdp_set_requires_gradient_sync(nn_module_t *root, bool sync) {
  set_control(root, CONTROL_SYNC, sync);
}
void fsdp_set_requires_all_reduce(nn_module_t *root, bool all_reduce) {
  set_control(root, CONTROL_ALL_REDUCE, all_reduce);
}
void fsdp_set_reshard_after_backward(nn_module_t *root, bool reshard) {
  set_control(root, CONTROL_RESHARD_AFTER_BACKWARD, reshard);
}
void fsdp_set_is_last_backward(nn_module_t *root, bool last) {
  set_control(root, CONTROL_LAST_BACKWARD, last);
}

/* ---- hooks ---- */

static void lazy_init(fsdp_group_t *g) {
  if (g->initialised) return;
  g->initialised = true;
  g->root = g; /* the outermost group above any of this group's modules */
  for (int i = 0; i < g->n_modules; i++)
    for (nn_module_t *a = nn_module_parent(g->modules[i]); a != NULL; a = nn_module_parent(a))
      if (fsdp_group_of(a) != NULL && fsdp_group_of(a) != g) g->root = fsdp_group_of(a);
  g->is_root = g->root == g;
  if (g->reshard_after_forward == FSDP_RESHARD_AUTO) g->reshard_after_forward = !g->is_root;
}

/* The group to prefetch in forward: explicit list, else the group that followed this call
 * in the last iteration's forward order. */
static status_t forward_prefetch(fsdp_group_t *g) {
  if (g->fwd_explicit) {
    for (int i = 0; i < g->n_fwd_prefetch; i++) TRY(fsdp_unshard_start(g->fwd_prefetch[i]));
    return STATUS_OK;
  }
  const gvec_t *prev = &g->root->prev_fwd_order;
  int pos = g->root->fwd_order.n - 1;
  if (pos + 1 < prev->n && prev->v[pos] == g) return fsdp_unshard_start(prev->v[pos + 1]);
  return STATUS_OK;
}

/* The group to prefetch in backward: explicit list, else the call before this one in
 * post-forward order (the next to run backward). */
static status_t backward_prefetch(fsdp_group_t *g) {
  fsdp_group_t *root = g->root;
  int i = root->bwd_pos - 1;
  while (i >= 0 && root->bwd_order.v[i] != g) i--;
  if (i >= 0) root->bwd_pos = i;
  if (g->bwd_explicit) {
    for (int k = 0; k < g->n_bwd_prefetch; k++) TRY(fsdp_unshard_start(g->bwd_prefetch[k]));
    return STATUS_OK;
  }
  if (i > 0) return fsdp_unshard_start(root->bwd_order.v[i - 1]);
  return STATUS_OK;
}

static status_t pre_forward(nn_ctx_t *ctx, fsdp_group_t *g) {
  if (nn_ctx_recomputing(ctx)) return fsdp_unshard(g); /* no orders, no prefetch */
  fsdp_group_t *root = g->root;
  if (g->is_root) { /* a new iteration: the forward order just recorded becomes the last one */
    gvec_t t = root->prev_fwd_order;
    root->prev_fwd_order = root->fwd_order;
    root->fwd_order = t;
    root->fwd_order.n = 0;
    root->bwd_order.n = 0;
  }
  TRY(gvec_push(&root->fwd_order, g));
  TRY(fsdp_unshard(g));
  return forward_prefetch(g);
}

/* After a call's forward: free the unsharded parameters as reshard_after_forward says. */
static status_t reshard_after_forward(fsdp_group_t *g) {
  if (!g->unsharded) return STATUS_OK;
  if (g->reshard_after_forward == 1) fsdp_reshard(g);
  if (g->reshard_after_forward >= 2) return fsdp_reshard_to_slice(g);
  return STATUS_OK;
}

/* After a call's backward: reduce the gradients it produced (unless accumulating without
 * sync) and reshard. A call whose backward runs after the root's backward has ended (a call
 * made before the root's forward) finishes the reduction at once: nothing later would. The
 * root's own post-backward runs inside its backward and finishes its reductions itself. */
static status_t reduce_after_backward(fsdp_group_t *g) {
  fsdp_emit(g, "post_backward");
  status_t st = g->sync ? fsdp_reduce_start(g) : STATUS_OK; /* else keep accumulating */
  if (g->reshard_after_backward) fsdp_reshard(g);
  if (st == STATUS_OK && !g->root->in_backward && g->root->is_last_backward)
    st = fsdp_finish_backward(g->root);
  return st;
}

static status_t post_forward(nn_ctx_t *ctx, fsdp_group_t *g) {
  /* inside a checkpointed call's recomputation the parameters are needed next */
  if (nn_ctx_recomputing(ctx)) return STATUS_OK;
  TRY(gvec_push(&g->root->bwd_order, g));
  return reshard_after_forward(g);
}

static status_t hook(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind, void *user) {
  (void)m;
  fsdp_group_t *g = user;
  lazy_init(g);
  switch (kind) {
    case NN_HOOK_PRE_FORWARD: g->in_forward++; return pre_forward(ctx, g);
    case NN_HOOK_POST_FORWARD: g->in_forward--; return post_forward(ctx, g);
    case NN_HOOK_PRE_BACKWARD:
      if (g->is_root) {
        g->bwd_pos = g->bwd_order.n;
        g->in_backward = true;
      }
      TRY(fsdp_unshard(g));
      return backward_prefetch(g);
    case NN_HOOK_POST_BACKWARD: {
      status_t st = reduce_after_backward(g);
      if (!g->is_root) return st;
      g->in_backward = false;
      /* end of backward: drop prefetches no backward consumed; on the last backward finish
       * the reductions, otherwise the next backward's first post-backward does */
      for (int i = 0; i < g->fwd_order.n; i++)
        if (g->fwd_order.v[i]->gathering) fsdp_reshard(g->fwd_order.v[i]);
      if (st == STATUS_OK && g->is_last_backward) st = fsdp_finish_backward(g);
      return st;
    }
    default: return STATUS_OK;
  }
}

/* ---- modules called outside their unit's forward ---- */

static status_t push_call(fsdp_member_t *mb, bool on_demand) {
  if (mb->depth == mb->cap) {
    int nc = mb->cap ? 2 * mb->cap : 4;
    bool *p = realloc(mb->on_demand, sizeof(bool) * (size_t)nc);
    if (p == NULL) return err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
    mb->on_demand = p;
    mb->cap = nc;
  }
  mb->on_demand[mb->depth++] = on_demand;
  return STATUS_OK;
}

static const char *unit_name(const fsdp_group_t *g) {
  const char *u = nn_module_fqn(g->module);
  return u[0] ? u : "(root)";
}

/* What ran on demand: the member's module (its call), or an operation on one of its
 * parameters. */
static void describe(const fsdp_member_t *mb, const char *op, const nn_param_t *p, char *buf,
                     size_t size) {
  const char *name = nn_module_fqn(mb->m);
  if (p == NULL)
    snprintf(buf, size, "%s", name[0] ? name : "(root)");
  else
    snprintf(buf, size, "%s on parameter %s of module %s", op, p->fqn, name[0] ? name : "(root)");
}

/* The first on-demand use of a member's module, once per module and rank: what ran, its unit
 * and the call path. */
static void warn_on_demand(nn_ctx_t *ctx, fsdp_member_t *mb, const char *what, bool call) {
  if ((call && mb->registered) || mb->warned) return;
  mb->warned = true;
  char path[1024];
  nn_ctx_call_path(ctx, path, sizeof path);
  fprintf(stderr,
          "fsdpc: warning: [rank %d] fully_shard: %s ran outside the forward of its unit '%s' "
          "(call path: %s); the unit's parameters were all-gathered on demand, without "
          "prefetch. Call the unit instead, or %s.\n",
          world_rank(), what, unit_name(mb->g), path,
          call ? "make the module an entry point with fsdp_register_forward_method"
               : "run the code using the parameter as a call of its module with nn_call_with");
}

/* A 63-bit FNV-1a hash of a module's name. */
static int64_t name_hash(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return (int64_t)(h >> 1);
}

/* An agreement's buffer whose collective never completed (the job was stopped: one at most),
 * kept reachable because MPI may still own it (volatile: a store the compiler cannot drop). */
static int64_t *volatile orphan;

/* Every rank of the group takes the on-demand path of a member together (what: its
 * description): an all-reduce of the module's name over the shard and the replicate ranks. A
 * rank whose partners do not join in time stops the job, naming it. */
static status_t agree_on_demand(const fsdp_member_t *mb, const char *what) {
  TRY(world_check());
  fsdp_group_t *g = mb->g;
  int64_t h = name_hash(nn_module_fqn(mb->m));
  for (int k = 0; k < 2; k++) {
    if (g->agree[k] == MPI_COMM_NULL) continue;
    int64_t *buf = malloc(4 * sizeof *buf);
    if (buf == NULL) return err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
    buf[0] = h;
    buf[1] = -h;
    MPI_Request req;
    status_t st = STATUS_OK;
    if (MPI_Iallreduce(buf, buf + 2, 2, MPI_INT64_T, MPI_MAX, g->agree[k], &req) != MPI_SUCCESS)
      st = err_set(STATUS_EMPI, "fully_shard: MPI_Iallreduce (on-demand agreement) failed");
    bool late = false;
    if (st == STATUS_OK)
      st = world_wait_for(&req, g->opt.on_demand_timeout, "MPI_Iallreduce (on-demand agreement)",
                          &late);
    if (st == STATUS_OK && late) {
      orphan = buf;
      return world_stop(err_set(
          STATUS_ETIMEOUT,
          "fully_shard: %s ran outside the forward of its unit '%s' on rank %d, and the other "
          "ranks of the unit's %s group did not take that on-demand unshard within %g s; it is "
          "collective: make the same call on every rank, or call the unit",
          what, unit_name(g), world_rank(), k ? "replicate" : "shard", g->opt.on_demand_timeout));
    }
    if (st != STATUS_OK) { /* failed to start (buf is free), or the job was stopped meanwhile */
      if (world_check() == STATUS_OK)
        free(buf);
      else
        orphan = buf;
      return st;
    }
    bool same = buf[2] == h && buf[3] == -h;
    free(buf);
    if (!same)
      return err_set(STATUS_EINVAL,
                     "fully_shard: the ranks of unit '%s' took different on-demand unshards "
                     "(%s on rank %d, another module on another rank); every rank must make "
                     "the same calls",
                     unit_name(g), what, world_rank());
  }
  return STATUS_OK;
}

/* A member's call is on demand when none of its group's own modules is in its forward: the
 * call then unshards the group, reshards after forward by the group's policy, and in backward
 * unshards again and reduces its gradients, as a call of the unit would. */
static status_t member_hook(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind, void *user) {
  (void)m;
  fsdp_member_t *mb = user;
  fsdp_group_t *g = mb->g;
  lazy_init(g);
  bool recomputing = nn_ctx_recomputing(ctx), rec = nn_ctx_recording(ctx) && !recomputing;
  switch (kind) {
    case NN_HOOK_PRE_FORWARD: {
      bool od = g->in_forward == 0; /* nested calls inside an on-demand call count as inside */
      if (!od) {
        if (rec) TRY(push_call(mb, false));
        return STATUS_OK;
      }
      /* the recomputation of an activation-checkpointed call in backward (whether or not the
       * call was on demand): the group's operations inside it are provided for, as in forward */
      if (!recomputing) {
        if (rec) TRY(push_call(mb, true));
        char what[512];
        describe(mb, NULL, NULL, what, sizeof what);
        TRY(agree_on_demand(mb, what));
        warn_on_demand(ctx, mb, what, true);
      }
      mb->active = true;
      g->in_forward++;
      return fsdp_unshard(g);
    }
    case NN_HOOK_POST_FORWARD:
      if (!mb->active) return STATUS_OK;
      mb->active = false;
      g->in_forward--;
      /* a recomputation's backward comes next: keep the parameters */
      return recomputing ? STATUS_OK : reshard_after_forward(g);
    case NN_HOOK_PRE_BACKWARD:
      if (mb->depth > 0 && mb->on_demand[mb->depth - 1]) return fsdp_unshard(g);
      return STATUS_OK;
    case NN_HOOK_POST_BACKWARD: {
      if (mb->depth == 0 || !mb->on_demand[--mb->depth]) return STATUS_OK;
      return reduce_after_backward(g);
    }
    default: return STATUS_OK;
  }
}

/* Operations on a sharded parameter while no call of its group runs: the operation is an
 * on-demand call of the module owning the parameter (nn_param_begin). */
static fsdp_group_t *group_of_param(const nn_param_t *p) {
  return ((const fsdp_param_t *)p->guard_state)->g;
}

static bool guard_ready(const nn_param_t *p) { return group_of_param(p)->in_forward > 0; }

static status_t guard_enter(nn_ctx_t *ctx, nn_param_t *p, const char *op) {
  fsdp_group_t *g = group_of_param(p);
  lazy_init(g);
  if (!nn_ctx_recomputing(ctx)) {
    fsdp_member_t *mb = member_of(g, p->owner);
    char what[512];
    describe(mb, op, p, what, sizeof what);
    TRY(agree_on_demand(mb, what));
    warn_on_demand(ctx, mb, what, false);
  }
  return fsdp_unshard(g);
}

static status_t guard_leave(nn_ctx_t *ctx, nn_param_t *p) {
  (void)ctx;
  return reshard_after_forward(group_of_param(p));
}

static status_t guard_pre_backward(nn_ctx_t *ctx, nn_param_t *p) {
  (void)ctx;
  return fsdp_unshard(group_of_param(p));
}

static status_t guard_post_backward(nn_ctx_t *ctx, nn_param_t *p) {
  (void)ctx;
  return reduce_after_backward(group_of_param(p));
}

static const nn_param_guard_t on_demand_guard = {
    .ready = guard_ready,
    .enter = guard_enter,
    .leave = guard_leave,
    .pre_backward = guard_pre_backward,
    .post_backward = guard_post_backward,
    .materialize = materialize_param,
};

status_t fsdp_register_forward_method(nn_module_t *m) {
  if (fsdp_group_of(m) != NULL) return STATUS_OK; /* a unit's own calls are regular */
  for (nn_module_t *a = nn_module_parent(m); a != NULL; a = nn_module_parent(a)) {
    fsdp_group_t *g = fsdp_group_of(a);
    fsdp_member_t *mb = g ? find_member(g, m) : NULL;
    if (mb != NULL) {
      mb->registered = true;
      return STATUS_OK;
    }
  }
  return err_set(STATUS_EINVAL,
                 "fsdp_register_forward_method: '%s' is not inside a fully-sharded unit",
                 nn_module_fqn(m));
}

static status_t set_list(fsdp_group_t ***list, int *n, bool *explicit_, fsdp_group_t *const *gs,
                         int count) {
  fsdp_group_t **v = NULL;
  if (count > 0 && (v = malloc(sizeof(fsdp_group_t *) * (size_t)count)) == NULL)
    return err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  for (int i = 0; i < count; i++) v[i] = gs[i];
  free(*list);
  *list = v;
  *n = count;
  *explicit_ = true;
  return STATUS_OK;
}

status_t fsdp_set_forward_prefetch(fsdp_group_t *g, fsdp_group_t *const *groups, int n) {
  return set_list(&g->fwd_prefetch, &g->n_fwd_prefetch, &g->fwd_explicit, groups, n);
}

status_t fsdp_set_backward_prefetch(fsdp_group_t *g, fsdp_group_t *const *groups, int n) {
  return set_list(&g->bwd_prefetch, &g->n_bwd_prefetch, &g->bwd_explicit, groups, n);
}

void fsdp_set_event_hook(nn_module_t *root, fsdp_event_fn fn, void *user) {
  fsdp_group_t *g = fsdp_group_of(root);
  if (g != NULL) {
    g->on_event = fn;
    g->on_event_user = user;
  }
  for (int i = 0; i < nn_module_num_children(root); i++)
    fsdp_set_event_hook(nn_module_child(root, i), fn, user);
}

const char *fsdp_group_name(const fsdp_group_t *g) { return nn_module_fqn(g->module); }
