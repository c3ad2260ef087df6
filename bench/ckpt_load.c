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
#include "bench/ckpt_load.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/file.h"
#include "checkpoint/dcp_integrity_impl.h"
#include "checkpoint/train_ckpt.h"

/* The eager resume (seconds each) runs in the first repetitions only. */
#define EAGER_REPS 3

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
  double t = device_clock_seconds() - t0;
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
  double t0 = device_clock_seconds();
  ckb_built_t b;
  ckb_build(&b, &cfg, true, NULL);
  int64_t step;
  BENCH_TRY(ckpt_load_training(dir, b.ps, b.n, b.opt, &step, NULL));
  fresh_print(t0, &before);
  ckb_unbuild(&b);
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
  double t0 = device_clock_seconds();
  void *mem;
  BENCH_TRY(device_alloc(device_cpu(), size, &mem));
  ckb_read_tree_into(dir, mem, size);
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
    ckb_sharded(&cfg, reps);
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
    ckb_built_t b;
    ckb_build(&b, &cfg, false, NULL);
    ckb_zero_moments(&b);
    BENCH_TRY(ckpt_save_training(dir, b.ps, b.n, b.opt, 1, NULL, world_pg()));
    ckb_unbuild(&b);
  } else {
    snprintf(dir, sizeof dir, "%s", given);
  }
  size_t bufsize = CKB_PLAIN_PIECE;
  char *buf = malloc(bufsize);
  if (buf == NULL) return 1;
  char plain[4400];
  snprintf(plain, sizeof plain, "%.4200s.unchecked", dir);
  ckb_copy_unchecked_checkpoint(dir, plain);
  uint64_t file_bytes = ckb_read_tree(dir, buf, bufsize); /* warms the page cache */
  ckb_read_tree(plain, buf, bufsize);
  char *mem = ckb_memory_in_use(file_bytes), bytes_arg[32];
  snprintf(bytes_arg, sizeof bytes_arg, "%llu", (unsigned long long)file_bytes);
  double t_read[64], t_into[64], t_deferred[64], t_eager[64], t_plain[64], t_part[64];
  double t_part_plain[64], t_hashed[64], t_cold[64], t_cold_plain[64], t_again[64];
  double t_again_plain[64], t_new[64], t_new_plain[64], t_new_read[64];
  size_t warm_blocks = 0;
  fresh_t resume_new = {0}, read_new = {0}; /* the last ones' blocks and faults */
  dcp_stats_t stats = {0}, plain_stats = {0};
  uint64_t part_bytes = 0;
  for (int r = 0; r < reps; r++) {
    double t0 = device_clock_seconds();
    ckb_read_tree(dir, buf, bufsize);
    t_read[r] = device_clock_seconds() - t0;
    t0 = device_clock_seconds();
    ckb_read_tree_into(dir, mem, file_bytes);
    t_into[r] = device_clock_seconds() - t0;
    t0 = device_clock_seconds();
    ckb_walk_tree(dir, &(ckb_walk_t){buf, (size_t)dcp_block_bytes(), true, false, NULL});
    t_hashed[r] = device_clock_seconds() - t0;
    for (int j = 0; j < 2; j++) { /* checked and unchecked back to back, alternating first */
      int k = (j + r) % 2;         /* 1: the checked files, 0: those without checksums */
      ckb_read_tree(k ? dir : plain, buf, bufsize); /* each load after a read of its own files */
      size_t blocks = mem_os_allocs(device_cpu());
      t0 = device_clock_seconds();
      ckb_built_t b;
      ckb_build(&b, &cfg, true, NULL);
      int64_t step;
      BENCH_TRY(ckpt_load_training(k ? dir : plain, b.ps, b.n, b.opt, &step,
                                   k ? &stats : &plain_stats));
      (k ? t_deferred : t_plain)[r] = device_clock_seconds() - t0;
      if (k) warm_blocks = mem_os_allocs(device_cpu()) - blocks;
      t0 = device_clock_seconds(); /* again into the same memory: the reads and checks alone */
      BENCH_TRY(ckpt_load_training(k ? dir : plain, b.ps, b.n, b.opt, &step, NULL));
      (k ? t_again : t_again_plain)[r] = device_clock_seconds() - t0;
      ckb_unbuild(&b);
    }
    for (int j = 0; spawn && j < 3; j++) { /* each in a process of its own */
      int k = (j + r) % 3;                 /* 2: the plain read */
      ckb_read_tree(k ? dir : plain, buf, bufsize);
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
      ckb_walk_tree(dir, &(ckb_walk_t){.drop = true});
      ckb_walk_tree(plain, &(ckb_walk_t){.drop = true});
      t0 = device_clock_seconds();
      ckb_built_t b;
      ckb_build(&b, &cfg, true, NULL);
      int64_t step;
      BENCH_TRY(ckpt_load_training(k ? dir : plain, b.ps, b.n, b.opt, &step, NULL));
      (k ? t_cold : t_cold_plain)[r] = device_clock_seconds() - t0;
      ckb_unbuild(&b);
    }
    for (int j = 0; j < 2; j++) { /* a quarter of the rows, the same way */
      int k = (j + r) % 2;
      ckb_read_tree(k ? dir : plain, buf, bufsize);
      part_bytes = ckb_read_quarters(k ? dir : plain, &(k ? t_part : t_part_plain)[r]);
    }
    if (r >= EAGER_REPS) continue;
    t0 = device_clock_seconds();
    ckb_built_t b;
    ckb_build(&b, &cfg, false, NULL);
    ckb_zero_moments(&b);
    int64_t step;
    BENCH_TRY(ckpt_load_training(dir, b.ps, b.n, b.opt, &step, &stats));
    t_eager[r] = device_clock_seconds() - t0;
    ckb_unbuild(&b);
  }
  double tr = bench_median(t_read, reps), ti = bench_median(t_into, reps),
         td = bench_median(t_deferred, reps);
  double te = bench_median(t_eager, reps < EAGER_REPS ? reps : EAGER_REPS);
  double tp = bench_median(t_plain, reps), tq = bench_median(t_part, reps),
         tqp = bench_median(t_part_plain, reps);
  printf("checkpoint %s: %lld parameters, %.1f MB in its files\n", dir,
         (long long)llama_num_params(&cfg), (double)file_bytes / 1e6);
  printf(
      "plain read of the files from the page cache: %.3f s (%.0f MB/s) into memory of their "
      "size (memory in use, each byte in its own place, as a load puts it); %.3f s (%.0f "
      "MB/s) in %zu MiB pieces into one buffer (which stays in the CPU's caches)\n",
      ti, (double)file_bytes / 1e6 / ti, tr, (double)file_bytes / 1e6 / tr, CKB_PLAIN_PIECE >> 20);
  if (spawn) {
    double tn = bench_median(t_new, reps), tnp = bench_median(t_new_plain, reps);
    double tnr = bench_median(t_new_read, reps);
    printf(
        "resume in a new process, as fsdp-train resumes (deferred build, materialize, load; "
        "its memory fresh from the system: %zu blocks of 64 KiB or more, %ld page faults): "
        "%.3f s (quartiles %.3f s, %.3f s); %.3f s without checksums\n",
        resume_new.blocks, resume_new.faults, tn, bench_quartile(t_new, reps, 1),
        bench_quartile(t_new, reps, 3), tnp);
    printf(
        "plain read in a new process into memory fresh from the system (one block of the "
        "host allocator, %ld page faults): %.3f s (quartiles %.3f s, %.3f s); the resume "
        "%s of it\n",
        read_new.faults, tnr, bench_quartile(t_new_read, reps, 1),
        bench_quartile(t_new_read, reps, 3), ckb_paired_ratio(t_new, t_new_read, reps));
    printf("block checks on the new-process resume: %s\n",
           ckb_paired_cost(t_new, t_new_plain, reps));
  } else {
    printf("resume in a new process: not timed under mpirun (run bench-ckpt-load alone)\n");
  }
  printf(
      "resume, deferred, repeated in this process (%zu blocks of 64 KiB or more from the "
      "system, the rest the blocks an earlier load freed): %.3f s, %.1f MB of tensor data read "
      "(%.1f MB needed, %.1f KB of headers): %s of the read into memory (%.2fx the read into "
      "one buffer)\n",
      warm_blocks, td, (double)stats.bytes_read / 1e6, (double)stats.bytes_needed / 1e6,
      (double)stats.header_bytes / 1e3, ckb_paired_ratio(t_deferred, t_into, reps), td / tr);
  printf(
      "resume, eager (init + zero-filled moments + load): %.3f s: %.2fx the read into "
      "memory, %.2fx the deferred resume\n",
      te, te / ti, te / td);
  uint64_t block = dcp_block_bytes();
  double th = bench_median(t_hashed, reps);
  printf(
      "the same files read in %llu-byte blocks into one buffer, each hashed: %.3f s (%.0f "
      "MB/s): the hashing alone is at most %.3f s, %.1f%% of the checked resume\n",
      (unsigned long long)block, th, (double)file_bytes / 1e6 / th, th - tr,
      100.0 * (th - tr) / td);
  ckb_print_hashing();
  printf(
      "block checks (XXH3-64 per %llu-byte block, always on): the repeated resume takes "
      "%.3f s checked, %.3f s from the same files without checksums: %s\n",
      (unsigned long long)block, td, tp, ckb_paired_cost(t_deferred, t_plain, reps));
  printf(
      "the same load again into the model's memory (reads and checks, no allocation): "
      "%.3f s checked (%s of the read into memory), %.3f s without checksums: %s\n",
      bench_median(t_again, reps), ckb_paired_ratio(t_again, t_into, reps),
      bench_median(t_again_plain, reps), ckb_paired_cost(t_again, t_again_plain, reps));
  double tc = bench_median(t_cold, reps), tcp = bench_median(t_cold_plain, reps);
  printf(
      "the same from storage (the files' pages dropped from the page cache first): %.3f s "
      "checked, %.3f s without checksums: %s\n",
      tc, tcp, ckb_paired_cost(t_cold, t_cold_plain, reps));
  printf(
      "a quarter of every tensor's rows (a rank of a 4-way plan, %.1f MB, into memory in use): "
      "%.3f s checked "
      "(the blocks it touches), %.3f s unchecked: %s\n",
      (double)part_bytes / 1e6, tq, tqp, ckb_paired_cost(t_part, t_part_plain, reps));
  printf("(times: medians of %d interleaved repetitions, the eager resume's of the first %d; "
         "costs: medians of the repetitions' checked/unchecked ratios)\n",
         reps, reps < EAGER_REPS ? reps : EAGER_REPS);
  device_free(device_cpu(), mem, file_bytes);
  free(buf);
  file_remove_tree(plain);
  if (given == NULL) {
    file_remove_tree(dir);
    rmdir(tmp);
  }
  world_finalize();
  return 0;
}
