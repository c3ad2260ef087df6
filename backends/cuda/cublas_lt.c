/*
 * cuBLASLt matrix products (see cublas_lt.h): descriptors and an algorithm chosen once per
 * key and kept with their refusals; each call enqueues one cublasLtMatmul with a workspace from
 * the device pool.
 */
#include "backends/cuda/cublas_lt.h"

#include <cublasLt.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cuda/cuda_check.h"
#include "core/device.h"
#include "core/fast_path_impl.h"
#include "core/kernels.h"

/* cuBLASLt is loaded, not linked, for the reason cuBLAS is (backends/cuda/kernels_cuda.cu):
 * CPU-only runs of a CUDA build should not pay for its resident memory. */
static struct {
  __typeof__(&cublasLtCreate) create;
  __typeof__(&cublasLtMatmulDescCreate) desc_create;
  __typeof__(&cublasLtMatmulDescSetAttribute) desc_set;
  __typeof__(&cublasLtMatmulDescDestroy) desc_destroy;
  __typeof__(&cublasLtMatrixLayoutCreate) layout_create;
  __typeof__(&cublasLtMatrixLayoutDestroy) layout_destroy;
  __typeof__(&cublasLtMatmulPreferenceCreate) pref_create;
  __typeof__(&cublasLtMatmulPreferenceSetAttribute) pref_set;
  __typeof__(&cublasLtMatmulPreferenceDestroy) pref_destroy;
  __typeof__(&cublasLtMatmulAlgoGetHeuristic) heuristic;
  __typeof__(&cublasLtMatmul) matmul;
  __typeof__(&cublasLtGetStatusName) status_name;
  char error[256];
} lt;
static pthread_once_t lt_once = PTHREAD_ONCE_INIT;

#define LT_STR2(x) #x
#define LT_STR(x) LT_STR2(x)
#define LT_SONAME "libcublasLt.so." LT_STR(CUBLAS_VER_MAJOR)

static void lt_load(void) {
  void *lib = dlopen(LT_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(lt.error, sizeof lt.error, "cannot load %s: %s", LT_SONAME, dlerror());
    return;
  }
  struct {
    void **fn;
    const char *name;
  } syms[] = {
      {(void **)&lt.create, "cublasLtCreate"},
      {(void **)&lt.desc_create, "cublasLtMatmulDescCreate"},
      {(void **)&lt.desc_set, "cublasLtMatmulDescSetAttribute"},
      {(void **)&lt.desc_destroy, "cublasLtMatmulDescDestroy"},
      {(void **)&lt.layout_create, "cublasLtMatrixLayoutCreate"},
      {(void **)&lt.layout_destroy, "cublasLtMatrixLayoutDestroy"},
      {(void **)&lt.pref_create, "cublasLtMatmulPreferenceCreate"},
      {(void **)&lt.pref_set, "cublasLtMatmulPreferenceSetAttribute"},
      {(void **)&lt.pref_destroy, "cublasLtMatmulPreferenceDestroy"},
      {(void **)&lt.heuristic, "cublasLtMatmulAlgoGetHeuristic"},
      {(void **)&lt.matmul, "cublasLtMatmul"},
      {(void **)&lt.status_name, "cublasLtGetStatusName"},
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    *syms[i].fn = dlsym(lib, syms[i].name);
    if (*syms[i].fn == NULL) {
      snprintf(lt.error, sizeof lt.error, "%s lacks %s", LT_SONAME, syms[i].name);
      return;
    }
  }
}

/* ---- the product in cuBLAS's terms ---- */

lt_gemm_t cublas_lt_of_row_major(int dev, void *stream, dtype_t dt, bool trans_a, bool trans_b,
                                 const matmul_dims_t *d) {
  return (lt_gemm_t){.dev = dev,
                     .stream = stream,
                     .dt = dt,
                     .trans_a = trans_b,
                     .trans_b = trans_a,
                     .m = d->n,
                     .n = d->m,
                     .k = d->k,
                     .lda = d->ldb,
                     .ldb = d->lda,
                     .ldd = d->n};
}

void cublas_lt_layouts(const lt_gemm_t *g, lt_layout_t out[3]) {
  out[0] = (lt_layout_t){(uint64_t)(g->trans_a ? g->k : g->m), (uint64_t)(g->trans_a ? g->m : g->k),
                         g->lda};
  out[1] = (lt_layout_t){(uint64_t)(g->trans_b ? g->n : g->k), (uint64_t)(g->trans_b ? g->k : g->n),
                         g->ldb};
  out[2] = (lt_layout_t){(uint64_t)g->m, (uint64_t)g->n, g->ldd};
}

/* ---- plans, built once per key ---- */

/* What the choice of algorithm depends on; align_* are the operands' address alignments
 * (powers of two, at most 16 bytes): an algorithm chosen for aligned operands may not run on
 * others. Capped at 16, what the vector loads need, so that fresh buffers (256-byte aligned)
 * and views 16 bytes in share an algorithm: a recomputed product runs as the original did
 * wherever its operands were put. */
typedef struct plan_key {
  lt_gemm_t g; /* its stream NULL: a plan serves every stream */
  int align_a, align_b, align_d;
} plan_key_t;

typedef struct plan {
  plan_key_t key;
  bool used, ok;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulAlgo_t algo;
  size_t workspace;
} plan_t;

#define PLAN_SLOTS 128
/* the workspace the heuristics may plan for: what cuBLAS advises for Hopper */
#define MAX_WORKSPACE ((uint64_t)32 << 20)

static struct {
  fast_path_t path; /* its lock guards the whole cache */
  cublasLtHandle_t handle[DEVICE_MAX_CUDA];
  plan_t plans[PLAN_SLOTS];
  int next_slot;
} cache = {.path = FAST_PATH_INIT("FSDPC_CUBLASLT", "kernel_matmul_set_lt(false)")};

/* Why the last call that could not take the path did not (the cache's lock held). */
#define note_set(...) fast_path_note(&cache.path, __VA_ARGS__)

static bool key_eq(const plan_key_t *a, const plan_key_t *b) {
  const lt_gemm_t *x = &a->g, *y = &b->g;
  return x->dev == y->dev && x->dt == y->dt && x->trans_a == y->trans_a &&
         x->trans_b == y->trans_b && x->m == y->m && x->n == y->n && x->k == y->k &&
         x->lda == y->lda && x->ldb == y->ldb && x->ldd == y->ldd && a->align_a == b->align_a &&
         a->align_b == b->align_b && a->align_d == b->align_d;
}

static int alignment(const void *p) {
  int a = 16;
  while (a > 1 && (uintptr_t)p % (uintptr_t)a != 0) a /= 2;
  return a;
}

static cudaDataType_t data_type(dtype_t dt) {
  return dt == DTYPE_BF16 ? CUDA_R_16BF : dt == DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

static void plan_destroy(plan_t *p) {
  if (p->desc != NULL) lt.desc_destroy(p->desc);
  if (p->la != NULL) lt.layout_destroy(p->la);
  if (p->lb != NULL) lt.layout_destroy(p->lb);
  if (p->ld != NULL) lt.layout_destroy(p->ld);
  p->desc = NULL, p->la = p->lb = p->ld = NULL;
  p->ok = false;
}

/* Describes p's product and keeps the algorithm the heuristics rank first. On failure p->ok
 * stays false and the note says why. */
static void plan_build(plan_t *p, cublasLtHandle_t h) {
  const plan_key_t *k = &p->key;
  const lt_gemm_t *g = &k->g;
  cudaDataType_t t = data_type(g->dt);
  cublasOperation_t ta = g->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t tb = g->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const char *step = "cublasLtMatmulDescCreate";
  cublasStatus_t s = lt.desc_create(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (s == CUBLAS_STATUS_SUCCESS) {
    step = "cublasLtMatmulDescSetAttribute";
    s = lt.desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
  }
  if (s == CUBLAS_STATUS_SUCCESS)
    s = lt.desc_set(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
  lt_layout_t l[3];
  cublas_lt_layouts(g, l);
  cublasLtMatrixLayout_t *made[3] = {&p->la, &p->lb, &p->ld};
  if (s == CUBLAS_STATUS_SUCCESS) step = "cublasLtMatrixLayoutCreate";
  for (int i = 0; i < 3 && s == CUBLAS_STATUS_SUCCESS; i++)
    s = lt.layout_create(made[i], t, l[i].rows, l[i].cols, l[i].ld);
  cublasLtMatmulPreference_t pref = NULL;
  if (s == CUBLAS_STATUS_SUCCESS) {
    step = "cublasLtMatmulPreference";
    s = lt.pref_create(&pref);
  }
  uint64_t ws = MAX_WORKSPACE;
  uint32_t align[3] = {(uint32_t)k->align_a, (uint32_t)k->align_b, (uint32_t)k->align_d};
  const struct {
    cublasLtMatmulPreferenceAttributes_t attr;
    const void *value;
    size_t size;
  } prefs[] = {
      {CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0], sizeof align[0]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1], sizeof align[1]},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align[2], sizeof align[2]}, /* C is D */
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align[2], sizeof align[2]},
  };
  for (size_t i = 0; i < sizeof prefs / sizeof prefs[0] && s == CUBLAS_STATUS_SUCCESS; i++)
    s = lt.pref_set(pref, prefs[i].attr, prefs[i].value, prefs[i].size);
  cublasLtMatmulHeuristicResult_t best;
  int found = 0;
  if (s == CUBLAS_STATUS_SUCCESS) {
    step = "cublasLtMatmulAlgoGetHeuristic";
    s = lt.heuristic(h, p->desc, p->la, p->lb, p->ld, p->ld, pref, 1, &best, &found);
  }
  if (pref != NULL) lt.pref_destroy(pref);
  if (s == CUBLAS_STATUS_SUCCESS && (found < 1 || best.state != CUBLAS_STATUS_SUCCESS)) {
    step = "cublasLtMatmulAlgoGetHeuristic (no algorithm)";
    s = found < 1 ? CUBLAS_STATUS_NOT_SUPPORTED : best.state;
  }
  if (s != CUBLAS_STATUS_SUCCESS) {
    note_set(
        "cuBLASLt refused %s m=%lld n=%lld k=%lld%s%s (column-major; alignments %d/%d/%d) at %s: "
        "%s",
        dtype_name(g->dt), (long long)g->m, (long long)g->n, (long long)g->k,
        g->trans_a ? " A^T" : "", g->trans_b ? " B^T" : "", k->align_a, k->align_b, k->align_d,
        step, lt.status_name(s));
    plan_destroy(p);
    return;
  }
  p->algo = best.algo;
  p->workspace = best.workspaceSize;
  p->ok = true;
}

/* The plan of key (built on first use), or NULL when cuBLASLt cannot run it (note set). */
static plan_t *plan_get(const plan_key_t *key, cublasLtHandle_t h) {
  for (int i = 0; i < PLAN_SLOTS; i++)
    if (cache.plans[i].used && key_eq(&cache.plans[i].key, key))
      return cache.plans[i].ok ? &cache.plans[i] : NULL;
  plan_t *p = &cache.plans[cache.next_slot];
  cache.next_slot = (cache.next_slot + 1) % PLAN_SLOTS;
  if (p->used) plan_destroy(p); /* the oldest key makes room */
  memset(p, 0, sizeof *p);
  p->used = true;
  p->key = *key;
  plan_build(p, h);
  return p->ok ? p : NULL;
}

/* The handle of dev, created on first use, or NULL (note set; lock held). */
static cublasLtHandle_t handle_of(int dev) {
  pthread_once(&lt_once, lt_load);
  if (lt.error[0]) {
    note_set("%s", lt.error);
    return NULL;
  }
  if (cache.handle[dev] == NULL) {
    cublasStatus_t s = cudaSetDevice(dev) == cudaSuccess ? lt.create(&cache.handle[dev])
                                                         : CUBLAS_STATUS_NOT_INITIALIZED;
    if (s != CUBLAS_STATUS_SUCCESS) {
      (void)cudaGetLastError();
      cache.handle[dev] = NULL;
      note_set("cublasLtCreate on cuda:%d: %s", dev, lt.status_name(s));
    }
  }
  return cache.handle[dev];
}

fsdpc_status_t cublas_lt_matmul(const lt_gemm_t *g, float alpha, const void *a, const void *b,
                                float beta, void *d, bool *ran) {
  *ran = false;
  if (g->m == 0 || g->n == 0 || g->k == 0) return STATUS_OK; /* cublasGemmEx's to do */
  pthread_mutex_lock(&cache.path.lock);
  const char *off = fast_path_off_locked(&cache.path);
  if (off[0]) {
    note_set("cuBLASLt is turned off (%s)", off);
    pthread_mutex_unlock(&cache.path.lock);
    return STATUS_OK;
  }
  plan_key_t key = {
      .g = *g, .align_a = alignment(a), .align_b = alignment(b), .align_d = alignment(d)};
  key.g.stream = NULL;
  cublasLtHandle_t h = handle_of(g->dev);
  plan_t *p = h != NULL ? plan_get(&key, h) : NULL;
  if (p == NULL) {
    pthread_mutex_unlock(&cache.path.lock);
    return STATUS_OK;
  }
  device_t dev = device_cuda(g->dev);
  void *ws = NULL;
  size_t ws_bytes = p->workspace;
  fsdpc_status_t st = ws_bytes > 0 ? device_alloc(dev, ws_bytes, &ws) : STATUS_OK;
  if (st == STATUS_OK) {
    cublasStatus_t s = lt.matmul(h, p->desc, &alpha, a, p->la, b, p->lb, &beta, d, p->ld, d, p->ld,
                                 &p->algo, ws, ws_bytes, (cudaStream_t)g->stream);
    if (s == CUBLAS_STATUS_SUCCESS) {
      cache.path.runs++;
      *ran = true;
    } else {
      /* refused at launch: the key goes to cublasGemmEx from now on, and the note says why */
      (void)cudaGetLastError();
      note_set("cublasLtMatmul %s m=%lld n=%lld k=%lld: %s", dtype_name(g->dt), (long long)g->m,
               (long long)g->n, (long long)g->k, lt.status_name(s));
      plan_destroy(p);
    }
  }
  pthread_mutex_unlock(&cache.path.lock);
  if (ws != NULL) device_free(dev, ws, ws_bytes); /* stream-ordered: after the product */
  return st;
}

void kernel_matmul_set_lt(bool on) { fast_path_set(&cache.path, on); }

const char *kernel_matmul_lt_off(void) { return fast_path_off(&cache.path); }

int64_t kernel_matmul_lt_runs(void) { return fast_path_runs(&cache.path); }

const char *kernel_matmul_lt_note(void) {
  static __thread char copy[sizeof cache.path.note];
  fast_path_note_copy(&cache.path, copy, sizeof copy);
  return copy;
}
