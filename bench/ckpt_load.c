/*
 * A one-rank resume against a plain read of the same files: a training checkpoint (model and
 * AdamW state) is written once, then, interleaved and repeated, (a) every file of it is read
 * into a buffer with read(2) (warm page cache), (b) the model is built deferred, its memory
 * allocated and the checkpoint loaded into it (what fsdp-train does), (c) the model is built
 * and initialised eagerly, the optimizer state zero-filled, then loaded (the path before
 * deferred initialisation). Prints median times, the bytes each read, and the ratios.
 *
 *   bench-ckpt-load [--config configs/llama-100m.json] [--dir DIR] [--reps 3]
 * Without --dir the checkpoint goes to a temporary folder, removed at the end.
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench/bench_util.h"
#include "checkpoint/train_ckpt.h"
#include "mesh/world.h"

/* Reads every regular file under dir (two levels) with read(2); returns the bytes read. */
static uint64_t read_tree(const char *dir, char *buf, size_t size) {
  uint64_t total = 0;
  DIR *d = opendir(dir);
  if (d == NULL) return 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    struct stat sb;
    if (stat(path, &sb) != 0) continue;
    if (S_ISDIR(sb.st_mode)) {
      total += read_tree(path, buf, size);
      continue;
    }
    int fd = open(path, O_RDONLY);
    if (fd < 0) continue;
    ssize_t n;
    while ((n = read(fd, buf, size)) > 0) total += (uint64_t)n;
    close(fd);
  }
  closedir(d);
  return total;
}

typedef struct built {
  llama_t *m;
  nn_param_t **ps;
  int n;
  optim_t *opt;
} built_t;

static void build(built_t *b, const llama_config_t *cfg, bool deferred) {
  llama_options_t o = LLAMA_OPTIONS_INIT;
  o.deferred = deferred;
  BENCH_TRY(llama_new(&b->m, cfg, &o));
  if (deferred)
    BENCH_TRY(nn_module_materialize(llama_module(b->m)));
  else
    BENCH_TRY(llama_init_weights(b->m, 1));
  BENCH_TRY(nn_named_parameters(llama_module(b->m), &b->ps, &b->n));
  adamw_config_t a = ADAMW_CONFIG_INIT;
  BENCH_TRY(optim_new(&b->opt, b->ps, b->n, &a));
}

static void unbuild(built_t *b) {
  optim_free(b->opt);
  free(b->ps);
  llama_free(b->m);
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

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv) {
  BENCH_TRY(world_init(&argc, &argv));
  llama_config_t cfg;
  llama_options_t unused;
  bench_model(argc, argv, SOURCE_ROOT "/configs/llama-100m.json", &cfg, &unused);
  int reps = atoi(bench_opt(argc, argv, "--reps", "3"));
  if (reps < 1 || reps > 64) reps = 3;
  const char *given = bench_opt(argc, argv, "--dir", NULL);
  char tmp[] = "/tmp/fsdpc-ckpt-load-XXXXXX", dir[4200];
  if (given == NULL) {
    if (mkdtemp(tmp) == NULL) {
      perror("mkdtemp");
      return 1;
    }
    snprintf(dir, sizeof dir, "%s/step-00000001", tmp);
    built_t b;
    build(&b, &cfg, false);
    zero_moments(&b);
    BENCH_TRY(ckpt_save_training(dir, b.ps, b.n, b.opt, 1, NULL, world_comm()));
    unbuild(&b);
  } else {
    snprintf(dir, sizeof dir, "%s", given);
  }
  size_t bufsize = (size_t)8 << 20;
  char *buf = malloc(bufsize);
  if (buf == NULL) return 1;
  uint64_t file_bytes = read_tree(dir, buf, bufsize); /* warms the page cache */
  double t_read[64], t_deferred[64], t_eager[64];
  dcp_stats_t stats = {0};
  for (int r = 0; r < reps; r++) {
    double t0 = bench_now();
    read_tree(dir, buf, bufsize);
    t_read[r] = bench_now() - t0;
    for (int k = 0; k < 2; k++) {
      t0 = bench_now();
      built_t b;
      build(&b, &cfg, k == 0);
      if (k == 1) zero_moments(&b);
      int64_t step;
      BENCH_TRY(ckpt_load_training(dir, b.ps, b.n, b.opt, &step, &stats));
      (k == 0 ? t_deferred : t_eager)[r] = bench_now() - t0;
      unbuild(&b);
    }
  }
  double tr = median(t_read, reps), td = median(t_deferred, reps), te = median(t_eager, reps);
  printf("checkpoint %s: %lld parameters, %.1f MB in its files\n", dir,
         (long long)llama_num_params(&cfg), (double)file_bytes / 1e6);
  printf("plain read of the files (page cache): %.3f s (%.0f MB/s)\n", tr,
         (double)file_bytes / 1e6 / tr);
  printf("resume, deferred (materialize + load): %.3f s, %.1f MB of tensor data read "
         "(%.1f MB needed, %.1f KB of headers): %.2fx the plain read\n",
         td, (double)stats.bytes_read / 1e6, (double)stats.bytes_needed / 1e6,
         (double)stats.header_bytes / 1e3, td / tr);
  printf("resume, eager (init + zero-filled moments + load): %.3f s: %.2fx the plain read, "
         "%.2fx the deferred resume\n",
         te, te / tr, te / td);
  printf("(median of %d interleaved repetitions)\n", reps);
  free(buf);
  if (given == NULL) {
    dcp_remove_tree(dir);
    rmdir(tmp);
  }
  world_finalize();
  return 0;
}
