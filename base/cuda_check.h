/*
 * Maps CUDA runtime errors into status_t. Private; used by .cu files and by
 * host-side C files compiled against the CUDA headers.
 */
#ifndef FSDPC_BASE_CUDA_CHECK_H
#define FSDPC_BASE_CUDA_CHECK_H

#include <cuda_runtime.h>

#include "base/status.h"

/* The status of a CUDA runtime result: STATUS_OK; STATUS_ENOMEM for a failed allocation;
 * otherwise STATUS_ECUDA, the detail "WHAT: the runtime's text". Clears the runtime's last
 * error (a non-sticky error must not fail the next check). Every CUDA runtime result the
 * library checks goes through here. */
static inline status_t cuda_status(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return STATUS_OK;
  (void)cudaGetLastError();
  return err_set(e == cudaErrorMemoryAllocation ? STATUS_ENOMEM : STATUS_ECUDA, "%s: %s", what,
                 cudaGetErrorString(e));
}

#define CUDA_STR2_(x) #x
#define CUDA_STR_(x) CUDA_STR2_(x)
/* Returns from the caller when call fails, naming the call and where it is. */
#define CUDA_TRY(call) TRY(cuda_status((call), __FILE__ ":" CUDA_STR_(__LINE__) ": " #call))

#endif
