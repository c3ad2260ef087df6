/* fsdp-train's plans: the job sections (model, optim, schedule, data, train, checkpoint, log)
 * read from YAML into fsdpc_plan_t with the mesh and parallelize sections (parallel_plan.c), by the
 * reader of plan_reader.c, then resolved against the world size. */
#include "train/plan.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/train_ckpt.h"
#include "core/args_impl.h"
#include "core/file.h"
#include "fully_shard/fsdp.h"
#include "mesh/world.h"
#include "models/llama/llama_plan.h"
#include "parallel/plan_reader_impl.h"
#include "train/plan_impl.h"

void plan_defaults(fsdpc_plan_t *p) {
  if (p == NULL) return;
  memset(p, 0, sizeof *p);
  parallel_plan_defaults(&p->par);
  /* model: the small Llama of configs/llama-small.json */
  p->model = (llama_config_t)LLAMA_CONFIG_INIT;
  p->model.dim = 256;
  p->model.n_layers = 6;
  p->model.n_heads = 8;
  p->model.n_kv_heads = 4;
  p->model.ffn_dim = 688;
  p->model.vocab_size = 256;
  p->model.max_seq_len = 1024;
  p->model.norm_eps = 1e-5;
  p->model.tie_embeddings = false;
  p->model_seed = 0;
  p->deferred_init = true;
  p->optim = (adamw_config_t)ADAMW_CONFIG_INIT;
  p->optim.lr = 3e-4;
  p->optim.weight_decay = 0.1;
  p->optim.beta2 = 0.95;
  p->clip_grad_norm = 1.0;
  p->warmup_steps = 0;
  p->min_lr_ratio = 0.1;
  p->data_format = DATA_BYTES;
  p->seq_len = 128;
  p->batch_size = 8;
  p->grad_accum = 1;
  p->eval_batches = 8;
  p->steps = 100;
  p->comm_timeout_s = WORLD_DEFAULT_TIMEOUT_S;
  p->signals[p->n_signals++] = SIGTERM; /* what Slurm, Kubernetes and torchrun send */
  p->signals[p->n_signals++] = SIGINT;
  p->signals[p->n_signals++] = SIGUSR1;
  p->seed = 0;
  p->ckpt_keep = 0;
  p->ckpt_block_bytes = (int64_t)256 << 10; /* checkpoint/dcp.h's (test_parallel checks) */
  p->log_interval = 10;
  p->moe_aux_loss_coef = -1;
}

/* The architecture from a Hugging Face config.json (path, or path/config.json where path is a
 * folder) that model.key names; no other architecture key of keys may be given beside it. */
static fsdpc_status_t read_hf_config(plan_ctx_t *c, int m, const char *const *keys, const char *key,
                                     const char *path) {
  fsdpc_plan_t *p = c->job;
  char listed[256] = "";
  int first = 0, n = 0;
  for (int i = 0; keys[i] && strcmp(keys[i], "seed") != 0; i++)
    if (!pr_is_null(c, pr_find(c, m, keys[i]))) { /* null: not given (--set KEY=null) */
      size_t l = strlen(listed);
      snprintf(listed + l, sizeof listed - l, "%smodel.%s", n++ ? ", " : "", keys[i]);
      if (first == 0) first = pr_find(c, m, keys[i]);
    }
  struct stat sb;
  bool folder = strcmp(key, "init_from") == 0 || (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode));
  char cfg[PLAN_PATH_MAX + 16];
  snprintf(cfg, sizeof cfg, "%s%s", path, folder ? "/config.json" : "");
  if (n > 0)
    return pr_fail(c, first, "model", "the architecture comes from %s with model.%s; remove %s",
                   cfg, key, listed);
  char name[32];
  snprintf(name, sizeof name, "model.%s", key);
  if (llama_config_from_hf(cfg, &p->model) != STATUS_OK)
    return pr_fail(c, pr_find(c, m, key), name, "%s", err_detail());
  snprintf(p->model_source, sizeof p->model_source, "%s", cfg);
  return STATUS_OK;
}

/* model.architecture: llama (the default), qwen2 or qwen3, with the features that name means. */
static fsdpc_status_t read_architecture(plan_ctx_t *c, int m, llama_config_t *mc) {
  char name[32] = "";
  FSDPC_TRY(pr_get_str(c, m, "model", "architecture", name, sizeof name));
  if (name[0] == 0) return STATUS_OK;
  if (!llama_arch_from_name(name, &mc->arch))
    return pr_fail(c, pr_find(c, m, "architecture"), "model.architecture",
                   "'%s' is not an architecture this build trains (llama, qwen2, qwen3, gpt2, "
                   "qwen3_moe, mixtral, qwen2_moe)",
                   name);
  if (mc->arch == LLAMA_ARCH_QWEN3_MOE || mc->arch == LLAMA_ARCH_MIXTRAL ||
      mc->arch == LLAMA_ARCH_QWEN2_MOE)
    return pr_fail(c, pr_find(c, m, "architecture"), "model.architecture",
                   "%s's experts are not among the model section's keys: give its "
                   "config.json with model.config (or a folder with model.init_from)",
                   name);
  mc->qkv_bias = mc->arch == LLAMA_ARCH_QWEN2;
  mc->o_bias = false;
  mc->qk_norm = mc->arch == LLAMA_ARCH_QWEN3;
  return STATUS_OK;
}

/* The rest of read_model: the seed, how the weights start, and the architecture (from
 * model.init_from, model.config or the section's keys). */
/* model.seed and model.deferred_init: how the weights start, whatever the model. */
static fsdpc_status_t read_model_start(plan_ctx_t *c, int m) {
  fsdpc_plan_t *p = c->job;
  int64_t s = 0;
  FSDPC_TRY(pr_get_int(c, m, "model", "seed", 0, INT64_MAX, &s));
  if (pr_find(c, m, "seed")) p->model_seed = (uint64_t)s;
  return pr_get_bool(c, m, "model", "deferred_init", &p->deferred_init);
}

static fsdpc_status_t read_model_keys(plan_ctx_t *c, int m, const char *const *keys) {
  fsdpc_plan_t *p = c->job;
  FSDPC_TRY(read_model_start(c, m));
  FSDPC_TRY(pr_get_path(c, m, "model", "init_from", p->init_from));
  char *config = p->model_config;
  FSDPC_TRY(pr_get_path(c, m, "model", "config", config));
  if (p->init_from[0] && config[0])
    return pr_fail(c, pr_find(c, m, "config"), "model",
                   "model.config and model.init_from both name the architecture: give one "
                   "(init_from: its config.json and weights; config: the architecture alone, "
                   "initialised from model.seed)");
  if (p->init_from[0]) return read_hf_config(c, m, keys, "init_from", p->init_from);
  if (config[0]) return read_hf_config(c, m, keys, "config", config);
  llama_config_t *mc = &p->model;
  FSDPC_TRY(read_architecture(c, m, mc));
  const int64_t big = (int64_t)1 << 31;
  FSDPC_TRY(pr_get_int(c, m, "model", "dim", 1, big, &mc->dim));
  FSDPC_TRY(pr_get_int(c, m, "model", "n_layers", 1, 4096, &mc->n_layers));
  FSDPC_TRY(pr_get_int(c, m, "model", "n_heads", 1, 65536, &mc->n_heads));
  FSDPC_TRY(pr_get_int(c, m, "model", "n_kv_heads", 1, 65536, &mc->n_kv_heads));
  FSDPC_TRY(pr_get_int(c, m, "model", "ffn_dim", 1, big, &mc->ffn_dim));
  FSDPC_TRY(pr_get_int(c, m, "model", "vocab_size", 1, big, &mc->vocab_size));
  FSDPC_TRY(pr_get_int(c, m, "model", "max_seq_len", 1, big, &mc->max_seq_len));
  FSDPC_TRY(pr_get_float(c, m, "model", "rope_theta", 0, 1e12, true, &mc->rope.theta));
  FSDPC_TRY(pr_get_float(c, m, "model", "norm_eps", 0, 1, true, &mc->norm_eps));
  FSDPC_TRY(pr_get_bool(c, m, "model", "tie_embeddings", &mc->tie_embeddings));
  FSDPC_TRY(pr_get_int(c, m, "model", "head_dim", 0, 65536, &mc->head_dim));
  char rp[256];
  if (mc->arch == LLAMA_ARCH_GPT2 && pr_lookup(c, m, "model", "rope_theta", rp) != 0)
    return pr_fail(c, pr_find(c, m, "rope_theta"), "model.rope_theta",
                   "gpt2 has no rotary embedding (its positions are learned): remove the key");
  if (mc->arch == LLAMA_ARCH_GPT2 && pr_find(c, m, "n_kv_heads") == 0)
    mc->n_kv_heads = mc->n_heads; /* GPT-2 has a key and a value head for every head */
  bool bias = false;
  FSDPC_TRY(pr_get_bool(c, m, "model", "attention_bias", &bias));
  if (bias && mc->arch == LLAMA_ARCH_QWEN2)
    return pr_fail(c, pr_find(c, m, "attention_bias"), "model.attention_bias",
                   "qwen2's q, k and v projections always have biases, its o_proj none");
  if (bias) mc->qkv_bias = mc->o_bias = true;
  if (llama_config_check(mc) != STATUS_OK) return pr_fail(c, m, "model", "%s", err_detail());
  return STATUS_OK;
}

/* The model section of a program's own model (own: its name): seed and deferred_init only. */
static fsdpc_status_t read_own_model(plan_ctx_t *c, int m, const char *const *keys,
                                     const char *own) {
  for (int i = 0; keys[i]; i++)
    if (strcmp(keys[i], "seed") != 0 && strcmp(keys[i], "deferred_init") != 0 &&
        pr_find(c, m, keys[i])) {
      char key[64];
      snprintf(key, sizeof key, "model.%s", keys[i]);
      return pr_fail(c, pr_find(c, m, keys[i]), key,
                     "this program trains its own model (%s); the plan's model section takes "
                     "only seed and deferred_init",
                     own);
    }
  return read_model_start(c, m);
}

static fsdpc_status_t read_model(plan_ctx_t *c, int root, const char *own) {
  static const char *const keys[] = {"architecture",
                                     "dim",
                                     "n_layers",
                                     "n_heads",
                                     "n_kv_heads",
                                     "head_dim",
                                     "ffn_dim",
                                     "vocab_size",
                                     "max_seq_len",
                                     "rope_theta",
                                     "norm_eps",
                                     "tie_embeddings",
                                     "attention_bias",
                                     "seed",
                                     "init_from",
                                     "deferred_init",
                                     "config",
                                     "pad_vocab_multiple",
                                     NULL};
  int m;
  FSDPC_TRY(pr_section(c, root, "model", keys, &m));
  if (m == 0) return STATUS_OK;
  if (own != NULL) return read_own_model(c, m, keys, own);
  fsdpc_plan_t *p = c->job;
  for (int i = 0; keys[i]; i++)
    if (strcmp(keys[i], "seed") != 0 && strcmp(keys[i], "deferred_init") != 0 &&
        strcmp(keys[i], "pad_vocab_multiple") != 0 && pr_find(c, m, keys[i]))
      p->model_given = true;
  FSDPC_TRY(read_model_keys(c, m, keys));
  /* beside any form of the architecture: the tables' padding is the run's choice */
  int64_t pad = p->model.pad_vocab_multiple;
  FSDPC_TRY(pr_get_int(c, m, "model", "pad_vocab_multiple", 0, 65536, &pad));
  p->model.pad_vocab_multiple = pad;
  return STATUS_OK;
}

/* The moe section: aux_loss_coef, the weight of the routers' load-balancing loss (over the
 * model config's router_aux_loss_coef and output_router_logits; 0 turns it off), and
 * aux_loss_scope, the tokens it is computed over. A built-in model must have experts. */
static fsdpc_status_t read_moe(plan_ctx_t *c, int root, const char *own) {
  static const char *const keys[] = {"aux_loss_coef", "aux_loss_scope", NULL};
  fsdpc_plan_t *p = c->job;
  int m;
  FSDPC_TRY(pr_section(c, root, "moe", keys, &m));
  char scope[32] = "";
  if (m != 0) FSDPC_TRY(pr_get_str(c, m, "moe", "aux_loss_scope", scope, sizeof scope));
  if (scope[0] && strcmp(scope, "micro_batch") != 0 && strcmp(scope, "global") != 0)
    return pr_fail(c, pr_find(c, m, "aux_loss_scope"), "moe.aux_loss_scope",
                   "'%s' is not a scope (micro_batch: each rank's micro-batch; global: every "
                   "data-parallel rank's together)",
                   scope);
  p->moe_aux_global = strcmp(scope, "global") == 0;
  if (p->moe_aux_global && own == NULL && p->model.n_experts == 0)
    return pr_fail(c, pr_find(c, m, "aux_loss_scope"), "moe.aux_loss_scope",
                   "the model (%s) has no experts to balance", llama_arch_name(p->model.arch));
  if (m != 0 && pr_find(c, m, "aux_loss_coef") != 0) {
    FSDPC_TRY(pr_get_float(c, m, "moe", "aux_loss_coef", 0, 1e6, false, &p->moe_aux_loss_coef));
    /* null: not given; the program's own model takes it, if it has experts */
    if (own == NULL && p->moe_aux_loss_coef >= 0 && p->model.n_experts == 0)
      return pr_fail(c, pr_find(c, m, "aux_loss_coef"), "moe.aux_loss_coef",
                     "the model (%s) has no experts to balance", llama_arch_name(p->model.arch));
    if (own == NULL && p->moe_aux_loss_coef >= 0) p->model.aux_loss_coef = p->moe_aux_loss_coef;
  }
  /* the scope of a loss that is off would change nothing (its figure in the metrics would
   * stay each rank's) */
  if (p->moe_aux_global && own == NULL && p->model.aux_loss_coef == 0)
    return pr_fail(c, pr_find(c, m, "aux_loss_scope"), "moe.aux_loss_scope",
                   "global, but the load-balancing loss is off (a coefficient of 0: "
                   "moe.aux_loss_coef, or the config's router_aux_loss_coef without "
                   "output_router_logits); give it a coefficient, or leave the scope");
  return STATUS_OK;
}

/* The pipeline section: schedule, microbatches, stages_per_rank (mesh.pp's stages). */
static fsdpc_status_t read_pipeline(plan_ctx_t *c, int root) {
  static const char *const keys[] = {"schedule",     "microbatches",          "stages_per_rank",
                                     "split_points", "sync_every_microbatch", NULL};
  fsdpc_plan_t *p = c->job;
  int m;
  FSDPC_TRY(pr_section(c, root, "pipeline", keys, &m));
  if (m == 0) return STATUS_OK;
  pr_where_section(c, m, keys, &p->par.pp_where);
  p->pipeline_given = true;
  char name[32] = "";
  FSDPC_TRY(pr_get_str(c, m, "pipeline", "schedule", name, sizeof name));
  if (name[0] && !pp_schedule_parse(name, &p->par.pp_schedule))
    return pr_fail(c, pr_find(c, m, "schedule"), "pipeline.schedule",
                   "'%s' is not a schedule (gpipe, 1f1b, interleaved_1f1b)", name);
  int64_t v = 0;
  FSDPC_TRY(pr_get_int(c, m, "pipeline", "microbatches", 1, 1 << 20, &v));
  p->par.pp_microbatches = (int)v;
  if (pr_find(c, m, "microbatches"))
    pr_where_of(c, pr_find(c, m, "microbatches"), &p->par.pp_micro_where);
  v = p->par.pp_stages_per_rank;
  FSDPC_TRY(pr_get_int(c, m, "pipeline", "stages_per_rank", 1, 1 << 16, &v));
  p->par.pp_stages_per_rank = (int)v;
  if (p->par.pp_schedule == PP_INTERLEAVED_1F1B && pr_find(c, m, "stages_per_rank") == 0)
    p->par.pp_stages_per_rank = 2; /* interleaved: two stages a rank unless said */
  FSDPC_TRY(pr_get_bool(c, m, "pipeline", "sync_every_microbatch", &p->par.pp_sync_every));
  int sp = pr_find(c, m, "split_points");
  if (pr_is_null(c, sp)) return STATUS_OK;
  pr_where_of(c, sp, &p->par.pp_splits_where);
  yaml_node_t *n = pr_node(c, sp);
  if (n->type != YAML_SEQUENCE_NODE)
    return pr_fail(c, sp, "pipeline.split_points",
                   "expected a list of module names (each stage's first block after the first)");
  p->par.n_pp_splits = 0;
  for (yaml_node_item_t *it = n->data.sequence.items.start; it < n->data.sequence.items.top; it++) {
    char path[64];
    snprintf(path, sizeof path, "pipeline.split_points[%d]", p->par.n_pp_splits);
    if (p->par.n_pp_splits == PLAN_MAX_PP_SPLITS)
      return pr_fail(c, *it, path, "more than %d split points", PLAN_MAX_PP_SPLITS);
    const char *v;
    FSDPC_TRY(pr_want_scalar(c, *it, path, "a module name", &v));
    if (strlen(v) >= PLAN_PATTERN_MAX) return pr_fail(c, *it, path, "name too long");
    strcpy(p->par.pp_splits[p->par.n_pp_splits++], v);
  }
  return STATUS_OK;
}

/* pipeline.split_points into each stage's first block (starts[0..S)), checked against the model:
 * S - 1 names of blocks, rising. */
static fsdpc_status_t split_starts(const fsdpc_plan_t *p, const char *w, int S, int64_t *starts) {
  const parallel_plan_t *pp = &p->par;
  int64_t L = p->model.n_layers;
  const char *body = p->model.arch == LLAMA_ARCH_GPT2 ? "transformer.h" : "model.layers";
  if (pp->n_pp_splits != S - 1)
    return err_set(STATUS_EINVAL,
                   "%s: pipeline.split_points: %d name%s for %d stages (one for each stage after "
                   "the first: the module it begins with)",
                   w, pp->n_pp_splits, pp->n_pp_splits == 1 ? "" : "s", S);
  starts[0] = 0;
  for (int i = 0; i < pp->n_pp_splits; i++) {
    const char *name = pp->pp_splits[i];
    size_t n = strlen(body);
    char *end = NULL;
    long long b = -1;
    if (strncmp(name, body, n) == 0 && name[n] == '.') b = strtoll(name + n + 1, &end, 10);
    if (b < 0 || end == NULL || *end != 0 || end == name + n + 1 || b >= L)
      return err_set(STATUS_EINVAL,
                     "%s: pipeline.split_points[%d]: '%s' is not a block of the model (stages "
                     "begin at blocks %s.1 to %s.%lld)",
                     w, i, name, body, body, (long long)(L - 1));
    if (b <= starts[i])
      return err_set(STATUS_EINVAL,
                     "%s: pipeline.split_points[%d]: '%s' does not come after the stage before "
                     "(split points rise: each stage holds at least one block)",
                     w, i, name);
    starts[i + 1] = b;
  }
  return STATUS_OK;
}

fsdpc_status_t plan_pipeline_starts(const fsdpc_plan_t *p, int64_t *starts) {
  ARG_NONNULL(p);
  ARG_NONNULL(starts);
  int S = p->par.pp * p->par.pp_stages_per_rank;
  return split_starts(p, p->par.pp_splits_where.text, S, starts);
}

/* mp_policy {param_dtype, reduce_dtype, output_dtype} under map into dt[0..2] (given keys). */
static fsdpc_status_t read_optim(plan_ctx_t *c, int root) {
  static const char *const keys[] = {"lr",           "beta1",        "beta2",
                                     "eps",          "weight_decay", "clip_grad_norm",
                                     "param_groups", "state_dtype",  NULL};
  static const char *const gkeys[] = {"lr", "weight_decay", NULL};
  fsdpc_plan_t *p = c->job;
  int m;
  FSDPC_TRY(pr_section(c, root, "optim", keys, &m));
  if (m == 0) return STATUS_OK;
  adamw_config_t *o = &p->optim;
  FSDPC_TRY(pr_get_float(c, m, "optim", "lr", 0, 1e3, true, &o->lr));
  FSDPC_TRY(pr_get_float(c, m, "optim", "beta1", 0, 0.999999, false, &o->beta1));
  FSDPC_TRY(pr_get_float(c, m, "optim", "beta2", 0, 0.999999, false, &o->beta2));
  FSDPC_TRY(pr_get_float(c, m, "optim", "eps", 0, 1, true, &o->eps));
  FSDPC_TRY(pr_get_float(c, m, "optim", "weight_decay", 0, 1e3, false, &o->weight_decay));
  FSDPC_TRY(pr_get_float(c, m, "optim", "clip_grad_norm", 0, 1e12, false, &p->clip_grad_norm));
  FSDPC_TRY(pr_get_dtype(c, m, "optim", "state_dtype", &o->state_dtype));
  if (o->state_dtype == DTYPE_F16)
    return pr_fail(c, pr_find(c, m, "state_dtype"), "optim.state_dtype",
                   "expected f32 or bf16 (f16's range is too narrow for the second moment)");
  int g = pr_find(c, m, "param_groups");
  if (pr_is_null(c, g)) return STATUS_OK;
  yaml_node_t *n = pr_node(c, g);
  if (n->type != YAML_MAPPING_NODE)
    return pr_fail(c, g, "optim.param_groups",
                   "expected a mapping of FQN pattern: {lr, weight_decay}");
  o->n_groups = 0;
  for (yaml_node_pair_t *a = n->data.mapping.pairs.start; a < n->data.mapping.pairs.top; a++) {
    const char *k = pr_scalar(c, a->key);
    if (k == NULL || strlen(k) >= PLAN_PATTERN_MAX)
      return pr_fail(c, a->key, "optim.param_groups", "expected an FQN pattern as the key");
    if (o->n_groups == ADAMW_MAX_GROUPS)
      return pr_fail(c, a->key, "optim.param_groups", "more than %d groups", ADAMW_MAX_GROUPS);
    for (int q = 0; q < o->n_groups; q++)
      if (strcmp(p->group_patterns[q], k) == 0)
        return pr_fail(c, a->key, "optim.param_groups", "'%s' appears twice", k);
    char path[300];
    snprintf(path, sizeof path, "optim.param_groups.%s", k);
    FSDPC_TRY(pr_check_keys(c, a->value, path, gkeys));
    adamw_group_t *gr = &o->groups[o->n_groups];
    gr->lr = gr->weight_decay = -1;
    FSDPC_TRY(pr_get_float(c, a->value, path, "lr", 0, 1e3, false, &gr->lr));
    FSDPC_TRY(pr_get_float(c, a->value, path, "weight_decay", 0, 1e3, false, &gr->weight_decay));
    strcpy(p->group_patterns[o->n_groups], k);
    gr->pattern = p->group_patterns[o->n_groups];
    o->n_groups++;
  }
  return STATUS_OK;
}

/* SECTION.format into *out (and *given), when the section has it. */
static fsdpc_status_t read_format(plan_ctx_t *c, int m, const char *section, data_format_t *out,
                                  bool *given) {
  static const char *const names[] = {
      [DATA_BYTES] = "text", [DATA_U16] = "u16", [DATA_U32] = "u32", [DATA_LLMC] = "llmc"};
  int f = pr_find(c, m, "format");
  if (pr_is_null(c, f)) return STATUS_OK;
  char key[64];
  snprintf(key, sizeof key, "%s.format", section);
  const char *s;
  FSDPC_TRY(pr_want_scalar(c, f, key, "text, u16, u32 or llmc", &s));
  for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
    if (strcmp(s, names[i]) == 0) {
      *out = (data_format_t)i;
      if (given) *given = true;
      return STATUS_OK;
    }
  return pr_fail(c, f, key, "expected text, u16, u32 or llmc, got '%s'", s);
}

/* One signal's name (TERM, SIGTERM, term...) into *sig; false when not one fsdp-train takes. */
static bool signal_named(const char *s, int *sig) {
  static const struct {
    const char *name;
    int sig;
  } known[] = {{"TERM", SIGTERM}, {"INT", SIGINT}, {"USR1", SIGUSR1},
               {"USR2", SIGUSR2}, {"HUP", SIGHUP}, {"XCPU", SIGXCPU}};
  if (strncasecmp(s, "SIG", 3) == 0) s += 3;
  for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
    if (strcasecmp(s, known[i].name) == 0) {
      *sig = known[i].sig;
      return true;
    }
  return false;
}

/* train.signals: a list of names, a comma-separated string of them (as --set gives it), or
 * [] / none for no handling. */
static fsdpc_status_t read_signals(plan_ctx_t *c, int v, fsdpc_plan_t *p) {
  if (pr_is_null(c, v)) return STATUS_OK;
  const char *path = "train.signals";
  char names[PLAN_MAX_SIGNALS + 1][16];
  int n = 0;
  yaml_node_t *node = pr_node(c, v);
  if (node->type == YAML_SEQUENCE_NODE) {
    for (yaml_node_item_t *it = node->data.sequence.items.start; it < node->data.sequence.items.top;
         it++) {
      const char *s;
      FSDPC_TRY(pr_want_scalar(c, *it, path, "a signal name", &s));
      if (n == PLAN_MAX_SIGNALS)
        return pr_fail(c, v, path, "more than %d signals", PLAN_MAX_SIGNALS);
      snprintf(names[n++], sizeof names[0], "%s", s);
    }
  } else {
    const char *s;
    FSDPC_TRY(pr_want_scalar(c, v, path, "a list of signal names", &s));
    if (strcasecmp(s, "none") != 0 && strcmp(s, "[]") != 0)
      for (const char *at = s; *at;) {
        size_t len = strcspn(at, ", ");
        if (len > 0 && n == PLAN_MAX_SIGNALS)
          return pr_fail(c, v, path, "more than %d signals", PLAN_MAX_SIGNALS);
        if (len > 0) snprintf(names[n++], sizeof names[0], "%.*s", (int)len, at);
        at += len + (at[len] != 0);
      }
  }
  p->n_signals = 0;
  for (int i = 0; i < n; i++) {
    int sig;
    if (!signal_named(names[i], &sig))
      return pr_fail(c, v, path, "'%s' is not one of TERM, INT, USR1, USR2, HUP, XCPU", names[i]);
    for (int k = 0; k < p->n_signals; k++)
      if (p->signals[k] == sig) return pr_fail(c, v, path, "'%s' is listed twice", names[i]);
    p->signals[p->n_signals++] = sig;
  }
  return STATUS_OK;
}

/* train.time_limit: seconds, or [D-]HH:MM:SS / MM:SS as Slurm writes times; 0: none. */
static fsdpc_status_t read_time_limit(plan_ctx_t *c, int v, double *out) {
  if (pr_is_null(c, v)) return STATUS_OK;
  const char *s, *path = "train.time_limit";
  FSDPC_TRY(pr_want_scalar(c, v, path, "seconds or HH:MM:SS", &s));
  double days = 0, part[3];
  int n = 0;
  const char *at = s;
  char *end;
  const char *dash = strchr(s, '-');
  if (dash != NULL && strchr(s, ':') != NULL) {
    errno = 0;
    long d = strtol(s, &end, 10);
    if (end != dash || d < 0 || errno)
      return pr_fail(c, v, path, "expected seconds or [D-]HH:MM:SS, got '%s'", s);
    days = (double)d;
    at = dash + 1;
  }
  for (;;) {
    errno = 0;
    part[n] = strtod(at, &end);
    if (end == at || errno || !isfinite(part[n]) || part[n] < 0 || *at == '-' || *at == '+')
      return pr_fail(c, v, path, "expected seconds or [D-]HH:MM:SS, got '%s'", s);
    n++;
    if (*end == 0) break;
    if (*end != ':' || n == 3)
      return pr_fail(c, v, path, "expected seconds or [D-]HH:MM:SS, got '%s'", s);
    at = end + 1;
  }
  if (days > 0 && n != 3) return pr_fail(c, v, path, "expected D-HH:MM:SS, got '%s'", s);
  for (int i = 1; i < n; i++) /* minutes and seconds below 60, whole hours and minutes */
    if (part[i] >= 60 || part[i - 1] != floor(part[i - 1]))
      return pr_fail(c, v, path, "'%s' is not a time of [D-]HH:MM:SS", s);
  double secs = n == 1   ? part[0]
                : n == 2 ? part[0] * 60 + part[1] /* MM:SS */
                         : days * 86400 + part[0] * 3600 + part[1] * 60 + part[2];
  if (secs > 1e9) return pr_fail(c, v, path, "'%s' is more than 10^9 seconds", s);
  *out = secs;
  return STATUS_OK;
}

static fsdpc_status_t read_rest(plan_ctx_t *c, int root) {
  static const char *const sched_keys[] = {"warmup_steps", "min_lr_ratio", NULL};
  static const char *const data_keys[] = {"path",       "format",     "seq_len",
                                          "batch_size", "grad_accum", "global_batch_size",
                                          "shuffle",    NULL};
  static const char *const train_keys[] = {"steps",
                                           "seed",
                                           "activation_checkpointing",
                                           "device",
                                           "nonfinite",
                                           "comm_timeout_s",
                                           "deterministic",
                                           "signals",
                                           "time_limit",
                                           NULL};
  static const char *const ckpt_keys[] = {"dir",         "interval",  "keep",  "load", "verify",
                                          "block_bytes", "overwrite", "async", NULL};
  static const char *const log_keys[] = {"metrics", "interval", NULL};
  static const char *const eval_keys[] = {"path",    "format",     "interval",
                                          "batches", "batch_size", NULL};
  fsdpc_plan_t *p = c->job;
  const int64_t big = (int64_t)1 << 40;
  int m;
  FSDPC_TRY(pr_section(c, root, "schedule", sched_keys, &m));
  FSDPC_TRY(pr_get_int(c, m, "schedule", "warmup_steps", 0, big, &p->warmup_steps));
  FSDPC_TRY(pr_get_float(c, m, "schedule", "min_lr_ratio", 0, 1, false, &p->min_lr_ratio));
  FSDPC_TRY(pr_section(c, root, "data", data_keys, &m));
  static const char *const data_later[] = {"path", "seq_len", "global_batch_size", "batch_size",
                                           NULL};
  if (m) pr_where_section(c, m, data_later, &p->data_where);
  static const char *const batch_keys[] = {"global_batch_size", "batch_size", "grad_accum", NULL};
  if (m) pr_where_section(c, m, batch_keys, &p->batch_where);
  FSDPC_TRY(pr_get_path(c, m, "data", "path", p->data_path));
  FSDPC_TRY(read_format(c, m, "data", &p->data_format, NULL));
  FSDPC_TRY(pr_get_int(c, m, "data", "seq_len", 1, (int64_t)1 << 24, &p->seq_len));
  FSDPC_TRY(pr_get_int(c, m, "data", "batch_size", 1, (int64_t)1 << 24, &p->batch_size));
  FSDPC_TRY(pr_get_int(c, m, "data", "grad_accum", 1, (int64_t)1 << 20, &p->grad_accum));
  p->grad_accum_given = m && !pr_is_null(c, pr_find(c, m, "grad_accum"));
  FSDPC_TRY(
      pr_get_int(c, m, "data", "global_batch_size", 1, (int64_t)1 << 40, &p->global_batch_size));
  FSDPC_TRY(pr_get_bool(c, m, "data", "shuffle", &p->shuffle));
  FSDPC_TRY(pr_section(c, root, "eval", eval_keys, &m));
  if (m) pr_where_of(c, m, &p->eval_where);
  FSDPC_TRY(pr_get_path(c, m, "eval", "path", p->eval_path));
  p->eval_path_where = p->eval_where;
  int ep = m ? pr_find(c, m, "path") : 0;
  if (ep != 0 && !pr_is_null(c, ep)) pr_where_of(c, ep, &p->eval_path_where);
  bool eval_format = false;
  FSDPC_TRY(read_format(c, m, "eval", &p->eval_format, &eval_format));
  if (!eval_format) p->eval_format = p->data_format;
  FSDPC_TRY(pr_get_int(c, m, "eval", "interval", 0, big, &p->eval_interval));
  FSDPC_TRY(pr_get_int(c, m, "eval", "batches", 1, (int64_t)1 << 20, &p->eval_batches));
  p->eval_batch_size = p->batch_size;
  FSDPC_TRY(pr_get_int(c, m, "eval", "batch_size", 1, (int64_t)1 << 24, &p->eval_batch_size));
  FSDPC_TRY(pr_section(c, root, "train", train_keys, &m));
  FSDPC_TRY(pr_get_int(c, m, "train", "steps", 1, big, &p->steps));
  int64_t seed = -1;
  FSDPC_TRY(pr_get_int(c, m, "train", "seed", 0, INT64_MAX, &seed));
  if (seed >= 0) p->seed = (uint64_t)seed;
  FSDPC_TRY(pr_get_bool(c, m, "train", "activation_checkpointing", &p->activation_checkpointing));
  FSDPC_TRY(pr_get_float(c, m, "train", "comm_timeout_s", 0, 1e9, false, &p->comm_timeout_s));
  FSDPC_TRY(pr_get_bool(c, m, "train", "deterministic", &p->deterministic));
  int dv = pr_find(c, m, "device");
  if (!pr_is_null(c, dv)) {
    const char *s;
    FSDPC_TRY(pr_want_scalar(c, dv, "train.device", "auto, cpu or cuda", &s));
    if (!device_want_parse(s, &p->device))
      return pr_fail(c, dv, "train.device", "expected auto, cpu or cuda, got '%s'", s);
  }
  int nf = pr_find(c, m, "nonfinite");
  if (!pr_is_null(c, nf)) {
    const char *s;
    FSDPC_TRY(pr_want_scalar(c, nf, "train.nonfinite", "stop or skip", &s));
    if (strcmp(s, "stop") == 0 || strcmp(s, "skip") == 0)
      p->skip_nonfinite = s[1] == 'k';
    else
      return pr_fail(c, nf, "train.nonfinite", "expected stop or skip, got '%s'", s);
  }
  FSDPC_TRY(read_signals(c, pr_find(c, m, "signals"), p));
  FSDPC_TRY(read_time_limit(c, pr_find(c, m, "time_limit"), &p->time_limit_s));
  FSDPC_TRY(pr_section(c, root, "checkpoint", ckpt_keys, &m));
  if (m) pr_where_of(c, m, &p->ckpt_where);
  FSDPC_TRY(pr_get_path(c, m, "checkpoint", "dir", p->ckpt_dir));
  FSDPC_TRY(pr_get_int(c, m, "checkpoint", "interval", 0, big, &p->ckpt_interval));
  FSDPC_TRY(pr_get_int(c, m, "checkpoint", "keep", 0, 1 << 20, &p->ckpt_keep));
  int ld = pr_find(c, m, "load");
  p->load_where = p->ckpt_where;
  if (ld != 0 && !pr_is_null(c, ld)) pr_where_of(c, ld, &p->load_where);
  if (!pr_is_null(c, ld) && pr_scalar(c, ld) && strcmp(pr_scalar(c, ld), "auto") == 0)
    strcpy(p->ckpt_load, "auto");
  else
    FSDPC_TRY(pr_get_path(c, m, "checkpoint", "load", p->ckpt_load));
  FSDPC_TRY(pr_get_bool(c, m, "checkpoint", "verify", &p->ckpt_verify));
  FSDPC_TRY(pr_get_bool(c, m, "checkpoint", "overwrite", &p->ckpt_overwrite));
  FSDPC_TRY(pr_get_bool(c, m, "checkpoint", "async", &p->ckpt_async));
  FSDPC_TRY(
      pr_get_int(c, m, "checkpoint", "block_bytes", 64, (int64_t)1 << 30, &p->ckpt_block_bytes));
  if (p->ckpt_block_bytes % 64 != 0)
    return pr_fail(c, pr_find(c, m, "block_bytes"), "checkpoint.block_bytes",
                   "expected a multiple of 64, got %lld", (long long)p->ckpt_block_bytes);
  FSDPC_TRY(pr_section(c, root, "log", log_keys, &m));
  FSDPC_TRY(pr_get_path(c, m, "log", "metrics", p->metrics));
  FSDPC_TRY(pr_get_int(c, m, "log", "interval", 1, big, &p->log_interval));
  return STATUS_OK;
}

/* The settings text's lines: one per scalar ("key.path: value"; list items as key[k]). */
typedef struct lines {
  char **v;
  int n, cap;
} lines_t;

static fsdpc_status_t add_line(lines_t *l, const char *key, const char *value) {
  ARRAY_GROW(l->v, l->n, l->cap, 64, "plan");
  size_t n = strlen(key) + strlen(value) + 3;
  if ((l->v[l->n] = malloc(n)) == NULL) return err_set(STATUS_ENOMEM, "plan: out of host memory");
  snprintf(l->v[l->n++], n, "%s: %s", key, value);
  return STATUS_OK;
}

static fsdpc_status_t settings_of(plan_ctx_t *c, int i, const char *prefix, lines_t *l, int depth) {
  yaml_node_t *n = pr_node(c, i);
  char key[1024];
  if (n == NULL || depth > PLAN_MAX_DEPTH) return STATUS_OK;
  if (n->type == YAML_SCALAR_NODE) return add_line(l, prefix, (const char *)n->data.scalar.value);
  if (n->type == YAML_SEQUENCE_NODE) {
    int k = 0;
    for (yaml_node_item_t *it = n->data.sequence.items.start; it < n->data.sequence.items.top;
         it++, k++) {
      snprintf(key, sizeof key, "%.900s[%d]", prefix, k);
      FSDPC_TRY(settings_of(c, *it, key, l, depth + 1));
    }
    return STATUS_OK;
  }
  for (yaml_node_pair_t *pr = n->data.mapping.pairs.start; pr < n->data.mapping.pairs.top; pr++) {
    const char *k = pr_scalar(c, pr->key);
    pr_join(key, sizeof key, prefix, k ? k : "?");
    FSDPC_TRY(settings_of(c, pr->value, key, l, depth + 1));
  }
  return STATUS_OK;
}

static int cmp_lines(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The sorted settings of the document (with --set applied) as one text (caller frees). */
static fsdpc_status_t settings_text(plan_ctx_t *c, int root, char **out) {
  lines_t l = {0};
  fsdpc_status_t st = settings_of(c, root, "", &l, 0);
  size_t total = 1;
  for (int i = 0; i < l.n; i++) total += strlen(l.v[i]) + 1;
  if (st == STATUS_OK) qsort(l.v, (size_t)l.n, sizeof *l.v, cmp_lines);
  char *text = st == STATUS_OK ? malloc(total) : NULL;
  if (st == STATUS_OK && text == NULL) st = err_set(STATUS_ENOMEM, "plan: out of host memory");
  if (text != NULL) {
    size_t at = 0;
    for (int i = 0; i < l.n; i++) at += (size_t)sprintf(text + at, "%s\n", l.v[i]);
    text[at] = 0;
  }
  for (int i = 0; i < l.n; i++) free(l.v[i]);
  free(l.v);
  *out = text;
  return st;
}

/* Reads the file into p; with settings, also the settings text. */
static fsdpc_status_t load(fsdpc_plan_t *p, const char *path, const char *const *sets, int n_sets,
                           const char *own, char **settings) {
  plan_defaults(p);
  if (strlen(path) >= PLAN_PATH_MAX) return err_set(STATUS_EINVAL, "plan path too long");
  strcpy(p->source, path);
  strcpy(p->par.source, path);
  plan_where_t *ws[] = {&p->par.mesh_where,  &p->par.fsdp_where,  &p->par.tp_where,
                        &p->par.optim_where, &p->data_where,      &p->eval_where,
                        &p->ckpt_where,      &p->par.ep_where,    &p->par.tp_size_where,
                        &p->batch_where,     &p->eval_path_where, &p->load_where};
  for (int i = 0; i < (int)(sizeof ws / sizeof ws[0]); i++)
    snprintf(ws[i]->text, sizeof ws[i]->text, "%s", path);
  plan_ctx_t *c = calloc(1, sizeof *c);
  if (c == NULL) return err_set(STATUS_ENOMEM, "plan: out of host memory");
  c->par = &p->par;
  c->job = p;
  static const char *const top[] = {"mesh",       "model",    "moe",  "parallelize", "pipeline",
                                    "optim",      "schedule", "data", "eval",        "train",
                                    "checkpoint", "log",      NULL};
  int root = 0;
  fsdpc_status_t st = pr_open(c, path, sets, n_sets, top,
                              "mesh, model, moe, parallelize, pipeline, optim, schedule, data, "
                              "eval, train, checkpoint, log",
                              "model, ", &root);
  if (st == STATUS_OK) st = pp_read_mesh(c, root);
  if (st == STATUS_OK) st = read_model(c, root, own);
  if (st == STATUS_OK) st = read_moe(c, root, own);
  if (st == STATUS_OK) st = read_pipeline(c, root);
  if (st == STATUS_OK) st = pp_read_parallelize(c, root);
  if (st == STATUS_OK) st = read_optim(c, root);
  if (st == STATUS_OK) st = read_rest(c, root);
  /* a built-in model: without rules of its own, a plan splits it by the built-in ones */
  if (st == STATUS_OK && own == NULL && !p->par.tp_plan_given)
    st = llama_plan_fill_tp_rules(&p->model, &p->par);
  if (st == STATUS_OK && settings) st = settings_text(c, root, settings);
  pr_close(c);
  free(c);
  return st;
}

fsdpc_status_t plan_load(fsdpc_plan_t *p, const char *path, const char *const *sets, int n_sets) {
  ARG_NONNULL(p);
  ARG_NONNULL(path);
  return load(p, path, sets, n_sets, NULL, NULL);
}

fsdpc_status_t plan_load_settings(fsdpc_plan_t *p, const char *path, const char *const *sets,
                                  int n_sets, char **settings) {
  ARG_NONNULL(p);
  ARG_NONNULL(path);
  if (n_sets > 0) ARG_NONNULL(sets);
  ARG_NONNULL(settings);
  *settings = NULL;
  return load(p, path, sets, n_sets, NULL, settings);
}

fsdpc_status_t plan_load_job(fsdpc_plan_t *p, const char *path, const char *const *sets, int n_sets,
                             const char *own, char **settings) {
  *settings = NULL;
  return load(p, path, sets, n_sets, own, settings);
}

/* ---- resolve ---- */

/* A token file that exists and is a regular file, or a pattern (its files are checked when the
 * stream is opened). */
static fsdpc_status_t check_path(const char *path, const plan_where_t *where, const char *key) {
  struct stat sb;
  errno = 0;
  if (!data_is_pattern(path) && (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)))
    return err_set(STATUS_EIO, "%s: %s: cannot read '%s': %s", where->text, key, path,
                   errno ? strerror(errno) : "not a regular file");
  return STATUS_OK;
}

/* What a checkpoint.load folder without train_state.json may be: a run's checkpoint.dir (its
 * newest complete step folder named) or a Hugging Face folder. "" when neither. */
static void load_hint(const char *dir, char *hint, size_t size) {
  hint[0] = 0;
  char newest[PLAN_PATH_MAX + 32];
  bool found = false;
  if (ckpt_latest(dir, newest, sizeof newest, &found, NULL, 0) != STATUS_OK) found = false;
  char config[PLAN_PATH_MAX + 16];
  snprintf(config, sizeof config, "%s/config.json", dir);
  if (found)
    snprintf(hint, size,
             "; it is a run's checkpoint folder, the newest complete checkpoint %s: name that, "
             "or resume the newest with checkpoint.dir: %s and checkpoint.load: auto",
             newest, dir);
  else if (access(config, R_OK) == 0)
    snprintf(hint, size,
             "; it is a Hugging Face folder (config.json): start from its weights with "
             "model.init_from: %s, or convert it with fsdp-ckpt import-hf",
             dir);
}

static fsdpc_status_t resolve_mesh(fsdpc_plan_t *p, int world, const char *own);

fsdpc_status_t plan_resolve(fsdpc_plan_t *p, int world) {
  ARG_NONNULL(p);
  return plan_resolve_job(p, world, NULL);
}

fsdpc_status_t plan_resolve_job(fsdpc_plan_t *p, int world, const char *own) {
  FSDPC_TRY(resolve_mesh(p, world, own));
  if (p->data_path[0] == 0)
    return err_set(STATUS_EINVAL, "%s: data.path: missing (the token file to train on)", p->source);
  FSDPC_TRY(check_path(p->data_path, &p->data_where, "data.path"));
  if (p->eval_path[0]) FSDPC_TRY(check_path(p->eval_path, &p->eval_path_where, "eval.path"));
  if (p->eval_interval > 0 && !p->eval_path[0])
    return err_set(STATUS_EINVAL,
                   "%s: eval.interval: %lld needs eval.path (the token file to evaluate on)",
                   p->eval_where.text, (long long)p->eval_interval);
  if (own == NULL && p->seq_len > p->model.max_seq_len)
    return err_set(STATUS_EINVAL, "%s: data.seq_len: %lld exceeds model.max_seq_len=%lld",
                   p->data_where.text, (long long)p->seq_len, (long long)p->model.max_seq_len);
  if (p->ckpt_interval > 0 && p->ckpt_dir[0] == 0)
    return err_set(STATUS_EINVAL, "%s: checkpoint.interval: %lld needs checkpoint.dir",
                   p->ckpt_where.text, (long long)p->ckpt_interval);
  /* what shapes the saves, given without a folder to save into: a plan that expects saves */
  char value[24];
  snprintf(value, sizeof value, "%lld", (long long)p->ckpt_keep);
  const char *saves = p->ckpt_keep > 0    ? "keep"
                      : p->ckpt_async     ? "async"
                      : p->ckpt_overwrite ? "overwrite"
                                          : NULL;
  if (saves != NULL && p->ckpt_dir[0] == 0)
    return err_set(STATUS_EINVAL,
                   "%s: checkpoint.%s: %s needs checkpoint.dir (nothing is saved without it)",
                   p->ckpt_where.text, saves, p->ckpt_keep > 0 ? value : "true");
  if (p->time_limit_s > 0 && p->ckpt_dir[0] == 0) /* exit 75 says: resume me, from nothing */
    return err_set(STATUS_EINVAL,
                   "%s: train.time_limit: %g s needs checkpoint.dir: a run it stops saves the "
                   "step it reached there and exits 75 for its resume",
                   p->source, p->time_limit_s);
  if (p->ckpt_verify && p->ckpt_dir[0] == 0 && p->ckpt_load[0] == 0)
    return err_set(STATUS_EINVAL,
                   "%s: checkpoint.verify: true checks a checkpoint before loading it, and none "
                   "is loaded: give checkpoint.load (a step folder, or auto with checkpoint.dir)",
                   p->ckpt_where.text);
  if (strcmp(p->ckpt_load, "auto") == 0 && p->ckpt_dir[0] == 0)
    return err_set(STATUS_EINVAL,
                   "%s: checkpoint.load: auto resumes from checkpoint.dir, which is not set",
                   p->load_where.text);
  if (p->ckpt_load[0] && strcmp(p->ckpt_load, "auto") != 0) {
    char state[PLAN_PATH_MAX + 32];
    snprintf(state, sizeof state, "%s/train_state.json", p->ckpt_load);
    struct stat sb;
    if (access(state, R_OK) != 0 && stat(p->ckpt_load, &sb) != 0) {
      const char *b = strrchr(p->ckpt_load, '/');
      b = b ? b + 1 : p->ckpt_load;
      return err_set(STATUS_EIO, "%s: checkpoint.load: '%s' does not exist%s", p->load_where.text,
                     p->ckpt_load,
                     strcasecmp(b, "auto") == 0 ? " (resuming the newest checkpoint of "
                                                  "checkpoint.dir is auto, in lower case)"
                                                : "");
    }
    if (access(state, R_OK) != 0 && !S_ISDIR(sb.st_mode))
      return err_set(STATUS_EIO,
                     "%s: checkpoint.load: '%s' is not a folder (a checkpoint is its step folder, "
                     "checkpoint.dir/step-N)",
                     p->load_where.text, p->ckpt_load);
    if (access(state, R_OK) != 0) {
      char hint[3 * PLAN_PATH_MAX];
      load_hint(p->ckpt_load, hint, sizeof hint);
      return err_set(STATUS_EIO,
                     "%s: checkpoint.load: '%s' is not a complete checkpoint (no "
                     "train_state.json)%s",
                     p->load_where.text, p->ckpt_load, hint);
    }
  }
  return STATUS_OK;
}

/* Sequence parallelism splits data.seq_len evenly over tp. */
static fsdpc_status_t check_sequence_split(const fsdpc_plan_t *p) {
  if (p->par.tp > 1 && p->par.sequence_parallel && p->seq_len % p->par.tp != 0)
    return err_set(STATUS_EINVAL,
                   "%s: data.seq_len: %lld is not divisible by mesh.tp=%d (sequence "
                   "parallelism splits the sequence evenly)",
                   p->data_where.text, (long long)p->seq_len, p->par.tp);
  return STATUS_OK;
}

/* data.global_batch_size = batch_size x data-parallel ranks x grad_accum: checked when all
 * three are given, grad_accum derived when it is not. */
static fsdpc_status_t resolve_global_batch(fsdpc_plan_t *p) {
  if (p->global_batch_size <= 0) return STATUS_OK;
  int64_t dp = (int64_t)p->par.dp_replicate * p->par.dp_shard, per_micro = p->batch_size * dp;
  if (p->grad_accum_given && per_micro * p->grad_accum != p->global_batch_size)
    return err_set(STATUS_EINVAL,
                   "%s: data.global_batch_size: %lld is not data.batch_size %lld x %lld "
                   "data-parallel rank%s x data.grad_accum %lld = %lld (leave grad_accum out to "
                   "derive it)",
                   p->batch_where.text, (long long)p->global_batch_size, (long long)p->batch_size,
                   (long long)dp, dp == 1 ? "" : "s", (long long)p->grad_accum,
                   (long long)(per_micro * p->grad_accum));
  if (!p->grad_accum_given) {
    if (p->global_batch_size % per_micro != 0)
      return err_set(STATUS_EINVAL,
                     "%s: data.global_batch_size: %lld is not a multiple of data.batch_size %lld x "
                     "%lld data-parallel rank%s = %lld samples a micro-batch",
                     p->batch_where.text, (long long)p->global_batch_size, (long long)p->batch_size,
                     (long long)dp, dp == 1 ? "" : "s", (long long)per_micro);
    p->grad_accum = p->global_batch_size / per_micro;
  }
  return STATUS_OK;
}

/* The built-in model's sizes that tensor parallelism splits, each divisible by mesh.tp. */
static fsdpc_status_t check_builtin_split(const fsdpc_plan_t *p) {
  if (p->par.ep > 1 && (p->model.n_experts == 0 || p->model.n_experts % p->par.ep != 0))
    return p->model.n_experts == 0
               ? err_set(STATUS_EINVAL,
                         "%s: mesh.ep: %d needs a model with experts (qwen3_moe, mixtral, "
                         "qwen2_moe)",
                         p->par.ep_where.text, p->par.ep)
               : err_set(STATUS_EINVAL,
                         "%s: mesh.ep: %d does not divide the model's num_experts, %lld (each "
                         "rank of a group holds as many experts)",
                         p->par.ep_where.text, p->par.ep, (long long)p->model.n_experts);
  if (p->par.tp > 1) {
    const struct {
      const char *key;
      int64_t v;
      const char *why;
    } split[] = {
        {"n_heads", p->model.n_heads, "whole attention heads"},
        {"n_kv_heads", p->model.n_kv_heads, "whole key/value heads"},
        /* a model whose every layer is sparse has no MLP to split (Mixtral's ffn_dim is its
         * experts' size) */
        {"ffn_dim", llama_num_moe_layers(&p->model) < p->model.n_layers ? p->model.ffn_dim : 0,
         "an equal slice of the MLP"},
        {llama_vocab_rows(&p->model) == p->model.vocab_size ? "vocab_size" : "vocab_size (padded)",
         llama_vocab_rows(&p->model), "an equal slice of the vocabulary"}};
    for (size_t i = 0; i < sizeof split / sizeof split[0]; i++)
      if (split[i].v % p->par.tp != 0)
        return err_set(STATUS_EINVAL,
                       "%s: mesh.tp: %d does not divide model.%s=%lld (each tensor-parallel "
                       "rank needs %s%s)",
                       p->par.tp_size_where.text, p->par.tp, split[i].key, (long long)split[i].v,
                       split[i].why,
                       strncmp(split[i].key, "vocab_size", 10) == 0
                           ? "; set model.pad_vocab_multiple to a multiple of mesh.tp (128 pads "
                             "GPT-2's 50257 tokens to 50304, as llm.c and Megatron do)"
                           : "");
    if (p->model.arch == LLAMA_ARCH_GPT2 && !p->par.tp_plan_given &&
        p->model.max_seq_len % p->par.tp != 0)
      return err_set(STATUS_EINVAL,
                     "%s: mesh.tp: %d does not divide model.max_seq_len=%lld (the built-in "
                     "GPT-2 plan splits the position table by rows, each tensor-parallel rank "
                     "an equal slice)",
                     p->par.tp_size_where.text, p->par.tp, (long long)p->model.max_seq_len);
  }
  return STATUS_OK;
}

/* The mesh against the world, the global batch, and what tensor parallelism splits: the
 * built-in model's sizes (own NULL) and, under sequence parallelism, data.seq_len. */
/* mesh.pp and the pipeline section: a built-in model split into pp x stages_per_rank stages of
 * whole blocks, the step's micro-batches its microbatches, the schedule's own rules; what does
 * not compose yet refused by name. */
static fsdpc_status_t check_pipeline(fsdpc_plan_t *p, const char *own) {
  const parallel_plan_t *pp = &p->par;
  const char *w = pp->pp_size_where.text;
  if (pp->pp == 1) {
    if (p->pipeline_given)
      return err_set(STATUS_EINVAL, "%s: pipeline: the section needs mesh.pp above 1",
                     pp->pp_where.text[0] ? pp->pp_where.text : w);
    return STATUS_OK;
  }
  int V = pp->pp_stages_per_rank, S = pp->pp * V;
  if (own != NULL)
    return err_set(STATUS_EUNSUPPORTED,
                   "%s: mesh.pp: %d: pipeline stages are cut from the built-in models' blocks; "
                   "this program's model (%s) is not split",
                   w, pp->pp, own);
  if (p->model.n_layers < S || p->model.n_layers % V != 0)
    return err_set(STATUS_EINVAL,
                   "%s: mesh.pp: %d x pipeline.stages_per_rank %d = %d stages %s the model's %lld "
                   "layers",
                   w, pp->pp, V, S,
                   p->model.n_layers < S ? "outnumber" : "do not fit: stages_per_rank must divide",
                   (long long)p->model.n_layers);
  int64_t starts[PLAN_MAX_PP_SPLITS + 1]; /* split_starts refuses more stages than that */
  if (pp->n_pp_splits > 0) FSDPC_TRY(split_starts(p, pp->pp_splits_where.text, S, starts));
  if (p->layout_only) return STATUS_OK; /* the microbatches lay nothing out */
  if (pp->pp_microbatches > 0 && pp->pp_microbatches != p->grad_accum)
    return err_set(STATUS_EINVAL,
                   "%s: pipeline.microbatches: %d, but the data section gives %lld micro-batch%s "
                   "a step (data.grad_accum, or global_batch_size over batch_size x "
                   "data-parallel ranks)",
                   pp->pp_micro_where.text, pp->pp_microbatches, (long long)p->grad_accum,
                   p->grad_accum == 1 ? "" : "es");
  /* the step's micro-batches are the schedule's microbatches, which the data section sets */
  fsdpc_status_t st = pp_schedule_check_microbatches(pp->pp_schedule, pp->pp, (int)p->grad_accum);
  if (st != STATUS_OK) {
    char why[1024];
    snprintf(why, sizeof why, "%s", err_detail());
    return err_set(st,
                   "%s: mesh.pp: %d: %s (a step's microbatches are its micro-batches: "
                   "data.grad_accum, or data.global_batch_size over data.batch_size x "
                   "data-parallel ranks, or pipeline.microbatches)",
                   w, pp->pp, why);
  }
  pp_schedule_t *sched = NULL;
  st = pp_schedule_new(pp->pp_schedule, pp->pp, (int)p->grad_accum, V, &sched);
  pp_schedule_free(sched);
  if (st != STATUS_OK)
    return err_prefix(st, "%s: pipeline (schedule %s)",
                      pp->pp_where.text[0] ? pp->pp_where.text : w,
                      pp_schedule_name(pp->pp_schedule));
  if (pp->offload)
    return err_set(STATUS_EUNSUPPORTED, "%s: mesh.pp: %d does not compose with offload yet", w,
                   pp->pp);
  return STATUS_OK;
}

static fsdpc_status_t resolve_mesh(fsdpc_plan_t *p, int world, const char *own) {
  FSDPC_TRY(parallel_plan_resolve(&p->par, world));
  /* the pipeline's microbatches are the step's micro-batches, unless the data says otherwise */
  if (p->par.pp_microbatches > 0 && p->global_batch_size <= 0 && !p->grad_accum_given)
    p->grad_accum = p->par.pp_microbatches;
  FSDPC_TRY(resolve_global_batch(p));
  FSDPC_TRY(check_pipeline(p, own));
  if (own == NULL) FSDPC_TRY(check_builtin_split(p));
  return check_sequence_split(p);
}

fsdpc_status_t plan_resolve_model(fsdpc_plan_t *p, int world) {
  ARG_NONNULL(p);
  return resolve_mesh(p, world, NULL);
}
