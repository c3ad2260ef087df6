/* The trainer's own pieces shared by its files (train_main, trainer.h): the arguments, the
 * run, the model it trains, and the report (the header, the dry run) printed from them.
 * Private to train/. */
#ifndef FSDPC_TRAIN_RUN_IMPL_H
#define FSDPC_TRAIN_RUN_IMPL_H

#include <cJSON.h>
#include <stdbool.h>
#include <stddef.h>

#include "checkpoint/dcp.h"
#include "parallel/parallelize.h"
#include "parallel/pipeline.h"
#include "train/ops_impl.h"
#include "train/plan.h"
#include "train/train.h"
#include "train/trainer.h"

typedef struct args {
  const char *config;
  const char *sets[256];
  int n_sets;
  const char *metrics;
  const char *plot; /* --plot: the metrics drawn as SVG at the end */
  bool dry_run;
  const char *verbose; /* -v or --verbose as given (with --dry-run: the per-unit table) */
  int world;          /* --world N with --dry-run: plan for N ranks from this one process */
  int ranks_per_node; /* --ranks-per-node M (with --world): 8, or N when fewer */
} args_t;

/* The learning-rate schedule a checkpoint's run trained under (saved_under.schedule). */
typedef struct saved_schedule {
  int64_t total_steps, warmup_steps; /* train.steps, schedule.warmup_steps */
  double min_ratio, lr;              /* schedule.min_lr_ratio, optim.lr */
} saved_schedule_t;

typedef struct run {
  fsdpc_plan_t plan;
  args_t args;
  parallel_t *par; /* the plan applied to the model; the rest is borrowed from it */
  mesh_t *mesh;    /* the world: (dp_replicate,) dp_shard(, tp) */
  pg_t *all;       /* every rank (gradient clipping) */
  const tp_plan_t *tp;
  fsdp_group_t *const *groups;
  int n_groups;
  /* the model: the program's (train_main's), or the plan's built-in architecture through
   * train_builtin_model */
  train_model_t model;
  bool builtin;
  llama_t *llama; /* the built-in model, or NULL */
  nn_module_t *root;
  nn_param_t **ps;
  int n;
  optim_t *opt;
  fsdpc_data_t *data;
  fsdpc_data_t *eval; /* eval.path's tokens, or NULL */
  device_t dev;
  char device_note[320]; /* why train.device auto took the CPU beside CUDA devices, or "" */
  int host_threads;      /* the host kernels' threads offload chose (0: left as they were) */
  int dp_size, dp_rank;
  int64_t start_step; /* steps already taken (resumed from a checkpoint) */
  char resumed_from[PLAN_PATH_MAX + 32];
  char run_id[24]; /* this run's, recorded in its checkpoints' saved_under ("run") */
  dcp_stats_t load_stats;
  int64_t verified;    /* chunks checked against their checksums before loading (-1: not asked) */
  int64_t saved_batch; /* the global batch the resumed checkpoint was saved with; 0: unknown */
  int64_t saved_tokens; /* the tokens of the data it was trained on; 0: unknown */
  /* train_data_order of the resumed checkpoint's run; "": unknown */
  char saved_order[96];
  saved_schedule_t saved_schedule; /* its learning-rate schedule; total_steps 0: unknown */
  char *settings;  /* the plan's settings text (plan_load_settings) */
  int lock_fd;     /* checkpoint.dir's lock (rank 0), or -1 */
  cJSON *carried;  /* the model's Hugging Face config its record carries (hf_config_carry), or
                    * NULL */
  bool resume_eval;      /* the resumed checkpoint's evaluation was skipped by a stop: run it */
  cJSON *saved_line;     /* the resumed step's metrics line its checkpoint records, or NULL */
  size_t made_len[64]; /* the folders of checkpoint.dir this run made: prefixes of it */
  int n_made;
  int stopped_by;  /* a signal stopped the run at a step boundary, or 0 */
  bool timed_out;  /* train.time_limit stopped it */
  double t_launch; /* when the process started (train.time_limit counts from it) */
  double eval_s;   /* the seconds of the last evaluation (0: none yet) */
  /* mesh.pp > 1 (pipe.c): this rank's pipeline index, the modules of its stages, the schedule */
  int pp_rank;
  nn_module_t **stage_modules;
  int n_stage_modules;
  pp_schedule_t *pp_sched;
  /* tied embeddings under mesh.pp: the shared weight, held by the first and the last pipeline
   * ranks (NULL elsewhere), its gradient summed between them after each step; the last one
   * leaves it out of the gradient norm and of its saves (train_pp_tied) */
  nn_param_t *tied;
  nn_param_t **save_ps; /* what this rank saves and counts in the norm: the first save_n of ps
                         * (the last pipeline rank's tied weight moved past them) */
  int save_n;
} run_t;

/* The plan's built-in architecture as a train_model_t whose self is r (model.c). */
train_model_t train_builtin_model(run_t *r);

/* Samples per optimizer step over all ranks. */
static inline int64_t train_global_batch(const run_t *r) {
  return r->plan.batch_size * r->plan.grad_accum * r->dp_size;
}
/* How a run reads its training data, in words ("in file order, samples of 129 tokens", or
 * "shuffled by train.seed 7, ..."): a resume under another order is warned of. */
void train_data_order(bool shuffle, uint64_t seed, int64_t seq_len, char *buf, size_t n);
/* The bytes this rank's groups sent since the last call (the counters are reset). */
double train_counted_bytes(const run_t *r);
/* bytes as "12.34 MiB" or "1.23 GiB" */
void train_mib(char *buf, size_t n, double bytes);
/* Pipeline parallelism (pipe.c). The modules of this rank's stages of the built-in model into
 * r->stage_modules and the schedule into r->pp_sched (nothing without mesh.pp); freed by
 * train_pp_free. */
fsdpc_status_t train_pp_stages(run_t *r);
void train_pp_free(run_t *r);
/* After the parameters are made (r->ps): the tied weight and r->save_ps. */
fsdpc_status_t train_pp_tied(run_t *r);
/* One step's forward and backward of every microbatch under the schedule: the step's mean loss
 * into *loss (every rank) and the bytes this rank sent to its pipeline neighbours into
 * *p2p_bytes. Collective over the pipeline group. */
fsdpc_status_t train_pp_step(run_t *r, const data_spec_t *spec, int64_t step, double *loss,
                             double *p2p_bytes);
/* Evaluation batches 0 to n - 1 of r->eval through the stages, without gradients, pipelined
 * (stage s runs batch b while stage s + 1 runs batch b - 1): the sum of their mean losses, in
 * batch order, into *sum on every pipeline rank; the batches the last stage finished into
 * *done on its rank (0 on the others). Collective over the pipeline group. */
fsdpc_status_t train_pp_eval(run_t *r, const data_spec_t *spec, int64_t n, bool stoppable,
                             double *sum, train_stop_t *cut, bool *agreed, int64_t *done);
/* Before evaluation forward f (one: the evaluation's data spec): this rank's samples of it
 * read into *ids and *targets when it reads them (reads; the caller frees them), then, when
 * stoppable, a signal of train.signals looked for and train.time_limit (within twice batch_s,
 * the last forward's seconds, of passing) checked, each agreed over the world: cut->signal or
 * cut->time_limit set when the evaluation is to end here. A sample that cannot be read fails
 * every rank alike (*agreed set). Collective over the world. */
fsdpc_status_t train_eval_agree(const run_t *r, const data_spec_t *one, int64_t f, bool reads,
                                bool stoppable, double batch_s, fsdpc_tensor_t *ids,
                                fsdpc_tensor_t *targets, train_stop_t *cut, bool *agreed);
/* The pipeline rank holding the last stage (the head and the loss). */
static inline int train_pp_last_rank(const run_t *r) {
  return pp_schedule_rank_of_stage(r->pp_sched, pp_schedule_stages(r->pp_sched) - 1);
}
/* The step's options for pp_step (also what --dry-run counts). */
pp_step_options_t train_pp_options(run_t *r);

/* The header every run prints first (rank 0). */
void train_header(const run_t *r);
/* --dry-run's report: placements, shapes, memory and communication of one step (rank 0). */
void train_dry_run(const run_t *r);

/* The set-up (trainer.c) and the training loop (loop.c) share these. */
/* This rank's share of the run's data order. */
data_spec_t train_spec_of(const run_t *r);
/* The samples d gives this rank for micro-batches [0, micros) of step `step`, read and
 * dropped: a bad token or a file cut short named under key. Local. */
fsdpc_status_t train_check_samples(const fsdpc_data_t *d, const data_spec_t *spec, int64_t step,
                                   int64_t micros, const char *key);
/* What an evaluation gave. */
typedef struct train_eval {
  double loss; /* the mean loss over eval.path's batches */
  train_stop_t stop; /* what stopped it, when something did (stoppable: train_stop_any): no
                      * loss then */
  bool agreed; /* its failure met every rank alike before any forward (a sample that cannot
                * be read now): the model is intact */
  int64_t done, forwards; /* forwards made of how many (a stopped one's: done < forwards) */
  double secs;            /* seconds it took */
} train_eval_t;
/* The mean loss over eval.path's batches (the same every time), without gradients; stoppable:
 * a signal of train.signals that reaches some rank ends it between two forwards. Collective
 * over the world. */
fsdpc_status_t train_evaluate(run_t *r, const data_spec_t *spec, bool stoppable, train_eval_t *out);
/* The seconds an evaluation is expected to take, from the last one's (0 when none ran: then
 * from step_s, the seconds of a training step, as its forwards' share of it). */
double train_eval_estimate(const run_t *r, double step_s);
/* Rank 0's line for an evaluation after step (prefix: to clear a progress bar). */
void train_eval_line(const run_t *r, int64_t step, double loss, const char *prefix);
/* The model's description for train_state.json (a JSON object's text; caller frees). */
fsdpc_status_t train_describe_model(const run_t *r, char **out);
/* The metrics file: --metrics, else log.metrics ("" for none). */
const char *train_metrics_path(const run_t *r);
/* The training of a built run, from its start step (the evaluation its checkpoint's run did
 * not make first; nothing to train: the checkpoint's evaluation). Collective over the world. */
fsdpc_status_t train_loop(run_t *r);

#endif
