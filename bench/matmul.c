/*
 * The matrix products of a Llama training step, one shape at a time: for each linear layer
 * (weight [out, in]) over N tokens, the forward y = x W^T, the input gradient dx = dy W and the
 * weight gradient dW = dy^T x. On CUDA each product runs through cuBLASLt and through
 * cublasGemmEx in alternate repetitions (kernel_matmul_set_lt), and the table sets their median
 * times side by side; on the CPU it times OpenBLAS. The last lines weigh every shape by how
 * often a step runs it (layers, and k/v and gate/up twice) and print one JSON line for scripts.
 *
 *   bench-matmul [--config configs/llama-100m.json] [--device cpu|cuda]
 *                [--dtype f32|bf16|f16] [--tokens N] [--reps 20]
 */
#include "base/kernels.h"
#include "bench/bench_util.h"

static const bench_option_t OPTIONS[] = {
    {"--config", "PATH", "the model's Hugging Face config.json (default configs/llama-100m.json)"},
    {"--device", "cpu|cuda", "where it runs (default cpu)"},
    {"--dtype", "f32|bf16|f16", "operands (default bf16 on cuda, f32 on cpu)"},
    {"--tokens", "N", "tokens per step (default 8192 on cuda, 512 on cpu)"},
    {"--reps", "N", "timed repetitions of each product and path (default 20)"},
    {NULL, NULL, NULL}};

typedef struct layer {
  const char *name;
  int64_t out, in, per_step; /* how many linears of this shape a step runs */
} layer_t;

static void rnd(tensor_t *t, dtype_t dt, device_t dev, int64_t rows, int64_t cols, uint64_t seed) {
  int64_t shape[2] = {rows, cols};
  tensor_t h;
  BENCH_TRY(tensor_init(&h, DTYPE_F32, device_cpu(), 2, shape));
  float *p = h.data;
  for (int64_t i = 0; i < rows * cols; i++) { /* a small LCG: inputs in [-1, 1) */
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = (float)((double)(seed >> 11) / 9007199254740992.0 * 2 - 1);
  }
  BENCH_TRY(tensor_clone(t, &h, dt, dev));
  tensor_free(&h);
}

/* Median seconds of one product, per path (paths: 2 on CUDA, cuBLASLt then cublasGemmEx,
 * taken in turn; 1 on the CPU). */
static void time_product(device_t dev, int paths, int reps, double *times, double *med,
                         tensor_t *out, const tensor_t *a, bool ta, const tensor_t *b, bool tb) {
  for (int r = -2; r < reps; r++) /* two warm-up rounds */
    for (int p = 0; p < paths; p++) {
      if (paths == 2) kernel_matmul_set_lt(p == 0);
      BENCH_TRY(device_stream_sync(dev));
      double t0 = bench_now();
      BENCH_TRY(kernel_matmul(out, a, ta, b, tb, 1.0f, 0.0f));
      BENCH_TRY(device_stream_sync(dev));
      if (r >= 0) times[p * reps + r] = bench_now() - t0;
    }
  kernel_matmul_set_lt(true);
  for (int p = 0; p < paths; p++) med[p] = bench_median(times + p * reps, reps);
}

static double tflops(double flop, double s) { return s > 0 ? flop / s / 1e12 : 0; }

/* "T ms R", R in TFLOP/s, or GFLOP/s below one TFLOP/s. */
static const char *cell(double flop, double s, char *buf, size_t n) {
  double r = tflops(flop, s);
  if (r >= 1)
    snprintf(buf, n, "%.3f ms %6.1f TF/s", 1e3 * s, r);
  else
    snprintf(buf, n, "%.3f ms %6.1f GF/s", 1e3 * s, 1e3 * r);
  return buf;
}

int main(int argc, char **argv) {
  if (world_init(&argc, &argv) != STATUS_OK) {
    fprintf(stderr, "bench-matmul: %s\n", err_detail());
    return 1;
  }
  bench_args(argc, argv, "Times the matrix products of a Llama step, shape by shape.", OPTIONS);
  dtype_t dt;
  device_t dev = bench_device_dtype(argc, argv, &dt);
  bool cuda = dev.type == DEVICE_CUDA;
  llama_config_t c;
  BENCH_TRY(llama_config_from_hf(
      bench_opt(argc, argv, "--config", SOURCE_ROOT "/configs/llama-100m.json"), &c));
  int64_t N = bench_int(argc, argv, "--tokens", cuda ? 8192 : 512, 1, 1 << 24);
  int reps = (int)bench_int(argc, argv, "--reps", 20, 1, 100000);
  int paths = cuda ? 2 : 1;
  int64_t Dh = c.dim / c.n_heads, L = c.n_layers;
  layer_t layers[] = {
      {"q, o", c.dim, c.dim, 2 * L},         {"k, v", c.n_kv_heads * Dh, c.dim, 2 * L},
      {"gate, up", c.ffn_dim, c.dim, 2 * L}, {"down", c.dim, c.ffn_dim, L},
      {"lm head", c.vocab_size, c.dim, 1},
  };
  static const char *kinds[3] = {"forward", "input grad", "weight grad"};
  double *times = calloc((size_t)(2 * reps), sizeof(double));
  if (times == NULL) bench_leave(1);
  double step[2] = {0, 0}, step_flop = 0;
  printf("matrix products of %s over %lld tokens, %s on %s, median of %d\n", "a Llama step",
         (long long)N, dtype_name(dt), cuda ? "cuda" : "cpu", reps);
  if (cuda)
    printf("%-10s %-11s %16s %22s %22s %7s\n", "linear", "product", "m x n x k", "cuBLASLt",
           "cublasGemmEx", "Lt x");
  else
    printf("%-10s %-11s %16s %22s\n", "linear", "product", "m x n x k", "OpenBLAS");
  for (size_t i = 0; i < sizeof layers / sizeof layers[0]; i++) {
    const layer_t *l = &layers[i];
    tensor_t x, w, dy, y, dx, dw;
    rnd(&x, dt, dev, N, l->in, 1);
    rnd(&w, dt, dev, l->out, l->in, 2);
    rnd(&dy, dt, dev, N, l->out, 3);
    int64_t sy[2] = {N, l->out}, sx[2] = {N, l->in}, sw[2] = {l->out, l->in};
    BENCH_TRY(tensor_init(&y, dt, dev, 2, sy));
    BENCH_TRY(tensor_init(&dx, dt, dev, 2, sx));
    BENCH_TRY(tensor_init(&dw, dt, dev, 2, sw));
    double flop = 2.0 * (double)N * (double)l->out * (double)l->in;
    for (int kind = 0; kind < 3; kind++) {
      double med[2];
      int64_t m = kind == 2 ? l->out : N, n = kind == 0 ? l->out : l->in;
      int64_t k = kind == 0 ? l->in : kind == 1 ? l->out : N;
      if (kind == 0) time_product(dev, paths, reps, times, med, &y, &x, false, &w, true);
      if (kind == 1) time_product(dev, paths, reps, times, med, &dx, &dy, false, &w, false);
      if (kind == 2) time_product(dev, paths, reps, times, med, &dw, &dy, true, &x, false);
      char dims[48], col[2][32];
      snprintf(dims, sizeof dims, "%lldx%lldx%lld", (long long)m, (long long)n, (long long)k);
      for (int p = 0; p < paths; p++) {
        cell(flop, med[p], col[p], sizeof col[p]);
        step[p] += (double)l->per_step * med[p];
      }
      step_flop += (double)l->per_step * flop;
      if (cuda)
        printf("%-10s %-11s %16s %22s %22s %6.2fx\n", l->name, kinds[kind], dims, col[0], col[1],
               med[1] / med[0]);
      else
        printf("%-10s %-11s %16s %22s\n", l->name, kinds[kind], dims, col[0]);
    }
    tensor_t *all[] = {&x, &w, &dy, &y, &dx, &dw};
    for (size_t j = 0; j < sizeof all / sizeof all[0]; j++) tensor_free(all[j]);
  }
  if (cuda) {
    printf(
        "a step's products: cuBLASLt %.2f ms (%.1f TFLOP/s), cublasGemmEx %.2f ms (%.1f "
        "TFLOP/s): cuBLASLt %.2fx as fast\n",
        1e3 * step[0], tflops(step_flop, step[0]), 1e3 * step[1], tflops(step_flop, step[1]),
        step[1] / step[0]);
    if (kernel_matmul_lt_runs() == 0)
      printf("cuBLASLt ran no product: %s\n", kernel_matmul_lt_note());
    printf("{\"cublaslt_ms\": %.6f, \"gemmex_ms\": %.6f, \"tflop\": %.6f}\n", 1e3 * step[0],
           1e3 * step[1], step_flop / 1e12);
  } else {
    printf("a step's products: %.2f ms (%.1f GFLOP/s)\n", 1e3 * step[0], step_flop / step[0] / 1e9);
    printf("{\"openblas_ms\": %.6f, \"tflop\": %.6f}\n", 1e3 * step[0], step_flop / 1e12);
  }
  free(times);
  world_finalize();
  return 0;
}
