/* What train/ shares of the Hugging Face conversions (private to train/). */
#ifndef FSDPC_TRAIN_HF_CONVERT_IMPL_H
#define FSDPC_TRAIN_HF_CONVERT_IMPL_H

#include <cJSON.h>

#include "core/status.h"

/* The keys of a Hugging Face config `source` that the normal form *text (written from the
 * model's config) lacks, added to it: the tokens' ids, sliding_window, transformers_version
 * and whatever else transformers keeps and the model here does not read. The dtype keys and
 * the rotary embedding's sections stay the normal form's alone; the dropout rates (which the
 * model here never applies) are the source's. *text is replaced (freed and written anew); a
 * source that is not a JSON object leaves it. */
fsdpc_status_t hf_config_carry(char **text, const cJSON *source);

/* The dropout rates a Hugging Face config may give (NULL-terminated): training here applies
 * none; the run's header names those above 0, and hf_config_carry keeps the source's. */
extern const char *const hf_dropout_keys[];

#endif
