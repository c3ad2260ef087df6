/*
 * Pipeline schedules (parallel/pp_schedule.h), checked against their definitions rather than
 * the code's: every rank runs each forward and backward of its stages once, microbatches in
 * order on every stage; small tables written out by hand; every schedule of a grid finishes
 * when run with its dependencies, and its idle time equals the closed-form bubble where
 * theory gives it exactly (gpipe and 1f1b, any forward and backward times; interleaved 1f1b
 * with equal ones); the activations each keeps in flight; the lockstep slots pipeline steps
 * run in (every action after what it consumes); refusals named.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "parallel/pp_schedule.h"
#include "tests/harness.h"

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

/* Rank r's actions as "F0.1 B0.0 ..." (stage.microbatch). */
static void table(const pp_schedule_t *s, int r, char *buf, size_t n) {
  buf[0] = 0;
  for (int i = 0; i < pp_schedule_num_actions(s, r); i++) {
    pp_action_t a = pp_schedule_action(s, r, i);
    snprintf(buf + strlen(buf), n - strlen(buf), "%s%c%d.%d", i ? " " : "",
             a.kind == PP_FORWARD ? 'F' : 'B', a.stage, a.microbatch);
  }
}

static void expect_table(pp_schedule_kind_t k, int P, int M, int V, int r, const char *want) {
  pp_schedule_t *s;
  ok(pp_schedule_new(k, P, M, V, &s));
  char got[512];
  table(s, r, got, sizeof got);
  ck_assert_msg(strcmp(got, want) == 0, "%s P=%d M=%d V=%d rank %d: %s, want %s",
                pp_schedule_name(k), P, M, V, r, got, want);
  pp_schedule_free(s);
}

/* By hand: gpipe all forwards then all backwards; 1f1b with P - r - 1 forwards ahead; the
 * interleaved order in groups of P microbatches through the rank's stages (backwards through
 * them in reverse), all forwards first when M = P. */
START_TEST(small_tables) {
  expect_table(PP_GPIPE, 2, 3, 1, 1, "F1.0 F1.1 F1.2 B1.0 B1.1 B1.2");
  expect_table(PP_1F1B, 2, 4, 1, 0, "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3");
  expect_table(PP_1F1B, 2, 4, 1, 1, "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3");
  expect_table(PP_1F1B, 3, 3, 1, 0, "F0.0 F0.1 F0.2 B0.0 B0.1 B0.2");
  expect_table(PP_INTERLEAVED_1F1B, 2, 2, 2, 0, "F0.0 F0.1 F2.0 F2.1 B2.0 B2.1 B0.0 B0.1");
  /* P = 2, M = 4, V = 2, rank 1: (2 - 1 - 1) 2 + (2 - 1) 2 = 2 warm-up forwards */
  expect_table(PP_INTERLEAVED_1F1B, 2, 4, 2, 1,
               "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3");
}
END_TEST

/* Each rank's actions: every (stage it holds, microbatch) once forward and once backward, a
 * stage's microbatches in order either way, a forward before its backward. */
static void check_actions(const pp_schedule_t *s) {
  int P = pp_schedule_ranks(s), M = pp_schedule_microbatches(s), V = pp_schedule_stages_per_rank(s);
  for (int r = 0; r < P; r++) {
    ck_assert_int_eq(pp_schedule_num_actions(s, r), 2 * M * V);
    int seen[2][8][64] = {{{0}}}, last[2][8];
    for (int k = 0; k < 2; k++)
      for (int c = 0; c < V; c++) last[k][c] = -1;
    for (int i = 0; i < 2 * M * V; i++) {
      pp_action_t a = pp_schedule_action(s, r, i);
      ck_assert_int_eq(pp_schedule_rank_of_stage(s, a.stage), r);
      int c = a.stage / P;
      ck_assert(c < V && a.microbatch >= 0 && a.microbatch < M);
      ck_assert_msg(a.microbatch == last[a.kind][c] + 1, "%s: rank %d, stage %d out of order",
                    pp_schedule_name(pp_schedule_kind(s)), r, a.stage);
      last[a.kind][c] = a.microbatch;
      if (a.kind == PP_BACKWARD) ck_assert(seen[PP_FORWARD][c][a.microbatch]);
      seen[a.kind][c][a.microbatch]++;
    }
    for (int k = 0; k < 2; k++)
      for (int c = 0; c < V; c++)
        for (int m = 0; m < M; m++) ck_assert_int_eq(seen[k][c][m], 1);
  }
}

/* The lockstep slots: a rank's actions in increasing slots, each after what it consumes (its
 * stage's previous forward's output, the next stage's input gradient, its own forward), and
 * as many slots as the simulation with unit times takes. */
static void check_slots(const pp_schedule_t *s) {
  int P = pp_schedule_ranks(s), V = pp_schedule_stages_per_rank(s), M = pp_schedule_microbatches(s);
  int n = 2 * M * V, S = P * V, slots;
  ck_assert_int_eq(pp_schedule_stages(s), S);
  ck_assert_int_eq(pp_schedule_stages(NULL), 0);
  int *slot = malloc(sizeof(int) * (size_t)(P * n)), *f = malloc(sizeof(int) * (size_t)(2 * S * M));
  ok(pp_schedule_slots(s, slot, &slots));
  double span;
  ok(pp_schedule_simulate(s, 1, 1, &span, NULL));
  ck_assert_int_eq(slots, (int)span);
  int *fwd = f, *bwd = f + S * M;
  for (int r = 0; r < P; r++)
    for (int i = 0; i < n; i++) {
      pp_action_t a = pp_schedule_action(s, r, i);
      (a.kind == PP_FORWARD ? fwd : bwd)[a.stage * M + a.microbatch] = slot[r * n + i];
      if (i > 0) ck_assert_int_gt(slot[r * n + i], slot[r * n + i - 1]);
    }
  for (int st = 0; st < S; st++)
    for (int m = 0; m < M; m++) {
      if (st > 0) ck_assert_int_gt(fwd[st * M + m], fwd[(st - 1) * M + m]);
      if (st < S - 1) ck_assert_int_gt(bwd[st * M + m], bwd[(st + 1) * M + m]);
      ck_assert_int_gt(bwd[st * M + m], fwd[st * M + m]);
      ck_assert_int_lt(bwd[st * M + m], slots);
    }
  free(slot);
  free(f);
}

START_TEST(grid_runs_with_the_closed_form_bubble) {
  int checked = 0;
  for (int k = 0; k < PP_SCHEDULE_COUNT; k++)
    for (int P = 1; P <= 8; P *= 2)
      for (int M = 1; M <= 32; M++)
        for (int V = 1; V <= 4; V++) {
          pp_schedule_t *s;
          if (pp_schedule_new((pp_schedule_kind_t)k, P, M, V, &s) != STATUS_OK) continue;
          check_actions(s);
          check_slots(s);
          double times[2][2] = {{1, 1}, {1, 2}}; /* forward, backward */
          for (int t = 0; t < 2; t++) {
            double f = times[t][0], b = times[t][1], span, idle[16];
            ok(pp_schedule_simulate(s, f, b, &span, idle));
            /* the ideal length of a rank's work, M V (f + b), plus the bubble */
            double bubble = pp_schedule_bubble(s), work = (double)M * V * (f + b);
            bool exact = k != PP_INTERLEAVED_1F1B || f == b;
            for (int r = 0; r < P; r++) {
              double frac = idle[r] / span;
              if (exact)
                ck_assert_msg(
                    fabs(frac - bubble) < 1e-12 && fabs(span - work / (1 - bubble)) < 1e-9,
                    "%s P=%d M=%d V=%d f=%g b=%g: rank %d idles %.6f of %.3f, closed "
                    "form %.6f",
                    pp_schedule_name(k), P, M, V, f, b, r, frac, span, bubble);
              else /* interleaving with unequal times: no worse than 1f1b's bubble */
                ck_assert(frac <= (double)(P - 1) / (M + P - 1) + 1e-12);
            }
          }
          /* activations in flight: gpipe all M; 1f1b P - r; interleaved its warm-up + 1 */
          for (int r = 0; r < P; r++) {
            int want = M;
            if (k == PP_1F1B) want = P - r < M ? P - r : M;
            if (k == PP_INTERLEAVED_1F1B) {
              want = M == P ? M * V : (P - r - 1) * 2 + (V - 1) * P + 1;
              if (want > M * V) want = M * V;
            }
            ck_assert_int_eq(pp_schedule_max_in_flight(s, r), want);
          }
          pp_schedule_free(s);
          checked++;
        }
  ck_assert_int_ge(checked, 200);
}
END_TEST

/* At M = 8 on 4 ranks, 1f1b keeps at most 4 microbatches' activations where gpipe keeps 8, and
 * interleaving (V = 2) cuts the bubble from 3/11 to 3/19. */
START_TEST(one_f_one_b_keeps_fewer_activations) {
  pp_schedule_t *g, *o, *i;
  ok(pp_schedule_new(PP_GPIPE, 4, 8, 1, &g));
  ok(pp_schedule_new(PP_1F1B, 4, 8, 1, &o));
  ok(pp_schedule_new(PP_INTERLEAVED_1F1B, 4, 8, 2, &i));
  ck_assert_int_eq(pp_schedule_max_in_flight(g, 0), 8);
  ck_assert_int_eq(pp_schedule_max_in_flight(o, 0), 4);
  ck_assert(fabs(pp_schedule_bubble(o) - 3.0 / 11) < 1e-15);
  ck_assert(fabs(pp_schedule_bubble(i) - 3.0 / 19) < 1e-15);
  pp_schedule_free(g);
  pp_schedule_free(o);
  pp_schedule_free(i);
}
END_TEST

static void refused(pp_schedule_kind_t k, int P, int M, int V, const char *words) {
  pp_schedule_t *s = (pp_schedule_t *)1;
  ck_assert_int_eq(pp_schedule_new(k, P, M, V, &s), STATUS_EINVAL);
  ck_assert(s == NULL);
  ck_assert_msg(strstr(err_detail(), words) != NULL, "'%s' lacks '%s'", err_detail(), words);
}

START_TEST(bad_sizes_are_refused_by_name) {
  refused(PP_1F1B, 4, 3, 1, "1f1b: 3 microbatches for 4 ranks");
  refused(PP_INTERLEAVED_1F1B, 4, 4, 1, "interleaved_1f1b: 1 stage a rank");
  refused(PP_INTERLEAVED_1F1B, 4, 6, 2, "6 microbatches is not a multiple of the 4 ranks");
  refused(PP_GPIPE, 2, 4, 2, "gpipe: 2 stages a rank");
  refused(PP_GPIPE, 0, 4, 1, "0 ranks and 4 microbatches");
  pp_schedule_kind_t k;
  ck_assert(pp_schedule_parse("interleaved_1f1b", &k) && k == PP_INTERLEAVED_1F1B);
  ck_assert(!pp_schedule_parse("zb", &k));
  ck_assert_str_eq(pp_schedule_name(PP_1F1B), "1f1b");
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("pp_schedule");
  TCase *tc = tcase_create("pp_schedule");
  tcase_add_test(tc, small_tables);
  tcase_add_test(tc, grid_runs_with_the_closed_form_bubble);
  tcase_add_test(tc, one_f_one_b_keeps_fewer_activations);
  tcase_add_test(tc, bad_sizes_are_refused_by_name);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
