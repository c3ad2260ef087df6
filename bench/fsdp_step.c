/*
 * FSDP training steps of a Llama under a plan: per-step communication bytes measured and
 * analytic (docs/design.md, "Performance model"), peak memory measured and budgeted (docs/design.md
 * "fully_shard"), step time, and the speed of the copies within the device (FSDP's copy-in with its
 * cast, copy-out and reduce-scatter packing, batched on a GPU; the others one by one) in one
 * more, profiled, step against a plain copy of 64 MiB on that device. Figures, not assertions.
 *
 *   mpirun -n 4 bench-fsdp-step [--config configs/llama-small.json] [--hsdp R [--hfsdp]]
 *       [--reshard auto|0|1|N] [--param-dtype f32|bf16] [--steps 5] [--batch 2] [--seq 128]
 *       [--device cpu|cuda] [--offload]
 * With --offload (CUDA) the sharded state lives on the host; its memory is printed too. After
 * the steps, the bytes each rank holds of the parameters the optimizer updates, their
 * gradients and AdamW's moments, measured, against the model's whole: 1/dp_shard under HSDP,
 * 1/(R x dp_shard) under --hfsdp (the optimizer state over the replicas too).
 * On a GPU, one more step measures the host's own time: the forward and backward launched
 * without a wait (per fully_shard unit), the part of it in fully_shard's hooks, and the
 * optimizer's launches (per parameter).
 */
#include "bench/bench_util.h"
#include "dtensor/placement.h"
#include "fully_shard/fsdp.h"
#include "mesh/world.h"
#include "nn/optim.h"
#include "train/train.h"

static uint64_t sum_kind(pg_t *pg, pg_kind_t k) { return pg ? pg_counters(pg).bytes[k] : 0; }

static const bench_option_t OPTIONS[] = {
    BENCH_MODEL_OPTIONS,
    {"--hsdp", "R", "replicate over R groups of W/R ranks (default 1: FSDP)"},
    {"--reshard", "auto|true|false|N", "reshard_after_forward of the layers (default auto)"},
    {"--param-dtype", "f32|bf16|f16", "all-gather and compute dtype (default f32)"},
    {"--steps", "N", "steps to time (default 5)"},
    {"--batch", "N", "samples per rank (default 2)"},
    {"--seq", "N", "tokens per sample (default 128)"},
    {"--offload", NULL, "sharded state on the host (CUDA)"},
    {"--hfsdp", NULL, "with --hsdp: the optimizer state sharded over the replicas too (HFSDP)"},
    {NULL, NULL, NULL}};

/* --reshard: auto, true, false or an integer N >= 2. */
static int reshard_arg(int argc, char **argv) {
  const char *rs = bench_opt(argc, argv, "--reshard", "auto");
  if (strcmp(rs, "auto") == 0) return FSDP_RESHARD_AUTO;
  if (strcmp(rs, "true") == 0) return 1;
  if (strcmp(rs, "false") == 0) return 0;
  char *end;
  long n = strtol(rs, &end, 10);
  if (end == rs || *end != 0 || n < 0 || n > (1 << 20)) {
    fprintf(stderr, "%s: --reshard: expected auto, true, false or an integer N, got '%s'\n",
            bench_prog(argv), rs);
    bench_leave(2);
  }
  return (int)n;
}

/* Step s: forward, backward, clipping and the optimizer, until the device is done. */
static void train_step(llama_t *m, fsdpc_data_t *d, const data_spec_t *spec, int64_t s,
                       nn_param_t **ps, int n, pg_t *all_ranks, optim_t *o, device_t dev) {
  bench_fwd_bwd(m, d, spec, s, 0);
  BENCH_TRY(clip_grad_norm(ps, n, 1.0, all_ranks, NULL));
  BENCH_TRY(optim_step(o, 1.0));
  BENCH_TRY(device_stream_sync(dev));
}

/* On a GPU: the host's time in one more step (step s) with the device idle at its start: the
 * forward and backward enqueued without a host wait (hooks, FSDP's bookkeeping, the launches),
 * per unit of ng, and the optimizer's launches after the clipping's wait, per parameter of n. */
static void host_time(llama_t *m, fsdpc_data_t *d, const data_spec_t *spec, int64_t s,
                      nn_param_t **ps, int n, int ng, pg_t *all_ranks, optim_t *o, device_t dev) {
  optim_zero_grad(o);
  BENCH_TRY(device_stream_sync(dev));
  BENCH_TRY(pg_barrier(world_pg(), NULL));
  size_t waits = device_host_waits();
  double k0[NN_HOOK_COUNT], k1[NN_HOOK_COUNT], h = 0; /* the hooks' time by kind, and all */
  int64_t n0[NN_HOOK_COUNT], n1[NN_HOOK_COUNT], c = 0;
  for (int k = 0; k < NN_HOOK_COUNT; k++) fsdp_hook_time_of((nn_hook_kind_t)k, &k0[k], &n0[k]);
  size_t allocs = mem_stats(dev).allocs;
  double t0 = device_clock_seconds();
  fsdpc_tensor_t loss;
  BENCH_TRY(llama_micro_step_async(m, d, spec, s, 0, &loss));
  double t1 = device_clock_seconds();
  allocs = mem_stats(dev).allocs - allocs;
  for (int k = 0; k < NN_HOOK_COUNT; k++) {
    fsdp_hook_time_of((nn_hook_kind_t)k, &k1[k], &n1[k]);
    h += k1[k] - k0[k];
    c += n1[k] - n0[k];
  }
  waits = device_host_waits() - waits;
  BENCH_TRY(clip_grad_norm(ps, n, 1.0, all_ranks, NULL));
  BENCH_TRY(device_stream_sync(dev));
  double t2 = device_clock_seconds();
  BENCH_TRY(optim_step(o, 1.0));
  double t3 = device_clock_seconds();
  BENCH_TRY(device_stream_sync(dev));
  double t4 = device_clock_seconds(), value;
  BENCH_TRY(llama_loss_read(&loss, &value));
  if (world_rank() == 0)
    printf(
        "host time in a step (device idle at its start): forward + backward launched in %.3f ms "
        "with %zu host wait(s) and %.1f device allocations per unit, %.1f us per unit (%d "
        "units), of which fully_shard's hooks %.1f us per unit (%lld calls); the optimizer "
        "launched in %.3f ms, %.2f us per parameter (%d), its device work done %.3f ms later\n",
        1e3 * (t1 - t0), waits, (double)allocs / ng, 1e6 * (t1 - t0) / ng, ng, 1e6 * h / ng,
        (long long)c, 1e3 * (t3 - t2), 1e6 * (t3 - t2) / n, n, 1e3 * (t4 - t3));
  static const char *const kinds[NN_HOOK_COUNT] = {"pre-forward", "post-forward", "pre-backward",
                                                   "post-backward"};
  if (world_rank() == 0) {
    printf("  fully_shard's hooks by kind:");
    for (int k = 0; k < NN_HOOK_COUNT; k++)
      printf("%s %s %.1f us a call (%lld calls)", k ? "," : "", kinds[k],
             n1[k] > n0[k] ? 1e6 * (k1[k] - k0[k]) / (double)(n1[k] - n0[k]) : 0.0,
             (long long)(n1[k] - n0[k]));
    printf("\n");
  }
}

/* On a GPU: what the calls a fully_shard hook makes cost this host, the device idle (a few
 * hundred of each, timed on the host): an allocation from the device's pool and its free, a
 * launch of a unit's list of nine casts (tensor_copy_many), a launch of a one-element kernel. */
static void call_costs(device_t dev) {
  enum { kReps = 300, kCopies = 9 };
  int64_t n = 1 << 18, one = 1;
  fsdpc_tensor_t src[kCopies], dst[kCopies], x, t;
  for (int i = 0; i < kCopies; i++) {
    BENCH_TRY(tensor_zeros(&src[i], DTYPE_F32, dev, 1, &one));
    BENCH_TRY(tensor_init(&dst[i], DTYPE_BF16, dev, 1, &one));
  }
  BENCH_TRY(tensor_zeros(&x, DTYPE_F32, dev, 1, &one));
  double alloc = 0, release = 0, copies = 0, kernel = 0;
  for (int round = 0; round < 2; round++) { /* the first warms the pool and the modules */
    BENCH_TRY(device_stream_sync(dev));
    alloc = release = 0;
    for (int r = 0; r < kReps; r++) {
      double t0 = device_clock_seconds();
      BENCH_TRY(tensor_init(&t, DTYPE_BF16, dev, 1, &n));
      double t1 = device_clock_seconds();
      tensor_free(&t);
      alloc += t1 - t0;
      release += device_clock_seconds() - t1;
    }
    BENCH_TRY(device_stream_sync(dev));
    double t0 = device_clock_seconds();
    for (int r = 0; r < kReps; r++) BENCH_TRY(tensor_copy_many(dst, src, kCopies));
    copies = device_clock_seconds() - t0;
    BENCH_TRY(device_stream_sync(dev));
    t0 = device_clock_seconds();
    for (int r = 0; r < kReps; r++) BENCH_TRY(kernel_scale(&x, 1.0f));
    kernel = device_clock_seconds() - t0;
  }
  BENCH_TRY(device_stream_sync(dev));
  for (int i = 0; i < kCopies; i++) {
    tensor_free(&src[i]);
    tensor_free(&dst[i]);
  }
  tensor_free(&x);
  if (world_rank() == 0)
    printf(
        "  the driver's calls on this host, the device idle: an allocation %.2f us and its "
        "free %.2f us (the device's pool), a launch of %d casts %.2f us, of a one-element "
        "kernel %.2f us\n",
        1e6 * alloc / kReps, 1e6 * release / kReps, kCopies, 1e6 * copies / kReps,
        1e6 * kernel / kReps);
}

/* The bytes this rank holds of the updated parameters, their gradients and AdamW's moments,
 * summed over every rank (each rank's own elements: no replica counted twice when the
 * placements say the state is sharded over all), against the model's P elements of each. */
static void state_share(nn_param_t **ps, int n, optim_t *o, double P, int W, int Ws, int R,
                        bool hfsdp) {
  double mine = 0;
  for (int i = 0; i < n; i++) {
    dtensor_t *m1, *m2;
    BENCH_TRY(optim_state(o, i, &m1, &m2));
    mine += (double)tensor_nbytes(dtensor_local(ps[i]->value)) +
            (ps[i]->grad ? (double)tensor_nbytes(dtensor_local(ps[i]->grad)) : 0) +
            (double)tensor_nbytes(dtensor_local(m1)) + (double)tensor_nbytes(dtensor_local(m2));
    dtensor_free(m1);
    dtensor_free(m2);
  }
  double whole = 4.0 * P * (double)dtype_size(dtensor_local(ps[0]->value)->dtype);
  int share = hfsdp ? W : Ws;
  if (world_rank() == 0)
    printf(
        "optimizer state on rank 0 (updated parameters, gradients, AdamW moments): %.0f B, "
        "1/%.2f of the model's %.0f B (%s: 1/%d, padding aside)%s\n",
        mine, whole / mine, whole,
        hfsdp   ? "HFSDP, over dp_replicate x dp_shard"
        : R > 1 ? "HSDP, over dp_shard"
                : "FSDP, over dp_shard",
        share, hfsdp ? "; the 1/dp_shard shards the units gather from are kept besides" : "");
}

/* GB/s of the profiled copies named name since the last reset; 0 when there were none. */
static double copy_rate(const char *name, int64_t *calls) {
  kernel_profile_row_t r = {0, 0, 0};
  *calls = kernel_profile_get(name, &r) ? r.calls : 0;
  return r.seconds > 0 ? r.bytes / r.seconds / 1e9 : 0;
}

/* The device's own copy bandwidth: GB/s (bytes read and written) of copies of 64 MiB
 * between two tensors on dev, the fastest of five after one to warm up. */
static double device_copy_rate(device_t dev) {
  int64_t n = 16 << 20;
  fsdpc_tensor_t a, b;
  BENCH_TRY(tensor_init(&a, DTYPE_F32, dev, 1, &n));
  BENCH_TRY(tensor_init(&b, DTYPE_F32, dev, 1, &n));
  BENCH_TRY(tensor_fill(&a, 1.5));
  double best = 0;
  for (int i = 0; i < 6; i++) {
    kernel_profile_reset();
    BENCH_TRY(tensor_copy(&b, &a));
    int64_t calls;
    double r = copy_rate("copy", &calls);
    if (i > 0 && r > best) best = r;
  }
  tensor_free(&a);
  tensor_free(&b);
  return best;
}

static void out_of_memory(void) {
  fprintf(stderr, "bench-fsdp-step: out of host memory\n");
  exit(1);
}

/* A list of copies for tensor_copy_many; it owns its tensors. */
typedef struct copy_list {
  fsdpc_tensor_t *dst, *src;
  int n, cap;
  double bytes; /* read and written */
} copy_list_t;

/* Adds the copy of rows [start, start + len) of full (viewed as rows of `row` elements) to or
 * from flat at element pos. */
static void list_add(copy_list_t *l, fsdpc_tensor_t *full, fsdpc_tensor_t *flat, int64_t start,
                     int64_t len, int64_t row, int64_t pos, bool to_flat) {
  if (len == 0) return;
  if (l->n == l->cap) {
    l->cap = l->cap ? 2 * l->cap : 64;
    l->dst = realloc(l->dst, sizeof *l->dst * (size_t)l->cap);
    l->src = realloc(l->src, sizeof *l->src * (size_t)l->cap);
    if (l->dst == NULL || l->src == NULL) out_of_memory();
  }
  int64_t shape[TENSOR_MAX_DIMS];
  memcpy(shape, full->shape, sizeof shape);
  shape[0] = len;
  fsdpc_tensor_t rows, slot, slot_nd;
  BENCH_TRY(tensor_narrow(&rows, full, 0, start, len));
  BENCH_TRY(tensor_narrow(&slot, flat, 0, pos, len * row));
  BENCH_TRY(tensor_view(&slot_nd, &slot, full->ndim, shape));
  tensor_free(&slot);
  l->dst[l->n] = to_flat ? slot_nd : rows;
  l->src[l->n++] = to_flat ? rows : slot_nd;
  l->bytes += (double)(len * row) * (double)(dtype_size(full->dtype) + dtype_size(flat->dtype));
}

static void list_free(copy_list_t *l) {
  for (int i = 0; i < l->n; i++) {
    tensor_free(&l->dst[i]);
    tensor_free(&l->src[i]);
  }
  free(l->dst);
  free(l->src);
}

enum { COPY_IN, COPY_OUT, COPY_PACK, COPY_KINDS };

/* The copy lists fully_shard makes for one group of parameters ps[0..n) on rank 0 of W:
 * copy-in (its shards, in their dtype sdt, cast into its block of the gather buffer in pdt),
 * copy-out (every rank's rows out of the gather buffer into the unsharded parameters) and
 * reduce-scatter packing (every rank's rows of the unsharded gradients, in pdt, into the send
 * buffer in rdt), each padded to the chunk rule's rows. Buffers on dev. */
static void group_lists(nn_param_t **ps, int n, int W, dtype_t sdt, dtype_t pdt, dtype_t rdt,
                        device_t dev, copy_list_t *lists) {
  int64_t flat = 0;
  for (int i = 0; i < n; i++) {
    const int64_t *shape = dtensor_shape(ps[i]->value);
    int64_t row = 1;
    for (int k = 1; k < dtensor_ndim(ps[i]->value); k++) row *= shape[k];
    flat += placement_chunk_size(shape[0], W) * row;
  }
  int64_t total = flat * W;
  fsdpc_tensor_t gather, send;
  BENCH_TRY(tensor_zeros(&gather, pdt, dev, 1, &total));
  BENCH_TRY(tensor_zeros(&send, rdt, dev, 1, &total));
  int64_t off = 0;
  for (int i = 0; i < n; i++) {
    int nd = dtensor_ndim(ps[i]->value);
    const int64_t *shape = dtensor_shape(ps[i]->value);
    int64_t row = 1;
    for (int k = 1; k < nd; k++) row *= shape[k];
    int64_t rows = placement_chunk_size(shape[0], W), padded[TENSOR_MAX_DIMS];
    memcpy(padded, shape, sizeof(int64_t) * (size_t)nd);
    padded[0] = rows;
    fsdpc_tensor_t shard, full, grad;
    BENCH_TRY(tensor_zeros(&shard, sdt, dev, nd, padded));
    BENCH_TRY(tensor_zeros(&full, pdt, dev, nd, shape));
    BENCH_TRY(tensor_zeros(&grad, pdt, dev, nd, shape));
    list_add(&lists[COPY_IN], &shard, &gather, 0, rows, row, off, true);
    for (int r = 0; r < W; r++) {
      int64_t start, len;
      placement_chunk_range(shape[0], W, r, &start, &len);
      list_add(&lists[COPY_OUT], &full, &gather, start, len, row, r * flat + off, false);
      list_add(&lists[COPY_PACK], &grad, &send, start, len, row, r * flat + off, true);
    }
    tensor_free(&shard);
    tensor_free(&full);
    tensor_free(&grad);
    off += rows * row;
  }
  tensor_free(&gather);
  tensor_free(&send);
}

/* FSDP's copy lists of the whole model (one group per decoder layer, one for the rest) run
 * alone, each kind back to back over the groups, and their rate (bytes read and written per
 * second, the best of five) against dev_rate. The step's own figure above runs them beside the
 * compute they overlap; this one is the kernels'. Timed on the host from a synchronised device
 * to the end of the kind's last launch, so the launch latency counts against them (dev_rate's
 * copy is timed by device events). */
static void fsdp_copy_lists(nn_param_t **ps, int n, int W, dtype_t sdt, dtype_t pdt, dtype_t rdt,
                            device_t dev, double dev_rate) {
  nn_param_t **grp = malloc(sizeof *grp * (size_t)n);
  copy_list_t *lists = calloc((size_t)COPY_KINDS * 65, sizeof *lists);
  if (grp == NULL || lists == NULL) out_of_memory();
  int ng = 0;
  for (int layer = -1;; layer++) { /* -1: the parameters outside the decoder layers */
    char prefix[48];
    snprintf(prefix, sizeof prefix, "model.layers.%d.", layer);
    int k = 0;
    for (int i = 0; i < n; i++) {
      bool in_layer = strncmp(ps[i]->fqn, "model.layers.", 13) == 0;
      if (layer < 0 ? !in_layer : strncmp(ps[i]->fqn, prefix, strlen(prefix)) == 0)
        grp[k++] = ps[i];
    }
    if (k == 0 && layer >= 0) break;
    if (ng == 65) {
      fprintf(stderr, "bench-fsdp-step: the copy lists take 64 layers at most\n");
      exit(1);
    }
    group_lists(grp, k, W, sdt, pdt, rdt, dev, &lists[COPY_KINDS * ng++]);
  }
  static const char *names[] = {"copy-in (shards cast into the gather buffer)",
                                "copy-out (gather buffer into the parameters)",
                                "packing (gradients into the reduce-scatter buffer)"};
  double all_bytes = 0, all_s = 0;
  for (int kind = 0; kind < COPY_KINDS; kind++) {
    double bytes = 0, best = 1e30;
    int launches = 0;
    for (int g = 0; g < ng; g++) bytes += lists[COPY_KINDS * g + kind].bytes;
    for (int rep = 0; rep < 6; rep++) {
      BENCH_TRY(device_stream_sync(dev));
      double t0 = device_clock_seconds();
      for (int g = 0; g < ng; g++) {
        copy_list_t *l = &lists[COPY_KINDS * g + kind];
        BENCH_TRY(tensor_copy_many(l->dst, l->src, l->n));
        launches += rep == 0;
      }
      BENCH_TRY(device_stream_sync(dev));
      double t = device_clock_seconds() - t0;
      if (rep > 0 && t < best) best = t; /* the first warms up */
    }
    all_bytes += bytes;
    all_s += best;
    printf("  %-52s %7.1f MB in %2d lists: %7.1f GB/s, %3.0f%% of it\n", names[kind], bytes / 1e6,
           launches, bytes / best / 1e9, dev_rate > 0 ? 100 * bytes / best / 1e9 / dev_rate : 0);
  }
  printf("  %-52s %7.1f MB: %7.1f GB/s, %3.0f%% of it\n", "all three", all_bytes / 1e6,
         all_bytes / all_s / 1e9, dev_rate > 0 ? 100 * all_bytes / all_s / 1e9 / dev_rate : 0);
  for (int g = 0; g < ng; g++)
    for (int kind = 0; kind < COPY_KINDS; kind++) list_free(&lists[COPY_KINDS * g + kind]);
  free(lists);
  free(grp);
}

int main(int argc, char **argv) {
  BENCH_TRY(world_init(&argc, &argv));
  bench_args(argc, argv,
             "Times FSDP training steps of a Llama and prints the communication and peak memory "
             "per step, measured and from the closed form.",
             OPTIONS);
  int rank = world_rank(), W = world_size();
  llama_config_t cfg;
  llama_options_t lopt;
  bench_model(argc, argv, SOURCE_ROOT "/configs/llama-small.json", &cfg, &lopt);
  int R = (int)bench_int(argc, argv, "--hsdp", 1, 1, W);
  int reshard = reshard_arg(argc, argv);
  dtype_t pdt;
  BENCH_TRY(dtype_parse(bench_opt(argc, argv, "--param-dtype", "f32"), &pdt));
  int64_t steps = bench_int(argc, argv, "--steps", 5, 1, 1000000);
  mesh_t *mesh;
  if (R > 1) {
    int shape[2] = {R, -1};
    const char *names[] = {"dp_replicate", "dp_shard"};
    BENCH_TRY(mesh_new(2, shape, names, lopt.device, &mesh));
  } else {
    const char *names[] = {"dp_shard"};
    BENCH_TRY(mesh_new(1, &W, names, lopt.device, &mesh));
  }
  int md = mesh_ndim(mesh), Ws = mesh_size(mesh, md - 1);
  int dp_rank = md == 2 ? mesh_coord(mesh, 0) * Ws + mesh_coord(mesh, 1) : mesh_coord(mesh, 0);
  data_spec_t spec = {.batch_size = bench_int(argc, argv, "--batch", 2, 1, 1 << 20),
                      .seq_len = bench_int(argc, argv, "--seq", 128, 1, 1 << 24),
                      .grad_accum = 1,
                      .dp_size = W,
                      .dp_rank = dp_rank};
  llama_t *m;
  BENCH_TRY(llama_new(&cfg, &lopt, &m)); /* deferred: memory for the shards only */
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  opt.reshard_after_forward = reshard;
  opt.param_dtype = pdt == lopt.dtype ? DTYPE_COUNT : pdt;
  opt.reduce_dtype = lopt.dtype;
  opt.offload = bench_flag(argc, argv, "--offload");
  opt.shard_state_over_replicas = bench_flag(argc, argv, "--hfsdp");
  if (opt.shard_state_over_replicas && R == 1) {
    fprintf(stderr, "%s: --hfsdp needs --hsdp R with R > 1\n", bench_prog(argv));
    bench_leave(2);
  }
  int ng = (int)cfg.n_layers + 1;
  fsdp_group_t **groups = calloc((size_t)ng, sizeof *groups);
  for (int i = 0; i < cfg.n_layers; i++)
    BENCH_TRY(fully_shard(llama_layer(m, i), &opt, &groups[i]));
  opt.reshard_after_forward = FSDP_RESHARD_AUTO;
  BENCH_TRY(fully_shard(llama_module(m), &opt, &groups[cfg.n_layers]));
  bench_init(m, 1);
  pg_t **post = calloc((size_t)ng, sizeof *post); /* each post-forward group once */
  int npost = fsdp_post_forward_groups(groups, ng, post);
  nn_param_t **ps;
  int n;
  BENCH_TRY(nn_named_parameters(llama_module(m), &ps, &n));
  adamw_config_t acfg = ADAMW_CONFIG_INIT;
  optim_t *o;
  BENCH_TRY(optim_new(ps, n, &acfg, &o));
  fsdpc_data_t *d;
  BENCH_TRY(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  pg_t *shard = mesh_group(mesh, md - 1), *rep = md == 2 ? mesh_group(mesh, 0) : NULL;
  mesh_t *flat = NULL;
  if (md == 2) {
    const char *names[] = {"dp_replicate", "dp_shard"};
    BENCH_TRY(mesh_flatten(mesh, 2, names, "dp", &flat));
  }
  pg_t *all_ranks = mesh_group(md == 2 ? flat : mesh, 0);
  size_t pbytes = dtype_size(pdt), rbytes = dtype_size(lopt.dtype);
  double P = (double)llama_num_params(&cfg), largest = 0;
  for (int i = 0; i < ng; i++) {
    double b = (double)fsdp_gather_numel(groups[i]) * Ws * (double)pbytes;
    largest = b > largest ? b : largest;
  }
  device_t dev = mesh_device(mesh);
  if (rank == 0)
    printf(
        "llama %lld params, %lld layers; mesh %s x %d; reshard %s; param %s, reduce %s; "
        "batch %lld x %lld per rank\n",
        (long long)P, (long long)cfg.n_layers,
        R == 1                          ? "fsdp"
        : opt.shard_state_over_replicas ? "hfsdp"
                                        : "hsdp",
        W, bench_opt(argc, argv, "--reshard", "auto"), dtype_name(pdt), dtype_name(lopt.dtype),
        (long long)spec.batch_size, (long long)spec.seq_len);
  for (int64_t s = 0; s < steps; s++) {
    pg_reset_counters(shard);
    if (rep) pg_reset_counters(rep);
    for (int i = 0; i < npost; i++) pg_reset_counters(post[i]);
    optim_zero_grad(o);
    size_t base = mem_stats(dev).current, host_base = mem_stats(device_cpu()).current;
    mem_reset_peak(dev);
    mem_reset_peak(device_cpu());
    BENCH_TRY(pg_barrier(world_pg(), NULL));
    double t0 = device_clock_seconds();
    train_step(m, d, &spec, s, ps, n, all_ranks, o, dev);
    double dt = device_clock_seconds() - t0;
    uint64_t ag = sum_kind(shard, PG_ALL_GATHER), rsb = sum_kind(shard, PG_REDUCE_SCATTER);
    /* HSDP's all-reduce over the replicas; HFSDP's reduce-scatter and gather there */
    uint64_t ar = sum_kind(rep, PG_ALL_REDUCE) + sum_kind(rep, PG_REDUCE_SCATTER) +
                  sum_kind(rep, PG_ALL_GATHER);
    for (int i = 0; i < npost; i++) ag += sum_kind(post[i], PG_ALL_GATHER);
    double f = (double)(Ws - 1) / Ws;
    double ag_model = (reshard == 0 ? 1 : 2) * f * P * (double)pbytes,
           rs_model = f * P * (double)rbytes;
    /* HFSDP: (R-1)/R of a shard reduce-scattered, and of the updated shard gathered */
    double ar_model = R == 1                          ? 0
                      : opt.shard_state_over_replicas ? (R - 1.0) / R * P / Ws * (double)rbytes +
                                                            (R - 1.0) / R * P / Ws * (double)rbytes
                                                      : 2.0 * (R - 1) / R * P / Ws * (double)rbytes;
    size_t peak = mem_stats(dev).peak;
    /* params, grads, two Adam moments; HFSDP: those over every rank, the 1/dp_shard shards */
    double state = opt.shard_state_over_replicas ? (4.0 * P / W + P / Ws) * (double)rbytes
                                                 : 4.0 * P / Ws * (double)rbytes;
    if (rank == 0)
      printf(
          "step %lld: %.3f s | all-gather %.0f B (model %.0f) reduce-scatter %.0f B (model "
          "%.0f) replicas %.0f B (model %.0f) | peak %.2f MiB (resident %.2f MiB; sharded "
          "state %.2f MiB, largest group %.2f MiB)\n",
          (long long)s, dt, (double)ag, ag_model, (double)rsb, rs_model, (double)ar, ar_model,
          peak / 1048576.0, base / 1048576.0, state / 1048576.0, largest / 1048576.0);
    if (rank == 0 && opt.offload)
      printf("        host: peak %.2f MiB (resident %.2f MiB)\n",
             mem_stats(device_cpu()).peak / 1048576.0, host_base / 1048576.0);
  }
  state_share(ps, n, o, P, W, Ws, R, opt.shard_state_over_replicas);
  if (dev.type == DEVICE_CUDA) {
    host_time(m, d, &spec, steps, ps, n, ng, all_ranks, o, dev);
    call_costs(dev);
  }
  /* FSDP's own copies (copy-in with its cast, copy-out, reduce-scatter packing) in one more
   * step, profiled, against the device's copy bandwidth */
  bool was_on = kernel_profile_enabled();
  kernel_profile_enable(true);
  double dev_rate = device_copy_rate(dev);
  kernel_profile_reset();
  optim_zero_grad(o);
  bool one_rank = W / R == 1; /* its copies are those of the flat-buffer path, turned on */
  if (one_rank) fsdp_set_one_rank_path(false);
  train_step(m, d, &spec, steps, ps, n, all_ranks, o, dev);
  if (one_rank) fsdp_set_one_rank_path(true);
  int64_t nc, ncast, nbatch;
  double rc = copy_rate("copy", &nc), rcast = copy_rate("copy (cast)", &ncast),
         rbatch = copy_rate("copy (batched)", &nbatch);
  kernel_profile_reset();
  kernel_profile_enable(was_on);
  if (rank == 0) {
    printf(
        "copies within the device in a step (profiled; a copy of 64 MiB runs at %.1f GB/s "
        "read + written)%s:\n",
        dev_rate,
        one_rank ? "; shard groups of one rank take the flat-buffer path for this step "
                   "(FSDPC_FSDP_ONE_RANK=0), whose copies the one-rank path skips"
                 : "");
    if (nbatch > 0)
      printf(
          "  FSDP's copy-in, copy-out and packing, batched, beside the compute they overlap: "
          "%lld launches at %.1f GB/s, %.0f%% of it\n",
          (long long)nbatch, rbatch, dev_rate > 0 ? 100 * rbatch / dev_rate : 0.0);
    printf("  one by one, same dtype: %lld copies at %.1f GB/s, %.0f%% of it\n", (long long)nc, rc,
           dev_rate > 0 ? 100 * rc / dev_rate : 0.0);
    if (ncast > 0)
      printf("  one by one, casts:      %lld copies at %.1f GB/s, %.0f%% of it\n", (long long)ncast,
             rcast, dev_rate > 0 ? 100 * rcast / dev_rate : 0.0);
  }
  if (rank == 0) {
    printf("FSDP's copy lists for this model on rank 0 of %d, alone (tensor_copy_many, %s):\n", Ws,
           dev.type == DEVICE_CUDA ? "one launch a list" : "one copy at a time");
    fsdp_copy_lists(ps, n, Ws, lopt.dtype, pdt, lopt.dtype, dev, dev_rate);
  }
  if (rank == 0)
    printf(
        "model: all-gathers 2 (W-1)/W P bytes(param) with resharding, 1x without (the root "
        "gathers once either way, so measured is lower), reduce-scatters (W-1)/W P "
        "bytes(reduce), HSDP all-reduce 2 (R-1)/R P/W bytes(reduce) (HFSDP: a reduce-scatter "
        "(R-1)/R P/W bytes(reduce) and a gather of the updated shards (R-1)/R P/W bytes(param) "
        "over the replicas); P unpadded, measured "
        "padded; an integer reshard moves the backward gathers into groups of N\n");
  free(ps);
  optim_free(o);
  fsdp_free_all(llama_module(m));
  llama_free(m);
  free(groups);
  free(post);
  data_free(d);
  mesh_free(flat);
  mesh_free(mesh);
  world_finalize();
  return 0;
}
