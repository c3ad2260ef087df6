#include "models/llama/llama.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/file.h"
#include "nn/init.h"
#include "nn/ops.h"

struct llama {
  llama_config_t cfg;
  mesh_t *mesh;
  nn_module_t *root;
  nn_module_t **layers;
};

/* ---- forwards ---- */

static nn_param_t *weight_of(nn_module_t *m) { return nn_module_param_named(m, "weight"); }
static const llama_config_t *cfg_of(nn_module_t *m) {
  return &((const llama_t *)nn_module_impl(m))->cfg;
}

static fsdpc_status_t linear_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_param_t *b = nn_module_param_named(m, "bias");
  if (b == NULL) return nn_linear(ctx, in, weight_of(m), out);
  nn_var_t *y = NULL;
  FSDPC_TRY(nn_linear(ctx, in, weight_of(m), &y));
  fsdpc_status_t st = nn_bias_add(ctx, y, b, out);
  nn_var_put(y);
  return st;
}

static fsdpc_status_t embedding_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                        nn_var_t **out) {
  return nn_embedding(ctx, in, weight_of(m), out);
}

static fsdpc_status_t rmsnorm_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  return nn_rmsnorm(ctx, in, weight_of(m), cfg_of(m)->norm_eps, out);
}

static fsdpc_status_t call_child(nn_ctx_t *ctx, nn_module_t *m, const char *name, nn_var_t *in,
                                 nn_var_t **out) {
  return nn_call(ctx, nn_module_child_named(m, name), in, out);
}

/* x [B, T, H*Dh] -> [B, T, H, Dh] with H from the projection's local output size. */
static fsdpc_status_t split_heads(nn_ctx_t *ctx, nn_var_t *x, int64_t head_dim, nn_var_t **out) {
  const fsdpc_tensor_t *v = &x->value;
  int64_t shape[4] = {v->shape[0], v->shape[1], v->shape[2] / head_dim, head_dim};
  return nn_view(ctx, x, 4, shape, out);
}

static fsdpc_status_t attention_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                        nn_var_t **out) {
  const llama_config_t *c = cfg_of(m);
  int64_t hd = llama_head_dim(c);
  if (in->value.ndim != 3)
    return err_set(STATUS_ESHAPE, "%s: input must be [B, T, D]", nn_module_fqn(m));
  nn_var_t *q = NULL, *k = NULL, *v = NULL, *q4 = NULL, *k4 = NULL, *v4 = NULL, *qn = NULL,
           *kn = NULL, *qr = NULL, *kr = NULL, *a = NULL, *a3 = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "q_proj", in, &q));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "k_proj", in, &k));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "v_proj", in, &v));
  FSDPC_TRY_GOTO(st, split_heads(ctx, q, hd, &q4));
  FSDPC_TRY_GOTO(st, split_heads(ctx, k, hd, &k4));
  FSDPC_TRY_GOTO(st, split_heads(ctx, v, hd, &v4));
  if (c->qk_norm) { /* each head normalised over its own features, before the rotation */
    FSDPC_TRY_GOTO(st, call_child(ctx, m, "q_norm", q4, &qn));
    FSDPC_TRY_GOTO(st, call_child(ctx, m, "k_norm", k4, &kn));
  }
  FSDPC_TRY_GOTO(st, nn_rope(ctx, qn ? qn : q4, &c->rope, &qr));
  FSDPC_TRY_GOTO(st, nn_rope(ctx, kn ? kn : k4, &c->rope, &kr));
  FSDPC_TRY_GOTO(st, nn_attention(ctx, qr, kr, v4, &a));
  int64_t shape[3] = {in->value.shape[0], in->value.shape[1], q->value.shape[2]};
  FSDPC_TRY_GOTO(st, nn_view(ctx, a, 3, shape, &a3));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "o_proj", a3, out));
cleanup:;
  nn_var_t *vars[] = {q, k, v, q4, k4, v4, qn, kn, qr, kr, a, a3};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) nn_var_put(vars[i]);
  return st;
}

static fsdpc_status_t mlp_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *g = NULL, *u = NULL, *s = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "gate_proj", in, &g));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "up_proj", in, &u));
  FSDPC_TRY_GOTO(st, nn_silu_mul(ctx, g, u, &s));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "down_proj", s, out));
cleanup:
  nn_var_put(g);
  nn_var_put(u);
  nn_var_put(s);
  return st;
}

static fsdpc_status_t block_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *r = NULL, *a = NULL, *h = NULL, *r2 = NULL, *f = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "input_layernorm", in, &r));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "self_attn", r, &a));
  FSDPC_TRY_GOTO(st, nn_add(ctx, in, a, &h));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "post_attention_layernorm", h, &r2));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "mlp", r2, &f));
  FSDPC_TRY_GOTO(st, nn_add(ctx, h, f, out));
cleanup:
  nn_var_put(r);
  nn_var_put(a);
  nn_var_put(h);
  nn_var_put(r2);
  nn_var_put(f);
  return st;
}

static fsdpc_status_t model_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  const llama_t *L = nn_module_impl(m);
  nn_var_t *h = NULL;
  FSDPC_TRY(call_child(ctx, m, "embed_tokens", in, &h));
  for (int64_t i = 0; i < L->cfg.n_layers; i++) {
    nn_var_t *next = NULL;
    fsdpc_status_t st = nn_call(ctx, L->layers[i], h, &next);
    nn_var_put(h);
    FSDPC_TRY(st);
    h = next;
  }
  fsdpc_status_t st = call_child(ctx, m, "norm", h, out);
  nn_var_put(h);
  return st;
}

static fsdpc_status_t causal_lm_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                        nn_var_t **out) {
  const llama_t *L = nn_module_impl(m);
  if (in->value.ndim != 2 || (in->value.dtype != DTYPE_I32 && in->value.dtype != DTYPE_I64))
    return err_set(STATUS_EINVAL, "llama: input ids must be an i32/i64 [B, T] tensor");
  if (in->value.shape[1] > L->cfg.max_seq_len)
    return err_set(STATUS_EINVAL,
                   "llama: sequence length %lld exceeds max_position_embeddings "
                   "%lld",
                   (long long)in->value.shape[1], (long long)L->cfg.max_seq_len);
  nn_var_t *h = NULL;
  FSDPC_TRY(call_child(ctx, m, "model", in, &h));
  fsdpc_status_t st = call_child(ctx, m, "lm_head", h, out);
  nn_var_put(h);
  return st;
}

/* ---- construction ---- */

typedef struct builder {
  llama_t *L;
  const llama_options_t *opt;
} builder_t;

static fsdpc_status_t add_param(builder_t *b, nn_module_t *m, const char *name, int64_t rows,
                                int64_t cols, nn_param_t **out) {
  int64_t shape[2] = {rows, cols};
  int nd = cols > 0 ? 2 : 1;
  fsdpc_tensor_t t;
  device_t dev = mesh_device(b->L->mesh);
  if (b->opt->deferred)
    FSDPC_TRY(tensor_meta(&t, b->opt->dtype, dev, nd, shape));
  else
    FSDPC_TRY(tensor_zeros(&t, b->opt->dtype, dev, nd, shape));
  dtensor_t *dt = NULL;
  placement_t rep = placement_replicate();
  fsdpc_status_t st = dtensor_from_local(&t, b->L->mesh, &rep, nd, shape, &dt);
  tensor_free(&t);
  FSDPC_TRY(st);
  return nn_module_add_param(m, name, dt, true, out);
}

/* A leaf module with a weight of [rows, cols] (cols 0: a vector) added to parent. */
static fsdpc_status_t add_leaf(builder_t *b, nn_module_t *parent, const char *name,
                               nn_forward_fn fn, int64_t rows, int64_t cols, nn_module_t **out) {
  nn_module_t *m;
  FSDPC_TRY(nn_module_new(name, fn, b->L, &m));
  nn_module_set_kind(m, fn == linear_forward      ? "linear"
                        : fn == embedding_forward ? "embedding"
                        : fn == rmsnorm_forward   ? "rmsnorm"
                                                  : NULL);
  fsdpc_status_t st = nn_module_add_child(parent, m);
  if (st != STATUS_OK) {
    nn_module_free(m);
    return st;
  }
  if (out) *out = m;
  if (rows == 0) return STATUS_OK;
  return add_param(b, m, "weight", rows, cols, NULL);
}

/* A linear leaf with a bias when bias is set. */
static fsdpc_status_t add_linear(builder_t *b, nn_module_t *parent, const char *name,
                                 int64_t out_features, int64_t in_features, bool bias) {
  nn_module_t *m;
  FSDPC_TRY(add_leaf(b, parent, name, linear_forward, out_features, in_features, &m));
  return bias ? add_param(b, m, "bias", out_features, 0, NULL) : STATUS_OK;
}

static fsdpc_status_t add_container(builder_t *b, nn_module_t *parent, const char *name,
                                    nn_forward_fn fn, nn_module_t **out) {
  return add_leaf(b, parent, name, fn, 0, 0, out);
}

static fsdpc_status_t build_block(builder_t *b, nn_module_t *layers, int64_t i) {
  const llama_config_t *c = &b->L->cfg;
  int64_t hd = llama_head_dim(c);
  char name[24];
  snprintf(name, sizeof name, "%lld", (long long)i);
  nn_module_t *blk, *attn, *mlp;
  FSDPC_TRY(add_container(b, layers, name, block_forward, &blk));
  b->L->layers[i] = blk;
  FSDPC_TRY(add_leaf(b, blk, "input_layernorm", rmsnorm_forward, c->dim, 0, NULL));
  FSDPC_TRY(add_container(b, blk, "self_attn", attention_forward, &attn));
  FSDPC_TRY(add_linear(b, attn, "q_proj", c->n_heads * hd, c->dim, c->qkv_bias));
  FSDPC_TRY(add_linear(b, attn, "k_proj", c->n_kv_heads * hd, c->dim, c->qkv_bias));
  FSDPC_TRY(add_linear(b, attn, "v_proj", c->n_kv_heads * hd, c->dim, c->qkv_bias));
  FSDPC_TRY(add_linear(b, attn, "o_proj", c->dim, c->n_heads * hd, c->o_bias));
  if (c->qk_norm) {
    FSDPC_TRY(add_leaf(b, attn, "q_norm", rmsnorm_forward, hd, 0, NULL));
    FSDPC_TRY(add_leaf(b, attn, "k_norm", rmsnorm_forward, hd, 0, NULL));
  }
  FSDPC_TRY(add_leaf(b, blk, "post_attention_layernorm", rmsnorm_forward, c->dim, 0, NULL));
  FSDPC_TRY(add_container(b, blk, "mlp", mlp_forward, &mlp));
  FSDPC_TRY(add_leaf(b, mlp, "gate_proj", linear_forward, c->ffn_dim, c->dim, NULL));
  FSDPC_TRY(add_leaf(b, mlp, "up_proj", linear_forward, c->ffn_dim, c->dim, NULL));
  FSDPC_TRY(add_leaf(b, mlp, "down_proj", linear_forward, c->dim, c->ffn_dim, NULL));
  nn_module_set_checkpoint(blk, b->opt->activation_checkpointing);
  return STATUS_OK;
}

static fsdpc_status_t build(builder_t *b) {
  llama_t *L = b->L;
  const llama_config_t *c = &L->cfg;
  nn_module_t *model, *layers, *embed, *head;
  FSDPC_TRY(nn_module_new("", causal_lm_forward, L, &L->root));
  FSDPC_TRY(add_container(b, L->root, "model", model_forward, &model));
  FSDPC_TRY(add_leaf(b, model, "embed_tokens", embedding_forward, c->vocab_size, c->dim, &embed));
  FSDPC_TRY(add_container(b, model, "layers", NULL, &layers));
  for (int64_t i = 0; i < c->n_layers; i++) FSDPC_TRY(build_block(b, layers, i));
  FSDPC_TRY(add_leaf(b, model, "norm", rmsnorm_forward, c->dim, 0, NULL));
  if (c->tie_embeddings) {
    FSDPC_TRY(add_container(b, L->root, "lm_head", linear_forward, &head));
    FSDPC_TRY(nn_module_share_param(head, weight_of(embed)));
  } else {
    FSDPC_TRY(add_leaf(b, L->root, "lm_head", linear_forward, c->vocab_size, c->dim, NULL));
  }
  return nn_module_finalize(L->root);
}

fsdpc_status_t llama_new(const llama_config_t *cfg, const llama_options_t *opt, llama_t **out) {
  ARG_NONNULL(out);
  ARG_NONNULL(cfg);
  *out = NULL;
  llama_options_t defaults = LLAMA_OPTIONS_INIT;
  if (opt == NULL) opt = &defaults;
  FSDPC_TRY(llama_config_check(cfg));
  if (!dtype_is_float(opt->dtype))
    return err_set(STATUS_EDTYPE, "llama: parameter dtype must be f32, bf16 or f16");
  llama_t *L = calloc(1, sizeof *L);
  if (L == NULL) return err_set(STATUS_ENOMEM, "llama: out of host memory");
  L->cfg = *cfg;
  fsdpc_status_t st = STATUS_OK;
  if ((L->layers = calloc((size_t)cfg->n_layers, sizeof(nn_module_t *))) == NULL)
    FSDPC_TRY_GOTO(st, err_set(STATUS_ENOMEM, "llama: out of host memory"));
  FSDPC_TRY_GOTO(st, mesh_new_local("local", opt->device, &L->mesh));
  builder_t b = {L, opt};
  FSDPC_TRY_GOTO(st, build(&b));
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

fsdpc_status_t llama_init_weights(llama_t *m, uint64_t seed) {
  ARG_NONNULL(m);
  nn_param_t **ps;
  int n;
  FSDPC_TRY(nn_named_parameters(m->root, &ps, &n));
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    size_t len = strlen(ps[i]->fqn);
    bool norm = len >= 11 && strcmp(ps[i]->fqn + len - 11, "norm.weight") == 0;
    bool bias = len >= 5 && strcmp(ps[i]->fqn + len - 5, ".bias") == 0;
    st = norm || bias ? nn_init_constant(ps[i], norm ? 1.0 : 0.0)
                      : nn_init_normal(ps[i], seed, 0.0, m->cfg.init_std);
  }
  free(ps);
  return st;
}

nn_module_t *llama_module(const llama_t *m) {
  if (m == NULL) return NULL;
  return m->root;
}
const llama_config_t *llama_get_config(const llama_t *m) { return m ? &m->cfg : NULL; }
nn_module_t *llama_layer(const llama_t *m, int64_t i) {
  if (m == NULL || i < 0 || i >= m->cfg.n_layers) return NULL;
  return m->layers[i];
}
mesh_t *llama_local_mesh(const llama_t *m) {
  if (m == NULL) return NULL;
  return m->mesh;
}

void llama_set_activation_checkpointing(llama_t *m, bool enabled) {
  if (m == NULL) return;
  for (int64_t i = 0; i < m->cfg.n_layers; i++) nn_module_set_checkpoint(m->layers[i], enabled);
}
