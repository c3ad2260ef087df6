/* Distributed checkpoints: sharded save with an atomic commit, and loads that read only the
 * intersection of saved and needed boxes. */
#include "checkpoint/dcp.h"

#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "checkpoint/safetensors.h"
#include "dtensor/placement.h"
#include "mesh/world.h"

#define DCP_PATH_MAX 4096
#define DCP_JOIN_MAX (DCP_PATH_MAX + 320) /* a folder path plus a file name */

/* ---- save ---- */

/* Whether this rank writes its shard of v: coordinate 0 on every dimension v is replicated
 * over. Every shard, strided ones included, is one box of the global tensor; Partial values
 * are not boxes and cannot be saved. */
static status_t writes_shard(const char *name, const dtensor_t *v, bool *out) {
  const mesh_t *m = dtensor_mesh(v);
  const placement_t *pl = dtensor_placements(v);
  *out = tensor_numel(dtensor_local(v)) > 0;
  for (int d = 0; d < mesh_ndim(m); d++) {
    char b[32];
    if (pl[d].kind == PLACEMENT_PARTIAL)
      return err_set(STATUS_EUNSUPPORTED,
                     "checkpoint: tensor '%s' has placement %s on mesh dimension %d; "
                     "redistribute it to Shard or Replicate before saving",
                     name, placement_str(pl[d], b, sizeof b), d);
    if (pl[d].kind == PLACEMENT_REPLICATE && mesh_coord(m, d) != 0) *out = false;
  }
  return STATUS_OK;
}

static status_t fsync_path(const char *path) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return err_set(STATUS_EIO, "%s: cannot open to sync: %s", path, strerror(errno));
  int rc = fsync(fd);
  close(fd);
  if (rc != 0) return err_set(STATUS_EIO, "%s: fsync failed: %s", path, strerror(errno));
  return STATUS_OK;
}

/* Removes a folder of files and folders of files. */
void dcp_remove_tree(const char *dir) {
  DIR *d = opendir(dir);
  if (d == NULL) return;
  struct dirent *e;
  char p[DCP_JOIN_MAX];
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    snprintf(p, sizeof p, "%.4000s/%.255s", dir, e->d_name);
    if (unlink(p) != 0) dcp_remove_tree(p);
  }
  closedir(d);
  rmdir(dir);
}

/* CRC-32 (zlib) of bytes in host memory. */
static uint32_t crc_bytes(const void *data, size_t bytes) {
  uLong c = crc32(0L, Z_NULL, 0);
  const unsigned char *p = data;
  for (size_t left = bytes; left > 0;) { /* crc32 takes a uInt length */
    uInt k = left > (1u << 30) ? (1u << 30) : (uInt)left;
    c = crc32(c, p, k);
    p += k;
    left -= k;
  }
  return (uint32_t)c;
}

/* CRC-32 of a contiguous tensor's bytes, wherever it lives. */
static status_t crc_of(const tensor_t *t, uint32_t *out) {
  if (tensor_is_meta(t))
    return err_set(STATUS_EINVAL,
                   "checkpoint: a meta tensor has no data to save (allocate and initialise "
                   "the model first)");
  tensor_t host = {0};
  const tensor_t *src = t;
  if (t->device.type != DEVICE_CPU || !tensor_is_contiguous(t)) {
    TRY(tensor_clone(&host, t, t->dtype, device_cpu()));
    src = &host;
  }
  *out = crc_bytes(src->data, tensor_nbytes(src));
  tensor_free(&host);
  return STATUS_OK;
}

status_t dcp_write_file(const char *path, const dcp_box_t *boxes, int n) {
  st_writer_t *w = NULL;
  cJSON *info = cJSON_CreateObject();
  char *text = NULL;
  status_t st = info ? STATUS_OK : err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  if (st == STATUS_OK) st = st_writer_new(&w);
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    const tensor_t *t = boxes[i].value;
    cJSON *offsets = cJSON_CreateArray(), *item = cJSON_CreateObject();
    for (int d = 0; d < t->ndim && offsets; d++)
      cJSON_AddItemToArray(offsets, cJSON_CreateNumber((double)boxes[i].offset[d]));
    if (offsets == NULL || item == NULL) {
      cJSON_Delete(offsets);
      cJSON_Delete(item);
      st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
      break;
    }
    cJSON_AddItemToObject(item, "saved_offsets", offsets);
    uint32_t crc = 0;
    st = crc_of(t, &crc);
    char hex[16];
    snprintf(hex, sizeof hex, "%08x", crc);
    cJSON_AddStringToObject(item, "crc32", hex);
    cJSON_AddItemToObject(info, boxes[i].name, item);
    if (st == STATUS_OK) st = st_writer_add(w, boxes[i].name, t);
  }
  if (st == STATUS_OK && (text = cJSON_PrintUnformatted(info)) == NULL)
    st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  if (st == STATUS_OK) st = st_writer_set_metadata(w, "DCP_SHARDING_INFO", text);
  if (st == STATUS_OK) st = st_writer_set_metadata(w, "DCP_VERSION", DCP_VERSION);
  if (st == STATUS_OK) st = st_writer_set_metadata(w, "format", "pt");
  if (st == STATUS_OK) st = st_writer_save(w, path);
  free(text);
  cJSON_Delete(info);
  st_writer_free(w);
  return st;
}

/* The file this rank writes: its shards (a replica only at coordinate 0), none when empty. */
static status_t write_shards(const char *tmp, const dcp_entry_t *entries, int n, int rank) {
  dcp_box_t *b = calloc((size_t)(n > 0 ? n : 1), sizeof *b);
  if (b == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  int count = 0;
  status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    bool mine;
    st = writes_shard(entries[i].name, entries[i].value, &mine);
    if (st != STATUS_OK || !mine) continue;
    b[count].name = entries[i].name;
    b[count].value = dtensor_local(entries[i].value);
    dtensor_offset(entries[i].value, b[count].offset);
    count++;
  }
  if (st == STATUS_OK && count > 0) {
    char path[DCP_JOIN_MAX];
    snprintf(path, sizeof path, "%.4010s/shard-%05d.safetensors", tmp, rank);
    st = dcp_write_file(path, b, count);
  }
  free(b);
  return st;
}

status_t dcp_agree(status_t st, MPI_Comm comm, const char *what) {
  int bad = st != STATUS_OK, any = 0;
  status_t got = world_allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, comm, "MPI_Allreduce (checkpoint)");
  if (got != STATUS_OK) return bad ? st : got;
  if (any && !bad) return err_set(STATUS_EIO, "%s: another rank failed", what);
  return st;
}

status_t dcp_prepare(const char *dir, char *tmp, size_t size, MPI_Comm comm) {
  int rank;
  MPI_Comm_rank(comm, &rank);
  status_t st = STATUS_OK;
  if (strlen(dir) + 8 >= DCP_PATH_MAX || size < DCP_PATH_MAX)
    st = err_set(STATUS_EINVAL, "checkpoint: path too long");
  else
    snprintf(tmp, size, "%.4000s.tmp", dir);
  struct stat sb;
  if (rank == 0 && st == STATUS_OK) {
    if (stat(dir, &sb) == 0) {
      st = err_set(STATUS_EINVAL, "checkpoint: %s already exists", dir);
    } else {
      dcp_remove_tree(tmp); /* left by a save that died before its commit */
      if (mkdir(tmp, 0755) != 0)
        st = err_set(STATUS_EIO, "checkpoint: cannot create %s: %s", tmp, strerror(errno));
    }
  }
  return dcp_agree(st, comm, dir);
}

status_t dcp_write(const char *folder, const dcp_entry_t *entries, int n, MPI_Comm comm) {
  int rank;
  MPI_Comm_rank(comm, &rank);
  return dcp_agree(write_shards(folder, entries, n, rank), comm, folder);
}

status_t dcp_commit(const char *tmp, const char *dir, MPI_Comm comm) {
  int rank;
  MPI_Comm_rank(comm, &rank);
  status_t st = STATUS_OK;
  if (rank == 0) { /* the folder's entries, then the rename, reach the disk */
    st = fsync_path(tmp);
    if (st == STATUS_OK && rename(tmp, dir) != 0)
      st = err_set(STATUS_EIO, "checkpoint: cannot rename %s to %s: %s", tmp, dir, strerror(errno));
    if (st == STATUS_OK) {
      char parent[DCP_PATH_MAX];
      snprintf(parent, sizeof parent, "%s", dir);
      char *slash = strrchr(parent, '/');
      if (slash == parent)
        slash[1] = 0;
      else if (slash)
        *slash = 0;
      else
        strcpy(parent, ".");
      st = fsync_path(parent);
    }
  }
  return dcp_agree(st, comm, dir);
}

status_t dcp_save(const char *dir, const dcp_entry_t *entries, int n, MPI_Comm comm) {
  char tmp[DCP_JOIN_MAX];
  TRY(dcp_prepare(dir, tmp, sizeof tmp, comm));
  status_t st = dcp_write(tmp, entries, n, comm);
  if (st == STATUS_OK) st = dcp_commit(tmp, dir, comm);
  int rank;
  MPI_Comm_rank(comm, &rank);
  if (st != STATUS_OK && rank == 0) dcp_remove_tree(tmp); /* all ranks agreed: none writes */
  return st;
}

/* ---- load ---- */

typedef struct chunk {
  int file;
  int64_t off[TENSOR_MAX_DIMS];
  const st_info_t *info;
  bool has_crc;
  uint32_t crc;
} chunk_t;

typedef struct folder {
  st_file_t **f;
  cJSON **sharding; /* per file: DCP_SHARDING_INFO, or NULL */
  cJSON ***entries; /* per file: the entries of sharding, sorted by name */
  int *n_entries;
  int n;
} folder_t;

static void folder_close(folder_t *fo) {
  for (int i = 0; i < fo->n; i++) {
    st_close(fo->f[i]);
    cJSON_Delete(fo->sharding[i]);
    if (fo->entries) free(fo->entries[i]);
  }
  free(fo->f);
  free(fo->sharding);
  free(fo->entries);
  free(fo->n_entries);
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static int cmp_entry(const void *a, const void *b) {
  return strcmp((*(cJSON *const *)a)->string, (*(cJSON *const *)b)->string);
}

/* Indexes file i's sharding entries by name (cJSON's own lookup is a linear walk). */
static status_t index_entries(folder_t *fo, int i) {
  const cJSON *info = fo->sharding[i];
  int n = 0;
  if (!cJSON_IsObject(info))
    return err_set(STATUS_EFORMAT, "%s: DCP_SHARDING_INFO is not a JSON object", st_path(fo->f[i]));
  for (const cJSON *e = info->child; e; e = e->next) n++;
  if ((fo->entries[i] = malloc(sizeof(cJSON *) * (size_t)(n ? n : 1))) == NULL)
    return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  n = 0;
  for (cJSON *e = info->child; e; e = e->next) fo->entries[i][n++] = e;
  qsort(fo->entries[i], (size_t)n, sizeof(cJSON *), cmp_entry);
  fo->n_entries[i] = n;
  for (int k = 1; k < n; k++)
    if (strcmp(fo->entries[i][k - 1]->string, fo->entries[i][k]->string) == 0)
      return err_set(STATUS_EFORMAT, "%s: DCP_SHARDING_INFO names tensor '%s' twice",
                     st_path(fo->f[i]), fo->entries[i][k]->string);
  return STATUS_OK;
}

/* File i's sharding entry for name, or NULL. */
static const cJSON *find_entry(const folder_t *fo, int i, const char *name) {
  int lo = 0, hi = fo->sharding[i] ? fo->n_entries[i] : 0;
  while (lo < hi) {
    int mid = lo + (hi - lo) / 2, c = strcmp(fo->entries[i][mid]->string, name);
    if (c == 0) return fo->entries[i][mid];
    if (c < 0)
      lo = mid + 1;
    else
      hi = mid;
  }
  return NULL;
}

static status_t folder_open(const char *dir, folder_t *fo) {
  memset(fo, 0, sizeof *fo);
  DIR *d = opendir(dir);
  if (d == NULL)
    return err_set(STATUS_EIO, "checkpoint: cannot open folder %s: %s", dir, strerror(errno));
  char **names = NULL;
  int n = 0, cap = 0;
  status_t st = STATUS_OK;
  struct dirent *e;
  while ((e = readdir(d)) != NULL && st == STATUS_OK) {
    size_t l = strlen(e->d_name);
    if (l < 12 || strcmp(e->d_name + l - 12, ".safetensors") != 0) continue;
    if (n == cap) {
      cap = cap ? 2 * cap : 16;
      char **nn = realloc(names, sizeof(char *) * (size_t)cap);
      if (nn == NULL) {
        st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
        break;
      }
      names = nn;
    }
    if ((names[n] = strdup(e->d_name)) == NULL)
      st = err_set(STATUS_ENOMEM, "out of host memory");
    else
      n++;
  }
  closedir(d);
  if (st == STATUS_OK && n == 0)
    st = err_set(STATUS_EFORMAT, "checkpoint: %s holds no .safetensors file", dir);
  if (st == STATUS_OK) {
    qsort(names, (size_t)n, sizeof(char *), cmp_str);
    fo->f = calloc((size_t)n, sizeof *fo->f);
    fo->sharding = calloc((size_t)n, sizeof *fo->sharding);
    fo->entries = calloc((size_t)n, sizeof *fo->entries);
    fo->n_entries = calloc((size_t)n, sizeof *fo->n_entries);
    if (fo->f == NULL || fo->sharding == NULL || fo->entries == NULL || fo->n_entries == NULL)
      st = err_set(STATUS_ENOMEM, "out of host memory");
  }
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    char path[DCP_JOIN_MAX];
    snprintf(path, sizeof path, "%.4000s/%.255s", dir, names[i]);
    st = st_open(&fo->f[i], path);
    if (st != STATUS_OK) break;
    fo->n = i + 1;
    const char *info = st_metadata(fo->f[i], "DCP_SHARDING_INFO");
    if (info != NULL && (fo->sharding[i] = cJSON_Parse(info)) == NULL)
      st = err_set(STATUS_EFORMAT, "%s: DCP_SHARDING_INFO is not valid JSON", path);
    else if (info != NULL)
      st = index_entries(fo, i);
  }
  for (int i = 0; i < n; i++) free(names[i]);
  free(names);
  if (st != STATUS_OK) folder_close(fo);
  return st;
}

/* The saved chunks of name: (file, offset, stored info). */
static status_t chunks_of(const folder_t *fo, const char *name, chunk_t **out, int *count) {
  *out = NULL;
  *count = 0;
  chunk_t *c = calloc((size_t)fo->n, sizeof *c);
  if (c == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  int k = 0;
  for (int i = 0; i < fo->n; i++) {
    const st_info_t *t = st_find(fo->f[i], name);
    if (t == NULL) continue;
    c[k].file = i;
    c[k].info = t;
    const cJSON *e = find_entry(fo, i, name);
    const cJSON *offs = e ? cJSON_GetObjectItemCaseSensitive(e, "saved_offsets") : NULL;
    if (e != NULL && (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != t->ndim)) {
      free(c);
      return err_set(STATUS_EFORMAT,
                     "%s: DCP_SHARDING_INFO of tensor '%s' lacks saved_offsets of %d numbers",
                     st_path(fo->f[i]), name, t->ndim);
    }
    for (int d = 0; d < t->ndim; d++) {
      const cJSON *v = offs ? cJSON_GetArrayItem(offs, d) : NULL;
      if (v != NULL && (!cJSON_IsNumber(v) || v->valuedouble < 0)) {
        free(c);
        return err_set(STATUS_EFORMAT, "%s: tensor '%s': saved_offsets are not offsets",
                       st_path(fo->f[i]), name);
      }
      c[k].off[d] = v ? (int64_t)v->valuedouble : 0;
    }
    const cJSON *crc = e ? cJSON_GetObjectItemCaseSensitive(e, "crc32") : NULL;
    if (crc != NULL) {
      char *end = NULL;
      unsigned long x = cJSON_IsString(crc) ? strtoul(crc->valuestring, &end, 16) : 0;
      if (end == NULL || *end != 0 || end == crc->valuestring || x > 0xfffffffful) {
        free(c);
        return err_set(STATUS_EFORMAT, "%s: tensor '%s': crc32 is not 8 hex digits",
                       st_path(fo->f[i]), name);
      }
      c[k].has_crc = true;
      c[k].crc = (uint32_t)x;
    }
    k++;
  }
  *out = c;
  *count = k;
  return STATUS_OK;
}

/* Reads the stored bytes of a whole chunk into data (room for them) and checks them against
 * the chunk's checksum. */
static status_t read_checked(st_file_t *f, const char *name, const chunk_t *c, void *data) {
  size_t bytes = (size_t)(c->info->end - c->info->begin);
  TRY(st_read_raw(f, name, data, bytes));
  uint32_t crc = crc_bytes(data, bytes);
  if (crc == c->crc) return STATUS_OK;
  return err_set(STATUS_EFORMAT,
                 "%s: tensor '%s': checksum mismatch (stored crc32 %08x, data %08x): the file "
                 "is corrupt",
                 st_path(f), name, c->crc, crc);
}

/* Reads a whole saved chunk into dst (its shape), checking its bytes against the chunk's
 * checksum first. */
static status_t read_verified(st_file_t *f, const char *name, const chunk_t *c, tensor_t *dst) {
  const st_info_t *t = c->info;
  if (dst->device.type == DEVICE_CPU && dst->dtype == t->dtype && tensor_is_contiguous(dst))
    return read_checked(f, name, c, dst->data); /* straight into place */
  tensor_t raw;
  TRY(tensor_init(&raw, t->dtype, device_cpu(), t->ndim, t->shape));
  status_t st = read_checked(f, name, c, raw.data);
  if (st == STATUS_OK) st = tensor_copy(dst, &raw);
  tensor_free(&raw);
  return st;
}

/* Reads the box at global offset loff with local's shape of tensor name (global shape gshape)
 * into local, from the saved chunks that intersect it. */
static status_t load_box(const char *dir, const folder_t *fo, const char *name, int nd,
                         const int64_t *gshape, const int64_t *loff, tensor_t *local,
                         dcp_stats_t *s) {
  if (tensor_is_meta(local))
    return err_set(STATUS_EINVAL,
                   "checkpoint %s: tensor '%s': the destination is a meta tensor without "
                   "memory (allocate a deferred model's shards with nn_module_materialize "
                   "before loading)",
                   dir, name);
  chunk_t *c;
  int nc;
  TRY(chunks_of(fo, name, &c, &nc));
  const dcp_entry_t one = {name, NULL}, *e = &one;
  status_t st = STATUS_OK;
  char a[96], b[96];
  if (nc == 0) st = err_set(STATUS_EFORMAT, "checkpoint %s: missing tensor '%s'", dir, e->name);
  /* the saved global shape: the largest offset + shape over the chunks */
  int64_t saved[TENSOR_MAX_DIMS] = {0};
  for (int k = 0; k < nc && st == STATUS_OK; k++) {
    if (c[k].info->ndim != nd)
      st = err_set(STATUS_ESHAPE, "%s: tensor '%s' has %d dimensions, the model's has %d",
                   st_path(fo->f[c[k].file]), e->name, c[k].info->ndim, nd);
    for (int d = 0; d < nd && st == STATUS_OK; d++) {
      int64_t end = c[k].off[d] + c[k].info->shape[d];
      saved[d] = end > saved[d] ? end : saved[d];
    }
    if (st == STATUS_OK && (c[k].info->dtype == DTYPE_COUNT ||
                            dtype_is_float(c[k].info->dtype) != dtype_is_float(local->dtype)))
      st = err_set(STATUS_EDTYPE, "%s: tensor '%s' is stored as %s; the model's is %s",
                   st_path(fo->f[c[k].file]), e->name, c[k].info->dtype_name,
                   dtype_name(local->dtype));
  }
  if (st == STATUS_OK && memcmp(saved, gshape, sizeof(int64_t) * (size_t)nd) != 0)
    st = err_set(STATUS_ESHAPE,
                 "checkpoint %s: tensor '%s' was saved with shape %s, the model's is %s", dir,
                 e->name, shape_str(nd, saved, a, sizeof a), shape_str(nd, gshape, b, sizeof b));
  int64_t covered = 0;
  for (int k = 0; k < nc && st == STATUS_OK; k++) {
    int64_t lo[TENSOR_MAX_DIMS], len[TENSOR_MAX_DIMS], vol = 1;
    for (int d = 0; d < nd; d++) {
      int64_t s0 = c[k].off[d], s1 = s0 + c[k].info->shape[d];
      int64_t n0 = loff[d], n1 = n0 + local->shape[d];
      lo[d] = s0 > n0 ? s0 : n0;
      int64_t hi = s1 < n1 ? s1 : n1;
      len[d] = hi > lo[d] ? hi - lo[d] : 0;
      vol *= len[d];
    }
    if (vol == 0) continue;
    /* the destination: the intersection inside this rank's shard */
    tensor_t dst, next;
    st = tensor_ref(&dst, local);
    for (int d = 0; d < nd && st == STATUS_OK; d++) {
      st = tensor_narrow(&next, &dst, d, lo[d] - loff[d], len[d]);
      tensor_free(&dst);
      dst = next;
    }
    int64_t src[TENSOR_MAX_DIMS], whole = 1;
    for (int d = 0; d < nd; d++) {
      src[d] = lo[d] - c[k].off[d];
      whole *= c[k].info->shape[d];
    }
    if (st == STATUS_OK && c[k].has_crc && vol == whole)
      st = read_verified(fo->f[c[k].file], e->name, &c[k], &dst);
    else if (st == STATUS_OK)
      st = st_read_box(fo->f[c[k].file], e->name, src, &dst);
    tensor_free(&dst);
    covered += vol;
    if (s) s->bytes_needed += (uint64_t)vol * c[k].info->elem_size;
  }
  if (st == STATUS_OK && covered != tensor_numel(local))
    st = err_set(STATUS_EFORMAT,
                 "checkpoint %s: the saved chunks of tensor '%s' cover %lld of the %lld "
                 "elements this rank needs",
                 dir, e->name, (long long)covered, (long long)tensor_numel(local));
  free(c);
  return st;
}

static status_t load_one(const char *dir, const folder_t *fo, const dcp_entry_t *e,
                         dcp_stats_t *s) {
  const dtensor_t *v = e->value;
  int64_t loff[TENSOR_MAX_DIMS];
  dtensor_offset(v, loff);
  tensor_t local;
  TRY(tensor_ref(&local, dtensor_local(v)));
  status_t st = load_box(dir, fo, e->name, dtensor_ndim(v), dtensor_shape(v), loff, &local, s);
  tensor_free(&local);
  return st;
}

struct dcp_reader {
  char dir[DCP_PATH_MAX];
  folder_t fo;
  dcp_tensor_t *list;
  int n_list;
};

status_t dcp_reader_open(const char *dir, dcp_reader_t **out) {
  *out = NULL;
  dcp_reader_t *r = calloc(1, sizeof *r);
  if (r == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  snprintf(r->dir, sizeof r->dir, "%s", dir);
  status_t st = folder_open(dir, &r->fo);
  if (st != STATUS_OK) {
    free(r);
    return st;
  }
  *out = r;
  return STATUS_OK;
}

void dcp_reader_close(dcp_reader_t *r) {
  if (r == NULL) return;
  for (int i = 0; i < r->n_list; i++) free(r->list[i].name);
  free(r->list);
  folder_close(&r->fo);
  free(r);
}

status_t dcp_reader_read_box(dcp_reader_t *r, const char *name, int ndim,
                             const int64_t *global_shape, const int64_t *offset, tensor_t *dst) {
  return load_box(r->dir, &r->fo, name, ndim, global_shape, offset, dst, NULL);
}

status_t dcp_reader_load(dcp_reader_t *r, const dcp_entry_t *entries, int n, dcp_stats_t *stats) {
  dcp_stats_t s = {0};
  s.files = r->fo.n;
  uint64_t read0 = 0;
  for (int i = 0; i < r->fo.n; i++) read0 += st_bytes_read(r->fo.f[i]);
  status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) st = load_one(r->dir, &r->fo, &entries[i], &s);
  for (int i = 0; i < r->fo.n; i++) {
    s.bytes_read += st_bytes_read(r->fo.f[i]);
    s.header_bytes += st_header_bytes(r->fo.f[i]);
  }
  s.bytes_read -= read0; /* header_bytes: every file's, parsed once at open */
  if (stats) *stats = s;
  return st;
}

status_t dcp_reader_verify(dcp_reader_t *r, const char *name, int *checked, int *unchecked) {
  chunk_t *c;
  int nc;
  *checked = *unchecked = 0;
  TRY(chunks_of(&r->fo, name, &c, &nc));
  status_t st =
      nc == 0 ? err_set(STATUS_EFORMAT, "checkpoint %s: no tensor '%s'", r->dir, name) : STATUS_OK;
  for (int k = 0; k < nc && st == STATUS_OK; k++) {
    if (!c[k].has_crc) {
      (*unchecked)++;
      continue;
    }
    size_t bytes = (size_t)(c[k].info->end - c[k].info->begin);
    void *buf = malloc(bytes ? bytes : 1);
    if (buf == NULL) {
      st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory for %zu bytes", bytes);
      break;
    }
    st = read_checked(r->fo.f[c[k].file], name, &c[k], buf);
    if (st == STATUS_OK) (*checked)++;
    free(buf);
  }
  free(c);
  return st;
}

status_t dcp_verify(const char *dir, MPI_Comm comm, int64_t *chunks) {
  int rank, size;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  dcp_reader_t *r = NULL;
  const dcp_tensor_t *t = NULL;
  int n = 0;
  long long mine = 0, all = 0;
  status_t st = dcp_reader_open(dir, &r);
  if (st == STATUS_OK) st = dcp_reader_list(r, &t, &n);
  for (int i = rank; i < n && st == STATUS_OK; i += size) {
    int ok = 0, none = 0;
    st = dcp_reader_verify(r, t[i].name, &ok, &none);
    mine += ok;
  }
  dcp_reader_close(r);
  TRY(comm_agree(comm, st));
  TRY(world_allreduce(&mine, &all, 1, MPI_LONG_LONG, MPI_SUM, comm, "MPI_Allreduce (verify)"));
  if (chunks) *chunks = all;
  return STATUS_OK;
}

/* Folds every chunk of the tensor called name into e. */
static status_t fold_tensor(dcp_reader_t *r, const char *name, dcp_tensor_t *e) {
  chunk_t *c;
  int nc;
  TRY(chunks_of(&r->fo, name, &c, &nc));
  const st_info_t *t = c[0].info;
  status_t st = STATUS_OK;
  if ((e->name = strdup(name)) == NULL) st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  e->dtype = t->dtype;
  e->dtype_name = t->dtype_name;
  e->ndim = t->ndim;
  for (int q = 0; q < nc && st == STATUS_OK; q++) {
    const st_info_t *ci = c[q].info;
    if (ci->ndim != t->ndim || strcmp(ci->dtype_name, t->dtype_name) != 0) {
      st = err_set(STATUS_EFORMAT,
                   "%s: tensor '%s' is stored as %s with %d dimensions here and as %s with %d "
                   "elsewhere",
                   st_path(r->fo.f[c[q].file]), name, ci->dtype_name, ci->ndim, t->dtype_name,
                   t->ndim);
      break;
    }
    for (int d = 0; d < t->ndim; d++) {
      int64_t end = c[q].off[d] + ci->shape[d];
      if (end > e->shape[d]) e->shape[d] = end;
    }
    e->chunks++;
    e->bytes += ci->end - ci->begin;
  }
  free(c);
  return st;
}

status_t dcp_reader_list(dcp_reader_t *r, const dcp_tensor_t **out, int *n) {
  if (r->list == NULL) {
    int total = 0;
    for (int i = 0; i < r->fo.n; i++) total += st_num_tensors(r->fo.f[i]);
    /* every name of every file, sorted: each distinct name once, in name order */
    const char **names = malloc(sizeof(char *) * (size_t)(total ? total : 1));
    r->list = calloc((size_t)(total ? total : 1), sizeof *r->list);
    if (names == NULL || r->list == NULL) {
      free(names);
      return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
    }
    int k = 0;
    for (int i = 0; i < r->fo.n; i++)
      for (int j = 0; j < st_num_tensors(r->fo.f[i]); j++)
        names[k++] = st_tensor(r->fo.f[i], j)->name;
    qsort(names, (size_t)total, sizeof(char *), cmp_str);
    status_t st = STATUS_OK;
    for (int i = 0; i < total && st == STATUS_OK; i++) {
      if (i > 0 && strcmp(names[i], names[i - 1]) == 0) continue;
      st = fold_tensor(r, names[i], &r->list[r->n_list]);
      if (r->list[r->n_list].name != NULL) r->n_list++;
    }
    free(names);
    if (st != STATUS_OK) { /* a later call fails again instead of listing part of the folder */
      for (int i = 0; i < r->n_list; i++) free(r->list[i].name);
      free(r->list);
      r->list = NULL;
      r->n_list = 0;
      return st;
    }
  }
  *out = r->list;
  *n = r->n_list;
  return STATUS_OK;
}

status_t dcp_load(const char *dir, const dcp_entry_t *entries, int n, dcp_stats_t *stats) {
  dcp_reader_t *r;
  TRY(dcp_reader_open(dir, &r));
  status_t st = dcp_reader_load(r, entries, n, stats);
  dcp_reader_close(r);
  return st;
}
