/* The operations of the general layers (nn/layers.h): bias, activations, LayerNorm, mean
 * squared error; and the helpers every operation file shares (ops_impl.h). */
#include <string.h>

#include "core/args_impl.h"
#include "core/kernels.h"
#include "nn/ops_impl.h"

/* ---- helpers ---- */

fsdpc_status_t ops_alloc_like(fsdpc_tensor_t *t, const fsdpc_tensor_t *like) {
  return tensor_init(t, like->dtype, like->device, like->ndim, like->shape);
}

fsdpc_status_t ops_zeros_like(fsdpc_tensor_t *t, const fsdpc_tensor_t *like) {
  return tensor_zeros(t, like->dtype, like->device, like->ndim, like->shape);
}

fsdpc_status_t ops_finish(nn_ctx_t *ctx, nn_node_t *node, bool needs, fsdpc_tensor_t *value,
                          nn_var_t **out) {
  fsdpc_status_t st = nn_var_new(value, needs, out);
  /* an operation's result keeps its inputs' tensor-parallel layout (the first recorded one): a
   * residual sum of sequence shards is still sequence shards */
  for (int i = 0; st == STATUS_OK && i < NN_NODE_MAX_IN && node->in[i] && !(*out)->layout; i++)
    (*out)->layout = node->in[i]->layout;
  if (st == STATUS_OK && needs) {
    node->out = *out;
    return nn_record(ctx, node);
  }
  for (int i = 0; i < NN_NODE_MAX_SAVED; i++) tensor_free(&node->saved[i]);
  return st;
}

fsdpc_status_t ops_scalar_of(const fsdpc_tensor_t *t, double *out) {
  if (tensor_numel(t) != 1)
    return err_set(STATUS_EINVAL, "expected one element, got %lld", (long long)tensor_numel(t));
  float f;
  fsdpc_tensor_t h;
  int64_t one = 1;
  FSDPC_TRY(tensor_wrap(&h, &f, DTYPE_F32, device_cpu(), 1, &one));
  fsdpc_tensor_t src;
  FSDPC_TRY(tensor_view(&src, t, 1, &one));
  fsdpc_status_t st = tensor_copy(&h, &src);
  tensor_free(&src);
  tensor_free(&h);
  *out = f;
  return st;
}

static int64_t last_of(const fsdpc_tensor_t *t) { return t->ndim ? t->shape[t->ndim - 1] : 1; }

/* ---- bias ---- */

/* b as the row vector the kernels take: a bias of several dimensions (GPT-2's c_attn's [3, dim],
 * one part of its output each) as one of its numel. A view: free it. */
static fsdpc_status_t vector_of(const fsdpc_tensor_t *b, fsdpc_tensor_t *out) {
  if (b->ndim <= 1) return tensor_ref(out, b);
  int64_t n = tensor_numel(b);
  return tensor_view(out, b, 1, &n);
}

static fsdpc_status_t bias_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *x = n->in[0];
  if (x->requires_grad) {
    fsdpc_tensor_t dx;
    FSDPC_TRY(tensor_ref(&dx, &n->out->grad)); /* d(x + b)/dx = 1 */
    FSDPC_TRY(nn_accumulate_grad(x, &dx));
  }
  if (!n->param->requires_grad) return STATUS_OK;
  fsdpc_tensor_t db, row;
  FSDPC_TRY(nn_param_grad_memory(n->param, true, &db)); /* the parameter's shape */
  fsdpc_status_t st = vector_of(&db, &row);
  if (st == STATUS_OK) st = kernel_bias_backward(&row, &n->out->grad);
  tensor_free(&row);
  if (st != STATUS_OK) {
    tensor_free(&db);
    return st;
  }
  return nn_param_accumulate_grad(n->param, &db);
}

static fsdpc_status_t bias_add(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *b, nn_var_t **out) {
  const fsdpc_tensor_t *B = &b->compute;
  if (B->ndim < 1 || x->value.ndim < 1 || last_of(&x->value) != tensor_numel(B)) {
    char a[96], c[96];
    return err_set(STATUS_ESHAPE, "nn_bias_add (%s): input %s does not end with the bias's %s",
                   b->fqn, tensor_shape_str(x->value.ndim, x->value.shape, a, sizeof a),
                   tensor_shape_str(B->ndim, B->shape, c, sizeof c));
  }
  fsdpc_tensor_t y, row;
  FSDPC_TRY(vector_of(B, &row));
  fsdpc_status_t st = ops_alloc_like(&y, &x->value);
  if (st == STATUS_OK) {
    st = kernel_bias_add(&y, &x->value, &row);
    if (st != STATUS_OK) tensor_free(&y);
  }
  tensor_free(&row);
  if (st != STATUS_OK) return st;
  nn_node_t n = {.backward = bias_backward, .name = "bias_add", .in = {x}, .param = b};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, b), &y, out);
}

fsdpc_status_t nn_bias_add(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *b, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(b);
  ARG_NONNULL(out);
  *out = NULL;
  bool implicit;
  FSDPC_TRY(nn_param_begin(ctx, "nn_bias_add", b, &implicit));
  return nn_param_end(ctx, b, implicit, bias_add(ctx, x, b, out));
}

/* ---- activations ---- */

static const char *const act_names[KERNEL_ACT_COUNT] = {"relu", "gelu", "silu", "gelu_tanh",
                                                        "sigmoid"};

static fsdpc_status_t activation_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *x = n->in[0];
  if (!x->requires_grad) return STATUS_OK;
  fsdpc_tensor_t dx;
  FSDPC_TRY(ops_alloc_like(&dx, &x->value));
  fsdpc_status_t st =
      kernel_activation_backward(&dx, &n->out->grad, &x->value, (kernel_act_t)n->ints[0]);
  if (st != STATUS_OK) {
    tensor_free(&dx);
    return st;
  }
  return nn_accumulate_grad(x, &dx);
}

fsdpc_status_t nn_activation(nn_ctx_t *ctx, nn_var_t *x, kernel_act_t act, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(out);
  *out = NULL;
  if (act < 0 || act >= KERNEL_ACT_COUNT)
    return err_set(STATUS_EINVAL, "nn_activation: unknown activation %d", (int)act);
  fsdpc_tensor_t y;
  FSDPC_TRY(ops_alloc_like(&y, &x->value));
  fsdpc_status_t st = kernel_activation(&y, &x->value, act);
  if (st != STATUS_OK) {
    tensor_free(&y);
    return st;
  }
  nn_node_t n = {
      .backward = activation_backward, .name = act_names[act], .in = {x}, .ints = {act, 0}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, NULL), &y, out);
}

/* ---- LayerNorm ---- */

/* The node's parameter is the weight; its user pointer the bias (or NULL). */
static fsdpc_status_t layernorm_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *x = n->in[0];
  nn_param_t *w = n->param, *b = n->user;
  fsdpc_tensor_t dx = {0}, dw = {0}, db = {0};
  fsdpc_status_t st = ops_alloc_like(&dx, &x->value);
  if (st == STATUS_OK) st = nn_param_grad_memory(w, true, &dw);
  if (st == STATUS_OK && b != NULL) st = nn_param_grad_memory(b, true, &db);
  if (st == STATUS_OK)
    st = kernel_layernorm_backward(&dx, &dw, b ? &db : NULL, &n->out->grad, &x->value, &w->compute,
                                   &n->saved[0], &n->saved[1]);
  if (st == STATUS_OK && x->requires_grad) st = nn_accumulate_grad(x, &dx);
  if (st == STATUS_OK && w->requires_grad) st = nn_param_accumulate_grad(w, &dw);
  if (st == STATUS_OK && b != NULL && b->requires_grad) st = nn_param_accumulate_grad(b, &db);
  tensor_free(&dx);
  tensor_free(&dw);
  tensor_free(&db);
  return st;
}

static fsdpc_status_t layernorm(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, nn_param_t *b,
                                double eps, nn_var_t **out) {
  int64_t D = last_of(&x->value), rows = D ? tensor_numel(&x->value) / D : 0;
  fsdpc_tensor_t y, mean = {0}, rstd = {0};
  FSDPC_TRY(ops_alloc_like(&y, &x->value));
  fsdpc_status_t st = tensor_init(&mean, DTYPE_F32, x->value.device, 1, &rows);
  if (st == STATUS_OK) st = tensor_init(&rstd, DTYPE_F32, x->value.device, 1, &rows);
  if (st == STATUS_OK)
    st = kernel_layernorm(&y, &mean, &rstd, &x->value, &w->compute, b ? &b->compute : NULL,
                          (float)eps);
  if (st != STATUS_OK) {
    tensor_free(&y);
    tensor_free(&mean);
    tensor_free(&rstd);
    return st;
  }
  bool needs = nn_needs_grad(ctx, &x, 1, w) || (b != NULL && nn_needs_grad(ctx, NULL, 0, b));
  nn_node_t n = {.backward = layernorm_backward,
                 .name = "layernorm",
                 .in = {x},
                 .param = w,
                 .user = b,
                 .saved = {mean, rstd}};
  return ops_finish(ctx, &n, needs, &y, out);
}

fsdpc_status_t nn_layernorm(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, nn_param_t *b, double eps,
                            nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(w);
  ARG_NONNULL(out);
  *out = NULL;
  bool iw, ib = false;
  FSDPC_TRY(nn_param_begin(ctx, "nn_layernorm", w, &iw));
  fsdpc_status_t st = b ? nn_param_begin(ctx, "nn_layernorm", b, &ib) : STATUS_OK;
  if (st == STATUS_OK) st = nn_param_end(ctx, b, ib, layernorm(ctx, x, w, b, eps, out));
  return nn_param_end(ctx, w, iw, st);
}

/* ---- mean squared error ---- */

/* saved[0] holds pred - target; scalar the number of elements. */
static fsdpc_status_t mse_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *pred = n->in[0];
  if (!pred->requires_grad) return STATUS_OK;
  double dloss = 0;
  FSDPC_TRY(ops_scalar_of(&n->out->grad, &dloss));
  fsdpc_tensor_t d;
  FSDPC_TRY(tensor_clone(&d, &n->saved[0], pred->value.dtype, pred->value.device));
  fsdpc_status_t st = kernel_scale(&d, (float)(2.0 * dloss / n->scalar));
  if (st != STATUS_OK) {
    tensor_free(&d);
    return st;
  }
  return nn_accumulate_grad(pred, &d);
}

fsdpc_status_t nn_mse_loss(nn_ctx_t *ctx, nn_var_t *pred, const fsdpc_tensor_t *target,
                           nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(pred);
  ARG_NONNULL(target);
  ARG_NONNULL(out);
  *out = NULL;
  if (!tensor_same_shape(&pred->value, target)) {
    char a[96], b[96];
    return err_set(STATUS_ESHAPE, "nn_mse_loss: prediction %s and target %s differ in shape",
                   tensor_shape_str(pred->value.ndim, pred->value.shape, a, sizeof a),
                   tensor_shape_str(target->ndim, target->shape, b, sizeof b));
  }
  if (!dtype_is_float(pred->value.dtype) || !dtype_is_float(target->dtype))
    return err_set(STATUS_EDTYPE,
                   "nn_mse_loss: prediction %s and target %s: both take a floating-point dtype",
                   dtype_name(pred->value.dtype), dtype_name(target->dtype));
  int64_t n = tensor_numel(target);
  if (n == 0) return err_set(STATUS_EINVAL, "nn_mse_loss: empty tensors");
  /* the difference in f32, whatever the storage dtypes: diff = pred - target */
  fsdpc_tensor_t diff, t32 = {0}, loss = {0};
  FSDPC_TRY(tensor_clone(&diff, &pred->value, DTYPE_F32, pred->value.device));
  fsdpc_status_t st = tensor_clone(&t32, target, DTYPE_F32, pred->value.device);
  if (st == STATUS_OK) st = kernel_axpy(&diff, -1.0f, &t32);
  tensor_free(&t32);
  double ss = 0;
  if (st == STATUS_OK) st = kernel_sum_squares(&diff, &ss);
  int64_t one = 1;
  if (st == STATUS_OK) st = tensor_init(&loss, DTYPE_F32, pred->value.device, 0, &one);
  if (st == STATUS_OK) st = tensor_fill(&loss, ss / (double)n);
  if (st != STATUS_OK) {
    tensor_free(&diff);
    tensor_free(&loss);
    return st;
  }
  nn_node_t node = {.backward = mse_backward,
                    .name = "mse_loss",
                    .in = {pred},
                    .saved = {diff},
                    .scalar = (double)n};
  return ops_finish(ctx, &node, nn_needs_grad(ctx, &pred, 1, NULL), &loss, out);
}
