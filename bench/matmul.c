/*
 * The matrix products of a training step of the Llama family, one shape at a time: for each
 * linear layer (weight [out, in]) over N tokens, the forward y = x W^T, the input gradient
 * dx = dy W and the weight gradient dW = dy^T x; GPT-2's Conv1D layers (weight [in, out]) as
 * it runs them, y = x W, dx = dy W^T, dW = x^T dy. On CUDA each product runs through cuBLASLt and
 * through cublasGemmEx in alternate repetitions (kernel_matmul_set_lt), and the table sets their
 * median times side by side; on the CPU it times OpenBLAS. The last lines weigh every shape by how
 * often a step runs it (layers, and Llama's k/v and gate/up twice) and print one JSON line for
 * scripts. With experts (Qwen3-MoE, Qwen2-MoE, Mixtral), the dense MLP rows count the dense
 * layers only, and a last table times one layer's experts' products (gate's shape, the tokens
 * spread evenly) made one call an expert against one grouped call (kernel_matmul_many).
 *
 *   bench-matmul [--config configs/llama-100m.json] [--device cpu|cuda]
 *                [--dtype f32|bf16|f16] [--tokens N] [--reps 20]
 */
#include "core/kernels.h"
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
  bool io;                   /* weight [in, out] (GPT-2's Conv1D) rather than [out, in] */
} layer_t;

/* Median seconds of one product, per path (paths: 2 on CUDA, cuBLASLt then cublasGemmEx,
 * taken in turn; 1 on the CPU). */
static void time_product(device_t dev, int paths, int reps, double *times, double *med,
                         fsdpc_tensor_t *out, const fsdpc_tensor_t *a, bool ta,
                         const fsdpc_tensor_t *b, bool tb) {
  for (int r = -2; r < reps; r++) /* two warm-up rounds */
    for (int p = 0; p < paths; p++) {
      if (paths == 2) kernel_matmul_set_lt(p == 0);
      BENCH_TRY(device_stream_sync(dev));
      double t0 = device_clock_seconds();
      BENCH_TRY(kernel_matmul(out, a, ta, b, tb, 1.0f, 0.0f));
      BENCH_TRY(device_stream_sync(dev));
      if (r >= 0) times[p * reps + r] = device_clock_seconds() - t0;
    }
  kernel_matmul_set_lt(true);
  for (int p = 0; p < paths; p++) med[p] = bench_median(times + p * reps, reps);
}

static double tflops(double flop, double s) { return s > 0 ? flop / s / 1e12 : 0; }

/* "T ms R": the time and the rate of flop in it. */
static const char *cell(double flop, double s, char *buf, size_t n) {
  char r[32];
  snprintf(buf, n, "%.3f ms %s", 1e3 * s, bench_rate(flop / s, r, sizeof r));
  return buf;
}

/* A product's operands: x [sx], w (ndim_w, sw) and dy [sy] random, y [sy], dx [sx] and dw
 * (ndim_w, sw) to write. */
static void operands(device_t dev, dtype_t dt, const int64_t *sx, const int64_t *sy, int ndim_w,
                     const int64_t *sw, fsdpc_tensor_t *x, fsdpc_tensor_t *w, fsdpc_tensor_t *dy,
                     fsdpc_tensor_t *y, fsdpc_tensor_t *dx, fsdpc_tensor_t *dw) {
  bench_random(x, dt, dev, 2, sx, 1);
  bench_random(w, dt, dev, ndim_w, sw, 2);
  bench_random(dy, dt, dev, 2, sy, 3);
  BENCH_TRY(tensor_init(y, dt, dev, 2, sy));
  BENCH_TRY(tensor_init(dx, dt, dev, 2, sx));
  BENCH_TRY(tensor_init(dw, dt, dev, ndim_w, sw));
}

/* Median seconds of n products with the same transposes: one kernel_matmul each (p = 0), then
 * one kernel_matmul_many (p = 1), taken in turn. */
static void time_many(device_t dev, int reps, double *times, double *med,
                      const kernel_product_t *ps, int n, bool ta, bool tb) {
  for (int r = -2; r < reps; r++)
    for (int p = 0; p < 2; p++) {
      BENCH_TRY(device_stream_sync(dev));
      double t0 = device_clock_seconds();
      if (p == 0)
        for (int i = 0; i < n; i++)
          BENCH_TRY(kernel_matmul(ps[i].out, ps[i].a, ta, ps[i].b, tb, 1.0f, 0.0f));
      else
        BENCH_TRY(kernel_matmul_many(ps, n, ta, tb, 1.0f, 0.0f));
      BENCH_TRY(device_stream_sync(dev));
      if (r >= 0) times[p * reps + r] = device_clock_seconds() - t0;
    }
  for (int p = 0; p < 2; p++) med[p] = bench_median(times + p * reps, reps);
}

/* A mixture of experts' products of one layer's gate (or up) projection, E experts of ffn x dim,
 * over N tokens routed k a token, c = N k / E rows each: forward, input gradient and weight
 * gradient, one call an expert against one grouped call. */
static void experts(device_t dev, dtype_t dt, int reps, double *times, int64_t N, int64_t E,
                    int64_t k, int64_t ffn, int64_t dim) {
  int64_t c = N * k / E, sx[2] = {E * c, dim}, sy[2] = {E * c, ffn}, sw[3] = {E, ffn, dim};
  fsdpc_tensor_t x, w, y, dy, dx, dw;
  operands(dev, dt, sx, sy, 3, sw, &x, &w, &dy, &y, &dx, &dw);
  fsdpc_tensor_t *v = calloc((size_t)(6 * E), sizeof *v); /* x, dy, y, dx, w, dw of each */
  kernel_product_t *ps = calloc((size_t)(3 * E), sizeof *ps);
  if (v == NULL || ps == NULL) bench_leave(1);
  for (int64_t e = 0; e < E; e++) {
    fsdpc_tensor_t *t = v + 6 * e, one;
    BENCH_TRY(tensor_narrow(&t[0], &x, 0, e * c, c));
    BENCH_TRY(tensor_narrow(&t[1], &dy, 0, e * c, c));
    BENCH_TRY(tensor_narrow(&t[2], &y, 0, e * c, c));
    BENCH_TRY(tensor_narrow(&t[3], &dx, 0, e * c, c));
    BENCH_TRY(tensor_narrow(&one, &w, 0, e, 1));
    BENCH_TRY(tensor_view(&t[4], &one, 2, sw + 1));
    tensor_free(&one);
    BENCH_TRY(tensor_narrow(&one, &dw, 0, e, 1));
    BENCH_TRY(tensor_view(&t[5], &one, 2, sw + 1));
    tensor_free(&one);
    ps[e] = (kernel_product_t){&t[2], &t[0], &t[4]};         /* y_e = x_e w_e^T */
    ps[E + e] = (kernel_product_t){&t[3], &t[1], &t[4]};     /* dx_e = dy_e w_e */
    ps[2 * E + e] = (kernel_product_t){&t[5], &t[1], &t[0]}; /* dw_e = dy_e^T x_e */
  }
  printf(
      "experts' products of a layer: %lld experts of %lldx%lld, %lld tokens top-%lld (%lld "
      "rows an expert), %s\n",
      (long long)E, (long long)ffn, (long long)dim, (long long)N, (long long)k, (long long)c,
      dtype_name(dt));
  printf("%-11s %16s %22s %22s %7s\n", "product", "m x n x k", "one call each", "grouped", "x");
  static const char *kinds[3] = {"forward", "input grad", "weight grad"};
  double flop = 2.0 * (double)(E * c) * (double)ffn * (double)dim;
  for (int kind = 0; kind < 3; kind++) {
    double med[2];
    time_many(dev, reps, times, med, ps + kind * E, (int)E, kind == 2, kind == 0);
    char dims[48], col[2][64];
    snprintf(dims, sizeof dims, "%lldx%lldx%lld", (long long)(kind == 2 ? ffn : c),
             (long long)(kind == 0 ? ffn : dim),
             (long long)(kind == 0   ? dim
                         : kind == 1 ? ffn
                                     : c));
    for (int p = 0; p < 2; p++) cell(flop, med[p], col[p], sizeof col[p]);
    printf("%-11s %16s %22s %22s %6.2fx\n", kinds[kind], dims, col[0], col[1], med[0] / med[1]);
  }
  if (dev.type == DEVICE_CUDA && kernel_matmul_grouped_runs() == 0)
    printf("no grouped cuBLAS call ran: %s\n", kernel_matmul_grouped_note());
  for (int64_t i = 0; i < 6 * E; i++) tensor_free(&v[i]);
  free(v);
  free(ps);
  fsdpc_tensor_t *all[] = {&x, &w, &y, &dy, &dx, &dw};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
}

int main(int argc, char **argv) {
  if (world_init(&argc, &argv) != STATUS_OK) {
    fprintf(stderr, "bench-matmul: %s\n", err_detail());
    return 1;
  }
  bench_args(argc, argv, "Times the matrix products of a training step, shape by shape.", OPTIONS);
  dtype_t dt;
  device_t dev = bench_device_dtype(argc, argv, &dt);
  bool cuda = dev.type == DEVICE_CUDA;
  llama_config_t c;
  BENCH_TRY(llama_config_from_hf(
      bench_opt(argc, argv, "--config", SOURCE_ROOT "/configs/llama-100m.json"), &c));
  int64_t N = bench_int(argc, argv, "--tokens", cuda ? 8192 : 512, 1, 1 << 24);
  int reps = (int)bench_int(argc, argv, "--reps", 20, 1, 100000);
  int paths = cuda ? 2 : 1;
  int64_t Dh = llama_head_dim(&c), L = c.n_layers, dense = L - llama_num_moe_layers(&c);
  layer_t llama[] = {
      {"q", c.n_heads * Dh, c.dim, L, false},
      {"o", c.dim, c.n_heads * Dh, L, false},
      {"k, v", c.n_kv_heads * Dh, c.dim, 2 * L, false},
      {"gate, up", c.ffn_dim, c.dim, 2 * dense, false}, /* the dense layers' MLPs */
      {"down", c.dim, c.ffn_dim, dense, false},
      {"lm head", c.vocab_size, c.dim, 1, false},
  };
  layer_t gpt2[] = {
      {"c_attn", 3 * c.dim, c.dim, L, true},      {"attn proj", c.dim, c.dim, L, true},
      {"c_fc", c.ffn_dim, c.dim, L, true},        {"mlp proj", c.dim, c.ffn_dim, L, true},
      {"lm head", c.vocab_size, c.dim, 1, false},
  };
  bool is_gpt2 = c.arch == LLAMA_ARCH_GPT2;
  layer_t *layers = is_gpt2 ? gpt2 : llama;
  size_t n_layers = is_gpt2 ? sizeof gpt2 / sizeof gpt2[0] : sizeof llama / sizeof llama[0];
  static const char *kinds[3] = {"forward", "input grad", "weight grad"};
  double *times = calloc((size_t)(2 * reps), sizeof(double));
  if (times == NULL) bench_leave(1);
  double step[2] = {0, 0}, step_flop = 0;
  printf("matrix products of a step over %lld tokens, %s on %s, median of %d\n", (long long)N,
         dtype_name(dt), cuda ? "cuda" : "cpu", reps);
  if (cuda)
    printf("%-10s %-11s %16s %22s %22s %7s\n", "linear", "product", "m x n x k", "cuBLASLt",
           "cublasGemmEx", "Lt x");
  else
    printf("%-10s %-11s %16s %22s\n", "linear", "product", "m x n x k", "OpenBLAS");
  for (size_t i = 0; i < n_layers; i++) {
    const layer_t *l = &layers[i];
    if (l->per_step == 0) continue; /* no dense MLP: every layer has experts */
    fsdpc_tensor_t x, w, dy, y, dx, dw;
    int64_t sy[2] = {N, l->out}, sx[2] = {N, l->in}, sw[2] = {l->out, l->in};
    if (l->io) {
      sw[0] = l->in;
      sw[1] = l->out;
    }
    operands(dev, dt, sx, sy, 2, sw, &x, &w, &dy, &y, &dx, &dw);
    double flop = 2.0 * (double)N * (double)l->out * (double)l->in;
    for (int kind = 0; kind < 3; kind++) {
      double med[2];
      int64_t m = kind == 2 ? (l->io ? l->in : l->out) : N;
      int64_t n = kind == 0 ? l->out : kind == 1 ? l->in : l->io ? l->out : l->in;
      int64_t k = kind == 0 ? l->in : kind == 1 ? l->out : N;
      /* y = x W^T, dx = dy W, dW = dy^T x; with io y = x W, dx = dy W^T, dW = x^T dy */
      if (kind == 0) time_product(dev, paths, reps, times, med, &y, &x, false, &w, !l->io);
      if (kind == 1) time_product(dev, paths, reps, times, med, &dx, &dy, false, &w, l->io);
      if (kind == 2 && !l->io)
        time_product(dev, paths, reps, times, med, &dw, &dy, true, &x, false);
      if (kind == 2 && l->io) time_product(dev, paths, reps, times, med, &dw, &x, true, &dy, false);
      char dims[48], col[2][64];
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
    fsdpc_tensor_t *all[] = {&x, &w, &dy, &y, &dx, &dw};
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
  if (L > dense) { /* the step's totals above leave them out */
    printf("the %lld layers with experts: their products below, not in the step's totals\n",
           (long long)(L - dense));
    experts(dev, dt, reps, times, N, c.n_experts, c.top_k, c.moe_ffn_dim, c.dim);
  }
  free(times);
  world_finalize();
  return 0;
}
