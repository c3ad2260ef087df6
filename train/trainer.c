/*
 * The trainer (trainer.h): fsdp-train's run, for a built-in architecture or the program's own
 * model, under a YAML parallelism plan.
 *
 *   mpirun -n 4 fsdp-train configs/fsdp.yaml [--set key.path=value]... [--metrics PATH]
 *       [--dry-run [-v]]
 *
 * Prints a header (world, mesh, plan, parameters, per-rank sharded bytes), a line per logged
 * step and a summary; --metrics (or log.metrics) writes one JSON object per step from rank 0,
 * and --plot draws that file as SVG at the end (as fsdp-plot does).
 * --dry-run builds the sharded model meta (no parameter memory) and prints placements, shapes,
 * the peak memory of a step and its communication without training; -v adds a table of the
 * fully_shard units. Bad input is reported by every rank, with a non-zero exit.
 * This file sets a run up (arguments, plan, data, model, checkpoint); loop.c trains it.
 */
#include <cJSON.h>
#include <errno.h>
#include <fnmatch.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/hf_weights.h"
#include "checkpoint/train_ckpt.h"
#include "core/file.h"
#include "mesh/world.h"
#include "models/llama/llama_plan.h"
#include "nn/layers.h"
#include "nn/moe.h"
#include "parallel/parallelize.h"
#include "train/hf_convert.h"
#include "train/llama_cost.h"
#include "train/metrics_impl.h"
#include "train/ops_impl.h"
#include "train/plan.h"
#include "train/plan_impl.h"
#include "train/plot.h"
#include "train/run_impl.h"
#include "train/save_impl.h"
#include "train/train.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: %s CONFIG.yaml [--set key.path=value]... [--metrics PATH] [--plot OUT.svg]\n"
          "       %*s [--dry-run [-v] [--world N [--ranks-per-node M]]]\n"
          "       %s --help | --version\n"
          "  under mpirun -n N for N ranks; the plan's mesh must multiply to N;\n"
          "  an option's value may follow it or an '=' (--set=k=v); -v is --verbose\n",
          train_prog(), (int)strlen(train_prog()), "", train_prog());
}

/* An option given at most once (the run writes one metrics file, one plot). */
static fsdpc_status_t once(const char **slot, const char *opt, const char *value) {
  if (*slot != NULL)
    return err_set(STATUS_EINVAL, "%s given twice ('%s' and '%s'): a run writes one", opt, *slot,
                   value);
  *slot = value;
  return STATUS_OK;
}

static fsdpc_status_t parse_args(int argc, char **argv, args_t *a) {
  memset(a, 0, sizeof *a);
  for (int i = 1; i < argc; i++) {
    const char *s = argv[i];
    if (strcmp(s, "--set") == 0 || strcmp(s, "--metrics") == 0 || strcmp(s, "--plot") == 0) {
      if (i + 1 >= argc) return err_set(STATUS_EINVAL, "%s needs a value", s);
      if (s[2] == 's') {
        if (a->n_sets == 256) return err_set(STATUS_EINVAL, "more than 256 --set options");
        a->sets[a->n_sets++] = argv[++i];
      } else {
        FSDPC_TRY(once(s[2] == 'p' ? &a->plot : &a->metrics, s, argv[++i]));
      }
    } else if (strncmp(s, "--set=", 6) == 0) {
      if (a->n_sets == 256) return err_set(STATUS_EINVAL, "more than 256 --set options");
      a->sets[a->n_sets++] = s + 6;
    } else if (strncmp(s, "--metrics=", 10) == 0) {
      FSDPC_TRY(once(&a->metrics, "--metrics", s + 10));
    } else if (strncmp(s, "--plot=", 7) == 0) {
      FSDPC_TRY(once(&a->plot, "--plot", s + 7));
    } else if (strcmp(s, "--world") == 0 || strcmp(s, "--ranks-per-node") == 0 ||
               strncmp(s, "--world=", 8) == 0 || strncmp(s, "--ranks-per-node=", 17) == 0) {
      int *dst = s[2] == 'w' ? &a->world : &a->ranks_per_node;
      const char *eq = strchr(s, '='), *arg = eq ? eq + 1 : i + 1 < argc ? argv[i + 1] : NULL;
      char name[24];
      snprintf(name, sizeof name, "%.*s", eq ? (int)(eq - s) : (int)strlen(s), s);
      char *end = NULL;
      long v = arg ? strtol(arg, &end, 10) : 0;
      if (arg == NULL || end == arg || *end != 0 || v < 1 || v > (1L << 20))
        return err_set(STATUS_EINVAL, "%s: expected a number of ranks from 1 to %ld, got '%s'",
                       name, 1L << 20, arg ? arg : "");
      *dst = (int)v;
      i += eq == NULL;
    } else if (strcmp(s, "--dry-run") == 0) {
      a->dry_run = true;
    } else if (strcmp(s, "-v") == 0 || strcmp(s, "--verbose") == 0) {
      a->verbose = s[1] == 'v' ? "-v" : "--verbose";
    } else if (s[0] == '-' && s[1] != 0) {
      return err_set(STATUS_EINVAL, "unknown option '%s'", s);
    } else if (a->config == NULL) {
      a->config = s;
    } else {
      return err_set(STATUS_EINVAL, "more than one plan file ('%s' and '%s')", a->config, s);
    }
  }
  if (a->config == NULL) return err_set(STATUS_EINVAL, "no plan file given");
  if (a->verbose && !a->dry_run)
    return err_set(STATUS_EINVAL, "%s goes with --dry-run", a->verbose);
  if (a->world && !a->dry_run)
    return err_set(STATUS_EINVAL, "--world plans a job without running it: it goes with --dry-run");
  if (a->ranks_per_node && !a->world)
    return err_set(STATUS_EINVAL, "--ranks-per-node goes with --world");
  if (a->metrics != NULL && a->metrics[0] == 0) /* an unset shell variable: no metrics */
    return err_set(STATUS_EINVAL, "--metrics '': empty path");
  return STATUS_OK;
}

static bool agree(fsdpc_status_t st) { return world_agree_report(st, train_prog()); }

/* A token stream (data.path or eval.path: key, at where), checked for one sample (a dry run
 * too: it must refuse what the run would). Only the files' sizes and llm.c's headers are read:
 * token ids are checked against the vocabulary where each batch reads them (data_batch), so
 * a stream of any size starts at once. Local (every rank reaches the same verdict). */
static fsdpc_status_t open_tokens(const run_t *r, const char *path, data_format_t format,
                                  const plan_where_t *where, const char *key, fsdpc_data_t **out) {
  const fsdpc_plan_t *p = &r->plan;
  /* a pattern over the folder checkpoint.dir lies in would take it, or a folder made for it
   * (made before this) */
  size_t cl = strlen(p->ckpt_dir);
  while (cl > 1 && p->ckpt_dir[cl - 1] == '/') cl--;
  char ck[PLAN_PATH_MAX];
  for (size_t n = 1; data_is_pattern(path) && n <= cl; n++) {
    if (n < cl && p->ckpt_dir[n] != '/') continue;
    snprintf(ck, sizeof ck, "%.*s", (int)n, p->ckpt_dir);
    if (fnmatch(path, ck, FNM_PATHNAME | FNM_PERIOD) != 0) continue;
    if (n == cl)
      return err_set(STATUS_EINVAL,
                     "%s: %s: the pattern '%s' matches checkpoint.dir '%s': narrow the pattern "
                     "or keep the checkpoints outside the data's folder",
                     where->text, key, path, p->ckpt_dir);
    return err_set(STATUS_EINVAL,
                   "%s: %s: the pattern '%s' matches '%s', a folder of checkpoint.dir '%s': "
                   "narrow the pattern or keep the checkpoints outside the data's folder",
                   where->text, key, path, ck, p->ckpt_dir);
  }
  fsdpc_status_t st = data_open(path, format, out);
  if (st != STATUS_OK) return err_prefix(st, "%s: %s", where->text, key);
  int64_t need = p->seq_len + 2; /* a sample and its targets, at one start of at least two */
  if (data_num_tokens(*out) < need)
    return err_set(STATUS_EINVAL,
                   "%s: %s: '%s' has %lld tokens; a sample needs data.seq_len + 2 = %lld (its "
                   "seq_len inputs, the targets one further, and a second start to draw from)",
                   where->text, key, path, (long long)data_num_tokens(*out), (long long)need);
  return STATUS_OK;
}

/* Every rank reads the same stream: its token count compared over the world (copies of the
 * data on each node that differ, or a pattern matching other files on some, would give each
 * rank other samples, and a shuffle of its own). Collective. */
static fsdpc_status_t same_tokens(const fsdpc_data_t *d, const char *key, const char *path) {
  int64_t n = d ? data_num_tokens(d) : -1, v[2] = {n, -n}; /* the largest, and the smallest */
  FSDPC_TRY(pg_host_all_reduce(world_pg(), v, v, 2, PG_HOST_I64, REDUCE_MAX));
  int64_t hi = v[0], lo = -v[1];
  if (lo == hi) return STATUS_OK;
  return err_set(STATUS_EINVAL,
                 "%s: '%s' holds %lld tokens on this rank, between %lld and %lld on the ranks: "
                 "every rank must read the same data (another copy of it on some node, or a "
                 "pattern matching other files there?)",
                 key, path, (long long)n, (long long)lo, (long long)hi);
}

static fsdpc_status_t open_data(run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  FSDPC_TRY(open_tokens(r, p->data_path, p->data_format, &p->data_where, "data.path", &r->data));
  if (!p->eval_path[0]) return STATUS_OK;
  return open_tokens(r, p->eval_path, p->eval_format, &p->eval_path_where, "eval.path", &r->eval);
}

/* The forwards of an evaluation: eval.batches global batches, each of grad_accum forwards of
 * eval.batch_size samples on every data-parallel rank, as a step's micro-batches (with the
 * default eval.batch_size, data.batch_size, a global batch is the training's: every plan of
 * one global batch evaluates the same samples). Forward f reads the samples of global
 * micro-batch f of eval.path (train_eval_batch takes one micro-batch of a step f). */
static int64_t eval_forwards(const fsdpc_plan_t *p) { return p->eval_batches * p->grad_accum; }

fsdpc_status_t train_eval_agree(const run_t *r, const data_spec_t *one, int64_t f, bool reads,
                                bool stoppable, double batch_s, fsdpc_tensor_t *ids,
                                fsdpc_tensor_t *targets, train_stop_t *cut, bool *agreed) {
  data_spec_t single = *one;
  single.grad_accum = 1;
  fsdpc_status_t st = reads ? data_batch(r->eval, &single, f, 0, ids, targets) : STATUS_OK;
  if (st != STATUS_OK) st = err_prefix(st, "eval.path");
  if ((st = pg_agree(world_pg(), st)) != STATUS_OK) {
    *agreed = true;
    return st;
  }
  if (!stoppable) return STATUS_OK;
  const fsdpc_plan_t *p = &r->plan;
  bool time_up =
      p->time_limit_s > 0 && device_clock_seconds() - r->t_launch + 2 * batch_s > p->time_limit_s;
  double v[1 + PLAN_MAX_SIGNALS];
  int n = train_stop_values(p, time_up, v);
  FSDPC_TRY(pg_host_all_reduce(world_pg(), v, v, n, PG_HOST_F64, REDUCE_SUM));
  *cut = train_stop_of(p, v);
  return STATUS_OK;
}

/* The mean loss over eval_forwards of eval.path (the same samples every time, in the training
 * data's order), without gradients; then every unit's parameters are released (the root keeps
 * them gathered after a forward, for the backward that would follow). Before each forward its
 * samples are read on every rank, agreed, and the forward runs on them: a file cut short
 * since the start stops every rank alike, the model intact. Collective over the world. */
fsdpc_status_t train_evaluate(run_t *r, const data_spec_t *spec, bool stoppable,
                              train_eval_t *out) {
  *out = (train_eval_t){0};
  double sum = 0, l = 0, t0 = device_clock_seconds(), batch_s = 0;
  data_spec_t one = *spec;
  one.batch_size = r->plan.eval_batch_size;
  int64_t n = eval_forwards(&r->plan);
  stoppable = stoppable && (r->plan.n_signals > 0 || r->plan.time_limit_s > 0);
  fsdpc_status_t st = STATUS_OK;
  if (r->pp_sched != NULL)
    st = train_pp_eval(r, &one, n, stoppable, &sum, &out->stop, &out->agreed, &out->done);
  for (int64_t f = 0; r->pp_sched == NULL && f < n && st == STATUS_OK; f++) {
    double tb = device_clock_seconds();
    fsdpc_tensor_t ids = {0}, tg = {0};
    st =
        train_eval_agree(r, &one, f, true, stoppable, batch_s, &ids, &tg, &out->stop, &out->agreed);
    bool cut = train_stop_any(out->stop);
    if (st == STATUS_OK && !cut) st = train_eval_batch_on(r->root, r->dev, &ids, &tg, &l);
    tensor_free(&ids);
    tensor_free(&tg);
    if (st != STATUS_OK || cut) break;
    sum += l;
    batch_s = device_clock_seconds() - tb;
    out->done = f + 1;
  }
  out->forwards = n;
  out->secs = device_clock_seconds() - t0;
  for (int i = 0; i < r->n_groups; i++) fsdp_reshard(r->groups[i]);
  if (st != STATUS_OK) return out->agreed ? st : world_stop(st); /* else others would wait */
  if (train_stop_any(out->stop)) return STATUS_OK;
  double all = 0;
  FSDPC_TRY(pg_host_all_reduce(world_pg(), &sum, &all, 1, PG_HOST_F64, REDUCE_SUM));
  /* every rank's tokens count the same; the ranks of one tp group hold the same loss */
  out->loss = all / (double)world_size() / (double)n;
  r->eval_s = device_clock_seconds() - t0;
  return STATUS_OK;
}

double train_eval_estimate(const run_t *r, double step_s) {
  if (r->eval == NULL) return 0;
  if (r->eval_s > 0) return r->eval_s;
  /* a forward is about a third of a forward and backward; a step's micro-batches are
   * data.batch_size samples, the evaluation's eval.batch_size */
  const fsdpc_plan_t *p = &r->plan;
  return step_s / 3.0 * (double)p->eval_batches * (double)p->eval_batch_size /
         (double)(p->batch_size > 0 ? p->batch_size : 1);
}

/* optim.param_groups name the whole model's parameters (under a pipeline every rank's model
 * has them all, meta outside its stages): a pattern that matches none is refused, on every
 * rank alike, a dry run's too. */
static fsdpc_status_t check_param_groups(const run_t *r) {
  const adamw_config_t *cfg = &r->plan.optim;
  if (cfg->n_groups == 0) return STATUS_OK;
  nn_param_t **ps = NULL;
  int n = 0;
  FSDPC_TRY(nn_named_parameters(r->root, &ps, &n));
  fsdpc_status_t st = STATUS_OK;
  for (int g = 0; g < cfg->n_groups && st == STATUS_OK; g++)
    if (!optim_group_matches(&cfg->groups[g], ps, n))
      st = err_set(STATUS_EINVAL,
                   "optim.param_groups: '%s' matches no parameter of the model (--dry-run -v "
                   "lists their names)",
                   cfg->groups[g].pattern);
  for (int g = 1; g < cfg->n_groups && st == STATUS_OK; g++) { /* one that never applies */
    int by = -1;
    bool owns = false;
    for (int k = 0; k < n && !owns; k++) {
      if (!optim_group_matches(&cfg->groups[g], &ps[k], 1)) continue;
      int first = 0;
      while (!optim_group_matches(&cfg->groups[first], &ps[k], 1)) first++;
      owns = first == g;
      by = first;
    }
    if (!owns && by >= 0)
      st = err_set(STATUS_EINVAL,
                   "optim.param_groups: every parameter '%s' matches is taken by the earlier "
                   "'%s' (the first matching pattern wins: put the more specific one first)",
                   cfg->groups[g].pattern, cfg->groups[by].pattern);
  }
  free(ps);
  return st;
}

/* The optimizer of this rank's parameters (check_param_groups has checked the groups): the
 * groups that match one of them (under a pipeline the others name another stage's). */
static fsdpc_status_t optim_for_rank(run_t *r) {
  adamw_config_t cfg = r->plan.optim;
  int k = 0;
  for (int g = 0; g < cfg.n_groups; g++)
    if (optim_group_matches(&cfg.groups[g], r->ps, r->n)) cfg.groups[k++] = cfg.groups[g];
  cfg.n_groups = k;
  return optim_new(r->ps, r->n, &cfg, &r->opt);
}

/* What dir's train_state.json (saved_under) records of the run that saved it: its global
 * batch, its data's tokens (0 when unknown), its data order (train_data_order; "" when
 * unknown), its learning-rate schedule (sched->total_steps 0 when unknown), whether its step's
 * evaluation is pending, and its step's metrics line (*line, NULL when not recorded). */
static void read_saved_run(const char *dir, int64_t *batch, int64_t *tokens, char *order, size_t n,
                           saved_schedule_t *sched, bool *eval_pending, cJSON **line) {
  char *text = NULL;
  *batch = *tokens = 0;
  *eval_pending = false;
  *line = NULL;
  order[0] = 0;
  memset(sched, 0, sizeof *sched);
  if (ckpt_state_text(dir, &text) != STATUS_OK) err_clear();
  if (text == NULL) return;
  cJSON *o = cJSON_Parse(text);
  free(text);
  const cJSON *under = cJSON_GetObjectItemCaseSensitive(o, "saved_under");
  const cJSON *b = cJSON_GetObjectItemCaseSensitive(under, "global_batch");
  if (cJSON_IsNumber(b) && b->valuedouble > 0) *batch = (int64_t)b->valuedouble;
  const cJSON *d = cJSON_GetObjectItemCaseSensitive(under, "data_order");
  const cJSON *shuffle = cJSON_GetObjectItemCaseSensitive(d, "shuffle");
  const cJSON *seed = cJSON_GetObjectItemCaseSensitive(d, "seed");
  const cJSON *seq = cJSON_GetObjectItemCaseSensitive(d, "seq_len");
  const cJSON *toks = cJSON_GetObjectItemCaseSensitive(d, "tokens");
  if (cJSON_IsNumber(toks) && toks->valuedouble >= 1) *tokens = (int64_t)toks->valuedouble;
  *eval_pending = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(under, "eval_pending"));
  const cJSON *m = cJSON_GetObjectItemCaseSensitive(under, "metrics");
  if (cJSON_IsObject(m) && cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(m, "step")))
    *line = cJSON_Duplicate(m, true);
  const cJSON *sc = cJSON_GetObjectItemCaseSensitive(under, "schedule");
  const cJSON *steps = cJSON_GetObjectItemCaseSensitive(sc, "steps");
  const cJSON *warm = cJSON_GetObjectItemCaseSensitive(sc, "warmup_steps");
  const cJSON *ratio = cJSON_GetObjectItemCaseSensitive(sc, "min_lr_ratio");
  const cJSON *lr = cJSON_GetObjectItemCaseSensitive(sc, "lr");
  if (cJSON_IsNumber(steps) && steps->valuedouble >= 1 && steps->valuedouble < 9e15 &&
      cJSON_IsNumber(warm) && warm->valuedouble >= 0 && warm->valuedouble < 9e15 &&
      cJSON_IsNumber(ratio) && cJSON_IsNumber(lr))
    *sched = (saved_schedule_t){.total_steps = (int64_t)steps->valuedouble,
                                .warmup_steps = (int64_t)warm->valuedouble,
                                .min_ratio = ratio->valuedouble,
                                .lr = lr->valuedouble};
  char *end = NULL;
  unsigned long long s = cJSON_IsString(seed) ? strtoull(seed->valuestring, &end, 10) : 0;
  if (cJSON_IsBool(shuffle) && end != NULL && end != seed->valuestring && *end == 0 &&
      cJSON_IsNumber(seq) && seq->valuedouble >= 1)
    train_data_order(cJSON_IsTrue(shuffle), s, (int64_t)seq->valuedouble, order, n);
  cJSON_Delete(o);
}

/* Rank 0's line for an evaluation after step (prefix: to clear a progress bar). */
void train_eval_line(const run_t *r, int64_t step, double loss, const char *prefix) {
  printf("%seval after step %lld: loss %.6f (perplexity %.2f) over %lld batches of %s\n", prefix,
         (long long)step, loss, exp(loss), (long long)r->plan.eval_batches, r->plan.eval_path);
}

/* The model built for how: the program's, or the plan's architecture. */
static fsdpc_status_t build_model(run_t *r, const train_build_t *how) {
  FSDPC_TRY(r->model.build(r->model.self, how, &r->root));
  if (r->root == NULL)
    return err_set(STATUS_EINVAL, "the model '%s' was built without a module tree",
                   r->model.name ? r->model.name : "");
  if (!nn_module_finalized(r->root))
    return err_set(STATUS_EINVAL,
                   "the model '%s' was built without its names: call nn_module_finalize(root) "
                   "after the last module is added, before build returns",
                   r->model.name ? r->model.name : "");
  return STATUS_OK;
}

/* The model's description for train_state.json (a JSON object's text; caller frees). */
fsdpc_status_t train_describe_model(const run_t *r, char **out) {
  *out = NULL;
  if (r->model.describe) {
    FSDPC_TRY(r->model.describe(r->model.self, out));
    cJSON *o = *out ? cJSON_Parse(*out) : NULL;
    bool ok = cJSON_IsObject(o);
    cJSON_Delete(o);
    if (ok) return STATUS_OK;
    free(*out);
    *out = NULL;
    return err_set(STATUS_EINVAL, "the model '%s' describes itself by something not a JSON object",
                   r->model.name);
  }
  cJSON *o = cJSON_CreateObject();
  if (o != NULL && cJSON_AddStringToObject(o, "name", r->model.name) &&
      cJSON_AddNumberToObject(o, "vocab_size", (double)r->model.vocab_size))
    *out = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return *out ? STATUS_OK : err_set(STATUS_ENOMEM, "out of host memory (the model's description)");
}

/* The program's model against the one a checkpoint records. */
static fsdpc_status_t check_own_model(const run_t *r) {
  char *mine = NULL;
  FSDPC_TRY(train_describe_model(r, &mine));
  fsdpc_status_t st = train_check_own_model(r->resumed_from, r->model.name, mine);
  free(mine);
  return st;
}

/* What would fail later is refused now, on every rank, a dry run included: outputs that would
 * replace an input, a checkpoint of another model, step folders the run would save over.
 * Collective over the world. */

/* The samples d gives this rank for micro-batches [0, micros) of step `step` (an evaluation's
 * batch), read and dropped: a token outside the vocabulary or a file cut short, named under
 * key. Local. */
fsdpc_status_t train_check_samples(const fsdpc_data_t *d, const data_spec_t *spec, int64_t step,
                                   int64_t micros, const char *key) {
  for (int64_t k = 0; k < micros; k++) {
    fsdpc_tensor_t in = {0}, tg = {0};
    fsdpc_status_t st = data_batch(d, spec, step, k, &in, &tg);
    tensor_free(&in);
    tensor_free(&tg);
    if (st != STATUS_OK) return err_prefix(st, "%s", key);
  }
  return STATUS_OK;
}

/* The metrics file: --metrics, else log.metrics ("" for none). */
const char *train_metrics_path(const run_t *r) {
  return r->args.metrics ? r->args.metrics : r->plan.metrics;
}

/* eval.path's batches, the same at every evaluation: read once before the first step, so
 * that a bad one stops the run now, not after an interval of training. */
static fsdpc_status_t check_eval_samples(const run_t *r) {
  if (r->eval == NULL) return STATUS_OK;
  data_spec_t one = train_spec_of(r);
  one.batch_size = r->plan.eval_batch_size;
  one.grad_accum = 1;
  /* a stop signal ends the check (the run then stops at its first chance, as it would have
   * without one): an evaluation of many batches is read here first, and a launcher waits
   * only so long after its SIGTERM */
  for (int64_t f = 0; f < eval_forwards(&r->plan) && train_signal() == 0; f++)
    FSDPC_TRY(train_check_samples(r->eval, &one, f, 1, "eval.path"));
  return STATUS_OK;
}

static fsdpc_status_t check_before_training(run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  const char *metrics = train_metrics_path(r);
  fsdpc_status_t st = STATUS_OK;
  if (world_rank() == 0 && r->args.metrics != NULL && p->metrics[0] &&
      !file_same_path(r->args.metrics, p->metrics))
    fprintf(stderr,
            "%s: note: --metrics '%s' is written; the plan's log.metrics '%s' is not (the "
            "command line's wins)\n",
            train_prog(), r->args.metrics, p->metrics);
  if (world_rank() == 0) /* rank 0 writes them */
    st = train_check_outputs(p, metrics, r->args.plot, r->data, r->eval, r->resumed_from,
                             r->args.dry_run);
  /* the checkpoint's state and its files' headers (a dry run reads no further), by rank 0 */
  if (st == STATUS_OK && r->resumed_from[0] && world_rank() == 0)
    st = ckpt_check_state(r->resumed_from);
  if (st == STATUS_OK && r->resumed_from[0] && r->builtin)
    st = train_check_model(p, r->resumed_from);
  if (st == STATUS_OK && r->resumed_from[0] && !r->builtin) st = check_own_model(r);
  /* then nothing in its files that model lacks (the whole model's parameters, whichever
   * stages a rank holds), by rank 0 */
  if (st == STATUS_OK && r->resumed_from[0] && world_rank() == 0) {
    nn_param_t **all = NULL;
    int n_all = 0;
    st = nn_named_parameters(r->root, &all, &n_all);
    if (st == STATUS_OK) st = ckpt_check_names(r->resumed_from, all, n_all);
    free(all);
  }
  if (st == STATUS_OK && !r->resumed_from[0] && !r->builtin) { /* the first save's record */
    char *mine = NULL;
    st = train_describe_model(r, &mine);
    free(mine);
  }
  if (st == STATUS_OK) st = check_eval_samples(r);
  FSDPC_TRY(pg_agree(world_pg(), st));
  int64_t start = 0; /* the step the checkpoint was saved after (read again by the load) */
  if (r->resumed_from[0]) st = train_checkpoint_step(r->resumed_from, &start);
  if (st == STATUS_OK && world_rank() == 0)
    st = train_check_metrics_branch(p, metrics, r->resumed_from, start);
  FSDPC_TRY(pg_agree(world_pg(), st));
  return train_check_step_folders(p, start);
}

/* Before anything is built: every rank runs the same plan, and checkpoint.dir is this job's
 * alone (locked; the unfinished saves of a job that died there removed). A dry run only says
 * whether another job holds the folder. Collective over the world. */
static fsdpc_status_t start(run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  /* the mode too: a dry run beside a real one would wait in the real one's collectives */
  size_t n = strlen(r->settings);
  char *mode = malloc(n + 32);
  if (mode != NULL)
    snprintf(mode, n + 32, "%s--dry-run: %s\n", r->settings, r->args.dry_run ? "given" : "absent");
  /* compared all the same without the mode (its ranks then differ): no rank leaves early */
  fsdpc_status_t same = train_check_same_plan(mode ? mode : r->settings);
  bool short_of_memory = mode == NULL;
  free(mode);
  FSDPC_TRY(same);
  if (short_of_memory) return err_set(STATUS_ENOMEM, "out of host memory");
  if (!p->ckpt_dir[0]) return STATUS_OK;
  if (r->args.dry_run) {
    train_lock_note(p->ckpt_dir);
    return STATUS_OK;
  }
  FSDPC_TRY(train_lock(p->ckpt_dir, p->source, &r->lock_fd));
  int removed = 0, stuck = 0;
  char why[512] = "";
  fsdpc_status_t st = world_rank() == 0
                          ? ckpt_remove_unfinished(p->ckpt_dir, &removed, &stuck, why, sizeof why)
                          : STATUS_OK;
  if (stuck > 0)
    fprintf(stderr,
            "%s: warning: checkpoint.dir '%s': %d unfinished entr%s (step-*.tmp, "
            "step-*.removing) stay%s (never read as a checkpoint): %s\n",
            train_prog(), p->ckpt_dir, stuck, stuck == 1 ? "y" : "ies", stuck == 1 ? "s" : "", why);
  if (removed > 0)
    fprintf(stderr,
            "%s: checkpoint.dir '%s': removed %d unfinished save%s or removal%s (step-*.tmp, "
            "step-*.removing)\n",
            train_prog(), p->ckpt_dir, removed, removed == 1 ? "" : "s", removed == 1 ? "" : "s");
  /* the folders checkpoint.overwrite moved aside for saves that never committed */
  int restored = 0, stale = 0;
  if (st == STATUS_OK && world_rank() == 0)
    st = ckpt_restore_replaced(p->ckpt_dir, &restored, &stale);
  if (restored > 0)
    fprintf(stderr,
            "%s: checkpoint.dir '%s': put back %d step folder%s that checkpoint.overwrite had "
            "moved aside for a save that did not finish\n",
            train_prog(), p->ckpt_dir, restored, restored == 1 ? "" : "s");
  if (stale > 0)
    fprintf(stderr,
            "%s: checkpoint.dir '%s': removed %d step folder%s that checkpoint.overwrite had "
            "replaced (step-*.replaced-*)\n",
            train_prog(), p->ckpt_dir, stale, stale == 1 ? "" : "s");
  /* a checkpoint.overwrite rollback a job began and did not end: finished where its first
   * save committed, else undone */
  bool found = false, finished = false;
  int replaced = 0;
  if (st == STATUS_OK && world_rank() == 0)
    st = ckpt_rollback_settle(p->ckpt_dir, &found, &finished, &replaced);
  if (found && finished)
    fprintf(stderr,
            "%s: checkpoint.dir '%s': finished the checkpoint.overwrite rollback a job stopped "
            "in: removed the %d step folder%s it replaces\n",
            train_prog(), p->ckpt_dir, replaced, replaced == 1 ? "" : "s");
  else if (found)
    fprintf(stderr,
            "%s: checkpoint.dir '%s': a checkpoint.overwrite rollback a job stopped in had "
            "saved nothing; the step folders are as they were\n",
            train_prog(), p->ckpt_dir);
  /* rewrites of the metrics file a killed run left beside it (a finished rollback's took its
   * name above) */
  const char *mpath = train_metrics_path(r);
  int left =
      st == STATUS_OK && world_rank() == 0 && mpath[0] ? file_remove_stale_temps(mpath, NULL) : 0;
  if (left > 0)
    fprintf(stderr,
            "%s: note: removed %d unfinished rewrite%s of the metrics file beside '%s' "
            "(%s.tmp-*), left by a run that was killed\n",
            train_prog(), left, left == 1 ? "" : "s", mpath, mpath);
  return pg_agree(world_pg(), st);
}

/* The device, the data, the model with its plan applied (only a meta model for a dry run),
 * its values and the optimizer, or the checkpoint to resume. Collective over the world. */
/* The checkpoint a run resumes from (checkpoint.load: auto, the newest complete one, or a
 * folder) into r->resumed_from; *resume: there is one. */
static fsdpc_status_t find_resume(run_t *r, bool *resume) {
  const fsdpc_plan_t *p = &r->plan;
  *resume = false;
  if (!p->ckpt_load[0]) return STATUS_OK;
  *resume = true;
  if (strcmp(p->ckpt_load, "auto") != 0) {
    snprintf(r->resumed_from, sizeof r->resumed_from, "%s", p->ckpt_load);
    return STATUS_OK;
  }
  char skipped[sizeof r->resumed_from + 128];
  FSDPC_TRY(ckpt_latest(p->ckpt_dir, r->resumed_from, sizeof r->resumed_from, resume, skipped,
                        sizeof skipped));
  if (skipped[0] && world_rank() == 0)
    fprintf(stderr, "%s: checkpoint.load=auto: skipped the newer %s\n", train_prog(), skipped);
  return STATUS_OK;
}

/* The Hugging Face config the built-in model's record carries the keys of that the model does
 * not read (its tokens' ids): the config.json it came from (model.init_from, model.config),
 * else the record of the checkpoint it resumes. Read once, before the first save. */
static fsdpc_status_t read_carried(run_t *r) {
  char *text = NULL;
  if (r->plan.model_source[0])
    FSDPC_TRY(file_read_text(r->plan.model_source, FILE_TEXT_MAX, &text));
  else if (r->resumed_from[0])
    FSDPC_TRY(ckpt_recorded_config(r->resumed_from, &text));
  r->carried = text ? cJSON_Parse(text) : NULL;
  free(text);
  return STATUS_OK;
}

/* The parallelised model's handles into r. */
static void take_parallel(run_t *r) {
  r->mesh = parallel_mesh(r->par);
  r->dev = mesh_device(r->mesh);
  r->all = parallel_all_group(r->par);
  r->tp = parallel_tp(r->par);
  r->groups = parallel_groups(r->par);
  r->n_groups = parallel_num_groups(r->par);
  r->dp_size = parallel_dp_size(r->par);
  r->dp_rank = parallel_dp_rank(r->par);
}

/* moe.aux_loss_scope: global: the load-balancing loss of a model with experts over the
 * data-parallel ranks' tokens together (each micro-step's: the same loss however its samples
 * are split over the ranks). */
static fsdpc_status_t share_routing(run_t *r) {
  nn_moe_aux_t *aux = nn_moe_aux_of(r->root);
  mesh_t *dp = parallel_dp_mesh(r->par);
  if (!r->plan.moe_aux_global || aux == NULL || r->dp_size <= 1 || dp == NULL) return STATUS_OK;
  pg_t *groups[NN_MOE_SHARE_MAX];
  int n = 0, ranks = 1;
  for (int d = 0; d < mesh_ndim(dp) && n < NN_MOE_SHARE_MAX; d++)
    if (mesh_size(dp, d) > 1) {
      groups[n++] = mesh_group(dp, d);
      ranks *= mesh_size(dp, d);
    }
  if (ranks != r->dp_size) /* the data-parallel mesh is the data's split */
    return err_set(STATUS_EINTERNAL, "the MoE loss's data-parallel groups span %d ranks of %d",
                   ranks, r->dp_size);
  return nn_moe_aux_share_over(aux, groups, n, (double)r->dp_size);
}

/* hf_load_opts_t.canonical for the built-in family's architecture *user. */
static bool hf_name_of(const char *name, char *buf, size_t size, const void *user) {
  return llama_hf_canonical(*(const llama_arch_t *)user, name, buf, size);
}

/* The parameters this rank holds into r->ps: every one, or under a pipeline its stages'. */
static fsdpc_status_t held_parameters(run_t *r) {
  FSDPC_TRY(nn_named_parameters(r->root, &r->ps, &r->n));
  int kept = 0;
  for (int i = 0; i < r->n; i++)
    if (parallel_holds(r->par, r->ps[i]->owner)) r->ps[kept++] = r->ps[i];
  r->n = kept;
  return STATUS_OK;
}

/* This rank's shards given memory and values (the seed, the Hugging Face folder, or left to
 * the checkpoint), the optimizer made, then the checkpoint loaded. */
static fsdpc_status_t fill(run_t *r, bool deferred, bool resume) {
  fsdpc_plan_t *p = &r->plan;
  nn_module_t *root = r->root;
  /* memory and the Hugging Face files may fail on one rank alone: every rank learns of it
   * before the checkpoint's collectives (or the end of the build) */
  fsdpc_status_t st = STATUS_OK; /* under a pipeline, this rank's stages alone */
  if (r->n_stage_modules == 0) st = nn_module_materialize(root);
  for (int i = 0; i < r->n_stage_modules && st == STATUS_OK; i++)
    st = nn_module_materialize(r->stage_modules[i]);
  if (st == STATUS_OK && deferred && !p->init_from[0] && !resume)
    st = r->model.init ? r->model.init(r->model.self, root, p->model_seed)
                       : nn_module_reset_parameters(root, p->model_seed);
  if (st == STATUS_OK && p->init_from[0]) { /* after sharding: each rank reads its shards' */
    hf_load_opts_t o = {
        /* model.pad_vocab_multiple: the files' rows, then zeros */
        .padded = llama_vocab_rows(&p->model) > p->model.vocab_size ? llama_is_vocab_table : NULL,
        /* the names transformers also reads: only GPT-2's files name the parameters
         * otherwise (llama_hf_canonical); the others are looked up as they are */
        .canonical = p->model.arch == LLAMA_ARCH_GPT2 ? hf_name_of : NULL,
        .user = &p->model.arch};
    st = ckpt_load_hf_with(root, p->init_from, &o);
  }
  if (st == STATUS_OK) st = held_parameters(r);
  if (st == STATUS_OK) st = train_pp_tied(r);
  if (st == STATUS_OK) st = optim_for_rank(r);
  FSDPC_TRY(pg_agree(world_pg(), st));
  if (!resume) return STATUS_OK;
  r->verified = -1;
  if (p->ckpt_verify) FSDPC_TRY(ckpt_verify_training(r->resumed_from, world_pg(), &r->verified));
  FSDPC_TRY(
      ckpt_load_training(r->resumed_from, r->ps, r->n, r->opt, &r->start_step, &r->load_stats));
  read_saved_run(r->resumed_from, &r->saved_batch, &r->saved_tokens, r->saved_order,
                 sizeof r->saved_order, &r->saved_schedule, &r->resume_eval, &r->saved_line);
  return STATUS_OK;
}

/* Offloaded state on a GPU: the optimizer step and the gradients' sums run on the host, on
 * the cores this rank may use shared among the node's ranks, unless OMP_NUM_THREADS chose. */
static void offload_threads(run_t *r) {
  const char *env = getenv("OMP_NUM_THREADS");
  if (!r->plan.par.offload || r->dev.type != DEVICE_CUDA || (env != NULL && env[0] != 0)) return;
  int n = world_cpus().share;
  if (n > 1 && kernel_set_cpu_threads(n) == STATUS_OK) r->host_threads = n;
  err_clear();
}

static fsdpc_status_t build(run_t *r) {
  fsdpc_plan_t *p = &r->plan;
  device_t dev; /* first: collective, and every rank arrives here */
  fsdpc_status_t st = STATUS_OK;
  if (world_planning()) /* a plan of a larger job: its meta model on the host type */
    dev = device_cpu();
  else
    st = world_choose_device(p->device, &dev, r->device_note, sizeof r->device_note);
  if (st != STATUS_OK)
    return err_prefix(st, "%s: train.device: %s", p->source, device_want_name(p->device));
  if (r->builtin) FSDPC_TRY(llama_plan_check(&p->model, &p->par));
  kernel_attention_set_fused(!p->deterministic);
  FSDPC_TRY(pg_agree(world_pg(), open_data(r))); /* before the model: a bad file fails at once */
  FSDPC_TRY(pg_agree(world_pg(), same_tokens(r->data, "data.path", p->data_path)));
  if (r->eval) FSDPC_TRY(pg_agree(world_pg(), same_tokens(r->eval, "eval.path", p->eval_path)));
  train_build_t how = {.device = dev.type,
                       /* no parameter memory; under a pipeline, only this rank's stages get it */
                       .deferred = p->deferred_init || r->args.dry_run || p->par.pp > 1,
                       .activation_checkpointing = p->activation_checkpointing,
                       .seed = p->model_seed};
  bool resume; /* a checkpoint to load: it overwrites every parameter */
  FSDPC_TRY(find_resume(r, &resume));
  /* deferred: meta parameters, parallelised, then memory for this rank's shards only and
   * values from the init, the Hugging Face folder or the checkpoint; eager: whole
   * parameters initialised on every rank, then split */
  st = build_model(r, &how);
  /* memory may fail on one rank alone: every rank learns of it before parallel_apply's
   * collectives */
  FSDPC_TRY(pg_agree(world_pg(), st));
  nn_module_t *root = r->root;
  FSDPC_TRY(pg_agree(world_pg(), train_pp_stages(r)));
  if (r->n_stage_modules > 0)
    FSDPC_TRY(parallel_apply_stages(root, &p->par, how.device, r->stage_modules, r->n_stage_modules,
                                    &r->par));
  else
    FSDPC_TRY(parallel_apply(root, &p->par, how.device, &r->par));
  take_parallel(r);
  FSDPC_TRY(share_routing(r));
  offload_threads(r);
  if (!resume) r->resumed_from[0] = 0;
  FSDPC_TRY(check_before_training(r));
  if (!r->args.dry_run && r->builtin) FSDPC_TRY(read_carried(r));
  FSDPC_TRY(check_param_groups(r)); /* the same model on every rank: the same verdict */
  if (r->args.dry_run) { /* the meta model has every placement and shape */
    FSDPC_TRY(held_parameters(r));
    return train_pp_tied(r);
  }
  return fill(r, how.deferred, resume);
}

/* A run that stopped before it saved anything leaves no checkpoint.dir it made: the folders it
 * made (file_make_dirs_noted) are removed, innermost first, while they are empty. */
static void remove_made_dirs(const char *dir, const size_t *len, int n) {
  if (world_rank() != 0) return;
  char buf[PLAN_PATH_MAX];
  for (int k = n - 1; k >= 0; k--) {
    if (len[k] >= sizeof buf) continue;
    memcpy(buf, dir, len[k]);
    buf[len[k]] = 0;
    (void)rmdir(buf);
  }
}

/* The command line and the plan, checked before anything else: the launch, the plan resolved
 * against the world, the checkpoint folder made, the signal handlers installed. */
static fsdpc_status_t set_up(run_t *r, int argc, char **argv) {
  fsdpc_status_t st = parse_args(argc, argv, &r->args);
  if (st != STATUS_OK && world_rank() == 0) usage(stderr);
  /* a dry run trains nothing: planned from one process under any launcher's settings */
  if (st == STATUS_OK && !r->args.dry_run) st = world_check_launch();
  if (st == STATUS_OK && r->args.world) /* before the plan resolves its mesh against the world */
    st = world_plan_as(r->args.world, r->args.ranks_per_node ? r->args.ranks_per_node : 8);
  const char *own = r->builtin ? NULL : r->model.name;
  if (st == STATUS_OK)
    st = plan_load_job(&r->plan, r->args.config, r->args.sets, r->args.n_sets, own, &r->settings);
  if (st == STATUS_OK) st = plan_resolve_job(&r->plan, world_size(), own);
  if (st == STATUS_OK && r->builtin) r->model = train_builtin_model(r);
  if (st == STATUS_OK && r->args.plot != NULL && r->args.metrics == NULL && !r->plan.metrics[0])
    st = err_set(STATUS_EINVAL,
                 "--plot draws the metrics file: give --metrics PATH or "
                 "log.metrics in the plan");
  if (st == STATUS_OK) st = world_set_timeout(r->plan.comm_timeout_s);
  if (st == STATUS_OK) st = dcp_set_block_bytes((uint64_t)r->plan.ckpt_block_bytes);
  /* checkpoint.dir made before training, by rank 0 first: it notes which folders it made */
  bool make = st == STATUS_OK && r->plan.ckpt_dir[0] && !r->args.dry_run;
  if (make && world_rank() == 0) {
    st = file_make_dirs_noted(r->plan.ckpt_dir, "checkpoint.dir", r->made_len, &r->n_made,
                              (int)(sizeof r->made_len / sizeof r->made_len[0]));
  }
  st = pg_agree(world_pg(), st);
  if (make && st == STATUS_OK && world_rank() != 0)
    st = file_make_dirs(r->plan.ckpt_dir, "checkpoint.dir");
  if (st == STATUS_OK && r->plan.ckpt_dir[0] && r->args.dry_run)
    st = file_check_dirs(r->plan.ckpt_dir, "checkpoint.dir");
  if (st == STATUS_OK && !r->args.dry_run) st = train_signals_install(&r->plan);
  return st;
}

/* Everything a run holds, and the run. */
static void run_free(run_t *r) {
  if (r == NULL) return;
  train_unlock(r->lock_fd);
  free(r->settings);
  cJSON_Delete(r->carried);
  cJSON_Delete(r->saved_line);
  optim_free(r->opt);
  free(r->ps);
  parallel_free(r->par);
  if (r->root != NULL && r->model.free)
    r->model.free(r->model.self, r->root);
  else
    nn_module_free(r->root);
  data_free(r->data);
  data_free(r->eval);
  train_pp_free(r);
  free(r);
}

/* A program's model that the trainer cannot use: why, or NULL. */
static const char *model_unusable(const train_model_t *m) {
  if (m->name == NULL || m->name[0] == 0) return "it has no name";
  if (m->build == NULL) return "it has no build function";
  if (m->vocab_size < 1) return "its vocab_size is below 1";
  return NULL;
}

/* --help, --version: answered without a plan. */
static bool answered(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0 ||
        strcmp(argv[i], "--version") == 0) {
      bool version = strcmp(argv[i], "--version") == 0;
      if (world_rank() == 0 && version) printf("%s (fsdpc) %s\n", train_prog(), fsdpc_version());
      if (world_rank() == 0 && !version) usage(stdout);
      return true;
    }
  return false;
}

/* A damaged newest checkpoint that checkpoint.load: auto took (its files named in the error):
 * the error names the one before it, which a resume may take instead. */
static fsdpc_status_t name_older(const run_t *r, fsdpc_status_t st) {
  const fsdpc_plan_t *p = &r->plan;
  int64_t step;
  bool tmp, found = false;
  const char *base = strrchr(r->resumed_from, '/');
  if (st != STATUS_EFORMAT || strcmp(p->ckpt_load, "auto") != 0 || !r->resumed_from[0] ||
      strstr(err_detail(), r->resumed_from) == NULL ||
      !ckpt_step_name(base ? base + 1 : r->resumed_from, &step, &tmp))
    return st;
  char older[PLAN_PATH_MAX], was[2048];
  snprintf(was, sizeof was, "%s", err_detail());
  if (ckpt_latest_before(p->ckpt_dir, step, older, sizeof older, &found) != STATUS_OK || !found)
    return err_set(st, "%s", was); /* (the listing's own error, if any, not this run's) */
  return err_set(st,
                 "%s (checkpoint.load: auto takes the newest checkpoint, %s; to resume the one "
                 "before it, check it with fsdp-ckpt verify %s and give checkpoint.load=%s)",
                 was, r->resumed_from, older, older);
}

/* The run of an agreed set-up: the build, the header, then the dry run or the training. */
static int run(run_t *r) {
  if (!agree(start(r)) || !agree(name_older(r, build(r)))) return 1;
  if (world_rank() == 0) train_header(r);
  if (r->args.dry_run) {
    train_dry_run(r);
    return 0;
  }
  if (!agree(train_loop(r))) return 1;
  return r->stopped_by || r->timed_out ? TRAIN_EXIT_INTERRUPTED : 0;
}

int train_main(int argc, char **argv, const char *program, const train_model_t *model) {
  double t_launch = device_clock_seconds();
  train_set_prog(program);
  if (argc < 1 || argv == NULL) {
    fprintf(stderr, "%s: train_main needs main's argc and argv\n", train_prog());
    return 1;
  }
  const char *bad = model ? model_unusable(model) : NULL;
  if (bad != NULL) {
    fprintf(stderr, "%s: train_main: the program's model cannot be trained: %s\n", train_prog(),
            bad);
    return 1;
  }
  train_signals_hold(); /* until the plan's handlers are in place (set_up) */
  if (!world_start(&argc, &argv, train_prog())) {
    train_signals_release();
    return 1;
  }
  if (answered(argc, argv)) {
    train_signals_release();
    world_finalize();
    return 0;
  }
  run_t *r = calloc(1, sizeof *r);
  fsdpc_status_t st = STATUS_ENOMEM;
  if (r != NULL) {
    r->t_launch = t_launch;
    r->lock_fd = -1;
    r->builtin = model == NULL;
    if (model) r->model = *model;
    st = set_up(r, argc, argv);
  } else {
    st = pg_agree(world_pg(), st); /* the one set_up makes on the others */
  }
  train_signals_release();
  int rc = agree(st) ? run(r) : 1;
  char dir[PLAN_PATH_MAX];
  size_t made[64];
  int n_made = r ? r->n_made : 0;
  snprintf(dir, sizeof dir, "%s", r ? r->plan.ckpt_dir : "");
  if (r) memcpy(made, r->made_len, sizeof made);
  run_free(r); /* the lock file removed */
  if (rc == 1) remove_made_dirs(dir, made, n_made);
  world_finalize();
  return rc;
}
