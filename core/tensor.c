#include "core/tensor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/backend_impl.h"
#include "core/kernels_impl.h"

struct tensor_storage {
  int refcount;
  int owned;   /* 0 for tensor_wrap: the memory belongs to the caller */
  bool zeroed; /* from device_alloc_zeroed */
  device_t device;
  void *ptr;
  size_t bytes;
};

static const backend_t *backend_of(device_t dev) {
  return dev.type == DEVICE_CUDA ? cuda_backend() : cpu_backend();
}

const char *tensor_shape_str(int ndim, const int64_t *shape, char *buf, size_t size) {
  if (buf == NULL || size == 0) return "";
  if (shape == NULL) ndim = 0;
  size_t off = 0;
  off += (size_t)snprintf(buf + off, size - off, "[");
  for (int i = 0; i < ndim && off < size; i++)
    off += (size_t)snprintf(buf + off, size - off, "%s%lld", i ? "," : "", (long long)shape[i]);
  if (off < size) snprintf(buf + off, size - off, "]");
  return buf;
}

int64_t tensor_numel(const fsdpc_tensor_t *t) {
  if (t == NULL) return 0;
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
  return n;
}

size_t tensor_nbytes(const fsdpc_tensor_t *t) {
  if (t == NULL) return 0;
  return (size_t)tensor_numel(t) * dtype_size(t->dtype);
}

bool tensor_is_contiguous(const fsdpc_tensor_t *t) {
  if (t == NULL) return false;
  int64_t expect = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] != 1 && t->stride[i] != expect) return false;
    expect *= t->shape[i];
  }
  return true;
}

bool tensor_same_shape(const fsdpc_tensor_t *a, const fsdpc_tensor_t *b) {
  if (a == NULL || b == NULL) return false;
  if (a->ndim != b->ndim) return false;
  for (int i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

/* The shape of a tensor fn makes. */
static fsdpc_status_t check_shape(const char *fn, int ndim, const int64_t *shape) {
  if (ndim < 0 || ndim > TENSOR_MAX_DIMS)
    return err_set(STATUS_ESHAPE, "%s: tensors have 0 to %d dimensions, got %d", fn,
                   TENSOR_MAX_DIMS, ndim);
  if (ndim > 0 && shape == NULL) return err_set(STATUS_EINVAL, "%s: shape is NULL", fn);
  int64_t numel = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] < 0)
      return err_set(STATUS_ESHAPE, "%s: negative size %lld in dimension %d", fn,
                     (long long)shape[i], i);
    if (shape[i] > 0 && numel > INT64_MAX / 16 / shape[i]) {
      char sb[160];
      return err_set(STATUS_ESHAPE, "%s: shape %s holds more elements than a tensor may (2^59)", fn,
                     tensor_shape_str(ndim, shape, sb, sizeof sb));
    }
    numel *= shape[i];
  }
  return STATUS_OK;
}

static void set_layout(fsdpc_tensor_t *t, dtype_t dtype, device_t dev, int ndim,
                       const int64_t *shape) {
  memset(t, 0, sizeof *t);
  t->dtype = dtype;
  t->device = dev;
  t->ndim = ndim;
  int64_t stride = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    t->shape[i] = shape[i];
    t->stride[i] = stride;
    stride *= shape[i];
  }
}

/* A contiguous tensor, its memory zero-filled when zeroed. */
static fsdpc_status_t tensor_alloc(fsdpc_tensor_t *t, dtype_t dtype, device_t dev, int ndim,
                                   const int64_t *shape, bool zeroed) {
  if (t == NULL) return err_set(STATUS_EINVAL, "tensor_init: t is NULL");
  memset(t, 0, sizeof *t);
  if (dtype_size(dtype) == 0)
    return err_set(STATUS_EDTYPE, "tensor_init: invalid dtype %d", (int)dtype);
  FSDPC_TRY(check_shape("tensor_init", ndim, shape));
  FSDPC_TRY(device_check(dev));
  set_layout(t, dtype, dev, ndim, shape);
  size_t bytes = tensor_nbytes(t);
  if (bytes == 0) return STATUS_OK;
  tensor_storage_t *s = calloc(1, sizeof *s);
  if (s == NULL) return err_set(STATUS_ENOMEM, "tensor_init: out of host memory");
  fsdpc_status_t st =
      zeroed ? device_alloc_zeroed(dev, bytes, &s->ptr) : device_alloc(dev, bytes, &s->ptr);
  if (st != STATUS_OK) {
    free(s);
    memset(t, 0, sizeof *t);
    return st;
  }
  s->refcount = 1;
  s->owned = 1;
  s->zeroed = zeroed;
  s->device = dev;
  s->bytes = bytes;
  t->storage = s;
  t->data = s->ptr;
  return STATUS_OK;
}

fsdpc_status_t tensor_init(fsdpc_tensor_t *t, dtype_t dtype, device_t dev, int ndim,
                           const int64_t *shape) {
  return tensor_alloc(t, dtype, dev, ndim, shape, false);
}

fsdpc_status_t tensor_meta(fsdpc_tensor_t *t, dtype_t dtype, device_t dev, int ndim,
                           const int64_t *shape) {
  if (t == NULL) return err_set(STATUS_EINVAL, "tensor_meta: t is NULL");
  memset(t, 0, sizeof *t);
  if (dtype_size(dtype) == 0)
    return err_set(STATUS_EDTYPE, "tensor_meta: invalid dtype %d", (int)dtype);
  FSDPC_TRY(check_shape("tensor_meta", ndim, shape));
  set_layout(t, dtype, dev, ndim, shape);
  t->meta = true;
  return STATUS_OK;
}

/* The error for an element access of a meta tensor. */
static fsdpc_status_t meta_error(const char *what, const fsdpc_tensor_t *t) {
  char a[96];
  return err_set(STATUS_EINVAL,
                 "%s: a meta tensor %s has no memory (a model built for deferred "
                 "initialisation: allocate its shards with nn_module_materialize first)",
                 what, tensor_shape_str(t->ndim, t->shape, a, sizeof a));
}

fsdpc_status_t tensor_check_memory(const char *what, const fsdpc_tensor_t *t) {
  ARG_NONNULL(t);
  if (tensor_numel(t) == 0) return STATUS_OK;
  if (t->meta) return meta_error(what, t);
  if (t->data == NULL) {
    char a[96];
    return err_set(STATUS_EINVAL,
                   "%s: a tensor of shape %s has no memory (freed, or never made by tensor_init "
                   "or tensor_zeros)",
                   what, tensor_shape_str(t->ndim, t->shape, a, sizeof a));
  }
  return STATUS_OK;
}

fsdpc_status_t tensor_zeros(fsdpc_tensor_t *t, dtype_t dtype, device_t dev, int ndim,
                            const int64_t *shape) {
  return tensor_alloc(t, dtype, dev, ndim, shape, true);
}

/* *v, a new tensor made from src, into *out; where out is src, src's reference is released
 * (the result replaces it: t = view of t). */
static fsdpc_status_t put_result(fsdpc_tensor_t *out, const fsdpc_tensor_t *src,
                                 const fsdpc_tensor_t *v) {
  if (out == src) tensor_free(out);
  *out = *v;
  return STATUS_OK;
}

fsdpc_status_t tensor_clone(fsdpc_tensor_t *out, const fsdpc_tensor_t *src, dtype_t dtype,
                            device_t dev) {
  ARG_NONNULL(out);
  ARG_NONNULL(src);
  fsdpc_tensor_t v;
  fsdpc_status_t st = src->meta ? tensor_meta(&v, dtype, dev, src->ndim, src->shape)
                                : tensor_init(&v, dtype, dev, src->ndim, src->shape);
  if (st == STATUS_OK && !src->meta) st = tensor_copy(&v, src);
  if (st == STATUS_OK) return put_result(out, src, &v);
  tensor_free(&v);
  if (out != src) memset(out, 0, sizeof *out); /* as a failed tensor_init leaves it */
  return st;
}

fsdpc_status_t tensor_upload(fsdpc_tensor_t *out, const fsdpc_tensor_t *host, device_t dev) {
  ARG_NONNULL(out);
  ARG_NONNULL(host);
  if (out != host) memset(out, 0, sizeof *out);
  if (host->device.type != DEVICE_CPU || host->meta || !tensor_is_contiguous(host))
    return err_set(STATUS_EINVAL, "tensor_upload: the source must be a contiguous host tensor");
  FSDPC_TRY(tensor_check_memory("tensor_upload", host));
  fsdpc_tensor_t v;
  FSDPC_TRY(tensor_init(&v, host->dtype, dev, host->ndim, host->shape));
  fsdpc_status_t st =
      device_upload(dev, v.data, host->data, (size_t)tensor_numel(host) * dtype_size(host->dtype));
  if (st != STATUS_OK) {
    tensor_free(&v);
    return st;
  }
  return put_result(out, host, &v);
}

fsdpc_status_t tensor_wrap(fsdpc_tensor_t *t, void *data, dtype_t dtype, device_t dev, int ndim,
                           const int64_t *shape) {
  if (t == NULL) return err_set(STATUS_EINVAL, "tensor_wrap: t is NULL");
  memset(t, 0, sizeof *t);
  if (dtype_size(dtype) == 0)
    return err_set(STATUS_EDTYPE, "tensor_wrap: invalid dtype %d", (int)dtype);
  FSDPC_TRY(check_shape("tensor_wrap", ndim, shape));
  set_layout(t, dtype, dev, ndim, shape);
  if (tensor_numel(t) > 0 && data == NULL)
    return err_set(STATUS_EINVAL, "tensor_wrap: data is NULL for a non-empty tensor");
  if (tensor_numel(t) == 0) return STATUS_OK;
  tensor_storage_t *s = calloc(1, sizeof *s);
  if (s == NULL) return err_set(STATUS_ENOMEM, "tensor_wrap: out of host memory");
  s->refcount = 1;
  s->device = dev;
  s->ptr = data;
  t->storage = s;
  t->data = data;
  return STATUS_OK;
}

bool tensor_storage_shared(const fsdpc_tensor_t *t) {
  return t != NULL && t->storage != NULL && t->storage->refcount > 1;
}

void tensor_free(fsdpc_tensor_t *t) {
  if (t == NULL) return;
  tensor_storage_t *s = t->storage;
  if (s != NULL && --s->refcount == 0) {
    if (s->owned && s->zeroed) device_free_zeroed(s->device, s->ptr, s->bytes);
    if (s->owned && !s->zeroed) device_free(s->device, s->ptr, s->bytes);
    free(s);
  }
  memset(t, 0, sizeof *t);
}

fsdpc_status_t tensor_ref(fsdpc_tensor_t *out, const fsdpc_tensor_t *src) {
  ARG_NONNULL(out);
  ARG_NONNULL(src);
  fsdpc_tensor_t v = *src;
  if (v.storage) v.storage->refcount++;
  return put_result(out, src, &v);
}

bool tensor_shared(const fsdpc_tensor_t *t) {
  if (t == NULL) return false;
  return t->storage != NULL && t->storage->refcount > 1;
}

fsdpc_status_t tensor_view(fsdpc_tensor_t *out, const fsdpc_tensor_t *src, int ndim,
                           const int64_t *shape) {
  ARG_NONNULL(out);
  ARG_NONNULL(src);
  if (ndim > 0) ARG_NONNULL(shape);
  FSDPC_TRY(check_shape("tensor_view", ndim, shape));
  char a[96], b[96];
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  if (n != tensor_numel(src))
    return err_set(STATUS_ESHAPE, "shape %s cannot be viewed as %s",
                   tensor_shape_str(src->ndim, src->shape, a, sizeof a),
                   tensor_shape_str(ndim, shape, b, sizeof b));
  if (!tensor_is_contiguous(src))
    return err_set(STATUS_ESHAPE, "view of a non-contiguous tensor of shape %s",
                   tensor_shape_str(src->ndim, src->shape, a, sizeof a));
  fsdpc_tensor_t v;
  set_layout(&v, src->dtype, src->device, ndim, shape);
  v.meta = src->meta;
  v.data = src->data;
  v.storage = src->storage;
  if (v.storage) v.storage->refcount++;
  return put_result(out, src, &v);
}

fsdpc_status_t tensor_narrow(fsdpc_tensor_t *out, const fsdpc_tensor_t *src, int dim, int64_t start,
                             int64_t length) {
  ARG_NONNULL(out);
  ARG_NONNULL(src);
  char a[96];
  if (dim < 0 || dim >= src->ndim)
    return err_set(STATUS_EINVAL, "narrow: dimension %d out of range for shape %s", dim,
                   tensor_shape_str(src->ndim, src->shape, a, sizeof a));
  if (start < 0 || length < 0 || start > src->shape[dim] - length) /* no overflow */
    return start >= 0 && length >= 0 && length <= INT64_MAX - start
               ? err_set(STATUS_ESHAPE, "narrow: [%lld, %lld) outside dimension %d of shape %s",
                         (long long)start, (long long)(start + length), dim,
                         tensor_shape_str(src->ndim, src->shape, a, sizeof a))
               : err_set(STATUS_ESHAPE,
                         "narrow: %lld elements from %lld outside dimension %d of shape %s",
                         (long long)length, (long long)start, dim,
                         tensor_shape_str(src->ndim, src->shape, a, sizeof a));
  fsdpc_tensor_t v = *src;
  v.shape[dim] = length;
  if (tensor_numel(&v) == 0) {
    v.data = NULL;
    v.storage = NULL;
  } else if (!v.meta) {
    v.data = (char *)src->data + start * src->stride[dim] * (int64_t)dtype_size(src->dtype);
    if (v.storage) v.storage->refcount++;
  }
  return put_result(out, src, &v);
}

fsdpc_status_t tensor_narrow_box(fsdpc_tensor_t *out, const fsdpc_tensor_t *src,
                                 const int64_t *offset, const int64_t *shape) {
  ARG_NONNULL(out);
  ARG_NONNULL(src);
  ARG_NONNULL(offset);
  ARG_NONNULL(shape);
  fsdpc_tensor_t box;
  FSDPC_TRY(tensor_ref(&box, src));
  for (int d = 0; d < src->ndim; d++) {
    fsdpc_tensor_t next;
    fsdpc_status_t st = tensor_narrow(&next, &box, d, offset[d], shape[d]);
    tensor_free(&box);
    FSDPC_TRY(st);
    box = next;
  }
  return put_result(out, src, &box);
}

static void desc_from(copy_desc_t *d, const fsdpc_tensor_t *dst, const fsdpc_tensor_t *src) {
  memset(d, 0, sizeof *d);
  d->ndim = dst->ndim > 0 ? dst->ndim : 1;
  for (int i = 0; i < d->ndim; i++) {
    d->shape[i] = dst->ndim ? dst->shape[i] : 1;
    d->dst_stride[i] = dst->ndim ? dst->stride[i] : 1;
    d->src_stride[i] = src->ndim ? src->stride[i] : 1;
  }
  d->dst = dst->data;
  d->src = src->data;
  d->dst_dtype = dst->dtype;
  d->src_dtype = src->dtype;
}

fsdpc_status_t tensor_copy(fsdpc_tensor_t *dst, const fsdpc_tensor_t *src) {
  ARG_NONNULL(dst);
  ARG_NONNULL(src);
  char a[96], b[96];
  if (!tensor_same_shape(dst, src))
    return err_set(STATUS_ESHAPE, "copy: destination shape %s differs from source shape %s",
                   tensor_shape_str(dst->ndim, dst->shape, a, sizeof a),
                   tensor_shape_str(src->ndim, src->shape, b, sizeof b));
  if (tensor_numel(dst) == 0) return STATUS_OK;
  FSDPC_TRY(tensor_check_memory("copy", dst));
  FSDPC_TRY(tensor_check_memory("copy", src));
  if (device_equal(dst->device, src->device)) {
    copy_desc_t d;
    desc_from(&d, dst, src);
    if (!kernel_profile_enabled()) return backend_of(dst->device)->copy(dst->device.index, &d);
    kernel_prof_t pc; /* a copy on one device: the bytes read and written */
    kernel_prof_begin(&pc, dst->device);
    double bytes =
        (double)tensor_numel(dst) * (double)(dtype_size(dst->dtype) + dtype_size(src->dtype));
    return kernel_prof_end(&pc, src->dtype == dst->dtype ? "copy" : "copy (cast)", bytes,
                           backend_of(dst->device)->copy(dst->device.index, &d));
  }
  /* Across devices: make a contiguous source in the destination dtype, move the bytes,
   * then scatter into the destination layout if it is strided. */
  fsdpc_status_t st = STATUS_OK;
  fsdpc_tensor_t staged_src = {0}, staged_dst = {0};
  const fsdpc_tensor_t *from = src;
  if (!tensor_is_contiguous(src) || src->dtype != dst->dtype) {
    FSDPC_TRY_GOTO(st, tensor_clone(&staged_src, src, dst->dtype, src->device));
    from = &staged_src;
  }
  if (tensor_is_contiguous(dst)) {
    FSDPC_TRY_GOTO(
        st, device_memcpy(dst->device, dst->data, from->device, from->data, tensor_nbytes(from)));
  } else {
    FSDPC_TRY_GOTO(st, tensor_init(&staged_dst, dst->dtype, dst->device, dst->ndim, dst->shape));
    FSDPC_TRY_GOTO(st, device_memcpy(dst->device, staged_dst.data, from->device, from->data,
                                     tensor_nbytes(from)));
    FSDPC_TRY_GOTO(st, tensor_copy(dst, &staged_dst));
  }
cleanup:
  tensor_free(&staged_src);
  tensor_free(&staged_dst);
  return st;
}

fsdpc_status_t tensor_copy_many(fsdpc_tensor_t *dst, const fsdpc_tensor_t *src, int n) {
  if (n > 0) ARG_NONNULL(dst);
  if (n > 0) ARG_NONNULL(src);
  if (n < 0) return err_set(STATUS_EINVAL, "copy: %d pairs", n);
  if (n == 0) return STATUS_OK;
  device_t dev = dst[0].device;
  const backend_t *be = backend_of(dev);
  bool together = be->copy_many != NULL && n > 1;
  for (int i = 0; i < n; i++) {
    char a[96], b[96];
    if (!tensor_same_shape(&dst[i], &src[i]))
      return err_set(STATUS_ESHAPE,
                     "copy: pair %d of %d: destination shape %s differs from source shape %s", i, n,
                     tensor_shape_str(dst[i].ndim, dst[i].shape, a, sizeof a),
                     tensor_shape_str(src[i].ndim, src[i].shape, b, sizeof b));
    FSDPC_TRY(tensor_check_memory("copy", &dst[i]));
    FSDPC_TRY(tensor_check_memory("copy", &src[i]));
    together = together && device_equal(dst[i].device, dev) && device_equal(src[i].device, dev);
  }
  if (!together) {
    for (int i = 0; i < n; i++) FSDPC_TRY(tensor_copy(&dst[i], &src[i]));
    return STATUS_OK;
  }
  copy_desc_t few[32]; /* two fully_shard units' parameters (a joint unshard): no allocation */
  copy_desc_t *d = n <= 32 ? few : malloc(sizeof *d * (size_t)n);
  if (d == NULL) return err_set(STATUS_ENOMEM, "copy: out of host memory for %d pairs", n);
  int m = 0;
  double bytes = 0; /* read and written */
  for (int i = 0; i < n; i++) {
    if (tensor_numel(&dst[i]) == 0) continue;
    desc_from(&d[m++], &dst[i], &src[i]);
    bytes += (double)tensor_numel(&dst[i]) *
             (double)(dtype_size(dst[i].dtype) + dtype_size(src[i].dtype));
  }
  fsdpc_status_t st;
  if (m == 0) {
    st = STATUS_OK;
  } else if (!kernel_profile_enabled()) {
    st = be->copy_many(dev.index, d, m);
  } else {
    kernel_prof_t pc;
    kernel_prof_begin(&pc, dev);
    st = kernel_prof_end(&pc, "copy (batched)", bytes, be->copy_many(dev.index, d, m));
  }
  if (d != few) free(d);
  return st;
}

fsdpc_status_t tensor_fill(fsdpc_tensor_t *t, double value) {
  ARG_NONNULL(t);
  if (tensor_numel(t) == 0) return STATUS_OK;
  FSDPC_TRY(tensor_check_memory("fill", t));
  uint64_t pattern = 0;
  dtype_store(t->dtype, &pattern, 0, value);
  size_t esz = dtype_size(t->dtype);
  const backend_t *be = backend_of(t->device);
  if (tensor_is_contiguous(t))
    return be->fill(t->device.index, t->data, esz, (size_t)tensor_numel(t), pattern);
  /* Strided: fill one element, then broadcast it with a stride-0 copy. */
  FSDPC_TRY(be->fill(t->device.index, t->data, esz, 1, pattern));
  copy_desc_t d;
  desc_from(&d, t, t);
  for (int i = 0; i < d.ndim; i++) d.src_stride[i] = 0;
  return be->copy(t->device.index, &d);
}

fsdpc_status_t tensor_equal(const fsdpc_tensor_t *a, const fsdpc_tensor_t *b, bool *equal) {
  ARG_NONNULL(a);
  ARG_NONNULL(b);
  ARG_NONNULL(equal);
  *equal = false;
  if (a->dtype != b->dtype || !tensor_same_shape(a, b)) return STATUS_OK;
  FSDPC_TRY(tensor_check_memory("equal", a));
  FSDPC_TRY(tensor_check_memory("equal", b));
  fsdpc_status_t st = STATUS_OK;
  fsdpc_tensor_t ha = {0}, hb = {0};
  FSDPC_TRY_GOTO(st, tensor_clone(&ha, a, a->dtype, device_cpu()));
  FSDPC_TRY_GOTO(st, tensor_clone(&hb, b, b->dtype, device_cpu()));
  *equal = tensor_nbytes(&ha) == 0 || memcmp(ha.data, hb.data, tensor_nbytes(&ha)) == 0;
cleanup:
  tensor_free(&ha);
  tensor_free(&hb);
  return st;
}
