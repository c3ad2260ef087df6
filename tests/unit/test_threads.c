/*
 * The CPU kernels on several threads: each kernel on inputs large enough to be split (odd sizes,
 * so that shares end mid-vector), fp32 and bf16, a mixture of experts' routing and weighted sum
 * among them, gives the same bits as on one thread; matrix products, whose rounding is the
 * BLAS's per call shape, agree to 1e-6 and give the same bits run after run on the same thread
 * count. Three training steps of llama-small (AdamW, clipping) likewise, parameter by
 * parameter.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/kernels.h"
#include "dtensor/dtensor.h"
#include "train/data.h"
#include "models/llama/llama.h"
#include "nn/optim.h"
#include "train/train.h"
#include "tests/harness.h"

#define THREADS 3

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

static uint64_t rng = 88172645463325252ull;

static double uniform(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (double)(rng >> 11) / 9007199254740992.0;
}

/* A tensor of values in [lo, hi). */
static void filled(fsdpc_tensor_t *t, dtype_t dt, int ndim, const int64_t *shape, double lo,
                   double hi) {
  ok(tensor_init(t, dt, device_cpu(), ndim, shape));
  for (int64_t i = 0; i < tensor_numel(t); i++)
    dtype_store(dt, t->data, (size_t)i, lo + (hi - lo) * uniform());
}

static void ids(fsdpc_tensor_t *t, int64_t n, int64_t below, int64_t ignored_every) {
  ok(tensor_init(t, DTYPE_I64, device_cpu(), 1, &n));
  for (int64_t i = 0; i < n; i++)
    ((int64_t *)t->data)[i] =
        ignored_every > 0 && i % ignored_every == 0 ? -100 : (int64_t)(uniform() * (double)below);
}

enum { MAX_OUT = 64 };

/* Inputs shared by both runs. */
typedef struct inputs {
  fsdpc_tensor_t a, b, bt, x, w, q, k, v, dout, q2, k2, v2, dout2, gate, up, gate16, up16, logits,
      targets, table_ids, grad_rows, p, g, p16;
  rope_t rope;
} inputs_t;

static void make_inputs(inputs_t *in) {
  int64_t ab[2] = {197, 301}, bb[2] = {301, 389}, bt[2] = {389, 301}, xs[2] = {523, 257};
  int64_t ws[1] = {257}, qs[4] = {2, 150, 4, 32}, ks[4] = {2, 150, 2, 32}, el[1] = {100003};
  int64_t ls[2] = {301, 263}, gr[2] = {301, 83}, ps[1] = {70001};
  filled(&in->a, DTYPE_F32, 2, ab, -1, 1);
  filled(&in->b, DTYPE_F32, 2, bb, -1, 1);
  filled(&in->bt, DTYPE_F32, 2, bt, -1, 1);
  filled(&in->x, DTYPE_F32, 2, xs, -2, 2);
  filled(&in->w, DTYPE_F32, 1, ws, 0.5, 1.5);
  filled(&in->q, DTYPE_F32, 4, qs, -2, 2);
  filled(&in->k, DTYPE_F32, 4, ks, -2, 2);
  filled(&in->v, DTYPE_F32, 4, ks, -2, 2);
  filled(&in->dout, DTYPE_F32, 4, qs, -1, 1);
  int64_t q2[4] = {4, 45, 4, 24}, k2[4] = {4, 45, 1, 24}; /* one odd block, groups of 4 */
  filled(&in->q2, DTYPE_F32, 4, q2, -2, 2);
  filled(&in->k2, DTYPE_F32, 4, k2, -2, 2);
  filled(&in->v2, DTYPE_F32, 4, k2, -2, 2);
  filled(&in->dout2, DTYPE_F32, 4, q2, -1, 1);
  filled(&in->gate, DTYPE_F32, 1, el, -6, 6);
  filled(&in->up, DTYPE_F32, 1, el, -2, 2);
  filled(&in->gate16, DTYPE_BF16, 1, el, -6, 6);
  filled(&in->up16, DTYPE_BF16, 1, el, -2, 2);
  filled(&in->logits, DTYPE_F32, 2, ls, -8, 8);
  ids(&in->targets, ls[0], ls[1], 7);
  ids(&in->table_ids, gr[0], 37, 0);
  filled(&in->grad_rows, DTYPE_F32, 2, gr, -1, 1);
  filled(&in->p, DTYPE_F32, 1, ps, -1, 1);
  filled(&in->g, DTYPE_F32, 1, ps, -1e-2, 1e-2);
  filled(&in->p16, DTYPE_BF16, 1, ps, -1, 1);
  in->rope = (rope_t){.theta = 10000.0};
}

static void free_inputs(inputs_t *in) {
  fsdpc_tensor_t *all[] = {&in->a,         &in->b,    &in->bt,     &in->x,       &in->w,
                           &in->q,         &in->k,    &in->v,      &in->dout,    &in->q2,
                           &in->k2,        &in->v2,   &in->dout2,  &in->gate,    &in->up,
                           &in->gate16,    &in->up16, &in->logits, &in->targets, &in->table_ids,
                           &in->grad_rows, &in->p,    &in->g,      &in->p16};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
}

typedef struct outputs {
  int n, n_gemm; /* the first n_gemm are matrix products */
  const char *name[MAX_OUT];
  fsdpc_tensor_t t[MAX_OUT];
  double sums[2];
} outputs_t;

static fsdpc_tensor_t *out_new(outputs_t *o, const char *name, dtype_t dt, int ndim,
                               const int64_t *shape) {
  ck_assert_int_lt(o->n, MAX_OUT);
  o->name[o->n] = name;
  fsdpc_tensor_t *t = &o->t[o->n++];
  ok(tensor_init(t, dt, device_cpu(), ndim, shape));
  memset(t->data, 0, tensor_nbytes(t));
  return t;
}

static fsdpc_tensor_t *out_copy(outputs_t *o, const char *name, const fsdpc_tensor_t *from) {
  fsdpc_tensor_t *t = out_new(o, name, from->dtype, from->ndim, from->shape);
  memcpy(t->data, from->data, tensor_nbytes(t));
  return t;
}

/* A view of numel(shape) values of a 1-D tensor from off (the caller frees it). */
static fsdpc_tensor_t first_of(const fsdpc_tensor_t *t, int64_t off, int ndim,
                               const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  fsdpc_tensor_t part, v;
  ok(tensor_narrow(&part, t, 0, off, n));
  ok(tensor_view(&v, &part, ndim, shape));
  tensor_free(&part);
  return v;
}

/* A mixture of experts' routing (the logits as 263 experts' scores of 301 tokens, top-8, with
 * a bias; its backward with the load-balancing term) and weighted sum (2 slots a token, each
 * one row, the rows shuffled), forward and backward. */
static void moe_kernels(const inputs_t *in, outputs_t *o) {
  int64_t N = in->logits.shape[0], E = in->logits.shape[1], k = 8, nk[2] = {N, k};
  fsdpc_tensor_t bias = first_of(&in->g, 0, 1, &E), g = first_of(&in->g, E, 1, &E);
  fsdpc_tensor_t dw = first_of(&in->up, 0, 2, nk);
  fsdpc_tensor_t *p = out_new(o, "moe scores", DTYPE_F32, 2, in->logits.shape);
  fsdpc_tensor_t *ex = out_new(o, "moe experts", DTYPE_I64, 2, nk);
  fsdpc_tensor_t *w = out_new(o, "moe weights", DTYPE_F32, 2, nk);
  ok(kernel_moe_route(p, ex, w, &in->logits, &bias, (int)k, true, false, 1.5));
  ok(kernel_moe_route_backward(out_new(o, "moe dz", DTYPE_F32, 2, in->logits.shape), &dw, w, p, ex,
                               &g, (int)k, true, false, 1.5));
  int64_t S = 2 * N, D = 57, yd[2] = {S, D}, nd[2] = {N, D}, s1 = S + 1;
  fsdpc_tensor_t y = first_of(&in->gate, 0, 2, yd), ws = first_of(&in->up, 0, 1, &S);
  fsdpc_tensor_t dout = first_of(&in->up, S, 2, nd), offs, rows, slots;
  ok(tensor_init(&offs, DTYPE_I64, device_cpu(), 1, &s1));
  ok(tensor_init(&rows, DTYPE_I64, device_cpu(), 1, &S));
  ok(tensor_init(&slots, DTYPE_I64, device_cpu(), 1, &S));
  for (int64_t s = 0; s <= S; s++) ((int64_t *)offs.data)[s] = s;
  for (int64_t s = 0; s < S; s++) {
    int64_t r = s * 37 % S; /* 37 and 602 are coprime: a permutation */
    ((int64_t *)rows.data)[s] = r;
    ((int64_t *)slots.data)[r] = s;
  }
  ok(kernel_moe_combine(out_new(o, "moe combine", DTYPE_F32, 2, nd), &y, &ws, &offs, &rows));
  ok(kernel_moe_combine_backward(out_new(o, "moe combine dy", DTYPE_F32, 2, yd),
                                 out_new(o, "moe combine dw", DTYPE_F32, 1, &S), &dout, &y, &ws,
                                 &slots, &offs, &rows));
  fsdpc_tensor_t *all[] = {&bias, &g, &dw, &y, &ws, &dout, &offs, &rows, &slots};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
}

/* Every kernel the CPU splits, on the inputs. */
static void run_kernels(const inputs_t *in, outputs_t *o) {
  int64_t mn[2] = {197, 389}, long_rows[2] = {389, 197};
  /* columns split (n > m), rows split (m > n), transposed operands, accumulation */
  ok(kernel_matmul(out_new(o, "a b", DTYPE_F32, 2, mn), &in->a, false, &in->b, false, 1, 0));
  ok(kernel_matmul(out_new(o, "a bt^T", DTYPE_F32, 2, mn), &in->a, false, &in->bt, true, 0.5f, 0));
  ok(kernel_matmul(out_new(o, "b^T a^T", DTYPE_F32, 2, long_rows), &in->b, true, &in->a, true, 1,
                   0));
  fsdpc_tensor_t *acc = out_copy(o, "a b + c", &o->t[0]);
  ok(kernel_matmul(acc, &in->a, false, &in->b, false, 1, 1));
  o->n_gemm = o->n;

  int64_t rows = in->x.shape[0], D = in->x.shape[1], r1[1] = {rows};
  fsdpc_tensor_t *y = out_new(o, "rmsnorm", DTYPE_F32, 2, in->x.shape);
  fsdpc_tensor_t *rstd = out_new(o, "rstd", DTYPE_F32, 1, r1);
  ok(kernel_rmsnorm(y, rstd, &in->x, &in->w, 1e-5f));
  fsdpc_tensor_t *dx = out_new(o, "rmsnorm dx", DTYPE_F32, 2, in->x.shape);
  fsdpc_tensor_t *dw = out_new(o, "rmsnorm dw", DTYPE_F32, 1, &D);
  ok(kernel_rmsnorm_backward(dx, dw, &in->x /* as dy */, &in->x, &in->w, rstd));

  fsdpc_tensor_t *rq = out_new(o, "rope", DTYPE_F32, 4, in->q.shape);
  ok(kernel_rope(rq, &in->q, &in->rope, 3, false));

  for (int c = 0; c < 2; c++) {
    const fsdpc_tensor_t *q = c ? &in->q2 : &in->q, *k = c ? &in->k2 : &in->k,
                         *v = c ? &in->v2 : &in->v;
    int64_t ls[3] = {q->shape[0], q->shape[2], q->shape[1]};
    fsdpc_tensor_t *att = out_new(o, "attention", DTYPE_F32, 4, q->shape);
    fsdpc_tensor_t *lse = out_new(o, "lse", DTYPE_F32, 3, ls);
    ok(kernel_attention(att, lse, q, k, v));
    ok(kernel_attention_backward(
        out_new(o, "dq", DTYPE_F32, 4, q->shape), out_new(o, "dk", DTYPE_F32, 4, k->shape),
        out_new(o, "dv", DTYPE_F32, 4, v->shape), c ? &in->dout2 : &in->dout, q, k, v, att, lse));
  }

  const int64_t *el = in->gate.shape;
  ok(kernel_silu_mul(out_new(o, "silu_mul", DTYPE_F32, 1, el), &in->gate, &in->up));
  ok(kernel_silu_mul_backward(out_new(o, "dgate", DTYPE_F32, 1, el),
                              out_new(o, "dup", DTYPE_F32, 1, el), &in->up, &in->gate, &in->up));
  ok(kernel_silu_mul(out_new(o, "silu_mul bf16", DTYPE_BF16, 1, el), &in->gate16, &in->up16));
  ok(kernel_silu_mul_backward(out_new(o, "dgate bf16", DTYPE_BF16, 1, el),
                              out_new(o, "dup bf16", DTYPE_BF16, 1, el), &in->up16, &in->gate16,
                              &in->up16));
  ok(kernel_add(out_new(o, "add", DTYPE_F32, 1, el), &in->gate, &in->up));
  ok(kernel_axpy(out_copy(o, "axpy", &in->gate), 1.0f, &in->up));
  ok(kernel_axpy(out_copy(o, "axpy 0.3", &in->gate), 0.3f, &in->up));
  ok(kernel_axpy(out_copy(o, "axpy bf16", &in->gate16), 0.3f, &in->up16));
  ok(kernel_scale(out_copy(o, "scale", &in->gate), 0.7f));

  int64_t n_rows[1] = {in->logits.shape[0]};
  ok(kernel_cross_entropy(out_new(o, "cross-entropy", DTYPE_F32, 1, n_rows), &in->logits,
                          &in->targets));
  ok(kernel_cross_entropy_backward(out_new(o, "dlogits", DTYPE_F32, 2, in->logits.shape),
                                   &in->logits, &in->targets, 0.01f));

  int64_t table[2] = {37, in->grad_rows.shape[1]};
  fsdpc_tensor_t *gt = out_new(o, "embedding grad", DTYPE_F32, 2, table);
  ok(kernel_embedding_backward(gt, &in->grad_rows, &in->table_ids));
  ok(kernel_embedding_backward(gt, &in->grad_rows, &in->table_ids)); /* accumulates */

  adamw_args_t args = {.lr = 1e-2,
                       .beta1 = 0.9,
                       .beta2 = 0.95,
                       .eps = 1e-8,
                       .weight_decay = 0.1,
                       .step = 3,
                       .grad_scale = 0.5f};
  for (int f = 0; f < 2; f++) {
    const fsdpc_tensor_t *p0 = f ? &in->p16 : &in->p;
    fsdpc_tensor_t *p = out_copy(o, f ? "adamw p bf16" : "adamw p", p0);
    fsdpc_tensor_t *m = out_copy(o, "adamw m", &in->g), *v = out_copy(o, "adamw v", &in->g);
    ok(kernel_scale(v, 0.0f));
    ok(kernel_adamw(p, &in->g, m, v, &args));
    ok(kernel_adamw(p, &in->g, m, v, &args));
  }
  moe_kernels(in, o);
  ok(kernel_sum_squares(&in->gate, &o->sums[0]));
  ok(kernel_sum_squares(&in->p, &o->sums[1]));
  double both[2]; /* the gradient norm's call: the same bits as one call each */
  const fsdpc_tensor_t *xs[2] = {&in->gate, &in->p};
  ok(kernel_sum_squares_many(xs, 2, both));
  ck_assert(both[0] == o->sums[0] && both[1] == o->sums[1]);
  ck_assert_int_eq(kernel_sum_squares_many(NULL, 2, both), STATUS_EINVAL);
  ok(kernel_sum_squares_many(NULL, 0, NULL));
}

static void free_outputs(outputs_t *o) {
  for (int i = 0; i < o->n; i++) tensor_free(&o->t[i]);
}

/* Relative L2 distance of two F32 tensors' values. */
static double distance(const fsdpc_tensor_t *x, const fsdpc_tensor_t *y) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < tensor_numel(x); i++) {
    double a = ((const float *)x->data)[i], b = ((const float *)y->data)[i];
    num += (a - b) * (a - b);
    den += a * a;
  }
  return sqrt(num / (den > 0 ? den : 1));
}

/* The names of the outputs [from, to) whose bytes differ between a and b, or "". */
static void differing(const outputs_t *a, const outputs_t *b, int from, int to, char *buf,
                      size_t n) {
  buf[0] = '\0';
  for (int i = from; i < to; i++)
    if (memcmp(a->t[i].data, b->t[i].data, tensor_nbytes(&a->t[i])) != 0)
      snprintf(buf + strlen(buf), n - strlen(buf), " [%s]", a->name[i]);
}

START_TEST(kernels_give_the_same_bits_on_any_thread_count) {
  inputs_t in;
  make_inputs(&in);
  outputs_t one = {0}, many = {0}, again = {0};
  ok(kernel_set_cpu_threads(1));
  run_kernels(&in, &one);
  ok(kernel_set_cpu_threads(THREADS));
  ck_assert_int_eq(kernel_cpu_threads(), THREADS);
  run_kernels(&in, &many);
  run_kernels(&in, &again);
  ok(kernel_set_cpu_threads(1));
  ck_assert_int_eq(one.n, many.n);
  char differ[1024];
  differing(&one, &many, one.n_gemm, one.n, differ, sizeof differ);
  ck_assert_msg(differ[0] == '\0', "%d threads give other bits than one:%s", THREADS, differ);
  ck_assert_msg(memcmp(one.sums, many.sums, sizeof one.sums) == 0,
                "sum of squares: %.17g, %.17g on one thread; %.17g, %.17g on %d", one.sums[0],
                one.sums[1], many.sums[0], many.sums[1], THREADS);
  for (int i = 0; i < one.n_gemm; i++) {
    double e = distance(&one.t[i], &many.t[i]);
    ck_assert_msg(e < 1e-6, "%s: %d threads are %.3g from one", one.name[i], THREADS, e);
  }
  differing(&many, &again, 0, many.n, differ, sizeof differ);
  ck_assert_msg(differ[0] == '\0', "two runs on %d threads differ:%s", THREADS, differ);
  free_outputs(&one);
  free_outputs(&many);
  free_outputs(&again);
  free_inputs(&in);
}
END_TEST

/* Three steps of llama-small, 8 x 64 tokens; every parameter's bytes after them. */
static void train_small(int threads, fsdpc_tensor_t *params, int *n_params, double *losses) {
  ok(kernel_set_cpu_threads(threads));
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/configs/llama-small.json", &cfg));
  llama_options_t opt = LLAMA_OPTIONS_INIT;
  llama_t *m;
  ok(llama_new(&cfg, &opt, &m));
  ok(llama_init_weights(m, 1234));
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  data_spec_t spec = {.batch_size = 8, .seq_len = 64, .grad_accum = 1, .dp_size = 1};
  nn_param_t **ps;
  int n;
  ok(nn_named_parameters(llama_module(m), &ps, &n));
  adamw_config_t acfg = ADAMW_CONFIG_INIT;
  acfg.lr = 3e-3;
  acfg.weight_decay = 0.1;
  optim_t *o;
  ok(optim_new(ps, n, &acfg, &o));
  for (int s = 0; s < 3; s++) {
    optim_zero_grad(o);
    ok(llama_micro_step(m, d, &spec, s, 0, &losses[s]));
    double norm;
    float coef;
    ok(clip_grad_coef(ps, n, 0.5, NULL, &norm, &coef));
    ok(optim_step_scaled(o, 1.0, coef));
  }
  for (int i = 0; i < n; i++)
    ok(tensor_clone(&params[i], dtensor_local(ps[i]->value), DTYPE_F32, device_cpu()));
  *n_params = n;
  optim_free(o);
  free(ps);
  data_free(d);
  llama_free(m);
  ok(kernel_set_cpu_threads(1));
}

START_TEST(training_agrees_on_any_thread_count) {
  enum { MAX_PARAMS = 64 };
  fsdpc_tensor_t one[MAX_PARAMS], many[MAX_PARAMS], again[MAX_PARAMS];
  double l1[3], ln[3], la[3];
  int n1, nn, na;
  train_small(1, one, &n1, l1);
  train_small(THREADS, many, &nn, ln);
  train_small(THREADS, again, &na, la);
  ck_assert_int_eq(n1, nn);
  ck_assert_int_eq(n1, na);
  for (int s = 0; s < 3; s++)
    ck_assert_msg(fabs(l1[s] - ln[s]) <= 1e-6 * fabs(l1[s]),
                  "step %d: loss %.17g, %.17g on %d threads", s, l1[s], ln[s], THREADS);
  ck_assert_msg(memcmp(ln, la, sizeof ln) == 0, "losses of two runs on %d threads differ", THREADS);
  for (int i = 0; i < n1; i++) {
    double e = distance(&one[i], &many[i]);
    ck_assert_msg(e < 1e-5, "parameter %d: %d threads are %.3g from one after 3 steps", i, THREADS,
                  e);
    ck_assert_msg(memcmp(many[i].data, again[i].data, tensor_nbytes(&many[i])) == 0,
                  "parameter %d: two runs on %d threads differ", i, THREADS);
    tensor_free(&one[i]);
    tensor_free(&many[i]);
    tensor_free(&again[i]);
  }
}
END_TEST

START_TEST(thread_counts_below_one_are_refused) {
  ck_assert_int_eq(kernel_set_cpu_threads(0), STATUS_EINVAL);
  ck_assert_ptr_nonnull(strstr(err_detail(), "0 threads"));
  ck_assert_int_eq(kernel_cpu_threads(), 1);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("threads");
  TCase *tc = tcase_create("threads");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, kernels_give_the_same_bits_on_any_thread_count);
  tcase_add_test(tc, training_agrees_on_any_thread_count);
  tcase_add_test(tc, thread_counts_below_one_are_refused);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
