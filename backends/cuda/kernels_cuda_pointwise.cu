/*
 * CUDA twin of the element-wise kernels (kernels_cpu_pointwise.c): SiLU*mul, activations, bias,
 * add, axpy, scale as typed maps in 16-byte packs; AdamW and the sums of squares of many tensors
 * in one launch. Kernels first, then launchers.
 */
#include "backends/cuda/kernels_cuda.h"

/* ======================= kernels ======================= */

/* ---- element-wise maps ---- */

template <int NI, int NO>
struct map_ptrs {
  const void *in[NI];
  void *out[NO];
};

/*
 * NI inputs and NO outputs of one storage type T, element by element: op.apply<T>(x, y) reads
 * x[0, NI) and writes y[0, NO) for one element, in f32. The first nvec * W elements (W = 16 /
 * sizeof(T)) go W at a time, each operand in one 16-byte load or store (the launcher sets nvec
 * to 0 unless every pointer is 16-byte aligned); the rest one at a time. An output may alias
 * an input: each element is read, then written, by one thread.
 */
template <typename T, int NI, int NO, typename Op>
__global__ static void map_kernel(map_ptrs<NI, NO> p, int64_t n, int64_t nvec, Op op) {
  const int W = 16 / sizeof(T);
  GRID_STRIDE(v, nvec) {
    pack<T> in[NI], o[NO];
#pragma unroll
    for (int i = 0; i < NI; i++) in[i] = ((const pack<T> *)p.in[i])[v];
#pragma unroll
    for (int j = 0; j < W; j++) {
      float x[NI], y[NO];
#pragma unroll
      for (int i = 0; i < NI; i++) x[i] = tof(in[i].v[j]);
      op.template apply<T>(x, y);
#pragma unroll
      for (int k = 0; k < NO; k++) o[k].v[j] = fromf<T>(y[k]);
    }
#pragma unroll
    for (int k = 0; k < NO; k++) ((pack<T> *)p.out[k])[v] = o[k];
  }
  GRID_STRIDE(r, n - nvec * W) {
    int64_t e = nvec * W + r;
    float x[NI], y[NO];
#pragma unroll
    for (int i = 0; i < NI; i++) x[i] = tof(((const T *)p.in[i])[e]);
    op.template apply<T>(x, y);
#pragma unroll
    for (int k = 0; k < NO; k++) ((T *)p.out[k])[e] = fromf<T>(y[k]);
  }
}

/* out = a + b */
struct op_add {
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    y[0] = x[0] + x[1];
  }
};

/* x = alpha x */
struct op_scale {
  float alpha;
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    y[0] = alpha * x[0];
  }
};

/* y = y + alpha x (inputs y, x) */
struct op_axpy {
  float alpha;
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    y[0] = x[0] + alpha * x[1];
  }
};

/* out = silu(gate) * up, silu's value rounded to T first (inputs gate, up) */
struct op_silu_mul {
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    float g = x[0], sg = 1.0f / (1.0f + expf(-g));
    y[0] = round_to<T>(g * sg) * x[1];
  }
};

/* dgate, dup from dout, gate, up */
struct op_silu_mul_backward {
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    float dy = x[0], g = x[1], u = x[2], s = 1.0f / (1.0f + expf(-g));
    y[1] = dy * (g * s);
    y[0] = dy * u * (s * (1.0f + g * (1.0f - s)));
  }
};

/* GELU's tanh form: the tanh (PyTorch's constants). */
__device__ static float gelu_tanh_t(float x) {
  return tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
}

__device__ static float act_value(int act, float x) {
  switch (act) {
    case KERNEL_ACT_RELU: return x > 0.0f ? x : 0.0f;
    case KERNEL_ACT_GELU: return 0.5f * x * (1.0f + erff(x * (float)M_SQRT1_2));
    case KERNEL_ACT_GELU_TANH: return 0.5f * x * (1.0f + gelu_tanh_t(x));
    case KERNEL_ACT_SIGMOID: return 1.0f / (1.0f + expf(-x));
    default: return x / (1.0f + expf(-x));
  }
}

__device__ static float act_derivative(int act, float x) {
  switch (act) {
    case KERNEL_ACT_RELU: return x > 0.0f ? 1.0f : 0.0f;
    case KERNEL_ACT_GELU: /* Phi(x) + x * phi(x) */
      return 0.5f * (1.0f + erff(x * (float)M_SQRT1_2)) +
             x * (float)(0.5 * M_2_SQRTPI * M_SQRT1_2) * expf(-0.5f * x * x);
    case KERNEL_ACT_GELU_TANH: { /* (1 + t) / 2 + x / 2 (1 - t^2) u'(x) */
      float t = gelu_tanh_t(x);
      return 0.5f * (1.0f + t) +
             0.5f * x * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
    }
    case KERNEL_ACT_SIGMOID: {
      float s = 1.0f / (1.0f + expf(-x));
      return s * (1.0f - s);
    }
    default: {
      float s = 1.0f / (1.0f + expf(-x));
      return s * (1.0f + x * (1.0f - s));
    }
  }
}

/* out = act(x) */
struct op_activation {
  int act;
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    y[0] = act_value(act, x[0]);
  }
};

/* dx = dy act'(x) (inputs dy, x) */
struct op_activation_backward {
  int act;
  template <typename T>
  __device__ void apply(const float *x, float *y) const {
    y[0] = x[0] * act_derivative(act, x[1]);
  }
};

__global__ static void bias_add_kernel(void *out, const void *x, const void *b, int dt, int64_t n,
                                       int64_t D) {
  GRID_STRIDE(i, n) stf(dt, out, i, ldf(dt, x, i) + ldf(dt, b, i % D));
}

/* The same, W = 16 / sizeof(T) elements a thread in 16-byte loads and stores, for rows whose
 * width is a multiple of W and operands on 16-byte boundaries: packs of a row never straddle
 * two. I (32-bit where it fits) keeps the division by the width cheap. (The element-wise kernel
 * above ran at 1.3 TB/s on an H200.) */
template <typename T, typename I>
__global__ static void bias_add_vec_kernel(T *out, const T *x, const T *b, I packs, I row_packs) {
  const int W = 16 / sizeof(T);
  for (I v = blockIdx.x * (I)blockDim.x + threadIdx.x; v < packs; v += (I)gridDim.x * blockDim.x) {
    pack<T> px = ((const pack<T> *)x)[v], pb = ((const pack<T> *)b)[v % row_packs], o;
#pragma unroll
    for (int j = 0; j < W; j++) o.v[j] = fromf<T>(tof(px.v[j]) + tof(pb.v[j]));
    ((pack<T> *)out)[v] = o;
  }
}

/* the bias gradient's term of row i, column j: dy */
template <typename T>
struct bias_term {
  const T *dy;
  int64_t D;
  __device__ void operator()(int64_t i, int64_t j, float *s) const { s[0] += tof(dy[i * D + j]); }
  /* columns [c W, c W + W) of row i, W = 16 / sizeof(T) (rows on 16-byte boundaries) */
  __device__ void packs(int64_t i, int64_t c, float (*s)[16 / sizeof(T)]) const {
    pack<T> g = ((const pack<T> *)(dy + i * D))[c];
#pragma unroll
    for (int j = 0; j < (int)(16 / sizeof(T)); j++) s[0][j] += tof(g.v[j]);
  }
};

/* y += alpha x where x is narrower than y (the same dtypes take op_axpy's map) */
__global__ static void axpy_kernel(void *y, int ydt, float alpha, const void *x, int xdt,
                                   int64_t n) {
  GRID_STRIDE(e, n) stf(ydt, y, e, ldf(ydt, y, e) + alpha * ldf(xdt, x, e));
}

struct adamw_consts {
  float decay, one_minus_b1, b2, one_minus_b2, step_size, bc2_sqrt, eps, grad_scale;
};

/* Many parameters' AdamW in one launch (the table is the kernel's argument: no copy to the
 * device). Entry i has blocks [first_block, next entry's first_block); each block strides
 * over its entry's elements. The arithmetic is kernel_adamw's, element by element. */
enum { kAdamwTable = 36 }; /* entries per launch: the table stays under 4 KB of arguments */

struct adamw_entry {
  void *p;
  const void *g;
  void *m, *v; /* f32, or bf16 (optim.state_dtype) */
  int64_t n, first_block;
  int pdt, gdt, mdt;
  adamw_consts c;
};

typedef entry_table<adamw_entry, kAdamwTable> adamw_table;

/* One element's AdamW: p, m and v updated from g (both paths of adamw_many_kernel). */
__device__ static inline void adamw_elem(const adamw_consts &a, float &p, float g, float &m,
                                         float &v) {
  float pi = p * a.decay, gi = __fmul_rn(g, a.grad_scale);
  m += a.one_minus_b1 * (gi - m);
  v = v * a.b2 + a.one_minus_b2 * gi * gi;
  float denom = sqrtf(v) / a.bc2_sqrt + a.eps;
  p = pi + (-a.step_size * m) / denom;
}

/* All four operands f32 on 16-byte boundaries: four elements a thread in 16-byte loads and
 * stores (element by element with a dtype switch each ran at 2.97 TB/s on an H200, llama-0.9b's
 * step), then the tail element-wise. */
__device__ static void adamw_f32_packs(const adamw_entry &x, int64_t k, int64_t stride) {
  typedef pack<float> P;
  int64_t packs = x.n / 4;
  P *p = (P *)x.p, *m = (P *)x.m, *v = (P *)x.v;
  const P *g = (const P *)x.g;
  for (int64_t i = k; i < packs; i += stride) {
    P pi = p[i], gi = g[i], mi = m[i], vi = v[i];
#pragma unroll
    for (int j = 0; j < 4; j++) adamw_elem(x.c, pi.v[j], gi.v[j], mi.v[j], vi.v[j]);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
  for (int64_t e = packs * 4 + k; e < x.n; e += stride) {
    float pe = ((float *)x.p)[e], me = ((float *)x.m)[e], ve = ((float *)x.v)[e];
    adamw_elem(x.c, pe, ((const float *)x.g)[e], me, ve);
    ((float *)x.p)[e] = pe;
    ((float *)x.m)[e] = me;
    ((float *)x.v)[e] = ve;
  }
}

__global__ static void adamw_many_kernel(adamw_table t) {
  int64_t b, nb;
  const adamw_entry &x = t.e[table_entry(t, &b, &nb)];
  int64_t k = b * blockDim.x + threadIdx.x, stride = nb * blockDim.x;
  if (x.pdt == DTYPE_F32 && x.gdt == DTYPE_F32 && x.mdt == DTYPE_F32 &&
      ((uintptr_t)x.p | (uintptr_t)x.g | (uintptr_t)x.m | (uintptr_t)x.v) % 16 == 0) {
    adamw_f32_packs(x, k, stride);
    return;
  }
  for (int64_t e = k; e < x.n; e += stride) {
    float p = ldf(x.pdt, x.p, e), m = ldf(x.mdt, x.m, e), v = ldf(x.mdt, x.v, e);
    adamw_elem(x.c, p, ldf(x.gdt, x.g, e), m, v);
    stf(x.mdt, x.m, e, m); /* bf16 moments rounded when stored; the update uses them unrounded */
    stf(x.mdt, x.v, e, v);
    stf(x.pdt, x.p, e, p);
  }
}

/* Sums of squares without atomics: block b of a tensor's nb blocks (at most kSsqBlocks)
 * strides over its elements nb blocks apart and writes its float partial to the tensor's
 * partial[b]; then a warp per tensor adds its kSsqBlocks partials in double in a fixed order.
 * Many tensors' blocks go in one launch, each block finding its tensor in the table (its
 * argument, as adamw_many_kernel's); a tensor's partials are the same whatever else the launch
 * holds. */
static const int kSsqBlocks = 1024;
/* Elements a thread reads at least before its tensor takes another block: a block then reads
 * 128 KB of f32 (64 KB of bf16) or more, against its fixed costs (its start, finding its tensor,
 * its reduction). At one block per 256 elements llama-100m's gradient norm launched about 82,000
 * blocks of one to three elements a thread and ran at 803 GB/s on an H200; at 16 elements a
 * thread, llama-0.9b's ran at 1.03 TB/s (about 100,000 blocks of 16-45 KB). */
static const int64_t kSsqPerThread = 128;
enum { kSsqTable = 120 }; /* tensors per launch: the table stays under 4 KB of arguments */

struct ssq_entry {
  const void *x;
  int64_t n;
  int first_block, dt;
  float *partial; /* its kSsqBlocks partials */
};

typedef entry_table<ssq_entry, kSsqTable> ssq_table;

/* The squares of x's elements [0, n) in 16-byte packs of T (x on a 16-byte boundary), then its
 * tail, striding as the element-wise loop does: thread k of the grid's `stride` threads. Four
 * packs are loaded before any is added, so that each thread keeps 64 bytes in flight. */
template <typename T>
__device__ static float ssq_packs(const T *x, int64_t n, int64_t k, int64_t stride) {
  const int W = 16 / sizeof(T), U = 4;
  int64_t packs = n / W, v = k;
  float s = 0;
  for (; v + (U - 1) * stride < packs; v += U * stride) {
    pack<T> p[U];
#pragma unroll
    for (int u = 0; u < U; u++) p[u] = ((const pack<T> *)x)[v + u * stride];
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int j = 0; j < W; j++) s += tof(p[u].v[j]) * tof(p[u].v[j]);
  }
  for (; v < packs; v += stride) {
    pack<T> p = ((const pack<T> *)x)[v];
#pragma unroll
    for (int j = 0; j < W; j++) s += tof(p.v[j]) * tof(p.v[j]);
  }
  for (int64_t e = packs * W + k; e < n; e += stride) s += tof(x[e]) * tof(x[e]);
  return s;
}

__global__ static void sum_squares_many_kernel(ssq_table t) {
  int64_t b, nb;
  const ssq_entry &x = t.e[table_entry(t, &b, &nb)];
  float s = 0;
  int64_t k = b * blockDim.x + threadIdx.x, stride = nb * blockDim.x;
  /* 16-byte loads where the tensor starts on a boundary (1.79 TB/s element by element on an
   * H200, llama-0.9b's gradient norm) */
  if ((uintptr_t)x.x % 16 == 0 && x.dt == DTYPE_F32)
    s = ssq_packs((const float *)x.x, x.n, k, stride);
  else if ((uintptr_t)x.x % 16 == 0 && x.dt == DTYPE_BF16)
    s = ssq_packs((const __nv_bfloat16 *)x.x, x.n, k, stride);
  else if ((uintptr_t)x.x % 16 == 0 && x.dt == DTYPE_F16)
    s = ssq_packs((const __half *)x.x, x.n, k, stride);
  else
#pragma unroll 4
    for (int64_t e = k; e < x.n; e += stride) {
      float v = ldf(x.dt, x.x, e);
      s += v * v;
    }
  s = block_reduce<false>(s);
  if (threadIdx.x == 0) x.partial[b] = s;
}

/* out[t] = the sum of tensor t's kSsqBlocks partials, a warp per tensor: lane l adds partials
 * l, l + 32, ... in order, then the lanes' sums are halved together (the same order at every
 * run). A thread per tensor adding its 1024 partials one after another took them one L2
 * round trip at a time. */
__global__ static void sum_squares_total_kernel(double *out, const float *partial, int n) {
  int lane = threadIdx.x % 32; /* blockDim.x is a multiple of 32: a warp's lanes loop together */
  int64_t warps = (int64_t)gridDim.x * blockDim.x / 32;
  for (int64_t t = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32; t < n; t += warps) {
    const float *p = partial + t * kSsqBlocks;
    double s = 0;
    for (int b = lane; b < kSsqBlocks; b += 32) s += p[b];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) out[t] = s;
  }
}

/* ======================= launchers ======================= */

/* Runs op over the n = numel(like) elements of the operands in and out, all of like's dtype, on
 * like's device and stream. */
template <int NI, int NO, typename Op>
static fsdpc_status_t map_launch(const fsdpc_tensor_t *like, const void *const (&in)[NI],
                                 void *const (&out)[NO], Op op, const char *what) {
  int64_t n = tensor_numel(like);
  if (n == 0) return STATUS_OK;
  map_ptrs<NI, NO> p;
  uintptr_t bits = 0;
  for (int i = 0; i < NI; i++) bits |= (uintptr_t)(p.in[i] = in[i]);
  for (int k = 0; k < NO; k++) bits |= (uintptr_t)(p.out[k] = out[k]);
  int64_t W = 16 / (int64_t)dtype_size(like->dtype), nvec = bits % 16 == 0 ? n / W : 0;
  int grid = grid_for(nvec > n - nvec * W ? nvec : n - nvec * W);
  cudaStream_t s = stream_of(like);
  with_float_type(like->dtype,
                  [&](auto t) { map_kernel<decltype(t)><<<grid, kBlock, 0, s>>>(p, n, nvec, op); });
  return launched(what);
}

static fsdpc_status_t cuda_silu_mul(fsdpc_tensor_t *out, const fsdpc_tensor_t *gate,
                                    const fsdpc_tensor_t *up) {
  const void *const in[2] = {gate->data, up->data};
  void *const o[1] = {out->data};
  return map_launch(out, in, o, op_silu_mul{}, "kernel_silu_mul");
}

static fsdpc_status_t cuda_silu_mul_backward(fsdpc_tensor_t *dgate, fsdpc_tensor_t *dup,
                                             const fsdpc_tensor_t *dout, const fsdpc_tensor_t *gate,
                                             const fsdpc_tensor_t *up) {
  const void *const in[3] = {dout->data, gate->data, up->data};
  void *const o[2] = {dgate->data, dup->data};
  return map_launch(dout, in, o, op_silu_mul_backward{}, "kernel_silu_mul_backward");
}

static fsdpc_status_t cuda_activation(fsdpc_tensor_t *out, const fsdpc_tensor_t *x,
                                      kernel_act_t act) {
  const void *const in[1] = {x->data};
  void *const o[1] = {out->data};
  return map_launch(out, in, o, op_activation{(int)act}, "kernel_activation");
}

static fsdpc_status_t cuda_activation_backward(fsdpc_tensor_t *dx, const fsdpc_tensor_t *dy,
                                               const fsdpc_tensor_t *x, kernel_act_t act) {
  const void *const in[2] = {dy->data, x->data};
  void *const o[1] = {dx->data};
  return map_launch(dx, in, o, op_activation_backward{(int)act}, "kernel_activation_backward");
}

static fsdpc_status_t cuda_bias_add(fsdpc_tensor_t *out, const fsdpc_tensor_t *x,
                                    const fsdpc_tensor_t *b) {
  int64_t n = tensor_numel(out), D = last_dim(x), W = 16 / (int64_t)dtype_size(out->dtype);
  bool vec =
      D % W == 0 && ((uintptr_t)out->data | (uintptr_t)x->data | (uintptr_t)b->data) % 16 == 0;
  if (vec) {
    int64_t packs = n / W;
    with_float_type(out->dtype, [&](auto t) {
      using T = decltype(t);
      /* 32-bit indices where the last stride stays below 2^31 too */
      if (packs <= INT32_MAX - (int64_t)grid_for(packs) * kBlock)
        bias_add_vec_kernel<T, int32_t><<<grid_for(packs), kBlock, 0, stream_of(out)>>>(
            (T *)out->data, (const T *)x->data, (const T *)b->data, (int32_t)packs,
            (int32_t)(D / W));
      else
        bias_add_vec_kernel<T, int64_t><<<grid_for(packs), kBlock, 0, stream_of(out)>>>(
            (T *)out->data, (const T *)x->data, (const T *)b->data, packs, D / W);
    });
    return launched("kernel_bias_add");
  }
  bias_add_kernel<<<grid_for(n), kBlock, 0, stream_of(out)>>>(out->data, x->data, b->data,
                                                              out->dtype, n, last_dim(x));
  return launched("kernel_bias_add");
}

static fsdpc_status_t cuda_bias_backward(fsdpc_tensor_t *db, const fsdpc_tensor_t *dy) {
  int64_t D = last_dim(dy), rows = tensor_numel(dy) / D;
  fsdpc_status_t st = STATUS_OK;
  with_float_type(dy->dtype, [&](auto t) {
    using T = decltype(t);
    st = column_sums_packs<1, T>(dy->device, stream_of(dy), rows, D, (uintptr_t)dy->data % 16 == 0,
                                 bias_term<T>{(const T *)dy->data, D},
                                 column_outs<1>{{{db->data, db->dtype}}}, "kernel_bias_backward");
  });
  return st;
}

static fsdpc_status_t cuda_add(fsdpc_tensor_t *out, const fsdpc_tensor_t *a,
                               const fsdpc_tensor_t *b) {
  const void *const in[2] = {a->data, b->data};
  void *const o[1] = {out->data};
  return map_launch(out, in, o, op_add{}, "kernel_add");
}

static fsdpc_status_t cuda_axpy(fsdpc_tensor_t *y, float alpha, const fsdpc_tensor_t *x) {
  int64_t n = tensor_numel(y);
  if (n == 0) return STATUS_OK;
  if (y->dtype == x->dtype) {
    const void *const in[2] = {y->data, x->data};
    void *const o[1] = {y->data};
    return map_launch(y, in, o, op_axpy{alpha}, "kernel_axpy");
  }
  axpy_kernel<<<grid_for(n), kBlock, 0, stream_of(y)>>>(y->data, y->dtype, alpha, x->data, x->dtype,
                                                        n);
  return launched("kernel_axpy");
}

static fsdpc_status_t cuda_scale(fsdpc_tensor_t *x, float alpha) {
  const void *const in[1] = {x->data};
  void *const o[1] = {x->data};
  return map_launch(x, in, o, op_scale{alpha}, "kernel_scale");
}

static adamw_consts adamw_consts_of(const adamw_args_t *a) {
  double bc1 = 1.0 - pow(a->beta1, (double)a->step), bc2 = 1.0 - pow(a->beta2, (double)a->step);
  adamw_consts c = {(float)(1.0 - a->lr * a->weight_decay),
                    (float)(1.0 - a->beta1),
                    (float)a->beta2,
                    (float)(1.0 - a->beta2),
                    (float)(a->lr / bc1),
                    (float)sqrt(bc2),
                    (float)a->eps,
                    a->grad_scale != 0 ? a->grad_scale : 1.0f};
  return c;
}

static fsdpc_status_t cuda_adamw_many(const adamw_item_t *items, int n) {
  cudaStream_t s = stream_of(items[0].p);
  for (int i0 = 0; i0 < n;) {
    adamw_table t;
    t.count = 0;
    int64_t blocks = 0;
    for (; i0 < n && t.count < kAdamwTable; i0++) {
      const adamw_item_t *it = &items[i0];
      int64_t numel = tensor_numel(it->p);
      if (numel == 0) continue;
      adamw_entry &e = t.e[t.count++];
      e.p = it->p->data;
      e.g = it->g->data;
      e.m = it->m->data;
      e.v = it->v->data;
      e.mdt = it->m->dtype;
      e.n = numel;
      e.first_block = blocks;
      e.pdt = it->p->dtype;
      e.gdt = it->g->dtype;
      e.c = adamw_consts_of(&it->args);
      int64_t nb = (numel + kBlock - 1) / kBlock;
      blocks += nb < 1024 ? nb : 1024;
    }
    if (t.count == 0) break;
    adamw_many_kernel<<<(unsigned)blocks, kBlock, 0, s>>>(t);
    FSDPC_TRY(launched("kernel_adamw"));
  }
  return STATUS_OK;
}

static fsdpc_status_t cuda_adamw(fsdpc_tensor_t *p, const fsdpc_tensor_t *g, fsdpc_tensor_t *m,
                                 fsdpc_tensor_t *v, const adamw_args_t *a) {
  adamw_item_t it = {p, g, m, v, *a};
  return cuda_adamw_many(&it, 1);
}

static fsdpc_status_t cuda_sum_squares_many(const fsdpc_tensor_t *const *xs, int n, double *out) {
  device_t dev = xs[0]->device;
  cudaStream_t s = stream_of(xs[0]);
  size_t pbytes = sizeof(float) * (size_t)n * kSsqBlocks, bytes = pbytes + sizeof(double) * n;
  char *buf;
  FSDPC_TRY(device_alloc(dev, bytes, (void **)&buf));
  float *partial = (float *)buf;
  double *sums = (double *)(buf + pbytes); /* pbytes is a multiple of 4 KiB */
  /* unused partials stay zero (adding them changes no bit) */
  fsdpc_status_t st =
      cuda_status(cudaMemsetAsync(partial, 0, pbytes, s), "cudaMemsetAsync (sum of squares)");
  for (int i0 = 0; i0 < n && st == STATUS_OK;) {
    ssq_table t;
    t.count = 0;
    int blocks = 0;
    for (; i0 < n && t.count < kSsqTable; i0++) {
      int64_t m = tensor_numel(xs[i0]);
      if (m == 0) continue;
      ssq_entry &e = t.e[t.count++];
      e.x = xs[i0]->data;
      e.n = m;
      e.first_block = blocks;
      e.dt = xs[i0]->dtype;
      e.partial = partial + (size_t)i0 * kSsqBlocks;
      int64_t nb = (m + kBlock * kSsqPerThread - 1) / (kBlock * kSsqPerThread);
      blocks += (int)(nb < kSsqBlocks ? nb : kSsqBlocks);
    }
    if (t.count == 0) break;
    sum_squares_many_kernel<<<(unsigned)blocks, kBlock, 0, s>>>(t);
    st = launched("kernel_sum_squares");
  }
  if (st == STATUS_OK) {
    sum_squares_total_kernel<<<grid_for((int64_t)n * 32), kBlock, 0, s>>>(sums, partial, n);
    st = launched("kernel_sum_squares");
  }
  if (st == STATUS_OK) st = device_memcpy(device_cpu(), out, dev, sums, sizeof(double) * n);
  device_free(dev, buf, bytes);
  return st;
}

static fsdpc_status_t cuda_sum_squares(const fsdpc_tensor_t *x, double *out) {
  return cuda_sum_squares_many(&x, 1, out);
}

void cuda_pointwise_kernels(kernel_ops_t *ops) {
  ops->silu_mul = cuda_silu_mul;
  ops->silu_mul_backward = cuda_silu_mul_backward;
  ops->activation = cuda_activation;
  ops->activation_backward = cuda_activation_backward;
  ops->bias_add = cuda_bias_add;
  ops->bias_backward = cuda_bias_backward;
  ops->add = cuda_add;
  ops->axpy = cuda_axpy;
  ops->scale = cuda_scale;
  ops->adamw = cuda_adamw;
  ops->adamw_many = cuda_adamw_many;
  ops->sum_squares = cuda_sum_squares;
  ops->sum_squares_many = cuda_sum_squares_many;
}
