#include "mesh/world.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/pg_impl.h"

static int we_initialised;
static int local_rank = -1;

static int env_int(const char *name, int *out) {
  const char *v = getenv(name);
  if (v == NULL || *v == '\0') return 0;
  char *end;
  long x = strtol(v, &end, 10);
  if (*end != '\0' || x < 0) return 0;
  *out = (int)x;
  return 1;
}

status_t world_init(int *argc, char ***argv) {
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) {
    int provided;
    int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    if (rc != MPI_SUCCESS) return err_set(STATUS_EMPI, "MPI_Init_thread failed (code %d)", rc);
    we_initialised = 1;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  if (!env_int("OMPI_COMM_WORLD_LOCAL_RANK", &local_rank) &&
      !env_int("MPI_LOCALRANKID", &local_rank) && !env_int("SLURM_LOCALID", &local_rank)) {
    MPI_Comm node;
    TRY(pg_mpi_status(
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
        "MPI_Comm_split_type"));
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
  }
  return STATUS_OK;
}

void world_finalize(void) {
  int done = 0;
  MPI_Finalized(&done);
  if (we_initialised && !done) MPI_Finalize();
}

int world_rank(void) {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size(void) {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

int world_local_rank(void) { return local_rank < 0 ? 0 : local_rank; }

MPI_Comm world_comm(void) { return MPI_COMM_WORLD; }

device_t world_device(void) {
  int n = device_cuda_count();
  if (n <= 0) return device_cpu();
  return device_cuda(world_local_rank() % n);
}

status_t comm_agree(MPI_Comm comm, status_t st) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  struct {
    int code;
    int rank;
  } mine = {st == STATUS_OK ? 1 : 0, rank}, worst;
  /* MINLOC over (ok flag, rank): the lowest failing rank if any failed. */
  int rc = MPI_Allreduce(&mine, &worst, 1, MPI_2INT, MPI_MINLOC, comm);
  if (rc != MPI_SUCCESS) return pg_mpi_status(rc, "MPI_Allreduce (agreement)");
  if (worst.code == 1) return STATUS_OK;
  struct {
    int status;
    char text[1000];
  } msg;
  memset(&msg, 0, sizeof msg);
  if (rank == worst.rank) {
    msg.status = st;
    snprintf(msg.text, sizeof msg.text, "%s", err_detail());
  }
  rc = MPI_Bcast(&msg, (int)sizeof msg, MPI_BYTE, worst.rank, comm);
  if (rc != MPI_SUCCESS) return pg_mpi_status(rc, "MPI_Bcast (agreement)");
  if (rank == worst.rank) return st;
  return err_set((status_t)msg.status, "rank %d: %s", worst.rank, msg.text);
}
