/*
 * What a training step of the built-in Llama costs per rank under a plan, computed from the
 * plan and the sharded (possibly meta) model's fully_shard groups without running it: the
 * bytes it sends (llama_comm_estimate, the closed form of docs/design.md, "Performance model") and
 * what it holds at its peak (llama_memory_estimate: the sharded state, the activations saved for
 * backward, the units gathered and what is in flight: logits, gradients being computed,
 * reductions not yet finished). fsdp-train --dry-run prints both; a real step's process-group
 * counters and peak_mem_bytes are what they estimate.
 *
 *   llama_memory_t m;
 *   FSDPC_TRY(llama_memory_estimate(&plan, groups, n_groups, sharded_param_bytes, 4, &m));
 *   printf("peak %.0f B (%s)\n", m.peak, m.at);
 *
 * The model follows how this library runs a step: the tape keeps each block's inputs to its
 * matmuls, norms, RoPE, attention (with its log-sum-exp) and SwiGLU; activation checkpointing
 * keeps a block's output only and recomputes the rest in backward; tensor parallelism splits
 * heads and the FFN and, with sequence parallelism, the sequence between blocks; a unit's
 * parameters are gathered while it runs forward and again for backward, its gradients made
 * whole, then reduced while the next unit's backward runs.
 */
#ifndef FSDPC_PARALLEL_LLAMA_COST_H
#define FSDPC_PARALLEL_LLAMA_COST_H

#include "fully_shard/fsdp.h"
#include "train/plan.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* Bytes per rank at the peak of a step, by kind. */
typedef struct llama_memory {
  double state;       /* sharded parameters and AdamW moments (and gradients, accumulating) */
  double activations; /* token ids, the embedding's output, what the tape keeps */
  double gathered;    /* unsharded units (and the slices integer reshards keep) */
  double in_flight;   /* logits, gradients being computed, reductions not yet finished */
  double peak;        /* the sum */
  const char *at;     /* where in the step it peaks, in words */
  double moments;     /* AdamW's two moments (optim.state_dtype), part of state */
  double shards;      /* HFSDP: the 1/dp_shard parameter shards the units gather from, kept
                         beside the 1/(dp_replicate x dp_shard) ones the optimizer updates;
                         part of state (0 without HFSDP) */
  double buffers;     /* what the model keeps between steps beside its parameters (GPT-2's
                         position ids), part of activations */
  double eval;        /* an evaluation's peak (eval.batch_size samples a rank, a forward
                         without gradients) after a step; 0 where not estimated (mesh.pp) */
  const char *eval_at; /* where it peaks, in words */
} llama_memory_t;

/* The estimate for plan p (resolved) whose model was parallelised into groups[0..n) (the
 * root's last, as parallel_groups lists them); sharded_param_bytes: this rank's parameter
 * shards (padded), param_size: bytes per element of those shards. Uses the plan's
 * train.activation_checkpointing. Local. */
fsdpc_status_t llama_memory_estimate(const fsdpc_plan_t *p, fsdp_group_t *const *groups, int n,
                                     double sharded_param_bytes, size_t param_size,
                                     llama_memory_t *out);

/* A pipeline rank's share of the model (mesh.pp): its stages and their blocks, whether it holds
 * the first stage (the embedding) and the last (the final norm, head and loss), and the most
 * microbatches whose activations its stages keep at once, summed over them
 * (pp_schedule_max_in_flight). */
typedef struct llama_stage {
  int stages, blocks;
  bool first, last;
  int in_flight;
  bool sync_every; /* pipeline.sync_every_microbatch: no whole gradients kept across them */
} llama_stage_t;

/* llama_memory_estimate for a pipeline rank holding stage's share, groups[0..n) its units. */
fsdpc_status_t llama_memory_estimate_stage(const fsdpc_plan_t *p, fsdp_group_t *const *groups,
                                           int n, double sharded_param_bytes, size_t param_size,
                                           const llama_stage_t *stage, llama_memory_t *out);

/* Collectives of one step (all micro-batches) on this rank: calls, and bytes sent as the
 * process groups count them. */
typedef struct llama_comm {
  double ag, rs, ar;          /* all-gather, reduce-scatter, all-reduce bytes */
  long long n_ag, n_rs, n_ar; /* calls */
  double a2a;                 /* expert parallelism's all-to-all bytes, under uniform routing */
  long long n_a2a;
} llama_comm_t;

/* Per unit and micro-batch (over the ranks the unit shards over: an expert unit's under
 * mesh.ep, dp_shard / ep): an all-gather in forward and, when the unit reshards, one in
 * backward (within the post-forward group for an integer reshard); one reduce-scatter; under
 * HSDP one all-reduce over the replicas, under HFSDP one reduce-scatter over them instead and
 * one all-gather over them a step. Tensor parallelism with the built-in Llama rules adds
 * its activations' collectives. groups[0..n) as for llama_memory_estimate. Local. */
llama_comm_t llama_comm_estimate(const fsdpc_plan_t *p, fsdp_group_t *const *groups, int n);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
