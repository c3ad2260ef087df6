/*
 * Training curves as SVG, from the metrics files fsdp-train writes (one JSON object per step:
 * step, loss, lr, grad_norm, tokens_per_s, ...): four panels (loss, learning rate, gradient
 * norm, tokens/s) against step, every run overlaid in its own colour, a legend naming each
 * run by its file. Used by fsdp-plot and the trainer's --plot.
 *
 *   const char *runs[] = {"fsdp.jsonl", "hsdp.jsonl"};
 *   FSDPC_TRY(train_plot_metrics(runs, 2, "runs.svg"));
 */
#ifndef FSDPC_TRAIN_PLOT_H
#define FSDPC_TRAIN_PLOT_H

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* Reads the n metrics files and writes the picture to out (through out.tmp and a rename).
 * Fails naming the file and line on unreadable input (not JSON, no "step"), and when a file
 * has no step at all, and when out exists and is no plot (train_plot_check_replaces). A value
 * that is null or absent (a non-finite loss) leaves a gap. */
fsdpc_status_t train_plot_metrics(const char *const *paths, int n, const char *out);

/* Whether out may take a plot (what: the option naming it): absent, empty, or a plot already;
 * another file there is refused (file_check_replaces). */
fsdpc_status_t train_plot_check_replaces(const char *out, const char *what);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
