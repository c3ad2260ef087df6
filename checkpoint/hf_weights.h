/*
 * Full model weights in one safetensors file, by Hugging Face parameter name (the FQN).
 *
 *   TRY(ckpt_load_weights(llama_module(model), "model.safetensors"));
 *   TRY(ckpt_save_weights(llama_module(model), "out.safetensors"));
 *
 * Loading reads, for every parameter, only the box its local shard covers, converting the
 * stored dtype to the parameter's; like torch's strict load_state_dict, a missing or an
 * unexpected tensor or a shape mismatch is an error naming the file and the tensor. Saving
 * writes each parameter whole: every parameter must be fully present on this rank
 * (Replicate on every mesh dimension). Neither is collective.
 */
#ifndef FSDPC_CHECKPOINT_HF_WEIGHTS_H
#define FSDPC_CHECKPOINT_HF_WEIGHTS_H

#include "nn/module.h"

#ifdef __cplusplus
extern "C" {
#endif

status_t ckpt_load_weights(nn_module_t *root, const char *path);
status_t ckpt_save_weights(nn_module_t *root, const char *path);

#ifdef __cplusplus
}
#endif

#endif
