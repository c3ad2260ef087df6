/*
 * cuDNN fused attention (see cudnn_sdpa.h): execution plans built once per device, shape, dtype
 * and direction over the graphs of backends/cuda/sdpa_graph.c, kept with their refusals; each call
 * enqueues one plan with its pointers and a workspace from the device pool.
 */
#include "backends/cuda/cudnn_sdpa.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "core/fast_path_impl.h"
#include "core/kernels.h"

#ifdef FSDPC_HAVE_CUDNN

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/sdpa_graph.h"

/* Attributes cuDNN 9 marks deprecated but still reads: the handle of a graph and a plan. */
static const cudnnBackendAttributeName_t kGraphHandle = (cudnnBackendAttributeName_t)800;
static const cudnnBackendAttributeName_t kPlanHandle = (cudnnBackendAttributeName_t)400;

/* ---- plans, built once per key ---- */

typedef struct plan_key {
  int dev, backward;
  dtype_t dt;
  int64_t B, T, H, Hkv, Dh;
} plan_key_t;

typedef struct plan {
  plan_key_t key;
  bool used, ok;
  gb_t g; /* every descriptor the plan rests on */
  cudnnBackendDescriptor_t exec;
  int64_t workspace; /* bytes cuDNN asks for */
} plan_t;

#define PLAN_SLOTS 16

static struct {
  fast_path_t path; /* its lock guards the whole cache */
  cudnnHandle_t handle[DEVICE_MAX_CUDA];
  plan_t plans[PLAN_SLOTS];
  int next_slot;
} cache = {.path = FAST_PATH_INIT("FSDPC_CUDNN_ATTENTION", "kernel_attention_set_fused(false)")};

/* Why the last call that could not take the path did not (the cache's lock held). */
#define note_set(...) fast_path_note(&cache.path, __VA_ARGS__)

static bool key_eq(const plan_key_t *a, const plan_key_t *b) {
  return a->dev == b->dev && a->backward == b->backward && a->dt == b->dt && a->B == b->B &&
         a->T == b->T && a->H == b->H && a->Hkv == b->Hkv && a->Dh == b->Dh;
}

/* Draws the forward or backward graph of a in g and finalizes it (the handle h may be NULL:
 * then cuDNN checks the graph without a device). */
static cudnnBackendDescriptor_t graph_build(gb_t *g, const attn_shape_t *a, dtype_t dt,
                                            int backward, cudnnHandle_t h) {
  sdpa_graph_draw(g, a, dt, backward);
  cudnnBackendDescriptor_t graph = gb_new(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "graph");
  gb_set(g, graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g->nops, g->ops,
         "graph");
  if (h != NULL && graph != NULL) /* deprecated in cuDNN 9: read where still needed */
    (void)cudnn_fn.set_attr(graph, kGraphHandle, CUDNN_TYPE_HANDLE, 1, &h);
  gb_finalize(g, graph, "graph");
  return graph;
}

/* A finalized heuristics query of mode over graph. */
static cudnnBackendDescriptor_t heuristics(gb_t *g, cudnnBackendDescriptor_t graph,
                                           cudnnBackendHeurMode_t mode) {
  cudnnBackendDescriptor_t heur = gb_new(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
  gb_link(g, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph, "heuristics");
  gb_set(g, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heuristics");
  gb_finalize(g, heur, "heuristics");
  return heur;
}

/* The first of (at most 8) engine configurations heur offers that finalizes as an execution
 * plan, or NULL (then *last is the last refusal). */
static cudnnBackendDescriptor_t first_plan(gb_t *g, cudnnBackendDescriptor_t heur, cudnnHandle_t h,
                                           cudnnStatus_t *last) {
  int64_t n = 0;
  if (g->st == CUDNN_STATUS_SUCCESS) {
    cudnnStatus_t st = cudnn_fn.get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                         CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, NULL);
    if (st != CUDNN_STATUS_SUCCESS) gb_fail(g, st, "heuristics results");
  }
  if (n > 8) n = 8;
  cudnnBackendDescriptor_t cfg[8];
  for (int64_t i = 0; i < n; i++) cfg[i] = gb_new(g, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "config");
  if (g->st == CUDNN_STATUS_SUCCESS && n > 0) {
    cudnnStatus_t st = cudnn_fn.get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                         CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &n, cfg);
    if (st != CUDNN_STATUS_SUCCESS) gb_fail(g, st, "heuristics results");
  }
  for (int64_t i = 0; i < n && g->st == CUDNN_STATUS_SUCCESS; i++) {
    cudnnBackendDescriptor_t plan = gb_new(g, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "plan");
    gb_link(g, plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfg[i], "plan");
    if (g->st != CUDNN_STATUS_SUCCESS) break;
    (void)cudnn_fn.set_attr(plan, kPlanHandle, CUDNN_TYPE_HANDLE, 1, &h); /* as the graph's */
    *last = cudnn_fn.finalize(plan);
    if (*last == CUDNN_STATUS_SUCCESS) return plan;
  }
  return NULL;
}

/* Builds p's graph, asks cuDNN's heuristics (mode A, then the fallback list) for engine
 * configurations and keeps the first that finalizes as an execution plan. On failure p->ok
 * stays false and the note says why. */
static void plan_build(plan_t *p, cudnnHandle_t h, const attn_shape_t *a) {
  gb_t *g = &p->g;
  cudnnBackendDescriptor_t graph = graph_build(g, a, p->key.dt, p->key.backward, h);
  cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
  cudnnStatus_t last = CUDNN_STATUS_NOT_SUPPORTED;
  for (int i = 0; i < 2 && p->exec == NULL && g->st == CUDNN_STATUS_SUCCESS; i++)
    p->exec = first_plan(g, heuristics(g, graph, modes[i]), h, &last);
  if (g->st == CUDNN_STATUS_SUCCESS && p->exec == NULL) gb_fail(g, last, "execution plan");
  if (g->st == CUDNN_STATUS_SUCCESS) {
    int64_t n = 0;
    cudnnStatus_t st = cudnn_fn.get_attr(p->exec, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                         CUDNN_TYPE_INT64, 1, &n, &p->workspace);
    if (st != CUDNN_STATUS_SUCCESS) gb_fail(g, st, "workspace size");
  }
  if (g->st != CUDNN_STATUS_SUCCESS) {
    char detail[256] = "";
    cudnn_fn.last_error(detail, sizeof detail);
    note_set("cuDNN attention refused B=%lld T=%lld H=%lld Hkv=%lld Dh=%lld (%s) at %s: %s %s",
             (long long)a->B, (long long)a->T, (long long)a->H, (long long)a->Hkv, (long long)a->Dh,
             p->key.backward ? "backward" : "forward", g->where, cudnn_fn.status_string(g->st),
             detail);
    gb_destroy(g);
    p->exec = NULL;
    return;
  }
  p->ok = true;
}

/* The plan of key (built on first use), or NULL when cuDNN cannot run it (note set). */
static plan_t *plan_get(const plan_key_t *key, const attn_shape_t *a, cudnnHandle_t h) {
  for (int i = 0; i < PLAN_SLOTS; i++)
    if (cache.plans[i].used && key_eq(&cache.plans[i].key, key))
      return cache.plans[i].ok ? &cache.plans[i] : NULL;
  plan_t *p = &cache.plans[cache.next_slot];
  cache.next_slot = (cache.next_slot + 1) % PLAN_SLOTS;
  if (p->used) gb_destroy(&p->g); /* the oldest shape makes room */
  memset(p, 0, sizeof *p);
  p->used = true;
  p->key = *key;
  plan_build(p, h, a);
  return p->ok ? p : NULL;
}

static size_t round256(size_t n) { return (n + 255) & ~(size_t)255; }

/* Whether cuDNN can be asked to run this call at all; if not, the note says why (lock held). */
static bool eligible(const attn_shape_t *a, dtype_t dt, int n, void *const *ptr) {
  const char *off = fast_path_off_locked(&cache.path);
  if (off[0]) {
    note_set("cuDNN attention is turned off (%s)", off);
    return false;
  }
  if ((dt != DTYPE_BF16 && dt != DTYPE_F16) || a->Dh % 8 != 0 || a->Dh > 256) {
    note_set(
        "cuDNN attention takes bf16 or f16 with a head dim that is a multiple of 8 up to "
        "256; this call has %s with head dim %lld",
        dtype_name(dt), (long long)a->Dh);
    return false;
  }
  if (a->B * a->T * a->H == 0) {
    note_set("cuDNN attention takes no empty call");
    return false;
  }
  for (int i = 0; i < n; i++)
    if ((uintptr_t)ptr[i] % 16 != 0) {
      note_set("cuDNN attention takes operands on 16-byte boundaries");
      return false;
    }
  const char *load_error = cudnn_load(); /* only for calls it could run */
  if (load_error[0]) {
    note_set("%s", load_error);
    return false;
  }
  return true;
}

/* The handle of dev, created on first use (lock held). */
static cudnnHandle_t handle_of(int dev) {
  if (cache.handle[dev] == NULL) {
    cudnnStatus_t cs = cudnn_fn.create(&cache.handle[dev]);
    if (cs != CUDNN_STATUS_SUCCESS) {
      cache.handle[dev] = NULL;
      note_set("cudnnCreate: %s", cudnn_fn.status_string(cs));
    }
  }
  return cache.handle[dev];
}

/* Enqueues plan p on stream with the uids and pointers of the call; a refusal names the call. */
static fsdpc_status_t execute(cudnnHandle_t h, const plan_t *p, void *stream, int m,
                              const int64_t *uids, void *const *ptrs, void *ws) {
  cudnnBackendDescriptor_t pack = NULL;
  cudnnStatus_t cs = cudnn_fn.set_stream(h, (cudaStream_t)stream);
  if (cs == CUDNN_STATUS_SUCCESS)
    cs = cudnn_fn.create_desc(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
  if (cs == CUDNN_STATUS_SUCCESS)
    cs = cudnn_fn.set_attr(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, m, uids);
  if (cs == CUDNN_STATUS_SUCCESS)
    cs = cudnn_fn.set_attr(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, m,
                           ptrs);
  if (cs == CUDNN_STATUS_SUCCESS)
    cs = cudnn_fn.set_attr(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  if (cs == CUDNN_STATUS_SUCCESS) cs = cudnn_fn.finalize(pack);
  if (cs == CUDNN_STATUS_SUCCESS) cs = cudnn_fn.execute(h, p->exec, pack);
  if (pack != NULL) cudnn_fn.destroy_desc(pack);
  if (cs == CUDNN_STATUS_SUCCESS) return STATUS_OK;
  char detail[256] = "";
  cudnn_fn.last_error(detail, sizeof detail);
  const plan_key_t *k = &p->key;
  return err_set(STATUS_ECUDA, "cuDNN attention %s (B=%lld T=%lld H=%lld Hkv=%lld Dh=%lld): %s %s",
                 k->backward ? "backward" : "forward", (long long)k->B, (long long)k->T,
                 (long long)k->H, (long long)k->Hkv, (long long)k->Dh, cudnn_fn.status_string(cs),
                 detail);
}

/* Runs the forward or backward plan of this shape with the device pointers ptr[i] of uid[i]
 * (the scalars and the backward's workspace tensors added here). */
static fsdpc_status_t run(int dev, void *stream, const attn_shape_t *a, dtype_t dt, int backward,
                          int n, const int64_t *uid, void *const *ptr, bool *ran) {
  *ran = false;
  pthread_mutex_lock(&cache.path.lock);
  plan_key_t key = {dev, backward, dt, a->B, a->T, a->H, a->Hkv, a->Dh};
  cudnnHandle_t h = eligible(a, dt, n, ptr) ? handle_of(dev) : NULL;
  plan_t *p = h != NULL ? plan_get(&key, a, h) : NULL;
  if (p == NULL) {
    pthread_mutex_unlock(&cache.path.lock);
    return STATUS_OK;
  }
  /* workspace: cuDNN's, then the backward's row dots and F32 dQ */
  size_t own = round256((size_t)p->workspace);
  size_t rows = round256((size_t)(a->B * a->H * a->T) * sizeof(float));
  size_t dqacc = round256((size_t)(a->B * a->H * a->T * a->Dh) * sizeof(float));
  size_t ws_bytes = own + (backward ? rows + dqacc : 0);
  device_t d = device_cuda(dev);
  void *ws = NULL;
  fsdpc_status_t st = ws_bytes > 0 ? device_alloc(d, ws_bytes, &ws) : STATUS_OK;
  float scale = a->scale, one = 1.0f, lowest = -3.4028234663852886e38f; /* -FLT_MAX */
  int64_t uids[16];
  void *ptrs[16];
  int m = 0;
  for (int i = 0; i < n; i++) uids[m] = uid[i], ptrs[m++] = ptr[i];
  uids[m] = UID_SCALE, ptrs[m++] = &scale;
  uids[m] = UID_LOWEST, ptrs[m++] = &lowest;
  if (backward && st == STATUS_OK) {
    char *extra = (char *)ws + own;
    uids[m] = UID_ONE, ptrs[m++] = &one;
    uids[m] = UID_ROWDOT, ptrs[m++] = extra;
    uids[m] = UID_DQACC, ptrs[m++] = extra + rows;
    st = cuda_status(cudaMemsetAsync(extra + rows, 0, dqacc, (cudaStream_t)stream),
                     "cudaMemsetAsync (attention dQ)");
  }
  if (st == STATUS_OK && execute(h, p, stream, m, uids, ptrs, ws) != STATUS_OK) {
    /* cuDNN refused to enqueue the plan it had built: the shape goes to the batched products
     * from now on, and the note keeps why */
    note_set("%s", err_detail());
    gb_destroy(&p->g);
    p->exec = NULL;
    p->ok = false;
  } else if (st == STATUS_OK) {
    cache.path.runs++;
    *ran = true;
  }
  pthread_mutex_unlock(&cache.path.lock);
  if (ws != NULL) device_free(d, ws, ws_bytes); /* stream-ordered: after the plan's kernels */
  return st;
}

fsdpc_status_t cudnn_sdpa_check_graph(const attn_shape_t *s, dtype_t dt, bool backward) {
  const char *load_error = cudnn_load();
  if (load_error[0]) return err_set(STATUS_ENODEV, "%s", load_error);
  gb_t *g = calloc(1, sizeof *g);
  if (g == NULL) return err_set(STATUS_ENOMEM, "cuDNN attention graph check");
  heuristics(g, graph_build(g, s, dt, backward, NULL), CUDNN_HEUR_MODE_A);
  fsdpc_status_t st = STATUS_OK;
  if (g->st != CUDNN_STATUS_SUCCESS) {
    char detail[256] = "";
    cudnn_fn.last_error(detail, sizeof detail);
    st =
        err_set(STATUS_EUNSUPPORTED, "cuDNN attention %s graph, at %s: %s %s",
                backward ? "backward" : "forward", g->where, cudnn_fn.status_string(g->st), detail);
  }
  gb_destroy(g);
  free(g);
  return st;
}

fsdpc_status_t cudnn_sdpa_forward(int dev, void *stream, const attn_shape_t *s, dtype_t dt,
                                  void *out, float *lse, const void *q, const void *k,
                                  const void *v, bool *ran) {
  int64_t uid[5] = {UID_Q, UID_K, UID_V, UID_O, UID_LSE};
  void *const ptr[5] = {(void *)q, (void *)k, (void *)v, out, lse};
  return run(dev, stream, s, dt, 0, 5, uid, ptr, ran);
}

fsdpc_status_t cudnn_sdpa_backward(int dev, void *stream, const attn_shape_t *s, dtype_t dt,
                                   void *dq, void *dk, void *dv, const void *dout, const void *q,
                                   const void *k, const void *v, const void *out, const float *lse,
                                   bool *ran) {
  int64_t uid[9] = {UID_Q, UID_K, UID_V, UID_O, UID_DO, UID_LSE, UID_DQ, UID_DK, UID_DV};
  void *const ptr[9] = {(void *)q,   (void *)k, (void *)v, (void *)out, (void *)dout,
                        (void *)lse, dq,        dk,        dv};
  return run(dev, stream, s, dt, 1, 9, uid, ptr, ran);
}

void kernel_attention_set_fused(bool on) { fast_path_set(&cache.path, on); }

const char *kernel_attention_fused_off(void) { return fast_path_off(&cache.path); }

int64_t kernel_attention_fused_runs(void) { return fast_path_runs(&cache.path); }

const char *kernel_attention_fused_note(void) {
  static __thread char copy[sizeof cache.path.note];
  fast_path_note_copy(&cache.path, copy, sizeof copy);
  return copy;
}

#else /* built without cuDNN's headers */

fsdpc_status_t cudnn_sdpa_forward(int dev, void *stream, const attn_shape_t *s, dtype_t dt,
                                  void *out, float *lse, const void *q, const void *k,
                                  const void *v, bool *ran) {
  (void)dev, (void)stream, (void)s, (void)dt, (void)out, (void)lse, (void)q, (void)k, (void)v;
  *ran = false;
  return STATUS_OK;
}

fsdpc_status_t cudnn_sdpa_backward(int dev, void *stream, const attn_shape_t *s, dtype_t dt,
                                   void *dq, void *dk, void *dv, const void *dout, const void *q,
                                   const void *k, const void *v, const void *out, const float *lse,
                                   bool *ran) {
  (void)dev, (void)stream, (void)s, (void)dt, (void)dq, (void)dk, (void)dv, (void)dout, (void)q;
  (void)k, (void)v, (void)out, (void)lse;
  *ran = false;
  return STATUS_OK;
}

fsdpc_status_t cudnn_sdpa_check_graph(const attn_shape_t *s, dtype_t dt, bool backward) {
  (void)s, (void)dt, (void)backward;
  return err_set(STATUS_ENODEV, "built without cuDNN");
}

void kernel_attention_set_fused(bool on) { (void)on; }

static const char kNoCudnn[] = "built without cuDNN (no cudnn_graph.h; see the cudnn_dir option)";

const char *kernel_attention_fused_off(void) { return kNoCudnn; }

int64_t kernel_attention_fused_runs(void) { return 0; }

const char *kernel_attention_fused_note(void) { return kNoCudnn; }

#endif
