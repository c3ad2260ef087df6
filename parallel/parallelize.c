#include "parallel/parallelize.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "nn/moe.h"

struct parallel {
  nn_module_t *root;
  mesh_t *mesh, *dp_mesh, *tp_mesh, *all, *pp_mesh;
  nn_module_t *const *owned; /* pipeline parallelism: the modules of this rank's stages */
  int n_owned;
  mesh_t *ep_mesh, *ep_fsdp_mesh; /* mesh.ep > 1: the experts' split, and their fully_shard */
  tp_plan_t *tp;
  fsdp_group_t **groups;
  int n_groups, cap_groups;
  int dp_rank, dp_size;
};

mesh_t *parallel_mesh(const parallel_t *par) {
  if (par == NULL) return NULL;
  return par->mesh;
}
mesh_t *parallel_dp_mesh(const parallel_t *par) {
  if (par == NULL) return NULL;
  return par->dp_mesh;
}
mesh_t *parallel_tp_mesh(const parallel_t *par) {
  if (par == NULL) return NULL;
  return par->tp_mesh;
}
mesh_t *parallel_expert_mesh(const parallel_t *par) {
  if (par == NULL) return NULL;
  return par->ep_fsdp_mesh;
}
mesh_t *parallel_pp_mesh(const parallel_t *par) {
  if (par == NULL) return NULL;
  return par->pp_mesh;
}
bool parallel_holds(const parallel_t *par, const nn_module_t *m) {
  if (par == NULL || m == NULL) return false;
  if (par->owned == NULL) return true;
  for (; m != NULL; m = nn_module_parent(m))
    for (int i = 0; i < par->n_owned; i++)
      if (par->owned[i] == m) return true;
  return false;
}
mesh_t *parallel_ep_mesh(const parallel_t *par) {
  if (par == NULL) return NULL;
  return par->ep_mesh;
}
pg_t *parallel_all_group(const parallel_t *par) {
  if (par == NULL) return NULL;
  return mesh_group(par->all, 0);
}
int parallel_dp_rank(const parallel_t *par) {
  if (par == NULL) return 0;
  return par->dp_rank;
}
int parallel_dp_size(const parallel_t *par) {
  if (par == NULL) return 0;
  return par->dp_size;
}
int parallel_num_groups(const parallel_t *par) {
  if (par == NULL) return 0;
  return par->n_groups;
}
fsdp_group_t *const *parallel_groups(const parallel_t *par) {
  if (par == NULL) return NULL;
  return par->groups;
}
const tp_plan_t *parallel_tp(const parallel_t *par) {
  if (par == NULL) return NULL;
  return par->tp;
}

/* ---- meshes ---- */

/* mesh.ep > 1: the world as ((dp_replicate,) dp_shard / ep, ep(, tp)): the dense units
 * fully shard over dp_shard / ep and ep flattened ("dp_shard"), the experts over dp_shard /
 * ep (with tp, flattened with tp: "dp_shard_ep_tp"), split over "ep". When ep borrows tp (it
 * does not divide dp_shard), ((dp_replicate,) dp_shard / (ep / tp), ep / tp ("ep_dp"), tp):
 * the experts split over ep_dp and tp flattened ("ep"), fully sharded over dp_shard_ep. A
 * pipeline's "pp" comes first, the rest within each stage. */
static fsdpc_status_t make_ep_meshes(parallel_t *par, const parallel_plan_t *pp,
                                     device_type_t dev) {
  bool borrow = parallel_plan_ep_borrows_tp(pp);
  int shape[MESH_MAX_DIMS], n = 0, epd = borrow ? pp->ep / pp->tp : pp->ep;
  const char *names[MESH_MAX_DIMS], *ep_name = borrow ? "ep_dp" : "ep";
  if (pp->pp > 1) { /* outermost: each stage's ranks together */
    shape[n] = pp->pp;
    names[n++] = "pp";
  }
  if (pp->dp_replicate > 1) {
    shape[n] = pp->dp_replicate;
    names[n++] = "dp_replicate";
  }
  shape[n] = pp->dp_shard / epd;
  names[n++] = "dp_shard_ep";
  shape[n] = epd;
  names[n++] = ep_name;
  if (pp->tp > 1) {
    shape[n] = pp->tp;
    names[n++] = "tp";
  }
  FSDPC_TRY(mesh_new(n, shape, names, dev, &par->mesh));
  FSDPC_TRY(mesh_flatten(par->mesh, n, names, "all", &par->all));
  const char *dense[] = {"dp_shard_ep", ep_name}, *expert[] = {"dp_shard_ep", "tp"},
             *split[] = {ep_name, "tp"};
  mesh_t *shard = NULL, *eshard = NULL, *rep = NULL;
  fsdpc_status_t st = mesh_flatten(par->mesh, 2, dense, "dp_shard", &shard);
  if (st == STATUS_OK)
    st = pp->tp > 1 && !borrow ? mesh_flatten(par->mesh, 2, expert, "dp_shard_ep_tp", &eshard)
                               : mesh_slice(par->mesh, 1, expert, &eshard);
  if (st == STATUS_OK && pp->dp_replicate > 1)
    st = mesh_slice(par->mesh, 1, (const char *[]){"dp_replicate"}, &rep);
  if (st == STATUS_OK && pp->pp > 1)
    st = mesh_slice(par->mesh, 1, (const char *[]){"pp"}, &par->pp_mesh);
  if (st == STATUS_OK && rep != NULL) {
    st = mesh_concat(rep, shard, &par->dp_mesh);
    if (st == STATUS_OK) st = mesh_concat(rep, eshard, &par->ep_fsdp_mesh);
  } else if (st == STATUS_OK) {
    par->dp_mesh = mesh_retain(shard);
    par->ep_fsdp_mesh = mesh_retain(eshard);
  }
  if (st == STATUS_OK)
    st = borrow ? mesh_flatten(par->mesh, 2, split, "ep", &par->ep_mesh)
                : mesh_slice(par->mesh, 1, split, &par->ep_mesh);
  if (st == STATUS_OK && pp->tp > 1)
    st = mesh_slice(par->mesh, 1, (const char *[]){"tp"}, &par->tp_mesh);
  mesh_free(rep);
  mesh_free(shard);
  mesh_free(eshard);
  FSDPC_TRY(st);
  int nd = mesh_ndim(par->dp_mesh);
  par->dp_size = pp->dp_replicate * pp->dp_shard;
  par->dp_rank = nd == 2 ? mesh_coord(par->dp_mesh, 0) * pp->dp_shard + mesh_coord(par->dp_mesh, 1)
                         : mesh_coord(par->dp_mesh, 0);
  return STATUS_OK;
}

static fsdpc_status_t make_meshes(parallel_t *par, const parallel_plan_t *pp, device_type_t dev) {
  if (pp->ep > 1) return make_ep_meshes(par, pp, dev);
  int shape[4], n = 0;
  const char *names[4];
  if (pp->pp > 1) { /* outermost: each stage's ranks together */
    shape[n] = pp->pp;
    names[n++] = "pp";
  }
  if (pp->dp_replicate > 1) {
    shape[n] = pp->dp_replicate;
    names[n++] = "dp_replicate";
  }
  shape[n] = pp->dp_shard;
  names[n++] = "dp_shard";
  if (pp->tp > 1) {
    shape[n] = pp->tp;
    names[n++] = "tp";
  }
  FSDPC_TRY(mesh_new(n, shape, names, dev, &par->mesh));
  FSDPC_TRY(mesh_flatten(par->mesh, n, names, "all", &par->all));
  int nd = pp->dp_replicate > 1 ? 2 : 1, first = pp->pp > 1;
  FSDPC_TRY(mesh_slice(par->mesh, nd, names + first, &par->dp_mesh));
  if (pp->pp > 1) FSDPC_TRY(mesh_slice(par->mesh, 1, names, &par->pp_mesh));
  if (pp->tp > 1) FSDPC_TRY(mesh_slice(par->mesh, 1, (const char *[]){"tp"}, &par->tp_mesh));
  par->dp_size = pp->dp_replicate * pp->dp_shard;
  par->dp_rank = nd == 2 ? mesh_coord(par->dp_mesh, 0) * pp->dp_shard + mesh_coord(par->dp_mesh, 1)
                         : mesh_coord(par->dp_mesh, 0);
  return STATUS_OK;
}

/* ---- tensor parallelism ---- */

static int count_matches(const nn_module_t *root, const nn_module_t *mod, const char *pattern);

static fsdpc_status_t apply_tp(parallel_t *par, const parallel_plan_t *pp) {
  if (pp->tp <= 1) return STATUS_OK;
  tp_rule_t rules[PLAN_MAX_TP_RULES];
  int n = parallel_plan_tp_rules(pp, rules);
  for (int i = 0; i < n; i++) /* a rule for no module named at its own line */
    if (count_matches(par->root, par->root, rules[i].pattern) == 0) {
      char names[256];
      const char *w =
          pp->tp_rules[i].where.text[0] ? pp->tp_rules[i].where.text : pp->tp_where.text;
      return err_set(STATUS_EINVAL,
                     "%s: parallelize.tensor_parallel.plan: '%s' matches no module (modules "
                     "here: %s, ...)",
                     w, rules[i].pattern, nn_module_names(par->root, 6, names, sizeof names));
    }
  fsdpc_status_t st =
      tensor_parallel(par->root, par->tp_mesh, rules, n, pp->sequence_parallel, &par->tp);
  if (st != STATUS_OK) /* name the rules' place in the file and the tree's modules */
    return err_prefix(st, "%s: parallelize.tensor_parallel.plan", pp->tp_where.text);
  return STATUS_OK;
}

/* ---- expert parallelism ---- */

/* Every MoE block under m split over the ep mesh; *blocks counts them. */
static fsdpc_status_t split_experts(parallel_t *par, nn_module_t *m, int *blocks) {
  const char *kind = nn_module_kind(m);
  if (kind != NULL && strcmp(kind, "moe") == 0) {
    FSDPC_TRY(nn_moe_expert_parallel(m, par->ep_mesh, 0));
    (*blocks)++;
  }
  for (int i = 0; i < nn_module_num_children(m); i++)
    FSDPC_TRY(split_experts(par, nn_module_child(m, i), blocks));
  return STATUS_OK;
}

static fsdpc_status_t apply_ep(parallel_t *par, const parallel_plan_t *pp) {
  if (pp->ep <= 1) return STATUS_OK;
  int blocks = 0;
  fsdpc_status_t st = split_experts(par, par->root, &blocks);
  if (st != STATUS_OK) return err_prefix(st, "%s: mesh.ep", pp->ep_where.text);
  if (blocks == 0)
    return err_set(STATUS_EINVAL, "%s: mesh.ep: %d, but the model has no MoE block to split",
                   pp->ep_where.text, pp->ep);
  return STATUS_OK;
}

static bool is_experts(const nn_module_t *m) {
  const char *kind = nn_module_kind(m);
  return kind != NULL && strcmp(kind, "experts") == 0;
}

/* ---- fully_shard ---- */

static fsdpc_status_t push_group(parallel_t *par, fsdp_group_t *g) {
  ARRAY_GROW(par->groups, par->n_groups, par->cap_groups, 16, "parallelize");
  par->groups[par->n_groups++] = g;
  return STATUS_OK;
}

/* fully_shard's shard_dim: the plan's shard_dims (checked by check_shard_dims; a dimension
 * out of range stays one for fully_shard to refuse). */
static int plan_shard_dim(const nn_param_t *p, void *pp) {
  int d = parallel_plan_shard_dim(pp, p->fqn, dtensor_ndim(p->value));
  return d < 0 ? INT_MIN : d;
}

/* Whether m is mod or under it. */
static bool within(const nn_module_t *m, const nn_module_t *mod) {
  for (const nn_module_t *up = m; up != NULL; up = nn_module_parent(up))
    if (up == mod) return true;
  return false;
}

/* Whether a module of mod's subtree has parameter p (its own, or one it shares). */
static bool holds_param(const nn_module_t *mod, const nn_param_t *p) {
  for (int i = 0; i < nn_module_num_params(mod); i++)
    if (nn_module_param(mod, i) == p) return true;
  for (int i = 0; i < nn_module_num_children(mod); i++)
    if (holds_param(nn_module_child(mod, i), p)) return true;
  return false;
}

/* Whether m (outside mod's subtree) uses a parameter of mod's subtree (owned there, or shared
 * with it: a tied head's weight is the token embedding's). */
static bool uses_param_of(const nn_module_t *m, const nn_module_t *mod) {
  if (within(m, mod)) return false;
  for (int i = 0; i < nn_module_num_params(m); i++)
    if (holds_param(mod, nn_module_param(m, i))) return true;
  return false;
}

#define PARALLEL_MAX_SHARERS 4

/* The modules under m, outside mod, that use a parameter of mod's and are in no unit yet, into
 * with[*n] on (at most max in all). */
static void add_sharers(nn_module_t *m, const nn_module_t *mod, nn_module_t **with, int *n,
                        int max) {
  if (m == mod || *n >= max) return;
  if (uses_param_of(m, mod) && fsdp_group_of(m) == NULL) with[(*n)++] = m;
  for (int i = 0; i < nn_module_num_children(m); i++)
    add_sharers(nn_module_child(m, i), mod, with, n, max);
}

static fsdpc_status_t shard_unit(parallel_t *par, const parallel_plan_t *pp, nn_module_t *mod,
                                 const plan_unit_t *u) {
  fsdp_options_t o = FSDP_OPTIONS_INIT;
  bool experts = par->ep_fsdp_mesh != NULL && is_experts(mod);
  if (pp->n_shard_dims > 0) {
    o.shard_dim = plan_shard_dim;
    o.shard_dim_user = (void *)pp;
  }
  o.mesh = experts ? par->ep_fsdp_mesh : par->dp_mesh;
  o.offload = pp->offload;
  o.shard_state_over_replicas = pp->state_over_replicas && pp->dp_replicate > 1;
  o.reshard_after_forward = u ? u->reshard_after_forward : FSDP_RESHARD_AUTO;
  o.param_dtype = u ? u->param_dtype : pp->param_dtype;
  o.reduce_dtype = u ? u->reduce_dtype : pp->reduce_dtype;
  o.output_dtype = u ? u->output_dtype : pp->output_dtype;
  fsdp_group_t *g;
  bool own_dtypes =
      u && (u->param_dtype != pp->param_dtype || u->reduce_dtype != pp->reduce_dtype ||
            u->output_dtype != pp->output_dtype);
  /* the modules that use a parameter of mod's (a tied head, which shares the token
   * embedding's weight) join its unit: their forwards are the unit's, not on-demand gathers;
   * under a pipeline, the stage's */
  nn_module_t *with[1 + PARALLEL_MAX_SHARERS];
  int n_with = 0;
  with[n_with++] = mod;
  for (int i = 0; i < par->n_owned && n_with < 1 + PARALLEL_MAX_SHARERS; i++)
    if (uses_param_of(par->owned[i], mod) && fsdp_group_of(par->owned[i]) == NULL)
      with[n_with++] = par->owned[i];
  if (par->owned == NULL) add_sharers(par->root, mod, with, &n_with, 1 + PARALLEL_MAX_SHARERS);
  if (n_with > 1)
    FSDPC_TRY(fully_shard_modules(with, n_with, &o, &g));
  else
    FSDPC_TRY(fully_shard(mod, &o, &g));
  /* a unit without parameters of its own (a head tied to the token embedding) gathers and
   * casts nothing: an item's mp_policy for it would be ignored */
  if (own_dtypes && fsdp_num_params(g) == 0)
    return err_set(STATUS_EINVAL,
                   "%s: parallelize.fully_shard.units item '%s': %s has no parameters of its own "
                   "(a tied head uses the token embedding's), so its mp_policy would not apply; "
                   "give the dtypes to the unit that holds them",
                   u->where.text, u->pattern, nn_module_fqn(mod));
  /* an expert's gradient sums its ep group's losses' (nn_moe_expert_parallel): summed over
   * the other groups too, divided by every data-parallel rank as the dense ones' average; with
   * tp, summed over the tp ranks as well, which share their tokens' gradients under sequence
   * parallelism and hold the same ones otherwise */
  if (experts)
    fsdp_set_gradient_divide_factor(
        mod, (double)par->dp_size * (pp->tp > 1 && !pp->sequence_parallel ? pp->tp : 1));
  /* (ep borrowing tp needs sequence parallelism: its tp ranks' tokens are apart) */
  /* units come inner first: tp's reductions under mod take its reduce dtype */
  if (par->tp != NULL && fsdp_num_params(g) > 0)
    FSDPC_TRY(tp_set_reduce_dtype(par->tp, mod, fsdp_reduce_dtype(g)));
  return push_group(par, g);
}

/* The index of the first unit pattern matching mod, or -1. */
static int first_unit(const parallel_plan_t *pp, const nn_module_t *mod) {
  const plan_unit_t *u = parallel_plan_unit(pp, nn_module_fqn(mod));
  return u ? (int)(u - pp->units) : -1;
}

static int64_t param_numel(const nn_param_t *p) {
  int64_t n = 1;
  for (int d = 0; d < dtensor_ndim(p->value); d++) n *= dtensor_shape(p->value)[d];
  return n;
}

/* Post-order: children (inner modules) before their parent. A module becomes a unit by the
 * first unit pattern matching it or, with min_unit_params, when the parameters under it that
 * no inner unit took number at least that many; *left receives that number (0 for a unit). */
static bool is_owned(const parallel_t *par, const nn_module_t *m) {
  for (int i = 0; i < par->n_owned; i++)
    if (par->owned[i] == m) return true;
  return false;
}

static fsdpc_status_t visit(parallel_t *par, const parallel_plan_t *pp, nn_module_t *mod,
                            int64_t *left) {
  int64_t n = 0, c;
  for (int i = 0; i < nn_module_num_children(mod); i++) {
    FSDPC_TRY(visit(par, pp, nn_module_child(mod, i), &c));
    n += c;
  }
  for (int i = 0; i < nn_module_num_params(mod); i++) n += param_numel(nn_module_param(mod, i));
  *left = n;
  if (mod == par->root) return STATUS_OK;
  if (fsdp_group_of(mod) != NULL) { /* joined the unit of the module it shares with */
    *left = 0;
    int u = first_unit(pp, mod);
    if (u >= 0 && (pp->units[u].param_dtype != pp->param_dtype ||
                   pp->units[u].reduce_dtype != pp->reduce_dtype ||
                   pp->units[u].output_dtype != pp->output_dtype))
      return err_set(STATUS_EINVAL,
                     "%s: parallelize.fully_shard.units item '%s': %s computes with the "
                     "parameters of the unit it joins (a tied head, with the token embedding's), "
                     "so its mp_policy would not apply; give the dtypes to that unit",
                     pp->units[u].where.text, pp->units[u].pattern, nn_module_fqn(mod));
    return STATUS_OK;
  }
  if (par->owned != NULL && !parallel_holds(par, mod)) { /* another stage's: not sharded here */
    *left = 0;
    return STATUS_OK;
  }
  int u = first_unit(pp, mod);
  plan_unit_t sized = {.reshard_after_forward = pp->reshard_after_forward,
                       .param_dtype = pp->param_dtype,
                       .reduce_dtype = pp->reduce_dtype,
                       .output_dtype = pp->output_dtype};
  if (par->ep_fsdp_mesh != NULL && is_experts(mod)) { /* a unit of its own, on its mesh */
    *left = 0;
    /* with the units item that matches it, else the section's settings with the dtypes of
     * the unit it lies in (where it computes without expert parallelism); a group size for
     * reshard_after_forward it was not given, where it spans the experts' smaller shard
     * group, keeps them gathered (as it would a group that size) */
    plan_unit_t e = u >= 0 ? pp->units[u] : sized;
    int in = -1;
    for (const nn_module_t *up = nn_module_parent(mod);
         u < 0 && in < 0 && up != NULL && up != par->root; up = nn_module_parent(up))
      in = first_unit(pp, up);
    if (in >= 0) {
      e.param_dtype = pp->units[in].param_dtype;
      e.reduce_dtype = pp->units[in].reduce_dtype;
      e.output_dtype = pp->units[in].output_dtype;
    }
    int W = mesh_size(par->ep_fsdp_mesh, mesh_ndim(par->ep_fsdp_mesh) - 1);
    int N = e.reshard_after_forward;
    bool given = u >= 0 && N != pp->reshard_after_forward; /* not the section's, inherited */
    if (!given && N >= 2 && (N >= W || W % N != 0)) e.reshard_after_forward = 0;
    fsdpc_status_t st = shard_unit(par, pp, mod, &e);
    if (st != STATUS_OK && u >= 0)
      return err_prefix(st,
                        "%s: parallelize.fully_shard.units[%d] ('%s', %s: its experts shard over "
                        "dp_shard / ep = %d ranks)",
                        pp->units[u].where.text, u, pp->units[u].pattern, nn_module_fqn(mod), W);
    return st;
  }
  /* a stage's own module with parameters left is a unit: the root's part under pipelines */
  bool stage_rest = par->owned != NULL && is_owned(par, mod) && n > 0;
  if (u < 0 && !stage_rest && (pp->min_unit_params <= 0 || n < pp->min_unit_params))
    return STATUS_OK;
  *left = 0;
  return shard_unit(par, pp, mod, u >= 0 ? &pp->units[u] : &sized);
}

static int count_matches(const nn_module_t *root, const nn_module_t *mod, const char *pattern) {
  int n = mod != root && nn_fqn_match(pattern, nn_module_fqn(mod));
  for (int i = 0; i < nn_module_num_children(mod); i++)
    n += count_matches(root, nn_module_child(mod, i), pattern);
  return n;
}

/* A module under mod (not the root) whose first matching pattern is not u while u matches it:
 * the earlier pattern's index, or -1 when u takes a module of its own. */
static int shadowed_by(const nn_module_t *root, const nn_module_t *mod, const parallel_plan_t *pp,
                       int u, bool *owns) {
  int by = -1;
  if (mod != root && nn_fqn_match(pp->units[u].pattern, nn_module_fqn(mod))) {
    int f = first_unit(pp, mod);
    if (f == u) *owns = true;
    else by = f;
  }
  for (int i = 0; i < nn_module_num_children(mod); i++) {
    int b = shadowed_by(root, nn_module_child(mod, i), pp, u, owns);
    if (by < 0) by = b;
  }
  return by;
}

/* Every shard_dims pattern names a parameter, with a dimension it has. */
static fsdpc_status_t check_shard_dims(const nn_module_t *root, const parallel_plan_t *pp) {
  if (pp->n_shard_dims == 0) return STATUS_OK;
  nn_param_t **ps;
  int n;
  FSDPC_TRY(nn_named_parameters(root, &ps, &n));
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < pp->n_shard_dims && st == STATUS_OK; i++) {
    const plan_shard_dim_t *sd = &pp->shard_dims[i];
    int hits = 0, by = -1; /* by: the earlier pattern that takes the last one it matches */
    bool owns = false;
    for (int k = 0; k < n && st == STATUS_OK; k++) {
      if (!nn_fqn_match(sd->pattern, ps[k]->fqn)) continue;
      hits++;
      int first = 0;
      while (!nn_fqn_match(pp->shard_dims[first].pattern, ps[k]->fqn)) first++;
      owns = owns || first == i;
      if (first != i) by = first;
      int nd = dtensor_ndim(ps[k]->value);
      if (parallel_plan_shard_dim(pp, ps[k]->fqn, nd) < 0)
        st = err_set(STATUS_EINVAL,
                     "%s: parallelize.fully_shard.shard_dims: parameter %s has %d dimension%s; "
                     "'%s' gives it dimension %d (from %d to %d)",
                     sd->where.text, ps[k]->fqn, nd, nd == 1 ? "" : "s", sd->pattern, sd->dim, -nd,
                     nd - 1);
    }
    if (st == STATUS_OK && hits == 0)
      st = err_set(STATUS_EINVAL,
                   "%s: parallelize.fully_shard.shard_dims: '%s' matches no parameter "
                   "(parameters here: %s%s%s, ...)",
                   sd->where.text, sd->pattern, n > 0 ? ps[0]->fqn : "", n > 1 ? ", " : "",
                   n > 1 ? ps[1]->fqn : "");
    else if (st == STATUS_OK && !owns) /* it would never apply */
      st = err_set(STATUS_EINVAL,
                   "%s: parallelize.fully_shard.shard_dims: every parameter '%s' matches is "
                   "taken by the earlier '%s' (the first matching pattern wins: put the more "
                   "specific one first)",
                   sd->where.text, sd->pattern, pp->shard_dims[by].pattern);
  }
  free(ps);
  return st;
}

static fsdpc_status_t apply_fsdp(parallel_t *par, const parallel_plan_t *pp) {
  FSDPC_TRY(check_shard_dims(par->root, pp));
  /* check every pattern first: nothing is sharded when one matches no module */
  for (int u = 0; u < pp->n_units; u++)
    if (count_matches(par->root, par->root, pp->units[u].pattern) == 0) {
      char names[256];
      return err_set(STATUS_EINVAL,
                     "%s: parallelize.fully_shard.units[%d]: '%s' matches no module (modules "
                     "here: %s, ...)",
                     pp->units[u].where.text, u, pp->units[u].pattern,
                     nn_module_names(par->root, 6, names, sizeof names));
    }
  for (int u = 0; u < pp->n_units; u++) { /* an item that would take nothing is a mistake */
    bool owns = false;
    int by = shadowed_by(par->root, par->root, pp, u, &owns);
    if (!owns)
      return err_set(STATUS_EINVAL,
                     "%s: parallelize.fully_shard.units[%d]: every module '%s' matches is taken "
                     "by the earlier units[%d] '%s' (the first matching item wins: put the more "
                     "specific one first)",
                     pp->units[u].where.text, u, pp->units[u].pattern, by, pp->units[by].pattern);
  }
  int64_t left;
  FSDPC_TRY(visit(par, pp, par->root, &left));
  if (par->owned != NULL) return STATUS_OK; /* the stages' modules are the units */
  return shard_unit(par, pp, par->root, NULL);
}

static fsdpc_status_t apply(nn_module_t *root, const parallel_plan_t *pp, device_type_t dev,
                            nn_module_t *const *owned, int n_owned, parallel_t **out) {
  *out = NULL;
  if (root == NULL || pp == NULL)
    return err_set(STATUS_EINVAL, "parallel_apply: a module tree and a plan are required");
  if (pp->dp_replicate < 1 || pp->dp_shard < 1 || pp->tp < 1 || pp->pp < 1)
    return err_set(STATUS_EINVAL,
                   "parallel_apply: the plan's mesh has a size of -1 (call parallel_plan_resolve "
                   "first)");
  if (pp->pp > 1 && (owned == NULL || n_owned < 1))
    return err_set(STATUS_EINVAL,
                   "parallel_apply: mesh.pp %d splits the model into stages: give this rank's "
                   "modules (parallel_apply_stages)",
                   pp->pp);
  parallel_t *par = calloc(1, sizeof *par);
  if (par == NULL) return err_set(STATUS_ENOMEM, "parallelize: out of host memory");
  par->root = root;
  par->owned = pp->pp > 1 ? owned : NULL;
  par->n_owned = pp->pp > 1 ? n_owned : 0;
  fsdpc_status_t st = make_meshes(par, pp, dev);
  /* the experts split before tensor parallelism leaves every other parameter Replicate on tp */
  if (st == STATUS_OK) st = apply_ep(par, pp);
  if (st == STATUS_OK) st = apply_tp(par, pp);
  if (st == STATUS_OK) st = apply_fsdp(par, pp);
  if (st != STATUS_OK) {
    parallel_free(par);
    return st;
  }
  *out = par;
  return STATUS_OK;
}

fsdpc_status_t parallel_apply(nn_module_t *root, const parallel_plan_t *pp, device_type_t dev,
                              parallel_t **out) {
  ARG_NONNULL(out);
  ARG_NONNULL(root);
  ARG_NONNULL(pp);
  return apply(root, pp, dev, NULL, 0, out);
}

fsdpc_status_t parallel_apply_stages(nn_module_t *root, const parallel_plan_t *pp,
                                     device_type_t dev, nn_module_t *const *owned, int n_owned,
                                     parallel_t **out) {
  ARG_NONNULL(out);
  ARG_NONNULL(root);
  ARG_NONNULL(pp);
  ARG_NONNULL(owned);
  return apply(root, pp, dev, owned, n_owned, out);
}

void parallel_free(parallel_t *par) {
  if (par == NULL) return;
  tp_free(par->tp);
  free(par->groups);
  mesh_free(par->tp_mesh);
  mesh_free(par->pp_mesh);
  mesh_free(par->ep_mesh);
  mesh_free(par->ep_fsdp_mesh);
  mesh_free(par->dp_mesh);
  mesh_free(par->all);
  mesh_free(par->mesh);
  free(par);
}

/* ---- offline placements ---- */

/* A stacked experts' weight under mesh.ep, on the world mesh ((dp_replicate,) dp_shard / ep,
 * ep(, tp)): its experts split over ep, that split sharded on dimension d over dp_shard / ep
 * (strided when d is the experts' dimension: the shards chunk each rank's experts), whole on
 * every replica (their files written once). With tp, their fully_shard spans dp_shard / ep and
 * tp flattened: so sharded on d over tp too, tp's chunks innermost; where d is the experts'
 * dimension and dp_shard / ep > 1 that order has no placements on this mesh (the strided
 * shard would put dp_shard / ep's chunks innermost), and the experts stay whole on tp (the
 * same values, each written once, read by a tp rank from its neighbour's file). When ep
 * borrows tp, the ep dimension is ep / tp dp ranks and tp flattened (adjacent in the world
 * mesh), and the experts shard over dp_shard / ep alone. */
static fsdpc_status_t expert_placements(const parallel_plan_t *pp, int d, int *mesh_ndim,
                                        int *mesh_shape, placement_t *pl) {
  int md = 0;
  if (pp->dp_replicate > 1) {
    mesh_shape[md] = pp->dp_replicate;
    pl[md++] = placement_replicate();
  }
  bool borrow = parallel_plan_ep_borrows_tp(pp); /* the split over ep / tp dp ranks and tp */
  int outer = pp->dp_shard / (borrow ? pp->ep / pp->tp : pp->ep);
  mesh_shape[md] = outer;
  pl[md++] = d == 0 && outer > 1 ? placement_strided_shard(0, pp->ep) : placement_shard(d);
  mesh_shape[md] = pp->ep;
  pl[md++] = placement_shard(0);
  if (pp->tp > 1 && !borrow) {
    mesh_shape[md] = pp->tp;
    pl[md++] = d == 0 && outer > 1 ? placement_replicate() : placement_shard(d);
  }
  *mesh_ndim = md;
  return STATUS_OK;
}

static fsdpc_status_t stage_placements(const parallel_plan_t *pp, const char *fqn, const char *kind,
                                       int ndim, int *mesh_ndim, int *mesh_shape, placement_t *pl);

fsdpc_status_t parallel_param_placements(const parallel_plan_t *pp, const char *fqn,
                                         const char *kind, int ndim, int *mesh_ndim,
                                         int *mesh_shape, placement_t *pl) {
  ARG_NONNULL(pp);
  ARG_NONNULL(mesh_ndim);
  ARG_NONNULL(mesh_shape);
  ARG_NONNULL(pl);
  FSDPC_TRY(stage_placements(pp, fqn, kind, ndim, mesh_ndim, mesh_shape, pl));
  if (pp->pp <= 1) return STATUS_OK;
  /* a pipeline: the outermost dimension, Replicate (laid out on the first pipeline rank's
   * files; each stage's ranks load their parameters from there) */
  memmove(mesh_shape + 1, mesh_shape, sizeof *mesh_shape * (size_t)*mesh_ndim);
  memmove(pl + 1, pl, sizeof *pl * (size_t)*mesh_ndim);
  mesh_shape[0] = pp->pp;
  pl[0] = placement_replicate();
  (*mesh_ndim)++;
  return STATUS_OK;
}

static fsdpc_status_t stage_placements(const parallel_plan_t *pp, const char *fqn, const char *kind,
                                       int ndim, int *mesh_ndim, int *mesh_shape, placement_t *pl) {
  ARG_NONNULL(pp);
  ARG_NONNULL(fqn);
  ARG_NONNULL(mesh_ndim);
  ARG_NONNULL(mesh_shape);
  ARG_NONNULL(pl);
  int md = 0, d = parallel_plan_shard_dim(pp, fqn, ndim);
  if (d < 0)
    return err_set(STATUS_EINVAL,
                   "parameter %s: its shard dimension in parallelize.fully_shard.shard_dims is out "
                   "of range for %d dimensions",
                   fqn, ndim);
  if (pp->ep > 1 && kind != NULL && strcmp(kind, "experts") == 0)
    return expert_placements(pp, d, mesh_ndim, mesh_shape, pl);
  if (pp->dp_replicate > 1) { /* HFSDP: the replicas chunk each shard */
    mesh_shape[md] = pp->dp_replicate;
    pl[md++] = !pp->state_over_replicas ? placement_replicate()
               : pp->dp_shard > 1       ? placement_strided_shard(d, pp->dp_shard)
                                        : placement_shard(d);
  }
  int shard = md;
  mesh_shape[md] = pp->dp_shard;
  pl[md++] = placement_shard(d);
  if (pp->tp > 1) {
    char module[PLAN_PATTERN_MAX * 4];
    snprintf(module, sizeof module, "%s", fqn);
    char *dot = strrchr(module, '.');
    if (dot) *dot = 0;
    tp_rule_t rules[PLAN_MAX_TP_RULES];
    int n = parallel_plan_tp_rules(pp, rules), i = tp_rule_index(rules, n, dot ? module : "");
    placement_t tpl = placement_replicate();
    if (i >= 0 && tp_rule_applies(&rules[i], pp->sequence_parallel)) {
      if (kind == NULL)
        return err_set(STATUS_EINVAL,
                       "parameter %s: tensor-parallel rule '%s' matches module '%s', whose kind "
                       "is not known",
                       fqn, rules[i].pattern, dot ? module : "");
      fsdpc_status_t st = tp_param_placement(rules[i].style, kind, dot ? dot + 1 : fqn, ndim, &tpl);
      if (st != STATUS_OK)
        return err_prefix(st, "parameter %s (tensor-parallel rule '%s')", fqn, rules[i].pattern);
    }
    if (placement_is_shard(tpl, d)) { /* dp chunks the tp shard (and HFSDP's replicas that) */
      pl[shard] = placement_strided_shard(d, pp->tp);
      if (shard > 0 && pp->state_over_replicas)
        pl[0] = placement_strided_shard(d, pp->dp_shard * pp->tp);
    }
    mesh_shape[md] = pp->tp;
    pl[md++] = tpl;
  }
  *mesh_ndim = md;
  return STATUS_OK;
}
