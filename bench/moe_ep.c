/*
 * Expert parallelism of the MoE block (nn/moe.h) on the world's ranks: every rank trains the
 * block (forward and backward) over its own tokens with the experts whole on each rank (ep 1)
 * and split over groups of ep ranks (mesh (world / ep, ep)), for each ep given. Prints the
 * tokens a second over the world, the step's time, and the share of it in the all-to-all
 * (the step's four exchanges timed again alone, with the same counts: this rank's rows for
 * each peer from its routing, the peers' for its experts). Figures, not assertions.
 *
 *   mpirun -n 4 bench-moe-ep [--dim 256] [--ffn 512] [--experts 8] [--top-k 2]
 *       [--tokens 2048] [--steps 5]
 */
#include <math.h>

#include "bench/bench_util.h"
#include "mesh/world.h"
#include "nn/moe.h"

static const bench_option_t OPTIONS[] = {
    {"--dim", "N", "hidden size (default 256)"},
    {"--ffn", "N", "an expert's hidden size (default 512)"},
    {"--experts", "E", "experts (default 8)"},
    {"--top-k", "K", "experts a token (default 2)"},
    {"--tokens", "N", "tokens a rank (default 2048)"},
    {"--steps", "N", "steps an ep, the first not timed (default 5)"},
    {NULL, NULL, NULL}};

typedef struct sizes {
  int64_t dim, ffn, tokens;
  int E, k;
} sizes_t;

static nn_module_t *block(const sizes_t *z) {
  nn_module_t *m;
  BENCH_TRY(nn_moe_new(NULL, "", z->dim, z->ffn, z->E, z->k, true, NULL, &m));
  BENCH_TRY(nn_module_finalize(m));
  BENCH_TRY(nn_module_reset_parameters(m, 7));
  return m;
}

/* One step: forward and backward of this rank's tokens; its seconds. */
static double step(nn_module_t *m, const sizes_t *z, uint64_t seed) {
  fsdpc_tensor_t x, g;
  int64_t shape[2] = {z->tokens, z->dim};
  BENCH_TRY(tensor_init(&x, DTYPE_F32, device_cpu(), 2, shape));
  BENCH_TRY(tensor_init(&g, DTYPE_F32, device_cpu(), 2, shape));
  for (int64_t i = 0; i < z->tokens * z->dim; i++) {
    ((float *)x.data)[i] = (float)sin(0.1 * (double)i + (double)seed);
    ((float *)g.data)[i] = (float)cos(0.07 * (double)i);
  }
  BENCH_TRY(pg_barrier(world_pg(), NULL));
  double t0 = device_clock_seconds();
  nn_ctx_t *ctx;
  nn_var_t *in, *out;
  BENCH_TRY(nn_ctx_new(&ctx));
  BENCH_TRY(nn_var_new(&x, true, &in));
  BENCH_TRY(nn_call(ctx, m, in, &out));
  BENCH_TRY(nn_backward_grad(ctx, out, &g));
  nn_var_put(out);
  nn_var_put(in);
  nn_ctx_free(ctx);
  double t = device_clock_seconds() - t0, worst;
  BENCH_TRY(pg_host_all_reduce(world_pg(), &t, &worst, 1, PG_HOST_F64, REDUCE_MAX));
  return worst;
}

/* The step's four exchanges alone (forward, back, and their gradients), with the counts of
 * the last routing of m over pg (P ranks); their seconds. */
static double exchanges(nn_module_t *m, const sizes_t *z, pg_t *pg) {
  int P = pg_size(pg), me = pg_rank(pg), L = z->E / P;
  int64_t *load = calloc((size_t)z->E, sizeof *load), *all = calloc((size_t)(z->E * P), 8);
  size_t *send = calloc((size_t)P, sizeof *send), *recv = calloc((size_t)P, sizeof *recv);
  if (!load || !all || !send || !recv || !nn_moe_last_load(m, load, z->E)) bench_leave(1);
  BENCH_TRY(pg_host_all_gather(pg, load, all, z->E, PG_HOST_I64));
  size_t ns = 0, nr = 0;
  for (int q = 0; q < P; q++) {
    for (int l = 0; l < L; l++) {
      send[q] += (size_t)(load[q * L + l] * z->dim);
      recv[q] += (size_t)(all[q * z->E + me * L + l] * z->dim);
    }
    ns += send[q];
    nr += recv[q];
  }
  float *a = calloc(ns + 1, sizeof *a), *b = calloc(nr + 1, sizeof *b);
  if (!a || !b) bench_leave(1);
  BENCH_TRY(pg_barrier(world_pg(), NULL));
  double t0 = device_clock_seconds();
  for (int r = 0; r < 2; r++) {
    BENCH_TRY(pg_all_to_all_v(pg, a, send, b, recv, DTYPE_F32, NULL));
    BENCH_TRY(pg_all_to_all_v(pg, b, recv, a, send, DTYPE_F32, NULL));
  }
  double t = device_clock_seconds() - t0, worst;
  BENCH_TRY(pg_host_all_reduce(world_pg(), &t, &worst, 1, PG_HOST_F64, REDUCE_MAX));
  free(load);
  free(all);
  free(send);
  free(recv);
  free(a);
  free(b);
  return worst;
}

int main(int argc, char **argv) {
  BENCH_TRY(world_init(&argc, &argv));
  bench_args(argc, argv,
             "Trains a MoE block on every rank with its experts whole (ep 1) and split over "
             "groups of 2, 4, ... ranks; prints tokens/s over the world and the all-to-all's "
             "share of the step.",
             OPTIONS);
  sizes_t z = {.dim = bench_int(argc, argv, "--dim", 256, 1, 1 << 16),
               .ffn = bench_int(argc, argv, "--ffn", 512, 1, 1 << 20),
               .tokens = bench_int(argc, argv, "--tokens", 2048, 1, 1 << 24),
               .E = (int)bench_int(argc, argv, "--experts", 8, 1, 4096),
               .k = (int)bench_int(argc, argv, "--top-k", 2, 1, 64)};
  int64_t steps = bench_int(argc, argv, "--steps", 5, 2, 1000);
  int W = world_size();
  if (z.k > z.E) {
    fprintf(stderr, "%s: --top-k %d above --experts %d\n", bench_prog(argv), z.k, z.E);
    bench_leave(2);
  }
  if (world_rank() == 0)
    printf(
        "MoE block dim %lld, %d experts of %lld, top-%d; %lld tokens a rank on %d ranks; "
        "median of steps 2-%lld\n%4s %14s %10s %16s\n",
        (long long)z.dim, z.E, (long long)z.ffn, z.k, (long long)z.tokens, W, (long long)steps,
        "ep", "tokens/s", "step ms", "all-to-all share");
  for (int ep = 1; ep <= W; ep *= 2) {
    if (W % ep != 0 || z.E % ep != 0) continue;
    nn_module_t *m = block(&z);
    mesh_t *mesh = NULL;
    if (ep > 1) {
      int shape[2] = {W / ep, ep};
      BENCH_TRY(mesh_new(2, shape, (const char *[]){"dp", "ep"}, DEVICE_CPU, &mesh));
      BENCH_TRY(nn_moe_expert_parallel(m, mesh, 1));
    }
    double *t = calloc((size_t)steps, sizeof *t);
    if (t == NULL) bench_leave(1);
    for (int64_t s = 0; s < steps; s++) t[s] = step(m, &z, (uint64_t)(s + 1));
    double med = bench_median(t + 1, (int)steps - 1);
    double a2a = ep > 1 ? exchanges(m, &z, mesh_group(mesh, 1)) : 0;
    if (world_rank() == 0)
      printf("%4d %14.0f %10.2f %15.1f%%\n", ep, (double)(z.tokens * W) / med, 1e3 * med,
             100 * a2a / med);
    free(t);
    nn_module_free(m);
    mesh_free(mesh);
  }
  bench_leave(0);
}
