/*
 * CPU twin of the compute kernels: OpenBLAS for matrix products, plain C elsewhere (the other
 * kernels in kernels_cpu_*.c, their shared parts in kernels_cpu.h). Values are read into fp32
 * (converted copies for bf16/f16 storage), computed in fp32, and rounded once when stored.
 * Row sums accumulate in double (vectorised for RMSNorm and attention's log-sum-exp); the
 * gradient norm in fp32 lanes over blocks of 256 elements, the blocks added in double. This
 * file is the only one built with OpenMP: its parallel region (cpu_for_shares) runs every
 * kernel's shares.
 */
#include <cblas.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "core/backend_impl.h"
#include "backends/cpu/kernels_cpu.h"

/* ---- threads ----
 * The kernels run on one thread unless OMP_NUM_THREADS (or kernel_set_cpu_threads) asks for
 * more: under mpirun the ranks already fill the cores. With more, a kernel splits its work into
 * one contiguous share per thread (element ranges, rows, columns, (batch, head) pairs), each
 * output value computed by the same operations in the same order as on one thread; a matrix
 * product is split by rows of its output, each share one OpenBLAS call on one thread. OpenBLAS's
 * own threads then stay at one (two thread pools on the same cores would spin against each
 * other); on one kernel thread they are what OPENBLAS_NUM_THREADS says, else one. */
static int team_max = 1, blas_threads = 1;
static pthread_once_t threads_once = PTHREAD_ONCE_INIT;

static void threads_init(void) {
#ifdef _OPENMP
  /* a count (the first of a nested list): one OpenMP took as it is; a value it could not read
   * (0, "abc": OpenMP's default of every CPU) leaves one thread */
  const char *env = getenv("OMP_NUM_THREADS");
  char *end = NULL;
  long n = env != NULL ? strtol(env, &end, 10) : 0;
  if (n >= 1 && end != env && (*end == '\0' || *end == ',')) team_max = omp_get_max_threads();
#endif
  if (getenv("OPENBLAS_NUM_THREADS") != NULL) blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(team_max > 1 ? 1 : blas_threads);
}

static int threads(void) {
  pthread_once(&threads_once, threads_init);
  return team_max;
}

int kernel_cpu_threads(void) { return threads(); }

fsdpc_status_t kernel_set_cpu_threads(int n) {
  threads();
  if (n < 1) return err_set(STATUS_EINVAL, "kernel_set_cpu_threads: %d threads (at least 1)", n);
#ifndef _OPENMP
  if (n > 1)
    return err_set(STATUS_EUNSUPPORTED,
                   "kernel_set_cpu_threads: %d threads asked, but the library was built without "
                   "OpenMP (one thread only)",
                   n);
#endif
  team_max = n;
  openblas_set_num_threads(n > 1 ? 1 : blas_threads);
  return STATUS_OK;
}

/* Thread t of k's share of [0, n): whole multiples of `align`, the last one ending at n. */
static void share_of(int64_t n, int64_t align, int t, int k, int64_t *i0, int64_t *i1) {
  int64_t units = (n + align - 1) / align;
  *i0 = units * t / k * align;
  *i1 = t == k - 1 ? n : units * (t + 1) / k * align;
  if (*i0 > n) *i0 = n;
  if (*i1 > n) *i1 = n;
}

void cpu_for_shares(int64_t n, int64_t work, int64_t grain, int64_t align, share_fn *fn,
                    const void *ctx) {
  int64_t most = n * (work > 0 ? work : 1) / grain, units = (n + align - 1) / align;
  int k = threads();
  if (most < k) k = most < 1 ? 1 : (int)most;
  if (units < k) k = units < 1 ? 1 : (int)units;
  if (k <= 1) {
    fn(ctx, 0, 0, n);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(k)
  {
    int t = omp_get_thread_num();
    int64_t i0, i1;
    share_of(n, align, t, omp_get_num_threads(), &i0, &i1);
    if (i1 > i0) fn(ctx, t, i0, i1);
  }
#else
  fn(ctx, 0, 0, n);
#endif
}

/* ---- fp32 views of tensors of any float dtype ---- */

static fsdpc_status_t fbuf_alloc(fbuf_t *b, int64_t n) {
  b->n = n;
  b->owned = true;
  b->p = cpu_host_alloc(sizeof(float) * (size_t)(n > 0 ? n : 1), false);
  if (b->p == NULL)
    return err_set(STATUS_ENOMEM, "kernels: out of host memory for %lld floats", (long long)n);
  return STATUS_OK;
}

static fsdpc_status_t cpu_fbuf_in(fbuf_t *b, const fsdpc_tensor_t *t) {
  int64_t n = tensor_numel(t);
  if (t->dtype == DTYPE_F32) {
    *b = (fbuf_t){.p = (float *)t->data, .n = n, .owned = false};
    return STATUS_OK;
  }
  FSDPC_TRY(fbuf_alloc(b, n));
  dtype_to_f32(t->dtype, t->data, b->p, (size_t)n);
  return STATUS_OK;
}

/* With load, the current values are read first (for accumulation). */
static fsdpc_status_t cpu_fbuf_out(fbuf_t *b, fsdpc_tensor_t *t, bool load) {
  if (t->dtype == DTYPE_F32 || load) return cpu_fbuf_in(b, t);
  return fbuf_alloc(b, tensor_numel(t));
}

static void cpu_fbuf_release(fbuf_t *b) {
  if (b->owned) cpu_host_free(b->p, sizeof(float) * (size_t)(b->n > 0 ? b->n : 1));
  b->p = NULL;
}

/* Stores an output view back into t (rounding once) and releases it. */
static void cpu_fbuf_commit(fbuf_t *b, fsdpc_tensor_t *t) {
  if (b->owned) dtype_from_f32(t->dtype, b->p, t->data, (size_t)b->n);
  cpu_fbuf_release(b);
}

static fbuf_t *fbufs_next(fbufs_t *s, const void *t) {
  if (t == NULL || s->st != STATUS_OK) return NULL;
  if (s->n == CPU_FBUFS_MAX) {
    s->st = err_set(STATUS_EINVAL, "kernels: more than %d fp32 views in one kernel", CPU_FBUFS_MAX);
    return NULL;
  }
  return &s->b[s->n];
}

const float *cpu_fbufs_in(fbufs_t *s, const fsdpc_tensor_t *t) {
  fbuf_t *b = fbufs_next(s, t);
  if (b == NULL || (s->st = cpu_fbuf_in(b, t)) != STATUS_OK) return NULL;
  s->out[s->n++] = NULL;
  return b->p;
}

float *cpu_fbufs_out(fbufs_t *s, fsdpc_tensor_t *t, bool load) {
  fbuf_t *b = fbufs_next(s, t);
  if (b == NULL || (s->st = cpu_fbuf_out(b, t, load)) != STATUS_OK) return NULL;
  s->out[s->n++] = t;
  return b->p;
}

fsdpc_status_t cpu_fbufs_end(fbufs_t *s, fsdpc_status_t st) {
  if (s->st != STATUS_OK) st = s->st;
  for (int i = 0; i < s->n; i++) {
    if (s->out[i] != NULL && st == STATUS_OK)
      cpu_fbuf_commit(&s->b[i], s->out[i]);
    else
      cpu_fbuf_release(&s->b[i]);
  }
  s->n = 0;
  return st;
}

/* ---- matmul ---- */

typedef struct gemm_args {
  bool ta, tb;
  int64_t m, n, k, lda, ldb;
  float alpha, beta;
  const float *a, *b;
  float *c;
} gemm_args_t;

/* Rows [i0, i1) of op(a) and of c. */
static void gemm_share(const void *ctx, int t, int64_t i0, int64_t i1) {
  const gemm_args_t *g = ctx;
  (void)t;
  cblas_sgemm(CblasRowMajor, g->ta ? CblasTrans : CblasNoTrans, g->tb ? CblasTrans : CblasNoTrans,
              (int)(i1 - i0), (int)g->n, (int)g->k, g->alpha, g->a + (g->ta ? i0 : i0 * g->lda),
              (int)g->lda, g->b, (int)g->ldb, g->beta, g->c + i0 * g->n, (int)g->n);
}

/* c[m, n] = alpha op(a) op(b) + beta c, in shares of c's rows. A share starts at a multiple
 * of 12 rows: whole groups of the register tiles of OpenBLAS's x86-64 kernels, whose results
 * are then the bits of one call (other BLAS kernels may round differently per share shape, so
 * a matrix product is deterministic for a given thread count, and the same bits for any count
 * only where the BLAS computes each tile alike). */
static void gemm(const gemm_args_t *g) {
  cpu_for_shares(g->m, g->n * g->k, GEMM_GRAIN, 12, gemm_share, g);
}

static fsdpc_status_t cpu_matmul(fsdpc_tensor_t *out, const fsdpc_tensor_t *a, bool trans_a,
                                 const fsdpc_tensor_t *b, bool trans_b, float alpha, float beta,
                                 const matmul_dims_t *d) {
  fbufs_t s = {0};
  const float *fa = cpu_fbufs_in(&s, a), *fb = cpu_fbufs_in(&s, b);
  float *fo = cpu_fbufs_out(&s, out, beta != 0.0f);
  if (s.st != STATUS_OK) return cpu_fbufs_end(&s, STATUS_OK);
  if (d->k == 0) {
    for (int64_t i = 0; i < d->m * d->n; i++) fo[i] = beta == 0.0f ? 0.0f : beta * fo[i];
  } else {
    gemm(&(gemm_args_t){.ta = trans_a,
                        .tb = trans_b,
                        .m = d->m,
                        .n = d->n,
                        .k = d->k,
                        .lda = d->lda,
                        .ldb = d->ldb,
                        .alpha = alpha,
                        .beta = beta,
                        .a = fa,
                        .b = fb,
                        .c = fo});
  }
  return cpu_fbufs_end(&s, STATUS_OK);
}

/* ---- embedding ---- */

static fsdpc_status_t check_ids(const char *fn, const fsdpc_tensor_t *ids, int64_t vocab) {
  for (int64_t i = 0, n = tensor_numel(ids); i < n; i++) {
    int64_t id = index_at(ids, i);
    if (id < 0 || id >= vocab)
      return err_set(STATUS_EINVAL, "%s: index %lld at position %lld is outside [0, %lld)", fn,
                     (long long)id, (long long)i, (long long)vocab);
  }
  return STATUS_OK;
}

static fsdpc_status_t cpu_embedding(fsdpc_tensor_t *out, const fsdpc_tensor_t *table,
                                    const fsdpc_tensor_t *ids, int64_t first, int64_t vocab) {
  int64_t n = tensor_numel(ids), V = table->shape[0], D = table->shape[1];
  size_t row = (size_t)D * dtype_size(table->dtype);
  FSDPC_TRY(check_ids("kernel_embedding", ids, vocab));
  for (int64_t i = 0; i < n; i++) {
    int64_t id = index_at(ids, i) - first;
    char *dst = (char *)out->data + (size_t)i * row;
    if (id < 0 || id >= V)
      memset(dst, 0, row); /* another shard's row */
    else
      memcpy(dst, (const char *)table->data + (size_t)id * row, row);
  }
  return STATUS_OK;
}

typedef struct emb_args {
  int64_t n, first, V, D;
  const fsdpc_tensor_t *ids;
  const float *go;
  float *g;
} emb_args_t;

/* Columns [j0, j1) of the table's gradient, the positions added in order. */
static void embedding_backward_share(const void *ctx, int t, int64_t j0, int64_t j1) {
  const emb_args_t *a = ctx;
  (void)t;
  for (int64_t i = 0; i < a->n; i++) {
    int64_t id = index_at(a->ids, i) - a->first;
    if (id < 0 || id >= a->V) continue;
    float *dst = a->g + id * a->D;
    const float *src = a->go + i * a->D;
#pragma omp simd
    for (int64_t j = j0; j < j1; j++) dst[j] += src[j];
  }
}

static fsdpc_status_t cpu_embedding_backward(fsdpc_tensor_t *grad_table,
                                             const fsdpc_tensor_t *grad_out,
                                             const fsdpc_tensor_t *ids, int64_t first,
                                             int64_t vocab) {
  FSDPC_TRY(check_ids("kernel_embedding_backward", ids, vocab));
  fbufs_t s = {0};
  float *g = cpu_fbufs_out(&s, grad_table, true);
  const float *go = cpu_fbufs_in(&s, grad_out);
  if (s.st != STATUS_OK) return cpu_fbufs_end(&s, STATUS_OK);
  emb_args_t a = {.n = tensor_numel(ids),
                  .first = first,
                  .V = grad_table->shape[0],
                  .D = grad_table->shape[1],
                  .ids = ids,
                  .go = go,
                  .g = g};
  cpu_for_shares(a.D, a.n, ELEM_GRAIN, 16, embedding_backward_share, &a);
  return cpu_fbufs_end(&s, STATUS_OK);
}

static kernel_ops_t ops;
static pthread_once_t ops_once = PTHREAD_ONCE_INIT;

static void ops_init(void) {
  ops.matmul = cpu_matmul;
  ops.embedding = cpu_embedding;
  ops.embedding_backward = cpu_embedding_backward;
  cpu_attention_kernels(&ops);
  cpu_row_kernels(&ops);
  cpu_pointwise_kernels(&ops);
}

const kernel_ops_t *cpu_kernels(void) {
  pthread_once(&ops_once, ops_init);
  return &ops;
}
