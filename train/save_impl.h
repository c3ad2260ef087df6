/* The trainer's checkpoints during a run (private to train/): each save synchronous, or
 * (checkpoint.async) staged at its step and committed at a later step boundary once every rank's
 * files are written; checkpoint.overwrite's replacement of newer step folders; pruning to
 * checkpoint.keep. */
#ifndef FSDPC_TRAIN_SAVE_IMPL_H
#define FSDPC_TRAIN_SAVE_IMPL_H

#include "checkpoint/train_ckpt.h"
#include "train/run_impl.h"

typedef struct train_saver {
  ckpt_async_t *async; /* checkpoint.async: true */
  bool replaced;       /* checkpoint.overwrite's newer folders are gone (or were none to replace) */
  char aside[PLAN_PATH_MAX + 64]; /* the folder of the save's step, moved aside until it commits */
  double started;                 /* when the save in flight started */
  double last_s;      /* the last completed save, from its start to its commit (seconds) */
  double stall_s;     /* the time the current step spent on checkpoints (train_save_*) */
  int64_t saved_step; /* the step of the save committed during the current step, or -1 */
} train_saver_t;

/* Local. */
fsdpc_status_t train_saver_init(train_saver_t *sv, const run_t *r);
/* Waits for a save in flight: its thread joined, its folder left uncommitted. */
void train_saver_free(train_saver_t *sv);

/* Saves the state after step into checkpoint.dir (under: saved_under's text). Synchronous, or
 * with checkpoint.async the state staged and written in the background (a save still in flight
 * is committed first); wait: commit before returning (the last step, a stop). Collective. */
fsdpc_status_t train_save(train_saver_t *sv, const run_t *r, int64_t step, const char *under,
                          bool wait);

/* The values this rank adds to the step's all-reduce (a sum) about a save in flight: 2 doubles
 * (its writer finished; it failed). */
void train_save_values(const train_saver_t *sv, double *out);
/* Commits a save in flight when the summed values say every rank has written (or one failed:
 * the run then stops naming the file). Collective: every rank calls it with the same sums. */
fsdpc_status_t train_save_poll(train_saver_t *sv, const run_t *r, const double *sums);
/* Waits until a save in flight has copied the state (before the optimizer changes it). Local. */
void train_save_wait_staged(train_saver_t *sv);
/* Commits a save in flight, waiting for this rank's writer. Collective. */
fsdpc_status_t train_save_finish(train_saver_t *sv, const run_t *r);

/* Records in the committed checkpoint dir that its step's evaluation is pending
 * (saved_under.eval_pending: a signal cut it short after the save), its train_state.json
 * resealed and replaced whole. Local (rank 0's). */
fsdpc_status_t train_mark_eval_pending(const char *dir);

#endif
