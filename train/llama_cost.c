#include "train/llama_cost.h"

#include <stdlib.h>
#include <string.h>

#include "core/args_impl.h"
#include "models/llama/llama_plan.h"

/* The units as the estimate sees them: the root's and the largest other unit's unsharded
 * bytes (compute dtype) and what gathering them allocates (root_gathered, unit_gathered:
 * nothing where shard groups of one rank use their shards as the unsharded tensors), that
 * unit's gradient in the reduce dtype, and what the other units keep gathered after their
 * forward (all of it when reshard_after_forward is false, 1/N of it when N). */
typedef struct units {
  double root, root_reduce, unit, unit_reduce, unit_shard, kept_largest, kept_all;
  double root_gathered, unit_gathered;
  dtype_t root_dtype, unit_dtype;
} units_t;

/* own: bytes per element of the parameters' shards; one_rank: shard groups of one rank with
 * their shards on the device (fully_shard's one-rank path: a unit in the shards' dtype is
 * gathered without memory). */
static void sum_units(fsdp_group_t *const *groups, int n, int dp_shard, size_t own, bool one_rank,
                      units_t *u) {
  memset(u, 0, sizeof *u);
  u->root_dtype = u->unit_dtype = DTYPE_F32;
  for (int i = 0; i < n; i++) {
    double flat = (double)fsdp_gather_numel(groups[i]), numel = flat * dp_shard;
    dtype_t pd = fsdp_param_dtype(groups[i]);
    double bytes = numel * (double)dtype_size(pd);
    double gathered = one_rank && dtype_size(pd) == own ? 0 : bytes;
    double reduce = numel * (double)dtype_size(fsdp_reduce_dtype(groups[i]));
    if (fsdp_group_name(groups[i])[0] == 0) {
      u->root = bytes;
      u->root_gathered = gathered;
      u->root_reduce = reduce;
      u->root_dtype = pd;
      continue;
    }
    int raf = fsdp_reshard_after_forward(groups[i]);
    double kept = raf == 0 ? gathered : raf >= 2 ? gathered / raf : 0;
    u->kept_all += kept;
    if (bytes > u->unit) {
      u->unit = bytes;
      u->unit_gathered = gathered;
      u->unit_reduce = reduce;
      u->unit_shard = flat * (double)own;
      u->unit_dtype = pd;
      u->kept_largest = kept;
    }
  }
  if (u->unit == 0) u->unit_dtype = u->root_dtype;
}

/* One moment of the step, by kind. */
static llama_memory_t moment(const char *at, double state, double act, double gathered,
                             double in_flight) {
  return (llama_memory_t){.state = state,
                          .activations = act,
                          .gathered = gathered,
                          .in_flight = in_flight,
                          .peak = state + act + gathered + in_flight,
                          .at = at};
}

static fsdpc_status_t estimate(const fsdpc_plan_t *p, fsdp_group_t *const *groups, int n,
                               double sharded_param_bytes, size_t param_size,
                               const llama_stage_t *stage, llama_memory_t *out);

fsdpc_status_t llama_memory_estimate(const fsdpc_plan_t *p, fsdp_group_t *const *groups, int n,
                                     double sharded_param_bytes, size_t param_size,
                                     llama_memory_t *out) {
  ARG_NONNULL(p);
  if (n > 0) ARG_NONNULL(groups);
  ARG_NONNULL(out);
  return estimate(p, groups, n, sharded_param_bytes, param_size, NULL, out);
}

fsdpc_status_t llama_memory_estimate_stage(const fsdpc_plan_t *p, fsdp_group_t *const *groups,
                                           int n, double sharded_param_bytes, size_t param_size,
                                           const llama_stage_t *stage, llama_memory_t *out) {
  ARG_NONNULL(p);
  if (n > 0) ARG_NONNULL(groups);
  ARG_NONNULL(stage);
  ARG_NONNULL(out);
  if (stage->stages < 1 || stage->blocks < 0 || stage->blocks > p->model.n_layers ||
      stage->in_flight < 1)
    return err_set(STATUS_EINVAL,
                   "memory estimate: %d stages of %d blocks, %d microbatches in flight",
                   stage->stages, stage->blocks, stage->in_flight);
  return estimate(p, groups, n, sharded_param_bytes, param_size, stage, out);
}

/* A pipeline rank's peak: its units gathered the whole step (each a root, kept from a
 * microbatch's forward to its backward), the tapes of the microbatches in flight (its blocks',
 * the embedding's on the first stage), a checkpointed block's recomputed tape, the largest
 * unit's whole gradient, and on the last stage the logits and their gradient. */
static llama_memory_t stage_peak(const llama_stage_t *st, fsdp_group_t *const *groups, int n,
                                 int dp_shard, size_t own, bool one_rank, double state,
                                 double per_block, double out_b, double head_in, double logits,
                                 bool ac, double unit_reduce) {
  double gathered = 0;
  for (int i = 0; i < n; i++) {
    double numel = (double)fsdp_gather_numel(groups[i]) * dp_shard;
    size_t pd = dtype_size(fsdp_param_dtype(groups[i]));
    gathered += one_rank && pd == own ? 0 : numel * (double)pd;
  }
  /* gathered once a step (pipeline.sync_every_microbatch off), a unit's gradients accumulate
   * whole until its last microbatch's backward reduces them */
  if (!st->sync_every && !one_rank) gathered *= 2;
  double nb = (double)st->blocks / st->stages; /* a stage's blocks: what one in flight keeps */
  double mb = head_in + (ac ? nb * out_b : nb * per_block);
  return moment("a block's backward with the schedule's microbatches in flight", state,
                st->in_flight * mb + (ac && st->blocks > 0 ? per_block : 0), gathered,
                unit_reduce + (st->last ? 2 * logits : 0));
}

/* The layer a unit's name places it in ("...layers.I" or "...h.I", and what it holds), or -1. */
static int64_t unit_layer(const char *name) {
  for (const char *at = name; (at = strchr(at, '.')) != NULL; at++) {
    char *end;
    long long i = strtoll(at + 1, &end, 10);
    if (end != at + 1 && (*end == 0 || *end == '.') && i >= 0) return i;
  }
  return -1;
}

/* An evaluation after a step: the state as the step left it (the shards, their gradients and
 * the moments), then a forward without gradients of eval.batch_size samples a rank. It peaks
 * either inside a block's MLP (its input and the residual stream, the MLP's own activations:
 * no tape is kept; the block's units gathered, the next block's ahead, the units before it
 * kept as reshard_after_forward says), or at the loss (the final norm's output and the
 * logits). */
static void eval_peak(const fsdpc_plan_t *p, fsdp_group_t *const *groups, int n, const units_t *u,
                      size_t own, bool one_rank, double state, llama_memory_t *out) {
  const llama_config_t *c = &p->model;
  double t = (double)p->par.tp, D = (double)c->dim, F = (double)c->ffn_dim;
  double V = (double)llama_vocab_rows(c);
  double pad = V > (double)c->vocab_size ? (double)c->vocab_size + V : 0;
  bool tp = p->par.tp > 1, sp = tp && p->par.sequence_parallel;
  double ea = (double)dtype_size(u->unit_dtype), er = (double)dtype_size(u->root_dtype);
  double N = (double)(p->eval_batch_size * p->seq_len), Ns = sp ? N / t : N;
  double ids = 4 * N * 8;
  /* GPT-2's MLP: c_fc's output and its GELU (and a LayerNorm's D wide more); SwiGLU's: gate,
   * up and their product */
  bool gpt2 = c->arch == LLAMA_ARCH_GPT2;
  double mlp = (gpt2 ? 2 : 3) * N * F / t;
  double dense = ea * ((gpt2 ? 7 : 6) * N * D + (tp ? Ns * D : 0) + mlp);
  /* inside the attention (q, k and v as wide as the heads, which may be wider than dim): the
   * block's input, its norm and the residual, q, k and v, the rotated q and k (and Qwen3's
   * normalised ones before), and the attention's output; GPT-2's heads are dim wide */
  double QD = (double)c->n_heads * (double)llama_head_dim(c);
  double KVD = (double)c->n_kv_heads * (double)llama_head_dim(c);
  double attn = gpt2 ? 0
                     : ea * (3 * N * D + (tp ? Ns * D : 0) +
                             N * (3 * QD + 3 * KVD + (c->qk_norm ? QD + KVD : 0)) / t);
  /* a sparse block's: router logits and probabilities (f32), top-k weights, each token's k
   * rows, the experts' activations and outputs (under expert parallelism the rows sent and
   * received, there and back) and Qwen2-MoE's shared expert */
  double Km = (double)c->top_k, Fm = (double)c->moe_ffn_dim, E = (double)c->n_experts;
  double Nm = sp ? Ns : N, Fs = (double)c->shared_ffn_dim;
  double sparse = ea * (6 * Nm * D + 3 * Nm * Km * Fm + 2 * Nm * Km * D) +
                  (p->par.ep > 1 ? ea * 4 * Nm * Km * D : 0) + 4 * (2 * Nm * E + Nm * Km) +
                  (Fs > 0 ? ea * (3 * Nm * Fs + 2 * Nm * D) : 0);
  /* each layer's units gathered (a unit placed in no layer counts for every one) */
  int64_t L = c->n_layers;
  double *g = calloc((size_t)L + 1, sizeof *g);
  for (int i = 0; g && i < n; i++) {
    const char *name = fsdp_group_name(groups[i]);
    if (name[0] == 0) continue; /* the root */
    double numel = (double)fsdp_gather_numel(groups[i]) * p->par.dp_shard;
    size_t pd = dtype_size(fsdp_param_dtype(groups[i]));
    double b = one_rank && pd == own ? 0 : numel * (double)pd;
    int64_t l = unit_layer(name);
    for (int64_t j = 0; j < L; j++)
      if (l == j || l < 0 || l >= L) g[j] += b;
  }
  llama_memory_t best = moment("an evaluation's loss", state, ids + er * (Ns + (sp ? N : 0)) * D,
                               u->root_gathered + u->kept_all,
                               er * (tp ? 2 * N * V / t + 2 * N * V : N * V) + er * N * pad);
  /* (under tensor parallelism the local logits and their copy sent, the gathered blocks and
   * their reordering into whole rows) */
  for (int64_t j = 0; g && j < L; j++) {
    double ahead = j + 1 < L ? g[j + 1] : 0, kept = u->kept_all * (double)j / (double)L;
    double mlp_at = llama_layer_is_moe(c, j) ? sparse : dense;
    llama_memory_t m =
        moment(attn > mlp_at ? "an evaluation's attention" : "an evaluation's block", state,
               ids + (attn > mlp_at ? attn : mlp_at), u->root_gathered + g[j] + ahead + kept, 0);
    if (m.peak > best.peak) best = m;
  }
  out->eval = g ? best.peak : 0; /* 0: not estimated (no memory for the table) */
  out->eval_at = best.at;
  free(g);
}

static fsdpc_status_t estimate(const fsdpc_plan_t *p, fsdp_group_t *const *groups, int n,
                               double sharded_param_bytes, size_t param_size,
                               const llama_stage_t *stage, llama_memory_t *out) {
  const llama_config_t *c = &p->model;
  const parallel_plan_t *pp = &p->par;
  if (pp->dp_shard < 1 || pp->dp_replicate < 1 || pp->tp < 1)
    return err_set(STATUS_EINVAL, "memory estimate: the plan's mesh is not resolved");
  units_t u;
  sum_units(groups, n, pp->dp_shard, param_size, pp->dp_shard == 1 && !pp->offload, &u);
  double t = (double)pp->tp, sh = (double)pp->dp_shard, L = (double)c->n_layers;
  double D = (double)c->dim, F = (double)c->ffn_dim, V = (double)llama_vocab_rows(c);
  /* padded tables (model.pad_vocab_multiple): the head's whole logits are kept beside their
   * vocab_size columns, and the narrowing's backward writes a padded gradient */
  double pad = V > (double)c->vocab_size ? (double)c->vocab_size + V : 0;
  double H = (double)c->n_heads, hd = (double)llama_head_dim(c);
  double QD = H * hd, KVD = (double)c->n_kv_heads * hd; /* the q and k/v widths */
  double B = (double)p->batch_size, T = (double)p->seq_len, N = B * T;
  bool tp = pp->tp > 1, sp = tp && pp->sequence_parallel, ac = p->activation_checkpointing;
  bool dp = pp->dp_shard * pp->dp_replicate > 1, accum = p->grad_accum > 1;
  double ea = (double)dtype_size(u.unit_dtype), er = (double)dtype_size(u.root_dtype);
  double Ns = sp ? N / t : N; /* tokens of a rank between blocks */
  bool gpt2 = c->arch == LLAMA_ARCH_GPT2;

  /* what one block's tape keeps: its norms' and residual adds' outputs, o and the down
   * projection (D wide), q, the rotated q and attention (n_heads x head_dim wide), k, v and
   * the rotated k (KV wide), gate, up and their
   * SwiGLU (F wide), two norms' inverse RMS and the attention's log-sum-exp in f32. Under
   * tensor parallelism heads and F split over tp and the rowwise outputs are whole before
   * their reduction; sequence parallelism puts norms and adds on sequence shards and keeps
   * the gathered inputs of the column-split projections too */
  double block;
  if (sp)
    block = ea * (4 * N * D + 6 * Ns * D + 3 * N * QD / t + 3 * N * KVD / t + 3 * N * F / t) +
            2 * Ns * 4 + B * (H / t) * T * 4;
  else if (tp)
    block = ea * (8 * N * D + 3 * N * QD / t + 3 * N * KVD / t + 3 * N * F / t) + 2 * N * 4 +
            B * (H / t) * T * 4;
  else
    block = ea * (6 * N * D + 3 * N * QD + 3 * N * KVD + 3 * N * F) + 2 * N * 4 + B * H * T * 4;
  /* GPT-2's block keeps more: c_attn's product and its bias's sum (3 D / t wide each) and the
   * narrowed copies of q, k and v in place of q, k, v and the rotated q and k (4 N D / t
   * more); both c_proj's bias sums beside their products (2 Ns D); each LayerNorm's mean
   * beside its inverse deviation (2 Ns f32) */
  if (gpt2) block += ea * (4 * N * D / t + 2 * Ns * D) + 2 * Ns * 4;
  if (c->qk_norm) /* Qwen3's normalised q and k heads and their inverse RMS */
    block += ea * N * (QD + KVD) / t + 4 * N * (H + (double)c->n_kv_heads) / t;
  /* the sparse layers: in place of the MLP's 3 N F / t, the router's logits and probabilities
   * (f32) and the top-k weights, each token's k rows gathered, the experts' 3 Nm k moe_ffn and
   * their outputs (under uniform routing: every expert's share is Nm k / E rows), Nm the tokens
   * a rank's block runs on (its sequence shard under sequence parallelism, else all of them:
   * the experts are not split by tensor parallelism) */
  double Km = (double)c->top_k, Fm = (double)c->moe_ffn_dim, E = (double)c->n_experts;
  double Nm = sp ? Ns : N;
  double block_moe = block + ea * (3 * Nm * Km * Fm + 2 * Nm * Km * D - 3 * N * F / t) +
                     4 * (2 * Nm * E + Nm * Km);
  /* under expert parallelism the rows received, grouped by expert, the experts' outputs in
   * the received order and back: four more copies of the k rows */
  if (pp->ep > 1) block_moe += ea * 4 * Nm * Km * D;
  /* Qwen2-MoE's shared expert over those tokens: its 3 Nm Fs, its output, gate and gated
   * output */
  double Fs = (double)c->shared_ffn_dim;
  if (Fs > 0) block_moe += ea * (3 * Nm * Fs + 2 * Nm * D + 2 * Nm);
  double sparse = (double)llama_num_moe_layers(c);
  double all_blocks = (L - sparse) * block + sparse * block_moe;
  double out_b = ea * Ns * D; /* a block's output: all that checkpointing keeps */
  /* what the model keeps between steps: GPT-2's position ids [batch, seq_len] (i64) */
  double buffers = gpt2 ? N * 8 : 0;
  double ids = 4 * N * 8 + buffers; /* input ids and labels, and their copies; those */
  /* the embedding's output (whole and reduced under tensor parallelism); GPT-2's wte's and
   * wpe's outputs beside their sum */
  double emb = gpt2 ? (tp ? er * (2 * N * D + 3 * Ns * D) : 3 * er * N * D)
                    : (tp ? er * (N * D + Ns * D) : er * N * D);
  /* under tensor parallelism the local logits and their copy sent, the gathered blocks and
   * their reordering into whole rows */
  double logits =
      er * (tp ? 2 * N * V / t + 2 * N * V : N * V) + er * N * pad; /* local, and whole */
  /* after the loss's backward: the lm_head's and final norm's gradients and the gradient
   * flowing into the blocks (the logits' memory, their gradient since the loss's backward,
   * is freed once the lm_head has used it) */
  double resid = er * V * D / t + er * Ns * D + 2 * er * D;
  /* the shards and AdamW's two moments of each element (optim.state_dtype) */
  double moments =
      2 * sharded_param_bytes / (double)param_size * (double)dtype_size(p->optim.state_dtype);
  double shards = 0; /* HFSDP's 1/dp_shard shards beside the optimizer's */
  for (int i = 0; i < n; i++)
    if (fsdp_state_over_replicas(groups[i]))
      shards += (double)fsdp_flat_numel(groups[i]) * (double)param_size;
  double state = sharded_param_bytes + shards + moments + (accum ? sharded_param_bytes : 0);
  if (stage != NULL) { /* a pipeline rank: gradients accumulate over the microbatches */
    *out = stage_peak(stage, groups, n, pp->dp_shard, param_size, pp->dp_shard == 1 && !pp->offload,
                      state + (accum ? 0 : sharded_param_bytes), block, out_b,
                      stage->first ? ids + emb : 0, logits, ac, u.unit_reduce);
    out->moments = moments;
    out->shards = shards;
    out->buffers = buffers;
    return STATUS_OK;
  }
  /* with accumulation the root's reduction of the previous micro-batch finishes during the
   * next backward: its whole gradients and the reduced shard */
  double root_pending = accum && dp ? u.root + u.root_reduce / sh : 0;
  /* backward gathers the next unit ahead (a unit kept whole after forward needs none) */
  double ahead = u.kept_largest == u.unit_gathered ? 0 : u.unit_gathered;
  double kept = u.kept_all - u.kept_largest; /* what the blocks before the last keep */

  /* the final norm's f32 rows: RMSNorm's inverse RMS; a LayerNorm's mean too */
  double fnorm = (gpt2 ? 2 : 1) * Ns * 4;
  /* 1: the loss's backward: every block's tape, the final norm's output (and its gathered
   * copy under sequence parallelism), the logits (their gradient written over them) and, at
   * the lm_head's backward, its input's and weight's gradients; under tensor parallelism the
   * whole gradient and its local slice (the gathered blocks and their reordering are gone by
   * then), the last unit being gathered for backward */
  *out = moment("the loss's backward", state, ids + emb + (ac ? L * out_b : all_blocks),
                u.root_gathered + ahead + kept,
                er * (Ns * D + (sp ? N * D : 0)) + fnorm +
                    (tp ? er * (N * V + N * V / t + N * pad) : logits + er * (N * D + V * D)) +
                    root_pending);
  /* 1b: under tensor parallelism, the logits made whole at the forward's end: the local
   * logits and their copy sent, the gathered blocks and their reordering into whole rows */
  if (tp) {
    llama_memory_t m = moment("the logits made whole", state,
                              ids + emb + (ac ? L * out_b : all_blocks), u.root_gathered + kept,
                              er * (Ns * D + (sp ? N * D : 0)) + fnorm + 2 * er * N * V / t +
                                  2 * er * N * V + root_pending);
    if (m.peak > out->peak) *out = m;
  }
  /* 2: a block's backward, inside its MLP: the tape of the blocks before it and its own
   * (less its output and the down projection's, already used; checkpointing recomputes it
   * first), its parameters and the next unit's being gathered, its MLP's input gradients;
   * below the last block, the gradients of the block after it being reduced (whole in the
   * reduce dtype, and the reduced shard) and the shards of those reduced before */
  /* GPT-2's GELU backward: its output's gradient and its input's (2 F wide, SwiGLU's 3), and
   * c_proj's bias gradient beside its weight's */
  double fw = gpt2 ? 2 : 3, cb = gpt2 ? ea * D : 0;
  double dense_mlp = ac ? (tp ? ea * (2 * N * D + Ns * D) : ea * (fw * N * F + F * D) + cb)
                        : ea * (fw * N * F / t + F * D / t) + cb;
  double moe_mlp =
      ea * (3 * Nm * Km * Fm + E * Fm * D) + (Fs > 0 ? ea * (3 * Nm * Fs + 3 * Fs * D) : 0);
  double sparse_below = sparse; /* of the layers below i, in the loop */
  for (int64_t i = c->n_layers - 1; i >= 0; i--) {
    bool last = i == c->n_layers - 1, moe = llama_layer_is_moe(c, i);
    sparse_below -= moe;
    double bi = moe ? block_moe : block, mlp = moe ? moe_mlp : dense_mlp;
    /* GPT-2: c_proj's bias sum used too, beside its product (and the block's output) */
    double used = gpt2 && !tp ? out_b : 0;
    double own = ac ? (tp ? bi : bi - out_b - used) : bi - 2 * out_b - used;
    double below = ((double)i - sparse_below) * block + sparse_below * block_moe;
    if (!last && u.unit == 0) break; /* no unit's gradients but the root's: the last peaks */
    double before = (double)i, after = L - 1 - before;
    /* the gradient shards of the blocks after it: reduced, but for the next one's (in flight
     * with data parallelism; added into its shards at once on one rank) */
    double done = dp ? (after > 1 ? after - 1 : 0) : after;
    llama_memory_t m = moment(
        last ? "the last block's backward"
        : dp ? "a block's backward while the next block's gradients reduce"
             : "a block's backward beside the gradients of the blocks after it",
        state + done * u.unit_shard, ids + emb + (ac ? (before + 1) * out_b : below) + own,
        u.root_gathered + u.unit_gathered + (i > 0 ? ahead : 0) +
            (before > 0 ? kept * before / (L - 1) : 0),
        /* the reduction: its input whole, and its output shard (the input itself when
         * shard groups have one rank) */
        resid + mlp + root_pending + (last || !dp ? 0 : u.unit_reduce * (sh > 1 ? 1 + 1 / sh : 1)));
    if (m.peak > out->peak) *out = m;
  }
  out->moments = moments; /* part of the state at every moment */
  out->shards = shards;
  out->buffers = buffers;
  eval_peak(p, groups, n, &u, param_size, pp->dp_shard == 1 && !pp->offload,
            2 * sharded_param_bytes + shards + moments, out);
  return STATUS_OK;
}

/* ---- communication ---- */

/* The built-in models' module names the estimates look up: the token embedding and a sparse
 * layer's MoE block. */
static const char *token_embedding(const llama_config_t *c) {
  return c->arch == LLAMA_ARCH_GPT2 ? "transformer.wte" : "model.embed_tokens";
}
static const char *moe_block(const llama_config_t *c) {
  return c->arch == LLAMA_ARCH_MIXTRAL ? "block_sparse_moe" : "mlp";
}

/* The innermost group whose module holds the module fqn (the root's holds every one), -1 when
 * none does. */
static int group_of(fsdp_group_t *const *groups, int n, const char *fqn) {
  int best = -1;
  size_t longest = 0;
  for (int i = 0; i < n; i++) {
    const char *name = fsdp_group_name(groups[i]);
    size_t l = strlen(name);
    if ((best < 0 || l > longest) && strncmp(fqn, name, l) == 0 &&
        (l == 0 || fqn[l] == 0 || fqn[l] == '.')) {
      best = i;
      longest = l;
    }
  }
  return best;
}

/* The bytes of an element the module fqn computes in (its unit's parameter dtype), or reduces
 * its gradients in (reduce): f32 outside every group. */
static double module_bytes(fsdp_group_t *const *groups, int n, const char *fqn, bool reduce) {
  int g = group_of(groups, n, fqn);
  if (g < 0) return (double)dtype_size(DTYPE_F32);
  return (double)dtype_size(reduce ? fsdp_reduce_dtype(groups[g]) : fsdp_param_dtype(groups[g]));
}

/* A ring all-reduce's bytes a rank sends for count elements of size bytes over T ranks. */
static double ring_all_reduce(int T, int64_t count, double size) {
  return (double)(2 * (T - 1) * (count * (int64_t)size) / T);
}

/* Tensor parallelism with the built-in plan (docs/plan.md, "Tensor parallelism") into c, per
 * micro-batch (A of them a step): activations of n = batch x seq_len x dim elements, each in the
 * compute dtype of the module that makes them, the backward's reductions of gradients in that
 * module's reduce dtype. */
static void tp_comm(const fsdpc_plan_t *p, fsdp_group_t *const *groups, int n, double A,
                    llama_comm_t *c) {
  const llama_config_t *mc = &p->model;
  int T = p->par.tp, P = p->par.ep;
  bool gpt2 = mc->arch == LLAMA_ARCH_GPT2, sp = p->par.sequence_parallel;
  double N = (double)(p->batch_size * p->seq_len * mc->dim);
  double logits = (double)(p->batch_size * p->seq_len) * (double)llama_vocab_rows(mc) / T;
  double fwd = p->activation_checkpointing ? 2 : 1; /* blocks recompute their forward */
#define BYTES(fqn, reduce) module_bytes(groups, n, fqn, reduce)
  /* under a pipeline, the modules of this rank's stages: those its units hold */
  bool pipe = p->par.pp > 1;
#define HELD(fqn) (!pipe || group_of(groups, n, fqn) >= 0)
  /* per dtype-weighted count: the forward's reductions (the embeddings' outputs, the rowwise
   * outputs), the backward's (the inputs of prepare_input, two a dense block, and of the
   * lm_head), the gathers under sequence parallelism (the inputs of prepare_input and the
   * lm_head forward; the embeddings' and rowwise outputs' gradients backward), and the
   * gradient sums over tp of the weights sequence parallelism replicates */
  double fred = 0, bred = 0, gath = 0, sums = 0, whole = 0; /* whole: without sp */
  int64_t Ni = p->batch_size * p->seq_len * mc->dim;
  long long n_fred = 0, n_bred = 0, n_gath = 0, n_sums = 0;
  const char *embs[2] = {token_embedding(mc), "transformer.wpe"};
  for (int e = 0; e < (gpt2 ? 2 : 1) && HELD(embs[0]); e++) {
    double b = BYTES(embs[e], false);
    fred += b;
    whole += ring_all_reduce(T, Ni, b);
    gath += b;
    n_fred++;
    n_gath++;
  }
  bool last = HELD("lm_head"); /* the final norm and the head: the last stage's */
  double head = BYTES("lm_head", false), head_r = BYTES("lm_head", true);
  if (last) {
    bred += head_r;
    whole += ring_all_reduce(T, Ni, head_r);
    gath += head;
    n_bred++;
    n_gath++;
  }
  char fqn[96];
  const char *layer = gpt2 ? "transformer.h" : "model.layers";
  const char *norms[2] = {gpt2 ? "ln_1" : "input_layernorm",
                          gpt2 ? "ln_2" : "post_attention_layernorm"};
  double norm_parts = gpt2 ? 2 : 1; /* a LayerNorm's weight and bias */
  for (int64_t l = 0; l < mc->n_layers; l++) {
    snprintf(fqn, sizeof fqn, "%s.%lld", layer, (long long)l);
    if (!HELD(fqn)) continue;
    bool sparse = llama_layer_is_moe(mc, l);
    /* a sparse layer's MoE block runs on the tokens as they come: no prepare_input gather or
     * rowwise reduction of its own */
    const char *blocks[2] = {gpt2 ? "attn" : "self_attn", "mlp"};
    for (int b = 0; b < (sparse ? 1 : 2); b++) {
      snprintf(fqn, sizeof fqn, "%s.%lld.%s", layer, (long long)l, blocks[b]);
      double e = BYTES(fqn, false), r = BYTES(fqn, true);
      fred += fwd * e;
      bred += r;
      whole += fwd * ring_all_reduce(T, Ni, e) + ring_all_reduce(T, Ni, r);
      gath += fwd * e + e;
      n_fred += (long long)fwd;
      n_bred++;
      n_gath += (long long)fwd + 1;
      /* the rowwise layer's bias: GPT-2's c_proj, an o_proj's */
      if (gpt2 || (b == 0 && mc->o_bias)) {
        sums += ring_all_reduce(T, mc->dim, r);
        n_sums++;
      }
    }
    for (int k = 0; k < 2; k++) {
      snprintf(fqn, sizeof fqn, "%s.%lld.%s", layer, (long long)l, norms[k]);
      sums += norm_parts * ring_all_reduce(T, mc->dim, BYTES(fqn, true));
      n_sums += (long long)norm_parts;
    }
    if (sparse && sp) { /* the router, and the experts unless expert parallelism shards them
                         * over tp; Qwen2-MoE's shared expert's three weights and its gate */
      snprintf(fqn, sizeof fqn, "%s.%lld.%s", layer, (long long)l, moe_block(mc));
      double r = BYTES(fqn, true);
      double moe =
          (double)(mc->n_experts * mc->dim) * (P > 1 ? 1 : 1 + 3 * (double)mc->moe_ffn_dim);
      c->n_ar += (long long)(A * (P > 1 ? 1 : 4));
      c->ar += A * 2.0 * (T - 1) * moe * r / T;
      if (mc->shared_ffn_dim > 0) {
        double sh = (double)mc->dim * (3 * (double)mc->shared_ffn_dim + 1);
        c->n_ar += (long long)(A * 4);
        c->ar += A * 2.0 * (T - 1) * sh * r / T;
      }
    }
    if (mc->qk_norm) { /* Qwen3's headwise q_norm and k_norm: their weights' sums */
      snprintf(fqn, sizeof fqn, "%s.%lld.%s", layer, (long long)l, blocks[0]);
      c->n_ar += (long long)(A * 2);
      c->ar += A * 2 * ring_all_reduce(T, llama_head_dim(mc), BYTES(fqn, true));
    }
  }
  snprintf(fqn, sizeof fqn, "%s", gpt2 ? "transformer.ln_f" : "model.norm");
  if (last) {
    sums += norm_parts * ring_all_reduce(T, mc->dim, BYTES(fqn, true));
    n_sums += (long long)norm_parts;
    c->n_ag += (long long)A;
    c->ag += A * (T - 1) * logits * head; /* the lm_head output made whole */
  }
#undef HELD
#undef BYTES
  if (sp) {                             /* reduce-scatters and all-gathers of n / T elements */
    c->n_ag += (long long)A * n_gath;
    c->ag += A * gath * (T - 1) * N / T;
    c->n_rs += (long long)A * (n_fred + n_bred);
    c->rs += A * (fred + bred) * (T - 1) * N / T;
    c->n_ar += (long long)A * n_sums;
    c->ar += A * sums;
  } else {
    c->n_ar += (long long)A * (n_fred + n_bred);
    c->ar += A * whole;
  }
}

llama_comm_t llama_comm_estimate(const fsdpc_plan_t *p, fsdp_group_t *const *groups, int n) {
  if (p == NULL || groups == NULL) return (llama_comm_t){0};
  llama_comm_t c = {0};
  int R = p->par.dp_replicate;
  double A = (double)p->grad_accum;
  /* under a pipeline the units gather once a step and reduce after the last microbatch, unless
   * pipeline.sync_every_microbatch */
  double Au = p->par.pp > 1 && !p->par.pp_sync_every ? 1 : A;
  /* with tied embeddings, the unit holding the token embedding (its own, or the innermost
   * that contains it: the body's), unless it is the root's, which the head is inside */
  int tied = p->model.tie_embeddings && p->par.pp == 1
                 ? group_of(groups, n, token_embedding(&p->model))
                 : -1;
  if (tied >= 0 && fsdp_group_name(groups[tied])[0] == 0) tied = -1;
  for (int i = 0; i < n; i++) {
    const fsdp_group_t *g = groups[i];
    int W = fsdp_shard_size(g) > 0 ? fsdp_shard_size(g) : p->par.dp_shard;
    bool root = fsdp_group_name(g)[0] == 0;
    int rs = root ? 0 : fsdp_reshard_after_forward(g); /* the root keeps its parameters */
    /* auto: resharded, but under a pipeline every stage's unit is a root of its own, and keeps
     * its parameters from a microbatch's forward to its backward */
    if (rs == FSDP_RESHARD_AUTO) rs = p->par.pp > 1 ? 0 : 1;
    const dtype_t pd = fsdp_param_dtype(g), rd = fsdp_reduce_dtype(g);
    double flat = (double)fsdp_gather_numel(g), red = (double)fsdp_reduce_numel(g);
    if (W > 1) {
      c.n_ag += (long long)Au * (rs == 1 ? 2 : 1);
      c.ag += Au * (rs == 1 ? 2 : 1) * (W - 1) * flat * (double)dtype_size(pd);
      if (rs >= 2) {
        c.n_ag += (long long)Au;
        c.ag += Au * (rs - 1) * flat * W / rs * (double)dtype_size(pd);
      }
      c.n_rs += (long long)Au;
      c.rs += Au * (W - 1) * red * (double)dtype_size(rd);
    }
    double red2 = (double)fsdp_replica_reduce_numel(g);
    /* a tied head outside the token embedding's unit joins that unit (a module of it: its
     * forward enters the unit again), each micro-step: the weight gathered for it (a full
     * gather, or from the post-forward groups of N: the head's forward and backward, the
     * embedding's backward a full gather after the head's backward resharded it; kept
     * gathered: the embedding's backward's gather alone), and the head's gradient reduced as
     * the unit's own */
    bool head_use = i == tied;
    if (head_use) {
      double full = (W - 1) * flat * (double)dtype_size(pd);
      double part = rs >= 2 ? (rs - 1) * flat * W / rs * (double)dtype_size(pd) : 0;
      if (W > 1) {
        c.n_ag += (long long)A * (rs == 0 ? 1 : rs == 1 ? 2 : 3);
        c.ag += A * (rs == 0 ? full : rs == 1 ? 2 * full : 2 * part + full - part);
        c.n_rs += (long long)A;
        c.rs += A * (W - 1) * red * (double)dtype_size(rd);
      }
    }
    double uses = head_use ? 2 : 1; /* reductions a micro-step: the unit's, and the head's */
    if (R > 1 && fsdp_state_over_replicas(g)) {
      if (red2 > 0) { /* the replicas' reduce-scatters, then one gather of the updated shards */
        c.n_rs += (long long)(Au * uses);
        c.rs += Au * uses * (R - 1) * red2 * (double)dtype_size(rd);
        c.n_ag += 1;
        c.ag += (R - 1) * (double)fsdp_replica_gather_numel(g) *
                (double)dtype_size(fsdp_shard_dtype(g));
      }
    } else if (R > 1) {
      c.n_ar += (long long)(Au * uses);
      c.ar += Au * uses * 2.0 * (R - 1) * red * (double)dtype_size(rd) / R;
    }
  }
  /* expert parallelism: per micro-batch and sparse layer, four exchanges (the rows forward and
   * back, then their gradients; six when checkpointed blocks recompute forward) of a rank's batch x
   * seq_len x top_k rows of dim (its sequence shard's under sequence parallelism), the share (ep -
   * 1) / ep of them for other ranks under uniform routing */
  int P = p->par.ep, T = p->par.tp;
  if (P > 1) {
    const llama_config_t *mc = &p->model;
    /* the rows go out and come back in the MoE block's compute dtype: the sparse layers' (a
     * pipeline rank's: those of its experts' units) */
    double es = 0; /* summed over the sparse layers */
    long long sparse = 0;
    char block[96];
    if (p->par.pp > 1) {
      for (int i = 0; i < n; i++) {
        const char *name = fsdp_group_name(groups[i]);
        size_t l = strlen(name);
        if (l < 8 || strcmp(name + l - 8, ".experts") != 0 || l - 8 >= sizeof block) continue;
        snprintf(block, sizeof block, "%.*s", (int)(l - 8), name);
        es += module_bytes(groups, n, block, false);
        sparse++;
      }
    } else {
      for (int64_t l = 0; l < mc->n_layers; l++) {
        if (!llama_layer_is_moe(mc, l)) continue;
        snprintf(block, sizeof block, "model.layers.%lld.%s", (long long)l, moe_block(mc));
        es += module_bytes(groups, n, block, false);
        sparse++;
      }
    }
    double rows = (double)(p->batch_size * p->seq_len * mc->top_k) /
                  (T > 1 && p->par.sequence_parallel ? T : 1);
    double x = p->activation_checkpointing ? 6 : 4; /* a checkpointed block's forward again */
    c.n_a2a += (long long)(A * x) * sparse;
    c.a2a += A * x * rows * (double)(P - 1) / P * (double)mc->dim * es;
  }
  if (T > 1 && llama_plan_tp_is_builtin(&p->model, &p->par)) tp_comm(p, groups, n, A, &c);
  return c;
}
