/*
 * Pipeline execution (parallel/pipeline.h) against the single-rank model: a Llama of 4 blocks
 * split into stages by blocks (the embedding on the first, the final norm, head and loss on
 * the last) on the world's ranks as pipeline ranks, each schedule that fits the world (gpipe,
 * 1f1b, and interleaved 1f1b with 2 stages a rank), trains ten steps of 4 microbatches with
 * the losses, every gradient of a rank's stages and the updated parameters of the single rank
 * that runs the microbatches in turn (1e-5); a rank holds no gradient outside its stages; the
 * point-to-point bytes of every step are the closed form (an activation forward and a
 * gradient back across each boundary a rank owns, per microbatch). With "dp:N" the world is
 * (pp, dp_shard) = (world / N, N): each rank's stages fully sharded over its N data-parallel
 * ranks (every block a unit, the embedding one, the final norm and head one), each dp rank's
 * microbatches its own, matching the single rank that averages them (gradients 1e-4 of the
 * tensor's norm: summed in another order). The trained stages saved (each rank its own shards,
 * under the global names) load into one rank's whole model with the single rank's values.
 * With "tp:N" the world is (pp, tp) instead: tensor parallelism inside the stages (the
 * built-in Llama plan, replicated activations between stages). Options that do not fit the
 * group are refused before anything runs.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/dcp.h"
#include "models/llama/llama_plan.h"
#include "nn/ops.h"
#include "parallel/pipeline.h"
#include "tests/dist/fsdp_common.h"

#define STEPS 10
#define MICRO 4
#define LAYERS 4

typedef struct stages {
  llama_t *m;
  int S; /* stages */
  fsdpc_data_t *d;
  data_spec_t spec;
  int64_t step;
  pg_t *pp_pg;
  /* the forwarded hook: microbatches it was called for in this step, in order; the ones a
   * backward found not yet forwarded, and the hook's calls that did not find every stage's
   * forward of their microbatch done, or the pipeline's ranks on other microbatches; this
   * rank's stage forwards of each microbatch */
  int forwarded[MICRO], n_forwarded, early_backwards, bad_calls, forwards[MICRO];
} stages_t;

/* After the last stage's forward of mb: on every rank of the pipeline at once, all on mb (the
 * sum of mb over the group is its size times mb), with every stage's forward of mb done (this
 * rank's stages' forwards of mb, summed over the group, are all the stages), in microbatch
 * order. */
static fsdpc_status_t on_forwarded(int mb, void *user) {
  stages_t *u = user;
  double v[2] = {mb, u->forwards[mb]};
  FSDPC_TRY(pg_host_all_reduce(u->pp_pg, v, v, 2, PG_HOST_F64, REDUCE_SUM));
  if (v[0] != (double)pg_size(u->pp_pg) * mb || v[1] != u->S || u->n_forwarded >= MICRO)
    u->bad_calls++;
  if (u->n_forwarded < MICRO) u->forwarded[u->n_forwarded++] = mb;
  return STATUS_OK;
}

/* Every backward of mb comes after the hook's call for mb. */
static fsdpc_status_t before_backward(int s, int mb, void *user) {
  (void)s;
  stages_t *u = user;
  bool seen = false;
  for (int i = 0; i < u->n_forwarded; i++) seen |= u->forwarded[i] == mb;
  if (!seen) u->early_backwards++;
  return STATUS_OK;
}

static fsdpc_status_t input_ids(int mb, nn_var_t **out, void *user) {
  stages_t *u = user;
  fsdpc_tensor_t in, tg;
  FSDPC_TRY(data_batch(u->d, &u->spec, u->step, mb, &in, &tg));
  tensor_free(&tg);
  return nn_var_new(&in, false, out);
}

/* Stage s of the model (llama_stage_forward), the loss after the last. */
static fsdpc_status_t stage_forward(nn_ctx_t *ctx, int s, int mb, nn_var_t *in, nn_var_t **out,
                                    void *user) {
  stages_t *u = user;
  nn_var_t *h = NULL, *loss = NULL;
  FSDPC_TRY(llama_stage_forward(ctx, u->m, s, u->S, in, &h));
  u->forwards[mb]++;
  if (s < u->S - 1) {
    *out = h;
    return STATUS_OK;
  }
  fsdpc_tensor_t ids, tg;
  fsdpc_status_t st = data_batch(u->d, &u->spec, u->step, mb, &ids, &tg);
  if (st == STATUS_OK) {
    tensor_free(&ids);
    st = nn_cross_entropy(ctx, h, &tg, &loss, NULL);
    tensor_free(&tg);
  }
  nn_var_put(h);
  *out = loss;
  return st;
}

/* The rank holding parameter fqn: its block's stage's (the embedding's: stage 0's; the norm's
 * and head's: the last stage's). */
static int owner(const char *fqn, int S, int P) {
  int layer;
  if (sscanf(fqn, "model.layers.%d.", &layer) == 1) return (layer * S / LAYERS) % P;
  return strstr(fqn, "embed_tokens") ? 0 : (S - 1) % P;
}

/* The ranks beside the pipeline of argument "KIND:N" (KIND dp or tp; default 1). */
static int beside(const char *kind) {
  for (int i = 1; i < test_argc(); i++)
    if (strncmp(test_argv()[i], kind, 3) == 0) return atoi(test_argv()[i] + 3);
  return 1;
}
static int dp_size(void) { return beside("dp:"); }
static int tp_size(void) { return beside("tp:"); }

/* With data parallelism, each of this rank's stages fully sharded over its dp group: every
 * block a unit, the embedding one, the final norm and the head one. */
static void shard_stages(llama_t *m, int r, int P, int S, mesh_t *dp) {
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = dp;
  nn_module_t *root = llama_module(m);
  for (int s = r; s < S; s += P) {
    for (int i = s * LAYERS / S; i < (s + 1) * LAYERS / S; i++)
      ok(fully_shard(llama_layer(m, i), &opt, NULL));
    if (s == 0) ok(fully_shard(nn_module_find(root, "model.embed_tokens"), &opt, NULL));
    if (s == S - 1) {
      nn_module_t *tail[] = {nn_module_find(root, "model.norm"), nn_module_find(root, "lm_head")};
      ok(fully_shard_modules(tail, 2, &opt, NULL));
    }
  }
}

static double norm2(const fsdpc_tensor_t *t) { /* f32 on the host, any strides */
  fsdpc_tensor_t h;
  ok(tensor_clone(&h, t, DTYPE_F32, device_cpu()));
  double s = 0;
  for (int64_t k = 0; k < tensor_numel(&h); k++)
    s += (double)((float *)h.data)[k] * ((float *)h.data)[k];
  tensor_free(&h);
  return sqrt(s);
}

/* Parameter i's gradient or value shard (this rank's stages) against the reference's slice at
 * its offset, relative to the whole reference tensor's norm (as test_fsdp's compare_shards). */
static double shard_error(const run_t *ref, const run_t *pp, int i, bool grads) {
  const dtensor_t *rv = grads ? ref->ps[i]->grad : ref->ps[i]->value;
  const dtensor_t *sv = grads ? pp->ps[i]->grad : pp->ps[i]->value;
  const fsdpc_tensor_t *mine = dtensor_local(sv);
  if (tensor_numel(mine) == 0) return 0;
  int64_t off[TENSOR_MAX_DIMS];
  dtensor_offset(sv, off);
  fsdpc_tensor_t want;
  ok(tensor_narrow_box(&want, dtensor_local(rv), off, mine->shape));
  double e = test_rel_l2(mine, &want) * norm2(&want) / (norm2(dtensor_local(rv)) + 1e-30);
  tensor_free(&want);
  return e;
}

/* The parameters saved from every rank's stages under their global names (each rank its own
 * shards) load into one rank's whole model: the reference's trained values. */
static int saved_loads_whole(const run_t *ref, const run_t *pp, int S, int P, int r) {
  char dir[300] = "";
  if (world_rank() == 0) {
    char root[] = "/tmp/fsdpc-pipeline-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(root));
    snprintf(dir, sizeof dir, "%s/ckpt", root);
  }
  MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
  dcp_entry_t *e = calloc((size_t)pp->n, sizeof *e);
  int n = 0;
  for (int i = 0; i < pp->n; i++)
    if (owner(pp->ps[i]->fqn, S, P) == r) e[n++] = (dcp_entry_t){pp->ps[i]->fqn, pp->ps[i]->value};
  ok(dcp_save(dir, e, n, world_pg()));
  llama_config_t cfg = *llama_get_config(ref->m);
  run_t whole;
  run_init(&whole, &cfg);
  ok(nn_named_parameters(llama_module(whole.m), &whole.ps, &whole.n));
  for (int i = 0; i < whole.n; i++) e[i] = (dcp_entry_t){whole.ps[i]->fqn, whole.ps[i]->value};
  ok(dcp_load(dir, e, whole.n, NULL));
  int bad = 0;
  for (int i = 0; i < whole.n; i++)
    if (test_rel_l2(dtensor_local(whole.ps[i]->value), dtensor_local(ref->ps[i]->value)) > 1e-5) {
      bad++;
      printf("rank %d: %s loaded from the pipeline's checkpoint differs\n", r, whole.ps[i]->fqn);
    }
  free(e);
  free(whole.ps);
  llama_free(whole.m);
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %.*s", (int)(strrchr(dir, '/') - dir), dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
  }
  return bad;
}

static void run_schedule(pp_schedule_kind_t kind, int V) {
  /* the world as (pp, dp_shard) or (pp, tp): the second dimension's ranks share a stage */
  int DP = dp_size(), TP = tp_size(), P = world_size() / (DP * TP), S = P * V;
  int shape[2] = {P, DP * TP};
  const char *names[2] = {"pp", TP > 1 ? "tp" : "dp_shard"};
  mesh_t *mesh, *side;
  ok(mesh_new(2, shape, names, DEVICE_CPU, &mesh));
  ok(mesh_slice(mesh, 1, &names[1], &side));
  pg_t *pp_pg = mesh_group(mesh, 0), *dp_pg = mesh_group(mesh, 1);
  int r = mesh_coord(mesh, 0);
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  cfg.n_layers = LAYERS;
  run_t ref, pp;
  run_init(&ref, &cfg);
  run_init(&pp, &cfg);
  if (DP > 1) shard_stages(pp.m, r, P, S, side);
  tp_plan_t *tp = NULL; /* tensor parallelism inside the stages: the built-in Llama plan */
  if (TP > 1) {
    const tp_rule_t *rules;
    int nr = llama_plan_tp_rules(NULL, &rules);
    ok(tensor_parallel(llama_module(pp.m), side, rules, nr, false, &tp));
  }
  run_optim(&ref);
  run_optim(&pp);
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  const int64_t B = 2, T = 16;
  stages_t u = {.m = pp.m, .S = S, .d = d, .pp_pg = pp_pg};
  u.spec = (data_spec_t){.batch_size = B,
                         .seq_len = T,
                         .grad_accum = MICRO,
                         .dp_size = DP,
                         .dp_rank = DP > 1 ? mesh_coord(mesh, 1) : 0};
  pp_schedule_t *sched;
  ok(pp_schedule_new(kind, P, MICRO, V, &sched));
  pp_step_options_t o = PP_STEP_OPTIONS_INIT;
  o.group = pp_pg;
  o.schedule = sched;
  o.ndim = 3;
  o.shape[0] = B, o.shape[1] = T, o.shape[2] = cfg.dim;
  o.forward = stage_forward;
  o.input = input_ids;
  o.forwarded = on_forwarded;
  o.before_backward = before_backward;
  o.user = &u;
  pp_step_stats_t stats;
  o.stats = &stats;
  /* every boundary a rank's stages own, crossed by one activation forward (not out of the
   * last stage) and one gradient back (not into stage 0) per microbatch */
  uint64_t want = 0, each = (uint64_t)(B * T * cfg.dim) * 4;
  for (int s = r; s < S; s += P) want += (uint64_t)MICRO * each * ((s < S - 1) + (s > 0));
  ck_assert_uint_eq(pp_step_send_bytes(&o, r), want);
  lr_schedule_t lrs = {.warmup_steps = 3, .total_steps = STEPS, .min_ratio = 0.1};
  int bad = 0;
  for (int step = 0; step < STEPS; step++) {
    optim_zero_grad(ref.opt);
    optim_zero_grad(pp.opt);
    double lref = 0, lpp = 0;
    for (int m = 0; m < MICRO; m++) lref += ref_fwd_bwd(ref.m, d, &u.spec, step, m) / MICRO;
    ref_average_grads(&ref, DP);
    u.step = step;
    u.n_forwarded = 0;
    memset(u.forwards, 0, sizeof u.forwards);
    pg_reset_counters(pp_pg);
    ok(pp_step(&o, &lpp));
    bool in_order = u.n_forwarded == MICRO;
    for (int m = 0; m < u.n_forwarded; m++) in_order &= u.forwarded[m] == m;
    if (!in_order || u.early_backwards || u.bad_calls) {
      bad++;
      printf(
          "rank %d, step %d: the forwarded hook ran for %d microbatches (in order: %d), %d "
          "backwards came before it, %d calls were early or on other microbatches\n",
          r, step, u.n_forwarded, in_order, u.early_backwards, u.bad_calls);
    }
    /* the dp mean (the tp ranks of a stage hold the same loss) */
    ok(pg_host_all_reduce(dp_pg, &lpp, &lpp, 1, PG_HOST_F64, REDUCE_SUM));
    lpp /= DP * TP;
    pg_counters_t c = pg_counters(pp_pg);
    /* the tapes kept at once: what the schedule says it keeps in flight */
    if (stats.max_in_flight != pp_schedule_max_in_flight(sched, r) ||
        !(stats.wait_seconds <= stats.seconds)) {
      bad++;
      printf("rank %d, step %d: %d microbatches in flight (the schedule: %d)\n", r, step,
             stats.max_in_flight, pp_schedule_max_in_flight(sched, r));
    }
    if (c.bytes[PG_SEND_RECV] != want) {
      bad++;
      printf("rank %d, step %d: %llu point-to-point bytes, want %llu\n", r, step,
             (unsigned long long)c.bytes[PG_SEND_RECV], (unsigned long long)want);
    }
    if (fabs(lpp - lref) > 1e-5 * fabs(lref)) {
      bad++;
      if (r == 0) printf("step %d: pipeline loss %.8f, single rank %.8f\n", step, lpp, lref);
    }
    for (int i = 0; i < pp.n; i++) { /* this rank's stages' gradients, and only those */
      bool mine = owner(pp.ps[i]->fqn, S, P) == r;
      if (mine != (pp.ps[i]->grad != NULL)) {
        bad++;
        printf("rank %d: %s %s a gradient\n", r, pp.ps[i]->fqn, mine ? "lacks" : "has");
        continue;
      }
      if (!mine) continue;
      /* with dp the gradients are averaged in another order (each microbatch's over dp,
       * then summed): fp32 rounding, largest in the attention's q and k weights, whose
       * gradients cancel (measured up to 5.5e-5 of the tensor's norm by step 8 under
       * OpenBLAS's Haswell kernels) */
      double e = shard_error(&ref, &pp, i, true);
      /* tp: partial sums in another order, the same q and k weights (7.5e-5 by step 9 in
       * the sanitized build) */
      if (e > (DP > 1 || TP > 1 ? 1e-4 : 1e-5)) {
        bad++;
        printf("rank %d, step %d: %s gradient differs by %.3g\n", r, step, pp.ps[i]->fqn, e);
      }
    }
    ok(clip_grad_norm(ref.ps, ref.n, 1.0, NULL, NULL));
    ok(clip_grad_norm(pp.ps, pp.n, 1.0, world_pg(), NULL)); /* the norm over every stage */
    ok(optim_step(ref.opt, lr_schedule_factor(&lrs, step)));
    ok(optim_step(pp.opt, lr_schedule_factor(&lrs, step)));
  }
  for (int i = 0; i < pp.n; i++)
    if (owner(pp.ps[i]->fqn, S, P) == r && shard_error(&ref, &pp, i, false) > 1e-5) bad++;
  bad += saved_loads_whole(&ref, &pp, S, P, r);
  expect_all(bad == 0, "%s, %d stages: %d mismatches with the single-rank run",
             pp_schedule_name(kind), S, bad);
  pp_schedule_free(sched);
  for (run_t *x = &ref; x; x = x == &ref ? &pp : NULL) {
    optim_free(x->opt);
    free(x->ps);
    llama_free(x->m);
  }
  data_free(d);
  tp_free(tp);
  mesh_free(side);
  mesh_free(mesh);
}

START_TEST(gpipe_matches_one_rank) { run_schedule(PP_GPIPE, 1); }
END_TEST
START_TEST(one_f_one_b_matches_one_rank) { run_schedule(PP_1F1B, 1); }
END_TEST
START_TEST(interleaved_matches_one_rank) { run_schedule(PP_INTERLEAVED_1F1B, 2); }
END_TEST

/* A step of a schedule for ranks pipeline ranks over group is refused with want, before
 * anything runs. */
static void refused(pg_t *group, int ranks, const char *want) {
  pp_schedule_t *sched;
  ok(pp_schedule_new(PP_GPIPE, ranks, MICRO, 1, &sched));
  pp_step_options_t o = PP_STEP_OPTIONS_INIT;
  o.group = group;
  o.schedule = sched;
  o.ndim = 1;
  o.shape[0] = 4;
  o.forward = stage_forward;
  o.input = input_ids;
  ck_assert_int_eq(pp_step(&o, NULL), STATUS_EINVAL);
  ck_assert_msg(strstr(err_detail(), want), "%s", err_detail());
  pp_schedule_free(sched);
}

/* A group of another size than the schedule's. */
START_TEST(bad_options_are_refused) {
  refused(world_pg(), world_size() + 1, "the schedule is for");
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("pipeline");
  TCase *tc = tcase_create("pipeline");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, gpipe_matches_one_rank);
  tcase_add_test(tc, one_f_one_b_matches_one_rank);
  if (LAYERS % (2 * (world_size() / (dp_size() * tp_size()))) == 0)
    tcase_add_test(tc, interleaved_matches_one_rank);
  tcase_add_test(tc, bad_options_are_refused);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
