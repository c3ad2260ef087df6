/*
 * The reference model: Llama with the math of Hugging Face's LlamaForCausalLM and its
 * parameter names (docs/design.md, "The reference model and training math"), and the
 * architectures of its family that differ only in a few features: Qwen2 (biases on the q, k
 * and v projections) and Qwen3 (an RMSNorm of each query and key head before the rotary
 * embedding, and a head size of its own), with their Hugging Face names; and GPT-2
 * (GPT2LMHeadModel: learned positions, LayerNorm with bias, a fused c_attn, every projection
 * with a bias and its weight stored [in, out] as transformers' Conv1D, GELU's tanh form, under
 * transformers' names transformer.wte, transformer.h.{i}.attn.c_attn, ...). GPT-2 trains
 * without dropout.
 *
 *   llama_config_t cfg;
 *   llama_t *model;
 *   FSDPC_TRY(llama_config_from_hf("config.json", &cfg));
 *   llama_options_t opt = LLAMA_OPTIONS_INIT;
 *   FSDPC_TRY(llama_new(&cfg, &opt, &model));          // parameters on a one-rank mesh
 *   FSDPC_TRY(llama_init_weights(model, 1234));        // plan-independent init
 *
 * Deferred initialisation (a model larger than one rank): opt.deferred = true builds meta
 * parameters; apply tensor parallelism and fully_shard, then
 *   FSDPC_TRY(nn_module_materialize(llama_module(model)));   // memory for this rank's shards only
 *   FSDPC_TRY(llama_init_weights(model, 1234));              // or ckpt_load_hf, a checkpoint load
 *   FSDPC_TRY(nn_call(ctx, llama_module(model), ids, &logits));   // ids: I32/I64 [B, T]
 *   llama_free(model);
 *
 * Module tree (FQNs): "" (the causal LM) -> model -> embed_tokens, layers.{i} ->
 * {input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
 * mlp.{gate,up,down}_proj}, model.norm; lm_head (sharing model.embed_tokens.weight when
 * embeddings are tied, in which case there is no lm_head.weight).
 * Every leaf computes from its parameters' `compute` tensors, so fully_shard and tensor
 * parallelism work by hooks and parameter replacement; attention derives its local head count
 * from the local q/k projection shapes.
 */
#ifndef FSDPC_NN_LLAMA_H
#define FSDPC_NN_LLAMA_H

#include <stdint.h>

#include "core/kernels.h"
#include "nn/autograd.h"

#ifdef __cplusplus
extern "C" {
#endif
#pragma GCC visibility push(default) /* the API: exported (the library builds hidden) */

/* The architectures of the family, as Hugging Face's model_type names them. */
typedef enum llama_arch {
  LLAMA_ARCH_LLAMA,
  LLAMA_ARCH_QWEN2,
  LLAMA_ARCH_QWEN3,
  LLAMA_ARCH_GPT2,
  LLAMA_ARCH_QWEN3_MOE,
  LLAMA_ARCH_MIXTRAL,
  LLAMA_ARCH_QWEN2_MOE,
  LLAMA_ARCH_COUNT
} llama_arch_t;

typedef struct llama_config {
  llama_arch_t arch;   /* model_type */
  int64_t dim;         /* hidden_size */
  int64_t n_layers;    /* num_hidden_layers */
  int64_t n_heads;     /* num_attention_heads */
  int64_t n_kv_heads;  /* num_key_value_heads */
  int64_t ffn_dim;     /* intermediate_size */
  int64_t vocab_size;  /* vocab_size */
  int64_t max_seq_len; /* max_position_embeddings */
  rope_t rope;         /* rope_theta, and rope_scaling or rope_parameters */
  double norm_eps;     /* rms_norm_eps */
  bool tie_embeddings; /* tie_word_embeddings */
  int64_t head_dim;    /* head_dim; 0: dim / n_heads */
  bool qkv_bias;       /* biases on q_proj, k_proj, v_proj (Qwen2's; attention_bias) */
  bool o_bias;         /* a bias on o_proj (attention_bias of Llama and Qwen3) */
  bool qk_norm;        /* RMSNorm of each q and k head, q_norm and k_norm (Qwen3's) */
  double init_std;     /* initializer_range: the normal initialisation's deviation */
  /* Not Hugging Face's: the embedding's and head's rows, vocab_size rounded up to a multiple
   * of this (0 or 1: vocab_size rows). The rows beyond vocab_size are never read: the model's
   * logits are vocab_size wide, their gradients zero, and the Hugging Face files leave them
   * out. Products of 50304 rows run at full speed where GPT-2's 50257 do not, and tensor
   * parallelism splits them. */
  int64_t pad_vocab_multiple;
  /* Qwen3-MoE (qwen3_moe): the MLP of a sparse layer is a mixture-of-experts block (nn/moe.h)
   * of n_experts SwiGLU experts of moe_ffn_dim, top_k of them for each token, their weights
   * renormalised to sum 1 when norm_topk; layer i is sparse when it is not one of
   * mlp_only_layers and i + 1 is a multiple of sparse_step (llama_layer_is_moe). The dense
   * layers keep the MLP of ffn_dim. No experts (0): every layer dense. Mixtral (mixtral):
   * Llama's attention, every layer sparse (block_sparse_moe: gate, experts w1, w3, w2),
   * num_local_experts of intermediate_size, renormalised. Qwen2-MoE (qwen2_moe): Qwen2's
   * attention, Qwen3-MoE's sparse layers plus a shared expert of shared_ffn_dim gated by a
   * sigmoid (mlp.shared_expert, mlp.shared_expert_gate). */
  int64_t n_experts;    /* num_experts (Mixtral's num_local_experts) */
  int64_t top_k;        /* num_experts_per_tok */
  int64_t moe_ffn_dim;  /* moe_intermediate_size (Mixtral's intermediate_size) */
  int64_t sparse_step;  /* decoder_sparse_step */
  bool norm_topk;       /* norm_topk_prob */
  int64_t shared_ffn_dim; /* shared_expert_intermediate_size (Qwen2-MoE's); 0: none */
  uint64_t mlp_only[4]; /* mlp_only_layers: bit i of word i / 64 for layer i (below 256) */
  /* The router's load-balancing loss added to the training loss with this weight
   * (router_aux_loss_coef when output_router_logits; 0: none; nn/moe.h's nn_moe_aux_t) */
  double aux_loss_coef;
  /* The config's router_aux_loss_coef as read, also when output_router_logits leaves it unused,
   * so that the written config keeps it; router_aux_loss_given: the config named it (else the
   * family's default, 0.001, is written) */
  double router_aux_loss_coef;
  bool router_aux_loss_given;
} llama_config_t;

/* The most layers mlp_only_layers can name (llama_config_t.mlp_only). */
#define LLAMA_MAX_MLP_ONLY 256

/* Hugging Face's LlamaConfig defaults for what a config.json may leave out. */
#define LLAMA_CONFIG_INIT                                                               \
  {                                                                                     \
    .dim = 4096, .n_layers = 32, .n_heads = 32, .n_kv_heads = 32, .ffn_dim = 11008,     \
    .vocab_size = 32000, .max_seq_len = 2048,                                           \
    .rope = {.theta = 10000.0, .scaling = ROPE_DEFAULT, .factor = 1}, .norm_eps = 1e-6, \
    .tie_embeddings = false, .init_std = 0.02, .sparse_step = 1                         \
  }

/* The architecture's model_type ("llama", "qwen2", "qwen3", "gpt2", "qwen3_moe", "mixtral",
 * "qwen2_moe"), and the arch of a model_type (false for one not of the family). */
const char *llama_arch_name(llama_arch_t arch);
bool llama_arch_from_name(const char *model_type, llama_arch_t *out);

/* The shape parameter fqn of arch has in Hugging Face's files (to_hf) or here (!to_hf), given
 * its shape (ndim, shape) on the other side, into out (room for ndim + 1); returns its number
 * of dimensions, or -1 for NULL pointers or ndim outside [0, TENSOR_MAX_DIMS]. The same bytes
 * either way: only GPT-2's c_attn differs, weight [dim, 3, dim] here and [dim, 3 dim] there,
 * bias [3, dim] and [3 dim] (here q, k and v each a dimension of their own, for tensor
 * parallelism to split by head). */
int llama_hf_shape(llama_arch_t arch, const char *fqn, int ndim, const int64_t *shape, bool to_hf,
                   int64_t *out);

/* The model's name for tensor `name` of arch's Hugging Face files into buf (true; cut to
 * fit), or false for a tensor that is no parameter, to skip. GPT-2's files
 * saved from the base model (the Hub's openai-community/gpt2) leave out "transformer.",
 * which transformers adds back (base_model_prefix), and hold each layer's attention masks
 * h.N.attn.bias and h.N.attn.masked_bias, buffers that transformers skips; the other
 * architectures' names are the model's. */
bool llama_hf_canonical(llama_arch_t arch, const char *name, char *buf, size_t size);

/* The rows of the embedding and head: vocab_size rounded up to a multiple of
 * pad_vocab_multiple (vocab_size when that is 0 or 1); 0 for NULL. */
int64_t llama_vocab_rows(const llama_config_t *c);

/* Whether fqn names a parameter whose rows are the vocabulary's in one of the family's
 * architectures (model.embed_tokens.weight, transformer.wte.weight, lm_head.weight). */
bool llama_is_vocab_table(const char *fqn);

/* Whether layer i's MLP is a mixture of experts (Qwen3-MoE's sparse layers); false for NULL
 * or i outside [0, n_layers). */
bool llama_layer_is_moe(const llama_config_t *c, int64_t i);
/* How many of the layers are (0 for NULL). */
int64_t llama_num_moe_layers(const llama_config_t *c);

/* The size of an attention head: head_dim, or dim / n_heads when it is 0. */
int64_t llama_head_dim(const llama_config_t *c);

/* Checks sizes: all positive, an even head size (dim divisible by n_heads when head_dim is
 * 0), n_heads a multiple of n_kv_heads; and the rotary embedding (rope_check). */
fsdpc_status_t llama_config_check(const llama_config_t *c);

/* Reads a Hugging Face config.json of model_type llama, qwen2 or qwen3 (hidden_size,
 * num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
 * vocab_size, rms_norm_eps, tie_word_embeddings, max_position_embeddings, attention_bias,
 * initializer_range, and the rotary embedding as transformers 4 writes it, rope_theta and
 * rope_scaling, or as transformers 5 does, rope_parameters), with each architecture's
 * defaults for what it leaves out; refuses features the model does not have (MLP biases,
 * sliding-window attention, rope types other than default, linear and llama3, another
 * activation). Errors name the file and the key. A key "pad_vocab_multiple" (not Hugging
 * Face's: what llama_config_to_hf writes of a padded config) gives pad_vocab_multiple. */
fsdpc_status_t llama_config_from_hf(const char *path, llama_config_t *out);

/* The same from config.json's text; errors name origin. */
fsdpc_status_t llama_config_from_hf_text(const char *text, const char *origin, llama_config_t *out);

/* Writes the config as a Hugging Face config.json of its architecture (LlamaForCausalLM,
 * Qwen2ForCausalLM or Qwen3ForCausalLM; a scaled rotary embedding as rope_scaling, which
 * transformers 4 and 5 both read), with "pad_vocab_multiple" when it is above 1 (for a
 * Hugging Face folder, write a copy whose pad_vocab_multiple is 0). */
fsdpc_status_t llama_config_to_hf(const llama_config_t *c, dtype_t dtype, const char *path);

/* The same as text (*out, freed by the caller with free()). */
fsdpc_status_t llama_config_to_hf_text(const llama_config_t *c, dtype_t dtype, char **out);

/* Number of parameters (the lm_head counted only when untied; the padded rows of the
 * embedding and head, llama_vocab_rows, included). */
int64_t llama_num_params(const llama_config_t *c);

/* True when a and b give the same parameters (names and shapes: every field but
 * max_seq_len, rope, norm_eps and init_std); otherwise why (if not NULL) receives the first
 * difference, as "n_layers 2 vs 4". */
bool llama_config_same_params(const llama_config_t *a, const llama_config_t *b, char *why,
                              size_t size);

/* A config's number x into buf in the fewest digits that read back as x ("1e-05", not
 * "1.0000000000000001e-05"; an integer in full). */
void llama_config_number(double x, char *buf, size_t n);

/* True when a and b, with the same parameters, compute the same function: the rotary
 * embedding (theta and scaling), norm_eps and the routing (num_experts_per_tok,
 * norm_topk_prob); otherwise why as above, under Hugging Face's key names ("rope_theta 1e+06
 * vs 10000"). */
bool llama_config_same_function(const llama_config_t *a, const llama_config_t *b, char *why,
                                size_t size);

typedef struct llama_options {
  dtype_t dtype;                 /* parameter dtype */
  device_type_t device;          /* where parameters live (this rank's device) */
  bool activation_checkpointing; /* per transformer block */
  bool deferred; /* parameters are meta (shapes only, no memory) until nn_module_materialize */
} llama_options_t;

#define LLAMA_OPTIONS_INIT \
  { .dtype = DTYPE_F32, .device = DEVICE_CPU, .activation_checkpointing = false, .deferred = false }

typedef struct llama llama_t;

/* Builds the module tree with zero parameters, each Replicate on a one-rank mesh owned by the
 * model; with opt->deferred the parameters are meta instead, so that a model larger than
 * one rank can be built, parallelised (tensor_parallel, fully_shard) and then given memory
 * for its shards only (nn_module_materialize) before llama_init_weights or a load. Local. */
fsdpc_status_t llama_new(const llama_config_t *cfg, const llama_options_t *opt, llama_t **out);
void llama_free(llama_t *m);

/* Linear and embedding weights ~ N(0, init_std), biases 0, norm weights 1 (init.h), as
 * Hugging Face initialises the family, each rank filling its local shards: the same global
 * values under every plan. Parameters without memory (meta: another pipeline stage's) are left
 * alone. Local. */
fsdpc_status_t llama_init_weights(llama_t *m, uint64_t seed);

nn_module_t *llama_module(const llama_t *m);
const llama_config_t *llama_get_config(const llama_t *m);
/* The transformer block i (module "model.layers.i"); NULL for i outside [0, n_layers). */
nn_module_t *llama_layer(const llama_t *m, int64_t i);
/* Pipeline stage `stage` of n_stages (1 <= n_stages <= n_layers) of the model's forward: the
 * blocks of llama_stage_range (by default [stage L / n_stages, (stage + 1) L / n_stages) of its
 * L), after the embedding of the
 * ids [B, T] on stage 0 (GPT-2's positions added), before the final norm and the head on the
 * last stage (which returns the logits; the others the hidden state [B, T, dim], which the
 * next stage takes as in). The modules run as nn_call runs them, hooks included, but the
 * containers above them ("model", the root): a stage's fully_shard units are its blocks and
 * leaves. A reference to in is taken, not consumed. Local. */
fsdpc_status_t llama_stage_forward(nn_ctx_t *ctx, llama_t *m, int stage, int n_stages, nn_var_t *in,
                                   nn_var_t **out);

/* Stage `stage` of n_stages's blocks [*first, *end): by llama_set_stage_splits for that stage
 * count, else the even split [stage L / n_stages, (stage + 1) L / n_stages). false for a stage
 * out of range. Local. */
bool llama_stage_range(const llama_t *m, int stage, int n_stages, int64_t *first, int64_t *end);

/* Splits the model into n_stages stages at first_blocks[0..n_stages) (each stage's first
 * block: 0, then rising, below n_layers; TorchTitan's split points) instead of evenly: the
 * stage functions with that stage count follow them. Local. */
fsdpc_status_t llama_set_stage_splits(llama_t *m, const int64_t *first_blocks, int n_stages);

/* The modules pipeline stage `stage` of n_stages holds (as llama_stage_forward runs them):
 * the embedding(s) on stage 0, its blocks, the final norm and lm_head on the last (and with
 * tied embeddings the token embedding too, whose weight lm_head uses: both ends hold it). Writes up
 * to cap of them into out; returns how many there are (-1 for a stage out of range). Local. */
int llama_stage_modules(const llama_t *m, int stage, int n_stages, nn_module_t **out, int cap);

/* The one-rank mesh the parameters were created on. */
mesh_t *llama_local_mesh(const llama_t *m);

/* Turns activation checkpointing of every transformer block on or off. */
void llama_set_activation_checkpointing(llama_t *m, bool enabled);

#pragma GCC visibility pop
#ifdef __cplusplus
}
#endif

#endif
