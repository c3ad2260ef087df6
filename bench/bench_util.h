/* Small helpers shared by the benchmarks: option parsing, timing, one training micro-step. */
#ifndef FSDPC_BENCH_UTIL_H
#define FSDPC_BENCH_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nn/data.h"
#include "nn/llama.h"
#include "nn/ops.h"

/* Prints the error and exits: benchmarks are programs, not library code. */
#define BENCH_TRY(expr)                                                            \
  do {                                                                             \
    status_t bench_st_ = (expr);                                                   \
    if (bench_st_ != STATUS_OK) {                                                  \
      fprintf(stderr, "%s: %s: %s\n", #expr, status_str(bench_st_), err_detail()); \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

static inline double bench_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* "--name value" lookup; returns def when absent. */
static inline const char *bench_opt(int argc, char **argv, const char *name, const char *def) {
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

static inline int bench_flag(int argc, char **argv, const char *name) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], name) == 0) return 1;
  return 0;
}

/* The model config (--config, default def_config) and options (--device cpu|cuda,
 * --dtype f32|bf16|f16, --ac). */
static inline void bench_model(int argc, char **argv, const char *def_config, llama_config_t *cfg,
                               llama_options_t *opt) {
  BENCH_TRY(llama_config_from_hf(bench_opt(argc, argv, "--config", def_config), cfg));
  *opt = (llama_options_t)LLAMA_OPTIONS_INIT;
  const char *dev = bench_opt(argc, argv, "--device", "cpu");
  if (strcmp(dev, "cpu") != 0 && strcmp(dev, "cuda") != 0) {
    fprintf(stderr, "--device must be cpu or cuda, got '%s'\n", dev);
    exit(2);
  }
  opt->device = strcmp(dev, "cuda") == 0 ? DEVICE_CUDA : DEVICE_CPU;
  BENCH_TRY(dtype_parse(bench_opt(argc, argv, "--dtype", "f32"), &opt->dtype));
  opt->activation_checkpointing = bench_flag(argc, argv, "--ac");
}

/* Forward, loss and backward of one micro-batch; returns the loss. */
static inline double bench_fwd_bwd(nn_ctx_t *ctx, llama_t *m, const data_t *d,
                                   const data_spec_t *spec, int64_t step, int64_t micro) {
  tensor_t in_h, tg_h, in, tg;
  BENCH_TRY(data_batch(d, spec, step, micro, &in_h, &tg_h));
  device_t dev = mesh_device(llama_local_mesh(m));
  BENCH_TRY(tensor_clone(&in, &in_h, DTYPE_I64, dev));
  BENCH_TRY(tensor_clone(&tg, &tg_h, DTYPE_I64, dev));
  nn_var_t *ids, *logits, *loss, *scaled;
  BENCH_TRY(nn_var_new(&ids, &in, false));
  BENCH_TRY(nn_call(ctx, llama_module(m), ids, &logits));
  BENCH_TRY(nn_cross_entropy(ctx, logits, &tg, &loss, NULL));
  double value;
  BENCH_TRY(nn_var_scalar(loss, &value));
  BENCH_TRY(nn_scale(ctx, loss, 1.0 / (double)spec->grad_accum, &scaled));
  BENCH_TRY(nn_backward(ctx, scaled));
  nn_var_put(scaled);
  nn_var_put(loss);
  nn_var_put(logits);
  nn_var_put(ids);
  tensor_free(&tg);
  tensor_free(&in_h);
  tensor_free(&tg_h);
  return value;
}

#endif
