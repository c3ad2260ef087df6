/*
 * Parallelism plans: the YAML file a user writes, read into plain C structs. The core never
 * sees YAML; a program can fill plan_t in code (start from plan_defaults) and get the same
 * behaviour.
 *
 *   plan_t p;
 *   TRY(plan_load(&p, "configs/fsdp.yaml", sets, n_sets));   // sets: "key.path=value"
 *   TRY(plan_resolve(&p, world_size()));                       // mesh sizes against the world
 *
 * Errors name the place and the key: "configs/x.yaml:12:5: parallelize.fully_shard.
 * reshard_after_forward: 3 does not divide mesh.dp_shard=4"; a value given by --set is named
 * "--set key=value" instead of a file position. Relative paths in the file are resolved
 * against the file's folder; those given by --set against the working directory.
 */
#ifndef FSDPC_PARALLEL_PLAN_H
#define FSDPC_PARALLEL_PLAN_H

#include "base/dtype.h"
#include "nn/data.h"
#include "nn/llama.h"
#include "nn/optim.h"
#include "parallel/tensor_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PLAN_MAX_UNITS 32
#define PLAN_MAX_TP_RULES 32
#define PLAN_PATH_MAX 512
#define PLAN_PATTERN_MAX 128

/* Where a value came from, for errors found after parsing (a unit matching nothing). */
typedef struct plan_where {
  char text[PLAN_PATH_MAX + 64]; /* "file:line:col" or "--set key=value" */
} plan_where_t;

/* One fully_shard unit: the modules whose FQN matches pattern (fnmatch), each its own group,
 * applied bottom-up; the root is implied. Settings default to the section's. */
typedef struct plan_unit {
  char pattern[PLAN_PATTERN_MAX];
  int reshard_after_forward; /* FSDP_RESHARD_AUTO, 0, 1 or N */
  dtype_t param_dtype;       /* DTYPE_COUNT: the parameter's own */
  dtype_t reduce_dtype;      /* DTYPE_COUNT: param_dtype */
  plan_where_t where;
} plan_unit_t;

/* One tensor-parallel rule: modules matching pattern get a style (layouts: TP_LAYOUT_DEFAULT
 * for the style's own). */
typedef struct plan_tp_rule {
  char pattern[PLAN_PATTERN_MAX];
  tp_style_t style;
  tp_layout_t input, output;
  plan_where_t where;
} plan_tp_rule_t;

typedef struct plan {
  char source[PLAN_PATH_MAX]; /* the YAML file */
  /* mesh: sizes, -1 = the rest of the world (at most one) */
  int dp_replicate, dp_shard, tp;
  plan_where_t mesh_where;
  /* model */
  llama_config_t model;
  char init_from[PLAN_PATH_MAX]; /* a Hugging Face folder, or "" */
  uint64_t model_seed;
  bool deferred_init; /* build meta, parallelise, then allocate and fill only local shards */
  /* parallelize.fully_shard */
  plan_unit_t units[PLAN_MAX_UNITS];
  int n_units;
  int reshard_after_forward; /* default for units; the root keeps FSDP_RESHARD_AUTO */
  dtype_t param_dtype, reduce_dtype;
  bool offload;
  plan_where_t fsdp_where;
  /* parallelize.tensor_parallel: the rules of `plan` (the built-in Llama plan when absent) */
  plan_tp_rule_t tp_rules[PLAN_MAX_TP_RULES];
  int n_tp_rules;
  bool tp_plan_given;
  bool sequence_parallel;
  plan_where_t tp_where;
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
  plan_where_t data_where;
  /* train */
  int64_t steps;
  uint64_t seed;
  bool activation_checkpointing;
  /* checkpoint */
  char ckpt_dir[PLAN_PATH_MAX], ckpt_load[PLAN_PATH_MAX];
  int64_t ckpt_interval, ckpt_keep;
  bool ckpt_verify; /* check every chunk's CRC-32 before loading */
  plan_where_t ckpt_where;
  /* log */
  char metrics[PLAN_PATH_MAX];
  int64_t log_interval;
} plan_t;

/* The defaults of every key (README lists them). */
void plan_defaults(plan_t *p);

/* Reads a YAML plan and applies sets ("key.path=value", scalars only) on top. Checks syntax,
 * keys (unknown ones get a did-you-mean), types and ranges. Local. */
status_t plan_load(plan_t *p, const char *path, const char *const *sets, int n_sets);

/* Resolves -1 mesh sizes against the world size and checks what needs it: the mesh product,
 * integer reshards dividing dp_shard, tensor-parallel sizes (heads, key/value heads, ffn_dim,
 * vocab_size and, under sequence parallelism, data.seq_len divisible by tp), the data file.
 * Local (every rank reaches the same verdict). */
status_t plan_resolve(plan_t *p, int world_size);

#ifdef __cplusplus
}
#endif

#endif
