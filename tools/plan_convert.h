/* fsdp-plan convert's translation of an Accelerate or DeepSpeed config (as a cJSON tree whose
 * scalars may be strings) into plan keys by section. */
#ifndef FSDPC_TOOLS_PLAN_CONVERT_H
#define FSDPC_TOOLS_PLAN_CONVERT_H

#include <cJSON.h>
#include <stdbool.h>
#include <stddef.h>

#include "core/status.h"

/* plan keys by section, each with the setting it came from; and the settings left out, why */
enum { MAX_KEYS = 64 };
typedef struct entry {
  char section[40], key[96], value[96], from[320];
} entry_t;

typedef struct out {
  entry_t keys[MAX_KEYS], left[MAX_KEYS];
  entry_t bad[MAX_KEYS]; /* settings whose values their own tool refuses (stage 5, "x" ranks) */
  int n_keys, n_left, n_bad;
} out_t;

/* A setting as text ("true", "3", "bf16"), whatever its JSON type; NULL when absent. */
const char *plan_text_of(const cJSON *it, char *buf, size_t n);
/* Fills o from config c (read from path); kind receives what c is ("a DeepSpeed config", ...).
 * Fails, naming path, on a config that is neither or has a section of the wrong type. */
fsdpc_status_t plan_convert(const cJSON *c, const char *path, out_t *o, char *kind, size_t n);

#endif
