/*
 * Pipeline execution: one training step of a model split into stages, run on the ranks of a
 * pipeline group as a schedule (pp_schedule.h) orders it, activations and their gradients sent
 * point to point between neighbouring stages (docs/design.md, "Pipeline schedules").
 *
 * The caller says what a stage computes: stage 0 takes the microbatch's input (token ids,
 * from the input callback), every other stage the previous stage's output, and the last
 * stage's output is the microbatch's loss (one element). Each forward records its own tape,
 * kept until that microbatch's backward on the stage; the last stage's backward seeds
 * loss / M, so the parameters' gradients accumulate the mean over the step's M microbatches,
 * as one rank running the whole model on each microbatch in turn would.
 *
 *   pp_step_options_t o = PP_STEP_OPTIONS_INIT;
 *   o.group = pp_group;                      // rank r runs stages r, r + P, ...
 *   o.schedule = schedule;                   // pp_schedule_new(PP_1F1B, P, M, 1, ...)
 *   o.ndim = 3; o.shape = {b, T, dim};       // what crosses a stage boundary (dtype, device)
 *   o.forward = my_stage; o.input = my_ids; o.user = model;
 *   double loss;                             // the step's mean loss (every rank)
 *   FSDPC_TRY(pp_step(&o, &loss));
 *   ... clip with the norm over every stage's gradients, step the optimizer ...
 *
 * A step runs in lockstep slots (pp_schedule_slots): in each, every rank runs the action the
 * table gives it there, then exchanges with its neighbours in one batch the messages the
 * slot's actions made (its own leaves, those made for it arrive). A message is consumed in a
 * later slot, so no exchange waits on another: no deadlock on any backend, whether its sends
 * leave alone (MPI) or wait for their receivers (NCCL, the host-staged groups).
 */
#ifndef FSDPC_PARALLEL_PIPELINE_H
#define FSDPC_PARALLEL_PIPELINE_H

#include "mesh/pg.h"
#include "nn/autograd.h"
#include "parallel/pp_schedule.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* Stage stage's forward of microbatch m on in; *out: what the next stage takes, or on the
 * last stage the loss (one element). Recorded in ctx, which the step keeps until the
 * microbatch's backward on the stage. */
typedef fsdpc_status_t (*pp_stage_fn)(nn_ctx_t *ctx, int stage, int microbatch, nn_var_t *in,
                                      nn_var_t **out, void *user);
/* Stage 0's input of microbatch m (a new variable: the caller's reference passes to the
 * step). */
typedef fsdpc_status_t (*pp_input_fn)(int microbatch, nn_var_t **out, void *user);
/* Called before B(stage, microbatch) runs on this rank (fully_shard's gradient sync for the
 * stage's last microbatch only, for example). */
typedef fsdpc_status_t (*pp_backward_fn)(int stage, int microbatch, void *user);
/* Called on every rank of the group at the end of the slot in which the last stage's forward of
 * microbatch m ran: the same slot everywhere, after every stage's forward of m and before any
 * backward of it. What those forwards made on their ranks can be combined over the group here
 * (a collective of the group's ranks, such as the MoE routers' statistics). */
typedef fsdpc_status_t (*pp_forwarded_fn)(int microbatch, void *user);

/* What a step measured on this rank (pp_step_options_t.stats). */
typedef struct pp_step_stats {
  double seconds;      /* the step, from its first action to its sends' completion */
  double wait_seconds; /* of those, waiting for a neighbour: receives and the final sends
                          (host time) */
  int max_in_flight;   /* the most microbatches whose tapes (activations) it held at once,
                          counted from the tapes themselves */
} pp_step_stats_t;

typedef struct pp_step_options {
  pg_t *group;                    /* the pipeline's ranks: group rank r is pipeline rank r */
  const pp_schedule_t *schedule;  /* its ranks: the group's size */
  int ndim;                       /* a stage boundary's activation (and its gradient) */
  int64_t shape[TENSOR_MAX_DIMS]; /* the same at every boundary, contiguous */
  dtype_t dtype;
  device_t device;
  /* the layout received activations carry (nn_var_t.layout: tensor parallelism's, such as
   * TP_SHARD_SEQ under sequence parallelism, whose shape then holds this rank's sequence
   * shard); 0: none */
  int layout;
  pp_stage_fn forward;
  pp_input_fn input; /* called on stage 0's rank only */
  pp_backward_fn before_backward; /* NULL: none */
  pp_forwarded_fn forwarded;      /* NULL: none */
  void *user;
  pp_step_stats_t *stats; /* if not NULL, filled by each step */
} pp_step_options_t;

#define PP_STEP_OPTIONS_INIT                                                            \
  {                                                                                     \
    .group = NULL, .schedule = NULL, .ndim = 0, .shape = {0}, .dtype = DTYPE_F32,       \
    .device = {DEVICE_CPU, 0}, .forward = NULL, .input = NULL, .before_backward = NULL, \
    .forwarded = NULL, .user = NULL, .stats = NULL                                      \
  }

/* Runs this rank's actions of one step (pp_schedule_action order): its stages' forwards and
 * backwards of every microbatch, the boundary activations sent to the next stage's rank and
 * their gradients back. Parameter gradients accumulate as the backward of loss / M would make
 * them. *loss (if not NULL) receives the step's mean loss on every rank. Collective over the
 * group. */
fsdpc_status_t pp_step(const pp_step_options_t *opt, double *loss);

/* The bytes a step's point-to-point sends of pipeline rank r move (as the group counts them:
 * send_recv bytes): an activation to the next stage for every forward but the last stage's,
 * a gradient to the previous stage for every backward but stage 0's. Local. */
uint64_t pp_step_send_bytes(const pp_step_options_t *opt, int rank);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
