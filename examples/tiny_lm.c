/*
 * A language model of your own, trained by the library's trainer (train/trainer.h): the program
 * says how to build the model, and the trainer does the rest as fsdp-train does: the YAML plan
 * (fully_shard units, tensor parallelism, HSDP, mixed precision), the data, evaluation, the
 * metrics file, checkpoints that resume under any plan, a stop at a signal or time limit.
 *
 *   mpirun -n 4 build/examples/tiny-lm examples/tiny_lm.yaml [--set key.path=value]...
 *
 * The model predicts each next byte from the current one: an embedding, two MLP blocks (each a
 * fully_shard unit, split by tensor parallelism in tiny_lm_tp.yaml), a LayerNorm and a head.
 */
#include "nn/layers.h"
#include "train/trainer.h"

enum { VOCAB = 256, DIM = 64, HIDDEN = 256, BLOCKS = 2 };

/* blocks.i: fc1 (DIM -> HIDDEN), GELU, fc2 (HIDDEN -> DIM). */
static fsdpc_status_t block(nn_module_t *blocks, int i, const nn_layer_options_t *lo) {
  char name[16];
  snprintf(name, sizeof name, "%d", i);
  nn_module_t *b;
  FSDPC_TRY(nn_sequential_new(blocks, name, &b));
  FSDPC_TRY(nn_linear_new(b, "fc1", DIM, HIDDEN, true, lo, NULL));
  FSDPC_TRY(nn_activation_new(b, "act", KERNEL_ACT_GELU, NULL));
  return nn_linear_new(b, "fc2", HIDDEN, DIM, true, lo, NULL);
}

/* The module tree the trainer asks for: token ids [B, T] -> logits [B, T, VOCAB]. Eager
 * parameters are initialised here (PyTorch's default rules, from the plan's model.seed); a
 * deferred build leaves them to the trainer, which gives each rank its shards first. */
static fsdpc_status_t build(void *self, const train_build_t *how, nn_module_t **root) {
  (void)self;
  nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;
  lo.device = how->device;
  lo.deferred = how->deferred;
  nn_module_t *m = NULL, *blocks = NULL;
  fsdpc_status_t st = nn_sequential_new(NULL, "", &m);
  if (st == STATUS_OK) st = nn_embedding_new(m, "embed", VOCAB, DIM, &lo, NULL);
  if (st == STATUS_OK) st = nn_sequential_new(m, "blocks", &blocks);
  for (int i = 0; i < BLOCKS && st == STATUS_OK; i++) st = block(blocks, i, &lo);
  if (st == STATUS_OK) st = nn_layernorm_new(m, "norm", DIM, 1e-5, true, &lo, NULL);
  if (st == STATUS_OK) st = nn_linear_new(m, "head", DIM, VOCAB, false, &lo, NULL);
  if (st == STATUS_OK) st = nn_module_finalize(m);
  if (st == STATUS_OK && !how->deferred) st = nn_module_reset_parameters(m, how->seed);
  if (st != STATUS_OK) {
    nn_module_free(m);
    return st;
  }
  *root = m;
  return STATUS_OK;
}

int main(int argc, char **argv) {
  train_model_t model = TRAIN_MODEL_INIT;
  model.name = "tiny-lm";
  model.vocab_size = VOCAB;
  model.build = build; /* init, describe and free: the trainer's defaults */
  return train_main(argc, argv, "tiny-lm", &model);
}
