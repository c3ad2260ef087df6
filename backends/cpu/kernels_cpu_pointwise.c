/* CPU element-wise kernels, AdamW and the sum of squares (see kernels_cpu.h). */
#include <math.h>
#include <string.h>

#include "backends/cpu/kernels_cpu.h"

/* ---- element-wise ---- */

/* Element-wise kernels have a loop over plain floats for the all-F32 case (the compiler
 * vectorises it) and, for the others, the same fp32 expression over tiles of TILE elements
 * converted to fp32 and back (dtype_to_f32, dtype_from_f32). */
static bool all_f32(const fsdpc_tensor_t *const *t, int n) {
  for (int i = 0; i < n; i++)
    if (t[i]->dtype != DTYPE_F32) return false;
  return true;
}
#define ALL_F32(...)                                                   \
  all_f32((const fsdpc_tensor_t *const[]){__VA_ARGS__},                \
          (int)(sizeof((const fsdpc_tensor_t *const[]){__VA_ARGS__}) / \
                sizeof(const fsdpc_tensor_t *)))

static inline float silu_sig(float g) { return 1.0f / (1.0f + exp_f32(-g)); }

/* Operands of an element-wise kernel, split into element ranges. */
typedef struct ew_args {
  fsdpc_tensor_t *o, *o2;
  const fsdpc_tensor_t *a, *b, *c;
  float alpha;
  bool f32; /* all operands F32: the vectorised loop */
} ew_args_t;

static fsdpc_status_t ew_run(share_fn *fn, ew_args_t e, int64_t n) {
  cpu_for_shares(n, 1, ELEM_GRAIN, 16, fn, &e);
  return STATUS_OK;
}

WIDE static void silu_mul_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const ew_args_t *e = ctx;
  (void)t;
  if (e->f32) {
    const float *pg = e->a->data, *pu = e->b->data;
    float *po = e->o->data;
#pragma omp simd
    for (int64_t i = i0; i < i1; i++) po[i] = pg[i] * silu_sig(pg[i]) * pu[i];
    return;
  }
  for (int64_t k = i0; k < i1; k += TILE) {
    size_t m = (size_t)(i1 - k < TILE ? i1 - k : TILE);
    float g[TILE], u[TILE], o[TILE];
    dtype_to_f32(e->a->dtype, elem_at(e->a, k), g, m);
    dtype_to_f32(e->b->dtype, elem_at(e->b, k), u, m);
#pragma omp simd
    for (size_t i = 0; i < m; i++) o[i] = g[i] * silu_sig(g[i]);
    dtype_round_f32(e->o->dtype, o, m); /* silu's value in the output dtype, as torch's */
#pragma omp simd
    for (size_t i = 0; i < m; i++) o[i] *= u[i];
    dtype_from_f32(e->o->dtype, o, elem_at(e->o, k), m);
  }
}

static fsdpc_status_t cpu_silu_mul(fsdpc_tensor_t *out, const fsdpc_tensor_t *gate,
                                   const fsdpc_tensor_t *up) {
  return ew_run(silu_mul_share,
                (ew_args_t){.o = out, .a = gate, .b = up, .f32 = ALL_F32(out, gate, up)},
                tensor_numel(out));
}

/* o = dgate, o2 = dup; a = dout, b = gate, c = up */
WIDE static void silu_mul_backward_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const ew_args_t *e = ctx;
  (void)t;
  if (e->f32) {
    const float *pd = e->a->data, *pg = e->b->data, *pu = e->c->data;
    float *dg = e->o->data, *du = e->o2->data;
#pragma omp simd
    for (int64_t i = i0; i < i1; i++) {
      float g = pg[i], s = silu_sig(g), dy = pd[i];
      du[i] = dy * (g * s);
      dg[i] = dy * pu[i] * (s * (1.0f + g * (1.0f - s)));
    }
    return;
  }
  for (int64_t k = i0; k < i1; k += TILE) {
    size_t m = (size_t)(i1 - k < TILE ? i1 - k : TILE);
    float dy[TILE], g[TILE], u[TILE], dg[TILE], du[TILE];
    dtype_to_f32(e->a->dtype, elem_at(e->a, k), dy, m);
    dtype_to_f32(e->b->dtype, elem_at(e->b, k), g, m);
    dtype_to_f32(e->c->dtype, elem_at(e->c, k), u, m);
#pragma omp simd
    for (size_t i = 0; i < m; i++) {
      float s = silu_sig(g[i]);
      du[i] = dy[i] * (g[i] * s);
      dg[i] = dy[i] * u[i] * (s * (1.0f + g[i] * (1.0f - s)));
    }
    dtype_from_f32(e->o2->dtype, du, elem_at(e->o2, k), m);
    dtype_from_f32(e->o->dtype, dg, elem_at(e->o, k), m);
  }
}

static fsdpc_status_t cpu_silu_mul_backward(fsdpc_tensor_t *dgate, fsdpc_tensor_t *dup,
                                            const fsdpc_tensor_t *dout, const fsdpc_tensor_t *gate,
                                            const fsdpc_tensor_t *up) {
  return ew_run(silu_mul_backward_share,
                (ew_args_t){.o = dgate,
                            .o2 = dup,
                            .a = dout,
                            .b = gate,
                            .c = up,
                            .f32 = ALL_F32(dgate, dup, dout, gate, up)},
                tensor_numel(dout));
}

/* ---- activations, bias ---- */

/* GELU's tanh form: the tanh and its argument's derivative (PyTorch's constants). */
static inline float gelu_tanh_t(float x) {
  return tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
}

static float act_value(kernel_act_t act, float x) {
  switch (act) {
    case KERNEL_ACT_RELU: return x > 0.0f ? x : 0.0f;
    case KERNEL_ACT_GELU: return 0.5f * x * (1.0f + erff(x * (float)M_SQRT1_2));
    case KERNEL_ACT_GELU_TANH: return 0.5f * x * (1.0f + gelu_tanh_t(x));
    case KERNEL_ACT_SIGMOID: return silu_sig(x);
    default: return x * silu_sig(x);
  }
}

static float act_derivative(kernel_act_t act, float x) {
  switch (act) {
    case KERNEL_ACT_RELU: return x > 0.0f ? 1.0f : 0.0f;
    case KERNEL_ACT_GELU: /* Phi(x) + x * phi(x) */
      return 0.5f * (1.0f + erff(x * (float)M_SQRT1_2)) +
             x * (float)(0.5 * M_2_SQRTPI * M_SQRT1_2) * expf(-0.5f * x * x);
    case KERNEL_ACT_GELU_TANH: { /* (1 + t) / 2 + x / 2 (1 - t^2) u'(x) */
      float t = gelu_tanh_t(x);
      return 0.5f * (1.0f + t) +
             0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
    }
    case KERNEL_ACT_SIGMOID: {
      float s = silu_sig(x);
      return s * (1.0f - s);
    }
    default: {
      float s = silu_sig(x);
      return s * (1.0f + x * (1.0f - s));
    }
  }
}

static fsdpc_status_t cpu_activation(fsdpc_tensor_t *out, const fsdpc_tensor_t *x,
                                     kernel_act_t act) {
  int64_t n = tensor_numel(out);
  for (int64_t i = 0; i < n; i++)
    dtype_store(out->dtype, out->data, (size_t)i,
                act_value(act, (float)dtype_load(x->dtype, x->data, (size_t)i)));
  return STATUS_OK;
}

static fsdpc_status_t cpu_activation_backward(fsdpc_tensor_t *dx, const fsdpc_tensor_t *dy,
                                              const fsdpc_tensor_t *x, kernel_act_t act) {
  int64_t n = tensor_numel(dx);
  for (int64_t i = 0; i < n; i++) {
    float g = (float)dtype_load(dy->dtype, dy->data, (size_t)i);
    float v = (float)dtype_load(x->dtype, x->data, (size_t)i);
    dtype_store(dx->dtype, dx->data, (size_t)i, g * act_derivative(act, v));
  }
  return STATUS_OK;
}

static fsdpc_status_t cpu_bias_add(fsdpc_tensor_t *out, const fsdpc_tensor_t *x,
                                   const fsdpc_tensor_t *b) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / D;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < D; j++) {
      size_t e = (size_t)(r * D + j);
      dtype_store(out->dtype, out->data, e,
                  (float)dtype_load(x->dtype, x->data, e) +
                      (float)dtype_load(b->dtype, b->data, (size_t)j));
    }
  return STATUS_OK;
}

static fsdpc_status_t cpu_bias_backward(fsdpc_tensor_t *db, const fsdpc_tensor_t *dy) {
  int64_t D = last_dim(dy), rows = tensor_numel(dy) / D;
  fbufs_t s = {0};
  float *fdb = cpu_fbufs_out(&s, db, true);
  const float *fdy = cpu_fbufs_in(&s, dy);
  if (s.st != STATUS_OK) return cpu_fbufs_end(&s, STATUS_OK);
  for (int64_t j = 0; j < D; j++) { /* rows in order, as the CUDA twin */
    float acc = 0;
    for (int64_t r = 0; r < rows; r++) acc += fdy[r * D + j];
    fdb[j] += acc;
  }
  return cpu_fbufs_end(&s, STATUS_OK);
}

WIDE static void add_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const ew_args_t *e = ctx;
  (void)t;
  if (e->f32) {
    const float *pa = e->a->data, *pb = e->b->data;
    float *po = e->o->data;
#pragma omp simd
    for (int64_t i = i0; i < i1; i++) po[i] = pa[i] + pb[i];
    return;
  }
  for (int64_t k = i0; k < i1; k += TILE) {
    size_t m = (size_t)(i1 - k < TILE ? i1 - k : TILE);
    float a[TILE], b[TILE];
    dtype_to_f32(e->a->dtype, elem_at(e->a, k), a, m);
    dtype_to_f32(e->b->dtype, elem_at(e->b, k), b, m);
    for (size_t i = 0; i < m; i++) a[i] += b[i];
    dtype_from_f32(e->o->dtype, a, elem_at(e->o, k), m);
  }
}

static fsdpc_status_t cpu_add(fsdpc_tensor_t *out, const fsdpc_tensor_t *a,
                              const fsdpc_tensor_t *b) {
  return ew_run(add_share, (ew_args_t){.o = out, .a = a, .b = b, .f32 = out->dtype == DTYPE_F32},
                tensor_numel(out));
}

/* o += alpha a */
WIDE static void axpy_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const ew_args_t *e = ctx;
  float alpha = e->alpha;
  (void)t;
  if (e->f32) {
    float *py = e->o->data;
    const float *px = e->a->data;
    if (alpha == 1.0f) {
#pragma omp simd
      for (int64_t i = i0; i < i1; i++) py[i] += px[i];
    } else {
#pragma omp simd
      for (int64_t i = i0; i < i1; i++) py[i] += alpha * px[i];
    }
    return;
  }
  for (int64_t k = i0; k < i1; k += TILE) {
    size_t m = (size_t)(i1 - k < TILE ? i1 - k : TILE);
    float y[TILE], x[TILE];
    dtype_to_f32(e->o->dtype, elem_at(e->o, k), y, m);
    dtype_to_f32(e->a->dtype, elem_at(e->a, k), x, m);
    for (size_t i = 0; i < m; i++) y[i] = y[i] + alpha * x[i];
    dtype_from_f32(e->o->dtype, y, elem_at(e->o, k), m);
  }
}

static fsdpc_status_t cpu_axpy(fsdpc_tensor_t *y, float alpha, const fsdpc_tensor_t *x) {
  return ew_run(axpy_share, (ew_args_t){.o = y, .a = x, .alpha = alpha, .f32 = ALL_F32(y, x)},
                tensor_numel(y));
}

WIDE static void scale_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const ew_args_t *e = ctx;
  float alpha = e->alpha;
  (void)t;
  if (e->f32) {
    float *px = e->o->data;
#pragma omp simd
    for (int64_t i = i0; i < i1; i++) px[i] *= alpha;
    return;
  }
  for (int64_t k = i0; k < i1; k += TILE) {
    size_t m = (size_t)(i1 - k < TILE ? i1 - k : TILE);
    float x[TILE];
    dtype_to_f32(e->o->dtype, elem_at(e->o, k), x, m);
    for (size_t i = 0; i < m; i++) x[i] = alpha * x[i];
    dtype_from_f32(e->o->dtype, x, elem_at(e->o, k), m);
  }
}

static fsdpc_status_t cpu_scale(fsdpc_tensor_t *x, float alpha) {
  return ew_run(scale_share, (ew_args_t){.o = x, .alpha = alpha, .f32 = x->dtype == DTYPE_F32},
                tensor_numel(x));
}

/* ---- optimizer and reductions ---- */

typedef struct adamw_share_args {
  fsdpc_tensor_t *p, *m, *v;
  const fsdpc_tensor_t *g;
  float decay, one_minus_b1, b2, one_minus_b2, step_size, bc2_sqrt, eps, gs;
} adamw_share_args_t;

/* The update of n elements of p from g, with moments m and v, all fp32. */
static inline void adamw_f32(const adamw_share_args_t *a, float *p, const float *g, float *m,
                             float *v, int64_t n) {
  float decay = a->decay, one_minus_b1 = a->one_minus_b1, b2 = a->b2;
  float one_minus_b2 = a->one_minus_b2, step_size = a->step_size, bc2_sqrt = a->bc2_sqrt;
  float eps = a->eps, gs = a->gs;
#pragma omp simd /* vectorised at -O2 as well (-fopenmp-simd): the same IEEE operations */
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i] * gs;
    m[i] += one_minus_b1 * (gi - m[i]);
    v[i] = v[i] * b2 + one_minus_b2 * gi * gi;
    float denom = sqrtf(v[i]) / bc2_sqrt + eps;
    p[i] = p[i] * decay + (-step_size * m[i]) / denom;
  }
}

/* Narrower parameters, gradients or moments (bf16 moments: optim.state_dtype) are widened a
 * tile at a time and the updated values rounded back. */
WIDE static void adamw_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const adamw_share_args_t *a = ctx;
  (void)t;
  if (ALL_F32(a->p, a->g, a->m)) {
    adamw_f32(a, (float *)a->p->data + i0, (const float *)a->g->data + i0, (float *)a->m->data + i0,
              (float *)a->v->data + i0, i1 - i0);
    return;
  }
  for (int64_t k = i0; k < i1; k += TILE) {
    int64_t n = i1 - k < TILE ? i1 - k : TILE;
    float p[TILE], g[TILE], m[TILE], v[TILE];
    fsdpc_tensor_t *const rw[3] = {a->p, a->m, a->v};
    float *const f[3] = {p, m, v};
    for (int j = 0; j < 3; j++) dtype_to_f32(rw[j]->dtype, elem_at(rw[j], k), f[j], (size_t)n);
    dtype_to_f32(a->g->dtype, elem_at(a->g, k), g, (size_t)n);
    adamw_f32(a, p, g, m, v, n);
    for (int j = 0; j < 3; j++) dtype_from_f32(rw[j]->dtype, f[j], elem_at(rw[j], k), (size_t)n);
  }
}

static fsdpc_status_t cpu_adamw(fsdpc_tensor_t *p, const fsdpc_tensor_t *g, fsdpc_tensor_t *m,
                                fsdpc_tensor_t *v, const adamw_args_t *a) {
  double bc1 = 1.0 - pow(a->beta1, (double)a->step), bc2 = 1.0 - pow(a->beta2, (double)a->step);
  adamw_share_args_t s = {
      .p = p,
      .m = m,
      .v = v,
      .g = g,
      .decay = (float)(1.0 - a->lr * a->weight_decay),
      .one_minus_b1 = (float)(1.0 - a->beta1),
      .b2 = (float)a->beta2,
      .one_minus_b2 = (float)(1.0 - a->beta2),
      .step_size = (float)(a->lr / bc1),
      .bc2_sqrt = (float)sqrt(bc2),
      .eps = (float)a->eps,
      .gs = a->grad_scale != 0 ? a->grad_scale : 1.0f, /* x * 1 is x exactly */
  };
  cpu_for_shares(tensor_numel(p), 4, ELEM_GRAIN, 16, adamw_share, &s);
  return STATUS_OK;
}

double cpu_sum_products(const float *a, const float *b, const float *c, int64_t n) {
  double s = 0;
  if (c == NULL) {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i];
  } else {
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i] * c[i];
  }
  return s;
}

/* static: the clones' dispatcher stays inside the library (an external one is exported
 * whatever the visibility) */
static WIDE double exp_sum(float *e, const float *x, int64_t n, float shift) {
  double lane[EXP_LANES] = {0};
  int64_t i = 0;
  if (e != NULL) {
    for (; i + EXP_LANES <= n; i += EXP_LANES) {
#pragma omp simd
      for (int l = 0; l < EXP_LANES; l++) lane[l] += (e[i + l] = exp_f32(x[i + l] - shift));
    }
    for (int l = 0; i < n; i++, l++) lane[l] += (e[i] = exp_f32(x[i] - shift));
  } else {
    for (; i + EXP_LANES <= n; i += EXP_LANES) {
#pragma omp simd
      for (int l = 0; l < EXP_LANES; l++) lane[l] += exp_f32(x[i + l] - shift);
    }
    for (int l = 0; i < n; i++, l++) lane[l] += exp_f32(x[i] - shift);
  }
  for (int w = EXP_LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; l++) lane[l] += lane[l + w];
  return lane[0];
}

double cpu_exp_sum(float *e, const float *x, int64_t n, float shift) {
  return exp_sum(e, x, n, shift);
}

float cpu_max(const float *x, int64_t n) {
  float m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m; /* maxps: no call to fmaxf */
  return m;
}

/* The gradient norm: sums of a[i] b[i] in fp32 lanes over blocks of SUM_BLOCK elements, formed
 * over windows of blocks (in parallel when threads allow), the blocks' sums added in double in
 * order. Not in a WIDE kernel, whose wider lanes would change the order. */
enum { SUM_BLOCK = 256 };

/* One block's sum; a function of its own, so that its vector code (and with it the order of
 * the sum) is the same wherever it is called from. */
__attribute__((noinline)) static float block_sum(const float *x, const float *y, int64_t m) {
  float acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < m; i++) acc += x[i] * y[i];
  return acc;
}

typedef struct dot_args {
  const float *a, *b;
  int64_t n, first; /* the window's first block */
  float *part;      /* one sum per block of the window */
} dot_args_t;

static void dot_share(const void *ctx, int t, int64_t b0, int64_t b1) {
  const dot_args_t *d = ctx;
  (void)t;
  for (int64_t blk = b0; blk < b1; blk++) {
    int64_t i0 = (d->first + blk) * SUM_BLOCK, i1 = i0 + SUM_BLOCK < d->n ? i0 + SUM_BLOCK : d->n;
    d->part[blk] = block_sum(d->a + i0, d->b + i0, i1 - i0);
  }
}

static double dot_f32(const float *a, const float *b, int64_t n) {
  enum { WINDOW = 4096 };
  float part[WINDOW];
  double s = 0;
  int64_t blocks = (n + SUM_BLOCK - 1) / SUM_BLOCK;
  for (int64_t w0 = 0; w0 < blocks; w0 += WINDOW) {
    int64_t nb = blocks - w0 < WINDOW ? blocks - w0 : WINDOW;
    cpu_for_shares(nb, SUM_BLOCK, ELEM_GRAIN, 1, dot_share,
                   &(dot_args_t){.a = a, .b = b, .n = n, .first = w0, .part = part});
    for (int64_t i = 0; i < nb; i++) s += part[i];
  }
  return s;
}

static fsdpc_status_t cpu_sum_squares(const fsdpc_tensor_t *x, double *out) {
  int64_t n = tensor_numel(x);
  double s = 0;
  if (x->dtype == DTYPE_F32) { /* fp32 lanes per block, double across blocks */
    *out = dot_f32(x->data, x->data, n);
    return STATUS_OK;
  }
  for (int64_t k = 0; k < n; k += TILE) { /* in double, in order */
    size_t m = (size_t)(n - k < TILE ? n - k : TILE);
    float e[TILE];
    dtype_to_f32(x->dtype, elem_at(x, k), e, m);
    for (size_t i = 0; i < m; i++) s += (double)e[i] * e[i];
  }
  *out = s;
  return STATUS_OK;
}

void cpu_pointwise_kernels(kernel_ops_t *ops) {
  ops->silu_mul = cpu_silu_mul;
  ops->silu_mul_backward = cpu_silu_mul_backward;
  ops->activation = cpu_activation;
  ops->activation_backward = cpu_activation_backward;
  ops->bias_add = cpu_bias_add;
  ops->bias_backward = cpu_bias_backward;
  ops->add = cpu_add;
  ops->axpy = cpu_axpy;
  ops->scale = cpu_scale;
  ops->adamw = cpu_adamw;
  ops->sum_squares = cpu_sum_squares;
}
