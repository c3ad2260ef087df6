/*
 * Training checkpoints: model, optimizer and train state, saved sharded and loaded under any
 * plan.
 *
 * Layout of one checkpoint folder (committed atomically: written as DIR.tmp, then renamed):
 *   DIR/model/shard-RRRRR.safetensors   the parameters by their Hugging Face names (dcp.h)
 *   DIR/optim/shard-RRRRR.safetensors   "NAME.exp_avg", "NAME.exp_avg_sq" (f32)
 *   DIR/train_state.json                {"step": N, "optim_steps": N, "saved_under": {...}}
 *                                       (fsdp-train records the plan, mesh, global batch and
 *                                       the model's Hugging Face config.json as "model")
 * Checkpoints of a run live in one folder as step-NNNNNNNN; the newest complete one is the one
 * to resume from.
 */
#ifndef FSDPC_CHECKPOINT_TRAIN_CKPT_H
#define FSDPC_CHECKPOINT_TRAIN_CKPT_H

#include "checkpoint/dcp.h"
#include "nn/optim.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* Saves params (the optimizer's, in its order), the optimizer state and the step into dir
 * (which must not exist). saved_under: a JSON object describing the plan (stored as given),
 * or NULL. Collective over pg. */
fsdpc_status_t ckpt_save_training(const char *dir, nn_param_t *const *params, int n, optim_t *opt,
                                  int64_t step, const char *saved_under, pg_t *pg);

/* ---- Asynchronous saves ----
 *
 * ckpt_save_training's work, split so that training goes on while the files are written:
 * ckpt_async_start makes room for this rank's state in staging memory on the host (kept and
 * reused from save to save: the state's size once more) and starts a thread that copies the
 * state there (state on a device is copied before it returns), then hashes and writes this
 * rank's files into DIR.tmp; ckpt_async_commit, once every rank's files are written, writes
 * the train state and renames the folder into place. The folder, its integrity records and
 * its atomic commit are those of a synchronous save, except the saves' ids: fresh ones drawn
 * by rank 0, where a synchronous save derives them from the files' contents.
 *
 *   ckpt_async_t *a;
 *   FSDPC_TRY(ckpt_async_new(&a));
 *   FSDPC_TRY(ckpt_async_start(a, "ckpt/step-00000100", ps, n, opt, 100, NULL, pg));
 *   ... forward, backward; ckpt_async_wait_staged(a) before the optimizer's step ...
 *   ... training steps; at each, the ranks agree whether every ckpt_async_written(a) ...
 *   FSDPC_TRY(ckpt_async_commit(a, pg, NULL));
 *   ckpt_async_free(a);
 */
typedef struct ckpt_async ckpt_async_t;

fsdpc_status_t ckpt_async_new(ckpt_async_t **out);
/* Frees the staging memory; a save not committed is left as DIR.tmp (its writer joined). */
void ckpt_async_free(ckpt_async_t *a);
/* Starts a save of the state after step into dir (which must not exist): returns once the
 * state is staged and the writer started; refused while another save is in flight. An error
 * (a full disk while preparing, staging memory) leaves nothing behind. Collective over pg. */
fsdpc_status_t ckpt_async_start(ckpt_async_t *a, const char *dir, nn_param_t *const *params, int n,
                                optim_t *opt, int64_t step, const char *saved_under, pg_t *pg);
/* Waits until the writer has copied this rank's host state into staging memory (it does so
 * first, while the caller goes on: a forward and backward read the state, the optimizer step
 * changes it). Call it before anything changes the parameters or the optimizer state. Local. */
void ckpt_async_wait_staged(ckpt_async_t *a);
/* Whether a save is in flight (started, not committed). Local. */
bool ckpt_async_pending(const ckpt_async_t *a);
/* Whether this rank's writer has finished (its files written, or failed); true with no save in
 * flight. Local, never blocks. */
bool ckpt_async_written(const ckpt_async_t *a);
/* Whether this rank's writer has failed (ckpt_async_commit then names the error). Local. */
bool ckpt_async_failed(const ckpt_async_t *a);
/* The folder of the save in flight ("" when none). */
const char *ckpt_async_dir(const ckpt_async_t *a);
/* Completes the save in flight: waits for this rank's writer, agrees on every rank's outcome
 * (a writer's error, naming the file, on every rank), writes the train state and commits the
 * folder; on failure the temporary folder is removed. *step (may be NULL) receives the save's
 * step. Collective over pg: call it on every rank together (when all have written, to wait
 * for none). */
fsdpc_status_t ckpt_async_commit(ckpt_async_t *a, pg_t *pg, int64_t *step);

/* Loads a checkpoint saved under any plan into params and opt (whose shards may be laid out
 * differently); *step receives the step it was saved after. A checkpoint of weights only
 * (optim_steps 0 and no optim folder, as fsdp-ckpt import-hf writes) leaves the optimizer
 * fresh. Every element of the parameters and of the optimizer state is overwritten (the
 * moments of parameters that had none are allocated without zero-filling), so a deferred
 * model needs only nn_module_materialize before it, no initialisation. stats (may be NULL)
 * adds up both folders' reads. The train state is checked first (ckpt_check_state). Local. */
fsdpc_status_t ckpt_load_training(const char *dir, nn_param_t *const *params, int n, optim_t *opt,
                                  int64_t *step, dcp_stats_t *stats);

/* Checks train_state.json against the integrity record it carries ({"integrity": {"model":
 * id, "optim": id, "state": hash}}: the ids of the saves that wrote model/ and optim/, and a
 * hash of the rest of the state), and that the folders are those saves' (their headers are
 * opened and checked, no tensor data read). A state without a record passes only when its
 * folders carry none either (an earlier version's or another tool's). Local. */
fsdpc_status_t ckpt_check_state(const char *dir);

/* What ckpt_load_training would refuse of the tensors, found without reading them: every one
 * of the n parameters (their global shapes: a model built for deferred initialisation will
 * do) in model/ under its name, of its shape and a floating-point dtype, and where the state
 * records optimizer steps (or optim/ exists) both AdamW moments in optim/ likewise; the state
 * checked first (ckpt_check_state), and no tensor that is neither (ckpt_check_names).
 * Local. */
fsdpc_status_t ckpt_check_params(const char *dir, nn_param_t *const *params, int n);

/* The checkpoint holds nothing the model lacks: every tensor of model/ is one of the n
 * parameters (every one of the model's, whichever a rank holds) and every one of optim/ is
 * one's AdamW moment (PARAM.exp_avg, PARAM.exp_avg_sq); one that is not (another model's, a
 * writer's extra) is refused, named; the state checked first (ckpt_check_state). Headers
 * only. Local. */
fsdpc_status_t ckpt_check_names(const char *dir, nn_param_t *const *params, int n);

/* Adds (or replaces) the integrity record of a train state given as JSON text: model_id and
 * optim_id (NULL: weights only) are the ids of the saves of its folders (dcp_write). The
 * sealed text into *out (caller frees). For tools that write checkpoints. */
fsdpc_status_t ckpt_state_seal(const char *text, uint64_t model_id, const uint64_t *optim_id,
                               char **out);

/* ckpt_state_seal of an edited train state that keeps the ids its own integrity record holds
 * (a state without a record is copied as it is). For tools that update a committed state. */
fsdpc_status_t ckpt_state_reseal(const char *text, char **out);

/* A training checkpoint's train_state.json as text into *out (the caller frees it); NULL when
 * dir has none (a plain shard folder). Read only: ckpt_check_state checks it. Local. */
fsdpc_status_t ckpt_state_text(const char *dir, char **out);

/* Completes a checkpoint written into folder tmp: its train_state.json from state_text
 * (sealed with the ids of the saves of its folders when model_id is given, ckpt_state_seal),
 * then the rename of tmp (made by file_make_temp_dir) to out. On failure tmp is removed. For tools
 * that write checkpoints. Local. */
fsdpc_status_t ckpt_commit_state(const char *tmp, const char *out, const char *state_text,
                                 const uint64_t *model_id, const uint64_t *optim_id);

/* Checks the train state (ckpt_check_state), then reads and checks every block of every chunk
 * of the checkpoint's model and optimizer state, the tensors split over pg's ranks
 * (dcp_verify): a load checks only the blocks it reads.
 * Collective over pg; *chunks (may be NULL) receives the number of chunks checked. */
fsdpc_status_t ckpt_verify_training(const char *dir, pg_t *pg, int64_t *chunks);

/* The newest complete checkpoint (step-NNNNNNNN with a train_state.json) in root into out;
 * *found false when there is none (or root does not exist). A newer folder that is not a
 * complete checkpoint is described in skipped (its path and why; "" when none). Local. */
fsdpc_status_t ckpt_latest(const char *root, char *out, size_t size, bool *found, char *skipped,
                           size_t skipped_size);

/* The newest complete checkpoint in root older than step before (the one to fall back to when
 * the newest is damaged) into out; *found false when there is none. Local. */
fsdpc_status_t ckpt_latest_before(const char *root, int64_t before, char *out, size_t size,
                                  bool *found);

/* Calls fn(ctx, name, step, kind) for each entry directly under root named step-NNNNNNNN
 * (CKPT_STEP_COMPLETE with a train_state.json, else CKPT_STEP_INCOMPLETE) or
 * step-NNNNNNNN.tmp (CKPT_STEP_TMP), as ckpt_step_dir names them (step-6 is not one), links
 * included as entries, in directory order; a root that does not exist has none. Stops at the
 * first status fn returns other than STATUS_OK. Local. */
typedef enum ckpt_step_kind {
  CKPT_STEP_COMPLETE,
  CKPT_STEP_INCOMPLETE,
  CKPT_STEP_TMP
} ckpt_step_kind_t;
typedef fsdpc_status_t ckpt_step_fn(void *ctx, const char *name, int64_t step,
                                    ckpt_step_kind_t kind);
fsdpc_status_t ckpt_scan_steps(const char *root, ckpt_step_fn *fn, void *ctx);

/* The folder of the checkpoint after step under root: root/step-NNNNNNNN. */
void ckpt_step_dir(const char *root, int64_t step, char *out, size_t size);

/* Whether name (a folder's last component) is a step folder's as ckpt_step_dir writes it,
 * step-NNNNNNNN, or an unfinished save's, step-NNNNNNNN.tmp: its step into *step and which into
 * *tmp (either may be NULL). step-6 and names of 20 digits are someone else's. */
bool ckpt_step_name(const char *name, int64_t *step, bool *tmp);

/* The step folders under root that a run from step `after` to step `upto` would pass over:
 * complete checkpoints after `after`, and folders step-NNNNNNNN without a train_state.json in
 * (after, upto] (unfinished saves, step-NNNNNNNN.tmp, not counted). Their number into *count
 * and the newest step into *newest (-1 when none). Local. */
fsdpc_status_t ckpt_newer(const char *root, int64_t after, int64_t upto, int *count,
                          int64_t *newest);

/* The first step-NNNNNNNN.tmp under root with a step in (after, upto] that is no save's (it
 * lacks the mark a save gives its folder, file_is_stale_temp_dir; a link aside): a save of that
 * step would be refused. Its name into name ("" when none). Local. */
fsdpc_status_t ckpt_foreign_tmp(const char *root, int64_t after, int64_t upto, char *name,
                                size_t size);

/* Removes the unfinished saves under root (step-NNNNNNNN.tmp, left by a job that died while
 * saving: marked as a save's, FILE_TEMP_MARK) and the folders a removal left half done
 * (step-NNNNNNNN.removing); *removed (may be NULL) receives how many. A step-NNNNNNNN.tmp
 * without the mark (no save's) and a half-removed folder that cannot go (a file in it that may
 * not be removed) are left, never being taken for a checkpoint: *left (may be NULL) counts
 * them and why (may be NULL) receives the first one's cause. A rollback journal's unfinished write
 * (fsdp-train.rollback.tmp-XXXXXX) goes too, uncounted. A symbolic link is removed itself,
 * never what it points to. Local; call it on one rank, with no job saving into root. */
fsdpc_status_t ckpt_remove_unfinished(const char *root, int *removed, int *left, char *why,
                                      size_t why_size);

/* Settles the folders a checkpoint.overwrite save moved aside (step-NNNNNNNN.replaced-PID)
 * and a job that died left there: one whose step folder is absent comes back under its name
 * (*restored counts them), one whose step folder is complete (the save committed) is removed
 * (*removed); any other stays. Call it after ckpt_remove_unfinished. Local; on one rank, with
 * no job saving into root. */
fsdpc_status_t ckpt_restore_replaced(const char *root, int *restored, int *removed);

/* A checkpoint.overwrite rollback's journal: root/fsdp-train.rollback, written (begin) before
 * it saves anything, holding the step it continues from, the run id its saves record in
 * saved_under ("run") and a file of its own (the metrics file it writes until its first save
 * commits, NAME.tmp-XXXXXX as file_create_temp names it for NAME; "" for none); removed (end)
 * once the step folders it replaces are gone. After a job that died in between,
 * ckpt_rollback_settle finishes what it began: when a complete step folder after `after`
 * carries the run id (its first save committed), the other step folders after `after` (the
 * history it replaces) are removed (*replaced counts them, *finished is true) and its file
 * takes NAME's place; else the folders stay as they were and its file goes. Either way the
 * journal goes. Local; on one rank, with the folder locked. */
#define CKPT_ROLLBACK_JOURNAL "fsdp-train.rollback"
fsdpc_status_t ckpt_rollback_begin(const char *root, int64_t after, const char *run,
                                   const char *own_file);
fsdpc_status_t ckpt_rollback_end(const char *root);
fsdpc_status_t ckpt_rollback_settle(const char *root, bool *found, bool *finished, int *replaced);

/* Removes the step folders under root after step `after`, except step `keep` (-1: none);
 * each is renamed step-N.removing first, so a half-removed one is never taken for a
 * checkpoint (the next start removes it). Links are removed themselves. Local; call it on one
 * rank. */
fsdpc_status_t ckpt_remove_newer(const char *root, int64_t after, int64_t keep, int *removed);

/* Removes all but the newest keep complete checkpoints under root (keep <= 0: none); a
 * checkpoint that is a symbolic link loses the link, never what it points to. One that cannot
 * be removed fails the call, naming it and its cause, after the others are removed. Local;
 * call it on one rank. */
fsdpc_status_t ckpt_prune(const char *root, int keep);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
