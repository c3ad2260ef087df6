/*
 * CUDA twin of the row-wise kernels (kernels_cpu_rows.c): RMSNorm and LayerNorm forward and
 * backward a warp per row, cross-entropy fused with its softmax a block per row; rows go in
 * 16-byte chunks where they are aligned. Kernels first, then launchers.
 */
#include "backends/cuda/kernels_cuda.h"

/* ======================= kernels ======================= */

/* ---- rows in chunks ---- */

/*
 * A row of V elements of T in chunks of W = 16 / sizeof(T): chunk c holds the elements of
 * [c W, c W + W) below V. When every row the kernel touches starts on a 16-byte boundary (vec),
 * a whole chunk is one aligned pack; otherwise, and for a last partial chunk, it goes element
 * by element, the places past V reading as fill. The threads on a row take chunks t, t + n,
 * ... (t their place among the row's n threads: a warp's lanes, or a block's threads).
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

/* RMSNorm a warp per row (kRowsPerBlock rows a block): a warp's lanes take the row's chunks
 * lane, lane + 32, ..., its sums over the warp without a block barrier. One block per row
 * (a barrier between the sum and the normalisation, most of the block waiting at it) ran
 * at 2.06 TB/s forward and 1.1 TB/s backward on an H200 (llama-0.9b, rows of 2048 bf16). */
static const int kRowsPerBlock = 8;

template <typename T>
__global__ static void rmsnorm_kernel(T *out, float *rstd, const T *x, const void *w, int wdt,
                                      int64_t rows, int64_t D, float eps) {
  typedef chunks<T> C;
  int64_t row = blockIdx.x * (int64_t)kRowsPerBlock + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= rows) return; /* a whole warp */
  const T *xr = x + row * D;
  T *yr = out + row * D;
  bool vec = aligned16(xr, yr);
  float ss = 0, v[C::W];
#pragma unroll 4
  for (int64_t c = lane; c < C::count(D); c += 32) {
    C::load(xr, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) ss += v[j] * v[j];
  }
  ss = warp_sum(ss);
  float r = rsqrtf(ss / (float)D + eps);
  if (lane == 0) rstd[row] = r;
#pragma unroll 4
  for (int64_t c = lane; c < C::count(D); c += 32) {
    C::load(xr, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) {
      int64_t e = c * C::W + j;
      v[j] = e < D ? ldf(wdt, w, e) * round_to<T>(v[j] * r) : 0.0f;
    }
    C::store(yr, c, D, vec, v);
  }
}

/* dx, a warp per row as rmsnorm_kernel. */
template <typename T>
__global__ static void rmsnorm_backward_dx_kernel(T *dx, const T *dy, const T *x, const void *w,
                                                  int wdt, const float *rstd, int64_t rows,
                                                  int64_t D) {
  typedef chunks<T> C;
  int64_t row = blockIdx.x * (int64_t)kRowsPerBlock + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= rows) return; /* a whole warp */
  int64_t off = row * D;
  bool vec = aligned16(dx + off, dy + off, x + off);
  float r = rstd[row], dot = 0, g[C::W], v[C::W];
#pragma unroll 4
  for (int64_t c = lane; c < C::count(D); c += 32) {
    C::load(dy + off, c, D, vec, 0.0f, g);
    C::load(x + off, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++)
      if (c * C::W + j < D) dot += g[j] * ldf(wdt, w, c * C::W + j) * v[j];
  }
  dot = warp_sum(dot);
  float k = dot / (float)D * r * r;
#pragma unroll 4
  for (int64_t c = lane; c < C::count(D); c += 32) {
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
  /* columns [c W, c W + W) of row i, W = 16 / sizeof(T) (rows on 16-byte boundaries) */
  __device__ void packs(int64_t i, int64_t c, float (*s)[16 / sizeof(T)]) const {
    pack<T> g = ((const pack<T> *)(dy + i * D))[c], v = ((const pack<T> *)(x + i * D))[c];
    float r = rstd[i];
#pragma unroll
    for (int j = 0; j < (int)(16 / sizeof(T)); j++) s[0][j] += tof(g.v[j]) * (tof(v.v[j]) * r);
  }
};

/* A warp per row as RMSNorm's: mean, then the variance about it, then the normalised row; rows
 * in chunks (the element-wise loads chunks replaced ran at 0.8 TB/s on an H200). */
template <typename T>
__global__ static void layernorm_kernel(T *out, float *mean, float *rstd, const T *x, const void *w,
                                        int wdt, const void *b, int bdt, int64_t rows, int64_t D,
                                        float eps) {
  typedef chunks<T> C;
  int64_t row = blockIdx.x * (int64_t)kRowsPerBlock + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= rows) return; /* a whole warp */
  const T *xr = x + row * D;
  T *yr = out + row * D;
  bool vec = aligned16(xr, yr);
  float s = 0, v[C::W];
#pragma unroll 4
  for (int64_t c = lane; c < C::count(D); c += 32) {
    C::load(xr, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) s += v[j];
  }
  float mu = warp_sum(s) / (float)D, ss = 0;
#pragma unroll 4
  for (int64_t c = lane; c < C::count(D); c += 32) {
    C::load(xr, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) {
      float d = c * C::W + j < D ? v[j] - mu : 0.0f;
      ss += d * d;
    }
  }
  float r = rsqrtf(warp_sum(ss) / (float)D + eps);
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = r;
  }
#pragma unroll 4
  for (int64_t c = lane; c < C::count(D); c += 32) {
    C::load(xr, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) {
      int64_t e = c * C::W + j;
      if (e >= D) continue;
      float y = (v[j] - mu) * r * ldf(wdt, w, e);
      v[j] = b ? y + ldf(bdt, b, e) : y;
    }
    C::store(yr, c, D, vec, v);
  }
}

template <typename T>
__global__ static void layernorm_backward_dx_kernel(T *dx, const T *dy, const T *x, const void *w,
                                                    int wdt, const float *mean, const float *rstd,
                                                    int64_t rows, int64_t D) {
  typedef chunks<T> C;
  int64_t row = blockIdx.x * (int64_t)kRowsPerBlock + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= rows) return; /* a whole warp */
  int64_t off = row * D;
  bool vec = aligned16(dx + off, dy + off, x + off);
  float mu = mean[row], r = rstd[row], a = 0, k = 0, g[C::W], v[C::W];
#pragma unroll 4
  for (int64_t c = lane; c < C::count(D); c += 32) {
    C::load(dy + off, c, D, vec, 0.0f, g);
    C::load(x + off, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) {
      int64_t e = c * C::W + j;
      if (e >= D) continue;
      float gw = g[j] * ldf(wdt, w, e), xh = (v[j] - mu) * r;
      a += gw;
      k += gw * xh;
    }
  }
  float ma = warp_sum(a) / (float)D, mk = warp_sum(k) / (float)D;
#pragma unroll 4
  for (int64_t c = lane; c < C::count(D); c += 32) {
    C::load(dy + off, c, D, vec, 0.0f, g);
    C::load(x + off, c, D, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) {
      int64_t e = c * C::W + j;
      float gw = e < D ? g[j] * ldf(wdt, w, e) : 0.0f, xh = (v[j] - mu) * r;
      g[j] = e < D ? r * (gw - ma - xh * mk) : 0.0f;
    }
    C::store(dx + off, c, D, vec, g);
  }
}

/* dw's and db's terms of row i, column j: dy x-hat and dy */
template <typename T>
struct layernorm_dwb_term {
  const T *dy, *x;
  const float *mean, *rstd;
  int64_t D;
  __device__ void operator()(int64_t i, int64_t j, float *s) const {
    float g = tof(dy[i * D + j]);
    s[0] += g * ((tof(x[i * D + j]) - mean[i]) * rstd[i]);
    s[1] += g;
  }
  /* columns [c W, c W + W) of row i, W = 16 / sizeof(T) (rows on 16-byte boundaries) */
  __device__ void packs(int64_t i, int64_t c, float (*s)[16 / sizeof(T)]) const {
    pack<T> pg = ((const pack<T> *)(dy + i * D))[c], pv = ((const pack<T> *)(x + i * D))[c];
    float mu = mean[i], r = rstd[i];
#pragma unroll
    for (int j = 0; j < (int)(16 / sizeof(T)); j++) {
      float g = tof(pg.v[j]);
      s[0][j] += g * ((tof(pv.v[j]) - mu) * r);
      s[1][j] += g;
    }
  }
};

/* Elements of T before p's first 16-byte boundary, at most V: a row that starts off a boundary
 * (a vocabulary of 50257 in bf16 puts most rows there) goes element by element up to it, then
 * in whole chunks from it. */
template <typename T>
__device__ static int64_t lead_of(const T *p, int64_t V) {
  int64_t l = (int64_t)(((16 - ((uintptr_t)p & 15)) & 15) / sizeof(T));
  return l < V ? l : V;
}

/* log-sum-exp of one row of V values, computed by the whole block: its first lead values one
 * by one, the rest in chunks from the boundary (vec: aligned chunks; lead 0 without). */
template <typename T>
__device__ static float block_row_lse(const T *row, int64_t V, int64_t lead, bool vec) {
  typedef chunks<T> C;
  const T *a = row + lead;
  int64_t Va = V - lead;
  float m = -INFINITY, s = 0, v[C::W];
  for (int64_t j = threadIdx.x; j < lead; j += blockDim.x) m = fmaxf(m, tof(row[j]));
  for (int64_t c = threadIdx.x; c < C::count(Va); c += blockDim.x) {
    C::load(a, c, Va, vec, -INFINITY, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) m = fmaxf(m, v[j]);
  }
  m = block_reduce<true>(m);
  for (int64_t j = threadIdx.x; j < lead; j += blockDim.x) s += expf(tof(row[j]) - m);
  for (int64_t c = threadIdx.x; c < C::count(Va); c += blockDim.x) {
    C::load(a, c, Va, vec, -INFINITY, v);
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
  float L = block_row_lse(x, V, lead_of(x, V), true);
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
  /* x and d off a boundary alike: both go one by one up to it, then in aligned chunks */
  bool vec = ((uintptr_t)x - (uintptr_t)d) % 16 == 0;
  int64_t lead = vec ? lead_of(x, V) : 0, Va = V - lead;
  float L = t < 0 ? 0.0f : block_row_lse(x, V, lead, vec), v[C::W];
  /* zero for an ignored row, else scale (softmax - onehot) */
  for (int64_t j = threadIdx.x; j < lead; j += blockDim.x) {
    float g = t < 0 ? 0.0f : scale * expf(tof(x[j]) - L);
    d[j] = fromf<T>(j == t ? g - scale : g);
  }
  const T *xa = x + lead;
  T *da = d + lead;
  for (int64_t c = threadIdx.x; c < C::count(Va); c += blockDim.x) {
    C::load(xa, c, Va, vec, 0.0f, v);
#pragma unroll
    for (int j = 0; j < C::W; j++) {
      float g = t < 0 ? 0.0f : scale * expf(v[j] - L);
      v[j] = lead + c * C::W + j == t ? g - scale : g;
    }
    C::store(da, c, Va, vec, v);
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

/* ---- a mixture of experts' weighted sum (kernel_moe_combine) ---- */

/* A thread per output element: the slots' rows in order, products and sums rounded apart (no
 * contraction), as the CPU twin computes them. Rows outside [0, M) are skipped. */
template <typename T>
__global__ static void moe_combine_kernel(T *out, const T *y, const T *w, const int64_t *offs,
                                          const int64_t *rows, int64_t N, int64_t D, int64_t k,
                                          int64_t M) {
  GRID_STRIDE(i, N * D) {
    int64_t t = i / D, d = i % D;
    float acc = 0;
    for (int64_t s = t * k; s < (t + 1) * k; s++) {
      float ws = tof(w[s]);
      for (int64_t m = offs[s]; m < offs[s + 1]; m++) {
        int64_t r = rows[m];
        if (r >= 0 && r < M) acc = __fadd_rn(acc, __fmul_rn(ws, tof(y[r * D + d])));
      }
    }
    out[i] = fromf<T>(acc);
  }
}

/* dy: a thread per element, its row's slot's weight times the slot's token's gradient. */
template <typename T>
__global__ static void moe_combine_dy_kernel(T *dy, const T *dout, const T *w, const int64_t *slots,
                                             int64_t M, int64_t D, int64_t k, int64_t S) {
  GRID_STRIDE(i, M * D) {
    int64_t m = i / D, d = i % D, s = slots[m];
    float v = s >= 0 && s < S ? __fmul_rn(tof(w[s]), tof(dout[(s / k) * D + d])) : 0.0f;
    dy[i] = fromf<T>(v);
  }
}

/* dw: a block per slot (grid-strided), its rows' products with the token's gradient summed
 * over the block. */
template <typename T>
__global__ static void moe_combine_dw_kernel(T *dw, const T *dout, const T *y, const int64_t *offs,
                                             const int64_t *rows, int64_t S, int64_t D, int64_t k,
                                             int64_t M) {
  for (int64_t s = blockIdx.x; s < S; s += gridDim.x) {
    const T *g = dout + (s / k) * D;
    int64_t n = (offs[s + 1] - offs[s]) * D;
    float acc = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      int64_t r = rows[offs[s] + i / D], d = i % D;
      if (r >= 0 && r < M) acc += tof(y[r * D + d]) * tof(g[d]);
    }
    acc = block_reduce<false>(acc);
    if (threadIdx.x == 0) dw[s] = fromf<T>(acc);
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
    rmsnorm_kernel<<<(unsigned)((rows + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock, 0,
                     stream_of(x)>>>((T *)out->data, (float *)rstd->data, (const T *)x->data,
                                     w->data, w->dtype, rows, D, eps);
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
    rmsnorm_backward_dx_kernel<<<(unsigned)((rows + kRowsPerBlock - 1) / kRowsPerBlock),
                                 32 * kRowsPerBlock, 0, s>>>((T *)dx->data, pdy, px, w->data,
                                                             w->dtype, r, rows, D);
    st = launched("kernel_rmsnorm_backward");
    if (st == STATUS_OK)
      st = column_sums_packs<1, T>(
          x->device, s, rows, D, ((uintptr_t)pdy | (uintptr_t)px) % 16 == 0,
          rmsnorm_dw_term<T>{pdy, px, r, D}, column_outs<1>{{{dw->data, dw->dtype}}},
          "kernel_rmsnorm_backward");
  });
  return st;
}

static fsdpc_status_t cuda_layernorm(fsdpc_tensor_t *out, fsdpc_tensor_t *mean,
                                     fsdpc_tensor_t *rstd, const fsdpc_tensor_t *x,
                                     const fsdpc_tensor_t *w, const fsdpc_tensor_t *b, float eps) {
  int64_t D = last_dim(x), rows = D ? tensor_numel(x) / D : 0;
  if (rows == 0) return STATUS_OK;
  with_float_type(x->dtype, [&](auto t) {
    using T = decltype(t);
    layernorm_kernel<<<(unsigned)((rows + kRowsPerBlock - 1) / kRowsPerBlock), 32 * kRowsPerBlock,
                       0, stream_of(x)>>>((T *)out->data, (float *)mean->data, (float *)rstd->data,
                                          (const T *)x->data, w->data, w->dtype, b ? b->data : NULL,
                                          b ? b->dtype : DTYPE_F32, rows, D, eps);
  });
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
  const float *mu = (const float *)mean->data, *r = (const float *)rstd->data;
  column_outs<2> outs = {{{dw->data, dw->dtype}, {db ? db->data : NULL, db ? db->dtype : 0}}};
  fsdpc_status_t st = STATUS_OK;
  with_float_type(x->dtype, [&](auto t) {
    using T = decltype(t);
    const T *pdy = (const T *)dy->data, *px = (const T *)x->data;
    layernorm_backward_dx_kernel<<<(unsigned)((rows + kRowsPerBlock - 1) / kRowsPerBlock),
                                   32 * kRowsPerBlock, 0, s>>>((T *)dx->data, pdy, px, w->data,
                                                               w->dtype, mu, r, rows, D);
    st = launched("kernel_layernorm_backward");
    if (st == STATUS_OK)
      st = column_sums_packs<2, T>(
          x->device, s, rows, D, ((uintptr_t)pdy | (uintptr_t)px) % 16 == 0,
          layernorm_dwb_term<T>{pdy, px, mu, r, D}, outs, "kernel_layernorm_backward");
  });
  return st;
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

static fsdpc_status_t cuda_moe_combine(fsdpc_tensor_t *out, const fsdpc_tensor_t *y,
                                       const fsdpc_tensor_t *w, const fsdpc_tensor_t *offs,
                                       const fsdpc_tensor_t *rows) {
  int64_t D = last_dim(y);
  if (D == 0 || tensor_numel(out) == 0) return STATUS_OK;
  int64_t M = tensor_numel(y) / D, N = tensor_numel(out) / D, k = tensor_numel(w) / N;
  with_float_type(y->dtype, [&](auto t) {
    using T = decltype(t);
    moe_combine_kernel<<<grid_for(N * D), kBlock, 0, stream_of(out)>>>(
        (T *)out->data, (const T *)y->data, (const T *)w->data, (const int64_t *)offs->data,
        (const int64_t *)rows->data, N, D, k, M);
  });
  return launched("kernel_moe_combine");
}

static fsdpc_status_t cuda_moe_combine_backward(fsdpc_tensor_t *dy, fsdpc_tensor_t *dw,
                                                const fsdpc_tensor_t *dout, const fsdpc_tensor_t *y,
                                                const fsdpc_tensor_t *w,
                                                const fsdpc_tensor_t *slots,
                                                const fsdpc_tensor_t *offs,
                                                const fsdpc_tensor_t *rows) {
  int64_t D = last_dim(y);
  if (D == 0 || tensor_numel(dout) == 0) { /* no features: no weight gradient */
    if (tensor_numel(dw) > 0)
      return cuda_status(cudaMemsetAsync(dw->data, 0, tensor_nbytes(dw), stream_of(dw)),
                         "kernel_moe_combine_backward");
    return STATUS_OK;
  }
  int64_t M = tensor_numel(y) / D, N = tensor_numel(dout) / D, S = tensor_numel(w), k = S / N;
  cudaStream_t st = stream_of(dy);
  with_float_type(y->dtype, [&](auto t) {
    using T = decltype(t);
    if (M > 0)
      moe_combine_dy_kernel<<<grid_for(M * D), kBlock, 0, st>>>(
          (T *)dy->data, (const T *)dout->data, (const T *)w->data, (const int64_t *)slots->data, M,
          D, k, S);
    if (S > 0)
      moe_combine_dw_kernel<<<(unsigned)(S < 65535 ? S : 65535), kBlock, 0, st>>>(
          (T *)dw->data, (const T *)dout->data, (const T *)y->data, (const int64_t *)offs->data,
          (const int64_t *)rows->data, S, D, k, M);
  });
  return launched("kernel_moe_combine_backward");
}

/* ---- a mixture of experts' routing: a thread a token, core/moe_route_impl.h's rows ---- */

__global__ static void moe_route_kernel(moe_route_args_t a, const float *z, const float *bias,
                                        float *p, int64_t *e, float *w, int64_t N) {
  GRID_STRIDE(t, N) { moe_route_row(&a, z + t * a.E, bias, p + t * a.E, e + t * a.k, w + t * a.k); }
}

/* Tokens with an expert outside [0, E) set *bad and are left. */
__global__ static void moe_route_backward_kernel(moe_route_args_t a, const float *p,
                                                 const int64_t *e, const float *dw, const float *w,
                                                 const float *g, float *dz, int64_t N, int *bad) {
  GRID_STRIDE(t, N) {
    const int64_t *et = e + t * a.k;
    bool ok = true;
    for (int j = 0; j < a.k; j++) ok &= et[j] >= 0 && et[j] < a.E;
    if (!ok) {
      *bad = 1;
      continue;
    }
    moe_route_row_backward(&a, p + t * a.E, et, dw + t * a.k, w + t * a.k, g, dz + t * a.E);
  }
}

static fsdpc_status_t cuda_moe_route(fsdpc_tensor_t *p, fsdpc_tensor_t *experts, fsdpc_tensor_t *w,
                                     const fsdpc_tensor_t *z, const fsdpc_tensor_t *bias,
                                     const moe_route_args_t *a) {
  int64_t N = z->shape[0];
  moe_route_kernel<<<grid_for(N), kBlock, 0, stream_of(z)>>>(
      *a, (const float *)z->data, bias ? (const float *)bias->data : NULL, (float *)p->data,
      (int64_t *)experts->data, (float *)w->data, N);
  return launched("kernel_moe_route");
}

static fsdpc_status_t cuda_moe_route_backward(fsdpc_tensor_t *dz, const fsdpc_tensor_t *dw,
                                              const fsdpc_tensor_t *w, const fsdpc_tensor_t *p,
                                              const fsdpc_tensor_t *experts,
                                              const fsdpc_tensor_t *g, const moe_route_args_t *a) {
  int64_t N = p->shape[0];
  flag_t f;
  FSDPC_TRY(flag_new(&f, dz->device, "%s: an expert is outside [0, %lld)",
                     "kernel_moe_route_backward", a->E));
  moe_route_backward_kernel<<<grid_for(N), kBlock, 0, stream_of(dz)>>>(
      *a, (const float *)p->data, (const int64_t *)experts->data, (const float *)dw->data,
      (const float *)w->data, g ? (const float *)g->data : NULL, (float *)dz->data, N, f.p);
  return flag_finish(&f, launched("kernel_moe_route_backward"));
}

void cuda_row_kernels(kernel_ops_t *ops) {
  ops->moe_route = cuda_moe_route;
  ops->moe_route_backward = cuda_moe_route_backward;
  ops->moe_combine = cuda_moe_combine;
  ops->moe_combine_backward = cuda_moe_combine_backward;
  ops->rmsnorm = cuda_rmsnorm;
  ops->rmsnorm_backward = cuda_rmsnorm_backward;
  ops->layernorm = cuda_layernorm;
  ops->layernorm_backward = cuda_layernorm_backward;
  ops->cross_entropy = cuda_cross_entropy;
  ops->cross_entropy_backward = cuda_cross_entropy_backward;
  ops->masked_mean = cuda_masked_mean;
}
