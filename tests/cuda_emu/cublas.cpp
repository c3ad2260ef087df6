/*
 * The CUDA emulator's cuBLAS: the four functions the backend loads (kernels_cuda.cu), with
 * cuBLAS's column-major products computed on the host in f32, k in order; and its dlopen,
 * which hands out this library for cuBLAS's name and reports every other one absent
 * (emu_dl.h).
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <string.h>

#include "emu_dl.h"

static float load(cudaDataType t, const void *p, long i) {
  switch (t) {
    case CUDA_R_16BF: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case CUDA_R_16F: return __half2float(((const __half *)p)[i]);
    default: return ((const float *)p)[i];
  }
}

static void store(cudaDataType t, void *p, long i, float v) {
  switch (t) {
    case CUDA_R_16BF: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); break;
    case CUDA_R_16F: ((__half *)p)[i] = __float2half_rn(v); break;
    default: ((float *)p)[i] = v;
  }
}

static int library; /* the handle of the emulated library and of its cuBLAS handles */

static cublasStatus_t create(cublasHandle_t *h) {
  *h = (cublasHandle_t)&library;
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t set_stream(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }

/* C = alpha op(A) op(B) + beta C, column-major; with beta 0, C is not read (it may hold NaN) */
static cublasStatus_t gemm(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                           int k, const void *alpha, const void *a, cudaDataType at, int lda,
                           const void *b, cudaDataType bt, int ldb, const void *beta, void *c,
                           cudaDataType ct, int ldc, cublasComputeType_t, cublasGemmAlgo_t) {
  if (m < 0 || n < 0 || k < 0 || lda < (ta == CUBLAS_OP_N ? m : k) ||
      ldb < (tb == CUBLAS_OP_N ? k : n) || ldc < m)
    return CUBLAS_STATUS_INVALID_VALUE;
  float al = *(const float *)alpha, be = *(const float *)beta;
  for (int j = 0; j < n; j++)
    for (int i = 0; i < m; i++) {
      float s = 0;
      for (int p = 0; p < k; p++)
        s += load(at, a, ta == CUBLAS_OP_N ? i + (long)p * lda : p + (long)i * lda) *
             load(bt, b, tb == CUBLAS_OP_N ? p + (long)j * ldb : j + (long)p * ldb);
      long o = i + (long)j * ldc;
      store(ct, c, o, be == 0 ? al * s : al * s + be * load(ct, c, o));
    }
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t gemm_batched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb,
                                   int m, int n, int k, const void *alpha, const void *const a[],
                                   cudaDataType at, int lda, const void *const b[], cudaDataType bt,
                                   int ldb, const void *beta, void *const c[], cudaDataType ct,
                                   int ldc, int count, cublasComputeType_t comp,
                                   cublasGemmAlgo_t algo) {
  for (int i = 0; i < count; i++) {
    cublasStatus_t s = gemm(h, ta, tb, m, n, k, alpha, a[i], at, lda, b[i], bt, ldb, beta, c[i], ct,
                            ldc, comp, algo);
    if (s != CUBLAS_STATUS_SUCCESS) return s;
  }
  return CUBLAS_STATUS_SUCCESS;
}

static thread_local const char *dl_error = "";

extern "C" void *emu_dlopen(const char *name, int) {
  if (name != NULL && strncmp(name, "libcublas.so.", 13) == 0) return &library;
  dl_error = "not in the CUDA emulator";
  return NULL;
}

extern "C" void *emu_dlsym(void *lib, const char *symbol) {
  if (lib != &library) return NULL;
  if (strcmp(symbol, "cublasCreate_v2") == 0) return (void *)create;
  if (strcmp(symbol, "cublasSetStream_v2") == 0) return (void *)set_stream;
  if (strcmp(symbol, "cublasGemmEx") == 0) return (void *)gemm;
  if (strcmp(symbol, "cublasGemmBatchedEx") == 0) return (void *)gemm_batched;
  return NULL;
}

extern "C" char *emu_dlerror(void) { return (char *)dl_error; }
