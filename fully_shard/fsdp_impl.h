/*
 * Private state of fully_shard, shared by fsdp.c (a group's life, its hooks, prefetch,
 * control), fsdp_state.c (the root's per-step context: orders, backward's place), fsdp_param.c
 * (one parameter's sharded storage), fsdp_on_demand.c (modules called outside their unit) and
 * fsdp_comm.c (the unshard and gradient-reduction data path). Not installed.
 */
#ifndef FSDPC_FULLY_SHARD_FSDP_IMPL_H
#define FSDPC_FULLY_SHARD_FSDP_IMPL_H

#include "fully_shard/fsdp.h"

typedef struct fsdp_param {
  nn_param_t *p;
  struct fsdp_group *g;
  int dim;        /* the shard dimension (opt->shard_dim's, from 0) */
  int64_t extent; /* the unsharded tensor's size along dim */
  int ndim;
  int64_t shape[TENSOR_MAX_DIMS]; /* the unsharded tensor: the whole parameter, or its
                                     tensor-parallel shard */
  /* A row is one index along dim: row elements (the product of the other sizes). A rank's
   * shard of len rows lies in rows * row elements wherever it is flat (its storage, its slot of
   * the gather and reduce buffers): its len * row elements first, in the shard's own shape,
   * then zeros; on dim 0 those are the padding rows themselves. */
  int64_t rows;          /* padded rows per rank: ceil(extent / W) */
  int64_t row;           /* elements per row */
  int64_t offset;        /* in the flat all-gather buffer of one rank, elements */
  fsdpc_tensor_t padded; /* this rank's zero-padded shard, flat (rows * row), original dtype; on
                      the host when offloaded */
  bool reducing;         /* its gradient is in the group's last reduction */
  bool trainable;     /* in the group's reduce layout (requires_grad when the reduction started) */
  int64_t red_offset; /* in one rank's block of the reduce buffer, elements */
  int red_index;      /* its place among the trainable parameters (its presence element) */
  /* HFSDP: this rank's len rows of the 1/S shard are chunked over the R replicas; replica q's
   * chunk lies at sub_offset (sub_red_offset in the reduce layout) of block q of the replica
   * buffers, padded to sub_rows */
  fsdpc_tensor_t master; /* this replica's chunk, contiguous: p->value's local */
  int64_t len, sub_rows, sub_offset, sub_red_offset;
} fsdp_param_t;

/* Side streams of one CUDA device, shared by every group on it (all NULL on the CPU), at the
 * device's top priority: copy_in for the all-gather copy-in, reduce for gradient packing,
 * reduce-scatter and accumulation, all_reduce for HSDP's all-reduce over the replicas and its
 * accumulation (so that the next group's pack and reduce-scatter do not queue behind the
 * inter-node latency). NCCL runs each communicator on its own stream, ordered by events after
 * the stream that issues the collective; reduced marks the end of the last reduction. */
typedef struct fsdp_streams {
  stream_t *copy_in, *reduce, *all_reduce;
  event_t *issued;    /* the issuing stream's position, for a side stream to wait on */
  event_t *packed;    /* the end of a pack that read a gradient another tensor still holds */
  event_t *scattered; /* the reduce stream's position, for the all-reduce stream */
  event_t *reduced;
} fsdp_streams_t;

/* A module of a group: one of its own modules (unit), or a module inside its subtree and not
 * inside an inner group, which called outside the unit's forward unshards the group on
 * demand. */
typedef struct fsdp_member {
  struct fsdp_group *g;
  nn_module_t *m;
  bool registered; /* an entry point (fsdp_register_forward_method): no warning */
  bool warned;
  bool *on_demand; /* per recorded call, in forward order: was it on demand */
  int depth, cap;
  bool active; /* a call of this module is in its forward, on demand */
} fsdp_member_t;

typedef struct gvec {
  fsdp_group_t **v;
  int n, cap;
} gvec_t;

/* The per-step context of a model under fully_shard, kept by its root group (fsdp_state.c):
 * the order the groups ran forward in, this step's and the last one's (forward prefetching
 * follows the last), the post-forward order that backward walks in reverse and backward's
 * place in it, and the group whose gradient reduction is in flight. */
typedef struct fsdp_state {
  gvec_t fwd_order, prev_fwd_order, bwd_order;
  int bwd_pos;
  bool in_backward;       /* between the root's pre- and post-backward */
  fsdp_group_t *reducing; /* the group whose reduction is in flight */
} fsdp_state_t;

/* n elements of dt rounded up to a whole number of 16-byte units: the length of a rank's block
 * in the flat buffers, so that every block starts 16-byte aligned. */
int64_t fsdp_align_block(int64_t n, dtype_t dt);

struct fsdp_group {
  nn_module_t *module;   /* the first module (names the group) */
  nn_module_t **modules; /* every module of the group (a list forms one group) */
  int n_modules;
  fsdp_param_t *params;
  int n;
  int64_t flat;           /* the padded shards' elements, end to end */
  int64_t block;          /* a rank's block of the all-gather buffer: flat rounded up to 16 bytes */
  fsdp_member_t *members; /* the group's own modules, then the other modules of its subtrees */
  int n_members;
  int in_forward; /* the group's own modules' forward calls in progress */
  uint64_t fwd_version; /* its parameters' versions summed at the last recorded forward */
  mesh_t *mesh;
  mesh_t *param_mesh;      /* (dp..., tp) of tensor-parallel parameters, or NULL; owned */
  pg_t *shard, *replicate; /* replicate: NULL without HSDP */
  pg_t *agree[2];          /* host groups of the shard and replicate ranks for agreeing on
                              on-demand unshards (NULL: a group of one rank, or no HSDP) */
  int W, rank;
  fsdp_options_t opt;   /* its ignored list points at the group's own copy: */
  nn_param_t **ignored; /* (fully_shard copies the caller's) */
  dtype_t param_dtype, reduce_dtype;
  int reshard_after_forward; /* resolved on the first forward */
  bool initialised, is_root, unsharded;
  bool sync, all_reduce, reshard_after_backward;
  bool kept; /* unsharded since its backward (reshard_after_backward false), not used since */
  pg_t *post_forward;          /* integer reshard: the N consecutive ranks of this one */
  fsdpc_tensor_t post_forward_slice; /* blocks [i*W/N, (i+1)*W/N) of the gathered buffer */
  fsdpc_tensor_t partial;      /* HSDP: reduce-scatter outputs waiting for the next all-reduce */
  double divide_factor;        /* > 0: sum / factor instead of the average */
  fsdpc_tensor_t gather;       /* the all-gather buffer while gathering */
  bool gather_local;           /* gathering on the one-rank path: no buffer (fsdp_comm.c) */
  /* prepared: on the one-rank path, cast by the unshard of the group that prefetched it into
   * gather, its place in that one's buffer (its tensors, then prepared_slots elements) */
  bool prepared;
  int64_t prepared_slots;
  pg_work_t *pending;          /* its collective */
  event_t *copied;             /* copy-in done (CUDA) */
  bool gathering;
  bool offload; /* sharded parameters and gradients on the host (CUDA mesh) */
  /* HFSDP (shard_state_over_replicas): R replicas, this rank's replica index, the blocks of
   * the replica gather (in own_dtype) and reduce buffers, the presence elements' place in the
   * latter; stale: the 1/S shards (padded) lag the masters, to be gathered before the next
   * unshard; red_last: the reduction in flight is of a last backward */
  bool hfsdp, stale, red_last, red_sub;
  int R, rrank;
  dtype_t own_dtype;
  int64_t sub_block, sub_red_block, sub_red_grads;
  fsdp_streams_t *streams;
  /* the gradient reduction in flight: reduce-scatter issued, completed at the next group's
   * post-backward or at the end of backward */
  fsdpc_tensor_t red_send, red_recv;
  int64_t red_flat;  /* elements per rank in the reduce buffer: red_grads, then the presence
                        element of each of the red_params trainable parameters */
  int64_t red_grads; /* of those, the gradients' */
  int red_params;
  bool red_missing; /* this rank had no gradient for some trainable parameter */
  pg_work_t *red_work;
  /* on a GPU, from the pre-backward that reserved it to the next reduction: the one buffer of
   * the slots of its parameters' first gradients (fsdp_unshard_ahead) */
  fsdpc_tensor_t grad_buf;
  fsdp_event_fn on_event;
  void *on_event_user;
  fsdp_group_t *root;    /* found on the first forward */
  fsdp_state_t state;    /* root only: the model's per-step context */
  bool is_last_backward; /* the root's: finish reductions at the end of backward */
  struct fsdp_group *live_prev, *live_next;    /* the registry of live groups (fsdp.c) */
  fsdp_group_t **fwd_prefetch, **bwd_prefetch; /* explicit lists */
  int n_fwd_prefetch, n_bwd_prefetch;
  bool fwd_explicit, bwd_explicit;
};

/* ---- fsdp_state.c: the root's per-step context ---- */

/* Appends g to a. */
fsdpc_status_t gvec_push(gvec_t *a, fsdp_group_t *g);
void fsdp_state_free(fsdp_state_t *s);
/* g's pre-forward (outside recomputation); the root's starts a new step, whose forward order
 * replaces the last one. Returns the group that followed g in the last step's forward
 * (what to prefetch), or NULL. */
fsdpc_status_t fsdp_state_pre_forward(fsdp_state_t *s, fsdp_group_t *g, fsdp_group_t **next);
/* g's post-forward (outside recomputation): backward will run g before what came earlier. */
fsdpc_status_t fsdp_state_post_forward(fsdp_state_t *s, fsdp_group_t *g);
/* The root's pre-backward: backward starts at the end of the post-forward order. */
void fsdp_state_backward_begins(fsdp_state_t *s);
/* g's pre-backward: the group to run backward after g (what to prefetch), or NULL. */
fsdp_group_t *fsdp_state_pre_backward(fsdp_state_t *s, const fsdp_group_t *g);
/* The root's post-backward: fsdp_state_drop_prefetches. */
void fsdp_state_backward_ends(fsdp_state_t *s);
/* Reshards the groups prefetched for a call that did not come (in backward, or in forward:
 * named by the last step's order, or by an explicit list): what they gathered or cast holds
 * the shards as they were. At the end of backward, and of a forward without gradients (no
 * backward follows). */
void fsdp_state_drop_prefetches(fsdp_state_t *s);

/* ---- fsdp.c: the group's state machine ---- */

/* Finds the group's root and resolves an auto reshard policy, on the first hook, after
 * checking that no parameter was added to its modules since fully_shard. */
fsdpc_status_t fsdp_lazy_init(fsdp_group_t *g);
/* After a call's forward: frees the unsharded parameters as reshard_after_forward says. */
fsdpc_status_t fsdp_after_forward(fsdp_group_t *g);
/* After a call's backward: reduces the gradients it produced (unless accumulating without
 * sync) and reshards. */
fsdpc_status_t fsdp_after_backward(fsdp_group_t *g);

/* ---- fsdp_param.c: one parameter ---- */

typedef struct fsdp_plist {
  nn_param_t **p;
  int n, cap;
} fsdp_plist_t;

/* Appends the parameters under m that no inner call claimed and opt does not ignore (each
 * once). */
fsdpc_status_t fsdp_collect_params(const nn_module_t *m, const fsdp_options_t *opt,
                                   fsdp_plist_t *l);
/* Whether p can be sharded over opt's mesh: whole (or a Shard/Replicate tensor-parallel DTensor
 * of the same world mesh), at least 1-D, on the mesh's device; *dim receives its shard
 * dimension (opt->shard_dim's answer, from 0), refused by name when out of range. */
fsdpc_status_t fsdp_check_param(const nn_param_t *p, const fsdp_options_t *opt, int *dim);
/* Replaces fp->p's value with its sharded DTensor: dimension fp->dim of its local tensor (the
 * whole parameter, or its tensor-parallel shard) chunked over the group's shard dimension, in
 * zero-padded storage (meta for a deferred parameter); installs the on-demand guard. */
fsdpc_status_t fsdp_shard_param(fsdp_group_t *g, fsdp_param_t *fp);
/* The guard's materialize: the padded shard of a meta parameter gets memory, uninitialised
 * except its padding rows (zero: they travel in the all-gather and the reduce-scatter). */
fsdpc_status_t fsdp_materialize_param(nn_param_t *p);

/* ---- fsdp_on_demand.c: modules called outside their unit ---- */

/* The guard of every sharded parameter (operations outside any call of its group). */
extern const nn_param_guard_t fsdp_on_demand_guard;
/* The members: the group's own modules, then the others under them (not inside an inner
 * group), which get the on-demand hook. */
fsdpc_status_t fsdp_install_members(fsdp_group_t *g);
/* The host group for agreeing on on-demand unshards over pg: pg's side channel, retained (NULL
 * for a group of one rank or none); collective over pg the first time for each pg. Released
 * with fsdp_agree_group_release. */
fsdpc_status_t fsdp_agree_group(pg_t *pg, pg_t **out);
void fsdp_agree_group_release(pg_t **agree);

/* ---- fsdp_comm.c: the data path ---- */

/* The side streams of dev (NULL on the CPU), created on first use and kept. */
fsdpc_status_t fsdp_streams_of(device_t dev, fsdp_streams_t **out);

/* Reports a data-path event to the group's observer. */
void fsdp_emit(fsdp_group_t *g, const char *event);
/* Starts gathering (copy-in and a nonblocking all-gather); no-op when gathered or gathering. */
fsdpc_status_t fsdp_unshard_start(fsdp_group_t *g);
/* Completes a started gather and copies out into the unsharded tensors. */
fsdpc_status_t fsdp_unshard_wait(fsdp_group_t *g);
/* Integer reshard after forward: keep this rank's 1/N slice, free the unsharded tensors. */
fsdpc_status_t fsdp_reshard_to_slice(fsdp_group_t *g);
/* A pre-forward's or pre-backward's unshard of g and start of the prefetches ahead (n_ahead
 * groups). In backward, on a GPU, it also reserves one buffer for the gradients g's operations
 * will form in place (nn_param_grad_memory), a slot of it for each such trainable parameter,
 * where each would take an allocation of its own; at the first backward after a reduction.
 * On the one-rank path, whose post-backward frees both, the slots follow the unsharded
 * tensors in the unshard's buffer, and a unit that casts its shards casts those of the
 * prefetched units too, into the same buffer (fsdp_set_joint_unshard). */
fsdpc_status_t fsdp_unshard_ahead(fsdp_group_t *g, fsdp_group_t *const *ahead, int n_ahead,
                                  bool backward);
/* Post-backward: packs the unsharded gradients and issues the reduce-scatter, after finishing
 * the reduction in flight (of any group under the same root); on the one-rank path, adds the
 * gradients into the sharded ones at once. */
fsdpc_status_t fsdp_reduce_start(fsdp_group_t *g);
/* A backward without gradient sync: the gradients it keeps for the next one are held in
 * reduce_dtype where that is wider than theirs, so that the backwards add up at the precision
 * of the reduction (as PyTorch FSDP2 accumulates unsharded gradients). Local. */
fsdpc_status_t fsdp_widen_grads(fsdp_group_t *g);
/* Finishes the root's reduction in flight, if any: waits for the reduce-scatter, all-reduces
 * (HSDP) and accumulates into the sharded gradients. */
fsdpc_status_t fsdp_reduce_finish(fsdp_group_t *root);
/* End of the root's backward: finishes reductions and orders the compute stream after them. */
fsdpc_status_t fsdp_finish_backward(fsdp_group_t *root);
/* Drops a reduction in flight without accumulating it (teardown). */
void fsdp_reduce_drop(fsdp_group_t *g);

#endif
