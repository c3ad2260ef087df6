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
