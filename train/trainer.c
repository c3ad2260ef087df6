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
 */
#include <cJSON.h>
#include <errno.h>
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
      a->verbose = true;
    } else if (s[0] == '-' && s[1] != 0) {
      return err_set(STATUS_EINVAL, "unknown option '%s'", s);
    } else if (a->config == NULL) {
      a->config = s;
    } else {
      return err_set(STATUS_EINVAL, "more than one plan file ('%s' and '%s')", a->config, s);
    }
  }
  if (a->config == NULL) return err_set(STATUS_EINVAL, "no plan file given");
  if (a->verbose && !a->dry_run) return err_set(STATUS_EINVAL, "-v goes with --dry-run");
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

static fsdpc_status_t open_data(run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  FSDPC_TRY(open_tokens(r, p->data_path, p->data_format, &p->data_where, "data.path", &r->data));
  if (!p->eval_path[0]) return STATUS_OK;
  return open_tokens(r, p->eval_path, p->eval_format, &p->eval_where, "eval.path", &r->eval);
}

/* The forwards of an evaluation: eval.batches global batches, each of grad_accum forwards of
 * eval.batch_size samples on every data-parallel rank, as a step's micro-batches (with the
 * default eval.batch_size, data.batch_size, a global batch is the training's: every plan of
 * one global batch evaluates the same samples). Forward f reads the samples of global
 * micro-batch f of eval.path (train_eval_batch takes one micro-batch of a step f). */
static int64_t eval_forwards(const fsdpc_plan_t *p) { return p->eval_batches * p->grad_accum; }

/* The mean loss over eval_forwards of eval.path (the same samples every time, in the training
 * data's order), without gradients; then every unit's parameters are released (the root keeps
 * them gathered after a forward, for the backward that would follow). Collective over the
 * world. */
static fsdpc_status_t evaluate(run_t *r, const data_spec_t *spec, double *loss) {
  double sum = 0, l = 0;
  fsdpc_status_t st = STATUS_OK;
  data_spec_t one = *spec;
  one.batch_size = r->plan.eval_batch_size;
  if (r->pp_sched != NULL) st = train_pp_eval(r, &one, eval_forwards(&r->plan), &sum);
  for (int64_t f = 0; r->pp_sched == NULL && f < eval_forwards(&r->plan) && st == STATUS_OK; f++) {
    st = train_eval_batch(r->root, r->dev, r->eval, &one, f, &l);
    sum += l;
  }
  for (int i = 0; i < r->n_groups; i++) fsdp_reshard(r->groups[i]);
  if (st != STATUS_OK) return world_stop(st); /* the others would wait in the forward */
  double all = 0;
  FSDPC_TRY(pg_host_all_reduce(world_pg(), &sum, &all, 1, PG_HOST_F64, REDUCE_SUM));
  /* every rank's tokens count the same; the ranks of one tp group hold the same loss */
  *loss = all / (double)world_size() / (double)eval_forwards(&r->plan);
  return STATUS_OK;
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
static void eval_line(const run_t *r, int64_t step, double loss, const char *prefix) {
  printf("%seval after step %lld: loss %.6f (perplexity %.2f) over %lld batches of %s\n", prefix,
         (long long)step, loss, exp(loss), (long long)r->plan.eval_batches, r->plan.eval_path);
}

/* The model built for how: the program's, or the plan's architecture. */
static fsdpc_status_t build_model(run_t *r, const train_build_t *how) {
  FSDPC_TRY(r->model.build(r->model.self, how, &r->root));
  if (r->root == NULL)
    return err_set(STATUS_EINVAL, "the model '%s' was built without a module tree",
                   r->model.name ? r->model.name : "");
  return STATUS_OK;
}

/* The model's description for train_state.json (a JSON object's text; caller frees). */
static fsdpc_status_t describe_model(const run_t *r, char **out) {
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
  FSDPC_TRY(describe_model(r, &mine));
  fsdpc_status_t st = train_check_own_model(r->resumed_from, r->model.name, mine);
  free(mine);
  return st;
}

/* What would fail later is refused now, on every rank, a dry run included: outputs that would
 * replace an input, a checkpoint of another model, step folders the run would save over.
 * Collective over the world. */
static data_spec_t spec_of(const run_t *r);

/* The samples d gives this rank for micro-batches [0, micros) of step `step` (an evaluation's
 * batch), read and dropped: a token outside the vocabulary or a file cut short, named under
 * key. Local. */
static fsdpc_status_t check_samples(const fsdpc_data_t *d, const data_spec_t *spec, int64_t step,
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
static const char *metrics_path(const run_t *r) {
  return r->args.metrics ? r->args.metrics : r->plan.metrics;
}

/* eval.path's batches, the same at every evaluation: read once before the first step, so
 * that a bad one stops the run now, not after an interval of training. */
static fsdpc_status_t check_eval_samples(const run_t *r) {
  if (r->eval == NULL) return STATUS_OK;
  data_spec_t one = spec_of(r);
  one.batch_size = r->plan.eval_batch_size;
  one.grad_accum = 1;
  for (int64_t f = 0; f < eval_forwards(&r->plan); f++)
    FSDPC_TRY(check_samples(r->eval, &one, f, 1, "eval.path"));
  return STATUS_OK;
}

static fsdpc_status_t check_before_training(run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  const char *metrics = metrics_path(r);
  fsdpc_status_t st = STATUS_OK;
  if (world_rank() == 0) /* rank 0 writes them */
    st = train_check_outputs(p, metrics, r->args.plot, r->data, r->eval, r->resumed_from);
  /* the checkpoint's state and its files' headers (a dry run reads no further), by rank 0 */
  if (st == STATUS_OK && r->resumed_from[0] && world_rank() == 0)
    st = ckpt_check_state(r->resumed_from);
  if (st == STATUS_OK && r->resumed_from[0] && r->builtin)
    st = train_check_model(p, r->resumed_from);
  if (st == STATUS_OK && r->resumed_from[0] && !r->builtin) st = check_own_model(r);
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
  FSDPC_TRY(train_check_same_plan(r->settings));
  if (!p->ckpt_dir[0]) return STATUS_OK;
  if (r->args.dry_run) {
    train_lock_note(p->ckpt_dir);
    return STATUS_OK;
  }
  FSDPC_TRY(train_lock(p->ckpt_dir, p->source, &r->lock_fd));
  int removed = 0;
  fsdpc_status_t st = world_rank() == 0 ? ckpt_remove_unfinished(p->ckpt_dir, &removed) : STATUS_OK;
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
  const char *mpath = metrics_path(r);
  int left = st == STATUS_OK && world_rank() == 0 && mpath[0] ? file_remove_stale_temps(mpath) : 0;
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
  if (r->builtin) FSDPC_TRY(llama_plan_check(&p->par));
  kernel_attention_set_fused(!p->deterministic);
  FSDPC_TRY(pg_agree(world_pg(), open_data(r))); /* before the model: a bad file fails at once */
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

/* The plan a checkpoint is saved under, as train_state.json's saved_under (caller frees);
 * eval_pending: its step's evaluation was skipped by a stop (the resume makes it); line (may be
 * NULL): the step's metrics line, which a resume writes if the metrics file lost it. */
static fsdpc_status_t saved_under(const run_t *r, bool eval_pending, const cJSON *line,
                                  char **out) {
  const fsdpc_plan_t *p = &r->plan;
  char *model_text = NULL;
  FSDPC_TRY(describe_model(r, &model_text));
  cJSON *model = cJSON_Parse(model_text), *o = cJSON_CreateObject(), *order = NULL, *sched = NULL;
  free(model_text);
  char *text = NULL, seed[24];
  snprintf(seed, sizeof seed, "%llu", (unsigned long long)p->seed); /* exact, unlike a double */
  if (model != NULL && o != NULL && cJSON_AddStringToObject(o, "plan", p->source) &&
      cJSON_AddNumberToObject(o, "world_size", world_size()) &&
      (!r->run_id[0] || cJSON_AddStringToObject(o, "run", r->run_id)) &&
      cJSON_AddNumberToObject(o, "dp_replicate", p->par.dp_replicate) &&
      cJSON_AddNumberToObject(o, "dp_shard", p->par.dp_shard) &&
      cJSON_AddNumberToObject(o, "tp", p->par.tp) &&
      cJSON_AddNumberToObject(o, "global_batch", (double)train_global_batch(r)) &&
      (order = cJSON_AddObjectToObject(o, "data_order")) != NULL &&
      cJSON_AddBoolToObject(order, "shuffle", p->shuffle) &&
      cJSON_AddStringToObject(order, "seed", seed) &&
      cJSON_AddNumberToObject(order, "seq_len", (double)p->seq_len) &&
      cJSON_AddNumberToObject(order, "tokens", (double)data_num_tokens(r->data)) &&
      (sched = cJSON_AddObjectToObject(o, "schedule")) != NULL &&
      cJSON_AddNumberToObject(sched, "steps", (double)p->steps) &&
      cJSON_AddNumberToObject(sched, "warmup_steps", (double)p->warmup_steps) &&
      cJSON_AddNumberToObject(sched, "min_lr_ratio", p->min_lr_ratio) &&
      cJSON_AddNumberToObject(sched, "lr", p->optim.lr) &&
      (!eval_pending || cJSON_AddBoolToObject(o, "eval_pending", true)) &&
      (line == NULL || cJSON_AddItemToObject(o, "metrics", cJSON_Duplicate(line, true))) &&
      cJSON_AddItemToObject(o, "model", model)) {
    model = NULL; /* o owns it */
    text = cJSON_PrintUnformatted(o);
  }
  cJSON_Delete(model);
  cJSON_Delete(o);
  if (text == NULL) return err_set(STATUS_ENOMEM, "out of host memory (train_state.json)");
  *out = text;
  return STATUS_OK;
}

/* Rank 0's line for a run stopped early at step (a signal or the time limit). */
static void stopped_line(const run_t *r, const train_stop_t *stop, int64_t step, bool tty) {
  const fsdpc_plan_t *p = &r->plan;
  char why[128], dir[PLAN_PATH_MAX + 32], saved[PLAN_PATH_MAX + 96];
  if (stop->signal)
    snprintf(why, sizeof why, "interrupted by %s", train_signal_name(stop->signal));
  else
    snprintf(why, sizeof why, "stopped before train.time_limit (%g s)", p->time_limit_s);
  ckpt_step_dir(p->ckpt_dir, step, dir, sizeof dir);
  if (p->ckpt_dir[0])
    snprintf(saved, sizeof saved, "saved %s (resume with checkpoint.load: auto)", dir);
  else
    snprintf(saved, sizeof saved, "nothing saved (no checkpoint.dir)");
  printf("%s%s at step %lld; %s\n", tty ? "\r\033[K" : "", why, (long long)step, saved);
  fflush(stdout);
}

/* What the training loop carries from step to step. */
typedef struct loop {
  data_spec_t spec;
  lr_schedule_t sched;
  const char *mpath; /* the metrics file, or "" */
  FILE *mf;          /* open on rank 0 */
  int bad;           /* errno of a metrics write that failed on this rank */
  bool lead, tty;    /* rank 0; and a live progress bar on its terminal */
  bool agreed;       /* the loop's failure is one every rank met alike */
  /* and one that left the model as its last completed step made it (a bad sample, a full
   * metrics disk): that step is saved before the run stops */
  bool keep;
  int64_t completed; /* the steps the model has taken */
  int64_t asked;     /* the last step handed to the saver */
  /* a checkpoint.overwrite rollback's metrics file, renamed over mpath once its first save
   * commits (the newer checkpoints, whose lines the old file holds, are removed then) */
  char mtmp[PLAN_PATH_MAX + 16];
  double t_start, t_profile, first_loss, last_loss, tok_sum, step_max;
  int64_t steps_done, profile_from;
  size_t peak_max;
  fsdpc_tensor_t *micro_loss; /* the micro-steps' losses, on the device until read */
  train_saver_t saver;
  nn_moe_aux_t *moe; /* the MoE blocks' routing statistics (and load-balancing loss), or NULL */
  int experts;
  int64_t *load;    /* a step's choices per expert, every block and rank summed */
  double *pp_peaks; /* mesh.pp: each pipeline rank's peak in the step (rank 0's pipeline) */
  cJSON *unwritten; /* the metrics line a write error lost (rank 0), recorded by the save */
} loop_t;

/* One step's figures. */
typedef struct step_out {
  int64_t s; /* the step's index (the step s + 1 of the run) */
  double t0, loss, norm, factor, dt, tokens, tps, comm, eval_loss;
  double aux_loss; /* the MoE routers' load-balancing loss (unweighted), mean over the ranks */
  double p2p;      /* mesh.pp: the bytes this rank sent its pipeline neighbours */
  int64_t load_min, load_max;
  double sums[4 + PLAN_MAX_SIGNALS]; /* the loss, a save's state, the stop requests, summed */
  float coef;                        /* clipping, applied inside the optimizer's pass */
  size_t peak, state, eval_peak;     /* eval_peak: the evaluation's, apart from the step's */
  bool finite, stopping, eval_now;
  train_stop_t stop;
} step_out_t;

/* x as printed: a NaN without the sign %g would give it ("-nan"), which means nothing. */
static double unsigned_nan(double x) { return isnan(x) ? fabs(x) : x; }

/* This rank's share of the run's data order. */
static data_spec_t spec_of(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  return (data_spec_t){.batch_size = p->batch_size,
                       .seq_len = p->seq_len,
                       .grad_accum = p->grad_accum,
                       .dp_size = r->dp_size,
                       .dp_rank = r->dp_rank,
                       .shuffle = p->shuffle,
                       .seed = p->seed,
                       .vocab_size = r->model.vocab_size};
}

/* Set up: the data order, the schedule, the metrics file, the saver. On failure nothing is
 * left to finish. */
static fsdpc_status_t loop_start(run_t *r, loop_t *L, const cJSON *patch) {
  const fsdpc_plan_t *p = &r->plan;
  memset(L, 0, sizeof *L);
  L->spec = spec_of(r);
  L->completed = L->asked = r->start_step;
  L->sched = (lr_schedule_t){
      .warmup_steps = p->warmup_steps, .total_steps = p->steps, .min_ratio = p->min_lr_ratio};
  L->mpath = metrics_path(r);
  /* a live progress bar on a terminal; mpirun hands every rank a pseudo-terminal even when
   * its own output is redirected, so under a launcher the bar stays off */
  bool launched = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("SLURM_PROCID");
  L->lead = world_rank() == 0;
  L->tty = L->lead && !launched && isatty(fileno(stdout));
  /* the profile leaves out the first two steps (allocation, first touch, warm-up), or only the
   * first in runs of fewer than four */
  L->profile_from = r->start_step + (p->steps - r->start_step >= 4 ? 2 : 1);
  /* a run of its own id in its checkpoints (a rollback's journal tells its saves from the
   * history it replaces) */
  snprintf(r->run_id, sizeof r->run_id, "%016llx", (unsigned long long)dcp_new_save_id());
  /* checkpoint.overwrite with step folders after the start (a rollback, or a rerun from
   * scratch): they, and the metrics file, stay as they were until its first save commits */
  int newer = 0;
  int64_t newest = -1;
  if (L->lead && p->ckpt_dir[0] && p->ckpt_overwrite &&
      ckpt_newer(p->ckpt_dir, r->start_step, r->start_step, &newer, &newest) != STATUS_OK)
    newer = 0;
  bool rollback = newer > 0; /* (rank 0's: the metrics file and the journal are its) */

  if (L->lead && L->mpath[0] &&
      (L->mf = train_metrics_open(L->mpath, r->start_step, patch, r->saved_line,
                                  rollback ? L->mtmp : NULL, sizeof L->mtmp)) == NULL)
    L->bad = errno;
  /* its journal: a job killed between its first save and the removal of the folders it
   * replaces is finished by the next start, not left with both histories */
  fsdpc_status_t jst = STATUS_OK;
  if (L->lead && newer > 0) {
    char *own = L->mtmp[0] ? realpath(L->mtmp, NULL) : NULL; /* found from any folder */
    jst = ckpt_rollback_begin(p->ckpt_dir, r->start_step, r->run_id, own ? own : "");
    free(own);
  }
  /* unbuffered: a line that fails to be written is cut off the file (metrics_write), and no
   * buffered rest of it is written later */
  if (L->mf != NULL) setvbuf(L->mf, NULL, _IONBF, 0);
  fsdpc_status_t st = train_metrics_agree(L->mpath, L->bad);
  if (st == STATUS_OK) st = pg_agree(world_pg(), jst);
  if (st == STATUS_OK) {
    L->micro_loss = calloc((size_t)p->grad_accum, sizeof *L->micro_loss);
    if (L->micro_loss == NULL) st = err_set(STATUS_ENOMEM, "out of host memory");
  }
  if (st == STATUS_OK) st = train_saver_init(&L->saver, r);
  bool saver = st == STATUS_OK;
  L->moe = nn_moe_aux_of(r->root);
  L->experts = nn_moe_aux_experts(L->moe);
  if (st == STATUS_OK && L->moe && (L->load = calloc((size_t)L->experts, sizeof *L->load)) == NULL)
    st = err_set(STATUS_ENOMEM, "out of host memory");
  if (st == STATUS_OK && r->pp_sched != NULL &&
      (L->pp_peaks = calloc((size_t)p->par.pp, sizeof *L->pp_peaks)) == NULL)
    st = err_set(STATUS_ENOMEM, "out of host memory");
  if (st != STATUS_OK) {
    if (saver) train_saver_free(&L->saver);
    free(L->pp_peaks);
    free(L->load);
    free(L->micro_loss);
    if (L->mf != NULL) fclose(L->mf);
    return st;
  }
  L->t_start = device_clock_seconds();
  train_counted_bytes(r); /* reset */
  return STATUS_OK;
}

/* Step, forward and backward: the micro-steps, the gradient norm (the step's one host wait),
 * then the micro-steps' losses, read once the norm has waited for the device. */
static fsdpc_status_t step_compute(run_t *r, loop_t *L, step_out_t *o) {
  const fsdpc_plan_t *p = &r->plan;
  nn_module_t *root = r->root;
  /* the step's samples read first, on every rank, before any of its collectives: a bad one
   * stops every rank alike with the model as the last step left it */
  fsdpc_status_t st =
      pg_agree(world_pg(), check_samples(r->data, &L->spec, o->s, p->grad_accum, "data.path"));
  if (st != STATUS_OK) {
    L->agreed = L->keep = true;
    return st;
  }
  optim_zero_grad(r->opt);
  int64_t ran = 0; /* micro-steps whose loss tensors are to be read (none under a pipeline) */
  if (r->pp_sched != NULL) { /* the micro-batches through the pipeline's schedule */
    st = train_pp_step(r, &L->spec, o->s, &o->loss, &o->p2p);
    if (st == STATUS_OK) /* the pipeline's sends, every rank's summed */
      st = pg_host_all_reduce(mesh_group(parallel_pp_mesh(r->par), 0), &o->p2p, &o->p2p, 1,
                              PG_HOST_F64, REDUCE_SUM);
  } else {
    for (int64_t k = 0; k < p->grad_accum && st == STATUS_OK; k++, ran++) {
      fsdp_set_is_last_backward(root, k == p->grad_accum - 1);
      st = train_micro_step_async(root, r->dev, r->data, &L->spec, o->s, k, &L->micro_loss[k]);
    }
  }
  o->factor = lr_schedule_factor(&L->sched, o->s);
  o->coef = 1;
  if (st == STATUS_OK)
    st = clip_grad_coef(r->save_ps, r->save_n, /* a tied weight counted once */
                        p->clip_grad_norm > 0 ? p->clip_grad_norm : INFINITY, r->all, &o->norm,
                        &o->coef);
  for (int64_t k = 0; k < ran; k++) {
    double l = 0;
    if (st == STATUS_OK && L->micro_loss[k].storage != NULL)
      st = llama_loss_read(&L->micro_loss[k], &l);
    tensor_free(&L->micro_loss[k]); /* after a failure: the losses not read */
    o->loss += l / (double)p->grad_accum;
  }
  return st;
}

/* Step, the MoE blocks' routing over the ranks: the tokens each expert got from every block
 * (their sum over the ranks; the ranks of a tp group each count the group's tokens), the
 * load-balancing loss's mean. */
static fsdpc_status_t step_moe(const run_t *r, loop_t *L, step_out_t *o) {
  if (L->moe == NULL) return STATUS_OK;
  nn_moe_aux_take_step(L->moe, L->load, L->experts, &o->aux_loss);
  FSDPC_TRY(pg_host_all_reduce(world_pg(), L->load, L->load, L->experts, PG_HOST_I64, REDUCE_SUM));
  for (int e = 0; e < L->experts && r->plan.par.tp > 1; e++) L->load[e] /= r->plan.par.tp;
  FSDPC_TRY(pg_host_all_reduce(world_pg(), &o->aux_loss, &o->aux_loss, 1, PG_HOST_F64, REDUCE_SUM));
  o->aux_loss /= world_size();
  o->load_min = o->load_max = L->load[0];
  for (int e = 1; e < L->experts; e++) {
    o->load_min = L->load[e] < o->load_min ? L->load[e] : o->load_min;
    o->load_max = L->load[e] > o->load_max ? L->load[e] : o->load_max;
  }
  return STATUS_OK;
}

/* Step, the ranks' agreement: the loss, a save's state and the stop requests in one sum; a
 * non-finite step stops the run (every rank alike) unless train.nonfinite skips it. */
static fsdpc_status_t step_agree(run_t *r, loop_t *L, step_out_t *o) {
  const fsdpc_plan_t *p = &r->plan;
  double t = device_clock_seconds(), step_est = t - o->t0 > L->step_max ? t - o->t0 : L->step_max;
  double save_s = L->saver.last_s > 0 ? L->saver.last_s : step_est;
  bool time_up = p->time_limit_s > 0 && t - r->t_launch + step_est + save_s > p->time_limit_s;
  o->sums[0] = o->loss;
  train_save_values(&L->saver, o->sums + 1); /* an asynchronous save: written, failed */
  int nsums = 3 + train_stop_values(p, time_up, o->sums + 3);
  FSDPC_TRY(pg_host_all_reduce(world_pg(), o->sums, o->sums, nsums, PG_HOST_F64, REDUCE_SUM));
  o->loss = o->sums[0] / world_size(); /* the ranks of one tp group hold the same loss */
  o->stop = train_stop_of(p, o->sums + 3);
  o->stopping = o->s + 1 < p->steps && (o->stop.signal != 0 || o->stop.time_limit);
  /* the same verdict on every rank: the loss and the norm are reduced over the world */
  o->finite = isfinite(o->loss) && isfinite(o->norm);
  if (!o->finite && !p->skip_nonfinite && o->s == r->start_step) {
    L->agreed = true; /* before any update: the learning rate is not the cause */
    return err_set(STATUS_EINVAL,
                   "step %lld: the loss is %g and the gradient norm %g at the run's first step, "
                   "before any update of its own: the weights it starts from (%s%s) hold "
                   "non-finite values, or the model overflows in its compute dtype "
                   "(parallelize.fully_shard.mp_policy)",
                   (long long)o->s + 1, unsigned_nan(o->loss), unsigned_nan(o->norm),
                   r->resumed_from[0] ? "the checkpoint "
                   : p->init_from[0]  ? "model.init_from "
                                      : "",
                   r->resumed_from[0] ? r->resumed_from
                   : p->init_from[0]  ? p->init_from
                                      : "the initialisation of model.seed");
  }
  if (!o->finite && !p->skip_nonfinite) {
    L->agreed = true; /* not saved: the weights that gave it would give it again */
    return err_set(STATUS_EINVAL,
                   "step %lld: the loss is %g and the gradient norm %g; stopping before the "
                   "optimizer applies the step, so the weights and the last checkpoint stay "
                   "finite (lower optim.lr, set optim.clip_grad_norm, or set train.nonfinite: "
                   "skip to skip such steps)",
                   (long long)o->s + 1, unsigned_nan(o->loss), unsigned_nan(o->norm));
  }
  if (!o->finite && L->lead)
    fprintf(stderr,
            "%s: step %lld: the loss is %g and the gradient norm %g; the step "
            "is skipped (train.nonfinite: skip)\n",
            train_prog(), (long long)o->s + 1, unsigned_nan(o->loss), unsigned_nan(o->norm));
  return STATUS_OK;
}

/* Step, the update: the optimizer (after a save in flight has copied what it changes), then
 * the step's figures. */
static fsdpc_status_t step_apply(run_t *r, loop_t *L, step_out_t *o) {
  const fsdpc_plan_t *p = &r->plan;
  train_save_wait_staged(&L->saver);
  if (o->finite) FSDPC_TRY(optim_step_scaled(r->opt, o->factor, o->coef));
  /* the MoE blocks' expert_bias toward the step's mean load (nn_moe_set_routing's bias) */
  if (o->finite) FSDPC_TRY(nn_moe_update_bias(r->root, world_pg()));
  if (!o->finite) nn_moe_discard_bias_counts(r->root); /* the skipped step's routing */
  L->completed = o->s + 1;
  FSDPC_TRY(device_stream_sync(r->dev));
  o->dt = device_clock_seconds() - o->t0;
  o->tokens = (double)(train_global_batch(r) * p->seq_len);
  o->tps = o->tokens / o->dt;
  o->comm = train_counted_bytes(r);
  o->peak = mem_stats(r->dev).peak;
  o->state = mem_stats(r->dev).current;
  if (L->pp_peaks != NULL) { /* every stage's peak, for the metrics */
    double mine = (double)o->peak;
    FSDPC_TRY(pg_host_all_gather(mesh_group(parallel_pp_mesh(r->par), 0), &mine, L->pp_peaks, 1,
                                 PG_HOST_F64));
  }
  L->peak_max = o->peak > L->peak_max ? o->peak : L->peak_max;
  if (o->s == r->start_step) L->first_loss = o->loss;
  L->step_max = o->dt > L->step_max ? o->dt : L->step_max;
  return STATUS_OK;
}

/* Report: the step's line of the metrics file, with its evaluation when o->eval_now (NULL when
 * out of host memory). */
static cJSON *metrics_json(const run_t *r, const loop_t *L, const step_out_t *o) {
  const fsdpc_plan_t *p = &r->plan;
  cJSON *j = cJSON_CreateObject();
  if (j == NULL) return NULL;
  cJSON_AddNumberToObject(j, "step", (double)(o->s + 1));
  cJSON_AddNumberToObject(j, "loss", o->loss);
  cJSON_AddNumberToObject(j, "lr", p->optim.lr * o->factor);
  cJSON_AddNumberToObject(j, "grad_norm", o->norm);
  cJSON_AddNumberToObject(j, "tokens_per_s", o->tps);
  cJSON_AddNumberToObject(j, "peak_mem_bytes", (double)o->peak);
  size_t nccl = mem_stats(r->dev).comm; /* NCCL's own buffers, apart from the peak */
  if (nccl > 0) cJSON_AddNumberToObject(j, "nccl_mem_bytes", (double)nccl);
  cJSON_AddNumberToObject(j, "comm_bytes", o->comm);
  cJSON_AddNumberToObject(j, "state_bytes", (double)o->state);
  cJSON_AddNumberToObject(j, "step_time_s", o->dt);
  if (o->eval_now) cJSON_AddNumberToObject(j, "eval_loss", o->eval_loss);
  if (o->eval_now) cJSON_AddNumberToObject(j, "eval_peak_mem_bytes", (double)o->eval_peak);
  if (r->pp_sched != NULL) {
    cJSON_AddNumberToObject(j, "p2p_bytes", o->p2p);
    cJSON *pk = cJSON_AddArrayToObject(j, "pp_peak_mem_bytes"); /* pipeline rank q's */
    for (int q = 0; pk && L->pp_peaks && q < p->par.pp; q++)
      cJSON_AddItemToArray(pk, cJSON_CreateNumber(L->pp_peaks[q]));
  }
  if (L->moe != NULL) { /* the routing: tokens per expert (every block), the balance loss */
    cJSON_AddNumberToObject(j, "aux_loss", o->aux_loss);
    cJSON *load = cJSON_AddArrayToObject(j, "expert_load");
    for (int e = 0; load && e < L->experts; e++)
      cJSON_AddItemToArray(load, cJSON_CreateNumber((double)L->load[e]));
    cJSON_AddNumberToObject(j, "expert_load_min", (double)o->load_min);
    cJSON_AddNumberToObject(j, "expert_load_max", (double)o->load_max);
  }
  if (L->saver.stall_s > 0) cJSON_AddNumberToObject(j, "ckpt_stall_s", L->saver.stall_s);
  if (L->saver.saved_step >= 0) { /* a save committed during this step */
    cJSON_AddNumberToObject(j, "ckpt_saved_step", (double)L->saver.saved_step);
    cJSON_AddNumberToObject(j, "ckpt_save_s", L->saver.last_s);
  }
  return j;
}

/* Save: an asynchronous save every rank has written commits here (one that failed stops the
 * run, named); then a save every checkpoint.interval steps, of the last step, and of a step
 * the run stops after (those two wait for their commit). Agreed over the ranks. */
/* The state after step handed to the saver under the run's record (wait: committed before
 * returning; eval_pending: saved_under's; line: the step's metrics line to record, or NULL).
 * Collective. */
static fsdpc_status_t save_step(run_t *r, loop_t *L, int64_t step, bool wait, bool eval_pending,
                                cJSON *line) {
  char *under = NULL;
  /* restored, the line is of a save that committed: this one, when it waits for its commit
   * (whose times the line cannot hold: it is recorded before them) */
  if (line != NULL && wait) {
    cJSON_DeleteItemFromObjectCaseSensitive(line, "ckpt_saved_step");
    cJSON_DeleteItemFromObjectCaseSensitive(line, "ckpt_save_s");
    cJSON_DeleteItemFromObjectCaseSensitive(line, "ckpt_stall_s");
    cJSON_AddNumberToObject(line, "ckpt_saved_step", (double)step);
  }
  fsdpc_status_t st = pg_agree(world_pg(), saved_under(r, eval_pending, line, &under));
  if (st == STATUS_OK) st = train_save(&L->saver, r, step, under, wait);
  if (st == STATUS_OK) L->asked = step;
  free(under);
  return st;
}

/* save_step of step o, its metrics line (rank 0's) recorded. Collective. */
static fsdpc_status_t save_step_of(run_t *r, loop_t *L, const step_out_t *o, bool wait,
                                   bool eval_pending) {
  cJSON *line = world_rank() == 0 ? metrics_json(r, L, o) : NULL;
  fsdpc_status_t st = save_step(r, L, o->s + 1, wait, eval_pending, line);
  cJSON_Delete(line);
  return st;
}

/* Whether an evaluation follows step done (of those trained): every eval.interval steps and
 * after the last. */
static bool eval_due(const run_t *r, int64_t done) {
  const fsdpc_plan_t *p = &r->plan;
  return r->eval != NULL &&
         ((p->eval_interval > 0 && done % p->eval_interval == 0) || done == p->steps);
}

static fsdpc_status_t step_save(run_t *r, loop_t *L, step_out_t *o) {
  const fsdpc_plan_t *p = &r->plan;
  int64_t done = o->s + 1;
  fsdpc_status_t st = train_save_poll(&L->saver, r, o->sums + 1);
  bool save = p->ckpt_dir[0] && ((p->ckpt_interval > 0 && done % p->ckpt_interval == 0) ||
                                 done == p->steps || o->stopping);
  /* a stop skips the step's evaluation (step_evaluate): its checkpoint says so, and the run
   * that resumes it evaluates first */
  if (st == STATUS_OK && save)
    st = save_step_of(r, L, o, o->stopping || done == p->steps, o->stopping && eval_due(r, done));
  L->agreed = st != STATUS_OK;
  return st;
}

/* A rollback's metrics file takes its name once the rollback's first save has committed (rank
 * 0); with final, a run ending before that leaves the old file as it was. */
static void metrics_settle(loop_t *L, bool final) {
  if (!L->mtmp[0] || L->mf == NULL) return;
  if (L->saver.replaced) {
    if (fflush(L->mf) != 0 || rename(L->mtmp, L->mpath) != 0) L->bad = errno ? errno : EIO;
    L->mtmp[0] = 0;
  } else if (final) {
    unlink(L->mtmp);
    L->mtmp[0] = 0;
  }
}

/* evaluate() with its own peak memory into *peak, its collectives left out of the next step's
 * counts. */
static fsdpc_status_t evaluate_measured(run_t *r, const data_spec_t *spec, double *loss,
                                        size_t *peak) {
  mem_reset_peak(r->dev);
  fsdpc_status_t st = evaluate(r, spec, loss);
  *peak = mem_stats(r->dev).peak;
  train_counted_bytes(r);
  return st;
}

/* Evaluate: after every eval.interval steps and after the last. */
static fsdpc_status_t step_evaluate(run_t *r, loop_t *L, step_out_t *o) {
  o->eval_now = !o->stopping && eval_due(r, o->s + 1);
  return o->eval_now ? evaluate_measured(r, &L->spec, &o->eval_loss, &o->eval_peak) : STATUS_OK;
}

/* Report: the step's line of the metrics file (rank 0), agreed over the ranks (a full disk
 * stops every rank). */
static void metrics_write(run_t *r, loop_t *L, const step_out_t *o) {
  if (L->mf) {
    cJSON *j = metrics_json(r, L, o);
    char *line = cJSON_PrintUnformatted(j);
    long at = ftell(L->mf);
    if (line == NULL || fprintf(L->mf, "%s\n", line) < 0 || fflush(L->mf) != 0) {
      L->bad = errno ? errno : EIO;
      /* the file ends on its last whole line, as fsdp-plot reads it; the line goes into the
       * step's checkpoint, whence the resumed run writes it */
      if (at >= 0 && ftruncate(fileno(L->mf), at) == 0) clearerr(L->mf);
      cJSON_Delete(L->unwritten);
      L->unwritten = j;
      j = NULL;
    }
    free(line);
    cJSON_Delete(j);
  }
}

static fsdpc_status_t metrics_line(run_t *r, loop_t *L, const step_out_t *o) {
  metrics_write(r, L, o);
  if (!L->mpath[0]) return STATUS_OK;
  fsdpc_status_t st = train_metrics_agree(L->mpath, L->bad);
  if (st != STATUS_OK) L->agreed = L->keep = true;
  return st;
}

/* Report: rank 0's line every log.interval steps (and the first and last), else a live
 * progress bar on a terminal; the evaluation's line. */
static void progress_line(const run_t *r, const loop_t *L, const step_out_t *o) {
  const fsdpc_plan_t *p = &r->plan;
  int64_t s = o->s;
  bool show = s == 0 || s + 1 == p->steps || (s + 1) % p->log_interval == 0;
  double elapsed = device_clock_seconds() - L->t_start,
         eta = elapsed / (double)(s + 1) * (double)(p->steps - s - 1);
  char pm[32];
  train_mib(pm, sizeof pm, (double)o->peak);
  char moe[96] = "";
  if (L->moe != NULL)
    snprintf(moe, sizeof moe, "  aux %.4f  load %lld-%lld", o->aux_loss, (long long)o->load_min,
             (long long)o->load_max);
  if (show) {
    printf(
        "%sstep %5lld/%lld  loss %.6f  lr %.3e  grad_norm %.4f%s  %.0f tok/s  peak %s  "
        "ETA %.0fs\n",
        L->tty ? "\r\033[K" : "", (long long)(s + 1), (long long)p->steps, o->loss,
        p->optim.lr * o->factor, o->norm, moe, o->tps, pm, eta);
  } else if (L->tty) { /* live progress on a terminal */
    int w = 30, done = (int)((double)w * (double)(s + 1) / (double)p->steps);
    printf("\r[%.*s%*s] %lld/%lld  loss %.4f  %.0f tok/s  ETA %.0fs", done,
           "##############################", w - done, "", (long long)(s + 1), (long long)p->steps,
           o->loss, o->tps, eta);
  }
  if (o->eval_now) eval_line(r, s + 1, o->eval_loss, L->tty && !show ? "\r\033[K" : "");
  fflush(stdout);
}

/* A signal of train.signals that came while the step saved or evaluated: agreed now (the
 * step's own agreement came before), so the run stops at this step, saved (an asynchronous
 * save of it committed first), not after another step and another save. */
static fsdpc_status_t step_stop_late(run_t *r, loop_t *L, step_out_t *o) {
  const fsdpc_plan_t *p = &r->plan;
  int64_t done = o->s + 1;
  bool saved = p->ckpt_dir[0] && L->asked == done;
  if (o->stopping || done >= p->steps || p->n_signals == 0 || !(saved || o->eval_now))
    return STATUS_OK; /* (the same on every rank) */
  double v[1 + PLAN_MAX_SIGNALS];
  int n = train_stop_values(p, false, v);
  fsdpc_status_t st = pg_host_all_reduce(world_pg(), v, v, n, PG_HOST_F64, REDUCE_SUM);
  train_stop_t stop = st == STATUS_OK ? train_stop_of(p, v) : (train_stop_t){0};
  if (stop.signal == 0) return st;
  o->stopping = true;
  o->stop = stop;
  if (p->ckpt_dir[0])
    st = saved ? train_save_finish(&L->saver, r) : save_step_of(r, L, o, true, false);
  L->agreed = st != STATUS_OK;
  return st;
}

/* One step, in its phases. *stop: the run ends after it (a signal or the time limit). */
static fsdpc_status_t step(run_t *r, loop_t *L, int64_t s, bool *stop) {
  step_out_t o = {.s = s, .t0 = device_clock_seconds()};
  if (s == L->profile_from && kernel_profile_enabled()) kernel_profile_reset();
  if (s == L->profile_from) L->t_profile = o.t0;
  mem_reset_peak(r->dev);
  L->saver.stall_s = 0;
  L->saver.saved_step = -1;
  FSDPC_TRY(step_compute(r, L, &o));
  FSDPC_TRY(step_moe(r, L, &o));
  FSDPC_TRY(step_agree(r, L, &o));
  FSDPC_TRY(step_apply(r, L, &o));
  FSDPC_TRY(step_save(r, L, &o));
  metrics_settle(L, false);
  fsdpc_status_t ev = step_evaluate(r, L, &o);
  L->last_loss = o.loss;
  L->tok_sum += o.tokens;
  if (ev != STATUS_OK) { /* the step trained (and saved): its lines, without the evaluation */
    o.eval_now = false;
    metrics_write(r, L, &o);
    if (L->lead) progress_line(r, L, &o);
    return ev;
  }
  FSDPC_TRY(step_stop_late(r, L, &o));
  FSDPC_TRY(metrics_line(r, L, &o));
  L->steps_done = s + 1 - r->start_step;
  *stop = o.stopping;
  if (L->lead) progress_line(r, L, &o);
  if (o.stopping) {
    r->stopped_by = o.stop.signal;
    r->timed_out = o.stop.signal == 0;
    if (L->lead) stopped_line(r, &o.stop, s + 1, L->tty);
  }
  return STATUS_OK;
}

/* Rank 0's kernel profile of the steps from profile_from on (FSDPC_PROFILE=1). */
static fsdpc_status_t profile_report(const run_t *r, const loop_t *L) {
  double k = 0, span = device_clock_seconds() - L->t_profile;
  printf("kernels of rank 0 in steps %lld-%lld (FSDPC_PROFILE):\n", (long long)L->profile_from + 1,
         (long long)r->plan.steps);
  fsdpc_status_t st = kernel_profile_report(stdout, &k);
  printf("kernels %.3f s of %.3f s\n", k, span);
  if (kernel_attention_fused_runs() > 0)
    printf("attention: cuDNN fused, %lld calls\n", (long long)kernel_attention_fused_runs());
  else if (r->dev.type == DEVICE_CUDA)
    printf("attention: batched cuBLAS products (%s)\n", kernel_attention_fused_note());
  if (r->dev.type == DEVICE_CUDA) {
    const char *note = kernel_matmul_lt_note();
    printf("matrix products: cuBLASLt %lld calls%s%s\n", (long long)kernel_matmul_lt_runs(),
           note[0] ? "; the last that took cublasGemmEx: " : "", note);
    const char *why = kernel_matmul_grouped_note();
    if (kernel_matmul_grouped_runs() > 0 || why[0])
      printf("experts' products: %lld grouped cuBLAS calls%s%s\n",
             (long long)kernel_matmul_grouped_runs(), why[0] ? "; the last one by one: " : "", why);
  }
  return st;
}

/* After a failure every rank met alike with the model as its last completed step made it:
 * that step saved (and a save in flight committed) before the run stops on st, whose
 * message is kept. Collective. */
static fsdpc_status_t save_before_stopping(run_t *r, loop_t *L, fsdpc_status_t st) {
  if (!r->plan.ckpt_dir[0]) return st;
  char why[4096];
  snprintf(why, sizeof why, "%s", err_detail());
  fsdpc_status_t sv = L->completed > L->asked
                          ? save_step(r, L, L->completed, true, false, L->unwritten)
                          : train_save_finish(&L->saver, r);
  char dir[PLAN_PATH_MAX + 32];
  ckpt_step_dir(r->plan.ckpt_dir, L->completed, dir, sizeof dir);
  if (world_rank() == 0 && sv == STATUS_OK && L->completed > r->start_step)
    fprintf(stderr,
            "%s: stopping after step %lld on the error below; saved %s first (resume with "
            "checkpoint.load: auto)\n",
            train_prog(), (long long)L->completed, dir);
  if (world_rank() == 0 && sv != STATUS_OK)
    fprintf(stderr, "%s: the save before stopping failed too: %s\n", train_prog(), err_detail());
  return err_set(st, "%s", why);
}

/* Finish: the saver and the metrics file closed (agreed), the plot, rank 0's summary. */
static fsdpc_status_t loop_finish(run_t *r, loop_t *L, fsdpc_status_t st) {
  /* a failure this rank may have met alone (memory, the data file, a device) stops the others
   * at once, where they would wait for it in the step's collectives until the watchdog */
  if (st != STATUS_OK && !L->agreed) world_stop(st);
  /* after a failure every rank met alike, a save in flight (of a step before it) commits, as
   * it would have without checkpoint.async; else it stays uncommitted */
  if (st != STATUS_OK && L->agreed && !L->keep) {
    char why[4096];
    snprintf(why, sizeof why, "%s", err_detail());
    if (train_save_finish(&L->saver, r) != STATUS_OK && world_rank() == 0)
      fprintf(stderr, "%s: the save in flight failed too: %s\n", train_prog(), err_detail());
    err_set(st, "%s", why);
  }
  train_saver_free(&L->saver);
  /* a rollback that committed nothing: its journal goes, the folders as they were */
  if (L->lead && r->plan.ckpt_dir[0] && !L->saver.replaced) ckpt_rollback_end(r->plan.ckpt_dir);
  free(L->micro_loss);
  free(L->load);
  free(L->pp_peaks);
  cJSON_Delete(L->unwritten);
  metrics_settle(L, true);
  if (L->mf != NULL && fclose(L->mf) != 0) L->bad = errno ? errno : EIO;
  if (L->mpath[0]) { /* the file closed (its last lines written): every rank takes this path */
    fsdpc_status_t ms = train_metrics_agree(L->mpath, L->bad);
    if (st == STATUS_OK) st = ms;
  }
  if (st == STATUS_OK && L->lead && r->args.plot != NULL &&
      (st = train_plot_metrics(&L->mpath, 1, r->args.plot)) == STATUS_OK)
    printf("plot: %s\n", r->args.plot);
  if (st != STATUS_OK || !L->lead) return st;
  double total = device_clock_seconds() - L->t_start;
  char pm[32], held[64] = "", nb[32];
  train_mib(pm, sizeof pm, (double)L->peak_max);
  if (mem_stats(r->dev).comm > 0) { /* NCCL's buffers are not in the allocator's peak */
    train_mib(nb, sizeof nb, (double)mem_stats(r->dev).comm);
    snprintf(held, sizeof held, " (and %s held by NCCL)", nb);
  }
  printf("done: %lld step%s in %.1f s; loss %.4f -> %.4f; %.0f tokens/s; peak memory %s%s\n",
         (long long)L->steps_done, L->steps_done == 1 ? "" : "s", total, L->first_loss,
         L->last_loss, L->tok_sum / total, pm, held);
  if (kernel_profile_enabled() && L->t_profile > 0) st = profile_report(r, L);
  return st;
}

/* Whether the step a run resumes from still needs its evaluation: the metrics file has its
 * line without one (or none, and the checkpoint's record of the line none), else (no file)
 * the checkpoint records a stop that skipped it. seen: rank 0's view of the file. Collective. */
static fsdpc_status_t resume_eval_needed(run_t *r, train_metrics_seen_t *seen, bool *need) {
  *need = r->resume_eval;
  const char *mpath = metrics_path(r);
  if (r->start_step == 0 || !mpath[0]) return STATUS_OK;
  double v[2] = {0, 0};
  if (world_rank() == 0) {
    *seen = train_metrics_scan(mpath, r->start_step);
    /* a line the file lost whose record has its evaluation (a full disk): written as it is */
    bool recorded =
        !seen->line && cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(r->saved_line, "eval_loss"));
    v[0] = seen->file;
    v[1] = seen->file && !seen->eval && !recorded;
  }
  FSDPC_TRY(pg_host_all_reduce(world_pg(), v, v, 2, PG_HOST_F64, REDUCE_SUM));
  if (v[0] > 0) *need = v[1] > 0;
  return STATUS_OK;
}

/* The evaluation of the step a run starts from: its line printed, its figures into *patch (the
 * fields of that step's metrics line; caller frees). Collective. */
static fsdpc_status_t evaluate_start(run_t *r, cJSON **patch) {
  data_spec_t spec = spec_of(r);
  double eval_loss;
  size_t peak;
  FSDPC_TRY(evaluate_measured(r, &spec, &eval_loss, &peak));
  if (world_rank() == 0) eval_line(r, r->start_step, eval_loss, "");
  *patch = cJSON_CreateObject();
  cJSON_AddNumberToObject(*patch, "eval_loss", eval_loss);
  cJSON_AddNumberToObject(*patch, "eval_peak_mem_bytes", (double)peak);
  return STATUS_OK;
}

/* A run with nothing to train (its checkpoint at train.steps or after): the checkpoint's
 * evaluation when the plan has one, and its step's line in the metrics file (rank 0) where the
 * run that saved it stopped before writing it or its evaluation; a file with later steps is
 * left as it is. Collective. */
static fsdpc_status_t evaluate_saved(run_t *r, const train_metrics_seen_t *seen) {
  const fsdpc_plan_t *p = &r->plan;
  if (world_rank() == 0)
    printf("nothing to train: the checkpoint is after step %lld, train.steps is %lld\n",
           (long long)r->start_step, (long long)p->steps);
  cJSON *patch = NULL; /* a checkpoint's evaluation: resume it with train.steps at its step */
  if (r->eval != NULL) FSDPC_TRY(evaluate_start(r, &patch));
  /* checkpoint.keep, which a kill during the last save's pruning left undone: the run resumed
   * the newest checkpoint (auto), so the newest are those a finished run keeps */
  if (world_rank() == 0 && p->ckpt_keep > 0 && strcmp(p->ckpt_load, "auto") == 0 &&
      ckpt_prune(p->ckpt_dir, (int)p->ckpt_keep) != STATUS_OK) {
    fprintf(stderr, "%s: warning: checkpoint.keep: %s\n", train_prog(), err_detail());
    err_clear();
  }
  bool lost = !seen->line ? r->saved_line != NULL : patch != NULL && !seen->eval;
  if (world_rank() == 0 && seen->file && seen->last <= (double)r->start_step && lost) {
    FILE *f = train_metrics_open(metrics_path(r), r->start_step, seen->eval ? NULL : patch,
                                 r->saved_line, NULL, 0);
    if (f == NULL || fclose(f) != 0)
      fprintf(stderr, "%s: warning: cannot write step %lld's line into the metrics file '%s': %s\n",
              train_prog(), (long long)r->start_step, metrics_path(r), strerror(errno));
  }
  cJSON_Delete(patch);
  return STATUS_OK;
}

static fsdpc_status_t train(run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  train_metrics_seen_t seen = {0};
  bool eval_first;
  FSDPC_TRY(resume_eval_needed(r, &seen, &eval_first));
  if (r->start_step >= p->steps) return evaluate_saved(r, &seen); /* before the file is touched */
  /* the evaluation of the step resumed from, which the run that saved it did not make */
  cJSON *patch = NULL;
  if (eval_first && eval_due(r, r->start_step)) FSDPC_TRY(evaluate_start(r, &patch));
  loop_t L;
  fsdpc_status_t started = loop_start(r, &L, patch);
  cJSON_Delete(patch);
  FSDPC_TRY(started);
  fsdpc_status_t st = STATUS_OK;
  bool stop = false;
  for (int64_t s = r->start_step; s < p->steps && st == STATUS_OK && !stop; s++)
    st = step(r, &L, s, &stop);
  if (st != STATUS_OK && L.keep) st = save_before_stopping(r, &L, st);
  return loop_finish(r, &L, st);
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
  if (st == STATUS_OK) st = world_check_launch();
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
  if (st == STATUS_OK) world_set_timeout(r->plan.comm_timeout_s);
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

/* The run of an agreed set-up: the build, the header, then the dry run or the training. */
static int run(run_t *r) {
  if (!agree(start(r)) || !agree(build(r))) return 1;
  if (world_rank() == 0) train_header(r);
  if (r->args.dry_run) {
    train_dry_run(r);
    return 0;
  }
  if (!agree(train(r))) return 1;
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
  fsdpc_status_t up = world_init(&argc, &argv);
  if (up != STATUS_OK) {
    train_signals_release();
    if (world_pg() == NULL) {
      fprintf(stderr, "%s: %s\n", train_prog(), err_detail());
      return 1;
    }
    agree(up); /* the world is up: rank 0 reports it once for the ranks */
    world_finalize();
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
