/*
 * The fused-attention graphs, drawn with the backend descriptors of cudnn_graph.h, and the
 * loading of libcudnn.so.9 (see backends/cuda/cudnn_sdpa.h for what they compute and when they
 * run).
 *
 * Tensors are 4-D in cuDNN's (batch, head, row, column) order with the strides of our
 * token-major layouts: Q [B, H, T, Dh] with strides (T H Dh, Dh, H Dh, 1), K and V the same
 * over Hkv heads; K enters the first product transposed by strides alone. Scores, masks and
 * row statistics are virtual: they never reach memory. The graphs:
 *
 *   forward   S = Q K^T;  S = S scale;  S = row >= col ? S : lowest;
 *             m = max_j S;  E = exp(S - m);  l = sum_j E;  lse = m + log l;  P = E / l (dtype);
 *             O = P V
 *   backward  D = sum_c dO O (F32, to the workspace);
 *             P = exp(Q K^T scale - lse), masked;  dV = P^T dO;
 *             dS = (dO V^T - D) P scale;  dK = dS^T Q;  dQ = dS K (F32 in the workspace) -> dQ
 *   with grouped heads, dK and dV are products over all H query heads summed over each group.
 */
#include "backends/cuda/sdpa_graph.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* ---- the library, loaded on first use ---- */

cudnn_fns_t cudnn_fn;
static char load_error[256]; /* why the library cannot be used; "" when it can */
static pthread_once_t load_once_flag = PTHREAD_ONCE_INIT;

#define CUDNN_SONAME "libcudnn.so.9"

static void load_once(void) {
  void *lib = dlopen(CUDNN_SONAME, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(load_error, sizeof load_error, "cannot load %s: %s", CUDNN_SONAME, dlerror());
    return;
  }
  *(void **)&cudnn_fn.create = dlsym(lib, "cudnnCreate");
  *(void **)&cudnn_fn.set_stream = dlsym(lib, "cudnnSetStream");
  *(void **)&cudnn_fn.create_desc = dlsym(lib, "cudnnBackendCreateDescriptor");
  *(void **)&cudnn_fn.destroy_desc = dlsym(lib, "cudnnBackendDestroyDescriptor");
  *(void **)&cudnn_fn.set_attr = dlsym(lib, "cudnnBackendSetAttribute");
  *(void **)&cudnn_fn.get_attr = dlsym(lib, "cudnnBackendGetAttribute");
  *(void **)&cudnn_fn.finalize = dlsym(lib, "cudnnBackendFinalize");
  *(void **)&cudnn_fn.execute = dlsym(lib, "cudnnBackendExecute");
  *(void **)&cudnn_fn.status_string = dlsym(lib, "cudnnGetErrorString");
  *(void **)&cudnn_fn.last_error = dlsym(lib, "cudnnGetLastErrorString");
  *(void **)&cudnn_fn.version = dlsym(lib, "cudnnGetVersion");
  const cudnn_fns_t *f = &cudnn_fn;
  if (!f->create || !f->set_stream || !f->create_desc || !f->destroy_desc || !f->set_attr ||
      !f->get_attr || !f->finalize || !f->execute || !f->status_string || !f->last_error ||
      !f->version) {
    snprintf(load_error, sizeof load_error, "%s lacks part of the backend API", CUDNN_SONAME);
    return;
  }
  if (cudnn_fn.version() < 90000)
    snprintf(load_error, sizeof load_error, "%s is version %zu; 9.0 or later is needed",
             CUDNN_SONAME, cudnn_fn.version());
}

const char *cudnn_load(void) {
  pthread_once(&load_once_flag, load_once);
  return load_error;
}

/* ---- graph building: every call records the first failure and stops there ---- */

void gb_fail(gb_t *g, cudnnStatus_t st, const char *what) {
  if (g->st != CUDNN_STATUS_SUCCESS) return;
  g->st = st;
  snprintf(g->where, sizeof g->where, "%s", what);
}

cudnnBackendDescriptor_t gb_new(gb_t *g, cudnnBackendDescriptorType_t type, const char *what) {
  cudnnBackendDescriptor_t d = NULL;
  if (g->st != CUDNN_STATUS_SUCCESS) return NULL;
  if (g->ndesc == GB_MAX_DESC) {
    gb_fail(g, CUDNN_STATUS_INTERNAL_ERROR, "too many descriptors");
    return NULL;
  }
  cudnnStatus_t st = cudnn_fn.create_desc(type, &d);
  if (st != CUDNN_STATUS_SUCCESS) {
    gb_fail(g, st, what);
    return NULL;
  }
  g->desc[g->ndesc++] = d;
  return d;
}

void gb_set(gb_t *g, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
            cudnnBackendAttributeType_t type, int64_t n, const void *v, const char *what) {
  if (g->st != CUDNN_STATUS_SUCCESS) return;
  cudnnStatus_t st = cudnn_fn.set_attr(d, name, type, n, v);
  if (st != CUDNN_STATUS_SUCCESS) gb_fail(g, st, what);
}

void gb_link(gb_t *g, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
             cudnnBackendDescriptor_t v, const char *what) {
  gb_set(g, d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v, what);
}

void gb_finalize(gb_t *g, cudnnBackendDescriptor_t d, const char *what) {
  if (g->st != CUDNN_STATUS_SUCCESS) return;
  cudnnStatus_t st = cudnn_fn.finalize(d);
  if (st != CUDNN_STATUS_SUCCESS) gb_fail(g, st, what);
}

void gb_destroy(gb_t *g) {
  while (g->ndesc > 0) cudnn_fn.destroy_desc(g->desc[--g->ndesc]);
}

/* A tensor's dims and strides, in cuDNN's order. */
typedef struct shape4 {
  int64_t dim[4], str[4];
} shape4_t;

enum { kReal = 0, kVirtual = 1, kByValue = 2 };

/* A finalized tensor; uid 0 takes the graph's next free one (virtual tensors). */
static cudnnBackendDescriptor_t gb_tensor(gb_t *g, int64_t uid, cudnnDataType_t dt, shape4_t s,
                                          int kind, const char *what) {
  cudnnBackendDescriptor_t t = gb_new(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, what);
  int64_t id = uid != 0 ? uid : g->next_uid++, align = 16;
  bool is_virtual = kind == kVirtual, by_value = kind == kByValue;
  gb_set(g, t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &id, what);
  gb_set(g, t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt, what);
  gb_set(g, t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, s.dim, what);
  gb_set(g, t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, s.str, what);
  gb_set(g, t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, what);
  gb_set(g, t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, what);
  if (by_value) gb_set(g, t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, what);
  gb_finalize(g, t, what);
  return t;
}

static cudnnBackendDescriptor_t gb_virtual(gb_t *g, cudnnDataType_t dt, shape4_t s) {
  return gb_tensor(g, 0, dt, s, kVirtual, "virtual tensor");
}

static void gb_add_op(gb_t *g, cudnnBackendDescriptor_t op) {
  if (g->st != CUDNN_STATUS_SUCCESS) return;
  if (g->nops == GB_MAX_OPS) {
    gb_fail(g, CUDNN_STATUS_INTERNAL_ERROR, "too many operations");
    return;
  }
  g->ops[g->nops++] = op;
}

/* A finalized operation of type over the descriptors d[i] set as attributes name[i] (NULL
 * ones left out), appended to the graph's operations. */
static void gb_operation(gb_t *g, cudnnBackendDescriptorType_t type, int n,
                         const cudnnBackendAttributeName_t *name, const cudnnBackendDescriptor_t *d,
                         const char *what) {
  cudnnBackendDescriptor_t op = gb_new(g, type, what);
  for (int i = 0; i < n; i++)
    if (d[i] != NULL) gb_link(g, op, name[i], d[i], what);
  gb_finalize(g, op, what);
  gb_add_op(g, op);
}

/* y = mode(x[, b[, t]]), computed in prec; axis >= 0 for GEN_INDEX. */
static void gb_pointwise(gb_t *g, cudnnPointwiseMode_t mode, cudnnDataType_t prec, int64_t axis,
                         cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                         cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, const char *what) {
  cudnnBackendDescriptor_t pw = gb_new(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, what);
  gb_set(g, pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what);
  gb_set(g, pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec, what);
  if (axis >= 0) gb_set(g, pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what);
  gb_finalize(g, pw, what);
  const cudnnBackendAttributeName_t name[5] = {
      CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_ATTR_OPERATION_POINTWISE_XDESC,
      CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_ATTR_OPERATION_POINTWISE_TDESC,
      CUDNN_ATTR_OPERATION_POINTWISE_YDESC};
  const cudnnBackendDescriptor_t d[5] = {pw, x, b, t, y};
  gb_operation(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, 5, name, d, what);
}

/* c = a b over the last two dims (batch dims broadcast: Hkv heads against H), F32 compute. */
static void gb_matmul(gb_t *g, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                      cudnnBackendDescriptor_t c, const char *what) {
  cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  cudnnBackendDescriptor_t mm = gb_new(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, what);
  gb_set(g, mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, what);
  gb_finalize(g, mm, what);
  const cudnnBackendAttributeName_t name[4] = {
      CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_ATTR_OPERATION_MATMUL_BDESC,
      CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_ATTR_OPERATION_MATMUL_DESC};
  const cudnnBackendDescriptor_t d[4] = {a, b, c, mm};
  gb_operation(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, 4, name, d, what);
}

/* y = reduce(x) over the dims where y has extent 1 and x does not, or over the groups of x's
 * extent that y's divides. */
static void gb_reduce(gb_t *g, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x,
                      cudnnBackendDescriptor_t y, const char *what) {
  cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  cudnnBackendDescriptor_t red = gb_new(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, what);
  gb_set(g, red, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode, what);
  gb_set(g, red, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, what);
  gb_finalize(g, red, what);
  const cudnnBackendAttributeName_t name[3] = {CUDNN_ATTR_OPERATION_REDUCTION_XDESC,
                                               CUDNN_ATTR_OPERATION_REDUCTION_YDESC,
                                               CUDNN_ATTR_OPERATION_REDUCTION_DESC};
  const cudnnBackendDescriptor_t d[3] = {x, y, red};
  gb_operation(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, 3, name, d, what);
}

/* y = x seen with y's dims and strides (here: a transpose of the last two dims). */
static void gb_reshape(gb_t *g, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
                       const char *what) {
  const cudnnBackendAttributeName_t name[2] = {CUDNN_ATTR_OPERATION_RESHAPE_XDESC,
                                               CUDNN_ATTR_OPERATION_RESHAPE_YDESC};
  const cudnnBackendDescriptor_t d[2] = {x, y};
  gb_operation(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, 2, name, d, what);
}

/* mode(x[, b]) computed in F32 into a new virtual tensor of dtype dt and shape s. */
static cudnnBackendDescriptor_t gb_apply(gb_t *g, cudnnPointwiseMode_t mode,
                                         cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                                         cudnnDataType_t dt, shape4_t s, const char *what) {
  cudnnBackendDescriptor_t y = gb_virtual(g, dt, s);
  gb_pointwise(g, mode, CUDNN_DATA_FLOAT, -1, x, b, NULL, y, what);
  return y;
}

/* a b into a new virtual F32 tensor of shape s. */
static cudnnBackendDescriptor_t gb_product(gb_t *g, cudnnBackendDescriptor_t a,
                                           cudnnBackendDescriptor_t b, shape4_t s,
                                           const char *what) {
  cudnnBackendDescriptor_t c = gb_virtual(g, CUDNN_DATA_FLOAT, s);
  gb_matmul(g, a, b, c, what);
  return c;
}

/* reduce(x) into a new virtual F32 tensor of shape s. */
static cudnnBackendDescriptor_t gb_reduced(gb_t *g, cudnnReduceTensorOp_t mode,
                                           cudnnBackendDescriptor_t x, shape4_t s,
                                           const char *what) {
  cudnnBackendDescriptor_t y = gb_virtual(g, CUDNN_DATA_FLOAT, s);
  gb_reduce(g, mode, x, y, what);
  return y;
}

/* ---- the two graphs ---- */

typedef struct shapes {
  shape4_t heads;    /* Q, O, dO, dQ: [B, H, T, Dh] over [B, T, H, Dh] */
  shape4_t kv;       /* K, V, dK, dV: [B, Hkv, T, Dh] over [B, T, Hkv, Dh] */
  shape4_t kv_t;     /* K^T, V^T: [B, Hkv, Dh, T] */
  shape4_t scores;   /* [B, H, T, T] */
  shape4_t scores_t; /* the same, transposed */
  shape4_t rows;     /* lse and row sums: [B, H, T, 1] */
  shape4_t packed;   /* [B, H, T, Dh] packed */
  shape4_t scalar;
} shapes_t;

static shape4_t shape4(int64_t d0, int64_t d1, int64_t d2, int64_t d3, int64_t s0, int64_t s1,
                       int64_t s2, int64_t s3) {
  shape4_t s = {{d0, d1, d2, d3}, {s0, s1, s2, s3}};
  return s;
}

static shapes_t shapes_of(const attn_shape_t *a) {
  int64_t B = a->B, T = a->T, H = a->H, G = a->Hkv, D = a->Dh;
  shapes_t s;
  s.heads = shape4(B, H, T, D, T * H * D, D, H * D, 1);
  s.kv = shape4(B, G, T, D, T * G * D, D, G * D, 1);
  s.kv_t = shape4(B, G, D, T, T * G * D, D, 1, G * D);
  s.scores = shape4(B, H, T, T, H * T * T, T * T, T, 1);
  s.scores_t = shape4(B, H, T, T, H * T * T, T * T, 1, T);
  s.rows = shape4(B, H, T, 1, H * T, T, 1, 1);
  s.packed = shape4(B, H, T, D, H * T * D, T * D, D, 1);
  s.scalar = shape4(1, 1, 1, 1, 1, 1, 1, 1);
  return s;
}

/* The causal mask on the scores x: y = row >= col ? x : lowest. */
static cudnnBackendDescriptor_t gb_causal(gb_t *g, const shapes_t *s, cudnnBackendDescriptor_t x,
                                          cudnnBackendDescriptor_t lowest) {
  cudnnBackendDescriptor_t row = gb_virtual(g, CUDNN_DATA_INT32, s->scores);
  cudnnBackendDescriptor_t col = gb_virtual(g, CUDNN_DATA_INT32, s->scores);
  cudnnBackendDescriptor_t keep = gb_virtual(g, CUDNN_DATA_BOOLEAN, s->scores);
  cudnnBackendDescriptor_t y = gb_virtual(g, CUDNN_DATA_FLOAT, s->scores);
  gb_pointwise(g, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, 2, x, NULL, NULL, row, "row index");
  gb_pointwise(g, CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, 3, x, NULL, NULL, col,
               "column index");
  gb_pointwise(g, CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, -1, row, col, NULL, keep,
               "causal comparison");
  gb_pointwise(g, CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, -1, x, lowest, keep, y,
               "causal select");
  return y;
}

static void graph_forward(gb_t *g, const attn_shape_t *a, cudnnDataType_t io) {
  shapes_t s = shapes_of(a);
  cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  cudnnBackendDescriptor_t q = gb_tensor(g, UID_Q, io, s.heads, kReal, "tensor q");
  cudnnBackendDescriptor_t kt = gb_tensor(g, UID_K, io, s.kv_t, kReal, "tensor k");
  cudnnBackendDescriptor_t v = gb_tensor(g, UID_V, io, s.kv, kReal, "tensor v");
  cudnnBackendDescriptor_t o = gb_tensor(g, UID_O, io, s.heads, kReal, "tensor out");
  cudnnBackendDescriptor_t lse = gb_tensor(g, UID_LSE, f32, s.rows, kReal, "tensor lse");
  cudnnBackendDescriptor_t scale = gb_tensor(g, UID_SCALE, f32, s.scalar, kByValue, "scale");
  cudnnBackendDescriptor_t lowest = gb_tensor(g, UID_LOWEST, f32, s.scalar, kByValue, "lowest");

  cudnnBackendDescriptor_t sc = gb_product(g, q, kt, s.scores, "Q K^T");
  cudnnBackendDescriptor_t scaled =
      gb_apply(g, CUDNN_POINTWISE_MUL, sc, scale, f32, s.scores, "scale");
  cudnnBackendDescriptor_t masked = gb_causal(g, &s, scaled, lowest);
  cudnnBackendDescriptor_t mx = gb_reduced(g, CUDNN_REDUCE_TENSOR_MAX, masked, s.rows, "row max");
  cudnnBackendDescriptor_t centered =
      gb_apply(g, CUDNN_POINTWISE_SUB, masked, mx, f32, s.scores, "minus max");
  cudnnBackendDescriptor_t e =
      gb_apply(g, CUDNN_POINTWISE_EXP, centered, NULL, f32, s.scores, "exp");
  cudnnBackendDescriptor_t sum = gb_reduced(g, CUDNN_REDUCE_TENSOR_ADD, e, s.rows, "row sum");
  cudnnBackendDescriptor_t logsum = gb_apply(g, CUDNN_POINTWISE_LOG, sum, NULL, f32, s.rows, "log");
  gb_pointwise(g, CUDNN_POINTWISE_ADD, f32, -1, mx, logsum, NULL, lse, "lse");
  cudnnBackendDescriptor_t p =
      gb_apply(g, CUDNN_POINTWISE_DIV, e, sum, io, s.scores, "probabilities");
  gb_matmul(g, p, v, o, "P V");
}

/* out = a b, and with grouped heads the products of every query head summed over each group. */
static void gb_matmul_grouped(gb_t *g, const attn_shape_t *a, const shapes_t *s, cudnnDataType_t io,
                              cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
                              cudnnBackendDescriptor_t out, const char *what) {
  if (a->H == a->Hkv) {
    gb_matmul(g, x, y, out, what);
    return;
  }
  cudnnBackendDescriptor_t full = gb_virtual(g, io, s->packed);
  gb_matmul(g, x, y, full, what);
  gb_reduce(g, CUDNN_REDUCE_TENSOR_ADD, full, out, "sum over a group's heads");
}

static void graph_backward(gb_t *g, const attn_shape_t *a, cudnnDataType_t io) {
  shapes_t s = shapes_of(a);
  cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  cudnnBackendDescriptor_t q = gb_tensor(g, UID_Q, io, s.heads, kReal, "tensor q");
  cudnnBackendDescriptor_t kt = gb_tensor(g, UID_K, io, s.kv_t, kReal, "tensor k");
  cudnnBackendDescriptor_t vt = gb_tensor(g, UID_V, io, s.kv_t, kReal, "tensor v");
  cudnnBackendDescriptor_t o = gb_tensor(g, UID_O, io, s.heads, kReal, "tensor out");
  cudnnBackendDescriptor_t dout = gb_tensor(g, UID_DO, io, s.heads, kReal, "tensor dout");
  cudnnBackendDescriptor_t lse = gb_tensor(g, UID_LSE, f32, s.rows, kReal, "tensor lse");
  cudnnBackendDescriptor_t dq = gb_tensor(g, UID_DQ, io, s.heads, kReal, "tensor dq");
  cudnnBackendDescriptor_t dk = gb_tensor(g, UID_DK, io, s.kv, kReal, "tensor dk");
  cudnnBackendDescriptor_t dv = gb_tensor(g, UID_DV, io, s.kv, kReal, "tensor dv");
  cudnnBackendDescriptor_t rowdot = gb_tensor(g, UID_ROWDOT, f32, s.rows, kReal, "row dots");
  cudnnBackendDescriptor_t dqacc = gb_tensor(g, UID_DQACC, f32, s.packed, kReal, "dq (f32)");
  cudnnBackendDescriptor_t scale = gb_tensor(g, UID_SCALE, f32, s.scalar, kByValue, "scale");
  cudnnBackendDescriptor_t one = gb_tensor(g, UID_ONE, f32, s.scalar, kByValue, "one");
  cudnnBackendDescriptor_t lowest = gb_tensor(g, UID_LOWEST, f32, s.scalar, kByValue, "lowest");

  /* D = rowsum(dO O); the virtual product takes the strides cuDNN's own frontend gives it */
  shape4_t prod = s.heads;
  prod.str[0] = a->H * a->T * a->Dh;
  prod.str[1] = a->T * a->Dh;
  cudnnBackendDescriptor_t dOO = gb_apply(g, CUDNN_POINTWISE_MUL, dout, o, f32, prod, "dO O");
  cudnnBackendDescriptor_t dsum =
      gb_reduced(g, CUDNN_REDUCE_TENSOR_ADD, dOO, s.rows, "rowsum dO O");
  gb_pointwise(g, CUDNN_POINTWISE_MUL, f32, -1, dsum, one, NULL, rowdot, "row dots");

  /* P = exp(scale Q K^T - lse), masked */
  cudnnBackendDescriptor_t sc = gb_product(g, q, kt, s.scores, "Q K^T");
  cudnnBackendDescriptor_t scaled =
      gb_apply(g, CUDNN_POINTWISE_MUL, sc, scale, f32, s.scores, "scale");
  cudnnBackendDescriptor_t centered =
      gb_apply(g, CUDNN_POINTWISE_SUB, scaled, lse, f32, s.scores, "minus lse");
  cudnnBackendDescriptor_t masked = gb_causal(g, &s, centered, lowest);
  cudnnBackendDescriptor_t p = gb_apply(g, CUDNN_POINTWISE_EXP, masked, NULL, f32, s.scores, "exp");

  /* dV = P^T dO */
  cudnnBackendDescriptor_t pt = gb_virtual(g, io, s.scores_t);
  gb_reshape(g, p, pt, "P^T");
  gb_matmul_grouped(g, a, &s, io, pt, dout, dv, "P^T dO");

  /* dS = (dO V^T - D) P scale */
  cudnnBackendDescriptor_t dp = gb_product(g, dout, vt, s.scores, "dO V^T");
  cudnnBackendDescriptor_t dp1 = gb_apply(g, CUDNN_POINTWISE_MUL, dp, one, f32, s.scores, "dP");
  cudnnBackendDescriptor_t dp2 =
      gb_apply(g, CUDNN_POINTWISE_SUB, dp1, rowdot, f32, s.scores, "dP - D");
  cudnnBackendDescriptor_t ds0 =
      gb_apply(g, CUDNN_POINTWISE_MUL, dp2, p, f32, s.scores, "(dP - D) P");
  cudnnBackendDescriptor_t ds =
      gb_apply(g, CUDNN_POINTWISE_MUL, ds0, scale, f32, s.scores, "dS scale");

  /* dK = dS^T Q */
  cudnnBackendDescriptor_t dst = gb_virtual(g, io, s.scores_t);
  gb_reshape(g, ds, dst, "dS^T");
  gb_matmul_grouped(g, a, &s, io, dst, q, dk, "dS^T Q");

  /* dQ = dS K, in F32 then cast */
  cudnnBackendDescriptor_t k = gb_virtual(g, io, s.kv);
  gb_reshape(g, kt, k, "K");
  gb_matmul(g, ds, k, dqacc, "dS K");
  gb_pointwise(g, CUDNN_POINTWISE_IDENTITY, f32, -1, dqacc, NULL, NULL, dq, "dQ cast");
}

void sdpa_graph_draw(gb_t *g, const attn_shape_t *a, dtype_t dt, bool backward) {
  memset(g, 0, sizeof *g);
  g->next_uid = UID_FIRST_VIRTUAL;
  cudnnDataType_t io = dt == DTYPE_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  if (backward)
    graph_backward(g, a, io);
  else
    graph_forward(g, a, io);
}
