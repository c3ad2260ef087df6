/*
 * Every public function, called with NULL for every pointer and 0, then -1 (an unsigned type's
 * largest value), for every number: none may crash, abort, hang or exit, and a function that
 * returns a status and takes a pointer must refuse (anything but STATUS_OK). The calls come from
 * the installed headers (gen_api_calls.py); each runs in a child process of its own, so one
 * failure names its function and the others still run. Without MPI started: a function given no
 * handle must refuse before it reaches a collective.
 *
 * Then, in this process with MPI started, valid handles with out-of-range indices, shapes and
 * dtypes, and NULL for the other arguments: each must be refused (or give NULL / 0 / -1 where
 * the function returns a value).
 *
 *   test_api_null [NAME]   one function only, its output shown
 */
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "api_calls.h"
#include "checkpoint/safetensors.h"
#include "core/tensor.h"
#include "mesh/mesh.h"
#include "mesh/world.h"
#include "nn/layers.h"
#include "nn/module.h"
#include "train/data.h"

/* Functions whose NULL or -1 arguments have a meaning of their own, so STATUS_OK is right. */
static const char *const allowed_ok[] = {
    "err_set",       /* returns the status it is given: STATUS_OK with a NULL format is a no-op */
    "err_prefix",    /* likewise */
    "pg_wait",       /* pg_wait(NULL) completes nothing, as documented */
    "world_init",    /* argc and argv may be NULL, as for MPI_Init */
    "device_memcpy", /* 0 bytes: nothing to copy */
    "device_upload", /* likewise */
    "stream_copy_async", /* likewise (a NULL stream: the CPU's, or the current one) */
    "stream_delay",      /* 0 seconds, or the CPU: no delay */
    "kernel_sum_squares_many", /* 0 tensors: nothing to sum */
    "tensor_copy_many",        /* 0 tensors: nothing to copy */
    "kernel_profile_report",   /* both outputs are optional */
    /* NULL is the CPU's stream and event (stream_new and event_new give NULL there) */
    "stream_wait_event",
    "stream_synchronize",
    "event_record",
    "event_synchronize",
};

static int ok_allowed(const char *name) {
  for (size_t i = 0; i < sizeof allowed_ok / sizeof allowed_ok[0]; i++) {
    if (strcmp(allowed_ok[i], name) == 0) return 1;
  }
  return 0;
}

/* 0 when the call behaved; otherwise a line saying what happened. */
/* Constructors that need MPI called before world_init: an error that says so, not MPI's abort
 * of the process. */
static int before_world_init(void) {
  mesh_t *m = NULL;
  nn_module_t *root = NULL;
  fsdpc_status_t a = mesh_new_local("x", DEVICE_CPU, &m);
  int bad = !(a == STATUS_EINVAL && strstr(err_detail(), "call world_init first"));
  fsdpc_status_t b = nn_sequential_new(NULL, "", &root);
  if (b == STATUS_OK) b = nn_linear_new(root, "fc", 4, 4, true, NULL, NULL);
  bad += !(b != STATUS_OK && strstr(err_detail(), "call world_init first"));
  nn_module_free(root);
  return bad;
}

static int run_one(const api_call_t *c, int quiet) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    return 1;
  }
  if (pid == 0) {
    if (quiet) {
      int fd = open("/dev/null", O_WRONLY);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
      }
    }
    alarm(20);
    int refused = c->call();
    _exit(refused ? 0 : 3);
  }
  int ws = 0;
  if (waitpid(pid, &ws, 0) < 0) {
    perror("waitpid");
    return 1;
  }
  const char *args = c->minus_one ? "NULL pointers, -1 numbers" : "NULL pointers, 0 numbers";
  if (WIFSIGNALED(ws)) {
    printf("FAIL %s (%s; %s): killed by signal %d (%s)\n", c->name, c->header, args, WTERMSIG(ws),
           strsignal(WTERMSIG(ws)));
    return 1;
  }
  int code = WEXITSTATUS(ws);
  if (code == 3 && c->refuses && !ok_allowed(c->name)) {
    printf("FAIL %s (%s; %s): returned STATUS_OK\n", c->name, c->header, args);
    return 1;
  }
  if (code != 0 && code != 3) {
    printf("FAIL %s (%s; %s): the process exited with %d\n", c->name, c->header, args, code);
    return 1;
  }
  return 0;
}

/* ---- valid handles, out-of-range arguments ---- */

static int range_failed;

#define EXPECT(cond)                                         \
  do {                                                       \
    if (!(cond)) {                                           \
      printf("FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      range_failed++;                                        \
    }                                                        \
  } while (0)
#define REFUSED(expr) EXPECT((expr) != STATUS_OK)
#define OK(expr) EXPECT((expr) == STATUS_OK)

static const int bad_index[] = {-1, INT_MIN, INT_MAX, 1 << 20};
#define N_BAD ((int)(sizeof bad_index / sizeof bad_index[0]))

static void tensor_ranges(void) {
  device_t cpu = device_cpu();
  fsdpc_tensor_t t, v;
  int64_t shape[2] = {2, 3}, neg[2] = {2, -3}, huge[2] = {INT64_MAX, INT64_MAX};
  REFUSED(tensor_zeros(&t, DTYPE_F32, cpu, -1, shape));
  REFUSED(tensor_zeros(&t, DTYPE_F32, cpu, 1000, shape));
  REFUSED(tensor_zeros(&t, DTYPE_F32, cpu, 2, neg));
  REFUSED(tensor_zeros(&t, DTYPE_F32, cpu, 2, huge));
  REFUSED(tensor_zeros(&t, (dtype_t)-1, cpu, 2, shape));
  REFUSED(tensor_zeros(&t, (dtype_t)1000, cpu, 2, shape));
  REFUSED(tensor_zeros(&t, DTYPE_F32, (device_t){.type = (device_type_t)77}, 2, shape));
  REFUSED(tensor_zeros(&t, DTYPE_F32, cpu, 2, NULL));
  OK(tensor_zeros(&t, DTYPE_F32, cpu, 2, shape));
  for (int i = 0; i < N_BAD; i++) {
    REFUSED(tensor_narrow(&v, &t, bad_index[i], 0, 1));
    REFUSED(tensor_narrow(&v, &t, 0, bad_index[i], 1));
    REFUSED(tensor_narrow(&v, &t, 0, 0, bad_index[i]));
  }
  int64_t six[1] = {6}, seven[1] = {7}, off[2] = {1, -1}, box[2] = {1, 9};
  REFUSED(tensor_view(&v, &t, 1, seven));
  REFUSED(tensor_view(&v, &t, -1, six));
  REFUSED(tensor_view(&v, &t, 1, NULL));
  REFUSED(tensor_narrow_box(&v, &t, off, shape));
  REFUSED(tensor_narrow_box(&v, &t, shape, box));
  REFUSED(tensor_narrow_box(&v, &t, NULL, shape));
  REFUSED(tensor_copy(&t, NULL));
  REFUSED(tensor_copy_many(&t, &t, -1));
  REFUSED(tensor_clone(&v, &t, (dtype_t)-1, cpu));
  bool eq;
  REFUSED(tensor_equal(&t, NULL, &eq));
  REFUSED(tensor_equal(&t, &t, NULL));
  EXPECT(!tensor_same_shape(&t, NULL));
  tensor_free(&t);
}

static void mesh_ranges(void) {
  mesh_t *m = NULL;
  OK(mesh_new_local("dp", DEVICE_CPU, &m));
  if (m == NULL) return;
  for (int i = 0; i < N_BAD; i++) {
    int d = bad_index[i];
    EXPECT(mesh_size(m, d) == 0);
    EXPECT(mesh_coord(m, d) == -1);
    EXPECT(mesh_dim_name(m, d) == NULL);
    EXPECT(mesh_group(m, d) == NULL);
  }
  EXPECT(mesh_size(m, 0) == 1 && mesh_coord(m, 0) == 0 && mesh_group(m, 0) != NULL);
  EXPECT(mesh_dim_index(m, NULL) == -1);
  const char *unknown[1] = {"tp"}, *none[1] = {NULL};
  mesh_t *s = NULL;
  REFUSED(mesh_slice(m, 1, unknown, &s));
  REFUSED(mesh_slice(m, 1, none, &s));
  REFUSED(mesh_slice(m, -1, unknown, &s));
  REFUSED(mesh_slice(m, 1 << 20, unknown, &s));
  REFUSED(mesh_slice(m, 1, NULL, &s));
  mesh_free(m);
}

static void module_ranges(void) {
  nn_module_t *root = NULL, *child = NULL;
  OK(nn_module_new("", NULL, NULL, &root));
  OK(nn_module_new("layer", NULL, NULL, &child));
  if (root == NULL || child == NULL) return;
  OK(nn_module_add_child(root, child));
  REFUSED(nn_module_add_child(root, NULL));
  for (int i = 0; i < N_BAD; i++) {
    EXPECT(nn_module_child(root, bad_index[i]) == NULL);
    EXPECT(nn_module_param(root, bad_index[i]) == NULL);
  }
  EXPECT(nn_module_child(root, 1) == NULL && nn_module_child(root, 0) == child);
  EXPECT(nn_module_child_named(root, NULL) == NULL);
  EXPECT(nn_module_param_named(root, NULL) == NULL);
  nn_module_free(root);
}

static void file_ranges(void) {
  char dir[] = "/tmp/fsdpc-api-XXXXXX", path[64], tokens[64];
  if (mkdtemp(dir) == NULL) {
    perror("mkdtemp");
    range_failed++;
    return;
  }
  snprintf(path, sizeof path, "%s/t.safetensors", dir);
  snprintf(tokens, sizeof tokens, "%s/tokens.bin", dir);
  fsdpc_tensor_t t;
  int64_t shape[1] = {4};
  OK(tensor_zeros(&t, DTYPE_F32, device_cpu(), 1, shape));
  st_writer_t *w = NULL;
  OK(st_writer_new(&w));
  REFUSED(st_writer_add(w, NULL, &t));
  REFUSED(st_writer_add(w, "x", NULL));
  OK(st_writer_add(w, "x", &t));
  REFUSED(st_writer_save(w, NULL));
  OK(st_writer_save(w, path));
  st_writer_free(w);
  tensor_free(&t);
  st_file_t *f = NULL;
  OK(st_open(path, &f));
  for (int i = 0; i < N_BAD; i++) EXPECT(st_tensor(f, bad_index[i]) == NULL);
  EXPECT(st_tensor(f, 0) != NULL && st_find(f, NULL) == NULL && st_metadata(f, NULL) == NULL);
  float raw[4];
  fsdpc_tensor_t small;
  int64_t three[1] = {3}, off[1] = {2};
  OK(tensor_zeros(&small, DTYPE_F32, device_cpu(), 1, three));
  REFUSED(st_read(f, NULL, &small));
  REFUSED(st_read(f, "x", NULL));
  REFUSED(st_read(f, "x", &small));          /* 3 elements where 4 are stored */
  REFUSED(st_read_box(f, "x", off, &small)); /* [2, 5) of 4 */
  REFUSED(st_read_raw(f, "x", raw, 3));
  REFUSED(st_read_raw(f, "x", NULL, sizeof raw));
  REFUSED(st_read_bytes(f, "x", 16, raw, 1));
  REFUSED(st_read_bytes(f, "x", UINT64_MAX, raw, 2));
  tensor_free(&small);
  st_close(f);

  FILE *out = fopen(tokens, "wb");
  uint16_t ids[64] = {0};
  if (out == NULL || fwrite(ids, sizeof ids, 1, out) != 1 || fclose(out) != 0) {
    perror(tokens);
    range_failed++;
  }
  fsdpc_data_t *d = NULL;
  REFUSED(data_open(tokens, (data_format_t)-1, &d));
  OK(data_open(tokens, DATA_U16, &d));
  for (int i = 0; i < N_BAD; i++) EXPECT(data_file_path(d, bad_index[i]) == NULL);
  EXPECT(data_file_path(d, 0) != NULL);
  data_free(d);
  unlink(path);
  unlink(tokens);
  rmdir(dir);
}

int main(int argc, char **argv) {
  const char *only = argc > 1 ? argv[1] : NULL;
  int failed = 0, ran = 0, functions = 0;
  for (int i = 0; i < api_call_count; i++) {
    const api_call_t *c = &api_calls[i];
    if (only && strcmp(only, c->name) != 0) continue;
    if (!c->minus_one) functions++;
    ran++;
    failed += run_one(c, only == NULL);
  }
  printf("%d calls of %d public functions, %d failed\n", ran, functions, failed);
  if (ran == 0) {
    printf("no public function named %s\n", only ? only : "(none)");
    return 1;
  }
  if (only) return failed ? 1 : 0;
  fflush(NULL);
  pid_t pid = fork(); /* a process that never starts MPI */
  if (pid == 0) {
    alarm(20);
    _exit(before_world_init());
  }
  int ws = 0;
  bool early = pid > 0 && waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) && WEXITSTATUS(ws) == 0;
  printf("%s constructors before world_init: an error naming world_init\n",
         early ? "ok  " : "FAIL");
  failed += !early;

  /* valid handles: MPI started, no child processes from here on */
  if (world_init(&argc, &argv) != STATUS_OK) {
    printf("FAIL world_init: %s\n", err_detail());
    return 1;
  }
  tensor_ranges();
  mesh_ranges();
  module_ranges();
  file_ranges();
  printf("valid handles with out-of-range arguments: %d failed\n", range_failed);
  world_finalize();
  return failed || range_failed ? 1 : 0;
}
