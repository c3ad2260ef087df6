/*
 * Private to the CUDA kernels (backends/cuda/kernels_cuda*.cu): element loads and stores of any
 * float dtype, block reductions, launch helpers, the run-time loaded cuBLAS, and the function by
 * which each file fills its launchers into the kernel table. kernels_cuda.cu holds the matrix
 * products, the embedding, RoPE and the table; kernels_cuda_rows.cu the norms and
 * cross-entropy; kernels_cuda_pointwise.cu the element-wise maps, AdamW and sums of squares;
 * kernels_cuda_attention.cu runs the attention plan of core/attention_gemm_impl.h.
 */
#ifndef FSDPC_BASE_KERNELS_CUDA_H
#define FSDPC_BASE_KERNELS_CUDA_H

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/cuda_elem.h"
#include "core/kernels_impl.h"

extern "C" cudaStream_t cuda_stream_raw(stream_t *s);

/* ---- device helpers ---- */

static __device__ inline float ldf(int dt, const void *p, int64_t i) {
  switch (dt) {
    case DTYPE_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case DTYPE_F16: return __half2float(((const __half *)p)[i]);
    default: return ((const float *)p)[i];
  }
}

static __device__ inline void stf(int dt, void *p, int64_t i, float v) {
  switch (dt) {
    case DTYPE_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); break;
    case DTYPE_F16: ((__half *)p)[i] = __float2half_rn(v); break;
    default: ((float *)p)[i] = v;
  }
}

static __device__ inline int64_t ldi(int dt, const void *p, int64_t i) {
  return dt == DTYPE_I32 ? ((const int32_t *)p)[i] : ((const int64_t *)p)[i];
}

#define GRID_STRIDE(i, n)                                                   \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); \
       i += (int64_t)gridDim.x * blockDim.x)

/* Sum over the warp; every lane gets the same bits (each level adds the same pairs). */
static __device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* Sum or max over the block; every thread gets the result. blockDim.x is a multiple of 32. */
template <bool kMax>
static __device__ inline float block_reduce(float v) {
  __shared__ float part[32];
  for (int o = 16; o > 0; o >>= 1) {
    float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmaxf(v, w) : v + w;
  }
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < nw ? part[lane] : (kMax ? -INFINITY : 0.0f);
  for (int o = 16; o > 0; o >>= 1) {
    float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmaxf(v, w) : v + w;
  }
  return v;
}

/* ---- launch helpers ---- */

static const int kBlock = 256;

static inline int grid_for(int64_t n) {
  int64_t g = (n + kBlock - 1) / kBlock;
  if (g > 65535) g = 65535;
  return g < 1 ? 1 : (int)g;
}

static inline cudaStream_t stream_of(const fsdpc_tensor_t *t) {
  return cuda_stream_raw(stream_current(t->device));
}

static inline fsdpc_status_t launched(const char *what) {
  return cuda_status(cudaGetLastError(), what);
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

static inline int64_t last_dim(const fsdpc_tensor_t *t) {
  return t->ndim == 0 ? 1 : t->shape[t->ndim - 1];
}

/* ---- column sums over rows, deterministic ---- */

/*
 * out_k[j] += sum over rows i of term k at (i, j), for K terms at once, summed in a fixed order
 * (the same result at every run) with a thread per (column, block of rows) rather than one per
 * column: partial[k][c][j] sums rows [c per, (c + 1) per) of column j in order, then a second
 * pass adds the partial sums in block order. term(i, j, s) adds row i's K values of column j
 * into s. (Over 16384 rows of 768 on an H200, a thread per column took 0.93 ms for a bias's
 * gradient and 6.27 ms for LayerNorm's two; by blocks of rows they take 0.047 and 0.12 ms.)
 */
template <int K, typename F>
__global__ static void column_partial_kernel(float *partial, int64_t rows, int64_t D, int64_t per,
                                             F term) {
  int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, c = blockIdx.y;
  if (j >= D) return;
  int64_t i1 = (c + 1) * per < rows ? (c + 1) * per : rows;
  float s[K] = {};
  for (int64_t i = c * per; i < i1; i++) term(i, j, s);
#pragma unroll
  for (int k = 0; k < K; k++) partial[((int64_t)k * gridDim.y + c) * D + j] = s[k];
}

struct column_out {
  void *p; /* NULL: this term is not wanted */
  int dt;
};

template <int K>
struct column_outs {
  column_out o[K];
};

/*
 * column_partial_kernel with each thread taking W = 16 / sizeof(T) adjacent columns, a row's in
 * one 16-byte load per operand: term.packs(i, c, s) adds row i's K values of columns
 * [c W, c W + W) into s[k][0, W). For D a multiple of W with every operand on a 16-byte
 * boundary. Each column's sum runs over the same rows in the same order as
 * column_partial_kernel's would over blocks of `per` rows.
 */
template <int K, typename T, typename F>
__global__ static void column_partial_packs_kernel(float *partial, int64_t rows, int64_t D,
                                                   int64_t per, F term) {
  const int W = 16 / sizeof(T);
  int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, b = blockIdx.y;
  if (c * W >= D) return;
  int64_t i1 = (b + 1) * per < rows ? (b + 1) * per : rows;
  float s[K][W] = {};
  for (int64_t i = b * per; i < i1; i++) term.packs(i, c, s);
#pragma unroll
  for (int k = 0; k < K; k++)
#pragma unroll
    for (int j = 0; j < W; j++) partial[((int64_t)k * gridDim.y + b) * D + c * W + j] = s[k][j];
}

template <int K>
__global__ static void column_sum_kernel(column_outs<K> outs, const float *partial, int64_t blocks,
                                         int64_t D) {
  GRID_STRIDE(j, D) {
#pragma unroll
    for (int k = 0; k < K; k++) {
      if (!outs.o[k].p) continue;
      float s = 0;
#pragma unroll 8
      for (int64_t c = 0; c < blocks; c++) s += partial[(k * blocks + c) * D + j];
      stf(outs.o[k].dt, outs.o[k].p, j, ldf(outs.o[k].dt, outs.o[k].p, j) + s);
    }
  }
}

/* The K column sums of a rows x D layout on dev's stream s (scratch from dev's pool), over
 * blocks of `per` rows: partial(buffer, blocks) launches the first pass. */
template <int K, typename P>
static fsdpc_status_t column_sums_by(device_t dev, cudaStream_t s, int64_t rows, int64_t D,
                                     int64_t per, column_outs<K> outs, const char *what,
                                     P partial_pass) {
  if (rows == 0 || D == 0) return STATUS_OK;
  int64_t blocks = (rows + per - 1) / per;
  size_t bytes = sizeof(float) * (size_t)(K * blocks * D);
  float *partial;
  FSDPC_TRY(device_alloc(dev, bytes, (void **)&partial));
  partial_pass(partial, blocks);
  fsdpc_status_t st = launched(what);
  if (st == STATUS_OK) {
    column_sum_kernel<K><<<grid_for(D), kBlock, 0, s>>>(outs, partial, blocks, D);
    st = launched(what);
  }
  device_free(dev, partial, bytes); /* stream-ordered: after the kernels */
  return st;
}

/* Rows a block of the first pass sums: at least `least`, and few enough blocks for a grid's
 * second dimension. */
static inline int64_t column_rows_per_block(int64_t rows, int64_t least) {
  return rows / 65535 + 1 > least ? rows / 65535 + 1 : least;
}

/* The K column sums of a rows x D layout on dev's stream s (scratch from dev's pool). */
template <int K, typename F>
static fsdpc_status_t column_sums(device_t dev, cudaStream_t s, int64_t rows, int64_t D, F term,
                                  column_outs<K> outs, const char *what) {
  int64_t per = column_rows_per_block(rows, 64);
  return column_sums_by<K>(dev, s, rows, D, per, outs, what, [&](float *partial, int64_t blocks) {
    dim3 grid((unsigned)((D + kBlock - 1) / kBlock), (unsigned)blocks);
    column_partial_kernel<K><<<grid, kBlock, 0, s>>>(partial, rows, D, per, term);
  });
}

/* column_sums of a term over operands of T in 16-byte packs where `aligned` (every operand on
 * a 16-byte boundary) and D is a multiple of 16 / sizeof(T); column_sums otherwise. A thread of
 * column_partial_kernel loads 2 or 4 bytes an operand a row; here 16, over blocks of 32 rows
 * or more, at most 1024 blocks of rows (8192 rows of 2048 bf16 columns: 512 blocks of 128
 * threads; the partial sums K x 1024 x D floats at most). The two paths group rows
 * differently, so their bits differ: each is the same at every run. */
template <int K, typename T, typename F>
static fsdpc_status_t column_sums_packs(device_t dev, cudaStream_t s, int64_t rows, int64_t D,
                                        bool aligned, F term, column_outs<K> outs,
                                        const char *what) {
  const int64_t W = 16 / sizeof(T), threads = 128;
  if (!aligned || D % W != 0) return column_sums<K>(dev, s, rows, D, term, outs, what);
  int64_t per = (rows + 1023) / 1024 > 32 ? (rows + 1023) / 1024 : 32; /* <= 1024 blocks */
  return column_sums_by<K>(dev, s, rows, D, per, outs, what, [&](float *partial, int64_t blocks) {
    dim3 grid((unsigned)((D / W + threads - 1) / threads), (unsigned)blocks);
    column_partial_packs_kernel<K, T>
        <<<grid, (unsigned)threads, 0, s>>>(partial, rows, D, per, term);
  });
}

/* Index checks without a host wait: a checking kernel writes 1 through p, a word of page-locked
 * host memory mapped into the device, kept per device and per check (what). Nothing is read at
 * the launch: the host looks at the words after its next wait for the device
 * (cuda_index_checks, backends/cuda/cuda_check.h), and a word found set fails that wait with an
 * EINVAL built from fmt (one %s for what, one %lld for limit). */
typedef struct flag {
  int *p;
} flag_t;

/* The word of check `what` on dev, its message set to fmt with limit. */
fsdpc_status_t flag_new(flag_t *f, device_t dev, const char *fmt, const char *what, int64_t limit);
/* The launch status (the check itself comes at the next wait). */
static inline fsdpc_status_t flag_finish(flag_t *f, fsdpc_status_t launch) {
  (void)f;
  return launch;
}

/* ---- cuBLAS, loaded on first use (kernels_cuda.cu) ---- */

/* The cuBLAS handle of device dev for this thread, bound to stream s. */
fsdpc_status_t cuda_blas_handle(int dev, cudaStream_t s, cublasHandle_t *out);

/* cublasGemmEx and cublasGemmBatchedEx through the loaded library (F32 compute, the default
 * algorithm). */
cublasStatus_t cuda_blas_gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                              int n, int k, const void *alpha, const void *a, cudaDataType_t at,
                              int lda, const void *b, cudaDataType_t bt, int ldb, const void *beta,
                              void *c, cudaDataType_t ct, int ldc);
cublasStatus_t cuda_blas_gemm_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                      int m, int n, int k, const void *alpha, const void *const a[],
                                      cudaDataType_t at, int lda, const void *const b[],
                                      cudaDataType_t bt, int ldb, const void *beta, void *const c[],
                                      cudaDataType_t ct, int ldc, int count);

/* The status of a cuBLAS result: STATUS_OK; STATUS_ENOMEM when cuBLAS could not allocate;
 * otherwise STATUS_ECUBLAS, "WHAT: cuBLAS status N". */
fsdpc_status_t cublas_status(cublasStatus_t s, const char *what);

static inline cudaDataType_t cuda_dtype(dtype_t dt) {
  return dt == DTYPE_BF16 ? CUDA_R_16BF : dt == DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* Fill their launchers into the CUDA kernel table (kernels_cuda.cu). */
void cuda_row_kernels(kernel_ops_t *ops);
void cuda_pointwise_kernels(kernel_ops_t *ops);
void cuda_attention_kernels(kernel_ops_t *ops);

#endif
