#include "models/llama/llama_plan.h"

#include <stdio.h>
#include <string.h>

#include "core/args_impl.h"
#include "nn/module.h"

/* The Llama plan of TorchTitan, by the module names of models/llama/llama.c; with Qwen3's
 * q_norm and k_norm the two rules at the end too. */
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
    {"model.layers.*.self_attn.q_norm", TP_HEADWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
    {"model.layers.*.self_attn.k_norm", TP_HEADWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
};

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
  *rules = llama_plan;
  return (int)(sizeof llama_plan / sizeof llama_plan[0]) - (c && c->qk_norm ? 0 : 2);
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
  for (int i = 0; i < n; i++) {
    const plan_tp_rule_t *r = &pp->tp_rules[i];
    if (strcmp(r->pattern, d[i].pattern) != 0 || r->style != d[i].style || r->input != d[i].input ||
        r->output != d[i].output)
      return false;
  }
  return true;
}

fsdpc_status_t llama_plan_check(const parallel_plan_t *pp) {
  ARG_NONNULL(pp);
  if (pp->tp <= 1) return STATUS_OK;
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
