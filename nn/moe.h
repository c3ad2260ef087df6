/*
 * Mixture of experts: the operations of a dropless top-k MoE block and the block as a layer.
 *
 * The block (nn_moe_new) routes each token of x [..., dim] to k of its E experts and sums the
 * experts' outputs weighted by the router: logits = x gate^T ([N, E]), probabilities by
 * softmax, the k largest (ties to the lower expert), renormalised to sum 1 when norm_topk (as
 * Qwen3-MoE's norm_topk_prob and Mixtral), and each expert a SwiGLU MLP,
 * down(silu(gate(x)) * up(x)). Every token reaches its k experts (no capacity limit). The
 * experts are stored stacked, as TorchTitan's grouped experts: experts.gate_proj and
 * experts.up_proj [E, ffn, dim], experts.down_proj [E, dim, ffn]; the router is the child
 * linear "gate" (weight [E, dim]).
 *
 * The operations under it, each recorded for backward: nn_moe_route (softmax and top-k),
 * nn_gather_rows (tokens into expert order), nn_grouped_linear (one product per expert over
 * its contiguous block of rows; on CUDA one grouped cuBLAS call) and nn_combine_rows (the
 * weighted sum back into token order). They run on the tensors' device in any float dtype; the
 * routing (kernel_moe_route) where the logits are, its choices then copied to the host.
 */
#ifndef FSDPC_NN_MOE_H
#define FSDPC_NN_MOE_H

#include "nn/layers.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* Routing of N tokens to k of E experts from logits [N, E]: *weights [N, k] (differentiable
 * in logits) and *experts, the experts chosen (I64 [N, k], host, caller frees), each token's
 * in descending probability. Local. */
fsdpc_status_t nn_moe_route(nn_ctx_t *ctx, nn_var_t *logits, int k, bool norm_topk,
                            nn_var_t **weights, fsdpc_tensor_t *experts);

/* out[m] = x[rows[m]]: x [N, D], rows I64 [M] in [0, N) -> [M, D]. Backward sums the rows'
 * gradients back into x's. Local. */
fsdpc_status_t nn_gather_rows(nn_ctx_t *ctx, nn_var_t *x, const fsdpc_tensor_t *rows,
                              nn_var_t **out);

/* x [M, in] in blocks of counts[e] rows, e = 0..E-1 in order (summing to M), and w [E, out,
 * in]: block e of the output [M, out] is block e of x times w[e]^T. Local. */
fsdpc_status_t nn_grouped_linear(nn_ctx_t *ctx, nn_var_t *x, nn_param_t *w, const int64_t *counts,
                                 int n_experts, nn_var_t **out);

/* out [N, D] with out[slots[m] / k] += weights[slots[m]] * y[m]: y [M, D], weights [N, k] (read
 * flat), slots I64 [M] in [0, N k). Local. */
fsdpc_status_t nn_combine_rows(nn_ctx_t *ctx, nn_var_t *y, nn_var_t *weights,
                               const fsdpc_tensor_t *slots, nn_var_t **out);

/* The MoE block as a layer (kind "moe"): children "gate" (linear dim -> n_experts, no bias)
 * and "experts" (the stacked SwiGLU weights); forward x [..., dim] -> [..., dim]. Initialised by
 * nn_module_reset_parameters as Linear layers each (U(-1/sqrt(in), 1/sqrt(in))). Local. */
fsdpc_status_t nn_moe_new(nn_module_t *parent, const char *name, int64_t dim, int64_t ffn_dim,
                          int n_experts, int top_k, bool norm_topk, const nn_layer_options_t *opt,
                          nn_module_t **out);

/* Renames the experts' three stacked weights (gate_proj, up_proj, down_proj by default), as a
 * model's files name them (Mixtral's w1, w3, w2): the names of their parameters, checkpoints
 * and Hugging Face files. Before nn_module_finalize. Local. */
fsdpc_status_t nn_moe_name_experts(nn_module_t *moe, const char *gate, const char *up,
                                   const char *down);

/* Adds a shared expert to the block (DeepSeek-V3's shared_experts, ungated): a SwiGLU MLP of
 * ffn_dim (child "shared_experts": gate_proj, up_proj [ffn_dim, dim], down_proj [dim,
 * ffn_dim], linears without bias) that every token goes through, its output added to the
 * routed experts'. Before nn_module_finalize (and any parallelism). Local. */
fsdpc_status_t nn_moe_add_shared_expert(nn_module_t *moe, int64_t ffn_dim,
                                        const nn_layer_options_t *opt);

/* Adds Qwen2-MoE's gated shared expert: a SwiGLU MLP of ffn_dim (child "shared_expert":
 * gate_proj, up_proj, down_proj, no biases) and its gate (child "shared_expert_gate": a linear
 * dim -> 1 without bias); every token's output gains sigmoid(gate(x)) times shared_expert(x).
 * One shared expert a block, gated or not. Before nn_module_finalize. Local. */
fsdpc_status_t nn_moe_add_gated_shared_expert(nn_module_t *moe, int64_t ffn_dim,
                                              const nn_layer_options_t *opt);

/* How a block scores its experts: softmax (Qwen3-MoE, Mixtral; the default) or sigmoid
 * (DeepSeek-V3). */
typedef enum nn_moe_score { NN_MOE_SOFTMAX = 0, NN_MOE_SIGMOID } nn_moe_score_t;

/* The block's routing: its scores (NN_MOE_SIGMOID: sigmoid(logits) each, the chosen ones
 * renormalised when norm_topk as DeepSeek-V3's norm_topk_prob), the weights times route_scale
 * (DeepSeek-V3's routed_scaling_factor; 1 by default), and with bias_rate > 0 aux-loss-free
 * load balancing: a parameter expert_bias [E] (no gradient, zeros at reset, in checkpoints)
 * added to the scores for the choice alone, which nn_moe_update_bias moves by bias_rate
 * toward the mean load after each step (DeepSeek-V3's e_score_correction_bias, TorchTitan's
 * expert_bias). Sigmoid scores do not take the load-balancing loss (nn_moe_aux_t). Before
 * nn_module_finalize. Local. */
fsdpc_status_t nn_moe_set_routing(nn_module_t *moe, nn_moe_score_t score, double route_scale,
                                  double bias_rate);

/* After each optimizer step: for every block under root with a bias_rate, the tokens each
 * expert received in the training forwards since the last call (summed over pg, the ranks
 * whose tokens trained the step), and its expert_bias raised by bias_rate where an expert got
 * fewer than the mean and lowered where it got more (each rank its shard). Collective over
 * pg; the trainer (train_main, trainer_run) calls it with every rank. */
fsdpc_status_t nn_moe_update_bias(nn_module_t *root, pg_t *pg);
/* Forgets the tokens counted since the last nn_moe_update_bias (a step not applied: the
 * trainer's non-finite step skipped). NULL: no-op. Local. */
void nn_moe_discard_bias_counts(nn_module_t *root);

/* Rows of x [M, dim] exchanged over pg (expert parallelism's token dispatch): this rank sends
 * send_rows[q] rows to rank q of the group (its blocks in rank order, summing to M) and
 * receives recv_rows[q] from q (which must equal q's send_rows[this rank]; *out holds them in
 * rank order). Backward sends the gradients back the same way. Every rank of pg calls it, and
 * runs its backward, in the same order. Collective over pg. */
fsdpc_status_t nn_all_to_all_rows(nn_ctx_t *ctx, nn_var_t *x, pg_t *pg, const int64_t *send_rows,
                                  const int64_t *recv_rows, nn_var_t **out);

/* Expert parallelism (TorchTitan's expert_parallel_degree): the block's experts are split over
 * dimension dim of mesh, Shard(0) there (Replicate on its other dimensions), each of its P
 * ranks holding E / P consecutive experts (P must divide E); the router stays whole. Each
 * forward routes this rank's tokens, sends every token's rows to the ranks of its experts by
 * one all-to-all (the counts agreed from every rank's routing), runs the local experts over
 * what arrived, and returns the results by the inverse all-to-all; backward likewise. The
 * router's gradient is this rank's loss's, like any replicated parameter's; an expert's is
 * the sum of the group's P ranks' losses' (every token of the group routed to it): where the
 * data-parallel ranks' gradients are averaged (fully_shard's default), divide the experts'
 * by P as well (their unit's fsdp_set_gradient_divide_factor with the data-parallel size, as
 * TorchTitan does; a plan's mesh.ep does so). Before fully_shard; the checkpoint holds every
 * expert under its global index. Collective over the group. */
fsdpc_status_t nn_moe_expert_parallel(nn_module_t *moe, mesh_t *mesh, int dim);

/* The block's tokens are split over pg's ranks (tensor parallelism's sequence shards: each
 * rank routes its own): the load-balancing loss's statistics of each forward are summed over
 * pg, so every rank's loss and gradient are those of all the group's tokens. The block's
 * parameters' gradients are then this rank's tokens' only: sum them over pg (tensor_parallel
 * does, for a block under a prepare_input rule with sequence parallelism). pg must outlive the
 * block. Local; the forwards are collective over pg. */
fsdpc_status_t nn_moe_split_tokens(nn_module_t *moe, pg_t *pg);

/* The load-balancing loss of a model's MoE blocks (transformers' load_balancing_loss_func, as
 * Qwen3-MoE and Mixtral add it with router_aux_loss_coef): over every token each block
 * routed in one forward, E sum_e f_e P_e, f_e the share of the top-k choices that went to
 * expert e and P_e its mean router probability (f_e held constant). Its value is read after
 * the forward (nn_moe_aux_loss) and added to the loss's; its gradient, coef times the scale
 * given to nn_moe_aux_begin (the factor the loss's own gradient gets: 1 / grad_accum), is
 * added by each block's routing in backward, so it also reaches checkpointed blocks. The
 * blocks must share E and top_k. train_micro_step_async and train_eval_batch run it for a
 * model whose blocks have one attached; fsdp-train's pipelines sum each microbatch's
 * statistics over the stages first (nn_moe_aux_stats_add below). Local. */
typedef struct nn_moe_aux nn_moe_aux_t;
fsdpc_status_t nn_moe_aux_new(int n_experts, int top_k, double coef, nn_moe_aux_t **out);
void nn_moe_aux_free(nn_moe_aux_t *a);
/* Every MoE block under root reports to a (NULL: to none); *blocks (if not NULL) how many. */
fsdpc_status_t nn_moe_aux_attach(nn_module_t *root, nn_moe_aux_t *a, int *blocks);
/* The loss the first block under root reports to, or NULL. */
nn_moe_aux_t *nn_moe_aux_of(const nn_module_t *root);
/* Before a forward: clears the routing gathered; scale as above. */
void nn_moe_aux_begin(nn_moe_aux_t *a, double scale);
/* After it: the loss's value (unweighted; 0 before any routing) and its weight. */
double nn_moe_aux_loss(const nn_moe_aux_t *a);
double nn_moe_aux_coef(const nn_moe_aux_t *a);
/* *out: loss (one element) plus coef times the forward's loss, its value alone (the gradient
 * comes through the blocks' routing); loss itself, referenced again, when a is NULL or its
 * coefficient 0. */
fsdpc_status_t nn_moe_aux_add(nn_ctx_t *ctx, const nn_moe_aux_t *a, nn_var_t *loss, nn_var_t **out);
int nn_moe_aux_experts(const nn_moe_aux_t *a); /* its E; 0 for NULL */
/* After a forward that trains: adds its routing to the step's. nn_moe_aux_take_step gives the
 * step's choices per expert (counts[n_experts], every block summed) and its mean loss over
 * the forwards, then starts the next step; false for a NULL or another expert count. */
void nn_moe_aux_end(nn_moe_aux_t *a);
bool nn_moe_aux_take_step(nn_moe_aux_t *a, int64_t *counts, int n_experts, double *loss);

/* Data parallelism: each forward's tokens are one part of a batch split over the ranks of
 * groups[0..n) together (every data-parallel rank, each routing its own samples), and the
 * gradients are averaged over weight (>= 1) such parts. nn_moe_aux_share, after a forward
 * that trains and before the loss is read, then sums its statistics over those ranks, so that
 * the loss and its gradient are those of the whole batch's tokens (Megatron's global
 * auxiliary loss), the same however it is split; the gradient is scaled by weight against the
 * averaging. The step's expert choices stay this rank's own. nn_moe_aux_share does nothing
 * without groups or with a coefficient of 0; it is collective over the groups. Groups must
 * outlive a. */
#define NN_MOE_SHARE_MAX 4
fsdpc_status_t nn_moe_aux_share_over(nn_moe_aux_t *a, pg_t *const *groups, int n, double weight);
fsdpc_status_t nn_moe_aux_share(nn_moe_aux_t *a);
/* Statistics v (nn_moe_aux_stats_len doubles, below) summed over those groups in place, as
 * nn_moe_aux_share sums a forward's; nothing without groups or with a coefficient of 0. */
fsdpc_status_t nn_moe_aux_stats_share(const nn_moe_aux_t *a, double *v);

/* A forward whose blocks run on several ranks (pipeline stages): the statistics the loss and
 * its gradient are made of, as nn_moe_aux_stats_len doubles (the tokens routed, each expert's
 * choices, each expert's probabilities summed), can be summed over those ranks, then set back
 * before the blocks' backward. nn_moe_aux_stats_add adds the last forward's to v;
 * nn_moe_aux_stats_set makes v the forward's (what nn_moe_aux_loss and the blocks' backward
 * use); nn_moe_aux_loss_of is the loss of v; nn_moe_aux_step_add adds a forward to the step's
 * figures: the expert choices of mine (this rank's blocks), the loss of total (all of them).
 * nn_moe_aux_stats_len is 0 for NULL; the others do nothing with a NULL a or v. Local. */
int nn_moe_aux_stats_len(const nn_moe_aux_t *a);
void nn_moe_aux_stats_add(const nn_moe_aux_t *a, double *v);
void nn_moe_aux_stats_set(nn_moe_aux_t *a, const double *v);
double nn_moe_aux_loss_of(const nn_moe_aux_t *a, const double *v);
void nn_moe_aux_step_add(nn_moe_aux_t *a, const double *mine, const double *total);

/* Tokens each expert received in the module's last forward (counts[n_experts]); false when
 * m is not a MoE block or has not run. Local. */
bool nn_moe_last_load(const nn_module_t *m, int64_t *counts, int n_experts);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
