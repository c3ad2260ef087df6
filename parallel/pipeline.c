/* Pipeline execution: a step's actions on this rank, activations and gradients point to point. */
#include "parallel/pipeline.h"

#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/device.h"
#include "mesh/world.h"
#include "nn/ops.h"

/* ---- the order of messages between two ranks ---- */

/* The message action a of rank r sends: to *peer, identified by (*stage, *mb, *grad) as the
 * stage that receives it; false when a sends nothing. */
static bool sends(const pp_schedule_t *s, pp_action_t a, int *peer, int *stage, bool *grad) {
  int S = pp_schedule_ranks(s) * pp_schedule_stages_per_rank(s);
  if (a.kind == PP_FORWARD && a.stage < S - 1) {
    *stage = a.stage + 1;
    *grad = false;
  } else if (a.kind == PP_BACKWARD && a.stage > 0) {
    *stage = a.stage - 1;
    *grad = true;
  } else {
    return false;
  }
  *peer = pp_schedule_rank_of_stage(s, *stage);
  return true;
}

/* The message action a receives: from *peer, for stage a.stage; false when none. */
static bool receives(const pp_schedule_t *s, pp_action_t a, int *peer) {
  int S = pp_schedule_ranks(s) * pp_schedule_stages_per_rank(s);
  if (a.kind == PP_FORWARD && a.stage > 0)
    *peer = pp_schedule_rank_of_stage(s, a.stage - 1);
  else if (a.kind == PP_BACKWARD && a.stage < S - 1)
    *peer = pp_schedule_rank_of_stage(s, a.stage + 1);
  else
    return false;
  return true;
}

fsdpc_status_t pp_schedule_check_order(const pp_schedule_t *s) {
  ARG_NONNULL(s);
  int P = pp_schedule_ranks(s);
  for (int from = 0; from < P; from++)
    for (int to = 0; to < P; to++) {
      if (from == to) continue;
      /* the k-th message from -> to, in from's order, must be what to's k-th receive from
       * `from` expects */
      int i = 0, n_from = pp_schedule_num_actions(s, from), n_to = pp_schedule_num_actions(s, to);
      for (int j = 0; j < n_to; j++) {
        pp_action_t want = pp_schedule_action(s, to, j);
        int peer;
        if (!receives(s, want, &peer) || peer != from) continue;
        int dst = -1, stage = -1;
        bool grad = false;
        pp_action_t got = {0};
        for (; i < n_from; i++) {
          got = pp_schedule_action(s, from, i);
          if (sends(s, got, &dst, &stage, &grad) && dst == to) break;
        }
        bool match = i < n_from && stage == want.stage && got.microbatch == want.microbatch &&
                     grad == (want.kind == PP_BACKWARD);
        if (!match)
          return err_set(STATUS_EINVAL,
                         "pipeline: %s on %d ranks: rank %d's %s of stage %d, microbatch %d, "
                         "would receive another message from rank %d (messages between two "
                         "ranks match in the order they are sent)",
                         pp_schedule_name(pp_schedule_kind(s)), P, to,
                         want.kind == PP_FORWARD ? "forward" : "backward", want.stage,
                         want.microbatch, from);
        i++;
      }
    }
  return STATUS_OK;
}

/* ---- a step ---- */

typedef struct mb {
  nn_ctx_t *ctx;
  nn_var_t *in, *out;
} mb_t;

/* Sends in flight and the tensors they read, until the step's end. */
typedef struct inflight {
  pg_work_t **work;
  fsdpc_tensor_t *keep;
  int n, cap;
} inflight_t;

static int64_t boundary_numel(const pp_step_options_t *o) {
  int64_t n = 1;
  for (int d = 0; d < o->ndim; d++) n *= o->shape[d];
  return n;
}

static fsdpc_status_t check_boundary(const pp_step_options_t *o, const fsdpc_tensor_t *t, int stage,
                                     const char *what) {
  bool same = t->ndim == o->ndim && t->dtype == o->dtype && device_equal(t->device, o->device);
  for (int d = 0; same && d < o->ndim; d++) same = t->shape[d] == o->shape[d];
  if (same) return STATUS_OK;
  char a[96], b[96];
  return err_set(
      STATUS_ESHAPE, "pipeline: stage %d's %s is %s %s, the boundary's %s %s (pp_step_options_t)",
      stage, what, tensor_shape_str(t->ndim, t->shape, a, sizeof a), dtype_name(t->dtype),
      tensor_shape_str(o->ndim, o->shape, b, sizeof b), dtype_name(o->dtype));
}

/* Sends t (a boundary tensor of stage) to peer without waiting. */
static fsdpc_status_t send_to(const pp_step_options_t *o, inflight_t *f, const fsdpc_tensor_t *t,
                              int stage, const char *what, int peer) {
  FSDPC_TRY(check_boundary(o, t, stage, what));
  if (f->n == f->cap) {
    int cap = f->cap ? 2 * f->cap : 16;
    pg_work_t **w = realloc(f->work, sizeof *w * (size_t)cap);
    if (w != NULL) f->work = w;
    fsdpc_tensor_t *k = w != NULL ? realloc(f->keep, sizeof *k * (size_t)cap) : NULL;
    if (k == NULL) return err_set(STATUS_ENOMEM, "pipeline: out of host memory");
    f->keep = k;
    f->cap = cap;
  }
  fsdpc_tensor_t *keep = &f->keep[f->n];
  FSDPC_TRY(tensor_is_contiguous(t) ? tensor_ref(keep, t)
                                    : tensor_clone(keep, t, t->dtype, t->device));
  pg_p2p_t op = {.send = true, .buf = keep->data, .count = (size_t)tensor_numel(t), .peer = peer};
  fsdpc_status_t st = pg_send_recv(o->group, &op, 1, o->dtype, &f->work[f->n]);
  if (st != STATUS_OK) {
    tensor_free(keep);
    return st;
  }
  f->n++;
  return STATUS_OK;
}

static fsdpc_status_t recv_from(const pp_step_options_t *o, int peer, fsdpc_tensor_t *out) {
  FSDPC_TRY(tensor_init(out, o->dtype, o->device, o->ndim, o->shape));
  pg_p2p_t op = {.send = false, .buf = out->data, .count = (size_t)boundary_numel(o), .peer = peer};
  pg_work_t *w = NULL;
  double t0 = device_clock_seconds();
  fsdpc_status_t st = pg_send_recv(o->group, &op, 1, o->dtype, &w);
  if (st == STATUS_OK) st = pg_wait(w);
  if (o->stats) o->stats->wait_seconds += device_clock_seconds() - t0;
  if (st != STATUS_OK) tensor_free(out);
  return st;
}

static fsdpc_status_t finish_sends(inflight_t *f) {
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < f->n; i++) {
    fsdpc_status_t s2 = pg_wait(f->work[i]);
    if (st == STATUS_OK) st = s2;
    tensor_free(&f->keep[i]);
  }
  free(f->work);
  free(f->keep);
  memset(f, 0, sizeof *f);
  return st;
}

static void mb_free(mb_t *b) {
  nn_var_put(b->out);
  nn_var_put(b->in);
  nn_ctx_free(b->ctx);
  memset(b, 0, sizeof *b);
}

/* F(stage, m): its input (stage 0's from the caller, else received), the forward, then the
 * output sent on, or on the last stage the loss added to *sum. */
static fsdpc_status_t run_forward(const pp_step_options_t *o, inflight_t *f, pp_action_t a, mb_t *b,
                                  double *sum) {
  const pp_schedule_t *s = o->schedule;
  int peer;
  if (receives(s, a, &peer)) {
    fsdpc_tensor_t t;
    FSDPC_TRY(recv_from(o, peer, &t));
    FSDPC_TRY(nn_var_new(&t, true, &b->in)); /* its gradient goes back to the previous stage */
  } else {
    FSDPC_TRY(o->input(a.microbatch, &b->in, o->user));
  }
  FSDPC_TRY(nn_ctx_new(&b->ctx));
  FSDPC_TRY(o->forward(b->ctx, a.stage, a.microbatch, b->in, &b->out, o->user));
  int stage;
  bool grad;
  if (sends(s, a, &peer, &stage, &grad))
    return send_to(o, f, &b->out->value, a.stage, "output", peer);
  if (tensor_numel(&b->out->value) != 1)
    return err_set(STATUS_ESHAPE, "pipeline: the last stage's output (the loss) has %lld elements",
                   (long long)tensor_numel(&b->out->value));
  double v;
  FSDPC_TRY(nn_var_scalar(b->out, &v));
  *sum += v;
  return STATUS_OK;
}

/* B(stage, m): backward from loss / M on the last stage, else from the received gradient of
 * the output; the input's gradient sent back (but on stage 0); the microbatch's tape freed. */
static fsdpc_status_t run_backward(const pp_step_options_t *o, inflight_t *f, pp_action_t a,
                                   mb_t *b) {
  const pp_schedule_t *s = o->schedule;
  int peer, stage;
  bool grad;
  if (b->ctx == NULL)
    return err_set(STATUS_EINVAL,
                   "pipeline: backward of stage %d, microbatch %d, before its forward", a.stage,
                   a.microbatch);
  if (receives(s, a, &peer)) {
    fsdpc_tensor_t g;
    FSDPC_TRY(recv_from(o, peer, &g));
    FSDPC_TRY(nn_backward_grad(b->ctx, b->out, &g));
  } else {
    nn_var_t *scaled = NULL;
    fsdpc_status_t st =
        nn_scale(b->ctx, b->out, 1.0 / (double)pp_schedule_microbatches(s), &scaled);
    if (st == STATUS_OK) st = nn_backward(b->ctx, scaled);
    nn_var_put(scaled);
    FSDPC_TRY(st);
  }
  fsdpc_status_t st = STATUS_OK;
  if (sends(s, a, &peer, &stage, &grad)) {
    if (!nn_var_has_grad(b->in))
      st = err_set(STATUS_EINVAL,
                   "pipeline: stage %d's input got no gradient (its output does not depend on it)",
                   a.stage);
    else
      st = send_to(o, f, &b->in->grad, a.stage, "input gradient", peer);
  }
  mb_free(b);
  return st;
}

static fsdpc_status_t check_options(const pp_step_options_t *o) {
  ARG_NONNULL(o);
  if (o->group == NULL || o->schedule == NULL || o->forward == NULL)
    return err_set(STATUS_EINVAL, "pipeline: a group, a schedule and a forward are required");
  /* a send that waits for its receiver (host-staged groups move data as a blocking exchange,
   * NCCL's send holds its stream) would meet a neighbour's own send in 1f1b's steady state */
  if (strcmp(pg_backend_name(o->group), "mpi") != 0)
    return err_set(STATUS_EINVAL,
                   "pipeline: point-to-point over a %s process group waits for the receiver at "
                   "each send; pipeline steps run over MPI groups (on the CPU, FSDPC_PG=native) "
                   "for now",
                   pg_backend_name(o->group));
  if (pp_schedule_ranks(o->schedule) != pg_size(o->group))
    return err_set(STATUS_EINVAL, "pipeline: the schedule is for %d ranks, the group has %d",
                   pp_schedule_ranks(o->schedule), pg_size(o->group));
  if (o->input == NULL && pp_schedule_rank_of_stage(o->schedule, 0) == pg_rank(o->group))
    return err_set(STATUS_EINVAL, "pipeline: the rank of stage 0 needs an input function");
  if (o->ndim < 1 || o->ndim > TENSOR_MAX_DIMS)
    return err_set(STATUS_EINVAL, "pipeline: a boundary of %d dimensions", o->ndim);
  return pp_schedule_check_order(o->schedule);
}

/* The microbatches whose tapes are kept now. */
static int tapes_kept(const mb_t *mbs, int n) {
  int k = 0;
  for (int i = 0; i < n; i++) k += mbs[i].ctx != NULL;
  return k;
}

fsdpc_status_t pp_step(const pp_step_options_t *o, double *loss) {
  if (loss) *loss = 0.0;
  FSDPC_TRY(check_options(o)); /* the same verdict on every rank */
  const pp_schedule_t *s = o->schedule;
  int P = pp_schedule_ranks(s), V = pp_schedule_stages_per_rank(s);
  int M = pp_schedule_microbatches(s), r = pg_rank(o->group), S = P * V;
  mb_t *mbs = calloc((size_t)(V * M), sizeof *mbs);
  /* from here a rank that fails alone would leave its neighbours waiting: it stops the job */
  if (mbs == NULL) return world_stop(err_set(STATUS_ENOMEM, "pipeline: out of host memory"));
  inflight_t f = {0};
  double sum = 0, t0 = device_clock_seconds();
  if (o->stats) *o->stats = (pp_step_stats_t){0};
  fsdpc_status_t st = STATUS_OK;
  for (int i = 0; i < pp_schedule_num_actions(s, r) && st == STATUS_OK; i++) {
    pp_action_t a = pp_schedule_action(s, r, i);
    mb_t *b = &mbs[(a.stage / P) * M + a.microbatch];
    st = a.kind == PP_FORWARD ? run_forward(o, &f, a, b, &sum) : run_backward(o, &f, a, b);
    int kept = tapes_kept(mbs, V * M);
    if (o->stats && kept > o->stats->max_in_flight) o->stats->max_in_flight = kept;
  }
  double t1 = device_clock_seconds();
  fsdpc_status_t s2 = finish_sends(&f);
  if (st == STATUS_OK) st = s2;
  if (o->stats) {
    o->stats->wait_seconds += device_clock_seconds() - t1;
    o->stats->seconds = device_clock_seconds() - t0;
  }
  for (int i = 0; i < V * M; i++) mb_free(&mbs[i]);
  free(mbs);
  /* the loss lives on the last stage's rank: every rank learns the mean */
  double mine = pp_schedule_rank_of_stage(s, S - 1) == r ? sum / M : 0.0;
  if (st == STATUS_OK) st = pg_host_all_reduce(o->group, &mine, &mine, 1, PG_HOST_F64, REDUCE_SUM);
  if (st != STATUS_OK) return world_stop(st);
  if (loss) *loss = mine;
  return STATUS_OK;
}

uint64_t pp_step_send_bytes(const pp_step_options_t *o, int rank) {
  if (o == NULL || o->schedule == NULL) return 0;
  const pp_schedule_t *s = o->schedule;
  uint64_t n = 0, each = (uint64_t)boundary_numel(o) * dtype_size(o->dtype);
  for (int i = 0; i < pp_schedule_num_actions(s, rank); i++) {
    int peer, stage;
    bool grad;
    if (sends(s, pp_schedule_action(s, rank, i), &peer, &stage, &grad) && peer != rank) n += each;
  }
  return n;
}
