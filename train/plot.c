#include "train/plot.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/file.h"

enum { N_PANELS = 4, N_SERIES = 5, EVAL = 4 }; /* a series per panel, and the evaluations */
static const char *const KEYS[N_SERIES] = {"loss", "lr", "grad_norm", "tokens_per_s", "eval_loss"};
static const char *const TITLES[N_PANELS] = {"loss (dots: evaluation)", "learning rate",
                                             "gradient norm", "tokens/s"};
static const char *const COLOURS[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                      "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
enum { N_COLOURS = sizeof COLOURS / sizeof COLOURS[0] };

/* A value a line leaves out: the curve goes on past it (a null, NAN, breaks it). */
#define ABSENT INFINITY

typedef struct run {
  const char *name;
  double *step, *v[N_SERIES]; /* NAN where a value is null, ABSENT where the line has none */
  int64_t n, cap;
} run_t;

static fsdpc_status_t push(run_t *r, double step, const double *v) {
  if (r->n == r->cap) {
    int64_t cap = r->cap ? 2 * r->cap : 256;
    double *p[1 + N_SERIES] = {r->step};
    for (int k = 0; k < N_SERIES; k++) p[1 + k] = r->v[k];
    for (int k = 0; k < 1 + N_SERIES; k++) {
      double *q = realloc(p[k], sizeof(double) * (size_t)cap);
      if (q == NULL) return err_set(STATUS_ENOMEM, "fsdp-plot: out of host memory");
      p[k] = q;
      if (k == 0)
        r->step = q;
      else
        r->v[k - 1] = q;
    }
    r->cap = cap;
  }
  r->step[r->n] = step;
  for (int k = 0; k < N_SERIES; k++) r->v[k][r->n] = v[k];
  r->n++;
  return STATUS_OK;
}

/* Values beyond this are drawn at it: the axes' arithmetic stays finite. */
#define PLOT_LIMIT 1e300

static double clamp(double v) {
  return v > PLOT_LIMIT ? PLOT_LIMIT : v < -PLOT_LIMIT ? -PLOT_LIMIT : v;
}

typedef struct at_step {
  double step;
  int64_t line;
} at_step_t;

static int by_step_then_line(const void *a, const void *b) {
  const at_step_t *x = a, *y = b;
  if (x->step != y->step) return x->step < y->step ? -1 : 1;
  return (x->line > y->line) - (x->line < y->line);
}

/* A run's lines in step order, a step given twice taking its last line (as a resumed run's
 * rewrite would), each said on stderr: drawn in file order they would double back. */
static fsdpc_status_t in_step_order(run_t *r, const char *path) {
  bool sorted = true;
  for (int64_t i = 1; i < r->n && sorted; i++) sorted = r->step[i] > r->step[i - 1];
  if (sorted) return STATUS_OK;
  at_step_t *o = malloc(sizeof *o * (size_t)r->n);
  double *tmp = malloc(sizeof *tmp * (size_t)r->n);
  if (o == NULL || tmp == NULL) {
    free(o);
    free(tmp);
    return err_set(STATUS_ENOMEM, "fsdp-plot: out of host memory");
  }
  for (int64_t i = 0; i < r->n; i++) o[i] = (at_step_t){r->step[i], i};
  qsort(o, (size_t)r->n, sizeof *o, by_step_then_line);
  int64_t kept = 0, twice = 0;
  for (int64_t i = 0; i < r->n; i++) { /* the last line of each step */
    if (i + 1 < r->n && o[i + 1].step == o[i].step) {
      twice++;
      continue;
    }
    o[kept++] = o[i];
  }
  for (int k = -1; k < N_SERIES; k++) {
    double *a = k < 0 ? r->step : r->v[k];
    for (int64_t i = 0; i < kept; i++) tmp[i] = a[o[i].line];
    memcpy(a, tmp, sizeof *tmp * (size_t)kept);
  }
  r->n = kept;
  free(o);
  free(tmp);
  fprintf(stderr, "fsdp-plot: warning: %s: its steps are not in order%s; drawn in step order%s\n",
          path, twice ? ", and some are given more than once" : "",
          twice ? ", each step's last line taken" : "");
  return STATUS_OK;
}

static fsdpc_status_t read_run(const char *path, run_t *r) {
  FILE *f;
  FSDPC_TRY(file_open_regular(path, "cannot open the metrics file", &f));
  long size = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
  fclose(f);
  char *text;
  FSDPC_TRY(file_read_text(path, (size_t)1 << 30, &text));
  size_t len = strlen(text); /* before the lines are cut apart */
  fsdpc_status_t st = STATUS_OK;
  int line = 0;
  for (char *s = text, *next; s != NULL && *s && st == STATUS_OK; s = next) {
    line++;
    next = strchr(s, '\n');
    if (next != NULL) *next++ = '\0';
    if (strspn(s, " \t\r") == strlen(s)) continue;
    cJSON *o = cJSON_ParseWithOpts(s, NULL, true); /* one object a line, nothing after it */
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(o, "step");
    if (!cJSON_IsObject(o)) {
      st = err_set(STATUS_EFORMAT, "%s:%d: not a JSON object (one a line)", path, line);
    } else if (!cJSON_IsNumber(step) || !isfinite(step->valuedouble)) {
      st = err_set(STATUS_EFORMAT, "%s:%d: no finite number 'step' (not a metrics file?)", path,
                   line);
    } else {
      double v[N_SERIES];
      for (int k = 0; k < N_SERIES && st == STATUS_OK; k++) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, KEYS[k]);
        /* a number, or null (a non-finite value, as fsdp-train writes it), or absent */
        if (it != NULL && !cJSON_IsNumber(it) && !cJSON_IsNull(it))
          st = err_set(STATUS_EFORMAT, "%s:%d: '%s' is not a number (not a metrics file?)", path,
                       line, KEYS[k]);
        v[k] = it == NULL                                        ? ABSENT
               : cJSON_IsNumber(it) && isfinite(it->valuedouble) ? clamp(it->valuedouble)
                                                                 : NAN;
      }
      if (st == STATUS_OK) st = push(r, clamp(step->valuedouble), v);
    }
    cJSON_Delete(o);
  }
  if (st == STATUS_OK && size >= 0 && (size_t)size != len)
    st = err_set(STATUS_EFORMAT, "%s:%d: holds a NUL byte (not a metrics file?)", path, line + 1);
  free(text);
  if (st == STATUS_OK && r->n == 0)
    st = err_set(STATUS_EFORMAT, "%s: no steps in it (an empty metrics file)", path);
  if (st == STATUS_OK) st = in_step_order(r, path);
  return st;
}

/* An axis [*a, *b] wide enough to divide by and to tell its ends apart: a single value (or
 * values within rounding of each other) gets a margin of its own size's precision. */
static void widen(double *a, double *b) {
  if (*b - *a > fmax(fabs(*a), fabs(*b)) * 1e-12) return;
  double m = fmax(1, fmax(fabs(*a), fabs(*b)) * 1e-6);
  *a -= m;
  *b += m;
}

/* A tick spacing of 1, 2 or 5 times a power of ten giving about `target` ticks. */
static double tick_step(double range, int target) {
  double raw = range / target, mag = pow(10, floor(log10(raw))), f = raw / mag;
  return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

/* The length of the valid UTF-8 sequence at s (1 to 4 bytes), or 0 when it is not one. */
static int utf8_length(const unsigned char *s) {
  int n = s[0] < 0x80             ? 1
          : (s[0] & 0xE0) == 0xC0 ? 2
          : (s[0] & 0xF0) == 0xE0 ? 3
          : (s[0] & 0xF8) == 0xF0 ? 4
                                  : 0;
  for (int i = 1; i < n; i++)
    if ((s[i] & 0xC0) != 0x80) return 0;
  if (n == 2 && s[0] < 0xC2) return 0; /* overlong */
  if (n == 3 && ((s[0] == 0xE0 && s[1] < 0xA0) || (s[0] == 0xED && s[1] >= 0xA0))) return 0;
  if (n == 4 && ((s[0] == 0xF0 && s[1] < 0x90) || s[0] > 0xF4 || (s[0] == 0xF4 && s[1] >= 0x90)))
    return 0;
  return n;
}

/* Text as XML character data: the markup characters escaped, control characters and bytes that
 * are not UTF-8 shown as U+FFFD (XML allows neither). */
static void xml_text(FILE *f, const char *text) {
  for (const unsigned char *s = (const unsigned char *)text; *s;) {
    int n = utf8_length(s);
    if (n == 0 || (*s < 0x20 && *s != '\t')) {
      fputs("\xEF\xBF\xBD", f);
      s++;
      continue;
    }
    switch (*s) {
      case '&': fputs("&amp;", f); break;
      case '<': fputs("&lt;", f); break;
      case '>': fputs("&gt;", f); break;
      case '"': fputs("&quot;", f); break;
      default: fwrite(s, 1, (size_t)n, f);
    }
    s += n;
  }
}

enum { PANEL_W = 480, PANEL_H = 300, LEFT = 72, RIGHT = 16, TOP = 28, BOTTOM = 40 };

/* Panel k: series k as lines; the loss panel also has the evaluations, as dots. */
/* Where a panel's plot area lies and the values it spans. */
typedef struct frame {
  double px, py, w, h;   /* the plot area */
  double x0, x1, y0, y1; /* the steps and values at its edges */
} frame_t;

static double fx(const frame_t *fr, double x) {
  return fr->px + (x - fr->x0) / (fr->x1 - fr->x0) * fr->w;
}
static double fy(const frame_t *fr, double y) {
  return fr->py + fr->h - (y - fr->y0) / (fr->y1 - fr->y0) * fr->h;
}

/* Grid and tick labels: at most 50 a side, each at k times the spacing (a sum would stop
 * moving where the spacing is below the values' precision); the step axis's name. */
static void axes(FILE *f, const frame_t *fr) {
  double ys = tick_step(fr->y1 - fr->y0, 5), xs = tick_step(fr->x1 - fr->x0, 6);
  for (double k = ceil(fr->y0 / ys), t = k * ys, n = 0; t <= fr->y1 && n < 50;
       k++, n++, t = k * ys) {
    double y = fy(fr, t);
    fprintf(f,
            "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
            "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.6g</text>\n",
            fr->px, y, fr->px + fr->w, y, fr->px - 6, y + 4, fabs(t) < ys * 1e-9 ? 0.0 : t);
  }
  for (double k = ceil(fr->x0 / xs), t = k * xs, n = 0; t <= fr->x1 && n < 50;
       k++, n++, t = k * xs) {
    double x = fx(fr, t);
    fprintf(f,
            "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
            "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.6g</text>\n",
            x, fr->py, x, fr->py + fr->h, x, fr->py + fr->h + 16, t);
  }
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">step</text>\n", fr->px + fr->w / 2,
          fr->py + fr->h + 34);
}

/* Run r's curve of value k: one polyline per stretch of values (a gap where a value is
 * missing), and the loss panel's evaluations as circles. */
/* Run r's dash pattern: none for the first N_COLOURS runs, then one per round of the colours. */
static const char *dashes(int r) {
  static const char *const d[] = {"", " stroke-dasharray=\"6 3\"", " stroke-dasharray=\"2 2\"",
                                  " stroke-dasharray=\"8 3 2 3\""};
  return d[(r / N_COLOURS) % 4];
}

static void curve(FILE *f, const frame_t *fr, const run_t *run, int r, int k) {
  int64_t open = 0; /* the points of the stretch being drawn */
  double lx = 0, ly = 0;
  for (int64_t i = 0; i <= run->n; i++) {
    if (i < run->n && isinf(run->v[k][i])) continue; /* a line without it: the curve goes on */
    bool have = i < run->n && !isnan(run->v[k][i]);
    if (have && !open)
      fprintf(f,
              "<polyline class=\"run%d\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\"%s "
              "points=\"",
              r, COLOURS[r % N_COLOURS], dashes(r));
    if (have) {
      lx = fx(fr, run->step[i]), ly = fy(fr, run->v[k][i]);
      fprintf(f, "%s%.2f,%.2f", open ? " " : "", lx, ly);
    }
    if (!have && open) {
      fputs("\"/>\n", f);
      if (open == 1) /* a lone point draws no line: a dot */
        fprintf(f, "<circle class=\"run%d\" cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\" fill=\"%s\"/>\n", r,
                lx, ly, COLOURS[r % N_COLOURS]);
    }
    open = have ? open + 1 : 0;
  }
  for (int64_t i = 0; k == 0 && i < run->n; i++)
    if (isfinite(run->v[EVAL][i]))
      fprintf(f,
              "<circle class=\"eval%d\" cx=\"%.2f\" cy=\"%.2f\" r=\"4\" fill=\"white\" "
              "stroke=\"%s\" stroke-width=\"2\"/>\n",
              r, fx(fr, run->step[i]), fy(fr, run->v[EVAL][i]), COLOURS[r % N_COLOURS]);
}

static void panel(FILE *f, const run_t *runs, int n, int k, double ox, double oy) {
  frame_t fr = {.x0 = INFINITY, .x1 = -INFINITY, .y0 = INFINITY, .y1 = -INFINITY};
  for (int r = 0; r < n; r++)
    for (int64_t i = 0; i < runs[r].n; i++) {
      fr.x0 = fmin(fr.x0, runs[r].step[i]);
      fr.x1 = fmax(fr.x1, runs[r].step[i]);
      double v[2] = {runs[r].v[k][i], k == 0 ? runs[r].v[EVAL][i] : NAN};
      for (int j = 0; j < 2; j++)
        if (isfinite(v[j])) fr.y0 = fmin(fr.y0, v[j]), fr.y1 = fmax(fr.y1, v[j]);
    }
  fr.w = PANEL_W - LEFT - RIGHT, fr.h = PANEL_H - TOP - BOTTOM;
  fr.px = ox + LEFT, fr.py = oy + TOP;
  fprintf(f, "<g class=\"panel\" id=\"%s\">\n", KEYS[k]);
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-weight=\"bold\">%s</text>\n",
          fr.px + fr.w / 2, oy + 18, TITLES[k]);
  fprintf(f,
          "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
          "stroke=\"#444\"/>\n",
          fr.px, fr.py, fr.w, fr.h);
  if (!(fr.y0 <= fr.y1)) {
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">no values</text>\n</g>\n",
            fr.px + fr.w / 2, fr.py + fr.h / 2);
    return;
  }
  widen(&fr.x0, &fr.x1);
  double pad = fr.y1 > fr.y0 ? 0.05 * (fr.y1 - fr.y0) : (fr.y0 != 0 ? 0.05 * fabs(fr.y0) : 1);
  fr.y0 -= pad;
  fr.y1 += pad;
  widen(&fr.y0, &fr.y1);
  axes(f, &fr);
  for (int r = 0; r < n; r++) curve(f, &fr, &runs[r], r, k);
  fputs("</g>\n", f);
}

static fsdpc_status_t write_svg(const run_t *runs, int n, const char *out) {
  char tmp[4096];
  FILE *f;
  FSDPC_TRY(file_create_temp(out, tmp, sizeof tmp, &f));
  int legend = 12 + 18 * n, width = 2 * PANEL_W, height = legend + 2 * PANEL_H;
  fprintf(f,
          "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
          "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
          "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
          "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n<g class=\"legend\">\n",
          width, height, width, height);
  for (int r = 0; r < n; r++) {
    double y = 16 + 18.0 * r;
    fprintf(f,
            "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"%s\" "
            "stroke-width=\"3\"%s/><text x=\"%d\" y=\"%.1f\">",
            LEFT, y - 4, LEFT + 24, y - 4, COLOURS[r % N_COLOURS], dashes(r), LEFT + 32, y);
    xml_text(f, runs[r].name);
    fprintf(f, " (%lld step%s)</text>\n", (long long)runs[r].n, runs[r].n == 1 ? "" : "s");
  }
  fputs("</g>\n", f);
  for (int k = 0; k < N_PANELS; k++)
    panel(f, runs, n, k, (k % 2) * PANEL_W, legend + (k / 2) * PANEL_H);
  fputs("</svg>\n", f);
  bool bad = ferror(f) != 0;
  if (fclose(f) != 0 || bad) {
    int e = errno;
    remove(tmp);
    return err_set(STATUS_EIO, "cannot write '%s': %s", tmp, strerror(e));
  }
  if (rename(tmp, out) != 0) {
    int e = errno;
    remove(tmp);
    return err_set(STATUS_EIO, "cannot rename '%s' to '%s': %s", tmp, out, strerror(e));
  }
  return STATUS_OK;
}

fsdpc_status_t train_plot_check_replaces(const char *out, const char *what) {
  static const char *const svg[] = {"<?xml", "<svg", NULL}; /* what write_svg begins with */
  return file_check_replaces(out, what, "an SVG plot", svg);
}

fsdpc_status_t train_plot_metrics(const char *const *paths, int n, const char *out) {
  ARG_NONNULL(paths);
  ARG_NONNULL(out);
  if (n < 1) return err_set(STATUS_EINVAL, "fsdp-plot: no metrics file given");
  run_t *runs = calloc((size_t)n, sizeof *runs);
  if (runs == NULL) return err_set(STATUS_ENOMEM, "fsdp-plot: out of host memory");
  file_inputs_t *in = NULL; /* the output replaces none of them */
  fsdpc_status_t st = file_inputs_new(&in);
  for (int r = 0; r < n && st == STATUS_OK; r++)
    st = file_inputs_add(in, paths[r], "the metrics file");
  if (st == STATUS_OK) st = file_check_output(out, "-o", in);
  if (st == STATUS_OK) st = train_plot_check_replaces(out, "-o");
  file_inputs_free(in);
  for (int r = 0; r < n && st == STATUS_OK; r++) {
    runs[r].name = paths[r];
    st = read_run(paths[r], &runs[r]);
  }
  if (st == STATUS_OK) st = write_svg(runs, n, out);
  for (int r = 0; r < n; r++) {
    free(runs[r].step);
    for (int k = 0; k < N_SERIES; k++) free(runs[r].v[k]);
  }
  free(runs);
  return st;
}
