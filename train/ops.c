/* The trainer's operations around the training loop (ops_impl.h). */
#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "checkpoint/train_ckpt.h"
#include "core/file.h"
#include "mesh/world.h"
#include "train/metrics_impl.h"
#include "train/ops_impl.h"
#include "train/plot.h"

/* ---- signals ---- */

static volatile sig_atomic_t g_signal;

static void on_signal(int sig) {
  if (g_signal != 0) _exit(128 + sig); /* the second: at once, no checkpoint touched */
  g_signal = sig;
}

fsdpc_status_t train_signals_install(const fsdpc_plan_t *p) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sa.sa_flags = SA_RESTART; /* reads, writes and waits go on; the loop looks at the boundary */
  sigemptyset(&sa.sa_mask);
  /* a closed output (| head, a tee whose session dropped) must not kill a run: its prints
   * fail and training goes on to its saves */
  signal(SIGPIPE, SIG_IGN);
  /* nor a file-size limit (ulimit -f): the write fails (EFBIG) and takes the error path of a
   * full disk, which saves first, instead of a kill that loses the steps since the last save */
  signal(SIGXFSZ, SIG_IGN);
  for (int i = 0; i < p->n_signals; i++)
    if (sigaction(p->signals[i], &sa, NULL) != 0)
      return err_set(STATUS_EINVAL, "train.signals: cannot handle %s: %s",
                     train_signal_name(p->signals[i]), strerror(errno));
  return STATUS_OK;
}

/* The signals train.signals may name: held from the start of the program until the plan says
 * which it handles, so that one arriving during start-up is not lost (taken by its default
 * action, killing the rank without a word) but delivered then, to the handler or the default
 * action as the plan says. */
static void stop_signal_set(sigset_t *set) {
  sigemptyset(set);
  const int all[] = {SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP, SIGXCPU};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) sigaddset(set, all[i]);
}

void train_signals_hold(void) {
  sigset_t set;
  stop_signal_set(&set);
  pthread_sigmask(SIG_BLOCK, &set, NULL); /* the threads started later keep them held */
}

void train_signals_release(void) {
  sigset_t set;
  stop_signal_set(&set);
  pthread_sigmask(SIG_UNBLOCK, &set, NULL);
}

int train_signal(void) { return g_signal; }

const char *train_signal_name(int sig) {
  switch (sig) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case SIGHUP: return "SIGHUP";
    case SIGXCPU: return "SIGXCPU";
    default: return "a signal";
  }
}

int train_stop_values(const fsdpc_plan_t *p, bool time_up, double *out) {
  out[0] = time_up ? 1 : 0;
  for (int i = 0; i < p->n_signals; i++) out[1 + i] = g_signal == p->signals[i] ? 1 : 0;
  return 1 + p->n_signals;
}

train_stop_t train_stop_of(const fsdpc_plan_t *p, const double *sums) {
  train_stop_t s = {0, sums[0] > 0};
  for (int i = 0; i < p->n_signals && s.signal == 0; i++)
    if (sums[1 + i] > 0) s.signal = p->signals[i];
  return s;
}

/* ---- the lock of checkpoint.dir ---- */

#define LOCK_NAME "fsdp-train.lock"
#define LOCK_TEXT_MAX 4096

/* The holder's record, read from fd ("" when empty), as "pid P on host H since T (plan X)". */
static bool lock_record(int fd, char *out, size_t size, long *pid, char *host, size_t hsize) {
  char text[LOCK_TEXT_MAX];
  ssize_t n = pread(fd, text, sizeof text - 1, 0);
  out[0] = host[0] = 0;
  *pid = 0;
  if (n <= 0) return true;
  text[n] = 0;
  cJSON *o = cJSON_Parse(text);
  const cJSON *jp = cJSON_GetObjectItemCaseSensitive(o, "pid");
  const cJSON *jh = cJSON_GetObjectItemCaseSensitive(o, "host");
  const cJSON *js = cJSON_GetObjectItemCaseSensitive(o, "started");
  const cJSON *jl = cJSON_GetObjectItemCaseSensitive(o, "plan");
  if (cJSON_IsNumber(jp) && cJSON_IsString(jh) && cJSON_IsString(js) && cJSON_IsString(jl)) {
    *pid = (long)jp->valuedouble;
    snprintf(host, hsize, "%s", jh->valuestring);
    snprintf(out, size, "pid %ld on host %s since %s (plan %s)", *pid, jh->valuestring,
             js->valuestring, jl->valuestring);
  } else {
    snprintf(out, size, "a record that is not a training job's");
  }
  cJSON_Delete(o);
  return *pid > 0;
}

static fsdpc_status_t lock_write(int fd, const char *plan_path) {
  char host[256] = "?", when[64];
  gethostname(host, sizeof host - 1);
  time_t t = time(NULL);
  struct tm tm;
  strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", gmtime_r(&t, &tm));
  cJSON *o = cJSON_CreateObject();
  char *text = NULL;
  if (o && cJSON_AddStringToObject(o, "host", host) &&
      cJSON_AddNumberToObject(o, "pid", (double)getpid()) &&
      cJSON_AddStringToObject(o, "started", when) && cJSON_AddStringToObject(o, "plan", plan_path))
    text = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (text == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  size_t n = strlen(text);
  errno = 0;
  ssize_t w = ftruncate(fd, 0) == 0 ? pwrite(fd, text, n, 0) : -1;
  bool ok = w == (ssize_t)n && fsync(fd) == 0;
  free(text);
  if (ok) return STATUS_OK;
  return err_set(STATUS_EIO, "cannot write the lock record: %s",
                 w >= 0 && w < (ssize_t)n ? "written short (a full disk, or a file-size limit)"
                                          : strerror(errno));
}

static char g_lock_path[PLAN_PATH_MAX + 32]; /* the lock this process holds */

/* Rank 0's part of train_lock. */
static fsdpc_status_t lock_dir(const char *dir, const char *plan_path, int *fd) {
  char path[PLAN_PATH_MAX + 32], held[LOCK_TEXT_MAX + 64], host[256], me[256] = "";
  snprintf(path, sizeof path, "%s/" LOCK_NAME, dir);
  long pid;
  int e = 0;
  for (int tries = 0; tries < 100; tries++) {
    *fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (*fd < 0 && errno == ELOOP) /* O_NOFOLLOW: a symbolic link is never followed */
      return err_set(STATUS_EINVAL,
                     "checkpoint.dir '%s': its lock %s is a symbolic link, not a job's lock; "
                     "nothing was written (remove the link if it is no file of yours)",
                     dir, path);
    if (*fd < 0)
      return err_set(STATUS_EIO, "checkpoint.dir '%s': cannot open its lock %s: %s", dir, path,
                     strerror(errno));
    struct stat sb; /* the record is written into it: never into another name of a file */
    if (fstat(*fd, &sb) == 0 && (!S_ISREG(sb.st_mode) || sb.st_nlink > 1)) {
      close(*fd);
      *fd = -1;
      return err_set(STATUS_EINVAL,
                     "checkpoint.dir '%s': its lock %s is %s, not a job's lock; nothing was "
                     "written (remove it if it is no file of yours)",
                     dir, path,
                     S_ISREG(sb.st_mode) ? "a hard link of another file" : "no regular file");
    }
    /* another job's --dry-run probes it for an instant (train_lock_note): waited out */
    e = file_lock_exclusive(*fd);
    if (e != 0 || file_fd_is(*fd, path)) break;
    close(*fd); /* locked a file its job removed as it ended: take the new one */
    *fd = -1;
  }
  if (*fd < 0) return err_set(STATUS_EIO, "checkpoint.dir '%s': its lock keeps changing", dir);
  if (e != 0) {
    if (e == EWOULDBLOCK) {
      lock_record(*fd, held, sizeof held, &pid, host, sizeof host);
      close(*fd);
      *fd = -1;
      return err_set(STATUS_EINVAL,
                     "checkpoint.dir '%s' is in use by another training job: %s. Two jobs in one "
                     "folder overwrite each other's checkpoints: wait for it to end (a job whose "
                     "launcher was killed with SIGKILL may still be running: its ranks stop on "
                     "SIGTERM), or give this run another checkpoint.dir",
                     dir, held[0] ? held : "(no record yet)");
    }
    /* a file system without locks (some parallel file systems mount without them) */
    fprintf(stderr,
            "%s: checkpoint.dir '%s': its file system takes no locks (%s); a second "
            "job in the folder will not be detected\n",
            train_prog(), dir, strerror(e));
    close(*fd);
    *fd = -1;
    return STATUS_OK;
  }
  if (!lock_record(*fd, held, sizeof held, &pid, host, sizeof host)) {
    close(*fd);
    *fd = -1;
    return err_set(STATUS_EINVAL,
                   "checkpoint.dir '%s': its lock %s holds no training job's record (a file of "
                   "yours?); nothing was written: remove it, or give this run another "
                   "checkpoint.dir",
                   dir, path);
  }
  gethostname(me, sizeof me - 1);
  if (held[0]) /* flock is released when its process ends: that process is gone */
    fprintf(
        stderr,
        "%s: checkpoint.dir '%s': took over the lock of %s, which ended without "
        "releasing it%s\n",
        train_prog(), dir, held,
        pid > 0 && strcmp(host, me) == 0 && kill((pid_t)pid, 0) != 0 ? " (no longer running)" : "");
  snprintf(g_lock_path, sizeof g_lock_path, "%s", path);
  fsdpc_status_t st = lock_write(*fd, plan_path);
  return st == STATUS_OK ? st : err_prefix(st, "checkpoint.dir '%s': its lock %s", dir, path);
}

fsdpc_status_t train_lock(const char *dir, const char *plan_path, int *fd) {
  *fd = -1;
  fsdpc_status_t st = world_rank() == 0 ? lock_dir(dir, plan_path, fd) : STATUS_OK;
  return pg_agree(world_pg(), st);
}

void train_unlock(int fd) {
  if (fd < 0) return;
  if (file_fd_is(fd, g_lock_path)) unlink(g_lock_path); /* while held: no job has it yet */
  close(fd);
}

void train_lock_note(const char *dir) {
  if (world_rank() != 0) return;
  char path[PLAN_PATH_MAX + 32], held[LOCK_TEXT_MAX + 64], host[256];
  snprintf(path, sizeof path, "%s/" LOCK_NAME, dir);
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
  long pid;
  bool record = lock_record(fd, held, sizeof held, &pid, host, sizeof host);
  if (file_lock_held(fd))
    fprintf(stderr,
            "%s: note: checkpoint.dir '%s' is in use by another training job (%s): a run "
            "would refuse to start until it ends\n",
            train_prog(), dir, held[0] ? held : "no record yet");
  else if (!record)
    fprintf(stderr,
            "%s: note: checkpoint.dir '%s': its lock %s holds no training job's record (a file "
            "of yours?): a run would refuse to start until it is removed\n",
            train_prog(), dir, path);
  close(fd);
}

/* ---- every rank's plan the same ---- */

/* The value of key in text ("key: value" lines, as plan_load_settings writes), its length
 * into *n; NULL when the key is absent. */
static const char *value_of(const char *text, const char *key, size_t klen, int *n) {
  for (const char *l = text; *l;) {
    const char *end = strchr(l, '\n');
    if (end == NULL) break;
    if (strncmp(l, key, klen) == 0 && strncmp(l + klen, ": ", 2) == 0) {
      *n = (int)(end - l - (ptrdiff_t)klen - 2);
      return l + klen + 2;
    }
    l = end + 1;
  }
  return NULL;
}

/* "key: A here, B on rank 0" for the first few keys whose values differ. */
static void describe_difference(const char *mine, const char *theirs, char *out, size_t size) {
  size_t at = 0;
  int shown = 0;
  out[0] = 0;
  for (int side = 0; side < 2 && shown < 4; side++) {
    const char *text = side ? theirs : mine, *other = side ? mine : theirs;
    for (const char *l = text; *l && shown < 4;) {
      const char *end = strchr(l, '\n'), *colon = strstr(l, ": ");
      if (end == NULL || colon == NULL || colon > end) break;
      size_t klen = (size_t)(colon - l);
      int n = (int)(end - colon - 2), m = 0;
      const char *v = colon + 2, *w = value_of(other, l, klen, &m);
      l = end + 1;
      if (w && (side == 1 || (m == n && strncmp(v, w, (size_t)n) == 0))) continue;
      const char *here = side ? w : v, *there = side ? v : w;
      int nh = side ? m : n, nt = side ? n : m;
      int k = snprintf(out + at, size - at, "%s%.*s: %.*s here, %.*s on rank 0", shown ? "; " : "",
                       (int)klen, colon - klen, here ? nh : 7, here ? here : "not set",
                       there ? nt : 7, there ? there : "not set");
      if (k > 0 && (size_t)k < size - at) at += (size_t)k;
      shown++;
    }
  }
  if (shown == 0) snprintf(out, size, "the plans differ");
}

fsdpc_status_t train_check_logits(const nn_var_t *logits, int64_t vocab_size) {
  const fsdpc_tensor_t *v = &logits->value;
  int64_t cols = v->ndim > 0 ? v->shape[v->ndim - 1] : 0;
  if (vocab_size <= 0 || cols >= vocab_size) return STATUS_OK;
  return err_set(STATUS_ESHAPE,
                 "the model's logits have %lld columns, fewer than vocab_size %lld: token ids "
                 "from %lld up would have no logit (the model's head gives one per token id)",
                 (long long)cols, (long long)vocab_size, (long long)cols);
}

fsdpc_status_t train_check_same_plan(const char *settings) {
  pg_t *pg = world_pg();
  uint64_t mine = XXH64(settings, strlen(settings), 0);
  int other = -1;
  fsdpc_status_t st = pg_host_first_differing(pg, mine, &other);
  if (st != STATUS_OK || other < 0) return st;
  /* rank 0's text to every rank, in 4-byte words */
  int64_t len = (int64_t)strlen(settings) + 1;
  FSDPC_TRY(pg_host_all_reduce(pg, &len, &len, 1, PG_HOST_I64, REDUCE_MAX)); /* the longest */
  int32_t *words = calloc((size_t)(len + 3) / 4, 4);
  if (words == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  if (world_rank() == 0) memcpy(words, settings, strlen(settings) + 1);
  st = pg_broadcast(pg, words, (size_t)(len + 3) / 4, DTYPE_I32, 0, NULL);
  if (st == STATUS_OK && mine != XXH64(words, strlen((char *)words), 0)) {
    char what[1024];
    describe_difference(settings, (const char *)words, what, sizeof what);
    st = err_set(STATUS_EINVAL,
                 "this rank's plan differs from rank 0's (%s); every rank must start with the "
                 "same plan file, --set options and --dry-run",
                 what);
  } else if (st == STATUS_OK) {
    st = err_set(STATUS_EINVAL,
                 "the plans of other ranks differ from this one (their lines name the keys)");
  }
  free(words);
  return pg_agree(pg, st);
}

/* ---- checks before the first step ---- */

fsdpc_status_t train_checkpoint_step(const char *ckpt, int64_t *step) {
  char *text = NULL;
  *step = 0;
  FSDPC_TRY(ckpt_state_text(ckpt, &text));
  cJSON *o = cJSON_Parse(text);
  free(text);
  const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "step");
  if (cJSON_IsNumber(s) && s->valuedouble >= 0) *step = (int64_t)s->valuedouble;
  cJSON_Delete(o);
  return STATUS_OK;
}

/* The model a checkpoint records (train_state.json's saved_under.model), as a JSON object
 * (caller deletes), or NULL when it records none. */
static fsdpc_status_t saved_model(const char *ckpt, cJSON **model) {
  char *text = NULL;
  *model = NULL;
  FSDPC_TRY(ckpt_state_text(ckpt, &text));
  cJSON *o = cJSON_Parse(text);
  free(text);
  cJSON *m = cJSON_DetachItemFromObjectCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(o, "saved_under"), "model");
  cJSON_Delete(o);
  if (cJSON_IsObject(m))
    *model = m;
  else
    cJSON_Delete(m);
  return STATUS_OK;
}

/* The first key of want whose value differs in got, or NULL. */
static const cJSON *first_difference(const cJSON *want, const cJSON *got) {
  for (const cJSON *k = want ? want->child : NULL; k != NULL; k = k->next)
    if (!cJSON_Compare(k, cJSON_GetObjectItemCaseSensitive(got, k->string), true)) return k;
  return NULL;
}

fsdpc_status_t train_check_own_model(const char *ckpt, const char *name, const char *described) {
  cJSON *got = NULL;
  FSDPC_TRY(saved_model(ckpt, &got));
  cJSON *want = cJSON_Parse(described);
  fsdpc_status_t st = STATUS_OK;
  if (got != NULL && !cJSON_Compare(got, want, true)) { /* no record: checked as it loads */
    const cJSON *diff = first_difference(want, got);
    char *g =
        cJSON_PrintUnformatted(diff ? cJSON_GetObjectItemCaseSensitive(got, diff->string) : got);
    char *w = cJSON_PrintUnformatted(diff ? diff : want);
    st = err_set(STATUS_EINVAL,
                 "checkpoint.load: %s holds another model than this program's '%s': %s%s%s in "
                 "the checkpoint, %s here",
                 ckpt, name, diff ? diff->string : "", diff ? " is " : "its description is ",
                 g ? g : "(absent)", w ? w : "?");
    free(g);
    free(w);
  }
  cJSON_Delete(got);
  cJSON_Delete(want);
  return st;
}

fsdpc_status_t train_check_model(const fsdpc_plan_t *p, const char *ckpt) {
  cJSON *model = NULL;
  FSDPC_TRY(saved_model(ckpt, &model));
  /* a record of this family (its model_type, or none: read as Llama's, as model.config reads
   * a config) is judged; another model's (a model_type of its own) is not this comparison's */
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(model, "model_type");
  llama_arch_t arch;
  bool named = cJSON_IsString(type) && type->valuestring[0] != 0;
  bool ours = type == NULL || (named && llama_arch_from_name(type->valuestring, &arch));
  char *mtext = model ? cJSON_PrintUnformatted(model) : NULL;
  cJSON_Delete(model);
  if (mtext == NULL) return STATUS_OK; /* no record: the shapes are checked as it loads */
  if (type != NULL && !named) {
    free(mtext);
    return err_set(STATUS_EFORMAT,
                   "checkpoint.load: '%s' records a model whose model_type is no name (an "
                   "empty string, or not a string): the checkpoint cannot be checked against "
                   "the plan's model",
                   ckpt);
  }
  llama_config_t c = LLAMA_CONFIG_INIT;
  fsdpc_status_t st = llama_config_from_hf_text(mtext, ckpt, &c);
  free(mtext);
  if (st != STATUS_OK && ours)
    return err_prefix(st, "checkpoint.load: '%s' records a model that is not valid", ckpt);
  if (st != STATUS_OK) {
    err_clear(); /* another model's record: not this comparison's to judge */
    return STATUS_OK;
  }
  const llama_config_t *m = &p->model;
  if (c.arch != m->arch)
    return err_set(STATUS_EINVAL,
                   "checkpoint.load: '%s' was saved with model.architecture = %s, the plan has %s: "
                   "a checkpoint resumes only the model it was saved from",
                   ckpt, llama_arch_name(c.arch), llama_arch_name(m->arch));
  struct {
    const char *key;
    double saved, plan;
  } keys[] = {
      {"n_layers", (double)c.n_layers, (double)m->n_layers},
      {"dim", (double)c.dim, (double)m->dim},
      {"n_heads", (double)c.n_heads, (double)m->n_heads},
      {"n_kv_heads", (double)c.n_kv_heads, (double)m->n_kv_heads},
      {"head_dim", (double)llama_head_dim(&c), (double)llama_head_dim(m)},
      {"attention_bias", c.o_bias, m->o_bias},
      {"ffn_dim", (double)c.ffn_dim, (double)m->ffn_dim},
      {"vocab_size", (double)c.vocab_size, (double)m->vocab_size},
      {"tie_embeddings", c.tie_embeddings, m->tie_embeddings},
      {"rope_theta", c.rope.theta, m->rope.theta},
      {"norm_eps", c.norm_eps, m->norm_eps}, /* RoPE's scaling, below: no plan key */
  };
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    double a = keys[i].saved, b = keys[i].plan;
    if (a == b || fabs(a - b) <= 1e-12 * fabs(b)) continue; /* a JSON round trip of a double */
    char sa[32], sb[32];
    bool flag =
        strcmp(keys[i].key, "tie_embeddings") == 0 || strcmp(keys[i].key, "attention_bias") == 0;
    llama_config_number(a, sa, sizeof sa);
    llama_config_number(b, sb, sizeof sb);
    /* rope_theta and norm_eps shape no tensor: the weights start another model's run */
    bool shapes = strcmp(keys[i].key, "rope_theta") != 0 && strcmp(keys[i].key, "norm_eps") != 0;
    return err_set(STATUS_EINVAL,
                   "checkpoint.load: '%s' was saved with model.%s = %s, the plan has %s: a "
                   "checkpoint resumes only the model it was saved from (set the plan's "
                   "model.%s to %s%s)",
                   ckpt, keys[i].key, flag ? (a ? "true" : "false") : sa,
                   flag ? (b ? "true" : "false") : sb, keys[i].key,
                   flag ? (a ? "true" : "false") : sa,
                   shapes ? ": its tensors have that model's shapes"
                          : ", or start from its weights with model.init_from after fsdp-ckpt "
                            "export-hf");
  }
  char why[160]; /* the rest of what makes the model's function: the routing, RoPE's scaling */
  if (!llama_config_same_function(&c, m, why, sizeof why))
    return err_set(STATUS_EINVAL,
                   "checkpoint.load: '%s' was saved from another model (%s: saved vs planned): "
                   "a checkpoint resumes only the model it was saved from (plan the model it "
                   "records, or start from its weights with model.init_from after fsdp-ckpt "
                   "export-hf)",
                   ckpt, why);
  if (llama_vocab_rows(&c) != llama_vocab_rows(m))
    return err_set(STATUS_EINVAL,
                   "checkpoint.load: '%s' holds an embedding and head of %lld rows "
                   "(model.pad_vocab_multiple = %lld), the plan's have %lld: set the plan's "
                   "model.pad_vocab_multiple to %lld, or start from its weights with "
                   "model.init_from after fsdp-ckpt export-hf",
                   ckpt, (long long)llama_vocab_rows(&c), (long long)c.pad_vocab_multiple,
                   (long long)llama_vocab_rows(m), (long long)c.pad_vocab_multiple);
  return STATUS_OK;
}

fsdpc_status_t train_check_step_folders(const fsdpc_plan_t *p, int64_t start) {
  fsdpc_status_t st = STATUS_OK;
  if (world_rank() == 0 && p->ckpt_dir[0] && !p->ckpt_overwrite) {
    int count = 0;
    int64_t newest = -1;
    st = ckpt_newer(p->ckpt_dir, start, p->steps, &count, &newest);
    char dir[PLAN_PATH_MAX + 32], state[PLAN_PATH_MAX + 64];
    ckpt_step_dir(p->ckpt_dir, newest, dir, sizeof dir);
    snprintf(state, sizeof state, "%s/train_state.json", dir);
    bool complete = access(state, F_OK) == 0;
    if (st == STATUS_OK && count > 0)
      st = err_set(STATUS_EINVAL,
                   "%s: checkpoint.dir '%s' holds %d step folder%s after step %lld, where this "
                   "run starts (the newest: %s%s); the run would save over them. %s, give this "
                   "run another checkpoint.dir, or set checkpoint.overwrite: true (the newer "
                   "folders are removed once this run's first checkpoint is saved)",
                   p->ckpt_where.text, p->ckpt_dir, count, count == 1 ? "" : "s", (long long)start,
                   dir, complete ? "" : ", not a complete checkpoint",
                   complete ? "Resume the newest with checkpoint.load: auto"
                            : "Remove the folders that are no checkpoint");
  }
  char tmp[256] = "";
  if (st == STATUS_OK && world_rank() == 0 && p->ckpt_dir[0])
    st = ckpt_foreign_tmp(p->ckpt_dir, start, p->steps, tmp, sizeof tmp);
  if (st == STATUS_OK && tmp[0])
    st = err_set(STATUS_EINVAL,
                 "%s: checkpoint.dir '%s' holds %s, which is no save's (it lacks the "
                 "%s mark a save gives its folder): a save of that step would be refused. "
                 "Remove or rename it, or give this run another checkpoint.dir",
                 p->ckpt_where.text, p->ckpt_dir, tmp, FILE_TEMP_MARK);
  return pg_agree(world_pg(), st);
}

/* Whether name is one of a run's step folders (or their .tmp), by its start: "step-" and a
 * digit. */
static bool step_folder_name(const char *name, size_t n) {
  return n > 5 && strncmp(name, "step-", 5) == 0 && name[5] >= '0' && name[5] <= '9';
}

/* An output must not be what checkpoint.dir's run manages: its lock file, a step folder's
 * name, or a file inside one (which checkpoint.keep prunes and checkpoint.overwrite replaces);
 * a file the run reads (input) not one inside a step folder either where checkpoint.keep or
 * checkpoint.overwrite would remove it. */
static fsdpc_status_t outside_checkpoints(const fsdpc_plan_t *p, const char *path, const char *what,
                                          bool input) {
  if (!p->ckpt_dir[0]) return STATUS_OK;
  if (input && p->ckpt_keep <= 0 && !p->ckpt_overwrite) return STATUS_OK; /* nothing removes it */
  char parent[PLAN_PATH_MAX + 8];
  file_parent_of(path, parent, sizeof parent);
  const char *slash = strrchr(path, '/');
  const char *base = slash ? slash + 1 : path;
  char *dir = realpath(p->ckpt_dir, NULL), *at = realpath(parent, NULL);
  fsdpc_status_t st = STATUS_OK;
  size_t n = dir ? strlen(dir) : 0;
  if (dir != NULL && at != NULL && strcmp(at, dir) == 0 && !input) { /* in the folder itself */
    if (strcmp(base, "fsdp-train.lock") == 0 || strcmp(base, CKPT_ROLLBACK_JOURNAL) == 0)
      st = err_set(STATUS_EINVAL, "%s '%s' is checkpoint.dir's %s; name another file", what, path,
                   strcmp(base, CKPT_ROLLBACK_JOURNAL) == 0 ? "rollback journal" : "lock file");
    else if (step_folder_name(base, strlen(base)))
      st = err_set(STATUS_EINVAL,
                   "%s '%s' is named as checkpoint.dir's step folders are, which the run "
                   "saves, prunes and replaces; name another file",
                   what, path);
  } else if (dir != NULL && at != NULL && strncmp(at, dir, n) == 0 && at[n] == '/') {
    const char *sub = at + n + 1, *end = strchr(sub, '/');
    size_t len = end ? (size_t)(end - sub) : strlen(sub);
    if (step_folder_name(sub, len))
      st = err_set(STATUS_EINVAL,
                   "%s '%s' lies in checkpoint.dir's step folder %.*s, which checkpoint.keep "
                   "prunes and checkpoint.overwrite replaces; %s",
                   what, path, (int)len, sub,
                   input ? "copy it outside the step folders (the run would remove it while "
                           "reading it)"
                         : "name a path outside the step folders");
  }
  free(dir);
  free(at);
  return st;
}

fsdpc_status_t train_check_outputs(const fsdpc_plan_t *p, const char *metrics, const char *plot,
                                   const fsdpc_data_t *data, const fsdpc_data_t *eval,
                                   const char *resumed, bool dry_run) {
  file_inputs_t *in = NULL;
  fsdpc_status_t st = file_inputs_new(&in);
  if (st == STATUS_OK) st = file_inputs_add(in, p->source, "the plan");
  for (int i = 0; data && i < data_num_files(data) && st == STATUS_OK; i++) {
    st = outside_checkpoints(p, data_file_path(data, i), "data.path's file", true);
    if (st == STATUS_OK) st = file_inputs_add(in, data_file_path(data, i), "data.path's file");
  }
  for (int i = 0; eval && i < data_num_files(eval) && st == STATUS_OK; i++) {
    st = outside_checkpoints(p, data_file_path(eval, i), "eval.path's file", true);
    if (st == STATUS_OK) st = file_inputs_add(in, data_file_path(eval, i), "eval.path's file");
  }
  if (st == STATUS_OK && p->init_from[0])
    st = file_inputs_add(in, p->init_from, "a file of model.init_from");
  if (st == STATUS_OK && p->model_config[0])
    st = file_inputs_add(in, p->model_config, "model.config's file");
  if (st == STATUS_OK && resumed && resumed[0])
    st = file_inputs_add(in, resumed, "a file of the checkpoint it resumes");
  if (st == STATUS_OK && metrics && metrics[0]) {
    st = outside_checkpoints(p, metrics, "--metrics (or log.metrics)", false);
    if (st == STATUS_OK) st = file_check_output(metrics, "--metrics (or log.metrics)", in);
    /* a fresh run writes into it (a resumed one renames a new file over it) */
    if (st == STATUS_OK && !(resumed && resumed[0]) && access(metrics, F_OK) == 0 &&
        access(metrics, W_OK) != 0)
      st = err_set(STATUS_EIO,
                   "--metrics (or log.metrics) '%s': exists and cannot be written (%s); nothing "
                   "was written",
                   metrics, strerror(errno));
    if (st == STATUS_OK) st = train_metrics_check_free(metrics, dry_run);
    if (st == STATUS_OK) st = train_metrics_check_content(metrics);
    if (st == STATUS_OK) st = file_inputs_add(in, metrics, "the metrics file");
  }
  if (st == STATUS_OK && plot) {
    st = outside_checkpoints(p, plot, "--plot", false);
    if (st == STATUS_OK) st = file_check_output(plot, "--plot", in);
    if (st == STATUS_OK) st = train_plot_check_replaces(plot, "--plot");
    if (st == STATUS_OK && metrics && metrics[0] && file_same_path(plot, metrics))
      st = err_set(STATUS_EINVAL, "--plot '%s' is the metrics file it draws; name another file",
                   plot);
  }
  file_inputs_free(in);
  return st;
}
