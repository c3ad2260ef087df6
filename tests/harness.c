#include "tests/harness.h"

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

unsigned long long test_rng_next(test_rng_t *r) { /* splitmix64 */
  unsigned long long z = (r->s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

int test_rng_int(test_rng_t *r, int lo, int hi) {
  return lo + (int)(test_rng_next(r) % (unsigned long long)(hi - lo + 1));
}

int harness_main(int argc, char **argv, Suite *(*make_suite)(void)) {
  if (world_init(&argc, &argv) != STATUS_OK) {
    fprintf(stderr, "harness: %s\n", err_detail());
    return 1;
  }
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
