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

#include "checkpoint/ckpt_reshard.h"
#include "checkpoint/dcp.h"
#include "checkpoint/train_ckpt.h"
#include "core/file.h"
#include "mesh/world.h"
#include "models/llama/llama.h"
#include "models/llama/llama_plan.h"
#include "parallel/parallelize.h"
#include "train/hf_convert.h"
#include "train/plan.h"

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
          "       fsdp-ckpt --help | --version\n"
          "  an option's value may follow it or an '=' (--dtype=bf16)\n");
}

/* A training checkpoint's train_state.json against its record and its folders; nothing for a
 * plain shard folder. */
static fsdpc_status_t check_state(const char *dir) {
  char path[PATH_LEN];
  FSDPC_TRY(file_join(path, sizeof path, dir, "train_state.json"));
  return file_lexists(path) ? ckpt_check_state(dir) : STATUS_OK;
}

/* A training checkpoint's folder (its DIR/model) without its train_state.json: refused by
 * every load, so by what would read it as a checkpoint. */
static fsdpc_status_t check_complete(const char *dir) {
  char model[PATH_LEN], state[PATH_LEN];
  FSDPC_TRY(file_join(model, sizeof model, dir, "model"));
  FSDPC_TRY(file_join(state, sizeof state, dir, "train_state.json"));
  if (file_is_dir(model) && !file_lexists(state))
    return err_set(STATUS_EFORMAT,
                   "%s: no train_state.json: not a complete checkpoint, which every load refuses "
                   "(its save did not finish, or the file was removed)",
                   dir);
  return STATUS_OK;
}

/* The folder of the model's shards: DIR/model in a training checkpoint, else DIR. */
static fsdpc_status_t model_folder(const char *dir, char *out, size_t size) {
  FSDPC_TRY(file_join(out, size, dir, "model"));
  if (!file_is_dir(out)) snprintf(out, size, "%s", dir);
  return STATUS_OK;
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

static fsdpc_status_t inspect_folder(const char *title, const char *dir) {
  dcp_reader_t *r;
  FSDPC_TRY(dcp_reader_open(dir, &r));
  const dcp_tensor_t *t;
  int n;
  fsdpc_status_t st = dcp_reader_list(r, &t, &n);
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

/* The step folders of a run's checkpoint folder, as ckpt_scan_steps finds them. */
typedef struct run_steps {
  struct run_step {
    char name[32]; /* step-NNNNNNNN[.tmp]: at most 28 characters */
    int64_t step;
    ckpt_step_kind_t kind;
  } * v;
  int n;
} run_steps_t;

static fsdpc_status_t add_run_step(void *ctx, const char *name, int64_t step,
                                   ckpt_step_kind_t kind) {
  run_steps_t *l = ctx;
  struct run_step *grown = realloc(l->v, (size_t)(l->n + 1) * sizeof *grown);
  if (grown == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  l->v = grown;
  struct run_step *e = &l->v[l->n++];
  snprintf(e->name, sizeof e->name, "%s", name);
  e->step = step;
  e->kind = kind;
  return STATUS_OK;
}

static int by_step(const void *a, const void *b) { /* a step's folder before its .tmp */
  const struct run_step *x = a, *y = b;
  if (x->step != y->step) return (x->step > y->step) - (x->step < y->step);
  return (x->kind == CKPT_STEP_TMP) - (y->kind == CKPT_STEP_TMP);
}

/* A run's checkpoint.dir (step-N folders, no checkpoint of its own): lists its checkpoints,
 * complete or not. *listed is false when dir holds no step folder. */
static fsdpc_status_t inspect_run(const char *dir, bool *listed) {
  run_steps_t l = {NULL, 0};
  fsdpc_status_t st = ckpt_scan_steps(dir, add_run_step, &l);
  *listed = st == STATUS_OK && l.n > 0;
  if (*listed) {
    qsort(l.v, (size_t)l.n, sizeof *l.v, by_step);
    /* a complete one's record checked as every load checks it (its step against its name,
     * its files' headers): one a load refuses is said so, with why */
    char(*why)[512] = calloc((size_t)l.n, sizeof *why);
    if (why == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
    int complete = 0;
    for (int i = 0; why && i < l.n; i++) {
      char path[PATH_LEN];
      if (file_join(path, sizeof path, dir, l.v[i].name) != STATUS_OK) continue;
      struct stat sb;
      if (l.v[i].kind == CKPT_STEP_TMP && lstat(path, &sb) == 0 && S_ISLNK(sb.st_mode))
        snprintf(why[i], sizeof why[i],
                 "a link: removed itself at the next start (what it points to is kept)");
      else if (l.v[i].kind == CKPT_STEP_TMP && !file_is_stale_temp_dir(path)) /* left */
        snprintf(why[i], sizeof why[i], "no save's, or one still being written: left as it is");
      if (l.v[i].kind != CKPT_STEP_COMPLETE) continue;
      if (ckpt_check_state(path) != STATUS_OK) snprintf(why[i], sizeof why[i], "%s", err_detail());
      err_clear();
      complete += why[i][0] == 0;
    }
    printf("%s: a run's checkpoint folder, %d complete checkpoint%s:\n", dir, complete,
           complete == 1 ? "" : "s");
    for (int i = 0; why && i < l.n; i++) {
      printf("  %-24s %s%s\n", l.v[i].name,
             l.v[i].kind == CKPT_STEP_COMPLETE
                 ? (why[i][0] ? "refused by every load: " : "complete")
             : l.v[i].kind != CKPT_STEP_TMP ? "not a complete checkpoint (no train_state.json)"
             : why[i][0]                    ? "unfinished, "
                         : "a save that did not finish (removed at the next start)",
             why[i]);
    }
    free(why);
    printf("inspect one of them: fsdp-ckpt inspect %s/STEP\n", dir);
  }
  free(l.v);
  return st;
}

/* A run's checkpoint.dir given where one checkpoint is wanted: refused, naming its newest
 * complete step folder. */
static fsdpc_status_t refuse_run_folder(const char *dir, const char *cmd) {
  char own[PATH_LEN + 32];
  FSDPC_TRY(file_join(own, sizeof own, dir, "train_state.json"));
  if (access(own, F_OK) == 0) return STATUS_OK;
  run_steps_t l = {NULL, 0};
  char newest[PATH_LEN + 32];
  bool found = false;
  fsdpc_status_t st = ckpt_scan_steps(dir, add_run_step, &l);
  if (st == STATUS_OK && l.n > 0) st = ckpt_latest(dir, newest, sizeof newest, &found, NULL, 0);
  if (st == STATUS_OK && l.n > 0 && found)
    st = err_set(STATUS_EINVAL,
                 "%s is a run's checkpoint folder (%d step folder%s): %s takes one checkpoint, "
                 "such as its newest complete one, %s (fsdp-ckpt inspect %s lists them)",
                 dir, l.n, l.n == 1 ? "" : "s", cmd, newest, dir);
  else if (st == STATUS_OK && l.n > 0)
    st = err_set(STATUS_EINVAL,
                 "%s is a run's checkpoint folder with no complete checkpoint (fsdp-ckpt inspect "
                 "%s lists its step folders): %s takes one checkpoint",
                 dir, dir, cmd);
  free(l.v);
  return st;
}

static fsdpc_status_t inspect(const char *dir) {
  if (!file_is_dir(dir)) return err_set(STATUS_EIO, "%s: not a folder", dir);
  char own[PATH_LEN + 32];
  FSDPC_TRY(file_join(own, sizeof own, dir, "train_state.json"));
  if (access(own, F_OK) != 0) {
    bool listed;
    FSDPC_TRY(inspect_run(dir, &listed));
    if (listed) return STATUS_OK;
  }
  FSDPC_TRY(check_state(dir)); /* a train state that passes is valid JSON */
  if (check_complete(dir) != STATUS_OK) { /* listed all the same: what is left of it */
    printf("%s\n", err_detail());
    err_clear();
  }
  char *text;
  FSDPC_TRY(ckpt_state_text(dir, &text));
  cJSON *state = text ? cJSON_Parse(text) : NULL;
  free(text);
  if (state) {
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(state, "step");
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(state, "saved_under");
    printf("checkpoint %s: after step %lld\n", dir,
           cJSON_IsNumber(s) ? (long long)s->valuedouble : -1);
    const cJSON *it;
    if (!cJSON_IsObject(u)) u = NULL; /* an older or another tool's record: not shown */
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
  fsdpc_status_t st = model_folder(dir, model, sizeof model);
  if (st == STATUS_OK) st = inspect_folder("model", model);
  if (st == STATUS_OK) st = file_join(optim, sizeof optim, dir, "optim");
  if (st == STATUS_OK && file_is_dir(optim)) st = inspect_folder("optimizer state", optim);
  cJSON_Delete(state);
  return st;
}

/* The checkpoint's tensors against model's parameters (ckpt_check_params): what a load of
 * that model refuses. */
static fsdpc_status_t check_params_of(const char *dir, llama_t *model) {
  nn_param_t **ps = NULL;
  int n = 0;
  FSDPC_TRY(nn_named_parameters(llama_module(model), &ps, &n));
  fsdpc_status_t st = ckpt_check_params(dir, ps, n);
  free(ps);
  return st;
}

/* A training checkpoint of a model fsdp-train builds (its record says which) against that
 * model, a meta one (no memory); any other model's checkpoint passes. */
static fsdpc_status_t check_recorded_model(const char *dir) {
  char *config = NULL;
  FSDPC_TRY(ckpt_recorded_config(dir, &config));
  fsdpc_status_t st = STATUS_OK;
  if (config && hf_config_is_family(config)) {
    llama_config_t c;
    llama_options_t lo = LLAMA_OPTIONS_INIT;
    lo.deferred = true;
    llama_t *model = NULL;
    st = llama_config_from_hf_text(config, dir, &c);
    if (st == STATUS_OK) st = llama_new(&c, &lo, &model);
    if (st == STATUS_OK) st = check_params_of(dir, model);
    llama_free(model);
  }
  free(config);
  return st;
}

/* ---- verify ---- */

/* Checks every chunk of every tensor of one folder; reports each damaged tensor and adds the
 * counts. */
static fsdpc_status_t verify_folder(const char *dir, int *checked, int *unchecked, int *damaged) {
  dcp_reader_t *r;
  FSDPC_TRY(dcp_reader_open(dir, &r));
  const dcp_tensor_t *t;
  int n;
  fsdpc_status_t st = dcp_reader_list(r, &t, &n);
  char how[160];
  checks_text(r, how, sizeof how);
  printf("%s: %s\n", dir, how);
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    int ok = 0, none = 0;
    fsdpc_status_t vs = dcp_reader_verify(r, t[i].name, &ok, &none);
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
static fsdpc_status_t verify(const char *dir) {
  if (!file_is_dir(dir)) return err_set(STATUS_EIO, "%s: not a folder", dir);
  FSDPC_TRY(refuse_run_folder(dir, "verify"));
  FSDPC_TRY(check_state(dir));
  char model[PATH_LEN], optim[PATH_LEN];
  FSDPC_TRY(model_folder(dir, model, sizeof model));
  FSDPC_TRY(file_join(optim, sizeof optim, dir, "optim"));
  int checked = 0, unchecked = 0, damaged = 0;
  FSDPC_TRY(verify_folder(model, &checked, &unchecked, &damaged));
  if (file_is_dir(optim)) FSDPC_TRY(verify_folder(optim, &checked, &unchecked, &damaged));
  printf("%s: %d chunk%s match%s their checksums, %d saved without one, %d tensor%s damaged\n", dir,
         checked, checked == 1 ? "" : "s", checked == 1 ? "es" : "", unchecked, damaged,
         damaged == 1 ? "" : "s");
  if (damaged > 0)
    return err_set(STATUS_EFORMAT, "%s: %d tensor%s damaged (named above)", dir, damaged,
                   damaged == 1 ? "" : "s");
  FSDPC_TRY(check_complete(dir));
  char state[PATH_LEN];
  FSDPC_TRY(file_join(state, sizeof state, dir, "train_state.json"));
  return file_lexists(state) ? check_recorded_model(dir) : STATUS_OK;
}

/* ---- export-hf, import-hf ---- */

static fsdpc_status_t export_hf(const char *dir, const char *out, const hf_export_opts_t *o) {
  hf_report_t rep;
  if (file_is_dir(dir)) FSDPC_TRY(refuse_run_folder(dir, "export-hf"));
  if (file_is_dir(dir)) FSDPC_TRY(check_complete(dir));
  fsdpc_status_t st = ckpt_export_hf(dir, out, o, &rep);
  if (rep.unchecked)
    printf("%s has no checksums (written by another tool): what is read from it is unchecked\n",
           dir);
  if (st == STATUS_OK && rep.unquantized)
    fprintf(stderr,
            "fsdp-ckpt: note: the model config's quantization_config is left out of %s's "
            "config.json: the tensors written are not quantized\n",
            out);
  if (st == STATUS_OK)
    printf("exported %d tensors, %llu bytes, into %d file%s in %s\n", rep.tensors,
           (unsigned long long)rep.bytes, rep.files, rep.files == 1 ? "" : "s", out);
  return st;
}

/* What an earlier command writing out left when it was stopped (OUT.tmp-XXXXXX, marked as
 * being written, its writer gone): removed, said; never input, the command's. */
static void clear_stale(const char *out, const char *input, const char *other) {
  const char *keep[] = {input, other, NULL};
  int n = file_remove_stale_temps(out, keep);
  int len = (int)strlen(out);
  while (len > 1 && out[len - 1] == '/') len--; /* OUT/ names OUT */
  if (n > 0)
    fprintf(stderr,
            "fsdp-ckpt: note: removed %d unfinished output%s beside '%s' (%.*s.tmp-*), left by "
            "a command that was stopped\n",
            n, n == 1 ? "" : "s", out, len, out);
}

static fsdpc_status_t import_hf(const char *hf, const char *out) {
  clear_stale(out, hf, NULL);
  hf_report_t rep;
  FSDPC_TRY(ckpt_import_hf(hf, out, &rep));
  printf("imported %d tensors from %d file%s of %s into %s (step 0, no optimizer state)\n",
         rep.tensors, rep.files, rep.files == 1 ? "" : "s", hf, out);
  return STATUS_OK;
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
  const fsdpc_plan_t *plan;
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

static fsdpc_status_t target_placements(void *ctx, const char *param, int ndim, int *mesh_ndim,
                                        int *mesh_shape, placement_t *pl) {
  const kinds_t *k = ctx;
  char module[1024];
  snprintf(module, sizeof module, "%s", param);
  char *dot = strrchr(module, '.');
  if (dot)
    *dot = 0;
  else
    module[0] = 0;
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
  return parallel_param_placements(&k->plan->par, param, kind, ndim, mesh_ndim, mesh_shape, pl);
}

/* Prints, for each folder of a checkpoint, that what is read from it is unchecked. */
static void say_unchecked_folders(const char *dir) {
  const char *subs[2] = {"model", "optim"};
  for (int k = 0; k < 2; k++) {
    char path[PATH_LEN + 16];
    dcp_reader_t *r;
    if (file_join(path, sizeof path, dir, subs[k]) == STATUS_OK && file_is_dir(path) &&
        dcp_reader_open(path, &r) == STATUS_OK) {
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

/* The world the new plan is for: --world, else the product of the plan's mesh sizes. */
static fsdpc_status_t reshard_world(const fsdpc_plan_t *p, const reshard_opts_t *o, int *world) {
  *world = o->world;
  if (*world > 0) return STATUS_OK;
  if (p->par.dp_replicate < 0 || p->par.dp_shard < 0 || p->par.tp < 0)
    return err_set(STATUS_EINVAL,
                   "%s: mesh: a size of -1 takes the rest of the world; give --world N", o->config);
  *world = p->par.dp_replicate * p->par.dp_shard * p->par.tp * p->par.pp;
  return STATUS_OK;
}

/* The new checkpoint's saved_under record (JSON text; NULL when out of memory). */
static char *reshard_record(const fsdpc_plan_t *p, const reshard_opts_t *o, const char *dir,
                            int world, const char *config) {
  cJSON *nu = cJSON_CreateObject();
  cJSON_AddStringToObject(nu, "plan", o->config);
  cJSON_AddNumberToObject(nu, "world_size", world);
  cJSON_AddNumberToObject(nu, "dp_replicate", p->par.dp_replicate);
  cJSON_AddNumberToObject(nu, "dp_shard", p->par.dp_shard);
  cJSON_AddNumberToObject(nu, "tp", p->par.tp);
  if (p->par.ep > 1) cJSON_AddNumberToObject(nu, "ep", p->par.ep);
  if (p->par.pp > 1) cJSON_AddNumberToObject(nu, "pp", p->par.pp);
  cJSON_AddStringToObject(nu, "resharded_from", dir);
  if (config) cJSON_AddItemToObject(nu, "model", cJSON_Parse(config));
  /* the training run's own record, which a resume compares with its plan's (another global
   * batch, data order or learning-rate schedule is warned of): the source's, unchanged by a
   * new layout */
  char *text = NULL;
  cJSON *src = ckpt_state_text(dir, &text) == STATUS_OK && text ? cJSON_Parse(text) : NULL;
  free(text);
  const cJSON *was = cJSON_GetObjectItemCaseSensitive(src, "saved_under");
  /* what the run resumed from it continues: its data, its schedule, the step's metrics line
   * and an evaluation a stop skipped */
  const char *kept[5] = {"global_batch", "data_order", "schedule", "metrics", "eval_pending"};
  for (int k = 0; k < 5 && cJSON_IsObject(was); k++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(was, kept[k]);
    if (v != NULL) cJSON_AddItemToObject(nu, kept[k], cJSON_Duplicate(v, true));
  }
  cJSON_Delete(src);
  char *under = cJSON_PrintUnformatted(nu);
  cJSON_Delete(nu);
  return under;
}

static fsdpc_status_t reshard(const char *dir, const char *out, const reshard_opts_t *o) {
  fsdpc_plan_t p;
  int world;
  FSDPC_TRY(plan_load(&p, o->config, o->sets, o->n_sets));
  FSDPC_TRY(reshard_world(&p, o, &world));
  if (!file_is_dir(dir)) return err_set(STATUS_EIO, "%s: not a folder", dir);
  FSDPC_TRY(refuse_run_folder(dir, "reshard"));
  char state[PATH_LEN + 32], *config = NULL;
  FSDPC_TRY(file_join(state, sizeof state, dir, "train_state.json"));
  if (!file_lexists(state))
    return err_set(STATUS_EINVAL, "%s: not a training checkpoint (no train_state.json)", dir);
  FSDPC_TRY(ckpt_recorded_config(dir, &config));
  bool llama = config && hf_config_is_family(config);
  /* a model fsdp-train builds: the checkpoint records it; a plan that states one must state
   * the same, or nothing would load. Any other model: the plan's mesh and parallelize
   * sections alone. The data and training sections are checked, and shape nothing. */
  fsdpc_status_t st = STATUS_OK;
  if (llama) {
    char why[192];
    llama_config_t saved;
    st = llama_config_from_hf_text(config, dir, &saved);
    if (st == STATUS_OK && !p.model_given) {
      p.model = saved; /* and its architecture's built-in tensor-parallel rules */
      if (!p.par.tp_plan_given) st = llama_plan_fill_tp_rules(&p.model, &p.par);
    } else if (st == STATUS_OK && (!llama_config_same_params(&saved, &p.model, why, sizeof why) ||
                                   !llama_config_same_function(&saved, &p.model, why, sizeof why)))
      st = err_set(STATUS_EINVAL,
                   "%s: the checkpoint's model differs from the model of %s (%s: saved vs "
                   "planned; leave the model section out to take the checkpoint's)",
                   dir, o->config, why);
    else if (st == STATUS_OK && llama_vocab_rows(&saved) != llama_vocab_rows(&p.model))
      st = err_set(STATUS_EINVAL,
                   "%s: the checkpoint holds an embedding and head of %lld rows "
                   "(model.pad_vocab_multiple = %lld), the model of %s has %lld: set its "
                   "model.pad_vocab_multiple to %lld, or leave the model section out to take the "
                   "checkpoint's",
                   dir, (long long)llama_vocab_rows(&saved), (long long)saved.pad_vocab_multiple,
                   o->config, (long long)llama_vocab_rows(&p.model),
                   (long long)saved.pad_vocab_multiple);
  }
  p.layout_only = true;
  if (st == STATUS_OK)
    st = llama ? plan_resolve_model(&p, world) : parallel_plan_resolve(&p.par, world);
  /* the Llama's module kinds come from a meta model: no memory */
  llama_options_t lo = LLAMA_OPTIONS_INIT;
  lo.deferred = true;
  llama_t *model = NULL;
  if (st == STATUS_OK && llama) st = llama_new(&p.model, &lo, &model);
  if (st == STATUS_OK && llama) st = check_params_of(dir, model); /* what no load would take */
  kinds_t kinds = {model ? llama_module(model) : NULL, o->embeddings, o->n_embeddings, &p};
  char *under = reshard_record(&p, o, dir, world, config);
  if (st == STATUS_OK && under == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  int files = 0;
  if (st == STATUS_OK) say_unchecked_folders(dir);
  if (st == STATUS_OK)
    st = ckpt_reshard_training(dir, out, world, target_placements, &kinds, under, &files);
  char ep[48] = "", pp[24] = "";
  if (p.par.ep > 1) snprintf(ep, sizeof ep, ", the experts split over ep %d", p.par.ep);
  if (p.par.pp > 1) snprintf(pp, sizeof pp, "pp %d x ", p.par.pp);
  if (st == STATUS_OK)
    printf(
        "resharded %s for %d rank%s (%sdp_replicate %d x dp_shard %d x tp %d%s): %d file%s in "
        "%s\n",
        dir, world, world == 1 ? "" : "s", pp, p.par.dp_replicate, p.par.dp_shard, p.par.tp, ep,
        files, files == 1 ? "" : "s", out);
  free(under);
  llama_free(model);
  free(config);
  return st;
}

/* ---- main ---- */

/* "--name=value" with name one of names (the options that take a value): "--name" into opt and
 * the value into *value; otherwise false. */
static bool split_eq(const char *a, const char *const *names, char *opt, size_t n,
                     const char **value) {
  const char *eq = strchr(a, '=');
  if (strncmp(a, "--", 2) != 0 || eq == NULL || (size_t)(eq - a) >= n) return false;
  for (int k = 0; names[k]; k++)
    if (strlen(names[k]) == (size_t)(eq - a) && strncmp(a, names[k], (size_t)(eq - a)) == 0) {
      snprintf(opt, n, "%s", names[k]);
      *value = eq + 1;
      return true;
    }
  return false;
}

/* fsdp-ckpt reshard DIR --to CONFIG OUT [--world N] [--set k=v]... [--embedding GLOB]... */
static fsdpc_status_t reshard_command(int argc, char **argv) {
  const char *pos[2] = {NULL, NULL}, *sets[256], *embeddings[256];
  reshard_opts_t o = {.config = NULL, .sets = sets, .embeddings = embeddings};
  int np = 0;
  static const char *const valued[] = {"--to", "--world", "--set", "--embedding", NULL};
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *v = NULL;
    char opt[16];
    if (split_eq(a, valued, opt, sizeof opt, &v)) a = opt;
    if (strcmp(a, "--to") == 0 || strcmp(a, "--world") == 0 || strcmp(a, "--set") == 0 ||
        strcmp(a, "--embedding") == 0) {
      if (v == NULL && i + 1 >= argc) return err_set(STATUS_EINVAL, "%s needs a value", a);
      if (v == NULL) v = argv[++i];
      if (a[2] == 't') {
        o.config = v;
      } else if (a[2] == 'w') {
        char *end;
        long w = strtol(v, &end, 10);
        if (!isdigit((unsigned char)v[0]) || *end || w < 1 || w > 1 << 20)
          return err_set(STATUS_EINVAL,
                         "--world: expected a number of ranks from 1 to %d, got '%s'", 1 << 20, v);
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
  clear_stale(pos[1], pos[0], o.config);
  return reshard(pos[0], pos[1], &o);
}

/* fsdp-ckpt export-hf DIR OUT [--dtype D] [--max-shard-bytes N] [--config FILE] */
static fsdpc_status_t export_command(int argc, char **argv) {
  hf_export_opts_t o = HF_EXPORT_OPTS_INIT;
  const char *pos[2] = {NULL, NULL};
  int np = 0;
  static const char *const valued[] = {"--dtype", "--max-shard-bytes", "--config", NULL};
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *v = NULL;
    char opt[24];
    if (split_eq(a, valued, opt, sizeof opt, &v)) a = opt;
    if (strcmp(a, "--dtype") == 0 || strcmp(a, "--max-shard-bytes") == 0 ||
        strcmp(a, "--config") == 0) {
      if (v == NULL && i + 1 >= argc) return err_set(STATUS_EINVAL, "%s needs a value", a);
      if (v == NULL) v = argv[++i];
      if (a[2] == 'd') {
        if (dtype_parse(v, &o.dtype) != STATUS_OK || !dtype_is_float(o.dtype))
          return err_set(STATUS_EINVAL, "--dtype: expected f32, bf16 or f16, got '%s'", v);
      } else if (a[2] == 'm') {
        char *end;
        errno = 0;
        unsigned long long b = strtoull(v, &end, 10);
        if (errno || *end || b == 0 || !isdigit((unsigned char)v[0]))
          return err_set(STATUS_EINVAL, "--max-shard-bytes: expected a positive integer, got '%s'",
                         v);
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
  clear_stale(pos[1], pos[0], o.config);
  return export_hf(pos[0], pos[1], &o);
}

/* A command of folders alone (inspect, verify, import-hf): its arguments, none an option. */
static fsdpc_status_t folders_only(int argc, char **argv, int want, const char *takes) {
  for (int i = 2; i < argc; i++)
    if (argv[i][0] == '-' && argv[i][1] != 0)
      return err_set(STATUS_EINVAL, "%s: unknown option '%s' (it takes %s)", argv[1], argv[i],
                     takes);
  if (argc - 2 != want)
    return err_set(STATUS_EINVAL, "%s takes %s, got %d argument%s", argv[1], takes, argc - 2,
                   argc - 2 == 1 ? "" : "s");
  return STATUS_OK;
}

static fsdpc_status_t run(int argc, char **argv) {
  if (argc < 2) return err_set(STATUS_EINVAL, "missing a command and its folders");
  const char *cmd = argv[1];
  if (cmd[0] == '-' && cmd[1] != 0) return err_set(STATUS_EINVAL, "unknown option '%s'", cmd);
  for (int i = 2; i < argc; i++) /* "" as a folder would name the root folder's files */
    if (argv[i][0] == 0) return err_set(STATUS_EINVAL, "%s: argument %d is empty", cmd, i - 1);
  if (strcmp(cmd, "inspect") == 0) {
    FSDPC_TRY(folders_only(argc, argv, 1, "one folder"));
    return inspect(argv[2]);
  }
  if (strcmp(cmd, "verify") == 0) {
    FSDPC_TRY(folders_only(argc, argv, 1, "one folder"));
    return verify(argv[2]);
  }
  if (strcmp(cmd, "import-hf") == 0) {
    FSDPC_TRY(folders_only(argc, argv, 2, "HFDIR OUT"));
    return import_hf(argv[2], argv[3]);
  }
  if (strcmp(cmd, "reshard") == 0) return reshard_command(argc, argv);
  if (strcmp(cmd, "export-hf") == 0) return export_command(argc, argv);
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
  if (!world_start(&argc, &argv, "fsdp-ckpt")) return 1;
  fsdpc_status_t st = run(argc, argv);
  if (st != STATUS_OK) {
    fprintf(stderr, "fsdp-ckpt: %s\n", err_detail());
    if (strncmp(err_detail(), "missing a command", 17) == 0 ||
        strncmp(err_detail(), "unknown command", 15) == 0 ||
        strncmp(err_detail(), "unknown option", 14) == 0)
      usage(stderr);
  }
  world_finalize();
  return st == STATUS_OK ? 0 : 1;
}
