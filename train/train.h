/*
 * One training micro-step of a language model (a module whose forward maps token ids [B, T] to
 * logits [B, T, vocab]; the Llama's by its own name): the batch of (step, micro) onto the model's
 * device, forward, mean token cross-entropy, backward of loss / grad_accum. Gradients accumulate
 * into the parameters (or, under fully_shard, are reduced by its hooks). And one evaluation batch:
 * the same forward and loss without gradients.
 */
#ifndef FSDPC_NN_TRAIN_H
#define FSDPC_NN_TRAIN_H

#include "models/llama/llama.h"
#include "train/data.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* *loss receives the mean loss over this rank's tokens of the micro-batch (unscaled). */
fsdpc_status_t llama_micro_step(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec,
                                int64_t step, int64_t micro, double *loss);

/* The same micro-step with its loss left where it was computed: *loss becomes a one-element
 * F32 tensor on the model's device (the caller frees it), read when the caller chooses. On a
 * GPU the micro-step makes no host wait: the batch is uploaded without one, the loss and its
 * gradient stay on the device, and the kernels' index checks are looked at by the next wait
 * (a bad token id then fails that wait, naming the kernel). */
fsdpc_status_t llama_micro_step_async(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec,
                                      int64_t step, int64_t micro, fsdpc_tensor_t *loss);

/* *value: the one-element loss tensor of llama_micro_step_async, read on the host (a wait on a
 * GPU); the tensor is freed either way. Local. */
fsdpc_status_t llama_loss_read(fsdpc_tensor_t *loss, double *value);

/* *loss receives the mean loss over this rank's tokens of evaluation batch b of d (the samples
 * step b would train on with grad_accum 1): a forward that records nothing and computes no
 * gradient. Under fully_shard each unit gathers and reshards as in training, the root keeps
 * its parameters gathered as after a training forward (fsdp_reshard releases them). */
fsdpc_status_t llama_eval_batch(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec,
                                int64_t b, double *loss);

/* The micro-step and the evaluation batch of any language model: root's forward on the batch
 * uploaded to dev (its parameters' device), as llama_micro_step_async and llama_eval_batch. */
fsdpc_status_t train_micro_step_async(nn_module_t *root, device_t dev, const fsdpc_data_t *d,
                                      const data_spec_t *spec, int64_t step, int64_t micro,
                                      fsdpc_tensor_t *loss);
fsdpc_status_t train_eval_batch(nn_module_t *root, device_t dev, const fsdpc_data_t *d,
                                const data_spec_t *spec, int64_t b, double *loss);
/* train_eval_batch on a batch read beforehand (data_batch's ids and targets, on the host): a
 * caller may first agree over the ranks that each could read its batch, so that a file cut
 * short fails every rank alike, before the forward's collectives. */
fsdpc_status_t train_eval_batch_on(nn_module_t *root, device_t dev, const fsdpc_tensor_t *ids,
                                   const fsdpc_tensor_t *targets, double *loss);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
