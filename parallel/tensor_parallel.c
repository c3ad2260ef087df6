#include "parallel/tensor_parallel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/kernels.h"
#include "nn/moe.h"
#include "nn/ops.h"

/* ---- the state of one wrapped module ---- */

typedef struct tp_mod {
  nn_module_t *m;
  tp_style_t style;
  tp_layout_t in, out; /* resolved: never TP_LAYOUT_DEFAULT */
  bool embedding;
  bool conv1d;   /* weight [in, out] */
  bool moe;      /* a MoE block under prepare_input: it runs on this rank's tokens */
  bool sum_only; /* a module under such a block (sequence parallelism): its parameters on tp
                    have gradients from this rank's tokens, summed over tp */
  mesh_t *mesh;
  nn_param_t *w, *b;    /* the weight, and the bias (or NULL) */
  int64_t first, vocab; /* rowwise embedding: the shard's rows of the vocabulary */
  nn_param_t *sum[4];   /* parameters whose gradient each rank computes from its sequence
                           shard, summed over tp after each call: a sequence-parallel norm's
                           weight and bias, the bias of a rowwise linear under sequence
                           parallelism, the parameters of a module under a MoE block */
  int n_sum;
  fsdpc_tensor_t stash[4]; /* their gradients from earlier calls */
  dtype_t reduce_dtype;    /* gradient reductions' dtype; DTYPE_COUNT: the gradient's own */
} tp_mod_t;

struct tp_plan {
  tp_mod_t *mods;
  int n;
  mesh_t *mesh; /* retained: its forwards move activations on it until tp_free */
};

/* ---- conversions: differentiable redistributions of activations ---- */

/* A conversion moves the activation between placements on the 1-D tp mesh; its backward
 * moves the gradient between the conjugate placements. */
typedef enum conv {
  CONV_COPY,           /* R -> R: nothing; backward P -> R */
  CONV_GATHER_SEQ,     /* S(1) -> R; backward P -> S(1) */
  CONV_SCATTER_SEQ,    /* R -> S(1); backward S(1) -> R */
  CONV_GATHER_LAST,    /* S(-1) -> R; backward R -> S(-1) */
  CONV_REDUCE,         /* P -> R; backward R -> R */
  CONV_REDUCE_SCATTER, /* P -> S(1); backward S(1) -> R */
  CONV_SCATTER_LAST    /* R -> S(-1): each rank's chunk; backward S(-1) -> R */
} conv_t;

typedef enum pk { PK_R, PK_P, PK_SEQ, PK_LAST } pk_t;

static const pk_t conv_fwd[][2] = {{PK_R, PK_R}, {PK_SEQ, PK_R}, {PK_R, PK_SEQ}, {PK_LAST, PK_R},
                                   {PK_P, PK_R}, {PK_P, PK_SEQ}, {PK_R, PK_LAST}};
static const pk_t conv_bwd[][2] = {{PK_P, PK_R}, {PK_P, PK_SEQ}, {PK_SEQ, PK_R}, {PK_R, PK_LAST},
                                   {PK_R, PK_R}, {PK_SEQ, PK_R}, {PK_LAST, PK_R}};
static const char *const conv_names[] = {"copy",   "gather(1)",         "scatter(1)", "gather(-1)",
                                         "reduce", "reduce_scatter(1)", "scatter(-1)"};

static placement_t placement_of(pk_t k, int ndim) {
  switch (k) {
    case PK_P: return placement_partial(REDUCE_SUM);
    case PK_SEQ: return placement_shard(1);
    case PK_LAST: return placement_shard(ndim - 1);
    default: return placement_replicate();
  }
}

/* The global shape of a local tensor x held with placement k on W ranks. */
static void global_of(const fsdpc_tensor_t *x, pk_t k, int W, int64_t *shape) {
  memcpy(shape, x->shape, sizeof(int64_t) * (size_t)x->ndim);
  if (k == PK_SEQ) shape[1] *= W;
  if (k == PK_LAST) shape[x->ndim - 1] *= W;
}

/* y = x moved from placement a to b on mesh (x local, y a new tensor). */
static fsdpc_status_t move(mesh_t *mesh, const fsdpc_tensor_t *x, pk_t a, pk_t b,
                           fsdpc_tensor_t *y) {
  if (a == b || (a == PK_P && b == PK_R && mesh_size(mesh, 0) == 1)) return tensor_ref(y, x);
  int64_t shape[TENSOR_MAX_DIMS];
  global_of(x, a, mesh_size(mesh, 0), shape);
  placement_t pa = placement_of(a, x->ndim), pb = placement_of(b, x->ndim);
  dtensor_t *src = NULL, *dst = NULL;
  FSDPC_TRY(dtensor_from_local(x, mesh, &pa, x->ndim, shape, &src));
  fsdpc_status_t st = dtensor_redistribute(src, &pb, &dst);
  if (st == STATUS_OK) st = tensor_ref(y, dtensor_local(dst));
  dtensor_free(dst);
  dtensor_free(src);
  return st;
}

/* y = x moved from a to b as move() does, a reduction (from Partial over more than one rank)
 * running in dt: x cast to dt, moved, the result cast back to x's dtype. */
static fsdpc_status_t move_in(mesh_t *mesh, const fsdpc_tensor_t *x, pk_t a, pk_t b, dtype_t dt,
                              fsdpc_tensor_t *y) {
  if (a != PK_P || mesh_size(mesh, 0) == 1 || dt == DTYPE_COUNT || dt == x->dtype)
    return move(mesh, x, a, b, y);
  fsdpc_tensor_t wide, moved;
  FSDPC_TRY(tensor_clone(&wide, x, dt, x->device));
  fsdpc_status_t st = move(mesh, &wide, a, b, &moved);
  tensor_free(&wide);
  if (st != STATUS_OK) return st;
  st = tensor_clone(y, &moved, x->dtype, x->device);
  tensor_free(&moved);
  return st;
}

static fsdpc_status_t convert_backward(nn_ctx_t *ctx, nn_node_t *n) {
  (void)ctx;
  nn_var_t *x = n->in[0];
  if (!x->requires_grad) return STATUS_OK;
  conv_t c = (conv_t)n->ints[0];
  fsdpc_tensor_t g;
  FSDPC_TRY(
      move_in(n->user, &n->out->grad, conv_bwd[c][0], conv_bwd[c][1], (dtype_t)n->ints[1], &g));
  return nn_accumulate_grad(x, &g);
}

/* Divisibility of the dimension a conversion splits. */
static fsdpc_status_t check_split(const tp_mod_t *t, const fsdpc_tensor_t *x, conv_t c) {
  int W = mesh_size(t->mesh, 0), d = -1;
  if (c == CONV_SCATTER_SEQ || c == CONV_REDUCE_SCATTER) d = 1;
  if (c == CONV_SCATTER_LAST && (x->ndim < 1 || x->shape[x->ndim - 1] % W != 0))
    return err_set(STATUS_ESHAPE,
                   "tensor parallel: %s: its input's %lld features are not divisible by tp=%d "
                   "(input: replicate splits them evenly)",
                   nn_module_fqn(t->m), (long long)(x->ndim ? x->shape[x->ndim - 1] : 0), W);
  if (d < 0) return STATUS_OK;
  if (x->ndim < 2 || x->shape[d] % W != 0)
    return err_set(STATUS_ESHAPE,
                   "tensor parallel: %s: the sequence length %lld is not divisible by tp=%d "
                   "(sequence parallelism splits it evenly)",
                   nn_module_fqn(t->m), (long long)(x->ndim >= 2 ? x->shape[1] : 0), W);
  return STATUS_OK;
}

static fsdpc_status_t convert(nn_ctx_t *ctx, const tp_mod_t *t, nn_var_t *x, conv_t c,
                              tp_layout_t tag, nn_var_t **out) {
  *out = NULL;
  FSDPC_TRY(check_split(t, &x->value, c));
  fsdpc_tensor_t y;
  FSDPC_TRY(move(t->mesh, &x->value, conv_fwd[c][0], conv_fwd[c][1], &y));
  FSDPC_TRY(nn_var_new(&y, x->requires_grad, out));
  (*out)->layout = tag;
  if (!nn_needs_grad(ctx, &x, 1, NULL)) return STATUS_OK;
  nn_node_t n = {.backward = convert_backward,
                 .name = conv_names[c],
                 .in = {x},
                 .out = *out,
                 .user = t->mesh,
                 .ints = {c, t->reduce_dtype}};
  return nn_record(ctx, &n);
}

static fsdpc_status_t unsupported(const tp_mod_t *t, const char *what, tp_layout_t from,
                                  tp_layout_t to) {
  return err_set(STATUS_EUNSUPPORTED, "tensor parallel: %s (%s): %s from %s to %s is not supported",
                 nn_module_fqn(t->m), tp_style_name(t->style), what, tp_layout_name(from),
                 tp_layout_name(to));
}

/* The layout x arrives in: what an earlier conversion recorded, else the declared one. */
static tp_layout_t arriving(const nn_var_t *x, tp_layout_t declared) {
  return x->layout != TP_LAYOUT_DEFAULT ? (tp_layout_t)x->layout : declared;
}

/* Whether prepare() moves an input arriving as from to want: the conversions there are. */
static bool preparable(tp_layout_t from, tp_layout_t want) {
  if (from == want || (want == TP_SHARD_LAST && from == TP_LAYOUT_DEFAULT)) return true;
  if (want == TP_REPLICATE_REDUCED) return from == TP_REPLICATE || from == TP_SHARD_SEQ;
  if (want == TP_SHARD_SEQ) return from == TP_REPLICATE || from == TP_REPLICATE_REDUCED;
  if (want == TP_SHARD_LAST) return from == TP_REPLICATE;
  return false;
}

/* An input made ready for a style: Replicate for colwise layers (reduced once in backward),
 * Shard(1) for sequence-parallel norms, Shard(-1) for rowwise layers (a replicated input
 * split here, as PyTorch's RowwiseParallel(input_layouts=Replicate())). *y is a new
 * reference. */
static fsdpc_status_t prepare(nn_ctx_t *ctx, const tp_mod_t *t, nn_var_t *x, tp_layout_t want,
                              nn_var_t **y) {
  /* Layouts travel with the activations (every operation keeps its inputs'), so one without a
   * layout came through no tensor-parallel layer: every rank holds it whole. Taken for
   * sequence shards, it would come back tp times as long. */
  if (want == TP_SHARD_SEQ && x->layout == TP_LAYOUT_DEFAULT && t->in == TP_SHARD_SEQ)
    return err_set(STATUS_EINVAL,
                   "tensor parallel: %s (sequence_parallel): its input comes from no "
                   "tensor-parallel layer, so every rank holds the whole sequence, not Shard(1) "
                   "of it: give the layer before it a Shard(1) output (rowwise with output "
                   "shard(1)), or this rule input: replicate to split it here",
                   nn_module_fqn(t->m));
  tp_layout_t from = arriving(x, t->in);
  if (from == want || (want == TP_SHARD_LAST && from == TP_LAYOUT_DEFAULT)) {
    *y = nn_var_ref(x);
    return STATUS_OK;
  }
  if (want == TP_REPLICATE_REDUCED && from == TP_REPLICATE)
    return convert(ctx, t, x, CONV_COPY, want, y);
  if (want == TP_REPLICATE_REDUCED && from == TP_SHARD_SEQ)
    return convert(ctx, t, x, CONV_GATHER_SEQ, want, y);
  if (want == TP_SHARD_SEQ && (from == TP_REPLICATE || from == TP_REPLICATE_REDUCED))
    return convert(ctx, t, x, CONV_SCATTER_SEQ, want, y);
  if (want == TP_SHARD_LAST && from == TP_REPLICATE)
    return convert(ctx, t, x, CONV_SCATTER_LAST, want, y);
  return unsupported(t, "input", from, want);
}

/* A layer's own output (Shard(-1) or Partial) moved to the rule's output layout. */
static fsdpc_status_t finish(nn_ctx_t *ctx, const tp_mod_t *t, nn_var_t *y, bool partial,
                             nn_var_t **out) {
  if (partial && t->out == TP_REPLICATE) return convert(ctx, t, y, CONV_REDUCE, TP_REPLICATE, out);
  if (partial && t->out == TP_SHARD_SEQ)
    return convert(ctx, t, y, CONV_REDUCE_SCATTER, TP_SHARD_SEQ, out);
  if (!partial && t->out == TP_SHARD_LAST) {
    y->layout = TP_SHARD_LAST;
    *out = nn_var_ref(y);
    return STATUS_OK;
  }
  if (!partial && t->out == TP_REPLICATE)
    return convert(ctx, t, y, CONV_GATHER_LAST, TP_REPLICATE, out);
  if (!partial && t->out == TP_SHARD_SEQ) {
    nn_var_t *r = NULL;
    FSDPC_TRY(convert(ctx, t, y, CONV_GATHER_LAST, TP_REPLICATE, &r));
    fsdpc_status_t st = convert(ctx, t, r, CONV_SCATTER_SEQ, TP_SHARD_SEQ, out);
    nn_var_put(r);
    return st;
  }
  return unsupported(t, "output", partial ? TP_LAYOUT_COUNT : TP_SHARD_LAST, t->out);
}

/* A rowwise layer's input, once prepared, holds this rank's Shard(-1) of the features. One
 * that came through no tensor-parallel layer with all of them on every rank (no colwise layer
 * before it, and no input: replicate to split it) is named here rather than by the product's
 * shape check. */
static fsdpc_status_t rowwise_input(const tp_mod_t *t, const nn_var_t *x) {
  int64_t whole = dtensor_shape(t->w->value)[t->conv1d ? 0 : 1];
  int64_t got = x->value.ndim > 0 ? x->value.shape[x->value.ndim - 1] : -1;
  if (got != whole || mesh_numel(t->mesh) == 1) return STATUS_OK;
  return err_set(STATUS_ESHAPE,
                 "tensor parallel: %s (rowwise): its input has all %lld features on every rank, "
                 "not this rank's Shard(-1) of them: no colwise layer before it split them; give "
                 "the layer before it a colwise rule, or this rule input: replicate to split the "
                 "input here",
                 nn_module_fqn(t->m), (long long)whole);
}

/* ---- forward wrappers ---- */

/* A MoE block runs on the tokens as they come: this rank's sequence shard under sequence
 * parallelism (its parameters' gradients summed over tp by the sum hooks of the modules under
 * it), the whole sequence otherwise (every rank alike: the same gradients). Its output keeps
 * the input's layout. */
static fsdpc_status_t moe_tokens(nn_ctx_t *ctx, const tp_mod_t *t, nn_module_t *m, nn_var_t *in,
                                 nn_var_t **out, nn_forward_fn inner) {
  *out = NULL;
  bool split = t->in == TP_SHARD_SEQ;
  /* an input without a layout came through no tensor-parallel layer: whole on every rank (its
   * gradients, summed over tp as a sequence shard's, would count tp times) */
  if (split && in->layout == TP_LAYOUT_DEFAULT)
    return err_set(STATUS_EINVAL,
                   "tensor parallel: %s (prepare_input of a MoE block, sequence parallelism): "
                   "its input comes from no tensor-parallel layer, so every rank holds the whole "
                   "sequence, not its Shard(1): give the layer before it a Shard(1) output (a "
                   "sequence_parallel norm, or rowwise with output shard(1))",
                   nn_module_fqn(t->m));
  tp_layout_t from = arriving(in, t->in);
  if (split ? from != TP_SHARD_SEQ : from != TP_REPLICATE)
    return err_set(STATUS_EUNSUPPORTED,
                   "tensor parallel: %s (prepare_input of a MoE block): its input comes %s; the "
                   "block runs on %s (give the layer before it that output)",
                   nn_module_fqn(t->m), tp_layout_name(from),
                   split ? "this rank's sequence shard, shard(1), under sequence parallelism"
                         : "the whole sequence, replicate, without sequence parallelism");
  FSDPC_TRY(inner(ctx, m, in, out));
  (*out)->layout = from;
  return STATUS_OK;
}

static fsdpc_status_t wrapped(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out,
                              nn_forward_fn inner, void *user) {
  const tp_mod_t *t = user;
  nn_var_t *x = NULL, *y = NULL;
  fsdpc_status_t st = STATUS_OK;
  *out = NULL;
  switch (t->style) {
    case TP_PREPARE_INPUT:
      if (t->moe) return moe_tokens(ctx, t, m, in, out, inner);
      FSDPC_TRY(prepare(ctx, t, in, TP_REPLICATE_REDUCED, &x));
      st = inner(ctx, m, x, out);
      break;
    case TP_SEQUENCE_PARALLEL:
      FSDPC_TRY(prepare(ctx, t, in, TP_SHARD_SEQ, &x));
      st = inner(ctx, m, x, out);
      if (st == STATUS_OK) (*out)->layout = TP_SHARD_SEQ;
      break;
    case TP_HEADWISE: /* this rank's heads, normalised where they are */
      st = inner(ctx, m, in, out);
      if (st == STATUS_OK) (*out)->layout = in->layout;
      break;
    case TP_COLWISE:
      if (t->embedding) { /* ids stay whole; each rank looks up its columns */
        FSDPC_TRY_GOTO(st, inner(ctx, m, in, &y));
      } else {
        FSDPC_TRY(prepare(ctx, t, in, TP_REPLICATE_REDUCED, &x));
        FSDPC_TRY_GOTO(st, inner(ctx, m, x, &y));
      }
      st = finish(ctx, t, y, false, out);
      break;
    case TP_ROWWISE:
      if (t->embedding) {
        FSDPC_TRY_GOTO(st, nn_embedding_shard(ctx, in, t->w, t->first, t->vocab, &y));
      } else if (t->b != NULL) { /* the bias is added once, to the reduced output */
        FSDPC_TRY(prepare(ctx, t, in, TP_SHARD_LAST, &x));
        FSDPC_TRY_GOTO(st, rowwise_input(t, x));
        FSDPC_TRY_GOTO(st,
                       t->conv1d ? nn_linear_io(ctx, x, t->w, &y) : nn_linear(ctx, x, t->w, &y));
        nn_var_t *r = NULL;
        FSDPC_TRY_GOTO(st, finish(ctx, t, y, true, &r));
        st = nn_bias_add(ctx, r, t->b, out);
        if (st == STATUS_OK) (*out)->layout = r->layout;
        nn_var_put(r);
        break;
      } else {
        FSDPC_TRY(prepare(ctx, t, in, TP_SHARD_LAST, &x));
        FSDPC_TRY_GOTO(st, rowwise_input(t, x));
        FSDPC_TRY_GOTO(st, inner(ctx, m, x, &y));
      }
      st = finish(ctx, t, y, true, out);
      break;
    default: st = err_set(STATUS_EINTERNAL, "tensor parallel: bad style");
  }
cleanup:
  nn_var_put(x);
  nn_var_put(y);
  if (st != STATUS_OK && *out) {
    nn_var_put(*out);
    *out = NULL;
  }
  return st;
}

/* Gradients computed from sequence shards (a sequence-parallel norm's weight and bias, a
 * rowwise bias under sequence parallelism): each call's contribution is summed over tp
 * (earlier calls' sums are set aside meanwhile). */
static fsdpc_status_t sum_hook(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind, void *user) {
  (void)ctx;
  (void)m;
  tp_mod_t *t = user;
  fsdpc_status_t st = STATUS_OK;
  for (int k = 0; k < t->n_sum && st == STATUS_OK; k++) {
    nn_param_t *p = t->sum[k];
    fsdpc_tensor_t *stash = &t->stash[k];
    bool has = p->compute_grad.storage != NULL;
    if (kind == NN_HOOK_PRE_BACKWARD) {
      tensor_free(stash);
      if (has) {
        *stash = p->compute_grad;
        memset(&p->compute_grad, 0, sizeof p->compute_grad);
      }
      continue;
    }
    if (kind != NN_HOOK_POST_BACKWARD) continue;
    if (has) {
      fsdpc_tensor_t *g = &p->compute_grad, wide = {0};
      bool cast = t->reduce_dtype != DTYPE_COUNT && t->reduce_dtype != g->dtype;
      if (cast) st = tensor_clone(&wide, g, t->reduce_dtype, g->device);
      fsdpc_tensor_t *r = cast ? &wide : g;
      if (st == STATUS_OK)
        st = pg_all_reduce(mesh_group(t->mesh, 0), r->data, r->data, (size_t)tensor_numel(r),
                           r->dtype, REDUCE_SUM, NULL);
      if (st == STATUS_OK && cast) st = tensor_copy(g, &wide);
      tensor_free(&wide);
      /* into the wider of the two (gradients kept without sync are widened: fsdp_widen_grads) */
      if (st == STATUS_OK && stash->storage != NULL &&
          dtype_size(stash->dtype) > dtype_size(g->dtype)) {
        st = kernel_axpy(stash, 1.0f, g);
        tensor_free(g);
        *g = *stash;
        memset(stash, 0, sizeof *stash);
      } else if (st == STATUS_OK && stash->storage != NULL) {
        st = kernel_axpy(g, 1.0f, stash);
      }
      tensor_free(stash);
    } else if (stash->storage != NULL) {
      p->compute_grad = *stash;
      memset(stash, 0, sizeof *stash);
    }
  }
  return st;
}

/* ---- applying a plan ---- */

static bool is_local(const nn_param_t *p) {
  const mesh_t *pm = dtensor_mesh(p->value);
  return mesh_ndim(pm) == 1 && mesh_size(pm, 0) == 1 && !p->external;
}

/* p becomes a DTensor with placement pl on mesh; a parameter already placed there (a tied
 * weight) must agree. */
static fsdpc_status_t place(nn_param_t *p, mesh_t *mesh, placement_t pl, const char *module) {
  if (p->external) /* fully_shard's shards, whatever mesh: tensor parallelism splits whole ones */
    return err_set(STATUS_EINVAL,
                   "tensor parallel: %s: parameter %s is sharded by fully_shard already; apply "
                   "tensor_parallel first, then fully_shard over the data-parallel mesh",
                   module, p->fqn);
  if (dtensor_mesh(p->value) == mesh) {
    if (placement_equal(dtensor_placements(p->value)[0], pl)) return STATUS_OK;
    char a[32], b[32];
    return err_set(STATUS_EINVAL,
                   "tensor parallel: %s: parameter %s is already placed %s on tp; this style "
                   "needs %s",
                   module, p->fqn, placement_str(dtensor_placements(p->value)[0], a, sizeof a),
                   placement_str(pl, b, sizeof b));
  }
  if (!is_local(p))
    return err_set(STATUS_EINVAL, "tensor parallel: parameter %s is already distributed", p->fqn);
  const fsdpc_tensor_t *full = dtensor_local(p->value);
  int W = mesh_size(mesh, 0);
  if (pl.kind == PLACEMENT_SHARD && full->shape[pl.dim] % W != 0)
    return err_set(STATUS_ESHAPE,
                   "tensor parallel: %s: parameter %s has %lld %s, not divisible by tp=%d "
                   "(uneven tensor parallelism is not supported)",
                   module, p->fqn, (long long)full->shape[pl.dim],
                   pl.dim == 0                ? "rows"
                   : pl.dim == full->ndim - 1 ? "columns"
                                              : "entries in a dimension",
                   W);
  dtensor_t *dt;
  FSDPC_TRY(dtensor_distribute(full, mesh, &pl, DTENSOR_ALL_RANKS, &dt));
  return nn_param_set_value(p, dt);
}

/* Resolves a rule's layouts and splits the module's weight and bias. */
static fsdpc_status_t setup(tp_mod_t *t, const tp_rule_t *r, bool sp) {
  const char *kind = nn_module_kind(t->m), *fqn = nn_module_fqn(t->m);
  tp_layout_t model = sp ? TP_SHARD_SEQ : TP_REPLICATE;
  t->embedding = kind && strcmp(kind, "embedding") == 0;
  t->conv1d = kind && strcmp(kind, "conv1d") == 0;
  t->moe = r->style == TP_PREPARE_INPUT && kind && strcmp(kind, "moe") == 0;
  t->style = r->style;
  bool has_params = r->style != TP_PREPARE_INPUT;
  t->w = has_params ? nn_module_param_named(t->m, "weight") : NULL;
  t->b = has_params ? nn_module_param_named(t->m, "bias") : NULL;
  placement_t pl, bpl = placement_replicate();
  fsdpc_status_t st =
      tp_param_placement(r->style, kind, "weight", t->w ? dtensor_ndim(t->w->value) : 2, &pl);
  if (st == STATUS_OK && t->b != NULL)
    st = tp_param_placement(r->style, kind, "bias", dtensor_ndim(t->b->value), &bpl);
  if (st != STATUS_OK) return err_prefix(STATUS_EINVAL, "tensor parallel: %s", fqn);
  if (t->w == NULL && has_params)
    return err_set(STATUS_EINVAL, "tensor parallel: %s has no weight", fqn);
  switch (r->style) {
    case TP_COLWISE:
      t->in = TP_REPLICATE;
      t->out = t->embedding ? model : TP_SHARD_LAST;
      break;
    case TP_ROWWISE:
      t->in = t->embedding ? TP_REPLICATE : TP_SHARD_LAST;
      t->out = model;
      break;
    case TP_SEQUENCE_PARALLEL: t->in = t->out = TP_SHARD_SEQ; break;
    case TP_HEADWISE: t->in = t->out = TP_SHARD_LAST; break;
    default: /* prepare_input */ t->in = model; t->out = t->moe ? model : TP_REPLICATE_REDUCED;
  }
  if (r->input != TP_LAYOUT_DEFAULT && (r->style == TP_HEADWISE || t->moe))
    return err_set(STATUS_EINVAL, "tensor parallel: %s: %s takes its input as it comes", fqn,
                   t->moe ? "a MoE block" : "headwise");
  if (r->input != TP_LAYOUT_DEFAULT) t->in = r->input;
  if (r->output != TP_LAYOUT_DEFAULT) {
    if (r->style == TP_SEQUENCE_PARALLEL || r->style == TP_PREPARE_INPUT || r->style == TP_HEADWISE)
      return err_set(STATUS_EINVAL, "tensor parallel: %s: %s has no output layout to choose", fqn,
                     tp_style_name(r->style));
    t->out = r->output;
  }
  /* the layouts a rule declares: ones no conversion reaches are refused now, not at the
   * first forward */
  tp_layout_t want = r->style == TP_SEQUENCE_PARALLEL ? TP_SHARD_SEQ
                     : r->style == TP_ROWWISE         ? TP_SHARD_LAST
                                                      : TP_REPLICATE_REDUCED;
  bool own_input = t->embedding || t->moe || r->style == TP_HEADWISE;
  if (r->input != TP_LAYOUT_DEFAULT && !own_input && !preparable(t->in, want))
    return err_set(STATUS_EUNSUPPORTED,
                   "tensor parallel: %s (%s): input %s cannot be made the %s it computes on "
                   "(from replicate: any; from shard(1): replicate)",
                   fqn, tp_style_name(r->style), tp_layout_name(t->in),
                   tp_layout_name(want == TP_REPLICATE_REDUCED ? TP_REPLICATE : want));
  if (r->output != TP_LAYOUT_DEFAULT && r->style == TP_ROWWISE && t->out == TP_SHARD_LAST)
    return err_set(STATUS_EUNSUPPORTED,
                   "tensor parallel: %s (rowwise): output shard(-1) is not supported (its output "
                   "is summed over tp: replicate or shard(1))",
                   fqn);
  if (t->w == NULL) return STATUS_OK;
  FSDPC_TRY(place(t->w, t->mesh, pl, fqn));
  if (t->b != NULL) FSDPC_TRY(place(t->b, t->mesh, bpl, fqn));
  if (r->style == TP_ROWWISE && t->embedding) {
    int64_t off[2];
    dtensor_offset(t->w->value, off);
    t->first = off[0];
    t->vocab = dtensor_shape(t->w->value)[0];
  }
  if (r->style == TP_SEQUENCE_PARALLEL || r->style == TP_HEADWISE) {
    t->sum[t->n_sum++] = t->w;
    if (t->b != NULL) t->sum[t->n_sum++] = t->b;
  }
  if (r->style == TP_ROWWISE && t->b != NULL && t->out == TP_SHARD_SEQ) t->sum[t->n_sum++] = t->b;
  return STATUS_OK;
}

typedef struct walk {
  const tp_rule_t *rules;
  int n_rules;
  bool sp;
  int *hits;
  tp_plan_t *plan;
  mesh_t *mesh;
} walk_t;

/* Under a MoE block on sequence shards: every module with parameters gets sum hooks (its
 * parameters found after placement, tp_fill_sums); none may take a rule of its own. */
static fsdpc_status_t visit_moe(walk_t *w, nn_module_t *moe, nn_module_t *m) {
  for (int i = 0; i < nn_module_num_children(m); i++) {
    nn_module_t *c = nn_module_child(m, i);
    int r = tp_rule_index(w->rules, w->n_rules, nn_module_fqn(c));
    if (r >= 0 && tp_rule_applies(&w->rules[r], w->sp))
      return err_set(STATUS_EINVAL,
                     "tensor parallel: rule '%s' matches %s, under the MoE block %s, which runs "
                     "whole on each rank's tokens (its modules take no rule of their own)",
                     w->rules[r].pattern, nn_module_fqn(c), nn_module_fqn(moe));
    if (nn_module_num_params(c) > 0) {
      tp_mod_t *t = &w->plan->mods[w->plan->n++];
      *t = (tp_mod_t){.m = c,
                      .style = TP_PREPARE_INPUT,
                      .sum_only = true,
                      .mesh = w->mesh,
                      .reduce_dtype = DTYPE_COUNT};
      FSDPC_TRY(nn_module_add_hook(c, NN_HOOK_PRE_BACKWARD, sum_hook, t));
      FSDPC_TRY(nn_module_add_hook(c, NN_HOOK_POST_BACKWARD, sum_hook, t));
    }
    FSDPC_TRY(visit_moe(w, moe, c));
  }
  return STATUS_OK;
}

/* After placement: the parameters on tp of the modules under MoE blocks, to sum. */
static fsdpc_status_t fill_sums(tp_plan_t *plan, const mesh_t *mesh) {
  for (int i = 0; i < plan->n; i++) {
    tp_mod_t *t = &plan->mods[i];
    for (int k = 0; t->sum_only && k < nn_module_num_params(t->m); k++) {
      nn_param_t *p = nn_module_param(t->m, k);
      if (dtensor_mesh(p->value) != mesh) continue; /* expert parallelism's, summed by fsdp */
      if (t->n_sum == 4)
        return err_set(STATUS_EUNSUPPORTED, "tensor parallel: %s has more than 4 parameters",
                       nn_module_fqn(t->m));
      t->sum[t->n_sum++] = p;
    }
  }
  return STATUS_OK;
}

static fsdpc_status_t visit(walk_t *w, nn_module_t *m) {
  int i = tp_rule_index(w->rules, w->n_rules, nn_module_fqn(m));
  if (i >= 0) w->hits[i]++;
  if (i >= 0 && tp_rule_applies(&w->rules[i], w->sp)) {
    tp_mod_t *t = &w->plan->mods[w->plan->n];
    t->m = m;
    t->mesh = w->mesh;
    t->reduce_dtype = DTYPE_COUNT;
    FSDPC_TRY(setup(t, &w->rules[i], w->sp));
    w->plan->n++;
    FSDPC_TRY(nn_module_wrap_forward(m, wrapped, t));
    if (t->n_sum > 0) {
      FSDPC_TRY(nn_module_add_hook(m, NN_HOOK_PRE_BACKWARD, sum_hook, t));
      FSDPC_TRY(nn_module_add_hook(m, NN_HOOK_POST_BACKWARD, sum_hook, t));
    }
    if (t->moe && t->in == TP_SHARD_SEQ) { /* each rank routes its sequence shard */
      FSDPC_TRY(nn_moe_split_tokens(m, mesh_group(w->mesh, 0)));
      FSDPC_TRY(visit_moe(w, m, m));
    }
  }
  for (int i = 0; i < nn_module_num_children(m); i++) FSDPC_TRY(visit(w, nn_module_child(m, i)));
  return STATUS_OK;
}

/* A module with parameters of its own (Replicate on tp) and no rule runs whole on each rank:
 * given a shard of its input (a norm on sequence shards, or on this rank's heads), each rank
 * would compute another gradient of its parameters, summed by no one. Refused there. */
static fsdpc_status_t unruled(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out,
                              nn_forward_fn inner, void *user) {
  (void)user;
  if (in->layout == TP_SHARD_SEQ || in->layout == TP_SHARD_LAST)
    return err_set(STATUS_EINVAL,
                   "tensor parallel: %s has parameters and no rule, but its input comes %s: "
                   "each rank would take another gradient of them; give it a rule "
                   "(sequence_parallel for a norm on sequence shards, headwise for a norm of "
                   "each rank's heads)",
                   nn_module_fqn(m), tp_layout_name((tp_layout_t)in->layout));
  return inner(ctx, m, in, out);
}

static bool has_rule(const tp_plan_t *plan, const nn_module_t *m) {
  for (int i = 0; i < plan->n; i++)
    if (plan->mods[i].m == m) return true;
  return false;
}

/* The modules under m (m included) without a rule of their own (a MoE block's modules have
 * their sums) that hold parameters Replicate on mesh: their inputs checked (unruled). */
static fsdpc_status_t guard_unruled(const tp_plan_t *plan, const mesh_t *mesh, nn_module_t *m) {
  bool on_tp = false;
  for (int k = 0; k < nn_module_num_params(m) && !on_tp; k++)
    on_tp = dtensor_mesh(nn_module_param(m, k)->value) == mesh;
  if (on_tp && !has_rule(plan, m)) FSDPC_TRY(nn_module_wrap_forward(m, unruled, NULL));
  for (int i = 0; i < nn_module_num_children(m); i++)
    FSDPC_TRY(guard_unruled(plan, mesh, nn_module_child(m, i)));
  return STATUS_OK;
}

static int count_modules(const nn_module_t *m) {
  int n = 1;
  for (int i = 0; i < nn_module_num_children(m); i++) n += count_modules(nn_module_child(m, i));
  return n;
}

fsdpc_status_t tensor_parallel(nn_module_t *root, mesh_t *mesh, const tp_rule_t *rules, int n,
                               bool sequence_parallel, tp_plan_t **out) {
  ARG_NONNULL(root);
  ARG_NONNULL(mesh);
  if (n > 0) ARG_NONNULL(rules);
  ARG_NONNULL(out);
  *out = NULL;
  if (root == NULL || mesh == NULL || mesh_ndim(mesh) != 1 || (n > 0 && rules == NULL))
    return err_set(STATUS_EINVAL, "tensor_parallel: a module, a 1-D mesh and rules are required");
  tp_plan_t *plan = calloc(1, sizeof *plan);
  int *hits = calloc((size_t)(n > 0 ? n : 1), sizeof(int));
  fsdpc_status_t st = STATUS_OK;
  if (plan == NULL || hits == NULL ||
      (plan->mods = calloc((size_t)count_modules(root), sizeof(tp_mod_t))) == NULL)
    FSDPC_TRY_GOTO(st, err_set(STATUS_ENOMEM, "tensor_parallel: out of host memory"));
  walk_t w = {rules, n, sequence_parallel, hits, plan, mesh};
  FSDPC_TRY_GOTO(st, visit(&w, root));
  for (int i = 0; i < n; i++)
    if (hits[i] == 0) {
      char names[256];
      FSDPC_TRY_GOTO(st, err_set(STATUS_EINVAL,
                                 "tensor parallel: '%s' matches no module (modules here: %s, ...)",
                                 rules[i].pattern, nn_module_names(root, 6, names, sizeof names)));
    }
  /* every other parameter: Replicate on tp */
  nn_param_t **ps = NULL;
  int np = 0;
  FSDPC_TRY_GOTO(st, nn_named_parameters(root, &ps, &np));
  for (int i = 0; i < np && st == STATUS_OK; i++) {
    const mesh_t *pm = dtensor_mesh(ps[i]->value);
    if (pm != mesh && !(!is_local(ps[i]) && mesh_same_root(pm, mesh))) /* not expert-parallel */
      st = place(ps[i], mesh, placement_replicate(), nn_module_fqn(ps[i]->owner));
  }
  free(ps);
  if (st == STATUS_OK) st = fill_sums(plan, mesh);
  if (st == STATUS_OK) st = guard_unruled(plan, mesh, root);
  if (st != STATUS_OK) goto cleanup;
  free(hits);
  plan->mesh = mesh_retain(mesh);
  *out = plan;
  return STATUS_OK;
cleanup:
  free(hits);
  for (int i = 0; plan != NULL && plan->mods != NULL && i < plan->n; i++) {
    /* the modules lose what this call installed: no forward runs through a freed plan */
    nn_module_unwrap_forward(plan->mods[i].m, &plan->mods[i]);
    nn_module_remove_hooks(plan->mods[i].m, &plan->mods[i]);
  }
  tp_free(plan);
  return st;
}

void tp_free(tp_plan_t *tp) {
  if (tp == NULL) return;
  for (int i = 0; i < tp->n; i++)
    for (int k = 0; k < 4; k++) tensor_free(&tp->mods[i].stash[k]);
  free(tp->mods);
  mesh_free(tp->mesh);
  free(tp);
}

int tp_num_modules(const tp_plan_t *tp) { return tp ? tp->n : 0; }

static bool at_or_under(const nn_module_t *m, const nn_module_t *under) {
  for (; m != NULL; m = nn_module_parent(m))
    if (m == under) return true;
  return false;
}

fsdpc_status_t tp_set_reduce_dtype(tp_plan_t *tp, const nn_module_t *under, dtype_t dt) {
  ARG_NONNULL(tp);
  if (tp == NULL) return err_set(STATUS_EINVAL, "tp_set_reduce_dtype: no plan");
  if (!dtype_is_float(dt))
    return err_set(STATUS_EDTYPE, "tp_set_reduce_dtype: %s is not a floating-point dtype",
                   dtype_name(dt));
  for (int i = 0; i < tp->n; i++) {
    tp_mod_t *t = &tp->mods[i];
    if (t->reduce_dtype == DTYPE_COUNT && (under == NULL || at_or_under(t->m, under)))
      t->reduce_dtype = dt;
  }
  return STATUS_OK;
}
