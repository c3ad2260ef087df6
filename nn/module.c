#include "nn/module.h"

#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/kernels.h"
#include "nn/autograd.h"

typedef struct hook {
  nn_hook_fn fn;
  void *user;
} hook_t;

struct nn_module {
  char *name;
  char *fqn;
  nn_module_t *parent;
  nn_forward_fn forward;
  void *impl;
  void (*impl_free)(void *); /* owned impl, or NULL */
  nn_module_t **children;
  int n_children, cap_children;
  nn_param_t **params; /* owned and shared */
  bool *owns;          /* owns[i]: params[i] was added here (read without touching params[i]) */
  int n_params, cap_params;
  hook_t *hooks[NN_HOOK_COUNT];
  int n_hooks[NN_HOOK_COUNT];
  bool checkpoint;
  dtype_t cast_in, cast_out; /* DTYPE_COUNT: none (see nn_module_set_cast) */
  void *ext;
  nn_ext_free_fn free_ext;
  nn_wrap_fn wrap;
  void *wrap_user;
  const char *kind;
};

static fsdpc_status_t check_name(const char *what, const char *name) {
  if (name == NULL) return err_set(STATUS_EINVAL, "%s name is NULL", what);
  if (strchr(name, '.') != NULL)
    return err_set(STATUS_EINVAL, "%s name '%s' contains a dot", what, name);
  return STATUS_OK;
}

fsdpc_status_t nn_module_new_owned(const char *name, nn_forward_fn forward, void *impl,
                                   void (*impl_free)(void *), nn_module_t **out) {
  ARG_NONNULL(out);
  ARG_NONNULL(name);
  fsdpc_status_t st = nn_module_new(name, forward, impl, out);
  if (st != STATUS_OK) {
    if (impl_free) impl_free(impl);
    return st;
  }
  (*out)->impl_free = impl_free;
  return STATUS_OK;
}

fsdpc_status_t nn_module_new(const char *name, nn_forward_fn forward, void *impl,
                             nn_module_t **out) {
  ARG_NONNULL(out);
  ARG_NONNULL(name);
  *out = NULL;
  FSDPC_TRY(check_name("module", name));
  nn_module_t *m = calloc(1, sizeof *m);
  if (m == NULL || (m->name = strdup(name)) == NULL) {
    free(m);
    return err_set(STATUS_ENOMEM, "module: out of host memory");
  }
  m->forward = forward;
  m->impl = impl;
  m->cast_in = m->cast_out = DTYPE_COUNT;
  *out = m;
  return STATUS_OK;
}

static void param_free(nn_param_t *p) {
  tensor_free(&p->compute);
  tensor_free(&p->compute_grad);
  tensor_free(&p->grad_slot);
  dtensor_free(p->grad);
  dtensor_free(p->value);
  free(p->name);
  free(p->fqn);
  free(p);
}

void nn_module_free(nn_module_t *m) {
  if (m == NULL) return;
  if (m->ext != NULL && m->free_ext != NULL) m->free_ext(m, m->ext); /* may clear other slots */
  for (int i = 0; i < m->n_children; i++) nn_module_free(m->children[i]);
  for (int i = 0; i < m->n_params; i++)
    if (m->owns[i]) param_free(m->params[i]);
  for (int k = 0; k < NN_HOOK_COUNT; k++) free(m->hooks[k]);
  if (m->impl_free) m->impl_free(m->impl);
  free(m->children);
  free(m->params);
  free(m->owns);
  free(m->name);
  free(m->fqn);
  free(m);
}

fsdpc_status_t nn_module_add_child(nn_module_t *parent, nn_module_t *child) {
  if (parent == NULL || child == NULL) return err_set(STATUS_EINVAL, "module: NULL argument");
  if (child->parent != NULL)
    return err_set(STATUS_EINVAL, "module '%s' already has a parent", child->name);
  if (child->name[0] == '\0') return err_set(STATUS_EINVAL, "a child module needs a name");
  if (nn_module_child_named(parent, child->name) != NULL)
    return err_set(STATUS_EINVAL, "module '%s' already has a child '%s'", parent->name,
                   child->name);
  for (const nn_module_t *up = parent; up != NULL; up = up->parent) /* a tree, not a cycle */
    if (up == child)
      return err_set(STATUS_EINVAL,
                     "module '%s' cannot be a child of '%s', which is %s: a module tree has "
                     "no cycles",
                     child->name, parent->name, parent == child ? "itself" : "under it");
  ARRAY_GROW(parent->children, parent->n_children, parent->cap_children, 4, "module");
  parent->children[parent->n_children++] = child;
  child->parent = parent;
  return STATUS_OK;
}

static fsdpc_status_t attach_param(nn_module_t *m, nn_param_t *p) {
  if (nn_module_param_named(m, p->name) != NULL)
    return err_set(STATUS_EINVAL, "module '%s' already has a parameter '%s'", m->name, p->name);
  if (m->n_params == m->cap_params) {
    int nc = m->cap_params ? 2 * m->cap_params : 4;
    nn_param_t **ps = realloc(m->params, sizeof(nn_param_t *) * (size_t)nc);
    if (ps != NULL) m->params = ps;
    bool *os = ps ? realloc(m->owns, sizeof(bool) * (size_t)nc) : NULL;
    if (os == NULL) return err_set(STATUS_ENOMEM, "module: out of host memory");
    m->owns = os;
    m->cap_params = nc;
  }
  m->owns[m->n_params] = p->owner == m;
  m->params[m->n_params++] = p;
  return STATUS_OK;
}

fsdpc_status_t nn_module_add_param(nn_module_t *m, const char *name, dtensor_t *value,
                                   bool requires_grad, nn_param_t **out) {
  fsdpc_status_t st = STATUS_OK;
  nn_param_t *p = NULL;
  if (out) *out = NULL;
  if (m == NULL || value == NULL)
    FSDPC_TRY_GOTO(st, err_set(STATUS_EINVAL, "module: NULL argument"));
  FSDPC_TRY_GOTO(st, check_name("parameter", name));
  if ((p = calloc(1, sizeof *p)) == NULL || (p->name = strdup(name)) == NULL)
    FSDPC_TRY_GOTO(st, err_set(STATUS_ENOMEM, "module: out of host memory"));
  p->owner = m;
  p->value = value;
  value = NULL;
  p->requires_grad = requires_grad;
  FSDPC_TRY_GOTO(st, tensor_ref(&p->compute, dtensor_local(p->value)));
  FSDPC_TRY_GOTO(st, attach_param(m, p));
  if (out) *out = p;
  return STATUS_OK;
cleanup:
  if (p) param_free(p);
  dtensor_free(value);
  return st;
}

fsdpc_status_t nn_param_set_value(nn_param_t *p, dtensor_t *value) {
  ARG_NONNULL(p);
  ARG_NONNULL(value);
  if (p->external) {
    dtensor_free(value);
    return err_set(STATUS_EINVAL,
                   "nn_param_set_value: parameter %s is managed by fully_shard (write a new "
                   "value into it with nn_param_copy_full)",
                   p->fqn);
  }
  fsdpc_tensor_t c;
  fsdpc_status_t st = tensor_ref(&c, dtensor_local(value));
  if (st != STATUS_OK) {
    dtensor_free(value);
    return st;
  }
  nn_param_zero_grad(p);
  tensor_free(&p->compute);
  dtensor_free(p->value);
  p->value = value;
  p->compute = c;
  return STATUS_OK;
}

static const nn_module_t *root_of(const nn_module_t *m);

fsdpc_status_t nn_module_share_param(nn_module_t *m, nn_param_t *p) {
  if (m == NULL || p == NULL) return err_set(STATUS_EINVAL, "module: NULL argument");
  if (m->fqn != NULL && p->fqn != NULL && root_of(m) != root_of(p->owner))
    return err_set(STATUS_EINVAL,
                   "nn_module_share_param: '%s' is a parameter of another model than module "
                   "'%s''s: a module shares a parameter of its own tree",
                   p->fqn, m->name);
  return attach_param(m, p);
}

static char *join(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  char *s = malloc(la + lb + 2);
  if (s == NULL) return NULL;
  if (la == 0) {
    memcpy(s, b, lb + 1);
  } else {
    memcpy(s, a, la);
    s[la] = '.';
    memcpy(s + la + 1, b, lb + 1);
  }
  return s;
}

static fsdpc_status_t finalize(nn_module_t *m, const char *prefix) {
  free(m->fqn);
  m->fqn = m->parent == NULL ? strdup("") : join(prefix, m->name);
  if (m->fqn == NULL) return err_set(STATUS_ENOMEM, "module: out of host memory");
  for (int i = 0; i < m->n_params; i++) {
    nn_param_t *p = m->params[i];
    if (p->owner != m) continue;
    free(p->fqn);
    if ((p->fqn = join(m->fqn, p->name)) == NULL)
      return err_set(STATUS_ENOMEM, "module: out of host memory");
  }
  for (int i = 0; i < m->n_children; i++) FSDPC_TRY(finalize(m->children[i], m->fqn));
  return STATUS_OK;
}

static const nn_module_t *root_of(const nn_module_t *m) {
  while (m->parent != NULL) m = m->parent;
  return m;
}

/* Every parameter a module of root's tree shares is owned in that tree (another model's would
 * outlive it, or be freed under it). */
static fsdpc_status_t shared_within(const nn_module_t *m, const nn_module_t *root) {
  for (int i = 0; i < m->n_params; i++)
    if (m->params[i]->owner != m && root_of(m->params[i]->owner) != root)
      return err_set(STATUS_EINVAL,
                     "module '%s' shares parameter '%s' of a module outside its tree (another "
                     "model's): nn_module_share_param takes a parameter of the same tree",
                     m->name, m->params[i]->name);
  for (int i = 0; i < m->n_children; i++) FSDPC_TRY(shared_within(m->children[i], root));
  return STATUS_OK;
}

fsdpc_status_t nn_module_finalize(nn_module_t *root) {
  if (root == NULL) return err_set(STATUS_EINVAL, "module: NULL argument");
  FSDPC_TRY(shared_within(root, root_of(root)));
  return finalize(root, "");
}

bool nn_module_finalized(const nn_module_t *m) {
  if (m == NULL || m->fqn == NULL) return false;
  for (int i = 0; i < m->n_params; i++)
    if (m->owns[i] && m->params[i]->fqn == NULL) return false;
  for (int i = 0; i < m->n_children; i++)
    if (!nn_module_finalized(m->children[i])) return false;
  return true;
}

fsdpc_status_t nn_module_add_hook(nn_module_t *m, nn_hook_kind_t kind, nn_hook_fn fn, void *user) {
  if (m == NULL || fn == NULL || kind < 0 || kind >= NN_HOOK_COUNT)
    return err_set(STATUS_EINVAL, "nn_module_add_hook: bad argument");
  hook_t *h = realloc(m->hooks[kind], sizeof(hook_t) * (size_t)(m->n_hooks[kind] + 1));
  if (h == NULL) return err_set(STATUS_ENOMEM, "module: out of host memory");
  h[m->n_hooks[kind]++] = (hook_t){fn, user};
  m->hooks[kind] = h;
  return STATUS_OK;
}

int nn_module_num_hooks(const nn_module_t *m, nn_hook_kind_t kind) {
  return m != NULL && kind >= 0 && kind < NN_HOOK_COUNT ? m->n_hooks[kind] : 0;
}

void nn_module_remove_hooks(nn_module_t *m, const void *user) {
  for (int k = 0; m != NULL && k < NN_HOOK_COUNT; k++) {
    int kept = 0;
    for (int i = 0; i < m->n_hooks[k]; i++)
      if (m->hooks[k][i].user != user) m->hooks[k][kept++] = m->hooks[k][i];
    m->n_hooks[k] = kept;
  }
}

static bool hook_registered(const nn_module_t *m, nn_hook_kind_t kind, hook_t h) {
  for (int i = 0; i < m->n_hooks[kind]; i++)
    if (m->hooks[kind][i].fn == h.fn && m->hooks[kind][i].user == h.user) return true;
  return false;
}

fsdpc_status_t nn_module_run_hooks(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(m);
  int n = m->n_hooks[kind];
  if (n == 0) return STATUS_OK;
  if (n == 1) return m->hooks[kind][0].fn(ctx, m, kind, m->hooks[kind][0].user);
  /* the hooks registered when the call began, each run if still registered at its turn: a
   * hook may remove itself or others (nn_module_remove_hooks) without one being skipped; one
   * added meanwhile runs from the next call */
  hook_t local[16], *h = n <= 16 ? local : malloc(sizeof *h * (size_t)n);
  if (h == NULL) return err_set(STATUS_ENOMEM, "module '%s': out of host memory", nn_module_fqn(m));
  memcpy(h, m->hooks[kind], sizeof *h * (size_t)n);
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++)
    if (i == 0 || hook_registered(m, kind, h[i])) st = h[i].fn(ctx, m, kind, h[i].user);
  if (h != local) free(h);
  return st;
}

fsdpc_status_t nn_module_wrap_forward(nn_module_t *m, nn_wrap_fn fn, void *user) {
  ARG_NONNULL(m);
  ARG_NONNULL(fn);
  if (m->wrap != NULL)
    return err_set(STATUS_EINVAL, "module '%s' already has a forward wrapper", nn_module_fqn(m));
  m->wrap = fn;
  m->wrap_user = user;
  return STATUS_OK;
}

void nn_module_unwrap_forward(nn_module_t *m, const void *user) {
  if (m == NULL || m->wrap == NULL || m->wrap_user != user) return;
  m->wrap = NULL;
  m->wrap_user = NULL;
}

fsdpc_status_t nn_module_run_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(m);
  ARG_NONNULL(in);
  ARG_NONNULL(out);
  fsdpc_status_t st =
      m->wrap ? m->wrap(ctx, m, in, out, m->forward, m->wrap_user) : m->forward(ctx, m, in, out);
  /* a leaf's dtype error named by the leaf: an input whose dtype is not its parameters' (a
   * unit before it returned its compute dtype or its output_dtype, and no unit casts for this
   * module) */
  bool leaf = st == STATUS_EDTYPE && m->n_children == 0 && nn_module_num_params(m) > 0;
  if (leaf && !dtype_is_float(in->value.dtype)) /* no policy makes ids or labels a float */
    st = err_prefix(
        st, "%s: its input has dtype %s (a module with parameters takes a floating-point input)",
        nn_module_fqn(m), dtype_name(in->value.dtype));
  else if (leaf)
    st = err_prefix(st,
                    "%s: its input is not of its parameters' dtype (a unit's mp_policy "
                    "output_dtype, or the compute dtype a unit before it returns, which no unit "
                    "casts for %s: make it a unit of its own with parameters, which casts its "
                    "input, or give the unit before it an output_dtype of this dtype)",
                    nn_module_fqn(m), nn_module_fqn(m));
  return st;
}

void nn_module_set_checkpoint(nn_module_t *m, bool enabled) {
  if (m == NULL) return;
  m->checkpoint = enabled;
}
void nn_module_set_cast(nn_module_t *m, dtype_t in, dtype_t out) {
  if (m == NULL) return;
  m->cast_in = in;
  m->cast_out = out;
}
void nn_module_cast(const nn_module_t *m, dtype_t *in, dtype_t *out) {
  if (m == NULL || in == NULL || out == NULL) return;
  *in = m->cast_in;
  *out = m->cast_out;
}
void nn_module_set_kind(nn_module_t *m, const char *kind) {
  if (m == NULL) return;
  m->kind = kind;
}
const char *nn_module_kind(const nn_module_t *m) {
  if (m == NULL) return NULL;
  return m->kind;
}
void nn_module_set_ext(nn_module_t *m, void *ext, nn_ext_free_fn free_ext) {
  if (m == NULL) return;
  m->ext = ext;
  m->free_ext = ext != NULL ? free_ext : NULL;
}
void *nn_module_ext(const nn_module_t *m) {
  if (m == NULL) return NULL;
  return m->ext;
}
bool nn_module_checkpoint(const nn_module_t *m) {
  if (m == NULL) return false;
  return m->checkpoint;
}
const char *nn_module_name(const nn_module_t *m) {
  if (m == NULL) return "(null)";
  return m->name;
}
const char *nn_module_fqn(const nn_module_t *m) {
  if (m == NULL) return "(null)";
  return m->fqn ? m->fqn : m->name;
}
nn_module_t *nn_module_parent(const nn_module_t *m) {
  if (m == NULL) return NULL;
  return m->parent;
}
void *nn_module_impl(const nn_module_t *m) {
  if (m == NULL) return NULL;
  return m->impl;
}
nn_forward_fn nn_module_forward(const nn_module_t *m) {
  if (m == NULL) return NULL;
  return m->forward;
}
int nn_module_num_children(const nn_module_t *m) {
  if (m == NULL) return 0;
  return m->n_children;
}
nn_module_t *nn_module_child(const nn_module_t *m, int i) {
  if (m == NULL || i < 0 || i >= m->n_children) return NULL;
  return m->children[i];
}
int nn_module_num_params(const nn_module_t *m) {
  if (m == NULL) return 0;
  return m->n_params;
}
nn_param_t *nn_module_param(const nn_module_t *m, int i) {
  if (m == NULL || i < 0 || i >= m->n_params) return NULL;
  return m->params[i];
}

nn_module_t *nn_module_child_named(const nn_module_t *m, const char *name) {
  if (m == NULL || name == NULL) return NULL;
  for (int i = 0; i < m->n_children; i++)
    if (strcmp(m->children[i]->name, name) == 0) return m->children[i];
  return NULL;
}

nn_param_t *nn_module_param_named(const nn_module_t *m, const char *name) {
  if (m == NULL || name == NULL) return NULL;
  for (int i = 0; i < m->n_params; i++)
    if (strcmp(m->params[i]->name, name) == 0) return m->params[i];
  return NULL;
}

static void names_into(const nn_module_t *m, char *buf, size_t size, int *left) {
  for (int i = 0; i < m->n_children && *left > 0; i++) {
    const nn_module_t *c = m->children[i];
    size_t l = strlen(buf);
    snprintf(buf + l, size - l, "%s%s", l ? ", " : "", nn_module_fqn(c));
    (*left)--;
    names_into(c, buf, size, left);
  }
}

const char *nn_module_names(const nn_module_t *root, int max, char *buf, size_t size) {
  if (buf == NULL || size == 0) return "";
  buf[0] = 0;
  if (root != NULL) names_into(root, buf, size, &max);
  return buf;
}

nn_module_t *nn_module_find(nn_module_t *root, const char *fqn) {
  nn_module_t *m = root;
  const char *s = fqn;
  while (m != NULL && *s != '\0') {
    const char *dot = strchr(s, '.');
    size_t len = dot ? (size_t)(dot - s) : strlen(s);
    nn_module_t *next = NULL;
    for (int i = 0; i < m->n_children && next == NULL; i++)
      if (strlen(m->children[i]->name) == len && strncmp(m->children[i]->name, s, len) == 0)
        next = m->children[i];
    m = next;
    s += len + (dot ? 1 : 0);
  }
  return m;
}

nn_param_t *nn_param_find(nn_module_t *root, const char *fqn) {
  if (root == NULL || fqn == NULL) return NULL;
  const char *dot = strrchr(fqn, '.');
  if (dot == NULL) {
    nn_param_t *p = nn_module_param_named(root, fqn);
    return p && p->owner == root ? p : NULL;
  }
  size_t len = (size_t)(dot - fqn);
  char *path = malloc(len + 1);
  if (path == NULL) return NULL;
  memcpy(path, fqn, len);
  path[len] = '\0';
  nn_module_t *m = nn_module_find(root, path);
  free(path);
  if (m == NULL) return NULL;
  nn_param_t *p = nn_module_param_named(m, dot + 1);
  return p && p->owner == m ? p : NULL;
}

static fsdpc_status_t collect(const nn_module_t *m, nn_param_t ***arr, int *n, int *cap) {
  for (int i = 0; i < m->n_params; i++) {
    if (m->params[i]->owner != m) continue;
    ARRAY_GROW(*arr, *n, *cap, 4, "module");
    (*arr)[(*n)++] = m->params[i];
  }
  for (int i = 0; i < m->n_children; i++) FSDPC_TRY(collect(m->children[i], arr, n, cap));
  return STATUS_OK;
}

fsdpc_status_t nn_named_parameters(const nn_module_t *m, nn_param_t ***out, int *n) {
  ARG_NONNULL(m);
  ARG_NONNULL(out);
  ARG_NONNULL(n);
  nn_param_t **arr = NULL;
  int cnt = 0, cap = 0;
  fsdpc_status_t st = collect(m, &arr, &cnt, &cap);
  if (st != STATUS_OK) {
    free(arr);
    return st;
  }
  *out = arr;
  *n = cnt;
  return STATUS_OK;
}

fsdpc_status_t nn_param_new_local_grad_in(nn_param_t *p, const fsdpc_tensor_t *mem,
                                          fsdpc_tensor_t *local) {
  ARG_NONNULL(p);
  ARG_NONNULL(mem);
  ARG_NONNULL(local);
  memset(local, 0, sizeof *local);
  if (p->grad != NULL)
    return err_set(STATUS_EINVAL, "nn_param_new_local_grad: %s has a gradient already", p->fqn);
  const fsdpc_tensor_t *v = dtensor_local(p->value);
  if (mem->dtype != v->dtype || !device_equal(mem->device, v->device) ||
      tensor_numel(mem) != tensor_numel(v) || !tensor_is_contiguous(mem))
    return err_set(STATUS_EINVAL,
                   "nn_param_new_local_grad_in: the memory for %s's gradient is not %lld "
                   "contiguous elements of its dtype on its device",
                   p->fqn, (long long)tensor_numel(v));
  fsdpc_tensor_t t;
  FSDPC_TRY(tensor_view(&t, mem, v->ndim, v->shape));
  fsdpc_status_t st = dtensor_from_local_like(&t, p->value, &p->grad);
  if (st == STATUS_OK) st = tensor_ref(local, dtensor_local(p->grad));
  tensor_free(&t);
  return st;
}

fsdpc_status_t nn_param_new_local_grad(nn_param_t *p, fsdpc_tensor_t *local) {
  ARG_NONNULL(p);
  ARG_NONNULL(local);
  memset(local, 0, sizeof *local);
  if (p->grad != NULL)
    return err_set(STATUS_EINVAL, "nn_param_new_local_grad: %s has a gradient already", p->fqn);
  const fsdpc_tensor_t *v = dtensor_local(p->value);
  fsdpc_tensor_t t;
  FSDPC_TRY(tensor_init(&t, v->dtype, v->device, v->ndim, v->shape));
  fsdpc_status_t st = nn_param_new_local_grad_in(p, &t, local);
  tensor_free(&t);
  return st;
}

fsdpc_status_t nn_param_accumulate_local_grad(nn_param_t *p, const fsdpc_tensor_t *g) {
  ARG_NONNULL(p);
  ARG_NONNULL(g);
  const fsdpc_tensor_t *local = dtensor_local(p->value);
  fsdpc_tensor_t src;
  FSDPC_TRY(tensor_view(&src, g, local->ndim, local->shape));
  fsdpc_status_t st;
  if (p->grad == NULL) { /* the first: a copy in the parameter's dtype, not zeros plus g */
    fsdpc_tensor_t first;
    st = nn_param_new_local_grad(p, &first);
    if (st == STATUS_OK) st = tensor_copy(&first, &src);
    tensor_free(&first);
  } else {
    fsdpc_tensor_t dst;
    st = tensor_ref(&dst, dtensor_local(p->grad));
    if (st == STATUS_OK) st = kernel_axpy(&dst, 1.0f, &src);
    tensor_free(&dst);
  }
  tensor_free(&src);
  return st;
}

fsdpc_status_t nn_param_written(nn_param_t *p) {
  ARG_NONNULL(p);
  FSDPC_TRY(p->guard != NULL && p->guard->written != NULL ? p->guard->written(p) : STATUS_OK);
  p->version++;
  return STATUS_OK;
}

fsdpc_status_t nn_param_copy_full(nn_param_t *p, const fsdpc_tensor_t *full) {
  ARG_NONNULL(p);
  ARG_NONNULL(full);
  const dtensor_t *v = p->value;
  int nd = dtensor_ndim(v);
  if (full == NULL || full->ndim != nd ||
      memcmp(full->shape, dtensor_shape(v), sizeof(int64_t) * (size_t)nd) != 0) {
    char a[96], b[96];
    return err_set(STATUS_ESHAPE, "nn_param_copy_full: parameter %s is %s, the value %s", p->fqn,
                   tensor_shape_str(nd, dtensor_shape(v), a, sizeof a),
                   full ? tensor_shape_str(full->ndim, full->shape, b, sizeof b) : "missing");
  }
  if (!dtype_is_float(full->dtype))
    return err_set(STATUS_EDTYPE, "nn_param_copy_full: parameter %s takes a float value, not %s",
                   p->fqn, dtype_name(full->dtype));
  FSDPC_TRY(nn_param_written(p));
  int64_t off[TENSOR_MAX_DIMS];
  dtensor_offset(v, off);
  fsdpc_tensor_t src, dst;
  FSDPC_TRY(tensor_narrow_box(&src, full, off, dtensor_local(v)->shape));
  fsdpc_status_t st = tensor_ref(&dst, dtensor_local(v));
  if (st == STATUS_OK) st = tensor_copy(&dst, &src);
  tensor_free(&dst);
  tensor_free(&src);
  return st;
}

bool nn_param_is_meta(const nn_param_t *p) {
  if (p == NULL) return false;
  return tensor_is_meta(dtensor_local(p->value));
}

/* A meta parameter that no guard manages: a plain tensor of its local shape, same placements. */
static fsdpc_status_t materialize_plain(nn_param_t *p) {
  const dtensor_t *v = p->value;
  const fsdpc_tensor_t *l = dtensor_local(v);
  fsdpc_tensor_t t;
  FSDPC_TRY(tensor_init(&t, l->dtype, l->device, l->ndim, l->shape));
  dtensor_t *dt = NULL;
  fsdpc_status_t st = dtensor_from_local(&t, dtensor_mesh(v), dtensor_placements(v),
                                         dtensor_ndim(v), dtensor_shape(v), &dt);
  tensor_free(&t);
  FSDPC_TRY(st);
  return nn_param_set_value(p, dt);
}

fsdpc_status_t nn_module_materialize(nn_module_t *root) {
  if (root == NULL) return err_set(STATUS_EINVAL, "nn_module_materialize: NULL module");
  nn_param_t **ps;
  int n;
  FSDPC_TRY(nn_named_parameters(root, &ps, &n));
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    nn_param_t *p = ps[i];
    if (!nn_param_is_meta(p)) continue;
    if (p->guard != NULL && p->guard->materialize != NULL)
      st = p->guard->materialize(p);
    else if (p->external)
      st = err_set(STATUS_EINVAL, "nn_module_materialize: parameter %s is managed by hooks that "
                   "cannot allocate it", p->fqn);
    else
      st = materialize_plain(p);
  }
  free(ps);
  return st;
}

void nn_param_zero_grad(nn_param_t *p) {
  if (p == NULL) return;
  tensor_free(&p->compute_grad);
  tensor_free(&p->grad_slot);
  dtensor_free(p->grad);
  p->grad = NULL;
}

bool nn_fqn_match(const char *pattern, const char *fqn) {
  if (pattern == NULL || fqn == NULL) return false;
  char pb[256], nb[1024];
  if (strlen(pattern) >= sizeof pb || strlen(fqn) >= sizeof nb) return false;
  strcpy(pb, pattern);
  strcpy(nb, fqn);
  for (char *c = pb; *c; c++)
    if (*c == '.') *c = '/';
  for (char *c = nb; *c; c++)
    if (*c == '.') *c = '/';
  return fnmatch(pb, nb, FNM_PATHNAME) == 0;
}
