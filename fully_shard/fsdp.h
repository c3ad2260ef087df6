/*
 * fully_shard: FSDP2 semantics on the module layer (docs/design.md, "fully_shard").
 *
 * Each call makes one parameter group from the parameters of the module's subtree that no
 * earlier (inner) call claimed; apply it bottom-up, blocks first and the root last. Every
 * parameter becomes a DTensor sharded on dim 0, or the dimension opt->shard_dim picks
 * (Shard(d) on a 1-D mesh; (Replicate, Shard(d)) on a 2-D HSDP mesh) whose local shard lives
 * in zero-padded storage of ceil(n_d / W) slices along d. Hooks do the rest:
 *   pre-forward / pre-backward: unshard, one all-gather of one flat buffer per group;
 *   post-forward: reshard (free the unsharded parameters) when reshard_after_forward;
 *   post-backward: one reduce-scatter (average over the shard group) per group, then for HSDP
 *   one all-reduce (average) over the replicate group; the sharded gradients accumulate into
 *   each parameter's grad DTensor, in the parameter's dtype.
 * The root (the group with no fully-sharded ancestor, found on the first forward) keeps its
 * parameters unsharded after forward by default.
 *
 *   fsdp_options_t opt = FSDP_OPTIONS_INIT;
 *   opt.mesh = dp_mesh;                            // 1-D, or 2-D (replicate, shard)
 *   for (i = 0; i < n_layers; i++) FSDPC_TRY(fully_shard(llama_layer(model, i), &opt, NULL));
 *   FSDPC_TRY(fully_shard(llama_module(model), &opt, &root));
 *   ... nn_call / nn_backward as usual; optimizer and clipping act on the shards ...
 *   llama_free(model);                             // frees the groups too
 *
 * Every rank of the mesh must apply the same calls to the same model; the hooks are
 * collective over the mesh.
 */
#ifndef FSDPC_FULLY_SHARD_FSDP_H
#define FSDPC_FULLY_SHARD_FSDP_H

#include "mesh/mesh.h"
#include "nn/autograd.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* reshard_after_forward values: FSDP_RESHARD_AUTO (false for the root, true elsewhere),
 * 0 (false), 1 (true), or N with 1 < N <= W dividing the shard size W: after forward keep a
 * 1/N slice of the gathered parameters, so the backward all-gather runs within groups of N
 * consecutive ranks of the shard group (ranks.view(-1, N)); N = W is true, as PyTorch reads
 * it. */
#define FSDP_RESHARD_AUTO (-1)

typedef struct fsdp_options {
  mesh_t *mesh; /* 1-D (shard) or 2-D (replicate, shard); the group keeps it (mesh_retain) */
  int reshard_after_forward;  /* FSDP_RESHARD_AUTO, 0, 1 or N (see above) */
  dtype_t param_dtype;        /* all-gather and compute dtype; DTYPE_COUNT: the parameter's */
  dtype_t reduce_dtype;       /* gradient reduction dtype; DTYPE_COUNT: param_dtype */
  dtype_t output_dtype;       /* the modules' floating-point outputs are cast to it; DTYPE_COUNT:
                                 f32 when their input was f32 and the compute dtype is narrower,
                                 else left in the compute dtype. Floating-point inputs are cast
                                 to the compute dtype (param_dtype or the parameters' own). */
  nn_param_t *const *ignored; /* parameters left alone: not sharded, not reduced */
  int n_ignored;
  bool offload; /* CUDA mesh: sharded parameters and gradients live in host memory, so the
                   optimizer and clipping run on the host; no effect on a CPU mesh */
  double on_demand_timeout; /* seconds the ranks of a group wait for each other to take an
                               on-demand unshard before the job is stopped (see
                               fsdp_register_forward_method) */
  /* The dimension each parameter is sharded on (FSDP2's shard_placement_fn): called once per
   * parameter by fully_shard with shard_dim_user; returns d with -ndim <= d < ndim (negative
   * counts from the end) of the parameter (of its tensor-parallel shard, for a distributed
   * one). NULL: dimension 0 for every parameter. An uneven dimension is padded as dimension 0
   * is (ceil(n_d / W) slices per rank); the values and gradients do not depend on d. */
  int (*shard_dim)(const nn_param_t *p, void *user);
  void *shard_dim_user;
  /* HFSDP, on a 2-D (replicate R, shard S) mesh: the sharded parameters the optimizer updates,
   * their gradients and so the optimizer's state are 1/(R*S) shards over every data-parallel
   * rank instead of HSDP's 1/S; each rank keeps its 1/S shard of the parameters as well, which
   * the unshards gather within the shard group as under HSDP. Backward reduce-scatters over
   * the shard group, then over the replicas (instead of HSDP's all-reduce); the first unshard
   * after the gradients of a last backward were reduced (fsdp_set_is_last_backward), or after
   * fsdp_params_changed, all-gathers the 1/(R*S) shards over the replicas into the 1/S ones
   * first. Tensor-parallel parameters compose (tp, then the shard group, then the replicas
   * chunk dimension d); offload does not. */
  bool shard_state_over_replicas;
} fsdp_options_t;

#define FSDP_ON_DEMAND_TIMEOUT_DEFAULT 600.0

#define FSDP_OPTIONS_INIT                                                                      \
  {                                                                                            \
    .mesh = NULL, .reshard_after_forward = FSDP_RESHARD_AUTO, .param_dtype = DTYPE_COUNT,      \
    .reduce_dtype = DTYPE_COUNT, .output_dtype = DTYPE_COUNT, .ignored = NULL, .n_ignored = 0, \
    .offload = false, .on_demand_timeout = FSDP_ON_DEMAND_TIMEOUT_DEFAULT, .shard_dim = NULL,  \
    .shard_dim_user = NULL, .shard_state_over_replicas = false                                 \
  }

typedef struct fsdp_group fsdp_group_t;

/* Observer of a group's data-path events: "unshard" (an all-gather is issued), "reshard"
 * (unsharded parameters freed), "post_backward" (gradients about to be reduced). */
typedef void (*fsdp_event_fn)(const char *event, const fsdp_group_t *g, void *user);

/* Shards the unclaimed parameters of m's subtree (each must be whole on this rank, at least
 * 1-D, and opt->shard_dim's answer for it in range) and installs the hooks. *out, if not NULL,
 * receives the group (owned by m's ext slot until fsdp_free_all). Collective over the mesh (it
 * creates the communicators on which the ranks agree on on-demand unshards, and with an integer
 * reshard_after_forward the post-forward group). */
fsdpc_status_t fully_shard(nn_module_t *m, const fsdp_options_t *opt, fsdp_group_t **out);

/* One group over several modules (for example [embed_tokens, lm_head] sharing a tied
 * weight): the unclaimed parameters of all their subtrees, hooks on each module. */
fsdpc_status_t fully_shard_modules(nn_module_t *const *ms, int n, const fsdp_options_t *opt,
                                   fsdp_group_t **out);

/* The group fully_shard installed on m, or NULL. */
fsdp_group_t *fsdp_group_of(const nn_module_t *m);

/* All-gathers the group's parameters (no-op when already unsharded). Collective. */
fsdpc_status_t fsdp_unshard(fsdp_group_t *g);
/* Frees the unsharded parameters. Local. */
void fsdp_reshard(fsdp_group_t *g);
bool fsdp_is_unsharded(const fsdp_group_t *g);
/* The reshard-after-forward policy in effect (after the root was found). */
int fsdp_reshard_after_forward(const fsdp_group_t *g);
int fsdp_num_params(const fsdp_group_t *g);
/* The ranks g shards over (its mesh's last dimension); 0 for NULL. */
int fsdp_shard_size(const fsdp_group_t *g);
/* The group of N consecutive ranks of an integer reshard_after_forward, or NULL. */
pg_t *fsdp_post_forward_group(const fsdp_group_t *g);
/* The distinct post-forward groups of groups[0..n) (groups of one shard group and N share
 * one), each once, into out (room for n); returns how many. */
int fsdp_post_forward_groups(fsdp_group_t *const *groups, int n, pg_t **out);
/* The all-gather and the gradient-reduction dtypes in effect. */
dtype_t fsdp_param_dtype(const fsdp_group_t *g);
dtype_t fsdp_reduce_dtype(const fsdp_group_t *g);
/* The sum of the group's padded shard sizes; fsdp_gather_numel: elements per rank in its
 * all-gather buffer, that sum rounded up to 16 bytes of the param dtype (every rank's block
 * starts aligned). */
int64_t fsdp_flat_numel(const fsdp_group_t *g);
int64_t fsdp_gather_numel(const fsdp_group_t *g);
/* Elements per rank in the group's gradient reduction: the padded shard of every parameter
 * that requires a gradient, then one presence element per such parameter (whether any rank
 * had its gradient), rounded up to 16 bytes of the reduce dtype; 0 when none requires one. */
int64_t fsdp_reduce_numel(const fsdp_group_t *g);

/* Gradient-sync control, applied to every group under root (as on PyTorch's FSDPModule):
 * - requires_gradient_sync false: backward keeps accumulating unsharded gradients and issues
 *   no collective; the next backward with sync reduces the sum (gradient accumulation). The
 *   gradients kept add up in reduce_dtype where it is wider than the compute dtype.
 * - requires_all_reduce false (HSDP): reduce-scatter only; the partial results are summed
 *   into the next all-reduce.
 * - reshard_after_backward false: parameters stay unsharded after backward, for the next
 *   micro-batch's forward; an optimizer step, nn_param_copy_full or a load writing their
 *   shards drops them (nn_param_written), so the forward after it gathers the new values.
 * - is_last_backward false: the end of backward does not wait for the last gradient
 *   reductions (micro-batches before the last); they finish during the next backward. Leave
 *   it true for the backward before the optimizer step.
 * Local. */
void fsdp_set_requires_gradient_sync(nn_module_t *root, bool sync);
void fsdp_set_requires_all_reduce(nn_module_t *root, bool all_reduce);
void fsdp_set_reshard_after_backward(nn_module_t *root, bool reshard);
void fsdp_set_is_last_backward(nn_module_t *root, bool last);

/* Reduce gradients as a sum divided by factor instead of the average over the data-parallel
 * ranks (factor > 0; 0, a negative factor or NaN restores the average). Applied to every group
 * under root. */
void fsdp_set_gradient_divide_factor(nn_module_t *root, double factor);

/* Prefetching. By default forward starts the all-gather of the group that followed this one in
 * the last iteration's forward, right after this group is gathered; backward starts the
 * all-gather of the group that runs backward next (reverse post-forward order). An explicit
 * list (possibly empty) replaces the default for that group. On the CPU a started all-gather
 * is a nonblocking MPI collective completed at the group's next unshard; one that no call
 * consumed is dropped at the end of the root's backward (or of its forward without
 * gradients), so that the next unshard gathers the shards as they are then. Local. */
fsdpc_status_t fsdp_set_forward_prefetch(fsdp_group_t *g, fsdp_group_t *const *groups, int n);
fsdpc_status_t fsdp_set_backward_prefetch(fsdp_group_t *g, fsdp_group_t *const *groups, int n);

/* The one-rank path: a group of one rank (W = 1) whose shards live where it computes needs no
 * gather, so unshard views each shard as the unsharded tensor (or casts it once into
 * param_dtype) and the reduction adds the gradients into the sharded ones without packing
 * them: the same values as the flat buffer, with two copies of the group fewer per unshard.
 * In the shards' own dtype the unsharded tensors share the shards' memory. On by default;
 * FSDPC_FSDP_ONE_RANK=0 in the environment, or fsdp_set_one_rank_path(false), keeps such groups on
 * the flat-buffer path (to compare, or to measure its copies on one device). Process-wide; an
 * unshard or reduction in flight ends on the path it started on. */
void fsdp_set_one_rank_path(bool on);

/* On a GPU, a backward forms a unit's gradients in one buffer reserved at its pre-backward
 * (one allocation and one free a unit, where each gradient would take its own; the operations
 * that form a parameter's gradient in place, nn_param_grad_memory, get a slot from the second
 * backward on); on the one-rank path, where the post-backward frees both, within the buffer
 * of the unshard (none of its own). The same values. On by default; FSDPC_FSDP_GRAD_BUFFER=0 in the
 * environment, or fsdp_set_grad_buffer(false), turns it off. Process-wide. */
void fsdp_set_grad_buffer(bool on);

/* On the one-rank path, a unit whose pre-forward or pre-backward casts its shards into
 * param_dtype casts those of the unit it prefetches too, into one buffer, in one launch: one
 * allocation, launch and free for two units where each would make its own (the prefetched
 * unit's tensors are made in its place at its own hook). Both must be freed at the same point
 * of their calls (reshard_after_forward 1, or reshard after backward), on one device, in one
 * param_dtype, and neither call may hold the other (the root and nested units join none). Its
 * cost: the prefetched unit's unsharded tensors (and in backward its gradient slots) from the
 * earlier hook on, as the all-gather prefetched for it holds them on several ranks; the buffer
 * goes with the later unit's tensors. The same values. On by default; FSDPC_FSDP_JOINT_UNSHARD=0 in
 * the environment, or fsdp_set_joint_unshard(false), turns it off. Process-wide. */
void fsdp_set_joint_unshard(bool on);

/* HFSDP (shard_state_over_replicas): whether g keeps its state over the replicas; the
 * elements per rank of its reduce-scatter over the replicas (every trainable parameter's
 * 1/(R*S) slice padded alike, then one presence element per such parameter, rounded up to 16
 * bytes of the reduce dtype) and of its all-gather over the replicas (every parameter's slice,
 * in fsdp_shard_dtype, rounded up to 16 bytes); 0 without HFSDP. */
bool fsdp_state_over_replicas(const fsdp_group_t *g);
int64_t fsdp_replica_reduce_numel(const fsdp_group_t *g);
int64_t fsdp_replica_gather_numel(const fsdp_group_t *g);
/* The dtype of the group's sharded parameters (of the first one; f32 when they differ). */
dtype_t fsdp_shard_dtype(const fsdp_group_t *g);

/* HFSDP: the sharded parameters under root were changed by other means than an optimizer
 * step after a last backward (a checkpoint loaded into them mid-run, a hand-made update): each
 * group is resharded, and its next unshard first gathers them over the replicas, a collective
 * over them, so call it on every rank. No-op for other groups. Local itself; not during a
 * forward or backward. */
void fsdp_params_changed(nn_module_t *root);

/* The host time spent in fully_shard's module hooks in this process so far (unshard,
 * prefetch, reshard, the reductions' start and their bookkeeping; on a GPU the launches
 * without the device's work), and how many hook calls it took. */
void fsdp_hook_time(double *seconds, int64_t *calls);
/* The same for one kind of hook (NN_HOOK_PRE_FORWARD ... NN_HOOK_POST_BACKWARD; 0 for
 * another value). */
void fsdp_hook_time_of(nn_hook_kind_t kind, double *seconds, int64_t *calls);

/* Installs an event observer on every group under root (NULL removes it). */
void fsdp_set_event_hook(nn_module_t *root, fsdp_event_fn fn, void *user);
/* The FQN of the group's module ("" for the model's root). */
const char *fsdp_group_name(const fsdp_group_t *g);

/* Modules and parameters used outside their unit's forward.
 *
 * A module inside a unit's subtree called directly (by a parent, or by user code) finds the
 * unit sharded: the call unshards the group on demand (collective over the group's ranks),
 * reshards after forward by the unit's policy, unshards again for its backward and reduces
 * the gradients it produced there, as a call of the unit would; prefetch does not apply.
 * An operation on a sharded parameter while no call of its group runs (a method of a module
 * computing with its parameters, called directly) does the same around that one operation.
 * The first such use of a module prints a warning naming the module, its unit and the call
 * path. Registering a module as an entry point makes its calls regular, without the
 * warning; a method runs as a regular hooked call through nn_call_with(ctx, module, fn, ...).
 *
 * Every rank must take the same on-demand paths. Before each, the ranks of the group agree
 * on it (a small all-reduce on a communicator of its own): a rank whose partners do not join
 * within on_demand_timeout seconds stops the job (world_stop), so that every rank fails with
 * an error naming the module instead of hanging; ranks that take different modules' paths
 * fail at once. On NCCL the ranks blocked in a device collective are not reached. Local. */
fsdpc_status_t fsdp_register_forward_method(nn_module_t *m);

/* Frees every group installed under root (restoring nothing: the parameters stay sharded).
 * Freeing a module of a sharded model does this for the whole model first (the groups are
 * the modules' extension, nn_module_set_ext), so it is needed only to drop the groups of a
 * model that lives on. A group keeps its mesh (mesh_retain) until it is freed. */
void fsdp_free_all(nn_module_t *root);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
