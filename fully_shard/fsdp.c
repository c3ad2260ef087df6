/* fully_shard: a group's life (creation, teardown), its hooks (the unshard / reshard / reduce
 * state machine of a step), prefetching and control. The root's per-step context is in
 * fsdp_state.c, sharding one parameter in fsdp_param.c, modules called outside their unit in
 * fsdp_on_demand.c, the data path in fsdp_comm.c. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "core/args_impl.h"
#include "fully_shard/fsdp_impl.h"
#include "mesh/world.h"

fsdp_group_t *fsdp_group_of(const nn_module_t *m) {
  if (m == NULL) return NULL;
  return nn_module_ext(m);
}
bool fsdp_is_unsharded(const fsdp_group_t *g) {
  if (g == NULL) return false;
  return g->unsharded;
}
int fsdp_reshard_after_forward(const fsdp_group_t *g) {
  if (g == NULL) return 0;
  return g->reshard_after_forward;
}
int fsdp_shard_size(const fsdp_group_t *g) { return g == NULL ? 0 : g->W; }

int fsdp_num_params(const fsdp_group_t *g) {
  if (g == NULL) return 0;
  return g->n;
}
int64_t fsdp_flat_numel(const fsdp_group_t *g) {
  if (g == NULL) return 0;
  return g->flat;
}
int64_t fsdp_gather_numel(const fsdp_group_t *g) {
  if (g == NULL) return 0;
  return g->block;
}
int64_t fsdp_align_block(int64_t n, dtype_t dt) {
  int64_t a = dtype_size(dt) >= 16 ? 1 : 16 / (int64_t)dtype_size(dt);
  return (n + a - 1) / a * a;
}

/* A reduce block: every trainable parameter's padded rows (sub: its replica chunk's), then a
 * presence element each, rounded up to 16 bytes of the reduce dtype; 0 when none trains. */
static int64_t reduce_block(const fsdp_group_t *g, bool sub) {
  int64_t n = 0;
  for (int i = 0; i < g->n; i++) {
    const fsdp_param_t *fp = &g->params[i];
    if (fp->p->requires_grad) n += (sub ? fp->sub_rows : fp->rows) * fp->row + 1;
  }
  return n == 0 ? 0 : fsdp_align_block(n, g->reduce_dtype);
}

int64_t fsdp_reduce_numel(const fsdp_group_t *g) { return g == NULL ? 0 : reduce_block(g, false); }
pg_t *fsdp_post_forward_group(const fsdp_group_t *g) {
  if (g == NULL) return NULL;
  return g->post_forward;
}
dtype_t fsdp_param_dtype(const fsdp_group_t *g) {
  if (g == NULL) return DTYPE_F32;
  return g->param_dtype;
}

bool fsdp_state_over_replicas(const fsdp_group_t *g) { return g != NULL && g->hfsdp; }
int64_t fsdp_replica_gather_numel(const fsdp_group_t *g) {
  return g != NULL && g->hfsdp ? g->sub_block : 0;
}
int64_t fsdp_replica_reduce_numel(const fsdp_group_t *g) {
  return g == NULL || !g->hfsdp ? 0 : reduce_block(g, true);
}
dtype_t fsdp_shard_dtype(const fsdp_group_t *g) {
  if (g == NULL || g->n == 0) return DTYPE_F32;
  dtype_t dt = g->params[0].padded.dtype;
  for (int i = 1; i < g->n; i++)
    if (g->params[i].padded.dtype != dt) return DTYPE_F32;
  return dt;
}

/* HFSDP: each parameter's slice of the replica buffers (sub_rows padded rows of its len), the
 * gather block they make, and the dtype it travels in. */
static void replica_layout(fsdp_group_t *g) {
  g->own_dtype = fsdp_shard_dtype(g);
  int64_t at = 0;
  for (int i = 0; i < g->n; i++) {
    fsdp_param_t *fp = &g->params[i];
    fp->sub_rows = placement_chunk_size(fp->len, g->R);
    fp->sub_offset = at;
    at += fp->sub_rows * fp->row;
  }
  g->sub_block = fsdp_align_block(at, g->own_dtype);
  g->stale = true; /* the 1/S shards are filled from the masters at the first unshard */
}

/* Why opt->shard_state_over_replicas cannot apply, or STATUS_OK. */
static fsdpc_status_t check_hfsdp(const fsdp_options_t *opt) {
  if (!opt->shard_state_over_replicas) return STATUS_OK;
  if (mesh_ndim(opt->mesh) != 2)
    return err_set(STATUS_EMESH,
                   "fully_shard: shard_state_over_replicas needs a 2-D (replicate, shard) mesh, "
                   "got %d dimension%s",
                   mesh_ndim(opt->mesh), mesh_ndim(opt->mesh) == 1 ? "" : "s");
  if (opt->offload && mesh_device(opt->mesh).type == DEVICE_CUDA)
    return err_set(STATUS_EINVAL,
                   "fully_shard: shard_state_over_replicas does not compose with offload");
  return STATUS_OK;
}

void fsdp_params_changed(nn_module_t *root) {
  if (root == NULL) return;
  fsdp_group_t *g = fsdp_group_of(root);
  if (g != NULL && g->hfsdp) {
    g->stale = true;
    fsdp_reshard(g); /* the gathered tensors (and a kept slice) hold the old values */
  }
  for (int i = 0; i < nn_module_num_children(root); i++)
    fsdp_params_changed(nn_module_child(root, i));
}

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
dtype_t fsdp_reduce_dtype(const fsdp_group_t *g) {
  if (g == NULL) return DTYPE_F32;
  return g->reduce_dtype;
}

static fsdpc_status_t hook(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind, void *user);

/* ranks.view(-1, N): the N consecutive ranks of the shard group holding this one, kept with
 * the shard group (so groups of the same shard group and N share it). Collective over the
 * shard group the first time for each N; every rank makes the same calls. */
static fsdpc_status_t post_forward_group(fsdp_group_t *g, int N) {
  FSDPC_TRY(pg_consecutive(g->shard, N, &g->post_forward));
  pg_retain(g->post_forward);
  return STATUS_OK;
}

static void post_forward_release(fsdp_group_t *g) {
  pg_release(g->post_forward);
  g->post_forward = NULL;
}

static void group_free(fsdp_group_t *g) {
  if (g == NULL) return;
  for (int i = 0; i < g->n_modules; i++) nn_module_remove_hooks(g->modules[i], g);
  for (int i = 0; i < g->n_members; i++) nn_module_remove_hooks(g->members[i].m, &g->members[i]);
  tensor_free(&g->partial);
  tensor_free(&g->post_forward_slice);
  tensor_free(&g->gather);
  fsdp_state_free(&g->state);
  free(g->fwd_prefetch);
  free(g->bwd_prefetch);
  post_forward_release(g);
  event_free(g->copied);
  tensor_free(&g->red_send);
  tensor_free(&g->red_recv);
  tensor_free(&g->grad_buf);
  for (int i = 0; i < g->n; i++) {
    tensor_free(&g->params[i].padded);
    tensor_free(&g->params[i].master);
    if (g->params[i].p != NULL && g->params[i].p->guard_state == &g->params[i])
      g->params[i].p->guard = NULL, g->params[i].p->guard_state = NULL;
  }
  for (int k = 0; k < 2; k++) fsdp_agree_group_release(&g->agree[k]);
  for (int i = 0; i < g->n_members; i++) free(g->members[i].on_demand);
  free(g->members);
  free(g->params);
  free(g->modules);
  free(g->ignored);
  mesh_free(g->param_mesh);
  mesh_free(g->mesh);
  free(g);
}

/* Every live group, by the top module of its model: freeing a module of a sharded model
 * frees the model's groups without walking its tree, parts of which may be freed already
 * (modules without a group freed before one with a group, when no group sits on the top). */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static fsdp_group_t *live_groups;

static nn_module_t *top_of(nn_module_t *m) {
  while (nn_module_parent(m) != NULL) m = nn_module_parent(m);
  return m;
}

static void live_add(fsdp_group_t *g) {
  pthread_mutex_lock(&live_lock);
  g->live_prev = NULL;
  g->live_next = live_groups;
  if (live_groups) live_groups->live_prev = g;
  live_groups = g;
  pthread_mutex_unlock(&live_lock);
}

static void live_remove(fsdp_group_t *g) {
  pthread_mutex_lock(&live_lock);
  if (g->live_prev)
    g->live_prev->live_next = g->live_next;
  else if (live_groups == g)
    live_groups = g->live_next;
  if (g->live_next) g->live_next->live_prev = g->live_prev;
  g->live_prev = g->live_next = NULL;
  pthread_mutex_unlock(&live_lock);
}

/* The group after `after` (NULL: the first) in the registry whose model's top module is top,
 * or NULL. A live group's modules and their parents are allocated, so its top is found now
 * (a module attached to a parent after fully_shard belongs to that parent's model). */
static fsdp_group_t *live_of(const nn_module_t *top, fsdp_group_t *after) {
  pthread_mutex_lock(&live_lock);
  fsdp_group_t *g = after ? after->live_next : live_groups;
  while (g != NULL && top_of(g->modules[0]) != top) g = g->live_next;
  pthread_mutex_unlock(&live_lock);
  return g;
}

static void free_group(fsdp_group_t *g);

/* A module of a sharded model is being freed: every group of the model goes first, before
 * any of its parameters (the groups of one model share the root's per-step state, so they go
 * together), reductions in flight dropped before any group goes. */
static void free_with_model(nn_module_t *m, void *ext) {
  (void)ext;
  nn_module_t *top = top_of(m);
  for (fsdp_group_t *g = live_of(top, NULL); g != NULL; g = live_of(top, g))
    if (g->state.reducing != NULL) fsdp_reduce_drop(g->state.reducing);
  for (fsdp_group_t *g = live_of(top, NULL); g != NULL; g = live_of(top, NULL)) free_group(g);
}

/* The mesh's ranks agree on a new group, this rank's verdict st first: they shard the same
 * parameters (names, global shapes, dtypes), in the same order. A rank that built another
 * model, or called fully_shard on other modules, would otherwise gather other ranks' bytes as
 * its own (or wait for good). Collective over each of the mesh's groups. */
static fsdpc_status_t agree_params(const fsdp_options_t *opt, const fsdp_plist_t *l,
                                   const fsdp_param_t *fps, const nn_module_t *m,
                                   fsdpc_status_t st) {
  /* and on the options that shape the collectives: each rank's own would gather, reduce and
   * reshard other byte counts than the others (a truncated message, or a wait for good) */
  XXH64_state_t *oh = XXH64_createState();
  if (oh == NULL && st == STATUS_OK) st = err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  if (oh != NULL) {
    int64_t o[8] = {opt->reshard_after_forward,
                    opt->param_dtype,
                    opt->reduce_dtype,
                    opt->output_dtype,
                    opt->n_ignored,
                    opt->offload,
                    opt->shard_state_over_replicas,
                    0};
    XXH64_reset(oh, 0);
    XXH64_update(oh, o, sizeof o);
    for (int i = 0; fps != NULL && i < l->n; i++) XXH64_update(oh, &fps[i].dim, sizeof fps[i].dim);
  }
  uint64_t options = oh ? XXH64_digest(oh) : 0;
  XXH64_freeState(oh);
  XXH64_state_t *h = XXH64_createState();
  if (h == NULL && st == STATUS_OK) st = err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  if (h != NULL) XXH64_reset(h, 0);
  for (int i = 0; h != NULL && i < l->n; i++) {
    const dtensor_t *v = l->p[i]->value;
    int64_t nd = dtensor_ndim(v), dt = dtensor_local(v)->dtype;
    XXH64_update(h, l->p[i]->fqn, strlen(l->p[i]->fqn) + 1);
    XXH64_update(h, &nd, sizeof nd);
    XXH64_update(h, dtensor_shape(v), sizeof(int64_t) * (size_t)nd);
    XXH64_update(h, &dt, sizeof dt);
  }
  uint64_t mine = h ? XXH64_digest(h) : 0;
  XXH64_freeState(h);
  char unit[300];
  snprintf(unit, sizeof unit, nn_module_fqn(m)[0] ? "'%s'" : "the root module%s", nn_module_fqn(m));
  /* a failure some rank met alone reaches the whole mesh first (each dimension's groups in
   * turn), then every dimension is compared, and the verdict spreads the same way: no rank
   * returns while another waits in a later dimension's exchange */
  const mesh_t *mesh = opt->mesh;
  for (int k = 0; k < mesh_ndim(mesh); k++) st = pg_agree(mesh_group(mesh, k), st);
  if (st != STATUS_OK) return st;
  int bad_dim = -1, bad_rank = -1;
  bool options_differ = false;
  for (int k = 0; k < mesh_ndim(mesh) && st == STATUS_OK; k++) {
    int a = -1, b = -1;
    st = pg_host_first_differing(mesh_group(mesh, k), mine, &a);
    if (st == STATUS_OK) st = pg_host_first_differing(mesh_group(mesh, k), options, &b);
    if (st == STATUS_OK && bad_dim < 0 && (a >= 0 || b >= 0)) {
      bad_dim = k;
      options_differ = a < 0;
      int c[MESH_MAX_DIMS], at = 0; /* that group rank's world rank */
      for (int d = 0; d < mesh_ndim(mesh); d++)
        c[d] = d == k ? (a >= 0 ? a : b) : mesh_coord(mesh, d);
      for (int d = 0; d < mesh_ndim(mesh); d++) at = at * mesh_size(mesh, d) + c[d];
      bad_rank = mesh_ranks(mesh)[at];
    }
  }
  if (st == STATUS_OK && bad_dim >= 0 && !options_differ)
    st = err_set(STATUS_EINVAL,
                 "fully_shard: %s: the ranks of the mesh's dimension %d shard different "
                 "parameters (rank %d's names, shapes or dtypes differ from the group's first): "
                 "every rank must build the same model and call fully_shard on the same modules, "
                 "in the same order",
                 unit, bad_dim, bad_rank);
  else if (st == STATUS_OK && bad_dim >= 0)
    st = err_set(STATUS_EINVAL,
                 "fully_shard: %s: the ranks of the mesh's dimension %d pass different options "
                 "(rank %d's reshard_after_forward, param_dtype, reduce_dtype, output_dtype, "
                 "offload, shard_state_over_replicas, ignored parameters or shard_dim differ "
                 "from the group's first): every rank must pass the same",
                 unit, bad_dim, bad_rank);
  for (int k = 0; k < mesh_ndim(mesh); k++) st = pg_agree(mesh_group(mesh, k), st);
  return st;
}

/* The options a rank may get wrong alone (its own dtypes, lists, numbers), for a shard group of
 * W ranks. */
static fsdpc_status_t check_options(const fsdp_options_t *opt, int W) {
  const dtype_t dts[3] = {opt->param_dtype, opt->reduce_dtype, opt->output_dtype};
  static const char *const dt_keys[3] = {"param_dtype", "reduce_dtype", "output_dtype"};
  for (int k = 0; k < 3; k++)
    if (dts[k] != DTYPE_COUNT && ((unsigned)dts[k] > DTYPE_COUNT || !dtype_is_float(dts[k])))
      return err_set(STATUS_EINVAL,
                     "fully_shard: %s %d is not a floating-point dtype (or DTYPE_COUNT for the "
                     "default)",
                     dt_keys[k], (int)dts[k]);
  if (opt->n_ignored < 0 || (opt->n_ignored > 0 && opt->ignored == NULL))
    return err_set(STATUS_EINVAL, "fully_shard: %d ignored parameters given without their list",
                   opt->n_ignored);
  for (int i = 0; i < opt->n_ignored; i++)
    if (opt->ignored[i] == NULL)
      return err_set(STATUS_EINVAL, "fully_shard: ignored parameter %d is NULL", i);
  if (!(opt->on_demand_timeout >= 0))
    return err_set(STATUS_EINVAL, "fully_shard: on_demand_timeout %g is not a number of seconds",
                   opt->on_demand_timeout);
  int N = opt->reshard_after_forward;
  if (N != FSDP_RESHARD_AUTO && N != 0 && N != 1 && (N < 2 || N > W || W % N != 0)) {
    if (W < 2)
      return err_set(STATUS_EINVAL,
                     "fully_shard: reshard_after_forward %d is not valid for a shard group of "
                     "1 rank (use true or false)",
                     N);
    return err_set(STATUS_EINVAL,
                   "fully_shard: reshard_after_forward %d is not valid for a shard group of %d "
                   "ranks (use true, false, or an integer N of 2 to %d dividing it: N = %d is "
                   "true, as PyTorch reads it)",
                   N, W, W, W);
  }
  return STATUS_OK;
}

fsdpc_status_t fully_shard(nn_module_t *m, const fsdp_options_t *opt, fsdp_group_t **out) {
  return fully_shard_modules(&m, 1, opt, out);
}

fsdpc_status_t fully_shard_modules(nn_module_t *const *ms, int n_modules, const fsdp_options_t *opt,
                                   fsdp_group_t **out) {
  if (out) *out = NULL;
  if (ms == NULL || n_modules < 1) return err_set(STATUS_EINVAL, "fully_shard: no module given");
  if (n_modules == 1 && ms[0] == NULL) return err_set(STATUS_EINVAL, "fully_shard: m is NULL");
  if (opt == NULL) return err_set(STATUS_EINVAL, "fully_shard: opt is NULL");
  if (opt->mesh == NULL)
    return err_set(STATUS_EINVAL, "fully_shard: opt->mesh is NULL (did mesh_new fail?)");
  for (int i = 0; i < n_modules; i++) {
    if (ms[i] == NULL)
      return n_modules == 1 ? err_set(STATUS_EINVAL, "fully_shard: m is NULL")
                            : err_set(STATUS_EINVAL, "fully_shard_modules: module %d is NULL", i);
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
  for (int i = 1; i < n_modules; i++)
    if (top_of(ms[i]) != top_of(ms[0])) /* a group lives and goes with one model */
      return err_set(STATUS_EINVAL,
                     "fully_shard: module %d ('%s') belongs to another model than module 0 "
                     "('%s'); a group's modules must share one top module",
                     i, nn_module_fqn(ms[i]), nn_module_fqn(ms[0]));
  int W = mesh_size(opt->mesh, md - 1), N = opt->reshard_after_forward;
  fsdp_plist_t l = {0};
  /* a rank whose own options fail these still takes part in the agreement (agree_params):
   * every rank of the mesh fails with it */
  fsdpc_status_t st = check_options(opt, W);
  for (int i = 0; i < n_modules && st == STATUS_OK; i++) st = fsdp_collect_params(ms[i], opt, &l);
  fsdp_group_t *g = NULL;
  if (st == STATUS_OK && (g = calloc(1, sizeof *g)) == NULL)
    st = err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  if (st == STATUS_OK &&
      ((g->params = calloc((size_t)(l.n ? l.n : 1), sizeof(fsdp_param_t))) == NULL ||
       (g->modules = malloc(sizeof(nn_module_t *) * (size_t)n_modules)) == NULL))
    st = err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  for (int i = 0; i < l.n && st == STATUS_OK; i++)
    st = fsdp_check_param(l.p[i], opt, &g->params[i].dim);
  if (st == STATUS_OK) st = check_hfsdp(opt);
  /* a copy of the ignored list (the first forward checks, through it, that no parameter was
   * added since), made before the ranks agree: a rank short of memory stops them all */
  if (st == STATUS_OK && opt->n_ignored > 0 &&
      (g->ignored = malloc(sizeof *g->ignored * (size_t)opt->n_ignored)) == NULL)
    st = err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  if (st == STATUS_OK && opt->n_ignored > 0)
    memcpy(g->ignored, opt->ignored, sizeof *g->ignored * (size_t)opt->n_ignored);
  st = agree_params(opt, &l, g ? g->params : NULL, ms[0], st);
  if (st != STATUS_OK) {
    free(l.p);
    group_free(g);
    return st;
  }
  g->module = ms[0];
  memcpy(g->modules, ms, sizeof(nn_module_t *) * (size_t)n_modules);
  g->n_modules = n_modules;
  g->mesh = mesh_retain(opt->mesh); /* the group may outlive its creator's mesh reference */
  g->opt = *opt;
  g->opt.ignored = g->ignored; /* the group's copy: the caller's may go once this returns */
  g->shard = mesh_group(opt->mesh, md - 1);
  g->replicate = md == 2 ? mesh_group(opt->mesh, 0) : NULL;
  g->W = mesh_size(opt->mesh, md - 1);
  g->rank = mesh_coord(opt->mesh, md - 1);
  g->R = md == 2 ? mesh_size(opt->mesh, 0) : 1;
  g->hfsdp = opt->shard_state_over_replicas && g->R > 1; /* one replica: HSDP's layout */
  g->rrank = md == 2 ? mesh_coord(opt->mesh, 0) : 0;
  if (N >= 2 && N == W) N = 1; /* groups of the whole shard group: resharded fully */
  g->reshard_after_forward = N;
  g->sync = g->all_reduce = g->reshard_after_backward = g->is_last_backward = true;
  g->offload = opt->offload && mesh_device(opt->mesh).type == DEVICE_CUDA;
  /* the offloaded shards, their gradients and the optimizer's state page-locked: their copies
   * run at the bus's speed, the shards' beside the compute */
  if (st == STATUS_OK && g->offload) st = device_pin_host_memory(mesh_device(opt->mesh));
  if (st == STATUS_OK) st = fsdp_streams_of(mesh_device(opt->mesh), &g->streams);
  for (int i = 0; i < l.n && st == STATUS_OK; i++) {
    fsdp_param_t *fp = &g->params[g->n];
    fp->p = l.p[i];
    dtype_t dt = dtensor_local(fp->p->value)->dtype;
    if (g->n == 0) {
      g->param_dtype = opt->param_dtype == DTYPE_COUNT ? dt : opt->param_dtype;
      g->reduce_dtype = opt->reduce_dtype == DTYPE_COUNT ? g->param_dtype : opt->reduce_dtype;
    }
    st = fsdp_shard_param(g, fp);
    if (st == STATUS_OK) {
      fp->offset = g->flat;
      g->flat += fp->rows * fp->row;
      g->n++;
    }
  }
  free(l.p);
  g->block = fsdp_align_block(g->flat, g->param_dtype);
  if (g->hfsdp) replica_layout(g);
  g->agree[0] = g->agree[1] = NULL;
  if (st == STATUS_OK) st = fsdp_agree_group(g->shard, &g->agree[0]);
  if (st == STATUS_OK) st = fsdp_agree_group(g->replicate, &g->agree[1]);
  if (st == STATUS_OK && N >= 2) st = post_forward_group(g, N);
  if (st == STATUS_OK) st = fsdp_install_members(g);
  for (int i = 0; i < n_modules; i++)
    for (int k = 0; k < NN_HOOK_COUNT && st == STATUS_OK; k++)
      st = nn_module_add_hook(ms[i], k, hook, g);
  if (st != STATUS_OK) { /* parameters already sharded stay sharded; the group is dropped */
    group_free(g);
    return st;
  }
  for (int i = 0; i < n_modules; i++) {
    nn_module_set_ext(ms[i], g, free_with_model);
    if (g->n > 0) nn_module_set_cast(ms[i], g->param_dtype, opt->output_dtype); /* boundary */
  }
  live_add(g);
  if (out) *out = g;
  return STATUS_OK;
}

/* A group's modules back to plain ones, then the group freed. */
static void free_group(fsdp_group_t *g) {
  live_remove(g);
  fsdp_reshard(g);
  for (int i = 0; i < g->n_modules; i++) {
    nn_module_set_ext(g->modules[i], NULL, NULL);
    nn_module_set_cast(g->modules[i], DTYPE_COUNT, DTYPE_COUNT);
  }
  group_free(g);
}

static void free_all(nn_module_t *m) {
  fsdp_group_t *g = fsdp_group_of(m);
  if (g != NULL) free_group(g);
  for (int i = 0; i < nn_module_num_children(m); i++) free_all(nn_module_child(m, i));
}

/* Drops reductions still in flight (after a backward that was not the last). */
static void drop_reductions(nn_module_t *m) {
  fsdp_group_t *g = fsdp_group_of(m);
  if (g != NULL && g->state.reducing != NULL) fsdp_reduce_drop(g->state.reducing);
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
  if (root == NULL) return;
  set_control(root, CONTROL_DIVIDE_FACTOR, factor > 0 ? factor : 0);
}

void fsdp_set_requires_gradient_sync(nn_module_t *root, bool sync) {
  if (root == NULL) return;
  set_control(root, CONTROL_SYNC, sync);
}
void fsdp_set_requires_all_reduce(nn_module_t *root, bool all_reduce) {
  if (root == NULL) return;
  set_control(root, CONTROL_ALL_REDUCE, all_reduce);
}
void fsdp_set_reshard_after_backward(nn_module_t *root, bool reshard) {
  if (root == NULL) return;
  set_control(root, CONTROL_RESHARD_AFTER_BACKWARD, reshard);
}
void fsdp_set_is_last_backward(nn_module_t *root, bool last) {
  if (root == NULL) return;
  set_control(root, CONTROL_LAST_BACKWARD, last);
}

/* ---- hooks ---- */

/* The group's modules hold no parameter that neither it, an inner group nor its ignored list
 * claims: one added after fully_shard would be neither sharded nor reduced, each rank's copy
 * drifting from the others' in silence. */
static fsdpc_status_t check_unclaimed(const fsdp_group_t *g) {
  fsdp_plist_t l = {0};
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < g->n_modules && st == STATUS_OK; i++)
    st = fsdp_collect_params(g->modules[i], &g->opt, &l);
  if (st == STATUS_OK && l.n > 0) {
    const nn_param_t *p = l.p[0];
    const char *owner = nn_module_fqn(p->owner);
    st = err_set(STATUS_EINVAL,
                 "fully_shard: parameter '%s%s%s' was added after fully_shard, to a module of the "
                 "unit at '%s': it would be neither sharded nor reduced (add parameters before "
                 "fully_shard, or name it in fsdp_options_t.ignored)",
                 owner && owner[0] ? owner : "", owner && owner[0] ? "." : "", p->name,
                 nn_module_fqn(g->module));
  }
  free(l.p);
  return st;
}

fsdpc_status_t fsdp_lazy_init(fsdp_group_t *g) {
  if (g->initialised) return STATUS_OK;
  FSDPC_TRY(check_unclaimed(g));
  g->initialised = true;
  g->root = g; /* the outermost group above any of this group's modules */
  for (int i = 0; i < g->n_modules; i++)
    for (nn_module_t *a = nn_module_parent(g->modules[i]); a != NULL; a = nn_module_parent(a))
      if (fsdp_group_of(a) != NULL && fsdp_group_of(a) != g) g->root = fsdp_group_of(a);
  g->is_root = g->root == g;
  if (g->reshard_after_forward == FSDP_RESHARD_AUTO) g->reshard_after_forward = !g->is_root;
  return STATUS_OK;
}

/* The groups to prefetch in forward: the explicit list, else next, the group that followed
 * this call in the last iteration's forward order. *n receives their count. */
static fsdp_group_t *const *forward_ahead(fsdp_group_t *g, fsdp_group_t *const *next, int *n) {
  *n = g->fwd_explicit ? g->n_fwd_prefetch : *next != NULL;
  return g->fwd_explicit ? g->fwd_prefetch : next;
}

/* The groups to prefetch in backward: the explicit list, else *next, the call before this one
 * in post-forward order (the next to run backward). */
static fsdp_group_t *const *backward_ahead(fsdp_group_t *g, fsdp_group_t **next, int *n) {
  *next = fsdp_state_pre_backward(&g->root->state, g);
  *n = g->bwd_explicit ? g->n_bwd_prefetch : *next != NULL;
  return g->bwd_explicit ? g->bwd_prefetch : next;
}

/* The group's parameters' write counts summed (nn_param_t.version). */
static uint64_t versions(const fsdp_group_t *g) {
  uint64_t v = 0;
  for (int i = 0; i < g->n; i++) v += g->params[i].p->version;
  return v;
}

static fsdpc_status_t pre_forward(nn_ctx_t *ctx, fsdp_group_t *g) {
  if (nn_ctx_recomputing(ctx)) return fsdp_unshard(g); /* no orders, no prefetch */
  /* every forward but a recomputation (which runs in backward): a checkpointed call's first
   * forward records no tape, yet its backward reads what it used */
  g->fwd_version = versions(g);
  fsdp_group_t *next;
  int n;
  FSDPC_TRY(fsdp_state_pre_forward(&g->root->state, g, &next));
  fsdp_group_t *const *ahead = forward_ahead(g, &next, &n);
  return fsdp_unshard_ahead(g, ahead, n, false);
}

static fsdpc_status_t pre_backward(fsdp_group_t *g) {
  /* a parameter written since the forward (an optimizer step, a copy): the backward would
   * gather the new values, not those the forward used (PyTorch refuses an in-place change) */
  if (versions(g) != g->fwd_version)
    return err_set(STATUS_EINVAL,
                   "fully_shard: a parameter of unit '%s' was written (an optimizer step, a "
                   "copy, a load) between the unit's forward and its backward: the backward "
                   "would use values the forward did not; write parameters between steps",
                   nn_module_fqn(g->module)[0] ? nn_module_fqn(g->module) : "(root)");
  if (g->is_root) fsdp_state_backward_begins(&g->state);
  fsdp_group_t *next;
  int n;
  fsdp_group_t *const *ahead = backward_ahead(g, &next, &n);
  return fsdp_unshard_ahead(g, ahead, n, true);
}

fsdpc_status_t fsdp_after_forward(fsdp_group_t *g) {
  if (!g->unsharded) return STATUS_OK;
  if (g->reshard_after_forward == 1) fsdp_reshard(g);
  if (g->reshard_after_forward >= 2) return fsdp_reshard_to_slice(g);
  return STATUS_OK;
}

/* A call whose backward runs after the root's backward has ended (a call made before the
 * root's forward) finishes the reduction at once: nothing later would. The root's own
 * post-backward runs inside its backward and finishes its reductions itself. */
fsdpc_status_t fsdp_after_backward(fsdp_group_t *g) {
  fsdp_emit(g, "post_backward");
  /* else keep accumulating */
  fsdpc_status_t st = g->sync ? fsdp_reduce_start(g) : fsdp_widen_grads(g);
  if (g->reshard_after_backward) fsdp_reshard(g);
  g->kept = g->unsharded; /* until its next unshard: an update of the shards may drop it */
  if (st == STATUS_OK && !g->root->state.in_backward && g->root->is_last_backward)
    st = fsdp_finish_backward(g->root);
  return st;
}

static fsdpc_status_t post_forward(nn_ctx_t *ctx, fsdp_group_t *g) {
  /* inside a checkpointed call's recomputation the parameters are needed next */
  if (nn_ctx_recomputing(ctx)) return STATUS_OK;
  FSDPC_TRY(fsdp_state_post_forward(&g->root->state, g));
  fsdpc_status_t st = fsdp_after_forward(g);
  /* a forward without gradients (evaluation): no backward comes to drop what it prefetched */
  if (g->is_root && !nn_ctx_recording(ctx)) fsdp_state_drop_prefetches(&g->state);
  return st;
}

/* The hooks' host time and calls so far, by kind (fsdp_hook_time, fsdp_hook_time_of). */
static _Atomic int64_t hook_ns[NN_HOOK_COUNT], hook_calls[NN_HOOK_COUNT];

void fsdp_hook_time_of(nn_hook_kind_t kind, double *seconds, int64_t *calls) {
  bool ok = kind >= 0 && kind < NN_HOOK_COUNT;
  if (seconds != NULL) *seconds = ok ? 1e-9 * (double)atomic_load(&hook_ns[kind]) : 0;
  if (calls != NULL) *calls = ok ? atomic_load(&hook_calls[kind]) : 0;
}

void fsdp_hook_time(double *seconds, int64_t *calls) {
  double s = 0;
  int64_t c = 0;
  for (int k = 0; k < NN_HOOK_COUNT; k++) {
    double sk;
    int64_t ck;
    fsdp_hook_time_of((nn_hook_kind_t)k, &sk, &ck);
    s += sk;
    c += ck;
  }
  if (seconds != NULL) *seconds = s;
  if (calls != NULL) *calls = c;
}

static fsdpc_status_t hook_run(nn_ctx_t *ctx, fsdp_group_t *g, nn_hook_kind_t kind);

static fsdpc_status_t hook(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind, void *user) {
  (void)m;
  double t0 = device_clock_seconds();
  fsdpc_status_t st = hook_run(ctx, user, kind);
  if (kind >= 0 && kind < NN_HOOK_COUNT) {
    atomic_fetch_add(&hook_ns[kind], (int64_t)(1e9 * (device_clock_seconds() - t0)));
    atomic_fetch_add(&hook_calls[kind], 1);
  }
  return st;
}

static fsdpc_status_t hook_run(nn_ctx_t *ctx, fsdp_group_t *g, nn_hook_kind_t kind) {
  FSDPC_TRY(fsdp_lazy_init(g));
  switch (kind) {
    case NN_HOOK_PRE_FORWARD: g->in_forward++; return pre_forward(ctx, g);
    case NN_HOOK_POST_FORWARD: g->in_forward--; return post_forward(ctx, g);
    case NN_HOOK_PRE_BACKWARD: return pre_backward(g);
    case NN_HOOK_POST_BACKWARD: {
      fsdpc_status_t st = fsdp_after_backward(g);
      if (!g->is_root) return st;
      /* end of backward: drop prefetches no backward consumed; on the last backward finish
       * the reductions, otherwise the next backward's first post-backward does */
      fsdp_state_backward_ends(&g->state);
      if (st == STATUS_OK && g->is_last_backward) st = fsdp_finish_backward(g);
      return st;
    }
    default: return STATUS_OK;
  }
}

/* g's prefetch list: groups of g's own model (they go with it), none NULL. */
static fsdpc_status_t set_list(const fsdp_group_t *g, fsdp_group_t ***list, int *n, bool *explicit_,
                               fsdp_group_t *const *gs, int count) {
  if (count < 0 || (count > 0 && gs == NULL))
    return err_set(STATUS_EINVAL, "fully_shard: a prefetch list of %d groups without the list",
                   count);
  for (int i = 0; i < count; i++) {
    if (gs[i] == NULL)
      return err_set(STATUS_EINVAL, "fully_shard: prefetch group %d of %s is NULL", i,
                     fsdp_group_name(g));
    if (top_of(gs[i]->module) != top_of(g->module))
      return err_set(STATUS_EINVAL, "fully_shard: %s cannot prefetch %s, a group of another model",
                     fsdp_group_name(g), fsdp_group_name(gs[i]));
  }
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

fsdpc_status_t fsdp_set_forward_prefetch(fsdp_group_t *g, fsdp_group_t *const *groups, int n) {
  ARG_NONNULL(g);
  return set_list(g, &g->fwd_prefetch, &g->n_fwd_prefetch, &g->fwd_explicit, groups, n);
}

fsdpc_status_t fsdp_set_backward_prefetch(fsdp_group_t *g, fsdp_group_t *const *groups, int n) {
  ARG_NONNULL(g);
  return set_list(g, &g->bwd_prefetch, &g->n_bwd_prefetch, &g->bwd_explicit, groups, n);
}

void fsdp_set_event_hook(nn_module_t *root, fsdp_event_fn fn, void *user) {
  if (root == NULL) return;
  fsdp_group_t *g = fsdp_group_of(root);
  if (g != NULL) {
    g->on_event = fn;
    g->on_event_user = user;
  }
  for (int i = 0; i < nn_module_num_children(root); i++)
    fsdp_set_event_hook(nn_module_child(root, i), fn, user);
}

const char *fsdp_group_name(const fsdp_group_t *g) {
  if (g == NULL) return "(null)";
  return nn_module_fqn(g->module);
}
