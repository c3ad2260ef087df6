/*
 * Private interface between device.c / tensor.c and the compute backends (CPU, CUDA).
 * Not installed. Each backend fills one backend_t with labelled initialisers; the public
 * functions check their arguments, then call through the table of the tensor's device.
 */
#ifndef FSDPC_BASE_BACKEND_H
#define FSDPC_BASE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define BACKEND_MAX_DIMS 5

/* An element-wise copy between two strided views on one device, converting dtype. Strides
 * are in elements. Shapes have ndim entries, ndim >= 1 (a scalar is shape [1]). */
typedef struct copy_desc {
  int ndim;
  int64_t shape[BACKEND_MAX_DIMS];
  int64_t dst_stride[BACKEND_MAX_DIMS];
  int64_t src_stride[BACKEND_MAX_DIMS];
  void *dst;
  const void *src;
  dtype_t dst_dtype;
  dtype_t src_dtype;
} copy_desc_t;

/* Merges dimensions that are contiguous in both views and drops size-1 dimensions, so that
 * the common cases reach a plain memory copy. Returns the new ndim (>= 1). */
static inline int copy_desc_coalesce(copy_desc_t *d) {
  int n = 0;
  for (int i = 0; i < d->ndim; i++) {
    if (d->shape[i] == 1) continue;
    if (n > 0 && d->dst_stride[n - 1] == d->dst_stride[i] * d->shape[i] &&
        d->src_stride[n - 1] == d->src_stride[i] * d->shape[i]) {
      d->shape[n - 1] *= d->shape[i];
      d->dst_stride[n - 1] = d->dst_stride[i];
      d->src_stride[n - 1] = d->src_stride[i];
      continue;
    }
    d->shape[n] = d->shape[i];
    d->dst_stride[n] = d->dst_stride[i];
    d->src_stride[n] = d->src_stride[i];
    n++;
  }
  if (n == 0) {
    d->shape[0] = 1;
    d->dst_stride[0] = d->src_stride[0] = 1;
    n = 1;
  }
  d->ndim = n;
  return n;
}

typedef struct backend {
  const char *name;
  /* zeroed: the memory must read as zeros; free gets the same bytes and zeroed */
  fsdpc_status_t (*alloc)(int index, size_t bytes, bool zeroed, void **out);
  void (*free)(int index, void *ptr, size_t bytes, bool zeroed);
  fsdpc_status_t (*copy)(int index, const copy_desc_t *desc);
  /* n copies that do not overlap, as copy does each, in as few launches as the backend can
   * (NULL: copy one by one) */
  fsdpc_status_t (*copy_many)(int index, const copy_desc_t *descs, int n);
  /* Sets n elements at ptr to the bit pattern `pattern` of elem_size bytes. */
  fsdpc_status_t (*fill)(int index, void *ptr, size_t elem_size, size_t n, uint64_t pattern);
  fsdpc_status_t (*stream_sync)(int index);
  /* Devices with streams and events (NULL on the CPU, whose streams and events are NULL). */
  int (*device_count)(void);
  /* the 16 bytes of device index's UUID */
  fsdpc_status_t (*device_uuid)(int index, uint8_t out[16]);
  /* bytes between any two devices of the kind (or one of them the host); ordered on the
   * current stream, and usable by the host on return when dst is the host */
  fsdpc_status_t (*memcpy)(device_t dst_dev, void *dst, device_t src_dev, const void *src,
                           size_t bytes);
  stream_t *(*stream_current)(int index);
  void (*stream_set_current)(int index, stream_t *s);
  fsdpc_status_t (*stream_new)(int index, bool high, stream_t **out); /* high: top priority */
  void (*stream_free)(stream_t *s);
  fsdpc_status_t (*stream_wait_event)(stream_t *s, event_t *e);
  fsdpc_status_t (*stream_synchronize)(stream_t *s);
  fsdpc_status_t (*event_new)(int index, event_t **out);
  void (*event_free)(event_t *e);
  fsdpc_status_t (*event_record)(event_t *e, stream_t *s);
  fsdpc_status_t (*event_synchronize)(event_t *e);
  /* host staging (NULL on the CPU): page-locked host memory, a copy between the device and
   * it ordered on s without waiting for it, and a kernel that keeps s busy for seconds */
  fsdpc_status_t (*host_alloc_pinned)(size_t bytes, void **out);
  void (*host_free_pinned)(void *p);
  /* page-locks the host memory of another allocator for the device's copies (false when it
   * could not), and releases it again */
  bool (*host_register)(void *p, size_t bytes);
  void (*host_unregister)(void *p);
  fsdpc_status_t (*copy_async)(stream_t *s, void *dst, const void *src, size_t bytes);
  fsdpc_status_t (*delay)(stream_t *s, double seconds);
  /* bytes from pageable host memory to device index's memory, ordered on its current stream,
   * returning once src may be reused, without waiting for the device (NULL on the CPU) */
  fsdpc_status_t (*upload)(int index, void *dst, const void *src, size_t bytes);
} backend_t;

const backend_t *cpu_backend(void);

/* Host memory of the CPU backend, also for the CPU kernels' scratch buffers (not counted by
 * mem_stats): blocks of 64 KiB and more are cached when freed and reused for the same size
 * (see cpu_backend.c). cpu_host_free takes the size given to cpu_host_alloc. */
void *cpu_host_alloc(size_t bytes, bool zeroed);
void cpu_host_free(void *p, size_t bytes);
/* Blocks the cache has taken from the operating system so far (a steady training step takes
 * none), and giving every cached block back (the peak restarts from the live bytes). */
size_t cpu_host_os_allocs(void);
void cpu_host_empty_cache(void);
/* From now on, the blocks of 4 MiB and more the host allocator takes from the operating system
 * are page-locked with pin (a block pin refuses stays pageable) and released with unpin before
 * they go back. */
void cpu_host_set_pinning(bool (*pin)(void *p, size_t bytes), void (*unpin)(void *p));

/* NULL when the library was built without CUDA. */
const backend_t *cuda_backend(void);


#ifdef __cplusplus
}
#endif

#endif
