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
#include "nn/train.h"

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
 * --dtype f32|bf16|f16, --ac); the model is built deferred (bench_init after sharding). */
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
  opt->deferred = true;
}

/* Deferred initialisation's second half: memory for this rank's shards, then the init. */
static inline void bench_init(llama_t *m, uint64_t seed) {
  BENCH_TRY(nn_module_materialize(llama_module(m)));
  BENCH_TRY(llama_init_weights(m, seed));
}

/* Forward, loss and backward of one micro-batch; returns the loss. */
static inline double bench_fwd_bwd(llama_t *m, const data_t *d, const data_spec_t *spec,
                                   int64_t step, int64_t micro) {
  double loss;
  BENCH_TRY(llama_micro_step(m, d, spec, step, micro, &loss));
  return loss;
}

#endif
