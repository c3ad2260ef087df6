#include "checkpoint/train_ckpt.h"

#include <cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/dcp_integrity_impl.h"
#include "checkpoint/dcp_reader_impl.h"
#include "checkpoint/train_ckpt_impl.h"
#include "core/args_impl.h"
#include "core/file.h"

#define PATH_LEN 4400

/* Entries of the model (names) and of the optimizer ("name.exp_avg", ...). */
void ckpt_entries_free(ckpt_entries_t *e) {
  for (int i = 0; i < 2 * e->n; i++) {
    if (e->owned) dtensor_free(e->owned[i]);
    if (e->names) free(e->names[i]);
  }
  free(e->model);
  free(e->optim);
  free(e->owned);
  free(e->names);
  memset(e, 0, sizeof *e); /* freed twice is harmless */
}

fsdpc_status_t ckpt_entries_make(nn_param_t *const *params, int n, optim_t *opt,
                                 ckpt_entries_mode_t mode, ckpt_entries_t *e) {
  memset(e, 0, sizeof *e);
  e->n = n;
  e->model = calloc((size_t)n + 1, sizeof *e->model);
  e->optim = calloc(2 * (size_t)n + 1, sizeof *e->optim);
  e->owned = calloc(2 * (size_t)n + 1, sizeof *e->owned);
  e->names = calloc(2 * (size_t)n + 1, sizeof *e->names);
  if (!e->model || !e->optim || !e->owned || !e->names) {
    ckpt_entries_free(e);
    return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  }
  for (int i = 0; i < n; i++) {
    const char *name = params[i]->fqn;
    e->model[i] = (dcp_entry_t){name, params[i]->value};
    if (mode == CKPT_ENTRIES_MODEL_ONLY) continue;
    if (optim_param(opt, i) != params[i]) { /* its moments would go under another's name */
      const nn_param_t *o = optim_param(opt, i);
      ckpt_entries_free(e);
      return err_set(STATUS_EINVAL,
                     "checkpoint: parameter %d ('%s') is not the optimizer's parameter %d (%s); "
                     "give the parameters in the order given to optim_new",
                     i, name, i, o ? o->fqn : "it has none");
    }
    fsdpc_status_t st = mode == CKPT_ENTRIES_SAVE
                            ? optim_state(opt, i, &e->owned[2 * i], &e->owned[2 * i + 1])
                            : optim_state_for_load(opt, i, &e->owned[2 * i], &e->owned[2 * i + 1]);
    for (int k = 0; k < 2 && st == STATUS_OK; k++) {
      size_t l = strlen(name) + 16;
      if ((e->names[2 * i + k] = malloc(l)) == NULL) {
        st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
        break;
      }
      snprintf(e->names[2 * i + k], l, "%s.%s", name, k ? "exp_avg_sq" : "exp_avg");
      e->optim[2 * i + k] = (dcp_entry_t){e->names[2 * i + k], e->owned[2 * i + k]};
    }
    if (st != STATUS_OK) {
      ckpt_entries_free(e);
      return st;
    }
  }
  return STATUS_OK;
}

fsdpc_status_t ckpt_make_dir(const char *path) {
  if (mkdir(path, 0755) != 0 && errno != EEXIST)
    return err_set(STATUS_EIO, "checkpoint: cannot create %s: %s", path, strerror(errno));
  return STATUS_OK;
}

/* The hash of a train state: its compact JSON without the "integrity" member. */
static fsdpc_status_t state_hash(const cJSON *state, uint64_t *out) {
  cJSON *copy = cJSON_Duplicate(state, true);
  if (copy) cJSON_DeleteItemFromObjectCaseSensitive(copy, "integrity");
  char *text = copy ? cJSON_PrintUnformatted(copy) : NULL;
  cJSON_Delete(copy);
  if (text == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  *out = dcp_block_hash(text, strlen(text));
  free(text);
  return STATUS_OK;
}

fsdpc_status_t ckpt_state_seal(const char *text, uint64_t model_id, const uint64_t *optim_id,
                               char **out) {
  ARG_NONNULL(text);
  ARG_NONNULL(out);
  *out = NULL;
  cJSON *o = cJSON_Parse(text);
  if (!cJSON_IsObject(o)) {
    cJSON_Delete(o);
    return err_set(STATUS_EINVAL, "checkpoint: a train state is not a JSON object");
  }
  cJSON_DeleteItemFromObjectCaseSensitive(o, "integrity");
  uint64_t h = 0;
  fsdpc_status_t st = state_hash(o, &h);
  char hex[3][17];
  snprintf(hex[0], 17, "%016" PRIx64, model_id);
  snprintf(hex[1], 17, "%016" PRIx64, optim_id ? *optim_id : 0);
  snprintf(hex[2], 17, "%016" PRIx64, h);
  cJSON *it = st == STATUS_OK ? cJSON_AddObjectToObject(o, "integrity") : NULL;
  if (it) {
    cJSON_AddStringToObject(it, "model", hex[0]);
    if (optim_id) cJSON_AddStringToObject(it, "optim", hex[1]);
    cJSON_AddStringToObject(it, "state", hex[2]);
  }
  if (st == STATUS_OK && (it == NULL || (*out = cJSON_Print(o)) == NULL))
    st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  cJSON_Delete(o);
  return st;
}

fsdpc_status_t ckpt_state_text(const char *dir, char **out) {
  ARG_NONNULL(dir);
  ARG_NONNULL(out);
  char path[PATH_LEN];
  *out = NULL;
  FSDPC_TRY(file_join(path, sizeof path, dir, "train_state.json"));
  if (!file_lexists(path)) return STATUS_OK;
  return file_read_text(path, FILE_TEXT_MAX, out);
}

fsdpc_status_t ckpt_commit_state(const char *tmp, const char *out, const char *state_text,
                                 const uint64_t *model_id, const uint64_t *optim_id) {
  ARG_NONNULL(tmp);
  ARG_NONNULL(out);
  ARG_NONNULL(state_text);
  char *sealed = NULL, path[PATH_LEN];
  fsdpc_status_t st = STATUS_OK;
  if (model_id) st = ckpt_state_seal(state_text, *model_id, optim_id, &sealed);
  if (st == STATUS_OK) st = file_join(path, sizeof path, tmp, "train_state.json");
  if (st == STATUS_OK) st = file_write_text(path, sealed ? sealed : state_text);
  free(sealed);
  if (st == STATUS_OK) st = file_commit_temp_dir(tmp, out);
  if (st != STATUS_OK) file_discard_temp_dir(tmp);
  return st;
}

fsdpc_status_t ckpt_write_state(const char *tmp, int64_t step, int64_t optim_steps,
                                const char *saved_under, uint64_t model_id, uint64_t optim_id) {
  cJSON *o = cJSON_CreateObject();
  if (o == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  cJSON_AddNumberToObject(o, "step", (double)step);
  cJSON_AddNumberToObject(o, "optim_steps", (double)optim_steps);
  cJSON *under = saved_under ? cJSON_Parse(saved_under) : NULL;
  if (under) cJSON_AddItemToObject(o, "saved_under", under);
  char *text = cJSON_PrintUnformatted(o), *sealed = NULL;
  cJSON_Delete(o);
  if (text == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  fsdpc_status_t st = ckpt_state_seal(text, model_id, &optim_id, &sealed);
  free(text);
  char path[PATH_LEN];
  if (st == STATUS_OK) st = file_join(path, sizeof path, tmp, "train_state.json");
  if (st == STATUS_OK) st = file_write_text(path, sealed);
  free(sealed);
  return st;
}

fsdpc_status_t ckpt_check_save_args(int64_t step, const char *saved_under) {
  if (step < 0)
    return err_set(STATUS_EINVAL, "checkpoint: step %lld is negative (the steps taken)",
                   (long long)step);
  if (saved_under == NULL) return STATUS_OK;
  cJSON *o = cJSON_Parse(saved_under);
  bool object = cJSON_IsObject(o);
  cJSON_Delete(o);
  if (!object)
    return err_set(STATUS_EINVAL,
                   "checkpoint: saved_under is not a JSON object ({...}), which train_state.json "
                   "records: %.60s",
                   saved_under);
  return STATUS_OK;
}

fsdpc_status_t ckpt_save_training(const char *dir, nn_param_t *const *params, int n, optim_t *opt,
                                  int64_t step, const char *saved_under, pg_t *pg) {
  ARG_NONNULL(dir);
  if (n > 0) ARG_NONNULL(params);
  ARG_NONNULL(opt);
  ARG_NONNULL(pg);
  int rank = pg_rank(pg);
  FSDPC_TRY(pg_agree(pg, ckpt_check_save_args(step, saved_under)));
  ckpt_entries_t e;
  /* agreed: a rank short of memory must not leave the others in the save's collectives */
  fsdpc_status_t st = pg_agree(pg, ckpt_entries_make(params, n, opt, CKPT_ENTRIES_SAVE, &e));
  if (st != STATUS_OK) return st;
  char tmp[PATH_LEN], model[PATH_LEN], optim[PATH_LEN];
  st = dcp_prepare(dir, tmp, sizeof tmp, pg);
  bool prepared = st == STATUS_OK;
  if (st == STATUS_OK) st = file_join(model, sizeof model, tmp, "model");
  if (st == STATUS_OK) st = file_join(optim, sizeof optim, tmp, "optim");
  if (st == STATUS_OK) { /* the same paths on every rank: agreed */
    fsdpc_status_t mine = STATUS_OK;
    if (rank == 0) {
      mine = ckpt_make_dir(model);
      if (mine == STATUS_OK) mine = ckpt_make_dir(optim);
    }
    st = pg_agree(pg, mine);
  }
  uint64_t model_id = 0, optim_id = 0; /* recorded in the train state: no folder swaps */
  if (st == STATUS_OK) st = dcp_write(model, e.model, n, pg, &model_id);
  if (st == STATUS_OK) st = dcp_write(optim, e.optim, 2 * n, pg, &optim_id);
  if (st == STATUS_OK) {
    fsdpc_status_t mine = STATUS_OK;
    if (rank == 0)
      mine = ckpt_write_state(tmp, step, optim_steps(opt), saved_under, model_id, optim_id);
    st = pg_agree(pg, mine);
  }
  if (st == STATUS_OK) st = dcp_commit(tmp, dir, pg);
  /* every rank has agreed on the failure, so no rank still writes: free the space it took */
  if (st != STATUS_OK && prepared && rank == 0) file_discard_temp_dir(tmp);
  ckpt_entries_free(&e);
  return st;
}

/* train_state.json of checkpoint dir, parsed (caller deletes); its path into path. */
static fsdpc_status_t load_state(const char *dir, char *path, size_t size, cJSON **out) {
  FSDPC_TRY(file_join(path, size, dir, "train_state.json"));
  char *text;
  FSDPC_TRY(file_read_text(path, FILE_TEXT_MAX, &text));
  *out = cJSON_ParseWithOpts(text, NULL, true); /* nothing but spaces after the object */
  free(text);
  if (cJSON_IsObject(*out)) return STATUS_OK;
  cJSON_Delete(*out);
  *out = NULL;
  return err_set(STATUS_EFORMAT, "%s: not a JSON object (alone: nothing after it but spaces)",
                 path);
}

static fsdpc_status_t state_steps(const char *path, const cJSON *o, int64_t *step,
                                  int64_t *optim_steps) {
  const char *keys[2] = {"step", "optim_steps"};
  int64_t *out[2] = {step, optim_steps};
  for (int k = 0; k < 2; k++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, keys[k]);
    if (!cJSON_IsNumber(v))
      return err_set(STATUS_EFORMAT,
                     "%s: expected {\"step\": N, \"optim_steps\": N, ...}: "
                     "\"%s\" is %s",
                     path, keys[k], v ? "not a number" : "missing");
    double x = v->valuedouble; /* a count a run reaches, exactly representable */
    if (!(x >= 0 && x <= 9007199254740992.0) || x != floor(x))
      return err_set(STATUS_EFORMAT,
                     "%s: \"%s\" is %.17g: expected a whole number of steps from 0 to 2^53", path,
                     keys[k], x);
    if (out[k]) *out[k] = (int64_t)x;
  }
  return STATUS_OK;
}

/* 16 hex digits of member key of o into *out; false when absent or malformed. */
static bool hex_member(const cJSON *o, const char *key, uint64_t *out) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
  return cJSON_IsString(v) && strlen(v->valuestring) == 16 && dcp_parse_hex64(v->valuestring, out);
}

fsdpc_status_t ckpt_state_reseal(const char *text, char **out) {
  ARG_NONNULL(text);
  ARG_NONNULL(out);
  *out = NULL;
  cJSON *o = cJSON_Parse(text);
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, "integrity");
  uint64_t model_id = 0, optim_id = 0;
  bool has_optim = hex_member(it, "optim", &optim_id);
  fsdpc_status_t st = STATUS_OK;
  if (!cJSON_IsObject(o))
    st = err_set(STATUS_EINVAL, "checkpoint: a train state is not a JSON object");
  else if (it == NULL)
    st = (*out = strdup(text)) ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
  else if (!hex_member(it, "model", &model_id))
    st = err_set(STATUS_EFORMAT, "checkpoint: a train state's integrity record has no model id");
  else
    st = ckpt_state_seal(text, model_id, has_optim ? &optim_id : NULL, out);
  cJSON_Delete(o);
  return st;
}

/* The state o (read from path) against its integrity record and the folders' readers (NULL:
 * the folder does not exist). */
static fsdpc_status_t check_state(const char *path, const char *model, const char *optim,
                                  const cJSON *o, const dcp_reader_t *rm, const dcp_reader_t *ro) {
  const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, "integrity");
  uint64_t m_id = 0, o_id = 0, want = 0, want_m = 0, want_o = 0, h = 0;
  bool m_has = rm && dcp_reader_save_id(rm, &m_id), o_has = ro && dcp_reader_save_id(ro, &o_id);
  if (it == NULL) {
    if (m_has || o_has)
      return err_set(STATUS_EFORMAT,
                     "%s has no integrity record while the files of %s/ have one: it was "
                     "removed, or the file belongs to another checkpoint",
                     path, m_has ? "model" : "optim");
    return STATUS_OK; /* an earlier version's or another tool's checkpoint */
  }
  bool sealed = hex_member(it, "state", &want) && hex_member(it, "model", &want_m);
  if (sealed) FSDPC_TRY(state_hash(o, &h));
  if (!sealed || h != want)
    return err_set(STATUS_EFORMAT,
                   "%s does not match its checksum (a step, a setting or a folder's id was "
                   "changed): the checkpoint is corrupt",
                   path);
  bool wants_optim = hex_member(it, "optim", &want_o);
  if (rm == NULL || (wants_optim && ro == NULL))
    return err_set(STATUS_EFORMAT, "%s is missing, which %s records (removed?)",
                   rm == NULL ? model : optim, path);
  if (!m_has || m_id != want_m)
    return err_set(STATUS_EFORMAT,
                   "%s was not written by the save that wrote %s (a folder of another "
                   "checkpoint?)",
                   model, path);
  if (wants_optim != o_has || (wants_optim && o_id != want_o))
    return err_set(STATUS_EFORMAT,
                   "%s was not written by the save that wrote %s (a folder of another "
                   "checkpoint, or one removed?)",
                   optim, path);
  return STATUS_OK;
}

/* Opens folder dir, or leaves *r NULL when it does not exist. */
static fsdpc_status_t open_if_any(const char *dir, dcp_reader_t **r) {
  struct stat sb;
  *r = NULL;
  return stat(dir, &sb) == 0 ? dcp_reader_open(dir, r) : STATUS_OK;
}

/* A checkpoint opened: its state parsed and checked, its folders' readers (optim NULL when
 * absent). */
typedef struct opened {
  char path[PATH_LEN], model[PATH_LEN], optim[PATH_LEN];
  cJSON *state;
  dcp_reader_t *rm, *ro;
} opened_t;

static void opened_close(opened_t *c) {
  cJSON_Delete(c->state);
  dcp_reader_close(c->rm);
  dcp_reader_close(c->ro);
}

/* A step folder's name (step-NNNNNNNN, as fsdp-train writes it) against the step its state
 * records: load: auto, checkpoint.keep and the rollbacks go by the name, a load by the state,
 * so a folder renamed or copied over another step's name is refused. */
static fsdpc_status_t check_step_name(const char *dir, const char *path, const cJSON *o) {
  const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "step");
  size_t n = strlen(dir);
  while (n > 1 && dir[n - 1] == '/') n--;
  size_t b = n;
  while (b > 0 && dir[b - 1] != '/') b--;
  char base[64];
  if (!cJSON_IsNumber(s) || n - b >= sizeof base) return STATUS_OK;
  memcpy(base, dir + b, n - b);
  base[n - b] = 0;
  int64_t named;
  bool tmp;
  if (!ckpt_step_name(base, &named, &tmp) || tmp || (double)named == s->valuedouble)
    return STATUS_OK;
  return err_set(STATUS_EFORMAT,
                 "%s records step %.0f, but its folder is named for step %lld (renamed, or "
                 "copied over another step's name?): checkpoint.load: auto and checkpoint.keep "
                 "go by the name, a resume by the file; name the folder step-%08.0f",
                 path, s->valuedouble, (long long)named, s->valuedouble);
}

static fsdpc_status_t opened_open(const char *dir, opened_t *c) {
  memset(c, 0, sizeof *c);
  FSDPC_TRY(file_join(c->model, sizeof c->model, dir, "model"));
  FSDPC_TRY(file_join(c->optim, sizeof c->optim, dir, "optim"));
  fsdpc_status_t st = load_state(dir, c->path, sizeof c->path, &c->state);
  if (st == STATUS_OK) st = state_steps(c->path, c->state, NULL, NULL);
  if (st == STATUS_OK) st = open_if_any(c->model, &c->rm);
  if (st == STATUS_OK) st = open_if_any(c->optim, &c->ro);
  if (st == STATUS_OK) st = check_state(c->path, c->model, c->optim, c->state, c->rm, c->ro);
  if (st == STATUS_OK) st = check_step_name(dir, c->path, c->state);
  if (st != STATUS_OK) opened_close(c);
  return st;
}

fsdpc_status_t ckpt_check_state(const char *dir) {
  opened_t c;
  FSDPC_TRY(opened_open(dir, &c));
  opened_close(&c);
  return STATUS_OK;
}

/* A training checkpoint opened with its steps: a model folder, and an optim folder where it
 * records optimizer steps (a weights-only one, fsdp-ckpt import-hf's, has neither). */
static fsdpc_status_t opened_training(const char *dir, opened_t *c, int64_t *s, int64_t *os) {
  FSDPC_TRY(opened_open(dir, c));
  fsdpc_status_t st = state_steps(c->path, c->state, s, os);
  if (st == STATUS_OK && c->rm == NULL)
    st = err_set(STATUS_EFORMAT, "checkpoint %s: no model folder", dir);
  if (st == STATUS_OK && *os > 0 && c->ro == NULL)
    st = err_set(STATUS_EFORMAT, "checkpoint %s: no optim folder, yet %lld optimizer steps", dir,
                 (long long)*os);
  if (st != STATUS_OK) opened_close(c);
  return st;
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Every tensor of folder r (of path) a parameter's, or with suffixes one of its moments:
 * names[0..n) sorted. */
static fsdpc_status_t all_named(dcp_reader_t *r, const char *path, const char **names, int n,
                                bool moments) {
  const dcp_tensor_t *ts;
  int m;
  FSDPC_TRY(dcp_reader_list(r, &ts, &m));
  for (int i = 0; i < m; i++) {
    char base[1024];
    snprintf(base, sizeof base, "%s", ts[i].name);
    size_t l = strlen(base);
    bool moment = false;
    for (int k = 0; moments && !moment && k < 2; k++) {
      const char *tail = k ? ".exp_avg_sq" : ".exp_avg";
      size_t t = strlen(tail);
      if (l > t && strcmp(base + l - t, tail) == 0) {
        base[l - t] = '\0';
        moment = true;
      }
    }
    const char *key = base;
    if ((moments && !moment) || bsearch(&key, names, (size_t)n, sizeof *names, by_name) == NULL)
      return err_set(STATUS_EFORMAT,
                     "checkpoint %s: tensor '%s' is %s of the model (another model's, or "
                     "written beside the model's by another program): a load would leave it "
                     "unread",
                     path, ts[i].name,
                     moments ? "no parameter's AdamW moment (PARAM.exp_avg, PARAM.exp_avg_sq)"
                             : "no parameter");
  }
  return STATUS_OK;
}

/* Every tensor of the opened checkpoint c is one of the n parameters or one's moment. */
static fsdpc_status_t names_known(const opened_t *c, nn_param_t *const *params, int n) {
  const char **names = malloc(sizeof *names * (size_t)(n > 0 ? n : 1));
  if (names == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  for (int i = 0; i < n; i++) names[i] = params[i]->fqn;
  qsort(names, (size_t)n, sizeof *names, by_name);
  fsdpc_status_t st = all_named(c->rm, c->model, names, n, false);
  if (st == STATUS_OK && c->ro != NULL) st = all_named(c->ro, c->optim, names, n, true);
  free(names);
  return st;
}

fsdpc_status_t ckpt_check_params(const char *dir, nn_param_t *const *params, int n) {
  ARG_NONNULL(dir);
  if (n > 0) ARG_NONNULL(params);
  opened_t c;
  int64_t s = 0, os = 0;
  FSDPC_TRY(opened_training(dir, &c, &s, &os));
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    const dtensor_t *v = params[i]->value;
    int nd = dtensor_ndim(v);
    dtype_t dt = dtensor_local(v)->dtype;
    st = dcp_reader_check_tensor(c.rm, params[i]->fqn, nd, dtensor_shape(v), dt, NULL);
    for (int k = 0; k < 2 && st == STATUS_OK && c.ro != NULL; k++) {
      char name[1024];
      snprintf(name, sizeof name, "%s.%s", params[i]->fqn, k ? "exp_avg_sq" : "exp_avg");
      st = dcp_reader_check_tensor(c.ro, name, nd, dtensor_shape(v), dt, NULL);
    }
  }
  if (st == STATUS_OK) st = names_known(&c, params, n);
  opened_close(&c);
  return st;
}

fsdpc_status_t ckpt_check_names(const char *dir, nn_param_t *const *params, int n) {
  ARG_NONNULL(dir);
  if (n > 0) ARG_NONNULL(params);
  opened_t c;
  int64_t s = 0, os = 0;
  FSDPC_TRY(opened_training(dir, &c, &s, &os));
  fsdpc_status_t st = names_known(&c, params, n);
  opened_close(&c);
  return st;
}

fsdpc_status_t ckpt_load_training(const char *dir, nn_param_t *const *params, int n, optim_t *opt,
                                  int64_t *step, dcp_stats_t *stats) {
  ARG_NONNULL(dir);
  if (n > 0) ARG_NONNULL(params);
  ARG_NONNULL(opt);
  ARG_NONNULL(step);
  opened_t c;
  int64_t s = 0, os = 0;
  FSDPC_TRY(opened_training(dir, &c, &s, &os));
  fsdpc_status_t st = STATUS_OK;
  bool weights_only = os == 0 && c.ro == NULL; /* fsdp-ckpt import-hf */
  ckpt_entries_t e = {0};
  dcp_stats_t a = {0}, b = {0};
  for (int i = 0; i < n && st == STATUS_OK; i++) st = nn_param_written(params[i]);
  if (st == STATUS_OK)
    st = ckpt_entries_make(params, n, opt,
                           weights_only ? CKPT_ENTRIES_MODEL_ONLY : CKPT_ENTRIES_LOAD, &e);
  if (st == STATUS_OK) st = dcp_reader_load(c.rm, e.model, n, &a);
  if (st == STATUS_OK && !weights_only) st = dcp_reader_load(c.ro, e.optim, 2 * n, &b);
  ckpt_entries_free(&e);
  opened_close(&c);
  FSDPC_TRY(st);
  optim_set_steps(opt, os);
  *step = s;
  if (stats) {
    stats->bytes_read = a.bytes_read + b.bytes_read;
    stats->header_bytes = a.header_bytes + b.header_bytes;
    stats->bytes_needed = a.bytes_needed + b.bytes_needed;
    stats->files = a.files + b.files;
    stats->unchecked = a.unchecked || b.unchecked;
  }
  return STATUS_OK;
}

fsdpc_status_t ckpt_verify_training(const char *dir, pg_t *pg, int64_t *chunks) {
  char model[PATH_LEN], optim[PATH_LEN];
  FSDPC_TRY(file_join(model, sizeof model, dir, "model"));
  FSDPC_TRY(file_join(optim, sizeof optim, dir, "optim"));
  int64_t a = 0, b = 0;
  FSDPC_TRY(pg_agree(pg, ckpt_check_state(dir)));
  FSDPC_TRY(dcp_verify(model, pg, &a));
  struct stat sb;
  if (stat(optim, &sb) == 0) FSDPC_TRY(dcp_verify(optim, pg, &b)); /* absent: weights only */
  if (chunks) *chunks = a + b;
  return STATUS_OK;
}
