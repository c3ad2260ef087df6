/* Parallelism plans: the mesh and parallelize sections read from YAML, filled in code, and
 * resolved against the world size. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "fully_shard/fsdp.h"
#include "mesh/world.h"
#include "nn/module.h"
#include "parallel/plan_reader_impl.h"

void parallel_plan_defaults(parallel_plan_t *pp) {
  if (pp == NULL) return;
  memset(pp, 0, sizeof *pp);
  pp->dp_replicate = 1;
  pp->dp_shard = -1;
  pp->tp = 1;
  pp->ep = 1;
  pp->pp = 1;
  pp->pp_schedule = PP_1F1B;
  pp->pp_stages_per_rank = 1;
  pp->reshard_after_forward = FSDP_RESHARD_AUTO;
  pp->param_dtype = pp->reduce_dtype = pp->output_dtype = DTYPE_COUNT;
  snprintf(pp->optim_where.text, sizeof pp->optim_where.text, "(plan)");
  snprintf(pp->ep_where.text, sizeof pp->ep_where.text, "(plan)");
  snprintf(pp->tp_size_where.text, sizeof pp->tp_size_where.text, "(plan)");
  snprintf(pp->pp_size_where.text, sizeof pp->pp_size_where.text, "(plan)");
}

fsdpc_status_t pp_read_mesh(plan_ctx_t *c, int root) {
  static const char *const keys[] = {"dp_replicate", "dp_shard", "tp", "ep", "pp", NULL};
  int m;
  FSDPC_TRY(pr_section(c, root, "mesh", keys, &m));
  if (m == 0) {
    snprintf(c->par->mesh_where.text, sizeof c->par->mesh_where.text, "%s", c->source);
    c->par->ep_where = c->par->tp_size_where = c->par->pp_size_where = c->par->mesh_where;
    return STATUS_OK;
  }
  pr_where_section(c, m, keys, &c->par->mesh_where);
  int ep = pr_find(c, m, "ep"), tp = pr_find(c, m, "tp"), pp = pr_find(c, m, "pp");
  if (pp != 0)
    pr_where_of(c, pp, &c->par->pp_size_where);
  else
    c->par->pp_size_where = c->par->mesh_where;
  if (ep != 0)
    pr_where_of(c, ep, &c->par->ep_where);
  else
    c->par->ep_where = c->par->mesh_where;
  if (tp != 0)
    pr_where_of(c, tp, &c->par->tp_size_where);
  else
    c->par->tp_size_where = c->par->mesh_where;
  FSDPC_TRY(pr_get_size(c, m, "mesh", "dp_replicate", &c->par->dp_replicate));
  FSDPC_TRY(pr_get_size(c, m, "mesh", "dp_shard", &c->par->dp_shard));
  FSDPC_TRY(pr_get_size(c, m, "mesh", "tp", &c->par->tp));
  int64_t v = c->par->ep; /* sizes from 1: neither takes the rest of the world */
  FSDPC_TRY(pr_get_int(c, m, "mesh", "ep", 1, 1 << 20, &v));
  c->par->ep = (int)v;
  v = c->par->pp;
  FSDPC_TRY(pr_get_int(c, m, "mesh", "pp", 1, 1 << 20, &v));
  c->par->pp = (int)v;
  int unknown = (c->par->dp_replicate < 0) + (c->par->dp_shard < 0) + (c->par->tp < 0);
  if (unknown > 1) return pr_fail(c, m, "mesh", "at most one size may be -1");
  return STATUS_OK;
}

static fsdpc_status_t read_mp(plan_ctx_t *c, int map, const char *prefix, dtype_t dt[3]) {
  static const char *const keys[] = {"param_dtype", "reduce_dtype", "output_dtype", NULL};
  char path[256];
  int v = pr_lookup(c, map, prefix, "mp_policy", path);
  if (v == 0) return STATUS_OK;
  FSDPC_TRY(pr_check_keys(c, v, path, keys));
  for (int k = 0; k < 3; k++) FSDPC_TRY(pr_get_dtype(c, v, path, keys[k], &dt[k]));
  return STATUS_OK;
}

static void unit_defaults(const parallel_plan_t *pp, plan_unit_t *u) {
  u->reshard_after_forward = pp->reshard_after_forward;
  u->param_dtype = pp->param_dtype;
  u->reduce_dtype = pp->reduce_dtype;
  u->output_dtype = pp->output_dtype;
}

static fsdpc_status_t read_units(plan_ctx_t *c, int fs) {
  parallel_plan_t *par = c->par;
  const char *path = "parallelize.fully_shard.units";
  int v = pr_find(c, fs, "units");
  if (pr_is_null(c, v)) return STATUS_OK;
  yaml_node_t *n = pr_node(c, v);
  if (n->type != YAML_SEQUENCE_NODE)
    return pr_fail(c, v, path, "expected a list of module patterns");
  par->n_units = 0;
  for (yaml_node_item_t *it = n->data.sequence.items.start; it < n->data.sequence.items.top; it++) {
    if (par->n_units == PLAN_MAX_UNITS)
      return pr_fail(c, *it, path, "more than %d units", PLAN_MAX_UNITS);
    plan_unit_t *u = &par->units[par->n_units];
    char upath[256];
    snprintf(upath, sizeof upath, "%s[%d]", path, par->n_units);
    unit_defaults(par, u);
    pr_where_of(c, *it, &u->where);
    const char *s = pr_scalar(c, *it);
    if (s == NULL) { /* {match: PATTERN, reshard_after_forward: ..., mp_policy: ...} */
      static const char *const keys[] = {"match", "reshard_after_forward", "mp_policy", NULL};
      FSDPC_TRY(pr_check_keys(c, *it, upath, keys));
      int m = pr_find(c, *it, "match");
      char mpath[300];
      snprintf(mpath, sizeof mpath, "%s.match", upath);
      if (pr_is_null(c, m))
        return pr_fail(c, *it, mpath, "missing: the module pattern of this unit");
      FSDPC_TRY(pr_want_scalar(c, m, mpath, "a module pattern", &s));
      FSDPC_TRY(pr_get_reshard(c, *it, upath, &u->reshard_after_forward));
      dtype_t dt[3] = {u->param_dtype, u->reduce_dtype, u->output_dtype};
      FSDPC_TRY(read_mp(c, *it, upath, dt));
      u->param_dtype = dt[0];
      u->reduce_dtype = dt[1];
      u->output_dtype = dt[2];
    }
    if (s[0] == 0) return pr_fail(c, *it, upath, "empty module pattern");
    if (strlen(s) >= PLAN_PATTERN_MAX)
      return pr_fail(c, *it, upath, "pattern longer than %d characters", PLAN_PATTERN_MAX - 1);
    strcpy(u->pattern, s);
    par->n_units++;
  }
  return STATUS_OK;
}

static fsdpc_status_t read_tp_layout(plan_ctx_t *c, int map, const char *path, const char *key,
                                     tp_layout_t *out) {
  int v = pr_find(c, map, key);
  if (pr_is_null(c, v)) return STATUS_OK;
  const char *s = pr_scalar(c, v);
  if (s == NULL || !tp_layout_parse(s, out))
    return pr_fail(c, v, path, "%s: expected replicate, shard(1) or shard(-1)", key);
  return STATUS_OK;
}

/* shard_dims: {PATTERN: DIM}, patterns of parameter FQNs in order. */
static fsdpc_status_t read_shard_dims(plan_ctx_t *c, int fs) {
  parallel_plan_t *par = c->par;
  const char *path = "parallelize.fully_shard.shard_dims";
  int v = pr_find(c, fs, "shard_dims");
  if (pr_is_null(c, v)) return STATUS_OK;
  yaml_node_t *n = pr_node(c, v);
  if (n->type != YAML_MAPPING_NODE)
    return pr_fail(c, v, path, "expected a mapping of parameter patterns to dimensions");
  par->n_shard_dims = 0;
  for (yaml_node_pair_t *a = n->data.mapping.pairs.start; a < n->data.mapping.pairs.top; a++) {
    const char *pat = pr_scalar(c, a->key);
    if (pat == NULL || pat[0] == 0)
      return pr_fail(c, a->key, path, "expected a parameter pattern as the key");
    char kpath[PLAN_PATTERN_MAX + 64];
    snprintf(kpath, sizeof kpath, "%s.%s", path, pat);
    if (par->n_shard_dims == PLAN_MAX_SHARD_DIMS)
      return pr_fail(c, a->key, path, "more than %d patterns", PLAN_MAX_SHARD_DIMS);
    if (strlen(pat) >= PLAN_PATTERN_MAX)
      return pr_fail(c, a->key, kpath, "pattern longer than %d characters", PLAN_PATTERN_MAX - 1);
    for (int q = 0; q < par->n_shard_dims; q++)
      if (strcmp(par->shard_dims[q].pattern, pat) == 0)
        return pr_fail(c, a->key, path, "'%s' appears twice", pat);
    int64_t d = 0;
    FSDPC_TRY(pr_parse_int(c, a->value, kpath, -TENSOR_MAX_DIMS, TENSOR_MAX_DIMS - 1, &d));
    plan_shard_dim_t *sd = &par->shard_dims[par->n_shard_dims++];
    strcpy(sd->pattern, pat);
    sd->dim = (int)d;
    pr_where_of(c, a->key, &sd->where);
  }
  return STATUS_OK;
}

/* optimizer_sharding: shard | full. */
static fsdpc_status_t read_optimizer_sharding(plan_ctx_t *c, int fs) {
  char path[256], v[16] = "";
  int n = pr_lookup(c, fs, "parallelize.fully_shard", "optimizer_sharding", path);
  if (n == 0) return STATUS_OK;
  FSDPC_TRY(pr_get_str(c, fs, "parallelize.fully_shard", "optimizer_sharding", v, sizeof v));
  if (strcmp(v, "shard") != 0 && strcmp(v, "full") != 0)
    return pr_fail(c, n, path,
                   "expected shard (the optimizer state sharded as the parameters, over "
                   "dp_shard) or full (over dp_replicate x dp_shard), got '%s'",
                   v);
  c->par->state_over_replicas = strcmp(v, "full") == 0;
  pr_where_of(c, n, &c->par->optim_where);
  return STATUS_OK;
}

/* tensor_parallel: {plan: {PATTERN: STYLE | {style: STYLE, input: L, output: L}},
 * sequence_parallel: bool} */
static fsdpc_status_t read_tp(plan_ctx_t *c, int tp) {
  static const char *const keys[] = {"plan", "sequence_parallel", NULL};
  static const char *const rkeys[] = {"style", "input", "output", NULL};
  parallel_plan_t *par = c->par;
  const char *path = "parallelize.tensor_parallel";
  if (pr_node(c, tp)->type != YAML_MAPPING_NODE)
    return pr_fail(c, tp, path, "expected a mapping with plan and sequence_parallel");
  FSDPC_TRY(pr_check_keys(c, tp, path, keys));
  pr_where_of(c, tp, &par->tp_where);
  FSDPC_TRY(pr_get_bool(c, tp, path, "sequence_parallel", &par->sequence_parallel));
  int pl = pr_find(c, tp, "plan");
  if (pr_is_null(c, pl)) return STATUS_OK;
  const char *ppath = "parallelize.tensor_parallel.plan";
  yaml_node_t *n = pr_node(c, pl);
  if (n->type != YAML_MAPPING_NODE)
    return pr_fail(c, pl, ppath, "expected a mapping of module pattern: style");
  par->tp_plan_given = true;
  for (yaml_node_pair_t *a = n->data.mapping.pairs.start; a < n->data.mapping.pairs.top; a++) {
    const char *k = pr_scalar(c, a->key);
    if (par->n_tp_rules == PLAN_MAX_TP_RULES)
      return pr_fail(c, a->key, ppath, "more than %d rules", PLAN_MAX_TP_RULES);
    if (k == NULL || strlen(k) >= PLAN_PATTERN_MAX)
      return pr_fail(c, a->key, ppath, "expected module pattern: style");
    for (int q = 0; q < par->n_tp_rules; q++)
      if (strcmp(par->tp_rules[q].pattern, k) == 0)
        return pr_fail(c, a->key, ppath, "'%s' appears twice", k);
    plan_tp_rule_t *r = &par->tp_rules[par->n_tp_rules];
    memset(r, 0, sizeof *r);
    char rpath[PLAN_PATTERN_MAX + 64];
    snprintf(rpath, sizeof rpath, "%s.%s", ppath, k);
    int sv = a->value;
    if (pr_node(c, a->value)->type == YAML_MAPPING_NODE) {
      FSDPC_TRY(pr_check_keys(c, a->value, rpath, rkeys));
      sv = pr_find(c, a->value, "style");
      if (sv == 0) return pr_fail(c, a->value, rpath, "style: missing");
      FSDPC_TRY(read_tp_layout(c, a->value, rpath, "input", &r->input));
      FSDPC_TRY(read_tp_layout(c, a->value, rpath, "output", &r->output));
    }
    const char *s = pr_scalar(c, sv);
    if (s == NULL || !tp_style_parse(s, &r->style))
      return pr_fail(c, sv, rpath,
                     "unknown style '%s' (colwise, rowwise, sequence_parallel, prepare_input, "
                     "headwise)",
                     s ? s : "");
    strcpy(r->pattern, k);
    pr_where_of(c, a->key, &r->where);
    par->n_tp_rules++;
  }
  return STATUS_OK;
}

/* sharding_strategy (FSDP1's names, as Accelerate writes them) or zero_stage (DeepSpeed's):
 * aliases of the mesh's data-parallel sizes and reshard_after_forward. A key also given that
 * says otherwise is an error naming both. */
static fsdpc_status_t read_strategy(plan_ctx_t *c, int root, int fs) {
  static const struct {
    const char *name;
    int reshard;
    char mesh; /* 's': shard over all ranks, 'h': shard within a node and replicate, 'r':
                  replicate only */
  } table[] = {{"FULL_SHARD", 1, 's'},
               {"SHARD_GRAD_OP", 0, 's'},
               {"HYBRID_SHARD", 1, 'h'},
               {"_HYBRID_SHARD_ZERO2", 0, 'h'},
               {"NO_SHARD", 0, 'r'}};
  parallel_plan_t *pp = c->par;
  const char *prefix = "parallelize.fully_shard";
  char spath[256], zpath[256];
  int s = pr_lookup(c, fs, prefix, "sharding_strategy", spath);
  int z = pr_lookup(c, fs, prefix, "zero_stage", zpath);
  if (s == 0 && z == 0) return STATUS_OK;
  if (s != 0 && z != 0)
    return pr_fail(c, z, zpath, "give sharding_strategy or zero_stage, not both");
  int k = -1;
  const char *said = s ? spath : zpath;
  if (s != 0) {
    const char *name;
    FSDPC_TRY(pr_want_scalar(c, s, spath, "a sharding strategy", &name));
    for (int i = 0; i < 5; i++)
      if (strcmp(name, table[i].name) == 0) k = i;
    if (k < 0)
      return pr_fail(c, s, spath,
                     "expected FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, _HYBRID_SHARD_ZERO2 or "
                     "NO_SHARD, got '%s'",
                     name);
  } else {
    const char *v;
    FSDPC_TRY(pr_want_scalar(c, z, zpath, "2 or 3", &v));
    if (strcmp(v, "3") == 0) k = 0;
    if (strcmp(v, "2") == 0) k = 1;
    if (k < 0)
      return pr_fail(
          c, z, zpath,
          "expected 3 (parameters, gradients and optimizer state sharded: FULL_SHARD) or "
          "2 (parameters kept whole from forward to backward: SHARD_GRAD_OP), got '%s'",
          v);
  }
  snprintf(pp->strategy, sizeof pp->strategy, "%s", table[k].name);
  char rpath[256], reppath[256], shardpath[256];
  int r = pr_lookup(c, fs, prefix, "reshard_after_forward", rpath);
  if (r != 0 && pp->reshard_after_forward != table[k].reshard)
    return pr_fail(c, r, rpath,
                   "disagrees with %s = %s (which means reshard_after_forward %s): give one", said,
                   table[k].name, table[k].reshard ? "true" : "false");
  pp->reshard_after_forward = table[k].reshard;
  int m = pr_find(c, root, "mesh"); /* the sizes given explicitly (0: absent or null) */
  int rep = pr_lookup(c, m, "mesh", "dp_replicate", reppath);
  int shard = pr_lookup(c, m, "mesh", "dp_shard", shardpath);
  if (table[k].mesh == 's') {
    if (rep && pp->dp_replicate != 1)
      return pr_fail(c, rep, reppath,
                     "%d disagrees with %s = %s (shards over every data-parallel rank): give one",
                     pp->dp_replicate, said, table[k].name);
  } else if (table[k].mesh == 'r') {
    if (shard && pp->dp_shard != 1 && pp->dp_shard != -1) /* -1: the rest, here none */
      return pr_fail(c, shard, shardpath,
                     "%d disagrees with %s = %s (replicates, shards nothing): give one",
                     pp->dp_shard, said, table[k].name);
    pp->dp_shard = 1;
    if (!rep) pp->dp_replicate = pp->tp < 0 ? 1 : -1;
  } else if (!rep) { /* hybrid: shard within a node (unless sized), replicate across nodes */
    if (pp->dp_shard < 0) pp->dp_shard = PLAN_SIZE_NODE;
    pp->dp_replicate = pp->tp < 0 ? 1 : -1;
  }
  return STATUS_OK;
}

fsdpc_status_t pp_read_parallelize(plan_ctx_t *c, int root) {
  static const char *const keys[] = {"fully_shard", "tensor_parallel", NULL};
  static const char *const fs_keys[] = {"units",
                                        "reshard_after_forward",
                                        "mp_policy",
                                        "offload",
                                        "sharding_strategy",
                                        "zero_stage",
                                        "min_unit_params",
                                        "shard_dims",
                                        "optimizer_sharding",
                                        NULL};
  parallel_plan_t *par = c->par;
  int m;
  FSDPC_TRY(pr_section(c, root, "parallelize", keys, &m));
  int fs = m ? pr_find(c, m, "fully_shard") : 0;
  if (!pr_is_null(c, fs)) {
    const char *path = "parallelize.fully_shard";
    FSDPC_TRY(pr_check_keys(c, fs, path, fs_keys));
    static const char *const later[] = {"reshard_after_forward", "sharding_strategy", NULL};
    pr_where_section(c, fs, later, &par->fsdp_where);
    FSDPC_TRY(pr_get_reshard(c, fs, path, &par->reshard_after_forward));
    int rn = pr_find(c, fs, "reshard_after_forward");
    if (rn != 0 && !pr_is_null(c, rn)) pr_where_of(c, rn, &par->reshard_where);
    dtype_t dt[3] = {par->param_dtype, par->reduce_dtype, par->output_dtype};
    FSDPC_TRY(read_mp(c, fs, path, dt));
    par->param_dtype = dt[0];
    par->reduce_dtype = dt[1];
    par->output_dtype = dt[2];
    FSDPC_TRY(pr_get_bool(c, fs, path, "offload", &par->offload));
    FSDPC_TRY(
        pr_get_int(c, fs, path, "min_unit_params", 0, (int64_t)1 << 50, &par->min_unit_params));
    FSDPC_TRY(read_strategy(c, root, fs));
    for (int i = 0; i < par->n_units; i++) unit_defaults(par, &par->units[i]);
    FSDPC_TRY(read_units(c, fs));
    FSDPC_TRY(read_shard_dims(c, fs));
    FSDPC_TRY(read_optimizer_sharding(c, fs));
  }
  int tp = m ? pr_find(c, m, "tensor_parallel") : 0;
  if (!pr_is_null(c, tp)) FSDPC_TRY(read_tp(c, tp));
  return STATUS_OK;
}

fsdpc_status_t parallel_plan_load(parallel_plan_t *pp, const char *path, const char *const *sets,
                                  int n_sets) {
  ARG_NONNULL(pp);
  ARG_NONNULL(path);
  parallel_plan_defaults(pp);
  if (strlen(path) >= PLAN_PATH_MAX) return err_set(STATUS_EINVAL, "plan path too long");
  strcpy(pp->source, path);
  plan_where_t *ws[] = {&pp->mesh_where, &pp->fsdp_where, &pp->tp_where, &pp->optim_where,
                        &pp->ep_where};
  for (int i = 0; i < 5; i++) snprintf(ws[i]->text, sizeof ws[i]->text, "%s", path);
  plan_ctx_t *c = calloc(1, sizeof *c);
  if (c == NULL) return err_set(STATUS_ENOMEM, "plan: out of host memory");
  c->par = pp;
  static const char *const top[] = {"mesh", "parallelize", NULL};
  int root = 0;
  fsdpc_status_t st =
      pr_open(c, path, sets, n_sets, top, "mesh, parallelize", "parallelize", &root);
  if (st == STATUS_OK) st = pp_read_mesh(c, root);
  if (st == STATUS_OK) st = pp_read_parallelize(c, root);
  pr_close(c);
  free(c);
  return st;
}

fsdpc_status_t parallel_plan_add_shard_dim(parallel_plan_t *pp, const char *pattern, int dim) {
  ARG_NONNULL(pp);
  ARG_NONNULL(pattern);
  if (pp->n_shard_dims == PLAN_MAX_SHARD_DIMS)
    return err_set(STATUS_EINVAL, "parallel plan: more than %d shard dimensions",
                   PLAN_MAX_SHARD_DIMS);
  if (pattern[0] == 0 || strlen(pattern) >= PLAN_PATTERN_MAX)
    return err_set(STATUS_EINVAL,
                   "parallel plan: a shard-dimension pattern must have 1 to %d characters",
                   PLAN_PATTERN_MAX - 1);
  if (dim < -TENSOR_MAX_DIMS || dim >= TENSOR_MAX_DIMS)
    return err_set(STATUS_EINVAL, "parallel plan: shard dimension %d of '%s' is out of range", dim,
                   pattern);
  plan_shard_dim_t *sd = &pp->shard_dims[pp->n_shard_dims++];
  memset(sd, 0, sizeof *sd);
  strcpy(sd->pattern, pattern);
  sd->dim = dim;
  snprintf(sd->where.text, sizeof sd->where.text, "shard_dims.%s", pattern);
  return STATUS_OK;
}

int parallel_plan_shard_dim(const parallel_plan_t *pp, const char *fqn, int ndim) {
  if (pp == NULL || fqn == NULL) return 0;
  for (int i = 0; i < pp->n_shard_dims; i++)
    if (nn_fqn_match(pp->shard_dims[i].pattern, fqn)) {
      int d = pp->shard_dims[i].dim;
      return d < -ndim || d >= ndim ? -1 : d < 0 ? d + ndim : d;
    }
  return 0;
}

fsdpc_status_t parallel_plan_add_unit(parallel_plan_t *pp, const char *pattern) {
  ARG_NONNULL(pp);
  ARG_NONNULL(pattern);
  if (pp->n_units == PLAN_MAX_UNITS)
    return err_set(STATUS_EINVAL, "parallel plan: more than %d units", PLAN_MAX_UNITS);
  if (pattern == NULL || pattern[0] == 0 || strlen(pattern) >= PLAN_PATTERN_MAX)
    return err_set(STATUS_EINVAL, "parallel plan: a unit pattern must have 1 to %d characters",
                   PLAN_PATTERN_MAX - 1);
  plan_unit_t *u = &pp->units[pp->n_units++];
  memset(u, 0, sizeof *u);
  strcpy(u->pattern, pattern);
  unit_defaults(pp, u);
  snprintf(u->where.text, sizeof u->where.text, "units[%d]", pp->n_units - 1);
  return STATUS_OK;
}

fsdpc_status_t parallel_plan_add_tp_rule(parallel_plan_t *pp, const char *pattern, tp_style_t style,
                                         tp_layout_t input, tp_layout_t output) {
  ARG_NONNULL(pp);
  ARG_NONNULL(pattern);
  if (pp->n_tp_rules == PLAN_MAX_TP_RULES)
    return err_set(STATUS_EINVAL, "parallel plan: more than %d tensor-parallel rules",
                   PLAN_MAX_TP_RULES);
  if (pattern == NULL || pattern[0] == 0 || strlen(pattern) >= PLAN_PATTERN_MAX)
    return err_set(STATUS_EINVAL, "parallel plan: a rule pattern must have 1 to %d characters",
                   PLAN_PATTERN_MAX - 1);
  if (style < 0 || style >= TP_STYLE_COUNT || input < 0 || input >= TP_LAYOUT_COUNT || output < 0 ||
      output >= TP_LAYOUT_COUNT)
    return err_set(STATUS_EINVAL, "parallel plan: rule '%s' has an unknown style or layout",
                   pattern);
  plan_tp_rule_t *r = &pp->tp_rules[pp->n_tp_rules++];
  memset(r, 0, sizeof *r);
  strcpy(r->pattern, pattern);
  r->style = style;
  r->input = input;
  r->output = output;
  snprintf(r->where.text, sizeof r->where.text, "tensor_parallel.plan.%s", pattern);
  pp->tp_plan_given = true;
  return STATUS_OK;
}

int parallel_plan_tp_rules(const parallel_plan_t *pp, tp_rule_t *out) {
  if (pp == NULL || out == NULL) return 0;
  for (int i = 0; i < pp->n_tp_rules; i++)
    out[i] = (tp_rule_t){pp->tp_rules[i].pattern, pp->tp_rules[i].style, pp->tp_rules[i].input,
                         pp->tp_rules[i].output};
  return pp->n_tp_rules;
}

/* ---- resolve ---- */

const plan_unit_t *parallel_plan_unit(const parallel_plan_t *pp, const char *fqn) {
  for (int u = 0; pp != NULL && fqn != NULL && u < pp->n_units; u++)
    if (nn_fqn_match(pp->units[u].pattern, fqn)) return &pp->units[u];
  return NULL;
}

bool parallel_plan_ep_borrows_tp(const parallel_plan_t *pp) {
  return pp != NULL && pp->ep > 1 && pp->dp_shard > 0 && pp->dp_shard % pp->ep != 0;
}

fsdpc_status_t parallel_plan_resolve(parallel_plan_t *pp, int world) {
  ARG_NONNULL(pp);
  bool node_sized = false;
  if (pp->dp_shard == PLAN_SIZE_NODE) { /* HYBRID_SHARD: the ranks of a node */
    if (world_started_size() != world)
      return err_set(STATUS_EINVAL,
                     "%s: sharding_strategy %s shards within a node, but a world of %d ranks is "
                     "not this job, whose nodes it could count: give mesh.dp_shard (the ranks "
                     "per node)",
                     pp->fsdp_where.text, pp->strategy, world);
    /* a node's ranks of one pipeline stage (a stage smaller than a node shards over its
     * ranks alone), over tp */
    int stage = pp->pp > 1 && world % pp->pp == 0 ? world / pp->pp : world;
    pp->dp_shard = world_local_size() < stage ? world_local_size() : stage;
    if (pp->tp > 1 && pp->dp_shard % pp->tp == 0) pp->dp_shard /= pp->tp;
    node_sized = true;
  }
  int *sizes[3] = {&pp->dp_replicate, &pp->dp_shard, &pp->tp};
  static const char *names[3] = {"dp_replicate", "dp_shard", "tp"};
  long long known = pp->pp > 1 ? pp->pp : 1; /* the pipeline's stages of ranks */
  int rest = -1;
  for (int i = 0; i < 3; i++) {
    if (*sizes[i] < 0)
      rest = i;
    else
      known *= *sizes[i];
  }
  if (rest >= 0) {
    if (known > world || world % known != 0) {
      char why[160] = "";
      if (node_sized)
        snprintf(why, sizeof why, "; sharding_strategy %s took dp_shard %d, a node's ranks",
                 pp->strategy, pp->dp_shard);
      return err_set(STATUS_EMESH,
                     "%s: mesh: the world has %d rank%s, which mesh sizes of product %lld do not "
                     "divide (mesh.%s = -1 takes the rest%s)",
                     pp->mesh_where.text, world, world == 1 ? "" : "s", known, names[rest], why);
    }
    *sizes[rest] = (int)(world / known);
  } else if (known != world) {
    char pipe[32] = "";
    if (pp->pp > 1) snprintf(pipe, sizeof pipe, " x pp %d", pp->pp);
    return err_set(STATUS_EMESH,
                   "%s: mesh: dp_replicate x dp_shard x tp = %d x %d x %d%s = %lld, but the "
                   "world has %d rank%s",
                   pp->mesh_where.text, pp->dp_replicate, pp->dp_shard, pp->tp, pipe, known, world,
                   world == 1 ? "" : "s");
  }
  for (int i = -1; i < pp->n_units; i++) { /* the section's value, then the units' own */
    int *at = i >= 0 ? &pp->units[i].reshard_after_forward : &pp->reshard_after_forward;
    int N = *at;
    if (i >= 0 && N == pp->reshard_after_forward) continue; /* inherited, or the same */
    if (N >= 2 && N == pp->dp_shard) { /* groups of all dp_shard ranks: true, as PyTorch reads it */
      *at = 1;
      continue;
    }
    const char *w = i >= 0                           ? pp->units[i].where.text
                    : pp->reshard_where.text[0] != 0 ? pp->reshard_where.text
                                                     : pp->fsdp_where.text;
    char key[64] = "parallelize.fully_shard.reshard_after_forward";
    if (i >= 0)
      snprintf(key, sizeof key, "parallelize.fully_shard.units[%d].reshard_after_forward", i);
    if (N >= 2 && (N > pp->dp_shard || pp->dp_shard % N != 0))
      return err_set(STATUS_EINVAL,
                     "%s: %s: %d %s mesh.dp_shard=%d (an integer N keeps parameters sharded "
                     "over groups of N ranks after forward: 1 < N <= dp_shard, dividing it; "
                     "dp_shard itself is true)",
                     w, key, N, N > pp->dp_shard ? "is above" : "does not divide", pp->dp_shard);
  }
  if (pp->state_over_replicas && pp->dp_replicate > 1 && pp->offload)
    return err_set(STATUS_EINVAL,
                   "%s: parallelize.fully_shard.optimizer_sharding: full does not compose with "
                   "offload: true yet (use shard)",
                   pp->optim_where.text);
  if (pp->ep > 1 && pp->dp_shard % pp->ep != 0 &&
      (pp->tp == 1 || pp->ep % pp->tp != 0 || pp->dp_shard % (pp->ep / pp->tp) != 0))
    return err_set(STATUS_EINVAL,
                   "%s: mesh.ep: %d divides neither mesh.dp_shard=%d nor, as a multiple of "
                   "mesh.tp=%d, dp_shard x tp (the experts are split over groups of ep of the "
                   "dp_shard ranks, or of ep / tp of them times every tp rank)",
                   pp->ep_where.text, pp->ep, pp->dp_shard, pp->tp);
  if (parallel_plan_ep_borrows_tp(pp) && !pp->sequence_parallel)
    return err_set(
        STATUS_EINVAL,
        "%s: mesh.ep: %d spans the tp ranks (it does not divide dp_shard=%d), which "
        "hold the same tokens without sequence parallelism: set "
        "parallelize.tensor_parallel.sequence_parallel: true, or an ep dividing dp_shard",
        pp->ep_where.text, pp->ep, pp->dp_shard);
  if (pp->ep > 1 && (pp->offload || (pp->state_over_replicas && pp->dp_replicate > 1)))
    return err_set(STATUS_EUNSUPPORTED, "%s: mesh.ep: %d does not compose with %s yet",
                   pp->ep_where.text, pp->ep, pp->offload ? "offload" : "optimizer_sharding: full");
  if (pp->tp > 1 && pp->n_tp_rules == 0)
    return err_set(STATUS_EINVAL,
                   "%s: parallelize.tensor_parallel.plan: mesh.tp is %d, but no rule says which "
                   "modules to split (PATTERN: colwise | rowwise | sequence_parallel | "
                   "prepare_input | headwise)",
                   pp->tp_where.text, pp->tp);
  return STATUS_OK;
}
