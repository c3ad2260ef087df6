/*
 * Training curves as SVG, from the metrics files fsdp-train writes (one JSON object per step:
 * step, loss, lr, grad_norm, tokens_per_s, ...): four panels (loss, learning rate, gradient
 * norm, tokens/s) against step, every run overlaid in its own colour, a legend naming each
 * run by its file. Used by fsdp-plot and fsdp-train --plot.
 *
 *   const char *runs[] = {"fsdp.jsonl", "hsdp.jsonl"};
 *   FSDPC_TRY(plot_metrics(runs, 2, "runs.svg"));
 */
#ifndef FSDPC_TOOLS_PLOT_H
#define FSDPC_TOOLS_PLOT_H

#include "core/status.h"

/* Reads the n metrics files and writes the picture to out (through out.tmp and a rename).
 * Fails naming the file and line on unreadable input (not JSON, no "step"), and when a file
 * has no step at all. A value that is null or absent (a non-finite loss) leaves a gap. */
fsdpc_status_t plot_metrics(const char *const *paths, int n, const char *out);

#endif
