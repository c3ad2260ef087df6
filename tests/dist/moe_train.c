/*
 * A next-byte model with a mixture-of-experts block (nn_moe_new), trained by train_main under
 * the plan given on the command line: an embedding, the MoE block (4 experts, top-2,
 * renormalised), a LayerNorm and a head. test_moe_train.py runs it under several plans. With
 * --sigmoid first, DeepSeek-V3's routing: sigmoid scores scaled by 2, and an expert bias moved
 * by 0.01 after every step.
 *
 *   mpirun -n 4 build/tests/moe-train [--sigmoid] PLAN.yaml [--set key.path=value]...
 */
#include <string.h>

#include "nn/moe.h"
#include "train/trainer.h"

enum { VOCAB = 256, DIM = 32, FFN = 64, EXPERTS = 4, TOP_K = 2 };

static fsdpc_status_t build(void *self, const train_build_t *how, nn_module_t **root) {
  const bool *sigmoid = self;
  nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;
  lo.device = how->device;
  lo.deferred = how->deferred;
  nn_module_t *m = NULL;
  fsdpc_status_t st = nn_sequential_new(NULL, "", &m);
  if (st == STATUS_OK) st = nn_embedding_new(m, "embed", VOCAB, DIM, &lo, NULL);
  nn_module_t *moe = NULL;
  if (st == STATUS_OK) st = nn_moe_new(m, "moe", DIM, FFN, EXPERTS, TOP_K, true, &lo, &moe);
  if (st == STATUS_OK && *sigmoid) st = nn_moe_set_routing(moe, NN_MOE_SIGMOID, 2.0, 0.01);
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
  bool sigmoid = argc > 1 && strcmp(argv[1], "--sigmoid") == 0;
  if (sigmoid) { /* the rest as train_main takes it */
    argv[1] = argv[0];
    argv++;
    argc--;
  }
  train_model_t model = TRAIN_MODEL_INIT;
  model.self = &sigmoid;
  model.name = "moe-lm";
  model.vocab_size = VOCAB;
  model.build = build;
  return train_main(argc, argv, "moe-train", &model);
}
