/*
 * The C model's logits for a Hugging Face folder (config.json + model.safetensors), for the
 * tests that compare them with independent implementations:
 *   hf_logits HFDIR ID...        prints {"logits": [[...V floats...] per position]}
 */
#include <stdio.h>
#include <stdlib.h>

#include "checkpoint/hf_weights.h"
#include "mesh/world.h"
#include "models/llama/llama.h"

static fsdpc_status_t run(const char *dir, int n, char **ids) {
  char path[4200];
  llama_config_t cfg;
  snprintf(path, sizeof path, "%.4000s/config.json", dir);
  FSDPC_TRY(llama_config_from_hf(path, &cfg));
  llama_t *m;
  FSDPC_TRY(llama_new(&cfg, NULL, &m));
  snprintf(path, sizeof path, "%.4000s/model.safetensors", dir);
  fsdpc_status_t st = ckpt_load_weights(llama_module(m), path);
  int64_t shape[2] = {1, n};
  fsdpc_tensor_t t = {0};
  nn_ctx_t *ctx = NULL;
  nn_var_t *in = NULL, *out = NULL;
  if (st == STATUS_OK) st = tensor_init(&t, DTYPE_I64, device_cpu(), 2, shape);
  for (int i = 0; st == STATUS_OK && i < n; i++) ((int64_t *)t.data)[i] = atoll(ids[i]);
  if (st == STATUS_OK) st = nn_var_new(&t, false, &in);
  if (st == STATUS_OK) st = nn_ctx_new(&ctx);
  if (st == STATUS_OK) nn_ctx_set_grad_enabled(ctx, false);
  if (st == STATUS_OK) st = nn_call(ctx, llama_module(m), in, &out);
  if (st == STATUS_OK) {
    fsdpc_tensor_t h;
    st = tensor_clone(&h, &out->value, DTYPE_F32, device_cpu());
    if (st == STATUS_OK) {
      int64_t V = h.shape[2];
      printf("{\"logits\": [");
      for (int i = 0; i < n; i++) {
        printf("%s[", i ? ", " : "");
        for (int64_t v = 0; v < V; v++)
          printf("%s%.9g", v ? ", " : "", (double)((float *)h.data)[i * V + v]);
        printf("]");
      }
      printf("]}\n");
      tensor_free(&h);
    }
  }
  nn_var_put(out);
  nn_var_put(in);
  nn_ctx_free(ctx);
  llama_free(m);
  return st;
}

int main(int argc, char **argv) {
  if (world_init(&argc, &argv) != STATUS_OK || argc < 3) {
    fprintf(stderr, "usage: hf_logits HFDIR ID...\n");
    return 2;
  }
  fsdpc_status_t st = run(argv[1], argc - 2, argv + 2);
  if (st != STATUS_OK) fprintf(stderr, "hf_logits: %s\n", err_detail());
  world_finalize();
  return st == STATUS_OK ? 0 : 1;
}
