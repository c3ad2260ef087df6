#include "nn/init.h"

#include <math.h>
#include <stdlib.h>

#include "core/args_impl.h"
#include "core/mix_impl.h"

static uint64_t name_key(uint64_t seed, const char *name) {
  uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
  for (const unsigned char *s = (const unsigned char *)name; *s; s++)
    h = (h ^ *s) * 0x100000001b3ull;
  return mix64(seed ^ mix64(h));
}

/* Uniform in (0, 1] from counter c under key. */
static double uniform(uint64_t key, uint64_t c) {
  uint64_t r = mix64(key + (c + 1) * 0x9e3779b97f4a7c15ull);
  return ((double)(r >> 11) + 1.0) * 0x1.0p-53;
}

double nn_init_normal_value(uint64_t seed, const char *name, uint64_t index) {
  if (name == NULL) return 0;
  uint64_t key = name_key(seed, name);
  double u1 = uniform(key, 2 * index), u2 = uniform(key, 2 * index + 1);
  return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

typedef double (*elem_fn)(uint64_t key, uint64_t index, double a, double b);

static double normal_elem(uint64_t key, uint64_t index, double mean, double std) {
  double u1 = uniform(key, 2 * index), u2 = uniform(key, 2 * index + 1);
  return mean + std * (sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}

static double uniform_elem(uint64_t key, uint64_t index, double lo, double hi) {
  return lo + (hi - lo) * (1.0 - uniform(key, index)); /* uniform() is in (0, 1] */
}

static double constant_elem(uint64_t key, uint64_t index, double value, double unused) {
  (void)key, (void)index, (void)unused;
  return value;
}

/* Computes the local shard on the host from global indices and copies it in. */
static fsdpc_status_t fill_local(nn_param_t *p, elem_fn fn, uint64_t key, double a, double b) {
  const dtensor_t *dt = p->value;
  const placement_t *pl = dtensor_placements(dt);
  for (int i = 0; i < mesh_ndim(dtensor_mesh(dt)); i++) /* a (strided) shard is one box */
    if (pl[i].kind == PLACEMENT_PARTIAL)
      return err_set(STATUS_EPLACEMENT, "init of %s: only Shard and Replicate placements",
                     p->fqn ? p->fqn : p->name);
  const fsdpc_tensor_t *local = dtensor_local(dt);
  int nd = dtensor_ndim(dt);
  const int64_t *gshape = dtensor_shape(dt);
  int64_t off[TENSOR_MAX_DIMS], gstride[TENSOR_MAX_DIMS], idx[TENSOR_MAX_DIMS] = {0};
  dtensor_offset(dt, off);
  int64_t s = 1;
  for (int d = nd - 1; d >= 0; d--) {
    gstride[d] = s;
    s *= gshape[d];
  }
  int64_t n = tensor_numel(local);
  fsdpc_tensor_t host;
  FSDPC_TRY(tensor_init(&host, local->dtype, device_cpu(), local->ndim, local->shape));
  for (int64_t e = 0; e < n; e++) {
    int64_t g = 0;
    for (int d = 0; d < nd; d++) g += (off[d] + idx[d]) * gstride[d];
    dtype_store(local->dtype, host.data, (size_t)e, fn(key, (uint64_t)g, a, b));
    for (int d = nd - 1; d >= 0; d--) {
      if (++idx[d] < local->shape[d]) break;
      idx[d] = 0;
    }
  }
  fsdpc_tensor_t dst;
  fsdpc_status_t st = tensor_ref(&dst, local);
  if (st == STATUS_OK) st = tensor_copy(&dst, &host);
  tensor_free(&dst);
  tensor_free(&host);
  return st;
}

fsdpc_status_t nn_init_normal(nn_param_t *p, uint64_t seed, double mean, double std) {
  if (p == NULL || p->fqn == NULL)
    return err_set(STATUS_EINVAL, "nn_init_normal: parameter has no FQN (finalize the module)");
  return fill_local(p, normal_elem, name_key(seed, p->fqn), mean, std);
}

fsdpc_status_t nn_init_uniform(nn_param_t *p, uint64_t seed, double lo, double hi) {
  if (p == NULL || p->fqn == NULL)
    return err_set(STATUS_EINVAL, "nn_init_uniform: parameter has no FQN (finalize the module)");
  if (!(lo <= hi)) return err_set(STATUS_EINVAL, "nn_init_uniform: need lo <= hi");
  return fill_local(p, uniform_elem, name_key(seed, p->fqn), lo, hi);
}

fsdpc_status_t nn_init_constant(nn_param_t *p, double value) {
  if (p == NULL) return err_set(STATUS_EINVAL, "nn_init_constant: NULL parameter");
  return fill_local(p, constant_elem, 0, value, 0);
}
