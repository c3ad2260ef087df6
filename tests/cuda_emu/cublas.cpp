/*
 * The CUDA emulator's cuBLAS and cuBLASLt: the functions the backend loads (kernels_cuda.cu,
 * cublas_lt.c), with their column-major products computed on the host in f32, k in order, and
 * cuBLASLt's descriptors kept and checked as far as the backend uses them (transposes, layouts,
 * the workspace its heuristic asks for); and the emulator's dlopen, which hands out these for
 * cuBLAS's and cuBLASLt's names and reports every other library (cuDNN) absent (emu_dl.h).
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdio.h>
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

/* Group g: group_size[g] products of its sizes, operations and scales; the pointer arrays
 * (device memory) hold the products of every group in order. */
static cublasStatus_t gemm_grouped(cublasHandle_t h, const cublasOperation_t ta[],
                                   const cublasOperation_t tb[], const int m[], const int n[],
                                   const int k[], const void *alpha, const void *const a[],
                                   cudaDataType at, const int lda[], const void *const b[],
                                   cudaDataType bt, const int ldb[], const void *beta,
                                   void *const c[], cudaDataType ct, const int ldc[], int groups,
                                   const int group_size[], cublasComputeType_t comp) {
  if (groups < 0 || comp != CUBLAS_COMPUTE_32F) return CUBLAS_STATUS_INVALID_VALUE;
  if (at != bt || at != ct) return CUBLAS_STATUS_NOT_SUPPORTED;
  long e = 0;
  for (int g = 0; g < groups; g++) {
    if (group_size[g] < 0) return CUBLAS_STATUS_INVALID_VALUE;
    for (int j = 0; j < group_size[g]; j++, e++) {
      cublasStatus_t s =
          gemm(h, ta[g], tb[g], m[g], n[g], k[g], (const float *)alpha + g, a[e], at, lda[g], b[e],
               bt, ldb[g], (const float *)beta + g, c[e], ct, ldc[g], comp, CUBLAS_GEMM_DEFAULT);
      if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

/* ---- cuBLASLt: one algorithm, asking for a workspace that the product then checks ---- */

static int lt_library;
static const size_t kLtWorkspace = 64 << 10;

struct lt_desc { /* in a cublasLtMatmulDescOpaque_t */
  cublasOperation_t ta, tb;
};
struct lt_layout { /* in a cublasLtMatrixLayoutOpaque_t */
  cudaDataType type;
  uint64_t rows, cols;
  int64_t ld;
};

static lt_desc desc_of(const cublasLtMatmulDesc_t d) {
  lt_desc x;
  memcpy(&x, d->data, sizeof x);
  return x;
}

static lt_layout layout_of(const cublasLtMatrixLayout_t l) {
  lt_layout x;
  memcpy(&x, l->data, sizeof x);
  return x;
}

static cublasStatus_t lt_create(cublasLtHandle_t *h) {
  *h = (cublasLtHandle_t)&lt_library;
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t lt_desc_create(cublasLtMatmulDesc_t *d, cublasComputeType_t compute,
                                     cudaDataType_t scale) {
  if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  *d = new cublasLtMatmulDescOpaque_t();
  lt_desc x{CUBLAS_OP_N, CUBLAS_OP_N};
  memcpy((*d)->data, &x, sizeof x);
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t lt_desc_set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                  const void *buf, size_t size) {
  lt_desc x = desc_of(d);
  if (size != sizeof(int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr == CUBLASLT_MATMUL_DESC_TRANSA)
    memcpy(&x.ta, buf, size);
  else if (attr == CUBLASLT_MATMUL_DESC_TRANSB)
    memcpy(&x.tb, buf, size);
  else
    return CUBLAS_STATUS_NOT_SUPPORTED; /* the backend sets no other attribute */
  memcpy(d->data, &x, sizeof x);
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t lt_desc_destroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t lt_layout_create(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows,
                                       uint64_t cols, int64_t ld) {
  if (ld < (int64_t)rows || ld < 1) return CUBLAS_STATUS_INVALID_VALUE; /* column-major */
  *l = new cublasLtMatrixLayoutOpaque_t();
  lt_layout x{type, rows, cols, ld};
  memcpy((*l)->data, &x, sizeof x);
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t lt_layout_destroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t lt_pref_create(cublasLtMatmulPreference_t *p) {
  *p = new cublasLtMatmulPreferenceOpaque_t();
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t lt_pref_set(cublasLtMatmulPreference_t p,
                                  cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                  size_t size) {
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES && size == sizeof(uint64_t))
    p->data[0] = *(const uint64_t *)buf;
  else if (size != sizeof(uint32_t))
    return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t lt_pref_destroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}

/* Whether the layouts make D (m x n) = op(A) (m x k) op(B) (k x n), C like D; *k set. */
static bool lt_shapes(const lt_desc *d, const lt_layout *a, const lt_layout *b, const lt_layout *c,
                      const lt_layout *o, uint64_t *k) {
  uint64_t am = d->ta == CUBLAS_OP_N ? a->rows : a->cols,
           ak = d->ta == CUBLAS_OP_N ? a->cols : a->rows;
  uint64_t bk = d->tb == CUBLAS_OP_N ? b->rows : b->cols,
           bn = d->tb == CUBLAS_OP_N ? b->cols : b->rows;
  *k = ak;
  return am == o->rows && bn == o->cols && ak == bk && c->rows == o->rows && c->cols == o->cols &&
         c->ld == o->ld && a->type == b->type && c->type == o->type;
}

static cublasStatus_t lt_heuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d,
                                   cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                   cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t o,
                                   cublasLtMatmulPreference_t p, int requested,
                                   cublasLtMatmulHeuristicResult_t *results, int *returned) {
  uint64_t k;
  *returned = 0;
  if (requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  lt_desc x = desc_of(d);
  lt_layout A = layout_of(a), B = layout_of(b), C = layout_of(c), D = layout_of(o);
  if (!lt_shapes(&x, &A, &B, &C, &D, &k)) return CUBLAS_STATUS_INVALID_VALUE;
  if (p->data[0] < kLtWorkspace) return CUBLAS_STATUS_NOT_SUPPORTED; /* no algorithm fits */
  memset(&results[0], 0, sizeof results[0]);
  results[0].algo.data[0] = 0x4c74; /* the one algorithm */
  results[0].workspaceSize = kLtWorkspace;
  results[0].state = CUBLAS_STATUS_SUCCESS;
  results[0].wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t lt_matmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha,
                                const void *a, cublasLtMatrixLayout_t la, const void *b,
                                cublasLtMatrixLayout_t lb, const void *beta, const void *c,
                                cublasLtMatrixLayout_t lc, void *o, cublasLtMatrixLayout_t lo,
                                const cublasLtMatmulAlgo_t *algo, void *workspace,
                                size_t workspace_bytes, cudaStream_t) {
  lt_desc x = desc_of(d);
  lt_layout A = layout_of(la), B = layout_of(lb), C = layout_of(lc), D = layout_of(lo);
  uint64_t k;
  if (h != (cublasLtHandle_t)&lt_library || algo == NULL || algo->data[0] != 0x4c74 ||
      !lt_shapes(&x, &A, &B, &C, &D, &k) || workspace_bytes < kLtWorkspace || workspace == NULL)
    return CUBLAS_STATUS_INVALID_VALUE;
  memset(workspace, 0, workspace_bytes); /* the workspace must be device memory of that size */
  if (c != o) {                          /* C into D first (the backend passes D as C) */
    size_t e = D.type == CUDA_R_32F ? 4 : 2;
    for (uint64_t j = 0; j < D.cols; j++)
      memmove((char *)o + j * D.ld * e, (const char *)c + j * C.ld * e, D.rows * e);
  }
  return gemm(NULL, x.ta, x.tb, (int)D.rows, (int)D.cols, (int)k, alpha, a, A.type, (int)A.ld, b,
              B.type, (int)B.ld, beta, o, D.type, (int)D.ld, CUBLAS_COMPUTE_32F,
              CUBLAS_GEMM_DEFAULT);
}

static const char *lt_status_name(cublasStatus_t s) {
  static thread_local char text[48];
  snprintf(text, sizeof text, "cuBLAS status %d (emulated)", (int)s);
  return text;
}

/* ---- dlopen ---- */

static thread_local const char *dl_error = "";

extern "C" void *emu_dlopen(const char *name, int) {
  if (name != NULL && strncmp(name, "libcublas.so.", 13) == 0) return &library;
  if (name != NULL && strncmp(name, "libcublasLt.so.", 15) == 0) return &lt_library;
  dl_error = "not in the CUDA emulator";
  return NULL;
}

extern "C" void *emu_dlsym(void *lib, const char *symbol) {
  static const struct {
    void *lib;
    const char *name;
    void *fn;
  } table[] = {
      {&library, "cublasCreate_v2", (void *)create},
      {&library, "cublasSetStream_v2", (void *)set_stream},
      {&library, "cublasGemmEx", (void *)gemm},
      {&library, "cublasGemmBatchedEx", (void *)gemm_batched},
      {&library, "cublasGemmGroupedBatchedEx", (void *)gemm_grouped},
      {&lt_library, "cublasLtCreate", (void *)lt_create},
      {&lt_library, "cublasLtMatmulDescCreate", (void *)lt_desc_create},
      {&lt_library, "cublasLtMatmulDescSetAttribute", (void *)lt_desc_set},
      {&lt_library, "cublasLtMatmulDescDestroy", (void *)lt_desc_destroy},
      {&lt_library, "cublasLtMatrixLayoutCreate", (void *)lt_layout_create},
      {&lt_library, "cublasLtMatrixLayoutDestroy", (void *)lt_layout_destroy},
      {&lt_library, "cublasLtMatmulPreferenceCreate", (void *)lt_pref_create},
      {&lt_library, "cublasLtMatmulPreferenceSetAttribute", (void *)lt_pref_set},
      {&lt_library, "cublasLtMatmulPreferenceDestroy", (void *)lt_pref_destroy},
      {&lt_library, "cublasLtMatmulAlgoGetHeuristic", (void *)lt_heuristic},
      {&lt_library, "cublasLtMatmul", (void *)lt_matmul},
      {&lt_library, "cublasLtGetStatusName", (void *)lt_status_name},
  };
  for (const auto &t : table)
    if (t.lib == lib && strcmp(t.name, symbol) == 0) return t.fn;
  return NULL;
}

extern "C" char *emu_dlerror(void) { return (char *)dl_error; }
