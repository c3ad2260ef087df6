/*
 * Hugging Face folders from and to training checkpoints, for a model of any architecture:
 * tensor names, dtypes and shapes come from the files; only the built-in Llama's config.json
 * (model_type "llama") is checked and written in its normal form, any other model's is carried
 * through as it is.
 *
 *   hf_export_opts_t o = HF_EXPORT_OPTS_INIT;
 *   o.dtype = DTYPE_BF16;
 *   FSDPC_TRY(ckpt_export_hf("ck/step-00000100", "hf-out", &o, NULL));
 *   FSDPC_TRY(ckpt_import_hf("Llama-3.2-1B", "ck-imported", NULL));   // checkpoint.load resumes it
 *
 * Both write OUT.tmp and rename it to OUT when complete: a failure leaves no OUT. Local.
 */
#ifndef FSDPC_CHECKPOINT_HF_CONVERT_H
#define FSDPC_CHECKPOINT_HF_CONVERT_H

#include <stdbool.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

typedef struct hf_export_opts {
  dtype_t dtype;            /* the dtype written; DTYPE_COUNT: as stored */
  uint64_t max_shard_bytes; /* one file up to this, then numbered files and an index */
  const char *config;       /* a config.json to write; NULL: the one the checkpoint records */
} hf_export_opts_t;

#define HF_EXPORT_OPTS_INIT {.dtype = DTYPE_COUNT, .max_shard_bytes = 5000000000ull, .config = NULL}

/* What a conversion did. */
typedef struct hf_report {
  int tensors, files;
  uint64_t bytes;  /* of tensor data written (export) or found (import) */
  bool unchecked;  /* the source carries no checksums: what was read is unchecked */
  bool unquantized; /* export: the config's quantization_config left out (the tensors are not) */
} hf_report_t;

/* Writes the model of checkpoint dir (a training checkpoint's model/, or a folder of shard
 * files) as a Hugging Face folder out (which must not exist, or be empty): model.safetensors,
 * or model-0000k-of-0000n.safetensors with model.safetensors.index.json past max_shard_bytes,
 * each with format "pt" and tensors in natural name order (layers.2 before layers.10), and
 * config.json with torch_dtype set. One tensor is assembled at a time, every block read
 * checked. report may be NULL. */
fsdpc_status_t ckpt_export_hf(const char *dir, const char *out, const hf_export_opts_t *o,
                              hf_report_t *report);

/* Makes a weights-only training checkpoint out (step 0, no optimizer state) of the Hugging
 * Face folder hf (config.json and model.safetensors or the files its index names, validated
 * and copied); its config.json is recorded as the checkpoint's model config. report may be
 * NULL. */
fsdpc_status_t ckpt_import_hf(const char *hf, const char *out, hf_report_t *report);

/* The Hugging Face config a training checkpoint records (train_state.json's
 * saved_under.model) as JSON text into *out (the caller frees it; NULL when none is
 * recorded or dir is not a training checkpoint). */
fsdpc_status_t ckpt_recorded_config(const char *dir, char **out);

/* Whether a Hugging Face config (JSON text) is of the built-in family whose files are checked
 * and rewritten on import: model_type "llama", "qwen2" or "qwen3". */
bool hf_config_is_llama(const char *json);
/* Whether it is of an architecture fsdp-train builds (those and "gpt2"). */
bool hf_config_is_family(const char *json);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
