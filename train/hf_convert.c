#include "train/hf_convert.h"

#include <cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/dcp.h"
#include "checkpoint/hf_weights.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/train_ckpt.h"
#include "core/args_impl.h"
#include "core/file.h"
#include "models/llama/llama.h"
#include "train/hf_convert_impl.h"

#define PATH_LEN 4096

/* train_state.json of a training checkpoint, or NULL (a plain shard folder). */
static fsdpc_status_t read_state(const char *dir, cJSON **out) {
  char *text;
  FSDPC_TRY(ckpt_state_text(dir, &text));
  *out = text ? cJSON_Parse(text) : NULL;
  bool bad = text && *out == NULL;
  free(text);
  return bad ? err_set(STATUS_EFORMAT, "%s/train_state.json: not valid JSON", dir) : STATUS_OK;
}

/* The model config a training checkpoint records (saved_under.model), or NULL. */
static const cJSON *recorded_model(const cJSON *state) {
  const cJSON *m = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(state, "saved_under"), "model");
  return cJSON_IsObject(m) ? m : NULL;
}

/* The architecture of the built-in family a config names (model_type), else LLAMA_ARCH_COUNT. */
static llama_arch_t arch_of(const cJSON *config) {
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(config, "model_type");
  llama_arch_t arch;
  return cJSON_IsString(t) && llama_arch_from_name(t->valuestring, &arch) ? arch : LLAMA_ARCH_COUNT;
}

/* A config of the built-in family whose files are checked and rewritten here (llama, qwen2,
 * qwen3; a GPT-2 folder is carried through as any other model's, but c_attn's shape). */
static bool is_llama(const cJSON *config) {
  llama_arch_t arch = arch_of(config);
  return arch != LLAMA_ARCH_COUNT && arch != LLAMA_ARCH_GPT2;
}

bool hf_config_is_family(const char *json) {
  cJSON *o = json ? cJSON_Parse(json) : NULL;
  bool yes = arch_of(o) != LLAMA_ARCH_COUNT;
  cJSON_Delete(o);
  return yes;
}

bool hf_config_is_llama(const char *json) {
  cJSON *o = json ? cJSON_Parse(json) : NULL;
  bool yes = is_llama(o);
  cJSON_Delete(o);
  return yes;
}

fsdpc_status_t ckpt_recorded_config(const char *dir, char **out) {
  ARG_NONNULL(dir);
  ARG_NONNULL(out);
  *out = NULL;
  cJSON *state;
  FSDPC_TRY(read_state(dir, &state));
  const cJSON *m = recorded_model(state);
  if (m && (*out = cJSON_PrintUnformatted(m)) == NULL) {
    cJSON_Delete(state);
    return err_set(STATUS_ENOMEM, "out of host memory");
  }
  cJSON_Delete(state);
  return STATUS_OK;
}

/* ---- export ---- */

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

static int cmp_tensor_names(const void *x, const void *y) {
  return strcmp(((const dcp_tensor_t *)x)->name, ((const dcp_tensor_t *)y)->name);
}

static int cmp_by_name(const void *x, const void *y) {
  return natural_cmp((*(const dcp_tensor_t *const *)x)->name,
                     (*(const dcp_tensor_t *const *)y)->name);
}

const char *const hf_dropout_keys[] = {
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "attention_dropout", "summary_first_dropout", NULL};

fsdpc_status_t hf_config_carry(char **text, const cJSON *source) {
  ARG_NONNULL(text);
  if (!cJSON_IsObject(source) || *text == NULL) return STATUS_OK;
  static const char *const own[] = {"torch_dtype",        "dtype",
                                    "rope_scaling",       "rope_parameters",
                                    "pad_vocab_multiple", "quantization_config"};
  cJSON *o = cJSON_Parse(*text);
  if (!cJSON_IsObject(o)) {
    cJSON_Delete(o);
    return err_set(STATUS_EINTERNAL, "a model config written here is not a JSON object");
  }
  const cJSON *it;
  bool ok = true;
  cJSON_ArrayForEach(it, source) {
    /* the dropout rates, which the model here never applies: the source's stand, for whoever
     * trains the exported model next */
    for (int k = 0; hf_dropout_keys[k]; k++)
      if (strcmp(it->string, hf_dropout_keys[k]) == 0)
        cJSON_DeleteItemFromObjectCaseSensitive(o, it->string);
    bool skip = cJSON_GetObjectItemCaseSensitive(o, it->string) != NULL;
    for (size_t k = 0; !skip && k < sizeof own / sizeof own[0]; k++)
      skip = strcmp(it->string, own[k]) == 0;
    if (!skip) ok = ok && cJSON_AddItemToObject(o, it->string, cJSON_Duplicate(it, true));
  }
  char *out = ok ? cJSON_Print(o) : NULL;
  cJSON_Delete(o);
  if (out == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  free(*text);
  *text = out;
  return STATUS_OK;
}

/* A Hugging Face config of any model written as config.json with torch_dtype set to dtype;
 * the built-in Llama's (model_type "llama") is checked and written in its normal form. origin
 * names where the config came from. */
static fsdpc_status_t write_config(const cJSON *config, const char *origin, dtype_t dtype,
                                   const char *path, int64_t *vocab) {
  if (!cJSON_IsObject(config))
    return err_set(STATUS_EFORMAT, "%s: a model config is not a JSON object", origin);
  if (is_llama(config)) {
    char *text = cJSON_PrintUnformatted(config);
    llama_config_t cfg;
    fsdpc_status_t st = text ? llama_config_from_hf_text(text, origin, &cfg)
                             : err_set(STATUS_ENOMEM, "out of host memory");
    free(text);
    FSDPC_TRY(st);
    /* padded tables are written vocab_size rows long, as transformers' model has them */
    if (llama_vocab_rows(&cfg) > cfg.vocab_size) *vocab = cfg.vocab_size;
    cfg.pad_vocab_multiple = 0;
    char *normal = NULL; /* with the keys the model does not read carried over */
    st = llama_config_to_hf_text(&cfg, dtype, &normal);
    if (st == STATUS_OK) st = hf_config_carry(&normal, config);
    if (st == STATUS_OK) st = file_write_text(path, normal);
    free(normal);
    return st;
  }
  cJSON *c = cJSON_Duplicate(config, true);
  const cJSON *pad = cJSON_GetObjectItemCaseSensitive(config, "pad_vocab_multiple");
  const cJSON *vs = cJSON_GetObjectItemCaseSensitive(config, "vocab_size");
  if (arch_of(config) != LLAMA_ARCH_COUNT && cJSON_IsNumber(pad) && cJSON_IsNumber(vs) &&
      pad->valuedouble > 1) { /* GPT-2 kept as it is, but for a run's padded tables */
    *vocab = (int64_t)vs->valuedouble;
    cJSON_DeleteItemFromObjectCaseSensitive(c, "pad_vocab_multiple");
  }
  /* the tensors are written in a float dtype: transformers would read them as quantized */
  cJSON_DeleteItemFromObjectCaseSensitive(c, "quantization_config");
  const char *names[] = {[DTYPE_F32] = "float32", [DTYPE_BF16] = "bfloat16",
                         [DTYPE_F16] = "float16"};
  const char *name = (size_t)dtype < sizeof names / sizeof names[0] ? names[dtype] : NULL;
  if (c && name) {
    cJSON_DeleteItemFromObjectCaseSensitive(c, "torch_dtype");
    cJSON_AddStringToObject(c, "torch_dtype", name);
  }
  char *text = c ? cJSON_Print(c) : NULL;
  cJSON_Delete(c);
  fsdpc_status_t st =
      text ? file_write_text(path, text) : err_set(STATUS_ENOMEM, "out of host memory");
  free(text);
  return st;
}

/* --config's model (given) against the one the checkpoint records (in state): the same
 * parameters and the same function (heads, RoPE, norms, routing), or the exported folder would
 * describe another model than its tensors trained as. */
static fsdpc_status_t same_model(const char *path, const cJSON *given, const cJSON *state) {
  char *a = cJSON_PrintUnformatted(given), *b = cJSON_PrintUnformatted(recorded_model(state));
  llama_config_t cg = LLAMA_CONFIG_INIT, cs = LLAMA_CONFIG_INIT;
  fsdpc_status_t st = a && b ? llama_config_from_hf_text(a, path, &cg)
                             : err_set(STATUS_ENOMEM, "out of host memory");
  if (st == STATUS_OK) st = llama_config_from_hf_text(b, "the checkpoint's record", &cs);
  free(a);
  free(b);
  char why[192];
  if (st == STATUS_OK && (!llama_config_same_params(&cg, &cs, why, sizeof why) ||
                          !llama_config_same_function(&cg, &cs, why, sizeof why)))
    st = err_set(STATUS_EINVAL,
                 "--config %s describes another model than the checkpoint's (%s: given vs "
                 "saved): its tensors trained as the recorded one; leave --config out to export "
                 "that one",
                 path, why);
  return st;
}

/* config.json: --config, or the model config the checkpoint was saved with; *arch its
 * architecture in the built-in family (LLAMA_ARCH_COUNT: another model). */
static fsdpc_status_t export_config(const char *dir, const hf_export_opts_t *o, dtype_t dtype,
                                    const char *path, llama_arch_t *arch, int64_t *vocab,
                                    bool *unquantized) {
  char *text = NULL, origin[PATH_LEN];
  cJSON *state = NULL, *given = NULL;
  const cJSON *config = NULL;
  if (o->config) {
    FSDPC_TRY(file_read_text(o->config, FILE_TEXT_MAX, &text));
    given = cJSON_Parse(text);
    free(text);
    if (given == NULL) return err_set(STATUS_EFORMAT, "%s: not valid JSON", o->config);
    config = given;
    snprintf(origin, sizeof origin, "%s", o->config);
    /* transformers finds a model by its config's model_type; the checkpoint's own record
     * says which model its tensors are */
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(given, "model_type");
    fsdpc_status_t st = STATUS_OK;
    if (!cJSON_IsString(type) || !type->valuestring[0])
      st = err_set(STATUS_EINVAL,
                   "--config %s: no model_type: not a Hugging Face model config (the "
                   "config.json of the model, as transformers writes it)",
                   o->config);
    if (st == STATUS_OK) st = read_state(dir, &state);
    llama_arch_t was = arch_of(recorded_model(state));
    if (st == STATUS_OK && was != LLAMA_ARCH_COUNT && arch_of(given) != was)
      st = err_set(STATUS_EINVAL,
                   "--config %s: model_type '%s', but the checkpoint's tensors are a %s model's "
                   "(saved_under.model in its train_state.json): give that model's config",
                   o->config, type->valuestring, llama_arch_name(was));
    if (st == STATUS_OK && was != LLAMA_ARCH_COUNT) st = same_model(o->config, given, state);
    if (st != STATUS_OK) {
      cJSON_Delete(given);
      cJSON_Delete(state);
      return st;
    }
  } else {
    FSDPC_TRY(read_state(dir, &state));
    config = recorded_model(state);
    snprintf(origin, sizeof origin, "%.4000s/train_state.json", dir); /* for messages */
  }
  *arch = arch_of(config);
  *unquantized = cJSON_GetObjectItemCaseSensitive(config, "quantization_config") != NULL;
  fsdpc_status_t st =
      config          ? write_config(config, origin, dtype, path, vocab)
      : state == NULL ? err_set(STATUS_EINVAL,
                                "%s: no train_state.json, which records the model's config in a "
                                "checkpoint fsdp-train saves: give --config CONFIG.json (the "
                                "model's Hugging Face config)",
                                dir)
                      : err_set(STATUS_EINVAL,
                                "%s: no model config recorded in train_state.json; give "
                                "--config CONFIG.json",
                                dir);
  cJSON_Delete(given);
  cJSON_Delete(state);
  return st;
}

/* t's shape in Hugging Face's files into hs (llama_hf_shape; a vocabulary table padded
 * beyond a vocabulary of vocab > 0 has its first vocab rows there); returns its ndim. */
static int hf_shape(llama_arch_t arch, const dcp_tensor_t *t, int64_t vocab, int64_t *hs) {
  int hn = llama_hf_shape(arch, t->name, t->ndim, t->shape, true, hs);
  if (hn > 0 && vocab > 0 && hs[0] > vocab && llama_is_vocab_table(t->name)) hs[0] = vocab;
  return hn;
}

/* The experts a stacked tensor holds (P.experts.N [E, a, b], which Hugging Face's files keep
 * as E tensors P.experts.J.N.weight), else 0. */
static int64_t stacked_experts(const dcp_tensor_t *t) {
  char name[512];
  return t->ndim == 3 && hf_expert_name(t->name, 0, name, sizeof name) ? t->shape[0] : 0;
}

/* The tensors export-hf writes, in order: each in the shape Hugging Face's files give it
 * (llama_hf_shape; a padded vocabulary table's first vocab rows), a stacked tensor one
 * tensor per expert. */
typedef struct hf_list {
  int n;
  dcp_tensor_t *v;    /* names and shapes as written, the source's dtype */
  char (*names)[512]; /* the experts' names, where v[k].name points */
  int *src;           /* v[k] comes from t[src[k]], */
  int64_t *plane;     /* its expert plane[k], or the whole of it: -1 */
} hf_list_t;

static void hf_list_free(hf_list_t *l) {
  free(l->v);
  free(l->names);
  free(l->src);
  free(l->plane);
  memset(l, 0, sizeof *l);
}

static fsdpc_status_t hf_list_of(const dcp_tensor_t *const *t, int n, llama_arch_t arch,
                                 int64_t vocab, hf_list_t *l) {
  memset(l, 0, sizeof *l);
  int count = 0;
  for (int i = 0; i < n; i++) count += stacked_experts(t[i]) ? (int)stacked_experts(t[i]) : 1;
  size_t c = (size_t)count + 1;
  l->v = calloc(c, sizeof *l->v);
  l->names = calloc(c, sizeof *l->names);
  l->src = calloc(c, sizeof *l->src);
  l->plane = calloc(c, sizeof *l->plane);
  fsdpc_status_t st = l->v && l->names && l->src && l->plane
                          ? STATUS_OK
                          : err_set(STATUS_ENOMEM, "out of host memory");
  int k = 0;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    int64_t E = stacked_experts(t[i]);
    for (int64_t j = 0; j < E && st == STATUS_OK; j++, k++) {
      if (!hf_expert_name(t[i]->name, j, l->names[k], sizeof l->names[k]))
        st = err_set(STATUS_EINVAL, "'%s': expert %lld's name is too long", t[i]->name,
                     (long long)j);
      l->v[k] = (dcp_tensor_t){.name = l->names[k], .dtype = t[i]->dtype, .ndim = 2};
      l->v[k].shape[0] = t[i]->shape[1];
      l->v[k].shape[1] = t[i]->shape[2];
      l->src[k] = i;
      l->plane[k] = j;
    }
    if (E > 0) continue;
    l->v[k] = (dcp_tensor_t){.name = t[i]->name, .dtype = t[i]->dtype};
    l->v[k].ndim = hf_shape(arch, t[i], vocab, l->v[k].shape);
    l->src[k] = i;
    l->plane[k] = -1;
    k++;
  }
  l->n = k;
  if (st != STATUS_OK) hf_list_free(l);
  return st;
}

/* The elements of src (f32 or bf16) finite there and beyond f16's range in f16 copy h; the
 * largest magnitude among them into *worst. */
static int64_t f16_overflows(const fsdpc_tensor_t *src, const fsdpc_tensor_t *h, double *worst) {
  int64_t n = tensor_numel(src), bad = 0;
  const uint16_t *hv = h->data;
  *worst = 0;
  for (int64_t i = 0; i < n; i++) {
    if ((hv[i] & 0x7fff) != 0x7c00) continue; /* not an infinity */
    double x = src->dtype == DTYPE_F32    ? ((const float *)src->data)[i]
               : src->dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)src->data)[i])
                                          : INFINITY;
    if (!isfinite(x)) continue;
    bad++;
    *worst = fabs(x) > *worst ? fabs(x) : *worst;
  }
  return bad;
}

/* Writes entries [first, last) of l into one file, one source tensor in memory at a time. */
static fsdpc_status_t export_file(dcp_reader_t *r, const dcp_tensor_t *const *t, const hf_list_t *l,
                                  int first, int last, dtype_t want, const char *path,
                                  mesh_t *one) {
  st_writer_t *w;
  FSDPC_TRY(st_writer_new(&w));
  fsdpc_status_t st = st_writer_set_metadata(w, "format", "pt");
  for (int k = first; k < last && st == STATUS_OK; k++)
    st = st_writer_declare(w, l->v[k].name, want == DTYPE_COUNT ? l->v[k].dtype : want,
                           l->v[k].ndim, l->v[k].shape);
  if (st == STATUS_OK) st = st_writer_begin(w, path);
  placement_t rep = placement_replicate();
  for (int k = first; k < last && st == STATUS_OK;) {
    const dcp_tensor_t *src = t[l->src[k]];
    fsdpc_tensor_t full, conv = {0};
    dtensor_t *dt = NULL;
    st = tensor_init(&full, src->dtype, device_cpu(), src->ndim, src->shape);
    if (st != STATUS_OK) break;
    st = dtensor_from_local(&full, one, &rep, src->ndim, src->shape, &dt);
    dcp_entry_t e = {src->name, dt};
    if (st == STATUS_OK) st = dcp_reader_load(r, &e, 1, NULL);
    const fsdpc_tensor_t *from = &full;
    if (st == STATUS_OK && want != DTYPE_COUNT && want != full.dtype) {
      st = tensor_clone(&conv, &full, want, device_cpu());
      from = &conv;
    }
    double worst = 0;
    int64_t over = st == STATUS_OK && want == DTYPE_F16 && full.dtype != DTYPE_F16
                       ? f16_overflows(&full, &conv, &worst)
                       : 0;
    if (over > 0)
      st = err_set(STATUS_EDTYPE,
                   "export-hf --dtype f16: tensor '%s' has %lld value%s beyond f16's range "
                   "(largest magnitude %g, f16's 65504), which f16 would make infinite: export "
                   "in bf16 or f32",
                   src->name, (long long)over, over == 1 ? "" : "s", worst);
    /* the whole tensor as written: a view (of a padded table's first rows); each expert's
     * plane is a view of a stacked one */
    fsdpc_tensor_t rows = {0};
    bool whole = l->plane[k] < 0;
    bool trim = whole && l->v[k].ndim > 0 && l->v[k].shape[0] < src->shape[0];
    if (st == STATUS_OK)
      st = trim ? tensor_narrow(&rows, from, 0, 0, l->v[k].shape[0]) : tensor_ref(&rows, from);
    for (; k < last && t[l->src[k]] == src && st == STATUS_OK; k++) {
      fsdpc_tensor_t one_plane = {0}, as = {0};
      if (whole)
        st = tensor_ref(&one_plane, &rows);
      else
        st = tensor_narrow(&one_plane, &rows, 0, l->plane[k], 1);
      if (st == STATUS_OK) st = tensor_view(&as, &one_plane, l->v[k].ndim, l->v[k].shape);
      if (st == STATUS_OK) st = st_writer_write(w, l->v[k].name, &as);
      tensor_free(&as);
      tensor_free(&one_plane);
    }
    tensor_free(&rows);
    tensor_free(&conv);
    dtensor_free(dt);
    tensor_free(&full);
  }
  if (st == STATUS_OK) st = st_writer_finish(w);
  st_writer_free(w);
  return st;
}

static fsdpc_status_t check_llama_tensors(const char *hf, const llama_config_t *c,
                                          const dcp_tensor_t *list, int nt);

/* For a model of the built-in family (arch), the config written at config_path
 * checked against the tensors as the export writes them (import-hf's check: every parameter
 * of the model it describes present with its shape, nothing else), before any is written. */
static fsdpc_status_t check_export(const char *dir, const hf_export_opts_t *o,
                                   const char *config_path, llama_arch_t arch, const hf_list_t *l) {
  if (arch == LLAMA_ARCH_COUNT) return STATUS_OK;
  llama_config_t lc;
  FSDPC_TRY(llama_config_from_hf(config_path, &lc));
  char label[PATH_LEN + 64];
  if (o->config)
    snprintf(label, sizeof label, "%.2000s exported with --config %.2000s", dir, o->config);
  else
    snprintf(label, sizeof label, "%.4000s", dir);
  return check_llama_tensors(label, &lc, l->v, l->n);
}

fsdpc_status_t ckpt_export_hf(const char *dir, const char *out, const hf_export_opts_t *o,
                              hf_report_t *report) {
  ARG_NONNULL(dir);
  ARG_NONNULL(out);
  ARG_NONNULL(o);
  hf_report_t rep_local;
  hf_report_t *rep = report ? report : &rep_local;
  memset(rep, 0, sizeof *rep);
  char model[PATH_LEN], state[PATH_LEN];
  if (!file_is_dir(dir)) return err_set(STATUS_EIO, "%s: not a folder", dir);
  FSDPC_TRY(file_join(state, sizeof state, dir, "train_state.json"));
  if (file_lexists(state)) FSDPC_TRY(ckpt_check_state(dir));
  /* the model's shards: DIR/model in a training checkpoint, else DIR */
  FSDPC_TRY(file_join(model, sizeof model, dir, "model"));
  if (!file_is_dir(model)) snprintf(model, sizeof model, "%s", dir);
  FSDPC_TRY(file_check_output_dir(out, "export-hf: OUT", true));
  FSDPC_TRY(file_check_outside(out, dir, "export-hf: OUT"));
  /* written into a fresh OUT.tmp-XXXXXX, renamed when complete (over an empty OUT, which
   * rename replaces): a failure (a damaged block) leaves OUT as it was */
  char tmp[PATH_LEN + 16] = "";
  dcp_reader_t *r;
  FSDPC_TRY(dcp_reader_open(model, &r));
  rep->unchecked = dcp_reader_checks(r, NULL) == DCP_CHECKS_NONE;
  const dcp_tensor_t *list;
  int n;
  const dcp_tensor_t **t = NULL;
  mesh_t *one = NULL;
  cJSON *index = NULL;
  llama_arch_t arch = LLAMA_ARCH_COUNT; /* the family's architecture, whose shapes may differ */
  int64_t vocab = 0; /* > 0: the vocabulary of padded tables, whose first rows are written */
  fsdpc_status_t st = dcp_reader_list(r, &list, &n);
  if (st == STATUS_OK && (t = malloc(sizeof *t * (size_t)(n ? n : 1))) == NULL)
    st = err_set(STATUS_ENOMEM, "out of host memory");
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    t[i] = &list[i];
    if (list[i].dtype == DTYPE_COUNT || !dtype_is_float(list[i].dtype))
      st = err_set(STATUS_EDTYPE, "%s: tensor '%s' is stored as %s, not a float dtype", model,
                   list[i].name, list[i].dtype_name);
  }
  if (st == STATUS_OK) qsort(t, (size_t)n, sizeof *t, cmp_by_name);
  if (st == STATUS_OK) st = mesh_new_local("one", DEVICE_CPU, &one);
  if (st == STATUS_OK) st = file_make_temp_dir(out, tmp, sizeof tmp);
  hf_list_t l = {0};
  if (st == STATUS_OK) { /* first: the config may be missing, before any tensor is written */
    char path[PATH_LEN + 64];
    dtype_t cd = o->dtype != DTYPE_COUNT ? o->dtype : n > 0 ? t[0]->dtype : DTYPE_F32;
    st = file_join(path, sizeof path, tmp, "config.json");
    if (st == STATUS_OK) st = export_config(dir, o, cd, path, &arch, &vocab, &rep->unquantized);
    if (st == STATUS_OK) st = hf_list_of(t, n, arch, vocab, &l);
    if (st == STATUS_OK) st = check_export(dir, o, path, arch, &l);
  }
  /* files: consecutive source tensors up to max_shard_bytes each (a larger one gets its
   * own); start[] holds the entries of l where each begins */
  int *start = st == STATUS_OK ? calloc((size_t)l.n + 2, sizeof(int)) : NULL;
  int files = 0;
  uint64_t total = 0, cur = 0;
  if (st == STATUS_OK && start == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  for (int k = 0; k < l.n && st == STATUS_OK;) {
    size_t es = dtype_size(o->dtype == DTYPE_COUNT ? l.v[k].dtype : o->dtype);
    uint64_t b = 0; /* the bytes of the entries of one source tensor */
    int next = k;
    for (; next < l.n && l.src[next] == l.src[k]; next++) {
      uint64_t e = es;
      for (int d = 0; d < l.v[next].ndim; d++) e *= (uint64_t)l.v[next].shape[d];
      b += e;
    }
    if (k == 0 || (cur > 0 && cur + b > o->max_shard_bytes)) {
      start[files++] = k;
      cur = 0;
    }
    cur += b;
    total += b;
    k = next;
  }
  if (st == STATUS_OK && l.n > 0) start[files] = l.n;
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
    st = file_join(path, sizeof path, tmp, name);
    if (st == STATUS_OK) st = export_file(r, t, &l, start[f], start[f + 1], o->dtype, path, one);
    cJSON *map = index ? cJSON_GetObjectItemCaseSensitive(index, "weight_map") : NULL;
    for (int k = start[f]; map && k < start[f + 1]; k++)
      cJSON_AddStringToObject(map, l.v[k].name, name);
  }
  if (st == STATUS_OK && index) {
    char path[PATH_LEN + 64], *text = cJSON_Print(index);
    st = text ? file_join(path, sizeof path, tmp, "model.safetensors.index.json")
              : err_set(STATUS_ENOMEM, "out of host memory");
    if (st == STATUS_OK) st = file_write_text(path, text);
    free(text);
  }
  if (st == STATUS_OK) st = file_commit_temp_dir(tmp, out);
  if (st != STATUS_OK) file_discard_temp_dir(tmp);
  if (st == STATUS_OK) {
    rep->tensors = l.n; /* as written: stacked experts one tensor each */
    rep->files = files;
    rep->bytes = total;
  }
  cJSON_Delete(index);
  hf_list_free(&l);
  free(start);
  free(t);
  mesh_free(one);
  dcp_reader_close(r);
  return st;
}

/* ---- import ---- */

/* Whether the folder keeps the stacked experts fqn one tensor per expert (Hugging Face's
 * names) rather than whole. */
static bool stacked_in_folder(const dcp_tensor_t *list, int nt, const char *fqn) {
  char first[512];
  if (!hf_expert_name(fqn, 0, first, sizeof first)) return false;
  for (int k = 0; k < nt; k++)
    if (strcmp(list[k].name, first) == 0) return true;
  return false;
}

/* Every expert of the stacked fqn [E, a, b] in the folder, each [a, b]. */
static fsdpc_status_t check_experts(const char *hf, const dcp_tensor_t *list, int nt,
                                    const char *fqn, const int64_t *shape) {
  for (int64_t j = 0; j < shape[0]; j++) {
    char name[512];
    hf_expert_name(fqn, j, name, sizeof name); /* fits: expert 0's did */
    int k = 0;
    while (k < nt && strcmp(list[k].name, name) != 0) k++;
    if (k == nt)
      return err_set(STATUS_EFORMAT, "%s: no tensor '%s', which config.json's model has", hf, name);
    if (list[k].dtype == DTYPE_COUNT || !dtype_is_float(list[k].dtype))
      return err_set(STATUS_EDTYPE,
                     "%s: tensor '%s' is stored as %s; the model's parameters are "
                     "floating point (F32, BF16 or F16)",
                     hf, name, list[k].dtype_name);
    if (list[k].ndim != 2 || list[k].shape[0] != shape[1] || list[k].shape[1] != shape[2])
      return err_set(STATUS_ESHAPE,
                     "%s: tensor '%s' has %d dimensions [%lld, ...], but config.json's model "
                     "needs [%lld, %lld]",
                     hf, name, list[k].ndim, (long long)(list[k].ndim ? list[k].shape[0] : 0),
                     (long long)shape[1], (long long)shape[2]);
  }
  return STATUS_OK;
}

/* The tensors of a Llama folder against the model its config.json describes (a meta model
 * built from it lists the parameters): every parameter present with its shape, nothing else. */
static fsdpc_status_t check_llama_tensors(const char *hf, const llama_config_t *c,
                                          const dcp_tensor_t *list, int nt) {
  llama_options_t lo = LLAMA_OPTIONS_INIT;
  lo.deferred = true; /* shapes only */
  llama_t *m = NULL;
  nn_param_t **ps = NULL;
  int n = 0;
  fsdpc_status_t st = llama_new(c, &lo, &m);
  if (st == STATUS_OK) st = nn_named_parameters(llama_module(m), &ps, &n);
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    const dtensor_t *v = ps[i]->value;
    if (dtensor_ndim(v) == 3 && stacked_in_folder(list, nt, ps[i]->fqn)) {
      for (int k = 0; k < nt && st == STATUS_OK; k++)
        if (strcmp(list[k].name, ps[i]->fqn) == 0)
          st = err_set(STATUS_EFORMAT,
                       "%s: tensor '%s' is there both whole and one tensor per expert (as "
                       "Hugging Face's files keep them): give one form",
                       hf, ps[i]->fqn);
      if (st == STATUS_OK) st = check_experts(hf, list, nt, ps[i]->fqn, dtensor_shape(v));
      continue;
    }
    int k = 0;
    while (k < nt && strcmp(list[k].name, ps[i]->fqn) != 0) k++;
    if (k == nt) {
      st = err_set(STATUS_EFORMAT, "%s: no tensor '%s', which config.json's model has", hf,
                   ps[i]->fqn);
      break;
    }
    if (list[k].dtype == DTYPE_COUNT || !dtype_is_float(list[k].dtype)) {
      st = err_set(STATUS_EDTYPE,
                   "%s: tensor '%s' is stored as %s; the model's parameters are "
                   "floating point (F32, BF16 or F16)",
                   hf, ps[i]->fqn, list[k].dtype_name);
      break;
    }
    int64_t hs[TENSOR_MAX_DIMS + 1]; /* the parameter as the files hold it (GPT-2's c_attn) */
    int hn = llama_hf_shape(c->arch, ps[i]->fqn, dtensor_ndim(v), dtensor_shape(v), true, hs);
    bool same = list[k].ndim == hn;
    for (int d = 0; same && d < hn; d++) same = list[k].shape[d] == hs[d];
    if (!same) {
      char a[96] = "", b[96] = "";
      for (int d = 0; d < list[k].ndim; d++)
        snprintf(a + strlen(a), sizeof a - strlen(a), "%s%lld", d ? ", " : "",
                 (long long)list[k].shape[d]);
      for (int d = 0; d < hn; d++)
        snprintf(b + strlen(b), sizeof b - strlen(b), "%s%lld", d ? ", " : "", (long long)hs[d]);
      st = err_set(STATUS_ESHAPE,
                   "%s: tensor '%s' has shape [%s], but config.json's model needs [%s]", hf,
                   ps[i]->fqn, a, b);
    }
  }
  for (int k = 0; k < nt && st == STATUS_OK; k++) {
    char fqn[512];
    int64_t j;
    const char *as = hf_expert_of(list[k].name, fqn, sizeof fqn, &j) ? fqn : list[k].name;
    int i = 0;
    while (i < n && strcmp(as, ps[i]->fqn) != 0) i++;
    if (i < n && as == fqn && j >= dtensor_shape(ps[i]->value)[0]) i = n; /* no such expert */
    bool head = strcmp(list[k].name, "lm_head.weight") == 0;
    if (i == n)
      st = err_set(STATUS_EFORMAT,
                   "%s: tensor '%s' is no parameter of the model config.json "
                   "describes%s",
                   hf, list[k].name,
                   head ? " (its tie_word_embeddings is true: the head is the embedding; set it "
                          "false for a head of its own)"
                        : "");
  }
  free(ps);
  llama_free(m);
  return st;
}

/* A stacked tensor's experts in a Hugging Face folder (P.experts.J.N.weight): one each of J =
 * 0, 1, ..., E - 1, as the stacked tensor [E, a, b] holds them, whatever the model. */
typedef struct expert_no {
  const char *name;
  char fqn[512];
  int64_t j;
} expert_no_t;

static int cmp_expert_no(const void *a, const void *b) {
  const expert_no_t *x = a, *y = b;
  int c = strcmp(x->fqn, y->fqn);
  return c ? c : (x->j > y->j) - (x->j < y->j);
}

static fsdpc_status_t check_expert_numbers(const char *hf, const dcp_tensor_t *list, int nt) {
  expert_no_t *e = malloc(sizeof *e * (size_t)(nt > 0 ? nt : 1));
  if (e == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  int m = 0;
  for (int k = 0; k < nt; k++)
    if (hf_expert_of(list[k].name, e[m].fqn, sizeof e[m].fqn, &e[m].j)) e[m++].name = list[k].name;
  qsort(e, (size_t)m, sizeof *e, cmp_expert_no);
  fsdpc_status_t st = STATUS_OK;
  for (int a = 0, b; a < m && st == STATUS_OK; a = b) {
    for (b = a; b < m && strcmp(e[b].fqn, e[a].fqn) == 0; b++)
      if (st == STATUS_OK && e[b].j != b - a)
        st = err_set(STATUS_EFORMAT,
                     "%s: the experts of '%s' must be numbered 0, 1, ... each once: expert %d "
                     "is missing, '%s' is there",
                     hf, e[a].fqn, b - a, e[b].name);
  }
  free(e);
  return st;
}

/* An expert weight of a Hugging Face file: tensor i of the file, expert j of stacked tensor
 * fqn, in box `box` of the runs below. */
typedef struct file_expert {
  int i, box;
  int64_t j;
  char fqn[512];
} file_expert_t;

static int cmp_file_expert(const void *a, const void *b) {
  const file_expert_t *x = a, *y = b;
  int c = strcmp(x->fqn, y->fqn);
  return c ? c : (x->j > y->j) - (x->j < y->j);
}

/* The runs of experts of file f (path from): for each stacked tensor whose experts the file
 * holds (Hugging Face's P.experts.J.N.weight), in any order (safetensors writes names sorted:
 * experts.10 before experts.2) but consecutive (Hugging Face's shards keep them so), one box
 * named stacked[b] (P.experts.N), its tensor t[b] [run, a, b] at row offset[0] = its first J;
 * each expert read into its row. *nb counts the boxes made. */
static fsdpc_status_t stack_experts(st_file_t *f, const char *from, char (*stacked)[512],
                                    fsdpc_tensor_t *t, dcp_box_t *boxes, int *nb) {
  int n = st_num_tensors(f), m = 0, first = *nb;
  file_expert_t *e = malloc(sizeof *e * (size_t)(n > 0 ? n : 1));
  int64_t *count = calloc((size_t)(n > 0 ? n : 1), sizeof *count);
  fsdpc_status_t st = e && count ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    const st_info_t *info = st_tensor(f, i);
    if (!hf_expert_of(info->name, e[m].fqn, sizeof e[m].fqn, &e[m].j)) continue;
    if (info->ndim != 2 || info->dtype == DTYPE_COUNT)
      st = err_set(STATUS_EFORMAT, "%s: tensor '%s' is not a 2-D float expert weight", from,
                   info->name);
    e[m++].i = i;
  }
  if (st == STATUS_OK && m > 1) qsort(e, (size_t)m, sizeof *e, cmp_file_expert);
  for (int k = 0; k < m && st == STATUS_OK; k++) {
    const st_info_t *info = st_tensor(f, e[k].i), *prev = k ? st_tensor(f, e[k - 1].i) : NULL;
    bool same = k > 0 && strcmp(e[k].fqn, e[k - 1].fqn) == 0;
    if (same && e[k].j == e[k - 1].j) {
      st = err_set(STATUS_EFORMAT, "%s: expert %lld of '%s' is in the file twice", from,
                   (long long)e[k].j, e[k].fqn);
    } else if (same && (prev->dtype != info->dtype || prev->shape[0] != info->shape[0] ||
                        prev->shape[1] != info->shape[1])) {
      st = err_set(STATUS_ESHAPE, "%s: expert %lld of '%s' differs in shape or dtype", from,
                   (long long)e[k].j, e[k].fqn);
    } else if (same && e[k].j == e[k - 1].j + 1) { /* the run goes on */
      e[k].box = e[k - 1].box;
      count[e[k].box - first]++;
    } else if (same) { /* a checkpoint file holds one box of a tensor */
      st = err_set(STATUS_EFORMAT,
                   "%s: the experts of '%s' in this file are not consecutive (%lld, then %lld): "
                   "each file must hold a run of experts of a tensor, in any order",
                   from, e[k].fqn, (long long)e[k - 1].j, (long long)e[k].j);
    } else { /* a run starts */
      int b = (*nb)++;
      snprintf(stacked[b], sizeof stacked[b], "%s", e[k].fqn);
      boxes[b] = (dcp_box_t){stacked[b], &t[b], {e[k].j, 0, 0}};
      count[b - first] = 1;
      e[k].box = b;
    }
  }
  for (int k = 0; k < m && st == STATUS_OK; k++) { /* the runs' tensors, from their first */
    const st_info_t *info = st_tensor(f, e[k].i);
    int b = e[k].box;
    if (k > 0 && e[k - 1].box == b) continue;
    int64_t shape[3] = {count[b - first], info->shape[0], info->shape[1]};
    st = tensor_init(&t[b], info->dtype, device_cpu(), 3, shape);
  }
  for (int k = 0; k < m && st == STATUS_OK; k++) { /* each expert into its row */
    const st_info_t *info = st_tensor(f, e[k].i);
    int b = e[k].box;
    fsdpc_tensor_t row = {0}, plane = {0};
    st = tensor_narrow(&row, &t[b], 0, e[k].j - boxes[b].offset[0], 1);
    if (st == STATUS_OK) st = tensor_view(&plane, &row, 2, info->shape);
    if (st == STATUS_OK) st = st_read(f, info->name, &plane);
    tensor_free(&plane);
    tensor_free(&row);
  }
  free(count);
  free(e);
  return st;
}

/* Writes Hugging Face file `name` of folder hf into folder model under the same name, its
 * tensors whole (per-expert tensors stacked: Hugging Face's experts.J.N.weight as rows of
 * experts.N), with the integrity records of a save of its own (folder: every file's name, and
 * the save's id). */
static fsdpc_status_t rewrite_file(const char *hf, const char *name, const char *model,
                                   const dcp_folder_t *folder, llama_arch_t arch) {
  char from[PATH_LEN + 300], to[PATH_LEN + 300];
  FSDPC_TRY(file_join(from, sizeof from, hf, name));
  FSDPC_TRY(file_join(to, sizeof to, model, name));
  st_file_t *f;
  FSDPC_TRY(st_open(from, &f));
  int n = st_num_tensors(f);
  dcp_box_t *boxes = calloc((size_t)(n > 0 ? n : 1), sizeof *boxes);
  fsdpc_tensor_t *t = calloc((size_t)(n > 0 ? n : 1), sizeof *t);
  fsdpc_status_t st = boxes && t ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
  int nb = 0; /* boxes: the file's experts' runs, then its other tensors */
  char(*stacked)[512] = st == STATUS_OK ? calloc((size_t)(n > 0 ? n : 1), sizeof *stacked) : NULL;
  if (st == STATUS_OK && stacked == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  if (st == STATUS_OK) st = stack_experts(f, from, stacked, t, boxes, &nb);
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    const st_info_t *info = st_tensor(f, i);
    char fqn[512];
    int64_t j;
    if (hf_expert_of(info->name, fqn, sizeof fqn, &j)) continue; /* stacked above */
    if (!llama_hf_canonical(arch, info->name, stacked[nb], sizeof stacked[nb]))
      continue; /* a buffer (GPT-2's attention masks) */
    if (info->dtype == DTYPE_COUNT)
      st = err_set(STATUS_EDTYPE, "%s: tensor '%s' is stored as %s, which is not read here", from,
                   info->name, info->dtype_name);
    fsdpc_tensor_t whole = {0};
    if (st == STATUS_OK)
      st = tensor_init(&whole, info->dtype, device_cpu(), info->ndim, info->shape);
    if (st == STATUS_OK) st = st_read(f, info->name, &whole);
    /* kept in the model's shape (GPT-2's c_attn: q, k and v each a dimension) */
    int64_t ms[ST_MAX_DIMS + 1];
    int mn = llama_hf_shape(arch, stacked[nb], info->ndim, info->shape, false, ms);
    if (st == STATUS_OK) st = tensor_view(&t[nb], &whole, mn, ms);
    tensor_free(&whole);
    boxes[nb] = (dcp_box_t){stacked[nb], &t[nb], {0}}; /* under the model's name */
    nb++;
  }
  if (st == STATUS_OK) st = dcp_write_file(to, boxes, nb, folder);
  for (int i = 0; t && i < nb; i++) tensor_free(&t[i]);
  free(t);
  free(boxes);
  free(stacked);
  st_close(f);
  return st;
}

typedef struct held_name {
  const char *name;
  int file;
} held_name_t;

static int cmp_held(const void *x, const void *y) {
  const held_name_t *a = x, *b = y;
  int c = strcmp(a->name, b->name);
  return c ? c : (a->file > b->file) - (a->file < b->file);
}

/* Every tensor of the n weight files of folder hf in one file only, as transformers reads them
 * (model.init_from's rule): a tensor in two (listed twice in a hand-made index, or split by
 * PyTorch DCP's sharding info) refused, naming both files. */
static fsdpc_status_t each_in_one_file(const char *hf, char *const *names, int n) {
  if (n < 2) return STATUS_OK;
  st_file_t **f = calloc((size_t)n, sizeof *f);
  if (f == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  fsdpc_status_t st = STATUS_OK;
  int total = 0;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    char path[PATH_LEN + 512];
    st = file_join(path, sizeof path, hf, names[i]);
    if (st == STATUS_OK) st = st_open(path, &f[i]);
    if (st == STATUS_OK) total += st_num_tensors(f[i]);
  }
  held_name_t *all = st == STATUS_OK ? calloc((size_t)total + 1, sizeof *all) : NULL;
  if (st == STATUS_OK && all == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  int k = 0;
  for (int i = 0; i < n && st == STATUS_OK; i++)
    for (int j = 0; j < st_num_tensors(f[i]); j++)
      all[k++] = (held_name_t){st_tensor(f[i], j)->name, i};
  if (st == STATUS_OK) qsort(all, (size_t)k, sizeof *all, cmp_held);
  for (int i = 0; i + 1 < k && st == STATUS_OK; i++)
    if (strcmp(all[i].name, all[i + 1].name) == 0)
      st = err_set(STATUS_EFORMAT,
                   "tensor '%s' is in both %s and %s: every tensor must be in exactly one file",
                   all[i].name, st_path(f[all[i].file]), st_path(f[all[i + 1].file]));
  free(all);
  for (int i = 0; i < n; i++) st_close(f[i]);
  free(f);
  return st;
}

/* The built-in Llama's config (model_type "llama") is checked as a plan would read it, and
 * every tensor against the model it describes; any other model's is kept as it is, for the
 * export to write back. */
fsdpc_status_t ckpt_import_hf(const char *hf, const char *out, hf_report_t *report) {
  hf_report_t rep_local;
  hf_report_t *rep = report ? report : &rep_local;
  memset(rep, 0, sizeof *rep);
  char cfg_path[PATH_LEN + 64], *config = NULL;
  FSDPC_TRY(file_join(cfg_path, sizeof cfg_path, hf, "config.json"));
  FSDPC_TRY(file_read_text(cfg_path, FILE_TEXT_MAX, &config));
  cJSON *cfg = cJSON_Parse(config);
  free(config);
  fsdpc_status_t st =
      cJSON_IsObject(cfg) ? STATUS_OK : err_set(STATUS_EFORMAT, "%s: not a JSON object", cfg_path);
  llama_config_t lc;
  llama_arch_t arch = arch_of(cfg);
  /* no model_type: a Llama's, as model.config and model.init_from read it */
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(cfg, "model_type");
  if (st == STATUS_OK && type == NULL) arch = LLAMA_ARCH_LLAMA;
  if (st == STATUS_OK && type != NULL && (!cJSON_IsString(type) || type->valuestring[0] == 0))
    st = err_set(STATUS_EFORMAT,
                 "%s: model_type must name the model (a string such as \"llama\"), not %s",
                 cfg_path, cJSON_IsString(type) ? "an empty string" : "another JSON value");
  bool llama = st == STATUS_OK && arch != LLAMA_ARCH_COUNT; /* GPT-2 too */
  if (llama) st = llama_config_from_hf(cfg_path, &lc);
  /* the source's tensors, read once for the checks (their files validated) */
  /* model.safetensors or the files its index names: the folder's others are not read */
  char **names = NULL;
  int n = 0;
  if (st == STATUS_OK) st = hf_weight_files(hf, &names, &n);
  if (st == STATUS_OK) st = each_in_one_file(hf, names, n);
  dcp_reader_t *r = NULL;
  const dcp_tensor_t *list = NULL;
  int nt = 0;
  if (st == STATUS_OK) st = dcp_reader_open_files(hf, (const char *const *)names, n, &r);
  if (st == STATUS_OK) st = dcp_reader_list(r, &list, &nt);
  if (st == STATUS_OK) st = check_expert_numbers(hf, list, nt);
  /* the tensors under the model's names (GPT-2's base-model files), buffers left out */
  dcp_tensor_t *canon = st == STATUS_OK ? calloc((size_t)nt + 1, sizeof *canon) : NULL;
  char(*canon_names)[512] = canon ? calloc((size_t)nt + 1, sizeof *canon_names) : NULL;
  if (st == STATUS_OK && canon_names == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  int nc = 0;
  uint64_t kept_bytes = 0; /* of the tensors written */
  for (int k = 0; k < nt && st == STATUS_OK; k++)
    if (llama_hf_canonical(arch, list[k].name, canon_names[nc], sizeof canon_names[nc])) {
      canon[nc] = list[k];
      canon[nc].name = canon_names[nc];
      kept_bytes += list[k].bytes;
      nc++;
    }
  if (st == STATUS_OK) qsort(canon, (size_t)nc, sizeof *canon, cmp_tensor_names);
  for (int a = 0; a + 1 < nc && st == STATUS_OK; a++) /* one tensor under both of its names */
    if (strcmp(canon[a].name, canon[a + 1].name) == 0)
      st = err_set(STATUS_EFORMAT, "%s: tensor '%s' is there under two names", hf, canon[a].name);
  if (st == STATUS_OK && llama) st = check_llama_tensors(hf, &lc, canon, nc);
  free(canon_names);
  free(canon);
  if (st == STATUS_OK) st = file_check_output_dir(out, "import-hf: OUT", false);
  if (st == STATUS_OK) st = file_check_outside(out, hf, "import-hf: OUT");
  char tmp[PATH_LEN + 16] = "", model[PATH_LEN + 32];
  if (st == STATUS_OK) st = file_make_temp_dir(out, tmp, sizeof tmp);
  bool made = st == STATUS_OK;
  if (st == STATUS_OK) st = file_join(model, sizeof model, tmp, "model");
  if (st == STATUS_OK && mkdir(model, 0755) != 0)
    st = err_set(STATUS_EIO, "%s: cannot create: %s", model, strerror(errno));
  uint64_t id = dcp_new_save_id();
  dcp_folder_t folder = {(const char *const *)names, n, id};
  for (int i = 0; i < n && st == STATUS_OK; i++)
    st = rewrite_file(hf, names[i], model, &folder, arch);
  cJSON *state = cJSON_CreateObject(), *under = cJSON_CreateObject();
  cJSON_AddNumberToObject(state, "step", 0);
  cJSON_AddNumberToObject(state, "optim_steps", 0);
  cJSON_AddStringToObject(under, "imported_from", hf);
  cJSON_AddItemToObject(under, "model", cfg);
  cJSON_AddItemToObject(state, "saved_under", under);
  char *text = st == STATUS_OK ? cJSON_Print(state) : NULL;
  if (st == STATUS_OK && text == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  if (st == STATUS_OK)
    st = ckpt_commit_state(tmp, out, text, &id, NULL); /* sealed: weights only */
  else if (made)
    file_discard_temp_dir(tmp);
  free(text);
  cJSON_Delete(state);
  if (st == STATUS_OK) { /* as written: the buffers left out */
    rep->files = n;
    rep->tensors = nc;
    rep->bytes = kept_bytes;
  }
  dcp_reader_close(r);
  hf_weight_files_free(names, n);
  return st;
}
