#include "tests/harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int skip_requested;

void harness_skip(const char *why) {
  if (!skip_requested && world_rank() == 0) printf("skipped: %s\n", why);
  skip_requested = 1;
}

int all_ranks(int ok) {
  int in = ok ? 1 : 0, out = 0;
  MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return out;
}

static void must(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

mesh_t *test_local_mesh(void) {
  mesh_t *m;
  must(mesh_new_local("local", DEVICE_CPU, &m));
  return m;
}

dtensor_t *test_replicated(mesh_t *mesh, int ndim, const int64_t *shape, double fill) {
  fsdpc_tensor_t t;
  must(tensor_init(&t, DTYPE_F32, device_cpu(), ndim, shape));
  must(tensor_fill(&t, fill));
  dtensor_t *d;
  placement_t rep = placement_replicate();
  must(dtensor_from_local(&t, mesh, &rep, ndim, shape, &d));
  tensor_free(&t);
  return d;
}

unsigned long long test_rng_next(test_rng_t *r) { /* splitmix64 */
  unsigned long long z = (r->s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

int test_rng_int(test_rng_t *r, int lo, int hi) {
  return lo + (int)(test_rng_next(r) % (unsigned long long)(hi - lo + 1));
}

double test_rng_uniform(test_rng_t *r) {
  return (double)(test_rng_next(r) >> 11) * 0x1.0p-52 - 1.0;
}

void test_fill_uniform(fsdpc_tensor_t *t, test_rng_t *r, double scale) {
  fsdpc_tensor_t host;
  ck_assert_int_eq(tensor_init(&host, t->dtype, device_cpu(), t->ndim, t->shape), STATUS_OK);
  for (int64_t i = 0; i < tensor_numel(t); i++)
    dtype_store(t->dtype, host.data, (size_t)i, scale * test_rng_uniform(r));
  ck_assert_int_eq(tensor_copy(t, &host), STATUS_OK);
  tensor_free(&host);
}

double test_rel_l2(const fsdpc_tensor_t *a, const fsdpc_tensor_t *ref) {
  fsdpc_tensor_t ha, hr;
  ck_assert_msg(tensor_same_shape(a, ref), "test_rel_l2: shapes differ");
  ck_assert_int_eq(tensor_clone(&ha, a, DTYPE_F32, device_cpu()), STATUS_OK);
  ck_assert_int_eq(tensor_clone(&hr, ref, DTYPE_F32, device_cpu()), STATUS_OK);
  const float *pa = ha.data, *pr = hr.data;
  double num = 0, den = 0;
  for (int64_t i = 0; i < tensor_numel(a); i++) {
    double d = (double)pa[i] - pr[i];
    num += d * d;
    den += (double)pr[i] * pr[i];
  }
  tensor_free(&ha);
  tensor_free(&hr);
  if (num != num) return INFINITY; /* NaN anywhere is a failure */
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static int saved_argc;
static char **saved_argv;
int test_argc(void) { return saved_argc; }
char **test_argv(void) { return saved_argv; }

int harness_main(int argc, char **argv, Suite *(*make_suite)(void)) {
  if (world_init(&argc, &argv) != STATUS_OK) {
    fprintf(stderr, "harness: %s\n", err_detail());
    return 1;
  }
  saved_argc = argc;
  saved_argv = argv;
  int rank = world_rank(), size = world_size();
  SRunner *sr = srunner_create(make_suite());
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, rank == 0 ? CK_NORMAL : CK_SILENT);
  int failed = srunner_ntests_failed(sr);
  if (rank != 0 && failed > 0) { /* rank 0 printed its own; others report theirs here */
    TestResult **res = srunner_failures(sr);
    for (int i = 0; i < failed; i++)
      fprintf(stderr, "rank %d: %s:%d: %s: %s\n", rank, tr_lfile(res[i]), tr_lno(res[i]),
              tr_tcname(res[i]), tr_msg(res[i]));
    free(res);
  }
  srunner_free(sr);
  int total = 0, skip_all = 0;
  MPI_Allreduce(&failed, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&skip_requested, &skip_all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0 && size > 1) printf("%d rank(s): %d failure(s) in total\n", size, total);
  world_finalize();
  if (total > 0) return 1;
  return skip_all ? 77 : 0;
}
