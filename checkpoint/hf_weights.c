#include "checkpoint/hf_weights.h"

#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/args_impl.h"
#include "core/file.h"
#include "checkpoint/safetensors.h"

/* Whether a stored tensor of shape fs holds the model's shape ms in the same row-major bytes
 * with ms's trailing dimensions merged (a model's [in, 3, out] for a file's [in, 3 out], its
 * [3, out] for [3 out]; GPT-2's c_attn): equal leading dimensions, then equal products. */
static bool merged_layout(int fn, const int64_t *fs, int mn, const int64_t *ms) {
  if (fn < 1 || mn <= fn) return false;
  for (int d = 0; d + 1 < fn; d++)
    if (fs[d] != ms[d]) return false;
  int64_t rest = 1;
  for (int d = fn - 1; d < mn; d++) rest *= ms[d];
  return rest == fs[fn - 1];
}

/* Whether a stored tensor of shape fs is the model's ms with fewer rows: equal but in the
 * first dimension, which is smaller. */
static bool fewer_rows(int fn, const int64_t *fs, int mn, const int64_t *ms) {
  if (fn < 1 || fn != mn || fs[0] >= ms[0]) return false;
  for (int d = 1; d < fn; d++)
    if (fs[d] != ms[d]) return false;
  return true;
}

/* The local shard dst at global offset off of a tensor whose first `rows` rows the file
 * holds: those it covers read, the others zero. */
static fsdpc_status_t read_rows(st_file_t *f, const char *name, int64_t rows, const int64_t *off,
                                fsdpc_tensor_t *dst) {
  int64_t n = dst->ndim ? dst->shape[0] : 0;
  int64_t have = rows - off[0] < 0 ? 0 : rows - off[0] > n ? n : rows - off[0];
  fsdpc_tensor_t part = {0};
  fsdpc_status_t st = STATUS_OK;
  if (have > 0) {
    st = tensor_narrow(&part, dst, 0, 0, have);
    if (st == STATUS_OK) st = st_read_box(f, name, off, &part);
    tensor_free(&part);
  }
  if (st == STATUS_OK && have < n) {
    st = tensor_narrow(&part, dst, 0, have, n - have);
    if (st == STATUS_OK) st = tensor_fill(&part, 0.0);
    tensor_free(&part);
  }
  return st;
}

/* The "N" of a stacked experts' name "P.experts.N" or "experts.N" (N without dots), else
 * NULL; *plen receives the length of "P.experts." (or "experts."). */
static const char *stacked_leaf(const char *fqn, size_t *plen) {
  if (fqn == NULL) return NULL;
  const char *dot = strrchr(fqn, '.');
  if (dot == NULL || dot[1] == 0) return NULL;
  size_t head = (size_t)(dot - fqn); /* "P.experts" */
  if (head < 7 || strncmp(dot - 7, "experts", 7) != 0 || (head > 7 && dot[-8] != '.')) return NULL;
  *plen = head + 1;
  return dot + 1;
}

bool hf_expert_name(const char *fqn, int64_t j, char *buf, size_t size) {
  size_t plen;
  const char *leaf = stacked_leaf(fqn, &plen);
  if (leaf == NULL || j < 0 || buf == NULL || size == 0) return false;
  int n = snprintf(buf, size, "%.*s%lld.%s.weight", (int)plen, fqn, (long long)j, leaf);
  return n > 0 && (size_t)n < size;
}

bool hf_expert_of(const char *name, char *fqn, size_t size, int64_t *j) {
  if (name == NULL || fqn == NULL || j == NULL || size == 0) return false;
  const char *e = strstr(name, "experts.");
  while (e != NULL && e != name && e[-1] != '.') e = strstr(e + 1, "experts.");
  if (e == NULL) return false;
  const char *num = e + 8, *p = num;
  while (*p >= '0' && *p <= '9') p++;
  if (p == num || p - num > 9 || *p != '.' || (p - num > 1 && *num == '0')) return false;
  const char *leaf = p + 1, *tail = strchr(leaf, '.');
  if (tail == NULL || tail == leaf || strcmp(tail, ".weight") != 0) return false;
  int n = snprintf(fqn, size, "%.*s%.*s", (int)(num - name), name, (int)(tail - leaf), leaf);
  if (n <= 0 || (size_t)n >= size) return false;
  *j = strtoll(num, NULL, 10);
  return true;
}

/* Expert j's tensor of stacked parameter p in the first of files[0..nf) that holds it
 * (*at: its index; -1 when none holds it), or an error when two do. */
static fsdpc_status_t find_expert(st_file_t *const *files, int nf, const nn_param_t *p, int64_t j,
                                  char *name, size_t size, int *at) {
  *at = -1;
  if (!hf_expert_name(p->fqn, j, name, size))
    return err_set(STATUS_EINVAL, "parameter '%s': expert %lld's name does not fit", p->fqn,
                   (long long)j);
  for (int k = 0; k < nf; k++) {
    if (st_find(files[k], name) == NULL) continue;
    if (*at >= 0)
      return err_set(STATUS_EFORMAT, "tensor '%s' is in both %s and %s", name, st_path(files[*at]),
                     st_path(files[k]));
    *at = k;
  }
  return STATUS_OK;
}

/* A parameter's tensor is stored in a floating-point dtype (integers would be read as their
 * values: weights of another kind altogether). */
static fsdpc_status_t float_stored(st_file_t *f, const st_info_t *t) {
  if (dtype_is_float(t->dtype)) return STATUS_OK;
  return err_set(STATUS_EDTYPE,
                 "%s: tensor '%s' is stored as %s; the model's parameters are "
                 "floating point",
                 st_path(f), t->name, t->dtype_name);
}

/* A stacked experts' parameter P.experts.N [E, a, b] from Hugging Face's per-expert tensors
 * P.experts.J.N.weight [a, b]: every expert's present with its shape (checked on every rank,
 * whichever experts its shard holds), then the experts of the local shard read, each the box
 * the shard covers. */
static fsdpc_status_t load_experts(st_file_t *const *files, int nf, const char *where,
                                   nn_param_t *p) {
  const int64_t *shape = dtensor_shape(p->value);
  char name[512];
  for (int64_t j = 0; j < shape[0]; j++) {
    int at;
    FSDPC_TRY(find_expert(files, nf, p, j, name, sizeof name, &at));
    if (at < 0) return err_set(STATUS_EFORMAT, "%s: missing tensor '%s'", where, name);
    const st_info_t *t = st_find(files[at], name);
    FSDPC_TRY(float_stored(files[at], t));
    if (t->ndim != 2 || t->shape[0] != shape[1] || t->shape[1] != shape[2]) {
      char a[96], b[96];
      return err_set(STATUS_ESHAPE, "%s: tensor '%s' has shape %s, the model's experts %s",
                     st_path(files[at]), name, tensor_shape_str(t->ndim, t->shape, a, sizeof a),
                     tensor_shape_str(2, shape + 1, b, sizeof b));
    }
  }
  int64_t off[TENSOR_MAX_DIMS];
  dtensor_offset(p->value, off);
  const fsdpc_tensor_t *local = dtensor_local(p->value);
  fsdpc_status_t st = STATUS_OK;
  for (int64_t j = 0; j < local->shape[0] && st == STATUS_OK; j++) {
    int at;
    st = find_expert(files, nf, p, off[0] + j, name, sizeof name, &at);
    fsdpc_tensor_t one = {0}, plane = {0};
    if (st == STATUS_OK) st = tensor_narrow(&one, local, 0, j, 1);
    if (st == STATUS_OK) st = tensor_view(&plane, &one, 2, local->shape + 1);
    if (st == STATUS_OK) st = st_read_box(files[at], name, off + 1, &plane);
    tensor_free(&plane);
    tensor_free(&one);
  }
  return st;
}

/* Whether name is a Hugging Face per-expert tensor of a stacked parameter among ps[0..n) that
 * none of the files holds stacked (so that it was read per expert). */
static bool per_expert_of(const char *name, nn_param_t *const *ps, int n, st_file_t *const *files,
                          int nf) {
  char fqn[512];
  int64_t j;
  if (!hf_expert_of(name, fqn, sizeof fqn, &j)) return false;
  for (int i = 0; i < n; i++)
    if (strcmp(ps[i]->fqn, fqn) == 0) {
      if (dtensor_ndim(ps[i]->value) != 3 || j >= dtensor_shape(ps[i]->value)[0]) return false;
      for (int k = 0; k < nf; k++)
        if (st_find(files[k], fqn) != NULL) return false;
      return true;
    }
  return false;
}

/* Parameter p from the file's tensor name. */
static fsdpc_status_t load_one(st_file_t *f, const char *name, nn_param_t *p, bool may_pad) {
  const st_info_t *t = st_find(f, name);
  if (t == NULL) return err_set(STATUS_EFORMAT, "%s: missing tensor '%s'", st_path(f), name);
  FSDPC_TRY(float_stored(f, t));
  int nd = dtensor_ndim(p->value);
  const int64_t *shape = dtensor_shape(p->value);
  bool same = t->ndim == nd;
  for (int d = 0; same && d < nd; d++) same = t->shape[d] == shape[d];
  bool merged = !same && merged_layout(t->ndim, t->shape, nd, shape);
  bool padded = !same && may_pad && fewer_rows(t->ndim, t->shape, nd, shape);
  if (!same && !merged && !padded) {
    char a[96], b[96];
    return err_set(STATUS_ESHAPE, "%s: tensor '%s' has shape %s, the model expects %s", st_path(f),
                   name, tensor_shape_str(t->ndim, t->shape, a, sizeof a),
                   tensor_shape_str(nd, shape, b, sizeof b));
  }
  int64_t off[TENSOR_MAX_DIMS];
  dtensor_offset(p->value, off);
  fsdpc_tensor_t dst;
  FSDPC_TRY(tensor_ref(&dst, dtensor_local(p->value)));
  fsdpc_status_t st = merged   ? st_read_box_as(f, name, nd, shape, off, &dst)
                      : padded ? read_rows(f, name, t->shape[0], off, &dst)
                               : st_read_box(f, name, off, &dst);
  tensor_free(&dst);
  return st;
}

/* The files' tensors under the model's names (hf_load_opts_t.canonical): for tensor i of
 * file k, names[k][i] ("": skipped, no parameter; the list ends with NULL). */
typedef struct file_names {
  int nf;
  char ***names;
} file_names_t;

static void file_names_free(file_names_t *fn) {
  for (int k = 0; fn->names && k < fn->nf; k++) {
    for (int i = 0; fn->names[k] && fn->names[k][i]; i++) free(fn->names[k][i]);
    free(fn->names[k]);
  }
  free(fn->names);
}

static fsdpc_status_t file_names_of(st_file_t *const *files, int nf, const hf_load_opts_t *o,
                                    file_names_t *fn) {
  fn->nf = nf;
  fn->names = calloc((size_t)(nf ? nf : 1), sizeof *fn->names);
  if (fn->names == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  for (int k = 0; k < nf; k++) {
    int n = st_num_tensors(files[k]);
    fn->names[k] = calloc((size_t)n + 1, sizeof *fn->names[k]);
    if (fn->names[k] == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
    for (int i = 0; i < n; i++) {
      char buf[512];
      const char *name = st_tensor(files[k], i)->name;
      /* "" for a tensor skipped (NULL ends a file's list) */
      fn->names[k][i] = strdup(o->canonical(name, buf, sizeof buf, o->user) ? buf : "");
      if (fn->names[k][i] == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
    }
  }
  return STATUS_OK;
}

/* The file name of the tensor that is parameter fqn in file k (NULL: none there). */
static const char *name_in(st_file_t *const *files, const file_names_t *fn, int k,
                           const char *fqn) {
  if (fn->names == NULL) return st_find(files[k], fqn) ? fqn : NULL;
  for (int i = 0; fn->names[k][i]; i++)
    if (fn->names[k][i][0] && strcmp(fn->names[k][i], fqn) == 0)
      return st_tensor(files[k], i)->name;
  return NULL;
}

/* Loads every parameter from the first of files[0..nf) that holds it; fails on a parameter in
 * none (naming where) or in two, and on a tensor that is not a parameter. */
static fsdpc_status_t load_from(nn_module_t *root, st_file_t *const *files, int nf,
                                const char *where, const hf_load_opts_t *o) {
  nn_param_t **ps = NULL;
  int n = 0;
  file_names_t fn = {0};
  FSDPC_TRY(nn_named_parameters(root, &ps, &n));
  fsdpc_status_t st = o->canonical ? file_names_of(files, nf, o, &fn) : STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    int at = -1;
    const char *name = NULL;
    for (int k = 0; k < nf && st == STATUS_OK; k++) {
      const char *here = name_in(files, &fn, k, ps[i]->fqn);
      if (here == NULL) continue;
      if (at >= 0)
        st = err_set(STATUS_EFORMAT, "tensor '%s' is in both %s and %s", ps[i]->fqn,
                     st_path(files[at]), st_path(files[k]));
      at = k;
      name = here;
    }
    if (st == STATUS_OK && fn.names != NULL && at >= 0) { /* under two names in one file */
      int seen = 0;
      for (int j = 0; fn.names[at][j]; j++) seen += strcmp(fn.names[at][j], ps[i]->fqn) == 0;
      if (seen > 1)
        st = err_set(STATUS_EFORMAT, "%s: parameter '%s' is there under two names",
                     st_path(files[at]), ps[i]->fqn);
    }
    size_t plen;
    bool stacked = dtensor_ndim(ps[i]->value) == 3 && stacked_leaf(ps[i]->fqn, &plen) != NULL;
    /* no memory here (another pipeline stage's): its ranks read it */
    if (st == STATUS_OK && tensor_is_meta(dtensor_local(ps[i]->value)) && (at >= 0 || stacked))
      continue;
    if (st == STATUS_OK) st = nn_param_written(ps[i]); /* a copy kept gathered goes stale */
    if (st == STATUS_OK && at < 0 && stacked) { /* Hugging Face's per-expert tensors */
      st = load_experts(files, nf, where, ps[i]);
      continue;
    }
    if (st == STATUS_OK && at < 0)
      st = err_set(STATUS_EFORMAT, "%s: missing tensor '%s'", where, ps[i]->fqn);
    if (st == STATUS_OK) st = load_one(files[at], name, ps[i], o->padded && o->padded(ps[i]->fqn));
  }
  for (int k = 0; k < nf && st == STATUS_OK; k++)
    for (int i = 0; i < st_num_tensors(files[k]) && st == STATUS_OK; i++) {
      const char *name = fn.names ? fn.names[k][i] : st_tensor(files[k], i)->name;
      bool known = name[0] == 0 || per_expert_of(name, ps, n, files, nf); /* "": skipped */
      for (int j = 0; j < n && !known; j++) known = strcmp(ps[j]->fqn, name) == 0;
      if (!known)
        st = err_set(STATUS_EFORMAT, "%s: unexpected tensor '%s' (not a parameter of the model)",
                     st_path(files[k]), st_tensor(files[k], i)->name);
    }
  file_names_free(&fn);
  free(ps);
  return st;
}

fsdpc_status_t ckpt_load_weights(nn_module_t *root, const char *path) {
  ARG_NONNULL(root);
  ARG_NONNULL(path);
  st_file_t *f = NULL;
  FSDPC_TRY(st_open(path, &f));
  hf_load_opts_t o = {0};
  fsdpc_status_t st = load_from(root, &f, 1, path, &o);
  st_close(f);
  return st;
}

fsdpc_status_t ckpt_load_hf(nn_module_t *root, const char *dir) {
  return ckpt_load_hf_padded(root, dir, NULL);
}

fsdpc_status_t ckpt_load_hf_padded(nn_module_t *root, const char *dir,
                                   bool (*padded)(const char *fqn)) {
  hf_load_opts_t o = {.padded = padded};
  return ckpt_load_hf_with(root, dir, &o);
}

fsdpc_status_t ckpt_load_hf_with(nn_module_t *root, const char *dir, const hf_load_opts_t *o) {
  ARG_NONNULL(root);
  ARG_NONNULL(dir);
  ARG_NONNULL(o);
  char **names;
  int n;
  FSDPC_TRY(hf_weight_files(dir, &names, &n));
  st_file_t **files = calloc((size_t)(n ? n : 1), sizeof *files);
  fsdpc_status_t st = files ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    char path[4400];
    st = file_join(path, sizeof path, dir, names[i]);
    if (st == STATUS_OK) st = st_open(path, &files[i]);
  }
  if (st == STATUS_OK) st = load_from(root, files, n, dir, o);
  for (int i = 0; files && i < n; i++) st_close(files[i]);
  free(files);
  hf_weight_files_free(names, n);
  return st;
}

fsdpc_status_t hf_weight_files(const char *dir, char ***out, int *n) {
  ARG_NONNULL(dir);
  ARG_NONNULL(out);
  ARG_NONNULL(n);
  enum { MAX_FILES = 4096 };
  char path[4400];
  *out = NULL;
  *n = 0;
  FSDPC_TRY(file_join(path, sizeof path, dir, "model.safetensors.index.json"));
  char single[4400]; /* with both, model.safetensors is the model, as transformers reads it */
  FSDPC_TRY(file_join(single, sizeof single, dir, "model.safetensors"));
  char **names = calloc(MAX_FILES, sizeof(char *));
  if (names == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  fsdpc_status_t st = STATUS_OK;
  if (access(path, F_OK) == 0 && access(single, F_OK) != 0) {
    char *text = NULL;
    st = file_read_text(path, FILE_TEXT_MAX, &text);
    cJSON *o = st == STATUS_OK ? cJSON_Parse(text) : NULL;
    free(text);
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(o, "weight_map"), *it;
    if (st == STATUS_OK && !cJSON_IsObject(wm))
      st = err_set(STATUS_EFORMAT, "%s: expected {\"weight_map\": {tensor: file}}", path);
    cJSON_ArrayForEach(it, wm) {
      if (st != STATUS_OK) break;
      if (!cJSON_IsString(it) || strchr(it->valuestring, '/') != NULL ||
          strcmp(it->valuestring, "..") == 0) {
        st = err_set(STATUS_EFORMAT, "%s: weight_map['%s'] is not a file name", path, it->string);
        break;
      }
      bool seen = false;
      for (int i = 0; i < *n && !seen; i++) seen = strcmp(names[i], it->valuestring) == 0;
      if (seen) continue;
      if (*n == MAX_FILES) {
        st = err_set(STATUS_EFORMAT, "%s: more than %d files", path, MAX_FILES);
        break;
      }
      if ((names[(*n)++] = strdup(it->valuestring)) == NULL)
        st = err_set(STATUS_ENOMEM, "out of host memory");
    }
    if (st == STATUS_OK && *n == 0) st = err_set(STATUS_EFORMAT, "%s: names no file", path);
    cJSON_Delete(o);
  } else if ((names[0] = strdup("model.safetensors")) == NULL) {
    st = err_set(STATUS_ENOMEM, "out of host memory");
  } else {
    *n = 1;
  }
  if (st != STATUS_OK) {
    hf_weight_files_free(names, *n);
    *n = 0;
    return st;
  }
  *out = names;
  return STATUS_OK;
}

void hf_weight_files_free(char **names, int n) {
  if (names == NULL) return;
  for (int i = 0; i < n; i++) free(names[i]);
  free(names);
}

fsdpc_status_t ckpt_save_weights(nn_module_t *root, const char *path) {
  ARG_NONNULL(root);
  ARG_NONNULL(path);
  nn_param_t **ps = NULL;
  int n = 0;
  st_writer_t *w = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, nn_named_parameters(root, &ps, &n));
  FSDPC_TRY_GOTO(st, st_writer_new(&w));
  for (int i = 0; i < n; i++) {
    const dtensor_t *v = ps[i]->value;
    const placement_t *pl = dtensor_placements(v);
    for (int d = 0; d < mesh_ndim(dtensor_mesh(v)); d++)
      if (pl[d].kind != PLACEMENT_REPLICATE)
        FSDPC_TRY_GOTO(st, err_set(STATUS_EUNSUPPORTED,
                                   "saving %s: parameter '%s' is not whole on "
                                   "this rank (sharded or partial)",
                                   path, ps[i]->fqn));
    const fsdpc_tensor_t *t = dtensor_local(v);
    char name[512];
    if (t->ndim == 3 && hf_expert_name(ps[i]->fqn, 0, name, sizeof name)) {
      for (int64_t j = 0; j < t->shape[0]; j++) { /* Hugging Face's names, one per expert */
        fsdpc_tensor_t one = {0}, plane = {0};
        if (!hf_expert_name(ps[i]->fqn, j, name, sizeof name))
          FSDPC_TRY_GOTO(st, err_set(STATUS_EINVAL,
                                     "saving %s: '%s' expert %lld's name is too "
                                     "long",
                                     path, ps[i]->fqn, (long long)j));
        st = tensor_narrow(&one, t, 0, j, 1);
        if (st == STATUS_OK) st = tensor_view(&plane, &one, 2, t->shape + 1);
        if (st == STATUS_OK) st = st_writer_add(w, name, &plane);
        tensor_free(&plane);
        tensor_free(&one);
        if (st != STATUS_OK) goto cleanup;
      }
      continue;
    }
    FSDPC_TRY_GOTO(st, st_writer_add(w, ps[i]->fqn, t));
  }
  FSDPC_TRY_GOTO(st, st_writer_set_metadata(w, "format", "pt"));
  FSDPC_TRY_GOTO(st, st_writer_save(w, path));
cleanup:
  st_writer_free(w);
  free(ps);
  return st;
}
