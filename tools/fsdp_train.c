/*
 * fsdp-train: trains the Llama under a YAML parallelism plan.
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
#include <time.h>
#include <unistd.h>

#include "base/file.h"
#include "checkpoint/hf_weights.h"
#include "checkpoint/train_ckpt.h"
#include "mesh/world.h"
#include "nn/train.h"
#include "parallel/llama_cost.h"
#include "parallel/llama_plan.h"
#include "parallel/parallelize.h"
#include "parallel/plan.h"
#include "tools/plot.h"

typedef struct args {
  const char *config;
  const char *sets[256];
  int n_sets;
  const char *metrics;
  const char *plot; /* --plot: the metrics drawn as SVG at the end */
  bool dry_run;
  bool verbose; /* -v with --dry-run: the per-unit table */
} args_t;

static void usage(FILE *f) {
  fprintf(f,
          "usage: fsdp-train CONFIG.yaml [--set key.path=value]... [--metrics PATH] "
          "[--plot OUT.svg] [--dry-run [-v]]\n"
          "       fsdp-train --help | --version\n"
          "  under mpirun -n N for N ranks; the plan's mesh must multiply to N\n");
}

static status_t parse_args(int argc, char **argv, args_t *a) {
  memset(a, 0, sizeof *a);
  for (int i = 1; i < argc; i++) {
    const char *s = argv[i];
    if (strcmp(s, "--set") == 0 || strcmp(s, "--metrics") == 0 || strcmp(s, "--plot") == 0) {
      if (i + 1 >= argc) return err_set(STATUS_EINVAL, "%s needs a value", s);
      if (s[2] == 's') {
        if (a->n_sets == 256) return err_set(STATUS_EINVAL, "more than 256 --set options");
        a->sets[a->n_sets++] = argv[++i];
      } else if (s[2] == 'p') {
        a->plot = argv[++i];
      } else {
        a->metrics = argv[++i];
      }
    } else if (strncmp(s, "--set=", 6) == 0) {
      if (a->n_sets == 256) return err_set(STATUS_EINVAL, "more than 256 --set options");
      a->sets[a->n_sets++] = s + 6;
    } else if (strncmp(s, "--metrics=", 10) == 0) {
      a->metrics = s + 10;
    } else if (strncmp(s, "--plot=", 7) == 0) {
      a->plot = s + 7;
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
  return STATUS_OK;
}

static bool agree(status_t st) { return world_agree_report(st, "fsdp-train"); }

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static const char *reshard_str(int r, char *buf, size_t n) {
  if (r == FSDP_RESHARD_AUTO) return "auto";
  if (r == 0 || r == 1) return r ? "true" : "false";
  snprintf(buf, n, "%d", r);
  return buf;
}

static const char *dt_str(dtype_t d) { return d == DTYPE_COUNT ? "own" : dtype_name(d); }

static void mib(char *buf, size_t n, double bytes) {
  if (bytes >= 1073741824.0)
    snprintf(buf, n, "%.2f GiB", bytes / 1073741824.0);
  else
    snprintf(buf, n, "%.2f MiB", bytes / 1048576.0);
}

typedef struct run {
  plan_t plan;
  args_t args;
  parallel_t *par; /* the plan applied to the model; the rest is borrowed from it */
  mesh_t *mesh;    /* the world: (dp_replicate,) dp_shard(, tp) */
  pg_t *all;       /* every rank (gradient clipping) */
  const tp_plan_t *tp;
  fsdp_group_t *const *groups;
  int n_groups;
  llama_t *model;
  nn_param_t **ps;
  int n;
  optim_t *opt;
  data_t *data;
  device_t dev;
  int dp_size, dp_rank;
  int64_t start_step; /* steps already taken (resumed from a checkpoint) */
  char resumed_from[PLAN_PATH_MAX + 32];
  dcp_stats_t load_stats;
  int64_t verified; /* chunks checked against their checksums before loading (-1: not asked) */
  int64_t saved_batch; /* the global batch the resumed checkpoint was saved with; 0: unknown */
} run_t;

/* The token file, checked against the model and the sample length (a dry run too: it must
 * refuse what the run would). */
static status_t open_data(run_t *r) {
  const plan_t *p = &r->plan;
  TRY(data_open(&r->data, p->data_path, p->data_format));
  if (data_max_token(r->data) >= p->model.vocab_size)
    return err_set(STATUS_EINVAL,
                   "%s: data.path: token id %lld in '%s' is outside "
                   "model.vocab_size=%lld",
                   p->data_where.text, (long long)data_max_token(r->data), p->data_path,
                   (long long)p->model.vocab_size);
  int64_t need = p->seq_len + 1;
  if (data_num_tokens(r->data) < need)
    return err_set(STATUS_EINVAL,
                   "%s: data.path: '%s' has %lld tokens, fewer than one sample "
                   "of data.seq_len + 1 = %lld",
                   p->data_where.text, p->data_path, (long long)data_num_tokens(r->data),
                   (long long)need);
  return STATUS_OK;
}

/* The global batch recorded in dir's train_state.json (saved_under), or 0. */
static int64_t saved_global_batch(const char *dir) {
  char path[PLAN_PATH_MAX + 64], *text = NULL;
  snprintf(path, sizeof path, "%s/train_state.json", dir);
  if (file_read_text(path, FILE_TEXT_MAX, &text) != STATUS_OK) {
    err_clear();
    return 0;
  }
  cJSON *o = cJSON_Parse(text);
  free(text);
  const cJSON *b = cJSON_GetObjectItemCaseSensitive(
      cJSON_GetObjectItemCaseSensitive(o, "saved_under"), "global_batch");
  int64_t n = cJSON_IsNumber(b) && b->valuedouble > 0 ? (int64_t)b->valuedouble : 0;
  cJSON_Delete(o);
  return n;
}

/* Samples per optimizer step over the data-parallel ranks. */
static int64_t global_batch(const run_t *r) {
  return r->plan.batch_size * r->plan.grad_accum * r->dp_size;
}

static status_t build(run_t *r) {
  plan_t *p = &r->plan;
  TRY(llama_plan_check(&p->par));
  TRY(open_data(r)); /* before the model: a bad file fails at once */
  llama_options_t lo = LLAMA_OPTIONS_INIT;
  lo.device = world_device().type;
  lo.activation_checkpointing = p->activation_checkpointing;
  lo.deferred = p->deferred_init || r->args.dry_run; /* a dry run allocates no parameter */
  bool resume = false; /* a checkpoint to load: it overwrites every parameter */
  if (p->ckpt_load[0]) {
    resume = true;
    if (strcmp(p->ckpt_load, "auto") == 0) {
      char skipped[sizeof r->resumed_from + 128];
      TRY(ckpt_latest(p->ckpt_dir, r->resumed_from, sizeof r->resumed_from, &resume, skipped,
                      sizeof skipped));
      if (skipped[0] && world_rank() == 0)
        fprintf(stderr, "fsdp-train: checkpoint.load=auto: skipped the newer %s\n", skipped);
    } else
      snprintf(r->resumed_from, sizeof r->resumed_from, "%s", p->ckpt_load);
  }
  /* deferred: meta parameters, parallelised, then memory for this rank's shards only and
   * values from the init, the Hugging Face folder or the checkpoint; eager: whole
   * parameters initialised on every rank, then split */
  TRY(llama_new(&r->model, &p->model, &lo));
  nn_module_t *root = llama_module(r->model);
  if (!lo.deferred && !p->init_from[0]) TRY(llama_init_weights(r->model, p->model_seed));
  TRY(parallel_apply(&r->par, root, &p->par, lo.device));
  r->mesh = parallel_mesh(r->par);
  r->dev = mesh_device(r->mesh);
  r->all = parallel_all_group(r->par);
  r->tp = parallel_tp(r->par);
  r->groups = parallel_groups(r->par);
  r->n_groups = parallel_num_groups(r->par);
  r->dp_size = parallel_dp_size(r->par);
  r->dp_rank = parallel_dp_rank(r->par);
  if (r->args.dry_run) { /* the meta model has every placement and shape */
    TRY(nn_named_parameters(root, &r->ps, &r->n));
    if (!resume) r->resumed_from[0] = 0;
    return resume ? ckpt_check_state(r->resumed_from) : STATUS_OK;
  }
  TRY(nn_module_materialize(root));
  if (lo.deferred && !p->init_from[0] && !resume)
    TRY(llama_init_weights(r->model, p->model_seed));
  if (p->init_from[0]) /* after sharding: each rank reads only its shards' rows */
    TRY(ckpt_load_hf(root, p->init_from));
  TRY(nn_named_parameters(root, &r->ps, &r->n));
  TRY(optim_new(&r->opt, r->ps, r->n, &p->optim));
  if (resume) {
    r->verified = -1;
    if (p->ckpt_verify)
      TRY(ckpt_verify_training(r->resumed_from, world_comm(), &r->verified));
    TRY(ckpt_load_training(r->resumed_from, r->ps, r->n, r->opt, &r->start_step, &r->load_stats));
    r->saved_batch = saved_global_batch(r->resumed_from);
  } else {
    r->resumed_from[0] = 0;
  }
  return STATUS_OK;
}

/* Per-rank bytes of the sharded parameters (padded storage included). */
static double sharded_param_bytes(const run_t *r) {
  double b = 0;
  for (int i = 0; i < r->n; i++) b += (double)tensor_nbytes(dtensor_local(r->ps[i]->value));
  return b;
}

static void header(const run_t *r) {
  const plan_t *p = &r->plan;
  char dev[16], rb[16], mb[32];
  device_str(r->dev, dev, sizeof dev);
  mib(mb, sizeof mb, sharded_param_bytes(r));
  printf("fsdp-train: %s\n", p->source);
  printf("  world %d rank%s on %s; mesh dp_replicate=%d x dp_shard=%d x tp=%d (%s)\n",
         world_size(), world_size() == 1 ? "" : "s", dev, p->par.dp_replicate, p->par.dp_shard,
         p->par.tp, p->par.dp_replicate > 1 ? "HSDP" : "FSDP");
  printf(
      "  model: llama dim %lld, %lld layers, %lld/%lld heads, ffn %lld, vocab %lld, %s; "
      "%lld parameters\n",
      (long long)p->model.dim, (long long)p->model.n_layers, (long long)p->model.n_heads,
      (long long)p->model.n_kv_heads, (long long)p->model.ffn_dim, (long long)p->model.vocab_size,
      p->model.tie_embeddings ? "tied" : "untied", (long long)llama_num_params(&p->model));
  printf(
      "  fully_shard: %d groups (%d units + root); %s%s%sreshard_after_forward %s; param %s, "
      "reduce %s%s\n",
      r->n_groups, r->n_groups - 1, p->par.strategy[0] ? "sharding_strategy " : "",
      p->par.strategy, p->par.strategy[0] ? ": " : "",
      reshard_str(p->par.reshard_after_forward, rb, sizeof rb),
      dt_str(p->par.param_dtype), dt_str(p->par.reduce_dtype), p->par.offload ? "; offload" : "");
  if (r->tp)
    printf("  tensor_parallel: %d modules on tp=%d (%s); sequence parallelism %s\n",
           tp_num_modules(r->tp), p->par.tp,
           llama_plan_tp_is_builtin(&p->par) ? "the built-in Llama plan" : "the plan's rules",
           p->par.sequence_parallel ? "on" : "off");
  printf("  sharded parameters on rank 0: %s\n", mb);
  if (r->resumed_from[0])
    printf(
        "  resumed from %s after step %lld (rank 0 read %llu bytes of tensor data, needing "
        "%llu, plus %llu header bytes of %d files)\n",
        r->resumed_from, (long long)r->start_step, (unsigned long long)r->load_stats.bytes_read,
        (unsigned long long)r->load_stats.bytes_needed,
        (unsigned long long)r->load_stats.header_bytes, r->load_stats.files);
  if (r->resumed_from[0] && r->load_stats.unchecked)
    printf("  %s has no checksums (written by another tool): what was read is unchecked\n",
           r->resumed_from);
  if (r->resumed_from[0] && r->verified >= 0 && r->load_stats.unchecked)
    printf("  checkpoint.verify: nothing to verify (the files carry no checksums)\n");
  else if (r->resumed_from[0] && r->verified >= 0)
    printf("  checkpoint.verify: %lld chunks read whole, every block matches its checksum\n",
           (long long)r->verified);
  else if (p->ckpt_load[0] && !r->resumed_from[0])
    printf("  no checkpoint in %s yet: starting from step 0\n", p->ckpt_dir);
  printf(
      "  data: %s, %lld samples x %lld tokens per rank, grad_accum %lld (global batch %lld "
      "samples); %lld step%s\n",
      p->data_path, (long long)p->batch_size, (long long)p->seq_len, (long long)p->grad_accum,
      (long long)global_batch(r), (long long)p->steps,
      p->steps == 1 ? "" : "s");
  if (r->saved_batch > 0 && r->saved_batch != global_batch(r))
    fprintf(stderr,
            "fsdp-train: warning: %s was saved with a global batch of %lld samples, this run "
            "takes %lld: the data order and the learning-rate schedule go on by step, so "
            "samples are skipped or repeated\n",
            r->resumed_from, (long long)r->saved_batch, (long long)global_batch(r));
  fflush(stdout);
}

static double counted_bytes(const run_t *r) {
  double b = 0;
  for (int k = 0; k < mesh_ndim(r->mesh); k++) {
    pg_t *pg = mesh_group(r->mesh, k);
    pg_counters_t c = pg_counters(pg);
    for (int j = 0; j < PG_KIND_COUNT; j++) b += (double)c.bytes[j];
    pg_reset_counters(pg);
  }
  pg_t **pf = calloc((size_t)r->n_groups + 1, sizeof *pf);
  int npf = pf ? fsdp_post_forward_groups(r->groups, r->n_groups, pf) : 0;
  for (int i = 0; i < npf; i++) {
    pg_counters_t c = pg_counters(pf[i]);
    for (int j = 0; j < PG_KIND_COUNT; j++) b += (double)c.bytes[j];
    pg_reset_counters(pf[i]);
  }
  free(pf);
  return b;
}

/* --dry-run -v: each fully_shard unit's parameters, elements (gathered, padded, on this
 * rank's tp coordinate), bytes per rank of its shards (in the parameters' dtype) and bytes
 * gathered (in its compute dtype). */
static void unit_table(const run_t *r) {
  int W = r->plan.par.dp_shard;
  size_t own = r->n > 0 ? dtype_size(dtensor_local(r->ps[0]->value)->dtype) : 4;
  printf("\nunits (fully_shard groups, the root last):\n");
  printf("  %-28s %7s %14s %14s %14s\n", "unit", "params", "elements", "sharded B", "gathered B");
  double tot[3] = {0, 0, 0};
  int params = 0;
  for (int i = 0; i < r->n_groups; i++) {
    const fsdp_group_t *g = r->groups[i];
    const char *name = fsdp_group_name(g);
    double flat = (double)fsdp_flat_numel(g), row[3];
    row[0] = flat * W;
    row[1] = flat * (double)own;
    row[2] = flat * W * (double)dtype_size(fsdp_param_dtype(g));
    printf("  %-28s %7d %14.0f %14.0f %14.0f\n", name[0] ? name : "(root)", fsdp_num_params(g),
           row[0], row[1], row[2]);
    for (int k = 0; k < 3; k++) tot[k] += row[k];
    params += fsdp_num_params(g);
  }
  printf("  %-28s %7d %14.0f %14.0f %14.0f\n", "total", params, tot[0], tot[1], tot[2]);
}

static void dry_run(const run_t *r) {
  const plan_t *p = &r->plan;
  int W = p->par.dp_shard;
  if (world_rank() == 0) {
    printf(
        "\nparameters (placements on mesh (%s%s), global shape, local shape of each dp_shard "
        "rank%s):\n",
        p->par.dp_replicate > 1 ? "dp_replicate, dp_shard" : "dp_shard", p->par.tp > 1 ? ", tp" : "",
        p->par.tp > 1 ? " at rank 0's tp coordinate" : "");
    for (int i = 0; i < r->n; i++) {
      const dtensor_t *v = r->ps[i]->value;
      char pl[64], gs[64] = "";
      const int64_t *shape = dtensor_shape(v);
      int nd = dtensor_ndim(v);
      placements_str(mesh_ndim(dtensor_mesh(v)), dtensor_placements(v), pl, sizeof pl);
      for (int d = 0; d < nd; d++)
        snprintf(gs + strlen(gs), sizeof gs - strlen(gs), "%s%lld", d ? "x" : "",
                 (long long)shape[d]);
      printf("  %-44s %-22s %-12s", r->ps[i]->fqn, pl, gs);
      const mesh_t *vm = dtensor_mesh(v);
      int coord[MESH_MAX_DIMS], sd = mesh_dim_index(vm, "dp_shard");
      for (int k = 0; k < mesh_ndim(vm); k++) coord[k] = mesh_coord(vm, k);
      for (int k = 0; k < W; k++) {
        int64_t local[TENSOR_MAX_DIMS], off[TENSOR_MAX_DIMS];
        if (sd >= 0) coord[sd] = k;
        if (dtensor_compute_box(vm, dtensor_placements(v), nd, shape, coord, local, off) !=
            STATUS_OK)
          break;
        printf(" ");
        for (int d = 0; d < nd; d++) printf("%s%lld", d ? "x" : "", (long long)local[d]);
      }
      printf("\n");
    }
    printf("\nunits (fully_shard groups): floating-point inputs are cast to the compute dtype; "
           "output auto = the compute dtype, or f32 when the input was f32\n");
    for (int i = 0; i < r->n_groups; i++) {
      const fsdp_group_t *g = r->groups[i];
      const char *name = fsdp_group_name(g);
      dtype_t cin = DTYPE_COUNT, cout = DTYPE_COUNT;
      nn_module_t *m = name[0] ? nn_module_find(llama_module(r->model), name) : NULL;
      if (m) nn_module_cast(m, &cin, &cout);
      char rb[16];
      printf("  %-28s compute %-4s  reduce %-4s  output %-4s  reshard_after_forward %s\n",
             name[0] ? name : "(root)", dtype_name(fsdp_param_dtype(g)),
             dtype_name(fsdp_reduce_dtype(g)), cout != DTYPE_COUNT ? dtype_name(cout) : "auto",
             reshard_str(fsdp_reshard_after_forward(g), rb, sizeof rb));
    }
    double pb = sharded_param_bytes(r), largest = 0;
    for (int i = 0; i < r->n_groups; i++) {
      double b = (double)fsdp_flat_numel(r->groups[i]) * W *
                 (double)dtype_size(fsdp_param_dtype(r->groups[i]));
      largest = b > largest ? b : largest;
    }
    if (r->args.verbose) unit_table(r);
    llama_memory_t est, other;
    plan_t flip = *p; /* the other activation-checkpointing setting, for comparison */
    flip.activation_checkpointing = !p->activation_checkpointing;
    size_t own = r->n > 0 ? dtype_size(dtensor_local(r->ps[0]->value)->dtype) : 4;
    if (llama_memory_estimate(p, r->groups, r->n_groups, pb, own, &est) != STATUS_OK ||
        llama_memory_estimate(&flip, r->groups, r->n_groups, pb, own, &other) != STATUS_OK) {
      printf("memory estimate: %s\n", err_detail());
      return;
    }
    char a[32], b2[32], c[32], pk[32], ac[32], ga[32], fl[32], st[32], ot[32];
    mib(a, sizeof a, pb);
    mib(b2, sizeof b2, 2 * pb);
    mib(c, sizeof c, largest);
    mib(pk, sizeof pk, est.peak);
    mib(st, sizeof st, est.state);
    mib(ac, sizeof ac, est.activations);
    mib(ga, sizeof ga, est.gathered);
    mib(fl, sizeof fl, est.in_flight);
    mib(ot, sizeof ot, other.peak);
    printf("\nmemory per rank (estimate): sharded parameters %s, gradients %s, AdamW state %s, "
           "largest unsharded unit %s\n",
           a, a, b2, c);
    printf("  a step peaks at %s in %s: state %s, activations %s, gathered units %s, in "
           "flight %s; %s activation checkpointing: %s\n",
           pk, est.at, st, ac, ga, fl, p->activation_checkpointing ? "without" : "with", ot);
    printf("state_bytes %.0f\n", 4 * pb);
    printf("largest_unit_bytes %.0f\n", largest);
    printf("peak_bytes %.0f\n", est.peak);
    llama_comm_t m = llama_comm_estimate(p, r->groups, r->n_groups);
    printf(
        "communication per step and rank (docs/design.md section 11): all-gather %lld calls "
        "%.0f B, reduce-scatter %lld calls %.0f B, all-reduce %lld calls %.0f B\n",
        m.n_ag, m.ag, m.n_rs, m.rs, m.n_ar, m.ar);
    printf("comm_bytes %.0f\n", m.ag + m.rs + m.ar);
  }
}

/* Every rank learns whether rank 0 could write the metrics file (err: its errno, or 0). */
static status_t metrics_agree(const char *path, int err) {
  int any = 0;
  TRY(world_allreduce(&err, &any, 1, MPI_INT, MPI_MAX, world_comm(), "MPI_Allreduce (metrics)"));
  if (any)
    return err_set(STATUS_EIO, "cannot write the metrics file '%s': %s", path, strerror(any));
  return STATUS_OK;
}

/* Opens the metrics file (rank 0) for a run starting after step start: a fresh run starts it
 * anew; a resumed run keeps the lines up to its step (later ones belong to the run it
 * replaces), rewritten through PATH.tmp and a rename, and appends. NULL with errno set on
 * failure. */
static FILE *metrics_open(const char *path, int64_t start) {
  if (start == 0) return fopen(path, "w");
  FILE *in = fopen(path, "r");
  if (in == NULL) return errno == ENOENT ? fopen(path, "w") : NULL;
  char tmp[PLAN_PATH_MAX + 8];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *out = fopen(tmp, "w");
  char *line = NULL;
  size_t cap = 0;
  while (out != NULL && getline(&line, &cap, in) > 0) {
    cJSON *o = cJSON_Parse(line);
    const cJSON *step = cJSON_GetObjectItemCaseSensitive(o, "step");
    if (!cJSON_IsNumber(step) || step->valuedouble <= (double)start) fputs(line, out);
    cJSON_Delete(o);
  }
  free(line);
  bool ok = out != NULL && !ferror(in) && fflush(out) == 0 && !ferror(out);
  fclose(in);
  if (out != NULL && fclose(out) != 0) ok = false;
  if (!ok || rename(tmp, path) != 0) {
    int e = errno;
    unlink(tmp);
    errno = e;
    return NULL;
  }
  return fopen(path, "a");
}

/* The plan a checkpoint is saved under, as train_state.json's saved_under (caller frees). */
static status_t saved_under(const run_t *r, char **out) {
  const plan_t *p = &r->plan;
  char *model_text = NULL;
  TRY(llama_config_to_hf_text(&p->model, dtensor_local(r->ps[0]->value)->dtype, &model_text));
  cJSON *model = cJSON_Parse(model_text), *o = cJSON_CreateObject();
  free(model_text);
  char *text = NULL;
  if (model != NULL && o != NULL && cJSON_AddStringToObject(o, "plan", p->source) &&
      cJSON_AddNumberToObject(o, "world_size", world_size()) &&
      cJSON_AddNumberToObject(o, "dp_replicate", p->par.dp_replicate) &&
      cJSON_AddNumberToObject(o, "dp_shard", p->par.dp_shard) &&
      cJSON_AddNumberToObject(o, "tp", p->par.tp) &&
      cJSON_AddNumberToObject(o, "global_batch", (double)global_batch(r)) &&
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

static status_t train(run_t *r) {
  const plan_t *p = &r->plan;
  data_spec_t spec = {.batch_size = p->batch_size,
                      .seq_len = p->seq_len,
                      .grad_accum = p->grad_accum,
                      .dp_size = r->dp_size,
                      .dp_rank = r->dp_rank};
  lr_schedule_t sched = {
      .warmup_steps = p->warmup_steps, .total_steps = p->steps, .min_ratio = p->min_lr_ratio};
  const char *mpath = r->args.metrics ? r->args.metrics : p->metrics;
  FILE *mf = NULL;
  /* a live progress bar on a terminal; mpirun hands every rank a pseudo-terminal even when
   * its own output is redirected, so under a launcher the bar stays off */
  bool launched = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMI_SIZE") || getenv("SLURM_PROCID");
  bool lead = world_rank() == 0, tty = lead && !launched && isatty(fileno(stdout));
  if (r->start_step >= p->steps) { /* before the metrics file is touched */
    if (lead)
      printf("nothing to train: the checkpoint is after step %lld, train.steps is %lld\n",
             (long long)r->start_step, (long long)p->steps);
    return STATUS_OK;
  }
  int bad = 0;
  if (lead && mpath[0] && (mf = metrics_open(mpath, r->start_step)) == NULL) bad = errno;
  TRY(metrics_agree(mpath, bad));
  nn_module_t *root = llama_module(r->model);
  double t_start = now(), first_loss = 0, last_loss = 0, tok_sum = 0;
  size_t peak_max = 0;
  status_t st = STATUS_OK;
  counted_bytes(r); /* reset */
  for (int64_t s = r->start_step; s < p->steps && st == STATUS_OK; s++) {
    double t0 = now(), loss = 0;
    mem_reset_peak(r->dev);
    optim_zero_grad(r->opt);
    for (int64_t k = 0; k < p->grad_accum && st == STATUS_OK; k++) {
      fsdp_set_is_last_backward(root, k == p->grad_accum - 1);
      double l;
      st = llama_micro_step(r->model, r->data, &spec, s, k, &l);
      loss += l / (double)p->grad_accum;
    }
    double norm = 0, factor = lr_schedule_factor(&sched, s);
    float coef = 1; /* clipping, applied inside the optimizer's pass */
    if (st == STATUS_OK)
      st = clip_grad_coef(r->ps, r->n, p->clip_grad_norm > 0 ? p->clip_grad_norm : INFINITY,
                          r->all, &norm, &coef);
    if (st != STATUS_OK) break;
    double gl = 0;
    st = world_allreduce(&loss, &gl, 1, MPI_DOUBLE, MPI_SUM, world_comm(), "MPI_Allreduce (loss)");
    if (st != STATUS_OK) break;
    gl /= world_size(); /* the ranks of one tp group hold the same loss */
    /* the same verdict on every rank: gl and norm are reduced over the world */
    bool finite = isfinite(gl) && isfinite(norm);
    if (!finite && !p->skip_nonfinite) {
      st = err_set(STATUS_EINVAL,
                   "step %lld: the loss is %g and the gradient norm %g; stopping before the "
                   "optimizer applies the step, so the weights and the last checkpoint stay "
                   "finite (lower optim.lr, set optim.clip_grad_norm, or set train.nonfinite: "
                   "skip to skip such steps)",
                   (long long)s + 1, gl, norm);
      break;
    }
    if (!finite && lead)
      fprintf(stderr, "fsdp-train: step %lld: the loss is %g and the gradient norm %g; the step "
                      "is skipped (train.nonfinite: skip)\n", (long long)s + 1, gl, norm);
    if (finite) st = optim_step_scaled(r->opt, factor, coef);
    if (st == STATUS_OK) st = device_stream_sync(r->dev);
    if (st != STATUS_OK) break;
    double dt = now() - t0;
    double tokens = (double)(global_batch(r) * p->seq_len);
    double tps = tokens / dt, comm = counted_bytes(r);
    size_t peak = mem_stats(r->dev).peak, state = mem_stats(r->dev).current;
    peak_max = peak > peak_max ? peak : peak_max;
    if (s == r->start_step) first_loss = gl;
    if (p->ckpt_interval > 0 && (s + 1) % p->ckpt_interval == 0) {
      char dir[PLAN_PATH_MAX + 32], *under = NULL;
      ckpt_step_dir(p->ckpt_dir, s + 1, dir, sizeof dir);
      st = saved_under(r, &under);
      if (st == STATUS_OK)
        st = ckpt_save_training(dir, r->ps, r->n, r->opt, s + 1, under, world_comm());
      free(under);
      if (st != STATUS_OK) break;
      if (lead) ckpt_prune(p->ckpt_dir, (int)p->ckpt_keep);
      if (lead) printf("saved %s\n", dir);
    }
    last_loss = gl;
    tok_sum += tokens;
    if (mf) {
      cJSON *o = cJSON_CreateObject();
      cJSON_AddNumberToObject(o, "step", (double)(s + 1));
      cJSON_AddNumberToObject(o, "loss", gl);
      cJSON_AddNumberToObject(o, "lr", p->optim.lr * factor);
      cJSON_AddNumberToObject(o, "grad_norm", norm);
      cJSON_AddNumberToObject(o, "tokens_per_s", tps);
      cJSON_AddNumberToObject(o, "peak_mem_bytes", (double)peak);
      cJSON_AddNumberToObject(o, "comm_bytes", comm);
      cJSON_AddNumberToObject(o, "state_bytes", (double)state);
      cJSON_AddNumberToObject(o, "step_time_s", dt);
      char *line = cJSON_PrintUnformatted(o);
      if (line == NULL || fprintf(mf, "%s\n", line) < 0 || fflush(mf) != 0)
        bad = errno ? errno : EIO;
      free(line);
      cJSON_Delete(o);
    }
    if (mpath[0] && (st = metrics_agree(mpath, bad)) != STATUS_OK) break; /* a full disk */
    if (!lead) continue;
    bool show = s == 0 || s + 1 == p->steps || (s + 1) % p->log_interval == 0;
    double elapsed = now() - t_start, eta = elapsed / (double)(s + 1) * (double)(p->steps - s - 1);
    char pm[32];
    mib(pm, sizeof pm, (double)peak);
    if (show) {
      printf(
          "%sstep %5lld/%lld  loss %.6f  lr %.3e  grad_norm %.4f  %.0f tok/s  peak %s  "
          "ETA %.0fs\n",
          tty ? "\r\033[K" : "", (long long)(s + 1), (long long)p->steps, gl, p->optim.lr * factor,
          norm, tps, pm, eta);
    } else if (tty) { /* live progress on a terminal */
      int w = 30, done = (int)((double)w * (double)(s + 1) / (double)p->steps);
      printf("\r[%.*s%*s] %lld/%lld  loss %.4f  %.0f tok/s  ETA %.0fs", done,
             "##############################", w - done, "", (long long)(s + 1),
             (long long)p->steps, gl, tps, eta);
    }
    fflush(stdout);
  }
  if (mf != NULL && fclose(mf) != 0) bad = errno ? errno : EIO;
  if (mpath[0]) { /* the file closed (its last lines written): every rank takes this path */
    status_t ms = metrics_agree(mpath, bad);
    if (st == STATUS_OK) st = ms;
  }
  if (st == STATUS_OK && lead && r->args.plot != NULL &&
      (st = plot_metrics(&mpath, 1, r->args.plot)) == STATUS_OK)
    printf("plot: %s\n", r->args.plot);
  if (st == STATUS_OK && lead) {
    double total = now() - t_start;
    char pm[32];
    mib(pm, sizeof pm, (double)peak_max);
    printf("done: %lld steps in %.1f s; loss %.4f -> %.4f; %.0f tokens/s; peak memory %s\n",
           (long long)(p->steps - r->start_step), total, first_loss, last_loss, tok_sum / total,
           pm);
  }
  return st;
}

int main(int argc, char **argv) {
  if (world_init(&argc, &argv) != STATUS_OK) {
    fprintf(stderr, "fsdp-train: %s\n", err_detail());
    return 1;
  }
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0 ||
        strcmp(argv[i], "--version") == 0) {
      bool version = strcmp(argv[i], "--version") == 0;
      if (world_rank() == 0 && version) printf("fsdp-train (fsdpc) %s\n", fsdpc_version());
      if (world_rank() == 0 && !version) usage(stdout);
      world_finalize();
      return 0;
    }
  run_t *r = calloc(1, sizeof *r);
  status_t st = r ? parse_args(argc, argv, &r->args) : STATUS_ENOMEM;
  if (st != STATUS_OK && world_rank() == 0) usage(stderr);
  if (st == STATUS_OK) st = world_check_launch();
  if (st == STATUS_OK) st = plan_load(&r->plan, r->args.config, r->args.sets, r->args.n_sets);
  if (st == STATUS_OK) st = plan_resolve(&r->plan, world_size());
  if (st == STATUS_OK && r->args.plot != NULL && r->args.metrics == NULL && !r->plan.metrics[0])
    st = err_set(STATUS_EINVAL, "--plot draws the metrics file: give --metrics PATH or "
                                "log.metrics in the plan");
  if (st == STATUS_OK) world_set_timeout(r->plan.comm_timeout_s);
  if (st == STATUS_OK) st = dcp_set_block_bytes((uint64_t)r->plan.ckpt_block_bytes);
  if (st == STATUS_OK && r->plan.ckpt_dir[0] && r->plan.ckpt_interval > 0) /* before training */
    st = r->args.dry_run ? file_check_dirs(r->plan.ckpt_dir, "checkpoint.dir")
                         : file_make_dirs(r->plan.ckpt_dir, "checkpoint.dir");
  int rc = 1;
  if (agree(st)) {
    st = build(r);
    if (agree(st)) {
      if (world_rank() == 0) header(r);
      if (r->args.dry_run) {
        dry_run(r);
        rc = 0;
      } else if (agree(train(r))) {
        rc = 0;
      }
    }
  }
  if (r) {
    optim_free(r->opt);
    free(r->ps);
    parallel_free(r->par);
    llama_free(r->model);
    data_free(r->data);
    free(r);
  }
  world_finalize();
  return rc;
}
