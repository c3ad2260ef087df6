/*
 * The C Llama against golden values from an independent PyTorch model
 * (tests/reference/make_goldens.py): logits, loss and every gradient of one step, and the
 * losses of ten AdamW steps with parameter groups, clipping and the schedule; untied and tied
 * embeddings, with and without activation checkpointing; the rotary embedding of both
 * transformers config forms, llama3 scaling included; and the family's Qwen2 (q, k, v biases)
 * and Qwen3 (q_norm, k_norm, a head_dim of its own, tied), and GPT-2.
 *
 * Run with argument "cuda" (the GPU suite) the same checks run on the GPU in fp32, and a bf16
 * variant with the wider tolerances documented in tests/README.md.
 */
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint/hf_weights.h"
#include "checkpoint/safetensors.h"
#include "core/file.h"
#include "models/llama/llama.h"
#include "nn/moe.h"
#include "nn/ops.h"
#include "nn/optim.h"
#include "tests/harness.h"
#include "train/data.h"

#define REF SOURCE_ROOT "/tests/reference/"
#define CORPUS SOURCE_ROOT "/data/corpus.txt"
#define STEPS 10

typedef struct run_mode {
  device_type_t device;
  dtype_t dtype;
  double tol_logits, tol_grad, tol_losses;
} run_mode_t;

static run_mode_t mode = {DEVICE_CPU, DTYPE_F32, 1e-5, 1e-4, 1e-5};

static void ok(fsdpc_status_t st) {
  ck_assert_msg(st == STATUS_OK, "%s: %s", status_str(st), err_detail());
}

static void path_of(char *buf, size_t n, const char *tag, const char *what) {
  snprintf(buf, n, REF "%s_%s", tag, what);
}

static st_file_t *open_golden(const char *tag) {
  char path[512];
  path_of(path, sizeof path, tag, "golden.safetensors");
  st_file_t *f;
  ok(st_open(path, &f));
  return f;
}

/* The model of config CONFIG_config.json with the initial weights golden TAG was made from:
 * the file its metadata "init" names, else TAG_init.safetensors. */
static llama_t *load_model(const char *config, const char *tag, bool ac) {
  char path[512];
  llama_config_t cfg;
  path_of(path, sizeof path, config, "config.json");
  ok(llama_config_from_hf(path, &cfg));
  llama_options_t opt = LLAMA_OPTIONS_INIT;
  opt.device = mode.device;
  opt.dtype = mode.dtype;
  opt.activation_checkpointing = ac;
  llama_t *m;
  ok(llama_new(&cfg, &opt, &m));
  st_file_t *g = open_golden(tag);
  const char *init = st_metadata(g, "init");
  if (init != NULL)
    snprintf(path, sizeof path, REF "%s", init);
  else
    path_of(path, sizeof path, tag, "init.safetensors");
  st_close(g);
  ok(ckpt_load_weights(llama_module(m), path));
  return m;
}

/* A golden tensor on the host as f32. */
static void golden(st_file_t *f, const char *name, fsdpc_tensor_t *out) {
  const st_info_t *info = st_find(f, name);
  ck_assert_msg(info != NULL, "golden file has no %s", name);
  ok(tensor_init(out, DTYPE_F32, device_cpu(), info->ndim, info->shape));
  ok(st_read(f, name, out));
}

static data_spec_t spec_of(st_file_t *g) {
  data_spec_t s = {.batch_size = 2, .seq_len = 32, .grad_accum = 1, .dp_size = 1, .dp_rank = 0};
  ck_assert_str_eq(st_metadata(g, "batch_size"), "2");
  ck_assert_str_eq(st_metadata(g, "seq_len"), "32");
  return s;
}

/* One forward + backward on step `step`'s batch; returns logits (caller frees) and loss. */
static void step_fwd_bwd(llama_t *m, const fsdpc_data_t *d, const data_spec_t *spec, int64_t step,
                         nn_ctx_t *ctx, fsdpc_tensor_t *logits_out, double *loss_out) {
  fsdpc_tensor_t in_h, tg_h, in, tg;
  ok(data_batch(d, spec, step, 0, &in_h, &tg_h));
  device_t dev = mesh_device(llama_local_mesh(m));
  ok(tensor_clone(&in, &in_h, DTYPE_I64, dev));
  ok(tensor_clone(&tg, &tg_h, DTYPE_I64, dev));
  nn_var_t *ids, *logits, *loss;
  ok(nn_var_new(&in, false, &ids));
  nn_moe_aux_t *aux = nn_moe_aux_of(llama_module(m)); /* Qwen3-MoE's load-balancing loss */
  nn_moe_aux_begin(aux, 1.0);
  ok(nn_call(ctx, llama_module(m), ids, &logits));
  ok(nn_cross_entropy(ctx, logits, &tg, &loss, NULL));
  nn_var_t *sum; /* loss + coef aux, its gradient coming through the routers */
  ok(nn_moe_aux_add(ctx, aux, loss, &sum));
  nn_var_put(loss);
  loss = sum;
  ok(nn_var_scalar(loss, loss_out));
  ok(nn_backward(ctx, loss));
  if (logits_out) ok(tensor_ref(logits_out, &logits->value));
  nn_var_put(loss);
  nn_var_put(logits);
  nn_var_put(ids);
  tensor_free(&tg);
  tensor_free(&in_h);
  tensor_free(&tg_h);
}

/* Step 0 of the model of CONFIG_config.json against golden TAG. */
static void check_step0(const char *config, const char *tag, bool ac) {
  llama_t *m = load_model(config, tag, ac);
  st_file_t *g = open_golden(tag);
  fsdpc_data_t *d;
  ok(data_open(CORPUS, DATA_BYTES, &d));
  data_spec_t spec = spec_of(g);
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  fsdpc_tensor_t logits, ref;
  double loss;
  step_fwd_bwd(m, d, &spec, 0, ctx, &logits, &loss);

  golden(g, "logits", &ref);
  double e = test_rel_l2(&logits, &ref), worst_grad = 0;
  ck_assert_msg(e <= mode.tol_logits, "%s logits: relative error %.3g", tag, e);
  tensor_free(&ref);
  golden(g, "loss", &ref);
  double want = ((float *)ref.data)[0];
  ck_assert_msg(fabs(loss - want) <= mode.tol_logits * fabs(want), "%s loss %.8f, torch %.8f", tag,
                loss, want);
  tensor_free(&ref);

  nn_param_t **ps;
  int n;
  ok(nn_named_parameters(llama_module(m), &ps, &n));
  int grads = 0; /* besides logits, loss, train_losses and (some) trained.* */
  for (int i = 0; i < st_num_tensors(g); i++)
    grads += strncmp(st_tensor(g, i)->name, "grad.", 5) == 0;
  ck_assert_int_eq(n, grads);
  for (int i = 0; i < n; i++) {
    char name[256];
    snprintf(name, sizeof name, "grad.%s", ps[i]->fqn);
    golden(g, name, &ref);
    ck_assert_msg(ps[i]->grad != NULL, "%s has no gradient", ps[i]->fqn);
    /* GPT-2's c_attn is [dim, 3, dim] here, transformers' [dim, 3 dim]: the same elements */
    const fsdpc_tensor_t *grad = dtensor_local(ps[i]->grad);
    fsdpc_tensor_t as;
    ck_assert_int_eq(tensor_numel(grad), tensor_numel(&ref));
    ok(tensor_view(&as, &ref, grad->ndim, grad->shape));
    e = test_rel_l2(grad, &as);
    tensor_free(&as);
    ck_assert_msg(e <= mode.tol_grad, "%s: gradient relative L2 error %.3g", name, e);
    worst_grad = e > worst_grad ? e : worst_grad;
    tensor_free(&ref);
  }
  if (getenv("FSDPC_TEST_VERBOSE"))
    printf("%s%s: loss %.8f (torch %.8f), worst gradient relative L2 %.3g\n", config,
           ac ? " (checkpointed)" : "", loss, want, worst_grad);
  free(ps);
  tensor_free(&logits);
  nn_ctx_free(ctx);
  data_free(d);
  st_close(g);
  llama_free(m);
}

START_TEST(forward_backward_untied) { check_step0("tiny", "tiny", false); }
END_TEST
START_TEST(forward_backward_tied) { check_step0("tiny_tied", "tiny_tied", false); }
END_TEST
START_TEST(forward_backward_checkpointed) {
  check_step0("tiny", "tiny", true);
  check_step0("tiny_tied", "tiny_tied", true);
}
END_TEST

/* The rotary embeddings of transformers 5's config form (theta 5e5 in rope_parameters) and
 * llama3 scaling in both forms (its step-0 q/k gradients differ from theta 5e5 unscaled by
 * ~25%, its logits by 2.6e-3 relative L2). */
START_TEST(forward_backward_rope_variants) {
  check_step0("tiny_v5", "tiny_v5", false);
  check_step0("tiny_llama3", "tiny_llama3", false);
  check_step0("tiny_llama3_v5", "tiny_llama3", false);
}
END_TEST

/* The family's other architectures: Qwen2 (q, k and v biases) and Qwen3 (q_norm and k_norm,
 * head_dim 24 where hidden / heads is 16, tied embeddings). */
START_TEST(forward_backward_qwen) {
  check_step0("tiny_qwen2", "tiny_qwen2", false);
  check_step0("tiny_qwen3", "tiny_qwen3", false);
  check_step0("tiny_qwen3", "tiny_qwen3", true);
}
END_TEST

/* GPT-2: learned positions, LayerNorm with bias, the fused c_attn, Conv1D weights [in, out]
 * loaded as transformers stores them, GELU's tanh form, tied. */
START_TEST(forward_backward_gpt2) {
  check_step0("tiny_gpt2", "tiny_gpt2", false);
  check_step0("tiny_gpt2", "tiny_gpt2", true);
}
END_TEST

/* The model's forward run stage by stage (llama_stage_forward over S stages, each stage's
 * output the next one's input) gives the whole forward's logits exactly, for every S from 1 to
 * the number of blocks; stage counts and stages outside that are refused. */
static void check_stages(const char *config) {
  llama_t *m = load_model(config, config, false);
  fsdpc_data_t *d;
  ok(data_open(CORPUS, DATA_BYTES, &d));
  data_spec_t spec = {.batch_size = 2, .seq_len = 32, .grad_accum = 1, .dp_size = 1};
  fsdpc_tensor_t in_h, tg_h, in;
  ok(data_batch(d, &spec, 0, 0, &in_h, &tg_h));
  ok(tensor_clone(&in, &in_h, DTYPE_I64, mesh_device(llama_local_mesh(m))));
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  nn_ctx_set_grad_enabled(ctx, false);
  nn_var_t *ids, *whole;
  ok(nn_var_new(&in, false, &ids));
  ok(nn_call(ctx, llama_module(m), ids, &whole));
  int64_t L = llama_get_config(m)->n_layers;
  for (int S = 1; S <= L; S++) {
    nn_var_t *h = nn_var_ref(ids);
    for (int s = 0; s < S; s++) {
      nn_var_t *next;
      ok(llama_stage_forward(ctx, m, s, S, h, &next));
      nn_var_put(h);
      h = next;
    }
    bool eq = false;
    ok(tensor_equal(&h->value, &whole->value, &eq));
    ck_assert_msg(eq, "%s: logits of %d stages differ from the whole forward's", config, S);
    nn_var_put(h);
  }
  nn_var_t *none = NULL;
  int bad[][2] = {{0, 0}, {0, -1}, {-1, 2}, {2, 2}, {0, (int)L + 1}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ck_assert_int_eq(llama_stage_forward(ctx, m, bad[i][0], bad[i][1], ids, &none), STATUS_EINVAL);
    ck_assert_ptr_null(none);
  }
  nn_var_put(whole);
  nn_var_put(ids);
  nn_ctx_free(ctx);
  tensor_free(&in_h);
  tensor_free(&tg_h);
  data_free(d);
  llama_free(m);
}

START_TEST(stages_compose_to_the_model) {
  check_stages("tiny");
  check_stages("tiny_gpt2");
}
END_TEST

static void train(const char *config, const char *tag, bool ac, double *losses) {
  llama_t *m = load_model(config, tag, ac);
  st_file_t *g = open_golden(tag);
  fsdpc_data_t *d;
  ok(data_open(CORPUS, DATA_BYTES, &d));
  data_spec_t spec = spec_of(g);
  nn_param_t **ps;
  int n;
  ok(nn_named_parameters(llama_module(m), &ps, &n));
  adamw_config_t cfg = ADAMW_CONFIG_INIT;
  cfg.lr = 3e-3;
  cfg.beta2 = 0.95;
  cfg.weight_decay = 0.1;
  if (strstr(tag, "gpt2") == NULL) { /* make_goldens.py's groups match none of GPT-2's names */
    cfg.groups[cfg.n_groups++] = (adamw_group_t){"*norm*", -1, 0.0};
    cfg.groups[cfg.n_groups++] = (adamw_group_t){"model.embed_tokens.*", 1e-3, -1};
  }
  lr_schedule_t sched = {.warmup_steps = 3, .total_steps = STEPS, .min_ratio = 0.1};
  optim_t *opt;
  ok(optim_new(ps, n, &cfg, &opt));
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  size_t os_allocs = 0;
  for (int s = 0; s < STEPS; s++) {
    if (s == 2) os_allocs = mem_os_allocs(device_cpu());
    optim_zero_grad(opt);
    step_fwd_bwd(m, d, &spec, s, ctx, NULL, &losses[s]);
    ok(clip_grad_norm(ps, n, 1.0, NULL, NULL));
    ok(optim_step(opt, lr_schedule_factor(&sched, s)));
  }
  /* after two steps, host buffers of 64 KiB and more all come from the cache */
  ck_assert_msg(
      mode.device != DEVICE_CPU || (os_allocs > 0 && mem_os_allocs(device_cpu()) == os_allocs),
      "steps 3-%d took %zu blocks from the operating system", STEPS,
      mem_os_allocs(device_cpu()) - os_allocs);
  nn_ctx_free(ctx);
  optim_free(opt);
  free(ps);
  data_free(d);
  st_close(g);
  llama_free(m);
}

static void check_training(const char *config, const char *tag) {
  double losses[STEPS];
  train(config, tag, false, losses);
  st_file_t *g = open_golden(tag);
  fsdpc_tensor_t ref;
  golden(g, "train_losses", &ref);
  ck_assert_int_eq(tensor_numel(&ref), STEPS);
  for (int s = 0; s < STEPS; s++) {
    double want = ((float *)ref.data)[s];
    if (getenv("FSDPC_TEST_VERBOSE"))
      printf("%s step %d: loss %.7f torch %.7f rel %.2g\n", config, s, losses[s], want,
             fabs(losses[s] - want) / want);
    ck_assert_msg(fabs(losses[s] - want) <= mode.tol_losses * fabs(want),
                  "%s step %d: loss %.8f, torch %.8f", tag, s, losses[s], want);
  }
  ck_assert_msg(losses[STEPS - 1] < losses[0], "%s: training did not lower the loss", tag);
  tensor_free(&ref);
  st_close(g);
}

START_TEST(training_untied) { check_training("tiny", "tiny"); }
END_TEST
START_TEST(training_tied) { check_training("tiny_tied", "tiny_tied"); }
END_TEST
START_TEST(training_qwen) {
  check_training("tiny_qwen2", "tiny_qwen2");
  check_training("tiny_qwen3", "tiny_qwen3");
}
END_TEST

START_TEST(training_gpt2) { check_training("tiny_gpt2", "tiny_gpt2"); }
END_TEST

/* Qwen3-MoE: layer 0 a sparse block (4 experts of 32, top-2 renormalised), layer 1 dense
 * (mlp_only_layers); the logits, loss and every gradient of step 0, with and without
 * activation checkpointing, and ten training steps, without and with the routers'
 * load-balancing loss; its parameter count. (The MoE operations run on the host in f32: the
 * CPU suite only.) */
/* On the CPU and in the GPU suite (f32: bf16 could flip a near-tied routing choice). */
START_TEST(qwen3_moe_trains_as_torch) {
  check_step0("tiny_qwen3_moe", "tiny_qwen3_moe", false);
  check_step0("tiny_qwen3_moe", "tiny_qwen3_moe", true);
  check_training("tiny_qwen3_moe", "tiny_qwen3_moe");
  /* with the routers' load-balancing loss (coefficient 0.1), checkpointed blocks too */
  check_step0("tiny_qwen3_moe_aux", "tiny_qwen3_moe_aux", false);
  check_step0("tiny_qwen3_moe_aux", "tiny_qwen3_moe_aux", true);
  check_training("tiny_qwen3_moe_aux", "tiny_qwen3_moe_aux");
}
END_TEST

/* The parameters of c's model (built meta) number llama_num_params(c); with the parameter
 * `has` (not NULL) among them and `lacks` not. */
static void check_params(const llama_config_t *c, const char *has, const char *lacks) {
  llama_options_t opt = LLAMA_OPTIONS_INIT;
  opt.deferred = true;
  llama_t *m;
  ok(llama_new(c, &opt, &m));
  nn_param_t **ps;
  int n;
  int64_t total = 0;
  ok(nn_named_parameters(llama_module(m), &ps, &n));
  for (int i = 0; i < n; i++) total += tensor_numel(dtensor_local(ps[i]->value));
  free(ps);
  ck_assert_int_eq(total, llama_num_params(c));
  if (has) ck_assert_msg(nn_param_find(llama_module(m), has) != NULL, "no parameter %s", has);
  if (lacks) ck_assert_msg(nn_param_find(llama_module(m), lacks) == NULL, "a parameter %s", lacks);
  llama_free(m);
}

/* Golden tag's model saved by ckpt_save_weights under Hugging Face's names (the file holds
 * `holds`, not `lacks`) and loaded back into a fresh model of c: every parameter the same. */
static void check_saved_names(const char *tag, const llama_config_t *c, const char *holds,
                              const char *lacks) {
  llama_t *a = load_model(tag, tag, false), *b;
  llama_options_t opt = LLAMA_OPTIONS_INIT;
  ok(llama_new(c, &opt, &b));
  char path[] = "/tmp/fsdpc-moe-XXXXXX";
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  close(fd);
  ok(ckpt_save_weights(llama_module(a), path));
  st_file_t *f;
  ok(st_open(path, &f));
  ck_assert_msg(st_find(f, holds) != NULL, "%s: no tensor %s", tag, holds);
  ck_assert_msg(st_find(f, lacks) == NULL, "%s: a tensor %s", tag, lacks);
  st_close(f);
  ok(ckpt_load_weights(llama_module(b), path));
  unlink(path);
  nn_param_t **ps;
  int n;
  ok(nn_named_parameters(llama_module(a), &ps, &n));
  for (int i = 0; i < n; i++) {
    bool same = false;
    ok(tensor_equal(dtensor_local(ps[i]->value),
                    dtensor_local(nn_param_find(llama_module(b), ps[i]->fqn)->value), &same));
    ck_assert_msg(same, "%s differs after a save and a load", ps[i]->fqn);
  }
  free(ps);
  llama_free(a);
  llama_free(b);
}

/* Qwen2-MoE: Qwen2's attention biases, layer 0 dense, layer 1 sparse (4 experts of 32, top-2
 * not renormalised, a shared expert of 40 gated by a sigmoid), the routers' loss (0.05): step
 * 0 with and without checkpointing and ten training steps against the torch model; the config
 * read and written back; the parameter count; the shared expert's names. */
START_TEST(qwen2_moe_trains_as_torch) {
  check_step0("tiny_qwen2_moe", "tiny_qwen2_moe", false);
  check_step0("tiny_qwen2_moe", "tiny_qwen2_moe", true);
  check_training("tiny_qwen2_moe", "tiny_qwen2_moe");
  if (mode.device != DEVICE_CPU) return;
  llama_config_t c, back;
  ok(llama_config_from_hf(REF "tiny_qwen2_moe_config.json", &c));
  ck_assert(c.arch == LLAMA_ARCH_QWEN2_MOE && c.shared_ffn_dim == 40 && c.qkv_bias && !c.o_bias &&
            !c.norm_topk && !llama_layer_is_moe(&c, 0) && llama_layer_is_moe(&c, 1) &&
            c.aux_loss_coef == 0.05);
  char *text, why[128] = "";
  ok(llama_config_to_hf_text(&c, DTYPE_F32, &text));
  ok(llama_config_from_hf_text(text, "written", &back));
  free(text);
  ck_assert_msg(llama_config_same_params(&c, &back, why, sizeof why), "%s", why);
  check_params(&c, "model.layers.1.mlp.shared_expert_gate.weight", NULL);
  check_saved_names("tiny_qwen2_moe", &c, "model.layers.1.mlp.shared_expert.down_proj.weight",
                    "model.layers.1.mlp.experts.down_proj");
}
END_TEST

/* Mixtral: Llama's attention, both layers sparse (4 experts of 48, w1, w3, w2, top-2
 * renormalised) with the routers' load-balancing loss (0.02): step 0 with and without
 * activation checkpointing and ten training steps against the torch model. */
START_TEST(mixtral_trains_as_torch) {
  check_step0("tiny_mixtral", "tiny_mixtral", false);
  check_step0("tiny_mixtral", "tiny_mixtral", true);
  check_training("tiny_mixtral", "tiny_mixtral");
}
END_TEST

/* Mixtral's config, parameter count and Hugging Face names: MixtralConfig's keys read and
 * written back (the experts' size is intermediate_size, the loss with output_router_logits),
 * the weights saved as its files name them (block_sparse_moe.experts.J.w1.weight) and loaded
 * back the same. */
START_TEST(mixtral_against_torch) {
  llama_config_t c;
  ok(llama_config_from_hf(REF "tiny_mixtral_config.json", &c));
  ck_assert(c.arch == LLAMA_ARCH_MIXTRAL && c.n_experts == 4 && c.top_k == 2 &&
            c.moe_ffn_dim == 48 && c.norm_topk && c.aux_loss_coef == 0.02 &&
            llama_layer_is_moe(&c, 0) && llama_layer_is_moe(&c, 1) && !c.qkv_bias && !c.o_bias &&
            !c.qk_norm && c.rope.theta == 1e6);
  char *text;
  ok(llama_config_to_hf_text(&c, DTYPE_F32, &text));
  llama_config_t back;
  ok(llama_config_from_hf_text(text, "written", &back));
  char why[128] = "";
  ck_assert_msg(llama_config_same_params(&c, &back, why, sizeof why), "%s", why);
  ck_assert(back.aux_loss_coef == 0.02 && back.norm_topk && back.moe_ffn_dim == 48);
  ck_assert(strstr(text, "\"num_local_experts\"") && !strstr(text, "moe_intermediate_size") &&
            !strstr(text, "use_sliding_window"));
  free(text);
  check_params(&c, "model.layers.0.block_sparse_moe.experts.w3",
               "model.layers.0.mlp.experts.up_proj");
  check_saved_names("tiny_mixtral", &c, "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                    "model.layers.1.block_sparse_moe.experts.w2");
}
END_TEST

START_TEST(qwen3_moe_against_torch) {
  llama_config_t c;
  ok(llama_config_from_hf(REF "tiny_qwen3_moe_aux_config.json", &c));
  ck_assert(c.aux_loss_coef == 0.1);
  char *text;
  ok(llama_config_to_hf_text(&c, DTYPE_F32, &text)); /* written back with the loss */
  c.aux_loss_coef = 0;
  ok(llama_config_from_hf_text(text, "written", &c));
  ck_assert(c.aux_loss_coef == 0.1);
  free(text);
  ok(llama_config_from_hf(REF "tiny_qwen3_moe_config.json", &c));
  ck_assert(llama_layer_is_moe(&c, 0) && !llama_layer_is_moe(&c, 1));
  check_params(&c, NULL, NULL);
  /* the experts' names in Hugging Face's files, both ways */
  char name[128], fqn[128];
  int64_t j = -1;
  ck_assert(hf_expert_name("model.layers.3.mlp.experts.up_proj", 7, name, sizeof name));
  ck_assert_str_eq(name, "model.layers.3.mlp.experts.7.up_proj.weight");
  ck_assert(hf_expert_of(name, fqn, sizeof fqn, &j) && j == 7);
  ck_assert_str_eq(fqn, "model.layers.3.mlp.experts.up_proj");
  ck_assert(hf_expert_name("experts.down_proj", 0, name, sizeof name));
  ck_assert_str_eq(name, "experts.0.down_proj.weight");
  const char *not_stacked[] = {"model.layers.0.mlp.gate_proj", "model.subexperts.up_proj",
                               "model.experts", "experts."};
  for (size_t i = 0; i < sizeof not_stacked / sizeof not_stacked[0]; i++)
    ck_assert_msg(!hf_expert_name(not_stacked[i], 0, name, sizeof name), "%s", not_stacked[i]);
  const char *not_expert[] = {
      "model.layers.0.mlp.experts.up_proj", "model.layers.0.mlp.experts.01.up_proj.weight",
      "model.layers.0.mlp.experts.1.up_proj.bias", "model.layers.0.mlp.experts.x.up_proj.weight"};
  for (size_t i = 0; i < sizeof not_expert / sizeof not_expert[0]; i++)
    ck_assert_msg(!hf_expert_of(not_expert[i], fqn, sizeof fqn, &j), "%s", not_expert[i]);
  ck_assert(!hf_expert_name("model.experts.up_proj", 0, name, 12)); /* does not fit */
  /* saved under those names, loaded back the same */
  check_saved_names("tiny_qwen3_moe", &c, "model.layers.0.mlp.experts.3.down_proj.weight",
                    "model.layers.0.mlp.experts.down_proj");
}
END_TEST

START_TEST(training_rope_variants) {
  check_training("tiny_v5", "tiny_v5");
  check_training("tiny_llama3", "tiny_llama3");
  check_training("tiny_llama3_v5", "tiny_llama3");
}
END_TEST

/* Activation checkpointing changes no number: bit-identical gradients, lower peak memory. The
 * batch is the largest the tiny model takes, so that the activations outweigh what a device
 * allocates per call (cuBLASLt's workspace, attention's scratch): at 2 x 32 a call's 4 MiB
 * workspace on CUDA makes the peak that of whichever product asks for the most, not that of
 * the activations. */
START_TEST(checkpointing_bit_identical) {
  device_t dev = mode.device == DEVICE_CUDA ? world_device() : device_cpu();
  llama_t *m[2];
  size_t peak[2];
  fsdpc_data_t *d;
  ok(data_open(CORPUS, DATA_BYTES, &d));
  data_spec_t spec = {.batch_size = 8, .seq_len = 64, .grad_accum = 1, .dp_size = 1};
  for (int k = 0; k < 2; k++) {
    m[k] = load_model("tiny", "tiny", k == 1);
    nn_ctx_t *ctx;
    ok(nn_ctx_new(&ctx));
    size_t base = mem_stats(dev).current;
    mem_reset_peak(dev);
    double loss;
    step_fwd_bwd(m[k], d, &spec, 3, ctx, NULL, &loss);
    peak[k] = mem_stats(dev).peak - base;
    nn_ctx_free(ctx);
  }
  nn_param_t **p0, **p1;
  int n0, n1;
  ok(nn_named_parameters(llama_module(m[0]), &p0, &n0));
  ok(nn_named_parameters(llama_module(m[1]), &p1, &n1));
  ck_assert_int_eq(n0, n1);
  for (int i = 0; i < n0; i++) {
    bool eq = false;
    ok(tensor_equal(dtensor_local(p0[i]->grad), dtensor_local(p1[i]->grad), &eq));
    ck_assert_msg(eq, "%s: gradient differs with activation checkpointing", p0[i]->fqn);
  }
  if (getenv("FSDPC_TEST_VERBOSE"))
    printf("peak with checkpointing %zu bytes, without %zu\n", peak[1], peak[0]);
  ck_assert_msg(peak[1] < peak[0], "checkpointing peak %zu bytes, without %zu", peak[1], peak[0]);
  free(p0);
  free(p1);
  llama_free(m[0]);
  llama_free(m[1]);
  data_free(d);
}
END_TEST

/* transformers 4 writes rope_theta at the top level and scaling in rope_scaling, transformers
 * 5 both in rope_parameters; both give the same model. Types not implemented are refused by
 * name, as are incomplete or contradictory sections. */
START_TEST(config_forms_of_transformers_4_and_5) {
  const char *base =
      "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
      "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
      "\"intermediate_size\": 160, \"vocab_size\": 256, "
      "\"max_position_embeddings\": 128%s}";
#define L3 "\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
  const rope_t plain4 = {1e4, ROPE_DEFAULT, 1, 0, 0, 0}, plain5 = {5e5, ROPE_DEFAULT, 1, 0, 0, 0},
               llama3 = {5e5, ROPE_LLAMA3, 8, 1, 4, 8192}, linear = {1e4, ROPE_LINEAR, 2, 0, 0, 0};
  const struct {
    const char *extra;
    const rope_t *want; /* NULL: refused */
    const char *said;   /* in the refusal */
  } cases[] = {
      {"", &plain4, NULL},
      {", \"rope_theta\": 500000.0", &plain5, NULL},
      {", \"rope_theta\": 500000.0, \"rope_scaling\": null", &plain5, NULL},
      {", \"rope_parameters\": {\"rope_theta\": 500000.0, \"rope_type\": \"default\"}", &plain5,
       NULL},
      {", \"rope_theta\": 500000.0, \"rope_parameters\": {\"rope_theta\": 500000.0, "
       "\"rope_type\": \"default\"}",
       &plain5, NULL},
      {", \"rope_parameters\": {\"rope_theta\": 500000.0, \"rope_type\": \"llama3\", " L3
       "\"original_max_position_embeddings\": 8192}",
       &llama3, NULL},
      {", \"rope_theta\": 500000.0, \"rope_scaling\": {\"rope_type\": \"llama3\", " L3
       "\"original_max_position_embeddings\": 8192}",
       &llama3, NULL},
      {", \"rope_theta\": 500000.0, \"rope_scaling\": {\"type\": \"llama3\", " L3
       "\"original_max_position_embeddings\": 8192}, \"rope_parameters\": {\"rope_theta\": "
       "500000.0, \"rope_type\": \"llama3\", " L3 "\"original_max_position_embeddings\": 8192}",
       &llama3, NULL},
      {", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}", &linear, NULL},
      {", \"rope_theta\": 500000.0, \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}",
       NULL, "'rope_scaling' has no 'low_freq_factor'"},
      {", \"rope_parameters\": {\"rope_type\": \"llama3\", " L3
       "\"original_max_position_embeddings\": \"8k\"}",
       NULL, "'rope_parameters.original_max_position_embeddings' must be a number"},
      {", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 4, "
       "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 8192}",
       NULL, "need 0 < low_freq_factor < high_freq_factor"},
      {", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 0}", NULL,
       "factor must be positive"},
      {", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}", NULL,
       "'rope_scaling.type' is 'dynamic': the rotary embeddings implemented are default, linear "
       "and llama3"},
      {", \"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4.0}", NULL,
       "'rope_parameters.rope_type' is 'yarn'"},
      {", \"rope_scaling\": {\"factor\": 2.0}", NULL, "'rope_scaling' has no rope_type"},
      {", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}, \"rope_parameters\": "
       "{\"rope_type\": \"default\"}",
       NULL, "'rope_scaling' and 'rope_parameters' give different rope types"},
      {", \"rope_theta\": 10000.0, \"rope_parameters\": {\"rope_theta\": 500000.0, "
       "\"rope_type\": \"default\"}",
       NULL, "'rope_theta' is 10000 but 'rope_parameters.rope_theta' is 500000"},
  };
#undef L3
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char text[1024];
    snprintf(text, sizeof text, base, cases[i].extra);
    llama_config_t c;
    fsdpc_status_t st = llama_config_from_hf_text(text, "config.json", &c);
    if (cases[i].want == NULL) {
      ck_assert_msg(st != STATUS_OK && strstr(err_detail(), cases[i].said),
                    "case %zu: expected a refusal saying \"%s\", got %s", i, cases[i].said,
                    st == STATUS_OK ? "success" : err_detail());
      continue;
    }
    ck_assert_msg(st == STATUS_OK, "case %zu: %s", i, err_detail());
    const rope_t *w = cases[i].want;
    for (int round = 0; round < 2; round++) { /* as read, then written and read back */
      const rope_t *r = &c.rope;
      ck_assert_msg(r->theta == w->theta && r->scaling == w->scaling && r->factor == w->factor,
                    "case %zu round %d: theta %g scaling %d factor %g", i, round, r->theta,
                    (int)r->scaling, r->factor);
      if (w->scaling == ROPE_LLAMA3)
        ck_assert_msg(r->low_freq_factor == w->low_freq_factor &&
                          r->high_freq_factor == w->high_freq_factor &&
                          r->original_max_pos == w->original_max_pos,
                      "case %zu round %d: llama3 parameters", i, round);
      char *out;
      ok(llama_config_to_hf_text(&c, DTYPE_F32, &out));
      ok(llama_config_from_hf_text(out, "written", &c));
      free(out);
    }
  }
}
END_TEST

/* The family's config.json forms: each architecture's defaults (Qwen3's head_dim 128, Qwen's
 * 32768 positions), its features (Qwen2's q/k/v biases, attention_bias, Qwen3's q/k norms), a
 * round trip through llama_config_to_hf_text, and the refusals, each naming its key. */
START_TEST(config_forms_of_the_family) {
  const char *base =
      "{\"hidden_size\": 64, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
      "\"num_key_value_heads\": 2, \"intermediate_size\": 160, "
      "\"vocab_size\": 256%s}";
  const struct {
    const char *extra;
    llama_arch_t arch;
    int64_t head_dim, max_pos; /* llama_head_dim, max_seq_len */
    bool qkv_bias, o_bias, qk_norm;
    const char *said; /* non-NULL: refused, saying this */
  } cases[] = {
      {"", LLAMA_ARCH_LLAMA, 16, 2048, false, false, false, NULL},
      {", \"model_type\": \"llama\", \"attention_bias\": true, \"head_dim\": 32", LLAMA_ARCH_LLAMA,
       32, 2048, true, true, false, NULL},
      {", \"model_type\": \"qwen2\"", LLAMA_ARCH_QWEN2, 16, 32768, true, false, false, NULL},
      {", \"model_type\": \"qwen2\", \"attention_bias\": true", LLAMA_ARCH_QWEN2, 16, 32768, true,
       false, false, NULL},
      {", \"model_type\": \"qwen3\"", LLAMA_ARCH_QWEN3, 128, 32768, false, false, true, NULL},
      {", \"model_type\": \"qwen3\", \"head_dim\": 16, \"attention_bias\": true, "
       "\"max_position_embeddings\": 40960, \"layer_types\": [\"full_attention\", "
       "\"full_attention\"]",
       LLAMA_ARCH_QWEN3, 16, 40960, true, true, true, NULL},
      {", \"model_type\": \"qwen2\", \"use_sliding_window\": true", 0, 0, 0, 0, 0, 0,
       "'use_sliding_window' is set, but sliding-window attention is not implemented"},
      {", \"model_type\": \"qwen3\", \"layer_types\": [\"full_attention\", "
       "\"sliding_attention\"]",
       0, 0, 0, 0, 0, 0, "'layer_types' holds a layer other than \"full_attention\""},
      {", \"model_type\": \"llama\", \"mlp_bias\": true", 0, 0, 0, 0, 0, 0,
       "'mlp_bias' is set, but the model's MLP has no biases"},
      {", \"model_type\": \"qwen3\", \"head_dim\": 0", 0, 0, 0, 0, 0, 0,
       "'head_dim' must be positive"},
      {", \"model_type\": \"qwen3\", \"head_dim\": 15", 0, 0, 0, 0, 0, 0,
       "head_dim must be an even size"},
      {", \"model_type\": \"qwen3\", \"attention_bias\": 1", 0, 0, 0, 0, 0, 0,
       "'attention_bias' must be true or false"},
      /* GPT2Config's aliases: the base's hidden_size is n_embd, which may not say otherwise */
      {", \"model_type\": \"gpt2\", \"n_embd\": 32", 0, 0, 0, 0, 0, 0,
       "'n_embd' is 32 and 'hidden_size' 64: transformers reads hidden_size as n_embd"},
      /* no model_type: Llama's, unless a key says another architecture */
      {", \"n_embd\": 64", 0, 0, 0, 0, 0, 0,
       "no model_type, and 'n_embd' is not a Llama config's key: add \"model_type\": \"gpt2\""},
      {", \"num_experts\": 8, \"shared_expert_intermediate_size\": 64", 0, 0, 0, 0, 0, 0,
       "'shared_expert_intermediate_size' is not a Llama config's key: add \"model_type\": "
       "\"qwen2_moe\""},
      {", \"num_local_experts\": 8", 0, 0, 0, 0, 0, 0, "add \"model_type\": \"mixtral\""},
      {", \"model_type\": \"gpt_neox\"", 0, 0, 0, 0, 0, 0,
       "model_type \"gpt_neox\": this build trains \"llama\", \"qwen2\", \"qwen3\", \"gpt2\", "
       "\"qwen3_moe\", \"mixtral\" and \"qwen2_moe\""},
      {", \"model_type\": \"qwen3_moe\", \"num_experts\": 8, \"num_experts_per_tok\": 2, "
       "\"moe_intermediate_size\": 32, \"mlp_only_layers\": [0]",
       LLAMA_ARCH_QWEN3_MOE, 16, 32768, false, false, true, NULL},
      {", \"model_type\": \"qwen3_moe\", \"num_experts\": 4, \"num_experts_per_tok\": 5", 0, 0, 0,
       0, 0, 0, "num_experts_per_tok must be from 1 to num_experts (4) and at most 64, got 5"},
      {", \"model_type\": \"qwen3_moe\", \"num_experts\": 4097", 0, 0, 0, 0, 0, 0,
       "num_experts must be from 0 to 4096, got 4097"},
      {", \"model_type\": \"qwen3_moe\", \"num_experts\": 128, \"num_experts_per_tok\": 65", 0, 0,
       0, 0, 0, 0, "num_experts_per_tok must be from 1 to num_experts (128) and at most 64"},
      {", \"model_type\": \"qwen3_moe\", \"output_router_logits\": true, "
       "\"router_aux_loss_coef\": -1",
       0, 0, 0, 0, 0, 0, "'router_aux_loss_coef' must be from 0 to 1e6"},
      {", \"model_type\": \"qwen3_moe\", \"mlp_only_layers\": [300]", 0, 0, 0, 0, 0, 0,
       "'mlp_only_layers' holds an index out of range"},
      {", \"model_type\": \"qwen3_moe\", \"decoder_sparse_step\": 0", 0, 0, 0, 0, 0, 0,
       "decoder_sparse_step must be from 1 to 4096"},
      {", \"model_type\": \"mixtral\", \"sliding_window\": null", LLAMA_ARCH_MIXTRAL, 16, 131072,
       false, false, false, NULL},
      {", \"model_type\": \"qwen2_moe\", \"num_experts\": 8, \"num_experts_per_tok\": 2, "
       "\"moe_intermediate_size\": 32, \"mlp_only_layers\": [0]",
       LLAMA_ARCH_QWEN2_MOE, 16, 32768, true, false, false, NULL},
      {", \"model_type\": \"qwen2_moe\", \"shared_expert_intermediate_size\": 0", 0, 0, 0, 0, 0, 0,
       "qwen2_moe has a shared expert"},
      {", \"model_type\": \"qwen2_moe\", \"num_experts\": 8, \"num_experts_per_tok\": 2, "
       "\"moe_intermediate_size\": 32, \"mlp_only_layers\": [0], \"qkv_bias\": false",
       LLAMA_ARCH_QWEN2_MOE, 16, 32768, false, false, false, NULL},
      {", \"model_type\": \"mixtral\", \"sliding_window\": 4096", 0, 0, 0, 0, 0, 0,
       "'sliding_window' is set, but sliding-window attention is not implemented"},
      {", \"model_type\": \"mixtral\", \"router_jitter_noise\": 0.1", 0, 0, 0, 0, 0, 0,
       "'router_jitter_noise' is 0.1, but the router's jitter noise is not implemented"},
      {", \"model_type\": \"mixtral\", \"attention_bias\": true", 0, 0, 0, 0, 0, 0,
       "mixtral's attention has no biases"},
      {", \"model_type\": \"mixtral\", \"num_local_experts\": 0", 0, 0, 0, 0, 0, 0,
       "mixtral has experts in every layer"},
      {", \"model_type\": \"mixtral\", \"num_local_experts\": 2, \"num_experts_per_tok\": 3", 0, 0,
       0, 0, 0, 0, "num_experts_per_tok must be from 1 to num_experts (2) and at most 64, got 3"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char text[1024];
    snprintf(text, sizeof text, base, cases[i].extra);
    llama_config_t c;
    fsdpc_status_t st = llama_config_from_hf_text(text, "config.json", &c);
    if (cases[i].said != NULL) {
      ck_assert_msg(st != STATUS_OK && strstr(err_detail(), cases[i].said),
                    "case %zu: expected a refusal saying \"%s\", got %s", i, cases[i].said,
                    st == STATUS_OK ? "success" : err_detail());
      continue;
    }
    ck_assert_msg(st == STATUS_OK, "case %zu: %s", i, err_detail());
    if (c.arch == LLAMA_ARCH_QWEN3_MOE) /* Qwen3MoeConfig's defaults but for those given */
      ck_assert(c.n_experts == 8 && c.top_k == 2 && c.moe_ffn_dim == 32 && c.sparse_step == 1 &&
                !c.norm_topk && !llama_layer_is_moe(&c, 0) && llama_layer_is_moe(&c, 1) &&
                c.aux_loss_coef == 0); /* router_aux_loss_coef only with output_router_logits */
    if (c.arch == LLAMA_ARCH_QWEN2_MOE) /* Qwen2MoeConfig's defaults but for those given */
      ck_assert(c.n_experts == 8 && c.top_k == 2 && c.moe_ffn_dim == 32 &&
                c.shared_ffn_dim == 5632 && !c.norm_topk && !llama_layer_is_moe(&c, 0) &&
                llama_layer_is_moe(&c, 1));
    if (c.arch == LLAMA_ARCH_MIXTRAL)  /* MixtralConfig's defaults: 8 experts of the MLP's size */
      ck_assert(c.n_experts == 8 && c.top_k == 2 && c.moe_ffn_dim == 160 && c.norm_topk &&
                llama_layer_is_moe(&c, 0) && llama_layer_is_moe(&c, 1) && c.aux_loss_coef == 0 &&
                c.rope.theta == 1e6 && c.norm_eps == 1e-5 && c.n_kv_heads == 2);
    for (int round = 0; round < 2; round++) { /* as read, then written and read back */
      ck_assert_msg(c.arch == cases[i].arch && llama_head_dim(&c) == cases[i].head_dim &&
                        c.max_seq_len == cases[i].max_pos && c.qkv_bias == cases[i].qkv_bias &&
                        c.o_bias == cases[i].o_bias && c.qk_norm == cases[i].qk_norm,
                    "case %zu round %d: %s head_dim %lld max_pos %lld biases %d/%d qk_norm %d", i,
                    round, llama_arch_name(c.arch), (long long)llama_head_dim(&c),
                    (long long)c.max_seq_len, c.qkv_bias, c.o_bias, c.qk_norm);
      char *out;
      ok(llama_config_to_hf_text(&c, DTYPE_F32, &out));
      ok(llama_config_from_hf_text(out, "written", &c));
      free(out);
    }
  }
}
END_TEST

/* router_aux_loss_coef survives a written config also while output_router_logits leaves it
 * unused (Qwen3-MoE, Qwen2-MoE and Mixtral), and is the weight in use when it is. */
START_TEST(router_coefficient_written_back) {
  static const char *const types[] = {"qwen3_moe", "qwen2_moe", "mixtral"};
  /* named (0.02, or 0: no loss even where output_router_logits is turned on later), or left
   * to the family's default (0.001) */
  static const char *const given[] = {", \"router_aux_loss_coef\": 0.02", "",
                                      ", \"router_aux_loss_coef\": 0"};
  static const double want[] = {0.02, 0.001, 0};
  for (int t = 0; t < 3; t++)
    for (int k = 0; k < 6; k++) {
      int logits = k % 2, g = k / 2;
      char text[512];
      snprintf(text, sizeof text,
               "{\"model_type\": \"%s\", \"hidden_size\": 64, \"num_hidden_layers\": 2, "
               "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"intermediate_size\": "
               "160, \"vocab_size\": 256, \"num_experts\": 4, \"num_local_experts\": 4, "
               "\"num_experts_per_tok\": 2, \"output_router_logits\": %s%s}",
               types[t], logits ? "true" : "false", given[g]);
      llama_config_t c;
      ok(llama_config_from_hf_text(text, "config.json", &c));
      ck_assert(c.aux_loss_coef == (logits ? want[g] : 0));
      char *out;
      ok(llama_config_to_hf_text(&c, DTYPE_F32, &out));
      cJSON *o = cJSON_Parse(out);
      free(out);
      ck_assert_ptr_nonnull(o);
      const cJSON *coef = cJSON_GetObjectItem(o, "router_aux_loss_coef"),
                  *on = cJSON_GetObjectItem(o, "output_router_logits");
      /* a loss of weight 0 is none: written as output_router_logits false */
      bool written_on = logits && want[g] > 0;
      ck_assert_msg(cJSON_IsNumber(coef) && coef->valuedouble == want[g] && cJSON_IsBool(on) &&
                        cJSON_IsTrue(on) == written_on,
                    "%s, output_router_logits %d%s: written %g, %d", types[t], logits, given[g],
                    coef ? coef->valuedouble : -1, on ? cJSON_IsTrue(on) : -1);
      cJSON_Delete(o);
    }
}
END_TEST

/* Llama 3.1 8B's rotary frequencies (head_dim 128, theta 5e5, llama3 scaling factor 8 over
 * 8192 positions: 64 pairs over all three regimes) equal torch's from transformers' formula. */
START_TEST(llama3_frequencies_of_llama31) {
  char *text;
  ok(file_read_text(REF "llama31_inv_freq.json", 1 << 20, &text));
  cJSON *ref = cJSON_Parse(text);
  free(text);
  ck_assert_ptr_nonnull(ref);
  char *rope = cJSON_PrintUnformatted(cJSON_GetObjectItem(ref, "rope_parameters"));
  char config[1024];
  snprintf(config, sizeof config,
           "{\"model_type\": \"llama\", \"hidden_size\": 4096, \"num_hidden_layers\": 32, "
           "\"num_attention_heads\": 32, \"num_key_value_heads\": 8, \"intermediate_size\": "
           "14336, \"vocab_size\": 128256, \"max_position_embeddings\": 131072, "
           "\"rope_parameters\": %s}",
           rope);
  free(rope);
  llama_config_t c;
  ok(llama_config_from_hf_text(config, "llama-3.1-8b", &c));
  ck_assert_int_eq(c.dim / c.n_heads, cJSON_GetObjectItem(ref, "head_dim")->valueint);
  const cJSON *want = cJSON_GetObjectItem(ref, "inv_freq");
  ck_assert_int_eq(cJSON_GetArraySize(want), 64);
  int kept = 0, divided = 0;
  for (int i = 0; i < 64; i++) {
    double w = cJSON_GetArrayItem(want, i)->valuedouble, got = rope_inv_freq(&c.rope, i, 128);
    double plain = pow(5e5, -2.0 * i / 128);
    ck_assert_msg(fabs(got - w) <= 1e-12 * w, "pair %d: inv_freq %.17g, torch %.17g", i, got, w);
    kept += got == plain;
    divided += fabs(got - plain / 8) <= 1e-15 * plain;
  }
  ck_assert_msg(kept > 0 && divided > 0 && kept + divided < 64,
                "the reference covers every regime: %d kept, %d divided", kept, divided);
  cJSON_Delete(ref);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("llama");
  TCase *tc = tcase_create("golden");
  tcase_set_timeout(tc, 600);
  if (test_argc() > 1 && strcmp(test_argv()[1], "cuda") == 0) {
    if (world_device().type != DEVICE_CUDA) {
      harness_skip("no CUDA device");
      suite_add_tcase(s, tc);
      return s;
    }
    mode.device = DEVICE_CUDA;
    mode.tol_logits = 1e-4; /* cuBLAS reorders fp32 sums */
    mode.tol_grad = 1e-3;
    mode.tol_losses = 1e-4;
  }
  if (test_argc() > 2 && strcmp(test_argv()[2], "bf16") == 0) {
    mode.dtype = DTYPE_BF16;
    mode.tol_logits = 3e-2;
    mode.tol_grad = 5e-2;
    mode.tol_losses = 1e-2;
  }
  tcase_add_test(tc, forward_backward_untied);
  tcase_add_test(tc, forward_backward_tied);
  tcase_add_test(tc, forward_backward_checkpointed);
  if (mode.dtype == DTYPE_F32) tcase_add_test(tc, checkpointing_bit_identical);
  tcase_add_test(tc, training_untied);
  tcase_add_test(tc, training_tied);
  tcase_add_test(tc, forward_backward_rope_variants);
  tcase_add_test(tc, training_rope_variants);
  tcase_add_test(tc, forward_backward_qwen);
  tcase_add_test(tc, training_qwen);
  tcase_add_test(tc, forward_backward_gpt2);
  tcase_add_test(tc, training_gpt2);
  tcase_add_test(tc, stages_compose_to_the_model);
  if (mode.dtype == DTYPE_F32) tcase_add_test(tc, qwen3_moe_trains_as_torch);
  if (mode.dtype == DTYPE_F32) tcase_add_test(tc, mixtral_trains_as_torch);
  if (mode.dtype == DTYPE_F32) tcase_add_test(tc, qwen2_moe_trains_as_torch);
  if (mode.device == DEVICE_CPU && mode.dtype == DTYPE_F32) {
    tcase_add_test(tc, qwen3_moe_against_torch);
    tcase_add_test(tc, mixtral_against_torch);
    tcase_add_test(tc, config_forms_of_transformers_4_and_5);
    tcase_add_test(tc, config_forms_of_the_family);
    tcase_add_test(tc, router_coefficient_written_back);
    tcase_add_test(tc, llama3_frequencies_of_llama31);
  }
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
