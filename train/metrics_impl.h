/* The metrics file of a run (private to train/): one JSON line per step from rank 0, opened
 * fresh or for a resumed run (the lines up to its step kept, the step's line restored from its
 * checkpoint), scanned, checked before a run writes it. */
#ifndef FSDPC_TRAIN_METRICS_IMPL_H
#define FSDPC_TRAIN_METRICS_IMPL_H

#include <cJSON.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "core/status.h"
#include "train/plan.h"

/* Every rank learns whether rank 0 could write the metrics file (err: its errno, or 0).
 * Collective. */
fsdpc_status_t train_metrics_agree(const char *path, int err);

/* Opens the metrics file (rank 0) for a run starting after step start: a fresh run starts it
 * anew; a resumed run keeps the lines up to its step (later ones belong to the run it
 * replaces), rewritten through a fresh file beside it and a rename, and appends. With defer
 * (not NULL: a checkpoint.overwrite rollback, whose newer checkpoints stay until its first save
 * commits) the fresh file is not renamed: its name goes into defer, the run appends to it, and
 * metrics_settle renames it once that save commits. The fields of patch (may be NULL) go into
 * step start's line (the evaluation a stop skipped); saved (may be NULL), the line its
 * checkpoint records, is written when the file lacks it (the run was killed after the save).
 * The file returned holds its lock (flock) until it is closed, taken before the file has the
 * name, and the file that had the name is held meanwhile: another job's check finds one of
 * the two locked. With defer, *guard (may be NULL without defer) receives the descriptor
 * holding the file that keeps the name until metrics_settle (-1: none); the caller closes it.
 * NULL with errno set on failure (EWOULDBLOCK: another job holds the file). */
FILE *train_metrics_open(const char *path, int64_t start, const cJSON *patch, const cJSON *saved,
                         char *defer, size_t defer_size, int *guard);

/* The metrics file at path, when there, not held by another running job (the file a run
 * appends to is locked while it runs, train_metrics_open): refused, naming it; a dry run
 * (dry_run) only says so. Local. */
fsdpc_status_t train_metrics_check_free(const char *path, bool dry_run);

/* What the metrics file at path holds about step start. Local. */
typedef struct train_metrics_seen {
  bool file;          /* it is there, with lines (a new or empty file starts after start) */
  bool line;          /* step start's line */
  bool eval;          /* that line's evaluation */
  double last;        /* the last step of its lines */
  double first_after; /* the first and last steps after start (0: none) */
  double last_after;
} train_metrics_seen_t;
train_metrics_seen_t train_metrics_scan(const char *path, int64_t start);

/* A metrics file given again holds metrics lines (a JSON object with a number "step"), at
 * least one in its first 64 KiB (a line cut short by a kill counts, as its start shows), or
 * nothing: the run replaces its lines, and another file's content (a mistyped name) is not a
 * run's to replace. Local. */
fsdpc_status_t train_metrics_check_content(const char *metrics);

/* A run with a checkpoint.dir resumed after step start from a checkpoint outside it (a branch
 * of another run) keeps the metrics file's lines up to start and rewrites the rest: when the
 * file holds steps after start, which belong to the run it branches from, refused, naming
 * them. Local (rank 0's file). */
fsdpc_status_t train_check_metrics_branch(const fsdpc_plan_t *p, const char *metrics,
                                          const char *resumed, int64_t start);

#endif
