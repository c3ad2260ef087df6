/*
 * Parallelism plans: how any module tree is parallelised, read from the `mesh` and
 * `parallelize` sections of a YAML file into plain C structs (or filled in code, starting
 * from parallel_plan_defaults). Nothing here knows a model: units and tensor-parallel rules
 * are FQN globs matched against whatever module tree the plan is applied to (parallelize.h).
 *
 *   parallel_plan_t pp;
 *   FSDPC_TRY(parallel_plan_load(&pp, "my_plan.yaml", NULL, 0));   // mesh + parallelize only
 *   FSDPC_TRY(parallel_plan_resolve(&pp, world_size()));           // -1 sizes, reshard divisors
 *
 *   # my_plan.yaml
 *   mesh: {dp_shard: -1, tp: 2}
 *   parallelize:
 *     fully_shard:
 *       units: ["layers.*"]
 *       reshard_after_forward: true
 *     tensor_parallel:
 *       plan: {"layers.*.fc1": colwise, "layers.*.fc2": rowwise}
 *
 * Errors name the place and the key ("my_plan.yaml:7:9: parallelize.fully_shard.units: ...");
 * a value given by --set is named "--set key=value" instead of a file position.
 */
#ifndef FSDPC_PARALLEL_PARALLEL_PLAN_H
#define FSDPC_PARALLEL_PARALLEL_PLAN_H

#include "core/dtype.h"
#include "parallel/pp_schedule.h"
#include "parallel/tensor_parallel.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

#define PLAN_MAX_UNITS 32
#define PLAN_MAX_TP_RULES 32
#define PLAN_MAX_SHARD_DIMS 32
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
  dtype_t output_dtype;      /* DTYPE_COUNT: fully_shard's default (fsdp_options_t) */
  plan_where_t where;
} plan_unit_t;

/* One shard dimension: the parameters whose FQN matches pattern (fnmatch, first match wins)
 * are sharded on dimension dim (negative counts from the end) by fully_shard; the others on 0. */
typedef struct plan_shard_dim {
  char pattern[PLAN_PATTERN_MAX];
  int dim;
  plan_where_t where;
} plan_shard_dim_t;

/* One tensor-parallel rule: modules matching pattern get a style (layouts: TP_LAYOUT_DEFAULT
 * for the style's own). */
typedef struct plan_tp_rule {
  char pattern[PLAN_PATTERN_MAX];
  tp_style_t style;
  tp_layout_t input, output;
  plan_where_t where;
} plan_tp_rule_t;

#define PLAN_MAX_PP_SPLITS 64

/* dp_shard of HYBRID_SHARD without mesh sizes: the job's ranks per node, found at resolve. */
#define PLAN_SIZE_NODE (-2)

typedef struct parallel_plan {
  char source[PLAN_PATH_MAX]; /* the YAML file, or "" when filled in code */
  /* mesh: sizes, -1 = the rest of the world (at most one) */
  int dp_replicate, dp_shard, tp;
  /* expert parallelism: the MoE blocks' experts split over groups of ep of the dp_shard ranks
   * (consecutive), and fully sharded over the dp_shard / ep ranks between the groups; or, when ep
   * does not divide dp_shard, over groups of ep / tp dp_shard ranks times all tp ranks (ep
   * borrows tp, as TorchTitan's; sequence parallelism gives each tp rank its own tokens); 1: off */
  int ep;
  /* pipeline parallelism: the model's layers split into pp x pp_stages_per_rank stages over
   * the outermost mesh dimension "pp" (1: off); its schedule and microbatches (the step's
   * micro-batches; 0: the grad accumulation's) */
  int pp;
  pp_schedule_kind_t pp_schedule;
  int pp_microbatches, pp_stages_per_rank;
  /* pipeline.sync_every_microbatch: reshard and reduce after every microbatch's backward;
   * false (the default): gathered once a step, gradients reduced after the last microbatch */
  bool pp_sync_every;
  /* pipeline.split_points: the module each stage after the first begins with ("" none: even) */
  char pp_splits[PLAN_MAX_PP_SPLITS][PLAN_PATTERN_MAX];
  int n_pp_splits;
  plan_where_t mesh_where, pp_where;
  plan_where_t pp_splits_where, pp_micro_where; /* pipeline.split_points', microbatches' own */
  plan_where_t ep_where; /* mesh.ep's own place (mesh_where without it) */
  plan_where_t tp_size_where; /* mesh.tp's own place (mesh_where without it) */
  plan_where_t pp_size_where; /* mesh.pp's own place (mesh_where without it) */
  /* parallelize.fully_shard */
  plan_unit_t units[PLAN_MAX_UNITS];
  int n_units;
  /* min_unit_params: a module no pattern names becomes a unit when the parameters under it
   * that no inner unit took number at least this many (torch's size-based wrap policy,
   * Accelerate's SIZE_BASED_WRAP); 0: off */
  int64_t min_unit_params;
  int reshard_after_forward; /* default for units; the root keeps FSDP_RESHARD_AUTO */
  dtype_t param_dtype, reduce_dtype, output_dtype;
  bool offload;
  plan_where_t fsdp_where;
  plan_where_t reshard_where; /* of reshard_after_forward where given ("" : not given) */
  char strategy[24]; /* sharding_strategy (or zero_stage's equivalent) as given; "" if none */
  plan_shard_dim_t shard_dims[PLAN_MAX_SHARD_DIMS]; /* shard_dims: {PATTERN: DIM}, in order */
  int n_shard_dims;
  /* optimizer_sharding: full (HFSDP: fsdp_options_t.shard_state_over_replicas when
   * dp_replicate > 1); false: shard (the sharded state of HSDP, 1/dp_shard) */
  bool state_over_replicas;
  plan_where_t optim_where;
  /* parallelize.tensor_parallel: the rules of `plan` (first match wins) */
  plan_tp_rule_t tp_rules[PLAN_MAX_TP_RULES];
  int n_tp_rules;
  bool tp_plan_given; /* the rules came from the file or code (not a model's defaults) */
  bool sequence_parallel;
  plan_where_t tp_where;
} parallel_plan_t;

/* Whether a resolved plan's ep borrows the tp ranks (ep does not divide dp_shard). */
bool parallel_plan_ep_borrows_tp(const parallel_plan_t *pp);

/* The defaults: mesh dp_replicate 1, dp_shard -1, tp 1; no units (the root alone is one
 * group); reshard_after_forward auto; the parameters' own dtypes; no tensor-parallel rules. */
void parallel_plan_defaults(parallel_plan_t *pp);

/* Reads the `mesh` and `parallelize` sections of a YAML file (any other top-level key is an
 * error) and applies sets ("key.path=value", scalars only) on top. Checks syntax, keys
 * (unknown ones get a did-you-mean), types and ranges. Local. */
fsdpc_status_t parallel_plan_load(parallel_plan_t *pp, const char *path, const char *const *sets,
                                  int n_sets);

/* Resolves a -1 mesh size against the world size and checks what needs it: the mesh product,
 * integer reshards dividing dp_shard, tensor-parallel rules present when tp > 1. Local
 * (every rank reaches the same verdict). */
fsdpc_status_t parallel_plan_resolve(parallel_plan_t *pp, int world_size);

/* Refuses YAML text (len bytes) with collections nested deeper than max_depth, naming
 * origin:line:col, before anything loads it: libyaml's loader takes time growing with the
 * square of the nesting depth. Local. */
fsdpc_status_t plan_yaml_check_depth(const char *origin, const char *text, size_t len,
                                     int max_depth);

/* Appends a tensor-parallel rule given in code. */
fsdpc_status_t parallel_plan_add_tp_rule(parallel_plan_t *pp, const char *pattern, tp_style_t style,
                                         tp_layout_t input, tp_layout_t output);

/* The units item module fqn takes: the first whose pattern matches it (NULL: none; the
 * section's settings apply). */
const plan_unit_t *parallel_plan_unit(const parallel_plan_t *pp, const char *fqn);

/* Adds a fully_shard unit given in code, with the section's settings. */
fsdpc_status_t parallel_plan_add_unit(parallel_plan_t *pp, const char *pattern);

/* Appends a shard dimension given in code: parameters matching pattern (and no earlier
 * pattern) are sharded on dim. */
fsdpc_status_t parallel_plan_add_shard_dim(parallel_plan_t *pp, const char *pattern, int dim);

/* The shard dimension the plan gives parameter fqn of ndim dimensions (from 0: 0 when no
 * pattern matches); -1 when the matching pattern's dimension is out of range for ndim. */
int parallel_plan_shard_dim(const parallel_plan_t *pp, const char *fqn, int ndim);

/* The plan's tensor-parallel rules as tensor_parallel() takes them (pointing into pp); returns
 * their number. out has room for PLAN_MAX_TP_RULES. */
int parallel_plan_tp_rules(const parallel_plan_t *pp, tp_rule_t *out);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
