#include "nn/layers.h"

#include <math.h>
#include <stdlib.h>

#include "nn/init.h"
#include "nn/layers_impl.h"

/* A layer's settings; the module owns it (nn_module_new_owned). */
typedef struct layer {
  int64_t in; /* Linear: in_features (the init's bound) */
  double eps; /* norms */
  kernel_act_t act;
} layer_t;

static const layer_t *layer_of(nn_module_t *m) { return nn_module_impl(m); }
static nn_param_t *param(nn_module_t *m, const char *name) {
  return nn_module_param_named(m, name);
}

/* ---- forwards ---- */

/* y = x W^T (+ b), or for a Conv1D y = x W (+ b). */
static fsdpc_status_t project(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, bool io,
                              nn_var_t **out) {
  nn_param_t *w = param(m, "weight"), *b = param(m, "bias");
  nn_var_t *y;
  FSDPC_TRY(io ? nn_linear_io(ctx, in, w, b ? &y : out) : nn_linear(ctx, in, w, b ? &y : out));
  if (b == NULL) return STATUS_OK;
  fsdpc_status_t st = nn_bias_add(ctx, y, b, out);
  nn_var_put(y);
  return st;
}

static fsdpc_status_t linear_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  return project(ctx, m, in, false, out);
}

static fsdpc_status_t conv1d_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  return project(ctx, m, in, true, out);
}

static fsdpc_status_t embedding_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                        nn_var_t **out) {
  return nn_embedding(ctx, in, param(m, "weight"), out);
}

static fsdpc_status_t rmsnorm_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  return nn_rmsnorm(ctx, in, param(m, "weight"), layer_of(m)->eps, out);
}

static fsdpc_status_t layernorm_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                        nn_var_t **out) {
  return nn_layernorm(ctx, in, param(m, "weight"), param(m, "bias"), layer_of(m)->eps, out);
}

static fsdpc_status_t activation_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                         nn_var_t **out) {
  return nn_activation(ctx, in, layer_of(m)->act, out);
}

static fsdpc_status_t sequential_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                         nn_var_t **out) {
  *out = NULL;
  nn_var_t *h = nn_var_ref(in);
  for (int i = 0; i < nn_module_num_children(m); i++) {
    nn_var_t *next = NULL;
    fsdpc_status_t st = nn_call(ctx, nn_module_child(m, i), h, &next);
    nn_var_put(h);
    FSDPC_TRY(st);
    h = next;
  }
  *out = h;
  return STATUS_OK;
}

/* ---- construction ---- */

static fsdpc_status_t check_size(const char *name, const char *what, int64_t v) {
  if (v <= 0 || v > ((int64_t)1 << 40))
    return err_set(STATUS_EINVAL, "layer '%s': %s must be a positive size, got %lld", name, what,
                   (long long)v);
  return STATUS_OK;
}

fsdpc_status_t layers_add_param(nn_module_t *m, const char *name, int nd, const int64_t *shape,
                                const nn_layer_options_t *opt) {
  if (!dtype_is_float(opt->dtype))
    return err_set(STATUS_EDTYPE, "layer '%s': parameters must be f32, bf16 or f16",
                   nn_module_name(m));
  mesh_t *local;
  FSDPC_TRY(mesh_local_shared(opt->device, &local));
  device_t dev = mesh_device(local);
  fsdpc_tensor_t t;
  if (opt->deferred)
    FSDPC_TRY(tensor_meta(&t, opt->dtype, dev, nd, shape));
  else
    FSDPC_TRY(tensor_zeros(&t, opt->dtype, dev, nd, shape));
  dtensor_t *dt = NULL;
  placement_t rep = placement_replicate();
  fsdpc_status_t st = dtensor_from_local(&t, local, &rep, nd, shape, &dt);
  tensor_free(&t);
  FSDPC_TRY(st);
  return nn_module_add_param(m, name, dt, true, NULL);
}

/* A parameter of shape [rows] or [rows, cols] (cols 0), zero or meta. */
static fsdpc_status_t add_param(nn_module_t *m, const char *name, int64_t rows, int64_t cols,
                                const nn_layer_options_t *opt) {
  return layers_add_param(m, name, cols > 0 ? 2 : 1, (const int64_t[]){rows, cols}, opt);
}

/* A layer module owning a copy of its settings. */
static fsdpc_status_t make(const char *name, nn_forward_fn fn, const char *kind, const layer_t *cfg,
                           nn_module_t **made) {
  layer_t *impl = malloc(sizeof *impl);
  if (impl == NULL) return err_set(STATUS_ENOMEM, "layers: out of host memory");
  *impl = *cfg;
  FSDPC_TRY(nn_module_new_owned(name, fn, impl, free, made));
  nn_module_set_kind(*made, kind);
  return STATUS_OK;
}

fsdpc_status_t layers_attach(nn_module_t *parent, nn_module_t *m, fsdpc_status_t st,
                             nn_module_t **out) {
  if (st == STATUS_OK && parent != NULL) st = nn_module_add_child(parent, m);
  if (st != STATUS_OK) {
    nn_module_free(m);
    return st;
  }
  if (out) *out = m;
  return STATUS_OK;
}

static const nn_layer_options_t *options(const nn_layer_options_t *opt) {
  static const nn_layer_options_t defaults = NN_LAYER_OPTIONS_INIT;
  return opt ? opt : &defaults;
}

/* A Linear (weight [out, in]) or a Conv1D (weight [in, out]), with a bias [out] when bias. */
static fsdpc_status_t projection_new(nn_module_t *parent, const char *name, bool conv1d,
                                     int64_t in_features, int64_t out_features, bool bias,
                                     const nn_layer_options_t *opt, nn_module_t **out) {
  if (out) *out = NULL;
  opt = options(opt);
  FSDPC_TRY(check_size(name, "in_features", in_features));
  FSDPC_TRY(check_size(name, "out_features", out_features));
  nn_module_t *m;
  FSDPC_TRY(make(name, conv1d ? conv1d_forward : linear_forward, conv1d ? "conv1d" : "linear",
                 &(layer_t){.in = in_features}, &m));
  fsdpc_status_t st = conv1d ? add_param(m, "weight", in_features, out_features, opt)
                             : add_param(m, "weight", out_features, in_features, opt);
  if (st == STATUS_OK && bias) st = add_param(m, "bias", out_features, 0, opt);
  return layers_attach(parent, m, st, out);
}

fsdpc_status_t nn_linear_new(nn_module_t *parent, const char *name, int64_t in_features,
                             int64_t out_features, bool bias, const nn_layer_options_t *opt,
                             nn_module_t **out) {
  return projection_new(parent, name, false, in_features, out_features, bias, opt, out);
}

fsdpc_status_t nn_conv1d_new(nn_module_t *parent, const char *name, int64_t in_features,
                             int64_t out_features, bool bias, const nn_layer_options_t *opt,
                             nn_module_t **out) {
  return projection_new(parent, name, true, in_features, out_features, bias, opt, out);
}

fsdpc_status_t nn_embedding_new(nn_module_t *parent, const char *name, int64_t num_embeddings,
                                int64_t dim, const nn_layer_options_t *opt, nn_module_t **out) {
  if (out) *out = NULL;
  opt = options(opt);
  FSDPC_TRY(check_size(name, "num_embeddings", num_embeddings));
  FSDPC_TRY(check_size(name, "dim", dim));
  nn_module_t *m;
  FSDPC_TRY(make(name, embedding_forward, "embedding", &(layer_t){0}, &m));
  return layers_attach(parent, m, add_param(m, "weight", num_embeddings, dim, opt), out);
}

static fsdpc_status_t check_eps(const char *name, double eps) {
  if (!(eps > 0) || !isfinite(eps))
    return err_set(STATUS_EINVAL, "layer '%s': eps must be positive, got %g", name, eps);
  return STATUS_OK;
}

fsdpc_status_t nn_rmsnorm_new(nn_module_t *parent, const char *name, int64_t dim, double eps,
                              const nn_layer_options_t *opt, nn_module_t **out) {
  if (out) *out = NULL;
  opt = options(opt);
  FSDPC_TRY(check_size(name, "dim", dim));
  FSDPC_TRY(check_eps(name, eps));
  nn_module_t *m;
  FSDPC_TRY(make(name, rmsnorm_forward, "rmsnorm", &(layer_t){.eps = eps}, &m));
  return layers_attach(parent, m, add_param(m, "weight", dim, 0, opt), out);
}

fsdpc_status_t nn_layernorm_new(nn_module_t *parent, const char *name, int64_t dim, double eps,
                                bool bias, const nn_layer_options_t *opt, nn_module_t **out) {
  if (out) *out = NULL;
  opt = options(opt);
  FSDPC_TRY(check_size(name, "dim", dim));
  FSDPC_TRY(check_eps(name, eps));
  nn_module_t *m;
  FSDPC_TRY(make(name, layernorm_forward, "layernorm", &(layer_t){.eps = eps}, &m));
  fsdpc_status_t st = add_param(m, "weight", dim, 0, opt);
  if (st == STATUS_OK && bias) st = add_param(m, "bias", dim, 0, opt);
  return layers_attach(parent, m, st, out);
}

fsdpc_status_t nn_activation_new(nn_module_t *parent, const char *name, kernel_act_t act,
                                 nn_module_t **out) {
  if (out) *out = NULL;
  if (act < 0 || act >= KERNEL_ACT_COUNT)
    return err_set(STATUS_EINVAL, "layer '%s': unknown activation %d", name, (int)act);
  nn_module_t *m;
  FSDPC_TRY(make(name, activation_forward, NULL, &(layer_t){.act = act}, &m));
  return layers_attach(parent, m, STATUS_OK, out);
}

fsdpc_status_t nn_sequential_new(nn_module_t *parent, const char *name, nn_module_t **out) {
  if (out) *out = NULL;
  nn_module_t *m;
  FSDPC_TRY(make(name, sequential_forward, NULL, &(layer_t){0}, &m));
  return layers_attach(parent, m, STATUS_OK, out);
}

/* ---- init ---- */

static fsdpc_status_t reset(nn_module_t *m, uint64_t seed) {
  nn_forward_fn f = nn_module_forward(m);
  nn_param_t *w = param(m, "weight"), *b = param(m, "bias");
  if (f == linear_forward) {
    double bound = 1.0 / sqrt((double)layer_of(m)->in);
    FSDPC_TRY(nn_init_uniform(w, seed, -bound, bound));
    if (b) FSDPC_TRY(nn_init_uniform(b, seed, -bound, bound));
  } else if (f == conv1d_forward) {
    FSDPC_TRY(nn_init_normal(w, seed, 0.0, 0.02));
    if (b) FSDPC_TRY(nn_init_constant(b, 0.0));
  } else if (f == embedding_forward) {
    FSDPC_TRY(nn_init_normal(w, seed, 0.0, 1.0));
  } else if (layers_is_experts(m)) {
    FSDPC_TRY(layers_reset_experts(m, seed));
  } else if (nn_module_param_named(m, "expert_bias") != NULL) {
    FSDPC_TRY(layers_reset_moe(m));
  } else if (f == rmsnorm_forward || f == layernorm_forward) {
    FSDPC_TRY(nn_init_constant(w, 1.0));
    if (b) FSDPC_TRY(nn_init_constant(b, 0.0));
  }
  for (int i = 0; i < nn_module_num_children(m); i++) FSDPC_TRY(reset(nn_module_child(m, i), seed));
  return STATUS_OK;
}

fsdpc_status_t nn_module_reset_parameters(nn_module_t *root, uint64_t seed) {
  if (root == NULL) return err_set(STATUS_EINVAL, "nn_module_reset_parameters: NULL module");
  return reset(root, seed);
}
