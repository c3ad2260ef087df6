#include "nn/autograd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/kernels.h"
#include "nn/ops.h"      /* nn_cast, for the casts at a module's boundary */
#include "nn/ops_impl.h" /* ops_alloc_like, ops_zeros_like */

typedef enum entry_kind {
  ENTRY_OP,
  ENTRY_ENTER,
  ENTRY_EXIT,
  ENTRY_CHECKPOINT,
  ENTRY_USE_ENTER, /* an operation's implicit call for its parameter (node.param) */
  ENTRY_USE_EXIT
} entry_kind_t;

typedef struct entry {
  entry_kind_t kind;
  nn_module_t *module; /* ENTER, EXIT, CHECKPOINT */
  nn_node_t node;      /* OP; for CHECKPOINT, in[0] and out are the call's input and output;
                          for USE_*, param */
} entry_t;

typedef struct tape {
  entry_t *e;
  int n, cap;
} tape_t;

struct nn_ctx {
  tape_t tape;
  bool grad_enabled;
  int suspended; /* > 0 inside the forward of a checkpointed call */
  bool recomputing;
  int casts;           /* calls in progress of modules with casts below the root (cast_call) */
  nn_module_t **calls; /* the module calls in progress, outermost first */
  int n_calls, cap_calls;
};

static bool present(const fsdpc_tensor_t *t) { return t->storage != NULL || t->ndim > 0; }

fsdpc_status_t nn_var_new(fsdpc_tensor_t *value, bool requires_grad, nn_var_t **out) {
  ARG_NONNULL(out);
  ARG_NONNULL(value);
  if (!value->meta) FSDPC_TRY(tensor_check_memory("nn_var_new", value));
  nn_var_t *v = calloc(1, sizeof *v);
  if (v == NULL) {
    tensor_free(value);
    return err_set(STATUS_ENOMEM, "autograd: out of host memory");
  }
  v->value = *value;
  memset(value, 0, sizeof *value);
  v->requires_grad = requires_grad;
  v->refs = 1;
  *out = v;
  return STATUS_OK;
}

nn_var_t *nn_var_ref(nn_var_t *v) {
  if (v) v->refs++;
  return v;
}

void nn_var_put(nn_var_t *v) {
  if (v == NULL || --v->refs > 0) return;
  tensor_free(&v->value);
  tensor_free(&v->grad);
  free(v);
}

bool nn_var_has_grad(const nn_var_t *v) {
  if (v == NULL) return false;
  return present(&v->grad);
}

fsdpc_status_t nn_ctx_new(nn_ctx_t **out) {
  ARG_NONNULL(out);
  nn_ctx_t *c = calloc(1, sizeof *c);
  if (c == NULL) return err_set(STATUS_ENOMEM, "autograd: out of host memory");
  c->grad_enabled = true;
  *out = c;
  return STATUS_OK;
}

static void node_release(nn_node_t *n) {
  for (int i = 0; i < NN_NODE_MAX_IN; i++) nn_var_put(n->in[i]);
  nn_var_put(n->out);
  for (int i = 0; i < NN_NODE_MAX_SAVED; i++) tensor_free(&n->saved[i]);
  memset(n, 0, sizeof *n);
}

static void tape_release(tape_t *t, int from) {
  for (int i = from; i < t->n; i++) node_release(&t->e[i].node);
  t->n = from < t->n ? from : t->n;
}

void nn_ctx_clear(nn_ctx_t *ctx) {
  if (ctx == NULL) return;
  tape_release(&ctx->tape, 0);
}

void nn_ctx_free(nn_ctx_t *ctx) {
  if (ctx == NULL) return;
  nn_ctx_clear(ctx);
  free(ctx->tape.e);
  free(ctx->calls);
  free(ctx);
}

void nn_ctx_set_grad_enabled(nn_ctx_t *ctx, bool enabled) {
  if (ctx == NULL) return;
  ctx->grad_enabled = enabled;
}
bool nn_ctx_recording(const nn_ctx_t *ctx) {
  if (ctx == NULL) return false;
  return ctx->grad_enabled && ctx->suspended == 0;
}
bool nn_ctx_recomputing(const nn_ctx_t *ctx) {
  if (ctx == NULL) return false;
  return ctx->recomputing;
}
int nn_ctx_tape_length(const nn_ctx_t *ctx) {
  if (ctx == NULL) return 0;
  return ctx->tape.n;
}

/* Appends an entry; takes over e's references (released on failure). */
static fsdpc_status_t push(nn_ctx_t *ctx, entry_t *e) {
  tape_t *t = &ctx->tape;
  if (t->n == t->cap) {
    int nc = t->cap ? 2 * t->cap : 64;
    entry_t *p = realloc(t->e, sizeof(entry_t) * (size_t)nc);
    if (p == NULL) {
      node_release(&e->node);
      return err_set(STATUS_ENOMEM, "autograd: out of host memory for the tape");
    }
    t->e = p;
    t->cap = nc;
  }
  t->e[t->n++] = *e;
  return STATUS_OK;
}

static fsdpc_status_t push_marker(nn_ctx_t *ctx, entry_kind_t kind, nn_module_t *m) {
  entry_t e = {.kind = kind, .module = m};
  return push(ctx, &e);
}

bool nn_needs_grad(const nn_ctx_t *ctx, nn_var_t *const *in, int n_in, const nn_param_t *p) {
  if (ctx == NULL) return false;
  if (!nn_ctx_recording(ctx)) return false;
  for (int i = 0; i < n_in; i++)
    if (in[i] && in[i]->requires_grad) return true;
  return p != NULL && p->requires_grad;
}

fsdpc_status_t nn_record(nn_ctx_t *ctx, const nn_node_t *node) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(node);
  entry_t e = {.kind = ENTRY_OP, .node = *node};
  for (int i = 0; i < NN_NODE_MAX_IN; i++) nn_var_ref(e.node.in[i]);
  nn_var_ref(e.node.out);
  if (!nn_ctx_recording(ctx)) {
    node_release(&e.node);
    return STATUS_OK;
  }
  return push(ctx, &e);
}

fsdpc_status_t nn_param_begin(nn_ctx_t *ctx, const char *op, nn_param_t *p, bool *implicit) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(op);
  *implicit = false;
  if (p != NULL && p->guard != NULL && !p->guard->ready(p)) {
    FSDPC_TRY(p->guard->enter(ctx, p, op));
    *implicit = true;
    entry_t e = {.kind = ENTRY_USE_ENTER, .node = {.param = p}};
    fsdpc_status_t st = nn_ctx_recording(ctx) ? push(ctx, &e) : STATUS_OK;
    if (st != STATUS_OK) {
      p->guard->leave(ctx, p);
      return st;
    }
  }
  if (p != NULL && tensor_is_meta(&p->compute))
    return nn_param_end(ctx, p, *implicit,
                        err_set(STATUS_EINVAL,
                                "%s: parameter %s is meta (built for deferred initialisation): "
                                "allocate it with nn_module_materialize and initialise it first",
                                op, p->fqn ? p->fqn : "(unnamed)"));
  if (p == NULL || p->compute.storage == NULL)
    return nn_param_end(ctx, p, *implicit,
                        err_set(STATUS_EINVAL, "%s: parameter %s has no value to compute with", op,
                                p && p->fqn ? p->fqn : "(unnamed)"));
  return STATUS_OK;
}

fsdpc_status_t nn_param_end(nn_ctx_t *ctx, nn_param_t *p, bool implicit, fsdpc_status_t st) {
  ARG_NONNULL(ctx);
  if (!implicit) return st;
  tape_t *t = &ctx->tape;
  fsdpc_status_t st2 = STATUS_OK;
  if (t->n > 0 && t->e[t->n - 1].kind == ENTRY_USE_ENTER && t->e[t->n - 1].node.param == p) {
    t->n--; /* nothing recorded in between: no backward to prepare for */
  } else if (nn_ctx_recording(ctx)) {
    entry_t e = {.kind = ENTRY_USE_EXIT, .node = {.param = p}};
    st2 = push(ctx, &e);
  }
  fsdpc_status_t st3 = p->guard->leave(ctx, p);
  return st != STATUS_OK ? st : st2 != STATUS_OK ? st2 : st3;
}

/* Makes v's gradient v's alone before something is added into it in place: a gradient handed
 * on by reference (an add passes its output's gradient to both inputs, a recomputed call's
 * input shares the original's) may be another variable's too, whose backward has yet to read
 * it. */
static fsdpc_status_t own_grad(nn_var_t *v) {
  if (!tensor_shared(&v->grad)) return STATUS_OK;
  fsdpc_tensor_t c;
  FSDPC_TRY(tensor_clone(&c, &v->grad, v->grad.dtype, v->grad.device));
  tensor_free(&v->grad);
  v->grad = c;
  return STATUS_OK;
}

fsdpc_status_t nn_accumulate_grad(nn_var_t *v, fsdpc_tensor_t *g) {
  ARG_NONNULL(v);
  ARG_NONNULL(g);
  if (!present(&v->grad)) {
    v->grad = *g;
    memset(g, 0, sizeof *g);
    return STATUS_OK;
  }
  fsdpc_status_t st = own_grad(v);
  if (st == STATUS_OK) st = kernel_axpy(&v->grad, 1.0f, g);
  tensor_free(g);
  return st;
}

fsdpc_status_t nn_grad_to_add_into(nn_var_t *v, fsdpc_tensor_t **into) {
  ARG_NONNULL(v);
  ARG_NONNULL(into);
  fsdpc_tensor_t *g = &v->grad, *x = &v->value;
  *into = NULL;
  if (!present(g) || g->dtype != x->dtype || !device_equal(g->device, x->device) ||
      !tensor_same_shape(g, x))
    return STATUS_OK;
  FSDPC_TRY(own_grad(v));
  *into = g;
  return STATUS_OK;
}

/* Whether g is p's slot (a reference to its memory). */
static bool in_slot(const nn_param_t *p, const fsdpc_tensor_t *g) {
  return p->grad_slot.storage != NULL && g->storage == p->grad_slot.storage &&
         g->data == p->grad_slot.data;
}

fsdpc_status_t nn_param_grad_memory(nn_param_t *p, bool zeroed, fsdpc_tensor_t *out) {
  ARG_NONNULL(p);
  ARG_NONNULL(out);
  memset(out, 0, sizeof *out);
  p->grad_slot_used = true;
  if (p->grad_slot.storage == NULL || present(&p->compute_grad))
    return zeroed ? ops_zeros_like(out, &p->compute) : ops_alloc_like(out, &p->compute);
  FSDPC_TRY(tensor_ref(out, &p->grad_slot));
  fsdpc_status_t st = zeroed ? tensor_fill(out, 0.0) : STATUS_OK;
  if (st != STATUS_OK) tensor_free(out);
  return st;
}

fsdpc_status_t nn_param_accumulate_grad(nn_param_t *p, fsdpc_tensor_t *g) {
  ARG_NONNULL(p);
  ARG_NONNULL(g);
  fsdpc_status_t st = STATUS_OK;
  if (in_slot(p, g) && !present(&p->compute_grad)) { /* formed in the slot: it is the gradient */
    p->compute_grad = p->grad_slot;
    memset(&p->grad_slot, 0, sizeof p->grad_slot);
  } else if (present(&p->compute_grad)) {
    st = kernel_axpy(&p->compute_grad, 1.0f, g);
  } else if (p->external) {
    st = tensor_ref(&p->compute_grad, g);
  } else {
    st = dtensor_from_local(g, dtensor_mesh(p->value), dtensor_placements(p->value),
                            dtensor_ndim(p->value), dtensor_shape(p->value), &p->grad);
    if (st == STATUS_OK) st = tensor_ref(&p->compute_grad, dtensor_local(p->grad));
  }
  tensor_free(g);
  return st;
}

/* ---- calls ---- */

/* m's forward (or fn instead, for nn_call_with). */
static fsdpc_status_t run_body(nn_ctx_t *ctx, nn_module_t *m, nn_forward_fn fn, nn_var_t *in,
                               nn_var_t **out) {
  return fn ? fn(ctx, m, in, out) : nn_module_run_forward(ctx, m, in, out);
}

/* enter marker, forward, exit marker, with the forward hooks around them. */
static fsdpc_status_t call_recorded(nn_ctx_t *ctx, nn_module_t *m, nn_forward_fn fn, nn_var_t *in,
                                    nn_var_t **out) {
  bool rec = nn_ctx_recording(ctx);
  FSDPC_TRY(nn_module_run_hooks(ctx, m, NN_HOOK_PRE_FORWARD));
  if (rec) FSDPC_TRY(push_marker(ctx, ENTRY_ENTER, m));
  FSDPC_TRY(run_body(ctx, m, fn, in, out));
  if (rec) FSDPC_TRY(push_marker(ctx, ENTRY_EXIT, m));
  return nn_module_run_hooks(ctx, m, NN_HOOK_POST_FORWARD);
}

static fsdpc_status_t call(nn_ctx_t *ctx, nn_module_t *m, nn_forward_fn fn, nn_var_t *in,
                           nn_var_t **out) {
  *out = NULL;
  if (fn == NULL && nn_module_forward(m) == NULL)
    return err_set(STATUS_EINVAL, "module '%s' has no forward", nn_module_fqn(m));
  if (!nn_module_checkpoint(m) || !nn_ctx_recording(ctx)) return call_recorded(ctx, m, fn, in, out);

  /* Activation checkpointing: run forward unrecorded and keep only the call's input. */
  FSDPC_TRY(nn_module_run_hooks(ctx, m, NN_HOOK_PRE_FORWARD));
  ctx->suspended++;
  fsdpc_status_t st = run_body(ctx, m, fn, in, out);
  ctx->suspended--;
  FSDPC_TRY(st);
  (*out)->requires_grad = true;
  entry_t e = {.kind = ENTRY_CHECKPOINT, .module = m};
  e.node.in[0] = nn_var_ref(in);
  e.node.out = nn_var_ref(*out);
  e.node.name = "checkpoint";
  e.node.user = (void *)fn;
  e.node.ints[0] = ctx->casts; /* the recomputation's inner units return what they did */
  FSDPC_TRY(push(ctx, &e));
  return nn_module_run_hooks(ctx, m, NN_HOOK_POST_FORWARD);
}

/* call() with the casts at m's boundary (nn_module_set_cast). Called inside another module
 * with casts that is not the root (a unit's module with parameters below the top), m returns
 * the dtype it was given: its output goes on in that module's arithmetic, whose operations
 * take one dtype (an f32 MLP unit in a bf16 block, an f32 experts unit in a bf16 layer).
 * Else its output is cast to its output dtype, if it has one; without one, a unit narrower
 * than an f32 input returns f32. */
static fsdpc_status_t cast_call(nn_ctx_t *ctx, nn_module_t *m, nn_forward_fn fn, nn_var_t *in,
                                nn_var_t **out) {
  dtype_t cin, cout;
  nn_module_cast(m, &cin, &cout);
  dtype_t given = in ? in->value.dtype : DTYPE_COUNT;
  int inner = cin != DTYPE_COUNT && nn_module_parent(m) != NULL; /* for the units inside it */
  bool cast = cin != DTYPE_COUNT && in != NULL && dtype_is_float(given);
  if (!cast)
    cout = DTYPE_COUNT;
  else if (ctx->casts > 0)
    cout = given;
  else if (cout == DTYPE_COUNT && given == DTYPE_F32 && cin != DTYPE_F32)
    cout = DTYPE_F32;
  nn_var_t *x = NULL, *y = NULL;
  *out = NULL;
  if (cast) FSDPC_TRY(nn_cast(ctx, in, cin, &x));
  ctx->casts += inner;
  fsdpc_status_t st = call(ctx, m, fn, cast ? x : in, &y);
  ctx->casts -= inner;
  nn_var_put(x);
  if (st != STATUS_OK || cout == DTYPE_COUNT || !dtype_is_float(y->value.dtype)) {
    *out = y;
    return st;
  }
  st = nn_cast(ctx, y, cout, out);
  nn_var_put(y);
  return st;
}

/* call() with m on the stack of calls in progress. */
static fsdpc_status_t tracked(nn_ctx_t *ctx, nn_module_t *m, nn_forward_fn fn, nn_var_t *in,
                              nn_var_t **out) {
  ARRAY_GROW(ctx->calls, ctx->n_calls, ctx->cap_calls, 16, "autograd");
  ctx->calls[ctx->n_calls++] = m;
  fsdpc_status_t st = cast_call(ctx, m, fn, in, out);
  ctx->n_calls--;
  return st;
}

fsdpc_status_t nn_call(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(m);
  ARG_NONNULL(in);
  ARG_NONNULL(out);
  return tracked(ctx, m, NULL, in, out);
}

fsdpc_status_t nn_call_with(nn_ctx_t *ctx, nn_module_t *m, nn_forward_fn fn, nn_var_t *in,
                            nn_var_t **out) {
  if (fn == NULL) return err_set(STATUS_EINVAL, "nn_call_with: no function");
  return tracked(ctx, m, fn, in, out);
}

void nn_ctx_call_path(const nn_ctx_t *ctx, char *buf, size_t size) {
  size_t o = 0;
  if (buf == NULL || size == 0) return;
  buf[0] = 0;
  if (ctx == NULL) return;
  for (int i = 0; i < ctx->n_calls && o + 1 < size; i++) {
    const char *f = nn_module_fqn(ctx->calls[i]);
    o += (size_t)snprintf(buf + o, size - o, "%s%s", i ? " > " : "", f[0] ? f : "(root)");
  }
  if (ctx->n_calls == 0) snprintf(buf, size, "(top level)");
}

/* ---- backward ---- */

static fsdpc_status_t walk(nn_ctx_t *ctx, tape_t *t);

/* Recomputes a checkpointed call on its own tape and differentiates it. The recomputed
 * input starts from the original input's gradient (a reference; the first addition makes it
 * its own copy, see own_grad) and hands the sum back, so accumulation happens in the same
 * order as without checkpointing and the numbers are bit-identical. */
static fsdpc_status_t backward_checkpoint(nn_ctx_t *ctx, entry_t *e) {
  nn_var_t *in = e->node.in[0], *out = e->node.out, *in2 = NULL, *out2 = NULL;
  if (!nn_var_has_grad(out)) return STATUS_OK;
  fsdpc_tensor_t v;
  FSDPC_TRY(tensor_ref(&v, &in->value));
  FSDPC_TRY(nn_var_new(&v, in->requires_grad, &in2));
  in2->layout = in->layout;
  fsdpc_status_t st = STATUS_OK;
  if (nn_var_has_grad(in)) FSDPC_TRY_GOTO(st, tensor_ref(&in2->grad, &in->grad));

  tape_t outer = ctx->tape;
  memset(&ctx->tape, 0, sizeof ctx->tape);
  ctx->recomputing = true;
  int casts = ctx->casts;
  ctx->casts = (int)e->node.ints[0];
  st = call_recorded(ctx, e->module, (nn_forward_fn)e->node.user, in2, &out2);
  ctx->casts = casts;
  ctx->recomputing = false;
  tape_t sub = ctx->tape;
  ctx->tape = outer;
  if (st == STATUS_OK) {
    out2->grad = out->grad; /* hand the incoming gradient over */
    memset(&out->grad, 0, sizeof out->grad);
    st = walk(ctx, &sub);
  }
  tape_release(&sub, 0);
  free(sub.e);
  if (st == STATUS_OK && nn_var_has_grad(in2)) { /* in place, or a copy made in2's own */
    tensor_free(&in->grad);
    in->grad = in2->grad;
    memset(&in2->grad, 0, sizeof in2->grad);
  }
cleanup:
  nn_var_put(out2);
  nn_var_put(in2);
  return st;
}

static fsdpc_status_t walk(nn_ctx_t *ctx, tape_t *t) {
  fsdpc_status_t st = STATUS_OK;
  while (t->n > 0 && st == STATUS_OK) {
    entry_t *e = &t->e[t->n - 1];
    switch (e->kind) {
      case ENTRY_OP:
        if (e->node.out && nn_var_has_grad(e->node.out)) {
          st = e->node.backward(ctx, &e->node);
          tensor_free(&e->node.out->grad); /* consumed */
        }
        break;
      case ENTRY_EXIT: st = nn_module_run_hooks(ctx, e->module, NN_HOOK_PRE_BACKWARD); break;
      case ENTRY_ENTER: st = nn_module_run_hooks(ctx, e->module, NN_HOOK_POST_BACKWARD); break;
      case ENTRY_CHECKPOINT: st = backward_checkpoint(ctx, e); break;
      case ENTRY_USE_EXIT: st = e->node.param->guard->pre_backward(ctx, e->node.param); break;
      case ENTRY_USE_ENTER: st = e->node.param->guard->post_backward(ctx, e->node.param); break;
    }
    node_release(&t->e[t->n - 1].node);
    t->n--;
  }
  return st;
}

fsdpc_status_t nn_backward_grad(nn_ctx_t *ctx, nn_var_t *out, fsdpc_tensor_t *grad) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(out);
  ARG_NONNULL(grad);
  fsdpc_status_t st = STATUS_OK;
  if (out == NULL || grad == NULL || !tensor_same_shape(&out->value, grad))
    st = err_set(STATUS_ESHAPE, "nn_backward_grad: gradient shape differs from the variable's");
  if (st == STATUS_OK) st = nn_accumulate_grad(out, grad);
  if (st == STATUS_OK) st = walk(ctx, &ctx->tape);
  if (grad) tensor_free(grad);
  nn_ctx_clear(ctx);
  return st;
}

fsdpc_status_t nn_backward(nn_ctx_t *ctx, nn_var_t *loss) {
  ARG_NONNULL(ctx);
  ARG_NONNULL(loss);
  if (loss == NULL || tensor_numel(&loss->value) != 1) {
    nn_ctx_clear(ctx);
    return err_set(STATUS_EINVAL, "nn_backward: the loss must have exactly one element");
  }
  /* recorded by this context since its last backward: a loss of another context, or whose
   * backward already ran, would take no gradient here (and leave its seed behind) */
  bool recorded = false;
  for (int i = ctx->tape.n - 1; i >= 0 && !recorded; i--)
    recorded = ctx->tape.e[i].kind == ENTRY_OP && ctx->tape.e[i].node.out == loss;
  if (!recorded) {
    nn_ctx_clear(ctx);
    return err_set(STATUS_EINVAL,
                   "nn_backward: the loss is not on this context's tape (computed in another "
                   "context, with gradients off or from no parameter, or its backward already "
                   "ran)");
  }
  fsdpc_tensor_t one;
  fsdpc_status_t st =
      tensor_init(&one, loss->value.dtype, loss->value.device, loss->value.ndim, loss->value.shape);
  if (st == STATUS_OK) st = tensor_fill(&one, 1.0);
  if (st == STATUS_OK) st = nn_accumulate_grad(loss, &one);
  if (st != STATUS_OK) {
    tensor_free(&one);
    nn_ctx_clear(ctx);
    return st;
  }
  st = walk(ctx, &ctx->tape);
  nn_ctx_clear(ctx);
  return st;
}
