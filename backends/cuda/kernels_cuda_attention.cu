/*
 * CUDA attention: cuDNN's fused flash attention where it runs the call (backends/cuda/cudnn_sdpa.h:
 * bf16/f16, head dims that are multiples of 8); otherwise, and for f32, the batched-GEMM plan
 * of core/attention_gemm_impl.h, its products on cuBLAS
 * (tensor cores for bf16/f16, F32 accumulation), its row passes as one block per score row.
 * A call whose operands are all 16-byte aligned (head dims and sequence lengths of the usual
 * multiples) is one cublasGemmBatchedEx over device pointer arrays built by a small kernel;
 * other shapes run one cublasGemmEx per entry, which checks alignment itself.
 */
#include <stdio.h>

#include "core/attention_gemm_impl.h"
#include "backends/cuda/cudnn_sdpa.h"
#include "backends/cuda/kernels_cuda.h"

/* Scratch a chunk of (batch, kv head) pairs may take, and query rows per causal block (a
 * multiple of 8, so that blocks of 16-bit scores stay 16-byte aligned). */
static const size_t kAttnScratch = (size_t)256 << 20;
static const int64_t kAttnBlockRows = 128;

typedef struct cuda_attn {
  int dev;
  cudaStream_t stream;
  cublasHandle_t blas;
} cuda_attn_t;

/* ---- kernels ---- */

/* Pointers of entry e to its A, B and C at ptrs[e], ptrs[n + e], ptrs[2 n + e]. */
__global__ static void attn_ptrs_kernel(const void **ptrs, attn_shape_t s, attn_batch_t bt,
                                        int64_t n, attn_mat_t a, attn_mat_t b, attn_mat_t c,
                                        int esa, int esb, int esc) {
  GRID_STRIDE(e, n) {
    int64_t bb, h, g;
    attn_entry(&s, &bt, e, &bb, &h, &g);
    ptrs[e] = (const char *)a.base + attn_at(&s, &a, e, bb, h, g) * esa;
    ptrs[n + e] = (const char *)b.base + attn_at(&s, &b, e, bb, h, g) * esb;
    ptrs[2 * n + e] = (const char *)c.base + attn_at(&s, &c, e, bb, h, g) * esc;
  }
}

/* One block per score row (entry e, query i in [r0, r1)): lse_i and the causal
 * probabilities of keys [0, r1). */
__global__ static void attn_probs_kernel(attn_shape_t s, attn_batch_t bt, int64_t r0, int64_t r1,
                                         const float *S, float *lse, void *p, int pdt) {
  int64_t e = blockIdx.x / (r1 - r0), i = r0 + blockIdx.x % (r1 - r0), b, h, g;
  int64_t row = e * s.T + i;
  attn_entry(&s, &bt, e, &b, &h, &g);
  const float *srow = S + row * s.T;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, srow[j]);
  m = block_reduce<true>(m);
  float l = 0;
  for (int64_t j = threadIdx.x; j <= i; j += blockDim.x) l += expf(srow[j] - m);
  l = block_reduce<false>(l);
  float L = m + logf(l);
  if (threadIdx.x == 0) lse[(b * s.H + h) * s.T + i] = L;
  for (int64_t j = threadIdx.x; j < r1; j += blockDim.x)
    stf(pdt, p, row * s.T + j, j <= i ? expf(srow[j] - L) : 0.0f);
}

/* One block per score row: P again from the forward's lse, D_i = dO_i . O_i and
 * dS = P (dP - D_i) scale. */
__global__ static void attn_dscores_kernel(attn_shape_t s, attn_batch_t bt, int64_t r0,
                                           int64_t r1, const float *S, const float *dP,
                                           const float *lse, const void *dout, const void *out,
                                           int dt, void *p, void *ds) {
  int64_t e = blockIdx.x / (r1 - r0), i = r0 + blockIdx.x % (r1 - r0), b, h, g;
  int64_t row = e * s.T + i;
  attn_entry(&s, &bt, e, &b, &h, &g);
  int64_t qi = attn_offset(&s, ATTN_HEADS, e, b, h, g) + i * s.H * s.Dh;
  float D = 0;
  for (int64_t c = threadIdx.x; c < s.Dh; c += blockDim.x)
    D += ldf(dt, dout, qi + c) * ldf(dt, out, qi + c);
  D = block_reduce<false>(D);
  float L = lse[(b * s.H + h) * s.T + i];
  const float *srow = S + row * s.T, *dprow = dP + row * s.T;
  for (int64_t j = threadIdx.x; j < r1; j += blockDim.x) {
    float pv = j <= i ? expf(srow[j] - L) : 0.0f;
    stf(dt, p, row * s.T + j, pv);
    stf(dt, ds, row * s.T + j, j <= i ? pv * (dprow[j] - D) * s.scale : 0.0f);
  }
}

/* ---- the executor ---- */

/* Whether every entry's matrix of m starts 16-byte aligned. */
static bool aligned16(const attn_shape_t *s, attn_mat_t m) {
  int64_t stride = m.layout == ATTN_SCRATCH ? s->T * s->T : s->Dh, es = dtype_size(m.dtype);
  return (uintptr_t)m.base % 16 == 0 && stride * es % 16 == 0 && m.off * es % 16 == 0;
}

static fsdpc_status_t attn_gemm_cuda(void *ctx, const attn_shape_t *s, const attn_batch_t *bt,
                                     const attn_gemm_t *g) {
  cuda_attn_t *c = (cuda_attn_t *)ctx;
  int64_t n = attn_entries(s, bt);
  if (n == 0) return STATUS_OK;
  cublasOperation_t ta = g->ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = g->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  cudaDataType_t at = cuda_dtype(g->a.dtype), bt_ = cuda_dtype(g->b.dtype),
                 ct = cuda_dtype(g->c.dtype);
  int esa = (int)dtype_size(g->a.dtype), esb = (int)dtype_size(g->b.dtype),
      esc = (int)dtype_size(g->c.dtype);
  char what[128];
  snprintf(what, sizeof what, "attention GEMM (m=%lld n=%lld k=%lld, %lld entries)",
           (long long)g->m, (long long)g->n, (long long)g->k, (long long)n);
  if (!aligned16(s, g->a) || !aligned16(s, g->b) || !aligned16(s, g->c)) {
    for (int64_t e = 0; e < n; e++) { /* one product per entry */
      int64_t b, h, kv;
      attn_entry(s, bt, e, &b, &h, &kv);
      const char *pa = (const char *)g->a.base + attn_at(s, &g->a, e, b, h, kv) * esa;
      const char *pb = (const char *)g->b.base + attn_at(s, &g->b, e, b, h, kv) * esb;
      char *pc = (char *)g->c.base + attn_at(s, &g->c, e, b, h, kv) * esc;
      FSDPC_TRY(cublas_status(
          cuda_blas_gemm(c->blas, ta, tb, (int)g->m, (int)g->n, (int)g->k, &g->alpha, pa, at,
                         (int)g->lda, pb, bt_, (int)g->ldb, &g->beta, pc, ct, (int)g->ldc),
          what));
    }
    return STATUS_OK;
  }
  device_t dev = device_cuda(c->dev);
  size_t bytes = 3 * (size_t)n * sizeof(void *);
  const void **ptrs;
  FSDPC_TRY(device_alloc(dev, bytes, (void **)&ptrs));
  attn_ptrs_kernel<<<grid_for(n), kBlock, 0, c->stream>>>(ptrs, *s, *bt, n, g->a, g->b, g->c,
                                                          esa, esb, esc);
  fsdpc_status_t st = launched("kernel_attention (operand pointers)");
  if (st == STATUS_OK)
    st = cublas_status(
        cuda_blas_gemm_batched(c->blas, ta, tb, (int)g->m, (int)g->n, (int)g->k, &g->alpha,
                               ptrs, at, (int)g->lda, ptrs + n, bt_, (int)g->ldb, &g->beta,
                               (void *const *)(ptrs + 2 * n), ct, (int)g->ldc, (int)n),
        what);
  device_free(dev, ptrs, bytes); /* stream-ordered: after the product */
  return st;
}

static int row_threads(const attn_shape_t *s) { return s->T >= 512 ? 256 : s->T >= 128 ? 128 : 64; }

static fsdpc_status_t attn_probs_cuda(void *ctx, const attn_shape_t *s, const attn_batch_t *bt,
                                      int64_t r0, int64_t r1, const float *S, float *lse,
                                      attn_mat_t p) {
  cuda_attn_t *c = (cuda_attn_t *)ctx;
  int64_t rows = attn_entries(s, bt) * (r1 - r0);
  if (rows == 0) return STATUS_OK;
  attn_probs_kernel<<<(unsigned)rows, row_threads(s), 0, c->stream>>>(*s, *bt, r0, r1, S, lse,
                                                                       p.base, p.dtype);
  return launched("kernel_attention (probabilities)");
}

static fsdpc_status_t attn_dscores_cuda(void *ctx, const attn_shape_t *s, const attn_batch_t *bt,
                                        int64_t r0, int64_t r1, const float *S, const float *dP,
                                        const float *lse, attn_mat_t dout, attn_mat_t out,
                                        attn_mat_t p, attn_mat_t ds) {
  cuda_attn_t *c = (cuda_attn_t *)ctx;
  int64_t rows = attn_entries(s, bt) * (r1 - r0);
  if (rows == 0) return STATUS_OK;
  attn_dscores_kernel<<<(unsigned)rows, row_threads(s), 0, c->stream>>>(
      *s, *bt, r0, r1, S, dP, lse, dout.base, out.base, dout.dtype, p.base, ds.base);
  return launched("kernel_attention_backward (score gradients)");
}

static fsdpc_status_t exec_for(const fsdpc_tensor_t *q, cuda_attn_t *c, attn_exec_t *x) {
  c->dev = q->device.index;
  c->stream = stream_of(q);
  FSDPC_TRY(cuda_blas_handle(c->dev, c->stream, &c->blas));
  *x = attn_exec_t{c, attn_gemm_cuda, attn_probs_cuda, attn_dscores_cuda, q->device,
                   kAttnScratch, kAttnBlockRows};
  return STATUS_OK;
}

static fsdpc_status_t cuda_attention(fsdpc_tensor_t *out, fsdpc_tensor_t *lse,
                                     const fsdpc_tensor_t *q, const fsdpc_tensor_t *k,
                                     const fsdpc_tensor_t *v) {
  cuda_attn_t c;
  attn_exec_t x;
  FSDPC_TRY(exec_for(q, &c, &x));
  attn_shape_t s = attn_shape_of(q->shape, k->shape);
  bool fused;
  FSDPC_TRY(cudnn_sdpa_forward(c.dev, c.stream, &s, q->dtype, out->data, (float *)lse->data,
                               q->data, k->data, v->data, &fused));
  if (fused) return STATUS_OK;
  return attn_gemm_forward(&x, &s, q->dtype, out->data, (float *)lse->data, q->data, k->data,
                           v->data);
}

static fsdpc_status_t cuda_attention_backward(fsdpc_tensor_t *dq, fsdpc_tensor_t *dk,
                                              fsdpc_tensor_t *dv, const fsdpc_tensor_t *dout,
                                              const fsdpc_tensor_t *q, const fsdpc_tensor_t *k,
                                              const fsdpc_tensor_t *v, const fsdpc_tensor_t *out,
                                              const fsdpc_tensor_t *lse) {
  cuda_attn_t c;
  attn_exec_t x;
  FSDPC_TRY(exec_for(q, &c, &x));
  attn_shape_t s = attn_shape_of(q->shape, k->shape);
  bool fused;
  FSDPC_TRY(cudnn_sdpa_backward(c.dev, c.stream, &s, q->dtype, dq->data, dk->data, dv->data,
                                dout->data, q->data, k->data, v->data, out->data,
                                (const float *)lse->data, &fused));
  if (fused) return STATUS_OK;
  return attn_gemm_backward(&x, &s, q->dtype, dq->data, dk->data, dv->data, dout->data, q->data,
                            k->data, v->data, out->data, (const float *)lse->data);
}

void cuda_attention_kernels(kernel_ops_t *ops) {
  ops->attention = cuda_attention;
  ops->attention_backward = cuda_attention_backward;
}
