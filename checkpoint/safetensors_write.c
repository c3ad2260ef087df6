/* The safetensors writer: tensors declared, then written in order (streamed, one at a time),
 * behind a header whose data starts 64-byte aligned. */
#include <cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/args_impl.h"
#include "core/file.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/safetensors_meta_impl.h"

typedef struct wentry {
  char *name;
  fsdpc_tensor_t t; /* contiguous; empty for a declared tensor (written by st_writer_write) */
  bool declared; /* st_writer_declare: no data held */
  dtype_t dtype;
  int ndim;
  int64_t shape[TENSOR_MAX_DIMS];
} wentry_t;

struct st_writer {
  wentry_t *e;
  int n, cap;
  st_meta_t *meta;
  int n_meta;
  FILE *fp;   /* between st_writer_begin and st_writer_finish */
  char *path; /* the file being written, and its temporary */
  char *tmp;
  int next; /* the entry st_writer_write expects */
};

fsdpc_status_t st_writer_new(st_writer_t **out) {
  ARG_NONNULL(out);
  *out = calloc(1, sizeof(st_writer_t));
  return *out ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
}

void st_writer_free(st_writer_t *w) {
  if (w == NULL) return;
  if (w->fp) { /* begun, never finished: the file is abandoned */
    fclose(w->fp);
    remove(w->tmp);
  }
  free(w->path);
  free(w->tmp);
  for (int i = 0; i < w->n; i++) {
    free(w->e[i].name);
    tensor_free(&w->e[i].t);
  }
  free(w->e);
  st_meta_free(w->meta, w->n_meta);
  free(w);
}

/* Appends an entry for name (checked), to be filled by the caller. */
static fsdpc_status_t add_entry(st_writer_t *w, const char *name, dtype_t dtype, int ndim,
                                wentry_t **out) {
  if (w->fp != NULL) return err_set(STATUS_EINVAL, "safetensors: tensors added after begin");
  if (name == NULL || name[0] == '\0' || strcmp(name, "__metadata__") == 0)
    return err_set(STATUS_EINVAL, "safetensors: invalid tensor name");
  if (st_dtype_name(dtype) == NULL)
    return err_set(STATUS_EDTYPE, "safetensors: tensor '%s' has an unsupported dtype", name);
  if (ndim < 0 || ndim > TENSOR_MAX_DIMS)
    return err_set(STATUS_ESHAPE, "safetensors: tensor '%s' has %d dimensions", name, ndim);
  for (int i = 0; i < w->n; i++)
    if (strcmp(w->e[i].name, name) == 0)
      return err_set(STATUS_EINVAL, "safetensors: tensor '%s' added twice", name);
  ARRAY_GROW(w->e, w->n, w->cap, 16, "safetensors");
  wentry_t *e = &w->e[w->n];
  memset(e, 0, sizeof *e);
  if ((e->name = strdup(name)) == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  e->dtype = dtype;
  e->ndim = ndim;
  *out = e;
  return STATUS_OK;
}

fsdpc_status_t st_writer_add(st_writer_t *w, const char *name, const fsdpc_tensor_t *t) {
  ARG_NONNULL(w);
  ARG_NONNULL(name);
  ARG_NONNULL(t);
  char what[160];
  snprintf(what, sizeof what, "safetensors: tensor '%.120s'", name);
  FSDPC_TRY(tensor_check_memory(what, t)); /* a meta model's: no values to save */
  wentry_t *e = NULL;
  FSDPC_TRY(add_entry(w, name, t->dtype, t->ndim, &e));
  memcpy(e->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
  fsdpc_status_t st =
      tensor_is_contiguous(t) ? tensor_ref(&e->t, t) : tensor_clone(&e->t, t, t->dtype, t->device);
  if (st != STATUS_OK) {
    free(e->name);
    return st;
  }
  w->n++;
  return STATUS_OK;
}

fsdpc_status_t st_writer_declare(st_writer_t *w, const char *name, dtype_t dtype, int ndim,
                                 const int64_t *shape) {
  ARG_NONNULL(w);
  ARG_NONNULL(name);
  if (ndim > 0) ARG_NONNULL(shape);
  wentry_t *e = NULL;
  FSDPC_TRY(add_entry(w, name, dtype, ndim, &e));
  for (int d = 0; d < ndim; d++) {
    if (shape[d] < 0) {
      free(e->name);
      return err_set(STATUS_ESHAPE, "safetensors: tensor '%s' has a negative size", name);
    }
    e->shape[d] = shape[d];
  }
  e->declared = true;
  w->n++;
  return STATUS_OK;
}

fsdpc_status_t st_writer_set_metadata(st_writer_t *w, const char *key, const char *value) {
  ARG_NONNULL(w);
  ARG_NONNULL(key);
  ARG_NONNULL(value);
  int i = st_meta_find(w->meta, w->n_meta, key);
  if (i >= 0) {
    char *v = strdup(value);
    if (v == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
    free(w->meta[i].value);
    w->meta[i].value = v;
    return STATUS_OK;
  }
  st_meta_t *p = realloc(w->meta, sizeof(st_meta_t) * (size_t)(w->n_meta + 1));
  if (p == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  w->meta = p;
  st_meta_t *m = &w->meta[w->n_meta];
  m->key = strdup(key);
  m->value = strdup(value);
  if (m->key == NULL || m->value == NULL) {
    free(m->key);
    free(m->value);
    return err_set(STATUS_ENOMEM, "out of host memory");
  }
  w->n_meta++;
  return STATUS_OK;
}

static cJSON *raw_u64(uint64_t v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
  return cJSON_CreateRaw(buf);
}

/* The header JSON, padded with spaces so that the data starts 64 bytes aligned in the file
 * (8-byte length + header: a multiple of 64): a read of a tensor into 64-byte-aligned memory
 * then copies whole cache lines. */
static fsdpc_status_t build_header(const st_writer_t *w, char **out, size_t *len) {
  cJSON *root = cJSON_CreateObject();
  bool ok = root != NULL; /* every item added: a header missing one would misplace the data */
  if (ok && w->n_meta > 0) {
    cJSON *m = cJSON_AddObjectToObject(root, "__metadata__");
    ok = m != NULL;
    for (int i = 0; ok && i < w->n_meta; i++)
      ok = cJSON_AddStringToObject(m, w->meta[i].key, w->meta[i].value) != NULL;
  }
  uint64_t pos = 0;
  for (int i = 0; ok && i < w->n; i++) {
    const wentry_t *e = &w->e[i];
    cJSON *o = cJSON_AddObjectToObject(root, e->name);
    cJSON *sh = o ? cJSON_AddArrayToObject(o, "shape") : NULL;
    ok = sh != NULL && cJSON_AddStringToObject(o, "dtype", st_dtype_name(e->dtype)) != NULL;
    uint64_t numel = 1;
    for (int d = 0; ok && d < e->ndim; d++) {
      ok = cJSON_AddItemToArray(sh, raw_u64((uint64_t)e->shape[d]));
      numel *= (uint64_t)e->shape[d];
    }
    cJSON *off = ok ? cJSON_AddArrayToObject(o, "data_offsets") : NULL;
    uint64_t end = pos + numel * dtype_size(e->dtype);
    ok = off != NULL && cJSON_AddItemToArray(off, raw_u64(pos)) &&
         cJSON_AddItemToArray(off, raw_u64(end));
    pos = end;
  }
  char *text = ok ? cJSON_PrintUnformatted(root) : NULL;
  cJSON_Delete(root);
  if (text == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  size_t n = strlen(text), padded = ((n + 8 + 63) & ~(size_t)63) - 8;
  if (padded > ST_MAX_HEADER) { /* no reader would open the file */
    free(text);
    return err_set(STATUS_EINVAL,
                   "safetensors: a header of %zu bytes, more than the %u a reader takes (%d "
                   "tensors)",
                   padded, ST_MAX_HEADER, w->n);
  }
  char *buf = realloc(text, padded + 1);
  if (buf == NULL) {
    free(text);
    return err_set(STATUS_ENOMEM, "out of host memory");
  }
  memset(buf + n, ' ', padded - n);
  buf[padded] = '\0';
  *out = buf;
  *len = padded;
  return STATUS_OK;
}

static fsdpc_status_t write_all(FILE *fp, const char *path, const void *p, size_t n) {
  if (n && fwrite(p, 1, n, fp) != n)
    return err_set(STATUS_EIO, "%s: write failed: %s", path, strerror(errno));
  return STATUS_OK;
}

fsdpc_status_t st_writer_begin(st_writer_t *w, const char *path) {
  ARG_NONNULL(w);
  ARG_NONNULL(path);
  if (w->fp != NULL) return err_set(STATUS_EINVAL, "safetensors: %s: already begun", w->path);
  char *header = NULL;
  size_t hlen = 0;
  FSDPC_TRY(build_header(w, &header, &hlen));
  fsdpc_status_t st = STATUS_OK;
  free(w->path);
  free(w->tmp);
  w->path = strdup(path);
  w->tmp = malloc(strlen(path) + 5);
  if (w->path == NULL || w->tmp == NULL)
    FSDPC_TRY_GOTO(st, err_set(STATUS_ENOMEM, "out of host memory"));
  sprintf(w->tmp, "%s.tmp", path);
  if ((w->fp = fopen(w->tmp, "wb")) == NULL)
    FSDPC_TRY_GOTO(st, err_set(STATUS_EIO, "%s: %s", w->tmp, strerror(errno)));
  unsigned char len8[8];
  for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
  FSDPC_TRY_GOTO(st, write_all(w->fp, w->tmp, len8, 8));
  FSDPC_TRY_GOTO(st, write_all(w->fp, w->tmp, header, hlen));
  w->next = 0;
cleanup:
  free(header);
  if (st != STATUS_OK && w->fp) {
    fclose(w->fp);
    w->fp = NULL;
    remove(w->tmp);
  }
  return st;
}

fsdpc_status_t st_writer_write(st_writer_t *w, const char *name, const fsdpc_tensor_t *t) {
  ARG_NONNULL(w);
  ARG_NONNULL(name);
  ARG_NONNULL(t);
  if (w->fp == NULL) return err_set(STATUS_EINVAL, "safetensors: write before begin");
  if (w->next >= w->n || strcmp(w->e[w->next].name, name) != 0)
    return err_set(STATUS_EINVAL, "safetensors: %s: expected tensor '%s', got '%s'", w->path,
                   w->next < w->n ? w->e[w->next].name : "(none)", name);
  const wentry_t *e = &w->e[w->next];
  if (t->dtype != e->dtype || t->ndim != e->ndim ||
      memcmp(t->shape, e->shape, sizeof(int64_t) * (size_t)e->ndim) != 0)
    return err_set(STATUS_ESHAPE, "safetensors: %s: tensor '%s' differs from its declaration",
                   w->path, name);
  char what[160];
  snprintf(what, sizeof what, "safetensors: tensor '%.120s'", name);
  FSDPC_TRY(tensor_check_memory(what, t));
  fsdpc_status_t st = STATUS_OK;
  if (t->device.type == DEVICE_CPU && tensor_is_contiguous(t)) {
    st = write_all(w->fp, w->tmp, t->data, tensor_nbytes(t));
  } else {
    fsdpc_tensor_t host;
    FSDPC_TRY(tensor_clone(&host, t, t->dtype, device_cpu()));
    st = write_all(w->fp, w->tmp, host.data, tensor_nbytes(&host));
    tensor_free(&host);
  }
  if (st == STATUS_OK) w->next++;
  return st;
}

fsdpc_status_t st_writer_finish(st_writer_t *w) {
  ARG_NONNULL(w);
  if (w->fp == NULL) return err_set(STATUS_EINVAL, "safetensors: finish before begin");
  fsdpc_status_t st = STATUS_OK;
  if (w->next != w->n)
    st =
        err_set(STATUS_EINVAL, "safetensors: %s: %d of %d tensors written", w->path, w->next, w->n);
  else if (fflush(w->fp) != 0 || fsync(fileno(w->fp)) != 0)
    st = err_set(STATUS_EIO, "%s: flush failed: %s", w->tmp, strerror(errno));
  int rc = fclose(w->fp);
  w->fp = NULL;
  if (st == STATUS_OK && rc != 0) st = err_set(STATUS_EIO, "%s: close failed", w->tmp);
  if (st == STATUS_OK && rename(w->tmp, w->path) != 0)
    st = err_set(STATUS_EIO, "rename %s -> %s: %s", w->tmp, w->path, strerror(errno));
  if (st != STATUS_OK) remove(w->tmp);
  return st;
}

fsdpc_status_t st_writer_save(st_writer_t *w, const char *path) {
  ARG_NONNULL(w);
  ARG_NONNULL(path);
  for (int i = 0; i < w->n; i++)
    if (w->e[i].declared)
      return err_set(STATUS_EINVAL, "safetensors: tensor '%s' was declared, not added",
                     w->e[i].name);
  FSDPC_TRY(st_writer_begin(w, path));
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < w->n && st == STATUS_OK; i++)
    st = st_writer_write(w, w->e[i].name, &w->e[i].t);
  if (st == STATUS_OK) return st_writer_finish(w);
  fclose(w->fp);
  w->fp = NULL;
  remove(w->tmp);
  return st;
}
