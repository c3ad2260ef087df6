/* fully_shard: modules called outside their unit's forward, and operations on sharded
 * parameters outside any call (nn_param_begin): the group is unsharded on demand, every rank
 * of the group agreeing first, and the call is reduced in backward as a unit's would be. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "fully_shard/fsdp_impl.h"
#include "mesh/world.h"

static fsdpc_status_t member_hook(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind, void *user);

/* The modules under m that no inner group claims (m itself excluded), appended to g->members
 * unless counting only. */
static int collect_members(fsdp_group_t *g, nn_module_t *m, bool count_only) {
  int n = 0;
  for (int i = 0; i < nn_module_num_children(m); i++) {
    nn_module_t *c = nn_module_child(m, i);
    if (fsdp_group_of(c) != NULL) continue; /* an inner unit: its own group */
    if (!count_only) g->members[g->n_members++] = (fsdp_member_t){.g = g, .m = c};
    n += 1 + collect_members(g, c, count_only);
  }
  return n;
}

/* Whether module m uses one of the group's parameters, itself or under it (its own, or one
 * it shares: a tied head): a member that uses none needs nothing gathered when called on its
 * own (an activation, a dropout). */
static bool holds_params(const fsdp_group_t *g, const nn_module_t *m) {
  for (int k = 0; k < nn_module_num_params(m); k++)
    for (int i = 0; i < g->n; i++)
      if (nn_module_param(m, k) == g->params[i].p) return true;
  for (int c = 0; c < nn_module_num_children(m); c++)
    if (holds_params(g, nn_module_child(m, c))) return true;
  return false;
}

fsdpc_status_t fsdp_install_members(fsdp_group_t *g) {
  size_t n = (size_t)g->n_modules;
  for (int i = 0; i < g->n_modules; i++) n += (size_t)collect_members(g, g->modules[i], true);
  if ((g->members = calloc(n, sizeof *g->members)) == NULL)
    return err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
  for (int i = 0; i < g->n_modules; i++)
    g->members[g->n_members++] = (fsdp_member_t){.g = g, .m = g->modules[i]};
  for (int i = 0; i < g->n_modules; i++) collect_members(g, g->modules[i], false);
  for (int i = g->n_modules; i < g->n_members; i++)
    for (int k = 0; k < NN_HOOK_COUNT && holds_params(g, g->members[i].m); k++)
      FSDPC_TRY(nn_module_add_hook(g->members[i].m, k, member_hook, &g->members[i]));
  return STATUS_OK;
}

/* The member for module m, or NULL. */
static fsdp_member_t *find_member(fsdp_group_t *g, const nn_module_t *m) {
  for (int i = 0; i < g->n_members; i++)
    if (g->members[i].m == m) return &g->members[i];
  return NULL;
}

/* The member for module m (the group's first module when m is not one of its members). */
static fsdp_member_t *member_of(fsdp_group_t *g, const nn_module_t *m) {
  fsdp_member_t *mb = find_member(g, m);
  return mb ? mb : &g->members[0];
}

/* The group agreeing on on-demand unshards over pg: pg's side channel (its timed exchanges,
 * which a rank may give up on, never mix with pg's traffic), kept until the group is freed. */
fsdpc_status_t fsdp_agree_group(pg_t *pg, pg_t **out) {
  *out = NULL;
  if (pg == NULL || pg_size(pg) == 1) return STATUS_OK;
  FSDPC_TRY(pg_side_channel(pg, out));
  pg_retain(*out);
  return STATUS_OK;
}

void fsdp_agree_group_release(pg_t **agree) {
  pg_release(*agree);
  *agree = NULL;
}

static fsdpc_status_t push_call(fsdp_member_t *mb, bool on_demand) {
  ARRAY_GROW(mb->on_demand, mb->depth, mb->cap, 4, "fully_shard");
  mb->on_demand[mb->depth++] = on_demand;
  return STATUS_OK;
}

static const char *unit_name(const fsdp_group_t *g) {
  const char *u = nn_module_fqn(g->module);
  return u[0] ? u : "(root)";
}

/* What ran on demand: the member's module (its call), or an operation on one of its
 * parameters. */
static void describe(const fsdp_member_t *mb, const char *op, const nn_param_t *p, char *buf,
                     size_t size) {
  const char *name = nn_module_fqn(mb->m);
  if (p == NULL)
    snprintf(buf, size, "%s", name[0] ? name : "(root)");
  else
    snprintf(buf, size, "%s on parameter %s of module %s", op, p->fqn, name[0] ? name : "(root)");
}

/* The first on-demand use of a member's module, once per module and rank: what ran, its unit
 * and the call path. */
static void warn_on_demand(nn_ctx_t *ctx, fsdp_member_t *mb, const char *what, bool call) {
  if ((call && mb->registered) || mb->warned) return;
  mb->warned = true;
  char path[1024];
  nn_ctx_call_path(ctx, path, sizeof path);
  fprintf(stderr,
          "fsdpc: warning: [rank %d] fully_shard: %s ran outside the forward of its unit '%s' "
          "(call path: %s); the unit's parameters were all-gathered on demand, without "
          "prefetch. Call the unit instead, or %s.\n",
          world_rank(), what, unit_name(mb->g), path,
          call ? "make the module an entry point with fsdp_register_forward_method"
               : "run the code using the parameter as a call of its module with nn_call_with");
}

/* A 63-bit FNV-1a hash of a module's name. */
static int64_t name_hash(const char *s) {
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return (int64_t)(h >> 1);
}

/* An agreement's buffer whose collective never completed (the job was stopped: one at most),
 * kept reachable because MPI may still own it (volatile: a store the compiler cannot drop). */
static int64_t *volatile orphan;

/* Every rank of the group takes the on-demand path of a member together (what: its
 * description): an all-reduce of the module's name over the shard and the replicate ranks. A
 * rank whose partners do not join in time stops the job, naming it. */
static fsdpc_status_t agree_on_demand(const fsdp_member_t *mb, const char *what) {
  FSDPC_TRY(world_check());
  fsdp_group_t *g = mb->g;
  int64_t h = name_hash(nn_module_fqn(mb->m));
  for (int k = 0; k < 2; k++) {
    if (g->agree[k] == NULL) continue;
    int64_t *buf = malloc(4 * sizeof *buf);
    if (buf == NULL) return err_set(STATUS_ENOMEM, "fully_shard: out of host memory");
    buf[0] = h;
    buf[1] = -h;
    bool late = false;
    fsdpc_status_t st = pg_host_all_reduce_within(g->agree[k], buf, buf + 2, 2, PG_HOST_I64,
                                                  REDUCE_MAX, g->opt.on_demand_timeout, &late);
    if (st == STATUS_OK && late) {
      orphan = buf;
      return world_stop(err_set(
          STATUS_ETIMEOUT,
          "fully_shard: %s ran outside the forward of its unit '%s' on rank %d, and the other "
          "ranks of the unit's %s group did not take that on-demand unshard within %g s; it is "
          "collective: make the same call on every rank, or call the unit",
          what, unit_name(g), world_rank(), k ? "replicate" : "shard", g->opt.on_demand_timeout));
    }
    if (st != STATUS_OK) { /* failed to start (buf is free), or the job was stopped meanwhile */
      if (world_check() == STATUS_OK)
        free(buf);
      else
        orphan = buf;
      return st;
    }
    bool same = buf[2] == h && buf[3] == -h;
    free(buf);
    if (!same)
      return err_set(STATUS_EINVAL,
                     "fully_shard: the ranks of unit '%s' took different on-demand unshards "
                     "(%s on rank %d, another module on another rank); every rank must make "
                     "the same calls",
                     unit_name(g), what, world_rank());
  }
  return STATUS_OK;
}

/* A member's call is on demand when none of its group's own modules is in its forward: the
 * call then unshards the group, reshards after forward by the group's policy, and in backward
 * unshards again and reduces its gradients, as a call of the unit would. */
static fsdpc_status_t member_hook(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind, void *user) {
  (void)m;
  fsdp_member_t *mb = user;
  fsdp_group_t *g = mb->g;
  FSDPC_TRY(fsdp_lazy_init(g));
  bool recomputing = nn_ctx_recomputing(ctx), rec = nn_ctx_recording(ctx) && !recomputing;
  switch (kind) {
    case NN_HOOK_PRE_FORWARD: {
      bool od = g->in_forward == 0; /* nested calls inside an on-demand call count as inside */
      if (!od) {
        if (rec) FSDPC_TRY(push_call(mb, false));
        return STATUS_OK;
      }
      /* the recomputation of an activation-checkpointed call in backward (whether or not the
       * call was on demand): the group's operations inside it are provided for, as in forward */
      if (!recomputing) {
        if (rec) FSDPC_TRY(push_call(mb, true));
        char what[512];
        describe(mb, NULL, NULL, what, sizeof what);
        FSDPC_TRY(agree_on_demand(mb, what));
        warn_on_demand(ctx, mb, what, true);
      }
      mb->active = true;
      g->in_forward++;
      return fsdp_unshard(g);
    }
    case NN_HOOK_POST_FORWARD:
      if (!mb->active) return STATUS_OK;
      mb->active = false;
      g->in_forward--;
      /* a recomputation's backward comes next: keep the parameters */
      return recomputing ? STATUS_OK : fsdp_after_forward(g);
    case NN_HOOK_PRE_BACKWARD:
      if (mb->depth > 0 && mb->on_demand[mb->depth - 1]) return fsdp_unshard(g);
      return STATUS_OK;
    case NN_HOOK_POST_BACKWARD: {
      if (mb->depth == 0 || !mb->on_demand[--mb->depth]) return STATUS_OK;
      return fsdp_after_backward(g);
    }
    default: return STATUS_OK;
  }
}

/* Operations on a sharded parameter while no call of its group runs: the operation is an
 * on-demand call of the module owning the parameter (nn_param_begin). */
static fsdp_group_t *group_of_param(const nn_param_t *p) {
  return ((const fsdp_param_t *)p->guard_state)->g;
}

static bool guard_ready(const nn_param_t *p) { return group_of_param(p)->in_forward > 0; }

static fsdpc_status_t guard_enter(nn_ctx_t *ctx, nn_param_t *p, const char *op) {
  fsdp_group_t *g = group_of_param(p);
  FSDPC_TRY(fsdp_lazy_init(g));
  if (!nn_ctx_recomputing(ctx)) {
    fsdp_member_t *mb = member_of(g, p->owner);
    char what[512];
    describe(mb, op, p, what, sizeof what);
    FSDPC_TRY(agree_on_demand(mb, what));
    warn_on_demand(ctx, mb, what, false);
  }
  return fsdp_unshard(g);
}

static fsdpc_status_t guard_leave(nn_ctx_t *ctx, nn_param_t *p) {
  (void)ctx;
  return fsdp_after_forward(group_of_param(p));
}

static fsdpc_status_t guard_pre_backward(nn_ctx_t *ctx, nn_param_t *p) {
  (void)ctx;
  return fsdp_unshard(group_of_param(p));
}

static fsdpc_status_t guard_post_backward(nn_ctx_t *ctx, nn_param_t *p) {
  (void)ctx;
  return fsdp_after_backward(group_of_param(p));
}

/* A shard written between steps: the parameters kept unsharded after backward
 * (reshard_after_backward false) were gathered before it; the next forward gathers anew. From
 * the unit's forward to its backward the step reads the gathered values: refused. */
static fsdpc_status_t guard_written(nn_param_t *p) {
  fsdp_group_t *g = group_of_param(p);
  bool gathered = g->unsharded || g->gathering || g->post_forward_slice.storage != NULL;
  if (g->in_forward > 0 || (gathered && !g->kept))
    return err_set(STATUS_EINVAL,
                   "parameter %s is gathered by fully_shard for a step in progress (from its "
                   "unit's forward to its backward); write it between steps",
                   p->fqn);
  if (gathered) fsdp_reshard(g);
  return STATUS_OK;
}

const nn_param_guard_t fsdp_on_demand_guard = {
    .ready = guard_ready,
    .enter = guard_enter,
    .leave = guard_leave,
    .pre_backward = guard_pre_backward,
    .post_backward = guard_post_backward,
    .materialize = fsdp_materialize_param,
    .written = guard_written,
};

fsdpc_status_t fsdp_register_forward_method(nn_module_t *m) {
  ARG_NONNULL(m);
  if (fsdp_group_of(m) != NULL) return STATUS_OK; /* a unit's own calls are regular */
  for (nn_module_t *a = nn_module_parent(m); a != NULL; a = nn_module_parent(a)) {
    fsdp_group_t *g = fsdp_group_of(a);
    fsdp_member_t *mb = g ? find_member(g, m) : NULL;
    if (mb != NULL) {
      mb->registered = true;
      return STATUS_OK;
    }
  }
  return err_set(STATUS_EINVAL,
                 "fsdp_register_forward_method: '%s' is not inside a fully-sharded unit",
                 nn_module_fqn(m));
}
