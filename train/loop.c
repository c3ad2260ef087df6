/* The training loop (loop.c): the steps, their saves, evaluations, metrics lines and
 * progress, and the stops; beside the set-up in trainer.c. */
#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint/train_ckpt.h"
#include "core/file.h"
#include "mesh/world.h"
#include "nn/moe.h"
#include "train/llama_cost.h"
#include "train/metrics_impl.h"
#include "train/ops_impl.h"
#include "train/plan.h"
#include "train/plot.h"
#include "train/run_impl.h"
#include "train/save_impl.h"

/* The plan a checkpoint is saved under, as train_state.json's saved_under (caller frees);
 * eval_pending: its step's evaluation was skipped by a stop (the resume makes it); line (may be
 * NULL): the step's metrics line, which a resume writes if the metrics file lost it. */
static fsdpc_status_t saved_under(const run_t *r, bool eval_pending, const cJSON *line,
                                  char **out) {
  const fsdpc_plan_t *p = &r->plan;
  char *model_text = NULL;
  FSDPC_TRY(train_describe_model(r, &model_text));
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
  int mguard; /* the rollback's hold on the file that keeps mpath's name meanwhile, or -1 */
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
  train_stop_t eval_stop; /* what ended the step's evaluation, agreed (train_stop_any: the
                           * stop saves it as pending) */
  train_stop_t stop;
} step_out_t;

/* x as printed: a NaN without the sign %g would give it ("-nan"), which means nothing. */
static double unsigned_nan(double x) { return isnan(x) ? fabs(x) : x; }

/* This rank's share of the run's data order. */
data_spec_t train_spec_of(const run_t *r) {
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
  L->mguard = -1;
  L->spec = train_spec_of(r);
  L->completed = L->asked = r->start_step;
  L->sched = (lr_schedule_t){
      .warmup_steps = p->warmup_steps, .total_steps = p->steps, .min_ratio = p->min_lr_ratio};
  L->mpath = train_metrics_path(r);
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
                                  rollback ? L->mtmp : NULL, sizeof L->mtmp, &L->mguard)) == NULL)
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
    if (L->mguard >= 0) close(L->mguard);
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
  fsdpc_status_t st = pg_agree(
      world_pg(), train_check_samples(r->data, &L->spec, o->s, p->grad_accum, "data.path"));
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

/* Whether an evaluation follows step done (of those trained): every eval.interval steps and
 * after the last. */
static bool eval_due(const run_t *r, int64_t done) {
  const fsdpc_plan_t *p = &r->plan;
  return r->eval != NULL &&
         ((p->eval_interval > 0 && done % p->eval_interval == 0) || done == p->steps);
}

/* Step, the ranks' agreement: the loss, a save's state and the stop requests in one sum; a
 * non-finite step stops the run (every rank alike) unless train.nonfinite skips it. */
static fsdpc_status_t step_agree(run_t *r, loop_t *L, step_out_t *o) {
  const fsdpc_plan_t *p = &r->plan;
  double t = device_clock_seconds(), step_est = t - o->t0 > L->step_max ? t - o->t0 : L->step_max;
  double save_s = L->saver.last_s > 0 ? L->saver.last_s : step_est;
  /* and the evaluation due after this step, which a run that goes on makes first; after the
   * last step, that evaluation alone (the step is saved whatever happens: with its
   * evaluation pending, the run stops before making it) */
  bool last = o->s + 1 >= p->steps;
  double eval_s = eval_due(r, o->s + 1) ? train_eval_estimate(r, step_est) : 0;
  bool time_up = p->time_limit_s > 0 && (last ? eval_s > 0 : true) &&
                 t - r->t_launch + eval_s + (last ? 0 : step_est) + save_s > p->time_limit_s;
  o->sums[0] = o->loss;
  train_save_values(&L->saver, o->sums + 1); /* an asynchronous save: written, failed */
  int nsums = 3 + train_stop_values(p, time_up, o->sums + 3);
  FSDPC_TRY(pg_host_all_reduce(world_pg(), o->sums, o->sums, nsums, PG_HOST_F64, REDUCE_SUM));
  o->loss = o->sums[0] / world_size(); /* the ranks of one tp group hold the same loss */
  o->stop = train_stop_of(p, o->sums + 3);
  o->stopping = last ? o->stop.time_limit : train_stop_any(o->stop);
  if (last) o->stop.signal = 0; /* the run ends with this step anyway */
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
  if (!L->mtmp[0] && L->mguard >= 0) { /* the name is the run's file now, or the old one's */
    close(L->mguard);
    L->mguard = -1;
  }
}

/* train_evaluate() with its own peak memory into *peak, its collectives left out of the next step's
 * counts. */
static fsdpc_status_t evaluate_measured(run_t *r, const data_spec_t *spec, bool stoppable,
                                        train_eval_t *ev, size_t *peak) {
  mem_reset_peak(r->dev);
  fsdpc_status_t st = train_evaluate(r, spec, stoppable, ev);
  *peak = mem_stats(r->dev).peak;
  train_counted_bytes(r);
  return st;
}

/* Evaluate: after every eval.interval steps and after the last. A sample that cannot be read
 * now stops the run with the step saved; a signal of train.signals ends the evaluation, the
 * stop (step_stop_late) saving the step with its evaluation pending. */
static fsdpc_status_t step_evaluate(run_t *r, loop_t *L, step_out_t *o) {
  o->eval_now = !o->stopping && eval_due(r, o->s + 1);
  if (!o->eval_now) return STATUS_OK;
  train_eval_t ev;
  fsdpc_status_t st = evaluate_measured(r, &L->spec, true, &ev, &o->eval_peak);
  if (st != STATUS_OK && ev.agreed) L->agreed = L->keep = true;
  o->eval_loss = ev.loss;
  o->eval_stop = ev.stop;
  o->eval_now = st == STATUS_OK && !train_stop_any(ev.stop);
  return st;
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
        L->tty ? "\r\033[K" : "", (long long)(s + 1), (long long)p->steps, unsigned_nan(o->loss),
        p->optim.lr * o->factor, unsigned_nan(o->norm), moe, o->tps, pm, eta);
  } else if (L->tty) { /* live progress on a terminal */
    int w = 30, done = (int)((double)w * (double)(s + 1) / (double)p->steps);
    printf("\r[%.*s%*s] %lld/%lld  loss %.4f  %.0f tok/s  ETA %.0fs", done,
           "##############################", w - done, "", (long long)(s + 1), (long long)p->steps,
           o->loss, o->tps, eta);
  }
  if (o->eval_now) train_eval_line(r, s + 1, o->eval_loss, L->tty && !show ? "\r\033[K" : "");
  fflush(stdout);
}

/* A signal of train.signals that came while the step saved or evaluated: agreed now (the
 * step's own agreement came before), so the run stops at this step, saved (an asynchronous
 * save of it committed first), not after another step and another save. */
static fsdpc_status_t step_stop_late(run_t *r, loop_t *L, step_out_t *o) {
  const fsdpc_plan_t *p = &r->plan;
  int64_t done = o->s + 1;
  bool saved = p->ckpt_dir[0] && L->asked == done;
  /* (the same on every rank); after the last step only a signal that cut its evaluation
   * short stops the run: saved already, it exits as stopped, the evaluation to be made */
  bool cut = train_stop_any(o->eval_stop);
  if (o->stopping || !(saved || o->eval_now || cut) || (done >= p->steps && !cut)) return STATUS_OK;
  if (!cut && p->n_signals == 0) return STATUS_OK;
  /* an evaluation cut short says why, agreed already; else the signals are agreed now */
  double v[1 + PLAN_MAX_SIGNALS];
  int n = cut ? 0 : train_stop_values(p, false, v);
  fsdpc_status_t st =
      n ? pg_host_all_reduce(world_pg(), v, v, n, PG_HOST_F64, REDUCE_SUM) : STATUS_OK;
  train_stop_t stop = cut               ? o->eval_stop
                      : st == STATUS_OK ? train_stop_of(p, v)
                                        : (train_stop_t){0};
  if (!train_stop_any(stop)) return st;
  o->stopping = true;
  o->stop = stop;
  if (p->ckpt_dir[0] && done < p->steps)
    st = saved ? train_save_finish(&L->saver, r) : save_step_of(r, L, o, true, cut);
  /* saved before its evaluation, which the signal cut short: the checkpoint says it pends */
  if (st == STATUS_OK && saved && cut) {
    char dir[PLAN_PATH_MAX + 32];
    ckpt_step_dir(p->ckpt_dir, done, dir, sizeof dir);
    st = pg_agree(world_pg(), world_rank() == 0 ? train_mark_eval_pending(dir) : STATUS_OK);
  }
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
  if (L->mguard >= 0) close(L->mguard);
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
  const char *mpath = train_metrics_path(r);
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
  data_spec_t spec = train_spec_of(r);
  train_eval_t ev;
  size_t peak;
  *patch = NULL;
  double began = device_clock_seconds() - r->t_launch; /* the start-up every run repeats */
  FSDPC_TRY(evaluate_measured(r, &spec, true, &ev, &peak));
  /* cut by the time limit: every resume repeats the start-up and this evaluation and would be
   * cut the same way (exit 75 requeued for ever) */
  double v[3] = {ev.done > 0 ? ev.secs * (double)ev.forwards / (double)ev.done : 0, began,
                 (double)ev.done};
  FSDPC_TRY(pg_host_all_reduce(world_pg(), v, v, 3, PG_HOST_F64, REDUCE_MAX)); /* one verdict */
  double whole = v[0];
  began = v[1];
  if (train_stop_any(ev.stop) && ev.stop.signal == 0)
    return err_set(STATUS_EINVAL,
                   "the evaluation of step %lld, which the run makes first, was cut by "
                   "train.time_limit (%g s): it takes about %.0f s (%lld of its %lld forwards in "
                   "%.1f s) after a start-up of %.0f s, and every resume would repeat both; raise "
                   "train.time_limit or lower eval.batches",
                   (long long)r->start_step, r->plan.time_limit_s, whole, (long long)v[2],
                   (long long)ev.forwards, ev.secs, began);
  if (train_stop_any(ev.stop)) { /* stopped as a step would be: the checkpoint as it was */
    r->stopped_by = ev.stop.signal;
    r->timed_out = ev.stop.signal == 0;
    char why[96];
    if (ev.stop.signal)
      snprintf(why, sizeof why, "interrupted by %s", train_signal_name(ev.stop.signal));
    else
      snprintf(why, sizeof why, "stopped before train.time_limit (%g s)", r->plan.time_limit_s);
    if (world_rank() == 0)
      printf(
          "%s during the evaluation of step %lld, which the run makes first: stopping "
          "before any step, the checkpoint as it was (resume with checkpoint.load: auto)\n",
          why, (long long)r->start_step);
    return STATUS_OK;
  }
  double eval_loss = ev.loss;
  if (world_rank() == 0) train_eval_line(r, r->start_step, eval_loss, "");
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
  if (r->stopped_by || r->timed_out) return STATUS_OK; /* cut short: to be made again */
  /* checkpoint.keep, which a kill during the last save's pruning left undone: the run resumed
   * the newest checkpoint (auto), so the newest are those a finished run keeps */
  if (world_rank() == 0 && p->ckpt_keep > 0 && strcmp(p->ckpt_load, "auto") == 0 &&
      ckpt_prune(p->ckpt_dir, (int)p->ckpt_keep) != STATUS_OK) {
    fprintf(stderr, "%s: warning: checkpoint.keep: %s\n", train_prog(), err_detail());
    err_clear();
  }
  bool lost = !seen->line ? r->saved_line != NULL : patch != NULL && !seen->eval;
  if (world_rank() == 0 && seen->file && seen->last <= (double)r->start_step && lost) {
    FILE *f = train_metrics_open(train_metrics_path(r), r->start_step, seen->eval ? NULL : patch,
                                 r->saved_line, NULL, 0, NULL);
    if (f == NULL || fclose(f) != 0)
      fprintf(stderr, "%s: warning: cannot write step %lld's line into the metrics file '%s': %s\n",
              train_prog(), (long long)r->start_step, train_metrics_path(r), strerror(errno));
  }
  cJSON_Delete(patch);
  return STATUS_OK;
}

fsdpc_status_t train_loop(run_t *r) {
  const fsdpc_plan_t *p = &r->plan;
  train_metrics_seen_t seen = {0};
  bool eval_first;
  FSDPC_TRY(resume_eval_needed(r, &seen, &eval_first));
  if (r->start_step >= p->steps) return evaluate_saved(r, &seen); /* before the file is touched */
  /* the evaluation of the step resumed from, which the run that saved it did not make */
  cJSON *patch = NULL;
  if (eval_first && eval_due(r, r->start_step)) FSDPC_TRY(evaluate_start(r, &patch));
  if (r->stopped_by || r->timed_out) return STATUS_OK; /* cut short: to be made again */
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
