/* fsdp-train's report: the header of a run and --dry-run's placements, memory estimate and
 * communication. */
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/kernels.h"
#include "mesh/world.h"
#include "models/llama/llama_plan.h"
#include "train/hf_convert_impl.h"
#include "train/llama_cost.h"
#include "train/run_impl.h"

static const char *reshard_str(int r, char *buf, size_t n) {
  if (r == FSDP_RESHARD_AUTO) return "auto";
  if (r == 0 || r == 1) return r ? "true" : "false";
  snprintf(buf, n, "%d", r);
  return buf;
}

static const char *dt_str(dtype_t d) { return d == DTYPE_COUNT ? "own" : dtype_name(d); }

void train_data_order(bool shuffle, uint64_t seed, int64_t seq_len, char *buf, size_t n) {
  if (shuffle)
    snprintf(buf, n, "shuffled by train.seed %llu, samples of data.seq_len %lld",
             (unsigned long long)seed, (long long)seq_len);
  else
    snprintf(buf, n, "in file order, samples of data.seq_len %lld", (long long)seq_len);
}

void train_mib(char *buf, size_t n, double bytes) {
  if (bytes >= 1073741824.0)
    snprintf(buf, n, "%.2f GiB", bytes / 1073741824.0);
  else
    snprintf(buf, n, "%.2f MiB", bytes / 1048576.0);
}

/* Per-rank bytes of the sharded parameters (padded storage included). */
static double sharded_param_bytes(const run_t *r) {
  double b = 0;
  for (int i = 0; i < r->n; i++) b += (double)tensor_nbytes(dtensor_local(r->ps[i]->value));
  return b;
}

/* Kernel threads beyond the CPUs this rank may use, or the node's ranks' threads beyond its
 * CPUs: idle threads wait by spinning, so each step is then several times slower. */
static void warn_oversubscribed(void) {
  int threads = kernel_cpu_threads();
  world_cpus_t c = world_cpus();
  int mine = c.mine, local = c.local_ranks;
  long online = c.online;
  if (threads > mine)
    printf(
        "  warning: %d kernel threads (OMP_NUM_THREADS) but rank 0 may run on %d CPU%s "
        "(its launcher's binding): steps will be several times slower\n",
        threads, mine, mine == 1 ? "" : "s");
  else if (online > 0 && (long)threads * local > online)
    printf(
        "  warning: %d ranks x %d kernel threads (OMP_NUM_THREADS) on a node of %ld CPUs: "
        "steps will be several times slower\n",
        local, threads, online);
}

/* The optimizer, its schedule and its parameter groups in one line. */
static void optim_line(const fsdpc_plan_t *p) {
  const adamw_config_t *o = &p->optim;
  char groups[512] = "";
  size_t n = 0;
  for (int i = 0; i < o->n_groups && n < sizeof groups; i++) {
    const adamw_group_t *g = &o->groups[i];
    int w = snprintf(groups + n, sizeof groups - n, "%s\"%s\"", i ? ", " : "; param_groups ",
                     g->pattern);
    if (w > 0 && (n += (size_t)w) < sizeof groups && g->lr >= 0)
      if ((w = snprintf(groups + n, sizeof groups - n, " lr %g", g->lr)) > 0) n += (size_t)w;
    if (n < sizeof groups && g->weight_decay >= 0)
      if ((w = snprintf(groups + n, sizeof groups - n, " weight_decay %g", g->weight_decay)) > 0)
        n += (size_t)w;
  }
  char clip[48] = "";
  if (p->clip_grad_norm > 0) snprintf(clip, sizeof clip, ", clip_grad_norm %g", p->clip_grad_norm);
  char decay[48] = "then constant";
  if (p->min_lr_ratio < 1) snprintf(decay, sizeof decay, "cosine to %g x lr", p->min_lr_ratio);
  printf(
      "  optim: AdamW lr %g, betas (%g, %g), eps %g, weight_decay %g%s%s; warmup %lld step%s, "
      "%s%s\n",
      o->lr, o->beta1, o->beta2, o->eps, o->weight_decay, clip,
      o->state_dtype == DTYPE_BF16 ? ", bf16 moments" : "", (long long)p->warmup_steps,
      p->warmup_steps == 1 ? "" : "s", decay, groups);
}

/* The header's world lines: ranks, mesh, planning, process groups, devices, kernels. */
static void header_world(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  char dev[16];
  device_str(r->dev, dev, sizeof dev);
  char threads[48] = "";
  if (r->dev.type == DEVICE_CPU && kernel_cpu_threads() > 1) /* OMP_NUM_THREADS */
    snprintf(threads, sizeof threads, ", %d kernel threads%s", kernel_cpu_threads(),
             world_size() == 1 ? "" : " each");
  bool hfsdp = p->par.dp_replicate > 1 && p->par.state_over_replicas;
  char pipe[32] = "";
  if (p->par.pp > 1) snprintf(pipe, sizeof pipe, "pp=%d x ", p->par.pp);
  printf("  world %d rank%s on %s%s; mesh %sdp_replicate=%d x dp_shard=%d x tp=%d (%s)\n",
         world_size(), world_size() == 1 ? "" : "s", dev, threads, pipe, p->par.dp_replicate,
         p->par.dp_shard, p->par.tp,
         hfsdp                     ? "HFSDP: optimizer state over dp_replicate x dp_shard"
         : p->par.dp_replicate > 1 ? "HSDP"
                                   : "FSDP");
  if (world_planning())
    printf("  planned from one process (--world %d, %d rank%s per node): rank 0's figures\n",
           world_size(), world_local_size(), world_local_size() == 1 ? "" : "s");
  if (pg_device_backend() != PG_BACKEND_NATIVE)
    printf(
        "  process groups: host-staged%s (FSDPC_PG): device data exchanged through host memory "
        "over MPI\n",
        pg_device_backend() == PG_BACKEND_STAGED_LAZY ? ", lazy test mode" : "");
  if (r->device_note[0]) printf("  train.device auto: %s\n", r->device_note);
  if (r->dev.type == DEVICE_CUDA && world_device_assignment()[0])
    printf("  devices: %s\n", world_device_assignment());
  if (r->dev.type == DEVICE_CUDA && p->deterministic)
    printf(
        "  attention: batched cuBLAS products (train.deterministic: the same bits on every "
        "run)\n");
  else if (r->dev.type == DEVICE_CUDA && kernel_attention_fused_off()[0])
    printf("  attention: batched cuBLAS products (%s)\n", kernel_attention_fused_off());
  else if (r->dev.type == DEVICE_CUDA)
    printf(
        "  attention: cuDNN's fused kernels for bf16/f16 where cuDNN takes the shape, else "
        "batched cuBLAS products\n");
  if (r->dev.type == DEVICE_CUDA && kernel_matmul_lt_off()[0])
    printf("  matrix products: cublasGemmEx (%s)\n", kernel_matmul_lt_off());
  if (r->dev.type == DEVICE_CUDA && kernel_matmul_grouped_off()[0])
    printf("  experts' products: one call each (%s)\n", kernel_matmul_grouped_off());
  if (r->dev.type == DEVICE_CPU && kernel_cpu_threads() > 1) warn_oversubscribed();
  if (r->builtin && p->par.tp > 1 && !p->par.sequence_parallel &&
      llama_num_moe_layers(&p->model) > 0)
    printf(
        "  note: mesh.tp=%d without sequence parallelism: every tp rank routes the whole "
        "sequence through the experts, %d times the MoE blocks' work; "
        "parallelize.tensor_parallel.sequence_parallel: true splits it\n",
        p->par.tp, p->par.tp);
}

/* The header's line on the program's own model: its name, vocabulary and parameters. */
static void own_model_line(const run_t *r) {
  double n = 0;
  for (int i = 0; i < r->n; i++) {
    double e = 1;
    for (int d = 0; d < dtensor_ndim(r->ps[i]->value); d++)
      e *= (double)dtensor_shape(r->ps[i]->value)[d];
    n += e;
  }
  printf(
      "  model: %s (the program's own), vocab %lld; %.0f parameters; activation checkpointing "
      "%s\n",
      r->model.name, (long long)r->model.vocab_size, n,
      r->plan.activation_checkpointing ? "asked (the model's to honour)" : "off");
}

/* The header's line on the built-in model: its architecture and sizes. */
/* The dropout rates the model's config.json gives above 0, which training here never applies
 * (export-hf keeps them in the config it writes). */
static void dropout_note(const run_t *r) {
  char said[256] = "";
  size_t n = 0;
  for (int k = 0; hf_dropout_keys[k]; k++) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(r->carried, hf_dropout_keys[k]);
    if (cJSON_IsNumber(v) && v->valuedouble > 0 && n < sizeof said)
      n += (size_t)snprintf(said + n, sizeof said - n, "%s%s %g", n ? ", " : "", hf_dropout_keys[k],
                            v->valuedouble);
  }
  if (said[0])
    printf(
        "  model: note: its config.json's %s %s not applied: training here has no dropout "
        "(export-hf keeps the rates in the config it writes)\n",
        said, strchr(said, ',') ? "are" : "is");
}

static void builtin_model_line(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  const llama_config_t *c = &p->model;
  char heads[48] = "", extra[64] = "", moe[224] = "";
  if (c->head_dim > 0) snprintf(heads, sizeof heads, " of %lld", (long long)c->head_dim);
  snprintf(extra, sizeof extra, "%s%s",
           c->qkv_bias ? (c->o_bias ? ", attention biases" : ", q/k/v biases") : "",
           c->qk_norm ? ", q/k norms" : "");
  int64_t sparse = llama_num_moe_layers(c);
  if (sparse > 0)
    snprintf(moe, sizeof moe, ", %lld experts of %lld, top-%lld%s in %lld of the layers%s",
             (long long)c->n_experts, (long long)c->moe_ffn_dim, (long long)c->top_k,
             c->norm_topk ? " renormalised" : "", (long long)sparse,
             c->aux_loss_coef == 0 ? ""
             : p->moe_aux_global
                 ? " (load-balancing loss over every data-parallel rank's micro-batch)"
                 : " (load-balancing loss over each rank's micro-batch)");
  char rows[48] = "";
  char padded[64] = "";
  if (llama_vocab_rows(c) > c->vocab_size) {
    int64_t pad = (llama_vocab_rows(c) - c->vocab_size) * c->dim * (c->tie_embeddings ? 1 : 2);
    snprintf(rows, sizeof rows, " (tables padded to %lld rows)", (long long)llama_vocab_rows(c));
    snprintf(padded, sizeof padded, " (%lld of them in the padding rows)", (long long)pad);
  }
  printf(
      "  model: %s dim %lld, %lld layer%s, %lld/%lld heads%s, ffn %lld%s, vocab %lld%s, %s%s; "
      "%lld parameters%s; activation checkpointing %s\n",
      llama_arch_name(c->arch), (long long)c->dim, (long long)c->n_layers,
      c->n_layers == 1 ? "" : "s", (long long)c->n_heads, (long long)c->n_kv_heads, heads,
      (long long)c->ffn_dim, moe, (long long)c->vocab_size, rows,
      c->tie_embeddings ? "tied" : "untied", extra, (long long)llama_num_params(c), padded,
      p->activation_checkpointing ? "on" : "off");
}

/* The header's model lines: the model, fully_shard, the optimizer, tensor parallelism. */
static void header_model(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  char rb[16], mb[32];
  train_mib(mb, sizeof mb, sharded_param_bytes(r));
  if (r->builtin) {
    builtin_model_line(r);
    dropout_note(r);
  } else {
    own_model_line(r);
  }
  char threads[64] = "";
  if (r->host_threads > 0)
    snprintf(threads, sizeof threads, ", the optimizer on %d host threads", r->host_threads);
  char offload[160] = "";
  if (p->par.offload)
    snprintf(offload, sizeof offload, "; offload (%s%s)",
             r->dev.type == DEVICE_CPU ? "no effect on the CPU: the state is in host memory already"
                                       : "state in host memory",
             threads);
  char units[96];
  if (r->pp_sched != NULL) /* every unit of this rank's stages is a root of its own */
    snprintf(units, sizeof units, "%d unit%s of this rank's stages", r->n_groups,
             r->n_groups == 1 ? "" : "s");
  else
    snprintf(units, sizeof units, "%d unit%s + root", r->n_groups - 1, r->n_groups == 2 ? "" : "s");
  bool own_mp = false; /* a unit's mp_policy of its own: the units table has each */
  for (int i = 0; i < p->par.n_units; i++)
    own_mp = own_mp || p->par.units[i].param_dtype != p->par.param_dtype ||
             p->par.units[i].reduce_dtype != p->par.reduce_dtype;
  printf(
      "  fully_shard: %d group%s (%s); %s%s%sreshard_after_forward %s; param %s, "
      "reduce %s%s%s\n",
      r->n_groups, r->n_groups == 1 ? "" : "s", units,
      p->par.strategy[0] ? "sharding_strategy " : "", p->par.strategy,
      p->par.strategy[0] ? ": " : "", reshard_str(p->par.reshard_after_forward, rb, sizeof rb),
      dt_str(p->par.param_dtype),
      dt_str(p->par.reduce_dtype != DTYPE_COUNT ? p->par.reduce_dtype : p->par.param_dtype),
      own_mp ? " (some units their own: see the units table)" : "", offload);
  optim_line(p);
  if (r->tp)
    printf("  tensor_parallel: %d module%s on tp=%d (%s); sequence parallelism %s\n",
           tp_num_modules(r->tp), tp_num_modules(r->tp) == 1 ? "" : "s", p->par.tp,
           !(r->builtin && llama_plan_tp_is_builtin(&p->model, &p->par)) ? "the plan's rules"
           : p->model.arch == LLAMA_ARCH_GPT2                            ? "the built-in GPT-2 plan"
                                              : "the built-in Llama plan",
           p->par.sequence_parallel ? "on" : "off");
  printf("  sharded parameters on rank 0: %s\n", mb);
}

/* The header's lines on the checkpoint a run resumes from. */
static void header_resume(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  if (r->resumed_from[0])
    printf(
        "  resumed from %s after step %lld (rank 0 read %llu bytes of tensor data, needing "
        "%llu, plus %llu header bytes of %d file%s)\n",
        r->resumed_from, (long long)r->start_step, (unsigned long long)r->load_stats.bytes_read,
        (unsigned long long)r->load_stats.bytes_needed,
        (unsigned long long)r->load_stats.header_bytes, r->load_stats.files,
        r->load_stats.files == 1 ? "" : "s");
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
}

/* The header's data and evaluation lines. */
static void header_data(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  char files[32] = "";
  if (data_num_files(r->data) > 1)
    snprintf(files, sizeof files, " in %d files", data_num_files(r->data));
  printf(
      "  data: %s (%lld tokens%s), %lld samples x %lld tokens per rank, grad_accum %lld "
      "(global batch %lld samples); %lld step%s\n",
      p->data_path, (long long)data_num_tokens(r->data), files, (long long)p->batch_size,
      (long long)p->seq_len, (long long)p->grad_accum, (long long)train_global_batch(r),
      (long long)p->steps, p->steps == 1 ? "" : "s");
  double read = (double)(p->steps - r->start_step) * (double)train_global_batch(r) *
                (double)p->seq_len,
         held = (double)data_num_tokens(r->data);
  if (held > 0 && read > 2 * held)
    printf(
        "  data: note: the run reads %.0f tokens, %.1f times the %.0f the data holds: each "
        "sample is seen about %.0f times\n",
        read, read / held, held, read / held);
  if (r->eval != NULL) {
    char every[64] = "";
    if (p->eval_interval > 0)
      snprintf(every, sizeof every, "every %lld steps and ", (long long)p->eval_interval);
    printf(
        "  eval: %s (%lld tokens), %lld global batch%s of %lld samples (eval.batch_size %lld x "
        "%lld micro-batches x %lld data-parallel ranks) %safter the last step\n",
        p->eval_path, (long long)data_num_tokens(r->eval), (long long)p->eval_batches,
        p->eval_batches == 1 ? "" : "es",
        (long long)(p->eval_batch_size * p->grad_accum * r->dp_size), (long long)p->eval_batch_size,
        (long long)p->grad_accum, (long long)r->dp_size, every);
    /* the distinct samples of seq_len + 1 tokens, shuffled or not: (n - 1) / seq_len */
    double samples = (double)p->eval_batches * (double)p->grad_accum *
                     (double)(p->eval_batch_size * r->dp_size),
           distinct = (double)((data_num_tokens(r->eval) - 1) / p->seq_len);
    if (samples > distinct)
      printf(
          "  eval: note: its batches read %.0f samples, more than the %.0f distinct samples of "
          "%lld tokens it holds: samples repeat\n",
          samples, distinct, (long long)p->seq_len);
  }
}

/* The saved run's schedule at step s, past its end at its last rate (min_ratio) once its
 * warmup is over: what it would have gone on with. */
static double saved_factor(const lr_schedule_t *then, int64_t s) {
  return s >= then->total_steps && s >= then->warmup_steps ? then->min_ratio
                                                           : lr_schedule_factor(then, s);
}

/* Warnings when a resumed run reads the data in another order, or follows another
 * learning-rate schedule, than the run it resumes. */
static void header_order_warnings(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  if (r->saved_batch > 0 && r->saved_batch != train_global_batch(r))
    fprintf(stderr,
            "%s: warning: %s was saved with a global batch of %lld samples, this run "
            "takes %lld: the data order and the learning-rate schedule go on by step, so "
            "samples are skipped or repeated\n",
            train_prog(), r->resumed_from, (long long)r->saved_batch,
            (long long)train_global_batch(r));
  int64_t tokens = r->data ? data_num_tokens(r->data) : 0;
  if (r->saved_tokens > 0 && tokens > 0 && r->saved_tokens != tokens)
    fprintf(stderr,
            "%s: warning: %s was trained on data of %lld tokens, this run's data.path holds "
            "%lld: from here its steps read other samples than the run it resumes would have\n",
            train_prog(), r->resumed_from, (long long)r->saved_tokens, (long long)tokens);
  const saved_schedule_t *was = &r->saved_schedule;
  if (was->total_steps > 0 && r->start_step < p->steps &&
      (was->total_steps != p->steps || was->warmup_steps != p->warmup_steps ||
       was->min_ratio != p->min_lr_ratio || was->lr != p->optim.lr)) {
    lr_schedule_t then = {.warmup_steps = was->warmup_steps,
                          .total_steps = was->total_steps,
                          .min_ratio = was->min_ratio};
    lr_schedule_t now = {
        .warmup_steps = p->warmup_steps, .total_steps = p->steps, .min_ratio = p->min_lr_ratio};
    int64_t at = r->start_step; /* the first step this run takes, 0-based */
    /* the rates compared over the steps both schedules have left (1000 of them at most, evenly
     * spread): the same rates (another train.steps of a constant rate, say) warn of nothing */
    int64_t end = p->steps, stride = end - at > 1000 ? (end - at) / 1000 : 1;
    bool differ = false;
    for (int64_t s = at; s < end && !differ; s += stride) {
      double a = p->optim.lr * lr_schedule_factor(&now, s);
      double b = was->lr * saved_factor(&then, s);
      differ = fabs(a - b) > 1e-12 * fmax(fabs(a), fabs(b));
    }
    if (differ)
      fprintf(stderr,
              "%s: warning: %s was trained under another learning-rate schedule (train.steps "
              "%lld, schedule.warmup_steps %lld, schedule.min_lr_ratio %g, optim.lr %g; this "
              "run's: %lld, %lld, %g, %g): from step %lld the learning rate follows this run's, "
              "%.4g where the saved run's would be %.4g\n",
              train_prog(), r->resumed_from, (long long)was->total_steps,
              (long long)was->warmup_steps, was->min_ratio, was->lr, (long long)p->steps,
              (long long)p->warmup_steps, p->min_lr_ratio, p->optim.lr, (long long)at + 1,
              p->optim.lr * lr_schedule_factor(&now, at), was->lr * saved_factor(&then, at));
  }
  char order[sizeof r->saved_order];
  train_data_order(p->shuffle, p->seed, p->seq_len, order, sizeof order);
  if (r->saved_order[0] && strcmp(r->saved_order, order) != 0)
    fprintf(stderr,
            "%s: warning: %s was saved reading the data %s; this run reads it %s: from "
            "here the samples follow this run's order, so some are skipped or repeated\n",
            train_prog(), r->resumed_from, r->saved_order, order);
}

/* A warmup longer than the run: the rate never reaches optim.lr (the schedule is as the plan
 * says it; TorchTitan would shorten the warmup). */
static void header_schedule(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  if (p->warmup_steps > p->steps)
    fprintf(stderr,
            "%s: warning: schedule.warmup_steps %lld exceeds train.steps %lld: the rate rises "
            "to %.4g (optim.lr x %lld / %lld) and never reaches optim.lr, nor decays\n",
            train_prog(), (long long)p->warmup_steps, (long long)p->steps,
            p->optim.lr * (double)p->steps / (double)p->warmup_steps, (long long)p->steps,
            (long long)p->warmup_steps);
}

void train_header(const run_t *r) {
  printf("%s: %s\n", train_prog(), r->plan.source);
  header_schedule(r);
  header_world(r);
  header_model(r);
  header_resume(r);
  header_data(r);
  header_order_warnings(r);
  fflush(stdout);
}

/* Adds the bytes counted by pg into *b and resets its counters, unless it is among seen[0..n)
 * (then or after, recorded there). */
static void count_group(pg_t *pg, pg_t **seen, int *n, double *b) {
  for (int q = 0; q < *n; q++)
    if (seen[q] == pg) return;
  seen[(*n)++] = pg;
  pg_counters_t c = pg_counters(pg);
  for (int j = 0; j < PG_KIND_COUNT; j++) *b += (double)c.bytes[j];
  pg_reset_counters(pg);
}

double train_counted_bytes(const run_t *r) {
  double b = 0;
  /* the groups of the world mesh, of the data-parallel mesh (mesh.ep: its dp_shard the
   * flattened dp_shard_ep and ep), of the experts' (mesh.ep with tp: dp_shard_ep and tp
   * flattened) and of their split (ep borrowing tp: ep_dp and tp flattened), each once */
  const mesh_t *meshes[] = {r->mesh, parallel_dp_mesh(r->par), parallel_expert_mesh(r->par),
                            parallel_ep_mesh(r->par)};
  pg_t *seen[4 * MESH_MAX_DIMS];
  int n = 0;
  for (int m = 0; m < 4; m++)
    for (int k = 0; k < mesh_ndim(meshes[m]); k++)
      count_group(mesh_group(meshes[m], k), seen, &n, &b);
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
    row[2] = (double)fsdp_gather_numel(g) * W * (double)dtype_size(fsdp_param_dtype(g));
    printf("  %-28s %7d %14.0f %14.0f %14.0f\n", name[0] ? name : "(root)", fsdp_num_params(g),
           row[0], row[1], row[2]);
    for (int k = 0; k < 3; k++) tot[k] += row[k];
    params += fsdp_num_params(g);
  }
  printf("  %-28s %7d %14.0f %14.0f %14.0f\n", "total", params, tot[0], tot[1], tot[2]);
}

/* --dry-run: one parameter's line: placements, global shape, each dp_shard rank's local
 * shape (beyond 16 ranks, a run of equal shapes once, with its ranks). */
static void param_line(const run_t *r, const nn_param_t *prm) {
  int W = r->plan.par.dp_shard;
  const dtensor_t *v = prm->value;
  char pl[64], gs[64] = "";
  const int64_t *shape = dtensor_shape(v);
  int nd = dtensor_ndim(v);
  placements_str(mesh_ndim(dtensor_mesh(v)), dtensor_placements(v), pl, sizeof pl);
  for (int d = 0; d < nd; d++)
    snprintf(gs + strlen(gs), sizeof gs - strlen(gs), "%s%lld", d ? "x" : "", (long long)shape[d]);
  printf("  %-44s %-22s %-12s", prm->fqn, pl, gs);
  const mesh_t *vm = dtensor_mesh(v);
  int coord[MESH_MAX_DIMS], sd = mesh_dim_index(vm, "dp_shard");
  for (int k = 0; k < mesh_ndim(vm); k++) coord[k] = mesh_coord(vm, k);
  char prev[96] = "";
  int from = 0;
  for (int k = 0; k <= W; k++) {
    int64_t local[TENSOR_MAX_DIMS], off[TENSOR_MAX_DIMS];
    char cur[96] = "";
    if (sd >= 0) coord[sd] = k;
    if (k < W &&
        dtensor_compute_box(vm, dtensor_placements(v), nd, shape, coord, local, off) != STATUS_OK)
      break;
    for (int d = 0; k < W && d < nd; d++)
      snprintf(cur + strlen(cur), sizeof cur - strlen(cur), "%s%lld", d ? "x" : "",
               (long long)local[d]);
    if (W <= 16) {
      if (k < W) printf(" %s", cur);
      continue;
    }
    if (k > 0 && (k == W || strcmp(cur, prev) != 0)) {
      if (k - 1 > from)
        printf(" %s (ranks %d-%d)", prev, from, k - 1);
      else
        printf(" %s (rank %d)", prev, from);
      from = k;
    }
    snprintf(prev, sizeof prev, "%s", cur);
  }
  printf("\n");
}

/* --dry-run: each unit's dtypes and reshard policy. */
static void unit_dtypes(const run_t *r) {
  printf(
      "\nunits (fully_shard groups): floating-point inputs are cast to the compute dtype; "
      "output auto = the compute dtype, or f32 when the input was f32; a unit inside another "
      "returns the dtype it was given (given)\n");
  for (int i = 0; i < r->n_groups; i++) {
    const fsdp_group_t *g = r->groups[i];
    const char *name = fsdp_group_name(g);
    dtype_t cin = DTYPE_COUNT, cout = DTYPE_COUNT;
    nn_module_t *m = name[0] ? nn_module_find(r->root, name) : NULL;
    if (m) nn_module_cast(m, &cin, &cout);
    bool inside = false; /* a unit's module with parameters above it, the root aside (as
                          * the run decides: cast_call) */
    for (const nn_module_t *up = m ? nn_module_parent(m) : NULL;
         up && nn_module_parent(up) != NULL && !inside; up = nn_module_parent(up))
      inside = fsdp_group_of(up) != NULL && fsdp_num_params(fsdp_group_of(up)) > 0;
    char rb[16];
    if (fsdp_num_params(g) == 0) { /* its modules compute in the dtype of what they use */
      printf("  %-28s (no parameters of its own)\n", name[0] ? name : "(root)");
      continue;
    }
    printf("  %-28s compute %-4s  reduce %-4s  output %-5s  reshard_after_forward %s\n",
           name[0] ? name : "(root)", dtype_name(fsdp_param_dtype(g)),
           dtype_name(fsdp_reduce_dtype(g)),
           inside                ? "given"
           : cout != DTYPE_COUNT ? dtype_name(cout)
                                 : "auto",
           reshard_str(fsdp_reshard_after_forward(g), rb, sizeof rb));
  }
}

/* --dry-run: the memory per rank, and a step's peak with what makes it up; false (said) when
 * the estimate fails. */
/* This rank's stages (mesh.pp) as llama_memory_estimate_stage takes them. */
static llama_stage_t own_stage(const run_t *r) {
  int P = pp_schedule_ranks(r->pp_sched), S = pp_schedule_stages(r->pp_sched);
  llama_stage_t stage = {.stages = pp_schedule_stages_per_rank(r->pp_sched),
                         .sync_every = r->plan.par.pp_sync_every,
                         .first = r->pp_rank == 0,
                         .last = train_pp_last_rank(r) == r->pp_rank,
                         .in_flight = pp_schedule_max_in_flight(r->pp_sched, r->pp_rank)};
  for (int s = r->pp_rank; s < S; s += P) {
    int64_t b0 = 0, b1 = 0;
    llama_stage_range(r->llama, s, S, &b0, &b1);
    stage.blocks += (int)(b1 - b0);
  }
  return stage;
}

/* mesh.pp in a dry run of the whole job (not planned from one process): every pipeline rank's
 * estimated peak (of the pipeline holding rank 0) into peaks[0..pp) on rank 0, else 0s.
 * Collective over the pipeline group. */
static void pipeline_peaks(const run_t *r, double *peaks) {
  int P = pp_schedule_ranks(r->pp_sched);
  for (int q = 0; q < P; q++) peaks[q] = 0;
  if (world_planning() || !r->builtin) return;
  llama_stage_t stage = own_stage(r);
  size_t own = r->n > 0 ? dtype_size(dtensor_local(r->ps[0]->value)->dtype) : 4;
  llama_memory_t est = {0};
  double mine = llama_memory_estimate_stage(&r->plan, r->groups, r->n_groups,
                                            sharded_param_bytes(r), own, &stage, &est) == STATUS_OK
                    ? est.peak
                    : 0;
  if (pg_host_all_gather(mesh_group(parallel_pp_mesh(r->par), 0), &mine, peaks, 1, PG_HOST_F64) !=
      STATUS_OK)
    err_clear();
}

static bool memory_lines(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  int W = p->par.dp_shard;
  double pb = sharded_param_bytes(r), largest = 0;
  for (int i = 0; i < r->n_groups; i++) {
    double b = (double)fsdp_gather_numel(r->groups[i]) * W *
               (double)dtype_size(fsdp_param_dtype(r->groups[i]));
    largest = b > largest ? b : largest;
  }
  if (r->args.verbose) unit_table(r);
  if (!r->builtin) { /* no cost model: the state alone */
    char a[32], m[32], c[32];
    size_t own = r->n > 0 ? dtype_size(dtensor_local(r->ps[0]->value)->dtype) : 4;
    train_mib(a, sizeof a, pb);
    train_mib(m, sizeof m, 2 * pb / (double)own * (double)dtype_size(p->optim.state_dtype));
    train_mib(c, sizeof c, largest);
    printf(
        "\nmemory per rank: sharded parameters %s, gradients %s, AdamW state %s, largest "
        "unsharded unit %s; activations are estimated for the built-in models only\n",
        a, a, m, c);
    return false;
  }
  llama_memory_t est, other;
  fsdpc_plan_t flip = *p; /* the other activation-checkpointing setting, for comparison */
  flip.activation_checkpointing = !p->activation_checkpointing;
  size_t own = r->n > 0 ? dtype_size(dtensor_local(r->ps[0]->value)->dtype) : 4;
  fsdpc_status_t st1, st2;
  if (r->pp_sched != NULL) { /* this pipeline rank's share */
    llama_stage_t stage = own_stage(r);
    st1 = llama_memory_estimate_stage(p, r->groups, r->n_groups, pb, own, &stage, &est);
    st2 = llama_memory_estimate_stage(&flip, r->groups, r->n_groups, pb, own, &stage, &other);
  } else {
    st1 = llama_memory_estimate(p, r->groups, r->n_groups, pb, own, &est);
    st2 = llama_memory_estimate(&flip, r->groups, r->n_groups, pb, own, &other);
  }
  if (st1 != STATUS_OK || st2 != STATUS_OK) {
    printf("memory estimate: %s\n", err_detail());
    return false;
  }
  char a[32], b2[32], c[32], pk[32], ac[32], ga[32], fl[32], st[32], ot[32];
  train_mib(a, sizeof a, pb);
  train_mib(b2, sizeof b2, est.moments);
  train_mib(c, sizeof c, largest);
  train_mib(pk, sizeof pk, est.peak);
  train_mib(st, sizeof st, est.state);
  train_mib(ac, sizeof ac, est.activations);
  train_mib(ga, sizeof ga, est.gathered);
  train_mib(fl, sizeof fl, est.in_flight);
  train_mib(ot, sizeof ot, other.peak);
  char sh[32];
  train_mib(sh, sizeof sh, est.shards);
  printf(
      "\nmemory per rank (estimate): sharded parameters %s%s%s%s, gradients %s, AdamW state %s%s, "
      "largest unsharded unit %s\n",
      a, est.shards > 0 ? " (1/(dp_replicate x dp_shard); their 1/dp_shard shards " : "",
      est.shards > 0 ? sh : "", est.shards > 0 ? ")" : "", a, b2,
      p->optim.state_dtype == DTYPE_BF16 ? " (bf16 moments)" : "", c);
  printf(
      "  a step peaks at %s in %s: state %s, activations %s, gathered units %s, in "
      "flight %s; %s activation checkpointing: %s\n",
      pk, est.at, st, ac, ga, fl, p->activation_checkpointing ? "without" : "with", ot);
  printf("state_bytes %.0f\n", 2 * pb + est.shards + est.moments + est.buffers);
  printf("largest_unit_bytes %.0f\n", largest);
  printf("peak_bytes %.0f\n", est.peak);
  if (r->eval != NULL && est.eval > 0) {
    char ev[32];
    train_mib(ev, sizeof ev, est.eval);
    printf("  an evaluation (eval.batch_size %lld) peaks at %s in %s%s\n",
           (long long)p->eval_batch_size, ev, est.eval_at,
           est.eval > est.peak ? ": more than a step" : "");
    printf("eval_peak_bytes %.0f\n", est.eval);
  }
  return true;
}

/* The bytes of the tied weight's gradient shard the first and last pipeline ranks exchange
 * (0 without one). */
static double tied_bytes(const run_t *r) {
  if (r->tied == NULL) return 0;
  const fsdpc_tensor_t *v = dtensor_local(r->tied->value);
  return (double)tensor_numel(v) * (double)dtype_size(v->dtype);
}

/* mesh.pp: the schedule, each pipeline rank's stages and actions, the bubble, the sends. */
static void pipeline_lines(run_t *r) {
  const pp_schedule_t *s = r->pp_sched;
  int P = pp_schedule_ranks(s), V = pp_schedule_stages_per_rank(s), S = pp_schedule_stages(s);
  pp_step_options_t o = train_pp_options(r);
  printf(
      "\npipeline: %s, %d ranks x %d stage%s a rank, %d microbatches a step; bubble %.4f "
      "(closed form, equal stage times)\n",
      pp_schedule_name(pp_schedule_kind(s)), P, V, V == 1 ? "" : "s", pp_schedule_microbatches(s),
      pp_schedule_bubble(s));
  uint64_t total = 0;
  for (int q = 0; q < P; q++) {
    printf("  pipeline rank %d: stage%s", q, V == 1 ? "" : "s");
    for (int st = q; st < S; st += P) {
      int64_t b0 = 0, b1 = 0;
      llama_stage_range(r->llama, st, S, &b0, &b1);
      printf(" %d (blocks %lld-%lld%s%s)", st, (long long)b0, (long long)(b1 - 1),
             st == 0 ? ", embedding" : "", st == S - 1 ? ", final norm and head" : "");
    }
    uint64_t b = pp_step_send_bytes(&o, q);
    total += b;
    printf("; %d microbatches in flight at most; sends %llu B a step; actions:",
           pp_schedule_max_in_flight(s, q), (unsigned long long)b);
    for (int i = 0; i < pp_schedule_num_actions(s, q); i++) {
      pp_action_t a = pp_schedule_action(s, q, i);
      printf(" %c%d.%d", a.kind == PP_FORWARD ? 'F' : 'B', a.stage, a.microbatch);
    }
    printf("\n");
  }
  /* tied embeddings: the first and last pipeline ranks exchange the shared weight's gradient
   * shard after each step */
  double tied = tied_bytes(r);
  if (tied > 0)
    printf(
        "  tied embeddings: pipeline ranks 0 and %d exchange the shared weight's gradient "
        "shard, %.0f B each way\n",
        train_pp_last_rank(r), tied);
  printf("p2p_bytes %llu\n", (unsigned long long)(total + (uint64_t)(2 * tied)));
}

void train_dry_run(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  /* mesh.pp: every pipeline rank's estimate (a dry run of the whole job); stages <= layers */
  double peaks[4096] = {0};
  if (r->pp_sched != NULL && pp_schedule_ranks(r->pp_sched) <= 4096) pipeline_peaks(r, peaks);
  if (world_rank() != 0) return;
  printf(
      "\nparameters (placements on mesh (%s%s), global shape, local shape of each dp_shard "
      "rank%s):\n",
      p->par.dp_replicate > 1 ? "dp_replicate, dp_shard" : "dp_shard", p->par.tp > 1 ? ", tp" : "",
      p->par.tp > 1 ? " at rank 0's tp coordinate" : "");
  for (int i = 0; i < r->n; i++) param_line(r, r->ps[i]);
  unit_dtypes(r);
  if (r->pp_sched != NULL) pipeline_lines((run_t *)r); /* memory: pipeline rank 0's */
  for (int q = 0; r->pp_sched != NULL && q < pp_schedule_ranks(r->pp_sched) && q < 4096; q++)
    if (peaks[q] > 0) printf("pp_peak_bytes %d %.0f\n", q, peaks[q]);
  if (!memory_lines(r) && r->builtin) return;
  /* fully_shard's collectives follow from its groups whatever the model; tensor parallelism's
   * from the built-in models' plans only */
  fsdpc_plan_t fsdp_only = *p;
  bool tp_counted = p->par.tp == 1 || (r->builtin && llama_plan_tp_is_builtin(&p->model, &p->par));
  if (!tp_counted) fsdp_only.par.tp = 1;
  llama_comm_t m = llama_comm_estimate(&fsdp_only, r->groups, r->n_groups);
  char a2a[128] = "";
  if (p->par.ep > 1)
    snprintf(a2a, sizeof a2a,
             ", all-to-all %lld calls %.0f B (uniform routing: the run's metrics give the routed "
             "bytes)",
             m.n_a2a, m.a2a);
  printf(
      "communication per step and rank (docs/design.md, Performance model): all-gather %lld calls "
      "%.0f B, reduce-scatter %lld calls %.0f B, all-reduce %lld calls %.0f B%s%s\n",
      m.n_ag, m.ag, m.n_rs, m.rs, m.n_ar, m.ar, a2a,
      tp_counted ? ""
                 : "; fully_shard's alone: tensor parallelism's activations are estimated "
                   "for the built-in models' own plans only");
  /* under a pipeline, rank 0's stages and its sends to the next stage */
  double p2p = 0;
  if (r->pp_sched != NULL) {
    pp_step_options_t o = train_pp_options((run_t *)r);
    p2p = (double)pp_step_send_bytes(&o, 0) + tied_bytes(r);
    printf("  point-to-point (pipeline rank 0's sends): %.0f B\n", p2p);
  }
  if (tp_counted) printf("comm_bytes %.0f\n", m.ag + m.rs + m.ar + m.a2a + p2p);
}
