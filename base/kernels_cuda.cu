/*
 * CUDA twin of the compute kernels: cuBLAS (fp32 compute) for matrix products, CUDA kernels
 * elsewhere (attention: kernels_cuda_attention.cu). Same semantics as kernels_cpu.c; values
 * are computed in fp32 and rounded once when stored. Kernels first, then launchers; every
 * launcher runs on the current stream of its device and checks cudaGetLastError().
 */
#include <cub/device/device_radix_sort.cuh>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#include "base/kernels_cuda.h"

/* ======================= kernels ======================= */

/* table holds rows [first, first + V) of a vocabulary of `vocab` ids; others give zeros */
__global__ static void embedding_kernel(void *out, const void *table, int tdt, const void *ids,
                                        int idt, int64_t n, int64_t D, int64_t V, int64_t first,
                                        int64_t vocab, int *bad) {
  GRID_STRIDE(e, n * D) {
    int64_t id = ldi(idt, ids, e / D);
    if (id < 0 || id >= vocab) {
      *bad = 1;
      continue;
    }
    id -= first;
    stf(tdt, out, e, id < 0 || id >= V ? 0.0f : ldf(tdt, table, id * D + e % D));
  }
}

/*
 * Deterministic scatter-add through a stable sort: each token's row of the table (its id
 * less first, or V when the id falls outside this shard) is sorted with the token's index
 * (stable: equal rows keep token order); then the first position of each row's run adds the
 * run's gradients to the row, column by column, in token order, in f32 from the row's value,
 * rounded once (the CPU kernel's order and rounding).
 */
__global__ static void embedding_rows_kernel(int *rows, int *tokens, const void *ids, int idt,
                                             int64_t n, int64_t V, int64_t first, int64_t vocab,
                                             int *bad) {
  GRID_STRIDE(t, n) {
    int64_t id = ldi(idt, ids, t);
    if (id < 0 || id >= vocab) *bad = 1;
    id -= first;
    rows[t] = id < 0 || id >= V ? (int)V : (int)id;
    tokens[t] = (int)t;
  }
}

__global__ static void embedding_runs_kernel(void *gt, int gdt, const void *go, int odt,
                                             const int *rows, const int *tokens, int64_t n,
                                             int64_t D, int64_t V) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    int r = rows[i];
    if (r >= V || (i > 0 && rows[i - 1] == r)) continue; /* not a run's first position */
    for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
      float s = ldf(gdt, gt, r * D + c);
      for (int64_t k = i; k < n && rows[k] == r; k++) s += ldf(odt, go, tokens[k] * D + c);
      stf(gdt, gt, r * D + c, s);
    }
  }
}

/* ---- rows in chunks ---- */

/*
 * A row of V elements of T in chunks of W = 16 / sizeof(T): chunk c holds the elements of
 * [c W, c W + W) below V. When every row the kernel touches starts on a 16-byte boundary (vec),
 * a whole chunk is one aligned pack; otherwise, and for a last partial chunk, it goes element
 * by element, the places past V reading as fill. A block's threads take chunks threadIdx.x,
 * threadIdx.x + blockDim.x, ...
 */
template <typename T>
struct chunks {
  static const int W = 16 / sizeof(T);

  static __device__ int64_t count(int64_t V) { return (V + W - 1) / W; }

  static __device__ void load(const T *row, int64_t c, int64_t V, bool vec, float fill, float *v) {
    if (vec && (c + 1) * W <= V) {
      pack<T> p = ((const pack<T> *)row)[c];
#pragma unroll
      for (int j = 0; j < W; j++) v[j] = tof(p.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < W; j++) v[j] = c * W + j < V ? tof(row[c * W + j]) : fill;
    }
  }

  static __device__ void store(T *row, int64_t c, int64_t V, bool vec, const float *v) {
    if (vec && (c + 1) * W <= V) {
      pack<T> p;
#pragma unroll
      for (int j = 0; j < W; j++) p.v[j] = fromf<T>(v[j]);
      ((pack<T> *)row)[c] = p;
    } else {
#pragma unroll
      for (int j = 0; j < W; j++)
        if (c * W + j < V) row[c * W + j] = fromf<T>(v[j]);
    }
  }
};

static __device__ inline bool aligned16(const void *a, const void *b, const void *c = NULL) {
  return ((uintptr_t)a | (uintptr_t)b | (uintptr_t)c) % 16 == 0;
}

/* Threads for a block per row of D elements of dt: one per chunk, a multiple of 32, at most
 * kBlock. */
static inline int row_threads(int64_t D, int dt) {
  int64_t W = 16 / (int64_t)dtype_size((dtype_t)dt), n = (D + W - 1) / W, t = (n + 31) / 32 * 32;
  return t < 32 ? 32 : t > kBlock ? kBlock : (int)t;
}

template <typename T>
__global__ static void rmsnorm_kernel(T *out, float *rstd, const T *x, const void *w, int wdt,
                                      int64_t D, float eps) {
  typedef chunks<T> C;
  const T *xr = x + blockIdx.x * D;
  T *yr = out + blockIdx.x * D;
  bool vec = aligned16(xr, yr);
  float ss = 0, v[C::W];
  for (int64_t c = threadIdx.x; c < C::count(D); c += blockDim.x) {
    C::load(xr, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) ss += v[j] * v[j];
  }
  ss = block_reduce<false>(ss);
  float r = rsqrtf(ss / (float)D + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  for (int64_t c = threadIdx.x; c < C::count(D); c += blockDim.x) {
    C::load(xr, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) {
      int64_t e = c * C::W + j;
      v[j] = e < D ? ldf(wdt, w, e) * round_to<T>(v[j] * r) : 0.0f;
    }
    C::store(yr, c, D, vec, v);
  }
}

template <typename T>
__global__ static void rmsnorm_backward_dx_kernel(T *dx, const T *dy, const T *x, const void *w,
                                                  int wdt, const float *rstd, int64_t D) {
  typedef chunks<T> C;
  int64_t off = blockIdx.x * D;
  bool vec = aligned16(dx + off, dy + off, x + off);
  float r = rstd[blockIdx.x], dot = 0, g[C::W], v[C::W];
  for (int64_t c = threadIdx.x; c < C::count(D); c += blockDim.x) {
    C::load(dy + off, c, D, vec, 0.0f, g);
    C::load(x + off, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++)
      if (c * C::W + j < D) dot += g[j] * ldf(wdt, w, c * C::W + j) * v[j];
  }
  dot = block_reduce<false>(dot);
  float k = dot / (float)D * r * r;
  for (int64_t c = threadIdx.x; c < C::count(D); c += blockDim.x) {
    C::load(dy + off, c, D, vec, 0.0f, g);
    C::load(x + off, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) {
      int64_t e = c * C::W + j;
      g[j] = e < D ? r * (g[j] * ldf(wdt, w, e) - v[j] * k) : 0.0f;
    }
    C::store(dx + off, c, D, vec, g);
  }
}

/* dw in two passes, in a fixed order (deterministic) and with a thread per (column, block of
 * rows) rather than one per column: partial[c][j] sums rows [c per, (c + 1) per) of column
 * j in order, then dw[j] adds the partial sums in block order. */
template <typename T>
__global__ static void rmsnorm_dw_partial_kernel(float *partial, const T *dy, const T *x,
                                                 const float *rstd, int64_t rows, int64_t D,
                                                 int64_t per) {
  int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, c = blockIdx.y;
  if (j >= D) return;
  int64_t i1 = (c + 1) * per < rows ? (c + 1) * per : rows;
  float s = 0;
  for (int64_t i = c * per; i < i1; i++) s += tof(dy[i * D + j]) * (tof(x[i * D + j]) * rstd[i]);
  partial[c * D + j] = s;
}

__global__ static void rmsnorm_dw_sum_kernel(void *dw, int wdt, const float *partial,
                                             int64_t blocks, int64_t D) {
  GRID_STRIDE(j, D) {
    float s = 0;
    for (int64_t c = 0; c < blocks; c++) s += partial[c * D + j];
    stf(wdt, dw, j, ldf(wdt, dw, j) + s);
  }
}

__global__ static void rope_kernel(void *out, const void *x, int dt, int64_t B, int64_t T,
                                   int64_t H, int64_t Dh, rope_t rope, int64_t pos_offset,
                                   float sign) {
  int64_t half = Dh / 2;
  GRID_STRIDE(e, B * T * H * half) {
    int64_t i = e % half, row = e / half, t = (row / H) % T;
    double ang = (double)(t + pos_offset) * rope_inv_freq(&rope, i, Dh);
    float c = (float)cos(ang), s = sign * (float)sin(ang);
    int64_t base = row * Dh;
    float x1 = ldf(dt, x, base + i), x2 = ldf(dt, x, base + i + half);
    stf(dt, out, base + i, x1 * c - x2 * s);
    stf(dt, out, base + i + half, x2 * c + x1 * s);
  }
}

/* ---- element-wise maps ---- */

template <int NI, int NO>
struct map_ptrs {
  const void *in[NI];
  void *out[NO];
};

/*
 * NI inputs and NO outputs of one storage type T, element by element: op.apply<T>(x, y) reads
 * x[0, NI) and writes y[0, NO) for one element, in f32. The first nvec * W elements (W = 16 /
 * sizeof(T)) go W at a time, each operand in one 16-byte load or store (the launcher sets nvec
 * to 0 unless every pointer is 16-byte aligned); the rest one at a time. An output may alias
 * an input: each element is read, then written, by one thread.
 */
template <typename T, int NI, int NO, typename Op>
__global__ static void map_kernel(map_ptrs<NI, NO> p, int64_t n, int64_t nvec, Op op) {
  const int W = 16 / sizeof(T);
  GRID_STRIDE(v, nvec) {
    pack<T> in[NI], o[NO];
#pragma unroll
    for (int i = 0; i < NI; i++) in[i] = ((const pack<T> *)p.in[i])[v];
#pragma unroll
    for (int j = 0; j < W; j++) {
      float x[NI], y[NO];
#pragma unroll
      for (int i = 0; i < NI; i++) x[i] = tof(in[i].v[j]);
      op.template apply<T>(x, y);
#pragma unroll
      for (int k = 0; k < NO; k++) o[k].v[j] = fromf<T>(y[k]);
    }
#pragma unroll
    for (int k = 0; k < NO; k++) ((pack<T> *)p.out[k])[v] = o[k];
  }
  GRID_STRIDE(r, n - nvec * W) {
    int64_t e = nvec * W + r;
    float x[NI], y[NO];
#pragma unroll
    for (int i = 0; i < NI; i++) x[i] = tof(((const T *)p.in[i])[e]);
    op.template apply<T>(x, y);
#pragma unroll
    for (int k = 0; k < NO; k++) ((T *)p.out[k])[e] = fromf<T>(y[k]);
  }
}

/* out = a + b */
struct op_add {
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    y[0] = x[0] + x[1];
  }
};

/* x = alpha x */
struct op_scale {
  float alpha;
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    y[0] = alpha * x[0];
  }
};

/* y = y + alpha x (inputs y, x) */
struct op_axpy {
  float alpha;
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    y[0] = x[0] + alpha * x[1];
  }
};

/* out = silu(gate) * up, silu's value rounded to T first (inputs gate, up) */
struct op_silu_mul {
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    float g = x[0], sg = 1.0f / (1.0f + expf(-g));
    y[0] = round_to<T>(g * sg) * x[1];
  }
};

/* dgate, dup from dout, gate, up */
struct op_silu_mul_backward {
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    float dy = x[0], g = x[1], u = x[2], s = 1.0f / (1.0f + expf(-g));
    y[1] = dy * (g * s);
    y[0] = dy * u * (s * (1.0f + g * (1.0f - s)));
  }
};

__device__ static float act_value(int act, float x) {
  switch (act) {
    case KERNEL_ACT_RELU: return x > 0.0f ? x : 0.0f;
    case KERNEL_ACT_GELU: return 0.5f * x * (1.0f + erff(x * (float)M_SQRT1_2));
    default: return x / (1.0f + expf(-x));
  }
}

__device__ static float act_derivative(int act, float x) {
  switch (act) {
    case KERNEL_ACT_RELU: return x > 0.0f ? 1.0f : 0.0f;
    case KERNEL_ACT_GELU: /* Phi(x) + x * phi(x) */
      return 0.5f * (1.0f + erff(x * (float)M_SQRT1_2)) +
             x * (float)(0.5 * M_2_SQRTPI * M_SQRT1_2) * expf(-0.5f * x * x);
    default: {
      float s = 1.0f / (1.0f + expf(-x));
      return s * (1.0f + x * (1.0f - s));
    }
  }
}

/* out = act(x) */
struct op_activation {
  int act;
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    y[0] = act_value(act, x[0]);
  }
};

/* dx = dy act'(x) (inputs dy, x) */
struct op_activation_backward {
  int act;
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    y[0] = x[0] * act_derivative(act, x[1]);
  }
};

__global__ static void bias_add_kernel(void *out, const void *x, const void *b, int dt, int64_t n,
                                       int64_t D) {
  GRID_STRIDE(i, n) stf(dt, out, i, ldf(dt, x, i) + ldf(dt, b, i % D));
}

/* One thread per column, summing over rows in order: deterministic, as the CPU twin. */
__global__ static void bias_backward_kernel(void *db, int bdt, const void *dy, int ydt,
                                            int64_t rows, int64_t D) {
  GRID_STRIDE(j, D) {
    float s = 0;
    for (int64_t i = 0; i < rows; i++) s += ldf(ydt, dy, i * D + j);
    stf(bdt, db, j, ldf(bdt, db, j) + s);
  }
}

/* One block per row: mean, then the variance about it, then the normalised row. */
__global__ static void layernorm_kernel(void *out, float *mean, float *rstd, const void *x, int xdt,
                                        const void *w, int wdt, const void *b, int bdt, int64_t D,
                                        float eps) {
  int64_t row = blockIdx.x;
  float s = 0;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) s += ldf(xdt, x, row * D + j);
  float mu = block_reduce<false>(s) / (float)D, ss = 0;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    float d = ldf(xdt, x, row * D + j) - mu;
    ss += d * d;
  }
  float r = rsqrtf(block_reduce<false>(ss) / (float)D + eps);
  if (threadIdx.x == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    float v = (ldf(xdt, x, row * D + j) - mu) * r * ldf(wdt, w, j);
    stf(xdt, out, row * D + j, b ? v + ldf(bdt, b, j) : v);
  }
}

__global__ static void layernorm_backward_dx_kernel(void *dx, const void *dy, const void *x,
                                                    int xdt, const void *w, int wdt,
                                                    const float *mean, const float *rstd,
                                                    int64_t D) {
  int64_t row = blockIdx.x;
  float mu = mean[row], r = rstd[row], a = 0, c = 0;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    int64_t e = row * D + j;
    float g = ldf(xdt, dy, e) * ldf(wdt, w, j), xh = (ldf(xdt, x, e) - mu) * r;
    a += g;
    c += g * xh;
  }
  float ma = block_reduce<false>(a) / (float)D, mc = block_reduce<false>(c) / (float)D;
  for (int64_t j = threadIdx.x; j < D; j += blockDim.x) {
    int64_t e = row * D + j;
    float g = ldf(xdt, dy, e) * ldf(wdt, w, j), xh = (ldf(xdt, x, e) - mu) * r;
    stf(xdt, dx, e, r * (g - ma - xh * mc));
  }
}

/* One thread per column, summing over rows in order: deterministic. */
__global__ static void layernorm_backward_dwb_kernel(void *dw, int wdt, void *db, int bdt,
                                                     const void *dy, const void *x, int xdt,
                                                     const float *mean, const float *rstd,
                                                     int64_t rows, int64_t D) {
  GRID_STRIDE(j, D) {
    float sw = 0, sb = 0;
    for (int64_t i = 0; i < rows; i++) {
      float g = ldf(xdt, dy, i * D + j);
      sw += g * ((ldf(xdt, x, i * D + j) - mean[i]) * rstd[i]);
      sb += g;
    }
    stf(wdt, dw, j, ldf(wdt, dw, j) + sw);
    if (db) stf(bdt, db, j, ldf(bdt, db, j) + sb);
  }
}

/* y += alpha x where x is narrower than y (the same dtypes take op_axpy's map) */
__global__ static void axpy_kernel(void *y, int ydt, float alpha, const void *x, int xdt,
                                   int64_t n) {
  GRID_STRIDE(e, n) stf(ydt, y, e, ldf(ydt, y, e) + alpha * ldf(xdt, x, e));
}

/* log-sum-exp of one row of V values, computed by the whole block (vec: as chunks' load). */
template <typename T>
__device__ static float block_row_lse(const T *row, int64_t V, bool vec) {
  typedef chunks<T> C;
  float m = -INFINITY, s = 0, v[C::W];
  for (int64_t c = threadIdx.x; c < C::count(V); c += blockDim.x) {
    C::load(row, c, V, vec, -INFINITY, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) m = fmaxf(m, v[j]);
  }
  m = block_reduce<true>(m);
  for (int64_t c = threadIdx.x; c < C::count(V); c += blockDim.x) {
    C::load(row, c, V, vec, -INFINITY, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) s += expf(v[j] - m);
  }
  return m + logf(block_reduce<false>(s));
}

template <typename T>
__global__ static void cross_entropy_kernel(float *losses, const T *logits, const void *targets,
                                            int tdt, int64_t V, int *bad) {
  int64_t r = blockIdx.x, t = ldi(tdt, targets, r);
  if (t >= V) {
    if (threadIdx.x == 0) *bad = 1;
    return;
  }
  if (t < 0) {
    if (threadIdx.x == 0) losses[r] = 0.0f;
    return;
  }
  const T *x = logits + r * V;
  float L = block_row_lse(x, V, aligned16(x, x));
  if (threadIdx.x == 0) losses[r] = L - tof(x[t]);
}

/* dlogits may be logits (each value is read, then written, by one thread). */
template <typename T>
__global__ static void cross_entropy_backward_kernel(T *dlogits, const T *logits,
                                                     const void *targets, int tdt, int64_t V,
                                                     float scale, int *bad) {
  typedef chunks<T> C;
  int64_t r = blockIdx.x, t = ldi(tdt, targets, r);
  if (t >= V) {
    if (threadIdx.x == 0) *bad = 1;
    return;
  }
  const T *x = logits + r * V;
  T *d = dlogits + r * V;
  bool vec = aligned16(x, d);
  float L = t < 0 ? 0.0f : block_row_lse(x, V, vec), v[C::W];
  for (int64_t c = threadIdx.x; c < C::count(V); c += blockDim.x) {
    C::load(x, c, V, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) { /* zero for an ignored row, else scale (softmax - onehot) */
      float g = t < 0 ? 0.0f : scale * expf(v[j] - L);
      v[j] = c * C::W + j == t ? g - scale : g;
    }
    C::store(d, c, V, vec, v);
  }
}

struct adamw_consts {
  float decay, one_minus_b1, b2, one_minus_b2, step_size, bc2_sqrt, eps, grad_scale;
};

/* Many parameters' AdamW in one launch (the table is the kernel's argument: no copy to the
 * device). Entry i has blocks [first_block, next entry's first_block); each block strides
 * over its entry's elements. The arithmetic is kernel_adamw's, element by element. */
enum { kAdamwTable = 36 }; /* entries per launch: the table stays under 4 KB of arguments */

struct adamw_entry {
  void *p;
  const void *g;
  float *m, *v;
  int64_t n, first_block;
  int pdt, gdt;
  adamw_consts c;
};

struct adamw_table {
  int count;
  adamw_entry e[kAdamwTable];
};
static_assert(sizeof(adamw_table) <= 4096, "a kernel's arguments: at most 4 KB");

/* The entry of a many-tensor table (entry i owns blocks [e[i].first_block, e[i + 1].first_block),
 * the last one up to the grid's end) this block works on, and the block's place b among the
 * entry's nb blocks. */
template <typename Table>
__device__ static int table_entry(const Table &t, int64_t *b, int64_t *nb) {
  int i = 0;
  while (i + 1 < t.count && (int64_t)blockIdx.x >= t.e[i + 1].first_block) i++;
  *b = blockIdx.x - t.e[i].first_block;
  *nb = (i + 1 < t.count ? t.e[i + 1].first_block : (int64_t)gridDim.x) - t.e[i].first_block;
  return i;
}

__global__ static void adamw_many_kernel(adamw_table t) {
  int64_t b, nb;
  const adamw_entry &x = t.e[table_entry(t, &b, &nb)];
  const adamw_consts &a = x.c;
  for (int64_t e = b * blockDim.x + threadIdx.x; e < x.n; e += nb * blockDim.x) {
    float pi = ldf(x.pdt, x.p, e) * a.decay, gi = __fmul_rn(ldf(x.gdt, x.g, e), a.grad_scale);
    float *m = x.m, *v = x.v;
    m[e] += a.one_minus_b1 * (gi - m[e]);
    v[e] = v[e] * a.b2 + a.one_minus_b2 * gi * gi;
    float denom = sqrtf(v[e]) / a.bc2_sqrt + a.eps;
    stf(x.pdt, x.p, e, pi + (-a.step_size * m[e]) / denom);
  }
}

/* Sums of squares without atomics: block b of a tensor's nb blocks (at most kSsqBlocks)
 * strides over its elements nb blocks apart and writes its float partial to the tensor's
 * partial[b]; then one thread per tensor adds its partials in block order in double. Many
 * tensors' blocks go in one launch, each block finding its tensor in the table (its argument,
 * as adamw_many_kernel's); a tensor's partials are the same whatever else the launch holds. */
static const int kSsqBlocks = 1024;
enum { kSsqTable = 120 }; /* tensors per launch: the table stays under 4 KB of arguments */

struct ssq_entry {
  const void *x;
  int64_t n;
  int first_block, dt;
  float *partial; /* its kSsqBlocks partials */
};

struct ssq_table {
  int count;
  ssq_entry e[kSsqTable];
};
static_assert(sizeof(ssq_table) <= 4096, "a kernel's arguments: at most 4 KB");

__global__ static void sum_squares_many_kernel(ssq_table t) {
  int64_t b, nb;
  const ssq_entry &x = t.e[table_entry(t, &b, &nb)];
  float s = 0;
  for (int64_t e = b * blockDim.x + threadIdx.x; e < x.n; e += nb * blockDim.x) {
    float v = ldf(x.dt, x.x, e);
    s += v * v;
  }
  s = block_reduce<false>(s);
  if (threadIdx.x == 0) x.partial[b] = s;
}

__global__ static void sum_squares_total_kernel(double *out, const float *partial, int n) {
  GRID_STRIDE(t, n) {
    double s = 0;
    for (int b = 0; b < kSsqBlocks; b++) s += partial[t * kSsqBlocks + b];
    out[t] = s;
  }
}

/* ======================= launchers ======================= */

/* A device int flag for index checks, read back after the kernel (a blocking read). */
typedef struct flag {
  device_t dev;
  int *p;
} flag_t;

static status_t flag_new(flag_t *f, device_t dev) {
  f->dev = dev;
  TRY(device_alloc(dev, sizeof(int), (void **)&f->p));
  status_t st = cuda_status(
      cudaMemsetAsync(f->p, 0, sizeof(int), cuda_stream_raw(stream_current(dev))),
      "cudaMemsetAsync (index check flag)");
  if (st != STATUS_OK) device_free(dev, f->p, sizeof(int));
  return st;
}

/* Frees the flag after the kernel that may set it; returns the launch status, else the read's,
 * else an EINVAL built from fmt (one %s for what, one %lld for limit) when the flag was set. */
static status_t flag_finish(flag_t *f, status_t launch, const char *fmt, const char *what,
                            int64_t limit) {
  int raised = 0;
  status_t st = device_memcpy(device_cpu(), &raised, f->dev, f->p, sizeof(int));
  device_free(f->dev, f->p, sizeof(int));
  TRY(launch);
  TRY(st);
  if (raised) return err_set(STATUS_EINVAL, fmt, what, (long long)limit);
  return STATUS_OK;
}

static const char kIndexRange[] = "%s: an index is outside [0, %lld)";
static const char kTargetRange[] = "%s: a target is >= the vocabulary size %lld";

/* cuBLAS is loaded on the first matrix product, not linked: merely loading it (with
 * cuBLASLt) costs every process about 210 MB of resident memory, which CPU-only runs of a
 * CUDA-enabled build should not pay. The loader's usual search finds it (the library's and
 * program's run path, LD_LIBRARY_PATH, the system's cache). */
static struct {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasSetStream_v2) set_stream;
  cublasStatus_t (*gemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                         const void *, const void *, cudaDataType, int, const void *,
                         cudaDataType, int, const void *, void *, cudaDataType, int,
                         cublasComputeType_t, cublasGemmAlgo_t);
  cublasStatus_t (*gemm_batched)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                 int, const void *, const void *const[], cudaDataType, int,
                                 const void *const[], cudaDataType, int, const void *,
                                 void *const[], cudaDataType, int, int, cublasComputeType_t,
                                 cublasGemmAlgo_t);
  char error[256];
} cublas;
static pthread_once_t cublas_once = PTHREAD_ONCE_INIT;

status_t cublas_status(cublasStatus_t s, const char *what) {
  if (s == CUBLAS_STATUS_SUCCESS) return STATUS_OK;
  return err_set(s == CUBLAS_STATUS_ALLOC_FAILED ? STATUS_ENOMEM : STATUS_ECUBLAS,
                 "%s: cuBLAS status %d", what, (int)s);
}

#define CUBLAS_SONAME "libcublas.so." CUBLAS_STR(CUBLAS_VER_MAJOR)
#define CUBLAS_STR(x) CUBLAS_STR2(x)
#define CUBLAS_STR2(x) #x

static void cublas_load(void) {
  void *lib = dlopen(CUBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(cublas.error, sizeof cublas.error, "cannot load %s: %s", CUBLAS_SONAME, dlerror());
    return;
  }
  cublas.create = (decltype(cublas.create))dlsym(lib, "cublasCreate_v2");
  cublas.set_stream = (decltype(cublas.set_stream))dlsym(lib, "cublasSetStream_v2");
  cublas.gemm = (decltype(cublas.gemm))dlsym(lib, "cublasGemmEx");
  cublas.gemm_batched = (decltype(cublas.gemm_batched))dlsym(lib, "cublasGemmBatchedEx");
  if (!cublas.create || !cublas.set_stream || !cublas.gemm || !cublas.gemm_batched)
    snprintf(cublas.error, sizeof cublas.error, "%s lacks cublasCreate_v2, cublasSetStream_v2, "
             "cublasGemmEx or cublasGemmBatchedEx", CUBLAS_SONAME);
}

status_t cuda_blas_handle(int dev, cudaStream_t s, cublasHandle_t *out) {
  static __thread cublasHandle_t handles[DEVICE_MAX_CUDA];
  pthread_once(&cublas_once, cublas_load);
  if (cublas.error[0]) return err_set(STATUS_ECUBLAS, "%s", cublas.error);
  CUDA_TRY(cudaSetDevice(dev));
  if (handles[dev] == NULL) TRY(cublas_status(cublas.create(&handles[dev]), "cublasCreate"));
  TRY(cublas_status(cublas.set_stream(handles[dev], s), "cublasSetStream"));
  *out = handles[dev];
  return STATUS_OK;
}

cublasStatus_t cuda_blas_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                              int n, int k, const void *alpha, const void *a, cudaDataType_t at,
                              int lda, const void *b, cudaDataType_t bt, int ldb, const void *beta,
                              void *c, cudaDataType_t ct, int ldc) {
  return cublas.gemm(h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc,
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

cublasStatus_t cuda_blas_gemm_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                      int m, int n, int k, const void *alpha,
                                      const void *const a[], cudaDataType_t at, int lda,
                                      const void *const b[], cudaDataType_t bt, int ldb,
                                      const void *beta, void *const c[], cudaDataType_t ct,
                                      int ldc, int count) {
  return cublas.gemm_batched(h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc,
                             count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

static status_t cuda_matmul(tensor_t *out, const tensor_t *a, bool trans_a, const tensor_t *b,
                            bool trans_b, float alpha, float beta, const matmul_dims_t *d) {
  cublasHandle_t h;
  TRY(cuda_blas_handle(out->device.index, stream_of(out), &h));
  cudaDataType_t t = cuda_dtype(out->dtype);
  /* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T. */
  cublasStatus_t s = cublas.gemm(
      h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, (int)d->n,
      (int)d->m, (int)d->k, &alpha, b->data, t, (int)d->ldb, a->data, t, (int)d->lda, &beta,
      out->data, t, (int)d->n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (s == CUBLAS_STATUS_SUCCESS) return STATUS_OK;
  char what[96];
  snprintf(what, sizeof what, "cublasGemmEx (m=%lld n=%lld k=%lld)", (long long)d->m,
           (long long)d->n, (long long)d->k);
  return cublas_status(s, what);
}

/* f(T()) with T the storage type of the float dtype dt. */
template <typename F>
static void with_float_type(int dt, F f) {
  switch (dt) {
    case DTYPE_BF16: f(__nv_bfloat16()); break;
    case DTYPE_F16: f(__half()); break;
    default: f(float());
  }
}

/* Runs op over the n = numel(like) elements of the operands in and out, all of like's dtype, on
 * like's device and stream. */
template <int NI, int NO, typename Op>
static status_t map_launch(const tensor_t *like, const void *const (&in)[NI],
                           void *const (&out)[NO], Op op, const char *what) {
  int64_t n = tensor_numel(like);
  if (n == 0) return STATUS_OK;
  map_ptrs<NI, NO> p;
  uintptr_t bits = 0;
  for (int i = 0; i < NI; i++) bits |= (uintptr_t)(p.in[i] = in[i]);
  for (int k = 0; k < NO; k++) bits |= (uintptr_t)(p.out[k] = out[k]);
  int64_t W = 16 / (int64_t)dtype_size(like->dtype), nvec = bits % 16 == 0 ? n / W : 0;
  int grid = grid_for(nvec > n - nvec * W ? nvec : n - nvec * W);
  cudaStream_t s = stream_of(like);
  with_float_type(like->dtype,
                  [&](auto t) { map_kernel<decltype(t)><<<grid, kBlock, 0, s>>>(p, n, nvec, op); });
  return launched(what);
}

static status_t cuda_embedding(tensor_t *out, const tensor_t *table, const tensor_t *ids,
                               int64_t first, int64_t vocab) {
  int64_t n = tensor_numel(ids), D = table->shape[1], V = table->shape[0];
  if (n * D == 0) return STATUS_OK;
  flag_t f;
  TRY(flag_new(&f, out->device));
  embedding_kernel<<<grid_for(n * D), kBlock, 0, stream_of(out)>>>(
      out->data, table->data, table->dtype, ids->data, ids->dtype, n, D, V, first, vocab, f.p);
  return flag_finish(&f, launched("kernel_embedding"), kIndexRange, "kernel_embedding", vocab);
}

static status_t cuda_embedding_backward(tensor_t *grad_table, const tensor_t *grad_out,
                                        const tensor_t *ids, int64_t first, int64_t vocab) {
  int64_t n = tensor_numel(ids), D = grad_table->shape[1], V = grad_table->shape[0];
  if (n * D == 0) return STATUS_OK;
  if (n > INT32_MAX || V >= INT32_MAX)
    return err_set(STATUS_EINVAL, "kernel_embedding_backward: %lld tokens or %lld rows: at most "
                   "2^31 - 1 each on CUDA", (long long)n, (long long)V);
  device_t dev = grad_table->device;
  cudaStream_t s = stream_of(grad_table);
  int end_bit = 1; /* sort keys are rows 0..V: enough bits for V */
  while (end_bit < 31 && ((int64_t)1 << end_bit) <= V) end_bit++;
  size_t sort_bytes = 0;
  CUDA_TRY(cub::DeviceRadixSort::SortPairs(NULL, sort_bytes, (const int *)NULL, (int *)NULL,
                                           (const int *)NULL, (int *)NULL, (int)n, 0, end_bit,
                                           s));
  size_t keys = sizeof(int) * (size_t)n, part = (keys + 255) / 256 * 256;
  size_t bytes = 4 * part + sort_bytes;
  char *buf;
  TRY(device_alloc(dev, bytes, (void **)&buf));
  int *rows = (int *)buf, *tokens = (int *)(buf + part), *rows_sorted = (int *)(buf + 2 * part),
      *tokens_sorted = (int *)(buf + 3 * part);
  flag_t f;
  status_t st = flag_new(&f, dev);
  if (st != STATUS_OK) {
    device_free(dev, buf, bytes);
    return st;
  }
  embedding_rows_kernel<<<grid_for(n), kBlock, 0, s>>>(rows, tokens, ids->data, ids->dtype, n, V,
                                                       first, vocab, f.p);
  st = launched("kernel_embedding_backward");
  if (st == STATUS_OK)
    st = cuda_status(cub::DeviceRadixSort::SortPairs(buf + 4 * part, sort_bytes, rows,
                                                     rows_sorted, tokens, tokens_sorted, (int)n,
                                                     0, end_bit, s),
                     "kernel_embedding_backward: cub::DeviceRadixSort::SortPairs");
  if (st == STATUS_OK) {
    int blocks = n < 65535 ? (int)n : 65535;
    embedding_runs_kernel<<<blocks, kBlock, 0, s>>>(grad_table->data, grad_table->dtype,
                                                    grad_out->data, grad_out->dtype, rows_sorted,
                                                    tokens_sorted, n, D, V);
    st = launched("kernel_embedding_backward");
  }
  device_free(dev, buf, bytes); /* stream-ordered: after the kernels */
  return flag_finish(&f, st, kIndexRange, "kernel_embedding_backward", vocab);
}

static int64_t last_dim(const tensor_t *t) { return t->ndim == 0 ? 1 : t->shape[t->ndim - 1]; }

static status_t cuda_rmsnorm(tensor_t *out, tensor_t *rstd, const tensor_t *x, const tensor_t *w,
                             float eps) {
  int64_t D = last_dim(x), rows = D ? tensor_numel(x) / D : 0;
  if (rows == 0) return STATUS_OK;
  with_float_type(x->dtype, [&](auto t) {
    using T = decltype(t);
    rmsnorm_kernel<<<(unsigned)rows, row_threads(D, x->dtype), 0, stream_of(x)>>>(
        (T *)out->data, (float *)rstd->data, (const T *)x->data, w->data, w->dtype, D, eps);
  });
  return launched("kernel_rmsnorm");
}

static status_t cuda_rmsnorm_backward(tensor_t *dx, tensor_t *dw, const tensor_t *dy,
                                      const tensor_t *x, const tensor_t *w, const tensor_t *rstd) {
  int64_t D = last_dim(x), rows = D ? tensor_numel(x) / D : 0;
  if (rows == 0) return STATUS_OK;
  cudaStream_t s = stream_of(x);
  const float *r = (const float *)rstd->data;
  with_float_type(x->dtype, [&](auto t) {
    using T = decltype(t);
    rmsnorm_backward_dx_kernel<<<(unsigned)rows, row_threads(D, x->dtype), 0, s>>>(
        (T *)dx->data, (const T *)dy->data, (const T *)x->data, w->data, w->dtype, r, D);
  });
  TRY(launched("kernel_rmsnorm_backward"));
  int64_t per = rows / 65535 + 1 > 64 ? rows / 65535 + 1 : 64, blocks = (rows + per - 1) / per;
  size_t bytes = sizeof(float) * (size_t)(blocks * D);
  float *partial;
  TRY(device_alloc(x->device, bytes, (void **)&partial));
  dim3 grid((unsigned)((D + kBlock - 1) / kBlock), (unsigned)blocks);
  with_float_type(x->dtype, [&](auto t) {
    using T = decltype(t);
    rmsnorm_dw_partial_kernel<<<grid, kBlock, 0, s>>>(partial, (const T *)dy->data,
                                                      (const T *)x->data, r, rows, D, per);
  });
  status_t st = launched("kernel_rmsnorm_backward");
  if (st == STATUS_OK) {
    rmsnorm_dw_sum_kernel<<<grid_for(D), kBlock, 0, s>>>(dw->data, dw->dtype, partial, blocks, D);
    st = launched("kernel_rmsnorm_backward");
  }
  device_free(x->device, partial, bytes); /* stream-ordered: after the kernels */
  return st;
}

static status_t cuda_rope(tensor_t *out, const tensor_t *x, const rope_t *rope,
                          int64_t pos_offset, bool inverse) {
  int64_t n = tensor_numel(x) / 2;
  if (n == 0) return STATUS_OK;
  rope_kernel<<<grid_for(n), kBlock, 0, stream_of(x)>>>(out->data, x->data, x->dtype, x->shape[0],
                                                        x->shape[1], x->shape[2], x->shape[3],
                                                        *rope, pos_offset, inverse ? -1.0f : 1.0f);
  return launched("kernel_rope");
}

static status_t cuda_silu_mul(tensor_t *out, const tensor_t *gate, const tensor_t *up) {
  const void *const in[2] = {gate->data, up->data};
  void *const o[1] = {out->data};
  return map_launch(out, in, o, op_silu_mul{}, "kernel_silu_mul");
}

static status_t cuda_silu_mul_backward(tensor_t *dgate, tensor_t *dup, const tensor_t *dout,
                                       const tensor_t *gate, const tensor_t *up) {
  const void *const in[3] = {dout->data, gate->data, up->data};
  void *const o[2] = {dgate->data, dup->data};
  return map_launch(dout, in, o, op_silu_mul_backward{}, "kernel_silu_mul_backward");
}

static status_t cuda_activation(tensor_t *out, const tensor_t *x, kernel_act_t act) {
  const void *const in[1] = {x->data};
  void *const o[1] = {out->data};
  return map_launch(out, in, o, op_activation{(int)act}, "kernel_activation");
}

static status_t cuda_activation_backward(tensor_t *dx, const tensor_t *dy, const tensor_t *x,
                                         kernel_act_t act) {
  const void *const in[2] = {dy->data, x->data};
  void *const o[1] = {dx->data};
  return map_launch(dx, in, o, op_activation_backward{(int)act}, "kernel_activation_backward");
}

static status_t cuda_bias_add(tensor_t *out, const tensor_t *x, const tensor_t *b) {
  int64_t n = tensor_numel(out);
  bias_add_kernel<<<grid_for(n), kBlock, 0, stream_of(out)>>>(out->data, x->data, b->data,
                                                              out->dtype, n, last_dim(x));
  return launched("kernel_bias_add");
}

static status_t cuda_bias_backward(tensor_t *db, const tensor_t *dy) {
  int64_t D = last_dim(dy), rows = tensor_numel(dy) / D;
  bias_backward_kernel<<<grid_for(D), kBlock, 0, stream_of(dy)>>>(db->data, db->dtype, dy->data,
                                                                  dy->dtype, rows, D);
  return launched("kernel_bias_backward");
}

static status_t cuda_layernorm(tensor_t *out, tensor_t *mean, tensor_t *rstd, const tensor_t *x,
                               const tensor_t *w, const tensor_t *b, float eps) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / D;
  layernorm_kernel<<<(unsigned)rows, kBlock, 0, stream_of(x)>>>(
      out->data, (float *)mean->data, (float *)rstd->data, x->data, x->dtype, w->data, w->dtype,
      b ? b->data : NULL, b ? b->dtype : DTYPE_F32, D, eps);
  return launched("kernel_layernorm");
}

static status_t cuda_layernorm_backward(tensor_t *dx, tensor_t *dw, tensor_t *db,
                                        const tensor_t *dy, const tensor_t *x, const tensor_t *w,
                                        const tensor_t *mean, const tensor_t *rstd) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / D;
  cudaStream_t s = stream_of(x);
  layernorm_backward_dx_kernel<<<(unsigned)rows, kBlock, 0, s>>>(
      dx->data, dy->data, x->data, x->dtype, w->data, w->dtype, (const float *)mean->data,
      (const float *)rstd->data, D);
  TRY(launched("kernel_layernorm_backward"));
  layernorm_backward_dwb_kernel<<<grid_for(D), kBlock, 0, s>>>(
      dw->data, dw->dtype, db ? db->data : NULL, db ? db->dtype : DTYPE_F32, dy->data, x->data,
      x->dtype, (const float *)mean->data, (const float *)rstd->data, rows, D);
  return launched("kernel_layernorm_backward");
}

static status_t cuda_add(tensor_t *out, const tensor_t *a, const tensor_t *b) {
  const void *const in[2] = {a->data, b->data};
  void *const o[1] = {out->data};
  return map_launch(out, in, o, op_add{}, "kernel_add");
}

static status_t cuda_axpy(tensor_t *y, float alpha, const tensor_t *x) {
  int64_t n = tensor_numel(y);
  if (n == 0) return STATUS_OK;
  if (y->dtype == x->dtype) {
    const void *const in[2] = {y->data, x->data};
    void *const o[1] = {y->data};
    return map_launch(y, in, o, op_axpy{alpha}, "kernel_axpy");
  }
  axpy_kernel<<<grid_for(n), kBlock, 0, stream_of(y)>>>(y->data, y->dtype, alpha, x->data, x->dtype,
                                                        n);
  return launched("kernel_axpy");
}

static status_t cuda_scale(tensor_t *x, float alpha) {
  const void *const in[1] = {x->data};
  void *const o[1] = {x->data};
  return map_launch(x, in, o, op_scale{alpha}, "kernel_scale");
}

static status_t cuda_cross_entropy(tensor_t *losses, const tensor_t *logits,
                                   const tensor_t *targets) {
  int64_t V = last_dim(logits), N = tensor_numel(targets);
  if (N == 0) return STATUS_OK;
  flag_t f;
  TRY(flag_new(&f, logits->device));
  with_float_type(logits->dtype, [&](auto t) {
    cross_entropy_kernel<<<(unsigned)N, kBlock, 0, stream_of(logits)>>>(
        (float *)losses->data, (const decltype(t) *)logits->data, targets->data, targets->dtype, V,
        f.p);
  });
  return flag_finish(&f, launched("kernel_cross_entropy"), kTargetRange, "kernel_cross_entropy", V);
}

static status_t cuda_cross_entropy_backward(tensor_t *dlogits, const tensor_t *logits,
                                            const tensor_t *targets, float scale) {
  int64_t V = last_dim(logits), N = tensor_numel(targets);
  if (N == 0) return STATUS_OK;
  flag_t f;
  TRY(flag_new(&f, logits->device));
  with_float_type(logits->dtype, [&](auto t) {
    using T = decltype(t);
    cross_entropy_backward_kernel<<<(unsigned)N, kBlock, 0, stream_of(logits)>>>(
        (T *)dlogits->data, (const T *)logits->data, targets->data, targets->dtype, V, scale, f.p);
  });
  return flag_finish(&f, launched("kernel_cross_entropy_backward"), kTargetRange,
                     "kernel_cross_entropy_backward", V);
}

static adamw_consts adamw_consts_of(const adamw_args_t *a) {
  double bc1 = 1.0 - pow(a->beta1, (double)a->step), bc2 = 1.0 - pow(a->beta2, (double)a->step);
  adamw_consts c = {(float)(1.0 - a->lr * a->weight_decay),
                    (float)(1.0 - a->beta1),
                    (float)a->beta2,
                    (float)(1.0 - a->beta2),
                    (float)(a->lr / bc1),
                    (float)sqrt(bc2),
                    (float)a->eps,
                    a->grad_scale != 0 ? a->grad_scale : 1.0f};
  return c;
}

static status_t cuda_adamw_many(const adamw_item_t *items, int n) {
  cudaStream_t s = stream_of(items[0].p);
  for (int i0 = 0; i0 < n;) {
    adamw_table t;
    t.count = 0;
    int64_t blocks = 0;
    for (; i0 < n && t.count < kAdamwTable; i0++) {
      const adamw_item_t *it = &items[i0];
      int64_t numel = tensor_numel(it->p);
      if (numel == 0) continue;
      adamw_entry &e = t.e[t.count++];
      e.p = it->p->data;
      e.g = it->g->data;
      e.m = (float *)it->m->data;
      e.v = (float *)it->v->data;
      e.n = numel;
      e.first_block = blocks;
      e.pdt = it->p->dtype;
      e.gdt = it->g->dtype;
      e.c = adamw_consts_of(&it->args);
      int64_t nb = (numel + kBlock - 1) / kBlock;
      blocks += nb < 1024 ? nb : 1024;
    }
    if (t.count == 0) break;
    adamw_many_kernel<<<(unsigned)blocks, kBlock, 0, s>>>(t);
    TRY(launched("kernel_adamw"));
  }
  return STATUS_OK;
}

static status_t cuda_adamw(tensor_t *p, const tensor_t *g, tensor_t *m, tensor_t *v,
                           const adamw_args_t *a) {
  adamw_item_t it = {p, g, m, v, *a};
  return cuda_adamw_many(&it, 1);
}

static status_t cuda_sum_squares_many(const tensor_t *const *xs, int n, double *out) {
  device_t dev = xs[0]->device;
  cudaStream_t s = stream_of(xs[0]);
  size_t pbytes = sizeof(float) * (size_t)n * kSsqBlocks, bytes = pbytes + sizeof(double) * n;
  char *buf;
  TRY(device_alloc(dev, bytes, (void **)&buf));
  float *partial = (float *)buf;
  double *sums = (double *)(buf + pbytes); /* pbytes is a multiple of 4 KiB */
  /* unused partials stay zero (adding them changes no bit) */
  status_t st =
      cuda_status(cudaMemsetAsync(partial, 0, pbytes, s), "cudaMemsetAsync (sum of squares)");
  for (int i0 = 0; i0 < n && st == STATUS_OK;) {
    ssq_table t;
    t.count = 0;
    int blocks = 0;
    for (; i0 < n && t.count < kSsqTable; i0++) {
      int64_t m = tensor_numel(xs[i0]);
      if (m == 0) continue;
      ssq_entry &e = t.e[t.count++];
      e.x = xs[i0]->data;
      e.n = m;
      e.first_block = blocks;
      e.dt = xs[i0]->dtype;
      e.partial = partial + (size_t)i0 * kSsqBlocks;
      blocks += grid_for(m) < kSsqBlocks ? grid_for(m) : kSsqBlocks;
    }
    if (t.count == 0) break;
    sum_squares_many_kernel<<<(unsigned)blocks, kBlock, 0, s>>>(t);
    st = launched("kernel_sum_squares");
  }
  if (st == STATUS_OK) {
    sum_squares_total_kernel<<<grid_for(n), kBlock, 0, s>>>(sums, partial, n);
    st = launched("kernel_sum_squares");
  }
  if (st == STATUS_OK) st = device_memcpy(device_cpu(), out, dev, sums, sizeof(double) * n);
  device_free(dev, buf, bytes);
  return st;
}

static status_t cuda_sum_squares(const tensor_t *x, double *out) {
  return cuda_sum_squares_many(&x, 1, out);
}

/* Profiling timers: two timing events on the call's stream. */
typedef struct cuda_timer {
  cudaEvent_t start, stop;
  cudaStream_t stream;
} cuda_timer_t;

static void *cuda_timer_start(device_t dev) {
  cuda_timer_t *t = (cuda_timer_t *)calloc(1, sizeof *t);
  if (t == NULL) return NULL;
  t->stream = cuda_stream_raw(stream_current(dev));
  if (cudaEventCreate(&t->start) != cudaSuccess) {
    free(t);
    return NULL;
  }
  if (cudaEventCreate(&t->stop) != cudaSuccess) {
    cudaEventDestroy(t->start);
    free(t);
    return NULL;
  }
  if (cudaEventRecord(t->start, t->stream) != cudaSuccess) {
    cudaEventDestroy(t->start);
    cudaEventDestroy(t->stop);
    free(t);
    return NULL;
  }
  return t;
}

static void cuda_timer_stop(void *timer) {
  cuda_timer_t *t = (cuda_timer_t *)timer;
  cudaEventRecord(t->stop, t->stream);
}

static status_t cuda_timer_read(void *timer, double *seconds) {
  cuda_timer_t *t = (cuda_timer_t *)timer;
  float ms = 0;
  status_t st = cuda_wait_event(t->stop, "kernel profile timer");
  if (st == STATUS_OK)
    st = cuda_status(cudaEventElapsedTime(&ms, t->start, t->stop), "kernel profile timer");
  cudaEventDestroy(t->start);
  cudaEventDestroy(t->stop);
  free(t);
  *seconds = 1e-3 * ms;
  return st;
}

static const kernel_ops_t ops = {
    /* .matmul = */ cuda_matmul,
    /* .embedding = */ cuda_embedding,
    /* .embedding_backward = */ cuda_embedding_backward,
    /* .rmsnorm = */ cuda_rmsnorm,
    /* .rmsnorm_backward = */ cuda_rmsnorm_backward,
    /* .rope = */ cuda_rope,
    /* .attention = */ cuda_attention,
    /* .attention_backward = */ cuda_attention_backward,
    /* .silu_mul = */ cuda_silu_mul,
    /* .silu_mul_backward = */ cuda_silu_mul_backward,
    /* .activation = */ cuda_activation,
    /* .activation_backward = */ cuda_activation_backward,
    /* .bias_add = */ cuda_bias_add,
    /* .bias_backward = */ cuda_bias_backward,
    /* .layernorm = */ cuda_layernorm,
    /* .layernorm_backward = */ cuda_layernorm_backward,
    /* .add = */ cuda_add,
    /* .axpy = */ cuda_axpy,
    /* .scale = */ cuda_scale,
    /* .cross_entropy = */ cuda_cross_entropy,
    /* .cross_entropy_backward = */ cuda_cross_entropy_backward,
    /* .adamw = */ cuda_adamw,
    /* .adamw_many = */ cuda_adamw_many,
    /* .sum_squares = */ cuda_sum_squares,
    /* .sum_squares_many = */ cuda_sum_squares_many,
    /* .timer_start = */ cuda_timer_start,
    /* .timer_stop = */ cuda_timer_stop,
    /* .timer_read = */ cuda_timer_read,
};

extern "C" const kernel_ops_t *cuda_kernels(void) { return &ops; }
