/* The Llama's configuration: checks, parameter count, and Hugging Face config.json read and
 * written (RoPE scaling included). */
#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/file.h"
#include "models/llama/llama.h"

static const struct {
  const char *model_type, *hf_class;
} arch_names[LLAMA_ARCH_COUNT] = {
    {"llama", "LlamaForCausalLM"},        {"qwen2", "Qwen2ForCausalLM"},
    {"qwen3", "Qwen3ForCausalLM"},        {"gpt2", "GPT2LMHeadModel"},
    {"qwen3_moe", "Qwen3MoeForCausalLM"}, {"mixtral", "MixtralForCausalLM"},
    {"qwen2_moe", "Qwen2MoeForCausalLM"}};

const char *llama_arch_name(llama_arch_t arch) {
  return arch >= 0 && arch < LLAMA_ARCH_COUNT ? arch_names[arch].model_type : "?";
}

bool llama_arch_from_name(const char *model_type, llama_arch_t *out) {
  for (int a = 0; model_type && a < LLAMA_ARCH_COUNT; a++)
    if (strcmp(model_type, arch_names[a].model_type) == 0) {
      if (out) *out = (llama_arch_t)a;
      return true;
    }
  return false;
}

int64_t llama_vocab_rows(const llama_config_t *c) {
  if (c == NULL) return 0;
  int64_t m = c->pad_vocab_multiple > 1 ? c->pad_vocab_multiple : 1;
  return (c->vocab_size + m - 1) / m * m;
}

bool llama_is_vocab_table(const char *fqn) {
  if (fqn == NULL) return false;
  static const char *const names[] = {"model.embed_tokens.weight", "transformer.wte.weight",
                                      "lm_head.weight"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcmp(fqn, names[i]) == 0) return true;
  return false;
}

bool llama_layer_is_moe(const llama_config_t *c, int64_t i) {
  if (c == NULL || i < 0 || i >= c->n_layers || c->n_experts <= 0 || c->sparse_step <= 0)
    return false;
  if (i < LLAMA_MAX_MLP_ONLY && (c->mlp_only[i / 64] >> (i % 64) & 1)) return false;
  return (i + 1) % c->sparse_step == 0;
}

int64_t llama_num_moe_layers(const llama_config_t *c) {
  int64_t n = 0;
  for (int64_t i = 0; c != NULL && i < c->n_layers; i++) n += llama_layer_is_moe(c, i);
  return n;
}

int64_t llama_head_dim(const llama_config_t *c) {
  if (c == NULL) return 0;
  return c->head_dim > 0 ? c->head_dim : c->n_heads > 0 ? c->dim / c->n_heads : 0;
}

/* The mixture-of-experts keys: only qwen3_moe, mixtral and qwen2_moe have experts (mixtral's
 * in every layer, renormalised), and only qwen2_moe a shared expert (its own, of a positive
 * size); top-k from 1 to the experts. */
static fsdpc_status_t check_experts(const llama_config_t *c) {
  bool qwen2_moe = c->arch == LLAMA_ARCH_QWEN2_MOE;
  if (qwen2_moe ? c->shared_ffn_dim < 1 || c->shared_ffn_dim > ((int64_t)1 << 31)
                : c->shared_ffn_dim != 0)
    return err_set(
        STATUS_EINVAL,
        "model config: %s (shared_expert_intermediate_size is qwen2_moe's, a size "
        "from 1 to 2^31), got %lld",
        qwen2_moe ? "qwen2_moe has a shared expert" : "only qwen2_moe has a shared expert",
        (long long)c->shared_ffn_dim);
  if (c->arch != LLAMA_ARCH_QWEN3_MOE && c->arch != LLAMA_ARCH_MIXTRAL && !qwen2_moe) {
    if (c->n_experts != 0)
      return err_set(STATUS_EINVAL,
                     "model config: %s has no experts (num_experts is qwen3_moe's, mixtral's and "
                     "qwen2_moe's)",
                     llama_arch_name(c->arch));
    return STATUS_OK;
  }
  if (c->arch == LLAMA_ARCH_MIXTRAL) {
    bool only = false;
    for (int i = 0; i < 4; i++) only |= c->mlp_only[i] != 0;
    if (c->n_experts < 1 || c->sparse_step != 1 || only || !c->norm_topk ||
        c->moe_ffn_dim != c->ffn_dim)
      return err_set(STATUS_EINVAL,
                     "model config: mixtral has experts in every layer, their weights "
                     "renormalised (num_local_experts at least 1, no dense layers), each of "
                     "intermediate_size");
  }
  /* the MoE block's limits (nn_moe_new), said here with the config's keys */
  if (c->n_experts < 0 || c->n_experts > 4096)
    return err_set(STATUS_EINVAL, "model config: num_experts must be from 0 to 4096, got %lld",
                   (long long)c->n_experts);
  if (c->n_experts == 0) return STATUS_OK;
  if (c->top_k < 1 || c->top_k > c->n_experts || c->top_k > 64)
    return err_set(STATUS_EINVAL,
                   "model config: num_experts_per_tok must be from 1 to num_experts (%lld) and "
                   "at most 64, got %lld",
                   (long long)c->n_experts, (long long)c->top_k);
  if (c->moe_ffn_dim <= 0 || c->moe_ffn_dim > ((int64_t)1 << 31))
    return err_set(STATUS_EINVAL,
                   "model config: moe_intermediate_size must be a size from 1 to 2^31, got %lld",
                   (long long)c->moe_ffn_dim);
  if (!(c->aux_loss_coef >= 0) || c->aux_loss_coef > 1e6)
    return err_set(STATUS_EINVAL, "model config: router_aux_loss_coef must be from 0 to 1e6");
  if (c->sparse_step < 1 || c->sparse_step > 4096)
    return err_set(STATUS_EINVAL,
                   "model config: decoder_sparse_step must be from 1 to 4096, got %lld",
                   (long long)c->sparse_step);
  return STATUS_OK;
}

fsdpc_status_t llama_config_check(const llama_config_t *c) {
  ARG_NONNULL(c);
  if (c->arch < 0 || c->arch >= LLAMA_ARCH_COUNT)
    return err_set(STATUS_EINVAL, "model config: unknown architecture %d", (int)c->arch);
  /* the limits of a plan's model: keys (train/plan.c), whichever way a config arrives */
  const int64_t big = (int64_t)1 << 31;
  const struct {
    const char *name;
    int64_t v, max;
  } pos[] = {{"hidden_size", c->dim, big},
             {"num_hidden_layers", c->n_layers, 4096},
             {"num_attention_heads", c->n_heads, 65536},
             {"num_key_value_heads", c->n_kv_heads, 65536},
             {"intermediate_size", c->ffn_dim, big},
             {"vocab_size", c->vocab_size, big},
             {"max_position_embeddings", c->max_seq_len, big}};
  for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
    if (pos[i].v <= 0 || pos[i].v > pos[i].max)
      return err_set(STATUS_EINVAL, "model config: %s must be a size from 1 to %lld, got %lld",
                     pos[i].name, (long long)pos[i].max, (long long)pos[i].v);
  if (c->pad_vocab_multiple < 0 || c->pad_vocab_multiple > 65536)
    return err_set(STATUS_EINVAL,
                   "model config: pad_vocab_multiple must be from 0 (no padding) to 65536, got "
                   "%lld",
                   (long long)c->pad_vocab_multiple);
  if (c->head_dim < 0 || c->head_dim > 65536 || c->head_dim % 2 != 0)
    return err_set(STATUS_EINVAL,
                   "model config: head_dim must be an even size up to 65536, got %lld",
                   (long long)c->head_dim);
  if (c->head_dim == 0 && (c->dim % c->n_heads != 0 || (c->dim / c->n_heads) % 2 != 0))
    return err_set(STATUS_EINVAL,
                   c->arch == LLAMA_ARCH_GPT2
                       ? "model config: n_embd %lld must be n_head %lld times an even head size "
                         "(GPT-2's heads are n_embd / n_head; odd sizes are not supported here)"
                       : "model config: hidden_size %lld must be num_attention_heads %lld times "
                         "an even head size (or give head_dim)",
                   (long long)c->dim, (long long)c->n_heads);
  bool qwen2 = c->arch == LLAMA_ARCH_QWEN2 || c->arch == LLAMA_ARCH_QWEN2_MOE,
       gpt2 = c->arch == LLAMA_ARCH_GPT2;
  if (gpt2 && c->n_kv_heads != c->n_heads)
    return err_set(STATUS_EINVAL,
                   "model config: gpt2 has as many key/value heads as heads: n_kv_heads %lld "
                   "differs from n_heads %lld (leave n_kv_heads out)",
                   (long long)c->n_kv_heads, (long long)c->n_heads);
  if (gpt2 && c->head_dim != 0)
    return err_set(STATUS_EINVAL,
                   "model config: gpt2's heads are dim / n_heads: head_dim %lld is not for it "
                   "(leave head_dim out)",
                   (long long)c->head_dim);
  if (gpt2 && (c->qkv_bias || c->o_bias))
    return err_set(STATUS_EINVAL,
                   "model config: gpt2 has biases of its own on every projection: "
                   "attention_bias is not for it (leave it out)");
  if (c->arch == LLAMA_ARCH_MIXTRAL && (c->qkv_bias || c->o_bias))
    return err_set(STATUS_EINVAL, "model config: mixtral's attention has no biases");
  /* Qwen2's q, k and v biases; Qwen2-MoE's too unless its qkv_bias says otherwise */
  bool qkv_only = qwen2 && (c->qkv_bias || c->arch == LLAMA_ARCH_QWEN2_MOE);
  if (!gpt2 && (qwen2 ? !qkv_only || c->o_bias : c->qkv_bias != c->o_bias))
    return err_set(STATUS_EINVAL,
                   "model config: %s has %s (attention biases as Hugging Face's architecture has "
                   "them)",
                   llama_arch_name(c->arch),
                   qwen2 ? "biases on q_proj, k_proj and v_proj only"
                         : "biases on all four attention projections or none");
  bool qwen3 = c->arch == LLAMA_ARCH_QWEN3 || c->arch == LLAMA_ARCH_QWEN3_MOE;
  if (c->qk_norm != qwen3)
    return err_set(STATUS_EINVAL,
                   "model config: q_norm and k_norm are Qwen3's (and Qwen3-MoE's), and it has "
                   "them");
  FSDPC_TRY(check_experts(c));
  if (!(c->init_std >= 0) || c->init_std > 1e3)
    return err_set(STATUS_EINVAL, "model config: initializer_range must be from 0 to 1000");
  if (c->n_heads % c->n_kv_heads != 0)
    return err_set(STATUS_EINVAL,
                   "model config: num_attention_heads %lld is not a multiple of "
                   "num_key_value_heads %lld",
                   (long long)c->n_heads, (long long)c->n_kv_heads);
  if (!(c->norm_eps > 0 && c->norm_eps <= 1)) /* a larger one all but zeroes the norms' output */
    return err_set(STATUS_EINVAL, "model config: %s must be in (0, 1], got %g",
                   c->arch == LLAMA_ARCH_GPT2 ? "layer_norm_epsilon" : "rms_norm_eps", c->norm_eps);
  if (rope_check(&c->rope) != STATUS_OK) return err_prefix(STATUS_EINVAL, "model config");
  /* each size within its limit, a product of them may still be more than a tensor holds */
  double D = (double)c->dim, hd = (double)llama_head_dim(c);
  const struct {
    const char *what;
    double numel;
  } big_ones[] = {
      {"q_proj (num_attention_heads x head_dim x hidden_size)", (double)c->n_heads * hd * D},
      {"the embedding (vocab_size x hidden_size)", (double)llama_vocab_rows(c) * D},
      {"the MLP's (intermediate_size x hidden_size)", (double)c->ffn_dim * D},
      {"the experts' (num_experts x moe_intermediate_size x hidden_size)",
       (double)c->n_experts * (double)c->moe_ffn_dim * D}};
  for (size_t i = 0; i < sizeof big_ones / sizeof big_ones[0]; i++)
    if (big_ones[i].numel > (double)((int64_t)1 << 59))
      return err_set(STATUS_EINVAL,
                     "model config: %s would hold %.3g elements, more than a tensor holds "
                     "(2^59)",
                     big_ones[i].what, big_ones[i].numel);
  return STATUS_OK;
}

bool llama_config_same_params(const llama_config_t *a, const llama_config_t *b, char *why,
                              size_t size) {
  if (a == NULL || b == NULL) return 0;
  const struct {
    const char *name;
    int64_t x, y;
  } f[] = {{"architecture", a->arch, b->arch},
           {"dim", a->dim, b->dim},
           {"n_layers", a->n_layers, b->n_layers},
           {"n_heads", a->n_heads, b->n_heads},
           {"n_kv_heads", a->n_kv_heads, b->n_kv_heads},
           {"ffn_dim", a->ffn_dim, b->ffn_dim},
           {"vocab_size", a->vocab_size, b->vocab_size},
           {"tie_embeddings", a->tie_embeddings, b->tie_embeddings},
           {"head_dim", llama_head_dim(a), llama_head_dim(b)},
           {"qkv_bias", a->qkv_bias, b->qkv_bias},
           {"o_bias", a->o_bias, b->o_bias},
           {"qk_norm", a->qk_norm, b->qk_norm},
           {"n_experts", a->n_experts, b->n_experts},
           {"moe_ffn_dim", a->moe_ffn_dim, b->moe_ffn_dim},
           {"shared_ffn_dim", a->shared_ffn_dim, b->shared_ffn_dim}};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
    if (f[i].x != f[i].y) {
      if (why && i == 0)
        snprintf(why, size, "architecture %s vs %s", llama_arch_name(a->arch),
                 llama_arch_name(b->arch));
      else if (why)
        snprintf(why, size, "%s %lld vs %lld", f[i].name, (long long)f[i].x, (long long)f[i].y);
      return false;
    }
  for (int64_t i = 0; i < a->n_layers; i++)
    if (llama_layer_is_moe(a, i) != llama_layer_is_moe(b, i)) {
      if (why)
        snprintf(why, size, "layer %lld's MLP %s vs %s", (long long)i,
                 llama_layer_is_moe(a, i) ? "sparse" : "dense",
                 llama_layer_is_moe(b, i) ? "sparse" : "dense");
      return false;
    }
  return true;
}

void llama_config_number(double x, char *buf, size_t n) {
  if (buf == NULL || n == 0) return;
  if (x == floor(x) && fabs(x) < 1e15) {
    snprintf(buf, n, "%.0f", x);
    return;
  }
  for (int prec = 1; prec <= 17; prec++) {
    snprintf(buf, n, "%.*g", prec, x);
    if (strtod(buf, NULL) == x) return;
  }
}

/* transformers' rope_type of each rope_scaling_t */
static const char *const rope_type_names[] = {
    [ROPE_DEFAULT] = "default", [ROPE_LINEAR] = "linear", [ROPE_LLAMA3] = "llama3"};
#define N_ROPE_TYPES (sizeof rope_type_names / sizeof rope_type_names[0])

bool llama_config_same_function(const llama_config_t *a, const llama_config_t *b, char *why,
                                size_t size) {
  if (a == NULL || b == NULL) return false;
  bool moe = a->n_experts > 0 || b->n_experts > 0;
  const struct {
    const char *name;
    double x, y;
  } f[] = {{"rope_theta", a->rope.theta, b->rope.theta},
           {"rope_scaling (rope_type)", (double)a->rope.scaling, (double)b->rope.scaling},
           {"rope_scaling (factor)", a->rope.factor, b->rope.factor},
           {"rope_scaling (low_freq_factor)", a->rope.low_freq_factor, b->rope.low_freq_factor},
           {"rope_scaling (high_freq_factor)", a->rope.high_freq_factor, b->rope.high_freq_factor},
           {"rope_scaling (original_max_position_embeddings)", a->rope.original_max_pos,
            b->rope.original_max_pos},
           {a->arch == LLAMA_ARCH_GPT2 ? "layer_norm_epsilon" : "rms_norm_eps", a->norm_eps,
            b->norm_eps},
           {"num_experts_per_tok", moe ? (double)a->top_k : 0, moe ? (double)b->top_k : 0},
           {"norm_topk_prob", moe && a->norm_topk, moe && b->norm_topk}};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
    double x = f[i].x, y = f[i].y;
    if (x == y || fabs(x - y) <= 1e-12 * fabs(y)) continue; /* a JSON round trip of a double */
    if (why) {
      char sx[32], sy[32];
      bool flag = strcmp(f[i].name, "norm_topk_prob") == 0;
      llama_config_number(x, sx, sizeof sx);
      llama_config_number(y, sy, sizeof sy);
      if (flag) {
        snprintf(sx, sizeof sx, "%s", x ? "true" : "false");
        snprintf(sy, sizeof sy, "%s", y ? "true" : "false");
      }
      if (strcmp(f[i].name, "rope_scaling (rope_type)") == 0 && x >= 0 && x < N_ROPE_TYPES &&
          y >= 0 && y < N_ROPE_TYPES) {
        snprintf(sx, sizeof sx, "%s", rope_type_names[(int)x]);
        snprintf(sy, sizeof sy, "%s", rope_type_names[(int)y]);
      }
      snprintf(why, size, "%s %s vs %s", f[i].name, sx, sy);
    }
    return false;
  }
  return true;
}

int64_t llama_num_params(const llama_config_t *c) {
  if (c == NULL) return 0;
  if (c->arch == LLAMA_ARCH_GPT2) { /* LayerNorms and projections with biases; positions */
    int64_t D = c->dim, F = c->ffn_dim;
    int64_t layer = 4 * D + 3 * D * D + 3 * D + D * D + D + 2 * D * F + F + D;
    return llama_vocab_rows(c) * D * (c->tie_embeddings ? 1 : 2) + c->max_seq_len * D +
           c->n_layers * layer + 2 * D;
  }
  int64_t hd = llama_head_dim(c), q = c->n_heads * hd, kv = c->n_kv_heads * hd;
  int64_t layer = 2 * c->dim + 2 * q * c->dim + 2 * kv * c->dim;
  layer += (c->qkv_bias ? q + 2 * kv : 0) + (c->o_bias ? c->dim : 0) + (c->qk_norm ? 2 * hd : 0);
  /* the router [E, dim] and the stacked experts, 3 [E, moe_ffn, dim]; a shared expert's
   * three [shared_ffn, dim] and its gate [1, dim] */
  int64_t sparse = llama_num_moe_layers(c);
  int64_t shared = c->shared_ffn_dim > 0 ? 3 * c->shared_ffn_dim * c->dim + c->dim : 0;
  int64_t mlps =
      (c->n_layers - sparse) * 3 * c->dim * c->ffn_dim +
      sparse * (c->n_experts * c->dim + 3 * c->n_experts * c->moe_ffn_dim * c->dim + shared);
  return llama_vocab_rows(c) * c->dim * (c->tie_embeddings ? 1 : 2) + c->n_layers * layer + mlps +
         c->dim;
}

/* Reads an optional integer key; errors name the file and the key. */
static fsdpc_status_t json_int(const char *path, const cJSON *o, const char *key, int64_t *v) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  if (it == NULL || cJSON_IsNull(it)) return STATUS_OK;
  if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) ||
      it->valuedouble != floor(it->valuedouble) || fabs(it->valuedouble) > 9e18)
    return err_set(STATUS_EFORMAT, "%s: '%s' must be an integer", path, key);
  *v = (int64_t)it->valuedouble;
  return STATUS_OK;
}

static fsdpc_status_t json_num(const char *path, const cJSON *o, const char *key, double *v) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  if (it == NULL || cJSON_IsNull(it)) return STATUS_OK;
  if (!cJSON_IsNumber(it)) return err_set(STATUS_EFORMAT, "%s: '%s' must be a number", path, key);
  if (!isfinite(it->valuedouble)) /* 1e400 reads as infinity */
    return err_set(STATUS_EFORMAT, "%s: '%s' must be a finite number", path, key);
  *v = it->valuedouble;
  return STATUS_OK;
}

/* Reads an optional true/false key. */
static fsdpc_status_t json_bool(const char *path, const cJSON *o, const char *key, bool *v) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  if (it == NULL || cJSON_IsNull(it)) return STATUS_OK;
  if (!cJSON_IsBool(it))
    return err_set(STATUS_EFORMAT, "%s: '%s' must be true or false", path, key);
  *v = cJSON_IsTrue(it);
  return STATUS_OK;
}

static fsdpc_status_t json_refuse(const char *path, const cJSON *o, const char *key,
                                  const char *why) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  if (it == NULL || cJSON_IsNull(it) || cJSON_IsFalse(it)) return STATUS_OK;
  return err_set(STATUS_EUNSUPPORTED, "%s: '%s' is set, but %s", path, key, why);
}

/* A number in a rope section; required ones missing are an error naming the key. */
static fsdpc_status_t rope_num(const char *path, const char *section, const cJSON *r,
                               const char *key, double *v) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(r, key);
  if (it == NULL || cJSON_IsNull(it))
    return err_set(STATUS_EFORMAT, "%s: '%s' has no '%s'", path, section, key);
  if (!cJSON_IsNumber(it))
    return err_set(STATUS_EFORMAT, "%s: '%s.%s' must be a number", path, section, key);
  *v = it->valuedouble;
  return STATUS_OK;
}

/* The rotary embedding: transformers 4 writes rope_theta at the top level and rope_scaling
 * {rope_type (or type), factor, ...} for the scaled variants; transformers 5 writes
 * rope_parameters {rope_theta, rope_type, ...}. The default, linear and llama3 types are
 * implemented; any other is refused, naming the key, rather than read as one of them. */
static fsdpc_status_t parse_rope(const char *path, const cJSON *o, rope_t *rope) {
  const cJSON *given = cJSON_GetObjectItemCaseSensitive(o, "rope_theta");
  bool top_given = given != NULL && !cJSON_IsNull(given);
  double top = rope->theta;
  FSDPC_TRY(json_num(path, o, "rope_theta", &top));
  rope->theta = top;
  static const char *const keys[] = {"rope_scaling", "rope_parameters"};
  const char *typed = NULL; /* the section that set the type */
  for (int k = 0; k < 2; k++) {
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(o, keys[k]);
    if (r == NULL || cJSON_IsNull(r) || cJSON_IsFalse(r)) continue;
    if (!cJSON_IsObject(r))
      return err_set(STATUS_EFORMAT, "%s: '%s' must be an object", path, keys[k]);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(r, "rope_type");
    const char *tkey = "rope_type";
    if (t == NULL) { /* the older spelling */
      t = cJSON_GetObjectItemCaseSensitive(r, "type");
      tkey = "type";
    }
    if (!cJSON_IsString(t))
      return err_set(STATUS_EUNSUPPORTED,
                     "%s: '%s' has no rope_type: its rotary embedding is unknown", path, keys[k]);
    size_t i = 0;
    while (i < N_ROPE_TYPES && strcmp(t->valuestring, rope_type_names[i]) != 0) i++;
    if (i == N_ROPE_TYPES)
      return err_set(STATUS_EUNSUPPORTED,
                     "%s: '%s.%s' is '%s': the rotary embeddings implemented are default, linear "
                     "and llama3 (no dynamic, yarn or longrope scaling)",
                     path, keys[k], tkey, t->valuestring);
    if (typed != NULL && (rope_scaling_t)i != rope->scaling)
      return err_set(STATUS_EFORMAT, "%s: '%s' and '%s' give different rope types", path, typed,
                     keys[k]);
    const char *first = typed; /* the other section, when both give the scaling */
    const rope_t was = *rope;
    typed = keys[k];
    rope->scaling = (rope_scaling_t)i;
    if (rope->scaling != ROPE_DEFAULT)
      FSDPC_TRY(rope_num(path, keys[k], r, "factor", &rope->factor));
    if (rope->scaling == ROPE_LLAMA3) {
      FSDPC_TRY(rope_num(path, keys[k], r, "low_freq_factor", &rope->low_freq_factor));
      FSDPC_TRY(rope_num(path, keys[k], r, "high_freq_factor", &rope->high_freq_factor));
      FSDPC_TRY(
          rope_num(path, keys[k], r, "original_max_position_embeddings", &rope->original_max_pos));
    }
    const struct {
      const char *key;
      double a, b;
    } same[] = {{"factor", was.factor, rope->factor},
                {"low_freq_factor", was.low_freq_factor, rope->low_freq_factor},
                {"high_freq_factor", was.high_freq_factor, rope->high_freq_factor},
                {"original_max_position_embeddings", was.original_max_pos, rope->original_max_pos}};
    for (size_t j = 0; first != NULL && rope->scaling != ROPE_DEFAULT && j < 4; j++)
      if (same[j].a != same[j].b && (j == 0 || rope->scaling == ROPE_LLAMA3))
        return err_set(STATUS_EFORMAT, "%s: '%s' and '%s' give different %s (%g and %g)", path,
                       first, keys[k], same[j].key, same[j].a, same[j].b);
    char key[40];
    snprintf(key, sizeof key, "%s.rope_theta", keys[k]);
    const cJSON *th = cJSON_GetObjectItemCaseSensitive(r, "rope_theta");
    if (th == NULL || cJSON_IsNull(th)) continue;
    if (!cJSON_IsNumber(th) || !isfinite(th->valuedouble))
      return err_set(STATUS_EFORMAT, "%s: '%s' must be a finite number", path, key);
    if (top_given && th->valuedouble != top)
      return err_set(STATUS_EFORMAT, "%s: 'rope_theta' is %g but '%s' is %g", path, top, key,
                     th->valuedouble);
    rope->theta = th->valuedouble;
  }
  return STATUS_OK;
}

/* The attention's biases: Qwen2's q, k and v projections always have one; attention_bias
 * gives Llama's and Qwen3's four projections one. And Qwen3's q_norm and k_norm. */
static fsdpc_status_t parse_bias(const char *path, const cJSON *o, llama_config_t *c) {
  bool bias = false;
  FSDPC_TRY(json_bool(path, o, "attention_bias", &bias));
  bool qwen2 = c->arch == LLAMA_ARCH_QWEN2 || c->arch == LLAMA_ARCH_QWEN2_MOE;
  c->qkv_bias = qwen2 || bias;
  c->o_bias = !qwen2 && bias;
  if (c->arch == LLAMA_ARCH_QWEN2_MOE) /* transformers 5's key, true by default */
    FSDPC_TRY(json_bool(path, o, "qkv_bias", &c->qkv_bias));
  c->qk_norm = c->arch == LLAMA_ARCH_QWEN3 || c->arch == LLAMA_ARCH_QWEN3_MOE;
  const cJSON *types = cJSON_GetObjectItemCaseSensitive(o, "layer_types");
  for (const cJSON *t = cJSON_IsArray(types) ? types->child : NULL; t; t = t->next)
    if (!cJSON_IsString(t) || strcmp(t->valuestring, "full_attention") != 0)
      return err_set(STATUS_EUNSUPPORTED,
                     "%s: 'layer_types' holds a layer other than \"full_attention\": "
                     "sliding-window attention is not implemented",
                     path);
  return STATUS_OK;
}

/* GPT2Config's attribute_map reads hidden_size, num_hidden_layers, num_attention_heads and
 * max_position_embeddings as n_embd, n_layer, n_head and n_positions: an alias alone stands
 * for its key (into *v); one beside its key with another value is refused (the file would give
 * one setting two values). */
static const char *const gpt2_keys[][2] = {{"n_embd", "hidden_size"},
                                           {"n_layer", "num_hidden_layers"},
                                           {"n_head", "num_attention_heads"},
                                           {"n_positions", "max_position_embeddings"}};

static fsdpc_status_t gpt2_alias(const char *path, const cJSON *o, int k, int64_t *v) {
  const char *key = gpt2_keys[k][0], *alias = gpt2_keys[k][1];
  const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, alias);
  if (a == NULL || cJSON_IsNull(a)) return STATUS_OK;
  int64_t x = *v;
  FSDPC_TRY(json_int(path, o, alias, &x));
  if (cJSON_GetObjectItemCaseSensitive(o, key) == NULL) {
    *v = x;
    return STATUS_OK;
  }
  if (x != *v)
    return err_set(STATUS_EINVAL,
                   "%s: '%s' is %lld and '%s' %lld: transformers reads %s as %s, so the file "
                   "gives one setting two values; keep one",
                   path, key, (long long)*v, alias, (long long)x, alias, key);
  return STATUS_OK;
}

/* GPT2Config: n_embd, n_layer, n_head, n_inner (null: 4 n_embd), n_positions, vocab_size,
 * layer_norm_epsilon, activation_function (the tanh GELU), tie_word_embeddings (true by
 * default), initializer_range; the attention variants GPT-2 allows are refused by name. */
static fsdpc_status_t parse_gpt2(const char *path, const cJSON *o, llama_config_t *c) {
  for (int k = 0; k < 3; k++) /* n_embd, n_layer, n_head, or their aliases */
    if (cJSON_GetObjectItemCaseSensitive(o, gpt2_keys[k][0]) == NULL &&
        cJSON_GetObjectItemCaseSensitive(o, gpt2_keys[k][1]) == NULL)
      return err_set(STATUS_EFORMAT, "%s: missing '%s'", path, gpt2_keys[k][0]);
  if (cJSON_GetObjectItemCaseSensitive(o, "vocab_size") == NULL)
    return err_set(STATUS_EFORMAT, "%s: missing 'vocab_size'", path);
  const cJSON *act = cJSON_GetObjectItemCaseSensitive(o, "activation_function");
  if (act && (!cJSON_IsString(act) || (strcmp(act->valuestring, "gelu_new") != 0 &&
                                       strcmp(act->valuestring, "gelu_pytorch_tanh") != 0)))
    return err_set(STATUS_EUNSUPPORTED,
                   "%s: activation_function must be \"gelu_new\" (GELU's tanh form)", path);
  FSDPC_TRY(json_refuse(path, o, "scale_attn_by_inverse_layer_idx",
                        "attention scores are scaled by 1/sqrt(head size) only"));
  FSDPC_TRY(json_refuse(path, o, "reorder_and_upcast_attn",
                        "attention is computed in one order, its softmax in f32"));
  const cJSON *scale = cJSON_GetObjectItemCaseSensitive(o, "scale_attn_weights");
  if (scale && cJSON_IsFalse(scale))
    return err_set(STATUS_EUNSUPPORTED,
                   "%s: 'scale_attn_weights' is false, but attention scores are scaled", path);
  c->max_seq_len = 1024;
  c->norm_eps = 1e-5;
  c->tie_embeddings = true;
  FSDPC_TRY(json_int(path, o, "n_embd", &c->dim));
  FSDPC_TRY(json_int(path, o, "n_layer", &c->n_layers));
  FSDPC_TRY(json_int(path, o, "n_head", &c->n_heads));
  FSDPC_TRY(gpt2_alias(path, o, 0, &c->dim));
  FSDPC_TRY(gpt2_alias(path, o, 1, &c->n_layers));
  FSDPC_TRY(gpt2_alias(path, o, 2, &c->n_heads));
  c->n_kv_heads = c->n_heads;
  c->ffn_dim = 4 * c->dim;
  FSDPC_TRY(json_int(path, o, "n_inner", &c->ffn_dim));
  FSDPC_TRY(json_int(path, o, "vocab_size", &c->vocab_size));
  FSDPC_TRY(json_int(path, o, "n_positions", &c->max_seq_len));
  FSDPC_TRY(gpt2_alias(path, o, 3, &c->max_seq_len));
  FSDPC_TRY(json_num(path, o, "layer_norm_epsilon", &c->norm_eps));
  FSDPC_TRY(json_num(path, o, "initializer_range", &c->init_std));
  FSDPC_TRY(json_bool(path, o, "tie_word_embeddings", &c->tie_embeddings));
  fsdpc_status_t st = llama_config_check(c);
  return st == STATUS_OK ? st : err_prefix(st, "%s", path);
}

/* The routers' load-balancing loss: router_aux_loss_coef (0.001, the default of every MoE
 * config of the family) when output_router_logits, else none. */
static fsdpc_status_t parse_router_loss(const char *path, const cJSON *o, llama_config_t *c) {
  bool logits = false;
  double coef = 0.001;
  FSDPC_TRY(json_bool(path, o, "output_router_logits", &logits));
  FSDPC_TRY(json_num(path, o, "router_aux_loss_coef", &coef));
  if (!(coef >= 0) || coef > 1e6)
    return err_set(STATUS_EFORMAT, "%s: 'router_aux_loss_coef' must be from 0 to 1e6", path);
  c->aux_loss_coef = logits ? coef : 0;
  c->router_aux_loss_coef = coef;
  c->router_aux_loss_given = cJSON_HasObjectItem(o, "router_aux_loss_coef");
  return STATUS_OK;
}

/* The router_aux_loss_coef a written config holds: the weight in use, else the one read (an
 * explicit 0 too), else the family's default. */
static double router_coef_of(const llama_config_t *c) {
  if (c->aux_loss_coef > 0) return c->aux_loss_coef;
  if (c->router_aux_loss_given || c->router_aux_loss_coef > 0) return c->router_aux_loss_coef;
  return 0.001;
}

/* MixtralConfig's experts (its defaults: 8 of intermediate_size in every layer, 2 a token,
 * renormalised; the router's loss with output_router_logits), and its refusals: Mistral's
 * sliding window and the router's jitter noise are not implemented. The model's other
 * defaults (rope_theta 1e6, rms_norm_eps 1e-5) go in before the keys are read (its 8
 * key/value heads where parse_hf reads them); the experts' size after intermediate_size is. */
static fsdpc_status_t parse_mixtral(const char *path, const cJSON *o, llama_config_t *c) {
  c->n_experts = 8;
  c->top_k = 2;
  c->sparse_step = 1;
  c->norm_topk = true;
  FSDPC_TRY(json_int(path, o, "num_local_experts", &c->n_experts));
  FSDPC_TRY(json_int(path, o, "num_experts_per_tok", &c->top_k));
  FSDPC_TRY(parse_router_loss(path, o, c));
  double jitter = 0; /* MixtralConfig's */
  FSDPC_TRY(json_num(path, o, "router_jitter_noise", &jitter));
  if (jitter != 0)
    return err_set(STATUS_EUNSUPPORTED,
                   "%s: 'router_jitter_noise' is %g, but the router's jitter noise is not "
                   "implemented (0 routes without it)",
                   path, jitter);
  FSDPC_TRY(json_refuse(path, o, "sliding_window",
                        "sliding-window attention is not implemented (every layer attends to "
                        "the whole sequence; null turns it off)"));
  c->rope.theta = 1e6;
  c->norm_eps = 1e-5;
  c->max_seq_len = 4096 * 32;
  return STATUS_OK;
}

/* Qwen3MoeConfig's experts (its defaults for what the file leaves out: 128 experts of 768, 8 a
 * token, not renormalised, every layer sparse), or Qwen2MoeConfig's (60 of 1408, 4 a token, a
 * shared expert of 5632); the router's loss with output_router_logits. */
static fsdpc_status_t parse_experts(const char *path, const cJSON *o, llama_config_t *c) {
  bool qwen2 = c->arch == LLAMA_ARCH_QWEN2_MOE;
  c->n_experts = qwen2 ? 60 : 128;
  c->top_k = qwen2 ? 4 : 8;
  c->moe_ffn_dim = qwen2 ? 1408 : 768;
  c->shared_ffn_dim = qwen2 ? 5632 : 0;
  if (qwen2) FSDPC_TRY(json_int(path, o, "shared_expert_intermediate_size", &c->shared_ffn_dim));
  c->sparse_step = 1;
  c->norm_topk = false;
  const char *experts = cJSON_GetObjectItemCaseSensitive(o, "num_experts") == NULL &&
                                cJSON_GetObjectItemCaseSensitive(o, "num_local_experts") != NULL
                            ? "num_local_experts"
                            : "num_experts";
  FSDPC_TRY(json_int(path, o, experts, &c->n_experts));
  FSDPC_TRY(json_int(path, o, "num_experts_per_tok", &c->top_k));
  FSDPC_TRY(json_int(path, o, "moe_intermediate_size", &c->moe_ffn_dim));
  FSDPC_TRY(json_int(path, o, "decoder_sparse_step", &c->sparse_step));
  FSDPC_TRY(json_bool(path, o, "norm_topk_prob", &c->norm_topk));
  FSDPC_TRY(parse_router_loss(path, o, c));
  const cJSON *only = cJSON_GetObjectItemCaseSensitive(o, "mlp_only_layers");
  if (only != NULL && !cJSON_IsNull(only) && !cJSON_IsArray(only))
    return err_set(STATUS_EFORMAT, "%s: 'mlp_only_layers' must be a list of layer indices", path);
  for (const cJSON *it = only && cJSON_IsArray(only) ? only->child : NULL; it; it = it->next) {
    double v = cJSON_IsNumber(it) ? it->valuedouble : -1;
    if (v != floor(v) || v < 0 || v >= LLAMA_MAX_MLP_ONLY)
      return err_set(STATUS_EFORMAT,
                     "%s: 'mlp_only_layers' holds %s: layer indices from 0 to %d are read", path,
                     cJSON_IsNumber(it) ? "an index out of range" : "something not a number",
                     LLAMA_MAX_MLP_ONLY - 1);
    int64_t i = (int64_t)v;
    c->mlp_only[i / 64] |= (uint64_t)1 << (i % 64);
  }
  return STATUS_OK;
}

/* A config without model_type is read as Llama's (as LlamaConfig reads any dict); one holding
 * a key only another architecture of the family has is refused, naming the model_type to add,
 * rather than trained as a Llama without its experts or its GPT-2 layout. */
static fsdpc_status_t check_untyped(const char *path, const cJSON *o) {
  static const struct {
    const char *key, *model_type;
  } marks[] = {
      {"n_embd", "gpt2"},
      {"n_layer", "gpt2"},
      {"n_head", "gpt2"},
      {"n_positions", "gpt2"},
      {"shared_expert_intermediate_size", "qwen2_moe"},
      {"num_experts", "qwen3_moe\" or \"qwen2_moe"},
      {"moe_intermediate_size", "qwen3_moe\" or \"qwen2_moe"},
      {"num_local_experts", "mixtral"},
  };
  for (size_t i = 0; i < sizeof marks / sizeof marks[0]; i++)
    if (cJSON_GetObjectItemCaseSensitive(o, marks[i].key) != NULL)
      return err_set(STATUS_EFORMAT,
                     "%s: no model_type, and '%s' is not a Llama config's key: add "
                     "\"model_type\": \"%s\" (a config without one is read as \"llama\")",
                     path, marks[i].key, marks[i].model_type);
  return STATUS_OK;
}

static fsdpc_status_t parse_hf(const char *path, const cJSON *o, llama_config_t *c) {
  if (!cJSON_IsObject(o)) return err_set(STATUS_EFORMAT, "%s: not a JSON object", path);
  /* the model type first: another architecture's config lacks Llama's keys */
  const cJSON *mt = cJSON_GetObjectItemCaseSensitive(o, "model_type");
  if (mt && !cJSON_IsString(mt))
    return err_set(STATUS_EFORMAT, "%s: model_type must be a string", path);
  if (mt && !llama_arch_from_name(mt->valuestring, &c->arch))
    return err_set(STATUS_EUNSUPPORTED,
                   "%s: model_type \"%.64s\": this build trains \"llama\", \"qwen2\", \"qwen3\", "
                   "\"gpt2\", \"qwen3_moe\", \"mixtral\" and \"qwen2_moe\" (LlamaForCausalLM, "
                   "Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel, Qwen3MoeForCausalLM, "
                   "MixtralForCausalLM, Qwen2MoeForCausalLM)",
                   path, mt->valuestring);
  if (mt == NULL) FSDPC_TRY(check_untyped(path, o));
  /* not Hugging Face's: a run's record of its padded tables (llama_config_to_hf_text) */
  FSDPC_TRY(json_int(path, o, "pad_vocab_multiple", &c->pad_vocab_multiple));
  if (c->arch == LLAMA_ARCH_GPT2) return parse_gpt2(path, o, c);
  if (c->arch != LLAMA_ARCH_LLAMA) /* Qwen's defaults (Qwen2Config, Qwen3Config) */
    c->max_seq_len = 32768;
  if (c->arch == LLAMA_ARCH_QWEN3) c->head_dim = 128; /* Qwen3-MoE's: hidden / heads */
  if (c->arch == LLAMA_ARCH_QWEN3_MOE || c->arch == LLAMA_ARCH_QWEN2_MOE)
    FSDPC_TRY(parse_experts(path, o, c));
  if (c->arch == LLAMA_ARCH_MIXTRAL) FSDPC_TRY(parse_mixtral(path, o, c));
  const char *required[] = {"hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "vocab_size"};
  for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
    if (cJSON_GetObjectItemCaseSensitive(o, required[i]) == NULL)
      return err_set(STATUS_EFORMAT, "%s: missing '%s'", path, required[i]);
  const cJSON *act = cJSON_GetObjectItemCaseSensitive(o, "hidden_act");
  if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "silu") != 0))
    return err_set(STATUS_EUNSUPPORTED, "%s: hidden_act must be \"silu\"", path);
  FSDPC_TRY(json_refuse(path, o, "mlp_bias", "the model's MLP has no biases"));
  FSDPC_TRY(json_refuse(path, o, "use_sliding_window",
                        "sliding-window attention is not implemented (every layer attends to "
                        "the whole sequence)"));
  FSDPC_TRY(parse_bias(path, o, c));
  FSDPC_TRY(json_int(path, o, "hidden_size", &c->dim));
  FSDPC_TRY(json_int(path, o, "num_hidden_layers", &c->n_layers));
  FSDPC_TRY(json_int(path, o, "num_attention_heads", &c->n_heads));
  /* MixtralConfig's 8 when the key is absent (null: as many as the heads, as there) */
  c->n_kv_heads = c->arch == LLAMA_ARCH_MIXTRAL &&
                          cJSON_GetObjectItemCaseSensitive(o, "num_key_value_heads") == NULL
                      ? 8
                      : c->n_heads;
  FSDPC_TRY(json_int(path, o, "num_key_value_heads", &c->n_kv_heads));
  FSDPC_TRY(json_int(path, o, "intermediate_size", &c->ffn_dim));
  FSDPC_TRY(json_int(path, o, "vocab_size", &c->vocab_size));
  FSDPC_TRY(json_int(path, o, "max_position_embeddings", &c->max_seq_len));
  FSDPC_TRY(parse_rope(path, o, &c->rope));
  FSDPC_TRY(json_num(path, o, "rms_norm_eps", &c->norm_eps));
  FSDPC_TRY(json_bool(path, o, "tie_word_embeddings", &c->tie_embeddings));
  if (c->arch == LLAMA_ARCH_MIXTRAL) c->moe_ffn_dim = c->ffn_dim; /* the experts' size */
  FSDPC_TRY(json_int(path, o, "head_dim", &c->head_dim));
  if (c->head_dim <= 0 && cJSON_GetObjectItemCaseSensitive(o, "head_dim") != NULL)
    return err_set(STATUS_EFORMAT, "%s: 'head_dim' must be positive", path);
  if (c->n_heads > 0 && c->head_dim * c->n_heads == c->dim) c->head_dim = 0; /* derived */
  FSDPC_TRY(json_num(path, o, "initializer_range", &c->init_std));
  fsdpc_status_t st = llama_config_check(c);
  return st == STATUS_OK ? st : err_prefix(st, "%s", path);
}

fsdpc_status_t llama_config_from_hf(const char *path, llama_config_t *out) {
  ARG_NONNULL(path);
  ARG_NONNULL(out);
  char *text = NULL;
  FSDPC_TRY(file_read_text(path, (size_t)1 << 24, &text));
  fsdpc_status_t st = llama_config_from_hf_text(text, path, out);
  free(text);
  return st;
}

/* A key given twice in one object of o (transformers would take the last; a config saying two
 * things is refused), or STATUS_OK. */
static fsdpc_status_t refuse_twice(const char *path, const cJSON *o) {
  for (const cJSON *it = o ? o->child : NULL; it; it = it->next) {
    for (const cJSON *j = it->next; j && it->string; j = j->next)
      if (j->string && strcmp(j->string, it->string) == 0)
        return err_set(STATUS_EFORMAT, "%s: '%s' is given twice", path, it->string);
    if (cJSON_IsObject(it)) FSDPC_TRY(refuse_twice(path, it));
  }
  return STATUS_OK;
}

fsdpc_status_t llama_config_from_hf_text(const char *text, const char *origin,
                                         llama_config_t *out) {
  const char *path = origin;
  const char *end = NULL;
  cJSON *o = cJSON_ParseWithOpts(text, &end, true);
  if (o == NULL) return err_set(STATUS_EFORMAT, "%s: not valid JSON (one object)", path);
  llama_config_t c = LLAMA_CONFIG_INIT;
  fsdpc_status_t st = refuse_twice(path, o);
  if (st == STATUS_OK) st = parse_hf(path, o, &c);
  cJSON_Delete(o);
  if (st == STATUS_OK) *out = c;
  return st;
}

static const char *dtype_hf_name(dtype_t dtype) {
  return dtype == DTYPE_BF16 ? "bfloat16" : dtype == DTYPE_F16 ? "float16" : "float32";
}

/* GPT2Config's keys (no dropout: the model has none). */
static void gpt2_to_hf(const llama_config_t *c, dtype_t dtype, cJSON *o) {
  cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
  if (arch) cJSON_AddItemToArray(arch, cJSON_CreateString(arch_names[c->arch].hf_class));
  cJSON_AddStringToObject(o, "model_type", "gpt2");
  cJSON_AddStringToObject(o, "activation_function", "gelu_new");
  cJSON_AddNumberToObject(o, "n_embd", (double)c->dim);
  cJSON_AddNumberToObject(o, "n_layer", (double)c->n_layers);
  cJSON_AddNumberToObject(o, "n_head", (double)c->n_heads);
  cJSON_AddNumberToObject(o, "n_inner", (double)c->ffn_dim);
  cJSON_AddNumberToObject(o, "n_positions", (double)c->max_seq_len);
  cJSON_AddNumberToObject(o, "vocab_size", (double)c->vocab_size);
  cJSON_AddNumberToObject(o, "layer_norm_epsilon", c->norm_eps);
  cJSON_AddNumberToObject(o, "initializer_range", c->init_std);
  cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_embeddings);
  const char *drops[] = {"attn_pdrop", "embd_pdrop", "resid_pdrop"};
  for (int i = 0; i < 3; i++) cJSON_AddNumberToObject(o, drops[i], 0.0);
  cJSON_AddStringToObject(o, "torch_dtype", dtype_hf_name(dtype));
  if (c->pad_vocab_multiple > 1)
    cJSON_AddNumberToObject(o, "pad_vocab_multiple", (double)c->pad_vocab_multiple);
}

/* Qwen3MoeConfig's expert keys (no auxiliary loss), and Qwen2MoeConfig's shared expert; false
 * when out of memory. */
static bool experts_to_hf(const llama_config_t *c, cJSON *o) {
  if (c->shared_ffn_dim > 0)
    cJSON_AddNumberToObject(o, "shared_expert_intermediate_size", (double)c->shared_ffn_dim);
  cJSON_AddNumberToObject(o, "num_experts", (double)c->n_experts);
  cJSON_AddNumberToObject(o, "num_experts_per_tok", (double)c->top_k);
  cJSON_AddNumberToObject(o, "moe_intermediate_size", (double)c->moe_ffn_dim);
  cJSON_AddNumberToObject(o, "decoder_sparse_step", (double)c->sparse_step);
  cJSON_AddBoolToObject(o, "norm_topk_prob", c->norm_topk);
  cJSON_AddBoolToObject(o, "output_router_logits", c->aux_loss_coef > 0);
  cJSON_AddNumberToObject(o, "router_aux_loss_coef", router_coef_of(c));
  cJSON *only = cJSON_AddArrayToObject(o, "mlp_only_layers");
  if (only == NULL) return false;
  for (int i = 0; i < LLAMA_MAX_MLP_ONLY; i++)
    if (c->mlp_only[i / 64] >> (i % 64) & 1) cJSON_AddItemToArray(only, cJSON_CreateNumber(i));
  return true;
}

fsdpc_status_t llama_config_to_hf_text(const llama_config_t *c, dtype_t dtype, char **out) {
  ARG_NONNULL(c);
  ARG_NONNULL(out);
  *out = NULL;
  FSDPC_TRY(llama_config_check(c));
  cJSON *o = cJSON_CreateObject();
  if (o == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  if (c->arch == LLAMA_ARCH_GPT2) {
    gpt2_to_hf(c, dtype, o);
    *out = cJSON_Print(o);
    cJSON_Delete(o);
    return *out ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
  }
  cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
  if (arch) cJSON_AddItemToArray(arch, cJSON_CreateString(arch_names[c->arch].hf_class));
  cJSON_AddStringToObject(o, "model_type", arch_names[c->arch].model_type);
  cJSON_AddStringToObject(o, "hidden_act", "silu");
  cJSON_AddNumberToObject(o, "hidden_size", (double)c->dim);
  cJSON_AddNumberToObject(o, "num_hidden_layers", (double)c->n_layers);
  cJSON_AddNumberToObject(o, "num_attention_heads", (double)c->n_heads);
  cJSON_AddNumberToObject(o, "num_key_value_heads", (double)c->n_kv_heads);
  cJSON_AddNumberToObject(o, "head_dim", (double)llama_head_dim(c));
  cJSON_AddNumberToObject(o, "intermediate_size", (double)c->ffn_dim);
  cJSON_AddNumberToObject(o, "vocab_size", (double)c->vocab_size);
  cJSON_AddNumberToObject(o, "max_position_embeddings", (double)c->max_seq_len);
  cJSON_AddNumberToObject(o, "rope_theta", c->rope.theta);
  if (c->rope.scaling != ROPE_DEFAULT) { /* the form both transformers 4 and 5 read */
    cJSON *r = cJSON_AddObjectToObject(o, "rope_scaling");
    if (r == NULL) {
      cJSON_Delete(o);
      return err_set(STATUS_ENOMEM, "out of host memory");
    }
    bool llama3 = c->rope.scaling == ROPE_LLAMA3;
    cJSON_AddStringToObject(r, "rope_type", rope_type_names[c->rope.scaling]);
    cJSON_AddNumberToObject(r, "factor", c->rope.factor);
    if (llama3) {
      cJSON_AddNumberToObject(r, "low_freq_factor", c->rope.low_freq_factor);
      cJSON_AddNumberToObject(r, "high_freq_factor", c->rope.high_freq_factor);
      cJSON_AddNumberToObject(r, "original_max_position_embeddings", c->rope.original_max_pos);
    }
  }
  cJSON_AddNumberToObject(o, "rms_norm_eps", c->norm_eps);
  cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_embeddings);
  if (c->arch != LLAMA_ARCH_QWEN2 && c->arch != LLAMA_ARCH_QWEN2_MOE)
    cJSON_AddBoolToObject(o, "attention_bias", c->o_bias);
  if (c->arch == LLAMA_ARCH_QWEN2_MOE) cJSON_AddBoolToObject(o, "qkv_bias", c->qkv_bias);
  if (c->arch == LLAMA_ARCH_LLAMA) cJSON_AddBoolToObject(o, "mlp_bias", 0);
  if (c->arch != LLAMA_ARCH_LLAMA && c->arch != LLAMA_ARCH_MIXTRAL)
    cJSON_AddBoolToObject(o, "use_sliding_window", 0);
  cJSON_AddNumberToObject(o, "initializer_range", c->init_std);
  if ((c->arch == LLAMA_ARCH_QWEN3_MOE || c->arch == LLAMA_ARCH_QWEN2_MOE) &&
      !experts_to_hf(c, o)) {
    cJSON_Delete(o);
    return err_set(STATUS_ENOMEM, "out of host memory");
  }
  if (c->arch == LLAMA_ARCH_MIXTRAL) { /* MixtralConfig's: intermediate_size is the experts' */
    cJSON_AddNumberToObject(o, "num_local_experts", (double)c->n_experts);
    cJSON_AddNumberToObject(o, "num_experts_per_tok", (double)c->top_k);
    cJSON_AddBoolToObject(o, "output_router_logits", c->aux_loss_coef > 0);
    cJSON_AddNumberToObject(o, "router_aux_loss_coef", router_coef_of(c));
    cJSON_AddNullToObject(o, "sliding_window");
  }
  cJSON_AddStringToObject(o, "torch_dtype", dtype_hf_name(dtype));
  if (c->pad_vocab_multiple > 1)
    cJSON_AddNumberToObject(o, "pad_vocab_multiple", (double)c->pad_vocab_multiple);
  *out = cJSON_Print(o);
  cJSON_Delete(o);
  return *out ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
}

fsdpc_status_t llama_config_to_hf(const llama_config_t *c, dtype_t dtype, const char *path) {
  ARG_NONNULL(c);
  ARG_NONNULL(path);
  char *text;
  FSDPC_TRY(llama_config_to_hf_text(c, dtype, &text));
  fsdpc_status_t st = file_write_text(path, text);
  free(text);
  return st;
}

static bool ends_with(const char *s, const char *tail) {
  size_t n = strlen(s), m = strlen(tail);
  return n >= m && strcmp(s + n - m, tail) == 0;
}

bool llama_hf_canonical(llama_arch_t arch, const char *name, char *buf, size_t size) {
  if (name == NULL || buf == NULL || size == 0) return false;
  const char *base = "transformer.";
  bool prefixed = strncmp(name, base, strlen(base)) == 0;
  bool add = arch == LLAMA_ARCH_GPT2 && !prefixed && strncmp(name, "lm_head.", 8) != 0;
  if (arch == LLAMA_ARCH_GPT2) { /* h.N.attn.bias, h.N.attn.masked_bias: the masks */
    const char *rest = prefixed ? name + strlen(base) : name, *p = rest + 2;
    if (strncmp(rest, "h.", 2) == 0 && *p >= '0' && *p <= '9') {
      while (*p >= '0' && *p <= '9') p++;
      if (strcmp(p, ".attn.bias") == 0 || strcmp(p, ".attn.masked_bias") == 0) return false;
    }
  }
  int n = snprintf(buf, size, "%s%s", add ? base : "", name);
  if (n < 0 || (size_t)n >= size) snprintf(buf, size, "%s", name); /* no parameter's anyway */
  return true;
}

int llama_hf_shape(llama_arch_t arch, const char *fqn, int ndim, const int64_t *shape, bool to_hf,
                   int64_t *out) {
  if (out == NULL || ndim < 0 || ndim > TENSOR_MAX_DIMS || (ndim > 0 && shape == NULL)) return -1;
  memcpy(out, shape, sizeof(int64_t) * (size_t)ndim);
  if (arch != LLAMA_ARCH_GPT2 || fqn == NULL) return ndim;
  bool weight = ends_with(fqn, "attn.c_attn.weight"), bias = ends_with(fqn, "attn.c_attn.bias");
  if (to_hf && ((weight && ndim == 3) || (bias && ndim == 2)) && shape[ndim - 2] == 3) {
    out[ndim - 2] = 3 * shape[ndim - 1];
    return ndim - 1;
  }
  if (!to_hf && ((weight && ndim == 2) || (bias && ndim == 1)) && shape[ndim - 1] % 3 == 0) {
    out[ndim - 1] = 3;
    out[ndim] = shape[ndim - 1] / 3;
    return ndim + 1;
  }
  return ndim;
}
