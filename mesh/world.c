#define _GNU_SOURCE /* sched_getaffinity */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/args_impl.h"
#include "mesh/nccl_comms_impl.h"
#include "mesh/pg_impl.h"
#include "mesh/world_impl.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define WORLD_LEAK_CHECK 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define WORLD_LEAK_CHECK 1
#endif
#ifdef WORLD_LEAK_CHECK
#include <sanitizer/lsan_interface.h>
#endif

static int we_initialised;
static int mpi_size(void);
static pg_t *world_group; /* every rank, host */

static fsdpc_status_t world_allreduce(const void *send, void *recv, int count, MPI_Datatype type,
                                      MPI_Op op, MPI_Comm comm, const char *what);
static fsdpc_status_t world_barrier(MPI_Comm comm, const char *what);
static fsdpc_status_t world_allgather(const void *mine, int bytes, void *all, MPI_Comm comm,
                                      const char *what);
static int local_rank = -1, local_size = -1;

/* The stop channel: a receive from any rank, posted at start-up on a communicator of its own. */
enum { STOP_TAG = 1 };
typedef struct stop_msg {
  int status, rank;
  int unanswered; /* a rank stopped answering: MPI_Finalize would wait for it forever */
  char text[1012];
} stop_msg_t;
static MPI_Comm stop_comm = MPI_COMM_NULL;
static MPI_Request stop_req = MPI_REQUEST_NULL;
static stop_msg_t stop_in, stop_out;
static bool stopped, unanswered;
static pthread_t main_thread; /* the thread that started MPI (MPI_THREAD_FUNNELED) */
static fsdpc_status_t device_wait_check(const char *what, double waited);
static fsdpc_status_t stopped_error(void);
static fsdpc_status_t stop_status;
static char stop_reason[sizeof stop_in.text + 32];

static fsdpc_status_t stop_channel_open(void) {
  if (stop_comm != MPI_COMM_NULL) return STATUS_OK;
  FSDPC_TRY(pg_mpi_status(MPI_Comm_dup(MPI_COMM_WORLD, &stop_comm), "MPI_Comm_dup"));
  MPI_Comm_set_errhandler(stop_comm, MPI_ERRORS_RETURN);
  return pg_mpi_status(MPI_Irecv(&stop_in, (int)sizeof stop_in, MPI_BYTE, MPI_ANY_SOURCE, STOP_TAG,
                                 stop_comm, &stop_req),
                       "MPI_Irecv (stop channel)");
}

static int env_int(const char *name, int *out) {
  const char *v = getenv(name);
  if (v == NULL || *v == '\0') return 0;
  char *end;
  long x = strtol(v, &end, 10);
  if (*end != '\0' || x < 0) return 0;
  *out = (int)x;
  return 1;
}

fsdpc_status_t world_init(int *argc, char ***argv) {
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) {
    int provided;
#ifdef WORLD_LEAK_CHECK
    /* what the MPI library allocates while it starts is its own (some of it from plugins it
     * has unloaded by the time of a leak report, which no suppression can name) */
    __lsan_disable();
#endif
    int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
#ifdef WORLD_LEAK_CHECK
    __lsan_enable();
#endif
    if (rc != MPI_SUCCESS) return err_set(STATUS_EMPI, "MPI_Init_thread failed (code %d)", rc);
    we_initialised = 1;
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  const char *pg_env = getenv("FSDPC_PG"); /* the device groups' backend (mesh/pg.h) */
  bool pg_bad = false; /* refused once the world is up, so that every rank can report it */
  if (pg_env != NULL && pg_env[0] != 0) {
    pg_backend_t b;
    if (pg_backend_parse(pg_env, &b))
      pg_set_device_backend(b);
    else
      pg_bad = true;
  }
  bool known = (env_int("OMPI_COMM_WORLD_LOCAL_RANK", &local_rank) &&
                env_int("OMPI_COMM_WORLD_LOCAL_SIZE", &local_size)) ||
               (env_int("MPI_LOCALRANKID", &local_rank) && env_int("MPI_LOCALNRANKS", &local_size));
  if (!known) { /* the ranks sharing this node's memory */
    MPI_Comm node;
    FSDPC_TRY(pg_mpi_status(
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
        "MPI_Comm_split_type"));
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_size(node, &local_size);
    MPI_Comm_free(&node);
  }
  if (world_group == NULL) FSDPC_TRY(pg_new_mpi(MPI_COMM_WORLD, &world_group));
  main_thread = pthread_self();
  device_set_wait_hook(device_wait_check);
  FSDPC_TRY(stop_channel_open());
  if (pg_bad)
    return err_set(STATUS_EINVAL, "FSDPC_PG=%s: expected native, staged or staged-lazy", pg_env);
  return STATUS_OK;
}

bool world_start(int *argc, char ***argv, const char *prog) {
  fsdpc_status_t up = world_init(argc, argv);
  if (up == STATUS_OK) return true;
  if (world_group != NULL) /* the world is up: reported once for all */
    world_agree_report(up, prog);
  else
    fprintf(stderr, "%s: %s\n", prog ? prog : "fsdpc", err_detail());
  world_finalize();
  return false;
}

void world_finalize(void) {
  device_set_wait_hook(NULL);
  int done = 0;
  MPI_Finalized(&done);
  if (unanswered) {
    /* a rank stopped answering: finalizing would wait for it. Leave without: the launcher
     * ends the job (the silent rank included) when this process exits non-zero, after the
     * other ranks, which learnt of the stop, have had a moment to report it. */
    fflush(stdout);
    fflush(stderr);
    struct timespec moment = {0, 500000000};
    nanosleep(&moment, NULL);
    return;
  }
  if (!done) {
    pg_release(world_group);
    world_group = NULL;
  }
  if (!done && stop_req != MPI_REQUEST_NULL) {
    MPI_Cancel(&stop_req);
    MPI_Wait(&stop_req, MPI_STATUS_IGNORE);
  }
#ifdef WORLD_LEAK_CHECK
  /* Sanitized builds: the leak check runs here, while the MPI library's own allocations (freed
   * or dropped only at its finalization) are still reachable, instead of at exit, where
   * thousands of them are matched against suppressions, and where a rank still checking is
   * killed once another has exited non-zero. */
  if (we_initialised && !done) __lsan_do_leak_check();
#endif
  if (we_initialised && !done) MPI_Finalize();
}

/* MPI is started and not finished: before world_init and after world_finalize the process is
 * a world of one, rank 0. */
static bool mpi_running(void) {
  int up = 0, down = 0;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  return up && !down;
}

int world_rank(void) {
  int r = 0;
  if (mpi_running()) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_started_size(void) { return mpi_running() ? world_size() : 0; }

static int planned_size; /* a planning world's size (world_plan_as), 0 otherwise */

/* The processes that run: a planning world's one. */
static int mpi_size(void) {
  int s = 1;
  if (mpi_running()) MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

int world_size(void) { return planned_size > 0 ? planned_size : mpi_size(); }

bool world_planning(void) { return planned_size > 0; }

fsdpc_status_t world_plan_as(int n, int ranks_per_node) {
  if (world_group == NULL) return err_set(STATUS_EINVAL, "world_plan_as: call world_init first");
  if (mpi_size() != 1)
    return err_set(STATUS_EINVAL, "a planning world is planned from one process; %d were started",
                   mpi_size());
  if (n < 1 || ranks_per_node < 1)
    return err_set(STATUS_EINVAL, "a planning world needs at least one rank (%d, %d per node)", n,
                   ranks_per_node);
  pg_t *g;
  FSDPC_TRY(pg_new_planned(n, 0, device_cpu(), &g));
  pg_release(world_group);
  world_group = g;
  planned_size = n;
  local_rank = 0;
  local_size = ranks_per_node < n ? ranks_per_node : n;
  return STATUS_OK;
}

int world_local_rank(void) { return local_rank < 0 ? 0 : local_rank; }
int world_local_size(void) { return local_size < 1 ? 1 : local_size; }

world_cpus_t world_cpus(void) {
  cpu_set_t set;
  CPU_ZERO(&set);
  world_cpus_t c = {.mine = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1,
                    .online = sysconf(_SC_NPROCESSORS_ONLN),
                    .local_ranks = world_local_size()};
  if (c.mine < 1) c.mine = 1;
  if (c.online < 0) c.online = 0;
  long share = c.online / c.local_ranks;
  c.share = share > 0 && share < c.mine ? (int)share : c.mine;
  return c;
}

pg_t *world_pg(void) { return world_group; }

device_t world_device(void) {
  int n = device_cuda_count();
  if (n <= 0) return device_cpu();
  return device_cuda(world_local_rank() % n);
}

static fsdpc_status_t real_devices_seen(int local_rank, device_seen_t *out) {
  memset(out, 0, sizeof *out);
  out->count = device_cuda_count();
  if (out->count <= 0) return STATUS_OK;
  return device_cuda_uuid(local_rank % out->count, &out->pick);
}

static world_devices_fn devices_seen = real_devices_seen;

void world_set_devices_seen(world_devices_fn fn) {
  devices_seen = fn != NULL ? fn : real_devices_seen;
}

static char assignment[512]; /* rank 0's line of which device each rank took */

const char *world_device_assignment(void) { return assignment; }

/* One rank's device for the assignment line: its node (a hash of the host name), the ordinal
 * it took there and the device's UUID. */
typedef struct rank_device {
  uint64_t host;
  int32_t index, pad;
  device_uuid_t uuid;
} rank_device_t;

static uint64_t host_hash(void) {
  char name[MPI_MAX_PROCESSOR_NAME] = "";
  int len = 0;
  MPI_Get_processor_name(name, &len);
  uint64_t h = 1469598103934665603ull; /* FNV-1a: a label, not a checksum */
  for (int i = 0; i < len; i++) h = (h ^ (uint8_t)name[i]) * 1099511628211ull;
  return h;
}

/* Gathers every rank's device to every rank and writes rank 0's line: each rank's ordinal
 * and UUID up to 8 ranks, else how many ranks, devices and nodes. */
static fsdpc_status_t describe_assignment(int index, const device_uuid_t *uuid) {
  int n = mpi_size(), me = world_rank();
  rank_device_t *all = calloc((size_t)n, sizeof *all);
  if (all == NULL) return err_set(STATUS_ENOMEM, "device assignment: out of host memory");
  rank_device_t mine = {host_hash(), index, 0, *uuid};
  fsdpc_status_t st = world_allgather(&mine, (int)sizeof mine, all, MPI_COMM_WORLD,
                                      "MPI_Iallgather (device assignment)");
  assignment[0] = 0;
  if (st == STATUS_OK && me == 0) {
    size_t at = 0;
    char u[48];
    if (n <= 8) {
      for (int r = 0; r < n; r++)
        at += (size_t)snprintf(assignment + at, sizeof assignment - at, "%srank %d cuda:%d %.12s",
                               r ? ", " : "", r, all[r].index,
                               device_uuid_str(&all[r].uuid, u, sizeof u));
    } else {
      int nodes = 0, devices = 0;
      for (int r = 0; r < n; r++) {
        bool new_node = true, new_device = true;
        for (int q = 0; q < r; q++) {
          new_node &= all[q].host != all[r].host;
          new_device &= memcmp(&all[q].uuid, &all[r].uuid, sizeof all[r].uuid) != 0 ||
                        all[q].host != all[r].host;
        }
        nodes += new_node;
        devices += new_device;
      }
      snprintf(assignment, sizeof assignment, "%d ranks on %d CUDA devices of %d node%s; rank 0 "
               "cuda:%d %.12s", n, devices, nodes, nodes == 1 ? "" : "s", all[0].index,
               device_uuid_str(&all[0].uuid, u, sizeof u));
    }
  }
  free(all);
  return st;
}

fsdpc_status_t world_choose_device(device_want_t want, device_t *out, char *why, size_t why_size) {
  ARG_NONNULL(out);
  device_type_t type = DEVICE_CPU;
  *out = device_cpu();
  if (why != NULL && why_size > 0) why[0] = 0;
  assignment[0] = 0;
  /* what each rank of the node sees, gathered over the node */
  device_seen_t mine_seen = {0};
  fsdpc_status_t st =
      want == DEVICE_WANT_CPU ? STATUS_OK : devices_seen(world_local_rank(), &mine_seen);
  MPI_Comm node = MPI_COMM_SELF;
  if (!world_planning() && mpi_size() > 1)
    FSDPC_TRY(pg_mpi_status(
        MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
        "MPI_Comm_split_type (device choice)"));
  int nl = 1, me = 0;
  MPI_Comm_size(node, &nl);
  MPI_Comm_rank(node, &me);
  device_seen_t *seen = calloc((size_t)nl, sizeof *seen);
  if (seen == NULL) {
    if (node != MPI_COMM_SELF) MPI_Comm_free(&node);
    return err_set(STATUS_ENOMEM, "device choice: out of host memory");
  }
  fsdpc_status_t gs = world_allgather(&mine_seen, (int)sizeof mine_seen, seen, node,
                                      "MPI_Iallgather (the node's devices)");
  if (node != MPI_COMM_SELF) MPI_Comm_free(&node);
  if (gs != STATUS_OK) {
    free(seen);
    return gs;
  }
  /* host-staged groups let ranks share a device; NCCL refuses it */
  bool may_share = pg_device_backend() != PG_BACKEND_NATIVE;
  if (st == STATUS_OK) st = device_choose_node(want, nl, seen, me, may_share, &type, why, why_size);
  free(seen);
  /* one reduction: whether every rank chose, whether every rank failed, whether every rank
   * chose CUDA */
  int mine[3] = {st == STATUS_OK, st != STATUS_OK, st == STATUS_OK && type == DEVICE_CUDA};
  int all[3];
  FSDPC_TRY(world_allreduce(mine, all, 3, MPI_INT, MPI_MIN, MPI_COMM_WORLD,
                            "MPI_Allreduce (device choice)"));
  if (all[1]) return st; /* each rank keeps its own message (one line in a report) */
  if (!all[0]) return comm_agree(MPI_COMM_WORLD, st); /* the others learn the failing one's */
  /* auto: one mesh device type for the whole job, the CPU when any node falls short */
  if (mine[2] && !all[2] && why != NULL)
    snprintf(why, why_size,
             "a rank of another node has no CUDA device of its own (NCCL needs one per rank): "
             "every rank runs on the CPU");
  if (!all[2]) return STATUS_OK;
  *out = device_cuda(world_local_rank() % mine_seen.count);
  return describe_assignment(out->index, &mine_seen.pick);
}

fsdpc_status_t comm_agree(MPI_Comm comm, fsdpc_status_t st) {
  if (stopped) return stopped_error(); /* see world_allreduce */
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  struct {
    int code;
    int rank;
  } mine = {st == STATUS_OK ? 1 : 0, rank}, worst;
  /* MINLOC over (ok flag, rank): the lowest failing rank if any failed. */
  MPI_Request req;
  FSDPC_TRY(pg_mpi_status(MPI_Iallreduce(&mine, &worst, 1, MPI_2INT, MPI_MINLOC, comm, &req),
                          "MPI_Iallreduce (agreement)"));
  FSDPC_TRY(world_wait(&req, "MPI_Iallreduce (agreement)"));
  if (worst.code == 1) return STATUS_OK;
  struct {
    int status, world_rank;
    char text[1000];
  } msg;
  memset(&msg, 0, sizeof msg);
  if (rank == worst.rank) {
    msg.status = st;
    msg.world_rank = world_rank();
    snprintf(msg.text, sizeof msg.text, "%s", err_detail());
  }
  FSDPC_TRY(pg_mpi_status(MPI_Ibcast(&msg, (int)sizeof msg, MPI_BYTE, worst.rank, comm, &req),
                          "MPI_Ibcast (agreement)"));
  FSDPC_TRY(world_wait(&req, "MPI_Ibcast (agreement)"));
  if (st != STATUS_OK) return st; /* a failing rank keeps its own */
  return err_set((fsdpc_status_t)msg.status, "rank %d: %s", msg.world_rank, msg.text);
}

fsdpc_status_t world_check_launch(void) {
  static const struct {
    const char *var, *launcher, *instead;
  } envs[] = {{"WORLD_SIZE", "torchrun or another PyTorch launcher",
               "mpirun -n %ld PROGRAM ... (the ranks are MPI processes)"},
              {"SLURM_STEP_NUM_TASKS", "srun without an MPI plugin",
               "srun --mpi=pmix -n %ld PROGRAM ..., or mpirun inside the allocation"}};
  for (size_t i = 0; i < sizeof envs / sizeof envs[0]; i++) {
    const char *v = getenv(envs[i].var);
    char *end;
    long n = v ? strtol(v, &end, 10) : 0;
    /* a singleton MPI world only: mpirun of fewer ranks inside a larger allocation is fine */
    if (v == NULL || *end != '\0' || n <= 1 || mpi_size() != 1) continue;
    char how[128];
    snprintf(how, sizeof how, envs[i].instead, n);
    return err_set(STATUS_EINVAL,
                   "%s=%ld says %ld processes were started, but this one's MPI world has %d "
                   "rank%s (%s?): each would train alone; launch with %s",
                   envs[i].var, n, n, mpi_size(), mpi_size() == 1 ? "" : "s", envs[i].launcher,
                   how);
  }
  return STATUS_OK;
}

/* "0-3,5,7-8": the ranks whose entry in msgs (size entries of n bytes) equals msgs[first];
 * returns how many. */
static int rank_list(char *out, size_t cap, const char *msgs, size_t n, int size, int first,
                     bool *done) {
  size_t len = 0;
  int count = 0;
  out[0] = '\0';
  for (int r = first; r < size; r++) {
    if (done[r] || strcmp(msgs + (size_t)r * n, msgs + (size_t)first * n) != 0) continue;
    int end = r;
    while (end + 1 < size && !done[end + 1] &&
           strcmp(msgs + (size_t)(end + 1) * n, msgs + (size_t)first * n) == 0)
      end++;
    for (int k = r; k <= end; k++) done[k] = true;
    count += end - r + 1;
    int w = end == r       ? snprintf(out + len, cap - len, "%s%d", len ? "," : "", r)
            : end == r + 1 ? snprintf(out + len, cap - len, "%s%d,%d", len ? "," : "", r, end)
                           : snprintf(out + len, cap - len, "%s%d-%d", len ? "," : "", r, end);
    if (w < 0 || (size_t)w >= cap - len) break; /* a very long list ends short */
    len += (size_t)w;
    r = end;
  }
  return count;
}

bool world_agree_report(fsdpc_status_t st, const char *prog) {
  enum { N = 1024 }; /* message bytes per rank */
  if (prog == NULL) prog = "fsdpc";
  if (!mpi_running()) { /* a world of one */
    if (st != STATUS_OK) fprintf(stderr, "%s: %s\n", prog, err_detail());
    return st == STATUS_OK;
  }
  int size = mpi_size(), rank = world_rank();
  char *all = rank == 0 ? malloc((size_t)size * N) : NULL;
  bool *done = rank == 0 ? calloc((size_t)size, sizeof *done) : NULL;
  int mine[2] = {st != STATUS_OK, rank == 0 && (all == NULL || done == NULL)}, any[2] = {0, 0};
  if (world_allreduce(mine, any, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD, "MPI_Allreduce (agreement)") !=
      STATUS_OK) {
    fprintf(stderr, "%s: [rank %d] %s\n", prog, rank, err_detail()); /* the stop's reason */
    free(all);
    free(done);
    return false;
  }
  if (any[0] == 0 || any[1] != 0) { /* nothing failed, or rank 0 cannot collect: each says */
    if (mine[0]) fprintf(stderr, "%s: [rank %d] %s\n", prog, rank, err_detail());
    free(all);
    free(done);
    return any[0] == 0;
  }
  char text[N];
  memset(text, 0, sizeof text);
  if (mine[0]) snprintf(text, sizeof text, "%s", err_detail());
  MPI_Request req;
  fsdpc_status_t gs =
      pg_mpi_status(MPI_Igather(text, N, MPI_CHAR, all, N, MPI_CHAR, 0, MPI_COMM_WORLD, &req),
                    "MPI_Igather (error messages)");
  if (gs == STATUS_OK) gs = world_wait(&req, "MPI_Igather (error messages)");
  if (gs != STATUS_OK) {
    if (mine[0]) fprintf(stderr, "%s: [rank %d] %s\n", prog, rank, text);
  } else if (rank == 0) {
    /* "rank K: X", where rank K says X: the agreement's copy of K's failure, said once with
     * K's, which is named where the others only pass it on ("[ranks 0-3, from rank 1]") */
    bool *relayed = calloc((size_t)size, sizeof *relayed);
    for (int r = 0; relayed && r < size; r++) {
      char *m = all + (size_t)r * N;
      int k = -1, at = 0;
      if (sscanf(m, "rank %d: %n", &k, &at) == 1 && at > 0 && k >= 0 && k < size && k != r &&
          strcmp(m + at, all + (size_t)k * N) == 0) {
        memmove(m, m + at, strlen(m + at) + 1);
        relayed[r] = true;
      }
    }
    char ranks[256], from[256];
    for (int pass = 0; pass < 2; pass++) /* the failures first, then the others */
      for (int r = 0; r < size; r++) {
        const char *m = all + (size_t)r * N;
        if (done[r] || (pass == 0) != (m[0] != '\0')) continue;
        int count = rank_list(ranks, sizeof ranks, all, N, size, r, done);
        /* of the group (every rank saying m: rank_list takes them all), those that said it
         * themselves */
        int own = 0;
        size_t len = 0;
        from[0] = '\0';
        for (int k = r; relayed != NULL && k < size; k++) {
          if (relayed[k] || strcmp(all + (size_t)k * N, m) != 0) continue;
          own++;
          int w = snprintf(from + len, sizeof from - len, "%s%d", len ? "," : "", k);
          if (w > 0 && (size_t)w < sizeof from - len) len += (size_t)w;
        }
        if (own > 0 && own < count)
          fprintf(stderr, "%s: [rank%s %s, from rank%s %s] %s\n", prog, count == 1 ? "" : "s",
                  ranks, own == 1 ? "" : "s", from, m);
        else
          fprintf(stderr, "%s: [rank%s %s] %s\n", prog, count == 1 ? "" : "s", ranks,
                  m[0] ? m : "stopping: another rank failed");
      }
    free(relayed);
  }
  /* no rank exits before rank 0 has printed: mpirun ends the job at the first failed exit */
  if (gs == STATUS_OK) (void)world_barrier(MPI_COMM_WORLD, "MPI_Barrier (error messages)");
  free(all);
  free(done);
  return false;
}

/* ---- stopping ---- */

static fsdpc_status_t stopped_error(void) { return err_set(stop_status, "%s", stop_reason); }

static fsdpc_status_t take_stop(void) {
  stopped = true;
  nccl_comm_abort_all(); /* the device work a wait may be behind ends too */
  stop_status = stop_in.status < 0 ? (fsdpc_status_t)stop_in.status : STATUS_EINTERNAL;
  stop_in.text[sizeof stop_in.text - 1] = 0;
  unanswered = unanswered || stop_in.unanswered;
  snprintf(stop_reason, sizeof stop_reason, "rank %d: %s", stop_in.rank, stop_in.text);
  return stopped_error();
}

fsdpc_status_t world_check(void) {
  if (!stopped && stop_req != MPI_REQUEST_NULL) { /* a stop that arrived meanwhile */
    int got = 0;
    if (MPI_Test(&stop_req, &got, MPI_STATUS_IGNORE) == MPI_SUCCESS && got) return take_stop();
  }
  return stopped ? stopped_error() : STATUS_OK;
}

static double watchdog_s = WORLD_DEFAULT_TIMEOUT_S;

fsdpc_status_t world_set_timeout(double seconds) {
  if (!(seconds >= 0))
    return err_set(STATUS_EINVAL,
                   "world_set_timeout: %g is no number of seconds (0 waits forever, the watchdog "
                   "off)",
                   seconds);
  watchdog_s = seconds;
  return STATUS_OK;
}
double world_timeout(void) { return watchdog_s; }

fsdpc_status_t world_wait(MPI_Request *req, const char *what) {
  if (stopped) return stopped_error();
  if (*req == MPI_REQUEST_NULL) return STATUS_OK; /* nothing to wait for */
  if (watchdog_s > 0) {
    bool late = false;
    FSDPC_TRY(world_wait_for(req, watchdog_s, what, &late));
    if (!late) return STATUS_OK;
    /* the others learn it through the stop channel; a rank blocked elsewhere is ended by the
     * launcher when this one exits non-zero */
    unanswered = true;
    return world_stop(err_set(STATUS_EMPI,
                              "%s has not completed in %g s: another rank stopped answering "
                              "(hung, stopped or far slower); stopping the job",
                              what, watchdog_s));
  }
  if (stop_req == MPI_REQUEST_NULL) return pg_mpi_status(MPI_Wait(req, MPI_STATUS_IGNORE), what);
  MPI_Request rs[2] = {*req, stop_req};
  int idx = MPI_UNDEFINED;
  int rc = MPI_Waitany(2, rs, &idx, MPI_STATUS_IGNORE);
  *req = rs[0];
  stop_req = rs[1];
  if (rc != MPI_SUCCESS) return pg_mpi_status(rc, what);
  return idx == 1 ? take_stop() : STATUS_OK;
}

fsdpc_status_t world_wait_for(MPI_Request *req, double seconds, const char *what, bool *timed_out) {
  *timed_out = false;
  if (stopped) return stopped_error();
  if (*req == MPI_REQUEST_NULL) return STATUS_OK;
  double start = MPI_Wtime(), end = start + seconds;
  for (;;) {
    MPI_Request rs[2] = {*req, stop_req};
    int idx = MPI_UNDEFINED, done = 0;
    int rc = MPI_Testany(2, rs, &idx, &done, MPI_STATUS_IGNORE);
    *req = rs[0];
    stop_req = rs[1];
    if (rc != MPI_SUCCESS) return pg_mpi_status(rc, what);
    if (done) return idx == 1 ? take_stop() : STATUS_OK;
    fsdpc_status_t nst = nccl_comm_poll_errors(); /* a device collective's peer or link failed */
    if (nst != STATUS_OK) return world_stop(err_prefix(nst, "%s", what));
    if (MPI_Wtime() >= end) {
      *timed_out = true;
      return STATUS_OK;
    }
    if (MPI_Wtime() - start < 1e-4) { /* short waits: poll */
      sched_yield();
    } else {
      struct timespec nap = {0, 100000}; /* 0.1 ms: leave the core to ranks sharing it */
      nanosleep(&nap, NULL);
    }
  }
}

/* The wait hook of host waits for device work (core/device.h): a stop ends them, as does a
 * wait longer than the watchdog (which stops the job); the NCCL communicators are aborted
 * first, so that the device work a wait may be behind ends too. */
static fsdpc_status_t device_wait_check(const char *what, double waited) {
  if (!pthread_equal(pthread_self(), main_thread)) return STATUS_OK; /* MPI: this thread only */
  fsdpc_status_t st = world_check();
  if (st == STATUS_OK && (st = nccl_comm_poll_errors()) != STATUS_OK) /* a peer or link failed */
    st = world_stop(err_prefix(st, "%s (device work)", what));
  if (st == STATUS_OK && watchdog_s > 0 && waited > watchdog_s) {
    unanswered = true;
    st = world_stop(err_set(STATUS_ETIMEOUT,
                            "%s (device work) has not completed in %g s: another rank stopped "
                            "answering (hung, stopped or far slower); stopping the job",
                            what, watchdog_s));
  }
  if (st != STATUS_OK) nccl_comm_abort_all();
  return st;
}

static fsdpc_status_t world_allreduce(const void *send, void *recv, int count, MPI_Datatype type,
                                      MPI_Op op, MPI_Comm comm, const char *what) {
  /* stopped: started, it would stay pending (world_wait returns at once) and MPI_Finalize
   * would progress it into the caller's freed stack */
  if (stopped) return stopped_error();
  MPI_Request req;
  FSDPC_TRY(pg_mpi_status(MPI_Iallreduce(send, recv, count, type, op, comm, &req), what));
  return world_wait(&req, what);
}

/* Every rank's bytes of mine into all (bytes per rank, in rank order). */
static fsdpc_status_t world_allgather(const void *mine, int bytes, void *all, MPI_Comm comm,
                                      const char *what) {
  if (stopped) return stopped_error(); /* see world_allreduce */
  MPI_Request req;
  FSDPC_TRY(
      pg_mpi_status(MPI_Iallgather(mine, bytes, MPI_BYTE, all, bytes, MPI_BYTE, comm, &req), what));
  return world_wait(&req, what);
}

static fsdpc_status_t world_barrier(MPI_Comm comm, const char *what) {
  if (stopped) return stopped_error();
  MPI_Request req;
  FSDPC_TRY(pg_mpi_status(MPI_Ibarrier(comm, &req), what));
  return world_wait(&req, what);
}

fsdpc_status_t world_stop(fsdpc_status_t st) {
  if (stopped) return st;
  stopped = true;
  nccl_comm_abort_all(); /* collectives in flight would wait for the others for good */
  stop_status = st;
  snprintf(stop_reason, sizeof stop_reason, "%s", err_detail());
  if (stop_comm == MPI_COMM_NULL) return st;
  memset(&stop_out, 0, sizeof stop_out);
  stop_out.status = st;
  stop_out.rank = world_rank();
  stop_out.unanswered = unanswered;
  memcpy(stop_out.text, stop_reason, sizeof stop_out.text - 1);
  for (int r = 0; r < mpi_size(); r++) {
    if (r == stop_out.rank) continue;
    MPI_Request sent;
    if (MPI_Isend(&stop_out, (int)sizeof stop_out, MPI_BYTE, r, STOP_TAG, stop_comm, &sent) ==
        MPI_SUCCESS)
      MPI_Request_free(&sent); /* small: delivered eagerly, the buffer stays */
  }
  return st;
}
