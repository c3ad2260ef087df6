/*
 * What a training step of the built-in Llama holds per rank under a plan, computed from the
 * plan and the sharded (possibly meta) model's fully_shard groups, without running it: the
 * sharded state, the activations saved for backward, the units gathered and what is in flight
 * (logits, gradients being computed, reductions not yet finished) at the moment the step
 * peaks. fsdp-train --dry-run prints it; a real step's peak_mem_bytes is what it estimates.
 *
 *   llama_memory_t m;
 *   TRY(llama_memory_estimate(&plan, groups, n_groups, sharded_param_bytes, 4, &m));
 *   printf("peak %.0f B (%s)\n", m.peak, m.at);
 *
 * The model follows how this library runs a step: the tape keeps each block's inputs to its
 * matmuls, norms, RoPE, attention (with its log-sum-exp) and SwiGLU; activation checkpointing
 * keeps a block's output only and recomputes the rest in backward; tensor parallelism splits
 * heads and the FFN and, with sequence parallelism, the sequence between blocks; a unit's
 * parameters are gathered while it runs forward and again for backward, its gradients made
 * whole, then reduced while the next unit's backward runs.
 */
#ifndef FSDPC_PARALLEL_LLAMA_MEMORY_H
#define FSDPC_PARALLEL_LLAMA_MEMORY_H

#include "fully_shard/fsdp.h"
#include "parallel/plan.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes per rank at the peak of a step, by kind. */
typedef struct llama_memory {
  double state;       /* sharded parameters and AdamW moments (and gradients, accumulating) */
  double activations; /* token ids, the embedding's output, what the tape keeps */
  double gathered;    /* unsharded units (and the slices integer reshards keep) */
  double in_flight;   /* logits, gradients being computed, reductions not yet finished */
  double peak;        /* the sum */
  const char *at;     /* where in the step it peaks, in words */
} llama_memory_t;

/* The estimate for plan p (resolved) whose model was parallelised into groups[0..n) (the
 * root's last, as parallel_groups lists them); sharded_param_bytes: this rank's parameter
 * shards (padded), param_size: bytes per element of those shards. Uses the plan's
 * train.activation_checkpointing. Local. */
status_t llama_memory_estimate(const plan_t *p, fsdp_group_t *const *groups, int n,
                               double sharded_param_bytes, size_t param_size,
                               llama_memory_t *out);

#ifdef __cplusplus
}
#endif

#endif
