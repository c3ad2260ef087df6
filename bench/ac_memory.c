/*
 * Peak memory of one forward + backward with and without activation checkpointing, and a
 * check that the gradients are bit-identical.
 *
 *   bench-ac-memory [--config configs/llama-small.json] [--batch 4] [--seq 128]
 *                   [--device cpu|cuda] [--dtype f32|bf16]
 */
#include "bench/bench_util.h"
#include "mesh/world.h"

static const bench_option_t OPTIONS[] = {
    BENCH_MODEL_OPTIONS,
    {"--batch", "N", "samples per step (default 4)"},
    {"--seq", "N", "tokens per sample (default 128)"},
    {NULL, NULL, NULL}};

int main(int argc, char **argv) {
  BENCH_TRY(world_init(&argc, &argv));
  bench_args(argc, argv,
             "Peak memory of a training step of a Llama with and without activation "
             "checkpointing.",
             OPTIONS);
  data_spec_t spec = {.batch_size = bench_int(argc, argv, "--batch", 4, 1, 1 << 20),
                      .seq_len = bench_int(argc, argv, "--seq", 128, 1, 1 << 24),
                      .grad_accum = 1,
                      .dp_size = 1};
  llama_config_t cfg;
  llama_options_t opt;
  bench_model(argc, argv, SOURCE_ROOT "/configs/llama-small.json", &cfg, &opt);
  fsdpc_data_t *d;
  BENCH_TRY(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  llama_t *m[2];
  size_t peak[2], params = 0;
  double secs[2];
  for (int k = 0; k < 2; k++) {
    opt.activation_checkpointing = k == 1;
    BENCH_TRY(llama_new(&cfg, &opt, &m[k]));
    bench_init(m[k], 7);
    device_t dev = mesh_device(llama_local_mesh(m[k]));
    size_t base = mem_stats(dev).current;
    mem_reset_peak(dev);
    double t = device_clock_seconds();
    bench_fwd_bwd(m[k], d, &spec, 0, 0);
    BENCH_TRY(device_stream_sync(dev));
    secs[k] = device_clock_seconds() - t;
    peak[k] = mem_stats(dev).peak - base;
    if (k == 0) params = base;
  }
  nn_param_t **p0, **p1;
  int n0, n1, same = 1;
  BENCH_TRY(nn_named_parameters(llama_module(m[0]), &p0, &n0));
  BENCH_TRY(nn_named_parameters(llama_module(m[1]), &p1, &n1));
  for (int i = 0; i < n0; i++) {
    bool eq = false;
    BENCH_TRY(tensor_equal(dtensor_local(p0[i]->grad), dtensor_local(p1[i]->grad), &eq));
    same &= eq;
  }
  printf("model %lld params (%zu bytes resident before the step), batch %lld x %lld\n",
         (long long)llama_num_params(&cfg), params, (long long)spec.batch_size,
         (long long)spec.seq_len);
  printf("peak above resident, no checkpointing:   %10.2f MiB  (%.3f s)\n",
         (double)peak[0] / 1048576.0, secs[0]);
  printf("peak above resident, with checkpointing: %10.2f MiB  (%.3f s)\n",
         (double)peak[1] / 1048576.0, secs[1]);
  printf("gradients bit-identical: %s\n", same ? "yes" : "NO");
  free(p0);
  free(p1);
  llama_free(m[0]);
  llama_free(m[1]);
  data_free(d);
  world_finalize();
  return same && peak[1] < peak[0] ? 0 : 1;
}
