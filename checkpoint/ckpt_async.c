/* Asynchronous training checkpoints (train_ckpt.h, "Asynchronous saves"): the state copied
 * into staging memory kept between saves, this rank's files written by a thread of its own,
 * the folder committed by the caller once every rank's files are written. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/file.h"
#include "checkpoint/train_ckpt_impl.h"

#define PATH_LEN 4400

/* One folder of the save (model/, optim/): this rank's boxes on the staging copies, the files
 * of every rank that writes one, and the save's id. */
typedef struct folder {
  dcp_box_t *boxes;
  int count;
  char **files;
  int n_files;
  uint64_t id;
} folder_t;

struct ckpt_async {
  fsdpc_tensor_t *stage;         /* the staging copies, kept between saves (same shapes, reused) */
  const fsdpc_tensor_t **source; /* per slot: the host tensor the writer copies into it, or NULL */
  int n_stage;
  /* the save in flight */
  bool pending; /* its writer started (and not yet joined) */
  int rank;     /* in the save's group */
  char dir[PATH_LEN], tmp[PATH_LEN];
  int64_t step, optim_steps;
  char *saved_under;
  ckpt_entries_t e;
  folder_t f[2]; /* model, optim */
  pthread_t writer;
  atomic_int done; /* the writer finished: 1 written, -1 failed */
  pthread_mutex_t lock;
  pthread_cond_t changed;
  bool staged; /* the writer has copied the host tensors (under lock) */
  fsdpc_status_t error;
  char detail[1024];
};

fsdpc_status_t ckpt_async_new(ckpt_async_t **out) {
  ARG_NONNULL(out);
  *out = calloc(1, sizeof **out);
  if (*out == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  pthread_mutex_init(&(*out)->lock, NULL);
  pthread_cond_init(&(*out)->changed, NULL);
  return STATUS_OK;
}

static void folder_free(folder_t *f) {
  for (int i = 0; i < f->n_files; i++) free(f->files[i]);
  free(f->files);
  free(f->boxes);
  memset(f, 0, sizeof *f);
}

/* Ends the save in flight on this rank: its writer joined, its pieces freed. */
static void release(ckpt_async_t *a);

static void drop(ckpt_async_t *a) {
  if (!a->pending) return;
  pthread_join(a->writer, NULL);
  release(a);
  a->pending = false;
}

void ckpt_async_free(ckpt_async_t *a) {
  if (a == NULL) return;
  drop(a); /* an uncommitted folder stays as DIR.tmp: the next run's start removes it */
  for (int i = 0; i < a->n_stage; i++) tensor_free(&a->stage[i]);
  free(a->stage);
  free(a->source);
  pthread_mutex_destroy(&a->lock);
  pthread_cond_destroy(&a->changed);
  free(a);
}

bool ckpt_async_pending(const ckpt_async_t *a) { return a != NULL && a->pending; }

bool ckpt_async_written(const ckpt_async_t *a) {
  return a == NULL || !a->pending || atomic_load(&a->done) != 0;
}

bool ckpt_async_failed(const ckpt_async_t *a) {
  return a != NULL && a->pending && atomic_load(&a->done) < 0;
}

const char *ckpt_async_dir(const ckpt_async_t *a) {
  if (a == NULL) return "";
  return a->pending ? a->dir : "";
}

/* Room for n staging slots (before any box points at one: the array may move). */
static fsdpc_status_t reserve(ckpt_async_t *a, int n) {
  if (n > a->n_stage) {
    fsdpc_tensor_t *s = realloc(a->stage, sizeof *s * (size_t)n);
    if (s == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory (staging)");
    memset(s + a->n_stage, 0, sizeof *s * (size_t)(n - a->n_stage));
    a->stage = s;
    const fsdpc_tensor_t **src = realloc(a->source, sizeof *src * (size_t)n);
    if (src == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory (staging)");
    a->source = src;
    a->n_stage = n;
  }
  memset(a->source, 0, sizeof *a->source * (size_t)a->n_stage);
  return STATUS_OK;
}

/* Staging slot i gets the room of a host copy of t (reused when the shape and dtype are those
 * of the last save). A tensor on a device is copied now; one on the host is left for the
 * writer thread to copy (*deferred). */
static fsdpc_status_t stage(ckpt_async_t *a, int i, const fsdpc_tensor_t *t,
                            const fsdpc_tensor_t **deferred) {
  fsdpc_tensor_t *s = &a->stage[i];
  *deferred = NULL;
  if (s->data == NULL || s->dtype != t->dtype || !tensor_same_shape(s, t)) {
    tensor_free(s);
    FSDPC_TRY(tensor_init(s, t->dtype, device_cpu(), t->ndim, t->shape));
  }
  if (t->device.type != DEVICE_CPU) return tensor_copy(s, t);
  *deferred = t;
  return STATUS_OK;
}

/* The writer: the host tensors copied into their staging slots (the caller waits for that
 * before it changes the state: ckpt_async_wait_staged), then this rank's files hashed and
 * written from the copies. */
static void *write_files(void *arg) {
  ckpt_async_t *a = arg;
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < a->n_stage && st == STATUS_OK; i++) {
    const fsdpc_tensor_t *src = a->source[i];
    if (src == NULL) continue;
    if (tensor_is_contiguous(src)) /* the staging copy has its dtype and shape */
      memcpy(a->stage[i].data, src->data, tensor_nbytes(src));
    else
      st = tensor_copy(&a->stage[i], src);
  }
  pthread_mutex_lock(&a->lock);
  a->staged = true;
  pthread_cond_broadcast(&a->changed);
  pthread_mutex_unlock(&a->lock);
  static const char *const sub[2] = {"model", "optim"};
  for (int k = 0; k < 2 && st == STATUS_OK; k++) {
    folder_t *f = &a->f[k];
    if (f->count == 0) continue;
    char path[PATH_LEN + 64], name[32];
    dcp_shard_name(a->rank, name, sizeof name);
    snprintf(path, sizeof path, "%.4300s/%s/%s", a->tmp, sub[k], name);
    st = dcp_write_file(path, f->boxes, f->count,
                        &(dcp_folder_t){(const char *const *)f->files, f->n_files, f->id});
  }
  if (st != STATUS_OK) {
    a->error = st;
    snprintf(a->detail, sizeof a->detail, "%s", err_detail());
  }
  atomic_store(&a->done, st == STATUS_OK ? 1 : -1);
  return NULL;
}

void ckpt_async_wait_staged(ckpt_async_t *a) {
  if (a == NULL || !a->pending) return;
  pthread_mutex_lock(&a->lock);
  while (!a->staged) pthread_cond_wait(&a->changed, &a->lock);
  pthread_mutex_unlock(&a->lock);
}

/* This rank's boxes of folder k, on staging slots from *slot on. */
static fsdpc_status_t stage_folder(ckpt_async_t *a, int k, const dcp_entry_t *entries, int n,
                                   int *slot) {
  folder_t *f = &a->f[k];
  if ((f->boxes = calloc((size_t)(n > 0 ? n : 1), sizeof *f->boxes)) == NULL)
    return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  FSDPC_TRY(dcp_shard_boxes(entries, n, f->boxes, &f->count));
  for (int i = 0; i < f->count; i++) {
    FSDPC_TRY(stage(a, *slot, f->boxes[i].value, &a->source[*slot]));
    f->boxes[i].value = &a->stage[(*slot)++];
  }
  return STATUS_OK;
}

/* Which ranks write a file of each folder, and the save's ids (rank 0's, fresh): the same on
 * every rank. Collective over pg. */
static fsdpc_status_t agree_files(ckpt_async_t *a, pg_t *pg) {
  int size = pg_size(pg);
  int64_t mine[4] = {a->f[0].count > 0, a->f[1].count > 0, 0, 0}, *all;
  if (pg_rank(pg) == 0) {
    mine[2] = (int64_t)dcp_new_save_id();
    mine[3] = (int64_t)dcp_new_save_id();
  }
  if ((all = calloc(4 * (size_t)size, sizeof *all)) == NULL)
    return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  fsdpc_status_t st = pg_host_all_gather(pg, mine, all, 4, PG_HOST_I64);
  for (int k = 0; k < 2 && st == STATUS_OK; k++) {
    folder_t *f = &a->f[k];
    f->id = (uint64_t)all[2 + k];
    if ((f->files = calloc((size_t)size, sizeof *f->files)) == NULL)
      st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
    for (int r = 0; r < size && st == STATUS_OK; r++) {
      if (!all[4 * r + k]) continue;
      if ((f->files[f->n_files] = malloc(32)) == NULL) {
        st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
        break;
      }
      dcp_shard_name(r, f->files[f->n_files++], 32);
    }
  }
  free(all);
  return st;
}

/* Frees what a save holds besides its writer. */
static void release(ckpt_async_t *a) {
  for (int k = 0; k < 2; k++) folder_free(&a->f[k]);
  ckpt_entries_free(&a->e);
  free(a->saved_under);
  a->saved_under = NULL;
}

fsdpc_status_t ckpt_async_start(ckpt_async_t *a, const char *dir, nn_param_t *const *params, int n,
                                optim_t *opt, int64_t step, const char *saved_under, pg_t *pg) {
  ARG_NONNULL(a);
  ARG_NONNULL(dir);
  if (n > 0) ARG_NONNULL(params);
  ARG_NONNULL(opt);
  ARG_NONNULL(pg);
  if (a->pending)
    return err_set(STATUS_EINVAL, "checkpoint: the save of %s is in flight: commit it first",
                   a->dir);
  if (strlen(dir) >= sizeof a->dir) return err_set(STATUS_EINVAL, "checkpoint: path too long");
  FSDPC_TRY(pg_agree(pg, ckpt_check_save_args(step, saved_under)));
  /* a failure here is agreed below, with every rank in the same collective */
  fsdpc_status_t st = ckpt_entries_make(params, n, opt, CKPT_ENTRIES_SAVE, &a->e);
  snprintf(a->dir, sizeof a->dir, "%s", dir);
  a->rank = pg_rank(pg);
  a->step = step;
  a->optim_steps = optim_steps(opt);
  a->saved_under = saved_under ? strdup(saved_under) : NULL;
  atomic_store(&a->done, 0);
  a->staged = false;
  if (st == STATUS_OK && saved_under && !a->saved_under)
    st = err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  st = pg_agree(pg, st);
  if (st == STATUS_OK) st = dcp_prepare(dir, a->tmp, sizeof a->tmp, pg);
  bool prepared = st == STATUS_OK;
  if (st == STATUS_OK) {
    fsdpc_status_t mine = STATUS_OK;
    char sub[PATH_LEN + 8];
    for (int k = 0; k < 2 && a->rank == 0 && mine == STATUS_OK; k++) {
      mine = file_join(sub, sizeof sub, a->tmp, k ? "optim" : "model");
      if (mine == STATUS_OK) mine = ckpt_make_dir(sub);
    }
    st = pg_agree(pg, mine);
  }
  if (st == STATUS_OK) { /* the copy the writer reads while training changes the state */
    int slot = 0;
    fsdpc_status_t mine = reserve(a, 3 * n);
    if (mine == STATUS_OK) mine = stage_folder(a, 0, a->e.model, n, &slot);
    if (mine == STATUS_OK) mine = stage_folder(a, 1, a->e.optim, 2 * n, &slot);
    st = pg_agree(pg, mine);
  }
  if (st == STATUS_OK) st = pg_agree(pg, agree_files(a, pg));
  if (st == STATUS_OK) {
    fsdpc_status_t mine = STATUS_OK;
    if (pthread_create(&a->writer, NULL, write_files, a) != 0)
      mine = err_set(STATUS_EIO, "checkpoint: cannot start a writer thread");
    a->pending = mine == STATUS_OK;
    st = pg_agree(pg, mine);
    if (st != STATUS_OK && a->pending) {
      pthread_join(a->writer, NULL);
      a->pending = false;
    }
  }
  if (st != STATUS_OK) {
    if (prepared && a->rank == 0) file_discard_temp_dir(a->tmp); /* agreed: none writes */
    release(a);
  }
  return st;
}

fsdpc_status_t ckpt_async_commit(ckpt_async_t *a, pg_t *pg, int64_t *step) {
  ARG_NONNULL(a);
  ARG_NONNULL(pg);
  if (!a->pending) return err_set(STATUS_EINVAL, "checkpoint: no save in flight");
  pthread_join(a->writer, NULL); /* written by now, where the caller waited for every rank */
  a->pending = false;
  fsdpc_status_t st = STATUS_OK;
  if (atomic_load(&a->done) < 0) st = err_set(a->error, "%s", a->detail);
  st = pg_agree(pg, st);
  if (st == STATUS_OK) {
    fsdpc_status_t mine = STATUS_OK;
    if (pg_rank(pg) == 0)
      mine =
          ckpt_write_state(a->tmp, a->step, a->optim_steps, a->saved_under, a->f[0].id, a->f[1].id);
    st = pg_agree(pg, mine);
  }
  if (st == STATUS_OK) st = dcp_commit(a->tmp, a->dir, pg);
  if (st != STATUS_OK && pg_rank(pg) == 0) file_discard_temp_dir(a->tmp); /* every rank agreed */
  if (step) *step = a->step;
  release(a);
  return st;
}
