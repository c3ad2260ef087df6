/*
 * fsdp-plot: training curves from fsdp-train's metrics files, as one SVG picture.
 *
 *   fsdp-plot METRICS.jsonl... -o OUT.svg
 *
 * Four panels (loss, learning rate, gradient norm, tokens/s) against step; several files are
 * overlaid, each run in its own colour, with a legend naming the files (comparing plans is
 * the common case). No plotting library: the SVG is written directly.
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/status.h"
#include "train/plot.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: fsdp-plot METRICS.jsonl... -o OUT.svg\n"
          "       fsdp-plot --help | --version\n"
          "  draws loss, learning rate, gradient norm and tokens/s against step from the\n"
          "  files fsdp-train --metrics writes, the runs overlaid with a legend\n"
          "  (-o OUT.svg: also --output OUT.svg or --output=OUT.svg)\n");
}

int main(int argc, char **argv) {
  const char **files = calloc((size_t)argc, sizeof *files);
  const char *out = NULL;
  int n = 0;
  if (files == NULL) return 1;
  for (int i = 1; i < argc; i++) {
    const char *s = argv[i];
    if (strcmp(s, "--help") == 0 || strcmp(s, "-h") == 0) {
      usage(stdout);
      free(files);
      return 0;
    }
    if (strcmp(s, "--version") == 0) {
      printf("fsdp-plot (fsdpc) %s\n", fsdpc_version());
      free(files);
      return 0;
    }
    bool o = strcmp(s, "-o") == 0 || strcmp(s, "--output") == 0;
    if ((o || strncmp(s, "--output=", 9) == 0) && out != NULL) {
      fprintf(stderr, "fsdp-plot: %s: the output is already given ('%s'); one picture a run\n", s,
              out);
      free(files);
      return 2;
    }
    if (o) {
      if (i + 1 >= argc) {
        fprintf(stderr, "fsdp-plot: %s needs a file name\n", s);
        free(files);
        return 2;
      }
      out = argv[++i];
    } else if (strncmp(s, "--output=", 9) == 0) {
      out = s + 9;
    } else if (s[0] == '-' && s[1] != '\0') {
      fprintf(stderr, "fsdp-plot: unknown option '%s' (--help)\n", s);
      free(files);
      return 2;
    } else {
      files[n++] = s;
    }
  }
  if (n == 0 || out == NULL) {
    fprintf(stderr, "fsdp-plot: %s\n", n == 0 ? "no metrics file given" : "no -o OUT.svg given");
    usage(stderr);
    free(files);
    return 2;
  }
  fsdpc_status_t st = train_plot_metrics(files, n, out);
  free(files);
  if (st != STATUS_OK) {
    fprintf(stderr, "fsdp-plot: %s\n", err_detail());
    return 1;
  }
  printf("fsdp-plot: wrote %s (%d run%s)\n", out, n, n == 1 ? "" : "s");
  return 0;
}
