/*
 * Pipeline schedules run for real (parallel/pipeline.h) on the world's ranks as pipeline ranks:
 * a Llama split into stages by blocks (the embedding on the first, the final norm, head and
 * loss on the last), a step of M microbatches under gpipe, 1f1b and interleaved 1f1b (2
 * stages a rank, when the blocks split so). Per rank: the step's time, the fraction of it
 * spent waiting for a neighbour beside the schedule's closed-form bubble (which assumes every
 * stage takes the same time: the first and last stages here do more), the microbatches whose
 * activations it kept at once, and the memory the step added at its peak. Figures, not
 * assertions; every rank holds the whole model (only its stages compute).
 *
 *   mpirun -n 4 bench-pipeline [--config configs/llama-small.json] [--layers 8]
 *       [--microbatches 8] [--batch 1] [--seq 128] [--steps 3]
 */
#include "parallel/pipeline.h"

#include "bench/bench_util.h"
#include "mesh/world.h"
#include "nn/ops.h"

static const bench_option_t OPTIONS[] = {
    BENCH_MODEL_OPTIONS,
    {"--layers", "L", "transformer blocks (default: the config's)"},
    {"--microbatches", "M", "microbatches a step (default 8)"},
    {"--batch", "N", "samples a microbatch (default 1)"},
    {"--seq", "N", "tokens a sample (default 128)"},
    {"--steps", "N", "steps a schedule, the first not counted (default 3)"},
    {NULL, NULL, NULL}};

typedef struct bench_stages {
  llama_t *m;
  int S;
  fsdpc_data_t *d;
  data_spec_t spec;
  int64_t step;
  nn_param_t **ps; /* every parameter, for dropping the gradients between steps */
  int n;
} bench_stages_t;

static fsdpc_status_t input_ids(int mb, nn_var_t **out, void *user) {
  bench_stages_t *u = user;
  fsdpc_tensor_t in, tg, dev_in;
  FSDPC_TRY(data_batch(u->d, &u->spec, u->step, mb, &in, &tg));
  tensor_free(&tg);
  fsdpc_status_t st = tensor_upload(&dev_in, &in, mesh_device(llama_local_mesh(u->m)));
  tensor_free(&in);
  return st == STATUS_OK ? nn_var_new(&dev_in, false, out) : st;
}

/* Stage s of the model (llama_stage_forward), the loss after the last. */
static fsdpc_status_t stage_forward(nn_ctx_t *ctx, int s, int mb, nn_var_t *in, nn_var_t **out,
                                    void *user) {
  bench_stages_t *u = user;
  nn_var_t *h = NULL, *loss = NULL;
  FSDPC_TRY(llama_stage_forward(ctx, u->m, s, u->S, in, &h));
  if (s < u->S - 1) {
    *out = h;
    return STATUS_OK;
  }
  fsdpc_tensor_t ids, tg, dev_tg = {0};
  fsdpc_status_t st = data_batch(u->d, &u->spec, u->step, mb, &ids, &tg);
  if (st == STATUS_OK) {
    tensor_free(&ids);
    st = tensor_upload(&dev_tg, &tg, h->value.device);
    tensor_free(&tg);
  }
  if (st == STATUS_OK) st = nn_cross_entropy(ctx, h, &dev_tg, &loss, NULL);
  tensor_free(&dev_tg);
  nn_var_put(h);
  *out = loss;
  return st;
}

/* Runs steps of the schedule; prints rank by rank (on rank 0) the medians after the first. */
static void run(pp_schedule_kind_t kind, int V, bench_stages_t *u, const llama_config_t *cfg,
                int64_t steps, device_t dev) {
  int P = world_size(), r = world_rank(), M = (int)u->spec.grad_accum;
  u->S = P * V;
  pp_schedule_t *s;
  if (pp_schedule_new(kind, P, M, V, &s) != STATUS_OK) {
    if (r == 0) printf("%-17s skipped: %s\n", pp_schedule_name(kind), err_detail());
    return;
  }
  pp_step_stats_t stats;
  pp_step_options_t o = PP_STEP_OPTIONS_INIT;
  o.group = world_pg();
  o.schedule = s;
  o.ndim = 3;
  o.shape[0] = u->spec.batch_size, o.shape[1] = u->spec.seq_len, o.shape[2] = cfg->dim;
  o.dtype = DTYPE_F32;
  o.device = dev;
  o.forward = stage_forward;
  o.input = input_ids;
  o.user = u;
  o.stats = &stats;
  double *t = calloc((size_t)steps, sizeof *t), *w = calloc((size_t)steps, sizeof *w);
  double added = 0, loss = 0;
  for (int64_t k = 0; k < steps; k++) {
    u->step = k;
    for (int i = 0; i < u->n; i++) nn_param_zero_grad(u->ps[i]);
    BENCH_TRY(device_stream_sync(dev));
    BENCH_TRY(pg_barrier(world_pg(), NULL));
    size_t base = mem_stats(dev).current;
    mem_reset_peak(dev);
    BENCH_TRY(pp_step(&o, &loss));
    BENCH_TRY(device_stream_sync(dev));
    t[k] = stats.seconds;
    w[k] = stats.wait_seconds / stats.seconds;
    double a = (double)(mem_stats(dev).peak - base);
    if (k > 0 && a > added) added = a;
  }
  /* per rank: time, waiting fraction, in flight, memory added */
  double mine[4] = {steps > 1 ? bench_median(t + 1, (int)steps - 1) : t[0],
                    steps > 1 ? bench_median(w + 1, (int)steps - 1) : w[0],
                    (double)stats.max_in_flight, added},
         all[4 * 64];
  BENCH_TRY(pg_host_all_gather(world_pg(), mine, all, 4, PG_HOST_F64));
  if (r == 0) {
    printf("%-17s %d stages, closed-form bubble %.3f, loss %.4f\n", pp_schedule_name(kind), u->S,
           pp_schedule_bubble(s), loss);
    for (int q = 0; q < P && q < 64; q++)
      printf(
          "  rank %d: step %8.2f ms, waiting %.3f of it, %2.0f microbatches in flight, "
          "activations %8.2f MiB at the peak\n",
          q, 1e3 * all[4 * q], all[4 * q + 1], all[4 * q + 2], all[4 * q + 3] / 1048576.0);
  }
  free(t);
  free(w);
  pp_schedule_free(s);
}

int main(int argc, char **argv) {
  BENCH_TRY(world_init(&argc, &argv));
  bench_args(argc, argv,
             "Runs a Llama's pipeline stages under each schedule and prints per rank the step "
             "time, the share of it spent waiting beside the closed-form bubble, the "
             "activations kept and the memory they take.",
             OPTIONS);
  llama_config_t cfg;
  llama_options_t lopt;
  bench_model(argc, argv, SOURCE_ROOT "/configs/llama-small.json", &cfg, &lopt);
  cfg.n_layers = bench_int(argc, argv, "--layers", cfg.n_layers, 1, 1 << 16);
  cfg.tie_embeddings = false; /* the embedding and the head live on different stages */
  lopt.deferred = false;
  lopt.dtype = DTYPE_F32;
  int P = world_size();
  int M = (int)bench_int(argc, argv, "--microbatches", 8, 1, 1 << 16);
  int64_t steps = bench_int(argc, argv, "--steps", 3, 1, 1000);
  if (cfg.n_layers < P) {
    fprintf(stderr, "%s: %lld blocks cannot fill %d stages\n", bench_prog(argv),
            (long long)cfg.n_layers, P);
    bench_leave(2);
  }
  bench_stages_t u = {0};
  BENCH_TRY(llama_new(&cfg, &lopt, &u.m));
  BENCH_TRY(llama_init_weights(u.m, 1));
  BENCH_TRY(nn_named_parameters(llama_module(u.m), &u.ps, &u.n));
  BENCH_TRY(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &u.d));
  u.spec = (data_spec_t){.batch_size = bench_int(argc, argv, "--batch", 1, 1, 1 << 20),
                         .seq_len = bench_int(argc, argv, "--seq", 128, 1, 1 << 24),
                         .grad_accum = M,
                         .dp_size = 1};
  device_t dev = mesh_device(llama_local_mesh(u.m));
  if (world_rank() == 0)
    printf("llama %lld blocks, dim %lld; %d pipeline ranks, %d microbatches of %lld x %lld\n",
           (long long)cfg.n_layers, (long long)cfg.dim, P, M, (long long)u.spec.batch_size,
           (long long)u.spec.seq_len);
  run(PP_GPIPE, 1, &u, &cfg, steps, dev);
  run(PP_1F1B, 1, &u, &cfg, steps, dev);
  if (cfg.n_layers >= 2 * P) run(PP_INTERLEAVED_1F1B, 2, &u, &cfg, steps, dev);
  data_free(u.d);
  free(u.ps);
  llama_free(u.m);
  world_finalize();
  return 0;
}
