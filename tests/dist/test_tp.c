/*
 * Tensor parallelism with the built-in Llama plan, alone and under fully_shard / HSDP (HFSDP
 * with a second argument "hfsdp"), on a (dp_replicate, dp_shard, tp) mesh given as the
 * argument "RxSxT": every parameter's local
 * shard is the single-rank parameter's slice at the offset its DTensor reports; ten steps
 * with and without sequence parallelism, with and without gradient accumulation and
 * activation checkpointing, and (dp_shard >= 4) with an integer reshard_after_forward, match
 * the single-rank run (1e-5); the tp group's collectives of every step are exactly the closed
 * form below.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/llama/llama_plan.h"
#include "nn/init.h"
#include "nn/layers.h"
#include "nn/moe.h"
#include "parallel/parallelize.h"
#include "tests/dist/fsdp_common.h"

#define STEPS 10

static int R = 1, S = 1, T = 1;

static void parse_mesh(void) {
  if (test_argc() < 2 || sscanf(test_argv()[1], "%dx%dx%d", &R, &S, &T) != 3 ||
      R * S * T != world_size()) {
    fprintf(stderr, "test_tp: argument RxSxT with R*S*T = world size expected\n");
    exit(2);
  }
}

typedef struct variant {
  bool sp, ac;
  int accum;
  int reshard;        /* the blocks' reshard_after_forward (0: the default) */
  bool colwise_embed; /* the embedding split by columns instead of by vocabulary */
  bool deferred;      /* built meta, parallelised, then materialized and initialised */
  bool bf16;          /* bf16 parameters (mp_policy param_dtype), gradients reduced in f32 */
} variant_t;

/* The tp group's collectives of one step, counted independently of the library: per
 * micro-batch, n = B x seq x dim activation elements, L blocks, V / T logits columns. Forward
 * collectives and backward gathers move elements of the compute dtype (f32, or bf16 with
 * v->bf16); backward reductions (gradients) run in the reduce dtype, f32. */
static pg_counters_t expected_tp(const variant_t *v, const llama_config_t *c, int64_t B,
                                 int64_t seq) {
  pg_counters_t e = {0};
  uint64_t A = (uint64_t)v->accum, L = (uint64_t)c->n_layers, W = (uint64_t)T;
  dtype_t cdt = v->bf16 ? DTYPE_BF16 : DTYPE_F32;
  uint64_t cb = dtype_size(cdt), rb = 4; /* compute and reduce element bytes */
  uint64_t n = (uint64_t)(B * seq * c->dim), logits = (uint64_t)(B * seq * c->vocab_size);
  uint64_t fwd = v->ac ? 2 : 1; /* checkpointed blocks run their forward twice */
  /* lm_head: its Shard(-1) output gathered whole for the loss */
  e.calls[PG_ALL_GATHER] += A;
  e.bytes[PG_ALL_GATHER] += A * (W - 1) * logits * cb / W;
  /* the forward's reductions: the embedding's Partial output, then each block's attention and
   * MLP rowwise outputs (forward runs) */
  uint64_t fred = A * (1 + L * 2 * fwd);
  /* the backward's: the inputs of each block's prepare_input (attention, MLP) and lm_head */
  uint64_t bred = A * (L * 2 + 1);
  if (v->sp) {
    /* reduce-scatters (to sequence shards) for those reductions; all-gathers: prepare_input and
     * lm_head inputs forward, the embedding's and rowwise outputs' gradients backward. Each
     * moves blocks of n / T. */
    uint64_t fgat = A * (L * 2 * fwd + 1), bgat = A * (1 + L * 2);
    e.calls[PG_ALL_GATHER] += fgat + bgat;
    e.bytes[PG_ALL_GATHER] += (fgat + bgat) * (W - 1) * n * cb / W;
    e.calls[PG_REDUCE_SCATTER] += fred + bred;
    e.bytes[PG_REDUCE_SCATTER] += fred * (W - 1) * n * cb / W + bred * (W - 1) * n * rb / W;
    e.reductions[cdt] += fred;
    e.reductions[DTYPE_F32] += bred;
    /* the norm weights' gradients (2 per block and the final norm), summed over tp */
    uint64_t norms = A * (2 * L + 1), nb = (uint64_t)c->dim * rb;
    e.calls[PG_ALL_REDUCE] += norms;
    e.bytes[PG_ALL_REDUCE] += norms * (2 * (W - 1) * nb / W);
    e.reductions[DTYPE_F32] += norms;
  } else {
    e.calls[PG_ALL_REDUCE] += fred + bred;
    e.bytes[PG_ALL_REDUCE] += fred * (2 * (W - 1) * n * cb / W) + bred * (2 * (W - 1) * n * rb / W);
    e.reductions[cdt] += fred;
    e.reductions[DTYPE_F32] += bred;
  }
  if (v->colwise_embed) {
    /* the embedding's Shard(-1) output is gathered instead of its Partial one reduced: an
     * all-gather of n / T forward (then a local chunk of the sequence under sequence
     * parallelism, whose backward all-gathers it back) */
    e.calls[PG_ALL_GATHER] += A;
    e.bytes[PG_ALL_GATHER] += A * (W - 1) * n * cb / W;
    pg_kind_t k = v->sp ? PG_REDUCE_SCATTER : PG_ALL_REDUCE;
    e.calls[k] -= A;
    e.bytes[k] -= A * (v->sp ? (W - 1) * n * cb / W : 2 * (W - 1) * n * cb / W);
    e.reductions[cdt] -= A;
  }
  return e;
}

/* The reductions of got by dtype against want's; the number of mismatches. */
static int check_reduction_dtypes(int step, const pg_counters_t *got, const pg_counters_t *want) {
  int bad = 0;
  for (int d = 0; d < DTYPE_COUNT; d++)
    if (got->reductions[d] != want->reductions[d]) {
      bad++;
      if (world_rank() == 0)
        printf("step %d, tp group: %llu reductions in %s, expected %llu\n", step,
               (unsigned long long)got->reductions[d], dtype_name((dtype_t)d),
               (unsigned long long)want->reductions[d]);
    }
  return bad;
}

static void parity(const variant_t *v) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  cfg.n_kv_heads = 4; /* whole heads on up to 4 tp ranks */
  int shape[3], md = 0;
  const char *names[3];
  if (R > 1) shape[md] = R, names[md++] = "dp_replicate";
  shape[md] = S, names[md++] = "dp_shard";
  shape[md] = T, names[md++] = "tp";
  mesh_t *world, *dp, *tp, *all;
  ok(mesh_new(md, shape, names, test_device_type(), &world));
  ok(mesh_slice(world, md - 1, names, &dp));
  ok(mesh_slice(world, 1, &names[md - 1], &tp));
  ok(mesh_flatten(world, md, names, "all", &all));
  int dp_rank = mesh_ndim(dp) == 2 ? mesh_coord(dp, 0) * S + mesh_coord(dp, 1) : mesh_coord(dp, 0);
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  const int64_t B = 2, SEQ = 16;
  data_spec_t gspec = {
      .batch_size = B * R * S, .seq_len = SEQ, .grad_accum = v->accum, .dp_size = 1};
  data_spec_t lspec = {.batch_size = B,
                       .seq_len = SEQ,
                       .grad_accum = v->accum,
                       .dp_size = R * S,
                       .dp_rank = dp_rank};
  run_t ref, sh;
  run_init(&ref, &cfg);
  if (v->deferred) {
    llama_options_t o = LLAMA_OPTIONS_INIT;
    o.device = test_device_type();
    o.deferred = true;
    ok(llama_new(&cfg, &o, &sh.m));
  } else {
    run_init(&sh, &cfg);
  }
  if (v->ac) llama_set_activation_checkpointing(sh.m, true);
  const tp_rule_t *builtin;
  tp_rule_t rules[32];
  int nr = llama_plan_tp_rules(NULL, &builtin);
  memcpy(rules, builtin, sizeof(tp_rule_t) * (size_t)nr);
  if (v->colwise_embed) rules[0].style = TP_COLWISE; /* model.embed_tokens */
  tp_plan_t *plan;
  ok(tensor_parallel(llama_module(sh.m), tp, rules, nr, v->sp, &plan));
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = dp;
  opt.shard_state_over_replicas = hfsdp_mode() && R > 1; /* "RxSxT hfsdp" */
  if (v->bf16) {
    opt.param_dtype = DTYPE_BF16;
    opt.reduce_dtype = DTYPE_F32;
  }
  if (v->reshard) opt.reshard_after_forward = v->reshard;
  /* tp's gradient reductions take each unit's reduce dtype, inner units first */
  for (int i = 0; i < cfg.n_layers; i++) {
    ok(fully_shard(llama_layer(sh.m, i), &opt, NULL));
    ok(tp_set_reduce_dtype(plan, llama_layer(sh.m, i), DTYPE_F32));
  }
  opt.reshard_after_forward = FSDP_RESHARD_AUTO;
  ok(fully_shard(llama_module(sh.m), &opt, NULL));
  ok(tp_set_reduce_dtype(plan, llama_module(sh.m), DTYPE_F32));
  if (v->deferred) { /* the strided (dp over tp) shards initialise themselves */
    ok(nn_module_materialize(llama_module(sh.m)));
    ok(llama_init_weights(sh.m, 99));
  }
  run_optim(&ref);
  run_optim(&sh);
  int bad = 0;
  /* every parameter on (dp..., tp), its local shard the reference's slice at its offset */
  for (int i = 0; i < sh.n; i++) {
    const mesh_t *pm = dtensor_mesh(sh.ps[i]->value);
    if (mesh_ndim(pm) != md || strcmp(mesh_dim_name(pm, md - 1), "tp") != 0) bad++;
    /* HFSDP: the replicas hold chunks, not copies */
    if (opt.shard_state_over_replicas &&
        dtensor_placements(sh.ps[i]->value)[0].kind != PLACEMENT_SHARD)
      bad++;
  }
  bad += compare_shards(&ref, &sh, false, 0.0); /* exact before training */
  pg_t *tp_pg = mesh_group(tp, 0);
  lr_schedule_t sched = {.warmup_steps = 3, .total_steps = STEPS, .min_ratio = 0.1};
  pg_counters_t want = expected_tp(v, &cfg, B, SEQ);
  /* fp32 sums in another order (tp partial sums, then the dp average of micro-batches of two
   * samples): compare_shards's tolerances for f32 */
  double grad_tol = 5e-5, param_tol = 1e-5;
  for (int s = 0; s < STEPS; s++) {
    optim_zero_grad(ref.opt);
    optim_zero_grad(sh.opt);
    pg_reset_counters(tp_pg);
    double lref = 0, lsh = 0, lsum = 0;
    for (int m = 0; m < v->accum; m++) {
      fsdp_set_is_last_backward(llama_module(sh.m), m == v->accum - 1);
      lref += fwd_bwd(ref.m, d, &gspec, s, m) / v->accum;
      lsh += fwd_bwd(sh.m, d, &lspec, s, m) / v->accum;
    }
    pg_counters_t got = pg_counters(tp_pg);
    bad += check_counts(s, "tp", &got, &want);
    bad += check_reduction_dtypes(s, &got, &want);
    MPI_Allreduce(&lsh, &lsum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    lsh = lsum / world_size();
    if (fabs(lsh - lref) > (v->bf16 ? 2e-2 : 1e-5) * fabs(lref)) { /* bf16: its rounding */
      bad++;
      if (world_rank() == 0)
        printf("step %d: parallel loss %.8f, single rank %.8f\n", s, lsh, lref);
    }
    if (!v->bf16) bad += compare_shards(&ref, &sh, true, grad_tol); /* before clipping */
    ok(clip_grad_norm(ref.ps, ref.n, 1.0, NULL, NULL));
    ok(clip_grad_norm(sh.ps, sh.n, 1.0, mesh_group(all, 0), NULL));
    ok(optim_step(ref.opt, lr_schedule_factor(&sched, s)));
    ok(optim_step(sh.opt, lr_schedule_factor(&sched, s)));
  }
  if (!v->bf16) bad += compare_shards(&ref, &sh, false, param_tol);
  expect_all(bad == 0, "%d mismatches between the tensor-parallel and the single-rank run", bad);
  for (run_t *r = &ref; r; r = r == &ref ? &sh : NULL) {
    optim_free(r->opt);
    free(r->ps);
  }
  fsdp_free_all(llama_module(sh.m));
  llama_free(ref.m);
  llama_free(sh.m);
  tp_free(plan);
  data_free(d);
  mesh_free(all);
  mesh_free(tp);
  mesh_free(dp);
  mesh_free(world);
}

START_TEST(parity_replicated_activations) { parity(&(variant_t){.accum = 1}); }
END_TEST

/* built deferred: every shard equals the eager model's exactly (compare_shards, 0) */
START_TEST(parity_sequence_parallel) {
  parity(&(variant_t){.sp = true, .accum = 1, .deferred = true});
}
END_TEST

START_TEST(parity_accumulation) { parity(&(variant_t){.accum = 2}); }
END_TEST

START_TEST(parity_sequence_parallel_accumulation_checkpointed) {
  parity(&(variant_t){.sp = true, .ac = true, .accum = 2});
}
END_TEST

/* blocks keep a 1/2 slice after forward; their backward gathers run within pairs of dp_shard
 * ranks, leaving the tp traffic unchanged */
START_TEST(parity_colwise_embedding) {
  parity(&(variant_t){.accum = 1, .colwise_embed = true, .deferred = true});
}
END_TEST

START_TEST(parity_colwise_embedding_sequence_parallel) {
  parity(&(variant_t){.sp = true, .accum = 1, .colwise_embed = true});
}
END_TEST

/* bf16 parameters with f32 reduction: every gradient reduction on tp runs in f32 (counted by
 * dtype), with and without sequence parallelism (its norms' summed gradients included) */
START_TEST(reduce_dtype_on_tp_reductions) {
  parity(&(variant_t){.accum = 1, .bf16 = true});
  parity(&(variant_t){.sp = true, .accum = 1, .bf16 = true});
}
END_TEST

START_TEST(parity_sequence_parallel_int_reshard) {
  parity(&(variant_t){.sp = true, .accum = 1, .reshard = 2});
}
END_TEST

/* Sizes tp cannot split are refused with the module's name, before anything runs. */
START_TEST(uneven_split_is_refused) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  run_t r;
  run_init(&r, &cfg);
  mesh_t *world, *tp;
  int shape[2] = {R * S, T};
  const char *names[] = {"dp", "tp"};
  ok(mesh_new(2, shape, names, test_device_type(), &world));
  ok(mesh_slice(world, 1, &names[1], &tp));
  const tp_rule_t *rules;
  int nr = llama_plan_tp_rules(NULL, &rules);
  tp_plan_t *plan = NULL;
  fsdpc_status_t st = tensor_parallel(llama_module(r.m), tp, rules, nr, false, &plan);
  int good = st == STATUS_ESHAPE && strstr(err_detail(), "not divisible by tp=") != NULL;
  if (!good) printf("rank %d: %s: %s\n", world_rank(), status_str(st), err_detail());
  expect_all(good, "an uneven split is refused with a message naming the parameter");
  llama_free(r.m);
  tp_free(plan);
  mesh_free(tp);
  mesh_free(world);
}
END_TEST

/* The world as (dp, tp) and its tp part. */
static void tp_meshes(mesh_t **world, mesh_t **tp) {
  int shape[2] = {R * S, T};
  const char *names[] = {"dp", "tp"};
  ok(mesh_new(2, shape, names, DEVICE_CPU, world));
  ok(mesh_slice(*world, 1, &names[1], tp));
}

/* An MLP of transformers' Conv1D layers (weight [in, out]) with biases: built eagerly, the same
 * values on every rank. */
static nn_module_t *conv1d_mlp(void) {
  nn_module_t *m;
  ok(nn_sequential_new(NULL, "", &m));
  ok(nn_conv1d_new(m, "c_fc", 8, 24, true, NULL, NULL));
  ok(nn_activation_new(m, "act", KERNEL_ACT_GELU_TANH, NULL));
  ok(nn_conv1d_new(m, "c_proj", 24, 8, true, NULL, NULL));
  ok(nn_module_finalize(m));
  ok(nn_module_reset_parameters(m, 5));
  for (int i = 0; i < nn_module_num_children(m); i++) { /* biases not zero, to be checked */
    nn_param_t *b = nn_module_param_named(nn_module_child(m, i), "bias");
    if (b) ok(nn_init_normal(b, 6, 0.0, 0.1));
  }
  return m;
}

/* One forward and backward of x [2, 3, 8] (the same on every rank): the MSE loss and the
 * gradients. */
static double conv1d_step(nn_module_t *m, fsdpc_tensor_t *pred_out) {
  fsdpc_tensor_t x, y;
  int64_t sx[3] = {2, 3, 8};
  ok(tensor_init(&x, DTYPE_F32, device_cpu(), 3, sx));
  ok(tensor_zeros(&y, DTYPE_F32, device_cpu(), 3, sx));
  for (int64_t i = 0; i < 48; i++)
    ((float *)x.data)[i] = (float)nn_init_normal_value(7, "x", (uint64_t)i);
  nn_ctx_t *ctx;
  nn_var_t *in, *pred, *l;
  double loss;
  ok(nn_ctx_new(&ctx));
  ok(nn_var_new(&x, false, &in));
  ok(nn_call(ctx, m, in, &pred));
  ok(nn_mse_loss(ctx, pred, &y, &l));
  ok(nn_var_scalar(l, &loss));
  ok(nn_backward(ctx, l));
  ok(tensor_clone(pred_out, &pred->value, DTYPE_F32, device_cpu()));
  nn_var_put(l);
  nn_var_put(pred);
  nn_var_put(in);
  nn_ctx_free(ctx);
  tensor_free(&y);
  return loss;
}

/* One step of conv1d_mlp split by tp model m against the single-rank one: the output's
 * relative error into *e, the loss's into *dl, and the gradient slices that differ (as
 * returned); *ps, when not NULL, receives m's parameters (the caller frees the list). */
static int conv1d_against_one_rank(nn_module_t *m, double *e, double *dl, nn_param_t ***ps) {
  nn_module_t *ref = conv1d_mlp();
  fsdpc_tensor_t pr, pm;
  double lr = conv1d_step(ref, &pr), lm = conv1d_step(m, &pm);
  run_t a = {0}, b = {0};
  ok(nn_named_parameters(ref, &a.ps, &a.n));
  ok(nn_named_parameters(m, &b.ps, &b.n));
  int bad = compare_shards(&a, &b, true, 1e-5);
  *e = test_rel_l2(&pm, &pr);
  *dl = fabs(lm - lr) / fabs(lr);
  free(a.ps);
  if (ps)
    *ps = b.ps;
  else
    free(b.ps);
  tensor_free(&pr);
  tensor_free(&pm);
  nn_module_free(ref);
  return bad;
}

/* Conv1D layers split by the Linear's styles on the weight's other side (colwise Shard(1),
 * rowwise Shard(0), a colwise bias with the output features, a rowwise one added once): the
 * single-rank output and loss, and on each rank the single-rank gradients' slices. */
START_TEST(conv1d_layers_split_like_linears) {
  mesh_t *world, *tp;
  tp_meshes(&world, &tp);
  nn_module_t *m = conv1d_mlp();
  const tp_rule_t rules[] = {{"c_fc", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
                             {"c_proj", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT}};
  tp_plan_t *plan;
  ok(tensor_parallel(m, tp, rules, 2, false, &plan));
  double e, dl;
  nn_param_t **ps = NULL;
  int bad = conv1d_against_one_rank(m, &e, &dl, &ps);
  static const char *const want[][2] = {{"c_fc.weight", "S(1)"},
                                        {"c_fc.bias", "S(0)"},
                                        {"c_proj.weight", "S(0)"},
                                        {"c_proj.bias", "R"}};
  for (int i = 0; i < 4 && T > 1; i++) {
    char got[16];
    placement_str(dtensor_placements(ps[i]->value)[0], got, sizeof got);
    if (strcmp(ps[i]->fqn, want[i][0]) != 0 || strcmp(got, want[i][1]) != 0) {
      printf("rank %d: %s placed %s, want %s %s\n", world_rank(), ps[i]->fqn, got, want[i][0],
             want[i][1]);
      bad++;
    }
  }
  expect_all(bad == 0 && e < 1e-6 && dl <= 1e-6,
             "Conv1D under tp: output %.2g, loss %.2g, %d gradient or placement mismatches", e, dl,
             bad);
  free(ps);
  nn_module_free(m);
  tp_free(plan);
  mesh_free(tp);
  mesh_free(world);
}
END_TEST

/* A rowwise layer given its input whole (input: replicate, PyTorch's
 * RowwiseParallel(input_layouts=Replicate())) takes this rank's chunk of it: after a colwise
 * layer that outputs replicate, the single-rank output, loss and gradients. The plan keeps
 * its mesh (freed here at once). A layout no conversion reaches is refused by tensor_parallel,
 * not at the first forward. */
START_TEST(rowwise_input_replicate_takes_its_chunk) {
  mesh_t *world, *tp;
  tp_meshes(&world, &tp);
  nn_module_t *m = conv1d_mlp(), *other = conv1d_mlp();
  const tp_rule_t rules[] = {{"c_fc", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_REPLICATE},
                             {"c_proj", TP_ROWWISE, TP_REPLICATE, TP_LAYOUT_DEFAULT}};
  tp_plan_t *plan, *no = NULL;
  ok(tensor_parallel(m, tp, rules, 2, false, &plan));
  const tp_rule_t wrong[] = {{"c_proj", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_SHARD_LAST}};
  fsdpc_status_t st = tensor_parallel(other, tp, wrong, 1, false, &no);
  expect_all(st == STATUS_EUNSUPPORTED && strstr(err_detail(), "output shard(-1) is not supported"),
             "a rowwise output shard(-1) is refused by tensor_parallel: %s",
             st ? err_detail() : "ok");
  mesh_free(tp);
  mesh_free(world);
  double e, dl;
  int bad = conv1d_against_one_rank(m, &e, &dl, NULL);
  expect_all(bad == 0 && e < 1e-6 && dl <= 1e-6,
             "rowwise input: replicate: output %.2g, loss %.2g, %d gradient mismatches", e, dl,
             bad);
  nn_module_free(m);
  nn_module_free(other);
  tp_free(plan);
}
END_TEST

/* Sequence parallelism with a MoE block whose input came through no tensor-parallel layer
 * (whole on every rank, not this rank's sequence shard): refused at its forward on every rank,
 * where the router's and experts' gradients would have been summed over tp, tp times too
 * large. */
START_TEST(moe_input_of_no_layer_is_refused) {
  mesh_t *world, *tp;
  tp_meshes(&world, &tp);
  nn_module_t *root;
  ok(nn_sequential_new(NULL, "", &root));
  ok(nn_moe_new(root, "moe", 8, 12, 4, 2, true, NULL, NULL));
  ok(nn_module_finalize(root));
  const tp_rule_t rules[] = {{"moe", TP_PREPARE_INPUT, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT}};
  tp_plan_t *plan = NULL;
  ok(tensor_parallel(root, tp, rules, 1, true, &plan));
  ok(nn_module_reset_parameters(root, 7));
  fsdpc_tensor_t x;
  ok(tensor_zeros(&x, DTYPE_F32, device_cpu(), 3, (int64_t[]){2, 4, 8}));
  nn_ctx_t *ctx;
  nn_var_t *in, *out = NULL;
  ok(nn_ctx_new(&ctx));
  ok(nn_var_new(&x, false, &in));
  fsdpc_status_t st = nn_call(ctx, root, in, &out);
  expect_all(st == STATUS_EINVAL && strstr(err_detail(),
                                           "moe (prepare_input of a MoE block, "
                                           "sequence parallelism): its input comes "
                                           "from no tensor-parallel layer"),
             "a MoE block's input whole on every rank under sequence parallelism: %s",
             st ? err_detail() : "ok");
  nn_var_put(out);
  nn_var_put(in);
  nn_ctx_free(ctx);
  tensor_free(&x);
  nn_module_free(root);
  tp_free(plan);
  mesh_free(tp);
  mesh_free(world);
}
END_TEST

/* tensor_parallel after fully_shard over the same ranks: refused, naming the order (it was
 * taken, and the first forward failed on an unrelated layout) */
START_TEST(tensor_parallel_after_fully_shard_is_refused) {
  mesh_t *world, *tp;
  tp_meshes(&world, &tp);
  nn_module_t *m = conv1d_mlp();
  fsdp_options_t fo = FSDP_OPTIONS_INIT;
  fo.mesh = tp;
  ok(fully_shard(m, &fo, NULL));
  const tp_rule_t rules[] = {{"c_fc", TP_COLWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT},
                             {"c_proj", TP_ROWWISE, TP_LAYOUT_DEFAULT, TP_LAYOUT_DEFAULT}};
  tp_plan_t *plan = NULL;
  fsdpc_status_t st = tensor_parallel(m, tp, rules, 2, false, &plan);
  expect_all(st == STATUS_EINVAL && strstr(err_detail(),
                                           "is sharded by fully_shard already; "
                                           "apply tensor_parallel first"),
             "tensor_parallel after fully_shard: %s", st ? err_detail() : "ok");
  tp_free(plan);
  fsdp_free_all(m);
  nn_module_free(m);
  mesh_free(tp);
  mesh_free(world);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("tp");
  TCase *tc = tcase_create("tp");
  tcase_set_timeout(tc, 600);
  parse_mesh();
  if (T % 3 != 0) { /* the tiny model splits evenly over 2 and 4 */
    tcase_add_test(tc, parity_replicated_activations);
    tcase_add_test(tc, parity_sequence_parallel);
    tcase_add_test(tc, parity_accumulation);
    tcase_add_test(tc, parity_sequence_parallel_accumulation_checkpointed);
    tcase_add_test(tc, parity_colwise_embedding);
    tcase_add_test(tc, parity_colwise_embedding_sequence_parallel);
    if (S >= 4) tcase_add_test(tc, parity_sequence_parallel_int_reshard);
    tcase_add_test(tc, conv1d_layers_split_like_linears);
    tcase_add_test(tc, rowwise_input_replicate_takes_its_chunk);
    tcase_add_test(tc, reduce_dtype_on_tp_reductions);
    tcase_add_test(tc, moe_input_of_no_layer_is_refused);
    tcase_add_test(tc, tensor_parallel_after_fully_shard_is_refused);
  } else {
    tcase_add_test(tc, uneven_split_is_refused);
  }
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
