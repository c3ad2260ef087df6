#include "parallel/parallelize.h"

#include <fnmatch.h>
#include <stdlib.h>
#include <string.h>

status_t plan_mesh(const plan_t *p, device_type_t dev, mesh_t **out) {
  if (p->dp_replicate > 1) {
    int shape[2] = {p->dp_replicate, p->dp_shard};
    const char *names[] = {"dp_replicate", "dp_shard"};
    return mesh_init(out, 2, shape, names, dev);
  }
  int w = p->dp_shard;
  const char *names[] = {"dp_shard"};
  return mesh_init(out, 1, &w, names, dev);
}

/* fnmatch with '*' and '?' staying inside one dot-separated component of the FQN. */
static bool fqn_match(const char *pattern, const char *fqn) {
  char pb[PLAN_PATTERN_MAX], nb[1024];
  if (strlen(pattern) >= sizeof pb || strlen(fqn) >= sizeof nb) return false;
  strcpy(pb, pattern);
  strcpy(nb, fqn);
  for (char *c = pb; *c; c++)
    if (*c == '.') *c = '/';
  for (char *c = nb; *c; c++)
    if (*c == '.') *c = '/';
  return fnmatch(pb, nb, FNM_PATHNAME) == 0;
}

typedef struct walk {
  const plan_t *p;
  nn_module_t *root;
  mesh_t *mesh;
  fsdp_group_t **groups;
  int max, n;
} walk_t;

static status_t shard_unit(walk_t *w, nn_module_t *mod, const plan_unit_t *u) {
  fsdp_options_t o = FSDP_OPTIONS_INIT;
  o.mesh = w->mesh;
  o.offload = w->p->offload;
  o.reshard_after_forward = u ? u->reshard_after_forward : FSDP_RESHARD_AUTO;
  o.param_dtype = u ? u->param_dtype : w->p->param_dtype;
  o.reduce_dtype = u ? u->reduce_dtype : w->p->reduce_dtype;
  fsdp_group_t *g;
  TRY(fully_shard(mod, &o, &g));
  if (w->groups && w->n < w->max) w->groups[w->n] = g;
  w->n++;
  return STATUS_OK;
}

/* Post-order: children (inner modules) before their parent. */
static status_t visit(walk_t *w, nn_module_t *mod) {
  for (int i = 0; i < nn_module_num_children(mod); i++) TRY(visit(w, nn_module_child(mod, i)));
  if (mod == w->root) return STATUS_OK;
  for (int u = 0; u < w->p->n_units; u++)
    if (fqn_match(w->p->units[u].pattern, nn_module_fqn(mod))) {
      return shard_unit(w, mod, &w->p->units[u]);
    }
  return STATUS_OK;
}

static int count_matches(const nn_module_t *root, const nn_module_t *mod, const char *pattern) {
  int n = mod != root && fqn_match(pattern, nn_module_fqn(mod));
  for (int i = 0; i < nn_module_num_children(mod); i++)
    n += count_matches(root, nn_module_child(mod, i), pattern);
  return n;
}

status_t plan_apply_fully_shard(const plan_t *p, llama_t *m, mesh_t *mesh, fsdp_group_t **groups,
                                int max, int *n) {
  walk_t w = {.p = p, .root = llama_module(m), .mesh = mesh, .groups = groups, .max = max};
  /* check every pattern first: nothing is sharded when one matches no module */
  for (int u = 0; u < p->n_units; u++)
    if (count_matches(w.root, w.root, p->units[u].pattern) == 0)
      return err_set(STATUS_EINVAL,
                     "%s: parallelize.fully_shard.units[%d]: '%s' matches no module (module "
                     "names look like model.layers.0, model.layers.0.mlp, lm_head)",
                     p->units[u].where.text, u, p->units[u].pattern);
  TRY(visit(&w, w.root));
  TRY(shard_unit(&w, w.root, NULL));
  if (n) *n = w.n;
  return STATUS_OK;
}
