/*
 * The built-in Llama's parallelism: TorchTitan's tensor-parallel plan for its module names,
 * which fsdp-train uses when a plan gives no rules, and the checks a plan must pass for it.
 *
 *   parallel_plan_t *pp = &plan.par;
 *   if (!pp->tp_plan_given) FSDPC_TRY(llama_plan_fill_tp_rules(&plan.model, pp));
 *   FSDPC_TRY(llama_plan_check(&plan.model, pp));
 */
#ifndef FSDPC_PARALLEL_LLAMA_PLAN_H
#define FSDPC_PARALLEL_LLAMA_PLAN_H

#include "models/llama/llama.h"
#include "parallel/parallel_plan.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* The built-in rules of the model of c (NULL: Llama's): attention and MLP inputs split by
 * column and outputs by row, the vocabulary split in the embedding and lm_head, whose output
 * is made whole for the loss; norms on sequence shards under sequence parallelism; with
 * Qwen3's q_norm and k_norm, those headwise; a mixture of experts' block (Qwen3-MoE's mlp,
 * Mixtral's block_sparse_moe) on the tokens as they come, the dense MLP's rules only where a
 * layer is dense; GPT-2's by its names (both embeddings by rows, c_attn by head). Returns
 * their number; *rules stays valid until this thread's next call. */
int llama_plan_tp_rules(const llama_config_t *c, const tp_rule_t **rules);

/* Puts the built-in rules of c's model into pp (tp_plan_given stays false). */
fsdpc_status_t llama_plan_fill_tp_rules(const llama_config_t *c, parallel_plan_t *pp);

/* True when pp's rules are the built-in ones of c's model (not given, or written out in the
 * same order). */
bool llama_plan_tp_is_builtin(const llama_config_t *c, const parallel_plan_t *pp);

/* What training the model of c (NULL: the checks of any) needs of a plan: with tp > 1 the
 * loss reads whole logits, so a colwise lm_head must output replicate; the projections a block
 * combines split alike (q_proj, k_proj and v_proj by head, gate_proj and up_proj by feature).
 * Errors name the rule's place. */
fsdpc_status_t llama_plan_check(const llama_config_t *c, const parallel_plan_t *pp);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
