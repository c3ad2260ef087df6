/*
 * fully_shard's control surface: parameter state after forward and backward for each reshard
 * policy and by hand, unshard's copies and values, a module called twice, ignored parameters, the
 * gradient divide factor, and the order of unshard / reshard / post-backward events with default
 * and explicit prefetching.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/ops.h"
#include "tests/dist/fsdp_common.h"

START_TEST(parameter_state_after_forward_and_backward) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  mesh_t *mesh = dp_mesh();
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  data_spec_t spec = {.batch_size = 1, .seq_len = 8, .grad_accum = 1, .dp_size = 1};
  for (int policy = 0; policy < 3; policy++) { /* 0: false, 1: true, 2: default */
    llama_t *m;
    ok(llama_new(&cfg, NULL, &m));
    fsdp_options_t opt = FSDP_OPTIONS_INIT;
    opt.mesh = mesh;
    opt.reshard_after_forward = policy == 2 ? FSDP_RESHARD_AUTO : policy;
    fsdp_group_t *layer, *root;
    ok(fully_shard(llama_layer(m, 0), &opt, &layer));
    ok(fully_shard(llama_layer(m, 1), &opt, NULL));
    ok(fully_shard(llama_module(m), &opt, &root));
    ck_assert(!fsdp_is_unsharded(layer) && !fsdp_is_unsharded(root));
    nn_ctx_t *ctx;
    ok(nn_ctx_new(&ctx));
    fsdpc_tensor_t in, tg;
    ok(data_batch(d, &spec, 0, 0, &in, &tg));
    nn_var_t *ids, *logits, *loss;
    ok(nn_var_new(&in, false, &ids));
    ok(nn_call(ctx, llama_module(m), ids, &logits));
    bool layer_kept = policy == 0, root_kept = policy != 1;
    ck_assert_msg(fsdp_is_unsharded(layer) == layer_kept, "policy %d: layer after forward", policy);
    ck_assert_msg(fsdp_is_unsharded(root) == root_kept, "policy %d: root after forward", policy);
    nn_param_t *q = nn_param_find(llama_module(m), "model.layers.0.self_attn.q_proj.weight");
    ck_assert((q->compute.storage != NULL) == layer_kept);
    ok(nn_cross_entropy(ctx, logits, &tg, &loss, NULL));
    ok(nn_backward(ctx, loss));
    ck_assert(!fsdp_is_unsharded(layer) && !fsdp_is_unsharded(root)); /* after backward */
    ck_assert(q->compute.storage == NULL && q->grad != NULL);
    ck_assert(q->compute_grad.storage == NULL); /* reduced into the sharded gradient */
    ok(fsdp_unshard(layer));
    ck_assert(fsdp_is_unsharded(layer) && q->compute.shape[0] == 64);
    fsdp_reshard(layer);
    ck_assert(!fsdp_is_unsharded(layer) && q->compute.storage == NULL);
    nn_var_put(loss);
    nn_var_put(logits);
    nn_var_put(ids);
    tensor_free(&tg);
    nn_ctx_free(ctx);
    fsdp_free_all(llama_module(m));
    llama_free(m);
  }
  data_free(d);
  mesh_free(mesh);
}
END_TEST

/* Unshard's copies and values, own dtype and bf16: every rank's rows of the unsharded tensor
 * are its shard in param_dtype, bit for bit. One rank (its shard is the whole tensor) takes a
 * view of its shard, or casts it once, and copies nothing else; more ranks, or one rank with
 * the one-rank path off, copy each shard in (cast to param_dtype), gather, and copy each
 * non-empty chunk out. */
START_TEST(unshard_copies_and_values) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  mesh_t *mesh = dp_mesh();
  int W = mesh_size(mesh, mesh_ndim(mesh) - 1); /* the shard dimension */
  for (int k = 0; k < 4; k++) {
    bool bf16 = (k & 1) != 0;
    bool one_rank_path = k < 2;
    bool flat = W > 1 || !one_rank_path;
    fsdp_set_one_rank_path(one_rank_path);
    llama_t *m;
    ok(llama_new(&cfg, NULL, &m));
    fsdp_options_t opt = FSDP_OPTIONS_INIT;
    opt.mesh = mesh;
    if (bf16) opt.param_dtype = DTYPE_BF16;
    fsdp_group_t *layer;
    ok(fully_shard(llama_layer(m, 0), &opt, &layer));
    ok(fully_shard(llama_module(m), &opt, NULL));
    nn_param_t **ps;
    int n;
    ok(nn_named_parameters(llama_layer(m, 0), &ps, &n));
    ck_assert_int_eq(n, fsdp_num_params(layer));
    int64_t chunks = 0; /* the non-empty chunks of the chunk rule */
    for (int i = 0; i < n; i++)
      for (int r = 0; r < W; r++) {
        int64_t off, len;
        placement_chunk_range(dtensor_shape(ps[i]->value)[0], W, r, &off, &len);
        chunks += len > 0;
      }
    kernel_profile_reset();
    kernel_profile_enable(true);
    ok(fsdp_unshard(layer));
    kernel_profile_row_t same = {0}, cast = {0};
    kernel_profile_get("copy", &same);
    kernel_profile_get("copy (cast)", &cast);
    kernel_profile_enable(false);
    kernel_profile_reset();
    ck_assert_int_eq(cast.calls, bf16 ? n : 0);
    ck_assert_int_eq(same.calls, flat ? (bf16 ? 0 : n) + chunks : 0);
    int bad = 0;
    for (int i = 0; i < n; i++) {
      const fsdpc_tensor_t *local = dtensor_local(ps[i]->value);
      fsdpc_tensor_t *full = &ps[i]->compute, mine, want;
      int64_t off[TENSOR_MAX_DIMS];
      dtensor_offset(ps[i]->value, off);
      ok(tensor_narrow(&mine, full, 0, off[0], local->shape[0]));
      ok(tensor_clone(&want, local, full->dtype, device_cpu()));
      ck_assert(tensor_is_contiguous(&mine) && full->dtype == (bf16 ? DTYPE_BF16 : DTYPE_F32));
      bool same;
      ok(tensor_equal(&mine, &want, &same));
      bad += !same;
      /* the one-rank path in its own dtype: the unsharded tensor is the shard's memory */
      if ((full->data == local->data) != (!flat && !bf16)) bad++;
      tensor_free(&mine);
      tensor_free(&want);
    }
    expect_all(bad == 0, "unshard (%s, one-rank path %s): %d parameters wrong",
               bf16 ? "bf16" : "own dtype", one_rank_path ? "on" : "off", bad);
    fsdp_reshard(layer);
    ck_assert(ps[0]->compute.storage == NULL);
    free(ps);
    fsdp_free_all(llama_module(m));
    llama_free(m);
  }
  fsdp_set_one_rank_path(true);
  mesh_free(mesh);
}
END_TEST

/* Counts the parameters whose local shards (values, or gradients) of a and b differ in any
 * bit, or where one has a gradient and the other not. */
static int shards_differ(const run_t *a, const run_t *b, bool grads) {
  int bad = 0;
  for (int i = 0; i < a->n; i++) {
    const dtensor_t *x = grads ? a->ps[i]->grad : a->ps[i]->value;
    const dtensor_t *y = grads ? b->ps[i]->grad : b->ps[i]->value;
    if (x == NULL || y == NULL) {
      bad += x != y;
      continue;
    }
    bool same;
    ok(tensor_equal(dtensor_local(x), dtensor_local(y), &same));
    bad += !same;
  }
  return bad;
}

/* r: the tiny Llama, every layer and the root fully sharded over mesh (bf16 parameters with
 * f32 reductions, or f32), with its optimizer. */
static void sharded_run(run_t *r, const llama_config_t *cfg, mesh_t *mesh, bool bf16) {
  run_init(r, cfg);
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  if (bf16) opt.param_dtype = DTYPE_BF16, opt.reduce_dtype = DTYPE_F32;
  for (int i = 0; i < cfg->n_layers; i++) ok(fully_shard(llama_layer(r->m, i), &opt, NULL));
  ok(fully_shard(llama_module(r->m), &opt, NULL));
  run_optim(r);
}

static void run_free(run_t *r) {
  optim_free(r->opt);
  free(r->ps);
  fsdp_free_all(llama_module(r->m));
  llama_free(r->m);
}

/* One training step on the one-rank path and on the flat-buffer path, in f32 and with bf16
 * parameters: the same gradients after two micro-batches (the first ending without waiting
 * for its reductions) and the same parameters after the optimizer step, bit for bit. More
 * ranks take the flat path both times. */
START_TEST(one_rank_path_trains_as_flat_path) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  mesh_t *mesh = dp_mesh();
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  data_spec_t spec = {.batch_size = 2, .seq_len = 16, .grad_accum = 2, .dp_size = 1};
  for (int bf16 = 0; bf16 < 2; bf16++) {
    run_t r[2];
    for (int k = 0; k < 2; k++) {
      fsdp_set_one_rank_path(k == 0);
      sharded_run(&r[k], &cfg, mesh, bf16);
      for (int micro = 0; micro < 2; micro++) {
        fsdp_set_is_last_backward(llama_module(r[k].m), micro == 1);
        fwd_bwd(r[k].m, d, &spec, 0, micro);
      }
    }
    int bad = shards_differ(&r[0], &r[1], true);
    for (int k = 0; k < 2; k++) ok(optim_step(r[k].opt, 1.0));
    bad += shards_differ(&r[0], &r[1], false);
    expect_all(bad == 0, "%s: %d shards differ between the paths", bf16 ? "bf16" : "f32", bad);
    for (int k = 0; k < 2; k++) run_free(&r[k]);
  }
  fsdp_set_one_rank_path(true);
  data_free(d);
  mesh_free(mesh);
}
END_TEST

/* Parameters kept unsharded after backward (reshard_after_backward false) across optimizer
 * steps, and a weight written with nn_param_copy_full between steps: the next forward reads
 * the new shards, as the default (gathering anew every forward) does, the losses bit for bit
 * the same; in f32 and bf16 (where even one rank holds a cast copy). */
START_TEST(kept_unsharded_params_see_the_step) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  mesh_t *mesh = dp_mesh();
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  data_spec_t spec = {.batch_size = 2, .seq_len = 16, .grad_accum = 1, .dp_size = 1};
  for (int bf16 = 0; bf16 < 2; bf16++) {
    run_t r[2];
    double loss[2][4];
    for (int k = 0; k < 2; k++) {
      sharded_run(&r[k], &cfg, mesh, bf16);
      fsdp_set_reshard_after_backward(llama_module(r[k].m), k == 0);
      for (int step = 0; step < 4; step++) {
        if (step == 3) { /* a weight written whole between steps */
          const dtensor_t *v = r[k].ps[0]->value;
          fsdpc_tensor_t full;
          ok(tensor_init(&full, DTYPE_F32, device_cpu(), dtensor_ndim(v), dtensor_shape(v)));
          ok(tensor_fill(&full, 0.01));
          ok(nn_param_copy_full(r[k].ps[0], &full));
          tensor_free(&full);
        }
        loss[k][step] = fwd_bwd(r[k].m, d, &spec, step, 0);
        if (step < 3) ok(optim_step(r[k].opt, 1.0));
        optim_zero_grad(r[k].opt);
      }
    }
    int bad = 0;
    for (int step = 0; step < 4; step++) bad += loss[0][step] != loss[1][step];
    expect_all(bad == 0 && loss[1][1] != loss[1][0],
               "%s: %d of 4 losses differ with the parameters kept unsharded (%.9g %.9g %.9g "
               "%.9g against %.9g %.9g %.9g %.9g)",
               bf16 ? "bf16" : "f32", bad, loss[1][0], loss[1][1], loss[1][2], loss[1][3],
               loss[0][0], loss[0][1], loss[0][2], loss[0][3]);
    for (int k = 0; k < 2; k++) run_free(&r[k]);
  }
  data_free(d);
  mesh_free(mesh);
}
END_TEST

/* ---- a module called twice, by hand-built modules ---- */

static fsdpc_status_t lin_fwd(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  return nn_linear(ctx, in, nn_module_param(m, 0), out);
}
static fsdpc_status_t emb_fwd(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  return nn_embedding(ctx, in, nn_module_param(m, 0), out);
}
/* head(lin(lin(emb(ids)))) */
static fsdpc_status_t twice_fwd(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *a = NULL, *b = NULL, *c = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, nn_call(ctx, nn_module_child_named(m, "emb"), in, &a));
  FSDPC_TRY_GOTO(st, nn_call(ctx, nn_module_child_named(m, "lin"), a, &b));
  FSDPC_TRY_GOTO(st, nn_call(ctx, nn_module_child_named(m, "lin"), b, &c));
  FSDPC_TRY_GOTO(st, nn_call(ctx, nn_module_child_named(m, "head"), c, out));
cleanup:
  nn_var_put(a);
  nn_var_put(b);
  nn_var_put(c);
  return st;
}

/* A root module with forward fwd and one child per name, each with one replicated 2-D weight
 * of its shape, uniform in [-0.5, 0.5) from seed + its place. */
static nn_module_t *hand_model(mesh_t *local, nn_forward_fn fwd, int n, const char *const *names,
                               const nn_forward_fn *fns, const int64_t (*shapes)[2],
                               unsigned seed) {
  nn_module_t *root;
  ok(nn_module_new("", fwd, NULL, &root));
  for (int i = 0; i < n; i++) {
    nn_module_t *c;
    ok(nn_module_new(names[i], fns[i], NULL, &c));
    ok(nn_module_add_child(root, c));
    fsdpc_tensor_t t;
    ok(tensor_init(&t, DTYPE_F32, device_cpu(), 2, shapes[i]));
    test_rng_t r = {seed + (unsigned)i};
    test_fill_uniform(&t, &r, 0.5);
    dtensor_t *d;
    placement_t rep = placement_replicate();
    ok(dtensor_from_local(&t, local, &rep, 2, shapes[i], &d));
    tensor_free(&t);
    ok(nn_module_add_param(c, "weight", d, true, NULL));
  }
  ok(nn_module_finalize(root));
  return root;
}

static nn_module_t *twice_model(mesh_t *local) {
  static const char *const names[] = {"emb", "lin", "head"};
  static const nn_forward_fn fns[] = {emb_fwd, lin_fwd, lin_fwd};
  static const int64_t shapes[][2] = {{11, 6}, {6, 6}, {11, 6}};
  return hand_model(local, twice_fwd, 3, names, fns, shapes, 77);
}

/* The loss of a step on tokens first .. first + n - 1 of a fixed sequence; with grad, after
 * its backward (else a forward without gradients: no backward follows). */
static double hand_step(nn_module_t *root, int64_t first, int64_t n, bool grad) {
  int64_t shape[2] = {1, n};
  fsdpc_tensor_t ids, tg;
  ok(tensor_init(&ids, DTYPE_I64, device_cpu(), 2, shape));
  ok(tensor_init(&tg, DTYPE_I64, device_cpu(), 2, shape));
  for (int64_t i = 0; i < n; i++) {
    ((int64_t *)ids.data)[i] = (first + i) * 7 % 11;
    ((int64_t *)tg.data)[i] = (first + i) * 5 % 11;
  }
  nn_ctx_t *ctx;
  ok(nn_ctx_new(&ctx));
  nn_ctx_set_grad_enabled(ctx, grad);
  nn_var_t *x, *logits, *loss;
  ok(nn_var_new(&ids, false, &x));
  ok(nn_call(ctx, root, x, &logits));
  ok(nn_cross_entropy(ctx, logits, &tg, &loss, NULL));
  double v;
  ok(nn_var_scalar(loss, &v));
  if (grad) ok(nn_backward(ctx, loss));
  nn_var_put(loss);
  nn_var_put(logits);
  nn_var_put(x);
  tensor_free(&tg);
  nn_ctx_free(ctx);
  return v;
}

static double twice_step(nn_module_t *root, int64_t first, int64_t n) {
  return hand_step(root, first, n, true);
}

static double eval_step(nn_module_t *root, int64_t first, int64_t n) {
  return hand_step(root, first, n, false);
}

START_TEST(module_called_twice) {
  mesh_t *mesh = dp_mesh(), *local;
  ok(mesh_new_local("local", DEVICE_CPU, &local));
  int W = world_size(), md = mesh_ndim(mesh);
  int dp = md == 2 ? mesh_coord(mesh, 0) * mesh_size(mesh, 1) + mesh_coord(mesh, 1)
                   : mesh_coord(mesh, 0);
  nn_module_t *ref = twice_model(local), *sh = twice_model(local);
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  fsdp_group_t *lin;
  ok(fully_shard(nn_module_find(sh, "lin"), &opt, &lin));
  ok(fully_shard(sh, &opt, NULL));
  const int T = 5;
  double lref = twice_step(ref, 0, T * W), lsh = twice_step(sh, dp * T, T), sum = 0;
  MPI_Allreduce(&lsh, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  int bad = fabs(sum / W - lref) > 1e-5 * fabs(lref);
  run_t r = {0}, s = {0};
  ok(nn_named_parameters(ref, &r.ps, &r.n));
  ok(nn_named_parameters(sh, &s.ps, &s.n));
  bad += compare_shards(&r, &s, true, 5e-5); /* lin's gradient sums both calls */
  expect_all(bad == 0, "module called twice: %d mismatches", bad);
  free(r.ps);
  free(s.ps);
  fsdp_free_all(sh);
  nn_module_free(ref);
  nn_module_free(sh);
  mesh_free(local);
  mesh_free(mesh);
}
END_TEST

/* ---- ranks whose batches take different paths ---- */

static int branch; /* which of "even" and "odd" the next forward takes */

/* head(even(emb(ids))) or head(odd(emb(ids))); "unused" is never called */
static fsdpc_status_t branch_fwd(nn_ctx_t *ctx, nn_module_t *m, nn_var_t *in, nn_var_t **out) {
  nn_var_t *a = NULL, *b = NULL;
  fsdpc_status_t st = STATUS_OK;
  FSDPC_TRY_GOTO(st, nn_call(ctx, nn_module_child_named(m, "emb"), in, &a));
  FSDPC_TRY_GOTO(st, nn_call(ctx, nn_module_child_named(m, branch ? "odd" : "even"), a, &b));
  FSDPC_TRY_GOTO(st, nn_call(ctx, nn_module_child_named(m, "head"), b, out));
cleanup:
  nn_var_put(a);
  nn_var_put(b);
  return st;
}

static nn_module_t *branch_model(mesh_t *local) {
  static const char *const names[] = {"emb", "even", "odd", "unused", "head"};
  static const nn_forward_fn fns[] = {emb_fwd, lin_fwd, lin_fwd, lin_fwd, lin_fwd};
  static const int64_t shapes[][2] = {{11, 6}, {6, 6}, {6, 6}, {6, 6}, {11, 6}};
  return hand_model(local, branch_fwd, 5, names, fns, shapes, 91);
}

/* Data-dependent paths: rank r's batch goes through "even" or "odd" by the parity of its
 * data-parallel index, and no batch through "unused", all in one group. Every rank reduces the
 * same elements (each trainable parameter's chunk and its presence element, equal byte counts
 * on every rank), without error; the gradients equal the reference's average of every rank's
 * own path (the ranks that skipped a parameter count as zeros, as in DDP), and "unused" has
 * no gradient anywhere, as outside the graph. On one rank "odd" is unused too. */
START_TEST(ranks_with_different_gradient_sets) {
  mesh_t *mesh = dp_mesh(), *local;
  ok(mesh_new_local("local", DEVICE_CPU, &local));
  int W = world_size(), md = mesh_ndim(mesh), Ws = mesh_size(mesh, md - 1);
  int dp = md == 2 ? mesh_coord(mesh, 0) * mesh_size(mesh, 1) + mesh_coord(mesh, 1)
                   : mesh_coord(mesh, 0);
  nn_module_t *ref = branch_model(local), *sh = branch_model(local);
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  fsdp_group_t *g;
  ok(fully_shard(sh, &opt, &g));
  pg_t *shard_pg = mesh_group(mesh, md - 1);
  pg_reset_counters(shard_pg);
  const int T = 5;
  for (int q = 0; q < W; q++) { /* the reference: each rank's own path, summed */
    branch = q % 2;
    twice_step(ref, q * T, T);
  }
  branch = dp % 2;
  twice_step(sh, dp * T, T);
  run_t r = {0}, s = {0};
  ok(nn_named_parameters(ref, &r.ps, &r.n));
  ok(nn_named_parameters(sh, &s.ps, &s.n));
  ref_average_grads(&r, W);
  int bad = 0;
  /* "unused" (and on one rank "odd"): no gradient on any rank; the rest as the reference */
  run_t rr = {0}, ss = {0};
  rr.ps = calloc((size_t)r.n, sizeof *rr.ps);
  ss.ps = calloc((size_t)s.n, sizeof *ss.ps);
  for (int i = 0; i < r.n; i++) {
    if (r.ps[i]->grad == NULL) {
      if (s.ps[i]->grad != NULL) {
        printf("rank %d: %s has a gradient no rank computed\n", world_rank(), s.ps[i]->fqn);
        bad++;
      }
      continue;
    }
    rr.ps[rr.n++] = r.ps[i];
    ss.ps[ss.n++] = s.ps[i];
  }
  bad += rr.n != (W > 1 ? 4 : 3);
  bad += compare_shards(&rr, &ss, true, 5e-5);
  /* the reduce layout: the same on every rank, whatever gradients it had */
  pg_counters_t c = pg_counters(shard_pg);
  uint64_t want = Ws > 1 ? ((uint64_t)fsdp_flat_numel(g) + 5u + 3u) / 4u * 16u * (uint64_t)(Ws - 1)
                         : 0;
  if (c.bytes[PG_REDUCE_SCATTER] != want) {
    printf("rank %d: reduce-scatter of %llu bytes, expected %llu\n", world_rank(),
           (unsigned long long)c.bytes[PG_REDUCE_SCATTER], (unsigned long long)want);
    bad++;
  }
  expect_all(bad == 0, "different gradient sets: %d mismatches", bad);
  free(rr.ps);
  free(ss.ps);
  free(r.ps);
  free(s.ps);
  fsdp_free_all(sh);
  nn_module_free(ref);
  nn_module_free(sh);
  mesh_free(local);
  mesh_free(mesh);
}
END_TEST

/* A unit prefetched for a call that does not come (the last step's order named it next) is
 * dropped at the end of backward, or of a forward without gradients: a change of its shards
 * before its next call is what that call computes with, whether the prefetch gathered it
 * (several ranks) or cast it with the unit that prefetched it (one rank in bf16: a joint
 * unshard). */
START_TEST(unconsumed_prefetch_sees_later_changes) {
  mesh_t *mesh = dp_mesh(), *local;
  ok(mesh_new_local("local", DEVICE_CPU, &local));
  int md = mesh_ndim(mesh);
  int dp = md == 2 ? mesh_coord(mesh, 0) * mesh_size(mesh, 1) + mesh_coord(mesh, 1)
                   : mesh_coord(mesh, 0);
  int bad = 0;
  for (int bf16 = 0; bf16 < 2; bf16++) {
    nn_module_t *sh = branch_model(local);
    fsdp_options_t opt = FSDP_OPTIONS_INIT;
    opt.mesh = mesh;
    if (bf16) opt.param_dtype = DTYPE_BF16;
    static const char *const units[] = {"emb", "even", "odd", "head"};
    for (int k = 0; k < 4; k++) ok(fully_shard(nn_module_find(sh, units[k]), &opt, NULL));
    ok(fully_shard(sh, &opt, NULL));
    const int T = 5;
    branch = 0;
    twice_step(sh, dp * T, T); /* emb, even, head */
    branch = 1;
    twice_step(sh, dp * T, T); /* emb prefetches even, but odd runs */
    nn_param_t *w = nn_param_find(sh, "even.weight");
    ok(tensor_fill((fsdpc_tensor_t *)dtensor_local(w->value), 0.125));
    branch = 0;
    double first = twice_step(sh, dp * T, T), again = twice_step(sh, dp * T, T);
    /* forwards without gradients: the same, with no backward to end them */
    branch = 1;
    eval_step(sh, dp * T, T);
    ok(tensor_fill((fsdpc_tensor_t *)dtensor_local(w->value), 0.25));
    branch = 0;
    double eval_first = eval_step(sh, dp * T, T), eval_again = eval_step(sh, dp * T, T);
    if (first != again || eval_first != eval_again) {
      printf(
          "rank %d, param_dtype %s: loss %.9g after the change, then %.9g; without "
          "gradients %.9g, then %.9g\n",
          world_rank(), bf16 ? "bf16" : "f32", first, again, eval_first, eval_again);
      bad++;
    }
    fsdp_free_all(sh);
    nn_module_free(sh);
  }
  expect_all(bad == 0, "a prefetch no call used: %d stale runs", bad);
  mesh_free(local);
  mesh_free(mesh);
}
END_TEST

/* An ignored parameter stays whole and local; a divide factor of 1 sums the gradients. */
START_TEST(ignored_parameter_and_divide_factor) {
  mesh_t *mesh = dp_mesh(), *local;
  ok(mesh_new_local("local", DEVICE_CPU, &local));
  int W = world_size(), md = mesh_ndim(mesh);
  int dp = md == 2 ? mesh_coord(mesh, 0) * mesh_size(mesh, 1) + mesh_coord(mesh, 1)
                   : mesh_coord(mesh, 0);
  nn_module_t *ref = twice_model(local), *sh = twice_model(local);
  nn_param_t *head = nn_param_find(sh, "head.weight");
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  opt.ignored = &head;
  opt.n_ignored = 1;
  fsdp_group_t *g;
  ok(fully_shard(sh, &opt, &g));
  ck_assert_int_eq(fsdp_num_params(g), 2);
  ck_assert(!head->external && dtensor_mesh(head->value) == local);
  fsdp_set_gradient_divide_factor(sh, 1.0);
  const int T = 5;
  twice_step(ref, 0, T * W);
  twice_step(sh, dp * T, T);
  /* summed, not averaged: the reference's mean gradient times W */
  nn_param_t *rl = nn_param_find(ref, "lin.weight");
  fsdpc_tensor_t scaled;
  ok(tensor_clone(&scaled, dtensor_local(rl->grad), DTYPE_F32, device_cpu()));
  for (int64_t i = 0; i < tensor_numel(&scaled); i++) ((float *)scaled.data)[i] *= (float)W;
  nn_param_t *sl = nn_param_find(sh, "lin.weight");
  int64_t off[2];
  dtensor_offset(sl->value, off);
  fsdpc_tensor_t want;
  ok(tensor_narrow_box(&want, &scaled, off, dtensor_local(sl->grad)->shape));
  double e = tensor_numel(&want) ? test_rel_l2(dtensor_local(sl->grad), &want) : 0;
  ck_assert(head->grad != NULL); /* the ignored weight has its local, unreduced gradient */
  expect_all(e < 1e-5, "divide factor 1: error %.3g", e);
  tensor_free(&want);
  tensor_free(&scaled);
  fsdp_free_all(sh);
  nn_module_free(ref);
  nn_module_free(sh);
  mesh_free(local);
  mesh_free(mesh);
}
END_TEST

/* Memory (docs/design.md, "fully_shard"): with reshard_after_forward, forward ends holding the
 * sharded state, the root's gathered parameters and the activations, and never more than a
 * few unsharded groups on top; the activations are measured on the unsharded model with the
 * same batch. */
/* ---- order of unshard / reshard / post-backward events ---- */

static char event_log[2048];

static void log_event(const char *event, const fsdp_group_t *g, void *user) {
  (void)user;
  const char *name = fsdp_group_name(g);
  size_t n = strlen(event_log);
  snprintf(event_log + n, sizeof event_log - n, "%s %s\n", event,
           name[0] ? name + strlen("model.") : "root");
}

/* Runs two iterations and returns the second one's events: forward, then backward (bf16:
 * parameters in bf16, which the one-rank path casts, two layers at a time in a joint
 * unshard). */
static void two_iterations(int explicit_mode, bool bf16, char *fwd, char *bwd, size_t size) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  mesh_t *mesh = dp_mesh();
  llama_t *m;
  ok(llama_new(&cfg, NULL, &m));
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  if (bf16) opt.param_dtype = DTYPE_BF16;
  fsdp_group_t *l0, *l1, *root;
  ok(fully_shard(llama_layer(m, 0), &opt, &l0));
  ok(fully_shard(llama_layer(m, 1), &opt, &l1));
  ok(fully_shard(llama_module(m), &opt, &root));
  if (explicit_mode == 1) { /* the root gathers both blocks up front, block 1 first */
    fsdp_group_t *both[] = {l1, l0};
    ok(fsdp_set_forward_prefetch(root, both, 2));
    ok(fsdp_set_forward_prefetch(l0, NULL, 0));
    ok(fsdp_set_forward_prefetch(l1, NULL, 0));
  }
  if (explicit_mode == 2) { /* backward: the root gathers both blocks up front, block 0 first */
    fsdp_group_t *both[] = {l0, l1};
    ok(fsdp_set_backward_prefetch(root, both, 2));
    ok(fsdp_set_backward_prefetch(l1, NULL, 0));
    ok(fsdp_set_backward_prefetch(l0, NULL, 0));
  }
  fsdp_set_event_hook(llama_module(m), log_event, NULL);
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  data_spec_t spec = {.batch_size = 1, .seq_len = 8, .grad_accum = 1, .dp_size = 1};
  for (int it = 0; it < 2; it++) {
    nn_ctx_t *ctx;
    ok(nn_ctx_new(&ctx));
    fsdpc_tensor_t in, tg;
    ok(data_batch(d, &spec, it, 0, &in, &tg));
    nn_var_t *ids, *logits, *loss;
    ok(nn_var_new(&in, false, &ids));
    event_log[0] = '\0';
    ok(nn_call(ctx, llama_module(m), ids, &logits));
    snprintf(fwd, size, "%s", event_log);
    event_log[0] = '\0';
    ok(nn_cross_entropy(ctx, logits, &tg, &loss, NULL));
    ok(nn_backward(ctx, loss));
    snprintf(bwd, size, "%s", event_log);
    nn_var_put(loss);
    nn_var_put(logits);
    nn_var_put(ids);
    tensor_free(&tg);
    nn_ctx_free(ctx);
  }
  fsdp_free_all(llama_module(m));
  llama_free(m);
  data_free(d);
  mesh_free(mesh);
}

static const char *kDefaultForward =
    "unshard root\nunshard layers.0\nunshard layers.1\nreshard layers.0\nreshard layers.1\n";
static const char *kDefaultBackward =
    "unshard layers.1\nunshard layers.0\npost_backward layers.1\nreshard layers.1\n"
    "post_backward layers.0\nreshard layers.0\npost_backward root\nreshard root\n";

START_TEST(event_order_default) {
  char fwd[2048], bwd[2048];
  for (int bf16 = 0; bf16 < 2; bf16++) {
    two_iterations(0, bf16, fwd, bwd, sizeof fwd);
    /* forward: the root gathers, prefetching block 0; block 0 prefetches block 1 */
    ck_assert_str_eq(fwd, kDefaultForward);
    /* backward: the root (still gathered) prefetches block 1; block 1 prefetches block 0 */
    ck_assert_str_eq(bwd, kDefaultBackward);
  }
}
END_TEST

START_TEST(event_order_explicit_forward_prefetch) {
  char fwd[2048], bwd[2048];
  for (int bf16 = 0; bf16 < 2; bf16++) {
    two_iterations(1, bf16, fwd, bwd, sizeof fwd);
    ck_assert_str_eq(fwd,
                     "unshard root\nunshard layers.1\nunshard layers.0\nreshard layers.0\n"
                     "reshard layers.1\n");
    ck_assert_str_eq(bwd, kDefaultBackward);
  }
}
END_TEST

START_TEST(event_order_explicit_backward_prefetch) {
  char fwd[2048], bwd[2048];
  for (int bf16 = 0; bf16 < 2; bf16++) {
    two_iterations(2, bf16, fwd, bwd, sizeof fwd);
    ck_assert_str_eq(fwd, kDefaultForward);
    ck_assert_str_eq(bwd,
                     "unshard layers.0\nunshard layers.1\npost_backward layers.1\n"
                     "reshard layers.1\npost_backward layers.0\nreshard layers.0\n"
                     "post_backward root\nreshard root\n");
  }
}
END_TEST

/* Integer reshard_after_forward N: the backward all-gather runs within groups of N. */
static Suite *make_suite(void) {
  Suite *s = suite_create("fsdp_control");
  TCase *tc = tcase_create("fsdp_control");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, parameter_state_after_forward_and_backward);
  tcase_add_test(tc, unshard_copies_and_values);
  tcase_add_test(tc, one_rank_path_trains_as_flat_path);
  tcase_add_test(tc, kept_unsharded_params_see_the_step);
  tcase_add_test(tc, module_called_twice);
  tcase_add_test(tc, ranks_with_different_gradient_sets);
  tcase_add_test(tc, ignored_parameter_and_divide_factor);
  tcase_add_test(tc, event_order_default);
  tcase_add_test(tc, event_order_explicit_forward_prefetch);
  tcase_add_test(tc, event_order_explicit_backward_prefetch);
  tcase_add_test(tc, unconsumed_prefetch_sees_later_changes);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
