/*
 * Full model weights in safetensors files, by Hugging Face parameter name (the FQN): one
 * file, or a Hugging Face folder (model.safetensors, or the files its
 * model.safetensors.index.json names).
 *
 *   FSDPC_TRY(ckpt_load_weights(llama_module(model), "model.safetensors"));
 *   FSDPC_TRY(ckpt_load_hf(llama_module(model), "path/to/Llama-3.2-1B"));
 *   FSDPC_TRY(ckpt_save_weights(llama_module(model), "out.safetensors"));
 *
 * Loading reads, for every parameter, only the box its local shard covers, converting the
 * stored dtype to the parameter's; like torch's strict load_state_dict, a missing or an
 * unexpected tensor or a shape mismatch is an error naming the file and the tensor; a
 * parameter without memory (meta: another pipeline stage's) is checked present, not read. Saving
 * writes each parameter whole: every parameter must be fully present on this rank
 * (Replicate on every mesh dimension). Neither is collective. Stacked experts are read and
 * written per expert, as Hugging Face names them (hf_expert_name below).
 */
#ifndef FSDPC_CHECKPOINT_HF_WEIGHTS_H
#define FSDPC_CHECKPOINT_HF_WEIGHTS_H

#include "nn/module.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

fsdpc_status_t ckpt_load_weights(nn_module_t *root, const char *path);

/* ckpt_load_weights over a Hugging Face folder's weight files: every parameter must be in
 * exactly one of them, and every tensor of them must be a parameter. */
fsdpc_status_t ckpt_load_hf(nn_module_t *root, const char *dir);

/* ckpt_load_hf where a parameter for which padded(fqn) is true may have more rows (its first
 * dimension; the others equal) than the files' tensor: the files' rows fill the first ones,
 * the rest are zero (a vocabulary padded for speed or for an even split). padded NULL: none. */
fsdpc_status_t ckpt_load_hf_padded(nn_module_t *root, const char *dir,
                                   bool (*padded)(const char *fqn));

/* How a folder's files may name the model's parameters otherwise (transformers'
 * base_model_prefix and ignored keys). canonical writes the model's name for a file's tensor
 * name into buf and returns true, or returns false for a tensor that is no parameter and is
 * skipped (a buffer saved beside them); NULL: the files use the model's names. padded as for
 * ckpt_load_hf_padded. */
typedef struct hf_load_opts {
  bool (*padded)(const char *fqn);
  bool (*canonical)(const char *name, char *buf, size_t size, const void *user);
  const void *user;
} hf_load_opts_t;
fsdpc_status_t ckpt_load_hf_with(nn_module_t *root, const char *dir, const hf_load_opts_t *o);

/* The weight files of a Hugging Face folder: model.safetensors, else those its index names
 * (each once, in order of first appearance), as transformers chooses. *names (file names, not
 * paths) is freed with hf_weight_files_free. */
fsdpc_status_t hf_weight_files(const char *dir, char ***names, int *n);
void hf_weight_files_free(char **names, int n);
fsdpc_status_t ckpt_save_weights(nn_module_t *root, const char *path);

/* Hugging Face's files keep a mixture of experts' weights one tensor per expert where the
 * model stacks them (nn/moe.h): the parameter P.experts.N [E, a, b] is P.experts.J.N.weight
 * [a, b] there, J = 0..E-1 (Qwen3-MoE's names). The loads above read either form; saving and
 * fsdp-ckpt export-hf write Hugging Face's. hf_expert_name writes expert j's name for the
 * stacked parameter fqn into buf (false when fqn is no P.experts.N, j is negative or the name
 * does not fit); hf_expert_of parses such a name back into the stacked one and j (false when
 * name is not one). */
bool hf_expert_name(const char *fqn, int64_t j, char *buf, size_t size);
bool hf_expert_of(const char *name, char *fqn, size_t size, int64_t *j);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
