#include "models/llama/llama_plan.h"

#include <stdio.h>
#include <string.h>

#include "core/args_impl.h"
#include "nn/module.h"

/* The Llama plan of TorchTitan, by the module names of models/llama/llama.c, each rule with
 * what a model needs to have it: the MLP's three products where a layer is dense, the MLP as
 * one input where it is named mlp (dense, or Qwen3-MoE's sparse block), Mixtral's sparse block
 * by its own name, Qwen3's q_norm and k_norm. A rule that matches no module is refused, so a
 * model gets only the rules of the modules it has. */
enum { NEED_ALL, NEED_DENSE, NEED_MLP, NEED_MIXTRAL, NEED_QK_NORM };
static const struct {
  tp_rule_t rule;
  int need;
} llama_plan[] = {
    {{"model.embed_tokens", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT}, NEED_ALL},
    {{"model.layers.*.input_layernorm", TP_SEQUENCE_PARALLEL, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_ALL},
    {{"model.layers.*.self_attn", TP_PREPARE_INPUT, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_ALL},
    {{"model.layers.*.self_attn.q_proj", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_ALL},
    {{"model.layers.*.self_attn.k_proj", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_ALL},
    {{"model.layers.*.self_attn.v_proj", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_ALL},
    {{"model.layers.*.self_attn.o_proj", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_ALL},
    {{"model.layers.*.post_attention_layernorm", TP_SEQUENCE_PARALLEL, TP_LAYOUT_DEFAULT,
      TP_LAYOUT_DEFAULT},
     NEED_ALL},
    {{"model.layers.*.mlp", TP_PREPARE_INPUT, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT}, NEED_MLP},
    {{"model.layers.*.mlp.gate_proj", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_DENSE},
    {{"model.layers.*.mlp.up_proj", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT}, NEED_DENSE},
    {{"model.layers.*.mlp.down_proj", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_DENSE},
    {{"model.layers.*.block_sparse_moe", TP_PREPARE_INPUT, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_MIXTRAL},
    {{"model.norm", TP_SEQUENCE_PARALLEL, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT}, NEED_ALL},
    {{"lm_head", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_REPLICATE}, NEED_ALL},
    {{"model.layers.*.self_attn.q_norm", TP_HEADWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_QK_NORM},
    {{"model.layers.*.self_attn.k_norm", TP_HEADWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
     NEED_QK_NORM},
};
enum { LLAMA_PLAN_RULES = sizeof llama_plan / sizeof llama_plan[0] };

/* Whether c's model has what rule need asks (NULL: Llama's). */
static bool has(const llama_config_t *c, int need) {
  bool mixtral = c && c->arch == LLAMA_ARCH_MIXTRAL;
  bool dense = c == NULL || llama_num_moe_layers(c) < c->n_layers;
  switch (need) {
    case NEED_DENSE: return dense;
    case NEED_MLP: return !mixtral;
    case NEED_MIXTRAL: return mixtral;
    case NEED_QK_NORM: return c && c->qk_norm;
    default: return true;
  }
}

/* GPT-2's, by transformers' names: both embeddings by rows (their Partial outputs summed),
 * LayerNorms on sequence shards, c_attn (stored [dim, 3, dim]) and c_fc by columns, both c_proj
 * by rows, the tied head by columns (the token embedding's rows: the same split). */
static const tp_rule_t gpt2_plan[] = {
    {"transformer.wte", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"transformer.wpe", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"transformer.h.*.ln_1", TP_SEQUENCE_PARALLEL, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"transformer.h.*.attn", TP_PREPARE_INPUT, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"transformer.h.*.attn.c_attn", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"transformer.h.*.attn.c_proj", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"transformer.h.*.ln_2", TP_SEQUENCE_PARALLEL, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"transformer.h.*.mlp", TP_PREPARE_INPUT, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"transformer.h.*.mlp.c_fc", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"transformer.h.*.mlp.c_proj", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"transformer.ln_f", TP_SEQUENCE_PARALLEL, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"lm_head", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_REPLICATE},
};

int llama_plan_tp_rules(const llama_config_t *c, const tp_rule_t **rules) {
  if (rules == NULL) return 0;
  if (c && c->arch == LLAMA_ARCH_GPT2) {
    *rules = gpt2_plan;
    return (int)(sizeof gpt2_plan / sizeof gpt2_plan[0]);
  }
  static _Thread_local tp_rule_t mine[LLAMA_PLAN_RULES]; /* this thread's last answer */
  int n = 0;
  for (int i = 0; i < LLAMA_PLAN_RULES; i++)
    if (has(c, llama_plan[i].need)) mine[n++] = llama_plan[i].rule;
  *rules = mine;
  return n;
}

fsdpc_status_t llama_plan_fill_tp_rules(const llama_config_t *c, parallel_plan_t *pp) {
  ARG_NONNULL(pp);
  const tp_rule_t *r;
  int n = llama_plan_tp_rules(c, &r);
  pp->n_tp_rules = 0;
  for (int i = 0; i < n; i++)
    FSDPC_TRY(parallel_plan_add_tp_rule(pp, r[i].pattern, r[i].style, r[i].input, r[i].output));
  plan_where_t builtin;
  snprintf(builtin.text, sizeof builtin.text, "%s: the built-in %s plan", pp->source,
           c && c->arch == LLAMA_ARCH_GPT2 ? "GPT-2" : "Llama");
  for (int i = 0; i < n; i++) pp->tp_rules[i].where = builtin;
  pp->tp_plan_given = false;
  return STATUS_OK;
}

bool llama_plan_tp_is_builtin(const llama_config_t *c, const parallel_plan_t *pp) {
  if (pp == NULL) return false;
  if (!pp->tp_plan_given) return true;
  const tp_rule_t *d;
  int n = llama_plan_tp_rules(c, &d);
  if (pp->n_tp_rules != n) return false;
  /* the same rules in any order: no two of the built-in plan's patterns match one module */
  bool used[LLAMA_PLAN_RULES + 16] = {false};
  for (int i = 0; i < n; i++) {
    const plan_tp_rule_t *r = &pp->tp_rules[i];
    int j = 0;
    while (j < n && (used[j] || strcmp(r->pattern, d[j].pattern) != 0 || r->style != d[j].style ||
                     r->input != d[j].input || r->output != d[j].output))
      j++;
    if (j == n || j >= (int)(sizeof used / sizeof used[0])) return false;
    used[j] = true;
  }
  return true;
}

/* The first of pp's rules that applies to module fqn, or NULL (no rule: it runs whole). */
static const plan_tp_rule_t *rule_of(const parallel_plan_t *pp, const char *fqn) {
  for (int i = 0; i < pp->n_tp_rules; i++)
    if (nn_fqn_match(pp->tp_rules[i].pattern, fqn))
      return pp->tp_rules[i].style == TP_SEQUENCE_PARALLEL && !pp->sequence_parallel
                 ? NULL
                 : &pp->tp_rules[i];
  return NULL;
}

/* Whether rule r splits its module's output features over tp (colwise, output Shard(-1)). */
static bool splits_output(const plan_tp_rule_t *r) {
  return r != NULL && r->style == TP_COLWISE &&
         (r->output == TP_LAYOUT_DEFAULT || r->output == TP_SHARD_LAST);
}

/* The projections a block combines (q, k and v by head; gate and up by feature) split alike:
 * one split and another whole would meet in the attention or the SwiGLU with other sizes. */
static fsdpc_status_t check_siblings(const llama_config_t *c, const parallel_plan_t *pp) {
  if (c == NULL || c->arch == LLAMA_ARCH_GPT2) return STATUS_OK; /* c_attn and c_fc: one each */
  static const char *const attn[] = {"q_proj", "k_proj", "v_proj"}, *const mlp[] = {"gate_proj",
                                                                                    "up_proj"};
  for (int64_t l = 0; l < c->n_layers; l++)
    for (int b = 0; b < 2; b++) {
      if (b == 1 && llama_layer_is_moe(c, l)) continue; /* its block runs whole */
      const char *const *names = b ? mlp : attn;
      int n = b ? 2 : 3;
      char block[64], fqn[96];
      snprintf(block, sizeof block, "model.layers.%lld.%s", (long long)l, b ? "mlp" : "self_attn");
      snprintf(fqn, sizeof fqn, "%s.%s", block, names[0]);
      const plan_tp_rule_t *first = rule_of(pp, fqn);
      for (int k = 1; k < n; k++) {
        snprintf(fqn, sizeof fqn, "%s.%s", block, names[k]);
        const plan_tp_rule_t *r = rule_of(pp, fqn);
        if (splits_output(r) == splits_output(first)) continue;
        const plan_tp_rule_t *split = splits_output(r) ? r : first;
        return err_set(STATUS_EINVAL,
                       "%s: parallelize.tensor_parallel.plan: %s's %s is split over tp (rule "
                       "'%s') and its %s is not (%s): %s must split their %s alike; give each "
                       "{style: colwise} (the built-in plan's)",
                       split->where.text, block, splits_output(r) ? names[k] : names[0],
                       split->pattern, splits_output(r) ? names[0] : names[k],
                       (splits_output(r) ? first : r) ? "its rule outputs whole" : "no rule",
                       b ? "gate_proj and up_proj" : "q_proj, k_proj and v_proj",
                       b ? "features" : "heads");
      }
    }
  return STATUS_OK;
}

fsdpc_status_t llama_plan_check(const llama_config_t *c, const parallel_plan_t *pp) {
  ARG_NONNULL(pp);
  if (pp->tp <= 1) return STATUS_OK;
  FSDPC_TRY(check_siblings(c, pp));
  for (int i = 0; i < pp->n_tp_rules; i++) {
    const plan_tp_rule_t *r = &pp->tp_rules[i];
    if (nn_fqn_match(r->pattern, "lm_head") && r->style == TP_COLWISE && r->output != TP_REPLICATE)
      return err_set(STATUS_EINVAL,
                     "%s: parallelize.tensor_parallel.plan.%s: the loss needs whole logits; "
                     "write {style: colwise, output: replicate}",
                     r->where.text, r->pattern);
  }
  return STATUS_OK;
}
