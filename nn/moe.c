#include "nn/moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/kernels.h"
#include "core/moe_route_impl.h"
#include "dtensor/dtensor.h"
#include "mesh/mesh.h"
#include "mesh/pg.h"
#include "nn/init.h"
#include "nn/layers_impl.h"
#include "nn/ops_impl.h"

/* A tensor the operations compute on: contiguous, with values, of a float dtype, on any device. */
static fsdpc_status_t float_values(const char *op, const fsdpc_tensor_t *t) {
  if (tensor_is_meta(t) || !tensor_is_contiguous(t))
    return err_set(STATUS_EINVAL, "%s: needs a contiguous tensor with values, got %s", op,
                   tensor_is_meta(t) ? "a meta tensor" : "a strided view");
  if (!dtype_is_float(t->dtype))
    return err_set(STATUS_EDTYPE, "%s: needs a float tensor, got %s", op, dtype_name(t->dtype));
  return STATUS_OK;
}

/* t as F32 on dev into *out: a reference when it is one already, else a copy. */
static fsdpc_status_t f32_on(const fsdpc_tensor_t *t, device_t dev, fsdpc_tensor_t *out) {
  if (t->dtype == DTYPE_F32 && device_equal(t->device, dev)) return tensor_ref(out, t);
  return tensor_clone(out, t, DTYPE_F32, dev);
}

/* A host I64 index vector on dev (a reference on the host). */
static fsdpc_status_t index_on(const fsdpc_tensor_t *idx, device_t dev, fsdpc_tensor_t *out) {
  if (dev.type == DEVICE_CPU) return tensor_ref(out, idx);
  return tensor_upload(out, idx, dev);
}

static fsdpc_status_t host_i64(const char *op, const char *what, const fsdpc_tensor_t *t) {
  if (t->device.type == DEVICE_CPU && t->dtype == DTYPE_I64 && t->ndim == 1 && !tensor_is_meta(t) &&
      tensor_is_contiguous(t))
    return STATUS_OK;
  return err_set(STATUS_EINVAL, "%s: %s must be a host I64 vector", op, what);
}

/* ---- the load-balancing loss ---- */

struct nn_moe_aux {
  int n_experts, top_k;
  double coef, scale;   /* the loss's weight; the factor on its gradient (nn_moe_aux_begin) */
  int64_t rows;         /* tokens routed by the blocks in this forward */
  int64_t *counts;      /* of them, the choices of each expert */
  double *prob_sums;    /* and each expert's router probabilities, summed */
  int64_t *step_counts; /* choices since the last nn_moe_aux_take_step */
  double step_loss;
  int step_forwards;
  /* nn_moe_aux_share_over: the data-parallel groups the batch is split over, the gradients'
   * averaging factor; after nn_moe_aux_share, this rank's own choices (for the step's) */
  pg_t *share[NN_MOE_SHARE_MAX];
  int n_share;
  double weight;
  bool shared;
  int64_t *own_counts;
};

fsdpc_status_t nn_moe_aux_new(int n_experts, int top_k, double coef, nn_moe_aux_t **out) {
  ARG_NONNULL(out);
  *out = NULL;
  if (n_experts < 1 || top_k < 1 || top_k > n_experts || !(coef >= 0) || coef > 1e6)
    return err_set(STATUS_EINVAL,
                   "nn_moe_aux_new: %d experts, top_k %d (1 to the experts), coefficient %g (0 "
                   "to 1e6)",
                   n_experts, top_k, coef);
  nn_moe_aux_t *a = calloc(1, sizeof *a);
  if (a != NULL) {
    a->counts = calloc((size_t)n_experts, sizeof *a->counts);
    a->step_counts = calloc((size_t)n_experts, sizeof *a->step_counts);
    a->prob_sums = calloc((size_t)n_experts, sizeof *a->prob_sums);
    a->own_counts = calloc((size_t)n_experts, sizeof *a->own_counts);
  }
  if (a == NULL || a->counts == NULL || a->step_counts == NULL || a->prob_sums == NULL ||
      a->own_counts == NULL) {
    nn_moe_aux_free(a);
    return err_set(STATUS_ENOMEM, "nn_moe_aux_new: out of host memory");
  }
  a->n_experts = n_experts;
  a->top_k = top_k;
  a->coef = coef;
  a->weight = 1;
  *out = a;
  return STATUS_OK;
}

void nn_moe_aux_free(nn_moe_aux_t *a) {
  if (a == NULL) return;
  free(a->counts);
  free(a->step_counts);
  free(a->prob_sums);
  free(a->own_counts);
  free(a);
}

fsdpc_status_t nn_moe_aux_share_over(nn_moe_aux_t *a, pg_t *const *groups, int n, double weight) {
  ARG_NONNULL(a);
  if (n > 0) ARG_NONNULL(groups);
  if (n < 0 || n > NN_MOE_SHARE_MAX || !(weight >= 1) || weight > 1e9)
    return err_set(STATUS_EINVAL, "nn_moe_aux_share_over: %d groups (0 to %d), weight %g (>= 1)", n,
                   NN_MOE_SHARE_MAX, weight);
  for (int i = 0; i < n; i++) {
    if (groups[i] == NULL)
      return err_set(STATUS_EINVAL, "nn_moe_aux_share_over: group %d is NULL", i);
    a->share[i] = groups[i];
  }
  a->n_share = n;
  a->weight = weight;
  return STATUS_OK;
}

fsdpc_status_t nn_moe_aux_stats_share(const nn_moe_aux_t *a, double *v) {
  ARG_NONNULL(a);
  ARG_NONNULL(v);
  if (a->coef == 0) return STATUS_OK;
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < a->n_share && st == STATUS_OK; i++)
    st = pg_host_all_reduce(a->share[i], v, v, (size_t)nn_moe_aux_stats_len(a), PG_HOST_F64,
                            REDUCE_SUM);
  return st;
}

fsdpc_status_t nn_moe_aux_share(nn_moe_aux_t *a) {
  ARG_NONNULL(a);
  if (a->coef == 0 || a->n_share == 0) return STATUS_OK;
  int E = a->n_experts, len = nn_moe_aux_stats_len(a);
  double *v = calloc((size_t)len, sizeof *v);
  if (v == NULL) return err_set(STATUS_ENOMEM, "MoE load-balancing loss: out of host memory");
  memcpy(a->own_counts, a->counts, sizeof *a->counts * (size_t)E);
  nn_moe_aux_stats_add(a, v);
  fsdpc_status_t st = nn_moe_aux_stats_share(a, v);
  if (st == STATUS_OK) {
    nn_moe_aux_stats_set(a, v);
    a->shared = true;
  }
  free(v);
  return st;
}

void nn_moe_aux_begin(nn_moe_aux_t *a, double scale) {
  if (a == NULL) return;
  a->rows = 0;
  a->shared = false;
  a->scale = scale * a->weight;
  memset(a->counts, 0, sizeof *a->counts * (size_t)a->n_experts);
  memset(a->prob_sums, 0, sizeof *a->prob_sums * (size_t)a->n_experts);
}

double nn_moe_aux_loss(const nn_moe_aux_t *a) {
  if (a == NULL || a->rows == 0) return 0;
  double s = 0, n = (double)a->rows;
  for (int e = 0; e < a->n_experts; e++) s += (double)a->counts[e] / n * (a->prob_sums[e] / n);
  return (double)a->n_experts * s;
}

double nn_moe_aux_coef(const nn_moe_aux_t *a) { return a ? a->coef : 0; }

int nn_moe_aux_experts(const nn_moe_aux_t *a) { return a ? a->n_experts : 0; }

fsdpc_status_t nn_moe_aux_add(nn_ctx_t *ctx, const nn_moe_aux_t *a, nn_var_t *loss,
                              nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(loss);
  ARG_NONNULL(out);
  *out = NULL;
  if (a == NULL || a->coef == 0) {
    *out = nn_var_ref(loss);
    return STATUS_OK;
  }
  const fsdpc_tensor_t *l = &loss->value;
  fsdpc_tensor_t c;
  FSDPC_TRY(tensor_init(&c, l->dtype, l->device, l->ndim, l->shape));
  fsdpc_status_t st = tensor_fill(&c, a->coef * nn_moe_aux_loss(a));
  nn_var_t *v = NULL;
  if (st == STATUS_OK)
    st = nn_var_new(&c, false, &v);
  else
    tensor_free(&c);
  if (st == STATUS_OK) st = nn_add(ctx, loss, v, out);
  nn_var_put(v);
  return st;
}

bool nn_moe_aux_take_step(nn_moe_aux_t *a, int64_t *counts, int n_experts, double *loss) {
  if (a == NULL || counts == NULL || loss == NULL || n_experts != a->n_experts) return false;
  memcpy(counts, a->step_counts, sizeof *counts * (size_t)n_experts);
  *loss = a->step_forwards ? a->step_loss / a->step_forwards : 0;
  memset(a->step_counts, 0, sizeof *a->step_counts * (size_t)n_experts);
  a->step_loss = 0;
  a->step_forwards = 0;
  return true;
}

void nn_moe_aux_end(nn_moe_aux_t *a) {
  if (a == NULL || a->rows == 0) return;
  const int64_t *own = a->shared ? a->own_counts : a->counts;
  for (int e = 0; e < a->n_experts; e++) a->step_counts[e] += own[e];
  a->step_loss += nn_moe_aux_loss(a);
  a->step_forwards++;
}

int nn_moe_aux_stats_len(const nn_moe_aux_t *a) { return a ? 1 + 2 * a->n_experts : 0; }

void nn_moe_aux_stats_add(const nn_moe_aux_t *a, double *v) {
  if (a == NULL || v == NULL) return;
  int E = a->n_experts;
  v[0] += (double)a->rows;
  for (int e = 0; e < E; e++) {
    v[1 + e] += (double)a->counts[e];
    v[1 + E + e] += a->prob_sums[e];
  }
}

void nn_moe_aux_stats_set(nn_moe_aux_t *a, const double *v) {
  if (a == NULL || v == NULL) return;
  int E = a->n_experts;
  a->rows = (int64_t)v[0]; /* counts summed in f64: exact below 2^53 */
  for (int e = 0; e < E; e++) {
    a->counts[e] = (int64_t)v[1 + e];
    a->prob_sums[e] = v[1 + E + e];
  }
}

double nn_moe_aux_loss_of(const nn_moe_aux_t *a, const double *v) {
  if (a == NULL || v == NULL || v[0] == 0) return 0; /* the terms as nn_moe_aux_loss's */
  int E = a->n_experts;
  double s = 0;
  for (int e = 0; e < E; e++) s += v[1 + e] / v[0] * (v[1 + E + e] / v[0]);
  return (double)E * s;
}

void nn_moe_aux_step_add(nn_moe_aux_t *a, const double *mine, const double *total) {
  if (a == NULL || mine == NULL || total == NULL || total[0] == 0) return;
  for (int e = 0; e < a->n_experts; e++) a->step_counts[e] += (int64_t)mine[1 + e];
  a->step_loss += nn_moe_aux_loss_of(a, total);
  a->step_forwards++;
}

/* A forward's routing of N tokens (probabilities p [N, E], choices ex [N, k]) into a; with
 * tokens (not NULL), summed over that group's ranks first (the block's tokens split over them). */
static fsdpc_status_t aux_add(nn_moe_aux_t *a, const float *p, const float *psum, const int64_t *ex,
                              int64_t N, int64_t E, int64_t k, pg_t *tokens) {
  /* rows, then each expert's choices, then its probabilities summed: in f64 from the scores p
   * [N, E], or the sums psum [E] made on a device */
  double *v = calloc((size_t)(1 + 2 * E), sizeof *v);
  if (v == NULL) return err_set(STATUS_ENOMEM, "MoE block: out of host memory");
  v[0] = (double)N;
  for (int64_t t = 0; t < N; t++) {
    for (int64_t e = 0; p != NULL && e < E; e++) v[1 + E + e] += p[t * E + e];
    for (int64_t j = 0; j < k; j++) v[1 + ex[t * k + j]] += 1;
  }
  for (int64_t e = 0; psum != NULL && e < E; e++) v[1 + E + e] = psum[e];
  fsdpc_status_t st =
      tokens ? pg_host_all_reduce(tokens, v, v, (size_t)(1 + 2 * E), PG_HOST_F64, REDUCE_SUM)
             : STATUS_OK;
  if (st == STATUS_OK) {
    a->rows += (int64_t)v[0];
    for (int64_t e = 0; e < E; e++) {
      a->counts[e] += (int64_t)v[1 + e];
      a->prob_sums[e] += v[1 + E + e];
    }
  }
  free(v);
  return st;
}

/* ---- routing ---- */

/* t32 (F32, taken over) in dtype dt on its device into *out. */
static fsdpc_status_t as_dtype(fsdpc_tensor_t *t32, dtype_t dt, fsdpc_tensor_t *out) {
  if (dt == DTYPE_F32) {
    *out = *t32;
    memset(t32, 0, sizeof *t32);
    return STATUS_OK;
  }
  fsdpc_status_t st = tensor_clone(out, t32, dt, t32->device);
  tensor_free(t32);
  return st;
}

/* d logits from d weights (kernel_moe_route_backward, where the scores and choices are: the
 * logits' device), plus the load-balancing loss's: E sum_e f_e P_e (f_e: the share of choices
 * of expert e, P_e: its mean probability, over every block's tokens of the forward), whose
 * derivative by p_te is E f_e / rows, times its weight and the loss's scale. */
static fsdpc_status_t route_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *z = n->in[0];
  if (!z->requires_grad) return STATUS_OK;
  FSDPC_TRY(float_values("nn_moe_route (backward)", &n->out->grad));
  const fsdpc_tensor_t *p = &n->saved[0], *ex = &n->saved[1];
  int64_t E = p->shape[1], N = p->shape[0];
  int k = (int)n->ints[0];
  bool norm = (n->ints[1] & 1) != 0, sigmoid = (n->ints[1] & 2) != 0;
  device_t dev = p->device;
  fsdpc_tensor_t dz = {0}, dw = {0}, w = {0}, g = {0}, gh = {0};
  fsdpc_status_t st = f32_on(&n->out->grad, dev, &dw);
  if (st == STATUS_OK) st = f32_on(&n->out->value, dev, &w);
  if (st == STATUS_OK) st = tensor_init(&dz, DTYPE_F32, dev, 2, (int64_t[]){N, E});
  const nn_moe_aux_t *a = n->user;
  bool aux = a != NULL && a->coef > 0 && a->rows > 0;
  if (st == STATUS_OK && aux) {
    st = tensor_init(&gh, DTYPE_F32, device_cpu(), 1, &E);
    for (int64_t i = 0; st == STATUS_OK && i < E; i++) {
      double rows = (double)a->rows;
      ((float *)gh.data)[i] =
          (float)(a->scale * a->coef * (double)E * ((double)a->counts[i] / rows) / rows);
    }
    if (st == STATUS_OK) st = f32_on(&gh, dev, &g);
  }
  if (st == STATUS_OK)
    st = kernel_moe_route_backward(&dz, &dw, &w, p, ex, aux ? &g : NULL, k, norm, sigmoid,
                                   n->scalar);
  fsdpc_tensor_t dzd = {0};
  if (st == STATUS_OK) st = as_dtype(&dz, z->value.dtype, &dzd);
  if (st == STATUS_OK) st = nn_accumulate_grad(z, &dzd);
  fsdpc_tensor_t *all[] = {&dz, &dw, &w, &g, &gh, &dzd};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
  return st;
}

/* How a block routes: k, renormalisation, the scores (softmax or sigmoid), the weights'
 * scale and a per-expert bias (F32 on the logits' device) added to the scores for the choice
 * alone (NULL: none). */
typedef struct route_opts {
  int k;
  bool norm, sigmoid;
  double scale;
  const fsdpc_tensor_t *bias;
} route_opts_t;

static fsdpc_status_t route(nn_ctx_t *ctx, nn_var_t *logits, const route_opts_t *o,
                            nn_moe_aux_t *aux, pg_t *tokens, nn_var_t **weights,
                            fsdpc_tensor_t *experts);

fsdpc_status_t nn_moe_route(nn_ctx_t *ctx, nn_var_t *logits, int k, bool norm_topk,
                            nn_var_t **weights, fsdpc_tensor_t *experts) {
  route_opts_t o = {.k = k, .norm = norm_topk, .scale = 1};
  return route(ctx, logits, &o, NULL, NULL, weights, experts);
}

/* nn_moe_route, reporting to aux (when not NULL): the forward's routing (not a checkpointed
 * block's recomputation, which the forward reported; summed over tokens' ranks when not NULL),
 * and its gradient added in backward. */
static fsdpc_status_t route(nn_ctx_t *ctx, nn_var_t *logits, const route_opts_t *o,
                            nn_moe_aux_t *aux, pg_t *tokens, nn_var_t **weights,
                            fsdpc_tensor_t *experts) {
  int k = o->k;
  ARG_NONNULL(ctx);
  ARG_NONNULL(logits);
  ARG_NONNULL(weights);
  ARG_NONNULL(experts);
  *weights = NULL;
  memset(experts, 0, sizeof *experts);
  const fsdpc_tensor_t *zv = &logits->value;
  FSDPC_TRY(float_values("nn_moe_route", zv));
  if (zv->ndim != 2 || zv->shape[1] < 1)
    return err_set(STATUS_ESHAPE, "nn_moe_route: logits must be [tokens, experts]");
  int64_t N = zv->shape[0], E = zv->shape[1];
  if (k < 1 || k > E || k > MOE_MAX_TOP_K)
    return err_set(STATUS_EINVAL, "nn_moe_route: top_k %d must lie in [1, %lld] (the experts)", k,
                   (long long)(E < MOE_MAX_TOP_K ? E : MOE_MAX_TOP_K));
  if (aux != NULL && (aux->n_experts != E || aux->top_k != k))
    return err_set(STATUS_EINVAL,
                   "nn_moe_route: a block of %lld experts, top-%d, reports to a load-balancing "
                   "loss of %d, top-%d",
                   (long long)E, k, aux->n_experts, aux->top_k);
  /* the choice where the logits are (kernel_moe_route: the same on every device); the experts
   * then on the host too (their counts decide the exchanges), the weights in the logits'
   * dtype */
  device_t dev = zv->device;
  fsdpc_tensor_t z = {0}, p = {0}, w = {0}, ex = {0}, wd = {0}, ph = {0};
  fsdpc_status_t st = f32_on(zv, dev, &z);
  if (st == STATUS_OK) st = tensor_init(&p, DTYPE_F32, dev, 2, (int64_t[]){N, E});
  if (st == STATUS_OK) st = tensor_init(&w, DTYPE_F32, dev, 2, (int64_t[]){N, k});
  if (st == STATUS_OK) st = tensor_init(&ex, DTYPE_I64, dev, 2, (int64_t[]){N, k});
  if (st == STATUS_OK)
    st = kernel_moe_route(&p, &ex, &w, &z, o->bias, k, o->norm, o->sigmoid, o->scale);
  tensor_free(&z);
  if (st == STATUS_OK)
    st = dev.type == DEVICE_CPU ? tensor_ref(experts, &ex)
                                : tensor_clone(experts, &ex, DTYPE_I64, device_cpu());
  if (st == STATUS_OK) st = as_dtype(&w, zv->dtype, &wd);
  if (st == STATUS_OK && aux != NULL && !nn_ctx_recomputing(ctx)) {
    if (dev.type == DEVICE_CPU) {
      st = aux_add(aux, p.data, NULL, experts->data, N, E, k, tokens);
    } else { /* the scores summed by expert where they are: E values to the host */
      fsdpc_tensor_t sums = {0};
      st = tensor_zeros(&sums, DTYPE_F32, dev, 1, &E);
      if (st == STATUS_OK) st = kernel_bias_backward(&sums, &p);
      if (st == STATUS_OK) st = tensor_clone(&ph, &sums, DTYPE_F32, device_cpu());
      if (st == STATUS_OK) st = aux_add(aux, NULL, ph.data, experts->data, N, E, k, tokens);
      tensor_free(&sums);
      tensor_free(&ph);
    }
  }
  if (st != STATUS_OK) {
    fsdpc_tensor_t *all[] = {&p, &w, &ex, &wd, experts};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
    return st;
  }
  w = wd;
  nn_node_t n = {.backward = route_backward,
                 .name = "moe_route",
                 .in = {logits},
                 .saved = {p, ex},
                 .user = aux,
                 .scalar = o->scale,
                 .ints = {k, (o->norm ? 1 : 0) | (o->sigmoid ? 2 : 0)}};
  st = ops_finish(ctx, &n, nn_needs_grad(ctx, &logits, 1, NULL), &w, weights);
  if (st != STATUS_OK) tensor_free(experts);
  return st;
}

/* ---- gathering and combining rows ---- */

static fsdpc_status_t gather_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *x = n->in[0];
  if (!x->requires_grad) return STATUS_OK;
  fsdpc_tensor_t dx;
  FSDPC_TRY(ops_zeros_like(&dx, &x->value));
  fsdpc_status_t st = kernel_embedding_backward(&dx, &n->out->grad, &n->saved[0]);
  if (st == STATUS_OK) return nn_accumulate_grad(x, &dx);
  tensor_free(&dx);
  return st;
}

fsdpc_status_t nn_gather_rows(nn_ctx_t *ctx, nn_var_t *x, const fsdpc_tensor_t *rows,
                              nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(rows);
  ARG_NONNULL(out);
  *out = NULL;
  FSDPC_TRY(float_values("nn_gather_rows", &x->value));
  FSDPC_TRY(host_i64("nn_gather_rows", "rows", rows));
  if (x->value.ndim != 2) return err_set(STATUS_ESHAPE, "nn_gather_rows: x must be [rows, dim]");
  const int64_t *r = rows->data;
  for (int64_t m = 0; m < rows->shape[0]; m++)
    if (r[m] < 0 || r[m] >= x->value.shape[0])
      return err_set(STATUS_EINVAL, "nn_gather_rows: row %lld outside [0, %lld)", (long long)r[m],
                     (long long)x->value.shape[0]);
  fsdpc_tensor_t y = {0}, saved = {0};
  FSDPC_TRY(index_on(rows, x->value.device, &saved));
  fsdpc_status_t st = tensor_init(&y, x->value.dtype, x->value.device, 2,
                                  (int64_t[]){rows->shape[0], x->value.shape[1]});
  if (st == STATUS_OK) st = kernel_embedding(&y, &x->value, &saved);
  if (st != STATUS_OK) {
    tensor_free(&saved);
    tensor_free(&y);
    return st;
  }
  nn_node_t n = {.backward = gather_backward, .name = "gather_rows", .in = {x}, .saved = {saved}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, NULL), &y, out);
}

static fsdpc_status_t combine_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *y = n->in[0], *w = n->in[1];
  FSDPC_TRY(float_values("nn_combine_rows (backward)", &n->out->grad));
  fsdpc_tensor_t dy = {0}, dw = {0};
  fsdpc_status_t st = ops_alloc_like(&dy, &y->value);
  if (st == STATUS_OK) st = ops_alloc_like(&dw, &w->value);
  if (st == STATUS_OK)
    st = kernel_moe_combine_backward(&dy, &dw, &n->out->grad, &y->value, &w->value, &n->saved[0],
                                     &n->saved[1], &n->saved[2]);
  /* by the inputs' needs, not the data: a rank whose experts got no rows still hands on its
   * empty gradient, so that the exchanges before it run their backward on every rank */
  if (st == STATUS_OK && y->requires_grad) st = nn_accumulate_grad(y, &dy);
  if (st == STATUS_OK && w->requires_grad) st = nn_accumulate_grad(w, &dw);
  tensor_free(&dy);
  tensor_free(&dw);
  return st;
}

/* The rows of each slot (CSR: offs [S + 1], rows [M], each slot's in ascending order) from
 * each row's slot, on the host. */
static fsdpc_status_t slot_lists(const int64_t *slots, int64_t M, int64_t S, fsdpc_tensor_t *offs,
                                 fsdpc_tensor_t *rows) {
  FSDPC_TRY(tensor_zeros(offs, DTYPE_I64, device_cpu(), 1, (int64_t[]){S + 1}));
  fsdpc_status_t st = tensor_init(rows, DTYPE_I64, device_cpu(), 1, &M);
  int64_t *pos = st == STATUS_OK ? malloc(sizeof(int64_t) * (size_t)(S > 0 ? S : 1)) : NULL;
  if (st == STATUS_OK && pos == NULL) st = err_set(STATUS_ENOMEM, "MoE: out of host memory");
  if (st != STATUS_OK) {
    tensor_free(offs);
    tensor_free(rows);
    return st;
  }
  int64_t *o = offs->data, *r = rows->data;
  for (int64_t m = 0; m < M; m++) o[slots[m] + 1]++;
  for (int64_t q = 0; q < S; q++) o[q + 1] += o[q];
  memcpy(pos, o, sizeof(int64_t) * (size_t)S);
  for (int64_t m = 0; m < M; m++) r[pos[slots[m]]++] = m;
  free(pos);
  return STATUS_OK;
}

fsdpc_status_t nn_combine_rows(nn_ctx_t *ctx, nn_var_t *y, nn_var_t *weights,
                               const fsdpc_tensor_t *slots, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(y);
  ARG_NONNULL(weights);
  ARG_NONNULL(slots);
  ARG_NONNULL(out);
  *out = NULL;
  FSDPC_TRY(float_values("nn_combine_rows", &y->value));
  FSDPC_TRY(float_values("nn_combine_rows", &weights->value));
  FSDPC_TRY(host_i64("nn_combine_rows", "slots", slots));
  const fsdpc_tensor_t *Y = &y->value, *W = &weights->value;
  if (Y->ndim != 2 || W->ndim != 2 || slots->shape[0] != Y->shape[0])
    return err_set(STATUS_ESHAPE, "nn_combine_rows: y [M, dim], weights [tokens, k] and M slots");
  if (Y->dtype != W->dtype || !device_equal(Y->device, W->device))
    return err_set(STATUS_EINVAL, "nn_combine_rows: y and weights must share a dtype and device");
  int64_t N = W->shape[0], k = W->shape[1], D = Y->shape[1], M = Y->shape[0];
  const int64_t *s = slots->data;
  for (int64_t m = 0; m < M; m++)
    if (s[m] < 0 || s[m] >= N * k)
      return err_set(STATUS_EINVAL, "nn_combine_rows: slot %lld outside [0, %lld)", (long long)s[m],
                     (long long)(N * k));
  fsdpc_tensor_t o = {0}, offs = {0}, rows = {0}, saved[3] = {{0}};
  fsdpc_status_t st = slot_lists(s, M, N * k, &offs, &rows);
  if (st == STATUS_OK) st = index_on(slots, Y->device, &saved[0]);
  if (st == STATUS_OK) st = index_on(&offs, Y->device, &saved[1]);
  if (st == STATUS_OK) st = index_on(&rows, Y->device, &saved[2]);
  tensor_free(&offs);
  tensor_free(&rows);
  if (st == STATUS_OK) st = tensor_init(&o, Y->dtype, Y->device, 2, (int64_t[]){N, D});
  if (st == STATUS_OK) st = kernel_moe_combine(&o, Y, W, &saved[1], &saved[2]);
  if (st != STATUS_OK) {
    tensor_free(&o);
    for (int i = 0; i < 3; i++) tensor_free(&saved[i]);
    return st;
  }
  nn_var_t *in[2] = {y, weights};
  nn_node_t n = {.backward = combine_backward,
                 .name = "combine_rows",
                 .in = {y, weights},
                 .saved = {saved[0], saved[1], saved[2]},
                 .ints = {k, 0}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, in, 2, NULL), &o, out);
}

/* ---- exchanging rows between ranks ---- */

/* rows[0..P) of D elements of n->user's group, from x's blocks to the peers' (fwd), or back. */
static fsdpc_status_t exchange(pg_t *pg, const fsdpc_tensor_t *from, const int64_t *send_rows,
                               const int64_t *recv_rows, int64_t D, fsdpc_tensor_t *to) {
  int P = pg_size(pg);
  size_t sc[P], rc[P];
  int64_t total = 0;
  for (int q = 0; q < P; q++) {
    sc[q] = (size_t)(send_rows[q] * D);
    rc[q] = (size_t)(recv_rows[q] * D);
    total += recv_rows[q];
  }
  FSDPC_TRY(tensor_init(to, from->dtype, from->device, 2, (int64_t[]){total, D}));
  pg_work_t *w = NULL;
  fsdpc_status_t st = pg_all_to_all_v(pg, from->data, sc, to->data, rc, from->dtype, &w);
  if (st == STATUS_OK) st = pg_wait(w);
  if (st != STATUS_OK) tensor_free(to);
  return st;
}

static fsdpc_status_t all_to_all_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *x = n->in[0];
  const int64_t *c = n->saved[0].data; /* send rows, then receive rows */
  int P = (int)n->ints[0];
  fsdpc_tensor_t dx;
  FSDPC_TRY(float_values("nn_all_to_all_rows (backward)", &n->out->grad));
  /* every rank sends the gradients back, whether or not its input needs one */
  FSDPC_TRY(exchange(n->user, &n->out->grad, c + P, c, x->value.shape[1], &dx));
  fsdpc_status_t st = x->requires_grad ? nn_accumulate_grad(x, &dx) : STATUS_OK;
  tensor_free(&dx);
  return st;
}

fsdpc_status_t nn_all_to_all_rows(nn_ctx_t *ctx, nn_var_t *x, pg_t *pg, const int64_t *send_rows,
                                  const int64_t *recv_rows, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(pg);
  ARG_NONNULL(send_rows);
  ARG_NONNULL(recv_rows);
  ARG_NONNULL(out);
  *out = NULL;
  FSDPC_TRY(float_values("nn_all_to_all_rows", &x->value));
  int P = pg_size(pg);
  int64_t M = 0;
  for (int q = 0; q < P; q++) {
    if (send_rows[q] < 0 || recv_rows[q] < 0)
      return err_set(STATUS_EINVAL, "nn_all_to_all_rows: negative row counts");
    M += send_rows[q];
  }
  if (x->value.ndim != 2 || x->value.shape[0] != M)
    return err_set(STATUS_ESHAPE,
                   "nn_all_to_all_rows: x must be [rows, dim], its rows the %lld "
                   "the peers receive",
                   (long long)M);
  fsdpc_tensor_t y = {0}, c = {0};
  FSDPC_TRY(exchange(pg, &x->value, send_rows, recv_rows, x->value.shape[1], &y));
  fsdpc_status_t st = tensor_init(&c, DTYPE_I64, device_cpu(), 1, (int64_t[]){2 * P});
  if (st != STATUS_OK) {
    tensor_free(&y);
    return st;
  }
  memcpy(c.data, send_rows, sizeof(int64_t) * (size_t)P);
  memcpy((int64_t *)c.data + P, recv_rows, sizeof(int64_t) * (size_t)P);
  /* recorded when x needs a gradient: so must every rank's (the peers' backward exchanges
   * need this rank's part) */
  nn_node_t n = {.backward = all_to_all_backward,
                 .name = "all_to_all_rows",
                 .in = {x},
                 .saved = {c},
                 .user = pg,
                 .ints = {P, 0}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, NULL), &y, out);
}

/* ---- grouped products ---- */

/* w's matrix e ([out, in]): a view, freed by the caller. */
static fsdpc_status_t matrix(const fsdpc_tensor_t *w, int64_t e, fsdpc_tensor_t *v) {
  fsdpc_tensor_t one;
  FSDPC_TRY(tensor_narrow(&one, w, 0, e, 1));
  fsdpc_status_t st = tensor_view(v, &one, 2, w->shape + 1);
  tensor_free(&one);
  return st;
}

/* The views of a grouped product's operands, one of each kind for each expert that got rows. */
typedef struct expert_views {
  fsdpc_tensor_t *t; /* kinds x experts, kind-major */
  kernel_product_t *p;
  int kinds, experts, used;
} expert_views_t;

static fsdpc_status_t views_new(expert_views_t *v, int kinds, int experts) {
  memset(v, 0, sizeof *v);
  v->t = calloc((size_t)kinds * (size_t)experts, sizeof *v->t);
  v->p = calloc((size_t)experts, sizeof *v->p);
  v->kinds = kinds;
  v->experts = experts;
  if (v->t == NULL || v->p == NULL) {
    free(v->t);
    free(v->p);
    return err_set(STATUS_ENOMEM, "nn_grouped_linear: views of %d experts", experts);
  }
  return STATUS_OK;
}

static fsdpc_status_t views_free(expert_views_t *v, fsdpc_status_t st) {
  for (int i = 0; i < v->kinds * v->experts; i++) tensor_free(&v->t[i]);
  free(v->t);
  free(v->p);
  return st;
}

/* The view of kind k of the i-th expert that got rows. */
static fsdpc_tensor_t *view(expert_views_t *v, int k, int i) { return &v->t[k * v->experts + i]; }

/* The backward: dx_e = dy_e w_e and dw_e = dy_e^T x_e for each expert e that got rows, each kind
 * of product in one kernel_matmul_many. */
static fsdpc_status_t grouped_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *x = n->in[0];
  const int64_t *counts = n->saved[0].data;
  int E = (int)n->saved[0].shape[0];
  FSDPC_TRY(float_values("nn_grouped_linear (backward)", &n->out->grad));
  fsdpc_tensor_t dx = {0}, dw = {0};
  expert_views_t v; /* kinds: x_e, dy_e, dx_e, w_e, dw_e */
  FSDPC_TRY(views_new(&v, 5, E));
  fsdpc_status_t st = STATUS_OK;
  if (x->requires_grad) st = ops_zeros_like(&dx, &x->value);
  if (st == STATUS_OK && n->param->requires_grad) st = ops_zeros_like(&dw, &n->param->compute);
  for (int64_t e = 0, off = 0; e < E && st == STATUS_OK; off += counts[e++]) {
    if (counts[e] == 0) continue;
    int i = v.used++;
    st = tensor_narrow(view(&v, 0, i), &n->in[0]->value, 0, off, counts[e]);
    if (st == STATUS_OK) st = tensor_narrow(view(&v, 1, i), &n->out->grad, 0, off, counts[e]);
    if (st == STATUS_OK && dx.data) st = tensor_narrow(view(&v, 2, i), &dx, 0, off, counts[e]);
    if (st == STATUS_OK) st = matrix(&n->param->compute, e, view(&v, 3, i));
    if (st == STATUS_OK && dw.data) st = matrix(&dw, e, view(&v, 4, i));
  }
  if (st == STATUS_OK && dx.data) { /* dx_e = dy_e w_e */
    for (int i = 0; i < v.used; i++)
      v.p[i] = (kernel_product_t){view(&v, 2, i), view(&v, 1, i), view(&v, 3, i)};
    st = kernel_matmul_many(v.p, v.used, false, false, 1.0f, 0.0f);
  }
  if (st == STATUS_OK && dw.data) { /* dw_e = dy_e^T x_e */
    for (int i = 0; i < v.used; i++)
      v.p[i] = (kernel_product_t){view(&v, 4, i), view(&v, 1, i), view(&v, 0, i)};
    st = kernel_matmul_many(v.p, v.used, true, false, 1.0f, 0.0f);
  }
  st = views_free(&v, st);
  /* empty ones too (a rank whose experts got no rows: see combine_backward) */
  if (st == STATUS_OK && x->requires_grad) st = nn_accumulate_grad(x, &dx);
  if (st == STATUS_OK && n->param->requires_grad) st = nn_param_accumulate_grad(n->param, &dw);
  tensor_free(&dx);
  tensor_free(&dw);
  return st;
}

static fsdpc_status_t grouped(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, const int64_t *counts,
                              int E, nn_var_t **out) {
  const fsdpc_tensor_t *W = &w->compute, *X = &x->value;
  FSDPC_TRY(float_values("nn_grouped_linear", X));
  FSDPC_TRY(float_values("nn_grouped_linear", W));
  if (X->dtype != W->dtype || !device_equal(X->device, W->device))
    return err_set(STATUS_EINVAL,
                   "nn_grouped_linear (%s): x is %s, the weight %s: one dtype and device", w->fqn,
                   dtype_name(X->dtype), dtype_name(W->dtype));
  int64_t M = 0;
  bool negative = false;
  for (int e = 0; e < E; e++) {
    negative |= counts[e] < 0;
    M += counts[e];
  }
  if (negative || W->ndim != 3 || W->shape[0] != E || X->ndim != 2 || X->shape[1] != W->shape[2] ||
      M != X->shape[0])
    return err_set(STATUS_ESHAPE,
                   "nn_grouped_linear (%s): x [rows, in] with rows the sum of %d counts, w "
                   "[%d, out, in]",
                   w->fqn, E, E);
  fsdpc_tensor_t y = {0}, c = {0};
  fsdpc_status_t st = tensor_zeros(&y, X->dtype, X->device, 2, (int64_t[]){M, W->shape[1]});
  if (st == STATUS_OK) st = tensor_init(&c, DTYPE_I64, device_cpu(), 1, (int64_t[]){E});
  if (st == STATUS_OK) memcpy(c.data, counts, (size_t)E * sizeof *counts);
  expert_views_t v; /* kinds: y_e, x_e, w_e */
  if (st == STATUS_OK) st = views_new(&v, 3, E);
  if (st == STATUS_OK) {
    for (int64_t e = 0, off = 0; e < E && st == STATUS_OK; off += counts[e++]) {
      if (counts[e] == 0) continue;
      int i = v.used++;
      st = tensor_narrow(view(&v, 0, i), &y, 0, off, counts[e]);
      if (st == STATUS_OK) st = tensor_narrow(view(&v, 1, i), X, 0, off, counts[e]);
      if (st == STATUS_OK) st = matrix(W, e, view(&v, 2, i));
      v.p[i] = (kernel_product_t){view(&v, 0, i), view(&v, 1, i), view(&v, 2, i)};
    }
    if (st == STATUS_OK)
      st = kernel_matmul_many(v.p, v.used, false, true, 1.0f, 0.0f); /* x_e w_e^T */
    st = views_free(&v, st);
  }
  if (st != STATUS_OK) {
    tensor_free(&y);
    tensor_free(&c);
    return st;
  }
  nn_node_t n = {
      .backward = grouped_backward, .name = "grouped_linear", .in = {x}, .param = w, .saved = {c}};
  return ops_finish(ctx, &n, nn_needs_grad(ctx, &x, 1, w), &y, out);
}

fsdpc_status_t nn_grouped_linear(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, const int64_t *counts,
                                 int n_experts, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(x);
  ARG_NONNULL(w);
  ARG_NONNULL(counts);
  ARG_NONNULL(out);
  *out = NULL;
  if (n_experts < 1) return err_set(STATUS_EINVAL, "nn_grouped_linear: no experts");
  bool implicit;
  FSDPC_TRY(nn_param_begin(ctx, "nn_grouped_linear", w, &implicit));
  return nn_param_end(ctx, w, implicit, grouped(ctx, x, w, counts, n_experts, out));
}

/* ---- the block ---- */

typedef struct moe {
  int64_t dim, ffn;
  int n_experts, top_k;
  bool norm_topk;
  bool ran;
  int64_t *counts; /* tokens of this rank per expert in the last forward */
  /* expert parallelism (nn_moe_expert_parallel): this rank holds experts [ep_rank *
   * local, (ep_rank + 1) * local) of the group's ep_size ranks */
  pg_t *ep;
  int ep_size, ep_rank, local;
  int64_t *local_counts;     /* rows each local expert received from the group */
  const int64_t *run_counts; /* the experts' blocks of the run in progress */
  int run_experts;
  nn_moe_aux_t *aux; /* the load-balancing loss it reports to (nn_moe_aux_attach), or NULL */
  pg_t *tokens;      /* the group its tokens are split over (nn_moe_split_tokens), or NULL */
  /* nn_moe_set_routing: sigmoid scores, the weights' scale, the bias's rate and the tokens
   * each expert got since the last nn_moe_update_bias */
  bool sigmoid;
  double scale, bias_rate;
  int64_t *bias_counts;
} moe_t;

static void moe_free(void *p) {
  moe_t *m = p;
  if (m) {
    free(m->counts);
    free(m->local_counts);
    free(m->bias_counts);
  }
  free(m);
}

/* The experts' SwiGLU over the rows in expert order (counts: the parent's). */
static fsdpc_status_t experts_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  const moe_t *cfg = nn_module_impl(m);
  nn_var_t *h1 = NULL, *h3 = NULL, *a = NULL;
  const int64_t *c = cfg->run_counts;
  int E = cfg->run_experts;
  /* the stacked weights by their place (gate, up, down): nn_moe_name_experts may rename them */
  fsdpc_status_t st = nn_grouped_linear(ctx, in, nn_module_param(m, 0), c, E, &h1);
  if (st == STATUS_OK) st = nn_grouped_linear(ctx, in, nn_module_param(m, 1), c, E, &h3);
  if (st == STATUS_OK) st = nn_silu_mul(ctx, h1, h3, &a);
  if (st == STATUS_OK) st = nn_grouped_linear(ctx, a, nn_module_param(m, 2), c, E, out);
  nn_var_put(h1);
  nn_var_put(h3);
  nn_var_put(a);
  return st;
}

bool layers_is_experts(nn_module_t *m) { return nn_module_forward(m) == experts_forward; }

fsdpc_status_t layers_reset_experts(nn_module_t *m, uint64_t seed) {
  const moe_t *cfg = nn_module_impl(m);
  double a = 1.0 / sqrt((double)cfg->dim), b = 1.0 / sqrt((double)cfg->ffn);
  FSDPC_TRY(nn_init_uniform(nn_module_param(m, 0), seed, -a, a)); /* gate, up, down */
  FSDPC_TRY(nn_init_uniform(nn_module_param(m, 1), seed, -a, a));
  return nn_init_uniform(nn_module_param(m, 2), seed, -b, b);
}

/* The slots (token t's j-th choice: t k + j) in expert order, stable, into order; counts. */
static void sort_by_expert(const fsdpc_tensor_t *experts, int E, int64_t *counts, int64_t *order) {
  const int64_t *e = experts->data;
  int64_t S = tensor_numel(experts), off[E + 1];
  memset(counts, 0, (size_t)E * sizeof *counts);
  for (int64_t s = 0; s < S; s++) counts[e[s]]++;
  off[0] = 0;
  for (int i = 0; i < E; i++) off[i + 1] = off[i] + counts[i];
  for (int64_t s = 0; s < S; s++) order[off[e[s]]++] = s;
}

/* Expert parallelism: xs, this rank's rows in expert order, go to the ranks holding their
 * experts (one all-to-all, its counts from every rank's tokens per expert); each rank runs its
 * experts over the rows it received, regrouped by expert; the results go back by the inverse
 * all-to-all into xs's order (*ys). Backward runs the same exchanges the other way. */
static fsdpc_status_t run_expert_parallel(nn_ctx_t *ctx, moe_t *cfg, nn_module_t *experts,
                                          nn_var_t *xs, nn_var_t **ys) {
  int P = cfg->ep_size, me = cfg->ep_rank, L = cfg->local, E = cfg->n_experts;
  int64_t *all = malloc(sizeof(int64_t) * (size_t)P * (size_t)E);
  int64_t send[P], recv[P], start[P];
  if (all == NULL) return err_set(STATUS_ENOMEM, "MoE block: out of host memory");
  fsdpc_status_t st = pg_host_all_gather(cfg->ep, cfg->counts, all, E, PG_HOST_I64);
  int64_t R = 0;
  for (int q = 0; q < P && st == STATUS_OK; q++) {
    send[q] = recv[q] = 0;
    for (int l = 0; l < L; l++) {
      send[q] += cfg->counts[q * L + l];  /* my rows for q's experts */
      recv[q] += all[q * E + me * L + l]; /* q's rows for mine */
    }
    start[q] = R;
    R += recv[q];
  }
  for (int l = 0; l < L && st == STATUS_OK; l++) {
    cfg->local_counts[l] = 0;
    for (int q = 0; q < P; q++) cfg->local_counts[l] += all[q * E + me * L + l];
  }
  /* the received rows come by source, each source's by expert: regrouped by expert (perm),
   * and back (inv) */
  fsdpc_tensor_t perm = {0}, inv = {0};
  if (st == STATUS_OK) st = tensor_init(&perm, DTYPE_I64, device_cpu(), 1, &R);
  if (st == STATUS_OK) st = tensor_init(&inv, DTYPE_I64, device_cpu(), 1, &R);
  if (st == STATUS_OK) {
    int64_t *pv = perm.data, *iv = inv.data, i = 0;
    for (int l = 0; l < L; l++)
      for (int q = 0; q < P; q++) {
        int64_t at = start[q];
        for (int l2 = 0; l2 < l; l2++) at += all[q * E + me * L + l2];
        for (int64_t r = 0; r < all[q * E + me * L + l]; r++, i++) {
          pv[i] = at + r;
          iv[at + r] = i;
        }
      }
  }
  free(all);
  nn_var_t *got = NULL, *grouped_in = NULL, *done = NULL, *back = NULL;
  if (st == STATUS_OK) st = nn_all_to_all_rows(ctx, xs, cfg->ep, send, recv, &got);
  if (st == STATUS_OK) st = nn_gather_rows(ctx, got, &perm, &grouped_in);
  if (st == STATUS_OK) {
    cfg->run_counts = cfg->local_counts;
    cfg->run_experts = L;
    st = nn_call(ctx, experts, grouped_in, &done);
  }
  if (st == STATUS_OK) st = nn_gather_rows(ctx, done, &inv, &back);
  if (st == STATUS_OK) st = nn_all_to_all_rows(ctx, back, cfg->ep, recv, send, ys);
  nn_var_put(got);
  nn_var_put(grouped_in);
  nn_var_put(done);
  nn_var_put(back);
  tensor_free(&perm);
  tensor_free(&inv);
  return st;
}

/* Routing, the tokens into expert order, the experts, the weighted sum back. */
static fsdpc_status_t moe_route_and_run(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *x,
                                        nn_var_t **out) {
  moe_t *cfg = nn_module_impl(m);
  nn_module_t *gate = nn_module_child(m, 0), *experts = nn_module_child(m, 1);
  nn_var_t *logits = NULL, *w = NULL, *xs = NULL, *ys = NULL;
  fsdpc_tensor_t ex = {0}, order = {0}, rows = {0};
  nn_param_t *bias = cfg->bias_counts ? nn_module_param_named(m, "expert_bias") : NULL;
  route_opts_t o = {cfg->top_k, cfg->norm_topk, cfg->sigmoid, cfg->scale, NULL};
  bool implicit = false, began = false;
  fsdpc_tensor_t bias_f = {0};
  fsdpc_status_t st = nn_call(ctx, gate, x, &logits);
  if (st == STATUS_OK && bias != NULL) { /* read for the choice: no gradient */
    st = nn_param_begin(ctx, "MoE routing", bias, &implicit);
    began = st == STATUS_OK;
    if (st == STATUS_OK) st = float_values("MoE routing (expert_bias)", &bias->compute);
    if (st == STATUS_OK) st = f32_on(&bias->compute, logits->value.device, &bias_f);
    if (st == STATUS_OK) o.bias = &bias_f;
  }
  if (st == STATUS_OK) st = route(ctx, logits, &o, cfg->aux, cfg->tokens, &w, &ex);
  if (began) st = nn_param_end(ctx, bias, implicit, st);
  tensor_free(&bias_f);
  if (st == STATUS_OK && bias != NULL && !nn_ctx_recomputing(ctx) &&
      nn_needs_grad(ctx, &logits, 1, NULL)) /* a training forward: its choices count */
    for (int64_t i = 0; i < tensor_numel(&ex); i++) cfg->bias_counts[((int64_t *)ex.data)[i]]++;
  int64_t S = tensor_numel(&ex);
  if (st == STATUS_OK) st = tensor_init(&order, DTYPE_I64, device_cpu(), 1, &S);
  if (st == STATUS_OK) st = tensor_init(&rows, DTYPE_I64, device_cpu(), 1, &S);
  if (st == STATUS_OK) {
    sort_by_expert(&ex, cfg->n_experts, cfg->counts, order.data);
    for (int64_t s = 0; s < S; s++)
      ((int64_t *)rows.data)[s] = ((int64_t *)order.data)[s] / cfg->top_k;
    cfg->ran = true;
    st = nn_gather_rows(ctx, x, &rows, &xs);
  }
  if (st == STATUS_OK && cfg->ep == NULL) {
    cfg->run_counts = cfg->counts;
    cfg->run_experts = cfg->n_experts;
    st = nn_call(ctx, experts, xs, &ys);
  } else if (st == STATUS_OK) {
    st = run_expert_parallel(ctx, cfg, experts, xs, &ys);
  }
  if (st == STATUS_OK) st = nn_combine_rows(ctx, ys, w, &order, out);
  nn_var_put(logits);
  nn_var_put(w);
  nn_var_put(xs);
  nn_var_put(ys);
  tensor_free(&ex);
  tensor_free(&order);
  tensor_free(&rows);
  return st;
}

/* The shared expert's SwiGLU over every token: down(silu(gate(x)) * up(x)). */
static fsdpc_status_t shared_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *h1 = NULL, *h3 = NULL, *a = NULL;
  fsdpc_status_t st = nn_call(ctx, nn_module_child(m, 0), in, &h1);
  if (st == STATUS_OK) st = nn_call(ctx, nn_module_child(m, 1), in, &h3);
  if (st == STATUS_OK) st = nn_silu_mul(ctx, h1, h3, &a);
  if (st == STATUS_OK) st = nn_call(ctx, nn_module_child(m, 2), a, out);
  nn_var_put(h1);
  nn_var_put(h3);
  nn_var_put(a);
  return st;
}

/* The block's shared expert (nn_moe_add_shared_expert, nn_moe_add_gated_shared_expert), or
 * NULL; its gate (the gated one's), or NULL. */
static nn_module_t *shared_of(nn_module_t *m) {
  return nn_module_num_children(m) > 2 ? nn_module_child(m, 2) : NULL;
}
static nn_module_t *shared_gate_of(nn_module_t *m) {
  return nn_module_num_children(m) > 3 ? nn_module_child(m, 3) : NULL;
}

/* *sh (a new reference in place of the caller's) = sigmoid(gate(x)) * *sh, each token's row
 * scaled by its gate: the rows combined one to one (nn_combine_rows, k 1). */
static fsdpc_status_t gate_shared(nn_ctx_t *ctx, nn_module_t *gate, nn_var_t *x, nn_var_t **sh) {
  int64_t N = x->value.shape[0];
  nn_var_t *g = NULL, *s = NULL, *out = NULL;
  fsdpc_tensor_t slots = {0};
  fsdpc_status_t st = nn_call(ctx, gate, x, &g);
  if (st == STATUS_OK) st = nn_activation(ctx, g, KERNEL_ACT_SIGMOID, &s);
  if (st == STATUS_OK) st = tensor_init(&slots, DTYPE_I64, device_cpu(), 1, &N);
  for (int64_t t = 0; st == STATUS_OK && t < N; t++) ((int64_t *)slots.data)[t] = t;
  if (st == STATUS_OK) st = nn_combine_rows(ctx, *sh, s, &slots, &out);
  if (st == STATUS_OK) {
    nn_var_put(*sh);
    *sh = out;
  }
  tensor_free(&slots);
  nn_var_put(g);
  nn_var_put(s);
  return st;
}

static fsdpc_status_t moe_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  const moe_t *cfg = nn_module_impl(m);
  const fsdpc_tensor_t *X = &in->value;
  *out = NULL;
  if (X->ndim < 1 || X->shape[X->ndim - 1] != cfg->dim) {
    char b[96];
    return err_set(STATUS_ESHAPE, "MoE block '%s': input %s does not end in dim %lld",
                   nn_module_name(m), tensor_shape_str(X->ndim, X->shape, b, sizeof b),
                   (long long)cfg->dim);
  }
  nn_var_t *x2 = NULL, *o2 = NULL, *sh = NULL, *sum = NULL;
  fsdpc_status_t st = nn_view(ctx, in, 2, (int64_t[]){tensor_numel(X) / cfg->dim, cfg->dim}, &x2);
  if (st == STATUS_OK) st = moe_route_and_run(ctx, m, x2, &o2);
  if (st == STATUS_OK && shared_of(m) != NULL) { /* every token through the shared expert too */
    st = nn_call(ctx, shared_of(m), x2, &sh);
    if (st == STATUS_OK && shared_gate_of(m) != NULL)
      st = gate_shared(ctx, shared_gate_of(m), x2, &sh);
    if (st == STATUS_OK) st = nn_add(ctx, o2, sh, &sum);
    if (st == STATUS_OK) {
      nn_var_put(o2);
      o2 = sum;
    }
  }
  if (st == STATUS_OK) st = nn_view(ctx, o2, X->ndim, X->shape, out);
  nn_var_put(x2);
  nn_var_put(o2);
  nn_var_put(sh);
  return st;
}

/* The experts' module: the stacked weights; it shares the block's settings and counts. */
static fsdpc_status_t experts_new(nn_module_t *moe, moe_t *cfg, const nn_layer_options_t *opt) {
  nn_module_t *m = NULL;
  FSDPC_TRY(nn_module_new("experts", experts_forward, cfg, &m));
  nn_module_set_kind(m, "experts");
  int64_t E = cfg->n_experts, up[3] = {E, cfg->ffn, cfg->dim}, down[3] = {E, cfg->dim, cfg->ffn};
  fsdpc_status_t st = layers_add_param(m, "gate_proj", 3, up, opt);
  if (st == STATUS_OK) st = layers_add_param(m, "up_proj", 3, up, opt);
  if (st == STATUS_OK) st = layers_add_param(m, "down_proj", 3, down, opt);
  if (st == STATUS_OK) st = nn_module_add_child(moe, m);
  if (st != STATUS_OK) nn_module_free(m);
  return st;
}

fsdpc_status_t nn_moe_new(nn_module_t *parent, const char *name, int64_t dim, int64_t ffn_dim,
                          int n_experts, int top_k, bool norm_topk, const nn_layer_options_t *opt,
                          nn_module_t **out) {
  ARG_NONNULL(name);
  static const nn_layer_options_t defaults = NN_LAYER_OPTIONS_INIT;
  opt = opt ? opt : &defaults;
  if (dim < 1 || ffn_dim < 1 || n_experts < 1 || n_experts > 4096 || top_k < 1 ||
      top_k > n_experts || top_k > 64)
    return err_set(STATUS_EINVAL,
                   "MoE block '%s': dim %lld, ffn_dim %lld, %d experts (1 to 4096), top_k %d (1 "
                   "to the experts, at most 64)",
                   name, (long long)dim, (long long)ffn_dim, n_experts, top_k);
  moe_t *cfg = calloc(1, sizeof *cfg);
  int64_t *counts = calloc((size_t)n_experts, sizeof *counts);
  if (cfg == NULL || counts == NULL) {
    free(cfg);
    free(counts);
    return err_set(STATUS_ENOMEM, "MoE block '%s': out of host memory", name);
  }
  *cfg = (moe_t){.dim = dim,
                 .ffn = ffn_dim,
                 .n_experts = n_experts,
                 .top_k = top_k,
                 .norm_topk = norm_topk,
                 .scale = 1,
                 .counts = counts};
  nn_module_t *m = NULL;
  FSDPC_TRY(nn_module_new_owned(name, moe_forward, cfg, moe_free, &m)); /* cfg freed on failure */
  nn_module_set_kind(m, "moe");
  fsdpc_status_t st = nn_linear_new(m, "gate", dim, n_experts, false, opt, NULL);
  if (st == STATUS_OK) st = experts_new(m, cfg, opt);
  return layers_attach(parent, m, st, out);
}

bool nn_moe_last_load(const nn_module_t *m, int64_t *counts, int n_experts) {
  if (m == NULL || counts == NULL || nn_module_forward(m) != moe_forward) return false;
  const moe_t *cfg = nn_module_impl(m);
  if (!cfg->ran || n_experts != cfg->n_experts) return false;
  memcpy(counts, cfg->counts, (size_t)n_experts * sizeof *counts);
  return true;
}

/* p (a stacked experts' weight, whole on a one-rank mesh) as mesh's Shard(0) over dimension
 * dim, into *v: this rank's experts copied (or meta when p has no memory yet). */
static fsdpc_status_t shard_experts(const nn_param_t *p, mesh_t *mesh, int dim, int rank, int P,
                                    dtensor_t **v) {
  const fsdpc_tensor_t *whole = dtensor_local(p->value);
  int64_t L = whole->shape[0] / P, shape[3] = {L, whole->shape[1], whole->shape[2]};
  fsdpc_tensor_t mine = {0}, rows = {0};
  fsdpc_status_t st;
  if (tensor_is_meta(whole)) {
    st = tensor_meta(&mine, whole->dtype, whole->device, 3, shape);
  } else {
    st = tensor_narrow(&rows, whole, 0, (int64_t)rank * L, L);
    if (st == STATUS_OK) st = tensor_clone(&mine, &rows, whole->dtype, whole->device);
    tensor_free(&rows);
  }
  placement_t pl[MESH_MAX_DIMS];
  for (int d = 0; d < mesh_ndim(mesh); d++)
    pl[d] = d == dim ? placement_shard(0) : placement_replicate();
  if (st == STATUS_OK) st = dtensor_from_local(&mine, mesh, pl, 3, whole->shape, v);
  tensor_free(&mine);
  return st;
}

fsdpc_status_t nn_moe_expert_parallel(nn_module_t *moe, mesh_t *mesh, int dim) {
  ARG_NONNULL(moe);
  ARG_NONNULL(mesh);
  if (nn_module_forward(moe) != moe_forward)
    return err_set(STATUS_EINVAL, "nn_moe_expert_parallel: '%s' is not a MoE block",
                   nn_module_name(moe));
  if (dim < 0 || dim >= mesh_ndim(mesh))
    return err_set(STATUS_EINVAL, "nn_moe_expert_parallel: mesh has no dimension %d", dim);
  moe_t *cfg = nn_module_impl(moe);
  pg_t *pg = mesh_group(mesh, dim);
  int P = pg_size(pg);
  if (cfg->ep != NULL)
    return err_set(STATUS_EINVAL, "nn_moe_expert_parallel: '%s' is expert-parallel already",
                   nn_module_name(moe));
  if (cfg->n_experts % P != 0)
    return err_set(STATUS_EINVAL,
                   "nn_moe_expert_parallel: %d ranks do not divide '%s''s %d experts (each rank "
                   "holds as many)",
                   P, nn_module_name(moe), cfg->n_experts);
  nn_module_t *experts = nn_module_child(moe, 1);
  for (int i = 0; i < 3; i++) { /* gate, up, down */
    nn_param_t *p = nn_module_param(experts, i);
    if (mesh_ndim(dtensor_mesh(p->value)) != 1 || mesh_size(dtensor_mesh(p->value), 0) != 1)
      return err_set(STATUS_EINVAL,
                     "nn_moe_expert_parallel: '%s' is distributed already (apply expert "
                     "parallelism before fully_shard)",
                     p->fqn);
  }
  int64_t *local = calloc((size_t)(cfg->n_experts / P), sizeof *local);
  if (local == NULL) return err_set(STATUS_ENOMEM, "nn_moe_expert_parallel: out of host memory");
  dtensor_t *v[3] = {NULL, NULL, NULL}; /* all three made before any is installed */
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < 3 && st == STATUS_OK; i++)
    st = shard_experts(nn_module_param(experts, i), mesh, dim, pg_rank(pg), P, &v[i]);
  for (int i = 0; i < 3 && st == STATUS_OK; i++) {
    st = nn_param_set_value(nn_module_param(experts, i), v[i]); /* takes v[i] */
    v[i] = NULL;
  }
  for (int i = 0; i < 3; i++) dtensor_free(v[i]);
  if (st != STATUS_OK) {
    free(local);
    return st;
  }
  cfg->ep = pg;
  cfg->ep_size = P;
  cfg->ep_rank = pg_rank(pg);
  cfg->local = cfg->n_experts / P;
  cfg->local_counts = local;
  return STATUS_OK;
}

fsdpc_status_t nn_moe_set_routing(nn_module_t *moe, nn_moe_score_t score, double route_scale,
                                  double bias_rate) {
  ARG_NONNULL(moe);
  if (nn_module_forward(moe) != moe_forward)
    return err_set(STATUS_EINVAL, "nn_moe_set_routing: '%s' is not a MoE block",
                   nn_module_name(moe));
  moe_t *cfg = nn_module_impl(moe);
  if ((score != NN_MOE_SOFTMAX && score != NN_MOE_SIGMOID) || !(route_scale > 0) ||
      route_scale > 1e6 || !(bias_rate >= 0) || bias_rate > 1)
    return err_set(STATUS_EINVAL,
                   "nn_moe_set_routing: '%s': score %d (softmax or sigmoid), route_scale %g "
                   "(above 0, at most 1e6), bias_rate %g (0 to 1)",
                   nn_module_name(moe), (int)score, route_scale, bias_rate);
  if (score == NN_MOE_SIGMOID && cfg->aux != NULL)
    return err_set(STATUS_EINVAL,
                   "nn_moe_set_routing: '%s' reports to a load-balancing loss, which weighs "
                   "softmax probabilities",
                   nn_module_name(moe));
  if (bias_rate > 0 && cfg->bias_counts == NULL) {
    cfg->bias_counts = calloc((size_t)cfg->n_experts, sizeof *cfg->bias_counts);
    if (cfg->bias_counts == NULL)
      return err_set(STATUS_ENOMEM, "nn_moe_set_routing: out of host memory");
    const nn_param_t *gw = nn_module_param_named(nn_module_child(moe, 0), "weight");
    const fsdpc_tensor_t *g = dtensor_local(gw->value);
    nn_layer_options_t opt = NN_LAYER_OPTIONS_INIT;
    opt.dtype = g->dtype;
    opt.device = g->device.type;
    opt.deferred = tensor_is_meta(g);
    fsdpc_status_t st = layers_add_param(moe, "expert_bias", 1, (int64_t[]){cfg->n_experts}, &opt);
    nn_param_t *b = st == STATUS_OK ? nn_module_param_named(moe, "expert_bias") : NULL;
    if (b != NULL) b->requires_grad = false;
    if (st != STATUS_OK) {
      free(cfg->bias_counts);
      cfg->bias_counts = NULL;
      return st;
    }
  }
  cfg->sigmoid = score == NN_MOE_SIGMOID;
  cfg->scale = route_scale;
  cfg->bias_rate = bias_rate;
  return STATUS_OK;
}

/* Every block under m with a bias: its step's counts summed over pg, its bias moved. */
static fsdpc_status_t update_bias(nn_module_t *m, pg_t *pg) {
  if (nn_module_forward(m) == moe_forward) {
    moe_t *cfg = nn_module_impl(m);
    if (cfg->bias_counts != NULL && cfg->bias_rate > 0) {
      int E = cfg->n_experts;
      FSDPC_TRY(pg_host_all_reduce(pg, cfg->bias_counts, cfg->bias_counts, (size_t)E, PG_HOST_I64,
                                   REDUCE_SUM));
      double mean = 0;
      for (int e = 0; e < E; e++) mean += (double)cfg->bias_counts[e] / E;
      nn_param_t *b = nn_module_param_named(m, "expert_bias");
      fsdpc_tensor_t *v = (fsdpc_tensor_t *)dtensor_local(b->value), h = {0};
      if (tensor_is_meta(v)) { /* another pipeline stage's block: its ranks move it */
        memset(cfg->bias_counts, 0, sizeof *cfg->bias_counts * (size_t)E);
        goto children;
      }
      FSDPC_TRY(float_values("nn_moe_update_bias", v));
      FSDPC_TRY(nn_param_written(b));         /* an unsharded copy kept after backward goes */
      FSDPC_TRY(f32_on(v, device_cpu(), &h)); /* this rank's shard, moved on the host */
      int64_t off[1] = {0};
      dtensor_offset(b->value, off);
      float *d = h.data;
      for (int64_t i = 0; i < tensor_numel(&h); i++) {
        double c = (double)cfg->bias_counts[off[0] + i];
        d[i] += (float)(cfg->bias_rate * (c < mean ? 1 : c > mean ? -1 : 0));
      }
      memset(cfg->bias_counts, 0, sizeof *cfg->bias_counts * (size_t)E);
      fsdpc_status_t st = h.data == v->data ? STATUS_OK : tensor_copy(v, &h);
      tensor_free(&h);
      FSDPC_TRY(st);
    }
  }
children:
  for (int i = 0; i < nn_module_num_children(m); i++)
    FSDPC_TRY(update_bias(nn_module_child(m, i), pg));
  return STATUS_OK;
}

static void clear_counts(nn_module_t *m) {
  if (nn_module_forward(m) == moe_forward) {
    moe_t *cfg = nn_module_impl(m);
    if (cfg->bias_counts != NULL)
      memset(cfg->bias_counts, 0, sizeof *cfg->bias_counts * (size_t)cfg->n_experts);
  }
  for (int i = 0; i < nn_module_num_children(m); i++) clear_counts(nn_module_child(m, i));
}

void nn_moe_discard_bias_counts(nn_module_t *root) {
  if (root != NULL) clear_counts(root);
}

fsdpc_status_t nn_moe_update_bias(nn_module_t *root, pg_t *pg) {
  ARG_NONNULL(root);
  ARG_NONNULL(pg);
  return update_bias(root, pg);
}

fsdpc_status_t layers_reset_moe(nn_module_t *m) {
  nn_param_t *b =
      nn_module_forward(m) == moe_forward ? nn_module_param_named(m, "expert_bias") : NULL;
  return b ? nn_init_constant(b, 0.0) : STATUS_OK;
}

fsdpc_status_t nn_moe_split_tokens(nn_module_t *moe, pg_t *pg) {
  ARG_NONNULL(moe);
  ARG_NONNULL(pg);
  if (nn_module_forward(moe) != moe_forward)
    return err_set(STATUS_EINVAL, "nn_moe_split_tokens: '%s' is not a MoE block",
                   nn_module_name(moe));
  moe_t *cfg = nn_module_impl(moe);
  cfg->tokens = pg;
  return STATUS_OK;
}

/* Attaches a to every MoE block under m (or detaches, a NULL); counts them into *n. */
static fsdpc_status_t attach(nn_module_t *m, nn_moe_aux_t *a, int *n) {
  if (nn_module_forward(m) == moe_forward) {
    moe_t *cfg = nn_module_impl(m);
    if (a != NULL && cfg->sigmoid)
      return err_set(STATUS_EINVAL,
                     "nn_moe_aux_attach: block '%s' routes by sigmoid scores; the load-balancing "
                     "loss weighs softmax probabilities (balance it by its expert_bias instead)",
                     nn_module_name(m));
    if (a != NULL && (cfg->n_experts != a->n_experts || cfg->top_k != a->top_k))
      return err_set(STATUS_EINVAL,
                     "nn_moe_aux_attach: block '%s' has %d experts, top-%d; the loss %d, top-%d",
                     nn_module_name(m), cfg->n_experts, cfg->top_k, a->n_experts, a->top_k);
    cfg->aux = a;
    (*n)++;
  }
  for (int i = 0; i < nn_module_num_children(m); i++)
    FSDPC_TRY(attach(nn_module_child(m, i), a, n));
  return STATUS_OK;
}

fsdpc_status_t nn_moe_aux_attach(nn_module_t *root, nn_moe_aux_t *a, int *blocks) {
  ARG_NONNULL(root);
  int n = 0;
  FSDPC_TRY(attach(root, a, &n));
  if (blocks != NULL) *blocks = n;
  return STATUS_OK;
}

static nn_moe_aux_t *find_aux(const nn_module_t *m) {
  if (nn_module_forward(m) == moe_forward) {
    const moe_t *cfg = nn_module_impl(m);
    if (cfg->aux != NULL) return cfg->aux;
  }
  for (int i = 0; i < nn_module_num_children(m); i++) {
    nn_moe_aux_t *a = find_aux(nn_module_child(m, i));
    if (a != NULL) return a;
  }
  return NULL;
}

nn_moe_aux_t *nn_moe_aux_of(const nn_module_t *root) { return root ? find_aux(root) : NULL; }

fsdpc_status_t nn_moe_name_experts(nn_module_t *moe, const char *gate, const char *up,
                                   const char *down) {
  ARG_NONNULL(moe);
  ARG_NONNULL(gate);
  ARG_NONNULL(up);
  ARG_NONNULL(down);
  if (nn_module_forward(moe) != moe_forward)
    return err_set(STATUS_EINVAL, "nn_moe_name_experts: '%s' is not a MoE block",
                   nn_module_name(moe));
  nn_module_t *experts = nn_module_child(moe, 1);
  const char *names[3] = {gate, up, down};
  for (int i = 0; i < 3; i++) {
    bool plain = names[i][0] != 0 && strchr(names[i], '.') == NULL;
    for (int j = 0; j < i && plain; j++) plain = strcmp(names[i], names[j]) != 0;
    if (!plain)
      return err_set(STATUS_EINVAL,
                     "nn_moe_name_experts: '%s' is not a name for one of the experts' three "
                     "weights (not empty, no '.', each its own)",
                     names[i]);
    if (nn_module_param(experts, i)->fqn != NULL)
      return err_set(STATUS_EINVAL, "nn_moe_name_experts: '%s' is finalized already",
                     nn_module_name(moe));
  }
  char *copies[3] = {strdup(gate), strdup(up), strdup(down)};
  if (!copies[0] || !copies[1] || !copies[2]) {
    for (int i = 0; i < 3; i++) free(copies[i]);
    return err_set(STATUS_ENOMEM, "nn_moe_name_experts: out of host memory");
  }
  for (int i = 0; i < 3; i++) {
    nn_param_t *p = nn_module_param(experts, i);
    free(p->name);
    p->name = copies[i];
  }
  return STATUS_OK;
}

/* The shared expert named name (and, gated, its gate) added to moe, by fn for its messages. */
static fsdpc_status_t add_shared(nn_module_t *moe, const char *name, bool gated, int64_t ffn_dim,
                                 const nn_layer_options_t *opt, const char *fn) {
  ARG_NONNULL(moe);
  if (nn_module_forward(moe) != moe_forward)
    return err_set(STATUS_EINVAL, "%s: '%s' is not a MoE block", fn, nn_module_name(moe));
  if (shared_of(moe) != NULL)
    return err_set(STATUS_EINVAL, "%s: '%s' has a shared expert already", fn, nn_module_name(moe));
  if (ffn_dim < 1)
    return err_set(STATUS_EINVAL, "%s: ffn_dim %lld must be positive", fn, (long long)ffn_dim);
  const moe_t *cfg = nn_module_impl(moe);
  nn_module_t *m = NULL;
  FSDPC_TRY(nn_module_new(name, shared_forward, NULL, &m));
  fsdpc_status_t st = nn_linear_new(m, "gate_proj", cfg->dim, ffn_dim, false, opt, NULL);
  if (st == STATUS_OK) st = nn_linear_new(m, "up_proj", cfg->dim, ffn_dim, false, opt, NULL);
  if (st == STATUS_OK) st = nn_linear_new(m, "down_proj", ffn_dim, cfg->dim, false, opt, NULL);
  if (st == STATUS_OK) st = nn_module_add_child(moe, m);
  if (st != STATUS_OK) {
    nn_module_free(m);
    return st;
  }
  if (gated) st = nn_linear_new(moe, "shared_expert_gate", cfg->dim, 1, false, opt, NULL);
  return st;
}

fsdpc_status_t nn_moe_add_shared_expert(nn_module_t *moe, int64_t ffn_dim,
                                        const nn_layer_options_t *opt) {
  return add_shared(moe, "shared_experts", false, ffn_dim, opt, "nn_moe_add_shared_expert");
}

fsdpc_status_t nn_moe_add_gated_shared_expert(nn_module_t *moe, int64_t ffn_dim,
                                              const nn_layer_options_t *opt) {
  return add_shared(moe, "shared_expert", true, ffn_dim, opt, "nn_moe_add_gated_shared_expert");
}
