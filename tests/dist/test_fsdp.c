/*
 * fully_shard against the single-rank model: shards equal the chunk-rule slices, training
 * with FSDP (or HSDP with argument "hsdp[:R]", HFSDP with "hfsdp" beside it) matches the
 * unsharded run step for step for every plan, the collectives per step are exactly one
 * all-gather per unshard and one reduce-scatter (and for HSDP one all-reduce; for HFSDP one
 * reduce-scatter over the replicas and one all-gather a step to refresh the shards) per group
 * with the bytes of docs/design.md "Performance model", and forward memory stays within the
 * budget of docs/design.md, "fully_shard".
 * With argument "cuda" or "cuda:offload" (the GPU suite; any world size, "hsdp[:R]" as a second
 * argument) the parity plans run on the GPU against the single-rank model on the GPU: at
 * world size 1, or several ranks on as many GPUs (NCCL), or on one GPU through the host-staged
 * groups (FSDPC_PG=staged-lazy).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/kernels.h"
#include "nn/ops.h"
#include "train/train.h"
#include "tests/dist/fsdp_common.h"

#define STEPS 10

START_TEST(shards_are_chunks) {
  mesh_t *mesh = dp_mesh(), *local;
  ok(mesh_new_local("local", DEVICE_CPU, &local));
  static const int64_t shapes[][3] = {{16, 15}, {7, 15}, {16, 17}, {3, 0}, {1, 8}};
  static const int ndims[] = {2, 2, 2, 1, 2};
  nn_module_t *root = params_module(local, 5, ndims, shapes);
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  ok(fully_shard(root, &opt, NULL));
  int md = mesh_ndim(mesh), W = mesh_size(mesh, md - 1), r = mesh_coord(mesh, md - 1);
  int bad = 0;
  for (int i = 0; i < 5; i++) {
    char name[16];
    snprintf(name, sizeof name, "p%d", i);
    nn_param_t *p = nn_param_find(root, name);
    const fsdpc_tensor_t *l = dtensor_local(p->value);
    int64_t start, len, row = shapes[i][1] ? shapes[i][1] : 1;
    placement_chunk_range(shapes[i][0], W, r, &start, &len);
    if (l->shape[0] != len) bad++;
    for (int64_t k = 0; k < len * row; k++)
      if (((float *)l->data)[k] != (float)(1000 * i + start * row + k)) bad++;
  }
  expect_all(bad == 0, "%d shard mismatches", bad);
  /* scalars are refused */
  nn_module_t *s;
  ok(nn_module_new("", NULL, NULL, &s));
  fsdpc_tensor_t t;
  ok(tensor_zeros(&t, DTYPE_F32, device_cpu(), 0, NULL));
  dtensor_t *d;
  placement_t rep = placement_replicate();
  ok(dtensor_from_local(&t, local, &rep, 0, NULL, &d));
  tensor_free(&t);
  ok(nn_module_add_param(s, "scale", d, true, NULL));
  ok(nn_module_finalize(s));
  ck_assert_int_eq(fully_shard(s, &opt, NULL), STATUS_ESHAPE);
  ck_assert(strstr(err_detail(), "scale") != NULL);
  nn_module_free(s);
  /* the groups of a model that lives on go with their hooks */
  for (int k = 0; k < NN_HOOK_COUNT; k++) ck_assert_int_eq(nn_module_num_hooks(root, k), 1);
  fsdp_free_all(root);
  for (int k = 0; k < NN_HOOK_COUNT; k++) ck_assert_int_eq(nn_module_num_hooks(root, k), 0);
  ck_assert_ptr_null(fsdp_group_of(root));
  nn_module_free(root);
  mesh_free(local);
  mesh_free(mesh);
}
END_TEST

typedef struct plan {
  bool tied;
  int reshard;          /* of the transformer blocks; the root keeps the default */
  int accum;            /* micro-batches per step */
  bool hold_all_reduce; /* HSDP accumulation: reduce-scatter every micro-batch, all-reduce once */
  bool ac;              /* activation checkpointing of the sharded model's blocks */
  bool frozen;          /* one frozen parameter inside a trainable group */
  bool bf16;            /* param_dtype bf16, reduce_dtype f32, on both sides */
  bool tied_group;      /* [embed_tokens, lm_head] as one group below the root (tied) */
  bool last_backward;   /* accumulation with sync on every micro-batch, is_last_backward false
                           on all but the last */
  bool shard_dims;      /* the projections on their last dimension, the embeddings on 1 */
} plan_t;

static int projection_dims(const nn_param_t *p, void *user) {
  (void)user;
  size_t n = strlen(p->fqn);
  if (n > 11 && strcmp(p->fqn + n - 11, "proj.weight") == 0) return -1;
  return strstr(p->fqn, "embed_tokens") || strstr(p->fqn, "lm_head") ? 1 : 0;
}

/* HFSDP: the elements of group i's block in the replica all-gather (all its parameters) or
 * reduce-scatter (the trainable ones, then a presence element each), before rounding: each
 * parameter's shard of len rows (of its shard dimension over the shard group) is chunked over
 * the R replicas, ceil(len / R) rows of row elements a replica. The blocks are the layers'
 * parameters and the root's (the rest). */
static uint64_t replica_elems(const plan_t *pl, const run_t *sh, int i, int n_groups,
                              const mesh_t *mesh, bool reduce) {
  int R = mesh_size(mesh, 0), S = mesh_size(mesh, 1), s = mesh_coord(mesh, 1);
  uint64_t n = 0;
  for (int k = 0; k < sh->n; k++) {
    const nn_param_t *p = sh->ps[k];
    int layer = -1;
    if (sscanf(p->fqn, "model.layers.%d.", &layer) != 1) layer = n_groups - 1;
    if (layer != i || (reduce && !p->requires_grad)) continue;
    int nd = dtensor_ndim(p->value), d = pl->shard_dims ? projection_dims(p, NULL) : 0;
    d = d < 0 ? d + nd : d;
    int64_t numel = 1, start, len;
    for (int j = 0; j < nd; j++) numel *= dtensor_shape(p->value)[j];
    int64_t extent = dtensor_shape(p->value)[d];
    placement_chunk_range(extent, S, s, &start, &len);
    n += (uint64_t)(placement_chunk_size(len, R) * (numel / extent)) + (reduce ? 1 : 0);
  }
  return n;
}

/* Collectives one step must issue on the shard and replicate groups. */
static void expected_counts(const plan_t *pl, fsdp_group_t **groups, int n_groups,
                            const mesh_t *mesh, const run_t *sh, pg_counters_t *shard,
                            pg_counters_t *rep, pg_counters_t *post) {
  int md = mesh_ndim(mesh), Ws = mesh_size(mesh, md - 1), R = md == 2 ? mesh_size(mesh, 0) : 1;
  memset(shard, 0, sizeof *shard);
  memset(rep, 0, sizeof *rep);
  memset(post, 0, sizeof *post);
  bool no_sync = pl->accum > 1 && !pl->hold_all_reduce && !pl->last_backward;
  for (int i = 0; i < n_groups; i++) {
    /* all-gathers move param_dtype, reductions f32: every trainable parameter's chunk and
     * its presence element (whether a rank had its gradient); a frozen parameter is not
     * reduced */
    uint64_t per16 = pl->bf16 ? 8 : 4; /* every rank's block a whole number of 16 bytes */
    uint64_t fb = ((uint64_t)fsdp_flat_numel(groups[i]) + per16 - 1) / per16 * 16;
    uint64_t rn = (uint64_t)fsdp_flat_numel(groups[i]) + (uint64_t)fsdp_num_params(groups[i]);
    if (pl->frozen && i == 1) rn -= (uint64_t)placement_chunk_size(64, Ws) + 1;
    uint64_t rb = (rn + 3) / 4 * 4 * 4; /* each rank's block a whole number of 16 bytes */
    bool layer = i < n_groups - 1, int_reshard = layer && pl->reshard >= 2;
    bool full_reshard = pl->reshard == 1 || pl->reshard == FSDP_RESHARD_AUTO;
    uint64_t gathers = (uint64_t)pl->accum * (layer && full_reshard ? 2 : 1);
    if (int_reshard) { /* the backward gathers run within groups of N */
      uint64_t N = (uint64_t)pl->reshard;
      post->calls[PG_ALL_GATHER] += (uint64_t)pl->accum;
      post->bytes[PG_ALL_GATHER] += (uint64_t)pl->accum * (N - 1) * fb * (uint64_t)Ws / N;
    }
    uint64_t scatters = no_sync ? 1 : (uint64_t)pl->accum;
    if (Ws > 1) {
      shard->calls[PG_ALL_GATHER] += gathers;
      shard->bytes[PG_ALL_GATHER] += gathers * (uint64_t)(Ws - 1) * fb;
      shard->calls[PG_REDUCE_SCATTER] += scatters;
      shard->bytes[PG_REDUCE_SCATTER] += scatters * (uint64_t)(Ws - 1) * rb;
    }
    uint64_t reduces = pl->last_backward ? (uint64_t)pl->accum : 1;
    if (R > 1 && hfsdp_mode()) { /* reduce-scatters over the replicas, one refresh a step */
      uint64_t r2 = (replica_elems(pl, sh, i, n_groups, mesh, true) + 3) / 4 * 16;
      uint64_t g2 = (replica_elems(pl, sh, i, n_groups, mesh, false) + 3) / 4 * 16;
      rep->calls[PG_REDUCE_SCATTER] += reduces;
      rep->bytes[PG_REDUCE_SCATTER] += reduces * (uint64_t)(R - 1) * r2;
      rep->calls[PG_ALL_GATHER] += 1;
      rep->bytes[PG_ALL_GATHER] += (uint64_t)(R - 1) * g2;
    } else if (R > 1) {
      rep->calls[PG_ALL_REDUCE] += reduces;
      rep->bytes[PG_ALL_REDUCE] += reduces * 2u * (uint64_t)(R - 1) * rb / (uint64_t)R;
    }
  }
}

/* Whether a world of one rank takes fully_shard's one-rank path (on unless the environment
 * turns it off: FSDPC_FSDP_ONE_RANK=0). */
/* Whether shard groups of one rank take the one-rank path (FSDPC_FSDP_ONE_RANK, read as the
 * library reads it). */
static bool one_rank_path_allowed(void) {
  const char *off = getenv("FSDPC_FSDP_ONE_RANK");
  return !(off != NULL && strcmp(off, "0") == 0);
}

static bool one_rank_path_on(void) { return world_size() == 1 && one_rank_path_allowed(); }

static void parity(const plan_t *pl) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  cfg.vocab_size = 250; /* not divisible by 3, 4 or 8 */
  cfg.tie_embeddings = pl->tied;
  mesh_t *mesh = dp_mesh();
  int md = mesh_ndim(mesh), W = world_size();
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  const int B = 2;
  int dp_rank = md == 2 ? mesh_coord(mesh, 0) * mesh_size(mesh, 1) + mesh_coord(mesh, 1)
                        : mesh_coord(mesh, 0);
  data_spec_t lspec = {
      .batch_size = B, .seq_len = 16, .grad_accum = pl->accum, .dp_size = W, .dp_rank = dp_rank};
  run_t ref, sh;
  run_init(&ref, &cfg);
  run_init(&sh, &cfg);
  if (pl->ac) llama_set_activation_checkpointing(sh.m, true);
  if (pl->frozen) {
    const char *fz = "model.layers.1.post_attention_layernorm.weight";
    nn_param_find(llama_module(ref.m), fz)->requires_grad = false;
    nn_param_find(llama_module(sh.m), fz)->requires_grad = false;
  }
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  opt.reshard_after_forward = pl->reshard;
  opt.offload = test_offload();
  opt.shard_state_over_replicas = hfsdp_mode();
  if (pl->shard_dims) opt.shard_dim = projection_dims;
  mesh_t *one = NULL;
  if (pl->bf16) { /* the reference runs the same casts: fully sharded over one rank */
    opt.param_dtype = DTYPE_BF16;
    opt.reduce_dtype = DTYPE_F32;
    ok(mesh_new_local("one", test_device_type(), &one));
    fsdp_options_t o1 = opt;
    o1.offload = o1.shard_state_over_replicas = false;
    o1.mesh = one;
    for (int i = 0; i < cfg.n_layers; i++) ok(fully_shard(llama_layer(ref.m, i), &o1, NULL));
    o1.reshard_after_forward = FSDP_RESHARD_AUTO;
    ok(fully_shard(llama_module(ref.m), &o1, NULL));
  }
  fsdp_group_t *groups[16];
  int ng = (int)cfg.n_layers + 1;
  for (int i = 0; i < cfg.n_layers; i++) ok(fully_shard(llama_layer(sh.m, i), &opt, &groups[i]));
  opt.reshard_after_forward = FSDP_RESHARD_AUTO;
  if (pl->tied_group) {
    nn_module_t *pair[] = {nn_module_find(llama_module(sh.m), "model.embed_tokens"),
                           nn_module_find(llama_module(sh.m), "lm_head")};
    fsdp_group_t *tg;
    ok(fully_shard_modules(pair, 2, &opt, &tg));
    ck_assert_int_eq(fsdp_num_params(tg), 1); /* the tied weight, once */
  }
  ok(fully_shard(llama_module(sh.m), &opt, &groups[cfg.n_layers]));
  for (int i = 1; i < cfg.n_layers; i++) /* one post-forward group per (mesh, N) */
    ck_assert_ptr_eq(fsdp_post_forward_group(groups[i]), fsdp_post_forward_group(groups[0]));
  run_optim(&ref);
  run_optim(&sh);
  if (hfsdp_mode()) /* every rank holds its own 1/(R*S) of each parameter: no replicas */
    for (int i = 0; i < sh.n; i++) {
      const dtensor_t *v = sh.ps[i]->value;
      int nd = dtensor_ndim(v), d = pl->shard_dims ? projection_dims(sh.ps[i], NULL) : 0;
      d = d < 0 ? d + nd : d;
      int64_t start, len, sub_start, sub, extent = dtensor_shape(v)[d];
      placement_chunk_range(extent, mesh_size(mesh, 1), mesh_coord(mesh, 1), &start, &len);
      placement_chunk_range(len, mesh_size(mesh, 0), mesh_coord(mesh, 0), &sub_start, &sub);
      ck_assert_msg(
          dtensor_placements(v)[0].kind == PLACEMENT_SHARD && dtensor_local(v)->shape[d] == sub,
          "%s: %lld rows here, want %lld", sh.ps[i]->fqn, (long long)dtensor_local(v)->shape[d],
          (long long)sub);
    }
  nn_param_t *root_param = nn_param_find(llama_module(sh.m), "model.norm.weight");
  nn_param_t *block_param = nn_param_find(llama_module(sh.m), "model.layers.0.mlp.up_proj.weight");
  mesh_t *flat = NULL;
  const char *names[] = {"dp_replicate", "dp_shard"};
  if (md == 2) ok(mesh_flatten(mesh, 2, names, "dp", &flat));
  pg_t *world_pg = mesh_group(md == 2 ? flat : mesh, 0);
  pg_t *shard_pg = mesh_group(mesh, md - 1), *rep_pg = md == 2 ? mesh_group(mesh, 0) : NULL;
  lr_schedule_t sched = {.warmup_steps = 3, .total_steps = STEPS, .min_ratio = 0.1};
  /* bf16: the weight gradients of the local batch and of the global batch round differently */
  double tol = pl->bf16 ? 2e-3 : 1e-5, grad_tol = pl->bf16 ? 1e-1 : 5e-5;
  double param_tol = pl->bf16 ? 1e-2 : 1e-5;
  int bad = 0;
  for (int s = 0; s < STEPS; s++) {
    optim_zero_grad(ref.opt);
    optim_zero_grad(sh.opt);
    pg_reset_counters(shard_pg);
    if (rep_pg) pg_reset_counters(rep_pg);
    double lref = 0, lsh = 0, lsum = 0;
    for (int m = 0; m < pl->accum; m++) {
      bool last = m == pl->accum - 1;
      if (pl->hold_all_reduce)
        fsdp_set_requires_all_reduce(llama_module(sh.m), last);
      else if (pl->last_backward)
        fsdp_set_is_last_backward(llama_module(sh.m), last);
      else
        fsdp_set_requires_gradient_sync(llama_module(sh.m), last);
      lref += ref_fwd_bwd(ref.m, d, &lspec, s, m) / pl->accum;
      lsh += fwd_bwd(sh.m, d, &lspec, s, m) / pl->accum;
      if (pl->last_backward && m == 0) {
        /* the root's reduction (the last) is still in flight; alone and on the device it
         * computes on (the one-rank path), a reduction has nothing to wait for and is done */
        bool done = one_rank_path_on() && !opt.offload;
        if ((root_param->grad != NULL) != done || block_param->grad == NULL) bad++;
      }
    }
    if (opt.offload) /* sharded state on the host */
      for (int i = 0; i < sh.n; i++)
        if (dtensor_local(sh.ps[i]->value)->device.type != DEVICE_CPU ||
            (sh.ps[i]->grad && dtensor_local(sh.ps[i]->grad)->device.type != DEVICE_CPU))
          bad++;
    pg_counters_t want_s, want_r, want_p, got_r = {0}, got_p = {0};
    expected_counts(pl, groups, ng, mesh, &sh, &want_s, &want_r, &want_p);
    pg_counters_t got_s = pg_counters(shard_pg);
    if (rep_pg) got_r = pg_counters(rep_pg);
    for (int i = 0; i < ng; i++) {
      pg_t *pf = fsdp_post_forward_group(groups[i]);
      if (pf == NULL) continue;
      pg_counters_t c = pg_counters(pf);
      for (int k = 0; k < PG_KIND_COUNT; k++) {
        got_p.calls[k] += c.calls[k];
        got_p.bytes[k] += c.bytes[k];
      }
      pg_reset_counters(pf);
    }
    if (!pl->tied_group) { /* the closed form below covers blocks + root */
      bad += check_counts(s, "shard", &got_s, &want_s);
      if (rep_pg) bad += check_counts(s, "replicate", &got_r, &want_r);
      bad += check_counts(s, "post-forward", &got_p, &want_p);
    }
    ref_average_grads(&ref, W);
    MPI_Allreduce(&lsh, &lsum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    lsh = lsum / W;
    if (fabs(lsh - lref) > tol * fabs(lref)) {
      bad++;
      if (world_rank() == 0) printf("step %d: sharded loss %.8f, single rank %.8f\n", s, lsh, lref);
    }
    bad += compare_shards(&ref, &sh, true, grad_tol); /* gradients before clipping */
    ok(clip_grad_norm(ref.ps, ref.n, 1.0, NULL, NULL));
    /* a sharded model's norm needs the group its shards span: NULL (this rank alone) refused */
    if (s == 0 && mesh_size(mesh, md - 1) > 1)
      expect_all(clip_grad_norm(sh.ps, sh.n, 1.0, NULL, NULL) == STATUS_EINVAL &&
                     strstr(err_detail(), "is split over ranks") != NULL,
                 "clip_grad_norm of shards with no group: %s", err_detail());
    ok(clip_grad_norm(sh.ps, sh.n, 1.0, world_pg, NULL));
    ok(optim_step(ref.opt, lr_schedule_factor(&sched, s)));
    ok(optim_step(sh.opt, lr_schedule_factor(&sched, s)));
  }
  bad += compare_shards(&ref, &sh, false, param_tol);
  expect_all(bad == 0, "%d mismatches between the sharded and the single-rank run", bad);
  for (run_t *r = &ref; r; r = r == &ref ? &sh : NULL) {
    optim_free(r->opt);
    free(r->ps);
  }
  fsdp_free_all(llama_module(sh.m));
  fsdp_free_all(llama_module(ref.m));
  llama_free(ref.m);
  llama_free(sh.m);
  data_free(d);
  mesh_free(flat);
  mesh_free(one);
  mesh_free(mesh);
}

START_TEST(training_parity_reshard) {
  parity(
      &(plan_t){.tied = false, .reshard = FSDP_RESHARD_AUTO, .accum = 1, .hold_all_reduce = false});
}
END_TEST
START_TEST(training_parity_tied_module_list) {
  parity(&(plan_t){.tied = true, .reshard = FSDP_RESHARD_AUTO, .accum = 1, .tied_group = true});
}
END_TEST
START_TEST(training_parity_checkpointed_frozen) {
  parity(&(plan_t){.reshard = FSDP_RESHARD_AUTO, .accum = 1, .ac = true, .frozen = true});
}
END_TEST
START_TEST(training_parity_mixed_precision) {
  parity(&(plan_t){.reshard = FSDP_RESHARD_AUTO, .accum = 1, .bf16 = true});
}
END_TEST
START_TEST(training_parity_no_reshard_tied) {
  parity(&(plan_t){.tied = true, .reshard = 0, .accum = 1, .hold_all_reduce = false});
}
END_TEST
START_TEST(training_parity_accumulation_no_sync) {
  parity(
      &(plan_t){.tied = false, .reshard = FSDP_RESHARD_AUTO, .accum = 2, .hold_all_reduce = false});
}
END_TEST
START_TEST(training_parity_accumulation_last_backward) {
  parity(&(plan_t){.reshard = FSDP_RESHARD_AUTO, .accum = 2, .last_backward = true});
}
END_TEST
START_TEST(training_parity_shard_dims) {
  /* tied: the one weight of embed_tokens and lm_head on dimension 1; accumulation on the side */
  parity(&(plan_t){.tied = true, .reshard = FSDP_RESHARD_AUTO, .accum = 2, .shard_dims = true});
  int Ws = hsdp_mode() ? world_size() / hsdp_replicas() : world_size();
  if (Ws == 4) parity(&(plan_t){.reshard = 2, .accum = 1, .shard_dims = true});
  parity(&(plan_t){.reshard = FSDP_RESHARD_AUTO, .accum = 1, .bf16 = true, .shard_dims = true});
}
END_TEST
START_TEST(training_parity_accumulation_hold_all_reduce) {
  parity(&(plan_t){.tied = false, .reshard = 1, .accum = 3, .hold_all_reduce = true});
}
END_TEST

START_TEST(training_parity_int_reshard) {
  int Ws = hsdp_mode() ? world_size() / hsdp_replicas() : world_size();
  for (int N = 2; N < Ws; N *= 2)
    if (Ws % N == 0)
      parity(&(plan_t){.tied = false, .reshard = N, .accum = 1, .hold_all_reduce = false});
}
END_TEST

START_TEST(int_reshard_invalid_is_refused) {
  mesh_t *mesh = dp_mesh();
  int md = mesh_ndim(mesh), Ws = mesh_size(mesh, md - 1);
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  llama_t *m;
  ok(llama_new(&cfg, NULL, &m));
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  int bad_values[] = {Ws + 1, -2, Ws > 2 ? Ws - 1 : 7, 2 * Ws + 1};
  for (int i = 0; i < 4; i++) {
    opt.reshard_after_forward = bad_values[i];
    int v = bad_values[i];
    if ((v >= -1 && v <= 1) || (v > 1 && v <= Ws && Ws % v == 0)) continue; /* valid ones */
    ck_assert_int_eq(fully_shard(llama_layer(m, 0), &opt, NULL), STATUS_EINVAL);
    ck_assert(strstr(err_detail(), "reshard_after_forward") != NULL);
  }
  if (Ws >= 2) { /* N = the shard group's size is true, as PyTorch reads it */
    fsdp_group_t *g = NULL;
    opt.reshard_after_forward = Ws;
    ok(fully_shard(llama_layer(m, 0), &opt, &g));
    ck_assert_int_eq(fsdp_reshard_after_forward(g), 1);
  }
  llama_free(m);
  mesh_free(mesh);
}
END_TEST

/* Which parameters are unsharded after forward and after backward, per reshard policy;
 * manual unshard and reshard. */
START_TEST(memory_within_budget) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  cfg.n_layers = 6;
  mesh_t *mesh = dp_mesh();
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  data_spec_t spec = {.batch_size = 1, .seq_len = 16, .grad_accum = 1, .dp_size = 1};
  device_t cpu = device_cpu();
  size_t act = 0, grown = 0, peak = 0, root_bytes = 0, largest = 0;
  size_t ref_bwd = 0, ref_grads = 0, bwd_peak = 0, bwd_end = 0, sharded_grads = 0;
  for (int k = 0; k < 2; k++) { /* 0: the unsharded model, 1: fully sharded */
    llama_t *m;
    ok(llama_new(&cfg, NULL, &m));
    fsdp_group_t *groups[8];
    if (k == 1) {
      fsdp_options_t opt = FSDP_OPTIONS_INIT;
      opt.mesh = mesh;
      for (int i = 0; i < cfg.n_layers; i++) ok(fully_shard(llama_layer(m, i), &opt, &groups[i]));
      ok(fully_shard(llama_module(m), &opt, &groups[cfg.n_layers]));
      int md = mesh_ndim(mesh), Ws = mesh_size(mesh, md - 1);
      for (int i = 0; i < cfg.n_layers; i++) {
        size_t b =
            ((size_t)fsdp_flat_numel(groups[i]) + 3) / 4 * 16 * (size_t)Ws; /* blocks of 16 B */
        largest = b > largest ? b : largest;
      }
      root_bytes = ((size_t)fsdp_flat_numel(groups[cfg.n_layers]) + 3) / 4 * 16 * (size_t)Ws;
    }
    nn_ctx_t *ctx;
    ok(nn_ctx_new(&ctx));
    fsdpc_tensor_t in, tg;
    ok(data_batch(d, &spec, 0, 0, &in, &tg));
    nn_var_t *ids, *logits;
    ok(nn_var_new(&in, false, &ids));
    size_t before = mem_stats(cpu).current;
    mem_reset_peak(cpu);
    ok(nn_call(ctx, llama_module(m), ids, &logits));
    if (k == 0) act = mem_stats(cpu).current - before;
    if (k == 1) {
      grown = mem_stats(cpu).current - before;
      peak = mem_stats(cpu).peak - before;
    }
    /* backward, measured from the end of forward */
    nn_var_t *loss;
    ok(nn_cross_entropy(ctx, logits, &tg, &loss, NULL));
    size_t start = mem_stats(cpu).current;
    mem_reset_peak(cpu);
    ok(nn_backward(ctx, loss));
    size_t bpeak = mem_stats(cpu).peak - start, bend = mem_stats(cpu).current;
    nn_param_t **ps;
    int n;
    ok(nn_named_parameters(llama_module(m), &ps, &n));
    size_t gb = 0;
    for (int i = 0; i < n; i++) gb += tensor_nbytes(dtensor_local(ps[i]->grad));
    free(ps);
    if (k == 0) {
      ref_bwd = bpeak;
      ref_grads = gb;
    } else {
      bwd_peak = bpeak;
      bwd_end = bend > start ? bend - start : 0;
      sharded_grads = gb;
    }
    nn_var_put(loss);
    nn_var_put(logits);
    nn_var_put(ids);
    tensor_free(&tg);
    nn_ctx_free(ctx);
    fsdp_free_all(llama_module(m));
    llama_free(m);
  }
  /* backward never holds more than the unsharded model's backward plus a few gathered groups,
   * and ends holding (beyond the freed activations) only the sharded gradients */
  size_t budget_bwd = ref_bwd + 3 * largest;
  if (world_rank() == 0)
    printf(
        "backward memory: peak %zu B (budget: unsharded model's backward peak %zu + 3 x "
        "largest group = %zu); growth at the end %zu B (budget: sharded gradients %zu, the "
        "unsharded model's are %zu)\n",
        bwd_peak, ref_bwd, budget_bwd, bwd_end, sharded_grads, ref_grads);
  expect_all(bwd_peak <= budget_bwd && bwd_end <= sharded_grads, "backward memory over budget");
  size_t budget_end = act + root_bytes, budget_peak = act + root_bytes + 3 * largest;
  if (world_rank() == 0)
    printf(
        "forward memory: end %zu B (budget: activations %zu + root %zu = %zu); peak %zu B "
        "(budget + 3 x largest group %zu = %zu)\n",
        grown, act, root_bytes, budget_end, peak, largest, budget_peak);
  expect_all(grown <= budget_end && peak <= budget_peak, "forward memory over budget");
  data_free(d);
  mesh_free(mesh);
}
END_TEST

/* Deferred initialisation: building the model meta and sharding it allocates nothing;
 * nn_module_materialize allocates exactly this rank's padded shards and never more at any
 * moment; the initialised shards equal, bit for bit, those of the model built whole,
 * initialised and then sharded; one step of both gives the same loss. */
START_TEST(deferred_init_allocates_only_shards) {
  llama_config_t cfg;
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", &cfg));
  cfg.vocab_size = 250; /* uneven chunks: padding rows on the last ranks */
  mesh_t *mesh = dp_mesh();
  device_t dev = test_offload() ? device_cpu() : mesh_device(mesh);
  llama_t *ms[2];
  fsdp_group_t *groups[2][8];
  size_t built = 0, materialized = 0, peak = 0, shards = 0;
  for (int k = 0; k < 2; k++) { /* 0: deferred, 1: eager */
    llama_options_t o = LLAMA_OPTIONS_INIT;
    o.device = test_device_type();
    o.deferred = k == 0;
    size_t c0 = mem_stats(dev).current;
    mem_reset_peak(dev);
    ok(llama_new(&cfg, &o, &ms[k]));
    if (k == 1) ok(llama_init_weights(ms[k], 99));
    fsdp_options_t opt = FSDP_OPTIONS_INIT;
    opt.mesh = mesh;
    opt.offload = test_offload();
    for (int i = 0; i < cfg.n_layers; i++)
      ok(fully_shard(llama_layer(ms[k], i), &opt, &groups[k][i]));
    ok(fully_shard(llama_module(ms[k]), &opt, &groups[k][cfg.n_layers]));
    if (k == 1) continue;
    built = mem_stats(dev).peak - c0;
    ok(nn_module_materialize(llama_module(ms[k])));
    materialized = mem_stats(dev).current - c0;
    peak = mem_stats(dev).peak - c0;
    for (int i = 0; i <= cfg.n_layers; i++) shards += (size_t)fsdp_flat_numel(groups[k][i]) * 4;
    ok(llama_init_weights(ms[k], 99));
  }
  if (world_rank() == 0)
    printf("deferred build: %zu B before materialize, %zu B after (peak %zu), shards %zu B\n",
           built, materialized, peak, shards);
  int bad = built != 0 || materialized != shards || peak != shards;
  nn_param_t **pa, **pb;
  int na, nb;
  ok(nn_named_parameters(llama_module(ms[0]), &pa, &na));
  ok(nn_named_parameters(llama_module(ms[1]), &pb, &nb));
  for (int i = 0; i < na && na == nb; i++) {
    bool eq;
    ok(tensor_equal(dtensor_local(pa[i]->value), dtensor_local(pb[i]->value), &eq));
    if (!eq) printf("rank %d: %s differs\n", world_rank(), pa[i]->fqn);
    bad += !eq;
  }
  free(pa);
  free(pb);
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  data_spec_t spec = {.batch_size = 2, .seq_len = 16, .grad_accum = 1, .dp_size = 1};
  double l0 = fwd_bwd(ms[0], d, &spec, 0, 0), l1 = fwd_bwd(ms[1], d, &spec, 0, 0);
  bad += l0 != l1;
  expect_all(bad == 0 && na == nb,
             "a deferred build allocates only the shards and initialises them as the eager one");
  for (int k = 0; k < 2; k++) {
    fsdp_free_all(llama_module(ms[k]));
    llama_free(ms[k]);
  }
  data_free(d);
  mesh_free(mesh);
}
END_TEST

/* The tiny Llama of the goldens (*cfg), each layer a unit under the root's, on mesh (offloaded
 * as the test mode says). */
/* param_dtype: FSDP's (DTYPE_COUNT: the parameters' own) */
/* The tiny model, each layer a unit and the root one, sharded with opt over its mesh (offload
 * as the test's); groups (may be NULL) receives the layers' groups, then the root's. */
static llama_t *sharded_tiny_with(llama_config_t *cfg, fsdp_options_t opt, fsdp_group_t **groups) {
  ok(llama_config_from_hf(SOURCE_ROOT "/tests/reference/tiny_config.json", cfg));
  llama_options_t o = LLAMA_OPTIONS_INIT;
  o.device = test_device_type();
  llama_t *m;
  ok(llama_new(cfg, &o, &m));
  ok(llama_init_weights(m, 5));
  opt.offload = test_offload();
  fsdp_group_t *g;
  for (int i = 0; i < cfg->n_layers; i++) {
    ok(fully_shard(llama_layer(m, i), &opt, &g));
    if (groups) groups[i] = g;
  }
  ok(fully_shard(llama_module(m), &opt, &g));
  if (groups) groups[cfg->n_layers] = g;
  return m;
}

static llama_t *sharded_tiny(mesh_t *mesh, llama_config_t *cfg, dtype_t param_dtype) {
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  opt.param_dtype = param_dtype;
  return sharded_tiny_with(cfg, opt, NULL);
}

/* This rank's micro-batches of 2 x 16 tokens, one a step. */
static data_spec_t tiny_spec(void) {
  return (data_spec_t){.batch_size = 2,
                       .seq_len = 16,
                       .grad_accum = 1,
                       .dp_size = world_size(),
                       .dp_rank = world_rank()};
}

/* The corpus, and m's parameters (*ps: the caller frees). */
static fsdpc_data_t *tiny_data(llama_t *m, nn_param_t ***ps, int *n) {
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  ok(nn_named_parameters(llama_module(m), ps, n));
  return d;
}

/* On a GPU with NCCL groups a training micro-step makes no host wait: the batch is uploaded
 * without one, the loss and its gradient stay on the device, the kernels' index checks wait
 * for the next wait, and the collectives are ordered by events. The second and third
 * micro-steps of a step are counted (the first builds handles and plans). */
START_TEST(micro_step_makes_no_host_wait) {
  /* host-staged groups and offloaded gradients wait by design */
  if (pg_device_backend() != PG_BACKEND_NATIVE || test_offload()) return;
  llama_config_t cfg;
  mesh_t *mesh = dp_mesh();
  llama_t *m = sharded_tiny(mesh, &cfg, DTYPE_COUNT);
  fsdpc_data_t *d;
  ok(data_open(SOURCE_ROOT "/data/corpus.txt", DATA_BYTES, &d));
  data_spec_t spec = {.batch_size = 2, .seq_len = 16, .grad_accum = 3,
                      .dp_size = world_size(), .dp_rank = world_rank()};
  fsdpc_tensor_t loss[3];
  size_t waits = 0;
  fsdp_set_is_last_backward(llama_module(m), false);
  ok(llama_micro_step_async(m, d, &spec, 0, 0, &loss[0]));
  size_t before = device_host_waits();
  for (int k = 1; k < 3; k++) {
    fsdp_set_is_last_backward(llama_module(m), k == 2);
    ok(llama_micro_step_async(m, d, &spec, 0, k, &loss[k]));
  }
  waits = device_host_waits() - before;
  ok(device_stream_sync(mesh_device(mesh)));
  int bad = waits != 0;
  for (int k = 0; k < 3; k++) {
    float l = NAN;
    ok(device_memcpy(device_cpu(), &l, loss[k].device, loss[k].data, sizeof l));
    bad += !isfinite(l);
    tensor_free(&loss[k]);
  }
  if (waits != 0) printf("rank %d: two micro-steps made %zu host waits\n", world_rank(), waits);
  expect_all(bad == 0, "a micro-step on the GPU waits on the host, or its loss is not finite");
  fsdp_free_all(llama_module(m));
  llama_free(m);
  data_free(d);
  mesh_free(mesh);
}
END_TEST

/* On a GPU a backward forms each unit's gradients in one buffer reserved at its pre-backward
 * (fsdp_set_grad_buffer): the same gradients, bit for bit, as with an allocation each, in one
 * device allocation a unit where its k parameters took k. The first backward learns which
 * operations form their gradients in place; the next two compare, from the same parameters. */
/* The gradients' buffer a unit (one allocation where each gradient but one took its own), and
 * under param_dtype on the one-rank path, that buffer within the unshard's (one more a unit
 * whose pre-backward unshards: every block's; the root stays unsharded). */
/* A step's device allocations after a first step (allocs[0] with set(true), allocs[1] with
 * set(false)) on the tiny model in param_dtype (DTYPE_COUNT: the parameters'), and *differ,
 * the gradients that are not the same bits both ways. Returns the number of parameters. */
static int allocations_both_ways(void (*set)(bool), dtype_t param_dtype, llama_config_t *cfg,
                                 size_t allocs[2], int *differ) {
  mesh_t *mesh = dp_mesh();
  device_t dev = mesh_device(mesh);
  llama_t *m = sharded_tiny(mesh, cfg, param_dtype);
  nn_param_t **ps;
  int n;
  fsdpc_data_t *d = tiny_data(m, &ps, &n);
  data_spec_t spec = tiny_spec();
  double loss;
  ok(llama_micro_step(m, d, &spec, 0, 0, &loss));
  fsdpc_tensor_t *grads[2];
  for (int run = 0; run < 2; run++) { /* turned on, then off */
    for (int i = 0; i < n; i++) nn_param_zero_grad(ps[i]);
    set(run == 0);
    size_t a0 = mem_stats(dev).allocs;
    ok(llama_micro_step(m, d, &spec, 1, 0, &loss));
    allocs[run] = mem_stats(dev).allocs - a0;
    grads[run] = calloc((size_t)n, sizeof(fsdpc_tensor_t));
    for (int i = 0; i < n; i++)
      ok(tensor_clone(&grads[run][i], dtensor_local(ps[i]->grad), DTYPE_F32, device_cpu()));
  }
  set(true);
  *differ = 0;
  for (int i = 0; i < n; i++) {
    bool same;
    ok(tensor_equal(&grads[0][i], &grads[1][i], &same));
    *differ += !same;
    tensor_free(&grads[0][i]);
    tensor_free(&grads[1][i]);
  }
  free(grads[0]);
  free(grads[1]);
  free(ps);
  fsdp_free_all(llama_module(m));
  llama_free(m);
  data_free(d);
  mesh_free(mesh);
  return n;
}

static void grad_buffer_allocations(dtype_t param_dtype) {
  llama_config_t cfg;
  size_t allocs[2];
  int differ, n = allocations_both_ways(fsdp_set_grad_buffer, param_dtype, &cfg, allocs, &differ);
  long saved = (long)allocs[1] - (long)allocs[0], want = n - (cfg.n_layers + 1);
  bool one_rank_path = one_rank_path_on() && !test_offload();
  if (param_dtype != DTYPE_COUNT && one_rank_path) want += cfg.n_layers;
  if (world_rank() == 0)
    printf(
        "a step's device allocations (param_dtype %s): %zu with a buffer a unit, %zu "
        "without\n",
        param_dtype == DTYPE_COUNT ? "the parameters'" : dtype_name(param_dtype), allocs[0],
        allocs[1]);
  expect_all(differ == 0 && saved == want,
             "a buffer a unit: %d of %d gradients differ; %ld allocations saved, %ld expected",
             differ, n, saved, want);
}

START_TEST(grad_buffer_same_gradients_fewer_allocations) {
  grad_buffer_allocations(DTYPE_COUNT);
  grad_buffer_allocations(DTYPE_BF16);
}
END_TEST

/* The one-rank path's joint unshard: a layer's pre-forward and pre-backward cast the next
 * layer's shards with its own, one allocation for two layers (the root keeps its parameters
 * from forward to backward and joins none); the same gradients. Elsewhere, or with the shards
 * already in param_dtype (nothing cast), the same allocations. */
START_TEST(joint_unshard_same_gradients_fewer_allocations) {
  for (int k = 0; k < 2; k++) {
    dtype_t pd = k == 0 ? DTYPE_COUNT : DTYPE_BF16;
    llama_config_t cfg;
    size_t allocs[2];
    int differ, n = allocations_both_ways(fsdp_set_joint_unshard, pd, &cfg, allocs, &differ);
    long saved = (long)allocs[1] - (long)allocs[0];
    /* shard groups of one rank (HSDP's too) take the path */
    bool one_rank = world_size() / (hsdp_mode() ? hsdp_replicas() : 1) == 1;
    long want = pd != DTYPE_COUNT && one_rank_path_allowed() && !test_offload() && one_rank
                    ? 2 * (cfg.n_layers / 2) /* forward's pairs and backward's */
                    : 0;
    if (world_rank() == 0)
      printf("a step's allocations (param_dtype %s): %zu with joint unshards, %zu without\n",
             pd == DTYPE_COUNT ? "the parameters'" : dtype_name(pd), allocs[0], allocs[1]);
    expect_all(differ == 0 && saved == want,
               "joint unshard: %d of %d gradients differ; %ld allocations saved, %ld expected",
               differ, n, saved, want);
  }
}
END_TEST

/* Three steps of the tiny model in bf16 whose root reshards after forward too and whose
 * explicit prefetch lists name a unit twice: their losses into loss[3] and the device memory
 * held after each into held[3]. */
static void three_steps_listed_twice(double loss[3], size_t held[3]) {
  llama_config_t cfg;
  mesh_t *mesh = dp_mesh();
  device_t dev = mesh_device(mesh);
  fsdp_options_t opt = FSDP_OPTIONS_INIT;
  opt.mesh = mesh;
  opt.param_dtype = DTYPE_BF16;
  opt.reshard_after_forward = 1; /* the root's too */
  fsdp_group_t *g[8];            /* the layers', then the root's */
  llama_t *m = sharded_tiny_with(&cfg, opt, g);
  ck_assert_int_eq(cfg.n_layers, 2);
  g[2] = g[cfg.n_layers];
  fsdp_group_t *twice0[] = {g[0], g[0]}, *twice1[] = {g[1], g[1]};
  ok(fsdp_set_forward_prefetch(g[2], twice0, 2));
  ok(fsdp_set_forward_prefetch(g[0], twice1, 2));
  ok(fsdp_set_backward_prefetch(g[2], twice1, 2));
  ok(fsdp_set_backward_prefetch(g[1], twice0, 2));
  nn_param_t **ps;
  int n;
  fsdpc_data_t *d = tiny_data(m, &ps, &n);
  data_spec_t spec = tiny_spec();
  for (int step = 0; step < 3; step++) {
    for (int i = 0; i < n; i++) nn_param_zero_grad(ps[i]);
    ok(llama_micro_step(m, d, &spec, step, 0, &loss[step]));
    ok(device_stream_sync(dev));
    held[step] = mem_stats(dev).current;
  }
  free(ps);
  fsdp_free_all(llama_module(m));
  llama_free(m);
  data_free(d);
  mesh_free(mesh);
}

/* A joint unshard takes a unit named twice in a prefetch list once, and a root that reshards
 * joins none: the same losses as without joint unshards, and the same memory held after each
 * step (nothing kept from one step to the next). */
START_TEST(joint_unshard_lists_twice_and_a_resharding_root) {
  double loss[2][3];
  size_t held[2][3];
  for (int run = 0; run < 2; run++) {
    fsdp_set_joint_unshard(run == 0);
    three_steps_listed_twice(loss[run], held[run]);
  }
  fsdp_set_joint_unshard(true);
  int bad = 0;
  for (int step = 0; step < 3; step++) {
    bad += loss[0][step] != loss[1][step] || held[0][step] != held[1][step];
    if (world_rank() == 0)
      printf("step %d: loss %.9g / %.9g, held %zu / %zu B (joint / not)\n", step, loss[0][step],
             loss[1][step], held[0][step], held[1][step]);
  }
  expect_all(bad == 0, "joint unshard with lists naming a unit twice: %d steps differ", bad);
}
END_TEST

static Suite *make_suite(void) {
  Suite *s = suite_create("fsdp");
  TCase *tc = tcase_create("fsdp");
  tcase_set_timeout(tc, 600);
  if (test_device_type() == DEVICE_CUDA) { /* the parity plans on the GPU */
    if (world_device().type != DEVICE_CUDA) {
      harness_skip("no CUDA device");
    } else {
      /* cuDNN's attention backward adds dq with atomics: the reference and the sharded run
       * would differ in last bits that ten bf16 steps grow past the tolerances. These tests
       * compare FSDP's data path, so attention takes the deterministic plan (cuDNN's is checked
       * against the CPU by kernels-gpu and llama-gpu). */
      kernel_attention_set_fused(false);
      tcase_add_test(tc, training_parity_reshard);
      tcase_add_test(tc, training_parity_no_reshard_tied);
      tcase_add_test(tc, training_parity_checkpointed_frozen);
      tcase_add_test(tc, training_parity_tied_module_list);
      tcase_add_test(tc, training_parity_mixed_precision);
      tcase_add_test(tc, training_parity_accumulation_no_sync);
      tcase_add_test(tc, training_parity_accumulation_last_backward);
      if (hsdp_mode()) tcase_add_test(tc, training_parity_accumulation_hold_all_reduce);
      tcase_add_test(tc, training_parity_int_reshard);
      tcase_add_test(tc, training_parity_shard_dims);
      tcase_add_test(tc, deferred_init_allocates_only_shards);
      tcase_add_test(tc, micro_step_makes_no_host_wait);
      tcase_add_test(tc, grad_buffer_same_gradients_fewer_allocations);
      tcase_add_test(tc, joint_unshard_same_gradients_fewer_allocations);
      tcase_add_test(tc, joint_unshard_lists_twice_and_a_resharding_root);
    }
    suite_add_tcase(s, tc);
    return s;
  }
  tcase_add_test(tc, shards_are_chunks);
  if (test_argc() > 1 && strcmp(test_argv()[1], "shards") == 0) { /* world sizes 5..7 */
    suite_add_tcase(s, tc);
    return s;
  }
  tcase_add_test(tc, training_parity_reshard);
  tcase_add_test(tc, training_parity_no_reshard_tied);
  tcase_add_test(tc, training_parity_checkpointed_frozen);
  tcase_add_test(tc, training_parity_tied_module_list);
  tcase_add_test(tc, training_parity_mixed_precision);
  tcase_add_test(tc, training_parity_accumulation_no_sync);
  tcase_add_test(tc, training_parity_accumulation_last_backward);
  if (hsdp_mode()) tcase_add_test(tc, training_parity_accumulation_hold_all_reduce);
  tcase_add_test(tc, training_parity_int_reshard);
  tcase_add_test(tc, training_parity_shard_dims);
  tcase_add_test(tc, int_reshard_invalid_is_refused);
  tcase_add_test(tc, memory_within_budget);
  tcase_add_test(tc, deferred_init_allocates_only_shards);
  tcase_add_test(tc, joint_unshard_same_gradients_fewer_allocations);
  tcase_add_test(tc, joint_unshard_lists_twice_and_a_resharding_root);
  suite_add_tcase(s, tc);
  return s;
}

int main(int argc, char **argv) { return harness_main(argc, argv, make_suite); }
