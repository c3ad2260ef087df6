/* The metrics file of a run (metrics_impl.h). */
#include <cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "core/file.h"
#include "mesh/world.h"
#include "train/metrics_impl.h"
#include "train/ops_impl.h"

static fsdpc_status_t busy_error(const char *path) {
  return err_set(STATUS_EINVAL,
                 "--metrics (or log.metrics) '%s': another running job writes it (it holds the "
                 "file's lock); give this run another metrics file, or wait for that job to end",
                 path);
}

/* Every rank learns whether rank 0 could write the metrics file (err: its errno, or 0).
 * Collective. */
fsdpc_status_t train_metrics_agree(const char *path, int err) {
  fsdpc_status_t st = STATUS_OK;
  if (err == EWOULDBLOCK) /* a job that took the lock after this one's check */
    st = busy_error(path);
  else if (err)
    st = err_set(STATUS_EIO, "cannot write the metrics file '%s': %s", path, strerror(err));
  return pg_agree(world_pg(), st);
}

/* Writes line o to out with patch's fields (may be NULL) put in; false when it could not. */
static bool put_patched(FILE *out, cJSON *o, const cJSON *patch) {
  const cJSON *it;
  cJSON_ArrayForEach(it, patch) {
    cJSON_DeleteItemFromObjectCaseSensitive(o, it->string);
    cJSON_AddItemToObject(o, it->string, cJSON_Duplicate(it, true));
  }
  char *text = cJSON_PrintUnformatted(o);
  bool ok = text != NULL && fprintf(out, "%s\n", text) >= 0;
  free(text);
  return ok;
}

/* A lock held against another job (flock, exclusive): false only when another job holds it
 * (errno EWOULDBLOCK); a file system without locks (ENOLCK, EBADF) lets the file be written
 * unlocked, as checkpoint.dir's lock does. Another job's check (train_metrics_check_free's
 * probe) is waited out (file_lock_exclusive). */
static bool take(int fd) {
  if (file_lock_exclusive(fd) != EWOULDBLOCK) return true;
  errno = EWOULDBLOCK;
  return false;
}

/* The file now at path (made empty when there is none) opened and locked while this run
 * replaces it (another job's check then finds one of the two locked, whichever it opens): its
 * descriptor, -1 when it cannot be held, -2 (errno EWOULDBLOCK) when another job holds it. The file
 * locked is the one that has the name once locked: another job may rename its own over it between
 * the open and the lock, then let it go. */
static int hold_current(const char *path) {
  for (int tries = 0; tries < 100; tries++) {
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) fd = open(path, O_RDONLY | O_CLOEXEC);
    /* none yet: made empty, exclusively, and held like any (two jobs starting together would
     * each rename a file of their own onto the name, one writing to a file that lost it) */
    if (fd < 0 && errno == ENOENT) {
      fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd < 0 && errno == EEXIST) continue; /* made meanwhile: held by its maker */
    }
    if (fd < 0) return -1;
    if (!take(fd)) {
      close(fd);
      errno = EWOULDBLOCK;
      return -2;
    }
    if (file_fd_is(fd, path)) return fd;
    close(fd); /* replaced (or removed) meanwhile: the next try opens what has the name */
  }
  return -1;
}

/* f, new and not yet renamed into place, locked first (NULL, errno set, when it cannot be). */
static FILE *locked(FILE *f) {
  if (f != NULL && !take(fileno(f))) {
    fclose(f);
    errno = EWOULDBLOCK;
    return NULL;
  }
  return f;
}

fsdpc_status_t train_metrics_check_free(const char *path, bool dry_run) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return STATUS_OK; /* none yet (other reasons: named by the other checks) */
  bool busy = file_lock_held(fd);
  close(fd);
  if (busy && dry_run) {
    fprintf(stderr,
            "%s: note: --metrics (or log.metrics) '%s': another running job writes it; this "
            "plan's run would be refused until that job ends\n",
            train_prog(), path);
    return STATUS_OK;
  }
  return busy ? busy_error(path) : STATUS_OK;
}

/* Opens the metrics file (rank 0) for a run starting after step start: a fresh run starts it
 * anew; a resumed run keeps the lines up to its step (later ones belong to the run it
 * replaces), rewritten through a fresh file beside it and a rename, and appends. With defer
 * (not NULL: a checkpoint.overwrite rollback, whose newer checkpoints stay until its first save
 * commits) the fresh file is not renamed: its name goes into defer, the run appends to it, and
 * metrics_settle renames it once that save commits. The fields of patch (may be NULL) go into
 * step start's line (the evaluation a stop skipped); saved (may be NULL), the line its
 * checkpoint records, is written when the file lacks it (the run was killed after the save).
 * The file returned is locked before it takes the name. NULL with errno set on failure. */
static FILE *open_locked(const char *path, int64_t start, const cJSON *patch, const cJSON *saved,
                         char *defer, size_t defer_size) {
  if (start == 0 && defer == NULL) {
    FILE *old = fopen(path, "r");
    long lines = 0;
    for (int c; old != NULL && (c = fgetc(old)) != EOF;) lines += c == '\n';
    if (old != NULL) fclose(old);
    if (lines > 0) /* a fresh run's file is its own: another run's lines are not kept */
      fprintf(stderr,
              "%s: note: the metrics file '%s' held %ld line%s of an earlier run; this run "
              "starts at step 0 and replaces %s\n",
              train_prog(), path, lines, lines == 1 ? "" : "s", lines == 1 ? "it" : "them");
    /* a fresh file renamed over any there, not that file emptied: a hard link to it (a
     * snapshot, a backup) keeps what it held */
    char tmp[PLAN_PATH_MAX + 16];
    FILE *fresh = NULL;
    if (file_create_temp(path, tmp, sizeof tmp, &fresh) != STATUS_OK) {
      errno = EIO;
      return NULL;
    }
    if ((fresh = locked(fresh)) == NULL || rename(tmp, path) != 0) {
      int e = errno;
      if (fresh != NULL) fclose(fresh);
      unlink(tmp);
      errno = e;
      return NULL;
    }
    return fresh;
  }
  FILE *in = NULL;
  if (start > 0 && (in = fopen(path, "r")) == NULL) {
    if (errno != ENOENT) return NULL;
    if (defer == NULL) return locked(fopen(path, "w"));
  }
  char tmp[PLAN_PATH_MAX + 16];
  FILE *out = NULL;
  if (file_create_temp(path, tmp, sizeof tmp, &out) != STATUS_OK) {
    if (in != NULL) fclose(in);
    errno = EIO;
    return NULL;
  }
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  double last = 0;   /* the last step kept */
  int64_t junk = 0;  /* lines that are no step's (a last line cut short by a kill) */
  bool have = false; /* step start's line */
  int64_t read = 0;  /* lines: a new or empty file starts after step start */
  while (in != NULL && out != NULL && (len = getline(&line, &cap, in)) > 0) {
    read++;
    cJSON *o = cJSON_Parse(line);
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(o, "step");
    if (!cJSON_IsNumber(step)) {
      junk++;
    } else if (step->valuedouble == (double)start && patch != NULL) { /* its fields added */
      if (!put_patched(out, o, patch)) {                              /* the file would lose it */
        fclose(out);
        out = NULL;
      }
      have = true;
    } else if (step->valuedouble <= (double)start) {
      fputs(line, out);
      if (line[len - 1] != '\n') fputc('\n', out); /* whole, but its newline lost */
      have = have || step->valuedouble == (double)start;
    }
    if (cJSON_IsNumber(step) && step->valuedouble <= (double)start)
      last = step->valuedouble > last ? step->valuedouble : last;
    cJSON_Delete(o);
  }
  free(line);
  /* the step's line, lost by a kill between its save and its line, from the checkpoint */
  const cJSON *ss = cJSON_GetObjectItemCaseSensitive(saved, "step");
  bool restore =
      read > 0 && out != NULL && !have && cJSON_IsNumber(ss) && ss->valuedouble == (double)start;
  if (restore) {
    cJSON *o = cJSON_Duplicate(saved, true);
    if (o == NULL || !put_patched(out, o, patch)) {
      fclose(out);
      out = NULL;
    }
    cJSON_Delete(o);
  }
  if (junk > 0)
    fprintf(stderr,
            "%s: warning: the metrics file '%s' had %lld line%s that %s no step's metrics (a "
            "line cut short when a run was killed, or another program's); left out\n",
            train_prog(), path, (long long)junk, junk == 1 ? "" : "s", junk == 1 ? "is" : "are");
  /* a run stopped on a metrics line it could not write saved that step first */
  int64_t upto = restore ? start - 1 : start;
  if (last > 0 && last + 1 == (double)upto)
    fprintf(stderr,
            "%s: warning: the metrics file '%s' ends at step %.0f; the line of step %lld is "
            "missing (never written, or cut from the file since)\n",
            train_prog(), path, last, (long long)upto);
  else if (last > 0 && last < (double)upto)
    fprintf(stderr,
            "%s: warning: the metrics file '%s' ends at step %.0f; the lines of steps %.0f to "
            "%lld are missing (never written, or cut from the file since)\n",
            train_prog(), path, last, last + 1, (long long)upto);
  if (restore && out != NULL)
    fprintf(stderr,
            "%s: note: the metrics file '%s' had no line for step %lld; written from the "
            "checkpoint's record\n",
            train_prog(), path, (long long)start);
  bool ok = out != NULL && (in == NULL || !ferror(in)) && fflush(out) == 0 && !ferror(out);
  if (in != NULL) fclose(in);
  /* locked before it takes the name, and appended to through a new stream on the same open
   * file (its lock kept; the caller sets its buffering before any write) */
  int fd = ok && (out = locked(out)) != NULL ? dup(fileno(out)) : -1;
  if (out != NULL && fclose(out) != 0) ok = false;
  FILE *f = ok && fd >= 0 ? fdopen(fd, "a") : NULL;
  if (f == NULL || (defer == NULL && rename(tmp, path) != 0)) {
    int e = errno;
    if (f != NULL)
      fclose(f);
    else if (fd >= 0)
      close(fd);
    unlink(tmp);
    errno = e ? e : EIO;
    return NULL;
  }
  if (defer != NULL) snprintf(defer, defer_size, "%s", tmp);
  return f;
}

FILE *train_metrics_open(const char *path, int64_t start, const cJSON *patch, const cJSON *saved,
                         char *defer, size_t defer_size, int *guard) {
  if (guard != NULL) *guard = -1;
  int hold = hold_current(path); /* until the new file, locked, has its name */
  if (hold == -2) return NULL;
  FILE *f = open_locked(path, start, patch, saved, defer, defer_size);
  int e = errno;
  if (f != NULL && defer != NULL && guard != NULL)
    *guard = hold; /* the old file keeps the name until the rollback settles */
  else if (hold >= 0)
    close(hold);
  errno = e;
  return f;
}

train_metrics_seen_t train_metrics_scan(const char *path, int64_t start) {
  train_metrics_seen_t seen = {0};
  FILE *in = fopen(path, "r");
  if (in == NULL) return seen;
  char *line = NULL;
  size_t cap = 0;
  while (getline(&line, &cap, in) > 0) {
    seen.file = true;
    cJSON *o = cJSON_Parse(line);
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(o, "step");
    double s = cJSON_IsNumber(step) ? step->valuedouble : 0;
    seen.last = s > seen.last ? s : seen.last;
    if (cJSON_IsNumber(step) && s == (double)start) {
      seen.line = true;
      seen.eval = cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(o, "eval_loss"));
    }
    if (s > (double)start) {
      seen.first_after = seen.first_after == 0 || s < seen.first_after ? s : seen.first_after;
      seen.last_after = s > seen.last_after ? s : seen.last_after;
    }
    cJSON_Delete(o);
  }
  free(line);
  fclose(in);
  return seen;
}

fsdpc_status_t train_check_metrics_branch(const fsdpc_plan_t *p, const char *metrics,
                                          const char *resumed, int64_t start) {
  if (metrics == NULL || !metrics[0] || resumed == NULL || !resumed[0] || start >= p->steps)
    return STATUS_OK;
  char parent[PLAN_PATH_MAX + 8];
  char *real = realpath(resumed, NULL); /* a link to one of its own: the folder it lies in */
  file_parent_of(real ? real : resumed, parent, sizeof parent);
  free(real);
  /* (no checkpoint.dir: a branch that saves nowhere) */
  char *dir = p->ckpt_dir[0] ? realpath(p->ckpt_dir, NULL) : NULL, *at = realpath(parent, NULL);
  bool own = dir != NULL && at != NULL && strcmp(dir, at) == 0;
  free(dir);
  free(at);
  if (own) return STATUS_OK; /* one of its own checkpoints */
  train_metrics_seen_t seen = train_metrics_scan(metrics, start);
  double first = seen.first_after, last = seen.last_after; /* (none: no file yet) */
  if (last == 0) return STATUS_OK;
  return err_set(STATUS_EINVAL,
                 "--metrics (or log.metrics) '%s' holds the lines of steps %.0f to %.0f, after "
                 "step %lld, where this run resumes from '%s', %s: this run would replace "
                 "them, and they belong to the run it branches from (or to an earlier attempt "
                 "of this one); give this run a metrics file of its own, or remove those lines",
                 metrics, first, last, (long long)start, resumed,
                 p->ckpt_dir[0] ? "outside its checkpoint.dir" : "without a checkpoint.dir");
}

/* A metrics file given again holds metrics lines (a JSON object with a number "step"), at
 * least one in its first 64 KiB (a line cut short by a kill counts, as its start shows), or
 * nothing: the run replaces its lines, and another file's content (a mistyped name) is not a
 * run's to replace. Local. */
fsdpc_status_t train_metrics_check_content(const char *metrics) {
  enum { HEAD = 65536 };
  FILE *f = fopen(metrics, "r");
  if (f == NULL) return STATUS_OK; /* absent (or unreadable: refused as it is written) */
  char *head = malloc(HEAD);
  size_t n = head ? fread(head, 1, HEAD - 1, f) : 0;
  fclose(f);
  if (head == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  head[n] = 0;
  long line = 0, first_other = 0;
  for (char *l = head, *next; l < head + n; l = next) {
    next = strchr(l, '\n');
    next = next ? next + 1 : head + n;
    line++;
    char keep = *next;
    *next = 0; /* (the line alone, its newline kept) */
    cJSON *o = cJSON_Parse(l);
    bool step = cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(o, "step")) ||
                strncmp(l, "{\"step\":", 8) == 0;
    cJSON_Delete(o);
    if (first_other == 0 && l[strspn(l, " \t\r\n")] != 0) first_other = line;
    *next = keep;
    if (step) {
      free(head);
      return STATUS_OK;
    }
  }
  free(head);
  if (first_other == 0) return STATUS_OK;
  return err_set(STATUS_EINVAL,
                 "--metrics (or log.metrics) '%s' holds no metrics line (line %ld is not a JSON "
                 "object with a \"step\"): this run would replace a file that is not a run's "
                 "metrics; name another file, or remove this one",
                 metrics, first_other);
}
