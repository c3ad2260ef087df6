#include "parallel/pp_schedule.h"

#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"

struct pp_schedule {
  pp_schedule_kind_t kind;
  int P, M, V;
  pp_action_t *actions; /* rank r's at [r * n, (r + 1) * n), n = 2 M V */
};

static const char *const names[PP_SCHEDULE_COUNT] = {"gpipe", "1f1b", "interleaved_1f1b"};

bool pp_schedule_parse(const char *name, pp_schedule_kind_t *out) {
  for (int k = 0; name && k < PP_SCHEDULE_COUNT; k++)
    if (strcmp(name, names[k]) == 0) {
      if (out) *out = (pp_schedule_kind_t)k;
      return true;
    }
  return false;
}

const char *pp_schedule_name(pp_schedule_kind_t kind) {
  return kind >= 0 && kind < PP_SCHEDULE_COUNT ? names[kind] : "?";
}

/* ---- the orders ---- */

static pp_action_t act(pp_action_kind_t k, int stage, int m) { return (pp_action_t){k, stage, m}; }

/* gpipe and 1f1b on rank r (its one stage r): w forwards first (M for gpipe), then a forward and
 * a backward in turn while forwards remain, then the backwards left. */
static void one_stage(pp_action_t *a, int r, int M, int w) {
  int n = 0, f = 0, b = 0;
  while (f < w) a[n++] = act(PP_FORWARD, r, f++);
  while (f < M) {
    a[n++] = act(PP_FORWARD, r, f++);
    a[n++] = act(PP_BACKWARD, r, b++);
  }
  while (b < M) a[n++] = act(PP_BACKWARD, r, b++);
}

/* The k-th forward (or backward) of rank r under interleaving: microbatches in groups of P, each
 * group through the rank's stages in turn (backwards through them in reverse). */
static pp_action_t interleaved(pp_action_kind_t kind, int k, int r, int P, int V) {
  int in_group = k % (P * V), chunk = in_group / P;
  if (kind == PP_BACKWARD) chunk = V - 1 - chunk;
  return act(kind, chunk * P + r, k / (P * V) * P + k % P);
}

/* interleaved 1f1b on rank r: warm-up forwards ((P - r - 1) 2 + (V - 1) P, or all when
 * M = P), then a forward and a backward in turn, then the backwards left. */
static void interleaved_1f1b(pp_action_t *a, int r, int P, int M, int V) {
  int total = M * V, w = M == P ? total : (P - r - 1) * 2 + (V - 1) * P;
  if (w > total) w = total;
  int n = 0, f = 0, b = 0;
  while (f < w) a[n++] = interleaved(PP_FORWARD, f++, r, P, V);
  while (f < total) {
    a[n++] = interleaved(PP_FORWARD, f++, r, P, V);
    a[n++] = interleaved(PP_BACKWARD, b++, r, P, V);
  }
  while (b < total) a[n++] = interleaved(PP_BACKWARD, b++, r, P, V);
}

fsdpc_status_t pp_schedule_check_microbatches(pp_schedule_kind_t kind, int ranks,
                                              int microbatches) {
  int P = ranks, M = microbatches;
  if (kind < 0 || kind >= PP_SCHEDULE_COUNT)
    return err_set(STATUS_EINVAL, "pipeline schedule: unknown schedule %d", (int)kind);
  if (kind != PP_GPIPE && M < P)
    return err_set(STATUS_EINVAL,
                   "pipeline schedule %s: %d microbatch%s for %d ranks; it needs "
                   "at least as many microbatches as ranks",
                   names[kind], M, M == 1 ? "" : "es", P);
  if (kind == PP_INTERLEAVED_1F1B && P > 0 && M % P != 0)
    return err_set(STATUS_EINVAL,
                   "pipeline schedule %s: %d microbatches is not a multiple of "
                   "the %d ranks (microbatches go through the stages in groups of the ranks)",
                   names[kind], M, P);
  return STATUS_OK;
}

fsdpc_status_t pp_schedule_new(pp_schedule_kind_t kind, int ranks, int microbatches,
                               int stages_per_rank, pp_schedule_t **out) {
  ARG_NONNULL(out);
  *out = NULL;
  int P = ranks, M = microbatches, V = stages_per_rank;
  if (kind < 0 || kind >= PP_SCHEDULE_COUNT)
    return err_set(STATUS_EINVAL, "pipeline schedule: unknown schedule %d", (int)kind);
  const char *name = names[kind];
  if (P < 1 || M < 1)
    return err_set(STATUS_EINVAL,
                   "pipeline schedule %s: %d ranks and %d microbatches: at least "
                   "one of each",
                   name, P, M);
  if (kind != PP_INTERLEAVED_1F1B && V != 1)
    return err_set(STATUS_EINVAL,
                   "pipeline schedule %s: %d stages a rank; it runs one (%s "
                   "runs several)",
                   name, V, names[PP_INTERLEAVED_1F1B]);
  if (kind == PP_INTERLEAVED_1F1B && V < 2)
    return err_set(STATUS_EINVAL,
                   "pipeline schedule %s: %d stage%s a rank; it needs at least 2 "
                   "(one stage a rank is %s)",
                   name, V, V == 1 ? "" : "s", names[PP_1F1B]);
  FSDPC_TRY(pp_schedule_check_microbatches(kind, P, M));
  if ((long long)2 * M * V * P > (1 << 28))
    return err_set(STATUS_EINVAL,
                   "pipeline schedule %s: %d ranks x %d microbatches x %d stages "
                   "is too many actions",
                   name, P, M, V);
  pp_schedule_t *s = calloc(1, sizeof *s);
  int n = 2 * M * V;
  if (s == NULL || (s->actions = malloc(sizeof(pp_action_t) * (size_t)(n * P))) == NULL) {
    free(s);
    return err_set(STATUS_ENOMEM, "pipeline schedule: out of host memory");
  }
  *s = (pp_schedule_t){kind, P, M, V, s->actions};
  for (int r = 0; r < P; r++) {
    pp_action_t *a = s->actions + (size_t)r * n;
    if (kind == PP_GPIPE) one_stage(a, r, M, M);
    if (kind == PP_1F1B) one_stage(a, r, M, P - r - 1 < M ? P - r - 1 : M);
    if (kind == PP_INTERLEAVED_1F1B) interleaved_1f1b(a, r, P, M, V);
  }
  *out = s;
  return STATUS_OK;
}

void pp_schedule_free(pp_schedule_t *s) {
  if (s == NULL) return;
  free(s->actions);
  free(s);
}

pp_schedule_kind_t pp_schedule_kind(const pp_schedule_t *s) { return s ? s->kind : PP_GPIPE; }
int pp_schedule_ranks(const pp_schedule_t *s) { return s ? s->P : 0; }
int pp_schedule_microbatches(const pp_schedule_t *s) { return s ? s->M : 0; }
int pp_schedule_stages_per_rank(const pp_schedule_t *s) { return s ? s->V : 0; }
int pp_schedule_stages(const pp_schedule_t *s) { return s ? s->P * s->V : 0; }
int pp_schedule_rank_of_stage(const pp_schedule_t *s, int stage) {
  return s && stage >= 0 ? stage % s->P : -1;
}

int pp_schedule_num_actions(const pp_schedule_t *s, int rank) {
  return s && rank >= 0 && rank < s->P ? 2 * s->M * s->V : 0;
}

pp_action_t pp_schedule_action(const pp_schedule_t *s, int rank, int i) {
  if (i < 0 || i >= pp_schedule_num_actions(s, rank)) return act(PP_FORWARD, -1, -1);
  return s->actions[(size_t)rank * (size_t)(2 * s->M * s->V) + (size_t)i];
}

double pp_schedule_bubble(const pp_schedule_t *s) {
  if (s == NULL) return 0;
  double P = s->P, MV = (double)s->M * s->V;
  return (P - 1) / (MV + P - 1);
}

int pp_schedule_max_in_flight(const pp_schedule_t *s, int rank) {
  int live = 0, most = 0;
  for (int i = 0; i < pp_schedule_num_actions(s, rank); i++) {
    live += pp_schedule_action(s, rank, i).kind == PP_FORWARD ? 1 : -1;
    if (live > most) most = live;
  }
  return most;
}

/* ---- the timeline ---- */

/* The simulation; start, if not NULL, receives each action's start time (rank r's action i
 * at r * 2 M V + i). */
static fsdpc_status_t simulate(const pp_schedule_t *s, double forward_time, double backward_time,
                               double *makespan, double *idle, double *start) {
  int P = s->P, M = s->M, S = s->P * s->V, n = 2 * s->M * s->V;
  /* finish times of F(stage, m) and B(stage, m); < 0 until run */
  double *fin = malloc(sizeof(double) * (size_t)(2 * S * M) + sizeof(double) * (size_t)(2 * P));
  if (fin == NULL) return err_set(STATUS_ENOMEM, "pipeline schedule: out of host memory");
  double *ffin = fin, *bfin = fin + (size_t)S * M, *free_at = fin + (size_t)(2 * S * M),
         *busy = free_at + P;
  int *next = calloc((size_t)P, sizeof(int));
  if (next == NULL) {
    free(fin);
    return err_set(STATUS_ENOMEM, "pipeline schedule: out of host memory");
  }
  for (int i = 0; i < 2 * S * M; i++) fin[i] = -1;
  for (int r = 0; r < P; r++) free_at[r] = busy[r] = 0;
  int left = n * P;
  fsdpc_status_t st = STATUS_OK;
  while (left > 0 && st == STATUS_OK) {
    int ran = 0;
    for (int r = 0; r < P; r++)
      while (next[r] < n) {
        pp_action_t a = pp_schedule_action(s, r, next[r]);
        int at = a.stage * M + a.microbatch;
        double ready = free_at[r];
        if (a.kind == PP_FORWARD && a.stage > 0) { /* the previous stage's output */
          if (ffin[at - M] < 0) break;
          if (ffin[at - M] > ready) ready = ffin[at - M];
        }
        if (a.kind == PP_BACKWARD) { /* its own forward, the next stage's input gradient */
          if (ffin[at] < 0 || (a.stage < S - 1 && bfin[at + M] < 0)) break;
          if (ffin[at] > ready) ready = ffin[at];
          if (a.stage < S - 1 && bfin[at + M] > ready) ready = bfin[at + M];
        }
        double d = a.kind == PP_FORWARD ? forward_time : backward_time;
        if (start) start[r * n + next[r]] = ready;
        (a.kind == PP_FORWARD ? ffin : bfin)[at] = free_at[r] = ready + d;
        busy[r] += d;
        next[r]++;
        left--;
        ran++;
      }
    if (ran == 0) {
      int r = 0;
      while (next[r] >= n) r++;
      pp_action_t a = pp_schedule_action(s, r, next[r]);
      st = err_set(STATUS_EINVAL,
                   "pipeline schedule %s: rank %d waits at action %d (%s of stage %d, "
                   "microbatch %d) for one no rank can run",
                   names[s->kind], r, next[r], a.kind == PP_FORWARD ? "forward" : "backward",
                   a.stage, a.microbatch);
    }
  }
  if (st == STATUS_OK) {
    double end = 0;
    for (int r = 0; r < P; r++) end = free_at[r] > end ? free_at[r] : end;
    *makespan = end;
    for (int r = 0; idle && r < P; r++) idle[r] = end - busy[r];
  }
  free(next);
  free(fin);
  return st;
}

fsdpc_status_t pp_schedule_simulate(const pp_schedule_t *s, double forward_time,
                                    double backward_time, double *makespan, double *idle) {
  ARG_NONNULL(s);
  ARG_NONNULL(makespan);
  return simulate(s, forward_time, backward_time, makespan, idle, NULL);
}

fsdpc_status_t pp_schedule_slots(const pp_schedule_t *s, int *slot, int *slots) {
  ARG_NONNULL(s);
  ARG_NONNULL(slot);
  ARG_NONNULL(slots);
  int n = 2 * s->M * s->V;
  double *start = malloc(sizeof(double) * (size_t)(s->P * n)), span = 0;
  if (start == NULL) return err_set(STATUS_ENOMEM, "pipeline schedule: out of host memory");
  fsdpc_status_t st = simulate(s, 1.0, 1.0, &span, NULL, start);
  for (int i = 0; i < s->P * n && st == STATUS_OK; i++) slot[i] = (int)start[i];
  *slots = st == STATUS_OK ? (int)span : 0;
  free(start);
  return st;
}

void pp_schedule_print(const pp_schedule_t *s, int rank, FILE *f) {
  for (int i = 0; i < pp_schedule_num_actions(s, rank); i++) {
    pp_action_t a = pp_schedule_action(s, rank, i);
    fprintf(f, "%c %d %d\n", a.kind == PP_FORWARD ? 'F' : 'B', a.stage, a.microbatch);
  }
}
