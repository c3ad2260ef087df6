/*
 * A model of your own, fully sharded: an MLP built meta (no memory), each linear layer one
 * fully_shard unit, then given memory for this rank's shards only and PyTorch's default init.
 * It trains on synthetic data whose global batch does not depend on the number of ranks, so
 * every world size prints the same losses.
 *
 *   mpirun -n 4 build/examples/mlp-fsdp [STEPS]
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "fully_shard/fsdp.h"
#include "mesh/world.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/optim.h"

enum { IN = 16, HIDDEN = 64, OUT = 4, BATCH = 16 }; /* BATCH: the global batch */

/* This rank's part of batch `step`: sample i has x ~ N(0, 1) (drawn by its index) and target
 * y_k = tanh(x_k + x_{k+4} * x_{k+8}). */
static fsdpc_status_t batch(int64_t step, int rank, int world, fsdpc_tensor_t *x,
                            fsdpc_tensor_t *y) {
  int64_t b = BATCH / world, first = step * BATCH + rank * b;
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

/* One step: forward, mean squared error, backward (fully_shard reduces the gradients),
 * clipping, AdamW. *loss is the loss over the global batch. */
static fsdpc_status_t step(nn_module_t *model, nn_param_t **ps, int n, optim_t *opt, pg_t *dp,
                           int64_t s, float *loss) {
  fsdpc_tensor_t x = {0}, y = {0};
  nn_ctx_t *ctx = NULL;
  nn_var_t *in = NULL, *pred = NULL, *l = NULL;
  double local = 0, norm = 0;
  fsdpc_status_t st = batch(s, world_rank(), world_size(), &x, &y);
  if (st == STATUS_OK) st = nn_ctx_new(&ctx);
  if (st == STATUS_OK) st = nn_var_new(&x, false, &in);
  if (st == STATUS_OK) st = nn_call(ctx, model, in, &pred);
  if (st == STATUS_OK) st = nn_mse_loss(ctx, pred, &y, &l);
  if (st == STATUS_OK) st = nn_var_scalar(l, &local);
  if (st == STATUS_OK) st = nn_backward(ctx, l);
  if (st == STATUS_OK) st = clip_grad_norm(ps, n, 1.0, dp, &norm);
  if (st == STATUS_OK) st = optim_step(opt, 1.0);
  optim_zero_grad(opt);
  *loss = (float)local; /* the mean of the ranks' means: each holds BATCH / world samples */
  if (st == STATUS_OK) st = pg_all_reduce(dp, loss, loss, 1, DTYPE_F32, REDUCE_AVG, NULL);
  nn_var_put(l);
  nn_var_put(pred);
  nn_var_put(in);
  nn_ctx_free(ctx);
  tensor_free(&x);
  tensor_free(&y);
  return st;
}

static fsdpc_status_t train(int steps) {
  int world = world_size();
  if (BATCH % world != 0)
    return err_set(STATUS_EINVAL, "%d ranks do not split the batch of %d", world, BATCH);
  nn_module_t *model = NULL;
  mesh_t *mesh = NULL;
  nn_param_t **ps = NULL;
  optim_t *opt = NULL;
  int n = 0;
  /* the model, meta: shapes and names only */
  nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;
  lo.deferred = true;
  fsdpc_status_t st = nn_sequential_new(NULL, "", &model);
  if (st == STATUS_OK) st = nn_linear_new(model, "fc1", IN, HIDDEN, true, &lo, NULL);
  if (st == STATUS_OK) st = nn_activation_new(model, "act1", KERNEL_ACT_GELU, NULL);
  if (st == STATUS_OK) st = nn_linear_new(model, "fc2", HIDDEN, HIDDEN, true, &lo, NULL);
  if (st == STATUS_OK) st = nn_activation_new(model, "act2", KERNEL_ACT_RELU, NULL);
  if (st == STATUS_OK) st = nn_linear_new(model, "head", HIDDEN, OUT, true, &lo, NULL);
  if (st == STATUS_OK) st = nn_module_finalize(model);
  /* each linear one unit, the root last, over all ranks */
  if (st == STATUS_OK) st = mesh_new(1, (int[]){world}, (const char *[]){"dp"}, DEVICE_CPU, &mesh);
  fsdp_options_t fo = FSDP_OPTIONS_INIT;
  fo.mesh = mesh;
  const char *units[] = {"fc1", "fc2", "head", ""};
  for (int i = 0; i < 4 && st == STATUS_OK; i++)
    st = fully_shard(nn_module_find(model, units[i]), &fo, NULL);
  /* memory for this rank's shards, then the same initial values as on one rank */
  if (st == STATUS_OK) st = nn_module_materialize(model);
  if (st == STATUS_OK) st = nn_module_reset_parameters(model, 1234);
  adamw_config_t ac = ADAMW_CONFIG_INIT;
  ac.lr = 1e-2;
  if (st == STATUS_OK) st = nn_named_parameters(model, &ps, &n);
  if (st == STATUS_OK) st = optim_new(ps, n, &ac, &opt);
  for (int64_t s = 0; s < steps && st == STATUS_OK; s++) {
    float loss;
    st = step(model, ps, n, opt, mesh_group(mesh, 0), s, &loss);
    if (st == STATUS_OK && world_rank() == 0) printf("step %lld loss %.9g\n", (long long)s + 1, loss);
  }
  optim_free(opt);
  free(ps);
  nn_module_free(model); /* its fully_shard groups too */
  mesh_free(mesh);
  return st;
}

int main(int argc, char **argv) {
  if (world_init(&argc, &argv) != STATUS_OK) {
    fprintf(stderr, "mlp-fsdp: %s\n", err_detail());
    return 1;
  }
  fsdpc_status_t st = train(argc > 1 ? atoi(argv[1]) : 20);
  if (st != STATUS_OK) {
    fprintf(stderr, "mlp-fsdp: rank %d: %s\n", world_rank(), err_detail());
    world_stop(st); /* the other ranks fail with this message instead of waiting */
  }
  world_finalize();
  return st == STATUS_OK ? 0 : 1;
}
