/*
 * Dense tensors of up to TENSOR_MAX_DIMS dimensions on the host or a CUDA device.
 *
 * A fsdpc_tensor_t is a small value the caller owns (on the stack or inside another object); its
 * memory is a reference-counted storage, so views (tensor_view, tensor_narrow) share it and
 * every fsdpc_tensor_t, view or not, is released with tensor_free(). Fields are read-only outside
 * this module. New tensors are contiguous (row-major); narrow() along a dimension other than
 * the first gives a strided view, which tensor_copy() accepts on either side.
 *
 *   int64_t shape[2] = {16, 15};
 *   fsdpc_tensor_t a, rows;
 *   FSDPC_TRY(tensor_init(&a, DTYPE_F32, device_cpu(), 2, shape));
 *   FSDPC_TRY(tensor_fill(&a, 1.0));
 *   FSDPC_TRY(tensor_narrow(&rows, &a, 0, 4, 8));    // rows 4..11, shares a's memory
 *   tensor_free(&rows);
 *   tensor_free(&a);
 *
 * Shapes are element counts; byte counts only ever appear as *_nbytes.
 */
#ifndef FSDPC_BASE_TENSOR_H
#define FSDPC_BASE_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/device.h"
#include "core/dtype.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

#define TENSOR_MAX_DIMS 5

typedef struct tensor_storage tensor_storage_t;

typedef struct fsdpc_tensor {
  dtype_t dtype;
  device_t device;
  int ndim;                        /* 0 for a scalar (one element) */
  int64_t shape[TENSOR_MAX_DIMS];  /* elements per dimension */
  int64_t stride[TENSOR_MAX_DIMS]; /* in elements */
  void *data;                      /* first element; NULL when numel == 0 or meta */
  tensor_storage_t *storage;       /* shared by views; NULL for an empty or meta tensor */
  bool meta;                       /* shape and dtype only, no memory (deferred init) */
} fsdpc_tensor_t;

/* Allocates an uninitialised contiguous tensor. Caller frees with tensor_free. */
fsdpc_status_t tensor_init(fsdpc_tensor_t *t, dtype_t dtype, device_t dev, int ndim,
                           const int64_t *shape);

/* A meta tensor: dtype, device and shape, but no memory (as PyTorch's device "meta"). Views,
 * narrows, references and clones of it are meta too; anything that reads or writes elements
 * (copies, fills, kernels, collectives) refuses it. Models built for deferred
 * initialisation hold their parameters this way until their shards are allocated. */
fsdpc_status_t tensor_meta(fsdpc_tensor_t *t, dtype_t dtype, device_t dev, int ndim,
                           const int64_t *shape);
static inline bool tensor_is_meta(const fsdpc_tensor_t *t) { return t != NULL && t->meta; }

/* What reads or writes t's elements (`what`, named in the error) checks this first: a meta
 * tensor, or one without memory (freed, or zero-initialised and never made), is refused. */
fsdpc_status_t tensor_check_memory(const char *what, const fsdpc_tensor_t *t);

/* Same, filled with zeros. */
fsdpc_status_t tensor_zeros(fsdpc_tensor_t *t, dtype_t dtype, device_t dev, int ndim,
                            const int64_t *shape);

/* The functions below that make out from src (clone, upload, view, narrow, narrow_box, ref)
 * take out == src: the result then replaces src, whose reference is released
 * (tensor_view(&t, &t, ...) as t = t.view(...)); on failure src is left as it was. */

/* A contiguous copy of src on dev in dtype (a meta tensor for a meta src). Caller frees out. */
fsdpc_status_t tensor_clone(fsdpc_tensor_t *out, const fsdpc_tensor_t *src, dtype_t dtype,
                            device_t dev);

/* A copy of host, a contiguous tensor on the host, on dev in its dtype, without waiting for
 * the device (device_upload): only work on dev's current stream, or ordered after it, may read
 * out. Caller frees out. */
fsdpc_status_t tensor_upload(fsdpc_tensor_t *out, const fsdpc_tensor_t *host, device_t dev);

/* Wraps caller-owned memory without taking ownership; tensor_free() on it releases nothing
 * of the memory. The memory must outlive the tensor and its views. */
fsdpc_status_t tensor_wrap(fsdpc_tensor_t *t, void *data, dtype_t dtype, device_t dev, int ndim,
                           const int64_t *shape);

/* Releases t's reference to its storage and zeroes t. tensor_free(NULL) is a no-op. */
void tensor_free(fsdpc_tensor_t *t);

/* Whether another tensor (a view, a tensor_ref) still references t's storage: freeing t then
 * releases no memory, and the last holder frees it wherever it is freed. */
bool tensor_storage_shared(const fsdpc_tensor_t *t);

/* A view of a contiguous tensor with another shape of the same numel. */
fsdpc_status_t tensor_view(fsdpc_tensor_t *out, const fsdpc_tensor_t *src, int ndim,
                           const int64_t *shape);

/* A view of elements [start, start + length) along dim. */
fsdpc_status_t tensor_narrow(fsdpc_tensor_t *out, const fsdpc_tensor_t *src, int dim, int64_t start,
                             int64_t length);

/* A view of the box [offset[d], offset[d] + shape[d]) in every dimension d. */
fsdpc_status_t tensor_narrow_box(fsdpc_tensor_t *out, const fsdpc_tensor_t *src,
                                 const int64_t *offset, const int64_t *shape);

/* Another reference to the same elements (same shape and strides). */
fsdpc_status_t tensor_ref(fsdpc_tensor_t *out, const fsdpc_tensor_t *src);

/* Whether another tensor holds t's storage too (a reference or a view): writing t's elements
 * in place then changes what that one reads. */
bool tensor_shared(const fsdpc_tensor_t *t);

/* Copies src into dst element-wise: same shape, any dtypes (converted as dtype_store),
 * any devices, any strides. Blocks until dst is readable by the host when dst is on the
 * host; otherwise ordered on the current stream. */
fsdpc_status_t tensor_copy(fsdpc_tensor_t *dst, const fsdpc_tensor_t *src);

/* tensor_copy(&dst[i], &src[i]) for i < n, the destinations apart from each other and from
 * the sources. Where every pair is on one device the copies go to the device together: on
 * CUDA, the contiguous ones (same dtype, or a cast between float dtypes) in one launch, which
 * moves many small tensors at the device's copy bandwidth rather than at one launch each
 * (FSDP's copy-in, copy-out and gradient packing). Profiled as "copy (batched)". */
fsdpc_status_t tensor_copy_many(fsdpc_tensor_t *dst, const fsdpc_tensor_t *src, int n);

/* Sets every element to value (converted to the dtype as dtype_store does). */
fsdpc_status_t tensor_fill(fsdpc_tensor_t *t, double value);

int64_t tensor_numel(const fsdpc_tensor_t *t);
size_t tensor_nbytes(const fsdpc_tensor_t *t);
bool tensor_is_contiguous(const fsdpc_tensor_t *t);
bool tensor_same_shape(const fsdpc_tensor_t *a, const fsdpc_tensor_t *b);

/* Bit-exact comparison of dtype, shape and every element (any devices). *equal is set to
 * true or false; a status other than OK means the comparison itself failed. */
fsdpc_status_t tensor_equal(const fsdpc_tensor_t *a, const fsdpc_tensor_t *b, bool *equal);

/* "[16,15]" into buf; returns buf. */
const char *tensor_shape_str(int ndim, const int64_t *shape, char *buf, size_t size);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
