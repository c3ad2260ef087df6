/*
 * Maps CUDA runtime and cuBLAS errors into status_t. Private; used by .cu files and by
 * host-side C files compiled against the CUDA headers.
 */
#ifndef FSDPC_BASE_CUDA_CHECK_H
#define FSDPC_BASE_CUDA_CHECK_H

#include <cuda_runtime.h>

#include "base/status.h"

#define CUDA_TRY(call)                                                         \
  do {                                                                         \
    cudaError_t cuda_err_ = (call);                                            \
    if (cuda_err_ != cudaSuccess)                                              \
      return err_set(STATUS_ECUDA, "%s:%d: %s: %s", __FILE__, __LINE__, #call, \
                     cudaGetErrorString(cuda_err_));                           \
  } while (0)

#endif
