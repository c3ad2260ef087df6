/*
 * A one-rank resume against a plain read of the same files: a training checkpoint (model and
 * AdamW state) is written once, then, interleaved and repeated, (a) every file of it is read
 * with read(2) from the warm page cache, end to end into memory of the files' size (memory in
 * use: each byte lands in its own place, as a load puts it; the reference of the ratios), and
 * in 8 MiB pieces into one buffer (which stays in the CPU's caches, so that read moves half
 * the bytes through memory that a load must), (b) the model is built deferred, its memory
 * allocated and the checkpoint loaded into it, as fsdp-train does: in a new process of this
 * program (all of its memory fresh from the system, as when fsdp-train resumes; against the
 * plain read in a new process into memory fresh from the system) and again in this one (its
 * memory then mostly the blocks the previous repetition freed, which the host cache hands out
 * again), (c) the model is built and initialised eagerly, the optimizer state
 * zero-filled, then loaded (the path before deferred initialisation), (d) the deferred resume
 * from a copy of the checkpoint without checksums (the files another tool would write: the same
 * bytes, no integrity records), (e) a resharding-style read of the first quarter of every
 * tensor's rows from both, the blocks it touches checked or not, (f) the plain read again in
 * blocks of the checksums' size, each hashed, (g) the checked and unchecked resumes from
 * storage (the files' pages dropped from the page cache first), and (h) each resume repeated
 * into the memory it just filled (reads and checks without the allocation). Prints median
 * times, the bytes each read, the ratios and the cost of the always-on block checks with the
 * spread of the paired ratios. A load hashes its blocks on a helper thread when the rank has a
 * CPU to spare (more CPUs than ranks on the node, or a binding to several), else on the reading
 * thread (run it under `taskset -c 0` to see the cost on one).
 *
 *   bench-ckpt-load [--config configs/llama-100m.json] [--dir DIR] [--reps 3]
 *                   [--block-bytes 262144]
 * Without --dir the checkpoint goes to a temporary folder, removed at the end. Under
 * `mpirun -n W` (W > 1) it writes a W-way FSDP checkpoint instead and times each rank's resume
 * of it, checked and unchecked, against each rank reading its own files (see sharded).
 */
#define _GNU_SOURCE /* sched_getaffinity */
#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/file.h"
#include "bench/bench_util.h"
#include "checkpoint/dcp_integrity.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/train_ckpt.h"
#include "fully_shard/fsdp.h"
#include "mesh/world.h"

/* Copies one shard file without its integrity record, streaming one tensor at a time. */
static void copy_unchecked(const char *from, const char *to) {
  st_file_t *f;
  st_writer_t *w;
  BENCH_TRY(st_open(&f, from));
  BENCH_TRY(st_writer_new(&w));
  const char *keys[] = {"DCP_SHARDING_INFO", "DCP_VERSION", "format"};
  for (int k = 0; k < 3; k++)
    if (st_metadata(f, keys[k])) BENCH_TRY(st_writer_set_metadata(w, keys[k], st_metadata(f, keys[k])));
  for (int i = 0; i < st_num_tensors(f); i++) {
    const st_info_t *t = st_tensor(f, i);
    BENCH_TRY(st_writer_declare(w, t->name, t->dtype, t->ndim, t->shape));
  }
  BENCH_TRY(st_writer_begin(w, to));
  for (int i = 0; i < st_num_tensors(f); i++) {
    const st_info_t *t = st_tensor(f, i);
    tensor_t x;
    BENCH_TRY(tensor_init(&x, t->dtype, device_cpu(), t->ndim, t->shape));
    BENCH_TRY(st_read(f, t->name, &x));
    BENCH_TRY(st_writer_write(w, t->name, &x));
    tensor_free(&x);
  }
  BENCH_TRY(st_writer_finish(w));
  st_writer_free(w);
  st_close(f);
}

/* A copy of checkpoint dir (model/, optim/, train_state.json) whose files carry no checksums. */
static void copy_checkpoint_unchecked(const char *dir, const char *to) {
  const char *subs[] = {"model", "optim"};
  if (mkdir(to, 0755) != 0) {
    perror(to);
    exit(1);
  }
  for (int k = 0; k < 2; k++) {
    char a[4400], b[4400];
    snprintf(a, sizeof a, "%.4000s/%s", dir, subs[k]);
    snprintf(b, sizeof b, "%.4000s/%s", to, subs[k]);
    mkdir(b, 0755);
    DIR *d = opendir(a);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
      if (strstr(e->d_name, ".safetensors") == NULL) continue;
      char x[4700], y[4700];
      snprintf(x, sizeof x, "%.4400s/%.255s", a, e->d_name);
      snprintf(y, sizeof y, "%.4400s/%.255s", b, e->d_name);
      copy_unchecked(x, y);
    }
    if (d) closedir(d);
  }
  char state[4400]; /* the state without its integrity record, as the files */
  snprintf(state, sizeof state, "%.4000s/train_state.json", to);
  BENCH_TRY(file_write_text(state, "{\"step\": 1, \"optim_steps\": 1}\n"));
}

/* Reads the first quarter of the rows of every tensor of dir's model and optimizer state, as
 * a rank of a 4-way plan would, into memory allocated and touched before: returns the bytes
 * read, the seconds the opens and reads took in *secs. */
static uint64_t read_quarters(const char *dir, double *secs) {
  const char *subs[] = {"model", "optim"};
  uint64_t total = 0;
  *secs = 0;
  for (int k = 0; k < 2; k++) {
    char folder[4400];
    snprintf(folder, sizeof folder, "%.4000s/%s", dir, subs[k]);
    double t0 = bench_now();
    dcp_reader_t *r;
    BENCH_TRY(dcp_reader_open(folder, &r));
    *secs += bench_now() - t0;
    const dcp_tensor_t *t;
    int n;
    BENCH_TRY(dcp_reader_list(r, &t, &n));
    tensor_t *x = calloc((size_t)n, sizeof *x);
    dcp_box_t *boxes = calloc((size_t)n, sizeof *boxes);
    if (x == NULL || boxes == NULL) bench_leave(1);
    for (int i = 0; i < n; i++) {
      int64_t shape[TENSOR_MAX_DIMS];
      memcpy(shape, t[i].shape, sizeof shape);
      if (t[i].ndim > 0) shape[0] = (shape[0] + 3) / 4;
      BENCH_TRY(tensor_init(&x[i], t[i].dtype, device_cpu(), t[i].ndim, shape));
      memset(x[i].data, 1, tensor_nbytes(&x[i]));
      boxes[i] = (dcp_box_t){.name = t[i].name, .value = &x[i]};
      total += tensor_nbytes(&x[i]);
    }
    t0 = bench_now();
    BENCH_TRY(dcp_reader_read_boxes(r, boxes, n)); /* what a resharding load reads */
    dcp_reader_close(r);
    *secs += bench_now() - t0;
    for (int i = 0; i < n; i++) tensor_free(&x[i]);
    free(boxes);
    free(x);
  }
  return total;
}

static uint64_t g_hash_sink;

/* The eager resume (seconds each) runs in the first repetitions only. */
#define EAGER_REPS 3

/* The plain reads' piece: each read(2) asks for this many bytes. */
#define PLAIN_PIECE ((size_t)8 << 20)

/* What each file of a tree gets: a read in pieces of size bytes into buf, each piece in the same
 * place (the destination stays in the CPU's caches); with at, the files laid end to end from
 * buf + *at on instead, each byte in its own place of memory of size bytes, as a load puts
 * them (*at advances), in pieces of PLAIN_PIECE; with hash, each piece hashed (what the block
 * checks add to a read); with drop, its pages dropped from the page cache (the next read comes
 * from storage). */
typedef struct walk {
  char *buf;
  size_t size;
  bool hash, drop;
  uint64_t *at;
} walk_t;

/* Reads (or drops) the open file fd at path, then closes it; returns the bytes read. */
static uint64_t walk_fd(int fd, const char *path, const walk_t *w) {
  uint64_t total = 0;
  if (w->drop) { /* written pages must reach the storage before they can be dropped */
    if (fdatasync(fd) != 0 || posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) perror(path);
    close(fd);
    return 0;
  }
  for (;;) {
    char *dst = w->at ? w->buf + *w->at : w->buf;
    size_t want = w->size;
    if (w->at) want = w->size - *w->at < PLAIN_PIECE ? w->size - *w->at : PLAIN_PIECE;
    ssize_t n = want > 0 ? read(fd, dst, want) : 0;
    if (n <= 0) break;
    total += (uint64_t)n;
    if (w->at) *w->at += (uint64_t)n;
    if (w->hash) g_hash_sink ^= dcp_block_hash(dst, (size_t)n);
  }
  close(fd);
  return total;
}

/* Reads (or drops) every regular file under dir (two levels); returns the bytes read. */
static uint64_t walk_tree(const char *dir, const walk_t *w) {
  uint64_t total = 0;
  DIR *d = opendir(dir);
  if (d == NULL) return 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char path[4096];
    snprintf(path, sizeof path, "%.3800s/%.255s", dir, e->d_name);
    struct stat sb;
    if (stat(path, &sb) != 0) continue;
    if (S_ISDIR(sb.st_mode)) {
      total += walk_tree(path, w);
      continue;
    }
    int fd = open(path, O_RDONLY);
    if (fd < 0) continue;
    total += walk_fd(fd, path, w);
  }
  closedir(d);
  return total;
}

static uint64_t read_tree(const char *dir, char *buf, size_t size) {
  return walk_tree(dir, &(walk_t){buf, size, false, false, NULL});
}

/* Reads every file under dir into mem (size bytes), end to end. */
static uint64_t read_tree_into(const char *dir, char *mem, size_t size) {
  uint64_t at = 0;
  return walk_tree(dir, &(walk_t){mem, size, false, false, &at});
}

/* size bytes from the host allocator, as a load's large tensors get them, touched. */
static char *memory_in_use(size_t size) {
  void *p;
  BENCH_TRY(device_alloc(device_cpu(), size, &p));
  memset(p, 1, size);
  return p;
}

typedef struct built {
  llama_t *m;
  nn_param_t **ps;
  int n;
  optim_t *opt;
} built_t;

/* The model and its AdamW state; with a mesh, fully_shard per layer and root over it (as
 * fsdp-train's FSDP plans), before the deferred model gets memory. */
static void build(built_t *b, const llama_config_t *cfg, bool deferred, mesh_t *mesh) {
  llama_options_t o = LLAMA_OPTIONS_INIT;
  o.deferred = deferred;
  BENCH_TRY(llama_new(&b->m, cfg, &o));
  if (!deferred) BENCH_TRY(llama_init_weights(b->m, 1));
  if (mesh) {
    fsdp_options_t f = FSDP_OPTIONS_INIT;
    f.mesh = mesh;
    fsdp_group_t *g;
    for (int i = 0; i < cfg->n_layers; i++) BENCH_TRY(fully_shard(llama_layer(b->m, i), &f, &g));
    BENCH_TRY(fully_shard(llama_module(b->m), &f, &g));
  }
  if (deferred)
    BENCH_TRY(nn_module_materialize(llama_module(b->m)));
  BENCH_TRY(nn_named_parameters(llama_module(b->m), &b->ps, &b->n));
  adamw_config_t a = ADAMW_CONFIG_INIT;
  BENCH_TRY(optim_new(&b->opt, b->ps, b->n, &a));
}

static void unbuild(built_t *b) {
  optim_free(b->opt);
  free(b->ps);
  llama_free(b->m);
}

/* The hidden first arguments that make this program a resume, or a plain read, of its own
 * (see fresh_resume and fresh_read). */
#define FRESH_RESUME "--fresh-resume"
#define FRESH_READ "--fresh-read"

/* What a timed piece of work in a new process printed: its seconds, the blocks it took from
 * the system and its page faults. */
typedef struct fresh {
  double secs;
  size_t blocks;
  long faults;
} fresh_t;

static void fresh_print(double t0, const struct rusage *before) {
  double t = bench_now() - t0;
  struct rusage after;
  getrusage(RUSAGE_SELF, &after);
  printf("%.9f %zu %ld\n", t, mem_os_allocs(device_cpu()), after.ru_minflt - before->ru_minflt);
}

static void fresh_init(void) {
  int one = 1;
  char *args[] = {"bench-ckpt-load", NULL}, **argv = args;
  BENCH_TRY(world_init(&one, &argv));
}

/* `bench-ckpt-load --fresh-resume CONFIG DIR`: one deferred resume of DIR in this new process
 * (one rank), the first thing it does after world_init. All of its memory comes from the
 * system, as in an `fsdp-train` that resumes. */
static int fresh_resume(const char *config, const char *dir) {
  fresh_init();
  llama_config_t cfg;
  BENCH_TRY(llama_config_from_hf(config, &cfg));
  struct rusage before;
  getrusage(RUSAGE_SELF, &before);
  double t0 = bench_now();
  built_t b;
  build(&b, &cfg, true, NULL);
  int64_t step;
  BENCH_TRY(ckpt_load_training(dir, b.ps, b.n, b.opt, &step, NULL));
  fresh_print(t0, &before);
  unbuild(&b);
  world_finalize();
  return 0;
}

/* `bench-ckpt-load --fresh-read DIR BYTES`: the plain read of DIR's files (BYTES in all) in
 * this new process, into memory of their size fresh from the system (one block of the host
 * allocator, which maps large blocks as a load's large tensors get them). */
static int fresh_read(const char *dir, const char *bytes) {
  fresh_init();
  size_t size = (size_t)strtoull(bytes, NULL, 10);
  struct rusage before;
  getrusage(RUSAGE_SELF, &before);
  double t0 = bench_now();
  void *mem;
  BENCH_TRY(device_alloc(device_cpu(), size, &mem));
  read_tree_into(dir, mem, size);
  fresh_print(t0, &before);
  device_free(device_cpu(), mem, size);
  world_finalize();
  return 0;
}

/* Whether mpirun started this process (a child would then take the job's identity); to be
 * asked before world_init, which sets some of these variables itself. */
static bool under_launcher(void) {
  return getenv("OMPI_COMM_WORLD_SIZE") != NULL || getenv("PMIX_RANK") != NULL ||
         getenv("PMI_RANK") != NULL;
}

/* Runs this program as `bench-ckpt-load MODE A B` (fresh_resume or fresh_read) in a new
 * process; returns what it measured. */
static fresh_t in_new_process(const char *mode, const char *a, const char *b) {
  int fds[2];
  if (pipe(fds) != 0) {
    perror("pipe");
    bench_leave(1);
  }
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    bench_leave(1);
  }
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    close(fds[0]);
    close(fds[1]);
    execl("/proc/self/exe", "bench-ckpt-load", mode, a, b, (char *)NULL);
    perror("/proc/self/exe");
    _exit(127);
  }
  close(fds[1]);
  char line[128] = {0};
  size_t got = 0;
  ssize_t n;
  while (got < sizeof line - 1 && (n = read(fds[0], line + got, sizeof line - 1 - got)) > 0)
    got += (size_t)n;
  close(fds[0]);
  int status = 0;
  fresh_t f;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0 ||
      sscanf(line, "%lf %zu %ld", &f.secs, &f.blocks, &f.faults) != 3) {
    fprintf(stderr, "bench-ckpt-load %s: the new process failed (status %d)\n", mode, status);
    bench_leave(1);
  }
  return f;
}

/* The state before deferred initialisation: the eager build also zero-filled the moments the
 * load then overwrote. */
static void zero_moments(built_t *b) {
  for (int i = 0; i < b->n; i++) {
    dtensor_t *m, *v;
    BENCH_TRY(optim_state(b->opt, i, &m, &v));
    dtensor_free(m);
    dtensor_free(v);
  }
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The k-th quartile of x (k = 1, 2 or 3; 2 is the median), x left in its order (pairs stay
 * paired). */
static double quartile(const double *x, int n, int k) {
  double v[64];
  memcpy(v, x, sizeof *v * (size_t)n);
  qsort(v, (size_t)n, sizeof *v, cmp);
  if (k == 2) return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  return v[(k * n) / 4];
}

static double median(const double *x, int n) { return quartile(x, n, 2); }

/* The ratios a[i] / b[i] of n paired repetitions (run back to back, so machine noise mostly
 * cancels) into q; returns their median. */
static double ratios(const double *a, const double *b, int n, double *q) {
  for (int i = 0; i < n; i++) q[i] = a[i] / b[i];
  return median(q, n);
}

/* The median of the paired ratios a / b, written with their quartiles (their spread: this
 * machine's noise). */
static const char *paired_ratio(const double *a, const double *b, int n) {
  static char out[4][96];
  static int next;
  double q[64], m = ratios(a, b, n, q);
  char *o = out[next++ % 4];
  snprintf(o, sizeof out[0], "%.2fx (paired; quartiles %.2fx, %.2fx)", m, quartile(q, n, 1),
           quartile(q, n, 3));
  return o;
}

/* The checked-over-unchecked cost: the median of the repetitions' paired ratios, in percent,
 * written with the ratios' quartiles and the fastest runs' ratio. */
static const char *paired_cost(const double *checked, const double *unchecked, int n) {
  static char out[4][128];
  static int next;
  double q[64], m = ratios(checked, unchecked, n, q);
  double best = checked[0], best_un = unchecked[0];
  for (int i = 1; i < n; i++) {
    best = checked[i] < best ? checked[i] : best;
    best_un = unchecked[i] < best_un ? unchecked[i] : best_un;
  }
  char *o = out[next++ % 4];
  snprintf(o, sizeof out[0], "%+.1f%% (quartiles %+.1f%%, %+.1f%%; fastest %+.1f%%)",
           100.0 * (m - 1.0), 100.0 * (quartile(q, n, 1) - 1.0), 100.0 * (quartile(q, n, 3) - 1.0),
           100.0 * (best / best_un - 1.0));
  return o;
}

/* Seconds since t0 on the slowest rank (a job waits for it). */
static double slowest(double t0) {
  double t = bench_now() - t0;
  BENCH_TRY(pg_host_all_reduce(world_pg(), &t, &t, 1, PG_HOST_F64, REDUCE_MAX));
  return t;
}

static void barrier(void) {
  int x = 0;
  BENCH_TRY(pg_host_all_reduce(world_pg(), &x, &x, 1, PG_HOST_I32, REDUCE_SUM));
}

/* Reads this rank's own files of checkpoint dir (model/ and optim/ shard-RRRRR) as w says
 * (buf and size: w's; at: NULL, or where to put them end to end); the bytes. */
static uint64_t read_own(const char *dir, char *buf, size_t size, uint64_t *at) {
  uint64_t total = 0;
  const char *subs[] = {"model", "optim"};
  for (int k = 0; k < 2; k++) {
    char path[4400];
    snprintf(path, sizeof path, "%.4000s/%s/shard-%05d.safetensors", dir, subs[k], world_rank());
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
      perror(path);
      bench_leave(1);
    }
    total += walk_fd(fd, path, &(walk_t){buf, size, false, false, at});
  }
  return total;
}

/* Where this rank's loads hash their blocks, and why. */
static void print_hashing(void) {
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  int ncpu = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
  printf(
      "this rank may use %d of the %ld CPUs, %d rank%s on the node: the loads hash their "
      "blocks %s\n",
      ncpu, sysconf(_SC_NPROCESSORS_ONLN), world_local_size(), world_local_size() == 1 ? "" : "s",
      dcp_checker_spare_cpu() ? "on a helper thread" : "on the reading thread");
}

/* With W > 1 ranks: a W-way FSDP checkpoint (fully_shard per layer and root, saved by the W
 * ranks), each rank's resume (deferred build, shard, memory for its shards, load its own
 * chunks) from it and from a copy without checksums, against each rank reading its own files
 * from the page cache; the slowest rank's times, medians over the repetitions. */
static void sharded(const llama_config_t *cfg, int reps) {
  int W = world_size();
  mesh_t *mesh;
  const char *names[] = {"dp_shard"};
  BENCH_TRY(mesh_init(&mesh, 1, &W, names, DEVICE_CPU));
  char tmp[] = "/tmp/fsdpc-ckpt-load-XXXXXX", dir[256] = {0}, plain[300];
  if (world_rank() == 0) {
    if (mkdtemp(tmp) == NULL) {
      perror("mkdtemp");
      bench_leave(1);
    }
    snprintf(dir, sizeof dir, "%s/step-00000001", tmp);
  }
  char *all = malloc(sizeof dir * (size_t)W);
  if (all == NULL) bench_leave(1);
  BENCH_TRY(pg_host_all_gather(world_pg(), dir, all, (int)sizeof dir, PG_HOST_BYTE));
  memcpy(dir, all, sizeof dir); /* rank 0's */
  free(all);
  snprintf(plain, sizeof plain, "%s.unchecked", dir);
  built_t b;
  build(&b, cfg, false, mesh);
  zero_moments(&b);
  BENCH_TRY(ckpt_save_training(dir, b.ps, b.n, b.opt, 1, NULL, world_pg()));
  unbuild(&b);
  if (world_rank() == 0) copy_checkpoint_unchecked(dir, plain);
  barrier();
  char *buf = malloc(PLAIN_PIECE);
  if (buf == NULL) bench_leave(1);
  uint64_t own = read_own(dir, buf, PLAIN_PIECE, NULL), total = 0, at;
  char *mem = memory_in_use(own);
  double t_read[64], t_into[64], t_load[64], t_plain[64];
  size_t fresh = 0; /* blocks rank 0's last checked resume took from the system */
  for (int r = 0; r < reps; r++) {
    barrier();
    double t0 = bench_now();
    read_own(dir, buf, PLAIN_PIECE, NULL);
    t_read[r] = slowest(t0);
    barrier();
    at = 0;
    t0 = bench_now();
    read_own(dir, mem, own, &at);
    t_into[r] = slowest(t0);
    for (int j = 0; j < 2; j++) { /* checked and unchecked back to back, alternating first */
      int k = (j + r) % 2;
      read_own(k ? dir : plain, buf, PLAIN_PIECE, NULL);
      barrier();
      size_t os0 = mem_os_allocs(device_cpu());
      t0 = bench_now();
      build(&b, cfg, true, mesh);
      int64_t step;
      BENCH_TRY(ckpt_load_training(k ? dir : plain, b.ps, b.n, b.opt, &step, NULL));
      (k ? t_load : t_plain)[r] = slowest(t0);
      if (k) fresh = mem_os_allocs(device_cpu()) - os0;
      unbuild(&b);
    }
  }
  BENCH_TRY(pg_host_all_reduce(world_pg(), &own, &total, 1, PG_HOST_I64, REDUCE_SUM));
  double tr = median(t_read, reps), ti = median(t_into, reps), tl = median(t_load, reps);
  if (world_rank() == 0) {
    printf("checkpoint %s: %lld parameters, %d ranks (FSDP: fully_shard per layer and root), "
           "%.1f MB in their files, %.1f MB per rank\n",
           dir, (long long)llama_num_params(cfg), W, (double)total / 1e6,
           (double)total / 1e6 / W);
    printf(
        "each rank reading its own files (page cache), the slowest rank: %.3f s into "
        "memory of their size (memory in use, each byte in its own place, as a load puts "
        "it); %.3f s in %zu MiB pieces into one buffer (which stays in the CPU's caches)\n",
        ti, tr, PLAIN_PIECE >> 20);
    printf(
        "resume, deferred (build, shard, memory for the shards, load), repeated in these "
        "processes (rank 0's took %zu blocks of 64 KiB or more from the system, the rest "
        "the blocks an earlier load freed; a new process takes them all, see the one-rank "
        "run), the slowest rank: %.3f s: %s of the read into memory (%.2fx the read into "
        "one buffer)\n",
        fresh, tl, paired_ratio(t_load, t_into, reps), tl / tr);
    print_hashing();
    printf("block checks: %.3f s checked, %.3f s from the same files without checksums: %s\n",
           tl, median(t_plain, reps), paired_cost(t_load, t_plain, reps));
    printf("(times: medians of %d interleaved repetitions of the slowest rank's)\n", reps);
  }
  device_free(device_cpu(), mem, own);
  free(buf);
  barrier();
  if (world_rank() == 0) {
    dcp_remove_tree(plain);
    dcp_remove_tree(dir);
    rmdir(tmp);
  }
  mesh_free(mesh);
}

static const bench_option_t OPTIONS[] = {
    BENCH_MODEL_OPTIONS,
    {"--dir", "DIR", "an existing checkpoint to read (default: one written to a temporary "
                     "folder)"},
    {"--reps", "N", "interleaved repetitions, the median printed (default 3)"},
    {"--block-bytes", "B", "the checksums' block size of the checkpoint written (default "
                           "262144)"},
    {NULL, NULL, NULL}};

int main(int argc, char **argv) {
  if (argc == 4 && strcmp(argv[1], FRESH_RESUME) == 0) return fresh_resume(argv[2], argv[3]);
  if (argc == 4 && strcmp(argv[1], FRESH_READ) == 0) return fresh_read(argv[2], argv[3]);
  bool spawn = !under_launcher(); /* the resume and read in new processes */
  BENCH_TRY(world_init(&argc, &argv));
  bench_args(argc, argv,
             "A resume of a training checkpoint against a plain read of its files, with and "
             "without checksums: on one rank, or on each of W ranks under mpirun -n W.",
             OPTIONS);
  llama_config_t cfg;
  llama_options_t unused;
  const char *config = bench_opt(argc, argv, "--config", SOURCE_ROOT "/configs/llama-100m.json");
  bench_model(argc, argv, config, &cfg, &unused);
  int reps = (int)bench_int(argc, argv, "--reps", 3, 1, 64);
  const char *given = bench_opt(argc, argv, "--dir", NULL);
  BENCH_TRY(dcp_set_block_bytes((uint64_t)bench_int(argc, argv, "--block-bytes",
                                                    (int64_t)DCP_BLOCK_BYTES_DEFAULT, 64,
                                                    (int64_t)DCP_BLOCK_BYTES_MAX)));
  if (world_size() > 1) {
    if (given) {
      fprintf(stderr, "%s: --dir is for one rank; with %d ranks the checkpoint is written by "
                      "them\n", bench_prog(argv), world_size());
      bench_leave(2);
    }
    sharded(&cfg, reps);
    world_finalize();
    return 0;
  }
  char tmp[] = "/tmp/fsdpc-ckpt-load-XXXXXX", dir[4200];
  if (given == NULL) {
    if (mkdtemp(tmp) == NULL) {
      perror("mkdtemp");
      return 1;
    }
    snprintf(dir, sizeof dir, "%s/step-00000001", tmp);
    built_t b;
    build(&b, &cfg, false, NULL);
    zero_moments(&b);
    BENCH_TRY(ckpt_save_training(dir, b.ps, b.n, b.opt, 1, NULL, world_pg()));
    unbuild(&b);
  } else {
    snprintf(dir, sizeof dir, "%s", given);
  }
  size_t bufsize = PLAIN_PIECE;
  char *buf = malloc(bufsize);
  if (buf == NULL) return 1;
  char plain[4400];
  snprintf(plain, sizeof plain, "%.4200s.unchecked", dir);
  copy_checkpoint_unchecked(dir, plain);
  uint64_t file_bytes = read_tree(dir, buf, bufsize); /* warms the page cache */
  read_tree(plain, buf, bufsize);
  char *mem = memory_in_use(file_bytes), bytes_arg[32];
  snprintf(bytes_arg, sizeof bytes_arg, "%llu", (unsigned long long)file_bytes);
  double t_read[64], t_into[64], t_deferred[64], t_eager[64], t_plain[64], t_part[64];
  double t_part_plain[64], t_hashed[64], t_cold[64], t_cold_plain[64], t_again[64];
  double t_again_plain[64], t_new[64], t_new_plain[64], t_new_read[64];
  size_t warm_blocks = 0;
  fresh_t resume_new = {0}, read_new = {0}; /* the last ones' blocks and faults */
  dcp_stats_t stats = {0}, plain_stats = {0};
  uint64_t part_bytes = 0;
  for (int r = 0; r < reps; r++) {
    double t0 = bench_now();
    read_tree(dir, buf, bufsize);
    t_read[r] = bench_now() - t0;
    t0 = bench_now();
    read_tree_into(dir, mem, file_bytes);
    t_into[r] = bench_now() - t0;
    t0 = bench_now();
    walk_tree(dir, &(walk_t){buf, (size_t)dcp_block_bytes(), true, false, NULL});
    t_hashed[r] = bench_now() - t0;
    for (int j = 0; j < 2; j++) { /* checked and unchecked back to back, alternating first */
      int k = (j + r) % 2;         /* 1: the checked files, 0: those without checksums */
      read_tree(k ? dir : plain, buf, bufsize); /* each load after a read of its own files */
      size_t blocks = mem_os_allocs(device_cpu());
      t0 = bench_now();
      built_t b;
      build(&b, &cfg, true, NULL);
      int64_t step;
      BENCH_TRY(ckpt_load_training(k ? dir : plain, b.ps, b.n, b.opt, &step,
                                   k ? &stats : &plain_stats));
      (k ? t_deferred : t_plain)[r] = bench_now() - t0;
      if (k) warm_blocks = mem_os_allocs(device_cpu()) - blocks;
      t0 = bench_now(); /* again into the same memory: the reads and checks alone */
      BENCH_TRY(ckpt_load_training(k ? dir : plain, b.ps, b.n, b.opt, &step, NULL));
      (k ? t_again : t_again_plain)[r] = bench_now() - t0;
      unbuild(&b);
    }
    for (int j = 0; spawn && j < 3; j++) { /* each in a process of its own */
      int k = (j + r) % 3;                 /* 2: the plain read */
      read_tree(k ? dir : plain, buf, bufsize);
      if (k == 2) {
        read_new = in_new_process(FRESH_READ, dir, bytes_arg);
        t_new_read[r] = read_new.secs;
      } else {
        fresh_t f = in_new_process(FRESH_RESUME, config, k ? dir : plain);
        (k ? t_new : t_new_plain)[r] = f.secs;
        if (k) resume_new = f;
      }
    }
    for (int j = 0; j < 2; j++) { /* the same from storage: both trees' pages dropped first */
      int k = (j + r) % 2;
      walk_tree(dir, &(walk_t){.drop = true});
      walk_tree(plain, &(walk_t){.drop = true});
      t0 = bench_now();
      built_t b;
      build(&b, &cfg, true, NULL);
      int64_t step;
      BENCH_TRY(ckpt_load_training(k ? dir : plain, b.ps, b.n, b.opt, &step, NULL));
      (k ? t_cold : t_cold_plain)[r] = bench_now() - t0;
      unbuild(&b);
    }
    for (int j = 0; j < 2; j++) { /* a quarter of the rows, the same way */
      int k = (j + r) % 2;
      read_tree(k ? dir : plain, buf, bufsize);
      part_bytes = read_quarters(k ? dir : plain, &(k ? t_part : t_part_plain)[r]);
    }
    if (r >= EAGER_REPS) continue;
    t0 = bench_now();
    built_t b;
    build(&b, &cfg, false, NULL);
    zero_moments(&b);
    int64_t step;
    BENCH_TRY(ckpt_load_training(dir, b.ps, b.n, b.opt, &step, &stats));
    t_eager[r] = bench_now() - t0;
    unbuild(&b);
  }
  double tr = median(t_read, reps), ti = median(t_into, reps), td = median(t_deferred, reps);
  double te = median(t_eager, reps < EAGER_REPS ? reps : EAGER_REPS);
  double tp = median(t_plain, reps), tq = median(t_part, reps), tqp = median(t_part_plain, reps);
  printf("checkpoint %s: %lld parameters, %.1f MB in its files\n", dir,
         (long long)llama_num_params(&cfg), (double)file_bytes / 1e6);
  printf(
      "plain read of the files from the page cache: %.3f s (%.0f MB/s) into memory of their "
      "size (memory in use, each byte in its own place, as a load puts it); %.3f s (%.0f "
      "MB/s) in %zu MiB pieces into one buffer (which stays in the CPU's caches)\n",
      ti, (double)file_bytes / 1e6 / ti, tr, (double)file_bytes / 1e6 / tr, PLAIN_PIECE >> 20);
  if (spawn) {
    double tn = median(t_new, reps), tnp = median(t_new_plain, reps);
    double tnr = median(t_new_read, reps);
    printf(
        "resume in a new process, as fsdp-train resumes (deferred build, materialize, load; "
        "its memory fresh from the system: %zu blocks of 64 KiB or more, %ld page faults): "
        "%.3f s (quartiles %.3f s, %.3f s); %.3f s without checksums\n",
        resume_new.blocks, resume_new.faults, tn, quartile(t_new, reps, 1),
        quartile(t_new, reps, 3), tnp);
    printf(
        "plain read in a new process into memory fresh from the system (one block of the "
        "host allocator, %ld page faults): %.3f s (quartiles %.3f s, %.3f s); the resume "
        "%s of it\n",
        read_new.faults, tnr, quartile(t_new_read, reps, 1), quartile(t_new_read, reps, 3),
        paired_ratio(t_new, t_new_read, reps));
    printf("block checks on the new-process resume: %s\n", paired_cost(t_new, t_new_plain, reps));
  } else {
    printf("resume in a new process: not timed under mpirun (run bench-ckpt-load alone)\n");
  }
  printf(
      "resume, deferred, repeated in this process (%zu blocks of 64 KiB or more from the "
      "system, the rest the blocks an earlier load freed): %.3f s, %.1f MB of tensor data read "
      "(%.1f MB needed, %.1f KB of headers): %s of the read into memory (%.2fx the read into "
      "one buffer)\n",
      warm_blocks, td, (double)stats.bytes_read / 1e6, (double)stats.bytes_needed / 1e6,
      (double)stats.header_bytes / 1e3, paired_ratio(t_deferred, t_into, reps), td / tr);
  printf(
      "resume, eager (init + zero-filled moments + load): %.3f s: %.2fx the read into "
      "memory, %.2fx the deferred resume\n",
      te, te / ti, te / td);
  uint64_t block = dcp_block_bytes();
  double th = median(t_hashed, reps);
  printf(
      "the same files read in %llu-byte blocks into one buffer, each hashed: %.3f s (%.0f "
      "MB/s): the hashing alone is at most %.3f s, %.1f%% of the checked resume\n",
      (unsigned long long)block, th, (double)file_bytes / 1e6 / th, th - tr,
      100.0 * (th - tr) / td);
  print_hashing();
  printf(
      "block checks (XXH3-64 per %llu-byte block, always on): the repeated resume takes "
      "%.3f s checked, %.3f s from the same files without checksums: %s\n",
      (unsigned long long)block, td, tp, paired_cost(t_deferred, t_plain, reps));
  printf(
      "the same load again into the model's memory (reads and checks, no allocation): "
      "%.3f s checked (%s of the read into memory), %.3f s without checksums: %s\n",
      median(t_again, reps), paired_ratio(t_again, t_into, reps), median(t_again_plain, reps),
      paired_cost(t_again, t_again_plain, reps));
  double tc = median(t_cold, reps), tcp = median(t_cold_plain, reps);
  printf("the same from storage (the files' pages dropped from the page cache first): %.3f s "
         "checked, %.3f s without checksums: %s\n",
         tc, tcp, paired_cost(t_cold, t_cold_plain, reps));
  printf("a quarter of every tensor's rows (a rank of a 4-way plan, %.1f MB, into memory in use): %.3f s checked "
         "(the blocks it touches), %.3f s unchecked: %s\n",
         (double)part_bytes / 1e6, tq, tqp, paired_cost(t_part, t_part_plain, reps));
  printf("(times: medians of %d interleaved repetitions, the eager resume's of the first %d; "
         "costs: medians of the repetitions' checked/unchecked ratios)\n",
         reps, reps < EAGER_REPS ? reps : EAGER_REPS);
  device_free(device_cpu(), mem, file_bytes);
  free(buf);
  dcp_remove_tree(plain);
  if (given == NULL) {
    dcp_remove_tree(dir);
    rmdir(tmp);
  }
  world_finalize();
  return 0;
}
