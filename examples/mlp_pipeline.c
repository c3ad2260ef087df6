/*
 * A model of your own, pipelined: the MLP of mlp_fsdp.c split into two stages (fc1 and its
 * activation; fc2, its activation, the head and the loss) on two pipeline ranks, each step's
 * batch pushed through as 4 microbatches by the 1F1B schedule. With more ranks than two, the
 * world is (pp 2, dp N) and each stage is fully sharded over its N data-parallel ranks. The
 * same synthetic data and initial values as mlp-fsdp: every world size prints its losses.
 *
 *   mpirun -n 2 build/examples/mlp-pipeline [STEPS]      # or -n 4, 8: pp 2 x dp 2, 4
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "fully_shard/fsdp.h"
#include "mesh/world.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/ops.h"
#include "nn/optim.h"
#include "parallel/pipeline.h"

enum { IN = 16, HIDDEN = 64, OUT = 4, BATCH = 16, MICRO = 4 }; /* BATCH: the global batch */

typedef struct job {
  nn_module_t *model;
  int64_t step, first, per_micro; /* this dp rank's samples start at first */
} job_t;

/* Samples [first, first + n): x ~ N(0, 1) drawn by index, y_k = tanh(x_k + x_{k+4} x_{k+8}),
 * as mlp-fsdp draws them. */
static fsdpc_status_t samples(int64_t first, int64_t n, fsdpc_tensor_t *x, fsdpc_tensor_t *y) {
  FSDPC_TRY(tensor_init(x, DTYPE_F32, device_cpu(), 2, (int64_t[]){n, IN}));
  FSDPC_TRY(tensor_init(y, DTYPE_F32, device_cpu(), 2, (int64_t[]){n, OUT}));
  float *xv = x->data, *yv = y->data;
  for (int64_t i = 0; i < n * IN; i++)
    xv[i] = (float)nn_init_normal_value(7, "x", (uint64_t)(first * IN + i));
  for (int64_t i = 0; i < n; i++)
    for (int k = 0; k < OUT; k++)
      yv[i * OUT + k] = tanhf(xv[i * IN + k] + xv[i * IN + k + 4] * xv[i * IN + k + 8]);
  return STATUS_OK;
}

/* Stage 0's input of microbatch m: its samples' x. */
static fsdpc_status_t input(int m, nn_var_t **out, void *user) {
  job_t *j = user;
  fsdpc_tensor_t x, y;
  FSDPC_TRY(samples(j->first + m * j->per_micro, j->per_micro, &x, &y));
  tensor_free(&y);
  return nn_var_new(&x, false, out);
}

/* Calls the module named name on *h, in place of *h. */
static fsdpc_status_t call(nn_ctx_t *ctx, job_t *j, const char *name, nn_var_t **h) {
  nn_var_t *next = NULL;
  fsdpc_status_t st = nn_call(ctx, nn_module_find(j->model, name), *h, &next);
  nn_var_put(*h);
  *h = next;
  return st;
}

/* Stage 0: fc1, act1. Stage 1: fc2, act2, head, then the mean squared error to microbatch
 * m's targets. */
static fsdpc_status_t stage(nn_ctx_t *ctx, int s, int m, nn_var_t *in, nn_var_t **out, void *user) {
  job_t *j = user;
  static const char *const names[2][3] = {{"fc1", "act1", NULL}, {"fc2", "act2", "head"}};
  nn_var_t *h = nn_var_ref(in);
  fsdpc_status_t st = STATUS_OK;
  for (int k = 0; k < 3 && names[s][k] && st == STATUS_OK; k++) st = call(ctx, j, names[s][k], &h);
  if (st == STATUS_OK && s == 1) {
    fsdpc_tensor_t x = {0}, y = {0};
    nn_var_t *loss = NULL;
    st = samples(j->first + m * j->per_micro, j->per_micro, &x, &y);
    if (st == STATUS_OK) st = nn_mse_loss(ctx, h, &y, &loss);
    tensor_free(&x);
    tensor_free(&y);
    nn_var_put(h);
    h = loss;
  }
  if (st != STATUS_OK) {
    nn_var_put(h);
    return st;
  }
  *out = h;
  return STATUS_OK;
}

static fsdpc_status_t train(int steps) {
  int world = world_size(), dp = world / 2;
  if (world % 2 != 0 || BATCH % (dp * MICRO) != 0)
    return err_set(STATUS_EINVAL, "%d ranks: an even number whose half splits %d samples by %d",
                   world, BATCH, MICRO);
  nn_module_t *model = NULL;
  mesh_t *mesh = NULL, *dp_mesh = NULL;
  nn_param_t **ps = NULL;
  optim_t *opt = NULL;
  pp_schedule_t *sched = NULL;
  int n = 0;
  nn_layer_options_t lo = NN_LAYER_OPTIONS_INIT;
  lo.deferred = true;
  fsdpc_status_t st = nn_sequential_new(NULL, "", &model);
  if (st == STATUS_OK) st = nn_linear_new(model, "fc1", IN, HIDDEN, true, &lo, NULL);
  if (st == STATUS_OK) st = nn_activation_new(model, "act1", KERNEL_ACT_GELU, NULL);
  if (st == STATUS_OK) st = nn_linear_new(model, "fc2", HIDDEN, HIDDEN, true, &lo, NULL);
  if (st == STATUS_OK) st = nn_activation_new(model, "act2", KERNEL_ACT_RELU, NULL);
  if (st == STATUS_OK) st = nn_linear_new(model, "head", HIDDEN, OUT, true, &lo, NULL);
  if (st == STATUS_OK) st = nn_module_finalize(model);
  /* the world as (pp, dp): rank r is stage r / dp's, data-parallel rank r % dp */
  const char *names[] = {"pp", "dp"};
  if (st == STATUS_OK) st = mesh_new(2, (int[]){2, dp}, names, DEVICE_CPU, &mesh);
  if (st == STATUS_OK) st = mesh_slice(mesh, 1, &names[1], &dp_mesh);
  int r = st == STATUS_OK ? mesh_coord(mesh, 0) : 0;
  /* this rank's stage fully sharded over its dp ranks, each linear one unit */
  fsdp_options_t fo = FSDP_OPTIONS_INIT;
  fo.mesh = dp_mesh;
  const char *units[2][2] = {{"fc1", NULL}, {"fc2", "head"}};
  for (int k = 0; k < 2 && units[r][k] && st == STATUS_OK; k++)
    st = fully_shard(nn_module_find(model, units[r][k]), &fo, NULL);
  if (st == STATUS_OK) st = nn_module_materialize(model);
  if (st == STATUS_OK) st = nn_module_reset_parameters(model, 1234);
  adamw_config_t ac = ADAMW_CONFIG_INIT;
  ac.lr = 1e-2;
  if (st == STATUS_OK) st = nn_named_parameters(model, &ps, &n);
  if (st == STATUS_OK) st = optim_new(ps, n, &ac, &opt);
  if (st == STATUS_OK) st = pp_schedule_new(PP_1F1B, 2, MICRO, 1, &sched);
  job_t job = {.model = model, .per_micro = BATCH / dp / MICRO};
  pp_step_options_t po = PP_STEP_OPTIONS_INIT;
  po.group = st == STATUS_OK ? mesh_group(mesh, 0) : NULL;
  po.schedule = sched;
  po.ndim = 2;
  po.shape[0] = job.per_micro, po.shape[1] = HIDDEN;
  po.forward = stage;
  po.input = input;
  po.user = &job;
  for (int64_t s = 0; s < steps && st == STATUS_OK; s++) {
    double loss = 0, norm;
    job.step = s;
    job.first = s * BATCH + (st == STATUS_OK ? mesh_coord(mesh, 1) : 0) * (BATCH / dp);
    st = pp_step(&po, &loss); /* the gradients of this rank's stage, reduced over dp */
    /* the norm over both stages and every shard; the parameters of the other stage have no
     * gradient here and are left alone */
    if (st == STATUS_OK) st = clip_grad_norm(ps, n, 1.0, world_pg(), &norm);
    if (st == STATUS_OK) st = optim_step(opt, 1.0);
    optim_zero_grad(opt);
    float l = (float)loss; /* the mean over the dp ranks' pipelines */
    if (st == STATUS_OK)
      st = pg_all_reduce(mesh_group(mesh, 1), &l, &l, 1, DTYPE_F32, REDUCE_AVG, NULL);
    if (st == STATUS_OK && world_rank() == 0) printf("step %lld loss %.9g\n", (long long)s + 1, l);
  }
  pp_schedule_free(sched);
  optim_free(opt);
  free(ps);
  nn_module_free(model); /* its fully_shard groups too */
  mesh_free(dp_mesh);
  mesh_free(mesh);
  return st;
}

int main(int argc, char **argv) {
  if (world_init(&argc, &argv) != STATUS_OK) {
    fprintf(stderr, "mlp-pipeline: %s\n", err_detail());
    return 1;
  }
  fsdpc_status_t st = train(argc > 1 ? atoi(argv[1]) : 20);
  if (st != STATUS_OK) {
    fprintf(stderr, "mlp-pipeline: rank %d: %s\n", world_rank(), err_detail());
    world_stop(st); /* the other ranks fail with this message instead of waiting */
  }
  world_finalize();
  return st == STATUS_OK ? 0 : 1;
}
