/* pg_new_nccl for builds without CUDA: NCCL groups are not available. */
#include "mesh/pg_impl.h"

fsdpc_status_t pg_new_nccl(MPI_Comm comm, int device, pg_t **out) {
  (void)comm;
  *out = NULL;
  return err_set(STATUS_ENODEV,
                 "NCCL group on cuda:%d requested, but the library was built "
                 "without CUDA",
                 device);
}
