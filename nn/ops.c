#include "nn/ops.h"

#include <math.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/kernels.h"
#include "nn/ops_impl.h"

/* ---- linear ---- */

/* w as the matrix a product takes: itself, or with io [in, out...] as [in, prod(out...)] (a
 * fused projection stored [in, k, out / k], as GPT-2's c_attn, so that tensor parallelism
 * splits each of its k parts). A view: free it. */
static fsdpc_status_t matrix_of(const fsdpc_tensor_t *w, fsdpc_tensor_t *out) {
  if (w->ndim <= 2) return tensor_ref(out, w);
  int64_t shape[2] = {w->shape[0], w->shape[0] ? tensor_numel(w) / w->shape[0] : 0};
  return tensor_view(out, w, 2, shape);
}

/* The backward of y = x @ w^T (ints[0] 0: w [out, in]) or y = x @ w (ints[0] 1: w [in, out...]). */
static fsdpc_status_t linear_backward_matrix(nn_node_t *n, const fsdpc_tensor_t *w);

static fsdpc_status_t linear_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  fsdpc_tensor_t w;
  FSDPC_TRY(matrix_of(&n->param->compute, &w));
  fsdpc_status_t st = linear_backward_matrix(n, &w);
  tensor_free(&w);
  return st;
}

static fsdpc_status_t linear_backward_matrix(nn_node_t *n, const fsdpc_tensor_t *w) {
  nn_var_t *x = n->in[0];
  const fsdpc_tensor_t *dy = &n->out->grad;
  bool io = n->ints[0] != 0;
  fsdpc_tensor_t *into = NULL;
  if (x->requires_grad) FSDPC_TRY(nn_grad_to_add_into(x, &into));
  if (into != NULL) { /* x feeds several products (q, k and v; gate and up): add in place */
    FSDPC_TRY(kernel_matmul(into, dy, false, w, io, 1.0f, 1.0f));
  } else if (x->requires_grad) {
    fsdpc_tensor_t dx;
    FSDPC_TRY(ops_alloc_like(&dx, &x->value));
    fsdpc_status_t st = kernel_matmul(&dx, dy, false, w, io, 1.0f, 0.0f);
    if (st != STATUS_OK) {
      tensor_free(&dx);
      return st;
    }
    FSDPC_TRY(nn_accumulate_grad(x, &dx));
  }
  if (n->param->requires_grad) {
    fsdpc_tensor_t dw, dwm;
    FSDPC_TRY(nn_param_grad_memory(n->param, false, &dw)); /* the parameter's shape */
    fsdpc_status_t st = matrix_of(&dw, &dwm);
    if (st == STATUS_OK)
      st = io ? kernel_matmul(&dwm, &x->value, true, dy, false, 1.0f, 0.0f)
              : kernel_matmul(&dwm, dy, true, &x->value, false, 1.0f, 0.0f);
    tensor_free(&dwm);
    if (st != STATUS_OK) {
      tensor_free(&dw);
      return st;
    }
    FSDPC_TRY(nn_param_accumulate_grad(n->param, &dw));
  }
  return STATUS_OK;
}

/* y = x @ w^T (w [out, in]), or with io y = x @ w (w [in, out...], its trailing dims taken as
 * one). */
static fsdpc_status_t linear_matrix(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w,
                                    const fsdpc_tensor_t *W, bool io, nn_var_t **out);

static fsdpc_status_t linear(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, bool io, nn_var_t **out) {
  const fsdpc_tensor_t *C = &w->compute;
  if (!io && C->ndim != 2) {
    char b[96];
    return err_set(STATUS_ESHAPE, "nn_linear (%s): weight %s is not a matrix", w->fqn,
                   tensor_shape_str(C->ndim, C->shape, b, sizeof b));
  }
  if (C->ndim < 2) {
    char b[96];
    return err_set(STATUS_ESHAPE, "nn_linear_io (%s): weight %s has fewer than two dimensions",
                   w->fqn, tensor_shape_str(C->ndim, C->shape, b, sizeof b));
  }
  fsdpc_tensor_t W;
  FSDPC_TRY(matrix_of(C, &W));
  fsdpc_status_t st = linear_matrix(ctx, x, w, &W, io, out);
  tensor_free(&W);
  return st;
}

static fsdpc_status_t linear_matrix(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w,
                                    const fsdpc_tensor_t *W, bool io, nn_var_t **out) {
  int in = io ? 0 : 1;
  if (W->ndim != 2 || x->value.ndim < 1 || x->value.shape[x->value.ndim - 1] != W->shape[in]) {
    char a[96], b[96];
    return err_set(STATUS_ESHAPE, "%s (%s): input %s does not match weight %s",
                   io ? "nn_linear_io" : "nn_linear", w->fqn,
                   tensor_shape_str(x->value.ndim, x->value.shape, a, sizeof a),
                   tensor_shape_str(W->ndim, W->shape, b, sizeof b));
  }
  int64_t shape[TENSOR_MAX_DIMS];
  memcpy(shape, x->value.shape, sizeof shape);
  shape[x->value.ndim - 1] = W->shape[1 - in];
  fsdpc_tensor_t y;
  FSDPC_TRY(tensor_init(&y, W->dtype, W->device, x->value.ndim, shape));
  fsdpc_status_t st = kernel_matmul(&y, &x->value, false, W, !io, 1.0f, 0.0f);
  if (st != STATUS_OK) {
    tensor_free(&y);
    return st;
  }
  nn_node_t n = {.backward = linear_backward,
                 .name = io ? "linear_io" : "linear",
                 .in = {x},
                 .param = w,
                 .ints = {io, 0}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, w), &y, out);
}

fsdpc_status_t nn_linear(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(w);
  ARG_NONNULL(out);
  *out = NULL;
  bool implicit;
  FSDPC_TRY(nn_param_begin(ctx, "nn_linear", w, &implicit));
  return nn_param_end(ctx, w, implicit, linear(ctx, x, w, false, out));
}

fsdpc_status_t nn_linear_io(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(w);
  ARG_NONNULL(out);
  *out = NULL;
  bool implicit;
  FSDPC_TRY(nn_param_begin(ctx, "nn_linear_io", w, &implicit));
  return nn_param_end(ctx, w, implicit, linear(ctx, x, w, true, out));
}

/* ---- narrow ---- */

/* x's gradient gets dy in the narrowed slice: written into a zero gradient the first time,
 * added to the slice of the one already there (the other slices' backward) after that. */
static fsdpc_status_t narrow_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *x = n->in[0];
  if (!x->requires_grad) return STATUS_OK;
  const fsdpc_tensor_t *dy = &n->out->grad;
  int dim = (int)n->ints[0];
  fsdpc_tensor_t *into = NULL;
  FSDPC_TRY(nn_grad_to_add_into(x, &into));
  fsdpc_tensor_t dx = {0}, part, sum = {0};
  if (into == NULL) FSDPC_TRY(ops_zeros_like(&dx, &x->value));
  fsdpc_status_t st = tensor_narrow(&part, into ? into : &dx, dim, n->ints[1], dy->shape[dim]);
  if (st != STATUS_OK) {
    tensor_free(&dx);
    return st;
  }
  if (into == NULL) {
    st = tensor_copy(&part, dy);
  } else { /* the slice is strided: its sum is made contiguous, then written back */
    st = tensor_clone(&sum, &part, part.dtype, part.device);
    if (st == STATUS_OK) st = kernel_axpy(&sum, 1.0f, dy);
    if (st == STATUS_OK) st = tensor_copy(&part, &sum);
    tensor_free(&sum);
  }
  tensor_free(&part);
  if (st != STATUS_OK || into != NULL) {
    tensor_free(&dx);
    return st;
  }
  return nn_accumulate_grad(x, &dx);
}

fsdpc_status_t nn_narrow(nn_ctx_t *ctx, nn_var_t *x, int dim, int64_t start, int64_t length,
                         nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(out);
  *out = NULL;
  fsdpc_tensor_t part, y;
  FSDPC_TRY(tensor_narrow(&part, &x->value, dim, start, length));
  fsdpc_status_t st = tensor_clone(&y, &part, part.dtype, part.device);
  tensor_free(&part);
  FSDPC_TRY(st);
  nn_node_t n = {.backward = narrow_backward, .name = "narrow", .in = {x}, .ints = {dim, start}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, NULL), &y, out);
}

/* ---- embedding ---- */

static fsdpc_status_t embedding_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  if (!n->param->requires_grad) return STATUS_OK;
  fsdpc_tensor_t dw;
  FSDPC_TRY(nn_param_grad_memory(n->param, true, &dw));
  fsdpc_status_t st =
      kernel_embedding_shard_backward(&dw, &n->out->grad, &n->in[0]->value, n->ints[0], n->ints[1]);
  if (st != STATUS_OK) {
    tensor_free(&dw);
    return st;
  }
  return nn_param_accumulate_grad(n->param, &dw);
}

fsdpc_status_t nn_embedding(nn_ctx_t *ctx, nn_var_t *ids, nn_param_t *w, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(ids);
  ARG_NONNULL(w);
  ARG_NONNULL(out);
  return nn_embedding_shard(ctx, ids, w, 0, -1, out); /* -1: every row of the table */
}

static fsdpc_status_t embedding(nn_ctx_t *ctx, nn_var_t *ids, nn_param_t *w, int64_t first,
                                int64_t vocab, nn_var_t **out) {
  const fsdpc_tensor_t *W = &w->compute;
  if (W->ndim != 2 || ids->value.ndim + 1 > TENSOR_MAX_DIMS)
    return err_set(STATUS_ESHAPE, "nn_embedding (%s): weight must be [V, D]", w->fqn);
  if (vocab < 0) vocab = W->shape[0];
  int64_t shape[TENSOR_MAX_DIMS];
  memcpy(shape, ids->value.shape, sizeof(int64_t) * (size_t)ids->value.ndim);
  shape[ids->value.ndim] = W->shape[1];
  fsdpc_tensor_t y;
  FSDPC_TRY(tensor_init(&y, W->dtype, W->device, ids->value.ndim + 1, shape));
  fsdpc_status_t st = kernel_embedding_shard(&y, W, &ids->value, first, vocab);
  if (st != STATUS_OK) {
    tensor_free(&y);
    return st;
  }
  nn_node_t n = {.backward = embedding_backward,
                 .name = "embedding",
                 .in = {ids},
                 .param = w,
                 .ints = {first, vocab}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, NULL, 0, w), &y, out);
}

fsdpc_status_t nn_embedding_shard(nn_ctx_t *ctx, nn_var_t *ids, nn_param_t *w, int64_t first,
                                  int64_t vocab, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(ids);
  ARG_NONNULL(w);
  ARG_NONNULL(out);
  *out = NULL;
  bool implicit;
  FSDPC_TRY(nn_param_begin(ctx, "nn_embedding", w, &implicit));
  return nn_param_end(ctx, w, implicit, embedding(ctx, ids, w, first, vocab, out));
}

/* ---- RMSNorm ---- */

static fsdpc_status_t rmsnorm_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *x = n->in[0];
  fsdpc_tensor_t dx, dw;
  FSDPC_TRY(ops_alloc_like(&dx, &x->value));
  fsdpc_status_t st = nn_param_grad_memory(n->param, true, &dw);
  if (st == STATUS_OK) {
    st = kernel_rmsnorm_backward(&dx, &dw, &n->out->grad, &x->value, &n->param->compute,
                                 &n->saved[0]);
    if (st == STATUS_OK && x->requires_grad) st = nn_accumulate_grad(x, &dx);
    if (st == STATUS_OK && n->param->requires_grad) st = nn_param_accumulate_grad(n->param, &dw);
    tensor_free(&dw);
  }
  tensor_free(&dx);
  return st;
}

static fsdpc_status_t rmsnorm(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, double eps,
                              nn_var_t **out) {
  int64_t D = x->value.ndim ? x->value.shape[x->value.ndim - 1] : 1;
  int64_t rows = D ? tensor_numel(&x->value) / D : 0;
  fsdpc_tensor_t y, rstd;
  FSDPC_TRY(ops_alloc_like(&y, &x->value));
  fsdpc_status_t st = tensor_init(&rstd, DTYPE_F32, x->value.device, 1, &rows);
  if (st == STATUS_OK) st = kernel_rmsnorm(&y, &rstd, &x->value, &w->compute, (float)eps);
  if (st != STATUS_OK) {
    tensor_free(&y);
    tensor_free(&rstd);
    return st;
  }
  nn_node_t n = {
      .backward = rmsnorm_backward, .name = "rmsnorm", .in = {x}, .param = w, .saved = {rstd}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, w), &y, out);
}

fsdpc_status_t nn_rmsnorm(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, double eps, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(w);
  ARG_NONNULL(out);
  *out = NULL;
  bool implicit;
  FSDPC_TRY(nn_param_begin(ctx, "nn_rmsnorm", w, &implicit));
  return nn_param_end(ctx, w, implicit, rmsnorm(ctx, x, w, eps, out));
}

/* ---- RoPE ---- */

static fsdpc_status_t rope_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  if (!n->in[0]->requires_grad) return STATUS_OK;
  fsdpc_tensor_t dx;
  FSDPC_TRY(ops_alloc_like(&dx, &n->out->grad));
  fsdpc_status_t st = kernel_rope(&dx, &n->out->grad, n->user, 0, true);
  if (st != STATUS_OK) {
    tensor_free(&dx);
    return st;
  }
  return nn_accumulate_grad(n->in[0], &dx);
}

fsdpc_status_t nn_rope(nn_ctx_t *ctx, nn_var_t *x, const rope_t *rope, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(rope);
  ARG_NONNULL(out);
  *out = NULL;
  fsdpc_tensor_t y;
  FSDPC_TRY(ops_alloc_like(&y, &x->value));
  fsdpc_status_t st = kernel_rope(&y, &x->value, rope, 0, false);
  if (st != STATUS_OK) {
    tensor_free(&y);
    return st;
  }
  nn_node_t n = {.backward = rope_backward, .name = "rope", .in = {x}, .user = (void *)rope};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, NULL), &y, out);
}

/* ---- attention ---- */

static fsdpc_status_t attention_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *q = n->in[0], *k = n->in[1], *v = n->in[2];
  fsdpc_tensor_t d[3] = {{0}};
  fsdpc_status_t st = ops_alloc_like(&d[0], &q->value);
  if (st == STATUS_OK) st = ops_alloc_like(&d[1], &k->value);
  if (st == STATUS_OK) st = ops_alloc_like(&d[2], &v->value);
  if (st == STATUS_OK)
    st = kernel_attention_backward(&d[0], &d[1], &d[2], &n->out->grad, &q->value, &k->value,
                                   &v->value, &n->out->value, &n->saved[0]);
  for (int i = 0; i < 3 && st == STATUS_OK; i++)
    if (n->in[i]->requires_grad) st = nn_accumulate_grad(n->in[i], &d[i]);
  for (int i = 0; i < 3; i++) tensor_free(&d[i]);
  return st;
}

fsdpc_status_t nn_attention(nn_ctx_t *ctx, nn_var_t *q, nn_var_t *k, nn_var_t *v, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(q);
  ARG_NONNULL(k);
  ARG_NONNULL(v);
  ARG_NONNULL(out);
  *out = NULL;
  if (q->value.ndim != 4) return err_set(STATUS_ESHAPE, "nn_attention: q must be [B, T, H, Dh]");
  int64_t lshape[3] = {q->value.shape[0], q->value.shape[2], q->value.shape[1]};
  fsdpc_tensor_t y, lse;
  FSDPC_TRY(ops_alloc_like(&y, &q->value));
  fsdpc_status_t st = tensor_init(&lse, DTYPE_F32, q->value.device, 3, lshape);
  if (st == STATUS_OK) st = kernel_attention(&y, &lse, &q->value, &k->value, &v->value);
  if (st != STATUS_OK) {
    tensor_free(&y);
    tensor_free(&lse);
    return st;
  }
  nn_var_t *in[3] = {q, k, v};
  nn_node_t n = {
      .backward = attention_backward, .name = "attention", .in = {q, k, v}, .saved = {lse}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, in, 3, NULL), &y, out);
}

/* ---- element-wise ---- */

static fsdpc_status_t silu_mul_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  fsdpc_tensor_t dg, du;
  FSDPC_TRY(ops_alloc_like(&dg, &n->in[0]->value));
  fsdpc_status_t st = ops_alloc_like(&du, &n->in[1]->value);
  if (st == STATUS_OK) {
    st = kernel_silu_mul_backward(&dg, &du, &n->out->grad, &n->in[0]->value, &n->in[1]->value);
    if (st == STATUS_OK && n->in[0]->requires_grad) st = nn_accumulate_grad(n->in[0], &dg);
    if (st == STATUS_OK && n->in[1]->requires_grad) st = nn_accumulate_grad(n->in[1], &du);
    tensor_free(&du);
  }
  tensor_free(&dg);
  return st;
}

fsdpc_status_t nn_silu_mul(nn_ctx_t *ctx, nn_var_t *gate, nn_var_t *up, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(gate);
  ARG_NONNULL(up);
  ARG_NONNULL(out);
  *out = NULL;
  fsdpc_tensor_t y;
  FSDPC_TRY(ops_alloc_like(&y, &gate->value));
  fsdpc_status_t st = kernel_silu_mul(&y, &gate->value, &up->value);
  if (st != STATUS_OK) {
    tensor_free(&y);
    return st;
  }
  nn_var_t *in[2] = {gate, up};
  nn_node_t n = {.backward = silu_mul_backward, .name = "silu_mul", .in = {gate, up}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, in, 2, NULL), &y, out);
}

/* Passes the incoming gradient (times scalar) to every input that wants one: by reference
 * (viewed in the input's shape, for a view) when unscaled, a scaled copy otherwise. */
static fsdpc_status_t pass_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  for (int i = 0; i < NN_NODE_MAX_IN && n->in[i]; i++) {
    nn_var_t *x = n->in[i];
    if (!x->requires_grad) continue;
    fsdpc_tensor_t g;
    if (n->scalar == 1.0 && tensor_same_shape(&n->out->grad, &x->value)) {
      FSDPC_TRY(tensor_ref(&g, &n->out->grad));
    } else if (n->scalar == 1.0 && tensor_is_contiguous(&n->out->grad)) {
      FSDPC_TRY(tensor_view(&g, &n->out->grad, x->value.ndim, x->value.shape));
    } else {
      FSDPC_TRY(tensor_clone(&g, &n->out->grad, n->out->grad.dtype, n->out->grad.device));
      if (n->scalar != 1.0) {
        fsdpc_status_t st = kernel_scale(&g, (float)n->scalar);
        if (st != STATUS_OK) {
          tensor_free(&g);
          return st;
        }
      }
    }
    if (!tensor_same_shape(&g, &x->value)) {
      fsdpc_tensor_t view;
      fsdpc_status_t st = tensor_view(&view, &g, x->value.ndim, x->value.shape);
      tensor_free(&g);
      FSDPC_TRY(st);
      g = view;
    }
    FSDPC_TRY(nn_accumulate_grad(x, &g));
  }
  return STATUS_OK;
}

fsdpc_status_t nn_add(nn_ctx_t *ctx, nn_var_t *a, nn_var_t *b, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(a);
  ARG_NONNULL(b);
  ARG_NONNULL(out);
  *out = NULL;
  fsdpc_tensor_t y;
  FSDPC_TRY(ops_alloc_like(&y, &a->value));
  fsdpc_status_t st = kernel_add(&y, &a->value, &b->value);
  if (st != STATUS_OK) {
    tensor_free(&y);
    return st;
  }
  nn_var_t *in[2] = {a, b};
  nn_node_t n = {.backward = pass_backward, .name = "add", .in = {a, b}, .scalar = 1.0};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, in, 2, NULL), &y, out);
}

fsdpc_status_t nn_scale(nn_ctx_t *ctx, nn_var_t *x, double alpha, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(out);
  *out = NULL;
  fsdpc_tensor_t y;
  FSDPC_TRY(tensor_clone(&y, &x->value, x->value.dtype, x->value.device));
  fsdpc_status_t st = kernel_scale(&y, (float)alpha);
  if (st != STATUS_OK) {
    tensor_free(&y);
    return st;
  }
  nn_node_t n = {.backward = pass_backward, .name = "scale", .in = {x}, .scalar = alpha};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, NULL), &y, out);
}

static fsdpc_status_t cast_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *x = n->in[0];
  if (!x->requires_grad) return STATUS_OK;
  fsdpc_tensor_t g;
  FSDPC_TRY(tensor_clone(&g, &n->out->grad, x->value.dtype, x->value.device));
  return nn_accumulate_grad(x, &g);
}

fsdpc_status_t nn_cast(nn_ctx_t *ctx, nn_var_t *x, dtype_t dtype, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(out);
  *out = NULL;
  if (x->value.dtype == dtype) {
    *out = nn_var_ref(x);
    return STATUS_OK;
  }
  fsdpc_tensor_t y;
  FSDPC_TRY(tensor_clone(&y, &x->value, dtype, x->value.device));
  nn_node_t n = {.backward = cast_backward, .name = "cast", .in = {x}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, NULL), &y, out);
}

fsdpc_status_t nn_view(nn_ctx_t *ctx, nn_var_t *x, int ndim, const int64_t *shape, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  if (ndim > 0) ARG_NONNULL(shape);
  ARG_NONNULL(out);
  *out = NULL;
  fsdpc_tensor_t y;
  FSDPC_TRY(tensor_view(&y, &x->value, ndim, shape));
  nn_node_t n = {.backward = pass_backward, .name = "view", .in = {x}, .scalar = 1.0};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, NULL), &y, out);
}

/* ---- loss ---- */

/* The value of a one-element tensor on the host (blocks). */
fsdpc_status_t nn_var_scalar(const nn_var_t *v, double *out) {
  ARG_NONNULL(v);
  ARG_NONNULL(out);
  return ops_scalar_of(&v->value, out);
}

/* saved: the targets and kernel_masked_mean's count; the gradient's scale (dloss / count) is
 * read on the device, not on the host. */
static fsdpc_status_t cross_entropy_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *logits = n->in[0];
  if (!logits->requires_grad) return STATUS_OK;
  const fsdpc_tensor_t *targets = &n->saved[0], *count = &n->saved[1], *dloss = &n->out->grad;
  fsdpc_tensor_t d;
  if (n->ints[0] && !nn_var_has_grad(logits) && tensor_is_contiguous(&logits->value)) {
    /* consumed: each row's gradient is written over its logits, which are read first */
    FSDPC_TRY(
        kernel_cross_entropy_backward_mean(&logits->value, &logits->value, targets, dloss, count));
    d = logits->value;
    memset(&logits->value, 0, sizeof logits->value);
    return nn_accumulate_grad(logits, &d);
  }
  FSDPC_TRY(ops_alloc_like(&d, &logits->value));
  fsdpc_status_t st = kernel_cross_entropy_backward_mean(&d, &logits->value, targets, dloss, count);
  if (st != STATUS_OK) {
    tensor_free(&d);
    return st;
  }
  return nn_accumulate_grad(logits, &d);
}

/* The mean loss stays on the device: per-row losses, then their mean and the count of kept
 * targets. The count comes to the host only when asked for (n_tokens) or already there (the
 * CPU), which is when a batch whose every target is ignored is refused. */
static fsdpc_status_t cross_entropy(nn_ctx_t *ctx, nn_var_t *logits, const fsdpc_tensor_t *targets,
                                    bool consume, nn_var_t **out, int64_t *n_tokens) {
  *out = NULL;
  device_t dev = logits->value.device;
  int64_t n = tensor_numel(targets), one = 1;
  fsdpc_tensor_t losses, count = {0}, targets_ref = {0}, loss = {0};
  FSDPC_TRY(tensor_init(&losses, DTYPE_F32, dev, 1, &n));
  fsdpc_status_t st = kernel_cross_entropy(&losses, &logits->value, targets);
  if (st == STATUS_OK) st = tensor_init(&loss, DTYPE_F32, dev, 0, &one);
  if (st == STATUS_OK) st = tensor_init(&count, DTYPE_I64, dev, 1, &one);
  if (st == STATUS_OK) st = kernel_masked_mean(&loss, &count, &losses, targets);
  tensor_free(&losses);
  int64_t kept = 0;
  if (st == STATUS_OK && (n_tokens != NULL || dev.type == DEVICE_CPU)) {
    st = device_memcpy(device_cpu(), &kept, dev, count.data, sizeof kept);
    if (st == STATUS_OK && kept == 0)
      st = err_set(STATUS_EINVAL, "nn_cross_entropy: every target is ignored");
  }
  if (st == STATUS_OK) st = tensor_ref(&targets_ref, targets);
  if (st != STATUS_OK) {
    tensor_free(&count);
    tensor_free(&loss);
    tensor_free(&targets_ref);
    return st;
  }
  if (n_tokens) *n_tokens = kept;
  nn_node_t node = {.backward = cross_entropy_backward,
                    .name = "cross_entropy",
                    .in = {logits},
                    .saved = {targets_ref, count},
                    .ints = {consume}};
  return ops_finish(ctx, &node, nn_needs_grad(ctx, &logits, 1, NULL), &loss, out);
}

fsdpc_status_t nn_cross_entropy(nn_ctx_t *ctx, nn_var_t *logits, const fsdpc_tensor_t *targets,
                                nn_var_t **out, int64_t *n_tokens) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(logits);
  ARG_NONNULL(targets);
  ARG_NONNULL(out);
  return cross_entropy(ctx, logits, targets, false, out, n_tokens);
}

fsdpc_status_t nn_cross_entropy_consume(nn_ctx_t *ctx, nn_var_t *logits,
                                        const fsdpc_tensor_t *targets, nn_var_t **out,
                                        int64_t *n_tokens) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(logits);
  ARG_NONNULL(targets);
  ARG_NONNULL(out);
  return cross_entropy(ctx, logits, targets, true, out, n_tokens);
}
