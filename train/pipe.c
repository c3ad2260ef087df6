/* Pipeline parallelism in the trainer (mesh.pp): the built-in model cut into pp x
 * stages_per_rank stages of whole blocks (llama_stage_modules), this rank's stages those of
 * pipeline index pp_rank (r, r + pp, ...), each step's micro-batches the schedule's
 * microbatches (pp_step). */
#include <stdlib.h>
#include <string.h>

#include "core/kernels.h"
#include "mesh/world.h"
#include "models/llama/llama.h"
#include "nn/moe.h"
#include "nn/ops.h"
#include "train/run_impl.h"

fsdpc_status_t train_pp_stages(run_t *r) {
  const parallel_plan_t *pp = &r->plan.par;
  if (pp->pp <= 1) return STATUS_OK;
  if (r->llama == NULL)
    return err_set(STATUS_EUNSUPPORTED, "mesh.pp: pipeline stages split the built-in models only");
  int P = pp->pp, V = pp->pp_stages_per_rank, S = P * V;
  /* the outermost mesh dimension: pipeline index world_rank / (world_size / pp) */
  r->pp_rank = world_rank() / (world_size() / P);
  if (pp->n_pp_splits > 0) { /* pipeline.split_points: the stages begin where it says */
    int64_t starts[PLAN_MAX_PP_SPLITS + 1];
    FSDPC_TRY(plan_pipeline_starts(&r->plan, starts));
    FSDPC_TRY(llama_set_stage_splits(r->llama, starts, S));
  }
  int cap = (int)r->plan.model.n_layers + 4 * V;
  r->stage_modules = calloc((size_t)cap, sizeof *r->stage_modules);
  if (r->stage_modules == NULL) return err_set(STATUS_ENOMEM, "out of host memory");
  for (int s = r->pp_rank; s < S; s += P) {
    int n = llama_stage_modules(r->llama, s, S, r->stage_modules + r->n_stage_modules,
                                cap - r->n_stage_modules);
    if (n < 0 || r->n_stage_modules + n > cap)
      return err_set(STATUS_EINTERNAL, "mesh.pp: stage %d of %d has no modules", s, S);
    r->n_stage_modules += n;
  }
  return pp_schedule_new(pp->pp_schedule, P, (int)r->plan.grad_accum, V, &r->pp_sched);
}

fsdpc_status_t train_pp_tied(run_t *r) {
  r->save_ps = r->ps;
  r->save_n = r->n;
  r->tied = NULL;
  if (r->pp_sched == NULL || !r->plan.model.tie_embeddings) return STATUS_OK;
  bool first = r->pp_rank == 0, last = train_pp_last_rank(r) == r->pp_rank;
  if (!first && !last) return STATUS_OK;
  nn_module_t *head = nn_module_child_named(llama_module(r->llama), "lm_head");
  r->tied = head ? nn_module_param_named(head, "weight") : NULL;
  if (r->tied == NULL) return err_set(STATUS_EINTERNAL, "mesh.pp: the tied head has no weight");
  if (first) return STATUS_OK; /* the first rank saves it and counts it */
  /* the last rank moves it to the end of its parameters (before the optimizer is made: the
   * checkpoint pairs parameter i with optimizer slot i) and saves and counts the rest */
  int at = -1;
  for (int i = 0; i < r->n; i++)
    if (r->ps[i] == r->tied) at = i;
  if (at < 0)
    return err_set(STATUS_EINTERNAL, "mesh.pp: the last stage does not hold the tied weight");
  memmove(r->ps + at, r->ps + at + 1, sizeof *r->ps * (size_t)(r->n - at - 1));
  r->ps[r->n - 1] = r->tied;
  r->save_n = r->n - 1;
  return STATUS_OK;
}

/* Tied embeddings: the first and last pipeline ranks add each other's gradient shard of the
 * shared weight (the same boxes: one plan shards both), so both hold the whole gradient and
 * take the same step. Collective between those two ranks: one that fails alone (its buffer's
 * allocation) stops the job, as the step does, rather than leave the other waiting. */
static fsdpc_status_t sum_tied(run_t *r, pg_t *g) {
  if (r->tied == NULL || r->tied->grad == NULL) return STATUS_OK;
  int peer = r->pp_rank == 0 ? train_pp_last_rank(r) : 0;
  if (peer == r->pp_rank) return STATUS_OK;
  fsdpc_tensor_t *mine = (fsdpc_tensor_t *)dtensor_local(r->tied->grad), other = {0};
  fsdpc_status_t st = tensor_init(&other, mine->dtype, mine->device, mine->ndim, mine->shape);
  if (st != STATUS_OK) return world_stop(st);
  pg_p2p_t ops[2] = {{true, mine->data, (size_t)tensor_numel(mine), peer},
                     {false, other.data, (size_t)tensor_numel(mine), peer}};
  pg_work_t *w = NULL;
  st = tensor_is_contiguous(mine)
           ? pg_send_recv(g, ops, 2, mine->dtype, &w)
           : err_set(STATUS_EINTERNAL, "mesh.pp: the tied gradient is strided");
  if (st == STATUS_OK) st = pg_wait(w);
  if (st == STATUS_OK) st = kernel_axpy(mine, 1.0f, &other);
  tensor_free(&other);
  return st;
}

void train_pp_free(run_t *r) {
  free(r->stage_modules);
  r->stage_modules = NULL;
  r->n_stage_modules = 0;
  pp_schedule_free(r->pp_sched);
  r->pp_sched = NULL;
}

/* What a step's stages read besides the run: the data's spec and the step; with MoE blocks,
 * their routing statistics per microbatch (nn_moe_aux_stats_len doubles each): this rank's
 * stages' (mine) and, once the last stage has run the microbatch, every stage's (total), which
 * the blocks' backward and the load-balancing loss take. */
typedef struct stage_step {
  run_t *r;
  const data_spec_t *spec;
  int64_t step;
  /* an evaluation's batch read (and agreed) beforehand, on the host: the first stage's ids,
   * the last stage's targets (NULL: read here) */
  const fsdpc_tensor_t *ready_ids, *ready_targets;
  nn_moe_aux_t *aux; /* NULL: no MoE block */
  int len;
  double *mine, *total;
} stage_step_t;

/* u's MoE statistics for m microbatches (none without MoE blocks). */
static fsdpc_status_t stage_stats_new(stage_step_t *u, int m) {
  u->aux = nn_moe_aux_of(u->r->root);
  u->len = nn_moe_aux_stats_len(u->aux);
  if (u->len == 0) return STATUS_OK;
  u->mine = calloc((size_t)(m * u->len), sizeof *u->mine);
  u->total = calloc((size_t)(m * u->len), sizeof *u->total);
  if (u->mine == NULL || u->total == NULL)
    return err_set(STATUS_ENOMEM, "mesh.pp: out of host memory for the routers' statistics");
  return STATUS_OK;
}

static void stage_stats_free(stage_step_t *u) {
  free(u->mine);
  free(u->total);
  u->mine = u->total = NULL;
}

/* Microbatch mb's token ids (stage 0) from data d on the device. */
static fsdpc_status_t stage_input_from(const fsdpc_data_t *d, const stage_step_t *u, int mb,
                                       nn_var_t **out) {
  fsdpc_tensor_t in = {0}, tg = {0}, dev = {0};
  if (u->ready_ids == NULL) FSDPC_TRY(data_batch(d, u->spec, u->step, mb, &in, &tg));
  fsdpc_status_t st = tensor_upload(&dev, u->ready_ids ? u->ready_ids : &in, u->r->dev);
  tensor_free(&in);
  tensor_free(&tg);
  if (st == STATUS_OK) st = nn_var_new(&dev, false, out);
  if (st != STATUS_OK) tensor_free(&dev);
  return st;
}

static fsdpc_status_t stage_input(int mb, nn_var_t **out, void *user) {
  const stage_step_t *u = user;
  return stage_input_from(u->r->data, u, mb, out);
}

/* Stage s of the model on microbatch mb of data d; the last one's logits into the mean
 * cross-entropy over its kept targets. */
static fsdpc_status_t stage_forward_on(const fsdpc_data_t *d, nn_ctx_t *ctx, int s, int mb,
                                       nn_var_t *in, nn_var_t **out, const stage_step_t *u) {
  run_t *r = u->r;
  int S = pp_schedule_stages(r->pp_sched);
  nn_var_t *h = NULL;
  /* the stage's routing statistics of the microbatch; a training forward's loss takes the
   * gradient factor of the microbatch's loss */
  bool train = d == r->data;
  nn_moe_aux_begin(u->aux, train ? 1.0 / (double)pp_schedule_microbatches(r->pp_sched) : 0);
  FSDPC_TRY(llama_stage_forward(ctx, r->llama, s, S, in, &h));
  if (u->mine != NULL) nn_moe_aux_stats_add(u->aux, u->mine + (size_t)mb * u->len);
  if (s < S - 1) { /* in the boundary's dtype (a widening: train_pp_options) */
    dtype_t b = train_pp_options(r).dtype;
    if (h->value.dtype == b) {
      *out = h;
      return STATUS_OK;
    }
    fsdpc_status_t st = nn_cast(ctx, h, b, out);
    nn_var_put(h);
    return st;
  }
  fsdpc_tensor_t ids = {0}, tg = {0}, tgd = {0};
  fsdpc_status_t st = u->ready_targets ? STATUS_OK : data_batch(d, u->spec, u->step, mb, &ids, &tg);
  tensor_free(&ids);
  if (st == STATUS_OK) st = tensor_upload(&tgd, u->ready_targets ? u->ready_targets : &tg, r->dev);
  if (st == STATUS_OK) st = train_check_logits(h, u->spec->vocab_size);
  if (st == STATUS_OK) st = nn_cross_entropy(ctx, h, &tgd, out, NULL);
  tensor_free(&tg);
  tensor_free(&tgd);
  nn_var_put(h);
  return st;
}

static fsdpc_status_t stage_forward(nn_ctx_t *ctx, int s, int mb, nn_var_t *in, nn_var_t **out,
                                    void *user) {
  const stage_step_t *u = user;
  return stage_forward_on(u->r->data, ctx, s, mb, in, out, u);
}

/* Before B(s, mb): the stage's units reduce their gradients and reshard only after its last
 * microbatch (gathered once a step, the gradients accumulated whole meanwhile), unless
 * pipeline.sync_every_microbatch. */
static fsdpc_status_t stage_before_backward(int s, int mb, void *user) {
  const stage_step_t *u = user;
  run_t *r = u->r;
  if (u->total != NULL) /* every stage's routing of the microbatch, for its blocks' backward
                         * (zeros without the loss's weight: its backward adds nothing) */
    nn_moe_aux_stats_set(u->aux, u->total + (size_t)mb * u->len);
  if (r->plan.par.pp_sync_every) return STATUS_OK;
  int S = pp_schedule_stages(r->pp_sched);
  bool last = mb == pp_schedule_microbatches(r->pp_sched) - 1;
  nn_module_t *mods[4096 + 4];
  int n = llama_stage_modules(r->llama, s, S, mods, 4096 + 4);
  for (int i = 0; i < n; i++) {
    fsdp_set_requires_gradient_sync(mods[i], last);
    fsdp_set_reshard_after_backward(mods[i], last);
    fsdp_set_is_last_backward(mods[i], last);
  }
  return STATUS_OK;
}

/* After the last stage's forward of microbatch mb: its routing statistics summed over the
 * pipeline's ranks (every stage's blocks), then over the data-parallel ranks
 * (nn_moe_aux_share_over). Collective over the pipeline group and those. */
static fsdpc_status_t stage_forwarded(int mb, void *user) {
  const stage_step_t *u = user;
  if (u->total == NULL) return STATUS_OK;
  size_t at = (size_t)mb * u->len;
  FSDPC_TRY(pg_host_all_reduce(mesh_group(parallel_pp_mesh(u->r->par), 0), u->mine + at,
                               u->total + at, u->len, PG_HOST_F64, REDUCE_SUM));
  return nn_moe_aux_stats_share(u->aux, u->total + at); /* and the data-parallel ranks' */
}

/* The settings of module fqn's unit under a pipeline (each block, the embedding, the norm and
 * the head a unit): the first units item that matches it, else the section's. */
static void unit_dtypes(const fsdpc_plan_t *p, const nn_module_t *m, dtype_t *compute,
                        dtype_t *out) {
  const plan_unit_t *u = parallel_plan_unit(&p->par, nn_module_fqn(m));
  dtype_t c = u ? u->param_dtype : p->par.param_dtype;
  *compute = c != DTYPE_COUNT ? c : DTYPE_F32;
  *out = u ? u->output_dtype : p->par.output_dtype;
}

/* What crosses the stage boundaries: the dtype each stage's last block returns as it does
 * without a pipeline (the token embedding's compute dtype, then each block's output dtype,
 * else f32 for an f32 input it computes narrower, else its compute dtype); f32 where the
 * boundaries differ, which holds each of them exactly (stage_forward_on widens each stage's
 * output to it; the units cast what they take, so the stages compute what they do without a
 * pipeline). */
static dtype_t boundary_dtype(const run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  int S = pp_schedule_stages(r->pp_sched);
  dtype_t d, out, c, at = DTYPE_COUNT;
  nn_module_t *first[1];
  llama_stage_modules(r->llama, 0, S, first, 1); /* the token embedding, stage 0's first */
  unit_dtypes(p, first[0], &d, &out);
  for (int s = 0; s < S - 1; s++) {
    int64_t b0 = 0, b1 = 0;
    llama_stage_range(r->llama, s, S, &b0, &b1);
    for (int64_t b = b0; b < b1; b++) {
      unit_dtypes(p, llama_layer(r->llama, b), &c, &out);
      d = out != DTYPE_COUNT ? out : d == DTYPE_F32 ? DTYPE_F32 : c;
    }
    at = at == DTYPE_COUNT || at == d ? d : DTYPE_F32;
  }
  return at == DTYPE_COUNT ? DTYPE_F32 : at;
}

pp_step_options_t train_pp_options(run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  pp_step_options_t o = PP_STEP_OPTIONS_INIT;
  o.group = mesh_group(parallel_pp_mesh(r->par), 0);
  o.schedule = r->pp_sched;
  o.ndim = 3; /* the hidden state [batch, seq_len, dim], whole on every tp rank, or its
               * sequence shard under sequence parallelism */
  bool sp = p->par.tp > 1 && p->par.sequence_parallel;
  o.shape[0] = p->batch_size;
  o.shape[1] = sp ? p->seq_len / p->par.tp : p->seq_len;
  o.shape[2] = p->model.dim;
  o.layout = sp ? TP_SHARD_SEQ : 0;
  o.dtype = boundary_dtype(r);
  o.device = r->dev;
  o.forward = stage_forward;
  o.input = stage_input;
  o.before_backward = stage_before_backward;
  o.forwarded = stage_forwarded;
  return o;
}

fsdpc_status_t train_pp_step(run_t *r, const data_spec_t *spec, int64_t step, double *loss,
                             double *p2p_bytes) {
  stage_step_t u = {.r = r, .spec = spec, .step = step};
  int M = pp_schedule_microbatches(r->pp_sched);
  fsdpc_status_t st = stage_stats_new(&u, M);
  if (st != STATUS_OK) { /* alone: the others would wait in the step for this rank */
    stage_stats_free(&u);
    return world_stop(st);
  }
  pp_step_options_t o = train_pp_options(r);
  o.user = &u;
  /* without the loss, the blocks' backward needs no totals: the step's figures take one sum of
   * every microbatch's statistics after it, not one wait a microbatch during it */
  bool weighted = nn_moe_aux_coef(u.aux) > 0;
  if (!weighted) o.forwarded = NULL;
  pg_counters_t before = pg_counters(o.group);
  st = pp_step(&o, loss);
  if (st == STATUS_OK && u.len > 0 && !weighted)
    st = pg_host_all_reduce(o.group, u.mine, u.total, M * u.len, PG_HOST_F64, REDUCE_SUM);
  if (st == STATUS_OK) st = sum_tied(r, o.group);
  pg_counters_t after = pg_counters(o.group);
  *p2p_bytes = (double)(after.bytes[PG_SEND_RECV] - before.bytes[PG_SEND_RECV]);
  /* the microbatches' routing: this rank's blocks' choices to the step's expert load; the
   * load-balancing loss of all the stages' blocks, weighted, to the step's loss (its gradient
   * came through the blocks' backward) */
  double aux = 0;
  for (int mb = 0; mb < M && st == STATUS_OK && u.len > 0; mb++) {
    size_t at = (size_t)mb * u.len;
    nn_moe_aux_step_add(u.aux, u.mine + at, u.total + at);
    aux += nn_moe_aux_loss_of(u.aux, u.total + at);
  }
  if (st == STATUS_OK) *loss += nn_moe_aux_coef(u.aux) * aux / M;
  stage_stats_free(&u);
  return st;
}

/* The boundary activation [batch, seq_len, dim] from stage s's rank to stage s + 1's (h on the
 * sender, *h received on the other), when they differ. */
static fsdpc_status_t pass_on(run_t *r, pg_t *g, int s, int P, const data_spec_t *spec,
                              nn_var_t **h) {
  int from = s % P, to = (s + 1) % P;
  if (from == to || (r->pp_rank != from && r->pp_rank != to)) return STATUS_OK;
  pp_step_options_t o = train_pp_options(r);
  int64_t shape[3] = {spec->batch_size, o.shape[1], o.shape[2]};
  fsdpc_tensor_t buf = {0};
  bool send = r->pp_rank == from;
  if (send) {
    FSDPC_TRY(tensor_clone(&buf, &(*h)->value, o.dtype, r->dev)); /* contiguous, the dtype */
  } else {
    FSDPC_TRY(tensor_init(&buf, o.dtype, r->dev, 3, shape));
  }
  pg_p2p_t op = {send, buf.data, (size_t)tensor_numel(&buf), send ? to : from};
  pg_work_t *w = NULL;
  fsdpc_status_t st = pg_send_recv(g, &op, 1, o.dtype, &w);
  if (st == STATUS_OK) st = pg_wait(w);
  if (send || st != STATUS_OK) {
    tensor_free(&buf);
    return st;
  }
  st = nn_var_new(&buf, false, h);
  if (st != STATUS_OK) tensor_free(&buf);
  if (st == STATUS_OK) (*h)->layout = o.layout;
  return st;
}

fsdpc_status_t train_pp_eval(run_t *r, const data_spec_t *spec, int64_t n, bool stoppable,
                             double *sum, train_stop_t *cut, bool *agreed, int64_t *done) {
  *cut = (train_stop_t){0};
  *agreed = false;
  *done = 0;
  double batch_s = 0;
  int P = pp_schedule_ranks(r->pp_sched), S = pp_schedule_stages(r->pp_sched);
  pg_t *g = mesh_group(parallel_pp_mesh(r->par), 0);
  data_spec_t one = *spec;
  one.grad_accum = 1;
  stage_step_t u = {.r = r, .spec = &one};
  nn_ctx_t *ctx = NULL;
  double l = 0;
  /* in[s]: stage s's input at this time (on its rank), out[s]: its output to pass on */
  nn_var_t **in = calloc((size_t)S, sizeof *in), **out = calloc((size_t)S, sizeof *out);
  fsdpc_status_t st =
      in && out ? stage_stats_new(&u, 1) : err_set(STATUS_ENOMEM, "mesh.pp: out of host memory");
  if (st == STATUS_OK) st = nn_ctx_new(&ctx);
  if (st == STATUS_OK) nn_ctx_set_grad_enabled(ctx, false);
  /* a wavefront: at time t stage s runs batch t - s, every rank its stages at once, then the
   * activations pass on, stage by stage in the same order on every rank */
  bool stop = false;
  for (int64_t t = 0; t < n + S - 1 && st == STATUS_OK && !stop; t++) {
    /* the samples this time reads (batch t's ids on the first stage, batch t - S + 1's
     * targets on the last), read and agreed first, then used: a failure or a stop ends it
     * between two times, the same on every rank */
    double tb = device_clock_seconds();
    int64_t f = r->pp_rank == 0 ? t : t - (S - 1);
    bool reads = f >= 0 && f < n && (r->pp_rank == 0 || (S - 1) % P == r->pp_rank);
    fsdpc_tensor_t ids = {0}, tg = {0};
    st = train_eval_agree(r, &one, f, reads, stoppable && t > 0, batch_s, &ids, &tg, cut, agreed);
    stop = train_stop_any(*cut);
    u.ready_ids = reads && r->pp_rank == 0 ? &ids : NULL;
    u.ready_targets = reads && r->pp_rank != 0 ? &tg : NULL;
    for (int s = 0; s < S && st == STATUS_OK && !stop; s++) {
      int64_t b = t - s;
      if (b < 0 || b >= n || s % P != r->pp_rank) continue;
      nn_var_t *x = in[s], *y = NULL;
      in[s] = NULL;
      u.step = b;
      if (s == 0) st = stage_input_from(r->eval, &u, 0, &x);
      if (st == STATUS_OK) st = stage_forward_on(r->eval, ctx, s, 0, x, &y, &u);
      nn_var_put(x);
      double lb = 0;
      if (st == STATUS_OK && s == S - 1) st = llama_loss_read(&y->value, &lb);
      if (st == STATUS_OK && s == S - 1) (*done)++; /* on the last stage's rank */
      l += lb;
      if (s < S - 1)
        out[s] = y;
      else
        nn_var_put(y);
    }
    u.ready_ids = u.ready_targets = NULL;
    tensor_free(&ids);
    tensor_free(&tg);
    for (int s = 0; s < S - 1 && st == STATUS_OK && !stop; s++) {
      int64_t b = t - s;
      if (b < 0 || b >= n) continue;
      nn_var_t *x = out[s];
      out[s] = NULL;
      st = pass_on(r, g, s, P, &one, &x);
      if ((s + 1) % P == r->pp_rank)
        in[s + 1] = x;
      else
        nn_var_put(x);
    }
    batch_s = device_clock_seconds() - tb;
  }
  for (int s = 0; in && out && s < S; s++) {
    nn_var_put(in[s]);
    nn_var_put(out[s]);
  }
  free(in);
  free(out);
  nn_ctx_free(ctx);
  /* the last stage's losses on every pipeline rank: the cross-entropy alone, as without a
   * pipeline */
  if (st == STATUS_OK) st = pg_host_all_reduce(g, &l, &l, 1, PG_HOST_F64, REDUCE_SUM);
  stage_stats_free(&u);
  *sum = l;
  return st;
}
