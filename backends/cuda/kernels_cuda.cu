/*
 * CUDA twin of the compute kernels: matrix products (cuBLASLt through backends/cuda/cublas_lt.c,
 * else cuBLAS; fp32 compute), the embedding and RoPE here, the other ops in kernels_cuda_rows.cu
 * (row-wise: norms, cross-entropy), kernels_cuda_pointwise.cu (element-wise maps, AdamW, sums
 * of squares) and kernels_cuda_attention.cu. Same semantics as the CPU kernels; values are
 * computed in fp32 and rounded once when stored. Kernels first, then launchers; every launcher
 * runs on the current stream of its device and checks cudaGetLastError().
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

#include <cub/device/device_radix_sort.cuh>

#include "backends/cuda/cublas_lt.h"
#include "backends/cuda/kernels_cuda.h"
#include "core/fast_path_impl.h"

/* ======================= kernels ======================= */

/* Pointers handed in a launch's arguments (a kernel's arguments take up to 4 KiB), written to
 * device memory at dst. */
static const int kPtrChunk = 448;
typedef struct ptr_chunk {
  const void *p[kPtrChunk];
} ptr_chunk_t;

__global__ static void ptrs_kernel(const void **dst, ptr_chunk_t c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = c.p[i];
}

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

/* RoPE from the table of rope_fill_table: one thread per pair (i, i + Dh/2) of a row. The
 * products and sums round one by one (no FMA), as the CPU kernel's do: the same bits. out may
 * be x (each pair is read, then written, by one thread). I is the index type: 32-bit where
 * the tensor allows, since three 64-bit divisions a pair made the kernel bound by arithmetic
 * (about 1 TB/s on an H200). */
template <typename T, typename I>
__global__ static void rope_kernel(T *out, const T *x, const float *cs, I n, I Tn, I H, I Dh,
                                   float sign) {
  I half = Dh / 2;
  for (I e = blockIdx.x * (I)blockDim.x + threadIdx.x; e < n; e += (I)gridDim.x * blockDim.x) {
    I i = e % half, row = e / half, t = (row / H) % Tn;
    float2 cs2 = ((const float2 *)cs)[(t * Dh + 2 * i) / 2];
    float c = cs2.x, s = sign * cs2.y;
    I base = row * Dh;
    float x1 = tof(x[base + i]), x2 = tof(x[base + i + half]);
    out[base + i] = fromf<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    out[base + i + half] = fromf<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
  }
}

/* Four T in one aligned load or store. */
template <typename T>
struct alignas(4 * sizeof(T)) quad {
  T v[4];
};

/* The same, four consecutive pairs a thread (head sizes a multiple of 8, operands on 16-byte
 * boundaries): each half's four elements in one load, their table entries in two 16-byte
 * loads; the arithmetic element by element as above, so the same bits. n4 is the number of
 * such quads. (One pair a thread ran at 1.28 TB/s on an H200, llama-0.9b.) */
template <typename T, typename I>
__global__ static void rope4_kernel(T *out, const T *x, const float *cs, I n4, I Tn, I H, I Dh,
                                    float sign) {
  I half = Dh / 2, q = half / 4;
  for (I e = blockIdx.x * (I)blockDim.x + threadIdx.x; e < n4; e += (I)gridDim.x * blockDim.x) {
    I i = (e % q) * 4, row = e / q, t = (row / H) % Tn, base = row * Dh;
    quad<T> a = *(const quad<T> *)(x + base + i), b = *(const quad<T> *)(x + base + i + half), oa,
            ob;
    const float4 *c4 = (const float4 *)(cs + t * Dh + 2 * i); /* c0 s0 c1 s1, c2 s2 c3 s3 */
    float4 p = c4[0], r = c4[1];
    float cv[4] = {p.x, p.z, r.x, r.z}, sv[4] = {p.y, p.w, r.y, r.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
      float c = cv[j], s = sign * sv[j], x1 = tof(a.v[j]), x2 = tof(b.v[j]);
      oa.v[j] = fromf<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
      ob.v[j] = fromf<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
    *(quad<T> *)(out + base + i) = oa;
    *(quad<T> *)(out + base + i + half) = ob;
  }
}

/* ======================= launchers ======================= */

/* The words of the index checks: per device, one per check, in mapped page-locked memory. */
enum { CHECKS = 8 };
typedef struct check {
  const char *what, *fmt;
  int64_t limit;
} check_t;
static struct {
  volatile int *words; /* host view; NULL until the device's first check */
  int *dev_words;
  check_t c[CHECKS];
  int n;
} checks[DEVICE_MAX_CUDA];
static pthread_mutex_t checks_lock = PTHREAD_MUTEX_INITIALIZER;

fsdpc_status_t flag_new(flag_t *f, device_t dev, const char *fmt, const char *what, int64_t limit) {
  f->p = NULL;
  if (dev.index < 0 || dev.index >= DEVICE_MAX_CUDA)
    return err_set(STATUS_ENODEV, "%s: no CUDA device %d", what, dev.index);
  fsdpc_status_t st = STATUS_OK;
  pthread_mutex_lock(&checks_lock);
  auto *d = &checks[dev.index];
  if (d->words == NULL) {
    void *h = NULL, *dp = NULL;
    cudaError_t e = cudaHostAlloc(&h, CHECKS * sizeof(int), cudaHostAllocMapped);
    if (e == cudaSuccess) e = cudaHostGetDevicePointer(&dp, h, 0);
    if (e == cudaSuccess) {
      memset(h, 0, CHECKS * sizeof(int));
      d->words = (volatile int *)h;
      d->dev_words = (int *)dp;
    } else {
      if (h != NULL) cudaFreeHost(h);
      st = cuda_status(e, "the index checks' words (cudaHostAlloc, mapped)");
    }
  }
  int k = 0;
  while (st == STATUS_OK && k < d->n && strcmp(d->c[k].what, what) != 0) k++;
  if (st == STATUS_OK && k == d->n) {
    if (d->n == CHECKS)
      st = err_set(STATUS_EINTERNAL, "%s: more than %d index checks", what, CHECKS);
    else
      d->n++;
  }
  if (st == STATUS_OK) {
    d->c[k] = (check_t){what, fmt, limit};
    f->p = d->dev_words + k;
  }
  pthread_mutex_unlock(&checks_lock);
  return st;
}

extern "C" fsdpc_status_t cuda_index_checks(void) {
  fsdpc_status_t st = STATUS_OK;
  pthread_mutex_lock(&checks_lock);
  for (int i = 0; i < DEVICE_MAX_CUDA && st == STATUS_OK; i++)
    for (int k = 0; k < checks[i].n && st == STATUS_OK; k++)
      if (checks[i].words[k] != 0) {
        checks[i].words[k] = 0;
        const check_t *c = &checks[i].c[k];
        st = err_set(STATUS_EINVAL, c->fmt, c->what, (long long)c->limit);
      }
  pthread_mutex_unlock(&checks_lock);
  return st;
}

static const char kIndexRange[] = "%s: an index is outside [0, %lld)";

/* cuBLAS is loaded on first use (a product cuBLASLt refuses, attention's batched products), not
 * linked: merely loading it (with cuBLASLt) costs every process about 210 MB of resident
 * memory, which CPU-only runs of a CUDA-enabled build should not pay. The loader's usual search
 * finds it (the library's and program's run path, LD_LIBRARY_PATH, the system's cache). */
static struct {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasSetStream_v2) set_stream;
  cublasStatus_t (*gemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                         const void *, const void *, cudaDataType, int, const void *, cudaDataType,
                         int, const void *, void *, cudaDataType, int, cublasComputeType_t,
                         cublasGemmAlgo_t);
  cublasStatus_t (*gemm_batched)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                 int, const void *, const void *const[], cudaDataType, int,
                                 const void *const[], cudaDataType, int, const void *,
                                 void *const[], cudaDataType, int, int, cublasComputeType_t,
                                 cublasGemmAlgo_t);
  /* cublasGemmGroupedBatchedEx, spelt out so that headers before 12.5 compile; NULL in a
   * cuBLAS without it */
  cublasStatus_t (*gemm_grouped)(cublasHandle_t, const cublasOperation_t[],
                                 const cublasOperation_t[], const int[], const int[], const int[],
                                 const void *, const void *const[], cudaDataType_t, const int[],
                                 const void *const[], cudaDataType_t, const int[], const void *,
                                 void *const[], cudaDataType_t, const int[], int, const int[],
                                 cublasComputeType_t);
  char error[256];
} cublas;
static pthread_once_t cublas_once = PTHREAD_ONCE_INIT;

fsdpc_status_t cublas_status(cublasStatus_t s, const char *what) {
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
  cublas.gemm_grouped = (decltype(cublas.gemm_grouped))dlsym(lib, "cublasGemmGroupedBatchedEx");
  if (!cublas.create || !cublas.set_stream || !cublas.gemm || !cublas.gemm_batched)
    snprintf(cublas.error, sizeof cublas.error,
             "%s lacks cublasCreate_v2, cublasSetStream_v2, "
             "cublasGemmEx or cublasGemmBatchedEx",
             CUBLAS_SONAME);
}

fsdpc_status_t cuda_blas_handle(int dev, cudaStream_t s, cublasHandle_t *out) {
  static __thread cublasHandle_t handles[DEVICE_MAX_CUDA];
  pthread_once(&cublas_once, cublas_load);
  if (cublas.error[0]) return err_set(STATUS_ECUBLAS, "%s", cublas.error);
  CUDA_TRY(cuda_use_device(dev));
  if (handles[dev] == NULL) FSDPC_TRY(cublas_status(cublas.create(&handles[dev]), "cublasCreate"));
  FSDPC_TRY(cublas_status(cublas.set_stream(handles[dev], s), "cublasSetStream"));
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
                                      int m, int n, int k, const void *alpha, const void *const a[],
                                      cudaDataType_t at, int lda, const void *const b[],
                                      cudaDataType_t bt, int ldb, const void *beta, void *const c[],
                                      cudaDataType_t ct, int ldc, int count) {
  return cublas.gemm_batched(h, ta, tb, m, n, k, alpha, a, at, lda, b, bt, ldb, beta, c, ct, ldc,
                             count, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

/* One product on pointers with the row strides of d (out's in ldd): cuBLASLt, else
 * cublasGemmEx. */
static fsdpc_status_t product(int dev, cudaStream_t s, dtype_t dt, const void *a, bool trans_a,
                              const void *b, bool trans_b, void *out, float alpha, float beta,
                              const matmul_dims_t *d, int64_t ldd) {
  lt_gemm_t g = cublas_lt_of_row_major(dev, s, dt, trans_a, trans_b, d);
  g.ldd = ldd;
  bool ran;
  FSDPC_TRY(cublas_lt_matmul(&g, alpha, b, a, beta, out, &ran));
  if (ran) return STATUS_OK;
  cublasHandle_t h;
  FSDPC_TRY(cuda_blas_handle(dev, s, &h));
  cudaDataType_t t = cuda_dtype(dt);
  /* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T. */
  cublasStatus_t st =
      cublas.gemm(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                  (int)d->n, (int)d->m, (int)d->k, &alpha, b, t, (int)d->ldb, a, t, (int)d->lda,
                  &beta, out, t, (int)ldd, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  if (st == CUBLAS_STATUS_SUCCESS) return STATUS_OK;
  char what[96];
  snprintf(what, sizeof what, "cublasGemmEx (m=%lld n=%lld k=%lld)", (long long)d->m,
           (long long)d->n, (long long)d->k);
  return cublas_status(st, what);
}

/*
 * A size that is not a multiple of 8 (GPT-2's vocabulary of 50257) leaves cuBLAS slow kernels:
 * GPT-2 124M's head ran at 86-151 TFLOP/s on an H200 where the blocks' products run at
 * 400-680, also with its rows copied into 16-byte-aligned strides first. From kPadMinMacs
 * multiply-adds on, each such size is rounded up to a multiple of kPadTo on padded copies of
 * the operands (cudaMemcpy2DAsync): the rows and columns added to m or n are computed and
 * dropped, those added to k hold zeros and add nothing. The output is copied back.
 */
static const double kPadMinMacs = (double)(1 << 27);
static const int64_t kPadTo = 64;

static int64_t padded_size(int64_t x, bool pad) {
  return !pad || x % 8 == 0 ? x : (x + kPadTo - 1) / kPadTo * kPadTo;
}

typedef struct strided {
  void *p;
  int64_t ld;   /* row stride, elements */
  size_t bytes; /* > 0: a padded copy from the pool */
} strided_t;

/* rows x cols at src (stride cols) in a prows x pcols matrix: src itself when the sizes are
 * equal, else a buffer from the pool holding src's values in its first rows and columns when
 * copy, and zeros in the rest when zero. */
static fsdpc_status_t padded_of(strided_t *o, device_t dev, cudaStream_t s, void *src, int64_t rows,
                                int64_t cols, int64_t prows, int64_t pcols, size_t es, bool copy,
                                bool zero) {
  *o = (strided_t){src, cols, 0};
  if (prows == rows && pcols == cols) return STATUS_OK;
  size_t pitch = (size_t)pcols * es, bytes = (size_t)prows * pitch;
  void *p;
  FSDPC_TRY(device_alloc(dev, bytes, &p));
  *o = (strided_t){p, pcols, bytes};
  char *c = (char *)p;
  if (zero && pcols > cols)
    CUDA_TRY(cudaMemset2DAsync(c + (size_t)cols * es, pitch, 0, (size_t)(pcols - cols) * es,
                               (size_t)rows, s));
  if (zero && prows > rows)
    CUDA_TRY(cudaMemsetAsync(c + (size_t)rows * pitch, 0, (size_t)(prows - rows) * pitch, s));
  if (!copy) return STATUS_OK;
  return cuda_status(cudaMemcpy2DAsync(p, pitch, src, (size_t)cols * es, (size_t)cols * es,
                                       (size_t)rows, cudaMemcpyDeviceToDevice, s),
                     "kernel_matmul: padding an operand");
}

static fsdpc_status_t cuda_matmul(fsdpc_tensor_t *out, const fsdpc_tensor_t *a, bool trans_a,
                                  const fsdpc_tensor_t *b, bool trans_b, float alpha, float beta,
                                  const matmul_dims_t *d) {
  device_t dev = out->device;
  cudaStream_t s = stream_of(out);
  size_t es = dtype_size(out->dtype);
  CUDA_TRY(cuda_use_device(dev.index));
  bool pad = (double)d->m * (double)d->n * (double)d->k >= kPadMinMacs;
  int64_t M = padded_size(d->m, pad), N = padded_size(d->n, pad), K = padded_size(d->k, pad);
  bool zk = K != d->k; /* the operands' padding along k must be zeros */
  strided_t A = {}, B = {}, D = {};
  /* a is stored [m, k] ([k, m] when trans_a), b [k, n] ([n, k] when trans_b) */
  fsdpc_status_t st = trans_a ? padded_of(&A, dev, s, a->data, d->k, d->m, K, M, es, true, zk)
                              : padded_of(&A, dev, s, a->data, d->m, d->k, M, K, es, true, zk);
  if (st == STATUS_OK)
    st = trans_b ? padded_of(&B, dev, s, b->data, d->n, d->k, N, K, es, true, zk)
                 : padded_of(&B, dev, s, b->data, d->k, d->n, K, N, es, true, zk);
  if (st == STATUS_OK)
    st = padded_of(&D, dev, s, out->data, d->m, d->n, M, N, es, beta != 0.0f, false);
  if (st == STATUS_OK) {
    matmul_dims_t pd = {M, N, K, A.ld, B.ld};
    st = product(dev.index, s, out->dtype, A.p, trans_a, B.p, trans_b, D.p, alpha, beta, &pd, D.ld);
  }
  if (st == STATUS_OK && D.bytes)
    st =
        cuda_status(cudaMemcpy2DAsync(out->data, (size_t)d->n * es, D.p, (size_t)D.ld * es,
                                      (size_t)d->n * es, (size_t)d->m, cudaMemcpyDeviceToDevice, s),
                    "kernel_matmul: copying the output back");
  strided_t *bufs[3] = {&A, &B, &D};
  for (int i = 0; i < 3; i++) /* stream-ordered: after the product */
    if (bufs[i]->bytes) device_free(dev, bufs[i]->p, bufs[i]->bytes);
  return st;
}

/*
 * Several products in one cublasGemmGroupedBatchedEx, each a group of one (a mixture of experts'
 * products differ in their rows): one call into cuBLAS where a loop makes one for each expert,
 * with its own descriptors and launches. Its operand pointers go to the device in the arguments
 * of a small kernel (a copy from pageable host memory may wait for the stream). Products it
 * cannot take run one by one.
 */
static fast_path_t grouped =
    FAST_PATH_INIT("FSDPC_GROUPED_GEMM", "kernel_matmul_set_grouped(false)");
/* cuBLAS said not supported, by dtype and transposes: under grouped.lock */
static bool grouped_refused[DTYPE_COUNT][2][2];

extern "C" void kernel_matmul_set_grouped(bool on) { fast_path_set(&grouped, on); }
extern "C" const char *kernel_matmul_grouped_off(void) { return fast_path_off(&grouped); }
extern "C" int64_t kernel_matmul_grouped_runs(void) { return fast_path_runs(&grouped); }
extern "C" const char *kernel_matmul_grouped_note(void) {
  static __thread char copy[512];
  fast_path_note_copy(&grouped, copy, sizeof copy);
  return copy;
}

static bool on16(const void *p) { return (uintptr_t)p % 16 == 0; }

/* With grouped.lock held: why the products cannot run grouped ("" when they can). */
static const char *grouped_refusal(const kernel_product_t *p, const matmul_dims_t *d, int n,
                                   bool trans_a, bool trans_b) {
  const char *off = fast_path_off_locked(&grouped);
  if (off[0]) return off;
  if (cublas.gemm_grouped == NULL) return "the loaded cuBLAS lacks cublasGemmGroupedBatchedEx";
  dtype_t dt = p[0].out->dtype;
  if (grouped_refused[dt][trans_a][trans_b])
    return "cuBLAS does not support these products grouped (their dtype and transposes)";
  int64_t es = (int64_t)dtype_size(dt);
  for (int i = 0; i < n; i++)
    if (!on16(p[i].out->data) || !on16(p[i].a->data) || !on16(p[i].b->data) || d[i].lda * es % 16 ||
        d[i].ldb * es % 16 || d[i].n * es % 16)
      return "an operand off a 16-byte boundary, or rows of a size that is not a multiple of 16 "
             "bytes";
  return "";
}

/* The grouped call; *refused when cuBLAS does not support it (nothing ran). */
static fsdpc_status_t grouped_call(const kernel_product_t *p, const matmul_dims_t *d, int n,
                                   bool trans_a, bool trans_b, float alpha, float beta,
                                   bool *refused) {
  *refused = false;
  device_t dev = p[0].out->device;
  cudaStream_t s = stream_of(p[0].out);
  cublasHandle_t h;
  FSDPC_TRY(cuda_blas_handle(dev.index, s, &h));
  size_t bytes = 3 * (size_t)n * sizeof(void *);
  const void **ptrs;
  FSDPC_TRY(device_alloc(dev, bytes, (void **)&ptrs));
  /* Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: cuBLAS's A is our b. */
  fsdpc_status_t st = STATUS_OK;
  ptr_chunk_t c;
  for (int i0 = 0; i0 < 3 * n && st == STATUS_OK; i0 += kPtrChunk) {
    int k = 3 * n - i0 < kPtrChunk ? 3 * n - i0 : kPtrChunk;
    for (int j = 0; j < k; j++) {
      int i = (i0 + j) % n, which = (i0 + j) / n;
      c.p[j] = which == 0 ? p[i].b->data : which == 1 ? p[i].a->data : p[i].out->data;
    }
    ptrs_kernel<<<(k + kBlock - 1) / kBlock, kBlock, 0, s>>>(ptrs + i0, c, k);
    st = launched("kernel_matmul_many (operand pointers)");
  }
  /* per product: the two operations, then m, n, k, lda, ldb, ldc, the group size (one) */
  cublasOperation_t *op = (cublasOperation_t *)malloc(sizeof *op * 2 * (size_t)n);
  int *v = (int *)malloc(sizeof *v * 7 * (size_t)n);
  float *scale = (float *)malloc(sizeof *scale * 2 * (size_t)n);
  if (st == STATUS_OK && (op == NULL || v == NULL || scale == NULL))
    st = err_set(STATUS_ENOMEM, "kernel_matmul_many: %d products", n);
  if (st == STATUS_OK) {
    for (int i = 0; i < n; i++) {
      op[i] = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
      op[n + i] = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
      int64_t x[7] = {d[i].n, d[i].m, d[i].k, d[i].ldb, d[i].lda, d[i].n, 1};
      for (int j = 0; j < 7; j++) v[j * n + i] = (int)x[j];
      scale[i] = alpha;
      scale[n + i] = beta;
    }
    cudaDataType_t t = cuda_dtype(p[0].out->dtype);
    cublasStatus_t cs = cublas.gemm_grouped(
        h, op, op + n, v, v + n, v + 2 * n, scale, ptrs, t, v + 3 * n, ptrs + n, t, v + 4 * n,
        scale + n, (void *const *)(ptrs + 2 * n), t, v + 5 * n, n, v + 6 * n, CUBLAS_COMPUTE_32F);
    *refused = cs == CUBLAS_STATUS_NOT_SUPPORTED;
    if (!*refused) {
      char what[96];
      snprintf(what, sizeof what, "cublasGemmGroupedBatchedEx (%d products)", n);
      st = cublas_status(cs, what);
    }
  }
  free(op);
  free(v);
  free(scale);
  device_free(dev, ptrs, bytes); /* stream-ordered: after the products */
  return st;
}

static fsdpc_status_t cuda_matmul_many(const kernel_product_t *p, const matmul_dims_t *d, int n,
                                       bool trans_a, bool trans_b, float alpha, float beta) {
  CUDA_TRY(cuda_use_device(p[0].out->device.index));
  pthread_once(&cublas_once, cublas_load);
  fsdpc_status_t st = STATUS_OK;
  bool ran = false, refused = false;
  dtype_t dt = p[0].out->dtype;
  pthread_mutex_lock(&grouped.lock);
  const char *why = cublas.error[0] ? cublas.error : grouped_refusal(p, d, n, trans_a, trans_b);
  if (why[0]) fast_path_note(&grouped, "%s", why);
  pthread_mutex_unlock(&grouped.lock);
  if (!why[0]) {
    st = grouped_call(p, d, n, trans_a, trans_b, alpha, beta, &refused);
    ran = st == STATUS_OK && !refused;
    pthread_mutex_lock(&grouped.lock);
    if (refused) {
      grouped_refused[dt][trans_a][trans_b] = true;
      fast_path_note(&grouped,
                     "cuBLAS does not support %s products grouped with these transposes "
                     "(a %s, b %s)",
                     dtype_name(dt), trans_a ? "transposed" : "as stored",
                     trans_b ? "transposed" : "as stored");
    }
    if (ran) grouped.runs++;
    pthread_mutex_unlock(&grouped.lock);
  }
  for (int i = 0; i < n && st == STATUS_OK && !ran; i++)
    st = cuda_matmul(p[i].out, p[i].a, trans_a, p[i].b, trans_b, alpha, beta, &d[i]);
  return st;
}

static fsdpc_status_t cuda_embedding(fsdpc_tensor_t *out, const fsdpc_tensor_t *table,
                                     const fsdpc_tensor_t *ids, int64_t first, int64_t vocab) {
  int64_t n = tensor_numel(ids), D = table->shape[1], V = table->shape[0];
  if (n * D == 0) return STATUS_OK;
  flag_t f;
  FSDPC_TRY(flag_new(&f, out->device, kIndexRange, "kernel_embedding", vocab));
  embedding_kernel<<<grid_for(n * D), kBlock, 0, stream_of(out)>>>(
      out->data, table->data, table->dtype, ids->data, ids->dtype, n, D, V, first, vocab, f.p);
  return flag_finish(&f, launched("kernel_embedding"));
}

static fsdpc_status_t cuda_embedding_backward(fsdpc_tensor_t *grad_table,
                                              const fsdpc_tensor_t *grad_out,
                                              const fsdpc_tensor_t *ids, int64_t first,
                                              int64_t vocab) {
  int64_t n = tensor_numel(ids), D = grad_table->shape[1], V = grad_table->shape[0];
  if (n * D == 0) return STATUS_OK;
  if (n > INT32_MAX || V >= INT32_MAX)
    return err_set(STATUS_EINVAL,
                   "kernel_embedding_backward: %lld tokens or %lld rows: at most "
                   "2^31 - 1 each on CUDA",
                   (long long)n, (long long)V);
  device_t dev = grad_table->device;
  cudaStream_t s = stream_of(grad_table);
  int end_bit = 1; /* sort keys are rows 0..V: enough bits for V */
  while (end_bit < 31 && ((int64_t)1 << end_bit) <= V) end_bit++;
  size_t sort_bytes = 0;
  CUDA_TRY(cub::DeviceRadixSort::SortPairs(NULL, sort_bytes, (const int *)NULL, (int *)NULL,
                                           (const int *)NULL, (int *)NULL, (int)n, 0, end_bit, s));
  size_t keys = sizeof(int) * (size_t)n, part = (keys + 255) / 256 * 256;
  size_t bytes = 4 * part + sort_bytes;
  char *buf;
  FSDPC_TRY(device_alloc(dev, bytes, (void **)&buf));
  int *rows = (int *)buf, *tokens = (int *)(buf + part), *rows_sorted = (int *)(buf + 2 * part),
      *tokens_sorted = (int *)(buf + 3 * part);
  flag_t f;
  fsdpc_status_t st = flag_new(&f, dev, kIndexRange, "kernel_embedding_backward", vocab);
  if (st != STATUS_OK) {
    device_free(dev, buf, bytes);
    return st;
  }
  embedding_rows_kernel<<<grid_for(n), kBlock, 0, s>>>(rows, tokens, ids->data, ids->dtype, n, V,
                                                       first, vocab, f.p);
  st = launched("kernel_embedding_backward");
  if (st == STATUS_OK)
    st = cuda_status(cub::DeviceRadixSort::SortPairs(buf + 4 * part, sort_bytes, rows, rows_sorted,
                                                     tokens, tokens_sorted, (int)n, 0, end_bit, s),
                     "kernel_embedding_backward: cub::DeviceRadixSort::SortPairs");
  if (st == STATUS_OK) {
    int blocks = n < 65535 ? (int)n : 65535;
    embedding_runs_kernel<<<blocks, kBlock, 0, s>>>(grad_table->data, grad_table->dtype,
                                                    grad_out->data, grad_out->dtype, rows_sorted,
                                                    tokens_sorted, n, D, V);
    st = launched("kernel_embedding_backward");
  }
  device_free(dev, buf, bytes); /* stream-ordered: after the kernels */
  return flag_finish(&f, st);
}

/* The RoPE table of the last call on each device (rope_fill_table, built on the host and
 * copied over once): the next calls of the same positions (every layer's q and k, forward and
 * backward) read it instead of computing a pow, cos and sin in double per pair. */
typedef struct rope_dev_table {
  rope_key_t key;
  float *cs;
  size_t bytes;
} rope_dev_table_t;

static pthread_mutex_t rope_lock = PTHREAD_MUTEX_INITIALIZER; /* held for a whole call */
static rope_dev_table_t rope_tables[DEVICE_MAX_CUDA];

static fsdpc_status_t rope_table_on(device_t dev, const rope_key_t *key, const float **out) {
  rope_dev_table_t *c = &rope_tables[dev.index];
  if (c->cs != NULL && rope_key_equal(&c->key, key)) {
    *out = c->cs;
    return STATUS_OK;
  }
  size_t bytes = sizeof(float) * (size_t)(key->T * key->Dh);
  float *host = (float *)malloc(bytes);
  if (host == NULL) return err_set(STATUS_ENOMEM, "kernel_rope: out of host memory");
  rope_fill_table(key, host);
  void *d = NULL;
  fsdpc_status_t st = device_alloc(dev, bytes, &d);
  if (st == STATUS_OK) st = device_memcpy(dev, d, device_cpu(), host, bytes); /* waits */
  free(host);
  if (st != STATUS_OK) {
    if (d != NULL) device_free(dev, d, bytes);
    return st;
  }
  if (c->cs != NULL) device_free(dev, c->cs, c->bytes); /* stream-ordered: after its readers */
  *c = (rope_dev_table_t){*key, (float *)d, bytes};
  *out = c->cs;
  return STATUS_OK;
}

static fsdpc_status_t cuda_rope(fsdpc_tensor_t *out, const fsdpc_tensor_t *x, const rope_t *rope,
                                int64_t pos_offset, bool inverse) {
  int64_t n = tensor_numel(x) / 2;
  if (n == 0) return STATUS_OK;
  if (x->device.index < 0 || x->device.index >= DEVICE_MAX_CUDA)
    return err_set(STATUS_ENODEV, "kernel_rope: no CUDA device %d", x->device.index);
  int64_t T = x->shape[1], H = x->shape[2], Dh = x->shape[3];
  pthread_mutex_lock(&rope_lock);
  const float *cs = NULL;
  rope_key_t key = {*rope, Dh, pos_offset, T};
  fsdpc_status_t st = rope_table_on(x->device, &key, &cs);
  if (st == STATUS_OK) {
    float sign = inverse ? -1.0f : 1.0f;
    bool narrow = 2 * n < INT32_MAX; /* every element's index fits */
    bool by4 = Dh % 8 == 0 && ((uintptr_t)out->data | (uintptr_t)x->data) % 16 == 0;
    with_float_type(x->dtype, [&](auto t) {
      using E = decltype(t);
      if (by4 && narrow)
        rope4_kernel<E, int><<<grid_for(n / 4), kBlock, 0, stream_of(x)>>>(
            (E *)out->data, (const E *)x->data, cs, (int)(n / 4), (int)T, (int)H, (int)Dh, sign);
      else if (by4)
        rope4_kernel<E, int64_t><<<grid_for(n / 4), kBlock, 0, stream_of(x)>>>(
            (E *)out->data, (const E *)x->data, cs, n / 4, T, H, Dh, sign);
      else if (narrow)
        rope_kernel<E, int><<<grid_for(n), kBlock, 0, stream_of(x)>>>(
            (E *)out->data, (const E *)x->data, cs, (int)n, (int)T, (int)H, (int)Dh, sign);
      else
        rope_kernel<E, int64_t><<<grid_for(n), kBlock, 0, stream_of(x)>>>(
            (E *)out->data, (const E *)x->data, cs, n, T, H, Dh, sign);
    });
    st = launched("kernel_rope");
  }
  pthread_mutex_unlock(&rope_lock);
  return st;
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

static fsdpc_status_t cuda_timer_read(void *timer, double *seconds) {
  cuda_timer_t *t = (cuda_timer_t *)timer;
  float ms = 0;
  fsdpc_status_t st = cuda_wait_event(t->stop, "kernel profile timer");
  if (st == STATUS_OK)
    st = cuda_status(cudaEventElapsedTime(&ms, t->start, t->stop), "kernel profile timer");
  cudaEventDestroy(t->start);
  cudaEventDestroy(t->stop);
  free(t);
  *seconds = 1e-3 * ms;
  return st;
}

static kernel_ops_t ops;
static pthread_once_t ops_once = PTHREAD_ONCE_INIT;

static void ops_init(void) {
  ops.matmul = cuda_matmul;
  ops.matmul_many = cuda_matmul_many;
  ops.embedding = cuda_embedding;
  ops.embedding_backward = cuda_embedding_backward;
  ops.rope = cuda_rope;
  cuda_attention_kernels(&ops);
  cuda_row_kernels(&ops);
  cuda_pointwise_kernels(&ops);
  ops.timer_start = cuda_timer_start;
  ops.timer_stop = cuda_timer_stop;
  ops.timer_read = cuda_timer_read;
}

extern "C" const kernel_ops_t *cuda_kernels(void) {
  pthread_once(&ops_once, ops_init);
  return &ops;
}
