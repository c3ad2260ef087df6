/*
 * Pipeline schedules: which stage of which microbatch each rank of a pipeline runs, forward
 * and backward, in what order (docs/design.md, "Pipeline schedules").
 *
 * A model split into S = P x V stages runs on P pipeline ranks, rank r holding stages
 * r, r + P, ..., r + (V - 1) P (V stages a rank: "virtual" stages, interleaved; V = 1 otherwise).
 * A step pushes M microbatches through: F(s, m) needs F(s - 1, m)'s output, B(s, m) needs
 * B(s + 1, m)'s input gradient and F(s, m)'s activations. A schedule is, for each rank, the
 * order of its 2 M V actions; a rank runs them one after the other, each waiting only for what
 * it needs from its neighbours (sent point to point without waiting, received where needed):
 *
 *   gpipe             every forward, then every backward (microbatches in order): M
 *                     microbatches' activations in flight
 *   1f1b              P - r - 1 forwards, then a forward and a backward in turn, then the
 *                     last backwards: at most P - r in flight (M >= P)
 *   interleaved_1f1b  1f1b over V stages a rank, microbatches in groups of P visiting each of
 *                     the rank's stages in turn (M a multiple of P): a bubble V times smaller
 *
 * Forward and backward taking f and b, the bubble (idle fraction) of gpipe and 1f1b is
 * (P - 1) / (M + P - 1), of interleaved_1f1b (P - 1) / (V M + P - 1).
 *
 *   pp_schedule_t *s;
 *   FSDPC_TRY(pp_schedule_new(PP_1F1B, 4, 8, 1, &s));     // P = 4 ranks, M = 8 microbatches
 *   for (int i = 0; i < pp_schedule_num_actions(s, rank); i++) {
 *     pp_action_t a = pp_schedule_action(s, rank, i);   // a.kind, a.stage, a.microbatch
 *     ...
 *   }
 *   pp_schedule_free(s);
 */
#ifndef FSDPC_PARALLEL_PP_SCHEDULE_H
#define FSDPC_PARALLEL_PP_SCHEDULE_H

#include <stdbool.h>
#include <stdio.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef enum pp_schedule_kind {
  PP_GPIPE = 0,
  PP_1F1B,
  PP_INTERLEAVED_1F1B,
  PP_SCHEDULE_COUNT
} pp_schedule_kind_t;

typedef enum pp_action_kind { PP_FORWARD = 0, PP_BACKWARD } pp_action_kind_t;

typedef struct pp_action {
  pp_action_kind_t kind;
  int stage;      /* the global stage, 0 .. P V - 1 */
  int microbatch; /* 0 .. M - 1 */
} pp_action_t;

typedef struct pp_schedule pp_schedule_t;

/* "gpipe", "1f1b", "interleaved_1f1b" into the kind; false when unknown. */
bool pp_schedule_parse(const char *name, pp_schedule_kind_t *out);
const char *pp_schedule_name(pp_schedule_kind_t kind);

/* The microbatches a schedule takes for ranks: at least as many as the ranks (not GPipe), a
 * multiple of them (interleaved 1F1B); pp_schedule_new checks them too. Local. */
fsdpc_status_t pp_schedule_check_microbatches(pp_schedule_kind_t kind, int ranks, int microbatches);

/* The schedule of kind on ranks pipeline ranks, microbatches microbatches a step and
 * stages_per_rank stages a rank (1 but for interleaved_1f1b, which needs at least 2). Refused,
 * naming the value: ranks or microbatches below 1; 1f1b and interleaved_1f1b with fewer
 * microbatches than ranks; interleaved_1f1b with microbatches not a multiple of ranks. Local. */
fsdpc_status_t pp_schedule_new(pp_schedule_kind_t kind, int ranks, int microbatches,
                               int stages_per_rank, pp_schedule_t **out);
void pp_schedule_free(pp_schedule_t *s);

pp_schedule_kind_t pp_schedule_kind(const pp_schedule_t *s);
int pp_schedule_ranks(const pp_schedule_t *s);
int pp_schedule_microbatches(const pp_schedule_t *s);
int pp_schedule_stages_per_rank(const pp_schedule_t *s);
/* Every stage of the model: ranks x stages_per_rank. */
int pp_schedule_stages(const pp_schedule_t *s);
/* The rank holding global stage s: s mod ranks. */
int pp_schedule_rank_of_stage(const pp_schedule_t *s, int stage);

/* Rank r's actions, in the order it runs them: 2 x microbatches x stages_per_rank. */
int pp_schedule_num_actions(const pp_schedule_t *s, int rank);
pp_action_t pp_schedule_action(const pp_schedule_t *s, int rank, int i);

/* The closed-form bubble: the fraction of a step a rank idles when every forward takes the
 * same time and every backward the same time. */
double pp_schedule_bubble(const pp_schedule_t *s);

/* The most microbatches whose forward rank r has run on a stage without yet running their
 * backward there, summed over its stages: the activations it keeps at the worst moment. */
int pp_schedule_max_in_flight(const pp_schedule_t *s, int rank);

/* Runs every rank's actions in order with forwards taking forward_time and backwards
 * backward_time, each starting when its rank is free and its inputs are ready. Fills the step's
 * length and each rank's idle time (room for ranks doubles; idle may be NULL); refuses a
 * schedule that cannot finish (an action waiting on one its producer runs later), naming it. */
fsdpc_status_t pp_schedule_simulate(const pp_schedule_t *s, double forward_time,
                                    double backward_time, double *makespan, double *idle);

/* The schedule in lockstep: every action takes one time slot (forwards and backwards alike)
 * and starts as soon as its rank is free and its inputs exist; slot[r * 2 M V + i] receives
 * the slot rank r's action i runs in, *slots the step's length in slots. An action's inputs
 * were made in earlier slots. Local. */
fsdpc_status_t pp_schedule_slots(const pp_schedule_t *s, int *slot, int *slots);

/* Rank r's actions as one line each, "F s m" / "B s m", for --dry-run. */
void pp_schedule_print(const pp_schedule_t *s, int rank, FILE *f);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
