/*
 * Small text files (JSON headers and states, configs): whole reads and durable writes.
 *
 *   char *text;
 *   FSDPC_TRY(file_read_text("config.json", FILE_TEXT_MAX, &text));   // NUL-terminated; free()
 *   FSDPC_TRY(file_write_text("train_state.json", text));              // text + "\n", synced
 *
 * Errors name the file and the reason.
 */
#ifndef FSDPC_BASE_FILE_H
#define FSDPC_BASE_FILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* The largest text file the library reads whole (64 MiB). */
#define FILE_TEXT_MAX ((size_t)1 << 26)

/* Opens path for reading if it is a regular file: a FIFO, a device or a folder is refused at
 * once (never blocks in open). Errors read "WHAT PATH: reason" (what may be NULL). */
fsdpc_status_t file_open_regular(const char *path, const char *what, FILE **out);

/* Reads the whole file into *out (NUL-terminated, freed by the caller); files longer than
 * max_bytes are refused. */
fsdpc_status_t file_read_text(const char *path, size_t max_bytes, char **out);

/* Writes text and a newline to path (created or truncated) and syncs it to storage. */
fsdpc_status_t file_write_text(const char *path, const char *text);

/* Whether path names a folder (following links). */
bool file_is_dir(const char *path);
/* Whether path names an entry of its folder, even a link to nothing or a loop of links (which
 * a read then names), not only a file that can be reached. */
bool file_lexists(const char *path);

/* The folder that holds path into buf: "." for a bare name, "/" for one in the root;
 * trailing slashes of path ignored. */
void file_parent_of(const char *path, char *buf, size_t size);

/* buf = dir "/" name. A path that does not fit in size bytes is refused (EINVAL, naming it),
 * never cut short: a shortened path names another file. */
fsdpc_status_t file_join(char *buf, size_t size, const char *dir, const char *name);

/* Creates folder path with its missing parents (as mkdir -p; an existing folder is fine) and
 * checks that it is writable. Errors read "WHAT 'PATH': reason" (what may be NULL). */
fsdpc_status_t file_make_dirs(const char *path, const char *what);

/* file_make_dirs, noting the folders it created (not those that were there): the lengths of
 * their prefixes of path, outermost first, into made[0..*n_made) (at most max of them; made
 * may be NULL). The inverse removes them innermost first while they are empty. */
fsdpc_status_t file_make_dirs_noted(const char *path, const char *what, size_t *made, int *n_made,
                                    int max);

/* Checks, leaving nothing behind, that folder path could be written: it is a writable folder,
 * or its nearest existing ancestor is one a folder can be made in (an empty folder is made
 * there and removed: permissions alone miss file systems such as /proc). Errors as
 * file_make_dirs's. */
fsdpc_status_t file_check_dirs(const char *path, const char *what);

/* Removes path and, when it is a folder, everything under it, never following a symbolic
 * link: a link is removed itself, not what it points to, and folders are walked through
 * descriptors opened with O_NOFOLLOW, so nothing outside path is touched. Best effort: false
 * when something could not be removed (a path that does not exist is no failure), errno then
 * the first failure's (the entry that could not go, not its folder left not empty). */
bool file_remove_tree(const char *path);

/* The file inside a folder of file_make_temp_dir's that marks it as this library's while it
 * is being written; removed by file_commit_temp_dir. */
#define FILE_TEMP_MARK ".fsdpc-partial"

/* Creates a fresh folder beside path, named "PATH.tmp-XXXXXX" (mkdtemp), for writing what
 * will be renamed to path; its name into tmp. Nothing that exists is reused. It holds
 * FILE_TEMP_MARK, locked (flock) by this process until file_commit_temp_dir or
 * file_discard_temp_dir: file_remove_stale_temps in another process leaves it. */
fsdpc_status_t file_make_temp_dir(const char *path, char *tmp, size_t size);

/* Creates folder tmp, of a name chosen by the caller, marked and locked as
 * file_make_temp_dir's are; one that exists is removed first when it is what a dead writer
 * left (file_remove_stale_temps's rule), and refused otherwise (a user's folder, a live
 * writer's, a link). */
fsdpc_status_t file_claim_temp_dir(const char *tmp);

/* Whether path is a folder of file_make_temp_dir's (or file_claim_temp_dir's) that its writer
 * left when it died: it holds FILE_TEMP_MARK, a file no process holds locked, or nothing but
 * that mark not yet named (a writer killed as it made the folder). A link, a folder holding
 * anything else without the mark, and one still being written are not. */
bool file_is_stale_temp_dir(const char *path);

/* Renames folder tmp of file_make_temp_dir's (or file_claim_temp_dir's) to path (an empty
 * folder path names gives it its permissions), then removes its mark and releases its lock. tmp
 * is left on failure, marked and held (file_discard_temp_dir removes it). */
fsdpc_status_t file_commit_temp_dir(const char *tmp, const char *path);

/* Removes folder tmp of file_make_temp_dir's (file_remove_tree) and releases its lock. */
void file_discard_temp_dir(const char *tmp);

/* Creates and opens for writing a fresh file beside path, "PATH.tmp-XXXXXX" (mkstemp); its
 * name into tmp. It is locked (flock) until it is closed. */
fsdpc_status_t file_create_temp(const char *path, char *tmp, size_t size, FILE **out);

/* Removes what file_make_temp_dir and file_create_temp left beside path when the process
 * writing path died before its rename: entries named PATH.tmp-XXXXXX that are files no
 * process holds locked (and not changed in the last 10 s), or folders holding FILE_TEMP_MARK that
 * no process holds locked (file_is_stale_temp_dir). A link, a folder without the mark (not this
 * library's, or a mark that is no file), a temporary being written and one that a path of keep
 * names or lies in (a NULL-terminated list, or NULL: a command's inputs) are left. Returns how many
 * went. */
int file_remove_stale_temps(const char *path, const char *const *keep);

/* Takes an exclusive flock of fd without blocking, waiting out a holder of an instant (another
 * process's file_lock_held probe: tried for 0.2 s): 0, else the errno of the refusal
 * (EWOULDBLOCK: another process holds it; ENOLCK and the like: the file system takes no locks). */
int file_lock_exclusive(int fd);

/* Whether another process holds fd's file locked (flock), probed with a shared lock held for an
 * instant (NFS grants one on a file opened for reading); false where no locks are taken. */
bool file_lock_held(int fd);

/* Whether fd is still the file named path (the name itself, not a link's target): false once
 * another file has taken the name, or none has it. */
bool file_fd_is(int fd, const char *path);

/* Whether paths a and b name the same file: the same file when both exist, else the same name
 * in the same folder (./m.jsonl and m.jsonl, a path through a link to the folder). */
bool file_same_path(const char *a, const char *b);

/* Writes text to path through a fresh file beside it, renamed over path when complete. */
fsdpc_status_t file_replace_text(const char *path, const char *text);

/* The inputs of a run, by device and inode: the files no output of the run may name. */
typedef struct file_inputs file_inputs_t;

fsdpc_status_t file_inputs_new(file_inputs_t **out);
void file_inputs_free(file_inputs_t *in);
/* Adds path (what: "the plan", "data.path", ...): a file, or every file under a folder
 * (links inside it not followed). A path that does not exist adds nothing. */
fsdpc_status_t file_inputs_add(file_inputs_t *in, const char *path, const char *what);

/* Checks that the output file path may be written, before anything is: when it exists it is
 * a regular file (a symbolic link, a folder, a FIFO or a device is refused) and none of the
 * inputs (NULL: none); its folder exists and is writable. Errors read "WHAT 'PATH': reason". */
fsdpc_status_t file_check_output(const char *path, const char *what, const file_inputs_t *in);

/* Checks that an existing output file (file_check_output) holds what this output writes, and
 * so is replaced by its user's choice: empty, or beginning (after white space) with one of the
 * NULL-terminated heads; another file's content (a mistyped or swapped name) is refused, the
 * error naming kind ("an SVG plot") and what the file begins with. */
fsdpc_status_t file_check_replaces(const char *path, const char *what, const char *kind,
                                   const char *const *heads);

/* The same for an output folder that is written whole and renamed into place: when path exists
 * it is a folder, not a symbolic link nor a mount point (an empty one, where empty_ok, else
 * refused); its parent exists and is writable. */
fsdpc_status_t file_check_output_dir(const char *path, const char *what, bool empty_ok);

/* Checks that the output path (whose parent exists: file_check_output_dir) lies outside the
 * input folder (the links of both resolved): a tool writes nothing into what it reads. */
fsdpc_status_t file_check_outside(const char *path, const char *input, const char *what);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
