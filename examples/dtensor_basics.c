/*
 * DTensor in brief: a 16 x 15 tensor sharded over a 2-D mesh (2 replicas x the rest of the
 * world), then redistributed so that every rank holds all of it. Every call's status is
 * checked; on a world the mesh cannot divide (3 ranks) every rank says why and exits 1.
 *
 *   mpirun -n 4 build/examples/dtensor-basics
 */
#include <stdio.h>

#include "dtensor/dtensor.h"
#include "mesh/world.h"

/* A failed call: its error on this rank, then the cleanup. */
#define CHECK(call)                                                                      \
  do {                                                                                   \
    fsdpc_status_t st_ = (call);                                                         \
    if (st_ != STATUS_OK) {                                                              \
      fprintf(stderr, "rank %d: %s: %s\n", world_rank(), status_str(st_), err_detail()); \
      goto done;                                                                         \
    }                                                                                    \
  } while (0)

int main(int argc, char **argv) {
  if (world_init(&argc, &argv) != STATUS_OK) { /* MPI; picks this rank's GPU if any */
    fprintf(stderr, "%s\n", err_detail());
    return 1;
  }
  int rc = 1;
  mesh_t *mesh = NULL;
  fsdpc_tensor_t full = {0}; /* the same tensor on every rank */
  dtensor_t *x = NULL, *y = NULL;
  CHECK(mesh_new(2, (int[]){2, -1}, (const char *[]){"dp_replicate", "dp_shard"}, DEVICE_CPU,
                 &mesh)); /* -1: the rest of the world */
  CHECK(tensor_zeros(&full, DTYPE_F32, device_cpu(), 2, (int64_t[]){16, 15}));
  CHECK(dtensor_distribute(&full, mesh, (placement_t[]){placement_replicate(), placement_shard(0)},
                           DTENSOR_ALL_RANKS, &x));
  CHECK(dtensor_redistribute(x, (placement_t[]){placement_replicate(), placement_replicate()}, &y));
  const fsdpc_tensor_t *local = dtensor_local(y); /* the whole tensor */
  printf("rank %d: %lld x %lld\n", world_rank(), (long long)local->shape[0],
         (long long)local->shape[1]);
  rc = 0;
done:
  dtensor_free(y);
  dtensor_free(x);
  tensor_free(&full);
  mesh_free(mesh);
  world_finalize();
  return rc;
}
