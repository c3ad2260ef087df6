/*
 * The trainer: fsdp-train's whole run as one call, for the built-in architectures or a model of
 * your own. A program that describes its model by a train_model_t gets fsdp-train's command
 * line, its YAML plan (mesh, parallelize, optim, schedule, data, eval, train, checkpoint, log),
 * and everything a run does: the plan applied (fully_shard units, tensor parallelism, HSDP,
 * mixed precision), training on token data with gradient accumulation and clipping, evaluation,
 * the metrics file, checkpoints that resume under any plan, the stop at a signal or a time
 * limit, and every refusal before work is lost.
 *
 *   static fsdpc_status_t build(void *self, const train_build_t *how, nn_module_t **root) {...}
 *   int main(int argc, char **argv) {
 *     train_model_t m = TRAIN_MODEL_INIT;
 *     m.name = "my-lm";
 *     m.vocab_size = 256;
 *     m.build = build;
 *     return train_main(argc, argv, "my-train", &m);   // my-train PLAN.yaml [--set k=v]...
 *   }
 *
 * The model is a language model: its root module's forward maps token ids [B, T] (I64) to
 * logits [B, T, vocab_size]; the trainer takes the mean cross-entropy against the next tokens.
 */
#ifndef FSDPC_TRAIN_TRAINER_H
#define FSDPC_TRAIN_TRAINER_H

#include <stdbool.h>
#include <stdint.h>

#include "core/device.h"
#include "core/status.h"
#include "nn/module.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* How the trainer asks for the model. */
typedef struct train_build {
  device_type_t device; /* where its parameters live */
  /* meta parameters (no memory, no values): the trainer applies the plan, gives each rank's
   * shards memory, then calls init; otherwise whole parameters with their initial values */
  bool deferred;
  bool activation_checkpointing; /* train.activation_checkpointing (the model may ignore it) */
  uint64_t seed;                 /* model.seed */
} train_build_t;

typedef struct train_model {
  const char *name;   /* in the run's header and the checkpoints' record */
  int64_t vocab_size; /* token ids of the data must be below it */
  void *self;         /* handed to each callback */
  /* The module tree (finalised, nn_module_finalize) for how->device; its forward maps token ids
   * [B, T] to logits [B, T, vocab_size]. With how->deferred its parameters are meta. Required. */
  fsdpc_status_t (*build)(void *self, const train_build_t *how, nn_module_t **root);
  /* The initial values of a deferred build once its shards have memory, from seed (the same on
   * every plan). NULL: nn_module_reset_parameters(root, seed), each layer's own rule. */
  fsdpc_status_t (*init)(void *self, nn_module_t *root, uint64_t seed);
  /* The model's description kept with its checkpoints (a JSON object's text, the caller frees):
   * a run resumes only from a checkpoint whose description equals it. NULL: the name and
   * vocab_size. */
  fsdpc_status_t (*describe)(void *self, char **json);
  /* Frees the tree (and what the program keeps with it). NULL: nn_module_free(root). */
  void (*free)(void *self, nn_module_t *root);
} train_model_t;

#define TRAIN_MODEL_INIT \
  { NULL, 0, NULL, NULL, NULL, NULL, NULL }

/* Runs a training job as fsdp-train does, with argv's command line (PLAN.yaml [--set
 * key.path=value]... [--metrics PATH] [--plot OUT.svg] [--dry-run [-v]]) under the name
 * program; model NULL: the plan's model section names a built-in architecture (fsdp-train).
 * With a model of the program's, the plan's model section takes seed and deferred_init only.
 * Starts and ends the world (world_init, world_finalize): call it once, from main. Returns the
 * process's exit status: 0, 1 after a failure every rank reported, 75 (EX_TEMPFAIL) when a
 * signal of train.signals or train.time_limit stopped the run after saving. */
int train_main(int argc, char **argv, const char *program, const train_model_t *model);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
