/* The trainer's operations around the training loop (private to train/): stopping at a step
 * boundary on a signal or before train.time_limit, the lock of checkpoint.dir, and the checks that
 * run before the first step (every rank's plan the same, outputs that replace no input, step
 * folders the run would collide with, a checkpoint's model against the plan's). */
#ifndef FSDPC_TRAIN_OPS_IMPL_H
#define FSDPC_TRAIN_OPS_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include "nn/autograd.h"
#include "train/data.h"
#include "train/plan.h"

/* The status the trainer exits with when it stopped early at a step boundary (a signal of
 * train.signals, or train.time_limit) after saving: sysexits.h's EX_TEMPFAIL, "try again
 * later"; a job script requeues on it. */
#define TRAIN_EXIT_INTERRUPTED 75

/* The program's name in messages (train_main's program: "fsdp-train"). */
const char *train_prog(void);
void train_set_prog(const char *name);

/* Installs handlers for p's signals: the first one received is recorded (train_signal), a
 * second exits the process at once with status 128 + its number. Local. */
fsdpc_status_t train_signals_install(const fsdpc_plan_t *p);
/* Holds (blocks) the signals train.signals may name in the calling thread, and so in every
 * thread it starts: called first thing, before the plan is read. train_signals_release, once the
 * handlers are in place, delivers one that came meanwhile. */
void train_signals_hold(void);
void train_signals_release(void);
/* The first of train.signals this process received, or 0. */
int train_signal(void);
/* "SIGTERM", "SIGUSR1", ... */
const char *train_signal_name(int sig);

/* Why a run stops before train.steps, agreed by every rank at a step boundary. */
typedef struct train_stop {
  int signal;      /* the signal some rank received (the first of train.signals), or 0 */
  bool time_limit; /* train.time_limit would pass during the next step and its save */
} train_stop_t;

/* The values a rank adds to the step's all-reduce (a sum) for the stop: n (1 + n_signals)
 * doubles from p, this rank's signal and whether its clock says the time is up. */
int train_stop_values(const fsdpc_plan_t *p, bool time_up, double *out);
/* The agreed stop from the summed values. */
train_stop_t train_stop_of(const fsdpc_plan_t *p, const double *sums);
/* Whether s stops anything (a signal or the time limit). */
static inline bool train_stop_any(train_stop_t s) { return s.signal != 0 || s.time_limit; }

/* Takes the lock of checkpoint.dir (a file there, fsdp-train.lock, held with flock and
 * recording host, pid, start time and plan) on rank 0, agreed: a second job refuses, naming
 * the holder; a record left by a process that died is taken over with a note on stderr.
 * *fd: the lock's file (-1 on the other ranks, or where the file system has no locks).
 * Collective over the world. */
fsdpc_status_t train_lock(const char *dir, const char *plan_path, int *fd);
/* Releases the lock: its file removed (a job that ends otherwise, killed, leaves its record
 * for the next job to take over), then closed. */
void train_unlock(int fd);
/* --dry-run: a note on stderr (rank 0) naming the job that holds checkpoint.dir's lock. */
void train_lock_note(const char *dir);

/* The logits of a forward: at least vocab_size columns, else named before a token id beyond
 * them meets the loss (at some later step). Local. */
fsdpc_status_t train_check_logits(const nn_var_t *logits, int64_t vocab_size);

/* Every rank's settings text (plan_load_settings) equal to rank 0's: a difference names the
 * keys and the ranks ("rank 1: train.steps: 8 here, 5 on rank 0"). Collective. */
fsdpc_status_t train_check_same_plan(const char *settings);

/* The checkpoint's recorded model (train_state.json's saved_under.model) equal to the plan's
 * model: layers, sizes, vocabulary, tying, RoPE, norm eps; a difference names the key. A
 * checkpoint without a record passes. Local. */
fsdpc_status_t train_check_model(const fsdpc_plan_t *p, const char *ckpt);

/* The same for a program's own model (train_main's): the record equal to the model's
 * description (described: a JSON object's text), or a refusal naming name and the first key
 * that differs. Local. */
fsdpc_status_t train_check_own_model(const char *ckpt, const char *name, const char *described);

/* The files this run reads (the plan, data.path and eval.path's files, init_from's folder, the
 * checkpoint to resume) may not be its outputs: --metrics, --plot (the metrics file neither).
 * Each output is a regular file or new, in a writable folder, and the metrics file not held
 * by another running job. Local; a dry run checks too (another job's metrics file: a note). */
fsdpc_status_t train_check_outputs(const fsdpc_plan_t *p, const char *metrics, const char *plot,
                                   const fsdpc_data_t *data, const fsdpc_data_t *eval,
                                   const char *resumed, bool dry_run);

/* checkpoint.dir's step folders after `start` (the step the run starts after) would be passed
 * over by this run: refused, naming the newest and the ways out, unless checkpoint.overwrite.
 * Rank 0 reads the folder; agreed. Collective. */
fsdpc_status_t train_check_step_folders(const fsdpc_plan_t *p, int64_t start);

/* The step a checkpoint was saved after (its train_state.json), for a dry run's checks. */
fsdpc_status_t train_checkpoint_step(const char *ckpt, int64_t *step);

#endif
