/*
 * fsdp-demo: distributes a tensor over a 2x2 mesh, moves it through several placements and
 * prints each rank's local shape and global offset, checking every step against the
 * directly distributed tensor.
 *
 *   mpirun -n 4 build/tools/fsdp-demo
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dtensor/dtensor.h"
#include "mesh/world.h"

enum { LINE_MAX_LEN = 160 };

/* Whether cur holds what distributing full directly with placements pl gives (a Partial
 * value is checked through its reduced whole). Collective. */
static fsdpc_status_t same_as_direct(const dtensor_t *cur, const fsdpc_tensor_t *full, mesh_t *mesh,
                                     const placement_t *pl, bool *same) {
  dtensor_t *direct = NULL;
  fsdpc_tensor_t got = {0}, want = {0};
  *same = false;
  fsdpc_status_t st = dtensor_distribute(full, mesh, pl, DTENSOR_ALL_RANKS, &direct);
  if (st == STATUS_OK) st = dtensor_full_tensor(cur, &got);
  if (st == STATUS_OK) st = dtensor_full_tensor(direct, &want);
  if (st == STATUS_OK) st = tensor_equal(&got, &want, same);
  tensor_free(&got);
  tensor_free(&want);
  dtensor_free(direct);
  return st;
}

/* Rank 0 prints every rank's line of step k, in rank order. Collective. */
static fsdpc_status_t print_step(int k, const placement_t *pl, const dtensor_t *cur, bool same) {
  char pls[128], ls[64], os[64], line[LINE_MAX_LEN];
  int64_t off[2];
  dtensor_offset(cur, off);
  const fsdpc_tensor_t *local = dtensor_local(cur);
  snprintf(line, sizeof line, "step %d %-14s rank %d: local %-8s offset %-8s %s", k,
           placements_str(2, pl, pls, sizeof pls), world_rank(),
           tensor_shape_str(local->ndim, local->shape, ls, sizeof ls),
           tensor_shape_str(2, off, os, sizeof os), same ? "ok" : "MISMATCH");
  char *all = malloc((size_t)world_size() * LINE_MAX_LEN);
  if (all == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  fsdpc_status_t st = pg_host_all_gather(world_pg(), line, all, LINE_MAX_LEN, PG_HOST_BYTE);
  for (int r = 0; st == STATUS_OK && world_rank() == 0 && r < world_size(); r++)
    printf("%s\n", all + r * LINE_MAX_LEN);
  free(all);
  return st;
}

static fsdpc_status_t run(void) {
  int shape[2] = {2, 2};
  const char *names[2] = {"dp", "tp"};
  mesh_t *mesh = NULL;
  FSDPC_TRY(mesh_new(2, shape, names, DEVICE_CPU, &mesh));

  int64_t gshape[2] = {7, 5};
  fsdpc_tensor_t full;
  fsdpc_status_t st = tensor_init(&full, DTYPE_F32, device_cpu(), 2, gshape);
  if (st != STATUS_OK) {
    mesh_free(mesh);
    return st;
  }
  for (int64_t i = 0; i < 35; i++) ((float *)full.data)[i] = (float)i;

  const placement_t steps[][2] = {
      {placement_shard(0), placement_shard(1)},
      {placement_shard(1), placement_shard(0)},
      {placement_replicate(), placement_shard(0)},
      {placement_shard(0), placement_shard(0)},
      {placement_partial(REDUCE_SUM), placement_shard(1)},
      {placement_replicate(), placement_replicate()},
  };
  int nsteps = (int)(sizeof steps / sizeof steps[0]);
  dtensor_t *cur = NULL;
  st = dtensor_distribute(&full, mesh, steps[0], DTENSOR_ALL_RANKS, &cur);
  for (int k = 0; k < nsteps && st == STATUS_OK; k++) {
    if (k > 0) {
      dtensor_t *next = NULL;
      st = dtensor_redistribute(cur, steps[k], &next);
      if (st != STATUS_OK) break;
      dtensor_free(cur);
      cur = next;
    }
    bool same = false;
    st = same_as_direct(cur, &full, mesh, steps[k], &same);
    if (st == STATUS_OK) st = print_step(k, steps[k], cur, same);
    if (st == STATUS_OK && !same)
      st = err_set(STATUS_EINTERNAL, "step %d does not match distribute()", k);
  }
  st = pg_agree(world_pg(), st);
  dtensor_free(cur);
  tensor_free(&full);
  mesh_free(mesh);
  return st;
}

int main(int argc, char **argv) {
  for (int i = 1; i < argc; i++) { /* before MPI starts: no mesh is needed to answer these */
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      printf(
          "usage: mpirun -n 4 fsdp-demo\n"
          "  distributes a tensor over a 2x2 mesh and moves it through several placements,\n"
          "  checking each step against the directly distributed tensor\n"
          "       fsdp-demo --help | --version\n");
      return 0;
    }
    if (strcmp(argv[i], "--version") == 0) {
      printf("fsdp-demo (fsdpc) %s\n", fsdpc_version());
      return 0;
    }
    fprintf(stderr, "fsdp-demo: unknown argument '%s' (it takes none; --help)\n", argv[i]);
    return 2;
  }
  if (!world_start(&argc, &argv, "fsdp-demo")) return 1;
  fsdpc_status_t st = run();
  if (st != STATUS_OK)
    fprintf(stderr, "fsdp-demo: rank %d: %s: %s\n", world_rank(), status_str(st), err_detail());
  else if (world_rank() == 0)
    printf("fsdp-demo: every step matches distribute() of the same tensor\n");
  world_finalize();
  return st == STATUS_OK ? 0 : 1;
}
