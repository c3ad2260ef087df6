#include "nn/data.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/file.h"

/* The file stays open for the run and is read where a batch or a check needs it: no rank holds
 * more of it than a batch, and ranks on one node share the operating system's page cache. */
struct data {
  FILE *f;
  char *path; /* for messages */
  int width;  /* bytes per token */
  int64_t n;
};

static int width_of(data_format_t format) {
  switch (format) {
    case DATA_BYTES: return 1;
    case DATA_U16: return 2;
    case DATA_U32: return 4;
  }
  return 0;
}

status_t data_open(data_t **out, const char *path, data_format_t format) {
  *out = NULL;
  int width = width_of(format);
  if (width == 0)
    return err_set(STATUS_EINVAL, "data file %s: unknown format %d", path, (int)format);
  FILE *f;
  TRY(file_open_regular(path, "data file", &f));
  struct stat sb;
  if (fstat(fileno(f), &sb) != 0) {
    int e = errno;
    fclose(f);
    return err_set(STATUS_EIO, "data file %s: %s", path, strerror(e));
  }
  if (sb.st_size % width != 0) {
    fclose(f);
    return err_set(STATUS_EFORMAT,
                   "data file %s: %lld bytes is not a whole number of uint%d tokens", path,
                   (long long)sb.st_size, 8 * width);
  }
  data_t *d = calloc(1, sizeof *d);
  char *copy = strdup(path);
  if (d == NULL || copy == NULL) {
    free(d);
    free(copy);
    fclose(f);
    return err_set(STATUS_ENOMEM, "data file %s: out of host memory", path);
  }
  d->f = f;
  d->path = copy;
  d->width = width;
  d->n = sb.st_size / width;
  *out = d;
  return STATUS_OK;
}

void data_free(data_t *d) {
  if (d == NULL) return;
  fclose(d->f);
  free(d->path);
  free(d);
}

int64_t data_num_tokens(const data_t *d) { return d->n; }

/* Reads bytes [at, at + n) of the file into buf; tokens [first, first + count) name them in
 * errors. */
static status_t read_bytes(const data_t *d, off_t at, size_t n, unsigned char *buf, int64_t first,
                           int64_t count) {
  for (size_t got = 0; got < n;) {
    ssize_t r = pread(fileno(d->f), buf + got, n - got, at + (off_t)got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return err_set(STATUS_EIO, "data file %s: cannot read tokens %lld-%lld: %s", d->path,
                     (long long)first, (long long)(first + count - 1),
                     r < 0 ? strerror(errno) : "the file is shorter than when it was opened");
    got += (size_t)r;
  }
  return STATUS_OK;
}

/* Token i of buf, little-endian of width w. */
static inline int64_t token_at(const unsigned char *buf, int w, int64_t i) {
  const unsigned char *b = buf + i * w;
  switch (w) {
    case 1: return b[0];
    case 2: return b[0] | (int64_t)b[1] << 8;
    default: return b[0] | (int64_t)b[1] << 8 | (int64_t)b[2] << 16 | (int64_t)b[3] << 24;
  }
}

/* The largest of the k tokens of width w in buf (-1 for none); a loop per width, so that each
 * vectorises. */
static int64_t max_of(const unsigned char *buf, int w, int64_t k) {
  if (k == 0) return -1;
  if (w == 1) {
    unsigned char m = 0;
    for (int64_t i = 0; i < k; i++) m = buf[i] > m ? buf[i] : m;
    return m;
  }
  if (w == 2) {
    uint16_t m = 0;
    for (int64_t i = 0; i < k; i++) {
      uint16_t v = (uint16_t)(buf[2 * i] | buf[2 * i + 1] << 8);
      m = v > m ? v : m;
    }
    return m;
  }
  uint32_t m = 0;
  for (int64_t i = 0; i < k; i++) {
    uint32_t v = buf[4 * i] | (uint32_t)buf[4 * i + 1] << 8 | (uint32_t)buf[4 * i + 2] << 16 |
                 (uint32_t)buf[4 * i + 3] << 24;
    m = v > m ? v : m;
  }
  return m;
}

/* Reads tokens [i0, i0 + count) into out. */
static status_t read_tokens(const data_t *d, int64_t i0, int64_t count, int64_t *out) {
  unsigned char buf[1 << 14];
  int64_t per = (int64_t)sizeof buf / d->width;
  for (int64_t done = 0; done < count;) {
    int64_t k = count - done < per ? count - done : per;
    TRY(read_bytes(d, (off_t)((i0 + done) * d->width), (size_t)(k * d->width), buf, i0 + done, k));
    for (int64_t i = 0; i < k; i++) out[done + i] = token_at(buf, d->width, i);
    done += k;
  }
  return STATUS_OK;
}

status_t data_max_token(const data_t *d, int64_t begin, int64_t end, int64_t *max) {
  *max = -1;
  if (begin < 0 || end > d->n || begin > end)
    return err_set(STATUS_EINVAL, "data file %s: tokens [%lld, %lld) outside [0, %lld)", d->path,
                   (long long)begin, (long long)end, (long long)d->n);
  enum { kChunk = 1 << 20 }; /* bytes read at a time */
  unsigned char *buf = malloc(kChunk);
  if (buf == NULL) return err_set(STATUS_ENOMEM, "data file %s: out of host memory", d->path);
  int w = d->width;
  int64_t per = kChunk / w, m = -1;
  status_t st = STATUS_OK;
  for (int64_t i = begin; i < end && st == STATUS_OK; i += per) {
    int64_t k = end - i < per ? end - i : per;
    st = read_bytes(d, (off_t)(i * w), (size_t)(k * w), buf, i, k);
    int64_t v = st == STATUS_OK ? max_of(buf, w, k) : -1;
    m = v > m ? v : m;
  }
  free(buf);
  if (st == STATUS_OK) *max = m;
  return st;
}

int64_t data_sample_start(const data_t *d, const data_spec_t *spec, int64_t step, int64_t micro,
                          int64_t j) {
  int64_t G = spec->dp_size * spec->batch_size;
  int64_t span = d->n - spec->seq_len - 1;
  /* in 128 bits, so that long runs cannot overflow the product */
  __int128 start = ((__int128)(step * spec->grad_accum + micro) * G + j) * spec->seq_len;
  return (int64_t)(start % span);
}

status_t data_batch(const data_t *d, const data_spec_t *spec, int64_t step, int64_t micro,
                    tensor_t *inputs, tensor_t *targets) {
  if (spec->batch_size < 1 || spec->seq_len < 1 || spec->grad_accum < 1 || spec->dp_size < 1 ||
      spec->dp_rank < 0 || spec->dp_rank >= spec->dp_size)
    return err_set(STATUS_EINVAL,
                   "data: batch_size, seq_len, grad_accum, dp_size must be "
                   "positive and 0 <= dp_rank < dp_size");
  if (micro < 0 || micro >= spec->grad_accum || step < 0)
    return err_set(STATUS_EINVAL, "data: micro-step %lld outside [0, %lld)", (long long)micro,
                   (long long)spec->grad_accum);
  if (d->n < spec->seq_len + 2)
    return err_set(STATUS_EINVAL,
                   "data: %lld tokens cannot hold a sample of seq_len %lld plus "
                   "its targets",
                   (long long)d->n, (long long)spec->seq_len);
  int64_t L = spec->seq_len, shape[2] = {spec->batch_size, L};
  int64_t *row = malloc(sizeof(int64_t) * (size_t)(L + 1));
  if (row == NULL) return err_set(STATUS_ENOMEM, "data: out of host memory");
  status_t st = tensor_init(inputs, DTYPE_I64, device_cpu(), 2, shape);
  if (st == STATUS_OK &&
      (st = tensor_init(targets, DTYPE_I64, device_cpu(), 2, shape)) != STATUS_OK)
    tensor_free(inputs);
  for (int64_t b = 0; b < spec->batch_size && st == STATUS_OK; b++) {
    int64_t s = data_sample_start(d, spec, step, micro, spec->dp_rank * spec->batch_size + b);
    st = read_tokens(d, s, L + 1, row);
    if (st != STATUS_OK) {
      tensor_free(inputs);
      tensor_free(targets);
      break;
    }
    memcpy((int64_t *)inputs->data + b * L, row, sizeof(int64_t) * (size_t)L);
    memcpy((int64_t *)targets->data + b * L, row + 1, sizeof(int64_t) * (size_t)L);
  }
  free(row);
  return st;
}
