/*
 * fsdp-train's job: the YAML file of a training run read into plain C structs: the
 * parallelism plan (mesh, parallelize; parallel_plan.h, usable with any model) and the job
 * (model, optim, schedule, data, train, checkpoint, log; the built-in Llama). The core never
 * sees YAML; a program can fill fsdpc_plan_t in code (start from plan_defaults) and get the same
 * behaviour.
 *
 *   fsdpc_plan_t p;
 *   FSDPC_TRY(plan_load(&p, "configs/fsdp.yaml", sets, n_sets));   // sets: "key.path=value"
 *   FSDPC_TRY(plan_resolve(&p, world_size()));                       // mesh sizes against the
 * world
 *
 * Errors name the place and the key: "configs/x.yaml:12:5: parallelize.fully_shard.
 * reshard_after_forward: 3 does not divide mesh.dp_shard=4"; a value given by --set is named
 * "--set key=value" instead of a file position. Relative paths in the file are resolved
 * against the file's folder; those given by --set against the working directory.
 */
#ifndef FSDPC_PARALLEL_PLAN_H
#define FSDPC_PARALLEL_PLAN_H

#include "core/dtype.h"
#include "train/data.h"
#include "models/llama/llama.h"
#include "nn/optim.h"
#include "parallel/parallel_plan.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

#define PLAN_MAX_SIGNALS 8

typedef struct fsdpc_plan {
  char source[PLAN_PATH_MAX]; /* the YAML file */
  parallel_plan_t par;        /* mesh and parallelize */
  /* model */
  llama_config_t model;
  bool model_given;              /* the plan states the architecture (model keys or init_from) */
  char init_from[PLAN_PATH_MAX]; /* a Hugging Face folder, or "" */
  char model_config[PLAN_PATH_MAX]; /* model.config's file (the architecture alone), or "" */
  char model_source[PLAN_PATH_MAX + 16]; /* the config.json the architecture came from
                                          * (model.init_from's or model.config's), or "" */
  uint64_t model_seed;
  bool deferred_init; /* build meta, parallelise, then allocate and fill only local shards */
  double moe_aux_loss_coef; /* moe.aux_loss_coef (applied to model.aux_loss_coef); < 0: not given */
  bool moe_aux_global;      /* moe.aux_loss_scope: global (over the data-parallel ranks) */
  /* set before plan_resolve_model by a tool that lays a checkpoint out for the plan (fsdp-ckpt
   * reshard): what only a run needs (the pipeline's microbatches) is not checked */
  bool layout_only;
  bool pipeline_given;      /* the plan has a pipeline section (mesh.pp's schedule) */
  /* optim, schedule */
  adamw_config_t optim;
  char group_patterns[ADAMW_MAX_GROUPS][PLAN_PATTERN_MAX]; /* storage of optim.groups[].pattern */
  double clip_grad_norm;                                   /* 0: no clipping */
  int64_t warmup_steps;
  double min_lr_ratio;
  /* data */
  char data_path[PLAN_PATH_MAX];
  data_format_t data_format;
  int64_t seq_len, batch_size, grad_accum;
  int64_t global_batch_size; /* samples a step over all data-parallel ranks; 0: not stated */
  bool grad_accum_given;     /* data.grad_accum in the plan (else derived from the global batch) */
  bool shuffle; /* each epoch's windows in an order drawn from train.seed */
  plan_where_t data_where;
  plan_where_t batch_where; /* of the batch keys (global_batch_size, batch_size, grad_accum) */
  /* eval: the loss on held-out tokens, without gradients */
  char eval_path[PLAN_PATH_MAX]; /* "": no evaluation */
  data_format_t eval_format;     /* data_format unless given */
  int64_t eval_interval;         /* after every that many steps (0: after the last only) */
  int64_t eval_batches;          /* global batches per evaluation */
  int64_t eval_batch_size;       /* samples per data-parallel rank (data.batch_size unless given) */
  plan_where_t eval_where;
  plan_where_t eval_path_where; /* of eval.path itself */
  /* train */
  int64_t steps;
  uint64_t seed; /* data.shuffle's order */
  bool activation_checkpointing;
  device_want_t device; /* auto (default), cpu or cuda */
  bool skip_nonfinite; /* a step with a non-finite loss or gradient norm: skipped, not fatal */
  double comm_timeout_s; /* the collective watchdog (world_set_timeout); 0: none */
  bool deterministic;    /* the same bits on every run: CUDA attention without cuDNN's atomics */
  int signals[PLAN_MAX_SIGNALS]; /* train.signals: each ends the run at a step boundary, saved */
  int n_signals;
  double time_limit_s; /* train.time_limit: save and stop before this many seconds (0: none) */
  /* checkpoint */
  char ckpt_dir[PLAN_PATH_MAX], ckpt_load[PLAN_PATH_MAX];
  int64_t ckpt_interval, ckpt_keep;
  bool ckpt_verify;         /* check every block of the checkpoint before loading */
  bool ckpt_overwrite; /* newer step folders than the run's start: removed after its first save */
  bool ckpt_async;     /* saves staged in host memory and written while training goes on */
  int64_t ckpt_block_bytes; /* the block size of the checksums of saved files */
  plan_where_t ckpt_where;
  plan_where_t load_where; /* of checkpoint.load itself */
  /* log */
  char metrics[PLAN_PATH_MAX];
  int64_t log_interval;
} fsdpc_plan_t;

/* The defaults of every key (docs/plan.md lists them). */
void plan_defaults(fsdpc_plan_t *p);

/* Reads a YAML plan and applies sets ("key.path=value", scalars only) on top. Checks syntax,
 * keys (unknown ones get a did-you-mean), types and ranges. Local. */
fsdpc_status_t plan_load(fsdpc_plan_t *p, const char *path, const char *const *sets, int n_sets);

/* plan_load, and the plan's settings as text (caller frees): one "key.path: value" line per
 * value of the file with the sets applied, sorted, list items as key[k]. Two runs whose texts
 * are equal read the same plan. Local. */
fsdpc_status_t plan_load_settings(fsdpc_plan_t *p, const char *path, const char *const *sets,
                                  int n_sets, char **settings);

/* Resolves -1 mesh sizes against the world size and checks what needs it: the mesh product,
 * integer reshards dividing dp_shard, tensor-parallel sizes (heads, key/value heads, ffn_dim,
 * vocab_size and, under sequence parallelism, data.seq_len divisible by tp), the data file.
 * Local (every rank reaches the same verdict). */
fsdpc_status_t plan_resolve(fsdpc_plan_t *p, int world_size);

/* pipeline.split_points of a resolved plan with them as each of its pp x stages_per_rank
 * stages' first block (starts[0] = 0). Local. */
fsdpc_status_t plan_pipeline_starts(const fsdpc_plan_t *p, int64_t *starts);

/* plan_resolve's checks of the mesh and the model only: for a tool that lays out a model
 * (fsdp-ckpt reshard) without training it. Local. */
fsdpc_status_t plan_resolve_model(fsdpc_plan_t *p, int world_size);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
