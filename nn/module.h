/*
 * Modules: a tree of named children and named parameters, with hook points around every call.
 *
 * A module's fully qualified name (FQN) is the dotted path of child names from the root
 * ("model.layers.3.self_attn.q_proj"); a parameter's FQN appends its own name
 * ("model.layers.3.self_attn.q_proj.weight"). The FQN is the parameter's identity in plans,
 * optimizer groups and checkpoints.
 *
 *   nn_module_t *root, *lin;
 *   FSDPC_TRY(nn_module_new("", NULL, NULL, &root));
 *   FSDPC_TRY(nn_module_new("proj", linear_forward, NULL, &lin));
 *   FSDPC_TRY(nn_module_add_child(root, lin));               // root owns lin from now on
 *   FSDPC_TRY(nn_module_add_param(lin, "weight", w, true, NULL));  // lin owns the DTensor w
 *   FSDPC_TRY(nn_module_finalize(root));                      // FQNs: "proj", "proj.weight"
 *   ...
 *   nn_module_free(root);                               // frees the whole tree
 *
 * A parameter is a DTensor (an unsharded one is Replicate on a one-rank mesh, see
 * mesh_new_local). Forward and backward never read the DTensor directly: they read
 * `compute`, the unsharded tensor, and accumulate into `compute_grad`. For an ordinary
 * parameter `compute` is the DTensor's local tensor and `compute_grad` the local tensor of
 * `grad`; a parameter marked external (fully_shard) has both managed by its hooks.
 *
 * One parameter may appear in several modules (tied embeddings): it is owned by the module
 * that added it and shared by the others (nn_module_share_param); it has one FQN, the owner's.
 */
#ifndef FSDPC_NN_MODULE_H
#define FSDPC_NN_MODULE_H

#include <stdbool.h>

#include "dtensor/dtensor.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef struct nn_module nn_module_t;
typedef struct nn_ctx nn_ctx_t;
typedef struct nn_var nn_var_t;

typedef struct nn_param nn_param_t;

/* How an external parameter becomes usable by an operation that runs while no call that
 * provides its value is (fully_shard: a use outside any call of the parameter's unit, which
 * then gathers it on demand). The operation runs as an implicit call: enter before it, leave
 * after it, and in backward pre_backward before its gradient and post_backward after. */
typedef struct nn_param_guard {
  bool (*ready)(const nn_param_t *p); /* a call providing p's value is running */
  fsdpc_status_t (*enter)(nn_ctx_t *ctx, nn_param_t *p, const char *op);
  fsdpc_status_t (*leave)(nn_ctx_t *ctx, nn_param_t *p);
  fsdpc_status_t (*pre_backward)(nn_ctx_t *ctx, nn_param_t *p);
  fsdpc_status_t (*post_backward)(nn_ctx_t *ctx, nn_param_t *p);
  /* allocates the memory of p's local shard when p is meta (nn_module_materialize) */
  fsdpc_status_t (*materialize)(nn_param_t *p);
  /* p's shard is being written outside any call (an optimizer step, a copy, a load): an
   * unsharded copy kept since a backward (fully_shard's reshard_after_backward false) would be
   * stale and goes, the next call making it anew; refused while a step holds p's value (from
   * its unit's forward to its backward; one its unit's resharding let through is refused by
   * that backward: nn_param_t.version). Local. */
  fsdpc_status_t (*written)(nn_param_t *p);
} nn_param_guard_t;

struct nn_param {
  char *name;            /* local name ("weight"); owned */
  char *fqn;             /* set by nn_module_finalize; owned */
  nn_module_t *owner;    /* the module that added it */
  dtensor_t *value;      /* the parameter; owned */
  dtensor_t *grad;       /* same mesh and placements as value; NULL until a gradient exists */
  fsdpc_tensor_t compute;      /* the unsharded value that forward and backward read */
  fsdpc_tensor_t compute_grad; /* gradient of compute, accumulated by backward */
  /* memory p's hooks reserved for the first gradient of a backward (fully_shard: a view of one
   * buffer for its unit's gradients), handed to the operation that forms it
   * (nn_param_grad_memory) and then become compute_grad; empty otherwise */
  fsdpc_tensor_t grad_slot;
  bool grad_slot_used; /* an operation has asked for p's gradient memory: a slot would be used */
  bool requires_grad;
  bool external; /* compute and compute_grad are managed by hooks, not by the module tree */
  /* writes so far (nn_param_written): a hook can tell that the value a call's forward used
   * was replaced before its backward (fully_shard refuses that backward) */
  uint64_t version;
  const nn_param_guard_t *guard; /* an external parameter's guard, or NULL */
  void *guard_state;             /* the guard's state for this parameter; not owned */
};

/* The body of a module: reads in, returns a new variable in *out (the caller's reference).
 * Called through nn_call(), never directly, so that hooks and the tape see the call. */
typedef fsdpc_status_t (*nn_forward_fn)(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in,
                                        nn_var_t **out);

typedef enum nn_hook_kind {
  NN_HOOK_PRE_FORWARD,
  NN_HOOK_POST_FORWARD,
  NN_HOOK_PRE_BACKWARD,  /* before the gradient flows into the module's call */
  NN_HOOK_POST_BACKWARD, /* after the call's backward, parameter gradients included */
  NN_HOOK_COUNT
} nn_hook_kind_t;

/* A hook; nn_ctx_recomputing(ctx) tells a forward hook that it runs inside the recomputation
 * of an activation-checkpointed call during backward. A failing hook fails the call. */
typedef fsdpc_status_t (*nn_hook_fn)(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind,
                                     void *user);

/* Creates a module named name (a child name: no dots; "" only for a root). forward may be
 * NULL for a pure container. impl is the module's private data, not owned. */
fsdpc_status_t nn_module_new(const char *name, nn_forward_fn forward, void *impl,
                             nn_module_t **out);

/* The same with impl owned by the module: nn_module_free calls impl_free(impl) (also when
 * this call fails). */
fsdpc_status_t nn_module_new_owned(const char *name, nn_forward_fn forward, void *impl,
                                   void (*impl_free)(void *), nn_module_t **out);

/* Frees m, its children and the parameters it owns. NULL is a no-op. */
void nn_module_free(nn_module_t *m);

/* Appends child (which must have no parent); the parent owns it from now on. Child names
 * are unique within a parent. */
fsdpc_status_t nn_module_add_child(nn_module_t *parent, nn_module_t *child);

/* Adds a parameter owned by m; m takes ownership of value (also on failure). *out, if not
 * NULL, receives the parameter (owned by m). */
fsdpc_status_t nn_module_add_param(nn_module_t *m, const char *name, dtensor_t *value,
                                   bool requires_grad, nn_param_t **out);

/* Makes an existing parameter (owned elsewhere in the same tree) usable by m; one of another
 * tree is refused here when both trees are finalised, else by nn_module_finalize. */
fsdpc_status_t nn_module_share_param(nn_module_t *m, nn_param_t *p);

/* Assigns the FQNs of every module and parameter under root. Call after building the tree.
 * Refuses a tree in which a module shares a parameter of another tree. */
fsdpc_status_t nn_module_finalize(nn_module_t *root);
/* Whether m and everything under it has its FQN (finalised after the last module was added). */
bool nn_module_finalized(const nn_module_t *m);

/* Registers a hook; hooks of one kind run in registration order. */
fsdpc_status_t nn_module_add_hook(nn_module_t *m, nn_hook_kind_t kind, nn_hook_fn fn, void *user);
/* How many hooks of one kind m has. */
int nn_module_num_hooks(const nn_module_t *m, nn_hook_kind_t kind);
/* Removes every hook of m registered with this user pointer (of every kind). */
void nn_module_remove_hooks(nn_module_t *m, const void *user);

/* Selects activation checkpointing for every call of m: forward keeps only m's input, and
 * backward recomputes m's forward before differentiating it. */
void nn_module_set_checkpoint(nn_module_t *m, bool enabled);
bool nn_module_checkpoint(const nn_module_t *m);

/* Casts at m's boundary (fully_shard's mixed precision): a floating-point input of another
 * dtype is cast to in before m's forward (its gradient back in backward); the output is cast
 * to out, or, with out DTYPE_COUNT, to f32 when the input was f32 and in is narrower (a
 * narrower unit inside a wider model returns what it was given; a wider unit keeps its
 * precision). in DTYPE_COUNT: no casts. */
void nn_module_set_cast(nn_module_t *m, dtype_t in, dtype_t out);
void nn_module_cast(const nn_module_t *m, dtype_t *in, dtype_t *out);

const char *nn_module_name(const nn_module_t *m);
/* "" for the root; valid after nn_module_finalize. */
const char *nn_module_fqn(const nn_module_t *m);
nn_module_t *nn_module_parent(const nn_module_t *m);
void *nn_module_impl(const nn_module_t *m);
nn_forward_fn nn_module_forward(const nn_module_t *m);
int nn_module_num_children(const nn_module_t *m);
/* Child i (0 <= i < nn_module_num_children; NULL otherwise). */
nn_module_t *nn_module_child(const nn_module_t *m, int i);
/* The child called name, or NULL. */
nn_module_t *nn_module_child_named(const nn_module_t *m, const char *name);
/* Parameters used by m itself (owned or shared), in registration order (NULL for an index out
 * of range). */
int nn_module_num_params(const nn_module_t *m);
nn_param_t *nn_module_param(const nn_module_t *m, int i);
/* The parameter of m (owned or shared) with local name name, or NULL. */
nn_param_t *nn_module_param_named(const nn_module_t *m, const char *name);

/* Glob match of an FQN, with '*' and '?' staying inside one dot-separated name
 * ("model.layers.*" matches each block, not its children). */
bool nn_fqn_match(const char *pattern, const char *fqn);

/* The first max module FQNs under root (pre-order, root excluded), comma-separated, into buf:
 * for messages about a pattern that matches no module. Returns buf. */
const char *nn_module_names(const nn_module_t *root, int max, char *buf, size_t size);

/* The module with this FQN under root ("" is root), or NULL. */
nn_module_t *nn_module_find(nn_module_t *root, const char *fqn);

/* Every parameter under m once (shared ones at their owner), depth-first in registration
 * order: *out is a new array of *n borrowed pointers, freed by the caller with free(). */
fsdpc_status_t nn_named_parameters(const nn_module_t *m, nn_param_t ***out, int *n);

/* The parameter with this FQN under root, or NULL. */
nn_param_t *nn_param_find(nn_module_t *root, const char *fqn);

/* Adds g (the elements of p's local shard, any float dtype) into p->grad, which the first
 * call creates as a copy of g in p->value's dtype, with its mesh and placements. g is not
 * kept (used by fully_shard to accumulate reduced shards). */
fsdpc_status_t nn_param_accumulate_local_grad(nn_param_t *p, const fsdpc_tensor_t *g);

/* Creates p->grad (p must have none) with p->value's local shape, dtype, device, mesh and
 * placements, its elements not yet set, and gives *local a reference to its local tensor, for
 * the caller to fill (fully_shard casts a group's first gradients in one copy). */
fsdpc_status_t nn_param_new_local_grad(nn_param_t *p, fsdpc_tensor_t *local);

/* The same over memory the caller gives: mem (contiguous elements of p->value's local dtype,
 * device and count) becomes p->grad's local tensor, viewed in the local shape; p holds a
 * reference. fully_shard gives all the first gradients of a group one buffer. */
fsdpc_status_t nn_param_new_local_grad_in(nn_param_t *p, const fsdpc_tensor_t *mem,
                                          fsdpc_tensor_t *local);

/* Replaces p's value (p takes ownership, also on failure): drops the gradient and points
 * compute at the new local tensor. For layers that redistribute parameters (tensor
 * parallelism); refused for a parameter fully_shard manages (use nn_param_copy_full). */
fsdpc_status_t nn_param_set_value(nn_param_t *p, dtensor_t *value);

/* Writes a whole value into p, sharded or not (as torch's param.copy_ under no_grad): every
 * rank passes the same full tensor (p's global shape, any float dtype, any device) and keeps
 * the part its placements give it. Gradient and optimizer state are left alone. Refused while
 * fully_shard has p gathered for a step in progress; between steps an unsharded copy kept
 * (reshard_after_backward false) goes (nn_param_written). Local. */
fsdpc_status_t nn_param_copy_full(nn_param_t *p, const fsdpc_tensor_t *full);

/* Says that p's shard is about to be written outside any call (an optimizer step, a load):
 * what was made from the shard before (fully_shard's unsharded copy kept after backward) goes,
 * so that the next forward reads the new value. Refused (EINVAL) while a step holds p's value
 * (from its unit's forward to its backward), when a backward would mix the two. Local. */
fsdpc_status_t nn_param_written(nn_param_t *p);

/* True when p has no memory yet: a model built for deferred initialisation (its DTensor's
 * local tensor is meta). */
bool nn_param_is_meta(const nn_param_t *p);

/* Deferred initialisation, the second half: allocates the memory of every meta parameter
 * under root, each rank only its local shard (under fully_shard its zero-padded shard, under
 * tensor parallelism its tensor-parallel shard, otherwise the whole tensor), on the device
 * the parameter was declared for. The values are uninitialised (as torch's to_empty):
 * initialise them next (nn_init_* or a model's init function, ckpt_load_hf, a checkpoint
 * load). Parameters that have memory are left alone. Build the model meta, apply tensor
 * parallelism and fully_shard, then materialize: no rank ever holds a whole parameter its
 * plan does not give it. Local. */
fsdpc_status_t nn_module_materialize(nn_module_t *root);

/* Drops p's gradient (grad and compute_grad). */
void nn_param_zero_grad(nn_param_t *p);

/* The kind of layer a module is ("linear", "embedding", "rmsnorm"; NULL for others), which
 * tells tensor parallelism how to split it. The string is not copied. */
void nn_module_set_kind(nn_module_t *m, const char *kind);
const char *nn_module_kind(const nn_module_t *m);

/* One slot of extension state per module (fully_shard keeps its parameter group here). When
 * nn_module_free reaches a module whose slot is set, it first calls free_ext(m, ext) (if not
 * NULL), before freeing anything of m, its children included: the extension goes with the
 * model, whatever order the owner's other frees come in. free_ext may clear the slot of other
 * modules (nn_module_set_ext(other, NULL, NULL)). */
typedef void (*nn_ext_free_fn)(nn_module_t *m, void *ext);
void nn_module_set_ext(nn_module_t *m, void *ext, nn_ext_free_fn free_ext);
void *nn_module_ext(const nn_module_t *m);

/* A wrapper around a module's forward (tensor parallelism converts the input and output
 * layouts with it): it receives the call's input and the module's own forward, and returns
 * the call's output. Runs inside the recorded call, so the operations it records are part of
 * the call (and are recomputed under activation checkpointing). */
typedef fsdpc_status_t (*nn_wrap_fn)(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out,
                                     nn_forward_fn inner, void *user);

/* Installs m's forward wrapper (one per module; a second is refused). */
fsdpc_status_t nn_module_wrap_forward(nn_module_t *m, nn_wrap_fn fn, void *user);
/* Removes m's forward wrapper if it was installed with user (a setup that failed undoing what
 * it installed). */
void nn_module_unwrap_forward(nn_module_t *m, const void *user);

/* Runs m's forward through its wrapper, if any (used by nn_call). */
fsdpc_status_t nn_module_run_forward(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out);

/* Runs m's hooks of one kind (used by the tape and by fully_shard's explicit calls). */
fsdpc_status_t nn_module_run_hooks(nn_ctx_t *ctx, nn_module_t *m, nn_hook_kind_t kind);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
