/*
 * The MLP of mlp_fsdp.c parallelised by a YAML plan instead of code: the plan's mesh, its
 * tensor-parallel rules (which split the linears by their declared kind, nothing here knows
 * them) and its fully_shard units. Any plan, at any world size it fits, prints the losses of
 * one rank.
 *
 *   mpirun -n 4 build/examples/mlp-plan examples/mlp_tp.yaml [STEPS]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "mesh/world.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/optim.h"
#include "parallel/parallelize.h"

enum { IN = 16, HIDDEN = 64, OUT = 4, BATCH = 16 }; /* BATCH: the global batch */

/* Data-parallel rank d's part of batch `step` (the ranks of one tensor-parallel group share
 * it): sample i has x ~ N(0, 1) by index and target y_k = tanh(x_k + x_{k+4} * x_{k+8}). */
static fsdpc_status_t batch(int64_t step, int d, int dp, fsdpc_tensor_t *x, fsdpc_tensor_t *y) {
  int64_t b = BATCH / dp, first = step * BATCH + d * b;
  FSDPC_TRY(tensor_init(x, DTYPE_F32, device_cpu(), 2, (int64_t[]){b, IN}));
  FSDPC_TRY(tensor_init(y, DTYPE_F32, device_cpu(), 2, (int64_t[]){b, OUT}));
  float *xv = x->data, *yv = y->data;
  for (int64_t i = 0; i < b * IN; i++)
    xv[i] = (float)nn_init_normal_value(7, "x", (uint64_t)(first * IN + i));
  for (int64_t i = 0; i < b; i++)
    for (int k = 0; k < OUT; k++)
      yv[i * OUT + k] = tanhf(xv[i * IN + k] + xv[i * IN + k + 4] * xv[i * IN + k + 8]);
  return STATUS_OK;
}

static fsdpc_status_t build(nn_module_t **model) {
  nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;
  lo.deferred = true;
  nn_module_t *m;
  FSDPC_TRY(nn_sequential_new(NULL, "", &m));
  fsdpc_status_t st = nn_linear_new(m, "fc1", IN, HIDDEN, true, &lo, NULL);
  if (st == STATUS_OK) st = nn_activation_new(m, "act1", KERNEL_ACT_GELU, NULL);
  if (st == STATUS_OK) st = nn_linear_new(m, "fc2", HIDDEN, HIDDEN, true, &lo, NULL);
  if (st == STATUS_OK) st = nn_activation_new(m, "act2", KERNEL_ACT_RELU, NULL);
  if (st == STATUS_OK) st = nn_linear_new(m, "head", HIDDEN, OUT, true, &lo, NULL);
  if (st == STATUS_OK) st = nn_module_finalize(m);
  if (st != STATUS_OK) nn_module_free(m);
  *model = st == STATUS_OK ? m : NULL;
  return st;
}

/* One step; *loss is the loss over the global batch (every rank holds it). */
static fsdpc_status_t step(nn_module_t *model, const parallel_t *par, nn_param_t **ps, int n,
                           optim_t *opt, int64_t s, float *loss) {
  fsdpc_tensor_t x = {0}, y = {0};
  nn_ctx_t *ctx = NULL;
  nn_var_t *in = NULL, *pred = NULL, *l = NULL;
  double local = 0, norm = 0;
  fsdpc_status_t st = batch(s, parallel_dp_rank(par), parallel_dp_size(par), &x, &y);
  if (st == STATUS_OK) st = nn_ctx_new(&ctx);
  if (st == STATUS_OK) st = nn_var_new(&x, false, &in);
  if (st == STATUS_OK) st = nn_call(ctx, model, in, &pred);
  if (st == STATUS_OK) st = nn_mse_loss(ctx, pred, &y, &l);
  if (st == STATUS_OK) st = nn_var_scalar(l, &local);
  if (st == STATUS_OK) st = nn_backward(ctx, l);
  if (st == STATUS_OK) st = clip_grad_norm(ps, n, 1.0, parallel_all_group(par), &norm);
  if (st == STATUS_OK) st = optim_step(opt, 1.0);
  optim_zero_grad(opt);
  *loss = (float)local; /* equal on the ranks of a tp group: the average over all is the mean */
  if (st == STATUS_OK)
    st = pg_all_reduce(parallel_all_group(par), loss, loss, 1, DTYPE_F32, REDUCE_AVG, NULL);
  nn_var_put(l);
  nn_var_put(pred);
  nn_var_put(in);
  nn_ctx_free(ctx);
  tensor_free(&x);
  tensor_free(&y);
  return st;
}

static fsdpc_status_t train(const char *plan_file, int steps) {
  parallel_plan_t pp;
  FSDPC_TRY(parallel_plan_load(&pp, plan_file, NULL, 0));
  FSDPC_TRY(parallel_plan_resolve(&pp, world_size()));
  if (BATCH % (pp.dp_replicate * pp.dp_shard) != 0)
    return err_set(STATUS_EINVAL, "%s: %d data-parallel ranks do not split the batch of %d",
                   plan_file, pp.dp_replicate * pp.dp_shard, BATCH);
  nn_module_t *model = NULL;
  parallel_t *par = NULL;
  nn_param_t **ps = NULL;
  optim_t *opt = NULL;
  int n = 0;
  fsdpc_status_t st = build(&model);
  if (st == STATUS_OK) st = parallel_apply(model, &pp, DEVICE_CPU, &par);
  if (st == STATUS_OK) st = nn_module_materialize(model);
  if (st == STATUS_OK) st = nn_module_reset_parameters(model, 1234);
  adamw_config_t ac = ADAMW_CONFIG_INIT;
  ac.lr = 1e-2;
  if (st == STATUS_OK) st = nn_named_parameters(model, &ps, &n);
  if (st == STATUS_OK) st = optim_new(ps, n, &ac, &opt);
  for (int64_t s = 0; s < steps && st == STATUS_OK; s++) {
    float loss;
    st = step(model, par, ps, n, opt, s, &loss);
    if (st == STATUS_OK && world_rank() == 0) printf("step %lld loss %.9g\n", (long long)s + 1, loss);
  }
  optim_free(opt);
  free(ps);
  parallel_free(par);
  nn_module_free(model);
  return st;
}

int main(int argc, char **argv) {
  if (world_init(&argc, &argv) != STATUS_OK) {
    fprintf(stderr, "mlp-plan: %s\n", err_detail());
    return 1;
  }
  fsdpc_status_t st = argc < 2 ? err_set(STATUS_EINVAL, "usage: mlp-plan PLAN.yaml [STEPS]")
                               : train(argv[1], argc > 2 ? atoi(argv[2]) : 20);
  if (st != STATUS_OK) {
    fprintf(stderr, "mlp-plan: rank %d: %s\n", world_rank(), err_detail());
    world_stop(st); /* the other ranks fail with this message instead of waiting */
  }
  world_finalize();
  return st == STATUS_OK ? 0 : 1;
}
