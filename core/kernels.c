/* Argument checks of the compute kernels, then dispatch to the device's backend, timed when
 * profiling is on (kernels_profile.c). */
#include "core/kernels.h"

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/kernels_impl.h"

/* Returns call's status; times it (on the device's timer, else the wall clock) when
 * profiling, with bytes (evaluated only then) the least the call moves: 0 for the
 * compute-bound kernels. */
#define DISPATCH(name, t, bytes, call)                     \
  do {                                                     \
    if (!kernel_profile_enabled()) return (call);          \
    kernel_prof_t pc_;                                     \
    kernel_prof_begin(&pc_, (t)->device);                  \
    return kernel_prof_end(&pc_, (name), (bytes), (call)); \
  } while (0)

/* The bytes of ts[0..n) (NULL entries none): each operand read or written once, a tensor both
 * read and written listed twice. */
static double moved(const fsdpc_tensor_t *const *ts, int n) {
  double b = 0;
  for (int i = 0; i < n; i++)
    if (ts[i] != NULL) b += (double)tensor_numel(ts[i]) * (double)dtype_size(ts[i]->dtype);
  return b;
}

#define NT(...)                              \
  ((const fsdpc_tensor_t *[]){__VA_ARGS__}), \
      (int)(sizeof((const fsdpc_tensor_t *[]){__VA_ARGS__}) / sizeof(const fsdpc_tensor_t *))

/* All tensors present, contiguous and on one existing device; returns that device's ops. */
static fsdpc_status_t check_common(const char *fn, const fsdpc_tensor_t *const *ts, int n,
                                   const kernel_ops_t **ops) {
  for (int i = 0; i < n; i++) {
    if (ts[i] == NULL) return err_set(STATUS_EINVAL, "%s: argument %d is NULL", fn, i);
    if (tensor_is_meta(ts[i]))
      return err_set(STATUS_EINVAL,
                     "%s: argument %d is a meta tensor without memory (allocate a deferred "
                     "model's shards with nn_module_materialize first)",
                     fn, i);
    if (!tensor_is_contiguous(ts[i]))
      return err_set(STATUS_EINVAL, "%s: argument %d is not contiguous", fn, i);
    if (!device_equal(ts[i]->device, ts[0]->device)) {
      char a[16], b[16];
      return err_set(STATUS_EINVAL, "%s: arguments on different devices (%s and %s)", fn,
                     device_str(ts[0]->device, a, sizeof a),
                     device_str(ts[i]->device, b, sizeof b));
    }
  }
  FSDPC_TRY(device_check(ts[0]->device));
  *ops = ts[0]->device.type == DEVICE_CUDA ? cuda_kernels() : cpu_kernels();
  if (*ops == NULL) return err_set(STATUS_ENODEV, "%s: no kernels for this device", fn);
  return STATUS_OK;
}

/* Every tensor has a float dtype, the same as the first one. */
static fsdpc_status_t check_float_same(const char *fn, const fsdpc_tensor_t *const *ts, int n) {
  for (int i = 0; i < n; i++) {
    if (!dtype_is_float(ts[i]->dtype))
      return err_set(STATUS_EDTYPE, "%s: argument %d has dtype %s, expected a float dtype", fn, i,
                     dtype_name(ts[i]->dtype));
    if (ts[i]->dtype != ts[0]->dtype)
      return err_set(STATUS_EDTYPE, "%s: arguments mix dtypes %s and %s", fn,
                     dtype_name(ts[0]->dtype), dtype_name(ts[i]->dtype));
  }
  return STATUS_OK;
}

static fsdpc_status_t check_dtype(const char *fn, const char *what, const fsdpc_tensor_t *t,
                                  dtype_t dt) {
  if (t->dtype != dt)
    return err_set(STATUS_EDTYPE, "%s: %s has dtype %s, expected %s", fn, what,
                   dtype_name(t->dtype), dtype_name(dt));
  return STATUS_OK;
}

static fsdpc_status_t check_float(const char *fn, const char *what, const fsdpc_tensor_t *t) {
  if (!dtype_is_float(t->dtype))
    return err_set(STATUS_EDTYPE, "%s: %s has dtype %s, expected a float dtype", fn, what,
                   dtype_name(t->dtype));
  return STATUS_OK;
}

static fsdpc_status_t check_index(const char *fn, const fsdpc_tensor_t *t) {
  if (t->dtype != DTYPE_I32 && t->dtype != DTYPE_I64)
    return err_set(STATUS_EDTYPE, "%s: indices have dtype %s, expected i32 or i64", fn,
                   dtype_name(t->dtype));
  return STATUS_OK;
}

static fsdpc_status_t shape_error(const char *fn, const char *what, const fsdpc_tensor_t *t,
                                  const char *expected) {
  char buf[96];
  return err_set(STATUS_ESHAPE, "%s: %s has shape %s, expected %s", fn, what,
                 tensor_shape_str(t->ndim, t->shape, buf, sizeof buf), expected);
}

static int64_t last_dim(const fsdpc_tensor_t *t) {
  return t->ndim == 0 ? 1 : t->shape[t->ndim - 1];
}
static int64_t rows_of(const fsdpc_tensor_t *t) {
  int64_t last = last_dim(t);
  return last == 0 ? 0 : tensor_numel(t) / last;
}

static fsdpc_status_t check_same_shape(const char *fn, const fsdpc_tensor_t *const *ts, int n) {
  for (int i = 1; i < n; i++)
    if (!tensor_same_shape(ts[0], ts[i])) {
      char a[96], b[96];
      return err_set(STATUS_ESHAPE, "%s: shapes %s and %s differ", fn,
                     tensor_shape_str(ts[0]->ndim, ts[0]->shape, a, sizeof a),
                     tensor_shape_str(ts[i]->ndim, ts[i]->shape, b, sizeof b));
    }
  return STATUS_OK;
}

/* The sizes of out = op(a) @ op(b), refused unless they fit. */
static fsdpc_status_t matmul_dims(const char *fn, const fsdpc_tensor_t *out,
                                  const fsdpc_tensor_t *a, bool trans_a, const fsdpc_tensor_t *b,
                                  bool trans_b, matmul_dims_t *d) {
  if (a->ndim < 1 || b->ndim < 1 || out->ndim < 1)
    return err_set(STATUS_ESHAPE, "%s: scalars are not matrices", fn);
  int64_t ar = rows_of(a), ac = last_dim(a), br = rows_of(b), bc = last_dim(b);
  d->m = trans_a ? ac : ar;
  d->k = trans_a ? ar : ac;
  int64_t kb = trans_b ? bc : br;
  d->n = trans_b ? br : bc;
  d->lda = ac;
  d->ldb = bc;
  if (kb != d->k || last_dim(out) != d->n || tensor_numel(out) != d->m * d->n) {
    char sa[96], sb[96], so[96];
    return err_set(STATUS_ESHAPE, "%s: %s%s @ %s%s cannot produce %s", fn,
                   tensor_shape_str(a->ndim, a->shape, sa, sizeof sa), trans_a ? "^T" : "",
                   tensor_shape_str(b->ndim, b->shape, sb, sizeof sb), trans_b ? "^T" : "",
                   tensor_shape_str(out->ndim, out->shape, so, sizeof so));
  }
  if (d->m > INT32_MAX || d->n > INT32_MAX || d->k > INT32_MAX)
    return err_set(STATUS_EUNSUPPORTED, "%s: dimensions beyond 2^31-1", fn);
  return STATUS_OK;
}

/* out = beta * out, a product over no terms (zeros for beta 0, whatever out held). */
static fsdpc_status_t scale_by_beta(fsdpc_tensor_t *out, float beta) {
  if (beta == 1.0f) return STATUS_OK;
  return beta == 0.0f ? tensor_fill(out, 0.0) : kernel_scale(out, beta);
}

fsdpc_status_t kernel_matmul(fsdpc_tensor_t *out, const fsdpc_tensor_t *a, bool trans_a,
                             const fsdpc_tensor_t *b, bool trans_b, float alpha, float beta) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_matmul", NT(out, a, b), &ops));
  FSDPC_TRY(check_float_same("kernel_matmul", NT(out, a, b)));
  matmul_dims_t d;
  FSDPC_TRY(matmul_dims("kernel_matmul", out, a, trans_a, b, trans_b, &d));
  if (d.m == 0 || d.n == 0) return STATUS_OK;
  if (d.k == 0) return scale_by_beta(out, beta);
  DISPATCH("matmul", out, 0, ops->matmul(out, a, trans_a, b, trans_b, alpha, beta, &d));
}

/* A tensor's bytes [lo, hi) and the product it belongs to. */
typedef struct span {
  uintptr_t lo, hi;
  int product;
} span_t;

static int span_order(const void *x, const void *y) {
  const span_t *a = x, *b = y;
  return a->lo < b->lo ? -1 : a->lo > b->lo;
}

static span_t span_of(const fsdpc_tensor_t *t, int product) {
  uintptr_t lo = (uintptr_t)t->data;
  return (span_t){lo, lo + tensor_nbytes(t), product};
}

/* Whether [lo, hi) meets one of the n sorted, disjoint spans; *which is its product. */
static bool span_meets(const span_t *s, int n, uintptr_t lo, uintptr_t hi, int *which) {
  int first = 0, last = n; /* the first span that ends after lo */
  while (first < last) {
    int mid = first + (last - first) / 2;
    if (s[mid].hi <= lo)
      first = mid + 1;
    else
      last = mid;
  }
  if (first < n && s[first].lo < hi && lo < hi) {
    *which = s[first].product;
    return true;
  }
  return false;
}

/* No product's output shares a byte with another's output or with any operand: run together,
 * the products' order is not defined. */
static fsdpc_status_t check_apart(const kernel_product_t *p, int n) {
  span_t *outs = malloc(sizeof *outs * (size_t)n);
  if (outs == NULL) return err_set(STATUS_ENOMEM, "kernel_matmul_many: %d products", n);
  int k = 0;
  for (int i = 0; i < n; i++)
    if (tensor_nbytes(p[i].out) > 0) outs[k++] = span_of(p[i].out, i);
  qsort(outs, (size_t)k, sizeof *outs, span_order);
  fsdpc_status_t st = STATUS_OK;
  for (int i = 1; i < k && st == STATUS_OK; i++)
    if (outs[i].lo < outs[i - 1].hi)
      st = err_set(STATUS_EINVAL, "kernel_matmul_many: the outputs of products %d and %d overlap",
                   outs[i - 1].product, outs[i].product);
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    const fsdpc_tensor_t *ops[2] = {p[i].a, p[i].b};
    for (int j = 0; j < 2 && st == STATUS_OK; j++) {
      span_t x = span_of(ops[j], i);
      int which;
      if (span_meets(outs, k, x.lo, x.hi, &which))
        st = err_set(STATUS_EINVAL,
                     "kernel_matmul_many: product %d's %s overlaps the output of product %d", i,
                     j == 0 ? "a" : "b", which);
    }
  }
  free(outs);
  return st;
}

/* The n checked products with elements: the backend's grouped call, else one kernel_matmul each. */
static fsdpc_status_t run_many(const kernel_ops_t *ops, const kernel_product_t *p,
                               const matmul_dims_t *d, int n, bool trans_a, bool trans_b,
                               float alpha, float beta) {
  if (ops->matmul_many != NULL)
    DISPATCH("matmul (grouped)", p[0].out, 0,
             ops->matmul_many(p, d, n, trans_a, trans_b, alpha, beta));
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++)
    st = kernel_matmul(p[i].out, p[i].a, trans_a, p[i].b, trans_b, alpha, beta);
  return st;
}

fsdpc_status_t kernel_matmul_many(const kernel_product_t *p, int n, bool trans_a, bool trans_b,
                                  float alpha, float beta) {
  ARG_NONNULL(p);
  if (n < 0) return err_set(STATUS_EINVAL, "kernel_matmul_many: %d products", n);
  if (n == 0) return STATUS_OK;
  const kernel_ops_t *ops = NULL;
  matmul_dims_t *d = malloc(sizeof *d * (size_t)n);
  if (d == NULL) return err_set(STATUS_ENOMEM, "kernel_matmul_many: %d products", n);
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < n && st == STATUS_OK; i++) {
    const char *fn = "kernel_matmul_many";
    st = check_common(fn, NT(p[i].out, p[i].a, p[i].b, p[0].out), &ops);
    if (st == STATUS_OK) st = check_float_same(fn, NT(p[i].out, p[i].a, p[i].b, p[0].out));
    if (st == STATUS_OK) st = matmul_dims(fn, p[i].out, p[i].a, trans_a, p[i].b, trans_b, &d[i]);
    if (st != STATUS_OK) st = err_prefix(st, "product %d of %d", i, n);
  }
  if (st == STATUS_OK) st = check_apart(p, n);
  /* products without elements are skipped and those with k 0 scaled, as kernel_matmul does;
   * the others run together */
  int k = 0;
  for (int i = 0; i < n && st == STATUS_OK; i++)
    if (d[i].m > 0 && d[i].n > 0 && d[i].k == 0)
      st = scale_by_beta(p[i].out, beta);
    else if (d[i].m > 0 && d[i].n > 0)
      k++;
  kernel_product_t *q = st == STATUS_OK && k > 0 && k < n ? malloc(sizeof *q * (size_t)k) : NULL;
  if (st == STATUS_OK && k > 0 && k < n && q == NULL)
    st = err_set(STATUS_ENOMEM, "kernel_matmul_many: %d products", n);
  if (q != NULL)
    for (int i = 0, j = 0; i < n; i++)
      if (d[i].m > 0 && d[i].n > 0 && d[i].k > 0) {
        q[j] = p[i];
        d[j++] = d[i];
      }
  if (st == STATUS_OK && k > 0)
    st = run_many(ops, q != NULL ? q : p, d, k, trans_a, trans_b, alpha, beta);
  free(q);
  free(d);
  return st;
}

fsdpc_status_t kernel_embedding_shard(fsdpc_tensor_t *out, const fsdpc_tensor_t *table,
                                      const fsdpc_tensor_t *ids, int64_t first, int64_t vocab) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_embedding", NT(out, table, ids), &ops));
  FSDPC_TRY(check_float_same("kernel_embedding", NT(out, table)));
  FSDPC_TRY(check_index("kernel_embedding", ids));
  if (table->ndim != 2) return shape_error("kernel_embedding", "table", table, "[V, D]");
  if (last_dim(out) != table->shape[1] || tensor_numel(out) != tensor_numel(ids) * table->shape[1])
    return shape_error("kernel_embedding", "out", out, "[ids..., D]");
  if (first < 0 || vocab < first + table->shape[0])
    return err_set(STATUS_EINVAL,
                   "kernel_embedding: rows [%lld, %lld) outside a vocabulary of %lld",
                   (long long)first, (long long)(first + table->shape[0]), (long long)vocab);
  DISPATCH("embedding", out, moved(NT(out, out, ids)),
           ops->embedding(out, table, ids, first, vocab));
}

fsdpc_status_t kernel_embedding_shard_backward(fsdpc_tensor_t *grad_table,
                                               const fsdpc_tensor_t *grad_out,
                                               const fsdpc_tensor_t *ids, int64_t first,
                                               int64_t vocab) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_embedding_backward", NT(grad_table, grad_out, ids), &ops));
  FSDPC_TRY(check_float("kernel_embedding_backward", "grad_table", grad_table));
  FSDPC_TRY(check_float("kernel_embedding_backward", "grad_out", grad_out));
  FSDPC_TRY(check_index("kernel_embedding_backward", ids));
  if (grad_table->ndim != 2)
    return shape_error("kernel_embedding_backward", "grad_table", grad_table, "[V, D]");
  if (last_dim(grad_out) != grad_table->shape[1] ||
      tensor_numel(grad_out) != tensor_numel(ids) * grad_table->shape[1])
    return shape_error("kernel_embedding_backward", "grad_out", grad_out, "[ids..., D]");
  if (first < 0 || vocab < first + grad_table->shape[0])
    return err_set(STATUS_EINVAL,
                   "kernel_embedding_backward: rows [%lld, %lld) outside a vocabulary of %lld",
                   (long long)first, (long long)(first + grad_table->shape[0]), (long long)vocab);
  DISPATCH("embedding_backward", grad_table, 0,
           ops->embedding_backward(grad_table, grad_out, ids, first, vocab));
}

fsdpc_status_t kernel_embedding(fsdpc_tensor_t *out, const fsdpc_tensor_t *table,
                                const fsdpc_tensor_t *ids) {
  ARG_NONNULL(out);
  ARG_NONNULL(table);
  ARG_NONNULL(ids);
  return kernel_embedding_shard(out, table, ids, 0, table->ndim == 2 ? table->shape[0] : 0);
}

fsdpc_status_t kernel_embedding_backward(fsdpc_tensor_t *grad_table, const fsdpc_tensor_t *grad_out,
                                         const fsdpc_tensor_t *ids) {
  ARG_NONNULL(grad_table);
  ARG_NONNULL(grad_out);
  ARG_NONNULL(ids);
  return kernel_embedding_shard_backward(grad_table, grad_out, ids, 0,
                                         grad_table->ndim == 2 ? grad_table->shape[0] : 0);
}

static fsdpc_status_t check_rows_stat(const char *fn, const char *what, const fsdpc_tensor_t *stat,
                                      int64_t rows) {
  FSDPC_TRY(check_dtype(fn, what, stat, DTYPE_F32));
  if (tensor_numel(stat) != rows) return shape_error(fn, what, stat, "one element per row");
  return STATUS_OK;
}

fsdpc_status_t kernel_rmsnorm(fsdpc_tensor_t *out, fsdpc_tensor_t *rstd, const fsdpc_tensor_t *x,
                              const fsdpc_tensor_t *w, float eps) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_rmsnorm", NT(out, rstd, x, w), &ops));
  FSDPC_TRY(check_float_same("kernel_rmsnorm", NT(out, x)));
  FSDPC_TRY(check_float("kernel_rmsnorm", "w", w));
  FSDPC_TRY(check_same_shape("kernel_rmsnorm", NT(out, x)));
  if (w->ndim != 1 || w->shape[0] != last_dim(x))
    return shape_error("kernel_rmsnorm", "w", w, "[D] with D the last dimension of x");
  FSDPC_TRY(check_rows_stat("kernel_rmsnorm", "rstd", rstd, rows_of(x)));
  DISPATCH("rmsnorm", out, moved(NT(x, out, w)), ops->rmsnorm(out, rstd, x, w, eps));
}

fsdpc_status_t kernel_rmsnorm_backward(fsdpc_tensor_t *dx, fsdpc_tensor_t *dw,
                                       const fsdpc_tensor_t *dy, const fsdpc_tensor_t *x,
                                       const fsdpc_tensor_t *w, const fsdpc_tensor_t *rstd) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_rmsnorm_backward", NT(dx, dw, dy, x, w, rstd), &ops));
  FSDPC_TRY(check_float_same("kernel_rmsnorm_backward", NT(dx, dy, x)));
  FSDPC_TRY(check_float("kernel_rmsnorm_backward", "w", w));
  FSDPC_TRY(check_float("kernel_rmsnorm_backward", "dw", dw));
  FSDPC_TRY(check_same_shape("kernel_rmsnorm_backward", NT(dx, dy, x)));
  FSDPC_TRY(check_same_shape("kernel_rmsnorm_backward", NT(w, dw)));
  if (w->ndim != 1 || w->shape[0] != last_dim(x))
    return shape_error("kernel_rmsnorm_backward", "w", w, "[D] with D the last dimension of x");
  FSDPC_TRY(check_rows_stat("kernel_rmsnorm_backward", "rstd", rstd, rows_of(x)));
  DISPATCH("rmsnorm_backward", dx, moved(NT(dy, x, dx, w, dw, dw)),
           ops->rmsnorm_backward(dx, dw, dy, x, w, rstd));
}

fsdpc_status_t rope_check(const rope_t *r) {
  ARG_NONNULL(r);
  if (!(r->theta > 0) || !isfinite(r->theta))
    return err_set(STATUS_EINVAL, "rope_theta must be positive and finite, got %g", r->theta);
  if (r->scaling == ROPE_DEFAULT) return STATUS_OK;
  if (r->scaling != ROPE_LINEAR && r->scaling != ROPE_LLAMA3)
    return err_set(STATUS_EINVAL, "unknown rotary embedding scaling %d", (int)r->scaling);
  if (!(r->factor > 0) || !isfinite(r->factor))
    return err_set(STATUS_EINVAL, "the rotary embedding's factor must be positive, got %g",
                   r->factor);
  if (r->scaling == ROPE_LINEAR) return STATUS_OK;
  if (!(r->original_max_pos > 0) || !isfinite(r->original_max_pos))
    return err_set(STATUS_EINVAL,
                   "llama3 rope scaling: original_max_position_embeddings must be "
                   "positive, got %g",
                   r->original_max_pos);
  if (!(r->low_freq_factor > 0) || !(r->high_freq_factor > r->low_freq_factor) ||
      !isfinite(r->high_freq_factor))
    return err_set(STATUS_EINVAL,
                   "llama3 rope scaling: need 0 < low_freq_factor < high_freq_factor, got %g "
                   "and %g",
                   r->low_freq_factor, r->high_freq_factor);
  return STATUS_OK;
}

bool rope_key_equal(const rope_key_t *a, const rope_key_t *b) {
  const rope_t *x = &a->rope, *y = &b->rope;
  return a->Dh == b->Dh && a->p0 == b->p0 && a->T == b->T && x->theta == y->theta &&
         x->scaling == y->scaling && x->factor == y->factor &&
         x->low_freq_factor == y->low_freq_factor && x->high_freq_factor == y->high_freq_factor &&
         x->original_max_pos == y->original_max_pos;
}

void rope_fill_table(const rope_key_t *k, float *cs) {
  int64_t Dh = k->Dh;
  for (int64_t t = 0; t < k->T; t++)
    for (int64_t i = 0; i < Dh / 2; i++) {
      double ang = (double)(t + k->p0) * rope_inv_freq(&k->rope, i, Dh);
      cs[t * Dh + 2 * i] = (float)cos(ang);
      cs[t * Dh + 2 * i + 1] = (float)sin(ang);
    }
}

fsdpc_status_t kernel_rope(fsdpc_tensor_t *out, const fsdpc_tensor_t *x, const rope_t *rope,
                           int64_t pos_offset, bool inverse) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_rope", NT(out, x), &ops));
  FSDPC_TRY(check_float_same("kernel_rope", NT(out, x)));
  FSDPC_TRY(check_same_shape("kernel_rope", NT(out, x)));
  if (x->ndim != 4 || x->shape[3] % 2 != 0)
    return shape_error("kernel_rope", "x", x, "[B, T, H, Dh] with Dh even");
  if (rope_check(rope) != STATUS_OK) return err_prefix(STATUS_EINVAL, "kernel_rope");
  DISPATCH("rope", out, moved(NT(x, out)), ops->rope(out, x, rope, pos_offset, inverse));
}

static fsdpc_status_t check_qkv(const char *fn, const fsdpc_tensor_t *q, const fsdpc_tensor_t *k,
                                const fsdpc_tensor_t *v) {
  if (q->ndim != 4) return shape_error(fn, "q", q, "[B, T, H, Dh]");
  if (k->ndim != 4 || k->shape[0] != q->shape[0] || k->shape[1] != q->shape[1] ||
      k->shape[3] != q->shape[3] || k->shape[2] < 1 || q->shape[2] % k->shape[2] != 0)
    return shape_error(fn, "k", k, "[B, T, Hkv, Dh] with H a multiple of Hkv");
  FSDPC_TRY(check_same_shape(fn, NT(k, v)));
  return STATUS_OK;
}

static fsdpc_status_t check_lse(const char *fn, const fsdpc_tensor_t *lse,
                                const fsdpc_tensor_t *q) {
  FSDPC_TRY(check_dtype(fn, "lse", lse, DTYPE_F32));
  if (lse->ndim != 3 || lse->shape[0] != q->shape[0] || lse->shape[1] != q->shape[2] ||
      lse->shape[2] != q->shape[1])
    return shape_error(fn, "lse", lse, "[B, H, T]");
  return STATUS_OK;
}

fsdpc_status_t kernel_attention(fsdpc_tensor_t *out, fsdpc_tensor_t *lse, const fsdpc_tensor_t *q,
                                const fsdpc_tensor_t *k, const fsdpc_tensor_t *v) {
  const char *fn = "kernel_attention";
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common(fn, NT(out, lse, q, k, v), &ops));
  FSDPC_TRY(check_float_same(fn, NT(out, q, k, v)));
  FSDPC_TRY(check_qkv(fn, q, k, v));
  FSDPC_TRY(check_same_shape(fn, NT(out, q)));
  FSDPC_TRY(check_lse(fn, lse, q));
  if (tensor_numel(q) == 0) return STATUS_OK;
  DISPATCH("attention", out, 0, ops->attention(out, lse, q, k, v));
}

fsdpc_status_t kernel_attention_backward(fsdpc_tensor_t *dq, fsdpc_tensor_t *dk, fsdpc_tensor_t *dv,
                                         const fsdpc_tensor_t *dout, const fsdpc_tensor_t *q,
                                         const fsdpc_tensor_t *k, const fsdpc_tensor_t *v,
                                         const fsdpc_tensor_t *out, const fsdpc_tensor_t *lse) {
  const char *fn = "kernel_attention_backward";
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common(fn, NT(dq, dk, dv, dout, q, k, v, out, lse), &ops));
  FSDPC_TRY(check_float_same(fn, NT(dq, dk, dv, dout, q, k, v, out)));
  FSDPC_TRY(check_qkv(fn, q, k, v));
  FSDPC_TRY(check_same_shape(fn, NT(dq, dout, q, out)));
  FSDPC_TRY(check_same_shape(fn, NT(dk, dv, k)));
  FSDPC_TRY(check_lse(fn, lse, q));
  if (tensor_numel(q) == 0) return STATUS_OK;
  DISPATCH("attention_backward", dq, 0,
           ops->attention_backward(dq, dk, dv, dout, q, k, v, out, lse));
}

fsdpc_status_t kernel_silu_mul(fsdpc_tensor_t *out, const fsdpc_tensor_t *gate,
                               const fsdpc_tensor_t *up) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_silu_mul", NT(out, gate, up), &ops));
  FSDPC_TRY(check_float_same("kernel_silu_mul", NT(out, gate, up)));
  FSDPC_TRY(check_same_shape("kernel_silu_mul", NT(out, gate, up)));
  DISPATCH("silu_mul", out, moved(NT(gate, up, out)), ops->silu_mul(out, gate, up));
}

fsdpc_status_t kernel_silu_mul_backward(fsdpc_tensor_t *dgate, fsdpc_tensor_t *dup,
                                        const fsdpc_tensor_t *dout, const fsdpc_tensor_t *gate,
                                        const fsdpc_tensor_t *up) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_silu_mul_backward", NT(dgate, dup, dout, gate, up), &ops));
  FSDPC_TRY(check_float_same("kernel_silu_mul_backward", NT(dgate, dup, dout, gate, up)));
  FSDPC_TRY(check_same_shape("kernel_silu_mul_backward", NT(dgate, dup, dout, gate, up)));
  DISPATCH("silu_mul_backward", dgate, moved(NT(dout, gate, up, dgate, dup)),
           ops->silu_mul_backward(dgate, dup, dout, gate, up));
}

/* kernel_moe_combine's shapes: out and dout [N, D], y and dy [M, D], w and dw N k elements,
 * offs I64 [N k + 1], rows and slots I64 [M]. */
static fsdpc_status_t check_combine(const char *fn, const fsdpc_tensor_t *out,
                                    const fsdpc_tensor_t *y, const fsdpc_tensor_t *w,
                                    const fsdpc_tensor_t *offs, const fsdpc_tensor_t *rows,
                                    const fsdpc_tensor_t *slots) {
  int64_t D = last_dim(y), M = D ? tensor_numel(y) / D : 0, N = D ? tensor_numel(out) / D : 0;
  const fsdpc_tensor_t *idx[3] = {offs, rows, slots};
  for (int i = 0; i < 3; i++)
    if (idx[i] != NULL && idx[i]->dtype != DTYPE_I64)
      return err_set(STATUS_EDTYPE, "%s: offsets, rows and slots must be i64, got %s", fn,
                     dtype_name(idx[i]->dtype));
  if (last_dim(out) != D || (N > 0 ? tensor_numel(w) % N != 0 : tensor_numel(w) != 0) ||
      tensor_numel(offs) != tensor_numel(w) + 1 || tensor_numel(rows) != M ||
      (slots != NULL && tensor_numel(slots) != M))
    return err_set(STATUS_ESHAPE,
                   "%s: out [N, D], y [M, D], w of N k, offs of N k + 1, rows (and slots) of M",
                   fn);
  return STATUS_OK;
}

fsdpc_status_t kernel_moe_combine(fsdpc_tensor_t *out, const fsdpc_tensor_t *y,
                                  const fsdpc_tensor_t *w, const fsdpc_tensor_t *offs,
                                  const fsdpc_tensor_t *rows) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_moe_combine", NT(out, y, w, offs, rows), &ops));
  FSDPC_TRY(check_float_same("kernel_moe_combine", NT(out, y, w)));
  FSDPC_TRY(check_combine("kernel_moe_combine", out, y, w, offs, rows, NULL));
  DISPATCH("moe_combine", out, moved(NT(out, y, w, offs, rows)),
           ops->moe_combine(out, y, w, offs, rows));
}

fsdpc_status_t kernel_moe_combine_backward(fsdpc_tensor_t *dy, fsdpc_tensor_t *dw,
                                           const fsdpc_tensor_t *dout, const fsdpc_tensor_t *y,
                                           const fsdpc_tensor_t *w, const fsdpc_tensor_t *slots,
                                           const fsdpc_tensor_t *offs, const fsdpc_tensor_t *rows) {
  const kernel_ops_t *ops;
  FSDPC_TRY(
      check_common("kernel_moe_combine_backward", NT(dy, dw, dout, y, w, slots, offs, rows), &ops));
  FSDPC_TRY(check_float_same("kernel_moe_combine_backward", NT(dy, dw, dout, y, w)));
  FSDPC_TRY(check_same_shape("kernel_moe_combine_backward", NT(dy, y)));
  FSDPC_TRY(check_same_shape("kernel_moe_combine_backward", NT(dw, w)));
  FSDPC_TRY(check_combine("kernel_moe_combine_backward", dout, y, w, offs, rows, slots));
  DISPATCH("moe_combine_backward", dy, moved(NT(dy, dw, dout, y, w, slots, offs, rows)),
           ops->moe_combine_backward(dy, dw, dout, y, w, slots, offs, rows));
}

/* A routing's tensors ([N, E] and [N, k] of their dtypes, E elements of bias or g) and scale,
 * into *a. */
static fsdpc_status_t check_route(const char *fn, const fsdpc_tensor_t *NE[2],
                                  const fsdpc_tensor_t *Nk[3], const fsdpc_tensor_t *perE, int k,
                                  bool norm, bool sigmoid, double scale, moe_route_args_t *a) {
  const fsdpc_tensor_t *z = NE[0];
  if (z->ndim != 2 || z->shape[1] < 1) return shape_error(fn, "the logits", z, "[tokens, experts]");
  int64_t N = z->shape[0], E = z->shape[1];
  if (k < 1 || k > E || k > MOE_MAX_TOP_K)
    return err_set(STATUS_EINVAL, "%s: top_k %d must lie in [1, %lld]", fn, k,
                   (long long)(E < MOE_MAX_TOP_K ? E : MOE_MAX_TOP_K));
  for (int i = 0; i < 2; i++) {
    FSDPC_TRY(check_dtype(fn, "a [tokens, experts] tensor", NE[i], DTYPE_F32));
    if (NE[i]->ndim != 2 || NE[i]->shape[0] != N || NE[i]->shape[1] != E)
      return shape_error(fn, "a [tokens, experts] tensor", NE[i], "the logits' shape");
  }
  for (int i = 0; i < 3; i++) {
    FSDPC_TRY(check_dtype(fn, i == 0 ? "the experts" : "a weights tensor", Nk[i],
                          i == 0 ? DTYPE_I64 : DTYPE_F32));
    if (Nk[i]->ndim != 2 || Nk[i]->shape[0] != N || Nk[i]->shape[1] != k)
      return shape_error(fn, i == 0 ? "the experts" : "a weights tensor", Nk[i], "[tokens, k]");
  }
  if (perE != NULL) {
    FSDPC_TRY(check_dtype(fn, "a tensor of one value an expert", perE, DTYPE_F32));
    if (tensor_numel(perE) != E)
      return shape_error(fn, "a tensor of one value an expert", perE, "[experts]");
  }
  if (!(scale > 0) || !isfinite(scale))
    return err_set(STATUS_EINVAL, "%s: scale %g must be positive and finite", fn, scale);
  *a = (moe_route_args_t){.E = E, .k = k, .norm = norm, .sigmoid = sigmoid, .scale = scale};
  return STATUS_OK;
}

fsdpc_status_t kernel_moe_route(fsdpc_tensor_t *p, fsdpc_tensor_t *experts, fsdpc_tensor_t *w,
                                const fsdpc_tensor_t *z, const fsdpc_tensor_t *bias, int k,
                                bool norm, bool sigmoid, double scale) {
  const kernel_ops_t *ops;
  const char *fn = "kernel_moe_route";
  FSDPC_TRY(bias ? check_common(fn, NT(z, p, experts, w, bias), &ops)
                 : check_common(fn, NT(z, p, experts, w), &ops));
  moe_route_args_t a;
  FSDPC_TRY(check_route(fn, (const fsdpc_tensor_t *[2]){z, p},
                        (const fsdpc_tensor_t *[3]){experts, w, w}, bias, k, norm, sigmoid, scale,
                        &a));
  if (z->shape[0] == 0) return STATUS_OK;
  DISPATCH("moe_route", z, moved(NT(z, p, experts, w)), ops->moe_route(p, experts, w, z, bias, &a));
}

fsdpc_status_t kernel_moe_route_backward(fsdpc_tensor_t *dz, const fsdpc_tensor_t *dw,
                                         const fsdpc_tensor_t *w, const fsdpc_tensor_t *p,
                                         const fsdpc_tensor_t *experts, const fsdpc_tensor_t *g,
                                         int k, bool norm, bool sigmoid, double scale) {
  const kernel_ops_t *ops;
  const char *fn = "kernel_moe_route_backward";
  FSDPC_TRY(g ? check_common(fn, NT(p, dz, dw, w, experts, g), &ops)
              : check_common(fn, NT(p, dz, dw, w, experts), &ops));
  moe_route_args_t a;
  FSDPC_TRY(check_route(fn, (const fsdpc_tensor_t *[2]){p, dz},
                        (const fsdpc_tensor_t *[3]){experts, dw, w}, g, k, norm, sigmoid, scale,
                        &a));
  if (p->shape[0] == 0) return STATUS_OK;
  DISPATCH("moe_route_backward", dz, moved(NT(dz, dw, w, p, experts)),
           ops->moe_route_backward(dz, dw, w, p, experts, g, &a));
}

static fsdpc_status_t check_act(const char *fn, kernel_act_t act) {
  if (act < 0 || act >= KERNEL_ACT_COUNT)
    return err_set(STATUS_EINVAL, "%s: unknown activation %d", fn, (int)act);
  return STATUS_OK;
}

fsdpc_status_t kernel_activation(fsdpc_tensor_t *out, const fsdpc_tensor_t *x, kernel_act_t act) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_activation", NT(out, x), &ops));
  FSDPC_TRY(check_float_same("kernel_activation", NT(out, x)));
  FSDPC_TRY(check_same_shape("kernel_activation", NT(out, x)));
  FSDPC_TRY(check_act("kernel_activation", act));
  DISPATCH("activation", out, moved(NT(x, out)), ops->activation(out, x, act));
}

fsdpc_status_t kernel_activation_backward(fsdpc_tensor_t *dx, const fsdpc_tensor_t *dy,
                                          const fsdpc_tensor_t *x, kernel_act_t act) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_activation_backward", NT(dx, dy, x), &ops));
  FSDPC_TRY(check_float_same("kernel_activation_backward", NT(dx, dy, x)));
  FSDPC_TRY(check_same_shape("kernel_activation_backward", NT(dx, dy, x)));
  FSDPC_TRY(check_act("kernel_activation_backward", act));
  DISPATCH("activation_backward", dx, moved(NT(dy, x, dx)),
           ops->activation_backward(dx, dy, x, act));
}

/* b is [D] with D the last dimension of x. */
static fsdpc_status_t check_row_vector(const char *fn, const char *what, const fsdpc_tensor_t *b,
                                       const fsdpc_tensor_t *x) {
  if (b->ndim != 1 || b->shape[0] != last_dim(x))
    return shape_error(fn, what, b, "[D] with D the last dimension of x");
  return STATUS_OK;
}

fsdpc_status_t kernel_bias_add(fsdpc_tensor_t *out, const fsdpc_tensor_t *x,
                               const fsdpc_tensor_t *b) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_bias_add", NT(out, x, b), &ops));
  FSDPC_TRY(check_float_same("kernel_bias_add", NT(out, x, b)));
  FSDPC_TRY(check_same_shape("kernel_bias_add", NT(out, x)));
  FSDPC_TRY(check_row_vector("kernel_bias_add", "b", b, x));
  if (tensor_numel(x) == 0) return STATUS_OK;
  DISPATCH("bias_add", out, moved(NT(x, out, b)), ops->bias_add(out, x, b));
}

fsdpc_status_t kernel_bias_backward(fsdpc_tensor_t *db, const fsdpc_tensor_t *dy) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_bias_backward", NT(db, dy), &ops));
  FSDPC_TRY(check_float("kernel_bias_backward", "db", db));
  FSDPC_TRY(check_float("kernel_bias_backward", "dy", dy));
  FSDPC_TRY(check_row_vector("kernel_bias_backward", "db", db, dy));
  if (tensor_numel(dy) == 0) return STATUS_OK;
  DISPATCH("bias_backward", db, moved(NT(dy, db, db)), ops->bias_backward(db, dy));
}

fsdpc_status_t kernel_layernorm(fsdpc_tensor_t *out, fsdpc_tensor_t *mean, fsdpc_tensor_t *rstd,
                                const fsdpc_tensor_t *x, const fsdpc_tensor_t *w,
                                const fsdpc_tensor_t *b, float eps) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_layernorm", NT(out, mean, rstd, x, w), &ops));
  if (b != NULL) FSDPC_TRY(check_common("kernel_layernorm", NT(x, b), &ops));
  FSDPC_TRY(check_float_same("kernel_layernorm", NT(out, x)));
  FSDPC_TRY(check_float("kernel_layernorm", "w", w));
  if (b != NULL) FSDPC_TRY(check_float("kernel_layernorm", "b", b));
  FSDPC_TRY(check_same_shape("kernel_layernorm", NT(out, x)));
  FSDPC_TRY(check_row_vector("kernel_layernorm", "w", w, x));
  if (b != NULL) FSDPC_TRY(check_row_vector("kernel_layernorm", "b", b, x));
  FSDPC_TRY(check_rows_stat("kernel_layernorm", "mean", mean, rows_of(x)));
  FSDPC_TRY(check_rows_stat("kernel_layernorm", "rstd", rstd, rows_of(x)));
  if (tensor_numel(x) == 0) return STATUS_OK;
  DISPATCH("layernorm", out, moved(NT(x, out, w, b)),
           ops->layernorm(out, mean, rstd, x, w, b, eps));
}

fsdpc_status_t kernel_layernorm_backward(fsdpc_tensor_t *dx, fsdpc_tensor_t *dw, fsdpc_tensor_t *db,
                                         const fsdpc_tensor_t *dy, const fsdpc_tensor_t *x,
                                         const fsdpc_tensor_t *w, const fsdpc_tensor_t *mean,
                                         const fsdpc_tensor_t *rstd) {
  const kernel_ops_t *ops;
  const char *fn = "kernel_layernorm_backward";
  FSDPC_TRY(check_common(fn, NT(dx, dw, dy, x, w, mean, rstd), &ops));
  if (db != NULL) FSDPC_TRY(check_common(fn, NT(x, db), &ops));
  FSDPC_TRY(check_float_same(fn, NT(dx, dy, x)));
  FSDPC_TRY(check_float(fn, "w", w));
  FSDPC_TRY(check_float(fn, "dw", dw));
  if (db != NULL) FSDPC_TRY(check_float(fn, "db", db));
  FSDPC_TRY(check_same_shape(fn, NT(dx, dy, x)));
  FSDPC_TRY(check_same_shape(fn, NT(w, dw)));
  FSDPC_TRY(check_row_vector(fn, "w", w, x));
  if (db != NULL) FSDPC_TRY(check_row_vector(fn, "db", db, x));
  FSDPC_TRY(check_rows_stat(fn, "mean", mean, rows_of(x)));
  FSDPC_TRY(check_rows_stat(fn, "rstd", rstd, rows_of(x)));
  if (tensor_numel(x) == 0) return STATUS_OK;
  DISPATCH("layernorm_backward", dx, moved(NT(dy, x, dx, w, dw, dw, db, db)),
           ops->layernorm_backward(dx, dw, db, dy, x, w, mean, rstd));
}

fsdpc_status_t kernel_add(fsdpc_tensor_t *out, const fsdpc_tensor_t *a, const fsdpc_tensor_t *b) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_add", NT(out, a, b), &ops));
  FSDPC_TRY(check_float_same("kernel_add", NT(out, a, b)));
  FSDPC_TRY(check_same_shape("kernel_add", NT(out, a, b)));
  DISPATCH("add", out, moved(NT(a, b, out)), ops->add(out, a, b));
}

fsdpc_status_t kernel_axpy(fsdpc_tensor_t *y, float alpha, const fsdpc_tensor_t *x) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_axpy", NT(y, x), &ops));
  FSDPC_TRY(check_float("kernel_axpy", "y", y));
  FSDPC_TRY(check_float("kernel_axpy", "x", x));
  FSDPC_TRY(check_same_shape("kernel_axpy", NT(y, x)));
  DISPATCH("axpy", y, moved(NT(y, y, x)), ops->axpy(y, alpha, x));
}

fsdpc_status_t kernel_scale(fsdpc_tensor_t *x, float alpha) {
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common("kernel_scale", NT(x), &ops));
  FSDPC_TRY(check_float("kernel_scale", "x", x));
  DISPATCH("scale", x, moved(NT(x, x)), ops->scale(x, alpha));
}

static fsdpc_status_t check_ce(const char *fn, const fsdpc_tensor_t *logits,
                               const fsdpc_tensor_t *targets) {
  FSDPC_TRY(check_float(fn, "logits", logits));
  FSDPC_TRY(check_index(fn, targets));
  if (logits->ndim < 1 || rows_of(logits) != tensor_numel(targets))
    return shape_error(fn, "logits", logits, "[N, V] with N the number of targets");
  return STATUS_OK;
}

fsdpc_status_t kernel_cross_entropy(fsdpc_tensor_t *losses, const fsdpc_tensor_t *logits,
                                    const fsdpc_tensor_t *targets) {
  const char *fn = "kernel_cross_entropy";
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common(fn, NT(losses, logits, targets), &ops));
  FSDPC_TRY(check_ce(fn, logits, targets));
  FSDPC_TRY(check_dtype(fn, "losses", losses, DTYPE_F32));
  if (tensor_numel(losses) != tensor_numel(targets))
    return shape_error(fn, "losses", losses, "one element per target");
  DISPATCH("cross_entropy", losses, moved(NT(logits, targets, losses)),
           ops->cross_entropy(losses, logits, targets));
}

fsdpc_status_t kernel_cross_entropy_backward(fsdpc_tensor_t *dlogits, const fsdpc_tensor_t *logits,
                                             const fsdpc_tensor_t *targets, float scale) {
  const char *fn = "kernel_cross_entropy_backward";
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common(fn, NT(dlogits, logits, targets), &ops));
  FSDPC_TRY(check_ce(fn, logits, targets));
  FSDPC_TRY(check_float_same(fn, NT(dlogits, logits)));
  FSDPC_TRY(check_same_shape(fn, NT(dlogits, logits)));
  DISPATCH("cross_entropy_backward", dlogits, moved(NT(logits, dlogits, targets)),
           ops->cross_entropy_backward(dlogits, logits, targets, scale, NULL, NULL));
}

fsdpc_status_t kernel_masked_mean(fsdpc_tensor_t *mean, fsdpc_tensor_t *count,
                                  const fsdpc_tensor_t *values, const fsdpc_tensor_t *targets) {
  const char *fn = "kernel_masked_mean";
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common(fn, NT(mean, count, values, targets), &ops));
  FSDPC_TRY(check_index(fn, targets));
  FSDPC_TRY(check_dtype(fn, "mean", mean, DTYPE_F32));
  FSDPC_TRY(check_dtype(fn, "count", count, DTYPE_I64));
  FSDPC_TRY(check_dtype(fn, "values", values, DTYPE_F32));
  if (tensor_numel(mean) != 1) return shape_error(fn, "mean", mean, "one element");
  if (tensor_numel(count) != 1) return shape_error(fn, "count", count, "one element");
  if (tensor_numel(values) != tensor_numel(targets))
    return shape_error(fn, "values", values, "one element per target");
  DISPATCH("masked_mean", mean, moved(NT(values, targets, mean, count)),
           ops->masked_mean(mean, count, values, targets));
}

fsdpc_status_t kernel_cross_entropy_backward_mean(fsdpc_tensor_t *dlogits,
                                                  const fsdpc_tensor_t *logits,
                                                  const fsdpc_tensor_t *targets,
                                                  const fsdpc_tensor_t *dloss,
                                                  const fsdpc_tensor_t *count) {
  const char *fn = "kernel_cross_entropy_backward_mean";
  const kernel_ops_t *ops;
  FSDPC_TRY(check_common(fn, NT(dlogits, logits, targets, dloss, count), &ops));
  FSDPC_TRY(check_ce(fn, logits, targets));
  FSDPC_TRY(check_float_same(fn, NT(dlogits, logits)));
  FSDPC_TRY(check_same_shape(fn, NT(dlogits, logits)));
  FSDPC_TRY(check_dtype(fn, "dloss", dloss, DTYPE_F32));
  FSDPC_TRY(check_dtype(fn, "count", count, DTYPE_I64));
  if (tensor_numel(dloss) != 1) return shape_error(fn, "dloss", dloss, "one element");
  if (tensor_numel(count) != 1) return shape_error(fn, "count", count, "one element");
  DISPATCH("cross_entropy_backward", dlogits, moved(NT(logits, dlogits, targets, dloss, count)),
           ops->cross_entropy_backward(dlogits, logits, targets, 1.0f, dloss, count));
}

static fsdpc_status_t adamw_check(const char *fn, fsdpc_tensor_t *p, const fsdpc_tensor_t *g,
                                  fsdpc_tensor_t *m, fsdpc_tensor_t *v, const adamw_args_t *args,
                                  const kernel_ops_t **ops) {
  FSDPC_TRY(check_common(fn, NT(p, g, m, v), ops));
  FSDPC_TRY(check_float(fn, "p", p));
  FSDPC_TRY(check_float(fn, "g", g));
  if ((m->dtype != DTYPE_F32 && m->dtype != DTYPE_BF16) || v->dtype != m->dtype)
    return err_set(STATUS_EDTYPE,
                   "%s: the moments m and v must both be f32 or both bf16, not %s "
                   "and %s",
                   fn, dtype_name(m->dtype), dtype_name(v->dtype));
  if (tensor_numel(g) != tensor_numel(p) || tensor_numel(m) != tensor_numel(p) ||
      tensor_numel(v) != tensor_numel(p))
    return err_set(STATUS_ESHAPE, "%s: p, g, m and v must have the same number of elements", fn);
  if (args == NULL || args->step < 1) return err_set(STATUS_EINVAL, "%s: step must be >= 1", fn);
  return STATUS_OK;
}

fsdpc_status_t kernel_adamw(fsdpc_tensor_t *p, const fsdpc_tensor_t *g, fsdpc_tensor_t *m,
                            fsdpc_tensor_t *v, const adamw_args_t *args) {
  const kernel_ops_t *ops;
  FSDPC_TRY(adamw_check("kernel_adamw", p, g, m, v, args, &ops));
  DISPATCH("adamw", p, moved(NT(p, p, g, m, m, v, v)), ops->adamw(p, g, m, v, args));
}

static fsdpc_status_t adamw_each(const kernel_ops_t *ops, const adamw_item_t *items, int n) {
  for (int i = 0; i < n; i++)
    FSDPC_TRY(ops->adamw(items[i].p, items[i].g, items[i].m, items[i].v, &items[i].args));
  return STATUS_OK;
}

static double adamw_items_moved(const adamw_item_t *items, int n) {
  double b = 0;
  for (int i = 0; i < n; i++)
    b += moved(
        NT(items[i].p, items[i].p, items[i].g, items[i].m, items[i].m, items[i].v, items[i].v));
  return b;
}

fsdpc_status_t kernel_adamw_many(const adamw_item_t *items, int n, int *failed) {
  if (n > 0) ARG_NONNULL(items);
  ARG_NONNULL(failed);
  const kernel_ops_t *ops = NULL;
  if (failed) *failed = -1;
  if (n < 0 || (n > 0 && items == NULL))
    return err_set(STATUS_EINVAL, "kernel_adamw_many: %d items, items NULL", n);
  for (int i = 0; i < n; i++) {
    const kernel_ops_t *o;
    fsdpc_status_t st = adamw_check("kernel_adamw_many", items[i].p, items[i].g, items[i].m,
                                    items[i].v, &items[i].args, &o);
    if (st == STATUS_OK && i > 0 && !device_equal(items[i].p->device, items[0].p->device)) {
      char a[32], b[32];
      st = err_set(STATUS_EINVAL, "kernel_adamw_many: items on %s and %s (one device per call)",
                   device_str(items[0].p->device, a, sizeof a),
                   device_str(items[i].p->device, b, sizeof b));
    }
    if (st != STATUS_OK) {
      if (failed) *failed = i;
      return st;
    }
    ops = o;
  }
  if (n == 0) return STATUS_OK;
  DISPATCH("adamw", items[0].p, adamw_items_moved(items, n),
           ops->adamw_many ? ops->adamw_many(items, n) : adamw_each(ops, items, n));
}

fsdpc_status_t kernel_sum_squares(const fsdpc_tensor_t *x, double *out) {
  const kernel_ops_t *ops;
  if (out == NULL) return err_set(STATUS_EINVAL, "kernel_sum_squares: out is NULL");
  FSDPC_TRY(check_common("kernel_sum_squares", NT(x), &ops));
  FSDPC_TRY(check_float("kernel_sum_squares", "x", x));
  *out = 0;
  if (tensor_numel(x) == 0) return STATUS_OK;
  DISPATCH("sum_squares", x, moved(NT(x)), ops->sum_squares(x, out));
}

static fsdpc_status_t sum_squares_each(const kernel_ops_t *ops, const fsdpc_tensor_t *const *xs,
                                       int n, double *out) {
  for (int i = 0; i < n; i++) {
    out[i] = 0;
    if (tensor_numel(xs[i]) > 0) FSDPC_TRY(ops->sum_squares(xs[i], &out[i]));
  }
  return STATUS_OK;
}

fsdpc_status_t kernel_sum_squares_many(const fsdpc_tensor_t *const *xs, int n, double *out) {
  const char *fn = "kernel_sum_squares_many";
  const kernel_ops_t *ops;
  if (n < 0 || (n > 0 && (xs == NULL || out == NULL)))
    return err_set(STATUS_EINVAL, "%s: %d tensors, xs or out NULL", fn, n);
  if (n == 0) return STATUS_OK;
  FSDPC_TRY(check_common(fn, xs, n, &ops));
  for (int i = 0; i < n; i++) FSDPC_TRY(check_float(fn, "x", xs[i]));
  DISPATCH("sum_squares", xs[0], moved(xs, n),
           ops->sum_squares_many ? ops->sum_squares_many(xs, n, out)
                                 : sum_squares_each(ops, xs, n, out));
}
