/*
 * Safetensors files: an 8-byte little-endian header length N, N bytes of JSON header
 * ({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}),
 * then the byte buffer the offsets index.
 *
 * The reader validates everything before use: header size (at most 100 MB), JSON shape,
 * known dtype names, non-negative shapes, offsets inside the file, size = numel x element
 * size, the buffer fully covered without gaps or overlaps, unique names, at most
 * TENSOR_MAX_DIMS dimensions. Only regular files are opened. Parsing and lookups by name take
 * O(n log n) in the number of tensors. Errors name the file and the tensor.
 *
 *   st_file_t *f;
 *   FSDPC_TRY(st_open("model.safetensors", &f));
 *   const st_info_t *w = st_find(f, "model.norm.weight");   // NULL if absent
 *   FSDPC_TRY(st_read(f, "model.norm.weight", &dst));             // dst has the stored shape
 *   st_close(f);
 *
 *   st_writer_t *w;
 *   FSDPC_TRY(st_writer_new(&w));
 *   FSDPC_TRY(st_writer_add(w, "model.norm.weight", &t));          // keeps a reference to t
 *   FSDPC_TRY(st_writer_set_metadata(w, "format", "pt"));
 *   FSDPC_TRY(st_writer_save(w, "out.safetensors"));               // temporary file + rename
 *   st_writer_free(w);
 */
#ifndef FSDPC_CHECKPOINT_SAFETENSORS_H
#define FSDPC_CHECKPOINT_SAFETENSORS_H

#include <stdint.h>

#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* Dimensions are bounded in one place, the tensors' own: a file declaring more is refused. */
#define ST_MAX_DIMS TENSOR_MAX_DIMS
#define ST_MAX_HEADER (100u * 1000u * 1000u)

typedef struct st_info {
  const char *name;
  const char *dtype_name; /* as stored: "F32", "BF16", "U8", ... */
  dtype_t dtype;          /* DTYPE_COUNT when the library's tensors cannot hold it */
  size_t elem_size;
  int ndim;
  int64_t shape[ST_MAX_DIMS];
  uint64_t begin, end; /* byte range within the data buffer */
} st_info_t;

typedef struct st_file st_file_t;

/* Opens and validates a file; the file stays open until st_close. */
fsdpc_status_t st_open(const char *path, st_file_t **out);
void st_close(st_file_t *f);

const char *st_path(const st_file_t *f);
int st_num_tensors(const st_file_t *f);
/* Tensor i in file order (sorted by offset); NULL for i outside [0, st_num_tensors). */
const st_info_t *st_tensor(const st_file_t *f, int i);
const st_info_t *st_find(const st_file_t *f, const char *name);
/* Value of a __metadata__ key, or NULL. */
const char *st_metadata(const st_file_t *f, const char *key);

/* Reads tensor name into dst, which must have the stored shape (any dtype: converted; any
 * device). */
fsdpc_status_t st_read(st_file_t *f, const char *name, fsdpc_tensor_t *dst);

/* Reads the box [offset, offset + dst->shape) of tensor name into dst (any dtype and device),
 * reading only the rows of the box from the file. */
fsdpc_status_t st_read_box(st_file_t *f, const char *name, const int64_t *offset,
                           fsdpc_tensor_t *dst);
/* The same, the stored tensor read as if of shape as_shape (as_ndim dimensions, the same
 * number of elements: its row-major bytes reinterpreted, as a view would). */
fsdpc_status_t st_read_box_as(st_file_t *f, const char *name, int as_ndim, const int64_t *as_shape,
                              const int64_t *offset, fsdpc_tensor_t *dst);

/* Tensor data bytes read from the file so far; the bytes before the data (length + header). */
uint64_t st_bytes_read(const st_file_t *f);
uint64_t st_header_bytes(const st_file_t *f);

/* Reads the raw bytes of tensor name (bytes must equal its size). */
fsdpc_status_t st_read_raw(st_file_t *f, const char *name, void *buf, size_t bytes);
/* Reads bytes [pos, pos + bytes) of tensor name's stored data (inside it). */
fsdpc_status_t st_read_bytes(st_file_t *f, const char *name, uint64_t pos, void *buf, size_t bytes);
/* st_read_bytes of the bytes already in the page cache, without waiting for storage: how many
 * of the first bytes it read, all of them or a multiple of unit (0 when fewer than unit were
 * cached, or the system cannot tell; read the rest with st_read_bytes). Only those count as
 * read. */
size_t st_read_cached(st_file_t *f, const char *name, uint64_t pos, void *buf, size_t bytes,
                      size_t unit);

/* The stored name of a dtype ("F32", "BF16", ...), or NULL. */
const char *st_dtype_name(dtype_t dtype);

typedef struct st_writer st_writer_t;

fsdpc_status_t st_writer_new(st_writer_t **out);
void st_writer_free(st_writer_t *w);
/* Adds a tensor (any device; stored in its dtype). Names are unique; the writer keeps a
 * reference to t's memory until it is freed. */
fsdpc_status_t st_writer_add(st_writer_t *w, const char *name, const fsdpc_tensor_t *t);
fsdpc_status_t st_writer_set_metadata(st_writer_t *w, const char *key, const char *value);
/* Writes the file to path + ".tmp", flushes it to disk and renames it over path. */
fsdpc_status_t st_writer_save(st_writer_t *w, const char *path);

/* Streaming, for files larger than memory: declare every tensor (name, dtype, shape), begin
 * (writes the header to path + ".tmp"), write each tensor in declaration order (any device,
 * any layout), finish (flush, fsync, rename over path). A writer freed before finish removes
 * its temporary file. */
fsdpc_status_t st_writer_declare(st_writer_t *w, const char *name, dtype_t dtype, int ndim,
                                 const int64_t *shape);
fsdpc_status_t st_writer_begin(st_writer_t *w, const char *path);
fsdpc_status_t st_writer_write(st_writer_t *w, const char *name, const fsdpc_tensor_t *t);
fsdpc_status_t st_writer_finish(st_writer_t *w);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
