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

#include <stddef.h>

#include "base/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The largest text file the library reads whole (64 MiB). */
#define FILE_TEXT_MAX ((size_t)1 << 26)

/* Reads the whole file into *out (NUL-terminated, freed by the caller); files longer than
 * max_bytes are refused. */
status_t file_read_text(const char *path, size_t max_bytes, char **out);

/* Writes text and a newline to path (created or truncated) and syncs it to storage. */
status_t file_write_text(const char *path, const char *text);

#ifdef __cplusplus
}
#endif

#endif
