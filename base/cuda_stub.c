/* Stand-ins for the CUDA entry points when the library is built without CUDA: no device is
 * ever present, so device_check() refuses CUDA devices before any of these can be reached. */
#include "base/backend.h"
#include "base/kernels_impl.h"

const backend_t *cuda_backend(void) { return NULL; }
int cuda_device_count(void) { return 0; }

status_t cuda_memcpy(device_t dst_dev, void *dst, device_t src_dev, const void *src, size_t bytes) {
  (void)dst_dev, (void)dst, (void)src_dev, (void)src, (void)bytes;
  return err_set(STATUS_ENODEV, "built without CUDA");
}

stream_t *cuda_stream_current(int index) {
  (void)index;
  return NULL;
}
void cuda_stream_set_current(int index, stream_t *s) { (void)index, (void)s; }
status_t cuda_stream_new(int index, stream_t **out) {
  (void)index;
  *out = NULL;
  return err_set(STATUS_ENODEV, "built without CUDA");
}
void cuda_stream_free(stream_t *s) { (void)s; }
status_t cuda_stream_wait_event(stream_t *s, event_t *e) {
  (void)s, (void)e;
  return STATUS_OK;
}
status_t cuda_stream_synchronize(stream_t *s) {
  (void)s;
  return STATUS_OK;
}
status_t cuda_event_new(int index, event_t **out) {
  (void)index;
  *out = NULL;
  return err_set(STATUS_ENODEV, "built without CUDA");
}
void cuda_event_free(event_t *e) { (void)e; }
status_t cuda_event_record(event_t *e, stream_t *s) {
  (void)e, (void)s;
  return STATUS_OK;
}
status_t cuda_event_synchronize(event_t *e) {
  (void)e;
  return STATUS_OK;
}

const kernel_ops_t *cuda_kernels(void) { return NULL; }
