/*
 * Causal grouped-query attention alone: the library's forward, and forward plus backward, on
 * one device, timed over repetitions after a warm-up (the device's stream drained around each
 * one). Prints the median times in milliseconds and the TFLOP/s they come to (causal: half of
 * the score and value products' 4 B H T^2 Dh, backward 2.5 times the forward), and one JSON
 * line for scripts (bench/vs_torch_gpu.py sets it beside torch's scaled_dot_product_attention).
 *
 *   bench-attention [--device cpu|cuda] [--dtype f32|bf16|f16] [--batch 8] [--seq 1024]
 *                   [--heads 16] [--kv-heads 16] [--head-dim 128] [--reps 20]
 */
#include "core/kernels.h"
#include "bench/bench_util.h"

static const bench_option_t OPTIONS[] = {
    {"--device", "cpu|cuda", "where it runs (default cpu)"},
    {"--dtype", "f32|bf16|f16", "q, k, v and gradients (default bf16 on cuda, f32 on cpu)"},
    {"--batch", "N", "sequences (default 8)"},
    {"--seq", "N", "tokens per sequence (default 1024)"},
    {"--heads", "N", "query heads (default 16)"},
    {"--kv-heads", "N", "key/value heads, dividing --heads (default --heads)"},
    {"--head-dim", "N", "per head (default 128)"},
    {"--reps", "N", "timed repetitions (default 20)"},
    {NULL, NULL, NULL}};

int main(int argc, char **argv) {
  if (world_init(&argc, &argv) != STATUS_OK) {
    fprintf(stderr, "bench-attention: %s\n", err_detail());
    return 1;
  }
  bench_args(argc, argv, "Times causal attention, forward and forward + backward, on one device.",
             OPTIONS);
  const char *prog = bench_prog(argv);
  dtype_t dt;
  device_t dev = bench_device_dtype(argc, argv, &dt);
  int64_t B = bench_int(argc, argv, "--batch", 8, 1, 1 << 16);
  int64_t T = bench_int(argc, argv, "--seq", 1024, 1, 1 << 20);
  int64_t H = bench_int(argc, argv, "--heads", 16, 1, 1 << 12);
  int64_t Hkv = bench_int(argc, argv, "--kv-heads", H, 1, H);
  int64_t Dh = bench_int(argc, argv, "--head-dim", 128, 1, 1 << 12);
  int reps = (int)bench_int(argc, argv, "--reps", 20, 1, 100000);
  if (H % Hkv != 0) {
    fprintf(stderr, "%s: --kv-heads %lld does not divide --heads %lld\n", prog, (long long)Hkv,
            (long long)H);
    bench_leave(2);
  }
  int64_t sq[4] = {B, T, H, Dh}, sk[4] = {B, T, Hkv, Dh}, sl[3] = {B, H, T};
  fsdpc_tensor_t q, k, v, dy, y, lse, dq, dk, dv;
  bench_random(&q, dt, dev, 4, sq, 1);
  bench_random(&k, dt, dev, 4, sk, 2);
  bench_random(&v, dt, dev, 4, sk, 3);
  bench_random(&dy, dt, dev, 4, sq, 4);
  BENCH_TRY(tensor_init(&y, dt, dev, 4, sq));
  BENCH_TRY(tensor_init(&lse, DTYPE_F32, dev, 3, sl));
  BENCH_TRY(tensor_init(&dq, dt, dev, 4, sq));
  BENCH_TRY(tensor_init(&dk, dt, dev, 4, sk));
  BENCH_TRY(tensor_init(&dv, dt, dev, 4, sk));
  double *fwd = calloc((size_t)reps, sizeof(double)), *both = calloc((size_t)reps, sizeof(double));
  if (fwd == NULL || both == NULL) return 1;
  for (int r = -2; r < reps; r++) { /* two warm-up rounds */
    BENCH_TRY(device_stream_sync(dev));
    double t0 = device_clock_seconds();
    BENCH_TRY(kernel_attention(&y, &lse, &q, &k, &v));
    BENCH_TRY(device_stream_sync(dev));
    double t1 = device_clock_seconds();
    BENCH_TRY(kernel_attention_backward(&dq, &dk, &dv, &dy, &q, &k, &v, &y, &lse));
    BENCH_TRY(device_stream_sync(dev));
    double t2 = device_clock_seconds();
    if (r >= 0) {
      fwd[r] = t1 - t0;
      both[r] = t2 - t0;
    }
  }
  if (dev.type == DEVICE_CUDA) {
    int64_t fused = kernel_attention_fused_runs();
    if (fused > 0)
      printf("path: cuDNN fused attention (%lld calls)\n", (long long)fused);
    else
      printf("path: batched cuBLAS products (%s)\n", kernel_attention_fused_note());
  }
  double f = bench_median(fwd, reps), fb = bench_median(both, reps);
  double flop = 2.0 * (double)(B * H) * (double)T * (double)T * (double)Dh; /* causal fwd */
  char rf[32], rfb[32];
  printf(
      "attention %lld x %lld tokens, %lld/%lld heads of %lld, %s on %s: forward %.3f ms "
      "(%s), forward + backward %.3f ms (%s); median of %d\n",
      (long long)B, (long long)T, (long long)H, (long long)Hkv, (long long)Dh, dtype_name(dt),
      dev.type == DEVICE_CUDA ? "cuda" : "cpu", 1e3 * f, bench_rate(flop / f, rf, sizeof rf),
      1e3 * fb, bench_rate(3.5 * flop / fb, rfb, sizeof rfb), reps);
  printf("{\"forward_ms\": %.6f, \"forward_backward_ms\": %.6f}\n", 1e3 * f, 1e3 * fb);
  fsdpc_tensor_t *all[] = {&q, &k, &v, &dy, &y, &lse, &dq, &dk, &dv};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
  free(fwd);
  free(both);
  world_finalize();
  return 0;
}
