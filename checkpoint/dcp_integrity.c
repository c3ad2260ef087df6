/* Integrity records of checkpoint shard files: block hashes and the canonical header. */
#include "checkpoint/dcp_integrity_impl.h"

#include "checkpoint/dcp.h"

#include <cJSON.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h> /* the widest vector unit the CPU has (AVX2, AVX-512) */
#endif

uint64_t dcp_blocks_of(uint64_t bytes, uint64_t block) { return (bytes + block - 1) / block; }

uint64_t dcp_block_hash(const void *data, size_t bytes) {
#if defined(__x86_64__)
  return (uint64_t)XXH3_64bits_dispatch(data, bytes); /* the same value, several times faster */
#else
  return (uint64_t)XXH3_64bits(data, bytes);
#endif
}

uint64_t dcp_first_bad_block(const void *data, size_t bytes, size_t block,
                             const uint64_t *expect, uint64_t first) {
  for (size_t o = 0, b = first; o < bytes; o += block, b++)
    if (dcp_block_hash((const char *)data + o, bytes - o < block ? bytes - o : block) != expect[b])
      return b;
  return UINT64_MAX;
}

uint64_t dcp_new_save_id(void) {
  static unsigned counter;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t seed[4] = {(uint64_t)ts.tv_sec, (uint64_t)ts.tv_nsec, (uint64_t)getpid(), counter++};
  return (uint64_t)XXH3_64bits(seed, sizeof seed);
}

/* ---- the canonical header ---- */

/* The canonical text, hashed as it is built. */
typedef struct canon {
  XXH3_state_t *s;
  bool failed;
} canon_t;

static void canon_add(canon_t *c, const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  int k = vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (k < 0 || (size_t)k >= sizeof buf || XXH3_64bits_update(c->s, buf, (size_t)k) != XXH_OK)
    c->failed = true;
}

/* A name: its length, then its bytes (no separator inside a name can be mistaken for one). */
static void canon_name(canon_t *c, const char *name) {
  size_t n = strlen(name);
  canon_add(c, "%zu:", n);
  if (XXH3_64bits_update(c->s, name, n) != XXH_OK) c->failed = true;
}

fsdpc_status_t dcp_integrity_header_hash(const dcp_integrity_t *it, const dcp_hdr_tensor_t *t,
                                         int n, uint64_t *out) {
  canon_t c = {XXH3_createState(), false};
  if (c.s == NULL || XXH3_64bits_reset(c.s) != XXH_OK) {
    XXH3_freeState(c.s);
    return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  }
  canon_add(&c, "fsdpc-integrity %d\nblock_bytes %" PRIu64 "\nfiles %d\n", DCP_INTEGRITY_VERSION,
            it->block_bytes, it->n_files);
  for (int i = 0; i < it->n_files; i++) {
    canon_name(&c, it->files[i]);
    canon_add(&c, "\n");
  }
  canon_add(&c, "save %016" PRIx64 "\ntensors %d\n", it->save_id, n);
  for (int i = 0; i < n; i++) {
    canon_name(&c, t[i].name);
    canon_add(&c, " %s %d", t[i].dtype_name, t[i].ndim);
    for (int d = 0; d < t[i].ndim; d++) canon_add(&c, " %" PRId64, t[i].shape[d]);
    canon_add(&c, " data %" PRIu64 " %" PRIu64 " at", t[i].begin, t[i].end);
    for (int d = 0; t[i].offsets && d < t[i].ndim; d++) canon_add(&c, " %" PRId64, t[i].offsets[d]);
    canon_add(&c, t[i].offsets ? "\n" : " -\n");
  }
  canon_add(&c, "blocks %" PRIu64 "\n", it->n_hashes);
  for (uint64_t b = 0; b < it->n_hashes; b++) canon_add(&c, "%016" PRIx64, it->hashes[b]);
  *out = (uint64_t)XXH3_64bits_digest(c.s);
  XXH3_freeState(c.s);
  return c.failed ? err_set(STATUS_EINVAL, "checkpoint: a name or value too long to hash")
                  : STATUS_OK;
}

/* ---- the record ---- */

fsdpc_status_t dcp_integrity_format(const dcp_integrity_t *it, char **out) {
  *out = NULL;
  char *blocks = malloc(16 * it->n_hashes + 1);
  cJSON *o = cJSON_CreateObject(), *files = cJSON_CreateArray();
  fsdpc_status_t st = STATUS_OK;
  if (blocks == NULL || o == NULL || files == NULL) {
    st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
    goto cleanup;
  }
  for (uint64_t b = 0; b < it->n_hashes; b++) snprintf(blocks + 16 * b, 17, "%016" PRIx64, it->hashes[b]);
  blocks[16 * it->n_hashes] = 0;
  for (int i = 0; i < it->n_files; i++) cJSON_AddItemToArray(files, cJSON_CreateString(it->files[i]));
  char header[17], save[17];
  snprintf(header, sizeof header, "%016" PRIx64, it->header);
  snprintf(save, sizeof save, "%016" PRIx64, it->save_id);
  cJSON_AddNumberToObject(o, "version", DCP_INTEGRITY_VERSION);
  cJSON_AddStringToObject(o, "hash", "xxh3-64");
  cJSON_AddNumberToObject(o, "block_bytes", (double)it->block_bytes);
  cJSON_AddItemToObject(o, "files", files);
  files = NULL;
  cJSON_AddStringToObject(o, "save", save);
  cJSON_AddStringToObject(o, "blocks", blocks);
  cJSON_AddStringToObject(o, "header", header);
  if ((*out = cJSON_PrintUnformatted(o)) == NULL)
    st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
cleanup:
  free(blocks);
  cJSON_Delete(files);
  cJSON_Delete(o);
  return st;
}

/* 16 hex digits into *out (see dcp_integrity_impl.h). */
bool dcp_parse_hex64(const char *s, uint64_t *out) {
  uint64_t v = 0;
  for (int i = 0; i < 16; i++) {
    char ch = s[i];
    int d = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
    if (d < 0) return false;
    v = v << 4 | (uint64_t)d;
  }
  *out = v;
  return true;
}

void dcp_integrity_free(dcp_integrity_t *it) {
  if (it == NULL) return;
  for (int i = 0; i < it->n_files; i++) free(it->files[i]);
  free(it->files);
  free(it->hashes);
  memset(it, 0, sizeof *it);
}

fsdpc_status_t dcp_integrity_parse(const char *path, const char *text, dcp_integrity_t *out) {
  memset(out, 0, sizeof *out);
  cJSON *o = cJSON_Parse(text);
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "version");
  const cJSON *h = cJSON_GetObjectItemCaseSensitive(o, "hash");
  const cJSON *b = cJSON_GetObjectItemCaseSensitive(o, "block_bytes");
  const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, "files");
  const cJSON *bl = cJSON_GetObjectItemCaseSensitive(o, "blocks");
  const cJSON *hd = cJSON_GetObjectItemCaseSensitive(o, "header");
  const cJSON *sv = cJSON_GetObjectItemCaseSensitive(o, "save");
  fsdpc_status_t st = STATUS_OK;
  if (!cJSON_IsObject(o)) {
    st = err_set(STATUS_EFORMAT, "%s: %s is not a JSON object", path, DCP_INTEGRITY_KEY);
    goto cleanup;
  }
  if (!cJSON_IsNumber(v) || v->valuedouble != DCP_INTEGRITY_VERSION || !cJSON_IsString(h) ||
      strcmp(h->valuestring, "xxh3-64") != 0) {
    st = err_set(STATUS_EFORMAT,
                 "%s: %s has an unknown version or hash (this build reads version %d, xxh3-64)",
                 path, DCP_INTEGRITY_KEY, DCP_INTEGRITY_VERSION);
    goto cleanup;
  }
  if (!cJSON_IsNumber(b) || b->valuedouble < (double)DCP_BLOCK_BYTES_MIN ||
      b->valuedouble > (double)DCP_BLOCK_BYTES_MAX || b->valuedouble != (double)(uint64_t)b->valuedouble ||
      (uint64_t)b->valuedouble % DCP_BLOCK_BYTES_MIN != 0 ||
      !cJSON_IsArray(f) || !cJSON_IsString(bl) || strlen(bl->valuestring) % 16 != 0 ||
      !cJSON_IsString(hd) || strlen(hd->valuestring) != 16 ||
      !dcp_parse_hex64(hd->valuestring, &out->header) || !cJSON_IsString(sv) ||
      strlen(sv->valuestring) != 16 || !dcp_parse_hex64(sv->valuestring, &out->save_id)) {
    st = err_set(STATUS_EFORMAT,
                 "%s: %s lacks block_bytes (a multiple of %llu up to %llu), files, save, "
                 "blocks or header, or one of them is malformed",
                 path, DCP_INTEGRITY_KEY, (unsigned long long)DCP_BLOCK_BYTES_MIN,
                 (unsigned long long)DCP_BLOCK_BYTES_MAX);
    goto cleanup;
  }
  out->block_bytes = (uint64_t)b->valuedouble;
  int nf = cJSON_GetArraySize(f);
  out->n_hashes = strlen(bl->valuestring) / 16;
  out->files = calloc((size_t)(nf ? nf : 1), sizeof(char *));
  out->hashes = malloc(sizeof(uint64_t) * (size_t)(out->n_hashes ? out->n_hashes : 1));
  if (out->files == NULL || out->hashes == NULL) {
    st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
    goto cleanup;
  }
  for (const cJSON *e = f->child; e; e = e->next) {
    if (!cJSON_IsString(e) || e->valuestring[0] == 0 || strchr(e->valuestring, '/')) {
      st = err_set(STATUS_EFORMAT, "%s: %s: files holds something other than file names", path,
                   DCP_INTEGRITY_KEY);
      goto cleanup;
    }
    if ((out->files[out->n_files] = strdup(e->valuestring)) == NULL) {
      st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
      goto cleanup;
    }
    out->n_files++;
  }
  for (uint64_t k = 0; k < out->n_hashes; k++)
    if (!dcp_parse_hex64(bl->valuestring + 16 * k, &out->hashes[k])) {
      st = err_set(STATUS_EFORMAT, "%s: %s: blocks holds something other than hex digits", path,
                   DCP_INTEGRITY_KEY);
      goto cleanup;
    }
cleanup:
  cJSON_Delete(o);
  if (st != STATUS_OK) dcp_integrity_free(out);
  return st;
}
