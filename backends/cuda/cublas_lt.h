/*
 * cuBLASLt matrix products for the CUDA backend (private to backends/cuda/). One call is
 * D = alpha * op(A) op(B) + beta * D in cuBLAS's column-major terms, A, B and D of one float
 * dtype (bf16, f16 or f32), fp32 compute and scale (f32 operands stay fp32: no TF32).
 *
 * libcublasLt.so is loaded on the first call. For each device, dtype, transposes, sizes,
 * leading dimensions and operand alignment the algorithm cuBLASLt's heuristics rank first is
 * chosen once and kept, so one shape always runs one algorithm: the same bits on every run
 * (activation-checkpointing recomputation included), whatever else the device runs at the
 * time. A refusal is kept too. A call cuBLASLt cannot run returns STATUS_OK with *ran false,
 * and the caller runs cublasGemmEx; the reason is kept for kernel_matmul_lt_note().
 * FSDPC_CUBLASLT=0 in the environment, or kernel_matmul_set_lt(false), turns this path off.
 *
 *   lt_gemm_t g = {.dev = 0, .stream = s, .dt = DTYPE_BF16, .trans_a = true, .m = N, .n = M,
 *                  .k = K, .lda = K, .ldb = K, .ldd = N};
 *   bool ran;
 *   FSDPC_TRY(cublas_lt_matmul(&g, 1.0f, a, b, 0.0f, d, &ran));
 *   if (!ran) ...  // cublasGemmEx with the same arguments
 */
#ifndef FSDPC_BASE_CUBLAS_LT_H
#define FSDPC_BASE_CUBLAS_LT_H

#include <stdbool.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/kernels_impl.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lt_gemm {
  int dev;      /* the current device */
  void *stream; /* the cudaStream_t every operand is ordered on */
  dtype_t dt;
  bool trans_a, trans_b;
  int64_t m, n, k; /* op(A) is m x k, op(B) k x n, D m x n */
  int64_t lda, ldb, ldd;
} lt_gemm_t;

fsdpc_status_t cublas_lt_matmul(const lt_gemm_t *g, float alpha, const void *a, const void *b,
                                float beta, void *d, bool *ran);

/* The product kernel_matmul checked (row-major out = alpha op(a) op(b) + beta out, sizes d) in
 * cuBLAS's column-major terms: out^T = op(b)^T op(a)^T, so cuBLAS's A is b and its B is a. */
lt_gemm_t cublas_lt_of_row_major(int dev, void *stream, dtype_t dt, bool trans_a, bool trans_b,
                                 const matmul_dims_t *d);

/* How the layouts describe A, B and D as stored (column-major rows x cols, leading dimension
 * ld): op(A) is m x k, so A is k x m when transposed; likewise B; D is m x n. */
typedef struct lt_layout {
  uint64_t rows, cols;
  int64_t ld;
} lt_layout_t;

void cublas_lt_layouts(const lt_gemm_t *g, lt_layout_t out[3]);

#ifdef __cplusplus
}
#endif

#endif
