#include "nn/optim.h"

#include <fnmatch.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/kernels.h"
#include "mesh/pg.h"

typedef struct slot {
  nn_param_t *p;
  double lr, weight_decay;
  fsdpc_tensor_t m, v;
  bool ready;
} slot_t;

struct optim {
  adamw_config_t cfg;
  slot_t *slots;
  int n;
  int64_t steps;
};

static const char *fqn_of(const nn_param_t *p) { return p->fqn ? p->fqn : p->name; }

bool optim_group_matches(const adamw_group_t *group, nn_param_t *const *params, int n) {
  if (group == NULL || (n > 0 && params == NULL)) return false;
  if (group->pattern == NULL) return true;
  for (int i = 0; i < n; i++)
    if (fnmatch(group->pattern, fqn_of(params[i]), 0) == 0) return true;
  return false;
}

static int cmp_ptr(const void *a, const void *b) {
  uintptr_t x = (uintptr_t) * (void *const *)a, y = (uintptr_t) * (void *const *)b;
  return (x > y) - (x < y);
}

/* Every parameter given once: one given twice (a tied weight listed under both its modules)
 * would be stepped twice. */
static fsdpc_status_t check_distinct(nn_param_t *const *params, int n) {
  for (int i = 0; i < n; i++)
    if (params[i] == NULL) return err_set(STATUS_EINVAL, "AdamW: parameter %d is NULL", i);
  nn_param_t **v = malloc(sizeof *v * (size_t)(n ? n : 1));
  if (v == NULL) return err_set(STATUS_ENOMEM, "AdamW: out of host memory");
  memcpy(v, params, sizeof *v * (size_t)n);
  qsort(v, (size_t)n, sizeof *v, cmp_ptr);
  fsdpc_status_t st = STATUS_OK;
  for (int i = 1; i < n && st == STATUS_OK; i++)
    if (v[i] == v[i - 1])
      st = err_set(STATUS_EINVAL,
                   "AdamW: parameter '%s' is given twice (a tied weight: list it once); it "
                   "would take two steps",
                   v[i]->fqn ? v[i]->fqn : "?");
  free(v);
  return st;
}

fsdpc_status_t optim_new(nn_param_t *const *params, int n, const adamw_config_t *cfg,
                         optim_t **out) {
  ARG_NONNULL(out);
  if (n > 0) ARG_NONNULL(params);
  ARG_NONNULL(cfg);
  *out = NULL;
  if (cfg == NULL || n < 0 || (n > 0 && params == NULL))
    return err_set(STATUS_EINVAL, "optim_new: bad arguments");
  if (!(cfg->lr >= 0) || !(cfg->beta1 >= 0 && cfg->beta1 < 1) ||
      !(cfg->beta2 >= 0 && cfg->beta2 < 1) || !(cfg->eps >= 0) || !(cfg->weight_decay >= 0))
    return err_set(STATUS_EINVAL,
                   "AdamW: need lr >= 0, 0 <= betas < 1, eps >= 0, "
                   "weight_decay >= 0");
  if (cfg->state_dtype != DTYPE_F32 && cfg->state_dtype != DTYPE_BF16)
    return err_set(STATUS_EINVAL, "AdamW: the state dtype must be f32 or bf16, not %s",
                   dtype_name(cfg->state_dtype));
  if (cfg->n_groups < 0 || cfg->n_groups > ADAMW_MAX_GROUPS)
    return err_set(STATUS_EINVAL, "AdamW: at most %d parameter groups", ADAMW_MAX_GROUPS);
  if (!isfinite(cfg->lr) || !isfinite(cfg->eps) || !isfinite(cfg->weight_decay))
    return err_set(STATUS_EINVAL, "AdamW: lr, eps and weight_decay must be finite");
  for (int g = 0; g < cfg->n_groups; g++) /* negative: the top-level value; NaN or inf: none */
    if (!isfinite(cfg->groups[g].lr) || !isfinite(cfg->groups[g].weight_decay))
      return err_set(STATUS_EINVAL,
                     "AdamW: parameter group %d ('%s'): lr %g, weight_decay %g: each a finite "
                     "value, or negative for the top-level one",
                     g, cfg->groups[g].pattern ? cfg->groups[g].pattern : "(null)",
                     cfg->groups[g].lr, cfg->groups[g].weight_decay);
  FSDPC_TRY(check_distinct(params, n));
  optim_t *o = calloc(1, sizeof *o);
  if (o == NULL || (o->slots = calloc((size_t)(n ? n : 1), sizeof(slot_t))) == NULL) {
    free(o);
    return err_set(STATUS_ENOMEM, "AdamW: out of host memory");
  }
  o->cfg = *cfg;
  o->n = n;
  for (int i = 0; i < n; i++) {
    slot_t *s = &o->slots[i];
    s->p = params[i];
    s->lr = cfg->lr;
    s->weight_decay = cfg->weight_decay;
    for (int g = 0; g < cfg->n_groups; g++) {
      if (cfg->groups[g].pattern == NULL || fnmatch(cfg->groups[g].pattern, fqn_of(params[i]), 0))
        continue;
      if (cfg->groups[g].lr >= 0) s->lr = cfg->groups[g].lr;
      if (cfg->groups[g].weight_decay >= 0) s->weight_decay = cfg->groups[g].weight_decay;
      break;
    }
  }
  /* as for fully_shard units: a group that matches nothing is a mistake, not a no-op */
  for (int g = 0; g < cfg->n_groups; g++) {
    if (optim_group_matches(&cfg->groups[g], params, n)) continue;
    free(o->slots);
    free(o);
    return err_set(STATUS_EINVAL,
                   "optim.param_groups: '%s' matches no parameter (parameters here: %s, ...)",
                   cfg->groups[g].pattern, n > 0 ? fqn_of(params[0]) : "none");
  }
  for (int g = 0; g < cfg->n_groups; g++) o->cfg.groups[g].pattern = NULL; /* not kept */
  *out = o;
  return STATUS_OK;
}

void optim_free(optim_t *o) {
  if (o == NULL) return;
  for (int i = 0; i < o->n; i++) {
    tensor_free(&o->slots[i].m);
    tensor_free(&o->slots[i].v);
  }
  free(o->slots);
  free(o);
}

void optim_param_hparams(const optim_t *o, int i, double *lr, double *weight_decay) {
  if (o == NULL || lr == NULL || weight_decay == NULL) return;
  if (i < 0 || i >= o->n) { /* no such parameter: NaN, which no setting is */
    *lr = *weight_decay = NAN;
    return;
  }
  *lr = o->slots[i].lr;
  *weight_decay = o->slots[i].weight_decay;
}

int64_t optim_steps(const optim_t *o) {
  if (o == NULL) return 0;
  return o->steps;
}
void optim_set_steps(optim_t *o, int64_t steps) {
  if (o == NULL) return;
  o->steps = steps;
}

/* The moments of a slot, created on first use: zero, or uninitialised when a load is about to
 * overwrite them. */
static fsdpc_status_t slot_ready(slot_t *s, dtype_t dt, bool zero) {
  if (s->ready) return STATUS_OK;
  const fsdpc_tensor_t *local = dtensor_local(s->p->value);
  fsdpc_status_t (*make)(fsdpc_tensor_t *, dtype_t, device_t, int, const int64_t *) =
      zero ? tensor_zeros : tensor_init;
  FSDPC_TRY(make(&s->m, dt, local->device, local->ndim, local->shape));
  fsdpc_status_t st = make(&s->v, dt, local->device, local->ndim, local->shape);
  if (st != STATUS_OK) {
    tensor_free(&s->m);
    return st;
  }
  s->ready = true;
  return STATUS_OK;
}

static fsdpc_status_t state_of(optim_t *o, int i, bool zero, dtensor_t **exp_avg,
                               dtensor_t **exp_avg_sq) {
  *exp_avg = *exp_avg_sq = NULL;
  if (i < 0 || i >= o->n) return err_set(STATUS_EINVAL, "optim_state: no parameter %d", i);
  slot_t *s = &o->slots[i];
  FSDPC_TRY(slot_ready(s, o->cfg.state_dtype, zero));
  const dtensor_t *v = s->p->value;
  FSDPC_TRY(dtensor_from_local(&s->m, dtensor_mesh(v), dtensor_placements(v), dtensor_ndim(v),
                               dtensor_shape(v), exp_avg));
  fsdpc_status_t st = dtensor_from_local(&s->v, dtensor_mesh(v), dtensor_placements(v),
                                         dtensor_ndim(v), dtensor_shape(v), exp_avg_sq);
  if (st != STATUS_OK) {
    dtensor_free(*exp_avg);
    *exp_avg = NULL;
  }
  return st;
}

nn_param_t *optim_param(const optim_t *o, int i) {
  return o != NULL && i >= 0 && i < o->n ? o->slots[i].p : NULL;
}

fsdpc_status_t optim_state(optim_t *o, int i, dtensor_t **exp_avg, dtensor_t **exp_avg_sq) {
  ARG_NONNULL(o);
  ARG_NONNULL(exp_avg);
  ARG_NONNULL(exp_avg_sq);
  return state_of(o, i, true, exp_avg, exp_avg_sq);
}

fsdpc_status_t optim_state_for_load(optim_t *o, int i, dtensor_t **exp_avg,
                                    dtensor_t **exp_avg_sq) {
  ARG_NONNULL(o);
  ARG_NONNULL(exp_avg);
  ARG_NONNULL(exp_avg_sq);
  return state_of(o, i, false, exp_avg, exp_avg_sq);
}

fsdpc_status_t optim_step(optim_t *o, double lr_factor) {
  ARG_NONNULL(o);
  return optim_step_scaled(o, lr_factor, 1);
}

fsdpc_status_t optim_step_scaled(optim_t *o, double lr_factor, float grad_scale) {
  ARG_NONNULL(o);
  if (!(lr_factor >= 0) || !isfinite(lr_factor)) /* a NaN would reach every weight */
    return err_set(STATUS_EINVAL, "AdamW step: learning-rate factor %g is not a number >= 0",
                   lr_factor);
  if (!(grad_scale > 0) || !isfinite(grad_scale))
    return err_set(STATUS_EINVAL, "AdamW step: gradient scale %g is not a positive number",
                   (double)grad_scale);
  o->steps++;
  /* the updates of every parameter, in runs on one device (one call each: a few launches on a
   * GPU); a narrower gradient is scaled in its own dtype first, as clip_grad_norm would */
  adamw_item_t *items = malloc(sizeof *items * (size_t)(o->n > 0 ? o->n : 1));
  int *slot_of = malloc(sizeof *slot_of * (size_t)(o->n > 0 ? o->n : 1));
  fsdpc_tensor_t *refs = calloc((size_t)(o->n > 0 ? 2 * o->n : 1), sizeof *refs);
  fsdpc_status_t st = items && slot_of && refs
                          ? STATUS_OK
                          : err_set(STATUS_ENOMEM, "AdamW step: out of host memory");
  int m = 0;
  for (int i = 0; i < o->n && st == STATUS_OK; i++) {
    slot_t *s = &o->slots[i];
    if (s->p->grad == NULL || !s->p->requires_grad) continue;
    fsdpc_tensor_t *p = &refs[2 * m], *g = &refs[2 * m + 1];
    st = nn_param_written(s->p); /* a copy kept gathered from the shard goes stale */
    if (st == STATUS_OK) st = slot_ready(s, o->cfg.state_dtype, true);
    if (st == STATUS_OK) st = tensor_ref(p, dtensor_local(s->p->value));
    if (st == STATUS_OK) st = tensor_ref(g, dtensor_local(s->p->grad));
    adamw_args_t a = {.lr = s->lr * lr_factor,
                      .beta1 = o->cfg.beta1,
                      .beta2 = o->cfg.beta2,
                      .eps = o->cfg.eps,
                      .weight_decay = s->weight_decay,
                      .step = o->steps,
                      .grad_scale = grad_scale};
    if (st == STATUS_OK && grad_scale != 1 && g->dtype != DTYPE_F32) {
      st = kernel_scale(g, grad_scale);
      a.grad_scale = 1;
    }
    if (st != STATUS_OK) {
      st = err_prefix(st, "AdamW step of %s", s->p->fqn);
      m++; /* its references are freed below */
      break;
    }
    items[m] = (adamw_item_t){p, g, &s->m, &s->v, a};
    slot_of[m++] = i;
  }
  for (int a = 0, b; a < m && st == STATUS_OK; a = b) {
    for (b = a + 1; b < m && device_equal(items[b].p->device, items[a].p->device); b++) {
    }
    int failed = -1;
    st = kernel_adamw_many(items + a, b - a, &failed);
    if (st != STATUS_OK)
      st = err_prefix(st, "AdamW step of %s",
                      failed >= 0 ? o->slots[slot_of[a + failed]].p->fqn : "the parameters");
  }
  for (int i = 0; i < 2 * m && refs; i++) tensor_free(&refs[i]);
  free(items);
  free(slot_of);
  free(refs);
  return st;
}

void optim_zero_grad(optim_t *o) {
  if (o == NULL) return;
  for (int i = 0; i < o->n; i++) nn_param_zero_grad(o->slots[i].p);
}

/* True when this rank holds the copy of its shard that counts (coordinate 0 of every mesh
 * dimension the gradient is replicated or partial over). */
static bool counts_here(const dtensor_t *g) {
  const mesh_t *mesh = dtensor_mesh(g);
  const placement_t *pl = dtensor_placements(g);
  for (int i = 0; i < mesh_ndim(mesh); i++)
    if (pl[i].kind == PLACEMENT_REPLICATE && mesh_coord(mesh, i) != 0) return false;
  return true;
}

/* Whether t is split over ranks: sharded or partial on a mesh dimension of more than one. */
static bool split_over_ranks(const dtensor_t *t) {
  const mesh_t *mesh = dtensor_mesh(t);
  const placement_t *pl = dtensor_placements(t);
  for (int i = 0; i < mesh_ndim(mesh); i++)
    if (pl[i].kind != PLACEMENT_REPLICATE && mesh_size(mesh, i) > 1) return true;
  return false;
}

fsdpc_status_t clip_grad_coef(nn_param_t *const *params, int n, double max_norm, pg_t *group,
                              double *norm, float *coef) {
  ARG_NONNULL(coef);
  if (n < 0 || (n > 0 && params == NULL))
    return err_set(STATUS_EINVAL, "clip_grad_norm: %d parameters given without their list", n);
  for (int i = 0; i < n; i++)
    if (params[i] == NULL) return err_set(STATUS_EINVAL, "clip_grad_norm: parameter %d is NULL", i);
  for (int i = 0; group == NULL && i < n; i++) /* this rank's norm alone would be another's */
    if (params[i]->grad != NULL && split_over_ranks(params[i]->grad))
      return err_set(STATUS_EINVAL,
                     "clip_grad_norm: '%s' is split over ranks (sharded): the norm needs the "
                     "group its shards span (the data-parallel group, or the world), not NULL",
                     params[i]->fqn);
  /* a group narrower than a gradient's mesh leaves out some of its shards: that group's ranks
   * would clip by another norm than the rest (said over the group with the sum, below) */
  const char *narrow = NULL;
  int64_t narrow_numel = 0;
  for (int i = 0; group != NULL && narrow == NULL && i < n; i++) {
    const dtensor_t *g = params[i]->grad;
    if (g != NULL && pg_size(group) < mesh_numel(dtensor_mesh(g))) {
      narrow = params[i]->fqn;
      narrow_numel = mesh_numel(dtensor_mesh(g));
    }
  }
  double total = 0;
  const fsdpc_tensor_t **gs = malloc(sizeof *gs * (size_t)(n > 0 ? n : 1));
  double *ss = malloc(sizeof *ss * (size_t)(n > 0 ? n : 1));
  int m = 0;
  /* NULL: every gradient is whole here (a split one was refused), counted on every rank */
  for (int i = 0; gs != NULL && i < n; i++)
    if (params[i]->grad != NULL && (group == NULL || counts_here(params[i]->grad)))
      gs[m++] = dtensor_local(params[i]->grad);
  fsdpc_status_t st =
      gs && ss ? STATUS_OK : err_set(STATUS_ENOMEM, "clip_grad_norm: out of host memory");
  /* runs of gradients on one device at a time (one read back each on a GPU) */
  for (int a = 0, b; a < m && st == STATUS_OK; a = b) {
    for (b = a + 1; b < m && device_equal(gs[b]->device, gs[a]->device); b++) {
    }
    st = kernel_sum_squares_many(gs + a, b - a, ss + a);
  }
  for (int i = 0; i < m && st == STATUS_OK; i++) total += ss[i]; /* in parameter order */
  free(gs);
  free(ss);
  if (group == NULL) {
    FSDPC_TRY(st);
  } else {
    /* three doubles over the group's host channel (exact, and not a data collective): the
     * sum, and whether a rank found the group narrow or failed (every rank then fails) */
    double sum[3] = {total, narrow != NULL, st != STATUS_OK};
    FSDPC_TRY(pg_host_all_reduce(group, sum, sum, 3, PG_HOST_F64, REDUCE_SUM));
    total = sum[0];
    if (st != STATUS_OK) return st;
    if (sum[2] > 0)
      return err_set(STATUS_EINVAL,
                     "clip_grad_norm: another rank of the group failed to sum its gradients "
                     "(its message names why)");
    if (narrow != NULL)
      return err_set(STATUS_EINVAL,
                     "clip_grad_norm: the group has %d ranks, but '%s' lies on a mesh of %lld: "
                     "the norm needs a group holding every rank of the gradients' meshes "
                     "(the world, or the data-parallel group of all their dimensions)",
                     pg_size(group), narrow, (long long)narrow_numel);
    if (sum[1] > 0)
      return err_set(STATUS_EINVAL,
                     "clip_grad_norm: the group is narrower than the mesh of a gradient on "
                     "another of its ranks (its message names it)");
  }
  double nrm = sqrt(total);
  if (norm) *norm = nrm;
  if (!(max_norm > 0)) return err_set(STATUS_EINVAL, "clip_grad_norm: max_norm must be positive");
  float c = (float)(max_norm / (nrm + 1e-6));
  *coef = c < 1.0f || isnan(c) ? c : 1.0f; /* a NaN norm gives a NaN factor, as torch's */
  return STATUS_OK;
}

fsdpc_status_t clip_grad_norm(nn_param_t *const *params, int n, double max_norm, pg_t *group,
                              double *norm) {
  float coef;
  FSDPC_TRY(clip_grad_coef(params, n, max_norm, group, norm, &coef));
  if (coef >= 1.0f) return STATUS_OK;
  for (int i = 0; i < n; i++) {
    if (params[i]->grad == NULL) continue;
    fsdpc_tensor_t g;
    FSDPC_TRY(tensor_ref(&g, dtensor_local(params[i]->grad)));
    fsdpc_status_t st = kernel_scale(&g, coef);
    tensor_free(&g);
    FSDPC_TRY(st);
  }
  return STATUS_OK;
}

double lr_schedule_factor(const lr_schedule_t *s, int64_t step) {
  if (s == NULL) return 0;
  if (s->warmup_steps > 0 && step < s->warmup_steps)
    return (double)(step + 1) / (double)s->warmup_steps;
  int64_t span = s->total_steps - s->warmup_steps;
  if (span < 1) span = 1;
  double progress = (double)(step - s->warmup_steps) / (double)span;
  return s->min_ratio + (1.0 - s->min_ratio) * 0.5 * (1.0 + cos(M_PI * progress));
}
