/*
 * Offline resharding: a training checkpoint laid out as the ranks of another plan would have
 * saved it, in one process, for any model. Nothing here knows a model: tensor names and
 * shapes come from the checkpoint's files, each target rank's box from a callback that says
 * how the target plan places a parameter (parallel/parallelize.h has one for plans).
 *
 *   FSDPC_TRY(ckpt_reshard_training("ck/step-00000100", "ck-tp", 4, my_placements, &ctx,
 *                             "{\"plan\": \"tp.yaml\"}", &files));
 */
#ifndef FSDPC_CHECKPOINT_CKPT_RESHARD_H
#define FSDPC_CHECKPOINT_CKPT_RESHARD_H

#include "dtensor/placement.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* How the target plan places parameter param (a tensor of ndim dims): the mesh's shape in
 * mesh_shape[0..*mesh_ndim) and a placement per mesh dim in pl. Ranks are numbered
 * row-major over the mesh. */
typedef fsdpc_status_t (*ckpt_placements_fn)(void *ctx, const char *param, int ndim, int *mesh_ndim,
                                             int *mesh_shape, placement_t *pl);

/* Writes the training checkpoint dir (train_state.json, model/ and, when present, optim/)
 * into out (which must not exist; written as out.tmp, renamed when complete) as world ranks
 * placing each tensor by placements would save it: one file per rank that holds a box, each
 * box read once from the source (every block it touches checked). Optimizer state NAME.exp_avg
 * and NAME.exp_avg_sq follow NAME's placements. The train state keeps its step and counters;
 * saved_under (JSON object text, or NULL to keep the old one) replaces its "saved_under", and
 * the state is sealed with the ids of the new folders. The source's state is checked first
 * (ckpt_check_state). *files (may be NULL) receives the number of files written. Local. */
fsdpc_status_t ckpt_reshard_training(const char *dir, const char *out, int world,
                                     ckpt_placements_fn placements, void *ctx,
                                     const char *saved_under, int *files);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
