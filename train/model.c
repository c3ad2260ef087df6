/* The plan's built-in architectures (Llama, Qwen2, Qwen3, GPT-2: the plan's model section) as
 * the trainer's train_model_t, and the program's name in the trainer's messages. */
#include <stdlib.h>

#include "models/llama/llama.h"
#include "train/hf_convert_impl.h"
#include "train/run_impl.h"

static const char *prog = "fsdp-train";

const char *train_prog(void) { return prog; }

void train_set_prog(const char *name) { prog = name != NULL && name[0] ? name : "fsdp-train"; }

/* Eager: whole parameters, initialised from model.seed unless model.init_from fills them. */
static fsdpc_status_t builtin_build(void *self, const train_build_t *how, nn_module_t **root) {
  run_t *r = self;
  llama_options_t lo = LLAMA_OPTIONS_INIT;
  lo.device = how->device;
  lo.activation_checkpointing = how->activation_checkpointing;
  lo.deferred = how->deferred;
  FSDPC_TRY(llama_new(&r->plan.model, &lo, &r->llama));
  *root = llama_module(r->llama);
  if (how->deferred || r->plan.init_from[0]) return STATUS_OK;
  return llama_init_weights(r->llama, how->seed);
}

static fsdpc_status_t builtin_init(void *self, nn_module_t *root, uint64_t seed) {
  (void)root;
  return llama_init_weights(((run_t *)self)->llama, seed);
}

/* The model as a Hugging Face config.json, in the parameters' dtype. */
static fsdpc_status_t builtin_describe(void *self, char **json) {
  run_t *r = self;
  dtype_t dt = r->n > 0 ? dtensor_local(r->ps[0]->value)->dtype : DTYPE_F32;
  FSDPC_TRY(llama_config_to_hf_text(&r->plan.model, dt, json));
  /* the keys of the config it came from that the model does not read (the tokens' ids) */
  fsdpc_status_t st = hf_config_carry(json, r->carried);
  if (st != STATUS_OK) {
    free(*json);
    *json = NULL;
  }
  return st;
}

static void builtin_free(void *self, nn_module_t *root) {
  (void)root;
  run_t *r = self;
  llama_free(r->llama);
  r->llama = NULL;
}

train_model_t train_builtin_model(run_t *r) {
  train_model_t m = TRAIN_MODEL_INIT;
  m.name = llama_arch_name(r->plan.model.arch);
  m.vocab_size = r->plan.model.vocab_size;
  m.self = r;
  m.build = builtin_build;
  m.init = builtin_init;
  m.describe = builtin_describe;
  m.free = builtin_free;
  return m;
}
