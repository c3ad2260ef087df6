/*
 * Single-process training of a small Llama on the bundled corpus: prints the loss curve and
 * tokens per second, the host blocks the steps after the second took from the system, and
 * (on the CPU in f32) the model's FLOP rate after step 0 against plain cblas_sgemm on the
 * step's linear shapes.
 *
 *   bench-train-tiny [--config configs/llama-tiny.json] [--data data/corpus.txt]
 *                    [--steps 300] [--batch 8] [--seq 64] [--accum 1] [--lr 3e-3]
 *                    [--device cpu|cuda] [--dtype f32|bf16] [--ac] [--every 25]
 */
#include <cblas.h>
#include <math.h>

#include "core/kernels.h"
#include "bench/bench_util.h"
#include "mesh/world.h"
#include "nn/optim.h"

static const bench_option_t OPTIONS[] = {
    BENCH_MODEL_OPTIONS,
    {"--data", "PATH", "token file, one byte per token (default data/corpus.txt)"},
    {"--steps", "N", "training steps (default 300)"},
    {"--every", "N", "steps between printed losses (default 25)"},
    {"--batch", "N", "samples per step (default 8)"},
    {"--seq", "N", "tokens per sample (default 64)"},
    {"--accum", "N", "micro-batches per step (default 1)"},
    {"--lr", "X", "peak learning rate (default 3e-3)"},
    {NULL, NULL, NULL}};

/* GFLOP/s of plain cblas_sgemm on the matrix products of a step's linear layers (forward
 * x W^T, backward dy W and dy^T x, M = tokens), best of three per shape: what the model's
 * FLOP rate is measured against. */
static double sgemm_reference(const llama_config_t *c, int64_t M) {
  int64_t hd = c->dim / c->n_heads, kv = c->n_kv_heads * hd;
  const int64_t shapes[][3] = {/* in, out, count per step */
                               {c->dim, c->dim, 2 * c->n_layers},
                               {c->dim, kv, 2 * c->n_layers},
                               {c->dim, c->ffn_dim, 2 * c->n_layers},
                               {c->ffn_dim, c->dim, c->n_layers},
                               {c->dim, c->vocab_size, 1}};
  double flops = 0, secs = 0;
  for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
    int64_t in = shapes[k][0], out = shapes[k][1];
    float *x = calloc((size_t)(M * in), sizeof(float)), *w = calloc((size_t)(out * in), 4),
          *y = calloc((size_t)(M * out), sizeof(float));
    if (x == NULL || w == NULL || y == NULL) exit(1);
    for (int64_t i = 0; i < M * in; i++) x[i] = (float)(i % 7) * 0.1f;
    for (int64_t i = 0; i < out * in; i++) w[i] = (float)(i % 5) * 0.1f;
    double best = INFINITY;
    for (int rep = 0; rep < 3; rep++) {
      double t = device_clock_seconds();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)M, (int)out, (int)in, 1, x,
                  (int)in, w, (int)in, 0, y, (int)out);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)M, (int)in, (int)out, 1, y,
                  (int)out, w, (int)in, 0, x, (int)in);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)out, (int)in, (int)M, 1, y,
                  (int)out, x, (int)in, 0, w, (int)in);
      t = device_clock_seconds() - t;
      best = t < best ? t : best;
    }
    flops += 6.0 * (double)(M * in * out) * (double)shapes[k][2];
    secs += best * (double)shapes[k][2];
    free(x);
    free(w);
    free(y);
  }
  return flops / secs / 1e9;
}

int main(int argc, char **argv) {
  BENCH_TRY(world_init(&argc, &argv));
  bench_args(argc, argv, "Trains a small Llama on one rank and prints its loss curve and tokens/s.",
             OPTIONS);
  const char *data_path = bench_opt(argc, argv, "--data", SOURCE_ROOT "/data/corpus.txt");
  int64_t steps = bench_int(argc, argv, "--steps", 300, 1, 100000000);
  int64_t every = bench_int(argc, argv, "--every", 25, 1, 100000000);
  data_spec_t spec = {.batch_size = bench_int(argc, argv, "--batch", 8, 1, 1 << 20),
                      .seq_len = bench_int(argc, argv, "--seq", 64, 1, 1 << 24),
                      .grad_accum = bench_int(argc, argv, "--accum", 1, 1, 1 << 20),
                      .dp_size = 1,
                      .dp_rank = 0};
  llama_config_t cfg;
  llama_options_t opt;
  bench_model(argc, argv, SOURCE_ROOT "/configs/llama-tiny.json", &cfg, &opt);
  llama_t *m;
  BENCH_TRY(llama_new(&cfg, &opt, &m));
  bench_init(m, 1234);
  fsdpc_data_t *d;
  BENCH_TRY(data_open(data_path, DATA_BYTES, &d));
  int64_t top;
  BENCH_TRY(data_max_token(d, 0, data_num_tokens(d), &top));
  if (top >= cfg.vocab_size) {
    fprintf(stderr, "%s: token %lld outside the vocabulary of %lld\n", data_path, (long long)top,
            (long long)cfg.vocab_size);
    return 1;
  }
  nn_param_t **ps;
  int n;
  BENCH_TRY(nn_named_parameters(llama_module(m), &ps, &n));
  adamw_config_t acfg = ADAMW_CONFIG_INIT;
  acfg.lr = bench_positive(argc, argv, "--lr", 3e-3);
  acfg.beta2 = 0.95;
  acfg.weight_decay = 0.1;
  acfg.groups[acfg.n_groups++] = (adamw_group_t){"*norm*", -1, 0.0};
  lr_schedule_t sched = {.warmup_steps = steps / 10, .total_steps = steps, .min_ratio = 0.1};
  optim_t *o;
  BENCH_TRY(optim_new(ps, n, &acfg, &o));
  printf(
      "model: %lld parameters, %lld layers, dim %lld; batch %lld x %lld tokens, accum %lld, "
      "%s %s%s; %d CPU kernel thread(s)\n",
      (long long)llama_num_params(&cfg), (long long)cfg.n_layers, (long long)cfg.dim,
      (long long)spec.batch_size, (long long)spec.seq_len, (long long)spec.grad_accum,
      opt.device == DEVICE_CUDA ? "cuda" : "cpu", dtype_name(opt.dtype),
      opt.activation_checkpointing ? ", activation checkpointing" : "", kernel_cpu_threads());
  printf("%6s %10s %10s %12s\n", "step", "loss", "grad_norm", "tokens/s");
  double t0 = device_clock_seconds(), window = t0, first = 0, last = 0, avg = 0, after_first = 0;
  int64_t tokens_per_step = spec.batch_size * spec.seq_len * spec.grad_accum;
  size_t os_allocs = 0; /* host blocks of 64 KiB and more taken from the system after step 2 */
  double t_profile = 0; /* when the profile restarted */
  /* the profile leaves out the first two steps (allocation, first touch, warm-up), or only the
   * first in runs of fewer than four */
  int64_t profile_from = steps >= 4 ? 2 : 1;
  for (int64_t s = 0; s < steps; s++) {
    if (s == 2) os_allocs = mem_os_allocs(device_cpu());
    if (s == profile_from && kernel_profile_enabled()) { /* steady steps only */
      BENCH_TRY(device_stream_sync(mesh_device(llama_local_mesh(m))));
      kernel_profile_reset();
      t_profile = device_clock_seconds();
    }
    optim_zero_grad(o);
    double loss = 0;
    for (int64_t k = 0; k < spec.grad_accum; k++)
      loss += bench_fwd_bwd(m, d, &spec, s, k) / (double)spec.grad_accum;
    double norm;
    float coef; /* clipping inside the AdamW pass, as fsdp-train does */
    BENCH_TRY(clip_grad_coef(ps, n, 1.0, NULL, &norm, &coef));
    BENCH_TRY(optim_step_scaled(o, lr_schedule_factor(&sched, s), coef));
    if (s == 0) {
      first = loss;
      BENCH_TRY(device_stream_sync(mesh_device(llama_local_mesh(m))));
      after_first = device_clock_seconds();
    }
    avg = s == 0 ? loss : 0.9 * avg + 0.1 * loss;
    last = loss;
    if ((s + 1) % every == 0 || s == 0 || s + 1 == steps) {
      BENCH_TRY(device_stream_sync(mesh_device(llama_local_mesh(m))));
      double now = device_clock_seconds();
      int64_t done = s == 0 ? 1 : ((s + 1) % every == 0 ? every : (s + 1) % every);
      printf("%6lld %10.4f %10.4f %12.0f\n", (long long)s, loss, norm,
             (double)(done * tokens_per_step) / (now - window));
      window = now;
    }
  }
  double t_end = device_clock_seconds(), total = t_end - t0;
  printf("loss %.4f -> %.4f (smoothed %.4f); %.0f tokens/s over %lld steps (%.1f s)\n", first, last,
         avg, (double)(steps * tokens_per_step) / total, (long long)steps, total);
  if (steps > 2)
    printf("host blocks of 64 KiB or more taken from the system after step 2: %zu\n",
           mem_os_allocs(device_cpu()) - os_allocs);
  if (opt.device == DEVICE_CPU && opt.dtype == DTYPE_F32) {
    /* model FLOPs per token: 6 per linear weight, 12 L D T for attention (PaLM's count) */
    int64_t linear = llama_num_params(&cfg) - cfg.vocab_size * cfg.dim * !cfg.tie_embeddings -
                     (2 * cfg.n_layers + 1) * cfg.dim;
    double per_token = 6.0 * (double)linear +
                       12.0 * (double)(cfg.n_layers * cfg.dim * spec.seq_len);
    double rate = /* after the first step, which allocates and warms up */
        per_token * (double)((steps - 1) * tokens_per_step) / (t_end - after_first) / 1e9;
    double ref = sgemm_reference(&cfg, spec.batch_size * spec.seq_len);
    printf("model %.1f GFLOP/s after step 0 (%.2f GFLOP a step); sgemm on the step's linear "
           "shapes %.1f GFLOP/s%s: %.0f%%\n",
           rate, per_token * (double)tokens_per_step / 1e9, ref,
           kernel_cpu_threads() > 1 ? " (one thread)" : "", 100 * rate / ref);
  }
  if (kernel_profile_enabled() && t_profile > 0) { /* FSDPC_PROFILE=1 */
    double k = 0;
    printf("\nkernels of steps %lld-%lld (FSDPC_PROFILE):\n", (long long)profile_from,
           (long long)steps - 1);
    BENCH_TRY(kernel_profile_report(stdout, &k));
    printf("kernels %.3f s of %.3f s\n", k, t_end - t_profile);
  }
  optim_free(o);
  free(ps);
  data_free(d);
  llama_free(m);
  world_finalize();
  return avg < first ? 0 : 1;
}
