/*
 * Small text files (JSON headers and states, configs): whole reads and durable writes.
 *
 *   char *text;
 *   TRY(file_read_text("config.json", FILE_TEXT_MAX, &text));   // NUL-terminated; free()
 *   TRY(file_write_text("train_state.json", text));              // text + "\n", synced
 *
 * Errors name the file and the reason.
 */
#ifndef FSDPC_BASE_FILE_H
#define FSDPC_BASE_FILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "base/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The largest text file the library reads whole (64 MiB). */
#define FILE_TEXT_MAX ((size_t)1 << 26)

/* Opens path for reading if it is a regular file: a FIFO, a device or a folder is refused at
 * once (never blocks in open). Errors read "WHAT PATH: reason" (what may be NULL). */
status_t file_open_regular(const char *path, const char *what, FILE **out);

/* Reads the whole file into *out (NUL-terminated, freed by the caller); files longer than
 * max_bytes are refused. */
status_t file_read_text(const char *path, size_t max_bytes, char **out);

/* Writes text and a newline to path (created or truncated) and syncs it to storage. */
status_t file_write_text(const char *path, const char *text);

/* Whether path names a folder (following links). */
bool file_is_dir(const char *path);

/* Creates folder path with its missing parents (as mkdir -p; an existing folder is fine) and
 * checks that it is writable. Errors read "WHAT 'PATH': reason" (what may be NULL). */
status_t file_make_dirs(const char *path, const char *what);

/* Checks, creating nothing, that folder path could be written: it is a writable folder, or its
 * nearest existing ancestor is. Errors as file_make_dirs's. */
status_t file_check_dirs(const char *path, const char *what);

#ifdef __cplusplus
}
#endif

#endif
