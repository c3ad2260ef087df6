/* One shard file of a checkpoint folder opened for reading: its header, its sharding info
 * indexed by name, and its integrity record checked against the header. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/dcp_reader_impl.h"

#define MAX_OFFSET 9007199254740992.0 /* 2^53: offsets JSON numbers hold exactly */

static int cmp_entry(const void *a, const void *b) {
  return strcmp((*(cJSON *const *)a)->string, (*(cJSON *const *)b)->string);
}

void dcp_rfile_close(rfile_t *rf) {
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
static fsdpc_status_t index_entries(rfile_t *rf) {
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
static fsdpc_status_t parse_sharding(rfile_t *rf, int i) {
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
static fsdpc_status_t check_integrity(rfile_t *rf) {
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
  fsdpc_status_t st = dcp_integrity_header_hash(&rf->it, ht, n, &h);
  free(ht);
  if (st == STATUS_OK && h != rf->it.header)
    st = err_set(STATUS_EFORMAT,
                 "%s: the header does not match its checksum (a name, shape, dtype, offset or "
                 "block checksum was changed): the file is corrupt",
                 p);
  return st;
}

fsdpc_status_t dcp_rfile_open(rfile_t *rf, const char *path) {
  FSDPC_TRY(st_open(path, &rf->f));
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
  if (info != NULL) FSDPC_TRY(index_entries(rf));
  for (int i = 0; i < n; i++) FSDPC_TRY(parse_sharding(rf, i));
  const char *record = st_metadata(rf->f, DCP_INTEGRITY_KEY);
  if (record == NULL) return STATUS_OK;
  FSDPC_TRY(dcp_integrity_parse(path, record, &rf->it));
  rf->has_integrity = true;
  return check_integrity(rf);
}
