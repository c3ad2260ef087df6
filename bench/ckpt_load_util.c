/* The parts of bench-ckpt-load shared by its one-rank and multi-rank runs (see ckpt_load.h). */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench/ckpt_load.h"
#include "checkpoint/dcp.h"
#include "checkpoint/dcp_integrity_impl.h"
#include "checkpoint/safetensors.h"
#include "core/file.h"
#include "fully_shard/fsdp.h"

/* Copies one shard file without its integrity record, streaming one tensor at a time. */
static void copy_unchecked(const char *from, const char *to) {
  st_file_t *f;
  st_writer_t *w;
  BENCH_TRY(st_open(from, &f));
  BENCH_TRY(st_writer_new(&w));
  const char *keys[] = {"DCP_SHARDING_INFO", "DCP_VERSION", "format"};
  for (int k = 0; k < 3; k++)
    if (st_metadata(f, keys[k]))
      BENCH_TRY(st_writer_set_metadata(w, keys[k], st_metadata(f, keys[k])));
  for (int i = 0; i < st_num_tensors(f); i++) {
    const st_info_t *t = st_tensor(f, i);
    BENCH_TRY(st_writer_declare(w, t->name, t->dtype, t->ndim, t->shape));
  }
  BENCH_TRY(st_writer_begin(w, to));
  for (int i = 0; i < st_num_tensors(f); i++) {
    const st_info_t *t = st_tensor(f, i);
    fsdpc_tensor_t x;
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
void ckb_copy_unchecked_checkpoint(const char *dir, const char *to) {
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
uint64_t ckb_read_quarters(const char *dir, double *secs) {
  const char *subs[] = {"model", "optim"};
  uint64_t total = 0;
  *secs = 0;
  for (int k = 0; k < 2; k++) {
    char folder[4400];
    snprintf(folder, sizeof folder, "%.4000s/%s", dir, subs[k]);
    double t0 = device_clock_seconds();
    dcp_reader_t *r;
    BENCH_TRY(dcp_reader_open(folder, &r));
    *secs += device_clock_seconds() - t0;
    const dcp_tensor_t *t;
    int n;
    BENCH_TRY(dcp_reader_list(r, &t, &n));
    fsdpc_tensor_t *x = calloc((size_t)n, sizeof *x);
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
    t0 = device_clock_seconds();
    BENCH_TRY(dcp_reader_read_boxes(r, boxes, n)); /* what a resharding load reads */
    dcp_reader_close(r);
    *secs += device_clock_seconds() - t0;
    for (int i = 0; i < n; i++) tensor_free(&x[i]);
    free(boxes);
    free(x);
  }
  return total;
}

static uint64_t g_hash_sink;

/* Reads (or drops) the open file fd at path, then closes it; returns the bytes read. */
static uint64_t walk_fd(int fd, const char *path, const ckb_walk_t *w) {
  uint64_t total = 0;
  if (w->drop) { /* written pages must reach the storage before they can be dropped */
    if (fdatasync(fd) != 0 || posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) perror(path);
    close(fd);
    return 0;
  }
  for (;;) {
    char *dst = w->at ? w->buf + *w->at : w->buf;
    size_t want = w->size;
    if (w->at) want = w->size - *w->at < CKB_PLAIN_PIECE ? w->size - *w->at : CKB_PLAIN_PIECE;
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
uint64_t ckb_walk_tree(const char *dir, const ckb_walk_t *w) {
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
      total += ckb_walk_tree(path, w);
      continue;
    }
    int fd = open(path, O_RDONLY);
    if (fd < 0) continue;
    total += walk_fd(fd, path, w);
  }
  closedir(d);
  return total;
}

uint64_t ckb_read_tree(const char *dir, char *buf, size_t size) {
  return ckb_walk_tree(dir, &(ckb_walk_t){buf, size, false, false, NULL});
}

/* Reads every file under dir into mem (size bytes), end to end. */
uint64_t ckb_read_tree_into(const char *dir, char *mem, size_t size) {
  uint64_t at = 0;
  return ckb_walk_tree(dir, &(ckb_walk_t){mem, size, false, false, &at});
}

/* size bytes from the host allocator, as a load's large tensors get them, touched. */
char *ckb_memory_in_use(size_t size) {
  void *p;
  BENCH_TRY(device_alloc(device_cpu(), size, &p));
  memset(p, 1, size);
  return p;
}

/* The model and its AdamW state; with a mesh, fully_shard per layer and root over it (as
 * fsdp-train's FSDP plans), before the deferred model gets memory. */
void ckb_build(ckb_built_t *b, const llama_config_t *cfg, bool deferred, mesh_t *mesh) {
  llama_options_t o = LLAMA_OPTIONS_INIT;
  o.deferred = deferred;
  BENCH_TRY(llama_new(cfg, &o, &b->m));
  if (!deferred) BENCH_TRY(llama_init_weights(b->m, 1));
  if (mesh) {
    fsdp_options_t f = FSDP_OPTIONS_INIT;
    f.mesh = mesh;
    fsdp_group_t *g;
    for (int i = 0; i < cfg->n_layers; i++) BENCH_TRY(fully_shard(llama_layer(b->m, i), &f, &g));
    BENCH_TRY(fully_shard(llama_module(b->m), &f, &g));
  }
  if (deferred) BENCH_TRY(nn_module_materialize(llama_module(b->m)));
  BENCH_TRY(nn_named_parameters(llama_module(b->m), &b->ps, &b->n));
  adamw_config_t a = ADAMW_CONFIG_INIT;
  BENCH_TRY(optim_new(b->ps, b->n, &a, &b->opt));
}

void ckb_unbuild(ckb_built_t *b) {
  optim_free(b->opt);
  free(b->ps);
  llama_free(b->m);
}

/* The state before deferred initialisation: the eager build also zero-filled the moments the
 * load then overwrote. */
void ckb_zero_moments(ckb_built_t *b) {
  for (int i = 0; i < b->n; i++) {
    dtensor_t *m, *v;
    BENCH_TRY(optim_state(b->opt, i, &m, &v));
    dtensor_free(m);
    dtensor_free(v);
  }
}

/* The ratios a[i] / b[i] of n paired repetitions (run back to back, so machine noise mostly
 * cancels) into q; returns their median. */
static double ratios(const double *a, const double *b, int n, double *q) {
  for (int i = 0; i < n; i++) q[i] = a[i] / b[i];
  return bench_median(q, n);
}

/* The median of the paired ratios a / b, written with their quartiles (their spread: this
 * machine's noise). */
const char *ckb_paired_ratio(const double *a, const double *b, int n) {
  static char out[4][96];
  static int next;
  double q[64], m = ratios(a, b, n, q);
  char *o = out[next++ % 4];
  snprintf(o, sizeof out[0], "%.2fx (paired; quartiles %.2fx, %.2fx)", m, bench_quartile(q, n, 1),
           bench_quartile(q, n, 3));
  return o;
}

/* The checked-over-unchecked cost: the median of the repetitions' paired ratios, in percent,
 * written with the ratios' quartiles and the fastest runs' ratio. */
const char *ckb_paired_cost(const double *checked, const double *unchecked, int n) {
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
           100.0 * (m - 1.0), 100.0 * (bench_quartile(q, n, 1) - 1.0),
           100.0 * (bench_quartile(q, n, 3) - 1.0), 100.0 * (best / best_un - 1.0));
  return o;
}

/* Seconds since t0 on the slowest rank (a job waits for it). */
double ckb_slowest(double t0) {
  double t = device_clock_seconds() - t0;
  BENCH_TRY(pg_host_all_reduce(world_pg(), &t, &t, 1, PG_HOST_F64, REDUCE_MAX));
  return t;
}

void ckb_barrier(void) {
  int x = 0;
  BENCH_TRY(pg_host_all_reduce(world_pg(), &x, &x, 1, PG_HOST_I32, REDUCE_SUM));
}

/* Reads this rank's own files of checkpoint dir (model/ and optim/ shard-RRRRR) as w says
 * (buf and size: w's; at: NULL, or where to put them end to end); the bytes. */
uint64_t ckb_read_own(const char *dir, char *buf, size_t size, uint64_t *at) {
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
    total += walk_fd(fd, path, &(ckb_walk_t){buf, size, false, false, at});
  }
  return total;
}

/* Where this rank's loads hash their blocks, and why. */
void ckb_print_hashing(void) {
  world_cpus_t c = world_cpus();
  printf(
      "this rank may use %d of the %ld CPUs, %d rank%s on the node: the loads hash their "
      "blocks %s\n",
      c.mine, c.online, c.local_ranks, c.local_ranks == 1 ? "" : "s",
      dcp_checker_spare_cpu() ? "on a helper thread" : "on the reading thread");
}
