/*
 * A program's own model built wrong in one of the ways TRAINER_MISUSE says, for the trainer's
 * refusals (test_trainer_api.py): "unnamed" builds its tree without nn_module_finalize,
 * "describe" describes itself by text that is not a JSON object, "narrow" has a head one
 * column short of its vocabulary. Otherwise examples/tiny_lm.c's model, smaller.
 */
#include <stdlib.h>
#include <string.h>

#include "nn/layers.h"
#include "train/trainer.h"

enum { VOCAB = 256, DIM = 32 };

static const char *mode(void) {
  const char *m = getenv("TRAINER_MISUSE");
  return m ? m : "";
}

static fsdpc_status_t build(void *self, const train_build_t *how, nn_module_t **root) {
  (void)self;
  nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;
  lo.device = how->device;
  lo.deferred = how->deferred;
  int64_t out = strcmp(mode(), "narrow") == 0 ? VOCAB - 1 : VOCAB;
  nn_module_t *m = NULL;
  fsdpc_status_t st = nn_sequential_new(NULL, "", &m);
  if (st == STATUS_OK) st = nn_embedding_new(m, "embed", VOCAB, DIM, &lo, NULL);
  if (st == STATUS_OK) st = nn_linear_new(m, "head", DIM, out, false, &lo, NULL);
  if (st == STATUS_OK && strcmp(mode(), "unnamed") != 0) st = nn_module_finalize(m);
  if (st == STATUS_OK && !how->deferred) st = nn_module_reset_parameters(m, how->seed);
  if (st != STATUS_OK) {
    nn_module_free(m);
    return st;
  }
  *root = m;
  return STATUS_OK;
}

static fsdpc_status_t describe(void *self, char **json) {
  (void)self;
  *json =
      strdup(strcmp(mode(), "describe") == 0 ? "[\"not an object\"]" : "{\"name\": \"misuse\"}");
  return *json ? STATUS_OK : STATUS_ENOMEM;
}

int main(int argc, char **argv) {
  train_model_t model = TRAIN_MODEL_INIT;
  model.name = "misuse";
  model.vocab_size = VOCAB;
  model.build = build;
  model.describe = describe;
  return train_main(argc, argv, "own-model-misuse", &model);
}
