/*
 * Tensor parallelism: parallelize_module's styles on a 1-D `tp` mesh (docs/design.md, "Tensor
 * parallelism").
 *
 * A plan maps module FQN patterns to styles. Applying it splits the matched layers'
 * weights into DTensors on the tp mesh and wraps their forwards so that activations move
 * between layouts with the collective each conversion needs, backward running the
 * conjugate one:
 *
 *   style               weight (Linear | Embedding)  input -> output
 *   colwise             Shard(0) | Shard(1)          Replicate -> Shard(-1) (Linear);
 *                                                    ids -> the model layout (Embedding)
 *   rowwise             Shard(1) | Shard(0) (vocab)  Shard(-1) | ids -> Partial, reduced to
 *                                                    the model layout
 *   sequence_parallel   Replicate (RMSNorm,          Shard(1) -> Shard(1); the weight's
 *                       LayerNorm)                   (and bias's) gradient is summed over tp
 *   prepare_input       -                            the model layout -> Replicate, once for
 *                                                    every colwise child (which alone may
 *                                                    read the block's input: a residual
 *                                                    inside the block would have its
 *                                                    gradient summed over tp too)
 *   headwise            Replicate (RMSNorm,          this rank's heads, as they come (a norm
 *                       LayerNorm)                   of each head: Qwen3's q_norm, k_norm);
 *                                                    the weight's gradient is summed over tp
 *
 * A Conv1D (kind "conv1d": transformers' y = x W + b, W [in, out]) splits as a Linear does, on
 * the other dimension: colwise Shard(1), rowwise Shard(0). A fused one stored [in, k, out / k]
 * (GPT-2's c_attn: q, k and v) splits colwise on its last dimension, each rank taking its heads
 * of all k parts.
 *
 * The model layout is Replicate, or Shard(1) (the sequence) under sequence parallelism,
 * where sequence_parallel norms run on sequence shards; without it they are left alone.
 * A linear layer's bias (parameter "bias") is split with its output features under colwise
 * and added once, after the reduction, under rowwise. The style reads what a module is from
 * its declared kind (nn_module_kind), never from its name.
 *
 *   conversion          forward          backward
 *   Replicate->Rep.     none             all-reduce      (colwise or prepare_input input)
 *   Shard(1)->Rep.      all-gather       reduce-scatter
 *   Replicate->Shard(1) local chunk      all-gather
 *   Shard(-1)->Rep.     all-gather       local chunk     (a colwise output made whole)
 *   Partial->Rep.       all-reduce       none            (rowwise output)
 *   Partial->Shard(1)   reduce-scatter   all-gather      (rowwise output under sequence
 *                                                         parallelism)
 *
 * An activation carries the layout its last conversion gave it (nn_var_t.layout), so a
 * colwise layer after prepare_input does not reduce again. Attention derives its local head
 * count from the local projection shapes. Every other parameter becomes Replicate on the tp
 * mesh, so after tensor_parallel all parameters live on it, and fully_shard over the
 * data-parallel mesh then places them on (dp..., tp).
 *
 *   tp_rule_t rules[] = {{"model.layers.*.self_attn.q_proj", TP_COLWISE}, ...};
 *   tp_plan_t *tp;
 *   FSDPC_TRY(tensor_parallel(llama_module(m), tp_mesh, rules, n, true, &tp));
 *   ... fully_shard, train ...
 *   tp_free(tp);                            // after the model
 *
 * Sizes must divide evenly: a split weight dimension, and the sequence under sequence
 * parallelism (errors name the module).
 */
#ifndef FSDPC_PARALLEL_TENSOR_PARALLEL_H
#define FSDPC_PARALLEL_TENSOR_PARALLEL_H

#include "mesh/mesh.h"
#include "nn/autograd.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef enum tp_style {
  TP_COLWISE = 0,
  TP_ROWWISE,
  TP_SEQUENCE_PARALLEL,
  TP_PREPARE_INPUT,
  TP_HEADWISE,
  TP_STYLE_COUNT
} tp_style_t;

/* Activation layouts on the tp mesh (the values of nn_var_t.layout). */
typedef enum tp_layout {
  TP_LAYOUT_DEFAULT = 0, /* in a rule: the style's default; on a variable: none recorded */
  TP_REPLICATE,          /* whole on every rank */
  TP_SHARD_SEQ,          /* Shard(1): the sequence split */
  TP_SHARD_LAST,         /* Shard(-1): the features split */
  TP_REPLICATE_REDUCED,  /* whole, and its backward reduces the consumers' partial gradients */
  TP_LAYOUT_COUNT
} tp_layout_t;

typedef struct tp_rule {
  const char *pattern; /* module FQN glob (nn_fqn_match) */
  tp_style_t style;
  tp_layout_t input, output; /* TP_LAYOUT_DEFAULT: the style's */
} tp_rule_t;

typedef struct tp_plan tp_plan_t;

/* "colwise" ... into the style; false when unknown. */
bool tp_style_parse(const char *name, tp_style_t *out);
const char *tp_style_name(tp_style_t s);
/* "replicate", "shard(1)", "shard(-1)" into a layout; false when unknown. */
bool tp_layout_parse(const char *name, tp_layout_t *out);
const char *tp_layout_name(tp_layout_t l);

/* The placement on tp of parameter param ("weight" or "bias", of ndim dimensions) of a layer of
 * kind ("linear", "conv1d", "embedding", "rmsnorm", "layernorm", NULL for a container) under
 * style: weights Shard(0) / Shard(1) as the table above (a conv1d's fused [in, k, out / k]
 * colwise on its last dimension, so each of its k parts splits alike); a colwise bias on its
 * last dimension (it follows the output features), a rowwise one Replicate (added once, to the
 * reduced output); Replicate for norms (sequence_parallel, headwise) and prepare_input. Errors
 * when the style does not apply to the kind or the number of dimensions. */
fsdpc_status_t tp_param_placement(tp_style_t style, const char *kind, const char *param, int ndim,
                                  placement_t *out);

/* The rule a module of this FQN takes: the index of the first rule whose pattern matches, or
 * -1. A matched rule changes the module only when tp_rule_applies (sequence_parallel rules
 * need sequence parallelism). */
int tp_rule_index(const tp_rule_t *rules, int n, const char *fqn);
bool tp_rule_applies(const tp_rule_t *rule, bool sequence_parallel);

/* Applies the rules (first match wins for a module) to the tree under root, whose
 * parameters must all be whole (Replicate on a one-rank mesh) and the same on every rank.
 * mesh is 1-D. Every pattern must match a module of a kind its style handles; a declared
 * input or output layout no conversion reaches is refused here. The plan keeps the mesh
 * (mesh_retain) until tp_free for the forwards that move activations on it; the parameters
 * placed on it need it as long as they live, as every DTensor does (fully_shard keeps the
 * mesh it places them on). Local: no communication. */
fsdpc_status_t tensor_parallel(nn_module_t *root, mesh_t *mesh, const tp_rule_t *rules, int n,
                               bool sequence_parallel, tp_plan_t **out);

/* Frees the plan's state; call after the last forward or backward (NULL: no-op). */
void tp_free(tp_plan_t *tp);

/* The number of modules the plan applies a style to. */
int tp_num_modules(const tp_plan_t *tp);

/* The dtype of the gradient reductions of the styled modules at or under `under` (NULL: every
 * one) that have none yet: the backward all-reduces and reduce-scatters of the conversions
 * (a colwise or prepare_input input's gradient, a sequence shard's) and the summed gradients
 * of sequence_parallel and headwise norms (and a rowwise bias under sequence parallelism).
 * Each such gradient is cast to dt, reduced, and cast back to its own dtype; without a call, it
 * is reduced in its own dtype (the compute dtype). Forward reductions (a rowwise output's)
 * stay in the activations' dtype. Call it as fully_shard is called, inner units first, with
 * each unit's reduce dtype: a module keeps the first dtype that reaches it, its innermost
 * unit's. fsdp-train (parallel_apply) does so with mp_policy.reduce_dtype. Local. */
fsdpc_status_t tp_set_reduce_dtype(tp_plan_t *tp, const nn_module_t *under, dtype_t dt);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
