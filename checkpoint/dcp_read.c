/* Checkpoint folders read back: every header and integrity record checked when the folder is
 * opened, each tensor's chunks indexed by name and checked to tile it, every read checked
 * block by block. */
#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "checkpoint/dcp.h"
#include "checkpoint/dcp_integrity.h"
#include "checkpoint/safetensors.h"
#include "mesh/world.h"

#define DCP_PATH_MAX 4096
#define DCP_JOIN_MAX (DCP_PATH_MAX + 320)
/* Reads go this many bytes at a time; a checked read's are whole blocks (at least one), each
 * piece handed to the checker as it arrives and hashed while the next is read. */
#define READ_JOB_BYTES ((uint64_t)16 << 20)
/* A partial read checks and copies this many bytes of rows at a time (at least one row), and
 * verify reads a chunk this many bytes at a time (whole blocks). */
#define READ_GROUP_BYTES (4 * READ_JOB_BYTES)
#define MAX_OFFSET 9007199254740992.0 /* 2^53: offsets JSON numbers hold exactly */

typedef struct rfile {
  st_file_t *f;
  char *base;            /* the file's name in the folder */
  cJSON *sharding;       /* DCP_SHARDING_INFO, or NULL */
  cJSON **entries;       /* its entries, sorted by name */
  int n_entries;
  int64_t (*offs)[TENSOR_MAX_DIMS]; /* per tensor in data order: saved_offsets */
  bool *has_offs;
  bool *has_crc; /* a legacy "crc32" of the whole chunk */
  uint32_t *crc;
  bool has_integrity;
  dcp_integrity_t it;
  uint64_t *first_block; /* per tensor in data order: its first hash in it.hashes */
} rfile_t;

typedef struct chunk {
  int file;
  const st_info_t *info;
  int64_t off[TENSOR_MAX_DIMS];
  uint64_t block;       /* bytes per checked block; 0: not checked */
  const uint64_t *hash; /* XXH3-64 of each block; NULL for a CRC-32 chunk (one block) */
  uint32_t crc;
} chunk_t;

struct dcp_reader {
  char dir[DCP_PATH_MAX];
  rfile_t *files;
  int n_files;
  dcp_checks_t checks;
  uint64_t block_bytes;
  dcp_tensor_t *list; /* sorted by name */
  int n_list;
  chunk_t *chunks; /* tensor i's: chunks[first[i] .. first[i + 1]) */
  int *first;
  dcp_checker_t *checker; /* hashes the blocks a read has just brought in */
};

static status_t oom(void) { return err_set(STATUS_ENOMEM, "checkpoint: out of host memory"); }

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static int cmp_entry(const void *a, const void *b) {
  return strcmp((*(cJSON *const *)a)->string, (*(cJSON *const *)b)->string);
}

/* ---- one file ---- */

static void rfile_close(rfile_t *rf) {
  st_close(rf->f);
  free(rf->base);
  cJSON_Delete(rf->sharding);
  free(rf->entries);
  free(rf->offs);
  free(rf->has_offs);
  free(rf->has_crc);
  free(rf->crc);
  free(rf->first_block);
  dcp_integrity_free(&rf->it);
}

/* Indexes the file's sharding entries by name (cJSON's own lookup is a linear walk). */
static status_t index_entries(rfile_t *rf) {
  const cJSON *info = rf->sharding;
  if (!cJSON_IsObject(info))
    return err_set(STATUS_EFORMAT, "%s: DCP_SHARDING_INFO is not a JSON object", st_path(rf->f));
  int n = 0;
  for (const cJSON *e = info->child; e; e = e->next) n++;
  if ((rf->entries = malloc(sizeof(cJSON *) * (size_t)(n > 0 ? n : 1))) == NULL) return oom();
  n = 0;
  for (cJSON *e = info->child; e; e = e->next) rf->entries[n++] = e;
  qsort(rf->entries, (size_t)n, sizeof(cJSON *), cmp_entry);
  rf->n_entries = n;
  for (int k = 1; k < n; k++)
    if (strcmp(rf->entries[k - 1]->string, rf->entries[k]->string) == 0)
      return err_set(STATUS_EFORMAT, "%s: DCP_SHARDING_INFO names tensor '%s' twice",
                     st_path(rf->f), rf->entries[k]->string);
  return STATUS_OK;
}

static int cmp_name_entry(const void *name, const void *e) {
  return strcmp(name, (*(cJSON *const *)e)->string);
}

static const cJSON *find_entry(const rfile_t *rf, const char *name) {
  cJSON *const *e = rf->n_entries ? bsearch(name, rf->entries, (size_t)rf->n_entries,
                                            sizeof(cJSON *), cmp_name_entry)
                                  : NULL;
  return e ? *e : NULL;
}

/* Tensor i's saved_offsets and legacy crc32 from the sharding info. */
static status_t parse_sharding(rfile_t *rf, int i) {
  const st_info_t *t = st_tensor(rf->f, i);
  const cJSON *e = rf->sharding ? find_entry(rf, t->name) : NULL;
  if (e == NULL) return STATUS_OK; /* a whole tensor at offset 0 */
  const char *p = st_path(rf->f);
  const cJSON *offs = cJSON_GetObjectItemCaseSensitive(e, "saved_offsets");
  if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != t->ndim)
    return err_set(STATUS_EFORMAT,
                   "%s: DCP_SHARDING_INFO of tensor '%s' lacks saved_offsets of %d numbers", p,
                   t->name, t->ndim);
  int d = 0;
  for (const cJSON *v = offs->child; v; v = v->next, d++) {
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > MAX_OFFSET ||
        v->valuedouble != floor(v->valuedouble))
      return err_set(STATUS_EFORMAT, "%s: tensor '%s': saved_offsets are not offsets", p, t->name);
    rf->offs[i][d] = (int64_t)v->valuedouble;
  }
  rf->has_offs[i] = true;
  const cJSON *crc = cJSON_GetObjectItemCaseSensitive(e, "crc32");
  if (crc != NULL) {
    char *end = NULL;
    unsigned long x = cJSON_IsString(crc) ? strtoul(crc->valuestring, &end, 16) : 0;
    if (end == NULL || *end != 0 || end == crc->valuestring || x > 0xfffffffful)
      return err_set(STATUS_EFORMAT, "%s: tensor '%s': crc32 is not 8 hex digits", p, t->name);
    rf->has_crc[i] = true;
    rf->crc[i] = (uint32_t)x;
  }
  return STATUS_OK;
}

/* The integrity record: as many block hashes as the tensors need, and a header whose hash
 * matches. */
static status_t check_integrity(rfile_t *rf) {
  const char *p = st_path(rf->f);
  int n = st_num_tensors(rf->f);
  uint64_t blocks = 0, B = rf->it.block_bytes;
  for (int i = 0; i < n; i++) {
    const st_info_t *t = st_tensor(rf->f, i);
    rf->first_block[i] = blocks;
    blocks += dcp_blocks_of(t->end - t->begin, B);
  }
  if (blocks != rf->it.n_hashes)
    return err_set(STATUS_EFORMAT,
                   "%s: %s holds %llu block checksums, the file's tensors have %llu blocks: "
                   "the file is corrupt",
                   p, DCP_INTEGRITY_KEY, (unsigned long long)rf->it.n_hashes,
                   (unsigned long long)blocks);
  dcp_hdr_tensor_t *ht = calloc((size_t)(n > 0 ? n : 1), sizeof *ht);
  if (ht == NULL) return oom();
  for (int i = 0; i < n; i++) {
    const st_info_t *t = st_tensor(rf->f, i);
    ht[i] = (dcp_hdr_tensor_t){t->name,  t->dtype_name, t->ndim,
                               t->shape, t->begin,      t->end,
                               rf->has_offs[i] ? rf->offs[i] : NULL};
  }
  uint64_t h = 0;
  status_t st = dcp_integrity_header_hash(&rf->it, ht, n, &h);
  free(ht);
  if (st == STATUS_OK && h != rf->it.header)
    st = err_set(STATUS_EFORMAT,
                 "%s: the header does not match its checksum (a name, shape, dtype, offset or "
                 "block checksum was changed): the file is corrupt",
                 p);
  return st;
}

static status_t rfile_open(rfile_t *rf, const char *path) {
  TRY(st_open(&rf->f, path));
  int n = st_num_tensors(rf->f);
  size_t m = (size_t)(n > 0 ? n : 1);
  rf->offs = calloc(m, sizeof *rf->offs);
  rf->has_offs = calloc(m, sizeof(bool));
  rf->has_crc = calloc(m, sizeof(bool));
  rf->crc = calloc(m, sizeof(uint32_t));
  rf->first_block = calloc(m, sizeof(uint64_t));
  if (!rf->offs || !rf->has_offs || !rf->has_crc || !rf->crc || !rf->first_block) return oom();
  const char *info = st_metadata(rf->f, "DCP_SHARDING_INFO");
  if (info != NULL && (rf->sharding = cJSON_Parse(info)) == NULL)
    return err_set(STATUS_EFORMAT, "%s: DCP_SHARDING_INFO is not valid JSON", path);
  if (info != NULL) TRY(index_entries(rf));
  for (int i = 0; i < n; i++) TRY(parse_sharding(rf, i));
  const char *record = st_metadata(rf->f, DCP_INTEGRITY_KEY);
  if (record == NULL) return STATUS_OK;
  TRY(dcp_integrity_parse(path, record, &rf->it));
  rf->has_integrity = true;
  return check_integrity(rf);
}

/* ---- the folder ---- */

/* The *.safetensors names directly in dir, sorted. */
static status_t list_files(const char *dir, char ***out, int *count) {
  *out = NULL;
  *count = 0;
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
        st = oom();
        break;
      }
      names = nn;
    }
    if ((names[n] = strdup(e->d_name)) == NULL)
      st = oom();
    else
      n++;
  }
  closedir(d);
  if (st == STATUS_OK && n == 0)
    st = err_set(STATUS_EFORMAT, "checkpoint: %s holds no .safetensors file", dir);
  if (st != STATUS_OK) {
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    return st;
  }
  qsort(names, (size_t)n, sizeof(char *), cmp_str);
  *out = names;
  *count = n;
  return STATUS_OK;
}

/* Every file records the folder's files: the same list, naming exactly the files present. */
static status_t check_file_lists(const dcp_reader_t *r) {
  const dcp_integrity_t *ref = &r->files[0].it;
  for (int i = 1; i < r->n_files; i++) {
    const dcp_integrity_t *it = &r->files[i].it;
    bool same = it->n_files == ref->n_files && it->save_id == ref->save_id;
    for (int k = 0; same && k < it->n_files; k++) same = strcmp(it->files[k], ref->files[k]) == 0;
    if (!same)
      return err_set(STATUS_EFORMAT,
                     "checkpoint %s: %s and %s belong to different saves (their ids or file "
                     "lists differ): files of two checkpoints are mixed",
                     r->dir, r->files[0].base, r->files[i].base);
  }
  char **listed = malloc(sizeof(char *) * (size_t)(ref->n_files ? ref->n_files : 1));
  if (listed == NULL) return oom();
  memcpy(listed, ref->files, sizeof(char *) * (size_t)ref->n_files);
  qsort(listed, (size_t)ref->n_files, sizeof(char *), cmp_str);
  status_t st = STATUS_OK;
  int a = 0, b = 0; /* merge the two sorted lists: present (r->files) and listed */
  while (st == STATUS_OK && (a < r->n_files || b < ref->n_files)) {
    int c = a == r->n_files    ? 1
            : b == ref->n_files ? -1
                                : strcmp(r->files[a].base, listed[b]);
    if (c < 0)
      st = err_set(STATUS_EFORMAT,
                   "checkpoint %s: %s is not one of the files this checkpoint lists (a file of "
                   "another checkpoint?)",
                   r->dir, r->files[a].base);
    else if (c > 0)
      st = err_set(STATUS_EFORMAT,
                   "checkpoint %s: %s is missing (the checkpoint's files list it): the "
                   "checkpoint is incomplete",
                   r->dir, listed[b]);
    else if (b + 1 < ref->n_files && strcmp(listed[b], listed[b + 1]) == 0)
      st = err_set(STATUS_EFORMAT, "checkpoint %s: the files list names %s twice", r->dir,
                   listed[b]);
    a += c <= 0;
    b += c >= 0;
  }
  free(listed);
  return st;
}

/* How the folder's chunks are checked: every file has an integrity record, or none has one
 * (then a legacy crc32 on every chunk, or on none: a folder written by another tool). */
static status_t decide_checks(dcp_reader_t *r) {
  int with = 0;
  for (int i = 0; i < r->n_files; i++) with += r->files[i].has_integrity;
  if (with == r->n_files) {
    r->checks = DCP_CHECKS_BLOCKS;
    r->block_bytes = r->files[0].it.block_bytes;
    return check_file_lists(r);
  }
  if (with > 0) {
    int a = 0, b = 0;
    while (!r->files[a].has_integrity) a++;
    while (r->files[b].has_integrity) b++;
    return err_set(STATUS_EFORMAT,
                   "checkpoint %s: %s has no %s record while %s has one: the record was "
                   "removed, or the file belongs to another checkpoint",
                   r->dir, r->files[b].base, DCP_INTEGRITY_KEY, r->files[a].base);
  }
  const rfile_t *with_crc = NULL;
  for (int i = 0; i < r->n_files && !with_crc; i++)
    for (int k = 0; k < st_num_tensors(r->files[i].f) && !with_crc; k++)
      if (r->files[i].has_crc[k]) with_crc = &r->files[i];
  r->checks = with_crc ? DCP_CHECKS_CHUNKS : DCP_CHECKS_NONE;
  for (int i = 0; i < r->n_files && with_crc; i++)
    for (int k = 0; k < st_num_tensors(r->files[i].f); k++) {
      const st_info_t *t = st_tensor(r->files[i].f, k);
      if (!r->files[i].has_crc[k] && t->end > t->begin)
        return err_set(STATUS_EFORMAT,
                       "%s: tensor '%s' has no crc32 while the other chunks of the folder (in "
                       "%s) have one: a checksum was removed",
                       st_path(r->files[i].f), t->name, with_crc->base);
    }
  return STATUS_OK;
}

/* A (name, file, position) of every tensor of every file, to sort by name. */
typedef struct ref {
  const char *name;
  int file, index;
} ref_t;

static int cmp_ref(const void *a, const void *b) {
  const ref_t *x = a, *y = b;
  int c = strcmp(x->name, y->name);
  return c ? c : x->file - y->file;
}

static void fill_chunk(const dcp_reader_t *r, int file, int index, chunk_t *c) {
  const rfile_t *rf = &r->files[file];
  const st_info_t *t = st_tensor(rf->f, index);
  c->file = file;
  c->info = t;
  memcpy(c->off, rf->offs[index], sizeof c->off);
  if (r->checks == DCP_CHECKS_BLOCKS) {
    c->block = rf->it.block_bytes;
    c->hash = rf->it.hashes + rf->first_block[index];
  } else if (r->checks == DCP_CHECKS_CHUNKS) {
    c->block = t->end - t->begin > 0 ? t->end - t->begin : 1;
    c->crc = rf->crc[index];
  }
}

/* The chunks of one tensor tile it exactly: no two overlap and their elements add up to the
 * tensor's (every chunk lies inside it: the shape is the largest end). */
static status_t check_tiling(const dcp_reader_t *r, const dcp_tensor_t *t, const chunk_t *c,
                             int nc) {
  int nd = t->ndim;
  uint64_t total = 1, sum = 0;
  bool huge = false;
  for (int d = 0; d < nd; d++) huge |= __builtin_mul_overflow(total, (uint64_t)t->shape[d], &total);
  for (int k = 0; k < nc; k++) {
    uint64_t v = 1;
    for (int d = 0; d < nd; d++) v *= (uint64_t)c[k].info->shape[d]; /* bounded by the file */
    huge |= __builtin_add_overflow(sum, v, &sum);
  }
  char a[96];
  if (huge || sum != total)
    return err_set(STATUS_EFORMAT,
                   "checkpoint %s: the chunks of tensor '%s' hold %llu elements, its shape %s has "
                   "%llu: a chunk is missing, repeated or misplaced",
                   r->dir, t->name, (unsigned long long)sum, shape_str(nd, t->shape, a, sizeof a),
                   (unsigned long long)total);
  if (nd == 0) return STATUS_OK; /* one chunk of one element */
  /* sweep along dimension 0: only chunks whose rows meet can overlap */
  int *order = malloc(sizeof(int) * (size_t)nc);
  if (order == NULL) return oom();
  for (int k = 0; k < nc; k++) order[k] = k;
  for (int i = 1; i < nc; i++) /* insertion sort by first row: chunks come nearly sorted */
    for (int j = i; j > 0 && c[order[j - 1]].off[0] > c[order[j]].off[0]; j--) {
      int x = order[j];
      order[j] = order[j - 1];
      order[j - 1] = x;
    }
  status_t st = STATUS_OK;
  for (int i = 0; i < nc && st == STATUS_OK; i++) {
    const chunk_t *p = &c[order[i]];
    for (int j = i + 1; j < nc && st == STATUS_OK; j++) {
      const chunk_t *q = &c[order[j]];
      if (q->off[0] >= p->off[0] + p->info->shape[0]) break;
      bool meet = true;
      for (int d = 0; d < nd && meet; d++)
        meet = q->off[d] < p->off[d] + p->info->shape[d] && p->off[d] < q->off[d] + q->info->shape[d];
      if (meet)
        st = err_set(STATUS_EFORMAT,
                     "checkpoint %s: tensor '%s': the chunks in %s and %s overlap: the "
                     "checkpoint is corrupt",
                     r->dir, t->name, r->files[p->file].base, r->files[q->file].base);
    }
  }
  free(order);
  return st;
}

/* Folds the chunks of one tensor into its description and checks them. */
static status_t fold_tensor(const dcp_reader_t *r, const chunk_t *c, int nc, dcp_tensor_t *e) {
  const st_info_t *t = c[0].info;
  if ((e->name = strdup(t->name)) == NULL) return oom();
  e->dtype = t->dtype;
  e->dtype_name = t->dtype_name;
  e->ndim = t->ndim;
  for (int q = 0; q < nc; q++) {
    const st_info_t *ci = c[q].info;
    if (ci->ndim != t->ndim || strcmp(ci->dtype_name, t->dtype_name) != 0)
      return err_set(STATUS_EFORMAT,
                     "%s: tensor '%s' is stored as %s with %d dimensions here and as %s with %d "
                     "in %s",
                     st_path(r->files[c[q].file].f), t->name, ci->dtype_name, ci->ndim,
                     t->dtype_name, t->ndim, r->files[c[0].file].base);
    for (int d = 0; d < t->ndim; d++) {
      if (c[q].off[d] + ci->shape[d] > e->shape[d]) e->shape[d] = c[q].off[d] + ci->shape[d];
    }
    e->chunks++;
    e->bytes += ci->end - ci->begin;
  }
  return check_tiling(r, e, c, nc);
}

/* The tensor table: every name once, its chunks together. */
static status_t build_table(dcp_reader_t *r) {
  int total = 0;
  for (int i = 0; i < r->n_files; i++) total += st_num_tensors(r->files[i].f);
  size_t m = (size_t)(total > 0 ? total : 1);
  ref_t *refs = malloc(sizeof(ref_t) * m);
  r->chunks = calloc(m, sizeof(chunk_t));
  r->list = calloc(m, sizeof(dcp_tensor_t));
  r->first = calloc(m + 1, sizeof(int));
  if (refs == NULL || r->chunks == NULL || r->list == NULL || r->first == NULL) {
    free(refs);
    return oom();
  }
  int k = 0;
  for (int i = 0; i < r->n_files; i++)
    for (int j = 0; j < st_num_tensors(r->files[i].f); j++)
      refs[k++] = (ref_t){st_tensor(r->files[i].f, j)->name, i, j};
  qsort(refs, (size_t)total, sizeof(ref_t), cmp_ref);
  for (int i = 0; i < total; i++) fill_chunk(r, refs[i].file, refs[i].index, &r->chunks[i]);
  free(refs);
  status_t st = STATUS_OK;
  for (int i = 0; i < total && st == STATUS_OK;) {
    int j = i + 1;
    while (j < total && strcmp(r->chunks[j].info->name, r->chunks[i].info->name) == 0) j++;
    r->first[r->n_list] = i;
    st = fold_tensor(r, &r->chunks[i], j - i, &r->list[r->n_list]);
    if (r->list[r->n_list].name != NULL) r->n_list++;
    i = j;
  }
  r->first[r->n_list] = total;
  return st;
}

status_t dcp_reader_open(const char *dir, dcp_reader_t **out) {
  *out = NULL;
  dcp_reader_t *r = calloc(1, sizeof *r);
  if (r == NULL) return oom();
  snprintf(r->dir, sizeof r->dir, "%s", dir);
  char **names = NULL;
  int n = 0;
  status_t st = list_files(dir, &names, &n);
  if (st == STATUS_OK && (r->files = calloc((size_t)n, sizeof(rfile_t))) == NULL) st = oom();
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    char path[DCP_JOIN_MAX];
    snprintf(path, sizeof path, "%.4000s/%.255s", dir, names[i]);
    r->n_files = i + 1;
    r->files[i].base = names[i]; /* owned by the file now */
    names[i] = NULL;
    st = rfile_open(&r->files[i], path);
  }
  for (int i = 0; i < n; i++) free(names[i]);
  free(names);
  if (st == STATUS_OK) st = decide_checks(r);
  if (st == STATUS_OK) st = build_table(r);
  if (st == STATUS_OK) st = dcp_checker_new(&r->checker);
  if (st != STATUS_OK) {
    dcp_reader_close(r);
    return st;
  }
  *out = r;
  return STATUS_OK;
}

void dcp_reader_close(dcp_reader_t *r) {
  if (r == NULL) return;
  for (int i = 0; i < r->n_list; i++) free(r->list[i].name);
  for (int i = 0; i < r->n_files; i++) rfile_close(&r->files[i]);
  free(r->files);
  free(r->list);
  free(r->chunks);
  free(r->first);
  dcp_checker_free(r->checker);
  free(r);
}

dcp_checks_t dcp_reader_checks(const dcp_reader_t *r, uint64_t *block_bytes) {
  if (block_bytes) *block_bytes = r->block_bytes;
  return r->checks;
}

bool dcp_reader_save_id(const dcp_reader_t *r, uint64_t *id) {
  if (r->checks != DCP_CHECKS_BLOCKS) return false;
  *id = r->files[0].it.save_id;
  return true;
}

status_t dcp_reader_list(dcp_reader_t *r, const dcp_tensor_t **out, int *n) {
  *out = r->list;
  *n = r->n_list;
  return STATUS_OK;
}

static int cmp_name_tensor(const void *name, const void *t) {
  return strcmp(name, ((const dcp_tensor_t *)t)->name);
}

/* Tensor name's index in the table, or -1. */
static int find_tensor(const dcp_reader_t *r, const char *name) {
  const dcp_tensor_t *t = r->n_list ? bsearch(name, r->list, (size_t)r->n_list,
                                              sizeof(dcp_tensor_t), cmp_name_tensor)
                                    : NULL;
  return t ? (int)(t - r->list) : -1;
}

/* ---- checked reads ---- */

static status_t mismatch(const rfile_t *rf, const char *name, uint64_t size, uint64_t B,
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
static status_t read_blocks(const dcp_reader_t *r, const chunk_t *c, uint64_t lo, uint64_t hi,
                            void *buf) {
  rfile_t *rf = &r->files[c->file];
  const char *name = c->info->name;
  uint64_t size = c->info->end - c->info->begin, B = c->block;
  if (B == 0) { /* nothing to check: still in pieces (one very large read is slower) */
    for (uint64_t pos = lo; pos < hi; pos += READ_JOB_BYTES)
      TRY(st_read_bytes(rf->f, name, pos, (char *)buf + (pos - lo),
                        (size_t)(hi - pos < READ_JOB_BYTES ? hi - pos : READ_JOB_BYTES)));
    return STATUS_OK;
  }
  if (c->hash == NULL) { /* a legacy CRC-32 of the whole chunk, read in one piece */
    TRY(st_read_bytes(rf->f, name, lo, buf, (size_t)(hi - lo)));
    uLong x = crc32(0L, Z_NULL, 0);
    for (uint64_t o = 0; o < hi - lo; o += 1u << 30)
      x = crc32(x, (const Bytef *)buf + o,
                (uInt)(hi - lo - o < (1u << 30) ? hi - lo - o : (1u << 30)));
    return (uint32_t)x == c->crc ? STATUS_OK : mismatch(rf, name, size, B, 0);
  }
  uint64_t step = B < READ_JOB_BYTES ? READ_JOB_BYTES / B * B : B;
  status_t st = STATUS_OK;
  for (uint64_t pos = lo; pos < hi && st == STATUS_OK; pos += step) {
    uint64_t n = hi - pos < step ? hi - pos : step;
    char *p = (char *)buf + (pos - lo);
    st = st_read_bytes(rf->f, name, pos, p, (size_t)n);
    if (st == STATUS_OK) dcp_checker_push(r->checker, p, (size_t)n, (size_t)B, c->hash, pos / B, c);
  }
  return st;
}

/* Waits for the checks of every block read so far: st, or the first mismatch when st is OK.
 * Bytes a read brought in are trusted (copied out, converted, returned) only after this. */
static status_t checks_done(const dcp_reader_t *r, status_t st) {
  const void *who = NULL;
  uint64_t b = 0;
  if (dcp_checker_wait(r->checker, &who, &b) || st != STATUS_OK) return st;
  const chunk_t *c = who;
  return mismatch(&r->files[c->file], c->info->name, c->info->end - c->info->begin, c->block, b);
}

/* read_blocks, then the checks of what it read: the bytes are the caller's to use after this.
 * A range of one piece is hashed by this thread right after its read (the caller would only
 * wait for the helper). */
static status_t read_checked(const dcp_reader_t *r, const chunk_t *c, uint64_t lo, uint64_t hi,
                             void *buf) {
  if (c->hash == NULL || hi - lo > READ_JOB_BYTES) return checks_done(r, read_blocks(r, c, lo, hi, buf));
  rfile_t *rf = &r->files[c->file];
  uint64_t size = c->info->end - c->info->begin, B = c->block;
  TRY(st_read_bytes(rf->f, c->info->name, lo, buf, (size_t)(hi - lo)));
  for (uint64_t pos = lo; pos < hi; pos += B)
    if (dcp_block_hash((char *)buf + (pos - lo), (size_t)(hi - pos < B ? hi - pos : B)) !=
        c->hash[pos / B])
      return mismatch(rf, c->info->name, size, B, pos / B);
  return STATUS_OK;
}

/* Reads a whole chunk into dst (its shape), every block checked. */
static status_t read_whole(const dcp_reader_t *r, const chunk_t *c, tensor_t *dst) {
  const st_info_t *t = c->info;
  uint64_t size = t->end - t->begin;
  if (dst->device.type == DEVICE_CPU && dst->dtype == t->dtype && tensor_is_contiguous(dst))
    return read_blocks(r, c, 0, size, dst->data); /* straight into place */
  tensor_t raw;
  TRY(tensor_init(&raw, t->dtype, device_cpu(), t->ndim, t->shape));
  status_t st = read_checked(r, c, 0, size, raw.data);
  if (st == STATUS_OK) st = tensor_copy(dst, &raw);
  tensor_free(&raw);
  return st;
}

/* Reads the box at src (inside chunk c) with dst's shape into dst, checking every block the
 * box touches: rows along dimension 0 in groups of about READ_GROUP_BYTES, each group's
 * blocks read and checked, then its part of the box copied out. */
static status_t read_part(const dcp_reader_t *r, const chunk_t *c, const int64_t *src,
                          tensor_t *dst) {
  const st_info_t *t = c->info;
  int nd = t->ndim;
  if (c->block != 0 && c->hash == NULL) { /* one CRC for the chunk: read it whole, then the box */
    tensor_t whole, box = {0};
    TRY(tensor_init(&whole, t->dtype, device_cpu(), nd, t->shape));
    status_t st = checks_done(r, read_whole(r, c, &whole));
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
  int64_t rows = dst->shape[0], per = row >= READ_GROUP_BYTES ? 1 : (int64_t)(READ_GROUP_BYTES / row);
  if (per > rows) per = rows;
  char *buf = malloc((size_t)((uint64_t)per * row + 2 * B));
  if (buf == NULL) return oom();
  status_t st = STATUS_OK;
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
    tensor_t rows_view = {0}, box = {0}, out = {0};
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

/* Reads the box at global offset loff with local's shape of tensor name (global shape gshape)
 * into local, from the saved chunks that intersect it. */
static status_t load_box(const dcp_reader_t *r, const char *name, int nd, const int64_t *gshape,
                         const int64_t *loff, tensor_t *local, dcp_stats_t *s) {
  if (tensor_is_meta(local))
    return err_set(STATUS_EINVAL,
                   "checkpoint %s: tensor '%s': the destination is a meta tensor without "
                   "memory (allocate a deferred model's shards with nn_module_materialize "
                   "before loading)",
                   r->dir, name);
  int ti = find_tensor(r, name);
  if (ti < 0) return err_set(STATUS_EFORMAT, "checkpoint %s: missing tensor '%s'", r->dir, name);
  const dcp_tensor_t *t = &r->list[ti];
  const chunk_t *c = &r->chunks[r->first[ti]];
  char a[96], b[96];
  if (t->ndim != nd)
    return err_set(STATUS_ESHAPE, "%s: tensor '%s' has %d dimensions, the model's has %d",
                   st_path(r->files[c[0].file].f), name, t->ndim, nd);
  if (t->dtype == DTYPE_COUNT || dtype_is_float(t->dtype) != dtype_is_float(local->dtype))
    return err_set(STATUS_EDTYPE, "%s: tensor '%s' is stored as %s; the model's is %s",
                   st_path(r->files[c[0].file].f), name, t->dtype_name, dtype_name(local->dtype));
  if (memcmp(t->shape, gshape, sizeof(int64_t) * (size_t)nd) != 0)
    return err_set(STATUS_ESHAPE,
                   "checkpoint %s: tensor '%s' was saved with shape %s, the model's is %s",
                   r->dir, name, shape_str(nd, t->shape, a, sizeof a),
                   shape_str(nd, gshape, b, sizeof b));
  int64_t covered = 0;
  status_t st = STATUS_OK;
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
    tensor_t dst, next; /* the intersection inside this rank's shard */
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

status_t dcp_reader_read_box(dcp_reader_t *r, const char *name, int ndim,
                             const int64_t *global_shape, const int64_t *offset, tensor_t *dst) {
  return checks_done(r, load_box(r, name, ndim, global_shape, offset, dst, NULL));
}

status_t dcp_reader_load(dcp_reader_t *r, const dcp_entry_t *entries, int n, dcp_stats_t *stats) {
  dcp_stats_t s = {0};
  s.files = r->n_files;
  s.unchecked = r->checks == DCP_CHECKS_NONE;
  uint64_t read0 = 0;
  for (int i = 0; i < r->n_files; i++) read0 += st_bytes_read(r->files[i].f);
  status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    const dtensor_t *v = entries[i].value;
    int64_t loff[TENSOR_MAX_DIMS];
    dtensor_offset(v, loff);
    tensor_t local;
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

status_t dcp_load(const char *dir, const dcp_entry_t *entries, int n, dcp_stats_t *stats) {
  dcp_reader_t *r;
  TRY(dcp_reader_open(dir, &r));
  status_t st = dcp_reader_load(r, entries, n, stats);
  dcp_reader_close(r);
  return st;
}

/* ---- verify ---- */

status_t dcp_reader_verify(dcp_reader_t *r, const char *name, int *checked, int *unchecked) {
  *checked = *unchecked = 0;
  int ti = find_tensor(r, name);
  if (ti < 0) return err_set(STATUS_EFORMAT, "checkpoint %s: no tensor '%s'", r->dir, name);
  const chunk_t *c = &r->chunks[r->first[ti]];
  status_t st = STATUS_OK;
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
