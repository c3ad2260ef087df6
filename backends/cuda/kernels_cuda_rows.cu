/*
 * CUDA twin of the row-wise kernels (kernels_cpu_rows.c): RMSNorm and LayerNorm forward and
 * backward, cross-entropy fused with its softmax. One block per row; rows go in 16-byte chunks
 * where they are aligned. Kernels first, then launchers.
 */
#include "backends/cuda/kernels_cuda.h"

/* ======================= kernels ======================= */

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

/* dx, one block per row. */
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

/* dw's term of row i, column j: dy x rstd (summed by column_sums, in a pass of its own: one pass
 * for dx and dw, 512 blocks of many rows each summing dw's columns in shared memory, took
 * 1.94 ms a llama-100m step on an H200 where the two passes take 1.03) */
template <typename T>
struct rmsnorm_dw_term {
  const T *dy, *x;
  const float *rstd;
  int64_t D;
  __device__ void operator()(int64_t i, int64_t j, float *s) const {
    s[0] += tof(dy[i * D + j]) * (tof(x[i * D + j]) * rstd[i]);
  }
};

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

/* dw's and db's terms of row i, column j: dy x-hat and dy */
struct layernorm_dwb_term {
  const void *dy, *x;
  int xdt;
  const float *mean, *rstd;
  int64_t D;
  __device__ void operator()(int64_t i, int64_t j, float *s) const {
    float g = ldf(xdt, dy, i * D + j);
    s[0] += g * ((ldf(xdt, x, i * D + j) - mean[i]) * rstd[i]);
    s[1] += g;
  }
};

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
                                                     float scale, const float *dloss,
                                                     const long long *count, int *bad) {
  typedef chunks<T> C;
  if (count != NULL) /* the mean loss's gradient, as the CPU kernel rounds it */
    scale = (float)((double)dloss[0] / (double)count[0]);
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

static const int kMeanThreads = 256;

/* kernel_masked_mean in one block: each thread's f64 sum of a strided share, then the shares
 * summed in a fixed tree (the same value every run). */
__global__ static void masked_mean_kernel(float *mean, long long *count, const float *values,
                                          const void *targets, int tdt, int64_t n) {
  __shared__ double sums[kMeanThreads];
  __shared__ long long counts[kMeanThreads];
  double s = 0;
  long long c = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
    if (ldi(tdt, targets, i) >= 0) {
      s += values[i];
      c++;
    }
  sums[threadIdx.x] = s;
  counts[threadIdx.x] = c;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if ((int)threadIdx.x < half) {
      sums[threadIdx.x] += sums[threadIdx.x + half];
      counts[threadIdx.x] += counts[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *mean = (float)(sums[0] / (double)counts[0]); /* 0 / 0: NaN */
    *count = counts[0];
  }
}

/* ======================= launchers ======================= */

static const char kTargetRange[] = "%s: a target is >= the vocabulary size %lld";

static fsdpc_status_t cuda_rmsnorm(fsdpc_tensor_t *out, fsdpc_tensor_t *rstd,
                                   const fsdpc_tensor_t *x, const fsdpc_tensor_t *w, float eps) {
  int64_t D = last_dim(x), rows = D ? tensor_numel(x) / D : 0;
  if (rows == 0) return STATUS_OK;
  with_float_type(x->dtype, [&](auto t) {
    using T = decltype(t);
    rmsnorm_kernel<<<(unsigned)rows, row_threads(D, x->dtype), 0, stream_of(x)>>>(
        (T *)out->data, (float *)rstd->data, (const T *)x->data, w->data, w->dtype, D, eps);
  });
  return launched("kernel_rmsnorm");
}

static fsdpc_status_t cuda_rmsnorm_backward(fsdpc_tensor_t *dx, fsdpc_tensor_t *dw,
                                            const fsdpc_tensor_t *dy, const fsdpc_tensor_t *x,
                                            const fsdpc_tensor_t *w, const fsdpc_tensor_t *rstd) {
  int64_t D = last_dim(x), rows = D ? tensor_numel(x) / D : 0;
  if (rows == 0) return STATUS_OK;
  cudaStream_t s = stream_of(x);
  const float *r = (const float *)rstd->data;
  fsdpc_status_t st = STATUS_OK;
  with_float_type(x->dtype, [&](auto t) {
    using T = decltype(t);
    const T *pdy = (const T *)dy->data, *px = (const T *)x->data;
    rmsnorm_backward_dx_kernel<<<(unsigned)rows, row_threads(D, x->dtype), 0, s>>>(
        (T *)dx->data, pdy, px, w->data, w->dtype, r, D);
    st = launched("kernel_rmsnorm_backward");
    if (st == STATUS_OK)
      st = column_sums<1>(x->device, s, rows, D, rmsnorm_dw_term<T>{pdy, px, r, D},
                          column_outs<1>{{{dw->data, dw->dtype}}}, "kernel_rmsnorm_backward");
  });
  return st;
}

static fsdpc_status_t cuda_layernorm(fsdpc_tensor_t *out, fsdpc_tensor_t *mean,
                                     fsdpc_tensor_t *rstd, const fsdpc_tensor_t *x,
                                     const fsdpc_tensor_t *w, const fsdpc_tensor_t *b, float eps) {
  int64_t D = last_dim(x), rows = tensor_numel(x) / D;
  layernorm_kernel<<<(unsigned)rows, kBlock, 0, stream_of(x)>>>(
      out->data, (float *)mean->data, (float *)rstd->data, x->data, x->dtype, w->data, w->dtype,
      b ? b->data : NULL, b ? b->dtype : DTYPE_F32, D, eps);
  return launched("kernel_layernorm");
}

static fsdpc_status_t cuda_layernorm_backward(fsdpc_tensor_t *dx, fsdpc_tensor_t *dw,
                                              fsdpc_tensor_t *db, const fsdpc_tensor_t *dy,
                                              const fsdpc_tensor_t *x, const fsdpc_tensor_t *w,
                                              const fsdpc_tensor_t *mean,
                                              const fsdpc_tensor_t *rstd) {
  int64_t D = last_dim(x), rows = D ? tensor_numel(x) / D : 0;
  if (rows == 0) return STATUS_OK;
  cudaStream_t s = stream_of(x);
  layernorm_backward_dx_kernel<<<(unsigned)rows, kBlock, 0, s>>>(
      dx->data, dy->data, x->data, x->dtype, w->data, w->dtype, (const float *)mean->data,
      (const float *)rstd->data, D);
  FSDPC_TRY(launched("kernel_layernorm_backward"));
  const float *mu = (const float *)mean->data, *r = (const float *)rstd->data;
  column_outs<2> outs = {{{dw->data, dw->dtype}, {db ? db->data : NULL, db ? db->dtype : 0}}};
  return column_sums<2>(x->device, s, rows, D,
                        layernorm_dwb_term{dy->data, x->data, x->dtype, mu, r, D}, outs,
                        "kernel_layernorm_backward");
}

static fsdpc_status_t cuda_cross_entropy(fsdpc_tensor_t *losses, const fsdpc_tensor_t *logits,
                                         const fsdpc_tensor_t *targets) {
  int64_t V = last_dim(logits), N = tensor_numel(targets);
  if (N == 0) return STATUS_OK;
  flag_t f;
  FSDPC_TRY(flag_new(&f, logits->device, kTargetRange, "kernel_cross_entropy", V));
  with_float_type(logits->dtype, [&](auto t) {
    cross_entropy_kernel<<<(unsigned)N, kBlock, 0, stream_of(logits)>>>(
        (float *)losses->data, (const decltype(t) *)logits->data, targets->data, targets->dtype, V,
        f.p);
  });
  return flag_finish(&f, launched("kernel_cross_entropy"));
}

static fsdpc_status_t cuda_masked_mean(fsdpc_tensor_t *mean, fsdpc_tensor_t *count,
                                       const fsdpc_tensor_t *values,
                                       const fsdpc_tensor_t *targets) {
  masked_mean_kernel<<<1, kMeanThreads, 0, stream_of(mean)>>>(
      (float *)mean->data, (long long *)count->data, (const float *)values->data, targets->data,
      targets->dtype, tensor_numel(targets));
  return launched("kernel_masked_mean");
}

static fsdpc_status_t cuda_cross_entropy_backward(fsdpc_tensor_t *dlogits,
                                                  const fsdpc_tensor_t *logits,
                                                  const fsdpc_tensor_t *targets, float scale,
                                                  const fsdpc_tensor_t *dloss,
                                                  const fsdpc_tensor_t *count) {
  int64_t V = last_dim(logits), N = tensor_numel(targets);
  if (N == 0) return STATUS_OK;
  flag_t f;
  FSDPC_TRY(flag_new(&f, logits->device, kTargetRange, "kernel_cross_entropy_backward", V));
  with_float_type(logits->dtype, [&](auto t) {
    using T = decltype(t);
    cross_entropy_backward_kernel<<<(unsigned)N, kBlock, 0, stream_of(logits)>>>(
        (T *)dlogits->data, (const T *)logits->data, targets->data, targets->dtype, V, scale,
        dloss ? (const float *)dloss->data : NULL,
        count ? (const long long *)count->data : NULL, f.p);
  });
  return flag_finish(&f, launched("kernel_cross_entropy_backward"));
}

void cuda_row_kernels(kernel_ops_t *ops) {
  ops->rmsnorm = cuda_rmsnorm;
  ops->rmsnorm_backward = cuda_rmsnorm_backward;
  ops->layernorm = cuda_layernorm;
  ops->layernorm_backward = cuda_layernorm_backward;
  ops->cross_entropy = cuda_cross_entropy;
  ops->cross_entropy_backward = cuda_cross_entropy_backward;
  ops->masked_mean = cuda_masked_mean;
}
