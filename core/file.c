#include "core/file.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/args_impl.h"

fsdpc_status_t file_open_regular(const char *path, const char *what, FILE **out) {
  ARG_NONNULL(path);
  ARG_NONNULL(out);
  *out = NULL;
  /* O_NONBLOCK: opening a FIFO with no writer returns at once instead of waiting for one */
  const char *sep = what ? " " : "";
  what = what ? what : "";
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return err_set(STATUS_EIO, "%s%s%s: %s", what, sep, path, strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    const char *kind = S_ISDIR(sb.st_mode)    ? "a folder"
                       : S_ISFIFO(sb.st_mode) ? "a FIFO"
                       : S_ISSOCK(sb.st_mode) ? "a socket"
                                              : "a device or special file";
    close(fd);
    return err_set(STATUS_EIO, "%s%s%s: is %s, not a regular file", what, sep, path, kind);
  }
  int flags = fcntl(fd, F_GETFL);
  FILE *f = NULL;
  if (flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0 || (f = fdopen(fd, "rb")) == NULL) {
    int e = errno;
    close(fd);
    return err_set(STATUS_EIO, "%s%s%s: %s", what, sep, path, strerror(e));
  }
  *out = f;
  return STATUS_OK;
}

fsdpc_status_t file_read_text(const char *path, size_t max_bytes, char **out) {
  ARG_NONNULL(path);
  ARG_NONNULL(out);
  *out = NULL;
  FILE *f;
  FSDPC_TRY(file_open_regular(path, NULL, &f));
  fsdpc_status_t st = STATUS_OK;
  char *buf = NULL;
  long n = -1;
  if (fseek(f, 0, SEEK_END) == 0) n = ftell(f);
  if (n < 0 || fseek(f, 0, SEEK_SET) != 0)
    st = err_set(STATUS_EIO, "%s: cannot read: %s", path, strerror(errno));
  else if ((size_t)n > max_bytes)
    st = err_set(STATUS_EFORMAT, "%s: %ld bytes, more than the %zu this file may have", path, n,
                 max_bytes);
  else if ((buf = malloc((size_t)n + 1)) == NULL)
    st = err_set(STATUS_ENOMEM, "%s: out of host memory", path);
  else if (fread(buf, 1, (size_t)n, f) != (size_t)n)
    st = err_set(STATUS_EIO, "%s: short read", path);
  fclose(f);
  if (st != STATUS_OK) {
    free(buf);
    return st;
  }
  buf[n] = '\0';
  *out = buf;
  return STATUS_OK;
}

fsdpc_status_t file_write_text(const char *path, const char *text) {
  ARG_NONNULL(path);
  ARG_NONNULL(text);
  FILE *f = fopen(path, "wb");
  fsdpc_status_t st = STATUS_OK;
  if (f == NULL || fputs(text, f) < 0 || fputc('\n', f) == EOF || fflush(f) != 0 ||
      fsync(fileno(f)) != 0)
    st = err_set(STATUS_EIO, "%s: cannot write: %s", path, strerror(errno));
  if (f && fclose(f) != 0 && st == STATUS_OK) st = err_set(STATUS_EIO, "%s: close failed", path);
  return st;
}

#define DIRS_PATH_MAX 4096

static fsdpc_status_t dirs_error(const char *what, const char *path, const char *reason) {
  return err_set(STATUS_EIO, "%s%s'%s': %s", what ? what : "", what ? " " : "", path, reason);
}

/* Whether the existing entry at path is a folder this process may write into. */
static fsdpc_status_t writable_folder(const char *what, const char *path, const char *shown) {
  struct stat sb;
  if (stat(path, &sb) != 0) return dirs_error(what, shown, strerror(errno));
  if (!S_ISDIR(sb.st_mode)) {
    char why[DIRS_PATH_MAX + 40];
    snprintf(why, sizeof why, "'%s' is not a folder", path);
    return dirs_error(what, shown, why);
  }
  if (access(path, W_OK | X_OK) != 0) {
    char why[DIRS_PATH_MAX + 80];
    snprintf(why, sizeof why, "cannot write into '%s': %s", path, strerror(errno));
    return dirs_error(what, shown, why);
  }
  return STATUS_OK;
}

fsdpc_status_t file_make_dirs(const char *path, const char *what) {
  return file_make_dirs_noted(path, what, NULL, NULL, 0);
}

fsdpc_status_t file_make_dirs_noted(const char *path, const char *what, size_t *made, int *n_made,
                                    int max) {
  ARG_NONNULL(path);
  if (n_made) *n_made = 0;
  char buf[DIRS_PATH_MAX];
  size_t n = strlen(path);
  if (n == 0 || n >= sizeof buf) return dirs_error(what, path, "empty or too long a path");
  memcpy(buf, path, n + 1);
  for (size_t i = 1; i <= n; i++) {
    if (buf[i] != '/' && buf[i] != 0) continue;
    char c = buf[i];
    buf[i] = 0;
    struct stat sb;
    char why[DIRS_PATH_MAX + 80];
    if (mkdir(buf, 0755) == 0) {
      if (made && n_made && *n_made < max) made[(*n_made)++] = i;
      buf[i] = c;
      continue;
    }
    if (errno != EEXIST) {
      snprintf(why, sizeof why, "cannot create '%s': %s", buf, strerror(errno));
      return dirs_error(what, path, why);
    }
    if (stat(buf, &sb) == 0 && !S_ISDIR(sb.st_mode)) {
      snprintf(why, sizeof why, "'%s' is not a folder", buf);
      return dirs_error(what, path, why);
    }
    buf[i] = c;
  }
  return writable_folder(what, path, path);
}

fsdpc_status_t file_check_dirs(const char *path, const char *what) {
  ARG_NONNULL(path);
  char buf[DIRS_PATH_MAX];
  size_t n = strlen(path);
  if (n == 0 || n >= sizeof buf) return dirs_error(what, path, "empty or too long a path");
  memcpy(buf, path, n + 1);
  for (;;) { /* up to the nearest entry that exists */
    struct stat sb;
    if (stat(buf, &sb) == 0) {
      FSDPC_TRY(writable_folder(what, buf, path));
      if (strcmp(buf, path) == 0) return STATUS_OK;
      /* an ancestor: a folder made in it, then removed, finds what permissions miss */
      char probe[DIRS_PATH_MAX + 32], why[DIRS_PATH_MAX + 80];
      snprintf(probe, sizeof probe, "%s/.fsdpc-probe-XXXXXX", buf);
      if (mkdtemp(probe) == NULL) {
        snprintf(why, sizeof why, "cannot create a folder in '%s': %s", buf, strerror(errno));
        return dirs_error(what, path, why);
      }
      rmdir(probe);
      return STATUS_OK;
    }
    if ((errno != ENOENT && errno != ENOTDIR) || strcmp(buf, ".") == 0 || strcmp(buf, "/") == 0) {
      char why[DIRS_PATH_MAX + 80];
      snprintf(why, sizeof why, "'%s': %s", buf, strerror(errno));
      return dirs_error(what, path, why);
    }
    char *slash = strrchr(buf, '/');
    while (slash != NULL && slash > buf && slash[1] == 0) { /* trailing slashes */
      *slash = 0;
      slash = strrchr(buf, '/');
    }
    if (slash == NULL) {
      snprintf(buf, sizeof buf, ".");
    } else if (slash == buf) {
      buf[1] = 0; /* "/" */
    } else {
      *slash = 0;
    }
  }
}

bool file_is_dir(const char *path) {
  struct stat sb;
  return path != NULL && stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* Empties the folder open at fd (owned: closed here), then nothing else. */
/* Removes everything in folder fd (closed here); *err keeps the first failure's errno (the
 * cause: a file that cannot go, not the folder left not empty by it). */
static bool remove_entries(int fd, int *err) {
  DIR *d = fdopendir(fd);
  if (d == NULL) {
    if (*err == 0) *err = errno;
    close(fd);
    return false;
  }
  bool ok = true;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    const char *name = e->d_name;
    if (strcmp(name, ".") == 0 || strcmp(name, "..") == 0) continue;
    if (unlinkat(dirfd(d), name, 0) == 0) continue; /* a file or a link: never its target */
    int why = errno; /* EISDIR (or EPERM, as Linux gives for folders too) when a folder */
    int sub = openat(dirfd(d), name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (sub < 0) {
      if (*err == 0) *err = why;
      ok = false;
      continue;
    }
    ok &= remove_entries(sub, err);
    if (unlinkat(dirfd(d), name, AT_REMOVEDIR) != 0) {
      if (*err == 0) *err = errno;
      ok = false;
    }
  }
  closedir(d);
  return ok;
}

bool file_remove_tree(const char *path) {
  struct stat sb;
  if (path == NULL) return false;
  if (lstat(path, &sb) != 0) return errno == ENOENT;
  if (!S_ISDIR(sb.st_mode)) return unlink(path) == 0; /* a link goes, its target stays */
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return unlink(path) == 0; /* replaced by a link since the lstat */
  int err = 0;
  bool ok = remove_entries(fd, &err);
  if (rmdir(path) == 0 && ok) return true;
  if (err != 0) errno = err; /* the cause, for the caller's message */
  return false;
}

/* path's temporary sibling, PATH.tmp-XXXXXX (a folder's trailing slashes left out). */
static fsdpc_status_t temp_name(const char *path, char *tmp, size_t size) {
  int len = (int)strnlen(path, DIRS_PATH_MAX + 1);
  while (len > 1 && path[len - 1] == '/') len--;
  int n = snprintf(tmp, size, "%.*s.tmp-XXXXXX", len, path);
  if (n < 0 || (size_t)n >= size || path[0] == 0)
    return err_set(STATUS_EINVAL, "'%s': empty or too long a path", path);
  return STATUS_OK;
}

/* The temporary folders this process is writing, each with the descriptor of its mark
 * (FILE_TEMP_MARK inside it) held under an exclusive flock: another process removes a folder
 * of that name only when it can take that lock, that is when the writer has died. */
#define TEMP_HELD 16
static struct {
  char path[DIRS_PATH_MAX + 16];
  int fd;
} held[TEMP_HELD];
static pthread_mutex_t held_lock = PTHREAD_MUTEX_INITIALIZER;

/* The mark's descriptor of folder tmp, removed from the table; -1 when not held. */
static int held_take(const char *tmp) {
  int fd = -1;
  pthread_mutex_lock(&held_lock);
  for (int i = 0; i < TEMP_HELD && fd < 0; i++)
    if (held[i].path[0] && strcmp(held[i].path, tmp) == 0) {
      fd = held[i].fd;
      held[i].path[0] = 0;
    }
  pthread_mutex_unlock(&held_lock);
  return fd;
}

/* Marks the fresh folder tmp as being written (FILE_TEMP_MARK, locked and held); on failure
 * tmp is removed. */
static fsdpc_status_t mark_and_hold(const char *tmp) {
  char mark[DIRS_PATH_MAX + 64], unnamed[DIRS_PATH_MAX + 64];
  snprintf(mark, sizeof mark, "%s/%s", tmp, FILE_TEMP_MARK);
  snprintf(unnamed, sizeof unnamed, "%s/%s.new", tmp, FILE_TEMP_MARK);
  /* locked under another name, then named: no other process ever finds the mark unlocked
   * while this one writes */
  int fd = open(unnamed, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  int e = errno;
  /* a file system without locks (ENOLCK): marked unlocked, as checkpoint.dir's lock goes on */
  if (fd >= 0 &&
      ((flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) || rename(unnamed, mark) != 0)) {
    e = errno;
    close(fd);
    fd = -1;
  }
  pthread_mutex_lock(&held_lock);
  int slot = 0;
  while (fd >= 0 && slot < TEMP_HELD && held[slot].path[0]) slot++;
  if (fd >= 0 && slot < TEMP_HELD) {
    snprintf(held[slot].path, sizeof held[slot].path, "%s", tmp);
    held[slot].fd = fd;
  }
  pthread_mutex_unlock(&held_lock);
  if (fd < 0 || slot == TEMP_HELD) {
    if (fd >= 0) close(fd);
    file_remove_tree(tmp);
    return err_set(STATUS_EIO, "cannot mark '%s' as being written: %s", tmp,
                   fd < 0 ? strerror(e) : "too many at once");
  }
  return STATUS_OK;
}

fsdpc_status_t file_make_temp_dir(const char *path, char *tmp, size_t size) {
  ARG_NONNULL(path);
  ARG_NONNULL(tmp);
  FSDPC_TRY(temp_name(path, tmp, size));
  if (mkdtemp(tmp) == NULL)
    return err_set(STATUS_EIO, "cannot create a folder beside '%s': %s", path, strerror(errno));
  chmod(tmp, 0755); /* mkdtemp's 0700, as mkdir would have made it */
  return mark_and_hold(tmp);
}

static bool stale_temp(int dfd, const char *name, const char *const *keep);

fsdpc_status_t file_claim_temp_dir(const char *tmp) {
  ARG_NONNULL(tmp);
  struct stat sb;
  if (lstat(tmp, &sb) == 0) {
    if (!stale_temp(AT_FDCWD, tmp, NULL))
      return err_set(STATUS_EIO,
                     "'%s' exists and is not what a stopped save left (it lacks the %s mark, or "
                     "a save still writes it): remove it, or save elsewhere",
                     tmp, FILE_TEMP_MARK);
    file_remove_tree(tmp);
  }
  if (mkdir(tmp, 0755) != 0)
    return err_set(STATUS_EIO, "cannot create '%s': %s", tmp, strerror(errno));
  return mark_and_hold(tmp);
}

fsdpc_status_t file_commit_temp_dir(const char *tmp, const char *path) {
  ARG_NONNULL(tmp);
  ARG_NONNULL(path);
  /* an empty folder path names keeps its permissions: the export replaces it */
  struct stat sb;
  if (lstat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) chmod(tmp, sb.st_mode & 07777);
  /* renamed marked and locked, the mark removed after: a kill at any point leaves either the
   * marked temporary (a dead writer's, removed by the next) or the output, never a temporary
   * without its mark (which would be taken for a user's) */
  fsdpc_status_t st = STATUS_OK;
  if (rename(tmp, path) != 0) {
    st = errno == ENOTEMPTY || errno == EEXIST
             ? err_set(STATUS_EIO,
                       "'%s' was filled while this command wrote it (another command writing the "
                       "same output?): left as it is, this command's output not kept",
                       path)
             : err_set(STATUS_EIO, "rename %s -> %s: %s", tmp, path, strerror(errno));
    return st; /* tmp left, marked and held (file_discard_temp_dir removes it) */
  }
  char mark[DIRS_PATH_MAX + 64];
  snprintf(mark, sizeof mark, "%s/%s", path, FILE_TEMP_MARK);
  unlink(mark);
  int fd = held_take(tmp);
  if (fd >= 0) close(fd);
  return st;
}

void file_discard_temp_dir(const char *tmp) {
  if (tmp == NULL || tmp[0] == 0) return;
  file_remove_tree(tmp);
  int fd = held_take(tmp);
  if (fd >= 0) close(fd);
}

fsdpc_status_t file_create_temp(const char *path, char *tmp, size_t size, FILE **out) {
  ARG_NONNULL(path);
  ARG_NONNULL(tmp);
  ARG_NONNULL(out);
  *out = NULL;
  FSDPC_TRY(temp_name(path, tmp, size));
  int fd = mkstemp(tmp);
  if (fd < 0)
    return err_set(STATUS_EIO, "cannot create a file beside '%s': %s", path, strerror(errno));
  /* locked while it is written (until fclose): file_remove_stale_temps leaves it */
  flock(fd, LOCK_EX | LOCK_NB);
  mode_t mask = umask(0); /* mkstemp's 0600, as fopen would have made it */
  umask(mask);
  fchmod(fd, 0666 & ~mask);
  if ((*out = fdopen(fd, "w")) == NULL) {
    int e = errno;
    close(fd);
    unlink(tmp);
    return err_set(STATUS_EIO, "'%s': %s", tmp, strerror(e));
  }
  return STATUS_OK;
}

fsdpc_status_t file_replace_text(const char *path, const char *text) {
  ARG_NONNULL(path);
  ARG_NONNULL(text);
  char tmp[DIRS_PATH_MAX + 16];
  FILE *f;
  FSDPC_TRY(file_create_temp(path, tmp, sizeof tmp, &f));
  bool ok = fputs(text, f) >= 0 && fflush(f) == 0 && fsync(fileno(f)) == 0;
  int e = errno;
  if (fclose(f) != 0 && ok) {
    ok = false;
    e = errno;
  }
  if (ok && rename(tmp, path) != 0) {
    ok = false;
    e = errno;
  }
  if (!ok) {
    unlink(tmp);
    return err_set(STATUS_EIO, "cannot write '%s': %s", path, strerror(e));
  }
  return STATUS_OK;
}

typedef struct input {
  dev_t dev;
  ino_t ino;
  char *path, *what;
} input_t;

struct file_inputs {
  input_t *v;
  int n, cap;
};

fsdpc_status_t file_inputs_new(file_inputs_t **out) {
  ARG_NONNULL(out);
  *out = calloc(1, sizeof **out);
  return *out ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory");
}

void file_inputs_free(file_inputs_t *in) {
  if (in == NULL) return;
  for (int i = 0; i < in->n; i++) {
    free(in->v[i].path);
    free(in->v[i].what);
  }
  free(in->v);
  free(in);
}

static fsdpc_status_t add_one(file_inputs_t *in, const struct stat *sb, const char *path,
                              const char *what) {
  ARRAY_GROW(in->v, in->n, in->cap, 16, "file inputs");
  input_t *e = &in->v[in->n];
  *e = (input_t){sb->st_dev, sb->st_ino, strdup(path), strdup(what)};
  if (e->path == NULL || e->what == NULL) {
    free(e->path);
    free(e->what);
    return err_set(STATUS_ENOMEM, "out of host memory");
  }
  in->n++;
  return STATUS_OK;
}

/* Adds the files under the folder path (depth: how far down), links not followed. */
static fsdpc_status_t add_folder(file_inputs_t *in, const char *path, const char *what, int depth) {
  DIR *d = opendir(path);
  if (d == NULL) return STATUS_OK;
  fsdpc_status_t st = STATUS_OK;
  struct dirent *e;
  while (st == STATUS_OK && (e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    char sub[DIRS_PATH_MAX];
    struct stat sb;
    st = file_join(sub, sizeof sub, path, e->d_name);
    if (st != STATUS_OK || lstat(sub, &sb) != 0) continue;
    if (S_ISREG(sb.st_mode))
      st = add_one(in, &sb, sub, what);
    else if (S_ISDIR(sb.st_mode) && depth > 0)
      st = add_folder(in, sub, what, depth - 1);
  }
  closedir(d);
  return st;
}

fsdpc_status_t file_inputs_add(file_inputs_t *in, const char *path, const char *what) {
  ARG_NONNULL(in);
  ARG_NONNULL(path);
  struct stat sb;
  if (path == NULL || path[0] == 0 || stat(path, &sb) != 0) return STATUS_OK;
  if (S_ISDIR(sb.st_mode)) return add_folder(in, path, what, 4);
  return add_one(in, &sb, path, what);
}

fsdpc_status_t file_join(char *buf, size_t size, const char *dir, const char *name) {
  ARG_NONNULL(buf);
  ARG_NONNULL(dir);
  ARG_NONNULL(name);
  int n = snprintf(buf, size, "%s/%s", dir, name);
  if (n >= 0 && (size_t)n < size) return STATUS_OK;
  if (size > 0) buf[0] = 0;
  return err_set(STATUS_EINVAL, "path too long (%d bytes, at most %zu): %.200s.../%.255s", n,
                 size > 0 ? size - 1 : 0, dir, name);
}

void file_parent_of(const char *path, char *buf, size_t size) {
  if (buf == NULL || size == 0) return;
  if (path == NULL) path = "";
  snprintf(buf, size, "%s", path);
  size_t n = strlen(buf);
  while (n > 1 && buf[n - 1] == '/') buf[--n] = 0;
  char *slash = strrchr(buf, '/');
  if (slash == NULL)
    snprintf(buf, size, ".");
  else if (slash == buf)
    buf[1] = 0;
  else
    *slash = 0;
}

/* Whether path, or a folder it lies in, is the entry of stat sb. */
static bool lies_in(const char *path, const struct stat *sb) {
  char at[DIRS_PATH_MAX], up[DIRS_PATH_MAX], real[PATH_MAX];
  /* its folders as they are (links resolved, from the root), else as written */
  snprintf(at, sizeof at, "%s", realpath(path, real) ? real : path);
  for (int depth = 0; depth < 4096; depth++) {
    struct stat kb;
    if (stat(at, &kb) == 0 && kb.st_dev == sb->st_dev && kb.st_ino == sb->st_ino) return true;
    file_parent_of(at, up, sizeof up);
    if (strcmp(up, at) == 0) return false; /* "." or "/" */
    snprintf(at, sizeof at, "%s", up);
  }
  return false;
}

/* Whether fd (closed here; -1: none) is a regular file no process holds locked: a dead
 * writer's. A file system without locks (ENOLCK) cannot tell: the writer is taken for dead, as
 * a second job there goes undetected. */
static bool unheld(int fd) {
  if (fd < 0) return false;
  struct stat mb;
  bool dead = fstat(fd, &mb) == 0 && S_ISREG(mb.st_mode) && /* a mark is a file, not a folder */
              (flock(fd, LOCK_EX | LOCK_NB) == 0 || errno != EWOULDBLOCK);
  close(fd);
  return dead;
}

/* A folder a writer killed between creating it and naming its mark left: it holds nothing,
 * or nothing but the mark not yet named (FILE_TEMP_MARK ".new"), which no process holds. */
static bool unmarked_leftover(int dfd, const char *name) {
  int d = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  DIR *dir = d >= 0 ? fdopendir(d) : NULL;
  if (dir == NULL) {
    if (d >= 0) close(d);
    return false;
  }
  bool only = true, unnamed = false;
  for (struct dirent *e; only && (e = readdir(dir)) != NULL;) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    unnamed = strcmp(e->d_name, FILE_TEMP_MARK ".new") == 0;
    only = unnamed;
  }
  bool dead = only && (!unnamed || unheld(openat(dirfd(dir), FILE_TEMP_MARK ".new",
                                                 O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)));
  closedir(dir);
  return dead;
}

/* Whether the entry name of folder dfd, a temporary one's name, was left by a writer that
 * died: a file no process holds locked, a folder holding FILE_TEMP_MARK (a file) no process
 * holds locked, or a folder a writer left as it began (unmarked_leftover); never a link,
 * another folder without the mark, or what a path of keep names or lies in. */
static bool stale_temp(int dfd, const char *name, const char *const *keep) {
  struct stat sb;
  if (fstatat(dfd, name, &sb, AT_SYMLINK_NOFOLLOW) != 0) return false;
  for (int i = 0; keep != NULL && keep[i] != NULL; i++)
    if (lies_in(keep[i], &sb)) return false; /* an input, or the folder of one */
  int fd = -1;
  /* a file is locked once its writer has created it: one made in the last seconds may be a
   * writer's between the two */
  if (S_ISREG(sb.st_mode) && sb.st_mtime + 10 < time(NULL)) {
    fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  } else if (S_ISDIR(sb.st_mode)) {
    int d = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (d >= 0) fd = openat(d, FILE_TEMP_MARK, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (d >= 0) close(d);
  }
  if (fd < 0 && S_ISDIR(sb.st_mode)) return unmarked_leftover(dfd, name);
  return unheld(fd);
}

bool file_is_stale_temp_dir(const char *path) {
  struct stat sb;
  return path != NULL && lstat(path, &sb) == 0 && S_ISDIR(sb.st_mode) &&
         stale_temp(AT_FDCWD, path, NULL);
}

int file_remove_stale_temps(const char *path, const char *const *keep) {
  if (path == NULL || path[0] == 0) return 0;
  char parent[DIRS_PATH_MAX], tmp[DIRS_PATH_MAX];
  if (temp_name(path, tmp, sizeof tmp) != STATUS_OK) return 0; /* "PATH.tmp-XXXXXX" */
  file_parent_of(tmp, parent, sizeof parent);
  const char *slash = strrchr(tmp, '/'), *base = slash ? slash + 1 : tmp;
  size_t stem = strlen(base) - 6; /* the name up to the six characters mkstemp chose */
  DIR *d = opendir(parent);
  int removed = 0;
  for (struct dirent *e; d != NULL && (e = readdir(d)) != NULL;) {
    if (strlen(e->d_name) != stem + 6 || strncmp(e->d_name, base, stem) != 0) continue;
    if (!stale_temp(dirfd(d), e->d_name, keep)) continue;
    char at[DIRS_PATH_MAX];
    int n = snprintf(at, sizeof at, "%s/%s", parent, e->d_name);
    if (n > 0 && (size_t)n < sizeof at && file_remove_tree(at)) removed++;
  }
  if (d != NULL) closedir(d);
  return removed;
}

bool file_lexists(const char *path) {
  struct stat sb;
  return path != NULL && lstat(path, &sb) == 0;
}

int file_lock_exclusive(int fd) {
  for (int i = 0; i < 20; i++) {
    if (flock(fd, LOCK_EX | LOCK_NB) == 0) return 0;
    if (errno != EWOULDBLOCK) return errno;
    usleep(10000);
  }
  return EWOULDBLOCK;
}

bool file_lock_held(int fd) { return flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK; }

bool file_fd_is(int fd, const char *path) {
  struct stat a, b;
  return path != NULL && fstat(fd, &a) == 0 && lstat(path, &b) == 0 && a.st_dev == b.st_dev &&
         a.st_ino == b.st_ino;
}

bool file_same_path(const char *a, const char *b) {
  if (a == NULL || b == NULL) return false;
  struct stat sa, sb;
  if (stat(a, &sa) == 0 && stat(b, &sb) == 0)
    return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  /* one not there yet: the same name in the same folder */
  const char *na = strrchr(a, '/'), *nb = strrchr(b, '/');
  na = na ? na + 1 : a;
  nb = nb ? nb + 1 : b;
  if (strcmp(na, nb) != 0 || na[0] == 0) return false;
  char pa[DIRS_PATH_MAX], pb[DIRS_PATH_MAX];
  file_parent_of(a, pa, sizeof pa);
  file_parent_of(b, pb, sizeof pb);
  return stat(pa, &sa) == 0 && stat(pb, &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

static const char *kind_of(mode_t m) {
  return S_ISLNK(m)    ? "a symbolic link (name the file it points to, if that is meant)"
         : S_ISDIR(m)  ? "a folder"
         : S_ISFIFO(m) ? "a FIFO"
         : S_ISSOCK(m) ? "a socket"
         : S_ISREG(m)  ? "a file"
                       : "a device";
}

fsdpc_status_t file_check_output(const char *path, const char *what, const file_inputs_t *in) {
  ARG_NONNULL(path);
  what = what ? what : "output";
  struct stat sb;
  if (path[0] == 0) return dirs_error(what, path, "empty path");
  if (lstat(path, &sb) == 0) {
    if (!S_ISREG(sb.st_mode)) {
      char why[160];
      snprintf(why, sizeof why, "is %s, not a regular file; nothing was written",
               kind_of(sb.st_mode));
      return dirs_error(what, path, why);
    }
    for (int i = 0; in != NULL && i < in->n; i++)
      if (in->v[i].dev == sb.st_dev && in->v[i].ino == sb.st_ino) {
        char why[DIRS_PATH_MAX + 160];
        snprintf(why, sizeof why, "is %s '%.3800s', an input of this run; name another file",
                 in->v[i].what, in->v[i].path);
        return dirs_error(what, path, why);
      }
  } else if (errno != ENOENT) {
    return dirs_error(what, path, strerror(errno));
  }
  char parent[DIRS_PATH_MAX];
  file_parent_of(path, parent, sizeof parent);
  return writable_folder(what, parent, path);
}

fsdpc_status_t file_check_replaces(const char *path, const char *what, const char *kind,
                                   const char *const *heads) {
  ARG_NONNULL(path);
  ARG_NONNULL(kind);
  ARG_NONNULL(heads);
  what = what ? what : "output";
  char head[512];
  FILE *f = fopen(path, "rb");
  if (f == NULL) return STATUS_OK; /* absent (or unreadable: refused as it is written) */
  size_t n = fread(head, 1, sizeof head - 1, f);
  fclose(f);
  head[n] = 0;
  const char *at = head + strspn(head, " \t\r\n");
  if (at == head + n) return STATUS_OK; /* empty, or white space only */
  for (int i = 0; heads[i] != NULL; i++)
    if (strncmp(at, heads[i], strlen(heads[i])) == 0) return STATUS_OK;
  char begins[48]; /* its first characters, as text */
  size_t k = 0;
  for (; k < sizeof begins - 1 && at + k < head + n && at[k] != '\n'; k++)
    begins[k] = isprint((unsigned char)at[k]) ? at[k] : '?';
  begins[k] = 0;
  return err_set(STATUS_EINVAL,
                 "%s '%s': exists and is not %s (it begins '%s'): it would be replaced; name "
                 "another file, or remove this one",
                 what, path, kind, begins);
}

fsdpc_status_t file_check_outside(const char *path, const char *input, const char *what) {
  ARG_NONNULL(path);
  ARG_NONNULL(input);
  what = what ? what : "output";
  char parent[DIRS_PATH_MAX], *in = realpath(input, NULL), *at = NULL;
  file_parent_of(path, parent, sizeof parent);
  if (in != NULL) at = realpath(parent, NULL);
  size_t n = in ? strlen(in) : 0;
  bool inside = at != NULL && strncmp(at, in, n) == 0 && (at[n] == 0 || at[n] == '/' || n == 1);
  free(in);
  free(at);
  if (!inside) return STATUS_OK;
  char why[DIRS_PATH_MAX + 80];
  snprintf(why, sizeof why, "lies inside '%.3800s', which it reads; name a path outside it", input);
  return dirs_error(what, path, why);
}

static bool folder_empty(const char *path) {
  DIR *d = opendir(path);
  if (d == NULL) return false;
  struct dirent *e;
  int n = 0;
  while ((e = readdir(d)) != NULL) n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
  closedir(d);
  return n == 0;
}

/* Whether folder path is a mount point: another file system's root, or a bind mount of a
 * folder of the same one (listed in /proc/self/mountinfo, whose fifth field is the mount
 * point, spaces and the like written as octal escapes). */
static bool mount_point(const char *path, const struct stat *sb) {
  char parent[DIRS_PATH_MAX];
  struct stat pb;
  file_parent_of(path, parent, sizeof parent);
  if (stat(parent, &pb) == 0 && pb.st_dev != sb->st_dev) return true;
  char *real = realpath(path, NULL);
  FILE *f = real ? fopen("/proc/self/mountinfo", "r") : NULL;
  bool found = false;
  char *line = NULL;
  size_t cap = 0;
  while (f != NULL && !found && getline(&line, &cap, f) > 0) {
    char *at = line;
    for (int k = 0; k < 4 && at != NULL; k++) { /* past the first four fields */
      at = strchr(at, ' ');
      if (at != NULL) at++;
    }
    if (at == NULL) continue;
    char point[DIRS_PATH_MAX];
    size_t n = 0;
    for (; *at && *at != ' ' && n + 1 < sizeof point; at++) {
      if (at[0] == '\\' && at[1] >= '0' && at[1] <= '3' && at[2] >= '0' && at[2] <= '7' &&
          at[3] >= '0' && at[3] <= '7') {
        point[n++] = (char)((at[1] - '0') * 64 + (at[2] - '0') * 8 + (at[3] - '0'));
        at += 3;
      } else {
        point[n++] = *at;
      }
    }
    point[n] = 0;
    found = strcmp(point, real) == 0 && strcmp(real, "/") != 0;
  }
  free(line);
  if (f != NULL) fclose(f);
  free(real);
  return found;
}

fsdpc_status_t file_check_output_dir(const char *path, const char *what, bool empty_ok) {
  ARG_NONNULL(path);
  what = what ? what : "output";
  struct stat sb;
  if (path[0] == 0) return dirs_error(what, path, "empty path");
  bool exists = lstat(path, &sb) == 0;
  if (exists) {
    char why[160];
    if (!S_ISDIR(sb.st_mode)) {
      snprintf(why, sizeof why, "exists and is %s; nothing was written", kind_of(sb.st_mode));
      return dirs_error(what, path, why);
    }
    if (!empty_ok || !folder_empty(path))
      return dirs_error(what, path,
                        empty_ok ? "exists and is not empty (name a new or an empty folder)"
                                 : "already exists (name a new folder)");
  } else if (errno != ENOENT) {
    return dirs_error(what, path, strerror(errno));
  }
  char parent[DIRS_PATH_MAX];
  file_parent_of(path, parent, sizeof parent);
  /* the output is built beside path and renamed onto it: a mount point cannot be renamed
   * onto (EBUSY), nor can "." or "..", which would only show once all of it was written */
  size_t len = strlen(path);
  while (len > 1 && path[len - 1] == '/') len--;
  const char *base = path + len;
  while (base > path && base[-1] != '/') base--;
  if ((len - (size_t)(base - path) == 1 && base[0] == '.') ||
      (len - (size_t)(base - path) == 2 && base[0] == '.' && base[1] == '.'))
    return dirs_error(what, path,
                      "ends in '.' or '..': name the folder by its own name (the output is built "
                      "beside it and renamed into its place)");
  if (exists && mount_point(path, &sb))
    return dirs_error(what, path,
                      "is a mount point: the output is built beside it and renamed into its "
                      "place, which a mount point does not allow; name a new folder inside it");
  return writable_folder(what, parent, path);
}
