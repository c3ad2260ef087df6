/* Reads from an open checkpoint folder: whole chunks straight into place, parts of chunks in
 * groups of rows, every block a read touches checked (on the checker's thread while the next
 * bytes are read); loads under any plan, and verify. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "core/args_impl.h"
#include "checkpoint/dcp_reader_impl.h"

/* Reads go this many bytes at a time; a checked read's are whole blocks (at least one), each
 * piece handed to the checker as it arrives and hashed while the next is read. */
#define READ_JOB_BYTES ((uint64_t)16 << 20)
/* Bytes already in the page cache are read this many at a time (whole blocks, at least one): the
 * checker then hashes them while they are still in the CPU's caches. */
#define READ_CACHED_BYTES ((uint64_t)2 << 20)
/* The same when the reading thread hashes them itself (no helper): pieces that stay in its own
 * cache until they are hashed. */
#define READ_CACHED_INLINE ((uint64_t)256 << 10)
/* A partial read checks and copies this many bytes of rows at a time (at least one row), and
 * verify reads a chunk this many bytes at a time (whole blocks). */
#define READ_GROUP_BYTES (4 * READ_JOB_BYTES)

/* ---- checked reads ---- */

static fsdpc_status_t mismatch(const rfile_t *rf, const char *name, uint64_t size, uint64_t B,
                               uint64_t b) {
  uint64_t pos = b * B, end = pos + B < size ? pos + B : size;
  return err_set(STATUS_EFORMAT,
                 "%s: tensor '%s': checksum mismatch in block %llu of %llu (bytes %llu to %llu "
                 "of the chunk): the file is corrupt",
                 st_path(rf->f), name, (unsigned long long)b + 1,
                 (unsigned long long)dcp_blocks_of(size, B), (unsigned long long)pos,
                 (unsigned long long)end);
}

/* Reads bytes [lo, hi) of chunk c into buf, queueing every block they span for its check (see
 * checks_done): lo is at a block's start, hi at a block's end or the chunk's. */
static fsdpc_status_t read_blocks(const dcp_reader_t *r, const chunk_t *c, uint64_t lo, uint64_t hi,
                                  void *buf) {
  rfile_t *rf = &r->files[c->file];
  const char *name = c->info->name;
  uint64_t size = c->info->end - c->info->begin, B = c->block;
  if (B == 0) { /* nothing to check: still in pieces (one very large read is slower) */
    for (uint64_t pos = lo; pos < hi; pos += READ_JOB_BYTES)
      FSDPC_TRY(st_read_bytes(rf->f, name, pos, (char *)buf + (pos - lo),
                              (size_t)(hi - pos < READ_JOB_BYTES ? hi - pos : READ_JOB_BYTES)));
    return STATUS_OK;
  }
  if (c->hash == NULL) { /* a legacy CRC-32 of the whole chunk, read in one piece */
    FSDPC_TRY(st_read_bytes(rf->f, name, lo, buf, (size_t)(hi - lo)));
    uLong x = crc32(0L, Z_NULL, 0);
    for (uint64_t o = 0; o < hi - lo; o += 1u << 30)
      x = crc32(x, (const Bytef *)buf + o,
                (uInt)(hi - lo - o < (1u << 30) ? hi - lo - o : (1u << 30)));
    return (uint32_t)x == c->crc ? STATUS_OK : mismatch(rf, name, size, B, 0);
  }
  uint64_t step = B < READ_JOB_BYTES ? READ_JOB_BYTES / B * B : B;
  uint64_t cached = dcp_checker_threaded(r->checker) ? READ_CACHED_BYTES : READ_CACHED_INLINE;
  uint64_t small = B < cached ? cached / B * B : B;
  fsdpc_status_t st = STATUS_OK;
  for (uint64_t pos = lo, n; pos < hi && st == STATUS_OK; pos += n) {
    char *p = (char *)buf + (pos - lo);
    n = hi - pos < small ? hi - pos : small;
    n = st_read_cached(rf->f, name, pos, p, (size_t)n, (size_t)B); /* the cached whole blocks */
    if (n == 0) { /* the next block is not cached: a job's worth from storage */
      n = hi - pos < step ? hi - pos : step;
      st = st_read_bytes(rf->f, name, pos, p, (size_t)n);
    }
    if (st == STATUS_OK) dcp_checker_push(r->checker, p, (size_t)n, (size_t)B, c->hash, pos / B, c);
  }
  return st;
}

/* Waits for the checks of every block read so far: st, or the first mismatch when st is OK.
 * Bytes a read brought in are trusted (copied out, converted, returned) only after this. */
static fsdpc_status_t checks_done(const dcp_reader_t *r, fsdpc_status_t st) {
  const void *who = NULL;
  uint64_t b = 0;
  if (dcp_checker_wait(r->checker, &who, &b) || st != STATUS_OK) return st;
  const chunk_t *c = who;
  return mismatch(&r->files[c->file], c->info->name, c->info->end - c->info->begin, c->block, b);
}

/* read_blocks, then the checks of what it read: the bytes are the caller's to use after this.
 * A range of one piece is hashed by this thread right after its read (the caller would only
 * wait for the helper). */
static fsdpc_status_t read_checked(const dcp_reader_t *r, const chunk_t *c, uint64_t lo,
                                   uint64_t hi, void *buf) {
  if (c->hash == NULL || hi - lo > READ_JOB_BYTES) return checks_done(r, read_blocks(r, c, lo, hi, buf));
  rfile_t *rf = &r->files[c->file];
  uint64_t size = c->info->end - c->info->begin, B = c->block;
  FSDPC_TRY(st_read_bytes(rf->f, c->info->name, lo, buf, (size_t)(hi - lo)));
  uint64_t bad = dcp_first_bad_block(buf, (size_t)(hi - lo), (size_t)B, c->hash, lo / B);
  return bad == UINT64_MAX ? STATUS_OK : mismatch(rf, c->info->name, size, B, bad);
}

/* Reads a whole chunk into dst (its shape), every block checked. */
static fsdpc_status_t read_whole(const dcp_reader_t *r, const chunk_t *c, fsdpc_tensor_t *dst) {
  const st_info_t *t = c->info;
  uint64_t size = t->end - t->begin;
  if (dst->device.type == DEVICE_CPU && dst->dtype == t->dtype && tensor_is_contiguous(dst))
    return read_blocks(r, c, 0, size, dst->data); /* straight into place */
  fsdpc_tensor_t raw;
  FSDPC_TRY(tensor_init(&raw, t->dtype, device_cpu(), t->ndim, t->shape));
  fsdpc_status_t st = read_checked(r, c, 0, size, raw.data);
  if (st == STATUS_OK) st = tensor_copy(dst, &raw);
  tensor_free(&raw);
  return st;
}

/* The whole blocks of chunk c inside its bytes [a, b): [*lo, *hi), the chunk's last block
 * counted whole when b is the chunk's end; false when there is none. */
static bool whole_blocks(const chunk_t *c, uint64_t a, uint64_t b, uint64_t *lo, uint64_t *hi) {
  uint64_t size = c->info->end - c->info->begin, B = c->block ? c->block : 1;
  *lo = dcp_blocks_of(a, B) * B;
  *hi = b == size ? size : b / B * B;
  return *lo < *hi;
}

/* Reads bytes [a, b) of chunk c (whole rows, at least one whole block: see whole_blocks) into
 * dst: the whole blocks straight into place, checked like a whole chunk's (see read_blocks),
 * the partly covered first and last blocks through a block-sized buffer, checked before their
 * bytes are copied. */
static fsdpc_status_t read_rows(const dcp_reader_t *r, const chunk_t *c, uint64_t a, uint64_t b,
                                char *dst) {
  uint64_t size = c->info->end - c->info->begin, B = c->block ? c->block : 1, in_lo, in_hi;
  whole_blocks(c, a, b, &in_lo, &in_hi);
  char *edge = a < in_lo || b > in_hi ? malloc((size_t)B) : NULL;
  if ((a < in_lo || b > in_hi) && edge == NULL) return oom();
  fsdpc_status_t st = STATUS_OK;
  if (a < in_lo) {
    st = read_checked(r, c, in_lo - B, in_lo, edge);
    if (st == STATUS_OK) memcpy(dst, edge + (a - (in_lo - B)), (size_t)(in_lo - a));
  }
  if (st == STATUS_OK) st = read_blocks(r, c, in_lo, in_hi, dst + (in_lo - a));
  if (st == STATUS_OK && b > in_hi) {
    st = read_checked(r, c, in_hi, in_hi + B < size ? in_hi + B : size, edge);
    if (st == STATUS_OK) memcpy(dst + (in_hi - a), edge, (size_t)(b - in_hi));
  }
  free(edge);
  return st;
}

/* Reads the box at src (inside chunk c) with dst's shape into dst, checking every block the
 * box touches. Whole rows into a destination laid out like the chunk go through read_rows;
 * other boxes along dimension 0 in groups of about READ_GROUP_BYTES of rows, each group's
 * blocks read and checked, then its part of the box copied out. */
static fsdpc_status_t read_part(const dcp_reader_t *r, const chunk_t *c, const int64_t *src,
                                fsdpc_tensor_t *dst) {
  const st_info_t *t = c->info;
  int nd = t->ndim;
  if (c->block != 0 && c->hash == NULL) { /* one CRC for the chunk: read it whole, then the box */
    fsdpc_tensor_t whole, box = {0};
    FSDPC_TRY(tensor_init(&whole, t->dtype, device_cpu(), nd, t->shape));
    fsdpc_status_t st = checks_done(r, read_whole(r, c, &whole));
    if (st == STATUS_OK) st = tensor_narrow_box(&box, &whole, src, dst->shape);
    if (st == STATUS_OK) st = tensor_copy(dst, &box);
    tensor_free(&box);
    tensor_free(&whole);
    return st;
  }
  /* B: the unit reads start and end on (unchecked: any byte) */
  uint64_t es = t->elem_size, size = t->end - t->begin, B = c->block ? c->block : 1, row = es;
  for (int d = 1; d < nd; d++) row *= (uint64_t)t->shape[d];
  uint64_t first = 0, last = 0, stride = es; /* the box's bytes within one row */
  for (int d = nd - 1; d >= 1; d--) {
    first += (uint64_t)src[d] * stride;
    last += (uint64_t)(src[d] + dst->shape[d] - 1) * stride;
    stride *= (uint64_t)t->shape[d];
  }
  last += es;
  bool whole_rows = dst->device.type == DEVICE_CPU && dst->dtype == t->dtype &&
                    tensor_is_contiguous(dst);
  for (int d = 1; d < nd; d++)
    whole_rows = whole_rows && src[d] == 0 && dst->shape[d] == t->shape[d];
  uint64_t a = (uint64_t)src[0] * row, b = a + (uint64_t)dst->shape[0] * row, in_lo, in_hi;
  if (whole_rows && whole_blocks(c, a, b, &in_lo, &in_hi)) return read_rows(r, c, a, b, dst->data);
  int64_t rows = dst->shape[0], per = row >= READ_GROUP_BYTES ? 1 : (int64_t)(READ_GROUP_BYTES / row);
  if (per > rows) per = rows;
  char *buf = malloc((size_t)((uint64_t)per * row + 2 * B));
  if (buf == NULL) return oom();
  fsdpc_status_t st = STATUS_OK;
  for (int64_t r0 = 0; r0 < rows && st == STATUS_OK; r0 += per) {
    int64_t n = rows - r0 < per ? rows - r0 : per;
    uint64_t base = (uint64_t)(src[0] + r0) * row; /* the group's first row in the chunk */
    uint64_t lo = (base + first) / B * B;
    uint64_t hi = dcp_blocks_of(base + (uint64_t)(n - 1) * row + last, B) * B;
    if (hi > size) hi = size;
    uint64_t start = lo < base ? lo : base; /* buf holds the chunk's bytes from start */
    st = read_checked(r, c, lo, hi, buf + (lo - start));
    int64_t shape[TENSOR_MAX_DIMS], boff[TENSOR_MAX_DIMS] = {0}, bshape[TENSOR_MAX_DIMS];
    for (int d = 0; d < nd; d++) {
      shape[d] = d == 0 ? n : t->shape[d];
      boff[d] = d == 0 ? 0 : src[d];
      bshape[d] = d == 0 ? n : dst->shape[d];
    }
    fsdpc_tensor_t rows_view = {0}, box = {0}, out = {0};
    if (st == STATUS_OK)
      st = tensor_wrap(&rows_view, buf + (base - start), t->dtype, device_cpu(), nd, shape);
    if (st == STATUS_OK) st = tensor_narrow_box(&box, &rows_view, boff, bshape);
    if (st == STATUS_OK) st = tensor_narrow(&out, dst, 0, r0, n);
    if (st == STATUS_OK) st = tensor_copy(&out, &box);
    tensor_free(&out);
    tensor_free(&box);
    tensor_free(&rows_view);
  }
  free(buf);
  return st;
}

fsdpc_status_t dcp_reader_check_tensor(const dcp_reader_t *r, const char *name, int nd,
                                       const int64_t *gshape, dtype_t dtype, int *index) {
  int ti = dcp_find_tensor(r, name);
  if (ti < 0) return err_set(STATUS_EFORMAT, "checkpoint %s: missing tensor '%s'", r->dir, name);
  if (index != NULL) *index = ti;
  const dcp_tensor_t *t = &r->list[ti];
  const char *file = st_path(r->files[r->chunks[r->first[ti]].file].f);
  char a[96], b[96];
  if (t->ndim != nd)
    return err_set(STATUS_ESHAPE, "%s: tensor '%s' has %d dimensions, the model's has %d", file,
                   name, t->ndim, nd);
  bool fl = dtype_is_float(dtype);
  if (t->dtype == DTYPE_COUNT || dtype_is_float(t->dtype) != fl)
    return err_set(STATUS_EDTYPE,
                   "%s: tensor '%s' is stored as %s, not a%s dtype as the model's %s", file, name,
                   t->dtype_name, fl ? " float" : "n integer", dtype_name(dtype));
  if (memcmp(t->shape, gshape, sizeof(int64_t) * (size_t)nd) != 0)
    return err_set(STATUS_ESHAPE,
                   "checkpoint %s: tensor '%s' was saved with shape %s, the model's is %s", r->dir,
                   name, tensor_shape_str(nd, t->shape, a, sizeof a),
                   tensor_shape_str(nd, gshape, b, sizeof b));
  return STATUS_OK;
}

/* Reads the box at global offset loff with local's shape of tensor name (global shape gshape)
 * into local, from the saved chunks that intersect it. */
static fsdpc_status_t load_box(const dcp_reader_t *r, const char *name, int nd,
                               const int64_t *gshape, const int64_t *loff,
                               const fsdpc_tensor_t *local, dcp_stats_t *s) {
  if (tensor_is_meta(local))
    return err_set(STATUS_EINVAL,
                   "checkpoint %s: tensor '%s': the destination is a meta tensor without "
                   "memory (allocate a deferred model's shards with nn_module_materialize "
                   "before loading)",
                   r->dir, name);
  int ti;
  FSDPC_TRY(dcp_reader_check_tensor(r, name, nd, gshape, local->dtype, &ti));
  const dcp_tensor_t *t = &r->list[ti];
  const chunk_t *c = &r->chunks[r->first[ti]];
  int64_t covered = 0;
  fsdpc_status_t st = STATUS_OK;
  for (int k = 0; k < t->chunks && st == STATUS_OK; k++) {
    int64_t lo[TENSOR_MAX_DIMS], len[TENSOR_MAX_DIMS], src[TENSOR_MAX_DIMS], vol = 1, whole = 1;
    for (int d = 0; d < nd; d++) {
      int64_t s0 = c[k].off[d], s1 = s0 + c[k].info->shape[d];
      int64_t n0 = loff[d], n1 = n0 + local->shape[d];
      lo[d] = s0 > n0 ? s0 : n0;
      int64_t hi = s1 < n1 ? s1 : n1;
      len[d] = hi > lo[d] ? hi - lo[d] : 0;
      src[d] = lo[d] - s0;
      vol *= len[d];
      whole *= c[k].info->shape[d];
    }
    if (vol == 0) continue;
    fsdpc_tensor_t dst, next; /* the intersection inside this rank's shard */
    st = tensor_ref(&dst, local);
    for (int d = 0; d < nd && st == STATUS_OK; d++) {
      st = tensor_narrow(&next, &dst, d, lo[d] - loff[d], len[d]);
      tensor_free(&dst);
      dst = next;
    }
    if (st == STATUS_OK) st = vol == whole ? read_whole(r, &c[k], &dst) : read_part(r, &c[k], src, &dst);
    tensor_free(&dst);
    covered += vol;
    if (s) s->bytes_needed += (uint64_t)vol * c[k].info->elem_size;
  }
  if (st == STATUS_OK && covered != tensor_numel(local))
    st = err_set(STATUS_EFORMAT,
                 "checkpoint %s: the saved chunks of tensor '%s' cover %lld of the %lld "
                 "elements this rank needs",
                 r->dir, name, (long long)covered, (long long)tensor_numel(local));
  return st;
}

fsdpc_status_t dcp_reader_read_box(dcp_reader_t *r, const char *name, int ndim,
                                   const int64_t *global_shape, const int64_t *offset,
                                   fsdpc_tensor_t *dst) {
  ARG_NONNULL(r);
  ARG_NONNULL(name);
  if (ndim > 0) ARG_NONNULL(global_shape);
  if (ndim > 0) ARG_NONNULL(offset);
  ARG_NONNULL(dst);
  return checks_done(r, load_box(r, name, ndim, global_shape, offset, dst, NULL));
}

fsdpc_status_t dcp_reader_read_boxes(dcp_reader_t *r, const dcp_box_t *boxes, int n) {
  ARG_NONNULL(r);
  if (n > 0) ARG_NONNULL(boxes);
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    int ti = dcp_find_tensor(r, boxes[i].name);
    const fsdpc_tensor_t *v = boxes[i].value;
    st = load_box(r, boxes[i].name, v->ndim, ti < 0 ? v->shape : r->list[ti].shape,
                  boxes[i].offset, v, NULL);
  }
  return checks_done(r, st); /* the checks of one box ran while the next was read */
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The first name given to two entries, or NULL (names already checked non-NULL). */
static fsdpc_status_t twice_named(const dcp_entry_t *entries, int n, const char **twice) {
  *twice = NULL;
  const char **names = malloc(sizeof *names * (size_t)(n > 0 ? n : 1));
  if (names == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  for (int i = 0; i < n; i++) names[i] = entries[i].name;
  qsort(names, (size_t)n, sizeof *names, by_name);
  for (int i = 1; i < n && *twice == NULL; i++)
    if (strcmp(names[i - 1], names[i]) == 0) *twice = names[i];
  free(names);
  return STATUS_OK;
}

fsdpc_status_t dcp_check_entries(const dcp_entry_t *entries, int n, bool save, const char *who) {
  if (n < 0) return err_set(STATUS_EINVAL, "%s: %d entries", who, n);
  for (int i = 0; i < n; i++) {
    if (entries[i].name == NULL || entries[i].name[0] == 0)
      return err_set(STATUS_EINVAL, "%s: entry %d has %s name", who, i,
                     entries[i].name ? "an empty" : "a NULL");
    if (entries[i].value == NULL)
      return err_set(STATUS_EINVAL, "%s: entry %d ('%s') has a NULL value", who, i,
                     entries[i].name);
    const dtensor_t *v = entries[i].value;
    int64_t numel = 1;
    for (int d = 0; d < dtensor_ndim(v); d++) numel *= dtensor_shape(v)[d];
    if (numel == 0) { /* no box to write or read: a name with nothing behind it */
      char b[96];
      return err_set(STATUS_EINVAL,
                     "%s: tensor '%s' has no elements (shape %s): a checkpoint holds tensors "
                     "with elements; leave it out of the entries",
                     who, entries[i].name,
                     tensor_shape_str(dtensor_ndim(v), dtensor_shape(v), b, sizeof b));
    }
    const mesh_t *m = dtensor_mesh(v);
    const placement_t *pl = dtensor_placements(v);
    for (int d = 0; !save && d < mesh_ndim(m); d++)
      if (pl[d].kind == PLACEMENT_PARTIAL) {
        char b[32];
        return err_set(STATUS_EUNSUPPORTED,
                       "%s: tensor '%s' has placement %s on mesh dimension %d: every local term "
                       "would hold the whole value; load it as Shard or Replicate, then "
                       "redistribute",
                       who, entries[i].name, placement_str(pl[d], b, sizeof b), d);
      }
  }
  const char *twice;
  FSDPC_TRY(twice_named(entries, n, &twice));
  if (twice != NULL)
    return err_set(STATUS_EINVAL, "%s: two entries are named '%s' (each tensor once)", who, twice);
  return STATUS_OK;
}

fsdpc_status_t dcp_reader_load(dcp_reader_t *r, const dcp_entry_t *entries, int n,
                               dcp_stats_t *stats) {
  ARG_NONNULL(r);
  if (n > 0) ARG_NONNULL(entries);
  FSDPC_TRY(dcp_check_entries(entries, n, false, "checkpoint load"));
  dcp_stats_t s = {0};
  s.files = r->n_files;
  s.unchecked = r->checks == DCP_CHECKS_NONE;
  uint64_t read0 = 0;
  for (int i = 0; i < r->n_files; i++) read0 += st_bytes_read(r->files[i].f);
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    const dtensor_t *v = entries[i].value;
    int64_t loff[TENSOR_MAX_DIMS];
    dtensor_offset(v, loff);
    fsdpc_tensor_t local;
    st = tensor_ref(&local, dtensor_local(v));
    if (st == STATUS_OK)
      st = load_box(r, entries[i].name, dtensor_ndim(v), dtensor_shape(v), loff, &local, &s);
    tensor_free(&local);
  }
  st = checks_done(r, st); /* straight-into-place reads are checked by now */
  for (int i = 0; i < r->n_files; i++) {
    s.bytes_read += st_bytes_read(r->files[i].f);
    s.header_bytes += st_header_bytes(r->files[i].f);
  }
  s.bytes_read -= read0; /* header_bytes: every file's, parsed once at open */
  if (stats) *stats = s;
  return st;
}

fsdpc_status_t dcp_load(const char *dir, const dcp_entry_t *entries, int n, dcp_stats_t *stats) {
  ARG_NONNULL(dir);
  if (n > 0) ARG_NONNULL(entries);
  dcp_reader_t *r;
  FSDPC_TRY(dcp_reader_open(dir, &r));
  fsdpc_status_t st = dcp_reader_load(r, entries, n, stats);
  dcp_reader_close(r);
  return st;
}

/* ---- verify ---- */

fsdpc_status_t dcp_reader_verify(dcp_reader_t *r, const char *name, int *checked, int *unchecked) {
  ARG_NONNULL(r);
  ARG_NONNULL(name);
  ARG_NONNULL(checked);
  ARG_NONNULL(unchecked);
  *checked = *unchecked = 0;
  int ti = dcp_find_tensor(r, name);
  if (ti < 0) return err_set(STATUS_EFORMAT, "checkpoint %s: no tensor '%s'", r->dir, name);
  const chunk_t *c = &r->chunks[r->first[ti]];
  fsdpc_status_t st = STATUS_OK;
  for (int k = 0; k < r->list[ti].chunks && st == STATUS_OK; k++) {
    if (c[k].block == 0) {
      (*unchecked)++;
      continue;
    }
    uint64_t size = c[k].info->end - c[k].info->begin, B = c[k].block;
    uint64_t step = c[k].hash && B <= READ_GROUP_BYTES / 2 ? READ_GROUP_BYTES / B * B : B;
    uint64_t piece = size < step ? size : step;
    void *buf = malloc(piece ? (size_t)piece : 1);
    if (buf == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory for %llu bytes",
                                    (unsigned long long)piece);
    for (uint64_t pos = 0; pos < size && st == STATUS_OK; pos += step)
      st = read_checked(r, &c[k], pos, pos + (size - pos < step ? size - pos : step), buf);
    free(buf);
    if (st == STATUS_OK) (*checked)++;
  }
  return st;
}

fsdpc_status_t dcp_verify(const char *dir, pg_t *pg, int64_t *chunks) {
  ARG_NONNULL(dir);
  ARG_NONNULL(pg);
  int rank = pg_rank(pg), size = pg_size(pg);
  dcp_reader_t *r = NULL;
  const dcp_tensor_t *t = NULL;
  int n = 0;
  int64_t mine = 0, all = 0;
  fsdpc_status_t st = dcp_reader_open(dir, &r);
  if (st == STATUS_OK) st = dcp_reader_list(r, &t, &n);
  for (int i = rank; i < n && st == STATUS_OK; i += size) {
    int ok = 0, none = 0;
    st = dcp_reader_verify(r, t[i].name, &ok, &none);
    mine += ok;
  }
  dcp_reader_close(r);
  FSDPC_TRY(pg_agree(pg, st));
  FSDPC_TRY(pg_host_all_reduce(pg, &mine, &all, 1, PG_HOST_I64, REDUCE_SUM));
  if (chunks) *chunks = all;
  return STATUS_OK;
}
