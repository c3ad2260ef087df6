/* Small helpers shared by the benchmarks: option parsing, timing, one training micro-step. */
#ifndef FSDPC_BENCH_UTIL_H
#define FSDPC_BENCH_UTIL_H

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/world.h"
#include "models/llama/llama.h"
#include "nn/ops.h"
#include "train/data.h"
#include "train/train.h"

/* Prints the error and exits: benchmarks are programs, not library code. */
#define BENCH_TRY(expr)                                                            \
  do {                                                                             \
    fsdpc_status_t bench_st_ = (expr);                                             \
    if (bench_st_ != STATUS_OK) {                                                  \
      fprintf(stderr, "%s: %s: %s\n", #expr, status_str(bench_st_), err_detail()); \
      exit(1);                                                                     \
    }                                                                              \
  } while (0)

/* One option of a benchmark: "--name" taking a value (shown as metavar) or a flag (NULL). */
typedef struct bench_option {
  const char *name, *metavar, *help;
} bench_option_t;

/* The options bench_model reads, which every benchmark takes. */
#define BENCH_MODEL_OPTIONS                                                  \
  {"--config", "PATH", "the model's Hugging Face config.json"},              \
      {"--device", "cpu|cuda", "where the model runs (default cpu)"},       \
      {"--dtype", "f32|bf16|f16", "the parameters' dtype (default f32)"}, \
      {"--ac", NULL, "activation checkpointing"}

static inline const char *bench_prog(char **argv) {
  const char *slash = strrchr(argv[0], '/');
  return slash ? slash + 1 : argv[0];
}

/* Leaves with status rc after rank 0 printed (or every rank, for an error) what was said. */
static inline void bench_leave(int rc) {
  fflush(stdout);
  fflush(stderr);
  if (rc == 0) world_finalize();
  exit(rc);
}

static inline int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The k-th quartile of the n > 0 values x (k = 1, 2 or 3; 2: the median, the mean of the middle
 * two for even n); x keeps its order (paired timings stay paired). */
static inline double bench_quartile(const double *x, int n, int k) {
  double *v = malloc(sizeof *v * (size_t)n);
  if (v == NULL) bench_leave(1);
  memcpy(v, x, sizeof *v * (size_t)n);
  qsort(v, (size_t)n, sizeof *v, bench_cmp_double);
  double q = k == 2 && n % 2 == 0 ? 0.5 * (v[n / 2 - 1] + v[n / 2])
             : k == 2             ? v[n / 2]
                                  : v[(k * n) / 4];
  free(v);
  return q;
}

static inline double bench_median(const double *x, int n) { return bench_quartile(x, n, 2); }

/* Checks the command line against opts (ended by {NULL}): --help prints what the program
 * does and its options, --version the library's version, both exiting 0; an unknown option,
 * a missing value or a stray argument is an error on every rank (exit 2). Call it first,
 * after world_init. */
static inline void bench_args(int argc, char **argv, const char *what,
                              const bench_option_t *opts) {
  const char *prog = bench_prog(argv);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      if (world_rank() == 0) {
        printf("usage: %s [OPTION]...\n%s\n\n", prog, what);
        for (const bench_option_t *o = opts; o->name; o++)
          printf("  %s%s%-*s %s\n", o->name, o->metavar ? " " : "",
                 (int)(24 - strlen(o->name) - (o->metavar ? 1 : 0)), o->metavar ? o->metavar : "",
                 o->help);
        printf("  %-24s %s\n  %-24s %s\n", "--help", "this text", "--version",
               "the version");
      }
      bench_leave(0);
    }
    if (strcmp(a, "--version") == 0) {
      if (world_rank() == 0) printf("%s (fsdpc) %s\n", prog, fsdpc_version());
      bench_leave(0);
    }
    const bench_option_t *o = opts;
    while (o->name && strcmp(o->name, a) != 0) o++;
    if (o->name == NULL) {
      fprintf(stderr, "%s: %s '%s' (--help lists the options)\n", prog,
              a[0] == '-' ? "unknown option" : "unexpected argument", a);
      bench_leave(2);
    }
    if (o->metavar && ++i >= argc) {
      fprintf(stderr, "%s: %s needs a value (%s)\n", prog, a, o->metavar);
      bench_leave(2);
    }
  }
}

/* "--name value" lookup; returns def when absent. */
static inline const char *bench_opt(int argc, char **argv, const char *name, const char *def) {
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], name) == 0) return argv[i + 1];
  return def;
}

/* Integer option name, def when absent: the whole value must be a number in [lo, hi]. */
static inline int64_t bench_int(int argc, char **argv, const char *name, int64_t def, int64_t lo,
                                int64_t hi) {
  const char *v = bench_opt(argc, argv, name, NULL);
  if (v == NULL) return def;
  char *end;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno != 0 || end == v || *end != 0 || x < lo || x > hi) {
    fprintf(stderr, "%s: %s: expected an integer from %lld to %lld, got '%s'\n",
            bench_prog(argv), name, (long long)lo, (long long)hi, v);
    bench_leave(2);
  }
  return (int64_t)x;
}

/* Real option name, def when absent: the whole value must be a finite number > 0. */
static inline double bench_positive(int argc, char **argv, const char *name, double def) {
  const char *v = bench_opt(argc, argv, name, NULL);
  if (v == NULL) return def;
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno != 0 || end == v || *end != 0 || !isfinite(x) || x <= 0) {
    fprintf(stderr, "%s: %s: expected a positive number, got '%s'\n", bench_prog(argv), name, v);
    bench_leave(2);
  }
  return x;
}

static inline int bench_flag(int argc, char **argv, const char *name) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], name) == 0) return 1;
  return 0;
}

/* A tensor of dt on dev with values in [-1, 1) from a small LCG seeded with seed (the same
 * values on every device). */
static inline void bench_random(fsdpc_tensor_t *t, dtype_t dt, device_t dev, int ndim,
                                const int64_t *shape, uint64_t seed) {
  fsdpc_tensor_t h;
  BENCH_TRY(tensor_init(&h, DTYPE_F32, device_cpu(), ndim, shape));
  float *p = h.data;
  for (int64_t i = 0; i < tensor_numel(&h); i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = (float)((double)(seed >> 11) / 9007199254740992.0 * 2 - 1);
  }
  BENCH_TRY(tensor_clone(t, &h, dt, dev));
  tensor_free(&h);
}

/* flops per second as "X TFLOP/s", or "X GFLOP/s" below one TFLOP/s, into buf. */
static inline const char *bench_rate(double flops, char *buf, size_t n) {
  if (flops >= 1e12)
    snprintf(buf, n, "%.1f TFLOP/s", flops / 1e12);
  else
    snprintf(buf, n, "%.1f GFLOP/s", flops / 1e9);
  return buf;
}

/* A kernel benchmark's --device cpu|cuda (default cpu) and --dtype f32|bf16|f16 (default bf16
 * on cuda, f32 on cpu). Without a CUDA device it says there is nothing to time and leaves
 * with 0; bad values leave with 2. */
static inline device_t bench_device_dtype(int argc, char **argv, dtype_t *dt) {
  const char *prog = bench_prog(argv), *dev_s = bench_opt(argc, argv, "--device", "cpu");
  if (strcmp(dev_s, "cpu") != 0 && strcmp(dev_s, "cuda") != 0) {
    fprintf(stderr, "%s: --device: expected cpu or cuda, got '%s'\n", prog, dev_s);
    bench_leave(2);
  }
  bool cuda = strcmp(dev_s, "cuda") == 0;
  device_t dev = cuda ? device_cuda(0) : device_cpu();
  if (cuda && device_check(dev) != STATUS_OK) {
    printf("%s: no CUDA device (%s): nothing to time\n", prog, err_detail());
    bench_leave(0);
  }
  const char *dt_s = bench_opt(argc, argv, "--dtype", cuda ? "bf16" : "f32");
  if (dtype_parse(dt_s, dt) != STATUS_OK || !dtype_is_float(*dt)) {
    fprintf(stderr, "%s: --dtype: expected f32, bf16 or f16, got '%s'\n", prog, dt_s);
    bench_leave(2);
  }
  return dev;
}

/* The model config (--config, default def_config) and options (--device cpu|cuda,
 * --dtype f32|bf16|f16, --ac); the model is built deferred (bench_init after sharding). */
static inline void bench_model(int argc, char **argv, const char *def_config, llama_config_t *cfg,
                               llama_options_t *opt) {
  BENCH_TRY(llama_config_from_hf(bench_opt(argc, argv, "--config", def_config), cfg));
  *opt = (llama_options_t)LLAMA_OPTIONS_INIT;
  const char *dev = bench_opt(argc, argv, "--device", "cpu");
  if (strcmp(dev, "cpu") != 0 && strcmp(dev, "cuda") != 0) {
    fprintf(stderr, "%s: --device: expected cpu or cuda, got '%s'\n", bench_prog(argv), dev);
    bench_leave(2);
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
static inline double bench_fwd_bwd(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec,
                                   int64_t step, int64_t micro) {
  double loss;
  BENCH_TRY(llama_micro_step(m, d, spec, step, micro, &loss));
  return loss;
}

#endif
