/* The step folders of a run's checkpoint folder (train_ckpt.h): step-NNNNNNNN, complete or
 * not, and the unfinished saves step-NNNNNNNN.tmp; finding the newest, counting, pruning and
 * removing them without following links. */
#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/train_ckpt.h"
#include "core/args_impl.h"
#include "core/file.h"

#define PATH_LEN 4400
#define REMOVING ".removing" /* a step folder being removed: step-NNNNNNNN[.tmp].removing */

void ckpt_step_dir(const char *root, int64_t step, char *out, size_t size) {
  if (out == NULL || size == 0) return;
  if (root == NULL) root = "";
  snprintf(out, size, "%s/step-%08" PRId64, root, step);
}

bool ckpt_step_name(const char *name, int64_t *step, bool *tmp) {
  if (name == NULL) return false;
  long long s;
  char tail;
  int got = sscanf(name, "step-%lld%c", &s, &tail);
  size_t n = strlen(name);
  bool is_tmp = got == 2 && n > 4 && strcmp(name + n - 4, ".tmp") == 0;
  if ((got != 1 && !is_tmp) || s < 0) return false;
  char canon[64];
  snprintf(canon, sizeof canon, "step-%08lld%s", s, is_tmp ? ".tmp" : "");
  if (strcmp(canon, name) != 0) return false;
  if (step) *step = s;
  if (tmp) *tmp = is_tmp;
  return true;
}

fsdpc_status_t ckpt_scan_steps(const char *root, ckpt_step_fn *fn, void *ctx) {
  ARG_NONNULL(root);
  ARG_NONNULL(fn);
  DIR *d = opendir(root);
  if (d == NULL) return STATUS_OK;
  struct dirent *e;
  fsdpc_status_t st = STATUS_OK;
  while (st == STATUS_OK && (e = readdir(d)) != NULL) {
    int64_t s;
    bool is_tmp;
    if (!ckpt_step_name(e->d_name, &s, &is_tmp)) continue;
    char sub[PATH_LEN], state[PATH_LEN];
    st = file_join(sub, sizeof sub, root, e->d_name);
    if (st == STATUS_OK) st = file_join(state, sizeof state, sub, "train_state.json");
    if (st != STATUS_OK) break;
    ckpt_step_kind_t kind = is_tmp                     ? CKPT_STEP_TMP
                            : access(state, R_OK) == 0 ? CKPT_STEP_COMPLETE
                                                       : CKPT_STEP_INCOMPLETE;
    st = fn(ctx, e->d_name, s, kind);
  }
  closedir(d);
  return st;
}

typedef struct steps {
  int64_t *v;
  int n, cap;
  int64_t partial; /* the newest incomplete folder's step, -1 when none */
  bool partial_tmp;
} steps_t;

static fsdpc_status_t collect_step(void *ctx, const char *name, int64_t s, ckpt_step_kind_t kind) {
  (void)name;
  steps_t *l = ctx;
  if (kind != CKPT_STEP_COMPLETE) {
    if (s > l->partial || (s == l->partial && kind == CKPT_STEP_INCOMPLETE)) {
      l->partial = s;
      l->partial_tmp = kind == CKPT_STEP_TMP;
    }
    return STATUS_OK;
  }
  ARRAY_GROW(l->v, l->n, l->cap, 16, "checkpoint");
  l->v[l->n++] = s;
  return STATUS_OK;
}

static int cmp_step(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Complete checkpoints under root, sorted by step (ascending); the newest incomplete folder
 * into *partial (step -1 when none): a step-N without train_state.json, or step-N.tmp. The
 * caller frees *steps (NULL after a failure). */
static fsdpc_status_t list_steps(const char *root, int64_t **steps, int *n, int64_t *partial,
                                 bool *partial_tmp) {
  steps_t l = {.partial = -1};
  fsdpc_status_t st = ckpt_scan_steps(root, collect_step, &l);
  if (st == STATUS_OK && l.n > 1) qsort(l.v, (size_t)l.n, sizeof *l.v, cmp_step);
  if (st != STATUS_OK) { /* nothing handed back on failure */
    free(l.v);
    l.v = NULL;
    l.n = 0;
  }
  *steps = l.v;
  *n = l.n;
  *partial = l.partial;
  *partial_tmp = l.partial_tmp;
  return st;
}

typedef struct newer {
  int64_t after, upto, newest;
  int count;
} newer_t;

static fsdpc_status_t count_newer(void *ctx, const char *name, int64_t s, ckpt_step_kind_t kind) {
  (void)name;
  newer_t *w = ctx;
  if (s > w->after &&
      (kind == CKPT_STEP_COMPLETE || (kind == CKPT_STEP_INCOMPLETE && s <= w->upto))) {
    w->count++;
    w->newest = s > w->newest ? s : w->newest;
  }
  return STATUS_OK;
}

fsdpc_status_t ckpt_newer(const char *root, int64_t after, int64_t upto, int *count,
                          int64_t *newest) {
  ARG_NONNULL(root);
  ARG_NONNULL(count);
  ARG_NONNULL(newest);
  newer_t w = {after, upto, -1, 0};
  FSDPC_TRY(ckpt_scan_steps(root, count_newer, &w));
  *count = w.count;
  *newest = w.newest;
  return STATUS_OK;
}

/* Whether root's step-N.tmp entry name (its path into path) is no save's: not a dead save's
 * temporary (file_is_stale_temp_dir), a link aside (removed itself, as any link). */
static fsdpc_status_t no_save(const char *root, const char *name, char *path, size_t size,
                              bool *foreign) {
  struct stat sb;
  FSDPC_TRY(file_join(path, size, root, name));
  *foreign = lstat(path, &sb) == 0 && !S_ISLNK(sb.st_mode) && !file_is_stale_temp_dir(path);
  return STATUS_OK;
}

typedef struct foreign {
  const char *root;
  int64_t after, upto;
  char *name;
  size_t size;
} foreign_t;

static fsdpc_status_t find_foreign(void *ctx, const char *name, int64_t s, ckpt_step_kind_t kind) {
  foreign_t *w = ctx;
  if (kind != CKPT_STEP_TMP || s <= w->after || s > w->upto || w->name[0]) return STATUS_OK;
  char path[PATH_LEN];
  bool foreign;
  FSDPC_TRY(no_save(w->root, name, path, sizeof path, &foreign));
  if (foreign) snprintf(w->name, w->size, "%s", name);
  return STATUS_OK;
}

fsdpc_status_t ckpt_foreign_tmp(const char *root, int64_t after, int64_t upto, char *name,
                                size_t size) {
  ARG_NONNULL(root);
  ARG_NONNULL(name);
  if (size > 0) name[0] = 0;
  foreign_t w = {root, after, upto, name, size};
  return size > 0 ? ckpt_scan_steps(root, find_foreign, &w) : STATUS_OK;
}

/* Removes root's entry `name`, renamed NAME.removing first (see below). */
static fsdpc_status_t remove_entry(const char *root, const char *name) {
  char path[PATH_LEN], gone[PATH_LEN + 16];
  FSDPC_TRY(file_join(path, sizeof path, root, name)); /* never a shortened path: another file */
  int n = snprintf(gone, sizeof gone, "%s" REMOVING, path);
  if (n < 0 || (size_t)n >= sizeof gone)
    return err_set(STATUS_EINVAL, "checkpoint: path too long: %.200s...", path);
  /* renamed first, at once (a link itself): a folder half removed by a kill is never taken for
   * a checkpoint, and the next start removes it (ckpt_remove_unfinished) */
  if (rename(path, gone) != 0)
    return err_set(STATUS_EIO, "checkpoint: cannot remove %s: %s", path, strerror(errno));
  if (!file_remove_tree(gone))
    return err_set(STATUS_EIO, "checkpoint: cannot remove all of %s: %s", gone, strerror(errno));
  return STATUS_OK;
}

/* Removes the entries step-N....REMOVING under root that a removal a kill cut short left;
 * *removed counts them. One that cannot go is left (never taken for a checkpoint), counted in
 * *left, the first one's cause into why. */
static void remove_half_removed(const char *root, int *removed, int *left, char *why, size_t size) {
  DIR *d = opendir(root);
  if (d == NULL) return;
  struct dirent *e;
  size_t tail = strlen(REMOVING);
  while ((e = readdir(d)) != NULL) {
    size_t n = strlen(e->d_name);
    if (strncmp(e->d_name, "step-", 5) != 0 || n <= tail + 5 ||
        strcmp(e->d_name + n - tail, REMOVING) != 0)
      continue;
    char path[PATH_LEN];
    if (file_join(path, sizeof path, root, e->d_name) != STATUS_OK) continue;
    if (file_remove_tree(path)) {
      (*removed)++;
    } else {
      if ((*left)++ == 0)
        snprintf(why, size, "cannot remove all of %.300s: %s", path, strerror(errno));
    }
  }
  closedir(d);
}

typedef enum removal_mode {
  REMOVE_TMP,           /* the unfinished saves */
  REMOVE_AFTER,         /* the step folders after `after`, but `keep` */
  REMOVE_COMPLETE_UPTO, /* the complete checkpoints up to `after` */
} removal_mode_t;

typedef struct removal {
  const char *root;
  removal_mode_t mode;
  int64_t after, keep; /* keep: a step folder to leave (-1: none) */
  int removed;
  int left;              /* REMOVE_TMP: step-N.tmp entries that are no save's, left */
  char left_why[512];    /* the first one's */
  fsdpc_status_t failed; /* pruning: the first removal that failed (the others are tried) */
  char why[512];
} removal_t;

static fsdpc_status_t remove_step(void *ctx, const char *name, int64_t s, ckpt_step_kind_t kind) {
  removal_t *r = ctx;
  bool take = r->mode == REMOVE_TMP     ? kind == CKPT_STEP_TMP
              : r->mode == REMOVE_AFTER ? kind != CKPT_STEP_TMP && s > r->after && s != r->keep
                                        : kind == CKPT_STEP_COMPLETE && s <= r->after;
  if (!take) return STATUS_OK;
  if (r->mode == REMOVE_TMP) { /* a save's (marked, its writer dead) or a link, never more */
    char path[PATH_LEN];
    bool foreign;
    FSDPC_TRY(no_save(r->root, name, path, sizeof path, &foreign));
    if (foreign) {
      if (r->left++ == 0)
        snprintf(r->left_why, sizeof r->left_why,
                 "%.300s holds no %s mark, so it is no save's (a save marks its folder): left "
                 "as it is",
                 path, FILE_TEMP_MARK);
      return STATUS_OK;
    }
  }
  fsdpc_status_t st = remove_entry(r->root, name);
  if (st != STATUS_OK && r->mode == REMOVE_COMPLETE_UPTO) {
    if (r->failed == STATUS_OK) snprintf(r->why, sizeof r->why, "%s", err_detail());
    if (r->failed == STATUS_OK) r->failed = st;
    return STATUS_OK;
  }
  FSDPC_TRY(st);
  r->removed++;
  return STATUS_OK;
}

fsdpc_status_t ckpt_remove_unfinished(const char *root, int *removed, int *left, char *why,
                                      size_t why_size) {
  ARG_NONNULL(root);
  if (left) *left = 0;
  if (why && why_size) why[0] = 0;
  removal_t r = {.root = root, .mode = REMOVE_TMP, .keep = -1};
  fsdpc_status_t st = ckpt_scan_steps(root, remove_step, &r);
  int kept = r.left;
  char first[512];
  snprintf(first, sizeof first, "%s", r.left_why);
  if (st == STATUS_OK) remove_half_removed(root, &r.removed, &kept, first, sizeof first);
  if (left) *left = kept;
  if (why && why_size) snprintf(why, why_size, "%s", first);
  char journal[PATH_LEN]; /* a rollback journal's write a kill cut short */
  if (st == STATUS_OK &&
      file_join(journal, sizeof journal, root, CKPT_ROLLBACK_JOURNAL) == STATUS_OK)
    file_remove_stale_temps(journal, NULL);
  if (removed) *removed = r.removed;
  return st;
}

fsdpc_status_t ckpt_restore_replaced(const char *root, int *restored, int *removed) {
  ARG_NONNULL(root);
  if (restored) *restored = 0;
  if (removed) *removed = 0;
  DIR *d = opendir(root);
  if (d == NULL) return STATUS_OK;
  fsdpc_status_t st = STATUS_OK;
  struct dirent *e;
  while (st == STATUS_OK && (e = readdir(d)) != NULL) {
    long long s, pid;
    char canon[96], tail;
    if (sscanf(e->d_name, "step-%lld.replaced-%lld%c", &s, &pid, &tail) != 2 || s < 0 || pid < 0)
      continue;
    snprintf(canon, sizeof canon, "step-%08lld.replaced-%lld", s, pid);
    if (strcmp(canon, e->d_name) != 0) continue; /* only the names a save gives */
    char aside[PATH_LEN], dir[PATH_LEN], state[PATH_LEN + 32], name[32];
    snprintf(name, sizeof name, "step-%08lld", s);
    st = file_join(aside, sizeof aside, root, e->d_name);
    if (st == STATUS_OK) st = file_join(dir, sizeof dir, root, name);
    if (st != STATUS_OK) break;
    struct stat sb;
    if (lstat(dir, &sb) != 0 && errno == ENOENT) {
      if (rename(aside, dir) != 0)
        st = err_set(STATUS_EIO, "checkpoint: cannot put %s back as %s: %s", aside, dir,
                     strerror(errno));
      else if (restored)
        (*restored)++;
      continue;
    }
    st = file_join(state, sizeof state, dir, "train_state.json");
    if (st == STATUS_OK && S_ISDIR(sb.st_mode) && access(state, F_OK) == 0) {
      if (!file_remove_tree(aside))
        st = err_set(STATUS_EIO, "checkpoint: cannot remove all of %s: %s", aside, strerror(errno));
      else if (removed)
        (*removed)++;
    }
  }
  closedir(d);
  return st;
}

fsdpc_status_t ckpt_remove_newer(const char *root, int64_t after, int64_t keep, int *removed) {
  ARG_NONNULL(root);
  removal_t r = {.root = root, .mode = REMOVE_AFTER, .after = after, .keep = keep};
  fsdpc_status_t st = ckpt_scan_steps(root, remove_step, &r);
  if (removed) *removed = r.removed;
  return st;
}

fsdpc_status_t ckpt_latest(const char *root, char *out, size_t size, bool *found, char *skipped,
                           size_t skipped_size) {
  ARG_NONNULL(root);
  ARG_NONNULL(out);
  ARG_NONNULL(found);
  if (skipped == NULL) skipped_size = 0;
  int64_t *steps, partial;
  int n;
  bool tmp;
  FSDPC_TRY(list_steps(root, &steps, &n, &partial, &tmp));
  *found = n > 0;
  if (n > 0) ckpt_step_dir(root, steps[n - 1], out, size);
  if (skipped_size > 0) skipped[0] = 0;
  if (skipped_size > 0 && partial >= 0 && (n == 0 || partial > steps[n - 1])) {
    char dir[PATH_LEN];
    ckpt_step_dir(root, partial, dir, sizeof dir);
    snprintf(skipped, skipped_size, "%s%s (%s)", dir, tmp ? ".tmp" : "",
             tmp ? "an unfinished folder: never read as a checkpoint"
                 : "no train_state.json: not a complete checkpoint");
  }
  free(steps);
  return STATUS_OK;
}

fsdpc_status_t ckpt_latest_before(const char *root, int64_t before, char *out, size_t size,
                                  bool *found) {
  ARG_NONNULL(root);
  ARG_NONNULL(out);
  ARG_NONNULL(found);
  int64_t *steps, partial;
  int n;
  bool tmp;
  FSDPC_TRY(list_steps(root, &steps, &n, &partial, &tmp));
  int k = n - 1;
  while (k >= 0 && steps[k] >= before) k--;
  *found = k >= 0;
  if (k >= 0) ckpt_step_dir(root, steps[k], out, size);
  free(steps);
  return STATUS_OK;
}

fsdpc_status_t ckpt_prune(const char *root, int keep) {
  ARG_NONNULL(root);
  if (keep <= 0) return STATUS_OK;
  int64_t *steps, partial;
  int n;
  bool tmp;
  FSDPC_TRY(list_steps(root, &steps, &n, &partial, &tmp));
  removal_t r = {
      .root = root, .mode = REMOVE_COMPLETE_UPTO, .after = n > keep ? steps[n - keep - 1] : -1};
  free(steps);
  fsdpc_status_t st = r.after < 0 ? STATUS_OK : ckpt_scan_steps(root, remove_step, &r);
  if (st == STATUS_OK && r.failed != STATUS_OK) st = err_set(r.failed, "%s", r.why);
  return st;
}

/* ---- a rollback's journal ---- */

fsdpc_status_t ckpt_rollback_begin(const char *root, int64_t after, const char *run,
                                   const char *own_file) {
  ARG_NONNULL(root);
  ARG_NONNULL(run);
  char path[PATH_LEN];
  FSDPC_TRY(file_join(path, sizeof path, root, CKPT_ROLLBACK_JOURNAL));
  cJSON *o = cJSON_CreateObject();
  char *text = NULL;
  if (o != NULL && cJSON_AddNumberToObject(o, "after", (double)after) &&
      cJSON_AddStringToObject(o, "run", run) &&
      cJSON_AddStringToObject(o, "own_file", own_file ? own_file : ""))
    text = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  if (text == NULL) return err_set(STATUS_ENOMEM, "checkpoint: out of host memory");
  fsdpc_status_t st = file_replace_text(path, text); /* whole or not at all, synced */
  free(text);
  return st;
}

fsdpc_status_t ckpt_rollback_end(const char *root) {
  ARG_NONNULL(root);
  char path[PATH_LEN];
  FSDPC_TRY(file_join(path, sizeof path, root, CKPT_ROLLBACK_JOURNAL));
  if (unlink(path) != 0 && errno != ENOENT)
    return err_set(STATUS_EIO, "checkpoint: cannot remove %s: %s", path, strerror(errno));
  return STATUS_OK;
}

/* The run id step folder name under root records in saved_under, into run ("" when none). */
static void run_of(const char *root, const char *name, char *run, size_t size) {
  char dir[PATH_LEN], *text = NULL;
  run[0] = 0;
  if (file_join(dir, sizeof dir, root, name) != STATUS_OK ||
      ckpt_state_text(dir, &text) != STATUS_OK || text == NULL)
    return;
  cJSON *o = cJSON_Parse(text);
  free(text);
  const cJSON *r =
      cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "saved_under"), "run");
  if (cJSON_IsString(r)) snprintf(run, size, "%s", r->valuestring);
  cJSON_Delete(o);
}

typedef struct settle {
  const char *root, *run;
  int64_t after;
  bool committed; /* first pass: a folder of the run's */
  int removed;
} settle_t;

static fsdpc_status_t find_run(void *ctx, const char *name, int64_t s, ckpt_step_kind_t kind) {
  settle_t *t = ctx;
  if (s <= t->after || kind != CKPT_STEP_COMPLETE || t->committed) return STATUS_OK;
  char run[64];
  run_of(t->root, name, run, sizeof run);
  t->committed = strcmp(run, t->run) == 0;
  return STATUS_OK;
}

static fsdpc_status_t remove_replaced(void *ctx, const char *name, int64_t s,
                                      ckpt_step_kind_t kind) {
  settle_t *t = ctx;
  if (s <= t->after || kind == CKPT_STEP_TMP) return STATUS_OK;
  char run[64];
  run_of(t->root, name, run, sizeof run);
  if (kind == CKPT_STEP_COMPLETE && strcmp(run, t->run) == 0) return STATUS_OK; /* the run's */
  FSDPC_TRY(remove_entry(t->root, name));
  t->removed++;
  return STATUS_OK;
}

fsdpc_status_t ckpt_rollback_settle(const char *root, bool *found, bool *finished, int *replaced) {
  ARG_NONNULL(root);
  *found = *finished = false;
  *replaced = 0;
  char path[PATH_LEN], *text = NULL;
  FSDPC_TRY(file_join(path, sizeof path, root, CKPT_ROLLBACK_JOURNAL));
  if (access(path, F_OK) != 0) return STATUS_OK;
  *found = true;
  FSDPC_TRY(file_read_text(path, 1 << 16, &text));
  cJSON *o = cJSON_Parse(text);
  free(text);
  const cJSON *after = cJSON_GetObjectItemCaseSensitive(o, "after");
  const cJSON *run = cJSON_GetObjectItemCaseSensitive(o, "run");
  const cJSON *own = cJSON_GetObjectItemCaseSensitive(o, "own_file");
  fsdpc_status_t st = STATUS_OK;
  if (!cJSON_IsNumber(after) || !cJSON_IsString(run) || run->valuestring[0] == 0)
    st = err_set(STATUS_EFORMAT,
                 "%s: not the journal of a rollback (remove it if no job uses this folder)", path);
  settle_t t = {root, st == STATUS_OK ? run->valuestring : "", 0, false, 0};
  if (st == STATUS_OK) t.after = (int64_t)after->valuedouble;
  if (st == STATUS_OK) st = ckpt_scan_steps(root, find_run, &t);
  if (st == STATUS_OK && t.committed) st = ckpt_scan_steps(root, remove_replaced, &t);
  /* its own file: a finished rollback's takes the name it stands in for (NAME.tmp-XXXXXX, as
   * file_create_temp names it, is NAME's), an undone one's goes */
  if (st == STATUS_OK && cJSON_IsString(own) && own->valuestring[0]) {
    const char *o = own->valuestring, *tmp = strstr(o, ".tmp-");
    char target[PATH_LEN];
    bool named = tmp != NULL && strlen(tmp) == 11 && (size_t)(tmp - o) < sizeof target;
    if (named) snprintf(target, sizeof target, "%.*s", (int)(tmp - o), o);
    if (!(t.committed && named && rename(o, target) == 0)) unlink(o);
  }
  cJSON_Delete(o);
  if (st == STATUS_OK) st = ckpt_rollback_end(root);
  *finished = t.committed;
  *replaced = t.removed;
  return st;
}
