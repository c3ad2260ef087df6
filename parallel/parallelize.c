#include "parallel/parallelize.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

status_t plan_mesh(const plan_t *p, device_type_t dev, mesh_t **out) {
  int shape[3], n = 0;
  const char *names[3];
  if (p->dp_replicate > 1) {
    shape[n] = p->dp_replicate;
    names[n++] = "dp_replicate";
  }
  shape[n] = p->dp_shard;
  names[n++] = "dp_shard";
  if (p->tp > 1) {
    shape[n] = p->tp;
    names[n++] = "tp";
  }
  return mesh_init(out, n, shape, names, dev);
}

status_t plan_dp_mesh(const plan_t *p, const mesh_t *world, mesh_t **out) {
  const char *names[2] = {"dp_replicate", "dp_shard"};
  int n = p->dp_replicate > 1 ? 2 : 1;
  return mesh_slice(world, n, names + 2 - n, out);
}

/* The Llama plan of TorchTitan: attention and MLP inputs split by column and outputs by
 * row, the vocabulary split in the embedding and lm_head (whose output is made whole for the
 * loss), norms on sequence shards under sequence parallelism. */
static const tp_rule_t llama_plan[] = {
    {"model.embed_tokens", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.input_layernorm", TP_SEQUENCE_PARALLEL, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.self_attn", TP_PREPARE_INPUT, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.self_attn.q_proj", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.self_attn.k_proj", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.self_attn.v_proj", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.self_attn.o_proj", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.post_attention_layernorm", TP_SEQUENCE_PARALLEL, TP_LAYOUT_DEFAULT,
     TP_LAYOUT_DEFAULT},
    {"model.layers.*.mlp", TP_PREPARE_INPUT, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.mlp.gate_proj", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.mlp.up_proj", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.mlp.down_proj", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.norm", TP_SEQUENCE_PARALLEL, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"lm_head", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_REPLICATE},
};

int plan_default_tp_rules(const tp_rule_t **rules) {
  *rules = llama_plan;
  return (int)(sizeof llama_plan / sizeof llama_plan[0]);
}

/* The kind of a Llama layer from its FQN (the module tree of nn/llama.c). */
static const char *llama_kind(const char *module) {
  size_t n = strlen(module);
  if (n >= 12 && strcmp(module + n - 12, "embed_tokens") == 0) return "embedding";
  if (n >= 4 && strcmp(module + n - 4, "norm") == 0) return "rmsnorm";
  return "linear";
}

/* The tensor-parallel rules in effect: the plan's (converted into buf) or the built-in ones. */
static int rules_of(const plan_t *p, tp_rule_t *buf, const tp_rule_t **out) {
  if (!p->tp_plan_given) return plan_default_tp_rules(out);
  for (int i = 0; i < p->n_tp_rules; i++)
    buf[i] = (tp_rule_t){p->tp_rules[i].pattern, p->tp_rules[i].style, p->tp_rules[i].input,
                         p->tp_rules[i].output};
  *out = buf;
  return p->n_tp_rules;
}

status_t plan_param_placements(const plan_t *p, const char *fqn, int *mesh_ndim, int *mesh_shape,
                               placement_t *pl) {
  int md = 0;
  if (p->dp_replicate > 1) {
    mesh_shape[md] = p->dp_replicate;
    pl[md++] = placement_replicate();
  }
  int shard = md;
  mesh_shape[md] = p->dp_shard;
  pl[md++] = placement_shard(0);
  if (p->tp > 1) {
    char module[PLAN_PATTERN_MAX * 4];
    snprintf(module, sizeof module, "%s", fqn);
    char *dot = strrchr(module, '.');
    if (dot) *dot = 0;
    tp_rule_t buf[PLAN_MAX_TP_RULES];
    const tp_rule_t *rules;
    int n = rules_of(p, buf, &rules), i = tp_rule_index(rules, n, module);
    placement_t tpl = placement_replicate();
    if (i >= 0 && tp_rule_applies(&rules[i], p->sequence_parallel))
      TRY(tp_weight_placement(rules[i].style, llama_kind(module), &tpl));
    if (placement_is_shard(tpl, 0)) pl[shard] = placement_strided_shard(0, p->tp);
    mesh_shape[md] = p->tp;
    pl[md++] = tpl;
  }
  *mesh_ndim = md;
  return STATUS_OK;
}

bool plan_tp_is_builtin(const plan_t *p) {
  if (!p->tp_plan_given) return true;
  const tp_rule_t *d;
  int n = plan_default_tp_rules(&d);
  if (p->n_tp_rules != n) return false;
  for (int i = 0; i < n; i++) {
    const plan_tp_rule_t *r = &p->tp_rules[i];
    if (strcmp(r->pattern, d[i].pattern) != 0 || r->style != d[i].style || r->input != d[i].input ||
        r->output != d[i].output)
      return false;
  }
  return true;
}

status_t plan_apply_tensor_parallel(const plan_t *p, llama_t *m, const mesh_t *world,
                                    mesh_t **tp_mesh, tp_plan_t **out) {
  *out = NULL;
  *tp_mesh = NULL;
  if (p->tp <= 1) return STATUS_OK;
  tp_rule_t buf[PLAN_MAX_TP_RULES];
  const tp_rule_t *use;
  int n = rules_of(p, buf, &use);
  for (int i = 0; i < n; i++) /* the loss reads whole logits */
    if (nn_fqn_match(use[i].pattern, "lm_head") && use[i].style == TP_COLWISE &&
        use[i].output != TP_REPLICATE)
      return err_set(STATUS_EINVAL,
                     "%s: parallelize.tensor_parallel.plan.%s: the loss needs whole logits; "
                     "write {style: colwise, output: replicate}",
                     p->tp_plan_given ? p->tp_rules[i].where.text : p->source, use[i].pattern);
  TRY(mesh_slice(world, 1, (const char *[]){"tp"}, tp_mesh));
  status_t st = tensor_parallel(llama_module(m), *tp_mesh, use, n, p->sequence_parallel, out);
  if (st != STATUS_OK && p->tp_plan_given) { /* name the rule's place in the file */
    char msg[512];
    snprintf(msg, sizeof msg, "%s", err_detail());
    st = err_set(st, "%s: parallelize.tensor_parallel.plan: %s", p->tp_where.text, msg);
  }
  if (st != STATUS_OK) {
    mesh_free(*tp_mesh);
    *tp_mesh = NULL;
  }
  return st;
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
    if (nn_fqn_match(w->p->units[u].pattern, nn_module_fqn(mod))) {
      return shard_unit(w, mod, &w->p->units[u]);
    }
  return STATUS_OK;
}

static int count_matches(const nn_module_t *root, const nn_module_t *mod, const char *pattern) {
  int n = mod != root && nn_fqn_match(pattern, nn_module_fqn(mod));
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
