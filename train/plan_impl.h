/* The job plan of the trainer (trainer.h) for a program's own model: plan_load_settings and
 * plan_resolve with own the model's name (NULL: the built-in model, as those two). With a
 * model of its own, the plan's model section takes seed and deferred_init only, no built-in
 * tensor-parallel rules fill the plan, and no built-in model's sizes are checked against the
 * mesh. Private to train/. */
#ifndef FSDPC_TRAIN_PLAN_IMPL_H
#define FSDPC_TRAIN_PLAN_IMPL_H

#include "train/plan.h"

fsdpc_status_t plan_load_job(fsdpc_plan_t *p, const char *path, const char *const *sets, int n_sets,
                             const char *own, char **settings);
fsdpc_status_t plan_resolve_job(fsdpc_plan_t *p, int world, const char *own);

#endif
