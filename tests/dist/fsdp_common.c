#include "tests/dist/fsdp_common.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/ops.h"
#include "train/train.h"

void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

/* The argument that starts with prefix ("cuda ... hsdp:2" in any order), or NULL. */
static const char *arg_with(const char *prefix) {
  for (int i = 1; i < test_argc(); i++)
    if (strncmp(test_argv()[i], prefix, strlen(prefix)) == 0) return test_argv()[i];
  return NULL;
}

static bool cuda_mode(void) { return arg_with("cuda") != NULL; }
device_type_t test_device_type(void) { return cuda_mode() ? DEVICE_CUDA : DEVICE_CPU; }
bool test_offload(void) { return cuda_mode() && strcmp(arg_with("cuda"), "cuda:offload") == 0; }

bool hsdp_mode(void) { return arg_with("hsdp") != NULL; }
bool hfsdp_mode(void) { return arg_with("hfsdp") != NULL; }
int hsdp_replicas(void) {
  const char *a = arg_with("hsdp");
  return a != NULL && a[4] == ':' ? atoi(a + 5) : 2;
}

/* The data-parallel mesh: 1-D over the world, or (R, W/R) for HSDP. */
mesh_t *dp_mesh(void) {
  mesh_t *m;
  if (hsdp_mode()) {
    int shape[2] = {hsdp_replicas(), -1};
    const char *names[] = {"dp_replicate", "dp_shard"};
    ok(mesh_new(2, shape, names, test_device_type(), &m));
  } else {
    int w = world_size();
    const char *names[] = {"dp_shard"};
    ok(mesh_new(1, &w, names, test_device_type(), &m));
  }
  return m;
}

nn_module_t *params_module(mesh_t *local, int n, const int *ndims, const int64_t (*shapes)[3]) {
  nn_module_t *root;
  ok(nn_module_new("", NULL, NULL, &root));
  for (int i = 0; i < n; i++) {
    fsdpc_tensor_t t;
    ok(tensor_init(&t, DTYPE_F32, device_cpu(), ndims[i], shapes[i]));
    for (int64_t k = 0; k < tensor_numel(&t); k++) ((float *)t.data)[k] = (float)(1000 * i + k);
    dtensor_t *d;
    placement_t rep = placement_replicate();
    ok(dtensor_from_local(&t, local, &rep, ndims[i], shapes[i], &d));
    tensor_free(&t);
    char name[16];
    snprintf(name, sizeof name, "p%d", i);
    ok(nn_module_add_param(root, name, d, true, NULL));
  }
  ok(nn_module_finalize(root));
  return root;
}

void run_init(run_t *r, const llama_config_t *cfg) {
  llama_options_t o = LLAMA_OPTIONS_INIT;
  o.device = test_device_type();
  ok(llama_new(cfg, &o, &r->m));
  ok(llama_init_weights(r->m, 99));
}

void run_optim(run_t *r) {
  ok(nn_named_parameters(llama_module(r->m), &r->ps, &r->n));
  adamw_config_t a = ADAMW_CONFIG_INIT;
  a.lr = 3e-3;
  a.beta2 = 0.95;
  /* Adam's step moves an element by up to lr/eps per unit of gradient where |g| is near eps:
   * with eps 1e-8 an fp32 rounding difference of 1e-10 in one such gradient moved a parameter
   * by 1.8e-5 after one step, a tenth of the whole comparison's tolerance in one element. At
   * 1e-6 the sharded and single-rank runs differ by their sums' rounding alone, so the
   * comparisons keep their margin (and their power: they see a 2e-4 relative error in an
   * accumulated partial gradient). */
  a.eps = 1e-6;
  a.weight_decay = 0.1;
  a.groups[a.n_groups++] = (adamw_group_t){"*norm*", -1, 0.0};
  a.groups[a.n_groups++] = (adamw_group_t){"model.embed_tokens.*", 1e-3, -1};
  ok(optim_new(r->ps, r->n, &a, &r->opt));
}

/* ||a||_2 of a float tensor on any device. */
static double norm2(const fsdpc_tensor_t *t) {
  fsdpc_tensor_t h;
  ok(tensor_clone(&h, t, DTYPE_F32, device_cpu()));
  double s = 0;
  for (int64_t i = 0; i < tensor_numel(&h); i++)
    s += (double)((float *)h.data)[i] * ((float *)h.data)[i];
  tensor_free(&h);
  return sqrt(s);
}

/* Counts shards (of values, or of gradients) that differ from the chunk of the single-rank
 * tensor by more than tol relative to the whole single-rank tensor's L2 norm. The tolerances
 * the suites pass, and why they hold under any BLAS kernel: tests/README.md, "Tolerances". */
int compare_shards(const run_t *ref, const run_t *sh, bool grads, double tol) {
  ck_assert_int_eq(ref->n, sh->n);
  int bad = 0;
  bool show_all = getenv("FSDPC_TEST_ERRORS") != NULL;
  for (int i = 0; i < ref->n; i++) {
    if (grads && !ref->ps[i]->requires_grad) {
      if (sh->ps[i]->grad != NULL) bad++; /* frozen: no gradient anywhere */
      continue;
    }
    const dtensor_t *rv = grads ? ref->ps[i]->grad : ref->ps[i]->value;
    const dtensor_t *sv = grads ? sh->ps[i]->grad : sh->ps[i]->value;
    ck_assert_msg(rv != NULL && sv != NULL, "%s: missing %s", sh->ps[i]->fqn,
                  grads ? "gradient" : "value");
    const fsdpc_tensor_t *mine = dtensor_local(sv);
    int64_t off[TENSOR_MAX_DIMS];
    dtensor_offset(sv, off);
    fsdpc_tensor_t want;
    ok(tensor_narrow_box(&want, dtensor_local(rv), off, mine->shape));
    double e = tensor_numel(mine) ? test_rel_l2(mine, &want) * norm2(&want) : 0;
    e /= norm2(dtensor_local(rv)) + 1e-30;
    if (show_all) /* FSDPC_TEST_ERRORS=1: every comparison, to review a tolerance's margin */
      printf("rank %d: %s %s error %.3g (tolerance %g)\n", world_rank(), sh->ps[i]->fqn,
             grads ? "gradient" : "parameter", e, tol);
    if (e > tol) {
      bad++;
      printf("rank %d: %s %s shard differs by %.3g\n", world_rank(), sh->ps[i]->fqn,
             grads ? "gradient" : "parameter", e);
    }
    tensor_free(&want);
  }
  return bad;
}

double fwd_bwd(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec, int64_t step,
               int64_t micro) {
  double v;
  ok(llama_micro_step(m, d, spec, step, micro, &v));
  return v;
}

double ref_fwd_bwd(llama_t *m, const fsdpc_data_t *d, const data_spec_t *local, int64_t step,
                   int64_t micro) {
  double sum = 0;
  for (int k = 0; k < local->dp_size; k++) {
    data_spec_t part = *local;
    part.dp_rank = k;
    sum += fwd_bwd(m, d, &part, step, micro);
  }
  return sum / local->dp_size;
}

/* Divided as the reduction's average divides its sum (each element by dp_size, rounded once),
 * on the host. */
void ref_average_grads(const run_t *r, int dp_size) {
  if (dp_size == 1) return;
  for (int i = 0; i < r->n; i++) {
    if (r->ps[i]->grad == NULL) continue;
    fsdpc_tensor_t *g = (fsdpc_tensor_t *)dtensor_local(r->ps[i]->grad), h;
    ok(tensor_clone(&h, g, DTYPE_F32, device_cpu()));
    float *x = h.data;
    for (int64_t j = 0; j < tensor_numel(&h); j++) x[j] = (float)((double)x[j] / dp_size);
    ok(tensor_copy(g, &h));
    tensor_free(&h);
  }
}

int check_counts(int step, const char *what, const pg_counters_t *got, const pg_counters_t *want) {
  int bad = 0;
  for (int k = 0; k < PG_KIND_COUNT; k++)
    if (got->calls[k] != want->calls[k] || got->bytes[k] != want->bytes[k]) {
      bad++;
      if (world_rank() == 0)
        printf("step %d, %s group: %s %llu calls (%llu B), expected %llu (%llu B)\n", step, what,
               pg_kind_name(k), (unsigned long long)got->calls[k],
               (unsigned long long)got->bytes[k], (unsigned long long)want->calls[k],
               (unsigned long long)want->bytes[k]);
    }
  return bad;
}
