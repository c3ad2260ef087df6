#include "nn/llama.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/file.h"
#include "nn/init.h"
#include "nn/ops.h"

struct llama {
  llama_config_t cfg;
  mesh_t *mesh;
  nn_module_t *root;
  nn_module_t **layers;
};

/* ---- config ---- */

status_t llama_config_check(const llama_config_t *c) {
  const struct {
    const char *name;
    int64_t v;
  } pos[] = {{"hidden_size", c->dim},
             {"num_hidden_layers", c->n_layers},
             {"num_attention_heads", c->n_heads},
             {"num_key_value_heads", c->n_kv_heads},
             {"intermediate_size", c->ffn_dim},
             {"vocab_size", c->vocab_size},
             {"max_position_embeddings", c->max_seq_len}};
  for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
    if (pos[i].v <= 0 || pos[i].v > (int64_t)1 << 40)
      return err_set(STATUS_EINVAL, "model config: %s must be a positive size, got %lld",
                     pos[i].name, (long long)pos[i].v);
  if (c->dim % c->n_heads != 0 || (c->dim / c->n_heads) % 2 != 0)
    return err_set(STATUS_EINVAL,
                   "model config: hidden_size %lld must be num_attention_heads %lld times an "
                   "even head size",
                   (long long)c->dim, (long long)c->n_heads);
  if (c->n_heads % c->n_kv_heads != 0)
    return err_set(STATUS_EINVAL,
                   "model config: num_attention_heads %lld is not a multiple of "
                   "num_key_value_heads %lld",
                   (long long)c->n_heads, (long long)c->n_kv_heads);
  if (!(c->norm_eps > 0))
    return err_set(STATUS_EINVAL, "model config: rms_norm_eps must be positive");
  if (rope_check(&c->rope) != STATUS_OK) return err_prefix(STATUS_EINVAL, "model config");
  return STATUS_OK;
}

bool llama_config_same_params(const llama_config_t *a, const llama_config_t *b, char *why,
                              size_t size) {
  const struct {
    const char *name;
    int64_t x, y;
  } f[] = {{"dim", a->dim, b->dim},
           {"n_layers", a->n_layers, b->n_layers},
           {"n_heads", a->n_heads, b->n_heads},
           {"n_kv_heads", a->n_kv_heads, b->n_kv_heads},
           {"ffn_dim", a->ffn_dim, b->ffn_dim},
           {"vocab_size", a->vocab_size, b->vocab_size},
           {"tie_embeddings", a->tie_embeddings, b->tie_embeddings}};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
    if (f[i].x != f[i].y) {
      if (why)
        snprintf(why, size, "%s %lld vs %lld", f[i].name, (long long)f[i].x, (long long)f[i].y);
      return false;
    }
  return true;
}

int64_t llama_num_params(const llama_config_t *c) {
  int64_t hd = c->dim / c->n_heads, kv = c->n_kv_heads * hd;
  int64_t layer = 2 * c->dim + 2 * c->dim * c->dim + 2 * kv * c->dim + 3 * c->dim * c->ffn_dim;
  return c->vocab_size * c->dim * (c->tie_embeddings ? 1 : 2) + c->n_layers * layer + c->dim;
}

/* Reads an optional integer key; errors name the file and the key. */
static status_t json_int(const char *path, const cJSON *o, const char *key, int64_t *v) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  if (it == NULL || cJSON_IsNull(it)) return STATUS_OK;
  if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble))
    return err_set(STATUS_EFORMAT, "%s: '%s' must be an integer", path, key);
  *v = (int64_t)it->valuedouble;
  return STATUS_OK;
}

static status_t json_num(const char *path, const cJSON *o, const char *key, double *v) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  if (it == NULL || cJSON_IsNull(it)) return STATUS_OK;
  if (!cJSON_IsNumber(it)) return err_set(STATUS_EFORMAT, "%s: '%s' must be a number", path, key);
  *v = it->valuedouble;
  return STATUS_OK;
}

static status_t json_refuse(const char *path, const cJSON *o, const char *key, const char *why) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
  if (it == NULL || cJSON_IsNull(it) || cJSON_IsFalse(it)) return STATUS_OK;
  return err_set(STATUS_EUNSUPPORTED, "%s: '%s' is set, but %s", path, key, why);
}

/* A number in a rope section; required ones missing are an error naming the key. */
static status_t rope_num(const char *path, const char *section, const cJSON *r, const char *key,
                         double *v) {
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
static status_t parse_rope(const char *path, const cJSON *o, rope_t *rope) {
  double top = -1;
  TRY(json_num(path, o, "rope_theta", &top));
  if (top != -1) rope->theta = top;
  static const char *const keys[] = {"rope_scaling", "rope_parameters"};
  static const struct {
    const char *name;
    rope_scaling_t scaling;
  } types[] = {{"default", ROPE_DEFAULT}, {"linear", ROPE_LINEAR}, {"llama3", ROPE_LLAMA3}};
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
    while (i < sizeof types / sizeof types[0] && strcmp(t->valuestring, types[i].name) != 0) i++;
    if (i == sizeof types / sizeof types[0])
      return err_set(STATUS_EUNSUPPORTED,
                     "%s: '%s.%s' is '%s': the rotary embeddings implemented are default, linear "
                     "and llama3 (no dynamic, yarn or longrope scaling)",
                     path, keys[k], tkey, t->valuestring);
    if (typed != NULL && types[i].scaling != rope->scaling)
      return err_set(STATUS_EFORMAT, "%s: '%s' and '%s' give different rope types", path, typed,
                     keys[k]);
    typed = keys[k];
    rope->scaling = types[i].scaling;
    if (rope->scaling != ROPE_DEFAULT) TRY(rope_num(path, keys[k], r, "factor", &rope->factor));
    if (rope->scaling == ROPE_LLAMA3) {
      TRY(rope_num(path, keys[k], r, "low_freq_factor", &rope->low_freq_factor));
      TRY(rope_num(path, keys[k], r, "high_freq_factor", &rope->high_freq_factor));
      TRY(rope_num(path, keys[k], r, "original_max_position_embeddings", &rope->original_max_pos));
    }
    double theta = -1;
    char key[40];
    snprintf(key, sizeof key, "%s.rope_theta", keys[k]);
    const cJSON *th = cJSON_GetObjectItemCaseSensitive(r, "rope_theta");
    if (th != NULL && !cJSON_IsNumber(th))
      return err_set(STATUS_EFORMAT, "%s: '%s' must be a number", path, key);
    if (th != NULL) theta = th->valuedouble;
    if (theta != -1 && top != -1 && theta != top)
      return err_set(STATUS_EFORMAT, "%s: 'rope_theta' is %g but '%s' is %g", path, top, key,
                     theta);
    if (theta != -1) rope->theta = theta;
  }
  return STATUS_OK;
}

static status_t parse_hf(const char *path, const cJSON *o, llama_config_t *c) {
  if (!cJSON_IsObject(o)) return err_set(STATUS_EFORMAT, "%s: not a JSON object", path);
  const char *required[] = {"hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "vocab_size"};
  for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
    if (cJSON_GetObjectItemCaseSensitive(o, required[i]) == NULL)
      return err_set(STATUS_EFORMAT, "%s: missing '%s'", path, required[i]);
  const cJSON *mt = cJSON_GetObjectItemCaseSensitive(o, "model_type");
  if (mt && (!cJSON_IsString(mt) || strcmp(mt->valuestring, "llama") != 0))
    return err_set(STATUS_EUNSUPPORTED, "%s: model_type must be \"llama\"", path);
  const cJSON *act = cJSON_GetObjectItemCaseSensitive(o, "hidden_act");
  if (act && (!cJSON_IsString(act) || strcmp(act->valuestring, "silu") != 0))
    return err_set(STATUS_EUNSUPPORTED, "%s: hidden_act must be \"silu\"", path);
  TRY(json_refuse(path, o, "attention_bias", "the model has no biases"));
  TRY(json_refuse(path, o, "mlp_bias", "the model has no biases"));
  TRY(json_int(path, o, "hidden_size", &c->dim));
  TRY(json_int(path, o, "num_hidden_layers", &c->n_layers));
  TRY(json_int(path, o, "num_attention_heads", &c->n_heads));
  c->n_kv_heads = c->n_heads;
  TRY(json_int(path, o, "num_key_value_heads", &c->n_kv_heads));
  TRY(json_int(path, o, "intermediate_size", &c->ffn_dim));
  TRY(json_int(path, o, "vocab_size", &c->vocab_size));
  TRY(json_int(path, o, "max_position_embeddings", &c->max_seq_len));
  TRY(parse_rope(path, o, &c->rope));
  TRY(json_num(path, o, "rms_norm_eps", &c->norm_eps));
  const cJSON *tie = cJSON_GetObjectItemCaseSensitive(o, "tie_word_embeddings");
  if (tie && !cJSON_IsNull(tie)) {
    if (!cJSON_IsBool(tie))
      return err_set(STATUS_EFORMAT, "%s: 'tie_word_embeddings' must be true or false", path);
    c->tie_embeddings = cJSON_IsTrue(tie);
  }
  int64_t head_dim = -1;
  TRY(json_int(path, o, "head_dim", &head_dim));
  if (head_dim != -1 && c->n_heads > 0 && head_dim * c->n_heads != c->dim)
    return err_set(STATUS_EUNSUPPORTED, "%s: head_dim %lld differs from hidden_size / heads", path,
                   (long long)head_dim);
  status_t st = llama_config_check(c);
  return st == STATUS_OK ? st : err_prefix(st, "%s", path);
}

status_t llama_config_from_hf(const char *path, llama_config_t *out) {
  char *text = NULL;
  TRY(file_read_text(path, (size_t)1 << 24, &text));
  status_t st = llama_config_from_hf_text(text, path, out);
  free(text);
  return st;
}

status_t llama_config_from_hf_text(const char *text, const char *origin, llama_config_t *out) {
  const char *path = origin;
  cJSON *o = cJSON_Parse(text);
  if (o == NULL) return err_set(STATUS_EFORMAT, "%s: not valid JSON", path);
  llama_config_t c = LLAMA_CONFIG_INIT;
  status_t st = parse_hf(path, o, &c);
  cJSON_Delete(o);
  if (st == STATUS_OK) *out = c;
  return st;
}

status_t llama_config_to_hf_text(const llama_config_t *c, dtype_t dtype, char **out) {
  *out = NULL;
  TRY(llama_config_check(c));
  cJSON *o = cJSON_CreateObject();
  if (o == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
  if (arch) cJSON_AddItemToArray(arch, cJSON_CreateString("LlamaForCausalLM"));
  cJSON_AddStringToObject(o, "model_type", "llama");
  cJSON_AddStringToObject(o, "hidden_act", "silu");
  cJSON_AddNumberToObject(o, "hidden_size", (double)c->dim);
  cJSON_AddNumberToObject(o, "num_hidden_layers", (double)c->n_layers);
  cJSON_AddNumberToObject(o, "num_attention_heads", (double)c->n_heads);
  cJSON_AddNumberToObject(o, "num_key_value_heads", (double)c->n_kv_heads);
  cJSON_AddNumberToObject(o, "head_dim", (double)(c->dim / c->n_heads));
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
    cJSON_AddStringToObject(r, "rope_type", llama3 ? "llama3" : "linear");
    cJSON_AddNumberToObject(r, "factor", c->rope.factor);
    if (llama3) {
      cJSON_AddNumberToObject(r, "low_freq_factor", c->rope.low_freq_factor);
      cJSON_AddNumberToObject(r, "high_freq_factor", c->rope.high_freq_factor);
      cJSON_AddNumberToObject(r, "original_max_position_embeddings", c->rope.original_max_pos);
    }
  }
  cJSON_AddNumberToObject(o, "rms_norm_eps", c->norm_eps);
  cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_embeddings);
  cJSON_AddBoolToObject(o, "attention_bias", 0);
  cJSON_AddBoolToObject(o, "mlp_bias", 0);
  cJSON_AddStringToObject(o, "torch_dtype",
                          dtype == DTYPE_BF16  ? "bfloat16"
                          : dtype == DTYPE_F16 ? "float16"
                                               : "float32");
  *out = cJSON_Print(o);
  cJSON_Delete(o);
  return *out ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
}

status_t llama_config_to_hf(const llama_config_t *c, dtype_t dtype, const char *path) {
  char *text;
  TRY(llama_config_to_hf_text(c, dtype, &text));
  status_t st = file_write_text(path, text);
  free(text);
  return st;
}

/* ---- forwards ---- */

static nn_param_t *weight_of(nn_module_t *m) { return nn_module_param_named(m, "weight"); }
static const llama_config_t *cfg_of(nn_module_t *m) {
  return &((const llama_t *)nn_module_impl(m))->cfg;
}

static status_t linear_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  return nn_linear(ctx, in, weight_of(m), out);
}

static status_t embedding_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  return nn_embedding(ctx, in, weight_of(m), out);
}

static status_t rmsnorm_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  return nn_rmsnorm(ctx, in, weight_of(m), cfg_of(m)->norm_eps, out);
}

static status_t call_child(nn_ctx_t *ctx, nn_module_t *m, const char *name, nn_var_t *in,
                           nn_var_t **out) {
  return nn_call(ctx, nn_module_child_named(m, name), in, out);
}

/* x [B, T, H*Dh] -> [B, T, H, Dh] with H from the projection's local output size. */
static status_t split_heads(nn_ctx_t *ctx, nn_var_t *x, int64_t head_dim, nn_var_t **out) {
  const tensor_t *v = &x->value;
  int64_t shape[4] = {v->shape[0], v->shape[1], v->shape[2] / head_dim, head_dim};
  return nn_view(ctx, x, 4, shape, out);
}

static status_t attention_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  const llama_config_t *c = cfg_of(m);
  int64_t hd = c->dim / c->n_heads;
  if (in->value.ndim != 3)
    return err_set(STATUS_ESHAPE, "%s: input must be [B, T, D]", nn_module_fqn(m));
  nn_var_t *q = NULL, *k = NULL, *v = NULL, *q4 = NULL, *k4 = NULL, *v4 = NULL, *qr = NULL,
           *kr = NULL, *a = NULL, *a3 = NULL;
  status_t st = STATUS_OK;
  TRY_GOTO(st, call_child(ctx, m, "q_proj", in, &q));
  TRY_GOTO(st, call_child(ctx, m, "k_proj", in, &k));
  TRY_GOTO(st, call_child(ctx, m, "v_proj", in, &v));
  TRY_GOTO(st, split_heads(ctx, q, hd, &q4));
  TRY_GOTO(st, split_heads(ctx, k, hd, &k4));
  TRY_GOTO(st, split_heads(ctx, v, hd, &v4));
  TRY_GOTO(st, nn_rope(ctx, q4, &c->rope, &qr));
  TRY_GOTO(st, nn_rope(ctx, k4, &c->rope, &kr));
  TRY_GOTO(st, nn_attention(ctx, qr, kr, v4, &a));
  int64_t shape[3] = {in->value.shape[0], in->value.shape[1], q->value.shape[2]};
  TRY_GOTO(st, nn_view(ctx, a, 3, shape, &a3));
  TRY_GOTO(st, call_child(ctx, m, "o_proj", a3, out));
cleanup:;
  nn_var_t *vars[] = {q, k, v, q4, k4, v4, qr, kr, a, a3};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) nn_var_put(vars[i]);
  return st;
}

static status_t mlp_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *g = NULL, *u = NULL, *s = NULL;
  status_t st = STATUS_OK;
  TRY_GOTO(st, call_child(ctx, m, "gate_proj", in, &g));
  TRY_GOTO(st, call_child(ctx, m, "up_proj", in, &u));
  TRY_GOTO(st, nn_silu_mul(ctx, g, u, &s));
  TRY_GOTO(st, call_child(ctx, m, "down_proj", s, out));
cleanup:
  nn_var_put(g);
  nn_var_put(u);
  nn_var_put(s);
  return st;
}

static status_t block_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *r = NULL, *a = NULL, *h = NULL, *r2 = NULL, *f = NULL;
  status_t st = STATUS_OK;
  TRY_GOTO(st, call_child(ctx, m, "input_layernorm", in, &r));
  TRY_GOTO(st, call_child(ctx, m, "self_attn", r, &a));
  TRY_GOTO(st, nn_add(ctx, in, a, &h));
  TRY_GOTO(st, call_child(ctx, m, "post_attention_layernorm", h, &r2));
  TRY_GOTO(st, call_child(ctx, m, "mlp", r2, &f));
  TRY_GOTO(st, nn_add(ctx, h, f, out));
cleanup:
  nn_var_put(r);
  nn_var_put(a);
  nn_var_put(h);
  nn_var_put(r2);
  nn_var_put(f);
  return st;
}

static status_t model_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  const llama_t *L = nn_module_impl(m);
  nn_var_t *h = NULL;
  TRY(call_child(ctx, m, "embed_tokens", in, &h));
  for (int64_t i = 0; i < L->cfg.n_layers; i++) {
    nn_var_t *next = NULL;
    status_t st = nn_call(ctx, L->layers[i], h, &next);
    nn_var_put(h);
    TRY(st);
    h = next;
  }
  status_t st = call_child(ctx, m, "norm", h, out);
  nn_var_put(h);
  return st;
}

static status_t causal_lm_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  const llama_t *L = nn_module_impl(m);
  if (in->value.ndim != 2 || (in->value.dtype != DTYPE_I32 && in->value.dtype != DTYPE_I64))
    return err_set(STATUS_EINVAL, "llama: input ids must be an i32/i64 [B, T] tensor");
  if (in->value.shape[1] > L->cfg.max_seq_len)
    return err_set(STATUS_EINVAL,
                   "llama: sequence length %lld exceeds max_position_embeddings "
                   "%lld",
                   (long long)in->value.shape[1], (long long)L->cfg.max_seq_len);
  nn_var_t *h = NULL;
  TRY(call_child(ctx, m, "model", in, &h));
  status_t st = call_child(ctx, m, "lm_head", h, out);
  nn_var_put(h);
  return st;
}

/* ---- construction ---- */

typedef struct builder {
  llama_t *L;
  const llama_options_t *opt;
} builder_t;

static status_t add_weight(builder_t *b, nn_module_t *m, int64_t rows, int64_t cols,
                           nn_param_t **out) {
  int64_t shape[2] = {rows, cols};
  int nd = cols > 0 ? 2 : 1;
  tensor_t t;
  device_t dev = mesh_device(b->L->mesh);
  if (b->opt->deferred)
    TRY(tensor_meta(&t, b->opt->dtype, dev, nd, shape));
  else
    TRY(tensor_zeros(&t, b->opt->dtype, dev, nd, shape));
  dtensor_t *dt = NULL;
  placement_t rep = placement_replicate();
  status_t st = dtensor_from_local(&dt, &t, b->L->mesh, &rep, nd, shape);
  tensor_free(&t);
  TRY(st);
  return nn_module_add_param(m, "weight", dt, true, out);
}

/* A leaf module with a weight of [rows, cols] (cols 0: a vector) added to parent. */
static status_t add_leaf(builder_t *b, nn_module_t *parent, const char *name, nn_forward_fn fn,
                         int64_t rows, int64_t cols, nn_module_t **out) {
  nn_module_t *m;
  TRY(nn_module_new(&m, name, fn, b->L));
  nn_module_set_kind(m, fn == linear_forward      ? "linear"
                        : fn == embedding_forward ? "embedding"
                        : fn == rmsnorm_forward   ? "rmsnorm"
                                                  : NULL);
  status_t st = nn_module_add_child(parent, m);
  if (st != STATUS_OK) {
    nn_module_free(m);
    return st;
  }
  if (out) *out = m;
  if (rows == 0) return STATUS_OK;
  return add_weight(b, m, rows, cols, NULL);
}

static status_t add_container(builder_t *b, nn_module_t *parent, const char *name, nn_forward_fn fn,
                              nn_module_t **out) {
  return add_leaf(b, parent, name, fn, 0, 0, out);
}

static status_t build_block(builder_t *b, nn_module_t *layers, int64_t i) {
  const llama_config_t *c = &b->L->cfg;
  int64_t hd = c->dim / c->n_heads;
  char name[24];
  snprintf(name, sizeof name, "%lld", (long long)i);
  nn_module_t *blk, *attn, *mlp;
  TRY(add_container(b, layers, name, block_forward, &blk));
  b->L->layers[i] = blk;
  TRY(add_leaf(b, blk, "input_layernorm", rmsnorm_forward, c->dim, 0, NULL));
  TRY(add_container(b, blk, "self_attn", attention_forward, &attn));
  TRY(add_leaf(b, attn, "q_proj", linear_forward, c->n_heads * hd, c->dim, NULL));
  TRY(add_leaf(b, attn, "k_proj", linear_forward, c->n_kv_heads * hd, c->dim, NULL));
  TRY(add_leaf(b, attn, "v_proj", linear_forward, c->n_kv_heads * hd, c->dim, NULL));
  TRY(add_leaf(b, attn, "o_proj", linear_forward, c->dim, c->n_heads * hd, NULL));
  TRY(add_leaf(b, blk, "post_attention_layernorm", rmsnorm_forward, c->dim, 0, NULL));
  TRY(add_container(b, blk, "mlp", mlp_forward, &mlp));
  TRY(add_leaf(b, mlp, "gate_proj", linear_forward, c->ffn_dim, c->dim, NULL));
  TRY(add_leaf(b, mlp, "up_proj", linear_forward, c->ffn_dim, c->dim, NULL));
  TRY(add_leaf(b, mlp, "down_proj", linear_forward, c->dim, c->ffn_dim, NULL));
  nn_module_set_checkpoint(blk, b->opt->activation_checkpointing);
  return STATUS_OK;
}

static status_t build(builder_t *b) {
  llama_t *L = b->L;
  const llama_config_t *c = &L->cfg;
  nn_module_t *model, *layers, *embed, *head;
  TRY(nn_module_new(&L->root, "", causal_lm_forward, L));
  TRY(add_container(b, L->root, "model", model_forward, &model));
  TRY(add_leaf(b, model, "embed_tokens", embedding_forward, c->vocab_size, c->dim, &embed));
  TRY(add_container(b, model, "layers", NULL, &layers));
  for (int64_t i = 0; i < c->n_layers; i++) TRY(build_block(b, layers, i));
  TRY(add_leaf(b, model, "norm", rmsnorm_forward, c->dim, 0, NULL));
  if (c->tie_embeddings) {
    TRY(add_container(b, L->root, "lm_head", linear_forward, &head));
    TRY(nn_module_share_param(head, weight_of(embed)));
  } else {
    TRY(add_leaf(b, L->root, "lm_head", linear_forward, c->vocab_size, c->dim, NULL));
  }
  return nn_module_finalize(L->root);
}

status_t llama_new(llama_t **out, const llama_config_t *cfg, const llama_options_t *opt) {
  *out = NULL;
  llama_options_t defaults = LLAMA_OPTIONS_INIT;
  if (opt == NULL) opt = &defaults;
  TRY(llama_config_check(cfg));
  if (!dtype_is_float(opt->dtype))
    return err_set(STATUS_EDTYPE, "llama: parameter dtype must be f32, bf16 or f16");
  llama_t *L = calloc(1, sizeof *L);
  if (L == NULL) return err_set(STATUS_ENOMEM, "llama: out of host memory");
  L->cfg = *cfg;
  status_t st = STATUS_OK;
  if ((L->layers = calloc((size_t)cfg->n_layers, sizeof(nn_module_t *))) == NULL)
    TRY_GOTO(st, err_set(STATUS_ENOMEM, "llama: out of host memory"));
  TRY_GOTO(st, mesh_init_local(&L->mesh, "local", opt->device));
  builder_t b = {L, opt};
  TRY_GOTO(st, build(&b));
  *out = L;
  return STATUS_OK;
cleanup:
  llama_free(L);
  return st;
}

void llama_free(llama_t *m) {
  if (m == NULL) return;
  nn_module_free(m->root);
  mesh_free(m->mesh);
  free(m->layers);
  free(m);
}

status_t llama_init_weights(llama_t *m, uint64_t seed) {
  nn_param_t **ps;
  int n;
  TRY(nn_named_parameters(m->root, &ps, &n));
  status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    size_t len = strlen(ps[i]->fqn);
    bool norm = len >= 11 && strcmp(ps[i]->fqn + len - 11, "norm.weight") == 0;
    st = norm ? nn_init_constant(ps[i], 1.0) : nn_init_normal(ps[i], seed, 0.0, 0.02);
  }
  free(ps);
  return st;
}

nn_module_t *llama_module(const llama_t *m) { return m->root; }
const llama_config_t *llama_get_config(const llama_t *m) { return &m->cfg; }
nn_module_t *llama_layer(const llama_t *m, int64_t i) { return m->layers[i]; }
mesh_t *llama_local_mesh(const llama_t *m) { return m->mesh; }

void llama_set_activation_checkpointing(llama_t *m, bool enabled) {
  for (int64_t i = 0; i < m->cfg.n_layers; i++) nn_module_set_checkpoint(m->layers[i], enabled);
}
