#include "base/file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

status_t file_open_regular(const char *path, const char *what, FILE **out) {
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

status_t file_read_text(const char *path, size_t max_bytes, char **out) {
  *out = NULL;
  FILE *f;
  TRY(file_open_regular(path, NULL, &f));
  status_t st = STATUS_OK;
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

status_t file_write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  status_t st = STATUS_OK;
  if (f == NULL || fputs(text, f) < 0 || fputc('\n', f) == EOF || fflush(f) != 0 ||
      fsync(fileno(f)) != 0)
    st = err_set(STATUS_EIO, "%s: cannot write: %s", path, strerror(errno));
  if (f && fclose(f) != 0 && st == STATUS_OK) st = err_set(STATUS_EIO, "%s: close failed", path);
  return st;
}

#define DIRS_PATH_MAX 4096

static status_t dirs_error(const char *what, const char *path, const char *reason) {
  return err_set(STATUS_EIO, "%s%s'%s': %s", what ? what : "", what ? " " : "", path, reason);
}

/* Whether the existing entry at path is a folder this process may write into. */
static status_t writable_folder(const char *what, const char *path, const char *shown) {
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

status_t file_make_dirs(const char *path, const char *what) {
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

status_t file_check_dirs(const char *path, const char *what) {
  char buf[DIRS_PATH_MAX];
  size_t n = strlen(path);
  if (n == 0 || n >= sizeof buf) return dirs_error(what, path, "empty or too long a path");
  memcpy(buf, path, n + 1);
  for (;;) { /* up to the nearest entry that exists */
    struct stat sb;
    if (stat(buf, &sb) == 0) return writable_folder(what, buf, path);
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
  return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}
