#include "nn/data.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/file.h"

struct data {
  uint16_t *tokens;
  int64_t n;
  int64_t max_token;
};

status_t data_open(data_t **out, const char *path, data_format_t format) {
  *out = NULL;
  FILE *f;
  TRY(file_open_regular(path, "data file", &f));
  status_t st = STATUS_OK;
  unsigned char *raw = NULL;
  data_t *d = NULL;
  long size = -1;
  if (fseek(f, 0, SEEK_END) == 0) size = ftell(f);
  if (size < 0 || fseek(f, 0, SEEK_SET) != 0)
    TRY_GOTO(st, err_set(STATUS_EIO, "data file %s: cannot determine its size", path));
  if (format == DATA_U16 && size % 2 != 0)
    TRY_GOTO(st, err_set(STATUS_EFORMAT,
                         "data file %s: %ld bytes is not a whole number of "
                         "uint16 tokens",
                         path, size));
  if ((raw = malloc((size_t)size + 1)) == NULL || (d = calloc(1, sizeof *d)) == NULL)
    TRY_GOTO(st, err_set(STATUS_ENOMEM, "data file %s: out of host memory", path));
  if (fread(raw, 1, (size_t)size, f) != (size_t)size)
    TRY_GOTO(st, err_set(STATUS_EIO, "data file %s: short read", path));
  d->n = format == DATA_U16 ? size / 2 : size;
  if ((d->tokens = malloc(sizeof(uint16_t) * (size_t)(d->n + 1))) == NULL)
    TRY_GOTO(st, err_set(STATUS_ENOMEM, "data file %s: out of host memory", path));
  for (int64_t i = 0; i < d->n; i++) {
    d->tokens[i] = format == DATA_U16 ? (uint16_t)(raw[2 * i] | (raw[2 * i + 1] << 8)) : raw[i];
    if (d->tokens[i] > d->max_token) d->max_token = d->tokens[i];
  }
  free(raw);
  fclose(f);
  *out = d;
  return STATUS_OK;
cleanup:
  free(raw);
  data_free(d);
  fclose(f);
  return st;
}

void data_free(data_t *d) {
  if (d == NULL) return;
  free(d->tokens);
  free(d);
}

int64_t data_num_tokens(const data_t *d) { return d->n; }
int64_t data_max_token(const data_t *d) { return d->max_token; }

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
  int64_t shape[2] = {spec->batch_size, spec->seq_len};
  TRY(tensor_init(inputs, DTYPE_I64, device_cpu(), 2, shape));
  status_t st = tensor_init(targets, DTYPE_I64, device_cpu(), 2, shape);
  if (st != STATUS_OK) {
    tensor_free(inputs);
    return st;
  }
  int64_t *in = inputs->data, *tg = targets->data;
  for (int64_t b = 0; b < spec->batch_size; b++) {
    int64_t s = data_sample_start(d, spec, step, micro, spec->dp_rank * spec->batch_size + b);
    for (int64_t t = 0; t < spec->seq_len; t++) {
      in[b * spec->seq_len + t] = d->tokens[s + t];
      tg[b * spec->seq_len + t] = d->tokens[s + t + 1];
    }
  }
  return STATUS_OK;
}
