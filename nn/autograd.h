/*
 * Variables, the activation tape and backward.
 *
 * A context records, during forward, a tape of module calls (enter/exit markers) and of the
 * operations inside them with their saved activations; nn_backward() walks the tape in reverse,
 * running each operation's backward and the module hooks: pre-backward at a call's exit marker,
 * post-backward at its enter marker. A module called twice leaves two calls on the tape; a
 * parameter used by two modules accumulates both gradients.
 *
 *   nn_ctx_t *ctx;
 *   nn_var_t *ids, *logits, *loss;
 *   FSDPC_TRY(nn_ctx_new(&ctx));
 *   FSDPC_TRY(nn_var_new(&tokens, false, &ids));          // takes over `tokens`
 *   FSDPC_TRY(nn_call(ctx, model, ids, &logits));          // records the tape
 *   FSDPC_TRY(nn_cross_entropy(ctx, logits, targets, &loss, NULL));
 *   FSDPC_TRY(nn_backward(ctx, loss));                     // parameter grads now in compute_grad
 *   nn_var_put(loss); nn_var_put(logits); nn_var_put(ids);
 *   nn_ctx_free(ctx);
 *
 * Variables are reference counted: every function that returns one gives the caller a
 * reference, released with nn_var_put(); the tape holds its own references to what backward
 * needs, and drops them as backward passes (or at nn_ctx_clear()).
 */
#ifndef FSDPC_NN_AUTOGRAD_H
#define FSDPC_NN_AUTOGRAD_H

#include "nn/module.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

struct nn_var {
  fsdpc_tensor_t value;
  fsdpc_tensor_t grad; /* present once a gradient has arrived (grad.storage or grad.ndim set) */
  bool requires_grad;
  int refs;
  int layout; /* the tensor-parallel layout tensor parallelism gave it (0: none, see
                 parallel/tensor_parallel.h); an operation keeps its inputs' */
};

/* A variable holding value (moved in: the caller's fsdpc_tensor_t is left empty). */
fsdpc_status_t nn_var_new(fsdpc_tensor_t *value, bool requires_grad, nn_var_t **out);
nn_var_t *nn_var_ref(nn_var_t *v);
void nn_var_put(nn_var_t *v);
bool nn_var_has_grad(const nn_var_t *v);

fsdpc_status_t nn_ctx_new(nn_ctx_t **out);
/* Drops the tape and frees the context. NULL is a no-op. */
void nn_ctx_free(nn_ctx_t *ctx);

/* Gradient mode: when off (evaluation), nothing is recorded. On by default. */
void nn_ctx_set_grad_enabled(nn_ctx_t *ctx, bool enabled);
/* True while operations are being recorded. */
bool nn_ctx_recording(const nn_ctx_t *ctx);
/* True while backward recomputes the forward of an activation-checkpointed call. */
bool nn_ctx_recomputing(const nn_ctx_t *ctx);

/* Calls module m on in: pre-forward hooks, m's forward (recorded, or under activation
 * checkpointing when m asks for it), post-forward hooks. *out is the caller's reference. */
fsdpc_status_t nn_call(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out);

/* A regular call of m (hooks, tape, activation checkpointing) that runs fn instead of m's
 * forward: another entry point of the module, as a method of a PyTorch module registered
 * with fully_shard. */
fsdpc_status_t nn_call_with(nn_ctx_t *ctx, nn_module_t *m, nn_forward_fn fn, nn_var_t *in,
                            nn_var_t **out);

/* The module calls in progress, outermost first ("(root) > model > lm_head"), into buf. */
void nn_ctx_call_path(const nn_ctx_t *ctx, char *buf, size_t size);

/* Seeds d(loss)/d(loss) = 1 (loss has one element), runs backward over the whole tape and
 * clears it. Parameter gradients accumulate into compute_grad. */
fsdpc_status_t nn_backward(nn_ctx_t *ctx, nn_var_t *loss);

/* Backward from any variable with a given incoming gradient (same shape; takes over grad),
 * as torch's out.backward(grad). Clears the tape. */
fsdpc_status_t nn_backward_grad(nn_ctx_t *ctx, nn_var_t *out, fsdpc_tensor_t *grad);

/* Drops the tape without running backward. */
void nn_ctx_clear(nn_ctx_t *ctx);

/* Number of entries on the tape (for tests). */
int nn_ctx_tape_length(const nn_ctx_t *ctx);

/* ---- for operation implementations (ops.c) ---- */

#define NN_NODE_MAX_IN 3
#define NN_NODE_MAX_SAVED 4

typedef struct nn_node nn_node_t;
typedef fsdpc_status_t (*nn_backward_fn)(nn_ctx_t *ctx, nn_node_t *n);

struct nn_node {
  nn_backward_fn backward;
  const char *name;                  /* the operation, for error messages */
  nn_var_t *in[NN_NODE_MAX_IN];      /* referenced inputs (NULL-padded) */
  nn_var_t *out;                     /* referenced output */
  nn_param_t *param;                 /* the parameter the operation reads, if any */
  fsdpc_tensor_t saved[NN_NODE_MAX_SAVED]; /* extra saved tensors (statistics), owned */
  double scalar;                     /* one operation constant (eps, theta, scale) */
  void *user;                        /* operation state not owned by the node (a group) */
  int64_t ints[2];                   /* integer constants (a dimension, an offset) */
};

/* True when an operation on these inputs must be recorded: recording is on and an input or
 * the parameter requires a gradient. */
bool nn_needs_grad(const nn_ctx_t *ctx, nn_var_t *const *in, int n_in, const nn_param_t *p);

/* Appends an operation to the tape; the tape takes references to node->in and node->out and
 * ownership of node->saved (also on failure). */
fsdpc_status_t nn_record(nn_ctx_t *ctx, const nn_node_t *node);

/* Brackets an operation that reads parameter p (NULL: no parameter): nn_param_begin fails
 * when p has no value to compute with, and when p's guard finds no call providing the value
 * running, makes the operation an implicit call (the guard's enter, a tape marker; *implicit
 * set). nn_param_end closes it (marker, the guard's leave) and returns st, or the closing's
 * failure when st is OK. */
fsdpc_status_t nn_param_begin(nn_ctx_t *ctx, const char *op, nn_param_t *p, bool *implicit);
fsdpc_status_t nn_param_end(nn_ctx_t *ctx, nn_param_t *p, bool implicit, fsdpc_status_t st);

/* Adds g into v's gradient; takes over g (moved in when v has no gradient yet). */
fsdpc_status_t nn_accumulate_grad(nn_var_t *v, fsdpc_tensor_t *g);

/* *into: v's gradient when an earlier use of v has formed it, of v's dtype, device and
 * shape, made v's alone (copied if another variable shares it): an operation may then add its
 * share into it directly (a matrix product with beta 1) instead of forming the share apart for
 * nn_accumulate_grad. NULL otherwise. */
fsdpc_status_t nn_grad_to_add_into(nn_var_t *v, fsdpc_tensor_t **into);

/* Adds g into p's compute_grad (allocating it first); g is released. When g is the memory of
 * p's slot (nn_param_grad_memory), compute_grad takes it over without a copy. */
fsdpc_status_t nn_param_accumulate_grad(nn_param_t *p, fsdpc_tensor_t *g);

/* *out: the memory in which an operation forms its share of p's gradient, of compute's dtype,
 * device and shape, contiguous, to be passed to nn_param_accumulate_grad: p's slot when p's
 * hooks reserved one and p has no gradient yet (fully_shard reserves one buffer for its unit's
 * gradients on a GPU, one allocation where each would take its own), else new memory. zeroed:
 * filled with zeros (for kernels that add into it); otherwise its contents are undefined. */
fsdpc_status_t nn_param_grad_memory(nn_param_t *p, bool zeroed, fsdpc_tensor_t *out);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
