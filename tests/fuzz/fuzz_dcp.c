/* libFuzzer harness: checkpoint folders (dcp_reader_*). The input is two shard files: a 4-byte
 * little-endian length, the first file, then the second; they are written into a folder that
 * is opened, listed, verified, and read as the first half of every tensor's rows. */
#include <string.h>
#include <sys/stat.h>

#include "checkpoint/dcp.h"
#include "tests/fuzz/fuzz_util.h"

static char dir[64];

static void put(const char *name, const uint8_t *data, size_t size) {
  char path[128];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  if (f == NULL || (size && fwrite(data, 1, size, f) != size)) abort();
  fclose(f);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (dir[0] == 0) {
    snprintf(dir, sizeof dir, "/dev/shm/fsdpc-fuzz-dcp-%d", (int)getpid());
    mkdir(dir, 0700);
  }
  if (size < 4) return 0;
  size_t a = (size_t)data[0] | (size_t)data[1] << 8 | (size_t)data[2] << 16 | (size_t)data[3] << 24;
  if (a > size - 4) a = size - 4;
  put("shard-00000.safetensors", data + 4, a);
  put("shard-00001.safetensors", data + 4 + a, size - 4 - a);
  dcp_reader_t *r;
  if (dcp_reader_open(dir, &r) == STATUS_OK) {
    const dcp_tensor_t *t;
    int n;
    (void)dcp_reader_list(r, &t, &n);
    for (int i = 0; i < n; i++) {
      int ok, none;
      (void)dcp_reader_verify(r, t[i].name, &ok, &none);
      int64_t numel = 1, rows[TENSOR_MAX_DIMS], off[TENSOR_MAX_DIMS] = {0};
      for (int d = 0; d < t[i].ndim; d++) {
        numel *= t[i].shape[d];
        rows[d] = d == 0 ? (t[i].shape[0] + 1) / 2 : t[i].shape[d];
      }
      if (t[i].dtype == DTYPE_COUNT || numel > (1 << 20)) continue;
      fsdpc_tensor_t x;
      if (tensor_init(&x, DTYPE_F32, device_cpu(), t[i].ndim, rows) != STATUS_OK) continue;
      (void)dcp_reader_read_box(r, t[i].name, t[i].ndim, t[i].shape, off, &x);
      tensor_free(&x);
    }
    dcp_reader_close(r);
  }
  return 0;
}
