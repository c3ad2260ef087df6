/*
 * Maps CUDA runtime errors into fsdpc_status_t; host waits for streams and events through
 * device_poll. Private; used by .cu files and by host-side C files compiled against the CUDA
 * headers.
 */
#ifndef FSDPC_BASE_CUDA_CHECK_H
#define FSDPC_BASE_CUDA_CHECK_H

#include <cuda_runtime.h>

#include "core/device.h"
#include "core/status.h"

/* The status of a CUDA runtime result: STATUS_OK; STATUS_ENOMEM for a failed allocation;
 * otherwise STATUS_ECUDA, the detail "WHAT: the runtime's text". Clears the runtime's last
 * error (a non-sticky error must not fail the next check). Every CUDA runtime result the
 * library checks goes through here. */
static inline fsdpc_status_t cuda_status(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return STATUS_OK;
  (void)cudaGetLastError();
  return err_set(e == cudaErrorMemoryAllocation ? STATUS_ENOMEM : STATUS_ECUDA, "%s: %s", what,
                 cudaGetErrorString(e));
}

/* Makes index the calling thread's device, without the runtime call when it is already (the
 * runtime keeps the current device per thread; asking is a read, setting is not free: this is
 * every allocation's, copy's and launch's path). */
static inline cudaError_t cuda_use_device(int index) {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur == index) return cudaSuccess;
  return cudaSetDevice(index);
}

#define CUDA_STR2_(x) #x
#define CUDA_STR_(x) CUDA_STR2_(x)
/* Returns from the caller when call fails, naming the call and where it is. */
#define CUDA_TRY(call) FSDPC_TRY(cuda_status((call), __FILE__ ":" CUDA_STR_(__LINE__) ": " #call))

/* Host waits poll (device_poll): a stream or event not done yet is cudaErrorNotReady, which
 * the runtime also records as its last error; it is cleared, as it is no failure. */
static inline int cuda_query_done(cudaError_t e, const char *what, fsdpc_status_t *st) {
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return 0;
  }
  *st = cuda_status(e, what);
  return -1;
}

static inline int cuda_stream_done(void *ctx, fsdpc_status_t *st) {
  return cuda_query_done(cudaStreamQuery(*(cudaStream_t *)ctx), "cudaStreamQuery", st);
}

static inline int cuda_event_done(void *ctx, fsdpc_status_t *st) {
  return cuda_query_done(cudaEventQuery(*(cudaEvent_t *)ctx), "cudaEventQuery", st);
}

#ifdef __cplusplus
extern "C" {
#endif
/* The index checks of the kernels (backends/cuda/kernels_cuda.h's flag_t) that have run: the first
 * one found set, as its EINVAL (and cleared), else STATUS_OK. */
fsdpc_status_t cuda_index_checks(void);
#ifdef __cplusplus
}
#endif

/* Waits for the work queued on s, or before e was recorded, through device_poll; then the
 * index checks of the kernels that ran (no kernel reads its check back at its launch).
 * cuda_drain_stream leaves the checks to a later wait (for cleanups that drop the status). */
static inline fsdpc_status_t cuda_drain_stream(cudaStream_t s, const char *what) {
  return device_poll(cuda_stream_done, &s, what);
}

static inline fsdpc_status_t cuda_wait_stream(cudaStream_t s, const char *what) {
  FSDPC_TRY(cuda_drain_stream(s, what));
  return cuda_index_checks();
}

static inline fsdpc_status_t cuda_wait_event(cudaEvent_t e, const char *what) {
  FSDPC_TRY(device_poll(cuda_event_done, &e, what));
  return cuda_index_checks();
}

#endif
