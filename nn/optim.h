/*
 * AdamW with per-parameter groups, gradient clipping and the learning-rate schedule, exactly
 * as docs/design.md, "The reference model and training math" (torch.optim.AdamW,
 * torch.nn.utils.clip_grad_norm_, warmup + cosine).
 *
 *   adamw_config_t cfg = ADAMW_CONFIG_INIT;
 *   cfg.lr = 3e-3;
 *   cfg.groups[cfg.n_groups++] = (adamw_group_t){.pattern = "*norm*", .lr = -1, .weight_decay = 0};
 *   optim_t *opt;
 *   FSDPC_TRY(optim_new(params, n, &cfg, &opt));
 *   ... backward ...
 *   FSDPC_TRY(clip_grad_norm(params, n, 1.0, NULL, &norm));
 *   FSDPC_TRY(optim_step(opt, lr_schedule_factor(&sched, step)));  // the rate is cfg.lr x this
 *   optim_free(opt);
 *
 * The optimizer steps on each parameter's local shard (p->value, p->grad); moments are
 * tensors of cfg.state_dtype (F32 by default) shaped like the local shard on its device.
 */
#ifndef FSDPC_NN_OPTIM_H
#define FSDPC_NN_OPTIM_H

#include "mesh/pg.h"
#include "nn/module.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

#define ADAMW_MAX_GROUPS 16

/* Parameters whose FQN matches pattern (fnmatch glob; the first matching group wins) use
 * this group's lr and weight decay; a negative value means the default (NaN and infinities are
 * refused). */
typedef struct adamw_group {
  const char *pattern;
  double lr;
  double weight_decay;
} adamw_group_t;

typedef struct adamw_config {
  double lr, beta1, beta2, eps, weight_decay;
  int n_groups;
  adamw_group_t groups[ADAMW_MAX_GROUPS];
  /* the moments' dtype: DTYPE_F32, or DTYPE_BF16 (half the state's memory; each update is
   * computed in f32 and the moments rounded to bf16 as they are stored). The parameters keep
   * their own dtype. */
  dtype_t state_dtype;
} adamw_config_t;

/* torch.optim.AdamW's defaults. */
#define ADAMW_CONFIG_INIT                                                                       \
  {                                                                                             \
    .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 1e-2, .n_groups = 0, \
    .state_dtype = DTYPE_F32                                                                    \
  }

typedef struct optim optim_t;

/* Whether group matches one of params[0..n) by FQN (a group without a pattern matches any);
 * optim_new refuses a group that matches none of its parameters. False for NULL arguments. */
bool optim_group_matches(const adamw_group_t *group, nn_param_t *const *params, int n);

/* An optimizer over params (borrowed; they must outlive it). Patterns are copied. */
fsdpc_status_t optim_new(nn_param_t *const *params, int n, const adamw_config_t *cfg,
                         optim_t **out);
void optim_free(optim_t *o);

/* One AdamW step of every parameter that has a gradient, with each group's lr times
 * lr_factor (the schedule's factor). Parameters without a gradient are skipped, as torch does;
 * the bias correction counts the optimizer's steps (optim_steps, what a checkpoint records),
 * where torch counts each parameter's own: a parameter first stepped at step k > 1 is
 * corrected as of step k here, as of step 1 there. */
fsdpc_status_t optim_step(optim_t *o, double lr_factor);

/* optim_step as if every gradient had first been multiplied by grad_scale (> 0; clip_grad_coef's
 * factor), bit for bit, with the scaling done inside the update's pass instead of a pass of its
 * own; the gradients keep their values. */
fsdpc_status_t optim_step_scaled(optim_t *o, double lr_factor, float grad_scale);

/* The lr and weight decay parameter i gets (after group matching); NaN for both when i is not
 * one of the optimizer's parameters. */
void optim_param_hparams(const optim_t *o, int i, double *lr, double *weight_decay);

/* Steps taken so far. */
int64_t optim_steps(const optim_t *o);
/* The parameter of slot i (the i-th given to optim_new), or NULL when there is none. */
nn_param_t *optim_param(const optim_t *o, int i);

/* Parameter i's AdamW moments (exp_avg, exp_avg_sq; state_dtype, zero before the first step) as new
 * DTensors sharing the optimizer's memory, with the parameter's mesh and placements: for
 * checkpoints. The caller frees the DTensors; the optimizer keeps the memory. */
fsdpc_status_t optim_state(optim_t *o, int i, dtensor_t **exp_avg, dtensor_t **exp_avg_sq);
/* The same for a load that overwrites every element: a parameter without state gets moments
 * allocated uninitialised instead of zero-filled. */
fsdpc_status_t optim_state_for_load(optim_t *o, int i, dtensor_t **exp_avg, dtensor_t **exp_avg_sq);
/* Sets the number of steps taken (bias correction continues from there), for resuming. */
void optim_set_steps(optim_t *o, int64_t steps);

/* Drops every parameter's gradient. */
void optim_zero_grad(optim_t *o);

/* Global L2 norm of all gradients across all shards, every element counted once (a shard
 * replicated over mesh dimensions is counted only on coordinate 0 of them); group, if not
 * NULL, is the process group over which the per-rank sums are added, holding every rank of
 * each gradient's mesh (a narrower one is refused); NULL: this rank's gradients only, each
 * whole here (one split over ranks is refused).
 * Scales every gradient by max_norm / (norm + 1e-6) when that is below 1. *norm receives the
 * norm before clipping. Collective over group. */
fsdpc_status_t clip_grad_norm(nn_param_t *const *params, int n, double max_norm, pg_t *group,
                              double *norm);

/* The norm as clip_grad_norm computes it and the factor it would scale the gradients by
 * (min(1, max_norm / (norm + 1e-6)) as an F32), without scaling them: give the factor to
 * optim_step_scaled. Collective over group. */
fsdpc_status_t clip_grad_coef(nn_param_t *const *params, int n, double max_norm, pg_t *group,
                              double *norm, float *coef);

/* Warmup then cosine decay to a floor: for step s of total steps S with W warmup steps and
 * floor ratio r, f = (s+1)/W if s < W, else r + (1-r) * 0.5 * (1 + cos(pi * (s-W) / max(1, S-W))).
 */
typedef struct lr_schedule {
  int64_t warmup_steps;
  int64_t total_steps;
  double min_ratio;
} lr_schedule_t;

double lr_schedule_factor(const lr_schedule_t *s, int64_t step);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
