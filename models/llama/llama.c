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
#include "nn/moe.h"
#include "nn/ops.h"

struct llama {
  llama_config_t cfg;
  mesh_t *mesh;
  nn_module_t *root;
  nn_module_t **layers;
  fsdpc_tensor_t positions; /* GPT-2: the last forward's position ids [B, T], reused */
  nn_moe_aux_t *aux;        /* Qwen3-MoE's load-balancing loss, when it has one */
  int64_t *starts;          /* llama_set_stage_splits: each stage's first block, then L */
  int split_stages;         /* the stage count they are for (0: even splits) */
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

static fsdpc_status_t layernorm_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                        nn_var_t **out) {
  return nn_layernorm(ctx, in, weight_of(m), nn_module_param_named(m, "bias"), cfg_of(m)->norm_eps,
                      out);
}

/* GPT-2's projections: weight [in, out] (transformers' Conv1D) and a bias. */
static fsdpc_status_t conv1d_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *y = NULL;
  FSDPC_TRY(nn_linear_io(ctx, in, weight_of(m), &y));
  fsdpc_status_t st = nn_bias_add(ctx, y, nn_module_param_named(m, "bias"), out);
  nn_var_put(y);
  return st;
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
  /* heads in the model's proportion (under tensor parallelism: each split alike) */
  int64_t wq = q->value.shape[2], wk = k->value.shape[2], wv = v->value.shape[2];
  if (wq % hd != 0 || wk % hd != 0 || wk != wv ||
      (wq / hd) * c->n_kv_heads != (wk / hd) * c->n_heads)
    FSDPC_TRY_GOTO(st, err_set(STATUS_ESHAPE,
                               "%s: q_proj, k_proj and v_proj give %lld, %lld and %lld features, "
                               "not %lld query heads to %lld key/value heads of %lld: under "
                               "tensor parallelism the three must split their heads alike (the "
                               "same rule, colwise)",
                               nn_module_fqn(m), (long long)wq, (long long)wk, (long long)wv,
                               (long long)c->n_heads, (long long)c->n_kv_heads, (long long)hd));
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
  if (g->value.shape[g->value.ndim - 1] != u->value.shape[u->value.ndim - 1])
    FSDPC_TRY_GOTO(st, err_set(STATUS_ESHAPE,
                               "%s: gate_proj gives %lld features and up_proj %lld: under tensor "
                               "parallelism the two must split them alike (the same rule, "
                               "colwise)",
                               nn_module_fqn(m), (long long)g->value.shape[g->value.ndim - 1],
                               (long long)u->value.shape[u->value.ndim - 1]));
  FSDPC_TRY_GOTO(st, nn_silu_mul(ctx, g, u, &s));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "down_proj", s, out));
cleanup:
  nn_var_put(g);
  nn_var_put(u);
  nn_var_put(s);
  return st;
}

/* GPT-2's attention: q, k and v from the fused c_attn, causal, no rotation. */
static fsdpc_status_t gpt2_attention_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                             nn_var_t **out) {
  const llama_config_t *c = cfg_of(m);
  int64_t hd = llama_head_dim(c);
  if (in->value.ndim != 3)
    return err_set(STATUS_ESHAPE, "%s: input must be [B, T, D]", nn_module_fqn(m));
  nn_var_t *qkv = NULL, *p[3] = {NULL, NULL, NULL}, *h[3] = {NULL, NULL, NULL}, *a = NULL,
           *a3 = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "c_attn", in, &qkv));
  int64_t w = qkv->value.shape[2] / 3;
  for (int i = 0; i < 3; i++) {
    FSDPC_TRY_GOTO(st, nn_narrow(ctx, qkv, 2, i * w, w, &p[i]));
    FSDPC_TRY_GOTO(st, split_heads(ctx, p[i], hd, &h[i]));
  }
  FSDPC_TRY_GOTO(st, nn_attention(ctx, h[0], h[1], h[2], &a));
  int64_t shape[3] = {in->value.shape[0], in->value.shape[1], w};
  FSDPC_TRY_GOTO(st, nn_view(ctx, a, 3, shape, &a3));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "c_proj", a3, out));
cleanup:;
  nn_var_t *vars[] = {qkv, p[0], p[1], p[2], h[0], h[1], h[2], a, a3};
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) nn_var_put(vars[i]);
  return st;
}

static fsdpc_status_t gpt2_mlp_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                       nn_var_t **out) {
  nn_var_t *f = NULL, *g = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "c_fc", in, &f));
  FSDPC_TRY_GOTO(st, nn_activation(ctx, f, KERNEL_ACT_GELU_TANH, &g));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, "c_proj", g, out));
cleanup:
  nn_var_put(f);
  nn_var_put(g);
  return st;
}

/* x + attn(norm1(x)), then + mlp(norm2(.)), under each architecture's names. */
static fsdpc_status_t block_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  static const char *const names[2][3] = {
      {"input_layernorm", "self_attn", "post_attention_layernorm"}, {"ln_1", "attn", "ln_2"}};
  const char *const *n = names[cfg_of(m)->arch == LLAMA_ARCH_GPT2];
  nn_var_t *r = NULL, *a = NULL, *h = NULL, *r2 = NULL, *f = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, call_child(ctx, m, n[0], in, &r));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, n[1], r, &a));
  FSDPC_TRY_GOTO(st, nn_add(ctx, in, a, &h));
  FSDPC_TRY_GOTO(st, call_child(ctx, m, n[2], h, &r2));
  /* the MLP: mlp, or Mixtral's block_sparse_moe; the block's fourth child either way */
  FSDPC_TRY_GOTO(st, nn_call(ctx, nn_module_child(m, 3), r2, &f));
  FSDPC_TRY_GOTO(st, nn_add(ctx, h, f, out));
cleanup:
  nn_var_put(r);
  nn_var_put(a);
  nn_var_put(h);
  nn_var_put(r2);
  nn_var_put(f);
  return st;
}

/* The position ids 0..T-1 of every row of ids [B, T], on ids' device: built once per shape. */
static fsdpc_status_t gpt2_positions(llama_t *L, const fsdpc_tensor_t *ids, fsdpc_tensor_t *out) {
  fsdpc_tensor_t *pos = &L->positions;
  if (pos->data == NULL || !tensor_same_shape(pos, ids) ||
      !device_equal(pos->device, ids->device)) {
    tensor_free(pos);
    fsdpc_tensor_t host;
    FSDPC_TRY(tensor_init(&host, DTYPE_I64, device_cpu(), 2, ids->shape));
    for (int64_t b = 0; b < ids->shape[0]; b++)
      for (int64_t t = 0; t < ids->shape[1]; t++) ((int64_t *)host.data)[b * ids->shape[1] + t] = t;
    if (ids->device.type == DEVICE_CPU) {
      *pos = host;
    } else {
      fsdpc_status_t st = tensor_upload(pos, &host, ids->device);
      tensor_free(&host);
      FSDPC_TRY(st);
    }
  }
  return tensor_ref(out, pos);
}

/* GPT-2's input: token embeddings plus the learned embeddings of positions 0..T-1. */
static fsdpc_status_t gpt2_embed(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *ids, nn_var_t **out) {
  fsdpc_tensor_t pos;
  FSDPC_TRY(gpt2_positions(nn_module_impl(m), &ids->value, &pos));
  nn_var_t *p = NULL, *tok = NULL, *pe = NULL;
  fsdpc_status_t st = nn_var_new(&pos, false, &p);
  if (st == STATUS_OK) st = call_child(ctx, m, "wte", ids, &tok);
  if (st == STATUS_OK) st = call_child(ctx, m, "wpe", p, &pe);
  if (st == STATUS_OK) st = nn_add(ctx, tok, pe, out);
  nn_var_put(p);
  nn_var_put(tok);
  nn_var_put(pe);
  return st;
}

/* Blocks [first, last) on *h, whose reference each call passes on. */
static fsdpc_status_t run_blocks(nn_ctx_t *ctx, const llama_t *L, int64_t first, int64_t last,
                                 nn_var_t **h) {
  for (int64_t i = first; i < last; i++) {
    nn_var_t *next = NULL;
    fsdpc_status_t st = nn_call(ctx, L->layers[i], *h, &next);
    nn_var_put(*h);
    *h = next;
    FSDPC_TRY(st);
  }
  return STATUS_OK;
}

/* The embedding of ids under the body m ("model" or "transformer"). */
static fsdpc_status_t embed(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *ids, nn_var_t **out) {
  const llama_t *L = nn_module_impl(m);
  return L->cfg.arch == LLAMA_ARCH_GPT2 ? gpt2_embed(ctx, m, ids, out)
                                        : call_child(ctx, m, "embed_tokens", ids, out);
}

/* The root's child holding the embeddings, blocks and final norm. */
static const char *body_name(const llama_t *L) {
  return L->cfg.arch == LLAMA_ARCH_GPT2 ? "transformer" : "model";
}

static const char *final_norm(const llama_t *L) {
  return L->cfg.arch == LLAMA_ARCH_GPT2 ? "ln_f" : "norm";
}

static fsdpc_status_t model_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  const llama_t *L = nn_module_impl(m);
  nn_var_t *h = NULL;
  FSDPC_TRY(embed(ctx, m, in, &h));
  fsdpc_status_t st = run_blocks(ctx, L, 0, L->cfg.n_layers, &h);
  if (st == STATUS_OK) st = call_child(ctx, m, final_norm(L), h, out);
  nn_var_put(h);
  return st;
}

/* The head (root's child lm_head) on h: the logits, vocab_size wide (the padded rows' columns
 * left out). */
static fsdpc_status_t head(nn_ctx_t *ctx, const llama_t *L, nn_var_t *h, nn_var_t **out) {
  nn_var_t *logits = NULL;
  FSDPC_TRY(call_child(ctx, L->root, "lm_head", h, &logits));
  if (llama_vocab_rows(&L->cfg) == L->cfg.vocab_size) {
    *out = logits;
    return STATUS_OK;
  }
  fsdpc_status_t st = nn_narrow(ctx, logits, logits->value.ndim - 1, 0, L->cfg.vocab_size, out);
  nn_var_put(logits);
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
  FSDPC_TRY(call_child(ctx, m, body_name(L), in, &h));
  fsdpc_status_t st = head(ctx, L, h, out);
  nn_var_put(h);
  return st;
}

bool llama_stage_range(const llama_t *m, int stage, int n_stages, int64_t *first, int64_t *end) {
  if (m == NULL || first == NULL || end == NULL || n_stages < 1 || n_stages > m->cfg.n_layers ||
      stage < 0 || stage >= n_stages)
    return false;
  int64_t L = m->cfg.n_layers;
  if (m->split_stages == n_stages) {
    *first = m->starts[stage];
    *end = m->starts[stage + 1];
  } else {
    *first = stage * L / n_stages;
    *end = (stage + 1) * L / n_stages;
  }
  return true;
}

fsdpc_status_t llama_set_stage_splits(llama_t *m, const int64_t *first_blocks, int n_stages) {
  ARG_NONNULL(m);
  ARG_NONNULL(first_blocks);
  int64_t L = m->cfg.n_layers;
  bool ok = n_stages >= 1 && n_stages <= L && first_blocks[0] == 0;
  for (int s = 1; s < n_stages && ok; s++)
    ok = first_blocks[s] > first_blocks[s - 1] && first_blocks[s] < L;
  if (!ok)
    return err_set(STATUS_EINVAL,
                   "llama_set_stage_splits: %d stages' first blocks must rise from 0 below the "
                   "model's %lld blocks",
                   n_stages, (long long)L);
  int64_t *starts = malloc(sizeof *starts * (size_t)(n_stages + 1));
  if (starts == NULL) return err_set(STATUS_ENOMEM, "llama_set_stage_splits: out of host memory");
  memcpy(starts, first_blocks, sizeof *starts * (size_t)n_stages);
  starts[n_stages] = L;
  free(m->starts);
  m->starts = starts;
  m->split_stages = n_stages;
  return STATUS_OK;
}

fsdpc_status_t llama_stage_forward(nn_ctx_t *ctx, llama_t *m, int stage, int n_stages, nn_var_t *in,
                                   nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(m);
  ARG_NONNULL(in);
  ARG_NONNULL(out);
  *out = NULL;
  int64_t L = m->cfg.n_layers;
  if (n_stages < 1 || n_stages > L || stage < 0 || stage >= n_stages)
    return err_set(STATUS_EINVAL,
                   "llama_stage_forward: stage %d of %d (the model's %lld blocks take 1 to %lld "
                   "stages)",
                   stage, n_stages, (long long)L, (long long)L);
  nn_module_t *body = nn_module_child_named(m->root, body_name(m));
  nn_var_t *h = nn_var_ref(in);
  fsdpc_status_t st = STATUS_OK;
  if (stage == 0) {
    nn_var_t *e = NULL;
    st = embed(ctx, body, h, &e);
    nn_var_put(h);
    h = e;
  }
  int64_t b0, b1;
  llama_stage_range(m, stage, n_stages, &b0, &b1);
  if (st == STATUS_OK) st = run_blocks(ctx, m, b0, b1, &h);
  if (st == STATUS_OK && stage == n_stages - 1) {
    nn_var_t *normed = NULL, *logits = NULL;
    st = call_child(ctx, body, final_norm(m), h, &normed);
    if (st == STATUS_OK) st = head(ctx, m, normed, &logits);
    nn_var_put(normed);
    nn_var_put(h);
    h = logits;
  }
  if (st != STATUS_OK) {
    nn_var_put(h);
    return st;
  }
  *out = h;
  return STATUS_OK;
}

int llama_stage_modules(const llama_t *m, int stage, int n_stages, nn_module_t **out, int cap) {
  if (m == NULL || out == NULL || n_stages < 1 || n_stages > m->cfg.n_layers || stage < 0 ||
      stage >= n_stages)
    return -1;
  int64_t b0, b1;
  llama_stage_range(m, stage, n_stages, &b0, &b1);
  nn_module_t *body = nn_module_child_named(m->root, body_name(m));
  nn_module_t *all[4096 + 4];
  int n = 0;
  if (stage == 0) {
    bool gpt2 = m->cfg.arch == LLAMA_ARCH_GPT2;
    all[n++] = nn_module_child_named(body, gpt2 ? "wte" : "embed_tokens");
    if (gpt2) all[n++] = nn_module_child_named(body, "wpe");
  }
  for (int64_t i = b0; i < b1 && n < 4096; i++) all[n++] = m->layers[i];
  if (stage == n_stages - 1) {
    all[n++] = nn_module_child_named(body, final_norm(m));
    all[n++] = nn_module_child_named(m->root, "lm_head");
    if (m->cfg.tie_embeddings && stage > 0) /* the token embedding whose weight the head uses */
      all[n++] =
          nn_module_child_named(body, m->cfg.arch == LLAMA_ARCH_GPT2 ? "wte" : "embed_tokens");
  }
  for (int i = 0; i < n && i < cap; i++) out[i] = all[i];
  return n;
}

/* ---- construction ---- */

typedef struct builder {
  llama_t *L;
  const llama_options_t *opt;
} builder_t;

static fsdpc_status_t add_param_shaped(builder_t *b, nn_module_t *m, const char *name, int nd,
                                       const int64_t *shape, nn_param_t **out) {
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

static fsdpc_status_t add_param(builder_t *b, nn_module_t *m, const char *name, int64_t rows,
                                int64_t cols, nn_param_t **out) {
  int64_t shape[2] = {rows, cols};
  return add_param_shaped(b, m, name, cols > 0 ? 2 : 1, shape, out);
}

/* A leaf module with a weight of [rows, cols] (cols 0: a vector) added to parent. */
static fsdpc_status_t add_leaf(builder_t *b, nn_module_t *parent, const char *name,
                               nn_forward_fn fn, int64_t rows, int64_t cols, nn_module_t **out) {
  nn_module_t *m;
  FSDPC_TRY(nn_module_new(name, fn, b->L, &m));
  nn_module_set_kind(m, fn == linear_forward      ? "linear"
                        : fn == embedding_forward ? "embedding"
                        : fn == rmsnorm_forward   ? "rmsnorm"
                        : fn == layernorm_forward ? "layernorm"
                        : fn == conv1d_forward    ? "conv1d"
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
  if (llama_layer_is_moe(c, i)) { /* Qwen3-MoE's sparse layer: mlp.gate, mlp.experts.*;
                                   * Mixtral's block_sparse_moe.gate, .experts.{w1, w3, w2} */
    nn_layer_options_t lo = {
        .dtype = b->opt->dtype, .device = b->opt->device, .deferred = b->opt->deferred};
    bool mixtral = c->arch == LLAMA_ARCH_MIXTRAL;
    nn_module_t *moe = NULL;
    FSDPC_TRY(nn_moe_new(blk, mixtral ? "block_sparse_moe" : "mlp", c->dim, c->moe_ffn_dim,
                         (int)c->n_experts, (int)c->top_k, c->norm_topk, &lo, &moe));
    if (mixtral) FSDPC_TRY(nn_moe_name_experts(moe, "w1", "w3", "w2"));
    if (c->shared_ffn_dim > 0) /* Qwen2-MoE's: mlp.shared_expert, mlp.shared_expert_gate */
      FSDPC_TRY(nn_moe_add_gated_shared_expert(moe, c->shared_ffn_dim, &lo));
  } else {
    FSDPC_TRY(add_container(b, blk, "mlp", mlp_forward, &mlp));
    FSDPC_TRY(add_leaf(b, mlp, "gate_proj", linear_forward, c->ffn_dim, c->dim, NULL));
    FSDPC_TRY(add_leaf(b, mlp, "up_proj", linear_forward, c->ffn_dim, c->dim, NULL));
    FSDPC_TRY(add_leaf(b, mlp, "down_proj", linear_forward, c->dim, c->ffn_dim, NULL));
  }
  nn_module_set_checkpoint(blk, b->opt->activation_checkpointing);
  return STATUS_OK;
}

/* A LayerNorm (weight and bias of [dim]) or a Conv1D projection (weight [in, out], bias [out]). */
static fsdpc_status_t add_with_bias(builder_t *b, nn_module_t *parent, const char *name,
                                    nn_forward_fn fn, int64_t rows, int64_t cols) {
  nn_module_t *m;
  FSDPC_TRY(add_leaf(b, parent, name, fn, rows, cols, &m));
  return add_param(b, m, "bias", cols > 0 ? cols : rows, 0, NULL);
}

/* GPT-2's transformer.h.{i}: ln_1, attn.{c_attn, c_proj}, ln_2, mlp.{c_fc, c_proj}. */
static fsdpc_status_t build_gpt2_block(builder_t *b, nn_module_t *h, int64_t i) {
  const llama_config_t *c = &b->L->cfg;
  char name[24];
  snprintf(name, sizeof name, "%lld", (long long)i);
  nn_module_t *blk, *attn, *mlp;
  FSDPC_TRY(add_container(b, h, name, block_forward, &blk));
  b->L->layers[i] = blk;
  FSDPC_TRY(add_with_bias(b, blk, "ln_1", layernorm_forward, c->dim, 0));
  FSDPC_TRY(add_container(b, blk, "attn", gpt2_attention_forward, &attn));
  /* c_attn: weight [dim, 3, dim] and bias [3, dim], transformers' [dim, 3 dim] and [3 dim] with
   * q, k and v each a dimension of its own, so that tensor parallelism splits each by head */
  nn_module_t *qkv;
  FSDPC_TRY(add_leaf(b, attn, "c_attn", conv1d_forward, 0, 0, &qkv));
  FSDPC_TRY(add_param_shaped(b, qkv, "weight", 3, (const int64_t[]){c->dim, 3, c->dim}, NULL));
  FSDPC_TRY(add_param_shaped(b, qkv, "bias", 2, (const int64_t[]){3, c->dim}, NULL));
  FSDPC_TRY(add_with_bias(b, attn, "c_proj", conv1d_forward, c->dim, c->dim));
  FSDPC_TRY(add_with_bias(b, blk, "ln_2", layernorm_forward, c->dim, 0));
  FSDPC_TRY(add_container(b, blk, "mlp", gpt2_mlp_forward, &mlp));
  FSDPC_TRY(add_with_bias(b, mlp, "c_fc", conv1d_forward, c->dim, c->ffn_dim));
  FSDPC_TRY(add_with_bias(b, mlp, "c_proj", conv1d_forward, c->ffn_dim, c->dim));
  nn_module_set_checkpoint(blk, b->opt->activation_checkpointing);
  return STATUS_OK;
}

/* GPT-2's tree: transformer.{wte, wpe, h.{i}, ln_f}, lm_head (sharing wte's weight if tied). */
static fsdpc_status_t build_gpt2(builder_t *b) {
  llama_t *L = b->L;
  const llama_config_t *c = &L->cfg;
  nn_module_t *body, *h, *wte, *head;
  FSDPC_TRY(nn_module_new("", causal_lm_forward, L, &L->root));
  FSDPC_TRY(add_container(b, L->root, "transformer", model_forward, &body));
  FSDPC_TRY(add_leaf(b, body, "wte", embedding_forward, llama_vocab_rows(c), c->dim, &wte));
  FSDPC_TRY(add_leaf(b, body, "wpe", embedding_forward, c->max_seq_len, c->dim, NULL));
  FSDPC_TRY(add_container(b, body, "h", NULL, &h));
  for (int64_t i = 0; i < c->n_layers; i++) FSDPC_TRY(build_gpt2_block(b, h, i));
  FSDPC_TRY(add_with_bias(b, body, "ln_f", layernorm_forward, c->dim, 0));
  if (c->tie_embeddings) {
    FSDPC_TRY(add_container(b, L->root, "lm_head", linear_forward, &head));
    FSDPC_TRY(nn_module_share_param(head, weight_of(wte)));
  } else {
    FSDPC_TRY(add_leaf(b, L->root, "lm_head", linear_forward, llama_vocab_rows(c), c->dim, NULL));
  }
  return nn_module_finalize(L->root);
}

static fsdpc_status_t build(builder_t *b) {
  llama_t *L = b->L;
  const llama_config_t *c = &L->cfg;
  if (c->arch == LLAMA_ARCH_GPT2) return build_gpt2(b);
  nn_module_t *model, *layers, *embed, *head;
  FSDPC_TRY(nn_module_new("", causal_lm_forward, L, &L->root));
  FSDPC_TRY(add_container(b, L->root, "model", model_forward, &model));
  FSDPC_TRY(
      add_leaf(b, model, "embed_tokens", embedding_forward, llama_vocab_rows(c), c->dim, &embed));
  FSDPC_TRY(add_container(b, model, "layers", NULL, &layers));
  for (int64_t i = 0; i < c->n_layers; i++) FSDPC_TRY(build_block(b, layers, i));
  FSDPC_TRY(add_leaf(b, model, "norm", rmsnorm_forward, c->dim, 0, NULL));
  if (c->tie_embeddings) {
    FSDPC_TRY(add_container(b, L->root, "lm_head", linear_forward, &head));
    FSDPC_TRY(nn_module_share_param(head, weight_of(embed)));
  } else {
    FSDPC_TRY(add_leaf(b, L->root, "lm_head", linear_forward, llama_vocab_rows(c), c->dim, NULL));
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
  if (llama_num_moe_layers(cfg) >
      0) { /* the routers' statistics, and their load-balancing loss when weighted */
    FSDPC_TRY_GOTO(
        st, nn_moe_aux_new((int)cfg->n_experts, (int)cfg->top_k, cfg->aux_loss_coef, &L->aux));
    FSDPC_TRY_GOTO(st, nn_moe_aux_attach(L->root, L->aux, NULL));
  }
  *out = L;
  return STATUS_OK;
cleanup:
  llama_free(L);
  return st;
}

void llama_free(llama_t *m) {
  if (m == NULL) return;
  nn_module_free(m->root);
  nn_moe_aux_free(m->aux);
  tensor_free(&m->positions);
  mesh_free(m->mesh);
  free(m->layers);
  free(m->starts);
  free(m);
}

fsdpc_status_t llama_init_weights(llama_t *m, uint64_t seed) {
  ARG_NONNULL(m);
  nn_param_t **ps;
  int n;
  FSDPC_TRY(nn_named_parameters(m->root, &ps, &n));
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    if (tensor_is_meta(dtensor_local(ps[i]->value))) continue; /* another pipeline stage's */
    const char *fqn = ps[i]->fqn;
    size_t len = strlen(fqn);
    bool bias = len >= 5 && strcmp(fqn + len - 5, ".bias") == 0;
    bool norm = (len >= 11 && strcmp(fqn + len - 11, "norm.weight") == 0) ||
                (strstr(fqn, ".ln_") != NULL && !bias); /* GPT-2's ln_1, ln_2, ln_f */
    /* GPT-2's residual projections: N(0, std / sqrt(2 n_layers)), as transformers does */
    bool scaled =
        m->cfg.arch == LLAMA_ARCH_GPT2 && len >= 14 && strcmp(fqn + len - 14, "c_proj.weight") == 0;
    double std = m->cfg.init_std / (scaled ? sqrt(2.0 * (double)m->cfg.n_layers) : 1.0);
    st = norm || bias ? nn_init_constant(ps[i], norm ? 1.0 : 0.0)
                      : nn_init_normal(ps[i], seed, 0.0, std);
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
