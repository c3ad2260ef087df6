/* Shared by the fuzz harnesses: an input handed to the readers as a file, without touching
 * the disk (a memory file seen through /proc/self/fd). */
#ifndef FSDPC_TESTS_FUZZ_UTIL_H
#define FSDPC_TESTS_FUZZ_UTIL_H

#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

/* A memory file holding data; its path into path. Returns the descriptor (close it after). */
static inline int fuzz_file(const uint8_t *data, size_t size, char *path, size_t path_size) {
  int fd = memfd_create("fuzz", 0);
  if (fd < 0) abort();
  if (size > 0 && write(fd, data, size) != (ssize_t)size) abort();
  snprintf(path, path_size, "/proc/self/fd/%d", fd);
  return fd;
}

#endif
