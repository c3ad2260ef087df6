/* Tensor-parallel styles and layouts by name, the rule a module matches, and where each style
 * puts a layer's parameters: the declarative half of tensor_parallel (tensor_parallel.c
 * applies it to a model). */
#include <string.h>

#include "core/args_impl.h"
#include "parallel/tensor_parallel.h"

/* ---- names ---- */

static const char *const style_names[TP_STYLE_COUNT] = {"colwise", "rowwise", "sequence_parallel",
                                                        "prepare_input", "headwise"};
static const char *const layout_names[TP_LAYOUT_COUNT] = {"default", "replicate", "shard(1)",
                                                          "shard(-1)", "replicate"};

bool tp_style_parse(const char *name, tp_style_t *out) {
  if (name == NULL || out == NULL) return false;
  for (int i = 0; i < TP_STYLE_COUNT; i++)
    if (strcmp(name, style_names[i]) == 0) {
      *out = (tp_style_t)i;
      return true;
    }
  return false;
}

const char *tp_style_name(tp_style_t s) {
  return s >= 0 && s < TP_STYLE_COUNT ? style_names[s] : "?";
}

bool tp_layout_parse(const char *name, tp_layout_t *out) {
  if (name == NULL || out == NULL) return false;
  for (int i = TP_REPLICATE; i <= TP_SHARD_LAST; i++)
    if (strcmp(name, layout_names[i]) == 0) {
      *out = (tp_layout_t)i;
      return true;
    }
  return false;
}

const char *tp_layout_name(tp_layout_t l) {
  return l >= 0 && l < TP_LAYOUT_COUNT ? layout_names[l] : "?";
}

int tp_rule_index(const tp_rule_t *rules, int n, const char *fqn) {
  if (rules == NULL || fqn == NULL) return -1;
  for (int i = 0; i < n; i++)
    if (nn_fqn_match(rules[i].pattern, fqn)) return i;
  return -1;
}

bool tp_rule_applies(const tp_rule_t *rule, bool sequence_parallel) {
  if (rule == NULL) return false;
  return rule->style != TP_SEQUENCE_PARALLEL || sequence_parallel; /* else norms stay whole */
}

static bool is_norm(const char *kind) {
  return kind && (strcmp(kind, "rmsnorm") == 0 || strcmp(kind, "layernorm") == 0);
}

fsdpc_status_t tp_param_placement(tp_style_t style, const char *kind, const char *param, int ndim,
                                  placement_t *out) {
  ARG_NONNULL(param);
  ARG_NONNULL(out);
  bool linear = kind && strcmp(kind, "linear") == 0, emb = kind && strcmp(kind, "embedding") == 0;
  bool conv1d = kind && strcmp(kind, "conv1d") == 0; /* weight [in, out]: an embedding's sides */
  bool bias = param && strcmp(param, "bias") == 0;
  *out = placement_replicate();
  switch (style) {
    case TP_COLWISE:
    case TP_ROWWISE:
      if (!linear && !emb && !conv1d)
        return err_set(STATUS_EINVAL,
                       "%s applies to linear, conv1d and embedding layers, not to a module "
                       "of kind '%s'",
                       tp_style_name(style), kind ? kind : "container");
      if (bias && emb)
        return err_set(STATUS_EINVAL, "%s: an embedding with a bias is not supported",
                       tp_style_name(style));
      if (ndim < 1 || (!bias && ndim < 2) || (!conv1d && ndim > (bias ? 1 : 2)))
        return err_set(STATUS_ESHAPE, "%s: a %s %s of %d dimensions is not supported",
                       tp_style_name(style), kind, bias ? "bias" : "weight", ndim);
      /* a colwise bias follows the output features (the last dimension: a conv1d's fused
       * [k, out / k] too); a rowwise one is added whole */
      if (bias) *out = style == TP_COLWISE ? placement_shard(ndim - 1) : placement_replicate();
      /* weights: a linear's [out, in], an embedding's [vocab, dim], a conv1d's [in, out...]
       * (its output features last) */
      if (!bias && style == TP_COLWISE) *out = placement_shard(linear ? 0 : ndim - 1);
      if (!bias && style == TP_ROWWISE) *out = placement_shard(linear ? 1 : 0);
      return STATUS_OK;
    case TP_SEQUENCE_PARALLEL:
    case TP_HEADWISE:
      if (!is_norm(kind))
        return err_set(STATUS_EINVAL, "%s applies to norms, not to a module of kind '%s'",
                       tp_style_name(style), kind ? kind : "container");
      return STATUS_OK;
    case TP_PREPARE_INPUT: return STATUS_OK;
    default: return err_set(STATUS_EINVAL, "unknown style");
  }
}
