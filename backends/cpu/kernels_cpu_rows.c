/* CPU kernels that reduce rows: RMSNorm, LayerNorm, cross-entropy (see kernels_cpu.h). */
#include <math.h>
#include <string.h>

#include "backends/cpu/kernels_cpu.h"

/* ---- RMSNorm ---- */

typedef struct norm_args {
  int64_t rows, D;
  dtype_t dt; /* x's dtype: the normalised value is rounded to it before the weight */
  float eps;
  const float *x, *w, *dy, *rstd_in;
  float *out, *rstd, *dx, *dw;
} norm_args_t;

/* Rows [i0, i1) of the RMSNorm forward. */
static void rmsnorm_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const norm_args_t *a = ctx;
  int64_t D = a->D;
  (void)t;
  for (int64_t i = i0; i < i1; i++) {
    const float *xi = a->x + i * D, *w = a->w;
    float var = (float)(cpu_sum_products(xi, xi, NULL, D) / (double)D),
          ri = 1.0f / sqrtf(var + a->eps);
    float *oi = a->out + i * D;
    a->rstd[i] = ri;
    if (a->dt == DTYPE_F32) {
#pragma omp simd
      for (int64_t j = 0; j < D; j++) oi[j] = w[j] * (xi[j] * ri);
    } else { /* the normalised row rounded to the dtype, then scaled */
#pragma omp simd
      for (int64_t j = 0; j < D; j++) oi[j] = xi[j] * ri;
      dtype_round_f32(a->dt, oi, (size_t)D);
#pragma omp simd
      for (int64_t j = 0; j < D; j++) oi[j] *= w[j];
    }
  }
}

static fsdpc_status_t cpu_rmsnorm(fsdpc_tensor_t *out, fsdpc_tensor_t *rstd,
                                  const fsdpc_tensor_t *x, const fsdpc_tensor_t *w, float eps) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / (D ? D : 1);
  fbufs_t s = {0};
  norm_args_t a = {.rows = rows,
                   .D = D,
                   .dt = x->dtype,
                   .eps = eps,
                   .x = cpu_fbufs_in(&s, x),
                   .w = cpu_fbufs_in(&s, w),
                   .out = cpu_fbufs_out(&s, out, false),
                   .rstd = rstd->data};
  if (s.st == STATUS_OK) cpu_for_shares(rows, D, ELEM_GRAIN, 1, rmsnorm_share, &a);
  return cpu_fbufs_end(&s, STATUS_OK);
}

/* Rows [i0, i1) of dx. */
static void rmsnorm_dx_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const norm_args_t *a = ctx;
  int64_t D = a->D;
  const float *w = a->w;
  (void)t;
  for (int64_t i = i0; i < i1; i++) {
    const float *xi = a->x + i * D, *dyi = a->dy + i * D;
    double dot = cpu_sum_products(dyi, w, xi, D); /* sum_j dy_j w_j x_j */
    float ri = a->rstd_in[i], c = (float)(dot / (double)D) * ri * ri;
    float *dxi = a->dx + i * D;
#pragma omp simd
    for (int64_t j = 0; j < D; j++) dxi[j] = ri * (dyi[j] * w[j] - xi[j] * c);
  }
}

/* Columns [j0, j1) of dw, each summed over the rows in order. */
static void rmsnorm_dw_share(const void *ctx, int t, int64_t j0, int64_t j1) {
  const norm_args_t *a = ctx;
  int64_t D = a->D;
  float *dw = a->dw;
  (void)t;
  for (int64_t i = 0; i < a->rows; i++) {
    const float *xi = a->x + i * D, *dyi = a->dy + i * D;
    float ri = a->rstd_in[i];
#pragma omp simd
    for (int64_t j = j0; j < j1; j++) dw[j] += dyi[j] * (xi[j] * ri);
  }
}

static fsdpc_status_t cpu_rmsnorm_backward(fsdpc_tensor_t *dx, fsdpc_tensor_t *dw,
                                           const fsdpc_tensor_t *dy, const fsdpc_tensor_t *x,
                                           const fsdpc_tensor_t *w, const fsdpc_tensor_t *rstd) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / (D ? D : 1);
  fbufs_t s = {0};
  norm_args_t a = {.rows = rows, .D = D, .rstd_in = rstd->data};
  a.dx = cpu_fbufs_out(&s, dx, false);
  a.dw = cpu_fbufs_out(&s, dw, true);
  a.dy = cpu_fbufs_in(&s, dy);
  a.x = cpu_fbufs_in(&s, x);
  a.w = cpu_fbufs_in(&s, w);
  if (s.st == STATUS_OK) {
    cpu_for_shares(rows, D, ELEM_GRAIN, 1, rmsnorm_dx_share, &a);
    cpu_for_shares(D, rows, ELEM_GRAIN, 16, rmsnorm_dw_share, &a);
  }
  return cpu_fbufs_end(&s, STATUS_OK);
}

/* ---- LayerNorm ---- */

static fsdpc_status_t cpu_layernorm(fsdpc_tensor_t *out, fsdpc_tensor_t *mean, fsdpc_tensor_t *rstd,
                                    const fsdpc_tensor_t *x, const fsdpc_tensor_t *w,
                                    const fsdpc_tensor_t *b, float eps) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / D;
  fbufs_t s = {0};
  const float *fx = cpu_fbufs_in(&s, x), *fw = cpu_fbufs_in(&s, w), *fb = cpu_fbufs_in(&s, b);
  float *fo = cpu_fbufs_out(&s, out, false);
  if (s.st != STATUS_OK) return cpu_fbufs_end(&s, STATUS_OK);
  float *mu = mean->data, *r = rstd->data;
  for (int64_t i = 0; i < rows; i++) {
    const float *xi = fx + i * D;
    double s = 0, ss = 0;
    for (int64_t j = 0; j < D; j++) s += xi[j];
    mu[i] = (float)(s / (double)D);
    for (int64_t j = 0; j < D; j++) ss += (double)(xi[j] - mu[i]) * (xi[j] - mu[i]);
    r[i] = 1.0f / sqrtf((float)(ss / (double)D) + eps);
    for (int64_t j = 0; j < D; j++)
      fo[i * D + j] = (xi[j] - mu[i]) * r[i] * fw[j] + (fb ? fb[j] : 0.0f);
  }
  return cpu_fbufs_end(&s, STATUS_OK);
}

static fsdpc_status_t cpu_layernorm_backward(fsdpc_tensor_t *dx, fsdpc_tensor_t *dw,
                                             fsdpc_tensor_t *db, const fsdpc_tensor_t *dy,
                                             const fsdpc_tensor_t *x, const fsdpc_tensor_t *w,
                                             const fsdpc_tensor_t *mean,
                                             const fsdpc_tensor_t *rstd) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / D;
  fbufs_t s = {0};
  float *fdx = cpu_fbufs_out(&s, dx, false), *fdw = cpu_fbufs_out(&s, dw, true),
        *fdb = cpu_fbufs_out(&s, db, true);
  const float *fdy = cpu_fbufs_in(&s, dy), *fx = cpu_fbufs_in(&s, x), *fw = cpu_fbufs_in(&s, w);
  if (s.st != STATUS_OK) return cpu_fbufs_end(&s, STATUS_OK);
  const float *mu = mean->data, *r = rstd->data;
  for (int64_t i = 0; i < rows; i++) {
    const float *xi = fx + i * D, *dyi = fdy + i * D;
    double a = 0, c = 0; /* sums of g and of g * xhat, g = dy * w */
    for (int64_t j = 0; j < D; j++) {
      float g = dyi[j] * fw[j], xh = (xi[j] - mu[i]) * r[i];
      a += g;
      c += (double)g * xh;
    }
    float ma = (float)(a / (double)D), mc = (float)(c / (double)D);
    for (int64_t j = 0; j < D; j++) {
      float g = dyi[j] * fw[j], xh = (xi[j] - mu[i]) * r[i];
      fdx[i * D + j] = r[i] * (g - ma - xh * mc);
    }
  }
  for (int64_t j = 0; j < D; j++) { /* rows in order, as the CUDA twin */
    float sw = 0, sb = 0;
    for (int64_t i = 0; i < rows; i++) {
      float g = fdy[i * D + j];
      sw += g * ((fx[i * D + j] - mu[i]) * r[i]);
      sb += g;
    }
    fdw[j] += sw;
    if (fdb != NULL) fdb[j] += sb;
  }
  return cpu_fbufs_end(&s, STATUS_OK);
}

/* ---- cross-entropy ---- */

static fsdpc_status_t ce_target(const fsdpc_tensor_t *targets, int64_t r, int64_t V, int64_t *t) {
  *t = index_at(targets, r);
  if (*t >= V)
    return err_set(STATUS_EINVAL, "cross-entropy: target %lld of row %lld is outside [0, %lld)",
                   (long long)*t, (long long)r, (long long)V);
  return STATUS_OK;
}

/* log-sum-exp of a row: fp32 exponentials (as the CUDA twin), a double-precision sum. */
static float row_lse(const float *x, int64_t V) {
  float m = cpu_max(x, V);
  return m + (float)log(cpu_exp_sum(NULL, x, V, m));
}

static fsdpc_status_t ce_targets(const fsdpc_tensor_t *targets, int64_t V) {
  for (int64_t r = 0, N = tensor_numel(targets); r < N; r++) {
    int64_t t;
    FSDPC_TRY(ce_target(targets, r, V, &t));
  }
  return STATUS_OK;
}

typedef struct ce_args {
  int64_t V;
  float scale;
  const fsdpc_tensor_t *targets;
  const float *logits;
  float *out; /* losses, or dlogits */
} ce_args_t;

static void ce_share(const void *ctx, int t, int64_t r0, int64_t r1) {
  const ce_args_t *a = ctx;
  int64_t V = a->V;
  (void)t;
  for (int64_t r = r0; r < r1; r++) {
    int64_t tr = index_at(a->targets, r);
    a->out[r] = tr < 0 ? 0.0f : row_lse(a->logits + r * V, V) - a->logits[r * V + tr];
  }
}

static fsdpc_status_t cpu_cross_entropy(fsdpc_tensor_t *losses, const fsdpc_tensor_t *logits,
                                        const fsdpc_tensor_t *targets) {
  int64_t V = last_dim(logits);
  FSDPC_TRY(ce_targets(targets, V));
  fbufs_t s = {0};
  ce_args_t a = {
      .V = V, .targets = targets, .logits = cpu_fbufs_in(&s, logits), .out = losses->data};
  if (s.st == STATUS_OK) cpu_for_shares(tensor_numel(targets), V, ELEM_GRAIN, 1, ce_share, &a);
  return cpu_fbufs_end(&s, STATUS_OK);
}

static void ce_backward_share(const void *ctx, int t, int64_t r0, int64_t r1) {
  const ce_args_t *a = ctx;
  int64_t V = a->V;
  (void)t;
  for (int64_t r = r0; r < r1; r++) {
    int64_t tr = index_at(a->targets, r);
    const float *x = a->logits + r * V;
    float *g = a->out + r * V;
    if (tr < 0) {
      memset(g, 0, sizeof(float) * (size_t)V);
      continue;
    }
    float m = cpu_max(x, V); /* softmax with one exponential per logit */
    double sum = cpu_exp_sum(g, x, V, m);
    float k = (float)(a->scale / sum);
    for (int64_t j = 0; j < V; j++) g[j] *= k;
    g[tr] -= a->scale;
  }
}

static fsdpc_status_t cpu_cross_entropy_backward(fsdpc_tensor_t *dlogits,
                                                 const fsdpc_tensor_t *logits,
                                                 const fsdpc_tensor_t *targets, float scale,
                                                 const fsdpc_tensor_t *dloss,
                                                 const fsdpc_tensor_t *count) {
  int64_t V = last_dim(logits);
  FSDPC_TRY(ce_targets(targets, V));
  if (count != NULL) /* the mean's gradient: dloss / count, rounded once */
    scale = (float)((double)*(const float *)dloss->data / (double)*(const int64_t *)count->data);
  fbufs_t s = {0};
  ce_args_t a = {.V = V, .scale = scale, .targets = targets};
  a.logits = cpu_fbufs_in(&s, logits);
  a.out = cpu_fbufs_out(&s, dlogits, false);
  if (s.st == STATUS_OK)
    cpu_for_shares(tensor_numel(targets), V, ELEM_GRAIN, 1, ce_backward_share, &a);
  return cpu_fbufs_end(&s, STATUS_OK);
}

static fsdpc_status_t cpu_masked_mean(fsdpc_tensor_t *mean, fsdpc_tensor_t *count,
                                      const fsdpc_tensor_t *values, const fsdpc_tensor_t *targets) {
  const float *v = values->data;
  double sum = 0;
  int64_t n = 0;
  for (int64_t i = 0, N = tensor_numel(targets); i < N; i++)
    if (index_at(targets, i) >= 0) {
      sum += v[i];
      n++;
    }
  *(float *)mean->data = (float)(sum / (double)n); /* 0 / 0: NaN */
  *(int64_t *)count->data = n;
  return STATUS_OK;
}

/* ---- a mixture of experts' weighted sum ---- */

/* The slots' listed rows, checked: offs from 0, nondecreasing, to M; rows in [0, M). */
static fsdpc_status_t check_lists(const fsdpc_tensor_t *offs, const fsdpc_tensor_t *rows,
                                  int64_t M) {
  const int64_t *o = offs->data, *r = rows->data;
  int64_t S = tensor_numel(offs) - 1;
  bool ok = o[0] == 0 && o[S] == M;
  for (int64_t s = 0; s < S && ok; s++) ok = o[s] <= o[s + 1];
  for (int64_t m = 0; m < M && ok; m++) ok = r[m] >= 0 && r[m] < M;
  return ok ? STATUS_OK
            : err_set(STATUS_EINVAL, "kernel_moe_combine: offsets or rows outside [0, %lld)",
                      (long long)M);
}

/* The operands of a combine or its backward, as f32 arrays, for the kernel threads. */
typedef struct combine {
  const int64_t *o, *r, *sl;
  const float *y, *w, *g;
  float *out, *dy, *dw;
  int64_t D, k;
} combine_t;

/* Tokens [t0, t1): each output row the sum of its slots' rows, weighted, in slot order. */
static void combine_share(const void *ctx, int th, int64_t t0, int64_t t1) {
  (void)th;
  const combine_t *c = ctx;
  int64_t D = c->D, k = c->k;
  for (int64_t t = t0; t < t1; t++) {
    float *ot = c->out + t * D;
    for (int64_t d = 0; d < D; d++) ot[d] = 0;
    for (int64_t s = t * k; s < (t + 1) * k; s++)
      for (int64_t m = c->o[s]; m < c->o[s + 1]; m++) {
        const float *ym = c->y + c->r[m] * D;
        for (int64_t d = 0; d < D; d++) ot[d] += c->w[s] * ym[d];
      }
  }
}

/* Rows [m0, m1) of dy: each its slot's weight times its token's gradient. */
static void combine_dy_share(const void *ctx, int th, int64_t m0, int64_t m1) {
  (void)th;
  const combine_t *c = ctx;
  int64_t D = c->D;
  for (int64_t m = m0; m < m1; m++) {
    const float *gt = c->g + (c->sl[m] / c->k) * D;
    for (int64_t d = 0; d < D; d++) c->dy[m * D + d] = c->w[c->sl[m]] * gt[d];
  }
}

/* Slots [s0, s1) of dw: each its rows' dot products with its token's gradient, in order. */
static void combine_dw_share(const void *ctx, int th, int64_t s0, int64_t s1) {
  (void)th;
  const combine_t *c = ctx;
  int64_t D = c->D;
  for (int64_t s = s0; s < s1; s++) {
    const float *gt = c->g + (s / c->k) * D;
    float acc = 0;
    for (int64_t m = c->o[s]; m < c->o[s + 1]; m++)
      for (int64_t d = 0; d < D; d++) acc += c->y[c->r[m] * D + d] * gt[d];
    c->dw[s] = acc;
  }
}

static fsdpc_status_t cpu_moe_combine(fsdpc_tensor_t *out, const fsdpc_tensor_t *y,
                                      const fsdpc_tensor_t *w, const fsdpc_tensor_t *offs,
                                      const fsdpc_tensor_t *rows) {
  int64_t D = last_dim(y);
  if (D == 0 || tensor_numel(out) == 0) return STATUS_OK;
  int64_t M = tensor_numel(y) / D, N = tensor_numel(out) / D, k = tensor_numel(w) / N;
  FSDPC_TRY(check_lists(offs, rows, M));
  fbufs_t b = {0};
  combine_t c = {.o = offs->data, .r = rows->data, .D = D, .k = k};
  c.y = cpu_fbufs_in(&b, y);
  c.w = cpu_fbufs_in(&b, w);
  c.out = cpu_fbufs_out(&b, out, false);
  if (b.st != STATUS_OK) return cpu_fbufs_end(&b, STATUS_OK);
  cpu_for_shares(N, D * k, ELEM_GRAIN, 1, combine_share, &c);
  return cpu_fbufs_end(&b, STATUS_OK);
}

static fsdpc_status_t cpu_moe_combine_backward(fsdpc_tensor_t *dy, fsdpc_tensor_t *dw,
                                               const fsdpc_tensor_t *dout, const fsdpc_tensor_t *y,
                                               const fsdpc_tensor_t *w, const fsdpc_tensor_t *slots,
                                               const fsdpc_tensor_t *offs,
                                               const fsdpc_tensor_t *rows) {
  int64_t D = last_dim(y);
  if (D == 0 || tensor_numel(dout) == 0) { /* no features: no weight gradient */
    if (tensor_numel(dw) > 0) memset(dw->data, 0, tensor_nbytes(dw));
    return STATUS_OK;
  }
  int64_t M = tensor_numel(y) / D, N = tensor_numel(dout) / D, S = tensor_numel(w), k = S / N;
  FSDPC_TRY(check_lists(offs, rows, M));
  const int64_t *o = offs->data, *r = rows->data, *sl = slots->data;
  for (int64_t m = 0; m < M; m++)
    if (sl[m] < 0 || sl[m] >= S)
      return err_set(STATUS_EINVAL, "kernel_moe_combine_backward: slot %lld outside [0, %lld)",
                     (long long)sl[m], (long long)S);
  fbufs_t b = {0};
  combine_t c = {.o = o, .r = r, .sl = sl, .D = D, .k = k};
  c.g = cpu_fbufs_in(&b, dout);
  c.y = cpu_fbufs_in(&b, y);
  c.w = cpu_fbufs_in(&b, w);
  c.dy = cpu_fbufs_out(&b, dy, false);
  c.dw = cpu_fbufs_out(&b, dw, false);
  if (b.st != STATUS_OK) return cpu_fbufs_end(&b, STATUS_OK);
  cpu_for_shares(M, D, ELEM_GRAIN, 1, combine_dy_share, &c);
  cpu_for_shares(S, M / (S > 0 ? S : 1) * D + 1, ELEM_GRAIN, 1, combine_dw_share, &c);
  return cpu_fbufs_end(&b, STATUS_OK);
}

/* ---- a mixture of experts' routing: a token a step, the tokens over the kernel threads ---- */

typedef struct route_share {
  const moe_route_args_t *a;
  const float *z, *bias, *dw, *w, *g;
  float *p, *wout, *dz;
  const int64_t *ein;
  int64_t *e;
} route_share_t;

static void route_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  (void)t;
  const route_share_t *r = ctx;
  int64_t E = r->a->E, k = r->a->k;
  for (int64_t i = i0; i < i1; i++)
    moe_route_row(r->a, r->z + i * E, r->bias, r->p + i * E, r->e + i * k, r->wout + i * k);
}

static fsdpc_status_t cpu_moe_route(fsdpc_tensor_t *p, fsdpc_tensor_t *experts, fsdpc_tensor_t *w,
                                    const fsdpc_tensor_t *z, const fsdpc_tensor_t *bias,
                                    const moe_route_args_t *a) {
  route_share_t r = {.a = a,
                     .z = z->data,
                     .bias = bias ? bias->data : NULL,
                     .p = p->data,
                     .wout = w->data,
                     .e = experts->data};
  cpu_for_shares(z->shape[0], a->E * (4 + a->k), ELEM_GRAIN, 1, route_share, &r);
  return STATUS_OK;
}

static void route_backward_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  (void)t;
  const route_share_t *r = ctx;
  int64_t E = r->a->E, k = r->a->k;
  for (int64_t i = i0; i < i1; i++)
    moe_route_row_backward(r->a, r->p + i * E, r->ein + i * k, r->dw + i * k, r->w + i * k, r->g,
                           r->dz + i * E);
}

static fsdpc_status_t cpu_moe_route_backward(fsdpc_tensor_t *dz, const fsdpc_tensor_t *dw,
                                             const fsdpc_tensor_t *w, const fsdpc_tensor_t *p,
                                             const fsdpc_tensor_t *experts, const fsdpc_tensor_t *g,
                                             const moe_route_args_t *a) {
  const int64_t *e = experts->data;
  for (int64_t i = 0; i < tensor_numel(experts); i++)
    if (e[i] < 0 || e[i] >= a->E)
      return err_set(STATUS_EINVAL, "kernel_moe_route_backward: expert %lld outside [0, %lld)",
                     (long long)e[i], (long long)a->E);
  route_share_t r = {.a = a,
                     .p = p->data,
                     .ein = e,
                     .dw = dw->data,
                     .w = w->data,
                     .g = g ? g->data : NULL,
                     .dz = dz->data};
  cpu_for_shares(p->shape[0], a->E * 4, ELEM_GRAIN, 1, route_backward_share, &r);
  return STATUS_OK;
}

void cpu_row_kernels(kernel_ops_t *ops) {
  ops->moe_route = cpu_moe_route;
  ops->moe_route_backward = cpu_moe_route_backward;
  ops->moe_combine = cpu_moe_combine;
  ops->moe_combine_backward = cpu_moe_combine_backward;
  ops->rmsnorm = cpu_rmsnorm;
  ops->rmsnorm_backward = cpu_rmsnorm_backward;
  ops->layernorm = cpu_layernorm;
  ops->layernorm_backward = cpu_layernorm_backward;
  ops->cross_entropy = cpu_cross_entropy;
  ops->cross_entropy_backward = cpu_cross_entropy_backward;
  ops->masked_mean = cpu_masked_mean;
}
