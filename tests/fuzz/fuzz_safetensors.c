/* libFuzzer harness: the safetensors reader. A file that opens has every tensor read whole and
 * as a box of its second half, into f32. */
#include "checkpoint/safetensors.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char path[64];
  int fd = fuzz_file(data, size, path, sizeof path);
  st_file_t *f;
  if (st_open(path, &f) == STATUS_OK) {
    for (int i = 0; i < st_num_tensors(f); i++) {
      const st_info_t *t = st_tensor(f, i);
      int64_t numel = 1, off[ST_MAX_DIMS] = {0}, half[ST_MAX_DIMS];
      for (int d = 0; d < t->ndim; d++) numel *= t->shape[d];
      if (t->dtype == DTYPE_COUNT || numel > (1 << 20)) continue;
      fsdpc_tensor_t x;
      if (tensor_init(&x, DTYPE_F32, device_cpu(), t->ndim, t->shape) != STATUS_OK) continue;
      (void)st_read(f, t->name, &x);
      tensor_free(&x);
      for (int d = 0; d < t->ndim; d++) {
        half[d] = t->shape[d] - t->shape[d] / 2;
        off[d] = t->shape[d] / 2;
      }
      if (tensor_init(&x, DTYPE_F32, device_cpu(), t->ndim, half) != STATUS_OK) continue;
      (void)st_read_box(f, t->name, off, &x);
      tensor_free(&x);
    }
    st_close(f);
  }
  close(fd);
  return 0;
}
