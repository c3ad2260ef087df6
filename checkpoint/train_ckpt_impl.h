/* The pieces of a training checkpoint's save shared by its synchronous (train_ckpt.c) and
 * asynchronous (ckpt_async.c) forms. Internal to the library. */
#ifndef FSDPC_CHECKPOINT_TRAIN_CKPT_IMPL_H
#define FSDPC_CHECKPOINT_TRAIN_CKPT_IMPL_H

#include "checkpoint/train_ckpt.h"

/* The model's entries (a parameter each) and the optimizer's (exp_avg, exp_avg_sq each). */
typedef struct ckpt_entries {
  dcp_entry_t *model, *optim;
  dtensor_t **owned; /* the optimizer-state DTensors */
  char **names;
  int n;
} ckpt_entries_t;

/* What the optimizer entries are for. */
typedef enum ckpt_entries_mode {
  CKPT_ENTRIES_SAVE,       /* the optimizer's state (zero when it has none yet) */
  CKPT_ENTRIES_LOAD,       /* state to overwrite (allocated uninitialised when absent) */
  CKPT_ENTRIES_MODEL_ONLY, /* no optimizer entries */
} ckpt_entries_mode_t;

fsdpc_status_t ckpt_entries_make(nn_param_t *const *params, int n, optim_t *opt,
                                 ckpt_entries_mode_t mode, ckpt_entries_t *e);
void ckpt_entries_free(ckpt_entries_t *e);

/* mkdir, an existing folder being no error. */
fsdpc_status_t ckpt_make_dir(const char *path);

/* train_state.json of the folder tmp, sealed with the ids of its model/ and optim/ saves. */
/* A save's step and saved_under checked before anything is written: the step is not negative,
 * and saved_under (may be NULL) is a JSON object, which train_state.json records. Local. */
fsdpc_status_t ckpt_check_save_args(int64_t step, const char *saved_under);

fsdpc_status_t ckpt_write_state(const char *tmp, int64_t step, int64_t optim_steps,
                                const char *saved_under, uint64_t model_id, uint64_t optim_id);

#endif
