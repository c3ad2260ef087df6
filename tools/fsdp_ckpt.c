/*
 * fsdp-ckpt: offline work on checkpoints, in one process.
 *
 *   fsdp-ckpt inspect DIR
 *   fsdp-ckpt export-hf DIR OUT [--dtype f32|bf16|f16] [--max-shard-bytes N] [--config FILE]
 *   fsdp-ckpt import-hf HFDIR OUT
 *   fsdp-ckpt reshard DIR --to CONFIG OUT [--world N] [--set key.path=value]...
 *                     [--embedding GLOB]...
 *
 * DIR is a training checkpoint (model/, optim/, train_state.json) or a folder of shard files.
 * export-hf writes a Hugging Face folder (model.safetensors, or model-0000k-of-0000n.safetensors
 * with model.safetensors.index.json, and config.json), streaming one tensor at a time so memory
 * stays bounded by the largest tensor. import-hf turns a Hugging Face folder into a
 * weights-only checkpoint that checkpoint.load resumes from (step 0, a fresh optimizer).
 * reshard lays a training checkpoint out as a run under another plan would have saved it
 * (one file per rank of that plan), reading each target shard's box once. All of them work on
 * checkpoints of any model: names and shapes come from the files.
 */
#include <cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/file.h"
#include "checkpoint/ckpt_reshard.h"
#include "checkpoint/dcp.h"
#include "checkpoint/hf_weights.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/train_ckpt.h"
#include "mesh/world.h"
#include "nn/llama.h"
#include "parallel/parallelize.h"
#include "parallel/plan.h"

#define PATH_LEN 4096

static void usage(FILE *f) {
  fprintf(f,
          "usage: fsdp-ckpt inspect DIR\n"
          "       fsdp-ckpt verify DIR\n"
          "       fsdp-ckpt export-hf DIR OUT [--dtype f32|bf16|f16] [--max-shard-bytes N] "
          "[--config FILE]\n"
          "       fsdp-ckpt import-hf HFDIR OUT\n"
          "       fsdp-ckpt reshard DIR --to CONFIG OUT [--world N] [--set key.path=value]...\n"
          "                 [--embedding GLOB]...\n"
          "       fsdp-ckpt --help | --version\n");
}

static bool is_dir(const char *p) {
  struct stat sb;
  return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* train_state.json of a training checkpoint, or NULL (a plain shard folder). */
static status_t read_state(const char *dir, cJSON **out) {
  char path[PATH_LEN];
  snprintf(path, sizeof path, "%.4000s/train_state.json", dir);
  *out = NULL;
  if (access(path, F_OK) != 0) return STATUS_OK;
  char *text;
  TRY(file_read_text(path, FILE_TEXT_MAX, &text));
  *out = cJSON_Parse(text);
  free(text);
  return *out ? STATUS_OK : err_set(STATUS_EFORMAT, "%s: not valid JSON", path);
}

/* The model config a training checkpoint records (saved_under.model), or NULL. */
static const cJSON *recorded_model(const cJSON *state) {
  const cJSON *m = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(state, "saved_under"), "model");
  return cJSON_IsObject(m) ? m : NULL;
}

/* Whether a Hugging Face config is the built-in Llama's (model_type "llama"). */
static bool is_llama(const cJSON *config) {
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(config, "model_type");
  return cJSON_IsString(t) && strcmp(t->valuestring, "llama") == 0;
}

/* A training checkpoint's train_state.json against its record and its folders; nothing for a
 * plain shard folder. */
static status_t check_state(const char *dir) {
  char path[PATH_LEN];
  snprintf(path, sizeof path, "%.4000s/train_state.json", dir);
  return access(path, F_OK) == 0 ? ckpt_check_state(dir) : STATUS_OK;
}

/* The folder of the model's shards: DIR/model in a training checkpoint, else DIR. */
static void model_folder(const char *dir, char *out, size_t size) {
  snprintf(out, size, "%.4000s/model", dir);
  if (!is_dir(out)) snprintf(out, size, "%s", dir);
}

static void shape_text(int nd, const int64_t *s, char *buf, size_t n) {
  size_t o = 0;
  buf[0] = 0;
  for (int d = 0; d < nd && o < n; d++)
    o += (size_t)snprintf(buf + o, n - o, "%s%lld", d ? "x" : "", (long long)s[d]);
  if (nd == 0) snprintf(buf, n, "scalar");
}

/* ---- inspect ---- */

/* A folder without checksums is read as it is: say so, once per folder. */
static void say_unchecked(const dcp_reader_t *r, const char *dir) {
  if (dcp_reader_checks(r, NULL) == DCP_CHECKS_NONE)
    printf("%s has no checksums (written by another tool): what is read from it is unchecked\n",
           dir);
}

/* What the reader checks in the folder, in words. */
static void checks_text(const dcp_reader_t *r, char *out, size_t size) {
  uint64_t block = 0;
  switch (dcp_reader_checks(r, &block)) {
    case DCP_CHECKS_BLOCKS:
      snprintf(out, size,
               "checksums on every %llu-byte block; headers, file list and tiling checked",
               (unsigned long long)block);
      break;
    case DCP_CHECKS_CHUNKS:
      snprintf(out, size, "a CRC-32 per chunk (an earlier version's files); headers unchecked");
      break;
    default:
      snprintf(out, size, "no checksums (written by another tool): its bytes cannot be checked");
  }
}

static status_t inspect_folder(const char *title, const char *dir) {
  dcp_reader_t *r;
  TRY(dcp_reader_open(dir, &r));
  const dcp_tensor_t *t;
  int n;
  status_t st = dcp_reader_list(r, &t, &n);
  if (st == STATUS_OK) {
    uint64_t total = 0;
    int files = 0;
    printf("%s (%s):\n", title, dir);
    printf("  %-52s %-6s %-14s %6s %12s\n", "tensor", "dtype", "shape", "chunks", "bytes");
    for (int i = 0; i < n; i++) {
      char sh[96];
      shape_text(t[i].ndim, t[i].shape, sh, sizeof sh);
      printf("  %-52s %-6s %-14s %6d %12llu\n", t[i].name, t[i].dtype_name, sh, t[i].chunks,
             (unsigned long long)t[i].bytes);
      total += t[i].bytes;
      files = t[i].chunks > files ? t[i].chunks : files;
    }
    char how[160];
    checks_text(r, how, sizeof how);
    printf("  %d tensors, %llu bytes of tensor data; %s\n", n, (unsigned long long)total, how);
  }
  dcp_reader_close(r);
  return st;
}

static status_t inspect(const char *dir) {
  if (!is_dir(dir)) return err_set(STATUS_EIO, "%s: not a folder", dir);
  TRY(check_state(dir));
  cJSON *state;
  TRY(read_state(dir, &state));
  if (state) {
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(state, "step");
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(state, "saved_under");
    printf("checkpoint %s: after step %lld\n", dir,
           cJSON_IsNumber(s) ? (long long)s->valuedouble : -1);
    const cJSON *it;
    cJSON_ArrayForEach(it, u) {
      if (strcmp(it->string, "model") == 0) continue;
      char *v = cJSON_PrintUnformatted(it);
      printf("  saved under %s: %s\n", it->string, v ? v : "?");
      free(v);
    }
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(u, "model");
    if (cJSON_IsObject(m)) {
      char *v = cJSON_PrintUnformatted(m);
      printf("  model config: %s\n", v ? v : "?");
      free(v);
    }
  }
  char model[PATH_LEN], optim[PATH_LEN];
  model_folder(dir, model, sizeof model);
  status_t st = inspect_folder("model", model);
  snprintf(optim, sizeof optim, "%.4000s/optim", dir);
  if (st == STATUS_OK && is_dir(optim)) st = inspect_folder("optimizer state", optim);
  cJSON_Delete(state);
  return st;
}

/* ---- verify ---- */

/* Checks every chunk of every tensor of one folder; reports each damaged tensor and adds the
 * counts. */
static status_t verify_folder(const char *dir, int *checked, int *unchecked, int *damaged) {
  dcp_reader_t *r;
  TRY(dcp_reader_open(dir, &r));
  const dcp_tensor_t *t;
  int n;
  status_t st = dcp_reader_list(r, &t, &n);
  char how[160];
  checks_text(r, how, sizeof how);
  printf("%s: %s\n", dir, how);
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    int ok = 0, none = 0;
    status_t vs = dcp_reader_verify(r, t[i].name, &ok, &none);
    if (vs == STATUS_ENOMEM) st = vs;
    if (vs != STATUS_OK) {
      fprintf(stderr, "fsdp-ckpt: %s\n", err_detail());
      (*damaged)++;
    }
    *checked += ok;
    *unchecked += none;
  }
  dcp_reader_close(r);
  return st;
}

/* Opens the whole checkpoint (model and optimizer state: headers, file lists, tiling) and reads
 * every block once, checking it: what a load checks of the blocks it reads, over all of them. */
static status_t verify(const char *dir) {
  if (!is_dir(dir)) return err_set(STATUS_EIO, "%s: not a folder", dir);
  TRY(check_state(dir));
  char model[PATH_LEN], optim[PATH_LEN];
  model_folder(dir, model, sizeof model);
  snprintf(optim, sizeof optim, "%.4000s/optim", dir);
  int checked = 0, unchecked = 0, damaged = 0;
  TRY(verify_folder(model, &checked, &unchecked, &damaged));
  if (is_dir(optim)) TRY(verify_folder(optim, &checked, &unchecked, &damaged));
  printf("%s: %d chunks match their checksums, %d saved without one, %d tensors damaged\n", dir,
         checked, unchecked, damaged);
  if (damaged > 0)
    return err_set(STATUS_EFORMAT, "%s: %d tensors damaged (named above)", dir, damaged);
  return STATUS_OK;
}

/* ---- export-hf ---- */

/* Names in natural order: digit runs compare as numbers (layers.2 before layers.10). */
static int natural_cmp(const char *a, const char *b) {
  while (*a && *b) {
    if (isdigit((unsigned char)*a) && isdigit((unsigned char)*b)) {
      char *ea, *eb;
      unsigned long long x = strtoull(a, &ea, 10), y = strtoull(b, &eb, 10);
      if (x != y) return x < y ? -1 : 1;
      a = ea;
      b = eb;
    } else {
      if (*a != *b) return (unsigned char)*a - (unsigned char)*b;
      a++;
      b++;
    }
  }
  return (unsigned char)*a - (unsigned char)*b;
}

static int cmp_by_name(const void *x, const void *y) {
  return natural_cmp((*(const dcp_tensor_t *const *)x)->name,
                     (*(const dcp_tensor_t *const *)y)->name);
}

typedef struct export_opts {
  dtype_t dtype; /* DTYPE_COUNT: as stored */
  uint64_t max_shard_bytes;
  const char *config;
} export_opts_t;

/* A Hugging Face config of any model written as config.json with torch_dtype set to dtype;
 * the built-in Llama's (model_type "llama") is checked and written in its normal form. origin
 * names where the config came from. */
static status_t write_config(const cJSON *config, const char *origin, dtype_t dtype,
                             const char *path) {
  if (!cJSON_IsObject(config))
    return err_set(STATUS_EFORMAT, "%s: a model config is not a JSON object", origin);
  if (is_llama(config)) {
    char *text = cJSON_PrintUnformatted(config);
    llama_config_t cfg;
    status_t st = text ? llama_config_from_hf_text(text, origin, &cfg)
                       : err_set(STATUS_ENOMEM, "out of host memory");
    free(text);
    TRY(st);
    return llama_config_to_hf(&cfg, dtype, path);
  }
  cJSON *c = cJSON_Duplicate(config, true);
  const char *names[] = {[DTYPE_F32] = "float32", [DTYPE_BF16] = "bfloat16",
                         [DTYPE_F16] = "float16"};
  const char *name = (size_t)dtype < sizeof names / sizeof names[0] ? names[dtype] : NULL;
  if (c && name) {
    cJSON_DeleteItemFromObjectCaseSensitive(c, "torch_dtype");
    cJSON_AddStringToObject(c, "torch_dtype", name);
  }
  char *text = c ? cJSON_Print(c) : NULL;
  cJSON_Delete(c);
  status_t st = text ? file_write_text(path, text) : err_set(STATUS_ENOMEM, "out of host memory");
  free(text);
  return st;
}

/* config.json: --config, or the model config the checkpoint was saved with. */
static status_t export_config(const char *dir, const export_opts_t *o, dtype_t dtype,
                              const char *path) {
  char *text = NULL, origin[PATH_LEN];
  cJSON *state = NULL, *given = NULL;
  const cJSON *config = NULL;
  if (o->config) {
    TRY(file_read_text(o->config, FILE_TEXT_MAX, &text));
    given = cJSON_Parse(text);
    free(text);
    if (given == NULL) return err_set(STATUS_EFORMAT, "%s: not valid JSON", o->config);
    config = given;
    snprintf(origin, sizeof origin, "%s", o->config);
  } else {
    TRY(read_state(dir, &state));
    config = recorded_model(state);
    snprintf(origin, sizeof origin, "%.4000s/train_state.json", dir);
  }
  status_t st = config ? write_config(config, origin, dtype, path)
                       : err_set(STATUS_EINVAL,
                                 "%s: no model config recorded in train_state.json; give "
                                 "--config CONFIG.json",
                                 dir);
  cJSON_Delete(given);
  cJSON_Delete(state);
  return st;
}

/* Writes tensors [first, last) of the sorted list into one file, one tensor in memory at a
 * time. */
static status_t export_file(dcp_reader_t *r, const dcp_tensor_t *const *t, int first, int last,
                            dtype_t want, const char *path, mesh_t *one) {
  st_writer_t *w;
  TRY(st_writer_new(&w));
  status_t st = st_writer_set_metadata(w, "format", "pt");
  for (int i = first; i < last && st == STATUS_OK; i++)
    st = st_writer_declare(w, t[i]->name, want == DTYPE_COUNT ? t[i]->dtype : want, t[i]->ndim,
                           t[i]->shape);
  if (st == STATUS_OK) st = st_writer_begin(w, path);
  placement_t rep = placement_replicate();
  for (int i = first; i < last && st == STATUS_OK; i++) {
    tensor_t full, conv = {0};
    dtensor_t *dt = NULL;
    st = tensor_init(&full, t[i]->dtype, device_cpu(), t[i]->ndim, t[i]->shape);
    if (st != STATUS_OK) break;
    st = dtensor_from_local(&dt, &full, one, &rep, t[i]->ndim, t[i]->shape);
    dcp_entry_t e = {t[i]->name, dt};
    if (st == STATUS_OK) st = dcp_reader_load(r, &e, 1, NULL);
    const tensor_t *src = &full;
    if (st == STATUS_OK && want != DTYPE_COUNT && want != full.dtype) {
      st = tensor_clone(&conv, &full, want, device_cpu());
      src = &conv;
    }
    if (st == STATUS_OK) st = st_writer_write(w, t[i]->name, src);
    tensor_free(&conv);
    dtensor_free(dt);
    tensor_free(&full);
  }
  if (st == STATUS_OK) st = st_writer_finish(w);
  st_writer_free(w);
  return st;
}

static status_t export_hf(const char *dir, const char *out, const export_opts_t *o) {
  char model[PATH_LEN];
  if (!is_dir(dir)) return err_set(STATUS_EIO, "%s: not a folder", dir);
  TRY(check_state(dir));
  model_folder(dir, model, sizeof model);
  if (is_dir(out) && rmdir(out) != 0)
    return err_set(STATUS_EINVAL, "%s: exists and is not empty", out);
  /* written as OUT.tmp, renamed when complete: a failure (a damaged block) leaves no OUT */
  char tmp[PATH_LEN + 8];
  snprintf(tmp, sizeof tmp, "%.4000s.tmp", out);
  dcp_remove_tree(tmp);
  dcp_reader_t *r;
  TRY(dcp_reader_open(model, &r));
  say_unchecked(r, model);
  const dcp_tensor_t *list;
  int n;
  const dcp_tensor_t **t = NULL;
  mesh_t *one = NULL;
  cJSON *index = NULL;
  status_t st = dcp_reader_list(r, &list, &n);
  if (st == STATUS_OK && (t = malloc(sizeof *t * (size_t)(n ? n : 1))) == NULL)
    st = err_set(STATUS_ENOMEM, "out of host memory");
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    t[i] = &list[i];
    if (list[i].dtype == DTYPE_COUNT || !dtype_is_float(list[i].dtype))
      st = err_set(STATUS_EDTYPE, "%s: tensor '%s' is stored as %s, not a float dtype", model,
                   list[i].name, list[i].dtype_name);
  }
  if (st == STATUS_OK) qsort(t, (size_t)n, sizeof *t, cmp_by_name);
  if (st == STATUS_OK) st = mesh_init_local(&one, "one", DEVICE_CPU);
  if (st == STATUS_OK && mkdir(tmp, 0755) != 0)
    st = err_set(STATUS_EIO, "%s: cannot create: %s", tmp, strerror(errno));
  if (st == STATUS_OK) { /* first: the config may be missing, before any tensor is written */
    char path[PATH_LEN + 64];
    snprintf(path, sizeof path, "%.4000s/config.json", tmp);
    dtype_t cd = o->dtype != DTYPE_COUNT ? o->dtype : n > 0 ? t[0]->dtype : DTYPE_F32;
    st = export_config(dir, o, cd, path);
  }
  /* files: consecutive tensors up to max_shard_bytes each (a larger tensor gets its own) */
  int *start = st == STATUS_OK ? calloc((size_t)n + 2, sizeof(int)) : NULL;
  int files = 0;
  uint64_t total = 0, cur = 0;
  if (st == STATUS_OK && start == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    size_t es = dtype_size(o->dtype == DTYPE_COUNT ? t[i]->dtype : o->dtype);
    uint64_t b = (uint64_t)t[i]->bytes / dtype_size(t[i]->dtype) * es;
    if (i == 0 || (cur > 0 && cur + b > o->max_shard_bytes)) {
      start[files++] = i;
      cur = 0;
    }
    cur += b;
    total += b;
  }
  if (st == STATUS_OK && n > 0) start[files] = n;
  if (st == STATUS_OK && files > 1) {
    index = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(index, "metadata");
    cJSON_AddNumberToObject(meta, "total_size", (double)total);
    cJSON_AddObjectToObject(index, "weight_map");
  }
  for (int f = 0; f < files && st == STATUS_OK; f++) {
    char name[64], path[PATH_LEN + 64];
    if (files == 1)
      snprintf(name, sizeof name, "model.safetensors");
    else
      snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", f + 1, files);
    snprintf(path, sizeof path, "%.4000s/%s", tmp, name);
    st = export_file(r, t, start[f], start[f + 1], o->dtype, path, one);
    for (int i = start[f]; index && i < start[f + 1]; i++)
      cJSON_AddStringToObject(cJSON_GetObjectItemCaseSensitive(index, "weight_map"), t[i]->name,
                              name);
    if (st == STATUS_OK) printf("wrote %s/%s (%d tensors)\n", out, name, start[f + 1] - start[f]);
  }
  if (st == STATUS_OK && index) {
    char path[PATH_LEN + 64], *text = cJSON_Print(index);
    snprintf(path, sizeof path, "%.4000s/model.safetensors.index.json", tmp);
    st = text ? file_write_text(path, text) : err_set(STATUS_ENOMEM, "out of host memory");
    free(text);
  }
  if (st == STATUS_OK && rename(tmp, out) != 0)
    st = err_set(STATUS_EIO, "rename %s -> %s: %s", tmp, out, strerror(errno));
  if (st != STATUS_OK) dcp_remove_tree(tmp);
  if (st == STATUS_OK)
    printf("exported %d tensors, %llu bytes, into %d file%s in %s\n", n, (unsigned long long)total,
           files, files == 1 ? "" : "s", out);
  cJSON_Delete(index);
  free(start);
  free(t);
  mesh_free(one);
  dcp_reader_close(r);
  return st;
}

/* ---- import-hf ---- */

static status_t copy_file(const char *from, const char *to) {
  FILE *in = NULL, *out = NULL;
  status_t st = file_open_regular(from, "copy", &in);
  if (st == STATUS_OK && (out = fopen(to, "wb")) == NULL)
    st = err_set(STATUS_EIO, "copy %s -> %s: %s", from, to, strerror(errno));
  char buf[1 << 16];
  size_t k;
  while (st == STATUS_OK && (k = fread(buf, 1, sizeof buf, in)) > 0)
    if (fwrite(buf, 1, k, out) != k) st = err_set(STATUS_EIO, "%s: write failed", to);
  if (st == STATUS_OK && (ferror(in) || fflush(out) != 0 || fsync(fileno(out)) != 0))
    st = err_set(STATUS_EIO, "copy %s -> %s failed", from, to);
  if (in) fclose(in);
  if (out && fclose(out) != 0 && st == STATUS_OK) st = err_set(STATUS_EIO, "%s: close failed", to);
  return st;
}

/* import-hf: the built-in Llama's config (model_type "llama") is checked as a plan would
 * read it; any other model's is kept as it is, for export-hf to write back. */
static status_t import_hf(const char *hf, const char *out) {
  char cfg_path[PATH_LEN + 64], *config = NULL;
  snprintf(cfg_path, sizeof cfg_path, "%.4000s/config.json", hf);
  TRY(file_read_text(cfg_path, FILE_TEXT_MAX, &config));
  cJSON *cfg = cJSON_Parse(config);
  free(config);
  status_t st = cJSON_IsObject(cfg) ? STATUS_OK
                                    : err_set(STATUS_EFORMAT, "%s: not a JSON object", cfg_path);
  llama_config_t lc;
  if (st == STATUS_OK && is_llama(cfg)) st = llama_config_from_hf(cfg_path, &lc);
  struct stat sb;
  if (st == STATUS_OK && stat(out, &sb) == 0)
    st = err_set(STATUS_EINVAL, "%s: already exists", out);
  char tmp[PATH_LEN + 8], model[PATH_LEN + 16];
  snprintf(tmp, sizeof tmp, "%.4000s.tmp", out);
  snprintf(model, sizeof model, "%s/model", tmp);
  if (st == STATUS_OK) {
    dcp_remove_tree(tmp);
    if (mkdir(tmp, 0755) != 0 || mkdir(model, 0755) != 0)
      st = err_set(STATUS_EIO, "%s: cannot create: %s", tmp, strerror(errno));
  }
  if (st != STATUS_OK) {
    cJSON_Delete(cfg);
    return st;
  }
  char **names = NULL;
  int n = 0;
  st = hf_weight_files(hf, &names, &n);
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    char from[PATH_LEN + 300], to[PATH_LEN + 300];
    snprintf(from, sizeof from, "%.4000s/%s", hf, names[i]);
    snprintf(to, sizeof to, "%s/%s", model, names[i]);
    st_file_t *f;
    st = st_open(&f, from); /* validate before copying */
    if (st == STATUS_OK) {
      st_close(f);
      st = copy_file(from, to);
    }
  }
  /* every tensor once; the shapes a plan's model implies are checked when it loads them */
  dcp_reader_t *r = NULL;
  const dcp_tensor_t *list;
  int nt = 0;
  if (st == STATUS_OK) st = dcp_reader_open(model, &r);
  if (st == STATUS_OK) st = dcp_reader_list(r, &list, &nt);
  cJSON *state = cJSON_CreateObject(), *under = cJSON_CreateObject();
  cJSON_AddNumberToObject(state, "step", 0);
  cJSON_AddNumberToObject(state, "optim_steps", 0);
  cJSON_AddStringToObject(under, "imported_from", hf);
  cJSON_AddItemToObject(under, "model", cfg);
  cJSON_AddItemToObject(state, "saved_under", under);
  char *text = st == STATUS_OK ? cJSON_Print(state) : NULL;
  if (st == STATUS_OK && text == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  if (st == STATUS_OK)
    st = ckpt_commit_state(tmp, out, text, NULL, NULL); /* the files carry no records */
  else
    dcp_remove_tree(tmp);
  free(text);
  cJSON_Delete(state);
  if (st == STATUS_OK)
    printf("imported %d tensors from %d file%s of %s into %s (step 0, no optimizer state)\n", nt, n,
           n == 1 ? "" : "s", hf, out);
  dcp_reader_close(r);
  hf_weight_files_free(names, n);
  return st;
}

/* ---- reshard ---- */

/* Module kinds for the target plan's tensor-parallel rules: the built-in Llama's (a meta
 * model) when the checkpoint holds one, else from names and shapes: modules matching an
 * --embedding glob (by default those whose last name contains "embed", and GPT-2's wte/wpe)
 * are embeddings, other 2-D weights and biases linear layers, 1-D weights norms. */
typedef struct kinds {
  const nn_module_t *model;
  const char *const *embeddings;
  int n_embeddings;
  const plan_t *plan;
} kinds_t;

static bool embedding_named(const kinds_t *k, const char *module) {
  if (k->n_embeddings > 0) {
    for (int i = 0; i < k->n_embeddings; i++)
      if (nn_fqn_match(k->embeddings[i], module)) return true;
    return false;
  }
  const char *leaf = strrchr(module, '.');
  leaf = leaf ? leaf + 1 : module;
  return strstr(leaf, "embed") != NULL || strcmp(leaf, "wte") == 0 || strcmp(leaf, "wpe") == 0;
}

static status_t target_placements(void *ctx, const char *param, int ndim, int *mesh_ndim,
                                   int *mesh_shape, placement_t *pl) {
  const kinds_t *k = ctx;
  char module[1024];
  snprintf(module, sizeof module, "%s", param);
  char *dot = strrchr(module, '.');
  if (dot) *dot = 0; else module[0] = 0;
  const char *leaf = dot ? dot + 1 : param, *kind;
  if (k->model) {
    const nn_module_t *m = nn_module_find((nn_module_t *)k->model, module);
    if (m == NULL)
      return err_set(STATUS_EINVAL, "parameter %s: the model has no module '%s'", param, module);
    kind = nn_module_kind(m);
  } else if (embedding_named(k, module)) {
    kind = "embedding";
  } else if (ndim == 2 || strcmp(leaf, "bias") == 0) {
    kind = "linear";
  } else {
    kind = ndim == 1 ? "layernorm" : "module";
  }
  return parallel_param_placements(&k->plan->par, param, kind, mesh_ndim, mesh_shape, pl);
}

/* Prints, for each folder of a checkpoint, that what is read from it is unchecked. */
static void say_unchecked_folders(const char *dir) {
  const char *subs[2] = {"model", "optim"};
  for (int k = 0; k < 2; k++) {
    char path[PATH_LEN + 16];
    snprintf(path, sizeof path, "%.4000s/%s", dir, subs[k]);
    dcp_reader_t *r;
    if (is_dir(path) && dcp_reader_open(path, &r) == STATUS_OK) {
      say_unchecked(r, path);
      dcp_reader_close(r);
    }
  }
}

typedef struct reshard_opts {
  const char *config;
  int world;
  const char *const *sets;
  int n_sets;
  const char *const *embeddings;
  int n_embeddings;
} reshard_opts_t;

static status_t reshard(const char *dir, const char *out, const reshard_opts_t *o) {
  plan_t p;
  TRY(plan_load(&p, o->config, o->sets, o->n_sets));
  int world = o->world;
  if (world <= 0) {
    if (p.par.dp_replicate < 0 || p.par.dp_shard < 0 || p.par.tp < 0)
      return err_set(STATUS_EINVAL,
                     "%s: mesh: a size of -1 takes the rest of the world; give --world N",
                     o->config);
    world = p.par.dp_replicate * p.par.dp_shard * p.par.tp;
  }
  if (!is_dir(dir)) return err_set(STATUS_EIO, "%s: not a folder", dir);
  cJSON *state;
  TRY(read_state(dir, &state));
  if (state == NULL)
    return err_set(STATUS_EINVAL, "%s: not a training checkpoint (no train_state.json)", dir);
  const cJSON *m = recorded_model(state);
  bool llama = m && is_llama(m);
  /* the built-in Llama: the plan's model must be the checkpoint's, or nothing would load;
   * any other model: the plan's mesh and parallelize sections alone */
  status_t st = llama ? plan_resolve(&p, world) : parallel_plan_resolve(&p.par, world);
  if (st == STATUS_OK && llama) {
    char *text = cJSON_PrintUnformatted(m), why[128];
    llama_config_t saved;
    st = text ? llama_config_from_hf_text(text, dir, &saved)
              : err_set(STATUS_ENOMEM, "out of host memory");
    free(text);
    if (st == STATUS_OK && !llama_config_same_params(&saved, &p.model, why, sizeof why))
      st = err_set(STATUS_EINVAL,
                   "%s: the checkpoint's model differs from the model of %s (%s: saved vs "
                   "planned)",
                   dir, o->config, why);
  }
  /* the Llama's module kinds come from a meta model: no memory */
  llama_options_t lo = LLAMA_OPTIONS_INIT;
  lo.deferred = true;
  llama_t *model = NULL;
  if (st == STATUS_OK && llama) st = llama_new(&model, &p.model, &lo);
  kinds_t kinds = {model ? llama_module(model) : NULL, o->embeddings, o->n_embeddings, &p};
  cJSON *nu = cJSON_CreateObject();
  cJSON_AddStringToObject(nu, "plan", o->config);
  cJSON_AddNumberToObject(nu, "world_size", world);
  cJSON_AddNumberToObject(nu, "dp_replicate", p.par.dp_replicate);
  cJSON_AddNumberToObject(nu, "dp_shard", p.par.dp_shard);
  cJSON_AddNumberToObject(nu, "tp", p.par.tp);
  cJSON_AddStringToObject(nu, "resharded_from", dir);
  if (m) cJSON_AddItemToObject(nu, "model", cJSON_Duplicate(m, true));
  char *under = cJSON_PrintUnformatted(nu);
  if (st == STATUS_OK && under == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  int files = 0;
  if (st == STATUS_OK) say_unchecked_folders(dir);
  if (st == STATUS_OK)
    st = ckpt_reshard_training(dir, out, world, target_placements, &kinds, under, &files);
  if (st == STATUS_OK)
    printf("resharded %s for %d ranks (dp_replicate %d x dp_shard %d x tp %d): %d files in %s\n",
           dir, world, p.par.dp_replicate, p.par.dp_shard, p.par.tp, files, out);
  free(under);
  cJSON_Delete(nu);
  llama_free(model);
  cJSON_Delete(state);
  return st;
}

/* ---- main ---- */

static status_t run(int argc, char **argv) {
  if (argc < 3) return err_set(STATUS_EINVAL, "missing a command and its folders");
  const char *cmd = argv[1];
  if (strcmp(cmd, "inspect") == 0) {
    if (argc != 3) return err_set(STATUS_EINVAL, "inspect takes one folder");
    return inspect(argv[2]);
  }
  if (strcmp(cmd, "verify") == 0) {
    if (argc != 3) return err_set(STATUS_EINVAL, "verify takes one folder");
    return verify(argv[2]);
  }
  if (strcmp(cmd, "import-hf") == 0) {
    if (argc != 4) return err_set(STATUS_EINVAL, "import-hf takes HFDIR OUT");
    return import_hf(argv[2], argv[3]);
  }
  if (strcmp(cmd, "reshard") == 0) {
    const char *pos[2] = {NULL, NULL}, *sets[256], *embeddings[256];
    reshard_opts_t o = {.config = NULL, .sets = sets, .embeddings = embeddings};
    int np = 0;
    for (int i = 2; i < argc; i++) {
      const char *a = argv[i];
      if (strcmp(a, "--to") == 0 || strcmp(a, "--world") == 0 || strcmp(a, "--set") == 0 ||
          strcmp(a, "--embedding") == 0) {
        if (i + 1 >= argc) return err_set(STATUS_EINVAL, "%s needs a value", a);
        const char *v = argv[++i];
        if (a[2] == 't') {
          o.config = v;
        } else if (a[2] == 'w') {
          char *end;
          long w = strtol(v, &end, 10);
          if (*end || w < 1 || w > 1 << 20)
            return err_set(STATUS_EINVAL, "--world: expected a positive integer, got '%s'", v);
          o.world = (int)w;
        } else if (a[2] == 'e') {
          if (o.n_embeddings == 256) return err_set(STATUS_EINVAL, "more than 256 --embedding");
          embeddings[o.n_embeddings++] = v;
        } else {
          if (o.n_sets == 256) return err_set(STATUS_EINVAL, "more than 256 --set");
          sets[o.n_sets++] = v;
        }
      } else if (a[0] == '-') {
        return err_set(STATUS_EINVAL, "unknown option '%s'", a);
      } else if (np < 2) {
        pos[np++] = a;
      } else {
        return err_set(STATUS_EINVAL, "reshard takes DIR --to CONFIG OUT");
      }
    }
    if (np != 2 || o.config == NULL)
      return err_set(STATUS_EINVAL, "reshard takes DIR --to CONFIG OUT");
    return reshard(pos[0], pos[1], &o);
  }
  if (strcmp(cmd, "export-hf") == 0) {
    export_opts_t o = {.dtype = DTYPE_COUNT, .max_shard_bytes = 5000000000ull, .config = NULL};
    const char *pos[2] = {NULL, NULL};
    int np = 0;
    for (int i = 2; i < argc; i++) {
      const char *a = argv[i];
      if (strcmp(a, "--dtype") == 0 || strcmp(a, "--max-shard-bytes") == 0 ||
          strcmp(a, "--config") == 0) {
        if (i + 1 >= argc) return err_set(STATUS_EINVAL, "%s needs a value", a);
        const char *v = argv[++i];
        if (a[2] == 'd') {
          if (dtype_parse(v, &o.dtype) != STATUS_OK || !dtype_is_float(o.dtype))
            return err_set(STATUS_EINVAL, "--dtype: expected f32, bf16 or f16, got '%s'", v);
        } else if (a[2] == 'm') {
          char *end;
          errno = 0;
          unsigned long long b = strtoull(v, &end, 10);
          if (errno || *end || b == 0 || v[0] == '-')
            return err_set(STATUS_EINVAL,
                           "--max-shard-bytes: expected a positive integer, got '%s'", v);
          o.max_shard_bytes = b;
        } else {
          o.config = v;
        }
      } else if (a[0] == '-') {
        return err_set(STATUS_EINVAL, "unknown option '%s'", a);
      } else if (np < 2) {
        pos[np++] = a;
      } else {
        return err_set(STATUS_EINVAL, "export-hf takes DIR OUT, got a third folder '%s'", a);
      }
    }
    if (np != 2) return err_set(STATUS_EINVAL, "export-hf takes DIR OUT");
    return export_hf(pos[0], pos[1], &o);
  }
  return err_set(STATUS_EINVAL,
                 "unknown command '%s' (inspect, verify, export-hf, import-hf, reshard)", cmd);
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(argv[i], "--version") == 0) {
      printf("fsdp-ckpt (fsdpc) %s\n", fsdpc_version());
      return 0;
    }
  if (world_init(&argc, &argv) != STATUS_OK) {
    fprintf(stderr, "fsdp-ckpt: %s\n", err_detail());
    return 1;
  }
  status_t st = run(argc, argv);
  if (st != STATUS_OK) {
    fprintf(stderr, "fsdp-ckpt: %s\n", err_detail());
    if (strncmp(err_detail(), "missing a command", 17) == 0 ||
        strncmp(err_detail(), "unknown command", 15) == 0)
      usage(stderr);
  }
  world_finalize();
  return st == STATUS_OK ? 0 : 1;
}
