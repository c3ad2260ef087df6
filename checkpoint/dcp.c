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
#include <xxhash.h>

#include "checkpoint/dcp_integrity_impl.h"
#include "checkpoint/dcp_reader_impl.h"
#include "checkpoint/safetensors.h"
#include "core/args_impl.h"
#include "core/file.h"
#include "dtensor/placement.h"

#define DCP_PATH_MAX 4096
#define DCP_JOIN_MAX (DCP_PATH_MAX + 320) /* a folder path plus a file name */

/* ---- save ---- */

/* Whether this rank writes its shard of v: coordinate 0 on every dimension v is replicated
 * over. Every shard, strided ones included, is one box of the global tensor; Partial values
 * are not boxes and cannot be saved. */
static fsdpc_status_t writes_shard(const char *name, const dtensor_t *v, bool *out) {
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

static fsdpc_status_t fsync_path(const char *path) {
  int fd = open(path, O_RDONLY);
  if (fd < 0) return err_set(STATUS_EIO, "%s: cannot open to sync: %s", path, strerror(errno));
  int rc = fsync(fd);
  close(fd);
  if (rc != 0) return err_set(STATUS_EIO, "%s: fsync failed: %s", path, strerror(errno));
  return STATUS_OK;
}

/* The folders directly in dir (a training checkpoint's model/ and optim/), synced: the shard
 * files renamed into them by every rank. */
static fsdpc_status_t fsync_subfolders(const char *dir) {
  DIR *d = opendir(dir);
  if (d == NULL) return err_set(STATUS_EIO, "%s: cannot open to sync: %s", dir, strerror(errno));
  fsdpc_status_t st = STATUS_OK;
  struct dirent *e;
  while (st == STATUS_OK && (e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    char sub[DCP_JOIN_MAX];
    struct stat sb;
    st = file_join(sub, sizeof sub, dir, e->d_name);
    if (st == STATUS_OK && lstat(sub, &sb) == 0 && S_ISDIR(sb.st_mode)) st = fsync_path(sub);
  }
  closedir(d);
  return st;
}

static uint64_t g_block_bytes = DCP_BLOCK_BYTES_DEFAULT;

fsdpc_status_t dcp_set_block_bytes(uint64_t bytes) {
  if (bytes < DCP_BLOCK_BYTES_MIN || bytes > DCP_BLOCK_BYTES_MAX || bytes % DCP_BLOCK_BYTES_MIN)
    return err_set(STATUS_EINVAL,
                   "checkpoint: block size %llu is not a multiple of %llu up to %llu bytes",
                   (unsigned long long)bytes, (unsigned long long)DCP_BLOCK_BYTES_MIN,
                   (unsigned long long)DCP_BLOCK_BYTES_MAX);
  g_block_bytes = bytes;
  return STATUS_OK;
}

uint64_t dcp_block_bytes(void) { return g_block_bytes; }

/* Appends the block hashes of a contiguous tensor's bytes, wherever it lives, to h. */
static fsdpc_status_t hash_blocks(const char *name, const fsdpc_tensor_t *t, uint64_t block,
                                  uint64_t *h) {
  char what[160];
  snprintf(what, sizeof what, "checkpoint: tensor '%.120s'", name);
  FSDPC_TRY(tensor_check_memory(what, t)); /* a meta model's: no values to save */
  fsdpc_tensor_t host = {0};
  const fsdpc_tensor_t *src = t;
  if (t->device.type != DEVICE_CPU || !tensor_is_contiguous(t)) {
    FSDPC_TRY(tensor_clone(&host, t, t->dtype, device_cpu()));
    src = &host;
  }
  uint64_t bytes = tensor_nbytes(src);
  for (uint64_t b = 0; b < dcp_blocks_of(bytes, block); b++) {
    uint64_t lo = b * block, n = bytes - lo < block ? bytes - lo : block;
    h[b] = dcp_block_hash((const char *)src->data + lo, (size_t)n);
  }
  tensor_free(&host);
  return STATUS_OK;
}

/* A file about to be written: its tensors as the header will declare them (laid out in
 * order from byte 0) and its integrity record, block hashes first, then (sealed) the folder's
 * files, the save's id and the header's hash. */
typedef struct pending {
  dcp_integrity_t it;
  dcp_hdr_tensor_t *ht;
  int n;
} pending_t;

static void pending_free(pending_t *p) {
  free(p->it.hashes);
  free(p->ht);
  memset(p, 0, sizeof *p);
}

/* The most block hashes a file records: 16 hex digits each, 32 MB of its header, well inside
 * what a reader takes (ST_MAX_HEADER). */
#define MAX_FILE_HASHES ((uint64_t)2000000)

/* The block size of a file of n boxes: the set one, doubled while the file would record more
 * than MAX_FILE_HASHES hashes (a large shard under a small checkpoint.block_bytes), so that
 * every file written can be read. Each file records its own. */
static uint64_t file_block_bytes(const dcp_box_t *boxes, int n) {
  uint64_t block = g_block_bytes;
  for (;;) {
    uint64_t hashes = 0;
    for (int i = 0; i < n; i++) {
      const fsdpc_tensor_t *t = boxes[i].value;
      hashes += dcp_blocks_of((uint64_t)tensor_numel(t) * dtype_size(t->dtype), block);
    }
    if (hashes <= MAX_FILE_HASHES || 2 * block > DCP_BLOCK_BYTES_MAX) return block;
    block *= 2;
  }
}

static fsdpc_status_t pending_hash(const dcp_box_t *boxes, int n, pending_t *p) {
  memset(p, 0, sizeof *p);
  p->it.block_bytes = file_block_bytes(boxes, n);
  p->n = n;
  if ((p->ht = calloc((size_t)(n > 0 ? n : 1), sizeof *p->ht)) == NULL)
    return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  uint64_t pos = 0;
  for (int i = 0; i < n; i++) {
    const fsdpc_tensor_t *t = boxes[i].value;
    uint64_t bytes = (uint64_t)tensor_numel(t) * dtype_size(t->dtype);
    p->ht[i] = (dcp_hdr_tensor_t){boxes[i].name, st_dtype_name(t->dtype), t->ndim, t->shape, pos,
                                  pos + bytes, boxes[i].offset};
    if (p->ht[i].dtype_name == NULL) p->ht[i].dtype_name = "?"; /* the writer refuses it */
    pos += bytes;
    p->it.n_hashes += dcp_blocks_of(bytes, p->it.block_bytes);
  }
  size_t m = (size_t)(p->it.n_hashes ? p->it.n_hashes : 1);
  if ((p->it.hashes = malloc(sizeof(uint64_t) * m)) == NULL)
    return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  uint64_t k = 0;
  for (int i = 0; i < n; i++) {
    FSDPC_TRY(hash_blocks(boxes[i].name, boxes[i].value, p->it.block_bytes, p->it.hashes + k));
    k += dcp_blocks_of(p->ht[i].end - p->ht[i].begin, p->it.block_bytes);
  }
  return STATUS_OK;
}

static fsdpc_status_t pending_seal(pending_t *p, const dcp_folder_t *folder) {
  p->it.files = (char **)folder->files; /* borrowed: never freed through it */
  p->it.n_files = folder->n_files;
  p->it.save_id = folder->save_id;
  return dcp_integrity_header_hash(&p->it, p->ht, p->n, &p->it.header);
}

static fsdpc_status_t write_sealed(const char *path, const dcp_box_t *boxes, int n,
                                   const pending_t *p) {
  const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
  bool listed = false;
  for (int i = 0; i < p->it.n_files; i++) listed = listed || strcmp(p->it.files[i], base) == 0;
  if (!listed)
    return err_set(STATUS_EINVAL, "checkpoint: %s is not among the folder's files given", path);
  st_writer_t *w = NULL;
  cJSON *info = cJSON_CreateObject();
  char *text = NULL, *record = NULL;
  fsdpc_status_t st = info ? STATUS_OK : err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  if (st == STATUS_OK) st = st_writer_new(&w);
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    const fsdpc_tensor_t *t = boxes[i].value;
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
    cJSON_AddItemToObject(info, boxes[i].name, item);
    st = st_writer_add(w, boxes[i].name, t);
  }
  if (st == STATUS_OK) st = dcp_integrity_format(&p->it, &record);
  if (st == STATUS_OK && (text = cJSON_PrintUnformatted(info)) == NULL)
    st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  if (st == STATUS_OK) st = st_writer_set_metadata(w, "DCP_SHARDING_INFO", text);
  if (st == STATUS_OK) st = st_writer_set_metadata(w, "DCP_VERSION", DCP_VERSION);
  if (st == STATUS_OK) st = st_writer_set_metadata(w, "format", "pt");
  if (st == STATUS_OK) st = st_writer_set_metadata(w, DCP_INTEGRITY_KEY, record);
  if (st == STATUS_OK) st = st_writer_save(w, path);
  free(text);
  free(record);
  cJSON_Delete(info);
  st_writer_free(w);
  return st;
}

fsdpc_status_t dcp_write_file(const char *path, const dcp_box_t *boxes, int n,
                              const dcp_folder_t *folder) {
  ARG_NONNULL(path);
  if (n > 0) ARG_NONNULL(boxes);
  ARG_NONNULL(folder);
  pending_t p;
  fsdpc_status_t st = pending_hash(boxes, n, &p);
  if (st == STATUS_OK) st = pending_seal(&p, folder);
  if (st == STATUS_OK) st = write_sealed(path, boxes, n, &p);
  pending_free(&p);
  return st;
}

fsdpc_status_t dcp_shard_boxes(const dcp_entry_t *entries, int n, dcp_box_t *b, int *count) {
  if (n > 0) ARG_NONNULL(entries);
  ARG_NONNULL(b);
  ARG_NONNULL(count);
  *count = 0;
  FSDPC_TRY(dcp_check_entries(entries, n, true, "dcp_shard_boxes"));
  for (int i = 0; i < n; i++) {
    bool mine;
    FSDPC_TRY(writes_shard(entries[i].name, entries[i].value, &mine));
    if (!mine) continue;
    b[*count].name = entries[i].name;
    b[*count].value = dtensor_local(entries[i].value);
    dtensor_offset(entries[i].value, b[*count].offset);
    (*count)++;
  }
  return STATUS_OK;
}

void dcp_shard_name(int rank, char *out, size_t size) {
  if (out == NULL || size == 0) return;
  snprintf(out, size, "shard-%05d.safetensors", rank);
}

/* Writes this rank's file into folder tmp, listing the files of every rank that writes one
 * and the save's id: a hash of every file's contents, so that the same save repeated gives
 * the same bytes and two different saves different ids. Collective over pg. */
static fsdpc_status_t write_shards(const char *tmp, const dcp_entry_t *entries, int n, pg_t *pg,
                                   uint64_t *save_id) {
  int rank = pg_rank(pg), size = pg_size(pg);
  dcp_box_t *b = calloc((size_t)(n > 0 ? n : 1), sizeof *b);
  uint64_t *mine = calloc(2, sizeof(uint64_t));
  uint64_t *all = calloc(2 * (size_t)size, sizeof(uint64_t));
  char **files = calloc((size_t)size, sizeof(char *));
  int count = 0, n_files = 0;
  pending_t p = {0};
  fsdpc_status_t st = b && mine && all && files
                          ? STATUS_OK
                          : err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  if (st == STATUS_OK) st = dcp_shard_boxes(entries, n, b, &count);
  if (st == STATUS_OK && count > 0) st = pending_hash(b, count, &p);
  if (st == STATUS_OK && count > 0) st = pending_seal(&p, &(dcp_folder_t){NULL, 0, 0});
  if (st == STATUS_OK && count > 0) {
    mine[0] = 1;
    mine[1] = p.it.header; /* this file's contents */
  }
  /* every rank learns which ranks write and what; a rank that failed takes part (and says so
   * after) */
  fsdpc_status_t got =
      mine && all ? pg_host_all_gather(pg, mine, all, 2, PG_HOST_I64) : STATUS_ENOMEM;
  if (st == STATUS_OK) st = got;
  uint64_t id = all ? dcp_block_hash(all, sizeof(uint64_t) * 2 * (size_t)size) : 0;
  if (save_id) *save_id = id;
  bool any = false;
  for (int r = 0; r < size && all != NULL; r++) any = any || all[2 * r];
  if (st == STATUS_OK && !any) /* every rank sees it */
    st = err_set(STATUS_EINVAL,
                 "checkpoint save into %s: nothing to save (no entries, or only tensors without "
                 "elements)",
                 tmp);
  for (int r = 0; r < size && st == STATUS_OK; r++) {
    if (!all[2 * r]) continue;
    if ((files[n_files] = malloc(32)) == NULL) {
      st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
      break;
    }
    dcp_shard_name(r, files[n_files++], 32);
  }
  if (st == STATUS_OK && count > 0) {
    dcp_folder_t folder = {(const char *const *)files, n_files, id};
    st = pending_seal(&p, &folder);
    char path[DCP_JOIN_MAX], name[32];
    dcp_shard_name(rank, name, sizeof name);
    if (st == STATUS_OK) st = file_join(path, sizeof path, tmp, name);
    if (st == STATUS_OK) st = write_sealed(path, b, count, &p);
  }
  pending_free(&p);
  for (int i = 0; i < n_files; i++) free(files[i]);
  free(files);
  free(mine);
  free(all);
  free(b);
  return st;
}

fsdpc_status_t dcp_prepare(const char *dir, char *tmp, size_t size, pg_t *pg) {
  ARG_NONNULL(dir);
  ARG_NONNULL(tmp);
  ARG_NONNULL(pg);
  int rank = pg_rank(pg);
  fsdpc_status_t st = STATUS_OK;
  if (strlen(dir) + 8 >= DCP_PATH_MAX || size < DCP_PATH_MAX)
    st = err_set(STATUS_EINVAL, "checkpoint: path too long");
  else
    snprintf(tmp, size, "%s.tmp", dir);
  /* one folder for the whole group: a rank naming another would write into nothing */
  int other = -1;
  FSDPC_TRY(pg_agree(pg, st));
  FSDPC_TRY(pg_host_first_differing(pg, XXH64(dir, strlen(dir), 0), &other));
  if (other >= 0)
    return err_set(STATUS_EINVAL,
                   "checkpoint: the ranks of the save name different folders (this rank '%s'; "
                   "rank %d of the group another than rank 0's): every rank passes the same",
                   dir, other);
  struct stat sb;
  if (rank == 0 && st == STATUS_OK) {
    if (lstat(dir, &sb) == 0)
      st = err_set(STATUS_EINVAL, "checkpoint: %s already exists", dir);
    else /* what a save that died before its commit left goes; nothing else of that name */
      st = file_claim_temp_dir(tmp);
    if (st != STATUS_OK && strncmp(err_detail(), "checkpoint:", 11) != 0)
      st = err_prefix(st, "checkpoint");
  }
  return pg_agree(pg, st);
}

/* One entry of a save, as every rank sees it: its tensor's name (hashed), global element
 * count, the elements this rank writes of it (0: another rank of its replicas does), shape
 * and dtype (hashed), the ranks of its mesh and this rank. */
typedef struct cover {
  int64_t name, global, local, shape, ranks, rank;
} cover_t;
#define COVER_WORDS ((int)(sizeof(cover_t) / sizeof(int64_t)))

static int cmp_cover(const void *x, const void *y) {
  const cover_t *a = x, *b = y;
  if (a->name != b->name) return a->name < b->name ? -1 : 1;
  return (a->rank > b->rank) - (a->rank < b->rank);
}

static int64_t hash63(const void *data, size_t bytes, uint64_t seed) {
  return (int64_t)(XXH64(data, bytes, seed) >> 1);
}

/* The ranks' entries of a save agree: every rank of a tensor's mesh passes it, with the same
 * global shape and dtype, and their shards add up to the whole (a rank that leaves out its
 * shard of a tensor the others save, or passes another shape, would otherwise write a folder
 * no load takes, found only then; one of a replicated tensor's ranks passing another shape
 * would go unseen, its replica not written). Ranks may save different tensors (a pipeline's
 * stages). Every rank reaches the same verdict from the same table. Collective over pg. */
static fsdpc_status_t check_coverage(const char *folder, const dcp_entry_t *entries, int n,
                                     pg_t *pg) {
  int R = pg_size(pg), me = pg_rank(pg);
  int64_t mine = 0, *counts = calloc((size_t)R, sizeof *counts);
  cover_t *rec = calloc((size_t)(n > 0 ? n : 1), sizeof *rec), *all = NULL;
  fsdpc_status_t st =
      counts && rec ? STATUS_OK : err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    bool writes;
    st = writes_shard(entries[i].name, entries[i].value, &writes);
    if (st != STATUS_OK) break;
    const dtensor_t *v = entries[i].value;
    int64_t g = 1, d[TENSOR_MAX_DIMS + 2] = {dtensor_ndim(v), dtensor_local(v)->dtype};
    for (int k = 0; k < dtensor_ndim(v); k++) g *= d[2 + k] = dtensor_shape(v)[k];
    rec[mine++] = (cover_t){hash63(entries[i].name, strlen(entries[i].name), 0),
                            g,
                            writes ? tensor_numel(dtensor_local(v)) : 0,
                            hash63(d, sizeof(int64_t) * (size_t)(2 + dtensor_ndim(v)), 0),
                            mesh_numel(dtensor_mesh(v)),
                            me};
  }
  /* every step agreed: a rank that fails one (its memory) never leaves the others waiting in
   * the next exchange */
  st = pg_agree(pg, st);
  if (st == STATUS_OK) st = pg_host_all_gather(pg, &mine, counts, 1, PG_HOST_I64);
  int64_t M = 0;
  for (int r = 0; r < R && st == STATUS_OK; r++) M = counts[r] > M ? counts[r] : M;
  cover_t *padded = NULL;
  if (st == STATUS_OK) {
    padded = calloc((size_t)(M ? M : 1), sizeof *padded);
    all = calloc((size_t)R * (size_t)(M ? M : 1), sizeof *all);
    st = pg_agree(
        pg, padded && all ? STATUS_OK : err_set(STATUS_ENOMEM, "checkpoint: out of host memory"));
  }
  if (st == STATUS_OK) {
    memcpy(padded, rec, sizeof *rec * (size_t)mine);
    st = pg_host_all_gather(pg, padded, all, (int)(M * COVER_WORDS), PG_HOST_I64);
  }
  free(padded);
  int64_t total = 0;
  for (int r = 0; r < R && st == STATUS_OK; r++) /* the rows each rank filled, together */
    for (int64_t k = 0; k < counts[r]; k++) all[total++] = all[(int64_t)r * M + k];
  if (st == STATUS_OK) qsort(all, (size_t)total, sizeof *all, cmp_cover);
  const cover_t *bad = NULL;
  int64_t held = 0, passed = 0;
  bool same = true;
  for (int64_t a = 0, b; a < total && st == STATUS_OK && bad == NULL; a = b) {
    held = 0;
    same = true;
    for (b = a; b < total && all[b].name == all[a].name; b++) {
      held += all[b].local;
      same = same && all[b].shape == all[a].shape && all[b].ranks == all[a].ranks;
    }
    passed = b - a;
    if (!same || held != all[a].global || passed != all[a].ranks) bad = &all[a];
  }
  if (bad != NULL) { /* its name from the ranks that pass it, for every rank to say */
    enum { NAME_MAX_SHOWN = 256 };
    int32_t mine_name[NAME_MAX_SHOWN] = {0}, name[NAME_MAX_SHOWN];
    for (int i = 0; i < n; i++)
      if (hash63(entries[i].name, strlen(entries[i].name), 0) == bad->name)
        for (int k = 0; k < NAME_MAX_SHOWN - 1 && entries[i].name[k]; k++)
          mine_name[k] = (unsigned char)entries[i].name[k];
    st = pg_host_all_reduce(pg, mine_name, name, NAME_MAX_SHOWN, PG_HOST_I32, REDUCE_MAX);
    char who[NAME_MAX_SHOWN + 8];
    size_t len = 0;
    who[len++] = '\'';
    for (int k = 0; st == STATUS_OK && k < NAME_MAX_SHOWN - 1 && name[k]; k++)
      who[len++] = (char)name[k];
    who[len++] = '\'';
    who[len] = 0;
    if (st == STATUS_OK && same && passed != bad->ranks)
      st = err_set(STATUS_EINVAL,
                   "checkpoint save into %s: tensor %s is passed by %lld rank%s, its mesh has "
                   "%lld: every rank of a tensor's mesh passes it to the save",
                   folder, who, (long long)passed, passed == 1 ? "" : "s", (long long)bad->ranks);
    else if (st == STATUS_OK)
      st = err_set(STATUS_EINVAL,
                   "checkpoint save into %s: the ranks' shards of tensor %s hold %lld of its "
                   "%lld elements, or disagree on its shape or dtype: every rank saves its shard "
                   "of each tensor, with the same global shape and dtype",
                   folder, who, (long long)held, (long long)bad->global);
  }
  free(all);
  free(rec);
  free(counts);
  return pg_agree(pg, st);
}

fsdpc_status_t dcp_write(const char *folder, const dcp_entry_t *entries, int n, pg_t *pg,
                         uint64_t *save_id) {
  ARG_NONNULL(folder);
  if (n > 0) ARG_NONNULL(entries);
  ARG_NONNULL(pg);
  FSDPC_TRY(pg_agree(pg, dcp_check_entries(entries, n, true, "checkpoint save")));
  FSDPC_TRY(check_coverage(folder, entries, n, pg));
  return pg_agree(pg, write_shards(folder, entries, n, pg, save_id));
}

fsdpc_status_t dcp_commit(const char *tmp, const char *dir, pg_t *pg) {
  ARG_NONNULL(tmp);
  ARG_NONNULL(dir);
  ARG_NONNULL(pg);
  int rank = pg_rank(pg);
  fsdpc_status_t st = STATUS_OK;
  if (rank == 0) { /* the folders' entries (the files' names), then the rename, reach the disk */
    st = fsync_subfolders(tmp);
    if (st == STATUS_OK) st = fsync_path(tmp);
    if (st == STATUS_OK) st = file_commit_temp_dir(tmp, dir);
    if (st == STATUS_OK) {
      char parent[DCP_PATH_MAX];
      file_parent_of(dir, parent, sizeof parent);
      st = fsync_path(parent);
    }
  }
  return pg_agree(pg, st);
}

fsdpc_status_t dcp_save(const char *dir, const dcp_entry_t *entries, int n, pg_t *pg) {
  ARG_NONNULL(dir);
  if (n > 0) ARG_NONNULL(entries);
  ARG_NONNULL(pg);
  char tmp[DCP_JOIN_MAX];
  FSDPC_TRY(dcp_prepare(dir, tmp, sizeof tmp, pg));
  fsdpc_status_t st = dcp_write(tmp, entries, n, pg, NULL);
  if (st == STATUS_OK) st = dcp_commit(tmp, dir, pg);
  int rank = pg_rank(pg);
  if (st != STATUS_OK && rank == 0) file_discard_temp_dir(tmp); /* agreed: none writes */
  return st;
}
