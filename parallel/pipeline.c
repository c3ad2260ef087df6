/* Pipeline execution: a step's actions on this rank, activations and gradients point to point. */
#include "parallel/pipeline.h"

#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "core/device.h"
#include "mesh/world.h"
#include "nn/ops.h"

/* ---- a step ---- */

/* A step runs in lockstep slots (pp_schedule_slots): in each, every rank runs the action the
 * table gives it there, if any, then takes part in one exchange with its neighbours: the
 * message its action made leaves, the messages its neighbours' actions of that slot made for
 * it arrive. Every message is consumed in a later slot, so no exchange waits on another and no
 * backend can deadlock, whether its sends leave alone (MPI) or wait for their receivers (NCCL,
 * the host-staged groups). */

typedef struct mb {
  nn_ctx_t *ctx;
  nn_var_t *in, *out;
} mb_t;

/* Whether action a makes a message (of S stages): every forward's output but the last
 * stage's, every backward's input gradient but stage 0's. */
static bool makes_message(pp_action_t a, int S) {
  return a.kind == PP_FORWARD ? a.stage < S - 1 : a.stage > 0;
}

/* The action that consumes what a makes: F(s + 1, m) for F(s, m), B(s - 1, m) for B(s, m). */
static pp_action_t consumer(pp_action_t a) {
  return a.kind == PP_FORWARD ? (pp_action_t){PP_FORWARD, a.stage + 1, a.microbatch}
                              : (pp_action_t){PP_BACKWARD, a.stage - 1, a.microbatch};
}

/* The slot of the mailbox for what action a consumes. */
static int mail_slot(int S, int M, pp_action_t a) {
  return (a.kind == PP_BACKWARD ? S * M : 0) + a.stage * M + a.microbatch;
}

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

/* *out: t, a boundary tensor of stage, to send (contiguous). */
static fsdpc_status_t outgoing(const pp_step_options_t *o, const fsdpc_tensor_t *t, int stage,
                               const char *what, fsdpc_tensor_t *out) {
  FSDPC_TRY(check_boundary(o, t, stage, what));
  return tensor_is_contiguous(t) ? tensor_ref(out, t) : tensor_clone(out, t, t->dtype, t->device);
}

/* What action a consumes from the mailbox (moved out), or an error naming it. */
static fsdpc_status_t take_mail(fsdpc_tensor_t *mail, int S, int M, pp_action_t a,
                                fsdpc_tensor_t *out) {
  fsdpc_tensor_t *m = &mail[mail_slot(S, M, a)];
  if (m->storage == NULL)
    return err_set(STATUS_EINVAL, "pipeline: the %s of stage %d, microbatch %d, has not arrived",
                   a.kind == PP_FORWARD ? "input" : "output gradient", a.stage, a.microbatch);
  *out = *m;
  memset(m, 0, sizeof *m);
  return STATUS_OK;
}

static void mb_free(mb_t *b) {
  nn_var_put(b->out);
  nn_var_put(b->in);
  nn_ctx_free(b->ctx);
  memset(b, 0, sizeof *b);
}

/* F(stage, m): its input (stage 0's from the caller, else from the mailbox), the forward, then
 * *send: the output for the next stage, or on the last stage the loss added to *sum. */
static fsdpc_status_t run_forward(const pp_step_options_t *o, fsdpc_tensor_t *mail, pp_action_t a,
                                  mb_t *b, double *sum, fsdpc_tensor_t *send) {
  int S = pp_schedule_stages(o->schedule);
  int M = pp_schedule_microbatches(o->schedule);
  if (a.stage > 0) {
    fsdpc_tensor_t t;
    FSDPC_TRY(take_mail(mail, S, M, a, &t));
    FSDPC_TRY(nn_var_new(&t, true, &b->in)); /* its gradient goes back to the previous stage */
    b->in->layout = o->layout;
  } else {
    FSDPC_TRY(o->input(a.microbatch, &b->in, o->user));
  }
  FSDPC_TRY(nn_ctx_new(&b->ctx));
  FSDPC_TRY(o->forward(b->ctx, a.stage, a.microbatch, b->in, &b->out, o->user));
  if (makes_message(a, S)) return outgoing(o, &b->out->value, a.stage, "output", send);
  if (tensor_numel(&b->out->value) != 1)
    return err_set(STATUS_ESHAPE, "pipeline: the last stage's output (the loss) has %lld elements",
                   (long long)tensor_numel(&b->out->value));
  double v;
  FSDPC_TRY(nn_var_scalar(b->out, &v));
  *sum += v;
  return STATUS_OK;
}

/* B(stage, m): backward from loss / M on the last stage, else from the output's gradient in
 * the mailbox; *send: the input's gradient for the previous stage (but on stage 0); the
 * microbatch's tape freed. */
static fsdpc_status_t run_backward(const pp_step_options_t *o, fsdpc_tensor_t *mail, pp_action_t a,
                                   mb_t *b, fsdpc_tensor_t *send) {
  int S = pp_schedule_stages(o->schedule);
  int M = pp_schedule_microbatches(o->schedule);
  if (b->ctx == NULL)
    return err_set(STATUS_EINVAL,
                   "pipeline: backward of stage %d, microbatch %d, before its forward", a.stage,
                   a.microbatch);
  if (o->before_backward) FSDPC_TRY(o->before_backward(a.stage, a.microbatch, o->user));
  if (a.stage < S - 1) {
    fsdpc_tensor_t g;
    FSDPC_TRY(take_mail(mail, S, M, a, &g));
    FSDPC_TRY(nn_backward_grad(b->ctx, b->out, &g));
  } else {
    nn_var_t *scaled = NULL;
    fsdpc_status_t st = nn_scale(b->ctx, b->out, 1.0 / (double)M, &scaled);
    if (st == STATUS_OK) st = nn_backward(b->ctx, scaled);
    nn_var_put(scaled);
    FSDPC_TRY(st);
  }
  fsdpc_status_t st = STATUS_OK;
  if (makes_message(a, S)) {
    if (!nn_var_has_grad(b->in))
      st = err_set(STATUS_EINVAL,
                   "pipeline: stage %d's input got no gradient (its output does not depend on it)",
                   a.stage);
    else
      st = outgoing(o, &b->in->grad, a.stage, "input gradient", send);
  }
  mb_free(b);
  return st;
}

static fsdpc_status_t check_options(const pp_step_options_t *o) {
  ARG_NONNULL(o);
  if (o->group == NULL || o->schedule == NULL || o->forward == NULL)
    return err_set(STATUS_EINVAL, "pipeline: a group, a schedule and a forward are required");
  if (pp_schedule_ranks(o->schedule) != pg_size(o->group))
    return err_set(STATUS_EINVAL, "pipeline: the schedule is for %d ranks, the group has %d",
                   pp_schedule_ranks(o->schedule), pg_size(o->group));
  if (o->input == NULL && pp_schedule_rank_of_stage(o->schedule, 0) == pg_rank(o->group))
    return err_set(STATUS_EINVAL, "pipeline: the rank of stage 0 needs an input function");
  if (o->ndim < 1 || o->ndim > TENSOR_MAX_DIMS)
    return err_set(STATUS_EINVAL, "pipeline: a boundary of %d dimensions", o->ndim);
  return STATUS_OK;
}

/* The microbatches whose tapes are kept now. */
static int tapes_kept(const mb_t *mbs, int n) {
  int k = 0;
  for (int i = 0; i < n; i++) k += mbs[i].ctx != NULL;
  return k;
}

/* A step's state on this rank. */
typedef struct step_state {
  mb_t *mbs;            /* V M: this rank's stages' microbatches */
  fsdpc_tensor_t *mail; /* 2 S M: what arrived for later actions */
  int *slot, *next;     /* every rank's actions' slots; each rank's next action */
  int *forwarded;       /* per slot: the microbatch the last stage's forward ran, or -1 */
} step_state_t;

static void state_free(step_state_t *x, int n_mbs, int n_mail) {
  for (int i = 0; x->mbs && i < n_mbs; i++) mb_free(&x->mbs[i]);
  for (int i = 0; x->mail && i < n_mail; i++) tensor_free(&x->mail[i]);
  free(x->mbs);
  free(x->mail);
  free(x->slot);
  free(x->next);
  free(x->forwarded);
}

/* x->forwarded from the slots of the last stage's rank (every rank has n actions). */
static fsdpc_status_t mark_forwarded(const pp_schedule_t *s, step_state_t *x, int n, int slots) {
  int S = pp_schedule_stages(s), L = pp_schedule_rank_of_stage(s, S - 1);
  x->forwarded = malloc(sizeof(int) * (size_t)(slots > 0 ? slots : 1));
  if (x->forwarded == NULL) return err_set(STATUS_ENOMEM, "pipeline: out of host memory");
  for (int t = 0; t < slots; t++) x->forwarded[t] = -1;
  for (int i = 0; i < n; i++) {
    pp_action_t a = pp_schedule_action(s, L, i);
    if (a.kind == PP_FORWARD && a.stage == S - 1) x->forwarded[x->slot[L * n + i]] = a.microbatch;
  }
  return STATUS_OK;
}

/* Slot t's exchange: send (to peer), and every message a neighbour's action of slot t makes
 * for this rank, received into the mailbox; then each rank's action of slot t is done. */
static fsdpc_status_t exchange(const pp_step_options_t *o, step_state_t *x, int t,
                               fsdpc_tensor_t *send, int peer) {
  const pp_schedule_t *s = o->schedule;
  int P = pp_schedule_ranks(s), S = P * pp_schedule_stages_per_rank(s);
  int M = pp_schedule_microbatches(s), n = pp_schedule_num_actions(s, 0), r = pg_rank(o->group);
  /* its own message, and one from each rank holding a stage next to one of its own: the
   * ranks before and after it */
  pg_p2p_t ops[3];
  int k = 0;
  size_t count = (size_t)boundary_numel(o);
  fsdpc_status_t st = STATUS_OK;
  if (send->storage != NULL) {
    ops[k++] = (pg_p2p_t){.send = true, .buf = send->data, .count = count, .peer = peer};
  }
  for (int q = 0; q < P && st == STATUS_OK; q++) {
    if (x->next[q] >= n || x->slot[q * n + x->next[q]] != t) continue;
    pp_action_t a = pp_schedule_action(s, q, x->next[q]++);
    if (q == r || !makes_message(a, S) || pp_schedule_rank_of_stage(s, consumer(a).stage) != r)
      continue;
    fsdpc_tensor_t *m = &x->mail[mail_slot(S, M, consumer(a))];
    if (k == 3) st = err_set(STATUS_EINVAL, "pipeline: more than 3 messages in one slot");
    if (st == STATUS_OK) st = tensor_init(m, o->dtype, o->device, o->ndim, o->shape);
    if (st == STATUS_OK)
      ops[k++] = (pg_p2p_t){.send = false, .buf = m->data, .count = count, .peer = q};
  }
  if (st != STATUS_OK || k == 0) return st;
  pg_work_t *w = NULL;
  double t0 = device_clock_seconds();
  st = pg_send_recv(o->group, ops, k, o->dtype, &w);
  if (st == STATUS_OK) st = pg_wait(w);
  if (o->stats) o->stats->wait_seconds += device_clock_seconds() - t0;
  return st;
}

fsdpc_status_t pp_step(const pp_step_options_t *o, double *loss) {
  if (loss) *loss = 0.0;
  FSDPC_TRY(check_options(o)); /* the same verdict on every rank */
  const pp_schedule_t *s = o->schedule;
  int P = pp_schedule_ranks(s), V = pp_schedule_stages_per_rank(s);
  int M = pp_schedule_microbatches(s), r = pg_rank(o->group), S = P * V;
  int n = pp_schedule_num_actions(s, r), slots = 0;
  step_state_t x = {.mbs = calloc((size_t)(V * M), sizeof(mb_t)),
                    .mail = calloc((size_t)(2 * S * M), sizeof(fsdpc_tensor_t)),
                    .slot = malloc(sizeof(int) * (size_t)(P * n)),
                    .next = calloc((size_t)P, sizeof(int))};
  /* from here a rank that fails alone would leave its neighbours waiting: it stops the job */
  fsdpc_status_t st = x.mbs && x.mail && x.slot && x.next
                          ? STATUS_OK
                          : err_set(STATUS_ENOMEM, "pipeline: out of host memory");
  if (st == STATUS_OK) st = pp_schedule_slots(s, x.slot, &slots);
  if (st == STATUS_OK && o->forwarded) st = mark_forwarded(s, &x, n, slots);
  double sum = 0, t0 = device_clock_seconds();
  if (o->stats) *o->stats = (pp_step_stats_t){0};
  for (int t = 0; t < slots && st == STATUS_OK; t++) {
    fsdpc_tensor_t send = {0};
    int peer = -1, i = x.next[r];
    if (i < n && x.slot[r * n + i] == t) { /* this rank's action of slot t */
      pp_action_t a = pp_schedule_action(s, r, i);
      mb_t *b = &x.mbs[(a.stage / P) * M + a.microbatch];
      st = a.kind == PP_FORWARD ? run_forward(o, x.mail, a, b, &sum, &send)
                                : run_backward(o, x.mail, a, b, &send);
      if (send.storage != NULL) peer = pp_schedule_rank_of_stage(s, consumer(a).stage);
      if (st == STATUS_OK && peer == r) { /* the next stage is this rank's own */
        x.mail[mail_slot(S, M, consumer(a))] = send;
        memset(&send, 0, sizeof send);
      }
      int kept = tapes_kept(x.mbs, V * M);
      if (o->stats && kept > o->stats->max_in_flight) o->stats->max_in_flight = kept;
    }
    if (st == STATUS_OK) st = exchange(o, &x, t, &send, peer);
    tensor_free(&send);
    if (st == STATUS_OK && o->forwarded && x.forwarded[t] >= 0)
      st = o->forwarded(x.forwarded[t], o->user);
  }
  if (o->stats) o->stats->seconds = device_clock_seconds() - t0;
  state_free(&x, V * M, 2 * S * M);
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
  int S = pp_schedule_stages(s);
  uint64_t n = 0, each = (uint64_t)boundary_numel(o) * dtype_size(o->dtype);
  for (int i = 0; i < pp_schedule_num_actions(s, rank); i++) {
    pp_action_t a = pp_schedule_action(s, rank, i);
    if (makes_message(a, S) && pp_schedule_rank_of_stage(s, consumer(a).stage) != rank) n += each;
  }
  return n;
}
