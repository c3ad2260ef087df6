/*
 * One training micro-step of the Llama: the batch of (step, micro) onto the model's device,
 * forward, mean token cross-entropy, backward of loss / grad_accum. Gradients accumulate into
 * the parameters (or, under fully_shard, are reduced by its hooks).
 */
#ifndef FSDPC_NN_TRAIN_H
#define FSDPC_NN_TRAIN_H

#include "nn/data.h"
#include "nn/llama.h"

#ifdef __cplusplus
extern "C" {
#endif

/* *loss receives the mean loss over this rank's tokens of the micro-batch (unscaled). */
status_t llama_micro_step(llama_t *m, const data_t *d, const data_spec_t *spec, int64_t step,
                          int64_t micro, double *loss);

#ifdef __cplusplus
}
#endif

#endif
