#define _GNU_SOURCE /* preadv2, RWF_NOWAIT */
#include "checkpoint/safetensors.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "core/args_impl.h"
#include "core/file.h"
#include "checkpoint/safetensors_meta_impl.h"

/* ---- dtypes ---- */

static const struct {
  const char *name;
  size_t size;
  dtype_t dtype;
} kDtypes[] = {
    {"F32", 4, DTYPE_F32},   {"BF16", 2, DTYPE_BF16},     {"F16", 2, DTYPE_F16},
    {"I32", 4, DTYPE_I32},   {"I64", 8, DTYPE_I64},       {"F64", 8, DTYPE_COUNT},
    {"U8", 1, DTYPE_COUNT},  {"I8", 1, DTYPE_COUNT},      {"BOOL", 1, DTYPE_COUNT},
    {"I16", 2, DTYPE_COUNT}, {"U16", 2, DTYPE_COUNT},     {"U32", 4, DTYPE_COUNT},
    {"U64", 8, DTYPE_COUNT}, {"F8_E4M3", 1, DTYPE_COUNT}, {"F8_E5M2", 1, DTYPE_COUNT},
};

static int dtype_index(const char *name) {
  for (size_t i = 0; i < sizeof kDtypes / sizeof kDtypes[0]; i++)
    if (strcmp(kDtypes[i].name, name) == 0) return (int)i;
  return -1;
}

static const char *dtype_st_name(dtype_t dt) {
  for (size_t i = 0; i < sizeof kDtypes / sizeof kDtypes[0]; i++)
    if (kDtypes[i].dtype == dt) return kDtypes[i].name;
  return NULL;
}

const char *st_dtype_name(dtype_t dtype) { return dtype_st_name(dtype); }

/* ---- reader ---- */

struct st_file {
  char *path;
  FILE *fp;
  uint64_t data_start, data_size;
  st_info_t *t;
  int n;
  int *by_name; /* indexes into t, sorted by name */
  st_meta_t *meta;
  int n_meta;
  uint64_t bytes_read; /* tensor data read so far */
};

void st_close(st_file_t *f) {
  if (f == NULL) return;
  if (f->fp) fclose(f->fp);
  for (int i = 0; i < f->n; i++) {
    free((char *)f->t[i].name);
  }
  st_meta_free(f->meta, f->n_meta);
  free(f->t);
  free(f->by_name);
  free(f->path);
  free(f);
}

static int cmp_begin(const void *a, const void *b) {
  const st_info_t *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

/* qsort has no context argument: the file whose index is being sorted (one parse at a time
 * per thread). */
static _Thread_local const st_file_t *g_sort_file;

static int cmp_name_index(const void *a, const void *b) {
  return strcmp(g_sort_file->t[*(const int *)a].name, g_sort_file->t[*(const int *)b].name);
}

static fsdpc_status_t parse_u64(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > 9007199254740992.0 ||
      v->valuedouble != floor(v->valuedouble))
    return STATUS_EFORMAT;
  *out = (uint64_t)v->valuedouble;
  return STATUS_OK;
}

static fsdpc_status_t parse_entry(st_file_t *f, const cJSON *item, st_info_t *t) {
  const char *p = f->path, *nm = item->string;
  if (!cJSON_IsObject(item))
    return err_set(STATUS_EFORMAT, "%s: entry '%s' is not an object", p, nm);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
  const cJSON *sh = cJSON_GetObjectItemCaseSensitive(item, "shape");
  const cJSON *off = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
  if (!cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(off))
    return err_set(STATUS_EFORMAT, "%s: tensor '%s' needs dtype, shape and data_offsets", p, nm);
  int di = dtype_index(dt->valuestring);
  if (di < 0)
    return err_set(STATUS_EFORMAT, "%s: tensor '%s' has unknown dtype '%s'", p, nm,
                   dt->valuestring);
  t->dtype_name = kDtypes[di].name;
  t->dtype = kDtypes[di].dtype;
  t->elem_size = kDtypes[di].size;
  t->ndim = cJSON_GetArraySize(sh);
  if (t->ndim > ST_MAX_DIMS)
    return err_set(STATUS_EFORMAT, "%s: tensor '%s' has %d dimensions; at most %d are supported",
                   p, nm, t->ndim, ST_MAX_DIMS);
  double numel = 1;
  for (int d = 0; d < t->ndim; d++) {
    uint64_t v;
    if (parse_u64(cJSON_GetArrayItem(sh, d), &v) != STATUS_OK)
      return err_set(STATUS_EFORMAT, "%s: tensor '%s' has a bad shape entry", p, nm);
    t->shape[d] = (int64_t)v;
    numel *= (double)v;
  }
  if (cJSON_GetArraySize(off) != 2 || parse_u64(cJSON_GetArrayItem(off, 0), &t->begin) ||
      parse_u64(cJSON_GetArrayItem(off, 1), &t->end) || t->end < t->begin)
    return err_set(STATUS_EFORMAT, "%s: tensor '%s' has bad data_offsets", p, nm);
  if (t->end > f->data_size)
    return err_set(STATUS_EFORMAT,
                   "%s: tensor '%s' ends at byte %llu, past the %llu-byte data "
                   "buffer (truncated file?)",
                   p, nm, (unsigned long long)t->end, (unsigned long long)f->data_size);
  if (numel * (double)t->elem_size != (double)(t->end - t->begin))
    return err_set(STATUS_EFORMAT,
                   "%s: tensor '%s' has %llu bytes, but its shape and dtype %s "
                   "need %.0f",
                   p, nm, (unsigned long long)(t->end - t->begin), t->dtype_name,
                   numel * (double)t->elem_size);
  if ((t->name = strdup(nm)) == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  return STATUS_OK;
}

static fsdpc_status_t parse_metadata(st_file_t *f, const cJSON *m) {
  if (!cJSON_IsObject(m))
    return err_set(STATUS_EFORMAT, "%s: __metadata__ is not an object", f->path);
  int n = cJSON_GetArraySize(m);
  if ((f->meta = calloc((size_t)(n ? n : 1), sizeof(st_meta_t))) == NULL)
    return err_set(STATUS_ENOMEM, "out of host memory");
  for (const cJSON *it = m->child; it; it = it->next) {
    if (!cJSON_IsString(it))
      return err_set(STATUS_EFORMAT, "%s: __metadata__ value of '%s' is not a string", f->path,
                     it->string);
    st_meta_t *e = &f->meta[f->n_meta++];
    if ((e->key = strdup(it->string)) == NULL || (e->value = strdup(it->valuestring)) == NULL)
      return err_set(STATUS_ENOMEM, "out of host memory");
  }
  return STATUS_OK;
}

/* Whether JSON text escapes a NUL character (\u0000), which a C string would end at: a name
 * that reads as another. */
static bool escapes_nul(const char *text) {
  for (const char *at = text; (at = strstr(at, "u0000")) != NULL; at++) {
    int slashes = 0;
    for (const char *b = at - 1; b >= text && *b == '\\'; b--) slashes++;
    if (slashes % 2 == 1) return true;
  }
  return false;
}

static fsdpc_status_t parse_header(st_file_t *f, const char *text) {
  if (escapes_nul(text))
    return err_set(STATUS_EFORMAT,
                   "%s: the header holds a NUL character (\\u0000) in a name or value, which "
                   "would read as another name",
                   f->path);
  const char *end = NULL;
  cJSON *root = cJSON_ParseWithOpts(text, &end, false);
  if (root == NULL || !cJSON_IsObject(root)) {
    cJSON_Delete(root);
    return err_set(STATUS_EFORMAT, "%s: header is not a JSON object", f->path);
  }
  while (end != NULL && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
    end++; /* the format pads the header with spaces */
  if (end != NULL && *end != '\0') {
    cJSON_Delete(root);
    return err_set(STATUS_EFORMAT, "%s: the header has bytes after its JSON object (at '%.16s')",
                   f->path, end);
  }
  fsdpc_status_t st = STATUS_OK;
  int total = cJSON_GetArraySize(root);
  if ((f->t = calloc((size_t)(total ? total : 1), sizeof(st_info_t))) == NULL)
    FSDPC_TRY_GOTO(st, err_set(STATUS_ENOMEM, "out of host memory"));
  for (const cJSON *it = root->child; it; it = it->next) {
    if (strcmp(it->string, "__metadata__") == 0) {
      if (f->meta != NULL)
        FSDPC_TRY_GOTO(st, err_set(STATUS_EFORMAT, "%s: __metadata__ appears twice", f->path));
      FSDPC_TRY_GOTO(st, parse_metadata(f, it));
      continue;
    }
    FSDPC_TRY_GOTO(st, parse_entry(f, it, &f->t[f->n]));
    f->n++;
  }
  qsort(f->t, (size_t)f->n, sizeof(st_info_t), cmp_begin);
  if ((f->by_name = malloc(sizeof(int) * (size_t)(f->n ? f->n : 1))) == NULL)
    FSDPC_TRY_GOTO(st, err_set(STATUS_ENOMEM, "out of host memory"));
  for (int i = 0; i < f->n; i++) f->by_name[i] = i;
  g_sort_file = f;
  qsort(f->by_name, (size_t)f->n, sizeof(int), cmp_name_index);
  for (int i = 1; i < f->n; i++)
    if (strcmp(f->t[f->by_name[i - 1]].name, f->t[f->by_name[i]].name) == 0)
      FSDPC_TRY_GOTO(st, err_set(STATUS_EFORMAT, "%s: tensor '%s' appears twice", f->path,
                                 f->t[f->by_name[i]].name));
  uint64_t pos = 0;
  for (int i = 0; i < f->n; i++) {
    if (f->t[i].begin != pos)
      FSDPC_TRY_GOTO(st, err_set(STATUS_EFORMAT,
                                 "%s: tensor '%s' starts at byte %llu, expected %llu "
                                 "(overlapping or non-contiguous data)",
                                 f->path, f->t[i].name, (unsigned long long)f->t[i].begin,
                                 (unsigned long long)pos));
    pos = f->t[i].end;
  }
  if (pos != f->data_size)
    FSDPC_TRY_GOTO(st, err_set(STATUS_EFORMAT,
                               "%s: tensors cover %llu bytes of a %llu-byte data "
                               "buffer",
                               f->path, (unsigned long long)pos, (unsigned long long)f->data_size));
cleanup:
  cJSON_Delete(root);
  return st;
}

fsdpc_status_t st_open(const char *path, st_file_t **out) {
  ARG_NONNULL(out);
  ARG_NONNULL(path);
  *out = NULL;
  st_file_t *f = calloc(1, sizeof *f);
  if (f == NULL || (f->path = strdup(path)) == NULL) {
    free(f);
    return err_set(STATUS_ENOMEM, "out of host memory");
  }
  fsdpc_status_t st = STATUS_OK;
  char *text = NULL;
  FSDPC_TRY_GOTO(st, file_open_regular(path, NULL, &f->fp));
  unsigned char len8[8];
  if (fread(len8, 1, 8, f->fp) != 8)
    FSDPC_TRY_GOTO(st, err_set(STATUS_EFORMAT, "%s: shorter than the 8-byte header length", path));
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | len8[i];
  if (fseeko(f->fp, 0, SEEK_END) != 0)
    FSDPC_TRY_GOTO(st, err_set(STATUS_EIO, "%s: cannot seek", path));
  off_t size = ftello(f->fp);
  if (n < 2 || n > ST_MAX_HEADER)
    FSDPC_TRY_GOTO(st, err_set(STATUS_EFORMAT, "%s: header length %llu outside [2, %u]", path,
                               (unsigned long long)n, ST_MAX_HEADER));
  if ((uint64_t)size < 8 + n)
    FSDPC_TRY_GOTO(st, err_set(STATUS_EFORMAT,
                               "%s: header of %llu bytes does not fit in the %lld-byte "
                               "file (truncated?)",
                               path, (unsigned long long)n, (long long)size));
  if ((text = malloc(n + 1)) == NULL)
    FSDPC_TRY_GOTO(st, err_set(STATUS_ENOMEM, "out of host memory"));
  if (fseeko(f->fp, 8, SEEK_SET) != 0 || fread(text, 1, n, f->fp) != n)
    FSDPC_TRY_GOTO(st, err_set(STATUS_EIO, "%s: cannot read the header", path));
  text[n] = '\0';
  if (text[0] != '{' || strlen(text) != n)
    FSDPC_TRY_GOTO(
        st,
        err_set(STATUS_EFORMAT,
                "%s: header is not a JSON object (no leading '{', or a NUL byte inside)", path));
  f->data_start = 8 + n;
  f->data_size = (uint64_t)size - f->data_start;
  FSDPC_TRY_GOTO(st, parse_header(f, text));
  free(text);
  *out = f;
  return STATUS_OK;
cleanup:
  free(text);
  st_close(f);
  return st;
}

const char *st_path(const st_file_t *f) {
  if (f == NULL) return "(null)";
  return f->path;
}
int st_num_tensors(const st_file_t *f) {
  if (f == NULL) return 0;
  return f->n;
}
const st_info_t *st_tensor(const st_file_t *f, int i) {
  if (f == NULL || i < 0 || i >= f->n) return NULL;
  return &f->t[i];
}

const st_info_t *st_find(const st_file_t *f, const char *name) {
  if (f == NULL || name == NULL) return NULL;
  int lo = 0, hi = f->n;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2, c = strcmp(f->t[f->by_name[mid]].name, name);
    if (c == 0) return &f->t[f->by_name[mid]];
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

const char *st_metadata(const st_file_t *f, const char *key) {
  if (f == NULL || key == NULL) return NULL;
  int i = st_meta_find(f->meta, f->n_meta, key);
  return i < 0 ? NULL : f->meta[i].value;
}

static fsdpc_status_t find_or_fail(st_file_t *f, const char *name, const st_info_t **out) {
  *out = st_find(f, name);
  if (*out == NULL) return err_set(STATUS_EFORMAT, "%s: no tensor '%s'", f->path, name);
  return STATUS_OK;
}

static fsdpc_status_t read_at(st_file_t *f, const char *name, uint64_t pos, void *buf,
                              size_t bytes) {
  if (bytes == 0) return STATUS_OK;
  if (fseeko(f->fp, (off_t)(f->data_start + pos), SEEK_SET) != 0 ||
      fread(buf, 1, bytes, f->fp) != bytes)
    return err_set(STATUS_EIO, "%s: reading tensor '%s' failed (truncated file?)", f->path, name);
  f->bytes_read += bytes;
  return STATUS_OK;
}

uint64_t st_bytes_read(const st_file_t *f) {
  if (f == NULL) return 0;
  return f->bytes_read;
}
uint64_t st_header_bytes(const st_file_t *f) {
  if (f == NULL) return 0;
  return f->data_start;
}

fsdpc_status_t st_read_raw(st_file_t *f, const char *name, void *buf, size_t bytes) {
  ARG_NONNULL(f);
  ARG_NONNULL(name);
  if (bytes > 0) ARG_NONNULL(buf);
  const st_info_t *t;
  FSDPC_TRY(find_or_fail(f, name, &t));
  if (bytes != t->end - t->begin)
    return err_set(STATUS_ESHAPE, "%s: tensor '%s' has %llu bytes, buffer has %zu", f->path, name,
                   (unsigned long long)(t->end - t->begin), bytes);
  return read_at(f, name, t->begin, buf, bytes);
}

/* Bytes [pos, pos + bytes) of tensor t's data lie inside it. */
static bool in_tensor(const st_info_t *t, uint64_t pos, size_t bytes) {
  return pos <= t->end - t->begin && bytes <= t->end - t->begin - pos;
}

fsdpc_status_t st_read_bytes(st_file_t *f, const char *name, uint64_t pos, void *buf,
                             size_t bytes) {
  ARG_NONNULL(f);
  ARG_NONNULL(name);
  if (bytes > 0) ARG_NONNULL(buf);
  const st_info_t *t;
  FSDPC_TRY(find_or_fail(f, name, &t));
  if (!in_tensor(t, pos, bytes))
    return err_set(STATUS_EINVAL, "%s: bytes %llu..%llu are outside tensor '%s' (%llu bytes)",
                   f->path, (unsigned long long)pos, (unsigned long long)(pos + bytes), name,
                   (unsigned long long)(t->end - t->begin));
  return read_at(f, name, t->begin + pos, buf, bytes);
}

size_t st_read_cached(st_file_t *f, const char *name, uint64_t pos, void *buf, size_t bytes,
                      size_t unit) {
  if (f == NULL || name == NULL || buf == NULL) return 0;
#ifdef RWF_NOWAIT
  const st_info_t *t = st_find(f, name);
  if (t == NULL || !in_tensor(t, pos, bytes)) return 0;
  struct iovec v = {buf, bytes};
  ssize_t n = preadv2(fileno(f->fp), &v, 1, (off_t)(f->data_start + t->begin + pos), RWF_NOWAIT);
  if (n <= 0 || unit == 0) return 0; /* EAGAIN: not cached; EOPNOTSUPP: cannot tell */
  size_t kept = (size_t)n == bytes ? bytes : (size_t)n / unit * unit;
  f->bytes_read += kept;
  return kept;
#else
  (void)f, (void)name, (void)pos, (void)buf, (void)bytes, (void)unit;
  return 0;
#endif
}

fsdpc_status_t st_read_box(st_file_t *f, const char *name, const int64_t *offset,
                           fsdpc_tensor_t *dst) {
  return st_read_box_as(f, name, -1, NULL, offset, dst);
}

fsdpc_status_t st_read_box_as(st_file_t *f, const char *name, int as_ndim, const int64_t *as_shape,
                              const int64_t *offset, fsdpc_tensor_t *dst) {
  ARG_NONNULL(f);
  ARG_NONNULL(name);
  ARG_NONNULL(offset);
  ARG_NONNULL(dst);
  const st_info_t *info;
  FSDPC_TRY(find_or_fail(f, name, &info));
  st_info_t view = *info; /* the tensor as read: its own shape, or as_shape */
  const st_info_t *t = &view;
  char a[96], b[96];
  if (as_shape != NULL) {
    int64_t n = 1;
    for (int d = 0; d < as_ndim; d++) n *= as_shape[d];
    if (as_ndim < 0 || as_ndim > ST_MAX_DIMS ||
        (uint64_t)n * info->elem_size != info->end - info->begin)
      return err_set(STATUS_ESHAPE, "%s: tensor '%s' of shape %s cannot be read as %s", f->path,
                     name, tensor_shape_str(info->ndim, info->shape, a, sizeof a),
                     tensor_shape_str(as_ndim, as_shape, b, sizeof b));
    view.ndim = as_ndim;
    memcpy(view.shape, as_shape, sizeof(int64_t) * (size_t)as_ndim);
  }
  if (t->dtype == DTYPE_COUNT)
    return err_set(STATUS_EDTYPE, "%s: tensor '%s' has dtype %s, which tensors cannot hold",
                   f->path, name, t->dtype_name);
  if (t->ndim != dst->ndim && !(t->ndim == 0 && dst->ndim == 1 && dst->shape[0] == 1))
    return err_set(STATUS_ESHAPE, "%s: tensor '%s' has shape %s, destination %s", f->path, name,
                   tensor_shape_str(t->ndim, t->shape, a, sizeof a),
                   tensor_shape_str(dst->ndim, dst->shape, b, sizeof b));
  int nd = t->ndim;
  for (int d = 0; d < nd; d++)
    if (offset[d] < 0 || offset[d] > t->shape[d] || dst->shape[d] > t->shape[d] - offset[d])
      return err_set(STATUS_ESHAPE,
                     "%s: box of %s at dimension %d is outside tensor '%s' of "
                     "shape %s",
                     f->path, tensor_shape_str(dst->ndim, dst->shape, b, sizeof b), d, name,
                     tensor_shape_str(t->ndim, t->shape, a, sizeof a));
  fsdpc_tensor_t host;
  FSDPC_TRY(tensor_init(&host, t->dtype, device_cpu(), dst->ndim, dst->shape));
  /* rows of the box: contiguous runs along the last dimension */
  int64_t rows = 1, run = nd ? dst->shape[nd - 1] : 1, idx[ST_MAX_DIMS] = {0};
  for (int d = 0; d + 1 < nd; d++) rows *= dst->shape[d];
  if (tensor_numel(dst) == 0) rows = 0;
  fsdpc_status_t st = STATUS_OK;
  for (int64_t r = 0; r < rows && st == STATUS_OK; r++) {
    uint64_t elem = 0;
    for (int d = 0; d < nd; d++)
      elem = elem * (uint64_t)t->shape[d] + (uint64_t)(offset[d] + (d + 1 < nd ? idx[d] : 0));
    st = read_at(f, name, t->begin + elem * t->elem_size,
                 (char *)host.data + (size_t)(r * run) * t->elem_size, (size_t)run * t->elem_size);
    for (int d = nd - 2; d >= 0; d--) {
      if (++idx[d] < dst->shape[d]) break;
      idx[d] = 0;
    }
  }
  if (st == STATUS_OK) st = tensor_copy(dst, &host);
  tensor_free(&host);
  return st;
}

fsdpc_status_t st_read(st_file_t *f, const char *name, fsdpc_tensor_t *dst) {
  ARG_NONNULL(f);
  ARG_NONNULL(name);
  ARG_NONNULL(dst);
  const st_info_t *t;
  FSDPC_TRY(find_or_fail(f, name, &t));
  bool same = t->ndim == dst->ndim;
  for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == dst->shape[d];
  if (!same) {
    char a[96], b[96];
    return err_set(STATUS_ESHAPE, "%s: tensor '%s' has shape %s, expected %s", f->path, name,
                   tensor_shape_str(t->ndim, t->shape, a, sizeof a),
                   tensor_shape_str(dst->ndim, dst->shape, b, sizeof b));
  }
  int64_t zero[ST_MAX_DIMS] = {0};
  return st_read_box(f, name, zero, dst);
}
